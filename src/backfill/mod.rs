//! `outbox-relay backfill`: publishes the outbox rows that exist now (those matching `--where`),
//! exactly like live events, and leaves a new slot behind that starts where those rows end, so that
//! `run` afterwards publishes everything committed after them: no gap and no overlap.
//!
//! How: the slot is created with `CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')`. Its consistent
//! point and the exported snapshot describe the same moment: a transaction is visible in the
//! snapshot exactly when its commit record lies before the consistent point, and the slot sends
//! exactly the transactions that commit at or after it. A read-only REPEATABLE READ transaction on
//! the control connection imports the snapshot (`SET TRANSACTION SNAPSHOT`) and reads the rows
//! through a server-side cursor, 1,000 at a time, while writers go on inserting. Each row becomes a
//! synthetic pgoutput Relation + Insert (the table's real column names and type OIDs, every value in
//! its text form, as the walsender sends it) and goes through the same [`OutboxStage`] and [`Sink`]
//! as live events: same subject, headers, `Nats-Msg-Id`, dead-letter rules and `bytea` handling.
//!
//! `Outbox-Commit-Lsn` of a backfilled message is the consistent point minus one, for every row,
//! and its `Outbox-Position` that LSN with the row's index in the cursor's order. Why not the
//! consistent point itself: a live transaction's commit record may start exactly there, and its
//! events would share positions with the backfilled rows, which the next `run` compares with the
//! stream's tail to know what is stored. One less is strictly before every commit the slot will send
//! and after every commit the snapshot shows (WAL records start on 8-byte boundaries).
//!
//! Rows the stream already holds are dropped by JetStream inside its duplicate window; the backfill
//! counts them. Its publishes are not fenced (see `publish_snapshot`); `run` fences the stream
//! again from the tail the backfill leaves.
//!
//! Until the last ack the new slot stands past rows the stream may not hold, so the backfill marks
//! the stream first (`outbox-relay.backfill`, [`crate::backfill_marker`]) and removes the mark only
//! then: `run`, `setup` and `status` see an unfinished backfill, also one killed with kill -9. On
//! SIGINT/SIGTERM ([`backfill_until`]) it drops the slot it created and keeps the mark; the next
//! backfill replaces a slot the mark guards without `--replace-slot`.
//!
//! The backfill reaches its servers only through the traits of `port.rs` ([`BackfillServers`]:
//! setup, the control connection, the replication connection that creates the slot, NATS through
//! the sink's own port); `servers.rs` implements them over the real connections, and the
//! deterministic simulation over its simulated servers, where [`backfill_over`] is stopped and
//! killed at random points.
//!
//! `--where` and `--order-by` are SQL written by the operator, who already has access to the
//! database; they go into the query as written, inside a READ ONLY transaction, through the extended
//! query protocol (which refuses more than one statement). `--order-by` must not contain `;`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::{debug, info, warn};

use crate::Lsn;
use crate::backfill_marker::{self, Marker, MarkerError};
use crate::catalog;
use crate::config::Settings;
use crate::nats::{JetStreamPort, NatsPort};
use crate::outbox::{OutboxStage, StageError, Step};
use crate::pgoutput::{Column, Message, Relation, TupleValue};
use crate::position::History;
use crate::setup::SetupError;
use crate::sink::{ConnectError, Origin, Outcome, Sink, SinkConfig, SinkError, TailError};
use crate::source::{SourceError, SystemInfo, quote_ident};

mod port;
mod servers;

pub use port::{BackfillServers, BoxError, Control, CursorError, DropFailure, Prepared, SlotMaker};

/// Rows per `FETCH`: large enough to amortise the round trip, small enough that the rows in one
/// fetch are a small part of the publish window.
const FETCH_ROWS: u32 = 1000;
/// How often the progress callback is called.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
const CURSOR: &str = "outbox_relay_backfill";
/// How long a slot the backfill's walsender just let go of may still show as active.
const SLOT_RELEASE: Duration = Duration::from_secs(10);
/// The relation id of the synthetic Relation message (any value: it only pairs Relation and Insert).
const RELATION_ID: u32 = 1;

/// What to backfill.
#[derive(Debug, Clone, Default)]
pub struct BackfillOptions {
    /// SQL predicate on the outbox table (`--where`); `None` = every row.
    pub where_sql: Option<String>,
    /// SQL `ORDER BY` list (`--order-by`); `None` = the id column.
    pub order_by: Option<String>,
    /// Drop an existing, inactive slot and create the new one in its place (`--replace-slot`).
    pub replace_slot: bool,
}

/// Where a running backfill is, for the progress line.
#[derive(Debug, Clone, Copy)]
pub struct BackfillProgress {
    /// Rows handed to the sink.
    pub(crate) done: u64,
    /// Rows matching the predicate in the snapshot.
    pub(crate) total: u64,
    /// Time since the first row was read.
    pub(crate) elapsed: Duration,
}

impl BackfillProgress {
    /// Rows per second so far.
    pub(crate) fn rate(&self) -> f64 {
        self.done as f64 / self.elapsed.as_secs_f64().max(1e-3)
    }
}

impl std::fmt::Display for BackfillProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "backfill: {}/{} rows ({:.0}/s)",
            self.done,
            self.total,
            self.rate()
        )
    }
}

