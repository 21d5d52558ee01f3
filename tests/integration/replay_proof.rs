//! The replay's proof against real servers: a session that resumes behind a long stored run of one
//! transaction must prove the run stored (by reading the stream back) and publish only what
//! follows it, whatever the run's length. Until this was fixed the proof gave up past 20,000
//! events, the relay then trusted no tail and published the whole transaction again, and with a
//! duplicate window shorter than the stall (or with atomic batches, which carry no `Nats-Msg-Id`)
//! every event of the run was stored twice.
//!
//! The reproduction: one transaction of 30,000 events into a stream whose `max_msgs` (discard new)
//! stops it at 25,000; the relay stalls there, the 2 s duplicate window passes, the limit is
//! lifted, and the relay resumes. Each test judges what a consumer sees: every event once; and that
//! the relay left no consumer behind.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::support::{InProcessRelay, Proxy, Scenario, Stored, wait_for};

const EVENTS: u64 = 30_000;
const LIMIT: u64 = 25_000;

/// One transaction of `n` events, ids `<prefix>-NNNNNN`.
fn write_one_transaction(s: &Scenario, prefix: &str, n: u64) {
    s.db.psql(&format!(
        "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
         SELECT '{prefix}-' || lpad(i::text, 6, '0'), 'Claim', i::text, 'ClaimApproved',
                jsonb_build_object('n', i)
         FROM generate_series(1, {n}) AS i;"
    ));
}

/// Sets the stream's `max_msgs` (-1: no limit); setup made it discard new messages past it.
async fn stream_max_messages(s: &Scenario, max: i64) {
    let mut stream = s.js.get_stream(&s.stream).await.expect("stream");
    let mut config = stream.info().await.expect("stream info").config.clone();
    config.max_messages = max;
    s.js.update_stream(config)
        .await
        .expect("update the stream's max_msgs");
}

async fn a_stalled_replay_past_20_000_events_is_proven(atomic: bool) {
    let s = Scenario::builder()
        .text_ids()
        .config(move |c| {
            c.postgres.status_interval_ms = 100;
            c.nats.duplicate_window_secs = 2;
            c.nats.atomic_transactions = atomic;
            c.nats.fence = true;
        })
        .start()
        .await;
    let relay = s.relay().await;
    // Setup made the stream (discard new); now it stops at LIMIT messages.
    stream_max_messages(&s, LIMIT as i64).await;
    write_one_transaction(&s, "p", EVENTS);
    let end = s.wal_lsn().await;

    wait_for(
        "the stream to fill up to its max_msgs",
        Duration::from_secs(120),
        || async { s.count().await >= LIMIT },
    )
    .await;
    // The relay is refused at the limit and restarts; let the duplicate window pass, so nothing
    // but the relay's own proof stands between a republish and a second copy.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(s.count().await, LIMIT, "stalled at the limit");
    assert!(
        s.confirmed().await.unwrap() < end,
        "the transaction is not confirmed while part of it is refused"
    );
    stream_max_messages(&s, -1).await;

    let started = Instant::now();
    s.wait_confirmed_within(
        "the slot to be confirmed past the transaction",
        end,
        Duration::from_secs(180),
    )
    .await;
    eprintln!(
        "resumed and confirmed in {:.1} s after the limit was lifted",
        started.elapsed().as_secs_f64()
    );
    // The read-back consumer is ephemeral: the server removes it once the read is over.
    wait_for(
        "the relay's read-back consumer to be gone",
        Duration::from_secs(20),
        || async {
            let mut stream = s.js.get_stream(&s.stream).await.expect("stream");
            stream
                .info()
                .await
                .expect("stream info")
                .state
                .consumer_count
                == 0
        },
    )
    .await;
    let all = s.read_all().await;
    let mut copies: BTreeMap<&str, u32> = BTreeMap::new();
    for m in &all {
        *copies.entry(m.id()).or_default() += 1;
    }
    let twice = copies.values().filter(|n| **n > 1).count();
    assert_eq!(
        (all.len(), copies.len(), twice),
        (EVENTS as usize, EVENTS as usize, 0),
        "every event stored exactly once (messages, distinct ids, ids stored more than once)"
    );
    let in_order = all.windows(2).all(|w| w[0].id() < w[1].id());
    assert!(in_order, "in insert order");
    relay.stop().await.expect("relay stops cleanly");
}

