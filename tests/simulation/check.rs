//! The promises, checked against what the simulators saw. P2 is checked as it happens (at every
//! status update, in `postgres.rs`); the rest here, once the world has settled, against the history
//! the slot now follows (the WAL after every restore) and the stream:
//!
//! - P1: every event of that history is in the stream, by id, as a routed message or a dead letter;
//! - context: an event after a trace context message of its transaction carries its `traceparent`;
//! - P7: an event that cannot be routed, and every non-transactional outbox message, is a dead
//!   letter, and the message's dead letter carries its payload: nothing vanishes;
//! - P3: no event id is stored twice by the relay, unless the world gave the stream a reason to be
//!   distrusted in between (a restore, a new timeline, a foreign message, a publish of an ended
//!   session landing late, a publish refused because the relay process that sent it lost the slot
//!   to another one whose session stored in its place (`jetstream.rs` `refused_overtaken`): then
//!   the relay republishes from the confirmed position and only the duplicate window stands between
//!   it and a second copy): between the event's first copy and
//!   the later one (what was stored before a restore, or before another writer's message, can no
//!   longer be proven stored by a replay that has to read past it), or between the starts of the
//!   sessions that published them (a session running at a restore still stores what it read
//!   before). Without the fence (`nats.fence =
//!   false`) the duplicate window is the only guard: a second copy is excused once it expired. The
//!   excuses are events the simulators saw, never the relay's own log lines;
//! - P4: the stream holds the first copies of the events in commit order, and in insert order
//!   within a transaction. With the fence nothing excuses a pair out of order (publishes are
//!   chained by sequence and by message id: nothing is stored past a refused message, whoever
//!   wrote in between). Without it, a publish lost with a connection can be stored after later
//!   ones when the relay sends it again: a pair is excused when a publish of the earlier event
//!   was lost. (A message over the stream's `max_msg_size` is dead-lettered before it is sent,
//!   fence or not, so its dead letter keeps its place.)
//!
//! - P7 counted: the relay's dead-letter counter never counts more dead letters than it stored
//!   (a republished one that JetStream drops by its id is a duplicate, not a new dead letter).
//! - P9, a client other than a relay that consumed the slot (the `consume` fault): the events it
//!   skipped are lost, which no relay can prevent; what the relay promises is to say so. An event
//!   the relay had not stored when the simulated Postgres recorded that another client consumed
//!   its unit is excused from P1 (it may be missing) and P4 (a rewind of the slot may bring it back
//!   after later events were stored), and only then ([`consumed_away`]). The report is checked as it happens (`postgres.rs`): when
//!   the next relay session takes the slot, the simulator decides from what it saw alone whether the
//!   stop mark can show the consumption (a mark stood at or before where the consumer began and
//!   still stands; the stream's last message was then, and still is, the relay's own from the
//!   server's current history; skipped events below the slot are missing from the stream); if so,
//!   the slot may not be confirmed again before the relay reported it
//!   (`outbox_relay_slot_consumed_events` above 0, which an operator watches before dropping the
//!   mark). Not demanded, as docs/guarantees.md P9 "What it cannot see" says: no mark (a relay
//!   killed, connections cut so that the walsender went first, a promotion: the mark lives on the
//!   primary only), a restore since (the mark and the slot come back from the snapshot), a stream
//!   whose last message is gone, another writer's or of an earlier history, or any other reason
//!   the world gave to distrust the stream's tail in between.
//!
//! A copy stored before its event committed belongs to another event with the same id (an id made
//! of an LSN that a restore reused), so it never counts for this one.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Mutex;

use tokio::time::Instant;

use super::jetstream::{DEAD_LETTER_SUBJECT, Stored};
use super::postgres::{Must, Unit};
use super::trace::{Trace, trace};

/// What went wrong in a world, in order.
#[derive(Default)]
pub(crate) struct Violations(Mutex<Vec<String>>);

impl Violations {
    pub(crate) fn report(&self, trace: &Trace, what: String) {
        trace!(trace, "VIOLATION {what}");
        self.0.lock().unwrap().push(what);
    }

    pub(crate) fn any(&self) -> bool {
        !self.0.lock().unwrap().is_empty()
    }

