//! One simulated world per seed: the relay's real restart loop (`relay::run_with`) with a
//! `Connector` that hands out the simulated Postgres and JetStream, application writers that keep
//! committing, and faults at random times; then the world settles (faults off, writers done) until
//! the slot has confirmed the whole WAL, and the promises are checked (`check.rs`).
//!
//! Everything runs on one current-thread runtime with a paused clock: time moves only when every
//! task waits, by as much as the next timer needs, so a minute of faults costs milliseconds, and
//! every choice comes from the seed's one generator. The relay's own timers (ack timeout, status
//! interval, backoff) run on the same clock.
//!
//! Faults (`SIM_FAULTS` picks them: `all`, names, `-name` to leave one out):
//!
//! - `kill`: the relay process dies; a new one starts from the slot's confirmed position;
//! - `stop`: the relay is shut down cleanly and started again;
//! - `cut`: the replication connections break;
//! - `blackhole`: they carry nothing more, and the walsender holds the slot until its timeout;
//! - `pg_down`: Postgres is unreachable for a while;
//! - `pg_crash`: Postgres restarts with the slot at its last checkpoint;
//! - `nats_down`: NATS is unreachable, and publishes on the wire are lost;
//! - `transit`: publishes linger on their way to the server (one may land after its session ended);
//! - `answers`: JetStream's answers are slow, late, lost or duplicated;
//! - `forge`: another client plants answers on the relay's inbox, before JetStream's (refused
//!   forms, a duplicate of a sequence never reached) or right behind it (a perfect-looking ack);
//!   to an atomic batch's commit also a batch's own forms: a `duplicate: true` answer, an ack of
//!   exactly the batch's form (`batch`, `count`) behind a refusal or where a lost answer was, a
//!   wrong `count`, an ack of a smaller batch;
//! - `foreign`: a message is published by hand at the stream's tail while no relay runs;
//! - `restore` / `pitr`: Postgres is restored from a disk snapshot (same timeline / a new one) and
//!   the relay restarted;
//! - `live_foreign`, `live_restore`, `live_pitr`: the same while the relay keeps running;
//! - `promote`: a standby is promoted (a new timeline, its history naming the switch point, the
//!   slot where its last sync left it) while the relay keeps running. With all of the WAL nothing is
//!   distrusted: the stream's tail is below the switch point, so nothing may be stored twice. Now
//!   and then the standby lacks the last records (a crash without `synchronized_standby_slots`);
//!   what the relay published of them is a history that did not survive, like a restore's.
//! - `purge`: the operator purges the stream (every message gone, the sequences stay).
//! - `consume`: a client other than a relay consumes the slot (`pg_logical_slot_get_changes`) or
//!   advances it (`pg_replication_slot_advance`) past committed units while no walsender holds it:
//!   after the relays were stopped cleanly (each session leaves its stop mark), killed (none), while
//!   NATS is down (the relay's sessions end with their walsender holding the slot, and leave a
//!   mark, then back off), or right after the connections were cut (the walsender went first: no
//!   mark). Those events are never sent again; the relay must say so at its next start when the
//!   mark could see it (`check.rs`, P9). An operator watches `outbox_relay_slot_consumed_events`
//!   and, once it is above 0, drops the mark to accept the gap (without a backfill), so the relay
//!   streams on.
//! - `backfill`: not a fault that strikes but an episode of a fifth of the worlds, once
//!   ([`World::backfill`]): the operator runs the real backfill over the simulated servers
//!   (`backfill.rs`), stopped by SIGTERM or killed at a random point, recovers as
//!   docs/operations.md says, and `run` resumes from the new slot. The faults that rewind the server
//!   or consume the slot are held back from then on.
//!
//! Besides the faults, each world draws the modes users turn on or off ([`Modes`]): the fence, the
//! descriptive headers, atomic transactions (in a quarter of fenced worlds), and the stream's
//! retention limits (`max_msgs`, `max_bytes` with `discard: new`, which stall the relay until the
//! operator raises them when the world settles; `max_age`, which removes old messages, the stream's
//! tail among them), and a standby (in a quarter of the worlds, `standby` in `SIM_FAULTS`: a second
//! relay process on the slot, refused it with 55006 while the other's walsender holds it, that
//! takes over when the process the faults strike is killed or stopped; a new standby then starts
//! behind it, and `foreign` and the restores that stop the relay stop both; each process reaches
//! JetStream through its own `ProcessPort`, so a refusal of a publish of the process that lost the
//! slot is a fact the checks know); the scenario draws the rest (CloudEvents, trace context
//! messages, the window, large transactions, the number of applications writing at once).
//!
//! Besides the promises checked in `check.rs` and at status updates (P2), each relay process's
//! position service (the `Positions` its sessions serve, handed out through `run_with`) is asked
//! after every status update the slot takes and every 100 to 500 ms what it says is stored
//! ([`PositionOracle`]): every event below that must already be in the stream. Its wait queue and
//! its HTTP and NATS front ends are not run.
//!
//! `status` is asked too, every 100 to 1,000 ms ([`status_oracle`]): its verdict on the slot, by its
//! own rules over what the simulated servers hold, may never be "nothing waits" or healthy while no
//! walsender holds the slot and a committed unit of work lies past its position. In 30% of worlds the
//! publication publishes deletes and a retention job deletes old outbox rows ([`PgParams`]'s
//! `publish_deletes`), so that changes that are not events come before events in the slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;
use outbox_relay::Lsn;
use outbox_relay::config::{Config, Settings};
use outbox_relay::error_chain::error_chain;
use outbox_relay::metrics::Metrics;
use outbox_relay::nats::NatsPort;
use outbox_relay::relay::{
    Connector, Consumed, NatsTrouble, PositionProbe, RelayError, Restart, SessionEnd, SlotCheck,
    Waited, run_with,
};
use outbox_relay::source::{ReplicationStream, StreamConfig, SystemInfo};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::check::{self, Violations};
use super::jetstream::{Chaos, JetStream, Limits, Retention, STREAM};
use super::peek::SimMarks;
use super::port::ProcessPort;
use super::postgres::{PgParams, Postgres, UnitCursor};
use super::rng::Dice;
use super::status::SimServers;
use super::trace::{RelayLog, Trace, trace};
use tracing_subscriber::layer::SubscriberExt;

/// Every fault, by the name `SIM_FAULTS` uses, with its weight among the faults.
pub(crate) const FAULTS: &[(&str, u64)] = &[
    ("kill", 6),
    ("stop", 2),
    ("cut", 4),
    ("blackhole", 1),
    ("pg_down", 2),
    ("pg_crash", 2),
    ("nats_down", 4),
    ("transit", 0),
    ("answers", 0),
    ("forge", 0),
    // A mode of the world rather than a fault that strikes ([`Modes::standby`]).
    ("standby", 0),
    ("foreign", 2),
    ("live_foreign", 1),
    ("restore", 2),
    ("pitr", 1),
    ("live_restore", 1),
    ("live_pitr", 1),
    ("promote", 2),
    ("purge", 1),
    ("consume", 2),
    // An episode of a fifth of the worlds rather than a fault that strikes ([`World::backfill`]).
    ("backfill", 0),
    // A mode of a quarter of the worlds rather than a fault that strikes ([`Modes::park`]).
    ("park", 0),
    // `outbox_requeue_event` requests in a quarter of the other worlds (`requeue_event.rs`).
    ("requeue_event", 0),
];

