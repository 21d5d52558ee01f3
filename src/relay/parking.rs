//! The session's side of parking (`outbox.on_invalid = "park"`): the parked set a session starts
//! from, read from the stream after its tail ([`rebuild`]: a read that fails restarts the
//! session, more parked keys than `outbox.max_parked_keys` stop the relay with one line naming a
//! key and the setting), and the parking gauges set from the sink's parked set ([`gauges`]).

use crate::config::Settings;
use crate::metrics::Metrics;
use crate::nats::NatsPort;
use crate::parking::ParkedSet;
use crate::parking::ledger::{RebuildError, rebuild as read_parked};
use crate::sink::{SinkError, TailError};

use super::error::SessionEnd;
use super::policy;

/// The parked keys the stream shows, for a session's sink.
pub(super) async fn rebuild(port: &NatsPort, settings: &Settings) -> Result<ParkedSet, SessionEnd> {
    let c = settings.config();
    let max = usize::try_from(c.outbox.max_parked_keys).unwrap_or(usize::MAX);
    read_parked(
        port,
        &c.nats.stream,
        &c.nats.dead_letter_subject,
        max,
        settings.ack_timeout,
    )
    .await
    .map_err(|e| match e {
        RebuildError::Read { stream, source } => policy::from_tail(TailError { stream, source }),
        RebuildError::Full { stream, max, key } => {
            policy::from_sink(SinkError::ParkedTooMany { stream, max, key })
        }
    })
}

/// Sets the parking gauges from `parked`.
pub(super) fn gauges(metrics: &Metrics, parked: &ParkedSet) {
    let oldest = parked
        .oldest()
        .and_then(crate::parking::set::since_unix_ms)
        .map_or(0, |t| t.max(1));
    metrics.parking.set(parked.len(), parked.events(), oldest);
}
