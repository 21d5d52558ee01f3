//! A read-only view of a relay process's position service for the deterministic simulation: the
//! stored LSN `/wait` answers by and the confirmed LSN `/position` reports, read straight from the
//! [`Positions`] the restart loop serves, so the simulation can check every claim against what its
//! simulated stream holds. It only reads: the caller makes it
//! before the relay starts ([`PositionProbe::new`]) and hands a clone to `relay::run_with`, which
//! serves through it as `run` serves through its own.

use std::sync::Arc;

use super::Positions;
use crate::Lsn;
use crate::config::Settings;

/// The position service of one relay process, as its clients would see it.
#[derive(Clone, Debug)]
pub struct PositionProbe(pub(crate) Arc<Positions>);

/// What the position service answers now (see [`super::Position`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    /// A `/wait` for an LSN at or below this is answered "stored" at once.
    pub stored_lsn: Lsn,
    /// What `/position` reports as confirmed to the slot.
    pub confirmed_lsn: Lsn,
    /// The stream sequence of the last message the relay stored.
    pub last_sequence: u64,
}

impl PositionProbe {
    /// A position service for `settings`' slot and stream, not serving until a session streams.
    /// Nothing answers waits through it: only [`PositionProbe::served`] reads it.
    pub fn new(settings: &Settings) -> Self {
        let (positions, _waits) = Positions::new(
            &settings.config().postgres.slot,
            &settings.config().nats.stream,
        );
        PositionProbe(positions)
    }

    /// What `/position` would answer now; `None` while no session streams the slot (a standby,
    /// between sessions), when it answers 503.
    pub fn served(&self) -> Option<Served> {
        self.0.position().ok().map(|p| Served {
            stored_lsn: p.stored_lsn,
            confirmed_lsn: p.confirmed_lsn,
            last_sequence: p.last_sequence,
        })
    }
}
