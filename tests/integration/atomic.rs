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

/// The batch id of every message of a transaction written by [`write_transactions`], by
/// transaction, and the number of batches.
fn batches_by_transaction(
    all: &[crate::support::Stored],
) -> (BTreeMap<String, Vec<String>>, usize) {
    let mut by_txn: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut batches = std::collections::BTreeSet::new();
    for m in all {
        let batch = m.header("Nats-Batch-Id").to_owned();
        assert!(!batch.is_empty(), "{} carries no Nats-Batch-Id", m.id());
        by_txn
            .entry(txn_of(m.id()).to_owned())
            .or_default()
            .push(batch.clone());
        batches.insert(batch);
    }
    (by_txn, batches.len())
}

/// Group commit (`nats.atomic_group_ms`): 300 transactions written while the relay streams share
/// batches, many to one, and yet each lies in exactly one batch, whole. With a window of 20
/// messages (the batch limit then), transactions of 7 events group by two: a third would not fit,
/// so the batch is committed before it, and the third starts the next one rather than being
/// split. With `atomic_group_ms = 0`, every transaction is a batch of its own.
#[tokio::test]
async fn transactions_share_batches_yet_each_lies_whole_in_one() {
    for group_ms in [1, 0] {
        let db = text_id_db().await;
        let nats = NatsServer::start();
        let mut config = relay_config(&db, &nats);
        config.nats.atomic_transactions = true;
        config.nats.atomic_group_ms = group_ms;
        config.nats.max_in_flight = 20;
        let stream = config.nats.stream.clone();
        let client = db.client().await;
        let relay = InProcessRelay::start_streaming(&config, &client).await;
        let js = nats.jetstream().await;
        let mut sizes: Vec<u64> = vec![1; 200];
        sizes.extend([7; 100]);
        let ids = write_transactions(&db, "g", &sizes);
        let tally = assert_all_stored_once_in_order(&js, &stream, &ids).await;
        tally.report(
            &format!("grouped atomic transactions (atomic_group_ms {group_ms})"),
            1,
        );
        let all = read_all(&js, &stream).await;
        let (by_txn, batches) = batches_by_transaction(&all);
        for (txn, of) in &by_txn {
            assert!(
                of.iter().all(|b| *b == of[0]),
                "transaction {txn} is split over batches {of:?} (atomic_group_ms {group_ms})"
            );
        }
        // Every batch holds whole transactions only: no two transactions' batches interleave.
        let per_batch = all.windows(2).filter(|w| {
            w[0].header("Nats-Batch-Id") == w[1].header("Nats-Batch-Id")
                && txn_of(w[0].id()) != txn_of(w[1].id())
        });
        let shared = per_batch.count();
        eprintln!(
            "atomic_group_ms {group_ms}: {} transactions in {batches} batches",
            by_txn.len()
        );
        if group_ms == 0 {
            assert_eq!(batches, by_txn.len(), "one batch per transaction");
            assert_eq!(shared, 0);
        } else {
            // Written in one burst, transactions wait while each batch is stored: they group.
            assert!(
                batches * 2 < by_txn.len(),
                "{batches} batches for {} transactions: not grouped",
                by_txn.len()
            );
            // No batch holds more than the window: 7-event transactions at most two to one.
            let mut count: BTreeMap<&str, usize> = BTreeMap::new();
            for m in &all {
                *count.entry(m.header("Nats-Batch-Id")).or_default() += 1;
            }
            assert!(
                count.values().all(|&n| n <= 20),
                "a batch over the window: {count:?}"
            );
        }
        assert_eq!(
            relay.metrics.reconnects.get(),
            0,
            "no restart (atomic_group_ms {group_ms})"
        );
        relay.stop().await.expect("relay stops cleanly");
    }
}

