//! A client other than a relay consumes or advances the slot while no relay streams it
//! (P9): the events it skipped are never sent to a relay again. The relay must say
//! so like a lost slot (a log line naming `backfill`, `status` exit 1, a metric) and refuse to
//! stream on past them; and a normal stop and start, also after an idle period in which other
//! tables were written and the slot was confirmed past the last event, must never say it.

use std::time::Duration;

use async_nats::jetstream;

use crate::hostile::{good, http_get, metric};
use crate::support::{
    RelayProcess, Scenario, confirmed_flush, current_wal_lsn, read_all, run_command, slot_exists,
    wait_for,
};

const LIMIT: Duration = Duration::from_secs(60);
const CONSUMED: &str = "outbox_relay_slot_consumed_events";
const STREAMING: &str = "outbox_relay_streaming";
/// Words of the report that only a consumed slot produces.
const REPORT: &str = "by a client other than a relay";

async fn ids_in(js: &jetstream::Context, stream: &str) -> Vec<String> {
    read_all(js, stream)
        .await
        .iter()
        .map(|m| m.id().to_owned())
        .collect()
}

/// The relay binary run with `env`, streaming, once it has stored e-1.
async fn stored_e1(s: &Scenario, env: &[(String, String)]) -> RelayProcess {
    let relay = RelayProcess::spawn(&["run"], env);
    wait_metric(&s.http_addr(), STREAMING, 1.0).await;
    good(&s.client, "e-1").await;
    wait_for("e-1 stored", LIMIT, || async {
        ids_in(&s.js, &s.stream).await == ["e-1"]
    })
    .await;
    relay
}

/// The metric's value, once `/metrics` answers with it.
async fn wait_metric(addr: &str, series: &str, want: f64) {
    wait_for(&format!("{series} = {want}"), LIMIT, || async {
        match http_get(addr, "/metrics").await {
            Some((200, body)) => metric(&body, series) == Some(want),
            _ => false,
        }
    })
    .await;
}

/// Stops the relay with SIGTERM (it must exit 0) and returns its log.
fn stop(mut relay: RelayProcess) -> String {
    let f = relay.terminate(Duration::from_secs(30));
    assert_eq!(f.status.code(), Some(0), "{}", f.stderr);
    f.stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_advanced_past_events_by_another_client_is_reported_and_a_normal_restart_never_is() {
    consumed_by_another_client(
        |slot, _, past| format!("SELECT pg_replication_slot_advance('{slot}', '{past}')"),
        Recovery::DropTheMark,
    )
    .await;
}

/// The recovery the report names: `backfill --replace-slot` publishes the skipped rows, and with
/// them stored the mark has nothing left to show: the backfill drops it, and `run` streams on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_after_a_consumed_slot_publishes_the_skipped_events_and_drops_the_mark() {
    consumed_by_another_client(
        |slot, _, past| format!("SELECT pg_replication_slot_advance('{slot}', '{past}')"),
        Recovery::Backfill,
    )
    .await;
}

