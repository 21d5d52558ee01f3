//! Atomic batches (`nats.atomic_transactions`): each Postgres transaction is published as one
//! JetStream atomic batch (ADR-50, nats-server 2.12+, stream `allow_atomic`), so the stream holds a
//! transaction's events all together or not at all, and a consumer never sees part of one.
//!
//! Wire form: every message carries `Nats-Batch-Id` and `Nats-Batch-Sequence` (1, 2, …); the first
//! one also `Nats-Expected-Last-Sequence` (the only place a batch may carry it, checked against the
//! stream before the batch when the batch commits); the last one `Nats-Batch-Commit: 1`. Members are
//! core publishes without a reply subject (no per-message ack for nats-server to send, which is most
//! of its cost per message); only the commit is a JetStream publish, whose single ack settles the
//! whole batch, in order: the commit carries its members in the sink's window. Since the last event
//! of a transaction is only known at its Commit, the sink holds each event back until the next one
//! (or the Commit) arrives.
//!
//! A batch cannot carry `Nats-Msg-Id`, so the event id goes into `Outbox-Event-Id`, and the fence
//! (required: settings refuse `atomic_transactions` without it) is what keeps every event stored
//! once: a session resumes behind the stream's tail, and a batch sent after a gap is refused whole.
//!
//! Size: one message over the stream's `max_msg_size` makes the server refuse the whole batch, on
//! every session, and one over the server's `max_payload` is refused by the client. So each message
//! is measured as it is sent, every header stamped (the batch headers and `Outbox-Position` take
//! about 200 bytes), against the smaller of the two (and its header block against JetStream's
//! 65,535 bytes, 10097), and one that does not fit goes out as its dead letter, shrunk until it
//! fits, in its place in the batch (`batch/fit.rs`); a client refusal all the same (a server with a
//! smaller `max_payload`) steps down the same ladder. A batch refused for its size
//! all the same (the stream's limit lowered during the session) ends the session once: the next
//! one reads the new limit.
//!
//! Limits: a batch holds at most [`MAX_BATCH`] messages (the server's default), and the open batch
//! can never hold more of the in-flight window than exists (its members are only acknowledged by its
//! commit, so waiting for window room it holds itself would deadlock). A transaction past either
//! limit is split into several batches, committed in order: nothing is lost and nothing is
//! reordered, but atomicity then holds per batch, not per transaction (a warn line per split). A
//! session that ends with a batch open (crash, lost connection) leaves it uncommitted: the server
//! abandons it after 10 s without storing any of it, and the next session publishes the transaction
//! again.
//!
//! The [`Batcher`] owns the batch state: the open batch, the event held back, the group waiting
//! (`group.rs`). Its decisions (when a transaction splits, which member of which batch the next
//! message is, what a transaction's end sends) are plain methods, unit-tested below without a
//! publisher; the functions at the end of the file carry them out through the session's
//! [`Flight`], which sends and settles.

use std::time::Duration;

use tokio::time::Instant;
use tracing::warn;

mod fit;

use fit::{Limit, Membership, Stamped, fit, smaller};

use super::config::SinkConfig;
use super::destination::{self, Sent};
use super::envelope::{begin_span, routed_subject};
use super::error::SinkError;
use super::flight::Flight;
use super::group::{Fill, Waiting};
use super::publish::Publisher;
use super::window::{Held, InFlight, approx_size};
use crate::event::OutboxEvent;
use crate::message::{self, IdHeader, Outgoing};
use crate::nats::NatsErrorKind;

/// Batches in flight (opened, commit not yet acknowledged) at most: one. A batch cannot carry
/// `Nats-Msg-Id` nor an id expectation, so batches are chained by sequence only; with two in flight,
/// a batch refused because another writer (or a late publish of an ended session) took its
/// sequences would have the next one stored past it, exactly when that writer took as many
/// sequences as the refused batch held (P4; found by the simulation, seed 177). So the next batch
/// is opened only once the stream stored the one before it. It costs one round trip and about
/// 80 µs of the relay's CPU per batch, with no throughput loss measurable beside nats-server's
/// ~3 ms of CPU per batch (docs/performance.md). nats-server's own limit of 50 open batches per
/// stream is never near.
pub(super) const MAX_BATCHES_IN_FLIGHT: usize = 1;