/// What a finished backfill did.
#[derive(Debug, Clone, Default)]
pub struct BackfillReport {
    /// What setup found and created (publication, stream), one line each.
    pub setup_lines: Vec<String>,
    /// Findings that did not stop the backfill, one line each.
    pub warnings: Vec<String>,
    /// The slot the backfill created (`postgres.slot`).
    pub slot: String,
    /// The slot's consistent point: `run` publishes every transaction committed from here on.
    pub consistent_point: Lsn,
    /// The `Outbox-Commit-Lsn` every backfilled message carries (consistent point − 1); their
    /// `Outbox-Position` is this LSN and the row's index in the cursor's order.
    pub commit_lsn: Lsn,
    /// The history the slot belongs to (named in every backfilled message's `Outbox-Position`), when the
    /// server told it.
    pub(crate) history: Option<History>,
    /// An existing slot was dropped first (`--replace-slot`).
    pub replaced_slot: bool,
    /// Rows matching the predicate in the snapshot.
    pub total: u64,
    /// Rows read and published (stored, duplicates and dead letters together).
    pub rows: u64,
    /// Newly stored.
    pub stored: u64,
    /// Dropped by JetStream: the stream already held an event with that id.
    pub duplicates: u64,
    /// Published to the dead-letter subject.
    pub dead_letters: u64,
    /// Setup, and the wait for a consistent point while the slot was created.
    pub slot_wait: Duration,
    /// From the first row read to the last ack.
    pub elapsed: Duration,
}

impl BackfillReport {
    /// Rows per second.
    pub fn rate(&self) -> f64 {
        self.rows as f64 / self.elapsed.as_secs_f64().max(1e-3)
    }
}

/// Why a backfill did not finish. One line naming the object and the fix.
#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    /// A setting the backfill cannot run with (`outbox.schemas` that does not load).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Setup failed: a check, or creating the publication or the stream.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// `--order-by` contains `;`.
    #[error(
        "--order-by {0:?} contains ';': give only the sort keys, e.g. --order-by \"created_at, event_id\""
    )]
    OrderBy(String),
    /// The slot exists and a walsender streams it.
    #[error(
        "replication slot {slot} is in use by PID {pid} (a relay streams it): backfill creates the slot anew and \
         must not run beside a relay; stop every relay for this slot (standbys too), then run backfill again. \
         Nothing was changed"
    )]
    SlotActive {
        /// The slot's name.
        slot: String,
        /// The process id of the walsender that streams it.
        pid: i32,
    },
    /// The slot exists, is inactive, and `--replace-slot` was not given.
    #[error(
        "replication slot {slot} already exists ({found}). backfill creates the slot at the snapshot it reads the \
         rows in, so it has to replace this one, and whatever the old slot still holds is then published only if \
         --where selects it. If that is what you want, stop every relay for this slot and run backfill again with \
         --replace-slot; if the slot is healthy, `outbox-relay run` needs no backfill. Nothing was changed"
    )]
    SlotExists {
        /// The slot's name.
        slot: String,
        /// What the slot is like: invalidated, or where it is confirmed up to.
        found: String,
    },
    /// Dropping the existing slot (`--replace-slot`) failed.
    #[error("cannot drop replication slot {slot} (to replace it)")]
    DropSlot {
        /// The slot's name.
        slot: String,
        /// The server's error.
        #[source]
        source: BoxError,
    },
    /// A connection to Postgres could not be opened.
    #[error("cannot connect to Postgres at {target} (check postgres.url)")]
    Postgres {
        /// `postgres.url`, with the password masked.
        target: String,
        /// Why the connection failed.
        #[source]
        source: SourceError,
    },
    /// Creating the slot with an exported snapshot failed.
    #[error(
        "cannot create replication slot {slot} with an exported snapshot (the role needs REPLICATION; see \
         sql/03_relay_role.sql)"
    )]
    CreateSlot {
        /// The slot's name.
        slot: String,
        /// Why it failed.
        #[source]
        source: SourceError,
    },
    /// The check of `--where` and `--order-by`, before any slot is touched, failed: no slot (and so no
    /// snapshot) exists for it yet, so the text must not say it read one.
    #[error("checking {what} on {table} failed, before any slot was created or changed: {message}")]
    Preflight {
        /// The outbox table.
        table: String,
        /// What was checked.
        what: String,
        /// The server's error.
        message: String,
    },
    /// A query reading the outbox table in the snapshot failed.
    #[error("reading {table} in the slot's snapshot failed ({what}): {message}")]
    Query {
        /// The outbox table.
        table: String,
        /// What the query was for.
        what: String,
        /// The server's error.
        message: String,
    },
    /// NATS cannot be reached or refuses the relay.
    #[error(transparent)]
    Nats(#[from] ConnectError),
    /// The stream's tail cannot be read.
    #[error(transparent)]
    Tail(#[from] TailError),
    /// Publishing failed part way; the new slot was dropped, the marker stays.
    #[error(
        "backfill stopped after {done} of {total} rows, and the slot it created was dropped; its marker on the \
         stream keeps `run` and `setup` from starting with a gap: fix the cause and run backfill again (JetStream \
         drops the rows it already holds)"
    )]
    Publish {
        /// Rows handed to the sink before the failure.
        done: u64,
        /// Rows to backfill.
        total: u64,
        /// Why publishing failed.
        #[source]
        source: SinkError,
    },
    /// The outbox stage could not interpret the rows fed to it.
    #[error("backfill")]
    Stage(#[from] StageError),
    /// SIGINT or SIGTERM before any slot was dropped or created.
    #[error("backfill stopped by {signal} before it changed any slot: nothing was changed")]
    StoppedEarly {
        /// The signal.
        signal: &'static str,
    },
    /// SIGINT or SIGTERM once a slot was dropped or created: the new slot was dropped, the marker
    /// stays.
    #[error(
        "backfill stopped by {signal} {progress}: {left}. To finish, run `{command}` again (JetStream drops the \
         rows it already holds)"
    )]
    Stopped {
        /// The signal.
        signal: &'static str,
        /// How far it got: `after 3000 of 30000 rows`, `while it created its slot`.
        progress: String,
        /// What is left: the marker, and the slot if it could not be dropped.
        left: String,
        /// The command that repeats this backfill.
        command: String,
    },
    /// The backfill marker could not be set (nothing was changed) or read.
    #[error(transparent)]
    Marker(#[from] MarkerError),
    /// Every row is stored and the slot is ready, but the marker could not be removed.
    #[error(
        "backfill stored every row and slot {slot} is ready, but its marker could not be removed, so `run` and \
         `setup` still refuse: fix the cause and run backfill again"
    )]
    MarkerLeft {
        /// The slot.
        slot: String,
        /// Why the marker stays.
        #[source]
        source: MarkerError,
    },
    /// More than `u32::MAX` rows match.
    #[error(
        "backfill of more than {} rows in one run: split it with --where",
        u32::MAX
    )]
    TooManyRows,
}

