//! The OTLP exporter's HTTP client: one blocking HTTP/1.1 POST per batch over a plain TCP
//! connection, on the export thread.
//!
//! Why not reqwest or hyper's client: the exporter runs on a thread of its own (the relay's runtime
//! is a current-thread one that must never wait for a collector), where a blocking request is the
//! natural shape; reqwest's blocking client would start a second tokio runtime and bring its own TLS
//! stack, hyper's needs a runtime to drive its connection. One request per batch (a few per second
//! at most) needs neither connection pooling nor HTTP/2, and the collector is expected next to the
//! relay (`http://`), so this is all of it: connect with a timeout, write, read the answer with a
//! deadline and a size cap, `Connection: close`.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use opentelemetry_http::{HttpClient, HttpError};

/// The most of an answer that is read: OTLP answers are small (an `ExportTraceServiceResponse`).
const MAX_RESPONSE: usize = 64 << 10;

/// See the module docs.
#[derive(Debug)]
pub(super) struct BlockingClient {
    connect_timeout: Duration,
    timeout: Duration,
}

impl BlockingClient {
    pub(super) fn new(connect_timeout: Duration, timeout: Duration) -> Self {
        BlockingClient {
            connect_timeout,
            timeout,
        }
    }

    fn post(&self, request: &Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let deadline = Instant::now() + self.timeout;
        let uri = request.uri();
        let host = uri.host().ok_or("the endpoint has no host")?;
        let port = uri.port_u16().unwrap_or(80);
        let addrs = (host.trim_matches(['[', ']']), port).to_socket_addrs()?;
        let mut last = None;
        let mut stream = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, self.connect_timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let mut stream = match (stream, last) {
            (Some(s), _) => s,
            (None, Some(e)) => return Err(e.into()),
            (None, None) => return Err(format!("{host} resolves to no address").into()),
        };
        let left = || {
            deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"))
        };
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(left()?))?;
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            uri.authority().map_or(host, |a| a.as_str()),
            request.body().len()
        );
        for (name, value) in request.headers() {
            // Header values the exporter sets are visible ASCII; anything else is left out
            // rather than written raw into the request.
            if let Ok(v) = value.to_str() {
                head.push_str(name.as_str());
                head.push_str(": ");
                head.push_str(v);
                head.push_str("\r\n");
            }
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes())?;
        stream.write_all(request.body())?;
        let mut answer = Vec::with_capacity(1024);
        let mut buf = [0u8; 4096];
        loop {
            stream.set_read_timeout(Some(left()?))?;
            let n = stream.read(&mut buf)?;
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
            if answer.len() > MAX_RESPONSE {
                return Err("the collector's answer is too large".into());
            }
            if complete(&answer) {
                break;
            }
        }
        parse_response(&answer)
    }
}

#[async_trait::async_trait]
impl HttpClient for BlockingClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        // Blocking inside the future is right here: it is only ever polled by `block_on` on the
        // export thread.
        self.post(&request)
    }
}

/// The end of the header block, and the body's length from `Content-Length` when there is one.
fn head_end(answer: &[u8]) -> Option<(usize, Option<usize>)> {
    let end = answer.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&answer[..end]).ok()?;
    let len = head.split("\r\n").find_map(|line| {
        let (k, v) = line.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse().ok())?
    });
    Some((end, len))
}

/// The whole answer is here (a body of known length); without a length, reading goes on until the
/// collector closes the connection, which `Connection: close` asks it to.
fn complete(answer: &[u8]) -> bool {
    matches!(head_end(answer), Some((end, Some(len))) if answer.len() >= end + len)
}

fn parse_response(answer: &[u8]) -> Result<Response<Bytes>, HttpError> {
    let (end, len) = head_end(answer).ok_or("the collector's answer is not HTTP")?;
    let status_line = std::str::from_utf8(&answer[..end])?
        .split("\r\n")
        .next()
        .unwrap_or_default();
    let mut parts = status_line.split(' ');
    let (Some(version), Some(code)) = (parts.next(), parts.next()) else {
        return Err(format!("the collector's answer is not HTTP: {status_line:?}").into());
    };
    if !version.starts_with("HTTP/1.") {
        return Err(format!("the collector's answer is not HTTP/1: {status_line:?}").into());
    }
    let status: u16 = code.parse()?;
    let body = &answer[end..];
    // A chunked body is not decoded: the exporter reads the answer only for partial-success
    // details, and the status says whether the batch was taken.
    let body = match len {
        Some(len) => &body[..len.min(body.len())],
        None if head_has_chunked(&answer[..end]) => &[][..],
        None => body,
    };
    Ok(Response::builder()
        .status(status)
        .body(Bytes::copy_from_slice(body))?)
}

fn head_has_chunked(head: &[u8]) -> bool {
    std::str::from_utf8(head).is_ok_and(|h| {
        h.split("\r\n").any(|line| {
            line.split_once(':').is_some_and(|(k, v)| {
                k.trim().eq_ignore_ascii_case("transfer-encoding")
                    && v.to_ascii_lowercase().contains("chunked")
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_status_and_body() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokMORE").unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(&r.body()[..], b"ok");
        assert!(complete(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"));
        assert!(!complete(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok"));
        let r = parse_response(b"HTTP/1.1 503 Unavailable\r\n\r\n").unwrap();
        assert_eq!(r.status(), 503);
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        )
        .unwrap();
        assert!(r.body().is_empty());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &b""[..],
            b"hello",
            b"\r\n\r\n",
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"HTTP/1.1 abc\r\n\r\n",
            b"HTTP/1.1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
        ] {
            assert!(
                parse_response(bad).is_err() || bad.starts_with(b"HTTP/1.1 200"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn posts_to_a_real_listener_and_times_out_on_a_silent_one() {
        use std::net::TcpListener;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 1024];
            while !got.ends_with(b"body") {
                let n = s.read(&mut buf).unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                .unwrap();
            // The silent one: accepts and never answers.
            let (_s, _) = listener.accept().unwrap();
            std::thread::sleep(Duration::from_secs(2));
            String::from_utf8(got).unwrap()
        });
        let client = BlockingClient::new(Duration::from_secs(1), Duration::from_millis(500));
        let request = || {
            Request::builder()
                .method("POST")
                .uri(format!("http://{addr}/v1/traces"))
                .header("content-type", "application/x-protobuf")
                .body(Bytes::from_static(b"body"))
                .unwrap()
        };
        assert_eq!(client.post(&request()).unwrap().status(), 200);
        let started = Instant::now();
        assert!(client.post(&request()).is_err());
        assert!(started.elapsed() < Duration::from_millis(1500));
        let sent = server.join().unwrap();
        assert!(sent.starts_with("POST /v1/traces HTTP/1.1\r\n"), "{sent}");
        assert!(
            sent.contains("content-type: application/x-protobuf\r\n"),
            "{sent}"
        );
    }
}
