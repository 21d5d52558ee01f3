//! Settings parsed once: [`Config::validate`] checks every key that can be checked without a
//! server and returns [`Settings`], the configuration with its URL, subject template and durations
//! already parsed, so nothing later re-parses a string or needs an `expect`.

use std::net::SocketAddr;
use std::time::Duration;

use super::nats::NatsSettings;
use super::{Config, ConfigError, OnInvalid, invalid};
use crate::route::SubjectTemplate;
use crate::schema::{LoadError, SchemaSet, Schemas};
use crate::source::ConnInfo;

/// A validated configuration. Each setting has one name: a setting that needs parsing is read from
/// its parsed field here (`ack_timeout`, never `nats.ack_timeout_ms`), every other one from
/// [`Settings::config`]. There is no `Deref` to [`Config`]: through one, both names would compile.
#[derive(Clone, Debug)]
pub struct Settings {
    config: Config,
    /// `postgres.url`, parsed.
    pub(crate) conn: ConnInfo,
    /// `[nats]` servers, credentials and TLS, parsed.
    pub(crate) nats_conn: NatsSettings,
    /// `nats.subject`, parsed.
    pub(crate) subject: SubjectTemplate,
    /// `postgres.status_interval_ms`, as a duration.
    pub status_interval: Duration,
    /// `nats.ack_timeout_ms`, as a duration.
    pub(crate) ack_timeout: Duration,
    /// `outbox.on_invalid = "stop"`.
    pub(crate) stop_on_invalid: bool,
    /// `outbox.on_invalid = "park"`.
    pub(crate) park_on_invalid: bool,
    /// Findings that do not stop the relay (e.g. a misspelt environment variable), for the log.
    pub(crate) warnings: Vec<crate::warning::Warning>,
    /// Where these settings came from: the `--config` file and the variables that set keys.
    pub(crate) origin: super::origin::Origin,
    /// `outbox.schemas`, loaded: the set in force, shared with every stage (empty when the
    /// directory did not load; see [`Settings::schemas_loaded`]).
    pub schemas: Schemas,
    /// Why `outbox.schemas` did not load, if it did not: `status` reports it, the commands that
    /// check events refuse to start ([`Settings::schemas_loaded`]), a reload keeps the old set.
    pub(crate) schemas_error: Option<LoadError>,
}

impl Settings {
    /// The configuration these settings came from: names and plain values. A setting with a parsed
    /// field above is read there, not here.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// `outbox.schemas` loaded: a directory that does not is a config error for the commands that
    /// check events (`run`, `backfill`, `check-schemas`).
    pub fn schemas_loaded(&self) -> Result<(), ConfigError> {
        match &self.schemas_error {
            None => Ok(()),
            Some(e) => Err(invalid(
                "outbox.schemas",
                format!("{e} (fix the file, or set outbox.schemas = \"\" to check nothing)"),
            )),
        }
    }
}

impl Config {
    /// Checks every setting that can be checked without connecting, and parses each once.
    pub fn validate(&self) -> Result<Settings, ConfigError> {
        // First: with a bad name, the derived keys would be refused under their own names instead.
        super::name::check(&self.name)?;
        let conn = self.validate_postgres()?;
        self.validate_outbox()?;
        self.validate_telemetry()?;
        let (nats, template) = self.validate_nats()?;
        self.validate_http()?;
        self.validate_operator()?;
        check_log_level(&self.log.level)?;
        let (schemas, schemas_error) = self.load_schemas()?;
        let (o, n) = (&self.outbox, &self.nats);
        Ok(Settings {
            config: self.clone(),
            conn,
            nats_conn: nats,
            subject: template,
            status_interval: Duration::from_millis(self.postgres.status_interval_ms),
            ack_timeout: Duration::from_millis(n.ack_timeout_ms),
            stop_on_invalid: o.on_invalid == OnInvalid::Stop,
            park_on_invalid: o.on_invalid == OnInvalid::Park,
            warnings: Vec::new(),
            origin: Default::default(),
            schemas,
            schemas_error,
        })
    }

