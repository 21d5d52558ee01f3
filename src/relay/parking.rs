//! The session's side of parking (`outbox.on_invalid = "park"`): the parked set a session starts
//! from, read from the stream after its tail ([`rebuild`]: a read that fails restarts the
//! session, more parked keys than `outbox.max_parked_keys` stop the relay with one line naming a
//! key and the setting), the parking gauges set from the sink's parked set ([`gauges`]), and the
//! parts of carrying out a control message (`Session::on_control` in `session.rs` puts them in
//! order): which run the stream says it releases ([`bounds_of`]), its marker ([`marker_event`]) and
//! the run read back and republished ([`requeue_run`]). The I/O the outbox stage asks for, as for a
//! partition lookup.

use tracing::info;

use crate::config::Settings;
use crate::event::OutboxEvent;
use crate::message::parked::Release;
use crate::metrics::{ControlResult, Metrics};
use crate::nats::NatsPort;
use crate::outbox::OutboxStage;
use crate::parking::control::{Control, KeyRequest};
use crate::parking::ledger::{self, RebuildError, rebuild as read_parked};
use crate::parking::revive::revive_of_key;
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
        RebuildError::Full { stream, max, key } => policy::from_sink(SinkError::ParkedTooMany {
            stream,
            max,
            key,
            command: settings.command("parked"),
        }),
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

/// What a control message asks of the session.
pub(super) enum Asked {
    /// A key to release, and how.
    Release(KeyRequest, Release),
    /// One dead letter to republish.
    DeadLetter {
        /// The event's id.
        event_id: String,
        /// The request id.
        request: String,
    },
    /// Nothing this relay does (counted and logged).
    Nothing,
}

/// What `control` at `at` asks of the session: a key's requeue or discard only in park mode (no
/// other mode parks a key, and the stream need not store the parking subjects then: counted and
/// logged as nothing to do); a dead letter's requeue in every mode.
pub(super) fn asked(control: Control, at: Position, park: bool, metrics: &Metrics) -> Asked {
    let op = control.op();
    match control {
        Control::Requeue(k) | Control::Discard(k) if !park => {
            info!(request = %k.request, position = %at, key = %key_text(&k), "control message for a key, but outbox.on_invalid is not \"park\": nothing to release");
            metrics.parking.control(op, ControlResult::Nothing);
            Asked::Nothing
        }
        Control::Requeue(k) => Asked::Release(k, Release::Requeued),
        Control::Discard(k) => Asked::Release(k, Release::Discarded),
        #[cfg(feature = "test-support")]
        Control::RequeueEvent { .. }
            if crate::parking::mutation::on(
                crate::parking::mutation::Mutation::IgnoreRequeueEvent,
            ) =>
        {
            Asked::Nothing
        }
        Control::RequeueEvent { event_id, request } => Asked::DeadLetter { event_id, request },
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
        let mut event = revive_of_key(
            &copy,
            key.aggregate_type.as_deref(),
            key.aggregate_id.as_deref(),
            at.with_sub(sub),
            commit_ts,
        );
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

/// Republishes the dead letter of `event_id` at `at` (sub-index 0), for control request
/// `request`: found on exactly `nats.dead_letter_subject` (the newest of that event), read back
/// as the event it was, checked again against today's schemas and handed to the sink, which
/// routes it to its subject with its own id as `Nats-Msg-Id` (a second copy after a crash is
/// then JetStream's duplicate, or the fence's replay skip), or, still invalid, to a new dead
/// letter `dead-letter:<id>:<request>` with the new reason. `false` (nothing sent) when the
/// stream holds no dead letter of it.
pub(super) async fn requeue_dead_letter(
    r: Requeue<'_>,
    event_id: &str,
    request: &str,
    at: Position,
    commit_ts: i64,
) -> Result<bool, SessionEnd> {
    let c = r.settings.config();
    let (stream, dl) = (&c.nats.stream, &c.nats.dead_letter_subject);
    let found =
        crate::parking::dead_letter::find(r.port, stream, dl, event_id, r.settings.ack_timeout)
            .await
            .map_err(|source| read_failed(stream, source))?;
    let Some(letter) = found else {
        return Ok(false);
    };
    let mut event = crate::parking::revive::revive_dead_letter(&letter, at, commit_ts);
    if event.problem.is_none() {
        r.stage.check_again(&mut event);
    }
    r.sink.set_requeue_dead_letter(Some(request.to_owned()));
    let seq = r.progress.publish();
    let sent = r.sink.submit(seq, Box::new(event)).await;
    r.sink.set_requeue_dead_letter(None);
    sent.map_err(from_sink)?;
    Ok(true)
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
