//! The sustained-load bench's writers: tokio-postgres connections committing outbox transactions on a
//! fixed schedule, pipelined so that the writers are not what bounds a phase.
//!
//! Transaction *t* (of `rate / per_txn` a second) is due at `start + t / txn_rate`; connection *c*
//! of *n* sends the transactions *t ≡ c (mod n)*. Each connection wakes every millisecond, sends every
//! transaction that is due, and keeps up to `pipeline` of them in flight at once (tokio-postgres
//! writes requests issued together in one go and the backend answers them in order), so one slow
//! commit does not hold up the schedule. A transaction is one statement in an implicit transaction:
//! one `INSERT` for one event, an `INSERT … SELECT unnest($1)` for several.
//!
//! The commit time of an event is the writer's wall clock read when its statement's answer has come
//! back: tokio-postgres' `execute` returns at the backend's ReadyForQuery, which follows the commit
//! of the implicit transaction, so this is the moment the application knows the event is committed.
//! Each row also carries, as `"t0"` in its payload, the database's `clock_timestamp()` while the
//! INSERT ran (µs): the moment of the change, before its commit, as a CDC vendor's `updated_at` is.
//! The writers run on a runtime of their own whose threads are named [`WRITER_THREAD`], so their CPU
//! is counted apart from the consumer's.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_postgres::{Client, NoTls, Statement};

/// About 200 bytes of jsonb, as in the drain bench.
const PAYLOAD: &str = r#"{"items": [{"qty": 2, "sku": "SKU-00000001", "price_cents": 1999}, {"qty": 1, "sku": "SKU-00000002", "price_cents": 4500}], "total_cents": 8498, "currency": "EUR", "customer_id": "cust-000042", "note": "leave at the door"}"#;

/// The payload key of the database's clock while the row was inserted, in µs since the epoch.
const CHANGE_KEY: &str = "t0";

/// The database's clock when the row of a published `payload` (the jsonb text the relay sends) was
/// inserted, in ns since the epoch: the number after `"t0": ` (jsonb puts the shortest keys first).
pub(crate) fn change_ns(payload: &[u8]) -> Option<i64> {
    let key = format!("\"{CHANGE_KEY}\": ");
    let at = payload
        .windows(key.len())
        .position(|w| w == key.as_bytes())?
        + key.len();
    let digits = payload[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    let us: i64 = std::str::from_utf8(&payload[at..at + digits])
        .ok()?
        .parse()
        .ok()?;
    Some(us * 1000)
}

/// Wall-clock nanoseconds since the epoch: the clock nats-server stamps stored messages with.
pub(crate) fn wall_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

/// The id of event `index` of `phase`: a uuid whose first group is the phase and whose last is the
/// event's number, so the consumer can tell which event a message is without a lookup.
pub(crate) fn event_id(phase: u32, index: usize) -> String {
    format!("{phase:08x}-0000-4000-8000-{index:012x}")
}

/// The event number of `id` when it is an id of `phase` ([`event_id`]).
pub(crate) fn event_index(id: &str, phase: u32) -> Option<usize> {
    let (head, tail) = id.split_at_checked(9)?;
    if head != format!("{phase:08x}-") {
        return None;
    }
    usize::from_str_radix(tail.rsplit('-').next()?, 16).ok()
}

/// What the writers are asked to do in one phase.
#[derive(Clone, Copy)]
pub(crate) struct Load {
    /// Events per second.
    pub(crate) rate: u64,
    pub(crate) per_txn: usize,
    pub(crate) secs: f64,
    pub(crate) phase: u32,
    /// Transactions in flight per connection at most.
    pub(crate) pipeline: usize,
}

impl Load {
    pub(crate) fn txns(&self) -> usize {
        (self.rate as f64 * self.secs / self.per_txn as f64).round() as usize
    }

    pub(crate) fn events(&self) -> usize {
        self.txns() * self.per_txn
    }

    fn txn_rate(&self) -> f64 {
        self.rate as f64 / self.per_txn as f64
    }
}

/// One writer connection, its backend's pid and its prepared INSERT.
pub(crate) struct Writer {
    client: Client,
    pub(crate) backend_pid: u32,
    insert: Statement,
}

/// `n` connections to `url`, each with the INSERT for `per_txn` events prepared. Run it on the
/// writers' runtime: the connections' tasks are spawned on the runtime it runs on.
pub(crate) async fn connect(url: String, n: usize, per_txn: usize) -> anyhow::Result<Vec<Writer>> {
    let payload = format!(
        "jsonb_build_object('{CHANGE_KEY}', (extract(epoch FROM clock_timestamp()) * 1000000)::int8) \
         || '{}'::jsonb",
        PAYLOAD.replace('\'', "''")
    );
    let sql = if per_txn == 1 {
        format!(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1::text::uuid, 'Order', $2, 'OrderPlaced', {payload})"
        )
    } else {
        format!(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT unnest($1::text[])::uuid, 'Order', $2, 'OrderPlaced', {payload}"
        )
    };
    let mut writers = Vec::with_capacity(n);
    for _ in 0..n {
        let (client, connection) = tokio_postgres::connect(&url, NoTls)
            .await
            .with_context(|| format!("connect to {url}"))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                eprintln!("writer connection ended: {e}");
            }
        });
        let pid: i32 = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await?
            .get(0);
        let insert = client.prepare(&sql).await?;
        writers.push(Writer {
            client,
            backend_pid: pid as u32,
            insert,
        });
    }
    Ok(writers)
}

