//! `outbox-relay setup` (and the first step of `run`): check everything, then create what is missing.
//!
//! Checks come first, all of them, so that a bad setting changes nothing (P8): `wal_level`, the outbox
//! table and its columns, the role's REPLICATION privilege, the publication (exists, publishes inserts,
//! contains the table), the slot (logical, pgoutput, this database, not invalidated), the JetStream
//! stream (covers the subject template and the dead-letter subject). Then, idempotently: the
//! publication (`publish = 'insert'`), the slot, the stream. Each step prints one line saying what it
//! found or did. Every failure is one line naming the object and how to fix it. `setup --check`
//! (`check.rs`) makes the same checks and says what would be created instead of creating it.

mod check;
mod helper;
mod overlap;
mod postgres;
mod retention;
mod stream;

use async_nats::jetstream;
use tokio_postgres::Client;
use tracing::warn;

use crate::catalog;
use crate::config::Settings;
use crate::nats::{ConnectError, connect_nats};
use crate::source::{SourceError, query_error_text};
use crate::warning::Warning;
pub use check::check;

/// For `status`: the logical-message warnings `setup` gives. While PUBLIC may execute
/// `pg_logical_emit_message`, or a `SECURITY DEFINER` helper that emits logical messages, and
/// `outbox.message_prefix` or `outbox.context_prefix` is set (anyone could write events or context
/// messages); and while sql/06's helper is installed but its prefix is not relayed (its events go
/// nowhere).
pub(crate) async fn message_warnings(
    settings: &Settings,
    pg: &Client,
) -> Result<Vec<Warning>, tokio_postgres::Error> {
    let mut warnings = postgres::public_emit_message(settings, pg).await?;
    warnings.extend(helper::unrelayed_helpers(settings, pg).await?);
    Ok(warnings)
}

