//! Fuzz target for `outbox_relay::pgoutput::Decoder`: any bytes from the network must give `Ok` or
//! `Err`, never a panic, an abort or an allocation the input did not pay for.
//!
//! Stream state changes the layout (the `[X]` xid prefix inside Stream Start…Stop, abort fields in
//! parallel mode), so an input starting with `'S'` is also decoded, minus that byte, by decoders that
//! are inside a stream block, in both streaming modes.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use outbox_relay::Lsn;
use outbox_relay::pgoutput::Decoder;

/// A valid Stream Start (xid 1, first segment) to put a decoder inside a stream block.
const STREAM_START: &[u8] = b"S\x00\x00\x00\x01\x01";

fuzz_target!(|data: &[u8]| {
    let _ = Decoder::new().decode(Bytes::copy_from_slice(data), Lsn::ZERO);

    if let Some((&b'S', rest)) = data.split_first() {
        for parallel in [false, true] {
            let mut decoder = Decoder::with_parallel_streaming(parallel);
            decoder
                .decode(Bytes::from_static(STREAM_START), Lsn::ZERO)
                .expect("a valid Stream Start decodes");
            let _ = decoder.decode(Bytes::copy_from_slice(rest), Lsn::ZERO);
        }
    }
});
