//! One replication session: [`Session::start`] connects (NATS, then the replication connection),
//! starts streaming from the confirmed LSN and lets the sink read the stream's tail;
//! [`Session::run`] moves events from the walsender to the sink and acks back to the slot
//! ([`Session::on_replication`], [`Session::on_acks`]) until shutdown or trouble, and
//! [`Session::drain`] waits, bounded, for what is in flight before a clean stop, taking acks the
//! same way.
//!
//! A session is crash-only: it never repairs itself. Any uncertainty ends it with a
//! [`SessionEnd`], and the relay starts the next one from the confirmed LSN.
//!
//! What a session may touch of the relay is in its signatures: it reads [`Shared`] (the settings,
//! the metrics, the position it serves, the span exporter) when it starts, borrows the relay's
//! [`State`] (where it stands, what earlier sessions found) and its [`Connector`] (the way to the
//! servers), and selects on the [`Shutdown`] signal. The backoff and the restart policy stay with
//! the relay.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tracing::warn;

use super::connector::{Connector, Start};
use super::error::{RelayError, SessionEnd};
use super::parking;
use super::policy::{self, from_sink, from_source};
use super::shutdown::Shutdown;
use super::state::State;
use crate::Lsn;
use crate::config::Settings;
use crate::metrics::Metrics;
use crate::outbox::{OutboxStage, Step};
use crate::pgoutput::Decoder;
use crate::progress::Progress;
use crate::sink::{Acked, Outcome, Sink, SinkConfig};
use crate::source::{ReplicationEvent, ReplicationStream, SourceError, SystemInfo};
use crate::stored::{Positions, Serve};
use crate::tail::Origin;

/// What the relay hands every session to read: the same for all sessions of the process.
pub(super) struct Shared {
    pub(super) settings: Arc<Settings>,
    pub(super) metrics: Arc<Metrics>,
    /// The stored position, which the streaming session serves (read-your-writes).
    pub(super) positions: Arc<Positions>,
    /// `[telemetry]`: the span exporter, one per process, handed to every session's sink.
    pub(super) telemetry: Option<crate::telemetry::Telemetry>,
}

/// A running session: the replication stream, the sink and the pure stages between them.
pub(super) struct Session {
    stream: ReplicationStream,
    sink: Sink,
    decoder: Decoder,
    stage: OutboxStage,
    progress: Progress,
    /// The NATS port, for the parking subjects a control message reads.
    port: crate::nats::NatsPort,
    /// The settings, for the same.
    settings: Arc<Settings>,
    streaming_reported: bool,
    /// The relay's metrics, which the session counts into.
    metrics: Arc<Metrics>,
    /// The stored position, which this session advances as it confirms.
    positions: Arc<Positions>,
    /// `nats.ack_timeout_ms`: how long a clean stop waits for what is in flight.
    ack_timeout: Duration,
    /// This relay serves its position (read-your-writes) while the session lives.
    _serve: Serve,
    /// When streaming started: a session that ran a while counts as a recovery.
    pub(crate) started: Instant,
}

/// What the position service must never answer on (the dead-letter subject, the inbox and reply
/// prefixes), and where it counts refusals.
fn serve_guard(shared: &Shared) -> crate::stored::service::Guard {
    let nats = &shared.settings.config().nats;
    crate::stored::service::Guard {
        dead_letter_subject: nats.dead_letter_subject.clone(),
        inbox_prefix: nats.inbox_prefix.clone(),
        reply_prefixes: nats.service_reply_prefixes.clone(),
        metrics: Arc::clone(&shared.metrics),
    }
}

