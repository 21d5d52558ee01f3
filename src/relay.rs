//! Wiring: setup, then sessions of source → pgoutput → outbox → route → sink → progress, restarted
//! from the last confirmed LSN after any transient failure, until shutdown.
//!
//! A session is crash-only: on any uncertainty (ack timeout, NATS trouble, a dropped Postgres
//! connection) it is dropped whole and a new one starts from the confirmed LSN, after a capped,
//! jittered backoff. JetStream drops the events it already stored (`Nats-Msg-Id`), so the restart
//! costs duplicates on the wire, never in the stream. Definite errors (bad settings, a slot that was
//! invalidated, a frame that cannot be decoded) end `run` with the message; nothing past them is
//! confirmed.
//!
//! Shutdown: stop reading, wait (bounded by the ack timeout) for the acks in flight, confirm, send the
//! final status update, end the replication connection cleanly.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use crate::Lsn;
use crate::config::Config;
use crate::fence;
use crate::message;
use crate::metrics::Metrics;
use crate::outbox::{OutboxStage, Step};
use crate::pgoutput::Decoder;
use crate::progress::Progress;
use crate::route::SubjectTemplate;
use crate::setup::{self, SetupError};
use crate::sink::{Outcome, Sink, SinkConfig};
use crate::source::{
    PgOutputOptions, ReplConnection, ReplicationEvent, ReplicationStream, SourceError, StreamConfig,
};

/// Why `run` ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("{0}")]
    Definite(String),
}

