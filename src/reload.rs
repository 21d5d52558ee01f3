//! SIGHUP: re-read the configuration, apply what can change in a running relay, and name what needs
//! a restart. Nothing here ever stops the relay: a file that no longer loads is reported and the
//! running settings stay.
//!
//! What can be applied lives in [`Hook`]s, one per concern, each naming the keys it takes over
//! (`log.level` for the log filter, `outbox.schemas` for the schema directory); a later concern
//! adds a hook and its keys without touching the comparison. A hook whose keys name something
//! outside the file (a directory's files) also applies when that changed ([`Hook::outside_changed`]). Every other key that changed is reported as
//! needing a restart, by name only: values may hold passwords.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use crate::config::{Config, Settings};
use crate::schema::{SchemaMetrics, Schemas};

/// Every key a running relay applies on SIGHUP: the keys of the hooks `run` registers (a test in
/// main.rs holds them to this list) and the "applied" rows of docs/configuration.md's table "What
/// SIGHUP reloads" (a test here holds that table to this list and to every key there is).
pub const RELOADED_KEYS: &[&str] = &["log.level", "outbox.schemas", "outbox.schemas_required"];

/// Why a hook could not apply new settings: the hook's own error (a log filter that does not parse,
/// a schema file that does not load), printed as one line in the reload's log line. Boxed because
/// each hook has its own; nothing branches on it.
pub type HookError = Box<dyn std::error::Error + Send + Sync>;

/// Something a running relay can change on SIGHUP.
pub trait Hook: Send {
    /// The configuration keys (`section.key`) this hook applies.
    fn keys(&self) -> &'static [&'static str];
    /// Applies the new settings; called only when one of [`Hook::keys`] changed. An `Err` says in
    /// one line why they could not be applied (the old value stays in force).
    fn apply(&mut self, new: &Settings) -> Result<(), HookError>;
    /// Whether what the keys name outside the configuration (the files of a directory) changed
    /// since the hook last applied: then it applies although none of its keys changed, and is
    /// reported under its first key.
    fn outside_changed(&self, _new: &Settings) -> bool {
        false
    }
}

/// The configuration a relay runs with, and the hooks that can change it.
pub struct Reloader {
    path: Option<PathBuf>,
    /// The values in force, by `section.key`: what the process started with, plus what hooks
    /// applied since.
    running: BTreeMap<String, toml::Value>,
    hooks: Vec<Box<dyn Hook>>,
}

/// What one reload did, for its log line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reloaded {
    /// Keys whose new values are in force now.
    pub(crate) applied: Vec<String>,
    /// Keys that differ from the running values and take effect only after a restart.
    pub(crate) needs_restart: Vec<String>,
    /// Keys a hook could not apply, with its reason.
    pub(crate) failed: Vec<(String, String)>,
}

impl Reloader {
    /// A reloader for a relay started with `settings`, loaded from `path` (and the environment).
    pub fn new(path: Option<PathBuf>, settings: &Settings) -> Reloader {
        Reloader {
            path,
            running: flatten(settings.config()),
            hooks: Vec::new(),
        }
    }

    /// Adds a hook; its keys are applied on reload instead of being reported as needing a restart.
    pub fn add(&mut self, hook: Box<dyn Hook>) {
        self.hooks.push(hook);
    }

    /// Loads the configuration again, as at start (the file, then `OUTBOX_RELAY_*`), and applies
    /// what changed. An error when the configuration no longer loads; nothing changes then.
    pub fn reload(&mut self) -> Result<Reloaded, crate::config::ConfigError> {
        let new = Config::load(self.path.as_deref())?;
        Ok(self.apply(&new))
    }

