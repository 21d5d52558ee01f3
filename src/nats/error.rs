//! The one error language of the NATS seam: [`NatsError`], a kind ([`NatsErrorKind`]) and the cause,
//! in the style of async-nats' own `Error<Kind>`. Every request through the port
//! ([`JetStreamPort`](super::JetStreamPort)) fails with it: the real client maps async-nats' many
//! error types to a kind once (`client.rs`, `readback.rs`), JetStream's answers to a publish are
//! read into the same kinds (`answer.rs`), and the simulator returns kinds. So what the sink decides
//! on (a refusal's code, the stream's last sequence a refusal names, a message too large, a
//! connection gone) is a field, never a text to read.
//!
//! The message shows the kind; the cause is the `source()` (async-nats' error, JetStream's error
//! answer, or a sentence of the reader's), so `error_chain` prints each once. How an async-nats
//! error becomes one ([`mapped`]) is at the end of this file, the one place its kinds are read.

use async_nats::jetstream::{self, ErrorCode};

/// What kind of failure a [`NatsError`] is: what a caller may decide on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatsErrorKind {
    /// No answer within the time the caller allowed.
    TimedOut,
    /// Nobody listens on the subject: no stream takes it, or the server runs without JetStream.
    NoResponders,
    /// The stream (or the consumer) does not exist. A message that is gone is not an error: the
    /// port answers `None` for it.
    NotFound,
    /// The connection or the subscription is gone for good.
    Closed,
    /// The client refused a message over the server's `max_payload` before sending it.
    TooLarge,
    /// JetStream refused the request: its error code, and the stream's last sequence when the
    /// refusal names it (10071, "wrong last sequence: N").
    Refused {
        /// JetStream's error code (`err_code`, nats-server `errors.json`).
        code: ErrorCode,
        /// The stream's last sequence, as the refusal named it.
        last_sequence: Option<u64>,
    },
    /// Anything else: a failure of the client or of the connection, or an answer that does not
    /// parse.
    Other,
}

impl std::fmt::Display for NatsErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NatsErrorKind::TimedOut => f.write_str("timed out"),
            NatsErrorKind::NoResponders => f.write_str("no responders"),
            NatsErrorKind::NotFound => f.write_str("not found"),
            NatsErrorKind::Closed => f.write_str("connection closed"),
            NatsErrorKind::TooLarge => f.write_str("larger than the server's max_payload"),
            NatsErrorKind::Refused { .. } => f.write_str("refused by JetStream"),
            NatsErrorKind::Other => f.write_str("failed"),
        }
    }
}

