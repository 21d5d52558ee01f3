//! The JetStream sink: one publishing task with a bounded window of publishes in flight, and one ack
//! task that awaits the acks in publish order.
//!
//! Publishing only queues the message on the connection (async-nats sends every publish through one
//! channel into one connection task, so wire order is call order). Each publish's ack future goes into
//! a bounded channel; the ack task awaits them one by one and reports `Acked { seq }` in the same order,
//! which is what [`crate::progress::Progress`] needs. The channel's capacity is the window: when it is
//! full the relay stops reading from Postgres, and TCP backpressure does the rest (P6).
//!
//! A message the stream refuses for good (too big for `max_msg_size`, for example) is republished by
//! the ack task as a dead letter before its ack is reported, so order and "nothing skipped" both hold.
//! Anything uncertain (ack timeout, lost connection, no stream, a broken fence) is reported as a
//! failure: the relay then restarts from the last confirmed LSN; [`crate::fence`] and JetStream's dedup
//! keep what was stored before from being stored twice.

use std::future::IntoFuture;
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishAckFuture, context::PublishErrorKind};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::message::{self, Outgoing};
use crate::outbox::OutboxEvent;

/// Why publishing cannot go on; the relay restarts from the last confirmed LSN.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("no ack from JetStream within {0:?} (message {1})")]
    AckTimeout(Duration, String),
    #[error("JetStream publish of message {id} failed: {reason}")]
    Publish { id: String, reason: String },
    #[error("the ack task stopped")]
    Stopped,
    /// `outbox.on_invalid = "stop"` and an event cannot be published as it is.
    #[error("event {id} at {lsn} cannot be published ({reason}); outbox.on_invalid = \"stop\"")]
    Invalid {
        id: String,
        lsn: crate::Lsn,
        reason: String,
    },
}

impl SinkError {
    /// Whether restarting the pipeline can help (everything but `Invalid`).
    pub fn is_transient(&self) -> bool {
        !matches!(self, SinkError::Invalid { .. })
    }
}

/// How a message ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Stored (or already stored: `duplicate`, JetStream dropped it by its `Nats-Msg-Id`).
    Stored { duplicate: bool },
    /// Not published: a fenced replay found it in the stream already ([`Sink::skip`]).
    AlreadyStored,
    /// Published to the dead-letter subject, with the reason.
    DeadLetter { reason: String },
}

/// An ack, reported in publish order.
#[derive(Debug)]
pub struct Acked {
    pub seq: u64,
    pub outcome: Outcome,
    /// The event id (for logs).
    pub id: String,
    /// The transaction's commit time (µs since 2000-01-01), for commit → ack latency.
    pub commit_ts: i64,
    /// The transaction's commit LSN.
    pub commit_lsn: crate::Lsn,
}

struct InFlight {
    seq: u64,
    /// `None` for an event that is already stored (skipped on a fenced replay): reported in order
    /// as a duplicate without publishing.
    ack: Option<PublishAckFuture>,
    /// Kept until the ack, to dead-letter it if the stream refuses it.
    event: Box<OutboxEvent>,
    subject: String,
    dead_letter: Option<String>,
    /// The `Nats-Expected-Last-Sequence` it was sent with (fenced streams).
    expected: Option<u64>,
}

/// Settings the sink needs.
#[derive(Clone, Debug)]
pub struct SinkConfig {
    pub max_in_flight: usize,
    pub ack_timeout: Duration,
    pub dead_letter_subject: String,
    /// `outbox.on_invalid = "stop"`: fail instead of dead-lettering.
    pub stop_on_invalid: bool,
}

/// The publishing side; the acks come out of the receiver returned by [`Sink::new`].
pub struct Sink {
    js: jetstream::Context,
    window: mpsc::Sender<InFlight>,
    ack_task: JoinHandle<()>,
    config: SinkConfig,
    /// With a fenced stream: the sequence the next message expects to follow.
    next_expected: Option<u64>,
}

