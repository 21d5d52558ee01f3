//! The copy loop: the rows of the slot's snapshot, fetched through the cursor, become a synthetic
//! pgoutput Begin, Relation, one Insert per row and Commit, and go through the same [`OutboxStage`]
//! and [`Sink`] as live events; every ack is awaited and counted into the report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::debug;

use super::port::Control;
use super::snapshot::{
    FETCH_ROWS, count_rows, declare_cursor, import_snapshot, outbox_columns, query_error,
};
use super::{BackfillError, BackfillOptions, BackfillProgress, BackfillReport};
use crate::config::Settings;
use crate::nats::NatsPort;
use crate::outbox::{OutboxStage, Step};
use crate::pgoutput::{Column, Message, Relation, TupleValue};
use crate::sink::{Origin, Outcome, Sink, SinkConfig, SinkError};

/// How often the progress callback is called.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
/// The relation id of the synthetic Relation message (any value: it only pairs Relation and Insert).
const RELATION_ID: u32 = 1;

/// Reads the rows in `snapshot` and publishes them; returns once every one is acknowledged.
/// `handed` counts the rows handed to the sink, for a stop that drops this future; `now` is the
/// rows' commit time.
#[allow(clippy::too_many_arguments)]
pub(super) async fn publish_snapshot(
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
            again: String::new(),
            source: Box::new(source),
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
