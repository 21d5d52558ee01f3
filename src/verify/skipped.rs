//! What a `verify` run did not check, and why: each a [`Skipped`] finding, whose text (its
//! `Display`) is the line the report prints after `not checked:` and lists in `--json`'s
//! `skipped`. Scripts and people read these lines, so their words only change on purpose; the
//! steps say which one applies, this file says how it reads.

use std::fmt;

/// One thing a run left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skipped {
    /// Sequences before the stream's first message are gone, `why` (a limit) explains those
    /// stored before `before` (RFC 3339).
    HeadBefore {
        /// Sequences gone.
        gone: u64,
        /// The first of them.
        from: u64,
        /// The last of them.
        to: u64,
        /// The limit, in words.
        why: String,
        /// Only messages stored before this time can have gone that way.
        before: String,
    },
    /// Sequences before the stream's first message are gone, by `why` (a limit that removes any).
    Head {
        /// Sequences gone.
        gone: u64,
        /// The first of them.
        from: u64,
        /// The last of them.
        to: u64,
        /// The limit, in words.
        why: String,
    },
    /// Sequences inside the stream are gone, which `why` (a limit) may explain.
    Inside {
        /// Sequences gone.
        gone: u64,
        /// The limit, in words.
        why: String,
    },
    /// `--where` or `--since` leave rows out: the events no row found are not judged.
    StreamOnlyFiltered,
    /// Rows before the backfill that began the stream (values escaped and bounded: stream
    /// metadata anyone allowed to update the stream may write).
    BeforeBackfill {
        /// How many.
        rows: u64,
        /// The backfill's slot.
        slot: String,
        /// When it started.
        started: String,
        /// Its `--where`.
        where_sql: String,
    },
    /// `proven_up_to` is said for a check of every row.
    ProofFiltered,
    /// `proven_up_to` needs the table's `created_at`.
    ProofNoCreatedAt {
        /// The outbox table.
        table: String,
    },
    /// Rows without a usable event id.
    UnusableIds {
        /// How many.
        rows: u64,
        /// `event::MAX_ID_BYTES`.
        max_id_bytes: usize,
    },
    /// Payloads were not compared.
    Payloads,
    /// A messages-only outbox: no rows to compare.
    NoRows,
    /// NATS could not be reached: only the slot was read.
    StreamUnreachable,
    /// `--record` without the stream.
    RecordUnreachable,
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Skipped::HeadBefore {
                gone,
                from,
                to,
                why,
                before,
            } => write!(
                f,
                "{gone} sequences before the stream's first message ({from}..{to}) are gone: {why} explains those \
                 stored before {before}; rows created after it whose message is gone count as missing"
            ),
            Skipped::Head { gone, from, to, why } => write!(
                f,
                "{gone} sequences before the stream's first message ({from}..{to}) are gone by {why}"
            ),
            Skipped::Inside { gone, why } => write!(
                f,
                "{gone} sequences inside the stream are gone, which {why} may explain: not counted as holes, and rows \
                 whose message it removed count as missing"
            ),
            Skipped::StreamOnlyFiltered => f.write_str(
                "stream_only and dead letters without a row (--where or --since leave rows out, whose \
                 messages would count)",
            ),
            Skipped::BeforeBackfill {
                rows,
                slot,
                started,
                where_sql,
            } => write!(
                f,
                "{rows} rows created before the backfill that began this stream (slot {slot}, {started}, --where \
                 \"{where_sql}\") are in no message: that backfill did not select them, so they are not the relay's \
                 (before_backfill)"
            ),
            Skipped::ProofFiltered => {
                f.write_str("proven_up_to (it is said for a check of every row)")
            }
            Skipped::ProofNoCreatedAt { table } => write!(
                f,
                "proven_up_to ({table} has no created_at column to say it in)"
            ),
            Skipped::UnusableIds { rows, max_id_bytes } => write!(
                f,
                "{rows} rows without a usable event id (null, empty, over {max_id_bytes} bytes or with a line break): \
                 the relay publishes them under a WAL-derived id, which no row can be matched with"
            ),
            Skipped::Payloads => f.write_str("payloads (give --payloads)"),
            Skipped::NoRows => f.write_str(
                "completeness, waiting, routing and payloads (outbox.table is empty: no rows to compare; \
                 the events are checked for continuity only, see stream_only)",
            ),
            Skipped::StreamUnreachable => f.write_str(
                "every check of the stream, and of rows the slot does not hold (NATS could not be reached)",
            ),
            Skipped::RecordUnreachable => {
                f.write_str("--record (nothing is proven without the stream)")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines as the report has printed them: the enum changed how they are made, not a word.
    #[test]
    fn each_finding_reads_as_the_line_it_always_was() {
        let cases = [
            (
                Skipped::HeadBefore {
                    gone: 3,
                    from: 1,
                    to: 3,
                    why: "max_age 86400s".into(),
                    before: "2026-01-01T00:00:00.000000Z".into(),
                },
                "3 sequences before the stream's first message (1..3) are gone: max_age 86400s explains those \
                 stored before 2026-01-01T00:00:00.000000Z; rows created after it whose message is gone count as missing",
            ),
            (
                Skipped::Head {
                    gone: 2,
                    from: 1,
                    to: 2,
                    why: "discard old".into(),
                },
                "2 sequences before the stream's first message (1..2) are gone by discard old",
            ),
            (
                Skipped::Inside {
                    gone: 4,
                    why: "max_msgs_per_subject".into(),
                },
                "4 sequences inside the stream are gone, which max_msgs_per_subject may explain: not counted as \
                 holes, and rows whose message it removed count as missing",
            ),
            (
                Skipped::BeforeBackfill {
                    rows: 5,
                    slot: "s".into(),
                    started: "t".into(),
                    where_sql: "id > 3".into(),
                },
                "5 rows created before the backfill that began this stream (slot s, t, --where \"id > 3\") are in \
                 no message: that backfill did not select them, so they are not the relay's (before_backfill)",
            ),
            (
                Skipped::ProofNoCreatedAt {
                    table: "public.outbox".into(),
                },
                "proven_up_to (public.outbox has no created_at column to say it in)",
            ),
            (
                Skipped::UnusableIds {
                    rows: 2,
                    max_id_bytes: 256,
                },
                "2 rows without a usable event id (null, empty, over 256 bytes or with a line break): the relay \
                 publishes them under a WAL-derived id, which no row can be matched with",
            ),
            (Skipped::Payloads, "payloads (give --payloads)"),
            (
                Skipped::RecordUnreachable,
                "--record (nothing is proven without the stream)",
            ),
        ];
        for (s, line) in cases {
            assert_eq!(s.to_string(), line);
        }
    }
}
