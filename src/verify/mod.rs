//! `outbox-relay verify`: a proof of delivery you can act on. It compares the outbox table's rows
//! that are still there with the relay's stream and says, per class ([`Class`]), what differs and
//! what to do about it: rows whose event is not stored (missing; or only waiting in the slot, as
//! the slot decides, never a clock; or unknown when the slot could not tell), rows only a dead
//! letter carries, stream sequences gone where the stream's limits cannot explain it (holes),
//! events stored twice or out of position order, messages the relay did not write, messages on
//! another subject than the template gives, bodies that differ (`--payloads`), and what it could
//! check only for continuity (stream-only events). It says up to where every row is proven
//! (`proven_up_to`) and, with `--record`, stores that point for a prune gated on proof: the one
//! write it makes. Otherwise it writes nothing: no slot but a temporary copy, no publish, no
//! durable consumer; it runs while the relay runs.
//!
//! The steps, in order, each a method of [`Run`] (`run.rs`): the rows' snapshot (`rows.rs`) and the stream's
//! state (`side.rs`); the stream read into compact records indexed by event-id hash (`stream.rs`,
//! `messages.rs`); the snapshot's rows, one at a time, each looked up among the messages
//! (`compare.rs`), only those with a candidate finding kept; for rows absent, a look into a copy
//! of the slot (`slot.rs`), then the stream read again past where the first read ended: whatever
//! the slot had confirmed by then is stored by then; the findings of the stream alone
//! (`findings.rs`, with `limits.rs`); the exact second look at the candidates (`look.rs`, with
//! `parked.rs` for a parked copy's run); the proof (`proof.rs`); the report (`report.rs`, its
//! classes in `class.rs`, what was left out in `skipped.rs`, an example's detail in `detail.rs`). With NATS unreachable,
//! the rows and the slot are still read (`unreachable.rs`): the report says which rows wait, and
//! exits 2 for the rest.

use async_nats::jetstream;
use tokio_postgres::Client;

use crate::config::{ConfigError, Settings};
use crate::nats::ConnectError;
use crate::setup::{self, SetupError};

mod class;
mod compare;
mod detail;
mod findings;
mod limits;
mod look;
mod messages;
mod parked;
mod proof;
mod report;
mod rows;
mod run;
mod side;
mod skipped;
mod slot;
mod stream;
mod unreachable;

pub use class::Class;
pub use report::{Example, Proven, VerifyReport};
pub use skipped::Skipped;
pub use slot::DEFAULT_SLOT_LOOK;

use messages::MAX_SPAN;
use rows::Table;
use run::Run;
use side::StreamSide;

/// What to verify.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// SQL predicate on the rows.
    pub where_sql: Option<String>,
    /// Only rows created at or after this time (the `created_at` column).
    pub since: Option<String>,
    /// Read the stream from this sequence (default: its first).
    pub from_sequence: Option<u64>,
    /// Compare payloads too.
    pub payloads: bool,
    /// Store `proven_up_to` in the proof table (`--record`).
    pub record: bool,
    /// At most this many changes of the slot are decoded to tell waiting rows (`--slot-look`).
    pub slot_look: u32,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            where_sql: None,
            since: None,
            from_sequence: None,
            payloads: false,
            record: false,
            slot_look: DEFAULT_SLOT_LOOK,
        }
    }
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
    /// `--record` cannot be done (refused with other options, or the proof table is missing).
    #[error("--record: {what}")]
    Record {
        /// What and how to fix it.
        what: String,
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

impl VerifyError {
    /// NATS could not be reached at all (not refused: unreachable).
    fn unreachable(&self) -> bool {
        matches!(self, VerifyError::Nats(ConnectError::Connect { .. }))
    }
}

/// Verifies the rows and the stream; `progress` gets a line every 2 s while rows or messages are
/// read (for stderr).
pub async fn verify(
    settings: &Settings,
    opts: &VerifyOptions,
    progress: impl FnMut(String),
) -> Result<VerifyReport, VerifyError> {
    check_options(settings, opts)?;
    let rows = Rows::open(settings, opts).await?;
    let side = match StreamSide::open(settings, opts.from_sequence).await {
        Ok(side) => side,
        Err(e) if e.unreachable() && rows.is_some() => {
            let rows = rows.expect("checked");
            return unreachable::report(settings, opts, rows, e, progress).await;
        }
        Err(e) => return Err(e),
    };
    let mut run = Run::new(settings, opts, rows, side, progress);
    run.read_first().await?;
    run.pass_rows().await?;
    run.recheck().await?;
    run.stream_findings().await?;
    run.classify().await?;
    run.prove().await?;
    run.finish().await
}

/// The options' own mistakes, before anything is read.
fn check_options(settings: &Settings, opts: &VerifyOptions) -> Result<(), VerifyError> {
    if opts.from_sequence == Some(0) {
        return Err(VerifyError::FromSequence);
    }
    let refuse = |what: &str| {
        Err(VerifyError::Record {
            what: what.to_owned(),
        })
    };
    if opts.record && (opts.where_sql.is_some() || opts.since.is_some()) {
        return refuse(
            "the proof is about every row: give neither --where nor --since with --record",
        );
    }
    if opts.record && settings.config().outbox.messages_only() {
        return refuse("outbox.table is empty: there are no rows to prove or prune");
    }
    Ok(())
}

/// The rows' side: the snapshot's connection and the table.
struct Rows {
    pg: Client,
    table: Table,
}

/// The cursor of the first pass, declared at once.
const ROWS_CURSOR: &str = "outbox_relay_verify_rows";

impl Rows {
    /// The rows' snapshot first: everything the stream holds later can only add to what it shows.
    /// `None` for a messages-only outbox.
    async fn open(settings: &Settings, opts: &VerifyOptions) -> Result<Option<Rows>, VerifyError> {
        let o = &settings.config().outbox;
        if o.messages_only() {
            return Ok(None);
        }
        let pg = setup::connect_postgres(settings).await?;
        let table = Table::open(&pg, o, opts.where_sql.as_deref(), opts.since.as_deref()).await?;
        if opts.record && !table.has_created {
            return Err(VerifyError::Record {
                what: format!(
                    "{} has no created_at timestamp column: the proof and the prune are said in it",
                    o.table
                ),
            });
        }
        // Declared now, so a --where Postgres cannot plan fails before the stream is read.
        table.declare(&pg, o, opts.payloads, ROWS_CURSOR).await?;
        Ok(Some(Rows { pg, table }))
    }

    /// Ends the read-only snapshot: ending it cannot lose anything, so a failure is not reported.
    async fn close(&self) {
        let _ = self.pg.batch_execute("COMMIT").await;
    }
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

/// Refuses a range of more sequences than one run keeps apart (4-byte offsets, [`MAX_SPAN`]).
fn span(stream: &str, first: u64, last: u64) -> Result<(), VerifyError> {
    if last > first && last - first > MAX_SPAN {
        return Err(VerifyError::Span {
            stream: stream.to_owned(),
            first,
            last,
            max: MAX_SPAN + 1,
            suggest: last - MAX_SPAN,
        });
    }
    Ok(())
}
