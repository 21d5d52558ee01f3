//! Unit tests of `outbox`.

use super::*;
use bytes::Bytes;

use crate::event::{JSON_CONTENT_TYPE, TEXT_CONTENT_TYPE};
use crate::pgoutput::{Column, TupleValue};
use row::oid;

fn col(name: &str, type_oid: u32) -> Column {
    Column {
        flags: 0,
        name: name.into(),
        type_oid,
        type_modifier: -1,
    }
}

fn outbox_relation(id: u32, cols: &[(&str, u32)]) -> Message {
    Message::Relation(Relation {
        xid: None,
        id,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: b'd',
        columns: cols.iter().map(|(n, t)| col(n, *t)).collect(),
    })
}

const DEFAULT_COLS: &[(&str, u32)] = &[
    ("event_id", 2950),
    ("aggregate_type", 25),
    ("aggregate_id", 25),
    ("event_type", 25),
    ("payload", 3802),
    ("created_at", 1184),
];

fn t(s: &str) -> TupleValue {
    TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()))
}

fn insert(id: u32, vals: Vec<TupleValue>) -> Message {
    Message::Insert {
        xid: None,
        relation_id: id,
        new: vals,
    }
}

fn stage() -> OutboxStage {
    OutboxStage::new(&OutboxConfig::default())
}

fn event(step: Step) -> OutboxEvent {
    match step {
        Step::Event(e) => *e,
        other => panic!("expected an event, got {other:?}"),
    }
}

#[test]
fn partitions_sent_under_their_own_names_map_to_the_outbox() {
    let mut s = stage().with_partition_lookup();
    let partition = |id: u32, name: &str| {
        let Message::Relation(mut rel) = outbox_relation(id, DEFAULT_COLS) else {
            unreachable!()
        };
        rel.name = name.into();
        rel
    };
    // A Relation the stage cannot place asks for the partitions, and is placed with the answer.
    let unknown = partition(41, "outbox_p202501");
    assert_eq!(
        s.step(Message::Relation(unknown.clone())).unwrap(),
        Step::LookUpPartitions
    );
    s.partitions_found([41]);
    let row = vec![t("1"), t("Claim"), t("4711"), t("E"), t("{}"), t("x")];
    assert_eq!(
        event(s.step(insert(41, row.clone())).unwrap())
            .id
            .as_deref(),
        Some("1")
    );
    // Known now: sent again (after a schema change), it asks for nothing.
    assert_eq!(s.step(Message::Relation(unknown)).unwrap(), Step::Nothing);
    // Another table is looked up once, then ignored.
    let other = partition(42, "orders");
    assert_eq!(
        s.step(Message::Relation(other.clone())).unwrap(),
        Step::LookUpPartitions
    );
    s.partitions_found([41]);
    assert_eq!(s.step(Message::Relation(other)).unwrap(), Step::Nothing);
    assert_eq!(s.step(insert(42, row.clone())).unwrap(), Step::Nothing);
    // Without the lookup (a scan told the partitions up front), nothing is asked.
    let mut told = stage();
    told.set_partitions([41]);
    assert_eq!(
        told.step(Message::Relation(partition(41, "outbox_p202501")))
            .unwrap(),
        Step::Nothing
    );
    assert_eq!(
        told.step(Message::Relation(partition(43, "outbox_p202502")))
            .unwrap(),
        Step::Nothing
    );
    assert_eq!(told.step(insert(43, row)).unwrap(), Step::Nothing);
}

#[test]
fn maps_an_insert_to_an_event() {
    let mut s = stage();
    s.step(Message::Begin {
        final_lsn: Lsn(0x1234),
        commit_ts: 0,
        xid: 1,
    })
    .unwrap();
    s.step(outbox_relation(7, DEFAULT_COLS)).unwrap();
    let payload = r#"{"claim_id": 4711, "status": "approved"}"#;
    let e = event(
        s.step(insert(
            7,
            vec![
                t("e-5531"),
                t("Claim"),
                t("4711"),
                t("ClaimApproved"),
                t(payload),
                t("2026-11-30 10:00:00+00"),
            ],
        ))
        .unwrap(),
    );
    assert_eq!(e.id.as_deref(), Some("e-5531"));
    assert_eq!(e.aggregate_type.as_deref(), Some("Claim"));
    assert_eq!(e.aggregate_id.as_deref(), Some("4711"));
    assert_eq!(e.event_type.as_deref(), Some("ClaimApproved"));
    assert_eq!(
        &e.payload[..],
        payload.as_bytes(),
        "payload passes through as stored"
    );
    assert_eq!(e.commit_lsn, Lsn(0x1234));
    assert_eq!(e.problem, None);
}

