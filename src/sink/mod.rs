//! The JetStream sink: one publishing side with a bounded window of publishes in flight, and one ack
//! task that awaits the acks in publish order.
//!
//! Publishing only queues the message on the connection (async-nats sends every publish through one
//! channel into one connection task, so wire order is call order), with a reply subject on the
//! session's inbox (`publish.rs`). Each publish's token goes to the ack task, which takes the acks
//! off that inbox one by one and reports [`Acked`] in the same order, which is what
//! [`crate::progress::Progress`] needs. The window is two semaphores, messages and bytes: when either
//! is used up the relay stops reading from Postgres, and TCP backpressure does the rest (P6).
//!
//! The sink owns the decisions about a single event: skip it (the [`Fence`] found it stored), publish
//! it, or dead-letter it (`outbox.on_invalid`, decided in [`SinkConfig::on_invalid`] only). A
//! message the stream refuses for good is republished by the ack task as a dead letter, shrunk until
//! it fits, before its ack is reported, so order and "nothing skipped" both hold. Anything uncertain
//! (ack timeout, lost connection, no stream, a broken fence) is reported as a failure: the relay then
//! restarts from the last confirmed LSN.

mod ack;
mod batch;
mod connect;
mod fence;
mod port;
mod publish;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tracing::warn;

use crate::config::Settings;
use crate::message::{self, Outgoing, Shrink};
use crate::outbox::OutboxEvent;
use crate::position::Position;
use crate::route::SubjectTemplate;

pub use connect::{ConnectError, connect_nats};
pub use fence::{Fence, Origin, Replay, Replayed, Stamp, Tail, TailError, Untrusted, read_tail};
pub use port::NatsPort;
#[cfg(feature = "test-support")]
pub use port::{SimJetStream, SimSendError};
use publish::Publisher;

/// Why publishing cannot go on. Transient ones restart the session; [`SinkError::is_transient`].
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// No ack arrived within `nats.ack_timeout_ms`; holds the timeout and the message id.
    #[error("no ack from JetStream within {0:?} (message {1})")]
    AckTimeout(Duration, String),
    /// Sending a publish failed, or JetStream refused the message.
    #[error("JetStream publish of message {id} failed")]
    Publish {
        /// The message's `Nats-Msg-Id`.
        id: String,
        /// The client's error.
        #[source]
        source: jetstream::context::PublishError,
    },
    #[error(
        "the stream's tail is not where the relay left it (message {id} expected last sequence {expected}): a message before it was lost or the stream changed; resynchronising"
    )]
    /// The stream refused a fenced publish: its last sequence is not the one the message expected.
    FenceBroken {
        /// The message's `Nats-Msg-Id`.
        id: String,
        /// The `Nats-Expected-Last-Sequence` the message carried.
        expected: u64,
        /// The client's error.
        #[source]
        source: jetstream::context::PublishError,
    },
    /// Sending a member of an atomic batch on the connection failed.
    #[error("publish of message {id} (part of an atomic batch) failed")]
    CorePublish {
        /// The message's event id.
        id: String,
        /// The client's error.
        #[source]
        source: jetstream::context::PublishError,
    },
    /// The ack task ended, so the sink cannot go on.
    #[error("the ack task stopped")]
    Stopped,
    /// The atomic-batch path was asked for on a sink built without it (a defect in the relay).
    #[error("atomic batch requested from a sink without nats.atomic_transactions")]
    NotAtomic,
    /// The replayed events passed the position of the stream's last message without that message's
    /// own event: the stream's tail is from another history of the database (restored from a
    /// snapshot or backup). Nothing skipped is confirmed; the next session publishes every event.
    #[error(
        "the stream's last message (sequence {sequence}, position {tail}) is not in this database's history: the \
         replay reached {at} without it (database restored from a snapshot or backup?); publishing every event \
         from the confirmed position again"
    )]
    Diverged {
        /// The stream's last sequence when the session started.
        sequence: u64,
        /// The tail's position.
        tail: Position,
        /// The first replayed event past it.
        at: Position,
    },
    /// `outbox.on_invalid = "stop"` and an event cannot be published as it is.
    #[error(
        "event {id} at {lsn} cannot be published ({reason}); outbox.on_invalid = \"stop\": fix or delete the row's \
         cause and restart, or set outbox.on_invalid = \"dead_letter\" to route it to the dead-letter subject"
    )]
    Invalid {
        /// The event's message id.
        id: String,
        /// The commit LSN of the event's transaction.
        lsn: crate::Lsn,
        /// Why the event cannot be published.
        reason: String,
    },
    /// Not even the minimal dead letter (id and reason) could be stored.
    #[error(
        "event {id} at {lsn} cannot be published ({reason}), and the stream refused even its minimal dead letter \
         ({refusal}): check the stream's max_msg_size and the server's max_payload, and nats.dead_letter_subject"
    )]
    DeadLetterRefused {
        /// The event's message id.
        id: String,
        /// The commit LSN of the event's transaction.
        lsn: crate::Lsn,
        /// Why the event itself cannot be published.
        reason: String,
        /// Why the stream refused the dead letter.
        refusal: String,
    },
}

