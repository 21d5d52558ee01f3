//! Confirm only what the stream shows: the [`Gate`] between settled acks and the session. An ack
//! can be planted by any client that may publish to the relay's inbox, and a planted ack that names
//! the relay's stream and exactly the sequence the message expected passes every check of its form.
//! So acks of newly stored messages are held until the stream itself shows the last of them: its
//! message at the highest sequence such an ack named is read back (headers only) and must carry
//! that message's `Outbox-Position` ([`verdict`]). With the fence each message expected the
//! sequence before it, so a real message at the highest sequence implies its predecessors of the
//! session; one proof covers every ack before it.
//!
//! At most one proof is in flight, started when acks of new stores arrived since the last one
//! (one request per proof, not per ack). Acks that store nothing new (duplicates, events a replay
//! found stored) are released at once unless an unproven new store is ahead of them: acks are
//! taken in publish order, and progress confirms in that order anyway.
//!
//! [`Gate`] counts, pure and unit-tested below; [`ProofGate`] owns it with the proof in flight,
//! its result until it is judged, and the highest sequence the stream has shown.

use std::pin::Pin;

use super::error::{Forged, SinkError};
use super::publish::{Publisher, Showing, Shown};
use crate::nats::NatsError;
use crate::position::Position;

/// The last newly stored message of a group of acks, to be shown by the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Target {
    /// The highest stream sequence an ack named for a new store.
    pub(super) sequence: u64,
    /// The `Outbox-Position` the message at that sequence was sent with.
    pub(super) position: Position,
    /// How many acks had been settled (ever) once it was: a proof releases those.
    end: u64,
}

/// Which settled acks may be handed on: counts over the session's settled acks, in order.
#[derive(Debug, Default)]
pub(super) struct Gate {
    /// Acks settled so far.
    pushed: u64,
    /// Acks handed on so far.
    taken: u64,
    /// Acks below this count may be handed on.
    release: u64,
    /// New stores not yet under a proof: the last of them, and the count of acks settled before
    /// the first of them (where the held acks begin).
    pending: Option<(Target, u64)>,
    /// The proof in flight.
    proving: Option<Target>,
    /// Proofs started, for the log and the tests.
    pub(super) proofs: u64,
}

impl Gate {
    /// `count` more acks were settled; `new`: the sequence and position of the last newly stored
    /// message among them, if one was.
    #[inline]
    pub(super) fn settled(&mut self, count: u64, new: Option<(u64, Position)>) {
        let first = self.pushed;
        self.pushed += count;
        match (new, self.pending.as_mut()) {
            (Some((sequence, position)), None) => {
                self.pending = Some((
                    Target {
                        sequence,
                        position,
                        end: self.pushed,
                    },
                    first,
                ));
            }
            (Some((sequence, position)), Some((t, _))) => {
                // The highest sequence: without the fence an answer could name a lower one later.
                if sequence >= t.sequence {
                    t.sequence = sequence;
                    t.position = position;
                }
                t.end = self.pushed;
            }
            (None, _) => {
                if self.pending.is_none() && self.proving.is_none() {
                    self.release = self.pushed;
                }
            }
        }
    }

    /// Whether an ack may be handed on now.
    #[inline]
    pub(super) fn may_take(&self) -> bool {
        self.taken < self.release
    }

    /// One ack was handed on.
    #[inline]
    pub(super) fn took(&mut self) {
        debug_assert!(self.may_take());
        self.taken += 1;
    }

    /// The target of the next proof, when none is in flight and new stores wait for one.
    pub(super) fn start(&mut self) -> Option<Target> {
        if self.proving.is_some() {
            return None;
        }
        let (target, _) = self.pending.take()?;
        self.proving = Some(target);
        self.proofs += 1;
        // Non-new acks settled after the target, with no new store since, wait for this proof.
        Some(target)
    }

    /// The proof in flight showed its target stored: every ack up to it, and those after it that
    /// stored nothing new, may be handed on. Returns the target.
    pub(super) fn proven(&mut self) -> Option<Target> {
        let target = self.proving.take()?;
        self.release = match &self.pending {
            Some((_, first)) => (*first).max(target.end),
            None => self.pushed,
        };
        Some(target)
    }

    /// The target of the proof in flight.
    pub(super) fn target(&self) -> Option<Target> {
        self.proving
    }

    /// Acks settled and held for a proof.
    pub(super) fn held(&self) -> u64 {
        self.pushed - self.release.max(self.taken)
    }
}

/// The gate with the proof it waits for; see the module docs.
pub(super) struct ProofGate {
    gate: Gate,
    /// The proof in flight: reading the stream's message at the gate's target sequence.
    proof: Option<Showing>,
    /// Its result, once it came, until [`ProofGate::judge`] judges it.
    shown: Option<Result<Shown, NatsError>>,
    /// The highest stream sequence the stream showed: a proven new store, a duplicate checked
    /// against the stream, or the tail's when fencing, before any ack.
    last_sequence: u64,
}