/// Runs a backfill: setup without the slot, the slot decision, the marker, a new slot with its
/// snapshot, the rows of that snapshot through the live pipeline, all acks, the marker removed.
/// `progress` is called about every two seconds while rows are published. Never stops early: see
/// [`backfill_until`].
pub async fn backfill(
    settings: &Settings,
    opts: BackfillOptions,
    progress: impl FnMut(BackfillProgress),
) -> Result<BackfillReport, BackfillError> {
    backfill_until(settings, opts, progress, std::future::pending()).await
}

/// [`backfill`], stopped when `stop` resolves (in the binary: SIGINT or SIGTERM, named by the value).
/// Stopped before it touched a slot, it changes nothing ([`BackfillError::StoppedEarly`]); stopped
/// later, it drops the slot it created and leaves the marker (`run` and `setup` refuse until a
/// backfill finishes), and says so ([`BackfillError::Stopped`]). A stop while the slot is being
/// created (Postgres waits there for the transactions that were running) cancels the creation.
pub async fn backfill_until(
    settings: &Settings,
    opts: BackfillOptions,
    progress: impl FnMut(BackfillProgress),
    stop: impl Future<Output = &'static str>,
) -> Result<BackfillReport, BackfillError> {
    backfill_over(
        settings,
        opts,
        progress,
        stop,
        &mut servers::Servers::new(settings),
    )
    .await
}