#[tokio::test]
async fn a_stalled_replay_of_25_000_events_is_proven_not_published_again() {
    a_stalled_replay_past_20_000_events_is_proven(false).await;
}

#[tokio::test]
async fn a_stalled_replay_of_25_000_atomic_batch_events_is_proven_not_published_again() {
    a_stalled_replay_past_20_000_events_is_proven(true).await;
}

/// Drops the slot `slot` once no walsender holds it (a stopped relay's may linger a moment).
async fn drop_slot(s: &Scenario, slot: &str) {
    wait_for(
        &format!("slot {slot} dropped"),
        Duration::from_secs(30),
        || async {
            s.client
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
                .is_ok()
        },
    )
    .await;
}

/// The scenario's slot as it is now, copied to `<slot>_saved`, after a relay made it and stopped:
/// [`set_slot_back`] brings it back, to replay from before every event written since.
async fn save_slot(s: &Scenario) {
    let relay = s.relay().await;
    relay.stop().await.expect("relay stops cleanly");
    s.client
        .execute(
            "SELECT pg_copy_logical_replication_slot($1, $2)",
            &[&s.slot, &format!("{}_saved", s.slot)],
        )
        .await
        .expect("copy the slot");
}

/// The slot set back to where [`save_slot`] saved it (a crash before the confirmation reached the
/// server).
async fn set_slot_back(s: &Scenario) {
    let saved = format!("{}_saved", s.slot);
    drop_slot(s, &s.slot).await;
    s.client
        .execute(
            "SELECT pg_copy_logical_replication_slot($1, $2)",
            &[&saved, &s.slot],
        )
        .await
        .expect("copy the saved slot back");
    drop_slot(s, &saved).await;
}

/// A scenario with atomic batches and the fence. With `one_batch_per_transaction`, a replay is cut
/// off part way, its first copies stored one transaction at a time until the stream is full.
/// Grouped, the replay's transactions would share one batch that the full stream refuses whole,
/// leaving no copy behind to test.
async fn atomic_scenario(one_batch_per_transaction: bool) -> Scenario {
    Scenario::builder()
        .text_ids()
        .config(move |c| {
            c.postgres.status_interval_ms = 100;
            c.nats.atomic_transactions = true;
            if one_batch_per_transaction {
                c.nats.atomic_group_ms = 0;
            }
            c.nats.fence = true;
        })
        .start()
        .await
}

/// Each message's sequence, event id, and the tail a replay that trusted no tail was published
/// over (`;replay-over=N` in `Outbox-Position`).
fn ids_and_replays(all: &[Stored]) -> Vec<(u64, String, Option<String>)> {
    all.iter()
        .map(|m| {
            let replay = m
                .header("Outbox-Position")
                .split_once(";replay-over=")
                .map(|(_, n)| n.to_owned());
            (m.seq, m.id().to_owned(), replay)
        })
        .collect()
}

/// The stream's event ids, in stream order.
async fn ids(s: &Scenario) -> Vec<String> {
    s.read_all()
        .await
        .iter()
        .map(|m| m.id().to_owned())
        .collect()
}

