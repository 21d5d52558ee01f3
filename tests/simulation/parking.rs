//! Park worlds (`outbox.on_invalid = "park"`, a quarter of the worlds): the operator who releases
//! parked keys, and the per-key order oracle.
//!
//! The applications write poison events (`postgres.rs`, [`Poison`]): a `Paid` payload its schema
//! refuses, a row whose aggregate type is no subject token, a row over the stream's size limit, a
//! non-transactional message. Each parks its key (`aggregate_type`, `aggregate_id`); the later
//! events of the key queue behind it. The operator ([`Operator`]) writes releases as sql/09's
//! functions do (a transactional logical message under `outbox-relay.control`, `requeue` or
//! `discard` of a key), at random times and right before some faults (kills, stops, cuts,
//! outages), and once in the world fixes the schema: the applications stop writing refused
//! payloads, the operator waits until the transactions open then that hold a refused payload have
//! ended and the slot has passed everything written until then (so every event and release of the
//! broken era was decided under the broken schema), then puts the fixed
//! schema in force (`SchemasHook`, what SIGHUP does). A requeue after the fix republishes a schema
//! poison; one before leaves the key parked at it with the new reason.
//!
//! The oracle ([`check`]) reads the stream as a consumer of each key's subject sees it and derives
//! what it must see from the committed rows and releases alone, never from the relay's code or
//! logs: per key, in commit order, an event goes to its subject unless the key is parked, and a
//! poison parks it; a requeue delivers the run in order up to the first event still invalid (which
//! parks the key again), a discard drops it. The key's events on their subject, first copies in
//! stream order (a consumer dedups by event id), must be exactly that list: in commit order,
//! without gaps, none after an unreleased poison. Every event the model parks has a parked copy on
//! the key's parking subject (computed here from the wire format, SHA-256 over the tagged key),
//! every release of a parked key its marker, and the key's parking subject ends with a parked copy
//! exactly when the model ends with the key parked (what the next session's rebuild reads).
//!
//! Not modelled in park worlds: faults that rewrite the server's history or the stream
//! (restores, promotions, other clients consuming the slot, purges, foreign messages, `max_age`),
//! backfills, atomic transactions (refused with park), and `requeue_event`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use outbox_relay::config::Settings;
use outbox_relay::reload::{Hook, SchemasHook};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::check::Violations;
use super::jetstream::{DEAD_LETTER_SUBJECT, Stored};
use super::postgres::{Expected, Poison, Postgres, Release, Unit};
use super::rng::Dice;
use super::trace::{Trace, trace};

/// The event type with a schema in park worlds.
pub(crate) const SCHEMA_TYPE: &str = "Paid";

/// The schema directories of park worlds, written once per test process: `strict` refuses a
/// `Paid` payload with `"bad": true`, `fixed` takes any object.
pub(crate) fn schema_dirs() -> &'static (String, String) {
    static DIRS: OnceLock<(String, String)> = OnceLock::new();
    DIRS.get_or_init(|| {
        let root =
            std::env::temp_dir().join(format!("outbox-relay-sim-schemas-{}", std::process::id()));
        let write = |name: &str, schema: &str| {
            let dir = root.join(name);
            std::fs::create_dir_all(&dir).expect("schema directory");
            std::fs::write(dir.join(format!("{SCHEMA_TYPE}.json")), schema).expect("schema file");
            dir.to_string_lossy().into_owned()
        };
        (
            write(
                "strict",
                r#"{"type": "object", "properties": {"bad": {"const": false}}}"#,
            ),
            write("fixed", r#"{"type": "object"}"#),
        )
    })
}

/// Where the schema fix stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The strict schema is in force; releases are written.
    Broken,
    /// The applications were fixed; the operator waits for the slot: no release is written.
    Waiting,
    /// The fixed schema is in force since the WAL was at this LSN.
    Fixed(u64),
    /// The slot did not pass the broken era in time: the schema stays strict.
    Never,
}

/// The operator of a park world: writes releases, fixes the schema.
pub(crate) struct Operator {
    pg: Arc<Postgres>,
    dice: Dice,
    trace: Arc<Trace>,
    phase: Mutex<Phase>,
    requests: AtomicU64,
}

impl Operator {
    pub(crate) fn new(pg: Arc<Postgres>, dice: Dice, trace: Arc<Trace>) -> Arc<Self> {
        Arc::new(Operator {
            pg,
            dice,
            trace,
            phase: Mutex::new(Phase::Broken),
            requests: AtomicU64::new(0),
        })
    }

    /// Where the fixed schema came in force, if it did.
    pub(crate) fn fixed_at(&self) -> Option<u64> {
        match *self.phase.lock().unwrap() {
            Phase::Fixed(at) => Some(at),
            _ => None,
        }
    }

    /// Whether a release races the fault about to strike (three in ten).
    pub(crate) fn races(&self) -> bool {
        self.dice.chance(0.3)
    }

