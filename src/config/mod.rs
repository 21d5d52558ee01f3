//! Configuration: TOML file, environment overrides, defaults, validation (docs/configuration.md).
//!
//! Layering: defaults < `--config FILE` < `OUTBOX_RELAY_<SECTION>_<KEY>` environment variables.
//! Unknown keys in the file are errors: a typo must not silently fall back to a default. A variable
//! that names no setting is ignored (Kubernetes injects `OUTBOX_RELAY_SERVICE_HOST` and the like),
//! with a warning when it looks like a misspelt key (`env.rs`). Every error is one line naming the
//! key (and its environment variable) and how to fix it.
//! URLs may carry passwords: `Debug` of this module's types never shows them.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

mod env;
mod name;
mod nats;
mod settings;

pub(crate) use env::redact_url;
pub(crate) use nats::NatsAuth;
pub use settings::Settings;

/// The logical message prefix sql/06_outbox_message.sql's helper emits by default, and so the
/// default `outbox.message_prefix`: "" is the explicit opt-out.
pub const DEFAULT_MESSAGE_PREFIX: &str = "outbox";

/// Prefix of the environment variables that override settings.
pub(crate) const ENV_PREFIX: &str = "OUTBOX_RELAY_";

/// The configuration as loaded (file, then environment), one field per `[section]`, before validation.
#[derive(Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The relay's name (top level): "" keeps the default names; a name derives the slot,
    /// publication, stream, subject prefix and dead-letter subject from it (`name.rs`). The
    /// derivation is part of [`Config::load`], which knows which keys were set; a `Config` built in
    /// code sets those keys itself.
    pub name: String,
    /// `[postgres]`: the database, the slot and the publication.
    pub postgres: PostgresConfig,
    /// `[outbox]`: where events come from and which columns they are made of.
    pub outbox: OutboxConfig,
    /// `[nats]`: the servers, credentials, stream, subjects and publish window.
    pub nats: NatsConfig,
    /// `[http]`: the metrics and health endpoint.
    pub http: HttpConfig,
    /// `[log]`: log format and filter.
    pub log: LogConfig,
    /// `[telemetry]`: trace spans over OTLP/HTTP.
    pub telemetry: TelemetryConfig,
}

/// The `[postgres]` section.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PostgresConfig {
    /// libpq-style URL; may hold a password.
    pub url: String,
    /// Name of the logical replication slot (output plugin `pgoutput`) the relay reads.
    pub slot: String,
    /// Publication that names the outbox table, inserts only.
    pub publication: String,
    /// Create the slot when it is missing (setup and run).
    pub(crate) create_slot: bool,
    /// PG 17+: create the slot with FAILOVER, so standbys with `sync_replication_slots` keep a copy
    /// that survives a promotion (ignored on older servers).
    pub(crate) failover: bool,
    /// Standby status update interval; at most 1000.
    pub status_interval_ms: u64,
    /// The largest replication message the relay accepts from the server (Postgres' own ceiling is
    /// about 1 GB); a larger length prefix is refused before anything is reserved for it.
    pub max_frame_bytes: usize,
}

impl Default for PostgresConfig {
    fn default() -> Self {
        PostgresConfig {
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            slot: "outbox_relay".into(),
            publication: "outbox_relay".into(),
            create_slot: true,
            failover: true,
            status_interval_ms: 1000,
            max_frame_bytes: crate::source::MAX_FRAME_BYTES,
        }
    }
}

/// What to do with an event that cannot be published as it is
/// (docs/guarantees.md#p7-no-silent-drop).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnInvalid {
    /// Publish it to the dead-letter subject with the reason, and go on.
    DeadLetter,
    /// Stop the relay with a clear error; the slot stays before the event.
    Stop,
}

