//! The polling relay the product replaces, built the way such relays are commonly built: an outbox
//! table with a nullable `published_at` and a partial index on the unpublished rows, and a loop that
//! locks the next 100 unpublished rows, publishes them, marks them published and commits; when a batch
//! comes back short it sleeps the poll interval (`@Scheduled(fixedDelay = …)`).
//!
//! One batch is one transaction:
//! `BEGIN; SELECT … WHERE published_at IS NULL ORDER BY created_at LIMIT 100 FOR UPDATE SKIP LOCKED;`
//! publish each row to JetStream (`Nats-Msg-Id` = event id) and await every ack;
//! `UPDATE … SET published_at = now() WHERE event_id = ANY($1); COMMIT`. The batch's publishes are
//! pipelined (sent, then the acks awaited), which is already kinder than the usual one-by-one loop.
//!
//! Also here: the database load of a period, from `pg_stat_user_tables` (the outbox table) and
//! `pg_stat_database` — the cost the relay avoids by reading the WAL instead of the table.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, context::PublishAckFuture};
use bytes::Bytes;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The poller's table (uuid, aggregate, type, jsonb payload, created_at, published_at) named like the
/// relay's, so the latency writers' INSERT fits both; and its index on the unpublished rows.
pub(crate) const TABLE_SQL: &str = "CREATE TABLE public.outbox (\n\
       event_id       uuid        PRIMARY KEY DEFAULT gen_random_uuid(),\n\
       aggregate_type text        NOT NULL,\n\
       aggregate_id   text        NOT NULL,\n\
       event_type     text        NOT NULL,\n\
       payload        jsonb       NOT NULL,\n\
       created_at     timestamptz NOT NULL DEFAULT now(),\n\
       published_at   timestamptz NULL,\n\
       publish_attempts integer   NOT NULL DEFAULT 0\n\
     );\n\
     CREATE INDEX ix_outbox_unpublished ON public.outbox (created_at) WHERE published_at IS NULL;";

pub(crate) const BATCH: i64 = 100;

/// What the poller did, counted by itself (pg_stat_statements needs shared_preload_libraries).
#[derive(Default)]
pub(crate) struct Counters {
    /// Polls (one transaction and one SELECT each).
    pub polls: AtomicU64,
    /// UPDATEs (one per non-empty batch).
    pub updates: AtomicU64,
    pub published: AtomicU64,
}

impl Counters {
    /// Statements against the outbox table so far.
    pub(crate) fn queries(&self) -> u64 {
        self.polls.load(Ordering::Relaxed) + self.updates.load(Ordering::Relaxed)
    }
}

/// A running poller; stops (between batches or during its sleep) when dropped or stopped.
pub(crate) struct Poller {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
    pub counters: Arc<Counters>,
}

impl Poller {
    pub(crate) fn start(
        client: tokio_postgres::Client,
        js: jetstream::Context,
        interval: Duration,
    ) -> Poller {
        let (stop, stopped) = watch::channel(false);
        let counters: Arc<Counters> = Arc::default();
        let task = tokio::spawn(run(client, js, interval, stopped, Arc::clone(&counters)));
        Poller {
            stop,
            task: Some(task),
            counters,
        }
    }

