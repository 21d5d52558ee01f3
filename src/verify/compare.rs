//! The comparison at the heart of `verify`: each row, as it is read, is looked up among the
//! relay's messages ([`Messages`], compact records indexed by a 64-bit hash of the event id), so
//! memory is a few dozen bytes per *message* whatever the ids' length, the rows are never kept,
//! and no map of strings is built. A hash only ever *proposes* a difference: two ids with one hash
//! could hide one from the other, so every candidate the lookup finds is looked at again exactly
//! (the message by its sequence, the row by its id) before it is reported ([`super::verify`]).
//!
//! What a hash can and cannot do here: equal ids always hash equal, so a row whose hash no message
//! has is certainly not in the stream, and a subject or payload whose hash differs certainly
//! differs. The reverse can hide a difference: two ids with one 64-bit hash (a chance of about
//! n²/2⁶⁵ for n events: 3·10⁻⁶ for ten million) can hide a missing row, and a changed subject or
//! payload with the row's 32-bit content hash goes unseen (a chance of 2⁻³² ≈ 2·10⁻¹⁰ for each
//! changed message: the content is only compared within a pair, so it needs no birthday margin,
//! and its 4 bytes keep a message's record at 16). Duplicates are the one class a collision could
//! invent, which is why each one is confirmed by reading both copies.

use std::hash::{Hash, Hasher};

use super::messages::Messages;

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
pub(crate) const DEAD_LETTER: u32 = 0;

/// The hash of what a message carries besides its id: its subject and, with `--payloads`, its body;
/// 32 bits (both halves of the 64 folded together).
pub(crate) fn content_hash(subject: &str, payload: Option<&[u8]>) -> u32 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    subject.hash(&mut h);
    if let Some(p) = payload {
        p.hash(&mut h);
    }
    let x = h.finish();
    match (x ^ (x >> 32)) as u32 {
        DEAD_LETTER => 1,
        x => x,
    }
}

/// One outbox row, as the comparison needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowRec {
    /// Hash of the event id's text form.
    pub(crate) id: u64,
    /// [`content_hash`] of the subject the template gives it (and its payload), or [`DEAD_LETTER`]
    /// when the relay makes it a dead letter.
    pub(crate) content: u32,
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

/// The first message with id hash `id` among `parts` (each part's sequences above the one's
/// before): its sequence and content hash.
fn first(parts: &[&Messages], id: u64) -> Option<(u64, u32)> {
    parts.iter().find_map(|p| p.first(id))
}

/// What is wrong with `row`, if anything, given the messages read (`parts`, indexed, in sequence
/// order): absent, or its first copy carries another content. A dead letter delivers its row
/// whatever it carries.
pub(crate) fn check(row: RowRec, parts: &[&Messages]) -> Option<RowFinding> {
    match first(parts, row.id) {
        None => Some(RowFinding::Absent),
        Some((seq, content)) if content != DEAD_LETTER && content != row.content => {
            Some(RowFinding::Differs(seq))
        }
        Some(_) => None,
    }
}