/// [`backfill_until`] over `servers`: the real ones, or the deterministic simulation's.
pub async fn backfill_over(
    settings: &Settings,
    opts: BackfillOptions,
    mut progress: impl FnMut(BackfillProgress),
    stop: impl Future<Output = &'static str>,
    servers: &mut dyn BackfillServers,
) -> Result<BackfillReport, BackfillError> {
    tokio::pin!(stop);
    check_options(settings, &opts)?;
    let slot = settings.config().postgres.slot.clone();
    let stopped_early = |signal| BackfillError::StoppedEarly { signal };
    let prepared = tokio::select! {
        biased;
        signal = &mut stop => return Err(stopped_early(signal)),
        p = servers.prepare() => p?,
    };
    let started = Instant::now();
    let ready = tokio::select! {
        biased;
        signal = &mut stop => Err(stopped_early(signal)),
        r = get_ready(settings, &prepared, &opts, servers) => r,
    };
    let Ready {
        control,
        nats,
        replace: replaced_slot,
    } = undo_on_error(servers, ready).await?;
    // From here until the last ack the slot may stand past rows the stream does not hold: the
    // marker says so to `run`, `setup` and `status`, also if this process is killed.
    let js: &dyn JetStreamPort = &*nats;
    let stream = settings.config().nats.stream.clone();
    let marker = Marker::new(
        &slot,
        opts.where_sql.as_deref(),
        opts.order_by.as_deref(),
        servers.now_micros(),
    );
    undo_on_error(
        servers,
        backfill_marker::set(js, &stream, &marker)
            .await
            .map_err(BackfillError::from),
    )
    .await?;
    // Dropping the old slot is not interrupted; creating the new one is cancelled by a stop
    // (Postgres may wait there a long time, for every transaction that was running).
    let created = async {
        if replaced_slot {
            drop_existing_slot(&*control, &slot).await?;
        }
        create_slot(settings, &*control, servers, stop.as_mut()).await
    };
    let creation = match created.await {
        Ok(c) => c,
        Err(e) => {
            // No slot was dropped: nothing changed, and the marker goes again (before what setup
            // created, the stream perhaps, is removed). With the old slot dropped, the marker stays:
            // only another backfill makes a slot with no gap.
            if !replaced_slot || matches!(e, BackfillError::DropSlot { .. }) {
                clear_marker(js, &stream, &marker).await;
                servers.undo().await;
            }
            return Err(e);
        }
    };
    let (repl, system, consistent_point, snapshot) = match creation {
        Creation::Done(new) => new,
        Creation::Stopped { signal, created } => {
            if let Some((repl, ..)) = created {
                repl.close().await;
            }
            // A slot the cancelled walsender may have finished after all goes too.
            let gone = abandon_slot(&*control, &slot).await;
            if gone && !replaced_slot {
                clear_marker(js, &stream, &marker).await;
                return Err(BackfillError::StoppedEarly { signal });
            }
            return Err(BackfillError::Stopped {
                signal,
                progress: "while it created its slot".to_owned(),
                left: left_after_stop(
                    &slot,
                    &stream,
                    if gone {
                        SlotLeft::OldDropped
                    } else {
                        SlotLeft::Kept
                    },
                ),
                command: marker.recovery_command(),
            });
        }
    };
    info!(%slot, %consistent_point, %snapshot, "slot created; reading the rows of its snapshot");
    // Creating the slot waits for every transaction that holds a transaction id on the server to
    // end; the rate is measured from here.
    let slot_wait = started.elapsed();
    let mut report = BackfillReport {
        setup_lines: prepared.lines.clone(),
        warnings: prepared.warnings.clone(),
        slot: slot.clone(),
        consistent_point,
        commit_lsn: Lsn(consistent_point.0.saturating_sub(1)),
        history: system.map(|s| History {
            system_id: s.system_id,
            timeline: s.timeline,
            slot: slot.clone(),
        }),
        replaced_slot,
        slot_wait,
        ..BackfillReport::default()
    };
    let handed = AtomicU64::new(0);
    let published = publish_snapshot(
        settings,
        &opts,
        &*control,
        nats.clone(),
        &snapshot,
        &mut report,
        &mut progress,
        &handed,
        servers.now_micros(),
    );
    let result = tokio::select! {
        biased;
        signal = &mut stop => Err(signal),
        r = published => Ok(r),
    };
    // The exported snapshot lived in the walsender's transaction; the cursor is done with it now.
    repl.close().await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            abandon_slot(&*control, &slot).await;
            return Err(e);
        }
        Err(signal) => {
            let gone = abandon_slot(&*control, &slot).await;
            return Err(BackfillError::Stopped {
                signal,
                progress: format!(
                    "after {} of {} rows",
                    handed.load(Ordering::Relaxed),
                    report.total
                ),
                left: left_after_stop(
                    &slot,
                    &stream,
                    if gone {
                        SlotLeft::NewDropped
                    } else {
                        SlotLeft::Kept
                    },
                ),
                command: marker.recovery_command(),
            });
        }
    }
    // Every row is stored: the slot has no gap behind it now.
    match backfill_marker::clear(js, &stream, &marker).await {
        Ok(true) => {}
        Ok(false) => warn!(
            %stream,
            "the backfill marker is no longer this backfill's (another backfill took over): left as it is"
        ),
        Err(source) => return Err(BackfillError::MarkerLeft { slot, source }),
    }
    // The rows are stored from the new slot's snapshot on: a stop mark left by the slot it replaced
    // (a client that consumed that slot, `slot_mark.rs`) shows a gap this backfill has filled.
    if let Err(e) = control.drop_stop_mark().await {
        warn!(
            error = %e,
            mark = %crate::slot_mark::name(&slot),
            "the replaced slot's stop mark could not be dropped: drop it with pg_drop_replication_slot"
        );
    }
    Ok(report)
}

/// What a backfill needs once it has decided about the slot.
struct Ready {
    /// The control connection: the snapshot's transaction, and dropping slots.
    control: Box<dyn Control>,
    /// The NATS connection to publish through.
    nats: NatsPort,
    /// The existing slot is to be dropped first.
    replace: bool,
}

/// Everything that can fail for a reason of the operator's making, tried before anything is
/// dropped or created: a typo in --where must leave a healthy slot as it was. Then the slot
/// decision, which a marker that stands for this slot takes part in.
async fn get_ready(
    settings: &Settings,
    prepared: &Prepared,
    opts: &BackfillOptions,
    servers: &mut dyn BackfillServers,
) -> Result<Ready, BackfillError> {
    let control = servers
        .control()
        .await
        .map_err(|source| BackfillError::Postgres {
            target: settings.conn.to_string(),
            source,
        })?;
    let nats = preflight(settings, opts, &*control, servers).await?;
    let standing = backfill_marker::read(&*nats, &settings.config().nats.stream)
        .await?
        .filter(|m| m.guards(&settings.config().postgres.slot));
    let replace = decide_slot(settings, prepared.slot.as_ref(), opts, standing.as_ref())?;
    Ok(Ready {
        control,
        nats,
        replace,
    })
}

/// Removes this backfill's marker when it stops before changing a slot; a failure is logged (the
/// marker then makes `run` refuse, and the next backfill removes it).
async fn clear_marker(js: &dyn JetStreamPort, stream: &str, marker: &Marker) {
    if let Err(e) = backfill_marker::clear(js, stream, marker).await {
        warn!(error = %e, "the backfill marker could not be removed: `run` refuses until a backfill finishes");
    }
}

/// What became of the slot when a backfill stopped.
#[derive(Clone, Copy)]
enum SlotLeft {
    /// The slot it created was dropped.
    NewDropped,
    /// The old slot was dropped (`--replace-slot`, or one an unfinished backfill left); no new
    /// one was made.
    OldDropped,
    /// A slot could not be dropped and is still there.
    Kept,
}

/// What a stopped backfill leaves, for [`BackfillError::Stopped`].
fn left_after_stop(slot: &str, stream: &str, what: SlotLeft) -> String {
    let marker = format!(
        "the backfill marker {} on stream {stream}, which keeps `run` and `setup` from starting until a backfill \
         finishes",
        backfill_marker::META_BACKFILL
    );
    match what {
        SlotLeft::NewDropped => {
            format!("the slot {slot} it created was dropped, and nothing is left but {marker}")
        }
        SlotLeft::OldDropped => format!(
            "the existing slot {slot} was dropped to be replaced and no new one was made, and nothing is left \
             but {marker}"
        ),
        SlotLeft::Kept => format!(
            "the slot {slot} could not be dropped (see the warning above); left are that slot and {marker}"
        ),
    }
}