/// A check that failed, or a server that cannot be reached. One line, naming the object and the fix.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The control connection to Postgres could not be opened.
    #[error("cannot connect to Postgres at {target} (check {check})")]
    Postgres {
        /// `postgres.url`, with the password masked.
        target: String,
        /// Where `postgres.url` was set: its variable, or the file (`Settings::key_source`).
        check: String,
        /// Why the connection failed.
        #[source]
        source: SourceError,
    },
    /// NATS cannot be reached or refuses the relay.
    #[error(transparent)]
    Nats(#[from] ConnectError),
    /// A catalog query failed. The message is the server's own, with its SQLSTATE, on one line;
    /// the error is kept (the start-up retry asks it whether the connection failed) but is not
    /// also a `source()`, which would print the server's message a second time.
    #[error("postgres: {}", query_error_text(.0))]
    Query(tokio_postgres::Error),
    /// `wal_level`, the table, its columns, the role: what Postgres must offer.
    #[error("{0}")]
    Prerequisite(String),
    /// The publication exists but does not publish what the relay needs.
    #[error("publication {name}: {problem}")]
    Publication {
        /// `postgres.publication`.
        name: String,
        /// What is wrong with it and how to fix it.
        problem: String,
    },
    /// The slot is missing (with `create_slot = false`) or cannot be used.
    #[error("replication slot {name}: {problem}")]
    Slot {
        /// `postgres.slot`.
        name: String,
        /// What is wrong with it and how to fix it.
        problem: String,
    },
    /// The stream exists but does not fit the settings (subjects, duplicate window, atomic batches).
    #[error("JetStream stream {name}: {problem}")]
    Stream {
        /// `nats.stream`.
        name: String,
        /// What is wrong with it and how to fix it.
        problem: String,
    },
    /// Another relay already relays the outbox table or the message prefix.
    #[error("{problem}")]
    Taken {
        /// `outbox.table` or `outbox.message_prefix`.
        key: &'static str,
        /// The key, whose it is and what to do (the whole line).
        problem: String,
    },
    /// NATS answered without JetStream.
    #[error(
        "JetStream is not available: start nats-server with -js (JetStream enabled) and check nats.url"
    )]
    NoJetStream(#[source] jetstream::context::GetStreamError),
    /// Creating or changing the publication, the slot or the stream failed.
    #[error("cannot create {object}")]
    Create {
        /// What was being created, e.g. `replication slot outbox_relay`.
        object: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

// By hand rather than `#[from]`, which would also make the query error the `source()`.
impl From<tokio_postgres::Error> for SetupError {
    fn from(e: tokio_postgres::Error) -> Self {
        SetupError::Query(e)
    }
}

/// What setup found and did, one line per object.
#[derive(Debug, Default, Clone)]
pub struct SetupReport {
    /// What was found or created, one line per object.
    pub lines: Vec<String>,
    /// Warnings worth a log line (e.g. a memory stream), each under its stable name.
    pub warnings: Vec<Warning>,
    /// The slot's confirmed position: where streaming starts.
    pub(crate) slot_confirmed: Option<crate::Lsn>,
    /// `setup --check`: how many of the lines say what `setup` would create or change.
    pub would_change: usize,
}

/// Connects the control connection. Fails with a line naming `postgres.url`.
pub(crate) async fn connect_postgres(settings: &Settings) -> Result<Client, SetupError> {
    catalog::connect(settings, "setup")
        .await
        .map_err(|source| SetupError::Postgres {
            target: settings.conn.to_string(),
            check: settings.key_source("postgres.url"),
            source,
        })
}

/// Checks everything, then creates what is missing. Idempotent. When a creation fails, what this
/// run created before it is removed again (P8): a failed setup leaves no slot, publication or
/// stream behind.
pub async fn setup(settings: &Settings) -> Result<SetupReport, SetupError> {
    let pg = connect_postgres(settings).await?;
    let nats = connect_nats(settings).await?;
    let js = jetstream::new(nats);
    let mut report = SetupReport::default();
    let checked = checks(settings, &pg, &js, &mut report, Mode::Setup).await?;
    apply(settings, &pg, &js, checked, &mut report).await?;
    Ok(report)
}

/// What [`prepare_without_slot`] leaves for `backfill` to decide.
#[derive(Debug)]
pub(crate) struct Prepared {
    /// What setup found and created so far.
    pub(crate) report: SetupReport,
    /// The slot as it exists now, if it does (it is neither checked nor changed).
    pub(crate) slot: Option<catalog::SlotRow>,
    /// What this run created (stream, publication), for [`Prepared::undo`].
    created: Created,
}

impl Prepared {
    /// Removes what [`prepare_without_slot`] created, when the step after it failed (P8).
    pub(crate) async fn undo(&self, settings: &Settings) {
        if !self.created.stream && !self.created.publication {
            return;
        }
        let (Ok(pg), Ok(nats)) = (
            connect_postgres(settings).await,
            connect_nats(settings).await,
        ) else {
            warn!("could not connect to remove what this run created");
            return;
        };
        self.created
            .undo(settings, &pg, &jetstream::new(nats))
            .await;
    }
}

/// For `backfill`: every check of [`setup`] and the creation of the stream and the publication, but
/// not of the slot, and without the P9 refusal (a missing slot while the stream holds events is
/// exactly what `backfill` recovers from). An existing slot is returned as found, invalidated or
/// not: `backfill` refuses or replaces it.
pub(crate) async fn prepare_without_slot(settings: &Settings) -> Result<Prepared, SetupError> {
    let pg = connect_postgres(settings).await?;
    let nats = connect_nats(settings).await?;
    let js = jetstream::new(nats);
    let mut report = SetupReport::default();
    let checked = checks(settings, &pg, &js, &mut report, Mode::Backfill).await?;
    let slot = checked.found.slot.clone();
    let created = apply_without_slot(settings, &pg, &js, checked, &mut report).await?;
    Ok(Prepared {
        report,
        slot,
        created,
    })
}

/// The checks of [`setup`] alone, changing nothing (for `status`, over the connections it opened
/// once).
pub(crate) async fn check_only(
    settings: &Settings,
    pg: &Client,
    js: &jetstream::Context,
) -> Result<(), SetupError> {
    checks(settings, pg, js, &mut SetupReport::default(), Mode::Status).await?;
    Ok(())
}

/// What the checks found to do.
struct Checked {
    found: postgres::Found,
    /// This database for the stream's metadata (`overlap::database_stamp`).
    database: Option<String>,
    create_stream: bool,
    create_slot: bool,
    /// Add the parking subjects to the existing stream (`stream::add_parked`).
    add_parked: bool,
    /// Allow per-message TTL on the existing stream (`stream::allow_ttl`).
    allow_ttl: bool,
}

/// Whose checks: `setup` (and `run`), `status` (the same, but it reports an unfinished backfill
/// itself), or `backfill`, which leaves the slot to its caller.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Setup,
    Status,
    Backfill,
}

/// Every check, before any change: Postgres, the stream, the other relays, then whether the slot is
/// created (not for a backfill, which leaves the slot to its caller).
async fn checks(
    settings: &Settings,
    pg: &Client,
    js: &jetstream::Context,
    report: &mut SetupReport,
    mode: Mode,
) -> Result<Checked, SetupError> {
    let found = postgres::check(settings, pg, report, mode != Mode::Backfill).await?;
    let found_stream = stream::check(settings, js, report).await?;
    if mode == Mode::Setup {
        refuse_unfinished_backfill(settings, found_stream.as_ref())?;
        report.lines.push(stream::publishing(settings));
    }
    let database = check_overlap(settings, pg, js, &found, found_stream.is_none(), report).await?;
    let create_slot = match mode {
        Mode::Backfill => false,
        Mode::Setup | Mode::Status => {
            slot_to_create(settings, pg, &found, found_stream.as_ref(), report).await?
        }
    };
    let add_parked = mode != Mode::Backfill && found_stream.as_ref().is_some_and(|f| f.add_parked);
    let allow_ttl = mode != Mode::Backfill && found_stream.as_ref().is_some_and(|f| f.allow_ttl);
    Ok(Checked {
        found,
        database,
        create_stream: found_stream.is_none(),
        create_slot,
        add_parked,
        allow_ttl,
    })
}

/// Another relay's slot or subjects (its stream: `stream::check`), or its table or message prefix:
/// refused before anything changes. Returns this database's stamp for the stream's metadata.
async fn check_overlap(
    settings: &Settings,
    pg: &Client,
    js: &jetstream::Context,
    found: &postgres::Found,
    stream_missing: bool,
    report: &mut SetupReport,
) -> Result<Option<String>, SetupError> {
    let database = overlap::database_stamp(pg).await;
    overlap::check_other_relays(settings, pg, js, database.as_deref(), report).await?;
    if stream_missing {
        overlap::check_new_stream(
            settings,
            js,
            found.slot.is_some(),
            database.as_deref(),
            report,
        )
        .await?;
    }
    Ok(database)
}

/// Whether the slot is to be created: not when it exists (its line says where it stands), refused
/// when it is missing and may not be created, or when the stream shows it was lost.
async fn slot_to_create(
    settings: &Settings,
    pg: &Client,
    found: &postgres::Found,
    found_stream: Option<&stream::FoundStream>,
    report: &mut SetupReport,
) -> Result<bool, SetupError> {
    let slot = &settings.config().postgres.slot;
    let Some(s) = &found.slot else {
        if !settings.config().postgres.create_slot {
            return Err(SetupError::Slot {
                name: slot.clone(),
                problem: format!(
                    "does not exist and postgres.create_slot is false: create it with \
                     SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput') or set postgres.create_slot = true"
                ),
            });
        }
        refuse_lost_slot(settings, found_stream)?;
        warn_rows_before_slot(settings, pg, report).await?;
        return Ok(true);
    };
    report.slot_confirmed = s
        .confirmed_flush_lsn
        .as_deref()
        .and_then(|l| l.parse().ok());
    report.lines.push(format!(
        "slot {slot}: exists (confirmed {}, wal_status {})",
        s.confirmed_flush_lsn.as_deref().unwrap_or("-"),
        s.wal_status.as_deref().unwrap_or("-")
    ));
    Ok(false)
}

/// P9: a new slot starts at the current WAL position; whatever committed between the old slot's
/// position and now would never reach the stream. So a stream that already holds this outbox's
/// events refuses a new slot, and says how to recover.
fn refuse_lost_slot(
    settings: &Settings,
    found_stream: Option<&stream::FoundStream>,
) -> Result<(), SetupError> {
    let Some((seq, lsn)) = found_stream.and_then(|s| s.relay_events.clone()) else {
        return Ok(());
    };
    Err(SetupError::Slot {
        name: settings.config().postgres.slot.clone(),
        problem: format!(
            "does not exist, but stream {} already holds this outbox's events (last: sequence {seq}, \
             commit LSN {}): the slot was dropped or lost, and events committed since may be missing. \
             Recover with {} (publishes the outbox rows in the new slot's snapshot; JetStream drops \
             those it holds); see docs/recovery.md",
            settings.config().nats.stream,
            crate::text::shown(&lsn, 80),
            settings.command("backfill")
        ),
    })
}

/// Rows already in the table were committed before the new slot exists: `run` will not publish
/// them, which is said as a warning with the command that would.
async fn warn_rows_before_slot(
    settings: &Settings,
    pg: &Client,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    if !settings.config().outbox.messages_only() && postgres::table_has_rows(settings, pg).await? {
        report.warnings.push(Warning::new(
            "rows-before-slot",
            format!(
                "table {} already holds rows: they were committed before the slot exists, so `run` \
                 will not publish them. To publish them too, run {} before the first `run` \
                 (docs/recovery.md)",
                settings.config().outbox.table,
                settings.command("backfill --replace-slot")
            ),
        ));
    }
    Ok(())
}

/// A backfill of this slot has begun and not finished (its marker stands on the stream): its slot
/// may stand past rows it never published, so neither `setup` nor `run` may go on from it.
fn refuse_unfinished_backfill(
    settings: &Settings,
    found: Option<&stream::FoundStream>,
) -> Result<(), SetupError> {
    match found.and_then(|f| f.backfill_refusal.clone()) {
        Some(problem) => Err(SetupError::Stream {
            name: settings.config().nats.stream.clone(),
            problem,
        }),
        None => Ok(()),
    }
}

/// The changes, the stream first (the step most likely to be refused), the slot last (it retains WAL
/// from the moment it exists).
async fn apply(
    settings: &Settings,
    pg: &Client,
    js: &jetstream::Context,
    checked: Checked,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let Checked {
        found,
        database,
        create_stream,
        create_slot,
        add_parked,
        allow_ttl,
    } = checked;
    let slot = &settings.config().postgres.slot;
    let mut created = Created::default();
    let result = async {
        if create_stream {
            report
                .lines
                .push(stream::create(settings, js, database.as_deref()).await?);
            created.stream = true;
        }
        if add_parked {
            report.lines.push(stream::add_parked(settings, js).await?);
        }
        if allow_ttl {
            report.lines.push(stream::allow_ttl(settings, js).await?);
        }
        if found.create_publication {
            report
                .lines
                .push(postgres::create_publication(settings, pg, found.partitioned).await?);
            created.publication = true;
        }
        if create_slot {
            let lsn = postgres::create_slot(settings, pg, found.version).await?;
            report.slot_confirmed = lsn.parse().ok();
            let failover = if found.version >= 170000 && settings.config().postgres.failover {
                ", failover"
            } else {
                ""
            };
            report.lines.push(format!(
                "slot {slot}: created (pgoutput{failover}, starts at {lsn})"
            ));
        }
        Ok::<_, SetupError>(())
    }
    .await;
    if let Err(e) = result {
        created.undo(settings, pg, js).await;
        return Err(e);
    }
    if let Some(existing) = &found.slot
        && found.version >= 170000
        && settings.config().postgres.failover
        && existing.failover == Some(false)
    {
        make_failover(settings, existing.active, report).await?;
    }
    Ok(())
}

/// PG 17+: an existing slot without FAILOVER is altered while no one streams it; otherwise a
/// warning says how.
async fn make_failover(
    settings: &Settings,
    active: bool,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let slot = &settings.config().postgres.slot;
    if active {
        report.warnings.push(Warning::new(
            "not-failover-slot",
            format!(
                "slot {slot} is not a failover slot and a relay streams it: stop the relay and run {} to make it \
                 one (or set postgres.failover = false)",
                settings.command("setup")
            ),
        ));
        return Ok(());
    }
    let mut conn = crate::source::ReplConnection::connect(&settings.conn, "outbox-relay setup")
        .await
        .map_err(|source| SetupError::Postgres {
            target: settings.conn.to_string(),
            check: settings.key_source("postgres.url"),
            source,
        })?;
    let result = conn.alter_slot_failover(slot).await;
    conn.close().await;
    result.map_err(|e| SetupError::Create {
        object: format!("failover for replication slot {slot}"),
        source: Box::new(e),
    })?;
    report
        .lines
        .push(format!("slot {slot}: now a failover slot"));
    Ok(())
}

/// [`apply`] for `backfill`: the stream and the publication, never the slot. Returns what it
/// created, so a failure of the backfill's own first steps can remove it again.
async fn apply_without_slot(
    settings: &Settings,
    pg: &Client,
    js: &jetstream::Context,
    checked: Checked,
    report: &mut SetupReport,
) -> Result<Created, SetupError> {
    let mut created = Created::default();
    let result = async {
        if checked.create_stream {
            report
                .lines
                .push(stream::create(settings, js, checked.database.as_deref()).await?);
            created.stream = true;
        }
        if checked.found.create_publication {
            report
                .lines
                .push(postgres::create_publication(settings, pg, checked.found.partitioned).await?);
            created.publication = true;
        }
        Ok::<_, SetupError>(())
    }
    .await;
    if let Err(e) = result {
        created.undo(settings, pg, js).await;
        return Err(e);
    }
    Ok(created)
}

/// What one setup run created, to undo when a later step fails.
#[derive(Default, Debug)]
struct Created {
    stream: bool,
    publication: bool,
}

impl Created {
    async fn undo(&self, settings: &Settings, pg: &Client, js: &jetstream::Context) {
        if self.publication {
            let name = &settings.config().postgres.publication;
            if let Err(e) = pg
                .batch_execute(&format!("DROP PUBLICATION IF EXISTS \"{name}\""))
                .await
            {
                warn!(publication = %name, error = %e, "setup failed; could not drop the publication it created");
            }
        }
        if self.stream {
            let name = &settings.config().nats.stream;
            if let Err(e) = js.delete_stream(name).await {
                warn!(stream = %name, error = %e, "setup failed; could not delete the stream it created");
            }
        }
    }
}

/// The message for a slot Postgres invalidated: events may be lost; how to recover (the command
/// with the `--config` these settings came from).
pub(crate) fn lost_slot_message(settings: &Settings, reason: &str) -> String {
    format!(
        "replication slot {} was invalidated ({}), so events written since its last confirmed position \
         may be lost: stop every relay for it and recover with {}, which replaces the slot with a new one and \
         publishes the outbox rows in its snapshot; see docs/recovery.md",
        settings.config().postgres.slot,
        crate::text::shown(reason, 200),
        settings.command("backfill --replace-slot")
    )
}
