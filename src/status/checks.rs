//! `status`'s verdict on everything but the slot, free of I/O: whether the relay's own word is
//! believed and what it adds to what Postgres shows, a publication or stream that is missing,
//! failover readiness, the stream's fill, durability, duplicate window and dead letters, the schema
//! directory as it loads now, and a backfill that has not finished. Each rule adds problems (which
//! make the status unhealthy) or warnings (which do not) to the lists the command prints.

use super::report::PostgresSide;
use super::report::{BackfillStatus, RelayState, RelayStatus, SchemasStatus, State, StreamStatus};
use super::text::last_ack;
use crate::config::Settings;
use crate::warning::Warning;

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
        marker.refusal(settings)
    ));
    Some(BackfillStatus {
        marker: crate::backfill_marker::META_BACKFILL,
        recover: marker.recovery(settings),
        backfill: marker,
    })
}

/// A publication or stream that its server says is not there: setup creates them.
pub(super) fn missing_problems(
    settings: &Settings,
    pg: &PostgresSide,
    stream: &StreamStatus,
    problems: &mut Vec<String>,
) {
    let setup = settings.command("setup");
    if pg.server.state == State::Exists && !pg.publication.exists {
        problems.push(format!(
            "publication {} does not exist: run {setup}",
            pg.publication.name
        ));
    }
    if stream.state == State::Missing {
        problems.push(format!(
            "stream {} does not exist: run {setup}",
            stream.name
        ));
    }
}

/// The dead letters the stream holds, as a warning naming how many and the newest (its sequence,
/// time, event id and reason): events the relay could not publish as they are, which consumers of
/// the events' own subjects never see (P7).
pub(super) fn dead_letter_warning(
    settings: &Settings,
    stream: &StreamStatus,
    warnings: &mut Vec<Warning>,
) {
    let Some(d) = stream.dead_letters.as_ref().filter(|d| d.count > 0) else {
        return;
    };
    let newest = d
        .newest
        .as_ref()
        .map(|n| {
            format!(
                "; the newest, sequence {} at {}: event {}: {}",
                n.sequence,
                n.time,
                n.event_id.as_deref().unwrap_or("(no id)"),
                n.reason.as_deref().unwrap_or("(no reason)")
            )
        })
        .unwrap_or_default();
    warnings.push(Warning::new(
        "dead-letters",
        format!(
            "stream {} holds {} dead letter{} on {}{newest}: fix the cause, then {} for each event that matters (or \
             insert its row again with the same id) (docs/operations.md, OutboxRelayDeadLetters); this warning stays \
             while the stream keeps them, requeued or not (outbox-relay verify tells which were)",
            stream.name,
            d.count,
            if d.count == 1 { "" } else { "s" },
            d.subject,
            settings.command("requeue --event ID"),
        ),
    ));
}

