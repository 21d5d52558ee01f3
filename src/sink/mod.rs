//! The JetStream sink: one publisher that owns everything about publishing in a session — the
//! window of publishes in flight, their acks in publish order, the fence (replay skips, expected
//! sequences, the repair behind a duplicate), the dead-letter ladder and the strategy (single
//! messages, or atomic batches). No task of its own and no state shared with one: the session hands
//! it events and commits ([`Sink::submit`], [`Sink::commit`]), waits for it to have acks
//! ([`Sink::ready`], cancel safe, in the session's `select!`), lets it settle them
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
//! dead-letter it (`outbox.on_invalid`, decided in `destination.rs` only, where every path asks
//! where an event goes). A message over the stream's `max_msg_size` (read when the session starts,
//! fence or not) is dead-lettered before it is sent, in its place. A message the stream still
//! refuses for good is republished as a dead letter, shrunk until it fits, before its ack is
//! reported (`settle.rs`), so order and "nothing skipped" both hold. Anything uncertain (ack
//! timeout, lost connection, no stream, a broken fence, an answer that is not JetStream's) is
//! reported as a failure: the relay then restarts from the last confirmed LSN.
//!
//! This file is the coordinator, thin: [`Sink`] is the strategy ([`Strategy`]: single messages, or
//! a [`Batcher`](batch::Batcher) of atomic batches) over the session's [`Flight`](flight::Flight),
//! which owns what is in flight and settles it. Each part owns its state and lives in its own file
//! (docs/architecture.md maps them), and the files import each other without a cycle, bottom up:
//! values (`outcome.rs`, `distrust.rs`, `config.rs`, `error.rs`), pure decisions
//! (`replay.rs`, `fence.rs`, `destination.rs`, `settle.rs`, `group.rs`), the port and the publisher
//! (`port.rs`, `publish.rs`), the parts (`window.rs`, `prove.rs`, `replay_proof.rs`,
//! `envelope.rs`), then `flight.rs`, `batch.rs`, `open.rs` and this file.

mod batch;
mod config;
mod destination;
mod distrust;
mod envelope;
mod error;
mod fence;
mod flight;
mod group;
mod open;
mod outcome;
mod port;
mod prove;
mod publish;
mod replay;
mod replay_proof;
mod settle;
mod window;

use crate::event::OutboxEvent;
use crate::nats::{NatsError, NatsPort};
use crate::tail::{Origin, TailError};

use batch::Batcher;
use flight::Flight;
use publish::Publisher;

pub(crate) use config::SinkConfig;
pub(crate) use distrust::Distrust;
pub use error::{Forged, SinkError};
pub(crate) use outcome::{Acked, Outcome};

/// How events become publishes: one message each, or one JetStream atomic batch per transaction
/// (`nats.atomic_transactions`), whose state the [`Batcher`] owns (boxed: it is large, and one
/// allocation per session is nothing).
enum Strategy {
    Single,
    Atomic(Box<Batcher>),
}