impl Session {
    /// Connects and starts streaming from `state.confirmed`.
    pub(super) async fn start(
        shared: &Shared,
        state: &mut State,
        connector: &mut dyn Connector,
    ) -> Result<Session, SessionEnd> {
        let settings = &shared.settings;
        let metrics = &shared.metrics;
        // NATS first: while it is down there is no point in holding the slot.
        let nats = connector.nats().await?;
        let start = Start {
            confirmed: state.confirmed,
            history: state.history.clone(),
        };
        let (stream, system) = connector.replication().await?;
        where_the_server_is(state, &start, &system);
        // The slot is held: nobody else moves it now. Its position is where the position service
        // starts, and a client that consumed it since the last session is reported here, before
        // anything says this session streams.
        let reported = state.consumed.clone();
        let check = connector.slot_check(&system, reported.as_ref()).await;
        state.slot_checked(metrics, &check)?;
        let from = Start::FROM_SLOT;
        // The history this session streams, and how far the server's WAL reaches: the sink trusts
        // the stream's tail only when it is this history's (or an ancestor timeline's, below its
        // switch point) and not beyond it.
        let origin = Origin::of(
            &system.system_id,
            system.timeline,
            system.xlogpos,
            &system.history,
            &settings.config().postgres.slot,
        );
        state.history = Some(origin.history.clone());
        state.streaming(metrics, &settings.config().postgres.slot);
        let client = nats.client().cloned();
        let nats_port = nats.clone();
        let sink = Sink::start(
            nats,
            SinkConfig {
                telemetry: shared.telemetry.clone(),
                ..SinkConfig::from_settings(settings)
            },
            Some(&origin),
            state.distrust.as_ref(),
        )
        .await
        .map_err(policy::from_tail)?;
        let mut sink = sink;
        if settings.park_on_invalid {
            // After the tail: a message stored since would fail this session's first publish
            // (the fence), so the keys read here are the stream's as the session starts.
            let parked = parking::rebuild(&nats_port, settings).await?;
            sink.restore_parked(parked);
        }
        parking::gauges(metrics, sink.parked());
        let serve = Serve::start(
            &shared.positions,
            client.as_ref().map(|c| (c, serve_guard(shared))),
            stream.reported(),
            check.confirmed,
            sink.last_sequence(),
        )
        .await;
        Ok(Session {
            stream,
            sink,
            decoder: Decoder::new(),
            stage: stage(settings, metrics),
            port: nats_port,
            settings: Arc::clone(&shared.settings),
            progress: Progress::new(from),
            streaming_reported: false,
            metrics: Arc::clone(metrics),
            positions: Arc::clone(&shared.positions),
            ack_timeout: settings.ack_timeout,
            _serve: serve,
            started: Instant::now(),
        })
    }

    /// Runs until shutdown (after draining) or until the session must end.
    pub(super) async fn run(
        mut self,
        state: &mut State,
        connector: &mut dyn Connector,
        stop: &mut Shutdown,
    ) -> SessionEnd {
        let end = loop {
            let step = tokio::select! {
                biased;
                _ = stop.requested() => break SessionEnd::Shutdown,
                _ = self.sink.ready() => self.on_acks(state).await,
                ev = self.stream.recv() => match ev {
                    None => Err(from_source(SourceError::Closed("replication stream ended"))),
                    Some(Err(e)) => Err(from_source(e)),
                    // A step can wait (for room in the window, for the partition lookup): it
                    // yields to stop. Abandoning it mid-way is safe: what it published but did not
                    // hand to progress is not confirmed, and the next start publishes it again.
                    Some(Ok(ev)) => {
                        tokio::select! {
                            biased;
                            _ = stop.requested() => break SessionEnd::Shutdown,
                            r = self.on_replication(state, connector, ev) => r,
                        }
                    }
                },
            };
            if let Err(end) = step {
                break end;
            }
        };
        if matches!(end, SessionEnd::Shutdown) {
            if let Some(defect) = self.drain(state, connector).await {
                return SessionEnd::Fatal(defect);
            }
        } else {
            self.sink.prove_held().await;
            if let Err(e) = self.take_acks(state) {
                // What the sink settled before the failure (a publish waiting for room settles the
                // oldest) was stored: counted and confirmed like any ack. An ack progress refuses is
                // a defect, which outweighs the failure.
                return SessionEnd::Fatal(e);
            }
            tracing::debug!(
                proofs = self.sink.proofs(),
                unproven = self.sink.held(),
                "session ends: acks the stream did not show are not confirmed"
            );
            // The walsender may still hold the slot: mark where it stands for the next session.
            // Only what progress confirmed: acks the stream has not shown never reached it.
            self.stream.send_status_now();
            connector
                .session_ended(self.stream.backend_pid(), self.stream.confirmed())
                .await;
        }
        end
    }

    /// Lets the sink settle what has arrived and hands every ack, in publish order, to progress;
    /// the clock is read and the confirmed LSN handed on once per burst, not per ack. The acks
    /// settled before a failure are taken first: they were stored (a dead letter among them is
    /// counted in the session that stored it, not as a duplicate in the next).
    async fn on_acks(&mut self, state: &mut State) -> Result<(), SessionEnd> {
        let settled = self.sink.settle().await;
        self.take_acks(state)?;
        settled.map_err(from_sink)?;
        // A batch waiting for the next transactions is committed once the one before it is
        // stored and its bound passed.
        self.sink.commit_due().await.map_err(from_sink)
    }

