//! Parking a key (`outbox.on_invalid = "park"`): an event that cannot be published as it is parks
//! its key, and that event and every later event of the key go, in commit order, to the key's
//! parking subject in the relay's stream, until a control message in the WAL releases the key
//! (requeue: the run goes to its subjects, validated again; discard: dropped). Every other key
//! flows, and the slot advances: parked events are stored.
//!
//! This folder holds what the sink, the session and the operator tools share about it, pure or
//! reading the stream through the NATS port: a key and its subject (`key.rs`), the parked set a
//! session holds (`set.rs`), what the stream says is parked and a key's run (`ledger.rs`, the one
//! reader: `parked`, `status` and `verify` use it too), and a control message's content
//! (`control.rs`), and one event's dead letter found for a `requeue_event` (`dead_letter.rs`,
//! with `revive.rs` turning what it reads back into the event). The messages themselves (a parked copy, a release marker) are built in
//! `message/parked.rs`; where an event goes is decided in the sink (`sink/destination.rs`).

pub mod control;
pub mod dead_letter;
pub mod key;
pub mod ledger;
#[cfg(feature = "test-support")]
pub mod mutation;
pub mod revive;
pub mod set;

pub use key::{KeyHash, key_of_subject, parked_filter, parked_subject};
pub use set::{Full, ParkedKey, ParkedSet};