/// The faults a run may use.
#[derive(Clone, Debug)]
pub(crate) struct FaultSet(Vec<&'static str>);

impl FaultSet {
    /// `all`, names, and `-name` to remove one, comma-separated.
    pub(crate) fn parse(spec: &str) -> Result<Self, String> {
        let mut on: Vec<&'static str> = Vec::new();
        for word in spec.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let (remove, name) = match word.strip_prefix('-') {
                Some(n) => (true, n),
                None => (false, word),
            };
            let names: Vec<&'static str> = if name == "all" {
                FAULTS.iter().map(|(n, _)| *n).collect()
            } else {
                let n = FAULTS
                    .iter()
                    .map(|(n, _)| *n)
                    .find(|n| *n == name)
                    .ok_or_else(|| format!("unknown fault {name:?} in SIM_FAULTS"))?;
                vec![n]
            };
            if remove {
                on.retain(|n| !names.contains(n));
            } else {
                on.extend(
                    names
                        .into_iter()
                        .filter(|n| !on.contains(n))
                        .collect::<Vec<_>>(),
                );
            }
        }
        Ok(FaultSet(on))
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.0.contains(&name)
    }
}

/// A world's shape, drawn from its seed.
#[derive(Debug)]
struct Scenario {
    max_in_flight: usize,
    status_interval_ms: u64,
    cloudevents: bool,
    limits: Limits,
    pg: PgParams,
    chaos: Chaos,
    write_gap_ms: (u64, u64),
    fault_gap_ms: (u64, u64),
    faults_for: Duration,
    modes: Modes,
    /// One world in a hundred: one transaction of this many events, more than 20,000 (what a replay
    /// proof read at most before it read in bulk), and a cut once the stream holds more than 20,000
    /// of them before its commit is confirmed, so that the next session must prove a replay that
    /// long. With a short duplicate window: a replay published again instead of proven would store
    /// copies.
    huge: Option<u64>,
}

/// The settings users turn on or off, drawn per world.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Modes {
    /// `nats.fence`: off, the relay expects nothing of the stream, and only the duplicate window
    /// keeps copies out.
    pub fence: bool,
    /// `nats.descriptive_headers`.
    pub descriptive: bool,
    /// The stream's retention limits.
    pub retention: Retention,
    /// `nats.atomic_transactions` (which needs the fence): each transaction one atomic batch, or
    /// several past the window or 1,000 messages.
    pub atomic: bool,
    /// `nats.atomic_group_ms` in atomic worlds: 0 (a batch per transaction), the default 1, or up
    /// to 50 (transactions share batches: group commit). Drawn from a generator of its own, so the
    /// rest of a world is drawn as before it.
    pub atomic_group_ms: u64,
    /// A second relay process on the same slot, started with the first: the simulated Postgres
    /// refuses it the slot while the other's walsender holds it (55006, as Postgres does), so it
    /// waits as a standby and takes over when the other is killed or stopped; then a new standby
    /// starts. Faults strike the process started first.
    pub standby: bool,
    /// `outbox.on_invalid = "park"` (with the fence, without atomic transactions), a schema for
    /// `Paid` events, poison events and releases (`parking.rs`). Drawn from a generator of its
    /// own, so the rest of a world is drawn as before it.
    pub park: bool,
}

impl Modes {
    fn draw(d: &Dice, faults: &FaultSet) -> Self {
        let fence = !d.chance(0.2);
        Modes {
            fence,
            descriptive: !d.chance(0.3),
            retention: Self::retention(d),
            atomic: fence && d.chance(0.25),
            atomic_group_ms: 0,
            standby: faults.has("standby") && d.chance(0.25),
            park: false,
        }
    }

    /// Most streams keep everything; some are full now and then, some forget old messages.
    fn retention(d: &Dice) -> Retention {
        match d.range(0, 10) {
            0 => Retention {
                max_msgs: Some(d.range(50, 400) as usize),
                ..Retention::default()
            },
            1 => Retention {
                max_bytes: Some(d.range(20_000, 200_000) as usize),
                ..Retention::default()
            },
            2 => Retention {
                max_age: Some(d.millis(2_000, 30_000)),
                ..Retention::default()
            },
            _ => Retention::default(),
        }
    }
}

impl Scenario {
    fn draw(d: &Dice, faults: &FaultSet) -> Self {
        let on = |name: &str, p: f64| if faults.has(name) { p } else { 0.0 };
        let calm = d.chance(0.3);
        let mut sc = Scenario {
            max_in_flight: d.pick(&[1, 2, 3, 8, 64, 4096]),
            status_interval_ms: d.pick(&[50, 200, 1000]),
            cloudevents: d.chance(0.2),
            limits: Limits {
                // A short window now and then: the fence alone must keep duplicates out.
                duplicate_window: if d.chance(0.3) {
                    d.millis(200, 3_000)
                } else {
                    Duration::from_secs(120)
                },
                max_payload: d.pick(&[1 << 20, 64 << 10]),
                max_msg_size: d.pick(&[None, Some(16 << 10), Some(48 << 10)]),
            },
            pg: PgParams {
                apps: d.range(1, 5) as usize,
                publish_orders: d.chance(0.3),
                // Drawn in `world` from a generator of its own, so that no other draw shifts.
                publish_deletes: false,
                send_empty: d.chance(0.5),
                pipe: d.pick(&[512, 8 << 10, 64 << 10]),
                keepalive_ms: d.pick(&[(10, 200), (100, 2_000)]),
                big_transactions: d.pick(&[0.0, 0.0, 0.002, 0.01]),
                context: d.chance(0.3),
                edge: None,
                park: None,
            },
            chaos: if calm {
                Chaos::default()
            } else {
                Chaos {
                    transit: on("transit", d.pick(&[0.0, 0.02])),
                    slow: on("answers", 0.05),
                    late: on("answers", d.pick(&[0.0, 0.002, 0.01])),
                    lost: on("answers", d.pick(&[0.0, 0.002, 0.01])),
                    duplicated: on("answers", 0.02),
                    forged: on("forge", d.pick(&[0.0, 0.005, 0.02])),
                }
            },
            write_gap_ms: d.pick(&[(0, 20), (5, 100), (20, 400)]),
            fault_gap_ms: d.pick(&[(500, 4_000), (2_000, 10_000)]),
            faults_for: d.millis(20_000, 60_000),
            modes: Modes::draw(d, faults),
            huge: None,
        };
        if sc.modes.atomic {
            let l = &sc.limits;
            sc.pg.edge = Some(
                l.max_msg_size
                    .map_or(l.max_payload, |m| m.min(l.max_payload)),
            );
        }
        if d.chance(0.01) {
            sc.huge = Some(d.range(21_000, 26_000));
            sc.limits.duplicate_window = d.millis(200, 3_000);
            // Calm, so that nothing else excuses a second copy of what the replay skipped.
            sc.chaos = Chaos::default();
            sc.modes.retention = Retention::default();
        }
        sc
    }

    fn settings(&self) -> Settings {
        let mut c = Config::default();
        c.http.listen = String::new();
        c.outbox.message_prefix = super::postgres::PREFIX.into();
        if self.pg.context {
            c.outbox.context_prefix = super::postgres::CONTEXT_PREFIX.into();
        }
        c.nats.max_in_flight = self.max_in_flight;
        c.nats.ack_timeout_ms = 2_000;
        c.nats.cloudevents = self.cloudevents;
        c.nats.fence = self.modes.fence;
        c.nats.descriptive_headers = self.modes.descriptive;
        c.nats.atomic_transactions = self.modes.atomic;
        c.nats.atomic_group_ms = self.modes.atomic_group_ms;
        c.postgres.status_interval_ms = self.status_interval_ms;
        if self.modes.park {
            c.outbox.on_invalid = outbox_relay::config::OnInvalid::Park;
            c.outbox.schemas = super::parking::schema_dirs().0.clone();
        }
        c.validate().expect("simulation settings are valid")
    }
}

