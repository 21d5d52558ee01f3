//! The `outbox-relay` binary: parses the command line, loads the configuration, sets up logging, and
//! runs one command. Thin on purpose: everything it calls lives in the library.
//!
//! Exit codes: 0 success (for `status`: healthy), 1 failure or unhealthy, 2 bad command line. For
//! `verify`: 0 every event arrived, 1 differences, 2 it could not check (also a bad configuration).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use outbox_relay::config::{Config, LogFormat, Settings};
use outbox_relay::error_chain::{error_chain, error_line};
use outbox_relay::metrics::Metrics;
use outbox_relay::parking_ops::{self, Key, KeyError, Request};
use outbox_relay::reload::{Hook, HookError, Reloader};
use tracing_subscriber::prelude::*;
use tracing_subscriber::{EnvFilter, Registry, fmt, reload};

/// mimalloc instead of glibc's malloc: per event the relay allocates and frees a few dozen small
/// objects (decoded columns, header values, the header map, acks), and glibc's bookkeeping for
/// them (its fastbins, and consolidating them whenever a larger buffer is allocated) cost about a
/// quarter of the relay's CPU in a drain. Measured in docs/performance.md ("Round 3").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Transactional outbox relay: Postgres logical replication to NATS JetStream.
#[derive(Parser, Debug)]
#[command(
    name = "outbox-relay",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("OUTBOX_RELAY_COMMIT"), ")"),
    about
)]
struct Cli {
    /// TOML configuration file. Every key can also be set by OUTBOX_RELAY_<SECTION>_<KEY>.
    #[arg(long, short, global = true, value_name = "FILE")]
    config: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check and create what is missing as setup does, then publish each outbox event the slot
    /// delivers to JetStream until SIGINT or SIGTERM (SIGHUP reads the configuration again).
    Run,
    /// Check the servers and create what is missing: publication, slot, stream.
    Setup {
        /// Make every check and say what would be created or changed, changing nothing: exit 0
        /// when setup would go ahead (or has nothing to do), 1 with its refusal.
        #[arg(long)]
        check: bool,
    },
    /// Publish the outbox rows that exist now (matching --where) like live events, and create the
    /// slot at the snapshot they were read in, so that `run` continues with no gap and no overlap.
    Backfill {
        /// SQL predicate selecting the rows, e.g. "published_at IS NULL" (default: every row).
        #[arg(long = "where", value_name = "SQL")]
        where_sql: Option<String>,
        /// SQL sort keys, e.g. "created_at, event_id" (default: the id column).
        #[arg(long, value_name = "COLUMNS")]
        order_by: Option<String>,
        /// Drop an existing slot that no relay streams and create the new one in its place.
        #[arg(long)]
        replace_slot: bool,
    },
    /// Check the payloads of the rows in the outbox table against outbox.schemas, publishing
    /// nothing: counts per event type and the first failures; exit 0 when every row passes.
    CheckSchemas {
        /// SQL predicate selecting the rows, e.g. "created_at > now() - interval '1 day'".
        #[arg(long = "where", value_name = "SQL")]
        where_sql: Option<String>,
    },
    /// Report what Postgres, NATS and the running relay say about the slot, the publication and the
    /// stream, changing nothing, with a verdict: exit 0 when healthy, 1 when not.
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// A slot further behind the WAL than this many bytes counts as unhealthy.
        #[arg(long, default_value_t = 1 << 30, value_name = "BYTES")]
        max_lag_bytes: i64,
    },
    /// Prove delivery from the outbox table, the slot and the stream, telling waiting events from
    /// missing ones: exit 0 when every row's event is stored once, in commit order, as the template
    /// routes it (with --payloads, byte for byte) or still waits in the slot, 1 with differences
    /// (missing, dead-lettered, holes, ...), 2 when it could not check everything; it writes
    /// nothing but with --record
    Verify {
        /// SQL predicate selecting the rows, e.g. "aggregate_type = 'Claim'" (default: every row).
        #[arg(long = "where", value_name = "SQL")]
        where_sql: Option<String>,
        /// Only rows whose created_at is at or after this time, e.g. "2026-12-01 00:00+00".
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
        /// Read the stream from this sequence (default: its first).
        #[arg(long, value_name = "N")]
        from_sequence: Option<u64>,
        /// Compare each message's payload with its row's, byte for byte.
        #[arg(long)]
        payloads: bool,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Store proven_up_to in the outbox table's proof table (sql/05_retention.sql), for
        /// outbox_prune(..., proven_only => true): the one write verify makes.
        #[arg(long)]
        record: bool,
        /// Decode at most this many changes of the replication slot to tell waiting rows from
        /// missing ones; rows past it are unknown.
        #[arg(long, value_name = "CHANGES", default_value_t = outbox_relay::verify::DEFAULT_SLOT_LOOK,
              value_parser = clap::value_parser!(u32).range(1..))]
        slot_look: u32,
    },
    /// List the keys the relay holds back (outbox.on_invalid = "park") as the stream shows them:
    /// exit 0 when none is parked, 1 when some are, 2 when it could not check.
    Parked {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Ask the relay, through the WAL, to requeue or discard a parked key or to requeue one dead
    /// letter (sql/09_requeue.sql's functions), then wait until it has carried that out.
    #[command(group(clap::ArgGroup::new("what").required(true).args(["key", "key_null_id", "event"])))]
    Requeue {
        /// The parked key: aggregate type, '/', aggregate id (the first '/' splits: Claim/2026/4711
        /// is type Claim, id 2026/4711).
        #[arg(long, value_name = "TYPE/ID")]
        key: Option<String>,
        /// The parked key of this aggregate type whose aggregate id is NULL.
        #[arg(long, value_name = "TYPE")]
        key_null_id: Option<String>,
        /// The id of a dead-lettered event to publish again.
        #[arg(long, value_name = "ID")]
        event: Option<String>,
        /// Release the key without publishing its parked events.
        #[arg(long, conflicts_with = "event")]
        discard: bool,
        /// Send the request even when the key is not parked (or that cannot be checked).
        #[arg(long)]
        force: bool,
        /// Do not wait for the relay to carry the request out.
        #[arg(long)]
        no_wait: bool,
        /// Connect with this URL instead of postgres.url (a login of the operator role).
        #[arg(long, value_name = "URL")]
        postgres_url: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match load_config(&cli) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let log_filter = init_logging(settings.config());
    let json_logs = settings.config().log.format == LogFormat::Json;
    let runtime = match build_runtime() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("outbox-relay: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(command(cli, settings, log_filter, json_logs))
}

/// Carries out the command line's command (the runtime is up, logging is set up).
async fn command(
    cli: Cli,
    settings: Settings,
    log_filter: FilterHandle,
    json_logs: bool,
) -> ExitCode {
    match cli.command {
        Command::Run => run(cli.config, settings, log_filter, json_logs).await,
        Command::Setup { check: false } => setup(&settings, json_logs).await,
        Command::Setup { check: true } => setup_check(&settings, json_logs).await,
        Command::Backfill {
            where_sql,
            order_by,
            replace_slot,
        } => {
            let opts = outbox_relay::backfill::BackfillOptions {
                where_sql,
                order_by,
                replace_slot,
            };
            backfill(&settings, opts, json_logs).await
        }
        Command::CheckSchemas { where_sql } => {
            check_schemas(&settings, where_sql.as_deref(), json_logs).await
        }
        Command::Status {
            json,
            max_lag_bytes,
        } => status(&settings, json, max_lag_bytes).await,
        Command::Verify {
            where_sql,
            since,
            from_sequence,
            payloads,
            json,
            record,
            slot_look,
        } => {
            let opts = outbox_relay::verify::VerifyOptions {
                where_sql,
                since,
                from_sequence,
                payloads,
                record,
                slot_look,
            };
            verify(&settings, &opts, json, json_logs).await
        }
        Command::Parked { json } => parked(&settings, json, json_logs).await,
        Command::Requeue {
            key,
            key_null_id,
            event,
            discard,
            force,
            no_wait,
            postgres_url,
        } => {
            let request = match requeue_request(key, key_null_id, event, discard) {
                Ok(r) => r,
                Err(e) => return fail(json_logs, &e),
            };
            let opts = RequeueOptions {
                force,
                no_wait,
                postgres_url,
            };
            requeue(&settings, request, &opts, json_logs).await
        }
    }
}

/// The settings, or the exit code after saying why not (before logging is set up, so on stderr).
/// The commands that check events refuse a schema directory that does not load, at once.
fn load_config(cli: &Cli) -> Result<Settings, ExitCode> {
    // verify's and parked's contract: 2 when they could not check, a configuration that does not load included.
    let could_not = if matches!(cli.command, Command::Verify { .. } | Command::Parked { .. }) {
        ExitCode::from(2)
    } else {
        ExitCode::FAILURE
    };
    let config = Config::load(cli.config.as_deref()).map_err(|e| {
        eprintln!("outbox-relay: {}", error_chain(&e));
        could_not
    })?;
    if matches!(
        cli.command,
        Command::Run | Command::Backfill { .. } | Command::CheckSchemas { .. }
    ) && let Err(e) = config.schemas_loaded()
    {
        eprintln!("outbox-relay: {}", error_chain(&e));
        return Err(ExitCode::FAILURE);
    }
    Ok(config)
}

/// One thread: the pipeline is one ordered stream, and on a small machine the relay shares the
/// cores with the walsender and nats-server. Measured with `cargo bench --bench drain` (100k
/// backlog, same run): 10.3–12.2 ms CPU per 1k events against 15.1–16.6 ms on the multi-threaded
/// runtime, at the same throughput (bounded by Postgres' decoding), and a smaller peak RSS.
fn build_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// `run`: streams until a signal, SIGHUP reloading what it can.
async fn run(
    path: Option<PathBuf>,
    config: Settings,
    log_filter: FilterHandle,
    json_logs: bool,
) -> ExitCode {
    // Before anything can wait: SIGHUP's default action would end the process.
    let metrics = Arc::new(Metrics::default());
    #[cfg(unix)]
    reload_on_sighup(path, &config, log_filter, &metrics);
    #[cfg(not(unix))]
    let _ = (path, log_filter);
    match outbox_relay::relay::run(config, metrics, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(json_logs, &e),
    }
}

/// `setup`: what it created or found, then its warnings.
async fn setup(config: &Settings, json_logs: bool) -> ExitCode {
    match outbox_relay::setup::setup(config).await {
        Ok(report) => {
            print_report(config, report);
            ExitCode::SUCCESS
        }
        Err(e) => fail(json_logs, &e),
    }
}

/// What `setup` (or `setup --check`) found and did, a line each, then its warnings.
fn print_report(config: &Settings, report: outbox_relay::setup::SetupReport) {
    for line in &report.lines {
        println!("{line}");
    }
    print_warnings(config, report.warnings);
}

/// `setup --check`: what setup found and would create or change, its warnings, and a last line
/// saying whether it would go ahead; its refusal (exit 1) otherwise. Changes nothing.
async fn setup_check(config: &Settings, json_logs: bool) -> ExitCode {
    match outbox_relay::setup::check(config).await {
        Ok(report) => {
            let would_change = report.would_change;
            print_report(config, report);
            if would_change == 0 {
                println!("setup --check: nothing to create or change");
            } else {
                println!(
                    "setup --check: setup would make the {would_change} change(s) above and refuses nothing; nothing was changed"
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let code = fail(json_logs, &e);
            println!("setup --check: setup would refuse (the line above); nothing was changed");
            code
        }
    }
}

/// Warnings as `warning[NAME]: …` lines, without those `warnings.acknowledged` names (a last line
/// says which were left out).
fn print_warnings(config: &Settings, warnings: Vec<outbox_relay::warning::Warning>) {
    let acknowledged = &config.config().warnings.acknowledged;
    let (shown, left_out) = outbox_relay::warning::split_acknowledged(warnings, acknowledged);
    for w in &shown {
        println!("warning[{}]: {}", w.name, w.text_line());
    }
    if !left_out.is_empty() {
        println!(
            "acknowledged warnings (warnings.acknowledged): {}",
            left_out.join(", ")
        );
    }
}

/// `backfill`: progress on stderr, then setup's lines, the slot and the summary on stdout. SIGINT
/// and SIGTERM stop it: the slot it created is dropped, and the error line says what is left.
async fn backfill(
    config: &Settings,
    opts: outbox_relay::backfill::BackfillOptions,
    json_logs: bool,
) -> ExitCode {
    let progress = |p| eprintln!("{p}");
    match outbox_relay::backfill::backfill_until(config, opts, progress, stop_signal()).await {
        Ok(report) => {
            for line in &report.setup_lines {
                println!("{line}");
            }
            print_warnings(config, report.warnings.clone());
            println!(
                "slot {}: {} (pgoutput, starts at {})",
                report.slot,
                if report.replaced_slot {
                    "replaced"
                } else {
                    "created"
                },
                report.consistent_point
            );
            println!(
                "backfill: {} rows in {:.1} s ({:.0}/s, after {:.1} s of setup and slot creation): {} stored, \
                 {} already in the stream, {} dead letters; Outbox-Commit-Lsn {}; now start {}",
                report.rows,
                report.elapsed.as_secs_f64(),
                report.rate(),
                report.slot_wait.as_secs_f64(),
                report.stored,
                report.duplicates,
                report.dead_letters,
                report.commit_lsn,
                config.command("run")
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(json_logs, &e),
    }
}

/// `check-schemas`: the report; success only when every row passes.
async fn check_schemas(config: &Settings, where_sql: Option<&str>, json_logs: bool) -> ExitCode {
    match outbox_relay::check_schemas::check_schemas(config, where_sql, |p| eprintln!("{p}")).await
    {
        Ok(report) => {
            print!("{report}");
            if report.failed() == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => fail(json_logs, &e),
    }
}

/// `status`: text or JSON; success only when healthy.
async fn status(config: &Settings, json: bool, max_lag_bytes: i64) -> ExitCode {
    let s = outbox_relay::status::status(config, max_lag_bytes).await;
    if json {
        println!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
    } else {
        print!("{}", s.render_text());
    }
    if s.healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `verify`: the report on stdout (text or JSON), progress and warnings on stderr; 0 no
/// differences, 1 differences, 2 could not check (all of it, or some rows).
async fn verify(
    config: &Settings,
    opts: &outbox_relay::verify::VerifyOptions,
    json: bool,
    json_logs: bool,
) -> ExitCode {
    match outbox_relay::verify::verify(config, opts, |p| eprintln!("{p}")).await {
        Ok(report) => {
            if json {
                println!("{}", report.to_json());
            } else {
                print!("{report}");
            }
            for w in &report.warnings {
                eprintln!("outbox-relay: warning: {w}");
            }
            if let Some(why) = &report.not_checked {
                eprintln!("outbox-relay: {why}");
            }
            ExitCode::from(report.exit_code())
        }
        Err(e) => {
            fail(json_logs, &e);
            ExitCode::from(2)
        }
    }
}

/// `parked`: one line per parked key and a summary (or one JSON object); 0 none parked, 1 some,
/// 2 the stream could not be read.
async fn parked(config: &Settings, json: bool, json_logs: bool) -> ExitCode {
    match parking_ops::parked(config).await {
        Ok(report) => {
            if json {
                println!("{}", serde_json::to_string(&report).unwrap_or_default());
            } else {
                print!("{report}");
            }
            ExitCode::from(report.exit_code())
        }
        Err(e) => {
            fail(json_logs, &e);
            ExitCode::from(2)
        }
    }
}

/// What `requeue`'s `--key`, `--key-null-id`, `--event` and `--discard` ask for (clap lets
/// exactly one of the first three through).
fn requeue_request(
    key: Option<String>,
    key_null_id: Option<String>,
    event: Option<String>,
    discard: bool,
) -> Result<Request, KeyError> {
    let key = match (key, key_null_id, event) {
        (Some(k), _, _) => Key::parse(&k)?,
        (_, Some(t), _) => Key::null_id(&t)?,
        (_, _, Some(id)) => return Ok(Request::RequeueEvent(id)),
        (None, None, None) => unreachable!("clap requires one of --key, --key-null-id, --event"),
    };
    Ok(if discard {
        Request::Discard(key)
    } else {
        Request::Requeue(key)
    })
}

/// `requeue`'s switches besides what it asks for.
struct RequeueOptions {
    force: bool,
    no_wait: bool,
    postgres_url: Option<String>,
}

/// How long `requeue` waits for the relay to carry a request out.
const REQUEUE_WAIT: Duration = Duration::from_secs(30);

/// `requeue`: one line with the request id and the control message's LSN once it is committed,
/// then one line saying whether the relay carried it out (within [`REQUEUE_WAIT`]). Exit 0 once
/// the request is committed, whether or not the wait saw it carried out; 1 when it was not sent.
async fn requeue(
    config: &Settings,
    request: Request,
    opts: &RequeueOptions,
    json_logs: bool,
) -> ExitCode {
    if let Err(e) = parking_ops::refuse_event(config, &request) {
        return fail(json_logs, &e);
    }
    if !opts.force
        && let Err(e) = parking_ops::refuse_unparked(config, &request).await
    {
        return fail(json_logs, &e);
    }
    let sent = match parking_ops::send(config, opts.postgres_url.as_deref(), request).await {
        Ok(s) => s,
        Err(e) => return fail(json_logs, &e),
    };
    println!("{sent}");
    if !opts.no_wait {
        println!(
            "{}",
            parking_ops::wait_stored(config, &sent, REQUEUE_WAIT)
                .await
                .line(config)
        );
    }
    ExitCode::SUCCESS
}

/// Reports a failed command with its whole cause chain: with JSON logs first as a JSON log line (so a
/// log collector sees it), then always as the plain `outbox-relay: …` line an operator reads.
/// Exit code 1.
fn fail(json_logs: bool, e: &dyn std::error::Error) -> ExitCode {
    if json_logs {
        tracing::error!(error = %error_chain(e), "outbox-relay failed");
    }
    // The chain may quote what a server or stream metadata said: one escaped, bounded line.
    eprintln!("outbox-relay: {}", error_line(e));
    ExitCode::FAILURE
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    stop_signal().await;
}

/// Resolves on SIGINT or SIGTERM, naming it. Both are handled from the first poll on: a signal
/// that comes while the caller does not poll (a step it finishes first) is seen at the next poll.
async fn stop_signal() -> &'static str {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return "SIGINT";
                }
            };
        tokio::select! {
            _ = ctrl_c => "SIGINT",
            _ = term.recv() => "SIGTERM",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
        "Ctrl-C"
    }
}

/// The log filter, reloadable on SIGHUP.
type FilterHandle = reload::Handle<EnvFilter, Registry>;

/// `log.level` as the filter the relay uses.
fn filter_for(level: &str) -> String {
    // The NATS client logs every (re)connect at info; the relay reports state changes itself.
    if level.contains("async_nats") {
        level.to_owned()
    } else {
        format!("{level},async_nats=warn")
    }
}

/// Logs go to stderr: human-readable by default, JSON with `log.format = "json"`. The filter sits in
/// a reload layer, so SIGHUP can change `log.level` without a restart.
fn init_logging(config: &Config) -> FilterHandle {
    let filter = EnvFilter::try_new(filter_for(&config.log.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = reload::Layer::new(filter);
    // Colours only on a terminal: a log file or collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let registry = tracing_subscriber::registry().with(filter);
    match config.log.format {
        LogFormat::Json => registry
            .with(
                fmt::layer()
                    .json()
                    .with_ansi(ansi)
                    .with_writer(std::io::stderr),
            )
            .init(),
        LogFormat::Text => registry
            .with(fmt::layer().with_ansi(ansi).with_writer(std::io::stderr))
            .init(),
    }
    handle
}

/// SIGHUP's reload hook for `log.level`.
struct LogLevel(FilterHandle);

impl LogLevel {
    const KEYS: &'static [&'static str] = &["log.level"];
}

impl Hook for LogLevel {
    fn keys(&self) -> &'static [&'static str] {
        Self::KEYS
    }

    fn apply(&mut self, new: &Settings) -> Result<(), HookError> {
        let filter = EnvFilter::try_new(filter_for(&new.config().log.level))?;
        self.0.reload(filter)?;
        Ok(())
    }
}

/// From now on SIGHUP reloads the configuration (the file given with `--config`, then the
/// environment) instead of ending the process, and logs one line: what was applied, what needs a
/// restart, or why the configuration could not be loaded.
#[cfg(unix)]
fn reload_on_sighup(
    path: Option<PathBuf>,
    running: &Settings,
    log_filter: FilterHandle,
    metrics: &Metrics,
) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot handle SIGHUP; it will end the relay");
            return;
        }
    };
    let mut reloader = Reloader::new(path, running);
    reloader.add(Box::new(LogLevel(log_filter)));
    reloader.add(Box::new(outbox_relay::reload::SchemasHook::new(
        &running.schemas,
        Arc::clone(&metrics.schemas),
    )));
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            match reloader.reload() {
                Ok(done) => {
                    // The line must survive a new level that hides info.
                    if tracing::enabled!(tracing::Level::INFO) {
                        tracing::info!("SIGHUP: configuration reloaded: {done}");
                    } else {
                        tracing::warn!("SIGHUP: configuration reloaded: {done}");
                    }
                }
                Err(e) => tracing::warn!(
                    error = %error_chain(&e),
                    "SIGHUP: the configuration cannot be loaded; the running settings stay"
                ),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    /// The hooks `reload_on_sighup` registers apply exactly the keys the docs' SIGHUP table (held to
    /// `RELOADED_KEYS` by the reload module's test) says are applied.
    #[test]
    fn the_registered_hooks_apply_exactly_the_reloaded_keys() {
        let mut hooks: Vec<&str> = super::LogLevel::KEYS
            .iter()
            .chain(outbox_relay::reload::SchemasHook::KEYS)
            .copied()
            .collect();
        let mut listed = outbox_relay::reload::RELOADED_KEYS.to_vec();
        hooks.sort_unstable();
        listed.sort_unstable();
        assert_eq!(hooks, listed);
    }
}
