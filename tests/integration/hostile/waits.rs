//! Read-your-writes waits under a flood (docs/security.md, security round 5, findings 3 and 8): the
//! open waits are bounded in bytes, not only in number, and `/wait` cannot take the probes' room.
//!
//! Finding 3: 120,000 NATS waits with ~1 KB reply subjects, sent by one client in one go, grew the
//! relay by 216 MB, and the flood could be renewed every 30 s. Now such a reply subject is not an
//! inbox (over 128 bytes) and gets no answer, and waits with the longest reply subjects allowed
//! stop at the byte budget: the rest are refused at once (`reason="overloaded"`). Each flood prints
//! the relay's resident memory before and at its peak.
//!
//! Finding 8: two `/wait`s held from each of 16 loopback addresses took all 32 of the listener's
//! connections, and `/healthz` from a new address was reset. Now the waits get at most their share.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{LIMIT, http_get, metric, proc_kb, wait_http};
use crate::support::{RelayProcess, Scenario, wait_for};

/// The flood of the finding: 120,000 waits from one client.
const FLOOD: usize = 120_000;

/// A relay binary with an HTTP listener, serving its position, and what it runs against. The relay
/// is the first field: it is killed before its servers go.
struct Serving {
    relay: RelayProcess,
    client: async_nats::Client,
    addr: String,
    prefix: String,
    _servers: Scenario,
}

async fn serving() -> Serving {
    let s = Scenario::listening().await;
    let addr = s.http_addr();
    let relay = s.run_binary();
    wait_http(&addr, "/position", 200).await;
    let client = s.nats.client().await;
    let prefix = format!("outbox-relay.{}", s.slot);
    wait_for("the position service", LIMIT, || async {
        let req = async_nats::Request::new().timeout(Some(Duration::from_secs(1)));
        client
            .send_request(format!("{prefix}.position"), req)
            .await
            .is_ok()
    })
    .await;
    Serving {
        relay,
        client,
        addr,
        prefix,
        _servers: s,
    }
}

/// Sends `n` waits for an LSN far ahead (30 s each) with reply subjects made by `reply(i)`, in
/// rounds of [`ROUND`]: each round ends with one more wait on an inbox of the client's own, whose
/// answer says the relay has read every request before it. So the flood goes as fast as the relay
/// reads (a debug build reads slower than one client writes, and a subscription that falls 65,536
/// messages behind drops them).
async fn flood(
    client: &async_nats::Client,
    prefix: &str,
    n: usize,
    reply: impl Fn(usize) -> String,
) {
    let body = r#"{"lsn": "FFFF/0", "timeout_ms": 30000}"#;
    let inbox = client.new_inbox();
    let mut answers = client.subscribe(inbox.clone()).await.expect("subscribe");
    for start in (0..n).step_by(ROUND) {
        for i in start..(start + ROUND).min(n) {
            client
                .publish_with_reply(format!("{prefix}.wait"), reply(i), body.into())
                .await
                .expect("publish");
        }
        client
            .publish_with_reply(
                format!("{prefix}.wait"),
                inbox.clone(),
                r#"{"lsn": "FFFF/0", "timeout_ms": 0}"#.into(),
            )
            .await
            .expect("publish");
        tokio::time::timeout(LIMIT, answers.next())
            .await
            .expect("the round's last wait is answered")
            .expect("subscription open");
    }
    // The wait task takes the last of them a moment after the service handed them over.
    tokio::time::sleep(Duration::from_secs(3)).await;
}

/// Requests a flood sends before it waits for the relay to read them.
const ROUND: usize = 5_000;

