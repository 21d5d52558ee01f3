//! Captures the fuzz seed corpus from a real Postgres: `cargo run --example fuzz_corpus` rewrites
//! `fuzz/corpus/pgoutput/` and `fuzz/corpus/framing/` (commit the result).
//!
//! A private server (`outbox_relay::testkit`) gets a workload that reaches every message pgoutput sends
//! without streaming or two-phase commit: Begin, Relation, Type (an enum column), Insert, Update (plain,
//! with the old key, with the full old row, with an unchanged TOAST value), Delete, Truncate, Origin
//! (a transaction replayed under a replication origin), transactional and non-transactional logical
//! messages, Commit. The relay's own source reads it from a slot, so the bytes are what a walsender
//! sent: each XLogData payload becomes a `pgoutput` seed; each event, framed again as the CopyData the
//! server sent (`'d' | len | 'w' header | payload`, or the keepalive), becomes a `framing` seed, and so
//! does the whole sequence as one byte stream. Streamed and prepared transactions are not captured
//! (the relay does not ask for them); their hand-written frames are in `src/pgoutput/tests/mod.rs`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::{BufMut, Bytes, BytesMut};
use outbox_relay::pgoutput::{Decoder, Message};
use outbox_relay::source::{
    ConnInfo, PgOutputOptions, ReplConnection, ReplicationEvent, StreamConfig,
};
use outbox_relay::testkit::{PgServer, TestDb};

/// The last statement of the workload: a non-transactional message that says the capture is complete.
const END_PREFIX: &str = "seed_end";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let pg = PgServer::start_private();
    let db = TestDb::create(&pg).await;
    let publication = db.publication_name();
    db.psql(&format!(
        "CREATE TYPE mood AS ENUM ('ok', 'sad');
         CREATE TABLE outbox (id uuid PRIMARY KEY, aggregate_type text NOT NULL, payload jsonb,
                              m mood);
         CREATE TABLE audit (id int, note text);
         ALTER TABLE audit REPLICA IDENTITY FULL;
         CREATE PUBLICATION {publication} FOR TABLE outbox, audit;"
    ));
    let info = ConnInfo::parse(&format!("{}?sslmode=disable", db.url()))?;
    let slot = db.slot_name();
    let mut conn = ReplConnection::connect(&info, "fuzz_corpus").await?;
    let start = conn.create_slot(&slot, false).await?;
    conn.close().await;

    db.psql(&format!(
        "INSERT INTO outbox VALUES ('0b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6d', 'order', '{{\"a\": 1}}', 'ok');
         BEGIN;
         INSERT INTO outbox VALUES ('2b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6d', 'invoice', NULL, NULL);
         SELECT pg_logical_emit_message(true, 'outbox', '{{\"tx\": true}}');
         INSERT INTO audit VALUES (1, 'first');
         COMMIT;
         SELECT pg_logical_emit_message(false, 'outbox', '{{\"tx\": false}}');
         UPDATE outbox SET payload = '{{\"a\": 2}}' WHERE aggregate_type = 'order';
         UPDATE outbox SET id = '1b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6d', payload = NULL
           WHERE aggregate_type = 'order';
         UPDATE audit SET note = 'second';
         DELETE FROM audit;
         -- An out-of-line payload, then an update that leaves it unchanged ('u'). EXTERNAL (no
         -- compression) moves it out of line at ~2 kB, so the seed stays under the fuzzers' max_len.
         ALTER TABLE outbox ALTER COLUMN payload SET STORAGE EXTERNAL;
         INSERT INTO outbox VALUES ('3b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6d', 'big',
           jsonb_build_object('blob',
             (SELECT string_agg(md5(i::text), '') FROM generate_series(1, 80) i)),
           'sad');
         UPDATE outbox SET aggregate_type = 'bigger' WHERE aggregate_type = 'big';
         DELETE FROM outbox WHERE aggregate_type = 'invoice';
         TRUNCATE outbox, audit;
         SELECT pg_replication_origin_create('seed_origin');
         SELECT pg_replication_origin_session_setup('seed_origin');
         BEGIN;
         SELECT pg_replication_origin_xact_setup('0/1234', now());
         INSERT INTO audit VALUES (2, 'replayed');
         COMMIT;
         SELECT pg_replication_origin_session_reset();
         SELECT pg_logical_emit_message(false, '{END_PREFIX}', '');"
    ));

    let mut options = PgOutputOptions::new([publication]);
    options.messages = true;
    // A short receive timeout makes the writer ask for keepalives often: one is a framing seed.
    let config = StreamConfig {
        receive_timeout: Duration::from_secs(3),
        ..StreamConfig::default()
    };
    let mut stream = ReplConnection::connect(&info, "fuzz_corpus")
        .await?
        .start_replication(&slot, start, &options, config)
        .await
        .map_err(|(e, _)| e)?;
    let mut decoder = Decoder::new();
    let mut seen_end = false;
    let mut seen_keepalive = false;
    let mut events = Vec::new();
    while !(seen_end && seen_keepalive) {
        let event = tokio::time::timeout(Duration::from_secs(20), stream.recv())
            .await
            .context("no replication event within 20 s")?
            .context("replication stream ended")??;
        match &event {
            ReplicationEvent::XLogData {
                wal_start, data, ..
            } => {
                let msg = decoder.decode(data.clone(), *wal_start)?;
                if let Message::Commit { end_lsn, .. } = &msg {
                    stream.confirm(*end_lsn);
                }
                if let Message::Message { prefix, lsn, .. } = &msg
                    && prefix == END_PREFIX
                {
                    stream.confirm(*lsn);
                    seen_end = true;
                }
                events.push((event, Some(name(&msg))));
            }
            ReplicationEvent::Keepalive { .. } => {
                // One is enough; the rest would be identical seeds but for the clock.
                if !seen_keepalive {
                    events.push((event, None));
                }
                seen_keepalive = true;
            }
        }
    }
    stream.stop(Duration::from_secs(5)).await?;
    write_corpus(&root, &events)
}

