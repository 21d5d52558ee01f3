//! `[telemetry]`: one OpenTelemetry PRODUCER span per event whose writer sampled its trace
//! (DESIGN §4.2 "Trace context", docs/tracing.md), exported over OTLP/HTTP (protobuf).
//!
//! The span runs from the transaction's commit to JetStream's ack, its parent is the writer's span
//! (the event's `traceparent`), and the published message's `traceparent` names it, so a consumer's
//! span becomes its child. The sink calls [`Telemetry::begin`] when it publishes an event and
//! [`Telemetry::end`] when it settles it; both run on the relay's one thread and cost a few small
//! allocations and a `try_send`. Everything else happens on the export thread: building the
//! OpenTelemetry [`SpanData`], batching, the OTLP exporter of `opentelemetry-otlp` (protobuf) and the
//! HTTP request (`http.rs`, a small blocking client, so the exporter needs no runtime of its own).
//!
//! Never in the way: the queue between the two is bounded ([`QUEUE`]); a span that finds it full,
//! or whose batch the collector refuses, does not answer, or answers with an error, is dropped and
//! counted. The queue is a vector under a mutex that the export thread empties in one swap, and the
//! relay wakes that thread once per [`WAKE_AT`] spans, not per span: a channel whose receiver waits
//! costs a futex wake-up and a context switch for every span, which measured as most of a span's
//! cost on two cores (docs/performance.md) (`outbox_relay_spans_dropped_total`). A hanging collector holds the export thread for at
//! most the request timeout, never the relay. Without `telemetry.otlp_endpoint` there is no
//! [`Telemetry`] at all: the sink's `Option` is `None` and the hot path pays one branch.

mod http;
pub mod traceparent;

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};
use std::thread::Thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SpanData, SpanExporter};
use tracing::{info, warn};

use crate::Lsn;
use crate::message::Outgoing;
use crate::metrics::Metrics;
use crate::outbox::OutboxEvent;
pub use traceparent::{TRACEPARENT, TRACESTATE, TraceParent};

/// Finished spans waiting for the export thread; more are dropped and counted.
pub const QUEUE: usize = 4096;
/// The relay wakes the export thread when this many spans wait (else it wakes every [`DELAY`]).
pub const WAKE_AT: usize = 1024;
/// The most spans in one export request.
pub const BATCH: usize = 512;
/// How long a span waits at most before the export thread looks at the queue.
pub const DELAY: Duration = Duration::from_millis(500);
/// Connecting to the collector, and the whole request: a collector that does not answer in time
/// costs the spans of that batch, nothing else.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// See [`CONNECT_TIMEOUT`].
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the relay's exit waits for the spans still queued to be sent.
const EXIT_FLUSH: Duration = Duration::from_secs(2);

/// The exporter of one relay process; cheap to clone (the sink of every session holds one).
#[derive(Clone)]
pub struct Telemetry {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    /// The export thread, to wake when [`WAKE_AT`] spans wait, and on exit.
    exporter: Thread,
    ids: RandomIdGenerator,
    metrics: Arc<Metrics>,
    dead_letter_subject: String,
    /// Told by the export thread when it has sent what was queued (on exit). In a mutex only so
    /// that `Inner` is `Sync`: the relay's future must be `Send`.
    done: Mutex<Receiver<()>>,
}

/// What the relay and the export thread share.
struct Shared {
    /// Finished spans, oldest first; the export thread takes them all in one swap.
    queue: Mutex<Vec<Finished>>,
    /// Set on exit: the thread sends what is queued and stops.
    closed: AtomicBool,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Telemetry")
    }
}

/// A span started by [`Telemetry::begin`]: what it needs until the ack ends it.
#[derive(Debug)]
pub struct Started {
    trace: TraceParent,
    span_id: u64,
    tracestate: Option<String>,
    start: SystemTime,
    subject: String,
}

/// A span ended, on its way to the export thread.
struct Finished {
    started: Box<Started>,
    end: SystemTime,
    message_id: String,
    commit_lsn: Lsn,
    /// A dead letter's reason.
    error: Option<String>,
}