    /// One release of a key with a poison (now and then of a key that never was parked), unless
    /// the operator waits for the slot.
    pub(crate) fn release(&self) {
        if *self.phase.lock().unwrap() == Phase::Waiting {
            return;
        }
        let d = &self.dice;
        let mut keys = self.pg.poisoned_keys();
        if keys.is_empty() || d.chance(0.1) {
            keys.push((
                d.pick(&["order", "claim"]).to_owned(),
                format!("a{}", d.range(0, 17)),
            ));
        }
        let key = keys[d.range(0, keys.len() as u64) as usize].clone();
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        let request = format!("{:08x}-r{n}", d.next_u64() as u32);
        self.pg.release(d.chance(0.25), &key, &request);
    }

    /// Releases at random times while the applications write; at `fix_at` the schema fix.
    pub(crate) async fn run(
        self: Arc<Self>,
        settings: Settings,
        writing: Arc<AtomicBool>,
        fix_at: Instant,
    ) {
        while writing.load(Ordering::Relaxed) {
            tokio::time::sleep(self.dice.millis(300, 4_000)).await;
            if !writing.load(Ordering::Relaxed) {
                return;
            }
            if Instant::now() >= fix_at && *self.phase.lock().unwrap() == Phase::Broken {
                self.fix(&settings, &writing).await;
                continue;
            }
            self.release();
        }
    }

    /// The schema fix: the applications first, then, once the slot passed what they wrote before,
    /// the schema (as SIGHUP applies `outbox.schemas`).
    async fn fix(&self, settings: &Settings, writing: &AtomicBool) {
        *self.phase.lock().unwrap() = Phase::Waiting;
        self.pg.schema_fixed_in_apps();
        trace!(
            self.trace,
            "PARK the applications are fixed at {}; the operator waits for the slot",
            outbox_relay::Lsn(self.pg.flushed())
        );
        // The broken era ends with the last commit of a refused payload: a transaction open at
        // the fix that holds one commits later (seed 25 once: its event reached the relay after
        // the schema fix and was published, where the model parked it).
        let until = Instant::now() + Duration::from_secs(120);
        let mut era_end = None;
        loop {
            if era_end.is_none() && !self.pg.schema_poison_open() {
                era_end = Some(self.pg.flushed());
            }
            if era_end.is_some_and(|end| self.pg.slot_confirmed() >= end) {
                break;
            }
            if Instant::now() >= until || !writing.load(Ordering::Relaxed) {
                trace!(
                    self.trace,
                    "PARK the schema stays strict: the slot did not pass the broken era ({})",
                    era_end.map_or("a refused payload still uncommitted".to_owned(), |end| {
                        outbox_relay::Lsn(end).to_string()
                    })
                );
                *self.phase.lock().unwrap() = Phase::Never;
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut c = settings.config().clone();
        c.outbox.schemas = schema_dirs().1.clone();
        let fixed = c.validate().expect("the fixed schema directory loads");
        SchemasHook::new(&settings.schemas, Arc::default())
            .apply(&fixed)
            .expect("the fixed schema applies");
        let at = self.pg.flushed();
        trace!(
            self.trace,
            "PARK the fixed schema is in force from {}",
            outbox_relay::Lsn(at)
        );
        *self.phase.lock().unwrap() = Phase::Fixed(at);
    }
}

/// The parking subject of `key`, from the wire format alone.
fn parking_subject(key: &(String, String)) -> String {
    let mut h = Sha256::new();
    for v in [&key.0, &key.1] {
        h.update([1u8]);
        h.update((v.len() as u32).to_be_bytes());
        h.update(v.as_bytes());
    }
    let hex: String = h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{DEAD_LETTER_SUBJECT}.parked.{hex}")
}

/// What the world's rows and releases say of one key.
#[derive(Default)]
struct Model<'a> {
    /// The run held now, in order.
    parked: Option<Vec<&'a Expected>>,
    /// The events its subject must show, in order.
    delivered: Vec<&'a str>,
    /// Every event parked at some time: each needs a parked copy.
    ever_parked: Vec<&'a str>,
    /// The requests that released the key while parked: each needs its marker.
    markers: Vec<&'a str>,
    /// Why an event is not delivered, for the report.
    held: HashMap<&'a str, String>,
}

impl<'a> Model<'a> {
    fn event(&mut self, e: &'a Expected) {
        if let Some(run) = &mut self.parked {
            run.push(e);
            self.ever_parked.push(&e.msg_id);
            self.held
                .insert(&e.msg_id, format!("behind poison {}", run[0].msg_id));
        } else if let Some(p) = e.poison {
            self.parked = Some(vec![e]);
            self.ever_parked.push(&e.msg_id);
            self.held.insert(&e.msg_id, format!("a poison ({p:?})"));
        } else {
            self.delivered.push(&e.msg_id);
        }
    }

