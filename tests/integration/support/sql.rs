//! The repository's SQL scripts as tests install them: a file of `sql/` as shipped, and
//! sql/09_requeue.sql with psql variables set first (its operator role, a relay's name), as
//! `psql -v name=value` would set them.

/// The text of `sql/<file>`.
pub(crate) fn sql_file(file: &str) -> String {
    let path = format!("{}/sql/{file}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// sql/09_requeue.sql as shipped.
pub(crate) fn requeue_sql() -> String {
    sql_file("09_requeue.sql")
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
