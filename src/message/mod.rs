//! What a NATS message for an outbox event looks like (docs/guarantees.md#messages): subject,
//! headers, payload, and
//! the dead-letter form of an event that cannot be published as it is.
//!
//! Headers: `Nats-Msg-Id` (the event id: JetStream drops a republished event inside the stream's
//! duplicate window), `Outbox-Event-Type`, `Outbox-Aggregate-Type`, `Outbox-Aggregate-Id`,
//! `Outbox-Commit-Lsn`, plus the event's own headers. A dead letter carries the same headers plus
//! `Outbox-Error` (one line) and `Outbox-Subject` (the subject it would have had), and its payload as
//! stored unless that is what made it too big (then it is empty and `Outbox-Payload-Size` says how big).
//!
//! With `nats.cloudevents`, a routed event also carries the binary content mode headers of the
//! CloudEvents NATS protocol binding (`ce-specversion`, `ce-id`, `ce-type`, `ce-source`,
//! `ce-subject`, `ce-time`, `ce-datacontenttype`), values percent-encoded as its §3.1.3.2 says
//! (<https://github.com/cloudevents/spec/blob/main/cloudevents/bindings/nats-protocol-binding.md>).
//! Dead letters never carry them: a dead letter is not the event it failed to be.
//!
//! Files by role: this one builds a message and its headers; `cloudevents.rs` adds the
//! CloudEvents attributes, `dead_letter.rs` writes the dead-letter form and its shrinking ladder.

mod cloudevents;
mod dead_letter;
pub mod parked;

use std::sync::LazyLock;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue, IntoHeaderName};
use bytes::Bytes;

use crate::event::OutboxEvent;
use crate::route::SubjectTemplate;
use crate::text::one_line;
pub use cloudevents::CloudEvents;
use cloudevents::{
    CE_DATACONTENTTYPE, CE_ID, CE_SOURCE, CE_SPECVERSION, CE_SUBJECT, CE_TIME, CE_TYPE,
    cloudevents_headers,
};
pub(crate) use cloudevents::{parse_rfc3339_micros, rfc3339_micros};
pub(crate) use dead_letter::{
    DEAD_LETTER_ID_PREFIX, Shrink, dead_letter, dead_letter_as, dead_letter_id,
};

/// The event id, by which JetStream drops a republished event inside the duplicate window.
pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
/// The event's type (the `event_type` column).
pub(crate) const EVENT_TYPE: &str = "Outbox-Event-Type";
/// The event's aggregate type (the `aggregate_type` column).
pub(crate) const AGGREGATE_TYPE: &str = "Outbox-Aggregate-Type";
/// The event's aggregate id (the `aggregate_id` column).
pub(crate) const AGGREGATE_ID: &str = "Outbox-Aggregate-Id";
/// The commit LSN of the event's transaction.
pub(crate) const COMMIT_LSN: &str = "Outbox-Commit-Lsn";
/// The message's place in the slot's history, `SYSTEM/TIMELINE/SLOT/X/Y:I`
/// ([`crate::position::stamp`]): what a resuming session compares with the stream's tail. Set by
/// the sink ([`stamp_position`]).
pub(crate) const POSITION: &str = "Outbox-Position";
/// On a dead letter: why the event could not be published, in one line.
pub(crate) const ERROR: &str = "Outbox-Error";
/// On a dead letter: the subject the event would have had.
pub(crate) const SUBJECT: &str = "Outbox-Subject";
/// On a dead letter without its payload: the payload's size in bytes.
pub(crate) const PAYLOAD_SIZE: &str = "Outbox-Payload-Size";
/// On a shrunk dead letter: the headers whose values were cut to fit.
pub(crate) const TRUNCATED_HEADERS: &str = "Outbox-Truncated-Headers";
/// On a dead letter or a parked copy: the payload's media type (from the payload column's type),
/// which a requeue restores as the event's `ce-datacontenttype`; the copy itself is no CloudEvent.
pub(crate) const CONTENT_TYPE: &str = "Outbox-Content-Type";
/// On a dead letter or a parked copy: the event's own commit time, RFC 3339 with microseconds in
/// UTC (as `ce-time` writes it), which a requeue restores as the republished event's `ce-time`.
pub(crate) const COMMIT_TIME: &str = "Outbox-Commit-Time";
/// Set by the sink when the stream is fenced (see `fence`).
pub const EXPECTED_LAST_SEQUENCE: &str = "Nats-Expected-Last-Sequence";
/// Set by the sink on a fenced stream on every message after the first of a session: the previous
/// message's `Nats-Msg-Id` (see `fence`, "chained by id").
pub const EXPECTED_LAST_MSG_ID: &str = "Nats-Expected-Last-Msg-Id";
/// The event id on messages of an atomic batch, which cannot carry `Nats-Msg-Id` (the server refuses
/// a batch message with one, or rejects the whole batch for one duplicate): consumers deduplicate
/// with it, and the fence finds the stream's last event by it.
pub(crate) const EVENT_ID: &str = "Outbox-Event-Id";

