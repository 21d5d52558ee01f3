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
//! docs/pgoutput.md#message-layouts-the-decoder-reads.
//!
//! # Layout
//!
//! This file holds the message types, the public vocabulary of the decoder. `decode` is the
//! [`Decoder`] and its bounds-checked reader; `error` is [`DecodeError`] and the typed reason under
//! it, [`Malformed`]; `encode` is the inverse, for tests, benchmarks and the
//! fuzz seed corpus only (compiled under `cfg(test)` or the `test-support` feature); `tests` holds
//! frames captured from a real server and the property tests.

use bytes::Bytes;

use crate::Lsn;

/// Microseconds since 2000-01-01 UTC, as Postgres sends timestamps.
pub(crate) type PgTimestamp = i64;

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
    /// The column's name.
    pub name: String,
    /// The OID of the column's data type.
    pub type_oid: u32,
    /// The column's type modifier (`atttypmod`), -1 when the type has none.
    pub type_modifier: i32,
}

impl Column {
    /// True when the column is part of the replica identity (flag 1, `LOGICALREP_IS_REPLICA_IDENTITY`).
    /// The relay keys nothing on it; the decoder's tests check the flag arrives.
    #[cfg(test)]
    pub(crate) fn is_key(&self) -> bool {
        self.flags & 1 != 0
    }
}

