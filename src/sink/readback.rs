//! Reading a range of the stream's messages back, headers only, in bulk: what the replay's proof
//! ([`super::Sink::prove_skipped`]) compares with the events it skipped. A replay can be as long as
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

/// How long the server keeps the consumer once nobody reads it.
const INACTIVE: Duration = Duration::from_secs(5);

/// How often the server says the consumer is alive while it has nothing to send.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// The simulation's messages per bulk read.
#[cfg(feature = "test-support")]
const SIM_CHUNK: usize = 512;

/// A read of the stream's messages `from..=to`: [`Reader::next`] gives each one still stored, in
/// sequence order.
pub(super) enum Reader {
    Client(Box<ClientReader>),
    #[cfg(feature = "test-support")]
    Sim(SimReader),
}

impl Reader {
    /// The next stored message of the range with its sequence, `None` once the range is read.
    pub(super) async fn next(&mut self) -> Result<Option<(u64, HeaderMap)>, String> {
        match self {
            Reader::Client(r) => r.next().await,
            #[cfg(feature = "test-support")]
            Reader::Sim(r) => r.next(),
        }
    }
}

/// The read through an ephemeral push consumer; see the module docs.
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
    ) -> Result<ClientReader, String> {
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
    ) -> Result<ClientReader, String> {
        let context = async_nats::jetstream::ContextBuilder::new()
            .timeout(timeout)
            .build(client.clone());
        let deliver = client.new_inbox();
        let sub = client
            .subscribe(deliver.clone())
            .await
            .map_err(|e| format!("subscribing to {deliver}: {e}"))?;
        let config = push::Config {
            deliver_subject: deliver,
            description: Some(description.into()),
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: from,
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
            .map_err(|e| format!("creating an ephemeral consumer on stream {stream}: {e}"))?;
        let info = consumer.cached_info();
        Ok(ClientReader {
            client: client.clone(),
            context,
            sub,
            stream: stream.to_owned(),
            consumer: info.name.clone(),
            to,
            delivered: 0,
            // Nothing stored from `from` on.
            done: info.num_pending == 0,
            timeout,
        })
    }

    async fn next(&mut self) -> Result<Option<(u64, HeaderMap)>, String> {
        Ok(self
            .next_message()
            .await?
            .map(|(seq, m)| (seq, m.headers.unwrap_or_default())))
    }

    /// The next stored message of the range, whole, with its stream sequence; `None` once the
    /// range is read.
    pub(crate) async fn next_message(
        &mut self,
    ) -> Result<Option<(u64, async_nats::Message)>, String> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            if self.done {
                return Ok(None);
            }
            let m = match tokio::time::timeout_at(deadline, self.sub.next()).await {
                Ok(Some(m)) => m,
                Ok(None) => return Err("the consumer's subscription ended".into()),
                Err(_) => {
                    return Err(format!(
                        "no message from the consumer within {:?} (after {} delivered)",
                        self.timeout, self.delivered
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
                            .map_err(|e| format!("answering the consumer's flow control: {e}"))?;
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
                        return Err(format!(
                            "the consumer delivered {last} messages, {} arrived",
                            self.delivered
                        ));
                    }
                }
                Some(status) => {
                    return Err(format!(
                        "the consumer answered with status {status} ({})",
                        m.description.as_deref().unwrap_or("no description")
                    ));
                }
                None => return self.delivery(m),
            }
        }
    }

    /// A delivered message, checked to be this consumer's next one: `None` past the range.
    fn delivery(
        &mut self,
        m: async_nats::Message,
    ) -> Result<Option<(u64, async_nats::Message)>, String> {
        let m = async_nats::jetstream::Message {
            message: m,
            context: self.context.clone(),
        };
        let info = m
            .info()
            .map_err(|e| format!("a delivery without the consumer's reply subject: {e}"))?;
        if info.stream != self.stream || info.consumer != self.consumer {
            return Err(format!(
                "a delivery from consumer {} on stream {}, not this read's",
                info.consumer, info.stream
            ));
        }
        if info.consumer_sequence != self.delivered + 1 {
            return Err(format!(
                "delivery {} arrived after {}: messages were lost on the way",
                info.consumer_sequence, self.delivered
            ));
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

/// The simulation's read: [`super::SimJetStream::headers_from`] in chunks.
#[cfg(feature = "test-support")]
pub(super) struct SimReader {
    pub(super) js: std::sync::Arc<dyn super::SimJetStream>,
    pub(super) stream: String,
    /// The first sequence not asked for yet.
    pub(super) next: u64,
    pub(super) to: u64,
    pub(super) chunk: std::collections::VecDeque<(u64, HeaderMap)>,
}

#[cfg(feature = "test-support")]
impl SimReader {
    fn next(&mut self) -> Result<Option<(u64, HeaderMap)>, String> {
        while self.chunk.is_empty() && self.next <= self.to {
            let got = self
                .js
                .headers_from(&self.stream, self.next, self.to, SIM_CHUNK)?;
            self.next = match got.last() {
                Some((seq, _)) if got.len() == SIM_CHUNK => seq + 1,
                _ => self.to + 1,
            };
            self.chunk = got.into();
        }
        Ok(self.chunk.pop_front())
    }
}