/// Failover readiness: connected to a standby, or a slot a promotion would lose.
pub(super) fn server_warnings(settings: &Settings, pg: &PostgresSide, warnings: &mut Vec<Warning>) {
    let slot_name = &settings.config().postgres.slot;
    if pg.server.in_recovery == Some(true) {
        warnings.push(Warning::new(
            "reached-standby",
            "postgres.url reached a standby: the relay streams from the primary; list the primary's host \
             too, with target_session_attrs=read-write",
        ));
    }
    if pg.slot.failover == Some(false) && pg.server.in_recovery == Some(false) {
        warnings.push(Warning::new(
            "not-failover-slot",
            format!(
                "slot {slot_name} is not a failover slot: it will not survive a promotion of a standby \
                 (PG 17+: postgres.failover = true and {} alter it while no relay streams it)",
                settings.command("setup")
            ),
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

/// Whether the relay's own word is believed ([`crate::relay_word::RelayWord::judge`]), and what it
/// adds to what Postgres shows: a believed relay that says it is not ready while its walsender
/// holds the slot is not streaming (the relay's state becomes [`RelayState::NotStreaming`], which
/// the text and the JSON both show) and a problem; a listener that is not believed, where its word
/// would have mattered, is a warning saying why; a relay Postgres shows that could not be asked, or
/// `http.listen` left empty, is said to be unknown.
pub(super) fn own_word_findings(
    settings: &Settings,
    relay: &mut RelayStatus,
    problems: &mut Vec<String>,
    warnings: &mut Vec<Warning>,
) {
    let shown = matches!(relay.state, RelayState::Streaming | RelayState::Retrying);
    if let Some(w) = &mut relay.own_word {
        let c = settings.config();
        w.judge(shown, &c.postgres.slot, &c.nats.stream);
    }
    match &relay.own_word {
        Some(w) if w.believed && w.ready == Some(false) => {
            if relay.state == RelayState::Streaming {
                relay.state = RelayState::NotStreaming;
            }
            problems.push(format!(
                "the relay at http {} is not streaming: {}{}",
                w.address,
                w.not_ready_because.as_deref().unwrap_or("not ready"),
                last_ack(w)
            ));
        }
        Some(w)
            if w.reached
                && !w.believed
                && (relay.state == RelayState::Streaming || w.ready == Some(true)) =>
        {
            warnings.push(Warning::new(
                "own-word-not-believed",
                format!(
                    "what answers on http.listen {} is not taken for the relay's own word: {}",
                    w.address,
                    w.not_believed_because.as_deref().unwrap_or("-")
                ),
            ));
        }
        Some(w) if !w.reached && shown => warnings.push(Warning::new(
            "own-word-unknown",
            format!(
                "could not ask the relay what it knows itself ({}): this status is what Postgres and NATS show; \
                 run status where http.listen is reachable",
                w.error.as_deref().unwrap_or("no answer")
            ),
        )),
        None if shown => warnings.push(Warning::new(
            "own-word-unknown",
            "http.listen is empty: status cannot ask the relay what it knows itself, only what Postgres \
             and NATS show (a relay whose NATS connection died looks streaming until its ack timeout)",
        )),
        _ => {}
    }
}

/// The share of a limit the stream fills from which `status` warns.
pub(super) const FULL_WARNING: f64 = 0.8;

/// A warning per limit (`max_msgs`, `max_bytes`) the stream fills to 80 % or more, saying what
/// happens when it is full under its discard policy.
pub(super) fn fill_warnings(stream: &StreamStatus, warnings: &mut Vec<Warning>) {
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
            warnings.push(Warning::new(
                "stream-filling",
                format!(
                    "stream {} is {:.0} % full: {used} of its {limit} {max}; {what}: raise {limit} or let consumers' \
                     retention free it",
                    stream.name,
                    100.0 * used as f64 / max as f64
                ),
            ));
        }
    }
}

pub(super) fn stream_warnings(
    settings: &Settings,
    stream: &StreamStatus,
    warnings: &mut Vec<Warning>,
) {
    if stream.exists != Some(true) {
        return;
    }
    fill_warnings(stream, warnings);
    let storage = stream.storage.as_deref().unwrap_or("");
    if storage == "memory" {
        warnings.push(Warning::new(
            "memory-storage",
            "stream uses memory storage: acknowledged events do not survive a nats-server restart",
        ));
    }
    if storage == "file" && stream.replicas == Some(1) {
        warnings.push(Warning::new(
            "one-replica",
            "stream has one replica: an ack means written to that server's OS, not fsynced; power loss can \
             lose acknowledged events unless nats-server runs with sync_interval: always (or use 3 replicas)",
        ));
    }
    // A republish after a failure comes at most one ack timeout plus the longest backoff (30 s) after
    // the first attempt; a shorter duplicate window lets such a republish be stored twice.
    let retry_horizon = settings.ack_timeout.as_secs() + 30;
    let window = stream.duplicate_window_secs.unwrap_or(0);
    if window < retry_horizon {
        warnings.push(Warning::new(
            "duplicate-window",
            format!(
                "stream duplicate window is {window}s, shorter than the relay's retry horizon of {retry_horizon}s: \
                 republished events may be stored twice; raise the stream's duplicate_window"
            ),
        ));
    }
}
