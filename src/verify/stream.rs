//! Reading the relay's stream for `verify`: every stored message of a sequence range through an
//! ephemeral push consumer ([`ClientReader`], the one a resumed session reads its replay back
//! with: in memory, one replica, no acks, removed by the server 5 s after the read, so nothing
//! durable is left behind), headers only unless `--payloads` needs the bodies. Each message
//! becomes a compact record in [`Messages`]; on the way the order of `Outbox-Position` is checked and messages
//! without the relay's headers are set aside as foreign.
//!
//! Every sequence of the range is accounted for on the way: a message (the relay's, a dead letter,
//! a foreign one) or gone. The consumer delivers the stored messages in order and its own delivery
//! count has no gap (the reader checks it), so a sequence it skips was deleted: each run of them is
//! a gap, counted, the first few kept as ranges; whether the stream's limits explain them is for
//! the caller to say (`limits.rs`).
//!
//! Order is judged per history (`Outbox-Position`'s `SYSTEM/TIMELINE/SLOT` part): a message of a
//! new history (a restore, a new slot) starts the comparison afresh, since positions of different
//! histories are not comparable. Each message is compared with the relay's message before it, so
//! one message stored out of place is one break, not a break for every message after it.

use std::time::Duration;

use super::VerifyError;
use super::compare::{DEAD_LETTER, PARKED, content_hash, hash64};
use super::messages::Messages;
use crate::message::parked::PARKING;
use crate::nats::ClientReader;
use crate::parking::key_of_subject;
use crate::position::Position;

/// How long to wait for the next message before giving up on the read.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How often progress is reported.
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// What the read of the stream collected.
#[derive(Debug, Default)]
pub(crate) struct StreamScan {
    /// The relay's messages (of the current read: the caller sets the part up for each).
    pub(crate) msgs: Messages,
    /// Messages read, the relay's and others.
    pub(crate) messages: u64,
    /// Sequences of the messages without the relay's headers.
    pub(crate) foreign: Vec<u64>,
    /// Sequences of the relay's messages whose position is not above the one before.
    pub(crate) out_of_order: Vec<u64>,
    /// The first sequence read (0 before any).
    pub(crate) first_read: u64,
    /// The last sequence read (0 before any).
    pub(crate) last_read: u64,
    /// The end of the last range read (`to`): the next read starts after it.
    pub(crate) read_to: u64,
    /// Sequences of the ranges read that are gone (deleted, or removed by a limit).
    pub(crate) gone: u64,
    /// The first runs of gone sequences, as (first, last).
    pub(crate) gone_ranges: Vec<(u64, u64)>,
    /// The position of the newest of the relay's messages (in stream order) committed before
    /// [`StreamScan::below`]: what the rows' snapshot can show.
    pub(crate) newest_below: Option<Position>,
    /// See `newest_below` (the rows' snapshot's WAL position).
    below: Option<crate::Lsn>,
    /// The next sequence expected.
    next: u64,
    /// The history and position of the relay's last message read.
    prev: Option<(String, Position)>,
    /// Read and hash the payloads (`--payloads`).
    payloads: bool,
    /// `nats.dead_letter_subject`.
    dead_letter_subject: String,
}

pub(crate) use super::compare::event_id;

/// `Outbox-Position` split into its history (possibly empty) and position; fields after the
/// position (`;replay-over=N`) are neither.
pub(crate) fn split_position(value: &str) -> Option<(&str, Position)> {
    let value = value.split_once(';').map_or(value, |(main, _)| main).trim();
    let mut cut = value.rmatch_indices('/').map(|(i, _)| i);
    let (_, lsn_slash) = (cut.next(), cut.next());
    match lsn_slash {
        None => Some(("", value.parse().ok()?)),
        Some(i) => Some((&value[..i], value[i + 1..].parse().ok()?)),
    }
}

