//! High availability on the Postgres side, on the `PgPair` fixture (a primary with a streaming
//! physical standby), without a relay: a logical slot created with `failover = true` on the primary
//! is synced to the standby and, after the primary stops (immediately, as in a crash, or cleanly, as in
//! a switchover) and the standby is promoted, is a usable slot on the new primary at or past the
//! position that was synced; and a multi-host URL with `target_session_attrs=read-write` reaches
//! whichever server is writable, and the promoted server answers `TIMELINE_HISTORY` with its history
//! file. These prove the fixture the relay's failover tests build on. Those follow: the relay
//! follows a promotion through a multi-host URL and, with atomic batches and the standby's copy of
//! the slot behind, stores every event once because it trusts the old timeline's tail below the
//! switch point.
//!
//! Failover slots are PG 17+: on older servers those tests print why they skip and pass.
//! `scripts/test.sh` runs this module with `PG_BIN` set to 17 and 18.

use std::time::Duration;

use crate::support::{PgPair, SyncedSlot, server_major};

/// Slot sync has been seen to take ~25 s on a quiet pair (the worker backs off to 30 s naps).
const SYNC_TIMEOUT: Duration = Duration::from_secs(90);
const SLOT: &str = "ha_slot";
const PUBLICATION: &str = "ha_pub";

/// A pair with failover slots, or `None` (saying why) when `PG_BIN` is older than 17.
fn pair_with_slot_sync(test: &str) -> Option<PgPair> {
    let major = server_major();
    if major < 17 {
        eprintln!("skipped {test}: failover slots need Postgres 17+, PG_BIN has {major}");
        return None;
    }
    let pair = PgPair::start();
    assert!(pair.supports_slot_sync());
    Some(pair)
}

/// On the primary: a table in a publication, a failover slot on it, and 100 rows.
fn failover_slot_and_100_rows(pair: &PgPair) {
    pair.primary.psql(
        "postgres",
        &format!(
            "CREATE TABLE ha_t (id int PRIMARY KEY);\n\
             CREATE PUBLICATION {PUBLICATION} FOR TABLE ha_t;\n\
             SELECT pg_create_logical_replication_slot('{SLOT}', 'pgoutput', false, false, true);\n\
             INSERT INTO ha_t SELECT generate_series(1, 100);"
        ),
    );
    assert_eq!(
        pair.primary.psql(
            "postgres",
            &format!("SELECT failover FROM pg_replication_slots WHERE slot_name = '{SLOT}'")
        ),
        "t"
    );
}

/// Confirms the 100 rows on the primary's slot, as a client would, and waits for the standby to have
/// the slot at or past that.
async fn sync_past_100_rows(pair: &PgPair) -> SyncedSlot {
    let synced = pair.advance_until_synced(SLOT, SYNC_TIMEOUT).await;
    eprintln!(
        "slot {SLOT} synced at {} after {:?}",
        synced.confirmed_flush_lsn, synced.waited
    );
    synced
}

