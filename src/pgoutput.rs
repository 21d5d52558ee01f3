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

/// Stateful only for what the wire format requires: whether we are inside a Stream Start…Stop block
/// (then change messages carry an xid prefix) and whether Stream Abort carries abort_lsn/ts
/// (`streaming 'parallel'`). Use one decoder per replication connection; make a new one on reconnect.
#[derive(Debug, Default, Clone)]
pub struct Decoder {
    in_stream: bool,
    parallel: bool,
}

impl Decoder {
    /// A decoder for `streaming` off or `'on'`.
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder for `streaming 'parallel'` when `parallel` is true: Stream Abort then carries
    /// abort_lsn and abort_ts (pgoutput.c passes `write_abort_info` only in parallel mode).
    pub fn with_parallel_streaming(parallel: bool) -> Self {
        Self {
            in_stream: false,
            parallel,
        }
    }

    /// True between a decoded Stream Start and the next Stream Stop.
    pub fn in_stream(&self) -> bool {
        self.in_stream
    }

    /// Decodes one pgoutput message. `data` is the XLogData payload after the 25-byte `'w'` header;
    /// `wal_lsn` is the XLogData dataStart, used only in errors. Text/binary values and Message content
    /// are slices of `data` (no copies). On error the decoder's state is unchanged.
    pub fn decode(&mut self, data: Bytes, wal_lsn: Lsn) -> Result<Message, DecodeError> {
        let tag = data.first().copied();
        let mut r = Reader { data, pos: 0 };
        let decoded = self.message(&mut r).and_then(|msg| {
            r.finish()?;
            Ok(msg)
        });
        match decoded {
            Ok(msg) => {
                // State moves only on a fully decoded message, so a bad frame cannot desynchronise us.
                match msg {
                    Message::StreamStart { .. } => self.in_stream = true,
                    Message::StreamStop => self.in_stream = false,
                    _ => {}
                }
                Ok(msg)
            }
            Err(reason) => Err(DecodeError {
                tag: TagName(tag),
                lsn: wal_lsn,
                reason,
            }),
        }
    }

    /// The `[X]` prefix: pgoutput writes it iff the change is sent from a stream callback
    /// (proto.c: `if (TransactionIdIsValid(xid)) pq_sendint32(out, xid)`, valid only while streaming).
    fn stream_xid(&self, r: &mut Reader) -> Result<Option<u32>, String> {
        if self.in_stream {
            r.u32("xid").map(Some)
        } else {
            Ok(None)
        }
    }