    fn release(&mut self, r: &'a Release, fixed: bool) {
        let Some(run) = self.parked.take() else {
            return;
        };
        self.markers.push(&r.request);
        if r.discard {
            for e in run {
                self.held
                    .insert(&e.msg_id, format!("discarded by {}", r.request));
            }
            return;
        }
        for (i, e) in run.iter().enumerate() {
            let still = match e.poison {
                Some(Poison::Schema) => !fixed,
                Some(_) => true,
                None => false,
            };
            if still {
                let rest = run[i..].to_vec();
                for later in &rest {
                    self.ever_parked.push(&later.msg_id);
                    self.held.insert(
                        &later.msg_id,
                        format!("parked again by {} behind {}", r.request, e.msg_id),
                    );
                }
                self.parked = Some(rest);
                return;
            }
            self.delivered.push(&e.msg_id);
        }
    }
}

/// The per-key order oracle over the settled world (see the module docs).
pub(crate) fn check(
    units: &[Unit],
    releases: &[Release],
    fixed_at: Option<u64>,
    stream: &[Stored],
    trace: &Trace,
    v: &Violations,
) {
    let mut models: HashMap<&(String, String), Model<'_>> = HashMap::new();
    let mut key_of: HashMap<&str, &(String, String)> = HashMap::new();
    let mut order: Vec<&(String, String)> = Vec::new();
    let mut next = releases.iter().peekable();
    for unit in units {
        while let Some(r) = next.next_if(|r| r.start < unit.start) {
            models
                .entry(&r.key)
                .or_default()
                .release(r, fixed_at.is_some_and(|f| r.start >= f));
        }
        for e in &unit.events {
            key_of.insert(&e.msg_id, &e.key);
            if !models.contains_key(&e.key) {
                order.push(&e.key);
            }
            models.entry(&e.key).or_default().event(e);
        }
    }
    for r in next {
        models
            .entry(&r.key)
            .or_default()
            .release(r, fixed_at.is_some_and(|f| r.start >= f));
    }
    // What a consumer of each key's subject sees: first copies, in stream order.
    let mut seen: HashMap<&(String, String), Vec<&str>> = HashMap::new();
    let mut first = std::collections::HashSet::new();
    let mut parking: HashMap<&str, Vec<&Stored>> = HashMap::new();
    for m in stream.iter().filter(|m| !m.foreign) {
        if m.subject.starts_with(DEAD_LETTER_SUBJECT) {
            parking.entry(&m.subject).or_default().push(m);
            continue;
        }
        let Some(id) = m.event_id() else { continue };
        if let Some(key) = key_of.get(id)
            && first.insert(id)
        {
            seen.entry(key).or_default().push(id);
        }
    }
    let (mut parked_keys, mut released) = (0, 0);
    for key in order {
        let model = &models[key];
        let name = format!("{}/{}", key.0, key.1);
        let shows = seen.get(key).map_or(&[][..], Vec::as_slice);
        if shows != model.delivered.as_slice() {
            let at = shows
                .iter()
                .zip(&model.delivered)
                .position(|(a, b)| a != b)
                .unwrap_or(shows.len().min(model.delivered.len()));
            let why = |id: Option<&&str>| match id {
                None => "nothing".to_owned(),
                Some(id) => format!(
                    "{id}{}",
                    model
                        .held
                        .get(*id)
                        .map(|h| format!(" ({h})"))
                        .unwrap_or_default()
                ),
            };
            v.report(
                trace,
                format!(
                    "park order: key {name}: the consumer of its subject sees {} at place {at} of {}, where the rows and \
                     releases say {} of {}",
                    why(shows.get(at)),
                    shows.len(),
                    why(model.delivered.get(at)),
                    model.delivered.len()
                ),
            );
            continue;
        }
        let subject = parking_subject(key);
        let on = parking.get(subject.as_str()).map_or(&[][..], Vec::as_slice);
        if let Some(id) = model.ever_parked.iter().find(|id| {
            !on.iter()
                .any(|m| m.event_id() == Some(**id) && m.headers.get("Outbox-Parking").is_none())
        }) {
            v.report(
                trace,
                format!("park P1: event {id} of key {name} was parked, but {subject} has no parked copy of it"),
            );
        }
        if let Some(r) = model.markers.iter().find(|r| {
            !on.iter()
                .any(|m| m.msg_id() == Some(format!("released:{r}").as_str()))
        }) {
            v.report(
                trace,
                format!("park: release {r} of key {name} (parked then) has no marker on {subject}"),
            );
        }
        let last_parked = on
            .last()
            .is_some_and(|m| m.headers.get("Outbox-Parking").is_none());
        if last_parked != model.parked.is_some() {
            v.report(
                trace,
                format!(
                    "park: key {name} ends {} by the rows and releases, but the last message on {subject} is {}",
                    if model.parked.is_some() { "parked" } else { "free" },
                    match on.last() {
                        None => "none".to_owned(),
                        Some(m) => format!("{} (sequence {})", m.msg_id().unwrap_or("?"), m.seq),
                    }
                ),
            );
        }
        parked_keys += usize::from(model.parked.is_some());
        released += model.markers.len();
    }
    trace!(
        trace,
        "park: {} keys checked, {parked_keys} parked at the end, {released} releases of parked keys, {} releases written, schema {}",
        models.len(),
        releases.len(),
        fixed_at.map_or("never fixed".to_owned(), |at| format!(
            "fixed at {}",
            outbox_relay::Lsn(at)
        ))
    );
}
