//! A parked copy's marks survive a requeue, against real servers: an event over the server's
//! `max_payload` is parked without its payload (`Outbox-Payload-Size`); a requeue while the limit
//! still holds parks it again (`parked:<id>:<request>`), small enough now to be kept whole, and a
//! second requeue must still know the payload is gone: it parks it again with the reason "payload
//! dropped when parked", and never publishes the event's empty body on the key's subject.

use outbox_relay::config::{Config, OnInvalid};
use outbox_relay::parking::revive::PAYLOAD_DROPPED;

use super::{control, ids_on, insert, parking_subject, stored};
use crate::support::{InProcessRelay, NatsServer, PgServer, TEXT_ID_OUTBOX_SQL, TestDb};
use crate::support::{read_all, relay_config};

/// A text-id outbox, a NATS server whose `max_payload` is 4096 bytes, and a park-mode
/// configuration for them.
async fn small_world() -> (TestDb, NatsServer, Config) {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    let nats = NatsServer::start_with_config("max_payload: 4096");
    let mut config = relay_config(&db, &nats);
    config.outbox.on_invalid = OnInvalid::Park;
    config.validate().expect("park config is valid");
    (db, nats, config)
}

#[tokio::test]
async fn a_copy_parked_again_without_its_payload_stays_parked_at_the_second_requeue() {
    let (db, nats, config) = small_world().await;
    let client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;
    let big = format!(r#"{{"claim": 4711, "pad": "{}"}}"#, "x".repeat(10_000));
    insert(&client, "big-4711", "4711", "ClaimPaid", &big).await;
    let all = stored(&nats, &config, 1).await;
    let parking = parking_subject(&config, "4711");
    assert_eq!(ids_on(&all, &parking), ["big-4711"], "{all:#?}");
    assert!(all[0].payload.is_empty(), "{all:#?}");
    assert_eq!(all[0].header("Outbox-Payload-Size"), big.len().to_string());

    // The first requeue: the limit still holds, so the copy is parked again, now kept whole.
    control(&client, "requeue", "4711", "r-1").await;
    let all = stored(&nats, &config, 3).await;
    let again = &all[2];
    assert_eq!(
        again.header("Nats-Msg-Id"),
        "parked:big-4711:r-1",
        "{all:#?}"
    );
    assert_eq!(again.header("Outbox-Error"), PAYLOAD_DROPPED);
    assert!(again.payload.is_empty(), "{again:?}");

    // The second requeue: the copy it reads has an empty body that fits; only the mark says it is
    // not the event's.
    control(&client, "requeue", "4711", "r-2").await;
    // A later event of another key: once it is stored, the requeue before it is carried out.
    insert(&client, "a-4712", "4712", "ClaimPaid", r#"{"claim": 4712}"#).await;
    stored(&nats, &config, 6).await;
    let all = read_all(&nats.jetstream().await, &config.nats.stream).await;
    assert_eq!(
        ids_on(&all, "outbox.Claim"),
        ["a-4712"],
        "big-4711 published with an empty payload: {all:#?}"
    );
    assert_eq!(
        ids_on(&all, &parking),
        [
            "big-4711",
            "released:r-1",
            "big-4711",
            "released:r-2",
            "big-4711"
        ],
        "{all:#?}"
    );
    let last = all.iter().rfind(|m| m.subject == parking).unwrap();
    assert_eq!(last.header("Nats-Msg-Id"), "parked:big-4711:r-2");
    assert_eq!(last.header("Outbox-Error"), PAYLOAD_DROPPED);
    // What made the second requeue know: the first size, carried on by every copy parked again.
    let size = big.len().to_string();
    for m in all.iter().filter(|m| m.id() == "big-4711") {
        assert_eq!(m.headers.get("Outbox-Payload-Size"), Some(&size), "{m:?}");
    }
    relay.stop().await.expect("clean stop");
}
