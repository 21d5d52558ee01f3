//! `outbox-relay verify`: a read-only proof of delivery. It compares the outbox table's rows that
//! are still there with the relay's stream and reports what differs: rows whose event is not
//! stored (missing, or in flight, or older than the stream's first message), events stored twice,
//! the relay's messages out of position order, messages the relay did not write, messages on
//! another subject than the template gives, and (with `--payloads`) bodies that differ from the
//! row. It writes nothing: no slot, no publish, no durable consumer; it runs while the relay runs.
//!
//! The order of work: the rows' snapshot is taken first ([`rows`]), then the stream is read up to
//! the last sequence it had after that ([`stream`]) into compact records indexed by event-id hash
//! ([`messages`]); then the snapshot's rows go by one at a time, each looked up among the messages
//! ([`compare`]), and only the rows with a candidate difference are kept. Memory is therefore the
//! messages' records, not the rows'. When rows are absent, the stream is read once more after
//! [`RECHECK`], past where the first read ended: an event committed just before the snapshot may
//! still have been on its way. Every candidate difference then gets an exact second look (the
//! message by its sequence, the row by its id) before it is counted; see docs/operations.md,
//! "Proving delivery", for what that costs.

use std::time::Duration;

use async_nats::jetstream;

use crate::config::{ConfigError, Settings};
use crate::event::{MAX_ID_BYTES, usable_id};
use crate::nats::{ConnectError, connect_nats};
use crate::setup::{self, SetupError};

mod compare;
mod messages;
mod report;
mod rows;
mod stream;

use compare::{DEAD_LETTER, RowFinding, RowRec, content_hash, hash64};
use messages::{MAX_SPAN, Messages};
pub use report::{Example, VerifyReport};
use rows::Table;
use stream::{StreamScan, event_id};

/// How long to wait before the stream is read again for rows not in it yet.
const RECHECK: Duration = Duration::from_secs(3);

/// What to verify.
#[derive(Debug, Clone, Default)]
pub struct VerifyOptions {
    /// SQL predicate on the rows.
    pub where_sql: Option<String>,
    /// Only rows created at or after this time (the `created_at` column).
    pub since: Option<String>,
    /// Read the stream from this sequence (default: its first).
    pub from_sequence: Option<u64>,
    /// Compare payloads too.
    pub payloads: bool,
}

/// Why `verify` could not check (exit code 2). One line naming what and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The configuration does not load.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Postgres cannot be reached.
    #[error(transparent)]
    Postgres(#[from] SetupError),
    /// NATS cannot be reached.
    #[error(transparent)]
    Nats(#[from] ConnectError),
    /// A query failed.
    #[error("{table}: {what}: {detail}")]
    Query {
        /// The outbox table.
        table: String,
        /// What was being done.
        what: String,
        /// The server's message.
        detail: String,
    },
    /// `--since` on a table without the creation-time column.
    #[error(
        "--since: {0} has no created_at timestamp column to filter on; select the rows with --where instead"
    )]
    Since(String),
    /// `--from-sequence 0`.
    #[error("--from-sequence must be 1 or more (stream sequences start at 1)")]
    FromSequence,
    /// More sequences than one run keeps apart (4-byte offsets, [`MAX_SPAN`]).
    #[error(
        "stream {stream}: sequences {first} to {last} are more than one verify reads ({max} at most): \
         give --from-sequence {suggest} or later (rows older than that message count as older_than_stream)"
    )]
    Span {
        /// The stream.
        stream: String,
        /// The first sequence to read.
        first: u64,
        /// The last sequence.
        last: u64,
        /// [`MAX_SPAN`] + 1.
        max: u64,
        /// A `--from-sequence` that fits.
        suggest: u64,
    },
    /// Reading the stream failed.
    #[error(
        "stream {stream} (nats.stream): {what}: {detail} (verify needs the relay's NATS user plus \
         $JS.API.CONSUMER.CREATE.{stream} and $JS.API.STREAM.MSG.GET.{stream}; docs/operations.md, Proving delivery)"
    )]
    Stream {
        /// The stream.
        stream: String,
        /// What was being done.
        what: String,
        /// The server's or client's message.
        detail: String,
    },
}