impl SinkError {
    /// Whether restarting the pipeline can help.
    pub fn is_transient(&self) -> bool {
        !matches!(
            self,
            SinkError::Invalid { .. } | SinkError::DeadLetterRefused { .. }
        )
    }
}

/// How a message ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Stored (or already stored: `duplicate`, JetStream dropped it by its `Nats-Msg-Id`).
    Stored {
        /// JetStream already had it.
        duplicate: bool,
    },
    /// Not published: a fenced replay found it in the stream already.
    AlreadyStored,
    /// Published to the dead-letter subject, with the reason.
    DeadLetter {
        /// Why the event could not be published as it is.
        reason: String,
    },
}

/// An ack, reported in publish order.
#[derive(Debug)]
pub struct Acked {
    /// The sequence number the event was submitted with ([`Sink::submit`]).
    pub seq: u64,
    /// How the message ended.
    pub outcome: Outcome,
    /// The event's commit time (µs since 2000-01-01; 0 when unknown), for commit → ack latency.
    pub commit_ts: i64,
}

/// Settings the sink needs.
#[derive(Clone, Debug)]
pub struct SinkConfig {
    /// `nats.max_in_flight`: publishes awaiting their ack.
    pub max_in_flight: usize,
    /// `nats.max_in_flight_bytes`: bytes of the publishes awaiting their ack.
    pub max_in_flight_bytes: usize,
    /// `nats.ack_timeout_ms`: how long to wait for one ack.
    pub ack_timeout: Duration,
    /// `nats.dead_letter_subject`.
    pub dead_letter_subject: String,
    /// `outbox.on_invalid = "stop"`: fail instead of dead-lettering.
    pub stop_on_invalid: bool,
    /// `nats.subject`, parsed.
    pub template: SubjectTemplate,
    /// Fence the stream (`nats.fence`).
    pub fence: bool,
    /// `nats.stream`.
    pub stream: String,
    /// `nats.cloudevents`: the CloudEvents headers to add to routed events.
    pub cloudevents: Option<message::CloudEvents>,
    /// `nats.atomic_transactions`: each transaction is published as one atomic batch.
    pub atomic: bool,
    /// The most messages in one atomic batch (the server's limit, 1,000 by default); a longer
    /// transaction is split into several batches.
    pub max_batch: usize,
    /// The `Outbox-History` every message carries: the history its position belongs to. Set by
    /// [`Sink::start`] from the session's [`Origin`].
    pub history: Option<String>,
}

impl SinkConfig {
    /// The sink's part of the validated settings.
    pub fn from_settings(s: &Settings) -> Self {
        SinkConfig {
            max_in_flight: s.nats.max_in_flight,
            max_in_flight_bytes: s.nats.max_in_flight_bytes,
            ack_timeout: s.ack_timeout,
            dead_letter_subject: s.nats.dead_letter_subject.clone(),
            stop_on_invalid: s.stop_on_invalid,
            template: s.subject.clone(),
            fence: s.nats.fence,
            stream: s.nats.stream.clone(),
            cloudevents: s
                .nats
                .cloudevents
                .then(|| message::CloudEvents::new(&s.nats.cloudevents_source)),
            atomic: s.nats.atomic_transactions,
            max_batch: batch::MAX_BATCH,
            history: None,
        }
    }

