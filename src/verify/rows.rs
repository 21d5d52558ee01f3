//! Reading the outbox table for `verify`: the rows still there (retention deletes old ones) that
//! match `--where` and `--since`, in one READ ONLY, REPEATABLE READ transaction held open for the
//! whole run, so the exact second look at the candidates reads the same snapshot as the first pass.
//! Rows come through a server-side cursor, [`FETCH_ROWS`] at a time, the next batch asked for
//! while the last is looked at: memory stays bounded at two batches.
//!
//! Columns are the configured ones (`outbox.*_column`), a partitioned table is read through its
//! parent. The creation time is the column `created_at` when the table has one (as
//! `sql/01_outbox_table.sql` creates it; a `timestamp` without time zone is read in the session's
//! time zone, as `now()` wrote it): `--since` filters on it, it tells a row older than the stream's
//! first message or the backfill that began the stream from a missing one, and `proven_up_to` is
//! said in it. Whether a row waits is never decided by it: the slot decides (`slot.rs`).
//!
//! The snapshot's WAL position bounds the look into the slot, and its oldest running transaction
//! (`pg_snapshot_xmin`) goes into the proof `--record` stores: a prune gated on the proof deletes
//! only rows written by transactions older than it, which this snapshot showed (`proof.rs`).

use futures_util::TryStreamExt;
use tokio_postgres::{Client, Row};

use super::VerifyError;
use crate::Lsn;
use crate::config::OutboxConfig;
use crate::source::quote_ident;

/// Rows per `FETCH`.
const FETCH_ROWS: u32 = 5000;
/// The creation-time column `verify` looks for.
pub(crate) const CREATED_COLUMN: &str = "created_at";
/// `pg_type.dat`.
const BYTEA_OID: u32 = 17;

/// What the table offers.
#[derive(Debug, Clone)]
pub(crate) struct Table {
    /// `"schema"."name"`.
    pub(crate) qualified: String,
    /// The payload column is bytea (published as its bytes), not text-like (published as text).
    bytea: bool,
    /// The table has a `created_at` timestamp column.
    pub(crate) has_created: bool,
    /// The row predicate: `--where` and `--since`, as SQL.
    predicate: String,
    /// The WAL position when the snapshot was taken: every row it shows committed before it.
    pub(crate) snapshot_lsn: Option<Lsn>,
    /// The snapshot's oldest running transaction (`xid8` as text): every transaction before it
    /// had ended, and those that committed are in the snapshot.
    pub(crate) snapshot_xmin: Option<String>,
    /// `"schema"."<table>_proof"`: where `--record` stores the proof (`sql/05_retention.sql`).
    pub(crate) proof_table: String,
}

/// One row as read: the fields in [`Table::select`]'s order.
pub(crate) struct RowView<'a> {
    pub(crate) id: Option<&'a str>,
    pub(crate) aggregate_type: Option<&'a str>,
    pub(crate) event_type: Option<&'a str>,
    pub(crate) aggregate_id: Option<&'a str>,
    /// The creation time, µs since the Unix epoch.
    pub(crate) created_us: Option<i64>,
    pub(crate) payload: &'a [u8],
}

/// A failed query as [`VerifyError::Query`].
pub(crate) fn query_error(
    table: &str,
    what: &str,
) -> impl FnOnce(tokio_postgres::Error) -> VerifyError {
    let table = table.to_owned();
    let what = what.to_owned();
    move |e: tokio_postgres::Error| VerifyError::Query {
        table,
        what,
        detail: match e.as_db_error() {
            Some(db) => format!("{} ({})", db.message(), db.code().code()),
            None => e.to_string(),
        },
    }
}

