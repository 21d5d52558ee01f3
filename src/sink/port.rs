//! The sink's use of its NATS door ([`crate::nats::JetStreamPort`], shared as a [`NatsPort`]): the
//! answers to a session's publishes as the publisher takes them, and the stream's tail as the fence
//! reads it ([`read_tail`]). Whatever implements the port (the async-nats client, the simulation's
//! JetStream), the sink's code above this file is the same.

use std::time::Duration;

use futures_util::{FutureExt, StreamExt};

use super::tail::{Stamp, Tail, TailError};
use crate::nats::{NatsError, NatsPort};

/// The answers to a session's publishes, from its inbox subscription.
pub(super) struct Answers(crate::nats::Answers);

impl Answers {
    /// Subscribes to `subject` on `port` for answers.
    pub(super) async fn subscribe(port: &NatsPort, subject: String) -> Result<Answers, NatsError> {
        port.subscribe(subject).await.map(Answers)
    }

    /// The next answer; `None` once the subscription ended.
    pub(super) async fn next(&mut self) -> Option<async_nats::Message> {
        self.0.next().await
    }

    /// The next answer if one is already queued: `Some(None)` once the subscription ended.
    pub(super) fn ready(&mut self) -> Option<Option<async_nats::Message>> {
        self.next().now_or_never()
    }
}

/// Reads the tail of `stream` through `port`, each request bounded by `timeout`: what the message
/// at the last sequence says of itself ([`Stamp`]), when it is still there.
pub(crate) async fn read_tail(
    port: &NatsPort,
    stream: &str,
    timeout: Duration,
) -> Result<Tail, TailError> {
    let t = port
        .tail(stream, timeout)
        .await
        .map_err(|source| TailError {
            stream: stream.to_owned(),
            source,
        })?;
    Ok(Tail {
        last_sequence: t.last_sequence,
        last: t.last.as_ref().map(Stamp::from_headers),
        max_msg_size: t.max_msg_size,
    })
}
