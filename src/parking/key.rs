//! A parked key and its subject, pure: the key of an event is its `aggregate_type` and
//! `aggregate_id` as raw text (`outbox.park_key = "aggregate"`, message events use the same
//! fields), and the relay keeps only a [`KeyHash`] of it: the first 16 bytes of SHA-256 over both
//! values, each tagged (`0` for NULL; `1`, its length as a big-endian u32, its bytes otherwise), so
//! that NULL and `""` are different keys and no two pairs of values hash the same bytes. The hash
//! names the key's parking subject ([`parked_subject`]): `<dead_letter_subject>.parked.<32 hex>`,
//! one valid subject token whatever the values hold, and nothing of the values themselves (which
//! travel, escaped, in the parked copies' headers).

use std::fmt;

use sha2::{Digest, Sha256};

use crate::event::OutboxEvent;

/// The token between the dead-letter subject and a key's hash in a parking subject.
pub(crate) const PARKED_TOKEN: &str = "parked";

/// A parked key as the relay keeps it: 16 bytes, whatever the length of the key's values.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyHash(pub(crate) [u8; 16]);

impl KeyHash {
    /// The hash of the key (`aggregate_type`, `aggregate_id`), `None` standing for NULL.
    pub fn of(aggregate_type: Option<&str>, aggregate_id: Option<&str>) -> KeyHash {
        let mut h = Sha256::new();
        for value in [aggregate_type, aggregate_id] {
            match value {
                None => h.update([0u8]),
                Some(s) => {
                    h.update([1u8]);
                    // An outbox value longer than 4 GiB cannot reach the relay (a frame is
                    // smaller); saturating keeps the function total.
                    h.update(u32::try_from(s.len()).unwrap_or(u32::MAX).to_be_bytes());
                    h.update(s.as_bytes());
                }
            }
        }
        let digest = h.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        KeyHash(out)
    }

    /// The key of `event`.
    pub(crate) fn of_event(event: &OutboxEvent) -> KeyHash {
        KeyHash::of(
            event.aggregate_type.as_deref(),
            event.aggregate_id.as_deref(),
        )
    }

    /// The hash as the 32 lowercase hex digits a parking subject ends with.
    pub fn hex(&self) -> String {
        let mut out = String::with_capacity(32);
        for b in self.0 {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xF)]));
        }
        out
    }

    /// The hash a parking subject's last token names, when it is 32 lowercase hex digits.
    pub fn from_hex(s: &str) -> Option<KeyHash> {
        if s.len() != 32 {
            return None;
        }
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut out = [0u8; 16];
        for (i, pair) in s.as_bytes().chunks(2).enumerate() {
            out[i] = (digit(pair[0])? << 4) | digit(pair[1])?;
        }
        Some(KeyHash(out))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyHash({})", self.hex())
    }
}

impl fmt::Display for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// The parking subject of `key`: `<dead_letter_subject>.parked.<32 hex>`.
pub fn parked_subject(dead_letter_subject: &str, key: KeyHash) -> String {
    format!("{dead_letter_subject}.{PARKED_TOKEN}.{}", key.hex())
}

/// The filter that matches every parking subject of `dead_letter_subject`:
/// `<dead_letter_subject>.parked.>`.
pub fn parked_filter(dead_letter_subject: &str) -> String {
    format!("{dead_letter_subject}.{PARKED_TOKEN}.>")
}

/// The key a parking subject of `dead_letter_subject` names, `None` for any other subject.
pub fn key_of_subject(dead_letter_subject: &str, subject: &str) -> Option<KeyHash> {
    let rest = subject
        .strip_prefix(dead_letter_subject)?
        .strip_prefix('.')?
        .strip_prefix(PARKED_TOKEN)?
        .strip_prefix('.')?;
    KeyHash::from_hex(rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_and_empty_are_different_keys_and_values_do_not_run_together() {
        let keys = [
            KeyHash::of(None, None),
            KeyHash::of(Some(""), None),
            KeyHash::of(None, Some("")),
            KeyHash::of(Some(""), Some("")),
            KeyHash::of(Some("Claim"), Some("4711")),
            KeyHash::of(Some("Claim4"), Some("711")),
            KeyHash::of(Some("Claim"), Some("4712")),
        ];
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(
            KeyHash::of(Some("Claim"), Some("4711")),
            KeyHash::of(Some("Claim"), Some("4711"))
        );
    }

    #[test]
    fn the_hash_is_sha256_of_the_tagged_values_cut_to_16_bytes() {
        // tag(Some("a")) = 01 00000001 61, tag(None) = 00.
        let mut h = Sha256::new();
        h.update([1, 0, 0, 0, 1, b'a', 0]);
        let want = h.finalize();
        assert_eq!(KeyHash::of(Some("a"), None).0, want[..16]);
    }

    #[test]
    fn the_subject_is_one_hex_token_and_reads_back() {
        let k = KeyHash::of(Some("Claim"), Some("a.b c*>"));
        let s = parked_subject("outbox_dead_letter", k);
        let hex = s.strip_prefix("outbox_dead_letter.parked.").unwrap();
        assert_eq!(hex.len(), 32);
        assert!(
            hex.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        crate::route::check_subject(&s).unwrap();
        assert_eq!(key_of_subject("outbox_dead_letter", &s), Some(k));
        assert_eq!(KeyHash::from_hex(&k.hex()), Some(k));
        assert_eq!(
            key_of_subject("outbox_dead_letter", "outbox_dead_letter"),
            None
        );
        assert_eq!(key_of_subject("other", &s), None);
        assert_eq!(KeyHash::from_hex(&k.hex().to_uppercase()), None);
        assert_eq!(parked_filter("dl"), "dl.parked.>");
    }
}
