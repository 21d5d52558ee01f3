//! JetStream publishes whose acks come back on one subscription per session.
//!
//! async-nats' `jetstream::Context::send_publish` makes every publish a request: a new inbox string,
//! a oneshot channel, an entry in the client's request map, an in-flight permit and two timers per
//! ack. Measured in `benches/drain` (`sink` against `sink core`), that is about 2 µs of CPU per
//! event, a third of the relay's. Here each session subscribes once to `<inbox>.*` and publishes
//! with the reply subject `<inbox>.<token>` (a core publish; JetStream answers a publish that has a
//! reply subject with its ack there), and the ack task takes the answers off the one subscription in
//! order. The sink's own window already bounds what is in flight, so no further permit is needed, and
//! the subscription's queue (async-nats' default, 65,536 messages) holds the acks of a full window
//! (`nats.max_in_flight` is at most 65,536); an ack dropped past it would be an ack timeout, never a
//! lost event.
//!
//! Answers normally arrive in publish order; one that arrives before the answer awaited (after a
//! resend, which takes a new token) is kept until its turn. A no-responders status (no stream takes
//! the subject) and JetStream's error answers become the same [`PublishError`] kinds async-nats
//! uses, so the sink's decisions about them stay in one form.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, ErrorCode};
use async_nats::{HeaderMap, StatusCode, Subscriber};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use serde::Deserialize;

/// Sends publishes with reply subjects on the session's inbox; cheap to clone (the sink and its
/// ack task each hold one).
#[derive(Clone)]
pub(super) struct Publisher {
    client: async_nats::Client,
    /// `<inbox>.`: a token is appended per publish.
    reply_prefix: Arc<str>,
    next: Arc<AtomicU64>,
    /// How long handing a publish to the client may wait (its queue to the connection is bounded).
    send_timeout: Duration,
}

/// The acks of what a [`Publisher`] sent, by token.
pub(super) struct Replies {
    sub: Subscriber,
    /// Answers that arrived before the one awaited.
    early: HashMap<u64, async_nats::Message>,
}

/// A stored (or duplicate) message, as JetStream acknowledged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ack {
    /// The stream sequence it was stored at (for a duplicate: the original's).
    pub sequence: u64,
    /// JetStream already held a message with its `Nats-Msg-Id`.
    pub duplicate: bool,
}

impl Publisher {
    /// Subscribes to a new inbox on `client`.
    pub async fn start(
        client: async_nats::Client,
        send_timeout: Duration,
    ) -> Result<(Publisher, Replies), async_nats::SubscribeError> {
        let inbox = client.new_inbox();
        let sub = client.subscribe(format!("{inbox}.*")).await?;
        Ok((
            Publisher {
                client,
                reply_prefix: format!("{inbox}.").into(),
                next: Arc::new(AtomicU64::new(0)),
                send_timeout,
            },
            Replies {
                sub,
                early: HashMap::new(),
            },
        ))
    }

    /// Queues a publish whose ack will come to [`Replies::ack`] under the returned token. The
    /// client refuses a message over the server's `max_payload` before sending it
    /// ([`PublishErrorKind::MaxPayloadExceeded`]).
    pub async fn send(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<u64, PublishError> {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let mut reply = String::with_capacity(self.reply_prefix.len() + 20);
        reply.push_str(&self.reply_prefix);
        reply.push_str(itoa::Buffer::new().format(token));
        let send = self
            .client
            .publish_with_reply_and_headers(subject, reply, headers, payload);
        match tokio::time::timeout(self.send_timeout, send).await {
            Ok(Ok(())) => Ok(token),
            Ok(Err(e)) if e.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded => {
                Err(PublishError::with_source(
                    PublishErrorKind::MaxPayloadExceeded,
                    e,
                ))
            }
            Ok(Err(e)) => Err(PublishError::with_source(PublishErrorKind::Other, e)),
            Err(_) => Err(PublishError::new(PublishErrorKind::TimedOut)),
        }
    }
}

impl Replies {
    /// The ack of publish `token`, or `None` if none arrives within `timeout`.
    pub async fn ack(
        &mut self,
        token: u64,
        timeout: Duration,
    ) -> Option<Result<Ack, PublishError>> {
        if let Some(m) = self.early.remove(&token) {
            return Some(parse(&m));
        }
        // Set at the first wait: most answers are already queued, and taking them needs neither a
        // timer nor a clock read.
        let mut deadline = None;
        loop {
            let next = match self.sub.next().now_or_never() {
                Some(m) => m,
                None => {
                    let at = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + timeout);
                    tokio::time::timeout_at(at, self.sub.next()).await.ok()?
                }
            };
            let Some(m) = next else {
                return Some(Err(PublishError::new(PublishErrorKind::BrokenPipe)));
            };
            match token_of(&m.subject) {
                Some(t) if t == token => return Some(parse(&m)),
                Some(t) => {
                    self.early.insert(t, m);
                }
                // Not an answer to a publish of ours (nothing else is sent to the inbox).
                None => {}
            }
        }
    }
}

