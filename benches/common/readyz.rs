//! The relay's readiness as a bench sees it: a free loopback address for its HTTP listener
//! (`http.listen`), and whether `GET /readyz` answers 200 there (streaming from Postgres with NATS
//! connected, src/http.rs). A plain blocking HTTP/1.0 request: one short read per poll, no client
//! crate. Shared by the sustained-load and startup benches, each a binary of its own.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// `127.0.0.1:<port>` with a port free right now (the relay binds it a moment later).
pub(crate) fn free_listen_addr() -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.to_string())
}

/// Whether `GET /readyz` on `addr` answers 200; false while nothing listens or on any other answer.
pub(crate) fn is_ready(addr: &str) -> bool {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    let mut got = 0;
    while got < head.len() {
        match stream.read(&mut head[got..]) {
            Ok(0) | Err(_) => return false,
            Ok(n) => got += n,
        }
    }
    // "HTTP/1.1 200"
    &head[9..12] == b"200"
}
