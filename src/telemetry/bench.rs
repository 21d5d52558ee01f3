//! The export thread's two halves, the OTLP encoder (`otlp.rs`) and the HTTP client (`http.rs`),
//! reachable from `benches/otlp.rs` (feature `test-support` only): the bench weighs them against
//! `opentelemetry-proto` + prost and a client crate on the same records, so it needs the real code,
//! not a copy. The relay never builds this module.

use std::time::SystemTime;

use super::{Finished, Started, TraceParent, http, otlp};
use crate::Lsn;

/// One finished span's fields, flat, as the bench makes them; [`Batch::new`] turns them into the
/// export thread's own records.
#[derive(Debug, Clone)]
pub struct Record {
    /// The writer's trace id.
    pub trace_id: u128,
    /// The writer's span id (the relay's span's parent).
    pub parent_id: u64,
    /// The relay's span id.
    pub span_id: u64,
    /// The event's `tracestate`, when it had one.
    pub tracestate: Option<String>,
    /// The transaction's commit time.
    pub start: SystemTime,
    /// When JetStream's ack arrived.
    pub end: SystemTime,
    /// The subject the event was published to.
    pub subject: String,
    /// The event id (`Nats-Msg-Id`).
    pub message_id: String,
    /// The transaction's commit LSN.
    pub commit_lsn: u64,
    /// A dead letter's reason.
    pub error: Option<String>,
}

/// Spans as the export thread takes them from the queue.
pub struct Batch(Vec<Finished>);

impl Batch {
    /// The export thread's records of `records`.
    pub fn new(records: &[Record]) -> Batch {
        Batch(
            records
                .iter()
                .map(|r| Finished {
                    started: Box::new(Started {
                        trace: TraceParent {
                            trace_id: r.trace_id,
                            parent_id: r.parent_id,
                            flags: 1,
                        },
                        span_id: r.span_id,
                        tracestate: r.tracestate.clone(),
                        start: r.start,
                        subject: r.subject.clone(),
                    }),
                    end: r.end,
                    message_id: r.message_id.clone(),
                    commit_lsn: Lsn(r.commit_lsn),
                    error: r.error.clone(),
                })
                .collect(),
        )
    }
}

/// The export thread's encoder.
pub struct Encoder(otlp::Encoder);

impl Encoder {
    /// As the relay makes it: `service_name`, and the scope `outbox-relay`, both of `version`.
    pub fn new(service_name: &str, version: &str) -> Encoder {
        Encoder(otlp::Encoder::new(
            service_name,
            version,
            "outbox-relay",
            version,
        ))
    }

    /// The `ExportTraceServiceRequest` of `batch`, in the encoder's reused buffer.
    pub fn encode(&mut self, batch: &Batch) -> &[u8] {
        self.0.start();
        for f in &batch.0 {
            self.0.push(f);
        }
        self.0.finish()
    }
}

/// The export thread's HTTP client.
pub struct Client(http::BlockingClient);

impl Client {
    /// A client POSTing to `url` (`http://`), with the relay's timeouts.
    pub fn new(url: &str) -> Result<Client, Box<dyn std::error::Error + Send + Sync>> {
        let url = url::Url::parse(url)?;
        http::BlockingClient::new(&url, &[], super::CONNECT_TIMEOUT, super::REQUEST_TIMEOUT)
            .map(Client)
            .ok_or_else(|| format!("{url}: no host").into())
    }

    /// One request, as the export thread sends a batch.
    pub fn post(&self, body: &[u8]) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.0.post(body)
    }
}