/// Verifies the rows and the stream; `progress` gets a line now and then (for stderr).
pub async fn verify(
    settings: &Settings,
    opts: &VerifyOptions,
    mut progress: impl FnMut(String),
) -> Result<VerifyReport, VerifyError> {
    if opts.from_sequence == Some(0) {
        return Err(VerifyError::FromSequence);
    }
    let o = &settings.config().outbox;
    let n = &settings.config().nats;
    let mut report = VerifyReport {
        stream: n.stream.clone(),
        fence: n.fence,
        ..VerifyReport::default()
    };

    // The rows' snapshot first: everything the stream holds later can only add to what it shows.
    let pg = if o.messages_only() {
        None
    } else {
        Some(setup::connect_postgres(settings).await?)
    };
    const ROWS_CURSOR: &str = "outbox_relay_verify_rows";
    let table = match &pg {
        None => None,
        Some(pg) => {
            let t = Table::open(pg, o, opts.where_sql.as_deref(), opts.since.as_deref()).await?;
            // Declared now, so a --where Postgres cannot plan fails before the stream is read.
            t.declare(pg, o, opts.payloads, ROWS_CURSOR).await?;
            Some(t)
        }
    };

    let nats = connect_nats(settings).await?;
    let js = jetstream::new(nats.clone());
    let stream_error = |what: &str, e: &dyn std::fmt::Display| VerifyError::Stream {
        stream: n.stream.clone(),
        what: what.to_owned(),
        detail: e.to_string(),
    };
    let js_stream = js
        .get_stream(&n.stream)
        .await
        .map_err(|e| stream_error("looking it up (run `outbox-relay setup`?)", &e))?;
    let state = js_stream
        .get_info()
        .await
        .map_err(|e| stream_error("reading its state", &e))?
        .state
        .clone();
    let start = state.first_sequence.max(opts.from_sequence.unwrap_or(1));
    let span = |first: u64, last: u64| {
        if last > first && last - first > MAX_SPAN {
            return Err(VerifyError::Span {
                stream: n.stream.clone(),
                first,
                last,
                max: MAX_SPAN + 1,
                suggest: last - MAX_SPAN,
            });
        }
        Ok(())
    };
    span(start, state.last_sequence)?;
    let mut scan = StreamScan::new(opts.payloads, &n.dead_letter_subject);
    // Exactly the records needed: a vector that doubles would hold up to twice that.
    scan.msgs = Messages::new(start, state.messages);
    if state.messages > 0 {
        scan.read(&nats, &n.stream, start, state.last_sequence, &mut |read| {
            progress(format!("verify: {read} messages read"))
        })
        .await?;
    }
    scan.msgs.index();

    // The rows, one at a time: only those with a candidate difference are kept.
    let mut candidates: Vec<(RowRec, RowFinding)> = Vec::new();
    let mut unusable_ids = 0u64;
    if let (Some(pg), Some(t)) = (&pg, &table) {
        let template = &settings.subject;
        let msgs = &scan.msgs;
        t.fetch_all(pg, o, ROWS_CURSOR, async |r| {
            // The relay gives a row without a usable id a WAL-derived one, which the row cannot
            // be matched with (docs/guarantees.md, Messages).
            let Some(id) = r.id.filter(|id| usable_id(id)) else {
                unusable_ids += 1;
                return Ok(true);
            };
            let content = match expected_subject(template, &r) {
                Some(subject) => content_hash(&subject, opts.payloads.then_some(r.payload)),
                None => DEAD_LETTER,
            };
            let row = RowRec {
                id: hash64(id.as_bytes()),
                content,
            };
            if let Some(finding) = compare::check(row, &[msgs]) {
                candidates.push((row, finding));
            }
            report.rows += 1;
            if report.rows.is_multiple_of(100_000) {
                progress(format!("verify: {} rows read", report.rows));
            }
            Ok(true)
        })
        .await?;
    }
    if unusable_ids > 0 {
        report.skipped.push(format!(
            "{unusable_ids} rows without a usable event id (null, empty, over {MAX_ID_BYTES} bytes or with a line break): \
             the relay publishes them under a WAL-derived id, which no row can be matched with"
        ));
    }

    let absent = |c: &[(RowRec, RowFinding)]| c.iter().any(|(_, f)| *f == RowFinding::Absent);
    let second = if absent(&candidates) {
        // A row committed just before the snapshot may still be on its way to the stream.
        tokio::time::sleep(RECHECK).await;
        let now = js_stream
            .get_info()
            .await
            .map_err(|e| stream_error("reading its state", &e))?
            .state
            .last_sequence;
        let from = start.max(scan.last_read + 1);
        span(from, now)?;
        // The later messages in a part of their own: growing the first would copy it.
        let first = std::mem::replace(
            &mut scan.msgs,
            Messages::new(from, (now + 1).saturating_sub(from)),
        );
        scan.read(&nats, &n.stream, from, now, &mut |read| {
            progress(format!("verify: {read} messages read"))
        })
        .await?;
        scan.msgs.index();
        let parts = [&first, &scan.msgs];
        candidates.retain_mut(|(row, finding)| match compare::check(*row, &parts) {
            Some(f) => {
                *finding = f;
                true
            }
            None => false,
        });
        compare::second_copies(&parts)
    } else {
        compare::second_copies(&[&scan.msgs])
    };
    // The records are done with; the second look needs only the candidates.
    scan.msgs = Messages::default();
    report.messages = scan.messages;
    report.first_sequence = scan.first_read;
    report.last_sequence = scan.last_read;

    // Once: each second copy, confirmed by reading both copies' ids.
    let mut second_copies: Vec<u64> = Vec::new();
    for &(first, later) in &second {
        let a = message(&js_stream, first)
            .await
            .map_err(|e| stream_error("reading a message", &e))?;
        let b = message(&js_stream, later)
            .await
            .map_err(|e| stream_error("reading a message", &e))?;
        let (Some(a), Some(b)) = (a, b) else { continue };
        if a.0 == b.0 {
            second_copies.push(later);
            report.add("duplicates", || {
                Some(Example {
                    event_id: b.0.clone(),
                    sequence: Some(later),
                    detail: Some(match crate::position::replay_over(&b.2) {
                        Some(n) => format!(
                            "first stored at sequence {first}; published again by a replay that trusted no \
                             tail (the stream's last sequence was {n} when it began)"
                        ),
                        None => format!("first stored at sequence {first}"),
                    }),
                })
            });
        }
    }
    second_copies.sort_unstable();

    // Order: breaks that are not a second copy (a copy sits wherever its writer put it).
    for &seq in &scan.out_of_order {
        if second_copies.binary_search(&seq).is_ok() {
            continue;
        }
        let example = if report.wants_example("out_of_order") {
            message(&js_stream, seq).await.ok().flatten()
        } else {
            None
        };
        report.add("out_of_order", || {
            example.map(|(id, _, pos)| Example {
                event_id: id,
                sequence: Some(seq),
                detail: Some(format!(
                    "Outbox-Position {pos} is not above the message before it"
                )),
            })
        });
    }

    // Gap-free: messages without the relay's headers.
    for &seq in &scan.foreign {
        let example = if report.wants_example("foreign") {
            message_any(&js_stream, seq).await.ok().flatten()
        } else {
            None
        };
        report.add("foreign", || {
            example.map(|(id, subject)| Example {
                event_id: id,
                sequence: Some(seq),
                detail: Some(format!("subject {subject}, no Outbox-Position")),
            })
        });
    }

    report.checks = vec!["once", "order", "gap_free"];
    match (&pg, &table) {
        (Some(pg), Some(table)) => {
            report.checks.insert(0, "completeness");
            report.checks.push("routing");
            if opts.payloads {
                report.checks.push("payloads");
            } else {
                report.skipped.push("payloads (give --payloads)".into());
            }
            let ctx = RowsCtx {
                payloads: opts.payloads,
                // A relay that confirmed past the snapshot has nothing of it in flight.
                in_flight_possible: !table
                    .slot_passed_snapshot(pg, &settings.config().postgres.slot)
                    .await,
                older_than: if start > 1 {
                    Some(first_time_us(&js_stream, report.first_sequence).await)
                } else {
                    None
                },
                stream: &js_stream,
            };
            second_look(pg, table, settings, candidates, &ctx, &mut report).await?;
            if !table.has_created {
                report.skipped.push(format!(
                    "in flight by creation time ({} has no created_at column: a row not stored after the recheck is missing)",
                    o.table
                ));
            }
        }
        _ => report.skipped.push(
            "completeness, routing and payloads (outbox.table is empty: no rows to compare)".into(),
        ),
    }
    for c in report::CLASSES {
        report.counts.entry(c).or_default();
    }
    if let Some(pg) = &pg {
        // A read-only snapshot: ending it cannot lose anything, so a failure here is not reported.
        let _ = pg.batch_execute("COMMIT").await;
    }
    Ok(report)
}

