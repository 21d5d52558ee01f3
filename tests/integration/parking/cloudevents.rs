//! A requeued event is the CloudEvent it would have been, against real servers: with
//! `nats.cloudevents = true`, an event parked (then `requeue` of its key) or dead-lettered (then
//! `requeue_event`) arrives on its subject with the `ce-datacontenttype` an event published
//! directly from the same column carries, and the `ce-time` of its own transaction (an event
//! committed in the same transaction and published directly says which), not the request's. The
//! parked copy and the dead letter are no CloudEvents; they keep the media type in
//! `Outbox-Content-Type` and the commit time in `Outbox-Commit-Time`, which the requeue reads back.

use outbox_relay::config::{Config, OnInvalid};

use super::{FIXED, STRICT, control, insert, stored, world};
use crate::support::{InProcessRelay, Stored};

/// The one message on `subject` whose event id is `id`.
fn one<'a>(all: &'a [Stored], subject: &str, id: &str) -> &'a Stored {
    let found: Vec<&Stored> = all
        .iter()
        .filter(|m| m.subject == subject && m.id() == id)
        .collect();
    assert_eq!(found.len(), 1, "{id} on {subject}: {all:#?}");
    found[0]
}

/// `config` with the CloudEvents binary mode on.
fn with_cloudevents(mut config: Config, on_invalid: OnInvalid) -> Config {
    config.nats.cloudevents = true;
    config.outbox.on_invalid = on_invalid;
    config.validate().expect("valid");
    config
}

#[tokio::test]
async fn a_requeued_parked_event_and_a_requeued_dead_letter_keep_their_content_type_and_time() {
    for mode in [OnInvalid::Park, OnInvalid::DeadLetter] {
        let s = world(STRICT).await;
        let config = with_cloudevents(s.config.clone(), mode);
        let (client, nats) = (&s.client, &s.nats);
        let relay = InProcessRelay::start_streaming(&config, client).await;
        // One transaction: a-4712, published directly, carries the commit time a-4711 has too.
        client.batch_execute("BEGIN").await.expect("begin");
        insert(
            client,
            "a-4711",
            "4711",
            "ClaimApproved",
            r#"{"claim": "x"}"#,
        )
        .await;
        insert(
            client,
            "a-4712",
            "4712",
            "ClaimApproved",
            r#"{"claim": 4712}"#,
        )
        .await;
        client.batch_execute("COMMIT").await.expect("commit");
        let all = stored(nats, &config, 2).await;
        let direct = one(&all, "outbox.Claim", "a-4712");
        let want = direct.header("ce-datacontenttype").to_owned();
        assert_eq!(want, "application/json", "{mode:?}");
        let committed = direct.header("ce-time").to_owned();
        assert!(committed.ends_with('Z'), "{mode:?}: {direct:?}");
        let kept = all.iter().find(|m| m.id() == "a-4711").unwrap();
        assert!(
            !kept.headers.contains_key("ce-datacontenttype"),
            "{mode:?}: a parked copy or dead letter is no CloudEvent: {kept:?}"
        );
        assert_eq!(kept.header("Outbox-Content-Type"), want, "{mode:?}");
        assert_eq!(kept.header("Outbox-Commit-Time"), committed, "{mode:?}");

        // The contract is fixed (read at the start), then the event is released.
        relay.stop().await.expect("clean stop");
        s.write_schema("ClaimApproved", FIXED);
        let relay = InProcessRelay::start_streaming(&config, client).await;
        match mode {
            OnInvalid::Park => control(client, "requeue", "4711", "r-1").await,
            _ => {
                let body = serde_json::json!({"op": "requeue_event", "event_id": "a-4711",
                    "request": "r-1"});
                client
                    .execute(
                        "SELECT pg_logical_emit_message(true, 'outbox-relay.control', $1::text)",
                        &[&body.to_string()],
                    )
                    .await
                    .expect("requeue_event");
            }
        }
        let n = if mode == OnInvalid::Park { 4 } else { 3 };
        let all = stored(nats, &config, n).await;
        let requeued = one(&all, "outbox.Claim", "a-4711");
        assert_eq!(requeued.header("ce-id"), "a-4711", "{mode:?}");
        assert_eq!(
            requeued.headers.get("ce-datacontenttype"),
            Some(&want),
            "{mode:?}: the requeued event lost its content type: {requeued:?}"
        );
        assert_eq!(
            requeued.header("ce-time"),
            committed,
            "{mode:?}: the requeued event has the request's commit time: {requeued:?}"
        );
        for mark in ["Outbox-Content-Type", "Outbox-Commit-Time"] {
            assert!(
                !requeued.headers.contains_key(mark),
                "{mode:?}: the relay's mark {mark} stays on the copy: {requeued:?}"
            );
        }
        relay.stop().await.expect("clean stop");
    }
}
