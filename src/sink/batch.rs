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
//! Size: one message over the stream's `max_msg_size` makes the server refuse the whole batch, on
//! every session, and one over the server's `max_payload` is refused by the client. So each message
//! is measured as it is sent, every header stamped (the batch headers and `Outbox-Position` take
//! about 200 bytes), against the smaller of the two (and its header block against JetStream's
//! 65,535 bytes, 10097), and one that does not fit goes out as its dead
//! letter, shrunk until it fits, in its place in the batch (`batch/fit.rs`); a client refusal all the same
//! (a server with a smaller `max_payload`) steps down the same ladder. A batch refused for its size
//! all the same (the stream's limit lowered during the session) ends the session once: the next
//! one reads the new limit.
//!
//! Limits: a batch holds at most [`MAX_BATCH`] messages (the server's default), and the open batch
//! can never hold more of the in-flight window than exists (its members are only acknowledged by its
//! commit, so waiting for window room it holds itself would deadlock). A transaction past either
//! limit is split into several batches, committed in order: nothing is lost and nothing is
//! reordered, but atomicity then holds per batch, not per transaction (a warn line per split). A
//! session
//! that ends with a batch open (crash, lost connection) leaves it uncommitted: the server abandons it
//! after 10 s without storing any of it, and the next session publishes the transaction again.

use async_nats::jetstream::context::PublishErrorKind;
use tracing::warn;

mod fit;

use fit::{Limit, Membership, Stamped, fit, smaller};

use super::envelope::Sent;
use super::window::{InFlight, Pending, approx_size};
use super::{Outcome, Sink, SinkError};
use crate::event::OutboxEvent;
use crate::message::{self, IdHeader, Outgoing, Shrink};

/// nats-server's default limit of messages in one atomic batch.
pub(super) const MAX_BATCH: usize = 1000;

/// Batches in flight (opened, commit not yet acknowledged) at most: one. A batch cannot carry
/// `Nats-Msg-Id` nor an id expectation, so batches are chained by sequence only; with two in flight,
/// a batch refused because another writer (or a late publish of an ended session) took its
/// sequences would have the next one stored past it, exactly when that writer took as many
/// sequences as the refused batch held (P4; found by the simulation, seed 177). So the next batch
/// is opened only once the stream stored the one before it. It costs one round trip and about
/// 80 µs of the relay's CPU per batch, with no throughput loss measurable beside nats-server's
/// ~3 ms of CPU per batch (docs/performance.md). nats-server's own limit of 50 open batches per
/// stream is never near.
pub(super) const MAX_BATCHES_IN_FLIGHT: usize = 1;

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
pub(super) struct Held {
    item: InFlight,
    out: Outgoing,
    pub(super) size: usize,
}

/// State of the atomic-batch path; see the module docs.
pub(super) struct Batcher {
    /// The server's `max_payload`.
    max_payload: usize,
    /// The stream's `max_msg_size`, if it has one: a batch holding a larger message would be refused
    /// whole, every time it is sent, so such a message is dead-lettered before it joins a batch.
    max_msg_size: Option<usize>,
    /// Batches committed and not yet settled (at most [`MAX_BATCHES_IN_FLIGHT`]).
    pub(crate) in_flight: usize,
    /// Unique per session, so a batch id never repeats (the server keys open batches by it).
    prefix: String,
    next: u64,
    open: Option<Open>,
    pub(super) held: Option<Held>,
    /// With `nats.atomic_group_ms`: the open batch ends at a transaction's end and waits for the
    /// transactions after it (`group.rs`).
    pub(super) waiting: Option<super::group::Waiting>,
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
            waiting: None,
            splits: 0,
        }
    }
}
impl Sink {
    /// [`Sink::submit`] with `atomic`: the event is held back; the one held before it goes out as
    /// a batch member (or closes the batch when a limit is reached).
    pub(super) async fn submit_batched(
        &mut self,
        seq: u64,
        event: Box<OutboxEvent>,
    ) -> Result<(), SinkError> {
        let size = approx_size(&event).min(self.config.max_in_flight_bytes);
        // A group waiting for the next transactions takes this one's events only while the
        // batch, with them, fits the batch limit and the window (`group.rs`); else it commits
        // first, and this transaction goes on in a batch of its own.
        if self.batcher()?.waiting.is_some() && !self.group_fits(1, size) {
            self.close_group().await?;
        }
        if self.batcher()?.waiting.is_none()
            && let Some(held) = self.batcher()?.held.take()
        {
            self.send_before(held, size).await?;
        }
        let size = self.reserve(size).await?;
        let (mut out, sent) = self.batch_message(&event)?;
        let mut event = event;
        let span = super::envelope::begin_span(&self.config, &mut event, &mut out);
        // Batch messages carry no `Nats-Msg-Id`, and the server refuses an id expectation inside
        // a batch: the chain is by sequence only, one expectation per batch (its first message).
        let expected = self.fence.as_mut().map(super::Fence::next_sequence);
        let held = Held {
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
        };
        let b = self.batcher()?;
        match b.waiting.as_mut() {
            Some(waiting) => waiting.pending.push(held),
            None => b.held = Some(held),
        }
        Ok(())
    }

    /// Sends `held`, the event before one of `size` bytes in the same transaction, as the next
    /// member of the open batch, or as its commit when a limit is reached (the transaction is then
    /// split).
    pub(super) async fn send_before(&mut self, held: Held, size: usize) -> Result<(), SinkError> {
        let (sent, bytes) = self
            .batcher()?
            .open
            .as_ref()
            .map_or((0, 0), |o| (o.sent, o.bytes));
        // Members wait for the commit's ack: the open batch (its members, the held one and the
        // new one) must fit the window, or waiting for room would wait for itself.
        let limit = self.batch_room();
        let split = sent + 2 > limit || bytes + held.size + size > self.config.max_in_flight_bytes;
        if split {
            let b = self.batcher()?;
            b.splits += 1;
            warn!(
                lsn = %held.item.event.commit_lsn,
                messages = sent + 1,
                "transaction larger than one atomic batch: committing it in parts (each part atomic)"
            );
        }
        self.send_held(held, split).await
    }

