//! `outbox-relay status`: the slot and the stream as the servers see them, and a verdict.
//!
//! Healthy means: both servers answer; the slot exists, is not invalidated or about to be, and
//! either a relay streams it or no event waits in it and no relay has been away for longer than
//! `status.grace_secs`; the publication and the stream exist; no stop mark outlives its slot; and
//! every check `run` makes before streaming passes (another relay's table or prefix included). Unreachable, missing and (for JetStream) not enabled are different
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
//!
//! The command is cut by role: this file gathers the facts in order and hands them to the verdict;
//! `postgres.rs` and `stream.rs` read the servers; `slot.rs` (the slot), `retention.rs` (WAL
//! retention and stop marks) and `checks.rs` (everything else) judge, free of I/O; `report.rs` is
//! what is reported, once, and `text.rs` its text form (`--json` prints the same report); `sim.rs`
//! runs the slot's verdict over the deterministic simulation's servers.

use std::time::Duration;

use crate::config::Settings;
use crate::nats::connect_nats;
use crate::setup;
use crate::slot_mark;
use crate::warning::Warning;

mod checks;
mod postgres;
mod report;
mod retention;
#[cfg(feature = "test-support")]
mod sim;
mod slot;
mod stream;
mod text;

pub use report::Status;
use report::{
    OrphanMark, PublicationStatus, RelayState, RelayStatus, ServerStatus, SlotStatus, State,
    StreamStatus,
};
#[cfg(feature = "test-support")]
pub use sim::{SimSlot, SimSlotVerdict, sim_slot_status};

use checks::{
    backfill_status, dead_letter_warning, missing_problems, own_word_findings, schemas_status,
    server_warnings, stream_warnings,
};
use postgres::{postgres_side, read_standbys, watch_unheld};
use retention::{orphan_mark_problems, retention_warnings};
use slot::{consumed_found, slot_problems, waiting_found};
use stream::{read_stream, stored_by_tail};

/// Gathers the status. `max_lag_bytes`: a slot further behind than this is a problem even while a
/// relay streams it (the relay is stalled or too slow).
///
/// On a server before Postgres 17, a slot no relay holds, with nothing waiting in it and nothing
/// else wrong, is watched for up to `status.grace_secs` (see `postgres.rs`): if a relay takes it
/// meanwhile, the status is gathered again, so every line is of the same moment.
pub async fn status(settings: &Settings, max_lag_bytes: i64) -> Status {
    let first = gather(settings, max_lag_bytes, None).await;
    let (Some(grace), true) = (first.watch, first.status.problems.is_empty()) else {
        return first.status;
    };
    match watch_unheld(settings, grace).await {
        Ok(None) => gather(settings, max_lag_bytes, None).await.status,
        Ok(Some(watched)) => gather(settings, max_lag_bytes, Some(watched)).await.status,
        Err(e) => {
            let mut s = first.status;
            s.problems.push(crate::error_chain::error_chain(&e));
            s.healthy = false;
            s
        }
    }
}

/// A status, and whether the slot needs watching (how long) to tell how long it has been unheld.
struct Gathered {
    status: Status,
    watch: Option<Duration>,
}

/// One pass over the servers; `watched`: how long an earlier pass watched the slot unheld.
async fn gather(settings: &Settings, max_lag_bytes: i64, watched: Option<Duration>) -> Gathered {
    let mut problems = Vec::new();
    let mut warnings: Vec<Warning> = Vec::new();
    let config = settings.config();
    let mut pg = postgres_side(settings, &mut problems, &mut warnings).await;
    if let Some(w) = watched {
        pg.slot.unheld_secs = Some(w.as_secs());
        pg.slot.unheld_measured = Some("watched");
    }
    let stream = read_stream(settings, &mut problems).await;
    pg.relay.own_word = crate::relay_word::ask(&config.http.listen).await;
    own_word_findings(settings, &mut pg.relay, &mut problems, &mut warnings);
    // A walsender holds the slot, but the relay says it does not stream: its events wait.
    if pg.relay.state == RelayState::NotStreaming {
        let found = postgres::count_held(settings).await;
        waiting_found(found, &mut pg.slot, &mut pg.events_unknown);
    }
    // The checks `run` makes, so a configuration `run` rejects is never called healthy.
    if pg.server.state == State::Exists
        && stream.state == State::Exists
        && let Err(e) = setup::check_only(settings).await
    {
        problems.push(crate::error_chain::error_chain(&e));
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
    let consumed = consumed_problem(settings, &pg, &stream, &mut problems, &mut warnings).await;
    missing_problems(settings, &pg, &stream, &mut problems);
    if let Some(lag) = pg.slot.lag_bytes.filter(|&l| l > max_lag_bytes) {
        problems.push(format!(
            "slot {} is {lag} bytes behind the WAL (more than {max_lag_bytes}): is the relay running and acknowledged?",
            config.postgres.slot
        ));
    }
    retention_warnings(settings, &pg, &mut warnings);
    orphan_mark_problems(&pg.orphan_marks, &mut problems);
    stream_warnings(settings, &stream, &mut warnings);
    dead_letter_warning(&stream, &mut warnings);
    server_warnings(settings, &pg, &mut warnings);
    let standbys =
        read_standbys(settings, pg.server.host.as_deref(), &pg.slot, &mut warnings).await;
    let schemas = schemas_status(settings, &mut problems);
    let (warnings, acknowledged_warnings) =
        crate::warning::split_acknowledged(warnings, &config.warnings.acknowledged);
    // Before 17 only watching tells how long the slot has been unheld (see `status`).
    let watch = (watched.is_none()
        && pg.server.version_num.is_some_and(|v| v < 170000)
        && pg.slot.state == State::Exists
        && pg.slot.active == Some(false)
        && pg.slot.events_waiting == Some(false))
    .then(|| Duration::from_secs(config.status.grace_secs));
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

/// What the control connection to Postgres found; all unknown when it could not connect.
struct PostgresSide {
    server: ServerStatus,
    slot: SlotStatus,
    relay: RelayStatus,
    publication: PublicationStatus,
    /// Why whether events wait in the slot could not be checked.
    events_unknown: Option<String>,
    /// Stop marks in this database whose slot is gone.
    orphan_marks: Vec<OrphanMark>,
}

/// A client other than a relay consumed the slot past events the stream lacks, as the stop mark
/// the last relay session left shows (`slot_mark.rs`): a problem that names the recovery. Returns
/// how many events, when a mark was judged.
async fn consumed_problem(
    settings: &Settings,
    pg: &PostgresSide,
    stream: &StreamStatus,
    problems: &mut Vec<String>,
    warnings: &mut Vec<Warning>,
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
