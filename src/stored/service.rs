//! The position service on the NATS services API ("micro"): service `outbox-relay`, endpoints
//! `<prefix>.position` and `<prefix>.wait` with `<prefix>` = `outbox-relay.<slot>` (queue group
//! `q`), and the discovery answers (`discovery.rs`), so `nats micro ls/info/stats` and `$SRV.PING`
//! see it.
//!
//! Every answer goes out with the relay's own NATS rights, so the service is nobody's deputy: it
//! answers only on requesters' inboxes (`replies.rs`: under `nats.service_reply_prefixes`, outside
//! the relay's inbox and stream, under no prefix a stream of the account stores subjects under, as
//! `streams.rs` keeps asking JetStream). Any other request gets no answer and is counted
//! (`outbox_relay_position_requests_refused_total`, reason `reply_subject`). A request body over
//! [`MAX_REQUEST_BYTES`] gets a service error (413); an open wait keeps only its reply subject (at
//! most 128 bytes) and when it began, never the request it came in, and is charged to the waits'
//! byte budget ([`super::MAX_WAIT_BYTES`]): beyond it a wait gets a service error (503) at once and
//! counts as `overloaded`.
//!
//! A session starts it once it streams the slot ([`start`]) and stops it when it ends (dropping the
//! [`Serving`] guard): a standby never appears. Stopping unsubscribes, and every wait still open
//! gets a service error (503, "ask again") at once rather than silence: the task then ends and lets
//! go of the session's NATS connection, which after a NATS failure must not outlive the session by
//! a wait's timeout. One task per session, whatever the number of waits: open waits are futures in
//! one set, woken only when [`super::WaitTask`] answers them (or the session ends).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::service::error::Error as ServiceError;
use async_nats::{HeaderMap, Message};
use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, SelectAll};
use futures_util::{Stream, StreamExt};
use tokio::sync::watch;
use tracing::debug;

use super::discovery::{Counts, Described, QUEUE_GROUP, Verb};
use super::replies::{ReplyRules, Streams};
use super::{MAX_REQUEST_BYTES, Positions, WaitOutcome, WaitRequest};
use crate::metrics::Metrics;

/// The service's name in `nats micro ls`.
pub(crate) const SERVICE_NAME: &str = "outbox-relay";

/// How long the service waits for the stream's configuration before it gives up starting.
const STREAM_INFO_TIMEOUT: Duration = Duration::from_secs(5);

/// What an open NATS wait holds in this task besides its reply subject: its entry in the set of
/// open waits (the future, its stop signal, [`Asked`]). With the wait task's share
/// (`WAIT_ENTRY_BYTES`, 256) and a 128-byte reply subject that charges 1,024 bytes; measured: the
/// 16,384 such waits the budget admits grew the relay by 1,048 bytes each, the flood's own buffers
/// included (tests/integration/hostile/waits.rs).
const NATS_WAIT_BYTES: usize = 640;

/// What the service needs besides the positions: the names it must never answer on, and where to
/// count refusals.
#[derive(Clone)]
pub(crate) struct Guard {
    /// `nats.dead_letter_subject`.
    pub(crate) dead_letter_subject: String,
    /// `nats.inbox_prefix`.
    pub(crate) inbox_prefix: String,
    /// `nats.service_reply_prefixes`.
    pub(crate) reply_prefixes: Vec<String>,
    /// Refused requests are counted here.
    pub(crate) metrics: Arc<Metrics>,
}

/// The running service; dropping it stops the service.
pub(crate) struct Serving {
    /// Dropped with the guard: the answering task unsubscribes, and its open waits see it too.
    _stop: watch::Sender<()>,
}

