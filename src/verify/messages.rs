//! The relay's messages as `verify` keeps them while the rows go by: one compact record per
//! message in a vector allocated once at its exact size (the stream says how many messages it
//! holds), sorted by event-id hash and indexed by the hash's top bits, so each row finds its
//! message in one or two memory reads without the rows ever being kept or sorted. Memory is
//! [`MsgRec`]'s 16 bytes plus about one byte of index per message, whatever the ids' length:
//! ten million messages take about 170 MB.
//!
//! Beside the records, one bit per message says whether a row found it ([`Messages::mark`]):
//! the messages no row found are the stream-only events, and the dead letters among them the
//! stream-only dead letters (an atomic bit, so a shared borrow marks: 1.25 MB for ten million).
//!
//! A sequence is kept as its distance from the part's first sequence (4 bytes, not 8), so one part
//! covers at most [`MAX_SPAN`] sequences; `verify` refuses a longer range with a line naming
//! `--from-sequence`. The recheck's few later messages go into a part of their own rather than
//! growing this one: growing a vector of ten million records would copy it, doubling the peak.

use std::sync::atomic::{AtomicU64, Ordering};

use super::compare::{DEAD_LETTER, PARKED};

/// One stored message of the relay's: 16 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MsgRec {
    /// Hash of its event id (`Outbox-Event-Id`, else `Nats-Msg-Id`): [`super::compare::hash64`].
    pub(crate) id: u64,
    /// [`super::compare::content_hash`] of its subject (and payload); [`super::compare::DEAD_LETTER`]
    /// for a dead letter.
    pub(crate) content: u32,
    /// Its stream sequence minus the part's first sequence.
    offset: u32,
}

/// The furthest a part's sequence may be from its first: offsets below `u32::MAX`, so the record
/// count fits the index's `u32` too.
pub(crate) const MAX_SPAN: u64 = u32::MAX as u64 - 1;

/// The messages of one read of the stream, from sequence `base` on.
#[derive(Debug, Default)]
pub(crate) struct Messages {
    base: u64,
    recs: Vec<MsgRec>,
    /// After [`Messages::index`]: the records of bucket `b` (the top `bits` bits of the id hash)
    /// are `recs[dir[b]..dir[b + 1]]`.
    dir: Vec<u32>,
    bits: u32,
    /// After [`Messages::index`]: bit `i` is set once a row found the group starting at `recs[i]`.
    matched: Vec<AtomicU64>,
}

/// The copies of one event id in a part: the first routed one and the first dead letter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Copies {
    /// Sequence and content hash of the first copy on a subject of its own.
    pub(crate) routed: Option<(u64, u32)>,
    /// Sequence of the first copy on the dead-letter subject.
    pub(crate) dead_letter: Option<u64>,
    /// Sequence of the last parked copy (on its key's parking subject): a requeue that finds the
    /// event still invalid parks it again, so the last one says where it stands.
    pub(crate) parked: Option<u64>,
}

/// One group of records with one id hash, as [`Messages::groups`] gives it.
pub(crate) struct Group<'a> {
    /// The id hash.
    pub(crate) id: u64,
    /// Whether a row found it.
    pub(crate) matched: bool,
    recs: &'a [MsgRec],
    base: u64,
}

impl Group<'_> {
    /// The sequences of its routed copies, then of its dead letters, each in order (parked
    /// copies are neither: a key's run is parked again by each requeue that finds it invalid).
    pub(crate) fn by_kind(&self) -> [impl Iterator<Item = u64> + '_; 2] {
        let kind = |dead: bool| {
            self.recs
                .iter()
                .filter(move |r| r.content != PARKED && (r.content == DEAD_LETTER) == dead)
                .map(|r| self.base + u64::from(r.offset))
        };
        [kind(false), kind(true)]
    }
}

impl Messages {
    /// An empty part for sequences `base..=base + MAX_SPAN`, with room for exactly `capacity`
    /// records (more still fit, by the vector's usual growth).
    pub(crate) fn new(base: u64, capacity: u64) -> Messages {
        Messages {
            base,
            recs: Vec::with_capacity(usize::try_from(capacity).unwrap_or(0)),
            ..Messages::default()
        }
    }

    /// Records a message; `false` (nothing recorded) when `seq` is outside the part's range.
    #[must_use]
    pub(crate) fn push(&mut self, id: u64, seq: u64, content: u32) -> bool {
        let Some(offset) = seq
            .checked_sub(self.base)
            .filter(|&d| d <= MAX_SPAN)
            .and_then(|d| u32::try_from(d).ok())
        else {
            return false;
        };
        self.recs.push(MsgRec {
            id,
            content,
            offset,
        });
        true
    }

