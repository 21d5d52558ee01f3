//! The simulated Postgres: a WAL of records at 8-byte-aligned LSNs, application transactions that
//! interleave in it and commit in their own order, a logical replication slot, and a walsender per
//! replication connection that decodes the WAL the way pgoutput does and speaks the CopyBoth
//! framing over an in-memory pipe to the relay's real `ReplicationStream`.
//!
//! What it must get right (the walsender's behaviour the relay relies on,
//! docs/pgoutput.md#which-lsn-is-confirmed): a transaction is sent whole at its commit
//! record, in commit order, iff that record starts at or after the start position; a
//! non-transactional logical message is sent iff its record starts there or later, and its LSN is
//! the *end* of its record, which is the start of the next record (often the commit that follows
//! it); `Commit.end_lsn` is where the next record starts (past a page header when the commit ends
//! on a page boundary); START_REPLICATION before the slot's `confirmed_flush` starts at it; the slot
//! only moves forward through status updates; keepalives carry the position decoded so far.
//!
//! Faults: the connection cut, the connection black-holed (the walsender holds the slot until its
//! `wal_sender_timeout`), the server unreachable, a crash (the slot falls back to its last
//! checkpoint, open transactions die), and a restore from a disk snapshot: the WAL is truncated to
//! the snapshot and the slot reset, same system id and timeline, and new transactions reuse the
//! LSNs after it (or, as a point-in-time recovery, on a new timeline), and a promotion: a standby
//! takes over on a new timeline, with the slot as its last sync left it and all of the WAL (or,
//! after a crash without `synchronized_standby_slots`, without the last records).
//! A new timeline's history file (what `TIMELINE_HISTORY` answers) names the switch point, and
//! the relay reads it with its real parser.
//!
//! P2 is checked here, at every status update: the slot may not pass a unit of work whose events
//! the stream does not hold, nor the end of the WAL. After each one the world's hook runs too (the
//! position service's oracle in `world.rs`, which walks the units with [`Postgres::units_below`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use outbox_relay::Lsn;
use outbox_relay::pgoutput::{Column, Message, OldTuple, Relation, TupleValue, encode};
use outbox_relay::relay::{SessionEnd, Start, from_source};
use outbox_relay::source::{
    ReplicationStream, ServerError, SourceError, StreamConfig, SystemInfo, TimelineHistory,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::check::Violations;
use super::jetstream::{JetStream, STREAM};
use super::rng::Dice;
use super::trace::{Trace, trace};

pub(crate) const PREFIX: &str = "outbox";
/// The prefix of trace context messages (`outbox.context_prefix`), in worlds that write them.
pub(crate) const CONTEXT_PREFIX: &str = "outbox-context";
const OUTBOX_OID: u32 = 16_384;
const ORDERS_OID: u32 = 16_390;
const PAGE: u64 = 8192;
/// A short page header, MAXALIGNed.
const PAGE_HEADER: u64 = 24;
/// The first record: past the long header of a segment above 4 GiB, so LSNs print as `1/…`.
const WAL_START: u64 = (1 << 32) + 40;
/// The world's start as a Postgres timestamp (µs since 2000-01-01): commit times and send times
/// follow the virtual clock from there, never the machine's.
const PG_EPOCH_START: i64 = 800_000_000_000_000;
/// Records sent per write to the pipe, at most.
const BATCH_RECORDS: usize = 64;

/// How one event must appear in the stream.
#[derive(Clone, Debug)]
pub(crate) enum Must {
    /// Routed to this subject.
    Routed(String),
    /// As a dead letter; with the payload it must carry, when known.
    DeadLetter(Option<Bytes>),
    /// Either (an oversized event: whether the client or the stream refuses it depends on sizes
    /// the simulation does not recompute).
    Either,
}

/// One event the relay must publish.
#[derive(Clone, Debug)]
pub(crate) struct Expected {
    pub msg_id: String,
    /// Its place in its unit.
    pub index: u32,
    pub must: Must,
    /// The `traceparent` of its transaction's context message before it, which it must carry.
    pub context: Option<String>,
    /// A row of the outbox table (a backfill reads it again), not a logical message.
    pub row: bool,
    /// Its key (`aggregate_type`, `aggregate_id`): what parks with it (`parking.rs`).
    pub key: (String, String),
    /// Why it cannot be published as it is, when the world wrote it so on purpose (park worlds).
    pub poison: Option<Poison>,
}

/// Why an event cannot be published as it is, as the world wrote it: what a park world's oracle
/// (`parking.rs`) expects of it, at first and when a requeue checks it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Poison {
    /// Its payload fails its type's schema until the operator fixes the schema.
    Schema,
    /// Its aggregate type is no subject token: never publishable.
    Token,
    /// Over the stream's size limit (its parked copy loses the payload): never publishable.
    Size,
    /// A non-transactional outbox message: atomic with nothing, never publishable.
    Stray,
}

/// A release the world wrote: a control message (`parking.rs`), in its own transaction.
#[derive(Clone, Debug)]
pub(crate) struct Release {
    /// Where its commit record starts: its place among the units.
    pub start: u64,
    pub discard: bool,
    pub key: (String, String),
    pub request: String,
}

/// A unit of work the walsender sends whole: a committed transaction with outbox events, or a
/// non-transactional outbox message.
#[derive(Clone, Debug)]
pub(crate) struct Unit {
    /// Where the record that decides it starts (the commit record, or the message's own): the
    /// walsender sends it iff this is at or after its start, and sends units in this order.
    pub start: u64,
    /// When it committed (virtual time): no copy stored before can be one of its events.
    pub at: Instant,
    pub events: Vec<Expected>,
    pub what: String,
}

/// What a world's Postgres looks like, drawn per seed.
#[derive(Clone, Debug)]
pub(crate) struct PgParams {
    /// Application connections writing concurrently.
    pub apps: usize,
    /// The publication also has `public.orders` (changes of another table reach the relay).
    pub publish_orders: bool,
    /// The publication publishes deletes too (`publish = 'insert, delete'`): a retention job's
    /// deletes of old outbox rows reach the relay as changes that are not events
    /// ([`Postgres::retention_delete`]).
    pub publish_deletes: bool,
    /// Transactions without published changes are sent as an empty Begin/Commit (before PG 15).
    pub send_empty: bool,
    /// Bytes the pipe between walsender and relay buffers.
    pub pipe: usize,
    /// How long the walsender waits, caught up, before a keepalive (ms range).
    pub keepalive_ms: (u64, u64),
    /// Applications write trace context messages (and the relay is configured for them).
    pub context: bool,
    /// How often a write is a whole large transaction (50 to 600 events), longer than a small
    /// window and than a replay reads back at once.
    pub big_transactions: f64,
    /// In worlds with atomic batches: the size a batch member must fit (the smaller of the stream's
    /// `max_msg_size` and the server's `max_payload`). Now and then a row's payload is drawn just
    /// below it, where the headers the relay stamps on a member decide whether it fits.
    pub edge: Option<usize>,
    /// A park world (`outbox.on_invalid = "park"`): the size a message must fit (the smaller of
    /// `max_msg_size` and `max_payload`); a large row is then drawn over it, a sure poison.
    pub park: Option<usize>,
}

enum Change {
    Outbox(Vec<TupleValue>),
    /// A transactional logical message with the prefix.
    Event(Bytes),
    /// A transactional trace context message (`CONTEXT_PREFIX`).
    Context(Bytes),
    /// A transactional control message (`CONTROL_PREFIX`), as sql/09's functions write it.
    Control(Bytes),
    Orders(Vec<TupleValue>),
    /// A delete of an outbox row: its key (the other columns are placeholders, as pgoutput sends a
    /// default replica identity's old key).
    OutboxDelete(Vec<TupleValue>),
}

enum Body {
    Change(Change),
    Commit {
        xid: u32,
        ts: i64,
        changes: Vec<usize>,
    },
    /// A non-transactional logical message with the prefix.
    Message(Bytes),
    /// Anything pgoutput does not send: other databases, aborts, checkpoints.
    Other,
}

struct Record {
    start: u64,
    /// The end of the record (MAXALIGNed, page headers inside it counted).
    end: u64,
    /// Where the next record starts: `end`, or past the next page's header when `end` is a page
    /// boundary.
    next: u64,
    body: Body,
}

#[derive(Default)]
struct Open {
    changes: Vec<usize>,
    events: Vec<Expected>,
    /// The `traceparent` of the last context message written in it.
    context: Option<String>,
}

struct Slot {
    confirmed: u64,
    /// What a crash or a disk snapshot brings back: the slot as last written to disk.
    checkpointed: u64,
    /// The connection streaming it.
    active: Option<u64>,
    /// `false` once a backfill dropped it and made no new one (yet).
    exists: bool,
}

#[derive(PartialEq, Eq)]
enum Copy {
    Streaming,
    /// The relay sent CopyDone: answer it, send nothing more.
    DoneReceived,
    Finished,
}

struct Conn {
    /// The relay process that opened it: a walsender outlives a killed process while its
    /// connection is black-holed, and holds the slot for no session then.
    owner: u64,
    epoch: u64,
    /// Where decoding sends from: max(requested start, confirmed_flush).
    start: u64,
    /// The next WAL record to decode.
    cursor: usize,
    /// Decoded up to here (the walsender's sentPtr).
    sent: u64,
    relations: BTreeSet<u32>,
    copy: Copy,
    /// Black-holed: holds the slot, moves nothing, until then (`wal_sender_timeout`).
    zombie_until: Option<Instant>,
    reply_now: bool,
    keepalive_at: Option<Instant>,
    /// The last `flush` the relay reported on this connection.
    reported: u64,
    wake: Arc<Notify>,
    kill: watch::Sender<bool>,
}

