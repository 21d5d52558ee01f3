//! The simulated JetStream behind the relay's NATS port (`port.rs`): one stream (`OUTBOX`, subjects
//! `outbox.>` and the dead-letter subject) with sequences, the duplicate window by `Nats-Msg-Id` on
//! the paused clock, `Nats-Expected-Last-Sequence`, `Nats-Expected-Last-Msg-Id`, `max_msg_size` and
//! the client's `max_payload`, retention limits (`max_msgs` and `max_bytes` with `discard: new`,
//! `max_age`) and purges,
//! and the faults a real connection and cluster produce: outages, publishes lost with the
//! connection, answers delayed, lost, duplicated, reordered or late past the ack timeout, answers
//! forged by another client on the relay's inbox (to single publishes and to atomic batch commits),
//! and messages hand-published to the stream. Each relay process reaches it through its own
//! [`ProcessPort`], which marks its sessions' inboxes as that process's: a publish of a process that
//! lost the slot to another is then told from the holder's.
//!
//! Publishes reach the server in the order they were sent (one TCP connection: a single server task
//! takes them off a queue, each after its transit delay), and the server checks them as nats-server
//! does: the duplicate window first, then the expected last sequence, then the expected last message
//! id (the `Nats-Msg-Id` of the last message stored, "" for one without), then the size. Each answer
//! then travels on its own timer, so answers can overtake each other.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_nats::header::{NATS_BATCH_COMMIT, NATS_BATCH_ID, NATS_BATCH_SEQUENCE};
use async_nats::{HeaderMap, StatusCode};
use bytes::Bytes;
use outbox_relay::message::{EXPECTED_LAST_MSG_ID, EXPECTED_LAST_SEQUENCE, NATS_MSG_ID};
use outbox_relay::nats::StoredMessage;
use outbox_relay::nats::{NatsError, NatsErrorKind};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::rng::Dice;
use super::trace::{Trace, trace};

pub(crate) const STREAM: &str = "OUTBOX";
pub(crate) const DEAD_LETTER_SUBJECT: &str = "outbox_dead_letter";
/// The stream metadata key of the backfill marker (`src/backfill_marker.rs`).
const BACKFILL_MARKER: &str = "outbox-relay.backfill";

/// How often each fault of publishes and answers strikes (all zero while the world settles).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Chaos {
    /// A publish lingers on its way to the server (20 to 400 ms), and those sent after it wait
    /// behind it (one connection): it may land after the session that sent it has ended and the
    /// next one has read the stream's tail.
    pub transit: f64,
    /// An answer takes 50 ms to 1.5 s instead of a few milliseconds.
    pub slow: f64,
    /// An answer takes longer than the ack timeout (2 s): 2.5 to 6 s.
    pub late: f64,
    /// An answer is lost on its way (the message is stored).
    pub lost: f64,
    /// An answer arrives twice.
    pub duplicated: f64,
    /// Another client plants an answer on the relay's inbox, before the real one or right behind
    /// it (and behind a refusal ten times as often).
    pub forged: f64,
}

/// The stream's limits and its duplicate window, per world.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub duplicate_window: Duration,
    pub max_payload: usize,
    pub max_msg_size: Option<usize>,
}

/// The stream's retention limits, with `discard: new` (a full stream refuses a new message, 10077:
/// the relay must stall, never lose it), and `max_age` (messages older are removed).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Retention {
    pub max_msgs: Option<usize>,
    pub max_bytes: Option<usize>,
    pub max_age: Option<Duration>,
}

/// A message in the stream.
#[derive(Clone, Debug)]
pub(crate) struct Stored {
    pub seq: u64,
    pub subject: String,
    pub headers: HeaderMap,
    pub payload: Bytes,
    pub at: Instant,
    /// Hand-published by "an operator", not by the relay: the promises are about the relay's.
    pub foreign: bool,
    /// How many times the world had given the stream's tail a reason to be distrusted when the
    /// session that published it began ([`Facts::distrust`]); a foreign message's is the era it
    /// begins.
    pub era: u64,
    /// The session that published it (its inbox's number; 0 for a foreign message).
    pub session: u64,
    /// Published by a session that had ended (its inbox gone): stored late.
    pub late: bool,
    /// Removed since (`max_age`, a purge): a read-back finds nothing at its sequence, but it was
    /// stored, and the promises count it.
    pub gone: bool,
}

impl Stored {
    /// The event id: `Nats-Msg-Id`, or `Outbox-Event-Id` on a message of an atomic batch.
    pub(crate) fn msg_id(&self) -> Option<&str> {
        self.headers
            .get(NATS_MSG_ID)
            .or_else(|| self.headers.get("Outbox-Event-Id"))
            .map(|v| v.as_str())
    }

    /// The event id the message is for: `Outbox-Event-Id` (a dead letter, a parked copy, a member
    /// of an atomic batch), else `Nats-Msg-Id`.
    pub(crate) fn event_id(&self) -> Option<&str> {
        self.headers
            .get("Outbox-Event-Id")
            .or_else(|| self.headers.get(NATS_MSG_ID))
            .map(|v| v.as_str())
    }
}

/// The event id a message is for: `Outbox-Event-Id` (a batch message, a dead letter, a parked
/// copy), else `Nats-Msg-Id`.
fn event_id(h: &HeaderMap) -> Option<String> {
    h.get("Outbox-Event-Id")
        .or_else(|| h.get(NATS_MSG_ID))
        .map(|v| v.as_str().to_owned())
}

/// When a forged answer is planted, against JetStream's own.
#[derive(Clone, Copy, Debug)]
enum Plant {
    Before,
    After,
}

/// What another client on the connection's inbox could know of an atomic batch when its commit is
/// answered: its id, how many messages it holds, and the sequence its first one expected.
#[derive(Clone, Debug)]
struct Commit {
    id: String,
    count: usize,
    expected: Option<u64>,
}

/// A publish on its way to the server.
struct InTransit {
    arrives: Instant,
    subject: String,
    reply: Option<String>,
    headers: HeaderMap,
    payload: Bytes,
}