/// The batch being built.
struct Open {
    id: String,
    /// Messages sent in it so far.
    sent: usize,
    /// Their window bytes.
    bytes: usize,
    /// Its members sent so far (core publishes, no ack of their own): they go with the commit.
    members: Vec<InFlight>,
}

/// State of the atomic-batch path; see the module docs.
pub(super) struct Batcher {
    /// The server's `max_payload`.
    max_payload: usize,
    /// The stream's `max_msg_size`, if it has one: a batch holding a larger message would be refused
    /// whole, every time it is sent, so such a message is dead-lettered before it joins a batch.
    max_msg_size: Option<usize>,
    /// Unique per session, so a batch id never repeats (the server keys open batches by it).
    prefix: String,
    next: u64,
    open: Option<Open>,
    /// The last event, not sent yet: it becomes the commit if the transaction ends here.
    held: Option<Held>,
    /// With `nats.atomic_group_ms`: the open batch ends at a transaction's end and waits for the
    /// transactions after it (`group.rs`).
    waiting: Option<Waiting>,
    /// Transactions split into several batches so far. Nothing reads it (no metric): the warn line
    /// each split logs is what reports it.
    splits: u64,
}

impl Batcher {
    /// The batcher of a session whose server takes `max_payload` and whose stream, if it has one,
    /// `max_msg_size`.
    pub(super) fn new(max_payload: usize, max_msg_size: Option<usize>) -> Self {
        Batcher {
            max_payload,
            max_msg_size,
            // Fixed width: the id's length, and so a batch's size and what fits in it, is the same
            // in every process (a replayed simulation seed is the run it replays).
            prefix: format!(
                "or{:08x}-{:016x}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            ),
            next: 0,
            open: None,
            held: None,
            waiting: None,
            splits: 0,
        }
    }

    /// The limit a batch message must fit, headers and payload: the server's `max_payload` or
    /// the stream's `max_msg_size`, whichever is smaller (members are core publishes, which the
    /// server would close the connection for, and one message over the stream's limit makes it
    /// refuse the whole batch, every time it is sent).
    fn limit(&self) -> Limit {
        match self.max_msg_size {
            Some(stream) if stream < self.max_payload => Limit {
                bytes: stream,
                what: "the stream's max_msg_size",
            },
            _ => Limit {
                bytes: self.max_payload,
                what: "the server's max_payload",
            },
        }
    }

    /// Messages and window bytes of the open batch sent so far.
    fn open_size(&self) -> (usize, usize) {
        self.open.as_ref().map_or((0, 0), |o| (o.sent, o.bytes))
    }

    /// What the open batch holds with the event held back: messages and window bytes.
    fn fill(&self) -> Fill {
        let (sent, bytes) = self.open_size();
        Fill {
            messages: sent + usize::from(self.held.is_some()),
            bytes: bytes + self.held.as_ref().map_or(0, |h| h.size),
        }
    }

    /// Messages handed to the sink whose batch is not committed yet and will not be unless their
    /// transaction's Commit arrives: a waiting batch's are committed on shutdown, the ones kept
    /// back after it are not.
    pub(super) fn uncommitted(&self) -> usize {
        match &self.waiting {
            Some(waiting) => waiting.kept(),
            None => self.open_size().0 + usize::from(self.held.is_some()),
        }
    }

    /// When the waiting batch is to be committed: once the batch before it is stored (`batches`,
    /// committed and not yet settled, is 0) and `bound` after its first transaction's end, or at
    /// once when that end found no batch in flight (`group.rs`). `None` while nothing waits, or
    /// while the batch before it is in flight (its ack comes first).
    pub(super) fn due(&self, batches: usize, bound: Option<Duration>) -> Option<Instant> {
        let waiting = self.waiting.as_ref()?;
        if batches > 0 {
            return None;
        }
        Some(waiting.due(bound.unwrap_or(Duration::ZERO)))
    }

    /// Whether the event held back, sent before one of `size` bytes of the same transaction, must
    /// commit the open batch: the batch (its members, the held one and the new one) must fit the
    /// batch limit and the window, or waiting for room would wait for itself. A split is counted
    /// and logged.
    fn split_before(&mut self, held: &Held, size: usize, config: &SinkConfig) -> bool {
        let (sent, bytes) = self.open_size();
        let split =
            sent + 2 > batch_room(config) || bytes + held.size + size > config.max_in_flight_bytes;
        if split {
            self.splits += 1;
            warn!(
                lsn = %held.item.event.commit_lsn,
                messages = sent + 1,
                "transaction larger than one atomic batch: committing it in parts (each part atomic)"
            );
        }
        split
    }

    /// Whether the next message (a commit when `commit`) must wait for the batch before it to be
    /// stored ([`MAX_BATCHES_IN_FLIGHT`]): before opening the next batch, or, when transactions
    /// are grouped, before committing it (its members wait staged on the server meanwhile, which
    /// is where the group forms).
    fn must_wait(&self, commit: bool, grouped: bool) -> bool {
        (commit && grouped) || (!grouped && self.open.is_none())
    }

    /// The next message of the open batch (opening one if none is), taking `size` window bytes:
    /// its batch headers. Only a batch's first message carries the fence's `expected` sequence.
    fn member(&mut self, size: usize, expected: Option<u64>, commit: bool) -> Membership {
        let prefix = &self.prefix;
        let next = &mut self.next;
        let open = self.open.get_or_insert_with(|| {
            *next += 1;
            Open {
                id: format!("{prefix}-{next}"),
                sent: 0,
                bytes: 0,
                members: Vec::new(),
            }
        });
        open.sent += 1;
        open.bytes += size;
        Membership {
            batch: open.id.clone(),
            sequence: open.sent,
            expected: expected.filter(|_| open.sent == 1),
            commit,
        }
    }

    /// A member was sent: it is settled with its batch's commit.
    fn sent_member(&mut self, item: InFlight) {
        if let Some(open) = self.open.as_mut() {
            open.members.push(item);
        }
    }

    /// The commit was sent: the batch closes, and its members go with the commit.
    fn committed(&mut self) -> Vec<InFlight> {
        self.open.take().map(|o| o.members).unwrap_or_default()
    }

    /// An event took its place: it is held back, behind a waiting batch if one waits.
    fn hold(&mut self, held: Held) {
        match self.waiting.as_mut() {
            Some(waiting) => waiting.keep(held),
            None => self.held = Some(held),
        }
    }

    /// A transaction ended while grouping, with `in_flight` batches committed and not yet
    /// stored: what to send now as members of the waiting batch, in order (the event held before,
    /// and the ended transaction's events but its last, which is held back in turn); a batch that
    /// did not wait yet starts waiting. `None`: nothing to do (no event since the last commit).
    fn transaction_ended(&mut self, now: Instant, in_flight: usize) -> Option<Vec<Held>> {
        match self.waiting.as_mut() {
            Some(waiting) => {
                // It fits: `submit` commits the group before a transaction outgrows it.
                let mut pending = waiting.take_kept();
                let Some(last) = pending.pop() else {
                    // A transaction without events.
                    return Some(Vec::new());
                };
                let sends = self.held.take().into_iter().chain(pending).collect();
                self.held = Some(last);
                Some(sends)
            }
            None if self.held.is_none() => None,
            None => {
                self.waiting = Some(Waiting::new(now, in_flight));
                Some(Vec::new())
            }
        }
    }
}

/// The most messages the open batch may hold: the server's limit, and never more than the
/// in-flight window.
fn batch_room(config: &SinkConfig) -> usize {
    config.max_batch.min(config.max_in_flight).max(1)
}

/// The message for `event` in a batch (event id in `Outbox-Event-Id`), or its dead letter when the
/// event has a problem (`destination.rs`). Its size is checked when it is sent, with every header
/// stamped ([`fit`]).
fn message(
    config: &SinkConfig,
    event: &OutboxEvent,
    requeue: Option<&str>,
) -> Result<(Outgoing, Sent), SinkError> {
    let out = message::build_as(
        event,
        &config.template,
        &config.dead_letter_subject,
        config.cloudevents.as_ref(),
        IdHeader::EventId,
        config.descriptive,
    );
    // Settings refuse parking with atomic batches: no key is ever parked here. A dead letter
    // requeued (`requeue`: its request) and still invalid is dead-lettered again, never a stop.
    let none = &mut crate::parking::ParkedSet::default();
    none.set_requeue_dead_letter(requeue.map(str::to_owned));
    let sent = destination::choose(config, none, event, out.dead_letter.as_deref())?;
    Ok((out, sent))
}

/// Carrying the batcher's decisions out through the session's flight: what `Sink::submit` and
/// `Sink::commit` do with atomic batches.
impl Batcher {
    /// [`Sink::submit`](super::Sink::submit) with `atomic`: the event is held back; the one held
    /// before it goes out as a batch member (or closes the batch when a limit is reached).
    pub(super) async fn submit(
        &mut self,
        flight: &mut Flight,
        seq: u64,
        mut event: Box<OutboxEvent>,
    ) -> Result<(), SinkError> {
        let size = approx_size(&event).min(flight.config().max_in_flight_bytes);
        // A group waiting for the next transactions takes this one's events only while the
        // batch, with them, fits the batch limit and the window (`group.rs`); else it commits
        // first, and this transaction goes on in a batch of its own.
        let (room, max_bytes) = (
            batch_room(flight.config()),
            flight.config().max_in_flight_bytes,
        );
        let outgrown =
            (self.waiting.as_ref()).is_some_and(|w| !w.fits(self.fill(), 1, size, room, max_bytes));
        if outgrown {
            self.close_group(flight).await?;
        }
        if self.waiting.is_none()
            && let Some(held) = self.held.take()
        {
            self.send_before(flight, held, size).await?;
        }
        let size = flight.reserve(size).await?;
        let requeue = flight.parked().requeue_of_dead_letter();
        let (mut out, sent) = message(flight.config(), &event, requeue)?;
        let span = begin_span(flight.config(), &mut event, &mut out);
        // Batch messages carry no `Nats-Msg-Id`, and the server refuses an id expectation inside
        // a batch: the chain is by sequence only, one expectation per batch (its first message).
        let expected = flight.next_sequence();
        let item = InFlight {
            seq,
            ack: 0,
            event,
            subject: String::new(),
            sent,
            expected,
            expected_id: None,
            size,
            members: None,
            span,
        };
        self.hold(Held { item, out, size });
        Ok(())
    }

