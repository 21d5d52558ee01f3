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
//! its text form, as the walsender sends it) and goes through the same
//! [`OutboxStage`](crate::outbox::OutboxStage) and [`Sink`](crate::sink::Sink) as live events: same
//! subject, headers, `Nats-Msg-Id`, dead-letter rules and `bytea` handling.
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
//!
//! Layout, one role a file: `preflight.rs` (everything tried before a slot is touched), `slot.rs`
//! (the slot decision, creating and dropping slots), `snapshot.rs` (the queries on the outbox table
//! and the cursor), `publish.rs` (the copy loop through the stage and the sink), `report.rs` (the
//! progress line and the report), `error.rs` (why a backfill did not finish), `start.rs` (where a
//! backfill into a stream with no message begins its history, for `verify`); this file runs them
//! in order ([`backfill_over`]) and holds the marker's part.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tracing::{info, warn};

use crate::Lsn;
use crate::backfill_marker::{self, Marker};
use crate::config::Settings;
use crate::nats::JetStreamPort;
use crate::position::History;

mod error;
mod port;
mod preflight;
mod publish;
mod report;
mod servers;
mod slot;
mod snapshot;
mod start;

pub use error::BackfillError;
pub use port::{
    BackfillServers, BoxError, Control, CursorError, DropFailure, Prepared, QueryError, SlotMaker,
};
pub use report::{BackfillProgress, BackfillReport};
pub use start::Start;

use error::{SlotLeft, again, left_after_stop};
use preflight::{Ready, check_options, get_ready};
use publish::publish_snapshot;
use slot::{Creation, abandon_slot, create_slot, drop_existing_slot};

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
    let (prepared, started, ready) = prepare(settings, &opts, servers, stop.as_mut()).await?;
    let Ready {
        control,
        nats,
        replace: replaced_slot,
    } = ready;
    let stream = settings.config().nats.stream.clone();
    let marker = set_marker(servers, &*nats, &stream, &slot, &opts).await?;
    let run = Run {
        settings,
        opts: &opts,
        slot: &slot,
        stream: &stream,
        js: &*nats,
        marker: &marker,
        control: &*control,
    };
    let (repl, system, consistent_point, snapshot) =
        match run.new_slot(replaced_slot, servers, stop.as_mut()).await? {
            Creation::Done(new) => new,
            Creation::Stopped { signal, created } => {
                return Err(run.stopped_creating(replaced_slot, signal, created).await);
            }
        };
    info!(%slot, %consistent_point, %snapshot, "slot created; reading the rows of its snapshot");
    // Creating the slot waits for every transaction that holds a transaction id on the server to
    // end; the rate is measured from here.
    let mut report = first_report(&prepared, &slot, consistent_point, system, replaced_slot);
    report.slot_wait = started.elapsed();
    let handed = AtomicU64::new(0);
    let published = publish_snapshot(
        settings,
        &opts,
        run.control,
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
    let rows = format!(
        "after {} of {} rows",
        handed.load(Ordering::Relaxed),
        report.total
    );
    run.published(result, rows).await?;
    run.finish().await?;
    Ok(report)
}

/// The steps before anything changes, each cancelled by `stop`: setup's checks and what it
/// creates (`servers.prepare`), then the connections and the options' checks against the servers
/// (undoing what `prepare` created when they fail). Also returns when `prepare` ended, where the
/// slot's wait is measured from.
async fn prepare(
    settings: &Settings,
    opts: &BackfillOptions,
    servers: &mut dyn BackfillServers,
    mut stop: Pin<&mut impl Future<Output = &'static str>>,
) -> Result<(Prepared, Instant, Ready), BackfillError> {
    let prepared = tokio::select! {
        biased;
        signal = &mut stop => return Err(BackfillError::StoppedEarly { signal }),
        p = servers.prepare() => p?,
    };
    let started = Instant::now();
    let ready = tokio::select! {
        biased;
        signal = &mut stop => Err(BackfillError::StoppedEarly { signal }),
        r = get_ready(settings, &prepared, opts, servers) => r,
    };
    let ready = undo_on_error(servers, ready).await?;
    Ok((prepared, started, ready))
}

/// What the steps after the slot decision share: the settings and options, the slot, the stream
/// and the marker this backfill set, and the servers it reaches them through.
struct Run<'a> {
    settings: &'a Settings,
    opts: &'a BackfillOptions,
    slot: &'a str,
    stream: &'a str,
    js: &'a dyn JetStreamPort,
    marker: &'a Marker,
    control: &'a dyn Control,
}