    pub(crate) fn list(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// What the world did that excuses a second copy or an order.
pub(crate) struct Excuses<'a> {
    /// When the world gave the stream's tail a reason to be distrusted: restores, foreign
    /// messages, publishes of ended sessions landing late.
    pub distrust: &'a [Instant],
    /// `Nats-Msg-Id`s of publishes lost with a connection.
    pub lost: &'a HashSet<String>,
    /// Every move of the slot's confirmed position: (when, to).
    pub confirmations: &'a [(Instant, u64)],
    /// `nats.fence`.
    pub fence: bool,
    /// The sessions of backfills: a backfill publishes its snapshot's rows in `--order-by` order
    /// (P4 holds for events the relay stored first, not for rows a backfill stored first), without
    /// trace context (a row carries none), and all of them again on each run (JetStream drops those
    /// it holds inside its duplicate window: a later copy by a backfill is the documented one).
    pub backfills: &'a HashSet<u64>,
    /// With atomic transactions: the most messages one batch holds (the server's 1,000, and never
    /// more than the window); `None` without them.
    pub atomic_room: Option<usize>,
    /// `outbox.on_invalid = "park"`: where an event must go is the per-key oracle's to judge
    /// (`parking.rs`), and an event is stored once per role (parked copy, requeued, parked again):
    /// P3 counts copies by their `Nats-Msg-Id`.
    pub park: bool,
    /// Dead letters are requeued (`requeue_event.rs`): a requeued event and a dead letter
    /// dead-lettered again are stored once each beside its dead letter, so P3 counts copies by
    /// their `Nats-Msg-Id` as in park worlds.
    pub requeue_event: bool,
}

/// P1, P3, P4 and P7 over the settled world.
pub(crate) fn settled(
    units: &[Unit],
    stream: &[Stored],
    excuses: &Excuses<'_>,
    trace: &Trace,
    v: &Violations,
) {
    let mut copies: BTreeMap<&str, Vec<&Stored>> = BTreeMap::new();
    for m in stream.iter().filter(|m| !m.foreign) {
        if let Some(id) = m.event_id() {
            copies.entry(id).or_default().push(m);
        }
    }
    // P1 and P7: each event's first copy stored after it committed.
    let mut order: Vec<(u64, u32, u64, &str)> = Vec::new();
    for unit in units {
        for e in &unit.events {
            let mine: Vec<&Stored> = copies
                .get(e.msg_id.as_str())
                .map(|c| c.iter().copied().filter(|m| m.at >= unit.at).collect())
                .unwrap_or_default();
            let Some(first) = mine.first() else {
                v.report(
                    trace,
                    format!(
                        "P1: event {} of the {} is not in the stream",
                        e.msg_id, unit.what
                    ),
                );
                continue;
            };
            let backfilled = excuses.backfills.contains(&first.session);
            if !backfilled {
                order.push((unit.start, e.index, first.seq, &e.msg_id));
            }
            if let (Some(tp), Must::Routed(subject), false) = (&e.context, &e.must, backfilled) {
                // Parked (never on its subject), it is the per-key oracle's.
                let parked_only = excuses.park && mine.iter().all(|m| &m.subject != subject);
                let carried = parked_only
                    || mine.iter().any(|m| {
                        &m.subject == subject
                            && m.headers.get("traceparent").map(|v| v.as_str()) == Some(tp.as_str())
                    });
                if !carried {
                    v.report(
                        trace,
                        format!(
                            "context: event {} of the {} does not carry its transaction's traceparent {tp}",
                            e.msg_id, unit.what
                        ),
                    );
                }
            }
            match &e.must {
                _ if excuses.park => {}
                Must::Routed(subject) if !mine.iter().any(|m| &m.subject == subject) => v.report(
                    trace,
                    format!(
                        "P7: event {} of the {} is stored on {}, not routed to {subject}",
                        e.msg_id, unit.what, first.subject
                    ),
                ),
                Must::DeadLetter(payload) => {
                    let dead = mine.iter().any(|m| {
                        m.subject == DEAD_LETTER_SUBJECT
                            && payload.as_ref().is_none_or(|p| *p == m.payload)
                    });
                    if !dead {
                        v.report(
                            trace,
                            format!(
                                "P7: event {} of the {} has no dead letter{} (stored on {})",
                                e.msg_id,
                                unit.what,
                                if payload.is_some() {
                                    " with its payload"
                                } else {
                                    ""
                                },
                                first.subject
                            ),
                        );
                    }
                }
                _ => {}
            }
        }
    }
    atomic_whole(units, &copies, excuses, trace, v);
    let trusted = trusted_again(units, &copies, excuses);
    if excuses.park || excuses.requeue_event {
        let mut wire: BTreeMap<&str, Vec<&Stored>> = BTreeMap::new();
        for m in stream.iter().filter(|m| !m.foreign) {
            if let Some(id) = m.msg_id() {
                wire.entry(id).or_default().push(m);
            }
        }
        p3_second_copies(stream, &wire, excuses, &trusted, trace, v);
    } else {
        p3_second_copies(stream, &copies, excuses, &trusted, trace, v);
    }
    p4_commit_order(order, excuses, trace, v);
}

/// The excuse for a client other than a relay that consumed the slot: `units` without the events
/// the simulated Postgres recorded it skipped (`consumed`: id, when), unless the relay had stored
/// them before (those are checked as any). A skipped event is never sent to the relay again (P1
/// cannot hold for it), unless a rewind of the slot (a crash before the consumer's move was
/// checkpointed, a restore) brings it back: then it is stored after events committed later that
/// the relay stored meanwhile (P4 cannot hold for it either). Whether the relay had to report the
/// consumption is checked as it happens (P9, `postgres.rs`).
pub(crate) fn consumed_away(
    mut units: Vec<Unit>,
    consumed: &HashMap<String, Instant>,
    stream: &[Stored],
    trace: &Trace,
) -> Vec<Unit> {
    if consumed.is_empty() {
        return units;
    }
    let mut first_stored: HashMap<&str, Vec<Instant>> = HashMap::new();
    for m in stream.iter().filter(|m| !m.foreign) {
        if let Some(id) = m.event_id() {
            first_stored.entry(id).or_default().push(m.at);
        }
    }
    let mut excused = 0;
    for unit in &mut units {
        let before = unit.events.len();
        let committed = unit.at;
        unit.events.retain(|e| {
            consumed.get(&e.msg_id).is_none_or(|&taken| {
                first_stored
                    .get(e.msg_id.as_str())
                    .and_then(|at| at.iter().find(|t| **t >= committed))
                    .is_some_and(|first| *first <= taken)
            })
        });
        excused += before - unit.events.len();
    }
    units.retain(|u| !u.events.is_empty());
    trace!(
        trace,
        "P1, P4: {excused} events another client consumed from the slot before the relay stored them are not demanded of the stream"
    );
    units
}

/// Atomic transactions: a transaction that fits one batch lies in one, whole, also when
/// transactions share batches (`nats.atomic_group_ms`): the first copies of its events carry one
/// `Nats-Batch-Id`. A larger one is split, each part atomic; a row a backfill stored first is no
/// batch's member.
fn atomic_whole(
    units: &[Unit],
    copies: &BTreeMap<&str, Vec<&Stored>>,
    excuses: &Excuses<'_>,
    trace: &Trace,
    v: &Violations,
) {
    let Some(room) = excuses.atomic_room else {
        return;
    };
    for unit in units.iter().filter(|u| u.events.len() <= room) {
        let firsts: Vec<&Stored> = unit
            .events
            .iter()
            .filter_map(|e| copies.get(e.msg_id.as_str()))
            .filter_map(|c| c.iter().copied().find(|m| m.at >= unit.at))
            .collect();
        if firsts
            .iter()
            .any(|m| excuses.backfills.contains(&m.session))
        {
            continue;
        }
        let batches: BTreeSet<&str> = firsts
            .iter()
            .map(|m| m.headers.get("Nats-Batch-Id").map_or("", |b| b.as_str()))
            .collect();
        if batches.len() > 1 {
            v.report(
                trace,
                format!(
                    "atomic: the {} ({} events, a batch holds {room}) is stored in {} batches: {:?}",
                    unit.what,
                    unit.events.len(),
                    batches.len(),
                    firsts.iter().map(|m| m.seq).collect::<Vec<_>>()
                ),
            );
        }
    }
}

/// P3: a second copy of an event id needs a reason the world gave.
fn p3_second_copies(
    stream: &[Stored],
    copies: &BTreeMap<&str, Vec<&Stored>>,
    excuses: &Excuses<'_>,
    trusted: &[(Instant, Option<Instant>)],
    trace: &Trace,
    v: &Violations,
) {
    let reach = republished_over(stream, copies);
    for (id, all) in copies {
        for pair in all.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            // Without the fence the duplicate window is the only guard (the simulated JetStream
            // stores a second copy only once it expired); with it, the tail must have been
            // distrusted in between.
            let excused = !excuses.fence
                || excuses.backfills.contains(&b.session)
                || (excuses.backfills.contains(&a.session) && b.late)
                || b.era > a.era
                || excuses
                    .distrust
                    .iter()
                    .any(|t| all[0].at <= *t && *t <= b.at)
                || reach
                    .get(&b.session)
                    .is_some_and(|&(from, to)| from < a.seq && a.seq <= to)
                || trusted
                    .iter()
                    .any(|&(t, until)| t <= b.at && until.is_none_or(|u| b.at <= u));
            if !excused {
                v.report(
                    trace,
                    format!(
                        "P3: event {id} is stored twice (sequences {} and {}) with nothing distrusted in between",
                        a.seq, b.seq
                    ),
                );
            }
        }
    }
}

