//! Which LSN the stream confirms, and what the server does with it (docs/pgoutput.md, "Which LSN is
//! confirmed" and classic bugs 1–3): no
//! re-delivery after confirming `Commit.end_lsn`, re-delivery of exactly the unconfirmed transaction
//! after a crash, an idle slot that still advances, and a clean stop that leaves the slot where the
//! consumer left it.

use std::time::{Duration, Instant};

use outbox_relay::Lsn;
use outbox_relay::pgoutput::{Decoder, Message};
use outbox_relay::progress::Progress;
use outbox_relay::source::ReplicationEvent;

use super::{
    Txn, barrier, config, create_slot, group, options, read_txns, read_until, repl, slot_state,
    start, wait_confirmed,
};
use crate::support::{PgServer, TestDb, wait_for};

/// A table `a (id int primary key, v text)` published for inserts.
async fn insert_table(db: &TestDb) -> tokio_postgres::Client {
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE a (id int PRIMARY KEY, v text NOT NULL);
             CREATE PUBLICATION {} FOR TABLE a WITH (publish = 'insert');",
            db.publication_name()
        ))
        .await
        .unwrap();
    client
}

async fn insert(client: &tokio_postgres::Client, id: i32) {
    client
        .execute("INSERT INTO a VALUES ($1::int, 'row ' || $1::int)", &[&id])
        .await
        .unwrap();
}

/// Reconnects from `from` and returns every transaction sent before a fresh barrier.
async fn redelivered(
    db: &TestDb,
    client: &tokio_postgres::Client,
    slot: &str,
    from: Lsn,
) -> Vec<Txn> {
    let mut stream = start(db, slot, from, &options(db), config()).await.stream;
    let mut decoder = Decoder::new();
    let b = barrier(client).await;
    let messages = read_until(&mut stream, &mut decoder, b).await;
    stream.stop(Duration::from_secs(5)).await.unwrap();
    let (txns, outside) = group(messages);
    assert!(outside.is_empty(), "{outside:?}");
    txns
}

#[tokio::test]
async fn confirming_commit_end_lsn_redelivers_nothing_and_commit_lsn_redelivers_the_last() {
    let db = TestDb::create(PgServer::shared()).await;
    let client = insert_table(&db).await;
    let slot = db.slot_name();
    let wrong_slot = format!("{slot}_commit_lsn");
    create_slot(&db, &slot).await;
    create_slot(&db, &wrong_slot).await;
    for id in 1..=3 {
        insert(&client, id).await;
    }

    // Right: confirm each Commit.end_lsn.
    let mut stream = start(&db, &slot, Lsn::ZERO, &options(&db), config())
        .await
        .stream;
    let mut decoder = Decoder::new();
    let txns = read_txns(&mut stream, &mut decoder, 3).await;
    for t in &txns {
        assert!(t.commit_lsn < t.end_lsn, "{t:?}");
        stream.confirm(t.end_lsn);
    }
    let stored = txns[2].end_lsn;
    assert_eq!(stream.confirmed(), stored);
    stream.stop(Duration::from_secs(5)).await.unwrap();
    assert_eq!(slot_state(&client, &slot).await.confirmed_flush, stored);

    for from in [Lsn::ZERO, stored] {
        let again = redelivered(&db, &client, &slot, from).await;
        assert!(
            again.is_empty(),
            "restart from {from} (slot confirmed {stored}) re-delivered {again:?}"
        );
    }

    // Wrong: confirm commit_lsn of the last one. The same check sees it come back, so the check
    // above can tell the bug apart.
    let mut stream = start(&db, &wrong_slot, Lsn::ZERO, &options(&db), config())
        .await
        .stream;
    let txns = read_txns(&mut stream, &mut Decoder::new(), 3).await;
    stream.confirm(txns[1].end_lsn);
    stream.confirm(txns[2].commit_lsn);
    stream.stop(Duration::from_secs(5)).await.unwrap();
    let again = redelivered(&db, &client, &wrong_slot, Lsn::ZERO).await;
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(again[0].commit_lsn, txns[2].commit_lsn);
    assert_eq!(again[0].inserted(), txns[2].inserted());
}

