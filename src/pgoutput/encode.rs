//! Builds pgoutput wire bytes from [`Message`]s: the inverse of
//! [`Decoder::decode`](crate::pgoutput::Decoder::decode), for round-trip tests, benchmarks and fake
//! servers. Not used on the production path.
//!
//! The `[X]` prefix is written iff the message's `xid` is `Some`, and Stream Abort's abort fields iff
//! they are `Some`; decode the result with a decoder in the matching stream/parallel state.
//!
//! Compiled for the crate's unit tests and with the `test-support` feature (integration tests,
//! benches, the fuzz seed corpus): the relay itself never writes pgoutput.
//!
//! # Panics
//!
//! On messages the wire format cannot carry: strings containing NUL, more than `i16::MAX` columns,
//! more than `i32::MAX` relations or bytes.

use bytes::{BufMut, Bytes, BytesMut};

use super::{Message, OldTuple, Relation, TupleValue};

/// The wire bytes of one message.
pub fn message(msg: &Message) -> Bytes {
    let mut out = BytesMut::with_capacity(64);
    write(msg, &mut out);
    out.freeze()
}

/// Appends the wire bytes of one message to `out`: one step per message kind.
pub(crate) fn write(msg: &Message, out: &mut BytesMut) {
    match msg {
        Message::Begin { .. } => begin(msg, out),
        Message::Commit { .. } => commit(msg, out),
        Message::Origin { commit_lsn, name } => {
            out.put_u8(b'O');
            out.put_u64(commit_lsn.0);
            cstr(out, name);
        }
        Message::Relation(rel) => relation(rel, out),
        Message::Type { .. } => type_(msg, out),
        Message::Insert { .. } => insert(msg, out),
        Message::Update { .. } => update(msg, out),
        Message::Delete { .. } => delete(msg, out),
        Message::Truncate { .. } => truncate(msg, out),
        Message::Message { .. } => logical_message(msg, out),
        Message::StreamStart { xid, first_segment } => {
            out.put_u8(b'S');
            out.put_u32(*xid);
            out.put_u8(u8::from(*first_segment));
        }
        Message::StreamStop => out.put_u8(b'E'),
        Message::StreamCommit { .. } => stream_commit(msg, out),
        Message::StreamAbort { .. } => stream_abort(msg, out),
        Message::BeginPrepare { .. } => begin_prepare(msg, out),
        Message::Prepare { .. } | Message::StreamPrepare { .. } => prepare(msg, out),
        Message::CommitPrepared { .. } => commit_prepared(msg, out),
        Message::RollbackPrepared { .. } => rollback_prepared(msg, out),
    }
}

/// `write` called a step with a message of another kind.
fn wrong_kind(msg: &Message) -> ! {
    unreachable!("encoder step called with another kind of message: {msg:?}")
}

/// Begin (`B`).
fn begin(msg: &Message, out: &mut BytesMut) {
    let Message::Begin {
        final_lsn,
        commit_ts,
        xid,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'B');
    out.put_u64(final_lsn.0);
    out.put_i64(*commit_ts);
    out.put_u32(*xid);
}

/// Commit (`C`).
fn commit(msg: &Message, out: &mut BytesMut) {
    let Message::Commit {
        flags,
        commit_lsn,
        end_lsn,
        commit_ts,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'C');
    out.put_u8(*flags);
    out.put_u64(commit_lsn.0);
    out.put_u64(end_lsn.0);
    out.put_i64(*commit_ts);
}