impl Telemetry {
    /// The exporter for `endpoint` (an `http://` URL, validated by the configuration; a bare
    /// `http://host:port` gets OTLP's `/v1/traces`), and its export thread. Spans of dead letters
    /// are named after `dead_letter_subject`.
    pub fn start(
        endpoint: &str,
        service_name: &str,
        dead_letter_subject: &str,
        metrics: Arc<Metrics>,
    ) -> Result<Telemetry, String> {
        let url = traces_url(endpoint)?;
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url.clone())
            .with_timeout(REQUEST_TIMEOUT)
            // A failed batch is dropped and counted, not retried: retrying would hold the
            // thread while newer spans wait, and a collector that is down stays down for a while.
            .with_retry_policy(opentelemetry_otlp::RetryPolicy::disabled())
            .with_http_client(http::BlockingClient::new(CONNECT_TIMEOUT, REQUEST_TIMEOUT))
            .build()
            .map_err(|e| format!("telemetry.otlp_endpoint {endpoint:?}: {e}"))?;
        exporter.set_resource(
            &Resource::builder_empty()
                .with_service_name(service_name.to_owned())
                .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                .build(),
        );
        let shared = Arc::new(Shared {
            queue: Mutex::new(Vec::with_capacity(WAKE_AT)),
            closed: AtomicBool::new(false),
        });
        let (done_tx, done) = sync_channel(1);
        let thread_metrics = Arc::clone(&metrics);
        let thread_shared = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || {
                export_loop(&thread_shared, exporter, &thread_metrics);
                let _ = done_tx.send(());
            })
            .map_err(|e| format!("cannot start the span export thread: {e}"))?;
        info!(endpoint = %url, "exporting trace spans over OTLP/HTTP");
        Ok(Telemetry {
            inner: Arc::new(Inner {
                shared,
                exporter: handle.thread().clone(),
                ids: RandomIdGenerator::default(),
                metrics,
                dead_letter_subject: dead_letter_subject.to_owned(),
                done: Mutex::new(done),
            }),
        })
    }

    /// Starts the span of `event`, published as `out`, when its `traceparent` is valid and
    /// sampled: from now on the event's and the message's `traceparent` name the relay's span
    /// (so a dead letter or a republish of it does too). Anything else passes through unchanged.
    pub fn begin(&self, event: &mut OutboxEvent, out: &mut Outgoing) -> Option<Box<Started>> {
        let (i, trace) = event
            .headers
            .iter()
            .enumerate()
            .find(|(_, (k, _))| k.eq_ignore_ascii_case(TRACEPARENT))
            .and_then(|(i, (_, v))| Some((i, TraceParent::parse(v)?)))?;
        if !trace.sampled() {
            return None;
        }
        let span_id = u64::from_be_bytes(self.inner.ids.new_span_id().to_bytes());
        let child = trace.child(span_id);
        let header = &mut event.headers[i];
        if out.headers.get(header.0.as_str()).is_some() {
            out.headers.insert(header.0.as_str(), child.as_str());
        }
        header.1 = child;
        let tracestate = event
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(TRACESTATE))
            .map(|(_, v)| v.clone());
        Some(Box::new(Started {
            trace,
            span_id,
            tracestate,
            start: commit_time(event.commit_ts).unwrap_or_else(SystemTime::now),
            subject: out.subject.clone(),
        }))
    }

    /// Ends `started` now (the ack of `event` arrived): `dead_letter` is the reason when the event
    /// went to the dead-letter subject. Queued for export, or dropped and counted.
    pub fn end(&self, mut started: Box<Started>, event: &OutboxEvent, dead_letter: Option<&str>) {
        if dead_letter.is_some() {
            // It may have been refused after it was sent, and republished as a dead letter.
            started.subject = self.inner.dead_letter_subject.clone();
        }
        let finished = Finished {
            started,
            end: SystemTime::now(),
            message_id: event.msg_id.clone(),
            commit_lsn: event.commit_lsn,
            error: dead_letter.map(str::to_owned),
        };
        let waiting = match self.inner.shared.queue.lock() {
            Ok(mut q) if q.len() < QUEUE => {
                q.push(finished);
                q.len()
            }
            // Full (the collector is slow or gone), or poisoned (the thread panicked).
            _ => {
                Metrics::inc(&self.inner.metrics.spans_dropped);
                return;
            }
        };
        if waiting == WAKE_AT {
            self.inner.exporter.unpark();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The relay is exiting: the thread sends what is queued and stops; waited for, briefly.
        self.shared.closed.store(true, Ordering::Release);
        self.exporter.unpark();
        if let Ok(done) = self.done.get_mut() {
            let _ = done.recv_timeout(EXIT_FLUSH);
        }
    }
}

