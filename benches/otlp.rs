//! The span exporter's hand-written code weighed against crates, in one run at 100 % sampling:
//! every event has a span, and the export thread sends them in requests of 420 spans (what a
//! drain at full rate gives: `telemetry::WAKE_AT` spans split in `BATCH`-sized requests).
//!
//! Encoding, ns and allocations per span, on the same records:
//!
//! - `hand`: the relay's encoder (src/telemetry/otlp.rs), writing the protobuf into one reused
//!   buffer;
//! - `prost`: `opentelemetry-proto`'s `ExportTraceServiceRequest` built from the records (no SDK:
//!   one resource, one scope, the spans' fields and five string attributes, as the relay writes
//!   them), then `prost::Message::encode` into a reused `Vec`;
//! - `prost-reuse`: the same structs kept from one request to the next and overwritten in place
//!   (strings cleared and refilled), the least a prost encoder can allocate.
//!
//! The three must give the same bytes (checked before anything is timed).
//!
//! Times are the timing thread's CPU (`CLOCK_THREAD_CPUTIME_ID`: user and system, so a busy machine
//! does not inflate them) and the wall clock, per span.
//!
//! HTTP, ns and allocations per span, one POST of a 420-span request to a loopback listener in this
//! process (which reads the request and answers `200` with an empty body):
//!
//! - `hand`: the relay's client (src/telemetry/http.rs): a new connection per request;
//! - `ureq`: ureq 3 without default features, one `Agent` per round, so its connection is kept
//!   alive between requests as it would be on the export thread.
//!
//! The records are realistic: subjects `outbox.<Type>`, a uuid event id, half of them with a
//! `tracestate`, one in 500 a dead letter with a reason. Allocations come from `dhat` as the
//! global allocator in a separate counted pass (as benches/decode.rs); the timed rounds run after
//! the profiler is dropped and alternate the variants, so a busy machine slows them alike; medians
//! are printed with the load average at the start and the end, and one JSON line.
//!
//! `cargo bench --bench otlp`; under `cargo test --benches` (no `--bench` argument) it runs one
//! small round as a smoke test (the byte comparison included).

use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{
    AnyValue, InstrumentationScope, KeyValue, any_value::Value,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status};
use outbox_relay::Lsn;
use outbox_relay::telemetry_bench::{Batch, Client, Encoder, Record};
use prost::Message;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// Spans per request.
const PER_REQUEST: usize = 420;
const SERVICE: &str = "orders-relay";
const VERSION: &str = "0.9.0";
/// `Span.flags` as the relay writes them: sampled, "is-remote is known", the parent is remote.
const SPAN_FLAGS: u32 = 0x301;
const KIND_PRODUCER: i32 = 4;
const STATUS_ERROR: i32 = 2;
const TYPES: [&str; 4] = ["Order", "Invoice", "Shipment", "Customer"];

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn record(i: u64) -> Record {
    let commit = UNIX_EPOCH + Duration::from_nanos(1_765_000_000_000_000_000 + i * 25_000);
    let dead = i % 500 == 499;
    Record {
        trace_id: u128::from(splitmix(i)) << 64 | u128::from(splitmix(i + 1)),
        parent_id: splitmix(i + 2) | 1,
        span_id: splitmix(i + 3) | 1,
        tracestate: i.is_multiple_of(2).then(|| "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7".to_owned()),
        start: commit,
        end: commit + Duration::from_micros(1_200 + (splitmix(i + 4) % 3_000)),
        subject: if dead {
            "outbox_dead_letter".to_owned()
        } else {
            format!("outbox.{}", TYPES[(i % 4) as usize])
        },
        message_id: format!("0190a5b2-7c3d-7e4f-8a9b-{i:012x}"),
        commit_lsn: 0x16_B374_D848 + i * 0x1C8,
        error: dead.then(|| {
            "payload does not match outbox.schemas/Order.json: /total_cents: \"12\" is not of type \"integer\"".to_owned()
        }),
    }
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn kv(key: &str, value: String) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(Value::StringValue(value)),
        }),
        ..Default::default()
    }
}

