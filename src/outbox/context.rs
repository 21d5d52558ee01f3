//! Trace context messages (`outbox.context_prefix`): a transactional logical message whose content is
//! a JSON object of header names and string values, e.g. `{"traceparent": "00-…-01"}`, written by
//! `sql/08_outbox_context.sql`'s `outbox_context(…)`. Its headers go onto every event of its
//! transaction that follows it; an event's own header of the same name wins, and a later context
//! message replaces an earlier one. This is how an application that cannot add a `traceparent` to
//! each row (or each `outbox_message`) gets its trace into the relay's spans (docs/tracing.md).
//!
//! Content that is not such an object is the application's mistake, and the relay says so where it
//! can be seen: the message becomes a dead letter with the reason (its events keep flowing, without
//! that context).

use bytes::Bytes;

use super::headers::HeaderProblem;
use super::{OutboxStage, StageError, Step};
use crate::Lsn;
use crate::event::OutboxEvent;

impl OutboxStage {
    /// A trace context message: the transaction's context from here on, or, when its content is
    /// not an object of strings or it belongs to no transaction, a dead letter saying why (the
    /// transaction's events then carry no context).
    pub(super) fn context_message(
        &mut self,
        transactional: bool,
        lsn: Lsn,
        prefix: &str,
        content: Bytes,
    ) -> Result<Step, StageError> {
        let why = |problem: String| format!("trace context message (prefix {prefix:?}): {problem}");
        if !transactional {
            let problem = why(format!(
                "non-transactional at {lsn}: it belongs to no transaction, so it applies to no event; emit it \
                 with pg_logical_emit_message(true, ...) (or sql/08_outbox_context.sql's outbox_context)"
            ));
            let event = OutboxEvent::dead_letter(&content, problem, lsn, 0, 0);
            return Ok(Step::Standalone {
                event: Box::new(event.standalone(lsn, &content)),
                end_lsn: lsn,
            });
        }
        if !self.in_txn {
            return Err(StageError::MessageWithoutBegin(lsn));
        }
        match parse(&content, self.cloudevents) {
            Ok(headers) => {
                self.context = headers;
                Ok(Step::Nothing)
            }
            Err(problem) => {
                self.context.clear();
                let event = OutboxEvent::dead_letter(
                    &content,
                    why(problem.to_string()),
                    self.commit_lsn,
                    self.index,
                    self.commit_ts,
                );
                Ok(self.next_event(event))
            }
        }
    }
}

/// The largest context kept: it stays for the rest of its transaction and goes onto every event
/// after it, and JetStream refuses a message whose headers pass 64 KiB anyway (P6: what is kept from
/// input is bounded in bytes).
const MAX_CONTEXT_BYTES: usize = 64 << 10;

/// The headers of a context message's content, or why it is not one.
pub(super) fn parse(
    content: &[u8],
    cloudevents: bool,
) -> Result<Vec<(String, String)>, HeaderProblem> {
    if content.len() > MAX_CONTEXT_BYTES {
        return Err(HeaderProblem::ContentTooLarge {
            bytes: content.len(),
            max: MAX_CONTEXT_BYTES,
        });
    }
    let value: serde_json::Value =
        serde_json::from_slice(content).map_err(HeaderProblem::ContentNotJson)?;
    let serde_json::Value::Object(map) = value else {
        return Err(HeaderProblem::ContentNotObject);
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        crate::header_name::check(&k, cloudevents).map_err(HeaderProblem::Name)?;
        let serde_json::Value::String(v) = v else {
            return Err(HeaderProblem::NotString(k));
        };
        if v.contains(['\r', '\n']) {
            return Err(HeaderProblem::LineBreak(k));
        }
        out.push((k, v));
    }
    Ok(out)
}

/// Adds the transaction's context to an event's own headers, except those it has already
/// (compared ignoring case, as header names are).
pub(super) fn apply(headers: &mut Vec<(String, String)>, context: &[(String, String)]) {
    for (k, v) in context {
        if !headers.iter().any(|(own, _)| own.eq_ignore_ascii_case(k)) {
            headers.push((k.clone(), v.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_of_strings_is_a_context() {
        let h = parse(br#"{"traceparent":"00-a-b-01","baggage":"k=v"}"#, false).unwrap();
        assert_eq!(
            h,
            [
                ("baggage".to_owned(), "k=v".to_owned()),
                ("traceparent".to_owned(), "00-a-b-01".to_owned())
            ]
        );
        assert_eq!(parse(b"{}", false).unwrap(), []);
    }

    #[test]
    fn anything_else_is_refused_with_a_reason() {
        for (bad, why) in [
            (&b"not json"[..], "not JSON"),
            (b"[\"traceparent\"]", "not a JSON object"),
            (b"\"00-a-b-01\"", "not a JSON object"),
            (br#"{"traceparent": 1}"#, "not a string"),
            (br#"{"traceparent": null}"#, "not a string"),
            (br#"{"traceparent": {"a": "b"}}"#, "not a string"),
            (br#"{"Nats-Msg-Id": "x"}"#, "reserved"),
            (br#"{"a b": "x"}"#, "not a valid header name"),
            (br#"{"x": "a\nb"}"#, "line break"),
        ] {
            let e = parse(bad, false).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_context_over_64_kib_is_refused_before_it_is_parsed() {
        let big = format!(r#"{{"baggage": "{}"}}"#, "k".repeat(MAX_CONTEXT_BYTES));
        let e = parse(big.as_bytes(), false).unwrap_err().to_string();
        assert!(e.contains("more than 65536"), "{e}");
        let fits = format!(r#"{{"baggage": "{}"}}"#, "k".repeat(MAX_CONTEXT_BYTES - 20));
        assert!(parse(fits.as_bytes(), false).is_ok());
    }

    #[test]
    fn an_events_own_headers_win() {
        let mut own = vec![("TraceParent".to_owned(), "own".to_owned())];
        apply(
            &mut own,
            &[
                ("traceparent".to_owned(), "ctx".to_owned()),
                ("baggage".to_owned(), "k=v".to_owned()),
            ],
        );
        assert_eq!(
            own,
            [
                ("TraceParent".to_owned(), "own".to_owned()),
                ("baggage".to_owned(), "k=v".to_owned())
            ]
        );
    }
}
