//! Event contracts (`outbox.schemas`): a directory of JSON Schema files named `<event_type>.json`,
//! compiled once per load, and the check every event's payload passes before it is published.
//!
//! A [`SchemaSet`] is one load of the directory: every `*.json` file parsed and compiled as draft
//! 2020-12 into a validator, all or nothing. A `$ref` to another file of the directory is resolved
//! by its last path segment (`common.json`, `https://example.com/schemas/common.json#/$defs/amount`
//! and a relative ref from a schema without `$id` all name the file `common.json`); nothing is ever
//! fetched from the network or read from outside the directory. A file that is not JSON, a schema
//! that does not compile and a `$ref` that names no file of the directory fail the whole load,
//! with the file and the problem in one line ([`LoadError`]).
//!
//! [`Schemas`] is the set in force, shared by every stage of the process and replaced as a whole
//! on SIGHUP: a stage's [`SchemaReader`] notices a new set by one atomic load per event and takes
//! it before its next event, so an event is never checked against half of two loads.
//!
//! The check ([`SchemaSet::check`]) parses the payload only when its event type has a schema: with
//! `outbox.schemas = ""` or for a type without a schema nothing is parsed. It answers with the
//! schema's `$id` (for `ce-dataschema`) or with a one-line reason naming the event type, the JSON
//! pointer of the first failing value and the failing keyword, which becomes the dead letter's
//! `Outbox-Error`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use serde_json::Value;

use crate::text::shortened;

mod budget;
pub use budget::PendingCheck;
#[cfg(feature = "test-support")]
pub use budget::check_on_the_calling_thread;
pub(crate) use budget::{BUDGET, INLINE_BYTES};

/// How much of a validator's message a reason keeps: a message may quote the whole failing value.
const MAX_MESSAGE: usize = 200;

/// Why a schema directory cannot be loaded: the file (or the directory) and the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {problem}", file.display())]
pub(crate) struct LoadError {
    /// The file at fault, or the directory when it cannot be read.
    pub(crate) file: PathBuf,
    /// What is wrong, in one line.
    pub(crate) problem: String,
}

/// One event type's contract.
struct Contract {
    validator: jsonschema::Validator,
    /// The schema's `$id`, the `ce-dataschema` of events that pass it.
    id: Option<Arc<str>>,
}

/// One load of the schema directory, compiled; never changed after.
#[derive(Default)]
pub(crate) struct SchemaSet {
    /// The directory, as configured; empty when validation is off.
    dir: String,
    by_type: HashMap<String, Contract>,
    /// `outbox.schemas_required`: a type without a schema fails.
    required: bool,
    /// A hash of the directory's schema files (names and bytes), with `dir` and `required`: a reload
    /// that finds the same is no change.
    fingerprint: u64,
}

impl fmt::Debug for SchemaSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SchemaSet")
            .field("dir", &self.dir)
            .field("schemas", &self.by_type.len())
            .field("required", &self.required)
            .finish()
    }
}

/// What the check says about one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The payload validates; the schema's `$id`, if it has one.
    Pass(Option<Arc<str>>),
    /// No schema for the type, and none is required: published unchecked.
    NoSchema,
    /// The reason the event is a dead letter.
    Fail(String),
}

