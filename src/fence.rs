//! Fencing the stream: at the start of every session the relay reads the stream's tail, skips the
//! replayed events that are already stored there, and publishes every further message with
//! `Nats-Expected-Last-Sequence` = the sequence the previous one will get.
//!
//! Why: after a lost connection the NATS client reconnects on its own and sends what it still had
//! queued, while a publish that was on the broken connection is gone. Deduplication by `Nats-Msg-Id`
//! cannot repair that: the lost event would be stored later, after events that committed after it
//! (P4). With the expectation, the first message after a gap is refused (10071) and so is everything
//! behind it; the relay restarts, reads the tail again and goes on from exactly there. The stream
//! therefore always holds a gap-free prefix of the outbox in commit order, also beyond the duplicate
//! window. It requires that only the relay writes the stream (`nats.fence = false` turns this off).
//! Expectations pipeline: the server checks them in arrival order (and on replicated streams counts
//! proposals in flight), so the window of in-flight publishes stays full.

use std::collections::VecDeque;

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
}

/// Reads the tail of `stream`. The message is read from the stream leader (`STREAM.MSG.GET`), so a
/// message just stored is seen.
pub async fn read_tail(js: &jetstream::Context, stream: &str) -> Result<Tail, String> {
    let mut s = js
        .get_stream(stream)
        .await
        .map_err(|e| format!("JetStream stream {stream}: {e}"))?;
    let last_sequence = s
        .info()
        .await
        .map_err(|e| format!("JetStream stream {stream}: {e}"))?
        .state
        .last_sequence;
    if last_sequence == 0 {
        return Ok(Tail {
            last_sequence,
            last: None,
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
            let id = m
                .headers
                .get(message::NATS_MSG_ID)
                .map(|v| v.as_str().to_owned());
            lsn.zip(id)
        }
        Err(_) => None,
    };
    Ok(Tail {
        last_sequence,
        last,
    })
}

/// Decides, for the events a session replays from the confirmed position, which are already stored.
#[derive(Debug, Clone)]
pub struct Replay {
    /// Until this (commit LSN, id) has been passed, replayed events are already in the stream.
    until: Option<(Lsn, String)>,
}

impl Replay {
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

/// Message ids JetStream acknowledged as duplicates of an older message (an event id used twice):
/// such an ack takes no sequence, so the fence breaks behind it; on the replay the event is skipped
/// instead of published again, or the relay would loop.
#[derive(Debug, Default)]
pub struct KnownDuplicates {
    ids: VecDeque<(Lsn, String)>,
}

impl KnownDuplicates {
    pub fn remember(&mut self, commit_lsn: Lsn, id: String) {
        self.ids.push_back((commit_lsn, id));
    }

    pub fn contains(&self, commit_lsn: Lsn, id: &str) -> bool {
        self.ids.iter().any(|(l, i)| *l == commit_lsn && i == id)
    }

    /// Forgets what the slot has moved past: it will never be replayed.
    pub fn forget_before(&mut self, confirmed: Lsn) {
        while self.ids.front().is_some_and(|(l, _)| *l < confirmed) {
            self.ids.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail(lsn: u64, id: &str) -> Tail {
        Tail {
            last_sequence: 9,
            last: Some((Lsn(lsn), id.to_owned())),
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
        });
        assert!(!r.already_stored(Lsn(1), "a"));
    }

    #[test]
    fn known_duplicates_are_forgotten_behind_the_slot() {
        let mut d = KnownDuplicates::default();
        d.remember(Lsn(10), "a".into());
        d.remember(Lsn(20), "b".into());
        assert!(d.contains(Lsn(10), "a"));
        assert!(!d.contains(Lsn(20), "a"));
        d.forget_before(Lsn(15));
        assert!(!d.contains(Lsn(10), "a"));
        assert!(d.contains(Lsn(20), "b"));
    }
}
