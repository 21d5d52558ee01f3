//! The production [`JetStreamPort`]: the async-nats client itself. Publishes go into the client's
//! one queue to its connection (so wire order is call order), bounded by the caller's timeout;
//! reads of the stream are JetStream API requests through a context with that timeout, and the
//! bulk read is an ephemeral push consumer ([`ClientReader`]).
//!
//! async-nats has an error type per call, each with kinds of its own; they become a [`NatsError`]
//! here, once, by [`kind_of`]: a JetStream refusal by its code (10059, no such stream: not found),
//! a request by whether it timed out or found no responders.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, ErrorCode};
use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::error::{NatsError, NatsErrorKind};
use super::port::{Answers, HeaderRead, JetStreamPort, StreamTail};
use super::readback::ClientReader;

/// A JetStream context on `client` whose requests wait at most `timeout`.
fn context(client: &async_nats::Client, timeout: Duration) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(timeout)
        .build(client.clone())
}

/// An async-nats error as a [`NatsError`].
pub(super) fn mapped<E>(e: E) -> NatsError
where
    E: std::error::Error + Send + Sync + 'static,
{
    NatsError::new(kind_of(&e), e)
}

/// An async-nats error met while doing `what`, as a [`NatsError`] whose cause says both.
pub(super) fn mapped_while<E>(what: String, e: E) -> NatsError
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

impl JetStreamPort for async_nats::Client {
    fn new_inbox(&self) -> String {
        async_nats::Client::new_inbox(self)
    }

    fn subscribe(&self, subject: String) -> BoxFuture<'_, Result<Answers, NatsError>> {
        Box::pin(async move {
            async_nats::Client::subscribe(self, subject)
                .await
                .map(|s| Box::pin(s) as Answers)
                .map_err(mapped)
        })
    }

    fn publish(
        &self,
        subject: String,
        reply: Option<String>,
        headers: HeaderMap,
        payload: Bytes,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<(), NatsError>> {
        Box::pin(async move {
            let sent = match reply {
                Some(reply) => {
                    let send =
                        self.publish_with_reply_and_headers(subject, reply, headers, payload);
                    tokio::time::timeout(timeout, send).await
                }
                None => {
                    let send = self.publish_with_headers(subject, headers, payload);
                    tokio::time::timeout(timeout, send).await
                }
            };
            match sent {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(mapped(e)),
                Err(_) => Err(NatsError::new(
                    NatsErrorKind::TimedOut,
                    format!(
                        "the client's queue to the connection took no publish within {timeout:?}"
                    ),
                )),
            }
        })
    }

    fn max_payload(&self) -> usize {
        async_nats::Client::max_payload(self)
    }

    fn api_request(
        &self,
        subject: String,
        body: serde_json::Value,
    ) -> BoxFuture<'_, Result<serde_json::Value, NatsError>> {
        Box::pin(async move {
            // The default context (its request timeout), as the marker was always read and written.
            async_nats::jetstream::new(self.clone())
                .request(subject, &body)
                .await
                .map_err(mapped)
        })
    }

    fn last_sequence<'a>(
        &'a self,
        stream: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<u64, NatsError>> {
        Box::pin(async move {
            // `STREAM.INFO`.
            let s = context(self, timeout)
                .get_stream(stream)
                .await
                .map_err(mapped)?;
            Ok(s.cached_info().state.last_sequence)
        })
    }

    fn tail<'a>(
        &'a self,
        stream: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<StreamTail, NatsError>> {
        Box::pin(async move {
            let mut s = context(self, timeout)
                .get_stream(stream)
                .await
                .map_err(mapped)?;
            let info = s.info().await.map_err(mapped)?;
            let last_sequence = info.state.last_sequence;
            // -1 (or 0, never set) means no limit of the stream's own.
            let max_msg_size = usize::try_from(info.config.max_message_size)
                .ok()
                .filter(|&n| n > 0);
            if last_sequence == 0 {
                return Ok(StreamTail {
                    last_sequence,
                    max_msg_size,
                    last: None,
                });
            }
            // The last message may be gone (a limit or a purge); then nothing can be matched, and
            // the replay publishes everything after the confirmed position.
            let last = s
                .get_raw_message(last_sequence)
                .await
                .ok()
                .map(|m| m.headers);
            Ok(StreamTail {
                last_sequence,
                max_msg_size,
                last,
            })
        })
    }

    fn message_headers<'a>(
        &'a self,
        stream: &'a str,
        seq: u64,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<HeaderMap>, NatsError>> {
        Box::pin(async move {
            use async_nats::jetstream::stream::LastRawMessageErrorKind;
            // No STREAM.INFO first: one request per message.
            let s = context(self, timeout)
                .get_stream_no_info(stream)
                .await
                .map_err(mapped)?;
            match s.get_raw_message(seq).await {
                Ok(m) => Ok(Some(m.headers)),
                // The message is gone (a limit or a purge).
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
                Err(e) => Err(mapped(e)),
            }
        })
    }

    fn read_headers<'a>(
        &'a self,
        stream: &'a str,
        from: u64,
        to: u64,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Box<dyn HeaderRead>, NatsError>> {
        Box::pin(async move {
            ClientReader::start(self, stream, from, to, timeout)
                .await
                .map(|r| Box::new(r) as Box<dyn HeaderRead>)
        })
    }

    fn client(&self) -> Option<&async_nats::Client> {
        Some(self)
    }
}
