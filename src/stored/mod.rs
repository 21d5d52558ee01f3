//! Read-your-writes: how far the relay's events are stored, and waits for a writer's LSN
//! ([`Positions`]), served over NATS ([`service`], the NATS services API) and HTTP (`/position`,
//! `/wait` in `http.rs`).
//!
//! The stored LSN is the progress tracker's: every event of every transaction whose commit ends at
//! or before it is acknowledged by JetStream, in order, and while idle it moves with the
//! walsender's keepalives. It can be ahead of the LSN confirmed to the slot (the status update that
//! reports it goes out a few milliseconds later). A writer takes `SELECT pg_current_wal_lsn()` after
//! its COMMIT returned; once the stored LSN reaches it, its events are in the stream.
//!
//! The session must not be slowed by waiters: it only publishes a new stored LSN into a watch
//! channel ([`Positions::advance`], a lock and a wake-up per burst of acks). One task
//! ([`WaitTask::run`]) owns every open wait in a [`waitset::WaitSet`] ordered by LSN and by
//! deadline, answers the ones an advance satisfies and sleeps once, until the earliest deadline,
//! however many waits are open.
//!
//! Only a relay whose session streams the slot serves: a standby answers nothing (HTTP 503, no NATS
//! service) until it takes over. An HTTP wait that is open when a session ends stays open: the next
//! session may store its events, or it times out; the NATS service answers its open waits with an
//! error that says to ask again (see `service.rs`). Nothing is lost either way; a timeout only says
//! "not yet".

mod discovery;
pub(crate) mod probe;
mod replies;
pub(crate) mod service;
mod streams;
pub(crate) mod waitset;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Map, Value};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::Lsn;
use waitset::WaitSet;

/// The longest wait a request may ask for. An HTTP wait holds one of the listener's few
/// connections for that long, and a client that needs longer asks again: the answer carries the
/// stored LSN, so it sees progress.
pub(crate) const MAX_WAIT_MS: u64 = 30_000;
/// The largest request body the service and `/wait` read: a wait needs some 50 bytes, and a wait
/// open for its timeout must not hold a large request's memory.
pub(crate) const MAX_REQUEST_BYTES: usize = 512;
/// A wait without `timeout_ms` waits this long.
pub(crate) const DEFAULT_WAIT_MS: u64 = 5_000;
/// Open waits at most, whatever they hold. Each costs [`WAIT_ENTRY_BYTES`] here plus what its caller
/// keeps (a NATS wait: its reply subject and its place in the service's set; a few hundred bytes in
/// all), so [`MAX_WAIT_BYTES`] is the bound that holds first; this one only keeps the ordered sets
/// small when the callers keep next to nothing.
const MAX_WAITERS: usize = 65_536;
/// The bytes all open waits may hold together, NATS and HTTP: each is charged what it keeps
/// ([`WAIT_ENTRY_BYTES`] and what its caller says it holds) until it is answered, and a wait that
/// would go beyond is answered "too many open waits" at once (NATS: a 503 service error; HTTP: 503).
/// Round 5 measured 1.9 KB of resident memory a wait with 1 KB reply subjects and no such bound.
pub(crate) const MAX_WAIT_BYTES: usize = 16 << 20;
/// What one open wait costs in the wait task: its entries in the two ordered sets and the map
/// ([`WaitSet`]) and its answer channel, with the allocator's rounding. The callers' share is
/// theirs to say (`held`); `service.rs` says how the sum was measured.
const WAIT_ENTRY_BYTES: usize = 256;

/// What the session last published.
#[derive(Clone, Debug, Default)]
struct State {
    /// The stored LSN (see the module docs). Never moves backwards within one session; each
    /// session starts it at the slot's position.
    stored: Lsn,
    /// The stream sequence of the last message the relay stored (0 before the first).
    last_sequence: u64,
    /// While a session streams the slot: the flush LSN its last status update reported to the slot.
    serving: Option<Arc<AtomicU64>>,
    /// The slot's `confirmed_flush_lsn` when the session started: confirmed already, before the
    /// session's first status update reports anything.
    slot_start: Lsn,
    /// The server's WAL position as the relay's slot sampler last read it, and when: a wait for
    /// an LSN past it, begun before that reading, waits for WAL that did not exist.
    wal_end: Option<(Instant, Lsn)>,
}

