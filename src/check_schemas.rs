//! `outbox-relay check-schemas [--where SQL]`: checks the payloads of the rows in the outbox table
//! against `outbox.schemas`, exactly as the relay would before publishing them, and publishes
//! nothing. Teams run it before switching validation on, and in CI against a copy of their data:
//! every row that fails here would be a dead letter once validation is on.
//!
//! It reads in one READ ONLY, REPEATABLE READ transaction (the count and the rows are the same
//! snapshot) through a server-side cursor, [`FETCH_ROWS`] rows at a time, so memory stays bounded
//! whatever the table's size, and reports progress through a callback (stderr). Only the id, the
//! event type and the payload are read: jsonb, json and text payloads as text, bytea as its bytes.
//! `--where` is SQL written by the operator, as for `backfill`: it goes into the query as written,
//! inside the READ ONLY transaction, through the extended protocol (one statement only).

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use futures_util::TryStreamExt;

use crate::config::{ConfigError, OutboxConfig, Settings};
use crate::schema::{SchemaSet, Verdict};
use crate::setup::{self, SetupError};
use crate::source::quote_ident;

/// Rows per `FETCH`.
const FETCH_ROWS: u32 = 1000;
/// How many failures the report lists (all are counted).
const FIRST_FAILURES: usize = 10;
/// How often the progress callback is called.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
const CURSOR: &str = "outbox_relay_check_schemas";
/// `pg_type.dat`.
const BYTEA_OID: u32 = 17;

/// Why the check could not run. One line naming the setting or object and the fix.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The schema directory does not load.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `outbox.schemas` is empty.
    #[error(
        "outbox.schemas is empty: name the directory of JSON Schema files to check the rows against \
         (OUTBOX_RELAY_OUTBOX_SCHEMAS)"
    )]
    NoSchemas,
    /// `outbox.table` is empty: logical messages only, no rows to read.
    #[error(
        "outbox.table is empty (logical messages only): check-schemas reads the rows of an outbox table"
    )]
    NoTable,
    /// Postgres cannot be reached.
    #[error(transparent)]
    Postgres(#[from] SetupError),
    /// A query failed.
    #[error("{table}: {what}: {detail}")]
    Query {
        /// The outbox table.
        table: String,
        /// What was being done (`--where`, `FETCH`, …).
        what: String,
        /// The server's message.
        detail: String,
    },
}

/// Rows of one event type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TypeCount {
    /// Payloads that validate.
    pub(crate) pass: u64,
    /// Payloads that fail (dead letters once validation is on).
    pub(crate) fail: u64,
    /// Rows whose type has no schema, which pass unchecked (`schemas_required` off).
    pub(crate) unchecked: u64,
}

/// One failing row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// The row's id (its text form), `NULL` when it has none.
    pub(crate) id: String,
    /// The reason, as `Outbox-Error` would give it: type, pointer, message, keyword.
    pub(crate) reason: String,
}

/// What `check-schemas` found.
#[derive(Debug, Clone, Default)]
pub struct CheckReport {
    /// The outbox table.
    pub(crate) table: String,
    /// The schema directory.
    pub(crate) dir: String,
    /// Schemas in it.
    pub(crate) schemas: usize,
    /// Rows read.
    pub(crate) rows: u64,
    /// Counts by event type.
    pub(crate) by_type: BTreeMap<String, TypeCount>,
    /// The first failures, in the order read.
    pub(crate) first_failures: Vec<Failure>,
    /// Time spent reading and checking.
    pub(crate) elapsed: Duration,
}

impl CheckReport {
    /// Rows that fail.
    pub fn failed(&self) -> u64 {
        self.by_type.values().map(|c| c.fail).sum()
    }

    /// Counts one row.
    fn add(&mut self, id: Option<&str>, event_type: &str, verdict: Verdict) {
        self.rows += 1;
        let count = self.by_type.entry(event_type.to_owned()).or_default();
        match verdict {
            Verdict::Pass(_) => count.pass += 1,
            Verdict::NoSchema => count.unchecked += 1,
            Verdict::Fail(reason) => {
                count.fail += 1;
                if self.first_failures.len() < FIRST_FAILURES {
                    self.first_failures.push(Failure {
                        id: id.unwrap_or("NULL").to_owned(),
                        reason,
                    });
                }
            }
        }
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "check-schemas: {} rows of {} against {} schemas in {} ({:.1} s)",
            self.rows,
            self.table,
            self.schemas,
            self.dir,
            self.elapsed.as_secs_f64()
        )?;
        for (t, c) in &self.by_type {
            let mut parts = Vec::new();
            if c.pass > 0 || c.fail > 0 {
                parts.push(format!("{} pass, {} fail", c.pass, c.fail));
            }
            if c.unchecked > 0 {
                parts.push(format!(
                    "{} without a schema (published unchecked)",
                    c.unchecked
                ));
            }
            writeln!(f, "  {t}: {}", parts.join(", "))?;
        }
        if !self.first_failures.is_empty() {
            writeln!(f, "first failures (id: reason):")?;
            for x in &self.first_failures {
                writeln!(f, "  {}: {}", x.id, x.reason)?;
            }
        }
        match self.failed() {
            0 => writeln!(f, "all {} rows pass", self.rows),
            n => writeln!(
                f,
                "{n} of {} rows fail: they would be dead letters with validation on",
                self.rows
            ),
        }
    }
}

