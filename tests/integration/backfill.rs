//! `outbox-relay backfill` against real servers: adopting a polling publisher's table while a writer
//! keeps inserting (no gap, no overlap with `run`), recovering after a lost slot (every duplicate
//! dropped, rate beside the live drain rate), a backfill stopped mid-way by SIGTERM, SIGINT or
//! kill -9 (its marker keeps `run`, `setup` and a waiting relay off its slot until a second
//! backfill finished), a stop while the slot waits for a running transaction (cancelled, nothing
//! changed), refusal while a relay streams, and a partitioned outbox whose partitions are
//! attached, detached and dropped while the relay streams.
//!
//! "No overlap" is checked without leaning on JetStream's deduplication: the backfill reports how
//! many of its rows the stream already held, and the relay counts the duplicates it met; both must
//! be 0 where nothing was published before.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use outbox_relay::backfill::{BackfillOptions, BackfillReport, backfill};
use outbox_relay::config::Config;
use tokio::task::JoinHandle;

use crate::support::{
    InProcessRelay, NatsServer, PgServer, RelayProcess, Scenario, TestDb, read_all, relay_config,
    relay_env, run_command, slot_exists, stream_count, wait_for,
};

const LIMIT: Duration = Duration::from_secs(120);

/// A polling publisher's table: ids, a `published_at` it sets once it has sent a row.
const POLLED_TABLE: &str = "CREATE TABLE outbox_event (
    event_id uuid PRIMARY KEY,
    aggregate_type varchar(80) NOT NULL,
    aggregate_id varchar(80) NOT NULL,
    event_type varchar(120) NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamp NOT NULL,
    published_at timestamp NULL,
    publish_attempts integer NOT NULL DEFAULT 0
);
CREATE INDEX ix_outbox_unpublished ON outbox_event(created_at) WHERE published_at IS NULL;";

fn env_with_table(config: &Config) -> Vec<(String, String)> {
    let mut env = relay_env(config);
    env.push((
        "OUTBOX_RELAY_OUTBOX_TABLE".into(),
        config.outbox.table.clone(),
    ));
    env
}

async fn js(nats: &NatsServer) -> jetstream::Context {
    jetstream::new(
        async_nats::connect(nats.url())
            .await
            .expect("connect to NATS"),
    )
}

/// A scenario with the text-id outbox table after `setup` (publication, slot and stream made),
/// taken apart: database, NATS server, config, JetStream context.
async fn set_up_text_ids() -> (TestDb, NatsServer, Config, jetstream::Context) {
    let s = Scenario::builder().text_ids().start().await;
    let settings = s.config.validate().unwrap();
    outbox_relay::setup::setup(&settings).await.expect("setup");
    let (db, nats, config, _client, js, _slot, _stream) = s.into_parts();
    (db, nats, config, js)
}

/// Message ids in the stream, with how often each is stored.
async fn stored_ids(js: &jetstream::Context, stream: &str) -> BTreeMap<String, usize> {
    let mut ids = BTreeMap::new();
    for m in read_all(js, stream).await {
        *ids.entry(m.id().to_owned()).or_insert(0) += 1;
    }
    ids
}

async fn run_backfill(config: &Config, opts: BackfillOptions) -> BackfillReport {
    let settings = config.validate().expect("valid config");
    backfill(&settings, opts, |_| {}).await.unwrap_or_else(|e| {
        panic!(
            "backfill failed: {}",
            outbox_relay::error_chain::error_chain(&e)
        )
    })
}

/// The ids of `outbox_event`'s rows where `condition` holds.
async fn polled_ids(client: &tokio_postgres::Client, condition: &str) -> HashSet<String> {
    let sql = format!("SELECT event_id::text FROM outbox_event WHERE {condition}");
    let rows = client.query(&sql, &[]).await.expect("read outbox_event");
    rows.iter().map(|r| r.get(0)).collect()
}