/// How a world ended.
pub(crate) struct Outcome {
    pub violations: Vec<String>,
    pub trace: Arc<Trace>,
    /// Units of work (transactions with events, stray messages) in the final history.
    pub units: usize,
    /// Messages in the stream at the end.
    pub stored: usize,
    /// A digest of the stream at the end (`trace::published`): what a replay must publish again.
    pub published: u64,
}

/// The relay's way to the simulated servers.
struct SimConnector {
    pg: Arc<Postgres>,
    js: Arc<JetStream>,
    config: StreamConfig,
    dice: Dice,
    /// The server's rewinds ([`Postgres::rewinds`]) when this process last connected for
    /// replication: its position service speaks of that history.
    connected: Arc<AtomicU64>,
    /// The process's number.
    process: u64,
    settings: Settings,
}

impl Connector for SimConnector {
    fn nats(&mut self) -> BoxFuture<'_, Result<NatsPort, Restart>> {
        Box::pin(async move {
            tokio::time::sleep(self.dice.millis(0, 10)).await;
            if self.js.is_down() {
                return Err(Restart::Nats(NatsTrouble::Unavailable(
                    "connection refused (simulated outage)".into(),
                )));
            }
            Ok(NatsPort::new(ProcessPort {
                js: Arc::clone(&self.js),
                process: self.process,
            }))
        })
    }

    fn nats_failed(&mut self) {}

    fn replication(
        &mut self,
    ) -> BoxFuture<'_, Result<(ReplicationStream, SystemInfo), SessionEnd>> {
        Box::pin(async move {
            // What the production connector does first: no session under a backfill's marker.
            let port = ProcessPort {
                js: Arc::clone(&self.js),
                process: self.process,
            };
            outbox_relay::relay::refuse_under_backfill(&self.settings, &port).await?;
            let connected = self.pg.connect(self.config.clone(), self.process).await?;
            // No await since the server took the connection: no rewind came in between.
            self.connected
                .store(self.pg.rewinds() as u64, Ordering::Relaxed);
            self.js.slot_held_by(self.process);
            Ok(connected)
        })
    }

    fn partitions(&mut self) -> BoxFuture<'_, Result<Vec<u32>, SessionEnd>> {
        Box::pin(async move {
            tokio::time::sleep(self.dice.millis(0, 5)).await;
            self.pg.partitions()
        })
    }

    /// The session holds the slot: its position (what the position service starts from), and the
    /// stop mark judged by the relay's own start (`slot_mark::at_start`) against the stream's tail,
    /// read through the simulated Postgres (`peek.rs`); the mark is dropped unless it holds evidence.
    fn slot_check<'a>(
        &'a mut self,
        system: &'a SystemInfo,
        reported: Option<&'a Consumed>,
    ) -> BoxFuture<'a, SlotCheck> {
        Box::pin(async move {
            tokio::time::sleep(self.dice.millis(0, 15)).await;
            let Some(slot_at) = self.pg.slot_position() else {
                return SlotCheck::default();
            };
            self.pg.judge_consumptions();
            let port = NatsPort::new(ProcessPort {
                js: Arc::clone(&self.js),
                process: self.process,
            });
            let marks = &mut SimMarks::of(&self.pg, slot_at);
            let settings = &self.settings;
            outbox_relay::slot_mark::at_start(
                settings,
                system,
                &port,
                Lsn(slot_at),
                marks,
                reported,
            )
            .await
        })
    }

    /// What `slot_mark::leave` does, against the simulated server: wait (at most 2 s) until the
    /// slot shows `confirmed` while walsender `pid` holds it, then copy it as the mark, unless one
    /// is there; all within the 5 s the relay allows.
    fn session_ended(&mut self, pid: i32, confirmed: Lsn) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let leave = async {
                tokio::time::sleep(self.dice.millis(0, 15)).await;
                let until = Instant::now() + Duration::from_secs(2);
                loop {
                    match self.pg.slot_held_by(pid) {
                        Ok(Some(at)) if at >= confirmed.0 || Instant::now() >= until => break,
                        Ok(Some(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
                        Ok(None) | Err(()) => return,
                    }
                }
                self.pg.copy_mark(pid);
            };
            let _ = tokio::time::timeout(Duration::from_secs(5), leave).await;
        })
    }
}

/// One relay process.
struct Process {
    handle: JoinHandle<Result<(), RelayError>>,
    shutdown: Option<oneshot::Sender<()>>,
    /// Its number (the trace's "relay process N"): the position oracle watches it by this.
    number: u64,
}

/// The position service's oracle: whenever a relay process's position service says an LSN is
/// stored (the stored LSN `/wait` answers "stored" by at once), every event of every unit of work
/// whose deciding record (its commit, or a non-transactional message's own) starts below it must be
/// in the stream, stored after it committed: what P2 asks of a confirmation, asked of a claim that
/// runs ahead of the slot. Sampled after every status update the slot takes and every 100 to
/// 500 ms besides. Excused only by what the world did: a session that connected before the WAL was
/// cut back (a restore, a lossy promotion) may still speak of the history that was forgotten, whose
/// units the server no longer has (and a new unit at a forgotten LSN is not the one it stored);
/// such a session's connection ended with the rewind, and claims are checked again from the next.
struct PositionOracle {
    js: Arc<JetStream>,
    trace: Arc<Trace>,
    violations: Arc<Violations>,
    watched: std::sync::Mutex<Vec<Watched>>,
}

/// One relay process's position service, and how far its claims were checked.
struct Watched {
    number: u64,
    probe: PositionProbe,
    connected: Arc<AtomicU64>,
    /// The units found stored so far.
    checked: UnitCursor,
}

impl PositionOracle {
    fn watch(&self, number: u64, probe: PositionProbe, connected: Arc<AtomicU64>) {
        self.watched.lock().unwrap().push(Watched {
            number,
            probe,
            connected,
            checked: UnitCursor::default(),
        });
    }

    /// A writer's read-your-writes wait: for every watched process that serves now, a `/wait` for
    /// `lsn` (the server's WAL end after a commit, what a writer takes with `pg_current_wal_lsn()`)
    /// of at most `timeout`, through the process's wait queue. A "stored" answer is checked when it
    /// comes: every unit of work below `lsn` must be in the stream then. The same excuse as
    /// [`PositionOracle::sample`]: the WAL cut back since the wait was opened, or a session connected
    /// before it.
    fn ask(self: &Arc<Self>, pg: &Arc<Postgres>, lsn: u64, timeout: Duration) {
        let watched = self.watched.lock().unwrap();
        for w in watched.iter() {
            let Some(answer) = w.probe.wait(Lsn(lsn), timeout) else {
                continue;
            };
            let rewinds = pg.rewinds();
            let (oracle, pg, number) = (Arc::clone(self), Arc::clone(pg), w.number);
            let connected = Arc::clone(&w.connected);
            tokio::spawn(async move {
                let Waited::Stored(stored) = answer.await else {
                    return;
                };
                if pg.rewinds() != rewinds || connected.load(Ordering::Relaxed) != rewinds as u64 {
                    return;
                }
                if stored.0 < lsn {
                    oracle.violations.report(
                        &oracle.trace,
                        format!(
                            "position service of relay process {number} answered a wait for {} as stored at {stored}, below it",
                            Lsn(lsn)
                        ),
                    );
                    return;
                }
                // Events another client consumed from the slot never reach the stream (excused by
                // the simulated Postgres's record alone, as in `sample`).
                let consumed = pg.consumed();
                let mut missing = None;
                pg.units_below(&mut UnitCursor::default(), lsn, |u| {
                    if missing.is_some() {
                        return;
                    }
                    if let Some(e) = u.events.iter().find(|e| {
                        !oracle.js.holds(&e.msg_id, u.at) && !consumed.contains_key(&e.msg_id)
                    }) {
                        missing = Some(format!(
                            "position service of relay process {number} answered a wait for {} as stored before \
                             event {} of the {} (commit LSN {}) was in the stream",
                            Lsn(lsn),
                            e.msg_id,
                            u.what,
                            Lsn(u.start)
                        ));
                    }
                });
                if let Some(what) = missing {
                    oracle.violations.report(&oracle.trace, what);
                }
            });
        }
    }

