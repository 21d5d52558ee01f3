//! The sink's use of its NATS door ([`crate::nats::JetStreamPort`], shared as a [`NatsPort`]): the
//! answers to a session's publishes as the publisher takes them. The stream's tail, which the sink
//! reads when it opens, is read by the tail module (`src/tail/read.rs`). Whatever implements the
//! port (the async-nats client, the simulation's JetStream), the sink's code above this file is the
//! same.

use futures_util::{FutureExt, StreamExt};

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
