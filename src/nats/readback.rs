//! Reading a range of the stream's messages back, headers only, in bulk: what the replay's proof
//! (`prove_skipped`, src/sink/replay_proof.rs) compares with the events it skipped. A replay can be as long as
//! the largest transaction, so the read holds one message at a time, never the range. `verify`
//! ([`crate::verify`]) reads the whole stream the same way, with the payloads when it compares them
//! ([`ClientReader::start_with`], [`ClientReader::next_message`]): a push consumer needs no
//! permission beyond the relay's own (a pull consumer's `$JS.API.CONSUMER.MSG.NEXT` requests would).
//!
//! Against nats-server it is an ephemeral push consumer (`$JS.API.CONSUMER.CREATE.<stream>`) that
//! starts at the first sequence, delivers headers only (`headers_only`: the payloads stay on the
//! server), acknowledges nothing, lives in memory on one replica, and delivers to an inbox of the
//! relay's own (`nats.inbox_prefix`). Flow control keeps the server from sending faster than the
//! relay reads (an unread backlog would make the server cut the connection as a slow consumer);
//! its requests are answered on their reply subject, as any response. The server removes the
//! consumer a few seconds after the read ends ([`INACTIVE`]): nothing durable is left behind, and no
//! delete permission is needed.
//!
//! The consumer skips a message that is gone (a limit, a purge, a deleted message), so the caller
//! sees the stream sequences and checks that none is missing. Anything unexpected on the way (a
//! status other than a heartbeat or flow control, a delivery out of the consumer's order, one from
//! another consumer, nothing for a whole timeout) ends the read with an error, never with a message
//! taken for another: the proof then fails, and nothing skipped is confirmed.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, push};
use async_nats::{HeaderMap, StatusCode, Subscriber};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;

use super::error::{NatsError, NatsErrorKind, mapped_while};
use super::port::{HeaderRead, MessageRead, StoredMessage};

/// How long the server keeps the consumer once nobody reads it.
const INACTIVE: Duration = Duration::from_secs(5);

/// How often the server says the consumer is alive while it has nothing to send.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// Deliveries taken from one consumer before the read goes on with a new one from the next
/// sequence. Flow control bounds what the server sends in bytes, not in messages, and the client
/// drops deliveries once its subscription buffer (65,536 messages) is full: `verify`'s read of
/// 200,000 messages with payloads saw delivery 165,924 arrive after 161,705 from one consumer. A
/// consumer's first deliveries are never the ones dropped, so a read that takes far fewer than
/// the buffer holds from each consumer cannot lose one that way, whatever the message sizes.
const CHUNK: u64 = 16_384;

/// [`CHUNK`], or in a build with the feature `test-support` (the tests' build, never a release)
/// `OUTBOX_RELAY_TEST_READ_PAGE` (a positive number, read once): a real-server test makes a read
/// move through many consumers with a few dozen messages. Not a setting, and not read by a release
/// binary at all: nothing but a test has a reason to set it, and an input no document lists has
/// no place in what operators run. The binary says when it uses it, so a test can tell that its
/// build reads the variable (tests/integration/parking/read_page.rs).
#[cfg(feature = "test-support")]
fn chunk() -> u64 {
    static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        let page = std::env::var("OUTBOX_RELAY_TEST_READ_PAGE")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0);
        if let Some(page) = page {
            tracing::warn!(
                page,
                "OUTBOX_RELAY_TEST_READ_PAGE: stream reads take {page} messages per consumer (a test build)"
            );
        }
        page.unwrap_or(CHUNK)
    })
}

/// [`CHUNK`]: a release build reads no variable for it.
#[cfg(not(feature = "test-support"))]
fn chunk() -> u64 {
    CHUNK
}

/// The read through an ephemeral push consumer; see the module docs. As the port's bulk read
/// ([`HeaderRead`]) it gives the headers only.
pub(crate) struct ClientReader {
    client: async_nats::Client,
    context: async_nats::jetstream::Context,
    sub: Subscriber,
    stream: String,
    consumer: String,
    to: u64,
    /// The consumer sequence of the last delivery taken.
    delivered: u64,
    done: bool,
    /// How long to wait for the next delivery.
    timeout: Duration,
    /// Deliveries left before the read moves on to a new consumer ([`CHUNK`]).
    chunk_left: u64,
    /// What the consumers deliver, and their description, for the next one.
    headers_only: bool,
    description: String,
    /// What the consumers read: the whole stream, or some subjects ([`Scope`]).
    scope: Scope,
}

/// Which of the stream's messages a read takes.
#[derive(Debug, Clone, Default)]
pub(crate) enum Scope {
    /// Every message from the start sequence.
    #[default]
    All,
    /// The messages on subjects `filter` matches, from the start sequence.
    Subjects(String),
    /// The last message of each subject `filter` matches (whether one key is parked: one
    /// subject): one consumer, never rolled over, since a new one could not start from a
    /// sequence; so not for many subjects.
    LastPerSubject(String),
}