/// The shared handle: the session writes, the NATS service and the HTTP listener read and wait.
#[derive(Debug)]
pub(crate) struct Positions {
    slot: String,
    stream: String,
    state: watch::Sender<State>,
    waits: mpsc::Sender<Waiter>,
}

/// The task that answers waits; see [`WaitTask::run`].
pub(crate) struct WaitTask {
    state: watch::Receiver<State>,
    waits: mpsc::Receiver<Waiter>,
}

/// A registered wait, answered once.
#[derive(Debug)]
struct Waiter {
    lsn: Lsn,
    /// When it was asked for: a WAL position read after it says whether `lsn` existed then.
    since: Instant,
    deadline: Instant,
    answer: oneshot::Sender<WaitOutcome>,
    /// What its caller keeps while it waits, in bytes ([`Positions::wait`]).
    held: usize,
}

/// The answer to `/position` and `<prefix>.position`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Position {
    /// `postgres.slot`.
    pub(crate) slot: String,
    /// `nats.stream`.
    pub(crate) stream: String,
    /// See the module docs.
    pub(crate) stored_lsn: Lsn,
    /// The LSN the relay's last status update confirmed to the slot.
    pub(crate) confirmed_lsn: Lsn,
    /// The stream sequence of the last message the relay stored.
    pub(crate) last_sequence: u64,
}

impl Position {
    /// The JSON of the reply.
    pub(crate) fn to_json(&self) -> String {
        serde_json::json!({
            "slot": self.slot,
            "stream": self.stream,
            "stored_lsn": self.stored_lsn.to_string(),
            "confirmed_lsn": self.confirmed_lsn.to_string(),
            "last_sequence": self.last_sequence,
        })
        .to_string()
    }
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WaitOutcome {
    /// Every event up to the LSN is stored.
    Stored {
        /// The stored LSN when it was answered (at or past the LSN waited for).
        stored_lsn: Lsn,
        /// The stream sequence of the last message stored then.
        last_sequence: u64,
    },
    /// `timeout_ms` passed first.
    TimedOut {
        /// How far the relay had stored.
        stored_lsn: Lsn,
        /// The server's WAL position, read after the wait began, when the LSN waited for is past
        /// it: no transaction can have committed there, so the wait could never be answered.
        past_wal_end: Option<Lsn>,
    },
    /// Too many waits are open, or they hold too much ([`MAX_WAITERS`], [`MAX_WAIT_BYTES`]); ask
    /// again later.
    Overloaded,
    /// The relay is stopping: no answer is coming; ask again (another relay may take over).
    Stopping,
}

impl WaitOutcome {
    /// The JSON of the reply (overloaded and stopping are errors, not replies, over NATS).
    pub(crate) fn to_json(self) -> String {
        match self {
            WaitOutcome::Stored {
                stored_lsn,
                last_sequence,
            } => serde_json::json!({
                "stored": true,
                "stored_lsn": stored_lsn.to_string(),
                "last_sequence": last_sequence,
            }),
            WaitOutcome::TimedOut {
                stored_lsn,
                past_wal_end: None,
            } => serde_json::json!({
                "stored": false,
                "error": "timeout",
                "stored_lsn": stored_lsn.to_string(),
            }),
            WaitOutcome::TimedOut {
                stored_lsn,
                past_wal_end: Some(wal_end),
            } => serde_json::json!({
                "stored": false,
                "error": "timeout",
                "stored_lsn": stored_lsn.to_string(),
                "wal_end": wal_end.to_string(),
                "reason": format!(
                    "the lsn is past the end of the server's WAL ({wal_end}, read after this wait began): no \
                     transaction has committed there; take it with SELECT pg_current_wal_lsn() after COMMIT, on the \
                     database this relay streams"
                ),
            }),
            WaitOutcome::Overloaded => serde_json::json!({
                "stored": false,
                "error": "too many open waits",
            }),
            WaitOutcome::Stopping => serde_json::json!({
                "stored": false,
                "error": "the relay is stopping",
            }),
        }
        .to_string()
    }
}

/// This relay does not stream the slot (a standby, or between sessions): it knows no position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this relay does not stream the slot now (a standby, or reconnecting): ask the one that does"
)]
pub(crate) struct NotServing;

