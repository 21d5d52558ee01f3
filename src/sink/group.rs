//! Group commit for atomic batches (`nats.atomic_group_ms`): consecutive transactions share one
//! JetStream atomic batch, so nats-server's fixed cost per batch (about 3 ms of its CPU and a
//! round trip to the file store on a single-replica stream) is paid once for all of them.
//!
//! Without it, a transaction's last event commits its batch, and the next transaction's batch
//! opens only once the stream stored that one: one batch per round trip, a few dozen transactions
//! a second. With it, a transaction's end leaves the batch open, *waiting*: the transactions after
//! it join it while the batch before it waits for its ack, and for at most the bound after the
//! first of them ended. It is committed when both are over, or earlier when the next transaction
//! would not fit the batch limit or the window.
//!
//! Each transaction stays all-or-nothing, because the group is: a waiting batch takes the next
//! transaction's events only once that transaction ended. Until then they are kept back
//! (`pending`, in the window already), and when they outgrow what the batch can still take, the
//! batch is committed and the transaction goes on in a batch of its own, split only if it is
//! larger than one batch by itself (as without grouping). Order holds: one batch is committed at a
//! time, each only after the one before it is stored, and its first message carries the fence's
//! expectation. Resume and the position service see nothing new: every message carries its own
//! event's `Outbox-Position`, and an event is acknowledged (and its transaction confirmed) only
//! with its batch's commit.

use std::time::Duration;

use tokio::time::Instant;

use super::batch::Held;
use super::{Sink, SinkError};

/// A batch that ended at a transaction's end and waits for the transactions after it.
pub(super) struct Waiting {
    /// When its first transaction ended: it waits no longer than the bound after that.
    since: Instant,
    /// The events of the transaction after it, kept back until that one ends.
    pub(super) pending: Vec<Held>,
}

impl Sink {
    /// The transaction ended. Without grouping, its held event commits the batch; with it, the
    /// batch waits (or takes the transaction that ended, when it was waiting already), and is
    /// committed here only when it is due ([`Sink::group_due`]).
    pub(crate) async fn commit(&mut self) -> Result<(), SinkError> {
        let Some(b) = self.batch.as_mut() else {
            return Ok(());
        };
        if self.config.atomic_group.is_none() {
            return match b.held.take() {
                Some(held) => self.send_held(held, true).await,
                None => Ok(()),
            };
        }
        match b.waiting.as_mut() {
            Some(waiting) => {
                // It fits: `submit_batched` commits the group before a transaction outgrows it.
                let mut pending = std::mem::take(&mut waiting.pending);
                let Some(last) = pending.pop() else {
                    // A transaction without events.
                    return self.commit_due().await;
                };
                let before = b.held.take();
                for next in before.into_iter().chain(pending) {
                    self.send_held(next, false).await?;
                }
                self.batcher()?.held = Some(last);
            }
            None if b.held.is_none() => return Ok(()),
            None => {
                b.waiting = Some(Waiting {
                    since: Instant::now(),
                    pending: Vec::new(),
                });
            }
        }
        self.commit_due().await
    }

    /// Commits the waiting batch if it is due.
    pub(crate) async fn commit_due(&mut self) -> Result<(), SinkError> {
        match self.group_due() {
            Some(due) if Instant::now() >= due => self.close_group().await,
            _ => Ok(()),
        }
    }

    /// When the waiting batch is to be committed: once the batch before it is stored and the
    /// bound after its first transaction's end passed. `None` while nothing waits, or while the
    /// batch before it is in flight (its ack comes first, through [`Sink::ready`]).
    pub(crate) fn group_due(&self) -> Option<Instant> {
        let b = self.batch.as_ref()?;
        let waiting = b.waiting.as_ref()?;
        if b.in_flight > 0 {
            return None;
        }
        Some(waiting.since + self.config.atomic_group.unwrap_or(Duration::ZERO))
    }

    /// Commits the waiting batch now (after the batch before it is stored), and starts the
    /// transaction kept back after it in a batch of its own.
    pub(super) async fn close_group(&mut self) -> Result<(), SinkError> {
        let Some(waiting) = self.batcher()?.waiting.take() else {
            return Ok(());
        };
        if let Some(held) = self.batcher()?.held.take() {
            self.send_held(held, true).await?;
        }
        for next in waiting.pending {
            if let Some(held) = self.batcher()?.held.take() {
                self.send_before(held, next.size).await?;
            }
            self.batcher()?.held = Some(next);
        }
        Ok(())
    }

    /// Whether the waiting batch can still take `n` more events of `size` window bytes after the
    /// ones kept back: within the batch limit and the window.
    pub(super) fn group_fits(&self, n: usize, size: usize) -> bool {
        let Some(b) = self.batch.as_ref() else {
            return false;
        };
        let (sent, bytes) = self.open_size();
        let held = b.held.as_ref().map_or(0, |h| h.size);
        let (kept, kept_bytes) = b.waiting.as_ref().map_or((0, 0), |w| {
            (w.pending.len(), w.pending.iter().map(|h| h.size).sum())
        });
        sent + usize::from(b.held.is_some()) + kept + n <= self.batch_room()
            && bytes + held + kept_bytes + size <= self.config.max_in_flight_bytes
    }

    /// Messages handed to the sink whose batch is not committed yet and will not be unless their
    /// transaction's Commit arrives: a waiting batch's are committed on shutdown, the ones kept
    /// back after it are not.
    pub(crate) fn uncommitted(&self) -> usize {
        self.batch.as_ref().map_or(0, |b| match &b.waiting {
            Some(waiting) => waiting.pending.len(),
            None => self.open_size().0 + usize::from(b.held.is_some()),
        })
    }
}
