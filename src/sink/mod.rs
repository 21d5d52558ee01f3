//! The JetStream sink: one publisher that owns everything about publishing in a session — the
//! window of publishes in flight, their acks in publish order, the [`Fence`] (replay skips,
//! expected sequences, the repair behind a duplicate), the dead-letter ladder and the strategy
//! (single messages, or atomic batches in `batch.rs`). No task of its own and no state shared with
//! one: the session hands it events and commits ([`Sink::submit`], [`Sink::commit`]), waits for
//! it to have acks ([`Sink::ready`], cancel safe, in the session's `select!`), lets it settle them
//! ([`Sink::settle`]) and takes them in order ([`Sink::acked`]), which is what
//! [`crate::progress::Progress`] needs.
//!
//! Publishing only queues the message on the connection (async-nats sends every publish through one
//! channel into one connection task, so wire order is call order), with a reply subject on the
//! session's inbox (`publish.rs`). The window is bounded in messages and bytes: when either is used
//! up, submitting waits for the oldest ack, the relay stops reading from Postgres, and TCP
//! backpressure does the rest (P6).
//!
//! The sink decides about a single event: skip it (the fence proved it stored), publish it, or
//! dead-letter it (`outbox.on_invalid`, decided in [`SinkConfig::on_invalid`] only). A message over
//! the stream's `max_msg_size` (read when the session starts, fence or not) is dead-lettered before
//! it is sent, in its place. A message the stream still refuses for good is republished as a dead
//! letter, shrunk until it fits, before its ack is reported (`settle.rs`), so order and "nothing
//! skipped" both hold. Anything uncertain (ack
//! timeout, lost connection, no stream, a broken fence, an answer that is not JetStream's) is
//! reported as a failure: the relay then restarts from the last confirmed LSN.
//!
//! One role a file (docs/architecture.md maps them): this one is the session's interface and the
//! start of a session; the settings are in `config.rs`, the failures in `error.rs`, the window and
//! its bounds in `window.rs`, an event's message and the dead-letter ladder in `envelope.rs`, the
//! replay's decisions in `replay.rs` and its proof in `replay_proof.rs`, the fence's expectations
//! in `fence.rs`, settling an answer in `settle.rs`, and the proof that the stream shows what an
//! ack named in `prove.rs`.

mod batch;
mod config;
mod distrust;
mod envelope;
mod error;
mod fence;
mod group;
mod port;
mod prove;
mod publish;
mod replay;
mod replay_proof;
mod settle;
mod window;

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::Duration;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use tracing::{debug, warn};

use crate::event::OutboxEvent;
use crate::nats::NatsPort;
use crate::position::Position;

pub(crate) use config::SinkConfig;
pub(crate) use distrust::Distrust;
pub use error::SinkError;
pub(crate) use fence::{Fence, Origin, Stamp, Tail, TailError};
pub(crate) use port::read_tail;
use publish::Publisher;
pub(crate) use replay::{Replay, Replayed};
use replay_proof::SKIPPED_HASH_START;
use window::{Pending, Room, approx_size};

/// How a message ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Stored (or already stored: `duplicate`, JetStream dropped it by its `Nats-Msg-Id`; a
    /// republished dead letter too).
    Stored {
        /// JetStream already had it.
        duplicate: bool,
    },
    /// Not published: a fenced replay found it in the stream already.
    AlreadyStored,
    /// Stored on the dead-letter subject as a new message, with the reason (a dead letter JetStream
    /// dropped as a duplicate is [`Outcome::Stored`] with `duplicate`).
    DeadLetter {
        /// Why the event could not be published as it is.
        reason: String,
    },
}

impl Outcome {
    /// Whether JetStream stored a new message for it (an event or a dead letter): the only proof
    /// that the way to the stream works again. A duplicate, or an event a replay found stored,
    /// proves nothing: a stream that refuses every new message still answers those.
    pub(crate) fn is_new(&self) -> bool {
        matches!(
            self,
            Outcome::Stored { duplicate: false } | Outcome::DeadLetter { .. }
        )
    }
}

/// An ack, reported in publish order.
#[derive(Debug)]
pub(crate) struct Acked {
    /// The sequence number the event was submitted with ([`Sink::submit`]).
    pub(crate) seq: u64,
    /// How the message ended.
    pub(crate) outcome: Outcome,
    /// The event's commit time (µs since 2000-01-01; 0 when unknown), for commit → ack latency.
    pub(crate) commit_ts: i64,
}

