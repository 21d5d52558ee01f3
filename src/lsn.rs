//! The `Lsn` newtype: a position in the Postgres write-ahead log.
//!
//! Printed and parsed as `X/Y` (two hex halves), the form `pg_current_wal_lsn()`, `pg_replication_slots`
//! and the `Outbox-Commit-Lsn` header use. Ordering is the WAL order; `Lsn::ZERO` means "unknown".

use std::fmt;
use std::str::FromStr;

/// A WAL position (byte offset into the WAL). Ordered, copyable, printed as `X/Y`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    /// `0/0`: the server uses it for "no position" (e.g. XLogData of non-final pgoutput messages).
    pub const ZERO: Lsn = Lsn(0);

    /// True for `0/0`.
    pub fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// Appends `X/Y` to `out` without the formatting machinery (on every message, in
    /// `Outbox-Commit-Lsn` and `Outbox-Position`): the same text as [`fmt::Display`].
    pub(crate) fn push_to(self, out: &mut String) {
        push_hex(out, (self.0 >> 32) as u32);
        out.push('/');
        push_hex(out, self.0 as u32);
    }

    /// `X/Y` as a new string (see [`Lsn::push_to`]).
    pub(crate) fn text(self) -> String {
        let mut out = String::with_capacity(17);
        self.push_to(&mut out);
        out
    }
}

/// Upper-case hex without leading zeros, as Postgres prints LSN halves.
fn push_hex(out: &mut String, v: u32) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    let mut buf = [0u8; 8];
    let mut i = buf.len();
    let mut v = v;
    loop {
        i -= 1;
        buf[i] = DIGITS[(v & 0xF) as usize];
        v >>= 4;
        if v == 0 {
            break;
        }
    }
    for &b in &buf[i..] {
        out.push(char::from(b));
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl From<u64> for Lsn {
    fn from(v: u64) -> Self {
        Lsn(v)
    }
}

impl From<Lsn> for u64 {
    fn from(l: Lsn) -> Self {
        l.0
    }
}

/// Error for text that is not an `X/Y` LSN.
#[derive(Debug, thiserror::Error)]
#[error("invalid LSN {0:?}: expected two hex numbers separated by '/', like 16/B374D848")]
pub struct ParseLsnError(String);

impl FromStr for Lsn {
    type Err = ParseLsnError;

    /// Lenient like the server: halves may be zero-padded or not, upper or lower case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError(s.to_owned());
        let (hi, lo) = s.trim().split_once('/').ok_or_else(err)?;
        if hi.is_empty() || lo.is_empty() || hi.len() > 8 || lo.len() > 8 {
            return Err(err());
        }
        let hi = u32::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

/// Now as microseconds since 2000-01-01 UTC, the epoch of Postgres timestamps (commit times, status
/// updates).
pub(crate) fn pg_now_micros() -> i64 {
    const PG_EPOCH_OFFSET_US: i64 = 946_684_800_000_000;
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0);
    unix - PG_EPOCH_OFFSET_US
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn displays_as_two_hex_halves() {
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
    }

    #[test]
    fn parses_padded_and_lowercase() {
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn(0));
        assert!(
            "00000016/0b374d848".parse::<Lsn>().is_err(),
            "nine hex digits"
        );
        assert_eq!("16/b374d848".parse::<Lsn>().unwrap(), Lsn(0x16_B374_D848));
        assert_eq!(
            "0000000A/0000FF00".parse::<Lsn>().unwrap(),
            Lsn(0xA_0000_FF00)
        );
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "/", "1/", "/1", "x/1", "1-2", "1/2/3", "123456789/0"] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} parsed");
        }
    }

    proptest! {
        #[test]
        fn text_is_the_display_form(v in any::<u64>()) {
            prop_assert_eq!(Lsn(v).text(), Lsn(v).to_string());
        }

        #[test]
        fn display_parse_round_trip(v: u64) {
            prop_assert_eq!(Lsn(v).to_string().parse::<Lsn>().unwrap(), Lsn(v));
        }

        #[test]
        fn order_is_numeric(a: u64, b: u64) {
            prop_assert_eq!(Lsn(a).cmp(&Lsn(b)), a.cmp(&b));
        }
    }
}