    /// `[postgres]`: the URL parsed, then the slot, publication and protocol limits.
    fn validate_postgres(&self) -> Result<ConnInfo, ConfigError> {
        let conn = ConnInfo::parse(&self.postgres.url)
            .map_err(|e| invalid("postgres.url", e.to_string()))?;
        check_slot_name(&self.postgres.slot)?;
        check_ident("postgres.publication", &self.postgres.publication)?;
        if !(50..=1000).contains(&self.postgres.status_interval_ms) {
            return Err(invalid(
                "postgres.status_interval_ms",
                "must be between 50 and 1000 (status updates at least every second keep the slot alive)",
            ));
        }
        if !((1 << 20)..=crate::source::MAX_FRAME_BYTES).contains(&self.postgres.max_frame_bytes) {
            return Err(invalid(
                "postgres.max_frame_bytes",
                format!(
                    "must be between 1048576 and {} (Postgres sends nothing larger)",
                    crate::source::MAX_FRAME_BYTES
                ),
            ));
        }
        Ok(conn)
    }

    /// `[outbox]`: the table (or messages only), its columns, and the message prefixes.
    fn validate_outbox(&self) -> Result<(), ConfigError> {
        let o = &self.outbox;
        check_outbox_table(o)?;
        for (key, col) in [
            ("outbox.id_column", &o.id_column),
            ("outbox.aggregate_type_column", &o.aggregate_type_column),
            ("outbox.aggregate_id_column", &o.aggregate_id_column),
            ("outbox.event_type_column", &o.event_type_column),
            ("outbox.payload_column", &o.payload_column),
        ] {
            check_ident(key, col)?;
        }
        if !o.headers_column.is_empty() {
            check_ident("outbox.headers_column", &o.headers_column)?;
        }
        check_header_columns(&o.header_columns, self.nats.cloudevents)?;
        if o.message_prefix.contains('\0') {
            return Err(invalid(
                "outbox.message_prefix",
                "contains a NUL character, which a logical message prefix cannot hold",
            ));
        }
        check_context_prefix(o)?;
        check_parking(o, &self.nats)
    }

    /// `[telemetry]`: an OTLP endpoint, if set, makes a traces URL.
    fn validate_telemetry(&self) -> Result<(), ConfigError> {
        if !self.telemetry.otlp_endpoint.is_empty() {
            crate::telemetry::traces_url(&self.telemetry.otlp_endpoint)
                .map_err(|e| invalid("telemetry.otlp_endpoint", e.to_string()))?;
        }
        Ok(())
    }

    /// `[nats]`: connection settings, stream name and subjects parsed, then the numeric limits.
    fn validate_nats(&self) -> Result<(NatsSettings, SubjectTemplate), ConfigError> {
        let n = &self.nats;
        if n.cloudevents && n.cloudevents_source.trim().is_empty() {
            return Err(invalid(
                "nats.cloudevents_source",
                "is empty, but CloudEvents require a source (a URI-reference such as \"outbox-relay\" or \
                 \"/claims-service\")",
            ));
        }
        let nats = super::nats::parse(n)?;
        check_stream_name(&n.stream)?;
        let template = check_subjects(n)?;
        check_nats_limits(n)?;
        Ok((nats, template))
    }

    /// `http.listen`: empty (no listener) or a socket address.
    fn validate_http(&self) -> Result<(), ConfigError> {
        if !self.http.listen.is_empty() && self.http.listen.parse::<SocketAddr>().is_err() {
            return Err(invalid(
                "http.listen",
                format!(
                    "{:?} is not an address like 127.0.0.1:9187 (\"\" disables the listener)",
                    self.http.listen
                ),
            ));
        }
        Ok(())
    }