/// The publisher of one session; see the module docs.
pub(crate) struct Sink {
    publisher: Publisher,
    config: SinkConfig,
    fence: Option<Fence>,
    /// The submit sequence of the first replayed event skipped and not yet proven stored.
    skipped_from: Option<u64>,
    /// A hash of the (position, id) of the events skipped so far, compared with the stream's
    /// messages once the replay reaches the tail ([`Sink::prove_skipped`]).
    skipped_hash: u64,
    /// With `atomic`: the batch being built.
    batch: Option<batch::Batcher>,
    /// Published (or proven stored) and not yet settled, oldest first.
    window: VecDeque<Pending>,
    /// The room its messages take (members of the open batch included), and its bounds.
    room: Room,
    /// When the oldest message's ack is due; set at the first wait for it.
    deadline: Option<tokio::time::Instant>,
    /// The timer [`Sink::ready`] waits on, kept across calls and reset only when `deadline`
    /// changes, and the deadline it is set to.
    timer: Pin<Box<tokio::time::Sleep>>,
    timer_at: Option<tokio::time::Instant>,
    /// Settled, not yet taken by [`Sink::acked`], in order.
    settled: VecDeque<Acked>,
    /// Which of them may be taken: acks of new stores wait until the stream shows the last of
    /// them (`prove.rs`).
    gate: prove::Gate,
    /// The proof in flight: reading the stream's message at the gate's target sequence.
    proof: Option<publish::Showing>,
    /// Its result, once it came, until [`Sink::settle`] judges it.
    shown: Option<Result<prove::Shown, String>>,
    /// The message the settling ack newly stored (its sequence and position), for the gate.
    stored_new: Option<(u64, Position)>,
    /// The highest stream sequence the stream showed: a proven new store, a duplicate checked
    /// against the stream, or the tail's when fencing, before any ack.
    last_sequence: u64,
}

