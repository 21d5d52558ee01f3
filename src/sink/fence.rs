//! Fencing the stream, owned by the sink: at the start of every session the sink reads the stream's
//! tail, skips the replayed events already stored there, and publishes every further message with
//! `Nats-Expected-Last-Sequence` = the sequence the previous one will get. The sink alone owns it:
//! expectations, duplicates and the stream's last known sequence are plain fields.
//!
//! Why: after a lost connection the NATS client reconnects on its own and sends what it still had
//! queued, while a publish that was on the broken connection is gone. Deduplication by `Nats-Msg-Id`
//! cannot repair that: the lost event would be stored later, after events that committed after it
//! (P4). With the expectation, the first message after a gap is refused (10071) and so is everything
//! behind it; the relay restarts, reads the tail again and goes on from exactly there. The stream
//! therefore always holds a gap-free prefix of the outbox in commit order, also beyond the duplicate
//! window. It requires that only the relay writes the stream (`nats.fence = false` turns this off).
//!
//! Chained by id as well: every message after a session's first also carries
//! `Nats-Expected-Last-Msg-Id` = the `Nats-Msg-Id` of the message the session published before it.
//! A sequence alone can be matched by accident: a publish of an ended session that arrives late
//! takes the sequence the new session's first message expected (that one is refused), and a later
//! message of the new session, whose expected sequence the late ones happened to fill, would be
//! stored past the refused one: out of commit order. Its predecessor's id is what a late or
//! foreign message cannot supply: with it, the first refused message refuses every message behind
//! it (each expects the id of one that was not stored), and nothing is stored past it. The first
//! message of a session expects only a sequence: the server keeps the last message id in memory
//! and, after its own restart, only for a stream whose last message is inside the duplicate window,
//! so an id expectation on a tail the session did not write could refuse every session.
//!
//! An event whose id JetStream already holds (an id reused by the application, a re-inserted row, a
//! backfill overlapping live traffic) is acknowledged as a duplicate and takes no sequence. The sink
//! then counts it ([`Fence::duplicate`]), so later publishes expect one sequence less, and
//! republishes the few already sent with the old expectation: one skipped message and a log line,
//! never a session restart.
//!
//! This file holds the expectations ([`Fence`]); the tail they start from is `tail.rs`, and which
//! replayed events the tail says are stored is the replay's decision, in `replay.rs` ([`Replay`]).

use crate::Lsn;
use crate::position::Position;

use super::replay::{Replay, Replayed};
use super::tail::Tail;

/// The fence of one session, owned by the sink: which replayed events to skip, which sequence (and
/// previous message id) each publish expects, and the stream's last sequence as the acks report it.
#[derive(Debug)]
pub(crate) struct Fence {
    replay: Replay,
    /// The stream's last sequence when the session started.
    base: u64,
    /// Messages published with an expectation so far (each should take one sequence).
    published: u64,
    /// Of those, how many JetStream acknowledged as duplicates (they took none).
    duplicates: u64,
    /// The last sequence the stream is known to hold.
    last_stored: u64,
    /// The `Nats-Msg-Id` of the message at `last_stored`, when this session stored it (`None`
    /// before: a session's first message expects only a sequence).
    last_stored_id: Option<String>,
    /// The `Nats-Msg-Id` of the message published before the next one: its id expectation.
    chain: Option<String>,
}

/// What a fenced message expects of the stream when it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Expect {
    /// `Nats-Expected-Last-Sequence`.
    pub(crate) seq: u64,
    /// `Nats-Expected-Last-Msg-Id`, on every message after a session's first.
    pub(crate) id: Option<String>,
}

impl Fence {
    /// The fence of a session that starts with the stream at `tail`, replaying as `replay` says.
    pub(crate) fn new(tail: &Tail, replay: Replay) -> Self {
        Fence {
            replay,
            base: tail.last_sequence,
            published: 0,
            duplicates: 0,
            last_stored: tail.last_sequence,
            last_stored_id: None,
            chain: None,
        }
    }

    /// What to do with a replayed event ([`Replay::replayed`]).
    pub(crate) fn replayed(&mut self, position: Position, id: &str) -> Replayed {
        self.replay.replayed(position, id)
    }

    /// A keepalive at `wal_end` ([`Replay::passed`]).
    pub(crate) fn passed(&mut self, wal_end: Lsn) -> Option<Position> {
        self.replay.passed(wal_end)
    }

