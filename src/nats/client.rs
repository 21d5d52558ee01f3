//! The production [`JetStreamPort`]: the async-nats client itself. Publishes go into the client's
//! one queue to its connection (so wire order is call order), bounded by the caller's timeout;
//! reads of the stream are JetStream API requests through a context with that timeout, and the
//! bulk read is an ephemeral push consumer ([`ClientReader`]).
//!
//! async-nats has an error type per call, each with kinds of its own; each becomes a [`NatsError`]
//! as it leaves the client (`mapped`, in `error.rs`): a JetStream refusal by its code (10059, no
//! such stream: not found), a request by whether it timed out or found no responders.

use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::error::{NatsError, NatsErrorKind, mapped};
use super::port::{Answers, HeaderRead, JetStreamPort, MessageRead, StreamTail, SubjectRead};
use super::readback::{ClientReader, Scope};

/// A JetStream context on `client` whose requests wait at most `timeout`.
fn context(client: &async_nats::Client, timeout: Duration) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(timeout)
        .build(client.clone())
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

    fn read_subjects<'a>(
        &'a self,
        stream: &'a str,
        filter: &'a str,
        read: SubjectRead,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Box<dyn MessageRead>, NatsError>> {
        Box::pin(async move {
            let (from, headers_only, scope, what) = match read {
                SubjectRead::Last => (
                    1,
                    true,
                    Scope::LastPerSubject(filter.to_owned()),
                    "outbox-relay: reading which keys are parked",
                ),
                SubjectRead::Headers(seq) => (
                    seq.max(1),
                    true,
                    Scope::Subjects(filter.to_owned()),
                    "outbox-relay: reading the headers on a parking or dead-letter subject",
                ),
                SubjectRead::From(seq) => (
                    seq.max(1),
                    false,
                    Scope::Subjects(filter.to_owned()),
                    "outbox-relay: reading a parked key's run or a dead letter",
                ),
            };
            ClientReader::start_scoped(
                self,
                stream,
                from,
                u64::MAX,
                timeout,
                headers_only,
                what,
                scope,
            )
            .await
            .map(|r| Box::new(r) as Box<dyn MessageRead>)
        })
    }

    fn client(&self) -> Option<&async_nats::Client> {
        Some(self)
    }
}
