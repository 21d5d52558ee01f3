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
use crate::parking::ParkedSet;
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
#[allow(clippy::too_many_arguments)]
pub(super) async fn send_event(
    publisher: &mut Publisher,
    config: &SinkConfig,
    parked: &mut ParkedSet,
    fence: Option<&mut Fence>,
    seq: u64,
    mut event: Box<OutboxEvent>,
    size: usize,
) -> Result<InFlight, SinkError> {
    let built = envelope(config, parked, &mut event)?;
    send_envelope(publisher, config, parked, fence, seq, event, size, built).await
}

/// Sends the release marker `marker` as message `seq` (its synthetic `event` carries its position
/// and id), stamped and fenced like any message.
#[allow(clippy::too_many_arguments)]
pub(super) async fn send_marker(
    publisher: &mut Publisher,
    config: &SinkConfig,
    parked: &mut ParkedSet,
    fence: Option<&mut Fence>,
    seq: u64,
    event: Box<OutboxEvent>,
    size: usize,
    marker: Sent,
) -> Result<InFlight, SinkError> {
    let built = Envelope {
        out: form(config, &event, &marker, None),
        sent: marker,
        subject: String::new(),
        span: None,
    };
    send_envelope(publisher, config, parked, fence, seq, event, size, built).await
}

