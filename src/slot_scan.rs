//! Looking into the changes a slot has not confirmed yet, for outbox events: `status` asks whether
//! an event waits in an idle slot, and the relay asks whether another client consumed its slot past
//! events the stream lacks (`relay/slot_mark.rs`).
//!
//! The changes are peeked (`pg_logical_slot_peek_binary_changes`, nothing is consumed) with the
//! relay's own pgoutput options and judged by the relay's own decoder and outbox stage, so an event
//! is exactly what a relay would publish: inserts into the outbox table or its partitions, logical
//! messages under `outbox.message_prefix`. Updates, deletes and truncates of the outbox, other tables
//! and other prefixes are not events, however many come first; the first event is found behind any
//! number of them up to the bound.
//!
//! `verify` looks further: every pending event up to the rows' snapshot, each handed to it as the
//! look finds it ([`scan_each`]), so that a row whose event the slot still holds is told apart from
//! a missing one without a clock.
//!
//! The look is bounded twice: in changes (`upto_nchanges`; rows are read one at a time, so memory
//! stays small whatever their size) and in time (`statement_timeout`). When a bound ends it with
//! WAL still pending and no event found, the answer is "unknown", never "none".

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tokio_postgres::Client;

use crate::Lsn;
use crate::config::Settings;
use crate::outbox::{OutboxStage, Step};
use crate::pgoutput::Decoder;
use crate::position::Position;

/// How far a look may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bound {
    /// At most this many pgoutput rows (the server ends at the first transaction boundary past it).
    pub(crate) changes: u32,
    /// At most this long (the session's `statement_timeout`).
    pub(crate) timeout: Duration,
}

impl Bound {
    /// What `status` and the relay's start allow: a look must answer within seconds, and the
    /// server keeps what it decoded (up to this many changes) in a tuplestore until it is read.
    pub(crate) const DEFAULT: Bound = Bound {
        changes: 20_000,
        timeout: Duration::from_secs(10),
    };
}

/// The first, cheap look of a search for the first event (see [`scan`]).
const FIRST_LOOK: u32 = 64;

/// An outbox event the look found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Found {
    /// Its position (commit LSN and index).
    pub(crate) position: Position,
    /// Its `Nats-Msg-Id`.
    pub(crate) id: String,
}

/// What a look saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Scan {
    /// Outbox events counted (all of them when the look is complete).
    pub(crate) events: u64,
    /// The first of them.
    pub(crate) first: Option<Found>,
    /// The last of them.
    pub(crate) last: Option<Found>,
    /// Why the look ended before the end of the pending WAL: `None` when it saw everything.
    pub(crate) unfinished: Option<String>,
}

impl Scan {
    /// An event was found, or there is none: `None` while unknown (a bound ended the look first).
    pub(crate) fn any(&self) -> Option<bool> {
        if self.events > 0 {
            Some(true)
        } else if self.unfinished.is_some() {
            None
        } else {
            Some(false)
        }
    }
}

/// What a look hands each event it counts to (see [`scan_each`]).
pub(crate) type Each<'a, 'f> = &'a mut (dyn FnMut(&Found) + Send + 'f);

/// Judges peeked pgoutput rows, in order, as the relay would; events at or before `after` are not
/// counted (the stream holds them), nor those of transactions committed at or after `before` (the
/// peek's `upto_lsn` ends at a record boundary, and may hand over the one straddling it).
pub(crate) struct Scanner {
    decoder: Decoder,
    stage: OutboxStage,
    after: Option<Position>,
    before: Option<Lsn>,
    scan: Scan,
    rows: u64,
}

impl Scanner {
    /// A scanner for `settings`' outbox, whose table has the partitions `partitions`.
    pub(crate) fn new(
        settings: &Settings,
        partitions: Vec<u32>,
        after: Option<Position>,
        before: Option<Lsn>,
    ) -> Self {
        let mut stage = OutboxStage::new(&settings.config().outbox);
        stage.set_partitions(partitions);
        Scanner {
            decoder: Decoder::new(),
            stage,
            after,
            before,
            scan: Scan::default(),
            rows: 0,
        }
    }