struct State {
    limits: Limits,
    retention: Retention,
    messages: Vec<Stored>,
    /// When the relay last stored a message for each event id (`Outbox-Event-Id`, else
    /// `Nats-Msg-Id`; looked up, never iterated).
    ids: HashMap<String, Instant>,
    /// `Nats-Msg-Id` → (sequence, stored at): the duplicate window's memory.
    dedup: BTreeMap<String, (u64, Instant)>,
    /// The `Nats-Msg-Id` of the last message stored ("" if it had none), which
    /// `Nats-Expected-Last-Msg-Id` is compared with (nats-server's `lmsgId`).
    last_msg_id: String,
    down: bool,
    chaos: Chaos,
    /// (prefix `<inbox>.`, receiver): the inbox subscriptions of the relay's sessions.
    subs: Vec<(String, mpsc::UnboundedSender<async_nats::Message>)>,
    inboxes: u64,
    /// The era each session's inbox began in (see [`Stored::era`]).
    inbox_era: HashMap<String, u64>,
    /// The relay process each session's inbox belongs to ([`ProcessPort`]).
    inbox_process: HashMap<String, u64>,
    /// The relay process whose session last got the slot (0: none yet).
    holder: u64,
    /// Atomic batches being staged (`Nats-Batch-Id` → its messages so far, when the last came).
    batches: HashMap<String, (Vec<InTransit>, Instant)>,
    queue: VecDeque<InTransit>,
    /// When the last queued publish arrives: later ones arrive after it (TCP order).
    last_arrival: Instant,
    /// What the world did to the stream that the promises' checks may excuse a copy or an order
    /// by: never what the relay says about itself.
    facts: Facts,
    /// The stream configuration's `metadata` (where a backfill leaves its marker).
    metadata: serde_json::Map<String, serde_json::Value>,
}

/// Events of the simulated JetStream's world that `check.rs` excuses copies and orders by.
#[derive(Clone, Debug, Default)]
pub(crate) struct Facts {
    /// When the world gave the stream's tail a reason to be distrusted: a restore of Postgres, a
    /// message of another writer, a publish of an ended session stored late (the stream then
    /// holds a message the running session did not expect). Each begins a new era.
    pub distrust: Vec<Instant>,
    /// The `Nats-Msg-Id`s of publishes lost on the way with a connection (`go_down`), or refused
    /// by a full stream: sent, never stored.
    pub lost: std::collections::HashSet<String>,
    /// Each session (its inbox's number) got the slot: its relay process, and when.
    pub sessions: BTreeMap<u64, (u64, Instant)>,
}

pub(crate) struct JetStream {
    /// Itself, for the answer timers its `&self` methods spawn.
    me: Weak<JetStream>,
    state: Mutex<State>,
    arrived: Notify,
    dice: Dice,
    trace: Arc<Trace>,
}

impl JetStream {
    /// A JetStream with an empty stream; its server task runs on the current runtime.
    pub(crate) fn start(limits: Limits, dice: Dice, trace: Arc<Trace>) -> Arc<Self> {
        let js = Arc::new_cyclic(|me| JetStream {
            me: Weak::clone(me),
            state: Mutex::new(State {
                limits,
                retention: Retention::default(),
                messages: Vec::new(),
                ids: HashMap::new(),
                dedup: BTreeMap::new(),
                last_msg_id: String::new(),
                down: false,
                chaos: Chaos::default(),
                subs: Vec::new(),
                inboxes: 0,
                inbox_era: HashMap::new(),
                inbox_process: HashMap::new(),
                holder: 0,
                batches: HashMap::new(),
                queue: VecDeque::new(),
                last_arrival: Instant::now(),
                facts: Facts::default(),
                metadata: serde_json::Map::new(),
            }),
            arrived: Notify::new(),
            dice,
            trace,
        });
        tokio::spawn(Arc::clone(&js).serve());
        js
    }

    pub(crate) fn set_chaos(&self, chaos: Chaos) {
        self.state.lock().unwrap().chaos = chaos;
    }

    pub(crate) fn is_down(&self) -> bool {
        self.state.lock().unwrap().down
    }

    /// NATS goes down: the connection drops, and with it each publish still on its way (or not:
    /// the server may have read it already) and every answer not yet delivered.
    pub(crate) fn go_down(&self) {
        let mut s = self.state.lock().unwrap();
        s.down = true;
        // The connection's open batches are abandoned with it.
        s.batches.clear();
        let before = s.queue.len();
        let queue = std::mem::take(&mut s.queue);
        let (kept, lost): (VecDeque<InTransit>, VecDeque<InTransit>) =
            queue.into_iter().partition(|_| self.dice.chance(0.5));
        s.queue = kept;
        for m in lost {
            if let Some(id) = event_id(&m.headers) {
                s.facts.lost.insert(id);
            }
        }
        trace!(
            self.trace,
            "nats down ({} of {before} publishes in transit lost)",
            before - s.queue.len()
        );
    }

    /// A session of relay `process` got the slot (its walsender streams): from now on a publish
    /// of another process's session is another writer's.
    pub(crate) fn slot_held_by(&self, process: u64) {
        self.state.lock().unwrap().holder = process;
    }

    /// A publish of a session that no longer holds the slot (its process lost it to another,
    /// whose session stored in its place) was refused for the stream's last sequence or message
    /// id: that session ends finding the stream's tail unreliable, and its process trusts no tail
    /// until it stores anew (docs/guarantees.md, "Trusting no tail"). A reason the world gave to
    /// distrust the stream, like another writer's message (seed 475 with the standby mode: the
    /// process that lost the slot in a cut got it back 0.4 s later and published 400 events again,
    /// past a 487 ms duplicate window).
    fn refused_overtaken(&self, s: &mut State, reply: Option<&str>) {
        let process = reply
            .and_then(|r| r.rsplit_once('.'))
            .and_then(|(inbox, _)| s.inbox_process.get(inbox).copied());
        // Only a session still listening hears the refusal (a dead one's publishes landing late
        // are excused as such when stored).
        let listening = reply.is_some_and(|r| {
            s.subs.iter().any(|(prefix, tx)| {
                r.starts_with(prefix.as_str())
                    && !r[prefix.len()..].contains('.')
                    && !tx.is_closed()
            })
        });
        if let Some(p) = process.filter(|p| *p != s.holder && listening) {
            trace!(
                self.trace,
                "js refused a publish of relay process {p}, overtaken by process {}", s.holder
            );
            s.facts.distrust.push(Instant::now());
        }
    }

