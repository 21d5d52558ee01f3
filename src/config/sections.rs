//! The configuration's tables: [`Config`], one field per `[section]`, and each section's keys with
//! their defaults (docs/configuration.md lists them). `Debug` of the sections that hold URLs and
//! credentials masks them.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{DEFAULT_MESSAGE_PREFIX, redact_url};

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
    /// `[status]`: what `status` allows before it calls the slot unhealthy.
    pub status: StatusConfig,
    /// `[warnings]`: the warnings an operator acknowledged by name.
    pub warnings: WarningsConfig,
}

/// The `[status]` section.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StatusConfig {
    /// How long (seconds) the slot may be without a relay holding it before `status` calls that a
    /// problem, whether or not events wait: a restart or a standby's takeover fits in it. Events
    /// that wait in a slot no relay holds are a problem at once.
    pub grace_secs: u64,
}

impl Default for StatusConfig {
    fn default() -> Self {
        StatusConfig { grace_secs: 30 }
    }
}

/// The `[warnings]` section.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarningsConfig {
    /// Names of warnings (`crate::warning::NAMES`) the operator accepts: `setup`, `run`, `status`
    /// and `backfill` leave them out.
    pub acknowledged: Vec<String>,
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
    /// Park the event's key: the event and every later event of its key go to the key's parking
    /// subject until a control message releases it; every other key flows.
    Park,
}

/// What a parked key is (`outbox.park_key`): only the aggregate for now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ParkKey {
    /// `aggregate_type` and `aggregate_id` (message events: the same fields).
    Aggregate,
}

/// The default of `outbox.max_parked_keys`.
pub(crate) const DEFAULT_MAX_PARKED_KEYS: u64 = 10_000;

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
    /// With `on_invalid = "park"`: what a parked key is.
    pub park_key: ParkKey,
    /// With `on_invalid = "park"`: how many keys may be parked at once; past it the relay stops
    /// (the event that would park one more is not confirmed: nothing is lost).
    pub max_parked_keys: u64,
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
            park_key: ParkKey::Aggregate,
            max_parked_keys: DEFAULT_MAX_PARKED_KEYS,
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
    /// Where the position service may answer: a request's reply subject must start with one of
    /// these prefixes (requesters' inboxes, each ending in `.`), or it gets no answer.
    pub service_reply_prefixes: Vec<String>,
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
            service_reply_prefixes: vec!["_INBOX.".into()],
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
            .field("service_reply_prefixes", &self.service_reply_prefixes)
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
            .field("status", &self.status)
            .field("warnings", &self.warnings)
            .finish()
    }
}
