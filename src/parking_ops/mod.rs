//! The operator's side of parking a key (docs/recovery.md, "A parked key"): `requeue`, which asks the
//! relay through the WAL to release a parked key or one dead letter by calling sql/09_requeue.sql's
//! functions ([`send`]) and then waits, bounded, until the relay reports it stored ([`wait_stored`]);
//! and `parked`, which lists the parked keys from the stream. Neither writes to the stream: the relay
//! alone carries a release out, when it reads the control message in commit order.

mod error;
mod functions;
mod key;
mod parked;
mod requeue;
mod wait;

pub use error::RequeueError;
pub use key::{Key, KeyError};
pub use parked::{Parked, ParkedError, ParkedReport, parked};
pub use requeue::{Request, Sent, refuse_event, refuse_unparked, send, wait_stored};
pub use wait::Waited;
