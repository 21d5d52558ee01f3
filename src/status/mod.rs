//! `outbox-relay status`: the slot and the stream as the servers see them, and a verdict.
//!
//! Healthy means: both servers answer; the slot exists, is not invalidated, and either a relay
//! streams it or no event waits in it; the publication and the stream exist; and every check `run`
//! makes before streaming passes. Unreachable, missing and (for JetStream) not enabled are different
//! states and are reported as such. It reads only; it never creates or changes anything, and it
//! always prints (text or `--json`), even when a server cannot be reached. What a server that cannot
//! be reached would have told is unknown (`null` in JSON), never `false` or 0.
//!
//! A running relay shows in `pg_stat_activity`: every connection it opens is named
//! `outbox-relay/SLOT/PID…`, its sampler's stays open while it waits for NATS or retries. So during an
//! outage `status` says the relay is retrying instead of advising to start one. It never acquires the
//! slot itself: whether events wait in an idle slot is peeked on a temporary copy of it, so a relay
//! starting meanwhile never finds its slot held by `status`. The look judges the changes as a relay
//! would (`slot_scan.rs`): it finds an event behind changes that are not events, and says "cannot be
//! checked" rather than "nothing waits" when its bound ends it first. A stop mark the last relay
//! session left (`slot_mark.rs`) is judged the same way the relay judges it: events that a client
//! other than a relay consumed from the slot, and the stream lacks, are a problem.

use crate::catalog::SlotRow;
use crate::config::Settings;
use crate::setup;
use crate::sink::connect_nats;
use crate::slot_mark;
use crate::slot_scan;

mod postgres;
mod report;
mod stream;
mod text;

use postgres::{postgres_side, read_standbys};
pub use report::Status;
use report::{
    BackfillStatus, PublicationStatus, RelayState, RelayStatus, SchemasStatus, ServerStatus,
    SlotStatus, State, StreamStatus,
};
#[cfg(feature = "test-support")]
use stream::unknown_stream;
use stream::{read_stream, stored_by_tail};
use text::last_ack;

/// Gathers the status. `max_lag_bytes`: a slot further behind than this is a problem even while a
/// relay streams it (the relay is stalled or too slow).
pub async fn status(settings: &Settings, max_lag_bytes: i64) -> Status {
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    let slot_name = &settings.config().postgres.slot;
    let mut pg = postgres_side(settings, &mut problems, &mut warnings).await;
    let stream = read_stream(settings, &mut problems).await;
    pg.relay.own_word = crate::relay_word::ask(&settings.config().http.listen).await;
    own_word_findings(&pg.relay, &mut problems, &mut warnings);
    // The checks `run` makes, so a configuration `run` rejects is never called healthy.
    if pg.server.state == State::Exists
        && stream.state == State::Exists
        && let Err(e) = setup::check_only(settings).await
    {
        problems.push(crate::error_chain::error_chain(&e));
    }
    slot_problems(slot_name, &pg, &stream, &mut problems);
    let consumed = consumed_problem(settings, &pg, &stream, &mut problems, &mut warnings).await;
    missing_problems(&pg, &stream, &mut problems);
    if let Some(lag) = pg.slot.lag_bytes.filter(|&l| l > max_lag_bytes) {
        problems.push(format!(
            "slot {slot_name} is {lag} bytes behind the WAL (more than {max_lag_bytes}): is the relay running and acknowledged?"
        ));
    }
    stream_warnings(settings, &stream, &mut warnings);
    server_warnings(slot_name, &pg, &mut warnings);
    let standbys =
        read_standbys(settings, pg.server.host.as_deref(), &pg.slot, &mut warnings).await;
    let schemas = schemas_status(settings, &mut problems);
    let backfill = backfill_status(settings, &stream, &mut problems);
    let mut slot = pg.slot;
    slot.consumed_events = consumed;
    Status {
        healthy: problems.is_empty(),
        postgres: pg.server,
        standbys,
        slot,
        relay: pg.relay,
        publication: pg.publication,
        stream,
        schemas,
        backfill,
        problems,
        warnings,
    }
}

