//! [`State`]: what the relay remembers from one session to the next (where it stands, what the
//! last sessions found, how they failed), and the policy applied to what a session reports: that
//! it streams ([`State::streaming`]), what its slot check found ([`State::slot_checked`]), that it
//! stored a new event ([`State::stored_new`]). A session borrows it; it reaches nothing else of
//! the relay but the connector, the metrics and the position it serves.

use tracing::{debug, error, info};

use crate::Lsn;
use crate::metrics::Metrics;
use crate::slot_mark::{Consumed, SlotCheck};

use super::error::{CauseKind, SessionEnd};
use super::policy;

/// What outlives a session.
pub(super) struct State {
    /// Failed sessions in a row (drives the backoff); 0 once new events are stored.
    pub(super) failures: u32,
    /// The kind of the last failure, so each change of state is logged once, not every retry.
    pub(super) last_cause: Option<CauseKind>,
    /// The last LSN confirmed to the slot by this process; sessions restart here.
    pub(super) confirmed: Lsn,
    /// The system and timeline the last session streamed.
    pub(super) history: Option<crate::position::History>,
    /// Why and which tail a session found unreliable ([`crate::sink::SinkError::distrust`]): the
    /// next sessions skip nothing while the stream still ends there, until one has stored a new
    /// event (its own tail is then one to trust), and their warn line says why
    /// ([`crate::sink::Distrust`]).
    pub(super) distrust: Option<crate::sink::Distrust>,
    /// The report of a client that consumed the slot, as last logged (logged again only when it
    /// changes), and handed to the next look, which keeps it when it cannot compare.
    pub(super) consumed: Option<Consumed>,
}

impl State {
    /// A relay that has not streamed yet, starting from `confirmed`.
    pub(super) fn new(confirmed: Lsn) -> State {
        State {
            failures: 0,
            last_cause: None,
            confirmed,
            history: None,
            distrust: None,
            consumed: None,
        }
    }

    /// A session started streaming `slot` (facts the session reports; the policy is decided here).
    /// Postgres trouble (or waiting as a standby) ends here; NATS trouble ends at the next new
    /// ack ([`State::stored_new`]). The backoff is kept until a new event is stored or the session
    /// has run a while: a server that accepts the start and drops the connection at once must not
    /// get a restart every 100 ms.
    pub(super) fn streaming(&mut self, metrics: &Metrics, slot: &str) {
        metrics.standby.set(0);
        match self.last_cause {
            // From the slot's own position; `confirmed` is the last this process confirmed.
            None => info!(%slot, confirmed = %self.confirmed, "streaming"),
            Some(CauseKind::Postgres | CauseKind::SlotHeld) => {
                info!(%slot, confirmed = %self.confirmed, "recovered: streaming again");
                self.last_cause = None;
            }
            Some(CauseKind::Nats) => {
                debug!(%slot, confirmed = %self.confirmed, "streaming (retry)")
            }
        }
    }

    /// What the session's [`super::Connector::slot_check`] found: a client that consumed the slot
    /// past events the stream lacks ends the session (logged and counted, like a lost slot); a
    /// check that could not tell is logged once.
    pub(super) fn slot_checked(
        &mut self,
        metrics: &Metrics,
        check: &SlotCheck,
    ) -> Result<(), SessionEnd> {
        let events = check.consumed.as_ref().map_or(0, |c| c.events);
        metrics.slot_consumed_events.set(events);
        let Some(consumed) = &check.consumed else {
            if let Some(why) = &check.unknown {
                info!(%why, "whether another client consumed the slot since the last session cannot be told");
            }
            self.consumed = None;
            return Ok(());
        };
        let text = consumed.to_string();
        if self.consumed.as_ref() != Some(consumed) {
            error!(
                slot = %consumed.slot,
                from = %consumed.mark_at,
                to = %consumed.slot_at,
                events = consumed.events,
                first = %consumed.first.id,
                "{text}"
            );
            self.consumed = Some(consumed.clone());
        }
        Err(policy::slot_consumed(text))
    }

    /// A session stored a new event (or dead letter): the way to the stream works again.
    pub(super) fn stored_new(&mut self) {
        if self.last_cause == Some(CauseKind::Nats) {
            info!(confirmed = %self.confirmed, "recovered: JetStream acknowledges again");
        }
        self.failures = 0;
        self.last_cause = None;
        self.distrust = None;
    }
}
