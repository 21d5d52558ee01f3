//! One pass of `status` over the facts ([`Facts`]): what is read, in order, and what the rules in
//! `slot.rs`, `checks.rs` and `retention.rs` make of it. Reads nothing but the facts, so the
//! deterministic simulation, which implements [`Facts`] over its servers, runs this very code.
//!
//! Since when no relay holds the slot: Postgres 17 records it (`inactive_since`); before 17 nothing
//! does, so [`watch_unheld`] looks at the slot until a relay takes it or the grace period is over.

use std::time::{Duration, Instant};

use super::checks::{
    backfill_status, dead_letter_warning, missing_problems, own_word_findings, schemas_status,
    server_warnings, stream_warnings,
};
use super::facts::{FactError, Facts};
use super::parked::{parked_problem, reads_parked};
use super::report::{
    PostgresSide, PublicationStatus, RelayState, RelayStatus, ServerStatus, SlotStatus,
    StandbyStatus, State, Status, StreamStatus,
};
use super::retention::{orphan_mark_problems, retention_warnings};
use super::slot::{
    consumed_found, needs_look, relay_state, slot_problems, slot_status, waiting_found,
};
use super::stream::stored_by_tail;
use crate::config::Settings;
use crate::slot_mark;
use crate::warning::Warning;

/// A status, and whether the slot needs watching (how long) to tell how long it has been unheld.
pub(super) struct Gathered {
    pub(super) status: Status,
    pub(super) watch: Option<Duration>,
}

/// One pass over the servers; `watched`: how long an earlier pass watched the slot unheld.
pub(super) async fn gather(
    facts: &impl Facts,
    settings: &Settings,
    max_lag_bytes: i64,
    watched: Option<Duration>,
) -> Gathered {
    let (mut problems, mut warnings) = (Vec::new(), Vec::<Warning>::new());
    let config = settings.config();
    let mut pg = postgres_side(facts, settings, &mut problems, &mut warnings).await;
    if let Some(w) = watched {
        pg.slot.unheld_secs = Some(w.as_secs());
        pg.slot.unheld_measured = Some("watched");
    }
    let stream = stream_side(facts, settings, &mut problems).await;
    pg.relay.own_word = facts.own_word().await;
    own_word_findings(settings, &mut pg.relay, &mut problems, &mut warnings);
    // A walsender holds the slot, but the relay says it does not stream: its events wait.
    if pg.relay.state == RelayState::NotStreaming {
        let found = facts.waiting().await;
        waiting_found(found, &mut pg.slot, &mut pg.events_unknown);
    }
    // The checks `run` makes, so a configuration `run` rejects is never called healthy.
    if pg.server.state == State::Exists
        && stream.state == State::Exists
        && let Err(e) = facts.run_checks().await
    {
        problems.push(e.0);
    }
    let backfill = backfill_status(settings, &stream, &mut problems);
    slot_problems(
        settings,
        &pg,
        &stream,
        backfill.is_some(),
        &mut problems,
        &mut warnings,
    );
    let consumed =
        consumed_problem(facts, settings, &pg, &stream, &mut problems, &mut warnings).await;
    missing_problems(settings, &pg, &stream, &mut problems);
    problems.extend(lag_problem(settings, &pg.slot, max_lag_bytes));
    retention_warnings(settings, &pg, &mut warnings);
    orphan_mark_problems(&pg.orphan_marks, &mut problems);
    stream_warnings(settings, &stream, &mut warnings);
    dead_letter_warning(settings, &stream, &mut warnings);
    server_warnings(settings, &pg, &mut warnings);
    let standbys = facts.standbys(pg.server.host.as_deref()).await;
    standby_warnings(&standbys, &pg.slot, &mut warnings);
    let schemas = schemas_status(settings, &mut problems);
    let (warnings, acknowledged_warnings) =
        crate::warning::split_acknowledged(warnings, &config.warnings.acknowledged);
    let watch = watched
        .is_none()
        .then(|| watch_for(settings, &pg))
        .flatten();
    let mut slot = pg.slot;
    slot.consumed_events = consumed;
    Gathered {
        status: Status {
            healthy: problems.is_empty(),
            postgres: pg.server,
            standbys,
            slot,
            relay: pg.relay,
            publication: pg.publication,
            stream,
            schemas,
            backfill,
            orphan_marks: pg.orphan_marks,
            grace_secs: config.status.grace_secs,
            problems,
            warning_names: warnings.iter().map(|w| w.name).collect(),
            warnings,
            acknowledged_warnings,
        },
        watch,
    }
}

