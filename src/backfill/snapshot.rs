//! The backfill's queries on the outbox table, all on the control connection: the query that
//! `--where` and `--order-by` make, importing the slot's exported snapshot, the table's columns as
//! pgoutput sends them, the count of matching rows, and the server-side cursor that reads them,
//! [`FETCH_ROWS`] at a time. A failed query is a [`BackfillError::Query`] saying what it was for.

use super::port::{Control, CursorError, QueryError};
use super::{BackfillError, BackfillOptions};
use crate::config::Settings;
use crate::pgoutput::Column;
use crate::source::quote_ident;

/// Rows per `FETCH`: large enough to amortise the round trip, small enough that the rows in one
/// fetch are a small part of the publish window.
pub(super) const FETCH_ROWS: u32 = 1000;
const CURSOR: &str = "outbox_relay_backfill";

/// `SELECT <columns> FROM <outbox table> WHERE (<--where>) ORDER BY <--order-by or the id column>`.
pub(super) fn snapshot_query(settings: &Settings, opts: &BackfillOptions, columns: &str) -> String {
    let (schema, name) = settings.config().outbox.table_parts();
    let qualified = format!("{}.{}", quote_ident(schema), quote_ident(name));
    let predicate = opts.where_sql.as_deref().unwrap_or("true");
    let order = match &opts.order_by {
        Some(o) => o.clone(),
        None => quote_ident(&settings.config().outbox.id_column),
    };
    format!("SELECT {columns} FROM {qualified} WHERE ({predicate}) ORDER BY {order}")
}

/// A failed query on the outbox table as [`BackfillError::Query`], saying what it was for.
pub(super) fn query_error(
    table: &str,
    what: &str,
) -> impl FnOnce(QueryError) -> BackfillError + use<> {
    let table = table.to_owned();
    let what = what.to_owned();
    move |message: QueryError| BackfillError::Query {
        table,
        what,
        message,
    }
}

/// The outbox table as a quoted, schema-qualified name.
fn qualified_table(settings: &Settings) -> String {
    let (schema, name) = settings.config().outbox.table_parts();
    format!("{}.{}", quote_ident(schema), quote_ident(name))
}

/// Opens the read-only REPEATABLE READ transaction that sees the slot's exported snapshot.
pub(super) async fn import_snapshot(
    pg: &dyn Control,
    snapshot: &str,
    table: &str,
) -> Result<(), BackfillError> {
    pg.import_snapshot(snapshot.to_owned())
        .await
        .map_err(query_error(table, "importing the slot's snapshot"))
}

/// Every column of the outbox table, in table order, as pgoutput sends them (generated columns are
/// not sent).
pub(super) async fn outbox_columns(
    settings: &Settings,
    pg: &dyn Control,
) -> Result<Vec<Column>, BackfillError> {
    pg.columns(qualified_table(settings))
        .await
        .map_err(query_error(
            &settings.config().outbox.table,
            "reading its columns",
        ))
}

/// How many rows match `--where` in the snapshot; refuses more than `u32::MAX`.
pub(super) async fn count_rows(
    settings: &Settings,
    opts: &BackfillOptions,
    pg: &dyn Control,
) -> Result<u64, BackfillError> {
    let qualified = qualified_table(settings);
    let predicate = opts.where_sql.as_deref().unwrap_or("true");
    let total: i64 = pg
        .count(format!(
            "SELECT count(*) FROM {qualified} WHERE ({predicate})"
        ))
        .await
        .map_err(query_error(&settings.config().outbox.table, "--where"))?;
    let total = total.max(0) as u64;
    if total > u64::from(u32::MAX) {
        return Err(BackfillError::TooManyRows);
    }
    Ok(total)
}

/// Declares the cursor over the matching rows (every column as text) and prepares its `FETCH`.
pub(super) async fn declare_cursor(
    settings: &Settings,
    opts: &BackfillOptions,
    pg: &dyn Control,
    columns: &[Column],
) -> Result<(), BackfillError> {
    let table = settings.config().outbox.table.as_str();
    let select: Vec<String> = columns
        .iter()
        .map(|c| format!("{}::text", quote_ident(&c.name)))
        .collect();
    pg.declare_cursor(
        format!(
            "DECLARE {CURSOR} NO SCROLL CURSOR FOR {}",
            snapshot_query(settings, opts, &select.join(", "))
        ),
        format!("FETCH {FETCH_ROWS} FROM {CURSOR}"),
    )
    .await
    .map_err(|e| match e {
        CursorError::Declare(m) => query_error(table, "--where / --order-by")(m),
        CursorError::Fetch(m) => query_error(table, "FETCH")(m),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