/// Refuses what must not reach the database: schemas that did not load, `;` in `--order-by`.
fn check_options(settings: &Settings, opts: &BackfillOptions) -> Result<(), BackfillError> {
    // Rows must never go out unchecked because the contracts did not load (P8).
    settings.schemas_loaded()?;
    if let Some(o) = &opts.order_by
        && o.contains(';')
    {
        return Err(BackfillError::OrderBy(o.clone()));
    }
    Ok(())
}

/// Passes `result` through; on an error, first undoes what setup created.
async fn undo_on_error<T>(
    servers: &mut dyn BackfillServers,
    result: Result<T, BackfillError>,
) -> Result<T, BackfillError> {
    if result.is_err() {
        servers.undo().await;
    }
    result
}

/// Drops the existing slot (`--replace-slot`).
async fn drop_existing_slot(control: &dyn Control, slot: &str) -> Result<(), BackfillError> {
    control
        .drop_slot(slot.to_owned())
        .await
        .map_err(|source| BackfillError::DropSlot {
            slot: slot.to_owned(),
            source,
        })?;
    info!(%slot, "dropped the existing slot (--replace-slot)");
    Ok(())
}

/// The new slot: the replication connection (the snapshot lives as long as it does), the server's
/// history when it told it, the consistent point and the snapshot's name.
type NewSlot = (Box<dyn SlotMaker>, Option<SystemInfo>, Lsn, String);

/// How creating the slot ended.
enum Creation {
    /// The slot exists.
    Done(NewSlot),
    /// `stop` resolved meanwhile: the creation was cancelled, or had finished anyway (`created`).
    Stopped {
        /// The signal.
        signal: &'static str,
        /// The slot, when the cancel came too late.
        created: Option<NewSlot>,
    },
}

/// Opens the replication connection and creates the slot with an exported snapshot. A stop
/// meanwhile cancels the walsender's command (`pg_cancel_backend` on the control connection, the
/// same role): Postgres drops a slot it had not finished.
async fn create_slot(
    settings: &Settings,
    control: &dyn Control,
    servers: &mut dyn BackfillServers,
    stop: Pin<&mut impl Future<Output = &'static str>>,
) -> Result<Creation, BackfillError> {
    let slot = settings.config().postgres.slot.clone();
    let mut repl = servers
        .replication()
        .await
        .map_err(|source| BackfillError::Postgres {
            target: settings.conn.to_string(),
            source,
        })?;
    // The history the backfilled messages name, so the next run's replay recognises them as its
    // own. Without it (an old server's answer it cannot read) they carry none, and the run after the
    // backfill trusts nothing and republishes (JetStream drops the duplicates).
    let system = repl.identify_system().await;
    let walsender = repl.backend_pid();
    let (result, signal) = {
        let creating =
            repl.create_slot_with_snapshot(slot.clone(), settings.config().postgres.failover);
        tokio::pin!(creating);
        tokio::select! {
            biased;
            signal = stop => {
                if let Err(e) = control.cancel_backend(walsender).await {
                    warn!(error = %e, "could not cancel the slot's creation; waiting for it");
                }
                (creating.await, Some(signal))
            }
            r = &mut creating => (r, None),
        }
    };
    match (result, signal) {
        (Ok((lsn, snapshot)), None) => Ok(Creation::Done((repl, system, lsn, snapshot))),
        (Ok((lsn, snapshot)), Some(signal)) => Ok(Creation::Stopped {
            signal,
            created: Some((repl, system, lsn, snapshot)),
        }),
        (Err(_), Some(signal)) => {
            repl.close().await;
            Ok(Creation::Stopped {
                signal,
                created: None,
            })
        }
        (Err(source), None) => {
            repl.close().await;
            Err(BackfillError::CreateSlot { slot, source })
        }
    }
}

/// After a failed or stopped publish: ends the snapshot's transaction and drops the new slot.
/// Returns whether the slot is gone.
async fn abandon_slot(control: &dyn Control, slot: &str) -> bool {
    control.rollback().await;
    // Without the slot, `run` refuses (P9) instead of starting after rows that were never
    // published; the next backfill creates it again. The walsender that created it releases it a
    // moment after its connection closed: "is active for PID" (55006) is waited out, briefly.
    let deadline = Instant::now() + SLOT_RELEASE;
    loop {
        // Only if it exists: after a cancelled creation there may be none.
        match control.drop_slot_if_exists(slot.to_owned()).await {
            Ok(()) => return true,
            Err(e) if e.in_use && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(drop) => {
                warn!(%slot, error = %drop.message, "backfill stopped and the slot it created could not be dropped: run backfill again (it replaces the slot)");
                return false;
            }
        }
    }
}