    /// One row of the peek: its LSN and its pgoutput message. A row that cannot be decoded or makes
    /// no sense ends the look as unknown: a relay would stop there too.
    pub(crate) fn row(&mut self, lsn: Lsn, data: Bytes) -> Result<(), String> {
        self.rows += 1;
        let msg = self
            .decoder
            .decode(data, lsn)
            .map_err(|e| format!("the change at {lsn} cannot be decoded: {e}"))?;
        let event = match self
            .stage
            .step(msg)
            .map_err(|e| format!("the change at {lsn}: {e}"))?
        {
            Step::Event(e) | Step::Standalone { event: e, .. } => e,
            _ => return Ok(()),
        };
        if self.after.is_some_and(|a| event.position <= a)
            || self.before.is_some_and(|b| event.position.lsn >= b)
        {
            return Ok(());
        }
        let found = Found {
            position: event.position,
            id: event.msg_id.clone(),
        };
        self.scan.events += 1;
        self.scan.first.get_or_insert_with(|| found.clone());
        self.scan.last = Some(found);
        Ok(())
    }

    /// Rows judged so far.
    pub(crate) fn rows(&self) -> u64 {
        self.rows
    }

    /// What was seen; `unfinished` says why the look ended early, if it did.
    pub(crate) fn finish(mut self, unfinished: Option<String>) -> Scan {
        self.scan.unfinished = unfinished;
        self.scan
    }
}

/// Peeks `slot` (which the caller must not need to stay unacquired: pass a copy or a mark) up to
/// `upto` (the end of the WAL when `None`) and counts the outbox events past `after`. With
/// `first_only` it stops at the first. `Err` only when the query could not be made at all.
pub(crate) async fn scan(
    settings: &Settings,
    pg: &Client,
    slot: &str,
    upto: Option<Lsn>,
    after: Option<Position>,
    first_only: bool,
    bound: Bound,
) -> Result<Scan, tokio_postgres::Error> {
    let look = Look {
        slot,
        upto,
        after,
        first_only,
        bound,
    };
    scan_with(settings, pg, look, None).await
}

/// [`scan`] of every pending event up to `upto` (none skipped as stored, no early end), handing
/// each one it counts to `each` as it goes. When the look is retried (the slot was busy), events
/// are handed again: `each` must not mind.
pub(crate) async fn scan_each(
    settings: &Settings,
    pg: &Client,
    slot: &str,
    upto: Option<Lsn>,
    bound: Bound,
    each: Each<'_, '_>,
) -> Result<Scan, tokio_postgres::Error> {
    let look = Look {
        slot,
        upto,
        after: None,
        first_only: false,
        bound,
    };
    scan_with(settings, pg, look, Some(each)).await
}

/// What one look reads: [`scan`]'s arguments.
struct Look<'a> {
    slot: &'a str,
    upto: Option<Lsn>,
    after: Option<Position>,
    first_only: bool,
    bound: Bound,
}

async fn scan_with(
    settings: &Settings,
    pg: &Client,
    look: Look<'_>,
    mut each: Option<Each<'_, '_>>,
) -> Result<Scan, tokio_postgres::Error> {
    let Look {
        slot,
        upto,
        after,
        first_only,
        bound,
    } = look;
    let partitions = match settings.config().outbox.table.as_str() {
        "" => Vec::new(),
        table => crate::catalog::partitions(pg, table).await?,
    };
    pg.batch_execute(&format!(
        "SET statement_timeout = {}",
        bound.timeout.as_millis()
    ))
    .await?;
    // A slot can be peeked by one backend at a time: a mark that `status` and a starting relay
    // look at together is busy for one of them for as long as the other's look takes (at most the
    // bound). Wait for it rather than report "unknown".
    let deadline = tokio::time::Instant::now() + bound.timeout + Duration::from_secs(2);
    let mut scan = Scan::default();
    for changes in stages(first_only, bound) {
        let stage = Bound { changes, ..bound };
        scan = loop {
            let mut scanner = Scanner::new(settings, partitions.clone(), after, upto);
            let ended = peek_into(
                settings,
                pg,
                slot,
                (upto, first_only, stage),
                &mut scanner,
                each.as_deref_mut(),
            )
            .await;
            match ended {
                Err(e) if in_use(&e) && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => break scanner.finish(Some(server_words(&e, stage))),
                Ok(unfinished) => break scanner.finish(unfinished),
            }
        };
        if scan.any().is_some() {
            break;
        }
    }
    let _ = pg.batch_execute("RESET statement_timeout").await;
    Ok(scan)
}