#[test]
fn other_tables_and_outbox_updates_are_not_events() {
    let mut s = stage();
    s.step(Message::Relation(Relation {
        xid: None,
        id: 9,
        namespace: "public".into(),
        name: "claims".into(),
        replica_identity: b'd',
        columns: vec![col("id", 20)],
    }))
    .unwrap();
    assert_eq!(s.step(insert(9, vec![t("1")])).unwrap(), Step::Nothing);
    s.step(outbox_relation(7, DEFAULT_COLS)).unwrap();
    let upd = Message::Update {
        xid: None,
        relation_id: 7,
        old: None,
        new: vec![],
    };
    assert_eq!(s.step(upd).unwrap(), Step::IgnoredChange("update"));
    let del = Message::Delete {
        xid: None,
        relation_id: 7,
        old: crate::pgoutput::OldTuple::Key(vec![]),
    };
    assert_eq!(s.step(del).unwrap(), Step::IgnoredChange("delete"));
}

#[test]
fn same_name_in_other_schema_is_not_the_outbox() {
    let mut s = stage();
    let Message::Relation(mut rel) = outbox_relation(3, DEFAULT_COLS) else {
        unreachable!()
    };
    rel.namespace = "audit".into();
    s.step(Message::Relation(rel)).unwrap();
    let vals = vec![t("a"), t("b"), t("c"), t("d"), t("{}"), t("x")];
    assert_eq!(s.step(insert(3, vals)).unwrap(), Step::Nothing);
}

#[test]
fn null_required_fields_are_problems_not_panics() {
    let mut s = stage();
    s.step(outbox_relation(7, DEFAULT_COLS)).unwrap();
    let e = event(
        s.step(insert(
            7,
            vec![
                TupleValue::Null,
                t("Claim"),
                TupleValue::Null,
                TupleValue::Null,
                t("{}"),
                t("x"),
            ],
        ))
        .unwrap(),
    );
    let p = e.problem.unwrap();
    assert!(
        p.contains("event_id is null") && p.contains("event_type is null"),
        "{p}"
    );
    assert_eq!(e.aggregate_type.as_deref(), Some("Claim"));
}

#[test]
fn dropped_column_makes_events_invalid_with_reason() {
    let mut s = stage();
    let cols: Vec<_> = DEFAULT_COLS
        .iter()
        .copied()
        .filter(|(n, _)| *n != "event_type")
        .collect();
    s.step(outbox_relation(7, &cols)).unwrap();
    let e = event(
        s.step(insert(
            7,
            vec![t("1"), t("Claim"), t("4711"), t("{}"), t("x")],
        ))
        .unwrap(),
    );
    assert!(e.problem.unwrap().contains("event_type missing"));
}

#[test]
fn relation_change_mid_stream_remaps_columns() {
    let mut s = stage();
    s.step(outbox_relation(7, DEFAULT_COLS)).unwrap();
    // ALTER TABLE … ADD COLUMN extra text, placed first by a rewrite-less reorder is impossible in
    // Postgres, but a new Relation always wins: decode by the latest one.
    let mut cols = DEFAULT_COLS.to_vec();
    cols.push(("extra", 25));
    s.step(outbox_relation(7, &cols)).unwrap();
    let e = event(
        s.step(insert(
            7,
            vec![
                t("1"),
                t("Claim"),
                t("4711"),
                t("E"),
                t("{}"),
                t("x"),
                t("new"),
            ],
        ))
        .unwrap(),
    );
    assert_eq!(e.problem, None);
    assert_eq!(e.id.as_deref(), Some("1"));
}

#[test]
fn wrong_column_count_and_unknown_relation_are_errors() {
    let mut s = stage();
    assert_eq!(
        s.step(insert(5, vec![])).unwrap_err(),
        StageError::UnknownRelation(5)
    );
    s.step(outbox_relation(7, DEFAULT_COLS)).unwrap();
    assert!(matches!(
        s.step(insert(7, vec![t("1")])).unwrap_err(),
        StageError::ColumnCount { .. }
    ));
}

