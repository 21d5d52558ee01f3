//! `status`'s verdict on the slot, free of I/O: the slot's fields from its `pg_replication_slots`
//! row, what a relay for it is doing, whether it is looked into for waiting events and what that
//! look found, and what is said about it (missing, lost or about to be, events waiting or not
//! checkable with no relay streaming it, no relay holding it for longer than the grace period,
//! events a client other than a relay consumed past the stop mark). One pass of the command
//! (`gather.rs`) calls these rules, over the real servers or the deterministic simulation's, so the
//! simulation judges the very texts an operator reads.
//!
//! Events that wait in a slot no relay holds are a problem at once, whatever the grace period: the
//! grace only spares a slot in which nothing waits yet (a restart, a standby's takeover).

use super::facts::FactError;
use super::report::PostgresSide;
use super::report::{RelayState, RelayStatus, SlotStatus, State, StreamStatus};
use crate::catalog::SlotRow;
use crate::config::Settings;
use crate::setup;
use crate::slot_mark;
use crate::slot_scan;
use crate::warning::Warning;

/// The slot's problems: missing, lost or about to be, events waiting (or unknown) with no relay
/// streaming it, no relay holding it for longer than the grace period. `under_backfill`: a backfill's
/// marker stands, and its recovery (not `setup`, which refuses then) is what a missing slot needs.
pub(super) fn slot_problems(
    settings: &Settings,
    pg: &PostgresSide,
    stream: &StreamStatus,
    under_backfill: bool,
    problems: &mut Vec<String>,
    warnings: &mut Vec<Warning>,
) {
    let slot_name = &settings.config().postgres.slot;
    let slot = &pg.slot;
    if slot.state == State::Missing {
        problems.push(if under_backfill {
            format!(
                "slot {slot_name} does not exist: a backfill of it has not finished (see the backfill line); \
                 recover as that line says"
            )
        } else {
            format!(
                "slot {slot_name} does not exist: run {} (or {} if the stream already holds this outbox's events)",
                settings.command("setup"),
                settings.command("backfill")
            )
        });
    }
    if let Some(reason) = slot.invalidation_reason.clone().or_else(|| {
        (slot.wal_status.as_deref() == Some("lost")).then(|| "wal_status = lost".to_owned())
    }) {
        problems.push(setup::lost_slot_message(settings, &reason));
    } else if slot.wal_status.as_deref() == Some("unreserved") {
        problems.push(format!(
            "slot {slot_name} is wal_status unreserved: it retains {} bytes, past max_slot_wal_keep_size, and the next \
             checkpoint removes WAL it still needs; a relay must confirm past {} before then, or the slot is lost \
             and the events written since need {}",
            slot.retained_bytes.unwrap_or(0),
            slot.confirmed_flush_lsn.as_deref().unwrap_or("-"),
            settings.command("backfill --replace-slot"),
        ));
    }
    let since = slot
        .inactive_since
        .as_deref()
        .map(|t| format!(" (inactive since {t})"))
        .unwrap_or_default();
    let retrying = retrying_note(&pg.relay, stream);
    let start = format!("start {}", settings.command("run"));
    if slot.events_waiting == Some(true) {
        let first = slot
            .waiting_event
            .as_deref()
            .map(|e| format!(", the first {e}"))
            .unwrap_or_default();
        let count = waiting_count(slot);
        problems.push(match &retrying {
            Some(r) => format!(
                "slot {slot_name}{since}: {count}{first} and {r}; they are published once it reconnects"
            ),
            None if pg.relay.state == RelayState::NotStreaming => format!(
                "slot {slot_name}: {count}{first}, held by a relay that does not stream (see the relay line); \
                 they are published once it reconnects"
            ),
            None => format!("no relay streams slot {slot_name}{since} while {count}{first}: {start}"),
        });
    }
    if let Some(e) = &pg.events_unknown {
        problems.push(match &retrying {
            Some(r) => format!(
                "slot {slot_name}: {r}; whether events wait in the slot cannot be checked ({e})"
            ),
            None => format!(
                "slot {slot_name}: no relay streams it, and it cannot be checked for waiting events ({e}): {start}"
            ),
        });
    }
    if slot.events_waiting == Some(false) && pg.events_unknown.is_none() {
        unheld_finding(settings, pg, retrying.as_deref(), problems, warnings);
    }
}

