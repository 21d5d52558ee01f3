//! What `status` reads from Postgres, query by query over the one control connection
//! ([`Servers`](super::Servers) opens it): the server and its WAL-retention settings, the slot's row
//! and since when no relay holds it, the relay processes connected for the slot, the publication,
//! how many events wait in a slot no one streams (peeked on a temporary copy, so a relay starting
//! meanwhile never finds its slot held by `status`), stop marks whose slot is gone, and each other
//! host of the URL with its copy of the slot. It reads only and never changes anything; what the
//! answers mean is judged in `gather.rs` and the rules it calls.

use std::time::{SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;

use super::facts::PublicationRead;
use super::report::{OrphanMark, ServerStatus, StandbyStatus, State};
use crate::catalog;
use crate::config::Settings;
use crate::slot_scan;

/// The server: its version, recovery, host and WAL-retention settings.
pub(super) async fn server(pg: &Client) -> Result<ServerStatus, tokio_postgres::Error> {
    let r = pg
        .query_one(
            "SELECT current_setting('server_version'), pg_is_in_recovery(), \
             current_setting('synchronized_standby_slots', true), \
             current_setting('idle_replication_slot_timeout', true), \
             coalesce(host(inet_server_addr()) || ':' || inet_server_port()::text, 'local socket'), \
             current_setting('server_version_num')::int4",
            &[],
        )
        .await?;
    let limits = catalog::retention_limits(pg).await?;
    Ok(ServerStatus {
        server_version: r.get(0),
        in_recovery: r.get(1),
        synchronized_standby_slots: r.get(2),
        idle_replication_slot_timeout: r.get(3),
        host: r.get(4),
        version_num: r.get(5),
        max_slot_wal_keep_size: limits.keep_size,
        max_slot_wal_keep_bytes: limits.keep_bytes,
        idle_timeout_secs: limits.idle_secs,
        ..ServerStatus::unread(State::Exists)
    })
}

/// The publication: whether it exists, and the tables it publishes.
pub(super) async fn publication(
    pg: &Client,
    name: &str,
) -> Result<PublicationRead, tokio_postgres::Error> {
    let exists = pg
        .query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&name])
        .await?
        .is_some();
    let tables = pg
        .query(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1",
            &[&name],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    Ok(PublicationRead { exists, tables })
}

/// The pids of the relay processes for `slot` connected to this database: every connection a relay
/// opens is named [`catalog::relay_application_name`] (`outbox-relay/SLOT/PID…`). Any session may
/// give itself that name, so only sessions of the relay's own role (the role `status` connects as)
/// and the walsender that holds the slot are believed.
pub(super) async fn relay_pids(pg: &Client, slot: &str) -> Result<Vec<u32>, tokio_postgres::Error> {
    let prefix = format!("{}{slot}/", catalog::RELAY_APPLICATION_PREFIX);
    // application_name is cut at 63 bytes (NAMEDATALEN - 1); a long slot name leaves no pid.
    let cut = prefix.len().min(63);
    let rows = pg
        .query(
            "SELECT DISTINCT application_name FROM pg_stat_activity \
             WHERE datname = current_database() AND left(application_name, $2) = left($1, $2) \
               AND (usename = current_user \
                    OR pid = (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $3))",
            &[&prefix, &(cut as i32), &slot],
        )
        .await?;
    let mut pids: Vec<u32> = rows
        .iter()
        .filter_map(|r| {
            let name: String = r.get(0);
            name.get(prefix.len()..)?.split('/').next()?.parse().ok()
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// PG 17+: seconds since no one holds the slot (`inactive_since`), when it is inactive.
pub(super) async fn unheld_since(
    pg: &Client,
    slot: &str,
) -> Result<Option<u64>, tokio_postgres::Error> {
    let row = pg
        .query_opt(
            "SELECT greatest(extract(epoch FROM now() - inactive_since), 0)::int8 \
             FROM pg_replication_slots WHERE slot_name = $1 AND NOT active AND inactive_since IS NOT NULL",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| r.get::<_, i64>(0).max(0) as u64))
}

/// Whether a walsender holds the slot now.
pub(super) async fn held(pg: &Client, slot: &str) -> Result<bool, tokio_postgres::Error> {
    Ok(pg
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active",
            &[&slot],
        )
        .await?
        .is_some())
}

/// The stop marks in this database whose slot is gone: slots named `<slot>_mark` (the slot's
/// name cut to 58 bytes, as `slot_mark::name` makes them) with no slot of that name. A mark keeps
/// WAL like a slot; without its slot nothing ever drops it.
pub(super) async fn orphan_marks(pg: &Client) -> Result<Vec<OrphanMark>, tokio_postgres::Error> {
    let rows = pg
        .query(
            "WITH pos AS (SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                                      ELSE pg_current_wal_lsn() END AS lsn) \
             SELECT m.slot_name::text, (pos.lsn - m.restart_lsn)::int8 \
             FROM pg_replication_slots m, pos \
             WHERE m.slot_type = 'logical' AND m.plugin = 'pgoutput' AND m.database = current_database() \
               AND m.slot_name LIKE '%\\_mark' AND NOT m.active \
               AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s \
                               WHERE s.slot_name <> m.slot_name AND left(s.slot_name, 58) || '_mark' = m.slot_name) \
             ORDER BY 1",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let name: String = r.get(0);
            OrphanMark {
                slot: name.trim_end_matches("_mark").to_owned(),
                name,
                retained_bytes: r.get(1),
            }
        })
        .collect())
}

