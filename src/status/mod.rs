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
//! The command is cut by role: this file runs the passes; `facts.rs` is what `status` reads, as a
//! trait ([`Facts`]), and `servers.rs` its real implementation over the servers, each opened once
//! ([`Servers`]), through `postgres.rs` and `stream.rs`; `gather.rs` is one pass over the facts in
//! order; `slot.rs` (the slot), `retention.rs` (WAL retention and stop marks), `parked.rs` (the
//! parked keys, read through the parking ledger) and `checks.rs` (everything else) judge; `report.rs` is what is reported, once, and `text.rs` its
//! text form (`--json` prints the same report). The deterministic simulation implements [`Facts`]
//! over its servers and runs [`status_over`], so what it checks is the command's own verdict.

use crate::config::Settings;

mod checks;
pub mod facts;
mod gather;
mod parked;
mod postgres;
mod report;
mod retention;
mod servers;
mod slot;
mod stream;
mod text;

pub use facts::Facts;
pub use report::Status;
pub use servers::Servers;

/// Gathers the status. `max_lag_bytes`: a slot further behind than this is a problem even while a
/// relay streams it (the relay is stalled or too slow).
///
/// On a server before Postgres 17, a slot no relay holds, with nothing waiting in it and nothing
/// else wrong, is watched for up to `status.grace_secs` (see `postgres.rs`): if a relay takes it
/// meanwhile, the status is gathered again, so every line is of the same moment.
pub async fn status(settings: &Settings, max_lag_bytes: i64) -> Status {
    status_over(&Servers::new(settings), settings, max_lag_bytes).await
}

/// [`status`] over `facts`: the real servers ([`Servers`]) or a simulation's.
pub async fn status_over(facts: &impl Facts, settings: &Settings, max_lag_bytes: i64) -> Status {
    let first = gather::gather(facts, settings, max_lag_bytes, None).await;
    let Some(grace) = first.watch else {
        return first.status;
    };
    if !first.status.problems.is_empty() {
        // Watching would not change the verdict (already unhealthy), but the problems alone would
        // hide that no relay holds the slot behind them: a parked key's advice, say, while no
        // relay runs to carry a requeue out.
        let mut s = first.status;
        let line = slot::unwatched_problem(settings, &s.relay, &s.stream, grace);
        s.problems.push(line);
        return s;
    }
    match gather::watch_unheld(facts, settings, grace).await {
        Ok(None) => {
            gather::gather(facts, settings, max_lag_bytes, None)
                .await
                .status
        }
        Ok(Some(watched)) => {
            gather::gather(facts, settings, max_lag_bytes, Some(watched))
                .await
                .status
        }
        Err(e) => {
            let mut s = first.status;
            s.problems.push(e);
            s.healthy = false;
            s
        }
    }
}
