//! The envelope: what goes on the wire for one event, and the dead-letter ladder. On the
//! single-message path [`send_event`] is the one entry point: it builds the routed message (or,
//! when the event cannot be published as it is, its dead letter: `destination.rs` decides), stamps
//! it with its position and the fence's expectations ([`stamped`]), and sends it; a message too
//! large for the stream or the server (measured as the server counts it, [`wire_size`]) goes as its
//! dead letter, in its place, shrunk until it fits ([`send_dead_letter`]). The ladder is the same
//! one a message the stream refused later goes down ([`send_refused`], when `settle.rs` decides
//! so); atomic batches measure their members with the same [`wire_size`] in `batch/fit.rs`.
//!
//! Functions over the parts they use (the publisher, the settings, the fence), not methods of the
//! sink: each signature says what it may touch.

use async_nats::HeaderMap;

use super::config::SinkConfig;
use super::destination::{self, Sent};
use super::error::SinkError;
use super::fence::Fence;
use super::publish::Publisher;
use super::window::InFlight;
use crate::event::OutboxEvent;
use crate::message::{self, Outgoing, Shrink};
use crate::nats::NatsErrorKind;
use crate::telemetry::Started;

/// An event's message before it is stamped, and what the window keeps of it.
struct Envelope {
    /// The routed message, or the event's dead letter.
    out: Outgoing,
    /// Which of the two.
    sent: Sent,
    /// The subject a dead letter names in `Outbox-Subject` ("" for a routed event).
    subject: String,
    /// Its trace span, when the event's `traceparent` is sampled.
    span: Option<Box<Started>>,
}

/// A message sent, or too large to send (why); nothing was sent then.
enum Fitted {
    Sent(u64),
    TooLarge(String),
}

/// Sends `event`, submitted as `seq` and taking `size` bytes of the window: its message, stamped
/// with the fence's next expectations, or its dead letter in its place. Returns it as the window
/// holds it until its ack.
pub(super) async fn send_event(
    publisher: &mut Publisher,
    config: &SinkConfig,
    fence: Option<&mut Fence>,
    seq: u64,
    mut event: Box<OutboxEvent>,
    size: usize,
) -> Result<InFlight, SinkError> {
    let Envelope {
        out,
        sent,
        subject,
        span,
    } = envelope(config, &mut event)?;
    let (expected, expected_id) = match fence {
        Some(f) => {
            let e = f.next_expected(&event.msg_id);
            (Some(e.seq), e.id)
        }
        None => (None, None),
    };
    let (target, headers, payload) = stamped(
        out,
        &event,
        expected,
        expected_id.as_deref(),
        config.history.as_deref(),
    );
    let fitted = send_fitting(publisher, config, &event, target, headers, payload).await?;
    let (ack, sent) = match fitted {
        Fitted::Sent(ack) => (ack, sent),
        Fitted::TooLarge(why) => {
            let expecting = (expected, expected_id.as_deref());
            send_in_place(publisher, config, &event, sent, &subject, why, expecting).await?
        }
    };
    Ok(InFlight {
        seq,
        ack,
        event,
        subject,
        sent,
        expected,
        expected_id,
        size,
        members: None,
        span,
    })
}

/// The routed message for `event` (or its dead letter, where `destination.rs` decides), its trace
/// span when it is sampled, what was sent, and the subject a dead letter names.
fn envelope(config: &SinkConfig, event: &mut OutboxEvent) -> Result<Envelope, SinkError> {
    let mut out = message::build_as(
        event,
        &config.template,
        &config.dead_letter_subject,
        config.cloudevents.as_ref(),
        message::IdHeader::MsgId,
        config.descriptive,
    );
    let span = begin_span(config, event, &mut out);
    let sent = destination::choose(config, event, out.dead_letter.as_deref())?;
    // The subject it was routed to, which a dead letter names in `Outbox-Subject`: kept for
    // dead letters only; a routed event's is rendered again if it is ever refused (rare), so
    // the hot path moves its subject into the publish instead of copying it.
    let subject = match &sent {
        Sent::Event => String::new(),
        Sent::DeadLetter { .. } => out
            .headers
            .get(message::SUBJECT)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default(),
    };
    Ok(Envelope {
        out,
        sent,
        subject,
        span,
    })
}