/// `prost`: a fresh request of `records`, as a straightforward encoder on the crate would build it.
fn request(records: &[Record]) -> ExportTraceServiceRequest {
    let spans = records
        .iter()
        .map(|r| {
            let start = unix_nanos(r.start);
            let mut name = String::with_capacity(5 + r.subject.len());
            name.push_str("send ");
            name.push_str(&r.subject);
            Span {
                trace_id: r.trace_id.to_be_bytes().to_vec(),
                span_id: r.span_id.to_be_bytes().to_vec(),
                // The relay's encoder checks and normalizes it (W3C rules); these are valid and
                // normal already, so the copy is all this side pays for.
                trace_state: r.tracestate.clone().unwrap_or_default(),
                parent_span_id: r.parent_id.to_be_bytes().to_vec(),
                flags: SPAN_FLAGS,
                name,
                kind: KIND_PRODUCER,
                start_time_unix_nano: start,
                end_time_unix_nano: unix_nanos(r.end).max(start),
                attributes: vec![
                    kv("messaging.system", "nats".to_owned()),
                    kv("messaging.destination.name", r.subject.clone()),
                    kv("messaging.message.id", r.message_id.clone()),
                    kv("messaging.operation.type", "send".to_owned()),
                    kv("outbox.commit_lsn", Lsn(r.commit_lsn).to_string()),
                ],
                status: r.error.as_ref().map(|e| Status {
                    message: format!("dead letter: {e}"),
                    code: STATUS_ERROR,
                }),
                ..Default::default()
            }
        })
        .collect();
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![
                    kv("service.name", SERVICE.to_owned()),
                    kv("service.version", VERSION.to_owned()),
                ],
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "outbox-relay".to_owned(),
                    version: VERSION.to_owned(),
                    ..Default::default()
                }),
                spans,
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// `prost-reuse`: one request kept between batches; each span's fields overwritten in place.
struct Reused {
    req: ExportTraceServiceRequest,
}

fn set(s: &mut String, parts: &[&str]) {
    s.clear();
    for p in parts {
        s.push_str(p);
    }
}

fn set_attr(kv: &mut KeyValue, value: &str) {
    match kv.value.as_mut().and_then(|v| v.value.as_mut()) {
        Some(Value::StringValue(s)) => set(s, &[value]),
        _ => unreachable!("built as strings"),
    }
}

impl Reused {
    fn new() -> Reused {
        let mut req = request(&[]);
        req.resource_spans[0].scope_spans[0].spans = Vec::new();
        Reused { req }
    }

    fn fill(&mut self, records: &[Record]) -> &ExportTraceServiceRequest {
        let spans = &mut self.req.resource_spans[0].scope_spans[0].spans;
        spans.truncate(records.len());
        while spans.len() < records.len() {
            spans.push(request(&records[..1]).resource_spans[0].scope_spans[0].spans[0].clone());
        }
        for (s, r) in spans.iter_mut().zip(records) {
            s.trace_id.clear();
            s.trace_id.extend_from_slice(&r.trace_id.to_be_bytes());
            s.span_id.clear();
            s.span_id.extend_from_slice(&r.span_id.to_be_bytes());
            set(&mut s.trace_state, &[r.tracestate.as_deref().unwrap_or("")]);
            s.parent_span_id.clear();
            s.parent_span_id
                .extend_from_slice(&r.parent_id.to_be_bytes());
            set(&mut s.name, &["send ", &r.subject]);
            let start = unix_nanos(r.start);
            s.start_time_unix_nano = start;
            s.end_time_unix_nano = unix_nanos(r.end).max(start);
            set_attr(&mut s.attributes[1], &r.subject);
            set_attr(&mut s.attributes[2], &r.message_id);
            let lsn = &mut s.attributes[4];
            match lsn.value.as_mut().and_then(|v| v.value.as_mut()) {
                Some(Value::StringValue(t)) => {
                    t.clear();
                    std::fmt::Write::write_fmt(t, format_args!("{}", Lsn(r.commit_lsn)))
                        .expect("a String");
                }
                _ => unreachable!("built as strings"),
            }
            match (&r.error, &mut s.status) {
                (None, status) => *status = None,
                (Some(e), Some(st)) => set(&mut st.message, &["dead letter: ", e]),
                (Some(e), status) => {
                    *status = Some(Status {
                        message: format!("dead letter: {e}"),
                        code: STATUS_ERROR,
                    })
                }
            }
        }
        &self.req
    }
}

#[derive(Clone, Copy)]
enum Enc {
    Hand,
    Prost,
    ProstReuse,
}

const ENCODERS: [(Enc, &str); 3] = [
    (Enc::Hand, "hand"),
    (Enc::Prost, "prost"),
    (Enc::ProstReuse, "prost-reuse"),
];

struct Encoders {
    hand: Encoder,
    buf: Vec<u8>,
    reused: Reused,
}

