//! The W3C Trace Context `traceparent` header (<https://www.w3.org/TR/trace-context/#traceparent-header>):
//! parsed from an event's headers, and written again naming the relay's own span.
//!
//! Parsing is strict where the recommendation is (lower-case hex, no all-zero ids, version `ff`
//! invalid, exactly 55 characters for version `00`) and lenient where it asks to be (a later version
//! may append fields after a `-`). A header that does not parse is not an error for the event: it is
//! published as written and the relay makes no span for it.

/// A parsed `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TraceParent {
    /// The trace id (16 bytes, never zero).
    pub(crate) trace_id: u128,
    /// The span id of the parent: for an event, the writer's span (8 bytes, never zero).
    pub(crate) parent_id: u64,
    /// The trace flags; bit 0 is "sampled".
    pub(crate) flags: u8,
}

/// The header's name, as the recommendation writes it (header names are compared ignoring case).
pub(crate) const TRACEPARENT: &str = "traceparent";
/// The vendor-specific companion header, passed through unchanged.
pub(crate) const TRACESTATE: &str = "tracestate";

impl TraceParent {
    /// Parses a header value; `None` for anything the recommendation calls invalid.
    pub(crate) fn parse(value: &str) -> Option<TraceParent> {
        let v = value.trim_matches([' ', '\t']).as_bytes();
        if v.len() < 55 {
            return None;
        }
        let version = hex_u8(&v[0..2])?;
        if version == 0xff || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
            return None;
        }
        // Version 00 has exactly four fields; a later one may add fields, after a dash.
        if (version == 0 && v.len() != 55) || (v.len() > 55 && v[55] != b'-') {
            return None;
        }
        let trace_id = hex_u128(&v[3..35])?;
        let parent_id = hex_u64(&v[36..52])?;
        let flags = hex_u8(&v[53..55])?;
        if trace_id == 0 || parent_id == 0 {
            return None;
        }
        Some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// Whether the writer sampled its trace (flag bit 0).
    pub(crate) fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The header naming `span_id` as the parent, in the same trace: what a consumer continues
    /// from. Always version 00, which is what a participant writes whatever version it read; the
    /// flags the version defines (sampled, and level 2's random trace id) are kept.
    pub(crate) fn child(&self, span_id: u64) -> String {
        format!(
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id,
            span_id,
            self.flags & 0x03
        )
    }
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        // Upper case is invalid in traceparent.
        _ => None,
    }
}

fn hex_u128(s: &[u8]) -> Option<u128> {
    s.iter()
        .try_fold(0u128, |acc, &b| Some(acc << 4 | u128::from(hex_digit(b)?)))
}

fn hex_u64(s: &[u8]) -> Option<u64> {
    s.iter()
        .try_fold(0u64, |acc, &b| Some(acc << 4 | u64::from(hex_digit(b)?)))
}

fn hex_u8(s: &[u8]) -> Option<u8> {
    s.iter()
        .try_fold(0u8, |acc, &b| Some(acc << 4 | hex_digit(b)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn parses_the_recommendations_example() {
        let tp = TraceParent::parse(EXAMPLE).unwrap();
        assert_eq!(tp.trace_id, 0x0af7651916cd43dd8448eb211c80319c);
        assert_eq!(tp.parent_id, 0xb7ad6b7169203331);
        assert!(tp.sampled());
        let unsampled = TraceParent::parse(&EXAMPLE.replace("-01", "-00")).unwrap();
        assert!(!unsampled.sampled());
    }

    #[test]
    fn the_child_keeps_the_trace_and_names_the_new_span() {
        let tp = TraceParent::parse(EXAMPLE).unwrap();
        assert_eq!(
            tp.child(0x00f067aa0ba902b7),
            "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"
        );
        // Written, it parses back to the same trace with the new parent.
        let back = TraceParent::parse(&tp.child(42)).unwrap();
        assert_eq!(back.trace_id, tp.trace_id);
        assert_eq!(back.parent_id, 42);
        // A later version's extra flags are not carried into version 00.
        let v1 = TraceParent::parse(
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-ff-what-comes-next",
        )
        .unwrap();
        assert!(v1.child(1).ends_with("-03"), "{}", v1.child(1));
        assert!(v1.child(1).starts_with("00-"));
    }

    #[test]
    fn invalid_values_are_refused_not_guessed() {
        for bad in [
            "",
            "00",
            "garbage",
            // upper-case hex
            "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
            // all-zero ids
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            // version ff
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            // version 00 with an extra field
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            // a later version whose extra part does not start with a dash
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x",
            // wrong separators, short ids, non-hex
            "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319-cb7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0x",
            // multi-byte characters where hex belongs must not split a character or panic
            "00-0af7651916cd43dd8448eb211c8031é-b7ad6b7169203331-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        // Surrounding spaces are allowed around a header value.
        assert!(TraceParent::parse(&format!(" {EXAMPLE}\t")).is_some());
    }
}
