//! JetStream's answer to a publish, read off the wire once: an ack ([`PubAck`]: the stream, the
//! sequence, whether it was a duplicate) or a [`NatsError`] of the kind the answer means (no
//! responders: no stream takes the subject; an error object: [`NatsErrorKind::Refused`] with its
//! code, and for 10071 the stream's last sequence, which nats-server gives only in the
//! description, "wrong last sequence: N"). Whether an ack can be JetStream's for the relay's stream
//! is the sink's judgement (src/sink/publish.rs), not this file's: it only reads what the answer
//! says.

use std::borrow::Cow;

use async_nats::StatusCode;
use async_nats::jetstream::ErrorCode;
use serde::Deserialize;

use super::error::{NatsError, NatsErrorKind};

/// An ack as the answer states it, unchecked. The stream name is borrowed from the answer's bytes
/// (one allocation fewer per ack) unless JSON escapes in it need an owned copy.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct PubAck<'a> {
    /// The stream the answer names, if any.
    pub(crate) stream: Option<Cow<'a, str>>,
    /// The sequence it names (0 when none).
    pub(crate) seq: u64,
    /// JetStream already held a message with the publish's `Nats-Msg-Id`.
    pub(crate) duplicate: bool,
}

#[derive(Deserialize)]
struct Answer<'a> {
    #[serde(default)]
    error: Option<Refusal>,
    #[serde(default, borrow)]
    stream: Option<Cow<'a, str>>,
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    duplicate: bool,
}

/// What an answer on a publish's reply subject says.
pub(crate) fn read(m: &async_nats::Message) -> Result<PubAck<'_>, NatsError> {
    if m.status == Some(StatusCode::NO_RESPONDERS) {
        return Err(NatsError::of(NatsErrorKind::NoResponders));
    }
    let answer: Answer =
        serde_json::from_slice(&m.payload).map_err(|e| NatsError::new(NatsErrorKind::Other, e))?;
    if let Some(error) = answer.error {
        return Err(refusal(error));
    }
    Ok(PubAck {
        stream: answer.stream,
        seq: answer.seq,
        duplicate: answer.duplicate,
    })
}

/// JetStream's error object, shown as async-nats shows it (`description (code N, error code M)`),
/// which is the text a dead letter's reason quotes.
#[derive(Debug, Deserialize, thiserror::Error)]
#[error(
    "{} (code {code}, error code {err_code})",
    description.as_deref().unwrap_or("unknown")
)]
struct Refusal {
    code: usize,
    #[serde(default)]
    err_code: u64,
    description: Option<String>,
}

/// JetStream's error answer as a [`NatsErrorKind::Refused`] (the answer is the cause): with the
/// stream's last sequence for 10071, the one refusal that names it.
fn refusal(error: Refusal) -> NatsError {
    let code = ErrorCode(error.err_code);
    let last_sequence = (code == ErrorCode::STREAM_WRONG_LAST_SEQUENCE)
        .then(|| named_sequence(error.description.as_deref()?))
        .flatten();
    NatsError::new(
        NatsErrorKind::Refused {
            code,
            last_sequence,
        },
        error,
    )
}

/// The number after the last `:` of a refusal's description ("wrong last sequence: 5").
fn named_sequence(description: &str) -> Option<u64> {
    description.rsplit(':').next()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn answer(payload: &str, status: Option<StatusCode>) -> async_nats::Message {
        async_nats::Message {
            subject: "i.1".into(),
            reply: None,
            payload: Bytes::from(payload.to_owned()),
            headers: None,
            status,
            description: None,
            length: payload.len(),
        }
    }

    #[test]
    fn an_ack_gives_stream_sequence_and_duplicate() {
        let m = answer(r#"{"stream":"OUTBOX","seq":42}"#, None);
        let a = read(&m).unwrap();
        assert_eq!(
            (a.stream.as_deref(), a.seq, a.duplicate),
            (Some("OUTBOX"), 42, false)
        );
        let m = answer(r#"{"stream":"OUTBOX","seq":7,"duplicate":true}"#, None);
        assert!(read(&m).unwrap().duplicate);
        let m = answer("{}", None);
        assert_eq!(read(&m).unwrap().stream, None);
    }

    #[test]
    fn refusals_carry_their_code_and_the_last_sequence_they_name() {
        let m = answer(
            r#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 5"},"stream":"OUTBOX","seq":0}"#,
            None,
        );
        assert_eq!(
            read(&m).unwrap_err().kind(),
            NatsErrorKind::Refused {
                code: ErrorCode::STREAM_WRONG_LAST_SEQUENCE,
                last_sequence: Some(5)
            }
        );
        let m = answer(
            r#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence"}}"#,
            None,
        );
        assert_eq!(
            read(&m).unwrap_err().kind(),
            NatsErrorKind::Refused {
                code: ErrorCode::STREAM_WRONG_LAST_SEQUENCE,
                last_sequence: None
            },
            "no number, none read"
        );
        let m = answer(
            r#"{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}}"#,
            None,
        );
        let e = read(&m).unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode(10054)));
        assert_eq!(
            e.cause_text(),
            "message size exceeds maximum allowed (code 400, error code 10054)"
        );
        let m = answer(
            r#"{"error":{"code":400,"err_code":10070,"description":"wrong last msg ID: a"}}"#,
            None,
        );
        assert_eq!(
            read(&m).unwrap_err().kind(),
            NatsErrorKind::Refused {
                code: ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID,
                last_sequence: None
            }
        );
    }

    #[test]
    fn no_responders_and_garbage_are_errors_of_their_kind() {
        let m = answer("", Some(StatusCode::NO_RESPONDERS));
        assert_eq!(read(&m).unwrap_err().kind(), NatsErrorKind::NoResponders);
        let m = answer("not json", None);
        assert_eq!(read(&m).unwrap_err().kind(), NatsErrorKind::Other);
    }
}