/// The token at the end of a reply subject.
fn token_of(subject: &str) -> Option<u64> {
    subject.rsplit_once('.')?.1.parse().ok()
}

/// JetStream's answer to a publish: an ack or an error.
#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    error: Option<jetstream::Error>,
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    duplicate: bool,
}

/// An answer as an [`Ack`] or the [`PublishError`] async-nats would give for it.
fn parse(m: &async_nats::Message) -> Result<Ack, PublishError> {
    if m.status == Some(StatusCode::NO_RESPONDERS) {
        return Err(PublishError::new(PublishErrorKind::StreamNotFound));
    }
    let answer: Answer = serde_json::from_slice(&m.payload)
        .map_err(|e| PublishError::with_source(PublishErrorKind::Other, e))?;
    match answer.error {
        Some(error) => Err(match error.error_code() {
            ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID => {
                PublishError::with_source(PublishErrorKind::WrongLastMessageId, error)
            }
            ErrorCode::STREAM_WRONG_LAST_SEQUENCE => {
                PublishError::with_source(PublishErrorKind::WrongLastSequence, error)
            }
            _ => PublishError::with_source(PublishErrorKind::Other, error),
        }),
        None => Ok(Ack {
            sequence: answer.seq,
            duplicate: answer.duplicate,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(subject: &str, payload: &str, status: Option<StatusCode>) -> async_nats::Message {
        async_nats::Message {
            subject: subject.into(),
            reply: None,
            payload: Bytes::from(payload.to_owned()),
            headers: None,
            status,
            description: None,
            length: payload.len(),
        }
    }

    #[test]
    fn token_is_the_last_subject_token() {
        assert_eq!(token_of("_INBOX.abc.17"), Some(17));
        assert_eq!(token_of("_INBOX.abc.x"), None);
        assert_eq!(token_of("nodot"), None);
    }

    #[test]
    fn an_ack_gives_sequence_and_duplicate() {
        let m = answer("i.1", r#"{"stream":"OUTBOX","seq":42}"#, None);
        assert_eq!(
            parse(&m).unwrap(),
            Ack {
                sequence: 42,
                duplicate: false
            }
        );
        let m = answer(
            "i.1",
            r#"{"stream":"OUTBOX","seq":7,"duplicate":true}"#,
            None,
        );
        assert!(parse(&m).unwrap().duplicate);
    }

    #[test]
    fn errors_keep_async_nats_kinds_and_codes() {
        let m = answer(
            "i.1",
            r#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 5"},"stream":"OUTBOX","seq":0}"#,
            None,
        );
        assert_eq!(
            parse(&m).unwrap_err().kind(),
            PublishErrorKind::WrongLastSequence
        );
        let m = answer(
            "i.1",
            r#"{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}}"#,
            None,
        );
        let e = parse(&m).unwrap_err();
        assert_eq!(e.kind(), PublishErrorKind::Other);
        let code = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .map(|j| j.error_code().0);
        assert_eq!(code, Some(10054));
        let m = answer("i.1", "", Some(StatusCode::NO_RESPONDERS));
        assert_eq!(
            parse(&m).unwrap_err().kind(),
            PublishErrorKind::StreamNotFound
        );
        let m = answer("i.1", "not json", None);
        assert_eq!(parse(&m).unwrap_err().kind(), PublishErrorKind::Other);
    }
}