/// For each distrust event, until when the relay may still distrust the stream: until the slot
/// was first confirmed past a unit of work whose first copy was stored after the event (to confirm
/// it, the relay had the acks of what it stored past the event, and trusts its tail again). `None`:
/// never within the run.
fn trusted_again(
    units: &[Unit],
    copies: &BTreeMap<&str, Vec<&Stored>>,
    excuses: &Excuses<'_>,
) -> Vec<(Instant, Option<Instant>)> {
    // Each unit's commit position and the first time one of its events was stored after it
    // committed.
    let firsts: Vec<(u64, Instant)> = units
        .iter()
        .filter_map(|u| {
            u.events
                .iter()
                .filter_map(|e| copies.get(e.msg_id.as_str()))
                .filter_map(|c| c.iter().find(|m| m.at >= u.at).map(|m| m.at))
                .min()
                .map(|at| (u.start, at))
        })
        .collect();
    excuses
        .distrust
        .iter()
        .map(|&t| {
            let until = excuses
                .confirmations
                .iter()
                .filter(|(at, _)| *at >= t)
                .find(|(at, to)| {
                    firsts
                        .iter()
                        .any(|(start, first)| *first >= t && *first <= *at && *to > *start)
                })
                .map(|(at, _)| *at);
            (t, until)
        })
        .collect()
}