    fn message(&self, r: &mut Reader) -> Result<Message, String> {
        let tag = r.u8("message tag")?;
        // Struct-literal fields are evaluated in source order, so each arm reads in wire order.
        let msg = match tag {
            b'B' => Message::Begin {
                final_lsn: r.lsn("final_lsn")?,
                commit_ts: r.i64("commit_ts")?,
                xid: r.u32("xid")?,
            },
            b'C' => Message::Commit {
                flags: r.u8("flags")?,
                commit_lsn: r.lsn("commit_lsn")?,
                end_lsn: r.lsn("end_lsn")?,
                commit_ts: r.i64("commit_ts")?,
            },
            b'O' => Message::Origin {
                commit_lsn: r.lsn("origin commit_lsn")?,
                name: r.cstr("origin name")?,
            },
            b'R' => Message::Relation(self.relation(r)?),
            b'Y' => Message::Type {
                xid: self.stream_xid(r)?,
                id: r.u32("type oid")?,
                namespace: r.cstr("type namespace")?,
                name: r.cstr("type name")?,
            },
            b'I' => {
                let xid = self.stream_xid(r)?;
                let relation_id = r.u32("relation id")?;
                match r.u8("tuple marker")? {
                    b'N' => {}
                    other => return Err(unexpected_marker(other, "'N'")),
                }
                Message::Insert {
                    xid,
                    relation_id,
                    new: tuple(r)?,
                }
            }
            b'U' => {
                let xid = self.stream_xid(r)?;
                let relation_id = r.u32("relation id")?;
                // 'K'/'O' old tuple is optional (only when the key changed, or REPLICA IDENTITY FULL);
                // proto.c `logicalrep_write_update`.
                let old = match r.u8("tuple marker")? {
                    b'N' => None,
                    b'K' => Some(OldTuple::Key(tuple(r)?)),
                    b'O' => Some(OldTuple::Full(tuple(r)?)),
                    other => return Err(unexpected_marker(other, "'K', 'O' or 'N'")),
                };
                if old.is_some() {
                    match r.u8("new tuple marker")? {
                        b'N' => {}
                        other => return Err(unexpected_marker(other, "'N'")),
                    }
                }
                Message::Update {
                    xid,
                    relation_id,
                    old,
                    new: tuple(r)?,
                }
            }
            b'D' => {
                let xid = self.stream_xid(r)?;
                let relation_id = r.u32("relation id")?;
                // Deletes without an old tuple are never sent (pgoutput.c skips them), so 'K'/'O' is
                // mandatory here.
                let old = match r.u8("tuple marker")? {
                    b'K' => OldTuple::Key(tuple(r)?),
                    b'O' => OldTuple::Full(tuple(r)?),
                    other => return Err(unexpected_marker(other, "'K' or 'O'")),
                };
                Message::Delete {
                    xid,
                    relation_id,
                    old,
                }
            }
            b'T' => {
                let xid = self.stream_xid(r)?;
                let nrels = r.count32("number of relations")?;
                let options = r.u8("truncate options")?;
                // Capacity bounded by the bytes actually present: a lying count cannot make us allocate.
                let mut relation_ids = Vec::with_capacity(nrels.min(r.remaining() / 4));
                for _ in 0..nrels {
                    relation_ids.push(r.u32("relation id")?);
                }
                Message::Truncate {
                    xid,
                    options,
                    relation_ids,
                }
            }
            b'M' => Message::Message {
                xid: self.stream_xid(r)?,
                // Flag bit 0 = transactional (proto.c `MESSAGE_TRANSACTIONAL`).
                transactional: r.u8("flags")? & 1 != 0,
                lsn: r.lsn("message lsn")?,
                prefix: r.cstr("prefix")?,
                content: {
                    let len = r.count32("content length")?;
                    r.bytes(len, "content")?
                },
            },
            b'S' => {
                if self.in_stream {
                    // pgoutput never nests blocks (reorderbuffer.c pairs stream_start/stream_stop);
                    // a second 'S' means we lost an 'E' and would misread the xid prefixes.
                    return Err("Stream Start inside a stream block (missing Stream Stop)".into());
                }
                Message::StreamStart {
                    xid: r.u32("xid")?,
                    first_segment: match r.u8("first_segment")? {
                        0 => false,
                        1 => true,
                        other => return Err(format!("first_segment must be 0 or 1, got {other}")),
                    },
                }
            }
            b'E' => {
                if !self.in_stream {
                    return Err("Stream Stop outside a stream block".into());
                }
                Message::StreamStop
            }
            b'c' => Message::StreamCommit {
                xid: r.u32("xid")?,
                flags: r.u8("flags")?,
                commit_lsn: r.lsn("commit_lsn")?,
                end_lsn: r.lsn("end_lsn")?,
                commit_ts: r.i64("commit_ts")?,
            },
            b'A' => {
                let xid = r.u32("xid")?;
                let subxid = r.u32("subxid")?;
                let (abort_lsn, abort_ts) = if self.parallel {
                    (Some(r.lsn("abort_lsn")?), Some(r.i64("abort_ts")?))
                } else {
                    (None, None)
                };
                Message::StreamAbort {
                    xid,
                    subxid,
                    abort_lsn,
                    abort_ts,
                }
            }
            b'b' => Message::BeginPrepare {
                prepare_lsn: r.lsn("prepare_lsn")?,
                end_lsn: r.lsn("end_lsn")?,
                prepare_ts: r.i64("prepare_ts")?,
                xid: r.u32("xid")?,
                gid: r.cstr("gid")?,
            },
            b'P' => Message::Prepare {
                flags: r.u8("flags")?,
                prepare_lsn: r.lsn("prepare_lsn")?,
                end_lsn: r.lsn("end_lsn")?,
                prepare_ts: r.i64("prepare_ts")?,
                xid: r.u32("xid")?,
                gid: r.cstr("gid")?,
            },
            b'p' => Message::StreamPrepare {
                flags: r.u8("flags")?,
                prepare_lsn: r.lsn("prepare_lsn")?,
                end_lsn: r.lsn("end_lsn")?,
                prepare_ts: r.i64("prepare_ts")?,
                xid: r.u32("xid")?,
                gid: r.cstr("gid")?,
            },
            b'K' => Message::CommitPrepared {
                flags: r.u8("flags")?,
                commit_lsn: r.lsn("commit_lsn")?,
                end_lsn: r.lsn("end_lsn")?,
                commit_ts: r.i64("commit_ts")?,
                xid: r.u32("xid")?,
                gid: r.cstr("gid")?,
            },
            b'r' => Message::RollbackPrepared {
                flags: r.u8("flags")?,
                prepare_end_lsn: r.lsn("prepare_end_lsn")?,
                rollback_end_lsn: r.lsn("rollback_end_lsn")?,
                prepare_ts: r.i64("prepare_ts")?,
                rollback_ts: r.i64("rollback_ts")?,
                xid: r.u32("xid")?,
                gid: r.cstr("gid")?,
            },
            _ => return Err("unknown message type".into()),
        };
        Ok(msg)
    }

