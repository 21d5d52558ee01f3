//! The sink's one door to NATS: [`NatsPort`]. In production it is the async-nats client; in the
//! deterministic simulation (tests/simulation) it is an in-memory JetStream ([`SimJetStream`]), so
//! the real sink, fence and ack handling run against faults no real server produces on demand (an
//! ack lost, late, duplicated, reordered or forged; a foreign message at the tail).
//!
//! An enum, not a trait object: the production path stays static calls with no boxed future per
//! publish, and the simulation variant exists only with the `test-support` feature.

use std::time::Duration;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::{HeaderMap, Subscriber};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};

use super::fence::{Tail, TailError, read_tail};
use super::readback::{ClientReader, Reader};

/// Where the sink publishes. Cheap to clone.
#[derive(Clone)]
pub enum NatsPort {
    /// A real NATS connection.
    Client(async_nats::Client),
    /// The simulation's JetStream.
    #[cfg(feature = "test-support")]
    Sim(std::sync::Arc<dyn SimJetStream>),
}

impl From<async_nats::Client> for NatsPort {
    fn from(c: async_nats::Client) -> Self {
        NatsPort::Client(c)
    }
}

/// A simulated JetStream: what the sink needs of a NATS connection, synchronously (the simulator
/// delivers its answers on its own schedule).
#[cfg(feature = "test-support")]
pub trait SimJetStream: Send + Sync + 'static {
    /// A new unique inbox prefix.
    fn new_inbox(&self) -> String;
    /// Messages published to `subject` (a wildcard like `<inbox>.*`): JetStream's answers.
    fn subscribe(
        &self,
        subject: String,
    ) -> tokio::sync::mpsc::UnboundedReceiver<async_nats::Message>;
    /// A publish as the client sends it: `reply` is set for publishes that await JetStream's answer,
    /// `None` for core publishes (atomic batch members).
    fn publish(
        &self,
        subject: String,
        reply: Option<String>,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<(), SimSendError>;
    /// The server's `max_payload`.
    fn max_payload(&self) -> usize;
    /// The stream's last sequence and `max_msg_size`, or why they cannot be read.
    fn stream_state(&self, stream: &str) -> Result<(u64, Option<usize>), String>;
    /// The headers of the stream's message `seq` (`None` if it is gone).
    fn message_headers(&self, stream: &str, seq: u64) -> Result<Option<HeaderMap>, String>;
    /// The stream's messages with sequences `from..=to` that are still there, in order, at most
    /// `max` of them: the bulk read behind [`NatsPort::read_headers`] (a gone message is left out,
    /// as a consumer skips it).
    fn headers_from(
        &self,
        stream: &str,
        from: u64,
        to: u64,
        max: usize,
    ) -> Result<Vec<(u64, HeaderMap)>, String>;
}

/// Why the simulated client could not send a publish.
#[cfg(feature = "test-support")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SimSendError {
    /// Over the server's `max_payload` (the real client refuses it before sending).
    #[error("payload exceeds the server's max_payload")]
    MaxPayloadExceeded,
    /// The connection is down.
    #[error("not connected")]
    Disconnected,
}

/// The answers to a session's publishes, from its inbox subscription.
pub(super) enum Answers {
    Client(Subscriber),
    #[cfg(feature = "test-support")]
    Sim(tokio::sync::mpsc::UnboundedReceiver<async_nats::Message>),
}

impl Answers {
    /// The next answer; `None` once the subscription ended.
    pub(super) async fn next(&mut self) -> Option<async_nats::Message> {
        match self {
            Answers::Client(s) => s.next().await,
            #[cfg(feature = "test-support")]
            Answers::Sim(rx) => rx.recv().await,
        }
    }

    /// The next answer if one is already queued: `Some(None)` once the subscription ended.
    pub(super) fn ready(&mut self) -> Option<Option<async_nats::Message>> {
        self.next().now_or_never()
    }
}

impl NatsPort {
    /// A new inbox prefix for a session's answers.
    pub(super) fn new_inbox(&self) -> String {
        match self {
            NatsPort::Client(c) => c.new_inbox(),
            #[cfg(feature = "test-support")]
            NatsPort::Sim(s) => s.new_inbox(),
        }
    }

    /// Subscribes to `subject` for answers.
    pub(super) async fn subscribe(&self, subject: String) -> Result<Answers, String> {
        match self {
            NatsPort::Client(c) => c
                .subscribe(subject)
                .await
                .map(Answers::Client)
                .map_err(|e| e.to_string()),
            #[cfg(feature = "test-support")]
            NatsPort::Sim(s) => Ok(Answers::Sim(s.subscribe(subject))),
        }
    }

