//! outbox-relay: the relay of the transactional outbox pattern, without polling.
//!
//! An application writes its business change and an outbox row in one Postgres transaction. This crate
//! reads the committed outbox inserts from the write-ahead log through a logical replication slot
//! (`pgoutput`), publishes each to a NATS JetStream subject chosen by its aggregate type, and moves the
//! slot's confirmed position forward only after JetStream acknowledged storing every event before it.
//!
//! ```text
//! Postgres walsender
//!   │ CopyBoth (XLogData, keepalives)            ▲ standby status updates (flush = confirmed LSN)
//!   ▼                                            │
//! source     replication connection: TLS, auth, START_REPLICATION, framing, status-update timer
//!   ▼
//! pgoutput   pure decoder: bytes → Begin / Relation / Insert / Commit / …
//!   ▼
//! outbox     relation cache; picks INSERTs into the outbox table; row → OutboxEvent
//!   ▼
//! route      subject from a template (outbox.{aggregate_type}); validates tokens
//!   ▼
//! sink       JetStream publisher: bounded window of in-flight publishes, acks awaited in order
//!   ▼
//! progress   in-order tracker: a transaction is done when all its acks arrived and every earlier one
//!            is done; confirmed LSN = its Commit.end_lsn
//!   └──────────► back to source (the status-update writer reads it)
//! ```
//!
//! # Promises
//!
//! P1 no loss; P2 the slot never passes an unacknowledged event; P3 every message carries
//! `Nats-Msg-Id` = event id, so JetStream drops redeliveries; P4 commit order, and insert order within a
//! transaction; P5 idle slots still advance; P6 memory bounded by the in-flight window; P7 bad events go
//! to a dead-letter subject, never silently skipped; P8 bad settings fail with a one-line error.
//! Consumers deduplicate by `Nats-Msg-Id`: delivery is at least once.

pub mod config;
pub mod fence;
pub mod http;
pub mod lsn;
pub mod message;
pub mod metrics;
pub mod outbox;
pub mod pgoutput;
pub mod progress;
pub mod relay;
pub mod route;
pub mod setup;
pub mod sink;
pub mod source;
pub mod status;
#[cfg(feature = "test-support")]
pub mod testkit;

pub use lsn::Lsn;
