//! End-to-end tests of the relay against real Postgres and NATS (the promises in
//! docs/guarantees.md): each test writes to an
//! outbox table, runs the relay (in-process, or the binary when it must be killed or signalled), and
//! judges it only by what a user can see: the JetStream stream, the slot's `confirmed_flush_lsn`,
//! exit codes and stderr.
//!
//! Most tests use an outbox table with `event_id text` so ids read like the README's story
//! (`e-5531`);
//! `setup_is_idempotent_and_status_reports_health` uses the shipped `sql/01_outbox_table.sql`.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use outbox_relay::Lsn;
use tokio_postgres::Client;

use crate::support::{
    Finished, InProcessRelay, NatsServer, PgServer, RelayProcess, Scenario, Stored,
    TEXT_ID_OUTBOX_SQL, TestDb, confirmed_flush, current_wal_lsn, default_outbox_sql, read_all,
    relay_config, relay_env, run_command, slot_exists, stream_count, wait_for,
};

/// Inserts one outbox row in the current transaction (or as its own, on a plain client).
async fn insert_event(
    client: &impl tokio_postgres::GenericClient,
    id: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    payload: &str,
) {
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, $2, $3, $4, $5::text::jsonb)",
            &[&id, &aggregate_type, &aggregate_id, &event_type, &payload],
        )
        .await
        .unwrap_or_else(|e| panic!("insert outbox event {id}: {e}"));
}

