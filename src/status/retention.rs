//! `status`'s verdict on WAL retention, free of I/O: what bounds how long a relay may be away before
//! its slot costs the disk or the events. Postgres' own limits, with the numbers that say how close
//! they are: an unlimited `max_slot_wal_keep_size` (a stopped relay's slot keeps the WAL of every
//! table of the cluster until the disk is full), the slot's retained WAL against a limit, PG 18's
//! `idle_replication_slot_timeout` (a slot unheld that long is invalidated) against how long it has
//! been unheld. And stop marks whose slot is gone, which keep WAL like a slot and which nothing
//! drops: a problem, with the SQL that drops each. (A slot that is `unreserved` or already lost is
//! the slot's own verdict, in `slot.rs`.)

use super::report::PostgresSide;
use super::report::{OrphanMark, State};
use crate::config::Settings;
use crate::warning::Warning;

/// From this share of `max_slot_wal_keep_size` on, retained WAL is worth a warning.
const NEAR_LIMIT: f64 = 0.5;

/// The warnings on Postgres' retention limits for the slot.
pub(super) fn retention_warnings(
    settings: &Settings,
    pg: &PostgresSide,
    warnings: &mut Vec<Warning>,
) {
    if pg.slot.state != State::Exists || pg.slot.invalidation_reason.is_some() {
        return;
    }
    let slot = &settings.config().postgres.slot;
    let retained = pg.slot.retained_bytes.unwrap_or(0);
    match pg.server.max_slot_wal_keep_bytes {
        Some(-1) => warnings.push(Warning::new(
            "wal-keep-unbounded",
            format!(
                "max_slot_wal_keep_size is -1 (unlimited): while no relay confirms (stopped, or NATS down), slot \
                 {slot} keeps the WAL of every table of the cluster until the disk is full and Postgres stops; it \
                 retains {retained} bytes now. Set max_slot_wal_keep_size (postgresql.conf; a reload is enough) to \
                 the WAL written per hour at peak times the longest outage to survive, below the WAL volume's free \
                 space (docs/operations.md, Sizing max_slot_wal_keep_size)"
            ),
        )),
        Some(limit) if limit > 0 && retained as f64 >= NEAR_LIMIT * limit as f64 => {
            warnings.push(Warning::new(
                "wal-keep-near-limit",
                format!(
                    "slot {slot} retains {retained} bytes, {:.0} % of max_slot_wal_keep_size {} ({limit} bytes){}: \
                     past it Postgres may invalidate the slot, and events written since need {}; let the relay \
                     catch up, or raise the limit",
                    100.0 * retained as f64 / limit as f64,
                    pg.server.max_slot_wal_keep_size.as_deref().unwrap_or("-"),
                    pg.slot
                        .safe_wal_size
                        .map(|s| format!("; {s} bytes more can be written before then"))
                        .unwrap_or_default(),
                    settings.command("backfill --replace-slot")
                ),
            ));
        }
        _ => {}
    }
    if let Some(timeout) = pg.server.idle_timeout_secs.filter(|t| *t > 0) {
        let unheld = match (pg.slot.active, pg.slot.unheld_secs) {
            (Some(true), _) => "a relay holds it now".to_owned(),
            (_, Some(secs)) => format!(
                "no relay has held it for {secs} s, {} s left",
                (timeout - secs as i64).max(0)
            ),
            _ => "no relay holds it now".to_owned(),
        };
        warnings.push(Warning::new(
            "idle-slot-timeout",
            format!(
                "idle_replication_slot_timeout is {timeout} s: Postgres invalidates slot {slot} at the first \
                 checkpoint after no relay has held it that long, and the events written since need {} ({unheld}); \
                 set it above the longest relay outage to survive, or 0",
                settings.command("backfill --replace-slot")
            ),
        ));
    }
}

/// Each stop mark whose slot is gone, as a problem with the SQL that drops it.
pub(super) fn orphan_mark_problems(marks: &[OrphanMark], problems: &mut Vec<String>) {
    for m in marks {
        problems.push(format!(
            "stop mark {} keeps {} bytes of WAL, but its slot {} is gone (dropped, or postgres.slot renamed), and \
             nothing will ever drop it: unless that slot comes back through a backfill (which drops its mark), drop \
             it: SELECT pg_drop_replication_slot('{}')",
            m.name,
            m.retained_bytes.unwrap_or(0),
            m.slot,
            m.name
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::super::report::{PublicationStatus, RelayState, RelayStatus, ServerStatus};
    use super::super::slot::slot_status;
    use super::*;
    use crate::catalog::SlotRow;
    use crate::config::Config;

    fn side(keep: Option<i64>, idle: Option<i64>, row: SlotRow) -> PostgresSide {
        let mut server = ServerStatus::unread(State::Exists);
        server.max_slot_wal_keep_bytes = keep;
        server.max_slot_wal_keep_size =
            keep.map(|k| if k < 0 { "-1".into() } else { "1GB".into() });
        server.idle_timeout_secs = idle;
        PostgresSide {
            server,
            slot: slot_status("s", State::Exists, Some(&row)),
            relay: RelayStatus {
                state: RelayState::NotRunning,
                pids: Vec::new(),
                own_word: None,
            },
            publication: PublicationStatus {
                name: "p".into(),
                exists: true,
                tables: Vec::new(),
            },
            events_unknown: None,
            orphan_marks: Vec::new(),
        }
    }

    fn warned(pg: &PostgresSide) -> Vec<Warning> {
        let mut c = Config::default();
        c.postgres.slot = "s".into();
        let mut out = Vec::new();
        retention_warnings(&c.validate().unwrap(), pg, &mut out);
        out
    }

    #[test]
    fn unlimited_retention_is_a_warning_with_the_wal_kept_now() {
        let row = SlotRow {
            retained_bytes: Some(95 << 20),
            ..SlotRow::default()
        };
        let w = warned(&side(Some(-1), None, row.clone()));
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].name, "wal-keep-unbounded");
        assert!(w[0].text.contains("retains 99614720 bytes now"), "{w:?}");
        assert!(
            warned(&side(Some(1 << 30), None, row)).is_empty(),
            "far below a limit"
        );
    }

    #[test]
    fn retained_wal_near_the_limit_and_an_idle_timeout_are_counted() {
        let row = SlotRow {
            retained_bytes: Some(600 << 20),
            safe_wal_size: Some(424 << 20),
            ..SlotRow::default()
        };
        let mut pg = side(Some(1 << 30), Some(3600), row);
        pg.slot.unheld_secs = Some(600);
        let w = warned(&pg);
        assert_eq!(
            w.iter().map(|w| w.name).collect::<Vec<_>>(),
            ["wal-keep-near-limit", "idle-slot-timeout"]
        );
        assert!(
            w[0].text.contains("retains 629145600 bytes, 59 % of"),
            "{w:?}"
        );
        assert!(
            w[1].text
                .contains("no relay has held it for 600 s, 3000 s left"),
            "{w:?}"
        );
    }

    #[test]
    fn an_orphan_mark_names_the_sql_that_drops_it() {
        let mut p = Vec::new();
        orphan_mark_problems(
            &[OrphanMark {
                name: "old_mark".into(),
                slot: "old".into(),
                retained_bytes: Some(7),
            }],
            &mut p,
        );
        assert!(
            p[0].ends_with("SELECT pg_drop_replication_slot('old_mark')"),
            "{p:?}"
        );
        assert!(
            p[0].contains("keeps 7 bytes of WAL, but its slot old is gone"),
            "{p:?}"
        );
    }
}
