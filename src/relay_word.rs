//! `status` asks a running relay what it knows itself, over its HTTP listener (`http.listen`):
//! `/readyz` (streaming with both connections up, or why not), `/position` (how far it has stored)
//! and `/metrics`' `outbox_relay_seconds_since_last_ack` (how old that knowledge is). Postgres alone
//! shows a walsender that stays active until the relay's ack timeout ends its session, so a relay
//! whose NATS connection died looked "streaming" for that long; the relay's own `/readyz` says
//! "nats disconnected" at once.
//!
//! Read-only and bounded: three GETs over one-shot HTTP/1.1 connections (hyper's client), each
//! within [`ASK_TIMEOUT`], bodies of at most [`MAX_BODY`] bytes. A wildcard listen address
//! (`0.0.0.0`, `::`) is asked on the loopback address of its family. Nothing is asked when
//! `http.listen` is empty: `status` then says it cannot know.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use serde::Serialize;

/// The bound on each request, connect included.
pub(crate) const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest answer read (`/metrics` is a few kilobytes).
const MAX_BODY: usize = 1 << 20;

/// What the relay serving `http.listen` says of itself.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RelayWord {
    /// The address asked.
    pub(crate) address: String,
    /// Whether it answered at all.
    pub(crate) reached: bool,
    /// `/readyz`: streaming with both connections up.
    pub(crate) ready: Option<bool>,
    /// `/readyz`'s reason when not ready (e.g. `nats disconnected`).
    pub(crate) not_ready_because: Option<String>,
    /// `/position`'s answer (`stored_lsn`, `confirmed_lsn`, `last_sequence`), when it has one.
    pub(crate) position: Option<serde_json::Value>,
    /// Seconds since the relay's last ack (`None`: none yet, or not read).
    pub(crate) seconds_since_last_ack: Option<f64>,
    /// Why it could not be asked.
    pub(crate) error: Option<String>,
}

/// Asks the relay listening on `listen` (`http.listen`); `None` when that is empty.
pub(crate) async fn ask(listen: &str) -> Option<RelayWord> {
    if listen.is_empty() {
        return None;
    }
    let mut word = RelayWord {
        address: listen.to_owned(),
        reached: false,
        ready: None,
        not_ready_because: None,
        position: None,
        seconds_since_last_ack: None,
        error: None,
    };
    let addr = match listen.parse::<SocketAddr>() {
        Ok(a) => reachable(a),
        Err(_) => {
            word.error = Some(format!("http.listen {listen:?} is not an address"));
            return Some(word);
        }
    };
    word.address = addr.to_string();
    match get(addr, "/readyz").await {
        Ok((status, body)) => {
            word.reached = true;
            word.ready = Some(status == 200);
            if status != 200 {
                word.not_ready_because = Some(body.trim().to_owned());
            }
        }
        Err(e) => {
            word.error = Some(e);
            return Some(word);
        }
    }
    if let Ok((200, body)) = get(addr, "/position").await {
        word.position = serde_json::from_str(&body).ok();
    }
    if let Ok((200, body)) = get(addr, "/metrics").await {
        word.seconds_since_last_ack = since_last_ack(&body);
    }
    Some(word)
}

/// A wildcard address is asked on the loopback address of its family.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port())
        }
        _ => addr,
    }
}

/// `outbox_relay_seconds_since_last_ack` from a metrics text (`-1`: no ack yet).
fn since_last_ack(metrics: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("outbox_relay_seconds_since_last_ack "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| *v >= 0.0)
}

/// One GET: the status code and the body, or why not (one line).
async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let request = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connecting to {addr}: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| format!("{addr}: {e}"))?;
        // The connection is driven beside the request, and dropped with it.
        let conn = tokio::spawn(conn);
        let req = hyper::Request::get(path)
            .header(hyper::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let res = sender
            .send_request(req)
            .await
            .map_err(|e| format!("GET {path} on {addr}: {e}"))?;
        let status = res.status().as_u16();
        let body = Limited::new(res.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| format!("GET {path} on {addr}: {e}"))?
            .to_bytes();
        conn.abort();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(ASK_TIMEOUT, request)
        .await
        .unwrap_or_else(|_| Err(format!("{addr} did not answer within {ASK_TIMEOUT:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_are_asked_on_loopback() {
        let a: SocketAddr = "0.0.0.0:9187".parse().unwrap();
        assert_eq!(reachable(a).to_string(), "127.0.0.1:9187");
        let b: SocketAddr = "[::]:9187".parse().unwrap();
        assert_eq!(reachable(b).to_string(), "[::1]:9187");
        let c: SocketAddr = "10.1.2.3:9187".parse().unwrap();
        assert_eq!(reachable(c), c);
    }

    #[test]
    fn the_age_of_the_last_ack_is_read_from_the_metrics() {
        let text = "# HELP x\noutbox_relay_seconds_since_last_ack 3.25\nother 1\n";
        assert_eq!(since_last_ack(text), Some(3.25));
        assert_eq!(
            since_last_ack("outbox_relay_seconds_since_last_ack -1\n"),
            None
        );
        assert_eq!(since_last_ack("nothing\n"), None);
    }

    #[tokio::test]
    async fn an_empty_listen_asks_nothing_and_a_closed_port_says_so() {
        assert!(ask("").await.is_none());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let word = ask(&format!("127.0.0.1:{port}")).await.expect("asked");
        assert!(!word.reached);
        assert!(word.error.unwrap().contains("connecting to"));
    }
}
