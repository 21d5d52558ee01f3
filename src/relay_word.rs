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
//!
//! Whatever answers on that port is not trusted for being there: another relay's listener, or any
//! local process, can answer. So what it says is kept only as plain values: `/position` must be
//! the JSON of a relay's position, its LSNs must parse as LSNs, its slot and stream names are kept
//! escaped and bounded, and `/readyz`'s reason is one escaped line of at most [`MAX_REASON`]
//! bytes. Whether the word is believed ([`RelayWord::judge`]) is decided from it: only a listener
//! that serves this slot and this stream, while Postgres shows a relay of the slot, speaks for it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use serde::Serialize;

use crate::lsn::Lsn;
use crate::text::shown;

/// The bound on each request, connect included.
pub(crate) const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest answer read (`/metrics` is a few kilobytes).
const MAX_BODY: usize = 1 << 20;

/// The longest `/readyz` reason kept (the relay's own are under 60 bytes).
const MAX_REASON: usize = 120;

/// What the relay serving `http.listen` says of itself.
#[derive(Debug, Clone, Serialize)]
pub struct RelayWord {
    /// The address asked.
    pub(crate) address: String,
    /// Whether it answered at all.
    pub(crate) reached: bool,
    /// Whether `status` believes it ([`RelayWord::judge`]): only then does it speak for the relay.
    pub(crate) believed: bool,
    /// Why it is not believed, when it is not (and it answered).
    pub(crate) not_believed_because: Option<String>,
    /// `/readyz`: streaming with both connections up.
    pub(crate) ready: Option<bool>,
    /// `/readyz`'s reason when not ready (e.g. `nats disconnected`), escaped, one bounded line.
    pub(crate) not_ready_because: Option<String>,
    /// `/position`'s answer, when it has one that is a relay's position.
    pub(crate) position: Option<WordPosition>,
    /// Seconds since the relay's last ack (`None`: none yet, or not read).
    pub(crate) seconds_since_last_ack: Option<f64>,
    /// Why it could not be asked, or why `/position`'s answer was not a relay's position.
    pub(crate) error: Option<String>,
}

/// `/position`'s answer, each value checked: LSNs that parse, names kept escaped and bounded.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct WordPosition {
    /// The slot it serves.
    pub(crate) slot: String,
    /// The stream it serves.
    pub(crate) stream: String,
    /// Through where every event is stored.
    #[serde(serialize_with = "as_text")]
    pub(crate) stored_lsn: Lsn,
    /// What it last confirmed to the slot.
    #[serde(serialize_with = "as_text")]
    pub(crate) confirmed_lsn: Lsn,
    /// The stream sequence of the last message it stored.
    pub(crate) last_sequence: u64,
}

/// An LSN as `X/Y`.
fn as_text<S: serde::Serializer>(lsn: &Lsn, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(lsn)
}

impl WordPosition {
    /// From `/position`'s body: the relay's JSON, or why it is not.
    fn parse(body: &str) -> Result<WordPosition, NotPosition> {
        let v: serde_json::Value = serde_json::from_str(body).map_err(|_| NotPosition::NotJson)?;
        let text = |key: &'static str| {
            v.get(key)
                .and_then(|x| x.as_str())
                .ok_or(NotPosition::Lacks(key))
        };
        let lsn = |key: &'static str| -> Result<Lsn, NotPosition> {
            text(key)?.parse().map_err(|_| NotPosition::NotLsn(key))
        };
        Ok(WordPosition {
            slot: shown(text("slot")?, 63),
            stream: shown(text("stream")?, 255),
            stored_lsn: lsn("stored_lsn")?,
            confirmed_lsn: lsn("confirmed_lsn")?,
            last_sequence: v
                .get("last_sequence")
                .and_then(|x| x.as_u64())
                .ok_or(NotPosition::Lacks("last_sequence"))?,
        })
    }
}

