//! Setup's Postgres side: the checks (`wal_level`, the outbox table and its columns, the role's
//! REPLICATION attribute, the publication, the slot) and the creation of the publication and the slot.
//!
//! A partitioned outbox is published through its root (`publish_via_partition_root`), so inserts
//! into any partition arrive as the root table's, and partitions can come and go while the relay
//! streams.
//!
//! Messages only (`outbox.table = ""` with a `message_prefix`): there is no table to check, and the
//! publication is created empty. pgoutput still needs one to exist (it looks the names up when
//! streaming starts), but sends logical messages whatever the publication contains.

use tokio_postgres::Client;

use super::{SetupError, SetupReport};
use crate::catalog::{self, SlotRow};
use crate::config::Settings;
use crate::source::quote_ident;
use crate::warning::Warning;

const PAYLOAD_TYPES: &[&str] = &["jsonb", "json", "text", "bytea", "varchar"];
const ID_TYPES: &[&str] = &["uuid", "text", "varchar", "int8", "int4", "bpchar"];
const TEXT_TYPES: &[&str] = &["text", "varchar", "bpchar"];
const AGGREGATE_ID_TYPES: &[&str] = &["text", "varchar", "bpchar", "uuid", "int8", "int4"];
const HEADER_TYPES: &[&str] = &["jsonb", "json"];

/// What the Postgres checks found.
pub(super) struct Found {
    /// `server_version_num`.
    pub(crate) version: u32,
    pub(crate) create_publication: bool,
    /// The slot, when it exists.
    pub(crate) slot: Option<SlotRow>,
    /// The outbox table is partitioned.
    pub(crate) partitioned: bool,
}

/// Checks `wal_level`, the table, the role and the publication, and reads the slot. With
/// `check_slot_too` false (backfill, which decides about an existing slot itself) the slot is only
/// read.
pub(super) async fn check(
    settings: &Settings,
    pg: &Client,
    report: &mut SetupReport,
    check_slot_too: bool,
) -> Result<Found, SetupError> {
    let version = check_server(settings, pg, report).await?;
    report
        .warnings
        .extend(super::retention::warnings(settings, pg).await?);
    let partitioned = check_table_or_messages(settings, pg, report).await?;
    check_role(settings, pg, report).await?;
    report
        .warnings
        .extend(public_emit_message(settings, pg).await?);
    report
        .warnings
        .extend(super::helper::unrelayed_helpers(settings, pg).await?);
    let create_publication = check_publication(settings, pg, partitioned, report).await?;
    let slot = catalog::slot(pg, &settings.config().postgres.slot).await?;
    if let Some(s) = slot.as_ref().filter(|_| check_slot_too) {
        check_slot(settings, s)?;
    }
    Ok(Found {
        version,
        create_publication,
        slot,
        partitioned,
    })
}

/// `wal_level`, a primary (not a standby), and with `failover` on PG 17, standbys that
/// `synchronized_standby_slots` waits for. Returns `server_version_num`.
async fn check_server(
    settings: &Settings,
    pg: &Client,
    report: &mut SetupReport,
) -> Result<u32, SetupError> {
    let row = pg
        .query_one(
            "SELECT current_setting('wal_level'), current_setting('server_version_num')::int4, \
             pg_is_in_recovery(), coalesce(current_setting('synchronized_standby_slots', true), ''), \
             (SELECT count(*) FROM pg_stat_replication WHERE application_name <> '' \
                AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s \
                                WHERE s.active_pid = pg_stat_replication.pid AND s.slot_type = 'logical'))::int4",
            &[],
        )
        .await?;
    let (wal_level, version, in_recovery, sync_slots, physical_standbys): (
        String,
        i32,
        bool,
        String,
        i32,
    ) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    let version = version.max(0) as u32;
    if in_recovery {
        return Err(SetupError::Prerequisite(format!(
            "postgres.url reached a standby ({}): no slot can be created or streamed there; point postgres.url at the \
             primary, or list every host with target_session_attrs=read-write so the relay finds it",
            settings.conn
        )));
    }
    if version >= 170000
        && settings.config().postgres.failover
        && physical_standbys > 0
        && sync_slots.is_empty()
    {
        report.warnings.push(Warning::new(
            "no-synchronized-standby-slots",
            format!(
                "{physical_standbys} physical standby(s) stream from this primary, but synchronized_standby_slots is \
                 empty: the relay may publish a transaction a standby does not have yet, and after a failover that \
                 event exists in NATS but not in the database; set synchronized_standby_slots to the standbys' \
                 physical slots"
            ),
        ));
    }
    if wal_level != "logical" {
        return Err(SetupError::Prerequisite(format!(
            "Postgres wal_level is {wal_level:?}, logical decoding needs \"logical\": set wal_level = logical \
             in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart Postgres"
        )));
    }
    Ok(version)
}

