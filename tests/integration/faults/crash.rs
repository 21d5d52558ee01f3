//! Processes dying: the relay (kill -9 at random points of a backlog; a standby taking over), NATS
//! (stopped for 20 s, killed), Postgres (restarted, killed), plus a transaction far bigger than the
//! relay's memory bound (P6) and a slot Postgres invalidated.

use std::time::{Duration, Instant};

use tokio::task::block_in_place;

use super::{
    Rng, Writer, assert_all_stored_once_in_order, assert_all_stored_once_in_order_within, event_id,
    text_id_db, wait_for_slot, write_backlog,
};
use crate::support::{
    InProcessRelay, NatsServer, PgServer, RelayProcess, confirmed_flush, read_all, relay_config,
    relay_env, run_command, stream_count, wait_for,
};

/// The long CI step (`FAULTS_LONG=1`, see .ci/run) runs the full sizes (50k backlog, 10 kills, NATS
/// down 60 s); the normal suite runs smaller ones to stay quick.
fn long() -> bool {
    std::env::var_os("FAULTS_LONG").is_some()
}

/// Events in the kill -9 backlog.
fn kill_backlog() -> u64 {
    if long() { 50_000 } else { 20_000 }
}

/// SIGKILLs while it drains.
fn kill_points() -> u64 {
    if long() { 10 } else { 5 }
}

/// How long NATS stays down under steady writes.
fn nats_down() -> Duration {
    Duration::from_secs(if long() { 60 } else { 20 })
}
/// Events in the one big transaction of the P6 test, and the memory bound it must stay under.
pub(super) const BIG_TXN_EVENTS: u64 = 200_000;
pub(super) const RSS_LIMIT_KB: u64 = 64 * 1024;

/// P1/P3/P4 across SIGKILLs: the relay binary is killed at `kill_points()` random points while a
/// `kill_backlog()` backlog drains, and restarted each time from the slot's confirmed position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_points_while_a_backlog_drains() {
    let (kill_backlog, kill_points) = (kill_backlog(), kill_points());
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let stream = config.nats.stream.clone();
    let slot = config.postgres.slot.clone();
    let mut env = relay_env(&config);
    let setup = run_command(&["setup"], &env, Duration::from_secs(60));
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let expected = block_in_place(|| write_backlog(&db, "k", kill_backlog));
    // Frequent status updates, so each kill lands after the slot moved.
    env.push((
        "OUTBOX_RELAY_POSTGRES_STATUS_INTERVAL_MS".into(),
        "100".into(),
    ));
    let js = nats.jetstream().await;
    let client = db.client().await;
    let mut rng = Rng::from_clock();
    let started = Instant::now();
    let mut kills = Vec::new();
    for k in 1..=kill_points {
        let span = kill_backlog / (kill_points + 1);
        let target = span * k + rng.below(span / 2) - span / 4;
        let mut relay = RelayProcess::spawn(&["run"], &env);
        let deadline = Instant::now() + Duration::from_secs(60);
        while stream_count(&js, &stream).await < target {
            assert!(relay.is_running(), "relay exited: {}", relay.stderr());
            assert!(Instant::now() < deadline, "stuck below {target}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(200))).await;
        relay.signal("KILL");
        assert!(relay.wait(Duration::from_secs(10)).is_some(), "SIGKILL");
        let stored = stream_count(&js, &stream).await;
        let confirmed = confirmed_flush(&client, &slot).await.expect("slot");
        eprintln!("kill {k}: {stored} stored, slot confirmed {confirmed}");
        kills.push(stored);
    }
    assert!(
        kills.iter().any(|&n| n < kill_backlog),
        "every kill came after the backlog drained: {kills:?}"
    );
    let mut last = RelayProcess::spawn(&["run"], &env);
    let t =
        assert_all_stored_once_in_order_within(&js, &stream, &expected, Duration::from_secs(90))
            .await;
    last.signal("TERM");
    let status = last.wait(Duration::from_secs(15)).expect("exit on SIGTERM");
    assert!(status.success(), "{}", last.stderr());
    eprintln!(
        "kill -9 x{kill_points}: stored at kills {kills:?}, {:?} in all",
        started.elapsed()
    );
    t.report(
        &format!("relay kill -9 at {kill_points} random points, {kill_backlog} backlog"),
        kill_points as usize + 1,
    );
}

/// NATS stopped (20 s; 60 s in the long step) while the application writes ~50 events/s, then
/// started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_stopped_under_steady_writes() {
    let down = nats_down();
    nats_outage(
        &format!("nats stopped {} s under 50 ev/s", down.as_secs()),
        down,
        false,
    )
    .await;
}

/// nats-server SIGKILLed (no shutdown) under writes, restarted after 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_killed_and_restarted_under_steady_writes() {
    nats_outage(
        "nats-server kill -9 + restart",
        Duration::from_secs(5),
        true,
    )
    .await;
}

