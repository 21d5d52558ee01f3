//! The replay's proof: a fenced session skips the replayed events the stream's tail says are
//! stored ([`Skips`]), and reports them stored only once the replay reaches the tail's own event
//! and the stream's last messages, read back, are exactly those events, in order
//! ([`prove_skipped`]). The skipped events are folded into a hash as they are skipped
//! ([`skipped_hash`]) and the messages read back into the same hash ([`Proof`]), so the proof holds
//! no list of either and its memory does not grow with the replay. [`Skips`] and [`Proof`] are pure
//! and unit-tested here; the reading back goes through the publisher (`publish.rs`).

use tracing::warn;

use super::error::SinkError;
use super::fence::Fence;
use super::publish::Publisher;
use super::replay::Replayed;
use super::tail::Stamp;
use crate::event::OutboxEvent;
use crate::position::Position;

/// The events a fenced replay skipped and not yet proven stored: where they start and their fold.
/// Pure: the sink asks it about every replayed event ([`Skips::replayed`]) and does the reading
/// back ([`prove_skipped`]) when it says so.
#[derive(Debug)]
pub(super) struct Skips {
    /// The submit sequence of the first replayed event skipped and not yet proven stored.
    from: Option<u64>,
    /// A hash of the (position, id) of the events skipped so far, compared with the stream's
    /// messages once the replay reaches the tail ([`prove_skipped`]).
    hash: u64,
}

/// What to do with a replayed event ([`Skips::replayed`]).
#[derive(Debug)]
pub(super) enum Skip {
    /// Not stored yet: publish it.
    Publish,
    /// Stored, if the replay reaches the tail's own event: not published, not yet reported.
    Skipped,
    /// The tail's own event: the `count` events from submit sequence `first` (this one included)
    /// are stored once the stream's messages prove the fold `hash`.
    Verified {
        /// The first skipped event's submit sequence.
        first: u64,
        /// How many, this one included.
        count: u64,
        /// Their fold, with this one's.
        hash: u64,
    },
}

impl Default for Skips {
    fn default() -> Self {
        Skips {
            from: None,
            hash: SKIPPED_HASH_START,
        }
    }
}

impl Skips {
    /// Asks the fence's replay about `event` (submitted as `seq`). Skipped events are reported as
    /// stored only once the replay reaches the tail's own event; they hold no place in the window
    /// meanwhile (a replay can be longer than the window), only their count. `Err` when the replay
    /// passed the tail's position without its event ([`SinkError::Diverged`]).
    pub(super) fn replayed(
        &mut self,
        fence: &mut Fence,
        seq: u64,
        event: &OutboxEvent,
    ) -> Result<Skip, SinkError> {
        match fence.replayed(event.position, &event.msg_id) {
            Replayed::Publish => Ok(Skip::Publish),
            Replayed::Skip => {
                self.from.get_or_insert(seq);
                self.hash = skipped_hash(self.hash, event.position, &event.msg_id);
                Ok(Skip::Skipped)
            }
            Replayed::Verified => {
                let first = self.from.take().unwrap_or(seq);
                Ok(Skip::Verified {
                    first,
                    count: seq + 1 - first,
                    hash: skipped_hash(self.hash, event.position, &event.msg_id),
                })
            }
            Replayed::Diverged { tail, at } => Err(SinkError::Diverged {
                sequence: fence.proof_end(),
                tail,
                at,
                over: fence.over(),
            }),
        }
    }
}

/// The replay reached the stream's tail: proves that the stream's last `count` messages (those
/// that end at the message before a cut-off replay, when the replay verifies that one:
/// [`Replay::new`](super::Replay::new)) are exactly the events skipped (with the tail's own),
/// in order, by their positions and ids (`hash`). The tail alone cannot tell: a late publish
/// of an earlier session can have been stored behind another writer's message, past a gap. The
/// messages are read back in bulk, headers only (`src/nats/readback.rs`), one at a time into
/// the hash: no limit on `count`, and memory that does not grow with it. Where the bulk read cannot start (a user without the consumer
/// permission), they are read one request each, as slow as that is.
pub(super) async fn prove_skipped(
    publisher: &Publisher,
    fence: &Fence,
    stream: &str,
    count: u64,
    hash: u64,
) -> Result<(), SinkError> {
    let sequence = fence.proof_end();
    let over = fence.over();
    let unproven = |reason: String| SinkError::Unproven {
        sequence,
        count,
        reason,
        over,
    };
    let mismatch = |m: Mismatch| unproven(m.to_string());
    if count > sequence {
        return Err(unproven("the stream holds fewer messages".into()));
    }
    let first = sequence + 1 - count;
    let mut proof = Proof::new(first);
    match publisher.read(first, sequence).await {
        Ok(mut reader) => loop {
            match reader.next().await {
                Ok(Some((seq, headers))) => proof.message(seq, &headers).map_err(mismatch)?,
                Ok(None) => break,
                Err(e) => {
                    return Err(unproven(format!(
                        "reading back message {} failed: {}",
                        proof.next,
                        crate::error_chain::error_chain(&e)
                    )));
                }
            }
        },
        Err(e) => {
            warn!(error = %crate::error_chain::error_chain(&e), %stream, first, last = sequence,
                "cannot read the replay's messages back in bulk: reading them one request each \
                 (allow the relay's user $JS.API.CONSUMER.CREATE.<stream>; see docs/operations.md, NATS permissions)");
            for seq in first..=sequence {
                match publisher.stored(seq).await {
                    Ok(Some(h)) => proof.message(seq, &h).map_err(mismatch)?,
                    Ok(None) => {}
                    Err(e) => {
                        return Err(unproven(format!(
                            "reading back message {seq} failed: {}",
                            crate::error_chain::error_chain(&e)
                        )));
                    }
                }
            }
        }
    }
    proof.end(sequence, hash).map_err(mismatch)
}