/// Which header carries the event id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IdHeader {
    /// `Nats-Msg-Id`: JetStream deduplicates by it (single publishes).
    MsgId,
    /// `Outbox-Event-Id`: atomic batches.
    EventId,
}

/// A message ready for JetStream.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The subject to publish to.
    pub(crate) subject: String,
    /// The message's headers.
    pub headers: HeaderMap,
    /// The message's body.
    pub(crate) payload: Bytes,
    /// Set for dead letters: the reason, for logs and metrics.
    pub(crate) dead_letter: Option<String>,
}

/// Builds the message for `event`: routed by `template`, or a dead letter when the event has a problem
/// or cannot be routed.
pub fn build(
    event: &OutboxEvent,
    template: &SubjectTemplate,
    dead_letter_subject: &str,
    cloudevents: Option<&CloudEvents>,
) -> Outgoing {
    build_as(
        event,
        template,
        dead_letter_subject,
        cloudevents,
        IdHeader::MsgId,
        Descriptive::On,
    )
}

/// Whether a routed event carries the descriptive headers (`nats.descriptive_headers`):
/// `Outbox-Event-Type`, `Outbox-Aggregate-Type`, `Outbox-Aggregate-Id` and `Outbox-Commit-Lsn`.
/// They cost nats-server about 1 µs per message (docs/performance.md); nothing in the relay reads
/// them back (`Outbox-Position` carries the commit LSN too). Dead letters always carry them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Descriptive {
    /// The default: all four.
    On,
    /// None of the four.
    Off,
}

/// [`build`], with the event id in the header `id` says and the descriptive headers as
/// `descriptive` says.
pub(crate) fn build_as(
    event: &OutboxEvent,
    template: &SubjectTemplate,
    dead_letter_subject: &str,
    cloudevents: Option<&CloudEvents>,
    id: IdHeader,
    descriptive: Descriptive,
) -> Outgoing {
    let routed = template.render(
        event.aggregate_type.as_deref().unwrap_or(""),
        event.event_type.as_deref().unwrap_or(""),
        event.aggregate_id.as_deref().unwrap_or(""),
    );
    match (&event.problem, routed) {
        (None, Ok(subject)) => Outgoing {
            subject,
            headers: {
                let mut h = headers(event, id, descriptive);
                if let Some(ce) = cloudevents {
                    cloudevents_headers(&mut h, event, ce);
                }
                h
            },
            payload: event.payload.clone(),
            dead_letter: None,
        },
        (Some(problem), routed) => dead_letter_as(
            event,
            dead_letter_subject,
            problem,
            routed.ok().as_deref(),
            Shrink::Keep,
            id,
        ),
        (None, Err(e)) => dead_letter_as(
            event,
            dead_letter_subject,
            &e.to_string(),
            None,
            Shrink::Keep,
            id,
        ),
    }
}

/// Adds `Outbox-Position` for `event` in `history` (its text, `SYSTEM/TIMELINE/SLOT`), through the
/// header name built once.
pub fn stamp_position(h: &mut HeaderMap, event: &OutboxEvent, history: Option<&str>) {
    h.insert(
        names().position.clone(),
        HeaderValue::from(crate::position::stamp(event.position, history)),
    );
}

/// The relay's header names, built once: a name made from a `&str` is validated and copied on
/// every insert, and these are on every message.
struct Names {
    msg_id: HeaderName,
    event_id: HeaderName,
    event_type: HeaderName,
    aggregate_type: HeaderName,
    aggregate_id: HeaderName,
    commit_lsn: HeaderName,
    position: HeaderName,
    ce_specversion: HeaderName,
    ce_id: HeaderName,
    ce_type: HeaderName,
    ce_source: HeaderName,
    ce_subject: HeaderName,
    ce_time: HeaderName,
    ce_datacontenttype: HeaderName,
}

