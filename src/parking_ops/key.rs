//! The key an operator names on the command line (`--key TYPE/ID`, `--key-null-id TYPE`): the
//! aggregate type and id as the events carry them, a NULL id a key of its own (distinct from "").
//! Pure.

use std::fmt;

use crate::text::shown;

/// How much of a type or id a line shows; the key itself is kept whole.
const SHOWN_BYTES: usize = 200;

/// A key: `(aggregate_type, aggregate_id)`, the id `None` for SQL NULL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key {
    /// The aggregate type, never empty.
    pub aggregate_type: String,
    /// The aggregate id; `None` is NULL.
    pub aggregate_id: Option<String>,
}

/// A `--key` that names no key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KeyError(String);

impl Key {
    /// `TYPE/ID`: the first `/` splits, so an id may hold `/` (`Claim/2026/4711` is type `Claim`,
    /// id `2026/4711`); `TYPE/` is the empty id. A type cannot hold `/`.
    pub fn parse(s: &str) -> Result<Key, KeyError> {
        let Some((aggregate_type, aggregate_id)) = s.split_once('/') else {
            return Err(KeyError(format!(
                "--key {:?} has no '/': pass TYPE/ID, e.g. --key Claim/4711 (--key-null-id TYPE for a NULL id)",
                shown(s, SHOWN_BYTES)
            )));
        };
        Key::new(aggregate_type, Some(aggregate_id.to_owned()))
    }

    /// The key of `aggregate_type` with a NULL id (`--key-null-id TYPE`).
    pub fn null_id(aggregate_type: &str) -> Result<Key, KeyError> {
        Key::new(aggregate_type, None)
    }

    fn new(aggregate_type: &str, aggregate_id: Option<String>) -> Result<Key, KeyError> {
        if aggregate_type.is_empty() {
            return Err(KeyError(
                "--key needs an aggregate type before the '/': pass TYPE/ID, e.g. --key Claim/4711"
                    .into(),
            ));
        }
        Ok(Key {
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id,
        })
    }
}

/// `TYPE/ID` escaped for one line (`TYPE (NULL id)` for a NULL id).
impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ty = shown(&self.aggregate_type, SHOWN_BYTES);
        match &self.aggregate_id {
            Some(id) => write!(f, "{ty}/{}", shown(id, SHOWN_BYTES)),
            None => write!(f, "{ty} (NULL id)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Key;

    #[test]
    fn the_first_slash_splits_and_an_id_may_hold_slashes() {
        let k = Key::parse("Claim/2026/4711").unwrap();
        assert_eq!(k.aggregate_type, "Claim");
        assert_eq!(k.aggregate_id.as_deref(), Some("2026/4711"));
        assert_eq!(
            Key::parse("Claim/").unwrap().aggregate_id.as_deref(),
            Some("")
        );
        assert_eq!(Key::null_id("Claim").unwrap().aggregate_id, None);
    }

    #[test]
    fn a_key_without_a_slash_or_a_type_is_one_line_saying_how() {
        let e = Key::parse("Claim").unwrap_err().to_string();
        assert!(
            e.contains("has no '/'") && e.contains("--key-null-id"),
            "{e}"
        );
        let e = Key::parse("/4711").unwrap_err().to_string();
        assert!(e.contains("needs an aggregate type"), "{e}");
        assert!(Key::null_id("").is_err());
    }

    #[test]
    fn a_key_is_shown_escaped_on_one_line() {
        let k = Key::parse("Cl\naim/47\u{1b}[2J11").unwrap();
        assert_eq!(k.to_string(), "Cl\\u{a}aim/47\\u{1b}[2J11");
        assert_eq!(
            Key::null_id("Claim").unwrap().to_string(),
            "Claim (NULL id)"
        );
    }
}