/// Starts the service on `client` for `positions`: reads the stream's subjects (which it must never
/// answer on), then subscribes. Fails when the stream cannot be read or a subscription is refused.
pub(crate) async fn start(
    client: &async_nats::Client,
    positions: Arc<Positions>,
    guard: Guard,
) -> Result<Serving, async_nats::Error> {
    let js = async_nats::jetstream::ContextBuilder::new()
        .timeout(STREAM_INFO_TIMEOUT)
        .build(client.clone());
    let stream = js.get_stream(&positions.stream).await?;
    let rules = ReplyRules::new(
        &stream.cached_info().config.subjects,
        &guard.dead_letter_subject,
        &guard.inbox_prefix,
        &guard.reply_prefixes,
    );
    // The instance id: a NUID, as every inbox of the client ends with.
    let inbox = client.new_inbox();
    let id = inbox.rsplit('.').next().unwrap_or(&inbox).to_owned();
    let prefix = positions.prefix();
    let described = Described {
        name: SERVICE_NAME.into(),
        id: id.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        description: format!(
            "read-your-writes: how far slot {} is stored in stream {}",
            positions.slot, positions.stream
        ),
        metadata: HashMap::from([
            ("slot".to_owned(), positions.slot.clone()),
            ("stream".to_owned(), positions.stream.clone()),
        ]),
        endpoints: vec![
            ("position".into(), format!("{prefix}.position")),
            ("wait".into(), format!("{prefix}.wait")),
        ],
        started: async_nats::datetime::now(),
    };
    let mut requests: SelectAll<Requests> = SelectAll::new();
    for (kind, (_, subject)) in [Kind::Position, Kind::Wait]
        .into_iter()
        .zip(&described.endpoints)
    {
        let sub = client
            .queue_subscribe(subject.clone(), QUEUE_GROUP.into())
            .await?;
        requests.push(Box::pin(sub.map(move |m| (kind, m))));
    }
    for verb in Verb::ALL {
        for subject in verb.subjects(SERVICE_NAME, &id) {
            let sub = client.subscribe(subject).await?;
            requests.push(Box::pin(sub.map(move |m| (Kind::Discovery(verb), m))));
        }
    }
    let (stop, stopped) = watch::channel(());
    // Nothing is answered until the account's streams are known.
    let (streams_tx, streams) = watch::channel(Streams::Unknown);
    tokio::spawn(super::streams::watch_streams(
        client.clone(),
        rules.prefixes().to_vec(),
        streams_tx,
        stopped.clone(),
    ));
    let answering = Answering {
        client: client.clone(),
        positions,
        rules,
        streams,
        metrics: guard.metrics,
        described,
        counts: [Counts::default(), Counts::default()],
    };
    tokio::spawn(answering.run(requests, stopped));
    Ok(Serving { _stop: stop })
}

/// Which subscription a request came to.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Position,
    Wait,
    Discovery(Verb),
}

type Requests = std::pin::Pin<Box<dyn Stream<Item = (Kind, Message)> + Send>>;

/// What an open wait keeps: where to answer, and since when (for `STATS`).
struct Asked {
    reply: String,
    since: Instant,
}

/// The answering task's state.
struct Answering {
    client: async_nats::Client,
    positions: Arc<Positions>,
    rules: ReplyRules,
    /// What the account's streams store under the allowed prefixes (`streams.rs`).
    streams: watch::Receiver<Streams>,
    metrics: Arc<Metrics>,
    described: Described,
    /// `position`, `wait`.
    counts: [Counts; 2],
}