impl Names {
    fn id(&self, id: IdHeader) -> &HeaderName {
        match id {
            IdHeader::MsgId => &self.msg_id,
            IdHeader::EventId => &self.event_id,
        }
    }
}

fn names() -> &'static Names {
    static NAMES: LazyLock<Names> = LazyLock::new(|| Names {
        msg_id: NATS_MSG_ID.into_header_name(),
        event_id: EVENT_ID.into_header_name(),
        event_type: EVENT_TYPE.into_header_name(),
        aggregate_type: AGGREGATE_TYPE.into_header_name(),
        aggregate_id: AGGREGATE_ID.into_header_name(),
        commit_lsn: COMMIT_LSN.into_header_name(),
        position: POSITION.into_header_name(),
        ce_specversion: CE_SPECVERSION.into_header_name(),
        ce_id: CE_ID.into_header_name(),
        ce_type: CE_TYPE.into_header_name(),
        ce_source: CE_SOURCE.into_header_name(),
        ce_subject: CE_SUBJECT.into_header_name(),
        ce_time: CE_TIME.into_header_name(),
        ce_datacontenttype: CE_DATACONTENTTYPE.into_header_name(),
    });
    &NAMES
}

fn headers(event: &OutboxEvent, id: IdHeader, descriptive: Descriptive) -> HeaderMap {
    let n = names();
    let mut h = HeaderMap::new();
    // Values go in as owned Strings: HeaderValue keeps them without another copy.
    h.insert(n.id(id).clone(), HeaderValue::from(event.msg_id.clone()));
    if descriptive == Descriptive::On {
        if let Some(v) = &event.event_type {
            h.insert(n.event_type.clone(), HeaderValue::from(header_value(v)));
        }
        if let Some(v) = &event.aggregate_type {
            h.insert(n.aggregate_type.clone(), HeaderValue::from(header_value(v)));
        }
        if let Some(v) = &event.aggregate_id {
            h.insert(n.aggregate_id.clone(), HeaderValue::from(header_value(v)));
        }
        h.insert(
            n.commit_lsn.clone(),
            HeaderValue::from(event.commit_lsn.text()),
        );
    }
    for (k, v) in &event.headers {
        h.insert(k.as_str(), v.as_str());
    }
    h
}

/// The media type an `Outbox-Content-Type` value names, as the relay's own constant; `None` for a
/// value the relay never writes (the event then has no content type, as a `bytea` payload).
pub(crate) fn content_type_of(value: &str) -> Option<&'static str> {
    [
        crate::event::JSON_CONTENT_TYPE,
        crate::event::TEXT_CONTENT_TYPE,
    ]
    .into_iter()
    .find(|t| *t == value)
}

