//! One database per test on a `PgServer`, with a slot name and a publication name of its own, so tests
//! on the shared server never see each other's tables, slots or publications.
//!
//! Drop removes everything the test made in it: replication slots (which would otherwise pin WAL on
//! the shared server and block `DROP DATABASE`), then the database, with its backends terminated.

use std::time::Duration;

use super::postgres::{PgConn, PgServer};

/// A database of its own on a Postgres test server, dropped with its slots on Drop.
pub struct TestDb {
    name: String,
    suffix: String,
    conn: PgConn,
}

impl TestDb {
    /// `CREATE DATABASE t_<unique>`; returns after it exists.
    pub async fn create(server: &PgServer) -> TestDb {
        let suffix = super::unique_suffix();
        let db = TestDb {
            name: format!("t_{suffix}"),
            suffix,
            conn: server.conn(),
        };
        let (client, connection) =
            tokio_postgres::connect(&server.url("postgres"), tokio_postgres::NoTls)
                .await
                .unwrap_or_else(|e| panic!("connect to {}: {e}", server.url("postgres")));
        let connection = tokio::spawn(connection);
        client
            .batch_execute(&format!("CREATE DATABASE {}", db.name))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {}: {e}", db.name));
        drop(client);
        let _ = connection.await;
        db
    }

    /// The database's name, `t_<unique>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Superuser URL of this database.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            self.conn.port(),
            self.name
        )
    }

    /// A connected client; its connection task runs on the current runtime.
    pub async fn client(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.url(), tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.url()));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                eprintln!("test db connection ended: {e}");
            }
        });
        client
    }

    /// `PgServer::psql` on this database.
    pub fn psql(&self, sql: &str) -> String {
        self.conn
            .psql(&self.name, sql)
            .unwrap_or_else(|e| panic!("psql on {} failed: {e}\n--- sql:\n{sql}", self.name))
    }

    /// Unique per TestDb: `s_<unique>`.
    pub fn slot_name(&self) -> String {
        format!("s_{}", self.suffix)
    }

    /// Unique per TestDb: `p_<unique>`.
    pub fn publication_name(&self) -> String {
        format!("p_{}", self.suffix)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // A relay under test may still be reconnecting and take a slot again between the terminate
        // and the drop; retry until the slot is free instead of failing the test.
        let sql = format!(
            "SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots \
               WHERE database = '{db}' AND active_pid IS NOT NULL;\n\
             SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
               WHERE database = '{db}' AND NOT active;\n\
             DROP DATABASE IF EXISTS {db} WITH (FORCE);",
            db = self.name
        );
        let mut last_error = String::new();
        for _ in 0..50 {
            match self.conn.psql("postgres", &sql) {
                Ok(_) => return,
                // The server is gone (a private one stopped or dropped first): nothing to clean.
                Err(e) if e.contains("Connection refused") || e.contains("could not connect") => {
                    return;
                }
                Err(e) => last_error = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Never panic in Drop: it may run while a failed test unwinds.
        eprintln!(
            "warning: could not drop test database {}: {last_error}",
            self.name
        );
    }
}
