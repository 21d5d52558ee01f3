//! `[telemetry]`: one OpenTelemetry PRODUCER span per event whose writer sampled its trace
//! (docs/tracing.md), exported over OTLP/HTTP (protobuf).
//!
//! The span runs from the transaction's commit to JetStream's ack, its parent is the writer's span
//! (the event's `traceparent`), and the published message's `traceparent` names it, so a consumer's
//! span becomes its child. The sink calls [`Telemetry::begin`] when it publishes an event and
//! [`Telemetry::end`] when it settles it; both run on the relay's one thread and cost a few small
//! allocations and one push under an uncontended mutex. Everything else happens on the export
//! thread: writing the batch's OTLP protobuf straight from the relay's records into one reusable
//! buffer (`otlp.rs`, no OpenTelemetry SDK: its per-span conversion was most of a span's cost) and
//! the HTTP request (`http.rs`, a small blocking client, so the export needs no runtime of its own).
//!
//! Never in the way: the queue between the two is bounded ([`QUEUE`]); a span that finds it full,
//! or whose batch the collector refuses, does not answer, or answers with an error, is dropped and
//! counted. The queue is a vector under a mutex that the export thread empties in one swap, and the
//! relay wakes that thread once per [`WAKE_AT`] spans, not per span: a channel whose receiver waits
//! costs a futex wake-up and a context switch for every span, which measured as most of a span's
//! cost on two cores (docs/performance.md) (`outbox_relay_spans_dropped_total`). A hanging collector holds the export thread for at
//! most the request timeout, never the relay. Without `telemetry.otlp_endpoint` there is no
//! [`Telemetry`] at all: the sink's `Option` is `None` and the hot path pays one branch.
//! An endpoint the configuration refuses, or an exporter that cannot start, is an [`EndpointError`]
//! or a [`StartError`] (`error.rs`).

#[cfg(feature = "test-support")]
pub mod bench;
mod error;
mod http;
mod otlp;
pub(crate) mod traceparent;

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};
use std::thread::Thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::HeaderMap;
use tracing::{info, warn};

use crate::Lsn;
use crate::metrics::Metrics;
pub(crate) use error::{EndpointError, StartError};
pub(crate) use traceparent::{TRACEPARENT, TRACESTATE, TraceParent};

/// Finished spans waiting for the export thread; more are dropped and counted.
pub(crate) const QUEUE: usize = 4096;
/// The relay wakes the export thread when this many spans wait (else it wakes every [`DELAY`]).
pub(crate) const WAKE_AT: usize = 1024;
/// The most spans in one export request.
pub(crate) const BATCH: usize = 512;
/// How long a span waits at most before the export thread looks at the queue.
pub(crate) const DELAY: Duration = Duration::from_millis(500);
/// Connecting to the collector, and the whole request: a collector that does not answer in time
/// costs the spans of that batch, nothing else.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// See [`CONNECT_TIMEOUT`].
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the relay's exit waits for the spans still queued to be sent.
const EXIT_FLUSH: Duration = Duration::from_secs(2);

/// The exporter of one relay process; cheap to clone (the sink of every session holds one).
#[derive(Clone)]
pub(crate) struct Telemetry {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    /// The export thread, to wake when [`WAKE_AT`] spans wait, and on exit.
    exporter: Thread,
    ids: SpanIds,
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
pub(crate) struct Started {
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
    pub(crate) fn start(
        endpoint: &str,
        service_name: &str,
        dead_letter_subject: &str,
        metrics: Arc<Metrics>,
    ) -> Result<Telemetry, StartError> {
        let url = traces_url(endpoint)?;
        let parsed = url::Url::parse(&url).map_err(|error| StartError::Url {
            endpoint: endpoint.to_owned(),
            error,
        })?;
        let headers = env_headers();
        let client = http::BlockingClient::new(&parsed, &headers, CONNECT_TIMEOUT, REQUEST_TIMEOUT)
            .ok_or_else(|| StartError::NoHost {
                endpoint: endpoint.to_owned(),
            })?;
        let encoder = otlp::Encoder::new(
            service_name,
            env!("CARGO_PKG_VERSION"),
            "outbox-relay",
            env!("CARGO_PKG_VERSION"),
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
                export_loop(&thread_shared, encoder, &client, &thread_metrics);
                let _ = done_tx.send(());
            })
            .map_err(StartError::Thread)?;
        info!(endpoint = %url, "exporting trace spans over OTLP/HTTP");
        Ok(Telemetry {
            inner: Arc::new(Inner {
                shared,
                exporter: handle.thread().clone(),
                ids: SpanIds::new(),
                metrics,
                dead_letter_subject: dead_letter_subject.to_owned(),
                done: Mutex::new(done),
            }),
        })
    }

