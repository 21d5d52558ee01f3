//! Counters and gauges of a running relay, shared between the pipeline and whoever reports them
//! (logs, `status`, the HTTP listener). Plain atomics: updating them costs nothing on the hot path.
//! Metric names are constants here so every exporter spells them the same way.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub const EVENTS_PUBLISHED: &str = "outbox_relay_events_published_total";
pub const IGNORED_CHANGES: &str = "outbox_relay_ignored_changes_total";
pub const RECONNECTS: &str = "outbox_relay_reconnects_total";
pub const CONFIRMED_LSN: &str = "outbox_relay_confirmed_lsn";
pub const RECEIVED_LSN: &str = "outbox_relay_received_lsn";
pub const IN_FLIGHT: &str = "outbox_relay_in_flight";

/// Live numbers of one relay process.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Stored by JetStream as new messages.
    pub published_ok: AtomicU64,
    /// Acknowledged as duplicates (already stored: a republish after a restart).
    pub published_duplicate: AtomicU64,
    /// Published to the dead-letter subject.
    pub dead_letters: AtomicU64,
    /// Updates, deletes and truncates of the outbox table (never published).
    pub ignored_changes: AtomicU64,
    /// Pipeline restarts after a transient failure.
    pub reconnects: AtomicU64,
    pub confirmed_lsn: AtomicU64,
    pub received_lsn: AtomicU64,
    pub in_flight: AtomicU64,
    /// Unix seconds of the last ack (0 = none yet).
    pub last_ack_unix: AtomicU64,
    /// 1 while streaming with both connections up.
    pub streaming: AtomicU64,
}

impl Metrics {
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn set(gauge: &AtomicU64, v: u64) {
        gauge.store(v, Ordering::Relaxed);
    }

    pub fn get(v: &AtomicU64) -> u64 {
        v.load(Ordering::Relaxed)
    }

    /// Records that an ack arrived now.
    pub fn acked_now(&self) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        self.last_ack_unix.store(now, Ordering::Relaxed);
    }
}