/// How the test ends the gap once it is reported.
#[derive(PartialEq)]
enum Recovery {
    /// The operator accepts the gap: drops the mark by hand.
    DropTheMark,
    /// The operator runs the recovery the report names.
    Backfill,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_consumed_by_get_changes_is_reported_and_a_normal_restart_never_is() {
    consumed_by_another_client(
        |slot, publication, past| {
            format!(
                "SELECT count(*) FROM pg_logical_slot_get_binary_changes('{slot}', '{past}', NULL, \
                 'proto_version', '1', 'publication_names', '{publication}')"
            )
        },
        Recovery::DropTheMark,
    )
    .await;
}

/// The story of the module: a clean run with an idle period, a normal restart, then `consume`
/// (SQL for the slot, the publication and the WAL position past the new events) run by another
/// client while no relay runs, and what must follow.
async fn consumed_by_another_client(
    consume: impl Fn(&str, &str, outbox_relay::Lsn) -> String,
    recovery: Recovery,
) {
    let s = Scenario::listening().await;
    s.db.psql("CREATE TABLE public.orders (id bigserial PRIMARY KEY, note text)");
    let (db, config, client, js) = (&s.db, &s.config, &s.client, &s.js);
    let (addr, env, slot, stream) = (s.http_addr(), s.env(), s.slot.clone(), s.stream.clone());
    let mark = format!("{slot}_mark");

    // A relay stores an event; then an idle period: other tables are written and the slot is
    // confirmed past the event, at the walsender's keepalive positions.
    let relay = stored_e1(&s, &env).await;
    for i in 0..50 {
        client
            .execute(
                "INSERT INTO public.orders (note) VALUES ($1)",
                &[&format!("order {i}")],
            )
            .await
            .expect("insert an order");
    }
    let idle_end = current_wal_lsn(client).await;
    wait_for("the idle slot confirmed past the orders", LIMIT, || async {
        confirmed_flush(client, &slot)
            .await
            .is_some_and(|c| c >= idle_end)
    })
    .await;
    let log = stop(relay);
    assert!(!log.contains(REPORT), "a clean run reported: {log}");

    // A normal start after that: nothing reported, the mark is dropped, the relay streams.
    let relay = RelayProcess::spawn(&["run"], &env);
    wait_metric(&addr, STREAMING, 1.0).await;
    let body = http_get(&addr, "/metrics").await.expect("metrics").1;
    assert!(
        metric(&body, CONSUMED).unwrap_or(0.0) == 0.0,
        "a normal restart counted consumed events:\n{body}"
    );
    let log = stop(relay);
    assert!(!log.contains(REPORT), "a normal restart reported: {log}");

    // While no relay runs, events are committed and another client advances the slot past them.
    good(client, "e-2").await;
    good(client, "e-3").await;
    let past = current_wal_lsn(client).await;
    wait_for("the slot released by the stopped relay", LIMIT, || async {
        client
            .query_one(
                "SELECT NOT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(false)
    })
    .await;
    db.psql(&consume(&slot, &config.postgres.publication, past));

    // status, no relay running: exit 1 with the report, naming the events and backfill.
    let status = run_command(&["status"], &env, LIMIT);
    assert_eq!(status.status.code(), Some(1), "{}", status.stdout);
    for part in [
        REPORT,
        "past 2 outbox events the stream lacks",
        "the first e-2",
        "the last e-3",
        "outbox-relay backfill",
    ] {
        assert!(
            status.stdout.contains(part),
            "status lacks {part:?}:\n{}",
            status.stdout
        );
    }

    if recovery == Recovery::Backfill {
        let backfill = run_command(&["backfill", "--replace-slot"], &env, LIMIT);
        assert_eq!(
            backfill.status.code(),
            Some(0),
            "backfill: {}{}",
            backfill.stdout,
            backfill.stderr
        );
        assert!(
            !slot_exists(client, &mark).await,
            "the backfill left the mark of the slot it replaced"
        );
        let relay = RelayProcess::spawn(&["run"], &env);
        wait_metric(&addr, STREAMING, 1.0).await;
        good(client, "e-4").await;
        wait_for("every event stored once", LIMIT, || async {
            ids_in(js, &stream).await == ["e-1", "e-2", "e-3", "e-4"]
        })
        .await;
        let log = stop(relay);
        assert!(!log.contains(REPORT), "reported after the backfill: {log}");
        return;
    }

    // The relay started again: the log line, the metric, and it does not stream on past the gap.
    let relay = RelayProcess::spawn(&["run"], &env);
    wait_metric(&addr, CONSUMED, 2.0).await;
    wait_for("the report in the log", LIMIT, || {
        let log = relay.stderr();
        async move { log.contains(REPORT) && log.contains("outbox-relay backfill") }
    })
    .await;
    let body = http_get(&addr, "/metrics").await.expect("metrics").1;
    assert_eq!(
        metric(&body, STREAMING),
        Some(0.0),
        "it must not stream past the gap"
    );
    let status = run_command(&["status"], &env, LIMIT);
    assert_eq!(status.status.code(), Some(1), "{}", status.stdout);
    assert!(status.stdout.contains(REPORT), "{}", status.stdout);
    assert_eq!(ids_in(js, &stream).await, ["e-1"]);

    assert!(slot_exists(client, &mark).await, "the evidence stays");

    // Dropping the mark accepts the gap: the relay streams again, and says nothing more.
    // The relay peeks the mark at each retry; the drop waits for a moment it is not.
    wait_for("the stop mark dropped by the operator", LIMIT, || async {
        client
            .execute("SELECT pg_drop_replication_slot($1)", &[&mark])
            .await
            .is_ok()
    })
    .await;
    wait_metric(&addr, CONSUMED, 0.0).await;
    wait_metric(&addr, STREAMING, 1.0).await;
    good(client, "e-4").await;
    wait_for("e-4 stored", LIMIT, || async {
        ids_in(js, &stream).await == ["e-1", "e-4"]
    })
    .await;
    stop(relay);
}

/// The report stands while its mark does: a retry after the stream's last message went (a purge
/// here; `max_age` does the same) can no longer compare, and must not drop the evidence and
/// stream on past the gap before anyone saw the report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumed_slot_stays_reported_after_the_streams_last_message_is_gone() {
    let s = Scenario::listening().await;
    let (db, client, js) = (&s.db, &s.client, &s.js);
    let (addr, env, slot, stream) = (s.http_addr(), s.env(), s.slot.clone(), s.stream.clone());
    let mark = format!("{slot}_mark");

    // A relay stores e-1 and stops cleanly (the mark); another client advances the slot past e-2.
    let relay = stored_e1(&s, &env).await;
    stop(relay);
    good(client, "e-2").await;
    let past = current_wal_lsn(client).await;
    wait_for("the slot released by the stopped relay", LIMIT, || async {
        client
            .query_one(
                "SELECT NOT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(false)
    })
    .await;
    db.psql(&format!(
        "SELECT pg_replication_slot_advance('{slot}', '{past}')"
    ));
    let relay = RelayProcess::spawn(&["run"], &env);
    wait_metric(&addr, CONSUMED, 1.0).await;

    // The stream's last message goes. Two more restarts: the second ends a session that began
    // after the purge, whose look could not compare.
    js.get_stream(&stream)
        .await
        .expect("the stream")
        .purge()
        .await
        .expect("purge the stream");
    const RESTARTS: &str = "outbox_relay_reconnects_total{cause=\"postgres\"}";
    let restarts = || async {
        let body = http_get(&addr, "/metrics").await.expect("metrics").1;
        (
            metric(&body, RESTARTS).unwrap_or(0.0),
            metric(&body, STREAMING).unwrap_or(0.0),
        )
    };
    let before = restarts().await.0;
    wait_for(
        "two more restarts, or streaming",
        Duration::from_secs(120),
        || async {
            let (n, streaming) = restarts().await;
            n >= before + 2.0 || streaming == 1.0
        },
    )
    .await;
    let body = http_get(&addr, "/metrics").await.expect("metrics").1;
    assert_eq!(
        metric(&body, STREAMING),
        Some(0.0),
        "it streamed on past the gap once the stream's last message was gone: {}",
        relay.stderr()
    );
    assert_eq!(metric(&body, CONSUMED), Some(1.0), "the report stands");
    assert!(slot_exists(client, &mark).await, "the evidence stays");

    // Dropping the mark accepts the gap, as before.
    wait_for("the stop mark dropped by the operator", LIMIT, || async {
        client
            .execute("SELECT pg_drop_replication_slot($1)", &[&mark])
            .await
            .is_ok()
    })
    .await;
    wait_metric(&addr, STREAMING, 1.0).await;
    good(client, "e-3").await;
    wait_for("e-3 stored, after the gap", LIMIT, || async {
        ids_in(js, &stream).await == ["e-3"]
    })
    .await;
    stop(relay);
}