/// A wait request: the LSN and how long to wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WaitRequest {
    /// Wait until every event of every transaction whose commit ends at or before this is stored.
    pub(crate) lsn: Lsn,
    /// At most this long (at most [`MAX_WAIT_MS`]).
    pub(crate) timeout: Duration,
}

/// A bad wait request: the field and what to send instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub(crate) struct BadRequest {
    /// The request's field (`lsn`, `timeout_ms`) or `request`.
    pub(crate) field: &'static str,
    /// What is wrong and how to fix it.
    pub(crate) why: String,
}

fn bad(field: &'static str, why: impl Into<String>) -> BadRequest {
    BadRequest {
        field,
        why: why.into(),
    }
}

impl WaitRequest {
    /// From the JSON body of `<prefix>.wait`: `{"lsn": "X/Y", "timeout_ms": N}`.
    pub(crate) fn from_json(body: &[u8]) -> Result<WaitRequest, BadRequest> {
        let shape = "send a JSON object like {\"lsn\": \"16/B374D848\", \"timeout_ms\": 5000}";
        if body.iter().all(u8::is_ascii_whitespace) {
            return Err(bad("lsn", format!("missing: {shape}")));
        }
        let value: Value = serde_json::from_slice(body)
            .map_err(|_| bad("request", format!("is not JSON: {shape}")))?;
        let Value::Object(map) = value else {
            return Err(bad("request", format!("is not a JSON object: {shape}")));
        };
        Self::from_fields(&map)
    }

    fn from_fields(map: &Map<String, Value>) -> Result<WaitRequest, BadRequest> {
        if let Some(other) = map
            .keys()
            .find(|k| !matches!(k.as_str(), "lsn" | "timeout_ms"))
        {
            return Err(bad(
                "request",
                format!(
                    "unknown field {:?}: the fields are lsn and timeout_ms",
                    shorten(other)
                ),
            ));
        }
        let lsn = match map.get("lsn") {
            None => {
                return Err(bad(
                    "lsn",
                    "missing: the LSN pg_current_wal_lsn() gave after your COMMIT, like \"16/B374D848\"",
                ));
            }
            Some(Value::String(s)) => parse_lsn(s)?,
            Some(_) => return Err(bad("lsn", "must be a string like \"16/B374D848\"")),
        };
        let timeout = match map.get("timeout_ms") {
            None | Some(Value::Null) => DEFAULT_WAIT_MS,
            Some(v) => v
                .as_u64()
                .filter(|&ms| ms <= MAX_WAIT_MS)
                .ok_or_else(timeout_error)?,
        };
        Ok(WaitRequest {
            lsn,
            timeout: Duration::from_millis(timeout),
        })
    }

    /// From the query of `GET /wait?lsn=X/Y&timeout_ms=N` (percent-decoded).
    pub(crate) fn from_query(query: &str) -> Result<WaitRequest, BadRequest> {
        let mut map = Map::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let k = percent_encoding::percent_decode_str(k).decode_utf8_lossy();
            let v = percent_encoding::percent_decode_str(v).decode_utf8_lossy();
            let v = match k.as_ref() {
                "timeout_ms" => {
                    Value::Number(v.trim().parse::<u64>().map_err(|_| timeout_error())?.into())
                }
                _ => Value::String(v.into_owned()),
            };
            if map.insert(k.into_owned(), v).is_some() {
                return Err(bad("request", "a parameter is given twice"));
            }
        }
        Self::from_fields(&map)
    }
}

