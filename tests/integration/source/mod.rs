//! Integration tests of the replication source (`src/source/`) against real Postgres: the classic
//! pgoutput-client bugs of
//! docs/pgoutput.md#the-classic-client-bugs-and-the-tests-that-guard-against-them, each test built
//! so it fails when its
//! behaviour breaks.
//!
//! The helpers here read the stream the way a relay would, but without a sink: decode every XLogData,
//! group Begin…Commit into a [`Txn`], and confirm only what a test decides to confirm. [`barrier`] is
//! how a test knows that "nothing more is coming": it writes a WAL record no publication sends, and
//! once a keepalive's WAL end reaches it the walsender has decoded (and sent) everything before it.

mod auth;
mod decoding;
mod impostor;
mod liveness;
mod lsn;
mod options;

use std::time::{Duration, Instant};

use outbox_relay::Lsn;
use outbox_relay::pgoutput::{Decoder, Message, TupleValue};
use outbox_relay::source::{
    ConnInfo, PgOutputOptions, ReplConnection, ReplicationEvent, ReplicationStream, SourceError,
    StreamConfig,
};

use crate::support::{TestDb, unique};

/// How long a test waits for something the server sends promptly.
pub(crate) const PROMPT: Duration = Duration::from_secs(15);

/// A replication connection to `url`, with a unique application name.
pub(crate) async fn connect(url: &str) -> Result<ReplConnection, SourceError> {
    let info = ConnInfo::parse(url).unwrap_or_else(|e| panic!("parse {url}: {e}"));
    ReplConnection::connect(&info, &unique("source_test")).await
}

/// A superuser replication connection to the test database, plain TCP.
pub(crate) async fn repl(db: &TestDb) -> ReplConnection {
    let url = format!("{}?sslmode=disable", db.url());
    connect(&url)
        .await
        .unwrap_or_else(|e| panic!("replication connection to {url}: {e}"))
}

/// Creates the persistent pgoutput slot `slot` in the test database; returns its consistent point.
pub(crate) async fn create_slot(db: &TestDb, slot: &str) -> Lsn {
    let mut conn = repl(db).await;
    let lsn = conn
        .create_slot(slot, false)
        .await
        .unwrap_or_else(|e| panic!("create slot {slot}: {e}"));
    conn.close().await;
    lsn
}

pub(crate) fn options(db: &TestDb) -> PgOutputOptions {
    PgOutputOptions::new([db.publication_name()])
}

pub(crate) fn config() -> StreamConfig {
    StreamConfig {
        status_interval: Duration::from_secs(1),
        channel_capacity: 1024,
        ..StreamConfig::default()
    }
}

/// What [`start`] met on the way.
pub(crate) struct Started {
    pub stream: ReplicationStream,
    /// "slot is active for PID" answers seen (and retried) before streaming started.
    pub slot_busy: usize,
}