/// `Insert { .. }` → `insert`: the variant name, for file names.
fn name(msg: &Message) -> String {
    format!("{msg:?}")
        .chars()
        .take_while(char::is_ascii_alphanumeric)
        .collect::<String>()
        .to_ascii_lowercase()
}

/// The CopyData message the server sent for `event`.
fn frame(event: &ReplicationEvent) -> Bytes {
    let mut body = BytesMut::new();
    match event {
        ReplicationEvent::XLogData {
            wal_start,
            wal_end,
            send_time,
            data,
        } => {
            body.put_u8(b'w');
            body.put_u64(wal_start.0);
            body.put_u64(wal_end.0);
            body.put_i64(*send_time);
            body.put_slice(data);
        }
        ReplicationEvent::Keepalive {
            wal_end,
            send_time,
            reply_requested,
        } => {
            body.put_u8(b'k');
            body.put_u64(wal_end.0);
            body.put_i64(*send_time);
            body.put_u8(u8::from(*reply_requested));
        }
    }
    let mut out = BytesMut::with_capacity(body.len() + 5);
    out.put_u8(b'd');
    out.put_u32(u32::try_from(body.len() + 4).expect("a seed under 4 GiB"));
    out.put_slice(&body);
    out.freeze()
}

fn write_corpus(root: &Path, events: &[(ReplicationEvent, Option<String>)]) -> anyhow::Result<()> {
    let pgoutput = root.join("pgoutput");
    let framing = root.join("framing");
    for dir in [&pgoutput, &framing] {
        // Seeds only: the fuzz runs write what they find elsewhere (scripts/fuzz.sh).
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("clear {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let mut stream = BytesMut::new();
    let mut payloads = std::collections::HashSet::new();
    for (i, (event, name)) in events.iter().enumerate() {
        let framed = frame(event);
        stream.put_slice(&framed);
        let label = name.as_deref().unwrap_or("keepalive");
        std::fs::write(framing.join(format!("{i:02}-{label}")), &framed)?;
        if let ReplicationEvent::XLogData { data, .. } = event
            && payloads.insert(data.clone())
        {
            std::fs::write(pgoutput.join(format!("{i:02}-{label}")), data)?;
        }
    }
    std::fs::write(framing.join("stream"), &stream)?;
    let kinds: std::collections::BTreeSet<_> =
        events.iter().filter_map(|(_, n)| n.clone()).collect();
    for needed in [
        "begin", "relation", "type", "insert", "update", "delete", "truncate", "origin", "message",
        "commit",
    ] {
        if !kinds.contains(needed) {
            bail!("the workload produced no {needed} message (got {kinds:?})");
        }
    }
    println!(
        "wrote {} pgoutput and {} framing seeds under {} ({})",
        payloads.len(),
        events.len() + 1,
        root.display(),
        kinds.into_iter().collect::<Vec<_>>().join(", "),
    );
    Ok(())
}
