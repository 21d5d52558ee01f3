//! What the relay must survive without growing or spinning: a NATS server that is up but frozen
//! (SIGSTOP) under a backlog of 1 MB events (P6: memory bounded by `nats.max_in_flight_bytes`, not
//! by the backlog), a stream that refuses new messages (`discard: new` at `max_msgs`: restarts back
//! off instead of hammering, one log line instead of one per retry), and HTTP clients that open
//! connections and never finish a request (idle, slow-loris, a flood over the connection cap, and a
//! flood from one peer while another probes).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::stream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{
    LIMIT, good, http_get, metric, proc_kb, set, text_id_db, wait_for_active_slot, wait_http,
};
use crate::faults::assert_all_stored_once_in_order_within;
use crate::ops::free_addr;
use crate::support::{
    NatsServer, RelayProcess, Scenario, relay_config, relay_env, stream_count, wait_for,
};

const MIB: u64 = 1 << 20;

/// P6 with NATS frozen: `nats.max_in_flight_bytes` = 4 MiB, nats-server SIGSTOPped, 100 events of
/// 1 MB each committed. The relay reads what its window allows and waits; its peak RSS must stay far
/// below the 100 MB backlog (under 4 MiB + 64 MiB of base). After SIGCONT every event arrives once,
/// in commit order. (The replication reader hands on at most 8 MiB of WAL ahead of the sink,
/// `MAX_BUFFERED_BYTES` in src/source/stream.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_nats_with_a_backlog_of_1_mb_events_keeps_memory_bounded() {
    frozen_nats(Some((4 + 64) * 1024)).await;
}

/// The same run judged without the memory bound: NATS frozen under a backlog of 1 MB events, the
/// relay keeps running, and after SIGCONT every event arrives once, in commit order, whole. Prints
/// the peak RSS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_nats_with_a_backlog_of_1_mb_events_loses_nothing() {
    frozen_nats(None).await;
}

async fn frozen_nats(rss_limit_kb: Option<u64>) {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let client = db.client().await;
    let js = nats.jetstream().await;
    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_NATS_MAX_IN_FLIGHT_BYTES",
        &(4 * MIB).to_string(),
    );
    // Long enough that the relay sits on its full window instead of restarting during the freeze.
    set(&mut env, "OUTBOX_RELAY_NATS_ACK_TIMEOUT_MS", "60000");
    let mut relay = RelayProcess::spawn(&["run"], &env);
    wait_for_active_slot(&client, &config.postgres.slot).await;
    good(&client, "warm-1").await;
    wait_for("the first event", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await == 1
    })
    .await;
    let base_kb = proc_kb(relay.pid(), "VmRSS");

    nats.freeze();
    // 100 transactions of one ~1 MB event each (TOAST compresses the repeat on disk; the walsender
    // sends each row whole).
    db.psql(
        "DO $$ BEGIN
           FOR i IN 1..100 LOOP
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('big-' || lpad(i::text, 4, '0'), 'Claim', i::text, 'Big',
                     jsonb_build_object('pad', repeat('x', 1000000)));
             COMMIT;
           END LOOP;
         END $$;",
    );
    // Let the relay read all it will read; sample meanwhile.
    let mut peak_rss = 0;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        peak_rss = peak_rss.max(proc_kb(relay.pid(), "VmRSS"));
    }
    let hwm = proc_kb(relay.pid(), "VmHWM");
    eprintln!(
        "P6 frozen NATS: base RSS {base_kb} kB, peak sampled RSS {peak_rss} kB, VmHWM {hwm} kB, backlog 100 MB"
    );
    nats.thaw();
    assert!(relay.is_running(), "the relay runs: {}", relay.stderr());
    let mut expected = vec!["warm-1".to_owned()];
    expected.extend((1..=100).map(|i| format!("big-{i:04}")));
    // Judged by direct gets of each sequence: an ordered consumer over 100 MB of 1 MB messages is
    // slow enough in a debug build to trip its own timeouts.
    let stream = &config.nats.stream;
    wait_for("all 101 events", Duration::from_secs(120), || async {
        stream_count(&js, stream).await >= 101
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = js.get_stream(stream).await.expect("stream");
    assert_eq!(
        stream_count(&js, stream).await,
        101,
        "each event stored once"
    );
    for (i, id) in expected.iter().enumerate() {
        let m = s
            .get_raw_message(i as u64 + 1)
            .await
            .unwrap_or_else(|e| panic!("message {}: {e}", i + 1));
        let got = m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned());
        assert_eq!(
            got.as_deref(),
            Some(id.as_str()),
            "stream order = commit order at {}",
            i + 1
        );
        if i > 0 {
            assert!(
                m.payload.len() > 1_000_000,
                "{id} whole: {} bytes",
                m.payload.len()
            );
        }
    }
    relay.signal("TERM");
    assert_eq!(
        relay.wait(Duration::from_secs(30)).and_then(|s| s.code()),
        Some(0),
        "{}",
        relay.stderr()
    );
    if let Some(limit_kb) = rss_limit_kb {
        assert!(
            hwm < limit_kb,
            "P6: peak RSS {hwm} kB with a 4 MiB window and NATS frozen (limit {limit_kb} kB, base \
             {base_kb} kB, backlog 100 MB): the relay buffers the backlog"
        );
    }
}

