//! The promises (docs/guarantees.md) under attack. Each fault test writes events with increasing ids
//! from one writer (so commit order is id order), breaks something while the relay runs, repairs it,
//! and then judges the stream by three invariants: every committed event stored (P1), no id stored
//! twice (P3), stream order = commit order (P4). Each prints one row of the fault matrix:
//! `FAULT-MATRIX | fault | runs | events | lost | duplicates stored | order kept`.
//!
//! - `crash`: kill -9 of the relay, NATS stopped or killed, Postgres restarted or killed, a standby
//!   relay taking over, a huge transaction (P6), an invalidated slot.
//! - `network`: a proxy between the relay and NATS or Postgres cuts connections or turns into a black
//!   hole.
//! - `late_publish`: a message stored in the place one of the relay's publishes expected, while
//!   later ones are on their way: nothing of the relay's is stored past the refused one.
//! - `operator`: the stream deleted and recreated under the relay.
//! - `bad_input`: events that cannot be published as they are end as dead letters (P7), or stop the
//!   relay with `on_invalid = "stop"`.

mod bad_input;
mod crash;
mod late_publish;
mod network;
mod operator;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use crate::support::{PgServer, Stored, TEXT_ID_OUTBOX_SQL, TestDb, read_all, stream_count};

/// A database on `server` with the text-id outbox table.
/// Waits (30 s at most) until the relay under test has created its slot. A slot shows in
/// `pg_replication_slots` before its consistent point is found; rows inserted before then are not
/// decoded, so it waits for `confirmed_flush_lsn` too.
pub(crate) async fn wait_for_slot(client: &tokio_postgres::Client, slot: &str) {
    crate::support::wait_for("the slot", Duration::from_secs(30), || async {
        crate::support::confirmed_flush(client, slot)
            .await
            .is_some()
    })
    .await;
}

pub(crate) async fn text_id_db(server: &PgServer) -> TestDb {
    let db = TestDb::create(server).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    db
}

/// `e-000001`, `e-000002`, …: readable, and sorting as text sorts by number.
pub(crate) fn event_id(prefix: &str, n: u64) -> String {
    format!("{prefix}-{n:06}")
}

/// What the invariant check measured.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tally {
    pub events: usize,
    pub stored: usize,
    pub lost: usize,
    pub duplicates: usize,
    pub order_kept: bool,
}

impl Tally {
    /// Prints the fault-matrix row for `fault`.
    pub(crate) fn report(&self, fault: &str, runs: usize) {
        eprintln!(
            "FAULT-MATRIX | {fault} | {runs} | {} | {} | {} | {} | stream held {}",
            self.events,
            self.lost,
            self.duplicates,
            if self.order_kept { "yes" } else { "NO" },
            self.stored
        );
    }
}

/// Measures the three invariants for `expected` (ids in commit order) against `stored` (stream order);
/// messages with other ids are ignored.
pub(crate) fn tally(stored: &[Stored], expected: &[String]) -> Tally {
    let position: HashMap<&str, usize> = expected
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), i))
        .collect();
    let mut seen = vec![0usize; expected.len()];
    let mut order_kept = true;
    let mut last: Option<usize> = None;
    for m in stored {
        let Some(&p) = position.get(m.id()) else {
            continue;
        };
        seen[p] += 1;
        if seen[p] == 1 {
            if last.is_some_and(|l| p < l) {
                order_kept = false;
            }
            last = Some(p);
        }
    }
    // Commit LSNs never go backwards in the stream (also holds for several writers).
    for w in stored.windows(2) {
        if w[0].headers.contains_key("Outbox-Commit-Lsn")
            && w[1].headers.contains_key("Outbox-Commit-Lsn")
            && w[1].commit_lsn() < w[0].commit_lsn()
        {
            order_kept = false;
        }
    }
    Tally {
        events: expected.len(),
        stored: stored.len(),
        lost: seen.iter().filter(|&&n| n == 0).count(),
        duplicates: seen.iter().map(|&n| n.saturating_sub(1)).sum(),
        order_kept,
    }
}

/// The invariant check: waits (up to `timeout`) until the stream holds at least every expected
/// event, then reads it all and asserts P1 (every committed event stored), P3 (no Nats-Msg-Id stored
/// twice) and P4 (stream order = commit order, commit LSNs non-decreasing).
pub(crate) async fn assert_all_stored_once_in_order(
    js: &async_nats::jetstream::Context,
    stream: &str,
    expected_ids_in_commit_order: &[String],
) -> Tally {
    assert_all_stored_once_in_order_within(
        js,
        stream,
        expected_ids_in_commit_order,
        Duration::from_secs(60),
    )
    .await
}