/// `N events wait in it` (`1 event waits`), or `at least N events wait in it (…)` when the look
/// stopped at its bound with WAL still pending.
pub(super) fn waiting_count(slot: &SlotStatus) -> String {
    let n = slot.waiting_events.unwrap_or(1);
    let verb = if n == 1 { "event waits" } else { "events wait" };
    match slot.waiting_events_complete {
        Some(false) => format!(
            "at least {n} {verb} in it (the count stops at the look's bound of {} changes)",
            slot_scan::Bound::DEFAULT.changes
        ),
        _ => format!("{n} {verb} in it"),
    }
}

/// No relay holds the slot and nothing waits in it: a problem once that has lasted longer than
/// `status.grace_secs` (events written from now on would wait unseen), a warning within it.
fn unheld_finding(
    settings: &Settings,
    pg: &PostgresSide,
    retrying: Option<&str>,
    problems: &mut Vec<String>,
    warnings: &mut Vec<Warning>,
) {
    let slot_name = &settings.config().postgres.slot;
    let grace = settings.config().status.grace_secs;
    let Some(secs) = pg.slot.unheld_secs else {
        return;
    };
    let what = match retrying {
        Some(r) => r.to_owned(),
        None => format!("start {}", settings.command("run")),
    };
    match pg.slot.unheld_measured {
        Some("watched") => problems.push(format!(
            "no relay took slot {slot_name} in the {secs} s status watched it (status.grace_secs {grace}; Postgres \
             before 17 does not record since when a slot is unheld), and events written now would wait unseen: {what}"
        )),
        _ if secs > grace => problems.push(format!(
            "no relay has held slot {slot_name} for {secs} s (more than status.grace_secs {grace}), and events written \
             now would wait unseen: {what}"
        )),
        _ => warnings.push(Warning::new(
            "unheld-within-grace",
            format!(
                "no relay has held slot {slot_name} for {secs} s, within status.grace_secs {grace} (a restart or a \
                 standby's takeover); nothing waits in it"
            ),
        )),
    }
}

/// Before Postgres 17, with other problems found, `status` does not watch an unheld slot (the
/// verdict is unhealthy already), so how long no relay has held it is unknown: said as a problem
/// all the same, with what to do, so the other problems do not hide a relay that is gone.
pub(super) fn unwatched_problem(
    settings: &Settings,
    relay: &RelayStatus,
    stream: &StreamStatus,
    grace: std::time::Duration,
) -> String {
    let slot_name = &settings.config().postgres.slot;
    let what = retrying_note(relay, stream)
        .unwrap_or_else(|| format!("if none takes it, start {}", settings.command("run")));
    format!(
        "no relay holds slot {slot_name} (Postgres before 17 does not record since when, and status did not \
         watch it for status.grace_secs {} s because of the problems above): {what}",
        grace.as_secs()
    )
}

/// A relay that runs and retries needs its servers, not a start: what to say instead.
pub(super) fn retrying_note(relay: &RelayStatus, stream: &StreamStatus) -> Option<String> {
    (relay.state == RelayState::Retrying).then(|| {
        let pids = relay
            .pids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let why = if stream.state == State::Unreachable {
            "NATS cannot be reached (see the stream line)"
        } else {
            "see its log for why"
        };
        format!("the relay (pid {pids}) runs but does not stream it: it is retrying; {why}")
    })
}

/// What the stop mark's judgement found (`Err`: why the mark could not be read): a problem when
/// events were consumed, a warning when it cannot be told. Returns how many events, when a mark
/// was judged.
pub(super) fn consumed_found(
    slot: &str,
    found: Result<slot_mark::Check, FactError>,
    problems: &mut Vec<String>,
    warnings: &mut Vec<Warning>,
) -> Option<u64> {
    match found {
        Ok(slot_mark::Check::Consumed(c)) => {
            problems.push(c.to_string());
            Some(c.events)
        }
        Ok(slot_mark::Check::Unknown(why)) => {
            warnings.push(Warning::new(
                "stop-mark-unjudged",
                format!(
                    "slot {slot}: whether a client other than a relay consumed it since the last relay session \
                     cannot be told: {why}"
                ),
            ));
            None
        }
        Ok(slot_mark::Check::Clean) => Some(0),
        Ok(slot_mark::Check::NoMark) => None,
        Err(e) => {
            warnings.push(Warning::new(
                "stop-mark-unjudged",
                format!(
                    "slot {slot}: the stop mark {} cannot be read: {e}",
                    slot_mark::name(slot),
                ),
            ));
            None
        }
    }
}

