//! An outbox event, as the outbox stage makes it from a row or a logical message and the sink
//! publishes it ([`OutboxEvent`]), and its id rules: which ids are published as they are
//! ([`usable_id`]), why one is not ([`id_problems`]), and the id an event gets otherwise
//! ([`message_id`], [`standalone_id`]).
//!
//! Below the stage, the message builder and the sink alike, so that each of them reads an event
//! without the others. It knows the contract check only as far as an event carries one
//! (`schema_check`) and records its verdict.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::Lsn;
use crate::fnv::fnv1a_64;
use crate::position::Position;
use crate::schema::{PendingCheck, SchemaMetrics, Verdict};

/// The longest event id published as `Nats-Msg-Id`; a longer one makes the event invalid (its dead
/// letter gets a WAL-derived id), so one huge id cannot keep even a minimal dead letter out.
pub(crate) const MAX_ID_BYTES: usize = 1024;

/// The CloudEvents `datacontenttype` of JSON payloads (jsonb and json columns, logical messages).
pub const JSON_CONTENT_TYPE: &str = "application/json";
/// ... and of text payloads.
pub(crate) const TEXT_CONTENT_TYPE: &str = "text/plain; charset=utf-8";

/// One outbox row on its way to JetStream. Fields are `None` when the column was NULL or missing; then
/// `problem` says why the event cannot be published as is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// The event id's text form (`outbox.id_column`).
    pub id: Option<String>,
    /// The kind of entity (`outbox.aggregate_type_column`).
    pub aggregate_type: Option<String>,
    /// The entity's id (`outbox.aggregate_id_column`).
    pub aggregate_id: Option<String>,
    /// What happened (`outbox.event_type_column`).
    pub event_type: Option<String>,
    /// The message body, as stored (`outbox.payload_column`).
    pub payload: Bytes,
    /// The event's own headers as (name, value): headers column, `header_columns`, or a message's `headers`.
    pub headers: Vec<(String, String)>,
    /// The commit LSN of the transaction (from Begin.final_lsn): the `Outbox-Commit-Lsn` header.
    pub commit_lsn: Lsn,
    /// Position among the outbox inserts of its transaction (0-based).
    pub index: u32,
    /// Its place in the slot's history: the `Outbox-Position` header, what a resuming session
    /// compares with the stream's tail ([`crate::position`]).
    pub position: Position,
    /// The transaction's commit time (µs since 2000-01-01, from Begin), for commit → ack latency.
    pub commit_ts: i64,
    /// An event republished from a copy (a requeue of a parked copy or a dead letter): its own
    /// transaction's commit time, read back from the copy's `Outbox-Commit-Time`, while
    /// `commit_ts` is the request's (the relay's latency). `None` for every other event, and for a
    /// copy written before the header existed.
    pub original_commit_ts: Option<i64>,
    /// Why this event must go to the dead-letter subject; `None` for a good event.
    pub problem: Option<String>,
    /// The `Nats-Msg-Id`, computed once ([`message_id`]).
    pub msg_id: String,
    /// The payload's media type, from the payload column's type (`None` for bytea: unknown bytes).
    pub content_type: Option<&'static str>,
    /// The `$id` of the JSON Schema the payload passed (`outbox.schemas`): `ce-dataschema`.
    pub data_schema: Option<Arc<str>>,
    /// The contract check of a payload too large to check on the runtime thread, which the sink
    /// runs before it publishes the event (`schema/budget.rs`); `None` once checked, or for none.
    pub schema_check: Option<PendingCheck>,
}

impl OutboxEvent {
    /// The event at `index` of the transaction committing at `commit_lsn`, with `payload` and
    /// nothing else yet: no fields, no headers, no problem, no id (the one place all of an
    /// event's fields are written; every event starts here).
    pub(crate) fn at(
        payload: Bytes,
        commit_lsn: Lsn,
        index: u32,
        commit_ts: i64,
        content_type: Option<&'static str>,
    ) -> OutboxEvent {
        OutboxEvent {
            id: None,
            aggregate_type: None,
            aggregate_id: None,
            event_type: None,
            payload,
            headers: Vec::new(),
            commit_lsn,
            index,
            position: Position::in_transaction(commit_lsn, index),
            commit_ts,
            original_commit_ts: None,
            problem: None,
            msg_id: String::new(),
            content_type,
            data_schema: None,
            schema_check: None,
        }
    }

    /// The dead letter of JSON `content` that is no event at all: the content is its payload, its
    /// id is WAL-derived, and `problem` says why.
    pub(crate) fn dead_letter(
        content: &Bytes,
        problem: String,
        commit_lsn: Lsn,
        index: u32,
        commit_ts: i64,
    ) -> OutboxEvent {
        OutboxEvent {
            msg_id: message_id(None, commit_lsn, index, content),
            problem: Some(problem),
            ..OutboxEvent::at(
                content.clone(),
                commit_lsn,
                index,
                commit_ts,
                Some(JSON_CONTENT_TYPE),
            )
        }
    }

    /// When the event's own transaction committed (µs since 2000-01-01): `ce-time` and a copy's
    /// `Outbox-Commit-Time`. A requeued event keeps its own, not the request's.
    pub(crate) fn own_commit_ts(&self) -> i64 {
        self.original_commit_ts.unwrap_or(self.commit_ts)
    }

