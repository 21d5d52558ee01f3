//! `require_auth` for the control connection: a stream wrapper that reads the server's
//! authentication request off the wire and refuses a method the connection's [`AuthPolicy`] does not
//! allow, before tokio-postgres (which has no such setting) can answer a cleartext request with the
//! password.
//!
//! The replication connection authenticates in our own code ([`super::conn`]) and asks the same
//! policy there. Here
//! the guard sits on the TCP stream (watching for `SSLRequest` and the server's one-byte answer) and,
//! when TLS is negotiated, again on the TLS stream, where the messages are readable. It only parses
//! messages up to AuthenticationOk; after that it passes bytes through untouched.
//!
//! It also notes what the server asked for ([`Seen`]), so that when tokio-postgres gives up on its
//! own (no password to send, no channel binding to offer) the error can be told from what happened
//! on the wire rather than from tokio-postgres' message text, which is all its error exposes.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, TlsConnect, TlsStream};

use super::auth_error::AuthRefusal;
use super::auth_policy::AuthPolicy;
use super::conninfo::{AuthMethod, ConnInfo};

/// `SSLRequest`: length 8, code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 4, 210, 22, 47];

/// The guard's refusal, if `e` is one: it travels inside the `io::Error` tokio-postgres reports.
pub(super) fn refusal(e: &tokio_postgres::Error) -> Option<AuthRefusal> {
    let io = std::error::Error::source(e)?.downcast_ref::<io::Error>()?;
    io.get_ref()?.downcast_ref::<AuthRefusal>().cloned()
}

/// What the server asked for during one connection attempt, shared by the guards of its streams and
/// read after tokio-postgres returned.
#[derive(Debug)]
pub(super) struct Seen {
    /// A password is configured for this attempt.
    has_password: bool,
    /// `channel_binding=require`.
    requires_channel_binding: bool,
    /// The server asked for a method that sends the password (cleartext, md5, SCRAM).
    asked_password: AtomicBool,
    /// The server asked for SASL and the client has written nothing since: tokio-postgres declined
    /// to answer.
    sasl_unanswered: AtomicBool,
}

/// Why tokio-postgres gave up on authentication before answering, as [`Seen`] tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GaveUp {
    /// The server asked for a password and none is configured.
    NoPassword,
    /// `channel_binding=require`, and the SASL request went unanswered: tokio-postgres found no
    /// SCRAM-SHA-256-PLUS over TLS to bind with (the password was there, it checks that first).
    NoChannelBinding,
}

impl Seen {
    fn new(info: &ConnInfo, policy: &AuthPolicy) -> Self {
        Seen {
            has_password: info.password.is_some(),
            requires_channel_binding: policy.requires_channel_binding(),
            asked_password: AtomicBool::new(false),
            sasl_unanswered: AtomicBool::new(false),
        }
    }

