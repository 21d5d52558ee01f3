//! Configuration: TOML file, environment overrides, defaults, validation (docs/configuration.md).
//!
//! Layering: defaults < `--config FILE` < `OUTBOX_RELAY_<SECTION>_<KEY>` environment variables.
//! Unknown keys in the file are errors: a typo must not silently fall back to a default. A variable
//! that names no setting is ignored (Kubernetes injects `OUTBOX_RELAY_SERVICE_HOST` and the like),
//! with a warning when it looks like a misspelt key (`env.rs`). Every error is one line naming the
//! key (and its environment variable) and how to fix it.
//! URLs may carry passwords: `Debug` of this module's types never shows them.
//!
//! Layout: this file loads ([`Config::load`]: the file, then `env.rs`, then `name.rs`, then
//! validation); `sections.rs` holds the tables, their keys and defaults; `settings.rs` validates them
//! into [`Settings`], with `nats.rs` parsing the `[nats]` connection and `reply_prefixes.rs` checking
//! where the position service may answer; `origin.rs` remembers where the settings came from, for
//! the commands the relay prints; `error.rs` is [`ConfigError`]. The unit tests of the whole path
//! are in `tests.rs`.

use std::path::Path;

use serde::Deserialize;

mod env;
mod error;
mod name;
mod nats;
mod origin;
mod reply_prefixes;
mod sections;
mod settings;
#[cfg(test)]
mod tests;

pub(crate) use env::redact_url;
pub use error::ConfigError;
// `super::invalid` for the files beside this one.
use error::invalid;
pub(crate) use nats::NatsAuth;
pub(crate) use reply_prefixes::{MAX_PREFIX_BYTES, SHARED_INBOX_PREFIX};
pub use sections::{
    Config, HttpConfig, LogConfig, LogFormat, NatsConfig, OnInvalid, OutboxConfig, ParkKey,
    PostgresConfig, StatusConfig, TelemetryConfig, WarningsConfig,
};
pub use settings::Settings;

/// The logical message prefix sql/06_outbox_message.sql's helper emits by default, and so the
/// default `outbox.message_prefix`: "" is the explicit opt-out.
pub const DEFAULT_MESSAGE_PREFIX: &str = "outbox";

/// Prefix of the environment variables that override settings.
pub(crate) const ENV_PREFIX: &str = "OUTBOX_RELAY_";

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
        let applied = env::apply_env(&mut table, env)?;
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
        settings.warnings = applied.warnings;
        settings.origin = origin::Origin {
            file: path.map(|p| std::path::absolute(p).unwrap_or_else(|_| p.to_owned())),
            env: applied.keys,
        };
        Ok(settings)
    }
}
