//! The environment layer: `OUTBOX_RELAY_<SECTION>_<KEY>` variables override the file, typed like the
//! key's default; and the one-line, secret-free error texts of the loading steps.
//!
//! A variable that names no setting does not stop the relay: Kubernetes injects
//! `OUTBOX_RELAY_SERVICE_HOST` and friends for a Service named `outbox-relay`. A near miss of a real
//! key (`OUTBOX_RELAY_NATS_STREEM`) is most likely a typo, so it comes back as a warning to log.

use super::{Config, ConfigError, ENV_PREFIX};
use crate::text::single_spaced;
use crate::warning::Warning;

/// What the environment did: warnings for variables that look like a misspelt setting, and the
/// keys it set (`section.key`, the variable), in the order met.
#[derive(Default)]
pub(super) struct Applied {
    pub(super) warnings: Vec<Warning>,
    pub(super) keys: Vec<(String, String)>,
}

/// Sets `section.key` from every `OUTBOX_RELAY_SECTION_KEY`. The settings are not listed by hand:
/// `Config::default()`'s table is the list, and each key's default gives its variable's type.
pub(super) fn apply_env(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Applied, ConfigError> {
    let defaults = toml::Table::try_from(Config::default()).unwrap_or_default();
    let mut applied = Applied::default();
    for (var, value) in env {
        let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let rest = rest.to_lowercase();
        // A top-level key (`OUTBOX_RELAY_NAME`): a string, set as it is.
        if defaults.get(&rest).is_some_and(|d| d.is_str()) {
            applied.keys.push((rest.clone(), var.clone()));
            table.insert(rest, toml::Value::String(value));
            continue;
        }
        let default = rest.split_once('_').and_then(|(section, key)| {
            let d = defaults.get(section)?.as_table()?.get(key)?;
            Some((section, key, d))
        });
        let Some((section, key, default)) = default else {
            if let Some(near) = near_miss(&defaults, &rest) {
                applied.warnings.push(Warning::new(
                    "unknown-variable",
                    format!("environment variable {var} names no setting; did you mean {near}?"),
                ));
            }
            continue;
        };
        let env_error = |reason: String| ConfigError::Env {
            var: var.clone(),
            reason,
        };
        let typed = typed_like(default, &value).map_err(env_error)?;
        check_alone(section, key, &typed).map_err(env_error)?;
        set_in_section(table, section, key, typed).map_err(env_error)?;
        applied.keys.push((format!("{section}.{key}"), var.clone()));
    }
    Ok(applied)
}

/// `value` typed like the key's `default`: a whole number, a yes/no word, a comma-separated list
/// (`OUTBOX_RELAY_OUTBOX_HEADER_COLUMNS=tenant_id,trace_id`), or else a string as it is. The
/// error is the reason, for the variable's one-line error.
fn typed_like(default: &toml::Value, value: &str) -> Result<toml::Value, String> {
    Ok(match default {
        toml::Value::Integer(_) => toml::Value::Integer(
            value
                .trim()
                .parse()
                .map_err(|_| format!("{value:?} is not a whole number"))?,
        ),
        toml::Value::Boolean(_) => {
            toml::Value::Boolean(match value.trim().to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => true,
                "false" | "0" | "no" | "off" => false,
                _ => return Err(format!("{value:?} is not true or false")),
            })
        }
        toml::Value::Array(_) => toml::Value::Array(
            value
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| toml::Value::String(s.to_owned()))
                .collect(),
        ),
        _ => toml::Value::String(value.to_owned()),
    })
}

/// Checks the value alone, so a bad enum word names this variable, not the file.
fn check_alone(section: &str, key: &str, typed: &toml::Value) -> Result<(), String> {
    let mut alone = toml::Table::new();
    let mut sect = toml::Table::new();
    sect.insert(key.to_owned(), typed.clone());
    alone.insert(section.to_owned(), toml::Value::Table(sect));
    Config::deserialize_table(alone)
        .map(drop)
        .map_err(|e| single_spaced(e.message()))
}

/// Sets `section.key` in the file's table, making the section when the file has none.
fn set_in_section(
    table: &mut toml::Table,
    section: &str,
    key: &str,
    typed: toml::Value,
) -> Result<(), String> {
    let section_table = table
        .entry(section.to_owned())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    match section_table {
        toml::Value::Table(t) => {
            t.insert(key.to_owned(), typed);
            Ok(())
        }
        _ => Err(format!("the config file's {section} is not a table")),
    }
}

/// The variable of the real setting closest to `rest` (`section_key`, lower case), when it is close.
fn near_miss(defaults: &toml::Table, rest: &str) -> Option<String> {
    defaults
        .iter()
        .filter_map(|(section, keys)| Some((section, keys.as_table()?)))
        .flat_map(|(section, keys)| keys.keys().map(move |k| format!("{section}_{k}")))
        .map(|name| (strsim::levenshtein(&name, rest), name))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, name)| format!("{ENV_PREFIX}{}", name.to_uppercase()))
}

impl Config {
    fn deserialize_table(t: toml::Table) -> Result<Config, toml::de::Error> {
        serde::Deserialize::deserialize(toml::Value::Table(t))
    }
}

/// A TOML syntax error as one line with its position, without the offending source line: the line
/// may hold a password.
pub(super) fn toml_error(e: &toml::de::Error, text: &str) -> String {
    let message = single_spaced(e.message());
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("line {line}, column {column}: {message}")
        }
        None => message,
    }
}

/// `scheme://***@host…`: a URL with its user name, password or token hidden, for logs and `status`.
/// A list of URLs (`nats://a,nats://b`) is redacted item by item.
pub(crate) fn redact_url(raw: &str) -> String {
    if raw.contains(',') && raw.contains("://") {
        return raw
            .split(',')
            .map(|u| redact_url(u.trim()))
            .collect::<Vec<_>>()
            .join(",");
    }
    match url::Url::parse(raw) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            let nats = matches!(u.scheme(), "nats" | "tls" | "ws" | "wss");
            if nats && !u.username().is_empty() && u.password().is_none() {
                // A lone user name in a NATS URL is a token.
                let _ = u.set_username("***");
            }
            u.to_string()
        }
        Err(_) => "<unparsable url>".into(),
    }
}