    /// `[status]` and `[warnings]`: a grace period an operator can wait out, and acknowledged names
    /// that name warnings (a typo would silence nothing, quietly).
    fn validate_operator(&self) -> Result<(), ConfigError> {
        if self.status.grace_secs > 3600 {
            return Err(invalid(
                "status.grace_secs",
                "must be at most 3600: a slot no relay holds for longer than an hour is a problem to report, \
                 not to wait out (the default 30 s covers a restart or a standby's takeover)",
            ));
        }
        let unknown = crate::warning::unknown_names(&self.warnings.acknowledged);
        if !unknown.is_empty() {
            return Err(invalid(
                "warnings.acknowledged",
                format!(
                    "names no warning: {}; the names are those in brackets after `warning`, e.g. {}",
                    unknown.join(", "),
                    crate::warning::NAMES
                        .iter()
                        .take(3)
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// `outbox.schemas`: required needs a directory; the set is loaded here so a reload's new
    /// settings carry the new set, and a directory that does not load is returned, not refused
    /// (whether it stops the command is the command's choice; status reports it).
    fn load_schemas(&self) -> Result<(Schemas, Option<LoadError>), ConfigError> {
        let o = &self.outbox;
        if o.schemas_required && o.schemas.is_empty() {
            return Err(invalid(
                "outbox.schemas_required",
                "is on, but outbox.schemas is empty: every event would be a dead letter; name the schema \
                 directory in outbox.schemas",
            ));
        }
        Ok(match SchemaSet::load(&o.schemas, o.schemas_required) {
            Ok(set) => (Schemas::new(set), None),
            Err(e) => (Schemas::new(SchemaSet::default()), Some(e)),
        })
    }
}

/// `postgres.slot`: Postgres's rules for a replication slot name.
fn check_slot_name(slot: &str) -> Result<(), ConfigError> {
    if slot.is_empty()
        || slot.len() > 63
        || !slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(invalid(
            "postgres.slot",
            format!(
                "{slot:?} is not a valid slot name: use 1-63 lowercase letters, digits and underscores"
            ),
        ));
    }
    Ok(())
}

/// `outbox.table`: schema-qualified, or empty for messages only (which then needs a message prefix
/// and no header columns).
fn check_outbox_table(o: &super::OutboxConfig) -> Result<(), ConfigError> {
    match o.table.split_once('.') {
        // Messages only: no table to read, so the prefix is what makes events.
        None if o.table.is_empty() => {
            if o.message_prefix.is_empty() {
                return Err(invalid(
                    "outbox.table",
                    "is empty, but outbox.message_prefix is not set: name the outbox table, or set \
                     outbox.message_prefix to relay logical messages only",
                ));
            }
            if !o.header_columns.is_empty() {
                return Err(invalid(
                    "outbox.header_columns",
                    "needs a table, but outbox.table is empty (messages only): put the values in the \
                     message's \"headers\" object instead",
                ));
            }
        }
        Some((schema, table))
            if !schema.is_empty() && !table.is_empty() && !table.contains('.') =>
        {
            check_ident("outbox.table", schema)?;
            check_ident("outbox.table", table)?;
        }
        _ => {
            return Err(invalid(
                "outbox.table",
                format!("{:?} must be schema-qualified, like public.outbox", o.table),
            ));
        }
    }
    Ok(())
}

/// `nats.stream`: a name JetStream accepts.
fn check_stream_name(stream: &str) -> Result<(), ConfigError> {
    if stream.is_empty()
        || stream.len() > 255
        || stream
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c))
    {
        return Err(invalid(
            "nats.stream",
            format!(
                "{stream:?} is not a valid stream name: 1-255 characters, no spaces, '.', '*', '>', '/' or '\\'"
            ),
        ));
    }
    Ok(())
}

/// `nats.subject` parsed, with its partitions, and the dead-letter and inbox subjects kept apart
/// from it.
fn check_subjects(n: &super::NatsConfig) -> Result<SubjectTemplate, ConfigError> {
    let template = SubjectTemplate::parse(&n.subject)
        .map_err(|e| invalid("nats.subject", e.to_string()))?
        .with_partitions(n.partitions);
    check_partitions(n, &template)?;
    crate::route::check_subject(&n.dead_letter_subject)
        .map_err(|e| invalid("nats.dead_letter_subject", e.to_string()))?;
    if template.matches_literal(&n.dead_letter_subject) {
        return Err(invalid(
            "nats.dead_letter_subject",
            format!(
                "{:?} is matched by nats.subject {:?}: dead letters would mix with events; pick a subject outside it",
                n.dead_letter_subject, n.subject
            ),
        ));
    }
    check_inbox_prefix(n, &template)?;
    super::reply_prefixes::check(n, &template)?;
    Ok(template)
}

/// The parking settings: `max_parked_keys` in range, and park only on a fenced stream (the parked
/// set is rebuilt from the stream, which only the fence keeps a commit-ordered prefix of the outbox:
/// without it a replay republishes, and would decide again events a later park changed).
fn check_parking(o: &super::OutboxConfig, n: &super::NatsConfig) -> Result<(), ConfigError> {
    if !(1..=MAX_PARKED_KEYS_LIMIT).contains(&o.max_parked_keys) {
        return Err(invalid(
            "outbox.max_parked_keys",
            format!("must be between 1 and {MAX_PARKED_KEYS_LIMIT}"),
        ));
    }
    if o.on_invalid == OnInvalid::Park && n.atomic_transactions {
        // A batch member cannot go to a parking subject on its own: the batch is stored whole.
        return Err(invalid(
            "outbox.on_invalid",
            "\"park\" cannot be used with nats.atomic_transactions = true: a parked key's events would \
             leave their transaction's batch, which JetStream stores whole or not at all, and split the \
             transaction; set nats.atomic_transactions = false to park keys, or keep atomic batches with \
             outbox.on_invalid = \"dead_letter\" (or \"stop\")",
        ));
    }
    if o.on_invalid == OnInvalid::Park && !n.fence {
        return Err(invalid(
            "outbox.on_invalid",
            "\"park\" needs nats.fence = true: the parked keys are rebuilt from the fenced stream",
        ));
    }
    Ok(())
}

/// The most keys `outbox.max_parked_keys` may allow: the parked set is held in memory.
const MAX_PARKED_KEYS_LIMIT: u64 = 1_000_000;

/// `[nats]` numbers: in-flight limits, timeouts, stream retention and replicas, and the fence
/// that atomic batches need.
fn check_nats_limits(n: &super::NatsConfig) -> Result<(), ConfigError> {
    if !(1..=65_536).contains(&n.max_in_flight) {
        return Err(invalid("nats.max_in_flight", "must be between 1 and 65536"));
    }
    if !((64 << 10)..=(4 << 30) - 1).contains(&n.max_in_flight_bytes) {
        return Err(invalid(
            "nats.max_in_flight_bytes",
            "must be between 65536 and 4294967295",
        ));
    }
    if n.ack_timeout_ms < 100 {
        return Err(invalid("nats.ack_timeout_ms", "must be at least 100"));
    }
    if n.duplicate_window_secs == 0 {
        return Err(invalid(
            "nats.duplicate_window_secs",
            "must be at least 1: the duplicate window is what drops republished events",
        ));
    }
    if n.max_age_secs != 0 && n.duplicate_window_secs > n.max_age_secs {
        // JetStream refuses such a stream: an id cannot be remembered longer than its message.
        return Err(invalid(
            "nats.max_age_secs",
            format!(
                "is shorter than nats.duplicate_window_secs ({}): keep messages at least as long as \
                 the duplicate window, or set 0 to keep them forever",
                n.duplicate_window_secs
            ),
        ));
    }
    if i64::try_from(n.max_bytes).is_err() {
        return Err(invalid(
            "nats.max_bytes",
            "must be below 2^63 (0 for no limit)",
        ));
    }
    if !(1..=5).contains(&n.stream_replicas) {
        return Err(invalid("nats.stream_replicas", "must be between 1 and 5"));
    }
    if n.atomic_transactions && !n.fence {
        // An atomic batch carries no Nats-Msg-Id: only the fence keeps a restart from storing
        // a transaction twice.
        return Err(invalid(
            "nats.atomic_transactions",
            "needs nats.fence = true: atomic batches cannot carry Nats-Msg-Id, so the fence is what keeps \
             every event stored once",
        ));
    }
    if n.atomic_group_ms > MAX_ATOMIC_GROUP_MS {
        // nats-server abandons a batch idle for 10 s; a group held open that long would be lost
        // and sent again on every session.
        return Err(invalid(
            "nats.atomic_group_ms",
            "must be at most 1000 (milliseconds a transaction's atomic batch waits for the next \
             transactions; 0 = one batch per transaction)",
        ));
    }
    Ok(())
}

/// `outbox.header_columns`: `column` or `column:Header-Name`, a plain column and a valid header name
/// that is not one the relay sets itself (the same rules as names in the headers column).
fn check_header_columns(entries: &[String], cloudevents: bool) -> Result<(), ConfigError> {
    const KEY: &str = "outbox.header_columns";
    let mut seen: Vec<String> = Vec::new();
    for entry in entries {
        let (column, header) = match entry.split_once(':') {
            Some((c, h)) => (c.trim(), h.trim()),
            None => (entry.trim(), entry.trim()),
        };
        check_ident(KEY, column)?;
        if let Err(why) = crate::header_name::check(header, cloudevents) {
            return Err(invalid(KEY, format!("{entry:?}: {why}")));
        }
        let lower = header.to_ascii_lowercase();
        if seen.contains(&lower) {
            return Err(invalid(
                KEY,
                format!("{entry:?}: header {header:?} is named twice"),
            ));
        }
        seen.push(lower);
    }
    Ok(())
}

/// The most partitions: a consumer per partition, and setup checks the stream for each.
const MAX_PARTITIONS: u32 = 10_000;

/// `nats.atomic_group_ms` at most: far below nats-server's 10 s after which an idle batch is
/// abandoned.
const MAX_ATOMIC_GROUP_MS: u64 = 1000;

/// `nats.partitions` and `{partition}`: one needs the other's count.
fn check_partitions(n: &super::NatsConfig, template: &SubjectTemplate) -> Result<(), ConfigError> {
    let uses = template
        .fields()
        .any(|f| f == crate::route::Field::Partition);
    if uses && n.partitions == 0 {
        return Err(invalid(
            "nats.partitions",
            format!(
                "is 0, but nats.subject {:?} uses {{partition}}: set nats.partitions to the number of partitions (the N of the stream's partition(N, ...) mapping)",
                n.subject
            ),
        ));
    }
    if n.partitions > MAX_PARTITIONS {
        return Err(invalid(
            "nats.partitions",
            format!("must be between 0 and {MAX_PARTITIONS}"),
        ));
    }
    Ok(())
}

/// `nats.inbox_prefix`: literal tokens (no wildcards, not `$…`, which NATS reserves), no subject
/// the stream stores (JetStream would store the answers to the relay's own publishes), and not under
/// `outbox-relay.>`, where service callers may publish.
fn check_inbox_prefix(
    n: &super::NatsConfig,
    template: &SubjectTemplate,
) -> Result<(), ConfigError> {
    const KEY: &str = "nats.inbox_prefix";
    let prefix = &n.inbox_prefix;
    crate::route::check_subject(prefix).map_err(|why| {
        invalid(
            KEY,
            format!("{why}: use literal tokens such as \"_INBOX_outbox_relay\""),
        )
    })?;
    let inbox = format!("{prefix}.>");
    // The position service's subjects: service callers may publish there, so an inbox among them
    // would let any of them plant an answer on the relay's inbox.
    if crate::route::subjects_overlap(&inbox, "outbox-relay.>") {
        return Err(invalid(
            KEY,
            format!(
                "{prefix:?}: the relay's inbox {inbox} overlaps the position service's subjects outbox-relay.>, \
                 where service callers may publish: pick a prefix of its own, such as \"_INBOX_outbox_relay\""
            ),
        ));
    }
    for (key, subject) in [
        ("nats.subject", template.wildcard()),
        ("nats.dead_letter_subject", n.dead_letter_subject.clone()),
    ] {
        if crate::route::subjects_overlap(&inbox, &subject) {
            return Err(invalid(
                KEY,
                format!(
                    "{prefix:?}: the relay's inbox {inbox} overlaps {key} {subject:?}, so the stream would store \
                     JetStream's answers: pick a prefix of its own, such as \"_INBOX_outbox_relay\""
                ),
            ));
        }
    }
    Ok(())
}

/// An identifier the relay puts into SQL: letters, digits, underscores, `$`; not starting with a digit.
fn check_ident(key: &str, s: &str) -> Result<(), ConfigError> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_alphanumeric() || c == '_' || c == '$');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            key,
            format!(
                "{s:?} is not a plain identifier: use letters, digits and underscores (at most 63)"
            ),
        ))
    }
}

