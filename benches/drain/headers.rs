//! What each header costs nats-server: the relay's messages (a 131-byte payload to `outbox.Order`)
//! published by the `sink core` publisher ([`sink::publish_core`]: core publishes with a reply
//! subject on one ack inbox, the relay's window in flight, each ack checked in order), to a fresh
//! nats-server and stream per variant, with a growing header set: none; `Nats-Msg-Id`; + the
//! fence's `Nats-Expected-Last-Sequence`; + `Outbox-Position` (the least the relay's own resume
//! needs); + the rest of the relay's `Outbox-*` headers (what the relay sends by default); + the CloudEvents headers (`nats.cloudevents`); and the relay's set again on a stream
//! whose duplicate window is 1 h instead of the relay's default 2 min. Per event: nats-server's CPU
//! (utime+stime of its pid) and the publisher thread's (building the headers, the client, the ack
//! reader), from the first publish to the last ack; events/s; and the header block's bytes.
//!
//! The headers are built with the relay's own functions ([`message::build`],
//! [`message::stamp_position`]) from an event like the bench's rows, so a header the relay adds or
//! lengthens shows up here. The duplicate window: nats-server keeps every `Nats-Msg-Id` of the
//! window in a map and purges the expired ones on a timer, so within a run shorter than 2 minutes
//! (100k events take a few seconds) both windows do the same work; past that, a 1 h window holds
//! rate × 3600 ids instead of rate × 120. Raise `BENCH_HEADER_EVENTS` until a variant runs past
//! 2 minutes to see the purging and the memory (the peak RSS column).
//!
//! `BENCH_HEADERS=1` adds this to a run, `BENCH_HEADERS_ONLY=1` runs nothing else (no Postgres is
//! started); `BENCH_HEADER_EVENTS` (100000) per variant and round, `BENCH_ROUNDS` (3) rounds, the
//! variants one after the other within each round.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::HeaderValue;
use bytes::Bytes;
use outbox_relay::Lsn;
use outbox_relay::event::{JSON_CONTENT_TYPE, OutboxEvent};
use outbox_relay::message::{self, CloudEvents};
use outbox_relay::position::Position;
use outbox_relay::route::SubjectTemplate;
use outbox_relay::testkit::NatsServer;

use super::{STREAM, env_or, median, peak_rss_mb, shapes, sink};

/// Which headers a variant sends; each set holds the one before it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Set {
    None,
    MsgId,
    Fence,
    /// `Nats-Msg-Id`, the fence and `Outbox-Position`: what the relay's own resume needs.
    Position,
    Outbox,
    CloudEvents,
}

struct Variant {
    label: &'static str,
    set: Set,
    window: Duration,
    /// The variant its difference is taken against (the window variant against the same headers
    /// at 2 min, not against the CloudEvents one listed before it).
    base: Option<usize>,
}

fn variants() -> Vec<Variant> {
    let min2 = Duration::from_secs(120);
    vec![
        Variant {
            label: "no headers",
            set: Set::None,
            window: min2,
            base: None,
        },
        Variant {
            label: "Nats-Msg-Id",
            set: Set::MsgId,
            window: min2,
            base: Some(0),
        },
        Variant {
            label: "+ fence",
            set: Set::Fence,
            window: min2,
            base: Some(1),
        },
        Variant {
            label: "+ Outbox-Position",
            set: Set::Position,
            window: min2,
            base: Some(2),
        },
        Variant {
            label: "+ Outbox-* (relay)",
            set: Set::Outbox,
            window: min2,
            base: Some(3),
        },
        Variant {
            label: "+ CloudEvents",
            set: Set::CloudEvents,
            window: min2,
            base: Some(4),
        },
        Variant {
            label: "relay, window 1 h",
            set: Set::Outbox,
            window: Duration::from_secs(3600),
            base: Some(4),
        },
    ]
}

/// Builds message `i`'s headers of one set the way the relay's sink does for the bench's rows:
/// event `i` is the only insert of a transaction committed at a growing LSN.
struct Headers {
    set: Set,
    event: OutboxEvent,
    template: SubjectTemplate,
    cloudevents: CloudEvents,
    /// `SYSTEM/TIMELINE/SLOT` as a session names it (a 19-digit system id, the default slot).
    history: String,
}