/// The claims service: approves `claim` and writes its event in one transaction.
async fn approve_claim(client: &mut Client, claim: i64, event_id: &str) {
    let tx = client.transaction().await.unwrap();
    let n = tx
        .execute(
            "UPDATE claims SET status = 'approved' WHERE id = $1",
            &[&claim],
        )
        .await
        .unwrap();
    assert_eq!(n, 1, "claim {claim} exists");
    let payload = format!(r#"{{"claim_id":{claim},"status":"approved","amount_cents":125000}}"#);
    insert_event(
        &tx,
        event_id,
        "Claim",
        &claim.to_string(),
        "ClaimApproved",
        &payload,
    )
    .await;
    tx.commit().await.unwrap();
}

/// Waits until the relay's slot exists and has found its consistent point: it shows in
/// `pg_replication_slots` while it is still being created, and rows inserted then are not decoded.
async fn wait_for_slot(client: &Client, slot: &str) {
    wait_for("the relay's slot", Duration::from_secs(30), || async {
        confirmed_flush(client, slot).await.is_some()
    })
    .await;
}

async fn wait_for_count(js: &async_nats::jetstream::Context, stream: &str, n: u64, secs: u64) {
    let what = format!("{n} messages in stream {stream}");
    wait_for(&what, Duration::from_secs(secs), || async {
        stream_count(js, stream).await >= n
    })
    .await;
}

/// P2 while a commit is unacknowledged: watches the slot for five seconds and fails as soon as it
/// is confirmed at `after` (the WAL's position after `what`) or past it. Returns the highest
/// position it was confirmed at.
async fn max_confirmed_below(client: &Client, slot: &str, after: Lsn, what: &str) -> Lsn {
    let mut max_confirmed = Lsn::ZERO;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        let c = confirmed_flush(client, slot).await.expect("slot exists");
        max_confirmed = max_confirmed.max(c);
        assert!(
            c < after,
            "P2: confirmed_flush_lsn {c} reached {after}, the WAL's position after {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    max_confirmed
}

/// Waits until the slot is confirmed past `commit` (`what`'s commit LSN) and at `end` or beyond.
async fn wait_confirmed_past(client: &Client, slot: &str, commit: Lsn, end: Lsn, what: &str) {
    let what = format!("the slot to confirm past {what}");
    wait_for(&what, Duration::from_secs(30), || async {
        confirmed_flush(client, slot)
            .await
            .is_some_and(|c| c > commit && c >= end)
    })
    .await;
}

fn ids(messages: &[Stored]) -> Vec<&str> {
    messages.iter().map(Stored::id).collect()
}

/// Panics if an id occurs twice.
fn assert_unique_ids(messages: &[Stored]) {
    let mut seen = HashSet::new();
    for m in messages {
        assert!(
            seen.insert(m.id()),
            "Nats-Msg-Id {} stored twice (seq {})",
            m.id(),
            m.seq
        );
    }
}

/// The README's story (claim 4711, event e-5531): e-5531 arrives with every header;
/// NATS goes down while claims
/// 4712..4716 are approved; the slot does not pass the first unacknowledged commit (P2); when NATS
/// returns all six events are in the stream once, in commit order (P1, P3, P4), and the slot moves on.
#[tokio::test]
async fn claim_4711_story_survives_a_nats_outage_in_order_and_once() {
    let s = Scenario::builder()
        .text_ids()
        .sql(
            "CREATE TABLE claims (id bigint PRIMARY KEY, status text NOT NULL);
             INSERT INTO claims SELECT g, 'open' FROM generate_series(4711, 4716) g;",
        )
        .start()
        .await;
    let (_db, nats, config, mut client, js, slot, stream) = s.into_parts();
    let relay = InProcessRelay::start(config);
    wait_for_slot(&client, &slot).await;

    approve_claim(&mut client, 4711, "e-5531").await;
    wait_for_count(&js, &stream, 1, 30).await;
    let first = read_all(&js, &stream).await;
    assert_eq!(first.len(), 1);
    let m = &first[0];
    assert_eq!(m.subject, "outbox.Claim");
    assert_eq!(m.id(), "e-5531");
    assert_eq!(m.header("Outbox-Event-Type"), "ClaimApproved");
    assert_eq!(m.header("Outbox-Aggregate-Type"), "Claim");
    assert_eq!(m.header("Outbox-Aggregate-Id"), "4711");
    let stored: String = client
        .query_one(
            "SELECT payload::text FROM outbox WHERE event_id = 'e-5531'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(m.payload_str(), stored, "payload as stored by Postgres");
    assert!(!m.commit_lsn().is_zero());
    drop(js);

    // The messaging platform goes down; the claims service keeps approving claims.
    nats.stop();
    let before_writes = current_wal_lsn(&client).await;
    let mut after_first_unacked = Lsn::ZERO;
    for (i, claim) in (4712..=4716).enumerate() {
        approve_claim(&mut client, claim, &format!("e-{}", 5532 + i)).await;
        if i == 0 {
            after_first_unacked = current_wal_lsn(&client).await;
        }
    }
    let after_writes = current_wal_lsn(&client).await;
    let max_confirmed_during_outage =
        max_confirmed_below(&client, &slot, after_first_unacked, "e-5532's commit").await;
    assert!(
        relay.metrics.reconnects.get() > 0,
        "the relay never noticed NATS was down"
    );

    nats.start_again();
    let js = nats.jetstream().await;
    wait_for_count(&js, &stream, 6, 60).await;
    let all = read_all(&js, &stream).await;
    assert_unique_ids(&all);
    assert_eq!(
        ids(&all),
        ["e-5531", "e-5532", "e-5533", "e-5534", "e-5535", "e-5536"],
        "every event once, in commit order"
    );
    for (i, m) in all.iter().enumerate() {
        assert_eq!(m.subject, "outbox.Claim");
        assert_eq!(m.header("Outbox-Aggregate-Id"), (4711 + i).to_string());
        if i > 0 {
            assert!(
                m.commit_lsn() > all[i - 1].commit_lsn(),
                "separate transactions have increasing commit LSNs: {all:?}"
            );
        }
    }
    // Precisely: the slot never passed the commit record of e-5532 while it was unacknowledged.
    assert!(
        max_confirmed_during_outage <= all[1].commit_lsn(),
        "P2: confirmed {max_confirmed_during_outage} during the outage passed e-5532's commit at {} \
         (WAL before the writes: {before_writes})",
        all[1].commit_lsn()
    );
    let last_commit = all[5].commit_lsn();
    wait_confirmed_past(
        &client,
        &slot,
        last_commit,
        after_writes,
        "the last approval",
    )
    .await;
    relay.stop().await.expect("relay stops cleanly");
}

/// P1's other half and the outbox stage's rules (docs/pgoutput.md, "What the relay uses of them"):
/// a rolled-back row is never published; updates and deletes of
/// outbox rows are ignored and counted; an insert deleted in its own transaction is still published.
/// The publication here publishes every operation, so the relay really sees the updates and deletes.
#[tokio::test]
async fn rollbacks_never_publish_and_updates_deletes_are_ignored() {
    let s = Scenario::builder().text_ids().start().await;
    let (db, _nats, config, mut client, js, _slot, stream) = s.into_parts();
    db.psql(&format!(
        "CREATE PUBLICATION {} FOR TABLE public.outbox",
        db.publication_name()
    ));
    let relay = InProcessRelay::start(config.clone());
    wait_for_slot(&client, &config.postgres.slot).await;

    insert_event(&client, "a-1", "Claim", "1", "ClaimApproved", r#"{"n": 1}"#).await;
    wait_for_count(&js, &stream, 1, 30).await;

    let tx = client.transaction().await.unwrap();
    insert_event(&tx, "r-1", "Claim", "2", "ClaimApproved", r#"{"n": 2}"#).await;
    tx.rollback().await.unwrap();
    client
        .execute(
            "UPDATE outbox SET payload = '{\"n\": 11}' WHERE event_id = 'a-1'",
            &[],
        )
        .await
        .unwrap();
    client
        .execute("DELETE FROM outbox WHERE event_id = 'a-1'", &[])
        .await
        .unwrap();
    let tx = client.transaction().await.unwrap();
    insert_event(&tx, "d-1", "Claim", "3", "ClaimApproved", r#"{"n": 3}"#).await;
    tx.execute("DELETE FROM outbox WHERE event_id = 'd-1'", &[])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    insert_event(&client, "z-1", "Claim", "4", "ClaimApproved", r#"{"n": 4}"#).await;

    wait_for_count(&js, &stream, 3, 30).await;
    // Give a wrongly published rollback or update time to show up.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let all = read_all(&js, &stream).await;
    assert_eq!(ids(&all), ["a-1", "d-1", "z-1"]);
    assert_eq!(
        all[0].payload_str(),
        r#"{"n": 1}"#,
        "the insert, not the update"
    );
    assert_eq!(
        relay.metrics.ignored_changes.get(),
        3,
        "one update and two deletes ignored"
    );
    assert_eq!(relay.metrics.published_ok.get(), 3);
    relay.stop().await.expect("relay stops cleanly");
}

/// P4 under concurrency: four writers commit 200 transactions of 1-3 events at once; the stream
/// holds every event once, ordered by commit LSN, each transaction's events together and in insert
/// order.
#[tokio::test]
async fn concurrent_writers_arrive_in_commit_order() {
    const WRITERS: usize = 4;
    const TXNS: usize = 50;
    let s = Scenario::builder().text_ids().start().await;
    let (db, _nats, config, client, js, _slot, stream) = s.into_parts();
    let relay = InProcessRelay::start(config.clone());
    wait_for_slot(&client, &config.postgres.slot).await;

    let events_in = |w: usize, t: usize| 1 + (w * 7 + t) % 3;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let mut c = db.client().await;
        writers.push(tokio::spawn(async move {
            for t in 0..TXNS {
                let tx = c.transaction().await.unwrap();
                for i in 0..events_in(w, t) {
                    let id = format!("w{w}-{t}-{i}");
                    let payload = format!(r#"{{"w":{w},"t":{t},"i":{i}}}"#);
                    insert_event(&tx, &id, "Claim", &format!("{w}"), "Written", &payload).await;
                }
                tx.commit().await.unwrap();
            }
        }));
    }
    for w in writers {
        w.await.expect("writer task");
    }
    let total: usize = (0..WRITERS)
        .flat_map(|w| (0..TXNS).map(move |t| events_in(w, t)))
        .sum();

    wait_for_count(&js, &stream, total as u64, 60).await;
    let all = read_all(&js, &stream).await;
    assert_eq!(all.len(), total);
    assert_unique_ids(&all);

    let parse = |id: &str| -> (usize, usize, usize) {
        let p: Vec<usize> = id[1..].split('-').map(|x| x.parse().unwrap()).collect();
        (p[0], p[1], p[2])
    };
    let mut txn_lsn: BTreeMap<(usize, usize), Lsn> = BTreeMap::new();
    let mut per_writer_last: BTreeMap<usize, usize> = BTreeMap::new();
    for (k, m) in all.iter().enumerate() {
        let (w, t, i) = parse(m.id());
        let lsn = m.commit_lsn();
        if let Some(prev) = txn_lsn.insert((w, t), lsn) {
            assert_eq!(prev, lsn, "{}: one transaction, one commit LSN", m.id());
        }
        if k > 0 {
            let p = &all[k - 1];
            let (pw, pt, pi) = parse(p.id());
            let plsn = p.commit_lsn();
            assert!(
                lsn >= plsn,
                "P4: {} (commit {lsn}) stored after {} (commit {plsn})",
                m.id(),
                p.id()
            );
            if lsn == plsn {
                assert_eq!((w, t), (pw, pt), "one commit LSN, one transaction");
                assert_eq!(i, pi + 1, "insert order within {w}/{t}");
            } else {
                assert_eq!(i, 0, "{} starts its transaction", m.id());
            }
        } else {
            assert_eq!(i, 0);
        }
        // A writer commits its transactions one after another: their order must survive too.
        if i == 0 {
            if let Some(&last) = per_writer_last.get(&w) {
                assert_eq!(t, last + 1, "writer {w}: transaction {t} after {last}");
            } else {
                assert_eq!(t, 0, "writer {w} starts at transaction 0");
            }
            per_writer_last.insert(w, t);
        }
    }
    assert_eq!(txn_lsn.len(), WRITERS * TXNS, "every transaction present");
    for &(w, t) in txn_lsn.keys() {
        let n = all
            .iter()
            .filter(|m| m.id().starts_with(&format!("w{w}-{t}-")))
            .count();
        assert_eq!(n, events_in(w, t), "all events of {w}/{t}");
    }
    relay.stop().await.expect("relay stops cleanly");
}

/// P2 directly: while NATS is down, the slot does not confirm a transaction whose event is not
/// acknowledged; once NATS is back and the event stored, it does.
#[tokio::test]
async fn slot_is_not_confirmed_past_an_unacknowledged_event() {
    let s = Scenario::builder().text_ids().start().await;
    let (_db, nats, config, client, _js, slot, stream) = s.into_parts();
    let relay = InProcessRelay::start(config);
    wait_for_slot(&client, &slot).await;
    wait_for("the relay to stream", Duration::from_secs(30), || async {
        relay.metrics.streaming.get() == 1
    })
    .await;

    nats.stop();
    insert_event(
        &client,
        "p2-1",
        "Claim",
        "4711",
        "ClaimApproved",
        r#"{"claim_id": 4711}"#,
    )
    .await;
    let after_commit = current_wal_lsn(&client).await;
    let max_confirmed =
        max_confirmed_below(&client, &slot, after_commit, "the unacknowledged commit").await;

    nats.start_again();
    let js = nats.jetstream().await;
    wait_for_count(&js, &stream, 1, 60).await;
    let all = read_all(&js, &stream).await;
    assert_eq!(ids(&all), ["p2-1"]);
    let commit = all[0].commit_lsn();
    assert!(
        max_confirmed <= commit,
        "P2: confirmed {max_confirmed} passed the commit at {commit} before its ack"
    );
    wait_confirmed_past(
        &client,
        &slot,
        commit,
        after_commit,
        "the acknowledged commit",
    )
    .await;
    relay.stop().await.expect("relay stops cleanly");
}

/// P1 + P3 across a crash: SIGKILL the relay in the middle of a 20,000-transaction backlog, start it
/// again; the stream holds each event exactly once.
#[tokio::test]
async fn kill_9_mid_backlog_loses_nothing_and_stores_no_duplicates() {
    const EVENTS: u64 = 20_000;
    let s = Scenario::builder().text_ids().start().await;
    let (db, _nats, config, client, js, slot, stream) = s.into_parts();
    let env = relay_env(&config);
    let setup = run_command(&["setup"], &env, Duration::from_secs(60));
    assert!(setup.status.success(), "setup: {}", setup.stderr);

    // 20,000 single-event transactions, committed before the relay starts.
    db.psql(&format!(
        "DO $$ BEGIN
           FOR i IN 1..{EVENTS} LOOP
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('k-' || i, 'Claim', i::text, 'ClaimApproved', jsonb_build_object('n', i));
             COMMIT;
           END LOOP;
         END $$;"
    ));

    let slot_start = confirmed_flush(&client, &slot).await.expect("slot exists");
    // Frequent status updates, so the kill lands after the slot moved: the restart then begins in
    // the middle of the backlog, not at its start.
    let mut env1 = env.clone();
    env1.push((
        "OUTBOX_RELAY_POSTGRES_STATUS_INTERVAL_MS".into(),
        "100".into(),
    ));
    let mut first = RelayProcess::spawn(&["run"], &env1);
    let deadline = Instant::now() + Duration::from_secs(60);
    let at_kill = loop {
        let n = stream_count(&js, &stream).await;
        if n >= 5_000
            && confirmed_flush(&client, &slot)
                .await
                .is_some_and(|c| c > slot_start)
        {
            break n;
        }
        assert!(first.is_running(), "relay exited early: {}", first.stderr());
        assert!(
            Instant::now() < deadline,
            "only {n} stored after 60 s: {}",
            first.stderr()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    first.signal("KILL");
    assert!(first.wait(Duration::from_secs(10)).is_some(), "SIGKILL");
    assert!(
        at_kill < EVENTS,
        "the backlog was done before the kill ({at_kill} stored): the test proves nothing"
    );
    let confirmed_at_kill = confirmed_flush(&client, &slot).await.expect("slot exists");
    let stored_at_kill = stream_count(&js, &stream).await;

    let mut env2 = env.clone();
    env2.push((
        "OUTBOX_RELAY_LOG_LEVEL".into(),
        "info,outbox_relay::relay=debug".into(),
    ));
    let mut second = RelayProcess::spawn(&["run"], &env2);
    wait_for_count(&js, &stream, EVENTS, 90).await;
    // Anything still in flight would show up now.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        stream_count(&js, &stream).await,
        EVENTS,
        "P3: duplicates stored"
    );
    let all = read_all(&js, &stream).await;
    assert_unique_ids(&all);
    let got: HashSet<&str> = all.iter().map(Stored::id).collect();
    let missing: Vec<String> = (1..=EVENTS)
        .map(|i| format!("k-{i}"))
        .filter(|id| !got.contains(id.as_str()))
        .take(10)
        .collect();
    assert!(missing.is_empty(), "P1: missing events, e.g. {missing:?}");
    for w in all.windows(2) {
        assert!(w[0].commit_lsn() < w[1].commit_lsn(), "P4: commit order");
    }

    second.signal("TERM");
    let status = second
        .wait(Duration::from_secs(15))
        .expect("exit on SIGTERM");
    let log = second.stderr();
    assert!(status.success(), "exit {status}: {log}");
    let duplicates = log.matches("duplicate dropped by JetStream").count();
    // The fence skips what the first relay stored; those are not ids used twice.
    assert!(
        !log.contains("already used by an earlier event"),
        "a replayed event was taken for a reused id: {log}"
    );
    eprintln!(
        "kill -9 test: {at_kill}..{stored_at_kill} stored at SIGKILL, slot confirmed {confirmed_at_kill} \
         (created at {slot_start}), {duplicates} republished events acknowledged as duplicates by JetStream"
    );
}

/// `run` on SIGTERM: waits for the acks in flight, confirms, exits 0; the slot is past the last commit.
#[tokio::test]
async fn sigterm_confirms_everything_and_exits_0() {
    let s = Scenario::builder().text_ids().start().await;
    let (db, _nats, config, client, js, slot, stream) = s.into_parts();
    let mut relay = RelayProcess::run(&config);
    wait_for_slot(&client, &slot).await;

    db.psql(
        "DO $$ BEGIN
           FOR t IN 0..99 LOOP
             FOR i IN 0..9 LOOP
               INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
               VALUES ('t-' || t || '-' || i, 'Claim', t::text, 'ClaimApproved', jsonb_build_object('i', i));
             END LOOP;
             COMMIT;
           END LOOP;
         END $$;",
    );
    let after_writes = current_wal_lsn(&client).await;
    wait_for_count(&js, &stream, 1_000, 60).await;

    relay.signal("TERM");
    let status = relay
        .wait(Duration::from_secs(15))
        .unwrap_or_else(|| panic!("no exit within 15 s of SIGTERM: {}", relay.stderr()));
    assert_eq!(status.code(), Some(0), "stderr: {}", relay.stderr());

    let all = read_all(&js, &stream).await;
    assert_eq!(all.len(), 1_000);
    assert_unique_ids(&all);
    let last_commit = all.iter().map(Stored::commit_lsn).max().unwrap();
    let confirmed = confirmed_flush(&client, &slot).await.expect("slot exists");
    // The relay confirms Commit.end_lsn, which is past the commit record's start (the header).
    assert!(
        confirmed > last_commit,
        "confirmed {confirmed} is not past the last commit at {last_commit} \
         (WAL after the writes: {after_writes})"
    );
    let active: bool = client
        .query_one(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!active, "the replication connection ended with the process");
}

/// P8: exit non-zero, stderr exactly one line that names `what`.
fn assert_clear_failure(f: &Finished, what: &str) {
    assert!(
        !f.status.success(),
        "expected failure naming {what}; stdout: {}",
        f.stdout
    );
    let stderr = f.stderr.trim();
    assert_eq!(
        stderr.lines().count(),
        1,
        "stderr must be one line naming {what}, got:\n{stderr}"
    );
    assert!(
        stderr.contains(what),
        "stderr does not name {what}: {stderr}"
    );
}

/// P8: nothing was created on Postgres or NATS.
async fn assert_nothing_created(
    client: &Client,
    js: &async_nats::jetstream::Context,
    stream: &str,
    slot: &str,
) {
    assert!(!slot_exists(client, slot).await, "slot {slot} was created");
    let publications: i64 = client
        .query_one("SELECT count(*) FROM pg_publication", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(publications, 0, "a publication was created");
    assert!(
        js.get_stream(stream).await.is_err(),
        "stream {stream} was created"
    );
}

/// P8: bad settings, wal_level and a missing table each end `run` with one clear line and change
/// nothing; an unreachable NATS ends `setup` so (`run` waits for it).
#[tokio::test]
async fn configuration_errors_are_one_clear_line_and_change_nothing() {
    let s = Scenario::builder().start().await;
    let (db, nats, config, client, js, slot, stream) = s.into_parts();
    let env = relay_env(&config);
    let limit = Duration::from_secs(60);

    // An unknown key in the file.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.toml");
    std::fs::write(&file, "[postgres]\nslto = \"x\"\n").unwrap();
    let f = run_command(&["run", "--config", file.to_str().unwrap()], &env, limit);
    assert_clear_failure(&f, "slto");
    assert!(
        f.stderr.contains("postgres"),
        "names the section: {}",
        f.stderr
    );

    // A value of the wrong type in the environment.
    let mut bad_env = env.clone();
    bad_env.push(("OUTBOX_RELAY_NATS_MAX_IN_FLIGHT".into(), "lots".into()));
    let f = run_command(&["run"], &bad_env, limit);
    assert_clear_failure(&f, "OUTBOX_RELAY_NATS_MAX_IN_FLIGHT");

    // An invalid value: names the key and its variable.
    let mut bad_slot = env.clone();
    bad_slot.retain(|(k, _)| k != "OUTBOX_RELAY_POSTGRES_SLOT");
    bad_slot.push(("OUTBOX_RELAY_POSTGRES_SLOT".into(), "Bad-Slot".into()));
    let f = run_command(&["run"], &bad_slot, limit);
    assert_clear_failure(&f, "postgres.slot");

    // The outbox table does not exist.
    let f = run_command(&["run"], &env, limit);
    assert_clear_failure(&f, "public.outbox");
    assert_nothing_created(&client, &js, &stream, &slot).await;

    // NATS unreachable: a port nothing listens on.
    db.psql(TEXT_ID_OUTBOX_SQL);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut no_nats = env.clone();
    no_nats.retain(|(k, _)| k != "OUTBOX_RELAY_NATS_URL");
    no_nats.push((
        "OUTBOX_RELAY_NATS_URL".into(),
        format!("nats://127.0.0.1:{port}"),
    ));
    // `setup` fails at once; `run` waits for the server instead (tests/integration/lifecycle.rs).
    let f = run_command(&["setup"], &no_nats, limit);
    assert_clear_failure(&f, "nats.url");
    assert_nothing_created(&client, &js, &stream, &slot).await;
    drop(client);
    drop(db);

    // wal_level = replica on a server of its own.
    let pg = PgServer::start_private();
    pg.psql("postgres", "ALTER SYSTEM SET wal_level = replica");
    pg.restart();
    let db = TestDb::create(&pg).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    let mut config = relay_config(&db, &nats);
    config.nats.stream = stream.clone();
    let f = run_command(&["run"], &relay_env(&config), limit);
    assert_clear_failure(&f, "wal_level");
    let client = db.client().await;
    assert_nothing_created(&client, &js, &stream, &config.postgres.slot).await;
}

/// `setup` twice: the second run finds everything; `status --json` says healthy (exit 0) while a
/// relay holds the slot, and not (exit 1) once it stopped and the slot was dropped. Uses the shipped
/// `sql/01_outbox_table.sql`.
#[tokio::test]
async fn setup_is_idempotent_and_status_reports_health() {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(&default_outbox_sql());
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let env = relay_env(&config);
    let (slot, publication, stream) = (
        config.postgres.slot.clone(),
        config.postgres.publication.clone(),
        config.nats.stream.clone(),
    );
    let limit = Duration::from_secs(60);

    let first = run_command(&["setup"], &env, limit);
    assert!(first.status.success(), "setup: {}", first.stderr);
    for (what, name) in [
        ("publication", &publication),
        ("slot", &slot),
        ("stream", &stream),
    ] {
        assert!(
            first.stdout.contains(&format!("{what} {name}: created")),
            "first setup creates {what}:\n{}",
            first.stdout
        );
    }
    let second = run_command(&["setup"], &env, limit);
    assert!(second.status.success(), "setup again: {}", second.stderr);
    for (what, name) in [
        ("publication", &publication),
        ("slot", &slot),
        ("stream", &stream),
    ] {
        assert!(
            second.stdout.contains(&format!("{what} {name}: exists")),
            "second setup finds {what}:\n{}",
            second.stdout
        );
    }
    assert!(!second.stdout.contains("created"), "{}", second.stdout);

    // Healthy while a relay holds the slot (without one, past the grace period, it is not).
    let mut relay = RelayProcess::spawn(&["run"], &env);
    let client = db.client().await;
    crate::hostile::wait_for_active_slot(&client, &slot).await;
    let status = run_command(&["status", "--json"], &env, limit);
    relay.signal("TERM");
    assert_eq!(
        relay.wait(limit).and_then(|s| s.code()),
        Some(0),
        "{}",
        relay.stderr()
    );
    assert_eq!(
        status.status.code(),
        Some(0),
        "status: {}{}",
        status.stdout,
        status.stderr
    );
    let json: serde_json::Value = serde_json::from_str(&status.stdout)
        .unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {}", status.stdout));
    assert_eq!(json["healthy"], serde_json::Value::Bool(true), "{json}");
    assert_eq!(
        json["slot"]["exists"],
        serde_json::Value::Bool(true),
        "{json}"
    );

    db.psql(&format!(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
         WHERE slot_name IN ('{slot}', '{slot}_mark')"
    ));
    let status = run_command(&["status", "--json"], &env, limit);
    assert_eq!(
        status.status.code(),
        Some(1),
        "status without slot: {}{}",
        status.stdout,
        status.stderr
    );
    let json: serde_json::Value = serde_json::from_str(&status.stdout)
        .unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {}", status.stdout));
    assert_eq!(json["healthy"], serde_json::Value::Bool(false), "{json}");
}

/// P7: an event whose aggregate type is not a subject token goes to the dead-letter subject with the
/// reason; the next event is still delivered.
#[tokio::test]
async fn bad_aggregate_type_is_dead_lettered_and_the_next_event_delivered() {
    let s = Scenario::builder().text_ids().start().await;
    let (_db, _nats, config, client, js, _slot, stream) = s.into_parts();
    let relay = InProcessRelay::start(config.clone());
    wait_for_slot(&client, &config.postgres.slot).await;

    insert_event(
        &client,
        "bad-1",
        "Bad Type",
        "1",
        "ClaimApproved",
        r#"{"n": 1}"#,
    )
    .await;
    insert_event(
        &client,
        "good-1",
        "Claim",
        "2",
        "ClaimApproved",
        r#"{"n": 2}"#,
    )
    .await;
    wait_for_count(&js, &stream, 2, 30).await;
    let all = read_all(&js, &stream).await;
    assert_eq!(ids(&all), ["bad-1", "good-1"]);
    let dead = &all[0];
    assert_eq!(dead.subject, "outbox_dead_letter");
    let error = dead.header("Outbox-Error");
    assert!(error.contains("aggregate_type"), "Outbox-Error: {error}");
    assert_eq!(dead.header("Outbox-Aggregate-Type"), "Bad Type");
    assert_eq!(dead.payload_str(), r#"{"n": 1}"#, "payload kept");
    assert_eq!(all[1].subject, "outbox.Claim");
    assert_eq!(relay.metrics.dead_letters.get(), 1);
    relay.stop().await.expect("relay stops cleanly");
}
