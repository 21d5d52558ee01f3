//! Test support. The server fixtures (`PgServer`, `NatsServer`, `TestDb`, process plumbing) live in
//! the library as `outbox_relay::testkit` (feature `test-support`), so the benches share the same
//! copy; this module re-exports them and adds what only the tests need: a TCP proxy that can cut or
//! stall connections, and harnesses that run the relay in process or as the built binary.
//!
//! - `PgServer::shared()` is one Postgres per test binary; `PgServer::start_private()` is for tests
//!   that stop, restart or crash it.
//! - `PgPair::start()` is a primary with a streaming physical standby (and failover slot sync on
//!   PG 17+), for high-availability tests; see `src/testkit/pg_pair.rs`.
//! - `NatsServer::start()` is a JetStream server per test.
//! - `TestDb::create(server)` is a database per test, with its own slot and publication names.
//! - `Scenario::builder()…start()` is the usual beginning of an end-to-end test: a database on the shared
//!   Postgres with the test's SQL, a JetStream server, the relay's config with the test's changes,
//!   and the clients (`scenario.rs`); the builder also takes a private Postgres, a NATS server with
//!   a configuration and credentials, schemas and parking, and sql/09's operator role.
//!   `Scenario::listening()` is the one with an HTTP listener on a `free_addr()`.
//! - `free_addr`, `http_get`: an address for the relay's HTTP listener and a GET of it (`http.rs`).
//! - `sql_file`, `requeue_sql_with`: the repository's SQL scripts as tests install them (`sql.rs`).

#![allow(dead_code)]

mod http;
mod otlp;
mod proxy;
mod relay;
mod scenario;
mod sql;

pub(crate) use http::{free_addr, http_get};
pub(crate) use otlp::{OtlpReceiver, ReceivedSpan};
pub(crate) use outbox_relay::testkit::{
    NatsServer, PgPair, PgServer, SyncedSlot, TestDb, process, server_major, unique, wait_for,
};
pub(crate) use proxy::*;
pub(crate) use relay::{
    Finished, InProcessRelay, RelayProcess, Stored, TEXT_ID_OUTBOX_SQL, confirmed_flush,
    current_wal_lsn, default_outbox_sql, read_all, relay_config, relay_env, run_command,
    slot_exists, stream_count,
};
pub(crate) use scenario::{ROLE_PASSWORD, Scenario, ScenarioBuilder};
pub(crate) use sql::{requeue_sql, requeue_sql_with, sql_file};
