//! The promises, checked against what the simulators saw. P2 is checked as it happens (at every
//! status update, in `postgres.rs`); the rest here, once the world has settled, against the history
//! the slot now follows (the WAL after every restore) and the stream:
//!
//! - P1: every event of that history is in the stream, by id, as a routed message or a dead letter;
//! - P7: an event that cannot be routed, and every non-transactional outbox message, is a dead
//!   letter, and the message's dead letter carries its payload: nothing vanishes;
//! - P3: no event id is stored twice by the relay, unless the stream had to be distrusted in
//!   between (a restore, a new timeline, a foreign message at the tail: then the relay republishes
//!   from the confirmed position and only the duplicate window stands between it and a second copy);
//! - P4: the stream holds the events in commit order, and in insert order within a transaction,
//!   except behind a message another writer stored: the fence needs the relay to be the only
//!   writer, and a publish of a killed relay that arrives after such a message can be stored past
//!   the one refused before it (the relay then republishes that one: later, but never lost). A
//!   pair out of order is excused only when a foreign message lies within one window
//!   (`max_in_flight`) before the earlier-stored copy.
//!
//! - P7 counted: the relay's dead-letter counter never counts more dead letters than it stored
//!   (a republished one that JetStream drops by its id is a duplicate, not a new dead letter).
//!
//! A copy stored before its event committed belongs to another event with the same id (an id made
//! of an LSN that a restore reused), so it never counts for this one.

use std::collections::BTreeMap;
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

/// P1, P3, P4 and P7 over the settled world. `distrust` holds the instants the stream's tail could
/// not be trusted from.
pub(crate) fn settled(
    units: &[Unit],
    stream: &[Stored],
    distrust: &[Instant],
    window: u64,
    trace: &Trace,
    v: &Violations,
) {
    let foreign: Vec<u64> = stream.iter().filter(|m| m.foreign).map(|m| m.seq).collect();
    let mut copies: BTreeMap<&str, Vec<&Stored>> = BTreeMap::new();
    for m in stream.iter().filter(|m| !m.foreign) {
        if let Some(id) = m.msg_id() {
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
            order.push((unit.start, e.index, first.seq, &e.msg_id));
            match &e.must {
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
    // P3: a second copy needs a reason.
    for (id, all) in &copies {
        for pair in all.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if !distrust.iter().any(|t| a.at <= *t && *t <= b.at) {
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
    // P4: first copies in commit order.
    order.sort();
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let excused = foreign
            .iter()
            .any(|&f| f < b.2 && f + window >= b.2 && f < a.2);
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