impl Sink {
    /// Starts the ack task. Acks (or the first failure) arrive on the returned receiver.
    pub fn new(
        client: async_nats::Client,
        config: SinkConfig,
    ) -> (Sink, mpsc::UnboundedReceiver<Result<Acked, SinkError>>) {
        // Our own window bounds in-flight publishes; async-nats' semaphore must never be the one
        // that refuses (it errors instead of waiting unless backpressure is on).
        let js = jetstream::ContextBuilder::new()
            .timeout(config.ack_timeout)
            .max_ack_inflight(config.max_in_flight + 64)
            .backpressure_on_inflight(true)
            .build(client);
        let (window, rx) = mpsc::channel(config.max_in_flight);
        let (acks_tx, acks) = mpsc::unbounded_channel();
        let ack_task = tokio::spawn(ack_loop(js.clone(), rx, acks_tx, config.clone()));
        (
            Sink {
                js,
                window,
                ack_task,
                config,
                next_expected: None,
            },
            acks,
        )
    }

    /// The JetStream context the sink publishes through.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Fences the stream from here on: the next message expects `last_sequence` to be the stream's
    /// last sequence, and each following one the sequence before it (see [`crate::fence`]).
    pub fn fence_from(&mut self, last_sequence: u64) {
        self.next_expected = Some(last_sequence);
    }

    /// Publishes `out` (built from `event`) as message `seq`. Returns once it is queued and has a
    /// place in the window; its ack arrives later, in order.
    pub async fn publish(
        &mut self,
        seq: u64,
        event: Box<OutboxEvent>,
        out: Outgoing,
    ) -> Result<(), SinkError> {
        let permit = self
            .window
            .reserve()
            .await
            .map_err(|_| SinkError::Stopped)?;
        let subject = out.subject.clone();
        let expected = self.next_expected;
        let publish = fenced(out.headers, out.payload, expected);
        let (ack, subject, dead_letter) = match self.js.send_publish(out.subject, publish).await {
            Ok(ack) => (ack, subject, out.dead_letter),
            // async-nats checks payload + headers against the server's max_payload before sending
            // (an oversize publish would make the server close the connection).
            Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                let reason = format!("message too large for the server's max_payload: {e}");
                let id = message::message_id(&event);
                if self.config.stop_on_invalid {
                    return Err(SinkError::Invalid {
                        id,
                        lsn: event.commit_lsn,
                        reason,
                    });
                }
                let ack =
                    send_dead_letter(&self.js, &event, &subject, &self.config, &reason, expected)
                        .await?;
                (ack, subject, Some(reason))
            }
            Err(e) => return Err(publish_error(&event, &e)),
        };
        self.next_expected = expected.map(|e| e + 1);
        permit.send(InFlight {
            seq,
            ack: Some(ack),
            event,
            subject,
            dead_letter,
            expected,
        });
        Ok(())
    }

    /// Reports message `seq` as already stored, in order with the acks of what was published before
    /// it, without publishing it (a fenced replay found it in the stream).
    pub async fn skip(&mut self, seq: u64, event: Box<OutboxEvent>) -> Result<(), SinkError> {
        let permit = self
            .window
            .reserve()
            .await
            .map_err(|_| SinkError::Stopped)?;
        permit.send(InFlight {
            seq,
            ack: None,
            event,
            subject: String::new(),
            dead_letter: None,
            expected: None,
        });
        Ok(())
    }

    /// Messages published whose ack has not been taken by the ack task yet (approximate).
    pub fn window_used(&self) -> usize {
        self.config.max_in_flight - self.window.capacity()
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.ack_task.abort();
    }
}

/// A publish with its headers, carrying `Nats-Expected-Last-Sequence` when the stream is fenced.
fn fenced(
    mut headers: async_nats::HeaderMap,
    payload: bytes::Bytes,
    expected: Option<u64>,
) -> jetstream::message::PublishMessage {
    if let Some(e) = expected {
        headers.insert(message::EXPECTED_LAST_SEQUENCE, e.to_string().as_str());
    }
    jetstream::message::PublishMessage::build()
        .headers(headers)
        .payload(payload)
}

fn publish_error(
    event: &OutboxEvent,
    e: &async_nats::jetstream::context::PublishError,
) -> SinkError {
    SinkError::Publish {
        id: message::message_id(event),
        reason: e.to_string(),
    }
}

/// JetStream error codes that mean "this message will never be stored as it is"
/// (nats-server `errors.json`): 10054 message size exceeds `max_msg_size`, 10097 headers too large.
fn refused_for_good(e: &async_nats::jetstream::context::PublishError) -> Option<String> {
    if e.kind() != PublishErrorKind::Other {
        return None;
    }
    let je = std::error::Error::source(e)?.downcast_ref::<async_nats::jetstream::Error>()?;
    match je.error_code().0 {
        10054 | 10097 => Some(je.to_string()),
        _ => None,
    }
}