/// What a relay for the slot is doing, from the slot's row and the pids of the relay processes
/// connected to Postgres.
pub(super) fn relay_state(row: Option<&SlotRow>, pids: &[u32]) -> RelayState {
    if row.is_some_and(|r| r.active) {
        RelayState::Streaming
    } else if pids.is_empty() {
        RelayState::NotRunning
    } else {
        RelayState::Retrying
    }
}

/// Whether the slot is looked into for waiting events: no one streams it (a relay that does
/// publishes them) and its changes can still be decoded.
pub(super) fn needs_look(row: &SlotRow) -> bool {
    !row.active && row.invalidated().is_none()
}

/// What the look for waiting events found (`Err`: the server's reason it could not look), into
/// the slot's fields: whether events wait and the first of them, or why that is unknown.
pub(super) fn waiting_found(
    found: Result<slot_scan::Scan, FactError>,
    slot: &mut SlotStatus,
    events_unknown: &mut Option<String>,
) {
    match found {
        Ok(scan) => {
            slot.events_waiting = scan.any();
            slot.waiting_event = scan
                .first
                .as_ref()
                .map(|f| format!("{} (position {})", f.id, f.position));
            slot.waiting_events = Some(scan.events);
            slot.waiting_events_complete = Some(scan.unfinished.is_none());
            if scan.any().is_none() {
                *events_unknown = scan.unfinished;
            }
        }
        Err(e) => *events_unknown = Some(e.0),
    }
}

pub(super) fn slot_status(name: &str, state: State, row: Option<&SlotRow>) -> SlotStatus {
    let r = row.cloned().unwrap_or_default();
    let known = state != State::Unreachable;
    SlotStatus {
        name: name.to_owned(),
        state,
        exists: known.then_some(row.is_some()),
        active: known.then_some(r.active),
        active_pid: r.active_pid,
        confirmed_flush_lsn: r.confirmed_flush_lsn,
        lag_bytes: r.lag_bytes,
        retained_bytes: r.retained_bytes,
        wal_status: r.wal_status,
        safe_wal_size: r.safe_wal_size,
        events_waiting: None,
        waiting_event: None,
        waiting_events: None,
        waiting_events_complete: None,
        unheld_secs: None,
        unheld_measured: None,
        consumed_events: None,
        inactive_since: r.inactive_since,
        invalidation_reason: r.invalidation_reason,
        failover: r.failover,
        synced: r.synced,
    }
}

#[cfg(test)]
mod tests {
    //! The slot's verdict on facts built by hand: each rule's outcome and its exact words, which
    //! operators read (the simulation checks the outcomes over its worlds, not the words).

    use super::super::report::unknown_stream;
    use super::super::report::{PublicationStatus, ServerStatus};
    use super::*;
    use crate::Lsn;
    use crate::config::Config;
    use crate::position::Position;
    use crate::slot_scan::{Found, Scan};

    /// The slot `s` as Postgres shows it from `row`, with no relay connected, a reachable
    /// Postgres and publication, and what the look found folded in.
    fn side(
        row: Option<SlotRow>,
        pids: Vec<u32>,
        found: Option<Result<Scan, FactError>>,
    ) -> PostgresSide {
        let state = if row.is_some() {
            State::Exists
        } else {
            State::Missing
        };
        let mut slot = slot_status("s", state, row.as_ref());
        let mut events_unknown = None;
        if let Some(found) = found {
            waiting_found(found, &mut slot, &mut events_unknown);
        }
        PostgresSide {
            server: ServerStatus::unread(State::Exists),
            relay: RelayStatus {
                state: relay_state(row.as_ref(), &pids),
                pids,
                own_word: None,
            },
            slot,
            publication: PublicationStatus {
                name: "p".into(),
                exists: true,
                tables: Vec::new(),
            },
            events_unknown,
            orphan_marks: Vec::new(),
        }
    }

    fn stream(state: State) -> StreamStatus {
        let mut st = unknown_stream("st");
        st.state = state;
        st
    }

    fn settings() -> Settings {
        let mut c = Config::default();
        c.postgres.slot = "s".into();
        c.validate().unwrap()
    }