impl ClientReader {
    /// Creates the consumer at `from`, subscribed to its inbox first so nothing is delivered
    /// before anyone listens.
    pub(super) async fn start(
        client: &async_nats::Client,
        stream: &str,
        from: u64,
        to: u64,
        timeout: Duration,
    ) -> Result<ClientReader, NatsError> {
        Self::start_with(
            client,
            stream,
            from,
            to,
            timeout,
            true,
            "outbox-relay: reading back a replay's messages",
        )
        .await
    }

    /// [`ClientReader::start`], with the payloads unless `headers_only`, and the consumer's
    /// description (what an operator listing the stream's consumers sees).
    pub(crate) async fn start_with(
        client: &async_nats::Client,
        stream: &str,
        from: u64,
        to: u64,
        timeout: Duration,
        headers_only: bool,
        description: &str,
    ) -> Result<ClientReader, NatsError> {
        Self::start_scoped(
            client,
            stream,
            from,
            to,
            timeout,
            headers_only,
            description,
            Scope::All,
        )
        .await
    }

    /// [`ClientReader::start_with`] over the messages `scope` takes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn start_scoped(
        client: &async_nats::Client,
        stream: &str,
        from: u64,
        to: u64,
        timeout: Duration,
        headers_only: bool,
        description: &str,
        scope: Scope,
    ) -> Result<ClientReader, NatsError> {
        let context = async_nats::jetstream::ContextBuilder::new()
            .timeout(timeout)
            .build(client.clone());
        let (sub, consumer, pending) = Self::consumer(
            client,
            &context,
            stream,
            from,
            headers_only,
            description,
            &scope,
        )
        .await?;
        Ok(ClientReader {
            client: client.clone(),
            context,
            sub,
            stream: stream.to_owned(),
            consumer,
            to,
            delivered: 0,
            // Nothing stored from `from` on.
            done: pending == 0,
            timeout,
            chunk_left: match scope {
                Scope::LastPerSubject(_) => u64::MAX,
                _ => chunk(),
            },
            headers_only,
            description: description.to_owned(),
            scope,
        })
    }

    /// A new ephemeral consumer from `from`, its inbox subscribed first: the subscription, the
    /// consumer's name and how many messages it has pending.
    async fn consumer(
        client: &async_nats::Client,
        context: &async_nats::jetstream::Context,
        stream: &str,
        from: u64,
        headers_only: bool,
        description: &str,
        scope: &Scope,
    ) -> Result<(Subscriber, String, u64), NatsError> {
        let deliver = client.new_inbox();
        let sub = client
            .subscribe(deliver.clone())
            .await
            .map_err(|e| mapped_while(format!("subscribing to {deliver}"), e))?;
        let config = push::Config {
            deliver_subject: deliver,
            description: Some(description.into()),
            deliver_policy: match scope {
                Scope::LastPerSubject(_) => DeliverPolicy::LastPerSubject,
                _ => DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
            },
            filter_subject: match scope {
                Scope::All => String::new(),
                Scope::Subjects(f) | Scope::LastPerSubject(f) => f.clone(),
            },
            ack_policy: AckPolicy::None,
            headers_only,
            flow_control: true,
            idle_heartbeat: HEARTBEAT,
            inactive_threshold: INACTIVE,
            memory_storage: true,
            num_replicas: 1,
            ..Default::default()
        };
        let consumer = context
            .create_consumer_on_stream(config, stream)
            .await
            .map_err(|e| {
                mapped_while(
                    format!("creating an ephemeral consumer on stream {stream}"),
                    e,
                )
            })?;
        let info = consumer.cached_info();
        Ok((sub, info.name.clone(), info.num_pending))
    }

    /// Goes on with a new consumer from `from` ([`CHUNK`]); the old one's subscription is dropped,
    /// and the server removes the consumer once it is inactive.
    async fn next_consumer(&mut self, from: u64) -> Result<(), NatsError> {
        let (sub, consumer, pending) = Self::consumer(
            &self.client,
            &self.context,
            &self.stream,
            from,
            self.headers_only,
            &self.description,
            &self.scope,
        )
        .await?;
        self.sub = sub;
        self.consumer = consumer;
        self.delivered = 0;
        self.chunk_left = chunk();
        self.done = pending == 0;
        Ok(())
    }

    /// The next stored message of the range, whole, with its stream sequence; `None` once the
    /// range is read.
    pub(crate) async fn next_message(
        &mut self,
    ) -> Result<Option<(u64, async_nats::Message)>, NatsError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            if self.done {
                return Ok(None);
            }
            let m = match tokio::time::timeout_at(deadline, self.sub.next()).await {
                Ok(Some(m)) => m,
                Ok(None) => {
                    return Err(NatsError::new(
                        NatsErrorKind::Closed,
                        "the consumer's subscription ended",
                    ));
                }
                Err(_) => {
                    return Err(NatsError::new(
                        NatsErrorKind::TimedOut,
                        format!(
                            "no message from the consumer within {:?} (after {} delivered)",
                            self.timeout, self.delivered
                        ),
                    ));
                }
            };
            match m.status {
                Some(StatusCode::IDLE_HEARTBEAT) => {
                    if let Some(reply) = m.reply {
                        // Flow control: the server sends more once this is answered.
                        self.client
                            .publish(reply, bytes::Bytes::new())
                            .await
                            .map_err(|e| {
                                mapped_while("answering the consumer's flow control".into(), e)
                            })?;
                        continue;
                    }
                    // A heartbeat names the last delivery: one the relay never saw was lost.
                    let last = m
                        .headers
                        .as_ref()
                        .and_then(|h| h.get(async_nats::header::NATS_LAST_CONSUMER))
                        .and_then(|v| v.as_str().parse::<u64>().ok());
                    if let Some(last) = last
                        && last != self.delivered
                    {
                        return Err(unexpected(format!(
                            "the consumer delivered {last} messages, {} arrived",
                            self.delivered
                        )));
                    }
                }
                Some(status) => {
                    return Err(unexpected(format!(
                        "the consumer answered with status {status} ({})",
                        m.description.as_deref().unwrap_or("no description")
                    )));
                }
                None => {
                    let got = self.delivery(m)?;
                    self.chunk_left -= 1;
                    if let Some((seq, _)) = &got
                        && !self.done
                        && self.chunk_left == 0
                    {
                        self.next_consumer(seq + 1).await?;
                    }
                    return Ok(got);
                }
            }
        }
    }

    /// A delivered message, checked to be this consumer's next one: `None` past the range.
    fn delivery(
        &mut self,
        m: async_nats::Message,
    ) -> Result<Option<(u64, async_nats::Message)>, NatsError> {
        let m = async_nats::jetstream::Message {
            message: m,
            context: self.context.clone(),
        };
        let info = m.info().map_err(|e| {
            unexpected(format!(
                "a delivery without the consumer's reply subject: {e}"
            ))
        })?;
        if info.stream != self.stream || info.consumer != self.consumer {
            return Err(unexpected(format!(
                "a delivery from consumer {} on stream {}, not this read's",
                info.consumer, info.stream
            )));
        }
        if info.consumer_sequence != self.delivered + 1 {
            return Err(unexpected(format!(
                "delivery {} arrived after {}: messages were lost on the way",
                info.consumer_sequence, self.delivered
            )));
        }
        self.delivered = info.consumer_sequence;
        let seq = info.stream_sequence;
        // Past the range (the rest of it is gone), or the last one stored.
        if seq >= self.to || info.pending == 0 {
            self.done = true;
        }
        if seq > self.to {
            return Ok(None);
        }
        Ok(Some((seq, m.message)))
    }
}