async fn nats_outage(fault: &str, outage: Duration, kill: bool) {
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let stream = config.nats.stream.clone();
    let relay = InProcessRelay::start(config.clone());
    let client = db.client().await;
    wait_for_slot(&client, &config.postgres.slot).await;
    let writer = Writer::start(db.url(), "e", 50);
    tokio::time::sleep(Duration::from_secs(3)).await;
    block_in_place(|| if kill { nats.kill() } else { nats.stop() });
    tokio::time::sleep(outage).await;
    block_in_place(|| nats.start_again());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let expected = writer.stop().await;
    let js = nats.jetstream().await;
    let t =
        assert_all_stored_once_in_order_within(&js, &stream, &expected, Duration::from_secs(60))
            .await;
    t.report(fault, 1);
    relay.stop().await.expect("relay stops cleanly");
}

/// Postgres restarted (fast shutdown) under writes, then killed (SIGKILL, crash recovery) and
/// started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_and_killed_under_steady_writes() {
    let pg = PgServer::start_private();
    let db = text_id_db(&pg).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let stream = config.nats.stream.clone();
    let relay = InProcessRelay::start(config.clone());
    {
        let client = db.client().await;
        wait_for_slot(&client, &config.postgres.slot).await;
    }
    let writer = Writer::start(db.url(), "e", 50);
    tokio::time::sleep(Duration::from_secs(3)).await;
    block_in_place(|| pg.restart());
    tokio::time::sleep(Duration::from_secs(5)).await;
    block_in_place(|| pg.kill());
    tokio::time::sleep(Duration::from_secs(1)).await;
    block_in_place(|| pg.start());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let expected = writer.stop().await;
    let js = nats.jetstream().await;
    let t =
        assert_all_stored_once_in_order_within(&js, &stream, &expected, Duration::from_secs(60))
            .await;
    t.report("postgres restart, then kill -9 + start, under 50 ev/s", 1);
    relay.stop().await.expect("relay stops cleanly");
}

/// docs/operations.md#deployment-topologies: a second relay on the same slot waits as a standby (it
/// does not stream), and takes
/// over within ~10 s of the active one's SIGKILL; events written after the kill arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_waits_and_takes_over_after_kill_9() {
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let stream = config.nats.stream.clone();
    let env = relay_env(&config);
    let client = db.client().await;
    let js = nats.jetstream().await;
    let insert = |from: u64, to: u64| {
        let client = &client;
        async move {
            let mut ids = Vec::new();
            for n in from..=to {
                let id = event_id("e", n);
                client
                    .execute(
                        "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                         VALUES ($1, 'Claim', $2, 'ClaimApproved', '{}')",
                        &[&id, &n.to_string()],
                    )
                    .await
                    .expect("insert");
                ids.push(id);
            }
            ids
        }
    };

    let mut a = RelayProcess::spawn(&["run"], &env);
    wait_for_slot(&client, &config.postgres.slot).await;
    let mut expected = insert(1, 20).await;
    wait_for("A to deliver", Duration::from_secs(30), || async {
        stream_count(&js, &stream).await >= 20
    })
    .await;
    let mut b = RelayProcess::spawn(&["run"], &env);
    tokio::time::sleep(Duration::from_secs(5)).await;
    expected.extend(insert(21, 40).await);
    wait_for("A to deliver more", Duration::from_secs(30), || async {
        stream_count(&js, &stream).await >= 40
    })
    .await;
    assert!(b.is_running(), "standby exited: {}", b.stderr());
    let b_log = plain(&b.stderr());
    assert!(
        b_log.contains("standby") && b_log.contains("waiting"),
        "standby log says it waits: {b_log}"
    );
    assert!(
        !b_log.contains("streaming"),
        "the standby streamed while A held the slot: {b_log}"
    );

    a.signal("KILL");
    assert!(a.wait(Duration::from_secs(10)).is_some(), "SIGKILL A");
    let killed = Instant::now();
    expected.extend(insert(41, 60).await);
    wait_for("B to take over", Duration::from_secs(30), || async {
        stream_count(&js, &stream).await >= 60
    })
    .await;
    let takeover = killed.elapsed();
    assert!(
        takeover < Duration::from_secs(12),
        "B took {takeover:?} to deliver after A's kill: {}",
        b.stderr()
    );
    let b_log = plain(&b.stderr());
    assert!(b_log.contains("streaming"), "{b_log}");
    let t = assert_all_stored_once_in_order(&js, &stream, &expected).await;
    eprintln!("standby took over and delivered {takeover:?} after the kill");
    t.report("active relay kill -9, standby takes over", 2);
    b.signal("TERM");
    assert!(b.wait(Duration::from_secs(15)).is_some_and(|s| s.success()));
}