/// The `[outbox]` section.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutboxConfig {
    /// Schema-qualified table name; "" for none (logical messages only, with `message_prefix`).
    pub table: String,
    /// Column of the event id, which becomes the message's `Nats-Msg-Id`.
    pub(crate) id_column: String,
    /// Column of the kind of entity (header `Outbox-Aggregate-Type`, placeholder `{aggregate_type}`).
    pub(crate) aggregate_type_column: String,
    /// Column of the entity id (header `Outbox-Aggregate-Id`, placeholder `{aggregate_id}`).
    pub(crate) aggregate_id_column: String,
    /// Column of what happened (header `Outbox-Event-Type`, placeholder `{event_type}`).
    pub(crate) event_type_column: String,
    /// Column of the message body, published as stored.
    pub(crate) payload_column: String,
    /// Optional jsonb object of extra headers; "" for none.
    pub headers_column: String,
    /// Extra columns copied to headers: `"tenant_id"` (header `tenant_id`) or
    /// `"tenant_id:Tenant-Id"`. A NULL column gives no header.
    pub header_columns: Vec<String>,
    /// Transactional logical messages (`pg_logical_emit_message(true, prefix, content)`) with this
    /// prefix are events too; "" for none. The default is the prefix of sql/06's `outbox_message()`,
    /// so the helper the project ships publishes with the default configuration.
    pub message_prefix: String,
    /// What to do with an event that cannot be published as it is.
    pub on_invalid: OnInvalid,
    /// A directory of JSON Schema files named `<event_type>.json`; an event whose payload does not
    /// validate is a dead letter. "" for none (nothing is parsed).
    pub schemas: String,
    /// An event whose type has no schema file is a dead letter too.
    pub schemas_required: bool,
    /// Transactional logical messages with this prefix carry trace context (a JSON object of
    /// header names and string values) for the events of their transaction that follow; "" for none.
    pub context_prefix: String,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            table: "public.outbox".into(),
            id_column: "event_id".into(),
            aggregate_type_column: "aggregate_type".into(),
            aggregate_id_column: "aggregate_id".into(),
            event_type_column: "event_type".into(),
            payload_column: "payload".into(),
            headers_column: String::new(),
            header_columns: Vec::new(),
            message_prefix: DEFAULT_MESSAGE_PREFIX.into(),
            on_invalid: OnInvalid::DeadLetter,
            schemas: String::new(),
            schemas_required: false,
            context_prefix: String::new(),
        }
    }
}

impl OutboxConfig {
    /// (schema, table) of `table`.
    pub(crate) fn table_parts(&self) -> (&str, &str) {
        self.table
            .split_once('.')
            .unwrap_or(("public", &self.table))
    }

    /// No table: the events are logical messages only (`table = ""` with a `message_prefix`).
    pub(crate) fn messages_only(&self) -> bool {
        self.table.is_empty()
    }

    /// `header_columns` as (column, header name) pairs; entries were checked by `validate`.
    pub(crate) fn header_column_pairs(&self) -> Vec<(String, String)> {
        self.header_columns
            .iter()
            .map(|entry| match entry.split_once(':') {
                Some((column, header)) => (column.trim().to_owned(), header.trim().to_owned()),
                None => (entry.trim().to_owned(), entry.trim().to_owned()),
            })
            .collect()
    }
}