/// `START_REPLICATION` on a fresh connection. While an old walsender still holds the slot (55006) it
/// retries with backoff for up to 15 s, checking that the error is classed transient.
pub(crate) async fn start(
    db: &TestDb,
    slot: &str,
    from: Lsn,
    options: &PgOutputOptions,
    config: StreamConfig,
) -> Started {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut backoff = Duration::from_millis(100);
    let mut slot_busy = 0;
    loop {
        let conn = repl(db).await;
        match conn
            .start_replication(slot, from, options, config.clone())
            .await
        {
            Ok(stream) => return Started { stream, slot_busy },
            Err((e, conn)) if e.sqlstate() == Some("55006") && Instant::now() < deadline => {
                assert!(e.is_transient(), "slot busy must be transient: {e}");
                slot_busy += 1;
                if let Some(conn) = conn {
                    conn.close().await;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Err((e, _)) => panic!("START_REPLICATION {slot} from {from}: {e}"),
        }
    }
}

/// One event from the stream, decoded.
#[derive(Debug)]
pub(crate) enum Event {
    Msg(Message),
    Keepalive(Lsn),
}

/// The next event; panics on a stream error, the end of the stream, or nothing within `within`.
pub(crate) async fn next_event(
    stream: &mut ReplicationStream,
    decoder: &mut Decoder,
    within: Duration,
) -> Event {
    match tokio::time::timeout(within, stream.recv()).await {
        Err(_) => panic!("no replication event within {within:?}"),
        Ok(None) => panic!("replication stream ended"),
        Ok(Some(Err(e))) => panic!("replication stream error: {e}"),
        Ok(Some(Ok(ReplicationEvent::XLogData {
            wal_start, data, ..
        }))) => Event::Msg(
            decoder
                .decode(data, wal_start)
                .unwrap_or_else(|e| panic!("decode at {wal_start}: {e}")),
        ),
        Ok(Some(Ok(ReplicationEvent::Keepalive { wal_end, .. }))) => Event::Keepalive(wal_end),
    }
}

/// A decoded transaction.
#[derive(Debug, Clone)]
pub(crate) struct Txn {
    /// `Begin.final_lsn`.
    pub final_lsn: Lsn,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    /// Everything between Begin and Commit (Relation messages included), in order.
    pub changes: Vec<Message>,
}

impl Txn {
    /// The text values of every Insert, in order (NULL as `None`).
    pub(crate) fn inserted(&self) -> Vec<Vec<Option<String>>> {
        self.changes
            .iter()
            .filter_map(|m| match m {
                Message::Insert { new, .. } => Some(new.iter().map(text).collect()),
                _ => None,
            })
            .collect()
    }
}

/// A text column as a String; `None` for anything else.
pub(crate) fn text(v: &TupleValue) -> Option<String> {
    match v {
        TupleValue::Text(b) => Some(String::from_utf8(b.to_vec()).expect("UTF-8 text value")),
        _ => None,
    }
}

/// Groups messages into transactions; messages outside Begin…Commit are returned separately.
pub(crate) fn group(messages: Vec<Message>) -> (Vec<Txn>, Vec<Message>) {
    let mut txns = Vec::new();
    let mut outside = Vec::new();
    let mut open: Option<Txn> = None;
    for m in messages {
        match (m, open.as_mut()) {
            (Message::Begin { final_lsn, .. }, None) => {
                open = Some(Txn {
                    final_lsn,
                    commit_lsn: Lsn::ZERO,
                    end_lsn: Lsn::ZERO,
                    changes: Vec::new(),
                })
            }
            (m @ Message::Begin { .. }, Some(t)) => panic!("Begin {m:?} inside open txn {t:?}"),
            (
                Message::Commit {
                    commit_lsn,
                    end_lsn,
                    ..
                },
                Some(_),
            ) => {
                let mut t = open.take().expect("open txn");
                t.commit_lsn = commit_lsn;
                t.end_lsn = end_lsn;
                assert_eq!(t.final_lsn, t.commit_lsn, "Begin.final_lsn != commit_lsn");
                txns.push(t);
            }
            (m, Some(t)) => t.changes.push(m),
            (m, None) => outside.push(m),
        }
    }
    assert!(open.is_none(), "transaction left open: {open:?}");
    (txns, outside)
}

/// Reads until `n` transactions are complete. Keepalives are skipped and nothing is confirmed.
pub(crate) async fn read_txns(
    stream: &mut ReplicationStream,
    decoder: &mut Decoder,
    n: usize,
) -> Vec<Txn> {
    let mut messages = Vec::new();
    let mut commits = 0;
    while commits < n {
        if let Event::Msg(m) = next_event(stream, decoder, PROMPT).await {
            commits += usize::from(matches!(m, Message::Commit { .. }));
            messages.push(m);
        }
    }
    let (txns, outside) = group(messages);
    assert!(outside.is_empty(), "messages outside a txn: {outside:?}");
    txns
}

/// Writes a WAL record no publication sends (a transactional logical message, ignored without
/// `messages 'true'`; its commit flushes it) and returns its end.
pub(crate) async fn barrier(client: &tokio_postgres::Client) -> Lsn {
    let row = client
        .query_one(
            "SELECT pg_logical_emit_message(true, 'barrier', '')::text",
            &[],
        )
        .await
        .expect("emit barrier message");
    row.get::<_, String>(0).parse().expect("barrier LSN")
}

/// Every message the stream sends until a keepalive shows the walsender decoded past `barrier`.
/// Nothing is confirmed.
pub(crate) async fn read_until(
    stream: &mut ReplicationStream,
    decoder: &mut Decoder,
    barrier: Lsn,
) -> Vec<Message> {
    let deadline = Instant::now() + PROMPT;
    let mut messages = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no keepalive past {barrier} within {PROMPT:?}"
        );
        match next_event(stream, decoder, left).await {
            Event::Msg(m) => messages.push(m),
            Event::Keepalive(end) if end >= barrier => return messages,
            Event::Keepalive(_) => {}
        }
    }
}

/// `pg_replication_slots` as a test sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotState {
    pub confirmed_flush: Lsn,
    pub restart: Lsn,
    pub active: bool,
}

pub(crate) async fn slot_state(client: &tokio_postgres::Client, slot: &str) -> SlotState {
    let row = client
        .query_one(
            "SELECT confirmed_flush_lsn::text, restart_lsn::text, active \
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap_or_else(|e| panic!("slot {slot}: {e}"));
    let lsn = |i: usize| {
        row.get::<_, Option<String>>(i)
            .map_or(Lsn::ZERO, |s| s.parse().expect("slot LSN"))
    };
    SlotState {
        confirmed_flush: lsn(0),
        restart: lsn(1),
        active: row.get(2),
    }
}

/// Waits until the slot's `confirmed_flush_lsn` is at least `lsn`.
pub(crate) async fn wait_confirmed(client: &tokio_postgres::Client, slot: &str, lsn: Lsn) {
    crate::support::wait_for(
        &format!("slot {slot} confirmed_flush_lsn >= {lsn}"),
        PROMPT,
        move || async move { slot_state(client, slot).await.confirmed_flush >= lsn },
    )
    .await;
}

/// How many rows of `pg_stat_replication` the walsender `pid` has (0 or 1).
pub(crate) async fn walsenders(client: &tokio_postgres::Client, pid: i32) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_stat_replication WHERE pid = $1",
            &[&pid],
        )
        .await
        .unwrap()
        .get(0)
}
