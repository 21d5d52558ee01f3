//! `outbox-relay parked` and `requeue`'s check that a key is parked, against a real JetStream
//! stream holding parked copies and release markers in the relay's wire format (written here, as
//! the relay writes them): a key whose newest message is a parked copy is listed with its count,
//! since, reason, poison and subject (escaped), a key released by a marker is not, a NULL id is
//! its own key; exit 0 with none parked, 1 with some, 2 when NATS cannot be read. `requeue`
//! refuses a released key and sends one that is parked.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use outbox_relay::parking::{KeyHash, parked_subject};
use serde_json::Value;

use crate::support::{Scenario, run_command};

const LIMIT: Duration = Duration::from_secs(60);
const DEAD_LETTER: &str = "outbox_dead_letter";
const SINCE: &str = "2026-05-04T10:15:02.123456Z";
const REASON: &str = "ClaimApproved: /amount: \"a lot\" is not of type \"integer\" (type)";

/// The parking subject of (`aggregate_type`, `aggregate_id`).
fn subject(aggregate_type: &str, aggregate_id: Option<&str>) -> String {
    parked_subject(DEAD_LETTER, KeyHash::of(Some(aggregate_type), aggregate_id))
}

/// A parked copy of event `id`, `count`th in the run behind `poison`.
fn parked_copy(
    key: (&str, Option<&str>),
    id: &str,
    poison: &str,
    count: u64,
    reason: &str,
) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", format!("parked:{id}").as_str());
    h.insert("Outbox-Event-Id", id);
    h.insert("Outbox-Event-Type", "ClaimApproved");
    h.insert("Outbox-Aggregate-Type", key.0);
    if let Some(agg_id) = key.1 {
        h.insert("Outbox-Aggregate-Id", agg_id);
    }
    h.insert("Outbox-Error", reason);
    h.insert("Outbox-Parked-Behind", poison);
    h.insert("Outbox-Subject", format!("outbox.{}", key.0).as_str());
    h.insert("Outbox-Parked-Count", count.to_string().as_str());
    h.insert("Outbox-Parked-Since", SINCE);
    h
}

/// A release marker of request `request` for `key`.
fn release_marker(key: (&str, Option<&str>), request: &str, how: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", format!("released:{request}").as_str());
    h.insert("Outbox-Parking", how);
    h.insert("Outbox-Control-Id", request);
    h.insert("Outbox-Aggregate-Type", key.0);
    if let Some(agg_id) = key.1 {
        h.insert("Outbox-Aggregate-Id", agg_id);
    }
    h
}

async fn publish(
    js: &jetstream::Context,
    subject: String,
    headers: HeaderMap,
    payload: &'static [u8],
) {
    js.publish_with_headers(subject, headers, payload.into())
        .await
        .expect("publish")
        .await
        .expect("stored");
}