/// Where a running check is, for the progress line.
#[derive(Debug, Clone, Copy)]
pub struct CheckProgress {
    /// Rows checked.
    pub(crate) done: u64,
    /// Rows matching the predicate.
    pub(crate) total: u64,
    /// Failures so far.
    pub(crate) failed: u64,
}

impl fmt::Display for CheckProgress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "check-schemas: {}/{} rows, {} fail",
            self.done, self.total, self.failed
        )
    }
}

/// Reads the rows matching `where_sql` (every row when `None`) and checks each payload.
pub async fn check_schemas(
    settings: &Settings,
    where_sql: Option<&str>,
    mut progress: impl FnMut(CheckProgress),
) -> Result<CheckReport, CheckError> {
    check_settings(settings)?;
    let set = settings.schemas.current();
    let o = &settings.config().outbox;
    let (schema, name) = o.table_parts();
    let qualified = format!("{}.{}", quote_ident(schema), quote_ident(name));
    let pg = setup::connect_postgres(settings).await?;
    pg.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await
        .map_err(query_error(&o.table, "BEGIN"))?;
    let bytea = payload_is_bytea(&pg, o, &qualified).await?;
    let predicate = where_sql.unwrap_or("true");
    let total: i64 = pg
        .query_one(
            &format!("SELECT count(*) FROM {qualified} WHERE ({predicate})"),
            &[],
        )
        .await
        .map_err(query_error(&o.table, "--where"))?
        .get(0);
    let cursor = Cursor::declare(&pg, o, &qualified, predicate, bytea).await?;
    let started = Instant::now();
    let mut report = CheckReport {
        table: o.table.clone(),
        dir: set.dir().to_owned(),
        schemas: set.len(),
        ..CheckReport::default()
    };
    let total = total.max(0) as u64;
    cursor
        .check_rows(&pg, &set, o, total, &mut report, &mut progress)
        .await?;
    pg.batch_execute("COMMIT")
        .await
        .map_err(query_error(&o.table, "COMMIT"))?;
    report.elapsed = started.elapsed();
    progress(CheckProgress {
        done: report.rows,
        total,
        failed: report.failed(),
    });
    Ok(report)
}

/// What the check needs before connecting: schemas that load, a directory, and a table.
fn check_settings(settings: &Settings) -> Result<(), CheckError> {
    settings.schemas_loaded()?;
    if settings.config().outbox.schemas.is_empty() {
        return Err(CheckError::NoSchemas);
    }
    if settings.config().outbox.messages_only() {
        return Err(CheckError::NoTable);
    }
    Ok(())
}

/// A failed query as [`CheckError::Query`], with the server's message and SQLSTATE when it has one.
fn query_error(table: &str, what: &str) -> impl FnOnce(tokio_postgres::Error) -> CheckError {
    let table = table.to_owned();
    let what = what.to_owned();
    move |e: tokio_postgres::Error| CheckError::Query {
        table,
        what,
        detail: match e.as_db_error() {
            Some(db) => format!("{} ({})", db.message(), db.code().code()),
            None => e.to_string(),
        },
    }
}

/// Whether the payload column is bytea (read as bytes) rather than text-like; a table without it
/// is an error naming `outbox.payload_column`.
async fn payload_is_bytea(
    pg: &tokio_postgres::Client,
    o: &OutboxConfig,
    qualified: &str,
) -> Result<bool, CheckError> {
    let payload_type: Option<u32> = pg
        .query_opt(
            "SELECT atttypid::oid FROM pg_attribute \
             WHERE attrelid = $1::text::regclass AND attname = $2 AND attnum > 0 AND NOT attisdropped",
            &[&qualified, &o.payload_column],
        )
        .await
        .map_err(query_error(&o.table, "reading its columns"))?
        .map(|r| r.get(0));
    let Some(payload_type) = payload_type else {
        return Err(CheckError::Query {
            table: o.table.clone(),
            what: "outbox.payload_column".into(),
            detail: format!("the table has no column {:?}", o.payload_column),
        });
    };
    Ok(payload_type == BYTEA_OID)
}

