//! One test per message type on captured and hand-written frames, the stream state that decides the
//! xid prefix, and malformed input: every error names the tag and the WAL position.

use super::*;

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
    // end_lsn is what the consumer confirms (docs/pgoutput.md#which-lsn-is-confirmed); it must
    // follow commit_lsn.
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
    assert!(
        matches!(err.reason, Malformed::TrailingBytes { left: 16, .. }),
        "{err}"
    );
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
    assert!(
        matches!(err.reason, Malformed::UnexpectedMarker { .. }),
        "{err}"
    );
}

#[test]
fn stream_blocks_do_not_nest() {
    let mut d = Decoder::new();
    let err = d
        .decode(Bytes::from_static(PG15_STREAM_STOP), AT)
        .unwrap_err();
    assert_eq!(err.reason, Malformed::StreamStopOutsideBlock, "{err}");
    d.decode(Bytes::from_static(PG15_STREAM_START_FIRST), AT)
        .unwrap();
    let err = d
        .decode(Bytes::from_static(PG15_STREAM_START_NEXT), AT)
        .unwrap_err();
    assert_eq!(err.reason, Malformed::StreamStartInsideBlock, "{err}");
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
        assert!(
            matches!(err.reason, Malformed::TrailingBytes { left: 1, .. }),
            "{err}"
        );
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
    assert_eq!(
        err.reason,
        Malformed::TupleColumn {
            index: 0,
            reason: Box::new(Malformed::UnknownColumnKind(b'x'))
        },
        "{err}"
    );
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
        assert!(err.reason.to_string().contains(want), "{err}");
    }
    let err = Decoder::new()
        .decode(Bytes::from_static(b"R\x00\x00@\x00\x00t\x00d\xff\xfe"), AT)
        .unwrap_err();
    assert_eq!(
        err.reason,
        Malformed::Negative {
            what: "number of columns",
            n: -2
        },
        "{err}"
    );
}

#[test]
fn bad_strings_and_markers_are_errors() {
    let err = Decoder::new()
        .decode(
            Bytes::from_static(b"O\x00\x00\x00\x00\x00\x00\x00\x01\xff\x00"),
            AT,
        )
        .unwrap_err();
    assert!(matches!(err.reason, Malformed::NotUtf8 { .. }), "{err}");
    let err = Decoder::new()
        .decode(Bytes::from_static(b"D\x00\x00@\x00N\x00\x00"), AT)
        .unwrap_err();
    assert_eq!(
        err.reason,
        Malformed::UnexpectedMarker {
            got: b'N',
            expected: "'K' or 'O'"
        },
        "{err}"
    );
    let err = Decoder::new()
        .decode(Bytes::from_static(b"U\x00\x00@\x00K\x00\x00K\x00\x00"), AT)
        .unwrap_err();
    assert_eq!(
        err.reason,
        Malformed::UnexpectedMarker {
            got: b'K',
            expected: "'N'"
        },
        "{err}"
    );
    let err = Decoder::new()
        .decode(Bytes::from_static(b"S\x00\x00\x00\x01\x02"), AT)
        .unwrap_err();
    assert_eq!(err.reason, Malformed::FirstSegment(2), "{err}");
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

#[test]
fn each_reason_prints_as_it_always_has() {
    // Logs and the relay's stop message print these; the wording is pinned here, variant by
    // variant, because callers match the variant and nothing else would notice a change.
    for (reason, text) in reading_reasons().into_iter().chain(structure_reasons()) {
        assert_eq!(reason.to_string(), text);
    }
}

/// The reasons a field cannot be read: too short, unterminated, not UTF-8, negative, left over.
fn reading_reasons() -> Vec<(Malformed, &'static str)> {
    let bad = vec![0xff_u8];
    let utf8 = std::str::from_utf8(&bad).unwrap_err();
    vec![
        (
            Malformed::Truncated {
                what: "relation id",
                need: 4,
                offset: 5,
                left: 1,
            },
            "truncated: relation id needs 4 bytes at offset 5, 1 left",
        ),
        (
            Malformed::Unterminated {
                what: "gid",
                offset: 9,
            },
            "truncated: gid at offset 9 has no NUL terminator",
        ),
        (
            Malformed::NotUtf8 {
                what: "prefix",
                offset: 10,
                utf8,
            },
            "prefix at offset 10 is not UTF-8: invalid utf-8 sequence of 1 bytes from index 0",
        ),
        (
            Malformed::Negative {
                what: "value length",
                n: -1,
            },
            "negative value length: -1",
        ),
        (
            Malformed::TrailingBytes {
                left: 16,
                offset: 9,
            },
            "16 trailing bytes after a complete message (offset 9)",
        ),
    ]
}

/// The reasons the message's structure is wrong: unknown kinds and markers, stream blocks out of
/// place, and a column's reason wrapped with its index.
fn structure_reasons() -> Vec<(Malformed, &'static str)> {
    vec![
        (Malformed::UnknownMessageType, "unknown message type"),
        (
            Malformed::UnexpectedMarker {
                got: 0,
                expected: "'K' or 'O'",
            },
            "expected tuple marker 'K' or 'O', got 0x00",
        ),
        (
            Malformed::UnknownColumnKind(b'x'),
            "unknown column kind 'x' (expected 'n', 'u', 't' or 'b')",
        ),
        (
            Malformed::StreamStartInsideBlock,
            "Stream Start inside a stream block (missing Stream Stop)",
        ),
        (
            Malformed::StreamStopOutsideBlock,
            "Stream Stop outside a stream block",
        ),
        (
            Malformed::FirstSegment(2),
            "first_segment must be 0 or 1, got 2",
        ),
        (
            Malformed::Column {
                index: 1,
                reason: Box::new(Malformed::Unterminated {
                    what: "name",
                    offset: 30,
                }),
            },
            "column 1: truncated: name at offset 30 has no NUL terminator",
        ),
        (
            Malformed::TupleColumn {
                index: 2,
                reason: Box::new(Malformed::UnknownColumnKind(0xff)),
            },
            "tuple column 2: unknown column kind 0xff (expected 'n', 'u', 't' or 'b')",
        ),
    ]
}
