//! Atomic batches (`nats.atomic_transactions`): each Postgres transaction is published as one
//! JetStream atomic batch (ADR-50, nats-server 2.12+, stream `allow_atomic`), so the stream holds a
//! transaction's events all together or not at all, and a consumer never sees part of one.
//!
//! Wire form: every message carries `Nats-Batch-Id` and `Nats-Batch-Sequence` (1, 2, …); the first
//! one also `Nats-Expected-Last-Sequence` (the only place a batch may carry it, checked against the
//! stream before the batch when the batch commits); the last one `Nats-Batch-Commit: 1`. Members are
//! core publishes without a reply subject (no per-message ack for nats-server to send, which is most
//! of its cost per message); only the commit is a JetStream publish, whose single ack settles the
//! whole batch, in order: the commit carries its members in the sink's window. Since the last event of a transaction is only known
//! at its Commit, the sink holds each event back until the next one (or the Commit) arrives.
//!
//! A batch cannot carry `Nats-Msg-Id`, so the event id goes into `Outbox-Event-Id`, and the fence
//! (required: settings refuse `atomic_transactions` without it) is what keeps every event stored
//! once: a session resumes behind the stream's tail, and a batch sent after a gap is refused whole.
//!
//! Limits: a batch holds at most [`MAX_BATCH`] messages (the server's default), and the open batch
//! can never hold more of the in-flight window than exists (its members are only acknowledged by its
//! commit, so waiting for window room it holds itself would deadlock). A transaction past either
//! limit is split into several batches, committed in order: nothing is lost and nothing is
//! reordered, but atomicity then holds per batch, not per transaction (a warn line per split). A
//! session
//! that ends with a batch open (crash, lost connection) leaves it uncommitted: the server abandons it
//! after 10 s without storing any of it, and the next session publishes the transaction again.

use async_nats::HeaderMap;
use async_nats::header::{
    HeaderValue, NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL, NATS_BATCH_ID, NATS_BATCH_SEQUENCE,
};
use async_nats::jetstream::context::PublishErrorKind;
use tracing::warn;

use super::{InFlight, Outcome, Pending, Sent, Sink, SinkError, approx_size};
use crate::message::{self, IdHeader, Outgoing, Shrink};
use crate::outbox::OutboxEvent;

/// nats-server's default limit of messages in one atomic batch.
pub(super) const MAX_BATCH: usize = 1000;

/// Batches in flight (opened, commit not yet acknowledged) at most. nats-server allows 50 per
/// stream by default; past that it drops a new batch without an answer, which the relay would only
/// see as an ack timeout. Some room is left below the limit.
pub(super) const MAX_BATCHES_IN_FLIGHT: usize = 40;

/// The batch being built.
struct Open {
    id: String,
    /// Messages sent in it so far.
    sent: usize,
    /// Their window bytes.
    bytes: usize,
    /// Its members sent so far (core publishes, no ack of their own): they go with the commit.
    members: Vec<InFlight>,
}

/// The last event, not sent yet: it becomes the commit if the transaction ends here.
struct Held {
    item: InFlight,
    out: Outgoing,
    size: usize,
}

/// State of the atomic-batch path; see the module docs.
pub(super) struct Batcher {
    /// The server's `max_payload`.
    max_payload: usize,
    /// The stream's `max_msg_size`, if it has one: a batch holding a larger message would be refused
    /// whole, every time it is sent, so such a message is dead-lettered before it joins a batch.
    max_msg_size: Option<usize>,
    /// Batches opened and not yet settled (at most [`MAX_BATCHES_IN_FLIGHT`]).
    pub(crate) in_flight: usize,
    /// Unique per session, so a batch id never repeats (the server keys open batches by it).
    prefix: String,
    next: u64,
    open: Option<Open>,
    held: Option<Held>,
    /// Transactions split into several batches so far. Nothing reads it (no metric): the warn line
    /// each split logs is what reports it.
    pub(crate) splits: u64,
}

impl Batcher {
    pub(super) fn new(max_payload: usize, max_msg_size: Option<usize>) -> Self {
        Batcher {
            max_payload,
            max_msg_size,
            in_flight: 0,
            prefix: format!(
                "or{:x}-{:x}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos())
            ),
            next: 0,
            open: None,
            held: None,
            splits: 0,
        }
    }
}