impl Sink {
    /// Reads the stream's tail when fencing and subscribes to the session's inbox. `origin` is the
    /// history the session streams (`None` where there is none, e.g. a backfill: then nothing is
    /// skipped and positions name no history); `distrust`: why and which tail an earlier session
    /// of this process found unreliable ([`SinkError::distrust`]), if one did.
    pub(crate) async fn start(
        nats: impl Into<NatsPort>,
        mut config: SinkConfig,
        origin: Option<&Origin>,
        distrust: Option<&Distrust>,
    ) -> Result<Sink, TailError> {
        let port = nats.into();
        config.history = origin.map(|o| o.history.to_string());
        let tail = if config.fence {
            let tail = read_tail(&port, &config.stream, config.ack_timeout).await?;
            tracing::debug!(last_sequence = tail.last_sequence, last = ?tail.last, "stream tail");
            Some(tail)
        } else {
            None
        };
        let verdict = match (distrust, &tail) {
            (Some(d), Some(t)) => d.verdict(t.last_sequence),
            _ => distrust::Verdict::Stale,
        };
        match verdict {
            distrust::Verdict::Stale if distrust.is_some() && tail.is_some() => {
                debug!(
                    last_sequence = tail.as_ref().map_or(0, |t| t.last_sequence),
                    "the stream ends past the tail an earlier session found unreliable: judging its new tail"
                );
            }
            distrust::Verdict::TailAlone => {
                debug!(
                    "an earlier session found the message before the replay that wrote the stream's tail unreliable: judging the tail alone"
                );
            }
            _ => {}
        }
        let distrust = match verdict {
            distrust::Verdict::Skip(why) => Some(why),
            _ => None,
        };
        // The tail of a replay that trusted no tail names the stream's last message before that
        // replay (`Replay::new`): read it too, unless looking there is what failed before.
        let look_past = verdict != distrust::Verdict::TailAlone;
        let before_replay = match tail.as_ref().filter(|_| look_past).and_then(|t| {
            let n = t.last.as_ref()?.replay_over?;
            (n > 0 && n < t.last_sequence).then_some(n)
        }) {
            Some(n) => match port
                .message_headers(&config.stream, n, config.ack_timeout)
                .await
            {
                Ok(h) => h.map(|h| (n, Stamp::from_headers(&h))),
                Err(e) => {
                    debug!(error = %e, sequence = n, "cannot read the message before the replay that wrote the stream's tail: trusting the tail alone");
                    None
                }
            },
            None => None,
        };
        let fence = tail.as_ref().map(|tail| {
            let replay = match origin {
                Some(origin) => {
                    let before = before_replay.as_ref().map(|(n, s)| (*n, s));
                    let (replay, untrusted) = Replay::new(tail, before, origin, distrust);
                    if let Some(why) = untrusted {
                        warn!(%why, last_sequence = tail.last_sequence, "replay skips nothing: every event from the confirmed position is published again (JetStream drops the duplicates inside its window)");
                        // Its messages say so, and over which tail: a later session whose tail is
                        // one of them looks past it (`Replay::new`).
                        config.history = Some(crate::position::context(
                            &origin.history,
                            Some(tail.last_sequence),
                        ));
                    } else if let Some(end) = replay.ends_at() {
                        debug!(tail = tail.last_sequence, verifies = end, "the stream's tail is from a replay that trusted no tail: verifying the message before that replay instead");
                    }
                    replay
                }
                None => Replay::publishing(),
            };
            Fence::new(tail, replay)
        });
        config.max_msg_size = match &tail {
            Some(t) => t.max_msg_size,
            // Without the fence the tail is read for the stream's limit only.
            None => match read_tail(&port, &config.stream, config.ack_timeout).await {
                Ok(t) => t.max_msg_size,
                Err(e) => {
                    warn!(error = %crate::error_chain::error_chain(&e), "cannot read the stream's max_msg_size: a message over it is dead-lettered only after the stream refused it, behind the messages sent after it");
                    None
                }
            },
        };
        let publisher = Publisher::start(port, &config.stream, config.ack_timeout)
            .await
            .map_err(|e| TailError {
                stream: config.stream.clone(),
                source: format!("subscribing to the inbox for its acks: {e}").into(),
            })?;
        // Settings refuse atomic_transactions without the fence, so the tail is there.
        let batch = config
            .atomic
            .then(|| batch::Batcher::new(publisher.max_payload(), config.max_msg_size));
        let room = Room::new(config.max_in_flight, config.max_in_flight_bytes);
        Ok(Sink {
            publisher,
            config,
            fence,
            skipped_from: None,
            skipped_hash: SKIPPED_HASH_START,
            batch,
            window: VecDeque::new(),
            room,
            deadline: None,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            timer_at: None,
            settled: VecDeque::new(),
            gate: prove::Gate::default(),
            proof: None,
            shown: None,
            stored_new: None,
            last_sequence: tail.as_ref().map_or(0, |t| t.last_sequence),
        })
    }

    /// Hands `event` to the sink as message `seq`: skipped when the fence proves it stored, else
    /// published (or dead-lettered). Returns once it has a place in the window (waiting, bounded by
    /// the ack timeout, for the oldest acks when the window is full); its ack comes later, in order.
    pub(crate) async fn submit(
        &mut self,
        seq: u64,
        mut event: Box<OutboxEvent>,
    ) -> Result<(), SinkError> {
        if self.skip_replayed(seq, &event).await? {
            return Ok(());
        }
        // A large payload's contract check, left by the stage: off the runtime thread, within its
        // budget; a failure makes the event a dead letter like any other.
        if event.schema_check.is_some() {
            event.check_schema().await;
        }
        if self.batch.is_some() {
            return self.submit_batched(seq, event).await;
        }
        let size = self.reserve(approx_size(&event)).await?;
        let item = self.send_event(seq, event, size).await?;
        self.window.push_back(Pending::Sent(item));
        Ok(())
    }