impl Headers {
    fn new(set: Set, payload: Bytes) -> anyhow::Result<Headers> {
        Ok(Headers {
            set,
            event: OutboxEvent {
                id: None,
                aggregate_type: Some("Order".into()),
                aggregate_id: None,
                event_type: Some("OrderPlaced".into()),
                payload,
                headers: Vec::new(),
                commit_lsn: Lsn(0),
                index: 0,
                position: Position::in_transaction(Lsn(0), 0),
                // 2026-12-02 09:30 UTC in µs since 2000-01-01: a commit time as Begin carries it.
                commit_ts: 849_519_000_000_000,
                original_commit_ts: None,
                problem: None,
                msg_id: String::new(),
                content_type: Some(JSON_CONTENT_TYPE),
                data_schema: None,
                schema_check: None,
            },
            template: SubjectTemplate::parse("outbox.{aggregate_type}")?,
            cloudevents: CloudEvents::new("outbox-relay"),
            history: "7441234567890123456/1/outbox_relay".into(),
        })
    }

    fn id(i: u64) -> String {
        format!("00000000-0000-4000-8000-{i:012x}")
    }

    /// The fence's expectation: message `i` (0-based) follows sequence `i` of a stream that started
    /// empty.
    fn fence(h: &mut HeaderMap, i: u64) {
        h.insert(
            message::EXPECTED_LAST_SEQUENCE,
            HeaderValue::from(itoa::Buffer::new().format(i)),
        );
    }

    fn of(&mut self, i: u64) -> HeaderMap {
        match self.set {
            Set::None => HeaderMap::new(),
            Set::MsgId | Set::Fence | Set::Position => {
                let mut h = HeaderMap::new();
                h.insert(message::NATS_MSG_ID, HeaderValue::from(Self::id(i)));
                if self.set != Set::MsgId {
                    Self::fence(&mut h, i);
                }
                if self.set == Set::Position {
                    let e = &mut self.event;
                    e.commit_lsn = Lsn(0x1A00_0000 + i * 520);
                    e.position = Position::in_transaction(e.commit_lsn, 0);
                    message::stamp_position(&mut h, e, Some(&self.history));
                }
                h
            }
            Set::Outbox | Set::CloudEvents => {
                let e = &mut self.event;
                e.msg_id = Self::id(i);
                e.aggregate_id = Some(format!("order-{}", i + 1));
                e.commit_lsn = Lsn(0x1A00_0000 + i * 520);
                e.position = Position::in_transaction(e.commit_lsn, 0);
                let ce = (self.set == Set::CloudEvents).then_some(&self.cloudevents);
                let mut h = message::build(e, &self.template, "outbox_dead_letter", ce).headers;
                message::stamp_position(&mut h, e, Some(&self.history));
                Self::fence(&mut h, i);
                h
            }
        }
    }
}

/// The relay's default headers for message `i` (the `+ Outbox-* (relay)` variant, the fence
/// included), for the sections that publish the relay's exact messages.
pub(crate) fn relay_default(payload: Bytes) -> anyhow::Result<impl FnMut(u64) -> HeaderMap + Send> {
    let mut h = Headers::new(Set::Outbox, payload)?;
    Ok(move |i| h.of(i))
}

/// Bytes of the header block as the client writes it (`NATS/1.0\r\n`, `name: value\r\n` each,
/// `\r\n`); 0 for a map without headers, which goes out as a plain `PUB`.
fn block_len(h: &HeaderMap) -> usize {
    if h.is_empty() {
        return 0;
    }
    let fields: usize = h
        .iter()
        .flat_map(|(k, vs)| {
            vs.iter()
                .map(move |v| AsRef::<str>::as_ref(k).len() + 2 + v.as_str().len() + 2)
        })
        .sum();
    "NATS/1.0\r\n".len() + fields + 2
}

/// One variant's measures per round.
#[derive(Default)]
struct Rounds {
    nats_us: Vec<f64>,
    client_us: Vec<f64>,
    eps: Vec<f64>,
    nats_rss_mb: Vec<f64>,
}

