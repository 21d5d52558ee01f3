//! How a session reaches its servers: [`Connector`]. The relay's restart loop and sessions only
//! ever talk to Postgres and NATS through it, so the deterministic simulation (tests/simulation)
//! can run the real loop, session, sink, fence and progress against simulated servers, and
//! [`Servers`] is the production one: real connections from the settings.

use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::Lsn;
use crate::catalog;
use crate::config::Settings;
use crate::metrics::Metrics;
use crate::nats::NatsPort;
use crate::nats::connect_nats;
use crate::position::History;
use crate::slot_mark::{self, Consumed, PgMarks, SlotCheck};
use crate::source::{
    PgOutputOptions, ReplConnection, ReplicationStream, Shared, SourceError, StreamConfig,
    SystemInfo, TimelineHistory,
};

use super::error::{Restart, SessionEnd};
use super::monitor::{Background, watch_nats};
use super::policy::{self, from_source};

/// What a session needs to reach its servers.
pub trait Connector: Send + Sync {
    /// The NATS connection to publish through (kept until [`Connector::nats_failed`]).
    fn nats(&mut self) -> BoxFuture<'_, Result<NatsPort, Restart>>;
    /// A NATS failure ended the session: the next session must not reuse a connection that may
    /// still send what it had buffered (after the point the new session republishes from).
    fn nats_failed(&mut self);
    /// A replication stream of the slot from its own position ([`Start::FROM_SLOT`]), and what
    /// `IDENTIFY_SYSTEM` answered first on the same connection.
    fn replication(&mut self)
    -> BoxFuture<'_, Result<(ReplicationStream, SystemInfo), SessionEnd>>;
    /// The OIDs of the outbox table's partitions (asked when a relation the stage does not know
    /// arrives).
    fn partitions(&mut self) -> BoxFuture<'_, Result<Vec<u32>, SessionEnd>>;
    /// The slot as a session that holds it finds it (`system`: what the session's `IDENTIFY_SYSTEM`
    /// said): its position, and whether another client consumed it past events the stream lacks
    /// (`slot_mark.rs`); `reported`: what this process's last look reported, which a look that
    /// cannot compare keeps while its mark stands. The default knows neither.
    fn slot_check<'a>(
        &'a mut self,
        system: &'a SystemInfo,
        reported: Option<&'a Consumed>,
    ) -> BoxFuture<'a, SlotCheck> {
        let _ = (system, reported);
        Box::pin(async { SlotCheck::default() })
    }
    /// A session that confirmed `confirmed` ends while its walsender (`walsender_pid`) may still
    /// hold the slot: leave the stop mark the next session's [`Connector::slot_check`] compares
    /// with. The default leaves none.
    fn session_ended(&mut self, walsender_pid: i32, confirmed: Lsn) -> BoxFuture<'_, ()> {
        let _ = (walsender_pid, confirmed);
        Box::pin(async {})
    }
    /// The relay ends: stop and await what the connector runs in the background. The default runs
    /// nothing.
    fn close(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// Where a session starts streaming, and what the relay remembers of where it left the slot.
#[derive(Clone, Debug, Default)]
pub struct Start {
    /// The last position this process confirmed to the slot.
    pub(crate) confirmed: Lsn,
    /// The system and timeline the last session streamed, if any.
    pub(crate) history: Option<History>,
}

impl Start {
    /// The position every session starts from: `0/0`, which asks the server for the slot's own
    /// confirmed position, never one this process remembers. After a restore from a disk snapshot
    /// (same system, same timeline) the server's slot is back where the snapshot left it and the
    /// WAL after it is written anew, possibly past the remembered position before the relay
    /// reconnects: a start there would skip every new transaction below it and confirm past them.
    /// Nothing on the connection tells a restore apart; the slot's own position is right in every
    /// case, and what it sends again that is stored already the fence skips or JetStream drops.
    pub const FROM_SLOT: Lsn = Lsn::ZERO;

    /// Whether the server is visibly not where the relay left it: its WAL ends before the
    /// remembered position, its system changed, or its timeline changed to one that does not
    /// hold what this relay confirmed (a restore, a point-in-time recovery to a point before it).
    /// A promoted standby is on a new timeline that branched off the remembered one at or past the
    /// confirmed position: everything confirmed is still its history, so it has not moved. Only
    /// for the log and the position service: [`Start::FROM_SLOT`] is the slot's position anyway.
    pub(crate) fn moved(&self, system: &SystemInfo) -> bool {
        if system.xlogpos < self.confirmed {
            return true;
        }
        let Some(before) = &self.history else {
            return false;
        };
        if before.system_id != system.system_id {
            return true;
        }
        match system.history.shared(before.timeline) {
            Shared::All => false,
            // The remembered timeline ended at `end`: what was confirmed up to it survived.
            Shared::Below(end) => self.confirmed > end,
            // Neither this timeline nor an ancestor (or its history could not be read).
            Shared::Nothing => true,
        }
    }
}

/// The production connector: real Postgres and NATS connections from the settings.
pub(crate) struct Servers {
    settings: Arc<Settings>,
    metrics: Arc<Metrics>,
    /// The NATS client sessions publish through, and the task that watches its connection.
    nats: Option<(async_nats::Client, Background)>,
}

impl Servers {
    /// A connector that starts with the NATS client `run` connected while it set up.
    pub(crate) fn new(
        settings: Arc<Settings>,
        metrics: Arc<Metrics>,
        nats: async_nats::Client,
    ) -> Self {
        let mut s = Servers {
            settings,
            metrics,
            nats: None,
        };
        s.keep(nats);
        s
    }

    fn keep(&mut self, client: async_nats::Client) {
        let mut watch = Background::default();
        watch.spawn(
            "NATS watcher",
            watch_nats(client.clone(), Arc::clone(&self.metrics)),
        );
        self.nats = Some((client, watch));
    }
}

impl Servers {
    /// Every session, before it takes the slot: [`refuse_under_backfill`], over the connection
    /// `run` keeps (none after a NATS failure: the session's own look at the stream follows).
    async fn refuse_unfinished_backfill(&self) -> Result<(), SessionEnd> {
        let Some((client, _)) = &self.nats else {
            return Ok(());
        };
        refuse_under_backfill(&self.settings, client).await
    }
}

/// A session must not take a slot an unfinished backfill's marker guards
/// ([`crate::backfill_marker::refusal_for_run`]): the relay stops with the marker's refusal.
pub async fn refuse_under_backfill(
    settings: &Settings,
    js: &dyn crate::nats::JetStreamPort,
) -> Result<(), SessionEnd> {
    match crate::backfill_marker::refusal_for_run(settings, js).await {
        Some(problem) => Err(policy::backfill_unfinished(
            &settings.config().nats.stream,
            problem,
        )),
        None => Ok(()),
    }
}

impl Connector for Servers {
    fn nats(&mut self) -> BoxFuture<'_, Result<NatsPort, Restart>> {
        Box::pin(async move {
            if let Some((c, _)) = &self.nats {
                return Ok(NatsPort::from(c.clone()));
            }
            let c = connect_nats(&self.settings)
                .await
                .map_err(policy::from_connect)?;
            self.keep(c.clone());
            Ok(NatsPort::from(c))
        })
    }

    fn nats_failed(&mut self) {
        // Aborted, not awaited: the next session connects anew meanwhile.
        self.nats = None;
    }

    fn close(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some((_, watch)) = self.nats.take() {
                watch.stop().await;
            }
        })
    }

    fn replication(
        &mut self,
    ) -> BoxFuture<'_, Result<(ReplicationStream, SystemInfo), SessionEnd>> {
        Box::pin(async move {
            self.refuse_unfinished_backfill().await?;
            let settings = &self.settings;
            let app = catalog::relay_application_name(
                &settings.config().postgres.slot,
                std::process::id(),
                None,
            );
            let mut conn = ReplConnection::connect(&settings.conn, &app)
                .await
                .map_err(from_source)?;
            let mut system = match conn.identify_system().await {
                Ok(s) => s,
                Err(e) => {
                    conn.close().await;
                    return Err(from_source(e));
                }
            };
            // On the same connection, so it is the same server's: which earlier timelines are
            // still this one's history, and up to where (a promoted standby's are).
            system.history = match conn.timeline_history(system.timeline).await {
                Ok(h) => h,
                // The server refused the command or sent a history that does not parse: the
                // session can go on, trusting less.
                Err(e @ (SourceError::Server { .. } | SourceError::Protocol(_))) => {
                    tracing::warn!(
                        error = %crate::error_chain::error_chain(&e),
                        timeline = system.timeline,
                        "TIMELINE_HISTORY failed: the stream's last message is trusted only if it is from \
                         this timeline, so after a promotion or recovery the replay publishes again what \
                         the stream holds (JetStream drops the duplicates inside its window)"
                    );
                    TimelineHistory::root(system.timeline)
                }
                Err(e) => {
                    conn.close().await;
                    return Err(from_source(e));
                }
            };
            let mut options =
                PgOutputOptions::new([settings.config().postgres.publication.clone()]);
            // Proto v1 is enough: no streaming of in-progress transactions (the relay publishes
            // only committed transactions), and v1 keeps the decoding identical on every server.
            options.proto_version = Some(1);
            // Logical messages are events (or trace context) only with a prefix, or release
            // parked keys; without any they would be decoded for nothing.
            options.messages = crate::parking::control::messages_read(settings);
            let stream_config = StreamConfig {
                status_interval: settings.status_interval,
                channel_capacity: 1024,
                max_frame_bytes: settings.config().postgres.max_frame_bytes,
                ..StreamConfig::default()
            };
            let start = Start::FROM_SLOT;
            match conn
                .start_replication(
                    &settings.config().postgres.slot,
                    start,
                    &options,
                    stream_config,
                )
                .await
            {
                Ok(s) => Ok((s, system)),
                Err((e, conn)) => {
                    if let Some(c) = conn {
                        c.close().await;
                    }
                    Err(classify_start_error(settings, e).await)
                }
            }
        })
    }

    fn slot_check<'a>(
        &'a mut self,
        system: &'a SystemInfo,
        reported: Option<&'a Consumed>,
    ) -> BoxFuture<'a, SlotCheck> {
        Box::pin(async move {
            let nats = self.nats.as_ref().map(|(c, _)| c.clone());
            tokio::time::timeout(
                SLOT_CHECK_TIMEOUT,
                check_slot(&self.settings, nats, system, reported),
            )
            .await
            .unwrap_or_else(|_| SlotCheck {
                unknown: Some(format!("no answer within {SLOT_CHECK_TIMEOUT:?}")),
                ..SlotCheck::default()
            })
        })
    }

    fn session_ended(&mut self, walsender_pid: i32, confirmed: Lsn) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let settings = &self.settings;
            let leave = async {
                let pg = catalog::connect(settings, "stop mark")
                    .await
                    .map_err(|e| e.to_string())?;
                slot_mark::leave(settings, &pg, walsender_pid, confirmed)
                    .await
                    .map_err(|e| crate::source::query_error_text(&e))
            };
            match tokio::time::timeout(MARK_TIMEOUT, leave).await {
                Ok(Ok(made)) => tracing::debug!(made, "stop mark"),
                Ok(Err(error)) => {
                    tracing::debug!(%error, "no stop mark left: a client consuming the slot before the next session would go unnoticed")
                }
                Err(_) => tracing::debug!("no stop mark left: no answer in time"),
            }
        })
    }

    fn partitions(&mut self) -> BoxFuture<'_, Result<Vec<u32>, SessionEnd>> {
        Box::pin(async move {
            let settings = &self.settings;
            let trouble = |what: String| {
                from_source(SourceError::Io {
                    target: settings.conn.to_string(),
                    error: std::io::Error::other(format!(
                        "reading the outbox table's partitions: {what}"
                    )),
                })
            };
            let lookup = async {
                let client = catalog::connect(settings, "partitions")
                    .await
                    .map_err(from_source)?;
                catalog::partitions(&client, &settings.config().outbox.table)
                    .await
                    .map_err(|e| trouble(e.to_string()))
            };
            tokio::time::timeout(PARTITION_LOOKUP_TIMEOUT, lookup)
                .await
                .unwrap_or_else(|_| {
                    Err(trouble(format!(
                        "no answer within {PARTITION_LOOKUP_TIMEOUT:?}"
                    )))
                })
        })
    }
}

