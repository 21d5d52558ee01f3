//! The window ([`Window`]): the messages published (or proven stored by a replay) and not yet
//! settled, oldest first, the acks settled and not yet taken, and the room they take. Its bounds
//! ([`Room`], `nats.max_in_flight` messages and `nats.max_in_flight_bytes` bytes) are plain
//! arithmetic, unit-tested below without NATS; when either is used up, taking a place settles the
//! oldest message first (`Flight::reserve`), which is how the relay stops reading from Postgres while
//! JetStream is behind (P6). Settling reports in window order, so acks come out in publish order
//! whatever order JetStream answers in. What goes in it: [`InFlight`] (a message sent), [`Held`]
//! (an event of an atomic batch that took its place and waits to be sent).

use std::collections::VecDeque;
use std::pin::Pin;

use tokio::time::{Instant, Sleep};

use super::destination::Sent;
use super::outcome::{Acked, Outcome};
use crate::event::OutboxEvent;
use crate::message::Outgoing;
use crate::telemetry::{Started, Telemetry};

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
    pub(super) span: Option<Box<Started>>,
}

/// An event of an atomic batch that took its place in the window and is not sent yet: the last
/// event of its transaction so far, which becomes the batch's commit if the transaction ends here
/// (`batch.rs`), or one kept back behind a waiting batch (`group.rs`).
pub(super) struct Held {
    pub(super) item: InFlight,
    /// Its message, built and not yet stamped with its batch headers.
    pub(super) out: Outgoing,
    /// Its bytes in the window.
    pub(super) size: usize,
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
    #[inline]
    pub(super) fn bytes_for(&self, size: usize) -> usize {
        size.min(self.max_bytes)
    }

    /// Whether a message taking `size` bytes must wait for the oldest to be settled.
    #[inline]
    pub(super) fn is_full_for(&self, size: usize) -> bool {
        self.messages >= self.max_messages
            || (self.messages > 0 && self.bytes + size > self.max_bytes)
    }

    /// A message taking `size` bytes enters the window.
    #[inline]
    pub(super) fn take(&mut self, size: usize) {
        self.messages += 1;
        self.bytes += size;
    }

    /// A message that took `size` bytes leaves it.
    #[inline]
    pub(super) fn give_back(&mut self, size: usize) {
        self.messages -= 1;
        self.bytes -= size;
    }

    /// Messages in the window.
    #[inline]
    pub(super) fn messages(&self) -> usize {
        self.messages
    }
}

/// What the front of the window is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Front {
    /// Nothing published is waiting (members of an open batch may be: they are not in it yet).
    Empty,
    /// Events a replay proved stored: settled without an answer.
    Stored,
    /// A published message whose answer comes under this token.
    Sent(u64),
}

/// The window of one session; see the module docs. It owns what is published and not yet settled
/// (in submit order), what is settled and not yet taken (in the same order), the room they take,
/// and when the oldest message's answer is due.
pub(super) struct Window {
    /// Published (or proven stored) and not yet settled, oldest first.
    pending: VecDeque<Pending>,
    /// Settled, not yet taken, in order.
    settled: VecDeque<Acked>,
    /// The room its messages take (members of the open batch included), and its bounds.
    room: Room,
    /// Atomic batches whose commit is in `pending`.
    batches: usize,
    /// When the oldest message's answer is due; set at the first wait for it.
    deadline: Option<Instant>,
    /// The timer a wait for the oldest answer sleeps on, kept across waits and reset only when
    /// `deadline` changes (a new timer per wait cost a timer-wheel insert and removal each time:
    /// the session waits once per replication message), and the deadline it is set to.
    timer: Pin<Box<Sleep>>,
    timer_at: Option<Instant>,
}

impl Window {
    /// An empty window bounded by `max_messages` and `max_bytes`.
    pub(super) fn new(max_messages: usize, max_bytes: usize) -> Self {
        Window {
            pending: VecDeque::new(),
            settled: VecDeque::new(),
            room: Room::new(max_messages, max_bytes),
            batches: 0,
            deadline: None,
            timer: Box::pin(tokio::time::sleep(std::time::Duration::ZERO)),
            timer_at: None,
        }
    }

    /// The bytes a message of `size` takes ([`Room::bytes_for`]).
    #[inline]
    pub(super) fn bytes_for(&self, size: usize) -> usize {
        self.room.bytes_for(size)
    }

    /// Whether a message taking `size` bytes must wait for the oldest to be settled.
    #[inline]
    pub(super) fn is_full_for(&self, size: usize) -> bool {
        self.room.is_full_for(size)
    }

    /// A message taking `size` bytes takes its place (it enters `pending` when it is sent).
    #[inline]
    pub(super) fn take(&mut self, size: usize) {
        self.room.take(size);
    }