/// The serialized size of a message as nats-server counts it against `max_payload` and the
/// stream's `max_msg_size` (the header block and the payload).
pub(super) fn wire_size(h: &HeaderMap, payload: usize) -> usize {
    let mut n = "NATS/1.0\r\n\r\n".len() + payload;
    for (k, vs) in h.iter() {
        for v in vs {
            n += AsRef::<[u8]>::as_ref(k).len() + 2 + v.as_str().len() + 2;
        }
    }
    n
}

/// Room for the batch headers the sink adds to each message.
const BATCH_HEADER_ROOM: usize = 160;

impl Sink {
    /// [`Sink::submit`] with `atomic`: the event is held back; the one held before it goes out as
    /// a batch member (or closes the batch when a limit is reached).
    pub(super) async fn submit_batched(
        &mut self,
        seq: u64,
        event: Box<OutboxEvent>,
    ) -> Result<(), SinkError> {
        let size = approx_size(&event).min(self.config.max_in_flight_bytes);
        if let Some(held) = self.batcher()?.held.take() {
            let (sent, bytes) = self
                .batcher()?
                .open
                .as_ref()
                .map_or((0, 0), |o| (o.sent, o.bytes));
            // Members wait for the commit's ack: the open batch (its members, the held one and the
            // new one) must fit the window, or waiting for room would wait for itself.
            let limit = self.config.max_batch.min(self.config.max_in_flight).max(1);
            let split =
                sent + 2 > limit || bytes + held.size + size > self.config.max_in_flight_bytes;
            if split {
                let b = self.batcher()?;
                b.splits += 1;
                warn!(
                    lsn = %held.item.event.commit_lsn,
                    messages = sent + 1,
                    "transaction larger than one atomic batch: committing it in parts (each part atomic)"
                );
            }
            self.send_held(held, split).await?;
        }
        let size = self.reserve(size).await?;
        let (mut out, sent) = self.batch_message(&event)?;
        let mut event = event;
        let span = match &self.config.telemetry {
            None => None,
            Some(t) => t.begin(&mut event, &mut out),
        };
        // Batch messages carry no `Nats-Msg-Id`, and the server refuses an id expectation inside
        // a batch: the chain is by sequence only, one expectation per batch (its first message).
        let expected = self.fence.as_mut().map(super::Fence::next_sequence);
        self.batcher()?.held = Some(Held {
            item: InFlight {
                seq,
                ack: 0,
                event,
                subject: String::new(),
                sent,
                expected,
                expected_id: None,
                size,
                members: None,
                span,
            },
            out,
            size,
        });
        Ok(())
    }

    /// The transaction ended: the held event commits the batch.
    pub(crate) async fn commit(&mut self) -> Result<(), SinkError> {
        let Some(b) = self.batch.as_mut() else {
            return Ok(());
        };
        match b.held.take() {
            Some(held) => self.send_held(held, true).await,
            None => Ok(()),
        }
    }

    /// Messages handed to the sink whose batch is not committed yet: they will not be acknowledged
    /// unless their transaction's Commit arrives.
    pub(crate) fn uncommitted(&self) -> usize {
        self.batch.as_ref().map_or(0, |b| {
            b.open.as_ref().map_or(0, |o| o.sent) + usize::from(b.held.is_some())
        })
    }

    /// The batcher; only called on the atomic path, which exists only with one.
    fn batcher(&mut self) -> Result<&mut Batcher, SinkError> {
        self.batch.as_mut().ok_or(SinkError::NotAtomic)
    }