/// A full stream (`discard: new`, `max_msgs` reached, created by the operator before the relay, and
/// reached in the middle of a transaction): the relay keeps retrying, but with a growing backoff (well under 30 restarts in 20 s; the old
/// loop restarted about 120 times) and one "pipeline stopped" line, not one per retry. When the
/// operator raises the limit, the waiting events arrive once and in order.
#[tokio::test]
async fn full_stream_retries_back_off_and_log_once() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let client = db.client().await;
    let js = nats.jetstream().await;
    let name = config.nats.stream.clone();
    let mut cfg = stream::Config {
        name: name.clone(),
        subjects: vec!["outbox.*".into(), "outbox_dead_letter".into()],
        max_messages: 5,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    };
    js.create_stream(cfg.clone())
        .await
        .expect("create the full-to-be stream");
    let addr = free_addr();
    let mut env = relay_env(&config);
    set(&mut env, "OUTBOX_RELAY_HTTP_LISTEN", &addr);
    let mut relay = RelayProcess::spawn(&["run"], &env);
    wait_for_active_slot(&client, &config.postgres.slot).await;
    let ids: Vec<String> = (1..=8).map(|i| format!("f-{i}")).collect();
    for id in &ids[..3] {
        good(&client, id).await;
    }
    // One transaction across the limit: its first two events are stored, the third is refused, so
    // every retry replays two stored events before the refusal. Their acks must not count as
    // recovery (the old loop reset its backoff on them and restarted every ~100 ms, logging each).
    client
        .batch_execute(&format!(
            "BEGIN; {} COMMIT;",
            ids[3..]
                .iter()
                .map(|id| format!(
                    "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                     VALUES ('{id}', 'Claim', '4711', 'ClaimApproved', '{{}}');"
                ))
                .collect::<String>()
        ))
        .await
        .expect("one transaction of five events");
    wait_for("the stream to fill", LIMIT, || async {
        stream_count(&js, &name).await == 5
    })
    .await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(20)).await;
    let body = http_get(&addr, "/metrics").await.expect("/metrics").1;
    let restarts = metric(&body, "outbox_relay_reconnects_total").unwrap_or_else(|| {
        body.lines()
            .filter(|l| l.starts_with("outbox_relay_reconnects_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    });
    let stderr = relay.stderr();
    let stopped_lines = stderr.matches("pipeline stopped").count();
    eprintln!(
        "full stream: {restarts} restarts in {:?}, {stopped_lines} 'pipeline stopped' lines",
        started.elapsed()
    );
    assert!(relay.is_running(), "{stderr}");
    assert!(restarts >= 2.0, "the relay retried: {restarts}\n{stderr}");
    assert!(
        restarts < 30.0,
        "restarts back off: {restarts} in 20 s\n{stderr}"
    );
    assert_eq!(stopped_lines, 1, "one line per change of state:\n{stderr}");
    assert_eq!(stream_count(&js, &name).await, 5);

    // The operator makes room: the waiting events arrive at the next retry (≤ ~16 s away).
    cfg.max_messages = 100;
    js.update_stream(cfg).await.expect("raise max_msgs");
    assert_all_stored_once_in_order_within(&js, &name, &ids, Duration::from_secs(45)).await;
    relay.signal("TERM");
    assert_eq!(
        relay.wait(Duration::from_secs(30)).and_then(|s| s.code()),
        Some(0),
        "{}",
        relay.stderr()
    );
}

/// Reads until the server closes the connection; how long that took (panics after `max`).
async fn closed_within(mut s: TcpStream, started: Instant, max: Duration) -> Duration {
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(max.saturating_sub(started.elapsed()), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("connection still open after {max:?}"),
        }
    }
}

/// The HTTP listener against clients that never finish: an idle connection and a slow-loris (a
/// header byte a second) are closed within 15 s; 200 connections with partial headers at once are
/// cut at the cap (the ones over it closed at once), RSS hardly moves, and `/healthz` answers after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_idle_slow_loris_and_a_flood_of_partial_requests_are_cut_off() {
    let s = Scenario::listening().await;
    let addr = s.http_addr();
    let relay = s.run_binary();
    wait_http(&addr, "/healthz", 200).await;
    let max = Duration::from_secs(15);

    let idle = {
        let addr = addr.clone();
        tokio::spawn(async move {
            let s = TcpStream::connect(&addr).await.expect("connect");
            closed_within(s, Instant::now(), max).await
        })
    };
    let loris = {
        let addr = addr.clone();
        tokio::spawn(async move {
            let mut s = TcpStream::connect(&addr).await.expect("connect");
            let started = Instant::now();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("write");
            // One header byte a second, until the server hangs up.
            for b in b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                .iter()
                .cycle()
            {
                if started.elapsed() > max {
                    panic!("slow-loris connection still open after {max:?}");
                }
                if s.write_all(&[*b]).await.is_err() {
                    return started.elapsed();
                }
                let mut buf = [0u8; 256];
                match tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
                    _ => {}
                }
            }
            unreachable!()
        })
    };
    let idle = idle.await.expect("idle task");
    let loris = loris.await.expect("slow-loris task");
    eprintln!("http: idle connection closed after {idle:?}, slow-loris after {loris:?}");

    let rss_before = proc_kb(relay.pid(), "VmRSS");
    let started = Instant::now();
    let mut conns = Vec::new();
    for _ in 0..200 {
        let mut s = TcpStream::connect(&addr).await.expect("connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Partial: ")
            .await
            .expect("write");
        conns.push(s);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_during = proc_kb(relay.pid(), "VmRSS");
    // Which were closed at once (over the cap)?
    let mut closed_at_once = 0;
    let mut open = Vec::new();
    for mut s in conns {
        let mut buf = [0u8; 64];
        match tokio::time::timeout(Duration::from_millis(20), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed_at_once += 1,
            _ => open.push(s),
        }
    }
    eprintln!(
        "http flood: 200 partial requests in {:?}: {closed_at_once} closed at once, RSS {rss_before} -> {rss_during} kB",
        started.elapsed()
    );
    assert!(
        closed_at_once >= 150,
        "connections over the cap are closed at once: {closed_at_once} of 200"
    );
    assert!(
        rss_during < rss_before + 16 * 1024,
        "200 partial requests grew RSS from {rss_before} to {rss_during} kB"
    );
    // The ones under the cap are cut by the header timeout too.
    let at = Instant::now();
    for s in open {
        closed_within(s, at, max).await;
    }
    let (status, body) = http_get(&addr, "/healthz")
        .await
        .expect("/healthz after the flood");
    assert_eq!(status, 200, "{body}");
    let mut seen: HashMap<u16, usize> = HashMap::new();
    for _ in 0..5 {
        *seen
            .entry(http_get(&addr, "/metrics").await.map_or(0, |r| r.0))
            .or_default() += 1;
    }
    assert_eq!(seen.get(&200), Some(&5), "/metrics answers again: {seen:?}");
    drop(relay);
}

/// Probes stay answerable while one peer floods the listener with slow connections: 64 connections
/// from 127.0.0.1 each send half a request and stall, and are reopened as soon as they are cut (the
/// attack that took every slot of the old 32-connection cap and got the pod restarted). Meanwhile a
/// kubelet at 127.0.0.2 probes `/healthz` every 200 ms with its default 1 s timeout: every probe
/// gets 200. A stalled connection from a third address is cut within the ~1 s header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_from_another_peer_answer_under_a_flood_of_slow_connections() {
    let s = Scenario::listening().await;
    let addr = s.http_addr();
    let relay = s.run_binary();
    wait_http(&addr, "/healthz", 200).await;
    let target: std::net::SocketAddr = addr.parse().expect("listen address");

    let stop = Instant::now() + Duration::from_secs(8);
    let flood: Vec<_> = (0..64)
        .map(|_| {
            tokio::spawn(async move {
                let mut held = 0u32;
                while Instant::now() < stop {
                    let Ok(mut s) = connect_from("127.0.0.1", target).await else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    if s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                        .await
                        .is_ok()
                    {
                        // Stall until the server cuts it (or the flood ends), then reopen.
                        let mut buf = [0u8; 64];
                        let left = stop.saturating_duration_since(Instant::now());
                        if let Ok(Ok(0) | Err(_)) =
                            tokio::time::timeout(left, s.read(&mut buf)).await
                        {
                            held += 1;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                held
            })
        })
        .collect();
    // Let the flood take what it can.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let stalled = tokio::spawn(async move {
        let mut s = connect_from("127.0.0.3", target).await.expect("connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\n")
            .await
            .expect("write");
        closed_within(s, Instant::now(), Duration::from_secs(5)).await
    });

    let mut failures = Vec::new();
    let mut probes = 0;
    while Instant::now() + Duration::from_secs(1) < stop {
        probes += 1;
        let started = Instant::now();
        match tokio::time::timeout(Duration::from_secs(1), probe(target)).await {
            Ok(Ok(200)) => {}
            Ok(Ok(status)) => failures.push(format!("status {status}")),
            Ok(Err(e)) => failures.push(e.to_string()),
            Err(_) => failures.push("no answer within 1 s".into()),
        }
        tokio::time::sleep(Duration::from_millis(200).saturating_sub(started.elapsed())).await;
    }
    let stalled = stalled.await.expect("stalled connection task");
    let mut cut = 0;
    for f in flood {
        cut += f.await.expect("flood task");
    }
    eprintln!(
        "http: {probes} probes under a flood of 64 slow connections ({cut} cut and reopened): {} failed; \
         a stalled connection was cut after {stalled:?}",
        failures.len()
    );
    assert!(probes >= 20, "only {probes} probes ran");
    assert!(
        failures.is_empty(),
        "probes from another peer failed under the flood: {failures:?}"
    );
    assert!(
        stalled < Duration::from_secs(3),
        "a connection that stalls in its headers is cut by the ~1 s header timeout, not after {stalled:?}"
    );
    drop(relay);
}

/// A TCP connection to `target` from the loopback address `from` (Linux routes all of 127/8 to lo).
async fn connect_from(from: &str, target: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::new(
        from.parse().expect("loopback address"),
        0,
    ))?;
    socket.connect(target).await
}

/// One kubelet probe from 127.0.0.2: `GET /healthz`, the status code.
async fn probe(target: std::net::SocketAddr) -> std::io::Result<u16> {
    let mut s = connect_from("127.0.0.2", target).await?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {text:?}")))
}
