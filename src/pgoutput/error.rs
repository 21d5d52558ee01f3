//! Why a pgoutput message could not be decoded: [`DecodeError`] (the tag and the WAL position, for an
//! operator with `pg_waldump`) around [`Malformed`], one variant per way the bytes can be wrong. The
//! texts are what the logs and `RelayError::Decode`'s chain print, so each variant's `Display` keeps
//! its wording; tests and callers match the variant instead of searching the text.

use std::fmt;
use std::str::Utf8Error;

use crate::Lsn;

/// The tag byte of a message that failed to decode: shown as `'I'` when printable ASCII, as `0x7f`
/// otherwise, and as `<empty>` when the payload had no byte at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TagName(pub(crate) Option<u8>);

impl fmt::Display for TagName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(b) if b.is_ascii_graphic() => write!(f, "'{}'", char::from(b)),
            Some(b) => write!(f, "{b:#04x}"),
            None => f.write_str("<empty>"),
        }
    }
}

/// Why a message could not be decoded. Always names the tag and the WAL position of the XLogData that
/// carried it, so an operator can find the record with `pg_waldump`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot decode pgoutput message {tag} at {lsn}: {reason}")]
pub struct DecodeError {
    /// The tag byte of the message that failed.
    pub(crate) tag: TagName,
    /// The WAL position of the XLogData that carried the message.
    pub(crate) lsn: Lsn,
    /// What was wrong with the bytes. Not a `#[source]`: the line above already prints it, and the
    /// chain printer would print it twice.
    pub(crate) reason: Malformed,
}

/// What was wrong with the bytes of one message. `what` names the field being read, as the
/// decoder spells it ("relation id", "value length").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// A fixed-size field or a counted byte string runs past the end of the message.
    #[error("truncated: {what} needs {need} bytes at offset {offset}, {left} left")]
    Truncated {
        /// The field.
        what: &'static str,
        /// The bytes the field needs.
        need: usize,
        /// Where the field starts.
        offset: usize,
        /// The bytes left from there.
        left: usize,
    },
    /// A string runs to the end of the message without its NUL terminator.
    #[error("truncated: {what} at offset {offset} has no NUL terminator")]
    Unterminated {
        /// The field.
        what: &'static str,
        /// Where the string starts.
        offset: usize,
    },
    /// A string is not UTF-8 (the connection runs with `client_encoding=UTF8`).
    #[error("{what} at offset {offset} is not UTF-8: {utf8}")]
    NotUtf8 {
        /// The field.
        what: &'static str,
        /// Where the string starts.
        offset: usize,
        /// Where the UTF-8 breaks.
        utf8: Utf8Error,
    },
    /// A count or a length Postgres sends signed is negative.
    #[error("negative {what}: {n}")]
    Negative {
        /// The field.
        what: &'static str,
        /// The value read (an `i16` or an `i32` on the wire).
        n: i32,
    },
    /// Bytes are left after a complete message: we and the server disagree on the layout.
    #[error("{left} trailing bytes after a complete message (offset {offset})")]
    TrailingBytes {
        /// How many bytes are left.
        left: usize,
        /// Where the message ended.
        offset: usize,
    },
    /// The tag is not a message pgoutput sends.
    #[error("unknown message type")]
    UnknownMessageType,
    /// A tuple marker other than the ones the message allows.
    #[error("expected tuple marker {expected}, got {}", TagName(Some(*.got)))]
    UnexpectedMarker {
        /// The marker byte read.
        got: u8,
        /// The markers allowed, as the text prints them (`'K' or 'O'`).
        expected: &'static str,
    },
    /// A tuple column's kind byte is not `n`, `u`, `t` or `b`.
    #[error("unknown column kind {} (expected 'n', 'u', 't' or 'b')", TagName(Some(*.0)))]
    UnknownColumnKind(u8),
    /// A Stream Start while a stream block is open: a Stream Stop was lost.
    #[error("Stream Start inside a stream block (missing Stream Stop)")]
    StreamStartInsideBlock,
    /// A Stream Stop with no stream block open.
    #[error("Stream Stop outside a stream block")]
    StreamStopOutsideBlock,
    /// Stream Start's first_segment byte is neither 0 nor 1.
    #[error("first_segment must be 0 or 1, got {0}")]
    FirstSegment(u8),
    /// A Relation message's column `index` is malformed.
    #[error("column {index}: {reason}")]
    Column {
        /// The column's position, from 0.
        index: usize,
        /// What was wrong with it.
        reason: Box<Malformed>,
    },
    /// A TupleData's column `index` is malformed.
    #[error("tuple column {index}: {reason}")]
    TupleColumn {
        /// The column's position, from 0.
        index: usize,
        /// What was wrong with it.
        reason: Box<Malformed>,
    },
}
