//! Wire helpers shared by the connection phase (`conn`), the option builder (`options`) and the
//! streaming phase (`stream`): the byte transport, backend message framing with a size cap,
//! ErrorResponse/NoticeResponse fields, and SQL quoting for the walsender's simple-query commands.
//!
//! A leaf: it imports nothing from `source` but [`super::error`], so the modules that use it never
//! import each other for a helper.

use bytes::{Buf, BytesMut};
use fallible_iterator::FallibleIterator;
use postgres_protocol::message::backend::{ErrorFields, Message};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tracing::warn;

use super::error::{ServerError, SourceError};

/// The largest backend message (its length prefix, which counts itself) the relay accepts by default.
///
/// The length prefix is an i32, so without a cap a single header could make us reserve 2 GiB before a
/// byte of the body arrived. Postgres never sends more: a message is built in a StringInfo, limited to
/// `MaxAllocSize` (1 GB - 1, `src/include/utils/memutils.h`), so 1 GiB rejects nothing a real server
/// sends. [`super::StreamConfig::max_frame_bytes`] can lower or raise it for the streaming phase.
pub const MAX_FRAME_BYTES: usize = 1 << 30;

/// The byte stream under the protocol: plain TCP or TLS over TCP.
pub(crate) trait Transport: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Transport for T {}

/// A backend message, plus the one postgres-protocol cannot parse.
pub(crate) enum Backend {
    Message(Message),
    CopyBothResponse,
}

/// Reads one backend message into/out of `buf`, pulling bytes from `io` as needed. A message whose
/// length prefix exceeds `max_frame` is an error before anything is reserved for it.
pub(crate) async fn read_backend<R: AsyncRead + Unpin + ?Sized>(
    io: &mut R,
    buf: &mut BytesMut,
    target: &str,
    max_frame: usize,
) -> Result<Backend, SourceError> {
    loop {
        if let Some(m) = parse_backend(buf, max_frame)? {
            return Ok(m);
        }
        if buf.capacity() - buf.len() < 8 * 1024 {
            buf.reserve(64 * 1024);
        }
        let n = io.read_buf(buf).await.map_err(|error| SourceError::Io {
            target: target.to_owned(),
            error,
        })?;
        if n == 0 {
            return Err(SourceError::Closed("postgres closed the connection"));
        }
    }
}

/// One complete message from the front of `buf`, or `None` if more bytes are needed.
pub(crate) fn parse_backend(
    buf: &mut BytesMut,
    max_frame: usize,
) -> Result<Option<Backend>, SourceError> {
    // Checked before postgres-protocol sees the header: its parser reserves the whole announced length.
    let Some(total) = frame_len(buf, max_frame)? else {
        return Ok(None);
    };
    match buf[0] {
        // CopyBothResponse: u8 format, i16 ncols (0 for replication). Not in postgres-protocol.
        b'W' => {
            if buf.len() < total {
                return Ok(None);
            }
            buf.advance(total);
            Ok(Some(Backend::CopyBothResponse))
        }
        _ => Ok(Message::parse(buf).map_err(proto)?.map(Backend::Message)),
    }
}

/// The total size (tag byte included) of the backend message at the front of `buf`, once its 5-byte
/// header (`u8 tag | i32 length`) is there; `None` before. The length counts itself, so below 4 is
/// corruption, and above `max_frame` is [`SourceError::FrameTooLarge`]. Pure and allocation-free: the
/// framing fuzz target (`fuzz/fuzz_targets/framing.rs`) drives it with arbitrary bytes.
pub fn frame_len(buf: &[u8], max_frame: usize) -> Result<Option<usize>, SourceError> {
    let Some(&[tag, a, b, c, d]) = buf.first_chunk::<5>() else {
        return Ok(None);
    };
    let len = u32::from_be_bytes([a, b, c, d]);
    // A u32 always fits in a usize on the 64-bit targets the relay supports; saturate elsewhere.
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len < 4 {
        return Err(SourceError::Protocol(format!(
            "backend message {:?} announces {len} bytes, less than its own length field",
            char::from(tag)
        )));
    }
    if len > max_frame {
        return Err(SourceError::FrameTooLarge {
            tag: char::from(tag),
            len,
            max: max_frame,
        });
    }
    Ok(Some(len + 1))
}

/// An ErrorResponse/NoticeResponse as a [`ServerError`].
pub(crate) fn server_error(mut fields: ErrorFields<'_>) -> Result<ServerError, SourceError> {
    let mut e = ServerError {
        severity: String::new(),
        code: String::new(),
        message: String::new(),
        detail: None,
        hint: None,
    };
    while let Some(f) = fields.next().map_err(proto)? {
        let v = String::from_utf8_lossy(f.value_bytes()).into_owned();
        match f.type_() {
            b'V' => e.severity = v,
            b'S' if e.severity.is_empty() => e.severity = v,
            b'C' => e.code = v,
            b'M' => e.message = v,
            b'D' => e.detail = Some(v),
            b'H' => e.hint = Some(v),
            _ => {}
        }
    }
    Ok(e)
}

