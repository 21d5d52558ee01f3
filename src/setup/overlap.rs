//! Setup's refusal of a configuration that overlaps another relay's: a second relay on the same
//! Postgres and NATS that kept one of the first relay's names would steal its slot's events, break
//! the fence of its stream, or have JetStream refuse its stream. Checked before anything changes
//! (P8), each refusal one line naming the key and suggesting `name`.
//!
//! - **The stream is another relay's.** It exists and its metadata `outbox-relay.slot` names another
//!   slot: two relays would write one stream.
//! - **The slot is another relay's.** It exists, this relay's stream does not (a first setup), and
//!   another stream's metadata names the slot for the same database (`outbox-relay.database`, the
//!   server's system identifier and the database; a stream made before that key counts as the same).
//! - **The subjects are another stream's.** This relay's stream does not exist and another stream's
//!   subjects overlap the subject template or the dead-letter subject: JetStream would refuse the create
//!   anyway (error 10065, which does not say with which stream), so setup names it first.
//!
//! - **The table or the message prefix is another relay's.** Another relay's publication and slot
//!   relay the outbox table (a publication that publishes it, and a logical pgoutput slot of this
//!   database named like it, as `name` derives both), or another relay's stream records, in its
//!   metadata, the table or the message prefix its relay publishes and that relay's slot exists in
//!   this database. Every slot receives every logical message, so a prefix two relays share is
//!   published twice as surely as a shared table. Checked by `setup`, `run`, `backfill` and `status`.
//!
//! Streams are listed with `$JS.API.STREAM.LIST`. A NATS user without that permission (the
//! documented relay user) gets a warning that the slot could not be checked; the subject overlap is
//! still refused by JetStream, and named in `stream::create`; the table is still checked on the
//! Postgres side.

use async_nats::jetstream;
use futures_util::StreamExt;
use tokio_postgres::Client;

use super::stream::{META_DATABASE, META_MESSAGE_PREFIX, META_SLOT, META_TABLE};
use super::{SetupError, SetupReport};
use crate::config::Settings;
use crate::route::subjects_overlap;
use crate::warning::Warning;

/// This database, as a stream's `outbox-relay.database` names it: `<system identifier>/<database>`.
/// `None` when the server does not say (the check then treats every stream as the same database).
pub(super) async fn database_stamp(pg: &Client) -> Option<String> {
    pg.query_one(
        "SELECT system_identifier::text || '/' || current_database() FROM pg_catalog.pg_control_system()",
        &[],
    )
    .await
    .ok()
    .map(|r| r.get(0))
}

/// The stream exists: refused when its metadata names another slot.
pub(super) fn check_existing_stream(
    settings: &Settings,
    slot_meta: Option<&str>,
) -> Result<(), SetupError> {
    let ours = &settings.config().postgres.slot;
    match slot_meta {
        Some(theirs) if theirs != ours => Err(SetupError::Stream {
            name: settings.config().nats.stream.clone(),
            problem: format!(
                "belongs to another relay: its metadata outbox-relay.slot names slot {theirs}, not postgres.slot \
                 {ours}, and two relays writing one stream break each other's fence; give this relay names of its \
                 own with name (or set nats.stream), or, if this relay's slot was renamed, set postgres.slot = \"{theirs}\""
            ),
        }),
        _ => Ok(()),
    }
}

