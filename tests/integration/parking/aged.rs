//! A parked key outlives the stream's `max_age`: its parked copies (and release markers) carry
//! `Nats-TTL: never` on a stream `setup` lets hold per-message TTLs, so the stream's age limit never
//! removes the only record of a parked event, and a restart still finds the key parked; `verify` then
//! calls the events aged out behind the parked copy `older_than_stream`, not `missing`.

use std::time::Duration;

use serde_json::Value;

use super::{STRICT, approve, close, ids_on, insert, parking_subject};
use crate::support::{Scenario, run_command, wait_for};

/// A park-mode world whose stream removes messages after 2 s (`max_age`).
async fn aging_world() -> Scenario {
    Scenario::builder()
        .text_ids()
        .schema("ClaimApproved", STRICT)
        .park()
        .config(|c| {
            c.nats.max_age_secs = 2;
            c.nats.duplicate_window_secs = 1;
        })
        .start()
        .await
}

/// A key parked longer than the stream's `max_age`: its parked events must not age out of the
/// stream (they are the only record of them, the slot is past them), and after a restart the
/// key's next event still waits behind its poison.
#[tokio::test]
async fn a_key_parked_longer_than_max_age_stays_parked_across_a_restart() {
    let s = aging_world().await;
    let relay = s.relay().await;
    insert(
        &s.client,
        "a-1",
        "4711",
        "ClaimApproved",
        r#"{"claim": "x"}"#,
    )
    .await;
    insert(&s.client, "p-1", "4711", "ClaimPaid", r#"{"claim": 1}"#).await;
    wait_for("both parked", super::LIMIT, || async {
        ids_on(&s.read_all().await, &parking_subject(&s.config, "4711")).len() == 2
    })
    .await;
    // Longer than max_age: the stream's own limit removes what it may.
    tokio::time::sleep(Duration::from_secs(5)).await;
    relay.stop().await.expect("clean stop");
    let relay = s.relay().await;
    close(&s.client, "4711").await;
    wait_for("ClaimClosed stored", super::LIMIT, || async {
        s.read_all().await.iter().any(|m| m.id() == "c-4711")
    })
    .await;
    let all = s.read_all().await;
    assert!(
        ids_on(&all, "outbox.Claim").is_empty(),
        "the key is still parked: {all:#?}"
    );
    assert_eq!(
        ids_on(&all, &parking_subject(&s.config, "4711")),
        ["a-1", "p-1", "c-4711"],
        "the parked events outlived max_age: {all:#?}"
    );
    relay.stop().await.expect("clean stop");
}

/// An event stored after a parked copy ages out while the copy stays at the stream's head, so its
/// message is gone *inside* the stream. `max_age` explains that, as it explains a head trimmed by
/// age: verify must say `older_than_stream` for its row, not `missing` (which tells an operator an
/// event was lost).
#[tokio::test]
async fn verify_calls_an_event_aged_out_behind_a_parked_copy_older_than_the_stream() {
    let s = aging_world().await;
    let relay = s.relay().await;
    approve(&s.client, "4711", r#"{"claim": "x"}"#).await;
    approve(&s.client, "4712", r#"{"claim": 4712}"#).await;
    wait_for(
        "4712 stored after 4711's parked copy",
        super::LIMIT,
        || async { s.read_all().await.iter().any(|m| m.id() == "a-4712") },
    )
    .await;
    relay.stop().await.expect("clean stop");
    wait_for(
        "a-4712 aged out, the parked copy kept",
        super::LIMIT,
        || async {
            let all = s.read_all().await;
            !all.iter().any(|m| m.id() == "a-4712")
                && ids_on(&all, &parking_subject(&s.config, "4711")) == ["a-4711"]
        },
    )
    .await;
    let env = s.env();
    let done = tokio::task::spawn_blocking(move || {
        run_command(&["verify", "--json"], &env, Duration::from_secs(120))
    })
    .await
    .unwrap();
    let json: Value = serde_json::from_str(done.stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "verify printed no JSON ({e}): {} {}",
            done.stdout, done.stderr
        )
    });
    assert_eq!(json["missing"], 0, "{json}");
    assert_eq!(json["older_than_stream"], 1, "{json}");
    assert_eq!(json["parked"], 1, "{json}");
}
