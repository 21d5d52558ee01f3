//! The decoder proper: [`Decoder::decode`] and the bounds-checked [`Reader`] under it. One function
//! per message layout, each returning a [`Malformed`] on any mismatch; `decode` adds the tag and the WAL
//! position. No I/O and no allocation beyond the decoded names and vectors.

use bytes::Bytes;

use super::{Column, DecodeError, Malformed, Message, OldTuple, Relation, TagName, TupleValue};
use crate::Lsn;

/// Stateful only for what the wire format requires: whether we are inside a Stream Start…Stop block
/// (then change messages carry an xid prefix) and whether Stream Abort carries abort_lsn/ts
/// (`streaming 'parallel'`). Use one decoder per replication connection; make a new one on reconnect.
#[derive(Debug, Default, Clone)]
pub struct Decoder {
    // pub(super): the unit tests build decoders in every state directly.
    pub(super) in_stream: bool,
    pub(super) parallel: bool,
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

    /// True between a decoded Stream Start and the next Stream Stop. For the tests: the relay reads
    /// the state from the messages it is given.
    #[cfg(test)]
    pub(crate) fn in_stream(&self) -> bool {
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
    fn stream_xid(&self, r: &mut Reader) -> Result<Option<u32>, Malformed> {
        if self.in_stream {
            r.u32("xid").map(Some)
        } else {
            Ok(None)
        }
    }

    fn message(&self, r: &mut Reader) -> Result<Message, Malformed> {
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
            b'U' => self.update(r)?,
            b'D' => self.delete(r)?,
            b'T' => self.truncate(r)?,
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
            b'S' | b'E' | b'c' | b'A' => self.stream_control(tag, r)?,
            b'b' | b'P' | b'p' | b'K' | b'r' => two_phase(tag, r)?,
            _ => return Err(Malformed::UnknownMessageType),
        };
        Ok(msg)
    }

    /// Update: an optional old tuple (key or full), then the new one.
    fn update(&self, r: &mut Reader) -> Result<Message, Malformed> {
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
        Ok(Message::Update {
            xid,
            relation_id,
            old,
            new: tuple(r)?,
        })
    }

    /// Delete: the old tuple (key or full).
    fn delete(&self, r: &mut Reader) -> Result<Message, Malformed> {
        let xid = self.stream_xid(r)?;
        let relation_id = r.u32("relation id")?;
        // Deletes without an old tuple are never sent (pgoutput.c skips them), so 'K'/'O' is
        // mandatory here.
        let old = match r.u8("tuple marker")? {
            b'K' => OldTuple::Key(tuple(r)?),
            b'O' => OldTuple::Full(tuple(r)?),
            other => return Err(unexpected_marker(other, "'K' or 'O'")),
        };
        Ok(Message::Delete {
            xid,
            relation_id,
            old,
        })
    }

    /// Truncate: the relations and the options.
    fn truncate(&self, r: &mut Reader) -> Result<Message, Malformed> {
        let xid = self.stream_xid(r)?;
        let nrels = r.count32("number of relations")?;
        let options = r.u8("truncate options")?;
        // Capacity bounded by the bytes actually present: a lying count cannot make us allocate.
        let mut relation_ids = Vec::with_capacity(nrels.min(r.remaining() / 4));
        for _ in 0..nrels {
            relation_ids.push(r.u32("relation id")?);
        }
        Ok(Message::Truncate {
            xid,
            options,
            relation_ids,
        })
    }