/// The outbox table (returns whether it is partitioned), or with messages only the line saying so.
async fn check_table_or_messages(
    settings: &Settings,
    pg: &Client,
    report: &mut SetupReport,
) -> Result<bool, SetupError> {
    if settings.config().outbox.messages_only() {
        report.lines.push(format!(
            "table: none (messages only: logical messages with prefix {:?})",
            settings.config().outbox.message_prefix
        ));
        Ok(false)
    } else {
        check_table(settings, pg, report).await
    }
}

/// The role may stream from a slot: REPLICATION, superuser, or `rds_replication` on Amazon RDS.
async fn check_role(
    settings: &Settings,
    pg: &Client,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    // What lets a role stream from a slot: the REPLICATION attribute, superuser, or on Amazon RDS
    // and Aurora, where no customer role may have the attribute, membership of `rds_replication`
    // (RDS's patched server honours it; a plain server has no such role, or refuses the walsender
    // with its own error, which the slot's creation then reports).
    let row = pg
        .query_one(
            "SELECT r.rolreplication OR r.rolsuper,                     EXISTS (SELECT 1 FROM pg_roles g WHERE g.rolname = 'rds_replication'                             AND pg_has_role(r.oid, g.oid, 'MEMBER'))              FROM pg_roles r WHERE r.rolname = current_user",
            &[],
        )
        .await?;
    let (attribute, rds) = (row.get::<_, bool>(0), row.get::<_, bool>(1));
    if rds && !attribute {
        report
            .lines
            .push("role: member of rds_replication (Amazon RDS / Aurora)".to_owned());
    } else if !attribute {
        let user = &settings.conn.user;
        return Err(SetupError::Prerequisite(format!(
            "Postgres role {user:?} lacks the REPLICATION attribute: ALTER ROLE {user} REPLICATION \
             (see sql/03_relay_role.sql; on Amazon RDS or Aurora: GRANT rds_replication TO {user})"
        )));
    }
    Ok(())
}

/// Whether the outbox table holds any row (one index or heap page read, whatever its size).
pub(super) async fn table_has_rows(settings: &Settings, pg: &Client) -> Result<bool, SetupError> {
    let (schema, name) = settings.config().outbox.table_parts();
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {}.{})",
        quote_ident(schema),
        quote_ident(name)
    );
    Ok(pg.query_one(&sql, &[]).await?.get(0))
}

/// With `outbox.message_prefix` or `outbox.context_prefix` set: a warning while PUBLIC may execute
/// `pg_logical_emit_message`. Table privileges do not apply to it, so then any role that can connect
/// may write a message with the prefix directly: an event the relay publishes, bypassing the checks of
/// sql/06_outbox_message.sql's helper, or a trace context message that sql/08's helper did not check
/// (an invalid or non-transactional one is a dead letter in the stream).
///
/// The same for the helpers: a `SECURITY DEFINER` function that emits logical messages (sql/06's
/// `outbox_message`, sql/08's `outbox_context`, or one of yours) and that PUBLIC may execute lets every
/// role emit through it, with its owner's rights.
pub(crate) async fn public_emit_message(
    settings: &Settings,
    pg: &Client,
) -> Result<Vec<Warning>, tokio_postgres::Error> {
    let outbox = &settings.config().outbox;
    let (key, what) = match (
        outbox.message_prefix.is_empty(),
        outbox.context_prefix.is_empty(),
    ) {
        (true, true) => return Ok(Vec::new()),
        (false, _) => (
            "outbox.message_prefix",
            "write events the relay publishes, unchecked",
        ),
        (true, false) => (
            "outbox.context_prefix",
            "write trace context messages the relay applies to their transaction's events, unchecked (and fill the \
             dead-letter subject with invalid ones)",
        ),
    };
    // Every overload (text and bytea content; PG 17 added `flush`). A NULL proacl is the default,
    // which grants EXECUTE to PUBLIC (grantee 0).
    let row = pg
        .query_one(
            "SELECT string_agg(p.oid::regprocedure::text, ', ' ORDER BY p.oid::regprocedure::text) \
             FROM pg_catalog.pg_proc p \
             WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace \
               AND EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a \
                           WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')",
            &[],
        )
        .await?;
    let mut warnings: Vec<Warning> = row
        .get::<_, Option<String>>(0)
        .map(|functions| {
            Warning::new(
                "public-emit-message",
                format!(
                    "{key} is set, but every role of this database may call {functions} and so {what}: as a \
                     superuser, REVOKE EXECUTE ON FUNCTION {functions} FROM PUBLIC (sql/06_outbox_message.sql does \
                     it; its helper and sql/08's keep working)"
                ),
            )
        })
        .into_iter()
        .collect();
    let helpers = pg
        .query_one(
            "SELECT string_agg(p.oid::regprocedure::text, ', ' ORDER BY p.oid::regprocedure::text) \
             FROM pg_catalog.pg_proc p \
             WHERE p.prosecdef AND p.prosrc LIKE '%pg_logical_emit_message%' \
               AND p.pronamespace <> 'pg_catalog'::regnamespace \
               AND EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a \
                           WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')",
            &[],
        )
        .await?;
    if let Some(functions) = helpers.get::<_, Option<String>>(0) {
        warnings.push(Warning::new(
            "public-emit-helper",
            format!(
                "{key} is set, but every role of this database may call {functions}, SECURITY DEFINER and \
                 emitting logical messages with its owner's rights, and so {what}: REVOKE EXECUTE ON FUNCTION \
                 {functions} FROM PUBLIC and GRANT it to your writer role (sql/06 and sql/08 do both with -v \
                 writer_role=…)"
            ),
        ));
    }
    Ok(warnings)
}