/// Why a `/position` body is not the relay's position.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum NotPosition {
    #[error("its /position is not JSON")]
    NotJson,
    #[error("its /position has no {0}")]
    Lacks(&'static str),
    #[error("its /position's {0} is not an LSN")]
    NotLsn(&'static str),
}

/// Why a GET to the relay's listener got no answer, one line.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AskError {
    #[error("connecting to {addr}: {cause}")]
    Connect {
        addr: SocketAddr,
        cause: std::io::Error,
    },
    #[error("{addr}: {cause}")]
    Handshake {
        addr: SocketAddr,
        cause: hyper::Error,
    },
    #[error("{0}")]
    Request(hyper::http::Error),
    #[error("GET {path} on {addr}: {cause}")]
    Get {
        path: String,
        addr: SocketAddr,
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{addr} did not answer within {within:?}")]
    Timeout { addr: SocketAddr, within: Duration },
}

impl RelayWord {
    /// Whether the word speaks for this relay: Postgres shows a relay of the slot (`shown`: its
    /// walsender holds the slot, or its processes are connected, e.g. a standby), and the listener
    /// says it serves `slot` and `stream`. A listener that serves no position (a standby, a relay
    /// between sessions) cannot say whose it is: its word adds nothing Postgres does not show, and
    /// is not believed either. Sets [`RelayWord::believed`] and the reason when not.
    pub(crate) fn judge(&mut self, shown: bool, slot: &str, stream: &str) {
        let why = if !self.reached {
            None
        } else if !shown {
            Some(format!(
                "Postgres shows no relay of slot {slot}, so whatever answers on {} does not speak for one",
                self.address
            ))
        } else {
            match &self.position {
                None => Some(format!(
                    "it serves no position ({}), so it cannot say it is slot {slot}'s relay",
                    self.error
                        .as_deref()
                        .unwrap_or("a standby, or between sessions")
                )),
                Some(p) if p.slot != slot || p.stream != stream => Some(format!(
                    "it serves slot {} and stream {}, not slot {slot} and stream {stream}: another relay's listener",
                    p.slot, p.stream
                )),
                Some(_) => None,
            }
        };
        self.believed = self.reached && why.is_none();
        self.not_believed_because = why;
    }
}

/// Asks the relay listening on `listen` (`http.listen`); `None` when that is empty.
pub(crate) async fn ask(listen: &str) -> Option<RelayWord> {
    if listen.is_empty() {
        return None;
    }
    let mut word = RelayWord {
        address: listen.to_owned(),
        reached: false,
        believed: false,
        not_believed_because: None,
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
                word.not_ready_because = Some(shown(body.trim(), MAX_REASON));
            }
        }
        Err(e) => {
            word.error = Some(e.to_string());
            return Some(word);
        }
    }
    match get(addr, "/position").await {
        Ok((200, body)) => match WordPosition::parse(&body) {
            Ok(p) => word.position = Some(p),
            Err(e) => word.error = Some(e.to_string()),
        },
        Ok((status, _)) => word.error = Some(format!("/position answered {status}")),
        Err(e) => word.error = Some(e.to_string()),
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

/// One GET within [`ASK_TIMEOUT`]: the status code and the body, or why not (one line).
async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), AskError> {
    get_within(addr, path, ASK_TIMEOUT).await
}

/// One GET within `within` (a `/wait` is answered only when it ends): as [`get`].
pub(crate) async fn get_within(
    addr: SocketAddr,
    path: &str,
    within: Duration,
) -> Result<(u16, String), AskError> {
    let failed = |cause: Box<dyn std::error::Error + Send + Sync>| AskError::Get {
        path: path.to_owned(),
        addr,
        cause,
    };
    let request = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|cause| AskError::Connect { addr, cause })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|cause| AskError::Handshake { addr, cause })?;
        // The connection is driven beside the request, and dropped with it.
        let conn = tokio::spawn(conn);
        let req = hyper::Request::get(path)
            .header(hyper::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(AskError::Request)?;
        let res = sender
            .send_request(req)
            .await
            .map_err(|e| failed(e.into()))?;
        let status = res.status().as_u16();
        let body = Limited::new(res.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(failed)?
            .to_bytes();
        conn.abort();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(within, request)
        .await
        .unwrap_or(Err(AskError::Timeout { addr, within }))
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

    #[test]
    fn a_position_is_kept_only_as_plain_values() {
        let good = r#"{"slot":"s","stream":"S","stored_lsn":"0/16B3740","confirmed_lsn":"0/16B3700","last_sequence":7}"#;
        let p = WordPosition::parse(good).unwrap();
        assert_eq!(p.stored_lsn, Lsn(0x16B_3740));
        assert_eq!(p.last_sequence, 7);
        let injected = r#"{"slot":"s","stream":"S","stored_lsn":"0/1\nrelay: streaming (pid 1)\nhealthy","confirmed_lsn":"0/1","last_sequence":1}"#;
        assert_eq!(
            WordPosition::parse(injected).unwrap_err().to_string(),
            "its /position's stored_lsn is not an LSN"
        );
        let named = r#"{"slot":"s\u001b[2K","stream":"S","stored_lsn":"0/1","confirmed_lsn":"0/1","last_sequence":1}"#;
        assert_eq!(WordPosition::parse(named).unwrap().slot, r"s\u{1b}[2K");
        assert!(WordPosition::parse("ready").is_err());
    }

    #[test]
    fn only_a_listener_of_this_slot_and_stream_that_postgres_shows_is_believed() {
        let mut w = RelayWord {
            address: "127.0.0.1:1".into(),
            reached: true,
            believed: false,
            not_believed_because: None,
            ready: Some(true),
            not_ready_because: None,
            position: WordPosition::parse(
                r#"{"slot":"claims","stream":"CLAIMS","stored_lsn":"0/1","confirmed_lsn":"0/1","last_sequence":1}"#,
            )
            .ok(),
            seconds_since_last_ack: None,
            error: None,
        };
        w.judge(true, "claims", "CLAIMS");
        assert!(w.believed);
        w.judge(true, "orders", "ORDERS");
        assert!(!w.believed);
        assert!(
            w.not_believed_because
                .as_deref()
                .unwrap()
                .contains("serves slot claims and stream CLAIMS, not slot orders"),
            "{w:?}"
        );
        w.judge(false, "claims", "CLAIMS");
        assert!(!w.believed, "Postgres shows no relay");
        w.position = None;
        w.judge(true, "claims", "CLAIMS");
        assert!(!w.believed, "no position, no name");
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
