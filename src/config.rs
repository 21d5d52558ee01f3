//! Configuration: TOML file, environment overrides, defaults, validation (DESIGN.md §4).
//!
//! Layering: defaults < `--config FILE` < `OUTBOX_RELAY_<SECTION>_<KEY>` environment variables.
//! Unknown keys, in the file or in the environment, are errors: a typo must not silently fall back to
//! a default. Every error is one line naming the key (and its environment variable) and how to fix it.
//! URLs may carry passwords: `Debug` of this module's types never shows them.

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::route::SubjectTemplate;
use crate::source::ConnInfo;

/// Prefix of the environment variables that override settings.
pub const ENV_PREFIX: &str = "OUTBOX_RELAY_";

#[derive(Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub postgres: PostgresConfig,
    pub outbox: OutboxConfig,
    pub nats: NatsConfig,
    pub http: HttpConfig,
    pub log: LogConfig,
}

#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PostgresConfig {
    /// libpq-style URL; may hold a password.
    pub url: String,
    pub slot: String,
    pub publication: String,
    /// Create the slot when it is missing (setup and run).
    pub create_slot: bool,
    /// Standby status update interval; at most 1000.
    pub status_interval_ms: u64,
}

impl Default for PostgresConfig {
    fn default() -> Self {
        PostgresConfig {
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            slot: "outbox_relay".into(),
            publication: "outbox_relay".into(),
            create_slot: true,
            status_interval_ms: 1000,
        }
    }
}

/// What to do with an event that cannot be published as it is (DESIGN.md P7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnInvalid {
    /// Publish it to the dead-letter subject with the reason, and go on.
    DeadLetter,
    /// Stop the relay with a clear error; the slot stays before the event.
    Stop,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutboxConfig {
    /// Schema-qualified table name.
    pub table: String,
    pub id_column: String,
    pub aggregate_type_column: String,
    pub aggregate_id_column: String,
    pub event_type_column: String,
    pub payload_column: String,
    /// Optional jsonb object of extra headers; "" for none.
    pub headers_column: String,
    pub on_invalid: OnInvalid,
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
            on_invalid: OnInvalid::DeadLetter,
        }
    }
}

impl OutboxConfig {
    /// (schema, table) of `table`.
    pub fn table_parts(&self) -> (&str, &str) {
        self.table
            .split_once('.')
            .unwrap_or(("public", &self.table))
    }
}

#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// May hold user:password.
    pub url: String,
    /// Path of a NATS credentials file; "" for none.
    pub creds_file: String,
    pub stream: String,
    pub subject: String,
    pub dead_letter_subject: String,
    /// Publishes awaiting their ack.
    pub max_in_flight: usize,
    /// How long to wait for an ack before treating the connection as broken.
    pub ack_timeout_ms: u64,
    /// Duplicate window of a stream that setup creates.
    pub duplicate_window_secs: u64,
    /// Replicas of a stream that setup creates.
    pub stream_replicas: usize,
    /// Fence the stream with `Nats-Expected-Last-Sequence` (see `fence`): commit order and no
    /// duplicates even after lost connections and beyond the duplicate window. Needs the relay to be
    /// the stream's only writer.
    pub fence: bool,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            url: "nats://127.0.0.1:4222".into(),
            creds_file: String::new(),
            stream: "OUTBOX".into(),
            subject: "outbox.{aggregate_type}".into(),
            dead_letter_subject: "outbox_dead_letter".into(),
            max_in_flight: 4096,
            ack_timeout_ms: 10_000,
            duplicate_window_secs: 120,
            stream_replicas: 1,
            fence: true,
        }
    }
}

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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
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
    #[error("config file {path}: {reason}")]
    File { path: String, reason: String },
    #[error("environment variable {var}: {reason}")]
    Env { var: String, reason: String },
    #[error("config {key} (env {env}): {reason}")]
    Invalid {
        key: String,
        env: String,
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
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_with_env(path, std::env::vars())
    }

    /// As [`Config::load`], with the environment given (tests).
    pub fn load_with_env(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
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
                    reason: one_line(&e.to_string()),
                })?
            }
        };
        let file_path = path.map(|p| p.display().to_string());
        apply_env(&mut table, env)?;
        let config: Config = Config::deserialize(toml::Value::Table(table)).map_err(|e| {
            let reason = one_line(&e.to_string());
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
        config.validate()?;
        Ok(config)
    }

    /// Checks every setting that can be checked without connecting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConnInfo::parse(&self.postgres.url).map_err(|e| invalid("postgres.url", e.to_string()))?;
        let slot = &self.postgres.slot;
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
        check_ident("postgres.publication", &self.postgres.publication)?;
        if !(50..=1000).contains(&self.postgres.status_interval_ms) {
            return Err(invalid(
                "postgres.status_interval_ms",
                "must be between 50 and 1000 (status updates at least every second keep the slot alive)",
            ));
        }
        let o = &self.outbox;
        match o.table.split_once('.') {
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
        let n = &self.nats;
        let nats_url = url::Url::parse(&n.url).map_err(|e| {
            invalid(
                "nats.url",
                format!("not a URL ({e}): expected nats://host:4222"),
            )
        })?;
        if !matches!(nats_url.scheme(), "nats" | "tls" | "ws" | "wss") {
            return Err(invalid(
                "nats.url",
                format!(
                    "scheme {:?} is not supported: use nats:// or tls://",
                    nats_url.scheme()
                ),
            ));
        }
        if !n.creds_file.is_empty() && !Path::new(&n.creds_file).is_file() {
            return Err(invalid(
                "nats.creds_file",
                format!("{:?} is not a readable file", n.creds_file),
            ));
        }
        if n.stream.is_empty()
            || n.stream
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c))
        {
            return Err(invalid(
                "nats.stream",
                format!(
                    "{:?} is not a valid stream name: no spaces, '.', '*', '>', '/' or '\\'",
                    n.stream
                ),
            ));
        }
        let template = SubjectTemplate::parse(&n.subject)
            .map_err(|e| invalid("nats.subject", e.to_string()))?;
        crate::route::check_subject(&n.dead_letter_subject)
            .map_err(|e| invalid("nats.dead_letter_subject", e))?;
        if template.matches_literal(&n.dead_letter_subject) {
            return Err(invalid(
                "nats.dead_letter_subject",
                format!(
                    "{:?} is matched by nats.subject {:?}: dead letters would mix with events; pick a subject outside it",
                    n.dead_letter_subject, n.subject
                ),
            ));
        }
        if !(1..=65_536).contains(&n.max_in_flight) {
            return Err(invalid("nats.max_in_flight", "must be between 1 and 65536"));
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
        if !(1..=5).contains(&n.stream_replicas) {
            return Err(invalid("nats.stream_replicas", "must be between 1 and 5"));
        }
        if !self.http.listen.is_empty() && self.http.listen.parse::<SocketAddr>().is_err() {
            return Err(invalid(
                "http.listen",
                format!(
                    "{:?} is not an address like 127.0.0.1:9187 (\"\" disables the listener)",
                    self.http.listen
                ),
            ));
        }
        if tracing_subscriber::EnvFilter::try_new(&self.log.level).is_err() {
            return Err(invalid(
                "log.level",
                format!(
                    "{:?} is not a filter like \"info\" or \"info,outbox_relay=debug\"",
                    self.log.level
                ),
            ));
        }
        Ok(())
    }

    /// The parsed Postgres URL (valid after `validate`).
    pub fn conn_info(&self) -> ConnInfo {
        // validate() parsed it already; fall back to the default URL rather than panic.
        ConnInfo::parse(&self.postgres.url)
            .or_else(|_| ConnInfo::parse(&PostgresConfig::default().url))
            .expect("default postgres url parses")
    }
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

