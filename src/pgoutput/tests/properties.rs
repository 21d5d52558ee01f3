//! Properties: arbitrary and mutated bytes never panic, and every encodable message survives a round
//! trip through the encoder and the decoder.

use super::*;

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

/// A Relation message, with up to four columns.
fn relation() -> impl Strategy<Value = Message> {
    let column = (any::<u8>(), name(), any::<u32>(), any::<i32>()).prop_map(
        |(flags, name, type_oid, type_modifier)| Column {
            flags,
            name,
            type_oid,
            type_modifier,
        },
    );
    (
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
        })
}

/// Messages whose layout depends on stream state (the `[X]` prefix).
fn change_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        relation(),
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

/// Transaction-framing messages (no xid prefix), weighted as if every variant were one arm of a
/// single union (3 + 4 + 3).
fn frame_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        3 => transaction_frame(),
        4 => stream_frame(),
        3 => prepare_frame(),
    ]
}

/// Begin, Commit and Origin.
fn transaction_frame() -> impl Strategy<Value = Message> {
    let ts = any::<i64>;
    prop_oneof![
        (lsn(), ts(), any::<u32>()).prop_map(|(final_lsn, commit_ts, xid)| Message::Begin {
            final_lsn,
            commit_ts,
            xid
        }),
        (any::<u8>(), lsn(), lsn(), ts()).prop_map(|(flags, commit_lsn, end_lsn, commit_ts)| {
            Message::Commit {
                flags,
                commit_lsn,
                end_lsn,
                commit_ts,
            }
        }),
        (lsn(), name()).prop_map(|(commit_lsn, name)| Message::Origin { commit_lsn, name }),
    ]
}

/// The frames of a streamed transaction (protocol 2 and later).
fn stream_frame() -> impl Strategy<Value = Message> {
    let ts = any::<i64>;
    let abort_info = proptest::option::of((lsn(), ts()));
    prop_oneof![
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
    ]
}

/// The frames of two-phase commit (protocol 3 and later).
fn prepare_frame() -> impl Strategy<Value = Message> {
    let ts = any::<i64>;
    prop_oneof![
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