/// How long the check at a session's start may take (connect, the slot, the stream's tail, the
/// mark's look, which its own statement timeout bounds) before the session goes on without it.
const SLOT_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(45);
/// How long leaving the stop mark may take at a session's end.
const MARK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The production [`Connector::slot_check`]: the slot's position on a control connection, then the
/// stop mark judged against the stream's tail ([`slot_mark::at_start`], the mark read through
/// [`PgMarks`] on the same connection).
async fn check_slot(
    settings: &Settings,
    nats: Option<async_nats::Client>,
    system: &SystemInfo,
    reported: Option<&Consumed>,
) -> SlotCheck {
    let mut out = SlotCheck::default();
    let slot = &settings.config().postgres.slot;
    let pg = match catalog::connect(settings, "slot check").await {
        Ok(c) => c,
        Err(e) => {
            out.unknown = Some(format!("no control connection: {e}"));
            return out;
        }
    };
    match catalog::slot(&pg, slot).await {
        Ok(row) => {
            out.confirmed = row
                .and_then(|r| r.confirmed_flush_lsn)
                .and_then(|t| t.parse().ok());
        }
        Err(e) => {
            out.unknown = Some(format!("the slot cannot be read: {e}"));
            return out;
        }
    }
    let (Some(slot_at), Some(nats)) = (out.confirmed, nats) else {
        return out;
    };
    let nats = NatsPort::from(nats);
    let marks = &mut PgMarks::new(settings, &pg);
    slot_mark::at_start(settings, system, &nats, slot_at, marks, reported).await
}