fn parse_lsn(s: &str) -> Result<Lsn, BadRequest> {
    s.parse().map_err(|_| {
        bad(
            "lsn",
            format!(
                "{:?} is not an LSN: send what SELECT pg_current_wal_lsn() returns, like \"16/B374D848\"",
                shorten(s)
            ),
        )
    })
}

fn timeout_error() -> BadRequest {
    bad(
        "timeout_ms",
        format!(
            "must be a whole number of milliseconds from 0 to {MAX_WAIT_MS}: wait again for longer"
        ),
    )
}

/// At most 64 characters of what a client sent, for an error line.
fn shorten(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_owned(),
    }
}

impl Positions {
    /// The handle for `slot` and `stream`, and the task that answers its waits (run it, or waits
    /// time out at once).
    pub(crate) fn new(slot: &str, stream: &str) -> (Arc<Positions>, WaitTask) {
        let (state, state_rx) = watch::channel(State::default());
        // Room for bursts of new waits; the task takes them as fast as they come.
        let (waits, waits_rx) = mpsc::channel(4096);
        (
            Arc::new(Positions {
                slot: slot.to_owned(),
                stream: stream.to_owned(),
                state,
                waits,
            }),
            WaitTask {
                state: state_rx,
                waits: waits_rx,
            },
        )
    }

    /// The subject prefix of the NATS service: `outbox-relay.<slot>`.
    pub(crate) fn prefix(&self) -> String {
        format!("outbox-relay.{}", self.slot)
    }

    /// A session streams the slot from here: serve. `slot` is the slot's `confirmed_flush_lsn` as
    /// the session found it (`None` when it could not be read); `last_sequence` the stream's last
    /// sequence; `reported` the stream's last reported flush LSN.
    ///
    /// Each session starts over from the slot, never from what an earlier session stored: after a
    /// restore the slot is back where the snapshot left it, on the same system and timeline, and
    /// its WAL after that point is written anew, so an LSN stored before means nothing now. Only
    /// what the slot says is confirmed is stored for sure. An unknown slot position starts at
    /// `0/0`: nothing is answered stored until the session's own progress says so.
    pub(crate) fn serving(&self, reported: Arc<AtomicU64>, slot: Option<Lsn>, last_sequence: u64) {
        self.state.send_modify(|s| {
            s.stored = slot.unwrap_or(Lsn::ZERO);
            s.slot_start = s.stored;
            s.last_sequence = last_sequence;
            s.serving = Some(reported);
        });
    }

    /// The server's WAL position now (the slot sampler's reading): what tells a wait for an LSN
    /// that no transaction can reach. Wakes no waiter.
    pub(crate) fn wal_read(&self, wal_end: Lsn) {
        self.state.send_if_modified(|s| {
            s.wal_end = Some((Instant::now(), wal_end));
            false
        });
    }

    /// The session ended: no position until the next one streams.
    pub(crate) fn not_serving(&self) {
        self.state.send_if_modified(|s| s.serving.take().is_some());
    }

    /// The session's tracker says everything through `stored` is stored, the last message at stream
    /// sequence `last_sequence`. Cheap: waiters are woken only when something changed.
    pub(crate) fn advance(&self, stored: Lsn, last_sequence: u64) {
        self.state.send_if_modified(|s| {
            let changed = stored > s.stored || last_sequence > s.last_sequence;
            s.stored = s.stored.max(stored);
            s.last_sequence = s.last_sequence.max(last_sequence);
            changed
        });
    }

    /// The position now, or [`NotServing`].
    pub(crate) fn position(&self) -> Result<Position, NotServing> {
        let s = self.state.borrow();
        let reported = s.serving.as_ref().ok_or(NotServing)?;
        Ok(Position {
            slot: self.slot.clone(),
            stream: self.stream.clone(),
            stored_lsn: s.stored,
            confirmed_lsn: Lsn(reported.load(Ordering::Acquire)).max(s.slot_start),
            last_sequence: s.last_sequence,
        })
    }

