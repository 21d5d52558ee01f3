//! `outbox-relay setup` (and the first step of `run`): check everything, then create what is missing.
//!
//! Checks come first, all of them, so that a bad setting changes nothing (P8): `wal_level`, the outbox
//! table and its columns, the role's REPLICATION privilege, the publication (exists, publishes inserts,
//! contains the table), the slot (logical, pgoutput, this database, not invalidated), the JetStream
//! stream (covers the subject template and the dead-letter subject). Then, idempotently: the
//! publication (`publish = 'insert'`), the slot, the stream. Each step prints one line saying what it
//! found or did. Every failure is one line naming the object and how to fix it.

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use tokio_postgres::Client;

use crate::config::Config;
use crate::route::SubjectTemplate;
use crate::source::{SourceError, connect_control};

/// A check that failed, or a server that cannot be reached. One line.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SetupError(pub String);

/// What setup found and did, one line per object.
#[derive(Debug, Default, Clone)]
pub struct SetupReport {
    pub lines: Vec<String>,
    /// Warnings worth a log line (e.g. a memory stream).
    pub warnings: Vec<String>,
    /// The slot's confirmed position: where streaming starts.
    pub slot_confirmed: Option<crate::Lsn>,
}

const PAYLOAD_TYPES: &[&str] = &["jsonb", "json", "text", "bytea", "varchar"];
const ID_TYPES: &[&str] = &["uuid", "text", "varchar", "int8", "int4", "bpchar"];
const TEXT_TYPES: &[&str] = &["text", "varchar", "bpchar"];
const AGGREGATE_ID_TYPES: &[&str] = &["text", "varchar", "bpchar", "uuid", "int8", "int4"];
const HEADER_TYPES: &[&str] = &["jsonb", "json"];