impl SchemaSet {
    /// Loads and compiles every `*.json` file of `dir` (`""`: validation off, an empty set).
    /// `required` is `outbox.schemas_required`.
    pub(crate) fn load(dir: &str, required: bool) -> Result<SchemaSet, LoadError> {
        if dir.is_empty() {
            return Ok(SchemaSet {
                required,
                fingerprint: fingerprint(dir, required, &BTreeMap::new()),
                ..SchemaSet::default()
            });
        }
        let path = Path::new(dir);
        let unreadable = |e: std::io::Error| LoadError {
            file: path.to_owned(),
            problem: format!("cannot read the directory ({e})"),
        };
        // Every file first, so a $ref can name any of them.
        let mut files: BTreeMap<String, Value> = BTreeMap::new();
        let mut texts: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for entry in std::fs::read_dir(path).map_err(unreadable)? {
            let entry = entry.map_err(unreadable)?;
            let name = entry.file_name().to_string_lossy().into_owned();
            // Only the directory's own JSON files: editors' backups and hidden files are not schemas.
            if !name.ends_with(".json") || name.starts_with('.') || name == ".json" {
                continue;
            }
            let file = entry.path();
            if !file.is_file() {
                continue;
            }
            let text = std::fs::read(&file).map_err(|e| LoadError {
                file: file.clone(),
                problem: format!("cannot be read ({e})"),
            })?;
            let value: Value = serde_json::from_slice(&text).map_err(|e| LoadError {
                file: file.clone(),
                problem: format!("is not JSON ({e})"),
            })?;
            if !value.is_object() && !value.is_boolean() {
                return Err(LoadError {
                    file,
                    problem: "is not a JSON Schema (an object or a boolean)".into(),
                });
            }
            texts.insert(name.clone(), text);
            files.insert(name, value);
        }
        let files = Arc::new(files);
        let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
        let mut by_type = HashMap::with_capacity(files.len());
        for (name, schema) in files.iter() {
            let file = path.join(name);
            // A schema without `$id` gets its file's URI as its base, so a relative `$ref` resolves
            // to a sibling file, which the retriever finds by name.
            let base = url::Url::from_file_path(absolute.join(name))
                .map(String::from)
                .unwrap_or_else(|()| format!("file:///{name}"));
            let validator = jsonschema::draft202012::options()
                .with_pattern_options(jsonschema::PatternOptions::regex())
                .with_retriever(Directory(Arc::clone(&files)))
                .with_base_uri(base)
                .build(schema)
                .map_err(|e| LoadError {
                    file: file.clone(),
                    problem: build_problem(&e),
                })?;
            let id = schema
                .get("$id")
                .and_then(Value::as_str)
                .map(Arc::<str>::from);
            let event_type = name.trim_end_matches(".json").to_owned();
            by_type.insert(event_type, Contract { validator, id });
        }
        Ok(SchemaSet {
            dir: dir.to_owned(),
            by_type,
            required,
            fingerprint: fingerprint(dir, required, &texts),
        })
    }

    /// Whether `other` was loaded from the same files with the same settings.
    pub(crate) fn same_as(&self, other: &SchemaSet) -> bool {
        self.fingerprint == other.fingerprint
    }

    /// The directory (empty when validation is off).
    pub(crate) fn dir(&self) -> &str {
        &self.dir
    }

    /// How many schemas the set holds.
    pub(crate) fn len(&self) -> usize {
        self.by_type.len()
    }

    /// The set holds no schema (for the tests: the relay asks [`SchemaSet::len`] for its log line).
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.by_type.is_empty()
    }

    /// Whether events are checked at all: a schema directory is set or schemas are required. When
    /// not, the stage never calls [`SchemaSet::check`].
    pub(crate) fn active(&self) -> bool {
        !self.dir.is_empty() || self.required
    }

    /// Checks `payload` (the bytes as published) of an event of type `event_type`. `bytea` says the
    /// payload column is bytea (raw bytes, which must hold JSON to validate).
    pub(crate) fn check(&self, event_type: &str, payload: &[u8], bytea: bool) -> Verdict {
        let Some(contract) = self.by_type.get(event_type) else {
            return if self.required {
                Verdict::Fail(format!(
                    "{event_type}: no schema {event_type}.json in {} and outbox.schemas_required is on",
                    self.dir_shown()
                ))
            } else {
                Verdict::NoSchema
            };
        };
        let value: Value = match serde_json::from_slice(payload) {
            Ok(v) => v,
            Err(e) => {
                let what = if bytea { "bytea payload" } else { "payload" };
                return Verdict::Fail(if payload.is_empty() {
                    format!("{event_type}: the {what} is empty (NULL?), not JSON")
                } else {
                    format!("{event_type}: the {what} is not JSON ({e})")
                });
            }
        };
        // is_valid is the fast path; the error (and its message) is built only for a failure.
        if contract.validator.is_valid(&value) {
            return Verdict::Pass(contract.id.clone());
        }
        match contract.validator.validate(&value) {
            Ok(()) => Verdict::Pass(contract.id.clone()),
            Err(e) => {
                let pointer = e.instance_path().as_str();
                let pointer = if pointer.is_empty() {
                    "(root)"
                } else {
                    pointer
                };
                Verdict::Fail(format!(
                    "{event_type}: {pointer}: {} ({})",
                    shortened(&crate::text::one_line(&e.to_string()), MAX_MESSAGE),
                    e.kind().keyword()
                ))
            }
        }
    }

    /// Whether `event_type` has a schema of its own in this set.
    pub(crate) fn has_schema_for(&self, event_type: &str) -> bool {
        self.by_type.contains_key(event_type)
    }

    fn dir_shown(&self) -> &str {
        if self.dir.is_empty() {
            "outbox.schemas (not set)"
        } else {
            &self.dir
        }
    }
}