    /// The most messages the open batch may hold: the server's limit, and never more than the
    /// in-flight window.
    pub(super) fn batch_room(&self) -> usize {
        self.config.max_batch.min(self.config.max_in_flight).max(1)
    }

    /// Messages and window bytes of the open batch sent so far.
    pub(super) fn open_size(&self) -> (usize, usize) {
        self.batch
            .as_ref()
            .and_then(|b| b.open.as_ref())
            .map_or((0, 0), |o| (o.sent, o.bytes))
    }

    /// The batcher; only called on the atomic path, which exists only with one.
    pub(super) fn batcher(&mut self) -> Result<&mut Batcher, SinkError> {
        self.batch.as_mut().ok_or(SinkError::NotAtomic)
    }

    /// The message for `event` in a batch (event id in `Outbox-Event-Id`), or its dead letter
    /// (`outbox.on_invalid`) when the event has a problem. Its size is checked when it is sent,
    /// with every header stamped (`fit`, in `batch/fit.rs`).
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
        let sent = match &out.dead_letter {
            Some(reason) => {
                c.on_invalid(event, reason)?;
                Sent::DeadLetter {
                    reason: reason.clone(),
                    shrink: Shrink::Keep,
                }
            }
            None => Sent::Event,
        };
        Ok((out, sent))
    }

    /// The limit a batch message must fit, headers and payload: the server's `max_payload` or
    /// the stream's `max_msg_size`, whichever is smaller (members are core publishes, which the
    /// server would close the connection for, and one message over the stream's limit makes it
    /// refuse the whole batch, every time it is sent).
    fn batch_limit(&self) -> Limit {
        let b = self.batch.as_ref();
        let server = b.map_or(usize::MAX, |b| b.max_payload);
        match b.and_then(|b| b.max_msg_size) {
            Some(stream) if stream < server => Limit {
                bytes: stream,
                what: "the stream's max_msg_size",
            },
            _ => Limit {
                bytes: server,
                what: "the server's max_payload",
            },
        }
    }

    /// Sends the held event as the next message of the open batch (opening one if needed), as its
    /// commit when `commit`.
    pub(super) async fn send_held(&mut self, held: Held, commit: bool) -> Result<(), SinkError> {
        let Held {
            mut item,
            out,
            size,
        } = held;
        // Wait for the batch before it to be stored ([`MAX_BATCHES_IN_FLIGHT`]): before opening
        // the next one, or, when transactions are grouped, before committing it (its members wait
        // staged on the server meanwhile, which is where the group forms).
        let grouped = self.config.atomic_group.is_some();
        if (commit && grouped) || (!grouped && self.batcher()?.open.is_none()) {
            while self.batcher()?.in_flight >= MAX_BATCHES_IN_FLIGHT {
                self.settle_oldest().await?;
            }
        }
        if self.batcher()?.open.is_none() {
            let b = self.batcher()?;
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
        let m = Membership {
            batch: open.id.clone(),
            sequence: open.sent,
            expected: item.expected.filter(|_| open.sent == 1),
            commit,
        };
        let mut msg = fit(&self.config, self.batch_limit(), &mut item, out, &m)?;
        loop {
            let Stamped {
                subject,
                headers,
                payload,
            } = msg;
            let sent = if commit {
                self.publisher
                    .send(subject, headers, payload)
                    .await
                    .map(Some)
            } else {
                // Bounded like every other publish: the client's queue to the connection is
                // bounded, and a connection that does not drain must end the session, not wedge
                // it.
                self.publisher
                    .send_member(subject, headers, payload)
                    .await
                    .map(|()| None)
            };
            match sent {
                Ok(ack) => {
                    if commit {
                        let members = self
                            .batch
                            .as_mut()
                            .and_then(|b| {
                                b.in_flight += 1;
                                b.open.take()
                            })
                            .map(|o| o.members)
                            .unwrap_or_default();
                        item.ack = ack.unwrap_or(0);
                        item.members = Some(members);
                        self.window.push_back(Pending::Sent(item));
                    } else if let Some(open) = self.batch.as_mut().and_then(|b| b.open.as_mut()) {
                        open.members.push(item);
                    }
                    return Ok(());
                }
                // The client refused it for the server's max_payload before sending (a server
                // with a smaller limit than the one the session started with): a dead-letter
                // decision like any other size refusal, one step down the ladder each time.
                Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                    let routed = super::envelope::routed_subject(
                        &self.config,
                        &item.event,
                        &item.sent,
                        std::mem::take(&mut item.subject),
                    );
                    let server = self.publisher.max_payload();
                    let reason =
                        format!("message too large for the server's max_payload of {server} bytes");
                    let limit = self.batch_limit();
                    let limit = Limit {
                        bytes: limit.bytes.min(server),
                        ..limit
                    };
                    msg = smaller(
                        &self.config,
                        limit,
                        &mut item,
                        Some(routed.as_str()).filter(|s| !s.is_empty()),
                        &m,
                        reason,
                    )?;
                }
                Err(source) if commit => {
                    return Err(SinkError::Publish {
                        id: item.event.msg_id.clone(),
                        source,
                    });
                }
                Err(source) => {
                    return Err(SinkError::CorePublish {
                        id: item.event.msg_id.clone(),
                        source,
                    });
                }
            }
        }
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