/// The stop mark (`<slot>_mark`): the copy of the slot a relay's session leaves when it ends while
/// its walsender still holds the slot (`src/slot_mark.rs`). `serial` tells one copy from the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mark {
    at: u64,
    serial: u64,
}

/// A unit of work a client other than a relay consumed: where its deciding record starts, when it
/// committed, its events' ids.
#[derive(Clone, Debug)]
struct Skipped {
    start: u64,
    at: Instant,
    ids: Vec<String>,
}

/// A client other than a relay consumed the slot (`pg_logical_slot_get_changes`) or advanced it
/// (`pg_replication_slot_advance`) while no walsender held it: what the simulator saw, and whether
/// the relay must report it ([`Postgres::judge_consumptions`]).
#[derive(Clone, Debug)]
struct Consumption {
    at: Instant,
    from: u64,
    to: u64,
    skipped: Vec<Skipped>,
    /// The stop mark when it happened.
    mark: Option<Mark>,
    /// Whether the stream's last message then was one the relay can compare with (its own, still
    /// there, written in the server's current history), and why not.
    tail: Result<(), String>,
    /// (the stream's distrust events, the server's rewinds, its timeline) then: what would make
    /// the mark's judgement unknowable if it changed before the relay's next session.
    era: (usize, usize, u32),
    /// Decided when the next session takes the slot: `Ok(n)`, the relay must report `n` events the
    /// stream lacks below the slot before it confirms anything; `Err(why)`, it need not (what
    /// docs/guarantees.md P9 says the stop mark cannot see).
    demanded: Option<Result<usize, String>>,
    /// The operator saw the relay's report (`outbox_relay_slot_consumed_events` above 0).
    reported: bool,
}

struct Snapshot {
    records: usize,
    end: u64,
    units: usize,
    slot: u64,
    timeline: u32,
    history_file: String,
    /// Slots live on disk: a restore brings the mark back as it was.
    mark: Option<Mark>,
}

struct State {
    params: PgParams,
    /// Every move of the slot's confirmed position, with when it happened: the checks read from it
    /// when the relay took the stream's tail as trustworthy again.
    confirmations: Vec<(Instant, u64)>,
    system_id: String,
    timeline: u32,
    /// The current timeline's history file: a line `parentTLI<TAB>switch point<TAB>reason` per
    /// ancestor.
    history_file: String,
    /// The highest timeline ever used: a new one is always above it.
    newest_timeline: u32,
    /// The server's incarnation: bumped by a crash or a restore, which end every connection.
    epoch: u64,
    wal: Vec<Record>,
    /// Where the next record starts.
    end: u64,
    units: Vec<Unit>,
    open: BTreeMap<u32, Open>,
    /// Each application connection's open transaction.
    apps: Vec<Option<u32>>,
    next_xid: u32,
    slot: Slot,
    conns: BTreeMap<u64, Conn>,
    next_conn: u64,
    down_until: Option<Instant>,
    snapshots: Vec<Snapshot>,
    /// Events written so far, in every history: ids and payload markers never repeat.
    written: u64,
    /// How many units of work each time the WAL was cut back (a restore, a promotion of a standby
    /// that lacked the last records) kept: an LSN learned before names a history the server may no
    /// longer have.
    rewinds: Vec<usize>,
    /// The stop mark, if a relay left one.
    mark: Option<Mark>,
    /// Stop marks made so far.
    marks: u64,
    /// When the server's history last changed (a restore, a new timeline): a message stored by a
    /// session that began before speaks of another history.
    history_changed: Instant,
    /// Every time another client consumed the slot.
    consumptions: Vec<Consumption>,
    /// The units whose rows the retention job has deleted from (it goes on from here).
    deleted: usize,
    /// Backfills (`backfill.rs` in this directory).
    pub(super) backfill: super::backfill::PgBackfill,
    /// Park worlds: the releases written, in commit order.
    releases: Vec<Release>,
    /// Park worlds: applications still write payloads their type's schema refuses.
    schema_broken: bool,
}

/// How far a walk over the units ([`Postgres::units_below`]) has come: the units before `next`, in
/// the history after `rewinds` rewinds.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct UnitCursor {
    pub next: usize,
    pub rewinds: usize,
}

/// What the world runs at every status update the slot takes (the position-service oracle).
pub(crate) type StatusHook = Box<dyn Fn(&Postgres) + Send + Sync>;

pub(crate) struct Postgres {
    state: Mutex<State>,
    dice: Dice,
    /// Park worlds' poison draws: a generator of its own, so that other worlds draw as before.
    poison: Dice,
    trace: Arc<Trace>,
    js: Arc<JetStream>,
    violations: Arc<Violations>,
    start: Instant,
    on_status: Mutex<Option<StatusHook>>,
}

/// The outbox table of sql/01_outbox_table.sql, as pgoutput describes it.
fn outbox_relation() -> Relation {
    let col = |name: &str, type_oid: u32, key: bool| Column {
        flags: u8::from(key),
        name: name.into(),
        type_oid,
        type_modifier: -1,
    };
    Relation {
        xid: None,
        id: OUTBOX_OID,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: b'd',
        columns: vec![
            col("event_id", 2950, true),
            col("aggregate_type", 25, false),
            col("aggregate_id", 25, false),
            col("event_type", 25, false),
            col("payload", 3802, false),
            col("created_at", 1184, false),
            col("headers", 3802, false),
        ],
    }
}

fn orders_relation() -> Relation {
    Relation {
        xid: None,
        id: ORDERS_OID,
        namespace: "public".into(),
        name: "orders".into(),
        replica_identity: b'd',
        columns: vec![
            Column {
                flags: 1,
                name: "id".into(),
                type_oid: 23,
                type_modifier: -1,
            },
            Column {
                flags: 0,
                name: "total".into(),
                type_oid: 1700,
                type_modifier: -1,
            },
        ],
    }
}

fn text(s: &str) -> TupleValue {
    TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()))
}

fn align8(n: u64) -> u64 {
    (n + 7) & !7
}

/// A CopyData frame holding XLogData: the 25-byte header, then one pgoutput message.
fn xlog(out: &mut BytesMut, lsn: u64, msg: &Message, time: i64) {
    let body = encode::message(msg);
    out.put_u8(b'd');
    out.put_i32((4 + 25 + body.len()) as i32);
    out.put_u8(b'w');
    out.put_u64(lsn);
    out.put_u64(lsn);
    out.put_i64(time);
    out.put_slice(&body);
}

/// A CopyData frame holding a primary keepalive.
fn keepalive(out: &mut BytesMut, wal_end: u64, time: i64, reply: bool) {
    out.put_u8(b'd');
    out.put_i32(4 + 18);
    out.put_u8(b'k');
    out.put_u64(wal_end);
    out.put_i64(time);
    out.put_u8(u8::from(reply));
}

/// The server's answer to CopyDone: CopyDone, CommandComplete, ReadyForQuery.
fn copy_finished(out: &mut BytesMut) {
    out.put_u8(b'c');
    out.put_i32(4);
    let tag = b"START_REPLICATION\0";
    out.put_u8(b'C');
    out.put_i32(4 + tag.len() as i32);
    out.put_slice(tag);
    out.put_u8(b'Z');
    out.put_i32(5);
    out.put_u8(b'I');
}

/// What the walsender does next on one connection.
enum Out {
    Send(Bytes),
    Wait(Option<Instant>),
    Close,
}

impl State {
    fn is_down(&self) -> bool {
        self.down_until.is_some_and(|t| Instant::now() < t)
    }

    /// The end of the last record: the server's flush position.
    fn flushed(&self) -> u64 {
        self.wal.last().map_or(WAL_START, |r| r.end)
    }

    /// Appends a record of `size` bytes; returns its index.
    fn append(&mut self, size: u64, body: Body) -> usize {
        let start = self.end;
        let mut end = start + align8(size.max(24));
        // A record that crosses a page boundary carries the next page's header inside it.
        let mut boundary = (start / PAGE + 1) * PAGE;
        while boundary < end {
            end += PAGE_HEADER;
            boundary += PAGE;
        }
        let next = if end.is_multiple_of(PAGE) {
            end + PAGE_HEADER
        } else {
            end
        };
        self.end = next;
        self.wal.push(Record {
            start,
            end,
            next,
            body,
        });
        for c in self.conns.values() {
            c.wake.notify_one();
        }
        self.wal.len() - 1
    }

    fn end_conn(&mut self, id: u64) {
        if let Some(c) = self.conns.remove(&id) {
            let _ = c.kill.send(true);
            if self.slot.active == Some(id) {
                self.slot.active = None;
            }
        }
    }

    /// Ends the current timeline at `switch` and starts the next; its history file names them all.
    fn switch_timeline(&mut self, switch: u64, reason: &str) {
        let line = format!("{}\t{}\t{reason}\n", self.timeline, Lsn(switch));
        self.history_file.push_str(&line);
        self.newest_timeline += 1;
        self.timeline = self.newest_timeline;
    }

    fn end_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.end_conn(id);
        }
    }

    /// The slot was taken back (a crash to its checkpoint, a restore, a promotion): a consumption
    /// the slot now stands at or before the start of is undone, its WAL sent again or gone from
    /// the history with the rest. A report demanded of it and not yet seen is demanded no more
    /// (the relay's next look finds the slot behind the mark, nothing to report).
    fn slot_taken_back(&mut self) {
        let at = self.slot.confirmed;
        for c in &mut self.consumptions {
            if matches!(c.demanded, Some(Ok(_))) && !c.reported && at <= c.from {
                c.demanded = Some(Err(format!(
                    "the slot was taken back to {}, before it",
                    Lsn(at)
                )));
            }
        }
    }
}