/// Inserts one row per transaction into `outbox_event` until stopped; returns the ids it committed.
fn start_writer(db: &TestDb, stop: Arc<AtomicBool>) -> JoinHandle<Vec<String>> {
    let url = db.url();
    tokio::spawn(async move {
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("writer connects");
        tokio::spawn(conn);
        let mut ids = Vec::new();
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            let row = client
                .query_one(
                    "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, created_at) \
                     VALUES (gen_random_uuid(), 'Order', $1, 'OrderConfirmed', '{\"live\": true}', now()) \
                     RETURNING event_id::text",
                    &[&format!("W-{n}")],
                )
                .await
                .expect("writer inserts");
            ids.push(row.get(0));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        ids
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adoption_of_a_polled_table_has_no_gap_and_no_overlap() {
    let db = TestDb::create(PgServer::shared()).await;
    let nats = NatsServer::start();
    db.psql(POLLED_TABLE);
    db.psql(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, created_at, published_at) \
         SELECT gen_random_uuid(), 'Order', 'O-' || i, 'OrderConfirmed', jsonb_build_object('n', i), \
                now() - interval '1 hour' + i * interval '1 second', \
                CASE WHEN i <= 100 THEN now() - interval '30 minutes' END \
         FROM generate_series(1, 400) AS i",
    );
    let client = db.client().await;
    let published = polled_ids(&client, "published_at IS NOT NULL").await;
    let waiting = polled_ids(&client, "published_at IS NULL").await;
    assert_eq!((published.len(), waiting.len()), (100, 300));

    let mut config = relay_config(&db, &nats);
    config.outbox.table = "public.outbox_event".into();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = start_writer(&db, Arc::clone(&stop));
    tokio::time::sleep(Duration::from_millis(300)).await;

    let env = env_with_table(&config);
    let out = tokio::task::spawn_blocking(move || {
        run_command(
            &[
                "backfill",
                "--where",
                "published_at IS NULL",
                "--order-by",
                "created_at, event_id",
            ],
            &env,
            LIMIT,
        )
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "backfill failed:\n{}\n{}",
        out.stdout,
        out.stderr
    );
    assert!(
        out.stdout.contains("0 already in the stream"),
        "{}",
        out.stdout
    );
    assert!(
        out.stderr.contains("backfill: "),
        "progress: {}",
        out.stderr
    );

    let relay = InProcessRelay::start(config.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    let written = writer.await.unwrap();
    assert!(
        written.len() > 50,
        "the writer wrote only {}",
        written.len()
    );
    let js = js(&nats).await;
    let expected = waiting.len() + written.len();
    wait_for("every waiting and written row", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await >= expected as u64
    })
    .await;
    // Anything extra (an overlap the dedup window did not catch, a published row) would come now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ids = stored_ids(&js, &config.nats.stream).await;
    let want: HashSet<String> = waiting.iter().chain(written.iter()).cloned().collect();
    let got: HashSet<String> = ids.keys().cloned().collect();
    assert_eq!(got, want, "stored ids differ from waiting + written");
    assert!(ids.values().all(|&n| n == 1), "an id is stored twice");
    assert!(
        got.is_disjoint(&published),
        "a published row was sent again"
    );
    assert_eq!(
        relay.metrics.published_duplicate.get(),
        0,
        "run republished a backfilled row (overlap)"
    );
    relay.stop().await.expect("relay stops cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_after_a_lost_slot_republishes_without_new_copies() {
    const N: u64 = 10_000;
    let (db, _nats, config, js) = set_up_text_ids().await;
    let settings = config.validate().unwrap();
    db.psql(&format!(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'e-' || i, 'Claim', i::text, 'ClaimApproved', jsonb_build_object('claim', i) \
         FROM generate_series(1, {N}) AS i"
    ));
    // The live drain rate of the same rows, as the baseline.
    let t = Instant::now();
    let relay = InProcessRelay::start(config.clone());
    wait_for("the live relay to drain", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await >= N
    })
    .await;
    let live = N as f64 / t.elapsed().as_secs_f64();
    relay.stop().await.unwrap();

    // The slot is lost; run now refuses (P9) and names backfill.
    db.psql(&format!(
        "SELECT pg_drop_replication_slot('{}')",
        config.postgres.slot
    ));
    let err = outbox_relay::setup::setup(&settings).await.unwrap_err();
    assert!(err.to_string().contains("backfill"), "{err}");

    let report = run_backfill(&config, BackfillOptions::default()).await;
    let rate = report.rate();
    eprintln!(
        "recovery: backfill {N} rows at {rate:.0}/s, live drain {live:.0}/s ({:.2}x)",
        rate / live
    );
    assert_eq!(report.rows, N);
    assert_eq!(
        report.duplicates, N,
        "every row was in the stream: {report:?}"
    );
    assert_eq!(report.stored, 0);
    assert!(
        report.elapsed < Duration::from_secs(60),
        "{:?}",
        report.elapsed
    );
    let ids = stored_ids(&js, &config.nats.stream).await;
    assert_eq!(ids.len() as u64, N);
    assert!(ids.values().all(|&n| n == 1));

    // run continues from the new slot.
    let relay = InProcessRelay::start(config.clone());
    db.psql(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('after-1', 'Claim', '1', 'ClaimPaid', '{}'), ('after-2', 'Claim', '2', 'ClaimPaid', '{}')",
    );
    wait_for("run to publish the new rows", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await >= N + 2
    })
    .await;
    relay.stop().await.unwrap();
    let all = read_all(&js, &config.nats.stream).await;
    assert_eq!(all.len() as u64, N + 2);
    let last = &all[all.len() - 1];
    assert_eq!(last.id(), "after-2");
    assert!(last.commit_lsn() > report.commit_lsn);
}

/// Rows in the interrupted-backfill tests: enough that a backfill is far from done after its
/// first few thousand acks.
const INTERRUPTED_ROWS: u64 = 30_000;
/// Acks before the backfill is stopped.
const STOP_AFTER: u64 = 3_000;

/// A table of `INTERRUPTED_ROWS` rows `<prefix>-1…`, and the relay's config for it.
async fn interrupted_setup(prefix: &str) -> (TestDb, NatsServer, Config, jetstream::Context) {
    let s = Scenario::builder()
        .text_ids()
        .sql(&format!(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT '{prefix}-' || i, 'Claim', i::text, 'ClaimApproved', jsonb_build_object('claim', i, 'pad', repeat('x', 200)) \
             FROM generate_series(1, {INTERRUPTED_ROWS}) AS i"
        ))
        .start()
        .await;
    let (db, nats, config, _client, js, _slot, _stream) = s.into_parts();
    (db, nats, config, js)
}

/// Starts `backfill` as the binary and waits until the stream holds `STOP_AFTER` of its rows.
async fn backfill_until_some_stored(
    config: &Config,
    js: &jetstream::Context,
    args: &[&str],
) -> RelayProcess {
    let p = RelayProcess::spawn(args, &relay_env(config));
    wait_for("the backfill to store some rows", LIMIT, || async {
        stream_count(js, &config.nats.stream).await >= STOP_AFTER
    })
    .await;
    p
}

/// Runs a command of the binary to its end (off the test's runtime threads).
async fn command(
    args: &'static [&'static str],
    env: Vec<(String, String)>,
) -> crate::support::Finished {
    tokio::task::spawn_blocking(move || run_command(args, &env, Duration::from_secs(60)))
        .await
        .unwrap()
}

/// `run` and `setup` refuse while the marker stands, with one line naming it and the recovery.
async fn run_and_setup_refuse(config: &Config) {
    for args in [&["run"][..], &["setup"][..]] {
        let out = command(args, relay_env(config)).await;
        assert!(
            !out.status.success(),
            "{args:?} went on past the unfinished backfill:\n{}\n{}",
            out.stdout,
            out.stderr
        );
        let line = out
            .stderr
            .lines()
            .find(|l| l.starts_with("outbox-relay: "))
            .unwrap_or_else(|| panic!("{args:?}: no error line in\n{}", out.stderr));
        eprintln!("{args:?}: {line}");
        assert!(
            line.contains("outbox-relay.backfill")
                && line.contains("run `outbox-relay backfill` (with ")
                && line.contains("set as for this command) again"),
            "{args:?}: {line}"
        );
    }
}

/// The stopped or killed backfill is run again, then `run` goes on from its slot: every row and
/// a row written afterwards are in the stream, each once.
async fn recover_and_check_every_row(
    db: &TestDb,
    config: &Config,
    js: &jetstream::Context,
    prefix: &str,
) {
    let out = command(&["backfill"], relay_env(config)).await;
    assert!(
        out.status.success(),
        "the recovery backfill failed:\n{}\n{}",
        out.stdout,
        out.stderr
    );
    let relay = InProcessRelay::start(config.clone());
    db.psql(&format!(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('{prefix}-after', 'Claim', '1', 'ClaimPaid', '{{}}')"
    ));
    wait_for(
        "run to publish the row written after the recovery",
        LIMIT,
        || async { stream_count(js, &config.nats.stream).await > INTERRUPTED_ROWS },
    )
    .await;
    relay
        .stop()
        .await
        .expect("the relay runs after the recovery");
    let ids = stored_ids(js, &config.nats.stream).await;
    assert_eq!(
        ids.len() as u64,
        INTERRUPTED_ROWS + 1,
        "{} of {} ids stored",
        ids.len(),
        INTERRUPTED_ROWS + 1
    );
    assert!(ids.values().all(|&n| n == 1), "an id is stored twice");
    assert!(ids.contains_key(&format!("{prefix}-after")));
}

/// A backfill stopped by `signal` mid-way drops the slot it created and says so in one line that
/// names what is left (the marker) and how to finish; `run` and `setup` refuse until a second
/// backfill has finished, and then every row is in the stream.
async fn a_signal_mid_backfill(signal: &str, prefix: &str) {
    let (db, _nats, config, js) = interrupted_setup(prefix).await;
    let mut p = backfill_until_some_stored(&config, &js, &["backfill"]).await;
    p.signal(signal);
    let status = p.wait(Duration::from_secs(30)).expect("the backfill stops");
    let at_stop = stream_count(&js, &config.nats.stream).await;
    assert!(
        at_stop < INTERRUPTED_ROWS,
        "the backfill finished before the signal"
    );
    let stderr = p.stderr();
    assert!(
        !status.success(),
        "a stopped backfill exits non-zero: {status:?}"
    );
    let line = stderr
        .lines()
        .find(|l| l.starts_with("outbox-relay: "))
        .unwrap_or_else(|| panic!("no error line after SIG{signal} ({status:?}):\n{stderr}"));
    eprintln!("SIG{signal}: {line}");
    assert!(
        line.contains(&format!("stopped by SIG{signal}"))
            && line.contains("was dropped")
            && line.contains("outbox-relay.backfill")
            && line.contains("run `outbox-relay backfill` (with ")
            && line.contains("set as for this command) again"),
        "{line}"
    );
    let client = db.client().await;
    assert!(
        !slot_exists(&client, &config.postgres.slot).await,
        "the stopped backfill left its slot behind"
    );
    run_and_setup_refuse(&config).await;
    recover_and_check_every_row(&db, &config, &js, prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_backfill_drops_the_slot_and_a_rerun_publishes_every_row() {
    a_signal_mid_backfill("TERM", "t").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_mid_backfill_drops_the_slot_and_a_rerun_publishes_every_row() {
    a_signal_mid_backfill("INT", "i").await;
}

/// Creating the slot waits for every transaction that was running; a stop then cancels the
/// creation instead of waiting with it: the backfill exits at once saying nothing was changed, and
/// no slot appears when the transaction ends (a walsender left to finish would make one, with no
/// backfill behind it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_while_the_slot_waits_for_a_transaction_changes_nothing() {
    let (db, _nats, config, js) = interrupted_setup("c").await;
    let blocker = db.client().await;
    blocker
        .batch_execute("BEGIN; SELECT txid_current();")
        .await
        .expect("a transaction with an xid");
    let mut p = RelayProcess::spawn(&["backfill"], &relay_env(&config));
    let client = db.client().await;
    wait_for("the slot's creation to wait", LIMIT, || async {
        slot_exists(&client, &config.postgres.slot).await
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    p.signal("INT");
    let status = p.wait(Duration::from_secs(15));
    blocker.batch_execute("COMMIT").await.expect("commit");
    let status = status.unwrap_or_else(|| {
        panic!(
            "the backfill did not stop while its slot waited:\n{}",
            p.stderr()
        )
    });
    let stderr = p.stderr();
    let line = stderr
        .lines()
        .find(|l| l.starts_with("outbox-relay: "))
        .unwrap_or_else(|| panic!("no error line after SIGINT ({status:?}):\n{stderr}"));
    eprintln!("SIGINT: {line}");
    assert!(!status.success());
    assert!(
        line.contains("stopped by SIGINT") && line.contains("nothing was changed"),
        "{line}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !slot_exists(&client, &config.postgres.slot).await,
        "a slot appeared after the stop"
    );
    assert_eq!(stream_count(&js, &config.nats.stream).await, 0);
    let out = command(&["status", "--json"], relay_env(&config)).await;
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("status --json");
    assert!(v["backfill"].is_null(), "no marker is left: {v}");
    // Nothing was changed, so the backfill can simply run now.
    recover_and_check_every_row(&db, &config, &js, "c").await;
}

/// kill -9 leaves the slot behind, past rows never published: `run` and `setup` refuse with the
/// marker, `status` exits 1 naming the recovery (text and JSON), and the recovery, a plain
/// `backfill` again, replaces the slot and publishes every row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_backfill_makes_run_setup_and_status_name_the_recovery() {
    let (db, _nats, config, js) = interrupted_setup("k").await;
    let mut p = backfill_until_some_stored(&config, &js, &["backfill"]).await;
    p.signal("KILL");
    p.wait(Duration::from_secs(10)).expect("killed");
    let at_kill = stream_count(&js, &config.nats.stream).await;
    assert!(
        at_kill < INTERRUPTED_ROWS,
        "the backfill finished before the kill"
    );
    let client = db.client().await;
    assert!(
        slot_exists(&client, &config.postgres.slot).await,
        "kill -9 leaves the slot: nothing could drop it"
    );

    run_and_setup_refuse(&config).await;
    let out = command(&["status"], relay_env(&config)).await;
    assert_eq!(out.status.code(), Some(1), "{}", out.stdout);
    assert!(
        out.stdout.contains("backfill: NOT FINISHED")
            && out
                .stdout
                .contains("once it no longer runs, run `outbox-relay backfill`"),
        "{}",
        out.stdout
    );
    let out = command(&["status", "--json"], relay_env(&config)).await;
    assert_eq!(out.status.code(), Some(1), "{}", out.stdout);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("status --json");
    assert!(
        v["backfill"]["recover"]
            .as_str()
            .is_some_and(|r| r.starts_with("run `outbox-relay backfill`")),
        "{v}"
    );
    assert_eq!(v["backfill"]["slot"], config.postgres.slot.as_str(), "{v}");
    assert_eq!(v["backfill"]["marker"], "outbox-relay.backfill", "{v}");
    assert!(
        v["backfill"]["pid"]
            .as_u64()
            .is_some_and(|pid| pid == u64::from(p.pid())),
        "{v}"
    );
    assert_eq!(v["healthy"], false);

    let config_before = stream_config_without_metadata(&js, &config.nats.stream).await;
    recover_and_check_every_row(&db, &config, &js, "k").await;
    assert_eq!(
        stream_config_without_metadata(&js, &config.nats.stream).await,
        config_before,
        "setting and clearing the marker changed the stream's configuration"
    );
    let out = command(&["status", "--json"], relay_env(&config)).await;
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("status --json");
    assert!(
        v["backfill"].is_null(),
        "the marker is gone after the recovery: {v}"
    );
}

/// The stream's configuration as the server sends it, without its metadata.
async fn stream_config_without_metadata(
    js: &jetstream::Context,
    stream: &str,
) -> serde_json::Value {
    let mut info: serde_json::Value = js
        .request(format!("STREAM.INFO.{stream}"), &serde_json::json!({}))
        .await
        .expect("stream info");
    let cfg = info["config"].take();
    let mut cfg = cfg.as_object().cloned().expect("a configuration");
    cfg.remove("metadata");
    serde_json::Value::Object(cfg)
}

/// A relay whose setup passed before a backfill began, retrying while Postgres is out of its
/// reach, must not take the slot a killed backfill left: its next session stops with the marker's
/// refusal instead of streaming past the rows the backfill never published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_relay_does_not_take_the_slot_of_a_killed_backfill() {
    let (db, _nats, config, js) = interrupted_setup("w").await;
    let settings = config.validate().unwrap();
    outbox_relay::setup::setup(&settings).await.expect("setup");
    let proxy = crate::support::Proxy::start(PgServer::shared().port());
    let mut via_proxy = config.clone();
    via_proxy.postgres.url = proxy.postgres_url(&config.postgres.url);
    let client = db.client().await;
    let relay = InProcessRelay::start_streaming(&via_proxy, &client).await;
    let slot = config.postgres.slot.clone();
    let active = || async {
        client
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(false)
    };
    wait_for("the relay to stream", LIMIT, || async { active().await }).await;
    // Postgres out of the relay's reach: it retries, its setup long done.
    proxy.refuse(true);
    proxy.cut();
    wait_for("the relay to let go of the slot", LIMIT, || async {
        !active().await
    })
    .await;

    let mut p = backfill_until_some_stored(&config, &js, &["backfill", "--replace-slot"]).await;
    p.signal("KILL");
    p.wait(Duration::from_secs(10)).expect("killed");
    assert!(stream_count(&js, &config.nats.stream).await < INTERRUPTED_ROWS);
    proxy.refuse(false);
    wait_for(
        "the relay to refuse the killed backfill's slot",
        LIMIT,
        || async { relay.is_finished() },
    )
    .await;
    let err = relay.stop().await.expect_err("the relay stops");
    let text = outbox_relay::error_chain::error_chain(&err);
    assert!(text.contains("outbox-relay.backfill"), "{text}");
    assert!(!active().await, "the slot is streamed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_is_refused_while_a_relay_streams() {
    let s = Scenario::builder()
        .text_ids()
        .sql(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('r-1', 'Claim', '1', 'ClaimApproved', '{}')",
        )
        .start()
        .await;
    let (_db, _nats, config, client, js, slot, _stream) = s.into_parts();
    let relay = InProcessRelay::start(config.clone());
    // A slot being created is active before it has a consistent point (confirmed_flush_lsn NULL).
    wait_for("the relay to stream", LIMIT, || async {
        client
            .query_opt(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active \
                 AND confirmed_flush_lsn IS NOT NULL AND active_pid IS NOT NULL",
                &[&slot],
            )
            .await
            .unwrap()
            .is_some()
    })
    .await;
    // The relay streaming the slot keeps its pid; its confirmed position may move on (an idle relay
    // confirms the WAL end the server reports, and other tests write WAL), never back.
    let slot_state = |row: tokio_postgres::Row| (row.get::<_, i32>(0), row.get::<_, String>(1));
    let before = client
        .query_one(
            "SELECT active_pid, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map(slot_state)
        .unwrap();
    let messages = stream_count(&js, &config.nats.stream).await;
    for replace in [false, true] {
        let settings = config.validate().unwrap();
        let opts = BackfillOptions {
            replace_slot: replace,
            ..Default::default()
        };
        let err = backfill(&settings, opts, |_| {}).await.unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("in use by PID") && text.contains("stop every relay"),
            "{text}"
        );
    }
    let after = client
        .query_one(
            "SELECT active_pid, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map(slot_state)
        .unwrap();
    assert_eq!(before.0, after.0, "another process took the slot");
    let lsn = |s: &str| s.parse::<outbox_relay::Lsn>().expect("an LSN");
    assert!(
        lsn(&after.1) >= lsn(&before.1),
        "the slot went back: {before:?} {after:?}"
    );
    assert_eq!(stream_count(&js, &config.nats.stream).await, messages);
    assert!(!relay.is_finished());
    relay.stop().await.unwrap();
}

const PARTITIONED: &str = "CREATE TABLE public.outbox (
    event_id       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, created_at)
) PARTITION BY RANGE (created_at);
CREATE TABLE outbox_2025_01 PARTITION OF outbox FOR VALUES FROM ('2025-01-01') TO ('2025-02-01');
CREATE TABLE outbox_2025_02 PARTITION OF outbox FOR VALUES FROM ('2025-02-01') TO ('2025-03-01');";

fn insert_at(id: &str, at: &str) -> String {
    format!(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, created_at) \
         VALUES ('{id}', 'Claim', '1', 'ClaimApproved', '{{}}', '{at}');"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_outbox_through_backfill_run_and_partition_changes() {
    let db = TestDb::create(PgServer::shared()).await;
    let nats = NatsServer::start();
    db.psql(PARTITIONED);
    db.psql(&(insert_at("p-1", "2025-01-10") + &insert_at("p-2", "2025-02-10")));
    let config = relay_config(&db, &nats);
    // A fresh install: backfill creates publication (via the root), stream and slot.
    let report = run_backfill(&config, BackfillOptions::default()).await;
    assert_eq!((report.rows, report.stored), (2, 2));
    let client = db.client().await;
    let via_root: bool = client
        .query_one(
            "SELECT pubviaroot FROM pg_publication WHERE pubname = $1",
            &[&config.postgres.publication],
        )
        .await
        .unwrap()
        .get(0);
    assert!(via_root, "the publication publishes via the root");

    let relay = InProcessRelay::start(config.clone());
    let js = js(&nats).await;
    let stream = config.nats.stream.clone();
    let mut want = vec!["p-1", "p-2"];
    let wait_all = |want: Vec<&'static str>| {
        let js = js.clone();
        let stream = stream.clone();
        async move {
            wait_for(&format!("{} events", want.len()), LIMIT, || async {
                stream_count(&js, &stream).await >= want.len() as u64
            })
            .await;
            let ids: Vec<String> = read_all(&js, &stream)
                .await
                .iter()
                .map(|m| m.id().to_owned())
                .collect();
            assert_eq!(ids, want);
        }
    };
    db.psql(&(insert_at("p-3", "2025-01-11") + &insert_at("p-4", "2025-02-11")));
    want.extend(["p-3", "p-4"]);
    wait_all(want.clone()).await;

    // Attach a new month, write into it, detach and drop an old one: none of it is an event.
    db.psql(
        "CREATE TABLE outbox_2025_03 PARTITION OF outbox FOR VALUES FROM ('2025-03-01') TO ('2025-04-01');",
    );
    db.psql(&insert_at("p-5", "2025-03-05"));
    db.psql("ALTER TABLE outbox DETACH PARTITION outbox_2025_01; DROP TABLE outbox_2025_01;");
    db.psql(&(insert_at("p-6", "2025-02-12") + &insert_at("p-7", "2025-03-06")));
    want.extend(["p-5", "p-6", "p-7"]);
    wait_all(want.clone()).await;

    // A publication that sends partitions under their own names: the stage maps them to the root,
    // including a partition attached after that, whose columns are in another order.
    db.psql(&format!(
        "ALTER PUBLICATION {} SET (publish_via_partition_root = false)",
        config.postgres.publication
    ));
    db.psql(&(insert_at("p-8", "2025-02-13") + &insert_at("p-9", "2025-03-07")));
    db.psql(
        "CREATE TABLE outbox_2025_04 (created_at timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL, \
           event_type text NOT NULL, aggregate_id text NOT NULL, aggregate_type text NOT NULL, event_id text NOT NULL); \
         ALTER TABLE outbox ATTACH PARTITION outbox_2025_04 FOR VALUES FROM ('2025-04-01') TO ('2025-05-01');",
    );
    db.psql(&insert_at("p-10", "2025-04-02"));
    want.extend(["p-8", "p-9", "p-10"]);
    wait_all(want.clone()).await;
    let all = read_all(&js, &stream).await;
    let last = all.last().unwrap();
    assert_eq!(last.subject, "outbox.Claim");
    assert_eq!(last.header("Outbox-Event-Type"), "ClaimApproved");
    assert!(!relay.is_finished(), "the relay stopped");
    relay.stop().await.unwrap();
}

fn shipped_sql(name: &str) -> String {
    let path = format!("{}/sql/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_partitioned_outbox_creates_and_drops_months_while_streaming() {
    let db = TestDb::create(PgServer::shared()).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    db.psql(&shipped_sql("07_partitioned_outbox.sql"));
    db.psql(&format!(
        "\\set publication {}\n{}",
        config.postgres.publication,
        shipped_sql("02_publication.sql")
    ));
    let client = db.client().await;
    let via_root: bool = client
        .query_one(
            "SELECT pubviaroot FROM pg_publication WHERE pubname = $1",
            &[&config.postgres.publication],
        )
        .await
        .unwrap()
        .get(0);
    assert!(via_root);
    // An old month, to be dropped by retention while the relay streams.
    let part: String = client
        .query_one("SELECT public.outbox_create_partition('2020-01-20')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(part, "outbox_p202001");
    let relay = InProcessRelay::start(config.clone());
    // Rows written before the slot exists are not the relay's (that is what backfill is for).
    // A slot shows before its consistent point is found; rows written then are not decoded.
    wait_for("the slot", LIMIT, || async {
        crate::support::confirmed_flush(&client, &config.postgres.slot)
            .await
            .is_some()
    })
    .await;
    let insert = |at: &str| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) \
             VALUES ('Claim', '1', 'ClaimApproved', '{{}}', {at});"
        )
    };
    db.psql(&(insert("'2020-01-15'") + &insert("now()") + &insert("now() + interval '1 month'")));
    let js = js(&nats).await;
    wait_for("three events", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await >= 3
    })
    .await;
    let dropped: Vec<String> = client
        .query(
            "SELECT public.outbox_drop_partitions(interval '3 months')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(dropped, vec!["outbox_p202001".to_owned()]);
    let next: String = client
        .query_one("SELECT public.outbox_create_partition()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(next.starts_with("outbox_p"), "{next}");
    db.psql(&insert("now()"));
    wait_for("the fourth event", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await >= 4
    })
    .await;
    assert!(!relay.is_finished());
    relay.stop().await.unwrap();
    assert_eq!(stream_count(&js, &config.nats.stream).await, 4);
}

/// A typo in `--where` or `--order-by` with `--replace-slot` leaves the healthy slot exactly as it
/// was (same position), creates nothing, and names the option; the relay then resumes from it.
#[tokio::test]
async fn a_typo_in_where_or_order_by_leaves_the_slot_as_it_was() {
    let (db, _nats, config, js) = set_up_text_ids().await;
    let settings = config.validate().unwrap();
    let relay = InProcessRelay::start(config.clone());
    db.psql(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('before-1', 'Claim', '4711', 'ClaimApproved', '{}')",
    );
    wait_for("the relay to publish", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await >= 1
    })
    .await;
    relay.stop().await.unwrap();
    let slot_state = || {
        db.psql(&format!(
            "SELECT confirmed_flush_lsn::text || ' ' || restart_lsn::text FROM pg_replication_slots \
             WHERE slot_name = '{}'",
            config.postgres.slot
        ))
    };
    let before = slot_state();
    assert!(!before.is_empty(), "the slot exists");

    for (opts, names) in [
        (
            BackfillOptions {
                where_sql: Some("nonexistent_col = 1".into()),
                replace_slot: true,
                ..BackfillOptions::default()
            },
            "nonexistent_col",
        ),
        (
            BackfillOptions {
                order_by: Some("created_att".into()),
                replace_slot: true,
                ..BackfillOptions::default()
            },
            "created_att",
        ),
        (
            BackfillOptions {
                where_sql: Some("true); DROP TABLE outbox; SELECT (1".into()),
                replace_slot: true,
                ..BackfillOptions::default()
            },
            "--where",
        ),
    ] {
        let e = backfill(&settings, opts, |_| {}).await.unwrap_err();
        let text = outbox_relay::error_chain::error_chain(&e);
        assert!(text.contains(names), "names {names}: {text}");
        // It used to say "reading … in the slot's snapshot failed", but no slot was made for it.
        assert!(
            text.contains("before any slot was created or changed") && !text.contains("snapshot"),
            "{text}"
        );
        assert_eq!(slot_state(), before, "the slot is untouched after: {text}");
    }
    assert!(slot_exists(&db.client().await, &config.postgres.slot).await);

    // The relay resumes from the untouched slot: the event written meanwhile arrives, once.
    db.psql(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('after-1', 'Claim', '4711', 'ClaimPaid', '{}')",
    );
    let relay = InProcessRelay::start(config.clone());
    wait_for("the relay to resume", LIMIT, || async {
        stored_ids(&js, &config.nats.stream)
            .await
            .contains_key("after-1")
    })
    .await;
    relay.stop().await.unwrap();
    let ids = stored_ids(&js, &config.nats.stream).await;
    assert_eq!(ids.get("before-1"), Some(&1), "{ids:?}");
    assert_eq!(ids.get("after-1"), Some(&1), "{ids:?}");
}