impl Run<'_> {
    /// Drops the old slot (`replaced_slot`) and creates the new one. Dropping is not
    /// interrupted; creating is cancelled by a stop (Postgres may wait there a long time, for
    /// every transaction that was running).
    async fn new_slot(
        &self,
        replaced_slot: bool,
        servers: &mut dyn BackfillServers,
        stop: Pin<&mut impl Future<Output = &'static str>>,
    ) -> Result<Creation, BackfillError> {
        let created = async {
            if replaced_slot {
                drop_existing_slot(self.control, self.slot).await?;
            }
            create_slot(self.settings, self.control, servers, stop).await
        };
        let e = match created.await {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        // No slot was dropped: nothing changed, and the marker goes again (before what setup
        // created, the stream perhaps, is removed). With the old slot dropped, the marker stays:
        // only another backfill makes a slot with no gap.
        if !replaced_slot || matches!(e, BackfillError::DropSlot { .. }) {
            clear_marker(self.js, self.stream, self.marker).await;
            servers.undo().await;
        }
        Err(e)
    }

    /// A stop while the slot was being created: the slot the cancelled walsender may have
    /// finished after all goes too; with no old slot dropped, so does the marker, and nothing
    /// changed.
    async fn stopped_creating(
        &self,
        replaced_slot: bool,
        signal: &'static str,
        created: Option<slot::NewSlot>,
    ) -> BackfillError {
        if let Some((repl, ..)) = created {
            repl.close().await;
        }
        let gone = abandon_slot(self.control, self.slot).await;
        if gone && !replaced_slot {
            clear_marker(self.js, self.stream, self.marker).await;
            return BackfillError::StoppedEarly { signal };
        }
        BackfillError::Stopped {
            signal,
            progress: "while it created its slot".to_owned(),
            left: left_after_stop(
                self.slot,
                self.stream,
                if gone {
                    SlotLeft::OldDropped
                } else {
                    SlotLeft::Kept
                },
            ),
            command: again(self.settings, self.opts, false),
        }
    }

    /// How the rows' publishing ended (`Err`: a stop's signal, `rows` how far it got): a failure
    /// or a stop drops the new slot and says how to go on.
    async fn published(
        &self,
        result: Result<Result<(), BackfillError>, &'static str>,
        rows: String,
    ) -> Result<(), BackfillError> {
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                abandon_slot(self.control, self.slot).await;
                Err(match e {
                    BackfillError::Publish {
                        done,
                        total,
                        source,
                        ..
                    } => BackfillError::Publish {
                        done,
                        total,
                        again: again(self.settings, self.opts, false),
                        source,
                    },
                    e => e,
                })
            }
            Err(signal) => {
                let gone = abandon_slot(self.control, self.slot).await;
                Err(BackfillError::Stopped {
                    signal,
                    progress: rows,
                    left: left_after_stop(
                        self.slot,
                        self.stream,
                        if gone {
                            SlotLeft::NewDropped
                        } else {
                            SlotLeft::Kept
                        },
                    ),
                    command: again(self.settings, self.opts, false),
                })
            }
        }
    }

    /// Every row is stored, so the slot has no gap behind it now: the marker goes, and a stop
    /// mark left by the slot this one replaced (a client that consumed that slot, `slot_mark.rs`)
    /// shows a gap this backfill has filled, so it goes too.
    async fn finish(&self) -> Result<(), BackfillError> {
        match backfill_marker::clear(self.js, self.stream, self.marker).await {
            Ok(true) => {}
            Ok(false) => warn!(
                stream = %self.stream,
                "the backfill marker is no longer this backfill's (another backfill took over): left as it is"
            ),
            Err(source) => {
                return Err(BackfillError::MarkerLeft {
                    slot: self.slot.to_owned(),
                    again: again(self.settings, self.opts, false),
                    source,
                });
            }
        }
        if let Err(e) = self.control.drop_stop_mark().await {
            warn!(
                error = %e,
                mark = %crate::slot_mark::name(self.slot),
                "the replaced slot's stop mark could not be dropped: drop it with pg_drop_replication_slot"
            );
        }
        Ok(())
    }
}

/// From here until the last ack the slot may stand past rows the stream does not hold: the marker
/// says so to `run`, `setup` and `status`, also if this process is killed. Set before any slot is
/// touched (a failure undoes what setup created), with where this backfill begins the stream's
/// history.
async fn set_marker(
    servers: &mut dyn BackfillServers,
    js: &dyn JetStreamPort,
    stream: &str,
    slot: &str,
    opts: &BackfillOptions,
) -> Result<Marker, BackfillError> {
    let now = servers.now_micros();
    let marker = Marker::new(
        slot,
        opts.where_sql.as_deref(),
        opts.order_by.as_deref(),
        now,
    );
    undo_on_error(
        servers,
        backfill_marker::set(js, stream, &marker)
            .await
            .map_err(BackfillError::from),
    )
    .await?;
    record_start(js, stream, &marker, now).await;
    Ok(marker)
}

/// The report as the slot's creation leaves it: what setup said, the slot, its consistent point
/// and history, whether it replaced one; the rows' counts come as they are published.
fn first_report(
    prepared: &Prepared,
    slot: &str,
    consistent_point: Lsn,
    system: Option<crate::source::SystemInfo>,
    replaced_slot: bool,
) -> BackfillReport {
    BackfillReport {
        setup_lines: prepared.lines.clone(),
        warnings: prepared.warnings.clone(),
        slot: slot.to_owned(),
        consistent_point,
        commit_lsn: Lsn(consistent_point.0.saturating_sub(1)),
        history: system.map(|s| History {
            system_id: s.system_id,
            timeline: s.timeline,
            slot: slot.to_owned(),
        }),
        replaced_slot,
        ..BackfillReport::default()
    }
}

/// Records where this backfill begins the stream's history, when the stream holds no message
/// (`start.rs`: `verify` leaves out the rows created before it that it did not select). A failure
/// is logged, not fatal: it costs `verify` that knowledge, nothing else.
async fn record_start(js: &dyn JetStreamPort, stream: &str, marker: &Marker, now: i64) {
    match start::record(js, stream, marker, now).await {
        Ok(Some(s)) => info!(
            %stream,
            sequence = s.sequence,
            "this backfill begins the stream's history (metadata outbox-relay.start)"
        ),
        Ok(None) => {}
        Err(e) => warn!(
            %stream,
            error = %e,
            "where this backfill begins the stream's history could not be recorded: verify will count the rows \
             its --where leaves out as missing"
        ),
    }
}

/// Removes this backfill's marker when it stops before changing a slot; a failure is logged (the
/// marker then makes `run` refuse, and the next backfill removes it).
async fn clear_marker(js: &dyn JetStreamPort, stream: &str, marker: &Marker) {
    if let Err(e) = backfill_marker::clear(js, stream, marker).await {
        warn!(error = %e, "the backfill marker could not be removed: `run` refuses until a backfill finishes");
    }
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