impl Table {
    /// Opens the snapshot and looks up the payload's type and the creation-time column.
    pub(crate) async fn open(
        pg: &Client,
        o: &OutboxConfig,
        where_sql: Option<&str>,
        since: Option<&str>,
    ) -> Result<Table, VerifyError> {
        let (schema, name) = o.table_parts();
        let qualified = format!("{}.{}", quote_ident(schema), quote_ident(name));
        pg.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await
            .map_err(query_error(&o.table, "BEGIN"))?;
        let (snapshot_lsn, snapshot_xmin) = snapshot_position(pg, &o.table).await?;
        let columns = pg
            .query(
                "SELECT attname::text, atttypid::oid FROM pg_attribute \
                 WHERE attrelid = $1::text::regclass AND attnum > 0 AND NOT attisdropped",
                &[&qualified],
            )
            .await
            .map_err(query_error(
                &o.table,
                "reading its columns (does outbox.table exist?)",
            ))?;
        let type_of = |col: &str| {
            columns
                .iter()
                .find(|r| r.get::<_, &str>(0) == col)
                .map(|r| r.get::<_, u32>(1))
        };
        for (key, col) in [
            ("outbox.id_column", &o.id_column),
            ("outbox.aggregate_type_column", &o.aggregate_type_column),
            ("outbox.aggregate_id_column", &o.aggregate_id_column),
            ("outbox.event_type_column", &o.event_type_column),
            ("outbox.payload_column", &o.payload_column),
        ] {
            if type_of(col).is_none() {
                return Err(VerifyError::Query {
                    table: o.table.clone(),
                    what: key.into(),
                    detail: format!("the table has no column {col:?}: set {key} to its name"),
                });
            }
        }
        let bytea = type_of(&o.payload_column) == Some(BYTEA_OID);
        // timestamptz 1184, timestamp 1114.
        let has_created = matches!(type_of(CREATED_COLUMN), Some(1184 | 1114));
        let mut predicate = format!("({})", where_sql.unwrap_or("true"));
        if let Some(since) = since {
            if !has_created {
                return Err(VerifyError::Since(o.table.clone()));
            }
            predicate.push_str(&format!(
                " AND {} >= '{}'::timestamptz",
                quote_ident(CREATED_COLUMN),
                since.replace('\'', "''")
            ));
        }
        Ok(Table {
            qualified,
            bytea,
            has_created,
            predicate,
            snapshot_lsn,
            snapshot_xmin,
            proof_table: proof_table(schema, name),
        })
    }

    /// The query: id, aggregate type, event type, aggregate id, created (µs), payload.
    fn select(&self, o: &OutboxConfig, payloads: bool) -> String {
        let text = |c: &str| format!("{}::text", quote_ident(c));
        let created = if self.has_created {
            let c = quote_ident(CREATED_COLUMN);
            format!("(extract(epoch FROM {c}::timestamptz) * 1000000)::int8")
        } else {
            "NULL::int8".into()
        };
        let payload = match (payloads, self.bytea) {
            (false, _) => "NULL::bytea".into(),
            (true, true) => quote_ident(&o.payload_column),
            (true, false) => format!(
                "convert_to({}::text, 'UTF8')",
                quote_ident(&o.payload_column)
            ),
        };
        format!(
            "SELECT {}, {}, {}, {}, {created}, {payload} FROM {} WHERE {}",
            text(&o.id_column),
            text(&o.aggregate_type_column),
            text(&o.event_type_column),
            text(&o.aggregate_id_column),
            self.qualified,
            self.predicate
        )
    }

    /// The creation time (µs since the Unix epoch) up to which the last `--record` proved the rows,
    /// as this snapshot shows it: `None` without a proof table the role may read, or without a
    /// proof in it.
    pub(crate) async fn previous_proof(&self, pg: &Client) -> Option<i64> {
        let readable: bool = pg
            .query_one(
                // Through the OID: for a table that does not exist it is NULL, not an error (an
                // error would end the snapshot's transaction).
                "SELECT coalesce(has_table_privilege(to_regclass($1), 'SELECT'), false)",
                &[&self.proof_table],
            )
            .await
            .ok()?
            .get(0);
        if !readable {
            return None;
        }
        let sql = format!(
            "SELECT (extract(epoch FROM proven_created_at) * 1000000)::int8 FROM {}",
            self.proof_table
        );
        pg.query_opt(&sql, &[]).await.ok()??.get(0)
    }