/// Sends the stamped message for `event`, unless it is too large: then [`Fitted::TooLarge`], and
/// nothing was sent.
async fn send_fitting(
    publisher: &mut Publisher,
    config: &SinkConfig,
    event: &OutboxEvent,
    target: String,
    headers: HeaderMap,
    payload: bytes::Bytes,
) -> Result<Fitted, SinkError> {
    // Too large for the stream (checked here, so its dead letter keeps its place) or, as
    // async-nats checks before sending, for the server's max_payload (an oversize publish
    // would make the server close the connection).
    let too_large = config.max_msg_size.and_then(|max| {
        let size = wire_size(&headers, payload.len());
        (size > max).then(|| {
            format!(
                "refused by the stream's max_msg_size of {max} bytes: the message is {size} bytes"
            )
        })
    });
    if let Some(reason) = too_large {
        return Ok(Fitted::TooLarge(reason));
    }
    match publisher.send(target, headers, payload).await {
        Ok(ack) => Ok(Fitted::Sent(ack)),
        Err(e) if e.kind() == NatsErrorKind::TooLarge => Ok(Fitted::TooLarge(
            "message too large for the server's max_payload".to_owned(),
        )),
        Err(source) => Err(SinkError::Publish {
            id: event.msg_id.clone(),
            source,
        }),
    }
}

/// `event`'s message, `sent`, was too large (`too_large` says why): its dead letter goes in its
/// place, with the same expectations, down the shrink ladder.
async fn send_in_place(
    publisher: &mut Publisher,
    config: &SinkConfig,
    event: &OutboxEvent,
    sent: Sent,
    subject: &str,
    too_large: String,
    expecting: (Option<u64>, Option<&str>),
) -> Result<(u64, Sent), SinkError> {
    let routed = routed_subject(config, event, &sent, subject.to_owned());
    let (reason, _) = destination::refused(config, event, &sent, too_large)?;
    let (ack, shrink) = send_dead_letter(
        publisher,
        config,
        event,
        Some(&routed).filter(|s| !s.is_empty()).map(String::as_str),
        &reason,
        expecting,
        Shrink::Keep,
    )
    .await?;
    Ok((ack, Sent::DeadLetter { reason, shrink }))
}

/// The stream refused `item` for good (`refusal`): its dead letter, or a smaller dead letter than
/// before, goes in its place with the same expectations. Returns the token its answer comes under.
pub(super) async fn send_refused(
    publisher: &mut Publisher,
    config: &SinkConfig,
    item: &mut InFlight,
    refusal: String,
) -> Result<u64, SinkError> {
    let reason = format!("the stream refused the message: {refusal}");
    let (reason, from) = destination::refused(config, &item.event, &item.sent, reason)?;
    if matches!(item.sent, Sent::Event) {
        // The hot path keeps no copy of a routed event's subject: render it again.
        item.subject = routed_subject(
            config,
            &item.event,
            &item.sent,
            std::mem::take(&mut item.subject),
        );
    }
    let (ack, shrink) = send_dead_letter(
        publisher,
        config,
        &item.event,
        (!item.subject.is_empty()).then_some(item.subject.as_str()),
        &reason,
        (item.expected, item.expected_id.as_deref()),
        from,
    )
    .await?;
    item.sent = Sent::DeadLetter { reason, shrink };
    Ok(ack)
}

/// Sends `item` again as it was last sent (event or dead letter), with its current expectation.
/// Returns the token its answer comes under.
pub(super) async fn resend(
    publisher: &mut Publisher,
    config: &SinkConfig,
    item: &InFlight,
) -> Result<u64, SinkError> {
    let out = match &item.sent {
        Sent::Event => message::build_as(
            &item.event,
            &config.template,
            &config.dead_letter_subject,
            config.cloudevents.as_ref(),
            message::IdHeader::MsgId,
            config.descriptive,
        ),
        Sent::DeadLetter { reason, shrink } => message::dead_letter(
            &item.event,
            &config.dead_letter_subject,
            reason,
            (!item.subject.is_empty()).then_some(item.subject.as_str()),
            *shrink,
        ),
    };
    let (target, headers, payload) = stamped(
        out,
        &item.event,
        item.expected,
        item.expected_id.as_deref(),
        config.history.as_deref(),
    );
    publisher
        .send(target, headers, payload)
        .await
        .map_err(|source| SinkError::Publish {
            id: item.event.msg_id.clone(),
            source,
        })
}

