//! The payment service of the demo: a JetStream consumer that pays approved claims exactly once.
//!
//! It reads `outbox.Claim` from the relay's stream with a durable pull consumer, and deduplicates by
//! `Nats-Msg-Id` with an inbox table in its own database (docs/consumer-dedup.md): the id is recorded
//! in the same transaction as the payment, and the message is acknowledged only after the commit. A
//! redelivered event finds its id already recorded and is skipped.
//!
//! `--skip-ack-once <event id>` plays a crash between commit and ack: the payment commits, the ack is
//! never sent, and JetStream redelivers the event after the consumer's ack wait.
//!
//! ```text
//! cargo run --example payment_service -- --postgres postgres://…/payments --nats nats://127.0.0.1:4222
//! ```

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use async_nats::jetstream::{self, consumer::AckPolicy, consumer::pull};
use clap::Parser;
use futures_util::StreamExt as _;
use tokio_postgres::NoTls;

#[derive(Parser, Debug)]
struct Args {
    /// The payment service's own database (the inbox table and payments live here).
    #[arg(long)]
    postgres: String,
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats: String,
    #[arg(long, default_value = "OUTBOX")]
    stream: String,
    #[arg(long, default_value = "outbox.Claim")]
    subject: String,
    /// Commit the payment for this event id but do not acknowledge it (once): a crash before the ack.
    #[arg(long)]
    skip_ack_once: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (mut db, connection) = tokio_postgres::connect(&args.postgres, NoTls)
        .await
        .context("connecting to the payments database")?;
    tokio::spawn(connection);
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS processed_events (
             event_id text PRIMARY KEY, processed_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE IF NOT EXISTS payments (
             claim_id bigint NOT NULL, amount numeric NOT NULL, event_id text NOT NULL UNIQUE);",
    )
    .await?;

    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(args.nats.as_str())
        .await?;
    let js = jetstream::new(client);
    let stream = js.get_stream(&args.stream).await.map_err(|e| anyhow!(e))?;
    let consumer = stream
        .get_or_create_consumer(
            "payment",
            pull::Config {
                durable_name: Some("payment".into()),
                filter_subject: args.subject.clone(),
                ack_policy: AckPolicy::Explicit,
                // Short, so the demo's simulated crash is redelivered quickly.
                ack_wait: Duration::from_secs(2),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| anyhow!(e))?;
    println!(
        "[payment] listening on {} (stream {})",
        args.subject, args.stream
    );

    let mut skip_ack = args.skip_ack_once.into_iter().collect::<HashSet<_>>();
    let mut messages = consumer.messages().await.map_err(|e| anyhow!(e))?;
    while let Some(message) = messages.next().await {
        let message = match message {
            Ok(m) => m,
            // The connection to NATS dropped: the durable consumer resumes where it was.
            Err(e) => {
                println!("[payment] waiting for NATS: {e}");
                continue;
            }
        };
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
        };
        let delivery = message.info().map(|i| i.delivered).unwrap_or(1);
        // An atomic batch (nats.atomic_transactions) cannot carry Nats-Msg-Id: the id is then in
        // Outbox-Event-Id.
        let Some(event_id) = header("Nats-Msg-Id").or_else(|| header("Outbox-Event-Id")) else {
            message.ack().await.map_err(|e| anyhow!(e))?;
            continue;
        };
        if header("Outbox-Event-Type").as_deref() != Some("ClaimApproved") {
            message.ack().await.map_err(|e| anyhow!(e))?;
            continue;
        }
        let payload: serde_json::Value =
            serde_json::from_slice(&message.payload).unwrap_or(serde_json::Value::Null);
        let claim_id = payload["claim_id"].as_i64().unwrap_or(0);
        let amount = payload["amount"].to_string();

        let tx = db.transaction().await?;
        let new = tx
            .execute(
                "INSERT INTO processed_events (event_id) VALUES ($1) ON CONFLICT DO NOTHING",
                &[&event_id],
            )
            .await?
            == 1;
        if new {
            tx.execute(
                "INSERT INTO payments (claim_id, amount, event_id) VALUES ($1, $2::text::numeric, $3)",
                &[&claim_id, &amount, &event_id],
            )
            .await?;
        }
        tx.commit().await?;
        if new {
            println!(
                "[payment] {event_id} (delivery {delivery}): paid claim {claim_id}, amount {amount}"
            );
        } else {
            println!(
                "[payment] {event_id} (delivery {delivery}): already processed, not paying again"
            );
        }
        if skip_ack.remove(&event_id) {
            println!(
                "[payment] {event_id}: simulating a crash before the ack (JetStream will redeliver)"
            );
            continue;
        }
        message.ack().await.map_err(|e| anyhow!(e))?;
    }
    Ok(())
}