    /// `outbox.on_invalid`, the one place it is applied: `Ok` means dead-letter the event (and it is
    /// logged), `Err` means stop.
    pub fn on_invalid(&self, event: &OutboxEvent, reason: &str) -> Result<(), SinkError> {
        if self.stop_on_invalid {
            return Err(SinkError::Invalid {
                id: event.msg_id.clone(),
                lsn: event.commit_lsn,
                reason: reason.to_owned(),
            });
        }
        warn!(id = %event.msg_id, lsn = %event.commit_lsn, %reason, "dead-lettering event");
        Ok(())
    }
}

/// What was sent for an event, so the ack task can send it again with another expectation.
#[derive(Debug, Clone)]
enum Sent {
    /// The routed message.
    Event,
    /// A dead letter with this reason, shrunk this far.
    DeadLetter { reason: String, shrink: Shrink },
}

/// What the sink hands the ack task, in submit order.
enum Queued {
    /// Submitted events `first..first + count`, which a fenced replay proved to be stored already:
    /// reported without publishing.
    Stored { first: u64, count: u64 },
    /// A published message, whose ack is awaited.
    Sent(InFlight),
}

struct InFlight {
    seq: u64,
    /// The token its ack comes under ([`publish::Replies::ack`]); `None` for a member of an atomic
    /// batch, settled by its commit.
    ack: Option<u64>,
    event: Box<OutboxEvent>,
    /// The subject it was routed to ("" if none), for a dead letter's `Outbox-Subject`.
    subject: String,
    sent: Sent,
    /// The `Nats-Expected-Last-Sequence` it was sent with (fenced streams).
    expected: Option<u64>,
    /// Its place in the window, given back when its ack is reported.
    _permits: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
    /// Its part in an atomic batch, if it was sent in one.
    batch: Option<batch::Role>,
    /// A batch's commit: the batch's place among those in flight, given back with its ack.
    batch_permit: Option<OwnedSemaphorePermit>,
}

/// The publishing side; the acks come out of the receiver returned by [`Sink::start`].
pub struct Sink {
    publisher: Publisher,
    window: mpsc::UnboundedSender<Queued>,
    messages: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    ack_task: JoinHandle<()>,
    config: Arc<SinkConfig>,
    fence: Option<Fence>,
    /// The submit sequence of the first replayed event skipped and not yet proven stored.
    skipped_from: Option<u64>,
    /// With `atomic`: the batch being built.
    batch: Option<batch::Batcher>,
}

/// Acks (or the first failure) in publish order.
pub type AckReceiver = mpsc::UnboundedReceiver<Result<Acked, SinkError>>;

impl Sink {
    /// Reads the stream's tail when fencing, and starts the ack task. `origin` is the history the
    /// session streams (`None` where there is none, e.g. a backfill: then nothing is skipped and
    /// messages carry no `Outbox-History`); `distrusted` the last sequence of a tail that an earlier
    /// session found to be from another history ([`SinkError::Diverged`]).
    pub async fn start(
        nats: impl Into<NatsPort>,
        mut config: SinkConfig,
        origin: Option<&Origin>,
        distrusted: Option<u64>,
    ) -> Result<(Sink, AckReceiver), TailError> {
        let port = nats.into();
        config.history = origin.map(|o| o.history.to_string());
        let tail = if config.fence {
            let tail = port.tail(&config.stream, config.ack_timeout).await?;
            tracing::debug!(last_sequence = tail.last_sequence, last = ?tail.last, "stream tail");
            Some(tail)
        } else {
            None
        };
        let fence = tail.as_ref().map(|tail| {
            let replay = match origin {
                Some(origin) => {
                    let (replay, untrusted) = Replay::new(tail, origin, distrusted);
                    if let Some(why) = untrusted {
                        warn!(%why, last_sequence = tail.last_sequence, "replay skips nothing: every event from the confirmed position is published again (JetStream drops the duplicates inside its window)");
                    }
                    replay
                }
                None => Replay::publishing(),
            };
            Fence::new(tail, replay)
        });
        let (publisher, replies) = Publisher::start(port, &config.stream, config.ack_timeout)
            .await
            .map_err(|e| TailError {
                stream: config.stream.clone(),
                source: format!("subscribing to the inbox for its acks: {e}").into(),
            })?;
        // Settings refuse atomic_transactions without the fence, so the tail is there.
        let batch = config.atomic.then(|| {
            batch::Batcher::new(
                publisher.max_payload(),
                tail.as_ref().and_then(|t| t.max_msg_size),
            )
        });
        let config = Arc::new(config);
        let (window, rx) = mpsc::unbounded_channel();
        let (acks_tx, acks) = mpsc::unbounded_channel();
        let task = ack::AckTask {
            publisher: publisher.clone(),
            replies,
            config: Arc::clone(&config),
            fence: fence.as_ref().map(|f| (f.base(), f.duplicates())),
        };
        let ack_task = tokio::spawn(task.run(rx, acks_tx));
        Ok((
            Sink {
                publisher,
                window,
                messages: Arc::new(Semaphore::new(config.max_in_flight)),
                bytes: Arc::new(Semaphore::new(config.max_in_flight_bytes)),
                ack_task,
                config,
                fence,
                skipped_from: None,
                batch,
            },
            acks,
        ))
    }