/// The stream, with its parked keys when it can hold any: each one is a problem (`parked.rs`).
async fn stream_side(
    facts: &impl Facts,
    settings: &Settings,
    problems: &mut Vec<String>,
) -> StreamStatus {
    let read = facts.stream().await;
    problems.extend(read.problem);
    let mut stream = read.status;
    if stream.state == State::Exists && reads_parked(settings, stream.subjects.as_deref()) {
        match facts.parked().await {
            Ok(p) => {
                problems.extend(parked_problem(settings, &stream.name, &p));
                stream.parked = Some(p);
            }
            Err(e) => problems.push(e.0),
        }
    }
    stream
}

/// A slot further behind than `max_lag_bytes`, even while a relay streams it: the relay is stalled
/// or too slow.
fn lag_problem(settings: &Settings, slot: &SlotStatus, max_lag_bytes: i64) -> Option<String> {
    let lag = slot.lag_bytes.filter(|&l| l > max_lag_bytes)?;
    Some(format!(
        "slot {} is {lag} bytes behind the WAL (more than {max_lag_bytes}): is the relay running and acknowledged?",
        settings.config().postgres.slot
    ))
}

/// How long to watch a slot no relay holds, with nothing waiting in it: before 17 only watching
/// tells how long it has been unheld (see `status`).
fn watch_for(settings: &Settings, pg: &PostgresSide) -> Option<Duration> {
    (pg.server.version_num.is_some_and(|v| v < 170000)
        && pg.slot.state == State::Exists
        && pg.slot.active == Some(false)
        && pg.slot.events_waiting == Some(false))
    .then(|| Duration::from_secs(settings.config().status.grace_secs))
}

/// The server, slot, relay and publication, and the `pg_logical_emit_message` grant warning; a
/// failure is a problem, never an early return.
async fn postgres_side(
    facts: &impl Facts,
    settings: &Settings,
    problems: &mut Vec<String>,
    warnings: &mut Vec<Warning>,
) -> PostgresSide {
    let mut side = PostgresSide {
        server: ServerStatus::unread(State::Unreachable),
        slot: slot_status(&settings.config().postgres.slot, State::Unreachable, None),
        relay: RelayStatus {
            state: RelayState::Unknown,
            pids: Vec::new(),
            own_word: None,
        },
        publication: PublicationStatus {
            name: settings.config().postgres.publication.clone(),
            exists: false,
            tables: Vec::new(),
        },
        events_unknown: None,
        orphan_marks: Vec::new(),
    };
    if let Err(e) = facts.postgres().await {
        side.server.state = e.state;
        problems.push(e.error);
        return side;
    }
    side.server.state = State::Exists;
    if let Err(e) = read_postgres(facts, settings, &mut side).await {
        problems.push(format!("postgres: {e}"));
    }
    match facts.message_warnings().await {
        Ok(w) => warnings.extend(w),
        Err(e) => problems.push(format!("postgres: {e}")),
    }
    match facts.orphan_marks().await {
        Ok(marks) => side.orphan_marks = marks,
        Err(e) => problems.push(format!("postgres: {e}")),
    }
    side
}