/// Log levels a `log.level` directive may name.
const LEVELS: &[&str] = &["trace", "debug", "info", "warn", "error", "off"];
/// Targets worth filtering: the relay's own and the clients it uses.
const TARGETS: &[&str] = &[
    "outbox_relay",
    "async_nats",
    "tokio_postgres",
    "postgres_protocol",
    "hyper",
    "rustls",
    "tokio",
];

/// `log.level`: comma-separated directives, each a level (`info`) or `target=level`
/// (`outbox_relay=debug`), or a bare target (`outbox_relay`, all levels). A word that is neither a
/// level nor a known target is refused: `loud` would otherwise silence every log line.
fn check_log_level(level: &str) -> Result<(), ConfigError> {
    let bad = |why: String| {
        invalid(
            "log.level",
            format!(
                "{level:?}: {why}; use a level ({}) or target=level, like \"info,outbox_relay=debug\"",
                LEVELS.join(", ")
            ),
        )
    };
    if tracing_subscriber::EnvFilter::try_new(level).is_err() {
        return Err(bad("not a filter".into()));
    }
    for directive in level.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let (target, lvl) = match directive.split_once('=') {
            Some((t, l)) => (Some(t), Some(l)),
            None if LEVELS.contains(&directive.to_ascii_lowercase().as_str()) => (None, None),
            None => (Some(directive), None),
        };
        if let Some(l) = lvl
            && !LEVELS.contains(&l.to_ascii_lowercase().as_str())
        {
            return Err(bad(format!("{l:?} is not a level")));
        }
        if let Some(t) = target {
            let root = t.split(['[', ':']).next().unwrap_or(t);
            if !TARGETS.contains(&root) {
                return Err(bad(format!("{t:?} is neither a level nor a known target")));
            }
        }
    }
    Ok(())
}

/// `outbox.context_prefix`: a prefix of its own, which no event message uses.
fn check_context_prefix(o: &super::OutboxConfig) -> Result<(), ConfigError> {
    if o.context_prefix.contains('\0') {
        return Err(invalid(
            "outbox.context_prefix",
            "contains a NUL character, which a logical message prefix cannot hold",
        ));
    }
    if !o.context_prefix.is_empty() && o.context_prefix == o.message_prefix {
        return Err(invalid(
            "outbox.context_prefix",
            format!(
                "is the same as outbox.message_prefix ({:?}): context messages and event messages need \
                 prefixes of their own (the helper sql/08_outbox_context.sql emits \"outbox-context\")",
                o.message_prefix
            ),
        ));
    }
    Ok(())
}
