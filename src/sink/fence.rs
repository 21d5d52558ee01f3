//! Fencing the stream, owned by the sink: at the start of every session the sink reads the stream's
//! tail, skips the replayed events already stored there, and publishes every further message with
//! `Nats-Expected-Last-Sequence` = the sequence the previous one will get.
//!
//! Why: after a lost connection the NATS client reconnects on its own and sends what it still had
//! queued, while a publish that was on the broken connection is gone. Deduplication by `Nats-Msg-Id`
//! cannot repair that: the lost event would be stored later, after events that committed after it
//! (P4). With the expectation, the first message after a gap is refused (10071) and so is everything
//! behind it; the relay restarts, reads the tail again and goes on from exactly there. The stream
//! therefore always holds a gap-free prefix of the outbox in commit order, also beyond the duplicate
//! window. It requires that only the relay writes the stream (`nats.fence = false` turns this off).
//!
//! An event whose id JetStream already holds (an id reused by the application, a re-inserted row, a
//! backfill overlapping live traffic) is acknowledged as a duplicate and takes no sequence. The ack
//! task then counts it in [`Fence::duplicates`], so later publishes expect one sequence less, and
//! republishes the few already sent with the old expectation: one skipped message and a log line,
//! never a session restart.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_nats::jetstream;

use crate::Lsn;
use crate::message;

/// The stream's last message, as far as the relay needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tail {
    /// The stream's last sequence (0 for a new stream).
    pub last_sequence: u64,
    /// Commit LSN and message id of the message at `last_sequence`, when it is still there and was
    /// written by the relay.
    pub last: Option<(Lsn, String)>,
    /// The stream's `max_msg_size` (headers and payload), when it has one.
    pub max_msg_size: Option<usize>,
}

/// The stream's tail cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("JetStream stream {stream}: {source}")]
pub struct TailError {
    /// The stream's name.
    pub stream: String,
    /// Why its tail cannot be read (no stream, no JetStream, no answer).
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// Reads the tail of `stream`. The message is read from the stream leader (`STREAM.MSG.GET`), so a
/// message just stored is seen.
pub async fn read_tail(js: &jetstream::Context, stream: &str) -> Result<Tail, TailError> {
    let err = |e: Box<dyn std::error::Error + Send + Sync>| TailError {
        stream: stream.to_owned(),
        source: e,
    };
    let mut s = js.get_stream(stream).await.map_err(|e| err(e.into()))?;
    let info = s.info().await.map_err(|e| err(e.into()))?;
    let last_sequence = info.state.last_sequence;
    // -1 (or 0, never set) means no limit of the stream's own.
    let max_msg_size = usize::try_from(info.config.max_message_size)
        .ok()
        .filter(|&n| n > 0);
    if last_sequence == 0 {
        return Ok(Tail {
            last_sequence,
            last: None,
            max_msg_size,
        });
    }
    // The last message may be gone (a limit or a purge); then nothing can be matched, and the
    // replay publishes everything after the confirmed position.
    let last = match s.get_raw_message(last_sequence).await {
        Ok(m) => {
            let lsn = m
                .headers
                .get(message::COMMIT_LSN)
                .and_then(|v| v.as_str().parse::<Lsn>().ok());
            // Messages of an atomic batch carry the id in Outbox-Event-Id.
            let id = m
                .headers
                .get(message::NATS_MSG_ID)
                .or_else(|| m.headers.get(message::EVENT_ID))
                .map(|v| v.as_str().to_owned());
            lsn.zip(id)
        }
        Err(_) => None,
    };
    Ok(Tail {
        last_sequence,
        last,
        max_msg_size,
    })
}

/// Decides, for the events a session replays from the confirmed position, which are already stored.
#[derive(Debug, Clone)]
pub struct Replay {
    /// Until this (commit LSN, id) has been passed, replayed events are already in the stream.
    until: Option<(Lsn, String)>,
}

impl Replay {
    /// A replay that skips events up to the stream's last message, `tail.last`.
    pub fn new(tail: &Tail) -> Self {
        Replay {
            until: tail.last.clone(),
        }
    }