impl StreamScan {
    /// An empty scan; `payloads`: read and hash the bodies; `below`: the rows' snapshot's WAL
    /// position, for [`StreamScan::newest_below`].
    pub(crate) fn new(
        payloads: bool,
        dead_letter_subject: &str,
        below: Option<crate::Lsn>,
    ) -> StreamScan {
        StreamScan {
            payloads,
            dead_letter_subject: dead_letter_subject.to_owned(),
            below,
            ..StreamScan::default()
        }
    }

    /// Accounts for the sequences before `seq` not delivered since the last one: gone.
    fn gap(&mut self, seq: u64) {
        // 0: no range is being read (sequences start at 1).
        if self.next != 0 && seq > self.next {
            self.gone += seq - self.next;
            if self.gone_ranges.len() < super::report::EXAMPLES {
                self.gone_ranges.push((self.next, seq - 1));
            }
        }
        self.next = self.next.max(seq + 1);
    }

    /// Reads the stored messages `from..=to` into the scan. `progress` is called now and then with
    /// the messages read so far.
    pub(crate) async fn read(
        &mut self,
        client: &async_nats::Client,
        name: &str,
        from: u64,
        to: u64,
        progress: &mut impl FnMut(u64),
    ) -> Result<(), VerifyError> {
        if from > to {
            return Ok(());
        }
        self.next = from;
        let nats = |what: &str, detail: String| VerifyError::Stream {
            stream: name.to_owned(),
            what: what.to_owned(),
            detail,
        };
        let mut last_progress = std::time::Instant::now();
        // The reader moves to a new consumer every so many deliveries itself, so a long read
        // cannot outgrow the client's subscription buffer (src/nats/readback.rs).
        let mut reader = ClientReader::start_with(
            client,
            name,
            from,
            to,
            READ_TIMEOUT,
            !self.payloads,
            "outbox-relay verify: reading the stream",
        )
        .await
        .map_err(|e| nats("reading", crate::error_chain::error_chain(&e)))?;
        while let Some((seq, m)) = reader
            .next_message()
            .await
            .map_err(|e| nats("reading", crate::error_chain::error_chain(&e)))?
        {
            self.take(seq, m.subject.as_str(), m.headers.as_ref(), &m.payload)
                .map_err(|e| nats("reading", e.to_string()))?;
            if last_progress.elapsed() >= PROGRESS_EVERY {
                last_progress = std::time::Instant::now();
                progress(self.messages);
            }
        }
        // Deleted at the tail: the stream's last sequence stays, its message is gone.
        self.gap(to + 1);
        self.read_to = to;
        progress(self.messages);
        Ok(())
    }

    /// One stored message; an error when its sequence is outside the range the part was set up
    /// for (the caller checks the range first, so only a server's mistake gets here).
    fn take(
        &mut self,
        seq: u64,
        subject: &str,
        headers: Option<&async_nats::HeaderMap>,
        payload: &[u8],
    ) -> Result<(), OutOfRange> {
        self.messages += 1;
        self.gap(seq);
        if self.first_read == 0 {
            self.first_read = seq;
        }
        self.last_read = seq;
        let position = headers
            .and_then(|h| h.get("Outbox-Position"))
            .and_then(|v| split_position(v.as_str()));
        let (Some((history, position)), Some(id)) = (position, event_id(headers)) else {
            self.foreign.push(seq);
            return Ok(());
        };
        if self.below.is_some_and(|b| position.lsn < b) {
            self.newest_below = Some(position);
        }
        match &mut self.prev {
            Some((h, p)) if h == history => {
                if position <= *p {
                    self.out_of_order.push(seq);
                }
                *p = position;
            }
            prev => *prev = Some((history.to_owned(), position)),
        }
        let parking = key_of_subject(&self.dead_letter_subject, subject).is_some();
        // A release marker is no event: it ends its key's run (`parked.rs` reads it).
        if parking && headers.is_some_and(|h| h.get(PARKING).is_some()) {
            return Ok(());
        }
        let dead_letter = subject == self.dead_letter_subject
            || headers.is_some_and(|h| h.get("Outbox-Error").is_some());
        let content = if parking {
            PARKED
        } else if dead_letter {
            DEAD_LETTER
        } else {
            content_hash(subject, self.payloads.then_some(payload))
        };
        if self.msgs.push(hash64(id.as_bytes()), seq, content) {
            Ok(())
        } else {
            Err(OutOfRange(seq))
        }
    }
}

