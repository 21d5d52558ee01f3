//! The position service on the NATS services API ("micro"): service `outbox-relay`, endpoints
//! `<prefix>.position` and `<prefix>.wait` with `<prefix>` = `outbox-relay.<slot>`, so `nats micro
//! ls/info/stats` and `$SRV.PING` see it.
//!
//! A session starts it once it streams the slot ([`start`]) and stops it when it ends (dropping the
//! [`Serving`] guard): a standby never appears. Stopping unsubscribes, and every wait still open
//! gets a service error (503, "ask again") at once rather than silence: the task then ends and lets
//! go of the session's NATS connection, which after a NATS failure must not outlive the session by
//! a wait's timeout. One task per session, whatever the number of waits: open waits are futures in
//! one set, woken only when [`super::WaitTask`] answers them (or the session ends).

use std::collections::HashMap;
use std::sync::Arc;

use async_nats::service::{Service, ServiceExt, error::Error as ServiceError};
use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::watch;
use tracing::debug;

use super::{Positions, WaitOutcome, WaitRequest};

/// The service's name in `nats micro ls`.
pub(crate) const SERVICE_NAME: &str = "outbox-relay";

/// The running service; dropping it stops the service.
pub(crate) struct Serving {
    service: Option<Service>,
    /// Dropped with the guard: the answering task and its open waits see the sender gone.
    _stop: watch::Sender<()>,
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(service) = self.service.take() {
            // `stop` does its work before its first await (it ends the PING/INFO/STATS task);
            // dropping the service without it would leave the relay answering `$SRV.PING`.
            let stopping = service.stop();
            if stopping.now_or_never().is_none() {
                debug!("position service: stop did not finish at once");
            }
        }
    }
}

/// Starts the service on `client` for `positions`. Subscribing only queues commands on the
/// client: this does not wait for the server.
pub(crate) async fn start(
    client: &async_nats::Client,
    positions: Arc<Positions>,
) -> Result<Serving, async_nats::Error> {
    let prefix = positions.prefix();
    let metadata = HashMap::from([
        ("slot".to_owned(), positions.slot.clone()),
        ("stream".to_owned(), positions.stream.clone()),
    ]);
    let service = client
        .service_builder()
        .description(format!(
            "read-your-writes: how far slot {} is stored in stream {}",
            positions.slot, positions.stream
        ))
        .metadata(metadata)
        .start(SERVICE_NAME, env!("CARGO_PKG_VERSION"))
        .await?;
    let group = service.group(&prefix);
    let position = group
        .endpoint_builder()
        .name("position")
        .add("position")
        .await?;
    let wait = group.endpoint_builder().name("wait").add("wait").await?;
    let (stop, stopped) = watch::channel(());
    tokio::spawn(answer(client.clone(), positions, position, wait, stopped));
    Ok(Serving {
        service: Some(service),
        _stop: stop,
    })
}

/// Which endpoint a request came to.
enum Endpoint {
    Position,
    Wait,
}

/// Answers requests until stopped; then the open waits, at once.
async fn answer(
    client: async_nats::Client,
    positions: Arc<Positions>,
    position: async_nats::service::endpoint::Endpoint,
    wait: async_nats::service::endpoint::Endpoint,
    mut stopped: watch::Receiver<()>,
) {
    let mut requests = Some(futures_util::stream::select(
        position.map(|r| (Endpoint::Position, r)),
        wait.map(|r| (Endpoint::Wait, r)),
    ));
    let mut open = FuturesUnordered::new();
    loop {
        tokio::select! {
            // Dropping the endpoints unsubscribes them; the open waits see the same stop.
            _ = stopped.changed(), if requests.is_some() => requests = None,
            next = async { requests.as_mut()?.next().await }, if requests.is_some() => {
                // The subscriptions ended (the connection closed for good): answer what is open.
                let Some((endpoint, req)) = next else {
                    requests = None;
                    continue;
                };
                match endpoint {
                    Endpoint::Position => {
                        let reply = match positions.position() {
                            Ok(p) => Ok(Bytes::from(p.to_json())),
                            Err(e) => Err(error(503, e.to_string())),
                        };
                        respond(&req, reply).await;
                    }
                    Endpoint::Wait => {
                        let waiting = WaitRequest::from_json(&req.message.payload)
                            .map_err(|e| error(400, e.to_string()))
                            .and_then(|r| positions.wait(r).map_err(|e| error(503, e.to_string())));
                        match waiting {
                            Ok(outcome) => {
                                let mut stopped = stopped.clone();
                                open.push(async move {
                                    tokio::select! {
                                        o = outcome => (req, Some(o)),
                                        // Only the sender's drop ends this: the session ended.
                                        _ = stopped.changed() => (req, None),
                                    }
                                });
                            }
                            Err(e) => respond(&req, Err(e)).await,
                        }
                    }
                }
            }
            Some((req, outcome)) = open.next(), if !open.is_empty() => {
                let reply = match outcome {
                    Some(WaitOutcome::Overloaded) => Err(error(503, "too many open waits: ask again later".into())),
                    Some(o @ (WaitOutcome::Stored { .. } | WaitOutcome::TimedOut { .. })) => Ok(Bytes::from(o.to_json())),
                    Some(WaitOutcome::Stopping) | None => Err(error(503, "the relay stopped streaming the slot (reconnecting, or shutting down): ask again".into())),
                };
                respond(&req, reply).await;
            }
            else => break,
        }
    }
    // Replies are only queued on the client; when the relay stops, this task may hold its last
    // handle, and a handle dropped with replies queued can lose them. Bounded: the connection may
    // be down.
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), client.flush()).await;
}

fn error(code: usize, status: String) -> ServiceError {
    ServiceError { status, code }
}

async fn respond(req: &async_nats::service::Request, reply: Result<Bytes, ServiceError>) {
    // A request without a reply subject, or a connection that went down: nobody to tell.
    if let Err(e) = req.respond(reply).await {
        debug!(error = %e, "position service: reply not sent");
    }
}