    /// Events skipped whose storage is not yet proven ([`Replay::unverified`]).
    pub(crate) fn unverified(&self) -> u64 {
        self.replay.unverified()
    }

    /// What the next message, whose `Nats-Msg-Id` is `id`, expects; counts it, and chains the one
    /// after it to `id`.
    pub(crate) fn next_expected(&mut self, id: &str) -> Expect {
        Expect {
            seq: self.count(),
            id: self.chain.replace(id.to_owned()),
        }
    }

    /// The `Nats-Expected-Last-Sequence` of the next message, which carries no `Nats-Msg-Id` (a
    /// message of an atomic batch, where the server refuses an id expectation): counts it. The
    /// stream's last message id is then empty, so nothing after it can chain by id.
    pub(crate) fn next_sequence(&mut self) -> u64 {
        self.chain = None;
        self.count()
    }

    /// The expected sequence of the next message; counts it.
    fn count(&mut self) -> u64 {
        let e = self.base + self.published - self.duplicates;
        self.published += 1;
        e
    }

    /// The expectation of a message sent again behind what the stream is known to hold: the last
    /// sequence an ack named, and the id stored there when this session stored it.
    pub(crate) fn behind_last_stored(&self) -> Expect {
        Expect {
            seq: self.last_stored,
            id: self.last_stored_id.clone(),
        }
    }

    /// JetStream acknowledged a message as a duplicate: it took no sequence, so later
    /// expectations step back by one.
    pub(crate) fn duplicate(&mut self) {
        self.duplicates += 1;
    }

    /// JetStream stored a message at `sequence`, with `Nats-Msg-Id` `id` (`None`: without one, an
    /// atomic batch's).
    pub(crate) fn stored(&mut self, sequence: u64, id: Option<&str>) {
        self.last_stored = sequence;
        self.last_stored_id = id.map(str::to_owned);
    }

    /// The sequence of the last message the skipped events are proven against: the stream's last
    /// when the session started, or the message before a cut-off replay ([`Replay::new`]).
    pub(crate) fn proof_end(&self) -> u64 {
        self.replay.ends_at().unwrap_or(self.base)
    }

    /// When the replay verifies the message before a cut-off replay in the tail's place: the
    /// stream's last sequence when the session started (what a failure distrusts only the look
    /// past for, [`crate::sink::Distrust`]).
    pub(crate) fn over(&self) -> Option<u64> {
        self.replay.ends_at().map(|_| self.base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::tail::tests::tail;

    #[test]
    fn expectations_count_from_the_tail_and_step_back_for_duplicates() {
        let mut f = Fence::new(&tail(200, 1, "b"), Replay::publishing());
        assert_eq!(f.next_expected("a").seq, 9);
        assert_eq!(f.next_expected("b").seq, 10);
        // The message that expected 9 was a duplicate: it took no sequence.
        f.duplicate();
        assert_eq!(f.next_expected("c").seq, 10);
        assert_eq!(f.next_expected("d").seq, 11);
    }

    #[test]
    fn every_message_after_the_first_expects_its_predecessors_id() {
        let mut f = Fence::new(&tail(200, 1, "b"), Replay::publishing());
        // The tail's id is not expected: the server may have forgotten it (a restart).
        assert_eq!(f.next_expected("e-1"), Expect { seq: 9, id: None });
        assert_eq!(
            f.next_expected("e-2"),
            Expect {
                seq: 10,
                id: Some("e-1".into())
            }
        );
        assert_eq!(
            f.next_expected("e-3"),
            Expect {
                seq: 11,
                id: Some("e-2".into())
            }
        );
        // A message without an id (an atomic batch's) ends the chain: the stream's last id is "".
        assert_eq!(f.next_sequence(), 12);
        assert_eq!(f.next_expected("e-5"), Expect { seq: 13, id: None });
    }

    #[test]
    fn a_message_sent_again_expects_what_the_acks_named() {
        let mut f = Fence::new(&tail(200, 1, "b"), Replay::publishing());
        // Nothing stored by this session yet: only the tail's sequence.
        assert_eq!(f.behind_last_stored(), Expect { seq: 9, id: None });
        f.next_expected("e-1");
        f.stored(10, Some("e-1"));
        assert_eq!(
            f.behind_last_stored(),
            Expect {
                seq: 10,
                id: Some("e-1".into())
            }
        );
        f.stored(11, None);
        assert_eq!(f.behind_last_stored(), Expect { seq: 11, id: None });
    }
}
