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

use super::messages::{Copies, Messages};

/// The hash every side uses: SipHash with fixed keys (`DefaultHasher::new`), the same within one
/// process, which is all a comparison within one run needs. A row and a message are each two or
/// three hashes: the id's, and one of what else must match (subject, and payload with `--payloads`),
/// so the records stay 16 and 24 bytes whatever is compared.
pub(crate) fn hash64(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// The relay's event id of a message: `Outbox-Event-Id` (atomic batches, dead letters, parked
/// copies), else `Nats-Msg-Id`.
pub(crate) fn event_id(headers: Option<&async_nats::HeaderMap>) -> Option<&str> {
    let h = headers?;
    h.get("Outbox-Event-Id")
        .or_else(|| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str())
}

/// The content hash of a dead letter, and of a row the template gives no subject (which only a dead
/// letter delivers). [`content_hash`] never gives it.
pub(crate) const DEAD_LETTER: u32 = 0;

/// The content hash of a parked copy (a message on its key's parking subject): the event has not
/// reached its subject yet. [`content_hash`] never gives it.
pub(crate) const PARKED: u32 = 1;

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
        DEAD_LETTER | PARKED => 2,
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

/// What a row's messages (or their absence) say about the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowFinding {
    /// No message with its id.
    Absent,
    /// Its first copy on a subject (at this sequence) carries another subject or payload than the
    /// row gives: the exact second look tells which.
    Differs(u64),
    /// Its only copies are dead letters (the first at this sequence): consumers of its subject
    /// never saw it.
    DeadLettered(u64),
    /// It has no copy on a subject of its own, and parked copies (the last at this sequence): its
    /// key was parked, and whether it still is decides between parked and discarded.
    Parked(u64),
}

/// The copies of `id` among `parts` (each part's sequences above the one's before): the first
/// routed copy and the first dead letter over all parts. Marks the id as a row's in every part.
fn copies(parts: &[&Messages], id: u64) -> Option<Copies> {
    let mut all: Option<Copies> = None;
    for p in parts {
        let Some(c) = p.copies(id) else { continue };
        p.mark(id);
        let a = all.get_or_insert_default();
        a.routed = a.routed.or(c.routed);
        a.dead_letter = a.dead_letter.or(c.dead_letter);
        a.parked = c.parked.or(a.parked);
    }
    all
}

/// What is wrong with `row`, if anything, given the messages read (`parts`, indexed, in sequence
/// order): absent, only parked or dead-lettered, or its first routed copy carries another
/// content. A copy on its own subject after a dead letter or a parked copy (a dead letter
/// requeued, a parked key's run requeued, or the row inserted again once the cause was fixed) is
/// delivered: it is what consumers of its subject see.
pub(crate) fn check(row: RowRec, parts: &[&Messages]) -> Option<RowFinding> {
    let Some(c) = copies(parts, row.id) else {
        return Some(RowFinding::Absent);
    };
    match (c.routed, c.parked, c.dead_letter) {
        (Some((seq, content)), ..) if content != row.content => Some(RowFinding::Differs(seq)),
        (Some(_), ..) => None,
        (None, Some(seq), _) => Some(RowFinding::Parked(seq)),
        (None, None, Some(seq)) => Some(RowFinding::DeadLettered(seq)),
        (None, None, None) => Some(RowFinding::Absent),
    }
}

/// Every second copy among `parts` (indexed, in sequence order): (sequence of the first copy,
/// sequence of this copy), within one kind: a routed copy after a routed one, a dead letter after a
/// dead letter. A routed copy after a dead letter is the republished event, not a second copy.
pub(crate) fn second_copies(parts: &[&Messages]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        for group in part.groups() {
            let earlier = parts[..i].iter().find_map(|p| p.copies(group.id));
            let [routed, dead] = group.by_kind();
            let firsts = [
                earlier.and_then(|c| c.routed.map(|r| r.0)),
                earlier.and_then(|c| c.dead_letter),
            ];
            for (mut seqs, first) in [routed, dead].into_iter().zip(firsts) {
                let Some(first) = first.or_else(|| seqs.next()) else {
                    continue;
                };
                out.extend(seqs.map(|later| (first, later)));
            }
        }
    }
    out
}

/// What the stream holds that no row found, once per event id over all `parts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unmatched {
    /// An event with a routed copy (its first at this sequence).
    Routed(u64),
    /// An event stored only as dead letters (the first at this sequence).
    DeadLetter(u64),
    /// An event stored only as parked copies (the last at this sequence).
    Parked(u64),
}