/// The looks a search makes, each bounded by this many changes. The server decodes every change
/// up to `upto_nchanges` before it returns the first row. A look for the first event usually finds
/// it in the first transaction: a small look first, the whole bound only when that one saw no
/// event and more is pending.
fn stages(first_only: bool, bound: Bound) -> Vec<u32> {
    if first_only && bound.changes > FIRST_LOOK {
        vec![FIRST_LOOK, bound.changes]
    } else {
        vec![bound.changes]
    }
}

/// [`scan`] over changes already read: `transactions` are the rows a peek hands over, one list
/// per transaction (the server's bound ends at a transaction's end), in order. The same looks, the
/// same judgement and the same bound; the deterministic simulation's Postgres hands its WAL this
/// way, so that what `status` and the relay's start conclude is checked against its own records.
#[cfg(any(test, feature = "test-support"))]
pub(crate) fn scan_changes(
    settings: &Settings,
    transactions: &[Vec<(Lsn, Bytes)>],
    upto: Option<Lsn>,
    after: Option<Position>,
    first_only: bool,
    bound: Bound,
) -> Scan {
    let mut scan = Scan::default();
    for changes in stages(first_only, bound) {
        let mut scanner = Scanner::new(settings, Vec::new(), after, upto);
        let unfinished = feed(&mut scanner, transactions, changes, first_only);
        scan = scanner.finish(unfinished);
        if scan.any().is_some() {
            break;
        }
    }
    scan
}

/// Feeds whole transactions to `scanner` until `changes` rows are judged, as a peek with
/// `upto_nchanges` does; returns why the look ended early, if it did.
#[cfg(any(test, feature = "test-support"))]
fn feed(
    scanner: &mut Scanner,
    transactions: &[Vec<(Lsn, Bytes)>],
    changes: u32,
    first_only: bool,
) -> Option<String> {
    for transaction in transactions {
        if scanner.rows() >= u64::from(changes) {
            break;
        }
        for (lsn, data) in transaction {
            if let Err(e) = scanner.row(*lsn, data.clone()) {
                return Some(e);
            }
            if first_only && scanner.scan.events > 0 {
                return None;
            }
        }
    }
    beyond(scanner.rows(), changes)
}

/// The slot is held by another backend (SQLSTATE 55006, "replication slot … is active for PID …").
pub(crate) fn in_use(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE)
}

/// Feeds the peek's rows to `scanner`; returns why the look ended early, if it did, or the
/// server's error.
async fn peek_into(
    settings: &Settings,
    pg: &Client,
    slot: &str,
    (upto, first_only, bound): (Option<Lsn>, bool, Bound),
    scanner: &mut Scanner,
    mut each: Option<Each<'_, '_>>,
) -> Result<Option<String>, tokio_postgres::Error> {
    // Logical messages are only decoded when asked for, as the relay asks.
    let outbox = &settings.config().outbox;
    let messages = if outbox.message_prefix.is_empty() && outbox.context_prefix.is_empty() {
        "false"
    } else {
        "true"
    };
    let upto = upto.map(|l| l.to_string());
    let changes = i32::try_from(bound.changes).unwrap_or(i32::MAX);
    let publication = settings.config().postgres.publication.clone();
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
        [&slot, &upto, &changes, &publication, &messages];
    let rows = pg
        .query_raw(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes($1, $2::text::pg_lsn, $3, \
             'proto_version', '1', 'publication_names', $4, 'messages', $5)",
            params,
        )
        .await;
    let rows = rows?;
    tokio::pin!(rows);
    while let Some(row) = rows.next().await {
        let row = row?;
        let lsn = row.get::<_, String>(0).parse::<Lsn>().unwrap_or(Lsn::ZERO);
        let counted = scanner.scan.events;
        if let Err(e) = scanner.row(lsn, Bytes::from(row.get::<_, Vec<u8>>(1))) {
            return Ok(Some(e));
        }
        if scanner.scan.events > counted
            && let (Some(each), Some(found)) = (each.as_deref_mut(), &scanner.scan.last)
        {
            each(found);
        }
        if first_only && scanner.scan.events > 0 {
            return Ok(None);
        }
    }
    Ok(beyond(scanner.rows(), bound.changes))
}