    /// Waits until everything through `req.lsn` is stored, or `req.timeout`. Refused at once while
    /// no session streams; a wait that began while one did is answered whatever happens to it.
    /// `held` is what the caller keeps in memory while it waits (bytes), charged to
    /// [`MAX_WAIT_BYTES`] with the wait's own cost: beyond it the answer is
    /// [`WaitOutcome::Overloaded`].
    pub(crate) fn wait(
        &self,
        req: WaitRequest,
        held: usize,
    ) -> Result<impl Future<Output = WaitOutcome> + Send + 'static, NotServing> {
        let (stored, last_sequence) = {
            let s = self.state.borrow();
            if s.serving.is_none() {
                return Err(NotServing);
            }
            (s.stored, s.last_sequence)
        };
        let (answer, rx) = oneshot::channel();
        let at_once = if req.lsn <= stored {
            Some(WaitOutcome::Stored {
                stored_lsn: stored,
                last_sequence,
            })
        } else if req.timeout.is_zero() {
            Some(WaitOutcome::TimedOut {
                stored_lsn: stored,
                past_wal_end: None,
            })
        } else {
            let now = Instant::now();
            let waiter = Waiter {
                lsn: req.lsn,
                since: now,
                deadline: now + req.timeout,
                answer,
                held,
            };
            match self.waits.try_send(waiter) {
                Ok(()) => None,
                Err(_) => Some(WaitOutcome::Overloaded),
            }
        };
        Ok(async move {
            match at_once {
                Some(outcome) => outcome,
                // The task is gone: the relay is stopping.
                None => rx.await.unwrap_or(WaitOutcome::Stopping),
            }
        })
    }
}

/// What a streaming session holds: while it lives, this relay serves its position (HTTP, and the
/// NATS service when the session publishes through a real NATS connection).
pub(crate) struct Serve {
    positions: Arc<Positions>,
    _service: Option<service::Serving>,
}

impl Serve {
    /// Serves from now on; see [`Positions::serving`] for the arguments. A NATS service that cannot
    /// start (e.g. no permission) costs the service, not the session: HTTP still answers.
    pub(crate) async fn start(
        positions: &Arc<Positions>,
        nats: Option<(&async_nats::Client, service::Guard)>,
        reported: Arc<AtomicU64>,
        slot: Option<Lsn>,
        last_sequence: u64,
    ) -> Serve {
        positions.serving(reported, slot, last_sequence);
        let service = match nats {
            Some((client, guard)) => {
                match service::start(client, Arc::clone(positions), guard).await {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::warn!(error = %e, prefix = %positions.prefix(), "the position service did not start; /position and /wait still answer");
                        None
                    }
                }
            }
            None => None,
        };
        Serve {
            positions: Arc::clone(positions),
            _service: service,
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.positions.not_serving();
    }
}

