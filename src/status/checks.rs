//! `status`'s verdict on everything but the slot, free of I/O: what the relay's own word adds to
//! what Postgres shows, a publication or stream that is missing, failover readiness, the stream's
//! fill, durability and duplicate window, the schema directory as it loads now, and a backfill that
//! has not finished. Each rule adds problems (which make the status unhealthy) or warnings (which
//! do not) to the lists the command prints.

use super::PostgresSide;
use super::report::{BackfillStatus, RelayState, RelayStatus, SchemasStatus, State, StreamStatus};
use super::text::last_ack;
use crate::config::Settings;

/// The marker of a backfill of this slot that has begun and not finished, as a problem: `run`
/// refuses while it stands. (`setup`'s checks, which `status` runs too, leave it to this.)
pub(super) fn backfill_status(
    settings: &Settings,
    stream: &StreamStatus,
    problems: &mut Vec<String>,
) -> Option<BackfillStatus> {
    let marker = crate::backfill_marker::Marker::in_metadata(&stream.metadata)
        .filter(|m| m.guards(&settings.config().postgres.slot))?;
    problems.push(format!(
        "JetStream stream {}: {}",
        stream.name,
        marker.refusal(&stream.name)
    ));
    Some(BackfillStatus {
        marker: crate::backfill_marker::META_BACKFILL,
        recover: marker.recovery_command(),
        backfill: marker,
    })
}

/// A publication or stream that its server says is not there: setup creates them.
pub(super) fn missing_problems(
    pg: &PostgresSide,
    stream: &StreamStatus,
    problems: &mut Vec<String>,
) {
    if pg.server.state == State::Exists && !pg.publication.exists {
        problems.push(format!(
            "publication {} does not exist: run outbox-relay setup",
            pg.publication.name
        ));
    }
    if stream.state == State::Missing {
        problems.push(format!(
            "stream {} does not exist: run outbox-relay setup",
            stream.name
        ));
    }
}

/// Failover readiness: connected to a standby, or a slot a promotion would lose.
pub(super) fn server_warnings(slot_name: &str, pg: &PostgresSide, warnings: &mut Vec<String>) {
    if pg.server.in_recovery == Some(true) {
        warnings.push(
            "postgres.url reached a standby: the relay streams from the primary; list the primary's host \
             too, with target_session_attrs=read-write"
                .into(),
        );
    }
    if pg.slot.failover == Some(false) && pg.server.in_recovery == Some(false) {
        warnings.push(format!(
            "slot {slot_name} is not a failover slot: it will not survive a promotion of a standby \
             (PG 17+: postgres.failover = true and outbox-relay setup alter it while no relay streams it)"
        ));
    }
}

/// The schema directory as it loads now. One that does not is a problem: a relay keeps its
/// previous schemas, but one started now refuses to start.
pub(super) fn schemas_status(
    settings: &Settings,
    problems: &mut Vec<String>,
) -> Option<SchemasStatus> {
    let dir = &settings.config().outbox.schemas;
    if dir.is_empty() {
        return None;
    }
    let error = settings.schemas_error.as_ref().map(ToString::to_string);
    if let Some(e) = &error {
        problems.push(format!(
            "outbox.schemas: {e}: a running relay keeps the schemas it has, a relay started now refuses to start; fix the file, then send SIGHUP"
        ));
    }
    Some(SchemasStatus {
        dir: dir.clone(),
        loaded: error.is_none().then(|| settings.schemas.current().len()),
        error,
        required: settings.config().outbox.schemas_required,
    })
}

/// What the relay's own word adds to what Postgres shows: a relay that says it is not ready is a
/// problem (its slot can look active until the ack timeout ends the session); a relay Postgres
/// shows that could not be asked, or `http.listen` left empty, is said to be unknown.
pub(super) fn own_word_findings(
    relay: &RelayStatus,
    problems: &mut Vec<String>,
    warnings: &mut Vec<String>,
) {
    let shown = matches!(relay.state, RelayState::Streaming | RelayState::Retrying);
    match &relay.own_word {
        Some(w) if w.ready == Some(false) => problems.push(format!(
            "the relay at http {} is not streaming: {}{}",
            w.address,
            w.not_ready_because.as_deref().unwrap_or("not ready"),
            last_ack(w)
        )),
        Some(w) if !w.reached && shown => warnings.push(format!(
            "could not ask the relay what it knows itself ({}): this status is what Postgres and NATS show; \
             run status where http.listen is reachable",
            w.error.as_deref().unwrap_or("no answer")
        )),
        None if shown => warnings.push(
            "http.listen is empty: status cannot ask the relay what it knows itself, only what Postgres \
             and NATS show (a relay whose NATS connection died looks streaming until its ack timeout)"
                .into(),
        ),
        _ => {}
    }
}

/// The share of a limit the stream fills from which `status` warns.
pub(super) const FULL_WARNING: f64 = 0.8;

/// A warning per limit (`max_msgs`, `max_bytes`) the stream fills to 80 % or more, saying what
/// happens when it is full under its discard policy.
pub(super) fn fill_warnings(stream: &StreamStatus, warnings: &mut Vec<String>) {
    let what = match stream.discard.as_deref() {
        Some("new") => {
            "with discard new a full stream refuses new events and the relay stalls until it has room"
        }
        _ => "with discard old a full stream drops its oldest messages",
    };
    for (limit, used, max) in [
        ("max_msgs", stream.messages, stream.max_msgs),
        ("max_bytes", stream.bytes, stream.max_bytes),
    ] {
        if let (Some(used), Some(max)) = (used, max)
            && max > 0
            && used as f64 >= FULL_WARNING * max as f64
        {
            warnings.push(format!(
                "stream {} is {:.0} % full: {used} of its {limit} {max}; {what}: raise {limit} or let consumers' retention free it",
                stream.name,
                100.0 * used as f64 / max as f64
            ));
        }
    }
}

pub(super) fn stream_warnings(
    settings: &Settings,
    stream: &StreamStatus,
    warnings: &mut Vec<String>,
) {
    if stream.exists != Some(true) {
        return;
    }
    fill_warnings(stream, warnings);
    let storage = stream.storage.as_deref().unwrap_or("");
    if storage == "memory" {
        warnings.push(
            "stream uses memory storage: acknowledged events do not survive a nats-server restart"
                .into(),
        );
    }
    if storage == "file" && stream.replicas == Some(1) {
        warnings.push(
            "stream has one replica: an ack means written to that server's OS, not fsynced; power loss can \
             lose acknowledged events unless nats-server runs with sync_interval: always (or use 3 replicas)"
                .into(),
        );
    }
    // A republish after a failure comes at most one ack timeout plus the longest backoff (30 s) after
    // the first attempt; a shorter duplicate window lets such a republish be stored twice.
    let retry_horizon = settings.ack_timeout.as_secs() + 30;
    let window = stream.duplicate_window_secs.unwrap_or(0);
    if window < retry_horizon {
        warnings.push(format!(
            "stream duplicate window is {window}s, shorter than the relay's retry horizon of {retry_horizon}s: \
             republished events may be stored twice; raise the stream's duplicate_window"
        ));
    }
}