/// How the writers did.
pub(crate) struct Written {
    pub(crate) txns: usize,
    /// From the schedule's start to the last commit.
    pub(crate) secs: f64,
    /// p99 of a transaction's round trip, sent → committed (queueing in the pipeline included).
    pub(crate) round_trip_p99_ms: f64,
    /// The most a transaction was sent after it was due: writers that keep the schedule stay near
    /// the 1 ms tick.
    pub(crate) behind_max_ms: f64,
}

/// Runs `load` on `writers` (one task per connection) from `start`, storing each event's commit time
/// in `commits` (wall-clock ns, by event number). Run it on the writers' runtime.
pub(crate) async fn write(
    writers: Vec<Writer>,
    load: Load,
    start: Instant,
    commits: Arc<Vec<AtomicI64>>,
) -> anyhow::Result<Written> {
    let n = writers.len().max(1);
    let mut tasks = Vec::with_capacity(n);
    for (c, writer) in writers.into_iter().enumerate() {
        let commits = Arc::clone(&commits);
        tasks.push(tokio::spawn(async move {
            run_connection(&writer, c, n, load, start, &commits).await
        }));
    }
    let (mut txns, mut round_trips, mut behind, mut last) = (0, Vec::new(), Duration::ZERO, start);
    for task in tasks {
        let conn = task.await??;
        txns += conn.txns;
        round_trips.extend(conn.round_trips_us);
        behind = behind.max(conn.behind_max);
        last = last.max(conn.last_commit);
    }
    round_trips.sort_unstable();
    let p99 = round_trips
        .get((round_trips.len() as f64 * 0.99) as usize)
        .or(round_trips.last())
        .map_or(f64::NAN, |&us| us as f64 / 1000.0);
    Ok(Written {
        txns,
        secs: last.saturating_duration_since(start).as_secs_f64(),
        round_trip_p99_ms: p99,
        behind_max_ms: behind.as_secs_f64() * 1000.0,
    })
}

struct ConnectionStats {
    txns: usize,
    round_trips_us: Vec<u32>,
    behind_max: Duration,
    last_commit: Instant,
}

/// Connection `c` of `n`: transactions `c, c + n, c + 2n, …`, each sent when due.
async fn run_connection(
    writer: &Writer,
    c: usize,
    n: usize,
    load: Load,
    start: Instant,
    commits: &[AtomicI64],
) -> anyhow::Result<ConnectionStats> {
    let (txns, txn_rate, per_txn) = (load.txns(), load.txn_rate(), load.per_txn);
    let send = |t: usize| async move {
        let sent = Instant::now();
        let first = t * per_txn;
        let aggregate = format!("order-{t}");
        if per_txn == 1 {
            let id = event_id(load.phase, first);
            writer
                .client
                .execute(&writer.insert, &[&id, &aggregate])
                .await?;
        } else {
            let ids: Vec<String> = (first..first + per_txn)
                .map(|i| event_id(load.phase, i))
                .collect();
            writer
                .client
                .execute(&writer.insert, &[&ids, &aggregate])
                .await?;
        }
        let committed = wall_ns();
        for slot in &commits[first..first + per_txn] {
            slot.store(committed, Ordering::Relaxed);
        }
        anyhow::Ok(sent.elapsed())
    };
    let mut stats = ConnectionStats {
        txns: 0,
        round_trips_us: Vec::with_capacity(txns / n + 1),
        behind_max: Duration::ZERO,
        last_commit: start,
    };
    let mut in_flight = FuturesUnordered::new();
    let mut tick = tokio::time::interval_at(start, Duration::from_millis(1));
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut next = c;
    while next < txns || !in_flight.is_empty() {
        tokio::select! {
            _ = tick.tick() => {}
            Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                let round_trip: Duration = done?;
                stats.txns += 1;
                stats.round_trips_us.push(round_trip.as_micros().min(u32::MAX as u128) as u32);
                stats.last_commit = Instant::now();
            }
        }
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(start).as_secs_f64();
        let due = ((elapsed * txn_rate) as usize + 1).min(txns);
        while next < due && in_flight.len() < load.pipeline {
            let due_at = start + Duration::from_secs_f64(next as f64 / txn_rate);
            stats.behind_max = stats.behind_max.max(now.saturating_duration_since(due_at));
            in_flight.push(send(next));
            next += n;
        }
    }
    Ok(stats)
}