/// A request to NATS or JetStream failed; see the module docs.
#[derive(Debug, thiserror::Error)]
#[error("{kind}")]
pub struct NatsError {
    kind: NatsErrorKind,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl NatsError {
    /// A failure of `kind` caused by `source` (an error, or a sentence saying what happened).
    pub fn new(
        kind: NatsErrorKind,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        NatsError {
            kind,
            source: Some(source.into()),
        }
    }

    /// A failure of `kind` with nothing more to say.
    pub fn of(kind: NatsErrorKind) -> Self {
        NatsError { kind, source: None }
    }

    /// Its kind.
    pub fn kind(&self) -> NatsErrorKind {
        self.kind
    }

    /// JetStream's error code, when JetStream refused.
    pub fn code(&self) -> Option<ErrorCode> {
        match self.kind {
            NatsErrorKind::Refused { code, .. } => Some(code),
            _ => None,
        }
    }

    /// What the cause says, as the server or the client put it ("" without one): JetStream's
    /// refusal as `description (code N, error code M)`, the text a dead letter's reason quotes.
    pub fn cause_text(&self) -> String {
        self.source
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default()
    }
}

/// An async-nats error as a [`NatsError`].
pub(crate) fn mapped<E>(e: E) -> NatsError
where
    E: std::error::Error + Send + Sync + 'static,
{
    NatsError::new(kind_of(&e), e)
}

/// An async-nats error met while doing `what`, as a [`NatsError`] whose cause says both.
pub(crate) fn mapped_while<E>(what: String, e: E) -> NatsError
where
    E: std::error::Error + Send + Sync + 'static,
{
    NatsError::new(kind_of(&e), format!("{what}: {e}"))
}

/// The kind of an async-nats error: the JetStream refusal or the request failure it carries
/// (found in its kind or down its chain of causes), else [`NatsErrorKind::Other`].
fn kind_of(e: &(dyn std::error::Error + 'static)) -> NatsErrorKind {
    use async_nats::jetstream::context::{GetStreamErrorKind, RequestErrorKind as JsRequest};
    use async_nats::jetstream::stream::{ConsumerErrorKind, LastRawMessageErrorKind};
    let mut cur = Some(e);
    while let Some(err) = cur {
        let refused = if let Some(e) = err.downcast_ref::<jetstream::context::GetStreamError>() {
            match e.kind() {
                GetStreamErrorKind::JetStream(je) => Some(je),
                _ => None,
            }
        } else if let Some(e) = err.downcast_ref::<jetstream::stream::LastRawMessageError>() {
            match e.kind() {
                LastRawMessageErrorKind::JetStream(je) => Some(je),
                LastRawMessageErrorKind::NoMessageFound => return NatsErrorKind::NotFound,
                _ => None,
            }
        } else if let Some(e) = err.downcast_ref::<jetstream::stream::ConsumerError>() {
            match e.kind() {
                ConsumerErrorKind::JetStream(je) => Some(je),
                ConsumerErrorKind::TimedOut => return NatsErrorKind::TimedOut,
                _ => None,
            }
        } else {
            None
        };
        if let Some(je) = refused {
            return refused_kind(&je);
        }
        if let Some(e) = err.downcast_ref::<jetstream::context::RequestError>() {
            match e.kind() {
                JsRequest::TimedOut => return NatsErrorKind::TimedOut,
                JsRequest::NoResponders => return NatsErrorKind::NoResponders,
                _ => {}
            }
        }
        if let Some(e) = err.downcast_ref::<async_nats::RequestError>() {
            match e.kind() {
                async_nats::RequestErrorKind::TimedOut => return NatsErrorKind::TimedOut,
                async_nats::RequestErrorKind::NoResponders => return NatsErrorKind::NoResponders,
                async_nats::RequestErrorKind::MaxPayloadExceeded => {
                    return NatsErrorKind::TooLarge;
                }
                _ => {}
            }
        }
        if let Some(e) = err.downcast_ref::<async_nats::client::PublishError>() {
            match e.kind() {
                async_nats::client::PublishErrorKind::MaxPayloadExceeded => {
                    return NatsErrorKind::TooLarge;
                }
                async_nats::client::PublishErrorKind::Send => return NatsErrorKind::Closed,
                _ => {}
            }
        }
        cur = err.source();
    }
    NatsErrorKind::Other
}

/// A JetStream refusal's kind: "no such stream" is [`NatsErrorKind::NotFound`].
fn refused_kind(je: &jetstream::Error) -> NatsErrorKind {
    match je.error_code() {
        ErrorCode::STREAM_NOT_FOUND => NatsErrorKind::NotFound,
        code => NatsErrorKind::Refused {
            code,
            last_sequence: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_is_the_kind_and_the_cause_comes_once() {
        let e = NatsError::new(NatsErrorKind::TimedOut, "no message within 5s");
        assert_eq!(e.to_string(), "timed out");
        assert_eq!(
            crate::error_chain::error_chain(&e),
            "timed out: no message within 5s"
        );
        assert_eq!(e.cause_text(), "no message within 5s");
        let refused = NatsError::of(NatsErrorKind::Refused {
            code: ErrorCode::STREAM_WRONG_LAST_SEQUENCE,
            last_sequence: Some(5),
        });
        assert_eq!(refused.code(), Some(ErrorCode(10071)));
        assert_eq!(NatsError::of(NatsErrorKind::Closed).code(), None);
    }

    fn refusal(code: u64) -> jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": 404, "err_code": code, "description": "stream not found"
        }))
        .expect("a JetStream error")
    }

    #[test]
    fn async_nats_errors_become_their_kind_once() {
        use async_nats::jetstream::context::{
            GetStreamError, GetStreamErrorKind, RequestError, RequestErrorKind,
        };
        use async_nats::jetstream::stream::{LastRawMessageError, LastRawMessageErrorKind};
        let not_found = GetStreamError::new(GetStreamErrorKind::JetStream(refusal(10059)));
        assert_eq!(mapped(not_found).kind(), NatsErrorKind::NotFound);
        let refused = GetStreamError::new(GetStreamErrorKind::JetStream(refusal(10039)));
        assert_eq!(
            mapped(refused).kind(),
            NatsErrorKind::Refused {
                code: ErrorCode(10039),
                last_sequence: None
            }
        );
        // A request's own kind is found down the chain of causes.
        let timed_out = GetStreamError::with_source(
            GetStreamErrorKind::Request,
            RequestError::new(RequestErrorKind::TimedOut),
        );
        assert_eq!(mapped(timed_out).kind(), NatsErrorKind::TimedOut);
        let nobody = RequestError::new(RequestErrorKind::NoResponders);
        assert_eq!(mapped(nobody).kind(), NatsErrorKind::NoResponders);
        let gone = LastRawMessageError::new(LastRawMessageErrorKind::NoMessageFound);
        assert_eq!(mapped(gone).kind(), NatsErrorKind::NotFound);
        let large = async_nats::client::PublishError::new(
            async_nats::client::PublishErrorKind::MaxPayloadExceeded,
        );
        assert_eq!(mapped(large).kind(), NatsErrorKind::TooLarge);
        let other = std::io::Error::other("?");
        assert_eq!(mapped(other).kind(), NatsErrorKind::Other);
    }
}