    /// Hands `event` to the sink as message `seq`: skipped when the fence finds it stored, else
    /// published (or dead-lettered). Returns once it has a place in the window; its ack arrives
    /// later, in order.
    pub async fn submit(&mut self, seq: u64, event: Box<OutboxEvent>) -> Result<(), SinkError> {
        if self.skip_replayed(seq, &event)? {
            return Ok(());
        }
        if self.batch.is_some() {
            return self.submit_batched(seq, event).await;
        }
        let permits = self.reserve(approx_size(&event)).await?;
        let out = message::build(
            &event,
            &self.config.template,
            &self.config.dead_letter_subject,
            self.config.cloudevents.as_ref(),
        );
        let sent = match &out.dead_letter {
            Some(reason) => {
                self.config.on_invalid(&event, reason)?;
                Sent::DeadLetter {
                    reason: reason.clone(),
                    shrink: Shrink::Keep,
                }
            }
            None => Sent::Event,
        };
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
        let expected = self.fence.as_mut().map(Fence::next_expected);
        let (target, headers, payload) = stamped(out, expected, self.config.history.as_deref());
        let (ack, sent) = match self.publisher.send(target, headers, payload).await {
            Ok(ack) => (ack, sent),
            // async-nats checks payload + headers against the server's max_payload before sending
            // (an oversize publish would make the server close the connection).
            Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                let routed = routed_subject(&self.config, &event, &sent, subject.clone());
                let reason = match sent {
                    Sent::DeadLetter { reason, .. } => reason,
                    Sent::Event => {
                        let reason = "message too large for the server's max_payload".to_owned();
                        self.config.on_invalid(&event, &reason)?;
                        reason
                    }
                };
                let (ack, shrink) = send_dead_letter(
                    &self.publisher,
                    &self.config,
                    &event,
                    Some(&routed).filter(|s| !s.is_empty()).map(String::as_str),
                    &reason,
                    expected,
                )
                .await?;
                (ack, Sent::DeadLetter { reason, shrink })
            }
            Err(source) => {
                return Err(SinkError::Publish {
                    id: event.msg_id.clone(),
                    source,
                });
            }
        };
        self.queue(InFlight {
            seq,
            ack: Some(ack),
            event,
            subject,
            sent,
            expected,
            _permits: permits,
            batch: None,
            batch_permit: None,
        })
    }

    /// Asks the fence's replay about `event` (submitted as `seq`): true when it is stored already,
    /// so it is not published. Skipped events are reported as stored only once the replay reaches
    /// the tail's own event; they hold no place in the window meanwhile (a replay can be longer than
    /// the window), only their count.
    fn skip_replayed(&mut self, seq: u64, event: &OutboxEvent) -> Result<bool, SinkError> {
        let Some(fence) = self.fence.as_mut() else {
            return Ok(false);
        };
        match fence.replayed(event.position, &event.msg_id) {
            Replayed::Publish => Ok(false),
            Replayed::Skip => {
                self.skipped_from.get_or_insert(seq);
                Ok(true)
            }
            Replayed::Verified => {
                let first = self.skipped_from.take().unwrap_or(seq);
                tracing::debug!(events = seq + 1 - first, position = %event.position, "replay reached the stream's tail: skipped events are stored");
                self.window
                    .send(Queued::Stored {
                        first,
                        count: seq + 1 - first,
                    })
                    .map_err(|_| SinkError::Stopped)?;
                Ok(true)
            }
            Replayed::Diverged { tail, at } => Err(SinkError::Diverged {
                sequence: fence.base(),
                tail,
                at,
            }),
        }
    }

    /// A keepalive at `wal_end` arrived: a replay still waiting for the stream's tail is past it
    /// ([`Replay::passed`]); with events skipped, that is [`SinkError::Diverged`].
    pub fn keepalive(&mut self, wal_end: crate::Lsn) -> Result<(), SinkError> {
        let Some(fence) = self.fence.as_mut() else {
            return Ok(());
        };
        match fence.passed(wal_end) {
            Some(tail) => Err(SinkError::Diverged {
                sequence: fence.base(),
                tail,
                at: Position {
                    lsn: wal_end,
                    index: 0,
                },
            }),
            None => Ok(()),
        }
    }

    /// Submitted events skipped by the replay and not yet proven stored: they will not be
    /// acknowledged unless the replay reaches the stream's tail.
    pub fn unverified(&self) -> u64 {
        self.fence.as_ref().map_or(0, Fence::unverified)
    }

    /// Messages in the window (published, ack not yet reported).
    pub fn in_flight(&self) -> usize {
        self.config.max_in_flight - self.messages.available_permits()
    }

    async fn reserve(
        &self,
        size: usize,
    ) -> Result<(OwnedSemaphorePermit, Option<OwnedSemaphorePermit>), SinkError> {
        let message = Arc::clone(&self.messages)
            .acquire_owned()
            .await
            .map_err(|_| SinkError::Stopped)?;
        // One event bigger than the whole byte window still goes, alone.
        let size = size.min(self.config.max_in_flight_bytes);
        let bytes = match u32::try_from(size) {
            Ok(0) => None,
            Ok(n) => Some(
                Arc::clone(&self.bytes)
                    .acquire_many_owned(n)
                    .await
                    .map_err(|_| SinkError::Stopped)?,
            ),
            Err(_) => None,
        };
        Ok((message, bytes))
    }

    fn queue(&self, item: InFlight) -> Result<(), SinkError> {
        self.window
            .send(Queued::Sent(item))
            .map_err(|_| SinkError::Stopped)
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.ack_task.abort();
    }
}