/// What a schema that does not compile gets wrong, in one line. A `pattern` (or a
/// `patternProperties` key) the `regex` engine refuses is named with where it is and why: patterns
/// must match in time linear in the payload, so lookaround and backreferences, which need a
/// backtracking engine, are refused when the schemas load rather than stalling the relay on a payload.
fn build_problem(e: &jsonschema::ValidationError<'_>) -> String {
    if let jsonschema::error::ValidationErrorKind::Format { format } = e.kind()
        && format == "regex"
        && let Value::String(pattern) = e.instance().as_ref()
    {
        let at = e.instance_path().as_str();
        let at = if at.is_empty() { "(root)" } else { at };
        return format!(
            "{at}: pattern {} is refused: patterns must match in linear time, so lookaround ((?=, (?!, (?<=, \
             (?<!) and backreferences (\\1, \\k<name>) are not supported, nor is a pattern that does not compile; \
             rewrite it without them",
            shortened(&format!("{pattern:?}"), MAX_MESSAGE)
        );
    }
    crate::text::one_line(&e.to_string())
}

/// Resolves a `$ref` outside the schema itself to a file of the directory, by the URI's last path
/// segment; anything else is refused, never fetched.
struct Directory(Arc<BTreeMap<String, Value>>);

impl jsonschema::Retrieve for Directory {
    fn retrieve(
        &self,
        uri: &jsonschema::Uri<String>,
    ) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
        let path = uri.path().as_str();
        let last = path.rsplit('/').next().unwrap_or(path);
        let name = percent_encoding::percent_decode_str(last).decode_utf8_lossy();
        match self.0.get(name.as_ref()) {
            Some(v) => Ok(v.clone()),
            None => Err(format!(
                "$ref {uri} names no file of the schema directory ({name:?}); references are resolved \
                 only to files of the directory, never fetched"
            )
            .into()),
        }
    }
}

/// The set in force, shared by the stages of a process and replaced as a whole on reload.
#[derive(Clone, Default)]
pub struct Schemas {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    /// Bumped on every replace, after the new set is in place.
    generation: AtomicU64,
    current: RwLock<Arc<SchemaSet>>,
}

impl fmt::Debug for Schemas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.current().fmt(f)
    }
}

impl Schemas {
    /// A handle holding `set`.
    pub(crate) fn new(set: SchemaSet) -> Schemas {
        let s = Schemas::default();
        s.replace(Arc::new(set));
        s
    }

    /// The set in force.
    pub(crate) fn current(&self) -> Arc<SchemaSet> {
        // A poisoned lock still holds a whole set: replace only swaps an Arc.
        Arc::clone(
            &self
                .shared
                .current
                .read()
                .unwrap_or_else(|p| p.into_inner()),
        )
    }

    /// Puts `set` in force for every reader.
    pub(crate) fn replace(&self, set: Arc<SchemaSet>) {
        *self
            .shared
            .current
            .write()
            .unwrap_or_else(|p| p.into_inner()) = set;
        self.shared.generation.fetch_add(1, Ordering::Release);
    }

    /// A reader for one stage.
    pub(crate) fn reader(&self) -> SchemaReader {
        SchemaReader {
            seen: self.shared.generation.load(Ordering::Acquire),
            set: self.current(),
            schemas: self.clone(),
        }
    }
}

/// A stage's view of [`Schemas`]: the set it checks with, refreshed when a reload replaced it.
#[derive(Debug)]
pub(crate) struct SchemaReader {
    schemas: Schemas,
    seen: u64,
    set: Arc<SchemaSet>,
}

impl SchemaReader {
    /// The set in force now: one atomic load when nothing changed.
    pub(crate) fn get(&mut self) -> &SchemaSet {
        let now = self.schemas.shared.generation.load(Ordering::Acquire);
        if now != self.seen {
            self.seen = now;
            self.set = self.schemas.current();
        }
        &self.set
    }

    /// The set [`SchemaReader::get`] last returned, to hand to a check that runs elsewhere.
    pub(crate) fn shared(&self) -> Arc<SchemaSet> {
        Arc::clone(&self.set)
    }
}

pub use crate::metrics::SchemaMetrics;

fn fingerprint(dir: &str, required: bool, texts: &BTreeMap<String, Vec<u8>>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    (dir, required, texts).hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests;