impl WaitTask {
    /// Answers waits until the handle is gone: each new stored LSN answers the waits it satisfies;
    /// one timer, reset to the earliest deadline, answers the expired ones. Every open wait is
    /// charged its bytes until it is answered; see [`MAX_WAIT_BYTES`].
    pub(crate) async fn run(mut self) {
        let mut set: WaitSet<Instant, Open> = WaitSet::default();
        let mut budget = Budget::default();
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        let mut timer_at = None;
        loop {
            let next = set.next_deadline();
            if next != timer_at {
                if let Some(at) = next {
                    timer.as_mut().reset(at);
                }
                timer_at = next;
            }
            tokio::select! {
                biased;
                // Only while someone waits: the sink moves the position once per burst of acks,
                // and waking this task for each with nobody to answer cost a task switch per burst.
                // A wait that arrives later reads the position itself, and `changed` still reports
                // every move made since the last one this branch took.
                changed = self.state.changed(), if !set.is_empty() => {
                    if changed.is_err() {
                        return;
                    }
                    let (stored, last_sequence) = {
                        let s = self.state.borrow_and_update();
                        (s.stored, s.last_sequence)
                    };
                    for open in set.stored(stored) {
                        budget.release(open.cost);
                        // A waiter that gave up (its client went away) is simply dropped.
                        let _ = open.answer.send(WaitOutcome::Stored { stored_lsn: stored, last_sequence });
                    }
                }
                w = self.waits.recv() => {
                    let Some(w) = w else { return };
                    let (stored, last_sequence) = {
                        let s = self.state.borrow();
                        (s.stored, s.last_sequence)
                    };
                    let cost = WAIT_ENTRY_BYTES.saturating_add(w.held);
                    // The position may have moved since the request looked.
                    if w.lsn <= stored {
                        let _ = w.answer.send(WaitOutcome::Stored { stored_lsn: stored, last_sequence });
                    } else if !budget.admits(cost, &mut set) || set.len() >= MAX_WAITERS {
                        let _ = w.answer.send(WaitOutcome::Overloaded);
                    } else {
                        budget.used += cost;
                        set.insert(w.lsn, w.deadline, Open { answer: w.answer, cost, lsn: w.lsn, since: w.since });
                    }
                }
                () = &mut timer, if timer_at.is_some() => {
                    let (stored, wal_end) = {
                        let s = self.state.borrow();
                        (s.stored, s.wal_end)
                    };
                    for open in set.expired(Instant::now()) {
                        budget.release(open.cost);
                        // Past a WAL end read after the wait began: that LSN did not exist then.
                        let past_wal_end = wal_end
                            .filter(|(read, end)| *read >= open.since && *end < open.lsn)
                            .map(|(_, end)| end);
                        let _ = open.answer.send(WaitOutcome::TimedOut { stored_lsn: stored, past_wal_end });
                    }
                    timer_at = None;
                }
            }
        }
    }
}

/// An open wait in the wait task: where to answer, what it is charged, and the LSN it waits for
/// and since when (a timeout says whether that LSN was past the WAL's end).
#[derive(Debug)]
struct Open {
    answer: oneshot::Sender<WaitOutcome>,
    cost: usize,
    lsn: Lsn,
    since: Instant,
}

/// The bytes the open waits are charged ([`MAX_WAIT_BYTES`]).
#[derive(Debug, Default)]
struct Budget {
    used: usize,
    /// When waits whose callers went away were last dropped (at most once a second: it looks at
    /// every open wait).
    swept: Option<Instant>,
}

impl Budget {
    fn release(&mut self, cost: usize) {
        self.used = self.used.saturating_sub(cost);
    }