impl ProofGate {
    /// A gate with nothing settled, the stream shown up to `last_sequence`.
    pub(super) fn new(last_sequence: u64) -> Self {
        ProofGate {
            gate: Gate::default(),
            proof: None,
            shown: None,
            last_sequence,
        }
    }

    /// `count` more acks were settled; `new`: the sequence and position of the last newly stored
    /// message among them ([`Gate::settled`]).
    #[inline]
    pub(super) fn settled(&mut self, count: u64, new: Option<(u64, Position)>) {
        self.gate.settled(count, new);
    }

    /// Whether an ack may be handed on now.
    #[inline]
    pub(super) fn may_take(&self) -> bool {
        self.gate.may_take()
    }

    /// One ack was handed on.
    #[inline]
    pub(super) fn took(&mut self) {
        self.gate.took();
    }

    /// Whether a proof's result waits to be judged.
    #[inline]
    pub(super) fn has_result(&self) -> bool {
        self.shown.is_some()
    }

    /// The proof in flight, to wait on.
    #[inline]
    pub(super) fn in_flight(&mut self) -> Option<&mut Showing> {
        self.proof.as_mut()
    }

    /// The proof in flight came back with `shown`.
    #[inline]
    pub(super) fn came(&mut self, shown: Result<Shown, NatsError>) {
        self.proof = None;
        self.shown = Some(shown);
    }

    /// Starts the proof of the last new store, when acks of new stores arrived since the last
    /// proof and none is in flight; polled once at once (it sends the request, and a simulated
    /// stream answers right away). True when its result is already here, to be judged.
    pub(super) fn start(&mut self, publisher: &Publisher) -> bool {
        if self.proof.is_some() || self.shown.is_some() {
            return false;
        }
        let Some(target) = self.gate.start() else {
            return false;
        };
        let mut f = publisher.show(target.sequence);
        match futures_util::FutureExt::now_or_never(showing(&mut f)) {
            Some(shown) => {
                self.shown = Some(shown);
                true
            }
            None => {
                self.proof = Some(f);
                false
            }
        }
    }

    /// Judges the proof's result, if it came (polling the one in flight once): the stream shows
    /// the target, so every ack up to it may be taken; or it does not, and the session ends before
    /// anything past the last proven message is confirmed.
    pub(super) fn judge(&mut self, stream: &str) -> Result<(), SinkError> {
        if self.shown.is_none()
            && let Some(f) = self.proof.as_mut()
            && let Some(shown) = futures_util::FutureExt::now_or_never(showing(f))
        {
            self.came(shown);
        }
        let Some(shown) = self.shown.take() else {
            return Ok(());
        };
        let Some(target) = self.gate.target() else {
            return Ok(());
        };
        let shown = shown.map_err(|source| SinkError::Unshown {
            position: target.position,
            stream: stream.to_owned(),
            sequence: target.sequence,
            source,
        })?;
        verdict(&target, &shown).map_err(|why| SinkError::Forged {
            id: format!("at position {}", target.position),
            source: Forged {
                stream: stream.to_owned(),
                why: why.to_string(),
            },
        })?;
        self.gate.proven();
        self.saw(target.sequence);
        tracing::trace!(
            sequence = target.sequence,
            position = %target.position,
            proofs = self.gate.proofs,
            "the stream shows the last message stored"
        );
        Ok(())
    }

    /// The stream showed a message at `sequence` (a duplicate checked against it, or a proof).
    #[inline]
    pub(super) fn saw(&mut self, sequence: u64) {
        self.last_sequence = self.last_sequence.max(sequence);
    }

    /// The highest stream sequence the stream showed so far.
    #[inline]
    pub(super) fn last_sequence(&self) -> u64 {
        self.last_sequence
    }

    /// Proofs started in this session: one per group of acks of new stores.
    pub(super) fn proofs(&self) -> u64 {
        self.gate.proofs
    }

    /// Settled acks held until the stream shows the last new store among them.
    pub(super) fn held(&self) -> u64 {
        self.gate.held()
    }
}

/// The proof in flight, to be polled (a mutex only for `Sync`, so never locked: see
/// [`Showing`]).
pub(super) fn showing(
    f: &mut Showing,
) -> Pin<&mut (dyn std::future::Future<Output = Result<Shown, NatsError>> + Send)> {
    f.get_mut()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_mut()
}

/// Why what the stream shows does not prove an ack: the stream's own answer to it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum Mismatch {
    /// Another of the relay's messages is at the sequence.
    #[error(
        "an ack says the message at position {want} is stored at sequence {sequence}, but the stream holds the \
         message at position {found} there"
    )]
    Other {
        /// The position the ack's message was sent with.
        want: Position,
        /// The sequence the ack named.
        sequence: u64,
        /// The position of the message the stream holds there.
        found: Position,
    },
    /// A message the relay did not write is at the sequence.
    #[error(
        "an ack says the message at position {want} is stored at sequence {sequence}, but the stream holds a \
         message the relay did not write there"
    )]
    Foreign {
        /// The position the ack's message was sent with.
        want: Position,
        /// The sequence the ack named.
        sequence: u64,
    },
    /// The sequence is past the stream's last.
    #[error(
        "an ack says the message at position {want} is stored at sequence {sequence}, beyond the stream's last \
         sequence {last}"
    )]
    Beyond {
        /// The position the ack's message was sent with.
        want: Position,
        /// The sequence the ack named.
        sequence: u64,
        /// The stream's last sequence.
        last: u64,
    },
}

