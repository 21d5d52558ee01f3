//! `requeue_event` worlds (a quarter of the `dead_letter` worlds without atomic batches, a huge
//! transaction or a backfill): an operator ([`Requeuer`]) writes `outbox_requeue_event(event_id)`
//! as sql/09 does (a transactional logical message under `outbox-relay.control`), at random times
//! and right before some faults (kills, stops, cuts, outages), for the id of a dead-lettered event,
//! of a routed one, or of none at all; each id at most once.
//!
//! The oracle ([`check`]) derives what the stream must show from the committed rows and requests
//! alone, never from the relay's code or logs. The messages a request expands to carry its commit
//! LSN in `Outbox-Position`, which no other message has (the request is a transaction of its own):
//! - the id of a dead letter whose event is publishable as it is now (a non-transactional outbox
//!   message, dead-lettered only for that): at least one message at the request, each on the event's
//!   own subject with `Nats-Msg-Id` = the event's id (a consumer deduplicating by id sees it once)
//!   and the payload its dead letter kept, stored after the request committed;
//! - the id of a dead letter still invalid (a type that is no subject token, a payload over the
//!   limits): at least one message at the request, each a new dead letter `dead-letter:<id>:<request>`;
//! - any other id (a routed event, no event): no message at the request: it changes nothing;
//! - and no dead-lettered event is on a subject of its own but at one of its requests.
//!
//! Not modelled in these worlds, as in park worlds: faults that rewrite the server's history or the
//! stream (restores, promotions, other clients consuming the slot, purges, foreign messages) and
//! retention limits, which could take a dead letter away before its request is carried out.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

use super::check::Violations;
use super::jetstream::{DEAD_LETTER_SUBJECT, Stored};
use super::postgres::{Expected, Must, Postgres, Unit};
use super::rng::Dice;
use super::trace::{Trace, trace};

/// One `outbox_requeue_event` the world committed.
#[derive(Clone, Debug)]
pub(crate) struct EventRequest {
    /// Where its commit record starts: the LSN its expansion's `Outbox-Position` names.
    start: u64,
    /// When it committed: nothing of it can be stored before.
    at: Instant,
    event_id: String,
    request: String,
}

/// The operator of a `requeue_event` world.
pub(crate) struct Requeuer {
    pg: Arc<Postgres>,
    dice: Dice,
    trace: Arc<Trace>,
    requests: Mutex<Vec<EventRequest>>,
    /// The ids asked for so far: each once, so that a second copy of a republished event is
    /// always P3's to judge.
    asked: Mutex<HashSet<String>>,
    n: AtomicU64,
}

impl Requeuer {
    pub(crate) fn new(pg: Arc<Postgres>, dice: Dice, trace: Arc<Trace>) -> Arc<Self> {
        Arc::new(Requeuer {
            pg,
            dice,
            trace,
            requests: Mutex::default(),
            asked: Mutex::default(),
            n: AtomicU64::new(0),
        })
    }

    /// Whether a request races the fault about to strike (three in ten).
    pub(crate) fn races(&self) -> bool {
        self.dice.chance(0.3)
    }

    /// One request: mostly for a dead-lettered event, now and then for a routed one or an id
    /// no event has.
    pub(crate) fn request(&self) {
        let d = &self.dice;
        let units = self.pg.units();
        let events = || units.iter().flat_map(|u| &u.events);
        let asked = self.asked.lock().unwrap().clone();
        let fresh = |e: &&Expected| !asked.contains(&e.msg_id);
        let dead: Vec<&Expected> = events()
            .filter(|e| !matches!(e.must, Must::Routed(_)))
            .filter(fresh)
            .collect();
        let routed: Vec<&Expected> = events()
            .filter(|e| matches!(e.must, Must::Routed(_)))
            .filter(fresh)
            .collect();
        let n = self.n.fetch_add(1, Ordering::Relaxed);
        let roll = d.range(0, 10);
        let id = if roll < 7 && !dead.is_empty() {
            dead[d.range(0, dead.len() as u64) as usize].msg_id.clone()
        } else if roll < 9 && !routed.is_empty() {
            routed[d.range(0, routed.len() as u64) as usize]
                .msg_id
                .clone()
        } else {
            format!("never-written-{n}")
        };
        let request = format!("{:08x}-q{n}", d.next_u64() as u32);
        if let Some(start) = self.pg.requeue_event(&id, &request) {
            self.asked.lock().unwrap().insert(id.clone());
            self.requests.lock().unwrap().push(EventRequest {
                start,
                at: Instant::now(),
                event_id: id,
                request,
            });
        }
    }

    /// Requests at random times while the applications write.
    pub(crate) async fn run(self: Arc<Self>, writing: Arc<AtomicBool>) {
        while writing.load(Ordering::Relaxed) {
            tokio::time::sleep(self.dice.millis(300, 4_000)).await;
            if !writing.load(Ordering::Relaxed) {
                return;
            }
            self.request();
        }
        trace!(
            self.trace,
            "requeue_event: {} requests written",
            self.requests.lock().unwrap().len()
        );
    }