/// The outbox table and its columns. Returns whether it is partitioned.
async fn check_table(
    settings: &Settings,
    pg: &Client,
    report: &mut SetupReport,
) -> Result<bool, SetupError> {
    let o = &settings.config().outbox;
    let (schema, table) = o.table_parts();
    let found: Option<(u32, i8)> = pg
        .query_opt(
            "SELECT c.oid, c.relkind FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
            &[&schema, &table],
        )
        .await?
        .map(|r| (r.get(0), r.get(1)));
    let Some((oid, relkind)) = found else {
        return Err(SetupError::Prerequisite(format!(
            "outbox.table {} does not exist (or this role cannot see it): create it with sql/01_outbox_table.sql \
             or set outbox.table",
            o.table
        )));
    };
    let partitioned = relkind == b'p' as i8;
    let columns: Vec<(String, String)> = pg
        .query(
            "SELECT a.attname::text, t.typname::text FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
             WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped",
            &[&oid],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
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
                return Err(SetupError::Prerequisite(format!(
                    "{key}: table {} has no column {name:?}: add it or set {key}",
                    o.table
                )));
            }
            Some((_, ty)) if !types.contains(&ty.as_str()) => {
                return Err(SetupError::Prerequisite(format!(
                    "{key}: column {name:?} of {} has type {ty}, expected one of {}",
                    o.table,
                    types.join(", ")
                )));
            }
            Some(_) => {}
        }
    }
    report.lines.push(format!(
        "table {}: ok ({} columns{})",
        o.table,
        columns.len(),
        if partitioned { ", partitioned" } else { "" }
    ));
    Ok(partitioned)
}

/// The publication: publishes inserts, contains the table (through its root when partitioned).
/// Returns whether it must be created.
async fn check_publication(
    settings: &Settings,
    pg: &Client,
    partitioned: bool,
    report: &mut SetupReport,
) -> Result<bool, SetupError> {
    let name = &settings.config().postgres.publication;
    let table = &settings.config().outbox.table;
    let (schema, relname) = settings.config().outbox.table_parts();
    let row = pg
        .query_opt(
            "SELECT pubinsert, pubviaroot, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = $1",
            &[name],
        )
        .await?;
    let problem = |problem: String| SetupError::Publication {
        name: name.clone(),
        problem,
    };
    let Some(row) = row else {
        return Ok(true);
    };
    if settings.config().outbox.messages_only() {
        // Whatever it publishes is decoded and ignored: only its existence matters to pgoutput.
        report.lines.push(format!(
            "publication {name}: exists (messages only: no table of it is read as the outbox)"
        ));
        return Ok(false);
    }
    let (pubinsert, viaroot): (bool, bool) = (row.get(0), row.get(1));
    if !pubinsert {
        return Err(problem(format!(
            "does not publish inserts: ALTER PUBLICATION {name} SET (publish = 'insert')"
        )));
    }
    report
        .warnings
        .extend(more_than_inserts(name, row.get(2), row.get(3), row.get(4)));
    if partitioned && !viaroot {
        return Err(problem(format!(
            "{table} is partitioned, but the publication publishes its partitions under their own names: \
             ALTER PUBLICATION {name} SET (publish_via_partition_root = true)"
        )));
    }
    // A partitioned table's publication lists its partitions (or, via root, the root) in
    // pg_publication_tables; membership of the root is what matters.
    let member = pg
        .query_opt(
            "SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid \
             JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE p.pubname = $1 AND n.nspname = $2 AND c.relname = $3 \
             UNION ALL SELECT 1 FROM pg_publication WHERE pubname = $1 AND puballtables",
            &[name, &schema, &relname],
        )
        .await?;
    if member.is_none() {
        return Err(problem(format!(
            "does not contain {table}: ALTER PUBLICATION {name} ADD TABLE {table}"
        )));
    }
    report.lines.push(format!("publication {name}: exists"));
    Ok(false)
}

