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
//! Streams are listed with `$JS.API.STREAM.LIST` only on a first setup of the stream. A NATS user
//! without that permission (the documented relay user) gets a warning that the slot could not be
//! checked; the subject overlap is still refused by JetStream, and named in `stream::create`.

use async_nats::jetstream;
use futures_util::StreamExt;
use tokio_postgres::Client;

use super::stream::{META_DATABASE, META_SLOT};
use super::{SetupError, SetupReport};
use crate::config::Settings;
use crate::route::subjects_overlap;

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
                    report.warnings.push(format!(
                        "could not list the streams ({e}; the NATS user may lack $JS.API.STREAM.LIST), so setup \
                         could not check that no other relay's stream uses slot {}: if another relay streams it, \
                         give this relay names of its own with name",
                        config.postgres.slot
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
