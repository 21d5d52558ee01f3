//! The waiters of read-your-writes waits, kept in LSN order and in deadline order: [`WaitSet`].
//!
//! Thousands of open waits must cost one ordered structure, not a timer task each: the owner asks
//! [`WaitSet::stored`] for every waiter an advanced stored LSN satisfies (the front of the LSN
//! order, nothing else is looked at), and sleeps once, until [`WaitSet::next_deadline`], to take the
//! expired ones with [`WaitSet::expired`]. Pure and synchronous: no I/O and no clock (deadlines are
//! values the owner compares), so it is tested on its own.

use std::collections::{BTreeSet, HashMap};

use crate::Lsn;

/// Waiters by the LSN they wait for and by their deadline. `D` is the deadline type (an
/// `Instant` in the relay, a number in tests), `W` the waiter (e.g. a channel to answer on).
#[derive(Debug)]
pub(crate) struct WaitSet<D, W> {
    /// (LSN, id): the front holds the waiters the next advance satisfies first.
    by_lsn: BTreeSet<(Lsn, u64)>,
    /// (deadline, id): the front is the next to expire.
    by_deadline: BTreeSet<(D, u64)>,
    /// id → (LSN, deadline, waiter).
    waiters: HashMap<u64, (Lsn, D, W)>,
    next_id: u64,
}

impl<D: Ord + Copy, W> Default for WaitSet<D, W> {
    fn default() -> Self {
        WaitSet {
            by_lsn: BTreeSet::new(),
            by_deadline: BTreeSet::new(),
            waiters: HashMap::new(),
            next_id: 0,
        }
    }
}

impl<D: Ord + Copy, W> WaitSet<D, W> {
    /// Adds a waiter for `lsn` that gives up at `deadline`.
    pub(crate) fn insert(&mut self, lsn: Lsn, deadline: D, waiter: W) {
        let id = self.next_id;
        self.next_id += 1;
        self.by_lsn.insert((lsn, id));
        self.by_deadline.insert((deadline, id));
        self.waiters.insert(id, (lsn, deadline, waiter));
    }

    /// Takes every waiter whose LSN is at or before `stored`, in LSN order.
    pub(crate) fn stored(&mut self, stored: Lsn) -> Vec<W> {
        let mut out = Vec::new();
        while let Some(&(lsn, id)) = self.by_lsn.first() {
            if lsn > stored {
                break;
            }
            self.by_lsn.pop_first();
            if let Some((_, deadline, w)) = self.waiters.remove(&id) {
                self.by_deadline.remove(&(deadline, id));
                out.push(w);
            }
        }
        out
    }

    /// Takes every waiter whose deadline is at or before `now`, earliest first.
    pub(crate) fn expired(&mut self, now: D) -> Vec<W> {
        let mut out = Vec::new();
        while let Some(&(deadline, id)) = self.by_deadline.first() {
            if deadline > now {
                break;
            }
            self.by_deadline.pop_first();
            if let Some((lsn, _, w)) = self.waiters.remove(&id) {
                self.by_lsn.remove(&(lsn, id));
                out.push(w);
            }
        }
        out
    }

    /// Takes every waiter for which `gone` holds (however long it would still wait).
    pub(crate) fn remove_where(&mut self, mut gone: impl FnMut(&W) -> bool) -> Vec<W> {
        let ids: Vec<u64> = self
            .waiters
            .iter()
            .filter(|(_, (_, _, w))| gone(w))
            .map(|(&id, _)| id)
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some((lsn, deadline, w)) = self.waiters.remove(&id) {
                self.by_lsn.remove(&(lsn, id));
                self.by_deadline.remove(&(deadline, id));
                out.push(w);
            }
        }
        out
    }

    /// The earliest deadline of a waiter still waiting.
    pub(crate) fn next_deadline(&self) -> Option<D> {
        self.by_deadline.first().map(|&(d, _)| d)
    }

    /// Waiters still waiting.
    pub(crate) fn len(&self) -> usize {
        self.waiters.len()
    }

    /// No waiter waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_advance_takes_exactly_the_waiters_at_or_before_it() {
        let mut set = WaitSet::default();
        set.insert(Lsn(30), 100, "c");
        set.insert(Lsn(10), 100, "a");
        set.insert(Lsn(20), 100, "b");
        set.insert(Lsn(20), 100, "b2");
        assert!(set.stored(Lsn(9)).is_empty());
        assert_eq!(set.stored(Lsn(20)), ["a", "b", "b2"]);
        assert_eq!(set.len(), 1);
        assert_eq!(set.stored(Lsn(31)), ["c"]);
        assert!(set.is_empty());
        assert_eq!(set.next_deadline(), None, "no deadline left behind");
    }

    #[test]
    fn deadlines_expire_in_order_and_leave_the_lsn_order_clean() {
        let mut set = WaitSet::default();
        set.insert(Lsn(10), 5, "early");
        set.insert(Lsn(5), 9, "late");
        set.insert(Lsn(7), 5, "early2");
        assert_eq!(set.next_deadline(), Some(5));
        assert!(set.expired(4).is_empty());
        assert_eq!(set.expired(5), ["early", "early2"]);
        assert_eq!(set.next_deadline(), Some(9));
        assert!(set.stored(Lsn(9)).len() == 1, "only the late one is left");
        assert!(set.expired(100).is_empty());
        assert!(set.is_empty());
    }

    #[test]
    fn removed_waiters_leave_both_orders() {
        let mut set = WaitSet::default();
        set.insert(Lsn(10), 5, "gone");
        set.insert(Lsn(20), 9, "kept");
        assert_eq!(set.remove_where(|w| *w == "gone"), ["gone"]);
        assert_eq!(set.next_deadline(), Some(9));
        assert!(set.stored(Lsn(10)).is_empty(), "no LSN entry left behind");
        assert_eq!(set.stored(Lsn(20)), ["kept"]);
        assert!(set.is_empty());
    }

    proptest! {
        /// Whatever the order of inserts, advances and expiries, every waiter is taken exactly once:
        /// by an advance only when its LSN is covered, by expiry only when its deadline passed.
        #[test]
        fn every_waiter_is_taken_once_and_for_the_right_reason(
            ops in prop::collection::vec((0u8..3, 0u64..50, 0u64..50), 0..300)
        ) {
            let mut set = WaitSet::default();
            let mut lsns = HashMap::new();
            let mut deadlines = HashMap::new();
            let mut taken = std::collections::HashSet::new();
            let (mut stored, mut now) = (0u64, 0u64);
            for (i, (op, a, b)) in ops.into_iter().enumerate() {
                match op {
                    // As the owner does: a wait already satisfied or already due is answered at
                    // once, never inserted.
                    0 if a <= stored || b == 0 => {}
                    0 => {
                        set.insert(Lsn(a), now + b, i);
                        lsns.insert(i, a);
                        deadlines.insert(i, now + b);
                    }
                    1 => {
                        stored += a;
                        for w in set.stored(Lsn(stored)) {
                            prop_assert!(lsns[&w] <= stored);
                            prop_assert!(taken.insert(w));
                        }
                    }
                    _ => {
                        now += a;
                        for w in set.expired(now) {
                            prop_assert!(deadlines[&w] <= now);
                            prop_assert!(taken.insert(w));
                        }
                    }
                }
                // Nothing left waiting is satisfied or expired already.
                prop_assert!(set.stored(Lsn(stored)).is_empty());
                prop_assert!(set.expired(now).is_empty());
            }
            prop_assert_eq!(taken.len() + set.len(), lsns.len());
        }
    }
}
