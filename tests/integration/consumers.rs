//! What consumers rely on: read-your-writes through the position service, over NATS (the
//! services API: `outbox-relay.<slot>.position`, `.wait`, `$SRV.PING`) and HTTP (`/position`,
//! `/wait`), served only by the relay that streams the slot; and `{partition}`, which must put every
//! aggregate id in the partition a real nats-server's `partition()` mapping gives it.
//!
//! Each test judges the relay the way a consumer would: a write and its `pg_current_wal_lsn()`, the
//! answers of the service, the messages in the stream.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use outbox_relay::Lsn;
use serde_json::Value;
use tokio_postgres::Client;

use crate::hostile::wait_for_active_slot;
use crate::ops::{free_addr, try_get, wait_for_status};
use crate::support::{
    InProcessRelay, NatsServer, PgServer, Scenario, TestDb, current_wal_lsn, read_all,
    relay_config, relay_env, run_command, stream_count, unique, wait_for,
};

const LIMIT: Duration = Duration::from_secs(60);

/// A scenario with the text-id outbox whose relay serves HTTP on `addr` (`free_addr()`).
async fn http_scenario(addr: &str) -> Scenario {
    Scenario::builder()
        .text_ids()
        .http_listen(addr)
        .start()
        .await
}

/// Inserts one event in its own transaction and returns `pg_current_wal_lsn()` taken after the
/// COMMIT returned: the writer's token.
async fn write(client: &Client, id: &str, aggregate_id: &str) -> Lsn {
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'Claim', $2, 'ClaimApproved', '{}')",
            &[&id, &aggregate_id],
        )
        .await
        .unwrap_or_else(|e| panic!("insert {id}: {e}"));
    current_wal_lsn(client).await
}

/// A request to the service; the reply's JSON, or the service error (code, text).
async fn ask(
    nats: &async_nats::Client,
    subject: String,
    body: &str,
) -> Result<Value, (String, String)> {
    let request = async_nats::Request::new()
        .payload(body.to_owned().into())
        .timeout(Some(Duration::from_secs(40)));
    let reply = nats
        .send_request(subject.clone(), request)
        .await
        .unwrap_or_else(|e| panic!("request {subject}: {e}"));
    if let Some(h) = &reply.headers
        && let Some(code) = h.get("Nats-Service-Error-Code")
    {
        let text = h
            .get("Nats-Service-Error")
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        return Err((code.as_str().to_owned(), text));
    }
    Ok(serde_json::from_slice(&reply.payload)
        .unwrap_or_else(|e| panic!("{subject}: reply is not JSON ({e}): {:?}", reply.payload)))
}

fn lsn_of(v: &Value, key: &str) -> Lsn {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("{key} missing: {v}"))
        .parse()
        .unwrap_or_else(|e| panic!("{key}: {e}: {v}"))
}

/// Every `$SRV.PING.outbox-relay` answer that arrives within a second: one per relay that serves.
/// Published with a reply subject rather than asked as a request, so every answer is counted.
async fn pings(nats: &async_nats::Client) -> Vec<Value> {
    use futures_util::StreamExt;
    let inbox = nats.new_inbox();
    let mut answers = nats.subscribe(inbox.clone()).await.expect("subscribe");
    nats.publish_with_reply("$SRV.PING.outbox-relay", inbox, "".into())
        .await
        .expect("ping");
    let mut out = Vec::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(1);
    while let Ok(Some(m)) = tokio::time::timeout_at(until, answers.next()).await {
        // With nobody subscribed the server says "no responders" (a status, no payload).
        if m.status.is_none() {
            out.push(serde_json::from_slice(&m.payload).expect("ping answer is JSON"));
        }
    }
    out
}

/// `GET path` over HTTP/1.0, read for up to 40 s (ops.rs's reader gives up after 10): status and body.
async fn get_slow(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .expect("send");
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(40), s.read_to_end(&mut buf))
        .await
        .expect("an answer within 40 s")
        .expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, body.to_owned())
}

