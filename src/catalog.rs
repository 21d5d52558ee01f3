//! What the control connection asks Postgres about the slot, in one place for `setup`, `status` and
//! the relay's sampler: one query, every column the server has.
//!
//! The row is read as `to_jsonb(pg_replication_slots)`, so columns that only newer servers have
//! (`failover`, `synced`, `inactive_since`, `invalidation_reason` in 17+) are simply absent on older
//! ones instead of needing a query per version. Lag is measured against the WAL position the server
//! has: the insert position on a primary, the replay position on a standby.

use serde::Deserialize;
use tokio_postgres::Client;

use crate::config::Settings;
use crate::source::{SourceError, connect_control};

/// A slot as `pg_replication_slots` shows it, plus its lag.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct SlotRow {
    /// `physical` or `logical`.
    pub slot_type: String,
    /// The output plugin (`pgoutput`).
    pub plugin: Option<String>,
    /// The database a logical slot decodes.
    pub database: Option<String>,
    /// A walsender streams it now.
    pub active: bool,
    /// That walsender's pid.
    pub active_pid: Option<i32>,
    /// The position its consumer confirmed.
    pub confirmed_flush_lsn: Option<String>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Bytes that can still be written before the slot is in danger of `lost`.
    pub safe_wal_size: Option<i64>,
    /// PG 17+: the slot is synchronised to standbys (`FAILOVER`).
    pub failover: Option<bool>,
    /// PG 17+: this is a standby's copy of a failover slot.
    pub synced: Option<bool>,
    /// PG 17+: since when no one streams the slot.
    pub inactive_since: Option<String>,
    /// PG 17+: why the slot was invalidated (`wal_removed`, `idle_timeout`, …).
    pub invalidation_reason: Option<String>,
    /// Not a column: the database the control connection is in.
    #[serde(skip)]
    pub current_database: String,
    /// Not a column: WAL position − `confirmed_flush_lsn`.
    #[serde(skip)]
    pub lag_bytes: Option<i64>,
    /// Not a column: WAL position − `restart_lsn`, the WAL the slot keeps.
    #[serde(skip)]
    pub retained_bytes: Option<i64>,
    /// Not a column: the server's WAL position the lag is measured against.
    #[serde(skip)]
    pub wal_lsn: Option<String>,
}

impl SlotRow {
    /// Why Postgres can no longer give this slot's changes, if it cannot.
    pub(crate) fn invalidated(&self) -> Option<String> {
        if let Some(r) = &self.invalidation_reason {
            return Some(r.clone());
        }
        (self.wal_status.as_deref() == Some("lost")).then(|| "wal_status = lost".to_owned())
    }
}

/// The slot named `name`, or `None` when it does not exist.
pub(crate) async fn slot(
    client: &Client,
    name: &str,
) -> Result<Option<SlotRow>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "WITH pos AS (SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                                      ELSE pg_current_wal_lsn() END AS lsn) \
             SELECT to_jsonb(s)::text, (pos.lsn - s.confirmed_flush_lsn)::int8, \
                    (pos.lsn - s.restart_lsn)::int8, current_database()::text, pos.lsn::text \
             FROM pg_replication_slots s, pos WHERE s.slot_name = $1",
            &[&name],
        )
        .await?;
    Ok(row.map(|r| {
        let json: String = r.get(0);
        // The view's columns are the server's; a row that does not parse is reported as empty
        // rather than failing the caller (status must still print).
        let mut slot: SlotRow = serde_json::from_str(&json).unwrap_or_default();
        slot.lag_bytes = r.get(1);
        slot.retained_bytes = r.get(2);
        slot.current_database = r.get(3);
        slot.wal_lsn = r.get(4);
        slot
    }))
}

/// The control connection for `settings`, named so `pg_stat_activity` shows who it is.
pub(crate) async fn connect(settings: &Settings, purpose: &str) -> Result<Client, SourceError> {
    connect_control(&settings.conn, &format!("outbox-relay {purpose}")).await
}