/// Whether `shown` proves `target` stored: its message carries the target's position, or it is
/// gone since (limits, purge) at a sequence the stream has reached. Why not otherwise.
pub(super) fn verdict(target: &Target, shown: &Shown) -> Result<(), Mismatch> {
    let (want, sequence) = (target.position, target.sequence);
    match *shown {
        Shown::Message(Some(p)) if p == want => Ok(()),
        Shown::Message(Some(found)) => Err(Mismatch::Other {
            want,
            sequence,
            found,
        }),
        Shown::Message(None) => Err(Mismatch::Foreign { want, sequence }),
        Shown::Gone { last } if sequence <= last => Ok(()),
        Shown::Gone { last } => Err(Mismatch::Beyond {
            want,
            sequence,
            last,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Lsn;
    use crate::sink::publish::Shown;

    fn pos(lsn: u64, index: u32) -> Position {
        Position::in_transaction(Lsn(lsn), index)
    }

    fn drain(g: &mut Gate) -> u64 {
        let mut n = 0;
        while g.may_take() {
            g.took();
            n += 1;
        }
        n
    }

    #[test]
    fn acks_that_store_nothing_new_pass_at_once() {
        let mut g = Gate::default();
        g.settled(3, None);
        assert_eq!(drain(&mut g), 3);
        assert_eq!(g.start(), None, "nothing to prove");
    }

    #[test]
    fn a_new_store_is_held_until_proven_with_what_follows_it() {
        let mut g = Gate::default();
        g.settled(1, None);
        g.settled(1, Some((7, pos(100, 0))));
        g.settled(1, None); // a duplicate behind it
        assert_eq!(drain(&mut g), 1, "only the ack before the new store");
        assert_eq!(g.held(), 2);
        let t = g.start().expect("a proof");
        assert_eq!((t.sequence, t.position), (7, pos(100, 0)));
        assert_eq!(drain(&mut g), 0, "held while the proof runs");
        assert!(g.proven().is_some());
        assert_eq!(drain(&mut g), 2);
        assert_eq!(g.held(), 0);
    }

    #[test]
    fn one_proof_at_a_time_covers_the_last_of_many() {
        let mut g = Gate::default();
        for s in 1..=100 {
            g.settled(1, Some((s, pos(s * 10, 0))));
        }
        let t = g.start().expect("a proof");
        assert_eq!(t.sequence, 100, "the last one only");
        // More arrive while it runs: no second proof until it ends.
        g.settled(1, Some((101, pos(1010, 0))));
        g.settled(1, None);
        assert_eq!(g.start(), None);
        g.proven();
        assert_eq!(
            drain(&mut g),
            100,
            "up to the proven one, not past the next new store"
        );
        let t = g.start().expect("the next proof");
        assert_eq!(t.sequence, 101);
        g.proven();
        assert_eq!(drain(&mut g), 2);
        assert_eq!(g.proofs, 2);
    }

    #[test]
    fn a_batch_is_held_whole_and_proven_by_its_commit() {
        let mut g = Gate::default();
        // Three members and the commit, settled together; the commit took sequence 12.
        g.settled(4, Some((12, pos(300, 3))));
        assert_eq!(drain(&mut g), 0);
        let t = g.start().unwrap();
        assert_eq!((t.sequence, t.position), (12, pos(300, 3)));
        g.proven();
        assert_eq!(drain(&mut g), 4);
    }

    #[test]
    fn a_failed_proof_releases_nothing() {
        let mut g = Gate::default();
        g.settled(1, Some((5, pos(1, 0))));
        g.start().unwrap();
        // The session ends on the failure: `proven` is never called.
        assert_eq!(drain(&mut g), 0);
        assert_eq!(g.held(), 1);
    }

    #[test]
    fn the_verdict_takes_only_the_message_sent_or_one_gone_within_the_stream() {
        let t = Target {
            sequence: 19,
            position: pos(750, 2),
            end: 0,
        };
        assert_eq!(verdict(&t, &Shown::Message(Some(pos(750, 2)))), Ok(()));
        let other = verdict(&t, &Shown::Message(Some(pos(750, 1))))
            .unwrap_err()
            .to_string();
        assert!(other.contains("holds the message at position"), "{other}");
        assert!(verdict(&t, &Shown::Message(None)).is_err());
        assert_eq!(verdict(&t, &Shown::Gone { last: 19 }), Ok(()));
        assert_eq!(verdict(&t, &Shown::Gone { last: 40 }), Ok(()));
        // Seed 286's planted ack: sequence 19, the stream's last is 18.
        let beyond = verdict(&t, &Shown::Gone { last: 18 })
            .unwrap_err()
            .to_string();
        assert!(
            beyond.contains("beyond the stream's last sequence 18"),
            "{beyond}"
        );
    }
}