/// This relay's stream does not exist yet: refused when another stream holds this relay's slot (the
/// slot exists) or overlapping subjects.
pub(super) async fn check_new_stream(
    settings: &Settings,
    js: &jetstream::Context,
    slot_exists: bool,
    database: Option<&str>,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let config = settings.config();
    let ours = [
        ("nats.subject", settings.subject.wildcard()),
        (
            "nats.dead_letter_subject",
            config.nats.dead_letter_subject.clone(),
        ),
    ];
    let mut streams = js.streams();
    while let Some(info) = streams.next().await {
        let info = match info {
            Ok(info) => info,
            Err(e) => {
                if slot_exists {
                    report.warnings.push(Warning::new(
                        "streams-not-listed",
                        format!(
                            "could not list the streams ({e}; the NATS user may lack $JS.API.STREAM.LIST), so \
                             setup could not check that no other relay's stream uses slot {}: if another relay \
                             streams it, give this relay names of its own with name",
                            config.postgres.slot
                        ),
                    ));
                }
                return Ok(());
            }
        };
        let other = &info.config.name;
        if *other == config.nats.stream {
            continue;
        }
        let meta = &info.config.metadata;
        let same_database = match (meta.get(META_DATABASE), database) {
            (Some(theirs), Some(ours)) => theirs == ours,
            _ => true,
        };
        if slot_exists
            && same_database
            && meta.get(META_SLOT).map(String::as_str) == Some(config.postgres.slot.as_str())
        {
            return Err(SetupError::Slot {
                name: config.postgres.slot.clone(),
                problem: format!(
                    "is another relay's: stream {other}'s metadata outbox-relay.slot names it, and two relays on one \
                     slot take each other's events; give this relay names of its own with name (or set postgres.slot), \
                     or, if this relay moves to stream {} for good, delete stream {other} first",
                    config.nats.stream
                ),
            });
        }
        for (key, subject) in &ours {
            if let Some(theirs) = info
                .config
                .subjects
                .iter()
                .find(|t| subjects_overlap(subject, t))
            {
                return Err(SetupError::Stream {
                    name: config.nats.stream.clone(),
                    problem: format!(
                        "cannot be created: {key} {subject} overlaps subject {theirs} of stream {other}, and JetStream \
                         lets no two streams share a subject; give this relay names of its own with name (or set \
                         {key}), or use that stream (nats.stream = \"{other}\")"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Another relay that relays what this one would: its slot, and how that is known.
struct Taken {
    /// The setting that must differ.
    key: &'static str,
    /// Its value here.
    value: String,
    /// That relay's slot.
    slot: String,
    /// How it is known (its publication, or its stream's metadata).
    by: String,
}

/// Refuses `outbox.table` or `outbox.message_prefix` when another relay's publication and slot
/// already relay it (see the module docs). A publication with a row filter on the table may split
/// it with this relay on purpose: a warning, not a refusal.
pub(super) async fn check_other_relays(
    settings: &Settings,
    pg: &Client,
    js: &jetstream::Context,
    database: Option<&str>,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let config = settings.config();
    let mut taken = Vec::new();
    if !config.outbox.messages_only() {
        let (schema, table) = config.outbox.table_parts();
        // A relay's slot and publication share their name (`name` derives both; the defaults are
        // both outbox_relay); this relay's own slot never counts.
        let rows = pg
            .query(
                "SELECT t.pubname::text, bool_or(t.rowfilter IS NOT NULL) \
                 FROM pg_catalog.pg_publication_tables t \
                 JOIN pg_catalog.pg_replication_slots s ON s.slot_name = t.pubname \
                 WHERE t.schemaname = $1 AND t.tablename = $2 AND t.pubname <> $3 AND s.slot_name <> $4 \
                   AND s.slot_type = 'logical' AND s.plugin = 'pgoutput' AND s.database = current_database() \
                 GROUP BY 1 ORDER BY 1",
                &[&schema, &table, &config.postgres.publication, &config.postgres.slot],
            )
            .await?;
        for r in rows {
            let name: String = r.get(0);
            if r.get::<_, bool>(1) {
                report.warnings.push(Warning::new(
                    "filtered-overlap",
                    format!(
                        "publication {name} of slot {name} publishes {} through a row filter: if another relay \
                         streams that slot, check that its filter and this relay's publication {} never take the same \
                         row, or each such row is published twice",
                        config.outbox.table, config.postgres.publication
                    ),
                ));
                continue;
            }
            taken.push(Taken {
                key: "outbox.table",
                value: config.outbox.table.clone(),
                by: format!("its publication {name} publishes the table"),
                slot: name,
            });
        }
    }
    if taken.is_empty() {
        taken = from_streams(settings, pg, js, database).await?;
    }
    match taken.into_iter().next() {
        None => Ok(()),
        Some(t) => Err(SetupError::Taken {
            key: t.key,
            problem: format!(
                "{} {:?} is already relayed by the relay of slot {} ({}), and two relays would publish each of \
                 its events twice: give this relay its own with {} (docs/multiple-outboxes.md; `name` alone \
                 does not change it){}; or, if that relay is retired, drop its slot and its stop mark: \
                 SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name IN ('{}', '{}')",
                t.key,
                t.value,
                t.slot,
                t.by,
                t.key,
                if t.key == "outbox.message_prefix" {
                    " and sql/06's helper made for it (psql -v message_prefix=... -v function_name=...), or \"\" to \
                     relay no logical messages"
                } else {
                    ""
                },
                t.slot,
                crate::slot_mark::name(&t.slot),
            ),
        }),
    }
}

/// What other streams' metadata says their relays publish (the table, the message prefix), for the
/// relays whose slot exists in this database. Nothing when the streams cannot be listed (a warning
/// says so only when it matters: [`check_new_stream`]).
async fn from_streams(
    settings: &Settings,
    pg: &Client,
    js: &jetstream::Context,
    database: Option<&str>,
) -> Result<Vec<Taken>, SetupError> {
    let config = settings.config();
    let mut taken = Vec::new();
    let mut streams = js.streams();
    while let Some(Ok(info)) = streams.next().await {
        let meta = &info.config.metadata;
        let Some(slot) = meta.get(META_SLOT) else {
            continue;
        };
        if info.config.name == config.nats.stream || *slot == config.postgres.slot {
            continue;
        }
        if let (Some(theirs), Some(ours)) = (meta.get(META_DATABASE), database)
            && theirs != ours
        {
            continue;
        }
        let (table, prefix) = (meta.get(META_TABLE), meta.get(META_MESSAGE_PREFIX));
        let table_taken = !config.outbox.messages_only() && table == Some(&config.outbox.table);
        let prefix_taken = !config.outbox.message_prefix.is_empty()
            && prefix == Some(&config.outbox.message_prefix);
        if !(table_taken || prefix_taken) || !slot_here(pg, slot).await? {
            continue;
        }
        let by = format!("stream {}'s metadata says so", info.config.name);
        taken.push(if table_taken {
            Taken {
                key: "outbox.table",
                value: config.outbox.table.clone(),
                slot: slot.clone(),
                by,
            }
        } else {
            Taken {
                key: "outbox.message_prefix",
                value: config.outbox.message_prefix.clone(),
                slot: slot.clone(),
                by,
            }
        });
    }
    Ok(taken)
}

/// `slot` is a logical slot of this database.
async fn slot_here(pg: &Client, slot: &str) -> Result<bool, SetupError> {
    Ok(pg
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_replication_slots \
             WHERE slot_name = $1 AND slot_type = 'logical' AND database = current_database()",
            &[&slot],
        )
        .await?
        .is_some())
}