/// Refuses an active slot, and an existing one without `--replace-slot`, unless an unfinished
/// backfill of this slot left it (its marker stands): that slot is replaced, as the marker's
/// recovery says. Returns whether to drop the existing slot.
fn decide_slot(
    settings: &Settings,
    existing: Option<&catalog::SlotRow>,
    opts: &BackfillOptions,
    standing: Option<&Marker>,
) -> Result<bool, BackfillError> {
    let slot = &settings.config().postgres.slot;
    let Some(s) = existing else {
        return Ok(false);
    };
    if s.active {
        return Err(BackfillError::SlotActive {
            slot: slot.clone(),
            pid: s.active_pid.unwrap_or(0),
        });
    }
    if opts.replace_slot {
        return Ok(true);
    }
    if let Some(m) = standing {
        info!(%slot, backfill = %m.origin(), "replacing the slot an unfinished backfill left");
        return Ok(true);
    }
    let found = match s.invalidated() {
        Some(reason) => format!("invalidated: {reason}"),
        None => format!(
            "inactive, confirmed up to {}, wal_status {}",
            s.confirmed_flush_lsn.as_deref().unwrap_or("-"),
            s.wal_status.as_deref().unwrap_or("-")
        ),
    };
    Err(BackfillError::SlotExists {
        slot: slot.clone(),
        found,
    })
}

/// What must work before the slot is touched: `--where` and `--order-by` planned against the table
/// (a zero-row query in a read-only transaction: a wrong column, a syntax error or a second statement
/// fails here), and a NATS connection. Returns the connection for the publishing.
async fn preflight(
    settings: &Settings,
    opts: &BackfillOptions,
    pg: &dyn Control,
    servers: &mut dyn BackfillServers,
) -> Result<NatsPort, BackfillError> {
    let table = settings.config().outbox.table.clone();
    let query = snapshot_query(settings, opts, "1");
    pg.preflight(format!("{query} LIMIT 0"))
        .await
        .map_err(|message| BackfillError::Preflight {
            table,
            what: "--where / --order-by".to_owned(),
            message,
        })?;
    servers.nats().await
}

/// `SELECT <columns> FROM <outbox table> WHERE (<--where>) ORDER BY <--order-by or the id column>`.
fn snapshot_query(settings: &Settings, opts: &BackfillOptions, columns: &str) -> String {
    let (schema, name) = settings.config().outbox.table_parts();
    let qualified = format!("{}.{}", quote_ident(schema), quote_ident(name));
    let predicate = opts.where_sql.as_deref().unwrap_or("true");
    let order = match &opts.order_by {
        Some(o) => o.clone(),
        None => quote_ident(&settings.config().outbox.id_column),
    };
    format!("SELECT {columns} FROM {qualified} WHERE ({predicate}) ORDER BY {order}")
}

/// Reads the rows in `snapshot` and publishes them; returns once every one is acknowledged.
/// `handed` counts the rows handed to the sink, for a stop that drops this future; `now` is the
/// rows' commit time.
#[allow(clippy::too_many_arguments)]
async fn publish_snapshot(
    settings: &Settings,
    opts: &BackfillOptions,
    pg: &dyn Control,
    nats: NatsPort,
    snapshot: &str,
    report: &mut BackfillReport,
    progress: &mut impl FnMut(BackfillProgress),
    handed: &AtomicU64,
    now: i64,
) -> Result<(), BackfillError> {
    let started = Instant::now();
    let table = settings.config().outbox.table.as_str();
    import_snapshot(pg, snapshot, table).await?;
    let columns = outbox_columns(settings, pg).await?;
    let total = count_rows(settings, opts, pg).await?;
    report.total = total;
    declare_cursor(settings, opts, pg, &columns).await?;
    let sink = start_sink(settings, nats, report).await?;
    let mut publisher = Publisher::begin(settings, report, columns, sink, total, (started, now))?;
    publisher.publish_rows(pg, table, progress, handed).await?;
    publisher.commit(report)?;
    publisher.await_acks().await?;
    pg.commit().await.map_err(query_error(table, "COMMIT"))?;
    publisher.report_progress(progress);
    let published = publisher.published;
    debug!(published, "backfill acknowledged");
    report.rows = published;
    report.stored = publisher.acked.stored;
    report.duplicates = publisher.acked.duplicates;
    report.dead_letters = publisher.acked.dead_letters;
    report.elapsed = started.elapsed();
    Ok(())
}

/// A failed query on the outbox table as [`BackfillError::Query`], saying what it was for.
fn query_error(table: &str, what: &str) -> impl FnOnce(String) -> BackfillError + use<> {
    let table = table.to_owned();
    let what = what.to_owned();
    move |message: String| BackfillError::Query {
        table,
        what,
        message,
    }
}

/// The outbox table as a quoted, schema-qualified name.
fn qualified_table(settings: &Settings) -> String {
    let (schema, name) = settings.config().outbox.table_parts();
    format!("{}.{}", quote_ident(schema), quote_ident(name))
}

/// Opens the read-only REPEATABLE READ transaction that sees the slot's exported snapshot.
async fn import_snapshot(
    pg: &dyn Control,
    snapshot: &str,
    table: &str,
) -> Result<(), BackfillError> {
    pg.import_snapshot(snapshot.to_owned())
        .await
        .map_err(query_error(table, "importing the slot's snapshot"))
}

/// Every column of the outbox table, in table order, as pgoutput sends them (generated columns are
/// not sent).
async fn outbox_columns(
    settings: &Settings,
    pg: &dyn Control,
) -> Result<Vec<Column>, BackfillError> {
    pg.columns(qualified_table(settings))
        .await
        .map_err(query_error(
            &settings.config().outbox.table,
            "reading its columns",
        ))
}