/// The publisher of one session; see the module docs.
pub(crate) struct Sink {
    strategy: Strategy,
    flight: Flight,
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
        let opening = open::open(&port, &config, origin, distrust).await?;
        config.history = opening.history;
        config.max_msg_size = opening.max_msg_size;
        let publisher = Publisher::start(port, &config.stream, config.ack_timeout)
            .await
            .map_err(|e| TailError {
                stream: config.stream.clone(),
                source: NatsError::new(
                    e.kind(),
                    format!(
                        "subscribing to the inbox for its acks: {}",
                        crate::error_chain::error_chain(&e)
                    ),
                ),
            })?;
        // Settings refuse atomic_transactions without the fence, so the tail is there.
        let strategy = match config.atomic {
            true => Strategy::Atomic(Box::new(Batcher::new(
                publisher.max_payload(),
                config.max_msg_size,
            ))),
            false => Strategy::Single,
        };
        let parked = crate::parking::ParkedSet::new(config.max_parked_keys);
        let flight = Flight::new(
            publisher,
            config,
            opening.fence,
            opening.last_sequence,
            parked,
        );
        Ok(Sink { strategy, flight })
    }

    /// Hands `event` to the sink as message `seq`: skipped when the fence proves it stored, else
    /// published (or dead-lettered). Returns once it has a place in the window (waiting, bounded by
    /// the ack timeout, for the oldest acks when the window is full); its ack comes later, in order.
    pub(crate) async fn submit(
        &mut self,
        seq: u64,
        mut event: Box<OutboxEvent>,
    ) -> Result<(), SinkError> {
        if self.flight.skip_replayed(seq, &event).await? {
            return Ok(());
        }
        // A large payload's contract check, left by the stage: off the runtime thread, within its
        // budget; a failure makes the event a dead letter like any other.
        if event.schema_check.is_some() {
            event.check_schema().await;
        }
        match &mut self.strategy {
            Strategy::Single => self.flight.submit_one(seq, event).await,
            Strategy::Atomic(b) => b.submit(&mut self.flight, seq, event).await,
        }
    }

    /// The transaction ended: with atomic batches its last event commits its batch, or the batch
    /// waits for the next transactions (`group.rs`). Nothing to do for single messages.
    pub(crate) async fn commit(&mut self) -> Result<(), SinkError> {
        match &mut self.strategy {
            Strategy::Single => Ok(()),
            Strategy::Atomic(b) => b.commit(&mut self.flight).await,
        }
    }

    /// Commits a waiting batch if its bound passed and the batch before it is stored.
    pub(crate) async fn commit_due(&mut self) -> Result<(), SinkError> {
        match &mut self.strategy {
            Strategy::Single => Ok(()),
            Strategy::Atomic(b) => b.commit_due(&mut self.flight).await,
        }
    }

    /// Resolves when [`Sink::settle`] has something to do: settled acks wait, the oldest
    /// message's answer arrived, its deadline passed, or a waiting batch is due. Never resolves
    /// with nothing in flight. Cancel safe: an answer taken off the inbox is kept.
    pub(crate) async fn ready(&mut self) {
        // A batch waiting for the next transactions is due: nothing is in flight then, so this
        // is the only wait.
        let due = match &self.strategy {
            Strategy::Single => None,
            Strategy::Atomic(b) => b.due(self.flight.batches(), self.flight.config().atomic_group),
        };
        self.flight.ready(due).await;
    }

    /// Settles, in order, every message whose answer is here (waiting only for the answers of
    /// what it sends again: behind a duplicate, or as a dead letter). The results come out of
    /// [`Sink::acked`]. An error ends the session: nothing after it may be reported.
    pub(crate) async fn settle(&mut self) -> Result<(), SinkError> {
        self.flight.settle().await
    }

    /// The next settled ack, in publish order, once the stream has shown what it stored.
    pub(crate) fn acked(&mut self) -> Option<Acked> {
        self.flight.acked()
    }

    /// The session ends on a failure: proves what is held, one proof at a time and within the ack
    /// timeout, so acks the stream shows are counted and confirmed like any other.
    pub(crate) async fn prove_held(&mut self) {
        self.flight.prove_held().await;
    }

    /// A keepalive at `wal_end` arrived: a replay still waiting for the stream's tail is past it
    /// ([`Replay::passed`]); with events skipped, that is [`SinkError::Diverged`].
    pub(crate) fn keepalive(&mut self, wal_end: crate::Lsn) -> Result<(), SinkError> {
        self.flight.keepalive(wal_end)
    }

    /// Proofs started in this session (`prove.rs`): one per group of acks of new stores.
    pub(crate) fn proofs(&self) -> u64 {
        self.flight.proofs()
    }

    /// Settled acks held until the stream shows the last new store among them.
    pub(crate) fn held(&self) -> u64 {
        self.flight.held()
    }

    /// Submitted events skipped by the replay and not yet proven stored: they will not be
    /// acknowledged unless the replay reaches the stream's tail.
    pub(crate) fn unverified(&self) -> u64 {
        self.flight.unverified()
    }

    /// Messages handed to the sink whose atomic batch is not committed yet and will not be unless
    /// their transaction's Commit arrives (0 for single messages).
    pub(crate) fn uncommitted(&self) -> usize {
        match &self.strategy {
            Strategy::Single => 0,
            Strategy::Atomic(b) => b.uncommitted(),
        }
    }

    /// Messages in the window (published, ack not yet reported).
    pub(crate) fn in_flight(&self) -> usize {
        self.flight.in_flight()
    }

    /// Sends the release marker of control request `request` for the key of `event` (a synthetic
    /// event with the marker's position, `released:<request>` as its id and the key's values), as
    /// message `seq`, and releases the key, unless the replay proves the marker stored. Returns
    /// whether it was published.
    pub(crate) async fn submit_marker(
        &mut self,
        seq: u64,
        event: Box<OutboxEvent>,
        request: &str,
        release: crate::message::parked::Release,
    ) -> Result<bool, SinkError> {
        let key = crate::parking::KeyHash::of_event(&event);
        let marker = destination::Sent::Marker(Box::new(destination::MarkerAs {
            subject: crate::parking::parked_subject(&self.flight.config().dead_letter_subject, key),
            request: request.to_owned(),
            release,
        }));
        self.flight.submit_marker(seq, event, marker).await
    }

    /// Sets (or ends, `None`) the control request whose run is being republished.
    pub(crate) fn set_requeue(&mut self, request: Option<String>) {
        self.flight.set_requeue(request);
    }

    /// Sets (or ends, `None`) the control request republishing a dead letter (`requeue_event`):
    /// while it is set, an event still invalid goes to a new dead letter of its own.
    pub(crate) fn set_requeue_dead_letter(&mut self, request: Option<String>) {
        self.flight.set_requeue_dead_letter(request);
    }

    /// The keys parked now (`outbox.on_invalid = "park"`).
    pub(crate) fn parked(&self) -> &crate::parking::ParkedSet {
        self.flight.parked()
    }

    /// The keys the stream shows parked, read when the session starts (before anything is
    /// submitted).
    pub(crate) fn restore_parked(&mut self, parked: crate::parking::ParkedSet) {
        self.flight.restore_parked(parked);
    }

    /// The highest stream sequence the stream showed so far: the last proven new store, or a
    /// duplicate checked against the stream (with the fence, the stream's last sequence when the
    /// session started, before any): the position service's `last_sequence`. An ack alone never
    /// raises it.
    pub(crate) fn last_sequence(&self) -> u64 {
        self.flight.last_sequence()
    }
}
