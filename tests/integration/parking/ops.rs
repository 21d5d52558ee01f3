//! What the operator tools say of a parked key, against real servers: `status` calls it a
//! problem (unhealthy: exit 1) naming `outbox-relay parked` and `outbox-relay requeue --key`, with
//! the count in `--json`, and `verify` counts its rows `parked` (exit 1), until a requeue (the
//! rows delivered) or a discard (the rows `discarded`, exit 0) releases it.

use outbox_relay::config::Settings;
use serde_json::Value;

use super::{FIXED, STRICT, approve, control, insert, parking_subject, stored, world};
use crate::support::{InProcessRelay, Scenario, wait_for};

/// claim 4711 approved with a claim that breaks the schema (parked), then paid (parked behind it);
/// claim 4712 approved properly (flows). The relay is left running.
async fn park_4711(s: &Scenario) -> InProcessRelay {
    let client = &s.client;
    let relay = s.relay().await;
    approve(client, "4711", r#"{"claim": "x"}"#).await;
    insert(client, "p-4711", "4711", "ClaimPaid", r#"{"claim": 4711}"#).await;
    approve(client, "4712", r#"{"claim": 4712}"#).await;
    let all = stored(&s.nats, &s.config, 3).await;
    let parking = parking_subject(&s.config, "4711");
    assert_eq!(
        all.iter().filter(|m| m.subject == parking).count(),
        2,
        "{all:#?}"
    );
    relay
}

/// `status` in-process (what `outbox-relay status` prints and exits with, from `healthy`).
async fn status(settings: &Settings) -> (outbox_relay::status::Status, Value) {
    let s = outbox_relay::status::status(settings, i64::MAX).await;
    let v = serde_json::to_value(&s).expect("status serializes");
    (s, v)
}

/// `verify` in-process: its exit code and `--json` object.
async fn verify(settings: &Settings) -> (u8, Value) {
    let opts = outbox_relay::verify::VerifyOptions::default();
    let r = outbox_relay::verify::verify(settings, &opts, |_| {})
        .await
        .expect("verify checks");
    (r.exit_code(), r.to_json())
}

/// Every class of `verify` that is not 0.
fn nonzero(v: &Value) -> Vec<(String, u64)> {
    outbox_relay::verify::Class::ALL
        .iter()
        .map(|c| (c.key().to_owned(), v[c.key()].as_u64().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

fn parked_problems(s: &outbox_relay::status::Status) -> Vec<&String> {
    s.problems()
        .iter()
        .filter(|p| p.contains("parked key"))
        .collect()
}

#[tokio::test]
async fn status_and_verify_report_a_parked_key_until_it_is_requeued_or_discarded() {
    for release in ["requeue", "discard"] {
        let w = world(STRICT).await;
        let settings = w.config.validate().expect("valid");
        let relay = park_4711(&w).await;

        let (s, v) = status(&settings).await;
        let parked = parked_problems(&s);
        assert!(!s.healthy, "{:?}", s.problems());
        assert_eq!(parked.len(), 1, "{:?}", s.problems());
        for part in [
            "1 parked key (2 events)",
            "Claim/4711: 2 events parked",
            "behind a-4711",
            "outbox-relay parked",
            "outbox-relay requeue --key TYPE/ID",
        ] {
            assert!(parked[0].contains(part), "{part:?} not in {}", parked[0]);
        }
        let p = &v["stream"]["parked"];
        assert_eq!(p["keys"], 1, "{v}");
        assert_eq!(p["events"], 2, "{v}");
        assert_eq!(p["first"][0]["poison"], "a-4711", "{v}");
        assert!(p["oldest_age_secs"].is_u64(), "{v}");
        assert!(
            s.render_text().contains("parked keys 1 (2 events)"),
            "{}",
            s.render_text()
        );

        let (code, v) = verify(&settings).await;
        assert_eq!(code, 1, "parked is a difference: {v}");
        assert_eq!(nonzero(&v), [("parked".to_owned(), 2)], "{v}");
        let example = v["examples"]["parked"][0].to_string();
        assert!(
            example.contains("\"a-4711\"") && example.contains("behind a-4711"),
            "{example}"
        );
        assert!(
            v["recoveries"]["parked"].as_str().is_some_and(
                |r| r.contains("requeue --key") && r.ends_with("docs/recovery.md#parked")
            ),
            "{v}"
        );

        // Released: the marker is on the subject after the run, and status no longer calls the
        // key parked. A requeue validates again: the schema is fixed first (read at the start).
        let relay = if release == "requeue" {
            relay.stop().await.expect("clean stop");
            w.write_schema("ClaimApproved", FIXED);
            w.relay().await
        } else {
            relay
        };
        control(&w.client, release, "4711", &format!("r-{release}")).await;
        let parking = parking_subject(&w.config, "4711");
        wait_for(&format!("the {release} marker"), super::LIMIT, || async {
            w.read_all()
                .await
                .iter()
                .any(|m| m.subject == parking && m.headers.contains_key("Outbox-Parking"))
        })
        .await;
        let (s, v) = status(&settings).await;
        assert!(
            parked_problems(&s).is_empty(),
            "{release}: {:?}",
            s.problems()
        );
        assert_eq!(v["stream"]["parked"]["keys"], 0, "{release}: {v}");
        if release == "requeue" {
            stored(&w.nats, &w.config, 6).await;
        }
        let (code, v) = verify(&settings).await;
        let want: Vec<(String, u64)> = match release {
            // The run on its subject with its ids: delivered.
            "requeue" => vec![],
            _ => vec![("discarded".to_owned(), 2)],
        };
        assert_eq!((code, nonzero(&v)), (0, want), "{release}: {v}");
        relay.stop().await.expect("clean stop");
    }
}

/// Before Postgres 17, `status` watched a slot no relay holds only when nothing else was wrong, so
/// with a key parked a relay that had stopped was named by no problem: the parked key's advice
/// (requeue) was all an operator read, and no relay ran to carry a requeue out. From 17 on the
/// slot's `inactive_since` says how long (a warning within the grace period).
#[tokio::test]
async fn with_a_key_parked_a_stopped_relay_is_named_among_the_problems() {
    let w = world(STRICT).await;
    let settings = w.config.validate().expect("valid");
    park_4711(&w).await.stop().await.expect("clean stop");
    let slot = &settings.config().postgres.slot;
    wait_for("the slot released", super::LIMIT, || async {
        let active: bool = w
            .client
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[slot],
            )
            .await
            .expect("slot row")
            .get(0);
        !active
    })
    .await;
    let version: String = w
        .client
        .query_one("SHOW server_version_num", &[])
        .await
        .expect("version")
        .get(0);
    let (s, v) = status(&settings).await;
    assert_eq!(parked_problems(&s).len(), 1, "{:?}", s.problems());
    assert_eq!(v["relay"]["state"], "not_running", "{v:#}");
    let named = s.problems().iter().any(|p| {
        p.starts_with(&format!("no relay holds slot {slot} ")) && p.contains("start `outbox-relay")
    });
    if version.parse::<u32>().is_ok_and(|n| n < 170000) {
        assert!(named, "{:?}", s.problems());
    }
}