/// Relation `'R'`: the schema the following changes of `id` are decoded with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Present only inside a Stream Start…Stop block.
    pub xid: Option<u32>,
    /// The relation's OID, which later change messages refer to.
    pub id: u32,
    /// Empty for `pg_catalog` (proto.c `logicalrep_write_namespace`).
    pub namespace: String,
    /// The relation's name, without its schema.
    pub name: String,
    /// `'d'` default, `'n'` nothing, `'f'` full, `'i'` index.
    pub replica_identity: u8,
    /// The published columns, in the order tuples carry their values.
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
    /// Begin `'B'`: a transaction starts; its changes follow, up to the matching Commit.
    Begin {
        /// The transaction's commit LSN (`Begin.final_lsn`).
        final_lsn: Lsn,
        /// The transaction's commit timestamp.
        commit_ts: PgTimestamp,
        /// The transaction's id.
        xid: u32,
    },
    /// Commit `'C'`: the transaction that the last Begin opened has committed.
    Commit {
        /// Unused by the server; always 0.
        flags: u8,
        /// The LSN of the commit record.
        commit_lsn: Lsn,
        /// The end of the commit record: the position to confirm once the transaction is handled.
        end_lsn: Lsn,
        /// The transaction's commit timestamp.
        commit_ts: PgTimestamp,
    },
    /// Origin `'O'`: the transaction was replicated here from the named replication origin.
    Origin {
        /// The commit LSN on the origin server.
        commit_lsn: Lsn,
        /// The replication origin's name.
        name: String,
    },
    /// Relation `'R'`: the schema of the relation the following changes refer to.
    Relation(Relation),
    /// Type `'Y'`: a non-built-in data type of a published column, sent before the Relation that uses it.
    Type {
        /// Present only inside a Stream Start…Stop block.
        xid: Option<u32>,
        /// The type's OID.
        id: u32,
        /// The type's schema, empty for `pg_catalog`.
        namespace: String,
        /// The type's name.
        name: String,
    },
    /// Insert `'I'`: one row inserted.
    Insert {
        /// Present only inside a Stream Start…Stop block.
        xid: Option<u32>,
        /// The OID of the relation, as sent in an earlier Relation message.
        relation_id: u32,
        /// The new row, one value per column of the relation.
        new: Vec<TupleValue>,
    },
    /// Update `'U'`: one row updated.
    Update {
        /// Present only inside a Stream Start…Stop block.
        xid: Option<u32>,
        /// The OID of the relation, as sent in an earlier Relation message.
        relation_id: u32,
        /// The old key or row, sent only when the key changed or with REPLICA IDENTITY FULL.
        old: Option<OldTuple>,
        /// The new row, one value per column of the relation.
        new: Vec<TupleValue>,
    },
    /// Delete `'D'`: one row deleted.
    Delete {
        /// Present only inside a Stream Start…Stop block.
        xid: Option<u32>,
        /// The OID of the relation, as sent in an earlier Relation message.
        relation_id: u32,
        /// The deleted row's key, or the whole row with REPLICA IDENTITY FULL.
        old: OldTuple,
    },
    /// Truncate `'T'`: one TRUNCATE of one or more relations.
    Truncate {
        /// Present only inside a Stream Start…Stop block.
        xid: Option<u32>,
        /// 1 = CASCADE, 2 = RESTART IDENTITY.
        options: u8,
        /// The OIDs of the truncated relations.
        relation_ids: Vec<u32>,
    },
    /// Message `'M'`: a logical decoding message written with `pg_logical_emit_message`.
    Message {
        /// Present only inside a Stream Start…Stop block.
        xid: Option<u32>,
        /// True when the message was emitted as part of its transaction, false when sent at once.
        transactional: bool,
        /// End of the message's WAL record (what `pg_logical_emit_message` returns).
        lsn: Lsn,
        /// The prefix the writer passed to `pg_logical_emit_message`.
        prefix: String,
        /// The message's content, as written.
        content: Bytes,
    },
    /// Stream Start `'S'`: a block of changes of an in-progress transaction follows.
    StreamStart {
        /// The streamed transaction's id.
        xid: u32,
        /// True for the transaction's first block.
        first_segment: bool,
    },
    /// Stream Stop `'E'`: the current block of streamed changes ends.
    StreamStop,
    /// Stream Commit `'c'`: a streamed transaction has committed.
    StreamCommit {
        /// The streamed transaction's id.
        xid: u32,
        /// Unused by the server; always 0.
        flags: u8,
        /// The LSN of the commit record.
        commit_lsn: Lsn,
        /// The end of the commit record: the position to confirm once the transaction is handled.
        end_lsn: Lsn,
        /// The transaction's commit timestamp.
        commit_ts: PgTimestamp,
    },
    /// Stream Abort `'A'`: a streamed transaction, or one of its subtransactions, was aborted.
    StreamAbort {
        /// The top-level transaction's id.
        xid: u32,
        /// The aborted subtransaction's id; equal to `xid` when the whole transaction aborted.
        subxid: u32,
        /// Present only with `streaming 'parallel'` (protocol 4, PG16+).
        abort_lsn: Option<Lsn>,
        /// The abort's timestamp; present only with `streaming 'parallel'`.
        abort_ts: Option<PgTimestamp>,
    },
    /// Begin Prepare `'b'`: a transaction prepared for two-phase commit starts.
    BeginPrepare {
        /// The LSN of the prepare record.
        prepare_lsn: Lsn,
        /// The end of the prepared transaction.
        end_lsn: Lsn,
        /// The prepare's timestamp.
        prepare_ts: PgTimestamp,
        /// The transaction's id.
        xid: u32,
        /// The global transaction id given to `PREPARE TRANSACTION`.
        gid: String,
    },
    /// Prepare `'P'`: the transaction that Begin Prepare opened has been prepared.
    Prepare {
        /// Unused by the server; always 0.
        flags: u8,
        /// The LSN of the prepare record.
        prepare_lsn: Lsn,
        /// The end of the prepared transaction.
        end_lsn: Lsn,
        /// The prepare's timestamp.
        prepare_ts: PgTimestamp,
        /// The transaction's id.
        xid: u32,
        /// The global transaction id given to `PREPARE TRANSACTION`.
        gid: String,
    },
    /// Stream Prepare `'p'`: a streamed transaction has been prepared.
    StreamPrepare {
        /// Unused by the server; always 0.
        flags: u8,
        /// The LSN of the prepare record.
        prepare_lsn: Lsn,
        /// The end of the prepared transaction.
        end_lsn: Lsn,
        /// The prepare's timestamp.
        prepare_ts: PgTimestamp,
        /// The transaction's id.
        xid: u32,
        /// The global transaction id given to `PREPARE TRANSACTION`.
        gid: String,
    },
    /// Commit Prepared `'K'`: a prepared transaction was committed with `COMMIT PREPARED`.
    CommitPrepared {
        /// Unused by the server; always 0.
        flags: u8,
        /// The LSN of the commit-prepared record.
        commit_lsn: Lsn,
        /// The end of the commit-prepared record.
        end_lsn: Lsn,
        /// The commit's timestamp.
        commit_ts: PgTimestamp,
        /// The transaction's id.
        xid: u32,
        /// The global transaction id given to `PREPARE TRANSACTION`.
        gid: String,
    },
    /// Rollback Prepared `'r'`: a prepared transaction was rolled back with `ROLLBACK PREPARED`.
    RollbackPrepared {
        /// Unused by the server; always 0.
        flags: u8,
        /// The end of the prepared transaction.
        prepare_end_lsn: Lsn,
        /// The end of the rollback-prepared record.
        rollback_end_lsn: Lsn,
        /// The prepare's timestamp.
        prepare_ts: PgTimestamp,
        /// The rollback's timestamp.
        rollback_ts: PgTimestamp,
        /// The transaction's id.
        xid: u32,
        /// The global transaction id given to `PREPARE TRANSACTION`.
        gid: String,
    },
}

mod decode;
mod error;
// Not on the production path: the relay only reads pgoutput.
#[cfg(any(test, feature = "test-support"))]
pub mod encode;
#[cfg(test)]
mod tests;

pub use decode::Decoder;
pub(crate) use error::TagName;
pub use error::{DecodeError, Malformed};
