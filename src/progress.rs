//! The in-order progress tracker: which LSN is safe to confirm to the slot (P2 and P5 in
//! docs/guarantees.md; the rule behind it: docs/pgoutput.md#which-lsn-is-confirmed).
//!
//! Every message handed to the sink gets a sequence number; the sink awaits acks in publish order, so
//! "acked" is one counter. A transaction is done when its Commit arrived and every message published
//! before that Commit is acked; then its `Commit.end_lsn` may be confirmed, never its `commit_lsn` (the
//! walsender re-sends a transaction whose commit record starts at or after the confirmed position).
//! When nothing is open or unacknowledged, a keepalive's WAL end is confirmed, so a slot whose
//! publication is idle still advances while other tables or databases write WAL.
//!
//! Pure and synchronous: no I/O, no clocks. The relay feeds it; the source reads `confirmed()`.

use std::collections::VecDeque;

use crate::Lsn;

/// An ack arrived out of publish order: the sink's ordering broke, so nothing past it can be trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "ack for message {got} arrived while {expected} was the next expected: acks must come in publish order"
)]
pub struct OutOfOrderAck {
    /// The sequence number of the next ack expected.
    pub(crate) expected: u64,
    /// The sequence number of the ack that arrived.
    pub(crate) got: u64,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Progress {
    /// Sequence number of the next message handed to the sink.
    next_seq: u64,
    /// Messages acknowledged so far (all of `0..acked`).
    acked: u64,
    /// Committed transactions not yet confirmed, oldest first: (messages that must be acked, end LSN).
    committed: VecDeque<(u64, Lsn)>,
    /// Between Begin and Commit.
    in_txn: bool,
    /// What may be confirmed to the slot. Only moves forward.
    confirmed: Lsn,
}

impl Progress {
    /// Starts at the slot's confirmed position (or the LSN streaming started from).
    pub fn new(start: Lsn) -> Self {
        Progress {
            next_seq: 0,
            acked: 0,
            committed: VecDeque::new(),
            in_txn: false,
            confirmed: start,
        }
    }

    /// A Begin arrived.
    pub fn begin(&mut self) {
        self.in_txn = true;
    }

