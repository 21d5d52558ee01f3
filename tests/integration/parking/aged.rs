//! A parked key outlives the stream's `max_age`: its parked copies (and release markers) carry
//! `Nats-TTL: never` on a stream `setup` lets hold per-message TTLs, so the stream's age limit never
//! removes the only record of a parked event, and a restart still finds the key parked.

use super::{STRICT, close, ids_on, insert, parking_subject};
use crate::support::{Scenario, wait_for};

/// A key parked longer than the stream's `max_age`: its parked events must not age out of the
/// stream (they are the only record of them, the slot is past them), and after a restart the
/// key's next event still waits behind its poison.
#[tokio::test]
async fn a_key_parked_longer_than_max_age_stays_parked_across_a_restart() {
    let s = Scenario::builder()
        .text_ids()
        .schema("ClaimApproved", STRICT)
        .park()
        .config(|c| {
            c.nats.max_age_secs = 2;
            c.nats.duplicate_window_secs = 1;
        })
        .start()
        .await;
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
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
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
