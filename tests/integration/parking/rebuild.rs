//! The parked set rebuilt at a restart when the parking subjects take many pages to read: the
//! binary with a read page of 8 deliveries per consumer (the test-only
//! `OUTBOX_RELAY_TEST_READ_PAGE`), 50 keys parked and 5 of them discarded, restarted; every
//! key's next event then goes where the stream says it must (behind its poison for the 45 still
//! parked, to `outbox.Claim` for the 5 released), which it does only if every page was read,
//! in order, with the release markers applied.

use std::time::Duration;

use super::{STRICT, control, ids_on, parking_subject, run_paged, stored, world};

const KEYS: u32 = 50;
const RELEASED: u32 = 5;

#[tokio::test]
async fn a_restart_rebuilds_every_parked_key_across_many_read_pages() {
    let s = world(STRICT).await;
    let client = &s.client;
    let mut relay = run_paged(&s);
    s.wait_slot_made().await;
    s.client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'a-' || g, 'Claim', g::text, 'ClaimApproved', '{\"claim\": \"x\"}'::jsonb \
             FROM generate_series(1, $1::int) g",
            &[&(KEYS as i32)],
        )
        .await
        .expect("insert the approvals");
    stored(&s.nats, &s.config, u64::from(KEYS)).await;
    for k in 1..=RELEASED {
        control(client, "discard", &k.to_string(), &format!("d-{k}")).await;
    }
    stored(&s.nats, &s.config, u64::from(KEYS + RELEASED)).await;
    relay.signal("TERM");
    assert!(relay.wait(Duration::from_secs(30)).is_some(), "stopped");

    let mut relay = run_paged(&s);
    s.client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'p-' || g, 'Claim', g::text, 'ClaimPaid', jsonb_build_object('claim', g) \
             FROM generate_series(1, $1::int) g",
            &[&(KEYS as i32)],
        )
        .await
        .expect("insert the payments");
    let all = stored(&s.nats, &s.config, u64::from(2 * KEYS + RELEASED)).await;
    let released: Vec<String> = (1..=RELEASED).map(|k| format!("p-{k}")).collect();
    assert_eq!(
        ids_on(&all, "outbox.Claim"),
        released,
        "only the discarded keys' payments reach the subject: {}",
        relay.stderr()
    );
    for k in RELEASED + 1..=KEYS {
        let (a, p) = (format!("a-{k}"), format!("p-{k}"));
        assert_eq!(
            ids_on(&all, &parking_subject(&s.config, &k.to_string())),
            [a.as_str(), p.as_str()],
            "claim {k} still parked after the restart"
        );
    }
    assert!(relay.is_running(), "{}", relay.stderr());
    relay.signal("TERM");
    assert!(relay.wait(Duration::from_secs(30)).is_some(), "stopped");
}