/// Hands `each` every event id among `parts` that no row found ([`check`] marks what rows find),
/// with what kind of copies it has. Call after every row was checked. Nothing is collected: a
/// messages-only outbox has as many of them as messages.
pub(crate) fn unmatched(parts: &[&Messages], mut each: impl FnMut(Unmatched)) {
    for (i, part) in parts.iter().enumerate() {
        for group in part.groups() {
            // Counted where the id first appears; a later part's copy of it is that event's too.
            if group.matched || parts[..i].iter().any(|p| p.has(group.id)) {
                continue;
            }
            // A dead letter here and a routed copy in a later part: the event was republished.
            let later = parts[i + 1..].iter().filter_map(|p| p.copies(group.id));
            let later_routed = later.filter_map(|c| c.routed).map(|r| r.0).next();
            let [mut routed, mut dead] = group.by_kind();
            let parked = parts[i..].iter().rev().find_map(|p| {
                let c = p.copies(group.id)?;
                c.parked
            });
            match (routed.next().or(later_routed), parked, dead.next()) {
                (Some(seq), ..) => each(Unmatched::Routed(seq)),
                (None, Some(seq), _) => each(Unmatched::Parked(seq)),
                (None, None, Some(seq)) => each(Unmatched::DeadLetter(seq)),
                (None, None, None) => {}
            }
        }
    }
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
    fn a_row_stored_only_as_a_dead_letter_is_dead_lettered_until_republished() {
        let unroutable = RowRec {
            id: hash64(b"e-1"),
            content: DEAD_LETTER,
        };
        let claim = content_hash("outbox.Claim", Some(b"{}"));
        let mut msgs = Messages::new(1, 5);
        assert!(msgs.push(hash64(b"e-1"), 1, claim));
        assert!(msgs.push(hash64(b"e-2"), 2, DEAD_LETTER));
        assert!(msgs.push(hash64(b"e-3"), 3, DEAD_LETTER));
        assert!(msgs.push(hash64(b"e-3"), 4, claim));
        assert!(msgs.push(hash64(b"e-2"), 5, DEAD_LETTER));
        msgs.index();
        let parts = [&msgs];
        // A row the template gives no subject, stored on one: misrouted by the second look.
        assert_eq!(check(unroutable, &parts), Some(RowFinding::Differs(1)));
        assert_eq!(
            check(row("e-2", "outbox.Claim", "{}"), &parts),
            Some(RowFinding::DeadLettered(2))
        );
        assert_eq!(check(row("e-3", "outbox.Claim", "{}"), &parts), None);
        // e-2's second dead letter is a second copy; e-3's routed copy after its dead letter is not.
        assert_eq!(second_copies(&parts), vec![(2, 5)]);
    }

    #[test]
    fn a_parked_event_is_parked_at_its_last_copy_until_a_copy_on_its_subject_delivers_it() {
        let claim = content_hash("outbox.Claim", Some(b"{}"));
        let mut first_read = Messages::new(1, 4);
        // e-1 parked, then parked again by a requeue that found it still invalid; e-2 parked then
        // requeued onto its subject; e-3 a dead letter requeued onto its subject.
        for (id, seq, content) in [
            ("e-1", 1, PARKED),
            ("e-2", 2, PARKED),
            ("e-3", 3, DEAD_LETTER),
            ("e-1", 4, PARKED),
        ] {
            assert!(first_read.push(hash64(id.as_bytes()), seq, content));
        }
        first_read.index();
        let mut later = Messages::new(5, 3);
        assert!(later.push(hash64(b"e-2"), 5, claim));
        assert!(later.push(hash64(b"e-3"), 6, claim));
        assert!(later.push(hash64(b"m-1"), 7, PARKED));
        later.index();
        let parts = [&first_read, &later];
        let row = |id: &str| RowRec {
            id: hash64(id.as_bytes()),
            content: claim,
        };
        assert_eq!(check(row("e-1"), &parts), Some(RowFinding::Parked(4)));
        assert_eq!(check(row("e-2"), &parts), None, "requeued: delivered");
        assert_eq!(check(row("e-3"), &parts), None, "a requeued dead letter");
        assert_eq!(
            check(row("e-2"), &parts[..1]),
            Some(RowFinding::Parked(2)),
            "before its requeue"
        );
        assert!(
            second_copies(&parts).is_empty(),
            "a parked copy again, or the requeued one, is no second copy"
        );
        let mut seen = Vec::new();
        unmatched(&parts, |u| seen.push(u));
        assert_eq!(seen, vec![Unmatched::Parked(7)]);
        assert_ne!(content_hash("", None), PARKED);
    }

    #[test]
    fn what_no_row_found_is_handed_over_once_per_event_with_its_kind() {
        let claim = content_hash("s", None);
        let mut first_read = Messages::new(1, 4);
        for (id, seq, content) in [
            ("row", 1, claim),
            ("m-1", 2, claim),
            ("m-2", 3, DEAD_LETTER),
        ] {
            assert!(first_read.push(hash64(id.as_bytes()), seq, content));
        }
        first_read.index();
        let mut recheck = Messages::new(4, 2);
        assert!(recheck.push(hash64(b"m-1"), 4, claim));
        assert!(recheck.push(hash64(b"m-3"), 5, DEAD_LETTER));
        recheck.index();
        let parts = [&first_read, &recheck];
        let found = RowRec {
            id: hash64(b"row"),
            content: claim,
        };
        assert_eq!(check(found, &parts[..1]), None);
        let mut seen = Vec::new();
        unmatched(&parts, |u| seen.push(u));
        seen.sort_by_key(|u| match u {
            Unmatched::Routed(s) | Unmatched::DeadLetter(s) | Unmatched::Parked(s) => *s,
        });
        assert_eq!(
            seen,
            vec![
                Unmatched::Routed(2),
                Unmatched::DeadLetter(3),
                Unmatched::DeadLetter(5)
            ]
        );
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