    /// Reads every matching row through a cursor named `cursor`, calling `each` on each one (it may
    /// await, for the exact second look); `each` returns false to stop early.
    pub(crate) async fn scan<F>(
        &self,
        pg: &Client,
        o: &OutboxConfig,
        payloads: bool,
        cursor: &str,
        each: F,
    ) -> Result<(), VerifyError>
    where
        F: AsyncFnMut(RowView<'_>) -> Result<bool, VerifyError>,
    {
        self.declare(pg, o, payloads, cursor).await?;
        self.fetch_all(pg, o, cursor, each).await
    }

    /// Declares the cursor `cursor` over the matching rows: a `--where` Postgres cannot plan fails
    /// here, before anything is read. The rows are read later, by [`Table::fetch_all`], from the
    /// transaction's snapshot.
    pub(crate) async fn declare(
        &self,
        pg: &Client,
        o: &OutboxConfig,
        payloads: bool,
        cursor: &str,
    ) -> Result<(), VerifyError> {
        pg.execute(
            &format!(
                "DECLARE {cursor} NO SCROLL CURSOR FOR {}",
                self.select(o, payloads)
            ),
            &[],
        )
        .await
        .map_err(query_error(&o.table, "--where / --since"))?;
        Ok(())
    }

    /// Reads the rows of the cursor [`Table::declare`] declared, calling `each` on each one, and
    /// closes it.
    pub(crate) async fn fetch_all<F>(
        &self,
        pg: &Client,
        o: &OutboxConfig,
        cursor: &str,
        mut each: F,
    ) -> Result<(), VerifyError>
    where
        F: AsyncFnMut(RowView<'_>) -> Result<bool, VerifyError>,
    {
        let fetch = pg
            .prepare(&format!("FETCH {FETCH_ROWS} FROM {cursor}"))
            .await
            .map_err(query_error(&o.table, "FETCH"))?;
        let batch = async || -> Result<Vec<Row>, VerifyError> {
            pg.query_raw(&fetch, std::iter::empty::<i32>())
                .await
                .map_err(query_error(&o.table, "FETCH"))?
                .try_collect()
                .await
                .map_err(query_error(&o.table, "FETCH"))
        };
        let mut rows = batch().await?;
        loop {
            let more = rows.len() == FETCH_ROWS as usize;
            // The next batch is asked for before this one is looked at: Postgres reads it while
            // the rows here are hashed and compared (on one thread, the two would take turns).
            let (next, go_on) = tokio::join!(
                async { if more { Some(batch().await) } else { None } },
                async {
                    for row in &rows {
                        let view = RowView {
                            id: row.get(0),
                            aggregate_type: row.get(1),
                            event_type: row.get(2),
                            aggregate_id: row.get(3),
                            created_us: row.get(4),
                            payload: row.get::<_, Option<&[u8]>>(5).unwrap_or_default(),
                        };
                        if !each(view).await? {
                            return Ok(false);
                        }
                    }
                    Ok::<bool, VerifyError>(true)
                }
            );
            match (go_on?, next) {
                (true, Some(next)) => rows = next?,
                _ => break,
            }
        }
        pg.execute(&format!("CLOSE {cursor}"), &[])
            .await
            .map_err(query_error(&o.table, "CLOSE"))?;
        Ok(())
    }
}

/// The snapshot's WAL position and its oldest running transaction: the first query of the
/// transaction, so the snapshot is taken by it.
async fn snapshot_position(
    pg: &Client,
    table: &str,
) -> Result<(Option<Lsn>, Option<String>), VerifyError> {
    let row = pg
        .query_one(
            "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
             ELSE pg_current_wal_lsn() END)::text, pg_snapshot_xmin(pg_current_snapshot())::text",
            &[],
        )
        .await
        .map_err(query_error(table, "reading the snapshot's position"))?;
    let lsn = row.get::<_, Option<String>>(0).and_then(|s| s.parse().ok());
    Ok((lsn, row.get(1)))
}

/// The proof table of the outbox table `schema.name`, quoted: `<name>_proof` in its schema, cut
/// to Postgres' 63 bytes as Postgres cuts the name `sql/05_retention.sql` gives it.
pub(crate) fn proof_table(schema: &str, name: &str) -> String {
    let mut proof = format!("{name}_proof");
    let mut cut = proof.len().min(63);
    while !proof.is_char_boundary(cut) {
        cut -= 1;
    }
    proof.truncate(cut);
    format!("{}.{}", quote_ident(schema), quote_ident(&proof))
}