/// What an event holds in memory while in flight: payload, the values that become headers, and the
/// client's copy of the message.
fn approx_size(e: &OutboxEvent) -> usize {
    let opt = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    let headers: usize = e.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    2 * (e.payload.len()
        + e.msg_id.len()
        + opt(&e.aggregate_type)
        + opt(&e.aggregate_id)
        + opt(&e.event_type)
        + headers)
        + 256
}

/// The subject an event was routed to: `known` for a dead letter, rendered again for an event
/// (the hot path does not keep a copy).
fn routed_subject(config: &SinkConfig, event: &OutboxEvent, sent: &Sent, known: String) -> String {
    match sent {
        Sent::Event => {
            message::build(event, &config.template, &config.dead_letter_subject, None).subject
        }
        Sent::DeadLetter { .. } => known,
    }
}

/// A publish (subject, headers, payload), carrying `Nats-Expected-Last-Sequence` when the stream is
/// fenced and `Outbox-History` when the session knows its history.
fn stamped(
    out: Outgoing,
    expected: Option<u64>,
    history: Option<&str>,
) -> (String, async_nats::HeaderMap, bytes::Bytes) {
    let mut headers = out.headers;
    if let Some(e) = expected {
        headers.insert(
            message::EXPECTED_LAST_SEQUENCE,
            async_nats::HeaderValue::from(itoa::Buffer::new().format(e)),
        );
    }
    if let Some(h) = history {
        headers.insert(message::HISTORY, h);
    }
    (out.subject, headers, out.payload)
}

/// Queues the dead letter of `event` (it takes the refused message's place in the sequence), shrunk
/// until the client accepts its size. The payload is dropped first: its size is what usually cannot
/// be published.
async fn send_dead_letter(
    publisher: &Publisher,
    config: &SinkConfig,
    event: &OutboxEvent,
    subject: Option<&str>,
    reason: &str,
    expected: Option<u64>,
) -> Result<(u64, Shrink), SinkError> {
    let mut last = None;
    for shrink in Shrink::Keep.below() {
        let dl = message::dead_letter(event, &config.dead_letter_subject, reason, subject, shrink);
        let (target, headers, payload) = stamped(dl, expected, config.history.as_deref());
        match publisher.send(target, headers, payload).await {
            Ok(ack) => return Ok((ack, shrink)),
            Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => last = Some(e),
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
        refusal: last.map_or_else(String::new, |e| e.to_string()),
    })
}
