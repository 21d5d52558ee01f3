//! The session's side of parking (`outbox.on_invalid = "park"`): the parked set a session starts
//! from, read from the stream after its tail ([`rebuild`]: a read that fails restarts the
//! session, more parked keys than `outbox.max_parked_keys` stop the relay with one line naming a
//! key and the setting), the parking gauges set from the sink's parked set ([`gauges`]), and the
//! parts of carrying out a control message (`Session::on_control` in `session.rs` puts them in
//! order): which run the stream says it releases ([`bounds_of`]), its marker ([`marker_event`]) and
//! the run read back and republished ([`requeue_run`]). The I/O the outbox stage asks for, as for a
//! partition lookup.

use tracing::{info, warn};

use crate::config::Settings;
use crate::event::OutboxEvent;
use crate::message::parked::Release;
use crate::metrics::{ControlResult, Metrics};
use crate::nats::NatsPort;
use crate::outbox::OutboxStage;
use crate::parking::control::{Control, KeyRequest};
use crate::parking::ledger::{self, RebuildError, rebuild as read_parked};
use crate::parking::revive::revive;
use crate::parking::{KeyHash, ParkedSet};
use crate::position::Position;
use crate::progress::Progress;
use crate::sink::{Sink, SinkError};
use crate::tail::TailError;

use super::error::SessionEnd;
use super::policy::{self, from_sink};

/// The parked keys the stream shows, for a session's sink.
pub(super) async fn rebuild(port: &NatsPort, settings: &Settings) -> Result<ParkedSet, SessionEnd> {
    let c = settings.config();
    let max = usize::try_from(c.outbox.max_parked_keys).unwrap_or(usize::MAX);
    #[cfg(feature = "test-support")]
    if crate::parking::mutation::on(crate::parking::mutation::Mutation::NoRebuild) {
        return Ok(ParkedSet::new(max));
    }
    #[allow(unused_mut)]
    let mut set = read_parked(
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
    })?;
    #[cfg(feature = "test-support")]
    if crate::parking::mutation::on(crate::parking::mutation::Mutation::RunFromMemory) {
        set.memory_from = port
            .last_sequence(&c.nats.stream, settings.ack_timeout)
            .await
            .map_err(|source| read_failed(&c.nats.stream, source))?;
    }
    Ok(set)
}

/// Sets the parking gauges from `parked`.
pub(super) fn gauges(metrics: &Metrics, parked: &ParkedSet) {
    let oldest = parked
        .oldest()
        .and_then(crate::parking::set::since_unix_ms)
        .map_or(0, |t| t.max(1));
    metrics.parking.set(parked.len(), parked.events(), oldest);
}

/// What [`requeue_run`] works with: the session's sink, stage and progress, and where to read.
pub(super) struct Requeue<'a> {
    pub(super) sink: &'a mut Sink,
    pub(super) stage: &'a mut OutboxStage,
    pub(super) progress: &'a mut Progress,
    pub(super) port: &'a NatsPort,
    pub(super) settings: &'a Settings,
}

/// What a control message asks of the session: a key to release and how, or nothing to do
/// (`requeue_event`, which this version reads but does not carry out: counted and warned).
pub(super) fn release_of(
    control: Control,
    at: Position,
    metrics: &Metrics,
) -> Option<(KeyRequest, Release)> {
    let op = control.op();
    match control {
        Control::Requeue(k) => Some((k, Release::Requeued)),
        Control::Discard(k) => Some((k, Release::Discarded)),
        Control::RequeueEvent { event_id, request } => {
            warn!(%event_id, %request, position = %at, "requeue_event is not carried out by this version: the dead letter stays");
            metrics.parking.control(op, ControlResult::Nothing);
            None
        }
    }
}

