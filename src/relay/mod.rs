//! `outbox-relay run`: setup, then sessions of source → pgoutput → outbox → route → sink → progress
//! (`session.rs`), restarted from the last confirmed LSN after any transient failure, until shutdown.
//!
//! The restart loop lives here: a capped, jittered backoff; a standby's steady pace while another
//! relay holds the slot; one log line per change of state, not per retry. JetStream drops the events
//! it already stored (`Nats-Msg-Id`, and the sink's fence skips them), so a restart costs duplicates
//! on the wire, never in the stream. Definite errors ([`RelayError`]) end `run` with the message;
//! nothing past them is confirmed.
//!
//! Shutdown: stop reading, wait (bounded by the ack timeout) for the acks in flight, confirm, send the
//! final status update, end the replication connection cleanly.

mod backoff;
mod connector;
mod error;
mod monitor;
mod parking;
mod policy;
mod session;
mod shutdown;
mod startup;
mod state;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::{debug, error, info, warn};

use crate::Lsn;
use crate::config::Settings;
use crate::error_chain::error_chain;
use crate::metrics::Metrics;
pub use crate::slot_mark::{Consumed, SlotCheck};
use crate::stored::Positions;
pub use crate::stored::probe::{PositionProbe, Served, Waited};
use backoff::{backoff, xorshift};
use connector::Servers;
pub use connector::{Connector, Start, refuse_under_backfill};
use error::CauseKind;
pub use error::{NatsTrouble, RelayError, Restart, SessionEnd};
use monitor::{Background, sample_slot};
pub use policy::from_source;
use session::{Session, Shared};
use shutdown::Shutdown;
use state::State;

/// A session that streamed this long before failing counts as recovered from earlier trouble: the
/// next failure is logged again and backs off from the start.
const HEALTHY_SESSION: Duration = Duration::from_secs(30);

