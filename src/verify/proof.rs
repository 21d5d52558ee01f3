//! `proven_up_to`: the newest point up to which every row is proven stored once, in order, and
//! `verify --record`, the one write verify makes: it stores that point in the outbox table's proof
//! table (`<table>_proof`, created by `sql/05_retention.sql`), where
//! `outbox_prune(..., proven_only => true)` reads it and deletes only rows at or below it.
//!
//! The point is a creation time: every row the snapshot shows created at or before it was found
//! in the stream once, in order, on its subject (and byte for byte with `--payloads`). It lies just
//! before the oldest row that is not proven: missing, waiting, unknown, dead-lettered, misrouted,
//! a changed payload, stored twice or out of order, without a usable id, or older than the stream
//! (unless an earlier proof already covered it: a limit that removed its message since does not
//! take the proof back). Rows before the backfill that began the stream are not the relay's and
//! do not hold it back. With a row not proven that has no creation time, nothing is proven.
//!
//! Its LSN is the commit LSN of the newest message whose row is proven at or before that time
//! (with nothing held back: of the newest message committed before the snapshot), for the operator
//! to compare with the slot; the prune goes by the time. A transaction that began before the point
//! and committed after the snapshot wrote rows verify never saw: the proof stores the snapshot's
//! oldest running transaction too, and the prune deletes only rows written before it.

use super::VerifyError;
use super::class::Class;
use super::report::Proven;
use super::rows::{Table, query_error};
use crate::Lsn;
use crate::config::Settings;

/// Gathers what the proof needs as the rows go by.
#[derive(Debug, Default)]
pub(crate) struct ProofTracker {
    /// The newest creation time among the rows checked.
    newest: Option<i64>,
    /// The oldest creation time among the rows not proven.
    oldest_unproven: Option<i64>,
    /// A row not proven has no creation time.
    unproven_without_time: bool,
    /// The proof of the last `--record`, as the snapshot shows it (µs since the Unix epoch).
    pub(crate) previous: Option<i64>,
}

impl ProofTracker {
    /// A row checked, created at `created` (µs since the Unix epoch).
    pub(crate) fn row(&mut self, created: Option<i64>) {
        if let Some(c) = created {
            self.newest = Some(self.newest.map_or(c, |n| n.max(c)));
        }
    }

    /// A row not proven: `created` it, found as `class` (rows of a class that proves nothing
    /// about the relay, or that an earlier proof covered, do not hold the proof back).
    pub(crate) fn unproven(&mut self, created: Option<i64>, class: Option<Class>) {
        match class {
            // Not the relay's, or discarded by an operator: a decision, not a loss.
            Some(Class::BeforeBackfill | Class::Discarded) => return,
            Some(Class::OlderThanStream)
                if created.is_some_and(|c| self.previous.is_some_and(|p| c <= p)) =>
            {
                return;
            }
            _ => {}
        }
        match created {
            Some(c) => self.oldest_unproven = Some(self.oldest_unproven.map_or(c, |o| o.min(c))),
            None => self.unproven_without_time = true,
        }
    }

    /// Whether a row holds the proof back.
    pub(crate) fn held_back(&self) -> bool {
        self.oldest_unproven.is_some() || self.unproven_without_time
    }

    /// The creation time up to which every row is proven, if any.
    pub(crate) fn created_bound(&self) -> Option<i64> {
        if self.unproven_without_time {
            return None;
        }
        match (self.newest, self.oldest_unproven) {
            (Some(n), Some(o)) => Some(n.min(o - 1)),
            (newest, None) => newest,
            (None, Some(o)) => Some(o - 1),
        }
    }
}

/// Stores `proven` (and the snapshot's oldest running transaction, `table.snapshot_xmin`) in the
/// proof table, replacing the last proof: a run that proves less moves the point back, which only
/// ever keeps more rows.
pub(crate) async fn record(
    settings: &Settings,
    table: &Table,
    proven: &Proven,
    rows: u64,
) -> Result<(), VerifyError> {
    let o = &settings.config().outbox;
    let failed = |detail: String| VerifyError::Record {
        what: format!(
            "cannot store the proof in {}: {detail} (create it with sql/05_retention.sql, which grants \
             -v relay_role INSERT, UPDATE and SELECT on it)",
            table.proof_table
        ),
    };
    let pg = crate::catalog::connect(settings, "verify")
        .await
        .map_err(|e| failed(e.to_string()))?;
    let sql = format!(
        "INSERT INTO {t} AS p (id, proven_lsn, proven_created_at, snapshot_xmin, rows_checked, stream, recorded_at) \
         VALUES (true, $1::text::pg_lsn, 'epoch'::timestamptz + $2::int8 * interval '1 microsecond', \
                 $3::text::xid8, $4::int8, $5::text, now()) \
         ON CONFLICT (id) DO UPDATE SET proven_lsn = EXCLUDED.proven_lsn, \
             proven_created_at = EXCLUDED.proven_created_at, snapshot_xmin = EXCLUDED.snapshot_xmin, \
             rows_checked = EXCLUDED.rows_checked, stream = EXCLUDED.stream, recorded_at = EXCLUDED.recorded_at",
        t = table.proof_table
    );
    let lsn = proven.lsn.map(|l: Lsn| l.to_string());
    let rows = i64::try_from(rows).unwrap_or(i64::MAX);
    pg.execute(
        &sql,
        &[
            &lsn,
            &proven.created_unix_us,
            &table.snapshot_xmin,
            &rows,
            &settings.config().nats.stream,
        ],
    )
    .await
    .map_err(|e| match query_error(&o.table, "--record")(e) {
        VerifyError::Query { detail, .. } => failed(detail),
        other => other,
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_point_lies_just_before_the_oldest_row_not_proven() {
        let mut t = ProofTracker::default();
        for c in [10, 20, 30, 40] {
            t.row(Some(c));
        }
        assert_eq!(t.created_bound(), Some(40), "every row proven");
        t.unproven(Some(30), Some(Class::Waiting));
        t.unproven(Some(35), Some(Class::DeadLettered));
        assert_eq!(t.created_bound(), Some(29));
        t.unproven(Some(5), Some(Class::BeforeBackfill));
        assert_eq!(t.created_bound(), Some(29), "not the relay's: no hold");
        t.previous = Some(25);
        t.unproven(Some(20), Some(Class::OlderThanStream));
        assert_eq!(t.created_bound(), Some(29), "proven before");
        t.unproven(Some(26), Some(Class::OlderThanStream));
        assert_eq!(t.created_bound(), Some(25));
        t.unproven(None, Some(Class::Missing));
        assert_eq!(
            t.created_bound(),
            None,
            "a row without a time holds everything"
        );
        assert!(t.held_back());
    }
}