    /// Hands every settled ack the sink lets go (those of new stores once the stream showed the
    /// last of them), in publish order, to progress and the metrics, and confirms.
    fn take_acks(&mut self, state: &mut State) -> Result<(), RelayError> {
        let now = crate::lsn::pg_now_micros();
        let mut any = false;
        while let Some(ack) = self.sink.acked() {
            self.on_ack(state, ack, now)?;
            any = true;
        }
        // Only an ack taken is one: a session ending on a failure (NATS down) takes none.
        if any {
            self.metrics.acked_now();
        }
        self.confirm(state);
        if any {
            parking::gauges(&self.metrics, self.sink.parked());
        }
        Ok(())
    }

    /// One ack, in publish order: progress and metrics.
    fn on_ack(&mut self, state: &mut State, ack: Acked, now: i64) -> Result<(), RelayError> {
        self.progress.ack(ack.seq).map_err(policy::from_order)?;
        count(&self.metrics, &ack.outcome);
        if ack.commit_ts != 0 {
            let micros = now - ack.commit_ts;
            self.metrics
                .commit_to_ack
                .observe(Duration::from_micros(micros.max(0) as u64));
        }
        // Only a newly stored event proves the way to the stream works again: acks of what was
        // stored before (a full stream refuses only new ones, and a republished dead letter is a
        // duplicate too) must not reset the backoff, the last cause or the distrust.
        if ack.outcome.is_new() {
            state.stored_new();
        }
        Ok(())
    }

    /// A keepalive from the walsender, at `wal_end`.
    fn on_keepalive(&mut self, state: &mut State, wal_end: Lsn) -> Result<(), SessionEnd> {
        // Between transactions only: within one, the walsender's position is not past the
        // transaction's own commit yet, but nothing here depends on that.
        if !self.progress.in_transaction()
            && let Err(e) = self.sink.keepalive(wal_end)
        {
            return Err(from_sink(e));
        }
        self.progress.keepalive(wal_end);
        self.confirm(state);
        Ok(())
    }

    /// One message from the walsender.
    async fn on_replication(
        &mut self,
        state: &mut State,
        connector: &mut dyn Connector,
        ev: ReplicationEvent,
    ) -> Result<(), SessionEnd> {
        if !self.streaming_reported {
            self.metrics.streaming.set(1);
            self.streaming_reported = true;
        }
        let (wal_start, data) = match ev {
            ReplicationEvent::Keepalive { wal_end, .. } => {
                return self.on_keepalive(state, wal_end);
            }
            ReplicationEvent::XLogData {
                wal_start, data, ..
            } => (wal_start, data),
        };
        let msg = self
            .decoder
            .decode(data, wal_start)
            .map_err(|source| policy::from_decode(self.progress.confirmed(), source))?;
        let step = self
            .stage
            .step(msg)
            .map_err(|source| policy::from_stage(wal_start, source))?;
        match step {
            Step::Begin { .. } => self.progress.begin(),
            Step::Commit { end_lsn, .. } => {
                // With atomic transactions, the transaction's last event commits its batch.
                if let Err(e) = self.sink.commit().await {
                    return Err(from_sink(e));
                }
                self.progress.commit(end_lsn);
                self.confirm(state);
            }
            Step::Event(event) => {
                let seq = self.progress.publish();
                if let Err(e) = self.sink.submit(seq, event).await {
                    return Err(from_sink(e));
                }
                self.metrics.in_flight.set(self.sink.in_flight() as u64);
            }
            Step::Standalone { event, end_lsn } => {
                let seq = self.progress.publish();
                if let Err(e) = self.sink.submit(seq, event).await {
                    return Err(from_sink(e));
                }
                // Its own transaction: with atomic transactions it commits a batch of one, or it
                // would wait for the next transaction's first event, forever on a quiet database.
                if let Err(e) = self.sink.commit().await {
                    return Err(from_sink(e));
                }
                self.progress.standalone(end_lsn);
                self.confirm(state);
            }
            // Once per relation and session, and only when a publication sends partitions under
            // their own names: is it a partition of the outbox table (attached since we looked)?
            Step::LookUpPartitions => self.stage.partitions_found(connector.partitions().await?),
            Step::Control {
                control,
                at,
                commit_ts,
            } => self.on_control(state, control, at, commit_ts).await?,
            Step::ControlIgnored { lsn, why } => {
                warn!(%lsn, %why, "ignoring a message under the control prefix");
                self.metrics.parking.control(
                    crate::metrics::ControlOp::Invalid,
                    crate::metrics::ControlResult::Ignored,
                );
            }
            Step::IgnoredChange(_) => self.metrics.ignored_changes.inc(),
            Step::Nothing => {}
        }
        Ok(())
    }