/// Relation (`R`), with its columns.
fn relation(rel: &Relation, out: &mut BytesMut) {
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

/// Type (`Y`).
fn type_(msg: &Message, out: &mut BytesMut) {
    let Message::Type {
        xid: x,
        id,
        namespace,
        name,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'Y');
    xid(out, *x);
    out.put_u32(*id);
    cstr(out, namespace);
    cstr(out, name);
}

/// Insert (`I`).
fn insert(msg: &Message, out: &mut BytesMut) {
    let Message::Insert {
        xid: x,
        relation_id,
        new,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'I');
    xid(out, *x);
    out.put_u32(*relation_id);
    out.put_u8(b'N');
    tuple(new, out);
}

/// Update (`U`), with the old tuple when there is one.
fn update(msg: &Message, out: &mut BytesMut) {
    let Message::Update {
        xid: x,
        relation_id,
        old,
        new,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'U');
    xid(out, *x);
    out.put_u32(*relation_id);
    if let Some(old) = old {
        old_tuple(old, out);
    }
    out.put_u8(b'N');
    tuple(new, out);
}

/// Delete (`D`).
fn delete(msg: &Message, out: &mut BytesMut) {
    let Message::Delete {
        xid: x,
        relation_id,
        old,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'D');
    xid(out, *x);
    out.put_u32(*relation_id);
    old_tuple(old, out);
}

/// Truncate (`T`).
fn truncate(msg: &Message, out: &mut BytesMut) {
    let Message::Truncate {
        xid: x,
        options,
        relation_ids,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'T');
    xid(out, *x);
    count32(out, relation_ids.len());
    out.put_u8(*options);
    for id in relation_ids {
        out.put_u32(*id);
    }
}

/// Logical decoding message (`M`).
fn logical_message(msg: &Message, out: &mut BytesMut) {
    let Message::Message {
        xid: x,
        transactional,
        lsn,
        prefix,
        content,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'M');
    xid(out, *x);
    out.put_u8(u8::from(*transactional));
    out.put_u64(lsn.0);
    cstr(out, prefix);
    count32(out, content.len());
    out.put_slice(content);
}

/// Stream Commit (`c`).
fn stream_commit(msg: &Message, out: &mut BytesMut) {
    let Message::StreamCommit {
        xid,
        flags,
        commit_lsn,
        end_lsn,
        commit_ts,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'c');
    out.put_u32(*xid);
    out.put_u8(*flags);
    out.put_u64(commit_lsn.0);
    out.put_u64(end_lsn.0);
    out.put_i64(*commit_ts);
}

/// Stream Abort (`A`), with the abort fields when they are `Some`.
fn stream_abort(msg: &Message, out: &mut BytesMut) {
    let Message::StreamAbort {
        xid,
        subxid,
        abort_lsn,
        abort_ts,
    } = msg
    else {
        wrong_kind(msg)
    };
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

/// Begin Prepare (`b`).
fn begin_prepare(msg: &Message, out: &mut BytesMut) {
    let Message::BeginPrepare {
        prepare_lsn,
        end_lsn,
        prepare_ts,
        xid,
        gid,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'b');
    out.put_u64(prepare_lsn.0);
    out.put_u64(end_lsn.0);
    out.put_i64(*prepare_ts);
    out.put_u32(*xid);
    cstr(out, gid);
}

/// Prepare (`P`) and Stream Prepare (`p`): the same fields.
fn prepare(msg: &Message, out: &mut BytesMut) {
    let (Message::Prepare {
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
    }) = msg
    else {
        wrong_kind(msg)
    };
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

/// Commit Prepared (`K`).
fn commit_prepared(msg: &Message, out: &mut BytesMut) {
    let Message::CommitPrepared {
        flags,
        commit_lsn,
        end_lsn,
        commit_ts,
        xid,
        gid,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'K');
    out.put_u8(*flags);
    out.put_u64(commit_lsn.0);
    out.put_u64(end_lsn.0);
    out.put_i64(*commit_ts);
    out.put_u32(*xid);
    cstr(out, gid);
}

/// Rollback Prepared (`r`).
fn rollback_prepared(msg: &Message, out: &mut BytesMut) {
    let Message::RollbackPrepared {
        flags,
        prepare_end_lsn,
        rollback_end_lsn,
        prepare_ts,
        rollback_ts,
        xid,
        gid,
    } = msg
    else {
        wrong_kind(msg)
    };
    out.put_u8(b'r');
    out.put_u8(*flags);
    out.put_u64(prepare_end_lsn.0);
    out.put_u64(rollback_end_lsn.0);
    out.put_i64(*prepare_ts);
    out.put_i64(*rollback_ts);
    out.put_u32(*xid);
    cstr(out, gid);
}

/// Appends a TupleData (`i16 ncols | columns`).
pub(crate) fn tuple(values: &[TupleValue], out: &mut BytesMut) {
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