impl Postgres {
    pub(crate) fn new(
        params: PgParams,
        dice: Dice,
        trace: Arc<Trace>,
        js: Arc<JetStream>,
        violations: Arc<Violations>,
    ) -> Arc<Self> {
        let drawn = dice.range(0, 99_999_999_999_999_999);
        let system_id = format!("73{drawn:017}");
        Arc::new(Postgres {
            state: Mutex::new(State {
                apps: vec![None; params.apps],
                params,
                confirmations: Vec::new(),
                system_id,
                timeline: 1,
                history_file: String::new(),
                newest_timeline: 1,
                epoch: 0,
                wal: Vec::new(),
                end: WAL_START,
                units: Vec::new(),
                open: BTreeMap::new(),
                next_xid: 740,
                slot: Slot {
                    confirmed: WAL_START,
                    checkpointed: WAL_START,
                    active: None,
                    exists: true,
                },
                conns: BTreeMap::new(),
                next_conn: 1,
                down_until: None,
                snapshots: Vec::new(),
                written: 0,
                rewinds: Vec::new(),
                mark: None,
                marks: 0,
                history_changed: Instant::now(),
                consumptions: Vec::new(),
                deleted: 0,
                backfill: Default::default(),
                releases: Vec::new(),
                schema_broken: true,
            }),
            poison: Dice::new(drawn ^ 0x706f_6973_6f6e),
            dice,
            trace,
            js,
            violations,
            start: Instant::now(),
            on_status: Mutex::new(None),
        })
    }

    /// Now on the server's clock (µs since 2000-01-01), following the virtual clock.
    pub(crate) fn pg_now(&self) -> i64 {
        PG_EPOCH_START + self.start.elapsed().as_micros() as i64
    }

    /// `hook` runs after every status update, outside the server's lock.
    pub(crate) fn on_status(&self, hook: StatusHook) {
        *self.on_status.lock().unwrap() = Some(hook);
    }

    /// How many times the WAL was cut back so far (see [`State::rewinds`]).
    pub(crate) fn rewinds(&self) -> usize {
        self.state.lock().unwrap().rewinds.len()
    }

    /// Hands `f` each unit of work of the current history from `at` on whose deciding record
    /// starts below `lsn` (what a relay that says `lsn` is stored or confirmed must have stored, as
    /// P2 reads a confirmation), in order, under the server's lock, and moves `at` past them. A
    /// cursor from before a rewind first steps back to what the rewind kept.
    pub(crate) fn units_below(&self, at: &mut UnitCursor, lsn: u64, mut f: impl FnMut(&Unit)) {
        let s = self.state.lock().unwrap();
        if let Some(kept) = s.rewinds.get(at.rewinds..).and_then(|r| r.iter().min()) {
            at.next = at.next.min(*kept);
        }
        at.rewinds = s.rewinds.len();
        while let Some(u) = s.units.get(at.next).filter(|u| u.start < lsn) {
            f(u);
            at.next += 1;
        }
    }

    pub(crate) fn slot_confirmed(&self) -> u64 {
        self.state.lock().unwrap().slot.confirmed
    }

    /// The server's flush position (what IDENTIFY_SYSTEM reports).
    pub(crate) fn flushed(&self) -> u64 {
        self.state.lock().unwrap().flushed()
    }

    /// Every move of the slot's confirmed position: (when, to).
    pub(crate) fn confirmations(&self) -> Vec<(Instant, u64)> {
        self.state.lock().unwrap().confirmations.clone()
    }

    pub(crate) fn units(&self) -> Vec<Unit> {
        self.state.lock().unwrap().units.clone()
    }

    pub(crate) fn history(&self) -> String {
        let s = self.state.lock().unwrap();
        format!("system {} timeline {}", s.system_id, s.timeline)
    }

    /// One step of the applications: a connection begins, writes, commits or aborts, or emits a
    /// non-transactional message; other databases write WAL too.
    pub(crate) fn write(&self) {
        let mut s = self.state.lock().unwrap();
        if s.is_down() {
            return;
        }
        let d = &self.dice;
        if d.chance(0.08) {
            let size = d.range(24, 3000);
            s.append(size, Body::Other);
        }
        if d.chance(s.params.big_transactions) {
            let n = d.range(50, 600);
            self.big_transaction(&mut s, n);
            return;
        }
        let app = d.range(0, s.apps.len() as u64) as usize;
        let Some(xid) = s.apps[app] else {
            let xid = s.next_xid;
            s.next_xid += 1;
            s.open.insert(xid, Open::default());
            s.apps[app] = Some(xid);
            return;
        };
        match d.range(0, 100) {
            0..40 => self.insert_row(&mut s, xid),
            40..50 if s.params.context && d.chance(0.3) => self.insert_context(&mut s, xid),
            40..50 => self.insert_message(&mut s, xid),
            50..60 => {
                let n = s.written;
                let row = vec![text(&n.to_string()), text("12.50")];
                let idx = s.append(d.range(40, 90), Body::Change(Change::Orders(row)));
                s.open.get_mut(&xid).unwrap().changes.push(idx);
            }
            60..88 => {
                self.commit(&mut s, xid);
                s.apps[app] = None;
            }
            88..91 => {
                if s.open.remove(&xid).is_some_and(|o| !o.changes.is_empty()) {
                    s.append(32, Body::Other);
                }
                s.apps[app] = None;
                trace!(self.trace, "pg xid {xid} aborted");
            }
            _ => {
                // Emitted straight before the commit of this connection's transaction, more often
                // than not: the message's LSN (its record's end) is then that commit's LSN.
                self.stray_message(&mut s);
                if d.chance(0.6) {
                    self.commit(&mut s, xid);
                    s.apps[app] = None;
                }
            }
        }
    }

    /// One transaction of `n` events (rows and transactional messages), committed at once, from a
    /// connection of its own (a batch job beside the applications).
    fn big_transaction(&self, s: &mut State, n: u64) {
        let xid = s.next_xid;
        s.next_xid += 1;
        s.open.insert(xid, Open::default());
        for _ in 0..n {
            if self.dice.chance(0.9) {
                self.insert_row(s, xid);
            } else {
                self.insert_message(s, xid);
            }
        }
        self.commit(s, xid);
    }

    /// One transaction of `n` events at once, more than a replay proof once read (20,000); returns
    /// where its commit record starts (`None` while the server is down).
    pub(crate) fn huge_transaction(&self, n: u64) -> Option<u64> {
        let mut s = self.state.lock().unwrap();
        if s.is_down() {
            return None;
        }
        self.big_transaction(&mut s, n);
        Some(s.units.last().map_or(0, |u| u.start))
    }

    /// Commits or aborts every open transaction: the applications stop writing.
    pub(crate) fn finish_writes(&self) {
        let mut s = self.state.lock().unwrap();
        let xids: Vec<u32> = s.open.keys().copied().collect();
        for xid in xids {
            self.commit(&mut s, xid);
        }
        s.apps.iter_mut().for_each(|a| *a = None);
    }

    /// A retention job's transaction: deletes the `n` oldest outbox rows it has not deleted yet
    /// (of the units in the current history), committed at once. Its changes are no events; with a
    /// publication that publishes deletes they reach the relay, and a look for waiting events must
    /// see past them (`status`, `slot_scan.rs`). Draws nothing from the world's generator.
    pub(crate) fn retention_delete(&self, n: usize) {
        let mut s = self.state.lock().unwrap();
        if s.is_down() {
            return;
        }
        let mut next = s.deleted.min(s.units.len());
        let mut ids: Vec<String> = Vec::new();
        while ids.len() < n && next < s.units.len() {
            // A non-transactional message is no row.
            if s.units[next].what.starts_with("transaction") {
                ids.extend(s.units[next].events.iter().map(|e| e.msg_id.clone()));
            }
            next += 1;
        }
        s.deleted = next;
        if ids.is_empty() {
            return;
        }
        let xid = s.next_xid;
        s.next_xid += 1;
        let mut open = Open::default();
        for id in &ids {
            let mut key = vec![text(id)];
            key.resize(outbox_relation().columns.len(), TupleValue::Null);
            open.changes
                .push(s.append(60, Body::Change(Change::OutboxDelete(key))));
        }
        s.open.insert(xid, open);
        trace!(
            self.trace,
            "pg retention job deletes {} outbox rows",
            ids.len()
        );
        self.commit(&mut s, xid);
    }

    fn new_event(&self, s: &mut State) -> (u64, String) {
        s.written += 1;
        let n = s.written;
        let d = &self.dice;
        let id = format!(
            "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
            d.next_u64() as u32,
            d.range(0, 0x1_0000),
            d.range(0, 0x1000),
            0x8000 | d.range(0, 0x4000),
            n
        );
        (n, id)
    }