/// Runs the relay until `shutdown` resolves (then exits cleanly) or a definite error. Its
/// background tasks are stopped and awaited (bounded) before it returns, either way.
pub async fn run(
    settings: Settings,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RelayError> {
    let mut background = Background::default();
    let result = run_beside(settings, metrics, shutdown, &mut background).await;
    background.stop().await;
    result
}

/// [`run`], with its background tasks (the position service's waits, the HTTP listener, the slot
/// sampler) in `background`.
async fn run_beside(
    settings: Settings,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send,
    background: &mut Background,
) -> Result<(), RelayError> {
    let acknowledged = &settings.config().warnings.acknowledged;
    for w in crate::warning::split_acknowledged(settings.warnings.clone(), acknowledged).0 {
        warn!(warning = w.name, "{}", w.text);
    }
    // Events must never go out unchecked because the contracts did not load (P8).
    settings.schemas_loaded()?;
    let schemas = settings.schemas.current();
    if schemas.active() {
        metrics.schemas.loaded.set(schemas.len() as u64);
        info!(dir = schemas.dir(), "{} JSON Schemas loaded", schemas.len());
    }
    // Read-your-writes: one task answers every wait; sessions publish the stored position.
    let (positions, waits) = Positions::new(
        &settings.config().postgres.slot,
        &settings.config().nats.stream,
    );
    background.spawn("position waits", waits.run());
    // The listener first: probes should answer while setup waits for the servers.
    let listen = settings.config().http.listen.as_str();
    if !listen.is_empty() {
        let listener = crate::http::bind(listen).await?;
        let serve = crate::http::serve(listener, Arc::clone(&metrics), Arc::clone(&positions));
        background.spawn("HTTP listener", serve);
    }
    // The slot sampler first too: its connection tells `status` a relay runs while it waits.
    background.spawn(
        "slot sampler",
        sample_slot(
            settings.clone(),
            Arc::clone(&metrics),
            Arc::clone(&positions),
        ),
    );
    // Jitter from the clock's nanoseconds: enough to spread restarts of relays that failed together.
    let mut jitter = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        | 1;
    tokio::pin!(shutdown);
    let Some((report, nats)) =
        startup::wait_for_servers(&settings, &mut jitter, shutdown.as_mut()).await?
    else {
        info!("stopped before streaming");
        return Ok(());
    };
    for line in &report.lines {
        info!(target: "outbox_relay::setup", "{line}");
    }
    for w in crate::warning::split_acknowledged(report.warnings.clone(), acknowledged).0 {
        warn!(warning = w.name, "{}", w.text);
    }
    let settings = Arc::new(settings);
    let connector = Servers::new(Arc::clone(&settings), Arc::clone(&metrics), nats);
    // Start where the slot is; the server would use max(this, confirmed_flush) anyway, but the
    // tracker and the logs should know the real position.
    let start = report.slot_confirmed.unwrap_or(Lsn::ZERO);
    sessions(
        settings,
        metrics,
        positions,
        Box::new(connector),
        start,
        jitter,
        shutdown,
    )
    .await
}

/// The restart loop and its sessions, reaching the servers through `connector`, from `start`: what
/// [`run`] does after setup. `jitter_seed` seeds the backoff's jitter. The sessions serve their
/// stored position through `positions` (made by the caller, who reads it). The deterministic
/// simulation runs this against simulated servers.
pub async fn run_with(
    settings: Settings,
    metrics: Arc<Metrics>,
    connector: Box<dyn Connector>,
    start: Lsn,
    jitter_seed: u64,
    positions: PositionProbe,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RelayError> {
    // No wait task: the caller reads the position itself, nothing waits on it.
    sessions(
        Arc::new(settings),
        metrics,
        positions.0,
        connector,
        start,
        jitter_seed,
        shutdown,
    )
    .await
}

async fn sessions(
    settings: Arc<Settings>,
    metrics: Arc<Metrics>,
    positions: Arc<Positions>,
    connector: Box<dyn Connector>,
    start: Lsn,
    jitter_seed: u64,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RelayError> {
    let (stop_tx, stop) = Shutdown::new();
    tokio::pin!(shutdown);
    let telemetry = telemetry(&settings, &metrics);
    let mut relay = Relay {
        shared: Shared {
            settings,
            metrics,
            positions,
            telemetry,
        },
        connector,
        state: State::new(start),
        jitter: jitter_seed | 1,
        stop,
    };
    let ended = {
        let main = relay.main_loop();
        tokio::pin!(main);
        // Biased (no draw from tokio's per-runtime generator, so a simulated seed replays): a main
        // loop that ended says why, even when a shutdown came at the same instant.
        tokio::select! {
            biased;
            r = &mut main => r,
            _ = &mut shutdown => {
                info!("shutdown requested: finishing in-flight publishes");
                let _ = stop_tx.send(true);
                main.await
            }
        }
    };
    relay.connector.close().await;
    ended
}

/// The restart loop: what it hands each session, and its own backoff.
pub(crate) struct Relay {
    /// What every session reads and never changes.
    shared: Shared,
    /// How sessions reach Postgres and NATS.
    connector: Box<dyn Connector>,
    /// What outlives a session, which each session borrows.
    state: State,
    /// The backoff jitter's xorshift state.
    jitter: u64,
    stop: Shutdown,
}

/// The span exporter when `telemetry.otlp_endpoint` is set. One that cannot start (no thread) is
/// logged and left out: tracing must never stop the relay.
fn telemetry(settings: &Settings, metrics: &Arc<Metrics>) -> Option<crate::telemetry::Telemetry> {
    let t = &settings.config().telemetry;
    if t.otlp_endpoint.is_empty() {
        return None;
    }
    match crate::telemetry::Telemetry::start(
        &t.otlp_endpoint,
        &t.service_name,
        &settings.config().nats.dead_letter_subject,
        Arc::clone(metrics),
    ) {
        Ok(t) => Some(t),
        Err(e) => {
            error!(error = %e, "no trace spans will be exported");
            None
        }
    }
}

impl Relay {
    async fn main_loop(&mut self) -> Result<(), RelayError> {
        loop {
            // Connecting can wait (a server that accepts and does not answer): stop goes first.
            let start = tokio::select! {
                biased;
                _ = self.stop.requested() => {
                    info!(confirmed = %self.state.confirmed, "stopped");
                    return Ok(());
                }
                s = Session::start(&self.shared, &mut self.state, self.connector.as_mut()) => s,
            };
            let (end, ran_for) = match start {
                Ok(session) => {
                    let started = session.started;
                    let end = session
                        .run(&mut self.state, self.connector.as_mut(), &mut self.stop)
                        .await;
                    (end, Some(started.elapsed()))
                }
                Err(end) => (end, None),
            };
            self.shared.metrics.streaming.set(0);
            match end {
                SessionEnd::Shutdown => {
                    info!(confirmed = %self.state.confirmed, "stopped");
                    return Ok(());
                }
                SessionEnd::Fatal(e) => {
                    error!(error = %error_chain(&e), "stopping");
                    return Err(e);
                }
                SessionEnd::Restart(restart) => {
                    if let Some(distrust) = restart.distrust() {
                        self.state.distrust = Some(distrust);
                    }
                    if ran_for.is_some_and(|d| d >= HEALTHY_SESSION) {
                        self.state.failures = 0;
                        self.state.last_cause = None;
                    }
                    let delay = self.restarting(&restart);
                    tokio::select! {
                        biased;
                        _ = self.stop.requested() => return Ok(()),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// Records a restart (metrics, one log line per change of state) and returns the delay before
    /// the next session.
    fn restarting(&mut self, restart: &Restart) -> Duration {
        let kind = restart.kind();
        if kind == CauseKind::Nats {
            self.connector.nats_failed();
        }
        let metrics = &self.shared.metrics;
        metrics.standby.set(u64::from(kind == CauseKind::SlotHeld));
        metrics.restarted(kind);
        let error = error_chain(restart);
        let state = &mut self.state;
        if state.last_cause != Some(kind) {
            if kind == CauseKind::SlotHeld {
                info!(%error, "standby: another relay holds the slot; waiting to take over");
            } else {
                warn!(cause = %kind, %error, confirmed = %state.confirmed, "pipeline stopped; retrying from the confirmed position");
            }
            state.last_cause = Some(kind);
        } else {
            debug!(cause = %kind, %error, "retry failed");
        }
        state.failures = state.failures.saturating_add(1);
        let failures = state.failures;
        // A standby waiting for the slot retries at a steady pace, so it takes over within seconds
        // of the active relay's end, however long it has waited.
        let random = self.next_random();
        if kind == CauseKind::SlotHeld {
            backoff(3, random)
        } else {
            backoff(failures, random)
        }
    }

    /// The next number of the jitter's xorshift64.
    fn next_random(&mut self) -> u64 {
        xorshift(&mut self.jitter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn run_future_is_send() {
        // The binary runs it on a current-thread runtime, but the tests, benches and simulation
        // spawn it (tokio::spawn, some on multi-threaded runtimes): its future must be Send.
        fn assert_send<T: Send>(_: &T) {}
        let f = run(
            Config::default().validate().unwrap(),
            Arc::new(Metrics::default()),
            std::future::pending::<()>(),
        );
        assert_send(&f);
    }
}
