//! A stalled consumer must not get the walsender to time out (docs/pgoutput.md, "The standby status
//! update" and classic bug 10): status
//! updates run on their own timer, not on `recv()`.

use std::time::Duration;

use outbox_relay::Lsn;
use outbox_relay::pgoutput::Decoder;
use outbox_relay::source::StreamConfig;

use super::{create_slot, options, read_txns, start};
use crate::support::{PgServer, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_consumer_outlives_wal_sender_timeout() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let client = db.client().await;
    let timeout: String = client
        .query_one("SHOW wal_sender_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        timeout, "10s",
        "the test stalls for 2.5 x wal_sender_timeout"
    );
    client
        .batch_execute(&format!(
            "CREATE TABLE a (id int PRIMARY KEY);
             CREATE PUBLICATION {} FOR TABLE a WITH (publish = 'insert');",
            db.publication_name()
        ))
        .await
        .unwrap();
    let slot = db.slot_name();
    create_slot(&db, &slot).await;
    let config = StreamConfig {
        status_interval: Duration::from_secs(1),
        channel_capacity: 4,
        ..StreamConfig::default()
    };
    let mut stream = start(&db, &slot, Lsn::ZERO, &options(&db), config)
        .await
        .stream;
    let pid = stream.backend_pid();
    assert!(pid > 0);

    // The consumer stalls for 25 s while a row arrives every second; the reader fills the channel
    // and blocks. Meanwhile the walsender must keep hearing from us.
    const ROWS: i32 = 25;
    for id in 1..=ROWS {
        client
            .execute("INSERT INTO a VALUES ($1)", &[&id])
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let row = client
        .query_opt(
            "SELECT extract(epoch FROM now() - reply_time)::float8 \
               FROM pg_stat_replication WHERE pid = $1",
            &[&pid],
        )
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("walsender {pid} gone while the consumer stalled"));
    let since_reply: f64 = row.get(0);
    assert!(
        since_reply < 3.0,
        "last status update {since_reply:.1}s ago while the consumer stalled"
    );

    let txns = read_txns(&mut stream, &mut Decoder::new(), ROWS as usize).await;
    let ids: Vec<_> = txns
        .iter()
        .flat_map(|t| t.inserted())
        .map(|row| row[0].clone().unwrap())
        .collect();
    let expected: Vec<_> = (1..=ROWS).map(|i| i.to_string()).collect();
    assert_eq!(ids, expected);
    stream.confirm(txns.last().unwrap().end_lsn);
    stream.send_status_now();
    assert_eq!(
        super::walsenders(&client, pid).await,
        1,
        "walsender {pid} is not the stream's any more"
    );
    stream.stop(Duration::from_secs(5)).await.unwrap();
}