/// The marker of a backfill of this slot that has begun and not finished, as a problem: `run`
/// refuses while it stands. (`setup`'s checks, which `status` runs too, leave it to this.)
fn backfill_status(
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

/// What the control connection to Postgres found; all unknown when it could not connect.
struct PostgresSide {
    server: ServerStatus,
    slot: SlotStatus,
    relay: RelayStatus,
    publication: PublicationStatus,
    /// Why whether events wait in the slot could not be checked.
    events_unknown: Option<String>,
}

/// The slot's problems: missing, lost, or events waiting (or unknown) with no relay streaming it.
fn slot_problems(
    slot_name: &str,
    pg: &PostgresSide,
    stream: &StreamStatus,
    problems: &mut Vec<String>,
) {
    let slot = &pg.slot;
    if slot.state == State::Missing {
        problems.push(format!(
            "slot {slot_name} does not exist: run outbox-relay setup (or `outbox-relay backfill` if the stream \
             already holds this outbox's events)"
        ));
    }
    if let Some(reason) = slot.invalidation_reason.clone().or_else(|| {
        (slot.wal_status.as_deref() == Some("lost")).then(|| "wal_status = lost".to_owned())
    }) {
        problems.push(setup::lost_slot_message(slot_name, &reason));
    }
    let since = slot
        .inactive_since
        .as_deref()
        .map(|t| format!(" (inactive since {t})"))
        .unwrap_or_default();
    let retrying = retrying_note(&pg.relay, stream);
    if slot.events_waiting == Some(true) {
        let first = slot
            .waiting_event
            .as_deref()
            .map(|e| format!(", the first {e}"))
            .unwrap_or_default();
        problems.push(match &retrying {
            Some(r) => format!(
                "slot {slot_name}{since}: events wait in it{first} and {r}; they are published once it reconnects"
            ),
            None => format!(
                "no relay streams slot {slot_name}{since} while events wait in it{first}: start outbox-relay run"
            ),
        });
    }
    if let Some(e) = &pg.events_unknown {
        problems.push(match &retrying {
            Some(r) => format!(
                "slot {slot_name}: {r}; whether events wait in the slot cannot be checked ({e})"
            ),
            None => format!(
                "slot {slot_name}: no relay streams it, and it cannot be checked for waiting events ({e}): start outbox-relay run"
            ),
        });
    }
}

/// A relay that runs and retries needs its servers, not a start: what to say instead.
fn retrying_note(relay: &RelayStatus, stream: &StreamStatus) -> Option<String> {
    (relay.state == RelayState::Retrying).then(|| {
        let pids = relay
            .pids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let why = if stream.state == State::Unreachable {
            "NATS cannot be reached (see the stream line)"
        } else {
            "see its log for why"
        };
        format!("the relay (pid {pids}) runs but does not stream it: it is retrying; {why}")
    })
}

/// A client other than a relay consumed the slot past events the stream lacks, as the stop mark
/// the last relay session left shows (`slot_mark.rs`): a problem that names the recovery. Returns
/// how many events, when a mark was judged.
async fn consumed_problem(
    settings: &Settings,
    pg: &PostgresSide,
    stream: &StreamStatus,
    problems: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Option<u64> {
    let slot = &settings.config().postgres.slot;
    let slot_at = pg.slot.confirmed_flush_lsn.as_deref()?.parse().ok()?;
    if stream.state != State::Exists {
        return None;
    }
    let client = setup::connect_postgres(settings).await.ok()?;
    let nats = connect_nats(settings).await.ok()?;
    let stored = stored_by_tail(&nats.into(), slot, &stream.name).await;
    let found = slot_mark::judge(settings, &client, slot_at, &stored)
        .await
        .map_err(|e| crate::source::query_error_text(&e));
    consumed_found(slot, found, problems, warnings)
}

/// What the stop mark's judgement found (`Err`: why the mark could not be read): a problem when
/// events were consumed, a warning when it cannot be told. Returns how many events, when a mark
/// was judged.
fn consumed_found(
    slot: &str,
    found: Result<slot_mark::Check, String>,
    problems: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Option<u64> {
    match found {
        Ok(slot_mark::Check::Consumed(c)) => {
            problems.push(c.to_string());
            Some(c.events)
        }
        Ok(slot_mark::Check::Unknown(why)) => {
            warnings.push(format!(
                "slot {slot}: whether a client other than a relay consumed it since the last relay session cannot be told: {why}"
            ));
            None
        }
        Ok(slot_mark::Check::Clean) => Some(0),
        Ok(slot_mark::Check::NoMark) => None,
        Err(e) => {
            warnings.push(format!(
                "slot {slot}: the stop mark {} cannot be read: {e}",
                slot_mark::name(slot),
            ));
            None
        }
    }
}

/// A publication or stream that its server says is not there: setup creates them.
fn missing_problems(pg: &PostgresSide, stream: &StreamStatus, problems: &mut Vec<String>) {
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
fn server_warnings(slot_name: &str, pg: &PostgresSide, warnings: &mut Vec<String>) {
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
fn schemas_status(settings: &Settings, problems: &mut Vec<String>) -> Option<SchemasStatus> {
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

/// What a relay for the slot is doing, from the slot's row and the pids of the relay processes
/// connected to Postgres.
fn relay_state(row: Option<&SlotRow>, pids: &[u32]) -> RelayState {
    if row.is_some_and(|r| r.active) {
        RelayState::Streaming
    } else if pids.is_empty() {
        RelayState::NotRunning
    } else {
        RelayState::Retrying
    }
}

/// Whether the slot is looked into for waiting events: no one streams it (a relay that does
/// publishes them) and its changes can still be decoded.
fn needs_look(row: &SlotRow) -> bool {
    !row.active && row.invalidated().is_none()
}

/// What the look for waiting events found (`Err`: the server's reason it could not look), into
/// the slot's fields: whether events wait and the first of them, or why that is unknown.
fn waiting_found(
    found: Result<slot_scan::Scan, String>,
    slot: &mut SlotStatus,
    events_unknown: &mut Option<String>,
) {
    match found {
        Ok(scan) => {
            slot.events_waiting = scan.any();
            slot.waiting_event = scan
                .first
                .as_ref()
                .map(|f| format!("{} (position {})", f.id, f.position));
            if scan.any().is_none() {
                *events_unknown = scan.unfinished;
            }
        }
        Err(e) => *events_unknown = Some(e),
    }
}

fn slot_status(name: &str, state: State, row: Option<&SlotRow>) -> SlotStatus {
    let r = row.cloned().unwrap_or_default();
    let known = state != State::Unreachable;
    SlotStatus {
        name: name.to_owned(),
        state,
        exists: known.then_some(row.is_some()),
        active: known.then_some(r.active),
        active_pid: r.active_pid,
        confirmed_flush_lsn: r.confirmed_flush_lsn,
        lag_bytes: r.lag_bytes,
        retained_bytes: r.retained_bytes,
        wal_status: r.wal_status,
        safe_wal_size: r.safe_wal_size,
        events_waiting: None,
        waiting_event: None,
        consumed_events: None,
        inactive_since: r.inactive_since,
        invalidation_reason: r.invalidation_reason,
        failover: r.failover,
        synced: r.synced,
    }
}

/// What the relay's own word adds to what Postgres shows: a relay that says it is not ready is a
/// problem (its slot can look active until the ack timeout ends the session); a relay Postgres
/// shows that could not be asked, or `http.listen` left empty, is said to be unknown.
fn own_word_findings(relay: &RelayStatus, problems: &mut Vec<String>, warnings: &mut Vec<String>) {
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
const FULL_WARNING: f64 = 0.8;

/// A warning per limit (`max_msgs`, `max_bytes`) the stream fills to 80 % or more, saying what
/// happens when it is full under its discard policy.
fn fill_warnings(stream: &StreamStatus, warnings: &mut Vec<String>) {
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

fn stream_warnings(settings: &Settings, stream: &StreamStatus, warnings: &mut Vec<String>) {
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

/// The slot as the deterministic simulation's Postgres holds it (tests/simulation): what
/// `pg_replication_slots` and `pg_stat_activity` would show, and what a peek of a copy of it hands
/// over, one list of (LSN, pgoutput message) per transaction.
#[cfg(feature = "test-support")]
pub struct SimSlot {
    /// The walsender that holds the slot, if one does.
    pub active_pid: Option<i32>,
    /// `confirmed_flush_lsn`.
    pub confirmed: crate::Lsn,
    /// Its changes from `confirmed` on (at least as far as the look's bound reaches).
    pub changes: Vec<Vec<(crate::Lsn, bytes::Bytes)>>,
    /// The stop mark, with its changes up to `confirmed`.
    pub mark: Option<crate::slot_mark::SimMark>,
    /// The relay processes connected to Postgres (their connections' `outbox-relay/SLOT/PID`).
    pub relay_pids: Vec<u32>,
}

/// `status`'s verdict on the slot over the simulation's servers.
#[cfg(feature = "test-support")]
#[derive(Debug)]
pub struct SimSlotVerdict {
    /// The slot's problems, worded and ordered as `status` prints them.
    pub problems: Vec<String>,
    /// Its warnings (a stop mark that cannot be judged or read).
    pub warnings: Vec<String>,
    /// `slot.events_waiting`.
    pub events_waiting: Option<bool>,
    /// The id of the first waiting event (`slot.waiting_event` names it with its position).
    pub waiting_id: Option<String>,
}

/// The part of [`status`] that judges the slot, over the simulation's servers: the same rules
/// ([`needs_look`], [`waiting_found`], [`slot_problems`], [`consumed_found`]) and the same
/// judgement of the changes ([`slot_scan::scan_changes`], the relay's decoder and outbox stage,
/// within [`slot_scan::Bound::DEFAULT`]); only the servers' answers come from the simulators.
/// `nats` is `None` while NATS cannot be reached.
#[cfg(feature = "test-support")]
pub async fn sim_slot_status(
    settings: &Settings,
    nats: Option<&crate::nats::NatsPort>,
    sim: SimSlot,
) -> SimSlotVerdict {
    let name = &settings.config().postgres.slot;
    let row = SlotRow {
        active: sim.active_pid.is_some(),
        active_pid: sim.active_pid,
        confirmed_flush_lsn: Some(sim.confirmed.to_string()),
        ..SlotRow::default()
    };
    let mut slot = slot_status(name, State::Exists, Some(&row));
    let mut events_unknown = None;
    let mut waiting_id = None;
    if needs_look(&row) {
        let scan = slot_scan::scan_changes(
            settings,
            &sim.changes,
            None,
            None,
            true,
            slot_scan::Bound::DEFAULT,
        );
        waiting_id = scan.first.as_ref().map(|f| f.id.clone());
        waiting_found(Ok(scan), &mut slot, &mut events_unknown);
    }
    let pg = PostgresSide {
        server: ServerStatus {
            state: State::Exists,
            host: None,
            server_version: None,
            in_recovery: None,
            synchronized_standby_slots: None,
            idle_replication_slot_timeout: None,
        },
        relay: RelayStatus {
            state: relay_state(Some(&row), &sim.relay_pids),
            pids: sim.relay_pids,
            own_word: None,
        },
        slot,
        publication: PublicationStatus {
            name: settings.config().postgres.publication.clone(),
            exists: true,
            tables: Vec::new(),
        },
        events_unknown,
    };
    let mut stream = unknown_stream(&settings.config().nats.stream);
    if nats.is_some() {
        stream.state = State::Exists;
        stream.exists = Some(true);
    }
    let (mut problems, mut warnings) = (Vec::new(), Vec::new());
    slot_problems(name, &pg, &stream, &mut problems);
    if let Some(nats) = nats {
        let stored = stored_by_tail(nats, name, &stream.name).await;
        let (mark_at, changes) = match sim.mark {
            Some(m) => (Some(m.at), m.changes),
            None => (None, Vec::new()),
        };
        let found =
            slot_mark::judge_from(name, mark_at, sim.confirmed, &stored, |after| async move {
                Ok::<_, String>(slot_scan::scan_changes(
                    settings,
                    &changes,
                    Some(sim.confirmed),
                    after,
                    false,
                    slot_scan::Bound::DEFAULT,
                ))
            })
            .await;
        consumed_found(name, found, &mut problems, &mut warnings);
    }
    SimSlotVerdict {
        problems,
        warnings,
        events_waiting: pg.slot.events_waiting,
        waiting_id,
    }
}
