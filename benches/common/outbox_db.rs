//! The database a bench's relay reads: the relay's outbox table as `sql/01_outbox_table.sql` makes it,
//! without autovacuum, and a publication of its inserts. Shared by the drain and sustained-load
//! benches, each a binary of its own.

use outbox_relay::testkit::TestDb;

/// The outbox table (sql/01) and `publication` for its inserts. No autovacuum: its WAL would land
/// between a backlog and its end position on some runs only, and its CPU inside some phases only.
pub(crate) fn outbox_setup(db: &TestDb, publication: &str) -> anyhow::Result<()> {
    let outbox_sql = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/sql/01_outbox_table.sql"
    ))?;
    db.psql(&format!(
        "{outbox_sql}\nALTER TABLE public.outbox SET (autovacuum_enabled = false);\n\
         CREATE PUBLICATION {publication} FOR TABLE public.outbox WITH (publish = 'insert');"
    ));
    Ok(())
}