impl Encoders {
    /// Encodes every request once with `enc`; returns the bytes written.
    fn run(&mut self, enc: Enc, records: &[Record], batches: &[Batch]) -> usize {
        let mut bytes = 0;
        for (chunk, batch) in records.chunks(PER_REQUEST).zip(batches) {
            bytes += black_box(self.one(enc, chunk, batch)).len();
        }
        bytes
    }

    fn one(&mut self, enc: Enc, chunk: &[Record], batch: &Batch) -> &[u8] {
        match enc {
            Enc::Hand => self.hand.encode(batch),
            Enc::Prost => {
                self.buf.clear();
                request(chunk).encode(&mut self.buf).expect("a Vec grows");
                &self.buf
            }
            Enc::ProstReuse => {
                self.buf.clear();
                self.reused
                    .fill(chunk)
                    .encode(&mut self.buf)
                    .expect("a Vec grows");
                &self.buf
            }
        }
    }
}

/// The loopback collector: reads each request whole (`Content-Length`) and answers `200` with an
/// empty body; keeps the connection for the next request unless asked to close it. One connection
/// at a time, one reused buffer: nothing it does allocates per request.
fn collector() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 256 << 10];
        for mut s in listener.incoming().flatten() {
            let _ = s.set_nodelay(true);
            serve(&mut s, &mut buf);
        }
    });
    format!("http://{addr}/v1/traces")
}

fn serve(s: &mut TcpStream, buf: &mut [u8]) {
    let mut filled = 0;
    loop {
        let end = loop {
            if let Some(p) = buf[..filled].windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            match s.read(&mut buf[filled..]) {
                Ok(0) | Err(_) => return,
                Ok(n) => filled += n,
            }
        };
        let head = std::str::from_utf8(&buf[..end]).unwrap_or("");
        let mut len = 0usize;
        let mut close = false;
        for line in head.split("\r\n") {
            if let Some((k, v)) = line.split_once(':') {
                if k.trim().eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap_or(0);
                } else if k.trim().eq_ignore_ascii_case("connection") {
                    close = v.trim().eq_ignore_ascii_case("close");
                }
            }
        }
        // The body is read and dropped; nothing follows it (neither client pipelines).
        let mut have = filled - end;
        while have < len {
            match s.read(&mut buf[..]) {
                Ok(0) | Err(_) => return,
                Ok(n) => have += n,
            }
        }
        let answer: &[u8] = if close {
            b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        } else {
            b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"
        };
        if s.write_all(answer).is_err() || close {
            return;
        }
        filled = 0;
    }
}

#[derive(Clone, Copy)]
enum Http {
    Hand,
    Ureq,
}

const CLIENTS: [(Http, &str); 2] = [(Http::Hand, "hand"), (Http::Ureq, "ureq")];

/// POSTs `body` `requests` times with `client`.
fn post(client: Http, url: &str, body: &[u8], requests: usize) {
    match client {
        Http::Hand => {
            let c = Client::new(url).expect("client");
            for _ in 0..requests {
                c.post(body).expect("posted");
            }
        }
        Http::Ureq => {
            // The relay's timeouts (telemetry::CONNECT_TIMEOUT, REQUEST_TIMEOUT).
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .timeout_connect(Some(Duration::from_secs(2)))
                .timeout_global(Some(Duration::from_secs(5)))
                .build()
                .into();
            for _ in 0..requests {
                let mut answer = agent
                    .post(url)
                    .header("content-type", "application/x-protobuf")
                    .send(body)
                    .expect("posted");
                // Read to the end, so the connection goes back to the pool.
                black_box(answer.body_mut().read_to_vec().expect("body"));
            }
        }
    }
}

/// This thread's CPU time (user and system).
fn cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// `f`'s CPU and wall nanoseconds, per one of `n`.
fn timed(n: f64, f: impl FnOnce()) -> (f64, f64) {
    let (c, t) = (cpu(), Instant::now());
    f();
    let wall = t.elapsed().as_nanos() as f64 / n;
    ((cpu() - c).as_nanos() as f64 / n, wall)
}

