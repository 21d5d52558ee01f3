//! Waiting is decided by the slot, never by a clock: events the relay has not published (it is
//! stopped, or NATS is down) are `waiting`, not missing, however old their rows; what the slot
//! cannot tell (its look ends at its bound, or it cannot be copied) is `unknown`, never missing.

use super::*;

/// Claims approved an hour ago (longer than any timeout the relay or verify has), while the relay
/// is stopped: `w-1..=w-n`, one transaction each.
async fn approved_an_hour_ago(s: &Story, n: u32) {
    for i in 1..=n {
        s.client
            .execute(
                "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, created_at) \
                 VALUES ($1, 'Claim', $2, 'ClaimApproved', '{}', now() - interval '1 hour')",
                &[&format!("w-{i}"), &i.to_string()],
            )
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn events_of_a_relay_stopped_for_longer_than_any_timeout_are_waiting_not_missing() {
    let s = Story::new().await;
    s.relay_publishes(1..21).await;
    approved_an_hour_ago(&s, 3).await;
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "waiting is no difference: {json}");
    assert_counts(&json, &[("waiting", 3)]);
    assert_eq!(json["examples"]["waiting"][0]["event_id"], "w-1", "{json}");
    assert_eq!(json["rows"], 23, "{json}");
    // The proof ends before the oldest waiting row.
    assert!(json["proven_up_to"]["created_at"].is_string(), "{json}");

    // Once the relay runs, they arrive: clean.
    let relay = s.relay().await;
    s.wait_messages(23).await;
    relay.stop().await.expect("relay stops cleanly");
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "{json}");
    assert_counts(&json, &[]);
}

#[tokio::test]
async fn a_look_that_its_bound_ends_leaves_the_rows_it_did_not_reach_unknown_never_missing() {
    let s = Story::new().await;
    s.relay_publishes(1..6).await;
    approved_an_hour_ago(&s, 20).await;
    // Each of the 20 transactions is three or four changes: the look ends after a few of them.
    let (code, json, stderr) = s.verify_env(&["--slot-look", "10"], &[]).await;
    let (waiting, unknown) = (
        json["waiting"].as_u64().unwrap(),
        json["unknown"].as_u64().unwrap(),
    );
    assert!(waiting > 0 && unknown > 0, "{json}");
    assert_eq!(waiting + unknown, 20, "{json}");
    assert_eq!(json["missing"], 0, "{json}");
    assert_eq!(code, 2, "unknown could not be checked: {json}");
    assert!(stderr.contains("--slot-look"), "{stderr}");
    // With the default bound, every one of them is told.
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "{json}");
    assert_counts(&json, &[("waiting", 20)]);
}

#[tokio::test]
async fn events_written_while_nats_is_down_are_reported_waiting_and_the_run_exits_2() {
    let s = Story::new().await;
    let relay = s.relay().await;
    s.fillers(1, 10, 5).await;
    s.wait_messages(10).await;
    s.wait_all_confirmed().await;
    s.nats.stop();
    // The claims service goes on approving claims: the relay cannot publish them.
    approved_an_hour_ago(&s, 4).await;
    let (code, json, stderr) = s.verify_env(&[], &[]).await;
    println!("stderr: {stderr}");
    assert_eq!(code, 2, "the stream could not be read: {json}");
    assert_counts(&json, &[("waiting", 4)]);
    assert_eq!(json["rows"], 14, "{json}");
    assert_eq!(json["checks"], serde_json::json!(["waiting"]), "{json}");
    assert!(
        json["not_checked"]
            .as_str()
            .is_some_and(|n| n.contains("could not be read")),
        "{json}"
    );
    assert!(stderr.contains("could not be read"), "{stderr}");

    s.nats.start_again();
    s.wait_messages(14).await;
    relay.stop().await.expect("relay stops cleanly");
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "after the outage: {json}");
    assert_counts(&json, &[]);
}

#[tokio::test]
async fn a_slot_that_cannot_be_copied_leaves_rows_unknown_with_one_warning_line() {
    let s = Story::new().await;
    s.relay_publishes(1..6).await;
    approved_an_hour_ago(&s, 2).await;
    // A role that may read the table but not use replication slots.
    let role = format!("verifier_{}", s.config.postgres.slot);
    s.db.psql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'verify-pw'; GRANT SELECT ON public.outbox TO {role};"
    ));
    let url = crate::support::PgServer::shared().url_as(&role, "verify-pw", s.db.name());
    let (code, json, stderr) = s
        .verify_env(&[], &[("OUTBOX_RELAY_POSTGRES_URL", &url)])
        .await;
    s.db.psql(&format!("DROP OWNED BY {role}; DROP ROLE {role};"));
    assert_eq!(code, 2, "{json}");
    assert_counts(&json, &[("unknown", 2)]);
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("warning:")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(
        warnings[0].contains("cannot copy it") && warnings[0].contains("REPLICATION"),
        "{stderr}"
    );
}
