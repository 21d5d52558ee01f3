//! The relay's NATS side, beside `source/` (the Postgres side): the connection built from the
//! settings (`connect_nats`, `connect.rs`) that the sink, `setup`, `status`, `verify` and the
//! backfill open, the port the sink publishes and reads through ([`JetStreamPort`], shared as
//! [`NatsPort`]), its implementation by the real async-nats client (`client.rs`), the bulk
//! read-back of a range of the stream (`readback.rs`), JetStream's answers to publishes
//! (`answer.rs`), and the one error every request of the port fails with ([`NatsError`], a kind and
//! its cause, `error.rs`). The deterministic simulation (tests/simulation) implements the same port
//! over its in-memory JetStream, so nothing here knows a simulator exists.

pub(crate) mod answer;
mod client;
mod connect;
mod error;
mod port;
mod readback;

pub(crate) use connect::{ConnectError, connect_nats};
pub use error::{NatsError, NatsErrorKind};
pub use port::{Answers, HeaderRead, JetStreamPort, NatsPort, StreamTail};
pub(crate) use readback::ClientReader;