    fn relation(&self, r: &mut Reader) -> Result<Relation, String> {
        let xid = self.stream_xid(r)?;
        let id = r.u32("relation id")?;
        let namespace = r.cstr("namespace")?;
        let name = r.cstr("relation name")?;
        let replica_identity = r.u8("replica identity")?;
        let ncols = r.count16("number of columns")?;
        // Each column needs at least 10 bytes (flags, empty name, oid, typmod).
        let mut columns = Vec::with_capacity(ncols.min(r.remaining() / 10));
        for i in 0..ncols {
            columns.push(column(r).map_err(|e| format!("column {i}: {e}"))?);
        }
        Ok(Relation {
            xid,
            id,
            namespace,
            name,
            replica_identity,
            columns,
        })
    }
}

/// TupleData: `i16 ncols | ncols × (u8 kind [i32 len | bytes])` (proto.c `logicalrep_write_tuple`).
/// ncols is not checked against the relation here: there is no relation cache in this module.
fn tuple(r: &mut Reader) -> Result<Vec<TupleValue>, String> {
    let ncols = r.count16("number of tuple columns")?;
    // One byte per column at least: bound the capacity by what is really there.
    let mut values = Vec::with_capacity(ncols.min(r.remaining()));
    for i in 0..ncols {
        values.push(tuple_value(r).map_err(|e| format!("tuple column {i}: {e}"))?);
    }
    Ok(values)
}

fn column(r: &mut Reader) -> Result<Column, String> {
    Ok(Column {
        flags: r.u8("flags")?,
        name: r.cstr("name")?,
        type_oid: r.u32("type oid")?,
        type_modifier: r.i32("type modifier")?,
    })
}

fn tuple_value(r: &mut Reader) -> Result<TupleValue, String> {
    Ok(match r.u8("column kind")? {
        b'n' => TupleValue::Null,
        b'u' => TupleValue::UnchangedToast,
        b't' => {
            let len = r.count32("value length")?;
            TupleValue::Text(r.bytes(len, "text value")?)
        }
        b'b' => {
            let len = r.count32("value length")?;
            TupleValue::Binary(r.bytes(len, "binary value")?)
        }
        other => {
            return Err(format!(
                "unknown column kind {} (expected 'n', 'u', 't' or 'b')",
                TagName(Some(other))
            ));
        }
    })
}