/// Something on the way that no read should see: the read ends with it.
fn unexpected(what: String) -> NatsError {
    NatsError::new(NatsErrorKind::Other, what)
}

impl MessageRead for ClientReader {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<StoredMessage>, NatsError>> {
        Box::pin(async move {
            Ok(self.next_message().await?.map(|(seq, m)| StoredMessage {
                seq,
                subject: m.subject.to_string(),
                headers: m.headers.unwrap_or_default(),
                payload: m.payload,
            }))
        })
    }
}

impl HeaderRead for ClientReader {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<(u64, HeaderMap)>, NatsError>> {
        Box::pin(async move {
            Ok(self
                .next_message()
                .await?
                .map(|(seq, m)| (seq, m.headers.unwrap_or_default())))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::NatsServer;

    /// A read of 100,000 messages with relay-sized headers, taken slowly at first, gives every
    /// message once and in order across the consumers it moves through ([`CHUNK`] each): a
    /// rollover that repeated or skipped a sequence fails it. (A single consumer did not drop
    /// headers-only deliveries here either; `verify`'s reads with payloads did, at 165,924.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_read_moves_through_consumers_and_gives_every_message_once_in_order() {
        const N: u64 = 100_000;
        let nats = NatsServer::start();
        let client = nats.client().await;
        let js = nats.jetstream().await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "READ".into(),
            subjects: vec!["read.*".into()],
            ..Default::default()
        })
        .await
        .expect("create stream");
        // Core publishes (the stream stores them without acks), then wait for all.
        for i in 0..N {
            let mut h = HeaderMap::new();
            h.insert("Outbox-Position", i.to_string().as_str());
            // About the header bytes of a relay's message.
            h.insert("Outbox-Pad", "x".repeat(250).as_str());
            client
                .publish_with_headers("read.x", h, bytes::Bytes::new())
                .await
                .expect("publish");
        }
        client.flush().await.expect("flush");
        let mut stream = js.get_stream("READ").await.expect("stream");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while stream.info().await.expect("info").state.messages < N {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the stream never held {N}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut r = ClientReader::start(&client, "READ", 1, N, Duration::from_secs(30))
            .await
            .expect("start");
        // The server pushes while the reader is busy elsewhere.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let mut expected = 1;
        while let Some((seq, h)) = HeaderRead::next(&mut r)
            .await
            .unwrap_or_else(|e| panic!("reading stopped after sequence {}: {e}", expected - 1))
        {
            assert_eq!(seq, expected);
            assert_eq!(
                h.get("Outbox-Position").map(|v| v.as_str().to_owned()),
                Some((seq - 1).to_string())
            );
            expected += 1;
        }
        assert_eq!(expected, N + 1, "every message read");
    }
}
