//! Reading the stream's tail through the NATS port ([`read_tail`]): the one request the sink's
//! opening, `status`, the stop mark and the connector share. Whatever implements the port (the
//! async-nats client, the simulation's JetStream), the reading is the same.

use std::time::Duration;

use crate::nats::NatsPort;

use super::stamp::{Stamp, Tail, TailError};

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
