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
//!
//! Weighed against ureq 3 (no default features, its connection kept alive) by
//! `cargo bench --bench otlp`, one 420-span request at a time to a loopback listener: this client
//! took 47 / 54 / 81 ns of CPU a span in three runs of 2026-12-06 (2 shared cores, load average
//! 11.3 → 10.6, 7.1 → 6.6, 1.0 → 1.1), ureq 64 / 70 / 101 ns (1.25–1.34×) and four more crates. A
//! small margin (7–8 µs a request, under 1 % of a span's cost) but over the 10 % that would have
//! made the crate the choice (docs/performance.md, Tracing).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The most of an answer that is read: OTLP answers are small (an `ExportTraceServiceResponse`).
const MAX_RESPONSE: usize = 64 << 10;

/// Why a request failed: connecting, writing, reading, or an answer that is not a success.
pub(super) type Error = Box<dyn std::error::Error + Send + Sync>;

/// See the module docs.
#[derive(Debug)]
pub(super) struct BlockingClient {
    /// Host (without IPv6 brackets) and port to connect to.
    host: String,
    port: u16,
    /// The request line and the headers that are the same for every request, up to and
    /// including `Content-Length: ` (the body's length and the blank line follow).
    head: String,
    connect_timeout: Duration,
    timeout: Duration,
}

impl BlockingClient {
    /// A client that POSTs protobuf to `url` (`http://`, checked by the configuration), with
    /// `headers` (already checked to be valid HTTP names and values) on every request; `None` when
    /// the URL has no host.
    pub(super) fn new(
        url: &url::Url,
        headers: &[(String, String)],
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Option<Self> {
        let host = url.host_str()?;
        let port = url.port_or_known_default().unwrap_or(80);
        let path = &url[url::Position::BeforePath..url::Position::AfterQuery];
        let authority = &url[url::Position::BeforeHost..url::Position::AfterPort];
        let mut head = format!(
            "POST {} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\ncontent-type: application/x-protobuf\r\n",
            if path.is_empty() { "/" } else { path }
        );
        for (name, value) in headers {
            head.push_str(name);
            head.push_str(": ");
            head.push_str(value);
            head.push_str("\r\n");
        }
        head.push_str("Content-Length: ");
        Some(BlockingClient {
            host: host.trim_matches(['[', ']']).to_owned(),
            port,
            head,
            connect_timeout,
            timeout,
        })
    }

    /// POSTs `body`; `Ok` when the collector answered with a 2xx status.
    pub(super) fn post(&self, body: &[u8]) -> Result<(), Error> {
        let deadline = Instant::now() + self.timeout;
        let addrs = (self.host.as_str(), self.port).to_socket_addrs()?;
        let mut last = None;
        let mut stream = None;
        for addr in addrs {
            // Within the request's own deadline too, however many addresses the name has.
            let connect = self.connect_timeout.min(
                deadline
                    .checked_duration_since(Instant::now())
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out")
                    })?,
            );
            match TcpStream::connect_timeout(&addr, connect) {
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
            (None, None) => return Err(format!("{} resolves to no address", self.host).into()),
        };
        let left = || {
            deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"))
        };
        stream.set_nodelay(true)?;
        let mut head = String::with_capacity(self.head.len() + 24);
        head.push_str(&self.head);
        head.push_str(itoa::Buffer::new().format(body.len()));
        head.push_str("\r\n\r\n");
        // A write timeout bounds one write call, and a collector that reads slowly lets every call
        // make a little progress: the timeout is set again to what is left before each call, so
        // the whole request stays within the deadline.
        for mut rest in [head.as_bytes(), body] {
            while !rest.is_empty() {
                stream.set_write_timeout(Some(left()?))?;
                match stream.write(rest) {
                    Ok(0) => return Err("the collector closed the connection".into()),
                    Ok(n) => rest = &rest[n..],
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
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
        let status = parse_status(&answer)?;
        if (200..300).contains(&status) {
            Ok(())
        } else {
            Err(format!("HTTP export failed with status code: {status}").into())
        }
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

/// The status code of a complete HTTP/1 answer. Its body is not read: a collector's
/// partial-success details are not acted on, the status says whether the batch was taken.
fn parse_status(answer: &[u8]) -> Result<u16, Error> {
    let (end, _) = head_end(answer).ok_or("the collector's answer is not HTTP")?;
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
    Ok(code.parse()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_status() {
        assert_eq!(
            parse_status(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").unwrap(),
            200
        );
        assert!(complete(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"));
        assert!(!complete(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok"));
        assert_eq!(
            parse_status(b"HTTP/1.1 503 Unavailable\r\n\r\n").unwrap(),
            503
        );
        assert_eq!(
            parse_status(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
            )
            .unwrap(),
            200
        );
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
            b"HTTP/1.1 99999 Big\r\n\r\n",
        ] {
            assert!(parse_status(bad).is_err(), "{bad:?}");
        }
        assert!(
            parse_status(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n")
                .is_ok()
        );
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
        let url = url::Url::parse(&format!("http://{addr}/v1/traces")).unwrap();
        let headers = [("api-key".to_owned(), "s3cret".to_owned())];
        let client = BlockingClient::new(
            &url,
            &headers,
            Duration::from_secs(1),
            Duration::from_millis(500),
        )
        .unwrap();
        client.post(b"body").unwrap();
        let started = Instant::now();
        assert!(client.post(b"body").is_err());
        assert!(started.elapsed() < Duration::from_millis(1500));
        let sent = server.join().unwrap();
        assert!(sent.starts_with("POST /v1/traces HTTP/1.1\r\n"), "{sent}");
        assert!(
            sent.contains("content-type: application/x-protobuf\r\n"),
            "{sent}"
        );
        assert!(sent.contains("api-key: s3cret\r\n"), "{sent}");
        assert!(sent.contains(&format!("Host: {addr}\r\n")), "{sent}");
        assert!(sent.contains("Content-Length: 4\r\n\r\nbody"), "{sent}");
    }

    /// docs/security.md, finding 12: a collector that reads the request slowly (64 KiB every
    /// 100 ms) cannot hold the export thread past the request's timeout: each write makes a little
    /// progress, and a write timeout set once per request would let the whole write take minutes.
    /// Run on a thread, so the test ends after 10 s either way.
    #[test]
    fn a_slowly_reading_collector_is_cut_off_at_the_timeout() {
        use std::net::TcpListener;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reading = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = vec![0u8; 64 << 10];
            while !reading.load(std::sync::atomic::Ordering::Relaxed) {
                if matches!(s.read(&mut buf), Ok(0) | Err(_)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let url = url::Url::parse(&format!("http://{addr}/v1/traces")).unwrap();
        let client = BlockingClient::new(
            &url,
            &[],
            Duration::from_secs(1),
            Duration::from_millis(500),
        )
        .unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let started = Instant::now();
            let r = client.post(&vec![b'x'; 64 << 20]);
            let _ = done.send((r.is_err(), started.elapsed()));
        });
        let answer = finished.recv_timeout(Duration::from_secs(10));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        // Within 10 s, not the ~100 s the whole body takes at this pace: bounded by the request's
        // timeout (how close to 1 s is the machine's business, not the test's).
        let (failed, _took) = answer.expect("post returned within 10 s");
        assert!(failed, "a request cut off is an error");
    }
}