/// What the rows' second look needs besides the rows.
struct RowsCtx<'a> {
    /// `--payloads`.
    payloads: bool,
    /// The relay's slot has not confirmed past the snapshot: a young absent row may be in flight.
    in_flight_possible: bool,
    /// With a stream whose first sequence read is above 1: the store time (µs) of that first
    /// message; a row absent and created before it is older than the stream.
    older_than: Option<i64>,
    stream: &'a jetstream::stream::Stream,
}

/// The exact second look at the rows' candidates: the rows are read again (same snapshot), and
/// each candidate row's id is compared with the message the merge paired it with.
async fn second_look(
    pg: &tokio_postgres::Client,
    table: &Table,
    settings: &Settings,
    candidates: Vec<(RowRec, RowFinding)>,
    ctx: &RowsCtx<'_>,
    report: &mut VerifyReport,
) -> Result<(), VerifyError> {
    if candidates.is_empty() {
        return Ok(());
    }
    let mut by_hash: Vec<(u64, RowFinding)> =
        candidates.iter().map(|&(row, f)| (row.id, f)).collect();
    by_hash.sort_unstable_by_key(|x| x.0);
    let o = &settings.config().outbox;
    let payloads = ctx.payloads;
    table
        .scan(pg, o, payloads, "outbox_relay_verify_look", async |r| {
            let Some(id) = r.id else { return Ok(true) };
            let h = hash64(id.as_bytes());
            let Ok(k) = by_hash.binary_search_by_key(&h, |x| x.0) else {
                return Ok(true);
            };
            let (_, finding) = by_hash[k];
            let class = match finding {
                RowFinding::Absent
                    if ctx
                        .older_than
                        .is_some_and(|t| r.created_us.is_none_or(|c| c < t)) =>
                {
                    "older_than_stream"
                }
                // Not yet in the stream while the relay has not confirmed past the snapshot.
                RowFinding::Absent if r.young && ctx.in_flight_possible => "in_flight",
                RowFinding::Absent => "missing",
                RowFinding::Differs(seq) => {
                    // The message the merge paired with the row, read again: it must carry the
                    // row's own id, and its subject or payload must really differ.
                    let m = match ctx.stream.get_raw_message(seq).await {
                        Ok(m) => m,
                        Err(_) => return Ok(true),
                    };
                    if event_id(Some(&m.headers)) != Some(id) {
                        return Ok(true);
                    }
                    let expected = expected_subject(&settings.subject, &r);
                    let (class, detail) = match expected {
                        Some(e) if e == m.subject.as_str() => {
                            if payloads && m.payload.as_ref() != r.payload {
                                (
                                    "payload_differs",
                                    "the payload differs from the row's".to_owned(),
                                )
                            } else {
                                return Ok(true);
                            }
                        }
                        Some(e) => (
                            "misrouted",
                            format!("stored on {}, the template gives {e}", m.subject),
                        ),
                        None => (
                            "misrouted",
                            format!("stored on {}, the row can only be a dead letter", m.subject),
                        ),
                    };
                    report.add(class, || {
                        Some(Example {
                            event_id: id.to_owned(),
                            sequence: Some(seq),
                            detail: Some(detail),
                        })
                    });
                    return Ok(true);
                }
            };
            report.add(class, || {
                Some(Example {
                    event_id: id.to_owned(),
                    sequence: None,
                    detail: None,
                })
            });
            Ok(true)
        })
        .await?;
    Ok(())
}