/// Every second copy among `parts` (indexed, in sequence order): (sequence of the first copy,
/// sequence of this copy), the first copy being the lowest sequence of its id hash in any part.
pub(crate) fn second_copies(parts: &[&Messages]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        for (id, mut seqs) in part.groups() {
            let Some(first) = first(&parts[..i], id)
                .map(|(s, _)| s)
                .or_else(|| seqs.next())
            else {
                continue;
            };
            out.extend(seqs.map(|later| (first, later)));
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

    /// An indexed part from `base` with these (id, sequence, subject, payload) messages.
    fn part(base: u64, msgs: &[(&str, u64, &str, &str)]) -> Messages {
        let mut m = Messages::new(base, msgs.len() as u64);
        for &(id, seq, subject, payload) in msgs {
            let content = content_hash(subject, Some(payload.as_bytes()));
            assert!(m.push(hash64(id.as_bytes()), seq, content));
        }
        m.index();
        m
    }

    #[test]
    fn each_class_is_found_once_and_nothing_on_a_clean_pair() {
        let msgs = part(
            1,
            &[
                ("e-1", 1, "outbox.Claim", "{}"),
                ("e-3", 2, "outbox.Claim", "{\"a\": 2}"),
                ("e-4", 3, "outbox.Other", "{}"),
                ("e-5", 4, "outbox.Claim", "{}"),
                ("gone", 5, "outbox.Claim", "{}"),
                ("e-5", 7, "outbox.Claim", "{}"),
            ],
        );
        let parts = [&msgs];
        assert_eq!(second_copies(&parts), vec![(4, 7)]);
        let found: Vec<Option<RowFinding>> = [
            row("e-1", "outbox.Claim", "{}"),
            row("e-2", "outbox.Claim", "{}"),
            row("e-3", "outbox.Claim", "{\"a\": 1}"),
            row("e-4", "outbox.Claim", "{}"),
            row("e-5", "outbox.Claim", "{}"),
        ]
        .into_iter()
        .map(|r| check(r, &parts))
        .collect();
        assert_eq!(
            found,
            vec![
                None,
                Some(RowFinding::Absent),
                Some(RowFinding::Differs(2)),
                Some(RowFinding::Differs(3)),
                None
            ]
        );
    }

    #[test]
    fn a_dead_letter_delivers_its_row_and_a_row_without_a_subject_needs_one() {
        let unroutable = RowRec {
            id: hash64(b"e-1"),
            content: DEAD_LETTER,
        };
        let mut msgs = Messages::new(1, 2);
        let claim = content_hash("outbox.Claim", Some(b"{}"));
        assert!(msgs.push(hash64(b"e-1"), 1, claim));
        assert!(msgs.push(hash64(b"e-2"), 2, DEAD_LETTER));
        msgs.index();
        assert_eq!(check(unroutable, &[&msgs]), Some(RowFinding::Differs(1)));
        assert_eq!(check(row("e-2", "outbox.Claim", "{}"), &[&msgs]), None);
    }

    #[test]
    fn the_rechecks_later_part_finds_absent_rows_and_copies_across_parts() {
        let first_read = part(1, &[("e-1", 1, "s", ""), ("e-2", 2, "s", "")]);
        let recheck = part(
            3,
            &[
                ("e-3", 3, "s", ""),
                ("e-1", 4, "s", ""),
                ("e-3", 5, "t", ""),
            ],
        );
        let parts = [&first_read, &recheck];
        assert_eq!(
            check(row("e-3", "s", ""), &[&first_read]),
            Some(RowFinding::Absent)
        );
        assert_eq!(
            check(row("e-3", "s", ""), &parts),
            None,
            "its first copy decides"
        );
        assert_eq!(check(row("e-1", "s", ""), &parts), None);
        let mut copies = second_copies(&parts);
        copies.sort_unstable();
        assert_eq!(copies, vec![(1, 4), (3, 5)]);
    }

    /// Two ids with one hash (forced here: the records carry the hash, not the id) look like one
    /// event: the second row passes and the second message looks like a copy. This is the case
    /// the exact second look exists for: verify confirms every copy by reading both messages' ids.
    #[test]
    fn a_hash_collision_proposes_a_duplicate_and_hides_nothing_else_it_can_see() {
        let h = hash64(b"e-1");
        let mut msgs = Messages::new(10, 2);
        let c = content_hash("s", None);
        assert!(msgs.push(h, 10, c));
        assert!(msgs.push(h, 11, c));
        msgs.index();
        let parts = [&msgs];
        assert_eq!(second_copies(&parts), vec![(10, 11)]);
        let a = RowRec { id: h, content: c };
        let b = RowRec {
            id: h,
            content: content_hash("t", None),
        };
        assert_eq!(check(a, &parts), None);
        // Paired with the first copy, a row of another subject is still proposed.
        assert_eq!(check(b, &parts), Some(RowFinding::Differs(10)));
    }
}