pub(crate) async fn assert_all_stored_once_in_order_within(
    js: &async_nats::jetstream::Context,
    stream: &str,
    expected: &[String],
    timeout: Duration,
) -> Tally {
    let deadline = Instant::now() + timeout;
    while stream_count(js, stream).await < expected.len() as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Anything still in flight (a late duplicate) would show up now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stored = read_all(js, stream).await;
    let t = tally(&stored, expected);
    let missing: Vec<&str> = {
        let got: std::collections::HashSet<&str> = stored.iter().map(Stored::id).collect();
        expected
            .iter()
            .map(String::as_str)
            .filter(|id| !got.contains(id))
            .take(10)
            .collect()
    };
    assert_eq!(
        t.lost,
        0,
        "P1: {} of {} committed events not stored, e.g. {missing:?} ({} stored)",
        t.lost,
        expected.len(),
        stored.len()
    );
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for m in &stored {
        *counts.entry(m.id()).or_default() += 1;
    }
    let dups: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).take(10).collect();
    assert!(dups.is_empty(), "P3: ids stored more than once: {dups:?}");
    if !t.order_kept {
        // Messages of other writers (no commit LSN) are shown, not compared.
        let lsn = |m: &Stored| m.headers.get("Outbox-Commit-Lsn").map(|_| m.commit_lsn());
        let at = stored
            .windows(2)
            .position(|w| {
                w[1].id() < w[0].id()
                    || matches!((lsn(&w[0]), lsn(&w[1])), (Some(a), Some(b)) if b < a)
            })
            .unwrap_or(0);
        let around: Vec<String> = stored[at.saturating_sub(5)..(at + 8).min(stored.len())]
            .iter()
            .map(|m| {
                format!(
                    "seq {} {} @{}",
                    m.seq,
                    m.id(),
                    m.headers
                        .get("Outbox-Commit-Lsn")
                        .map_or("-", String::as_str)
                )
            })
            .collect();
        panic!(
            "P4: stream order is not commit order near stream seq {}: {around:#?}",
            at + 1
        );
    }
    t
}

/// One application writer: commits one event per transaction, ids `<prefix>-000001`, … in order, at
/// about `per_sec` events a second, until stopped. It survives Postgres going away: it reconnects,
/// and after an error whose outcome is unknown it looks the id up, so its list is exactly the
/// committed events, in commit order.
pub(crate) struct Writer {
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    handle: JoinHandle<Vec<String>>,
}

impl Writer {
    pub(crate) fn start(url: String, prefix: &str, per_sec: u64) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let (s, p, prefix) = (Arc::clone(&stop), Arc::clone(&paused), prefix.to_owned());
        let handle = tokio::spawn(async move {
            let interval = Duration::from_micros(1_000_000 / per_sec.max(1));
            let mut committed = Vec::new();
            let mut client: Option<tokio_postgres::Client> = None;
            let mut n = 1u64;
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !s.load(Ordering::SeqCst) {
                tick.tick().await;
                if p.load(Ordering::SeqCst) {
                    continue;
                }
                let c = match &client {
                    Some(c) if !c.is_closed() => c,
                    _ => match connect(&url).await {
                        Some(c) => client.insert(c),
                        None => {
                            client = None;
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                    },
                };
                let id = event_id(&prefix, n);
                let payload = format!(r#"{{"n": {n}}}"#);
                let ok = c
                    .execute(
                        "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                         VALUES ($1, 'Claim', $2, 'ClaimApproved', $3::text::jsonb)",
                        &[&id, &n.to_string(), &payload],
                    )
                    .await
                    .is_ok();
                if !ok {
                    // Committed or not? Ask once Postgres answers again.
                    let exists = loop {
                        if let Some(c) = connect(&url).await {
                            match c
                                .query_opt(
                                    "SELECT 1 FROM public.outbox WHERE event_id = $1",
                                    &[&id],
                                )
                                .await
                            {
                                Ok(row) => {
                                    let e = row.is_some();
                                    client = Some(c);
                                    break e;
                                }
                                Err(_) => continue,
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    };
                    if !exists {
                        continue;
                    }
                }
                committed.push(id);
                n += 1;
            }
            committed
        });
        Writer {
            stop,
            paused,
            handle,
        }
    }

    pub(crate) fn pause(&self, on: bool) {
        self.paused.store(on, Ordering::SeqCst);
    }

    /// Stops writing; the committed ids in commit order.
    pub(crate) async fn stop(self) -> Vec<String> {
        self.stop.store(true, Ordering::SeqCst);
        tokio::time::timeout(Duration::from_secs(90), self.handle)
            .await
            .expect("writer stops")
            .expect("writer task")
    }
}

async fn connect(url: &str) -> Option<tokio_postgres::Client> {
    let (client, connection) = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_postgres::connect(url, tokio_postgres::NoTls),
    )
    .await
    .ok()?
    .ok()?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Some(client)
}

/// Writes `n` single-event transactions `<prefix>-000001…` with one `DO` block; returns their ids.
pub(crate) fn write_backlog(db: &TestDb, prefix: &str, n: u64) -> Vec<String> {
    db.psql(&format!(
        "DO $$ BEGIN
           FOR i IN 1..{n} LOOP
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('{prefix}-' || lpad(i::text, 6, '0'), 'Claim', i::text, 'ClaimApproved',
                     jsonb_build_object('n', i));
             COMMIT;
           END LOOP;
         END $$;"
    ));
    (1..=n).map(|i| event_id(prefix, i)).collect()
}

/// A small deterministic generator (no `rand` dependency); the seed is printed so a run repeats.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn from_clock() -> Rng {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            | 1;
        eprintln!("rng seed {seed}");
        Rng(seed)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
}
