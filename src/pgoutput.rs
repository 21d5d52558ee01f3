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

/// Builds pgoutput wire bytes from [`Message`](crate::pgoutput::Message)s: the inverse of
/// [`Decoder::decode`](crate::pgoutput::Decoder::decode), for round-trip tests, benchmarks and fake
/// servers. Not used on the production path.
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // ---- Frames captured from a real server ----------------------------------------------------
    //
    // PostgreSQL 15 (Debian `postgresql-15`), throwaway cluster: `initdb --auth=trust`, started with
    // `-c wal_level=logical`. Setup:
    //   CREATE TABLE outbox (id uuid PRIMARY KEY, aggregate_type text NOT NULL, payload jsonb);
    //   CREATE PUBLICATION p FOR TABLE outbox;
    //   SELECT pg_create_logical_replication_slot('s1', 'pgoutput');
    //   INSERT INTO outbox VALUES ('0b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6d', 'order', '{"a":1}');
    //   SELECT pg_logical_emit_message(true, 'outbox', '{"a":1}');   -- returned 0/1529320
    //   SELECT pg_logical_emit_message(false, 'outbox', '{"a":1}');  -- returned 0/1529390
    //   UPDATE outbox SET payload = '{"a":2}';
    //   UPDATE outbox SET id = '1b6f2a3e-…', payload = NULL;         -- key change: 'K' old tuple
    //   DELETE FROM outbox;
    //   TRUNCATE outbox;
    // then `SELECT lsn, xid, encode(data, 'hex') FROM pg_logical_slot_peek_binary_changes('s1', NULL,
    // NULL, 'proto_version', '1', 'publication_names', 'p', 'messages', 'true')`, each row's `data`
    // pasted here as a byte string.

    /// 'B' | final_lsn 0/15292B0 | commit_ts | xid 726
    const PG15_BEGIN: &[u8] =
        b"B\x00\x00\x00\x00\x01R\x92\xb0\x00\x03\x04v\x05l\xe0\xb4\x00\x00\x02\xd6";
    /// 'R' | relid 16384 | "public" | "outbox" | 'd' | 3 cols × (flags | name | oid | typmod)
    const PG15_RELATION: &[u8] = b"R\x00\x00@\x00public\x00outbox\x00d\x00\x03\x01id\x00\x00\x00\x0b\x86\xff\xff\xff\xff\x00aggregate_type\x00\x00\x00\x00\x19\xff\xff\xff\xff\x00payload\x00\x00\x00\x0e\xda\xff\xff\xff\xff";
    /// 'I' | relid | 'N' | 3 × 't' len bytes (uuid, text, jsonb text output)
    const PG15_INSERT: &[u8] = b"I\x00\x00@\x00N\x00\x03t\x00\x00\x00$0b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6dt\x00\x00\x00\x05ordert\x00\x00\x00\x08{\"a\": 1}";
    /// 'C' | flags 0 | commit_lsn 0/15292B0 | end_lsn 0/15292E0 | commit_ts
    const PG15_COMMIT: &[u8] = b"C\x00\x00\x00\x00\x00\x01R\x92\xb0\x00\x00\x00\x00\x01R\x92\xe0\x00\x03\x04v\x05l\xe0\xb4";
    /// 'M' | flags 1 (transactional) | lsn 0/1529320 | "outbox" | len 7 | {"a":1}
    const PG15_MESSAGE_TX: &[u8] =
        b"M\x01\x00\x00\x00\x00\x01R\x93 outbox\x00\x00\x00\x00\x07{\"a\":1}";
    /// 'M' | flags 0 (non-transactional, arrived outside B…C) | lsn 0/1529390 | …
    const PG15_MESSAGE_NONTX: &[u8] =
        b"M\x00\x00\x00\x00\x00\x01R\x93\x90outbox\x00\x00\x00\x00\x07{\"a\":1}";
    /// 'U' | relid | 'N' | new tuple (no old tuple: key unchanged, REPLICA IDENTITY DEFAULT)
    const PG15_UPDATE: &[u8] = b"U\x00\x00@\x00N\x00\x03t\x00\x00\x00$0b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6dt\x00\x00\x00\x05ordert\x00\x00\x00\x08{\"a\": 2}";
    /// 'U' | relid | 'K' old key (non-key columns 'n') | 'N' | new tuple (payload now NULL)
    const PG15_UPDATE_KEY: &[u8] = b"U\x00\x00@\x00K\x00\x03t\x00\x00\x00$0b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6dnnN\x00\x03t\x00\x00\x00$1b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6dt\x00\x00\x00\x05ordern";
    /// 'D' | relid | 'K' | old key tuple
    const PG15_DELETE: &[u8] =
        b"D\x00\x00@\x00K\x00\x03t\x00\x00\x00$1b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6dnn";
    /// 'T' | nrels 1 | options 0 | relid 16384
    const PG15_TRUNCATE: &[u8] = b"T\x00\x00\x00\x01\x00\x00\x00@\x00";

    // Streamed frames, same server. Setup:
    //   CREATE TYPE mood AS ENUM ('ok', 'sad');
    //   CREATE TABLE big (id int PRIMARY KEY, m mood, t text);
    //   CREATE PUBLICATION p2 FOR TABLE big;
    //   SELECT pg_create_logical_replication_slot('s2', 'pgoutput', false, true);
    //   SET logical_decoding_work_mem = '64kB';
    //   INSERT INTO big SELECT g, 'ok', repeat('x', 100) FROM generate_series(1, 1000) g;   -- xid 735
    //   BEGIN; INSERT … generate_series(1001, 2000) g; ROLLBACK;                            -- xid 736
    // peeked (same session, 64kB) with 'proto_version', '2', 'publication_names', 'p2', 'messages',
    // 'true', 'streaming', 'on', 'binary', 'true'.

    /// 'S' | xid 735 | first_segment 1
    const PG15_STREAM_START_FIRST: &[u8] = b"S\x00\x00\x02\xdf\x01";
    /// 'Y' | xid 735 | type oid 16398 | "public" | "mood"
    const PG15_STREAM_TYPE: &[u8] = b"Y\x00\x00\x02\xdf\x00\x00@\x0epublic\x00mood\x00";
    /// 'R' | xid 735 | relid 16403 | "public" | "big" | 'd' | 3 columns
    const PG15_STREAM_RELATION: &[u8] = b"R\x00\x00\x02\xdf\x00\x00@\x13public\x00big\x00d\x00\x03\x01id\x00\x00\x00\x00\x17\xff\xff\xff\xff\x00m\x00\x00\x00@\x0e\xff\xff\xff\xff\x00t\x00\x00\x00\x00\x19\xff\xff\xff\xff";
    /// 'I' | xid 735 | relid | 'N' | 3 × 'b' (int4 send, enum send = label, text send)
    const PG15_STREAM_INSERT_BINARY: &[u8] = b"I\x00\x00\x02\xdf\x00\x00@\x13N\x00\x03b\x00\x00\x00\x04\x00\x00\x00\x01b\x00\x00\x00\x02okb\x00\x00\x00dxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";
    /// 'E'
    const PG15_STREAM_STOP: &[u8] = b"E";
    /// 'S' | xid 735 | first_segment 0
    const PG15_STREAM_START_NEXT: &[u8] = b"S\x00\x00\x02\xdf\x00";
    /// 'c' | xid 735 | flags 0 | commit_lsn 0/156C328 | end_lsn 0/156C358 | commit_ts
    const PG15_STREAM_COMMIT: &[u8] = b"c\x00\x00\x02\xdf\x00\x00\x00\x00\x00\x01V\xc3(\x00\x00\x00\x00\x01V\xc3X\x00\x03\x04v\x05\xdf\xdb\x8b";
    /// 'A' | xid 736 | subxid 736 (top-level abort), no abort_lsn/ts: streaming 'on', not 'parallel'
    const PG15_STREAM_ABORT: &[u8] = b"A\x00\x00\x02\xe0\x00\x00\x02\xe0";

    // ---- Hand-written frames, from the layouts in reference/pgoutput-client.md §3 ----------------
    // (two-phase needs max_prepared_transactions > 0 and parallel streaming PG16; not on the capture
    // server, so written by hand).

    /// 'O' | origin_commit_lsn 0/15292B0 | "pg_16385"
    const ORIGIN: &[u8] = b"O\x00\x00\x00\x00\x01R\x92\xb0pg_16385\x00";
    /// 'U' | relid 16384 | 'O' full old (t "1", t "a") | 'N' new (t "1", 'u' unchanged TOAST)
    const UPDATE_FULL: &[u8] =
        b"U\x00\x00@\x00O\x00\x02t\x00\x00\x00\x011t\x00\x00\x00\x01aN\x00\x02t\x00\x00\x00\x011u";
    /// 'D' | relid 16384 | 'O' full old (t "1", n)
    const DELETE_FULL: &[u8] = b"D\x00\x00@\x00O\x00\x02t\x00\x00\x00\x011n";
    /// 'A' | xid 737 | subxid 738 | abort_lsn 0/15A5948 | abort_ts 1 (streaming 'parallel')
    const STREAM_ABORT_PARALLEL: &[u8] =
        b"A\x00\x00\x02\xe1\x00\x00\x02\xe2\x00\x00\x00\x00\x01ZYH\x00\x00\x00\x00\x00\x00\x00\x01";
    /// 'b' | prepare_lsn 0/1600000 | end_lsn 0/1600100 | prepare_ts 2 | xid 740 | "gx1"
    const BEGIN_PREPARE: &[u8] = b"b\x00\x00\x00\x00\x01\x60\x00\x00\x00\x00\x00\x00\x01\x60\x01\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x02\xe4gx1\x00";
    /// 'P' | flags 0 | prepare_lsn | end_lsn | prepare_ts 2 | xid 740 | "gx1"
    const PREPARE: &[u8] = b"P\x00\x00\x00\x00\x00\x01\x60\x00\x00\x00\x00\x00\x00\x01\x60\x01\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x02\xe4gx1\x00";
    /// 'p' | same layout as 'P'
    const STREAM_PREPARE: &[u8] = b"p\x00\x00\x00\x00\x00\x01\x60\x00\x00\x00\x00\x00\x00\x01\x60\x01\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x02\xe4gx1\x00";
    /// 'K' | flags 0 | commit_lsn 0/1600200 | end_lsn 0/1600300 | commit_ts 3 | xid 740 | "gx1"
    const COMMIT_PREPARED: &[u8] = b"K\x00\x00\x00\x00\x00\x01\x60\x02\x00\x00\x00\x00\x00\x01\x60\x03\x00\x00\x00\x00\x00\x00\x00\x00\x03\x00\x00\x02\xe4gx1\x00";
    /// 'r' | flags 0 | prepare_end_lsn 0/1600100 | rollback_end_lsn 0/1600400 | prepare_ts 2 |
    /// rollback_ts 4 | xid 741 | "gx2"
    const ROLLBACK_PREPARED: &[u8] = b"r\x00\
        \x00\x00\x00\x00\x01\x60\x01\x00\
        \x00\x00\x00\x00\x01\x60\x04\x00\
        \x00\x00\x00\x00\x00\x00\x00\x02\
        \x00\x00\x00\x00\x00\x00\x00\x04\
        \x00\x00\x02\xe5gx2\x00";

    const AT: Lsn = Lsn(0x0152_92B0);
    /// PG15 capture commit_ts (2026-11-30 04:57:53.805492 UTC).
    const TS1: PgTimestamp = 849_329_873_805_492;

    fn decoder(in_stream: bool, parallel: bool) -> Decoder {
        Decoder {
            in_stream,
            parallel,
        }
    }

    /// Every test frame with the decoder state it must be decoded in.
    fn all_frames() -> Vec<(&'static [u8], bool, bool)> {
        let plain = [
            PG15_BEGIN,
            PG15_RELATION,
            PG15_INSERT,
            PG15_COMMIT,
            PG15_MESSAGE_TX,
            PG15_MESSAGE_NONTX,
            PG15_UPDATE,
            PG15_UPDATE_KEY,
            PG15_DELETE,
            PG15_TRUNCATE,
            PG15_STREAM_START_FIRST,
            PG15_STREAM_START_NEXT,
            PG15_STREAM_COMMIT,
            PG15_STREAM_ABORT,
            ORIGIN,
            UPDATE_FULL,
            DELETE_FULL,
            BEGIN_PREPARE,
            PREPARE,
            STREAM_PREPARE,
            COMMIT_PREPARED,
            ROLLBACK_PREPARED,
        ];
        let streamed = [
            PG15_STREAM_TYPE,
            PG15_STREAM_RELATION,
            PG15_STREAM_INSERT_BINARY,
            PG15_STREAM_STOP,
        ];
        let mut v: Vec<_> = plain.into_iter().map(|f| (f, false, false)).collect();
        v.extend(streamed.into_iter().map(|f| (f, true, false)));
        v.push((STREAM_ABORT_PARALLEL, false, true));
        v
    }

    fn ok(data: &'static [u8]) -> Message {
        decoder(false, false)
            .decode(Bytes::from_static(data), AT)
            .unwrap()
    }

    fn ok_streamed(data: &'static [u8]) -> Message {
        decoder(true, false)
            .decode(Bytes::from_static(data), AT)
            .unwrap()
    }

    fn text(s: &'static str) -> TupleValue {
        TupleValue::Text(Bytes::from_static(s.as_bytes()))
    }

    const UUID1: &str = "0b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6d";
    const UUID2: &str = "1b6f2a3e-8a6d-4c41-9d8e-2f1c3a4b5c6d";

    // ---- One test per message type ---------------------------------------------------------------

    #[test]
    fn begin() {
        assert_eq!(
            ok(PG15_BEGIN),
            Message::Begin {
                final_lsn: Lsn(0x0152_92B0),
                commit_ts: TS1,
                xid: 726
            }
        );
    }

    #[test]
    fn commit() {
        // end_lsn is what the consumer confirms (reference §2); it must follow commit_lsn.
        assert_eq!(
            ok(PG15_COMMIT),
            Message::Commit {
                flags: 0,
                commit_lsn: Lsn(0x0152_92B0),
                end_lsn: Lsn(0x0152_92E0),
                commit_ts: TS1
            }
        );
    }

    #[test]
    fn origin() {
        assert_eq!(
            ok(ORIGIN),
            Message::Origin {
                commit_lsn: Lsn(0x0152_92B0),
                name: "pg_16385".into()
            }
        );
    }

    #[test]
    fn relation() {
        let Message::Relation(rel) = ok(PG15_RELATION) else {
            panic!("not a relation")
        };
        let col = |flags, name: &str, type_oid| Column {
            flags,
            name: name.into(),
            type_oid,
            type_modifier: -1,
        };
        assert_eq!(
            rel,
            Relation {
                xid: None,
                id: 16384,
                namespace: "public".into(),
                name: "outbox".into(),
                replica_identity: b'd',
                // uuid 2950, text 25, jsonb 3802
                columns: vec![
                    col(1, "id", 2950),
                    col(0, "aggregate_type", 25),
                    col(0, "payload", 3802)
                ],
            }
        );
        assert!(rel.columns[0].is_key());
        assert!(!rel.columns[1].is_key());
    }

    #[test]
    fn type_in_stream() {
        assert_eq!(
            ok_streamed(PG15_STREAM_TYPE),
            Message::Type {
                xid: Some(735),
                id: 16398,
                namespace: "public".into(),
                name: "mood".into()
            }
        );
    }

    #[test]
    fn insert() {
        assert_eq!(
            ok(PG15_INSERT),
            Message::Insert {
                xid: None,
                relation_id: 16384,
                new: vec![text(UUID1), text("order"), text(r#"{"a": 1}"#)],
            }
        );
    }

    #[test]
    fn insert_values_are_slices_of_the_input() {
        let data = Bytes::from_static(PG15_INSERT);
        let Message::Insert { new, .. } = Decoder::new().decode(data.clone(), AT).unwrap() else {
            panic!("not an insert")
        };
        let TupleValue::Text(uuid) = &new[0] else {
            panic!("not text")
        };
        // Zero-copy: the value points into the original buffer.
        let start = data.as_ptr() as usize;
        let p = uuid.as_ptr() as usize;
        assert!(p >= start && p + uuid.len() <= start + data.len());
    }

    #[test]
    fn update_without_old_tuple() {
        assert_eq!(
            ok(PG15_UPDATE),
            Message::Update {
                xid: None,
                relation_id: 16384,
                old: None,
                new: vec![text(UUID1), text("order"), text(r#"{"a": 2}"#)],
            }
        );
    }

    #[test]
    fn update_with_old_key() {
        assert_eq!(
            ok(PG15_UPDATE_KEY),
            Message::Update {
                xid: None,
                relation_id: 16384,
                old: Some(OldTuple::Key(vec![
                    text(UUID1),
                    TupleValue::Null,
                    TupleValue::Null
                ])),
                new: vec![text(UUID2), text("order"), TupleValue::Null],
            }
        );
    }

    #[test]
    fn update_with_full_old_row_and_unchanged_toast() {
        assert_eq!(
            ok(UPDATE_FULL),
            Message::Update {
                xid: None,
                relation_id: 16384,
                old: Some(OldTuple::Full(vec![text("1"), text("a")])),
                new: vec![text("1"), TupleValue::UnchangedToast],
            }
        );
    }

    #[test]
    fn delete() {
        assert_eq!(
            ok(PG15_DELETE),
            Message::Delete {
                xid: None,
                relation_id: 16384,
                old: OldTuple::Key(vec![text(UUID2), TupleValue::Null, TupleValue::Null]),
            }
        );
        assert_eq!(
            ok(DELETE_FULL),
            Message::Delete {
                xid: None,
                relation_id: 16384,
                old: OldTuple::Full(vec![text("1"), TupleValue::Null]),
            }
        );
    }

    #[test]
    fn truncate() {
        assert_eq!(
            ok(PG15_TRUNCATE),
            Message::Truncate {
                xid: None,
                options: 0,
                relation_ids: vec![16384]
            }
        );
    }

    #[test]
    fn logical_messages() {
        let content = Bytes::from_static(br#"{"a":1}"#);
        assert_eq!(
            ok(PG15_MESSAGE_TX),
            Message::Message {
                xid: None,
                transactional: true,
                lsn: Lsn(0x0152_9320),
                prefix: "outbox".into(),
                content: content.clone(),
            }
        );
        // lsn equals what pg_logical_emit_message returned (0/1529390): the end of the record.
        assert_eq!(
            ok(PG15_MESSAGE_NONTX),
            Message::Message {
                xid: None,
                transactional: false,
                lsn: Lsn(0x0152_9390),
                prefix: "outbox".into(),
                content,
            }
        );
    }

    #[test]
    fn stream_start_and_stop() {
        let mut d = Decoder::new();
        assert_eq!(
            d.decode(Bytes::from_static(PG15_STREAM_START_FIRST), AT),
            Ok(Message::StreamStart {
                xid: 735,
                first_segment: true
            })
        );
        assert!(d.in_stream());
        assert_eq!(
            d.decode(Bytes::from_static(PG15_STREAM_STOP), AT),
            Ok(Message::StreamStop)
        );
        assert!(!d.in_stream());
        assert_eq!(
            d.decode(Bytes::from_static(PG15_STREAM_START_NEXT), AT),
            Ok(Message::StreamStart {
                xid: 735,
                first_segment: false
            })
        );
    }

    #[test]
    fn stream_commit() {
        assert_eq!(
            ok(PG15_STREAM_COMMIT),
            Message::StreamCommit {
                xid: 735,
                flags: 0,
                commit_lsn: Lsn(0x0156_C328),
                end_lsn: Lsn(0x0156_C358),
                commit_ts: 849_329_881_340_811,
            }
        );
    }

    #[test]
    fn stream_abort_without_and_with_parallel_fields() {
        assert_eq!(
            ok(PG15_STREAM_ABORT),
            Message::StreamAbort {
                xid: 736,
                subxid: 736,
                abort_lsn: None,
                abort_ts: None
            }
        );
        assert_eq!(
            Decoder::with_parallel_streaming(true)
                .decode(Bytes::from_static(STREAM_ABORT_PARALLEL), AT),
            Ok(Message::StreamAbort {
                xid: 737,
                subxid: 738,
                abort_lsn: Some(Lsn(0x015A_5948)),
                abort_ts: Some(1)
            })
        );
        // The same bytes without parallel mode have 16 bytes too many.
        let err = Decoder::new()
            .decode(Bytes::from_static(STREAM_ABORT_PARALLEL), AT)
            .unwrap_err();
        assert!(err.reason.contains("16 trailing bytes"), "{err}");
    }

    #[test]
    fn two_phase_messages() {
        let gid = || "gx1".to_string();
        assert_eq!(
            ok(BEGIN_PREPARE),
            Message::BeginPrepare {
                prepare_lsn: Lsn(0x0160_0000),
                end_lsn: Lsn(0x0160_0100),
                prepare_ts: 2,
                xid: 740,
                gid: gid()
            }
        );
        assert_eq!(
            ok(PREPARE),
            Message::Prepare {
                flags: 0,
                prepare_lsn: Lsn(0x0160_0000),
                end_lsn: Lsn(0x0160_0100),
                prepare_ts: 2,
                xid: 740,
                gid: gid()
            }
        );
        assert_eq!(
            ok(STREAM_PREPARE),
            Message::StreamPrepare {
                flags: 0,
                prepare_lsn: Lsn(0x0160_0000),
                end_lsn: Lsn(0x0160_0100),
                prepare_ts: 2,
                xid: 740,
                gid: gid()
            }
        );
        assert_eq!(
            ok(COMMIT_PREPARED),
            Message::CommitPrepared {
                flags: 0,
                commit_lsn: Lsn(0x0160_0200),
                end_lsn: Lsn(0x0160_0300),
                commit_ts: 3,
                xid: 740,
                gid: gid()
            }
        );
        assert_eq!(
            ok(ROLLBACK_PREPARED),
            Message::RollbackPrepared {
                flags: 0,
                prepare_end_lsn: Lsn(0x0160_0100),
                rollback_end_lsn: Lsn(0x0160_0400),
                prepare_ts: 2,
                rollback_ts: 4,
                xid: 741,
                gid: "gx2".into()
            }
        );
    }

    // ---- The xid prefix follows stream state -----------------------------------------------------

    #[test]
    fn captured_stream_decodes_in_sequence_with_xid_prefix_only_inside() {
        let mut d = Decoder::new();
        let mut next = |f: &'static [u8]| d.decode(Bytes::from_static(f), AT).unwrap();
        assert!(matches!(
            next(PG15_STREAM_START_FIRST),
            Message::StreamStart { .. }
        ));
        assert!(matches!(
            next(PG15_STREAM_TYPE),
            Message::Type { xid: Some(735), .. }
        ));
        let Message::Relation(rel) = next(PG15_STREAM_RELATION) else {
            panic!("not a relation")
        };
        assert_eq!(
            (rel.xid, rel.id, rel.name.as_str()),
            (Some(735), 16403, "big")
        );
        assert_eq!(
            next(PG15_STREAM_INSERT_BINARY),
            Message::Insert {
                xid: Some(735),
                relation_id: 16403,
                new: vec![
                    TupleValue::Binary(Bytes::from_static(&[0, 0, 0, 1])),
                    TupleValue::Binary(Bytes::from_static(b"ok")),
                    TupleValue::Binary(Bytes::from(vec![b'x'; 100])),
                ],
            }
        );
        assert_eq!(next(PG15_STREAM_STOP), Message::StreamStop);
        // After 'E' the same change bytes are read without a prefix again: the captured unstreamed
        // insert decodes, and the streamed one no longer does (its xid is read as the relid).
        assert!(matches!(
            next(PG15_INSERT),
            Message::Insert { xid: None, .. }
        ));
        assert!(matches!(
            next(PG15_STREAM_COMMIT),
            Message::StreamCommit { .. }
        ));
        assert!(
            d.decode(Bytes::from_static(PG15_STREAM_INSERT_BINARY), AT)
                .is_err()
        );
    }

    #[test]
    fn unstreamed_change_inside_a_stream_is_misaligned() {
        // Inside S…E, the first 4 bytes after the tag are the xid; the captured unstreamed insert
        // then has no 'N' where one must be.
        let err = decoder(true, false)
            .decode(Bytes::from_static(PG15_INSERT), AT)
            .unwrap_err();
        assert!(err.reason.contains("tuple marker"), "{err}");
    }

    #[test]
    fn stream_blocks_do_not_nest() {
        let mut d = Decoder::new();
        let err = d
            .decode(Bytes::from_static(PG15_STREAM_STOP), AT)
            .unwrap_err();
        assert!(err.reason.contains("outside"), "{err}");
        d.decode(Bytes::from_static(PG15_STREAM_START_FIRST), AT)
            .unwrap();
        let err = d
            .decode(Bytes::from_static(PG15_STREAM_START_NEXT), AT)
            .unwrap_err();
        assert!(err.reason.contains("inside"), "{err}");
        assert!(d.in_stream(), "a failed decode must not change state");
    }

    #[test]
    fn failed_decode_keeps_state() {
        let mut d = Decoder::new();
        assert!(d.decode(Bytes::from_static(b"S\x00\x00"), AT).is_err());
        assert!(!d.in_stream());
    }

    // ---- Malformed input -------------------------------------------------------------------------

    #[test]
    fn every_truncation_of_every_frame_is_an_error() {
        for (frame, in_stream, parallel) in all_frames() {
            // The full frame decodes…
            decoder(in_stream, parallel)
                .decode(Bytes::from_static(frame), AT)
                .unwrap_or_else(|e| panic!("{e}: {frame:?}"));
            // …and no proper prefix does.
            for len in 0..frame.len() {
                let prefix = Bytes::copy_from_slice(&frame[..len]);
                let r = decoder(in_stream, parallel).decode(prefix, AT);
                assert!(r.is_err(), "prefix {len} of {frame:?} decoded: {r:?}");
            }
        }
    }

    #[test]
    fn trailing_byte_is_an_error() {
        for (frame, in_stream, parallel) in all_frames() {
            let mut long = frame.to_vec();
            long.push(0);
            let err = decoder(in_stream, parallel)
                .decode(Bytes::from(long), AT)
                .unwrap_err();
            assert!(err.reason.contains("1 trailing bytes"), "{err}");
        }
    }

    #[test]
    fn unknown_tag_names_tag_and_lsn() {
        let err = Decoder::new()
            .decode(Bytes::from_static(b"Zxyz"), Lsn(0x16_B374_D848))
            .unwrap_err();
        assert_eq!(err.tag, TagName(Some(b'Z')));
        assert_eq!(
            err.to_string(),
            "cannot decode pgoutput message 'Z' at 16/B374D848: unknown message type"
        );
        let err = Decoder::new()
            .decode(Bytes::from_static(b"\x7f"), AT)
            .unwrap_err();
        assert!(
            err.to_string().contains("message 0x7f at 0/15292B0"),
            "{err}"
        );
        let err = Decoder::new().decode(Bytes::new(), AT).unwrap_err();
        assert!(err.to_string().contains("message <empty> at"), "{err}");
    }

    #[test]
    fn truncation_error_names_tag_and_lsn() {
        let err = Decoder::new()
            .decode(Bytes::from_static(&PG15_INSERT[..20]), AT)
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with(
                "cannot decode pgoutput message 'I' at 0/15292B0: tuple column 0: truncated"
            ),
            "{msg}"
        );
    }

    #[test]
    fn bad_column_kind_is_an_error() {
        let err = Decoder::new()
            .decode(Bytes::from_static(b"I\x00\x00@\x00N\x00\x01x"), AT)
            .unwrap_err();
        assert!(err.reason.contains("unknown column kind 'x'"), "{err}");
    }

    #[test]
    fn negative_lengths_and_counts_are_errors() {
        let cases: [(&[u8], &str); 4] = [
            (
                b"I\x00\x00@\x00N\xff\xff",
                "negative number of tuple columns",
            ),
            (
                b"I\x00\x00@\x00N\x00\x01t\xff\xff\xff\xff",
                "negative value length",
            ),
            (b"T\xff\xff\xff\xff\x00", "negative number of relations"),
            (
                b"M\x01\x00\x00\x00\x00\x00\x00\x00\x01p\x00\x80\x00\x00\x00",
                "negative content length",
            ),
        ];
        for (bytes, want) in cases {
            let err = Decoder::new()
                .decode(Bytes::from_static(bytes), AT)
                .unwrap_err();
            assert!(err.reason.contains(want), "{err}");
        }
        let err = Decoder::new()
            .decode(Bytes::from_static(b"R\x00\x00@\x00\x00t\x00d\xff\xfe"), AT)
            .unwrap_err();
        assert!(err.reason.contains("negative number of columns"), "{err}");
    }

    #[test]
    fn bad_strings_and_markers_are_errors() {
        let err = Decoder::new()
            .decode(
                Bytes::from_static(b"O\x00\x00\x00\x00\x00\x00\x00\x01\xff\x00"),
                AT,
            )
            .unwrap_err();
        assert!(err.reason.contains("not UTF-8"), "{err}");
        let err = Decoder::new()
            .decode(Bytes::from_static(b"D\x00\x00@\x00N\x00\x00"), AT)
            .unwrap_err();
        assert!(
            err.reason
                .contains("expected tuple marker 'K' or 'O', got 'N'"),
            "{err}"
        );
        let err = Decoder::new()
            .decode(Bytes::from_static(b"U\x00\x00@\x00K\x00\x00K\x00\x00"), AT)
            .unwrap_err();
        assert!(
            err.reason.contains("expected tuple marker 'N', got 'K'"),
            "{err}"
        );
        let err = Decoder::new()
            .decode(Bytes::from_static(b"S\x00\x00\x00\x01\x02"), AT)
            .unwrap_err();
        assert!(err.reason.contains("first_segment"), "{err}");
    }

    #[test]
    fn encoder_reproduces_captured_frames() {
        for (frame, in_stream, parallel) in all_frames() {
            let msg = decoder(in_stream, parallel)
                .decode(Bytes::from_static(frame), AT)
                .unwrap();
            assert_eq!(encode::message(&msg), frame, "{msg:?}");
        }
    }

    // ---- Properties ------------------------------------------------------------------------------

    fn lsn() -> impl Strategy<Value = Lsn> {
        any::<u64>().prop_map(Lsn)
    }

    fn name() -> impl Strategy<Value = String> {
        "[^\\x00]{0,12}"
    }

    fn bytes() -> impl Strategy<Value = Bytes> {
        prop::collection::vec(any::<u8>(), 0..24).prop_map(Bytes::from)
    }

    fn tuple() -> impl Strategy<Value = Vec<TupleValue>> {
        let value = prop_oneof![
            Just(TupleValue::Null),
            Just(TupleValue::UnchangedToast),
            bytes().prop_map(TupleValue::Text),
            bytes().prop_map(TupleValue::Binary),
        ];
        prop::collection::vec(value, 0..6)
    }

    fn old_tuple() -> impl Strategy<Value = OldTuple> {
        prop_oneof![
            tuple().prop_map(OldTuple::Key),
            tuple().prop_map(OldTuple::Full)
        ]
    }

    fn xid() -> impl Strategy<Value = Option<u32>> {
        proptest::option::of(any::<u32>())
    }

    /// Messages whose layout depends on stream state (the `[X]` prefix).
    fn change_message() -> impl Strategy<Value = Message> {
        let column = (any::<u8>(), name(), any::<u32>(), any::<i32>()).prop_map(
            |(flags, name, type_oid, type_modifier)| Column {
                flags,
                name,
                type_oid,
                type_modifier,
            },
        );
        let relation = (
            xid(),
            any::<u32>(),
            name(),
            name(),
            any::<u8>(),
            prop::collection::vec(column, 0..5),
        )
            .prop_map(|(xid, id, namespace, name, replica_identity, columns)| {
                Message::Relation(Relation {
                    xid,
                    id,
                    namespace,
                    name,
                    replica_identity,
                    columns,
                })
            });
        prop_oneof![
            relation,
            (xid(), any::<u32>(), name(), name()).prop_map(|(xid, id, namespace, name)| {
                Message::Type {
                    xid,
                    id,
                    namespace,
                    name,
                }
            }),
            (xid(), any::<u32>(), tuple()).prop_map(|(xid, relation_id, new)| Message::Insert {
                xid,
                relation_id,
                new
            }),
            (
                xid(),
                any::<u32>(),
                proptest::option::of(old_tuple()),
                tuple()
            )
                .prop_map(|(xid, relation_id, old, new)| Message::Update {
                    xid,
                    relation_id,
                    old,
                    new
                }),
            (xid(), any::<u32>(), old_tuple()).prop_map(|(xid, relation_id, old)| {
                Message::Delete {
                    xid,
                    relation_id,
                    old,
                }
            }),
            (
                xid(),
                any::<u8>(),
                prop::collection::vec(any::<u32>(), 0..5)
            )
                .prop_map(|(xid, options, relation_ids)| Message::Truncate {
                    xid,
                    options,
                    relation_ids
                }),
            (xid(), any::<bool>(), lsn(), name(), bytes()).prop_map(
                |(xid, transactional, lsn, prefix, content)| Message::Message {
                    xid,
                    transactional,
                    lsn,
                    prefix,
                    content,
                }
            ),
        ]
    }

    /// Transaction-framing messages (no xid prefix).
    fn frame_message() -> impl Strategy<Value = Message> {
        let ts = any::<i64>;
        let abort_info = proptest::option::of((lsn(), ts()));
        prop_oneof![
            (lsn(), ts(), any::<u32>()).prop_map(|(final_lsn, commit_ts, xid)| Message::Begin {
                final_lsn,
                commit_ts,
                xid
            }),
            (any::<u8>(), lsn(), lsn(), ts()).prop_map(
                |(flags, commit_lsn, end_lsn, commit_ts)| {
                    Message::Commit {
                        flags,
                        commit_lsn,
                        end_lsn,
                        commit_ts,
                    }
                }
            ),
            (lsn(), name()).prop_map(|(commit_lsn, name)| Message::Origin { commit_lsn, name }),
            (any::<u32>(), any::<bool>())
                .prop_map(|(xid, first_segment)| { Message::StreamStart { xid, first_segment } }),
            Just(Message::StreamStop),
            (any::<u32>(), any::<u8>(), lsn(), lsn(), ts()).prop_map(
                |(xid, flags, commit_lsn, end_lsn, commit_ts)| Message::StreamCommit {
                    xid,
                    flags,
                    commit_lsn,
                    end_lsn,
                    commit_ts,
                }
            ),
            (any::<u32>(), any::<u32>(), abort_info).prop_map(|(xid, subxid, info)| {
                Message::StreamAbort {
                    xid,
                    subxid,
                    abort_lsn: info.map(|(l, _)| l),
                    abort_ts: info.map(|(_, t)| t),
                }
            }),
            (lsn(), lsn(), ts(), any::<u32>(), name()).prop_map(
                |(prepare_lsn, end_lsn, prepare_ts, xid, gid)| Message::BeginPrepare {
                    prepare_lsn,
                    end_lsn,
                    prepare_ts,
                    xid,
                    gid,
                }
            ),
            (
                any::<u8>(),
                lsn(),
                lsn(),
                ts(),
                any::<u32>(),
                name(),
                0..3u8
            )
                .prop_map(|(flags, a, b, t, xid, gid, which)| match which {
                    0 => Message::Prepare {
                        flags,
                        prepare_lsn: a,
                        end_lsn: b,
                        prepare_ts: t,
                        xid,
                        gid,
                    },
                    1 => Message::StreamPrepare {
                        flags,
                        prepare_lsn: a,
                        end_lsn: b,
                        prepare_ts: t,
                        xid,
                        gid,
                    },
                    _ => Message::CommitPrepared {
                        flags,
                        commit_lsn: a,
                        end_lsn: b,
                        commit_ts: t,
                        xid,
                        gid,
                    },
                }),
            (any::<u8>(), lsn(), lsn(), ts(), ts(), any::<u32>(), name()).prop_map(
                |(flags, prepare_end_lsn, rollback_end_lsn, prepare_ts, rollback_ts, xid, gid)| {
                    Message::RollbackPrepared {
                        flags,
                        prepare_end_lsn,
                        rollback_end_lsn,
                        prepare_ts,
                        rollback_ts,
                        xid,
                        gid,
                    }
                }
            ),
        ]
    }

    /// The decoder state in which `msg`'s encoding is valid.
    fn decoder_for(msg: &Message) -> Decoder {
        let in_stream = match msg {
            Message::Relation(r) => r.xid.is_some(),
            Message::Type { xid, .. }
            | Message::Insert { xid, .. }
            | Message::Update { xid, .. }
            | Message::Delete { xid, .. }
            | Message::Truncate { xid, .. }
            | Message::Message { xid, .. } => xid.is_some(),
            Message::StreamStop => true,
            _ => false,
        };
        let parallel = matches!(
            msg,
            Message::StreamAbort {
                abort_lsn: Some(_),
                ..
            }
        );
        decoder(in_stream, parallel)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn arbitrary_bytes_never_panic(
            data in prop::collection::vec(any::<u8>(), 0..96),
            in_stream: bool,
            parallel: bool,
        ) {
            let _ = decoder(in_stream, parallel).decode(Bytes::from(data), AT);
        }

        #[test]
        fn mutated_frames_never_panic(
            which in 0..all_frames().len(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        ) {
            let (frame, in_stream, parallel) = all_frames()[which];
            let mut data = frame.to_vec();
            for (at, byte) in edits {
                let i = at.index(data.len());
                data[i] = byte;
            }
            let _ = decoder(in_stream, parallel).decode(Bytes::from(data), AT);
        }

        #[test]
        fn round_trip(msg in prop_oneof![change_message(), frame_message()]) {
            let wire = encode::message(&msg);
            let mut d = decoder_for(&msg);
            prop_assert_eq!(d.decode(wire.clone(), AT), Ok(msg.clone()));
            // Every proper prefix of a valid encoding is rejected.
            for len in 0..wire.len() {
                prop_assert!(decoder_for(&msg).decode(wire.slice(..len), AT).is_err());
            }
        }
    }
}