    /// Messages in the window (published, ack not yet reported, and the held ones).
    #[inline]
    pub(super) fn messages(&self) -> usize {
        self.room.messages()
    }

    /// Atomic batches committed and not yet settled.
    #[inline]
    pub(super) fn batches(&self) -> usize {
        self.batches
    }

    /// Appends a published message, or events a replay proved stored.
    #[inline]
    pub(super) fn push(&mut self, p: Pending) {
        if matches!(&p, Pending::Sent(item) if item.members.is_some()) {
            self.batches += 1;
        }
        self.pending.push_back(p);
    }

    /// What is oldest.
    #[inline]
    pub(super) fn front(&self) -> Front {
        match self.pending.front() {
            None => Front::Empty,
            Some(Pending::Stored { .. }) => Front::Stored,
            Some(Pending::Sent(item)) => Front::Sent(item.ack),
        }
    }

    /// The oldest published message's id ("" when the oldest is none), for its error.
    pub(super) fn front_id(&self) -> String {
        match self.pending.front() {
            Some(Pending::Sent(item)) => item.event.msg_id.clone(),
            _ => String::new(),
        }
    }

    /// Takes the oldest message to settle it; `None` if the oldest is not a published message.
    /// Its deadline ends with it.
    #[inline]
    pub(super) fn pop_sent(&mut self) -> Option<InFlight> {
        let Some(Pending::Sent(item)) = self.pending.pop_front() else {
            return None;
        };
        self.deadline = None;
        if item.members.is_some() {
            self.batches -= 1;
        }
        Some(item)
    }

    /// Settles the oldest entry if it is events a replay proved stored: they are reported
    /// [`Outcome::AlreadyStored`]. Returns how many.
    pub(super) fn settle_stored(&mut self) -> Option<u64> {
        let Some(Pending::Stored { first, count }) = self.pending.front() else {
            return None;
        };
        let (first, count) = (*first, *count);
        self.pending.pop_front();
        self.settled.extend((first..first + count).map(|seq| Acked {
            seq,
            outcome: Outcome::AlreadyStored,
            commit_ts: 0,
        }));
        Some(count)
    }

    /// Reports a settled message (and the members of its batch) as `outcome`, ends their trace
    /// spans, and gives their places back. Returns how many acks it made.
    pub(super) fn settled(
        &mut self,
        mut item: InFlight,
        outcome: Outcome,
        telemetry: Option<&Telemetry>,
    ) -> u64 {
        let mut count = 1;
        if let Some(members) = item.members.take() {
            count += members.len() as u64;
            for mut m in members {
                self.room.give_back(m.size);
                let outcome = stored_outcome(&m.sent);
                end_span(telemetry, &mut m, &outcome);
                self.settled.push_back(Acked {
                    seq: m.seq,
                    outcome,
                    commit_ts: m.event.commit_ts,
                });
            }
        }
        end_span(telemetry, &mut item, &outcome);
        self.room.give_back(item.size);
        self.settled.push_back(Acked {
            seq: item.seq,
            outcome,
            commit_ts: item.event.commit_ts,
        });
        count
    }

    /// The oldest settled ack not yet taken.
    #[inline]
    pub(super) fn take_settled(&mut self) -> Option<Acked> {
        self.settled.pop_front()
    }

    /// Whether the oldest message's answer is overdue.
    #[inline]
    pub(super) fn overdue(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The timer that fires when the oldest message's answer is due, `timeout` after the first
    /// wait for it.
    pub(super) fn timer(&mut self, timeout: std::time::Duration) -> Pin<&mut Sleep> {
        let deadline = *self
            .deadline
            .get_or_insert_with(|| Instant::now() + timeout);
        if self.timer_at != Some(deadline) {
            self.timer.as_mut().reset(deadline);
            self.timer_at = Some(deadline);
        }
        self.timer.as_mut()
    }
}

/// How a message of a batch its commit's ack stored ended: an event, or its dead letter.
#[inline]
pub(super) fn stored_outcome(sent: &Sent) -> Outcome {
    match sent {
        Sent::DeadLetter { reason, .. } => Outcome::DeadLetter {
            reason: reason.clone(),
        },
        Sent::Event => Outcome::Stored { duplicate: false },
    }
}

/// Ends `item`'s span, if it has one, with its outcome: JetStream's ack is its end.
fn end_span(telemetry: Option<&Telemetry>, item: &mut InFlight, outcome: &Outcome) {
    if let (Some(span), Some(t)) = (item.span.take(), telemetry) {
        let dead_letter = match outcome {
            Outcome::DeadLetter { reason } => Some(reason.as_str()),
            _ => None,
        };
        t.end(span, &item.event.msg_id, item.event.commit_lsn, dead_letter);
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