    /// The requests committed, in commit order.
    pub(crate) fn requests(&self) -> Vec<EventRequest> {
        self.requests.lock().unwrap().clone()
    }
}

/// The commit LSN an `Outbox-Position` (`[HISTORY/]X/Y:I[.S]`) names.
fn position_lsn(m: &Stored) -> Option<u64> {
    let v = m.headers.get("Outbox-Position")?.as_str();
    let mut parts = v.rsplit('/');
    let lo = parts.next()?.split(':').next()?;
    let hi = parts.next()?;
    Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
}

/// The `requeue_event` oracle over the settled world (see the module docs).
pub(crate) fn check(
    units: &[Unit],
    requests: &[EventRequest],
    stream: &[Stored],
    trace: &Trace,
    v: &Violations,
) {
    let mut events: HashMap<&str, (&Unit, &Expected)> = HashMap::new();
    for u in units {
        for e in &u.events {
            events.insert(&e.msg_id, (u, e));
        }
    }
    let ours: Vec<&Stored> = stream.iter().filter(|m| !m.foreign).collect();
    let mut at_lsn: HashMap<u64, Vec<&Stored>> = HashMap::new();
    for m in &ours {
        if let Some(lsn) = position_lsn(m) {
            at_lsn.entry(lsn).or_default().push(m);
        }
    }
    // The events with a dead letter of their own (`dead-letter:<id>`) stored after they committed.
    let dead_lettered = |id: &str| {
        let first = format!("dead-letter:{id}");
        events.get(id).is_some_and(|(u, _)| {
            ours.iter().any(|m| {
                m.subject == DEAD_LETTER_SUBJECT && m.msg_id() == Some(&first) && m.at >= u.at
            })
        })
    };
    let mut requested: HashMap<&str, Vec<u64>> = HashMap::new();
    let (mut republished, mut again, mut nothing) = (0, 0, 0);
    for r in requests {
        requested.entry(&r.event_id).or_default().push(r.start);
        let expansion = at_lsn.get(&r.start).map_or(&[][..], Vec::as_slice);
        let what = format!(
            "requeue_event {} of {} (committed at {})",
            r.request,
            r.event_id,
            outbox_relay::Lsn(r.start)
        );
        let event = events
            .get(r.event_id.as_str())
            .filter(|(u, _)| u.start < r.start && dead_lettered(&r.event_id));
        let Some((_, e)) = event else {
            nothing += 1;
            if let Some(m) = expansion.first() {
                v.report(
                    trace,
                    format!(
                        "requeue_event: {what} names no dead letter, but changed the stream: {} on {} (sequence {})",
                        m.msg_id().unwrap_or("?"),
                        m.subject,
                        m.seq
                    ),
                );
            }
            continue;
        };
        if expansion.is_empty() {
            v.report(
                trace,
                format!("requeue_event: {what}: the stream holds nothing the request republished or dead-lettered again"),
            );
            continue;
        }
        let wrong = match &e.must {
            // A non-transactional message, dead-lettered for that alone: publishable now.
            Must::DeadLetter(Some(payload)) => {
                republished += 1;
                let subject = format!("outbox.{}", e.key.0);
                expansion.iter().find(|m| {
                    m.subject != subject
                        || m.msg_id() != Some(e.msg_id.as_str())
                        || m.payload != *payload
                        || m.at < r.at
                })
            }
            _ => {
                again += 1;
                let id = format!("dead-letter:{}:{}", r.event_id, r.request);
                expansion.iter().find(|m| {
                    m.subject != DEAD_LETTER_SUBJECT || m.msg_id() != Some(&id) || m.at < r.at
                })
            }
        };
        if let Some(m) = wrong {
            v.report(
                trace,
                format!(
                    "requeue_event: {what} stored {} on {} (sequence {}, {} payload bytes): not the event on its subject \
                     with its id and payload, or its new dead letter, after the request",
                    m.msg_id().unwrap_or("?"),
                    m.subject,
                    m.seq,
                    m.payload.len()
                ),
            );
        }
    }
    // A dead-lettered event on a subject of its own only at one of its requests.
    for m in &ours {
        let Some(id) = m.event_id() else { continue };
        if m.subject.starts_with(DEAD_LETTER_SUBJECT)
            || !events
                .get(id)
                .is_some_and(|(_, e)| matches!(e.must, Must::DeadLetter(_)))
        {
            continue;
        }
        let at = position_lsn(m);
        if !requested
            .get(id)
            .is_some_and(|starts| at.is_some_and(|lsn| starts.contains(&lsn)))
        {
            v.report(
                trace,
                format!(
                    "requeue_event: dead-lettered event {id} is on {} (sequence {}) without a request for it there",
                    m.subject, m.seq
                ),
            );
        }
    }
    trace!(
        trace,
        "requeue_event: {} requests: {republished} republish a dead letter, {again} dead-letter one again, {nothing} name none",
        requests.len()
    );
}
