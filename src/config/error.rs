//! [`ConfigError`]: a setting that cannot be used, in one line naming the file, the variable or the
//! key (with the variable that sets it) and the fix.

use super::ENV_PREFIX;

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

pub(super) fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        env: format!("{ENV_PREFIX}{}", key.replace('.', "_").to_uppercase()),
        reason: reason.into(),
    }
}