/// Logs a NoticeResponse: notices never change what the relay does, but an operator may need them.
pub(crate) fn log_notice(fields: ErrorFields<'_>) {
    if let Ok(n) = server_error(fields) {
        warn!(severity = %n.severity, code = %n.code, message = %n.message, "postgres notice");
    }
}

/// A codec error of postgres-protocol: the bytes do not follow the protocol.
pub(crate) fn proto(e: std::io::Error) -> SourceError {
    SourceError::Protocol(e.to_string())
}

pub(crate) fn unexpected(what: &str) -> SourceError {
    SourceError::Protocol(format!("unexpected {what}"))
}

/// `"name"` with embedded quotes doubled: slot names are restricted by the server anyway, but a
/// configured name must never be able to change the command.
pub(crate) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// A standard-conforming string literal (`standard_conforming_strings` is on since PG 9.1).
pub(crate) fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_identifiers_and_literals() {
        assert_eq!(quote_ident("slot"), "\"slot\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }

    #[test]
    fn copy_both_response_is_consumed() {
        // 'W', len 7, format 0, ncols 0 — then a CopyData 'd' with payload "k".
        let mut buf = BytesMut::from(&b"W\0\0\0\x07\0\0\0d\0\0\0\x05k"[..]);
        assert!(matches!(
            parse_backend(&mut buf, MAX_FRAME_BYTES).unwrap(),
            Some(Backend::CopyBothResponse)
        ));
        match parse_backend(&mut buf, MAX_FRAME_BYTES).unwrap() {
            Some(Backend::Message(Message::CopyData(d))) => assert_eq!(d.data(), b"k"),
            _ => panic!("expected CopyData"),
        }
        assert!(parse_backend(&mut buf, MAX_FRAME_BYTES).unwrap().is_none());
    }

    #[test]
    fn partial_copy_both_waits_for_more() {
        let mut buf = BytesMut::from(&b"W\0\0\0\x07\0"[..]);
        assert!(parse_backend(&mut buf, MAX_FRAME_BYTES).unwrap().is_none());
        assert_eq!(buf.len(), 6);
    }

    #[test]
    fn length_below_its_own_field_is_an_error() {
        let mut buf = BytesMut::from(&b"d\0\0\0\x03"[..]);
        assert!(matches!(
            parse_backend(&mut buf, MAX_FRAME_BYTES),
            Err(SourceError::Protocol(_))
        ));
    }

    #[test]
    fn huge_length_prefix_is_an_error_without_reserving() {
        // CopyData announcing i32::MAX bytes, then only a few of them: the old path reserved 2 GiB here.
        let mut buf = BytesMut::with_capacity(16);
        buf.extend_from_slice(b"d\x7f\xff\xff\xffwxyz");
        let capacity = buf.capacity();
        match parse_backend(&mut buf, MAX_FRAME_BYTES) {
            Err(SourceError::FrameTooLarge { tag, len, max }) => {
                assert_eq!((tag, len, max), ('d', i32::MAX as usize, MAX_FRAME_BYTES));
            }
            Err(e) => panic!("expected FrameTooLarge, got {e}"),
            Ok(_) => panic!("expected FrameTooLarge, got a message"),
        }
        assert_eq!(buf.capacity(), capacity, "nothing reserved for the body");
        assert_eq!(buf.len(), 9, "nothing consumed");
        // u32::MAX, which the i32 prefix reads as negative, is caught the same way.
        assert!(matches!(
            frame_len(b"d\xff\xff\xff\xff", MAX_FRAME_BYTES),
            Err(SourceError::FrameTooLarge { .. })
        ));
    }

    #[tokio::test]
    async fn reading_a_huge_frame_fails_with_the_cap_in_the_message() {
        let mut io: &[u8] = b"d\x40\x00\x00\x01";
        let mut buf = BytesMut::new();
        let e = match read_backend(&mut io, &mut buf, "test", MAX_FRAME_BYTES).await {
            Err(e) => e,
            Ok(_) => panic!("a frame over the cap was accepted"),
        };
        assert!(!e.is_transient(), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("1073741825") && text.contains("1073741824"),
            "{text}"
        );
        assert!(buf.capacity() <= 128 * 1024, "{} reserved", buf.capacity());
    }

    #[test]
    fn frames_at_the_cap_are_accepted() {
        assert_eq!(frame_len(b"d\0\0\0\x10", 16).unwrap(), Some(17));
        assert!(frame_len(b"d\0\0\0\x11", 16).is_err());
        assert_eq!(frame_len(b"d\0\0\0", 16).unwrap(), None);
    }
}
