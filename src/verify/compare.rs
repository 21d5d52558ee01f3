//! The comparison at the heart of `verify`: compact records of the rows and of the stream's
//! messages, sorted by a 64-bit hash of the event id and merged, so memory is a few dozen bytes per
//! event whatever the ids' length, and no map of strings is built. A hash only ever *proposes* a
//! difference: two ids with one hash could hide one from the other, so every candidate the merge
//! finds is looked at again exactly (the message by its sequence, the row by its id) before it is
//! reported ([`super::Verify`]).
//!
//! What a hash can and cannot do here: equal ids always hash equal, so a row whose hash no message
//! has is certainly not in the stream, and a subject or payload whose hash differs certainly
//! differs. The reverse (a collision hiding a missing row or a changed payload) has a chance of about
//! n²/2⁶⁵ for n events: 3·10⁻⁶ for ten million. Duplicates are the one class a collision could
//! invent, which is why each one is confirmed by reading both copies.

use std::hash::{Hash, Hasher};

/// The hash every side uses: SipHash with fixed keys (`DefaultHasher::new`), the same within one
/// process, which is all a comparison within one run needs.
pub(crate) fn hash64(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// One outbox row, as the comparison needs it: 40 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowRec {
    /// Hash of the event id's text form.
    pub(crate) id: u64,
    /// Hash of the subject the template gives it; `None` when the template gives none (the relay
    /// makes the event a dead letter).
    pub(crate) subject: Option<u64>,
    /// Hash of the payload as the relay publishes it (0 without `--payloads`).
    pub(crate) payload: u64,
    /// The creation time in microseconds since the epoch, when the table has the column.
    pub(crate) created_us: Option<i64>,
    /// Created within the in-flight window before the rows were read.
    pub(crate) young: bool,
}

/// One stored message of the relay's: 40 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MsgRec {
    /// Hash of its event id (`Outbox-Event-Id`, else `Nats-Msg-Id`).
    pub(crate) id: u64,
    /// Its stream sequence.
    pub(crate) seq: u64,
    /// Hash of its subject.
    pub(crate) subject: u64,
    /// Hash of its payload (0 without `--payloads`).
    pub(crate) payload: u64,
    /// A dead letter: delivered, but neither routed nor carrying the payload as such.
    pub(crate) dead_letter: bool,
}

/// What a row's message (or its absence) says about the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowFinding {
    /// No message with its id.
    Absent,
    /// Its first copy is on another subject than the template gives (sequence of that copy).
    Misrouted(u64),
    /// Its first copy's payload differs from the row's (sequence of that copy).
    PayloadDiffers(u64),
}

/// The candidates the merge found, before the exact second look.
#[derive(Debug, Default)]
pub(crate) struct Candidates {
    /// Rows (by index into the sorted rows) and what is wrong with them.
    pub(crate) rows: Vec<(usize, RowFinding)>,
    /// Second copies: (sequence of the first copy, sequence of this copy).
    pub(crate) second_copies: Vec<(u64, u64)>,
}

/// Sorts both sides by id hash (messages then by sequence) and merges them. `payloads`: compare
/// payload hashes too.
pub(crate) fn merge(rows: &mut [RowRec], msgs: &mut [MsgRec], payloads: bool) -> Candidates {
    rows.sort_unstable_by_key(|r| r.id);
    msgs.sort_unstable_by_key(|m| (m.id, m.seq));
    let mut out = Candidates::default();
    for group in msgs.chunk_by(|a, b| a.id == b.id) {
        for later in &group[1..] {
            out.second_copies.push((group[0].seq, later.seq));
        }
    }
    let mut m = 0;
    for (i, row) in rows.iter().enumerate() {
        while m < msgs.len() && msgs[m].id < row.id {
            m += 1;
        }
        let Some(first) = msgs.get(m).filter(|x| x.id == row.id) else {
            out.rows.push((i, RowFinding::Absent));
            continue;
        };
        let routed = match row.subject {
            Some(subject) => first.dead_letter || first.subject == subject,
            // The template gives no subject: only a dead letter is right.
            None => first.dead_letter,
        };
        if !routed {
            out.rows.push((i, RowFinding::Misrouted(first.seq)));
        } else if payloads && !first.dead_letter && first.payload != row.payload {
            out.rows.push((i, RowFinding::PayloadDiffers(first.seq)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, subject: &str, payload: &str) -> RowRec {
        RowRec {
            id: hash64(id.as_bytes()),
            subject: Some(hash64(subject.as_bytes())),
            payload: hash64(payload.as_bytes()),
            created_us: None,
            young: false,
        }
    }

    fn msg(id: &str, seq: u64, subject: &str, payload: &str) -> MsgRec {
        MsgRec {
            id: hash64(id.as_bytes()),
            seq,
            subject: hash64(subject.as_bytes()),
            payload: hash64(payload.as_bytes()),
            dead_letter: false,
        }
    }

    #[test]
    fn the_merge_finds_each_class_once_and_nothing_on_a_clean_pair() {
        let mut rows = vec![
            row("e-1", "outbox.Claim", "{}"),
            row("e-2", "outbox.Claim", "{}"),
            row("e-3", "outbox.Claim", "{\"a\": 1}"),
            row("e-4", "outbox.Claim", "{}"),
            row("e-5", "outbox.Claim", "{}"),
        ];
        let mut msgs = vec![
            msg("e-1", 1, "outbox.Claim", "{}"),
            msg("e-3", 2, "outbox.Claim", "{\"a\": 2}"),
            msg("e-4", 3, "outbox.Other", "{}"),
            msg("e-5", 4, "outbox.Claim", "{}"),
            msg("e-5", 7, "outbox.Claim", "{}"),
            msg("gone", 5, "outbox.Claim", "{}"),
        ];
        let c = merge(&mut rows, &mut msgs, true);
        assert_eq!(c.second_copies, vec![(4, 7)]);
        let mut found: Vec<(u64, RowFinding)> =
            c.rows.iter().map(|&(i, f)| (rows[i].id, f)).collect();
        found.sort_by_key(|x| x.0);
        let mut want = vec![
            (hash64(b"e-2"), RowFinding::Absent),
            (hash64(b"e-3"), RowFinding::PayloadDiffers(2)),
            (hash64(b"e-4"), RowFinding::Misrouted(3)),
        ];
        want.sort_by_key(|x| x.0);
        assert_eq!(found, want);
        // Without --payloads the payload is not compared.
        let c = merge(&mut rows, &mut msgs, false);
        assert_eq!(c.rows.len(), 2);

        let mut rows = vec![row("e-1", "outbox.Claim", "{}")];
        let mut msgs = vec![msg("e-1", 1, "outbox.Claim", "{}")];
        let c = merge(&mut rows, &mut msgs, true);
        assert!(c.rows.is_empty() && c.second_copies.is_empty());
    }

    #[test]
    fn a_dead_letter_delivers_its_row_and_a_row_without_a_subject_needs_one() {
        let mut unroutable = row("e-1", "", "{}");
        unroutable.subject = None;
        let mut rows = vec![unroutable, row("e-2", "outbox.Claim", "{}")];
        let mut dl = msg("e-2", 2, "outbox_dead_letter", "");
        dl.dead_letter = true;
        let mut msgs = vec![msg("e-1", 1, "outbox.Claim", "{}"), dl];
        let c = merge(&mut rows, &mut msgs, true);
        assert_eq!(c.rows.len(), 1);
        assert_eq!(rows[c.rows[0].0].id, hash64(b"e-1"));
        assert_eq!(c.rows[0].1, RowFinding::Misrouted(1));
    }
}