    pub(crate) fn come_up(&self) {
        self.state.lock().unwrap().down = false;
        trace!(self.trace, "nats up");
    }

    /// Whether the relay stored a message for this event id at `since` or later (an earlier
    /// one is another event's: an id made of an LSN that a restore reused).
    pub(crate) fn holds(&self, msg_id: &str, since: Instant) -> bool {
        self.state
            .lock()
            .unwrap()
            .ids
            .get(msg_id)
            .is_some_and(|at| *at >= since)
    }

    pub(crate) fn messages(&self) -> Vec<Stored> {
        self.state.lock().unwrap().messages.clone()
    }

    /// What happened to the stream that the checks may excuse copies and orders by.
    pub(crate) fn facts(&self) -> Facts {
        self.state.lock().unwrap().facts.clone()
    }

    /// The stream's retention limits from now on (`lift`: the operator raises `max_msgs` and
    /// `max_bytes` so that a stalled relay can go on; `max_age` stays).
    pub(crate) fn set_retention(&self, r: Retention) {
        self.state.lock().unwrap().retention = r;
    }

    /// The operator purges the stream: every message is gone, the sequences stay.
    pub(crate) fn purge(&self) {
        let mut s = self.state.lock().unwrap();
        let n = s.messages.iter().filter(|m| !m.gone).count();
        s.messages.iter_mut().for_each(|m| m.gone = true);
        s.facts.distrust.push(Instant::now());
        trace!(self.trace, "js purged ({n} messages)");
    }

    /// Removes the messages older than `max_age` (nats-server does it on a timer; here before
    /// anything reads or writes the stream). The tail, or messages a replay must read back, may
    /// go with them: a reason the world gives to distrust the stream.
    fn expire(&self, s: &mut State) {
        let Some(age) = s.retention.max_age else {
            return;
        };
        let now = Instant::now();
        let mut n = 0;
        for m in s.messages.iter_mut().filter(|m| !m.gone) {
            if now.duration_since(m.at) < age {
                break;
            }
            m.gone = true;
            n += 1;
        }
        if n > 0 {
            s.facts.distrust.push(now);
            trace!(self.trace, "js {n} messages aged out");
        }
    }

