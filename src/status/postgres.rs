//! What `status` reads from Postgres: the server and its WAL-retention settings, the slot's row and
//! since when no relay holds it, the relay processes connected for the slot, the publication, how
//! many events wait in a slot no one streams (peeked on a temporary copy, so a relay starting
//! meanwhile never finds its slot held by `status`), stop marks whose slot is gone, and each other
//! host of the URL with its copy of the slot. A failure is a problem in the report, never an early
//! return. It reads only and never changes anything; the verdict on what it finds is in `slot.rs`,
//! `checks.rs` and `retention.rs`.
//!
//! Since when no relay holds the slot: Postgres 17 records it (`inactive_since`); before 17 nothing
//! does, so [`watch_unheld`] looks at the slot until a relay takes it or the grace period is over.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;

use super::PostgresSide;
use super::report::{
    OrphanMark, PublicationStatus, RelayState, RelayStatus, ServerStatus, SlotStatus,
    StandbyStatus, State,
};
use super::slot::{needs_look, relay_state, slot_status, waiting_found};
use crate::catalog;
use crate::config::Settings;
use crate::setup;
use crate::slot_scan;
use crate::warning::Warning;

/// Connects to Postgres and reads the server, slot, relay and publication, and the
/// `pg_logical_emit_message` grant warning; a failure is a problem, never an early return.
pub(super) async fn postgres_side(
    settings: &Settings,
    problems: &mut Vec<String>,
    warnings: &mut Vec<Warning>,
) -> PostgresSide {
    let mut side = PostgresSide {
        server: ServerStatus::unread(State::Unreachable),
        slot: slot_status(&settings.config().postgres.slot, State::Unreachable, None),
        relay: RelayStatus {
            state: RelayState::Unknown,
            pids: Vec::new(),
            own_word: None,
        },
        publication: PublicationStatus {
            name: settings.config().postgres.publication.clone(),
            exists: false,
            tables: Vec::new(),
        },
        events_unknown: None,
        orphan_marks: Vec::new(),
    };
    match setup::connect_postgres(settings).await {
        Err(e) => {
            // Refused credentials or TLS are a setting to fix, not a server that is down.
            if let setup::SetupError::Postgres { source, .. } = &e
                && source.is_refusal()
            {
                side.server.state = match source {
                    crate::source::SourceError::Tls(_) => State::TlsFailed,
                    _ => State::AuthFailed,
                };
            }
            problems.push(crate::error_chain::error_chain(&e));
        }
        Ok(pg) => {
            side.server.state = State::Exists;
            if let Err(e) = read_postgres(
                settings,
                &pg,
                &mut side.server,
                &mut side.slot,
                &mut side.relay,
                &mut side.publication,
                &mut side.events_unknown,
            )
            .await
            {
                problems.push(format!("postgres: {e}"));
            }
            match setup::message_warnings(settings, &pg).await {
                Ok(w) => warnings.extend(w),
                Err(e) => problems.push(format!("postgres: {e}")),
            }
            match orphan_marks(&pg).await {
                Ok(marks) => side.orphan_marks = marks,
                Err(e) => problems.push(format!("postgres: {e}")),
            }
        }
    }
    side
}