/// A replay that trusted no tail and was cut off leaves its last copy, at an old position, behind
/// messages with higher positions. A later session must not take that copy for the stream's end:
/// with atomic batches (no `Nats-Msg-Id`, nothing drops a copy) it would store every event between
/// the copy's position and the stream's real end again. The replay's messages say over which tail
/// they were published (`;replay-over=N` in `Outbox-Position`), and the later session verifies
/// message N instead (found by the simulation, seed 1356, with a standby carrying a distrust).
///
/// Here, with the real relay: e-1..e-5 are stored, the slot is set back before them (a crash before
/// the confirmation reached the server), and message 1 is deleted, so the next session's proof
/// fails and the relay trusts no tail; its replay stores e-1 and e-2 again and is then cut off by
/// the stream's `max_msgs` (discard new). The session after it finds e-2's copy as the tail.
#[tokio::test]
async fn a_cut_off_replays_last_copy_is_not_taken_for_the_streams_end() {
    let s = atomic_scenario(true).await;
    // The slot, saved before any event, to set it back with later.
    save_slot(&s).await;

    s.write_each(&["e-1", "e-2", "e-3", "e-4", "e-5"]);
    let end = s.wal_lsn().await;
    let relay = s.relay().await;
    s.wait_confirmed("e-1..e-5 confirmed", end).await;
    relay.stop().await.expect("relay stops cleanly");
    assert_eq!(s.count().await, 5);

    // Set the slot back before e-1, delete message 1, and let the stream take two more messages.
    set_slot_back(&s).await;
    let stream = s.js.get_stream(&s.stream).await.expect("stream");
    stream.delete_message(1).await.expect("delete message 1");
    stream_max_messages(&s, 6).await;

    let relay = s.relay().await;
    wait_for(
        "the replay that trusts no tail to store e-1 and e-2 again and be cut off",
        Duration::from_secs(60),
        || async { s.count().await >= 6 },
    )
    .await;
    let cut_off = ids_and_replays(&s.read_all().await);
    assert_eq!(
        cut_off,
        [
            (2, "e-2".into(), None),
            (3, "e-3".into(), None),
            (4, "e-4".into(), None),
            (5, "e-5".into(), None),
            (6, "e-1".into(), Some("5".into())),
            (7, "e-2".into(), Some("5".into())),
        ],
        "the replay that trusted no tail stamps the stream's last sequence before it"
    );

    // The next session (the relay restarts after the refusal) proves e-3..e-5 stored from message
    // 5 on and confirms past them, with the stream still full: nothing of them is sent again.
    s.wait_confirmed(
        "the slot confirmed past e-5 without publishing e-3..e-5 again",
        end,
    )
    .await;
    stream_max_messages(&s, -1).await;
    s.write_each(&["e-6"]);
    let end = s.wal_lsn().await;
    s.wait_confirmed("e-6 confirmed", end).await;
    assert_eq!(
        ids(&s).await,
        ["e-2", "e-3", "e-4", "e-5", "e-1", "e-2", "e-6"],
        "e-3..e-5 once; only what the replay that trusted no tail sent twice"
    );
    relay.stop().await.expect("relay stops cleanly");
}

/// The look past a cut-off replay's tail can itself fail: message N, the stream's last before
/// that replay, may be from a history the database no longer has (restored from a disk snapshot:
/// the same system and timeline, so only the replay can tell). The replay that trusted no tail was
/// started for exactly that reason. A session that finds message N missing from the replay must
/// distrust only the look past: the tail itself, the cut-off replay's own copy, is this history's
/// and is proven as usual. Distrusting everything would publish every event from the confirmed
/// position again, and with atomic batches store them twice (found by the simulation, seeds 1367,
/// 1910 and 3077: a restore, a replay that trusted no tail cut off by a refusal, and copies of a
/// partly stored transaction stored again by the session after the failed look).
///
/// Here: message 1 is what a restore from a snapshot leaves in the stream, the relay's message for
/// an event the restored database never committed, at a position the database's WAL has since
/// passed with other events. The relay's first session finds the replay passing that position
/// without it and trusts no tail; its replay stores e-1 and e-2 again and is cut off by the
/// stream's `max_msgs`. Then the slot is set back before e-1 and a new relay process starts: its
/// first session reads message 1 past the tail (e-2's copy), finds it missing from the replay
/// again, and the session after it must prove e-1 and e-2 against their copies and store only
/// e-3 and e-4.
#[tokio::test]
async fn a_failed_look_past_a_cut_off_replay_falls_back_to_its_tail() {
    let s = atomic_scenario(true).await;
    save_slot(&s).await;

    s.write_each(&["e-1", "e-2"]);
    let lost_at = s.wal_lsn().await;
    s.write_each(&["e-3", "e-4"]);
    let end = s.wal_lsn().await;

    // The relay's message for an event of a lost history, at a position between e-2 and e-3.
    publish_lost_history_message(&s, lost_at).await;
    stream_max_messages(&s, 3).await;

    let relay = s.relay().await;
    wait_for(
        "the replay that trusts no tail to store e-1 and e-2 again and be cut off",
        Duration::from_secs(60),
        || async { s.count().await >= 3 },
    )
    .await;
    relay.stop().await.expect("relay stops cleanly");
    assert_eq!(
        ids_and_replays(&s.read_all().await),
        [
            (1, "e-lost".into(), None),
            (2, "e-1".into(), Some("1".into())),
            (3, "e-2".into(), Some("1".into())),
        ],
        "the replay that trusted no tail stamps the stream's last sequence before it"
    );

    // Set the slot back before e-1 (the confirmation of e-1 and e-2 may have reached the server)
    // and lift the limit: a new process, with no memory of the first one's distrust, starts.
    set_slot_back(&s).await;
    stream_max_messages(&s, -1).await;
    let relay = s.relay().await;
    s.wait_confirmed("e-4 confirmed", end).await;
    relay.stop().await.expect("relay stops cleanly");
    assert_eq!(
        ids(&s).await,
        ["e-lost", "e-1", "e-2", "e-3", "e-4"],
        "e-1 and e-2 proven by their copies, not stored a third time"
    );
}