    /// The transaction ended. Without grouping, its held event commits the batch; with it, the
    /// batch waits (or takes the transaction that ended, when it was waiting already), and is
    /// committed here only when it is due ([`Batcher::due`]).
    pub(super) async fn commit(&mut self, flight: &mut Flight) -> Result<(), SinkError> {
        if flight.config().atomic_group.is_none() {
            return match self.held.take() {
                Some(held) => self.send_held(flight, held, true).await,
                None => Ok(()),
            };
        }
        let Some(sends) = self.transaction_ended(Instant::now(), flight.batches()) else {
            return Ok(());
        };
        for next in sends {
            self.send_held(flight, next, false).await?;
        }
        self.commit_due(flight).await
    }

    /// Commits the waiting batch if it is due.
    pub(super) async fn commit_due(&mut self, flight: &mut Flight) -> Result<(), SinkError> {
        match self.due(flight.batches(), flight.config().atomic_group) {
            Some(due) if Instant::now() >= due => self.close_group(flight).await,
            _ => Ok(()),
        }
    }

    /// Commits the waiting batch now (after the batch before it is stored), and starts the
    /// transaction kept back after it in a batch of its own.
    async fn close_group(&mut self, flight: &mut Flight) -> Result<(), SinkError> {
        let Some(waiting) = self.waiting.take() else {
            return Ok(());
        };
        if let Some(held) = self.held.take() {
            self.send_held(flight, held, true).await?;
        }
        for next in waiting.into_kept() {
            if let Some(held) = self.held.take() {
                self.send_before(flight, held, next.size).await?;
            }
            self.held = Some(next);
        }
        Ok(())
    }