    /// This event as one outside any transaction, from the logical message `content` whose record
    /// ends at `lsn`: its id made of that LSN ([`standalone_id`]) and its position of its own.
    pub(crate) fn standalone(mut self, lsn: Lsn, content: &[u8]) -> OutboxEvent {
        // A WAL-derived id: should the application emit the event again, properly, its own id
        // must not be dropped as a duplicate of this dead letter.
        self.msg_id = standalone_id(lsn, content);
        // Not (lsn, 0): the next record may be a COMMIT that starts at `lsn`, and its
        // transaction's events would share the position.
        self.position = Position::standalone(lsn);
        self
    }

    /// Records a contract check's verdict: the schema's `$id`, or the failure as the event's
    /// problem (counted by its event type in `metrics`).
    pub(crate) fn record(&mut self, verdict: Verdict, metrics: &SchemaMetrics) {
        match verdict {
            Verdict::Pass(id) => self.data_schema = id,
            Verdict::NoSchema => {}
            Verdict::Fail(why) => {
                if let Some(event_type) = &self.event_type {
                    metrics.failed(event_type);
                }
                self.problem = Some(why);
            }
        }
    }

    /// Runs the contract check the stage left for later ([`OutboxEvent::schema_check`]), if any,
    /// within its budget, and records its verdict.
    pub(crate) async fn check_schema(&mut self) {
        self.check_schema_within(crate::schema::BUDGET).await;
    }

    /// [`OutboxEvent::check_schema`] with another budget (the tests' short one).
    pub(crate) async fn check_schema_within(&mut self, budget: Duration) {
        let Some(check) = self.schema_check.take() else {
            return;
        };
        let Some(event_type) = self.event_type.clone() else {
            return;
        };
        if self.problem.is_some() {
            return;
        }
        let metrics = Arc::clone(&check.metrics);
        let verdict = check
            .verdict(&event_type, self.payload.clone(), budget)
            .await;
        self.record(verdict, &metrics);
    }
}

/// Whether `id` can be an event's `Nats-Msg-Id` as it is: not empty, no line break (a header
/// cannot hold one), at most [`MAX_ID_BYTES`]. The one rule: [`id_problems`] words it for a dead
/// letter, and [`message_id`] makes up an id for an event whose id breaks it.
pub(crate) fn usable_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID_BYTES && !id.contains(['\r', '\n'])
}

/// The problems of an unusable `id` ([`usable_id`]), each naming where it came from (`what`: the
/// id column, or the message's `"id"` field).
pub(crate) fn id_problems(id: &str, what: &str, problems: &mut Vec<String>) {
    if id.is_empty() {
        problems.push(format!("{what} is empty"));
    }
    if id.contains(['\r', '\n']) {
        problems.push(format!(
            "{what} contains a line break, which cannot go into the Nats-Msg-Id header"
        ));
    }
    if id.len() > MAX_ID_BYTES {
        let len = id.len();
        problems.push(format!(
            "{what} is {len} bytes long, more than the {MAX_ID_BYTES} an id may have"
        ));
    }
}

/// The `Nats-Msg-Id` of an event: its id, or for an event without a usable id a WAL-derived one,
/// `lsn:<commit LSN>:<index>:<content hash>`, so that a republished dead letter is deduplicated too.
/// The hash of the payload (FNV-1a, 64 bits, stable across versions) keeps it apart from another
/// event at the same position in another history of the database (after a restore the same LSNs
/// are written again): JetStream would drop that one as a duplicate. Computed once by the outbox
/// stage, and carried in [`OutboxEvent::msg_id`].
pub fn message_id(id: Option<&str>, commit_lsn: Lsn, index: u32, payload: &[u8]) -> String {
    match id {
        // The outbox stage reports an unusable id as a dead letter's problem.
        Some(id) if usable_id(id) => id.to_owned(),
        _ => format!("lsn:{commit_lsn}:{index}:{:016x}", fnv1a_64(payload)),
    }
}

/// The `Nats-Msg-Id` of a non-transactional logical message's dead letter:
/// `lsn:<its LSN>:non-transactional:<content hash>` (see [`message_id`] for the hash).
pub fn standalone_id(lsn: Lsn, content: &[u8]) -> String {
    format!("lsn:{lsn}:non-transactional:{:016x}", fnv1a_64(content))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_id_gets_a_stable_wal_derived_id() {
        let payload = b"{\"claim_id\":4711}";
        let id = message_id(None, Lsn(0x1_0000_00A0), 3, payload);
        assert_eq!(id, format!("lsn:1/A0:3:{:016x}", fnv1a_64(payload)));
        assert_eq!(
            id,
            message_id(None, Lsn(0x1_0000_00A0), 3, payload),
            "stable"
        );
    }

    #[test]
    fn an_oversized_id_gets_a_wal_derived_message_id() {
        let long = "x".repeat(MAX_ID_BYTES + 1);
        assert_eq!(
            message_id(Some(&long), Lsn(0x10), 4, b"{}"),
            format!("lsn:0/10:4:{:016x}", fnv1a_64(b"{}"))
        );
        assert_ne!(
            message_id(None, Lsn(0x10), 4, b"{}"),
            message_id(None, Lsn(0x10), 4, b"{\"a\":1}"),
            "another event at the same position (another history) gets another id"
        );
        let fits = "x".repeat(MAX_ID_BYTES);
        assert_eq!(message_id(Some(&fits), Lsn(0x10), 4, b"{}"), fits);
    }
}