    /// An outbox insert: mostly a good event, sometimes one that cannot be routed (its aggregate
    /// type is no subject token) or one too large for the server's limits.
    fn insert_row(&self, s: &mut State, xid: u32) {
        let d = &self.dice;
        let (n, id) = self.new_event(s);
        let (ty, bad) = if d.chance(0.04) {
            ("bad type", true)
        } else {
            (d.pick(&["order", "claim", "invoice"]), false)
        };
        let big = d.chance(0.01);
        let edge = s.params.edge.filter(|_| d.chance(0.01));
        // Park worlds: a large row surely over the limit (from a generator of its own, so that
        // the other worlds draw as before).
        let mut payload = if let (Some(limit), true) = (s.params.park, big) {
            let pad = "x".repeat(limit + self.poison.range(1, 4_000) as usize);
            format!(r#"{{"n": {n}, "pad": "{pad}"}}"#)
        } else if let Some(limit) = edge {
            // Up to 1,200 bytes below the limit: the member's headers take some hundreds.
            let wrapper = format!(r#"{{"n": {n}, "pad": ""}}"#).len();
            let pad = "x".repeat((limit - d.range(0, 1_200) as usize).saturating_sub(wrapper));
            format!(r#"{{"n": {n}, "pad": "{pad}"}}"#)
        } else if big {
            let pad = "x".repeat(d.range(20_000, 100_000) as usize);
            format!(r#"{{"n": {n}, "pad": "{pad}"}}"#)
        } else {
            format!(r#"{{"n": {n}}}"#)
        };
        let big = big || edge.is_some();
        let event_type = d.pick(&["Created", "Paid", "Shipped"]);
        // Park worlds: a schema poison now and then.
        let schema_poison = s.params.park.is_some()
            && s.schema_broken
            && !big
            && event_type == super::parking::SCHEMA_TYPE
            && self.poison.chance(0.15);
        if schema_poison {
            payload = format!(r#"{{"n": {n}, "bad": true}}"#);
        }
        let aggregate_id = format!("a{}", n % 17);
        let row = vec![
            text(&id),
            text(ty),
            text(&aggregate_id),
            text(event_type),
            text(&payload),
            text("2026-12-02 00:00:00+00"),
            TupleValue::Null,
        ];
        let must = match (bad, big) {
            (true, _) => Must::DeadLetter(None),
            (false, true) => Must::Either,
            (false, false) => Must::Routed(format!("outbox.{ty}")),
        };
        let poison = match (bad, big, schema_poison) {
            (true, _, _) => Some(Poison::Token),
            (false, true, _) => Some(Poison::Size),
            (false, false, true) => Some(Poison::Schema),
            _ => None,
        }
        .filter(|_| s.params.park.is_some());
        let size = 120 + payload.len() as u64;
        let idx = s.append(size, Body::Change(Change::Outbox(row)));
        let open = s.open.get_mut(&xid).unwrap();
        let index = open.events.len() as u32;
        open.changes.push(idx);
        let context = open.context.clone();
        open.events.push(Expected {
            msg_id: id,
            index,
            must,
            context,
            row: true,
            key: (ty.to_owned(), aggregate_id),
            poison,
        });
    }

    /// `pg_logical_emit_message(true, 'outbox', …)`: an event inside the transaction.
    fn insert_message(&self, s: &mut State, xid: u32) {
        let (n, id) = self.new_event(s);
        let ty = self.dice.pick(&["order", "claim"]);
        let content = format!(
            r#"{{"id":"{id}","aggregate_type":"{ty}","aggregate_id":"m{n}","event_type":"Noted","payload":{{"n":{n}}}}}"#
        );
        let idx = s.append(
            48 + content.len() as u64,
            Body::Change(Change::Event(Bytes::from(content))),
        );
        let open = s.open.get_mut(&xid).unwrap();
        let index = open.events.len() as u32;
        open.changes.push(idx);
        let context = open.context.clone();
        open.events.push(Expected {
            msg_id: id,
            index,
            must: Must::Routed(format!("outbox.{ty}")),
            context,
            row: false,
            key: (ty.to_owned(), format!("m{n}")),
            poison: None,
        });
    }

    /// `outbox_context(…)`: a trace context for the transaction's events that follow it.
    fn insert_context(&self, s: &mut State, xid: u32) {
        let d = &self.dice;
        let tp = format!(
            "00-{:016x}{:016x}-{:016x}-01",
            d.next_u64(),
            d.next_u64(),
            d.next_u64()
        );
        let content = format!(r#"{{"traceparent":"{tp}"}}"#);
        let idx = s.append(
            48 + content.len() as u64,
            Body::Change(Change::Context(Bytes::from(content))),
        );
        let open = s.open.get_mut(&xid).unwrap();
        open.changes.push(idx);
        open.context = Some(tp);
    }

    /// `pg_logical_emit_message(false, 'outbox', …)`: atomic with nothing, so the relay must
    /// dead-letter it, under an id made of its LSN, with its payload.
    fn stray_message(&self, s: &mut State) {
        let (n, id) = self.new_event(s);
        let payload = format!(r#"{{"stray":{n}}}"#);
        let content = format!(
            r#"{{"id":"{id}","aggregate_type":"order","aggregate_id":"s{n}","event_type":"Stray","payload":{payload}}}"#
        );
        let idx = s.append(
            48 + content.len() as u64,
            Body::Message(Bytes::from(content.clone())),
        );
        let (start, end) = (s.wal[idx].start, s.wal[idx].end);
        s.units.push(Unit {
            start,
            at: Instant::now(),
            events: vec![Expected {
                msg_id: outbox_relay::event::standalone_id(Lsn(end), content.as_bytes()),
                index: 0,
                must: Must::DeadLetter(Some(Bytes::from(payload))),
                context: None,
                row: false,
                key: ("order".to_owned(), format!("s{n}")),
                poison: s.params.park.map(|_| Poison::Stray),
            }],
            what: format!("non-transactional message at {}", Lsn(end)),
        });
        trace!(self.trace, "pg message {} ends {}", Lsn(start), Lsn(end));
    }

    fn commit(&self, s: &mut State, xid: u32) {
        let Some(open) = s.open.remove(&xid) else {
            return;
        };
        if open.changes.is_empty() {
            // Wrote nothing: no commit record.
            return;
        }
        let ts = self.pg_now();
        let n = open.events.len();
        let idx = s.append(
            40,
            Body::Commit {
                xid,
                ts,
                changes: open.changes,
            },
        );
        let start = s.wal[idx].start;
        trace!(
            self.trace,
            "pg xid {xid} commits at {} with {n} events",
            Lsn(start)
        );
        if !open.events.is_empty() {
            s.units.push(Unit {
                start,
                at: Instant::now(),
                events: open.events,
                what: format!("transaction {xid} committed at {}", Lsn(start)),
            });
        }
    }

    /// `SELECT outbox_requeue(type, id)` (or `outbox_discard`), in a transaction of its own:
    /// the control message with the content sql/09 builds. Returns whether it committed (not
    /// while the server is down).
    pub(crate) fn release(&self, discard: bool, key: &(String, String), request: &str) -> bool {
        let mut s = self.state.lock().unwrap();
        if s.is_down() {
            return false;
        }
        let content = serde_json::json!({
            "op": if discard { "discard" } else { "requeue" },
            "aggregate_type": key.0,
            "aggregate_id": key.1,
            "request": request,
        })
        .to_string();
        let start = self.control(&mut s, content);
        trace!(
            self.trace,
            "pg {} of {}/{} (request {request}) commits at {}",
            if discard { "discard" } else { "requeue" },
            key.0,
            key.1,
            Lsn(start)
        );
        s.releases.push(Release {
            start,
            discard,
            key: key.clone(),
            request: request.to_owned(),
        });
        true
    }

    /// A control message with `content`, in a transaction of its own; where its commit starts.
    fn control(&self, s: &mut State, content: String) -> u64 {
        let xid = s.next_xid;
        s.next_xid += 1;
        let mut open = Open::default();
        open.changes.push(s.append(
            48 + content.len() as u64,
            Body::Change(Change::Control(Bytes::from(content))),
        ));
        s.open.insert(xid, open);
        self.commit(s, xid);
        s.wal.last().map_or(0, |r| r.start)
    }

    /// `SELECT outbox_requeue_event(event_id)` in a transaction of its own, as sql/09 writes it
    /// (`requeue_event.rs`). Returns where its commit starts, `None` while the server is down.
    pub(crate) fn requeue_event(&self, event_id: &str, request: &str) -> Option<u64> {
        let mut s = self.state.lock().unwrap();
        if s.is_down() {
            return None;
        }
        let content = serde_json::json!({
            "op": "requeue_event",
            "event_id": event_id,
            "request": request,
        })
        .to_string();
        let start = self.control(&mut s, content);
        trace!(
            self.trace,
            "pg requeue_event of {event_id} (request {request}) commits at {}",
            Lsn(start)
        );
        Some(start)
    }

    /// The releases written so far, in commit order.
    pub(crate) fn releases(&self) -> Vec<Release> {
        self.state.lock().unwrap().releases.clone()
    }

    /// The applications stop writing payloads the schema refuses (they were fixed).
    pub(crate) fn schema_fixed_in_apps(&self) {
        self.state.lock().unwrap().schema_broken = false;
    }

    /// Whether a transaction still open holds a payload the strict schema refuses: written
    /// before the applications were fixed, it commits after, so the WAL flushed at the fix does
    /// not cover it.
    pub(crate) fn schema_poison_open(&self) -> bool {
        let s = self.state.lock().unwrap();
        s.open
            .values()
            .flat_map(|o| &o.events)
            .any(|e| e.poison == Some(Poison::Schema))
    }

    /// The keys of the poisoned events committed so far (what an operator sees parked).
    pub(crate) fn poisoned_keys(&self) -> Vec<(String, String)> {
        let s = self.state.lock().unwrap();
        let mut keys: Vec<(String, String)> = Vec::new();
        for e in s.units.iter().flat_map(|u| &u.events) {
            if e.poison.is_some_and(|p| p != Poison::Stray) && !keys.contains(&e.key) {
                keys.push(e.key.clone());
            }
        }
        keys
    }

    /// The slot as a checkpoint writes it to disk.
    pub(crate) fn checkpoint(&self) {
        let mut s = self.state.lock().unwrap();
        s.slot.checkpointed = s.slot.confirmed;
    }

    /// A crash-consistent disk snapshot: the WAL so far and the slot as on disk.
    pub(crate) fn snapshot(&self) {
        let mut s = self.state.lock().unwrap();
        let snap = Snapshot {
            records: s.wal.len(),
            end: s.end,
            units: s.units.len(),
            slot: s.slot.checkpointed,
            timeline: s.timeline,
            history_file: s.history_file.clone(),
            mark: s.mark,
        };
        trace!(
            self.trace,
            "pg snapshot at {} (slot {})",
            Lsn(snap.end),
            Lsn(snap.slot)
        );
        s.snapshots.push(snap);
    }

    /// Restores a snapshot taken earlier (false if there is none): the WAL after it is gone and
    /// will be written anew at the same LSNs; the slot is as the snapshot has it. A point-in-time
    /// recovery does the same on a new timeline.
    pub(crate) fn restore(&self, new_timeline: bool) -> bool {
        let mut s = self.state.lock().unwrap();
        if s.snapshots.is_empty() {
            return false;
        }
        let i = self.dice.range(0, s.snapshots.len() as u64) as usize;
        // Later snapshots are of the history this one discards.
        s.snapshots.truncate(i + 1);
        let snap = &s.snapshots[i];
        let (records, end, units, slot) = (snap.records, snap.end, snap.units, snap.slot);
        // The restored server is on the snapshot's timeline, with its history.
        let (timeline, history_file) = (snap.timeline, snap.history_file.clone());
        s.mark = snap.mark;
        s.history_changed = Instant::now();
        s.end_all();
        s.wal.truncate(records);
        s.end = end;
        s.units.truncate(units);
        s.open.clear();
        s.apps.iter_mut().for_each(|a| *a = None);
        s.slot.confirmed = slot;
        s.slot.checkpointed = slot;
        s.slot_taken_back();
        s.epoch += 1;
        s.rewinds.push(units);
        s.timeline = timeline;
        s.history_file = history_file;
        if new_timeline {
            // The recovery ends the old timeline where the restored WAL ends.
            s.switch_timeline(end, "point-in-time recovery");
        }
        trace!(
            self.trace,
            "pg RESTORED to {} (slot {}, timeline {})",
            Lsn(end),
            Lsn(slot),
            s.timeline
        );
        true
    }

    /// A standby takes over: the old primary's connections end and its open transactions die, the
    /// new timeline starts where the standby's WAL ends, and the slot is the standby's synced copy,
    /// which lags the primary's (its last checkpointed position here). Without `lossy` the standby
    /// has every record (a switchover, or a crash with `synchronized_standby_slots`: the relay was
    /// never sent more than the standby had); with it, a crash without that setting, the standby
    /// lacks the last records, which the relay may have published. Returns whether anything was
    /// lost. Unreachable while it promotes.
    pub(crate) fn promote(&self, down_for: Duration, lossy: bool) -> bool {
        let mut s = self.state.lock().unwrap();
        s.end_all();
        s.open.clear();
        s.apps.iter_mut().for_each(|a| *a = None);
        s.slot.confirmed = s.slot.checkpointed;
        s.slot_taken_back();
        s.epoch += 1;
        let had = s.wal.len();
        if lossy {
            // The standby's WAL reaches at least the slot's copy, which it has on disk, and the
            // start of the current timeline, which it followed.
            let slot = s.slot.confirmed;
            let needed = if slot > WAL_START {
                (s.wal.partition_point(|r| r.end < slot) + 1).min(had)
            } else {
                0
            };
            let timeline_start = TimelineHistory::parse(s.timeline, &s.history_file)
                .expect("the simulated history file parses")
                .ancestors()
                .last()
                .map_or(WAL_START, |a| a.end.0);
            let needed = needed.max(s.wal.partition_point(|r| r.start < timeline_start));
            let kept = self.dice.range(needed as u64, had as u64 + 1) as usize;
            s.wal.truncate(kept);
            s.end = s.wal.last().map_or(WAL_START, |r| r.next);
            let end = s.end;
            let units = s.units.partition_point(|u| u.start < end);
            s.units.truncate(units);
            s.rewinds.push(units);
            // A snapshot past the switch point is of WAL the new timeline does not have.
            s.snapshots.retain(|snap| snap.records <= kept);
        }
        let lost = s.wal.len() < had;
        // The mark is a slot of the old primary's own (no failover slot): the standby lacks it.
        s.mark = None;
        s.history_changed = Instant::now();
        let switch = s.end;
        s.switch_timeline(switch, "no recovery target specified");
        s.down_until = Some(Instant::now() + down_for);
        trace!(
            self.trace,
            "pg PROMOTED: timeline {} from {}{}, slot at {}, down {down_for:?}",
            s.timeline,
            Lsn(switch),
            if lost { " (the last records lost)" } else { "" },
            Lsn(s.slot.confirmed)
        );
        lost
    }

    /// The server crashes and restarts: connections end, open transactions die, and the slot is
    /// back at its last checkpoint (its confirmed position lives in memory until then).
    pub(crate) fn crash(&self, down_for: Duration) {
        let mut s = self.state.lock().unwrap();
        s.end_all();
        s.open.clear();
        s.apps.iter_mut().for_each(|a| *a = None);
        s.slot.confirmed = s.slot.checkpointed;
        s.slot_taken_back();
        s.epoch += 1;
        s.down_until = Some(Instant::now() + down_for);
        trace!(
            self.trace,
            "pg crash: slot back to {}, down {down_for:?}",
            Lsn(s.slot.confirmed)
        );
    }

    /// The server cannot be reached for a while (its connections end; nothing is lost).
    pub(crate) fn unreachable(&self, down_for: Duration) {
        let mut s = self.state.lock().unwrap();
        s.end_all();
        s.down_until = Some(Instant::now() + down_for);
        trace!(self.trace, "pg unreachable for {down_for:?}");
    }

    pub(crate) fn up(&self) {
        self.state.lock().unwrap().down_until = None;
    }

    /// Every replication connection is cut.
    pub(crate) fn cut(&self) {
        let mut s = self.state.lock().unwrap();
        trace!(self.trace, "pg connections cut ({})", s.conns.len());
        s.end_all();
    }

    /// Every replication connection stops carrying anything, both ways; the walsender notices
    /// after `wal_sender_timeout` and only then lets go of the slot.
    pub(crate) fn black_hole(&self, timeout: Duration) {
        let mut s = self.state.lock().unwrap();
        let until = Instant::now() + timeout;
        for c in s.conns.values_mut() {
            c.zombie_until.get_or_insert(until);
            c.wake.notify_one();
        }
        trace!(self.trace, "pg connections black-holed ({})", s.conns.len());
    }

    /// The partition lookup's query.
    pub(crate) fn partitions(&self) -> Result<Vec<u32>, SessionEnd> {
        if self.state.lock().unwrap().is_down() {
            return Err(unreachable_error());
        }
        Ok(Vec::new())
    }

    /// IDENTIFY_SYSTEM and START_REPLICATION from the slot's own position, for relay process
    /// `owner`: the relay's end of the pipe, as a real `ReplicationStream`.
    pub(crate) async fn connect(
        self: &Arc<Self>,
        config: StreamConfig,
        owner: u64,
    ) -> Result<(ReplicationStream, SystemInfo), SessionEnd> {
        // Connecting and authenticating take a moment.
        tokio::time::sleep(self.dice.millis(0, 15)).await;
        let (id, wake, kill, pipe, info) = {
            let mut s = self.state.lock().unwrap();
            if s.is_down() {
                return Err(unreachable_error());
            }
            if !s.slot.exists {
                trace!(self.trace, "pg START refused: the slot does not exist");
                return Err(from_source(SourceError::Server {
                    context: "START_REPLICATION",
                    error: Box::new(ServerError {
                        severity: "ERROR".into(),
                        code: "42704".into(),
                        message: "replication slot \"outbox_relay\" does not exist".into(),
                        detail: None,
                        hint: None,
                    }),
                }));
            }
            if self.js.backfill_marked() {
                self.violations.report(
                    &self.trace,
                    "a relay session takes the slot while a backfill marker guards it (the backfill has not \
                     finished: the slot may stand past rows it never published)"
                        .into(),
                );
            }
            if let Some(active) = s.slot.active {
                trace!(
                    self.trace,
                    "pg START refused: slot active for conn {active}"
                );
                return Err(from_source(SourceError::Server {
                    context: "START_REPLICATION",
                    error: Box::new(ServerError {
                        severity: "ERROR".into(),
                        code: "55006".into(),
                        message: format!(
                            "replication slot \"outbox_relay\" is active for PID {}",
                            pid(active)
                        ),
                        detail: None,
                        hint: None,
                    }),
                }));
            }
            let info = identify(&s);
            // The relay starts from the slot's own position (0/0), as on a real connection.
            let start = Start::FROM_SLOT;
            // logical.c CreateDecodingContext: a start before confirmed_flush "has been already
            // streamed, forwarding to" confirmed_flush.
            let from = start.0.max(s.slot.confirmed);
            let cursor = s.wal.partition_point(|r| r.start < from);
            let id = s.next_conn;
            s.next_conn += 1;
            let wake = Arc::new(Notify::new());
            let (kill, _) = watch::channel(false);
            let epoch = s.epoch;
            s.conns.insert(
                id,
                Conn {
                    owner,
                    epoch,
                    start: from,
                    cursor,
                    sent: from,
                    relations: BTreeSet::new(),
                    copy: Copy::Streaming,
                    zombie_until: None,
                    reply_now: false,
                    keepalive_at: None,
                    reported: 0,
                    wake: Arc::clone(&wake),
                    kill: kill.clone(),
                },
            );
            s.slot.active = Some(id);
            trace!(
                self.trace,
                "pg conn {id}: START at {start}, streams from {}, WAL flushed to {}",
                Lsn(from),
                info.xlogpos
            );
            (id, wake, kill, s.params.pipe, info)
        };
        let (relay_end, our_end) = tokio::io::duplex(pipe);
        let (rd, wr) = tokio::io::split(our_end);
        tokio::spawn(Arc::clone(self).send_loop(id, wr, wake, kill.subscribe()));
        tokio::spawn(Arc::clone(self).receive_loop(id, rd, kill.subscribe()));
        let start = Start::FROM_SLOT;
        let stream = ReplicationStream::over(relay_end, start, config).with_backend_pid(pid(id));
        Ok((stream, info))
    }

    /// The walsender's sending side.
    async fn send_loop(
        self: Arc<Self>,
        id: u64,
        mut wr: WriteHalf<DuplexStream>,
        wake: Arc<Notify>,
        mut kill: watch::Receiver<bool>,
    ) {
        loop {
            match self.next_out(id) {
                Out::Close => return,
                Out::Send(bytes) => {
                    tokio::select! {
                        biased;
                        _ = kill.wait_for(|k| *k) => return,
                        r = wr.write_all(&bytes) => if r.is_err() {
                            self.ended(id, "the relay closed the connection");
                            return;
                        },
                    }
                }
                Out::Wait(until) => {
                    let until = until.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
                    tokio::select! {
                        biased;
                        _ = kill.wait_for(|k| *k) => return,
                        _ = wake.notified() => {}
                        _ = tokio::time::sleep_until(until) => {}
                    }
                }
            }
        }
    }

    fn next_out(&self, id: u64) -> Out {
        let mut guard = self.state.lock().unwrap();
        let s = &mut *guard;
        let now = Instant::now();
        let time = self.pg_now();
        let Some(conn) = s.conns.get_mut(&id) else {
            return Out::Close;
        };
        if let Some(until) = conn.zombie_until {
            if now < until {
                return Out::Wait(Some(until));
            }
            trace!(
                self.trace,
                "pg conn {id}: wal_sender_timeout, walsender exits"
            );
            s.end_conn(id);
            return Out::Close;
        }
        match conn.copy {
            Copy::Streaming => {}
            Copy::DoneReceived => {
                let mut out = BytesMut::new();
                copy_finished(&mut out);
                conn.copy = Copy::Finished;
                return Out::Send(out.freeze());
            }
            Copy::Finished => return Out::Wait(None),
        }
        let mut out = BytesMut::new();
        if conn.reply_now {
            conn.reply_now = false;
            keepalive(&mut out, conn.sent, time, false);
        }
        let mut n = 0;
        while conn.cursor < s.wal.len() && n < BATCH_RECORDS && out.len() < 32 << 10 {
            let rec = &s.wal[conn.cursor];
            conn.cursor += 1;
            n += 1;
            decode(
                rec,
                &s.wal,
                conn.start,
                &mut conn.relations,
                &s.params,
                &mut |lsn, msg| xlog(&mut out, lsn, msg, time),
            );
            conn.sent = conn.sent.max(rec.end);
            if self.dice.chance(0.02) {
                keepalive(&mut out, conn.sent, time, self.dice.chance(0.3));
            }
        }
        if !out.is_empty() {
            conn.keepalive_at = None;
            return Out::Send(out.freeze());
        }
        // Caught up: a keepalive with the position decoded so far, soon while the relay has not
        // confirmed that far (walsender.c WalSndWaitForWal), else every wal_sender_timeout / 2.
        let (lo, hi) = if conn.reported < conn.sent {
            s.params.keepalive_ms
        } else {
            (10_000, 30_000)
        };
        let at = *conn
            .keepalive_at
            .get_or_insert_with(|| now + self.dice.millis(lo, hi));
        if now < at {
            return Out::Wait(Some(at));
        }
        conn.keepalive_at = None;
        keepalive(&mut out, conn.sent, time, self.dice.chance(0.1));
        Out::Send(out.freeze())
    }

    /// The walsender's receiving side: status updates, CopyDone, Terminate.
    async fn receive_loop(
        self: Arc<Self>,
        id: u64,
        mut rd: ReadHalf<DuplexStream>,
        mut kill: watch::Receiver<bool>,
    ) {
        let mut buf = BytesMut::with_capacity(1024);
        loop {
            let zombie = self
                .state
                .lock()
                .unwrap()
                .conns
                .get(&id)
                .map(|c| c.zombie_until);
            match zombie {
                None => return,
                Some(Some(until)) => {
                    // Reads nothing: the relay's status updates pile up in the pipe.
                    tokio::select! {
                        biased;
                        _ = kill.wait_for(|k| *k) => {}
                        _ = tokio::time::sleep_until(until) => {}
                    }
                    return;
                }
                Some(None) => {}
            }
            let read = tokio::select! {
                biased;
                _ = kill.wait_for(|k| *k) => return,
                r = rd.read_buf(&mut buf) => r,
            };
            match read {
                Ok(0) | Err(_) => {
                    self.ended(id, "the relay closed the connection");
                    return;
                }
                Ok(_) => {}
            }
            while buf.len() >= 5 {
                let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                if buf.len() < 1 + len {
                    break;
                }
                let frame = buf.split_to(1 + len);
                match (frame[0], frame.get(5)) {
                    (b'd', Some(b'r')) if frame.len() >= 5 + 34 => {
                        let flush = u64::from_be_bytes(frame[14..22].try_into().unwrap());
                        self.status_update(id, flush, frame[38] != 0);
                        if let Some(hook) = &*self.on_status.lock().unwrap() {
                            hook(&self);
                        }
                    }
                    (b'c', _) => self.copy_done(id),
                    (b'X', _) => {
                        self.ended(id, "Terminate");
                        return;
                    }
                    (tag, _) => {
                        self.violations.report(
                            &self.trace,
                            format!("the relay sent an unexpected message {:?} on the replication connection", char::from(tag)),
                        );
                    }
                }
            }
        }
    }

    fn ended(&self, id: u64, why: &str) {
        let mut s = self.state.lock().unwrap();
        if s.conns.contains_key(&id) {
            trace!(self.trace, "pg conn {id} ends: {why}");
            s.end_conn(id);
        }
    }

    fn copy_done(&self, id: u64) {
        let mut s = self.state.lock().unwrap();
        if let Some(c) = s.conns.get_mut(&id) {
            if c.copy == Copy::Streaming {
                c.copy = Copy::DoneReceived;
            }
            c.wake.notify_one();
        }
    }

    /// A standby status update: `flush` is what the relay confirms. P2 is checked here.
    fn status_update(&self, id: u64, flush: u64, reply: bool) {
        let mut guard = self.state.lock().unwrap();
        let s = &mut *guard;
        let Some(conn) = s.conns.get_mut(&id) else {
            return;
        };
        if conn.epoch != s.epoch || conn.zombie_until.is_some() {
            return;
        }
        if reply {
            conn.reply_now = true;
            conn.wake.notify_one();
        }
        conn.reported = conn.reported.max(flush);
        if flush <= s.slot.confirmed {
            return;
        }
        if flush > s.end {
            self.violations.report(
                &self.trace,
                format!(
                    "P2: the relay confirmed {} beyond the server's WAL end {}: every transaction committed \
                     below it from now on is skipped",
                    Lsn(flush),
                    Lsn(s.end)
                ),
            );
        }
        let from = s.units.partition_point(|u| u.start < s.slot.confirmed);
        for unit in &s.units[from..] {
            if unit.start >= flush {
                break;
            }
            for e in &unit.events {
                if !self.js.holds(&e.msg_id, unit.at) {
                    self.violations.report(
                        &self.trace,
                        format!(
                            "P2: the slot was confirmed to {} past the {}, whose event {} is not in the stream",
                            Lsn(flush),
                            unit.what,
                            e.msg_id
                        ),
                    );
                }
            }
        }
        for c in &s.consumptions {
            if let (Some(Ok(n)), false) = (&c.demanded, c.reported) {
                self.violations.report(
                    &self.trace,
                    format!(
                        "P9: the slot was confirmed to {} after a client consumed it from {} to {} past {n} events \
                         the stream lacks, and the relay never reported it (outbox_relay_slot_consumed_events)",
                        Lsn(flush),
                        Lsn(c.from),
                        Lsn(c.to)
                    ),
                );
            }
        }
        s.slot.confirmed = flush;
        s.confirmations.push((Instant::now(), flush));
        trace!(self.trace, "pg slot confirmed {}", Lsn(flush));
    }
}

/// The walsender pid of replication connection `conn` (what 55006 names, and the stop mark is made
/// under).
fn pid(conn: u64) -> i32 {
    40_000 + conn as i32
}

/// The stop mark and the clients other than a relay that consume the slot (docs/guarantees.md P9).
impl Postgres {
    /// The slot's position as a control connection reads it (`None`: the server is unreachable).
    pub(crate) fn slot_position(&self) -> Option<u64> {
        let s = self.state.lock().unwrap();
        (!s.is_down()).then_some(s.slot.confirmed)
    }

    /// What `slot_mark::leave` reads: the slot's position while walsender `pid` holds it (`Ok(None)`:
    /// it does not), `Err` when the server cannot be reached.
    pub(crate) fn slot_held_by(&self, walsender: i32) -> Result<Option<u64>, ()> {
        let s = self.state.lock().unwrap();
        if s.is_down() {
            return Err(());
        }
        Ok(s.slot
            .active
            .filter(|&c| pid(c) == walsender)
            .map(|_| s.slot.confirmed))
    }

    /// `pg_copy_logical_replication_slot` as `slot_mark::leave` asks for it: only while walsender
    /// `pid` holds the slot and no mark exists. Returns whether a mark was made.
    pub(crate) fn copy_mark(&self, walsender: i32) -> bool {
        let mut s = self.state.lock().unwrap();
        if s.is_down() || s.mark.is_some() || s.slot.active.is_none_or(|c| pid(c) != walsender) {
            return false;
        }
        s.marks += 1;
        let mark = Mark {
            at: s.slot.confirmed,
            serial: s.marks,
        };
        s.mark = Some(mark);
        trace!(
            self.trace,
            "pg stop mark {} made at {}",
            mark.serial,
            Lsn(mark.at)
        );
        true
    }

    /// The mark and what a peek of it up to `slot_at` hands over, as pgoutput (`None`: no mark).
    pub(crate) fn mark_view(&self, slot_at: u64) -> Option<super::peek::MarkView> {
        let s = self.state.lock().unwrap();
        mark_of(&s, slot_at)
    }

    /// What `status` reads of the slot, and what the simulator knows of it, at one moment (`None`:
    /// the server is unreachable): the slot (who holds it, where it stands), what a peek of a copy
    /// of it hands over while no walsender holds it (from its position on, `rows` pgoutput rows at
    /// least: the rest of a transaction the bound ends in is handed over whole), the stop mark, and the units of work
    /// the slot has not confirmed (their deciding record at or past its position: a walsender
    /// started from it sends them).
    pub(crate) fn status_view(&self, rows: usize) -> Option<(super::status::SlotView, Vec<Unit>)> {
        let s = self.state.lock().unwrap();
        if s.is_down() {
            return None;
        }
        let at = s.slot.confirmed;
        // `status` peeks only at a slot no one streams.
        let changes = if s.slot.active.is_none() {
            peek(&s, at, u64::MAX, rows)
        } else {
            Vec::new()
        };
        let pending = s.units.iter().filter(|u| u.start >= at).cloned().collect();
        let slot = super::status::SlotView {
            active_pid: s.slot.active.map(pid),
            confirmed: Lsn(at),
            changes,
            mark: mark_of(&s, at),
            relay_pids: Vec::new(),
        };
        Some((slot, pending))
    }

    /// The relay process whose walsender holds the slot, with the server up (`None`: none holds
    /// it). A killed process's black-holed walsender holds it too, for no session.
    pub(crate) fn slot_holder(&self) -> Option<u64> {
        let s = self.state.lock().unwrap();
        if s.is_down() {
            return None;
        }
        s.slot.active.and_then(|c| s.conns.get(&c)).map(|c| c.owner)
    }

    /// Whether a stop mark exists.
    pub(crate) fn has_mark(&self) -> bool {
        self.state.lock().unwrap().mark.is_some()
    }

    /// `pg_drop_replication_slot` of the mark, by `who` (a relay's start, the operator).
    pub(crate) fn drop_mark(&self, who: &str) {
        let mut s = self.state.lock().unwrap();
        if let Some(m) = s.mark.take() {
            trace!(self.trace, "pg stop mark {} dropped by {who}", m.serial);
        }
    }

    /// Another client consumes the slot up to the end of the WAL (`pg_logical_slot_get_changes`) or
    /// advances it to a record boundary on the way (`upto_lsn`, `pg_replication_slot_advance`),
    /// when no walsender holds it and the server is up. Returns whether the slot moved.
    pub(crate) fn consume(&self) -> bool {
        let facts = self.js.facts();
        let messages = self.js.messages();
        let mut s = self.state.lock().unwrap();
        if s.is_down() || s.slot.active.is_some() {
            return false;
        }
        let from = s.slot.confirmed;
        let first = s.wal.partition_point(|r| r.start < from);
        if first >= s.wal.len() {
            return false;
        }
        let to = if self.dice.chance(0.5) {
            s.end
        } else {
            s.wal[self.dice.range(first as u64, s.wal.len() as u64) as usize].next
        };
        let skipped: Vec<Skipped> = s
            .units
            .iter()
            .filter(|u| from <= u.start && u.start < to)
            .map(|u| Skipped {
                start: u.start,
                at: u.at,
                ids: u.events.iter().map(|e| e.msg_id.clone()).collect(),
            })
            .collect();
        // What the relay's next start compares with (slot_mark::Stored::from_tail).
        let tail = match messages.last() {
            None => Ok(()),
            Some(m) if m.gone => Err("the stream's last message is gone".to_owned()),
            Some(m) if m.foreign => Err("the stream's last message is another writer's".to_owned()),
            Some(m) => match facts.sessions.get(&m.session) {
                Some((_, began)) if *began > s.history_changed => Ok(()),
                _ => Err(
                    "the stream's last message was stored by a session of an earlier history"
                        .to_owned(),
                ),
            },
        };
        let n: usize = skipped.iter().map(|u| u.ids.len()).sum();
        trace!(
            self.trace,
            "pg slot CONSUMED by another client from {} to {} ({} units, {n} events), stop mark {:?}",
            Lsn(from),
            Lsn(to),
            skipped.len(),
            s.mark
        );
        let era = (facts.distrust.len(), s.rewinds.len(), s.timeline);
        let mark = s.mark;
        s.consumptions.push(Consumption {
            at: Instant::now(),
            from,
            to,
            skipped,
            mark,
            tail,
            era,
            demanded: None,
            reported: false,
        });
        s.slot.confirmed = to;
        true
    }

    /// A session that holds the slot is about to look at the stop mark (its `slot_check`): each
    /// consumption since the last look decides whether the relay must report it, by what the
    /// simulators saw alone (the stream's messages past `max_age` removed first, as the relay's read
    /// of the tail would). Demanded when a stop mark stood at or before
    /// where the consumer began and still stands, the stream's last message then was the relay's
    /// own from this history and still is (no distrust event, rewind or new timeline since), and
    /// events the consumer skipped below the slot's position are not in the stream. Anything else is
    /// what docs/guarantees.md P9 says the mark cannot see ("What it cannot see": a relay that died
    /// without ending its session, Postgres gone first, a failover; a stream whose last message is
    /// gone or not the relay's).
    pub(crate) fn judge_consumptions(&self) {
        if self
            .state
            .lock()
            .unwrap()
            .consumptions
            .iter()
            .all(|c| c.demanded.is_some())
        {
            return;
        }
        let _ = self.js.stream_state(STREAM);
        let distrust = self.js.facts().distrust.len();
        let mut guard = self.state.lock().unwrap();
        let s = &mut *guard;
        let era = (distrust, s.rewinds.len(), s.timeline);
        let (mark, slot) = (s.mark, s.slot.confirmed);
        for c in s.consumptions.iter_mut().filter(|c| c.demanded.is_none()) {
            let verdict = if c.mark.is_none_or(|m| m.at > c.from) {
                Err("no stop mark stood before it".to_owned())
            } else if mark != c.mark {
                Err("the stop mark is gone since (a promotion, a restore)".to_owned())
            } else if let Err(why) = &c.tail {
                Err(why.clone())
            } else if c.era != era {
                Err("the stream or the server's history changed since".to_owned())
            } else {
                let lacking = c
                    .skipped
                    .iter()
                    .filter(|u| u.start < slot)
                    .flat_map(|u| u.ids.iter().map(move |id| (id, u.at)))
                    .filter(|(id, at)| !self.js.holds(id, *at))
                    .count();
                if lacking > 0 {
                    Ok(lacking)
                } else {
                    Err("the stream lacks no event it skipped below the slot".to_owned())
                }
            };
            trace!(
                self.trace,
                "consumption from {} to {}: the relay {}",
                Lsn(c.from),
                Lsn(c.to),
                match &verdict {
                    Ok(n) => format!("must report {n} events before it confirms anything"),
                    Err(why) => format!("need not report it: {why}"),
                }
            );
            c.demanded = Some(verdict);
        }
    }

    /// The operator saw the relay report a consumption: every one judged so far counts as reported.
    pub(crate) fn consumption_reported(&self) {
        let mut s = self.state.lock().unwrap();
        for c in s.consumptions.iter_mut().filter(|c| c.demanded.is_some()) {
            c.reported = true;
        }
    }

    /// The ids of every event another client consumed from the slot, with when it did (the
    /// first time): the stream may lack them, or get them back after a rewind of the slot.
    pub(crate) fn consumed(&self) -> HashMap<String, Instant> {
        let s = self.state.lock().unwrap();
        let mut ids = HashMap::new();
        for c in &s.consumptions {
            for id in c.skipped.iter().flat_map(|u| &u.ids) {
                ids.entry(id.clone()).or_insert(c.at);
            }
        }
        // A backfill's new slot leaves behind the logical messages of the old one's history that
        // the stream lacked: no backfill reads them (they are no rows).
        for (id, at) in &s.backfill.left_behind {
            ids.entry(id.clone()).or_insert(*at);
        }
        ids
    }
}

/// What IDENTIFY_SYSTEM answers of `s`, with TIMELINE_HISTORY on the same connection parsed as the
/// relay parses the real one.
fn identify(s: &State) -> SystemInfo {
    SystemInfo {
        system_id: s.system_id.clone(),
        timeline: s.timeline,
        xlogpos: Lsn(s.flushed()),
        dbname: Some("postgres".into()),
        history: TimelineHistory::parse(s.timeline, &s.history_file)
            .expect("the simulated history file parses"),
    }
}

/// The stop mark and what a peek of it up to `slot_at` hands over (`None`: no mark).
fn mark_of(s: &State, slot_at: u64) -> Option<super::peek::MarkView> {
    let mark = s.mark?;
    Some(super::peek::MarkView {
        at: Lsn(mark.at),
        changes: peek(s, mark.at, slot_at, usize::MAX),
    })
}

/// What `pg_logical_slot_peek_binary_changes` hands over of a slot (or a copy of it) at `from`, up
/// to records starting before `upto`: pgoutput's rows, one list per record that sends any (a
/// transaction at its commit, a non-transactional message), until at least `rows` rows.
fn peek(s: &State, from: u64, upto: u64, rows: usize) -> Vec<Vec<(Lsn, Bytes)>> {
    let mut relations = BTreeSet::new();
    let mut changes = Vec::new();
    let mut n = 0;
    let first = s.wal.partition_point(|r| r.start < from);
    for rec in s.wal[first..].iter().take_while(|r| r.start < upto) {
        if n >= rows {
            break;
        }
        let mut out = Vec::new();
        decode(
            rec,
            &s.wal,
            from,
            &mut relations,
            &s.params,
            &mut |lsn, msg| out.push((Lsn(lsn), encode::message(msg))),
        );
        if !out.is_empty() {
            n += out.len();
            changes.push(out);
        }
    }
    changes
}

/// What a backfill asks of the server (`backfill.rs` in this directory): the slot dropped and
/// created with an exported snapshot, the snapshot's rows.
impl Postgres {
    /// The slot as setup finds it: the walsender pid streaming it, its confirmed position.
    pub(crate) fn slot_found(&self) -> Option<(Option<i32>, Lsn)> {
        let s = self.state.lock().unwrap();
        s.slot
            .exists
            .then(|| (s.slot.active.map(pid), Lsn(s.slot.confirmed)))
    }

    pub(crate) fn slot_exists(&self) -> bool {
        self.state.lock().unwrap().slot.exists
    }

    /// `pg_drop_replication_slot`: refused while a walsender holds it, or when there is none.
    pub(crate) fn drop_slot(&self, who: &str, if_exists: bool) -> Result<(), (bool, String)> {
        let mut s = self.state.lock().unwrap();
        if s.is_down() {
            return Err((false, "connection refused (simulated outage)".into()));
        }
        if !s.slot.exists {
            return if if_exists {
                Ok(())
            } else {
                Err((
                    false,
                    "replication slot \"outbox_relay\" does not exist (42704)".into(),
                ))
            };
        }
        if let Some(active) = s.slot.active {
            return Err((
                true,
                format!(
                    "replication slot \"outbox_relay\" is active for PID {} (55006)",
                    pid(active)
                ),
            ));
        }
        s.slot.exists = false;
        trace!(self.trace, "pg slot dropped by {who}");
        Ok(())
    }

    /// What IDENTIFY_SYSTEM answers now.
    pub(crate) fn system_info(&self) -> SystemInfo {
        identify(&self.state.lock().unwrap())
    }

    /// A new walsender's pid for a backfill's replication connection.
    pub(crate) fn backfill_walsender(&self) -> i32 {
        let mut s = self.state.lock().unwrap();
        s.backfill.walsenders += 1;
        90_000 + s.backfill.walsenders
    }

    /// `pg_cancel_backend(pid)`.
    pub(crate) fn cancel_backend(&self, pid: i32) {
        self.state.lock().unwrap().backfill.cancelled.insert(pid);
    }

    /// `CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')` on walsender `walsender`, done: the consistent
    /// point is where the next WAL record starts, so that every transaction committed before is in
    /// the snapshot and every one after flows through the slot (an open transaction's changes may lie
    /// before it: it is sent whole at its commit). The snapshot holds the outbox rows committed
    /// before it, in `event_id` order (the default `--order-by`); the logical messages of that
    /// history the stream lacks are left behind (a backfill publishes rows only).
    pub(crate) fn create_backfill_slot(&self, walsender: i32) -> Result<(Lsn, String), String> {
        let mut guard = self.state.lock().unwrap();
        let s = &mut *guard;
        if s.backfill.cancelled.contains(&walsender) {
            return Err("canceling statement due to user request (57014)".into());
        }
        if s.is_down() {
            return Err("server closed the connection unexpectedly".into());
        }
        if s.slot.exists {
            return Err("replication slot \"outbox_relay\" already exists (42710)".into());
        }
        let cp = s.end;
        let mut rows: Vec<Vec<Option<Bytes>>> = Vec::new();
        for r in s.wal.iter().take_while(|r| r.start < cp) {
            let Body::Commit { changes, .. } = &r.body else {
                continue;
            };
            for &i in changes {
                if let Body::Change(Change::Outbox(row)) = &s.wal[i].body {
                    rows.push(
                        row.iter()
                            .map(|v| match v {
                                TupleValue::Text(b) => Some(b.clone()),
                                _ => None,
                            })
                            .collect(),
                    );
                }
            }
        }
        rows.sort_by(|a, b| a[0].cmp(&b[0]));
        let now = Instant::now();
        for u in s.units.iter().take_while(|u| u.start < cp) {
            for e in u.events.iter().filter(|e| !e.row) {
                if !self.js.holds(&e.msg_id, u.at) {
                    s.backfill.left_behind.push((e.msg_id.clone(), now));
                }
            }
        }
        s.slot = Slot {
            confirmed: cp,
            checkpointed: cp,
            active: None,
            exists: true,
        };
        s.backfill.slots += 1;
        let name = format!("00000003-{:08X}-1", s.backfill.slots);
        trace!(
            self.trace,
            "pg slot created by a backfill at {} with snapshot {name} of {} rows",
            Lsn(cp),
            rows.len()
        );
        s.backfill.snapshots.insert(name.clone(), rows);
        Ok((Lsn(cp), name))
    }

    /// The rows of an exported snapshot, while its replication connection is open.
    pub(crate) fn snapshot_rows(&self, name: &str) -> Option<Vec<Vec<Option<Bytes>>>> {
        self.state
            .lock()
            .unwrap()
            .backfill
            .snapshots
            .get(name)
            .cloned()
    }

    /// The replication connection that exported `name` closed.
    pub(crate) fn release_snapshot(&self, name: &str) {
        self.state.lock().unwrap().backfill.snapshots.remove(name);
    }

    /// The columns of the outbox table, as `pg_attribute` lists them.
    pub(crate) fn outbox_columns() -> Vec<Column> {
        outbox_relation()
            .columns
            .into_iter()
            .map(|c| Column { flags: 0, ..c })
            .collect()
    }
}

/// What pgoutput sends for one WAL record, if anything, handed to `emit` as (LSN, message): to a
/// walsender's connection (`start` its start, `relations` those it described) or to a peek of the
/// stop mark.
fn decode(
    rec: &Record,
    wal: &[Record],
    start: u64,
    relations: &mut BTreeSet<u32>,
    params: &PgParams,
    emit: &mut dyn FnMut(u64, &Message),
) {
    match &rec.body {
        Body::Commit { xid, ts, changes } if rec.start >= start => {
            let sent = |c: &usize| match &wal[*c].body {
                Body::Change(Change::Orders(_)) => params.publish_orders,
                Body::Change(Change::OutboxDelete(_)) => params.publish_deletes,
                _ => true,
            };
            if !changes.iter().any(sent) && !params.send_empty {
                // Since PG 15 a transaction with nothing to send is skipped whole.
                return;
            }
            let first = changes.first().map_or(rec.start, |&c| wal[c].start);
            emit(
                first,
                &Message::Begin {
                    final_lsn: Lsn(rec.start),
                    commit_ts: *ts,
                    xid: *xid,
                },
            );
            for &c in changes.iter().filter(|c| sent(c)) {
                let change = &wal[c];
                let Body::Change(kind) = &change.body else {
                    continue;
                };
                let (relation, msg) = match kind {
                    Change::Outbox(row) => (
                        Some(outbox_relation()),
                        Message::Insert {
                            xid: None,
                            relation_id: OUTBOX_OID,
                            new: row.clone(),
                        },
                    ),
                    Change::Orders(row) => (
                        Some(orders_relation()),
                        Message::Insert {
                            xid: None,
                            relation_id: ORDERS_OID,
                            new: row.clone(),
                        },
                    ),
                    Change::OutboxDelete(key) => (
                        Some(outbox_relation()),
                        Message::Delete {
                            xid: None,
                            relation_id: OUTBOX_OID,
                            old: OldTuple::Key(key.clone()),
                        },
                    ),
                    Change::Event(content) => (
                        None,
                        Message::Message {
                            xid: None,
                            transactional: true,
                            lsn: Lsn(change.end),
                            prefix: PREFIX.into(),
                            content: content.clone(),
                        },
                    ),
                    Change::Context(content) => (
                        None,
                        Message::Message {
                            xid: None,
                            transactional: true,
                            lsn: Lsn(change.end),
                            prefix: CONTEXT_PREFIX.into(),
                            content: content.clone(),
                        },
                    ),
                    Change::Control(content) => (
                        None,
                        Message::Message {
                            xid: None,
                            transactional: true,
                            lsn: Lsn(change.end),
                            prefix: outbox_relay::parking::control::CONTROL_PREFIX.into(),
                            content: content.clone(),
                        },
                    ),
                };
                // pgoutput describes a relation before its first change on each connection.
                if let Some(rel) = relation
                    && relations.insert(rel.id)
                {
                    emit(0, &Message::Relation(rel));
                }
                emit(change.start, &msg);
            }
            emit(
                rec.start,
                &Message::Commit {
                    flags: 0,
                    commit_lsn: Lsn(rec.start),
                    end_lsn: Lsn(rec.next),
                    commit_ts: *ts,
                },
            );
        }
        Body::Message(content) if rec.start >= start => emit(
            rec.start,
            &Message::Message {
                xid: None,
                transactional: false,
                lsn: Lsn(rec.end),
                prefix: PREFIX.into(),
                content: content.clone(),
            },
        ),
        _ => {}
    }
}

fn unreachable_error() -> SessionEnd {
    from_source(SourceError::Io {
        target: "simulated postgres:5432".into(),
        error: std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused"),
    })
}