/// The subject an event was routed to: `known` for a dead letter, rendered again for an event
/// (the hot path does not keep a copy).
pub(super) fn routed_subject(
    config: &SinkConfig,
    event: &OutboxEvent,
    sent: &Sent,
    known: String,
) -> String {
    match sent {
        Sent::Event => {
            message::build(event, &config.template, &config.dead_letter_subject, None).subject
        }
        Sent::DeadLetter { .. } => known,
    }
}

/// A publish (subject, headers, payload) of `event`, with its `Outbox-Position` (in `history`, when
/// the session knows it) and, when the stream is fenced, `Nats-Expected-Last-Sequence` and (after
/// a session's first message) `Nats-Expected-Last-Msg-Id`.
pub(super) fn stamped(
    out: Outgoing,
    event: &OutboxEvent,
    expected: Option<u64>,
    expected_id: Option<&str>,
    history: Option<&str>,
) -> (String, async_nats::HeaderMap, bytes::Bytes) {
    let mut headers = out.headers;
    message::stamp_position(&mut headers, event, history);
    if let Some(e) = expected {
        headers.insert(
            message::EXPECTED_LAST_SEQUENCE,
            async_nats::HeaderValue::from(itoa::Buffer::new().format(e)),
        );
        if let Some(id) = expected_id {
            headers.insert(
                message::EXPECTED_LAST_MSG_ID,
                async_nats::HeaderValue::from(id),
            );
        }
    }
    (out.subject, headers, out.payload)
}

/// Queues the dead letter of `event` (it takes the refused message's place in the sequence and in
/// the chain of ids: it carries the event's `Nats-Msg-Id` and the refused message's `expected`
/// sequence and id), at the first step of the shrink ladder below `from` that fits the stream's
/// `max_msg_size` (when known) and that the client accepts: the payload goes first, its size is
/// what usually cannot be published.
pub(super) async fn send_dead_letter(
    publisher: &mut Publisher,
    config: &SinkConfig,
    event: &OutboxEvent,
    subject: Option<&str>,
    reason: &str,
    (expected, expected_id): (Option<u64>, Option<&str>),
    from: Shrink,
) -> Result<(u64, Shrink), SinkError> {
    let mut last = None;
    for shrink in from.below() {
        let dl = message::dead_letter(event, &config.dead_letter_subject, reason, subject, shrink);
        let (target, headers, payload) =
            stamped(dl, event, expected, expected_id, config.history.as_deref());
        if let Some(max) = config.max_msg_size
            && wire_size(&headers, payload.len()) > max
        {
            last = Some(format!(
                "larger than the stream's max_msg_size of {max} bytes"
            ));
            continue;
        }
        match publisher.send(target, headers, payload).await {
            Ok(ack) => return Ok((ack, shrink)),
            Err(e) if e.kind() == NatsErrorKind::TooLarge => {
                last = Some(crate::error_chain::error_chain(&e))
            }
            Err(source) => {
                return Err(SinkError::Publish {
                    id: event.msg_id.clone(),
                    source,
                });
            }
        }
    }
    Err(SinkError::DeadLetterRefused {
        id: event.msg_id.clone(),
        lsn: event.commit_lsn,
        reason: reason.to_owned(),
        refusal: last.unwrap_or_default(),
    })
}

/// The serialized size of a message as nats-server counts it against `max_payload` and the
/// stream's `max_msg_size`, and as async-nats checks it before sending: the header block
/// (`NATS/1.0\r\n`, each `name: value\r\n`, `\r\n`) and the payload.
pub(super) fn wire_size(h: &HeaderMap, payload: usize) -> usize {
    let mut n = "NATS/1.0\r\n\r\n".len() + payload;
    for (k, vs) in h.iter() {
        for v in vs {
            n += AsRef::<[u8]>::as_ref(k).len() + 2 + v.as_str().len() + 2;
        }
    }
    n
}

/// The trace span of `event`'s message `out`, when tracing is on and the event carries a sampled
/// `traceparent` (the span's context then replaces it in `out`'s headers): one call for single
/// messages and batch members alike.
pub(super) fn begin_span(
    config: &SinkConfig,
    event: &mut OutboxEvent,
    out: &mut Outgoing,
) -> Option<Box<Started>> {
    config.telemetry.as_ref()?.begin(
        &mut event.headers,
        event.commit_ts,
        &mut out.headers,
        &out.subject,
    )
}
