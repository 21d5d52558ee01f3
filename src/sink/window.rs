//! The window: the messages published (or proven stored by a replay) and not yet settled, oldest
//! first, and the room they take. Its bounds ([`Room`], `nats.max_in_flight` messages and
//! `nats.max_in_flight_bytes` bytes) are plain arithmetic, unit-tested below without NATS; when
//! either is used up, taking a place settles the oldest message first ([`Sink::reserve`]), which is
//! how the relay stops reading from Postgres while JetStream is behind (P6). Settling reports in
//! window order, so acks come out in publish order whatever order JetStream answers in.

use async_nats::jetstream;

use super::envelope::Sent;
use super::{Acked, Outcome, Sink, SinkError, batch};
use crate::event::OutboxEvent;

/// The window, in submit order.
pub(super) enum Pending {
    /// Submitted events `first..first + count`, which a fenced replay proved to be stored already:
    /// reported without publishing.
    Stored { first: u64, count: u64 },
    /// A published message, whose ack is awaited.
    Sent(InFlight),
}

pub(super) struct InFlight {
    pub(super) seq: u64,
    /// The token its ack comes under (unused for a member of an atomic batch, settled by its
    /// commit).
    pub(super) ack: u64,
    pub(super) event: Box<OutboxEvent>,
    /// The subject it was routed to ("" if none), for a dead letter's `Outbox-Subject`.
    pub(super) subject: String,
    pub(super) sent: Sent,
    /// The `Nats-Expected-Last-Sequence` it was sent with (fenced streams).
    pub(super) expected: Option<u64>,
    /// The `Nats-Expected-Last-Msg-Id` it was sent with (fenced streams, after a session's first
    /// message).
    pub(super) expected_id: Option<String>,
    /// Its bytes in the window.
    pub(super) size: usize,
    /// An atomic batch's commit: the batch's other messages, settled with it.
    pub(super) members: Option<Vec<InFlight>>,
    /// Its trace span (`[telemetry]`), ended when it is settled.
    pub(super) span: Option<Box<crate::telemetry::Started>>,
}

/// The window's bounds and what it holds of them: messages and their bytes.
#[derive(Debug)]
pub(super) struct Room {
    /// `nats.max_in_flight`.
    max_messages: usize,
    /// `nats.max_in_flight_bytes`.
    max_bytes: usize,
    /// Messages in the window, members of the open batch included.
    messages: usize,
    /// Their bytes.
    bytes: usize,
}

impl Room {
    pub(super) fn new(max_messages: usize, max_bytes: usize) -> Self {
        Room {
            max_messages,
            max_bytes,
            messages: 0,
            bytes: 0,
        }
    }

    /// The bytes a message of `size` takes: one event bigger than the whole byte window still goes,
    /// alone.
    pub(super) fn bytes_for(&self, size: usize) -> usize {
        size.min(self.max_bytes)
    }

    /// Whether a message taking `size` bytes must wait for the oldest to be settled.
    pub(super) fn is_full_for(&self, size: usize) -> bool {
        self.messages >= self.max_messages
            || (self.messages > 0 && self.bytes + size > self.max_bytes)
    }

    /// A message taking `size` bytes enters the window.
    pub(super) fn take(&mut self, size: usize) {
        self.messages += 1;
        self.bytes += size;
    }

    /// A message that took `size` bytes leaves it.
    pub(super) fn give_back(&mut self, size: usize) {
        self.messages -= 1;
        self.bytes -= size;
    }

    /// Messages in the window.
    pub(super) fn messages(&self) -> usize {
        self.messages
    }
}

impl Sink {
    /// Takes a place for a message of `size` bytes in the window, settling the oldest messages
    /// while it is full. Returns the bytes taken.
    pub(super) async fn reserve(&mut self, size: usize) -> Result<usize, SinkError> {
        let size = self.room.bytes_for(size);
        while self.room.is_full_for(size) {
            self.settle_oldest().await?;
        }
        self.room.take(size);
        Ok(size)
    }

    /// Waits (bounded by the ack timeout) for the oldest message's answer and settles it.
    pub(super) async fn settle_oldest(&mut self) -> Result<(), SinkError> {
        let token = match self.window.front() {
            // Only members of the open batch are in flight: they wait for their commit, which
            // the batch limits send before the window fills.
            None => return Err(SinkError::Stopped),
            Some(Pending::Stored { .. }) => {
                self.pop_stored();
                return Ok(());
            }
            Some(Pending::Sent(item)) => item.ack,
        };
        let timeout = self.config.ack_timeout;
        match self.publisher.wait(token, timeout).await {
            Some(answer) => self.settle_front(answer).await,
            None => Err(self.timed_out()),
        }
    }