pub(super) const SKIPPED_HASH_START: u64 = 0xcbf2_9ce4_8422_2325;

/// The stream's side of a replay's proof ([`prove_skipped`]): the messages read back, in
/// sequence order, folded into the hash the skipped events were folded into.
struct Proof {
    /// The sequence the next message must have: one skipped means it is gone.
    next: u64,
    hash: u64,
}

impl Proof {
    fn new(first: u64) -> Self {
        Proof {
            next: first,
            hash: SKIPPED_HASH_START,
        }
    }

    /// The stored message `seq`, with `headers`.
    fn message(&mut self, seq: u64, headers: &async_nats::HeaderMap) -> Result<(), Mismatch> {
        if seq != self.next {
            return Err(Mismatch::Gone(self.next));
        }
        let stamp = Stamp::from_headers(headers);
        let (Some(position), Some(id)) = (stamp.position, stamp.id) else {
            return Err(Mismatch::Foreign(seq));
        };
        self.hash = skipped_hash(self.hash, position, &id);
        self.next += 1;
        Ok(())
    }

    /// Every message up to `last` was read: they are the events whose fold is `skipped`.
    fn end(&self, last: u64, skipped: u64) -> Result<(), Mismatch> {
        if self.next <= last {
            return Err(Mismatch::Gone(self.next));
        }
        if self.hash != skipped {
            return Err(Mismatch::Other);
        }
        Ok(())
    }
}

/// Why the stream's messages are not the events skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Mismatch {
    /// A sequence in the range holds no message.
    #[error("message {0} is gone")]
    Gone(u64),
    /// A message without the relay's `Outbox-Position` and id.
    #[error("message {0} was not written by the relay")]
    Foreign(u64),
    /// The fold differs.
    #[error("another message, or one missing, among them")]
    Other,
}

/// Folds an event's position and id into `h` (FNV-1a), in order.
fn skipped_hash(h: u64, position: Position, id: &str) -> u64 {
    let step = |h: u64, b: u8| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    let h = position.lsn.0.to_le_bytes().into_iter().fold(h, step);
    let h = position.index.to_le_bytes().into_iter().fold(h, step);
    // A separator, so that ("ab", "c") and ("a", "bc") differ.
    id.bytes().fold(h, step) ^ 0xff
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Lsn;
    use crate::message;

    fn headers(lsn: u64, index: u32, id: &str) -> async_nats::HeaderMap {
        let mut h = async_nats::HeaderMap::new();
        h.insert(
            message::POSITION,
            crate::position::stamp(
                Position::in_transaction(Lsn(lsn), index),
                Some("7311234567890123456/1/slot"),
            )
            .as_str(),
        );
        h.insert(message::NATS_MSG_ID, id);
        h
    }

    /// The skipped events' fold of `(lsn, index, id)`.
    fn skipped(events: &[(u64, u32, &str)]) -> u64 {
        events.iter().fold(SKIPPED_HASH_START, |h, (lsn, i, id)| {
            skipped_hash(h, Position::in_transaction(Lsn(*lsn), *i), id)
        })
    }

    const EVENTS: [(u64, u32, &str); 3] = [(100, 0, "a"), (100, 1, "b"), (200, 0, "c")];

    #[test]
    fn the_stream_proves_the_skipped_events_in_order() {
        let mut p = Proof::new(5);
        for (i, (lsn, index, id)) in EVENTS.iter().enumerate() {
            p.message(5 + i as u64, &headers(*lsn, *index, id)).unwrap();
        }
        assert_eq!(p.end(7, skipped(&EVENTS)), Ok(()));
        // The same messages, other events skipped (or in another order): no proof.
        let swapped = [EVENTS[1], EVENTS[0], EVENTS[2]];
        assert!(p.end(7, skipped(&swapped)).is_err());
    }

    #[test]
    fn a_message_gone_first_between_or_last_is_no_proof() {
        let mut p = Proof::new(5);
        assert_eq!(p.message(6, &headers(100, 0, "a")), Err(Mismatch::Gone(5)));
        let mut p = Proof::new(5);
        p.message(5, &headers(100, 0, "a")).unwrap();
        assert_eq!(p.message(7, &headers(100, 1, "b")), Err(Mismatch::Gone(6)));
        let mut p = Proof::new(5);
        p.message(5, &headers(100, 0, "a")).unwrap();
        p.message(6, &headers(100, 1, "b")).unwrap();
        assert_eq!(p.end(7, skipped(&EVENTS[..2])), Err(Mismatch::Gone(7)));
    }

    #[test]
    fn a_message_the_relay_did_not_write_is_no_proof() {
        let mut p = Proof::new(1);
        let mut h = async_nats::HeaderMap::new();
        h.insert(message::NATS_MSG_ID, "manual-1");
        let e = p.message(1, &h).unwrap_err();
        assert_eq!(e.to_string(), "message 1 was not written by the relay");
    }
}
