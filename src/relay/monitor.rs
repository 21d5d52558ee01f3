//! Background monitors of a running relay: the NATS connection state and the slot's lag, retained WAL
//! and `wal_status`, for `/metrics` and `/readyz`. They only read; the pipeline never waits for them.

use std::sync::Arc;
use std::time::Duration;

use crate::catalog;
use crate::config::Settings;
use crate::metrics::Metrics;
use crate::source::connect_control;

/// Aborts a background task when dropped.
pub(super) struct AbortOnDrop<T>(pub tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
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