/// The warning for a publication that publishes updates, deletes or truncates besides inserts:
/// the relay ignores them, but each is decoded, sent and counted, and a retention `DELETE` of many
/// rows is as much work for the walsender as the inserts were.
fn more_than_inserts(name: &str, update: bool, delete: bool, truncate: bool) -> Option<Warning> {
    let more: Vec<&str> = [
        (update, "update"),
        (delete, "delete"),
        (truncate, "truncate"),
    ]
    .into_iter()
    .filter_map(|(on, what)| on.then_some(what))
    .collect();
    (!more.is_empty()).then(|| {
        Warning::new(
            "publication-more-than-inserts",
            format!(
                "publication {name} publishes {} besides inserts: the relay ignores them, but the walsender \
                 decodes and sends every one (a retention DELETE costs as much as the inserts did): \
                 ALTER PUBLICATION {name} SET (publish = 'insert')",
                more.join(", ")
            ),
        )
    })
}

/// An existing slot must be a logical pgoutput slot of this database that Postgres did not
/// invalidate.
fn check_slot(settings: &Settings, s: &SlotRow) -> Result<(), SetupError> {
    let name = &settings.config().postgres.slot;
    let problem = |problem: String| SetupError::Slot {
        name: name.clone(),
        problem,
    };
    let plugin = s.plugin.as_deref().unwrap_or("");
    if s.slot_type != "logical" || plugin != "pgoutput" {
        return Err(problem(format!(
            "is a {} slot with plugin {plugin:?}, not a logical pgoutput slot: use another postgres.slot or drop it",
            s.slot_type
        )));
    }
    let db = s.database.as_deref().unwrap_or("");
    if db != s.current_database {
        return Err(problem(format!(
            "belongs to database {db:?}, but postgres.url connects to {:?}: use another postgres.slot or fix the \
             database in postgres.url",
            s.current_database
        )));
    }
    if let Some(reason) = s.invalidated() {
        return Err(SetupError::Prerequisite(super::lost_slot_message(
            settings, &reason,
        )));
    }
    Ok(())
}

/// Creates the publication (through the root for a partitioned table).
pub(super) async fn create_publication(
    settings: &Settings,
    pg: &Client,
    partitioned: bool,
) -> Result<String, SetupError> {
    let name = &settings.config().postgres.publication;
    if settings.config().outbox.messages_only() {
        pg.batch_execute(&format!(
            "CREATE PUBLICATION \"{name}\" WITH (publish = 'insert')"
        ))
        .await
        .map_err(|e| SetupError::Create {
            object: format!("publication {name} (run CREATE PUBLICATION {name} as a role with CREATE on the database)"),
            source: Box::new(e),
        })?;
        return Ok(format!(
            "publication {name}: created (no tables: messages only, pgoutput needs a publication to exist)"
        ));
    }
    let (schema, table) = settings.config().outbox.table_parts();
    let via_root = if partitioned {
        ", publish_via_partition_root = true"
    } else {
        ""
    };
    // Identifiers were validated as plain names by Config::validate.
    let sql = format!(
        "CREATE PUBLICATION \"{name}\" FOR TABLE \"{schema}\".\"{table}\" WITH (publish = 'insert'{via_root})"
    );
    pg.batch_execute(&sql)
        .await
        .map_err(|e| SetupError::Create {
            object: format!(
                "publication {name} (run sql/02_publication.sql as the owner of {})",
                settings.config().outbox.table
            ),
            source: Box::new(e),
        })?;
    Ok(format!(
        "publication {name}: created (FOR TABLE {}, publish = 'insert'{via_root})",
        settings.config().outbox.table
    ))
}

/// Creates the slot (a failover slot on PG 17+ unless `postgres.failover = false`); returns its
/// starting position.
pub(super) async fn create_slot(
    settings: &Settings,
    pg: &Client,
    version: u32,
) -> Result<String, SetupError> {
    let slot = &settings.config().postgres.slot;
    let sql = if version >= 170000 && settings.config().postgres.failover {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    let row = pg
        .query_one(sql, &[slot])
        .await
        .map_err(|e| SetupError::Create {
            object: format!("replication slot {slot}"),
            source: Box::new(e),
        })?;
    Ok(row.get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publication_of_inserts_only_gets_no_warning_any_other_names_what_it_adds() {
        assert_eq!(more_than_inserts("p", false, false, false), None);
        let w = more_than_inserts("p", false, true, true).unwrap().text;
        assert!(
            w.contains("publishes delete, truncate besides inserts"),
            "{w}"
        );
        assert!(
            w.ends_with("ALTER PUBLICATION p SET (publish = 'insert')"),
            "{w}"
        );
        assert!(!w.contains('\n'));
        assert!(
            more_than_inserts("p", true, false, false)
                .unwrap()
                .text
                .contains("publishes update besides")
        );
    }
}
