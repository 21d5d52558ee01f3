//! Group commit for atomic batches (`nats.atomic_group_ms`): consecutive transactions share one
//! JetStream atomic batch, so nats-server's fixed cost per batch (about 3 ms of its CPU and a
//! round trip to the file store on a single-replica stream) is paid once for all of them.
//!
//! Without it, a transaction's last event commits its batch, and the next transaction's batch
//! opens only once the stream stored that one: one batch per round trip, a few dozen transactions
//! a second. With it, a transaction's end leaves the batch open, *waiting*: the transactions after
//! it join it while the batch before it waits for its ack, and for at most the bound after the
//! first of them ended. It is committed when both are over, or earlier when the next transaction
//! would not fit the batch limit or the window. A group whose first transaction ends with no
//! batch in flight is committed at once (`Waiting::alone`): nothing is being stored for others
//! to gather behind, and waiting the bound would only add it to a lone transaction's latency
//! (the transactions after it gather while it is in flight, as behind any other batch).
//!
//! Each transaction stays all-or-nothing, because the group is: a waiting batch takes the next
//! transaction's events only once that transaction ended. Until then they are kept back
//! ([`Waiting::keep`], in the window already), and when they outgrow what the batch can still take, the
//! batch is committed and the transaction goes on in a batch of its own, split only if it is
//! larger than one batch by itself (as without grouping). Order holds: one batch is committed at a
//! time, each only after the one before it is stored, and its first message carries the fence's
//! expectation. Resume and the position service see nothing new: every message carries its own
//! event's `Outbox-Position`, and an event is acknowledged (and its transaction confirmed) only
//! with its batch's commit.
//!
//! This file holds the waiting batch ([`Waiting`]) and the arithmetic of its bound and its fill,
//! pure; when a transaction's end joins it or commits it is the batcher's (`batch.rs`).

use std::time::Duration;

use tokio::time::Instant;

use super::window::Held;

/// A batch that ended at a transaction's end and waits for the transactions after it.
pub(super) struct Waiting {
    /// When its first transaction ended: it waits no longer than the bound after that.
    since: Instant,
    /// No batch was in flight when its first transaction ended: it is due at once. At a low rate
    /// every transaction is such a group, and the bound was most of what it waited in the relay
    /// (docs/performance.md, round 5).
    alone: bool,
    /// The events of the transaction after it, kept back until that one ends.
    kept: Vec<Held>,
}

/// What the waiting batch holds so far, the event held back included: messages and window bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Fill {
    pub(super) messages: usize,
    pub(super) bytes: usize,
}

impl Waiting {
    /// A batch that starts waiting at `since`, behind `in_flight` batches in flight (none: alone).
    pub(super) fn new(since: Instant, in_flight: usize) -> Self {
        Waiting {
            since,
            alone: in_flight == 0,
            kept: Vec::new(),
        }
    }

    /// An event of the transaction after it, kept back until that transaction ends.
    pub(super) fn keep(&mut self, held: Held) {
        self.kept.push(held);
    }

    /// The events kept back, taken.
    pub(super) fn take_kept(&mut self) -> Vec<Held> {
        std::mem::take(&mut self.kept)
    }

    /// The events kept back, when the batch is committed.
    pub(super) fn into_kept(self) -> Vec<Held> {
        self.kept
    }

    /// How many events are kept back.
    pub(super) fn kept(&self) -> usize {
        self.kept.len()
    }

    /// When it is due: `bound` after its first transaction ended, or then when it began
    /// alone.
    pub(super) fn due(&self, bound: Duration) -> Instant {
        if self.alone {
            self.since
        } else {
            self.since + bound
        }
    }

    /// Whether the batch, holding `fill`, can still take `n` more events of `size` window bytes
    /// after the ones kept back: within `room` messages (the batch limit) and `max_bytes` (the
    /// window).
    pub(super) fn fits(
        &self,
        fill: Fill,
        n: usize,
        size: usize,
        room: usize,
        max_bytes: usize,
    ) -> bool {
        let kept_bytes: usize = self.kept.iter().map(|h| h.size).sum();
        fill.messages + self.kept.len() + n <= room && fill.bytes + kept_bytes + size <= max_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_behind_a_batch_in_flight_is_due_its_bound_after_it_began() {
        let since = Instant::now();
        let w = Waiting::new(since, 1);
        assert_eq!(
            w.due(Duration::from_millis(3)),
            since + Duration::from_millis(3)
        );
        assert_eq!(w.due(Duration::ZERO), since);
    }

    #[test]
    fn a_group_that_began_with_nothing_in_flight_is_due_at_once() {
        let since = Instant::now();
        let w = Waiting::new(since, 0);
        assert_eq!(
            w.due(Duration::from_millis(3)),
            since,
            "not its bound later"
        );
    }

    #[test]
    fn a_group_takes_events_only_within_the_batch_limit_and_the_window() {
        let w = Waiting::new(Instant::now(), 1);
        let fill = Fill {
            messages: 8,
            bytes: 800,
        };
        assert!(w.fits(fill, 2, 200, 10, 1_000), "exactly both limits");
        assert!(!w.fits(fill, 3, 10, 10, 1_000), "one message too many");
        assert!(!w.fits(fill, 1, 201, 10, 1_000), "one byte too many");
    }
}