    /// Sends `held`, the event before one of `size` bytes in the same transaction, as the next
    /// member of the open batch, or as its commit when a limit is reached (the transaction is then
    /// split).
    async fn send_before(
        &mut self,
        flight: &mut Flight,
        held: Held,
        size: usize,
    ) -> Result<(), SinkError> {
        let split = self.split_before(&held, size, flight.config());
        self.send_held(flight, held, split).await
    }

    /// Sends the held event as the next message of the open batch (opening one if needed), as its
    /// commit when `commit`.
    async fn send_held(
        &mut self,
        flight: &mut Flight,
        held: Held,
        commit: bool,
    ) -> Result<(), SinkError> {
        let Held {
            mut item,
            out,
            size,
        } = held;
        if self.must_wait(commit, flight.config().atomic_group.is_some()) {
            flight.wait_for_batches(MAX_BATCHES_IN_FLIGHT).await?;
        }
        let m = self.member(size, item.expected, commit);
        let limit = self.limit();
        let msg = fit(flight.config(), limit, &mut item, out, &m)?;
        let (publisher, config) = flight.wire();
        let token = send(publisher, config, limit, &mut item, msg, &m).await?;
        if commit {
            item.ack = token.unwrap_or(0);
            item.members = Some(self.committed());
            flight.push(item);
        } else {
            self.sent_member(item);
        }
        Ok(())
    }
}

/// Sends `msg`, the stamped message of `item` as member `m` of its batch: the commit as a JetStream
/// publish (the token its ack comes under), a member as a core publish. One the client refuses for
/// the server's `max_payload` (a server with a smaller limit than the one the session started
/// with) goes one step down the dead-letter ladder and is sent again, like any other size refusal.
async fn send(
    publisher: &mut Publisher,
    config: &SinkConfig,
    limit: Limit,
    item: &mut InFlight,
    mut msg: Stamped,
    m: &Membership,
) -> Result<Option<u64>, SinkError> {
    loop {
        let Stamped {
            subject,
            headers,
            payload,
        } = msg;
        let sent = if m.commit {
            publisher.send(subject, headers, payload).await.map(Some)
        } else {
            // Bounded like every other publish: the client's queue to the connection is
            // bounded, and a connection that does not drain must end the session, not wedge it.
            publisher
                .send_member(subject, headers, payload)
                .await
                .map(|()| None)
        };
        let e = match sent {
            Ok(token) => return Ok(token),
            Err(e) => e,
        };
        if e.kind() != NatsErrorKind::TooLarge {
            let id = item.event.msg_id.clone();
            return Err(match m.commit {
                true => SinkError::Publish { id, source: e },
                false => SinkError::CorePublish { id, source: e },
            });
        }
        let routed = routed_subject(
            config,
            &item.event,
            &item.sent,
            std::mem::take(&mut item.subject),
        );
        let server = publisher.max_payload();
        let reason = format!("message too large for the server's max_payload of {server} bytes");
        let limit = Limit {
            bytes: limit.bytes.min(server),
            ..limit
        };
        let subject = Some(routed.as_str()).filter(|s| !s.is_empty());
        msg = smaller(config, limit, item, subject, m, reason)?;
    }
}

/// The batcher's decisions, without a publisher: which batch and place each message takes, when a
/// transaction splits, what a transaction's end sends, when a waiting group is due.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::Lsn;
    use crate::config::Config;
    use crate::position::Position;

