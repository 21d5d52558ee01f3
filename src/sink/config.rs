//! The sink's settings ([`SinkConfig`]): its part of the validated configuration, and the two
//! values it learns when a session starts (the history messages name, the stream's
//! `max_msg_size`). `outbox.on_invalid` is read here and applied in one place, where an event's
//! destination is decided (`destination.rs`). A leaf of the sink.

use std::time::Duration;

use crate::config::Settings;
use crate::message;
use crate::route::SubjectTemplate;

/// nats-server's default limit of messages in one atomic batch: a longer transaction is split
/// (`batch.rs`).
pub(crate) const MAX_BATCH: usize = 1000;

/// Settings the sink needs.
#[derive(Clone, Debug)]
pub(crate) struct SinkConfig {
    /// `nats.max_in_flight`: publishes awaiting their ack.
    pub(crate) max_in_flight: usize,
    /// `nats.max_in_flight_bytes`: bytes of the publishes awaiting their ack.
    pub(crate) max_in_flight_bytes: usize,
    /// `nats.ack_timeout_ms`: how long to wait for one ack.
    pub(crate) ack_timeout: Duration,
    /// `nats.dead_letter_subject`.
    pub(crate) dead_letter_subject: String,
    /// `outbox.on_invalid = "stop"`: fail instead of dead-lettering.
    pub(crate) stop_on_invalid: bool,
    /// `outbox.on_invalid = "park"`: park the event's key instead of dead-lettering it.
    pub(crate) park_on_invalid: bool,
    /// `outbox.max_parked_keys`: past it, parking one more key stops the relay.
    pub(crate) max_parked_keys: usize,
    /// The command that lists the parked keys, as the relay was started (its `--config` file and
    /// the variables that set keys): the stop past `max_parked_keys` prints it, and one copied
    /// without them would list another relay's keys.
    pub(crate) parked_command: String,
    /// `nats.subject`, parsed.
    pub(crate) template: SubjectTemplate,
    /// Fence the stream (`nats.fence`).
    pub(crate) fence: bool,
    /// `nats.stream`.
    pub(crate) stream: String,
    /// `nats.descriptive_headers`: whether routed events carry the four descriptive headers.
    pub(crate) descriptive: message::Descriptive,
    /// `nats.cloudevents`: the CloudEvents headers to add to routed events.
    pub(crate) cloudevents: Option<message::CloudEvents>,
    /// `nats.atomic_transactions`: each transaction is published as one atomic batch.
    pub(crate) atomic: bool,
    /// `nats.atomic_group_ms`: how long a transaction's atomic batch stays open for the next
    /// transactions (group commit, `group.rs`); `None`: one batch per transaction.
    pub(crate) atomic_group: Option<Duration>,
    /// The most messages in one atomic batch (the server's limit, 1,000 by default); a longer
    /// transaction is split into several batches.
    pub(crate) max_batch: usize,
    /// The history every message's `Outbox-Position` names (`SYSTEM/TIMELINE/SLOT`). Set by
    /// [`Sink::start`](super::Sink::start) from the session's [`Origin`](super::Origin).
    pub(crate) history: Option<String>,
    /// The stream's `max_msg_size`, when it has one (and it could be read); set by
    /// [`Sink::start`](super::Sink::start). A message over it is dead-lettered before it is sent,
    /// in its place: a refusal by the stream would come back only after the messages sent behind
    /// it, which without the fence nothing refuses.
    pub(crate) max_msg_size: Option<usize>,
    /// `[telemetry]`: spans for events with a sampled `traceparent`; `None` without an endpoint.
    /// Set by the relay, which owns the exporter across sessions.
    pub(crate) telemetry: Option<crate::telemetry::Telemetry>,
}

impl SinkConfig {
    /// The sink's part of the validated settings.
    pub(crate) fn from_settings(s: &Settings) -> Self {
        let n = &s.config().nats;
        SinkConfig {
            max_in_flight: n.max_in_flight,
            max_in_flight_bytes: n.max_in_flight_bytes,
            ack_timeout: s.ack_timeout,
            dead_letter_subject: n.dead_letter_subject.clone(),
            stop_on_invalid: s.stop_on_invalid,
            park_on_invalid: s.park_on_invalid,
            max_parked_keys: usize::try_from(s.config().outbox.max_parked_keys)
                .unwrap_or(usize::MAX),
            parked_command: s.command("parked"),
            template: s.subject.clone(),
            fence: n.fence,
            stream: n.stream.clone(),
            descriptive: if n.descriptive_headers {
                message::Descriptive::On
            } else {
                message::Descriptive::Off
            },
            cloudevents: n
                .cloudevents
                .then(|| message::CloudEvents::new(&n.cloudevents_source)),
            atomic: n.atomic_transactions,
            atomic_group: (n.atomic_transactions && n.atomic_group_ms > 0)
                .then(|| Duration::from_millis(n.atomic_group_ms)),
            max_batch: MAX_BATCH,
            history: None,
            max_msg_size: None,
            telemetry: None,
        }
    }
}
