//! `status`'s verdict on the slot over the deterministic simulation's servers (tests/simulation):
//! the slot's facts are built from what the simulated Postgres and JetStream hold and judged by the
//! rules the command uses (`slot.rs`), with the relay's own look at the changes, so every simulated
//! world checks that what `status` tells an operator about the slot is true. Compiled only with the
//! `test-support` feature.

use super::PostgresSide;
use super::report::{PublicationStatus, RelayStatus, ServerStatus, State};
use super::slot::{
    consumed_found, needs_look, relay_state, slot_problems, slot_status, waiting_found,
};
use super::stream::{stored_by_tail, unknown_stream};
use crate::catalog::SlotRow;
use crate::config::Settings;
use crate::slot_mark;
use crate::slot_scan;

/// The slot as the deterministic simulation's Postgres holds it (tests/simulation): what
/// `pg_replication_slots` and `pg_stat_activity` would show, and what a peek of a copy of it hands
/// over, one list of (LSN, pgoutput message) per transaction.
pub struct SimSlot {
    /// The walsender that holds the slot, if one does.
    pub active_pid: Option<i32>,
    /// `confirmed_flush_lsn`.
    pub confirmed: crate::Lsn,
    /// Its changes from `confirmed` on (at least as far as the look's bound reaches).
    pub changes: Vec<Vec<(crate::Lsn, bytes::Bytes)>>,
    /// The stop mark, with its changes up to `confirmed`.
    pub mark: Option<crate::slot_mark::SimMark>,
    /// The relay processes connected to Postgres (their connections' `outbox-relay/SLOT/PID`).
    pub relay_pids: Vec<u32>,
}

/// `status`'s verdict on the slot over the simulation's servers.
#[derive(Debug)]
pub struct SimSlotVerdict {
    /// The slot's problems, worded and ordered as `status` prints them.
    pub problems: Vec<String>,
    /// Its warnings (a stop mark that cannot be judged or read).
    pub warnings: Vec<crate::warning::Warning>,
    /// `slot.events_waiting`.
    pub events_waiting: Option<bool>,
    /// The id of the first waiting event (`slot.waiting_event` names it with its position).
    pub waiting_id: Option<String>,
}

/// The part of [`status`](super::status) that judges the slot, over the simulation's servers: the
/// same rules ([`needs_look`], [`waiting_found`], [`slot_problems`], [`consumed_found`]) and the
/// same judgement of the changes ([`slot_scan::scan_changes`], the relay's decoder and outbox
/// stage, within [`slot_scan::Bound::DEFAULT`]); only the servers' answers come from the
/// simulators. `nats` is `None` while NATS cannot be reached.
pub async fn sim_slot_status(
    settings: &Settings,
    nats: Option<&crate::nats::NatsPort>,
    sim: SimSlot,
) -> SimSlotVerdict {
    let name = &settings.config().postgres.slot;
    let row = SlotRow {
        active: sim.active_pid.is_some(),
        active_pid: sim.active_pid,
        confirmed_flush_lsn: Some(sim.confirmed.to_string()),
        ..SlotRow::default()
    };
    let mut slot = slot_status(name, State::Exists, Some(&row));
    let mut events_unknown = None;
    let mut waiting_id = None;
    if needs_look(&row) {
        // Counted, as `status` counts them (`postgres::events_waiting`).
        let scan = slot_scan::scan_changes(
            settings,
            &sim.changes,
            None,
            None,
            false,
            slot_scan::Bound::DEFAULT,
        );
        waiting_id = scan.first.as_ref().map(|f| f.id.clone());
        waiting_found(Ok(scan), &mut slot, &mut events_unknown);
    }
    let pg = PostgresSide {
        server: ServerStatus::unread(State::Exists),
        relay: RelayStatus {
            state: relay_state(Some(&row), &sim.relay_pids),
            pids: sim.relay_pids,
            own_word: None,
        },
        slot,
        publication: PublicationStatus {
            name: settings.config().postgres.publication.clone(),
            exists: true,
            tables: Vec::new(),
        },
        events_unknown,
        orphan_marks: Vec::new(),
    };
    let mut stream = unknown_stream(&settings.config().nats.stream);
    if nats.is_some() {
        stream.state = State::Exists;
        stream.exists = Some(true);
    }
    let (mut problems, mut warnings) = (Vec::new(), Vec::new());
    // The simulated Postgres keeps no clock of since when the slot is unheld (`unheld_secs` stays
    // unknown), so the grace period's rule says nothing here: the oracle checks the one that never
    // waits, events waiting in a slot no relay holds.
    slot_problems(settings, &pg, &stream, false, &mut problems, &mut warnings);
    if let Some(nats) = nats {
        let stored = stored_by_tail(nats, name, &stream.name).await;
        let (mark_at, changes) = match sim.mark {
            Some(m) => (Some(m.at), m.changes),
            None => (None, Vec::new()),
        };
        let found = slot_mark::judge_from(
            settings,
            mark_at,
            sim.confirmed,
            &stored,
            |after| async move {
                Ok::<_, String>(slot_scan::scan_changes(
                    settings,
                    &changes,
                    Some(sim.confirmed),
                    after,
                    false,
                    slot_scan::Bound::DEFAULT,
                ))
            },
        )
        .await;
        consumed_found(name, found, &mut problems, &mut warnings);
    }
    SimSlotVerdict {
        problems,
        warnings,
        events_waiting: pg.slot.events_waiting,
        waiting_id,
    }
}
