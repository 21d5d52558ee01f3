//! docs/quickstart.md, step 4, without the `nats` CLI: the quickstart's SQL (01, 04, 06 and
//! `sql/example_claims.sql`; setup makes the publication), a relay with an HTTP listener, and the
//! `curl -s …/position` the page shows instead of `nats sub`: `last_sequence` is 0 before the
//! claims transaction and 1 after it, and the stream holds the event on `outbox.Claim`. And how long
//! the page says the stream keeps a message: what `setup` really gives a stream it creates.

use std::time::Duration;

use serde_json::Value;

use crate::ops::{free_addr, try_get, wait_for_status};
use crate::support::{
    InProcessRelay, NatsServer, PgServer, TestDb, read_all, relay_config, relay_env, run_command,
};

fn sql(file: &str) -> String {
    let path = format!("{}/sql/{file}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

async fn last_sequence(addr: &str) -> u64 {
    let (status, body) = try_get(addr, "/position").await.expect("/position");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("position JSON");
    v["last_sequence"]
        .as_u64()
        .unwrap_or_else(|| panic!("{body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_4_without_the_nats_cli_shows_the_event_stored_through_position() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/quickstart.md"))
        .expect("read docs/quickstart.md");
    assert!(
        page.contains("curl -s 127.0.0.1:9187/position") && page.contains("`last_sequence` is 1"),
        "the quickstart shows the way without the nats CLI"
    );
    let db = TestDb::create(PgServer::shared()).await;
    for file in [
        "01_outbox_table.sql",
        "04_write_event.sql",
        "06_outbox_message.sql",
    ] {
        db.psql(&sql(file));
    }
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    // The quickstart's 127.0.0.1:9187, on a free port: the machine is shared.
    let addr = free_addr();
    config.http.listen = addr.clone();
    let relay = InProcessRelay::start_streaming(&config, &db.client().await).await;
    wait_for_status(&addr, "/position", 200, 30).await;
    assert_eq!(
        last_sequence(&addr).await,
        0,
        "before the claims transaction"
    );

    db.psql(&sql("example_claims.sql"));
    let mut seen = 0;
    for _ in 0..150 {
        seen = last_sequence(&addr).await;
        if seen >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(seen, 1, "after the claims transaction");
    let stored = read_all(&nats.jetstream().await, &config.nats.stream).await;
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(stored[0].subject, "outbox.Claim");
    relay.stop().await.unwrap();
}

/// The quickstart's "keeps each message for N days by default" against the stream a default
/// `setup` creates, and the line `setup` prints about it.
#[tokio::test]
async fn the_quickstart_says_how_long_the_stream_setup_creates_keeps_messages() {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(&sql("01_outbox_table.sql"));
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let setup = run_command(&["setup"], &relay_env(&config), Duration::from_secs(60));
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let mut stream = nats
        .jetstream()
        .await
        .get_stream(&config.nats.stream)
        .await
        .expect("the stream setup created");
    let secs = stream
        .info()
        .await
        .expect("stream info")
        .config
        .max_age
        .as_secs();
    assert!(secs > 0 && secs % 86_400 == 0, "max_age {secs} s");
    let days = secs / 86_400;
    assert!(
        setup.stdout.contains(&format!("messages kept {secs}s")),
        "{}",
        setup.stdout
    );
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/quickstart.md"))
        .expect("read docs/quickstart.md");
    for said in [
        format!("keeps each message for {days} days by default"),
        format!("`max_age_secs = {secs}`"),
        format!("`messages kept {secs}s`"),
    ] {
        assert!(
            page.contains(&said),
            "docs/quickstart.md does not say {said:?}"
        );
    }
}