/// Sets `section.key` from every `OUTBOX_RELAY_SECTION_KEY`, typed like the default of that key.
fn apply_env(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(), ConfigError> {
    let defaults = toml::Table::try_from(Config::default()).unwrap_or_default();
    for (var, value) in env {
        let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let rest = rest.to_lowercase();
        let unknown = || ConfigError::Env {
            var: var.clone(),
            reason: "no such setting (see docs/configuration.md for the list)".into(),
        };
        let (section, key) = rest.split_once('_').ok_or_else(unknown)?;
        let default = defaults
            .get(section)
            .and_then(|s| s.as_table())
            .and_then(|s| s.get(key))
            .ok_or_else(unknown)?;
        let typed = match default {
            toml::Value::Integer(_) => {
                toml::Value::Integer(value.trim().parse().map_err(|_| ConfigError::Env {
                    var: var.clone(),
                    reason: format!("{value:?} is not a whole number"),
                })?)
            }
            toml::Value::Boolean(_) => toml::Value::Boolean(match value.trim() {
                "true" | "1" | "yes" | "on" => true,
                "false" | "0" | "no" | "off" => false,
                _ => {
                    return Err(ConfigError::Env {
                        var: var.clone(),
                        reason: format!("{value:?} is not true or false"),
                    });
                }
            }),
            _ => toml::Value::String(value),
        };
        let section_table = table
            .entry(section.to_owned())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        match section_table {
            toml::Value::Table(t) => {
                t.insert(key.to_owned(), typed);
            }
            _ => {
                return Err(ConfigError::Env {
                    var: var.clone(),
                    reason: format!("the config file's {section} is not a table"),
                });
            }
        }
    }
    Ok(())
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `scheme://user:***@host…`: a URL with its password hidden, for logs and `status`.
pub fn redact_url(raw: &str) -> String {
    match url::Url::parse(raw) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        Ok(u) => u.to_string(),
        Err(_) => "<unparsable url>".into(),
    }
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &redact_url(&self.url))
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("create_slot", &self.create_slot)
            .field("status_interval_ms", &self.status_interval_ms)
            .finish()
    }
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &redact_url(&self.url))
            .field("creds_file", &self.creds_file)
            .field("stream", &self.stream)
            .field("subject", &self.subject)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("max_in_flight", &self.max_in_flight)
            .field("ack_timeout_ms", &self.ack_timeout_ms)
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("postgres", &self.postgres)
            .field("outbox", &self.outbox)
            .field("nats", &self.nats)
            .field("http", &self.http)
            .field("log", &self.log)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn load(toml_text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
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
        assert_eq!(c.postgres.slot, "outbox_relay");
        assert_eq!(c.outbox.table, "public.outbox");
        assert_eq!(c.nats.subject, "outbox.{aggregate_type}");
        assert_eq!(c.nats.dead_letter_subject, "outbox_dead_letter");
        assert_eq!(c.http.listen, "127.0.0.1:9187");
        assert_eq!(c.outbox.on_invalid, OnInvalid::DeadLetter);
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
        assert_eq!(c.postgres.slot, "from_env");
        assert_eq!(c.nats.max_in_flight, 20);
        assert!(!c.postgres.create_slot);
    }

    #[test]
    fn unknown_keys_are_errors_naming_them() {
        let e = load("[postgres]\nslto = \"x\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("slto"), "{e}");
        let e = load("[postgress]\n", &[]).unwrap_err().to_string();
        assert!(e.contains("postgress"), "{e}");
        let e = load("", &[("OUTBOX_RELAY_NATS_STREEM", "x")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("OUTBOX_RELAY_NATS_STREEM"), "{e}");
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
}