/// How many outbox events the inactive slot holds that nobody has published, and the first one:
/// its pending changes are peeked, behind any number of changes that are not events (a retention
/// DELETE, other published tables, messages under other prefixes), within
/// [`slot_scan::Bound::DEFAULT`]; nothing is consumed.
///
/// Peeking acquires the slot it reads for as long as decoding takes, and a relay starting then
/// would find its slot held (and wait as a standby, naming this connection). So the peek reads a
/// temporary copy (`pg_copy_logical_replication_slot`, which reads the slot's positions without
/// acquiring it): the same WAL from the same position, and the copy goes with this connection.
pub(super) async fn events_waiting(
    settings: &Settings,
    pg: &Client,
) -> Result<slot_scan::Scan, tokio_postgres::Error> {
    let copy = format!(
        "outbox_relay_status_{}_{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    );
    pg.query(
        "SELECT pg_copy_logical_replication_slot($1, $2, true)",
        &[&settings.config().postgres.slot, &copy],
    )
    .await?;
    let peeked =
        slot_scan::waiting(settings, &mut slot_scan::SlotPeek::new(settings, pg, &copy)).await;
    let _ = pg
        .query("SELECT pg_drop_replication_slot($1)", &[&copy])
        .await;
    peeked
}

/// Each other host of the URL: reachable, a standby, and holding a synced copy of the slot.
pub(super) async fn read_standbys(
    settings: &Settings,
    reached: Option<&str>,
) -> Vec<StandbyStatus> {
    let mut out = Vec::new();
    if settings.conn.hosts.len() < 2 {
        return out;
    }
    for (host, port) in &settings.conn.hosts {
        let target = format!("{host}:{port}");
        // The host the control connection reached is the primary itself.
        if reached
            .is_some_and(|r| r == target || r.ends_with(&format!(":{port}")) && host_is_local(host))
        {
            continue;
        }
        let mut info = settings.conn.clone();
        info.hosts = vec![(host.clone(), *port)];
        info.target_session_attrs = crate::source::TargetSessionAttrs::Any;
        let mut st = StandbyStatus {
            host: target.clone(),
            state: State::Unreachable,
            in_recovery: None,
            slot_exists: false,
            synced: None,
            confirmed_flush_lsn: None,
        };
        if let Ok(client) = crate::source::connect_control(&info, "outbox-relay status").await {
            st.state = State::Exists;
            st.in_recovery = client
                .query_one("SELECT pg_is_in_recovery()", &[])
                .await
                .ok()
                .map(|r| r.get(0));
            if let Ok(Some(copy)) = catalog::slot(&client, &settings.config().postgres.slot).await {
                st.slot_exists = true;
                st.synced = copy.synced;
                st.confirmed_flush_lsn = copy.confirmed_flush_lsn;
            }
        }
        out.push(st);
    }
    out
}

pub(super) fn host_is_local(host: &str) -> bool {
    matches!(host, "localhost" | "127.0.0.1" | "::1")
}