/// The subject the relay gives the row, `None` when it makes the row a dead letter (no aggregate
/// or event type, or a value the template cannot take).
fn expected_subject(
    template: &crate::route::SubjectTemplate,
    r: &rows::RowView<'_>,
) -> Option<String> {
    let (Some(aggregate_type), Some(event_type)) = (r.aggregate_type, r.event_type) else {
        return None;
    };
    template
        .render(aggregate_type, event_type, r.aggregate_id.unwrap_or(""))
        .ok()
}

/// The store time (µs since the epoch) of the first message read, at `seq`: rows created before it
/// are older than the stream. When it cannot be read (gone meanwhile, or none), every absent row
/// counts as older than the stream, which errs towards "not checked" rather than "missing".
async fn first_time_us(stream: &jetstream::stream::Stream, seq: u64) -> i64 {
    match stream.get_raw_message(seq).await {
        Ok(m) => (m.time.unix_timestamp_nanos() / 1000) as i64,
        Err(_) => i64::MAX,
    }
}

/// The relay's event id, subject and `Outbox-Position` of the message at `seq` (`None` when it
/// is gone or has no id).
async fn message(
    stream: &jetstream::stream::Stream,
    seq: u64,
) -> Result<Option<(String, String, String)>, String> {
    match stream.get_raw_message(seq).await {
        Ok(m) => Ok(event_id(Some(&m.headers)).map(|id| {
            (
                id.to_owned(),
                m.subject.to_string(),
                m.headers
                    .get("Outbox-Position")
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default(),
            )
        })),
        Err(e) if e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Any message's `Nats-Msg-Id` ("" without one) and subject.
async fn message_any(
    stream: &jetstream::stream::Stream,
    seq: u64,
) -> Result<Option<(String, String)>, String> {
    match stream.get_raw_message(seq).await {
        Ok(m) => Ok(Some((
            event_id(Some(&m.headers)).unwrap_or("").to_owned(),
            m.subject.to_string(),
        ))),
        Err(e) if e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}
