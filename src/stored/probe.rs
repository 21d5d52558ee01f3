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

/// How a [`PositionProbe::wait`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    /// "Stored": every event through the LSN waited for is in the stream; the stored LSN then.
    Stored(Lsn),
    /// Not yet, within the timeout.
    TimedOut,
    /// Overloaded or stopping: ask again.
    NoAnswer,
}

impl PositionProbe {
    /// A position service for `settings`' slot and stream, not serving until a session streams.
    /// Nothing answers waits through it: only [`PositionProbe::served`] reads it.
    ///
    /// Its wait task runs on the caller's runtime, as `run`'s does, so that [`PositionProbe::wait`]
    /// goes through the same wait queue a `/wait` request does.
    pub fn new(settings: &Settings) -> Self {
        let (positions, waits) = Positions::new(
            &settings.config().postgres.slot,
            &settings.config().nats.stream,
        );
        tokio::spawn(waits.run());
        PositionProbe(positions)
    }

    /// A `/wait` for `lsn` of at most `timeout`, through the wait queue: `None` while no session
    /// streams the slot (503), else what it answers when it does.
    pub fn wait(
        &self,
        lsn: Lsn,
        timeout: std::time::Duration,
    ) -> Option<impl std::future::Future<Output = Waited> + Send + 'static> {
        let answer = self.0.wait(super::WaitRequest { lsn, timeout }, 0).ok()?;
        Some(async move {
            match answer.await {
                super::WaitOutcome::Stored { stored_lsn, .. } => Waited::Stored(stored_lsn),
                super::WaitOutcome::TimedOut { .. } => Waited::TimedOut,
                super::WaitOutcome::Overloaded | super::WaitOutcome::Stopping => Waited::NoAnswer,
            }
        })
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