impl Answering {
    /// Answers requests until stopped; then the open waits, at once.
    async fn run(mut self, requests: SelectAll<Requests>, mut stopped: watch::Receiver<()>) {
        let mut requests = Some(requests);
        let mut open = FuturesUnordered::new();
        loop {
            tokio::select! {
                // Dropping the subscriptions unsubscribes them; the open waits see the same stop.
                _ = stopped.changed(), if requests.is_some() => requests = None,
                next = async { requests.as_mut()?.next().await }, if requests.is_some() => {
                    // The subscriptions ended (the connection closed for good): answer what is open.
                    let Some((kind, message)) = next else {
                        requests = None;
                        continue;
                    };
                    let Some(asked) = self.admit(&message) else { continue };
                    let body = message.payload;
                    if body.len() > MAX_REQUEST_BYTES {
                        self.metrics.position_refused_too_large.inc();
                        self.respond(kind, asked, Err(too_large(body.len()))).await;
                        continue;
                    }
                    match kind {
                        Kind::Discovery(verb) => {
                            let json = self.described.answer(verb, &self.counts);
                            self.publish(&asked.reply, Ok(Bytes::from(json))).await;
                        }
                        Kind::Position => {
                            let reply = match self.positions.position() {
                                Ok(p) => Ok(Bytes::from(p.to_json())),
                                Err(e) => Err(error(503, e.to_string())),
                            };
                            self.respond(kind, asked, reply).await;
                        }
                        Kind::Wait => {
                            let held = asked.reply.len() + NATS_WAIT_BYTES;
                            let waiting = WaitRequest::from_json(&body)
                                .map_err(|e| error(400, e.to_string()))
                                .and_then(|r| self.positions.wait(r, held).map_err(|e| error(503, e.to_string())));
                            // The body goes now; the wait keeps only `asked`.
                            drop(body);
                            match waiting {
                                Ok(outcome) => {
                                    let mut stopped = stopped.clone();
                                    open.push(async move {
                                        tokio::select! {
                                            o = outcome => (asked, Some(o)),
                                            // Only the sender's drop ends this: the session ended.
                                            _ = stopped.changed() => (asked, None),
                                        }
                                    });
                                }
                                Err(e) => self.respond(kind, asked, Err(e)).await,
                            }
                        }
                    }
                }
                Some((asked, outcome)) = open.next(), if !open.is_empty() => {
                    let reply = match outcome {
                        Some(WaitOutcome::Overloaded) => {
                            self.metrics.position_refused_overloaded.inc();
                            Err(error(503, "too many open waits: ask again later".into()))
                        }
                        Some(o @ (WaitOutcome::Stored { .. } | WaitOutcome::TimedOut { .. })) => Ok(Bytes::from(o.to_json())),
                        Some(WaitOutcome::Stopping) | None => Err(error(503, "the relay stopped streaming the slot (reconnecting, or shutting down): ask again".into())),
                    };
                    self.respond(Kind::Wait, asked, reply).await;
                }
                else => break,
            }
        }
        // Replies are only queued on the client; when the relay stops, this task may hold its last
        // handle, and a handle dropped with replies queued can lose them. Bounded: the connection
        // may be down.
        let _ = tokio::time::timeout(Duration::from_secs(2), self.client.flush()).await;
    }

    /// Where to answer `message`, or `None` when nobody may be answered: no reply subject, or one
    /// the relay must never publish to (counted, and logged at debug: a flood must not flood logs).
    fn admit(&self, message: &Message) -> Option<Asked> {
        let reply = message.reply.as_ref()?;
        let refused = self.rules.refuses(reply, &self.streams.borrow());
        if let Some(why) = refused {
            self.metrics.position_refused_reply.inc();
            debug!(
                subject = %message.subject,
                reply = %super::shorten(reply),
                %why,
                "position service: request refused, its reply subject is not a requester's inbox"
            );
            return None;
        }
        Some(Asked {
            // A copy of its own: nothing of the received message stays alive with the wait.
            reply: reply.as_str().to_owned(),
            since: Instant::now(),
        })
    }

    /// Answers an endpoint's request and counts it for `STATS`.
    async fn respond(&mut self, kind: Kind, asked: Asked, reply: Result<Bytes, ServiceError>) {
        let counts = match kind {
            Kind::Position => Some(&mut self.counts[0]),
            Kind::Wait => Some(&mut self.counts[1]),
            Kind::Discovery(_) => None,
        };
        if let Some(c) = counts {
            c.answered(asked.since.elapsed(), reply.as_ref().err());
        }
        self.publish(&asked.reply, reply).await;
    }

    /// Publishes an answer, or a service error (the services API's two headers, no payload).
    async fn publish(&self, reply: &str, answer: Result<Bytes, ServiceError>) {
        let sent = match answer {
            Ok(payload) => self.client.publish(reply.to_owned(), payload).await,
            Err(e) => {
                let mut headers = HeaderMap::new();
                headers.insert(async_nats::service::NATS_SERVICE_ERROR, e.status.as_str());
                headers.insert(
                    async_nats::service::NATS_SERVICE_ERROR_CODE,
                    e.code.to_string().as_str(),
                );
                self.client
                    .publish_with_headers(reply.to_owned(), headers, Bytes::new())
                    .await
            }
        };
        // A connection that went down: nobody to tell.
        if let Err(e) = sent {
            debug!(error = %e, "position service: reply not sent");
        }
    }
}

fn error(code: usize, status: String) -> ServiceError {
    ServiceError { status, code }
}

fn too_large(len: usize) -> ServiceError {
    error(
        413,
        format!(
            "request: the body is {len} bytes, more than {MAX_REQUEST_BYTES}: send only {{\"lsn\": \"16/B374D848\", \"timeout_ms\": 5000}}"
        ),
    )
}