#[test]
fn bytea_payload_is_raw_bytes() {
    let mut s = stage();
    let mut cols = DEFAULT_COLS.to_vec();
    cols[4] = ("payload", oid::BYTEA);
    s.step(outbox_relation(7, &cols)).unwrap();
    let e = event(
        s.step(insert(
            7,
            vec![t("1"), t("A"), t("2"), t("E"), t("\\x00ff41"), t("x")],
        ))
        .unwrap(),
    );
    assert_eq!(&e.payload[..], &[0x00, 0xff, 0x41]);
}

#[test]
fn headers_column_becomes_headers() {
    let config = OutboxConfig {
        headers_column: "headers".into(),
        ..OutboxConfig::default()
    };
    let mut s = OutboxStage::new(&config);
    let mut cols = DEFAULT_COLS.to_vec();
    cols.push(("headers", 3802));
    s.step(outbox_relation(7, &cols)).unwrap();
    let row = |h: &str| vec![t("1"), t("A"), t("2"), t("E"), t("{}"), t("x"), t(h)];
    let e = event(
        s.step(insert(7, row(r#"{"traceparent": "00-ab-cd-01", "n": 3}"#)))
            .unwrap(),
    );
    assert_eq!(e.problem, None);
    assert_eq!(
        e.headers,
        vec![
            ("n".to_owned(), "3".to_owned()),
            ("traceparent".to_owned(), "00-ab-cd-01".to_owned())
        ]
    );
    for bad in [
        r#"[1]"#,
        r#"{"a b": "x"}"#,
        r#"{"Nats-Msg-Id": "x"}"#,
        "nope",
    ] {
        let e = event(s.step(insert(7, row(bad))).unwrap());
        assert!(e.problem.is_some(), "{bad} accepted");
    }
}

fn message(transactional: bool, prefix: &str, content: &str) -> Message {
    Message::Message {
        xid: None,
        transactional,
        lsn: Lsn(0x3000),
        prefix: prefix.into(),
        content: Bytes::copy_from_slice(content.as_bytes()),
    }
}

fn message_stage() -> OutboxStage {
    OutboxStage::new(&OutboxConfig {
        message_prefix: "outbox".into(),
        ..OutboxConfig::default()
    })
}

fn begin(s: &mut OutboxStage) {
    s.step(Message::Begin {
        final_lsn: Lsn(0x2000),
        commit_ts: 5,
        xid: 1,
    })
    .unwrap();
}

const GOOD: &str = r#"{"id":"m-1","aggregate_type":"Claim","aggregate_id":"4711",
    "event_type":"ClaimApproved","payload": {"b": 1,  "a":[2]} ,"headers":{"traceparent":"00-x"}}"#;

#[test]
fn message_event_shares_the_transaction_index_and_keeps_the_payload_text() {
    let mut s = message_stage();
    begin(&mut s);
    s.step(outbox_relation(7, DEFAULT_COLS)).unwrap();
    let row = |id: &str| vec![t(id), t("Claim"), t("1"), t("E"), t("{}"), t("x")];
    let a = event(s.step(insert(7, row("r-1"))).unwrap());
    let m = event(s.step(message(true, "outbox", GOOD)).unwrap());
    let b = event(s.step(insert(7, row("r-2"))).unwrap());
    assert_eq!((a.index, m.index, b.index), (0, 1, 2));
    assert_eq!(m.problem, None);
    assert_eq!(m.msg_id, "m-1");
    assert_eq!(m.aggregate_type.as_deref(), Some("Claim"));
    assert_eq!(m.aggregate_id.as_deref(), Some("4711"));
    assert_eq!(m.event_type.as_deref(), Some("ClaimApproved"));
    assert_eq!(&m.payload[..], br#"{"b": 1,  "a":[2]}"#, "as written");
    assert_eq!(m.headers, vec![("traceparent".into(), "00-x".into())]);
    assert_eq!(m.commit_lsn, Lsn(0x2000));
    assert_eq!(m.commit_ts, 5);
    assert_eq!(m.content_type, Some(JSON_CONTENT_TYPE));
}

#[test]
fn other_prefixes_and_no_prefix_are_ignored() {
    let mut s = message_stage();
    begin(&mut s);
    assert_eq!(s.step(message(true, "other", GOOD)).unwrap(), Step::Nothing);
    assert_eq!(
        s.step(message(true, "outboxx", GOOD)).unwrap(),
        Step::Nothing
    );
    let mut s = stage();
    begin(&mut s);
    assert_eq!(s.step(message(true, "", GOOD)).unwrap(), Step::Nothing);
}

#[test]
fn malformed_messages_are_invalid_events_with_the_content_as_payload() {
    for (content, why) in [
        ("not json", "not JSON"),
        ("[1,2,3,4,5]", "not a JSON object"),
        (
            r#"{"id":"m","aggregate_type":"A","aggregate_id":"1","event_type":"E"}"#,
            "lacks \"payload\"",
        ),
        (
            r#"{"aggregate_type":"A","aggregate_id":"1","event_type":"E","payload":1}"#,
            "lacks \"id\"",
        ),
        (
            r#"{"id":"m","aggregate_type":null,"aggregate_id":"1","event_type":"E","payload":1}"#,
            "\"aggregate_type\" is null",
        ),
        (
            r#"{"id":"m","aggregate_type":"A","aggregate_id":"1","event_type":7,"payload":1}"#,
            "\"event_type\" is not a string",
        ),
        (
            r#"{"id":"m","aggregate_type":"A","aggregate_id":"1","event_type":"E","payload":1,"headers":{"Nats-Msg-Id":"x"}}"#,
            "reserved",
        ),
    ] {
        let mut s = message_stage();
        begin(&mut s);
        let e = event(s.step(message(true, "outbox", content)).unwrap());
        let problem = e.problem.unwrap_or_default();
        assert!(problem.contains(why), "{content}: {problem}");
        assert_eq!(&e.payload[..], content.as_bytes());
    }
    let mut s = message_stage();
    begin(&mut s);
    let e = event(s.step(message(true, "outbox", "{}")).unwrap());
    assert_eq!(
        e.msg_id,
        crate::event::message_id(None, Lsn(0x2000), 0, &e.payload),
        "no id: WAL-derived"
    );
    assert!(e.msg_id.starts_with("lsn:0/2000:0:"));
    // A null aggregate id is allowed, like a NULL column.
    let e = event(
        s.step(message(
            true,
            "outbox",
            r#"{"id":"m","aggregate_type":"A","aggregate_id":null,"event_type":"E","payload":null}"#,
        ))
        .unwrap(),
    );
    assert_eq!(e.problem, None);
    assert_eq!(&e.payload[..], b"null");
}

#[test]
fn non_transactional_message_is_a_standalone_dead_letter() {
    let mut s = message_stage();
    let Step::Standalone { event, end_lsn } = s.step(message(false, "outbox", GOOD)).unwrap()
    else {
        panic!("expected a standalone event")
    };
    assert_eq!(end_lsn, Lsn(0x3000));
    assert!(
        event
            .problem
            .unwrap()
            .contains("pg_logical_emit_message(true")
    );
    assert!(
        event.msg_id.starts_with("lsn:0/3000:non-transactional:"),
        "{}",
        event.msg_id
    );
    // It opened nothing: a transaction still begins and commits normally.
    begin(&mut s);
    s.step(Message::Commit {
        flags: 0,
        commit_lsn: Lsn(0x2000),
        end_lsn: Lsn(0x2100),
        commit_ts: 5,
    })
    .unwrap();
    assert_eq!(
        s.step(message(true, "outbox", GOOD)).unwrap_err(),
        StageError::MessageWithoutBegin(Lsn(0x3000))
    );
}

#[test]
fn header_columns_become_headers_and_null_gives_none() {
    let config = OutboxConfig {
        headers_column: "headers".into(),
        header_columns: vec!["tenant_id".into(), "region:X-Region".into()],
        ..OutboxConfig::default()
    };
    let mut s = OutboxStage::new(&config).with_cloudevents(true);
    let mut cols = DEFAULT_COLS.to_vec();
    cols.extend([("headers", 3802), ("tenant_id", 23), ("region", 25)]);
    s.step(outbox_relation(7, &cols)).unwrap();
    let row = |h: TupleValue, tenant: TupleValue, region: TupleValue| {
        vec![
            t("1"),
            t("A"),
            t("2"),
            t("E"),
            t("{}"),
            t("x"),
            h,
            tenant,
            region,
        ]
    };
    let e = event(
        s.step(insert(
            7,
            row(t(r#"{"tenant_id":"from-json","k":"v"}"#), t("42"), t("eu")),
        ))
        .unwrap(),
    );
    assert_eq!(e.problem, None);
    assert_eq!(
        e.headers,
        vec![
            ("k".to_owned(), "v".to_owned()),
            ("tenant_id".to_owned(), "from-json".to_owned()),
            ("tenant_id".to_owned(), "42".to_owned()),
            ("X-Region".to_owned(), "eu".to_owned()),
        ],
        "the column comes after the headers column's key of the same name, and wins"
    );
    let e = event(
        s.step(insert(7, row(TupleValue::Null, TupleValue::Null, t("eu"))))
            .unwrap(),
    );
    assert_eq!(e.headers, vec![("X-Region".to_owned(), "eu".to_owned())]);
    // With CloudEvents on, ce-* is the relay's.
    let e = event(
        s.step(insert(7, row(t(r#"{"ce-id":"x"}"#), t("1"), t("eu"))))
            .unwrap(),
    );
    assert!(e.problem.unwrap().contains("reserved"));
    // A dropped header column is a missing column.
    s.step(outbox_relation(7, &cols[..8])).unwrap();
    let e = event(
        s.step(insert(
            7,
            vec![
                t("1"),
                t("A"),
                t("2"),
                t("E"),
                t("{}"),
                t("x"),
                TupleValue::Null,
                t("1"),
            ],
        ))
        .unwrap(),
    );
    assert!(e.problem.unwrap().contains("region"));
}

#[test]
fn content_type_follows_the_payload_column_type() {
    for (oid, ct) in [
        (3802, Some(JSON_CONTENT_TYPE)),
        (114, Some(JSON_CONTENT_TYPE)),
        (25, Some(TEXT_CONTENT_TYPE)),
        (17, None),
    ] {
        let mut s = stage();
        let mut cols = DEFAULT_COLS.to_vec();
        cols[4] = ("payload", oid);
        s.step(outbox_relation(7, &cols)).unwrap();
        let e = event(
            s.step(insert(
                7,
                vec![t("1"), t("A"), t("2"), t("E"), t("\\x00"), t("x")],
            ))
            .unwrap(),
        );
        assert_eq!(e.content_type, ct, "type {oid}");
    }
}

#[test]
fn schemas_turn_failing_payloads_into_dead_letters_and_name_the_schema() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("E.json"),
        r#"{"$id": "urn:e", "type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}"#,
    )
    .unwrap();
    let set = crate::schema::SchemaSet::load(dir.path().to_str().unwrap(), false).unwrap();
    let schemas = crate::schema::Schemas::new(set);
    let metrics = Arc::new(crate::schema::SchemaMetrics::default());
    let mut s = stage().with_schemas(&schemas, Arc::clone(&metrics));
    s.step(outbox_relation(1, DEFAULT_COLS)).unwrap();
    let row = |ty: &str, payload: &str| {
        insert(1, vec![t("1"), t("A"), t("2"), t(ty), t(payload), t("x")])
    };
    let good = event(s.step(row("E", r#"{"n": 1}"#)).unwrap());
    assert_eq!(good.problem, None);
    assert_eq!(good.data_schema.as_deref(), Some("urn:e"));
    let bad = event(s.step(row("E", r#"{"n": "1"}"#)).unwrap());
    assert_eq!(
        bad.problem.as_deref(),
        Some(r#"E: /n: "1" is not of type "integer" (type)"#)
    );
    assert_eq!(bad.data_schema, None);
    let other = event(s.step(row("F", "not even json")).unwrap());
    assert_eq!(other.problem, None, "a type without a schema passes");
    assert_eq!(metrics.failures("E"), 1);
    // A reload is seen by the next event.
    schemas.replace(Arc::new(crate::schema::SchemaSet::load("", false).unwrap()));
    assert_eq!(
        event(s.step(row("E", r#"{"n": "1"}"#)).unwrap()).problem,
        None
    );
}

/// A payload over `INLINE_BYTES` is not checked on the runtime thread: the stage leaves the check
/// to the sink (`schema_check`), which runs it on the blocking pool; its verdict is the one the
/// inline check gives (a pass names the schema, a failure is a counted dead letter), and a check that
/// runs out of its budget makes the event a dead letter saying so. The set in force when the event
/// arrived is the one it is checked against, whatever a reload does meanwhile.
#[test]
fn large_payloads_are_checked_off_the_runtime_thread_within_a_budget() {
    // One blocking thread, which the test can keep busy: then a check cannot start, and its budget
    // runs out whatever the machine's speed.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .max_blocking_threads(1)
        .build()
        .unwrap();
    rt.block_on(large_payloads_checked_later());
}

async fn large_payloads_checked_later() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("E.json"),
        r#"{"$id": "urn:e", "type": "object", "properties": {"n": {"type": "integer"}, "text": {"type": "string", "pattern": "^(\\w+\\s?)*$"}}}"#,
    )
    .unwrap();
    let set = crate::schema::SchemaSet::load(dir.path().to_str().unwrap(), false).unwrap();
    let schemas = crate::schema::Schemas::new(set);
    let metrics = Arc::new(crate::schema::SchemaMetrics::default());
    let mut s = stage().with_schemas(&schemas, Arc::clone(&metrics));
    s.step(outbox_relation(1, DEFAULT_COLS)).unwrap();
    let words = "word ".repeat(crate::schema::INLINE_BYTES / 4);
    let mut row = |n: &str, text: &str| {
        let payload = format!(r#"{{"n": {n}, "text": "{text}"}}"#);
        event(
            s.step(insert(
                1,
                vec![t("1"), t("A"), t("2"), t("E"), t(&payload), t("x")],
            ))
            .unwrap(),
        )
    };
    // A small one is checked at once, as before.
    let small = row(r#""1""#, "a few words");
    assert!(small.schema_check.is_none());
    assert!(small.problem.is_some());
    let mut good = row("1", words.trim_end());
    let mut bad = row(r#""1""#, words.trim_end());
    let mut slow = row("2", words.trim_end());
    for e in [&good, &bad, &slow] {
        assert!(e.schema_check.is_some(), "left to the sink");
        assert_eq!(
            (e.problem.as_deref(), e.data_schema.as_deref()),
            (None, None)
        );
    }
    // A reload before the sink runs the check does not change what the event is checked against.
    schemas.replace(Arc::new(crate::schema::SchemaSet::load("", false).unwrap()));

    good.check_schema().await;
    assert_eq!(good.problem, None);
    assert_eq!(good.data_schema.as_deref(), Some("urn:e"));
    bad.check_schema().await;
    assert_eq!(
        bad.problem.as_deref(),
        Some(r#"E: /n: "1" is not of type "integer" (type)"#)
    );
    let (release, busy) = std::sync::mpsc::channel::<()>();
    let blocker = tokio::task::spawn_blocking(move || busy.recv());
    slow.check_schema_within(std::time::Duration::from_millis(50))
        .await;
    release.send(()).unwrap();
    blocker.await.unwrap().unwrap();
    let why = slow.problem.as_deref().unwrap_or("");
    assert!(why.starts_with("E: the schema check of its "), "{why}");
    assert!(
        why.contains("byte payload ran out of its 0.05 s budget"),
        "{why}"
    );
    assert_eq!(slow.data_schema, None);
    assert_eq!(metrics.failures("E"), 3);
}

#[test]
fn bytea_payloads_are_checked_as_their_bytes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("E.json"), r#"{"type": "object"}"#).unwrap();
    let set = crate::schema::SchemaSet::load(dir.path().to_str().unwrap(), false).unwrap();
    let mut s = stage().with_schemas(&crate::schema::Schemas::new(set), Default::default());
    let mut cols = DEFAULT_COLS.to_vec();
    cols[4] = ("payload", 17);
    s.step(outbox_relation(1, &cols)).unwrap();
    let row = |hex: &str| insert(1, vec![t("1"), t("A"), t("2"), t("E"), t(hex), t("x")]);
    // {"a":1}
    assert_eq!(
        event(s.step(row("\\x7b2261223a317d")).unwrap()).problem,
        None
    );
    let bad = event(s.step(row("\\x0001")).unwrap());
    assert!(
        bad.problem
            .as_deref()
            .unwrap()
            .starts_with("E: the bytea payload is not JSON"),
        "{bad:?}"
    );
}

fn context_stage() -> OutboxStage {
    OutboxStage::new(&OutboxConfig {
        message_prefix: "outbox".into(),
        context_prefix: "outbox-context".into(),
        ..OutboxConfig::default()
    })
}

#[test]
fn a_context_message_gives_its_headers_to_the_events_after_it_in_its_transaction() {
    let mut s = context_stage();
    begin(&mut s);
    s.step(outbox_relation(7, DEFAULT_COLS)).unwrap();
    let row = |id: &str| vec![t(id), t("Claim"), t("1"), t("E"), t("{}"), t("x")];
    let before = event(s.step(insert(7, row("r-0"))).unwrap());
    let ctx = r#"{"traceparent":"00-ctx","baggage":"k=v"}"#;
    assert_eq!(
        s.step(message(true, "outbox-context", ctx)).unwrap(),
        Step::Nothing
    );
    let row_event = event(s.step(insert(7, row("r-1"))).unwrap());
    // A message event's own traceparent wins; the rest of the context is added.
    let m = event(s.step(message(true, "outbox", GOOD)).unwrap());
    assert!(before.headers.is_empty(), "{:?}", before.headers);
    assert_eq!(
        row_event.headers,
        vec![
            ("baggage".into(), "k=v".into()),
            ("traceparent".into(), "00-ctx".into())
        ]
    );
    assert_eq!(
        m.headers,
        vec![
            ("traceparent".into(), "00-x".into()),
            ("baggage".into(), "k=v".into())
        ]
    );
    // The context message takes no place among the events.
    assert_eq!((before.index, row_event.index, m.index), (0, 1, 2));
    // A later one replaces it; the next transaction starts without any.
    s.step(message(true, "outbox-context", r#"{"traceparent":"00-2"}"#))
        .unwrap();
    let later = event(s.step(insert(7, row("r-2"))).unwrap());
    assert_eq!(later.headers, vec![("traceparent".into(), "00-2".into())]);
    s.step(Message::Commit {
        flags: 0,
        commit_lsn: Lsn(0x2000),
        end_lsn: Lsn(0x2100),
        commit_ts: 5,
    })
    .unwrap();
    begin(&mut s);
    let next = event(s.step(insert(7, row("r-3"))).unwrap());
    assert!(next.headers.is_empty(), "{:?}", next.headers);
}

#[test]
fn a_bad_or_non_transactional_context_message_is_a_dead_letter_not_a_silent_drop() {
    let mut s = context_stage();
    begin(&mut s);
    s.step(outbox_relation(7, DEFAULT_COLS)).unwrap();
    s.step(message(true, "outbox-context", r#"{"traceparent":"00-1"}"#))
        .unwrap();
    let bad = event(
        s.step(message(true, "outbox-context", r#"{"traceparent": 1}"#))
            .unwrap(),
    );
    let problem = bad.problem.as_deref().unwrap();
    assert!(
        problem.contains("trace context message") && problem.contains("not a string"),
        "{problem}"
    );
    assert_eq!(&bad.payload[..], br#"{"traceparent": 1}"#);
    assert!(bad.msg_id.starts_with("lsn:0/2000:0:"), "{}", bad.msg_id);
    // The bad one also ends the earlier context.
    let row = vec![t("r-1"), t("Claim"), t("1"), t("E"), t("{}"), t("x")];
    let after = event(s.step(insert(7, row)).unwrap());
    assert_eq!(after.index, 1);
    assert!(after.headers.is_empty(), "{:?}", after.headers);
    match s
        .step(message(
            false,
            "outbox-context",
            r#"{"traceparent":"00-1"}"#,
        ))
        .unwrap()
    {
        Step::Standalone { event, end_lsn } => {
            assert_eq!(end_lsn, Lsn(0x3000));
            assert!(
                event
                    .problem
                    .as_deref()
                    .is_some_and(|p| p.contains("non-transactional")),
                "{event:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}