/// See the module docs.
pub(crate) async fn run(rounds: usize) -> anyhow::Result<()> {
    let events: u64 = env_or("BENCH_HEADER_EVENTS", 100_000).max(1);
    // The shapes section's 120-byte jsonb, 131 bytes as Postgres prints it back.
    let payload = Bytes::from(shapes::payload_of(120));
    let variants = variants();
    let mut header_bytes = Vec::new();
    for v in &variants {
        // The mean over the run's messages (ids, LSNs and fence numbers grow), outside the timing.
        let mut b = Headers::new(v.set, payload.clone())?;
        let total: usize = (0..events).map(|i| block_len(&b.of(i))).sum();
        header_bytes.push(total as f64 / events as f64);
    }
    println!(
        "headers: {events} events of {} B per variant and round, {rounds} round(s), sink core publisher, a fresh nats-server each",
        payload.len()
    );
    let mut results: Vec<Rounds> = variants.iter().map(|_| Rounds::default()).collect();
    for r in 0..rounds {
        for (v, variant) in variants.iter().enumerate() {
            let nats = NatsServer::start();
            let mut config = sink::stream_config(STREAM);
            config.duplicate_window = variant.window;
            let mut headers = Headers::new(variant.set, payload.clone())?;
            let (p, pid) = (payload.clone(), nats.pid());
            let (run, _) = sink::on_own_thread(nats.url(), move |c| async move {
                sink::publish_core(c, config, p, events, pid, move |i| headers.of(i)).await
            })?;
            let per_event = |ms: f64| ms * 1000.0 / events as f64;
            let rss = pid.map_or(f64::NAN, peak_rss_mb);
            println!(
                "  round {} {:<19}: {:>7.0}/s, nats-server {:>5.2} µs/event, publisher {:>5.2} µs/event, nats-server peak RSS {rss:.0} MB",
                r + 1,
                variant.label,
                run.eps,
                per_event(run.server_ms),
                per_event(run.thread_ms)
            );
            let m = &mut results[v];
            m.nats_us.push(per_event(run.server_ms));
            m.client_us.push(per_event(run.thread_ms));
            m.eps.push(run.eps);
            m.nats_rss_mb.push(rss);
        }
    }
    print(events, rounds, &variants, &header_bytes, &results);
    Ok(())
}

fn print(
    events: u64,
    rounds: usize,
    variants: &[Variant],
    header_bytes: &[f64],
    results: &[Rounds],
) {
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    // Against the base in the same round, then the median: a busy moment slows both of a pair.
    let delta = |v: usize| -> Option<Vec<f64>> {
        let b = variants[v].base?;
        Some(
            results[v]
                .nats_us
                .iter()
                .zip(&results[b].nats_us)
                .map(|(x, y)| x - y)
                .collect(),
        )
    };
    println!();
    println!(
        "== what each header costs nats-server: {events} events × {rounds} round(s); medians [per round]; Δ = nats-server µs/event against the line named, same round =="
    );
    println!(
        "| {:<19} | window | hdr B | nats-server µs/event      | Δ µs/event [rounds] (vs)                 | publisher µs/event | events/s | nats RSS MB |",
        "headers"
    );
    for (v, variant) in variants.iter().enumerate() {
        let m = &results[v];
        let d = delta(v).map_or(String::new(), |d| {
            format!(
                "{:+.2} [{}] ({})",
                median(d.clone()),
                d.iter()
                    .map(|x| format!("{x:+.2}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                variants[variant.base.unwrap_or(0)].label
            )
        });
        println!(
            "| {:<19} | {:>6} | {:>5.0} | {:>5.2} [{:<17}] | {:<40} | {:>5.2} [{}] | {:>8.0} | {:>11.0} |",
            variant.label,
            window_label(variant.window),
            header_bytes[v],
            median(m.nats_us.clone()),
            list(&m.nats_us),
            d,
            median(m.client_us.clone()),
            list(&m.client_us),
            median(m.eps.clone()),
            m.nats_rss_mb.iter().copied().fold(f64::NAN, f64::max)
        );
    }
    let num = |x: f64| {
        if x.is_finite() {
            format!("{x:.2}")
        } else {
            "null".into()
        }
    };
    let rows: Vec<String> = variants
        .iter()
        .enumerate()
        .map(|(v, variant)| {
            let m = &results[v];
            format!(
                r#"{{"headers":"{}","duplicate_window_s":{},"header_bytes":{:.1},"nats_us":{},"nats_us_rounds":[{}],"delta_nats_us":{},"delta_vs":{},"publisher_us":{},"eps":{:.0},"nats_peak_rss_mb":{}}}"#,
                variant.label,
                variant.window.as_secs(),
                header_bytes[v],
                num(median(m.nats_us.clone())),
                m.nats_us.iter().map(|x| num(*x)).collect::<Vec<_>>().join(","),
                delta(v).map_or("null".into(), |d| num(median(d))),
                variant
                    .base
                    .map_or("null".into(), |b| format!("\"{}\"", variants[b].label)),
                num(median(m.client_us.clone())),
                median(m.eps.clone()),
                num(m.nats_rss_mb.iter().copied().fold(f64::NAN, f64::max))
            )
        })
        .collect();
    println!(
        r#"{{"bench":"headers","events":{events},"rounds":{rounds},"rows":[{}]}}"#,
        rows.join(",")
    );
}

fn window_label(w: Duration) -> String {
    match w.as_secs() {
        s if s % 3600 == 0 => format!("{} h", s / 3600),
        s if s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}
