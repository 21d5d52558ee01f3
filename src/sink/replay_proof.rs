//! The replay's proof: a fenced session skips the replayed events the stream's tail says are
//! stored, and reports them stored only once the replay reaches the tail's own event and the
//! stream's last messages, read back, are exactly those events, in order ([`Sink::prove_skipped`]).
//! The skipped events are folded into a hash as they are skipped ([`skipped_hash`]) and the
//! messages read back into the same hash ([`Proof`]), so the proof holds no list of either and its
//! memory does not grow with the replay. [`Proof`] is pure and unit-tested here; the reading back
//! goes through the publisher (`publish.rs`).

use tracing::warn;

use super::{Fence, Pending, Replayed, Sink, SinkError, Stamp};
use crate::event::OutboxEvent;
use crate::position::Position;

impl Sink {
    /// Asks the fence's replay about `event` (submitted as `seq`): true when it is stored already,
    /// so it is not published. Skipped events are reported as stored only once the replay reaches
    /// the tail's own event; they hold no place in the window meanwhile (a replay can be longer than
    /// the window), only their count.
    pub(super) async fn skip_replayed(
        &mut self,
        seq: u64,
        event: &OutboxEvent,
    ) -> Result<bool, SinkError> {
        let Some(fence) = self.fence.as_mut() else {
            return Ok(false);
        };
        match fence.replayed(event.position, &event.msg_id) {
            Replayed::Publish => Ok(false),
            Replayed::Skip => {
                self.skipped_from.get_or_insert(seq);
                self.skipped_hash = skipped_hash(self.skipped_hash, event.position, &event.msg_id);
                Ok(true)
            }
            Replayed::Verified => {
                let first = self.skipped_from.take().unwrap_or(seq);
                let count = seq + 1 - first;
                let hash = skipped_hash(self.skipped_hash, event.position, &event.msg_id);
                let started = tokio::time::Instant::now();
                self.prove_skipped(count, hash).await?;
                tracing::debug!(events = count, position = %event.position, took_ms = started.elapsed().as_millis() as u64,
                    "replay reached the stream's tail: skipped events are stored");
                self.window.push_back(Pending::Stored { first, count });
                Ok(true)
            }
            Replayed::Diverged { tail, at } => Err(SinkError::Diverged {
                sequence: fence.proof_end(),
                tail,
                at,
                over: fence.over(),
            }),
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
    async fn prove_skipped(&mut self, count: u64, hash: u64) -> Result<(), SinkError> {
        let sequence = self.fence.as_ref().map_or(0, Fence::proof_end);
        let over = self.fence.as_ref().and_then(Fence::over);
        let unproven = |reason: String| SinkError::Unproven {
            sequence,
            count,
            reason,
            over,
        };
        if count > sequence {
            return Err(unproven("the stream holds fewer messages".into()));
        }
        let first = sequence + 1 - count;
        let mut proof = Proof::new(first);
        match self.publisher.read(first, sequence).await {
            Ok(mut reader) => loop {
                match reader.next().await {
                    Ok(Some((seq, headers))) => proof.message(seq, &headers).map_err(unproven)?,
                    Ok(None) => break,
                    Err(e) => {
                        return Err(unproven(format!(
                            "reading back message {} failed: {e}",
                            proof.next
                        )));
                    }
                }
            },
            Err(e) => {
                warn!(error = %e, stream = %self.config.stream, first, last = sequence,
                    "cannot read the replay's messages back in bulk: reading them one request each \
                     (allow the relay's user $JS.API.CONSUMER.CREATE.<stream>; see docs/operations.md, NATS permissions)");
                for seq in first..=sequence {
                    match self.publisher.stored(seq).await {
                        Ok(Some(h)) => proof.message(seq, &h).map_err(unproven)?,
                        Ok(None) => {}
                        Err(e) => {
                            return Err(unproven(format!(
                                "reading back message {seq} failed: {e}"
                            )));
                        }
                    }
                }
            }
        }
        proof.end(sequence, hash).map_err(unproven)
    }
}

pub(super) const SKIPPED_HASH_START: u64 = 0xcbf2_9ce4_8422_2325;

/// The stream's side of a replay's proof ([`Sink::prove_skipped`]): the messages read back, in
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
    fn message(&mut self, seq: u64, headers: &async_nats::HeaderMap) -> Result<(), String> {
        if seq != self.next {
            return Err(format!("message {} is gone", self.next));
        }
        let stamp = Stamp::from_headers(headers);
        let (Some(position), Some(id)) = (stamp.position, stamp.id) else {
            return Err(format!("message {seq} was not written by the relay"));
        };
        self.hash = skipped_hash(self.hash, position, &id);
        self.next += 1;
        Ok(())
    }

    /// Every message up to `last` was read: they are the events whose fold is `skipped`.
    fn end(&self, last: u64, skipped: u64) -> Result<(), String> {
        if self.next <= last {
            return Err(format!("message {} is gone", self.next));
        }
        if self.hash != skipped {
            return Err("another message, or one missing, among them".into());
        }
        Ok(())
    }
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
        assert_eq!(
            p.message(6, &headers(100, 0, "a")),
            Err("message 5 is gone".into())
        );
        let mut p = Proof::new(5);
        p.message(5, &headers(100, 0, "a")).unwrap();
        assert_eq!(
            p.message(7, &headers(100, 1, "b")),
            Err("message 6 is gone".into())
        );
        let mut p = Proof::new(5);
        p.message(5, &headers(100, 0, "a")).unwrap();
        p.message(6, &headers(100, 1, "b")).unwrap();
        assert_eq!(
            p.end(7, skipped(&EVENTS[..2])),
            Err("message 7 is gone".into())
        );
    }

    #[test]
    fn a_message_the_relay_did_not_write_is_no_proof() {
        let mut p = Proof::new(1);
        let mut h = async_nats::HeaderMap::new();
        h.insert(message::NATS_MSG_ID, "manual-1");
        assert_eq!(
            p.message(1, &h),
            Err("message 1 was not written by the relay".into())
        );
    }
}