    /// Whether a wait of `cost` fits. When it does not, the waits nobody waits for any more (an
    /// HTTP client that went away) are dropped first, so they cannot hold the budget until their
    /// deadlines.
    fn admits(&mut self, cost: usize, set: &mut WaitSet<Instant, Open>) -> bool {
        if self.used + cost <= MAX_WAIT_BYTES {
            return true;
        }
        if self
            .swept
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            self.swept = Some(Instant::now());
            for gone in set.remove_where(|o| o.answer.is_closed()) {
                self.release(gone.cost);
            }
        }
        self.used + cost <= MAX_WAIT_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_requests_parse_and_bad_ones_name_the_field() {
        let r = WaitRequest::from_json(br#"{"lsn": "16/B374D848", "timeout_ms": 250}"#).unwrap();
        assert_eq!(r.lsn, Lsn(0x16_B374_D848));
        assert_eq!(r.timeout, Duration::from_millis(250));
        let r = WaitRequest::from_json(br#"{"lsn": "0/10"}"#).unwrap();
        assert_eq!(r.timeout, Duration::from_millis(DEFAULT_WAIT_MS));
        let q = WaitRequest::from_query("lsn=16%2FB374D848&timeout_ms=0").unwrap();
        assert_eq!((q.lsn, q.timeout), (Lsn(0x16_B374_D848), Duration::ZERO));
        for (body, field) in [
            (&b""[..], "lsn"),
            (b"{}", "lsn"),
            (b"nope", "request"),
            (b"[1]", "request"),
            (br#"{"lsn": 5}"#, "lsn"),
            (br#"{"lsn": "16-B374"}"#, "lsn"),
            (br#"{"lsn": "0/1", "timeout_ms": -1}"#, "timeout_ms"),
            (br#"{"lsn": "0/1", "timeout_ms": 1.5}"#, "timeout_ms"),
            (br#"{"lsn": "0/1", "timeout_ms": 30001}"#, "timeout_ms"),
            (br#"{"lsn": "0/1", "timeout": 5}"#, "request"),
        ] {
            let e = WaitRequest::from_json(body).unwrap_err();
            assert_eq!(e.field, field, "{}: {e}", String::from_utf8_lossy(body));
            assert!(e.to_string().starts_with(field), "{e}");
            assert!(!e.to_string().contains('\n'), "{e}");
        }
        for (query, field) in [
            ("", "lsn"),
            ("lsn=x", "lsn"),
            ("lsn=0/1&timeout_ms=abc", "timeout_ms"),
            ("lsn=0/1&lsn=0/2", "request"),
            ("lsn=0/1&wait=1", "request"),
        ] {
            assert_eq!(
                WaitRequest::from_query(query).unwrap_err().field,
                field,
                "{query}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn waits_answer_on_advance_or_timeout_and_not_while_not_serving() {
        let (p, task) = Positions::new("s", "S");
        tokio::spawn(task.run());
        let req = |lsn, ms| WaitRequest {
            lsn: Lsn(lsn),
            timeout: Duration::from_millis(ms),
        };
        assert_eq!(p.position(), Err(NotServing));
        assert!(p.wait(req(1, 10), 0).is_err());
        p.serving(Arc::new(AtomicU64::new(0x10)), Some(Lsn(0x20)), 0);
        assert_eq!(p.position().unwrap().stored_lsn, Lsn(0x20));
        // The slot stood at 0x20 when the session started: confirmed, whatever was reported since.
        assert_eq!(p.position().unwrap().confirmed_lsn, Lsn(0x20));
        let done = p.wait(req(0x20, 10), 0).unwrap().await;
        assert!(matches!(done, WaitOutcome::Stored { .. }), "{done:?}");
        let soon = tokio::spawn(p.wait(req(0x30, 60_000), 0).unwrap());
        let late = tokio::spawn(p.wait(req(0x40, 1_000), 0).unwrap());
        tokio::task::yield_now().await;
        p.advance(Lsn(0x35), 7);
        assert_eq!(
            soon.await.unwrap(),
            WaitOutcome::Stored {
                stored_lsn: Lsn(0x35),
                last_sequence: 7
            }
        );
        assert_eq!(
            late.await.unwrap(),
            WaitOutcome::TimedOut {
                stored_lsn: Lsn(0x35),
                past_wal_end: None
            }
        );
        p.not_serving();
        assert!(p.wait(req(1, 10), 0).is_err());
        // Every session starts from the slot: after a restore on the same timeline the slot is
        // behind what the last session stored, and nothing past it is stored in this WAL.
        p.serving(Arc::new(AtomicU64::new(0)), Some(Lsn(0x8)), 3);
        let at = p.position().unwrap();
        assert_eq!((at.stored_lsn, at.last_sequence), (Lsn(0x8), 3));
        assert_eq!(
            at.confirmed_lsn,
            Lsn(0x8),
            "the slot's position before any status update"
        );
        let restored = p.wait(req(0x20, 0), 0).unwrap().await;
        assert_eq!(
            restored,
            WaitOutcome::TimedOut {
                stored_lsn: Lsn(0x8),
                past_wal_end: None
            },
            "a commit the restored WAL has not replayed is not stored"
        );
        // A slot position that could not be read stores nothing yet.
        p.serving(Arc::new(AtomicU64::new(0)), None, 3);
        assert_eq!(p.position().unwrap().stored_lsn, Lsn::ZERO);
    }

    /// A wait for an LSN past the server's WAL end, read after the wait began, times out saying
    /// so; a reading from before it began proves nothing (the writer may have committed since).
    #[tokio::test(start_paused = true)]
    async fn a_wait_past_the_wal_end_says_so_when_it_times_out() {
        let (p, task) = Positions::new("s", "S");
        tokio::spawn(task.run());
        p.serving(Arc::new(AtomicU64::new(0)), Some(Lsn(0x20)), 0);
        let req = |lsn| WaitRequest {
            lsn: Lsn(lsn),
            timeout: Duration::from_millis(1_000),
        };
        p.wal_read(Lsn(0x30));
        tokio::time::sleep(Duration::from_millis(10)).await;
        let only_read_before = p.wait(req(0x5000), 0).unwrap().await;
        assert_eq!(
            only_read_before,
            WaitOutcome::TimedOut {
                stored_lsn: Lsn(0x20),
                past_wal_end: None
            }
        );
        let past = tokio::spawn(p.wait(req(0x5000), 0).unwrap());
        let within = tokio::spawn(p.wait(req(0x38), 0).unwrap());
        tokio::time::sleep(Duration::from_millis(10)).await;
        p.wal_read(Lsn(0x40));
        let (past, within) = (past.await.unwrap(), within.await.unwrap());
        assert_eq!(
            past,
            WaitOutcome::TimedOut {
                stored_lsn: Lsn(0x20),
                past_wal_end: Some(Lsn(0x40))
            }
        );
        assert!(
            past.to_json()
                .contains("past the end of the server's WAL (0/40"),
            "{}",
            past.to_json()
        );
        assert_eq!(
            within,
            WaitOutcome::TimedOut {
                stored_lsn: Lsn(0x20),
                past_wal_end: None
            },
            "an LSN the WAL has reached is only not stored yet"
        );
    }

    /// Open waits are bounded in bytes: waits that keep a lot each are refused once what they keep
    /// together would pass [`MAX_WAIT_BYTES`], and an answered wait gives its bytes back.
    #[tokio::test(start_paused = true)]
    async fn open_waits_are_bounded_in_bytes() {
        let (p, task) = Positions::new("s", "S");
        tokio::spawn(task.run());
        p.serving(Arc::new(AtomicU64::new(0)), Some(Lsn(1)), 0);
        let far = WaitRequest {
            lsn: Lsn(1 << 40),
            timeout: Duration::from_secs(30),
        };
        let each = 1 << 20;
        let fit = MAX_WAIT_BYTES / (each + WAIT_ENTRY_BYTES);
        let open: Vec<_> = (0..fit)
            .map(|_| tokio::spawn(p.wait(far, each).unwrap()))
            .collect();
        tokio::task::yield_now().await;
        assert_eq!(
            p.wait(far, each).unwrap().await,
            WaitOutcome::Overloaded,
            "{fit} waits of {each} bytes fill the budget"
        );
        // A small one still fits in what is left.
        let small = tokio::spawn(p.wait(far, 100).unwrap());
        p.advance(Lsn(1 << 40), 1);
        for w in open {
            assert!(matches!(w.await.unwrap(), WaitOutcome::Stored { .. }));
        }
        assert!(matches!(small.await.unwrap(), WaitOutcome::Stored { .. }));
        let again = tokio::spawn(
            p.wait(
                WaitRequest {
                    lsn: Lsn(1 << 41),
                    ..far
                },
                each,
            )
            .unwrap(),
        );
        p.advance(Lsn(1 << 41), 2);
        assert!(
            matches!(again.await.unwrap(), WaitOutcome::Stored { .. }),
            "answered waits gave their bytes back"
        );
    }
}