/// Connects to NATS with the relay's settings. Fails with a line naming `nats.url`.
pub async fn connect_nats(config: &Config) -> Result<async_nats::Client, SetupError> {
    let n = &config.nats;
    let shown = crate::config::redact_url(&n.url);
    let mut opts = async_nats::ConnectOptions::new()
        .name("outbox-relay")
        .connection_timeout(Duration::from_secs(5))
        // Buffered publishes are what async-nats loses on a reconnect; the relay republishes them.
        .retry_on_initial_connect();
    if !n.creds_file.is_empty() {
        opts = opts
            .credentials_file(&n.creds_file)
            .await
            .map_err(|e| SetupError(format!("nats.creds_file {:?}: {e}", n.creds_file)))?;
    }
    let client = opts.connect(n.url.as_str()).await.map_err(|e| {
        SetupError(format!(
            "cannot connect to NATS at {shown}: {e}: check nats.url"
        ))
    })?;
    // retry_on_initial_connect returns at once; wait a bounded time for the first connection so an
    // unreachable server is a clear error, not a silent hang.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while client.connection_state() != async_nats::connection::State::Connected {
        if tokio::time::Instant::now() > deadline {
            return Err(SetupError(format!(
                "cannot connect to NATS at {shown} within 5s: check nats.url and that nats-server runs with -js"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(client)
}

/// Connects the control connection. Fails with a line naming `postgres.url`.
pub async fn connect_postgres(config: &Config) -> Result<Client, SetupError> {
    let info = config.conn_info();
    connect_control(&info, "outbox-relay setup")
        .await
        .map_err(|e| {
            SetupError(format!(
                "cannot connect to Postgres at {info}: {e}: check postgres.url"
            ))
        })
}

/// What needs creating after the checks passed.
struct Plan {
    create_publication: bool,
    create_slot: bool,
    create_stream: bool,
}

/// Checks everything, then creates what is missing. Idempotent.
pub async fn setup(config: &Config) -> Result<SetupReport, SetupError> {
    let pg = connect_postgres(config).await?;
    let nats = connect_nats(config).await?;
    let js = jetstream::new(nats);
    let mut report = SetupReport::default();
    let plan = check(config, &pg, &js, &mut report).await?;
    apply(config, &pg, &js, plan, &mut report).await?;
    Ok(report)
}

async fn check(
    config: &Config,
    pg: &Client,
    js: &jetstream::Context,
    report: &mut SetupReport,
) -> Result<Plan, SetupError> {
    let q = |e: tokio_postgres::Error| SetupError(format!("postgres: {}", pg_error(&e)));
    let wal_level: String = pg.query_one("SHOW wal_level", &[]).await.map_err(q)?.get(0);
    if wal_level != "logical" {
        return Err(SetupError(format!(
            "Postgres wal_level is {wal_level:?}, logical decoding needs \"logical\": set wal_level = logical \
             in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart Postgres"
        )));
    }

    let (schema, table) = config.outbox.table_parts();
    let oid: Option<u32> = pg
        .query_opt(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
            &[&schema, &table],
        )
        .await
        .map_err(q)?
        .map(|r| r.get(0));
    let Some(oid) = oid else {
        return Err(SetupError(format!(
            "outbox.table {} does not exist (or this role cannot see it): create it with sql/01_outbox_table.sql \
             or set outbox.table",
            config.outbox.table
        )));
    };
    let columns: Vec<(String, String)> = pg
        .query(
            "SELECT a.attname::text, t.typname::text FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
             WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped",
            &[&oid],
        )
        .await
        .map_err(q)?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let o = &config.outbox;
    let mut wanted = vec![
        ("outbox.id_column", &o.id_column, ID_TYPES),
        (
            "outbox.aggregate_type_column",
            &o.aggregate_type_column,
            TEXT_TYPES,
        ),
        (
            "outbox.aggregate_id_column",
            &o.aggregate_id_column,
            AGGREGATE_ID_TYPES,
        ),
        ("outbox.event_type_column", &o.event_type_column, TEXT_TYPES),
        ("outbox.payload_column", &o.payload_column, PAYLOAD_TYPES),
    ];
    if !o.headers_column.is_empty() {
        wanted.push(("outbox.headers_column", &o.headers_column, HEADER_TYPES));
    }
    for (key, name, types) in wanted {
        match columns.iter().find(|(n, _)| n == name) {
            None => {
                return Err(SetupError(format!(
                    "{key}: table {} has no column {name:?}: add it or set {key}",
                    o.table
                )));
            }
            Some((_, ty)) if !types.contains(&ty.as_str()) => {
                return Err(SetupError(format!(
                    "{key}: column {name:?} of {} has type {ty}, expected one of {}",
                    o.table,
                    types.join(", ")
                )));
            }
            Some(_) => {}
        }
    }
    report
        .lines
        .push(format!("table {}: ok ({} columns)", o.table, columns.len()));

    let row = pg
        .query_one(
            "SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(q)?;
    if !row.get::<_, bool>(0) {
        let user = config.conn_info().user;
        return Err(SetupError(format!(
            "Postgres role {user:?} lacks the REPLICATION attribute: ALTER ROLE {user} REPLICATION (see sql/03_relay_role.sql)"
        )));
    }

    let publication = &config.postgres.publication;
    let pubinsert: Option<bool> = pg
        .query_opt(
            "SELECT pubinsert FROM pg_publication WHERE pubname = $1",
            &[publication],
        )
        .await
        .map_err(q)?
        .map(|r| r.get(0));
    let create_publication = match pubinsert {
        None => true,
        Some(false) => {
            return Err(SetupError(format!(
                "publication {publication} does not publish inserts: ALTER PUBLICATION {publication} SET (publish = 'insert')"
            )));
        }
        Some(true) => {
            let member = pg
                .query_opt(
                    "SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                    &[publication, &schema, &table],
                )
                .await
                .map_err(q)?;
            if member.is_none() {
                return Err(SetupError(format!(
                    "publication {publication} does not contain {}: ALTER PUBLICATION {publication} ADD TABLE {}",
                    o.table, o.table
                )));
            }
            report
                .lines
                .push(format!("publication {publication}: exists"));
            false
        }
    };

    let slot = &config.postgres.slot;
    let slot_row = pg
        .query_opt(
            "SELECT slot_type, coalesce(plugin, ''), coalesce(database::text, ''), coalesce(wal_status, ''), \
             current_database()::text, coalesce(confirmed_flush_lsn::text, '') \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[slot],
        )
        .await
        .map_err(q)?;
    let create_slot = match slot_row {
        None if config.postgres.create_slot => true,
        None => {
            return Err(SetupError(format!(
                "replication slot {slot} does not exist and postgres.create_slot is false: create it with \
                 SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput') or set postgres.create_slot = true"
            )));
        }
        Some(r) => {
            let (kind, plugin, db, wal_status, current_db, confirmed): (
                String,
                String,
                String,
                String,
                String,
                String,
            ) = (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5));
            if kind != "logical" || plugin != "pgoutput" {
                return Err(SetupError(format!(
                    "replication slot {slot} is a {kind} slot with plugin {plugin:?}, not a logical pgoutput slot: \
                     use another postgres.slot or drop it"
                )));
            }
            if db != current_db {
                return Err(SetupError(format!(
                    "replication slot {slot} belongs to database {db:?}, but postgres.url connects to {current_db:?}: \
                     use another postgres.slot or fix the database in postgres.url"
                )));
            }
            if wal_status == "lost" {
                return Err(SetupError(lost_slot_message(slot)));
            }
            report.slot_confirmed = confirmed.parse().ok();
            report.lines.push(format!(
                "slot {slot}: exists (confirmed {confirmed}, wal_status {wal_status})"
            ));
            false
        }
    };

    let template = SubjectTemplate::parse(&config.nats.subject)
        .map_err(|e| SetupError(format!("nats.subject: {e}")))?;
    let wildcard = template.wildcard();
    let stream_name = &config.nats.stream;
    let create_stream = match js.get_stream(stream_name).await {
        Ok(mut s) => {
            let info = s
                .info()
                .await
                .map_err(|e| SetupError(format!("JetStream stream {stream_name}: {e}")))?;
            let subjects = &info.config.subjects;
            for needed in [&wildcard, &config.nats.dead_letter_subject] {
                if !subjects.iter().any(|f| subject_covers(f, needed)) {
                    return Err(SetupError(format!(
                        "JetStream stream {stream_name} does not cover subject {needed} (its subjects: {}): \
                         add it with `nats stream edit {stream_name} --subjects ...` or use another nats.stream",
                        subjects.join(", ")
                    )));
                }
            }
            if info.config.storage == stream::StorageType::Memory {
                report.warnings.push(format!(
                    "stream {stream_name} uses memory storage: acknowledged events are lost when nats-server restarts"
                ));
            }
            report.lines.push(format!(
                "stream {stream_name}: exists ({} messages, subjects {})",
                info.state.messages,
                subjects.join(", ")
            ));
            false
        }
        Err(e) => match e.kind() {
            // 10059: stream not found.
            jetstream::context::GetStreamErrorKind::JetStream(je) if je.error_code().0 == 10059 => {
                true
            }
            jetstream::context::GetStreamErrorKind::JetStream(_) => {
                return Err(SetupError(format!("JetStream stream {stream_name}: {e}")));
            }
            _ => {
                return Err(SetupError(format!(
                    "JetStream is not available ({e}): start nats-server with -js (JetStream enabled) and check nats.url"
                )));
            }
        },
    };
    Ok(Plan {
        create_publication,
        create_slot,
        create_stream,
    })
}

async fn apply(
    config: &Config,
    pg: &Client,
    js: &jetstream::Context,
    plan: Plan,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let publication = &config.postgres.publication;
    let (schema, table) = config.outbox.table_parts();
    if plan.create_publication {
        // Identifiers were validated as plain names by Config::validate.
        let sql = format!(
            "CREATE PUBLICATION \"{publication}\" FOR TABLE \"{schema}\".\"{table}\" WITH (publish = 'insert')"
        );
        pg.batch_execute(&sql).await.map_err(|e| {
            SetupError(format!(
                "cannot create publication {publication}: {}: run sql/02_publication.sql as the owner of {}",
                pg_error(&e),
                config.outbox.table
            ))
        })?;
        report.lines.push(format!(
            "publication {publication}: created (FOR TABLE {}, publish = 'insert')",
            config.outbox.table
        ));
    }
    let slot = &config.postgres.slot;
    if plan.create_slot {
        let row = pg
            .query_one(
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                &[slot],
            )
            .await
            .map_err(|e| {
                SetupError(format!(
                    "cannot create replication slot {slot}: {}",
                    pg_error(&e)
                ))
            })?;
        let lsn: String = row.get(0);
        report.slot_confirmed = lsn.parse().ok();
        report
            .lines
            .push(format!("slot {slot}: created (pgoutput, starts at {lsn})"));
    }
    if plan.create_stream {
        let template = SubjectTemplate::parse(&config.nats.subject)
            .map_err(|e| SetupError(format!("nats.subject: {e}")))?;
        let n = &config.nats;
        let cfg = stream::Config {
            name: n.stream.clone(),
            subjects: vec![template.wildcard(), n.dead_letter_subject.clone()],
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::Limits,
            // At a limit, refuse new events (the relay stalls and retries) rather than delete old ones.
            discard: stream::DiscardPolicy::New,
            duplicate_window: Duration::from_secs(n.duplicate_window_secs),
            num_replicas: n.stream_replicas,
            ..Default::default()
        };
        js.create_stream(cfg)
            .await
            .map_err(|e| SetupError(format!("cannot create JetStream stream {}: {e}", n.stream)))?;
        report.lines.push(format!(
            "stream {}: created (file storage, subjects {}, {}, duplicate window {}s, replicas {})",
            n.stream,
            template.wildcard(),
            n.dead_letter_subject,
            n.duplicate_window_secs,
            n.stream_replicas
        ));
    }
    Ok(())
}

/// The message for a slot Postgres invalidated: events may be lost; how to recover.
pub fn lost_slot_message(slot: &str) -> String {
    format!(
        "replication slot {slot} was invalidated (wal_status = lost: max_slot_wal_keep_size exceeded), so events \
         written since its last confirmed position may be lost: drop it (SELECT pg_drop_replication_slot('{slot}')), \
         run setup to create a new one, and backfill the missed outbox rows from the table"
    )
}

/// Whether the stream subject filter `filter` matches every subject `subject` can stand for
/// (`subject` may contain `*` itself, as a template's wildcard does).
pub fn subject_covers(filter: &str, subject: &str) -> bool {
    let f: Vec<&str> = filter.split('.').collect();
    let s: Vec<&str> = subject.split('.').collect();
    for (i, ft) in f.iter().enumerate() {
        match *ft {
            ">" => return s.len() > i,
            "*" => {
                if i >= s.len() || s[i] == ">" {
                    return false;
                }
            }
            lit => {
                if s.get(i) != Some(&lit) {
                    return false;
                }
            }
        }
    }
    f.len() == s.len()
}

fn pg_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

impl From<SourceError> for SetupError {
    fn from(e: SourceError) -> Self {
        SetupError(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_filters_cover_template_wildcards() {
        assert!(subject_covers("outbox.*", "outbox.*"));
        assert!(subject_covers("outbox.>", "outbox.*"));
        assert!(subject_covers(">", "outbox.*"));
        assert!(subject_covers("outbox_dead_letter", "outbox_dead_letter"));
        assert!(!subject_covers("outbox.Claim", "outbox.*"));
        assert!(!subject_covers("outbox.*", "outbox.*.*"));
        assert!(subject_covers("outbox.>", "outbox.*.*"));
        assert!(!subject_covers("other.>", "outbox.*"));
    }
}