/// Header values cannot hold line breaks (they would end the header block).
fn header_value(v: &str) -> String {
    if v.contains(['\r', '\n']) {
        one_line(v)
    } else {
        v.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::cloudevents::{CE_DATASCHEMA, ce_encode};
    use super::*;
    use crate::Lsn;

    fn event() -> OutboxEvent {
        OutboxEvent {
            id: Some("e-5531".into()),
            aggregate_type: Some("Claim".into()),
            aggregate_id: Some("4711".into()),
            event_type: Some("ClaimApproved".into()),
            payload: Bytes::from_static(b"{\"claim_id\":4711}"),
            headers: vec![("traceparent".into(), "00-1-2-01".into())],
            commit_lsn: Lsn(0x1_0000_00A0),
            index: 0,
            position: crate::position::Position::in_transaction(Lsn(0x1_0000_00A0), 0),
            commit_ts: 0,
            original_commit_ts: None,
            problem: None,
            msg_id: "e-5531".into(),
            content_type: Some("application/json"),
            data_schema: None,
            schema_check: None,
        }
    }

    fn template() -> SubjectTemplate {
        SubjectTemplate::parse("outbox.{aggregate_type}").unwrap()
    }

    #[test]
    fn builds_contract_headers() {
        let m = build(&event(), &template(), "dlq", None);
        assert_eq!(m.subject, "outbox.Claim");
        assert_eq!(m.dead_letter, None);
        let h = &m.headers;
        assert_eq!(h.get(NATS_MSG_ID).unwrap().as_str(), "e-5531");
        assert_eq!(h.get(EVENT_TYPE).unwrap().as_str(), "ClaimApproved");
        assert_eq!(h.get(AGGREGATE_TYPE).unwrap().as_str(), "Claim");
        assert_eq!(h.get(AGGREGATE_ID).unwrap().as_str(), "4711");
        assert_eq!(h.get(COMMIT_LSN).unwrap().as_str(), "1/A0");
        assert_eq!(h.get("traceparent").unwrap().as_str(), "00-1-2-01");
        assert_eq!(&m.payload[..], b"{\"claim_id\":4711}");
    }

    #[test]
    fn without_descriptive_headers_only_the_id_and_the_events_own_headers_stay() {
        let e = event();
        let m = build_as(
            &e,
            &template(),
            "dlq",
            None,
            IdHeader::MsgId,
            Descriptive::Off,
        );
        assert_eq!(m.subject, "outbox.Claim");
        let h = &m.headers;
        assert_eq!(h.get(NATS_MSG_ID).unwrap().as_str(), "e-5531");
        assert_eq!(h.get("traceparent").unwrap().as_str(), "00-1-2-01");
        for gone in [EVENT_TYPE, AGGREGATE_TYPE, AGGREGATE_ID, COMMIT_LSN] {
            assert!(h.get(gone).is_none(), "{gone} left out");
        }
        assert_eq!(h.len(), 2);
        // A dead letter is for a person to read: it keeps them.
        let mut bad = event();
        bad.problem = Some("payload is not JSON".into());
        let d = build_as(
            &bad,
            &template(),
            "dlq",
            None,
            IdHeader::MsgId,
            Descriptive::Off,
        );
        assert_eq!(d.subject, "dlq");
        assert_eq!(d.headers.get(EVENT_TYPE).unwrap().as_str(), "ClaimApproved");
        assert_eq!(d.headers.get(COMMIT_LSN).unwrap().as_str(), "1/A0");
    }

    #[test]
    fn unroutable_event_becomes_dead_letter_with_reason() {
        let mut e = event();
        e.aggregate_type = Some("Cl aim".into());
        let m = build(&e, &template(), "outbox_dead_letter", None);
        assert_eq!(m.subject, "outbox_dead_letter");
        let err = m.headers.get(ERROR).unwrap().as_str();
        assert!(
            err.contains("aggregate_type") && err.contains("whitespace"),
            "{err}"
        );
        assert!(m.headers.get(SUBJECT).is_none());
        // An id of its own, so the event requeued later is not its duplicate; the event's id
        // in Outbox-Event-Id.
        assert_eq!(
            m.headers.get(NATS_MSG_ID).unwrap().as_str(),
            "dead-letter:e-5531"
        );
        assert_eq!(m.headers.get(EVENT_ID).unwrap().as_str(), "e-5531");
        assert_eq!(&m.payload[..], &e.payload[..], "payload kept");
    }

    #[test]
    fn the_error_header_is_ascii_even_when_the_row_is_not() {
        let mut e = event();
        e.aggregate_type = Some(format!("Schäden {}", "ü".repeat(80)));
        let m = build(&e, &template(), "outbox_dead_letter", None);
        let err = m.headers.get(ERROR).unwrap().as_str();
        assert!(err.is_ascii(), "{err}");
        assert!(
            err.contains("Sch\\u{e4}den"),
            "the value stays readable: {err}"
        );
    }

    #[test]
    fn problem_event_keeps_the_subject_it_would_have_had() {
        let mut e = event();
        e.problem = Some("column x missing\nreally".into());
        let m = build(&e, &template(), "dlq", None);
        assert_eq!(m.subject, "dlq");
        assert_eq!(m.headers.get(SUBJECT).unwrap().as_str(), "outbox.Claim");
        assert_eq!(
            m.headers.get(ERROR).unwrap().as_str(),
            "column x missing really"
        );
    }

    #[test]
    fn oversize_dead_letter_drops_payload_and_says_its_size() {
        let e = event();
        let m = dead_letter(
            &e,
            "dlq",
            "too big",
            Some("outbox.Claim"),
            Shrink::DropPayload,
        );
        assert!(m.payload.is_empty());
        assert_eq!(
            m.headers.get(PAYLOAD_SIZE).unwrap().as_str(),
            e.payload.len().to_string()
        );
    }

    #[test]
    fn id_with_a_line_break_never_reaches_a_header() {
        let mut e = event();
        e.id = Some("e-1\r\nX-Evil: 1".into());
        e.index = 2;
        e.problem = Some("id has a line break".into());
        e.msg_id = crate::event::message_id(e.id.as_deref(), e.commit_lsn, e.index, &e.payload);
        let m = build(&e, &template(), "dlq", None);
        let id = m.headers.get(NATS_MSG_ID).unwrap().as_str();
        assert!(id.starts_with("dead-letter:lsn:1/A0:2:"), "{id}");
        let id = m.headers.get(EVENT_ID).unwrap().as_str();
        assert!(id.starts_with("lsn:1/A0:2:"), "{id}");
    }

    #[test]
    fn cloudevents_headers_follow_the_nats_binding() {
        let mut e = event();
        e.aggregate_id = Some("claim 4711/€".into());
        // 2024-02-29 13:45:06.000789 UTC in Postgres microseconds.
        e.commit_ts = 762_529_506_000_789;
        let ce = CloudEvents::new("/claims service");
        let m = build(&e, &template(), "dlq", Some(&ce));
        let h = |n: &str| m.headers.get(n).map(|v| v.as_str().to_owned());
        assert_eq!(h("ce-specversion").as_deref(), Some("1.0"));
        assert_eq!(h("ce-id").as_deref(), Some("e-5531"));
        assert_eq!(h("ce-type").as_deref(), Some("ClaimApproved"));
        assert_eq!(h("ce-source").as_deref(), Some("/claims%20service"));
        assert_eq!(h("ce-subject").as_deref(), Some("claim%204711/%E2%82%AC"));
        assert_eq!(h("ce-time").as_deref(), Some("2024-02-29T13:45:06.000789Z"));
        assert_eq!(h("ce-datacontenttype").as_deref(), Some("application/json"));
        assert_eq!(h("ce-dataschema"), None, "no schema, no dataschema");
        let mut checked = e.clone();
        checked.data_schema = Some("https://schemas.example.com/Claim Approved.json".into());
        let m2 = build(&checked, &template(), "dlq", Some(&ce));
        assert_eq!(
            m2.headers.get(CE_DATASCHEMA).map(|v| v.as_str()),
            Some("https://schemas.example.com/Claim%20Approved.json")
        );
        assert!(
            build(&checked, &template(), "dlq", None)
                .headers
                .get(CE_DATASCHEMA)
                .is_none()
        );
        assert_eq!(
            h("content-type"),
            None,
            "Content-Type marks structured mode"
        );
        // The names go on the wire in lower case.
        let names: Vec<String> = m.headers.iter().map(|(k, _)| k.to_string()).collect();
        assert!(names.iter().any(|n| n == "ce-id"), "{names:?}");
        // A dead letter is not a CloudEvent.
        let mut bad = e.clone();
        bad.problem = Some("broken".into());
        let dl = build(&bad, &template(), "dlq", Some(&ce));
        assert!(dl.headers.get("ce-id").is_none());
    }

    #[test]
    fn percent_encoding_matches_the_binding_example() {
        assert_eq!(
            ce_encode("Euro \u{20AC} \u{1F600}"),
            "Euro%20%E2%82%AC%20%F0%9F%98%80"
        );
        assert_eq!(ce_encode("a\"b%c~!"), "a%22b%25c~!");
    }

    #[test]
    fn rfc3339_from_postgres_microseconds() {
        assert_eq!(rfc3339_micros(0), "2000-01-01T00:00:00.000000Z");
        assert_eq!(rfc3339_micros(-1), "1999-12-31T23:59:59.999999Z");
        // SELECT extract(epoch FROM timestamptz '2038-01-19 03:14:08+00') - 946684800 = 1200798848
        assert_eq!(
            rfc3339_micros(1_200_798_848_000_000),
            "2038-01-19T03:14:08.000000Z"
        );
        // 1970-01-01 is 946684800 s before the Postgres epoch.
        assert_eq!(
            rfc3339_micros(-946_684_800_000_000),
            "1970-01-01T00:00:00.000000Z"
        );
        assert_eq!(
            rfc3339_micros(3_155_760_000_000_000 - 1),
            "2099-12-31T23:59:59.999999Z"
        );
    }
}