/// How a session ended.
enum SessionEnd {
    /// Shutdown requested and done.
    Shutdown,
    /// Transient trouble: restart from the confirmed LSN.
    Retry { cause: &'static str, error: String },
    /// Stop the relay.
    Fatal(String),
}

/// Runs the relay until `shutdown` resolves (then exits cleanly) or a definite error.
pub async fn run(
    config: Config,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RelayError> {
    // The listener first: probes should answer while setup waits for the servers.
    let _http = match config.http.listen.as_str() {
        "" => None,
        listen => {
            let listener = crate::http::bind(listen)
                .await
                .map_err(RelayError::Definite)?;
            Some(AbortOnDrop(tokio::spawn(crate::http::serve(
                listener,
                Arc::clone(&metrics),
            ))))
        }
    };
    let report = setup::setup(&config).await?;
    for line in &report.lines {
        info!(target: "outbox_relay::setup", "{line}");
    }
    for w in &report.warnings {
        warn!("{w}");
    }
    let nats = setup::connect_nats(&config).await?;
    let _slot_sampler = AbortOnDrop(tokio::spawn(sample_slot(
        config.clone(),
        Arc::clone(&metrics),
    )));
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    let mut relay = Relay {
        config: Arc::new(config),
        metrics,
        nats: Some(nats),
        failures: 0,
        last_cause: None,
        known_duplicates: fence::KnownDuplicates::default(),
        // Start where the slot is; the server would use max(this, confirmed_flush) anyway, but the
        // tracker and the logs should know the real position.
        confirmed: report.slot_confirmed.unwrap_or(Lsn::ZERO),
        stop: stop_rx,
    };
    let main = relay.main_loop();
    tokio::pin!(main);
    tokio::select! {
        r = &mut main => r,
        _ = &mut shutdown => {
            info!("shutdown requested: finishing in-flight publishes");
            let _ = stop_tx.send(true);
            main.await
        }
    }
}

struct Relay {
    config: Arc<Config>,
    metrics: Arc<Metrics>,
    /// The NATS client; replaced after a NATS failure (see `session`).
    nats: Option<async_nats::Client>,
    /// Failed sessions in a row (drives the backoff); 0 once acks flow.
    failures: u32,
    /// The cause of the last failure, so each change of state is logged once, not every retry.
    last_cause: Option<&'static str>,
    /// Events JetStream acknowledged as duplicates of other events (fenced streams only).
    known_duplicates: fence::KnownDuplicates,
    /// The last LSN confirmed to the slot by this process; sessions restart here.
    confirmed: Lsn,
    stop: watch::Receiver<bool>,
}

impl Relay {
    async fn main_loop(&mut self) -> Result<(), RelayError> {
        loop {
            let end = self.session().await;
            Metrics::set(&self.metrics.streaming, 0);
            match end {
                SessionEnd::Shutdown => {
                    info!(confirmed = %self.confirmed, "stopped");
                    return Ok(());
                }
                SessionEnd::Fatal(msg) => {
                    error!(error = %msg, "stopping");
                    return Err(RelayError::Definite(msg));
                }
                SessionEnd::Retry { cause, error } => {
                    if cause == "nats" {
                        self.nats = None;
                    }
                    Metrics::set(&self.metrics.standby, u64::from(cause == "slot active"));
                    Metrics::inc(&self.metrics.reconnects);
                    Metrics::inc(if cause == "nats" {
                        &self.metrics.reconnects_nats
                    } else {
                        &self.metrics.reconnects_postgres
                    });
                    // One line per change of state, not per retry.
                    if self.last_cause != Some(cause) {
                        if cause == "slot active" {
                            info!(%error, "standby: another relay holds the slot; waiting to take over");
                        } else {
                            warn!(cause, %error, confirmed = %self.confirmed, "pipeline stopped; retrying from the confirmed position");
                        }
                        self.last_cause = Some(cause);
                    } else {
                        debug!(cause, %error, "retry failed");
                    }
                    self.failures = self.failures.saturating_add(1);
                    // A standby waiting for the slot retries at a steady pace, so it takes over
                    // within seconds of the active relay's end, however long it has waited.
                    let delay = if cause == "slot active" {
                        backoff(3)
                    } else {
                        backoff(self.failures)
                    };
                    let mut stop = self.stop.clone();
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = async { stop.wait_for(|s| *s).await.is_ok() } => return Ok(()),
                    }
                }
            }
        }
    }

    /// One replication session. The failure count is reset once events flow again.
    async fn session(&mut self) -> SessionEnd {
        let config = Arc::clone(&self.config);
        // NATS first: while it is down there is no point in holding the slot.
        // A NATS client whose session failed is dropped, not reused: messages still buffered in it
        // would be sent after its reconnect, after the point where the new session republishes
        // from, which could store events out of commit order.
        let nats = match &self.nats {
            Some(c) => c.clone(),
            None => match setup::connect_nats(&config).await {
                Ok(c) => {
                    self.nats = Some(c.clone());
                    c
                }
                Err(e) => {
                    return SessionEnd::Retry {
                        cause: "nats",
                        error: e.to_string(),
                    };
                }
            },
        };
        let _nats_watch = AbortOnDrop(tokio::spawn(watch_nats(
            nats.clone(),
            Arc::clone(&self.metrics),
        )));
        let info = config.conn_info();
        let app = format!(
            "outbox-relay/{}/{}",
            config.postgres.slot,
            std::process::id()
        );
        let conn = match ReplConnection::connect(&info, &app).await {
            Ok(c) => c,
            Err(e) => return source_end(e, "postgres"),
        };
        let version = conn.server_version_num();
        let mut options = PgOutputOptions::new([config.postgres.publication.clone()]);
        // Proto v1 is enough: no streaming of in-progress transactions (DESIGN.md §3), and v1 keeps
        // the decoding identical on every supported server.
        options.proto_version = Some(1);
        let stream_config = StreamConfig {
            status_interval: Duration::from_millis(config.postgres.status_interval_ms),
            channel_capacity: 1024,
            ..StreamConfig::default()
        };
        let mut stream = match conn
            .start_replication(
                &config.postgres.slot,
                self.confirmed,
                &options,
                stream_config,
            )
            .await
        {
            Ok(s) => s,
            Err((e, conn)) => {
                if let Some(c) = conn {
                    c.close().await;
                }
                // 55000 is also used for other prerequisites (e.g. wal_level); only an invalidated
                // slot says it can no longer get changes.
                if e.sqlstate() == Some("55000")
                    && (e.to_string().contains("can no longer get changes")
                        || e.to_string().contains("invalidated"))
                {
                    return SessionEnd::Fatal(format!(
                        "{e}; {}",
                        setup::lost_slot_message(&config.postgres.slot)
                    ));
                }
                return source_end(e, "postgres");
            }
        };
        Metrics::set(&self.metrics.standby, 0);
        match self.last_cause {
            None => {
                info!(slot = %config.postgres.slot, start = %self.confirmed, server_version = version, "streaming")
            }
            // Postgres trouble (or waiting as a standby) ends here; NATS trouble ends at the next ack.
            Some("postgres") | Some("slot active") => {
                info!(slot = %config.postgres.slot, start = %self.confirmed, "recovered: streaming again");
                self.failures = 0;
                self.last_cause = None;
            }
            Some(_) => {
                debug!(slot = %config.postgres.slot, start = %self.confirmed, "streaming (retry)")
            }
        }

        let template = match SubjectTemplate::parse(&config.nats.subject) {
            Ok(t) => t,
            Err(e) => return SessionEnd::Fatal(e.to_string()),
        };
        let (mut sink, mut acks) = Sink::new(
            nats,
            SinkConfig {
                max_in_flight: config.nats.max_in_flight,
                ack_timeout: Duration::from_millis(config.nats.ack_timeout_ms),
                dead_letter_subject: config.nats.dead_letter_subject.clone(),
                stop_on_invalid: config.outbox.on_invalid == crate::config::OnInvalid::Stop,
            },
        );
        // Fencing (see `fence`): start right behind the stream's tail, skip what is stored already.
        let mut replay = None;
        if config.nats.fence {
            match fence::read_tail(sink.jetstream(), &config.nats.stream).await {
                Ok(tail) => {
                    debug!(last_sequence = tail.last_sequence, last = ?tail.last, "stream tail");
                    sink.fence_from(tail.last_sequence);
                    replay = Some(fence::Replay::new(&tail));
                }
                Err(e) => {
                    return SessionEnd::Retry {
                        cause: "nats",
                        error: e,
                    };
                }
            }
        }
        let mut decoder = Decoder::new();
        let mut stage = OutboxStage::new(&config.outbox);
        let mut progress = Progress::new(self.confirmed);
        let mut stop = self.stop.clone();
        let mut streaming_reported = false;

        let end = loop {
            tokio::select! {
                biased;
                _ = async { stop.wait_for(|s| *s).await.is_ok() } => break SessionEnd::Shutdown,
                ack = acks.recv() => {
                    let Some(ack) = ack else { break SessionEnd::Retry { cause: "nats", error: "ack task ended".into() } };
                    let ack = match ack {
                        Ok(a) => a,
                        Err(e) if !e.is_transient() => break SessionEnd::Fatal(e.to_string()),
                        Err(e) => break SessionEnd::Retry { cause: "nats", error: e.to_string() },
                    };
                    if let Err(e) = progress.ack(ack.seq) {
                        break SessionEnd::Fatal(e.to_string());
                    }
                    self.count(&ack.outcome, &ack.id);
                    if config.nats.fence
                        && ack.outcome == (Outcome::Stored { duplicate: true })
                        && !self.known_duplicates.contains(ack.commit_lsn, &ack.id)
                    {
                        // An id stored before by another event: it took no sequence, so the fence
                        // breaks behind it. Skip it on the replay instead of publishing it again.
                        warn!(id = %ack.id, lsn = %ack.commit_lsn, "event id already used by an earlier event: JetStream dropped it as a duplicate");
                        self.known_duplicates.remember(ack.commit_lsn, ack.id.clone());
                    }
                    if ack.commit_ts != 0 {
                        let micros = pg_now_micros() - ack.commit_ts;
                        self.metrics
                            .commit_to_ack
                            .observe(Duration::from_micros(micros.max(0) as u64));
                    }
                    if self.failures > 0 {
                        info!(confirmed = %self.confirmed, "recovered: JetStream acknowledges again");
                        self.failures = 0;
                    }
                    self.last_cause = None;
                    self.metrics.acked_now();
                    self.confirm(&stream, &progress);
                }
                ev = stream.recv() => {
                    let ev = match ev {
                        None => break SessionEnd::Retry { cause: "postgres", error: "replication stream ended".into() },
                        Some(Err(e)) => break source_end(e, "postgres"),
                        Some(Ok(ev)) => ev,
                    };
                    if !streaming_reported {
                        Metrics::set(&self.metrics.streaming, 1);
                        streaming_reported = true;
                    }
                    match ev {
                        ReplicationEvent::Keepalive { wal_end, .. } => {
                            progress.keepalive(wal_end);
                            self.confirm(&stream, &progress);
                        }
                        ReplicationEvent::XLogData { wal_start, data, .. } => {
                            let msg = match decoder.decode(data, wal_start) {
                                Ok(m) => m,
                                Err(e) => break SessionEnd::Fatal(format!(
                                    "cannot decode replication data ({e}); nothing past {} is confirmed",
                                    progress.confirmed()
                                )),
                            };
                            let step = match stage.step(msg) {
                                Ok(s) => s,
                                Err(e) => break SessionEnd::Fatal(format!("replication data at {wal_start}: {e}")),
                            };
                            match step {
                                Step::Begin { .. } => progress.begin(),
                                Step::Commit { end_lsn, .. } => {
                                    progress.commit(end_lsn);
                                    self.confirm(&stream, &progress);
                                }
                                Step::Event(event) => {
                                    let id = message::message_id(&event);
                                    let stored = replay.as_mut().is_some_and(|r| r.already_stored(event.commit_lsn, &id))
                                        || self.known_duplicates.contains(event.commit_lsn, &id);
                                    if stored {
                                        let seq = progress.publish();
                                        if let Err(e) = sink.skip(seq, event).await {
                                            break SessionEnd::Retry { cause: "nats", error: e.to_string() };
                                        }
                                        continue;
                                    }
                                    let out = message::build(&event, &template, &config.nats.dead_letter_subject);
                                    if let Some(reason) = &out.dead_letter {
                                        if config.outbox.on_invalid == crate::config::OnInvalid::Stop {
                                            break SessionEnd::Fatal(format!(
                                                "event {} at {} cannot be published ({reason}); outbox.on_invalid = \"stop\"",
                                                message::message_id(&event), event.commit_lsn
                                            ));
                                        }
                                        warn!(id = %message::message_id(&event), lsn = %event.commit_lsn, %reason, "dead-lettering event");
                                    }
                                    let seq = progress.publish();
                                    Metrics::set(&self.metrics.in_flight, progress.in_flight());
                                    if let Err(e) = sink.publish(seq, event, out).await {
                                        if !e.is_transient() {
                                            break SessionEnd::Fatal(e.to_string());
                                        }
                                        break SessionEnd::Retry { cause: "nats", error: e.to_string() };
                                    }
                                }
                                Step::IgnoredChange(_) => Metrics::inc(&self.metrics.ignored_changes),
                                Step::Nothing => {}
                            }
                        }
                    }
                }
            }
        };

        if matches!(end, SessionEnd::Shutdown) {
            // Wait, bounded, for what is in flight, so the final status update confirms it.
            let deadline = Duration::from_millis(config.nats.ack_timeout_ms);
            let drain = async {
                while progress.in_flight() > 0 {
                    match acks.recv().await {
                        Some(Ok(ack)) => {
                            if progress.ack(ack.seq).is_err() {
                                break;
                            }
                            self.count(&ack.outcome, &ack.id);
                        }
                        _ => break,
                    }
                }
            };
            if tokio::time::timeout(deadline, drain).await.is_err() {
                warn!(
                    in_flight = progress.in_flight(),
                    "shutdown: acks still missing; they will be republished on the next start"
                );
            }
            self.confirm(&stream, &progress);
            let _ = stream.stop(Duration::from_secs(5)).await;
        }
        end
    }

    fn confirm(&mut self, stream: &ReplicationStream, progress: &Progress) {
        let c = progress.confirmed();
        if c > self.confirmed {
            self.confirmed = c;
            stream.confirm(c);
            self.known_duplicates.forget_before(c);
            Metrics::set(&self.metrics.confirmed_lsn, c.0);
        }
        Metrics::set(&self.metrics.received_lsn, stream.received().0);
        Metrics::set(&self.metrics.in_flight, progress.in_flight());
    }

    fn count(&self, outcome: &Outcome, id: &str) {
        match outcome {
            Outcome::Stored { duplicate: false } => Metrics::inc(&self.metrics.published_ok),
            Outcome::Stored { duplicate: true } => {
                debug!(%id, "duplicate dropped by JetStream");
                Metrics::inc(&self.metrics.published_duplicate)
            }
            // Counted with the duplicates: a republish that never had to leave the relay.
            Outcome::AlreadyStored => Metrics::inc(&self.metrics.published_duplicate),
            Outcome::DeadLetter { .. } => Metrics::inc(&self.metrics.dead_letters),
        }
    }
}

/// Aborts a background task when the relay ends.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Keeps the `nats_connected` gauge current (async-nats reconnects on its own).
async fn watch_nats(client: async_nats::Client, metrics: Arc<Metrics>) {
    loop {
        let up = client.connection_state() == async_nats::connection::State::Connected;
        Metrics::set(&metrics.nats_connected, u64::from(up));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Samples the slot's lag, retained WAL and `wal_status` every few seconds on a control connection
/// of its own, so an operator sees a stalled or endangered slot from the metrics.
async fn sample_slot(config: Config, metrics: Arc<Metrics>) {
    let info = config.conn_info();
    let mut client = None;
    loop {
        if client.is_none() {
            client = crate::source::connect_control(&info, "outbox-relay metrics")
                .await
                .ok();
        }
        if let Some(c) = &client {
            let row = c
                .query_opt(
                    "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::int8, \
                     (pg_current_wal_lsn() - restart_lsn)::int8, coalesce(wal_status, '') \
                     FROM pg_replication_slots WHERE slot_name = $1",
                    &[&config.postgres.slot],
                )
                .await;
            match row {
                Ok(Some(r)) => {
                    let lag: Option<i64> = r.get(0);
                    let retained: Option<i64> = r.get(1);
                    Metrics::set(&metrics.slot_lag_bytes, lag.unwrap_or(0).max(0) as u64);
                    Metrics::set(
                        &metrics.retained_wal_bytes,
                        retained.unwrap_or(0).max(0) as u64,
                    );
                    metrics.set_wal_status(r.get::<_, String>(2).as_str());
                }
                Ok(None) => {
                    // The slot is gone: no lag to report, and no WAL kept for it.
                    metrics.set_wal_status("");
                    Metrics::set(&metrics.slot_lag_bytes, 0);
                    Metrics::set(&metrics.retained_wal_bytes, 0);
                }
                Err(_) => client = None,
            }
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// Now as microseconds since 2000-01-01 UTC (Postgres timestamps).
fn pg_now_micros() -> i64 {
    let unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0);
    unix - 946_684_800_000_000
}

fn source_end(e: SourceError, cause: &'static str) -> SessionEnd {
    if e.sqlstate() == Some("55006") {
        // "replication slot … is active for PID …": another relay streams; wait as a standby.
        SessionEnd::Retry {
            cause: "slot active",
            error: e.to_string(),
        }
    } else if e.is_transient() {
        SessionEnd::Retry {
            cause,
            error: e.to_string(),
        }
    } else {
        SessionEnd::Fatal(e.to_string())
    }
}

/// Capped exponential backoff with jitter: 100 ms, 200 ms, … up to 30 s, each ±25 %.
fn backoff(failures: u32) -> Duration {
    let base = 100u64.saturating_mul(1u64 << failures.min(12).saturating_sub(1));
    let capped = base.min(30_000);
    // Jitter from the clock's nanoseconds: enough to spread restarts of relays that failed together.
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0) as u64;
    let jitter = capped / 4;
    let offset = if jitter == 0 { 0 } else { nanos % (2 * jitter) };
    Duration::from_millis(capped - jitter + offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_future_is_send() {
        // The relay runs on a multi-threaded runtime (tokio::spawn): its future must be Send.
        fn assert_send<T: Send>(_: &T) {}
        let f = run(
            Config::default(),
            Arc::new(Metrics::default()),
            std::future::pending::<()>(),
        );
        assert_send(&f);
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        for f in 1..40 {
            let d = backoff(f);
            assert!(d <= Duration::from_millis(30_000 + 7_500), "{f}: {d:?}");
            assert!(d >= Duration::from_millis(75), "{f}: {d:?}");
        }
        assert!(backoff(1) < Duration::from_millis(200));
        assert!(backoff(20) >= Duration::from_millis(22_500));
    }
}