    /// [`Reloader::reload`] with the new settings given.
    pub(crate) fn apply(&mut self, new: &Settings) -> Reloaded {
        let fresh = flatten(new.config());
        let changed: Vec<String> = fresh
            .iter()
            .filter(|(k, v)| self.running.get(*k) != Some(v))
            .map(|(k, _)| k.clone())
            .chain(
                self.running
                    .keys()
                    .filter(|k| !fresh.contains_key(*k))
                    .cloned(),
            )
            .collect();
        let mut out = Reloaded::default();
        let mut taken = Vec::new();
        for hook in &mut self.hooks {
            let mut mine: Vec<String> = changed
                .iter()
                .filter(|k| hook.keys().contains(&k.as_str()))
                .cloned()
                .collect();
            if mine.is_empty() {
                // Its keys are as they were, but what they name may not be.
                match hook.keys().first() {
                    Some(first) if hook.outside_changed(new) => mine.push((*first).to_owned()),
                    _ => continue,
                }
            }
            taken.extend(mine.iter().cloned());
            match hook.apply(new) {
                Ok(()) => {
                    for k in mine {
                        match fresh.get(&k) {
                            Some(v) => self.running.insert(k.clone(), v.clone()),
                            None => self.running.remove(&k),
                        };
                        out.applied.push(k);
                    }
                }
                Err(why) => {
                    let why = why.to_string();
                    out.failed
                        .extend(mine.into_iter().map(|k| (k, why.clone())));
                }
            }
        }
        out.needs_restart = changed.into_iter().filter(|k| !taken.contains(k)).collect();
        out
    }
}

/// SIGHUP's reload hook for `outbox.schemas` and `outbox.schemas_required`. The new settings
/// carry the directory loaded anew ([`crate::config::Config::validate`]); this puts that set in
/// force as a whole, or, when it did not load, keeps the running set and says why (the file and
/// the problem). It applies when a key changed or when the directory's files did.
pub struct SchemasHook {
    running: Schemas,
    metrics: Arc<SchemaMetrics>,
}

impl SchemasHook {
    /// The keys it applies.
    pub const KEYS: &'static [&'static str] = &["outbox.schemas", "outbox.schemas_required"];

    /// A hook replacing the set of `running`, counting into `metrics`.
    pub fn new(running: &Schemas, metrics: Arc<SchemaMetrics>) -> SchemasHook {
        SchemasHook {
            running: running.clone(),
            metrics,
        }
    }
}

impl Hook for SchemasHook {
    fn keys(&self) -> &'static [&'static str] {
        Self::KEYS
    }

    fn outside_changed(&self, new: &Settings) -> bool {
        new.schemas_error.is_some() || !new.schemas.current().same_as(&self.running.current())
    }

    fn apply(&mut self, new: &Settings) -> Result<(), HookError> {
        if let Some(e) = &new.schemas_error {
            self.metrics.reload_failures.inc();
            return Err(e.to_string().into());
        }
        let set = new.schemas.current();
        self.metrics.loaded.set(set.len() as u64);
        self.metrics.reloads.inc();
        self.running.replace(set);
        Ok(())
    }
}

impl fmt::Display for Reloaded {
    /// `applied log.level; needs a restart: nats.url, postgres.slot` (or `nothing changed`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if !self.applied.is_empty() {
            parts.push(format!("applied {}", self.applied.join(", ")));
        }
        for (k, why) in &self.failed {
            parts.push(format!("could not apply {k} ({why}); the old value stays"));
        }
        if !self.needs_restart.is_empty() {
            parts.push(format!(
                "changed but needs a restart: {}",
                self.needs_restart.join(", ")
            ));
        }
        if parts.is_empty() {
            parts.push("nothing changed".to_owned());
        }
        f.write_str(&parts.join("; "))
    }
}