fn unexpected_marker(got: u8, expected: &str) -> String {
    format!(
        "expected tuple marker {expected}, got {}",
        TagName(Some(got))
    )
}

/// A bounds-checked big-endian cursor over the message. Every read returns `Err` instead of panicking.
struct Reader {
    data: Bytes,
    pos: usize,
}

impl Reader {
    fn remaining(&self) -> usize {
        self.data.len().saturating_sub(self.pos)
    }

    fn truncated(&self, need: usize, what: &str) -> String {
        format!(
            "truncated: {what} needs {need} bytes at offset {}, {} left",
            self.pos,
            self.remaining()
        )
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let end = self.pos.saturating_add(N);
        match self
            .data
            .get(self.pos..end)
            .and_then(|s| <[u8; N]>::try_from(s).ok())
        {
            Some(a) => {
                self.pos = end;
                Ok(a)
            }
            None => Err(self.truncated(N, what)),
        }
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        self.array::<1>(what).map(|[b]| b)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array(what).map(u32::from_be_bytes)
    }

    fn i32(&mut self, what: &str) -> Result<i32, String> {
        self.array(what).map(i32::from_be_bytes)
    }

    fn i64(&mut self, what: &str) -> Result<i64, String> {
        self.array(what).map(i64::from_be_bytes)
    }

    fn lsn(&mut self, what: &str) -> Result<Lsn, String> {
        self.array(what).map(|b| Lsn(u64::from_be_bytes(b)))
    }

    /// An i16 count (columns); Postgres sends it signed, so a negative one is an error, not a huge loop.
    fn count16(&mut self, what: &str) -> Result<usize, String> {
        let n = i16::from_be_bytes(self.array(what)?);
        usize::try_from(n).map_err(|_| format!("negative {what}: {n}"))
    }

    /// An i32 count or length; negative is an error.
    fn count32(&mut self, what: &str) -> Result<usize, String> {
        let n = i32::from_be_bytes(self.array(what)?);
        usize::try_from(n).map_err(|_| format!("negative {what}: {n}"))
    }

    /// `len` bytes as a slice of the input (no copy).
    fn bytes(&mut self, len: usize, what: &str) -> Result<Bytes, String> {
        let end = self.pos.saturating_add(len);
        if end > self.data.len() {
            return Err(self.truncated(len, what));
        }
        let b = self.data.slice(self.pos..end);
        self.pos = end;
        Ok(b)
    }

    /// A NUL-terminated string (`pq_sendstring`). The connection runs with `client_encoding=UTF8`, so
    /// anything else is corruption.
    fn cstr(&mut self, what: &str) -> Result<String, String> {
        let rest = self.data.get(self.pos..).unwrap_or_default();
        let Some(nul) = rest.iter().position(|&b| b == 0) else {
            return Err(format!(
                "truncated: {what} at offset {} has no NUL terminator",
                self.pos
            ));
        };
        let s = rest.get(..nul).unwrap_or_default();
        let s = std::str::from_utf8(s)
            .map_err(|e| format!("{what} at offset {} is not UTF-8: {e}", self.pos))?
            .to_owned();
        self.pos = self.pos.saturating_add(nul + 1);
        Ok(s)
    }

    /// A complete message must use every byte: leftovers mean we and the server disagree on the layout.
    fn finish(&self) -> Result<(), String> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(format!(
                "{n} trailing bytes after a complete message (offset {})",
                self.pos
            )),
        }
    }
}

/// Builds pgoutput wire bytes from [`Message`]s: the inverse of [`Decoder::decode`], for round-trip
/// tests, benchmarks and fake servers. Not used on the production path.
///
/// The `[X]` prefix is written iff the message's `xid` is `Some`, and Stream Abort's abort fields iff
/// they are `Some`; decode the result with a decoder in the matching stream/parallel state.
///
/// # Panics
///
/// On messages the wire format cannot carry: strings containing NUL, more than `i16::MAX` columns,
/// more than `i32::MAX` relations or bytes.
#[doc(hidden)]
pub mod encode {
    use bytes::{BufMut, Bytes, BytesMut};

