//! Background monitors of a running relay: the NATS connection state and the slot's lag, retained WAL
//! and `wal_status`, for `/metrics` and `/readyz`. They only read; the pipeline never waits for them.
//!
//! Every background task of the relay (these, the HTTP listener, the position service's wait task)
//! runs in a [`Background`], which stops them when the relay ends and waits for them, bounded, so
//! nothing of a relay runs after `run` returned: the slot sampler's connection, which tells
//! `status` a relay runs, is closed by then, and the NATS watcher's client is let go.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::debug;

use crate::catalog;
use crate::config::Settings;
use crate::metrics::Metrics;
use crate::source::connect_control;

/// How long the background tasks together may take to end once stopped.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Background tasks, stopped and awaited (bounded) by [`Background::stop`]; aborted when dropped
/// without it (a `run` that ends on an early error, a task of a test that was aborted itself).
#[derive(Default)]
pub(super) struct Background(Vec<(&'static str, JoinHandle<()>)>);

impl Background {
    /// Runs `task`, named `name` for the log, until [`Background::stop`].
    pub(super) fn spawn(
        &mut self,
        name: &'static str,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        self.0.push((name, tokio::spawn(task)));
    }

    /// Stops every task and waits until each has ended, at most [`STOP_WAIT`] in all: a task that
    /// does not end in time is left to the runtime (and logged).
    pub(super) async fn stop(mut self) {
        let tasks = std::mem::take(&mut self.0);
        for (_, task) in &tasks {
            task.abort();
        }
        let deadline = tokio::time::Instant::now() + STOP_WAIT;
        for (name, task) in tasks {
            if tokio::time::timeout_at(deadline, task).await.is_err() {
                debug!(task = name, "background task did not end in time");
            }
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        for (_, task) in &self.0 {
            task.abort();
        }
    }
}

/// Keeps the `nats_connected` gauge current (async-nats reconnects on its own).
pub(super) async fn watch_nats(client: async_nats::Client, metrics: Arc<Metrics>) {
    loop {
        let up = client.connection_state() == async_nats::connection::State::Connected;
        metrics.nats_connected.set(u64::from(up));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Samples the slot every few seconds on a control connection of its own, so an operator sees a
/// stalled or endangered slot from the metrics. The connection is named for the slot and the
/// process ([`catalog::relay_application_name`]): while it is open, `status` can tell a relay runs
/// even when no session streams the slot. The server's WAL position it reads goes to `positions`,
/// which tells a wait for an LSN past the end of the WAL.
pub(super) async fn sample_slot(
    settings: Settings,
    metrics: Arc<Metrics>,
    positions: Arc<crate::stored::Positions>,
) {
    let app = catalog::relay_application_name(
        &settings.config().postgres.slot,
        std::process::id(),
        Some("monitor"),
    );
    let mut client = None;
    loop {
        if client.is_none() {
            client = connect_control(&settings.conn, &app).await.ok();
        }
        if let Some(c) = &client {
            match catalog::slot(c, &settings.config().postgres.slot).await {
                Ok(Some(slot)) => {
                    let bytes = |v: Option<i64>| v.unwrap_or(0).max(0) as u64;
                    metrics.slot_lag_bytes.set(bytes(slot.lag_bytes));
                    metrics.retained_wal_bytes.set(bytes(slot.retained_bytes));
                    metrics.set_wal_status(slot.wal_status.as_deref().unwrap_or(""));
                    if let Some(lsn) = slot.wal_lsn.as_deref().and_then(|l| l.parse().ok()) {
                        positions.wal_read(lsn);
                    }
                }
                Ok(None) => {
                    // The slot is gone: no lag to report, and no WAL kept for it.
                    metrics.set_wal_status("");
                    metrics.slot_lag_bytes.set(0);
                    metrics.retained_wal_bytes.set(0);
                }
                Err(_) => client = None,
            }
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Once `stop` returned, every task has ended and dropped what it held (an abort alone leaves
    /// that to the runtime's next poll of the task).
    #[tokio::test]
    async fn stopped_tasks_have_ended_when_stop_returns() {
        let held = Arc::new(());
        let mut background = Background::default();
        for name in ["a", "b"] {
            let mine = Arc::clone(&held);
            background.spawn(name, async move {
                let _mine = mine;
                std::future::pending::<()>().await;
            });
        }
        tokio::task::yield_now().await;
        assert_eq!(Arc::strong_count(&held), 3);
        background.stop().await;
        assert_eq!(
            Arc::strong_count(&held),
            1,
            "both tasks dropped what they held"
        );
    }
}