/// Thirty writers in a row each take their LSN after COMMIT, wait for it through
/// `outbox-relay.<slot>.wait`, and then find their own event in the stream at the `last_sequence`
/// the answer names: a wait that answered before the event was stored (or a service that is not
/// there) fails it. The position names the slot and stream, and its stored LSN is at or past every
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_writes_each_read_their_own_event_after_a_wait() {
    let s = Scenario::builder().text_ids().start().await;
    let (_db, nats, config, client, _js, _slot, _stream) = s.into_parts();
    let relay = InProcessRelay::start(config.clone());
    wait_for_active_slot(&client, &config.postgres.slot).await;
    let nc = nats.client().await;
    let js = jetstream::new(nc.clone());
    let prefix = format!("outbox-relay.{}", config.postgres.slot);
    // The service registers a moment after the slot turns active.
    wait_for("the position service", LIMIT, || async {
        !pings(&nc).await.is_empty()
    })
    .await;

    for i in 0..30 {
        let id = format!("e-{i}");
        let token = write(&client, &id, &i.to_string()).await;
        let answer = ask(
            &nc,
            format!("{prefix}.wait"),
            &format!(r#"{{"lsn": "{token}", "timeout_ms": 20000}}"#),
        )
        .await
        .unwrap_or_else(|e| panic!("wait {i}: {e:?}"));
        assert_eq!(answer["stored"], true, "wait {i}: {answer}");
        assert!(lsn_of(&answer, "stored_lsn") >= token, "wait {i}: {answer}");
        let seq = answer["last_sequence"].as_u64().expect("last_sequence");
        let stream = js.get_stream(&config.nats.stream).await.expect("stream");
        let m = stream
            .get_raw_message(seq)
            .await
            .unwrap_or_else(|e| panic!("message {seq} after wait {i}: {e}"));
        let msg_id = m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned());
        assert_eq!(msg_id.as_deref(), Some(id.as_str()), "wait {i}: {answer}");
    }

    let position = ask(&nc, format!("{prefix}.position"), "")
        .await
        .expect("position");
    assert_eq!(
        position["slot"],
        config.postgres.slot.as_str(),
        "{position}"
    );
    assert_eq!(
        position["stream"],
        config.nats.stream.as_str(),
        "{position}"
    );
    assert_eq!(position["last_sequence"], 30, "{position}");
    let stored = lsn_of(&position, "stored_lsn");
    let token = current_wal_lsn(&client).await;
    assert!(
        stored <= token,
        "stored {stored} is not past the server's WAL {token}"
    );
    assert!(lsn_of(&position, "confirmed_lsn") <= stored, "{position}");
    relay.stop().await.expect("relay stops cleanly");
}