    fn verdict(pg: &PostgresSide, stream: &StreamStatus) -> (Vec<String>, Vec<Warning>) {
        let (mut problems, mut warnings) = (Vec::new(), Vec::new());
        slot_problems(&settings(), pg, stream, false, &mut problems, &mut warnings);
        (problems, warnings)
    }

    fn problems(pg: &PostgresSide, stream: &StreamStatus) -> Vec<String> {
        verdict(pg, stream).0
    }

    fn one_event() -> Scan {
        Scan {
            events: 1,
            first: Some(Found {
                position: Position::in_transaction(Lsn(0x10), 0),
                id: "e1".into(),
            }),
            last: Some(Found {
                position: Position::in_transaction(Lsn(0x10), 0),
                id: "e1".into(),
            }),
            ..Scan::default()
        }
    }

    #[test]
    fn a_missing_slot_names_setup_and_backfill_unless_a_backfill_stands() {
        assert_eq!(
            problems(&side(None, Vec::new(), None), &stream(State::Exists)),
            [
                "slot s does not exist: run `outbox-relay setup` (or `outbox-relay backfill` if the \
              stream already holds this outbox's events)"
            ]
        );
        let (mut problems, mut warnings) = (Vec::new(), Vec::new());
        let pg = side(None, Vec::new(), None);
        slot_problems(
            &settings(),
            &pg,
            &stream(State::Exists),
            true,
            &mut problems,
            &mut warnings,
        );
        assert!(
            !problems[0].contains("setup"),
            "setup refuses under a backfill: {problems:?}"
        );
    }

    #[test]
    fn a_lost_slot_is_reported_and_not_looked_into() {
        let row = SlotRow {
            wal_status: Some("lost".into()),
            ..SlotRow::default()
        };
        assert!(!needs_look(&row));
        assert_eq!(
            problems(&side(Some(row), Vec::new(), None), &stream(State::Exists)),
            [setup::lost_slot_message(&settings(), "wal_status = lost")]
        );
    }