    /// A control message at `at` (`commit_ts`: its transaction's), carried out as decided from
    /// the stream, never from memory, so a replay expands it the same way: once everything before
    /// it is stored, its release marker at `at`.0 and, for a requeue, the key's run after it.
    async fn on_control(
        &mut self,
        state: &mut State,
        control: crate::parking::control::Control,
        at: crate::position::Position,
        commit_ts: i64,
    ) -> Result<(), SessionEnd> {
        let op = control.op();
        let (key, release) =
            match parking::asked(control, at, self.settings.park_on_invalid, &self.metrics) {
                parking::Asked::Release(key, release) => (key, release),
                parking::Asked::DeadLetter { event_id, request } => {
                    return self
                        .requeue_dead_letter(state, &event_id, &request, at, commit_ts)
                        .await;
                }
                parking::Asked::Nothing => return Ok(()),
            };
        self.store_all(state).await?;
        let found = parking::bounds_of(&self.port, &self.settings, &self.metrics, &key, op, at);
        let Some(bounds) = found.await? else {
            return Ok(());
        };
        let seq = self.progress.publish();
        let marker = parking::marker_event(&key, at, commit_ts);
        self.sink
            .submit_marker(seq, marker, &key.request, release)
            .await
            .map_err(from_sink)?;
        if release == crate::message::parked::Release::Requeued {
            let parts = parking::Requeue {
                sink: &mut self.sink,
                stage: &mut self.stage,
                progress: &mut self.progress,
                port: &self.port,
                settings: &self.settings,
            };
            parking::requeue_run(parts, &key, bounds, at, commit_ts).await?;
        }
        tracing::info!(request = %key.request, position = %at, key = %parking::key_text(&key), how = release.as_str(), "released a parked key");
        self.metrics
            .parking
            .control(op, crate::metrics::ControlResult::Applied);
        Ok(())
    }

    /// A `requeue_event` control message at `at`, carried out once everything before it is
    /// stored: the event's dead letter republished ([`parking::requeue_dead_letter`]), or, when
    /// the stream holds none, a warning naming the LSN (counted), never a stop.
    async fn requeue_dead_letter(
        &mut self,
        state: &mut State,
        event_id: &str,
        request: &str,
        at: crate::position::Position,
        commit_ts: i64,
    ) -> Result<(), SessionEnd> {
        use crate::metrics::{ControlOp, ControlResult};
        self.store_all(state).await?;
        let parts = parking::Requeue {
            sink: &mut self.sink,
            stage: &mut self.stage,
            progress: &mut self.progress,
            port: &self.port,
            settings: &self.settings,
        };
        let result = if parking::requeue_dead_letter(parts, event_id, request, at, commit_ts)
            .await?
        {
            tracing::info!(%request, position = %at, event_id = %crate::text::cut(event_id, 200), "requeued a dead letter");
            ControlResult::Applied
        } else {
            warn!(%request, lsn = %at.lsn, position = %at, event_id = %crate::text::cut(event_id, 200), "requeue_event: the stream holds no dead letter of this event on the dead-letter subject: nothing republished");
            ControlResult::Nothing
        };
        self.metrics
            .parking
            .control(ControlOp::RequeueEvent, result);
        Ok(())
    }

    /// Waits until everything handed to the sink so far is stored (or, replayed, proven so
    /// later), taking the acks as they come: the stream then shows what is parked. Events of the
    /// control message's own transaction in an atomic batch are not waited for: their batch is
    /// committed only at the transaction's Commit, after this, so their acks cannot come first
    /// (waiting for them stalled the session for good, without a line).
    async fn store_all(&mut self, state: &mut State) -> Result<(), SessionEnd> {
        loop {
            self.on_acks(state).await?;
            let waits_for_commit = self.sink.uncommitted() as u64 + self.sink.unverified();
            if self.progress.in_flight() <= waits_for_commit {
                return Ok(());
            }
            self.sink.ready().await;
        }
    }

