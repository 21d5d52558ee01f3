//! What a backfill tells its caller: where a running one is, for the progress line
//! ([`BackfillProgress`]), and what a finished one did ([`BackfillReport`]): the slot and its
//! consistent point, and the rows counted by outcome.

use std::time::Duration;

use crate::Lsn;
use crate::position::History;

/// Where a running backfill is, for the progress line.
#[derive(Debug, Clone, Copy)]
pub struct BackfillProgress {
    /// Rows handed to the sink.
    pub(crate) done: u64,
    /// Rows matching the predicate in the snapshot.
    pub(crate) total: u64,
    /// Time since the first row was read.
    pub(crate) elapsed: Duration,
}

impl BackfillProgress {
    /// Rows per second so far.
    pub(crate) fn rate(&self) -> f64 {
        self.done as f64 / self.elapsed.as_secs_f64().max(1e-3)
    }
}

impl std::fmt::Display for BackfillProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "backfill: {}/{} rows ({:.0}/s)",
            self.done,
            self.total,
            self.rate()
        )
    }
}

/// What a finished backfill did.
#[derive(Debug, Clone, Default)]
pub struct BackfillReport {
    /// What setup found and created (publication, stream), one line each.
    pub setup_lines: Vec<String>,
    /// Findings that did not stop the backfill, one line each.
    pub warnings: Vec<crate::warning::Warning>,
    /// The slot the backfill created (`postgres.slot`).
    pub slot: String,
    /// The slot's consistent point: `run` publishes every transaction committed from here on.
    pub consistent_point: Lsn,
    /// The `Outbox-Commit-Lsn` every backfilled message carries (consistent point − 1); their
    /// `Outbox-Position` is this LSN and the row's index in the cursor's order.
    pub commit_lsn: Lsn,
    /// The history the slot belongs to (named in every backfilled message's `Outbox-Position`), when the
    /// server told it.
    pub(crate) history: Option<History>,
    /// An existing slot was dropped first (`--replace-slot`).
    pub replaced_slot: bool,
    /// Rows matching the predicate in the snapshot.
    pub total: u64,
    /// Rows read and published (stored, duplicates and dead letters together).
    pub rows: u64,
    /// Newly stored.
    pub stored: u64,
    /// Dropped by JetStream: the stream already held an event with that id.
    pub duplicates: u64,
    /// Published to the dead-letter subject.
    pub dead_letters: u64,
    /// Setup, and the wait for a consistent point while the slot was created.
    pub slot_wait: Duration,
    /// From the first row read to the last ack.
    pub elapsed: Duration,
}

impl BackfillReport {
    /// Rows per second.
    pub fn rate(&self) -> f64 {
        self.rows as f64 / self.elapsed.as_secs_f64().max(1e-3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line() {
        let p = BackfillProgress {
            done: 4200,
            total: 10000,
            elapsed: Duration::from_secs(2),
        };
        assert_eq!(p.to_string(), "backfill: 4200/10000 rows (2100/s)");
    }
}