/// The server delivered a message whose sequence lies outside the range asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("sequence {0} delivered outside the range asked for")]
pub(crate) struct OutOfRange(u64);

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(id: &str, position: &str) -> async_nats::HeaderMap {
        let mut h = async_nats::HeaderMap::new();
        h.insert(async_nats::header::NATS_MESSAGE_ID, id);
        h.insert("Outbox-Position", position);
        h
    }

    #[test]
    fn one_message_out_of_place_is_one_break_and_a_new_history_starts_afresh() {
        let mut s = StreamScan::new(false, "dl", None);
        s.msgs = Messages::new(1, 8);
        let h = "7311/1/outbox_relay";
        for (seq, id, pos) in [
            (1, "e-1", format!("{h}/0/100:0")),
            (2, "e-2", format!("{h}/0/100:1")),
            (3, "e-4", format!("{h}/0/300:0")),
            (4, "e-3", format!("{h}/0/200:0")),
            (5, "e-5", format!("{h}/0/400:0")),
            // Another history: lower positions are not a break.
            (6, "e-6", "9999/1/outbox_relay/0/10:0".to_owned()),
            (7, "e-7", "0/20:0".to_owned()),
        ] {
            s.take(seq, "outbox.Claim", Some(&headers(id, &pos)), b"")
                .expect("in range");
        }
        s.take(8, "outbox.Claim", None, b"").expect("in range");
        assert_eq!(s.out_of_order, vec![4]);
        assert_eq!(s.foreign, vec![8]);
        assert_eq!(s.msgs.len(), 7);
        assert_eq!(s.messages, 8);
        assert_eq!(
            split_position("0/16B3748:3").map(|x| x.0),
            Some(""),
            "a position without a history"
        );
        assert!(
            s.take(0, "outbox.Claim", Some(&headers("e-0", "0/1:0")), b"")
                .is_err(),
            "a sequence before the part's start is an error, not a wrapped offset"
        );
    }

    #[test]
    fn every_sequence_not_delivered_is_gone_interior_and_tail_and_the_newest_below_is_kept() {
        let mut s = StreamScan::new(false, "dl", Some(crate::Lsn(0x250)));
        s.msgs = Messages::new(1, 8);
        s.next = 1;
        let h = "7311/1/outbox_relay";
        for (seq, lsn) in [(1, 0x100), (2, 0x200), (5, 0x300), (6, 0x400)] {
            let pos = format!("{h}/0/{lsn:X}:0");
            s.take(
                seq,
                "outbox.Claim",
                Some(&headers(&format!("e-{seq}"), &pos)),
                b"",
            )
            .unwrap();
        }
        s.gap(9);
        assert_eq!(s.gone, 4);
        assert_eq!(s.gone_ranges, vec![(3, 4), (7, 8)]);
        assert_eq!(s.newest_below, Some("0/200:0".parse().unwrap()));
    }

    #[test]
    fn a_replay_over_field_after_the_position_is_still_the_relays_message() {
        let mut s = StreamScan::new(false, "dl", None);
        let h = "7311/1/outbox_relay";
        s.take(
            1,
            "outbox.Claim",
            Some(&headers("e-1", &format!("{h}/0/100:0"))),
            b"",
        )
        .unwrap();
        s.take(
            2,
            "outbox.Claim",
            Some(&headers("e-2", &format!("{h}/0/200:0;replay-over=1"))),
            b"",
        )
        .unwrap();
        assert!(s.foreign.is_empty(), "{:?}", s.foreign);
        assert!(s.out_of_order.is_empty());
        assert_eq!(
            split_position(&format!("{h}/0/200:0;replay-over=1")),
            Some((h, "0/200:0".parse().unwrap()))
        );
    }
}