/// The `application_name` of a relay process's connections for `slot`: `outbox-relay/SLOT/PID`,
/// then `/monitor` on its sampler's control connection. `status` finds a running relay by it in
/// `pg_stat_activity`, also while that relay does not stream (retrying, waiting for NATS).
pub(crate) fn relay_application_name(slot: &str, pid: u32, role: Option<&str>) -> String {
    match role {
        None => format!("{RELAY_APPLICATION_PREFIX}{slot}/{pid}"),
        Some(r) => format!("{RELAY_APPLICATION_PREFIX}{slot}/{pid}/{r}"),
    }
}

/// What every [`relay_application_name`] starts with.
pub(crate) const RELAY_APPLICATION_PREFIX: &str = "outbox-relay/";

/// The OIDs of every partition of `table` (schema-qualified), at any level; empty for a table
/// that is not partitioned or does not exist. Read from the current catalog: the outbox stage maps
/// these to the outbox table when a publication sends them under their own names.
pub(crate) async fn partitions(
    client: &Client,
    table: &str,
) -> Result<Vec<u32>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT relid::oid FROM pg_partition_tree(to_regclass($1)) WHERE level > 0",
            &[&table],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Postgres' own limits on what a slot may keep, for `setup`'s advice and `status`'s numbers.
#[derive(Debug, Clone, Default)]
pub(crate) struct RetentionLimits {
    /// `max_slot_wal_keep_size` as the server shows it (`-1`, `10GB`).
    pub(crate) keep_size: Option<String>,
    /// The same in bytes; `-1` unlimited.
    pub(crate) keep_bytes: Option<i64>,
    /// PG 18+: `idle_replication_slot_timeout` as shown (`None` on older servers).
    pub(crate) idle_timeout: Option<String>,
    /// The same in seconds; 0 off.
    pub(crate) idle_secs: Option<i64>,
}

/// [`RetentionLimits`] of the server `client` is connected to.
pub(crate) async fn retention_limits(
    client: &Client,
) -> Result<RetentionLimits, tokio_postgres::Error> {
    let r = client
        .query_one(
            "SELECT current_setting('max_slot_wal_keep_size'), \
             (SELECT setting || ' ' || coalesce(unit, '') FROM pg_settings WHERE name = 'max_slot_wal_keep_size'), \
             current_setting('idle_replication_slot_timeout', true), \
             (SELECT setting || ' ' || coalesce(unit, '') FROM pg_settings \
              WHERE name = 'idle_replication_slot_timeout')",
            &[],
        )
        .await?;
    Ok(RetentionLimits {
        keep_size: r.get(0),
        keep_bytes: r
            .get::<_, Option<String>>(1)
            .as_deref()
            .and_then(base_units),
        idle_timeout: r.get(2),
        idle_secs: r
            .get::<_, Option<String>>(3)
            .as_deref()
            .and_then(base_units),
    })
}

/// `setting unit` from `pg_settings` in the unit's base (bytes, seconds); `-1` and `0` as they are.
fn base_units(text: &str) -> Option<i64> {
    let (value, unit) = text.split_once(' ').unwrap_or((text, ""));
    let value: i64 = value.trim().parse().ok()?;
    if value <= 0 {
        return Some(value);
    }
    let factor = match unit.trim() {
        "" | "B" | "s" => 1,
        "kB" => 1 << 10,
        "8kB" => 8 << 10,
        "MB" => 1 << 20,
        "GB" => 1 << 30,
        "ms" => return Some(value / 1000),
        "min" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return None,
    };
    value.checked_mul(factor)
}

#[cfg(test)]
mod tests {
    use super::base_units;

    #[test]
    fn settings_are_read_in_their_base_unit() {
        assert_eq!(base_units("-1 MB"), Some(-1));
        assert_eq!(base_units("1024 MB"), Some(1 << 30));
        assert_eq!(base_units("0 s"), Some(0));
        assert_eq!(base_units("90 min"), Some(5400));
        assert_eq!(base_units("x MB"), None);
        assert_eq!(base_units("5 parsecs"), None);
    }
}
