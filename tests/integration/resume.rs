//! Where a session resumes. The relay restarts streaming at the slot's confirmed position, and the
//! fence skips the replayed events the stream already holds. It used to judge "already held" by the
//! stream's last message alone: every replayed event whose commit LSN was below that message's
//! `Outbox-Commit-Lsn`, or equal to it, was taken as stored. These tests build, against real
//! servers, the states in which that judgement was wrong and committed events were confirmed to the
//! slot without ever being stored: a dead letter of a non-transactional message whose LSN equals the next
//! transaction's commit LSN, a message someone else published to the stream with a high
//! `Outbox-Commit-Lsn`, a Postgres restored from a disk snapshot, whose slot and WAL go
//! back while the stream does not. A fourth test covers `backfill` with
//! `nats.atomic_transactions`, which never committed its last batch and published messages without
//! `Nats-Msg-Id`, so a rerun could not be deduplicated. The last one stops the relay
//! while a step of its session waits on a blocked query.
//!
//! Each test judges by what a consumer sees: every committed event in the stream, by id, once. An
//! event counts as lost as soon as the slot is confirmed past its commit while the stream lacks it:
//! Postgres never sends a confirmed transaction again, so waiting longer cannot change the outcome.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use outbox_relay::Lsn;
use outbox_relay::config::Config;
use tokio::task::block_in_place;

use crate::faults::{text_id_db, wait_for_slot, write_backlog};
use crate::support::{
    InProcessRelay, NatsServer, PgServer, RelayProcess, Stored, TestDb, confirmed_flush,
    current_wal_lsn, read_all, relay_config, relay_env, stream_count,
};

/// The bound of every wait in this module.
const WAIT: Duration = Duration::from_secs(30);

/// `relay_config` with frequent status updates, so the slot's confirmed position (which the tests
/// wait for) follows the acks closely.
fn resume_config(db: &TestDb, nats: &NatsServer) -> Config {
    let mut config = relay_config(db, nats);
    config.postgres.status_interval_ms = 100;
    config
}

/// Starts the relay in process and waits until its slot has a consistent point: rows committed
/// before that are not decoded.
async fn start_relay(config: &Config, client: &tokio_postgres::Client) -> InProcessRelay {
    let relay = InProcessRelay::start(config.clone());
    wait_for_slot(client, &config.postgres.slot).await;
    relay
}

/// One line per message, for failure messages: sequence, id, subject, commit LSN; of a long stream
/// the first 3 and the last 10.
fn summary(stored: &[Stored]) -> Vec<String> {
    let line = |m: &Stored| {
        format!(
            "seq {} id {} on {} @{}",
            m.seq,
            m.headers
                .get("Nats-Msg-Id")
                .or_else(|| m.headers.get("Outbox-Event-Id"))
                .map_or("-", String::as_str),
            m.subject,
            m.headers
                .get("Outbox-Commit-Lsn")
                .map_or("-", String::as_str)
        )
    };
    if stored.len() <= 13 {
        return stored.iter().map(line).collect();
    }
    let mut lines: Vec<String> = stored[..3].iter().map(line).collect();
    lines.push(format!("… {} more …", stored.len() - 13));
    lines.extend(stored[stored.len() - 10..].iter().map(line));
    lines
}

/// The stream's messages (none while it does not exist).
async fn stored(js: &async_nats::jetstream::Context, stream: &str) -> Vec<Stored> {
    if stream_count(js, stream).await == 0 {
        return Vec::new();
    }
    read_all(js, stream).await
}

/// Ids of `expected` the stream does not hold.
fn missing<'a>(stored: &[Stored], expected: &'a [String]) -> Vec<&'a str> {
    let got: BTreeSet<&str> = stored.iter().map(Stored::id).collect();
    expected
        .iter()
        .map(String::as_str)
        .filter(|id| !got.contains(id))
        .collect()
}