    use super::{Message, OldTuple, TupleValue};

    /// The wire bytes of one message.
    pub fn message(msg: &Message) -> Bytes {
        let mut out = BytesMut::with_capacity(64);
        write(msg, &mut out);
        out.freeze()
    }

    /// Appends the wire bytes of one message to `out`.
    pub fn write(msg: &Message, out: &mut BytesMut) {
        match msg {
            Message::Begin {
                final_lsn,
                commit_ts,
                xid,
            } => {
                out.put_u8(b'B');
                out.put_u64(final_lsn.0);
                out.put_i64(*commit_ts);
                out.put_u32(*xid);
            }
            Message::Commit {
                flags,
                commit_lsn,
                end_lsn,
                commit_ts,
            } => {
                out.put_u8(b'C');
                out.put_u8(*flags);
                out.put_u64(commit_lsn.0);
                out.put_u64(end_lsn.0);
                out.put_i64(*commit_ts);
            }
            Message::Origin { commit_lsn, name } => {
                out.put_u8(b'O');
                out.put_u64(commit_lsn.0);
                cstr(out, name);
            }
            Message::Relation(rel) => {
                out.put_u8(b'R');
                xid(out, rel.xid);
                out.put_u32(rel.id);
                cstr(out, &rel.namespace);
                cstr(out, &rel.name);
                out.put_u8(rel.replica_identity);
                count16(out, rel.columns.len());
                for c in &rel.columns {
                    out.put_u8(c.flags);
                    cstr(out, &c.name);
                    out.put_u32(c.type_oid);
                    out.put_i32(c.type_modifier);
                }
            }
            Message::Type {
                xid: x,
                id,
                namespace,
                name,
            } => {
                out.put_u8(b'Y');
                xid(out, *x);
                out.put_u32(*id);
                cstr(out, namespace);
                cstr(out, name);
            }
            Message::Insert {
                xid: x,
                relation_id,
                new,
            } => {
                out.put_u8(b'I');
                xid(out, *x);
                out.put_u32(*relation_id);
                out.put_u8(b'N');
                tuple(new, out);
            }
            Message::Update {
                xid: x,
                relation_id,
                old,
                new,
            } => {
                out.put_u8(b'U');
                xid(out, *x);
                out.put_u32(*relation_id);
                if let Some(old) = old {
                    old_tuple(old, out);
                }
                out.put_u8(b'N');
                tuple(new, out);
            }
            Message::Delete {
                xid: x,
                relation_id,
                old,
            } => {
                out.put_u8(b'D');
                xid(out, *x);
                out.put_u32(*relation_id);
                old_tuple(old, out);
            }
            Message::Truncate {
                xid: x,
                options,
                relation_ids,
            } => {
                out.put_u8(b'T');
                xid(out, *x);
                count32(out, relation_ids.len());
                out.put_u8(*options);
                for id in relation_ids {
                    out.put_u32(*id);
                }
            }
            Message::Message {
                xid: x,
                transactional,
                lsn,
                prefix,
                content,
            } => {
                out.put_u8(b'M');
                xid(out, *x);
                out.put_u8(u8::from(*transactional));
                out.put_u64(lsn.0);
                cstr(out, prefix);
                count32(out, content.len());
                out.put_slice(content);
            }
            Message::StreamStart { xid, first_segment } => {
                out.put_u8(b'S');
                out.put_u32(*xid);
                out.put_u8(u8::from(*first_segment));
            }
            Message::StreamStop => out.put_u8(b'E'),
            Message::StreamCommit {
                xid,
                flags,
                commit_lsn,
                end_lsn,
                commit_ts,
            } => {
                out.put_u8(b'c');
                out.put_u32(*xid);
                out.put_u8(*flags);
                out.put_u64(commit_lsn.0);
                out.put_u64(end_lsn.0);
                out.put_i64(*commit_ts);
            }
            Message::StreamAbort {
                xid,
                subxid,
                abort_lsn,
                abort_ts,
            } => {
                out.put_u8(b'A');
                out.put_u32(*xid);
                out.put_u32(*subxid);
                if let Some(lsn) = abort_lsn {
                    out.put_u64(lsn.0);
                }
                if let Some(ts) = abort_ts {
                    out.put_i64(*ts);
                }
            }
            Message::BeginPrepare {
                prepare_lsn,
                end_lsn,
                prepare_ts,
                xid,
                gid,
            } => {
                out.put_u8(b'b');
                out.put_u64(prepare_lsn.0);
                out.put_u64(end_lsn.0);
                out.put_i64(*prepare_ts);
                out.put_u32(*xid);
                cstr(out, gid);
            }
            Message::Prepare {
                flags,
                prepare_lsn,
                end_lsn,
                prepare_ts,
                xid,
                gid,
            }
            | Message::StreamPrepare {
                flags,
                prepare_lsn,
                end_lsn,
                prepare_ts,
                xid,
                gid,
            } => {
                out.put_u8(if matches!(msg, Message::Prepare { .. }) {
                    b'P'
                } else {
                    b'p'
                });
                out.put_u8(*flags);
                out.put_u64(prepare_lsn.0);
                out.put_u64(end_lsn.0);
                out.put_i64(*prepare_ts);
                out.put_u32(*xid);
                cstr(out, gid);
            }
            Message::CommitPrepared {
                flags,
                commit_lsn,
                end_lsn,
                commit_ts,
                xid,
                gid,
            } => {
                out.put_u8(b'K');
                out.put_u8(*flags);
                out.put_u64(commit_lsn.0);
                out.put_u64(end_lsn.0);
                out.put_i64(*commit_ts);
                out.put_u32(*xid);
                cstr(out, gid);
            }
            Message::RollbackPrepared {
                flags,
                prepare_end_lsn,
                rollback_end_lsn,
                prepare_ts,
                rollback_ts,
                xid,
                gid,
            } => {
                out.put_u8(b'r');
                out.put_u8(*flags);
                out.put_u64(prepare_end_lsn.0);
                out.put_u64(rollback_end_lsn.0);
                out.put_i64(*prepare_ts);
                out.put_i64(*rollback_ts);
                out.put_u32(*xid);
                cstr(out, gid);
            }
        }
    }

