//! `status` over the simulated servers: [`SimServers`] implements the library's `status::Facts`
//! from what the simulated Postgres and JetStream hold at one moment, so the status oracle
//! (`world.rs`) runs the command's own verdict (`status::status_over`), every rule and every text of
//! it, and only the servers' answers are simulated. What the simulated servers do not model (server
//! settings, publications, other hosts, `run`'s checks against a real catalog, a relay's HTTP word)
//! is answered as a set-up server with nothing to say would answer it.

use outbox_relay::Lsn;
use outbox_relay::config::Settings;
use outbox_relay::nats::NatsPort;
use outbox_relay::position::Position;
use outbox_relay::status::facts::{
    FactError, Facts, OrphanMark, ParkedStatus, PublicationRead, RelayWord, Scan, ServerStatus,
    SlotRow, StandbyStatus, State, StreamRead, Unreached, read_parked, unknown_stream,
};
use outbox_relay::warning::Warning;
use outbox_relay::{slot_mark, slot_scan};

use super::peek::InHand;

/// The slot as the simulated Postgres holds it at one moment: what `pg_replication_slots` and
/// `pg_stat_activity` would show, and what a peek of a copy of it hands over, one list of (LSN,
/// pgoutput message) per transaction.
pub(crate) struct SlotView {
    /// The walsender that holds the slot, if one does.
    pub(crate) active_pid: Option<i32>,
    /// `confirmed_flush_lsn`.
    pub(crate) confirmed: Lsn,
    /// Its changes from `confirmed` on (at least as far as the look's bound reaches).
    pub(crate) changes: Vec<Vec<(Lsn, bytes::Bytes)>>,
    /// The stop mark, with its changes up to `confirmed`.
    pub(crate) mark: Option<super::peek::MarkView>,
    /// The relay processes connected to Postgres (their connections' `outbox-relay/SLOT/PID`).
    pub(crate) relay_pids: Vec<u32>,
}

/// The simulated servers as `status` reads them: the slot's view, and the NATS port (`None` while
/// the simulated JetStream is down).
pub(crate) struct SimServers<'a> {
    pub(crate) settings: &'a Settings,
    pub(crate) view: SlotView,
    pub(crate) port: Option<NatsPort>,
}

impl Facts for SimServers<'_> {
    async fn postgres(&self) -> Result<(), Unreached> {
        // The oracle asks only while the simulated Postgres is up.
        Ok(())
    }

    async fn server(&self) -> Result<ServerStatus, FactError> {
        Ok(ServerStatus::unread(State::Exists))
    }

    async fn slot(&self) -> Result<Option<SlotRow>, FactError> {
        Ok(Some(SlotRow {
            active: self.view.active_pid.is_some(),
            active_pid: self.view.active_pid,
            confirmed_flush_lsn: Some(self.view.confirmed.to_string()),
            ..SlotRow::default()
        }))
    }

    async fn relay_pids(&self) -> Result<Vec<u32>, FactError> {
        Ok(self.view.relay_pids.clone())
    }

    async fn waiting(&self) -> Result<Scan, FactError> {
        let Ok(scan) = slot_scan::waiting(self.settings, &mut InHand(&self.view.changes[..])).await;
        Ok(scan)
    }

    async fn unheld_secs(&self) -> Result<Option<u64>, FactError> {
        // The simulated Postgres keeps no clock of since when the slot is unheld.
        Ok(None)
    }

    async fn held(&self) -> Result<bool, FactError> {
        Ok(self.view.active_pid.is_some())
    }

    async fn publication(&self) -> Result<PublicationRead, FactError> {
        Ok(PublicationRead {
            exists: true,
            tables: Vec::new(),
        })
    }

    async fn message_warnings(&self) -> Result<Vec<Warning>, FactError> {
        Ok(Vec::new())
    }

    async fn orphan_marks(&self) -> Result<Vec<OrphanMark>, FactError> {
        Ok(Vec::new())
    }

    async fn mark_at(&self) -> Result<Option<Lsn>, FactError> {
        Ok(self.view.mark.as_ref().map(|m| m.at))
    }

    async fn scan_mark(&self, slot_at: Lsn, after: Option<Position>) -> Result<Scan, FactError> {
        let changes = self.view.mark.as_ref().map_or(&[][..], |m| &m.changes[..]);
        let Ok(scan) =
            slot_mark::scan_mark(self.settings, &mut InHand(changes), slot_at, after).await;
        Ok(scan)
    }

    async fn stream(&self) -> StreamRead {
        let mut status = unknown_stream(&self.settings.config().nats.stream);
        if self.port.is_none() {
            return StreamRead {
                status,
                problem: Some("NATS unreachable (the simulated JetStream is down)".into()),
            };
        }
        status.state = State::Exists;
        status.exists = Some(true);
        StreamRead {
            status,
            problem: None,
        }
    }

    async fn parked(&self) -> Result<ParkedStatus, FactError> {
        // The library's own read of the parking subjects, over the simulated JetStream.
        let port = self
            .port
            .as_ref()
            .ok_or_else(|| FactError("NATS unreachable".into()))?;
        Ok(read_parked(port, self.settings).await?)
    }

    async fn nats(&self) -> Option<NatsPort> {
        self.port.clone()
    }

    async fn own_word(&self) -> Option<RelayWord> {
        None
    }

    async fn run_checks(&self) -> Result<(), FactError> {
        Ok(())
    }

    async fn standbys(&self, _reached: Option<&str>) -> Vec<StandbyStatus> {
        Vec::new()
    }
}