fn refused(addr_metrics: &str, reason: &str) -> f64 {
    metric(
        addr_metrics,
        &format!("outbox_relay_position_requests_refused_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Finding 3, the flood of the finding: 120,000 waits with ~1 KB reply subjects from one client.
/// Such a reply subject is no inbox (over 128 bytes): every wait is refused and counted, and the
/// relay keeps none of them (bound: 32 MB over its resident memory before; 216 MB without the fix).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flood_of_waits_with_1_kb_reply_subjects_keeps_nothing() {
    let s = serving().await;
    let pid = s.relay.pid();
    let before = proc_kb(pid, "VmRSS");
    // Ten tokens of 99 bytes: a literal subject (a token may have at most 256).
    let long = vec!["x".repeat(99); 10].join(".");
    flood(&s.client, &s.prefix, FLOOD, |i| {
        format!("_INBOX.{long}.{i}")
    })
    .await;
    let peak = proc_kb(pid, "VmHWM");
    let (_, text) = http_get(&s.addr, "/metrics").await.expect("/metrics");
    let refused_long = refused(&text, "reply_subject");
    eprintln!(
        "waits: {FLOOD} waits with 1 KB reply subjects: {refused_long} refused; RSS before {before} kB, \
         peak {peak} kB (+{} kB)",
        peak.saturating_sub(before)
    );
    assert_eq!(
        refused_long, FLOOD as f64,
        "a reply subject of 1 KB is no inbox: every such wait is refused"
    );
    assert!(
        peak.saturating_sub(before) < 32 * 1024,
        "the refused waits keep nothing: peak {peak} kB, {before} kB before"
    );
}

/// Finding 3, the bound itself: 120,000 waits with 128-byte reply subjects (the longest an inbox
/// may have). Those that fit the open waits' byte budget wait; the rest are refused at once as
/// overloaded, and the relay's peak resident memory grows by a bounded amount (32 MB; 16 MiB is the
/// budget, charged as each wait's measured cost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_with_the_longest_inbox_stop_at_the_byte_budget() {
    let s = serving().await;
    let pid = s.relay.pid();
    let before = proc_kb(pid, "VmRSS");
    // 128 bytes: `_INBOX.`, padding, a dot and six digits.
    let pad = "y".repeat(128 - 7 - 7);
    flood(&s.client, &s.prefix, FLOOD, |i| {
        format!("_INBOX.{pad}.{i:06}")
    })
    .await;
    let peak = proc_kb(pid, "VmHWM");
    let (_, text) = http_get(&s.addr, "/metrics").await.expect("/metrics");
    let overloaded = refused(&text, "overloaded");
    let open = FLOOD as f64 - overloaded;
    eprintln!(
        "waits: {FLOOD} waits with 128-byte reply subjects: {overloaded} refused as overloaded, {open} \
         open; RSS before {before} kB, peak {peak} kB (+{} kB, {:.0} bytes an open wait)",
        peak.saturating_sub(before),
        peak.saturating_sub(before) as f64 * 1024.0 / open.max(1.0)
    );
    assert!(
        overloaded > (FLOOD / 2) as f64,
        "waits beyond the byte budget are refused at once: {overloaded} of {FLOOD}"
    );
    assert!(
        peak.saturating_sub(before) < 32 * 1024,
        "the open waits' memory is bounded: peak {peak} kB, {before} kB before"
    );
}

/// A TCP connection to `target` from the loopback address `from` (Linux routes all of 127/8 to lo).
async fn connect_from(
    from: std::net::IpAddr,
    target: std::net::SocketAddr,
) -> std::io::Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::new(from, 0))?;
    socket.connect(target).await
}

/// Finding 8: two `/wait`s from each of 16 loopback addresses (127.0.0.2 to 127.0.0.17), each
/// held for 30 s. Every loopback address is one peer for waits, so all but a few are answered 503
/// at once, and `/healthz` from a new address (127.0.0.200) answers 200, three times of three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_from_many_loopback_addresses_leave_room_for_probes() {
    let s = serving().await;
    let addr = &s.addr;
    let target: std::net::SocketAddr = addr.parse().expect("listen address");
    let mut held = Vec::new();
    let mut refused_at_once = 0;
    for i in 2..18u8 {
        for _ in 0..2 {
            let from = std::net::IpAddr::from([127, 0, 0, i]);
            let Ok(mut s) = connect_from(from, target).await else {
                continue;
            };
            if s.write_all(b"GET /wait?lsn=FFFF/0&timeout_ms=30000 HTTP/1.0\r\nHost: x\r\n\r\n")
                .await
                .is_err()
            {
                continue;
            }
            let mut head = [0u8; 12];
            // A refused wait is answered at once; a held one says nothing for 30 s.
            match tokio::time::timeout(Duration::from_millis(500), s.read_exact(&mut head)).await {
                Ok(Ok(_)) if head.ends_with(b"503") => refused_at_once += 1,
                Err(_) => held.push(s),
                other => panic!(
                    "a wait from {from}: {other:?} {:?}",
                    String::from_utf8_lossy(&head)
                ),
            }
        }
    }
    let mut answers = Vec::new();
    for _ in 0..3 {
        let probe = async {
            let mut s = connect_from(std::net::IpAddr::from([127, 0, 0, 200]), target).await?;
            s.write_all(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
                .await?;
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await?;
            Ok::<_, std::io::Error>(String::from_utf8_lossy(&buf).into_owned())
        };
        answers.push(
            match tokio::time::timeout(Duration::from_secs(5), probe).await {
                Ok(Ok(text)) => text.lines().next().unwrap_or("(empty)").to_owned(),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no answer within 5 s".into(),
            },
        );
    }
    eprintln!(
        "http: {} waits held, {refused_at_once} refused at once; /healthz from 127.0.0.200: {answers:?}",
        held.len()
    );
    assert!(
        answers.iter().all(|a| a.contains(" 200 ")),
        "/healthz from a new address while waits are held: {answers:?}"
    );
    assert!(
        held.len() <= 4,
        "loopback is one peer for waits: {} held",
        held.len()
    );
    let (_, text) = http_get(addr, "/metrics").await.expect("/metrics");
    assert_eq!(refused(&text, "overloaded"), refused_at_once as f64);
    drop(held);
}
