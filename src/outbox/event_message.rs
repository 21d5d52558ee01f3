//! Event messages (`outbox.message_prefix`): a logical message whose content is a JSON object with
//! the fields of a row, as an event. A transactional one takes its place among the row events of
//! its transaction; a non-transactional one is atomic with nothing, so it becomes a dead letter of
//! its own ([`Step::Standalone`]).

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{OutboxStage, StageError, Step, headers::parse_headers};
use crate::Lsn;
use crate::event::{JSON_CONTENT_TYPE, OutboxEvent, id_problems, message_id};

impl OutboxStage {
    /// An event message with the prefix `prefix` whose record is at `lsn`.
    pub(super) fn event_message(
        &mut self,
        transactional: bool,
        lsn: Lsn,
        prefix: &str,
        content: Bytes,
    ) -> Result<Step, StageError> {
        if !transactional {
            // pgoutput sends these at once, between transactions: they belong to none.
            let mut event = self.message_event(&content, lsn, 0, 0);
            event.problem = Some(format!(
                "non-transactional logical message with prefix {prefix:?} at {lsn}: it is not atomic with \
                 any transaction, so it is not published as an event; emit it with \
                 pg_logical_emit_message(true, ...) (or sql/06_outbox_message.sql's outbox_message)"
            ));
            return Ok(Step::Standalone {
                event: Box::new(event.standalone(lsn, &content)),
                end_lsn: lsn,
            });
        }
        if !self.in_txn {
            return Err(StageError::MessageWithoutBegin(lsn));
        }
        let mut event = self.message_event(&content, self.commit_lsn, self.index, self.commit_ts);
        self.check(&mut event, false);
        Ok(self.next_event(event))
    }

    /// A logical message's content as an event. The fields are those of a row; what is missing or
    /// malformed is the event's problem, and then the whole content is its payload, so the dead letter
    /// holds everything the application wrote.
    fn message_event(
        &self,
        content: &Bytes,
        commit_lsn: Lsn,
        index: u32,
        commit_ts: i64,
    ) -> OutboxEvent {
        let mut event = OutboxEvent::at(
            content.clone(),
            commit_lsn,
            index,
            commit_ts,
            Some(JSON_CONTENT_TYPE),
        );
        let mut problems = Vec::new();
        match parse_message(content) {
            Err(e) => problems.push(e.to_string()),
            Ok(m) => self.fill(&mut event, m, content, &mut problems),
        }
        super::context::apply(&mut event.headers, &self.context);
        event.msg_id = message_id(event.id.as_deref(), commit_lsn, index, &event.payload);
        if !problems.is_empty() {
            event.problem = Some(format!("logical message: {}", problems.join("; ")));
        }
        event
    }

    /// `event`'s fields from the message `m` (of `content`); what is wrong with them goes into
    /// `problems`, and the payload is the message's `"payload"` only when nothing is.
    fn fill(
        &self,
        event: &mut OutboxEvent,
        m: MessageContent<'_>,
        content: &Bytes,
        problems: &mut Vec<String>,
    ) {
        event.id = field(m.id, "id", true, problems);
        event.aggregate_type = field(m.aggregate_type, "aggregate_type", true, problems);
        // Like the column, aggregate_id may be null (then there is no header for it).
        event.aggregate_id = field(m.aggregate_id, "aggregate_id", false, problems);
        event.event_type = field(m.event_type, "event_type", true, problems);
        match m.headers.map(RawValue::get) {
            None | Some("null") => {}
            Some(json) => match parse_headers(json, self.cloudevents) {
                Ok(h) => event.headers = h,
                Err(e) => problems.push(format!("\"headers\": {e}")),
            },
        }
        if let Some(id) = event.id.as_deref() {
            id_problems(id, "\"id\"", problems);
        }
        match m.payload {
            None => problems.push("content lacks \"payload\"".into()),
            // Borrowed from `content`, so this is a slice of the frame: the JSON text as written.
            Some(raw) if problems.is_empty() => {
                event.payload = content.slice_ref(raw.get().as_bytes())
            }
            Some(_) => {}
        }
    }
}

/// A string field of the content (`name`), or `None` with the reason in `problems` (a null is a
/// problem only for a `required` field).
fn field(
    raw: Option<&RawValue>,
    name: &str,
    required: bool,
    problems: &mut Vec<String>,
) -> Option<String> {
    let Some(raw) = raw else {
        problems.push(format!("content lacks \"{name}\""));
        return None;
    };
    match serde_json::from_str::<Option<String>>(raw.get()) {
        Ok(None) if required => {
            problems.push(format!("\"{name}\" is null"));
            None
        }
        Ok(v) => v,
        Err(_) => {
            problems.push(format!("\"{name}\" is not a string"));
            None
        }
    }
}

/// The content of an event message; every field borrowed, so nothing is copied until it is checked.
/// A field that is `null` is `Some("null")`, not `None`: "lacks" and "is null" are different reasons.
#[derive(Deserialize)]
struct MessageContent<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    aggregate_type: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    aggregate_id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    event_type: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    payload: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    headers: Option<&'a RawValue>,
}

/// A field that is there, whatever its value (`null` included); `default` makes an absent one `None`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// Why a logical message's content is no event.
#[derive(Debug, thiserror::Error)]
enum ContentProblem {
    #[error("content is not a JSON object")]
    WrongShape,
    #[error("content is not JSON")]
    NotJson,
    #[error("content is not a valid event ({0})")]
    NotEvent(serde_json::Error),
}

fn parse_message(content: &[u8]) -> Result<MessageContent<'_>, ContentProblem> {
    // serde_json would also read a struct from an array, by position; the contract is an object.
    if content.trim_ascii_start().first() != Some(&b'{') {
        return Err(if serde_json::from_slice::<&RawValue>(content).is_ok() {
            ContentProblem::WrongShape
        } else {
            ContentProblem::NotJson
        });
    }
    serde_json::from_slice(content).map_err(ContentProblem::NotEvent)
}