    /// The processes running now (what `pg_stat_activity` shows of them, by their numbers).
    fn numbers(&self) -> Vec<u32> {
        let watched = self.watched.lock().unwrap();
        watched.iter().map(|w| w.number as u32).collect()
    }

    /// A process is gone: nothing answers for it any more.
    fn forget(&self, number: u64) {
        self.watched.lock().unwrap().retain(|w| w.number != number);
    }

    /// Checks what every watched position service says now.
    fn sample(&self, pg: &Postgres) {
        let mut watched = self.watched.lock().unwrap();
        for w in watched.iter_mut() {
            let Some(served) = w.probe.served() else {
                continue;
            };
            if w.connected.load(Ordering::Relaxed) != pg.rewinds() as u64 {
                continue;
            }
            let stored = served.stored_lsn;
            let mut missing: Vec<(String, String)> = Vec::new();
            pg.units_below(&mut w.checked, stored.0, |u| {
                for e in u.events.iter().filter(|e| !self.js.holds(&e.msg_id, u.at)) {
                    missing.push((
                        e.msg_id.clone(),
                        format!(
                            "position service of relay process {} said stored at {stored} before event {} of the {} \
                             (commit LSN {} <= {stored}) was in the stream",
                            w.number,
                            e.msg_id,
                            u.what,
                            Lsn(u.start)
                        ),
                    ));
                }
            });
            // Events another client consumed from the slot never reach the stream (excused by the
            // simulated Postgres's record alone).
            if !missing.is_empty() {
                let consumed = pg.consumed();
                if let Some((_, what)) = missing
                    .into_iter()
                    .find(|(id, _)| !consumed.contains_key(id))
                {
                    self.violations.report(&self.trace, what);
                }
            }
        }
    }
}

/// How many pgoutput rows `status`'s look reads at most (`slot_scan::Bound::DEFAULT`): the
/// simulated peek hands over that many (and the rest of the transaction the bound ends in).
const STATUS_ROWS: usize = 20_000;

/// The `status` oracle: every 100 to 1,000 ms (drawn from its own generator) `status`'s verdict
/// (`outbox_relay::status::status_over`, the command's own verdict, over what the simulated
/// servers hold now: `status.rs`) is checked against what the simulated Postgres knows at the
/// same moment. While no walsender holds the slot, a unit of work past its confirmed position
/// (one a walsender started from it would send) is an event waiting in it: `status` must not say
/// that no event waits, nor find no problem with the slot. Whether the stream holds that event
/// does not matter (the slot has not passed it). And the event it names as waiting must be one of
/// those units: nothing excuses either, the view and the truth are read under one lock.
async fn status_oracle(
    settings: Settings,
    pg: Arc<Postgres>,
    js: Arc<JetStream>,
    positions: Arc<PositionOracle>,
    trace: Arc<Trace>,
    violations: Arc<Violations>,
    dice: Dice,
) {
    loop {
        tokio::time::sleep(dice.millis(100, 1_000)).await;
        // An unreachable server is a problem `status` names by itself.
        let Some((mut slot, pending)) = pg.status_view(STATUS_ROWS) else {
            continue;
        };
        if slot.active_pid.is_some() {
            continue;
        }
        let at = slot.confirmed;
        slot.relay_pids = positions.numbers();
        let port = (!js.is_down()).then(|| {
            NatsPort::new(ProcessPort {
                js: Arc::clone(&js),
                process: 0,
            })
        });
        let servers = SimServers {
            settings: &settings,
            view: slot,
            port,
        };
        let verdict = outbox_relay::status::status_over(&servers, &settings, i64::MAX).await;
        trace!(
            trace,
            "status of the idle slot at {at} ({} units past it): {}",
            pending.len(),
            if verdict.problems().is_empty() {
                "healthy".to_owned()
            } else {
                verdict.problems().join(" | ")
            }
        );
        let waiting = pending
            .iter()
            .find_map(|u| u.events.first().map(|e| (u, e)));
        if let Some((u, e)) = waiting
            && (verdict.events_waiting() == Some(false) || verdict.problems().is_empty())
        {
            violations.report(
                &trace,
                format!(
                    "status: no relay streams the slot at {at} while event {} of the {} waits in it (the stream {} it), \
                     but status says {}",
                    e.msg_id,
                    u.what,
                    if js.holds(&e.msg_id, u.at) {
                        "holds"
                    } else {
                        "lacks"
                    },
                    if verdict.problems().is_empty() {
                        "the slot is healthy".to_owned()
                    } else {
                        format!(
                            "no event waits (problems: {})",
                            verdict.problems().join(" | ")
                        )
                    }
                ),
            );
        }
        if let Some(id) = verdict.waiting_event_id()
            && !pending
                .iter()
                .any(|u| u.events.iter().any(|e| e.msg_id == id))
        {
            violations.report(
                &trace,
                format!(
                    "status: says event {id} waits in the slot at {at}, but no committed unit past it has that event"
                ),
            );
        }
    }
}

struct World {
    dice: Dice,
    trace: Arc<Trace>,
    settings: Settings,
    pg: Arc<Postgres>,
    js: Arc<JetStream>,
    violations: Arc<Violations>,
    relay: Option<Process>,
    /// The second process on the slot, in worlds with [`Modes::standby`].
    standby: Option<Process>,
    with_standby: bool,
    processes: u64,
    /// The counters of every relay process of the world, added up (each process's own would
    /// start at zero).
    metrics: Arc<Metrics>,
    positions: Arc<PositionOracle>,
    /// The huge transaction ([`Scenario::huge`]) is written and not yet cut off nor confirmed: the
    /// faults that would take it away before a replay of it can be tried are held back.
    huge_pending: Arc<std::sync::atomic::AtomicBool>,
    /// A backfill episode began: the faults that rewind the server or consume the slot are held
    /// back from then on (a restore would bring back a slot from before the backfill).
    backfilled: bool,
    /// The answers' chaos of the world, restored after a backfill's last attempt ran without it.
    chaos: Chaos,
    /// Backfill runs so far.
    backfills: u64,
    /// Park worlds: the operator who releases keys (also right before some faults).
    park: Option<Arc<super::parking::Operator>>,
    /// `requeue_event` worlds: the operator who requeues dead letters (also right before some
    /// faults).
    requeue: Option<Arc<super::requeue_event::Requeuer>>,
}

/// Runs the world of `seed` on its own runtime with a paused clock.
pub(crate) fn run(seed: u64, faults: &FaultSet, keep_trace: bool) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    let trace = Arc::new(rt.block_on(async { Trace::new(keep_trace) }));
    // The relay logs into the world's trace; for this thread only, so parallel worlds stay apart.
    let _log = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(RelayLog(Arc::clone(&trace))),
    );
    rt.block_on(world(seed, faults, trace))
}