/// A transaction that ends while the batch before it is held in flight (by a black hole between
/// the relay and NATS) waits behind it, and is stored whole after it once the black hole lifts,
/// before its own bound (1 s) has passed: A's ack arrives first, and B's members, already sent,
/// are then the oldest messages in the window, answered only by B's commit. Nothing else happens
/// (no later transaction), so B's commit comes from its bound, without an ack timeout or a restart.
/// When it comes is not asserted (a timed assertion): a missed wake at the bound used to leave B to
/// the next wake of the session (a transaction, or a keepalive after the next status update), which
/// the latency bench of atomic transactions measures (docs/performance.md).
#[tokio::test]
async fn a_batch_waiting_behind_one_in_flight_is_stored_whole_after_it_without_a_restart() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let proxy = crate::support::Proxy::start(nats.port());
    let mut config = relay_config(&db, &nats);
    config.nats.url = proxy.nats_url();
    config.nats.atomic_transactions = true;
    config.nats.atomic_group_ms = 1000;
    let stream = config.nats.stream.clone();
    let client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;
    let js = nats.jetstream().await;

    proxy.blackhole(true);
    let a = write_transactions(&db, "a", &[3]);
    // A is committed at once (nothing is in flight, so it does not wait its bound), into the
    // black hole.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let b = write_transactions(&db, "b", &[2]);
    // Long enough for the relay to see B end (B waits behind A, in flight); well inside B's bound.
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.blackhole(false);

    let ids: Vec<String> = a.into_iter().chain(b).collect();
    let tally = assert_all_stored_once_in_order(&js, &stream, &ids).await;
    tally.report("a batch waiting behind an acked one", 1);
    assert_eq!(
        relay.metrics.reconnects.get(),
        0,
        "B committed by its bound, not after an ack timeout and a restart"
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
    assert!(
        setup
            .stdout
            .contains("publishing: atomic transactions (nats.atomic_transactions = true)"),
        "setup names the publishing mode: {}",
        setup.stdout
    );
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

/// The header block of a stored message as nats-server counts it, for the names `keep` accepts.
fn header_bytes(m: &crate::support::Stored, keep: impl Fn(&str) -> bool) -> usize {
    m.headers
        .iter()
        .filter(|(k, _)| keep(k))
        .map(|(k, v)| k.len() + 2 + v.len() + 2)
        .sum()
}

/// The headers the relay builds for an event before it joins a batch, which the old size check
/// measured (with a fixed 160 bytes for the rest).
fn built_before_the_batch(name: &str) -> bool {
    !name.starts_with("Nats-") && name != "Outbox-Position"
}

/// A transaction with members around the size limit (`limit`: the stream's `max_msg_size` or the
/// server's `max_payload`), sized from stored probe messages of the same shapes:
/// - `t-1`, the batch's first message (it carries the expected last sequence), fits the old check
///   (its message without the batch headers and `Outbox-Position` is under the limit less 160
///   bytes) but is over the limit as sent: the old relay sent it, and the whole batch was refused
///   on every session (or the client refused the member), so nothing after it was published;
/// - `t-3`, a member in the middle, is just over the limit as sent, `t-4` exactly at it;
/// - in a later transaction `e-1` (first) and `e-3` (commit) are exactly at the limit too (each
///   when its commit LSN is as long as the probe's, which the sizes are measured from).
///
/// Measured by nats-server as by the relay: a message at the limit is stored, one over is not.
///
/// Every event is stored or dead-lettered with the reason, in order, without a single restart.
async fn members_around_the_size_limit(
    nats: NatsServer,
    max_msg_size: Option<usize>,
    limit: usize,
) {
    let db = text_id_db().await;
    let mut config = relay_config(&db, &nats);
    config.nats.atomic_transactions = true;
    // One batch per transaction, so `e-1` is a batch's first message (with the fence's
    // expectation) as the sizes assume. Grouping changes where a message stands in its batch,
    // not how it is measured: every header is stamped before the check, whatever its place.
    config.nats.atomic_group_ms = 0;
    // A slot name of a production length (the tests' own are short): it is in every message's
    // Outbox-Position, one of the headers the old check left out.
    config.postgres.slot = format!("{}_orders_outbox_relay", config.postgres.slot);
    let stream = config.nats.stream.clone();
    let js = nats.jetstream().await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec!["outbox.*".into(), "outbox_dead_letter".into()],
        max_message_size: max_msg_size.map_or(-1, |n| n as i32),
        duplicate_window: Duration::from_secs(120),
        allow_atomic_publish: true,
        ..Default::default()
    })
    .await
    .expect("create stream");
    let client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;
    let insert = |id: &str, pad: usize| {
        format!(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('{id}', 'Claim', '4711', 'ClaimApproved', jsonb_build_object('pad', repeat('x', {pad})));"
        )
    };
    // The probe: a batch of three, a first message, a middle one and a commit.
    client
        .batch_execute(&format!(
            "BEGIN; {} {} {} COMMIT;",
            insert("p-1", 1),
            insert("p-2", 1),
            insert("p-3", 1)
        ))
        .await
        .expect("probe transaction");
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream_count(&js, &stream).await < 3 {
        assert!(Instant::now() < deadline, "probe not stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let probe = read_all(&js, &stream).await;
    let (first, middle) = (&probe[0], &probe[1]);
    assert_eq!((first.id(), middle.id()), ("p-1", "p-2"));
    // "NATS/1.0\r\n" + "\r\n", and `{"pad": "` + `"}` around the padding.
    let frame = 12 + first.payload.len() - 1;
    let built = header_bytes(first, built_before_the_batch);
    let first_all = header_bytes(first, |_| true);
    let batch = first_all - built;
    assert!(
        batch > 160,
        "the first message's batch headers take {batch} bytes: the case needs more than the old allowance"
    );
    // Between the old allowance and the real headers (the reproduction had 40 bytes).
    let margin = ((batch - 160) / 2).min(40);
    let under_old = limit - 160 - margin - built - frame;
    let middle_all = header_bytes(middle, |_| true);
    let over = limit + 8 - middle_all - frame;
    let exact = limit - middle_all - frame;
    // And every other shape exactly at the limit: `e-1` first (it will expect sequence 10, one
    // digit more than the probe's 0), `e-3` the commit.
    let commit = &probe[2];
    let exact_first = limit - (first_all + 1) - frame;
    let exact_commit = limit - header_bytes(commit, |_| true) - frame;
    client
        .batch_execute(&format!(
            "BEGIN; {} {} {} {} {} {} COMMIT; BEGIN; {} COMMIT; BEGIN; {} {} {} COMMIT;",
            insert("t-1", under_old),
            insert("t-2", 10),
            insert("t-3", over),
            insert("t-4", exact),
            insert("t-5", 10),
            insert("t-6", 10),
            insert("u-1", 10),
            insert("e-1", exact_first),
            insert("e-2", 10),
            insert("e-3", exact_commit),
        ))
        .await
        .expect("the transaction around the limit, and one after it");
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream_count(&js, &stream).await < 13 {
        assert!(
            Instant::now() < deadline,
            "only {} of 13 messages stored after 30 s ({} restarts): the batch around the limit wedges the relay",
            stream_count(&js, &stream).await,
            relay.metrics.reconnects.get()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = read_all(&js, &stream).await;
    let ids: Vec<&str> = got.iter().map(|m| m.id()).collect();
    assert_eq!(
        ids,
        [
            "p-1", "p-2", "p-3", "t-1", "t-2", "t-3", "t-4", "t-5", "t-6", "u-1", "e-1", "e-2",
            "e-3"
        ],
        "every event once, in order"
    );
    let what = if max_msg_size.is_some() {
        "max_msg_size"
    } else {
        "max_payload"
    };
    let lsn_len = |m: &crate::support::Stored| m.header("Outbox-Commit-Lsn").len();
    let mut exactly = 0;
    for m in &got {
        let size = m.payload.len() + 12 + header_bytes(m, |_| true);
        assert!(size <= limit, "{} stored at {size} bytes", m.id());
        match m.id() {
            id @ ("t-4" | "e-1" | "e-3") if lsn_len(m) == lsn_len(middle) => {
                assert_eq!(
                    m.subject, "outbox.Claim",
                    "{id} exactly at the limit: stored as it is"
                );
                assert_eq!(size, limit, "{id} is exactly at the limit");
                exactly += 1;
            }
            "t-1" | "t-3" => {
                assert_eq!(m.subject, "outbox_dead_letter", "{m:?}");
                let error = m.header("Outbox-Error");
                assert!(
                    error.contains(what) && error.contains(&limit.to_string()),
                    "{}: {error}",
                    m.id()
                );
                assert_eq!(m.header("Outbox-Subject"), "outbox.Claim");
                assert!(m.payload.is_empty());
            }
            id @ ("t-4" | "e-1" | "e-3") => {
                eprintln!(
                    "{id}'s commit LSN differs in length from the probe's: not exactly at the limit"
                )
            }
            _ => assert_eq!(m.subject, "outbox.Claim", "{m:?}"),
        }
    }
    let m = &relay.metrics;
    let dead = got
        .iter()
        .filter(|m| m.subject == "outbox_dead_letter")
        .count();
    assert_eq!(m.dead_letters.get(), dead as u64);
    assert!(dead >= 2);
    assert_eq!(m.reconnects.get(), 0, "no restart");
    assert!(exactly >= 1, "no message was exactly at the limit");
    eprintln!(
        "atomic size limit ({what} {limit}): first message's batch headers {batch} bytes; t-1 {} \
         bytes without them; t-3 / t-4 {} / {} bytes as sent; {exactly} of 3 shapes stored at exactly the limit",
        under_old + built + frame,
        over + middle_all + frame,
        exact + middle_all + frame
    );
    relay.stop().await.expect("relay stops cleanly");
}

/// The stream's `max_msg_size` (JetStream refuses the whole batch, 10054).
#[tokio::test]
async fn members_around_the_streams_max_msg_size_are_stored_or_dead_lettered() {
    members_around_the_size_limit(NatsServer::start(), Some(8192), 8192).await;
}

/// The server's `max_payload` (the client refuses the member before sending it).
#[tokio::test]
async fn members_around_the_servers_max_payload_are_stored_or_dead_lettered() {
    members_around_the_size_limit(
        NatsServer::start_with_config("max_payload: 8192"),
        None,
        8192,
    )
    .await;
}

/// The stream's `max_msg_size` lowered while the relay streams: the session's limit is stale, so
/// JetStream refuses the whole batch holding a member over the new limit (10054). That costs one
/// restart, not a loop: the next session reads the new limit and dead-letters the member in its
/// place, and the rest of the transaction is stored.
#[tokio::test]
async fn a_max_msg_size_lowered_while_streaming_costs_one_restart_not_a_loop() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.nats.atomic_transactions = true;
    let stream = config.nats.stream.clone();
    let js = nats.jetstream().await;
    let mut cfg = async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec!["outbox.*".into(), "outbox_dead_letter".into()],
        max_message_size: 8192,
        duplicate_window: Duration::from_secs(120),
        allow_atomic_publish: true,
        ..Default::default()
    };
    js.create_stream(cfg.clone()).await.expect("create stream");
    let client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;
    let ids = write_transactions(&db, "w", &[1]);
    assert_all_stored_once_in_order(&js, &stream, &ids).await;
    cfg.max_message_size = 4096;
    js.update_stream(cfg).await.expect("lower max_msg_size");
    client
        .batch_execute(
            "BEGIN; \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('x-1', 'Claim', '1', 'ClaimApproved', '{}'); \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('x-2', 'Claim', '1', 'ClaimApproved', jsonb_build_object('pad', repeat('x', 6000))); \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('x-3', 'Claim', '1', 'ClaimApproved', '{}'); \
             COMMIT;",
        )
        .await
        .expect("a transaction with a member over the new limit");
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream_count(&js, &stream).await < 4 {
        assert!(
            Instant::now() < deadline,
            "only {} of 4 messages after 30 s ({} restarts)",
            stream_count(&js, &stream).await,
            relay.metrics.reconnects.get()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = read_all(&js, &stream).await;
    let ids: Vec<&str> = got.iter().map(|m| m.id()).collect();
    assert_eq!(ids, [ids[0], "x-1", "x-2", "x-3"]);
    assert_eq!(got[2].subject, "outbox_dead_letter", "{:?}", got[2]);
    let error = got[2].header("Outbox-Error");
    assert!(error.contains("max_msg_size of 4096"), "{error}");
    let restarts = relay.metrics.reconnects.get();
    assert_eq!(restarts, 1, "one restart reads the new limit");
    relay.stop().await.expect("relay stops cleanly");
}

/// A member whose headers are over JetStream's limit for a message's header block (65,535 bytes: a
/// 70 KB value in the headers column) would get its whole batch refused (10097) on every session:
/// it is dead-lettered in its place instead, its long header value cut and named, and the rest of
/// the transaction is stored, without a restart.
#[tokio::test]
async fn a_member_with_headers_over_jetstreams_limit_is_dead_lettered_not_a_wedge() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.nats.atomic_transactions = true;
    config.outbox.headers_column = "headers".into();
    let stream = config.nats.stream.clone();
    let client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;
    let big = format!(
        r#"{{"traceparent": "00-1-2-01", "big": "{}"}}"#,
        "v".repeat(70 * 1024)
    );
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ('h-1', 'Claim', '1', 'ClaimApproved', '{}', NULL), \
                    ('h-2', 'Claim', '1', 'ClaimApproved', '{}', $1::text::jsonb), \
                    ('h-3', 'Claim', '1', 'ClaimApproved', '{}', NULL)",
            &[&big],
        )
        .await
        .expect("one transaction, a member with a 70 KB header value");
    let ids = write_transactions(&db, "h", &[1]);
    let js = nats.jetstream().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream_count(&js, &stream).await < 4 {
        assert!(
            Instant::now() < deadline,
            "only {} of 4 messages after 30 s ({} restarts): the batch wedges the relay",
            stream_count(&js, &stream).await,
            relay.metrics.reconnects.get()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = read_all(&js, &stream).await;
    let got_ids: Vec<&str> = got.iter().map(|m| m.id()).collect();
    assert_eq!(got_ids, ["h-1", "h-2", "h-3", ids[0].as_str()]);
    let m = &got[1];
    assert_eq!(m.subject, "outbox_dead_letter", "{:?}", m.headers.keys());
    let error = m.header("Outbox-Error").to_lowercase();
    assert!(error.contains("header"), "names the headers: {error}");
    assert!(m.header("Outbox-Truncated-Headers").contains("big"));
    assert!(m.header("big").len() <= 1024);
    assert_eq!(m.header("traceparent"), "00-1-2-01");
    for m in [&got[0], &got[2], &got[3]] {
        assert_eq!(m.subject, "outbox.Claim", "{m:?}");
    }
    assert_eq!(relay.metrics.reconnects.get(), 0, "no restart");
    relay.stop().await.expect("relay stops cleanly");
}

/// A non-transactional logical message with the outbox prefix is dead-lettered in a batch of its
/// own, at once, and the slot is confirmed past it, with nothing written after it. It belongs to no
/// transaction, so no Commit follows it; the batcher held it (as it holds every event until the
/// next one or its transaction's Commit) and waited for the next transaction's first event to send
/// it: on a quiet database the dead letter was never published and the slot never confirmed past
/// it (found by the simulation). Guards the commit after the standalone event's
/// submit (`Step::Standalone` in src/relay/session.rs).
#[tokio::test]
async fn a_standalone_dead_letter_is_published_and_confirmed_on_a_quiet_database() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.nats.atomic_transactions = true;
    assert!(
        config.nats.fence,
        "atomic transactions need the fence, the default"
    );
    // Logical messages with this prefix are the relay's events (and dead letters when not
    // transactional).
    config.outbox.message_prefix = "outbox".into();
    let stream = config.nats.stream.clone();
    let slot = config.postgres.slot.clone();
    let dead_subject = config.nats.dead_letter_subject.clone();
    let client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;
    let js = nats.jetstream().await;
    let ids = write_transactions(&db, "q", &[1]);
    assert_all_stored_once_in_order(&js, &stream, &ids).await;

    // The message's LSN (its record's end, the position pgoutput gives it); nothing after it.
    let message_lsn: outbox_relay::Lsn = client
        .query_one(
            "SELECT pg_logical_emit_message(false, 'outbox', $1::text)::text",
            &[&r#"{"id":"nt-1","aggregate_type":"Claim","aggregate_id":"4711","event_type":"E","payload":{}}"#],
        )
        .await
        .expect("emit the non-transactional message")
        .get::<_, String>(0)
        .parse()
        .expect("an LSN");
    let wait = Duration::from_secs(30);
    let deadline = Instant::now() + wait;
    while stream_count(&js, &stream).await < 2 {
        assert!(
            Instant::now() < deadline,
            "the dead letter of the non-transactional message at {message_lsn} is not in the stream \
             after {wait:?} (the slot is confirmed to {}): it waits for a transaction that never comes",
            shown(crate::support::confirmed_flush(&client, &slot).await)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let got = read_all(&js, &stream).await;
    assert_eq!(got.len(), 2, "{got:?}");
    let dead = &got[1];
    assert_eq!(dead.subject, dead_subject, "{dead:?}");
    assert!(
        dead.header("Outbox-Error")
            .contains("pg_logical_emit_message(true"),
        "the reason says how to emit it: {dead:?}"
    );
    assert!(
        dead.id().contains(":non-transactional:"),
        "a WAL-derived id: {dead:?}"
    );
    assert_eq!(dead.commit_lsn(), message_lsn, "{dead:?}");
    let deadline = Instant::now() + wait;
    loop {
        let confirmed = crate::support::confirmed_flush(&client, &slot).await;
        if confirmed.is_some_and(|c| c >= message_lsn) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slot is confirmed to {} after {wait:?}, not past the message at {message_lsn}",
            shown(confirmed)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(relay.metrics.reconnects.get(), 0, "no restart");
    relay.stop().await.expect("relay stops cleanly");
}

/// A slot's confirmed LSN as `X/Y`, or `none`.
fn shown(lsn: Option<outbox_relay::Lsn>) -> String {
    lsn.map_or_else(|| "none".into(), |l| l.to_string())
}