    pub(super) fn pop_stored(&mut self) {
        if let Some(Pending::Stored { first, count }) = self.window.pop_front() {
            self.settled.extend((first..first + count).map(|seq| Acked {
                seq,
                outcome: Outcome::AlreadyStored,
                commit_ts: 0,
            }));
            // Proven by the replay's read-back already.
            self.gate.settled(count, None);
        }
    }

    /// The oldest message's ack did not come in time.
    pub(super) fn timed_out(&self) -> SinkError {
        let id = match self.window.front() {
            Some(Pending::Sent(item)) => item.event.msg_id.clone(),
            _ => String::new(),
        };
        SinkError::AckTimeout(self.config.ack_timeout, id)
    }

    /// The inbox failed while the oldest message was awaited.
    pub(super) fn front_error(&self, source: jetstream::context::PublishError) -> SinkError {
        let id = match self.window.front() {
            Some(Pending::Sent(item)) => item.event.msg_id.clone(),
            _ => String::new(),
        };
        SinkError::Publish { id, source }
    }

    /// Reports a settled message (and the members of its batch) and gives its place back.
    pub(super) fn report(&mut self, mut item: InFlight, outcome: Outcome) {
        let mut count = 1;
        if let Some(members) = item.members.take() {
            count += members.len() as u64;
            if let Some(b) = self.batch.as_mut() {
                b.in_flight = b.in_flight.saturating_sub(1);
            }
            for mut m in members {
                self.room.give_back(m.size);
                let outcome = batch::outcome(&m.sent);
                self.end_span(&mut m, &outcome);
                self.settled.push_back(Acked {
                    seq: m.seq,
                    outcome,
                    commit_ts: m.event.commit_ts,
                });
            }
        }
        self.end_span(&mut item, &outcome);
        self.room.give_back(item.size);
        self.settled.push_back(Acked {
            seq: item.seq,
            outcome,
            commit_ts: item.event.commit_ts,
        });
        let new = self.stored_new.take();
        self.gate.settled(count, new);
    }

    /// Ends `item`'s span, if it has one, with its outcome: JetStream's ack is its end.
    pub(super) fn end_span(&self, item: &mut InFlight, outcome: &Outcome) {
        if let (Some(span), Some(t)) = (item.span.take(), &self.config.telemetry) {
            let dead_letter = match outcome {
                Outcome::DeadLetter { reason } => Some(reason.as_str()),
                _ => None,
            };
            t.end(span, &item.event.msg_id, item.event.commit_lsn, dead_letter);
        }
    }
}

/// What an event holds in memory while in flight: payload, the values that become headers, and the
/// client's copy of the message.
pub(super) fn approx_size(e: &OutboxEvent) -> usize {
    let opt = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    let headers: usize = e.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    2 * (e.payload.len()
        + e.msg_id.len()
        + opt(&e.aggregate_type)
        + opt(&e.aggregate_id)
        + opt(&e.event_type)
        + headers)
        + 256
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_waits_while_the_window_holds_its_most_messages() {
        let mut r = Room::new(2, 1_000);
        r.take(10);
        assert!(!r.is_full_for(10));
        r.take(10);
        assert!(r.is_full_for(10));
        r.give_back(10);
        assert!(!r.is_full_for(10));
        assert_eq!(r.messages(), 1);
    }

    #[test]
    fn a_message_waits_while_its_bytes_do_not_fit() {
        let mut r = Room::new(100, 1_000);
        r.take(600);
        assert!(!r.is_full_for(400), "exactly the byte bound fits");
        assert!(r.is_full_for(401));
        r.give_back(600);
        assert!(!r.is_full_for(1_000));
    }

    #[test]
    fn one_message_bigger_than_the_byte_window_goes_alone() {
        let mut r = Room::new(100, 1_000);
        let size = r.bytes_for(5_000);
        assert_eq!(size, 1_000);
        assert!(!r.is_full_for(size), "an empty window takes it");
        r.take(size);
        assert!(r.is_full_for(r.bytes_for(1)), "and nothing goes beside it");
        r.give_back(size);
        assert_eq!(r.messages(), 0);
    }
}