/// Why a look that judged `rows` rows under a bound of `changes` is unfinished, if it is: the server
/// stops at the first transaction's end past the bound, so a look that reached it may have left
/// changes pending.
pub(crate) fn beyond(rows: u64, changes: u32) -> Option<String> {
    (rows >= u64::from(changes))
        .then(|| format!("more than {changes} changes are pending; only the first were looked at"))
}

/// The server's reason, in words a problem line can carry.
fn server_words(e: &tokio_postgres::Error, bound: Bound) -> String {
    match e.as_db_error() {
        Some(d) if d.code() == &tokio_postgres::error::SqlState::QUERY_CANCELED => format!(
            "decoding the pending WAL took longer than {} s",
            bound.timeout.as_secs()
        ),
        Some(d) => d.message().to_owned(),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::pgoutput::{Column, Message, OldTuple, Relation, TupleValue, encode};

    fn settings() -> Settings {
        let mut c = Config::default();
        c.outbox.message_prefix = "outbox".into();
        c.validate().unwrap()
    }

    fn text(s: &str) -> TupleValue {
        TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    fn relation(id: u32, name: &str) -> Message {
        let cols = [
            ("event_id", 25),
            ("aggregate_type", 25),
            ("aggregate_id", 25),
            ("event_type", 25),
            ("payload", 3802),
        ];
        Message::Relation(Relation {
            xid: None,
            id,
            namespace: "public".into(),
            name: name.into(),
            replica_identity: b'd',
            columns: cols
                .iter()
                .map(|(n, t)| Column {
                    flags: 0,
                    name: (*n).into(),
                    type_oid: *t,
                    type_modifier: -1,
                })
                .collect(),
        })
    }

    fn row(id: &str) -> Vec<TupleValue> {
        vec![
            text(id),
            text("Claim"),
            text("4711"),
            text("approved"),
            text("{}"),
        ]
    }

    /// A transaction committed at `commit` holding `changes`, as peek rows.
    fn txn(commit: u64, changes: Vec<Message>) -> Vec<Message> {
        let mut out = vec![Message::Begin {
            final_lsn: Lsn(commit),
            commit_ts: 0,
            xid: 7,
        }];
        out.extend(changes);
        out.push(Message::Commit {
            flags: 0,
            commit_lsn: Lsn(commit),
            end_lsn: Lsn(commit + 0x30),
            commit_ts: 0,
        });
        out
    }

    fn scan_of(after: Option<Position>, msgs: Vec<Message>) -> Scan {
        let mut s = Scanner::new(&settings(), Vec::new(), after, Some(Lsn(0x5000)));
        for (i, m) in msgs.iter().enumerate() {
            s.row(Lsn(0x100 + i as u64), encode::message(m)).unwrap();
        }
        s.finish(None)
    }

    #[test]
    fn an_insert_behind_outbox_deletes_and_other_tables_is_found() {
        let mut msgs = txn(
            0x1000,
            vec![
                relation(16384, "outbox"),
                Message::Delete {
                    xid: None,
                    relation_id: 16384,
                    old: OldTuple::Key(vec![text("old")]),
                },
            ],
        );
        msgs.extend(txn(
            0x2000,
            vec![
                relation(16390, "orders"),
                Message::Insert {
                    xid: None,
                    relation_id: 16390,
                    new: row("not-an-event"),
                },
            ],
        ));
        msgs.extend(txn(
            0x3000,
            vec![Message::Message {
                xid: None,
                transactional: true,
                lsn: Lsn(0x2ff0),
                prefix: "other".into(),
                content: Bytes::from_static(b"{}"),
            }],
        ));
        let quiet = scan_of(None, msgs.clone());
        assert_eq!(quiet.any(), Some(false), "{quiet:?}");
        msgs.extend(txn(
            0x4000,
            vec![Message::Insert {
                xid: None,
                relation_id: 16384,
                new: row("e-5531"),
            }],
        ));
        // Committed at the end of the look (`upto_lsn`): the relay's to stream, not waiting here.
        msgs.extend(txn(
            0x5000,
            vec![Message::Insert {
                xid: None,
                relation_id: 16384,
                new: row("later"),
            }],
        ));
        let found = scan_of(None, msgs);
        assert_eq!(found.any(), Some(true));
        assert_eq!(found.events, 1);
        let first = found.first.unwrap();
        assert_eq!(first.id, "e-5531");
        assert_eq!(first.position, Position::in_transaction(Lsn(0x4000), 0));
    }

    #[test]
    fn prefixed_messages_are_events_and_stored_ones_are_not_counted() {
        let msg = |lsn: u64, id: &str| Message::Message {
            xid: None,
            transactional: true,
            lsn: Lsn(lsn),
            prefix: "outbox".into(),
            content: Bytes::from(format!(
                r#"{{"id":"{id}","aggregate_type":"Claim","aggregate_id":"1","event_type":"x","payload":{{}}}}"#
            )),
        };
        let mut msgs = txn(0x1000, vec![msg(0xff0, "m-1")]);
        msgs.extend(txn(0x2000, vec![msg(0x1ff0, "m-2"), msg(0x1ff8, "m-3")]));
        let all = scan_of(None, msgs.clone());
        assert_eq!(all.events, 3);
        // The stream holds everything through the first event of the second transaction.
        let past = scan_of(Some(Position::in_transaction(Lsn(0x2000), 0)), msgs);
        assert_eq!(past.events, 1);
        assert_eq!(past.first.as_ref().unwrap().id, "m-3");
        assert_eq!(past.last.unwrap().id, "m-3");
    }

    #[test]
    fn a_look_over_changes_in_hand_reads_past_a_first_look_of_deletes_to_its_bound() {
        let delete = Message::Delete {
            xid: None,
            relation_id: 16384,
            old: OldTuple::Key(vec![text("old")]),
        };
        let rows = |msgs: Vec<Message>| -> Vec<(Lsn, Bytes)> {
            msgs.iter()
                .map(|m| (Lsn(0x100), encode::message(m)))
                .collect()
        };
        // A retention job's transactions: more rows than the first, small look reads.
        let mut transactions = vec![rows(txn(
            0x1000,
            vec![relation(16384, "outbox"), delete.clone()],
        ))];
        for i in 1..30 {
            transactions.push(rows(txn(0x1000 + i * 0x100, vec![delete.clone()])));
        }
        let quiet = scan_changes(&settings(), &transactions, None, None, true, Bound::DEFAULT);
        assert_eq!(quiet.any(), Some(false), "{quiet:?}");
        transactions.push(rows(txn(
            0x4000,
            vec![Message::Insert {
                xid: None,
                relation_id: 16384,
                new: row("e-5531"),
            }],
        )));
        let found = scan_changes(&settings(), &transactions, None, None, true, Bound::DEFAULT);
        assert_eq!(found.first.map(|f| f.id).as_deref(), Some("e-5531"));
        let short = Bound {
            changes: FIRST_LOOK,
            ..Bound::DEFAULT
        };
        let bounded = scan_changes(&settings(), &transactions, None, None, true, short);
        assert_eq!(
            bounded.any(),
            None,
            "a look its bound ended is unknown: {bounded:?}"
        );
    }

    #[test]
    fn an_unfinished_look_without_events_is_unknown_never_none() {
        let s = Scanner::new(&settings(), Vec::new(), None, None);
        let scan = s.finish(Some("more than 1 changes are pending".into()));
        assert_eq!(scan.any(), None);
    }

    #[test]
    fn a_change_that_cannot_be_decoded_ends_the_look() {
        let mut s = Scanner::new(&settings(), Vec::new(), None, None);
        let e = s.row(Lsn(0x10), Bytes::from_static(b"\xff")).unwrap_err();
        assert!(e.contains("0/10"), "{e}");
    }
}
