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
//!
//! The command is cut by role: this file gathers the facts in order and hands them to the verdict;
//! `postgres.rs` and `stream.rs` read the servers; `slot.rs` (the slot) and `checks.rs` (everything
//! else) judge, free of I/O; `report.rs` is what is reported and `text.rs` its text form; `sim.rs`
//! runs the slot's verdict over the deterministic simulation's servers.

use crate::config::Settings;
use crate::nats::connect_nats;
use crate::setup;
use crate::slot_mark;

mod checks;
mod postgres;
mod report;
#[cfg(feature = "test-support")]
mod sim;
mod slot;
mod stream;
mod text;

pub use report::Status;
use report::{PublicationStatus, RelayStatus, ServerStatus, SlotStatus, State, StreamStatus};
#[cfg(feature = "test-support")]
pub use sim::{SimSlot, SimSlotVerdict, sim_slot_status};

use checks::{
    backfill_status, missing_problems, own_word_findings, schemas_status, server_warnings,
    stream_warnings,
};
use postgres::{postgres_side, read_standbys};
use slot::{consumed_found, slot_problems};
use stream::{read_stream, stored_by_tail};

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

/// What the control connection to Postgres found; all unknown when it could not connect.
struct PostgresSide {
    server: ServerStatus,
    slot: SlotStatus,
    relay: RelayStatus,
    publication: PublicationStatus,
    /// Why whether events wait in the slot could not be checked.
    events_unknown: Option<String>,
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
