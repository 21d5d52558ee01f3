//! The relay against a 3-node JetStream cluster (`NatsCluster`), with `nats.url` listing every node
//! and an R3 stream: a kill -9 of the stream leader in the middle of a drain, and a rolling restart
//! of all nodes under steady writes. Judged per message like the fault tests: every committed event
//! stored, none twice, in commit order. Each prints how long the relay stalled and how many
//! republished events JetStream absorbed as duplicates; nothing here asserts on time.

use std::time::{Duration, Instant};

use outbox_relay::config::Config;
use outbox_relay::testkit::NatsCluster;

use crate::faults::{
    Writer, assert_all_stored_once_in_order, text_id_db, wait_for_slot, write_backlog,
};
use crate::support::{
    InProcessRelay, PgServer, RelayProcess, TestDb, relay_env, run_command, stream_count, unique,
};

/// A relay configuration for `db` and every node of `cluster`, with an R3 stream.
fn cluster_config(db: &TestDb, cluster: &NatsCluster, atomic: bool) -> Config {
    let mut config = Config::default();
    config.postgres.url = db.url();
    config.postgres.slot = db.slot_name();
    config.postgres.publication = db.publication_name();
    config.nats.url = cluster.urls();
    config.nats.stream = unique("OUTBOX").to_uppercase();
    config.nats.stream_replicas = 3;
    config.nats.atomic_transactions = atomic;
    config.http.listen = String::new();
    config.nats.ack_timeout_ms = 2000;
    config.validate().expect("cluster relay config is valid");
    config
}

/// The index of the node that leads `stream` now.
async fn stream_leader(
    cluster: &NatsCluster,
    js: &async_nats::jetstream::Context,
    stream: &str,
) -> Option<usize> {
    let mut s = js.get_stream(stream).await.ok()?;
    let info = s.info().await.ok()?;
    let leader = info.cluster.as_ref()?.leader.clone()?;
    cluster.index_of(&leader)
}