/// How many rows match `--where` in the snapshot; refuses more than `u32::MAX`.
async fn count_rows(
    settings: &Settings,
    opts: &BackfillOptions,
    pg: &dyn Control,
) -> Result<u64, BackfillError> {
    let qualified = qualified_table(settings);
    let predicate = opts.where_sql.as_deref().unwrap_or("true");
    let total: i64 = pg
        .count(format!(
            "SELECT count(*) FROM {qualified} WHERE ({predicate})"
        ))
        .await
        .map_err(query_error(&settings.config().outbox.table, "--where"))?;
    let total = total.max(0) as u64;
    if total > u64::from(u32::MAX) {
        return Err(BackfillError::TooManyRows);
    }
    Ok(total)
}

/// Declares the cursor over the matching rows (every column as text) and prepares its `FETCH`.
async fn declare_cursor(
    settings: &Settings,
    opts: &BackfillOptions,
    pg: &dyn Control,
    columns: &[Column],
) -> Result<(), BackfillError> {
    let table = settings.config().outbox.table.as_str();
    let select: Vec<String> = columns
        .iter()
        .map(|c| format!("{}::text", quote_ident(&c.name)))
        .collect();
    pg.declare_cursor(
        format!(
            "DECLARE {CURSOR} NO SCROLL CURSOR FOR {}",
            snapshot_query(settings, opts, &select.join(", "))
        ),
        format!("FETCH {FETCH_ROWS} FROM {CURSOR}"),
    )
    .await
    .map_err(|e| match e {
        CursorError::Declare(m) => query_error(table, "--where / --order-by")(m),
        CursorError::Fetch(m) => query_error(table, "FETCH")(m),
    })
}

/// Starts the sink the rows are published through: unfenced, never atomic.
async fn start_sink(
    settings: &Settings,
    nats: NatsPort,
    report: &BackfillReport,
) -> Result<Sink, BackfillError> {
    // Not fenced: the fence's expected sequences are for an ordered replay from the slot. Here,
    // rows the stream holds come back as duplicates that take no sequence, and every message
    // published behind one carries a stale expectation; the sink's repair resends them one at a
    // time, and a stale expectation can even match the tail by coincidence and store a row ahead
    // of those before it (measured: a rerun after a kill ended in a broken fence). The backfill does
    // not need it: every ack is awaited, any failure ends the backfill (and drops its slot), and a
    // rerun republishes everything, which JetStream deduplicates.
    //
    // Never atomic batches either (`nats.atomic_transactions`): a batch message cannot carry
    // `Nats-Msg-Id`, so a rerun would store every row again, and a snapshot is not a transaction
    // whose parts a consumer must see together. Each row is one publish with its id.
    let config = SinkConfig {
        fence: false,
        atomic: false,
        atomic_group: None,
        ..SinkConfig::from_settings(settings)
    };
    let origin = report.history.clone().map(|history| Origin {
        timelines: crate::source::TimelineHistory::root(history.timeline),
        history,
        wal_end: report.consistent_point,
    });
    Ok(Sink::start(nats, config, origin.as_ref(), None).await?)
}

/// The rows' way to the stream: the stage that makes events of them, the sink, and the counts.
struct Publisher {
    stage: OutboxStage,
    sink: Sink,
    commit_ts: i64,
    total: u64,
    published: u64,
    acked: Acked,
    started: Instant,
    last_progress: Instant,
}

impl Publisher {
    /// Feeds the stage the synthetic Begin and Relation the rows' Inserts belong to.
    fn begin(
        settings: &Settings,
        report: &BackfillReport,
        columns: Vec<Column>,
        sink: Sink,
        total: u64,
        (started, now): (Instant, i64),
    ) -> Result<Self, BackfillError> {
        let (schema, name) = settings.config().outbox.table_parts();
        // Checked like live events (outbox.schemas); the failures are counted nowhere: a backfill
        // reports its dead letters itself.
        let mut stage = OutboxStage::new(&settings.config().outbox)
            .with_schemas(&settings.schemas, Default::default());
        let commit_ts = now;
        let begin = Message::Begin {
            final_lsn: report.commit_lsn,
            commit_ts,
            xid: 0,
        };
        stage.step(begin)?;
        stage.step(Message::Relation(Relation {
            xid: None,
            id: RELATION_ID,
            namespace: schema.to_owned(),
            name: name.to_owned(),
            replica_identity: b'd',
            columns,
        }))?;
        Ok(Publisher {
            stage,
            sink,
            commit_ts,
            total,
            published: 0,
            acked: Acked::default(),
            started,
            last_progress: Instant::now(),
        })
    }

    /// Fetches the cursor's rows until it is exhausted and publishes each.
    async fn publish_rows(
        &mut self,
        pg: &dyn Control,
        table: &str,
        progress: &mut impl FnMut(BackfillProgress),
        handed: &AtomicU64,
    ) -> Result<(), BackfillError> {
        loop {
            let rows = pg.fetch().await.map_err(query_error(table, "FETCH"))?;
            let fetched = rows.len();
            for row in rows {
                self.publish_row(row, progress).await?;
                handed.store(self.published, Ordering::Relaxed);
            }
            if fetched < FETCH_ROWS as usize {
                return Ok(());
            }
        }
    }

    /// One row as a synthetic Insert through the stage and, when it makes an event, the sink;
    /// takes the acks that have come and reports progress when it is due.
    async fn publish_row(
        &mut self,
        row: Vec<Option<Bytes>>,
        progress: &mut impl FnMut(BackfillProgress),
    ) -> Result<(), BackfillError> {
        let new = row
            .into_iter()
            .map(|v| match v {
                Some(v) => TupleValue::Text(v),
                None => TupleValue::Null,
            })
            .collect();
        let msg = Message::Insert {
            xid: None,
            relation_id: RELATION_ID,
            new,
        };
        let Step::Event(event) = self.stage.step(msg)? else {
            return Ok(());
        };
        if let Err(e) = self.sink.submit(self.published, event).await {
            return Err(self.fail(e));
        }
        self.published += 1;
        // Acks are taken as they come, so the sink never holds more than the window.
        self.settle().await?;
        if self.last_progress.elapsed() >= PROGRESS_EVERY {
            self.last_progress = Instant::now();
            self.report_progress(progress);
        }
        Ok(())
    }