/// The server, the slot and whether events wait in it, the relay processes, the publication; the
/// first fact that cannot be read ends the reading (what was read stands).
async fn read_postgres(
    facts: &impl Facts,
    settings: &Settings,
    side: &mut PostgresSide,
) -> Result<(), FactError> {
    side.server = facts.server().await?;
    let name = &settings.config().postgres.slot;
    let row = facts.slot().await?;
    let state = match row {
        Some(_) => State::Exists,
        None => State::Missing,
    };
    side.slot = slot_status(name, state, row.as_ref());
    side.relay.pids = facts.relay_pids().await?;
    side.relay.state = relay_state(row.as_ref(), &side.relay.pids);
    if row.as_ref().is_some_and(needs_look) {
        let found = facts.waiting().await;
        waiting_found(found, &mut side.slot, &mut side.events_unknown);
        if side.server.version_num.unwrap_or(0) >= 170000 {
            side.slot.unheld_secs = facts.unheld_secs().await?;
            side.slot.unheld_measured = side.slot.unheld_secs.map(|_| "inactive_since");
        }
    }
    let publication = facts.publication().await?;
    side.publication.exists = publication.exists;
    side.publication.tables = publication.tables;
    Ok(())
}

/// A client other than a relay consumed the slot past events the stream lacks, as the stop mark
/// the last relay session left shows (`slot_mark.rs`): a problem that names the recovery. Returns
/// how many events, when a mark was judged.
async fn consumed_problem(
    facts: &impl Facts,
    settings: &Settings,
    pg: &PostgresSide,
    stream: &StreamStatus,
    problems: &mut Vec<String>,
    warnings: &mut Vec<Warning>,
) -> Option<u64> {
    let slot = &settings.config().postgres.slot;
    let slot_at = pg.slot.confirmed_flush_lsn.as_deref()?.parse().ok()?;
    if stream.state != State::Exists || facts.postgres().await.is_err() {
        return None;
    }
    let nats = facts.nats().await?;
    let stored = stored_by_tail(&nats, slot, &stream.name).await;
    let found = match facts.mark_at().await {
        Err(e) => Err(e),
        Ok(mark_at) => {
            let scan = |after| facts.scan_mark(slot_at, after);
            slot_mark::judge_from(settings, mark_at, slot_at, &stored, scan).await
        }
    };
    consumed_found(slot, found, problems, warnings)
}

/// A standby with no synced copy of a failover slot: a failover to it would lose the slot.
fn standby_warnings(standbys: &[StandbyStatus], slot: &SlotStatus, warnings: &mut Vec<Warning>) {
    for st in standbys {
        if st.in_recovery == Some(true) && slot.failover == Some(true) && st.synced != Some(true) {
            warnings.push(Warning::new(
                "standby-without-slot",
                format!(
                    "standby {} has no synced copy of slot {}: a failover to it would lose the slot \
                     (set sync_replication_slots = on, hot_standby_feedback = on and a primary_conninfo with dbname \
                     there)",
                    st.host, slot.name
                ),
            ));
        }
    }
}

/// Before PG 17, where Postgres does not record since when a slot is unheld: looks at the slot
/// every half second until a relay takes it (returns `None`) or `grace` is over (returns the time
/// watched). Progress on stderr, so an operator knows why `status` waits.
pub(super) async fn watch_unheld(
    facts: &impl Facts,
    settings: &Settings,
    grace: Duration,
) -> Result<Option<Duration>, String> {
    facts.postgres().await.map_err(|e| e.error)?;
    let slot = &settings.config().postgres.slot;
    eprintln!(
        "status: no relay holds slot {slot}, and Postgres before 17 does not record since when: watching it for up \
         to {} s (status.grace_secs) for a relay to take it",
        grace.as_secs()
    );
    let start = Instant::now();
    loop {
        if facts.held().await.map_err(|e| e.to_string())? {
            return Ok(None);
        }
        if start.elapsed() >= grace {
            return Ok(Some(start.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(500).min(grace)).await;
    }
}
