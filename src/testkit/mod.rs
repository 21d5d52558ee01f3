//! Test fixtures: real Postgres and NATS servers and a database per test (CONTRIBUTING.md,
//! Testing), for the
//! integration tests (`tests/integration/support` re-exports this and adds its own harnesses) and
//! the benches. Compiled only with the `test-support` feature; the relay never starts servers.
//!
//! - `PgServer::shared()` is one Postgres per test binary; `PgServer::start_private()` is for tests
//!   that stop, restart or crash it.
//! - `NatsServer::start()` is a JetStream server per test.
//! - `TestDb::create(server)` is a database per test, with its own slot and publication names.
//!
//! Nothing outlives the test binary: owned servers stop on Drop, and every server has a watchdog
//! that kills it within a second or two of the test process ending, even on SIGKILL.

mod db;
mod nats;
mod pg_pair;
mod postgres;
// Public for the tests' own harnesses (tests/integration/support), which stop and signal relay
// processes too.
pub mod process;

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub use db::TestDb;
pub use nats::{NatsCluster, NatsServer, NatsTls};
pub use pg_pair::{PgPair, SyncedSlot};
pub use postgres::{PgServer, os_user, server_major};

/// `<prefix>_<pid>_<n>`, lowercase: safe as an unquoted Postgres identifier (also a slot name) and as a
/// NATS subject token or stream name. Other characters in `prefix` become `_`.
pub fn unique(prefix: &str) -> String {
    let prefix: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("{prefix}_{}", unique_suffix())
}

/// `<pid>_<n>`: unique within this machine while this test binary runs.
pub(crate) fn unique_suffix() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Polls `f` every 50 ms until it returns true; panics with `what` after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