/// A relay process that found the stream's tail unreliable skips nothing only while the stream
/// still ends at that tail. With a standby, the other process may take the slot and store past it
/// meanwhile; when the first takes the slot back, its distrust is stale, and keeping it would
/// publish every event from the confirmed position again (with atomic batches, stored twice: found
/// by the simulation, seed 2659, a process whose publish was refused after the other overtook it).
///
/// Here: message 1 is a lost history's (as in the test above). Relay A, behind a proxy to NATS,
/// finds the replay passing it and trusts no tail, but cannot store (the stream's `max_msgs`); then
/// A loses NATS. Relay B takes the slot, trusts no tail either, and stores e-1..e-3 again. The slot
/// is set back before e-1 and A gets NATS back: it must judge the stream's new tail (B's copy of
/// e-3, and the failed look past it) and store nothing again.
#[tokio::test]
async fn a_distrust_of_a_tail_the_stream_has_since_passed_is_dropped() {
    let s = atomic_scenario(false).await;
    let proxy = Proxy::start(s.nats.port());
    let mut config_a = s.config.clone();
    config_a.nats.url = proxy.nats_url();

    save_slot(&s).await;
    s.write_each(&["e-1", "e-2"]);
    let lost_at = s.wal_lsn().await;
    s.write_each(&["e-3"]);
    let end = s.wal_lsn().await;
    publish_lost_history_message(&s, lost_at).await;
    stream_max_messages(&s, 1).await;

    // A: the replay passes message 1's position without it; the next sessions trust no tail and
    // are refused by the full stream.
    let a = InProcessRelay::start(config_a);
    wait_for(
        "relay A to restart after the failed replay and the refusals",
        Duration::from_secs(60),
        || async { a.metrics.reconnects.get() >= 3 },
    )
    .await;
    proxy.refuse(true);
    proxy.cut();
    stream_max_messages(&s, -1).await;

    // B stores e-1..e-3 again (trusting no tail, for the same reason) and confirms them.
    let b = InProcessRelay::start(s.config.clone());
    s.wait_confirmed("relay B to confirm e-3", end).await;
    b.stop().await.expect("relay B stops cleanly");
    assert_eq!(ids(&s).await, ["e-lost", "e-1", "e-2", "e-3"]);

    set_slot_back(&s).await;
    proxy.refuse(false);
    s.wait_confirmed_within("relay A to confirm e-3", end, Duration::from_secs(120))
        .await;
    a.stop().await.expect("relay A stops cleanly");
    assert_eq!(
        ids(&s).await,
        ["e-lost", "e-1", "e-2", "e-3"],
        "relay A proved B's copies instead of storing e-1..e-3 once more"
    );
}

/// What a restore from a disk snapshot leaves in the stream: the relay's message for an event
/// (`e-lost`) the restored database never committed, stamped with this database's history at
/// `at`, a position its WAL has since passed with other events.
async fn publish_lost_history_message(s: &Scenario, at: outbox_relay::Lsn) {
    let system: String = s
        .client
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await
        .expect("system identifier")
        .get(0);
    let timeline: i32 = s
        .client
        .query_one("SELECT timeline_id FROM pg_control_checkpoint()", &[])
        .await
        .expect("timeline")
        .get(0);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "e-lost");
    headers.insert(
        "Outbox-Position",
        format!("{system}/{timeline}/{}/{at}:0", s.slot).as_str(),
    );
    s.js.publish_with_headers("outbox.Claim", headers, "{}".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
}
