//! FNV-1a, the one hash whose values leave the process: 64 bits for the ids the relay makes up for
//! messages without one (`event.rs`), 32 bits for the partition of an aggregate id, which must
//! agree with nats-server's subject mapping (`route.rs`). Both are fixed by their published
//! definitions, never by the compiler or the platform, so an id or a partition stays the same across
//! relay versions and restarts. Written once here, with the published test vectors, because a
//! second copy that drifted would change ids (and so break deduplication) without any test failing.

/// FNV-1a, 64 bits.
pub(crate) fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// FNV-1a, 32 bits.
pub(crate) fn fnv1a_32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_widths_give_the_published_test_vectors() {
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a_32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a_32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a_32(b"foobar"), 0xbf9c_f968);
    }
}