    /// Why tokio-postgres gave up, if what the server asked for explains it. In tokio-postgres'
    /// order: the password is looked for before the SASL mechanism is chosen.
    pub(super) fn gave_up(&self) -> Option<GaveUp> {
        if self.asked_password.load(Ordering::Relaxed) && !self.has_password {
            Some(GaveUp::NoPassword)
        } else if self.requires_channel_binding && self.sasl_unanswered.load(Ordering::Relaxed) {
            Some(GaveUp::NoChannelBinding)
        } else {
            None
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Nothing written yet: the first write tells whether TLS is being requested.
    Start,
    /// The one-byte answer to SSLRequest.
    SslAnswer,
    /// A message header: tag and length.
    Header { got: usize, buf: [u8; 5] },
    /// The first four bytes of an authentication request: its code.
    Code {
        got: usize,
        buf: [u8; 4],
        rest: usize,
    },
    /// The rest of a message that does not matter.
    Skip { rest: usize, then_done: bool },
    /// Authentication is over (or TLS took over below): pass everything through.
    Done,
}

/// What the server asked for so far.
#[derive(Debug)]
struct Parser {
    policy: AuthPolicy,
    state: State,
    asked: bool,
    seen: Arc<Seen>,
    /// This parser read a SASL request that the client has not answered yet.
    sasl_pending: bool,
}

impl Parser {
    fn new(policy: AuthPolicy, seen: Arc<Seen>, after_tls: bool) -> Self {
        // Nothing to refuse and nothing to explain: a missing password is the one thing
        // tokio-postgres gives up on without a policy.
        let state = if !policy.is_set() && seen.has_password {
            State::Done
        } else if after_tls {
            State::Header {
                got: 0,
                buf: [0; 5],
            }
        } else {
            State::Start
        };
        Parser {
            policy,
            state,
            asked: false,
            seen,
            sasl_pending: false,
        }
    }

    fn wrote(&mut self, buf: &[u8]) {
        // Whatever the client writes on this stream after a SASL request is its answer.
        if self.sasl_pending && !buf.is_empty() {
            self.sasl_pending = false;
            self.seen.sasl_unanswered.store(false, Ordering::Relaxed);
        }
        if let State::Start = self.state {
            self.state = if buf.starts_with(&SSL_REQUEST) {
                State::SslAnswer
            } else {
                State::Header {
                    got: 0,
                    buf: [0; 5],
                }
            };
        }
    }

    /// Reads the bytes the server sent; refuses the first authentication request the policy does
    /// not allow.
    fn read(&mut self, mut bytes: &[u8]) -> Result<(), AuthRefusal> {
        while let Some((&b, rest)) = bytes.split_first() {
            match self.state {
                State::Start | State::Done => return Ok(()),
                State::SslAnswer => {
                    // 'S': TLS follows; the guard on the TLS stream reads the messages.
                    self.state = if b == b'S' { State::Done } else { header() };
                    bytes = rest;
                }
                State::Header { got, buf } => {
                    self.header_byte(got, buf, b);
                    bytes = rest;
                }
                State::Code {
                    got,
                    buf,
                    rest: remaining,
                } => {
                    bytes = rest;
                    self.code_byte(got, buf, remaining, b)?;
                }
                State::Skip {
                    rest: remaining,
                    then_done,
                } => bytes = self.skip(remaining, then_done, bytes),
            }
            if let State::Skip { rest: 0, then_done } = self.state {
                self.state = after_skip(then_done);
            }
        }
        Ok(())
    }

    /// One byte of a message header (tag and length). After the fifth: the code of an
    /// authentication request, or the end of authentication for any other message.
    fn header_byte(&mut self, mut got: usize, mut buf: [u8; 5], b: u8) {
        buf[got] = b;
        got += 1;
        self.state = State::Header { got, buf };
        if got == 5 {
            let tag = buf[0];
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            let body = len.saturating_sub(4);
            self.state = if tag == b'R' && body >= 4 {
                State::Code {
                    got: 0,
                    buf: [0; 4],
                    rest: body - 4,
                }
            } else {
                // An error or anything else ends authentication.
                State::Done
            };
        }
    }

    /// One byte of an authentication request's code; after the fourth, the request is checked.
    fn code_byte(
        &mut self,
        mut got: usize,
        mut buf: [u8; 4],
        remaining: usize,
        b: u8,
    ) -> Result<(), AuthRefusal> {
        buf[got] = b;
        got += 1;
        self.state = State::Code {
            got,
            buf,
            rest: remaining,
        };
        if got == 4 {
            self.auth_request(u32::from_be_bytes(buf), remaining)?;
        }
        Ok(())
    }

    /// Asks the policy about the method the request with `code` asks for, then skips the rest of
    /// the request; AuthenticationOk (0) ends authentication.
    fn auth_request(&mut self, code: u32, remaining: usize) -> Result<(), AuthRefusal> {
        let method = match code {
            0 if !self.asked => Some(AuthMethod::None),
            3 => Some(AuthMethod::Password),
            5 => Some(AuthMethod::Md5),
            10 => Some(AuthMethod::ScramSha256),
            _ => None,
        };
        if let Some(m) = method {
            self.policy.allow(m)?;
            if m != AuthMethod::None {
                self.seen.asked_password.store(true, Ordering::Relaxed);
            }
        }
        if code == 10 {
            self.sasl_pending = true;
            self.seen.sasl_unanswered.store(true, Ordering::Relaxed);
        }
        self.asked |= code != 0;
        self.state = State::Skip {
            rest: remaining,
            then_done: code == 0,
        };
        Ok(())
    }

    /// Skips what `bytes` holds of the `remaining` bytes of a message; returns the bytes after it.
    fn skip<'b>(&mut self, mut remaining: usize, then_done: bool, bytes: &'b [u8]) -> &'b [u8] {
        let n = remaining.min(bytes.len());
        remaining -= n;
        self.state = State::Skip {
            rest: remaining,
            then_done,
        };
        if remaining == 0 {
            self.state = after_skip(then_done);
        }
        &bytes[n..]
    }
}

/// The state at the start of a message header.
fn header() -> State {
    State::Header {
        got: 0,
        buf: [0; 5],
    }
}

/// The state after a skipped message: done, or the next message's header.
fn after_skip(then_done: bool) -> State {
    if then_done { State::Done } else { header() }
}

/// A stream with an authentication guard.
#[derive(Debug)]
pub(super) struct Guarded<S> {
    inner: S,
    parser: Parser,
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if let Err(why) = this.parser.read(&buf.filled()[before..]) {
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::PermissionDenied, why)));
                }
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        this.parser.wrote(buf);
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: TlsStream + Unpin> TlsStream for Guarded<S> {
    fn channel_binding(&self) -> ChannelBinding {
        self.inner.channel_binding()
    }
}

/// A TLS connector whose stream is guarded too.
pub(super) struct GuardedConnect<T> {
    inner: T,
    policy: AuthPolicy,
    seen: Arc<Seen>,
}