    /// The message for `event` in a batch (event id in `Outbox-Event-Id`), or its dead letter
    /// (`outbox.on_invalid`), shrunk to fit the server's `max_payload` and the stream's
    /// `max_msg_size`: members are core publishes, which the client does not check (an oversize one
    /// would make the server close the connection), and one message over the stream's limit makes
    /// the server refuse the whole batch.
    fn batch_message(&self, event: &OutboxEvent) -> Result<(Outgoing, Sent), SinkError> {
        let c = &self.config;
        let out = message::build_as(
            event,
            &c.template,
            &c.dead_letter_subject,
            c.cloudevents.as_ref(),
            IdHeader::EventId,
            c.descriptive,
        );
        let b = self.batch.as_ref();
        let server = b.map_or(usize::MAX, |b| b.max_payload);
        let (limit, what) = match b.and_then(|b| b.max_msg_size) {
            Some(stream) if stream < server => (stream, "the stream's max_msg_size"),
            _ => (server, "the server's max_payload"),
        };
        let max = limit.saturating_sub(BATCH_HEADER_ROOM);
        let (mut reason, subject) = match &out.dead_letter {
            Some(reason) => {
                c.on_invalid(event, reason)?;
                if wire_size(&out.headers, out.payload.len()) <= max {
                    let sent = Sent::DeadLetter {
                        reason: reason.clone(),
                        shrink: Shrink::Keep,
                    };
                    return Ok((out, sent));
                }
                let subject = out
                    .headers
                    .get(message::SUBJECT)
                    .map(|v| v.as_str().to_owned());
                (reason.clone(), subject)
            }
            None => {
                if wire_size(&out.headers, out.payload.len()) <= max {
                    return Ok((out, Sent::Event));
                }
                let reason = format!("message too large for {what} of {limit} bytes");
                c.on_invalid(event, &reason)?;
                (reason, Some(out.subject))
            }
        };
        for shrink in Shrink::Keep.below() {
            let dl = message::dead_letter_as(
                event,
                &c.dead_letter_subject,
                &reason,
                subject.as_deref(),
                shrink,
                IdHeader::EventId,
            );
            if wire_size(&dl.headers, dl.payload.len()) <= max {
                return Ok((dl, Sent::DeadLetter { reason, shrink }));
            }
        }
        reason.push_str(" (even its minimal dead letter)");
        Err(SinkError::DeadLetterRefused {
            id: event.msg_id.clone(),
            lsn: event.commit_lsn,
            reason,
            refusal: format!("larger than {what} of {limit} bytes"),
        })
    }

    /// Sends the held event as the next message of the open batch (opening one if needed), as its
    /// commit when `commit`.
    async fn send_held(&mut self, held: Held, commit: bool) -> Result<(), SinkError> {
        let Held {
            mut item,
            out,
            size,
        } = held;
        if self.batcher()?.open.is_none() {
            // nats-server drops a batch past its limit of open batches without an answer: wait
            // for the oldest ones to settle first.
            while self.batcher()?.in_flight >= MAX_BATCHES_IN_FLIGHT {
                self.settle_oldest().await?;
            }
            let b = self.batcher()?;
            b.in_flight += 1;
            b.next += 1;
            b.open = Some(Open {
                id: format!("{}-{}", b.prefix, b.next),
                sent: 0,
                bytes: 0,
                members: Vec::new(),
            });
        }
        let b = self.batch.as_mut().ok_or(SinkError::NotAtomic)?;
        let Some(open) = b.open.as_mut() else {
            return Err(SinkError::NotAtomic);
        };
        open.sent += 1;
        open.bytes += size;
        let mut headers = out.headers;
        headers.insert(NATS_BATCH_ID, HeaderValue::from(open.id.clone()));
        headers.insert(
            NATS_BATCH_SEQUENCE,
            HeaderValue::from(itoa::Buffer::new().format(open.sent)),
        );
        if open.sent == 1
            && let Some(e) = item.expected
        {
            headers.insert(
                message::EXPECTED_LAST_SEQUENCE,
                HeaderValue::from(itoa::Buffer::new().format(e)),
            );
        }
        message::stamp_position(&mut headers, &item.event, self.config.history.as_deref());
        if commit {
            let members = b.open.take().map(|o| o.members).unwrap_or_default();
            headers.insert(NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL);
            item.ack = self
                .publisher
                .send(out.subject, headers, out.payload)
                .await
                .map_err(|source| SinkError::Publish {
                    id: item.event.msg_id.clone(),
                    source,
                })?;
            item.members = Some(members);
            self.window.push_back(Pending::Sent(item));
        } else {
            // Bounded like every other publish: the client's queue to the connection is bounded,
            // and a connection that does not drain must end the session, not wedge it.
            self.publisher
                .send_member(out.subject, headers, out.payload)
                .await
                .map_err(|source| SinkError::CorePublish {
                    id: item.event.msg_id.clone(),
                    source,
                })?;
            if let Some(open) = self.batch.as_mut().and_then(|b| b.open.as_mut()) {
                open.members.push(item);
            }
        }
        Ok(())
    }
}

/// The outcome of a message of a committed batch.
pub(super) fn outcome(sent: &Sent) -> Outcome {
    match sent {
        Sent::DeadLetter { reason, .. } => Outcome::DeadLetter {
            reason: reason.clone(),
        },
        Sent::Event => Outcome::Stored { duplicate: false },
    }
}

/// Whether a failed batch commit is the fence refusing it (a gap before the batch).
pub(super) fn fence_refused(e: &async_nats::jetstream::context::PublishError) -> bool {
    e.kind() == PublishErrorKind::WrongLastSequence
}