/// The `[nats]` section.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// One URL or a comma-separated list (a cluster); `nats://` or `tls://`. May hold
    /// `user:password@` or `token@`.
    pub url: String,
    /// Credentials as keys instead of in the URL: user and password, or a token.
    pub user: String,
    /// The password that goes with `user`; both or neither.
    pub password: String,
    /// An authentication token.
    pub token: String,
    /// Path of an NKey seed file; "" for none.
    pub(crate) nkey_seed_file: String,
    /// Path of a NATS credentials file (JWT and seed); "" for none.
    pub(crate) creds_file: String,
    /// TLS to NATS: a PEM CA file to trust instead of the system roots.
    pub tls_ca_file: String,
    /// A client certificate and its key (mutual TLS).
    pub tls_cert_file: String,
    /// The private key (PEM) of `tls_cert_file`; both or neither.
    pub tls_key_file: String,
    /// Refuse a connection without TLS even for `nats://` URLs.
    pub(crate) tls_required: bool,
    /// JetStream stream that stores the events; setup creates it when missing.
    pub stream: String,
    /// Subject template with the placeholders `{aggregate_type}`, `{event_type}` and `{aggregate_id}`.
    pub subject: String,
    /// Literal subject, in the same stream, for events that cannot be published as they are.
    pub dead_letter_subject: String,
    /// Publishes awaiting their ack.
    pub max_in_flight: usize,
    /// Bytes (payload and headers) of the publishes awaiting their ack: the window's second bound.
    pub(crate) max_in_flight_bytes: usize,
    /// How long to wait for an ack before treating the connection as broken.
    pub ack_timeout_ms: u64,
    /// Duplicate window of a stream that setup creates.
    pub duplicate_window_secs: u64,
    /// Replicas of a stream that setup creates.
    pub stream_replicas: usize,
    /// How long a stream that setup creates keeps a message, in seconds; 0 keeps messages forever.
    pub max_age_secs: u64,
    /// The most bytes a stream that setup creates holds; 0 for no limit. Full, it refuses new events
    /// (the relay waits and retries) rather than delete old ones.
    pub max_bytes: u64,
    /// Fence the stream with `Nats-Expected-Last-Sequence` (see `fence`): commit order and no
    /// duplicates even after lost connections and beyond the duplicate window. Needs the relay to be
    /// the stream's only writer.
    pub fence: bool,
    /// Routed events carry `Outbox-Event-Type`, `Outbox-Aggregate-Type`, `Outbox-Aggregate-Id` and
    /// `Outbox-Commit-Lsn` (false leaves them out: about 1 µs less nats-server CPU per message).
    pub descriptive_headers: bool,
    /// Add CloudEvents binary-mode headers (`ce-*`, NATS protocol binding).
    pub cloudevents: bool,
    /// The `ce-source` of every event (a URI-reference).
    pub cloudevents_source: String,
    /// One Postgres transaction becomes one JetStream atomic batch (the stream needs
    /// `allow_atomic`): consumers never see part of a transaction. Needs `fence`.
    pub atomic_transactions: bool,
    /// With `atomic_transactions`: how long (milliseconds) a transaction's batch stays open for the
    /// transactions after it, which then share it (group commit: the server's fixed cost per batch
    /// is paid once for all of them). A batch also stays open while the one before it waits for
    /// its ack. Each transaction stays all-or-nothing and in order. 0: one batch per transaction.
    pub atomic_group_ms: u64,
    /// The first token(s) of the relay's inbox subjects, where JetStream answers its requests and
    /// publishes: a prefix of its own lets NATS permissions keep every other client off its inbox.
    pub inbox_prefix: String,
    /// Partitions of `{partition}` in the subject template (0: none): the aggregate id's partition,
    /// as nats-server's `partition(partitions, …)` mapping computes it.
    pub partitions: u32,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            url: "nats://127.0.0.1:4222".into(),
            user: String::new(),
            password: String::new(),
            token: String::new(),
            nkey_seed_file: String::new(),
            creds_file: String::new(),
            tls_ca_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            tls_required: false,
            stream: "OUTBOX".into(),
            subject: "outbox.{aggregate_type}".into(),
            dead_letter_subject: "outbox_dead_letter".into(),
            max_in_flight: 4096,
            max_in_flight_bytes: 64 << 20,
            ack_timeout_ms: 10_000,
            duplicate_window_secs: 120,
            stream_replicas: 1,
            max_age_secs: 7 * 24 * 3600,
            max_bytes: 0,
            fence: true,
            descriptive_headers: true,
            cloudevents: false,
            cloudevents_source: "outbox-relay".into(),
            atomic_transactions: false,
            atomic_group_ms: 1,
            inbox_prefix: "_INBOX".into(),
            partitions: 0,
        }
    }
}

/// The `[http]` section.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address for /metrics, /healthz, /readyz; "" disables the listener.
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:9187".into(),
        }
    }
}