/// Sends what [`envelope`] (or [`send_marker`]) built for `event`.
#[allow(clippy::too_many_arguments)]
async fn send_envelope(
    publisher: &mut Publisher,
    config: &SinkConfig,
    parked: &mut ParkedSet,
    mut fence: Option<&mut Fence>,
    seq: u64,
    event: Box<OutboxEvent>,
    size: usize,
    built: Envelope,
) -> Result<InFlight, SinkError> {
    let Envelope {
        out,
        sent,
        subject,
        span,
    } = built;
    let (expected, expected_id) = match fence.as_deref_mut() {
        Some(f) => {
            let e = f.next_expected(&sent.wire_id(&event.msg_id));
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
            let (ack, instead) = send_in_place(
                publisher, config, parked, &event, sent, &subject, why, expecting,
            )
            .await?;
            if let Some(f) = fence {
                // What went in its place has an id of its own: the next message chains to it.
                f.rechain(&instead.wire_id(&event.msg_id));
            }
            (ack, instead)
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
fn envelope(
    config: &SinkConfig,
    parked: &mut ParkedSet,
    event: &mut OutboxEvent,
) -> Result<Envelope, SinkError> {
    let mut out = message::build_as(
        event,
        &config.template,
        &config.dead_letter_subject,
        config.cloudevents.as_ref(),
        message::IdHeader::MsgId,
        config.descriptive,
    );
    let span = begin_span(config, event, &mut out);
    let sent = destination::choose(config, parked, event, out.dead_letter.as_deref())?;
    // The subject it was routed to, which a dead letter names in `Outbox-Subject`: kept for
    // dead letters only; a routed event's is rendered again if it is ever refused (rare), so
    // the hot path moves its subject into the publish instead of copying it.
    let subject = match (&sent, out.dead_letter.is_some()) {
        (Sent::Event, _) => String::new(),
        (_, true) => out
            .headers
            .get(message::SUBJECT)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default(),
        (_, false) => out.subject.clone(),
    };
    if let Sent::Parked(p) = &sent {
        // A parked copy: the event's own headers as its dead letter would carry them, on the
        // key's parking subject.
        let routed = Some(subject.as_str()).filter(|s| !s.is_empty());
        out = message::parked::parked_copy(event, &p.run(), routed, Shrink::Keep);
    }
    own_id(&mut out, event, &sent);
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
#[allow(clippy::too_many_arguments)]
async fn send_in_place(
    publisher: &mut Publisher,
    config: &SinkConfig,
    parked: &mut ParkedSet,
    event: &OutboxEvent,
    sent: Sent,
    subject: &str,
    too_large: String,
    expecting: (Option<u64>, Option<&str>),
) -> Result<(u64, Sent), SinkError> {
    let routed = routed_subject(config, event, &sent, subject.to_owned());
    // From the top of the ladder: the message as it was is what did not fit.
    let instead =
        destination::refused(config, parked, event, &sent, too_large)?.shrunk(Shrink::Keep);
    send_dead_letter(
        publisher,
        config,
        event,
        Some(&routed).filter(|s| !s.is_empty()).map(String::as_str),
        &instead,
        expecting,
    )
    .await
}

/// The stream refused `item` for good (`refusal`): its dead letter, or a smaller dead letter than
/// before, goes in its place with the same expectations. Returns the token its answer comes under.
pub(super) async fn send_refused(
    publisher: &mut Publisher,
    config: &SinkConfig,
    parked: &mut ParkedSet,
    item: &mut InFlight,
    refusal: String,
) -> Result<u64, SinkError> {
    let reason = format!("the stream refused the message: {refusal}");
    let instead = destination::refused(config, parked, &item.event, &item.sent, reason)?;
    if matches!(item.sent, Sent::Event) {
        // The hot path keeps no copy of a routed event's subject: render it again.
        item.subject = routed_subject(
            config,
            &item.event,
            &item.sent,
            std::mem::take(&mut item.subject),
        );
    }
    let (ack, sent) = send_dead_letter(
        publisher,
        config,
        &item.event,
        (!item.subject.is_empty()).then_some(item.subject.as_str()),
        &instead,
        (item.expected, item.expected_id.as_deref()),
    )
    .await?;
    item.sent = sent;
    Ok(ack)
}

/// Sends `item` again as it was last sent (event or dead letter), with its current expectation.
/// Returns the token its answer comes under.
pub(super) async fn resend(
    publisher: &mut Publisher,
    config: &SinkConfig,
    parked: &mut ParkedSet,
    item: &mut InFlight,
) -> Result<u64, SinkError> {
    if let Some(instead) = destination::again(config, parked, &item.event, &item.sent) {
        // Its key was parked behind a refused event ahead of it since it was first sent.
        item.subject = routed_subject(config, &item.event, &item.sent, String::new());
        item.sent = instead;
    }
    let subject = (!item.subject.is_empty()).then_some(item.subject.as_str());
    let out = form(config, &item.event, &item.sent, subject);
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
            let out = message::build(event, &config.template, &config.dead_letter_subject, None);
            // An event with a problem renders to its dead letter: no subject of its own then.
            match out.dead_letter {
                None => out.subject,
                Some(_) => out
                    .headers
                    .get(message::SUBJECT)
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default(),
            }
        }
        Sent::DeadLetter { .. } | Sent::Parked(_) | Sent::Marker(_) => known,
    }
}

/// The message `sent` says goes out for `event`: the routed event, its dead letter or its parked
/// copy, as far down the shrink ladder as `sent` went; `subject`: the one it would have had.
pub(super) fn form(
    config: &SinkConfig,
    event: &OutboxEvent,
    sent: &Sent,
    subject: Option<&str>,
) -> Outgoing {
    match sent {
        Sent::Event => message::build_as(
            event,
            &config.template,
            &config.dead_letter_subject,
            config.cloudevents.as_ref(),
            message::IdHeader::MsgId,
            config.descriptive,
        ),
        Sent::DeadLetter { reason, shrink, .. } => {
            let mut out =
                message::dead_letter(event, &config.dead_letter_subject, reason, subject, *shrink);
            own_id(&mut out, event, sent);
            out
        }
        Sent::Parked(p) => message::parked::parked_copy(event, &p.run(), subject, p.shrink),
        Sent::Marker(m) => message::parked::release_marker(
            &m.subject,
            &m.request,
            m.release,
            event.aggregate_type.as_deref(),
            event.aggregate_id.as_deref(),
        ),
    }
}

/// The dead letter of a requeued dead letter still invalid gets its own id,
/// `dead-letter:<id>:<request>` (the first dead letter holds `dead-letter:<id>`, and JetStream would
/// drop the new one as its duplicate); every other message keeps the id it was built with.
fn own_id(out: &mut Outgoing, event: &OutboxEvent, sent: &Sent) {
    if let Sent::DeadLetter {
        requeue: Some(_), ..
    } = sent
    {
        out.headers.insert(
            message::NATS_MSG_ID,
            async_nats::HeaderValue::from(sent.wire_id(&event.msg_id).as_ref()),
        );
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

/// Queues the dead letter or parked copy of `event` that `instead` says (it takes the refused
/// message's place in the sequence, with the refused message's `expected` sequence and id), at
/// the first step of the shrink ladder below `instead`'s that fits the stream's `max_msg_size`
/// (when known) and that the client accepts: the payload goes first, its size is what usually
/// cannot be published. Returns its token and what was sent.
pub(super) async fn send_dead_letter(
    publisher: &mut Publisher,
    config: &SinkConfig,
    event: &OutboxEvent,
    subject: Option<&str>,
    instead: &Sent,
    (expected, expected_id): (Option<u64>, Option<&str>),
) -> Result<(u64, Sent), SinkError> {
    let mut last = None;
    let reason = instead.reason().unwrap_or_default();
    for shrink in instead.shrink().below() {
        let sent = instead.clone().shrunk(shrink);
        let dl = form(config, event, &sent, subject);
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
            Ok(ack) => return Ok((ack, sent)),
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