/// The medians of CPU and of wall time, each on its own.
fn medians(v: &[(f64, f64)]) -> (f64, f64) {
    let median = |mut x: Vec<f64>| {
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    (
        median(v.iter().map(|s| s.0).collect()),
        median(v.iter().map(|s| s.1).collect()),
    )
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (requests, rounds, posts) = if bench { (200, 9, 200) } else { (2, 1, 2) };
    let load_start = loadavg();

    let records: Vec<Record> = (0..(requests * PER_REQUEST) as u64).map(record).collect();
    let batches: Vec<Batch> = records.chunks(PER_REQUEST).map(Batch::new).collect();
    let spans = records.len() as f64;
    let mut encoders = Encoders {
        hand: Encoder::new(SERVICE, VERSION),
        buf: Vec::new(),
        reused: Reused::new(),
    };

    // The same bytes three ways, on every request (a reused structure must not keep anything of
    // the request before).
    for (chunk, batch) in records.chunks(PER_REQUEST).zip(&batches) {
        let hand = encoders.one(Enc::Hand, chunk, batch).to_vec();
        assert_eq!(
            ExportTraceServiceRequest::decode(&hand[..]).expect("decodes"),
            request(chunk),
            "the hand encoder's request means what prost's does"
        );
        assert_eq!(hand, encoders.one(Enc::Prost, chunk, batch), "same bytes");
        assert_eq!(
            hand,
            encoders.one(Enc::ProstReuse, chunk, batch),
            "same bytes"
        );
    }
    let body = encoders
        .one(Enc::Hand, &records[..PER_REQUEST], &batches[0])
        .to_vec();
    let url = collector();

    // Allocations: a warm-up pass, then a counted one per variant; the profiler is off before
    // anything is timed.
    let profiler = dhat::Profiler::builder().testing().build();
    let mut enc_allocs = Vec::new();
    for (enc, _) in ENCODERS {
        encoders.run(enc, &records, &batches);
        let before = dhat::HeapStats::get();
        encoders.run(enc, &records, &batches);
        let after = dhat::HeapStats::get();
        enc_allocs.push((after.total_blocks - before.total_blocks) as f64 / spans);
    }
    let mut http_allocs = Vec::new();
    for (client, _) in CLIENTS {
        post(client, &url, &body, 2);
        let before = dhat::HeapStats::get();
        post(client, &url, &body, posts);
        let after = dhat::HeapStats::get();
        http_allocs
            .push((after.total_blocks - before.total_blocks) as f64 / (posts * PER_REQUEST) as f64);
    }
    drop(profiler);

    // Per variant: (CPU, wall) ns per span of each round. CPU is the timing thread's own (user and
    // system), which other processes' load does not inflate; the collector's thread is not in it.
    let mut enc_ns: Vec<Vec<(f64, f64)>> = vec![Vec::new(); ENCODERS.len()];
    let mut http_ns: Vec<Vec<(f64, f64)>> = vec![Vec::new(); CLIENTS.len()];
    for _ in 0..rounds {
        for (k, (enc, _)) in ENCODERS.into_iter().enumerate() {
            enc_ns[k].push(timed(spans, || {
                encoders.run(enc, &records, &batches);
            }));
        }
        for (k, (client, _)) in CLIENTS.into_iter().enumerate() {
            http_ns[k].push(timed((posts * PER_REQUEST) as f64, || {
                post(client, &url, &body, posts)
            }));
        }
    }
    let load_end = loadavg();

    println!(
        "otlp bench: {requests} requests of {PER_REQUEST} spans ({} bytes each), {rounds} rounds, median; load average {load_start} -> {load_end}",
        body.len()
    );
    let mut json = Vec::new();
    let mut table = |title: &str, names: &[&str], ns: &[Vec<(f64, f64)>], allocs: &[f64]| {
        println!(
            "{title:<20} {:>12} {:>13} {:>12} {:>12}",
            "cpu ns/span", "wall ns/span", "allocs/span", "cpu vs hand"
        );
        let m: Vec<(f64, f64)> = ns.iter().map(|v| medians(v)).collect();
        for (k, name) in names.iter().enumerate() {
            println!(
                "{name:<20} {:>12.1} {:>13.1} {:>12.3} {:>11.2}x",
                m[k].0,
                m[k].1,
                allocs[k],
                m[k].0 / m[0].0
            );
            json.push(format!(
                r#""{}_{name}":{{"cpu_ns_per_span":{:.1},"wall_ns_per_span":{:.1},"allocs_per_span":{:.3}}}"#,
                title.split_whitespace().next().unwrap_or(title),
                m[k].0,
                m[k].1,
                allocs[k]
            ));
        }
    };
    table("encode", &ENCODERS.map(|e| e.1), &enc_ns, &enc_allocs);
    table(
        "http (420/request)",
        &CLIENTS.map(|c| c.1),
        &http_ns,
        &http_allocs,
    );
    println!(
        r#"{{"bench":"otlp","spans_per_request":{PER_REQUEST},"load_start":"{load_start}","load_end":"{load_end}",{}}}"#,
        json.join(",")
    );
}