/// The major-upgrade procedure of docs/recovery.md: writers stop, the relay drains and stops, the
/// upgrade loses the slot; `setup` then refuses (the stream holds events), `backfill --where false`
/// creates the slot and publishes nothing, and `run` goes on with the events written after it.
#[tokio::test]
async fn the_documented_major_upgrade_procedure_works() {
    let (db, _nats, config, js) = set_up_text_ids().await;
    let settings = config.validate().unwrap();
    let insert = |id: &str| {
        db.psql(&format!(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('{id}', 'Claim', '4711', 'ClaimApproved', '{{}}')"
        ));
    };

    // Steps 1-3: the last writes, the relay drains, it stops.
    let relay = InProcessRelay::start(config.clone());
    insert("before-upgrade");
    wait_for("the relay to drain", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await >= 1
    })
    .await;
    relay.stop().await.unwrap();
    // Step 4: the upgrade loses the slot.
    db.psql(&format!(
        "SELECT pg_drop_replication_slot('{}')",
        config.postgres.slot
    ));
    // Step 5: setup refuses and names backfill; backfill --where false creates the slot.
    let e = outbox_relay::setup::setup(&settings).await.unwrap_err();
    assert!(e.to_string().contains("backfill"), "{e}");
    let report = run_backfill(
        &config,
        BackfillOptions {
            where_sql: Some("false".into()),
            ..BackfillOptions::default()
        },
    )
    .await;
    assert_eq!(report.rows, 0, "{report:?}");
    assert!(slot_exists(&db.client().await, &config.postgres.slot).await);
    // Step 6: writers again; run publishes what they write, and nothing twice.
    let relay = InProcessRelay::start(config.clone());
    insert("after-upgrade");
    wait_for("the event after the upgrade", LIMIT, || async {
        stored_ids(&js, &config.nats.stream)
            .await
            .contains_key("after-upgrade")
    })
    .await;
    relay.stop().await.unwrap();
    let ids = stored_ids(&js, &config.nats.stream).await;
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(ids.values().all(|&n| n == 1), "{ids:?}");
}
