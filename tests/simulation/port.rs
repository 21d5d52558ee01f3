//! The relay's NATS port ([`JetStreamPort`]) over the simulated JetStream: what the world's
//! connector hands each session in place of an async-nats client. Every request is answered at
//! once from the server's state (the timeouts are the relay's to spend, not the simulator's); what
//! the faults delay, lose or forge are the answers to publishes, which arrive on the inbox
//! subscription on the simulator's own schedule. Failures are the port's own [`NatsError`]s, of
//! the kind the real client's would be: a server down is a timeout, a publish on a broken
//! connection a closed one, a message over `max_payload` too large.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use outbox_relay::nats::{
    Answers, HeaderRead, JetStreamPort, MessageRead, NatsError, NatsErrorKind, StoredMessage,
    StreamTail, SubjectRead,
};

use super::jetstream::{JetStream, SendError};

/// Messages per bulk read of the stream ([`Reader`]).
const CHUNK: usize = 512;

/// One relay process's connection to the simulated JetStream: the same server, with the inboxes
/// of its sessions marked as the process's, so that a publish of a process that lost the slot
/// can be told from the holder's.
pub(crate) struct ProcessPort {
    pub js: Arc<JetStream>,
    pub process: u64,
}

impl JetStreamPort for ProcessPort {
    fn new_inbox(&self) -> String {
        self.js.inbox(self.process)
    }

    fn subscribe(&self, subject: String) -> BoxFuture<'_, Result<Answers, NatsError>> {
        Box::pin(async move {
            let mut rx = self.js.subscribe(subject);
            // The receiver's own poll: a wait for an answer behaves as `recv` would.
            let answers = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
            Ok(Box::pin(answers) as Answers)
        })
    }

    fn publish(
        &self,
        subject: String,
        reply: Option<String>,
        headers: HeaderMap,
        payload: Bytes,
        _: Duration,
    ) -> BoxFuture<'_, Result<(), NatsError>> {
        Box::pin(async move {
            self.js
                .publish(subject, reply, headers, payload)
                .map_err(|e| match e {
                    // The kinds the real client's errors are mapped to.
                    SendError::MaxPayloadExceeded => NatsError::new(NatsErrorKind::TooLarge, e),
                    SendError::Disconnected => NatsError::new(NatsErrorKind::Closed, e),
                })
        })
    }

    fn max_payload(&self) -> usize {
        self.js.max_payload()
    }

    fn api_request(
        &self,
        subject: String,
        body: serde_json::Value,
    ) -> BoxFuture<'_, Result<serde_json::Value, NatsError>> {
        Box::pin(async move { self.js.api(&subject, body) })
    }

    fn last_sequence<'a>(
        &'a self,
        stream: &'a str,
        _: Duration,
    ) -> BoxFuture<'a, Result<u64, NatsError>> {
        Box::pin(async move { self.js.stream_state(stream).map(|(last, _)| last) })
    }

    fn tail<'a>(
        &'a self,
        stream: &'a str,
        _: Duration,
    ) -> BoxFuture<'a, Result<StreamTail, NatsError>> {
        Box::pin(async move {
            let (last_sequence, max_msg_size) = self.js.stream_state(stream)?;
            let last = if last_sequence == 0 {
                None
            } else {
                self.js.message_headers(stream, last_sequence)?
            };
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
        _: Duration,
    ) -> BoxFuture<'a, Result<Option<HeaderMap>, NatsError>> {
        Box::pin(async move { self.js.message_headers(stream, seq) })
    }

    fn read_subjects<'a>(
        &'a self,
        stream: &'a str,
        filter: &'a str,
        read: SubjectRead,
        _: Duration,
    ) -> BoxFuture<'a, Result<Box<dyn MessageRead>, NatsError>> {
        Box::pin(async move {
            let from = match read {
                SubjectRead::Last => 1,
                SubjectRead::Headers(from) | SubjectRead::From(from) => from.max(1),
            };
            Ok(Box::new(SubjectReader {
                js: Arc::clone(&self.js),
                stream: stream.to_owned(),
                filter: filter.to_owned(),
                read,
                next: Some(from),
                chunk: VecDeque::new(),
            }) as Box<dyn MessageRead>)
        })
    }

    fn read_headers<'a>(
        &'a self,
        stream: &'a str,
        from: u64,
        to: u64,
        _: Duration,
    ) -> BoxFuture<'a, Result<Box<dyn HeaderRead>, NatsError>> {
        Box::pin(async move {
            Ok(Box::new(Reader {
                js: Arc::clone(&self.js),
                stream: stream.to_owned(),
                next: from,
                to,
                chunk: VecDeque::new(),
            }) as Box<dyn HeaderRead>)
        })
    }
}

/// A read of some subjects ([`JetStream::on_subjects`]): the last message of each at once, or
/// every message from a sequence in chunks.
struct SubjectReader {
    js: Arc<JetStream>,
    stream: String,
    filter: String,
    read: SubjectRead,
    /// The first sequence not asked for yet (`None`: all asked).
    next: Option<u64>,
    chunk: VecDeque<StoredMessage>,
}

impl MessageRead for SubjectReader {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<StoredMessage>, NatsError>> {
        Box::pin(async move {
            while self.chunk.is_empty()
                && let Some(from) = self.next
            {
                let (last, payloads) = match self.read {
                    SubjectRead::Last => (true, false),
                    SubjectRead::Headers(_) => (false, false),
                    SubjectRead::From(_) => (false, true),
                };
                let got =
                    self.js
                        .on_subjects(&self.stream, &self.filter, from, CHUNK, last, payloads)?;
                self.next = match got.last() {
                    Some(m) if !last && got.len() == CHUNK => Some(m.seq + 1),
                    _ => None,
                };
                self.chunk = got.into();
            }
            Ok(self.chunk.pop_front())
        })
    }
}

/// The bulk read: [`JetStream::headers_from`] in chunks, so a long range is never copied whole.
struct Reader {
    js: Arc<JetStream>,
    stream: String,
    /// The first sequence not asked for yet.
    next: u64,
    to: u64,
    chunk: VecDeque<(u64, HeaderMap)>,
}

impl HeaderRead for Reader {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<(u64, HeaderMap)>, NatsError>> {
        Box::pin(async move {
            while self.chunk.is_empty() && self.next <= self.to {
                let got = self
                    .js
                    .headers_from(&self.stream, self.next, self.to, CHUNK)?;
                self.next = match got.last() {
                    Some((seq, _)) if got.len() == CHUNK => seq + 1,
                    _ => self.to + 1,
                };
                self.chunk = got.into();
            }
            Ok(self.chunk.pop_front())
        })
    }
}