    /// Appends a TupleData (`i16 ncols | columns`).
    pub fn tuple(values: &[TupleValue], out: &mut BytesMut) {
        count16(out, values.len());
        for v in values {
            match v {
                TupleValue::Null => out.put_u8(b'n'),
                TupleValue::UnchangedToast => out.put_u8(b'u'),
                TupleValue::Text(b) | TupleValue::Binary(b) => {
                    out.put_u8(if matches!(v, TupleValue::Text(_)) {
                        b't'
                    } else {
                        b'b'
                    });
                    count32(out, b.len());
                    out.put_slice(b);
                }
            }
        }
    }

    fn old_tuple(old: &OldTuple, out: &mut BytesMut) {
        let (marker, values) = match old {
            OldTuple::Key(v) => (b'K', v),
            OldTuple::Full(v) => (b'O', v),
        };
        out.put_u8(marker);
        tuple(values, out);
    }

    fn xid(out: &mut BytesMut, xid: Option<u32>) {
        if let Some(x) = xid {
            out.put_u32(x);
        }
    }

    fn cstr(out: &mut BytesMut, s: &str) {
        assert!(
            !s.contains('\0'),
            "pgoutput strings cannot contain NUL: {s:?}"
        );
        out.put_slice(s.as_bytes());
        out.put_u8(0);
    }

    fn count16(out: &mut BytesMut, n: usize) {
        out.put_i16(i16::try_from(n).expect("more than i16::MAX columns"));
    }

    fn count32(out: &mut BytesMut, n: usize) {
        out.put_i32(i32::try_from(n).expect("count or length above i32::MAX"));
    }
}