    /// Fails if the poller has failed.
    pub(crate) fn check(&mut self) -> anyhow::Result<()> {
        if self.task.as_ref().is_some_and(|t| t.is_finished()) {
            let task = self.task.take().expect("checked");
            return match futures_util::FutureExt::now_or_never(task) {
                Some(Ok(Err(e))) => Err(e.context("poller failed")),
                Some(Err(e)) => Err(anyhow::anyhow!("poller panicked: {e}")),
                _ => Err(anyhow::anyhow!("poller stopped")),
            };
        }
        Ok(())
    }

    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        match self.task.take() {
            Some(task) => task.await?,
            None => Ok(()),
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn run(
    client: tokio_postgres::Client,
    js: jetstream::Context,
    interval: Duration,
    mut stopped: watch::Receiver<bool>,
    counters: Arc<Counters>,
) -> anyhow::Result<()> {
    let select = client
        .prepare(&format!(
            "SELECT event_id::text, aggregate_type, aggregate_id, event_type, payload::text \
               FROM public.outbox WHERE published_at IS NULL \
              ORDER BY created_at LIMIT {BATCH} FOR UPDATE SKIP LOCKED"
        ))
        .await?;
    // text[] → uuid[] so the primary key index finds the rows.
    let update = client
        .prepare(
            "UPDATE public.outbox SET published_at = now() \
              WHERE event_id = ANY($1::text[]::uuid[])",
        )
        .await?;
    let mut acks: Vec<PublishAckFuture> = Vec::with_capacity(BATCH as usize);
    while !*stopped.borrow() {
        client.batch_execute("BEGIN").await?;
        let rows = client.query(&select, &[]).await?;
        counters.polls.fetch_add(1, Ordering::Relaxed);
        let mut ids: Vec<String> = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: String = row.get(0);
            let aggregate_type: String = row.get(1);
            let aggregate_id: String = row.get(2);
            let event_type: String = row.get(3);
            let payload: String = row.get(4);
            let mut h = HeaderMap::new();
            h.insert("Nats-Msg-Id", id.as_str());
            h.insert("Outbox-Event-Type", event_type);
            h.insert("Outbox-Aggregate-Type", aggregate_type.as_str());
            h.insert("Outbox-Aggregate-Id", aggregate_id);
            let publish = jetstream::message::PublishMessage::build()
                .headers(h)
                .payload(Bytes::from(payload));
            acks.push(
                js.send_publish(format!("outbox.{aggregate_type}"), publish)
                    .await?,
            );
            ids.push(id);
        }
        for ack in acks.drain(..) {
            ack.await?;
        }
        if !ids.is_empty() {
            client.execute(&update, &[&ids]).await?;
            counters.updates.fetch_add(1, Ordering::Relaxed);
        }
        client.batch_execute("COMMIT").await?;
        counters
            .published
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        if (rows.len() as i64) < BATCH {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stopped.changed() => {}
            }
        }
    }
    Ok(())
}

/// Counters of the outbox table and the database at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PgLoad {
    pub seq_scan: i64,
    pub idx_scan: i64,
    pub n_tup_upd: i64,
    pub n_tup_hot_upd: i64,
    /// A gauge (autovacuum lowers it), not a counter.
    pub n_dead_tup: i64,
    pub xact_commit: i64,
    /// Autovacuum runs on the outbox table.
    pub autovacuum_count: i64,
}

impl PgLoad {
    /// Backends publish their counters at most once a second (and an idle one after up to 10 s), so
    /// a period's delta can be off by about a second's worth at each end; the writers' connections
    /// are closed before the end snapshot, which flushes theirs.
    pub(crate) async fn read(client: &tokio_postgres::Client) -> anyhow::Result<PgLoad> {
        let row = client
            .query_one(
                "SELECT coalesce(t.seq_scan, 0), coalesce(t.idx_scan, 0), t.n_tup_upd, \
                        t.n_tup_hot_upd, t.n_dead_tup, d.xact_commit, t.autovacuum_count \
                   FROM pg_stat_user_tables t, pg_stat_database d \
                  WHERE t.relid = 'public.outbox'::regclass AND d.datname = current_database()",
                &[],
            )
            .await?;
        Ok(PgLoad {
            seq_scan: row.get(0),
            idx_scan: row.get(1),
            n_tup_upd: row.get(2),
            n_tup_hot_upd: row.get(3),
            n_dead_tup: row.get(4),
            xact_commit: row.get(5),
            autovacuum_count: row.get(6),
        })
    }

    pub(crate) fn delta(&self, before: &PgLoad) -> PgLoad {
        PgLoad {
            seq_scan: self.seq_scan - before.seq_scan,
            idx_scan: self.idx_scan - before.idx_scan,
            n_tup_upd: self.n_tup_upd - before.n_tup_upd,
            n_tup_hot_upd: self.n_tup_hot_upd - before.n_tup_hot_upd,
            n_dead_tup: self.n_dead_tup - before.n_dead_tup,
            xact_commit: self.xact_commit - before.xact_commit,
            autovacuum_count: self.autovacuum_count - before.autovacuum_count,
        }
    }

    pub(crate) fn json(&self) -> String {
        format!(
            r#"{{"seq_scan":{},"idx_scan":{},"n_tup_upd":{},"n_tup_hot_upd":{},"n_dead_tup":{},"xact_commit":{},"autovacuum_count":{}}}"#,
            self.seq_scan,
            self.idx_scan,
            self.n_tup_upd,
            self.n_tup_hot_upd,
            self.n_dead_tup,
            self.xact_commit,
            self.autovacuum_count
        )
    }
}