impl<T> GuardedConnect<T> {
    pub(super) fn new(inner: T, info: &ConnInfo) -> Self {
        let policy = AuthPolicy::new(info);
        GuardedConnect {
            inner,
            seen: Arc::new(Seen::new(info, &policy)),
            policy,
        }
    }

    /// What the guards of this attempt see, to read after it failed.
    pub(super) fn seen(&self) -> Arc<Seen> {
        Arc::clone(&self.seen)
    }

    /// The TCP stream with its guard (it reads plaintext messages when TLS is not used).
    pub(super) fn wrap_raw<S>(&self, stream: S) -> Guarded<S> {
        Guarded {
            inner: stream,
            parser: Parser::new(self.policy.clone(), Arc::clone(&self.seen), false),
        }
    }
}

impl<S, T> TlsConnect<S> for GuardedConnect<T>
where
    T: TlsConnect<S>,
    T::Future: Send + 'static,
    T::Stream: Unpin,
{
    type Stream = Guarded<T::Stream>;
    type Error = T::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Stream, T::Error>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        let (policy, seen) = (self.policy, self.seen);
        let fut = self.inner.connect(stream);
        Box::pin(async move {
            let inner = fut.await?;
            Ok(Guarded {
                inner,
                parser: Parser::new(policy, seen, true),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parser for a connection to `url`, and what it sees.
    fn parser_for(url: &str, after_tls: bool) -> (Parser, Arc<Seen>) {
        let info = ConnInfo::parse_with_env(url, |_| None).unwrap();
        let policy = AuthPolicy::new(&info);
        let seen = Arc::new(Seen::new(&info, &policy));
        (Parser::new(policy, Arc::clone(&seen), after_tls), seen)
    }

    fn require(s: &str, after_tls: bool) -> Parser {
        parser_for(&format!("postgres://u:pw@h/d?require_auth={s}"), after_tls).0
    }

    fn auth(code: u32, extra: &[u8]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(((8 + extra.len()) as u32).to_be_bytes());
        m.extend(code.to_be_bytes());
        m.extend(extra);
        m
    }

    #[test]
    fn a_cleartext_request_is_refused_even_after_a_refused_ssl_request() {
        let mut p = require("scram-sha-256", false);
        p.wrote(&SSL_REQUEST);
        let mut wire = vec![b'N'];
        wire.extend(auth(3, &[]));
        // Fed a byte at a time: reads may split anywhere.
        let refused = wire.iter().any(|b| p.read(&[*b]).is_err());
        assert!(refused);
    }

    #[test]
    fn scram_passes_and_the_guard_retires_after_ok() {
        let mut p = require("scram-sha-256", true);
        let mut wire = auth(10, b"SCRAM-SHA-256\0\0");
        wire.extend(auth(11, b"r=abc"));
        wire.extend(auth(12, b"v=xyz"));
        wire.extend(auth(0, &[]));
        // After AuthenticationOk nothing is parsed: even bytes that look like a request pass.
        wire.extend(auth(3, &[]));
        assert!(p.read(&wire).is_ok());
        assert!(matches!(p.state, State::Done));
    }

    #[test]
    fn trust_needs_none_in_the_list() {
        let mut p = require("scram-sha-256", true);
        assert!(p.read(&auth(0, &[])).is_err());
        let mut p = require("scram-sha-256,none", true);
        assert!(p.read(&auth(0, &[])).is_ok());
    }

    #[test]
    fn a_password_request_without_a_password_is_why_the_client_gave_up() {
        for code in [3, 5, 10] {
            let (mut p, seen) = parser_for("postgres://u@h/d", true);
            assert!(p.read(&auth(code, b"SCRAM-SHA-256\0\0")).is_ok());
            assert_eq!(seen.gave_up(), Some(GaveUp::NoPassword), "code {code}");
        }
        let (mut p, seen) = parser_for("postgres://u@h/d", true);
        assert!(p.read(&auth(0, &[])).is_ok(), "trust");
        assert_eq!(seen.gave_up(), None);
    }

    #[test]
    fn an_unanswered_sasl_request_under_channel_binding_require() {
        let url = "postgres://u:pw@h/d?channel_binding=require";
        let (mut p, seen) = parser_for(url, true);
        p.read(&auth(10, b"SCRAM-SHA-256\0\0")).unwrap();
        assert_eq!(seen.gave_up(), Some(GaveUp::NoChannelBinding));
        // Answered: whatever fails later, it was not that.
        p.wrote(b"p\0\0\0\x05");
        assert_eq!(seen.gave_up(), None);
        let (mut p, seen) = parser_for("postgres://u:pw@h/d", true);
        let _ = p.read(&auth(10, b"SCRAM-SHA-256\0\0"));
        assert_eq!(seen.gave_up(), None, "binding not required");
    }

    #[test]
    fn tls_accepted_hands_over_to_the_tls_guard() {
        let mut p = require("scram-sha-256", false);
        p.wrote(&SSL_REQUEST);
        assert!(p.read(b"S\x16\x03\x01garbage").is_ok());
        assert!(matches!(p.state, State::Done));
    }
}