    fn config(max_in_flight: usize, max_bytes: usize) -> SinkConfig {
        let mut c = Config::default();
        c.nats.atomic_transactions = true;
        let mut config = SinkConfig::from_settings(&c.validate().unwrap());
        config.max_in_flight = max_in_flight;
        config.max_in_flight_bytes = max_bytes;
        config
    }

    #[test]
    fn a_requeued_dead_letter_still_invalid_in_a_batch_is_dead_lettered_again_not_a_stop() {
        let mut c = config(100, 1 << 20);
        c.stop_on_invalid = true;
        let mut event = held(1, 0, None).item.event;
        event.problem = Some("still bad".into());
        assert!(message(&c, &event, None).is_err(), "on_invalid = stop");
        let (out, sent) = message(&c, &event, Some("r-1")).unwrap();
        assert!(matches!(sent, Sent::DeadLetter { .. }), "{sent:?}");
        assert_eq!(out.subject, c.dead_letter_subject);
    }

    /// Event `i` of a transaction, held back with `size` window bytes and the fence's `expected`.
    fn held(i: u32, size: usize, expected: Option<u64>) -> Held {
        let event = Box::new(OutboxEvent {
            id: Some(format!("e-{i}")),
            aggregate_type: Some("Claim".into()),
            aggregate_id: Some("4711".into()),
            event_type: Some("ClaimApproved".into()),
            payload: bytes::Bytes::from_static(b"{}"),
            headers: vec![],
            commit_lsn: Lsn(0x100),
            index: i,
            position: Position::in_transaction(Lsn(0x100), i),
            commit_ts: 0,
            original_commit_ts: None,
            problem: None,
            msg_id: format!("e-{i}"),
            content_type: None,
            data_schema: None,
            schema_check: None,
        });
        let (out, sent) = message(&config(100, 1 << 20), &event, None).unwrap();
        Held {
            item: InFlight {
                seq: u64::from(i),
                ack: 0,
                event,
                subject: String::new(),
                sent,
                expected,
                expected_id: None,
                size,
                members: None,
                span: None,
            },
            out,
            size,
        }
    }