    #[test]
    fn an_unreserved_slot_is_a_problem_naming_backfill() {
        let row = SlotRow {
            active: true,
            wal_status: Some("unreserved".into()),
            retained_bytes: Some(5 << 20),
            confirmed_flush_lsn: Some("0/5000000".into()),
            ..SlotRow::default()
        };
        let p = problems(&side(Some(row), Vec::new(), None), &stream(State::Exists));
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].starts_with("slot s is wal_status unreserved: it retains 5242880 bytes")
                && p[0].ends_with("need `outbox-relay backfill --replace-slot`"),
            "{p:?}"
        );
    }

    #[test]
    fn a_streamed_slot_is_not_looked_into_and_has_no_problem() {
        let row = SlotRow {
            active: true,
            ..SlotRow::default()
        };
        assert!(!needs_look(&row));
        assert_eq!(relay_state(Some(&row), &[]), RelayState::Streaming);
        assert!(problems(&side(Some(row), Vec::new(), None), &stream(State::Exists)).is_empty());
    }

    #[test]
    fn an_idle_slot_with_nothing_waiting_is_judged_by_how_long_it_has_been_unheld() {
        let row = SlotRow::default();
        assert!(needs_look(&row));
        let mut pg = side(Some(row), Vec::new(), Some(Ok(Scan::default())));
        assert_eq!(pg.relay.state, RelayState::NotRunning);
        assert_eq!(pg.slot.events_waiting, Some(false));
        // Unknown for how long (an older server that status did not watch): nothing to say.
        assert_eq!(verdict(&pg, &stream(State::Exists)), (vec![], vec![]));
        pg.slot.unheld_secs = Some(12);
        pg.slot.unheld_measured = Some("inactive_since");
        let (p, w) = verdict(&pg, &stream(State::Exists));
        assert!(p.is_empty(), "{p:?}");
        assert_eq!(w[0].name, "unheld-within-grace");
        pg.slot.unheld_secs = Some(31);
        assert_eq!(
            problems(&pg, &stream(State::Exists)),
            [
                "no relay has held slot s for 31 s (more than status.grace_secs 30), and events written now \
                 would wait unseen: start `outbox-relay run`"
            ]
        );
        pg.slot.unheld_secs = Some(30);
        pg.slot.unheld_measured = Some("watched");
        assert!(
            problems(&pg, &stream(State::Exists))[0]
                .starts_with("no relay took slot s in the 30 s status watched it"),
        );
    }

    #[test]
    fn events_waiting_with_no_relay_are_counted_named_and_a_problem_at_once() {
        let mut pg = side(Some(SlotRow::default()), Vec::new(), Some(Ok(one_event())));
        assert_eq!(pg.slot.events_waiting, Some(true));
        assert_eq!(
            pg.slot.waiting_event.as_deref(),
            Some("e1 (position 0/10:0)")
        );
        assert_eq!(
            problems(&pg, &stream(State::Exists)),
            [
                "no relay streams slot s while 1 event waits in it, the first e1 (position 0/10:0): \
              start `outbox-relay run`"
            ]
        );
        // Within the grace period too: waiting work is never spared.
        pg.slot.unheld_secs = Some(1);
        pg.slot.unheld_measured = Some("inactive_since");
        assert_eq!(problems(&pg, &stream(State::Exists)).len(), 1);
        let bounded = Scan {
            events: 6000,
            unfinished: Some("bound".into()),
            ..one_event()
        };
        let pg = side(Some(SlotRow::default()), Vec::new(), Some(Ok(bounded)));
        assert!(
            problems(&pg, &stream(State::Exists))[0].contains(
                "while at least 6000 events wait in it (the count stops at the look's bound of 20000 \
                 changes), the first e1"
            ),
            "{:?}",
            problems(&pg, &stream(State::Exists))
        );
    }

    #[test]
    fn events_waiting_while_a_relay_retries_name_the_relay_not_a_start() {
        let pg = side(Some(SlotRow::default()), vec![7, 9], Some(Ok(one_event())));
        assert_eq!(pg.relay.state, RelayState::Retrying);
        assert_eq!(
            problems(&pg, &stream(State::Unreachable)),
            [
                "slot s: 1 event waits in it, the first e1 (position 0/10:0) and the relay (pid 7, 9) \
              runs but does not stream it: it is retrying; NATS cannot be reached (see the stream \
              line); they are published once it reconnects"
            ]
        );
        assert_eq!(
            problems(&pg, &stream(State::Exists)),
            [
                "slot s: 1 event waits in it, the first e1 (position 0/10:0) and the relay (pid 7, 9) \
              runs but does not stream it: it is retrying; see its log for why; they are published \
              once it reconnects"
            ]
        );
    }

    #[test]
    fn a_look_ended_by_its_bound_is_unknown_not_nothing_waits() {
        let bounded = Scan {
            unfinished: Some("the bound".into()),
            ..Scan::default()
        };
        let pg = side(Some(SlotRow::default()), Vec::new(), Some(Ok(bounded)));
        assert_eq!(pg.slot.events_waiting, None);
        assert_eq!(
            problems(&pg, &stream(State::Exists)),
            [
                "slot s: no relay streams it, and it cannot be checked for waiting events (the bound): \
              start `outbox-relay run`"
            ]
        );
        let refused = side(
            Some(SlotRow::default()),
            vec![3],
            Some(Err(FactError("denied".into()))),
        );
        assert_eq!(
            problems(&refused, &stream(State::Exists)),
            [
                "slot s: the relay (pid 3) runs but does not stream it: it is retrying; see its log \
              for why; whether events wait in the slot cannot be checked (denied)"
            ]
        );
    }

    #[test]
    fn the_stop_marks_judgement_counts_events_or_warns() {
        let judge = |found| {
            let (mut problems, mut warnings) = (Vec::new(), Vec::new());
            let n = consumed_found("s", found, &mut problems, &mut warnings);
            (n, problems, warnings)
        };
        assert_eq!(
            judge(Ok(slot_mark::Check::Clean)),
            (Some(0), vec![], vec![])
        );
        assert_eq!(judge(Ok(slot_mark::Check::NoMark)), (None, vec![], vec![]));
        assert_eq!(
            judge(Ok(slot_mark::Check::Unknown("why".into()))),
            (
                None,
                vec![],
                vec![Warning::new(
                    "stop-mark-unjudged",
                    "slot s: whether a client other than a relay consumed it since the last relay \
                     session cannot be told: why"
                )]
            )
        );
        assert_eq!(
            judge(Err(FactError("gone".into()))),
            (
                None,
                vec![],
                vec![Warning::new(
                    "stop-mark-unjudged",
                    "slot s: the stop mark s_mark cannot be read: gone"
                )]
            )
        );
    }
}