/// Which run `key`'s release covers, read from the stream; `None` (counted, logged) when there is
/// nothing to release: no marker of this request and no parked copy after the key's last.
pub(super) async fn bounds_of(
    port: &NatsPort,
    settings: &Settings,
    metrics: &Metrics,
    key: &KeyRequest,
    op: crate::metrics::ControlOp,
    at: Position,
) -> Result<Option<ledger::RunBounds>, SessionEnd> {
    let c = settings.config();
    let (stream, dl) = (&c.nats.stream, &c.nats.dead_letter_subject);
    let hash = KeyHash::of(key.aggregate_type.as_deref(), key.aggregate_id.as_deref());
    let bounds = ledger::run_bounds(port, stream, dl, hash, &key.request, settings.ack_timeout)
        .await
        .map_err(|source| read_failed(stream, source))?;
    if bounds.before.is_none() && bounds.copies == 0 {
        info!(request = %key.request, position = %at, key = %key_text(key), "control message for a key that is not parked: nothing to release");
        metrics.parking.control(op, ControlResult::Nothing);
        return Ok(None);
    }
    Ok(Some(bounds))
}

/// The release marker's synthetic event: at `at`, with the request's marker id and the key.
pub(super) fn marker_event(key: &KeyRequest, at: Position, commit_ts: i64) -> Box<OutboxEvent> {
    let mut marker = OutboxEvent::at(bytes::Bytes::new(), at.lsn, at.index, commit_ts, None);
    marker.position = at;
    marker.msg_id = crate::message::parked::released_id(&key.request);
    marker.aggregate_type = key.aggregate_type.clone();
    marker.aggregate_id = key.aggregate_id.clone();
    Box::new(marker)
}

/// Republishes the run `bounds` names on `key`'s subject, one copy at a time: each read back,
/// validated again by the stage and handed to the sink at `at`.1, `at`.2, …; the sink's
/// destination parks a still-invalid one again (`parked:<id>:<request>`).
pub(super) async fn requeue_run(
    r: Requeue<'_>,
    key: &KeyRequest,
    bounds: ledger::RunBounds,
    at: Position,
    commit_ts: i64,
) -> Result<(), SessionEnd> {
    let c = r.settings.config();
    let (stream, dl) = (&c.nats.stream, &c.nats.dead_letter_subject);
    let hash = KeyHash::of(key.aggregate_type.as_deref(), key.aggregate_id.as_deref());
    let mut run = ledger::read_run(r.port, stream, dl, hash, bounds, r.settings.ack_timeout)
        .await
        .map_err(|source| read_failed(stream, source))?;
    r.sink.set_requeue(Some(key.request.clone()));
    let mut sub = 1u32;
    let result = loop {
        let copy = match run.next().await {
            Ok(Some(copy)) => copy,
            Ok(None) => break Ok(()),
            Err(source) => break Err(read_failed(stream, source)),
        };
        #[cfg(feature = "test-support")]
        if crate::parking::mutation::on(crate::parking::mutation::Mutation::RunFromMemory)
            && copy.seq <= r.sink.parked().memory_from
        {
            continue;
        }
        let mut event = revive(&copy, at.with_sub(sub), commit_ts);
        if event.problem.is_none() {
            r.stage.check_again(&mut event);
        }
        let seq = r.progress.publish();
        if let Err(e) = r.sink.submit(seq, Box::new(event)).await {
            break Err(from_sink(e));
        }
        sub = sub.saturating_add(1);
    };
    r.sink.set_requeue(None);
    result
}

/// The parking subjects could not be read: the session restarts, as for the stream's tail.
fn read_failed(stream: &str, source: crate::nats::NatsError) -> SessionEnd {
    policy::from_tail(TailError {
        stream: stream.to_owned(),
        source,
    })
}

/// A control message's key as one escaped line.
pub(super) fn key_text(k: &KeyRequest) -> String {
    let part = |v: &Option<String>| {
        v.as_deref().map_or_else(
            || "(null)".to_owned(),
            |s| crate::text::cut(&s.escape_debug().to_string(), 256).to_owned(),
        )
    };
    format!("{}/{}", part(&k.aggregate_type), part(&k.aggregate_id))
}
