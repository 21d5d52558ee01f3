//! The operator's side of parking a key (docs/recovery.md, "A parked key"): `requeue`, which asks the
//! relay through the WAL to release a parked key or one dead letter by calling sql/09_requeue.sql's
//! functions ([`send`]) and then waits, bounded, until the relay reports it stored ([`wait_stored`]);
//! and `parked`, which lists the parked keys from the stream. Neither writes to the stream: the relay
//! alone carries a release out, when it reads the control message in commit order.

mod error;
mod functions;
mod key;
mod requeue;
mod wait;

pub use error::RequeueError;
pub use key::{Key, KeyError};
pub use requeue::{Request, Sent, send, wait_stored};
pub use wait::Waited;