/// Checks the slot on the promoted standby: persistent, still a failover slot, confirmed at or past
/// `synced_lsn`. Prints `synced`, which the docs leave meaningless on a primary.
fn assert_slot_kept(pair: &PgPair, synced_lsn: &str) {
    let row = pair.standby.psql(
        "postgres",
        &format!(
            "SELECT failover, temporary, confirmed_flush_lsn >= '{synced_lsn}'::pg_lsn, synced, \
                    confirmed_flush_lsn \
               FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        ),
    );
    let fields: Vec<&str> = row.split('|').collect();
    assert_eq!(
        fields.get(..3),
        Some(&["t", "f", "t"][..]),
        "slot on the promoted standby (failover|temporary|confirmed >= {synced_lsn}|synced|\
         confirmed_flush_lsn): {row:?}"
    );
    eprintln!(
        "slot {SLOT} on the promoted standby: confirmed_flush_lsn {}, synced = {}",
        fields[4], fields[3]
    );
}

/// Decodes (and consumes) the slot on the promoted standby; returns how many inserts it gave. A
/// second read must give nothing: the slot advanced, so it is a working slot, not a leftover copy.
fn consume_inserts(pair: &PgPair) -> u64 {
    let sql = format!(
        "SELECT count(*) FROM pg_logical_slot_get_binary_changes('{SLOT}', NULL, NULL, \
           'proto_version', '1', 'publication_names', '{PUBLICATION}') \
         WHERE get_byte(data, 0) = ascii('I')"
    );
    let inserts = pair.standby.psql("postgres", &sql).parse().unwrap();
    assert_eq!(
        pair.standby.psql("postgres", &sql),
        "0",
        "slot did not advance"
    );
    inserts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_slot_survives_an_immediate_stop_and_promotion() {
    let Some(pair) = pair_with_slot_sync("failover_slot_survives_an_immediate_stop_and_promotion")
    else {
        return;
    };
    failover_slot_and_100_rows(&pair);
    let synced = sync_past_100_rows(&pair).await;

    pair.stop_primary_immediate();
    pair.promote_standby();

    assert_slot_kept(&pair, &synced.confirmed_flush_lsn);
    // The 100 rows before the synced position are not given again; what the new primary writes is.
    pair.standby.psql(
        "postgres",
        "INSERT INTO ha_t SELECT generate_series(101, 105)",
    );
    assert_eq!(consume_inserts(&pair), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_slot_survives_a_switchover() {
    let Some(pair) = pair_with_slot_sync("failover_slot_survives_a_switchover") else {
        return;
    };
    failover_slot_and_100_rows(&pair);
    let synced = sync_past_100_rows(&pair).await;
    // Written after the sync and not confirmed by anyone: a clean stop hands them to the standby.
    pair.primary.psql(
        "postgres",
        "INSERT INTO ha_t SELECT generate_series(101, 110)",
    );

    pair.stop_primary_clean();
    pair.promote_standby();

    assert_eq!(
        pair.standby.psql("postgres", "SELECT count(*) FROM ha_t"),
        "110",
        "a switchover loses no committed row"
    );
    assert_slot_kept(&pair, &synced.confirmed_flush_lsn);
    // The 10 rows after the synced position (from the old primary's WAL) and 5 from the new one.
    pair.standby.psql(
        "postgres",
        "INSERT INTO ha_t SELECT generate_series(111, 115)",
    );
    assert_eq!(consume_inserts(&pair), 15);
}

/// Physical replication only, so every version runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_host_url_reaches_the_writable_server() {
    let pair = PgPair::start();
    let url = pair.multi_host_url("postgres");
    let server_port = || async {
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
        tokio::spawn(connection);
        let row = client.query_one("SELECT inet_server_port()", &[]).await?;
        Ok::<i32, tokio_postgres::Error>(row.get(0))
    };
    assert_eq!(server_port().await.unwrap(), i32::from(pair.primary.port()));

    pair.stop_primary_immediate();
    // The standby is up but read-only: read-write must not settle for it.
    let refused = server_port().await;
    assert!(
        refused.is_err(),
        "connected to a read-only standby: {refused:?}"
    );

    pair.promote_standby();
    assert_eq!(server_port().await.unwrap(), i32::from(pair.standby.port()));
    promoted_server_answers_timeline_history(&pair).await;
}

/// The promoted server's `TIMELINE_HISTORY`, as the relay reads it on a logical replication
/// connection, is its history file (timeline 1, ended at the switch point); timeline 1 has none
/// and is not asked for; a timeline the server does not know is the server's error, and the
/// connection still answers.
async fn promoted_server_answers_timeline_history(pair: &PgPair) {
    use outbox_relay::source::{ConnInfo, ReplConnection, SourceError, TimelineHistory};

    let info = ConnInfo::parse(&pair.standby.url("postgres")).expect("standby URL");
    let mut repl = ReplConnection::connect(&info, "ha_timeline_history")
        .await
        .expect("replication connection to the promoted server");
    let system = repl.identify_system().await.expect("IDENTIFY_SYSTEM");
    assert_eq!(system.timeline, 2, "a promotion starts timeline 2");
    let history = repl.timeline_history(2).await.expect("TIMELINE_HISTORY 2");
    let file = pair
        .standby
        .psql("postgres", "SELECT pg_read_file('pg_wal/00000002.history')");
    assert_eq!(
        history,
        TimelineHistory::parse(2, &file).expect("the history file parses"),
        "TIMELINE_HISTORY is the history file {file:?}"
    );
    let [switch] = history.ancestors() else {
        panic!("one ancestor expected: {history:?}");
    };
    assert_eq!(switch.timeline, 1);
    assert!(
        switch.end <= system.xlogpos,
        "switch point {} past the WAL end {}",
        switch.end,
        system.xlogpos
    );
    eprintln!(
        "promoted server's history: {}",
        history.to_string().trim_end()
    );
    assert_eq!(
        repl.timeline_history(1).await.expect("timeline 1"),
        TimelineHistory::root(1)
    );
    let refused = repl.timeline_history(9).await.expect_err("timeline 9");
    assert!(
        matches!(refused, SourceError::Server { .. }),
        "the server's own error: {refused}"
    );
    repl.identify_system()
        .await
        .expect("the connection answers after the refusal");
    repl.close().await;
}

/// How the primary goes away in a relay failover test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loss {
    /// `pg_ctl stop -m immediate`, as in a crash.
    Crash,
    /// A clean stop, as in a planned switchover.
    Switchover,
}

/// Inserts events `from..=to` (ids `e-<n>`) on `server`, one transaction each.
fn write_events(server: &crate::support::PgServer, from: u32, to: u32) {
    let sql: String = (from..=to)
        .map(|n| {
            format!(
                "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('e-{n}', 'Claim', '{n}', 'ClaimApproved', '{{\"n\": {n}}}');\n"
            )
        })
        .collect();
    server.psql("postgres", &sql);
}

/// The relay streams through a multi-host URL while the primary goes away and the standby is
/// promoted: it follows on its own, and every event committed on the survivor is in the stream
/// exactly once, in commit order.
async fn relay_follows_the_promotion(loss: Loss) {
    use crate::support::{InProcessRelay, NatsServer, TEXT_ID_OUTBOX_SQL, read_all, unique};
    use std::time::Instant;

    let test = format!("relay_follows_the_promotion({loss:?})");
    let Some(pair) = pair_with_slot_sync(&test) else {
        return;
    };
    pair.primary.psql("postgres", TEXT_ID_OUTBOX_SQL);
    let nats = NatsServer::start();
    let mut config = outbox_relay::config::Config::default();
    config.postgres.url = pair.multi_host_url("postgres");
    config.postgres.slot = unique("ha_relay");
    config.postgres.publication = unique("ha_pub");
    config.nats.url = nats.url();
    config.nats.stream = unique("HA").to_uppercase();
    config.http.listen = String::new();
    config.nats.ack_timeout_ms = 2000;
    let slot = config.postgres.slot.clone();
    let stream = config.nats.stream.clone();
    let relay = InProcessRelay::start(config);
    let js = nats.jetstream().await;
    // The slot is created by the relay's setup: events written before it would never be decoded.
    let metrics = std::sync::Arc::clone(&relay.metrics);
    crate::support::wait_for("the relay to stream", Duration::from_secs(60), || {
        let m = std::sync::Arc::clone(&metrics);
        async move { m.streaming.get() == 1 }
    })
    .await;

    write_events(&pair.primary, 1, 50);
    crate::support::wait_for("50 events before the loss", Duration::from_secs(60), || {
        let js = js.clone();
        let stream = stream.clone();
        async move { crate::support::stream_count(&js, &stream).await >= 50 }
    })
    .await;
    // The standby's copy of the slot must have caught up with what the relay confirmed, or the
    // promoted server would replay from an older position (JetStream would absorb it; the test
    // wants the synced path).
    let confirmed = pair.primary.psql(
        "postgres",
        &format!("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'"),
    );
    let synced = pair.wait_slot_synced(&slot, &confirmed, SYNC_TIMEOUT).await;
    eprintln!(
        "{test}: slot synced at {} after {:?}",
        synced.confirmed_flush_lsn, synced.waited
    );

    match loss {
        Loss::Crash => pair.stop_primary_immediate(),
        Loss::Switchover => pair.stop_primary_clean(),
    }
    let promoted = Instant::now();
    pair.promote_standby();
    write_events(&pair.standby, 51, 100);
    crate::support::wait_for(
        "100 events after the promotion",
        Duration::from_secs(90),
        || {
            let js = js.clone();
            let stream = stream.clone();
            async move { crate::support::stream_count(&js, &stream).await >= 100 }
        },
    )
    .await;
    let stall = promoted.elapsed();

    let committed: Vec<String> = pair
        .standby
        .psql(
            "postgres",
            "SELECT string_agg(event_id, ',' ORDER BY created_at, event_id) FROM public.outbox",
        )
        .split(',')
        .map(str::to_owned)
        .collect();
    let stored: Vec<String> = read_all(&js, &stream)
        .await
        .iter()
        .map(|m| m.id().to_owned())
        .collect();
    assert_eq!(
        stored, committed,
        "the stream must hold every event committed on the survivor, once, in commit order"
    );
    assert!(
        !relay.is_finished(),
        "the relay must keep running through the promotion"
    );
    let duplicates = relay.metrics.published_duplicate.get();
    eprintln!(
        "{test}: 100 events, all 50 after the promotion stored {stall:?} after it; {duplicates} \
         replays absorbed as duplicates"
    );
    relay.stop().await.expect("the relay stops cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_follows_a_crash_and_promotion_through_a_multi_host_url() {
    relay_follows_the_promotion(Loss::Crash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_follows_a_switchover_through_a_multi_host_url() {
    relay_follows_the_promotion(Loss::Switchover).await;
}

/// Defect: a promoted standby distrusted every tail. The relay (the binary, with
/// `nats.atomic_transactions`: batch messages carry no `Nats-Msg-Id`, so JetStream drops nothing
/// as a duplicate) streams 80 events on the primary, but the standby's copy of the slot is left
/// at the 50th (slot sync stopped: a sync always lags, this makes the lag certain). After the
/// promotion the new primary sends events 51-80 again. The stream's tail (event 80) names the old
/// timeline, below the point where the new one branched off: the relay must trust it, skip the 30
/// events it proves stored, and store every event once. Before the fix it distrusted the tail
/// ("replay skips nothing") and stored events 51-80 twice.
async fn atomic_replay_after_the_promotion_stores_each_event_once(loss: Loss) {
    use crate::support::{RelayProcess, TEXT_ID_OUTBOX_SQL, read_all, unique, wait_for};
    use std::collections::BTreeMap;

    let test = format!("atomic_replay_after_the_promotion_stores_each_event_once({loss:?})");
    let Some(pair) = pair_with_slot_sync(&test) else {
        return;
    };
    pair.primary.psql("postgres", TEXT_ID_OUTBOX_SQL);
    let nats = crate::support::NatsServer::start();
    let mut config = outbox_relay::config::Config::default();
    config.postgres.url = pair.multi_host_url("postgres");
    config.postgres.slot = unique("ha_relay");
    config.postgres.publication = unique("ha_pub");
    config.nats.url = nats.url();
    config.nats.stream = unique("HA").to_uppercase();
    config.nats.ack_timeout_ms = 2000;
    config.nats.atomic_transactions = true;
    // The default port is shared by every test that runs at the same time.
    config.http.listen = String::new();
    let slot = config.postgres.slot.clone();
    let stream = config.nats.stream.clone();
    let mut relay = RelayProcess::run(&config);
    let js = nats.jetstream().await;
    let count = |n: u64, what: &'static str| {
        let js = js.clone();
        let stream = stream.clone();
        wait_for(what, Duration::from_secs(90), move || {
            let js = js.clone();
            let stream = stream.clone();
            async move { crate::support::stream_count(&js, &stream).await >= n }
        })
    };
    // Events written before the relay's slot has its consistent point are never decoded.
    let slot_sql =
        format!("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'");
    let started = std::time::Instant::now();
    while pair.primary.psql("postgres", &slot_sql).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(60) && relay.is_running(),
            "the relay created no slot; stderr:\n{}",
            relay.stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    write_events(&pair.primary, 1, 50);
    count(50, "50 events before the sync is stopped").await;
    let confirmed = pair.primary.psql("postgres", &slot_sql);
    let synced = pair.wait_slot_synced(&slot, &confirmed, SYNC_TIMEOUT).await;
    pair.stop_slot_sync(Duration::from_secs(30));
    write_events(&pair.primary, 51, 80);
    count(80, "80 events on the old primary").await;
    // The relay confirms within its status interval; the standby's slot stays behind.
    let behind = pair.standby.psql(
        "postgres",
        &format!("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'"),
    );
    eprintln!(
        "{test}: standby's slot frozen at {behind} (synced at {} after {:?})",
        synced.confirmed_flush_lsn, synced.waited
    );

    match loss {
        Loss::Crash => pair.stop_primary_immediate(),
        Loss::Switchover => pair.stop_primary_clean(),
    }
    pair.promote_standby();
    write_events(&pair.standby, 81, 100);
    let expected: Vec<String> = (1..=100).map(|n| format!("e-{n}")).collect();
    wait_for(
        "events 81-100 from the new primary",
        Duration::from_secs(90),
        || {
            let js = js.clone();
            let stream = stream.clone();
            async move {
                read_all(&js, &stream)
                    .await
                    .iter()
                    .any(|m| m.id() == "e-100")
            }
        },
    )
    .await;

    let stored = read_all(&js, &stream).await;
    let mut copies: BTreeMap<&str, usize> = BTreeMap::new();
    for m in &stored {
        *copies.entry(m.id()).or_default() += 1;
    }
    let twice: Vec<_> = copies.iter().filter(|(_, n)| **n > 1).collect();
    let log = relay.stderr();
    assert!(
        twice.is_empty(),
        "{test}: every event must be stored once; {} of {} stored more than once: {twice:?}\n\
         relay stderr:\n{log}",
        twice.len(),
        stored.len()
    );
    // Batch messages: JetStream has no id to drop a second copy by, only the fence keeps it out.
    assert!(
        stored
            .iter()
            .all(|m| !m.headers.contains_key("Nats-Msg-Id")),
        "{test}: every event is published in an atomic batch"
    );
    let ids: Vec<&str> = stored.iter().map(|m| m.id()).collect();
    assert_eq!(ids, expected, "{test}: every event once, in commit order");
    assert!(
        !log.contains("replay skips nothing"),
        "{test}: the relay distrusted the stream's tail after the promotion:\n{log}"
    );
    assert!(
        !log.contains("not where this relay left it"),
        "{test}: the relay took the promotion for a restore:\n{log}"
    );
    assert!(
        log.contains("following a promoted server"),
        "{test}: the relay read the promoted server's timeline history:\n{log}"
    );
    assert!(relay.is_running(), "{test}: the relay must keep running");
    relay.signal("TERM");
    assert!(
        relay
            .wait(Duration::from_secs(30))
            .is_some_and(|s| s.success()),
        "{test}: the relay stops cleanly; stderr:\n{}",
        relay.stderr()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atomic_replay_after_a_crash_and_promotion_stores_each_event_once() {
    atomic_replay_after_the_promotion_stores_each_event_once(Loss::Crash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atomic_replay_after_a_switchover_stores_each_event_once() {
    atomic_replay_after_the_promotion_stores_each_event_once(Loss::Switchover).await;
}