#[tokio::test]
async fn unconfirmed_transaction_is_redelivered_once_after_the_consumer_dies() {
    let db = TestDb::create(PgServer::shared()).await;
    let client = insert_table(&db).await;
    let slot = db.slot_name();
    create_slot(&db, &slot).await;

    let mut stream = start(&db, &slot, Lsn::ZERO, &options(&db), config())
        .await
        .stream;
    let mut decoder = Decoder::new();
    insert(&client, 1).await;
    let first = read_txns(&mut stream, &mut decoder, 1).await.remove(0);
    stream.confirm(first.end_lsn);
    wait_confirmed(&client, &slot, first.end_lsn).await;
    insert(&client, 2).await;
    let second = read_txns(&mut stream, &mut decoder, 1).await.remove(0);
    assert_eq!(
        second.inserted(),
        [[Some("2".into()), Some("row 2".into())]]
    );

    // A second consumer on an active slot is refused with a transient error, connection intact.
    let (e, conn) = match repl(&db)
        .await
        .start_replication(&slot, first.end_lsn, &options(&db), config())
        .await
    {
        Ok(_) => panic!("two streams on one slot"),
        Err(e) => e,
    };
    assert_eq!(e.sqlstate(), Some("55006"), "{e}");
    assert!(e.is_transient(), "{e}");
    assert!(e.to_string().contains("active for PID"), "{e}");
    let mut conn = conn.expect("connection back after a refused START_REPLICATION");
    conn.identify_system().await.unwrap();
    conn.close().await;

    // Crash: no final status update, no CopyDone.
    drop(stream);
    let started = start(&db, &slot, first.end_lsn, &options(&db), config()).await;
    let mut stream = started.stream;
    let b = barrier(&client).await;
    let (txns, outside) = group(read_until(&mut stream, &mut decoder, b).await);
    assert!(outside.is_empty(), "{outside:?}");
    assert_eq!(
        txns.len(),
        1,
        "expected only the unconfirmed txn again (slot busy {} times): {txns:?}",
        started.slot_busy
    );
    assert_eq!(txns[0].commit_lsn, second.commit_lsn);
    // A consumer deduplicating by `commit_lsn < durable` keeps it: it was never durable.
    assert!(txns[0].commit_lsn >= first.end_lsn, "{txns:?}");
    assert_eq!(txns[0].end_lsn, second.end_lsn);
    assert_eq!(txns[0].inserted(), second.inserted());
    stream.stop(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_slot_advances_past_unpublished_wal() {
    let db = TestDb::create(PgServer::shared()).await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE a (id int PRIMARY KEY);
             CREATE TABLE b (v text);
             CREATE PUBLICATION {} FOR TABLE a WITH (publish = 'insert');",
            db.publication_name()
        ))
        .await
        .unwrap();
    let slot = db.slot_name();
    create_slot(&db, &slot).await;

    // The consumer confirms what Progress says is safe: commits, and keepalive WAL ends when idle.
    let mut stream = start(&db, &slot, Lsn::ZERO, &options(&db), config())
        .await
        .stream;
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn(async move {
        let mut decoder = Decoder::new();
        let mut progress = Progress::new(Lsn::ZERO);
        loop {
            let event = tokio::select! {
                _ = &mut stop_rx => return stream,
                e = stream.recv() => e,
            };
            match event.expect("stream ended").expect("stream error") {
                ReplicationEvent::XLogData {
                    wal_start, data, ..
                } => match decoder.decode(data, wal_start).unwrap() {
                    Message::Begin { .. } => progress.begin(),
                    Message::Commit { end_lsn, .. } => progress.commit(end_lsn),
                    Message::Insert { .. } => {
                        let seq = progress.publish();
                        progress.ack(seq).unwrap();
                    }
                    _ => {}
                },
                ReplicationEvent::Keepalive { wal_end, .. } => progress.keepalive(wal_end),
            }
            stream.confirm(progress.confirmed());
        }
    });

    client
        .batch_execute(
            "INSERT INTO b SELECT repeat('x', 1000) FROM generate_series(1, 20000);
             SELECT pg_switch_wal();",
        )
        .await
        .unwrap();
    let after: Lsn = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get::<_, String>(0)
        .parse()
        .unwrap();

    // restart_lsn moves only to a running-xacts record decoded and then confirmed: checkpoints
    // write those. Poll slowly; CHECKPOINT is not free on a shared server.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (state, retained) = loop {
        client.batch_execute("CHECKPOINT").await.unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        let state = slot_state(&client, &slot).await;
        let retained: i64 = client
            .query_one(
                "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint \
                   FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0);
        if state.confirmed_flush >= after && retained < 8 << 20 {
            break (state, retained);
        }
        assert!(
            Instant::now() < deadline,
            "idle slot did not advance: {state:?}, WAL after the writes {after}, \
             retained {retained} bytes"
        );
    };
    assert!(state.restart > Lsn::ZERO, "{state:?}");
    assert!(retained < 8 << 20, "{retained}");

    stop_tx.send(()).unwrap();
    let stream = consumer.await.unwrap();
    stream.stop(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test]
async fn clean_stop_releases_the_slot_at_the_last_confirmed_lsn() {
    let db = TestDb::create(PgServer::shared()).await;
    let client = insert_table(&db).await;
    let slot = db.slot_name();
    let consistent = create_slot(&db, &slot).await;
    let mut stream = start(&db, &slot, Lsn::ZERO, &options(&db), config())
        .await
        .stream;
    let pid = stream.backend_pid();
    insert(&client, 1).await;
    insert(&client, 2).await;
    let txns = read_txns(&mut stream, &mut Decoder::new(), 2).await;
    // Confirm the last one only and stop at once: the final status update must carry it, not the
    // next timer tick.
    stream.confirm(txns[1].end_lsn);
    let confirmed = stream.confirmed();
    assert_eq!(confirmed, txns[1].end_lsn);
    assert!(confirmed > consistent);
    let started = Instant::now();
    stream.stop(Duration::from_secs(5)).await.unwrap();
    let stopped_in = started.elapsed();
    assert!(stopped_in < Duration::from_secs(5), "{stopped_in:?}");

    let (c, s) = (&client, slot.as_str());
    wait_for(
        "slot inactive",
        Duration::from_secs(5),
        move || async move { !slot_state(c, s).await.active },
    )
    .await;
    assert_eq!(slot_state(&client, &slot).await.confirmed_flush, confirmed);
    // The walsender releases the slot and leaves pg_stat_replication in two separate steps of its
    // exit, so on a loaded machine its row can outlive the slot's release by a moment: wait for it
    // (a walsender the stop did not end stays, and fails this).
    wait_for(
        &format!("walsender {pid} gone after stop"),
        Duration::from_secs(10),
        move || async move { super::walsenders(c, pid).await == 0 },
    )
    .await;
}
