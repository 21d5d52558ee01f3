//! `nats.atomic_transactions`: each Postgres transaction is one JetStream atomic batch. The tests
//! judge what a consumer sees: every event once, in commit order, the event id in `Outbox-Event-Id`
//! (a batch cannot carry `Nats-Msg-Id`), a transaction past the server's batch limit still complete
//! (split into batches, nothing lost), and after a kill -9 mid-drain only whole transactions.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::faults::assert_all_stored_once_in_order;
use crate::support::{
    InProcessRelay, NatsServer, PgServer, RelayProcess, TEXT_ID_OUTBOX_SQL, TestDb, read_all,
    relay_config, relay_env, run_command, stream_count,
};

/// Writes one transaction per entry of `sizes`, with that many events; ids `<prefix>-TTTTT-EEEE`
/// sort in commit order. Returns the ids in commit order.
fn write_transactions(db: &TestDb, prefix: &str, sizes: &[u64]) -> Vec<String> {
    let array = sizes
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    db.psql(&format!(
        "DO $$ DECLARE sizes int[] := ARRAY[{array}]; BEGIN
           FOR t IN 1..array_length(sizes, 1) LOOP
             FOR e IN 1..sizes[t] LOOP
               INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
               VALUES ('{prefix}-' || lpad(t::text, 5, '0') || '-' || lpad(e::text, 4, '0'),
                       'Claim', t::text, 'ClaimApproved', jsonb_build_object('t', t, 'e', e));
             END LOOP;
             COMMIT;
           END LOOP;
         END $$;"
    ));
    let mut ids = Vec::new();
    for (t, &n) in sizes.iter().enumerate() {
        for e in 1..=n {
            ids.push(format!("{prefix}-{:05}-{e:04}", t + 1));
        }
    }
    ids
}

/// The transaction part of an id written by [`write_transactions`].
fn txn_of(id: &str) -> &str {
    id.rsplit_once('-').map_or(id, |(t, _)| t)
}

async fn text_id_db() -> TestDb {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    db
}

/// Transactions of 1 to 17 events and one of 2,300 (past the server's 1,000-message batch limit):
/// all stored once, in commit order, ids in `Outbox-Event-Id`; the stream allows atomic publish.
#[tokio::test]
async fn transactions_arrive_whole_in_order_and_a_huge_one_is_split_not_lost() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.nats.atomic_transactions = true;
    let stream = config.nats.stream.clone();
    let slot = config.postgres.slot.clone();
    let relay = InProcessRelay::start(config);
    let js = nats.jetstream().await;
    // The relay's setup creates the slot and the stream; wait for the stream.
    let deadline = Instant::now() + Duration::from_secs(30);
    while js.get_stream(&stream).await.is_err() {
        assert!(Instant::now() < deadline, "stream not created");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Setup creates the stream before the slot; rows written before the slot's consistent point
    // are not the relay's.
    crate::faults::wait_for_slot(&db.client().await, &slot).await;
    let mut s = js.get_stream(&stream).await.expect("stream");
    assert!(
        s.info().await.expect("info").config.allow_atomic_publish,
        "setup creates the stream with atomic publish allowed"
    );
    let mut sizes: Vec<u64> = (0..40).map(|i| [1, 2, 5, 17][i % 4]).collect();
    sizes.push(2300);
    sizes.extend([3, 1, 4]);
    let ids = write_transactions(&db, "a", &sizes);
    let tally = assert_all_stored_once_in_order(&js, &stream, &ids).await;
    tally.report("atomic transactions (1..17 events, one of 2,300)", 1);
    let all = read_all(&js, &stream).await;
    assert!(
        all.iter()
            .all(|m| !m.headers.contains_key("Nats-Msg-Id")
                && m.headers.contains_key("Outbox-Event-Id")),
        "batch messages carry the id in Outbox-Event-Id only"
    );
    relay.stop().await.expect("relay stops cleanly");
}

/// kill -9 of the relay while it drains 400 transactions of 50 events: right after the kill the
/// stream holds only whole transactions; after a restart, every event once, in commit order.
#[tokio::test]
async fn kill_9_mid_drain_leaves_only_whole_transactions() {
    const TXNS: usize = 400;
    const PER: u64 = 50;
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.nats.atomic_transactions = true;
    let stream = config.nats.stream.clone();
    let env = relay_env(&config);
    let setup = run_command(&["setup"], &env, Duration::from_secs(60));
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let ids = write_transactions(&db, "k", &[PER; TXNS]);
    let js = nats.jetstream().await;

    let mut first = RelayProcess::spawn(&["run"], &env);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = stream_count(&js, &stream).await;
        if n >= 3_000 {
            break;
        }
        assert!(first.is_running(), "relay exited early: {}", first.stderr());
        assert!(Instant::now() < deadline, "only {n} stored after 60 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.signal("KILL");
    assert!(first.wait(Duration::from_secs(10)).is_some(), "SIGKILL");
    // Batches the server had whole are stored; an open one is abandoned, never stored in part.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let at_kill = read_all(&js, &stream).await;
    let mut per_txn: BTreeMap<&str, u64> = BTreeMap::new();
    for m in &at_kill {
        *per_txn.entry(txn_of(m.id())).or_default() += 1;
    }
    let partial: Vec<_> = per_txn.iter().filter(|(_, n)| **n != PER).collect();
    assert!(
        partial.is_empty(),
        "transactions stored in part after kill -9: {partial:?}"
    );
    assert!(
        at_kill.len() < ids.len(),
        "the drain was done before the kill ({} stored): the test proves nothing",
        at_kill.len()
    );

    let mut second = RelayProcess::spawn(&["run"], &env);
    let tally = assert_all_stored_once_in_order(&js, &stream, &ids).await;
    tally.report("atomic transactions, kill -9 mid-drain", 1);
    second.signal("TERM");
    let status = second
        .wait(Duration::from_secs(15))
        .expect("exit on SIGTERM");
    assert!(status.success(), "exit {status}: {}", second.stderr());
    eprintln!(
        "atomic kill -9: {} of {} events ({} whole transactions) stored at the kill",
        at_kill.len(),
        ids.len(),
        per_txn.len()
    );
}

/// `setup` with `atomic_transactions` on an existing stream that does not allow atomic publish:
/// a clear error that says how to allow it, and the stream is left alone.
#[tokio::test]
async fn setup_says_how_to_allow_atomic_publish_on_an_existing_stream() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    let js = nats.jetstream().await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: config.nats.stream.clone(),
        subjects: vec!["outbox.*".into(), "outbox_dead_letter".into()],
        ..Default::default()
    })
    .await
    .expect("create stream");
    config.nats.atomic_transactions = true;
    let out = run_command(&["setup"], &relay_env(&config), Duration::from_secs(60));
    assert!(!out.status.success(), "setup accepted the stream");
    assert!(
        out.stderr.contains("allow_atomic") && out.stderr.contains("atomic_transactions"),
        "{}",
        out.stderr
    );
}
