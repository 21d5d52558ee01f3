//! The operator's side of parking a key (docs/recovery.md, "A parked key"): sql/09_requeue.sql's
//! release functions (`sql.rs`), the `requeue` command that calls them (`requeue.rs`) and the
//! `parked` command that lists what is parked (`parked.rs`), each against real servers.

mod parked;
mod requeue;
mod sql;

/// sql/09_requeue.sql as shipped.
pub(crate) fn requeue_sql() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/09_requeue.sql");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// sql/09_requeue.sql with psql variables set first, as `-v name=value` would.
pub(crate) fn requeue_sql_with(vars: &[(&str, &str)]) -> String {
    let mut sql: String = vars
        .iter()
        .map(|(name, value)| format!("\\set {name} '{value}'\n"))
        .collect();
    sql.push_str(&requeue_sql());
    sql
}
