//! Fuzz target for the replication stream's framing: arbitrary bytes as they would arrive from a
//! walsender after CopyBothResponse. Backend messages are split by their length prefix
//! (`outbox_relay::source::frame_len`, which refuses prefixes over the frame cap before anything is
//! reserved), each CopyData payload goes through `parse_copy_data` (XLogData `'w'` or keepalive `'k'`),
//! and each XLogData payload through one pgoutput `Decoder`, as in the relay. Any panic is a bug: the
//! bytes come from the network.
//!
//! Two caps: a tiny one so short inputs reach the "frame too large" path, and the real one.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use outbox_relay::pgoutput::Decoder;
use outbox_relay::source::{MAX_FRAME_BYTES, ReplicationEvent, frame_len, parse_copy_data};

fuzz_target!(|data: &[u8]| {
    for max in [64, MAX_FRAME_BYTES] {
        let mut decoder = Decoder::new();
        let mut rest = data;
        while let Ok(Some(total)) = frame_len(rest, max) {
            assert!(total > 4 && total <= max + 1, "frame_len returned {total} for cap {max}");
            let Some((frame, tail)) = rest.split_at_checked(total) else {
                break; // the reader would wait for more bytes
            };
            rest = tail;
            if frame[0] != b'd' {
                continue;
            }
            if let Ok(ReplicationEvent::XLogData {
                wal_start, data, ..
            }) = parse_copy_data(Bytes::copy_from_slice(&frame[5..]))
            {
                let _ = decoder.decode(data, wal_start);
            }
        }
    }
});
