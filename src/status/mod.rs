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

use std::time::{SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;

use crate::catalog::{self, SlotRow};
use crate::config::Settings;
use crate::setup;
use crate::sink::connect_nats;
use crate::slot_mark;
use crate::slot_scan;

mod report;
mod text;

pub use report::Status;
use report::{
    BackfillStatus, PublicationStatus, RelayState, RelayStatus, SchemasStatus, ServerStatus,
    SlotStatus, StandbyStatus, State, StreamStatus,
};
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

/// Connects to Postgres and reads the server, slot, relay and publication, and the
/// `pg_logical_emit_message` grant warning; a failure is a problem, never an early return.
async fn postgres_side(
    settings: &Settings,
    problems: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> PostgresSide {
    let mut side = PostgresSide {
        server: ServerStatus {
            state: State::Unreachable,
            host: None,
            server_version: None,
            in_recovery: None,
            synchronized_standby_slots: None,
            idle_replication_slot_timeout: None,
        },
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
    };
    match setup::connect_postgres(settings).await {
        Err(e) => problems.push(crate::error_chain::error_chain(&e)),
        Ok(pg) => {
            side.server.state = State::Exists;
            if let Err(e) = read_postgres(
                settings,
                &pg,
                &mut side.server,
                &mut side.slot,
                &mut side.relay,
                &mut side.publication,
                &mut side.events_unknown,
            )
            .await
            {
                problems.push(format!("postgres: {e}"));
            }
            match setup::message_warnings(settings, &pg).await {
                Ok(w) => warnings.extend(w),
                Err(e) => problems.push(format!("postgres: {e}")),
            }
        }
    }
    side
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

/// How far the stream's tail, read through `nats`, says the stream holds the slot's events.
async fn stored_by_tail(
    nats: &crate::nats::NatsPort,
    slot: &str,
    stream: &str,
) -> slot_mark::Stored {
    // As long as any other request of status's client may take (async-nats' default).
    let timeout = std::time::Duration::from_secs(10);
    match crate::sink::read_tail(nats, stream, timeout).await {
        // status knows no timeline: the slot named in the tail is compared, not the history.
        Ok(tail) => slot_mark::Stored::from_tail(&tail, slot, None),
        Err(e) => slot_mark::Stored::Unknown(crate::error_chain::error_chain(&e)),
    }
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

async fn read_postgres(
    settings: &Settings,
    pg: &Client,
    server: &mut ServerStatus,
    slot: &mut SlotStatus,
    relay: &mut RelayStatus,
    publication: &mut PublicationStatus,
    events_unknown: &mut Option<String>,
) -> Result<(), tokio_postgres::Error> {
    let r = pg
        .query_one(
            "SELECT current_setting('server_version'), pg_is_in_recovery(), \
             current_setting('synchronized_standby_slots', true), \
             current_setting('idle_replication_slot_timeout', true), \
             coalesce(host(inet_server_addr()) || ':' || inet_server_port()::text, 'local socket')",
            &[],
        )
        .await?;
    server.server_version = r.get(0);
    server.in_recovery = r.get(1);
    server.synchronized_standby_slots = r.get(2);
    server.idle_replication_slot_timeout = r.get(3);
    server.host = r.get(4);

    let row = catalog::slot(pg, &settings.config().postgres.slot).await?;
    *slot = slot_status(
        &settings.config().postgres.slot,
        if row.is_some() {
            State::Exists
        } else {
            State::Missing
        },
        row.as_ref(),
    );
    relay.pids = relay_pids(pg, &settings.config().postgres.slot).await?;
    relay.state = relay_state(row.as_ref(), &relay.pids);
    if row.as_ref().is_some_and(needs_look) {
        let found = events_waiting(settings, pg).await.map_err(|e| {
            e.as_db_error()
                .map_or_else(|| e.to_string(), |d| d.message().to_owned())
        });
        waiting_found(found, slot, events_unknown);
    }
    publication.exists = pg
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&settings.config().postgres.publication],
        )
        .await?
        .is_some();
    publication.tables = pg
        .query(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1",
            &[&settings.config().postgres.publication],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    Ok(())
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

/// The pids of the relay processes for `slot` connected to this database: every connection a relay
/// opens is named [`catalog::relay_application_name`] (`outbox-relay/SLOT/PID…`). Any session may
/// give itself that name, so only sessions of the relay's own role (the role `status` connects as)
/// and the walsender that holds the slot are believed.
async fn relay_pids(pg: &Client, slot: &str) -> Result<Vec<u32>, tokio_postgres::Error> {
    let prefix = format!("{}{slot}/", catalog::RELAY_APPLICATION_PREFIX);
    // application_name is cut at 63 bytes (NAMEDATALEN - 1); a long slot name leaves no pid.
    let cut = prefix.len().min(63);
    let rows = pg
        .query(
            "SELECT DISTINCT application_name FROM pg_stat_activity \
             WHERE datname = current_database() AND left(application_name, $2) = left($1, $2) \
               AND (usename = current_user \
                    OR pid = (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $3))",
            &[&prefix, &(cut as i32), &slot],
        )
        .await?;
    let mut pids: Vec<u32> = rows
        .iter()
        .filter_map(|r| {
            let name: String = r.get(0);
            name.get(prefix.len()..)?.split('/').next()?.parse().ok()
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// Whether the inactive slot holds at least one outbox event nobody has published, and the first
/// one: its pending changes are peeked, behind any number of changes that are not events (a
/// retention DELETE, other published tables, messages under other prefixes), within
/// [`slot_scan::Bound::DEFAULT`]; nothing is consumed.
///
/// Peeking acquires the slot it reads for as long as decoding takes, and a relay starting then
/// would find its slot held (and wait as a standby, naming this connection). So the peek reads a
/// temporary copy (`pg_copy_logical_replication_slot`, which reads the slot's positions without
/// acquiring it): the same WAL from the same position, and the copy goes with this connection.
async fn events_waiting(
    settings: &Settings,
    pg: &Client,
) -> Result<slot_scan::Scan, tokio_postgres::Error> {
    let copy = format!(
        "outbox_relay_status_{}_{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    );
    pg.query(
        "SELECT pg_copy_logical_replication_slot($1, $2, true)",
        &[&settings.config().postgres.slot, &copy],
    )
    .await?;
    let peeked = slot_scan::scan(
        settings,
        pg,
        &copy,
        None,
        None,
        true,
        slot_scan::Bound::DEFAULT,
    )
    .await;
    let _ = pg
        .query("SELECT pg_drop_replication_slot($1)", &[&copy])
        .await;
    peeked
}

/// Each other host of the URL: reachable, a standby, and holding a synced copy of the slot.
async fn read_standbys(
    settings: &Settings,
    reached: Option<&str>,
    slot: &SlotStatus,
    warnings: &mut Vec<String>,
) -> Vec<StandbyStatus> {
    let mut out = Vec::new();
    if settings.conn.hosts.len() < 2 {
        return out;
    }
    for (host, port) in &settings.conn.hosts {
        let target = format!("{host}:{port}");
        // The host the control connection reached is the primary itself.
        if reached
            .is_some_and(|r| r == target || r.ends_with(&format!(":{port}")) && host_is_local(host))
        {
            continue;
        }
        let mut info = settings.conn.clone();
        info.hosts = vec![(host.clone(), *port)];
        info.target_session_attrs = crate::source::TargetSessionAttrs::Any;
        let mut st = StandbyStatus {
            host: target.clone(),
            state: State::Unreachable,
            in_recovery: None,
            slot_exists: false,
            synced: None,
            confirmed_flush_lsn: None,
        };
        if let Ok(client) = crate::source::connect_control(&info, "outbox-relay status").await {
            st.state = State::Exists;
            st.in_recovery = client
                .query_one("SELECT pg_is_in_recovery()", &[])
                .await
                .ok()
                .map(|r| r.get(0));
            if let Ok(Some(copy)) = catalog::slot(&client, &settings.config().postgres.slot).await {
                st.slot_exists = true;
                st.synced = copy.synced;
                st.confirmed_flush_lsn = copy.confirmed_flush_lsn;
            }
        }
        if st.in_recovery == Some(true) && slot.failover == Some(true) && st.synced != Some(true) {
            warnings.push(format!(
                "standby {target} has no synced copy of slot {}: a failover to it would lose the slot \
                 (set sync_replication_slots = on, hot_standby_feedback = on and a primary_conninfo with dbname there)",
                slot.name
            ));
        }
        out.push(st);
    }
    out
}

fn host_is_local(host: &str) -> bool {
    matches!(host, "localhost" | "127.0.0.1" | "::1")
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

/// The stream `name` before NATS answered: every field unknown.
fn unknown_stream(name: &str) -> StreamStatus {
    StreamStatus {
        name: name.to_owned(),
        state: State::Unreachable,
        exists: None,
        messages: None,
        bytes: None,
        last_sequence: None,
        subjects: None,
        storage: None,
        replicas: None,
        duplicate_window_secs: None,
        max_msgs: None,
        max_bytes: None,
        max_age_secs: None,
        discard: None,
        unknown_because: None,
        metadata: Default::default(),
    }
}

async fn read_stream(settings: &Settings, problems: &mut Vec<String>) -> StreamStatus {
    let name = &settings.config().nats.stream;
    let mut st = unknown_stream(name);
    let client = match connect_nats(settings).await {
        Ok(c) => c,
        Err(e) => {
            let error = crate::error_chain::error_chain(&e);
            st.unknown_because = Some(format!("NATS unreachable ({error})"));
            problems.push(error);
            return st;
        }
    };
    let js = async_nats::jetstream::new(client);
    match js.get_stream(name).await {
        Ok(mut s) => match s.info().await {
            Ok(info) => {
                st.state = State::Exists;
                st.exists = Some(true);
                st.messages = Some(info.state.messages);
                st.bytes = Some(info.state.bytes);
                st.last_sequence = Some(info.state.last_sequence);
                st.subjects = Some(info.config.subjects.clone());
                st.storage = Some(format!("{:?}", info.config.storage).to_lowercase());
                st.replicas = Some(info.config.num_replicas);
                st.duplicate_window_secs = Some(info.config.duplicate_window.as_secs());
                // JetStream's "unlimited" is -1 (0 for max_age).
                st.max_msgs = u64::try_from(info.config.max_messages).ok();
                st.max_bytes = u64::try_from(info.config.max_bytes).ok();
                st.max_age_secs = Some(info.config.max_age.as_secs()).filter(|s| *s > 0);
                st.discard = Some(format!("{:?}", info.config.discard).to_lowercase());
                st.metadata = info.config.metadata.clone();
            }
            Err(e) => {
                st.unknown_because = Some(format!("JetStream did not answer ({e})"));
                problems.push(format!("JetStream stream {name}: {e}"));
            }
        },
        Err(e) => match e.kind() {
            async_nats::jetstream::context::GetStreamErrorKind::JetStream(je)
                if je.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                st.state = State::Missing;
                st.exists = Some(false);
            }
            async_nats::jetstream::context::GetStreamErrorKind::JetStream(_) => {
                st.unknown_because = Some(format!("JetStream refused the lookup ({e})"));
                problems.push(format!("JetStream stream {name}: {e}"));
            }
            _ => {
                st.state = State::JetstreamDisabled;
                st.unknown_because = Some("JetStream not available".into());
                problems.push(
                    "NATS answers, but JetStream is not available: start nats-server with -js"
                        .into(),
                );
            }
        },
    }
    st
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
