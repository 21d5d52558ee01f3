//! The sink's one door to NATS: the [`JetStreamPort`] trait, shared as a [`NatsPort`]. In production
//! the async-nats client implements it (`client.rs`); in the deterministic simulation
//! (tests/simulation) an in-memory JetStream does, so the real sink, fence and ack handling run
//! against faults no real server produces on demand (an ack lost, late, duplicated, reordered or
//! forged; a foreign message at the tail). The port is what the sink needs of a connection and no
//! more: an inbox and its answers, publishes, the server's `max_payload`, and reads of the stream
//! (its tail, one message's headers, a range's headers in bulk).
//!
//! A trait object with boxed futures, not generics: a `Connector` (itself a trait object) hands
//! each session its port, and a type parameter would run through the sink, the session and the
//! restart loop for one allocation and one indirect call per publish, small beside the relay's work
//! per event (measured in docs/performance.md, "Port as a trait"). Answers arrive as a boxed
//! stream, taken once per session, so polling for them costs one indirect call.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use futures_util::Stream;
use futures_util::future::BoxFuture;

use super::error::{NatsError, NatsErrorKind};

/// The answers published to a session's inbox (JetStream's acks), in arrival order; the stream
/// ends when the subscription does. `Sync` as well, so the sink that holds it is.
pub type Answers = Pin<Box<dyn Stream<Item = async_nats::Message> + Send + Sync>>;

/// What the sink needs of a NATS connection with JetStream. Every request that waits on the server
/// takes the longest it may wait; a port that answers at once (the simulation's) ignores it. Every
/// failure is a [`NatsError`] of a kind ([`NatsErrorKind`](super::NatsErrorKind)).
pub trait JetStreamPort: Send + Sync + 'static {
    /// A new unique inbox prefix for a session's answers.
    fn new_inbox(&self) -> String;

    /// Subscribes to `subject` (a wildcard like `<inbox>.*`) for the answers to publishes.
    fn subscribe(&self, subject: String) -> BoxFuture<'_, Result<Answers, NatsError>>;

    /// Queues a publish, waiting at most `timeout` for room in the queue to the connection.
    /// `reply` is set for a publish that awaits JetStream's answer, `None` for a core publish (an
    /// atomic batch member). A message over the server's `max_payload` is refused before it is
    /// sent, with [`NatsErrorKind::TooLarge`] (the sink dead-letters on it).
    fn publish(
        &self,
        subject: String,
        reply: Option<String>,
        headers: HeaderMap,
        payload: Bytes,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<(), NatsError>>;

    /// The server's `max_payload`.
    fn max_payload(&self) -> usize;

    /// The stream's last sequence now.
    fn last_sequence<'a>(
        &'a self,
        stream: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<u64, NatsError>>;

    /// The stream's tail: its last sequence, `max_msg_size` and the last message's headers. The
    /// message is read from the stream leader, so a message just stored is seen.
    fn tail<'a>(
        &'a self,
        stream: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<StreamTail, NatsError>>;

    /// The headers of the stream's message `seq`: `None` when it is gone (a limit or a purge).
    fn message_headers<'a>(
        &'a self,
        stream: &'a str,
        seq: u64,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<HeaderMap>, NatsError>>;

    /// A read of the stream's messages `from..=to`, headers only, in bulk: every message still
    /// stored, in order, one at a time (a gone message is left out, as a consumer skips it).
    fn read_headers<'a>(
        &'a self,
        stream: &'a str,
        from: u64,
        to: u64,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Box<dyn HeaderRead>, NatsError>>;

    /// A read of the messages on subjects `filter` matches, one at a time in stream order:
    /// [`SubjectRead::Last`], the last message of each subject, headers only (whether one key is
    /// parked: a single subject); [`SubjectRead::Headers`], every message from a sequence, headers
    /// only (which keys are parked, a key's markers, the dead letters); [`SubjectRead::From`],
    /// every message from a sequence with its payload (a parked key's run, one dead letter). A
    /// real port reads the last two in pages, so no length overruns the client. The default reads
    /// nothing.
    fn read_subjects<'a>(
        &'a self,
        stream: &'a str,
        filter: &'a str,
        read: SubjectRead,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Box<dyn MessageRead>, NatsError>> {
        let _ = (stream, filter, read, timeout);
        Box::pin(async {
            Err(NatsError::new(
                NatsErrorKind::Other,
                "this port reads no subjects",
            ))
        })
    }

    /// A JetStream API request (`$JS.API.<subject>`, e.g. `STREAM.INFO.OUTBOX`) with a JSON body,
    /// and the server's JSON answer (a refusal is an answer with an `error` object); `Err` when no
    /// answer came. For the stream's metadata, where the backfill marker lives
    /// (`backfill_marker.rs`): the marker is read and written as the whole configuration, so a
    /// field this client does not know goes back as the server sent it. The default answers
    /// nothing.
    fn api_request(
        &self,
        subject: String,
        body: serde_json::Value,
    ) -> BoxFuture<'_, Result<serde_json::Value, NatsError>> {
        let _ = (subject, body);
        Box::pin(async {
            Err(NatsError::new(
                NatsErrorKind::Other,
                "this port sends no JetStream API requests",
            ))
        })
    }

    /// The real connection behind the port, for what a session serves besides publishing (the
    /// stored position's NATS service). `None` where there is none (the simulation).
    fn client(&self) -> Option<&async_nats::Client> {
        None
    }
}

/// A bulk read started by [`JetStreamPort::read_headers`].
pub trait HeaderRead: Send {
    /// The next stored message of the range with its sequence, `None` once the range is read.
    fn next(&mut self) -> BoxFuture<'_, Result<Option<(u64, HeaderMap)>, NatsError>>;
}

/// Which messages a [`JetStreamPort::read_subjects`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubjectRead {
    /// The last message of each subject, headers only.
    Last,
    /// Every message from this sequence on, headers only.
    Headers(u64),
    /// Every message from this sequence on, with its payload.
    From(u64),
}

/// A stored message as a subject read gives it.
#[derive(Debug, Clone)]
pub struct StoredMessage {
    /// Its stream sequence.
    pub seq: u64,
    /// Its subject.
    pub subject: String,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its payload (empty in a headers-only read).
    pub payload: Bytes,
}

/// A read started by [`JetStreamPort::read_subjects`].
pub trait MessageRead: Send {
    /// The next message, `None` once the read is done.
    fn next(&mut self) -> BoxFuture<'_, Result<Option<StoredMessage>, NatsError>>;
}

/// The stream's tail as [`JetStreamPort::tail`] reads it.
#[derive(Debug, Clone, Default)]
pub struct StreamTail {
    /// The stream's last sequence (0 for a new stream).
    pub last_sequence: u64,
    /// The stream's `max_msg_size` (headers and payload), when it has one.
    pub max_msg_size: Option<usize>,
    /// The headers of the message at `last_sequence`, when it is still there.
    pub last: Option<HeaderMap>,
}

/// A shared [`JetStreamPort`]: where the sink publishes. Cheap to clone; derefs to the port.
#[derive(Clone)]
pub struct NatsPort(Arc<dyn JetStreamPort>);

impl NatsPort {
    /// Shares `port`.
    pub fn new(port: impl JetStreamPort) -> Self {
        NatsPort(Arc::new(port))
    }
}

impl From<async_nats::Client> for NatsPort {
    fn from(c: async_nats::Client) -> Self {
        NatsPort::new(c)
    }
}

impl std::ops::Deref for NatsPort {
    type Target = dyn JetStreamPort;

    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}
