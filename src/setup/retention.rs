//! Setup's advice on Postgres' own limits for the slot: how long an outage may last before the slot
//! costs the disk or the events. With `max_slot_wal_keep_size = -1` (Postgres' default) a stopped
//! relay's slot keeps the WAL of every table of the cluster until the disk is full; with PG 18's
//! `idle_replication_slot_timeout` a slot no relay holds that long is invalidated, and the events
//! written since need `backfill`. Both are warnings with the sizing advice, never refusals: the
//! operator owns the server's settings.

use tokio_postgres::Client;

use crate::catalog;
use crate::config::Settings;
use crate::warning::Warning;

/// The warnings on `max_slot_wal_keep_size` and `idle_replication_slot_timeout`.
pub(super) async fn warnings(
    settings: &Settings,
    pg: &Client,
) -> Result<Vec<Warning>, tokio_postgres::Error> {
    let limits = catalog::retention_limits(pg).await?;
    Ok(advice(settings, &limits))
}

fn advice(settings: &Settings, limits: &catalog::RetentionLimits) -> Vec<Warning> {
    let slot = &settings.config().postgres.slot;
    let mut out = Vec::new();
    if limits.keep_bytes == Some(-1) {
        out.push(Warning::new(
            "wal-keep-unbounded",
            format!(
                "max_slot_wal_keep_size is -1 (unlimited): while the relay is stopped or NATS is down, slot {slot} \
                 keeps the WAL of every table of the cluster until the disk is full and Postgres stops. Size it as \
                 the WAL written per hour at peak (two readings of pg_current_wal_lsn() an hour apart, \
                 pg_wal_lsn_diff) times the longest outage to survive, below the WAL volume's free space, in \
                 postgresql.conf (a reload is enough); docs/operations.md, Sizing max_slot_wal_keep_size"
            ),
        ));
    }
    if let Some(secs) = limits.idle_secs.filter(|s| *s > 0) {
        out.push(Warning::new(
            "idle-slot-timeout",
            format!(
                "idle_replication_slot_timeout is {} ({secs} s): Postgres invalidates slot {slot} once no relay has \
                 held it that long, and the events written since then need {}; set it above the longest relay \
                 outage to survive (a restart, a failover, a maintenance window), or 0",
                limits.idle_timeout.as_deref().unwrap_or("-"),
                settings.command("backfill --replace-slot")
            ),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlimited_retention_and_an_idle_timeout_get_sizing_advice() {
        let settings = crate::config::Config::default().validate().unwrap();
        let none = catalog::RetentionLimits {
            keep_size: Some("10GB".into()),
            keep_bytes: Some(10 << 30),
            idle_timeout: Some("0".into()),
            idle_secs: Some(0),
        };
        assert!(advice(&settings, &none).is_empty());
        let both = catalog::RetentionLimits {
            keep_size: Some("-1".into()),
            keep_bytes: Some(-1),
            idle_timeout: Some("1h".into()),
            idle_secs: Some(3600),
        };
        let w = advice(&settings, &both);
        assert_eq!(
            w.iter().map(|w| w.name).collect::<Vec<_>>(),
            ["wal-keep-unbounded", "idle-slot-timeout"]
        );
        assert!(w[0].text.contains("WAL written per hour at peak"), "{w:?}");
        assert!(
            w[1].text.contains("is 1h (3600 s)") && w[1].text.contains("backfill --replace-slot"),
            "{w:?}"
        );
    }
}
