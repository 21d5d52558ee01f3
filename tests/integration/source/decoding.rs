//! What real servers send that hand-made frames miss (docs/pgoutput.md, "Message layouts the
//! decoder reads" and classic bugs 5 and 7): unchanged TOAST
//! values (`'u'`) and where the full value is, and a Relation message that changes in the middle of a
//! transaction.

use std::time::Duration;

use outbox_relay::Lsn;
use outbox_relay::pgoutput::{Decoder, Message, OldTuple, TupleValue};

use super::{config, create_slot, options, read_txns, start, text};
use crate::support::{PgServer, TestDb};

#[tokio::test]
async fn update_of_another_column_sends_unchanged_toast_and_full_identity_sends_old_value() {
    let db = TestDb::create(PgServer::shared()).await;
    let client = db.client().await;
    // EXTERNAL: out of line and uncompressed, so the value is TOASTed whatever pglz would make of it.
    client
        .batch_execute(&format!(
            "CREATE TABLE t (id int PRIMARY KEY, n int NOT NULL, big text NOT NULL);
             ALTER TABLE t ALTER COLUMN big SET STORAGE EXTERNAL;
             CREATE PUBLICATION {} FOR TABLE t;",
            db.publication_name()
        ))
        .await
        .unwrap();
    let slot = db.slot_name();
    create_slot(&db, &slot).await;
    // One transaction each (a multi-statement simple query would be a single one).
    for sql in [
        "INSERT INTO t SELECT 1, 0, string_agg(md5(i::text), '') FROM generate_series(1, 500) i",
        "UPDATE t SET n = 1 WHERE id = 1",
        "ALTER TABLE t REPLICA IDENTITY FULL",
        "UPDATE t SET n = 2 WHERE id = 1",
    ] {
        client.batch_execute(sql).await.unwrap();
    }
    let big: String = client
        .query_one("SELECT big FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert!(big.len() > 8192, "{}", big.len());
    let mut stream = start(&db, &slot, Lsn::ZERO, &options(&db), config())
        .await
        .stream;
    let txns = read_txns(&mut stream, &mut Decoder::new(), 3).await;
    stream.stop(Duration::from_secs(5)).await.unwrap();

    let updates: Vec<_> = txns
        .iter()
        .flat_map(|t| &t.changes)
        .filter_map(|m| match m {
            Message::Update { old, new, .. } => Some((old.clone(), new.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(updates.len(), 2, "{txns:?}");
    let inserted = txns[0].inserted();
    assert_eq!(inserted[0][2].as_deref(), Some(big.as_str()));

    // DEFAULT identity, key unchanged: no old tuple, and the big column is not sent.
    let (old, new) = &updates[0];
    assert_eq!(old, &None);
    assert_eq!(text(&new[0]).as_deref(), Some("1"));
    assert_eq!(text(&new[1]).as_deref(), Some("1"));
    assert_eq!(new[2], TupleValue::UnchangedToast);

    // FULL identity: the old tuple carries the detoasted value.
    let (old, new) = &updates[1];
    let Some(OldTuple::Full(old)) = old else {
        panic!("expected an 'O' old tuple, got {old:?}");
    };
    assert_eq!(text(&old[1]).as_deref(), Some("1"));
    assert_eq!(text(&old[2]).as_deref(), Some(big.as_str()));
    assert_eq!(text(&new[1]).as_deref(), Some("2"));
    assert!(
        new[2] == TupleValue::UnchangedToast || text(&new[2]).as_deref() == Some(big.as_str()),
        "{:?}",
        new[2]
    );
}

#[tokio::test]
async fn alter_table_inside_a_transaction_sends_a_new_relation_before_the_next_insert() {
    let db = TestDb::create(PgServer::shared()).await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE r (id int PRIMARY KEY, v text);
             CREATE PUBLICATION {} FOR TABLE r WITH (publish = 'insert');",
            db.publication_name()
        ))
        .await
        .unwrap();
    let slot = db.slot_name();
    create_slot(&db, &slot).await;
    client
        .batch_execute(
            "BEGIN;
             INSERT INTO r VALUES (1, 'a');
             ALTER TABLE r ADD COLUMN c text;
             INSERT INTO r VALUES (2, 'b', 'c');
             COMMIT;",
        )
        .await
        .unwrap();

    let mut stream = start(&db, &slot, Lsn::ZERO, &options(&db), config())
        .await
        .stream;
    let txn = read_txns(&mut stream, &mut Decoder::new(), 1)
        .await
        .remove(0);
    stream.stop(Duration::from_secs(5)).await.unwrap();

    let shape: Vec<String> = txn
        .changes
        .iter()
        .map(|m| match m {
            Message::Relation(r) => format!(
                "R({})",
                r.columns
                    .iter()
                    .map(|c| c.name.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Message::Insert { new, .. } => format!("I({})", new.len()),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(shape, ["R(id,v)", "I(2)", "R(id,v,c)", "I(3)"], "{txn:?}");
    let ids: Vec<u32> = txn
        .changes
        .iter()
        .map(|m| match m {
            Message::Relation(r) => r.id,
            Message::Insert { relation_id, .. } => *relation_id,
            _ => 0,
        })
        .collect();
    assert!(ids.iter().all(|&id| id == ids[0]), "{ids:?}");
    assert_eq!(
        txn.inserted(),
        [
            vec![Some("1".into()), Some("a".into())],
            vec![Some("2".into()), Some("b".into()), Some("c".into())],
        ]
    );
}