/// P6: one transaction of 200,000 events (~300-byte payloads, ~60 MB) through the relay binary; all
/// stored once, in order, and the relay's peak RSS stays within 64 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_transaction_of_200k_events_in_bounded_memory() {
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let stream = config.nats.stream.clone();
    let client = db.client().await;
    let mut relay = RelayProcess::run(&config);
    wait_for_slot(&client, &config.postgres.slot).await;
    let started = Instant::now();
    block_in_place(|| {
        db.psql(&format!(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT 'big-' || lpad(i::text, 6, '0'), 'Claim', i::text, 'ClaimApproved',
                    jsonb_build_object('n', i, 'pad', repeat('x', 270))
             FROM generate_series(1, {BIG_TXN_EVENTS}) i"
        ))
    });
    let written = started.elapsed();
    let js = nats.jetstream().await;
    let deadline = Instant::now() + Duration::from_secs(150);
    while stream_count(&js, &stream).await < BIG_TXN_EVENTS {
        assert!(relay.is_running(), "relay exited: {}", relay.stderr());
        assert!(
            Instant::now() < deadline,
            "only {} of {BIG_TXN_EVENTS} stored",
            stream_count(&js, &stream).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drained = started.elapsed();
    let status = std::fs::read_to_string(format!("/proc/{}/status", relay.pid())).expect("status");
    let kb = |key: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{key} in /proc/pid/status"))
    };
    let (hwm, rss) = (kb("VmHWM:"), kb("VmRSS:"));
    let expected: Vec<String> = (1..=BIG_TXN_EVENTS).map(|i| event_id("big", i)).collect();
    let stored = read_all(&js, &stream).await;
    let t = super::tally(&stored, &expected);
    let bytes: usize = stored.iter().map(|m| m.payload.len()).sum();
    eprintln!(
        "big transaction: {BIG_TXN_EVENTS} events, {} MB payload, written in {written:?}, stored after \
         {drained:?}; relay peak RSS (VmHWM) {} kB = {:.1} MB, RSS now {} kB",
        bytes / 1_000_000,
        hwm,
        hwm as f64 / 1024.0,
        rss
    );
    t.report("one transaction of 200k events (P6)", 1);
    assert_eq!(t.lost, 0, "P1");
    assert_eq!(t.duplicates, 0, "P3");
    assert!(t.order_kept, "P4");
    relay.signal("TERM");
    let _ = relay.wait(Duration::from_secs(15));
    assert!(
        hwm <= RSS_LIMIT_KB,
        "P6: the relay's peak RSS was {hwm} kB ({:.1} MB) for one {BIG_TXN_EVENTS}-event transaction; \
         the bound is {RSS_LIMIT_KB} kB",
        hwm as f64 / 1024.0
    );
}

/// A slot Postgres invalidated (`max_slot_wal_keep_size` exceeded while the relay was stopped): `run`
/// exits non-zero saying events may have been lost and how to recover, and publishes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalidated_slot_stops_with_recovery_advice() {
    let pg = PgServer::start_private();
    block_in_place(|| {
        pg.psql(
            "postgres",
            "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'",
        );
        pg.restart();
    });
    let db = text_id_db(&pg).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let env = relay_env(&config);
    let slot = config.postgres.slot.clone();
    let setup = run_command(&["setup"], &env, Duration::from_secs(60));
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let client = db.client().await;
    let confirmed_before = confirmed_flush(&client, &slot).await.expect("slot");
    // Events the relay never saw, then far more WAL than the slot may keep.
    block_in_place(|| write_backlog(&db, "lost", 10));
    db.psql("CREATE TABLE filler (id serial, pad text)");
    let mut status = String::new();
    for round in 0..40 {
        block_in_place(|| {
            db.psql(
                "INSERT INTO filler (pad) SELECT repeat('x', 1000) FROM generate_series(1, 2000);
                 SELECT pg_switch_wal();
                 CHECKPOINT;",
            )
        });
        status = db.psql(&format!(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{slot}'"
        ));
        if status == "lost" {
            eprintln!("slot lost after {} rounds", round + 1);
            break;
        }
    }
    assert_eq!(status, "lost", "could not invalidate the slot");

    let f = run_command(&["run"], &env, Duration::from_secs(60));
    assert!(
        !f.status.success(),
        "run on a lost slot must fail: {}",
        f.stderr
    );
    let err = f.stderr.to_lowercase();
    assert!(
        err.contains("may be lost") && err.contains("backfill") && err.contains(&slot),
        "says events may be lost and how to recover: {}",
        f.stderr
    );
    let js = nats.jetstream().await;
    assert_eq!(
        stream_count(&js, &config.nats.stream).await,
        0,
        "nothing published from a later position"
    );
    let confirmed_after = confirmed_flush(&client, &slot).await;
    assert!(
        confirmed_after.is_none_or(|c| c == confirmed_before),
        "the slot moved: {confirmed_before} -> {confirmed_after:?}"
    );
    eprintln!(
        "FAULT-MATRIX | invalidated slot (wal_status lost) | 1 | 10 | exits non-zero, nothing streamed | 0 | n/a"
    );
}

/// `log` without ANSI colour sequences (`ESC [ ... m`).
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