/// Every key of `config` as `section.key` → value.
fn flatten(config: &Config) -> BTreeMap<String, toml::Value> {
    let mut out = BTreeMap::new();
    // Config serialises to a table of tables; a failure would be a bug, and then nothing counts
    // as changed rather than everything.
    if let Ok(toml::Value::Table(sections)) = toml::Value::try_from(config) {
        for (section, value) in sections {
            match value {
                toml::Value::Table(keys) => {
                    for (key, v) in keys {
                        out.insert(format!("{section}.{key}"), v);
                    }
                }
                other => {
                    out.insert(section, other);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One answer per key: docs/configuration.md's table "What SIGHUP reloads" names every key of
    /// the configuration, and says "applied" for exactly [`RELOADED_KEYS`].
    #[test]
    fn the_sighup_table_names_every_key_and_exactly_the_reloaded_ones() {
        let doc = include_str!("../docs/configuration.md");
        let section = doc
            .split("\n## What SIGHUP reloads\n")
            .nth(1)
            .expect("docs/configuration.md has a section \"What SIGHUP reloads\"");
        let section = section.split("\n## ").next().unwrap_or(section);
        let mut rows = BTreeMap::new();
        for line in section.lines() {
            let Some(rest) = line.strip_prefix("| `") else {
                continue;
            };
            let (key, rest) = rest.split_once('`').expect("a key in backquotes");
            let cell = rest.split('|').nth(1).expect("an 'on SIGHUP' cell").trim();
            assert!(
                rows.insert(key.to_owned(), cell.to_owned()).is_none(),
                "{key} appears twice"
            );
        }
        for key in flatten(&Config::default()).keys() {
            assert!(
                rows.contains_key(key),
                "docs/configuration.md's SIGHUP table does not say what SIGHUP does with {key}"
            );
        }
        for (key, cell) in &rows {
            assert!(
                cell == "applied" || cell == "restart",
                "{key}: the cell says {cell:?}, not applied or restart"
            );
            assert_eq!(
                cell == "applied",
                RELOADED_KEYS.contains(&key.as_str()),
                "{key}: the table says {cell}, the code {}",
                if RELOADED_KEYS.contains(&key.as_str()) {
                    "applies it"
                } else {
                    "needs a restart"
                }
            );
        }
    }

    struct Level(Vec<String>);

    impl Hook for Level {
        fn keys(&self) -> &'static [&'static str] {
            &["log.level"]
        }
        fn apply(&mut self, new: &Settings) -> Result<(), HookError> {
            self.0.push(new.config().log.level.clone());
            Ok(())
        }
    }

    fn settings(edit: impl FnOnce(&mut Config)) -> Settings {
        let mut c = Config::default();
        edit(&mut c);
        c.validate().expect("valid")
    }

    #[test]
    fn hooks_apply_their_keys_and_the_rest_needs_a_restart() {
        let mut r = Reloader::new(None, &settings(|_| {}));
        r.add(Box::new(Level(Vec::new())));
        let new = settings(|c| {
            c.log.level = "debug".into();
            c.nats.max_in_flight = 7;
            c.postgres.url = "postgres://u:secret@db/x".into();
        });
        let done = r.apply(&new);
        assert_eq!(done.applied, ["log.level"]);
        assert_eq!(done.needs_restart, ["nats.max_in_flight", "postgres.url"]);
        let line = done.to_string();
        assert!(!line.contains("secret"), "{line}");
        // Applied keys are in force now; the others still differ from what runs.
        let again = r.apply(&new);
        assert!(again.applied.is_empty());
        assert_eq!(again.needs_restart, ["nats.max_in_flight", "postgres.url"]);
    }

    /// A hook whose keys name something outside the file that changed.
    struct Outside(bool, u32);

    impl Hook for Outside {
        fn keys(&self) -> &'static [&'static str] {
            &["outbox.schemas", "outbox.schemas_required"]
        }
        fn outside_changed(&self, _: &Settings) -> bool {
            self.0
        }
        fn apply(&mut self, _: &Settings) -> Result<(), HookError> {
            self.1 += 1;
            Err("x.json: is not JSON".into())
        }
    }

    #[test]
    fn a_hook_applies_when_what_its_keys_name_changed() {
        let s = settings(|_| {});
        let mut r = Reloader::new(None, &s);
        r.add(Box::new(Outside(false, 0)));
        assert_eq!(r.apply(&s).to_string(), "nothing changed");
        let mut r = Reloader::new(None, &s);
        r.add(Box::new(Outside(true, 0)));
        assert_eq!(
            r.apply(&s).to_string(),
            "could not apply outbox.schemas (x.json: is not JSON); the old value stays"
        );
    }

    #[test]
    fn an_unchanged_file_says_so() {
        let s = settings(|_| {});
        let mut r = Reloader::new(None, &s);
        assert_eq!(r.apply(&s).to_string(), "nothing changed");
    }
}