/// After a fault: how long until the stream grows again, as `js` sees it, or holds all `total`
/// messages (reads fail while a new leader is elected, and the drain may end before one succeeds: that
/// is a relay that resumed, not one that stalled). Returns the time and how many reads failed.
async fn resumed_after(
    js: &async_nats::jetstream::Context,
    stream: &str,
    total: u64,
) -> Option<(Duration, usize)> {
    let t = Instant::now();
    let mut first: Option<u64> = None;
    let mut failed = 0;
    loop {
        let n = stream_count(js, stream).await;
        if n == 0 {
            failed += 1;
        } else if n >= total {
            return Some((t.elapsed(), failed));
        } else {
            match first {
                None => first = Some(n),
                Some(f) if n > f => return Some((t.elapsed(), failed)),
                Some(_) => {}
            }
        }
        if t.elapsed() > Duration::from_secs(60) {
            eprintln!("no growth for 60 s: first read {first:?}, last {n}, {failed} failed reads");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the stream holds more than `n` messages; returns how long that took.
async fn until_more_than(js: &async_nats::jetstream::Context, stream: &str, n: u64) -> Duration {
    let t = Instant::now();
    while stream_count(js, stream).await <= n {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the relay stored nothing for 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.elapsed()
}

async fn leader_kill(atomic: bool) {
    const EVENTS: u64 = 20_000;
    let db = text_id_db(PgServer::shared()).await;
    let cluster = NatsCluster::start(3);
    let config = cluster_config(&db, &cluster, atomic);
    let stream = config.nats.stream.clone();
    let mut env = relay_env(&config);
    env.push(("OUTBOX_RELAY_NATS_STREAM_REPLICAS".into(), "3".into()));
    // The slot must exist before the backlog is written.
    let setup = run_command(&["setup"], &env, Duration::from_secs(60));
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let ids = write_backlog(&db, "c", EVENTS);
    env.push((
        "OUTBOX_RELAY_LOG_LEVEL".into(),
        "info,outbox_relay::sink=debug".into(),
    ));
    let mut relay = RelayProcess::spawn(&["run"], &env);
    let js = cluster.jetstream().await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while stream_count(&js, &stream).await < 3_000 {
        assert!(
            Instant::now() < deadline,
            "the drain did not start: {}",
            relay.stderr()
        );
        assert!(relay.is_running(), "the relay stopped: {}", relay.stderr());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let leader = stream_leader(&cluster, &js, &stream)
        .await
        .expect("the stream has a leader");
    // Watched through a node that stays up.
    // Watched through a node that stays up, with a short request timeout: a stream read that waits
    // for the election must not hide the relay's progress behind the client's default 5 s.
    let survivor = async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_millis(250))
        .build(cluster.node((leader + 1) % cluster.len()).client().await);
    let killed = Instant::now();
    cluster.node(leader).kill();
    let Some((stall, failed_reads)) = resumed_after(&survivor, &stream, EVENTS).await else {
        panic!("the relay stored nothing for 60 s: {}", relay.stderr());
    };
    let at_kill = stream_count(&survivor, &stream).await;
    let tally = assert_all_stored_once_in_order(&js, &stream, &ids).await;
    let what = if atomic {
        "R3 stream leader kill -9 mid-drain (atomic transactions)"
    } else {
        "R3 stream leader kill -9 mid-drain"
    };
    tally.report(what, 1);
    relay.signal("TERM");
    let status = relay
        .wait(Duration::from_secs(15))
        .expect("exit on SIGTERM");
    let log = relay.stderr();
    assert!(status.success(), "exit {status}: {log}");
    eprintln!(
        "CLUSTER | {what} | growth seen {:.1} s after the kill ({failed_reads} stream reads failed during the election; {at_kill} stored then; {:.1} s to the end) | {} republished events absorbed as duplicates",
        stall.as_secs_f64(),
        killed.elapsed().as_secs_f64(),
        log.matches("duplicate dropped by JetStream").count(),
    );
}

/// kill -9 of the R3 stream's leader while a 20,000-event backlog drains.
#[tokio::test]
async fn stream_leader_kill_9_mid_drain_loses_nothing_and_stores_nothing_twice() {
    leader_kill(false).await;
}

/// The same with `nats.atomic_transactions`: atomic batches on a replicated stream.
#[tokio::test]
async fn stream_leader_kill_9_mid_drain_with_atomic_transactions() {
    leader_kill(true).await;
}

/// Each node in turn stopped (SIGTERM) and started again while a writer commits ~300 events/s.
#[tokio::test]
async fn rolling_restart_under_load_loses_nothing_and_stores_nothing_twice() {
    let db = text_id_db(PgServer::shared()).await;
    let cluster = NatsCluster::start(3);
    let config = cluster_config(&db, &cluster, false);
    let stream = config.nats.stream.clone();
    let slot = config.postgres.slot.clone();
    let relay = InProcessRelay::start(config);
    let js = cluster.jetstream().await;
    // Events committed before the relay's setup created the slot are not the relay's.
    wait_for_slot(&db.client().await, &slot).await;
    let writer = Writer::start(db.url(), "r", 300);
    until_more_than(&js, &stream, 200).await;
    let mut longest = Duration::ZERO;
    for i in 0..cluster.len() {
        cluster.node(i).stop();
        let n = stream_count(&js, &stream).await;
        longest = longest.max(until_more_than(&js, &stream, n).await);
        cluster.node(i).start_again();
        cluster.wait_for_meta_leader(Duration::from_secs(30));
        // Let the node catch up before the next one goes.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let ids = writer.stop().await;
    let tally = assert_all_stored_once_in_order(&js, &stream, &ids).await;
    tally.report("R3 rolling restart of 3 nodes under 300 events/s", 1);
    eprintln!(
        "CLUSTER | rolling restart | longest stall {:.1} s | {} republished events absorbed as duplicates | {} reconnects",
        longest.as_secs_f64(),
        relay.metrics.published_duplicate.get(),
        relay.metrics.reconnects.get()
    );
    relay.stop().await.expect("relay stops cleanly");
}
