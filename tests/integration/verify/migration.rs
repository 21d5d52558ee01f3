//! docs/migrating.md's switch from a polling publisher, then `verify`: the rows the poller had sent
//! before `backfill --where "published_at IS NULL"` took over are not the relay's. The backfill
//! records where it began the stream's history, and verify leaves those rows out (counted as
//! `before_backfill`, said in `skipped`) instead of reporting each as missing every day.

use outbox_relay::backfill::{BackfillOptions, backfill};

use super::*;

/// The poller's table of docs/migrating.md.
const POLLER_TABLE: &str = "create table outbox_event (
  event_id uuid primary key,
  aggregate_type varchar(80) not null,
  aggregate_id varchar(80) not null,
  event_type varchar(120) not null,
  payload jsonb not null,
  created_at timestamp not null,
  published_at timestamp null,
  publish_attempts integer not null default 0
);
create index ix_outbox_unpublished on outbox_event(created_at) where published_at is null;";

/// `n` orders written by the application, created `age` ago, sent by the poller or not.
async fn orders(s: &Story, n: u32, age: &str, sent: bool) {
    let published = if sent { "now()" } else { "NULL" };
    s.client
        .batch_execute(&format!(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, created_at, published_at) \
             SELECT gen_random_uuid(), 'Order', g::text, 'OrderPlaced', jsonb_build_object('order', g), \
                    now() - interval '{age}', {published} \
             FROM generate_series(1, {n}) g"
        ))
        .await
        .unwrap();
}

#[tokio::test]
async fn after_the_switch_from_a_poller_the_rows_it_had_sent_are_not_missing() {
    let s = Story::of(Scenario::builder().sql(POLLER_TABLE).config(|c| {
        c.outbox.table = "public.outbox_event".into();
        c.outbox.message_prefix = String::new();
    }))
    .await;
    orders(&s, 300, "2 hours", true).await;
    orders(&s, 200, "1 hour", false).await;

    // The switch: the poller is stopped; what it had not sent is backfilled; the relay runs.
    let settings = s.config.clone().validate().unwrap();
    let opts = BackfillOptions {
        where_sql: Some("published_at IS NULL".into()),
        order_by: Some("created_at, event_id".into()),
        replace_slot: false,
    };
    let report = backfill(&settings, opts, |_| {}).await.expect("backfill");
    assert_eq!(report.stored, 200);
    let relay = s.relay().await;
    orders(&s, 50, "0 seconds", false).await;
    s.wait_messages(250).await;
    relay.stop().await.expect("relay stops cleanly");

    // The scenario's environment names the poller's table and no message prefix.
    let (code, json) = s.verify(&["--payloads"]).await;
    assert_eq!(code, 0, "{json}");
    assert_eq!(
        (json["rows"].as_u64(), json["messages"].as_u64()),
        (Some(550), Some(250)),
        "{json}"
    );
    assert_counts(&json, &[("before_backfill", 300)]);
    let skipped = json["skipped"].to_string();
    assert!(
        skipped.contains("300 rows created before the backfill")
            && skipped.contains("published_at IS NULL"),
        "{skipped}"
    );
}