async fn ack_loop(
    js: jetstream::Context,
    mut rx: mpsc::Receiver<InFlight>,
    acks: mpsc::UnboundedSender<Result<Acked, SinkError>>,
    config: SinkConfig,
) {
    while let Some(InFlight {
        seq,
        ack,
        event,
        subject,
        dead_letter,
        expected,
    }) = rx.recv().await
    {
        let id = message::message_id(&event);
        // The ack future's own timeout starts when it is awaited; ours bounds the whole wait.
        let Some(ack) = ack else {
            let msg = Ok(Acked {
                seq,
                outcome: Outcome::AlreadyStored,
                id,
                commit_ts: event.commit_ts,
                commit_lsn: event.commit_lsn,
            });
            if acks.send(msg).is_err() {
                return;
            }
            continue;
        };
        let result = match tokio::time::timeout(config.ack_timeout, ack.into_future()).await {
            Err(_) => Err(SinkError::AckTimeout(config.ack_timeout, id.clone())),
            Ok(Ok(ack)) => Ok(match dead_letter {
                Some(reason) => Outcome::DeadLetter { reason },
                None => Outcome::Stored {
                    duplicate: ack.duplicate,
                },
            }),
            Ok(Err(e)) => match refused_for_good(&e) {
                Some(reason) if config.stop_on_invalid => Err(SinkError::Invalid {
                    id: id.clone(),
                    lsn: event.commit_lsn,
                    reason: format!("the stream refused the message: {reason}"),
                }),
                Some(reason) => {
                    let reason = format!("the stream refused the message: {reason}");
                    dead_letter_now(&js, &event, &subject, &config, &reason, expected)
                        .await
                        .map(|()| Outcome::DeadLetter { reason })
                }
                None if e.kind() == PublishErrorKind::WrongLastSequence => {
                    Err(SinkError::Publish {
                        id: id.clone(),
                        reason: format!(
                            "the stream's tail is not where the relay left it ({e}): a message before it was lost or the stream changed; resynchronising"
                        ),
                    })
                }
                None => Err(SinkError::Publish {
                    id: id.clone(),
                    reason: e.to_string(),
                }),
            },
        };
        let failed = result.is_err();
        let (commit_ts, commit_lsn) = (event.commit_ts, event.commit_lsn);
        let msg = result.map(|outcome| Acked {
            seq,
            outcome,
            id,
            commit_ts,
            commit_lsn,
        });
        if acks.send(msg).is_err() || failed {
            // After a failure nothing later may be reported: the relay restarts.
            return;
        }
    }
    debug!("ack task done");
}

/// Queues the dead letter of `event` (payload dropped: its size is what cannot be published) and
/// logs it with the event's id and LSN.
async fn send_dead_letter(
    js: &jetstream::Context,
    event: &OutboxEvent,
    subject: &str,
    config: &SinkConfig,
    reason: &str,
    expected: Option<u64>,
) -> Result<PublishAckFuture, SinkError> {
    warn!(id = %message::message_id(event), lsn = %event.commit_lsn, %reason, "dead-lettering event");
    let dl = message::dead_letter(
        event,
        &config.dead_letter_subject,
        reason,
        Some(subject.to_owned()),
        true,
    );
    // It takes the refused message's place in the sequence.
    let publish = fenced(dl.headers, dl.payload, expected);
    js.send_publish(dl.subject, publish)
        .await
        .map_err(|e| publish_error(event, &e))
}

/// Publishes the dead letter for a message the stream refused, and waits for its ack.
async fn dead_letter_now(
    js: &jetstream::Context,
    event: &OutboxEvent,
    subject: &str,
    config: &SinkConfig,
    reason: &str,
    expected: Option<u64>,
) -> Result<(), SinkError> {
    let ack = send_dead_letter(js, event, subject, config, reason, expected).await?;
    match tokio::time::timeout(config.ack_timeout, ack.into_future()).await {
        Err(_) => Err(SinkError::AckTimeout(
            config.ack_timeout,
            message::message_id(event),
        )),
        Ok(Err(e)) => Err(publish_error(event, &e)),
        Ok(Ok(_)) => Ok(()),
    }
}