    /// Whether the event of transaction `commit_lsn` with message id `id` is already stored. Events
    /// arrive in commit order, and within a transaction in insert order, as they were published.
    pub fn already_stored(&mut self, commit_lsn: Lsn, id: &str) -> bool {
        let Some((last_lsn, last_id)) = &self.until else {
            return false;
        };
        if commit_lsn < *last_lsn {
            return true;
        }
        if commit_lsn == *last_lsn {
            if id == last_id {
                self.until = None;
            }
            return true;
        }
        self.until = None;
        false
    }
}

/// The fence of one session: which replayed events to skip, and which sequence each publish expects.
#[derive(Debug)]
pub struct Fence {
    replay: Replay,
    /// The stream's last sequence when the session started.
    base: u64,
    /// Messages published with an expectation so far (each should take one sequence).
    published: u64,
    /// Of those, how many JetStream acknowledged as duplicates (they took none). Shared with the
    /// ack task, which learns it.
    duplicates: Arc<AtomicU64>,
}

impl Fence {
    /// The fence of a session that starts with the stream at `tail`.
    pub fn new(tail: &Tail) -> Self {
        Fence {
            replay: Replay::new(tail),
            base: tail.last_sequence,
            published: 0,
            duplicates: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Whether a replayed event is in the stream already (then it is skipped, not published).
    pub fn already_stored(&mut self, commit_lsn: Lsn, id: &str) -> bool {
        self.replay.already_stored(commit_lsn, id)
    }

    /// The `Nats-Expected-Last-Sequence` of the next message; counts it.
    pub fn next_expected(&mut self) -> u64 {
        let e = self.base + self.published - self.duplicates.load(Ordering::Acquire);
        self.published += 1;
        e
    }

    /// The stream's last sequence when the session started.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The duplicate counter the ack task increments.
    pub fn duplicates(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.duplicates)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail(lsn: u64, id: &str) -> Tail {
        Tail {
            last_sequence: 9,
            last: Some((Lsn(lsn), id.to_owned())),
            max_msg_size: None,
        }
    }

    #[test]
    fn skips_up_to_and_including_the_last_stored_event() {
        let mut r = Replay::new(&tail(200, "b"));
        assert!(r.already_stored(Lsn(100), "x"), "earlier transaction");
        assert!(r.already_stored(Lsn(200), "a"), "same transaction, before");
        assert!(r.already_stored(Lsn(200), "b"), "the last stored one");
        assert!(!r.already_stored(Lsn(200), "c"), "same transaction, after");
        assert!(!r.already_stored(Lsn(300), "d"));
        assert!(!r.already_stored(Lsn(100), "x"), "once passed, never again");
    }

    #[test]
    fn later_transaction_ends_skipping() {
        let mut r = Replay::new(&tail(200, "b"));
        assert!(!r.already_stored(Lsn(250), "z"));
        assert!(!r.already_stored(Lsn(200), "b"));
    }

    #[test]
    fn empty_or_foreign_tail_skips_nothing() {
        let mut r = Replay::new(&Tail {
            last_sequence: 0,
            last: None,
            max_msg_size: None,
        });
        assert!(!r.already_stored(Lsn(1), "a"));
    }

    #[test]
    fn expectations_count_from_the_tail_and_step_back_for_duplicates() {
        let mut f = Fence::new(&tail(200, "b"));
        assert_eq!(f.next_expected(), 9);
        assert_eq!(f.next_expected(), 10);
        // The message that expected 9 was a duplicate: it took no sequence.
        f.duplicates().fetch_add(1, Ordering::AcqRel);
        assert_eq!(f.next_expected(), 10);
        assert_eq!(f.next_expected(), 11);
    }
}