    /// Messages recorded.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.recs.len()
    }

    /// Sorts the records by id hash, then sequence, and builds the index; lookups need it.
    pub(crate) fn index(&mut self) {
        self.recs.sort_unstable_by_key(|r| (r.id, r.offset));
        // About four records a bucket: the index costs a byte a message, a lookup one or two reads.
        let n = self.recs.len();
        self.bits = (n / 4).max(1).ilog2();
        let buckets = 1usize << self.bits;
        self.dir = Vec::with_capacity(buckets + 1);
        let mut i = 0;
        for b in 0..buckets {
            while i < n && self.bucket(self.recs[i].id) < b {
                i += 1;
            }
            // `i` fits: a part holds at most MAX_SPAN + 1 sequences, one record each.
            self.dir.push(i as u32);
        }
        self.dir.push(n as u32);
        self.matched = (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
    }

    fn bucket(&self, id: u64) -> usize {
        id.checked_shr(64 - self.bits).unwrap_or(0) as usize
    }

    /// The index of the first record with id hash `id` and the records, in sequence order
    /// (after [`Messages::index`]).
    fn group(&self, id: u64) -> (usize, &[MsgRec]) {
        let b = self.bucket(id);
        let (Some(&lo), Some(&hi)) = (self.dir.get(b), self.dir.get(b + 1)) else {
            return (0, &[]);
        };
        let bucket = &self.recs[lo as usize..hi as usize];
        let start = bucket.partition_point(|r| r.id < id);
        let len = bucket[start..].partition_point(|r| r.id == id);
        (lo as usize + start, &bucket[start..start + len])
    }

    /// The first message with id hash `id`: its sequence and content hash.
    #[cfg(test)]
    pub(crate) fn first(&self, id: u64) -> Option<(u64, u32)> {
        self.group(id).1.first().map(|r| (self.seq(r), r.content))
    }

    /// The copies with id hash `id` in this part, if it has any.
    pub(crate) fn copies(&self, id: u64) -> Option<Copies> {
        let (_, recs) = self.group(id);
        if recs.is_empty() {
            return None;
        }
        let mut c = Copies::default();
        for r in recs {
            match r.content {
                DEAD_LETTER => c.dead_letter = c.dead_letter.or(Some(self.seq(r))),
                PARKED => c.parked = Some(self.seq(r)),
                content => c.routed = c.routed.or(Some((self.seq(r), content))),
            }
        }
        Some(c)
    }

    /// Notes that a row has id hash `id` (no effect when no message has it).
    pub(crate) fn mark(&self, id: u64) {
        let (i, recs) = self.group(id);
        if !recs.is_empty()
            && let Some(word) = self.matched.get(i / 64)
        {
            word.fetch_or(1 << (i % 64), Ordering::Relaxed);
        }
    }

    /// Whether `id` is among this part's messages.
    pub(crate) fn has(&self, id: u64) -> bool {
        !self.group(id).1.is_empty()
    }

    fn seq(&self, r: &MsgRec) -> u64 {
        self.base + u64::from(r.offset)
    }

    /// Each group of messages with one id hash (after [`Messages::index`]).
    pub(crate) fn groups(&self) -> impl Iterator<Item = Group<'_>> {
        let mut at = 0usize;
        self.recs.chunk_by(|a, b| a.id == b.id).map(move |g| {
            let i = at;
            at += g.len();
            let bit = self.matched.get(i / 64).map(|w| w.load(Ordering::Relaxed));
            Group {
                id: g[0].id,
                matched: bit.is_some_and(|w| w & (1 << (i % 64)) != 0),
                recs: g,
                base: self.base,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_16_bytes_and_every_id_is_found_at_its_first_sequence() {
        assert_eq!(std::mem::size_of::<MsgRec>(), 16);
        // Ids spread over the whole hash range, some twice, plus an empty and a one-record part.
        let mut m = Messages::new(100, 3000);
        for i in 0..3000u64 {
            let id = (i % 2500).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            // Content 0 is a dead letter's, 1 a parked copy's: these are all routed.
            assert!(m.push(id, 100 + i, i as u32 + 2));
        }
        m.index();
        for i in 0..2500u64 {
            let id = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            assert_eq!(m.first(id), Some((100 + i, i as u32 + 2)), "id {i}");
        }
        assert_eq!(m.first(12345), None);
        let twice: Vec<(u64, Vec<u64>)> = m
            .groups()
            .map(|g| {
                let [routed, _] = g.by_kind();
                (g.id, routed.collect::<Vec<u64>>())
            })
            .filter(|(_, s)| s.len() > 1)
            .collect();
        assert_eq!(twice.len(), 500);
        assert!(twice.iter().all(|(_, s)| s[1] == s[0] + 2500));

        let mut empty = Messages::new(1, 0);
        empty.index();
        assert_eq!(empty.first(0), None);
        let mut one = Messages::new(1, 1);
        assert!(one.push(u64::MAX, 1, 7));
        one.index();
        assert_eq!(one.first(u64::MAX), Some((1, 7)));
        assert_eq!(one.first(0), None);
    }

    #[test]
    fn a_sequence_outside_the_parts_range_is_refused_not_wrapped() {
        let mut m = Messages::new(10, 2);
        assert!(!m.push(1, 9, 0));
        assert!(!m.push(1, 10 + MAX_SPAN + 1, 0));
        assert!(m.push(1, 10 + MAX_SPAN, 0));
        m.index();
        assert_eq!(m.first(1), Some((10 + MAX_SPAN, 0)));
    }
}