/// The `[telemetry]` section (docs/tracing.md).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// OTLP/HTTP (protobuf) endpoint of a collector, e.g. `http://127.0.0.1:4318`; "" = no spans.
    pub otlp_endpoint: String,
    /// The `service.name` of the relay's spans.
    pub service_name: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: String::new(),
            service_name: "outbox-relay".into(),
        }
    }
}

/// How log lines are written (`log.format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Plain lines, for people.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// The `[log]` section.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `text` or `json`; logs go to standard error.
    pub format: LogFormat,
    /// A tracing filter, e.g. "info,outbox_relay=debug".
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

/// A setting that cannot be used. One line; names the key or file and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file cannot be read or parsed, or the settings loaded with it do not deserialise.
    #[error("config file {path}: {reason}")]
    File {
        /// The config file as given on the command line.
        path: String,
        /// What is wrong, in one line.
        reason: String,
    },
    /// An `OUTBOX_RELAY_*` variable cannot be applied, or (without a file) the settings do not deserialise.
    #[error("environment variable {var}: {reason}")]
    Env {
        /// The variable's name (`OUTBOX_RELAY_*` when no one variable is to blame).
        var: String,
        /// What is wrong, in one line.
        reason: String,
    },
    /// A value parsed but fails validation.
    #[error("config {key} (env {env}): {reason}")]
    Invalid {
        /// The key, as `section.key`.
        key: String,
        /// The environment variable that sets the key.
        env: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        env: format!("{ENV_PREFIX}{}", key.replace('.', "_").to_uppercase()),
        reason: reason.into(),
    }
}

impl Config {
    /// Loads `path` (if any), applies the process environment, validates.
    pub fn load(path: Option<&Path>) -> Result<Settings, ConfigError> {
        Self::load_with_env(path, std::env::vars())
    }

