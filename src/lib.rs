//! outbox-relay: the relay of the transactional outbox pattern, without polling.
//!
//! An application writes its business change and an outbox row in one Postgres transaction. This crate
//! reads the committed outbox inserts from the write-ahead log through a logical replication slot
//! (`pgoutput`), publishes each to a NATS JetStream subject chosen by its aggregate type, and moves the
//! slot's confirmed position forward only after JetStream acknowledged storing every event before it.
//!
//! ```text
//!  data flows down                                          operator tools, to one side
//!
//!  Postgres walsender                                       config     TOML + OUTBOX_RELAY_* → Settings
//!    │ CopyBoth (XLogData, keepalives)  ▲ status updates     setup      checks, then publication/slot/stream
//!    ▼                                  │ (flush = confirmed) status     slot, stream and verdict, read only
//!  source     replication connection: TLS, auth, framing     catalog    the slot queries setup/status/relay share
//!    ▼                                  │                    http       /metrics /healthz /readyz
//!  pgoutput   pure decoder: bytes → Begin / Insert / Commit   metrics    counters and gauges, one struct
//!    ▼                                  │
//!  outbox     relation cache; INSERT → OutboxEvent (id once)  relay/     run: restart loop, backoff, standby
//!    ▼                                  │                      session  start / run / drain of one session
//!  sink/      one publisher: where each event goes (its       monitor  NATS state, slot lag sampler
//!    │        subject, rendered by route, or its dead letter), policy   restart · standby · stop · defect
//!    │        window (messages + bytes), acks, fence (skip     verify     rows against the stream, read only
//!    │        stored, expected sequence), atomic batches
//!    │        through nats/ (JetStreamPort: the async-nats client, or a simulator; NatsError)
//!    ▼                                  │
//!  progress   in-order tracker → confirmed LSN = Commit.end_lsn
//!    └──────────────────────────────────┘
//! ```
//!
//! # Promises
//!
//! P1 no loss; P2 the slot never passes an unacknowledged event; P3 every message carries
//! `Nats-Msg-Id` = event id, so JetStream drops redeliveries; P4 commit order, and insert order within a
//! transaction; P5 idle slots still advance; P6 memory bounded by the in-flight window; P7 bad events go
//! to a dead-letter subject, never silently skipped; P8 bad settings fail with a one-line error;
//! P9 a lost slot is never replaced quietly; P10 P1–P4 hold across a Postgres failover and the loss
//! of a JetStream node; P11 no input makes the relay panic, wedge or leak a secret. Each is stated in
//! docs/guarantees.md; where the code keeps it, in docs/architecture.md.
//! Consumers deduplicate by `Nats-Msg-Id`: delivery is at least once.

#![warn(missing_docs)]

pub mod backfill;
pub mod backfill_marker;
mod catalog;
pub mod check_schemas;
pub mod config;
pub mod error_chain;
pub mod event;
mod fnv;
mod header_name;
mod http;
mod lsn;
pub mod message;
pub mod metrics;
pub mod nats;
pub mod outbox;
pub mod parking;
pub mod parking_ops;
pub mod pgoutput;
pub mod position;
pub mod progress;
pub mod relay;
mod relay_word;
pub mod reload;
pub mod route;
pub mod schema;
mod secret_file;
pub mod setup;
pub mod sink;
pub mod slot_mark;
pub mod slot_scan;
pub mod source;
pub mod status;
pub(crate) mod stored;
pub(crate) mod tail;
pub(crate) mod telemetry;
/// The OTLP exporter's encoder and HTTP client, for benches/otlp.rs.
#[cfg(feature = "test-support")]
pub use telemetry::bench as telemetry_bench;
#[cfg(feature = "test-support")]
pub mod testkit;
mod text;
pub mod timeline;
pub mod verify;
pub mod warning;

pub use lsn::Lsn;