    /// The streaming protocol's block and transaction markers (never requested by the relay, decoded
    /// for completeness and for the tests).
    fn stream_control(&self, tag: u8, r: &mut Reader) -> Result<Message, Malformed> {
        Ok(match tag {
            b'S' => {
                if self.in_stream {
                    // pgoutput never nests blocks (reorderbuffer.c pairs stream_start/stream_stop);
                    // a second 'S' means we lost an 'E' and would misread the xid prefixes.
                    return Err(Malformed::StreamStartInsideBlock);
                }
                Message::StreamStart {
                    xid: r.u32("xid")?,
                    first_segment: match r.u8("first_segment")? {
                        0 => false,
                        1 => true,
                        other => return Err(Malformed::FirstSegment(other)),
                    },
                }
            }
            b'E' => {
                if !self.in_stream {
                    return Err(Malformed::StreamStopOutsideBlock);
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
            _ => return Err(Malformed::UnknownMessageType),
        })
    }

    fn relation(&self, r: &mut Reader) -> Result<Relation, Malformed> {
        let xid = self.stream_xid(r)?;
        let id = r.u32("relation id")?;
        let namespace = r.cstr("namespace")?;
        let name = r.cstr("relation name")?;
        let replica_identity = r.u8("replica identity")?;
        let ncols = r.count16("number of columns")?;
        // Each column needs at least 10 bytes (flags, empty name, oid, typmod).
        let mut columns = Vec::with_capacity(ncols.min(r.remaining() / 10));
        for i in 0..ncols {
            columns.push(column(r).map_err(|e| Malformed::Column {
                index: i,
                reason: Box::new(e),
            })?);
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

/// Two-phase commit messages (never requested by the relay, decoded for completeness and for the
/// tests).
fn two_phase(tag: u8, r: &mut Reader) -> Result<Message, Malformed> {
    Ok(match tag {
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
        _ => return Err(Malformed::UnknownMessageType),
    })
}

/// TupleData: `i16 ncols | ncols × (u8 kind [i32 len | bytes])` (proto.c `logicalrep_write_tuple`).
/// ncols is not checked against the relation here: there is no relation cache in this module.
fn tuple(r: &mut Reader) -> Result<Vec<TupleValue>, Malformed> {
    let ncols = r.count16("number of tuple columns")?;
    // One byte per column at least: bound the capacity by what is really there.
    let mut values = Vec::with_capacity(ncols.min(r.remaining()));
    for i in 0..ncols {
        values.push(tuple_value(r).map_err(|e| Malformed::TupleColumn {
            index: i,
            reason: Box::new(e),
        })?);
    }
    Ok(values)
}

fn column(r: &mut Reader) -> Result<Column, Malformed> {
    Ok(Column {
        flags: r.u8("flags")?,
        name: r.cstr("name")?,
        type_oid: r.u32("type oid")?,
        type_modifier: r.i32("type modifier")?,
    })
}

fn tuple_value(r: &mut Reader) -> Result<TupleValue, Malformed> {
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
            return Err(Malformed::UnknownColumnKind(other));
        }
    })
}

fn unexpected_marker(got: u8, expected: &'static str) -> Malformed {
    Malformed::UnexpectedMarker { got, expected }
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

    fn truncated(&self, need: usize, what: &'static str) -> Malformed {
        Malformed::Truncated {
            what,
            need,
            offset: self.pos,
            left: self.remaining(),
        }
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], Malformed> {
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

    fn u8(&mut self, what: &'static str) -> Result<u8, Malformed> {
        self.array::<1>(what).map(|[b]| b)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, Malformed> {
        self.array(what).map(u32::from_be_bytes)
    }

    fn i32(&mut self, what: &'static str) -> Result<i32, Malformed> {
        self.array(what).map(i32::from_be_bytes)
    }

    fn i64(&mut self, what: &'static str) -> Result<i64, Malformed> {
        self.array(what).map(i64::from_be_bytes)
    }

    fn lsn(&mut self, what: &'static str) -> Result<Lsn, Malformed> {
        self.array(what).map(|b| Lsn(u64::from_be_bytes(b)))
    }

    /// An i16 count (columns); Postgres sends it signed, so a negative one is an error, not a huge loop.
    fn count16(&mut self, what: &'static str) -> Result<usize, Malformed> {
        let n = i16::from_be_bytes(self.array(what)?);
        usize::try_from(n).map_err(|_| Malformed::Negative { what, n: n.into() })
    }

    /// An i32 count or length; negative is an error.
    fn count32(&mut self, what: &'static str) -> Result<usize, Malformed> {
        let n = i32::from_be_bytes(self.array(what)?);
        usize::try_from(n).map_err(|_| Malformed::Negative { what, n })
    }

    /// `len` bytes as a slice of the input (no copy).
    fn bytes(&mut self, len: usize, what: &'static str) -> Result<Bytes, Malformed> {
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
    fn cstr(&mut self, what: &'static str) -> Result<String, Malformed> {
        let rest = self.data.get(self.pos..).unwrap_or_default();
        let Some(nul) = rest.iter().position(|&b| b == 0) else {
            return Err(Malformed::Unterminated {
                what,
                offset: self.pos,
            });
        };
        let s = rest.get(..nul).unwrap_or_default();
        let s = std::str::from_utf8(s)
            .map_err(|utf8| Malformed::NotUtf8 {
                what,
                offset: self.pos,
                utf8,
            })?
            .to_owned();
        self.pos = self.pos.saturating_add(nul + 1);
        Ok(s)
    }

    /// A complete message must use every byte: leftovers mean we and the server disagree on the layout.
    fn finish(&self) -> Result<(), Malformed> {
        match self.remaining() {
            0 => Ok(()),
            left => Err(Malformed::TrailingBytes {
                left,
                offset: self.pos,
            }),
        }
    }
}
