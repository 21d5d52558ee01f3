//! The values a series holds: a [`Counter`] that only grows, a [`Gauge`] set to what was last
//! measured, and a fixed-bucket [`Histogram`] of durations.
//!
//! Each is a relaxed atomic (`AtomicU64`, `Ordering::Relaxed`), so an update on the hot path costs
//! one atomic add or store and no lock: the pipeline writes, the HTTP listener and tests read, and
//! no reader needs one series ordered against another. The types keep the atomics private, so a
//! counter cannot be set, nor a gauge added to, by mistake.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A count that only grows (a Prometheus counter).
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub(crate) fn inc(&self) {
        self.add(1);
    }

    /// Adds `n`.
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The count so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value set to what was last measured (a Prometheus gauge).
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    /// Sets the value.
    pub(crate) fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }

    /// The value last set (0 before any).
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Upper bounds (seconds) of the buckets of a [`Histogram`].
pub(crate) const BUCKETS: [f64; 12] = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

/// A fixed-bucket histogram of durations: per bucket the observations that fell in it (not yet
/// cumulative), their count, and their sum in microseconds.
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    buckets: [Counter; BUCKETS.len()],
    count: Counter,
    sum_micros: Counter,
}

impl Histogram {
    /// Records one duration.
    pub(crate) fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&b| secs <= b) {
            self.buckets[i].inc();
        }
        self.count.inc();
        self.sum_micros.add(d.as_micros() as u64);
    }

    /// Observations per bucket of [`BUCKETS`], in their order (an observation over the last bound
    /// is in none of them, only in [`Histogram::count`]).
    pub(crate) fn bucket_counts(&self) -> impl Iterator<Item = u64> + '_ {
        self.buckets.iter().map(Counter::get)
    }

    /// Observations in all.
    pub(crate) fn count(&self) -> u64 {
        self.count.get()
    }

    /// The sum of the observations, in seconds.
    pub(crate) fn sum_seconds(&self) -> f64 {
        self.sum_micros.get() as f64 / 1e6
    }
}