async fn world(seed: u64, faults: &FaultSet, trace: Arc<Trace>) -> Outcome {
    let dice = Dice::new(seed);
    let mut sc = Scenario::draw(&dice, faults);
    if sc.modes.atomic {
        let group = Dice::new(seed ^ 0x0067_726f_7570);
        sc.modes.atomic_group_ms = match group.range(0, 4) {
            0 => 0,
            1 | 2 => 1,
            _ => group.range(2, 51),
        };
    }
    // A fifth of the worlds see a backfill, at a time of their own generator's: the other worlds
    // draw from the world's generator exactly as before. Their streams keep everything (a full
    // stream would refuse the backfill's rows until the operator makes room, which is no backfill
    // matter), and none has a huge transaction.
    let backfill_dice = Dice::new(seed ^ 0x6261_636b_6669_6c6c);
    let mut backfill_at =
        (faults.has("backfill") && sc.huge.is_none() && backfill_dice.chance(0.2))
            .then(|| Instant::now() + backfill_dice.millis(0, sc.faults_for.as_millis() as u64));
    if backfill_at.is_some() {
        sc.modes.retention = Retention::default();
    }
    // The retention job (its own generator: worlds without it run as they did before it).
    let retention_job = Dice::new(seed ^ 0x7265_7465_6e74_696f);
    // A quarter of the worlds park keys (their own generator): the fence on, single publishes, no
    // backfill, no huge transaction, a stream that keeps everything (its parking subjects are the
    // record of what is parked).
    let park_dice = Dice::new(seed ^ 0x7061_726b_6b65_7973);
    if faults.has("park") && park_dice.chance(0.25) {
        sc.modes.park = true;
        sc.modes.fence = true;
        sc.modes.atomic = false;
        sc.modes.atomic_group_ms = 0;
        sc.pg.edge = None;
        sc.huge = None;
        sc.modes.retention = Retention::default();
        backfill_at = None;
        let l = &sc.limits;
        sc.pg.park = Some(
            l.max_msg_size
                .map_or(l.max_payload, |m| m.min(l.max_payload)),
        );
    }
    // A quarter of the other `dead_letter` worlds requeue dead letters (their own generator):
    // without atomic batches, a huge transaction or a backfill, in a stream that keeps
    // everything (a dead letter must still be there when its request is carried out).
    let requeue_dice = Dice::new(seed ^ 0x7265_7175_6575_6576);
    let requeue_event = faults.has("requeue_event")
        && !sc.modes.park
        && !sc.modes.atomic
        && sc.huge.is_none()
        && backfill_at.is_none()
        && requeue_dice.chance(0.25);
    if requeue_event {
        sc.modes.retention = Retention::default();
    }
    // Not beside a backfill: the simulated table's snapshot does not know deleted rows.
    sc.pg.publish_deletes = sc.huge.is_none() && backfill_at.is_none() && retention_job.chance(0.3);
    trace!(trace, "seed {seed}: {sc:?}");
    let violations = Arc::new(Violations::default());
    let js = JetStream::start(sc.limits, dice.clone(), Arc::clone(&trace));
    let pg = Postgres::new(
        sc.pg.clone(),
        dice.clone(),
        Arc::clone(&trace),
        Arc::clone(&js),
        Arc::clone(&violations),
    );
    let mut w = World {
        dice: dice.clone(),
        trace: Arc::clone(&trace),
        settings: sc.settings(),
        pg: Arc::clone(&pg),
        js: Arc::clone(&js),
        violations: Arc::clone(&violations),
        relay: None,
        standby: None,
        with_standby: sc.modes.standby,
        processes: 0,
        metrics: Arc::new(Metrics::default()),
        positions: Arc::new(PositionOracle {
            js: Arc::clone(&js),
            trace: Arc::clone(&trace),
            violations: Arc::clone(&violations),
            watched: std::sync::Mutex::new(Vec::new()),
        }),
        huge_pending: Arc::default(),
        backfilled: false,
        chaos: sc.chaos,
        backfills: 0,
        park: sc.modes.park.then(|| {
            super::parking::Operator::new(Arc::clone(&pg), park_dice.clone(), Arc::clone(&trace))
        }),
        requeue: requeue_event.then(|| {
            super::requeue_event::Requeuer::new(Arc::clone(&pg), requeue_dice, Arc::clone(&trace))
        }),
    };
    // The position services are asked after every status update and every 100 to 500 ms,
    // at times from a generator of their own: asking draws nothing from the world's.
    pg.on_status(Box::new({
        let oracle = Arc::clone(&w.positions);
        move |pg| oracle.sample(pg)
    }));
    let sampler = tokio::spawn({
        let (oracle, pg) = (Arc::clone(&w.positions), Arc::clone(&pg));
        let dice = Dice::new(seed ^ 0x706f_7369_7469_6f6e);
        async move {
            loop {
                tokio::time::sleep(dice.millis(100, 500)).await;
                oracle.sample(&pg);
            }
        }
    });
    // The operator: once the relay reports a client that consumed the slot, accepts the gap by
    // dropping the stop mark (what the relay's error line tells them to do, without a backfill).
    // Its own generator, like the position sampler's.
    let operator = tokio::spawn({
        let (pg, metrics) = (Arc::clone(&pg), Arc::clone(&w.metrics));
        let dice = Dice::new(seed ^ 0x6f70_6572_6174_6f72);
        async move {
            loop {
                tokio::time::sleep(dice.millis(200, 1_000)).await;
                if metrics.slot_consumed_events.get() > 0 {
                    pg.consumption_reported();
                    tokio::time::sleep(dice.millis(1_000, 10_000)).await;
                    // What the relay reports by now is what the mark drops with.
                    if metrics.slot_consumed_events.get() > 0 {
                        pg.consumption_reported();
                    }
                    pg.drop_mark("the operator, accepting the gap");
                }
            }
        }
    });
    js.set_chaos(sc.chaos);
    js.set_retention(sc.modes.retention);
    let writing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let writer = tokio::spawn({
        let (pg, dice, writing) = (Arc::clone(&pg), dice.clone(), Arc::clone(&writing));
        let (lo, hi) = sc.write_gap_ms;
        // Writers that wait for their own writes, with a generator of their own: asking draws
        // nothing from the world's.
        let (oracle, waits) = (Arc::clone(&w.positions), Dice::new(seed ^ 0x7761_6974_7321));
        async move {
            while writing.load(std::sync::atomic::Ordering::Relaxed) {
                tokio::time::sleep(dice.millis(lo, hi).max(Duration::from_millis(1))).await;
                pg.write();
                if waits.chance(0.05) {
                    oracle.ask(&pg, pg.flushed(), waits.millis(0, 3_000));
                }
            }
        }
    });
    if let Some(op) = &w.park {
        let fix_at = Instant::now() + park_dice.millis(0, sc.faults_for.as_millis() as u64);
        tokio::spawn(Arc::clone(op).run(w.settings.clone(), Arc::clone(&writing), fix_at));
    }
    if let Some(rq) = &w.requeue {
        trace!(trace, "requeue_event: the operator requeues dead letters");
        tokio::spawn(Arc::clone(rq).run(Arc::clone(&writing)));
    }
    // With a publication that publishes deletes, a retention job deletes old outbox rows now and
    // then: changes that are not events, which a look for waiting events must see past.
    let retention = tokio::spawn({
        let (pg, writing, dice) = (Arc::clone(&pg), Arc::clone(&writing), retention_job);
        let on = sc.pg.publish_deletes;
        async move {
            while on && writing.load(std::sync::atomic::Ordering::Relaxed) {
                tokio::time::sleep(dice.millis(500, 6_000)).await;
                pg.retention_delete(dice.range(1, 150) as usize);
            }
        }
    });
    // `status` asked at random times, by a generator of its own.
    let status = tokio::spawn(status_oracle(
        w.settings.clone(),
        Arc::clone(&pg),
        Arc::clone(&js),
        Arc::clone(&w.positions),
        Arc::clone(&trace),
        Arc::clone(&violations),
        Dice::new(seed ^ 0x7374_6174_7573),
    ));
    if let Some(n) = sc.huge {
        tokio::spawn(huge_transaction(
            Arc::clone(&pg),
            Arc::clone(&js),
            dice.clone(),
            n,
            Arc::clone(&w.huge_pending),
        ));
    }
    // Checkpoints write the slot to disk; disk snapshots are taken now and then.
    let checkpointer = tokio::spawn({
        let (pg, dice) = (Arc::clone(&pg), dice.clone());
        async move {
            loop {
                tokio::time::sleep(dice.millis(500, 5_000)).await;
                pg.checkpoint();
                if dice.chance(0.3) {
                    pg.snapshot();
                }
            }
        }
    });
    w.start_relay();
    let end_of_faults = Instant::now() + sc.faults_for;
    let (lo, hi) = sc.fault_gap_ms;
    while Instant::now() < end_of_faults && !violations.any() {
        tokio::time::sleep(dice.millis(lo, hi)).await;
        w.reap();
        if backfill_at.is_some_and(|t| Instant::now() >= t) {
            backfill_at = None;
            w.backfill().await;
            continue;
        }
        w.fault(faults).await;
    }
    // Settle: no more faults, the applications finish, the servers are back.
    writing.store(false, std::sync::atomic::Ordering::Relaxed);
    let _ = writer.await;
    let _ = retention.await;
    pg.finish_writes();
    js.set_chaos(Chaos::default());
    // A full stream stalls the relay until the operator makes room: raised here.
    js.set_retention(Retention {
        max_age: sc.modes.retention.max_age,
        ..Retention::default()
    });
    pg.up();
    if js.is_down() {
        js.come_up();
    }
    trace!(trace, "settling: WAL flushed to {}", Lsn(pg.flushed()));
    let deadline = Instant::now() + Duration::from_secs(20 * 60);
    let flushed = pg.flushed();
    while !violations.any() {
        w.reap();
        if w.relay.is_none() {
            w.start_relay();
        }
        if pg.slot_confirmed() >= flushed {
            break;
        }
        if Instant::now() >= deadline {
            violations.report(
                &trace,
                format!(
                    "liveness: 20 minutes after the faults ended the slot is at {}, the WAL at {}",
                    Lsn(pg.slot_confirmed()),
                    Lsn(flushed)
                ),
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Whatever is still on its way lands (late answers, publishes of dead sessions), then the
    // relay is shut down cleanly.
    tokio::time::sleep(Duration::from_secs(10)).await;
    w.reap();
    w.stop_all().await;
    checkpointer.abort();
    sampler.abort();
    status.abort();
    operator.abort();
    // Events another client consumed from the slot are never sent again: only the simulated
    // Postgres's record of the consumption excuses their absence.
    let stream = js.messages();
    let units = check::consumed_away(pg.units(), &pg.consumed(), &stream, &trace);
    if !violations.any() {
        // Only what the world did excuses a copy or an order, never what the relay logged.
        let facts = js.facts();
        let backfills: std::collections::HashSet<u64> = facts
            .sessions
            .iter()
            .filter(|(_, (p, _))| *p >= super::backfill::BACKFILL_PROCESS)
            .map(|(n, _)| *n)
            .collect();
        check::settled(
            &units,
            &stream,
            &check::Excuses {
                backfills: &backfills,
                distrust: &facts.distrust,
                lost: &facts.lost,
                confirmations: &pg.confirmations(),
                fence: sc.modes.fence,
                atomic_room: sc.modes.atomic.then(|| sc.max_in_flight.clamp(1, 1000)),
                park: sc.modes.park,
                requeue_event,
            },
            &trace,
            &violations,
        );
        if let Some(rq) = &w.requeue {
            super::requeue_event::check(&units, &rq.requests(), &stream, &trace, &violations);
        }
        if let Some(op) = &w.park {
            super::parking::check(
                &units,
                &pg.releases(),
                op.fixed_at(),
                &stream,
                &trace,
                &violations,
            );
        }
        check::counted(w.metrics.dead_letters.get(), &stream, &trace, &violations);
    }
    trace!(
        trace,
        "end: {} units, {} messages in the stream, slot at {}, {}",
        units.len(),
        stream.len(),
        Lsn(pg.slot_confirmed()),
        pg.history()
    );
    Outcome {
        violations: violations.list(),
        trace,
        units: units.len(),
        stored: stream.len(),
        published: super::trace::published(&stream),
    }
}

/// The huge transaction of [`Scenario::huge`]: written once, a few seconds into the faults; once
/// the stream holds 20,300 messages more than when it committed while the slot has not passed it,
/// the replication connections are cut. Watched until the slot passes it, five minutes at most;
/// meanwhile (`pending`) no fault rewinds the server, consumes the slot or writes to the stream.
async fn huge_transaction(
    pg: Arc<Postgres>,
    js: Arc<JetStream>,
    dice: Dice,
    n: u64,
    pending: Arc<std::sync::atomic::AtomicBool>,
) {
    tokio::time::sleep(dice.millis(1_000, 10_000)).await;
    let commit = loop {
        if let Some(c) = pg.huge_transaction(n) {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    pending.store(true, Ordering::Relaxed);
    watch_huge(&pg, &js, commit).await;
    pending.store(false, Ordering::Relaxed);
}

async fn watch_huge(pg: &Postgres, js: &JetStream, commit: u64) {
    let last = |js: &JetStream| js.stream_state(STREAM).map(|(seq, _)| seq).ok();
    let base = loop {
        if let Some(seq) = last(js) {
            break seq;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let until = Instant::now() + Duration::from_secs(300);
    let mut cut = false;
    while Instant::now() < until && pg.slot_confirmed() <= commit {
        if !cut && last(js).is_some_and(|seq| seq >= base + 20_300) {
            pg.cut();
            cut = true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl World {
    /// The relay the faults strike runs again: the standby, which may hold the slot already, if
    /// there is one, else a new process; and, with [`Modes::standby`], a new standby behind it.
    fn start_relay(&mut self) {
        if self.relay.is_none() {
            self.relay = Some(match self.standby.take() {
                Some(p) => {
                    trace!(
                        self.trace,
                        "relay process {} is the one faults strike", p.number
                    );
                    p
                }
                None => self.spawn("relay"),
            });
        }
        if self.with_standby && self.standby.is_none() {
            self.standby = Some(self.spawn("standby"));
        }
    }

    /// A new relay process, from where the slot is (what `run` reads at setup).
    fn spawn(&mut self, role: &str) -> Process {
        self.processes += 1;
        let start = Lsn(self.pg.slot_confirmed());
        trace!(
            self.trace,
            "{role} process {} starts at {start}", self.processes
        );
        let settings = self.settings.clone();
        let probe = PositionProbe::new(&settings);
        let connected = Arc::new(AtomicU64::new(u64::MAX));
        self.positions
            .watch(self.processes, probe.clone(), Arc::clone(&connected));
        let connector = SimConnector {
            pg: Arc::clone(&self.pg),
            js: Arc::clone(&self.js),
            config: StreamConfig {
                status_interval: settings.status_interval,
                channel_capacity: 1024,
                max_frame_bytes: settings.config().postgres.max_frame_bytes,
                ..StreamConfig::default()
            },
            dice: self.dice.clone(),
            connected,
            process: self.processes,
            settings: settings.clone(),
        };
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(tracing::Instrument::instrument(
            run_with(
                settings,
                Arc::clone(&self.metrics),
                Box::new(connector),
                start,
                self.dice.next_u64(),
                probe,
                async move {
                    let _ = rx.await;
                },
            ),
            tracing::info_span!("process", n = self.processes),
        ));
        Process {
            handle,
            shutdown: Some(tx),
            number: self.processes,
        }
    }

    /// A relay (or standby) that ended on its own is a finding: it may only end when told to.
    fn reap(&mut self) {
        for standby in [false, true] {
            let slot = if standby {
                &mut self.standby
            } else {
                &mut self.relay
            };
            if slot.as_ref().is_some_and(|p| p.handle.is_finished()) {
                let p = slot.take().unwrap();
                self.ended(p);
            }
        }
    }

    fn ended(&mut self, p: Process) {
        self.positions.forget(p.number);
        let what = match futures_util::FutureExt::now_or_never(p.handle) {
            Some(Ok(Ok(()))) => "the relay stopped without being asked to".to_owned(),
            // A defect is a bug of the relay's whatever the world did: named as one.
            Some(Ok(Err(e))) if e.is_defect() => {
                format!("the relay stopped on a defect: {}", error_chain(&e))
            }
            Some(Ok(Err(e))) => format!("the relay stopped: {}", error_chain(&e)),
            Some(Err(e)) if e.is_panic() => format!("the relay panicked: {e}"),
            _ => "the relay task ended".to_owned(),
        };
        self.violations
            .report(&self.trace, format!("process {}: {what}", p.number));
    }

    /// Every relay process dies: none runs until the next starts.
    async fn kill_all(&mut self) {
        self.kill_relay().await;
        if let Some(p) = self.standby.take() {
            trace!(self.trace, "standby process {} killed", p.number);
            p.handle.abort();
            let _ = p.handle.await;
            self.positions.forget(p.number);
        }
    }

    async fn kill_relay(&mut self) {
        if let Some(p) = self.relay.take() {
            trace!(self.trace, "relay process {} killed", p.number);
            p.handle.abort();
            let _ = p.handle.await;
            self.positions.forget(p.number);
        }
    }

    /// The relay and its standby are shut down cleanly, at the end of a world.
    async fn stop_all(&mut self) {
        // The standby first: stopping the relay first would hand it the slot.
        if let Some(p) = self.standby.take() {
            self.stop(p).await;
        }
        self.stop_relay().await;
    }

    async fn stop_relay(&mut self) {
        if let Some(p) = self.relay.take() {
            self.stop(p).await;
        }
    }

    async fn stop(&mut self, mut p: Process) {
        trace!(self.trace, "relay process {} asked to stop", p.number);
        if let Some(tx) = p.shutdown.take() {
            let _ = tx.send(());
        }
        match tokio::time::timeout(Duration::from_secs(60), &mut p.handle).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => self.violations.report(
                &self.trace,
                format!(
                    "the relay failed while stopping{}: {}",
                    if e.is_defect() { " on a defect" } else { "" },
                    error_chain(&e)
                ),
            ),
            Ok(Err(e)) => self.violations.report(
                &self.trace,
                format!("the relay task failed while stopping: {e}"),
            ),
            Err(_) => {
                self.violations.report(
                    &self.trace,
                    "the relay did not stop within 60 s of its shutdown".into(),
                );
                p.handle.abort();
            }
        }
        self.positions.forget(p.number);
    }

    /// The backfill episode (the "backfill, stopped by SIGTERM and by kill -9"): the relays
    /// are stopped or killed; the operator waits for the servers, drops the slot by hand or passes
    /// `--replace-slot`, and runs the real `backfill_over` over the simulated servers while the
    /// applications go on writing. A run may end by itself, or be stopped by SIGTERM (its `stop`
    /// future) or killed (its task aborted, no cleanup) at a random point. After an unfinished
    /// one the operator follows docs/operations.md: now and then tries `run` first, which must refuse
    /// while the marker stands (it ends with the marker's refusal, and the simulated Postgres
    /// reports any session that takes the slot under a marker), then runs backfill again, until one
    /// finishes (the fourth and later without the answers' chaos). Then `run` resumes from the new
    /// slot. The checks hold the world to P1 for every row the snapshot held and every event
    /// committed after it.
    async fn backfill(&mut self) {
        let d = self.dice.clone();
        trace!(self.trace, "BACKFILL: the operator stops the relays");
        self.backfilled = true;
        if d.chance(0.5) {
            self.stop_all().await;
        } else {
            self.kill_all().await;
        }
        while self.js.is_down() || self.pg.slot_position().is_none() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let mut replace = d.chance(0.5);
        if !replace && self.pg.drop_slot("the operator", true).is_err() {
            replace = true;
        }
        for attempt in 1.. {
            let calm = attempt >= 4;
            if calm {
                self.js.set_chaos(Chaos::default());
            }
            let finished = self.backfill_run(replace, !calm && d.chance(0.6)).await;
            if finished {
                break;
            }
            if d.chance(0.5)
                && (self.js.backfill_marked() || self.pg.slot_exists())
                && self.try_run().await
            {
                break;
            }
            // Stopped before it changed anything: the old slot serves `run` as before.
            if !self.js.backfill_marked() && self.pg.slot_exists() {
                break;
            }
            // The marker makes the next backfill replace the slot it guards; without a slot there
            // is nothing to replace.
            replace = false;
            if attempt >= 10 {
                self.violations.report(
                    &self.trace,
                    "liveness: backfill did not finish in 10 attempts".into(),
                );
                break;
            }
        }
        self.js.set_chaos(self.chaos);
        self.start_relay();
    }

    /// One run of `outbox-relay backfill` (`--replace-slot` if `replace`), interrupted by SIGTERM
    /// or kill -9 at a random point if `interrupt`. Returns whether it finished.
    async fn backfill_run(&mut self, replace: bool, interrupt: bool) -> bool {
        let d = self.dice.clone();
        self.backfills += 1;
        let process = super::backfill::BACKFILL_PROCESS + self.backfills;
        let mut servers = super::backfill::SimBackfill {
            pg: Arc::clone(&self.pg),
            js: Arc::clone(&self.js),
            dice: d.clone(),
            process,
        };
        let settings = self.settings.clone();
        let (tx, rx) = oneshot::channel::<()>();
        let stop = async move {
            match rx.await {
                Ok(()) => "SIGTERM",
                Err(_) => std::future::pending().await,
            }
        };
        let opts = outbox_relay::backfill::BackfillOptions {
            replace_slot: replace,
            ..Default::default()
        };
        trace!(
            self.trace,
            "backfill {process} starts{}",
            if replace { " with --replace-slot" } else { "" }
        );
        let mut handle = tokio::spawn(tracing::Instrument::instrument(
            async move {
                outbox_relay::backfill::backfill_over(&settings, opts, |_| {}, stop, &mut servers)
                    .await
                    .map_err(|e| error_chain(&e))
            },
            tracing::info_span!("backfill", n = process),
        ));
        let ended = if interrupt {
            let kill = d.chance(0.5);
            let at = d.millis(0, super::backfill::INTERRUPT_WITHIN.as_millis() as u64);
            match tokio::time::timeout(at, &mut handle).await {
                Ok(r) => r,
                Err(_) if kill => {
                    trace!(self.trace, "backfill {process} killed");
                    handle.abort();
                    let _ = (&mut handle).await;
                    return false;
                }
                Err(_) => {
                    trace!(self.trace, "backfill {process} gets SIGTERM");
                    let _ = tx.send(());
                    (&mut handle).await
                }
            }
        } else {
            (&mut handle).await
        };
        match ended {
            Ok(Ok(report)) => {
                trace!(
                    self.trace,
                    "backfill {process} finished: {} rows, {} stored, {} duplicates, slot at {}",
                    report.rows,
                    report.stored,
                    report.duplicates,
                    report.consistent_point
                );
                true
            }
            Ok(Err(e)) => {
                trace!(self.trace, "backfill {process} failed: {e}");
                false
            }
            Err(e) => {
                self.violations
                    .report(&self.trace, format!("backfill {process} panicked: {e}"));
                false
            }
        }
    }

    /// The operator starts `run` after an unfinished backfill. While the marker stands it must
    /// refuse (end with the marker's refusal); without one it runs on. Returns whether it runs.
    async fn try_run(&mut self) -> bool {
        let marked = self.js.backfill_marked();
        let p = self.spawn("relay");
        let until = Instant::now() + Duration::from_secs(5);
        while !p.handle.is_finished() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !p.handle.is_finished() {
            if marked {
                self.violations.report(
                    &self.trace,
                    format!(
                        "relay process {} runs while a backfill marker stands: `run` must refuse",
                        p.number
                    ),
                );
            }
            self.relay = Some(p);
            return true;
        }
        self.positions.forget(p.number);
        match futures_util::FutureExt::now_or_never(p.handle) {
            Some(Ok(Err(e))) if marked && error_chain(&e).contains("outbox-relay.backfill") => {
                trace!(
                    self.trace,
                    "relay process {} refused: the backfill marker stands", p.number
                );
            }
            other => self.violations.report(
                &self.trace,
                format!(
                    "relay process {} started after an unfinished backfill ended: {}",
                    p.number,
                    match other {
                        Some(Ok(Err(e))) => error_chain(&e),
                        _ => "without an error".into(),
                    }
                ),
            ),
        }
        false
    }

    /// The `consume` fault: the slot is let go one of four ways, then another client takes some of
    /// what it holds (see the module docs).
    async fn consume(&mut self) {
        let d = self.dice.clone();
        match d.range(0, 10) {
            0..4 => {
                // A clean stop of a session that streams leaves the mark (docs/guarantees.md P9):
                // without it every consumption would go unseen. Only a running relay's session: a
                // killed one's black-holed walsender holds the slot until its timeout while a
                // standby waits, and stopping that standby ends no session that held it.
                let running = [&self.relay, &self.standby].map(|p| p.as_ref().map(|p| p.number));
                let streamed = self
                    .pg
                    .slot_holder()
                    .is_some_and(|owner| running.contains(&Some(owner)));
                self.stop_all().await;
                if streamed && self.pg.slot_position().is_some() && !self.pg.has_mark() {
                    self.violations.report(
                        &self.trace,
                        "P9: the relay was stopped cleanly while its session streamed the slot, and left no stop mark"
                            .into(),
                    );
                }
                tokio::time::sleep(d.millis(0, 1_000)).await;
                self.pg.consume();
                tokio::time::sleep(d.millis(0, 2_000)).await;
                self.start_relay();
            }
            4..6 => {
                self.kill_all().await;
                tokio::time::sleep(d.millis(0, 1_000)).await;
                self.pg.consume();
                tokio::time::sleep(d.millis(0, 2_000)).await;
                self.start_relay();
            }
            6..9 => {
                // Between sessions: NATS goes away, the sessions end holding the slot and back off.
                self.js.go_down();
                let (js, t) = (Arc::clone(&self.js), d.millis(1_000, 30_000));
                tokio::spawn(async move {
                    tokio::time::sleep(t).await;
                    js.come_up();
                });
                let until = Instant::now() + Duration::from_secs(10);
                while Instant::now() < until && !self.pg.consume() {
                    tokio::time::sleep(d.millis(20, 200)).await;
                }
            }
            _ => {
                self.pg.cut();
                self.pg.consume();
            }
        }
    }

    async fn restart_relay(&mut self) {
        self.kill_relay().await;
        tokio::time::sleep(self.dice.millis(0, 3_000)).await;
        self.start_relay();
    }

    /// One fault, drawn among those enabled.
    async fn fault(&mut self, faults: &FaultSet) {
        let enabled: Vec<(&str, u64)> = FAULTS
            .iter()
            .copied()
            .filter(|(n, w)| *w > 0 && faults.has(n))
            .collect();
        let total: u64 = enabled.iter().map(|(_, w)| w).sum();
        if total == 0 {
            return;
        }
        let mut roll = self.dice.range(0, total);
        let name = enabled
            .iter()
            .find(|(_, w)| {
                if roll < *w {
                    true
                } else {
                    roll -= w;
                    false
                }
            })
            .map(|(n, _)| *n)
            .unwrap();
        if (self.huge_pending.load(Ordering::Relaxed)
            || self.backfilled
            || self.park.is_some()
            || self.requeue.is_some())
            && matches!(
                name,
                "restore"
                    | "pitr"
                    | "live_restore"
                    | "live_pitr"
                    | "promote"
                    | "consume"
                    | "foreign"
                    | "live_foreign"
                    | "purge"
            )
        {
            trace!(
                self.trace,
                "FAULT {name} held back: the huge transaction is pending, or a backfill replaced the slot"
            );
            return;
        }
        // Park worlds: now and then a release races the fault; `requeue_event` worlds a request.
        if let Some(op) = &self.park
            && op.races()
        {
            op.release();
        }
        if let Some(rq) = &self.requeue
            && rq.races()
        {
            rq.request();
        }
        trace!(self.trace, "FAULT {name}");
        let d = self.dice.clone();
        match name {
            "kill" => self.restart_relay().await,
            "stop" => {
                self.stop_relay().await;
                tokio::time::sleep(d.millis(0, 2_000)).await;
                self.start_relay();
            }
            "cut" => self.pg.cut(),
            "blackhole" => self.pg.black_hole(Duration::from_secs(60)),
            "pg_down" => self.pg.unreachable(d.millis(500, 20_000)),
            "pg_crash" => self.pg.crash(d.millis(200, 5_000)),
            // Now and then the standby lacks the last records, which the relay may have
            // published: the stream's tail is then from a history the new timeline does not have.
            "promote" => {
                if self.pg.promote(d.millis(200, 5_000), d.chance(0.25)) {
                    self.js.distrusted();
                }
            }
            "nats_down" => {
                self.js.go_down();
                let (js, t) = (Arc::clone(&self.js), d.millis(1_000, 30_000));
                tokio::spawn(async move {
                    tokio::time::sleep(t).await;
                    js.come_up();
                });
            }
            // By hand while no relay runs: what the next session finds at the tail.
            "foreign" => {
                self.kill_all().await;
                self.js.publish_foreign(self.processes);
                tokio::time::sleep(d.millis(0, 3_000)).await;
                self.start_relay();
            }
            // By hand while the relay publishes: the fence's "only writer" is broken mid-flight.
            "live_foreign" => {
                self.js.publish_foreign(self.processes);
            }
            "purge" => self.js.purge(),
            "consume" => self.consume().await,
            "restore" | "pitr" | "live_restore" | "live_pitr" => {
                let live = name.starts_with("live_");
                if !live {
                    self.kill_all().await;
                }
                if self.pg.restore(name.ends_with("pitr")) {
                    self.js.distrusted();
                }
                if !live {
                    tokio::time::sleep(d.millis(0, 3_000)).await;
                    self.start_relay();
                }
            }
            _ => unreachable!("fault {name}"),
        }
    }
}