    /// Sends `h` as the batcher would (after any wait): its membership, and the member kept.
    fn send(b: &mut Batcher, h: Held, commit: bool) -> Membership {
        let m = b.member(h.size, h.item.expected, commit);
        if commit {
            b.committed();
        } else {
            b.sent_member(h.item);
        }
        m
    }

    #[test]
    fn each_batch_numbers_its_messages_and_only_its_first_expects_a_sequence() {
        let mut b = Batcher::new(1 << 20, None);
        assert!(b.must_wait(false, false), "the first message opens a batch");
        let first = send(&mut b, held(0, 10, Some(41)), false);
        assert!(
            !b.must_wait(false, false),
            "the open batch takes members at once"
        );
        let second = send(&mut b, held(1, 10, Some(42)), false);
        let commit = send(&mut b, held(2, 10, Some(43)), true);
        assert_eq!((first.sequence, first.expected), (1, Some(41)));
        assert_eq!((second.sequence, second.expected), (2, None));
        assert_eq!((commit.sequence, commit.commit), (3, true));
        assert_eq!(first.batch, commit.batch);
        let next = send(&mut b, held(3, 10, Some(44)), false);
        assert_ne!(next.batch, first.batch, "a commit closes its batch");
        assert_eq!((next.sequence, next.expected), (1, Some(44)));
    }