/// For each session that republished what the stream held, the stretch of the stream it went over
/// again, when a message another writer stored (or one a session stored after it ended) lies in
/// it: `(from, to)` = (the sequence of the earlier copy of the session's first message, the
/// sequence the session started at). A replay that has to prove such a stretch cannot: the
/// relay then trusts no tail, and a copy of anything in the stretch may follow.
fn republished_over(
    stream: &[Stored],
    copies: &BTreeMap<&str, Vec<&Stored>>,
) -> std::collections::HashMap<u64, (u64, u64)> {
    let mut first_of: std::collections::HashMap<u64, &Stored> = std::collections::HashMap::new();
    for m in stream.iter().filter(|m| !m.foreign && m.session != 0) {
        first_of.entry(m.session).or_insert(m);
    }
    let intruders: Vec<u64> = stream
        .iter()
        .filter(|m| m.foreign || m.late)
        .map(|m| m.seq)
        .collect();
    let mut reach = std::collections::HashMap::new();
    for (session, first) in first_of {
        let Some(earlier) = first
            .event_id()
            .and_then(|id| copies.get(id))
            .and_then(|c| c.iter().rev().find(|m| m.seq < first.seq))
        else {
            continue;
        };
        if intruders.iter().any(|&f| earlier.seq < f && f < first.seq) {
            reach.insert(session, (earlier.seq - 1, first.seq));
        }
    }
    reach
}

/// P4: first copies in commit order (`order`: commit position, index in the unit, first copy's
/// sequence, id).
fn p4_commit_order(
    mut order: Vec<(u64, u32, u64, &str)>,
    excuses: &Excuses<'_>,
    trace: &Trace,
    v: &Violations,
) {
    order.sort();
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Without the fence nothing stops the messages behind a lost publish.
        let excused = !excuses.fence && excuses.lost.contains(a.3);
        if a.2 >= b.2 && !excused {
            v.report(
                trace,
                format!(
                    "P4: event {} (sequence {}) comes after event {} (sequence {}) in the stream, before it in commit order",
                    a.3, a.2, b.3, b.2
                ),
            );
        }
    }
}

/// P7 counted: `counted` (the relay processes' `dead_letters`, added up) is at most the dead
/// letters the relay stored. Less is possible (an answer lost: the next session finds the dead
/// letter stored), more means a dead letter was counted that JetStream did not store anew.
pub(crate) fn counted(counted: u64, stream: &[Stored], trace: &Trace, v: &Violations) {
    let stored = stream
        .iter()
        .filter(|m| !m.foreign && m.subject == DEAD_LETTER_SUBJECT)
        .count() as u64;
    if counted > stored {
        v.report(
            trace,
            format!(
                "P7: the relay counted {counted} dead letters, but stored {stored} (duplicates counted as new ones)"
            ),
        );
    }
}