/// `http://host:port` → `http://host:port/v1/traces` (OTLP/HTTP's path for traces); a URL with a
/// path of its own is used as it is.
pub fn traces_url(endpoint: &str) -> Result<String, String> {
    let url = url::Url::parse(endpoint).map_err(|e| format!("not a URL ({e})"))?;
    if url.scheme() != "http" {
        return Err(format!(
            "scheme {:?} is not supported: use http:// (a collector or agent next to the relay; TLS to a \
             remote backend is the collector's job)",
            url.scheme()
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("has no host".into());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not hold credentials (use OTEL_EXPORTER_OTLP_HEADERS)".into());
    }
    Ok(if url.path() == "/" || url.path().is_empty() {
        format!("{}/v1/traces", endpoint.trim_end_matches('/'))
    } else {
        endpoint.to_owned()
    })
}

/// A Postgres timestamp (µs since 2000-01-01 UTC) as a `SystemTime`; `None` for 0 (unknown).
fn commit_time(pg_micros: i64) -> Option<SystemTime> {
    const PG_EPOCH_UNIX_SECS: u64 = 946_684_800;
    if pg_micros == 0 {
        return None;
    }
    let epoch = UNIX_EPOCH + Duration::from_secs(PG_EPOCH_UNIX_SECS);
    if pg_micros > 0 {
        epoch.checked_add(Duration::from_micros(pg_micros as u64))
    } else {
        epoch.checked_sub(Duration::from_micros(pg_micros.unsigned_abs()))
    }
}

/// The export thread: every [`DELAY`], or when woken because [`WAKE_AT`] spans wait, it takes the
/// whole queue and sends it in batches of up to [`BATCH`]; until the relay exits.
fn export_loop(shared: &Shared, exporter: opentelemetry_otlp::SpanExporter, metrics: &Metrics) {
    let scope = InstrumentationScope::builder("outbox-relay")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let mut taken: Vec<Finished> = Vec::with_capacity(WAKE_AT);
    let mut failing = false;
    loop {
        let closed = shared.closed.load(Ordering::Acquire);
        if !closed {
            std::thread::park_timeout(DELAY);
        }
        match shared.queue.lock() {
            Ok(mut q) => std::mem::swap(&mut *q, &mut taken),
            Err(_) => return,
        }
        while !taken.is_empty() {
            let n = taken.len().min(BATCH);
            let spans: Vec<SpanData> = taken.drain(..n).map(|f| span_data(f, &scope)).collect();
            match futures_executor::block_on(exporter.export(spans)) {
                Ok(()) => {
                    Metrics::add(&metrics.spans_exported, n as u64);
                    if failing {
                        info!("trace spans are exported again");
                        failing = false;
                    }
                }
                Err(e) => {
                    Metrics::add(&metrics.spans_dropped, n as u64);
                    // Once per outage, not per batch.
                    if !failing {
                        warn!(error = %e, "the OTLP collector did not take a batch of spans; dropping spans until it does (counted in outbox_relay_spans_dropped_total)");
                        failing = true;
                    }
                }
            }
        }
        if closed {
            return;
        }
    }
}

/// The OpenTelemetry form of a finished span: PRODUCER, `send <subject>`, the messaging
/// attributes of the semantic conventions and the relay's own `outbox.commit_lsn`.
fn span_data(f: Finished, scope: &InstrumentationScope) -> SpanData {
    let s = *f.started;
    let tracestate = s
        .tracestate
        .as_deref()
        .and_then(|t| t.parse::<TraceState>().ok())
        .unwrap_or_default();
    let status = match f.error {
        Some(reason) => Status::Error {
            description: Cow::Owned(format!("dead letter: {reason}")),
        },
        None => Status::Unset,
    };
    let subject = s.subject;
    SpanData {
        span_context: SpanContext::new(
            TraceId::from(s.trace.trace_id),
            SpanId::from(s.span_id),
            TraceFlags::SAMPLED,
            false,
            tracestate,
        ),
        parent_span_id: SpanId::from(s.trace.parent_id),
        parent_span_is_remote: true,
        span_kind: SpanKind::Producer,
        name: Cow::Owned(format!("send {subject}")),
        start_time: s.start,
        // A commit time ahead of the relay's clock (skew between the hosts) must not make a
        // negative span.
        end_time: f.end.max(s.start),
        attributes: vec![
            KeyValue::new("messaging.system", "nats"),
            KeyValue::new("messaging.destination.name", subject),
            KeyValue::new("messaging.message.id", f.message_id),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("outbox.commit_lsn", f.commit_lsn.to_string()),
        ],
        dropped_attributes_count: 0,
        events: Default::default(),
        links: Default::default(),
        status,
        instrumentation_scope: scope.clone(),
    }
}