    #[test]
    fn a_commit_carries_the_members_sent_before_it() {
        let mut b = Batcher::new(1 << 20, None);
        send(&mut b, held(0, 10, Some(1)), false);
        send(&mut b, held(1, 10, Some(2)), false);
        b.member(10, Some(3), true);
        let members = b.committed();
        assert_eq!(members.iter().map(|m| m.seq).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(b.open_size(), (0, 0));
    }

    #[test]
    fn a_transaction_splits_where_the_batch_or_the_window_would_overflow() {
        // At most 3 messages a batch (the window of 3 bounds it).
        let c = config(3, 1_000);
        let mut b = Batcher::new(1 << 20, None);
        let h = held(0, 10, None);
        assert!(!b.split_before(&h, 10, &c), "the held one and the next fit");
        send(&mut b, h, false);
        let h = held(1, 10, None);
        assert!(!b.split_before(&h, 10, &c), "three in all");
        send(&mut b, h, false);
        assert!(
            b.split_before(&held(2, 10, None), 10, &c),
            "a fourth would not fit"
        );
        assert_eq!(b.splits, 1);
        // Bytes: the members, the held one and the next must fit the window's bytes.
        let mut b = Batcher::new(1 << 20, None);
        let c = config(100, 1_000);
        send(&mut b, held(0, 600, None), false);
        assert!(b.split_before(&held(1, 300, None), 101, &c));
        assert!(!b.split_before(&held(1, 300, None), 100, &c));
    }

    #[test]
    fn the_limit_is_the_smaller_of_the_servers_and_the_streams() {
        assert_eq!(Batcher::new(1_000, Some(500)).limit().bytes, 500);
        assert_eq!(Batcher::new(1_000, Some(5_000)).limit().bytes, 1_000);
        assert_eq!(Batcher::new(1_000, None).limit().bytes, 1_000);
    }

    #[test]
    fn a_transactions_end_starts_a_group_then_joins_the_next_whole() {
        let now = Instant::now();
        let bound = Some(Duration::from_millis(5));
        let mut b = Batcher::new(1 << 20, None);
        assert!(
            b.transaction_ended(now, 1).is_none(),
            "nothing since the last commit"
        );
        b.hold(held(0, 10, None));
        // The first transaction's end, behind a batch in flight: the batch waits, nothing is
        // sent yet.
        assert_eq!(b.transaction_ended(now, 1).map(|s| s.len()), Some(0));
        assert_eq!(b.due(0, bound), Some(now + Duration::from_millis(5)));
        assert_eq!(b.due(1, bound), None, "the batch before it is in flight");
        // The next transaction's events are kept back while it is open...
        b.hold(held(1, 10, None));
        b.hold(held(2, 10, None));
        assert_eq!(b.uncommitted(), 2, "kept back: not committed on shutdown");
        // ...and join the group whole at its end: the one held before and all but its last go
        // out as members, its last is held.
        let sends = b.transaction_ended(now, 0).expect("sends");
        assert_eq!(sends.iter().map(|h| h.item.seq).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(b.held.as_ref().map(|h| h.item.seq), Some(2));
        assert_eq!(
            b.transaction_ended(now, 0).map(|s| s.len()),
            Some(0),
            "a transaction without events"
        );
    }

    #[test]
    fn a_transactions_end_with_nothing_in_flight_is_due_at_once() {
        let now = Instant::now();
        let bound = Some(Duration::from_millis(5));
        let mut b = Batcher::new(1 << 20, None);
        b.hold(held(0, 10, None));
        assert_eq!(b.transaction_ended(now, 0).map(|s| s.len()), Some(0));
        assert_eq!(b.due(0, bound), Some(now), "committed now, not 5 ms later");
        assert_eq!(
            b.due(1, bound),
            None,
            "never before the batch ahead is stored"
        );
    }

    #[test]
    fn grouped_commits_wait_for_the_batch_before() {
        let b = Batcher::new(1 << 20, None);
        assert!(b.must_wait(true, true), "a grouped commit waits");
        assert!(!b.must_wait(false, true), "a grouped member does not");
        assert!(
            b.must_wait(true, false),
            "nothing open: the next batch waits"
        );
    }
}
