//! kill -9 of the real binary while a key is parked, and again right after the release commits:
//! nothing is lost, nothing is stored twice on a subject, the order holds, and the parked set is
//! rebuilt from the stream by the next start; a standby that takes over keeps the parked keys.

use std::time::Duration;

use super::{
    FIXED, STRICT, approve, close, control, ids_on, insert, parking_subject, stored, world,
};
use crate::support::RelayProcess;

fn kill_9(p: &mut RelayProcess) {
    p.signal("KILL");
    assert!(p.wait(Duration::from_secs(30)).is_some(), "killed");
}

#[tokio::test]
async fn kill_9_while_parked_and_right_after_the_release_loses_nothing_and_keeps_order() {
    let s = world(STRICT).await;
    let client = &s.client;
    let mut relay = s.run_binary();
    s.wait_slot_made().await;
    approve(client, "4711", r#"{"claim": "4711"}"#).await;
    insert(client, "p-4711", "4711", "ClaimPaid", r#"{"claim": 4711}"#).await;
    stored(&s.nats, &s.config, 2).await;
    kill_9(&mut relay);
    // While it is down, the claim goes on; the next start must still hold it.
    insert(client, "n-4711", "4711", "ClaimNoted", r#"{"claim": 4711}"#).await;
    let mut relay = s.run_binary();
    let all = stored(&s.nats, &s.config, 3).await;
    let parking = parking_subject(&s.config, "4711");
    assert_eq!(
        ids_on(&all, &parking),
        ["a-4711", "p-4711", "n-4711"],
        "{all:#?}"
    );
    assert!(ids_on(&all, "outbox.Claim").is_empty(), "{all:#?}");
    // The release commits, and the relay dies at once; the fixed contract is in force after.
    s.write_schema("ClaimApproved", FIXED);
    kill_9(&mut relay);
    let mut relay = s.run_binary();
    control(client, "requeue", "4711", "r-9").await;
    kill_9(&mut relay);
    let _relay = s.run_binary();
    close(client, "4711").await;
    let all = stored(&s.nats, &s.config, 8).await;
    assert_eq!(
        ids_on(&all, "outbox.Claim"),
        ["a-4711", "p-4711", "n-4711", "c-4711"],
        "each once, in order: {all:#?}"
    );
    assert_eq!(
        all.iter().filter(|m| m.id() == "released:r-9").count(),
        1,
        "one marker: {all:#?}"
    );
}

#[tokio::test]
async fn a_standby_taking_over_keeps_the_parked_keys() {
    let s = world(STRICT).await;
    let client = &s.client;
    let mut a = s.run_binary();
    s.wait_slot_made().await;
    approve(client, "4711", r#"{"claim": "4711"}"#).await;
    approve(client, "4712", r#"{"claim": 4712}"#).await;
    stored(&s.nats, &s.config, 2).await;
    // The standby waits while A holds the slot, then takes over when A is killed.
    let mut b = s.run_binary();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(b.is_running(), "the standby exited: {}", b.stderr());
    kill_9(&mut a);
    insert(client, "p-4711", "4711", "ClaimPaid", r#"{"claim": 4711}"#).await;
    insert(client, "p-4712", "4712", "ClaimPaid", r#"{"claim": 4712}"#).await;
    let all = stored(&s.nats, &s.config, 4).await;
    assert_eq!(
        ids_on(&all, &parking_subject(&s.config, "4711")),
        ["a-4711", "p-4711"],
        "the standby parks 4711's payment behind its approval: {all:#?}"
    );
    assert_eq!(
        ids_on(&all, "outbox.Claim"),
        ["a-4712", "p-4712"],
        "{all:#?}"
    );
    b.signal("TERM");
    assert!(b.wait(Duration::from_secs(30)).is_some());
}
