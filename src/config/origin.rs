//! Where the settings came from, so that what the relay prints points back to it: every command it
//! offers (`setup`, `run`, `backfill`, `status`) carries the `--config` file it was run with, and
//! says which keys came from `OUTBOX_RELAY_*` variables (by name, never by value), because a
//! command copied without them would run against the default table, slot and stream. And an error
//! about a key (a refused password) names the place the key was set: the variable, or the file.

use std::path::PathBuf;

use super::{ENV_PREFIX, Settings};

/// The `--config` file and the variables that set keys.
#[derive(Clone, Debug, Default)]
pub(crate) struct Origin {
    /// The `--config` file, as an absolute path (a relative one means nothing in another
    /// directory, e.g. a log read elsewhere).
    pub(crate) file: Option<PathBuf>,
    /// The keys set by variables: (`section.key`, `OUTBOX_RELAY_SECTION_KEY`).
    pub(crate) env: Vec<(String, String)>,
}

impl Settings {
    /// A command to run against these same settings, for an operator to copy: in backticks,
    /// `outbox-relay --config FILE ARGS`, then, when variables set keys, which ones (their values
    /// may be secrets and are never shown).
    pub fn command(&self, args: &str) -> String {
        let mut out = String::from("`outbox-relay ");
        if let Some(file) = &self.origin.file {
            out.push_str(&format!(
                "--config {} ",
                shell_word(&file.display().to_string())
            ));
        }
        out.push_str(args);
        out.push('`');
        if !self.origin.env.is_empty() {
            let vars: Vec<&str> = self.origin.env.iter().map(|(_, v)| v.as_str()).collect();
            out.push_str(&format!(
                " (with {} set as for this command)",
                vars.join(", ")
            ));
        }
        out
    }

    /// Where `key` (`section.key`) was set: its variable, the file, or nowhere (its default).
    pub(crate) fn key_source(&self, key: &str) -> String {
        if let Some((_, var)) = self.origin.env.iter().rev().find(|(k, _)| k == key) {
            return format!("{var}, which sets {key}");
        }
        match &self.origin.file {
            Some(file) => format!("{key} in {}", file.display()),
            None => format!(
                "{key} (not set: its default; set it in the --config file or in {ENV_PREFIX}{})",
                key.replace('.', "_").to_uppercase()
            ),
        }
    }
}

/// `s` as one word for a POSIX shell: as it is when it is plain, else in single quotes.
fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+:@%".contains(&b))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn a_command_carries_the_file_and_names_the_variables() {
        let mut s = Config::default().validate().unwrap();
        assert_eq!(s.command("setup"), "`outbox-relay setup`");
        s.origin.file = Some("/etc/outbox relay/relay.toml".into());
        s.origin.env = vec![
            ("postgres.url".into(), "OUTBOX_RELAY_POSTGRES_URL".into()),
            ("name".into(), "OUTBOX_RELAY_NAME".into()),
        ];
        assert_eq!(
            s.command("backfill --replace-slot"),
            "`outbox-relay --config '/etc/outbox relay/relay.toml' backfill --replace-slot` (with \
             OUTBOX_RELAY_POSTGRES_URL, OUTBOX_RELAY_NAME set as for this command)"
        );
        assert_eq!(
            s.key_source("postgres.url"),
            "OUTBOX_RELAY_POSTGRES_URL, which sets postgres.url"
        );
        assert_eq!(
            s.key_source("nats.url"),
            "nats.url in /etc/outbox relay/relay.toml"
        );
        s.origin = Origin::default();
        assert!(
            s.key_source("postgres.url")
                .contains("set it in the --config file or in OUTBOX_RELAY_POSTGRES_URL"),
            "{}",
            s.key_source("postgres.url")
        );
        assert_eq!(shell_word("relay.toml"), "relay.toml");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
    }

    #[test]
    fn loading_remembers_the_file_and_the_variables_that_set_keys() {
        let s = Config::load_with_env(
            None,
            [
                ("OUTBOX_RELAY_NATS_STREAM".to_owned(), "X".to_owned()),
                (
                    "OUTBOX_RELAY_SERVICE_HOST".to_owned(),
                    "10.0.0.1".to_owned(),
                ),
            ],
        )
        .unwrap();
        assert_eq!(
            s.origin.env,
            [(
                "nats.stream".to_owned(),
                "OUTBOX_RELAY_NATS_STREAM".to_owned()
            )]
        );
        assert!(s.origin.file.is_none());
    }
}
