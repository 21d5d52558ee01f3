//! The session's side of parking (`outbox.on_invalid = "park"`): the parked set a session starts
//! from, read from the stream after its tail ([`rebuild`]: a read that fails restarts the
//! session, more parked keys than `outbox.max_parked_keys` stop the relay with one line naming a
//! key and the setting), the parking gauges set from the sink's parked set ([`gauges`]), and
//! carrying out a control message (`Session::on_control`): the I/O the outbox stage asks for, as
//! for a partition lookup.

use tracing::{info, warn};

use crate::config::Settings;
use crate::event::OutboxEvent;
use crate::message::parked::Release;
use crate::metrics::{ControlResult, Metrics};
use crate::nats::NatsPort;
use crate::parking::control::Control;
use crate::parking::ledger::{self, RebuildError, rebuild as read_parked};
use crate::parking::revive::revive;
use crate::parking::{KeyHash, ParkedSet};
use crate::position::Position;
use crate::sink::{SinkError, TailError};

use super::error::SessionEnd;
use super::policy::{self, from_sink};
use super::session::Session;
use super::state::State;

/// The parked keys the stream shows, for a session's sink.
pub(super) async fn rebuild(port: &NatsPort, settings: &Settings) -> Result<ParkedSet, SessionEnd> {
    let c = settings.config();
    let max = usize::try_from(c.outbox.max_parked_keys).unwrap_or(usize::MAX);
    read_parked(
        port,
        &c.nats.stream,
        &c.nats.dead_letter_subject,
        max,
        settings.ack_timeout,
    )
    .await
    .map_err(|e| match e {
        RebuildError::Read { stream, source } => policy::from_tail(TailError { stream, source }),
        RebuildError::Full { stream, max, key } => {
            policy::from_sink(SinkError::ParkedTooMany { stream, max, key })
        }
    })
}

/// Sets the parking gauges from `parked`.
pub(super) fn gauges(metrics: &Metrics, parked: &ParkedSet) {
    let oldest = parked
        .oldest()
        .and_then(crate::parking::set::since_unix_ms)
        .map_or(0, |t| t.max(1));
    metrics.parking.set(parked.len(), parked.events(), oldest);
}

impl Session {
    /// A control message at `at` (`commit_ts`: its transaction's): carried out as the design says,
    /// decided from the stream and never from memory, so a replay expands it the same way. First
    /// everything before it is stored (acked), so the stream shows the key as it is at the
    /// message; then its release marker at `at`.0 and, for a requeue, the key's run at `at`.1,
    /// `at`.2, … — each copy read back from the stream, validated again and published to its own
    /// subject with its own id, or, from the first still invalid on, parked again.
    pub(super) async fn on_control(
        &mut self,
        state: &mut State,
        control: Control,
        at: Position,
        commit_ts: i64,
    ) -> Result<(), SessionEnd> {
        let op = control.op();
        let (key, release) = match control {
            Control::Requeue(k) => (k, Release::Requeued),
            Control::Discard(k) => (k, Release::Discarded),
            Control::RequeueEvent { event_id, request } => {
                warn!(%event_id, %request, position = %at, "requeue_event is not carried out by this version: the dead letter stays");
                self.metrics.parking.control(op, ControlResult::Nothing);
                return Ok(());
            }
        };
        self.store_all(state).await?;
        let hash = KeyHash::of(key.aggregate_type.as_deref(), key.aggregate_id.as_deref());
        let c = self.settings.config();
        let (stream, dl) = (&c.nats.stream, &c.nats.dead_letter_subject);
        let timeout = self.settings.ack_timeout;
        let bounds = ledger::run_bounds(&self.port, stream, dl, hash, &key.request, timeout)
            .await
            .map_err(|source| read_failed(stream, source))?;
        if bounds.before.is_none() && bounds.copies == 0 {
            info!(request = %key.request, position = %at, key = %key_text(&key), "control message for a key that is not parked: nothing to release");
            self.metrics.parking.control(op, ControlResult::Nothing);
            return Ok(());
        }
        let mut marker = OutboxEvent::at(bytes::Bytes::new(), at.lsn, at.index, commit_ts, None);
        marker.position = at;
        marker.msg_id = crate::message::parked::released_id(&key.request);
        marker.aggregate_type = key.aggregate_type.clone();
        marker.aggregate_id = key.aggregate_id.clone();
        let seq = self.progress.publish();
        self.sink
            .submit_marker(seq, Box::new(marker), &key.request, release)
            .await
            .map_err(from_sink)?;
        if release == Release::Requeued {
            self.requeue_run(hash, bounds, &key.request, at, commit_ts)
                .await?;
        }
        info!(request = %key.request, position = %at, key = %key_text(&key), how = release.as_str(), "released a parked key");
        self.metrics.parking.control(op, ControlResult::Applied);
        Ok(())
    }

    /// Republishes the run `bounds` names on `hash`'s subject, one copy at a time.
    async fn requeue_run(
        &mut self,
        hash: KeyHash,
        bounds: ledger::RunBounds,
        request: &str,
        at: Position,
        commit_ts: i64,
    ) -> Result<(), SessionEnd> {
        let c = self.settings.config();
        let (stream, dl) = (c.nats.stream.clone(), c.nats.dead_letter_subject.clone());
        let timeout = self.settings.ack_timeout;
        let mut run = ledger::read_run(&self.port, &stream, &dl, hash, bounds, timeout)
            .await
            .map_err(|source| read_failed(&stream, source))?;
        self.sink.set_requeue(Some(request.to_owned()));
        let mut sub = 1u32;
        let result = loop {
            let copy = match run.next().await {
                Ok(Some(copy)) => copy,
                Ok(None) => break Ok(()),
                Err(source) => break Err(read_failed(&stream, source)),
            };
            let mut event = revive(&copy, at.with_sub(sub), commit_ts);
            if event.problem.is_none() {
                self.stage.check_again(&mut event);
            }
            let seq = self.progress.publish();
            if let Err(e) = self.sink.submit(seq, Box::new(event)).await {
                break Err(from_sink(e));
            }
            sub = sub.saturating_add(1);
        };
        self.sink.set_requeue(None);
        result
    }

    /// Waits until everything handed to the sink so far is stored (or proven so by the replay
    /// later), taking the acks as they come: the stream then shows what is parked.
    async fn store_all(&mut self, state: &mut State) -> Result<(), SessionEnd> {
        loop {
            self.on_acks(state).await?;
            if self.progress.in_flight() <= self.sink.unverified() {
                return Ok(());
            }
            self.sink.ready().await;
        }
    }
}

/// The parking subjects could not be read: the session restarts, as for the stream's tail.
fn read_failed(stream: &str, source: crate::nats::NatsError) -> SessionEnd {
    policy::from_tail(TailError {
        stream: stream.to_owned(),
        source,
    })
}

/// A control message's key as one escaped line.
fn key_text(k: &crate::parking::control::KeyRequest) -> String {
    let part = |v: &Option<String>| {
        v.as_deref().map_or_else(
            || "(null)".to_owned(),
            |s| crate::text::cut(&s.escape_debug().to_string(), 256).to_owned(),
        )
    };
    format!("{}/{}", part(&k.aggregate_type), part(&k.aggregate_id))
}