#[tokio::test]
async fn parked_lists_each_parked_key_from_the_stream_and_requeue_refuses_a_released_one() {
    let mut s = Scenario::builder().start().await;
    let env = s.env();
    let js = s.js.clone();
    js.create_stream(stream::Config {
        name: s.stream.clone(),
        subjects: vec![
            "outbox.>".into(),
            DEAD_LETTER.into(),
            format!("{DEAD_LETTER}.parked.>"),
        ],
        ..Default::default()
    })
    .await
    .expect("create the stream");

    let none = run_command(&["parked"], &env, LIMIT);
    assert_eq!(
        none.status.code(),
        Some(0),
        "{}{}",
        none.stdout,
        none.stderr
    );
    assert_eq!(
        none.stdout,
        format!("parked: no key is parked in stream {}\n", s.stream)
    );

    let claim = ("Claim", Some("2026/4711"));
    let released = ("Claim", Some("4712"));
    let null_id = ("Claim", None);
    let body = b"{\"claim_id\": 4711, \"amount\": \"a lot\"}";
    publish(
        &js,
        subject(claim.0, claim.1),
        parked_copy(claim, "e-1", "e-1", 1, REASON),
        body,
    )
    .await;
    publish(
        &js,
        subject(released.0, released.1),
        parked_copy(released, "e-2", "e-2", 1, REASON),
        body,
    )
    .await;
    publish(
        &js,
        subject(claim.0, claim.1),
        parked_copy(claim, "e-3", "e-1", 2, REASON),
        body,
    )
    .await;
    publish(
        &js,
        subject(released.0, released.1),
        release_marker(released, "r-1", "requeued"),
        b"",
    )
    .await;
    publish(
        &js,
        subject(null_id.0, null_id.1),
        parked_copy(null_id, "e-4", "e-4", 1, "bad \u{1b}[2J reason"),
        body,
    )
    .await;

    let listed = run_command(&["parked"], &env, LIMIT);
    assert_eq!(listed.status.code(), Some(1), "{}", listed.stderr);
    let lines: Vec<&str> = listed.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", listed.stdout);
    let claim_line = format!(
        "Claim/2026/4711: 2 events parked since {SINCE} behind e-1: {REASON} (subject {})",
        subject(claim.0, claim.1)
    );
    let null_line = format!(
        "Claim (NULL id): 1 event parked since {SINCE} behind e-4: bad \\u{{1b}}[2J reason (subject {})",
        subject(null_id.0, null_id.1)
    );
    assert!(lines.contains(&claim_line.as_str()), "{}", listed.stdout);
    assert!(lines.contains(&null_line.as_str()), "{}", listed.stdout);
    assert!(
        lines[2].starts_with("parked: 2 keys (3 events) in stream "),
        "{}",
        lines[2]
    );

    let json = run_command(&["parked", "--json"], &env, LIMIT);
    assert_eq!(json.status.code(), Some(1), "{}", json.stderr);
    let v: Value = serde_json::from_str(&json.stdout).expect("one JSON object");
    assert_eq!(v["events"], 3, "{v}");
    let keys = v["parked"].as_array().expect("parked is a list");
    assert_eq!(keys.len(), 2, "{v}");
    let first = keys
        .iter()
        .find(|k| k["aggregate_id"] == "2026/4711")
        .expect("the claim's key");
    for (field, want) in [
        ("aggregate_type", "Claim"),
        ("since", SINCE),
        ("reason", REASON),
        ("poison", "e-1"),
    ] {
        assert_eq!(first[field], want, "{field}: {v}");
    }
    assert_eq!(first["count"], 2, "{v}");
    assert_eq!(first["subject"], subject(claim.0, claim.1), "{v}");
    assert!(
        keys.iter()
            .any(|k| k["aggregate_id"].is_null() && k["poison"] == "e-4"),
        "{v}"
    );

    // requeue: a released key is refused, a parked one goes through.
    s.install_operator_role(&[]);
    let refused = run_command(&["requeue", "--key", "Claim/4712"], &env, LIMIT);
    assert_eq!(refused.status.code(), Some(1), "{}", refused.stdout);
    // The command it offers names the variables this one ran with (they set the stream).
    let line = refused.stderr.trim();
    assert!(
        line.starts_with(
            "outbox-relay: Claim/4712 is not parked (`outbox-relay parked` (with OUTBOX_RELAY_"
        ) && line.ends_with(
            "set as for this command) lists what is), so there is nothing to requeue: pass --force to \
             send the request anyway"
        ),
        "{line}"
    );
    let sent = run_command(
        &["requeue", "--key", "Claim/2026/4711", "--no-wait"],
        &env,
        LIMIT,
    );
    assert_eq!(sent.status.code(), Some(0), "{}", sent.stderr);
    assert!(
        sent.stdout.starts_with("requeue Claim/2026/4711: request "),
        "{}",
        sent.stdout
    );
    let discard_null = run_command(
        &[
            "requeue",
            "--key-null-id",
            "Claim",
            "--discard",
            "--no-wait",
        ],
        &env,
        LIMIT,
    );
    assert_eq!(
        discard_null.status.code(),
        Some(0),
        "{}",
        discard_null.stderr
    );

    // NATS gone: parked cannot check (2), requeue cannot tell (1, naming --force).
    s.nats.stop();
    let down = run_command(&["parked"], &env, LIMIT);
    assert_eq!(down.status.code(), Some(2), "{}", down.stdout);
    assert!(
        down.stderr
            .trim()
            .starts_with("outbox-relay: cannot connect to NATS")
            && !down.stderr.trim().contains('\n'),
        "{}",
        down.stderr
    );
    let unknown = run_command(&["requeue", "--key", "Claim/2026/4711"], &env, LIMIT);
    assert_eq!(unknown.status.code(), Some(1), "{}", unknown.stdout);
    assert!(
        unknown
            .stderr
            .contains("cannot tell whether Claim/2026/4711 is parked")
            && unknown.stderr.contains("--force"),
        "{}",
        unknown.stderr
    );
}