    /// As [`Config::load`], with the environment given (tests).
    pub fn load_with_env(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, ConfigError> {
        let mut table = match path {
            None => toml::Table::new(),
            Some(p) => {
                let shown = p.display().to_string();
                let text = std::fs::read_to_string(p).map_err(|e| ConfigError::File {
                    path: shown.clone(),
                    reason: format!("{e}"),
                })?;
                text.parse::<toml::Table>().map_err(|e| ConfigError::File {
                    path: shown,
                    reason: env::toml_error(&e, &text),
                })?
            }
        };
        let file_path = path.map(|p| p.display().to_string());
        let warnings = env::apply_env(&mut table, env)?;
        name::derive(&mut table);
        let config: Config = Config::deserialize(toml::Value::Table(table)).map_err(|e| {
            // Deserialising a parsed value: the text names the key and section, and holds no line
            // of the file.
            let reason = crate::text::single_spaced(&e.to_string());
            match &file_path {
                Some(path) => ConfigError::File {
                    path: path.clone(),
                    reason,
                },
                None => ConfigError::Env {
                    var: format!("{ENV_PREFIX}*"),
                    reason,
                },
            }
        })?;
        let mut settings = config.validate()?;
        settings.warnings = warnings;
        Ok(settings)
    }
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &redact_url(&self.url))
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("create_slot", &self.create_slot)
            .field("failover", &self.failover)
            .field("status_interval_ms", &self.status_interval_ms)
            .field("max_frame_bytes", &self.max_frame_bytes)
            .finish()
    }
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &redact_url(&self.url))
            .field("user", &self.user)
            .field("password", &(!self.password.is_empty()).then_some("***"))
            .field("token", &(!self.token.is_empty()).then_some("***"))
            .field("creds_file", &self.creds_file)
            .field("stream", &self.stream)
            .field("subject", &self.subject)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("max_in_flight", &self.max_in_flight)
            .field("ack_timeout_ms", &self.ack_timeout_ms)
            .field("fence", &self.fence)
            .field("descriptive_headers", &self.descriptive_headers)
            .field("cloudevents", &self.cloudevents)
            .field("cloudevents_source", &self.cloudevents_source)
            .field("atomic_transactions", &self.atomic_transactions)
            .field("atomic_group_ms", &self.atomic_group_ms)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("partitions", &self.partitions)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("name", &self.name)
            .field("postgres", &self.postgres)
            .field("outbox", &self.outbox)
            .field("nats", &self.nats)
            .field("http", &self.http)
            .field("log", &self.log)
            .field("telemetry", &self.telemetry)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn load(toml_text: &str, env: &[(&str, &str)]) -> Result<Settings, ConfigError> {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(toml_text.as_bytes()).unwrap();
        Config::load_with_env(
            Some(f.path()),
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn defaults_are_valid_and_match_the_contract() {
        let c = Config::load_with_env(None, Vec::new()).unwrap();
        assert_eq!(c.config().postgres.slot, "outbox_relay");
        assert_eq!(c.config().outbox.table, "public.outbox");
        assert_eq!(c.config().nats.subject, "outbox.{aggregate_type}");
        assert_eq!(c.config().nats.dead_letter_subject, "outbox_dead_letter");
        assert_eq!(c.config().http.listen, "127.0.0.1:9187");
        assert_eq!(c.config().outbox.on_invalid, OnInvalid::DeadLetter);
        // sql/06's helper publishes with the default configuration; "" is the explicit opt-out.
        assert_eq!(c.config().outbox.message_prefix, "outbox");
        let off = load("[outbox]\nmessage_prefix = \"\"\n", &[]).unwrap();
        assert_eq!(off.config().outbox.message_prefix, "");
        let off = load("", &[("OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX", "")]).unwrap();
        assert_eq!(off.config().outbox.message_prefix, "");
    }

    #[test]
    fn name_derives_the_relays_names_and_explicit_keys_win() {
        let c = load("name = \"orders\"\n", &[]).unwrap();
        let c = c.config();
        assert_eq!(c.postgres.slot, "outbox_relay_orders");
        assert_eq!(c.postgres.publication, "outbox_relay_orders");
        assert_eq!(c.nats.stream, "OUTBOX_ORDERS");
        assert_eq!(c.nats.subject, "orders.{aggregate_type}");
        assert_eq!(c.nats.dead_letter_subject, "orders_dead_letter");
        // "" keeps today's names.
        let c = load("name = \"\"\n", &[]).unwrap();
        assert_eq!(c.config().postgres.slot, "outbox_relay");
        assert_eq!(c.config().nats.stream, "OUTBOX");
        // The environment form, and explicit keys from the file and the environment, even when they
        // equal a default.
        let c = load(
            "[postgres]\nslot = \"outbox_relay\"\n[nats]\nsubject = \"claims.{event_type}\"\n",
            &[
                ("OUTBOX_RELAY_NAME", "claims"),
                ("OUTBOX_RELAY_NATS_STREAM", "CLAIMS"),
            ],
        )
        .unwrap();
        let c = c.config();
        assert_eq!(c.name, "claims");
        assert_eq!(c.postgres.slot, "outbox_relay", "explicit in the file");
        assert_eq!(c.nats.stream, "CLAIMS", "explicit in the environment");
        assert_eq!(c.nats.subject, "claims.{event_type}");
        assert_eq!(c.postgres.publication, "outbox_relay_claims", "derived");
        assert_eq!(c.nats.dead_letter_subject, "claims_dead_letter", "derived");
        // The environment wins over the file's name.
        let c = load("name = \"orders\"\n", &[("OUTBOX_RELAY_NAME", "billing")]).unwrap();
        assert_eq!(c.config().nats.stream, "OUTBOX_BILLING");
        for bad in ["Orders", "or.ders", "or-ders", "a b", "x*", &"n".repeat(51)] {
            let e = load(&format!("name = {bad:?}\n"), &[])
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("config name (env OUTBOX_RELAY_NAME): ")
                    && e.contains("not a valid relay name"),
                "{bad:?}: {e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
        assert!(load(&format!("name = {:?}\n", "n".repeat(50)), &[]).is_ok());
    }

    #[test]
    fn the_documented_complete_relay_toml_has_only_real_keys() {
        // docs/configuration.md, "A complete relay.toml": every key, `name` at the top level.
        let doc = include_str!("../../docs/configuration.md");
        let (_, section) = doc.split_once("\n## A complete relay.toml\n").unwrap();
        let (_, block) = section.split_once("```toml\n").unwrap();
        let (block, _) = block.split_once("\n```").unwrap();
        let table: toml::Table = block.parse().unwrap();
        let config = Config::deserialize(toml::Value::Table(table)).unwrap();
        assert_eq!(config.name, "");
    }

    #[test]
    fn env_wins_over_file_and_is_typed() {
        let c = load(
            "[postgres]\nslot = \"from_file\"\n[nats]\nmax_in_flight = 10\n",
            &[
                ("OUTBOX_RELAY_POSTGRES_SLOT", "from_env"),
                ("OUTBOX_RELAY_NATS_MAX_IN_FLIGHT", "20"),
                ("OUTBOX_RELAY_POSTGRES_CREATE_SLOT", "false"),
                ("UNRELATED", "x"),
            ],
        )
        .unwrap();
        assert_eq!(c.config().postgres.slot, "from_env");
        assert_eq!(c.config().nats.max_in_flight, 20);
        assert!(!c.config().postgres.create_slot);
    }

    #[test]
    fn unknown_keys_are_errors_naming_them() {
        let e = load("[postgres]\nslto = \"x\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("slto"), "{e}");
        let e = load("[postgress]\n", &[]).unwrap_err().to_string();
        assert!(e.contains("postgress"), "{e}");
    }

    #[test]
    fn variables_that_name_no_setting_do_not_stop_the_relay() {
        // Kubernetes injects these for a Service named outbox-relay.
        let c = load(
            "",
            &[
                ("OUTBOX_RELAY_SERVICE_HOST", "10.0.0.1"),
                ("OUTBOX_RELAY_PORT_9187_TCP", "tcp://10.0.0.1:9187"),
            ],
        )
        .unwrap();
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        // A near miss of a real key is a warning naming both.
        let c = load("", &[("OUTBOX_RELAY_NATS_STREEM", "x")]).unwrap();
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        let w = &c.warnings[0];
        assert!(
            w.contains("OUTBOX_RELAY_NATS_STREEM") && w.contains("OUTBOX_RELAY_NATS_STREAM"),
            "{w}"
        );
    }

    #[test]
    fn env_values_are_checked_against_their_own_variable() {
        let e = load("", &[("OUTBOX_RELAY_OUTBOX_ON_INVALID", "explode")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("OUTBOX_RELAY_OUTBOX_ON_INVALID"), "{e}");
        let c = load("", &[("OUTBOX_RELAY_NATS_FENCE", "TRUE")]).unwrap();
        assert!(c.config().nats.fence);
        let c = load("", &[("OUTBOX_RELAY_NATS_FENCE", "Off")]).unwrap();
        assert!(!c.config().nats.fence);
    }

    #[test]
    fn partition_placeholder_needs_partitions() {
        let e = load(
            "[nats]\nsubject = \"outbox.{aggregate_type}.{partition}\"",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("nats.partitions") && e.contains("{partition}"),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(
            !e.contains("  "),
            "no run of spaces from a line continuation: {e}"
        );
        let c = load(
            "[nats]\nsubject = \"outbox.{aggregate_type}.{partition}\"",
            &[("OUTBOX_RELAY_NATS_PARTITIONS", "4")],
        )
        .unwrap();
        assert_eq!(c.config().nats.partitions, 4);
        assert_eq!(c.subject.partition_wildcards().len(), 4);
        let e = load("[nats]\npartitions = 10001", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("nats.partitions"), "{e}");
    }

    #[test]
    fn inbox_prefix_is_literal_and_outside_the_stream() {
        assert_eq!(load("", &[]).unwrap().config().nats.inbox_prefix, "_INBOX");
        let c = load(
            "[nats]\ninbox_prefix = \"_INBOX_outbox_relay\"",
            &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", "_INBOX_relay.claims")],
        )
        .unwrap();
        assert_eq!(c.config().nats.inbox_prefix, "_INBOX_relay.claims");
        for bad in ["", "a.*", "_INBOX.>", "$JS", "a..b", "has space", "outbox"] {
            let e = load("", &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", bad)])
                .unwrap_err()
                .to_string();
            assert!(e.contains("nats.inbox_prefix"), "{bad:?}: {e}");
        }
        // `outbox.>` would take in the default template's `outbox.*`.
        let e = load("", &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", "outbox")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("overlaps nats.subject"), "{e}");
        // Under the position service's subjects, where its callers may publish (docs/security.md,
        // finding 11).
        for bad in ["outbox-relay", "outbox-relay.inbox", "outbox-relay.s.wait"] {
            let e = load("", &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", bad)])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("nats.inbox_prefix")
                    && e.contains("overlaps the position service's subjects outbox-relay.>"),
                "{bad:?}: {e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
        for good in ["outbox-relay_inbox", "_INBOX_outbox-relay"] {
            assert!(
                load("", &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", good)]).is_ok(),
                "{good}"
            );
        }
    }

    #[test]
    fn event_source_and_format_keys() {
        let c = load(
            "",
            &[
                (
                    "OUTBOX_RELAY_OUTBOX_HEADER_COLUMNS",
                    "tenant_id, region:X-Region",
                ),
                ("OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX", "outbox"),
                ("OUTBOX_RELAY_NATS_CLOUDEVENTS", "true"),
            ],
        )
        .unwrap();
        assert_eq!(
            c.config().outbox.header_column_pairs(),
            [
                ("tenant_id".to_owned(), "tenant_id".to_owned()),
                ("region".to_owned(), "X-Region".to_owned())
            ]
        );
        assert_eq!(c.config().outbox.message_prefix, "outbox");
        assert!(c.config().nats.cloudevents);
        assert_eq!(c.config().nats.cloudevents_source, "outbox-relay");
        // Messages only needs a prefix.
        let c = load("[outbox]\ntable = \"\"\nmessage_prefix = \"outbox\"\n", &[]).unwrap();
        assert!(c.config().outbox.messages_only());
        let e = load("[outbox]\ntable = \"\"\nmessage_prefix = \"\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("outbox.message_prefix"), "{e}");
        for (bad, why) in [
            ("[\"msg_id:nats-msg-id\"]", "reserved"),
            ("[\"t:Outbox-Tenant\"]", "reserved"),
            ("[\"t:a b\"]", "not a valid header name"),
            ("[\"drop table\"]", "plain identifier"),
            ("[\"a:X\", \"b:x\"]", "twice"),
        ] {
            let e = load(&format!("[outbox]\nheader_columns = {bad}\n"), &[])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(why) && e.contains("OUTBOX_RELAY_OUTBOX_HEADER_COLUMNS"),
                "{bad}: {e}"
            );
        }
        // ce-* is an ordinary name until CloudEvents are on.
        assert!(load("[outbox]\nheader_columns = [\"t:ce-tenant\"]\n", &[]).is_ok());
        let e = load(
            "[outbox]\nheader_columns = [\"t:ce-tenant\"]\n[nats]\ncloudevents = true\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("reserved"), "{e}");
    }

    #[test]
    fn telemetry_and_context_keys() {
        let c = load("", &[]).unwrap();
        assert_eq!(c.config().telemetry.otlp_endpoint, "", "off by default");
        assert_eq!(c.config().telemetry.service_name, "outbox-relay");
        assert_eq!(c.config().outbox.context_prefix, "");
        let c = load(
            "[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318\"\n",
            &[("OUTBOX_RELAY_OUTBOX_CONTEXT_PREFIX", "outbox-context")],
        )
        .unwrap();
        assert_eq!(c.config().outbox.context_prefix, "outbox-context");
        assert_eq!(
            crate::telemetry::traces_url(&c.config().telemetry.otlp_endpoint).unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            crate::telemetry::traces_url("http://collector:4318/custom/path").unwrap(),
            "http://collector:4318/custom/path"
        );
        for (bad, why) in [
            ("https://collector:4318", "not supported"),
            ("collector:4318", "not supported"),
            ("not a url", "not a URL"),
            ("http://user:pw@collector:4318", "credentials"),
        ] {
            let e = load("", &[("OUTBOX_RELAY_TELEMETRY_OTLP_ENDPOINT", bad)])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("telemetry.otlp_endpoint") && e.contains(why),
                "{bad}: {e}"
            );
        }
        let e = load(
            "[outbox]\nmessage_prefix = \"outbox\"\ncontext_prefix = \"outbox\"\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("outbox.context_prefix"), "{e}");
    }

    #[test]
    fn toml_errors_never_echo_the_source_line() {
        let e = load(
            "[postgres]
url = \"postgres://u:hunter2@h/d
",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(!e.contains("hunter2"), "{e}");
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn log_level_words_must_be_levels_or_targets() {
        for good in [
            "info",
            "warn,outbox_relay=debug",
            "outbox_relay",
            "async_nats=trace",
            "DEBUG",
        ] {
            assert!(
                load(&format!("[log]\nlevel = \"{good}\"\n"), &[]).is_ok(),
                "{good}"
            );
        }
        for bad in ["loud", "info,outbox_relay=loud", "verbose"] {
            let e = load(&format!("[log]\nlevel = \"{bad}\"\n"), &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("log.level"), "{bad}: {e}");
        }
    }

    #[test]
    fn invalid_values_name_key_and_env() {
        let e = load("[postgres]\nslot = \"Bad-Slot\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("postgres.slot") && e.contains("OUTBOX_RELAY_POSTGRES_SLOT"),
            "{e}"
        );
        let e = load("[outbox]\ntable = \"outbox\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("schema-qualified"), "{e}");
        let e = load("[nats]\nsubject = \"outbox.{bogus}\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("nats.subject") && e.contains("bogus"), "{e}");
        let e = load("", &[("OUTBOX_RELAY_NATS_MAX_IN_FLIGHT", "lots")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("whole number"), "{e}");
        let e = load("[nats]\ndead_letter_subject = \"outbox.dead\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("matched by nats.subject"), "{e}");
        let e = load("[postgres]\nurl = \"mysql://x\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("postgres.url"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }

    #[test]
    fn bad_toml_names_the_file() {
        let e = load("[postgres\n", &[]).unwrap_err().to_string();
        assert!(e.starts_with("config file "), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn debug_hides_passwords() {
        let c = load(
            "[postgres]\nurl = \"postgres://u:hunter2@h/d\"\n[nats]\nurl = \"nats://a:s3cret@h:4222\"\n",
            &[],
        )
        .unwrap();
        let d = format!("{c:?}");
        assert!(!d.contains("hunter2") && !d.contains("s3cret"), "{d}");
    }

    #[test]
    fn a_schema_directory_that_does_not_load_is_a_config_error_for_the_commands_that_check() {
        let e = load("[outbox]\nschemas_required = true\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("outbox.schemas_required"), "{e}");
        // Loads (status reports it), but refuses where events are checked.
        let s = load("", &[("OUTBOX_RELAY_OUTBOX_SCHEMAS", "/no/such/schemas")]).unwrap();
        let e = s.schemas_loaded().unwrap_err().to_string();
        assert!(
            e.contains("outbox.schemas")
                && e.contains("OUTBOX_RELAY_OUTBOX_SCHEMAS")
                && e.contains("/no/such/schemas: cannot read the directory"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        assert!(load("", &[]).unwrap().schemas_loaded().is_ok());
    }
}