    /// Queues a publish with a reply subject, waiting at most `timeout` for room in the client's
    /// queue to the connection.
    pub(super) async fn publish_with_reply(
        &self,
        subject: String,
        reply: String,
        headers: HeaderMap,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<(), PublishError> {
        match self {
            NatsPort::Client(c) => {
                let send = c.publish_with_reply_and_headers(subject, reply, headers, payload);
                match tokio::time::timeout(timeout, send).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e))
                        if e.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded =>
                    {
                        Err(PublishError::with_source(
                            PublishErrorKind::MaxPayloadExceeded,
                            e,
                        ))
                    }
                    Ok(Err(e)) => Err(PublishError::with_source(PublishErrorKind::Other, e)),
                    Err(_) => Err(PublishError::new(PublishErrorKind::TimedOut)),
                }
            }
            #[cfg(feature = "test-support")]
            NatsPort::Sim(s) => s
                .publish(subject, Some(reply), headers, payload)
                .map_err(sim_error),
        }
    }

    /// Queues a core publish (no reply), waiting at most `timeout` for room in the client's queue.
    pub(super) async fn publish(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<(), PublishError> {
        match self {
            NatsPort::Client(c) => {
                let send = c.publish_with_headers(subject, headers, payload);
                match tokio::time::timeout(timeout, send).await {
                    Ok(Ok(())) => Ok(()),
                    // The same check as a publish with a reply: the sink dead-letters on it.
                    Ok(Err(e))
                        if e.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded =>
                    {
                        Err(PublishError::with_source(
                            PublishErrorKind::MaxPayloadExceeded,
                            e,
                        ))
                    }
                    Ok(Err(e)) => Err(PublishError::with_source(PublishErrorKind::Other, e)),
                    Err(_) => Err(PublishError::new(PublishErrorKind::TimedOut)),
                }
            }
            #[cfg(feature = "test-support")]
            NatsPort::Sim(s) => s
                .publish(subject, None, headers, payload)
                .map_err(sim_error),
        }
    }

    /// The server's `max_payload`.
    pub(super) fn max_payload(&self) -> usize {
        match self {
            NatsPort::Client(c) => c.max_payload(),
            #[cfg(feature = "test-support")]
            NatsPort::Sim(s) => s.max_payload(),
        }
    }

    /// The headers of the stream's message `seq`: `None` when it is gone (a limit or a purge).
    pub(super) async fn message_headers(
        &self,
        stream: &str,
        seq: u64,
        timeout: Duration,
    ) -> Result<Option<HeaderMap>, String> {
        match self {
            NatsPort::Client(c) => {
                use async_nats::jetstream::stream::LastRawMessageErrorKind;
                let js = async_nats::jetstream::ContextBuilder::new()
                    .timeout(timeout)
                    .build(c.clone());
                // No STREAM.INFO first: one request per message.
                let s = js
                    .get_stream_no_info(stream)
                    .await
                    .map_err(|e| e.to_string())?;
                match s.get_raw_message(seq).await {
                    Ok(m) => Ok(Some(m.headers)),
                    Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
                    Err(e) => Err(e.to_string()),
                }
            }
            #[cfg(feature = "test-support")]
            NatsPort::Sim(s) => s.message_headers(stream, seq),
        }
    }

    /// A read of the stream's messages `from..=to`, headers only, in bulk ([`Reader`]): every
    /// message still stored, in order.
    pub(super) async fn read_headers(
        &self,
        stream: &str,
        from: u64,
        to: u64,
        timeout: Duration,
    ) -> Result<Reader, String> {
        match self {
            NatsPort::Client(c) => ClientReader::start(c, stream, from, to, timeout)
                .await
                .map(|r| Reader::Client(Box::new(r))),
            #[cfg(feature = "test-support")]
            NatsPort::Sim(s) => Ok(Reader::Sim(super::readback::SimReader {
                js: std::sync::Arc::clone(s),
                stream: stream.to_owned(),
                next: from,
                to,
                chunk: std::collections::VecDeque::new(),
            })),
        }
    }

    /// The stream's last sequence now (`STREAM.INFO`).
    pub(super) async fn last_sequence(
        &self,
        stream: &str,
        timeout: Duration,
    ) -> Result<u64, String> {
        match self {
            NatsPort::Client(c) => {
                let js = async_nats::jetstream::ContextBuilder::new()
                    .timeout(timeout)
                    .build(c.clone());
                let s = js.get_stream(stream).await.map_err(|e| e.to_string())?;
                Ok(s.cached_info().state.last_sequence)
            }
            #[cfg(feature = "test-support")]
            NatsPort::Sim(s) => s.stream_state(stream).map(|(last, _)| last),
        }
    }

    /// The stream's tail (see [`read_tail`]).
    pub(crate) async fn tail(&self, stream: &str, timeout: Duration) -> Result<Tail, TailError> {
        match self {
            NatsPort::Client(c) => {
                let js = async_nats::jetstream::ContextBuilder::new()
                    .timeout(timeout)
                    .build(c.clone());
                read_tail(&js, stream).await
            }
            #[cfg(feature = "test-support")]
            NatsPort::Sim(s) => {
                let err = |e: String| TailError {
                    stream: stream.to_owned(),
                    source: e.into(),
                };
                let (last_sequence, max_msg_size) = s.stream_state(stream).map_err(err)?;
                let last = if last_sequence == 0 {
                    None
                } else {
                    s.message_headers(stream, last_sequence)
                        .map_err(err)?
                        .map(|h| super::fence::Stamp::from_headers(&h))
                };
                Ok(Tail {
                    last_sequence,
                    last,
                    max_msg_size,
                })
            }
        }
    }
}

#[cfg(feature = "test-support")]
fn sim_error(e: SimSendError) -> PublishError {
    match e {
        SimSendError::MaxPayloadExceeded => {
            PublishError::with_source(PublishErrorKind::MaxPayloadExceeded, e)
        }
        SimSendError::Disconnected => PublishError::with_source(PublishErrorKind::BrokenPipe, e),
    }
}
