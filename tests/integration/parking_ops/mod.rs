//! The operator's side of parking a key (docs/recovery.md, "A parked key"): sql/09_requeue.sql's
//! release functions (`sql.rs`), the `requeue` command that calls them (`requeue.rs`) and the
//! `parked` command that lists what is parked (`parked.rs`), each against real servers. Here: a
//! slot of the test's own that watches the control messages the functions write.

mod parked;
mod requeue;
mod sql;

use bytes::Bytes;
use outbox_relay::Lsn;
use outbox_relay::pgoutput::{Decoder, Message};
use serde_json::Value;
use tokio_postgres::Client;

use crate::support::TestDb;

/// One logical message as a pgoutput slot hands it over, its content parsed as JSON.
#[derive(Debug)]
struct Emitted {
    transactional: bool,
    lsn: Lsn,
    prefix: String,
    content: Value,
}

/// A pgoutput slot of the test's own on `db` (with an empty publication: messages need no table),
/// beside the relay's, that keeps every control message for the test to read: its slot and
/// publication.
async fn watch_messages(client: &Client, db: &TestDb) -> (String, String) {
    let (slot, publication) = (
        format!("{}_watch", db.slot_name()),
        format!("{}_watch", db.publication_name()),
    );
    client
        .batch_execute(&format!("CREATE PUBLICATION {publication}"))
        .await
        .expect("create an empty publication");
    client
        .query_one(
            "SELECT lsn FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .expect("create the watching slot");
    (slot, publication)
}

/// Every logical message the watching slot would hand over now, decoded by the relay's decoder.
async fn emitted(client: &Client, (slot, publication): &(String, String)) -> Vec<Emitted> {
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2, 'messages', 'true')",
            &[slot, publication],
        )
        .await
        .expect("peek the watching slot");
    let mut decoder = Decoder::new();
    rows.iter()
        .filter_map(|r| {
            let data: Vec<u8> = r.get(0);
            match decoder.decode(Bytes::from(data), Lsn(0)).expect("decodes") {
                Message::Message {
                    transactional,
                    lsn,
                    prefix,
                    content,
                    ..
                } => Some(Emitted {
                    transactional,
                    lsn,
                    prefix,
                    // Not JSON: kept as its text, which no JSON a test expects equals.
                    content: serde_json::from_slice(&content).unwrap_or_else(|_| {
                        Value::String(String::from_utf8_lossy(&content).into_owned())
                    }),
                }),
                _ => None,
            }
        })
        .collect()
}