    /// Starts the span of an event whose own headers are `own`, published as a message with the
    /// headers `out` to `subject`, when its `traceparent` is valid and sampled: from now on the
    /// event's and the message's `traceparent` name the relay's span (so a dead letter or a
    /// republish of it does too). `commit_ts` (the transaction's commit time, 0 when unknown) is
    /// the span's start. Anything else passes through unchanged.
    pub(crate) fn begin(
        &self,
        own: &mut [(String, String)],
        commit_ts: i64,
        out: &mut HeaderMap,
        subject: &str,
    ) -> Option<Box<Started>> {
        let (i, trace) = own
            .iter()
            .enumerate()
            .find(|(_, (k, _))| k.eq_ignore_ascii_case(TRACEPARENT))
            .and_then(|(i, (_, v))| Some((i, TraceParent::parse(v)?)))?;
        if !trace.sampled() {
            return None;
        }
        let span_id = self.inner.ids.next();
        let child = trace.child(span_id);
        let header = &mut own[i];
        if out.get(header.0.as_str()).is_some() {
            out.insert(header.0.as_str(), child.as_str());
        }
        header.1 = child;
        let tracestate = own
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(TRACESTATE))
            .map(|(_, v)| v.clone());
        Some(Box::new(Started {
            trace,
            span_id,
            tracestate,
            start: commit_time(commit_ts).unwrap_or_else(SystemTime::now),
            subject: subject.to_owned(),
        }))
    }

    /// Ends `started` now (the ack of the event with the message id `message_id`, committed at
    /// `commit_lsn`, arrived): `dead_letter` is the reason when the event went to the dead-letter
    /// subject. Queued for export, or dropped and counted.
    pub(crate) fn end(
        &self,
        mut started: Box<Started>,
        message_id: &str,
        commit_lsn: Lsn,
        dead_letter: Option<&str>,
    ) {
        if dead_letter.is_some() {
            // It may have been refused after it was sent, and republished as a dead letter.
            started.subject = self.inner.dead_letter_subject.clone();
        }
        let finished = Finished {
            started,
            end: SystemTime::now(),
            message_id: message_id.to_owned(),
            commit_lsn,
            error: dead_letter.map(str::to_owned),
        };
        let waiting = match self.inner.shared.queue.lock() {
            Ok(mut q) if q.len() < QUEUE => {
                q.push(finished);
                q.len()
            }
            // Full (the collector is slow or gone), or poisoned (the thread panicked).
            _ => {
                self.inner.metrics.spans_dropped.inc();
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
pub(crate) fn traces_url(endpoint: &str) -> Result<String, EndpointError> {
    let url = url::Url::parse(endpoint).map_err(EndpointError::NotUrl)?;
    if url.scheme() != "http" {
        return Err(EndpointError::Scheme(url.scheme().to_owned()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(EndpointError::NoHost);
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(EndpointError::Credentials);
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

/// Span ids: unique within the process (a bijective mix of a counter never repeats and is zero
/// for exactly one counter value, which is skipped), unpredictable enough across processes (the
/// counter starts at a per-process random value: std's `RandomState` keys come from the OS). No
/// lock: one atomic add per span.
struct SpanIds(AtomicU64);

impl SpanIds {
    fn new() -> SpanIds {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        SpanIds(AtomicU64::new(h.finish()))
    }

    /// The next span id, never zero (W3C Trace Context: an all-zero id is invalid).
    fn next(&self) -> u64 {
        loop {
            let id = splitmix64(self.0.fetch_add(GOLDEN_GAMMA, Ordering::Relaxed));
            if id != 0 {
                return id;
            }
        }
    }
}

/// SplitMix64's increment: odd, so the counter visits every u64 before it repeats.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function, a bijection on u64 that scatters consecutive counters.
fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Extra request headers from `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, else
/// `OTEL_EXPORTER_OTLP_HEADERS` (the OpenTelemetry exporter's variables, e.g. a collector's API
/// key): `key1=value1,key2=value2`, values percent-decoded.
fn env_headers() -> Vec<(String, String)> {
    std::env::var("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_HEADERS"))
        .map(|v| parse_headers(&v))
        .unwrap_or_default()
}

/// See [`env_headers`]. Names are lower-cased and a later one replaces an earlier one of the same
/// name, as an HTTP header map would; a pair that is not a valid header (a name that is not an
/// HTTP token, a value with control or non-ASCII characters) is left out rather than written raw
/// into the request, and so are the headers the client sets itself.
fn parse_headers(input: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for pair in input.split_terminator(',').map(str::trim) {
        let Some((name, value)) = pair.split_once('=') else {
            continue;
        };
        let name = name.trim().to_ascii_lowercase();
        let raw = value.trim();
        let value = percent_encoding::percent_decode_str(raw)
            .decode_utf8()
            .map_or_else(|_| raw.to_owned(), |v| v.into_owned());
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        let visible = |b: u8| (0x20..0x7F).contains(&b) || b == b'\t';
        if name.is_empty()
            || value.is_empty()
            || !name.bytes().all(token)
            || !value.bytes().all(visible)
            || matches!(
                name.as_str(),
                "host" | "content-length" | "content-type" | "connection" | "transfer-encoding"
            )
        {
            continue;
        }
        out.retain(|(n, _)| *n != name);
        out.push((name, value));
    }
    out
}

/// The export thread: every [`DELAY`], or when woken because [`WAKE_AT`] spans wait, it takes the
/// whole queue and sends it in batches of up to [`BATCH`]; until the relay exits.
fn export_loop(
    shared: &Shared,
    mut encoder: otlp::Encoder,
    client: &http::BlockingClient,
    metrics: &Metrics,
) {
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
            encoder.start();
            for f in taken.drain(..n) {
                encoder.push(&f);
            }
            match client.post(encoder.finish()) {
                Ok(()) => {
                    metrics.spans_exported.add(n as u64);
                    if failing {
                        info!("trace spans are exported again");
                        failing = false;
                    }
                }
                Err(e) => {
                    metrics.spans_dropped.add(n as u64);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_ids_are_non_zero_and_distinct() {
        let ids = SpanIds::new();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..100_000 {
            let id = ids.next();
            assert_ne!(id, 0);
            assert!(seen.insert(id), "repeated {id:x}");
        }
        // The one counter value that mixes to zero is skipped.
        let zero = SpanIds(AtomicU64::new(0));
        assert_ne!(zero.next(), 0);
    }

    #[test]
    fn otel_headers_as_the_exporter_read_them() {
        assert_eq!(
            parse_headers(
                " API-Key = a%20b ,x-tenant=7,,bad name=1,empty=,x-tenant=8,host=evil,ctl=%0A"
            ),
            [
                ("api-key".to_owned(), "a b".to_owned()),
                ("x-tenant".to_owned(), "8".to_owned()),
            ]
        );
        assert!(parse_headers("").is_empty());
    }
}