/// How long the partition lookup may take (connect and query) before the session restarts.
const PARTITION_LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// START_REPLICATION failed. SQLSTATE 55000 (object_not_in_prerequisite_state) covers an invalidated
/// slot and other prerequisites (e.g. `wal_level`); the slot's own row tells them apart, whatever
/// language the server's messages are in. What each means is [`policy::start_refused`]'s.
async fn classify_start_error(settings: &Settings, e: SourceError) -> SessionEnd {
    let slot = &settings.config().postgres.slot;
    let mut invalidated = None;
    if e.sqlstate() == Some("55000") {
        invalidated = match catalog::connect(settings, "check").await {
            Ok(c) => catalog::slot(&c, slot)
                .await
                .ok()
                .flatten()
                .and_then(|s| s.invalidated())
                .map(|reason| crate::setup::lost_slot_message(settings, &reason)),
            Err(_) => None,
        };
    }
    policy::start_refused(slot, e, invalidated)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn system(timeline: u32, history: &str, xlogpos: u64) -> SystemInfo {
        SystemInfo {
            system_id: "7311234567890123456".into(),
            timeline,
            xlogpos: Lsn(xlogpos),
            dbname: Some("app".into()),
            history: if timeline > 1 {
                TimelineHistory::parse(timeline, history).unwrap()
            } else {
                TimelineHistory::root(1)
            },
        }
    }

    fn left_at(confirmed: u64, timeline: u32) -> Start {
        Start {
            confirmed: Lsn(confirmed),
            history: Some(History {
                system_id: "7311234567890123456".into(),
                timeline,
                slot: "outbox_relay".into(),
            }),
        }
    }

    #[test]
    fn a_promotion_past_what_was_confirmed_is_not_a_move() {
        let promoted = system(2, "1\t0/3000\tno recovery target specified\n", 0x5000);
        assert!(!left_at(0x2000, 1).moved(&promoted));
        assert!(
            !left_at(0x3000, 1).moved(&promoted),
            "confirmed up to the switch point"
        );
        // Twice promoted while this relay was away.
        let twice = system(3, "1\t0/3000\tr\n2\t0/4000\tr\n", 0x5000);
        assert!(!left_at(0x3800, 2).moved(&twice));
        assert!(!left_at(0x2000, 1).moved(&twice));
        // Nothing remembered, or the same timeline further on: not moved either.
        assert!(!Start::default().moved(&promoted));
        assert!(!left_at(0x4000, 2).moved(&promoted));
    }

    #[test]
    fn a_new_timeline_that_lost_what_was_confirmed_is_a_move() {
        // The old timeline ended before what this relay confirmed on it (a recovery to a point in
        // time before it, or a standby that was behind).
        let recovered = system(2, "1\t0/3000\tbefore 2026-12-03 10:00:00+00\n", 0x9000);
        assert!(left_at(0x3008, 1).moved(&recovered));
        // A sibling timeline: 3 branched off 1, this relay was on 2.
        let sibling = system(3, "1\t0/3000\tr\n", 0x9000);
        assert!(left_at(0x2000, 2).moved(&sibling));
        // A history that could not be read: a changed timeline is all there is to go by.
        let unread = SystemInfo {
            history: TimelineHistory::root(2),
            ..recovered.clone()
        };
        assert!(left_at(0x2000, 1).moved(&unread));
        // Another system, or a WAL that ends before what was confirmed.
        let other = SystemInfo {
            system_id: "7311234567890123457".into(),
            ..recovered.clone()
        };
        assert!(left_at(0x2000, 1).moved(&other));
        assert!(left_at(0x9008, 2).moved(&recovered));
    }
}