/// The server-side cursor over the matching rows' id, event type and payload.
struct Cursor {
    /// `FETCH` of the next [`FETCH_ROWS`].
    fetch: tokio_postgres::Statement,
    /// The payload comes as bytes, not text.
    bytea: bool,
}

impl Cursor {
    /// Declares the cursor (inside the open transaction) and prepares its `FETCH`.
    async fn declare(
        pg: &tokio_postgres::Client,
        o: &OutboxConfig,
        qualified: &str,
        predicate: &str,
        bytea: bool,
    ) -> Result<Self, CheckError> {
        let payload = if bytea {
            quote_ident(&o.payload_column)
        } else {
            format!("{}::text", quote_ident(&o.payload_column))
        };
        pg.execute(
            &format!(
                "DECLARE {CURSOR} NO SCROLL CURSOR FOR SELECT {}::text, {}::text, {payload} \
                 FROM {qualified} WHERE ({predicate})",
                quote_ident(&o.id_column),
                quote_ident(&o.event_type_column),
            ),
            &[],
        )
        .await
        .map_err(query_error(&o.table, "--where"))?;
        let fetch = pg
            .prepare(&format!("FETCH {FETCH_ROWS} FROM {CURSOR}"))
            .await
            .map_err(query_error(&o.table, "FETCH"))?;
        Ok(Self { fetch, bytea })
    }

    /// Fetches until a short batch, checking each row into `report`; progress at most every
    /// [`PROGRESS_EVERY`].
    async fn check_rows(
        &self,
        pg: &tokio_postgres::Client,
        set: &SchemaSet,
        o: &OutboxConfig,
        total: u64,
        report: &mut CheckReport,
        progress: &mut impl FnMut(CheckProgress),
    ) -> Result<(), CheckError> {
        let mut last_progress = Instant::now();
        loop {
            let rows = pg
                .query_raw(&self.fetch, std::iter::empty::<i32>())
                .await
                .map_err(query_error(&o.table, "FETCH"))?;
            tokio::pin!(rows);
            let mut fetched = 0u32;
            while let Some(row) = rows
                .try_next()
                .await
                .map_err(query_error(&o.table, "FETCH"))?
            {
                fetched += 1;
                self.check_row(&row, set, o, report);
                if last_progress.elapsed() >= PROGRESS_EVERY {
                    last_progress = Instant::now();
                    progress(CheckProgress {
                        done: report.rows,
                        total,
                        failed: report.failed(),
                    });
                }
            }
            if fetched < FETCH_ROWS {
                return Ok(());
            }
        }
    }

    /// Checks one row's payload against its event type's schema.
    fn check_row(
        &self,
        row: &tokio_postgres::Row,
        set: &SchemaSet,
        o: &OutboxConfig,
        report: &mut CheckReport,
    ) {
        let id: Option<&str> = row.get(0);
        let event_type: Option<&str> = row.get(1);
        let payload: &[u8] = if self.bytea {
            row.get::<_, Option<&[u8]>>(2).unwrap_or_default()
        } else {
            row.get::<_, Option<&str>>(2).unwrap_or_default().as_bytes()
        };
        match event_type {
            Some(t) => report.add(id, t, set.check(t, payload, self.bytea)),
            // The relay makes it a dead letter whatever the schemas say.
            None => report.add(
                id,
                "(null)",
                Verdict::Fail(format!("column {} is null", o.event_type_column)),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_counts_by_type_and_lists_the_first_failures() {
        let mut r = CheckReport {
            table: "public.outbox".into(),
            dir: "schemas".into(),
            schemas: 1,
            ..CheckReport::default()
        };
        r.add(Some("e-1"), "ClaimApproved", Verdict::Pass(None));
        r.add(
            Some("e-2"),
            "ClaimApproved",
            Verdict::Fail("ClaimApproved: /claim: x (type)".into()),
        );
        r.add(Some("e-3"), "ClaimRejected", Verdict::NoSchema);
        for i in 0..20 {
            r.add(
                Some(&format!("f-{i}")),
                "Other",
                Verdict::Fail("Other: (root): y (type)".into()),
            );
        }
        assert_eq!(r.failed(), 21);
        assert_eq!(r.first_failures.len(), FIRST_FAILURES);
        let text = r.to_string();
        assert!(text.contains("  ClaimApproved: 1 pass, 1 fail\n"), "{text}");
        assert!(
            text.contains("  ClaimRejected: 1 without a schema"),
            "{text}"
        );
        assert!(
            text.contains("  e-2: ClaimApproved: /claim: x (type)\n"),
            "{text}"
        );
        assert!(
            text.ends_with("21 of 23 rows fail: they would be dead letters with validation on\n"),
            "{text}"
        );
        let mut ok = CheckReport::default();
        ok.add(Some("e-1"), "A", Verdict::Pass(None));
        assert!(ok.to_string().ends_with("all 1 rows pass\n"));
    }
}