    /// Why a full stream (`discard: new`) refuses one more message of `size` bytes, if it does.
    fn full(s: &State, size: usize) -> Option<&'static str> {
        Self::full_for(s, 1, size)
    }

    /// Why a full stream refuses `n` more messages of `size` bytes in all, if it does.
    fn full_for(s: &State, n: usize, size: usize) -> Option<&'static str> {
        if s.retention.max_msgs.is_none() && s.retention.max_bytes.is_none() {
            return None;
        }
        let live = s.messages.iter().filter(|m| !m.gone);
        let (msgs, bytes) = live.fold((0, 0), |(n, b), m| {
            (
                n + 1,
                b + wire_size(&m.headers, m.payload.len()) + m.subject.len(),
            )
        });
        if s.retention.max_msgs.is_some_and(|max| msgs + n > max) {
            Some("maximum messages exceeded")
        } else if s.retention.max_bytes.is_some_and(|max| bytes + size > max) {
            Some("maximum bytes exceeded")
        } else {
            None
        }
    }

    /// The world gave the stream's tail a reason to be distrusted (a restore of Postgres): a new
    /// era begins.
    pub(crate) fn distrusted(&self) {
        self.state
            .lock()
            .unwrap()
            .facts
            .distrust
            .push(Instant::now());
    }

    /// A message published by hand at the stream's tail. `copy` repeats the last message's
    /// headers (an operator re-sending it, with a new id); otherwise it claims a position far
    /// beyond the WAL and names no history, or names the history of the last message with a
    /// position it never had.
    pub(crate) fn publish_foreign(&self, n: u64) {
        let mut s = self.state.lock().unwrap();
        // The last message's headers, less its expectation (a hand publish carries none).
        let last = s.messages.last().map(|m| {
            let mut h = HeaderMap::new();
            for (name, values) in m.headers.iter() {
                let name_str: &str = name.as_ref();
                if name_str != EXPECTED_LAST_SEQUENCE && name_str != EXPECTED_LAST_MSG_ID {
                    for v in values {
                        h.append(name.clone(), v.clone());
                    }
                }
            }
            h
        });
        let mut headers = HeaderMap::new();
        let kind = self.dice.range(0, 3);
        match (kind, last) {
            (0, Some(last)) => {
                headers = last;
                headers.insert(NATS_MSG_ID, format!("manual-{n}").as_str());
            }
            (1, Some(last)) => {
                headers = last;
                headers.insert(NATS_MSG_ID, format!("manual-{n}").as_str());
                let far = 0xFFu64 << 32;
                headers.insert(
                    "Outbox-Position",
                    format!("{}:0", outbox_relay::Lsn(far)).as_str(),
                );
            }
            _ => {
                headers.insert(NATS_MSG_ID, format!("manual-{n}").as_str());
                headers.insert("Outbox-Commit-Lsn", "FF/0");
                headers.insert("Outbox-Position", "FF/0:0");
            }
        }
        let seq = s.messages.len() as u64 + 1;
        let now = Instant::now();
        s.last_msg_id = headers
            .get(NATS_MSG_ID)
            .map_or_else(String::new, |v| v.as_str().to_owned());
        s.facts.distrust.push(now);
        let era = s.facts.distrust.len() as u64;
        s.messages.push(Stored {
            seq,
            subject: "outbox.manual".into(),
            headers,
            payload: Bytes::from_static(b"{}"),
            at: now,
            foreign: true,
            era,
            session: 0,
            late: false,
            gone: false,
        });
        trace!(self.trace, "js foreign message at seq {seq} (kind {kind})");
    }

    /// The server: takes the publishes off the queue in order, each when it arrives.
    async fn serve(self: Arc<Self>) {
        loop {
            let next = {
                let mut s = self.state.lock().unwrap();
                match s.queue.front() {
                    Some(m) if m.arrives <= Instant::now() => s.queue.pop_front().map(Ok),
                    Some(m) => Some(Err(m.arrives)),
                    None => None,
                }
            };
            match next {
                Some(Ok(m)) => self.process(m),
                Some(Err(at)) => {
                    tokio::select! {
                        biased;
                        _ = self.arrived.notified() => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => self.arrived.notified().await,
            }
        }
    }

    /// One publish at the server: checked and stored as nats-server does, then answered.
    fn process(&self, m: InTransit) {
        let mut s = self.state.lock().unwrap();
        self.expire(&mut s);
        let now = Instant::now();
        let id = m.headers.get(NATS_MSG_ID).map(|v| v.as_str().to_owned());
        let short = short(id.as_deref());
        // The stream of a park world stores `<dead letter subject>.parked.>` too (`setup` adds it).
        let covered = m.subject.starts_with("outbox.")
            || m.subject == DEAD_LETTER_SUBJECT
            || m.subject
                .strip_prefix(DEAD_LETTER_SUBJECT)
                .is_some_and(|rest| rest.starts_with(".parked."));
        let last = s.messages.len() as u64;
        let answer: Result<String, StatusCode> = if m.headers.get(NATS_BATCH_ID).is_some() {
            match self.batch(&mut s, m) {
                Some((answer, reply, headers, commit)) => {
                    drop(s);
                    return self.answer(reply, headers, answer, Some(commit));
                }
                None => return,
            }
        } else if !covered {
            Err(StatusCode::NO_RESPONDERS)
        } else if let Some((seq, _)) = id
            .as_ref()
            .and_then(|id| s.dedup.get(id))
            .filter(|(_, at)| now.duration_since(*at) < s.limits.duplicate_window)
        {
            // The duplicate window comes first, as in nats-server's processJetStreamMsg.
            trace!(self.trace, "js dup {short} of seq {seq}");
            Ok(format!(
                r#"{{"stream":"{STREAM}","seq":{seq},"duplicate":true}}"#
            ))
        } else if let Some(expected) = m
            .headers
            .get(EXPECTED_LAST_SEQUENCE)
            .and_then(|v| v.as_str().parse::<u64>().ok())
            .filter(|e| *e != last)
        {
            trace!(
                self.trace,
                "js refused {short}: expected {expected}, last {last}"
            );
            self.refused_overtaken(&mut s, m.reply.as_deref());
            Ok(format!(
                r#"{{"error":{{"code":400,"err_code":10071,"description":"wrong last sequence: {last}"}}}}"#
            ))
        } else if let Some(expected) = m
            .headers
            .get(EXPECTED_LAST_MSG_ID)
            .map(|v| v.as_str())
            .filter(|e| !e.is_empty() && *e != s.last_msg_id)
        {
            trace!(
                self.trace,
                "js refused {short}: expected last id {}, last {}",
                short_id(expected),
                short_id(&s.last_msg_id)
            );
            self.refused_overtaken(&mut s, m.reply.as_deref());
            Ok(format!(
                r#"{{"error":{{"code":400,"err_code":10070,"description":"wrong last msg ID: {}"}}}}"#,
                s.last_msg_id
            ))
        } else if s
            .limits
            .max_msg_size
            .is_some_and(|max| wire_size(&m.headers, m.payload.len()) > max)
        {
            trace!(self.trace, "js refused {short}: over max_msg_size");
            Ok(r#"{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}}"#.to_owned())
        } else if let Some(why) =
            Self::full(&s, wire_size(&m.headers, m.payload.len()) + m.subject.len())
        {
            trace!(self.trace, "js refused {short}: {why}");
            // Not stored: as good as lost on the way, for what the checks excuse.
            if let Some(id) = event_id(&m.headers) {
                s.facts.lost.insert(id);
            }
            Ok(format!(
                r#"{{"error":{{"code":503,"err_code":10077,"description":"{why}"}}}}"#
            ))
        } else {
            let seq = self.store(&mut s, &m, m.reply.as_deref());
            Ok(format!(r#"{{"stream":"{STREAM}","seq":{seq}}}"#))
        };
        let reply = m.reply;
        drop(s);
        self.answer(reply, m.headers, answer, None);
    }

    /// A message of an atomic batch (ADR-50, as nats-server 2.12+ handles it): staged until the
    /// one with `Nats-Batch-Commit`, then checked and stored whole or not at all. A batch whose
    /// `Nats-Batch-Sequence` skips one (a member lost with a connection) or that was idle for 10 s
    /// is abandoned: its commit is refused as incomplete. `Nats-Expected-Last-Sequence` counts only
    /// on the first message; the commit's answer names the batch's last sequence. Returns the
    /// commit's answer, with its reply subject, headers and what a forger would know of the batch;
    /// `None` for a member (no answer).
    #[allow(clippy::type_complexity)]
    fn batch(
        &self,
        s: &mut State,
        m: InTransit,
    ) -> Option<(
        Result<String, StatusCode>,
        Option<String>,
        HeaderMap,
        Commit,
    )> {
        let now = Instant::now();
        let id = m.headers.get(NATS_BATCH_ID)?.as_str().to_owned();
        s.batches
            .retain(|_, (_, at)| now.duration_since(*at) < Duration::from_secs(10));
        let place: Option<usize> = m
            .headers
            .get(NATS_BATCH_SEQUENCE)
            .and_then(|v| v.as_str().parse().ok());
        let commit = m.headers.get(NATS_BATCH_COMMIT).is_some();
        let (reply, headers) = (m.reply.clone(), m.headers.clone());
        let refuse = |code: u16, err: u32, what: &str| {
            Ok(format!(
                r#"{{"error":{{"code":{code},"err_code":{err},"description":"{what}"}}}}"#
            ))
        };
        let staged = s
            .batches
            .entry(id.clone())
            .or_insert_with(|| (Vec::new(), now));
        staged.1 = now;
        if place != Some(staged.0.len() + 1) || staged.0.len() >= 1000 {
            s.batches.remove(&id);
            trace!(self.trace, "js batch abandoned (gap or too large)");
            // What the forger saw of the batch: the place the commit claimed, and no expectation
            // (the first message's, which carried it, may be the one lost).
            let known = Commit {
                id: id.clone(),
                count: place.unwrap_or(1),
                expected: None,
            };
            return commit.then(|| {
                (
                    refuse(400, 10176, "atomic publish batch is incomplete"),
                    reply,
                    headers,
                    known,
                )
            });
        }
        staged.0.push(m);
        if !commit {
            return None;
        }
        let (msgs, _) = s.batches.remove(&id)?;
        let last = s.messages.len() as u64;
        let expected = msgs[0]
            .headers
            .get(EXPECTED_LAST_SEQUENCE)
            .and_then(|v| v.as_str().parse::<u64>().ok());
        let known = Commit {
            id: id.clone(),
            count: msgs.len(),
            expected,
        };
        let size: usize = msgs
            .iter()
            .map(|m| wire_size(&m.headers, m.payload.len()) + m.subject.len())
            .sum();
        let answer = if let Some(e) = expected.filter(|e| *e != last) {
            trace!(self.trace, "js refused batch: expected {e}, last {last}");
            self.refused_overtaken(s, reply.as_deref());
            refuse(400, 10071, &format!("wrong last sequence: {last}"))
        } else if msgs.iter().any(|m| {
            s.limits
                .max_msg_size
                .is_some_and(|max| wire_size(&m.headers, m.payload.len()) > max)
        }) {
            trace!(self.trace, "js refused batch: a message over max_msg_size");
            refuse(400, 10054, "message size exceeds maximum allowed")
        } else if let Some(why) = Self::full_for(s, msgs.len(), size) {
            trace!(self.trace, "js refused batch: {why}");
            refuse(503, 10077, why)
        } else {
            let mut seq = last;
            for m in &msgs {
                seq = self.store(s, m, reply.as_deref());
            }
            trace!(self.trace, "js committed batch: {} messages", msgs.len());
            Ok(format!(
                r#"{{"stream":"{STREAM}","seq":{seq},"batch":"{id}","count":{}}}"#,
                msgs.len()
            ))
        };
        Some((answer, reply, headers, known))
    }

    /// Stores `m` at the stream's next sequence (its session named by `reply`, the reply subject
    /// of the publish, or of its batch's commit).
    fn store(&self, s: &mut State, m: &InTransit, reply: Option<&str>) -> u64 {
        let now = Instant::now();
        let seq = s.messages.len() as u64 + 1;
        let id = m.headers.get(NATS_MSG_ID).map(|v| v.as_str().to_owned());
        let short = short(id.as_deref());
        if let Some(id) = &id {
            s.dedup.insert(id.clone(), (seq, now));
        }
        // What P2 asks about: the event id, `Outbox-Event-Id` on a batch message, a dead letter
        // or a parked copy (their `Nats-Msg-Id` is their own), else `Nats-Msg-Id`.
        if let Some(event) = m
            .headers
            .get("Outbox-Event-Id")
            .map(|v| v.as_str().to_owned())
            .or_else(|| id.clone())
        {
            s.ids.insert(event, now);
        }
        s.last_msg_id = id.clone().unwrap_or_default();
        let ended = reply.is_some_and(|r| {
            !s.subs.iter().any(|(prefix, tx)| {
                r.starts_with(prefix.as_str())
                    && !r[prefix.len()..].contains('.')
                    && !tx.is_closed()
            })
        });
        let inbox = reply.and_then(|r| r.rsplit_once('.'));
        let era = inbox
            .and_then(|(inbox, _)| s.inbox_era.get(inbox).copied())
            .unwrap_or(s.facts.distrust.len() as u64);
        let session = inbox
            .and_then(|(inbox, _)| inbox.strip_prefix("_INBOX.sim"))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        if ended {
            trace!(self.trace, "js stores a publish of an ended session");
            s.facts.distrust.push(now);
        }
        let after = m
            .headers
            .get(EXPECTED_LAST_MSG_ID)
            .map(|v| format!(" after {}", short_id(v.as_str())))
            .unwrap_or_default();
        trace!(
            self.trace,
            "js stored {short} at seq {seq} on {}{after} (session {session})", m.subject
        );
        s.messages.push(Stored {
            seq,
            subject: m.subject.clone(),
            headers: m.headers.clone(),
            payload: m.payload.clone(),
            at: now,
            foreign: false,
            era,
            session,
            late: ended,
            gone: false,
        });
        seq
    }

    /// Sends `answer` to `reply` (if the publish had one), through the answer faults.
    fn answer(
        &self,
        reply: Option<String>,
        headers: HeaderMap,
        answer: Result<String, StatusCode>,
        commit: Option<Commit>,
    ) {
        let Some(reply) = reply else {
            return;
        };
        let short = short(headers.get(NATS_MSG_ID).map(|v| v.as_str()));
        let s = self.state.lock().unwrap();
        let chaos = s.chaos;
        // A refusal is what a planted "stored" behind JetStream's answer would hide: such answers
        // are planted for refusals far more often than for other publishes.
        let refused = answer
            .as_ref()
            .is_ok_and(|text| text.contains(r#""error""#));
        // A commit settles a whole batch, and there is one per transaction: planted five times
        // as often as an answer to a single publish, or a run would see a handful.
        let rate = if commit.is_some() {
            (chaos.forged * 5.0).min(1.0)
        } else {
            chaos.forged
        };
        let forged = if self.dice.chance(rate) {
            Some(match &commit {
                // Half of the answers planted for a commit take a batch's own forms.
                Some(c) if self.dice.chance(0.5) => self.commit_forgery(&s, c),
                _ => self.forgery(&s, &headers),
            })
        } else if refused && self.dice.chance((chaos.forged * 10.0).min(1.0)) {
            let text = match &commit {
                Some(c) => perfect_batch_ack(&s, c),
                None => perfect_ack(&s, &headers),
            };
            trace!(self.trace, "js forged answer {text} (After the refusal)");
            Some((text, Plant::After))
        } else {
            None
        };
        drop(s);
        let lost = self.dice.chance(chaos.lost);
        let copies = if self.dice.chance(chaos.duplicated) {
            2
        } else {
            1
        };
        let mut last = Duration::ZERO;
        for _ in 0..copies {
            let delay = if self.dice.chance(chaos.late) {
                self.dice.millis(2_500, 6_000)
            } else if self.dice.chance(chaos.slow) {
                self.dice.millis(50, 1_500)
            } else {
                self.dice.millis(0, 5)
            };
            last = last.max(delay);
            if !lost {
                self.deliver_later(reply.clone(), answer.clone(), delay);
            }
        }
        if lost {
            trace!(self.trace, "js answer to {short} lost");
        }
        match forged {
            Some((text, Plant::Before)) => {
                self.deliver_later(reply, Ok(text), self.dice.millis(0, 2));
            }
            // Right behind JetStream's own answer (or where it would have been).
            Some((text, Plant::After)) => {
                self.deliver_later(reply, Ok(text), last + self.dice.millis(0, 3));
            }
            None => {}
        }
    }

    /// An answer another client could plant, and when: one the relay is documented to refuse
    /// (no stream, another stream, no sequence, a sequence other than the one the fence expects, a
    /// duplicate of a message holding another id, a duplicate of a sequence the stream never
    /// reached), planted before JetStream's answer; or an ack in exactly the sequence expected,
    /// planted right behind JetStream's answer, which the relay must not take in place of that
    /// answer (a refusal, say). Planted before JetStream's, an answer naming the stream and
    /// exactly the expected sequence cannot be told from JetStream's, by anyone: it is not
    /// planted. An answer to an atomic batch's commit gets these forms or, half of the time, a
    /// batch's own ([`JetStream::commit_forgery`]).
    fn forgery(&self, s: &State, headers: &HeaderMap) -> (String, Plant) {
        let last = s.messages.len() as u64;
        let expected = headers
            .get(EXPECTED_LAST_SEQUENCE)
            .and_then(|v| v.as_str().parse::<u64>().ok());
        let mut when = Plant::Before;
        let text = match self.dice.range(0, 7) {
            0 => "{}".to_owned(),
            1 => format!(r#"{{"stream":"{STREAM}","seq":0}}"#),
            2 => format!(r#"{{"stream":"ORDERS","seq":{}}}"#, last + 1),
            5 => {
                let seq = last + self.dice.range(1, 1_000_000_000);
                format!(r#"{{"stream":"{STREAM}","seq":{seq},"duplicate":true}}"#)
            }
            6 => {
                when = Plant::After;
                perfect_ack(s, headers)
            }
            3 => {
                let mut seq = last + self.dice.range(1, 4);
                if expected.is_some_and(|e| e + 1 == seq) {
                    seq += 7;
                }
                format!(r#"{{"stream":"{STREAM}","seq":{seq}}}"#)
            }
            _ => {
                let id = headers.get(NATS_MSG_ID).map(|v| v.as_str());
                match s
                    .messages
                    .iter()
                    .rev()
                    .find(|m| m.msg_id().is_some() && m.msg_id() != id)
                {
                    Some(other) => format!(
                        r#"{{"stream":"{STREAM}","seq":{},"duplicate":true}}"#,
                        other.seq
                    ),
                    None => "{}".to_owned(),
                }
            }
        };
        trace!(
            self.trace,
            "js forged answer {text} ({when:?} the real one)"
        );
        (text, when)
    }

    /// An answer another client could plant for an atomic batch's commit, and when: a duplicate
    /// (a batch carries no `Nats-Msg-Id`, so JetStream never says it) of the sequence the batch
    /// would end at, or of the stream's last; an ack of exactly the batch's form (stream, the
    /// sequence the batch would end at, its id and count) right behind JetStream's answer (a
    /// refusal, say, or where a lost answer would have been); the same ack with a wrong count,
    /// before or behind JetStream's; an ack of fewer messages than the batch holds, ending where
    /// that smaller batch would. Before JetStream's, an ack naming the batch's last sequence is
    /// only planted with a count that betrays it: with the right count no one could tell it
    /// from JetStream's own. Whatever the relay makes of any of them, it may confirm only what
    /// the stream holds (P2).
    fn commit_forgery(&self, s: &State, c: &Commit) -> (String, Plant) {
        let base = c.expected.unwrap_or(s.messages.len() as u64);
        let n = c.count as u64;
        let id = &c.id;
        let (text, when) = match self.dice.range(0, 5) {
            0 => (
                format!(
                    r#"{{"stream":"{STREAM}","seq":{},"duplicate":true}}"#,
                    base + n
                ),
                Plant::Before,
            ),
            1 => (
                format!(
                    r#"{{"stream":"{STREAM}","seq":{},"duplicate":true}}"#,
                    s.messages.len().max(1)
                ),
                Plant::Before,
            ),
            2 => (perfect_batch_ack(s, c), Plant::After),
            3 => {
                let wrong = if n > 1 && self.dice.chance(0.5) {
                    n - self.dice.range(1, n)
                } else {
                    n + self.dice.range(1, 5)
                };
                let when = if self.dice.chance(0.5) {
                    Plant::Before
                } else {
                    Plant::After
                };
                (
                    format!(
                        r#"{{"stream":"{STREAM}","seq":{},"batch":"{id}","count":{wrong}}}"#,
                        base + n
                    ),
                    when,
                )
            }
            _ if n < 2 => (
                format!(
                    r#"{{"stream":"{STREAM}","seq":{},"duplicate":true}}"#,
                    base + n
                ),
                Plant::Before,
            ),
            _ => {
                let fewer = self.dice.range(1, n);
                (
                    format!(
                        r#"{{"stream":"{STREAM}","seq":{},"batch":"{id}","count":{fewer}}}"#,
                        base + fewer
                    ),
                    Plant::Before,
                )
            }
        };
        trace!(
            self.trace,
            "js forged commit answer {text} ({when:?} the real one)"
        );
        (text, when)
    }

    /// Sends `answer` to `reply` after `delay`. The subscriptions are looked up on arrival: a
    /// session gone by then gets nothing.
    fn deliver_later(&self, reply: String, answer: Result<String, StatusCode>, delay: Duration) {
        let me = Weak::clone(&self.me);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if let Some(me) = me.upgrade() {
                me.deliver(reply, answer);
            }
        });
    }

    fn deliver(&self, reply: String, answer: Result<String, StatusCode>) {
        let mut s = self.state.lock().unwrap();
        if s.down {
            return;
        }
        let (payload, status) = match answer {
            Ok(text) => (Bytes::from(text), None),
            Err(status) => (Bytes::new(), Some(status)),
        };
        let msg = async_nats::Message {
            subject: reply.as_str().into(),
            reply: None,
            length: payload.len(),
            payload,
            headers: None,
            status,
            description: None,
        };
        s.subs.retain(|(prefix, tx)| {
            if reply.starts_with(prefix.as_str()) && !reply[prefix.len()..].contains('.') {
                tx.send(msg.clone()).is_ok()
            } else {
                !tx.is_closed()
            }
        });
    }
}

/// An ack no one can tell from JetStream's for the publish with `headers`: the stream, and the
/// sequence after the one it expected (or after the last, unfenced).
fn perfect_ack(s: &State, headers: &HeaderMap) -> String {
    let seq = headers
        .get(EXPECTED_LAST_SEQUENCE)
        .and_then(|v| v.as_str().parse::<u64>().ok())
        .map_or(s.messages.len() as u64 + 1, |e| e + 1);
    format!(r#"{{"stream":"{STREAM}","seq":{seq}}}"#)
}

/// A batch's commit ack no one can tell from JetStream's: the stream, the sequence the batch would
/// end at (its count after the one its first message expected, or after the last), its id and count.
fn perfect_batch_ack(s: &State, c: &Commit) -> String {
    let seq = c.expected.unwrap_or(s.messages.len() as u64) + c.count as u64;
    format!(
        r#"{{"stream":"{STREAM}","seq":{seq},"batch":"{}","count":{}}}"#,
        c.id, c.count
    )
}

/// An id for the trace: a uuid's first group, an LSN-made id whole.
fn short(id: Option<&str>) -> String {
    match id {
        Some(id) if id.starts_with("lsn:") => id.to_owned(),
        Some(id) => id.get(..8).unwrap_or(id).to_owned(),
        None => "-".to_owned(),
    }
}

/// [`short`] of an id that may be empty (a last message without one).
fn short_id(id: &str) -> String {
    if id.is_empty() {
        "\"\"".to_owned()
    } else {
        short(Some(id))
    }
}

/// A message's size as nats-server and the client count it against `max_payload` and
/// `max_msg_size`: the header block and the payload.
fn wire_size(h: &HeaderMap, payload: usize) -> usize {
    let mut n = "NATS/1.0\r\n\r\n".len() + payload;
    for (k, vs) in h.iter() {
        for v in vs {
            n += AsRef::<[u8]>::as_ref(k).len() + 2 + v.as_str().len() + 2;
        }
    }
    n
}

/// A request to a server that is down: no answer in time, as the real client reports it.
fn down() -> NatsError {
    NatsError::new(
        NatsErrorKind::TimedOut,
        "no answer from JetStream (NATS down)",
    )
}

/// A request about a stream the server does not have.
fn no_stream(stream: &str) -> NatsError {
    NatsError::new(
        NatsErrorKind::NotFound,
        format!("stream {stream} not found"),
    )
}

/// Why the simulated client could not send a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SendError {
    /// Over the server's `max_payload` (the real client refuses it before sending).
    #[error("payload exceeds the server's max_payload")]
    MaxPayloadExceeded,
    /// The connection is down.
    #[error("not connected")]
    Disconnected,
}

/// The client's side of the server: what a relay process's port (`port.rs`) asks of it, answered
/// at once.
impl JetStream {
    /// A new inbox, marked as `process`'s.
    pub(crate) fn inbox(&self, process: u64) -> String {
        let mut s = self.state.lock().unwrap();
        s.inboxes += 1;
        let inbox = format!("_INBOX.sim{}", s.inboxes);
        let era = s.facts.distrust.len() as u64;
        s.inbox_era.insert(inbox.clone(), era);
        s.inbox_process.insert(inbox.clone(), process);
        let n = s.inboxes;
        s.facts.sessions.insert(n, (process, Instant::now()));
        inbox
    }

    /// Messages published to `subject` (a wildcard like `<inbox>.*`): JetStream's answers.
    pub(crate) fn subscribe(
        &self,
        subject: String,
    ) -> mpsc::UnboundedReceiver<async_nats::Message> {
        let (tx, rx) = mpsc::unbounded_channel();
        let prefix = subject.strip_suffix('*').unwrap_or(&subject).to_owned();
        self.state.lock().unwrap().subs.push((prefix, tx));
        rx
    }

    /// A publish as the client sends it: `reply` is set for publishes that await JetStream's
    /// answer, `None` for core publishes (atomic batch members). It reaches the server after its
    /// transit delay, behind every publish sent before it.
    pub(crate) fn publish(
        &self,
        subject: String,
        reply: Option<String>,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<(), SendError> {
        let mut s = self.state.lock().unwrap();
        if s.down {
            return Err(SendError::Disconnected);
        }
        if wire_size(&headers, payload.len()) > s.limits.max_payload {
            return Err(SendError::MaxPayloadExceeded);
        }
        let transit = if self.dice.chance(s.chaos.transit) {
            self.dice.millis(20, 400)
        } else {
            self.dice.millis(0, 3)
        };
        let arrives = (Instant::now() + transit).max(s.last_arrival);
        s.last_arrival = arrives;
        s.queue.push_back(InTransit {
            arrives,
            subject,
            reply,
            headers,
            payload,
        });
        drop(s);
        self.arrived.notify_one();
        Ok(())
    }

    /// A JetStream API request: `STREAM.INFO.<stream>` answers the configuration (its name and
    /// `metadata`), `STREAM.UPDATE.<stream>` takes the `metadata` of the configuration sent; the
    /// rest of a configuration is not modelled. No answer while NATS is down.
    pub(crate) fn api(
        &self,
        subject: &str,
        body: serde_json::Value,
    ) -> Result<serde_json::Value, NatsError> {
        let mut s = self.state.lock().unwrap();
        if s.down {
            return Err(NatsError::new(
                NatsErrorKind::NoResponders,
                "simulated outage",
            ));
        }
        let config = |m: &serde_json::Map<String, serde_json::Value>| serde_json::json!({"config": {"name": STREAM, "metadata": m}});
        if subject == format!("STREAM.INFO.{STREAM}") {
            return Ok(config(&s.metadata));
        }
        if subject == format!("STREAM.UPDATE.{STREAM}") {
            let metadata = body
                .get("metadata")
                .and_then(|m| m.as_object())
                .cloned()
                .unwrap_or_default();
            let before = s.metadata.contains_key(BACKFILL_MARKER);
            let after = metadata.contains_key(BACKFILL_MARKER);
            s.metadata = metadata;
            if before != after {
                trace!(
                    self.trace,
                    "js backfill marker {}",
                    if after { "set" } else { "cleared" }
                );
            }
            return Ok(config(&s.metadata));
        }
        Ok(
            serde_json::json!({"error": {"code": 404, "err_code": 10059, "description": "stream not found"}}),
        )
    }

    /// Whether a backfill marker stands on the stream (what `run` must refuse to stream under).
    pub(crate) fn backfill_marked(&self) -> bool {
        self.state
            .lock()
            .unwrap()
            .metadata
            .contains_key(BACKFILL_MARKER)
    }

    /// The server's `max_payload`.
    pub(crate) fn max_payload(&self) -> usize {
        self.state.lock().unwrap().limits.max_payload
    }

    /// The stream's last sequence and `max_msg_size`, or why they cannot be read.
    pub(crate) fn stream_state(&self, stream: &str) -> Result<(u64, Option<usize>), NatsError> {
        let mut s = self.state.lock().unwrap();
        self.expire(&mut s);
        if s.down {
            return Err(down());
        }
        if stream != STREAM {
            return Err(no_stream(stream));
        }
        Ok((s.messages.len() as u64, s.limits.max_msg_size))
    }

    /// The headers of the stream's message `seq` (`None` if it is gone).
    pub(crate) fn message_headers(
        &self,
        stream: &str,
        seq: u64,
    ) -> Result<Option<HeaderMap>, NatsError> {
        let mut s = self.state.lock().unwrap();
        self.expire(&mut s);
        if s.down {
            return Err(down());
        }
        if stream != STREAM {
            return Err(no_stream(stream));
        }
        Ok(seq
            .checked_sub(1)
            .and_then(|i| s.messages.get(i as usize))
            .filter(|m| !m.gone)
            .map(|m| m.headers.clone()))
    }

    /// The stream's messages with sequences `from..=to` that are still there, in order, at most
    /// `max` of them (a gone message is left out, as a consumer skips it).
    pub(crate) fn headers_from(
        &self,
        stream: &str,
        from: u64,
        to: u64,
        max: usize,
    ) -> Result<Vec<(u64, HeaderMap)>, NatsError> {
        let s = self.state.lock().unwrap();
        if s.down {
            return Err(down());
        }
        if stream != STREAM {
            return Err(no_stream(stream));
        }
        // Sorted by sequence: start at the first one at or after `from`.
        let start = s.messages.partition_point(|m| m.seq < from);
        Ok(s.messages[start..]
            .iter()
            .take_while(|m| m.seq <= to)
            .take(max)
            .map(|m| (m.seq, m.headers.clone()))
            .collect())
    }
    /// The stream's messages still there on subjects `filter` matches (a subject, or `prefix.>`)
    /// from sequence `from` on, at most `max`; with `last`, only the last message of each subject
    /// (then from the start, whole). Payloads only with `payloads`.
    pub(crate) fn on_subjects(
        &self,
        stream: &str,
        filter: &str,
        from: u64,
        max: usize,
        last: bool,
        payloads: bool,
    ) -> Result<Vec<StoredMessage>, NatsError> {
        let s = self.state.lock().unwrap();
        if s.down {
            return Err(down());
        }
        if stream != STREAM {
            return Err(no_stream(stream));
        }
        let matches = |subject: &str| match filter.strip_suffix(">") {
            Some(prefix) => subject.starts_with(prefix) && subject.len() > prefix.len(),
            None => subject == filter,
        };
        let start = s.messages.partition_point(|m| m.seq < from);
        let hits = s.messages[start..]
            .iter()
            .filter(|m| !m.gone && matches(&m.subject));
        let shown = |m: &Stored| StoredMessage {
            seq: m.seq,
            subject: m.subject.clone(),
            headers: m.headers.clone(),
            payload: if payloads {
                m.payload.clone()
            } else {
                Bytes::new()
            },
        };
        if !last {
            return Ok(hits.take(max).map(shown).collect());
        }
        let mut lasts: BTreeMap<&str, &Stored> = BTreeMap::new();
        for m in hits {
            lasts.insert(&m.subject, m);
        }
        let mut out: Vec<StoredMessage> = lasts.into_values().map(shown).collect();
        out.sort_by_key(|m| m.seq);
        Ok(out)
    }
}
