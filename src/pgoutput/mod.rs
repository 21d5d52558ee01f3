//! pgoutput decoder: one logical-replication message (the XLogData payload after its 25-byte `'w'`
//! header) in, one [`Message`] out.
//!
//! It is pure: no I/O, no relation cache, no transaction tracking. The only state is what the wire
//! format forces on a reader: whether we are inside a Stream Start…Stop block (then change messages carry
//! an xid prefix) and whether the stream was started with `streaming 'parallel'` (then Stream Abort
//! carries an abort LSN and timestamp). Matching tuples to relations, buffering streamed transactions and
//! choosing which LSN to confirm belong to the consumer (`outbox`, `progress`).
//!
//! Values are zero-copy: text/binary column values and logical-message contents are [`Bytes`] slices of
//! the input. Every malformed input (unknown tag, truncation, trailing bytes, bad column kind, negative
//! length, invalid UTF-8) is a [`DecodeError`] naming the tag and the WAL position, never a panic: the
//! input comes from the network, and a fuzz target (`fuzz/`) holds us to it.
//!
//! Layouts follow the Postgres docs "Logical Replication Message Formats"
//! (<https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html>) and the writer
//! side, `src/backend/replication/logical/proto.c` (`logicalrep_write_*`); summary in
//! `reference/pgoutput-client.md` §3.
//!
//! # Layout
//!
//! This file holds the message types, the public vocabulary of the decoder. `decode` is the
//! [`Decoder`] and its bounds-checked reader; `encode` is the inverse, for tests, benchmarks and the
//! fuzz seed corpus only (compiled under `cfg(test)` or the `test-support` feature); `tests` holds
//! frames captured from a real server and the property tests.

use std::fmt;

use bytes::Bytes;

use crate::Lsn;

/// Microseconds since 2000-01-01 UTC, as Postgres sends timestamps.
pub type PgTimestamp = i64;

/// One column of a TupleData (proto.c `logicalrep_write_tuple`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TupleValue {
    /// `'n'`: SQL NULL, or, in an old-key (`'K'`) tuple, a non-key column that was not sent.
    Null,
    /// `'u'`: an unchanged TOASTed value the server did not send; keep the previous value.
    UnchangedToast,
    /// `'t'`: the type's text output, not NUL-terminated.
    Text(Bytes),
    /// `'b'`: the type's binary send format (only with `binary 'true'`).
    Binary(Bytes),
}

/// One column of a Relation message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Bit 0 set: part of the replica identity key.
    pub flags: u8,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

impl Column {
    /// True when the column is part of the replica identity (flag 1, `LOGICALREP_IS_REPLICA_IDENTITY`).
    pub fn is_key(&self) -> bool {
        self.flags & 1 != 0
    }
}

/// Relation `'R'`: the schema the following changes of `id` are decoded with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Present only inside a Stream Start…Stop block.
    pub xid: Option<u32>,
    pub id: u32,
    /// Empty for `pg_catalog` (proto.c `logicalrep_write_namespace`).
    pub namespace: String,
    pub name: String,
    /// `'d'` default, `'n'` nothing, `'f'` full, `'i'` index.
    pub replica_identity: u8,
    pub columns: Vec<Column>,
}

/// The old row of an Update or Delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple {
    /// `'K'`: key columns only; other columns are [`TupleValue::Null`] placeholders, not real NULLs.
    Key(Vec<TupleValue>),
    /// `'O'`: the whole old row (REPLICA IDENTITY FULL).
    Full(Vec<TupleValue>),
}

/// One decoded pgoutput message. `xid: Option<u32>` is the `[X]` prefix, present only inside a
/// Stream Start…Stop block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Begin {
        final_lsn: Lsn,
        commit_ts: PgTimestamp,
        xid: u32,
    },
    Commit {
        flags: u8,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        commit_ts: PgTimestamp,
    },
    Origin {
        commit_lsn: Lsn,
        name: String,
    },
    Relation(Relation),
    Type {
        xid: Option<u32>,
        id: u32,
        namespace: String,
        name: String,
    },
    Insert {
        xid: Option<u32>,
        relation_id: u32,
        new: Vec<TupleValue>,
    },
    Update {
        xid: Option<u32>,
        relation_id: u32,
        old: Option<OldTuple>,
        new: Vec<TupleValue>,
    },
    Delete {
        xid: Option<u32>,
        relation_id: u32,
        old: OldTuple,
    },
    Truncate {
        xid: Option<u32>,
        /// 1 = CASCADE, 2 = RESTART IDENTITY.
        options: u8,
        relation_ids: Vec<u32>,
    },
    Message {
        xid: Option<u32>,
        transactional: bool,
        /// End of the message's WAL record (what `pg_logical_emit_message` returns).
        lsn: Lsn,
        prefix: String,
        content: Bytes,
    },
    StreamStart {
        xid: u32,
        first_segment: bool,
    },
    StreamStop,
    StreamCommit {
        xid: u32,
        flags: u8,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        commit_ts: PgTimestamp,
    },
    StreamAbort {
        xid: u32,
        subxid: u32,
        /// Present only with `streaming 'parallel'` (protocol 4, PG16+).
        abort_lsn: Option<Lsn>,
        abort_ts: Option<PgTimestamp>,
    },
    BeginPrepare {
        prepare_lsn: Lsn,
        end_lsn: Lsn,
        prepare_ts: PgTimestamp,
        xid: u32,
        gid: String,
    },
    Prepare {
        flags: u8,
        prepare_lsn: Lsn,
        end_lsn: Lsn,
        prepare_ts: PgTimestamp,
        xid: u32,
        gid: String,
    },
    StreamPrepare {
        flags: u8,
        prepare_lsn: Lsn,
        end_lsn: Lsn,
        prepare_ts: PgTimestamp,
        xid: u32,
        gid: String,
    },
    CommitPrepared {
        flags: u8,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        commit_ts: PgTimestamp,
        xid: u32,
        gid: String,
    },
    RollbackPrepared {
        flags: u8,
        prepare_end_lsn: Lsn,
        rollback_end_lsn: Lsn,
        prepare_ts: PgTimestamp,
        rollback_ts: PgTimestamp,
        xid: u32,
        gid: String,
    },
}

/// The tag byte of a message that failed to decode: shown as `'I'` when printable ASCII, as `0x7f`
/// otherwise, and as `<empty>` when the payload had no byte at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagName(pub Option<u8>);

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
    pub tag: TagName,
    pub lsn: Lsn,
    pub reason: String,
}

mod decode;
// Not on the production path: the relay only reads pgoutput.
#[cfg(any(test, feature = "test-support"))]
pub mod encode;
#[cfg(test)]
mod tests;

pub use decode::Decoder;