    /// Feeds the stage the synthetic Commit.
    fn commit(&mut self, report: &BackfillReport) -> Result<(), BackfillError> {
        self.stage.step(Message::Commit {
            flags: 0,
            commit_lsn: report.commit_lsn,
            end_lsn: report.consistent_point,
            commit_ts: self.commit_ts,
        })?;
        Ok(())
    }

    /// Waits until every published row is acknowledged.
    async fn await_acks(&mut self) -> Result<(), BackfillError> {
        while self.acked.total() < self.published {
            self.sink.ready().await;
            self.settle().await?;
        }
        Ok(())
    }

    /// Lets the sink settle and counts the acks it has.
    async fn settle(&mut self) -> Result<(), BackfillError> {
        if let Err(e) = self.sink.settle().await {
            return Err(self.fail(e));
        }
        while let Some(ack) = self.sink.acked() {
            self.acked.add(ack.outcome);
        }
        Ok(())
    }

    /// Publishing failed after the rows published so far.
    fn fail(&self, source: SinkError) -> BackfillError {
        BackfillError::Publish {
            done: self.published,
            total: self.total,
            source,
        }
    }

    /// Calls the progress callback with where the backfill is.
    fn report_progress(&self, progress: &mut impl FnMut(BackfillProgress)) {
        progress(BackfillProgress {
            done: self.published,
            total: self.total,
            elapsed: self.started.elapsed(),
        });
    }
}

/// Outcomes counted.
#[derive(Default)]
struct Acked {
    stored: u64,
    duplicates: u64,
    dead_letters: u64,
}

impl Acked {
    fn add(&mut self, o: Outcome) {
        match o {
            Outcome::Stored { duplicate: false } => self.stored += 1,
            Outcome::Stored { duplicate: true } | Outcome::AlreadyStored => self.duplicates += 1,
            Outcome::DeadLetter { .. } => self.dead_letters += 1,
        }
    }

    fn total(&self) -> u64 {
        self.stored + self.duplicates + self.dead_letters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line() {
        let p = BackfillProgress {
            done: 4200,
            total: 10000,
            elapsed: Duration::from_secs(2),
        };
        assert_eq!(p.to_string(), "backfill: 4200/10000 rows (2100/s)");
    }

    fn marker() -> Marker {
        Marker::new("outbox_relay", None, None, 0)
    }

    fn decide(
        existing: Option<&catalog::SlotRow>,
        replace_slot: bool,
        standing: Option<&Marker>,
    ) -> Result<bool, BackfillError> {
        let settings = crate::config::Config::default().validate().unwrap();
        let opts = BackfillOptions {
            replace_slot,
            ..BackfillOptions::default()
        };
        decide_slot(&settings, existing, &opts, standing)
    }

    #[test]
    fn a_slot_an_unfinished_backfill_left_is_replaced_without_the_option() {
        let idle = catalog::SlotRow::default();
        assert!(matches!(
            decide(Some(&idle), false, None),
            Err(BackfillError::SlotExists { .. })
        ));
        assert!(decide(Some(&idle), false, Some(&marker())).unwrap());
        assert!(decide(Some(&idle), true, None).unwrap());
        assert!(
            !decide(None, false, Some(&marker())).unwrap(),
            "no slot: nothing to drop"
        );
    }

    #[test]
    fn a_streamed_slot_is_refused_whatever_the_marker_says() {
        let active = catalog::SlotRow {
            active: true,
            active_pid: Some(4711),
            ..catalog::SlotRow::default()
        };
        for (replace, standing) in [(false, None), (true, None), (false, Some(marker()))] {
            assert!(matches!(
                decide(Some(&active), replace, standing.as_ref()),
                Err(BackfillError::SlotActive { pid: 4711, .. })
            ));
        }
    }

    #[test]
    fn a_stop_says_what_is_left_and_how_to_finish() {
        let e = BackfillError::Stopped {
            signal: "SIGTERM",
            progress: "after 3000 of 30000 rows".into(),
            left: left_after_stop("outbox_relay", "OUTBOX", SlotLeft::NewDropped),
            command: "outbox-relay backfill --where 'x'".into(),
        };
        let text = e.to_string();
        assert!(!text.contains('\n'), "{text}");
        assert!(
            text.starts_with("backfill stopped by SIGTERM after 3000 of 30000 rows"),
            "{text}"
        );
        assert!(
            text.contains("outbox_relay it created was dropped"),
            "{text}"
        );
        assert!(
            text.contains("outbox-relay.backfill on stream OUTBOX"),
            "{text}"
        );
        assert!(
            text.contains("run `outbox-relay backfill --where 'x'` again"),
            "{text}"
        );
        let kept = left_after_stop("outbox_relay", "OUTBOX", SlotLeft::Kept);
        assert!(kept.contains("could not be dropped"), "{kept}");
        let old = left_after_stop("outbox_relay", "OUTBOX", SlotLeft::OldDropped);
        assert!(old.contains("no new one was made"), "{old}");
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