/// Waits (bounded) until the stream holds every id of `expected`; returns its messages.
async fn wait_stored(
    js: &async_nats::jetstream::Context,
    stream: &str,
    expected: &[String],
    what: &str,
) -> Vec<Stored> {
    let deadline = Instant::now() + WAIT;
    loop {
        let all = stored(js, stream).await;
        if missing(&all, expected).is_empty() {
            return all;
        }
        if Instant::now() >= deadline {
            panic!(
                "{what}: expected {} events in {stream} within {WAIT:?}, still missing {:?}; the stream holds {:#?}",
                expected.len(),
                missing(&all, expected),
                summary(&all)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (bounded) until the slot is confirmed to `at_least` or beyond.
async fn wait_confirmed(client: &tokio_postgres::Client, slot: &str, at_least: Lsn, what: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let confirmed = confirmed_flush(client, slot).await;
        if confirmed.is_some_and(|c| c >= at_least) {
            return;
        }
        if Instant::now() >= deadline {
            panic!(
                "{what}: expected slot {slot} confirmed to {at_least} or beyond within {WAIT:?}, it is at {confirmed:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The verdict of each test: every id of `expected` is stored exactly once. `past` is a WAL
/// position after their commits; once the relay has confirmed the slot to it, everything it has not
/// stored is lost for good, so the wait ends there rather than at the deadline. (The confirmed
/// position is read before the stream: what the relay stored before confirming is then seen.)
async fn assert_delivered(
    js: &async_nats::jetstream::Context,
    stream: &str,
    client: &tokio_postgres::Client,
    slot: &str,
    expected: &[String],
    past: Lsn,
    what: &str,
) -> Vec<Stored> {
    let deadline = Instant::now() + WAIT;
    let all = loop {
        let confirmed = confirmed_flush(client, slot).await;
        let all = stored(js, stream).await;
        let lost = missing(&all, expected);
        if lost.is_empty() {
            break all;
        }
        if confirmed.is_some_and(|c| c >= past) {
            panic!(
                "{what}: committed events lost: {lost:?} (of {expected:?}) are not in {stream}, yet slot {slot} is confirmed to \
                 {} (past their commits, which end by {past}), so Postgres will never send them again; the stream \
                 holds {:#?}",
                confirmed.unwrap_or_default(),
                summary(&all)
            );
        }
        if Instant::now() >= deadline {
            panic!(
                "{what}: expected {expected:?} in {stream} within {WAIT:?}; missing {lost:?}, slot {slot} confirmed to \
                 {confirmed:?} (their commits end by {past}); the stream holds {:#?}",
                summary(&all)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for m in &all {
        *counts.entry(m.id()).or_default() += 1;
    }
    let twice: Vec<_> = expected
        .iter()
        .filter(|id| counts.get(id.as_str()).copied().unwrap_or(0) > 1)
        .collect();
    assert!(
        twice.is_empty(),
        "stored more than once: {twice:?}; the stream holds {:#?}",
        summary(&all)
    );
    all
}

/// The commit LSN of the first transaction a never-streamed pgoutput slot `probe` sees, as the relay
/// would put it in `Outbox-Commit-Lsn`: the Begin message's `final_lsn` ('B', then an Int64).
/// <https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html>
async fn probe_commit_lsn(client: &tokio_postgres::Client, probe: &str, publication: &str) -> Lsn {
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2)",
            &[&probe, &publication],
        )
        .await
        .expect("peek the probe slot");
    rows.iter()
        .map(|r| r.get::<_, Vec<u8>>(0))
        .find(|data| data.first() == Some(&b'B') && data.len() >= 9)
        .map(|data| Lsn(u64::from_be_bytes(data[1..9].try_into().unwrap())))
        .unwrap_or_else(|| panic!("the probe slot {probe} saw no transaction"))
}

/// A non-transactional logical message with the prefix becomes a dead letter whose
/// `Outbox-Commit-Lsn` is the message's LSN, the END of its WAL record. A transaction whose commit
/// record follows it directly has that same commit LSN. With the dead letter as the stream's tail,
/// the replay after a restart used to take that transaction's events for the tail's own
/// transaction, and skip them all (the id it looks for is the dead letter's, which they never
/// match).
///
/// Reproduction: transaction A inserts two outbox rows and stays open; another session emits the
/// message; the relay dead-letters it and confirms its end; the relay stops; A commits (nothing
/// writes WAL in between, so A's commit record starts where the message's ends); the relay starts
/// again. A's events must arrive. WAL is per server, so this runs on a private one where no other
/// test writes; a background record (bgwriter's running-xacts, every 15 s) can still land between
/// the two, which a probe slot detects, and then the setup is tried again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_transactional_message_adjacent_to_a_commit_loses_nothing_on_restart() {
    const ATTEMPTS: u32 = 5;
    let started = Instant::now();
    let pg = PgServer::start_private();
    let nats = NatsServer::start();
    let js = nats.jetstream().await;
    let mut misses = Vec::new();
    for attempt in 1..=ATTEMPTS {
        let db = text_id_db(&pg).await;
        let mut config = resume_config(&db, &nats);
        config.outbox.message_prefix = "outbox".into();
        let (stream, slot) = (config.nats.stream.clone(), config.postgres.slot.clone());
        let dead_subject = config.nats.dead_letter_subject.clone();
        let client = db.client().await;
        let relay = start_relay(&config, &client).await;
        // A second slot, only peeked: it tells A's commit LSN even when the relay loses A's events.
        // Created before A begins (a slot waits for running transactions to find its start).
        let probe = format!("probe_{}", db.name());
        client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&probe],
            )
            .await
            .expect("create the probe slot");

        let a_ids = vec![format!("a{attempt}-1"), format!("a{attempt}-2")];
        let mut session_a = db.client().await;
        let a = session_a.transaction().await.expect("BEGIN in session A");
        for id in &a_ids {
            a.execute(
                "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, 'Claim', '4711', 'ClaimApproved', '{}')",
                &[id],
            )
            .await
            .unwrap_or_else(|e| panic!("insert {id} in session A: {e}"));
        }
        // Session B: the message A's commit will follow.
        client
            .execute(
                "SELECT pg_logical_emit_message(false, 'outbox', $1::text)",
                &[&format!(
                    r#"{{"id":"nt-{attempt}","aggregate_type":"Claim","aggregate_id":"4711","event_type":"E","payload":{{}}}}"#
                )],
            )
            .await
            .expect("emit the non-transactional message");
        let dead = wait_stored_count(&js, &stream, 1, "the dead letter").await;
        let dead = dead[0].clone();
        assert_eq!(dead.subject, dead_subject, "{dead:?}");
        let message_end = dead.commit_lsn();
        wait_confirmed(&client, &slot, message_end, "the dead letter confirmed").await;
        relay.stop().await.expect("the relay stops cleanly");

        a.commit().await.expect("COMMIT in session A");
        let a_commit = probe_commit_lsn(&client, &probe, &config.postgres.publication).await;
        client
            .execute("SELECT pg_drop_replication_slot($1)", &[&probe])
            .await
            .expect("drop the probe slot");
        if a_commit != message_end {
            misses.push(format!(
                "attempt {attempt}: the message ends at {message_end}, A's commit record starts at {a_commit}"
            ));
            eprintln!("{}; trying again", misses.last().unwrap());
            continue;
        }
        // Every record after A's commit is after its end: once the slot passes this, A was sent.
        let past = current_wal_lsn(&client).await;

        let relay = InProcessRelay::start(config.clone());
        let what = format!(
            "A's events, whose commit record starts at {message_end} where the non-transactional message's \
             record ends (the dead letter's Outbox-Commit-Lsn), after a restart with the dead letter as the tail"
        );
        let all = assert_delivered(&js, &stream, &client, &slot, &a_ids, past, &what).await;
        let dead_letters: Vec<&Stored> = all.iter().filter(|m| m.id() == dead.id()).collect();
        assert_eq!(
            dead_letters.len(),
            1,
            "the dead letter is stored once: {:#?}",
            summary(&all)
        );
        for m in all.iter().filter(|m| a_ids.iter().any(|id| id == m.id())) {
            assert_eq!(
                m.commit_lsn(),
                message_end,
                "A's event {} carries A's commit LSN, the message's end",
                m.id()
            );
        }
        relay.stop().await.expect("the relay stops cleanly");
        eprintln!(
            "adjacent message and commit at {message_end} on attempt {attempt}; {:?} in all",
            started.elapsed()
        );
        return;
    }
    panic!(
        "setup: in {ATTEMPTS} attempts A's commit record never started where the message's record ended, so the \
         test proved nothing: {misses:#?}"
    );
}

/// Waits (bounded) until the stream holds at least `n` messages; returns them.
async fn wait_stored_count(
    js: &async_nats::jetstream::Context,
    stream: &str,
    n: u64,
    what: &str,
) -> Vec<Stored> {
    let deadline = Instant::now() + WAIT;
    while stream_count(js, stream).await < n {
        if Instant::now() >= deadline {
            panic!(
                "{what}: expected {n} messages in {stream} within {WAIT:?}, it holds {:#?}",
                summary(&stored(js, stream).await)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    read_all(js, stream).await
}

/// The replay used to trust the headers of whatever message is at the stream's tail. A message
/// someone else publishes there (here: an operator moving a dead letter back by hand, headers and
/// all, as `nats pub` or a script would) with `Outbox-Commit-Lsn: FFFF/0` made every replayed event
/// look stored: the 3 events committed while the relay was stopped were skipped and confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_message_at_the_tail_does_not_make_the_replay_skip_events() {
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let config = resume_config(&db, &nats);
    assert!(config.nats.fence, "the fenced stream is the default");
    let (stream, slot) = (config.nats.stream.clone(), config.postgres.slot.clone());
    let dead_subject = config.nats.dead_letter_subject.clone();
    let client = db.client().await;
    let js = nats.jetstream().await;

    let relay = start_relay(&config, &client).await;
    let first = block_in_place(|| write_backlog(&db, "e", 3));
    wait_stored(&js, &stream, &first, "the first events").await;
    relay.stop().await.expect("the relay stops cleanly");

    // Committed while the relay is stopped: behind the slot's confirmed position, to be replayed.
    let later = block_in_place(|| write_backlog(&db, "n", 3));
    let past = current_wal_lsn(&client).await;

    let subjects = js
        .get_stream(&stream)
        .await
        .expect("the relay's stream")
        .info()
        .await
        .expect("stream info")
        .config
        .subjects
        .clone();
    assert!(
        subjects.contains(&dead_subject),
        "the stream captures the dead-letter subject {dead_subject}: {subjects:?}"
    );
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "moved-back-by-hand-1");
    headers.insert("Outbox-Commit-Lsn", "FFFF/0");
    let ack = js
        .publish_with_headers(dead_subject.clone(), headers, "{}".into())
        .await
        .expect("publish by hand")
        .await
        .expect("JetStream acks the hand-published message");
    assert_eq!(ack.stream, stream, "the stream stored it");

    let relay = InProcessRelay::start(config.clone());
    let what = "the events committed while the relay was stopped, behind a hand-published tail with \
                Outbox-Commit-Lsn FFFF/0";
    let all = assert_delivered(&js, &stream, &client, &slot, &later, past, what).await;
    assert!(
        missing(&all, &first).is_empty(),
        "the first events are still there: {:#?}",
        summary(&all)
    );
    relay.stop().await.expect("the relay stops cleanly");
}

/// `cp -a from to`: keeps owner and modes, as Postgres needs for its data directory.
fn copy_dir(from: &Path, to: &Path) {
    let out = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .output()
        .expect("spawn cp");
    assert!(
        out.status.success(),
        "cp -a {} {}: {}",
        from.display(),
        to.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Three events, stored and confirmed: what the snapshot will hold.
async fn events_before_the_snapshot(
    db: &TestDb,
    js: &async_nats::jetstream::Context,
    stream: &str,
    client: &tokio_postgres::Client,
    slot: &str,
) {
    let before = block_in_place(|| write_backlog(db, "s", 3));
    wait_stored(js, stream, &before, "the events before the snapshot").await;
    let end = current_wal_lsn(client).await;
    wait_confirmed(client, slot, end, "the events before the snapshot").await;
}

/// Stops `pg`, puts the snapshot `copy` in place of its data directory and starts it again: a
/// restore from a disk snapshot, same system and timeline.
fn restore(pg: &PgServer, copy: &Path) {
    pg.stop();
    std::fs::remove_dir_all(pg.data_dir())
        .unwrap_or_else(|e| panic!("remove {}: {e}", pg.data_dir().display()));
    copy_dir(copy, pg.data_dir());
    pg.start();
}

/// Postgres restored from a disk snapshot: the slot (confirmed position) and the WAL go back to the
/// snapshot, the stream keeps the events committed after it (set A), so its tail's commit LSN is
/// ahead of the restored server's WAL. Events committed after the restore (set B) get commit LSNs
/// below that tail's, and the replay used to skip them as stored, though no event of set B was ever
/// published. Set B is kept far smaller than set A so its commits stay below the tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_committed_after_a_restore_from_a_disk_snapshot_are_published() {
    restore_from_a_snapshot(3, false, false).await;
}

/// A restore from a disk snapshot, the harder case: after the restore the new history writes past
/// the old tail's position before the relay starts, so nothing tells the relay at its start that
/// the tail is from another history (same system, same timeline, position below the server's WAL
/// end). Its replay must find out on its own (the tail's event never comes) and publish every event
/// of the new history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_after_a_restore_are_published_when_the_new_wal_passed_the_old_tail() {
    restore_from_a_snapshot(400, true, false).await;
}

/// A restore from a disk snapshot on a quiet outbox: after the restore a few events are committed
/// below the old tail's position, then only other tables write, past it. The replay skips the few
/// (they are below the tail) and no later event ever comes to show that the tail's own event is
/// missing: the walsender's keepalives, past the tail's position, must.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_after_a_restore_are_published_when_only_other_tables_passed_the_old_tail() {
    restore_from_a_snapshot(3, true, true).await;
}

/// Stores events, snapshots the stopped server, stores 200 more (set A), restores the snapshot,
/// commits `new_events` (set B) and starts the relay: set B must arrive. `past_tail`: the WAL
/// reaches beyond set A's last commit (else it must stay below it); `filler`: another table's
/// writes take it there, after set B.
async fn restore_from_a_snapshot(new_events: u64, past_tail: bool, filler: bool) {
    let pg = PgServer::start_private();
    let db = text_id_db(&pg).await;
    let nats = NatsServer::start();
    let config = resume_config(&db, &nats);
    let (stream, slot) = (config.nats.stream.clone(), config.postgres.slot.clone());
    let js = nats.jetstream().await;
    let snapshot = tempfile::tempdir().expect("tempdir for the snapshot");
    let copy = snapshot.path().join("data");

    // Some events, stored and confirmed, then the snapshot of the cleanly stopped server.
    {
        let client = db.client().await;
        let relay = start_relay(&config, &client).await;
        events_before_the_snapshot(&db, &js, &stream, &client, &slot).await;
        relay.stop().await.expect("the relay stops cleanly");
    }
    block_in_place(|| {
        pg.stop();
        copy_dir(pg.data_dir(), &copy);
        pg.start();
    });

    // Set A: stored and confirmed, then lost with the restore.
    let tail_lsn = {
        let client = db.client().await;
        let relay = start_relay(&config, &client).await;
        let set_a = block_in_place(|| write_backlog(&db, "a", 200));
        let all = wait_stored(&js, &stream, &set_a, "set A").await;
        let end = current_wal_lsn(&client).await;
        wait_confirmed(&client, &slot, end, "set A").await;
        relay.stop().await.expect("the relay stops cleanly");
        all.last().expect("the stream's tail").commit_lsn()
    };
    block_in_place(|| restore(&pg, &copy));

    let client = db.client().await;
    let set_b = block_in_place(|| write_backlog(&db, "b", new_events));
    if filler {
        db.psql(
            "CREATE TABLE filler (x text); \
             INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 3000)",
        );
    }
    let past = current_wal_lsn(&client).await;
    assert_eq!(
        past > tail_lsn,
        past_tail,
        "setup: set B's commits (WAL now at {past}) must end {} the stream's tail at {tail_lsn}, or the test \
         proves nothing",
        if past_tail { "beyond" } else { "below" }
    );
    let relay = InProcessRelay::start(config.clone());
    let what = format!(
        "set B, committed after the restore from the snapshot, {} the stream's tail at {tail_lsn} (set A's last \
         event, lost with the restore)",
        if past_tail { "reaching past" } else { "below" }
    );
    assert_delivered(&js, &stream, &client, &slot, &set_b, past, &what).await;
    relay.stop().await.expect("the relay stops cleanly");
}

/// Runs `outbox-relay <args>` to completion within [`WAIT`]; on a hang, says how far it got.
async fn run_backfill(
    args: &[&str],
    env: &[(String, String)],
    js: &async_nats::jetstream::Context,
    stream: &str,
    rows: u64,
) -> (String, String) {
    let mut p = RelayProcess::spawn(args, env);
    let status = block_in_place(|| p.wait(WAIT));
    let Some(status) = status else {
        let n = stream_count(js, stream).await;
        p.signal("KILL");
        panic!(
            "`outbox-relay {}` with nats.atomic_transactions did not finish within {WAIT:?}: the stream holds {n} of \
             {rows} rows; stdout:\n{}\nstderr:\n{}",
            args.join(" "),
            p.stdout(),
            p.stderr()
        );
    };
    assert!(
        status.success(),
        "`outbox-relay {}` exited with {status}; stdout:\n{}\nstderr:\n{}",
        args.join(" "),
        p.stdout(),
        p.stderr()
    );
    (p.stdout(), p.stderr())
}

/// `backfill` with `nats.atomic_transactions`: the backfill goes through the sink's batcher, which
/// only sends a batch at a transaction's commit, and the backfill never commits the last one, so it
/// used to wait for acks forever. Its messages must also carry `Nats-Msg-Id` (the event id): a
/// backfill is rerun after a failure and relies on JetStream dropping what it already holds, which
/// an atomic batch's messages (id in `Outbox-Event-Id` only) do not allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_with_atomic_transactions_finishes_and_dedups() {
    const ROWS: u64 = 500;
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.nats.atomic_transactions = true;
    let stream = config.nats.stream.clone();
    // aggregate_id = event_id, so each message names its row in a header of its own.
    db.psql(&format!(
        "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'bf-' || lpad(i::text, 4, '0'), 'Claim', 'bf-' || lpad(i::text, 4, '0'), 'ClaimApproved', \
                jsonb_build_object('n', i) \
         FROM generate_series(1, {ROWS}) AS i"
    ));
    let expected: BTreeSet<String> = (1..=ROWS).map(|i| format!("bf-{i:04}")).collect();
    let env = relay_env(&config);
    let js = nats.jetstream().await;

    run_backfill(&["backfill"], &env, &js, &stream, ROWS).await;
    let all = read_all(&js, &stream).await;
    assert_eq!(all.len() as u64, ROWS, "the backfill stored every row once");
    let without_id: Vec<String> = all
        .iter()
        .filter(|m| {
            m.headers.get("Nats-Msg-Id") != m.headers.get("Outbox-Aggregate-Id")
                || !m.headers.contains_key("Nats-Msg-Id")
        })
        .take(5)
        .map(|m| format!("seq {} headers {:?}", m.seq, m.headers))
        .collect();
    assert!(
        without_id.is_empty(),
        "every backfilled message carries Nats-Msg-Id = its event id, e.g. not {without_id:#?}"
    );
    let ids: BTreeSet<String> = all.iter().map(|m| m.id().to_owned()).collect();
    assert_eq!(ids, expected, "the stored ids are the rows' ids");

    // A rerun (after a failure, say) replaces the slot and publishes every row again: JetStream
    // must drop them all as duplicates.
    let (stdout, _) = run_backfill(&["backfill", "--replace-slot"], &env, &js, &stream, ROWS).await;
    let again = read_all(&js, &stream).await;
    assert_eq!(
        again.len() as u64,
        ROWS,
        "the rerun stored nothing twice; its report: {stdout}"
    );
}

/// A step of the session that waits (here the partition lookup, blocked by a lock on one of the
/// outbox table's partitions) must not keep a stop waiting: the relay used to await it without a
/// deadline and without listening for the stop, so SIGTERM waited as long as the lock was held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_is_not_held_up_by_a_blocked_partition_lookup() {
    let db = TestDb::create(PgServer::shared()).await;
    let nats = NatsServer::start();
    db.psql(
        "CREATE TABLE public.outbox (
            event_id text NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
            event_type text NOT NULL, payload jsonb NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, created_at)
        ) PARTITION BY RANGE (created_at);
        CREATE TABLE outbox_2025_01 PARTITION OF outbox FOR VALUES FROM ('2025-01-01') TO ('2025-02-01');
        CREATE TABLE outbox_2025_02 PARTITION OF outbox FOR VALUES FROM ('2025-02-01') TO ('2025-03-01');",
    );
    let config = resume_config(&db, &nats);
    let client = db.client().await;
    let relay = start_relay(&config, &client).await;
    // Partitions under their own names: the first insert into one makes the session look up the
    // outbox table's partitions, which locks every partition (pg_partition_tree).
    db.psql(&format!(
        "ALTER PUBLICATION {} SET (publish_via_partition_root = false)",
        config.postgres.publication
    ));
    // Lock the other partition only: the insert below does not wait for it, the lookup does. The
    // locking transaction writes nothing, so it holds no transaction id that slot creation
    // elsewhere on the shared server would wait for.
    let mut locker = db.client().await;
    let lock = locker.transaction().await.expect("begin");
    lock.batch_execute("LOCK TABLE public.outbox_2025_02 IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock a partition");
    let insert = client.batch_execute(
        "INSERT INTO outbox_2025_01 (event_id, aggregate_type, aggregate_id, event_type, payload, created_at) \
         VALUES ('p-1', 'Claim', '1', 'ClaimApproved', '{}', '2025-01-10')",
    );
    let inserted = tokio::time::timeout(Duration::from_secs(10), insert).await;
    // Give the session time to receive the partition's Relation and start the lookup.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let running = !relay.is_finished();
    let stopped = if inserted.is_ok() && running {
        Some(tokio::time::timeout(Duration::from_secs(5), relay.stop()).await)
    } else {
        None
    };
    lock.rollback().await.expect("release the lock");
    inserted
        .expect("setup: the insert into the unlocked partition waited")
        .expect("insert into the partition");
    assert!(running, "the relay stopped on its own");
    match stopped {
        Some(Ok(result)) => result.expect("the relay stops cleanly"),
        _ => panic!(
            "the relay did not stop within 5 s while its partition lookup waited for a lock on a partition"
        ),
    }
}

/// The position service across a restore, on real servers: one relay process lives through a
/// restore from a disk snapshot on the same system and timeline. Before the restore it had stored
/// far past the snapshot (set A, then other tables' WAL it confirmed while idle); after it, set B
/// (one transaction of 3,000 events) is committed at LSNs below that old stored position, and other
/// tables' WAL takes the server past it, so nothing on the connection shows the restore. A `/wait`
/// for set B's token may only answer "stored" once all of set B is in the stream: the process must
/// not keep its old stored position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restore_the_position_service_waits_for_the_replayed_commits() {
    let pg = PgServer::start_private();
    let db = text_id_db(&pg).await;
    db.psql("CREATE TABLE filler (x text)");
    let nats = NatsServer::start();
    let mut config = resume_config(&db, &nats);
    let addr = crate::ops::free_addr();
    config.http.listen = addr.clone();
    let (stream, slot) = (config.nats.stream.clone(), config.postgres.slot.clone());
    let js = nats.jetstream().await;
    let snapshot = tempfile::tempdir().expect("tempdir for the snapshot");
    let copy = snapshot.path().join("data");
    let stored_lsn = |body: &str| -> Lsn {
        let v: serde_json::Value = serde_json::from_str(body).expect("JSON");
        v["stored_lsn"]
            .as_str()
            .expect("stored_lsn")
            .parse()
            .expect("an LSN")
    };

    let client = db.client().await;
    let relay = start_relay(&config, &client).await;
    events_before_the_snapshot(&db, &js, &stream, &client, &slot).await;
    block_in_place(|| {
        pg.stop();
        copy_dir(pg.data_dir(), &copy);
        pg.start();
    });

    // Set A and 5 MB of another table's WAL: the relay stores and, idle, confirms past them all.
    let client = db.client().await;
    let set_a = block_in_place(|| write_backlog(&db, "a", 200));
    wait_stored(&js, &stream, &set_a, "set A").await;
    db.psql("INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 5000)");
    let old_end = current_wal_lsn(&client).await;
    let deadline = Instant::now() + WAIT;
    let old_stored = loop {
        if let Some((200, body)) = crate::ops::try_get(&addr, "/position").await
            && stored_lsn(&body) >= old_end
        {
            break stored_lsn(&body);
        }
        assert!(
            Instant::now() < deadline,
            "the relay never stored past {old_end}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    // NATS down first, so the relay cannot start a session until set B and the filler are in.
    block_in_place(|| {
        nats.stop();
        restore(&pg, &copy);
    });
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'b-' || i, 'Claim', i::text, 'ClaimApproved', jsonb_build_object('n', i) \
             FROM generate_series(1, 3000) i",
        )
        .await
        .expect("set B");
    let token = current_wal_lsn(&client).await;
    db.psql("INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 10000)");
    let now = current_wal_lsn(&client).await;
    assert!(
        token < old_stored && now > old_stored,
        "setup: set B's token {token} must lie below the old stored position {old_stored} and the WAL \
         ({now}) beyond it, or the test proves nothing"
    );

    block_in_place(|| nats.start_again());
    let before_b = stream_count(&js, &stream).await;
    assert_eq!(before_b, 203, "the events stored before the restore");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Some((status, body)) =
            crate::ops::try_get(&addr, &format!("/wait?lsn={token}&timeout_ms=5000")).await
            && status == 200
        {
            // The answer names the stream's last sequence when it was given: set B's events come
            // after the 203 stored before the restore.
            let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
            let last = v["last_sequence"].as_u64().expect("last_sequence");
            assert!(
                last >= before_b + 3000,
                "/wait answered stored for {token} while the stream's last sequence was {last}: set B's 3,000 \
                 events come after sequence {before_b}: {body}"
            );
            let in_stream = read_all(&js, &stream)
                .await
                .iter()
                .filter(|m| m.id().starts_with("b-"))
                .count();
            assert_eq!(in_stream, 3000, "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "set B was never stored");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relay.stop().await.expect("the relay stops cleanly");
}