    /// Resolves when [`Sink::settle`] has something to do: settled acks wait, the oldest
    /// message's answer arrived, or its deadline passed. Never resolves with nothing in flight.
    /// Cancel safe: an answer taken off the inbox is kept.
    pub(crate) async fn ready(&mut self) {
        loop {
            if self.gate.may_take() || self.shown.is_some() {
                return;
            }
            // A batch waiting for the next transactions (`group.rs`) is due: nothing is in flight
            // then, so this is the only wait.
            let due = self.group_due();
            if due.is_some_and(|d| tokio::time::Instant::now() >= d) {
                return;
            }
            let token = match self.window.front() {
                // Only the proof in flight, or a waiting batch's bound, can bring something now
                // (the proof's request is bounded by the ack timeout).
                None => {
                    let group = async {
                        match due {
                            Some(d) => tokio::time::sleep_until(d).await,
                            None => std::future::pending().await,
                        }
                    };
                    match self.proof.as_mut() {
                        None => return group.await,
                        Some(f) => tokio::select! {
                            biased;
                            shown = showing(f) => {
                                self.proof = None;
                                self.shown = Some(shown);
                                return;
                            }
                            () = group => return,
                        },
                    }
                }
                Some(Pending::Stored { .. }) => return,
                Some(Pending::Sent(item)) => item.ack,
            };
            if self.publisher.has(token) {
                return;
            }
            let timeout = self.config.ack_timeout;
            let deadline = *self
                .deadline
                .get_or_insert_with(|| tokio::time::Instant::now() + timeout);
            if self.timer_at != Some(deadline) {
                self.timer.as_mut().reset(deadline);
                self.timer_at = Some(deadline);
            }
            let answer = async {
                match self.proof.as_mut() {
                    None => Ok(self.publisher.receive(self.timer.as_mut()).await),
                    // Both cancel safe: an answer taken off the inbox is kept, and the proof stays
                    // in flight.
                    Some(f) => tokio::select! {
                        biased;
                        shown = showing(f) => Err(shown),
                        received = self.publisher.receive(self.timer.as_mut()) => Ok(received),
                    },
                }
            };
            // With a batch waiting (nothing committed in flight), the oldest message is one of
            // its own members, answered only by its commit: the bound is what comes first.
            let group = async {
                match due {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            let received = tokio::select! {
                biased;
                received = answer => received,
                () = group => return,
            };
            match received {
                Ok(true) => {}
                Ok(false) => return,
                Err(shown) => {
                    self.proof = None;
                    self.shown = Some(shown);
                    return;
                }
            }
        }
    }

    /// Settles, in order, every message whose answer is here (waiting only for the answers of
    /// what it sends again: behind a duplicate, or as a dead letter). The results come out of
    /// [`Sink::acked`]. An error ends the session: nothing after it may be reported.
    pub(crate) async fn settle(&mut self) -> Result<(), SinkError> {
        loop {
            self.judge_proof()?;
            self.settle_window().await?;
            if !self.start_proof() {
                return Ok(());
            }
        }
    }

    /// Settles, in order, every message of the window whose answer is here.
    async fn settle_window(&mut self) -> Result<(), SinkError> {
        loop {
            let token = match self.window.front() {
                None => return Ok(()),
                Some(Pending::Stored { .. }) => {
                    self.pop_stored();
                    continue;
                }
                Some(Pending::Sent(item)) => item.ack,
            };
            let answer = match self.publisher.take(token) {
                Ok(Some(answer)) => answer,
                Ok(None) => {
                    if self
                        .deadline
                        .is_some_and(|d| tokio::time::Instant::now() >= d)
                    {
                        return Err(self.timed_out());
                    }
                    return Ok(());
                }
                Err(source) => return Err(self.front_error(source)),
            };
            self.settle_front(answer).await?;
        }
    }

    /// The next settled ack, in publish order, once the stream has shown what it stored.
    pub(crate) fn acked(&mut self) -> Option<Acked> {
        if !self.gate.may_take() {
            return None;
        }
        let ack = self.settled.pop_front()?;
        self.gate.took();
        Some(ack)
    }

    /// Starts the proof of the last new store, when acks of new stores arrived since the last proof
    /// and none is in flight; polled once at once (it sends the request, and a simulated stream
    /// answers right away). True when its result is already here, to be judged.
    fn start_proof(&mut self) -> bool {
        if self.proof.is_some() || self.shown.is_some() {
            return false;
        }
        let Some(target) = self.gate.start() else {
            return false;
        };
        let mut f = self.publisher.show(target.sequence);
        match futures_util::FutureExt::now_or_never(showing(&mut f)) {
            Some(shown) => {
                self.shown = Some(shown);
                true
            }
            None => {
                self.proof = Some(f);
                false
            }
        }
    }

    /// Judges the proof's result, if it came (polling the one in flight once): the stream shows the
    /// target, so every ack up to it may be taken; or it does not, and the session ends before
    /// anything past the last proven message is confirmed.
    fn judge_proof(&mut self) -> Result<(), SinkError> {
        if self.shown.is_none()
            && let Some(f) = self.proof.as_mut()
            && let Some(shown) = futures_util::FutureExt::now_or_never(showing(f))
        {
            self.proof = None;
            self.shown = Some(shown);
        }
        let Some(shown) = self.shown.take() else {
            return Ok(());
        };
        let Some(target) = self.gate.target() else {
            return Ok(());
        };
        let failed = |source: PublishError| SinkError::Publish {
            id: format!("at position {}", target.position),
            source,
        };
        let shown = shown.map_err(|e| {
            failed(PublishError::with_source(
                PublishErrorKind::Other,
                std::io::Error::other(format!(
                    "reading back stream {} sequence {} to prove the ack that named it: {e}",
                    self.config.stream, target.sequence
                )),
            ))
        })?;
        prove::verdict(&target, &shown).map_err(|why| {
            failed(PublishError::with_source(
                PublishErrorKind::Other,
                publish::Forged {
                    stream: self.config.stream.clone(),
                    why,
                },
            ))
        })?;
        self.gate.proven();
        self.last_sequence = self.last_sequence.max(target.sequence);
        tracing::trace!(
            sequence = target.sequence,
            position = %target.position,
            proofs = self.gate.proofs,
            "the stream shows the last message stored"
        );
        Ok(())
    }

    /// The session ends on a failure: proves what is held, one proof at a time and within the ack
    /// timeout, so acks the stream shows are counted and confirmed like any other (a dead letter
    /// stored just before a refusal is counted in the session that stored it, not found as a
    /// duplicate by the next). What the stream does not show, or not in time, stays held.
    pub(crate) async fn prove_held(&mut self) {
        let timeout = self.config.ack_timeout;
        let work = async {
            loop {
                if self.judge_proof().is_err() {
                    return;
                }
                if let Some(f) = self.proof.as_mut() {
                    let shown = showing(f).await;
                    self.proof = None;
                    self.shown = Some(shown);
                    continue;
                }
                if !self.start_proof() && self.proof.is_none() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(timeout, work).await;
    }

    /// Proofs started in this session (`prove.rs`): one per group of acks of new stores.
    pub(crate) fn proofs(&self) -> u64 {
        self.gate.proofs
    }

    /// Settled acks held until the stream shows the last new store among them.
    pub(crate) fn held(&self) -> u64 {
        self.gate.held()
    }

    /// A keepalive at `wal_end` arrived: a replay still waiting for the stream's tail is past it
    /// ([`Replay::passed`]); with events skipped, that is [`SinkError::Diverged`].
    pub(crate) fn keepalive(&mut self, wal_end: crate::Lsn) -> Result<(), SinkError> {
        let Some(fence) = self.fence.as_mut() else {
            return Ok(());
        };
        match fence.passed(wal_end) {
            Some(tail) => Err(SinkError::Diverged {
                sequence: fence.proof_end(),
                over: fence.over(),
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
    pub(crate) fn unverified(&self) -> u64 {
        self.fence.as_ref().map_or(0, Fence::unverified)
    }

    /// Messages in the window (published, ack not yet reported).
    pub(crate) fn in_flight(&self) -> usize {
        self.room.messages()
    }

    /// The highest stream sequence the stream showed so far: the last proven new store, or a
    /// duplicate checked against the stream (with the fence, the stream's last sequence when the
    /// session started, before any): the position service's `last_sequence`. An ack alone never
    /// raises it.
    pub(crate) fn last_sequence(&self) -> u64 {
        self.last_sequence
    }
}

/// The proof in flight, to be polled (a mutex only for `Sync`, so never locked: see
/// [`publish::Showing`]).
fn showing(
    f: &mut publish::Showing,
) -> Pin<&mut (dyn std::future::Future<Output = Result<prove::Shown, String>> + Send)> {
    f.get_mut()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_mut()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_new_message_is_progress() {
        assert!(Outcome::Stored { duplicate: false }.is_new());
        assert!(
            Outcome::DeadLetter {
                reason: "aggregate_type".into()
            }
            .is_new()
        );
        assert!(!Outcome::Stored { duplicate: true }.is_new());
        assert!(!Outcome::AlreadyStored.is_new());
    }
}