pub(super) async fn read_postgres(
    settings: &Settings,
    pg: &Client,
    server: &mut ServerStatus,
    slot: &mut SlotStatus,
    relay: &mut RelayStatus,
    publication: &mut PublicationStatus,
    events_unknown: &mut Option<String>,
) -> Result<(), tokio_postgres::Error> {
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
    server.server_version = r.get(0);
    server.in_recovery = r.get(1);
    server.synchronized_standby_slots = r.get(2);
    server.idle_replication_slot_timeout = r.get(3);
    server.host = r.get(4);
    server.version_num = r.get(5);
    let limits = catalog::retention_limits(pg).await?;
    server.max_slot_wal_keep_size = limits.keep_size;
    server.max_slot_wal_keep_bytes = limits.keep_bytes;
    server.idle_timeout_secs = limits.idle_secs;

    let row = catalog::slot(pg, &settings.config().postgres.slot).await?;
    *slot = slot_status(
        &settings.config().postgres.slot,
        if row.is_some() {
            State::Exists
        } else {
            State::Missing
        },
        row.as_ref(),
    );
    relay.pids = relay_pids(pg, &settings.config().postgres.slot).await?;
    relay.state = relay_state(row.as_ref(), &relay.pids);
    if row.as_ref().is_some_and(needs_look) {
        let found = events_waiting(settings, pg).await.map_err(|e| {
            e.as_db_error()
                .map_or_else(|| e.to_string(), |d| d.message().to_owned())
        });
        waiting_found(found, slot, events_unknown);
        if server.version_num.unwrap_or(0) >= 170000 {
            slot.unheld_secs = unheld_since(pg, &settings.config().postgres.slot).await?;
            slot.unheld_measured = slot.unheld_secs.map(|_| "inactive_since");
        }
    }
    publication.exists = pg
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&settings.config().postgres.publication],
        )
        .await?
        .is_some();
    publication.tables = pg
        .query(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1",
            &[&settings.config().postgres.publication],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    Ok(())
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
async fn unheld_since(pg: &Client, slot: &str) -> Result<Option<u64>, tokio_postgres::Error> {
    let row = pg
        .query_opt(
            "SELECT greatest(extract(epoch FROM now() - inactive_since), 0)::int8 \
             FROM pg_replication_slots WHERE slot_name = $1 AND NOT active AND inactive_since IS NOT NULL",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| r.get::<_, i64>(0).max(0) as u64))
}

/// Before PG 17, where Postgres does not record since when a slot is unheld: looks at the slot
/// every half second until a relay takes it (returns `None`) or `grace` is over (returns the time
/// watched). Progress on stderr, so an operator knows why `status` waits.
pub(super) async fn watch_unheld(
    settings: &Settings,
    grace: Duration,
) -> Result<Option<Duration>, setup::SetupError> {
    let pg = setup::connect_postgres(settings).await?;
    let slot = &settings.config().postgres.slot;
    eprintln!(
        "status: no relay holds slot {slot}, and Postgres before 17 does not record since when: watching it for up \
         to {} s (status.grace_secs) for a relay to take it",
        grace.as_secs()
    );
    let start = Instant::now();
    loop {
        let held = pg
            .query_opt(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active",
                &[slot],
            )
            .await?
            .is_some();
        if held {
            return Ok(None);
        }
        if start.elapsed() >= grace {
            return Ok(Some(start.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(500).min(grace)).await;
    }
}

/// The stop marks in this database whose slot is gone: slots named `<slot>_mark` (the slot's
/// name cut to 58 bytes, as `slot_mark::name` makes them) with no slot of that name. A mark keeps
/// WAL like a slot; without its slot nothing ever drops it.
async fn orphan_marks(pg: &Client) -> Result<Vec<OrphanMark>, tokio_postgres::Error> {
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
    let peeked = slot_scan::scan(
        settings,
        pg,
        &copy,
        None,
        None,
        false,
        slot_scan::Bound::DEFAULT,
    )
    .await;
    let _ = pg
        .query("SELECT pg_drop_replication_slot($1)", &[&copy])
        .await;
    peeked
}

/// How many events wait in a slot a walsender holds while its relay says it does not stream (its
/// NATS connection died and its session has not ended yet): the same look as for an idle slot, on a
/// copy, which leaves the walsender's hold alone. `Err`: why it could not look.
pub(super) async fn count_held(settings: &Settings) -> Result<slot_scan::Scan, String> {
    let pg = setup::connect_postgres(settings)
        .await
        .map_err(|e| crate::error_chain::error_chain(&e))?;
    events_waiting(settings, &pg).await.map_err(|e| {
        e.as_db_error()
            .map_or_else(|| e.to_string(), |d| d.message().to_owned())
    })
}

/// Each other host of the URL: reachable, a standby, and holding a synced copy of the slot.
pub(super) async fn read_standbys(
    settings: &Settings,
    reached: Option<&str>,
    slot: &SlotStatus,
    warnings: &mut Vec<Warning>,
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
        if st.in_recovery == Some(true) && slot.failover == Some(true) && st.synced != Some(true) {
            warnings.push(Warning::new(
                "standby-without-slot",
                format!(
                    "standby {target} has no synced copy of slot {}: a failover to it would lose the slot \
                     (set sync_replication_slots = on, hot_standby_feedback = on and a primary_conninfo with dbname \
                     there)",
                    slot.name
                ),
            ));
        }
        out.push(st);
    }
    out
}

pub(super) fn host_is_local(host: &str) -> bool {
    matches!(host, "localhost" | "127.0.0.1" | "::1")
}
