//! The single integration test binary: real Postgres and NATS servers are started by `support` (once
//! per binary for the shared Postgres), so every test module is listed here rather than being its own
//! binary. Add a module: one `mod name;` line below.

mod support;

mod atomic;
mod backfill;
mod cluster;
mod consumer_recipes;
mod consumers;
mod deploy;
mod docs_lists;
mod events;
mod faults;
mod foreign_consumer;
mod ha;
mod hostile;
mod lifecycle;
mod long_functions;
mod message_default;
mod migrating;
mod module_graph;
mod named_relays;
mod ops;
mod parking;
mod parking_ops;
mod permissions;
mod platforms;
mod printed_commands;
mod quickstart_step4;
mod relay;
mod replay_proof;
mod resume;
mod schemas;
mod smoke;
mod source;
mod status_truth;
mod telemetry;
mod truth;
mod verify;