    /// One message is being handed to the sink; returns its sequence number, which its ack must carry.
    pub fn publish(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// A Commit arrived: the transaction is done once every message published so far is acked.
    pub fn commit(&mut self, end_lsn: Lsn) {
        self.in_txn = false;
        self.committed.push_back((self.next_seq, end_lsn));
        self.advance();
    }

    /// A unit of WAL outside any transaction (a non-transactional logical message) that ends at
    /// `end_lsn`: done, like a commit, once every message published so far is acked. It leaves an
    /// open transaction open (pgoutput never sends one inside, but nothing here depends on that).
    pub(crate) fn standalone(&mut self, end_lsn: Lsn) {
        self.committed.push_back((self.next_seq, end_lsn));
        self.advance();
    }

    /// The ack for message `seq` arrived (JetStream stored it, or it was a duplicate of a stored one).
    pub fn ack(&mut self, seq: u64) -> Result<(), OutOfOrderAck> {
        if seq != self.acked || seq >= self.next_seq {
            return Err(OutOfOrderAck {
                expected: self.acked,
                got: seq,
            });
        }
        self.acked += 1;
        self.advance();
        Ok(())
    }

    /// A keepalive: everything before `wal_end` has been sent to us. Confirmable only when idle.
    pub fn keepalive(&mut self, wal_end: Lsn) {
        if self.is_idle() && wal_end > self.confirmed {
            self.confirmed = wal_end;
        }
    }

    /// The LSN that is safe to confirm now.
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// Between a Begin and its Commit.
    pub(crate) fn in_transaction(&self) -> bool {
        self.in_txn
    }

    /// Messages published but not acked.
    pub(crate) fn in_flight(&self) -> u64 {
        self.next_seq - self.acked
    }

    /// No open transaction, nothing unacknowledged, nothing waiting to be confirmed.
    pub(crate) fn is_idle(&self) -> bool {
        !self.in_txn && self.committed.is_empty() && self.acked == self.next_seq
    }

    fn advance(&mut self) {
        while let Some(&(needed, end_lsn)) = self.committed.front() {
            if needed > self.acked {
                break;
            }
            self.committed.pop_front();
            // Commit end LSNs rise with commit order; max() keeps the promise even if a caller
            // feeds an older one (e.g. a re-sent transaction after reconnect).
            if end_lsn > self.confirmed {
                self.confirmed = end_lsn;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn confirms_end_lsn_only_after_all_acks() {
        let mut p = Progress::new(Lsn(100));
        p.begin();
        let a = p.publish();
        let b = p.publish();
        p.commit(Lsn(200));
        assert_eq!(p.confirmed(), Lsn(100));
        p.ack(a).unwrap();
        assert_eq!(p.confirmed(), Lsn(100), "one of two acked");
        p.ack(b).unwrap();
        assert_eq!(p.confirmed(), Lsn(200));
    }

    #[test]
    fn later_transaction_waits_for_earlier() {
        let mut p = Progress::new(Lsn(0));
        p.begin();
        let a = p.publish();
        p.commit(Lsn(10));
        p.begin();
        let b = p.publish();
        p.commit(Lsn(20));
        assert!(p.ack(b).is_err(), "acks come in order");
        p.ack(a).unwrap();
        assert_eq!(p.confirmed(), Lsn(10));
        p.ack(b).unwrap();
        assert_eq!(p.confirmed(), Lsn(20));
    }

    #[test]
    fn empty_transaction_confirms_at_once_when_nothing_pending() {
        let mut p = Progress::new(Lsn(5));
        p.begin();
        p.commit(Lsn(9));
        assert_eq!(p.confirmed(), Lsn(9));
    }

    #[test]
    fn keepalive_confirms_only_when_idle() {
        let mut p = Progress::new(Lsn(5));
        p.keepalive(Lsn(50));
        assert_eq!(p.confirmed(), Lsn(50), "idle: keepalive end confirmed");
        p.begin();
        p.keepalive(Lsn(60));
        assert_eq!(p.confirmed(), Lsn(50), "inside a transaction");
        let s = p.publish();
        p.commit(Lsn(70));
        p.keepalive(Lsn(80));
        assert_eq!(p.confirmed(), Lsn(50), "unacked message");
        p.ack(s).unwrap();
        assert_eq!(p.confirmed(), Lsn(70));
        p.keepalive(Lsn(80));
        assert_eq!(p.confirmed(), Lsn(80));
        p.keepalive(Lsn(75));
        assert_eq!(p.confirmed(), Lsn(80), "never backwards");
    }

    #[test]
    fn standalone_unit_confirms_after_its_message() {
        let mut p = Progress::new(Lsn(5));
        let s = p.publish();
        p.standalone(Lsn(30));
        assert_eq!(p.confirmed(), Lsn(5), "its message is not acked");
        assert!(!p.is_idle());
        p.keepalive(Lsn(40));
        assert_eq!(p.confirmed(), Lsn(5), "not idle");
        p.ack(s).unwrap();
        assert_eq!(p.confirmed(), Lsn(30));
        assert!(p.is_idle());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Txn(u8),
        Ack,
        Keepalive,
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec(
            prop_oneof![
                (0u8..4).prop_map(Op::Txn),
                Just(Op::Ack),
                Just(Op::Keepalive)
            ],
            0..200,
        )
    }

    proptest! {
        /// P2: the confirmed LSN never passes a transaction with an unacked message, never moves
        /// backwards, and reaches the last commit once everything is acked.
        #[test]
        fn never_confirms_past_unacked(ops in ops()) {
            let mut p = Progress::new(Lsn(0));
            let mut lsn = 0u64;
            // (end_lsn, last seq of the transaction or None)
            let mut txns: Vec<(u64, Option<u64>)> = Vec::new();
            let mut acked = 0u64;
            let mut published = 0u64;
            let mut prev = Lsn(0);
            for op in ops {
                match op {
                    Op::Txn(n) => {
                        p.begin();
                        let mut last = None;
                        for _ in 0..n {
                            last = Some(p.publish());
                            published += 1;
                        }
                        lsn += 100;
                        p.commit(Lsn(lsn));
                        txns.push((lsn, last));
                    }
                    Op::Ack => {
                        if acked < published {
                            p.ack(acked).unwrap();
                            acked += 1;
                        }
                    }
                    Op::Keepalive => {
                        lsn += 1;
                        p.keepalive(Lsn(lsn));
                    }
                }
                let c = p.confirmed();
                prop_assert!(c >= prev, "moved backwards");
                prev = c;
                for &(end, last) in &txns {
                    if let Some(last) = last.filter(|&l| l >= acked) {
                        prop_assert!(c < Lsn(end), "confirmed {c} past unacked txn ending {end} (seq {last})");
                    }
                }
            }
            while acked < published {
                p.ack(acked).unwrap();
                acked += 1;
            }
            if let Some(&(end, _)) = txns.last() {
                prop_assert!(p.confirmed() >= Lsn(end));
            }
            prop_assert!(p.is_idle());
        }
    }
}
