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
/// process, which is all a comparison within one run needs. A row and a message are each two or
/// three hashes: the id's, and one of what else must match (subject, and payload with `--payloads`),
/// so the records stay 16 and 24 bytes whatever is compared.
pub(crate) fn hash64(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// The content hash of a dead letter, and of a row the template gives no subject (which only a dead
/// letter delivers). [`content_hash`] never gives it.
pub(crate) const DEAD_LETTER: u64 = 0;

/// The hash of what a message carries besides its id: its subject and, with `--payloads`, its body.
pub(crate) fn content_hash(subject: &str, payload: Option<&[u8]>) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    subject.hash(&mut h);
    if let Some(p) = payload {
        p.hash(&mut h);
    }
    match h.finish() {
        DEAD_LETTER => 1,
        x => x,
    }
}

/// One outbox row, as the comparison needs it: 16 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowRec {
    /// Hash of the event id's text form.
    pub(crate) id: u64,
    /// [`content_hash`] of the subject the template gives it (and its payload), or [`DEAD_LETTER`]
    /// when the relay makes it a dead letter.
    pub(crate) content: u64,
}

/// One stored message of the relay's: 24 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MsgRec {
    /// Hash of its event id (`Outbox-Event-Id`, else `Nats-Msg-Id`).
    pub(crate) id: u64,
    /// Its stream sequence.
    pub(crate) seq: u64,
    /// [`content_hash`] of its subject (and payload); [`DEAD_LETTER`] for a dead letter, which
    /// delivers its row whatever it carries.
    pub(crate) content: u64,
}

/// What a row's message (or its absence) says about the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowFinding {
    /// No message with its id.
    Absent,
    /// Its first copy (at this sequence) carries another subject or payload than the row gives:
    /// the exact second look tells which.
    Differs(u64),
}

/// The candidates the merge found, before the exact second look.
#[derive(Debug, Default)]
pub(crate) struct Candidates {
    /// Rows (by index into the sorted rows) and what is wrong with them.
    pub(crate) rows: Vec<(usize, RowFinding)>,
    /// Second copies: (sequence of the first copy, sequence of this copy).
    pub(crate) second_copies: Vec<(u64, u64)>,
}

/// Sorts both sides by id hash (messages then by sequence) and merges them.
pub(crate) fn merge(rows: &mut [RowRec], msgs: &mut [MsgRec]) -> Candidates {
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
        if first.content != DEAD_LETTER && first.content != row.content {
            out.rows.push((i, RowFinding::Differs(first.seq)));
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
            content: content_hash(subject, Some(payload.as_bytes())),
        }
    }

    fn msg(id: &str, seq: u64, subject: &str, payload: &str) -> MsgRec {
        MsgRec {
            id: hash64(id.as_bytes()),
            seq,
            content: content_hash(subject, Some(payload.as_bytes())),
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
        let c = merge(&mut rows, &mut msgs);
        assert_eq!(c.second_copies, vec![(4, 7)]);
        let mut found: Vec<(u64, RowFinding)> =
            c.rows.iter().map(|&(i, f)| (rows[i].id, f)).collect();
        found.sort_by_key(|x| x.0);
        let mut want = vec![
            (hash64(b"e-2"), RowFinding::Absent),
            (hash64(b"e-3"), RowFinding::Differs(2)),
            (hash64(b"e-4"), RowFinding::Differs(3)),
        ];
        want.sort_by_key(|x| x.0);
        assert_eq!(found, want);

        let mut rows = vec![row("e-1", "outbox.Claim", "{}")];
        let mut msgs = vec![msg("e-1", 1, "outbox.Claim", "{}")];
        let c = merge(&mut rows, &mut msgs);
        assert!(c.rows.is_empty() && c.second_copies.is_empty());
        assert_eq!(std::mem::size_of::<RowRec>(), 16);
        assert_eq!(std::mem::size_of::<MsgRec>(), 24);
    }

    #[test]
    fn a_dead_letter_delivers_its_row_and_a_row_without_a_subject_needs_one() {
        let unroutable = RowRec {
            id: hash64(b"e-1"),
            content: DEAD_LETTER,
        };
        let mut rows = vec![unroutable, row("e-2", "outbox.Claim", "{}")];
        let dl = MsgRec {
            id: hash64(b"e-2"),
            seq: 2,
            content: DEAD_LETTER,
        };
        let mut msgs = vec![msg("e-1", 1, "outbox.Claim", "{}"), dl];
        let c = merge(&mut rows, &mut msgs);
        assert_eq!(c.rows.len(), 1);
        assert_eq!(rows[c.rows[0].0].id, hash64(b"e-1"));
        assert_eq!(c.rows[0].1, RowFinding::Differs(1));
    }
}