/// A wait for an LSN far past the WAL answers `stored: false, error: timeout` after its
/// `timeout_ms`, not before (and within a generous bound after); bad requests are service errors
/// (code 400) that name the field; `$SRV.PING` and `$SRV.INFO` list the service and its endpoints;
/// a wait still open when the relay stops gets a 503 service error then, not silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn far_waits_time_out_bad_requests_name_the_field_and_ping_answers() {
    let s = Scenario::builder().text_ids().start().await;
    let (_db, nats, config, client, _js, _slot, _stream) = s.into_parts();
    let relay = InProcessRelay::start(config.clone());
    wait_for_active_slot(&client, &config.postgres.slot).await;
    let nc = nats.client().await;
    let prefix = format!("outbox-relay.{}", config.postgres.slot);
    wait_for("the position service", LIMIT, || async {
        !pings(&nc).await.is_empty()
    })
    .await;

    let far = Lsn(current_wal_lsn(&client).await.0 + (1 << 40));
    let started = Instant::now();
    let answer = ask(
        &nc,
        format!("{prefix}.wait"),
        &format!(r#"{{"lsn": "{far}", "timeout_ms": 700}}"#),
    )
    .await
    .expect("a timeout is an answer, not an error");
    let took = started.elapsed();
    assert_eq!(answer["stored"], false, "{answer}");
    assert_eq!(answer["error"], "timeout", "{answer}");
    assert!(lsn_of(&answer, "stored_lsn") < far, "{answer}");
    assert!(
        took >= Duration::from_millis(700),
        "answered after {took:?}"
    );
    assert!(took < Duration::from_secs(10), "answered after {took:?}");

    for (body, field) in [
        ("", "lsn"),
        (r#"{"lsn": "not-an-lsn"}"#, "lsn"),
        (r#"{"lsn": "0/1", "timeout_ms": 99999999}"#, "timeout_ms"),
        (r#"{"lsn": "0/1", "timeout": 5}"#, "timeout"),
        ("not json", "JSON"),
    ] {
        let (code, text) = ask(&nc, format!("{prefix}.wait"), body)
            .await
            .expect_err(body);
        assert_eq!(code, "400", "{body}: {text}");
        assert!(text.contains(field), "{body}: {text}");
        assert_eq!(text.lines().count(), 1, "{body}: {text}");
    }

    let pong = pings(&nc).await;
    assert_eq!(pong.len(), 1, "{pong:?}");
    assert_eq!(pong[0]["name"], "outbox-relay", "{pong:?}");
    let info = nc
        .request("$SRV.INFO.outbox-relay", "".into())
        .await
        .expect("$SRV.INFO");
    let info: Value = serde_json::from_slice(&info.payload).expect("info JSON");
    let mut subjects: Vec<&str> = info["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .map(|e| e["subject"].as_str().expect("subject"))
        .collect();
    subjects.sort();
    assert_eq!(
        subjects,
        [format!("{prefix}.position"), format!("{prefix}.wait")],
        "{info}"
    );
    assert_eq!(info["metadata"]["slot"], config.postgres.slot.as_str());

    // A wait still open when the session ends (the walsender is cut: the relay reconnects) is told
    // so (ask again), not left to its timeout.
    let open = tokio::spawn({
        let nc = nc.clone();
        let subject = format!("{prefix}.wait");
        let body = format!(r#"{{"lsn": "{far}", "timeout_ms": 30000}}"#);
        async move {
            let started = Instant::now();
            (ask(&nc, subject, &body).await, started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    client
        .execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1",
            &[&config.postgres.slot],
        )
        .await
        .expect("terminate the walsender");
    let (answer, took) = open.await.expect("the open wait");
    let (code, text) = answer.expect_err("an error, not a timeout");
    assert_eq!(code, "503", "{text}");
    assert!(text.contains("ask again"), "{text}");
    assert!(took < Duration::from_secs(20), "answered after {took:?}");
    relay.stop().await.expect("relay stops cleanly");
}

/// The same over HTTP: `/position` 200 with the JSON; `/wait` 200 once stored, 504 after its
/// timeout (also past the listener's 10 s connection limit), 400 with the field for bad input; and 503 on a standby, which serves nothing (neither
/// HTTP nor a `$SRV.PING` answer) until the active relay stops, then takes over and answers waits
/// for writes made after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_codes_and_a_standby_that_serves_once_it_takes_over() {
    let active_addr = free_addr();
    let s = http_scenario(&active_addr).await;
    let (_db, nats, config, client, _js, _slot, _stream) = s.into_parts();
    let active = InProcessRelay::start(config.clone());
    wait_for_active_slot(&client, &config.postgres.slot).await;
    wait_for_status(&active_addr, "/position", 200, 30).await;

    let (status, body) = try_get(&active_addr, "/position").await.expect("/position");
    assert_eq!(status, 200, "{body}");
    let position: Value = serde_json::from_str(&body).expect("position JSON");
    assert_eq!(position["slot"], config.postgres.slot.as_str(), "{body}");

    let token = write(&client, "e-http-1", "1").await;
    let (status, body) = try_get(&active_addr, &format!("/wait?lsn={token}&timeout_ms=20000"))
        .await
        .expect("/wait");
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("wait JSON");
    assert_eq!(answer["stored"], true, "{body}");

    let far = Lsn(token.0 + (1 << 40));
    let (status, body) = try_get(&active_addr, &format!("/wait?lsn={far}&timeout_ms=300"))
        .await
        .expect("/wait far");
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("\"timeout\""), "{body}");
    // A wait longer than the listener's 10 s connection limit gets its own timeout on top.
    let started = Instant::now();
    let (status, body) = get_slow(&active_addr, &format!("/wait?lsn={far}&timeout_ms=11000")).await;
    assert_eq!(status, 504, "after {:?}: {body}", started.elapsed());
    assert!(started.elapsed() >= Duration::from_secs(11), "{body}");
    for (query, field) in [
        ("lsn=zz", "lsn"),
        ("timeout_ms=5", "lsn"),
        ("lsn=0/1&timeout_ms=30001", "timeout_ms"),
    ] {
        let (status, body) = try_get(&active_addr, &format!("/wait?{query}"))
            .await
            .expect("/wait bad");
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains(field), "{query}: {body}");
    }

    let mut standby_config = config.clone();
    let standby_addr = free_addr();
    standby_config.http.listen = standby_addr.clone();
    let standby = InProcessRelay::start(standby_config);
    wait_for_status(&standby_addr, "/healthz", 200, 30).await;
    wait_for("the standby to wait for the slot", LIMIT, || async {
        standby.metrics.standby.get() == 1
    })
    .await;
    for path in ["/position", &format!("/wait?lsn={token}&timeout_ms=0")] {
        let (status, body) = try_get(&standby_addr, path).await.expect("standby GET");
        assert_eq!(status, 503, "a standby serves no position: {path}: {body}");
    }
    let nc = nats.client().await;
    assert_eq!(
        pings(&nc).await.len(),
        1,
        "only the active relay answers $SRV.PING"
    );

    active.stop().await.expect("the active relay stops cleanly");
    wait_for_status(&standby_addr, "/position", 200, 60).await;
    // The service registers a moment after the session starts (on a loaded machine, more than
    // the 1 s a ping listens): wait for exactly one answer, which two relays would never give.
    wait_for(
        "one $SRV.PING answer: the stopped relay left, the standby came",
        LIMIT,
        || async { pings(&nc).await.len() == 1 },
    )
    .await;
    let token = write(&client, "e-http-2", "2").await;
    let answer = ask(
        &nc,
        format!("outbox-relay.{}.wait", config.postgres.slot),
        &format!(r#"{{"lsn": "{token}", "timeout_ms": 20000}}"#),
    )
    .await
    .expect("the new active relay answers");
    assert_eq!(answer["stored"], true, "{answer}");
    standby.stop().await.expect("the standby stops cleanly");
}

/// A relay with `outbox.{aggregate_type}.{partition}` and 7 partitions puts each of a few hundred
/// aggregate ids in the partition that a real nats-server puts it in: a second stream with the
/// subject transform `check.* → check.{{partition(7,1)}}.{{wildcard(1)}}` stores each id published
/// to `check.<id>` under its partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_agree_with_nats_server_partition_mapping() {
    const N: u32 = 7;
    let s = Scenario::builder()
        .text_ids()
        .config(|c| {
            c.nats.subject = "outbox.{aggregate_type}.{partition}".into();
            c.nats.partitions = N;
        })
        .start()
        .await;
    let (_db, nats, config, client, _js, _slot, _stream) = s.into_parts();
    let ids: Vec<String> = (0..300)
        .map(|i| match i % 4 {
            0 => i.to_string(),
            1 => format!("claim-{i}"),
            2 => format!("{:08x}-4a1b-9c2d-{:012x}", i * 7919, i * 104_729),
            _ => format!("Schaden_ü-{i}"),
        })
        .collect();
    let relay = InProcessRelay::start(config.clone());
    wait_for_active_slot(&client, &config.postgres.slot).await;
    for (i, id) in ids.iter().enumerate() {
        write(&client, &format!("e-{i}"), id).await;
    }

    let nc = nats.client().await;
    let js = jetstream::new(nc.clone());
    let check = unique("CHECK").to_uppercase();
    js.create_stream(stream::Config {
        name: check.clone(),
        subjects: vec!["check.*".into()],
        subject_transform: Some(stream::SubjectTransform {
            source: "check.*".into(),
            destination: format!("check.{{{{partition({N},1)}}}}.{{{{wildcard(1)}}}}"),
        }),
        ..Default::default()
    })
    .await
    .expect("create the checking stream");
    for id in &ids {
        js.publish(format!("check.{id}"), "".into())
            .await
            .expect("publish")
            .await
            .expect("stored");
    }
    let by_server: BTreeMap<String, String> = read_all(&js, &check)
        .await
        .into_iter()
        .map(|m| {
            let mut tokens = m.subject.splitn(3, '.').skip(1);
            let partition = tokens.next().expect("partition token").to_owned();
            (tokens.next().expect("id token").to_owned(), partition)
        })
        .collect();
    assert_eq!(by_server.len(), ids.len());

    wait_for("every event in the relay's stream", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await >= ids.len() as u64
    })
    .await;
    let mut used = std::collections::BTreeSet::new();
    for m in read_all(&js, &config.nats.stream).await {
        let id = m.header("Outbox-Aggregate-Id");
        let partition = m.subject.rsplit('.').next().expect("partition token");
        assert_eq!(
            Some(partition),
            by_server.get(id).map(String::as_str),
            "aggregate id {id:?}: the relay's subject {} against nats-server's partition",
            m.subject
        );
        used.insert(partition.to_owned());
    }
    assert_eq!(used.len(), N as usize, "300 ids fill all {N} partitions");
    relay.stop().await.expect("relay stops cleanly");
}

/// `setup` with a stream that names only some of the partitions (subjects `outbox.*.0` and
/// `outbox.*.1` of 3) warns, naming the missing one; `{partition}` without `nats.partitions` is a
/// configuration error naming the key.
#[tokio::test]
async fn setup_warns_about_partitions_the_stream_does_not_cover() {
    let s = Scenario::builder().text_ids().start().await;
    let (_db, _nats, mut config, _client, js, _slot, _stream) = s.into_parts();
    // Invalid on purpose (no nats.partitions): `setup` must refuse it until it is set.
    config.nats.subject = "outbox.{aggregate_type}.{partition}".into();
    js.create_stream(stream::Config {
        name: config.nats.stream.clone(),
        subjects: vec![
            "outbox.*.0".into(),
            "outbox.*.1".into(),
            config.nats.dead_letter_subject.clone(),
        ],
        ..Default::default()
    })
    .await
    .expect("create the stream");
    let mut env = relay_env(&config);
    env.push((
        "OUTBOX_RELAY_NATS_SUBJECT".into(),
        config.nats.subject.clone(),
    ));
    let refused = run_command(&["setup"], &env, LIMIT);
    assert!(!refused.status.success(), "{}", refused.stdout);
    assert!(
        refused.stderr.contains("nats.partitions"),
        "{}",
        refused.stderr
    );
    env.push(("OUTBOX_RELAY_NATS_PARTITIONS".into(), "3".into()));
    let setup = run_command(&["setup"], &env, LIMIT);
    let out = format!("{}{}", setup.stdout, setup.stderr);
    assert!(setup.status.success(), "{out}");
    assert!(
        out.contains("do not cover 1 of the 3 partitions") && out.contains("outbox.*.2"),
        "{out}"
    );
}

/// The counter `outbox_relay_position_requests_refused_total{reason=…}` in the relay's metrics text.
fn refused(relay: &InProcessRelay, reason: &str) -> Option<f64> {
    crate::hostile::metric(
        &relay.metrics.render(),
        &format!("outbox_relay_position_requests_refused_total{{reason=\"{reason}\"}}"),
    )
}

/// docs/security.md, finding 1: the position service is nobody's deputy. Under the NATS permissions
/// docs/operations.md gives, the service's user may not publish into the stream, onto the relay's
/// inbox or to JetStream's API; it sends `.position`, `.wait`, `$SRV.PING`, `$SRV.INFO` and
/// `$SRV.STATS` requests whose reply subject is the stream's subject, the dead-letter subject, the
/// relay's inbox or `$JS.API.STREAM.PURGE.OUTBOX`, which the relay's `allow_responses` would let it
/// answer on. None is answered: the stream holds exactly the two inserted events (no stored answer,
/// no purge), the relay never restarted, the refusals are counted, and the same requests with the
/// user's own inbox are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_position_service_refuses_reply_subjects_it_must_never_publish_to() {
    use crate::permissions::{
        INBOX_PREFIX, RELAY_PASSWORD, RELAY_USER, documented_nats_config, service_client,
    };
    let nats = NatsServer::start_with_config(&documented_nats_config());
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(&crate::support::default_outbox_sql());
    let mut config = relay_config(&db, &nats);
    config.nats.stream = "OUTBOX".into();
    config.nats.user = RELAY_USER.into();
    config.nats.password = RELAY_PASSWORD.into();
    config.nats.inbox_prefix = INBOX_PREFIX.into();
    let mut env = relay_env(&config);
    env.push(("OUTBOX_RELAY_NATS_USER".into(), RELAY_USER.into()));
    env.push(("OUTBOX_RELAY_NATS_PASSWORD".into(), RELAY_PASSWORD.into()));
    env.push(("OUTBOX_RELAY_NATS_INBOX_PREFIX".into(), INBOX_PREFIX.into()));
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);

    let (service, _errors) = service_client(&nats).await;
    let js = jetstream::new(service.clone());
    let client = db.client().await;
    let relay = InProcessRelay::start(config.clone());
    wait_for_active_slot(&client, &config.postgres.slot).await;
    let insert = "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ('Claim', $1, 'ClaimApproved', '{}')";
    client.execute(insert, &[&"4711"]).await.expect("insert");
    wait_for("the first event in the stream", LIMIT, || async {
        stream_count(&js, "OUTBOX").await >= 1
    })
    .await;
    let prefix = format!("outbox-relay.{}", config.postgres.slot);
    wait_for("the position service", LIMIT, || async {
        !pings(&service).await.is_empty()
    })
    .await;

    let far = Lsn(current_wal_lsn(&client).await.0 + (1 << 40));
    let wait_body = format!(r#"{{"lsn": "{far}", "timeout_ms": 0}}"#);
    let requests = [
        (format!("{prefix}.position"), String::new()),
        (format!("{prefix}.wait"), wait_body.clone()),
        ("$SRV.PING".to_owned(), String::new()),
        ("$SRV.INFO.outbox-relay".to_owned(), String::new()),
        ("$SRV.STATS".to_owned(), String::new()),
    ];
    let replies = [
        "outbox.Claim",
        "outbox_dead_letter",
        &format!("{INBOX_PREFIX}.planted.1"),
        "$JS.API.STREAM.PURGE.OUTBOX",
    ];
    for reply in replies {
        for (subject, body) in &requests {
            service
                .publish_with_reply(subject.clone(), reply.to_owned(), body.clone().into())
                .await
                .expect("publish");
        }
    }
    service.flush().await.expect("flush");
    // Answers would be stored (or the stream purged) within milliseconds; give them time.
    tokio::time::sleep(Duration::from_secs(2)).await;

    client.execute(insert, &[&"4712"]).await.expect("insert");
    wait_for("the second event in the stream", LIMIT, || async {
        read_all(&js, "OUTBOX").await.iter().any(|m| {
            m.headers
                .get("Outbox-Aggregate-Id")
                .is_some_and(|id| id == "4712")
        })
    })
    .await;
    // A message the relay did not write shows as its subject and payload.
    let ids: Vec<String> = read_all(&js, "OUTBOX")
        .await
        .iter()
        .map(|m| match m.headers.get("Outbox-Aggregate-Id") {
            Some(id) => id.clone(),
            None => format!("{}: {}", m.subject, String::from_utf8_lossy(&m.payload)),
        })
        .collect();
    assert_eq!(
        ids,
        ["4711", "4712"],
        "the stream holds only the relay's events: no answer stored, nothing purged"
    );
    assert_eq!(
        relay.metrics.reconnects.get(),
        0,
        "the relay never restarted"
    );
    assert!(!relay.is_finished(), "the relay runs on");
    let expected = (replies.len() * requests.len()) as f64;
    assert_eq!(refused(&relay, "reply_subject"), Some(expected));

    // The same requests on the user's own inbox are answered.
    let position = ask(&service, format!("{prefix}.position"), "")
        .await
        .expect("position");
    assert_eq!(position["stream"], "OUTBOX", "{position}");
    let answer = ask(&service, format!("{prefix}.wait"), &wait_body)
        .await
        .expect("wait");
    assert_eq!(answer["error"], "timeout", "{answer}");
    assert_eq!(pings(&service).await.len(), 1);
    let stats = service
        .request("$SRV.STATS.outbox-relay", "".into())
        .await
        .expect("$SRV.STATS");
    let stats: Value = serde_json::from_slice(&stats.payload).expect("stats JSON");
    assert_eq!(stats["type"], "io.nats.micro.v1.stats_response", "{stats}");
    assert_eq!(refused(&relay, "reply_subject"), Some(expected));
    relay.stop().await.expect("relay stops cleanly");
}

/// Right after a restart the relay knows where the slot stands, and says so. Its first
/// `/position` answer shows the slot's `confirmed_flush_lsn` as `confirmed_lsn` and as
/// `stored_lsn` (not `0/0` until the session's first status update), with the stream's last
/// sequence; a wait for an LSN beyond it is not answered stored. (The restore case, a slot behind
/// what an earlier session of the same process stored, is in `resume.rs` and the unit test in
/// `src/stored/mod.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn position_right_after_a_restart_is_the_slots_own() {
    let addr = free_addr();
    let s = http_scenario(&addr).await;
    let (_db, nats, config, client, _js, _slot, _stream) = s.into_parts();
    let js = jetstream::new(nats.client().await);
    let relay = InProcessRelay::start(config.clone());
    wait_for_active_slot(&client, &config.postgres.slot).await;
    let mut token = Lsn::ZERO;
    for i in 0..3 {
        token = write(&client, &format!("e-{i}"), "1").await;
    }
    wait_for("three events stored and confirmed", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await == 3
            && crate::support::confirmed_flush(&client, &config.postgres.slot)
                .await
                .is_some_and(|c| c >= token)
    })
    .await;
    relay.stop().await.expect("relay stops cleanly");
    let slot_at = crate::support::confirmed_flush(&client, &config.postgres.slot)
        .await
        .expect("the slot's position");

    let relay = InProcessRelay::start(config.clone());
    // The first answer after the restart, polled as fast as a client would.
    let polling = std::time::Instant::now();
    let body = loop {
        match try_get(&addr, "/position").await {
            Some((200, body)) => break body,
            other => {
                assert!(
                    polling.elapsed() < LIMIT,
                    "/position did not answer 200 within {LIMIT:?} of the restart: last {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(5)).await
            }
        }
    };
    let first: Value = serde_json::from_str(&body).expect("/position is JSON");
    // At the slot's position or, if a status update came first, past it; never 0/0.
    assert!(
        lsn_of(&first, "confirmed_lsn") >= slot_at,
        "right after the restart the slot is at {slot_at}: {first}"
    );
    assert!(lsn_of(&first, "stored_lsn") >= slot_at, "{first}");
    assert_eq!(first["last_sequence"], 3, "{first}");
    let far = Lsn(current_wal_lsn(&client).await.0 + (1 << 32));
    let (status, body) = try_get(&addr, &format!("/wait?lsn={far}&timeout_ms=200"))
        .await
        .expect("/wait");
    assert_eq!(
        status, 504,
        "a wait past what is stored is not stored: {body}"
    );
    relay.stop().await.expect("relay stops cleanly");
}

/// docs/security.md, finding 3: a wait's request is bounded. A `.wait` body over 512 bytes (a valid
/// wait padded with whitespace) gets a 413 service error naming the limit, and a `/wait` whose
/// query is over 512 bytes (valid, padded with empty parameters) a 414, one with a body a 413; each
/// is counted. A normal wait on both still answers once its event is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_wait_requests_are_refused_on_nats_and_http() {
    let addr = free_addr();
    let s = http_scenario(&addr).await;
    let (_db, nats, config, client, _js, _slot, _stream) = s.into_parts();
    let relay = InProcessRelay::start(config.clone());
    wait_for_active_slot(&client, &config.postgres.slot).await;
    let nc = nats.client().await;
    let prefix = format!("outbox-relay.{}", config.postgres.slot);
    wait_for("the position service", LIMIT, || async {
        !pings(&nc).await.is_empty()
    })
    .await;
    wait_for_status(&addr, "/position", 200, 30).await;

    let far = Lsn(current_wal_lsn(&client).await.0 + (1 << 40));
    let body = format!(r#"{{"lsn": "{far}", "timeout_ms": 30000}}"#);
    let padded = format!("{body}{}", " ".repeat(600));
    let (code, text) = ask(&nc, format!("{prefix}.wait"), &padded)
        .await
        .expect_err("a padded wait is refused");
    assert_eq!(code, "413", "{text}");
    assert!(text.contains("more than 512"), "{text}");
    assert_eq!(text.lines().count(), 1, "{text}");

    let query = format!("lsn={far}&timeout_ms=30000{}", "&".repeat(600));
    let (status, text) = try_get(&addr, &format!("/wait?{query}"))
        .await
        .expect("/wait padded");
    assert_eq!(status, 414, "{text}");
    assert!(text.contains("more than 512"), "{text}");
    let with_body = {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        s.write_all(
            format!(
                "GET /wait?lsn={far}&timeout_ms=30000 HTTP/1.0\r\nHost: x\r\nContent-Length: 4\r\n\r\nabcd"
            )
            .as_bytes(),
        )
        .await
        .expect("send");
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
            .await
            .expect("answered at once")
            .expect("read");
        String::from_utf8_lossy(&buf).into_owned()
    };
    assert!(with_body.starts_with("HTTP/1.0 413"), "{with_body}");
    assert_eq!(refused(&relay, "too_large"), Some(3.0));

    let token = write(&client, "e-1", "1").await;
    let answer = ask(
        &nc,
        format!("{prefix}.wait"),
        &format!(r#"{{"lsn": "{token}", "timeout_ms": 20000}}"#),
    )
    .await
    .expect("a normal wait");
    assert_eq!(answer["stored"], true, "{answer}");
    let (status, text) = try_get(&addr, &format!("/wait?lsn={token}&timeout_ms=20000"))
        .await
        .expect("/wait");
    assert_eq!(status, 200, "{text}");
    relay.stop().await.expect("relay stops cleanly");
}