    /// Shutdown: wait, bounded by the ack timeout, for what is in flight, confirm it, and end the
    /// replication connection cleanly. Acks are taken as while streaming ([`Session::on_acks`]).
    /// Returns a defect met on the way, which outweighs the shutdown.
    async fn drain(
        mut self,
        state: &mut State,
        connector: &mut dyn Connector,
    ) -> Option<RelayError> {
        // Events of a transaction whose Commit has not arrived sit in an uncommitted atomic batch:
        // they are never acknowledged, and the next start publishes them again. Events the replay
        // skipped are acknowledged only once it reaches the stream's tail.
        let uncommitted = self.sink.uncommitted() as u64 + self.sink.unverified();
        // Acks held for the proof that the stream shows the last new store are not confirmed
        // unless it ends in time: the proof's own request is bounded by the same timeout.
        let drained = tokio::time::timeout(self.ack_timeout, self.drain_acks(state, uncommitted));
        let defect = match drained.await {
            Err(_) => {
                warn!(
                    in_flight = self.progress.in_flight(),
                    unproven = self.sink.held(),
                    "shutdown: acks still missing or not yet shown by the stream; they will be republished on the next start"
                );
                None
            }
            Ok(Err(SessionEnd::Fatal(e))) if e.is_defect() => Some(e),
            // Trouble while draining ends the drain: the next start publishes what is left.
            Ok(_) => None,
        };
        tracing::debug!(
            proofs = self.sink.proofs(),
            "session drained: proofs that the stream shows the last new store"
        );
        self.confirm(state);
        // Before the slot is let go, so no other relay can have taken it when the mark is made.
        self.stream.send_status_now();
        connector
            .session_ended(self.stream.backend_pid(), self.stream.confirmed())
            .await;
        let _ = self.stream.stop(Duration::from_secs(5)).await;
        defect
    }

    /// Takes acks until what is in flight is only what cannot be acknowledged (`uncommitted`).
    async fn drain_acks(&mut self, state: &mut State, uncommitted: u64) -> Result<(), SessionEnd> {
        loop {
            self.on_acks(state).await?;
            if self.progress.in_flight() <= uncommitted {
                return Ok(());
            }
            self.sink.ready().await;
        }
    }

    /// Tells the slot what is safe to confirm now.
    fn confirm(&self, state: &mut State) {
        let c = self.progress.confirmed();
        // The stream ignores what is not past what it confirmed already.
        self.stream.confirm(c);
        if c > state.confirmed {
            state.confirmed = c;
            self.metrics.confirmed_lsn.set(c.0);
        }
        self.metrics.received_lsn.set(self.stream.received().0);
        self.metrics.in_flight.set(self.sink.in_flight() as u64);
        // Stored is what the tracker says, not what the slot was told: waiters need not wait for
        // the next status update.
        self.positions.advance(c, self.sink.last_sequence());
    }
}

/// The outbox stage of a session: the settings' table and prefixes, schemas, the partition lookup,
/// and control messages (a key's release in park mode, a dead letter's requeue in every mode).
fn stage(settings: &Settings, metrics: &Arc<Metrics>) -> OutboxStage {
    let c = settings.config();
    let stage = OutboxStage::new(&c.outbox)
        .with_cloudevents(c.nats.cloudevents)
        .with_schemas(&settings.schemas, Arc::clone(&metrics.schemas))
        .with_partition_lookup();
    stage.with_control(crate::parking::control::prefix(&c.name))
}

/// Whether the server a session starts on is where this relay left it ([`Start::moved`]): one that
/// moved (restored, or recovered to a point in time before what this relay confirmed) is logged,
/// and what this process confirmed is forgotten, since it belongs to another history; a promoted
/// one is logged, and what was confirmed kept (the new timeline holds it).
fn where_the_server_is(state: &mut State, start: &Start, system: &SystemInfo) {
    if start.moved(system) {
        warn!(
            confirmed = %state.confirmed,
            server_wal_end = %system.xlogpos,
            system = %system.system_id,
            timeline = system.timeline,
            "the server is not where this relay left it (restored, or recovered to a point in time before what this relay confirmed): streaming from the slot's own position"
        );
        state.confirmed = Lsn::ZERO;
    } else if let Some(before) = &start.history
        && before.timeline != system.timeline
    {
        tracing::info!(
            confirmed = %state.confirmed,
            timeline = system.timeline,
            history = %system.history.to_string().trim_end().replace('\n', "; "),
            "following a promoted server: timeline {} is this server's history up to its switch point",
            before.timeline
        );
    }
}

/// Counts a stored (or refused and dead-lettered) event by its outcome.
fn count(metrics: &Metrics, outcome: &Outcome) {
    match outcome {
        Outcome::Stored { duplicate: false } => metrics.published_ok.inc(),
        Outcome::Stored { duplicate: true } => metrics.published_duplicate.inc(),
        // Counted with the duplicates: a republish that never had to leave the relay.
        Outcome::AlreadyStored => metrics.published_duplicate.inc(),
        Outcome::DeadLetter { .. } => metrics.dead_letters.inc(),
        Outcome::Parked { .. } => metrics.parking.parked_total.inc(),
        // Counted by operation and result when it is read.
        Outcome::Control => {}
    }
}
