//! The HTTP listener (`http.listen`): `/metrics` (Prometheus text), `/healthz` (200 while the process
//! runs), `/readyz` (200 only while streaming with both connections up, 503 otherwise), and
//! read-your-writes: `/position` and `/wait?lsn=X/Y&timeout_ms=N` ([`crate::stored`]).
//!
//! HTTP/1 only, GET and HEAD only, no bodies read: probes, scrapers and waits need nothing more. It
//! reads the shared [`Metrics`] and [`Positions`] and never touches the pipeline.
//!
//! Probes must stay answerable while something else holds connections open (a scanner, a client
//! that sends half a request and stalls, reconnecting as it is cut, waits held for their 30 s): a
//! kubelet whose probes are refused restarts a healthy pod. So one peer address holds at most
//! [`MAX_PER_PEER`] of the [`MAX_CONNECTIONS`] slots, the last [`RESERVED_FOR_NEW_PEERS`] slots go
//! only to a peer with next to nothing open, and a request's headers must arrive within
//! [`HEADER_READ_TIMEOUT`], so a stalled connection gives its slot back within a second. A `/wait`,
//! the one request that holds its connection for long, also needs one of [`MAX_WAITS`] wait slots
//! (half the connections, so the other half is always left to short requests such as probes), at
//! most [`MAX_WAITS_PER_PEER`] per peer, and for these every loopback address is one peer: any local
//! process may bind any of 127.0.0.0/8 (round 5, finding 8: two waits from each of 16 loopback
//! addresses took all 32 slots). Beyond it a wait is answered 503 at once.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use crate::metrics::Metrics;
use crate::stored::{MAX_REQUEST_BYTES, MAX_WAIT_MS, Positions, WaitOutcome, WaitRequest};

/// `http.listen` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// `http.listen` is not an `ip:port` address.
    #[error("http.listen {0:?} is not an address like 127.0.0.1:9187")]
    Address(String),
    /// Binding the address failed (in use, or not allowed).
    #[error(
        "http.listen {listen}: cannot listen: pick a free address, or \"\" to disable the listener"
    )]
    Listen {
        /// `http.listen`.
        listen: String,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
}

/// Binds `listen`. Fails with a line naming `http.listen` when the address cannot be used.
pub(crate) async fn bind(listen: &str) -> Result<TcpListener, BindError> {
    let addr: SocketAddr = listen
        .parse()
        .map_err(|_| BindError::Address(listen.to_owned()))?;
    TcpListener::bind(addr)
        .await
        .map_err(|source| BindError::Listen {
            listen: listen.to_owned(),
            source,
        })
}

/// Serves until the task is dropped: each accepted connection, within the caps, on its own task.
pub(crate) async fn serve(listener: TcpListener, metrics: Arc<Metrics>, positions: Arc<Positions>) {
    let slots = Arc::new(Mutex::new(Slots::default()));
    let mut last_emfile = None;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                accept_failed(&e, &mut last_emfile);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Over a cap the connection is closed at once: probes retry, a flood gets nothing.
        let Some(slot) = Slot::take(&slots, peer.ip()) else {
            debug!(%peer, "http connection refused: too many open");
            continue;
        };
        tokio::spawn(connection(
            stream,
            peer,
            slot,
            Arc::clone(&metrics),
            Arc::clone(&positions),
            Arc::clone(&slots),
        ));
    }
}

/// An accept that failed. Out of descriptors (EMFILE/ENFILE) starves the Postgres and NATS
/// connections too: an operator must see it, once a minute at most (the condition lasts, the log
/// must not flood). Anything else is for debugging.
fn accept_failed(e: &std::io::Error, last_emfile: &mut Option<std::time::Instant>) {
    if matches!(e.raw_os_error(), Some(libc::ENFILE | libc::EMFILE)) {
        if last_emfile.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
            warn!(error = %e, "http listener cannot accept: out of file descriptors");
            *last_emfile = Some(std::time::Instant::now());
        }
    } else {
        debug!(error = %e, "http accept failed");
    }
}

/// One connection, holding its `slot` until it ends: one request, closed when it is done or when
/// it takes longer than [`CONNECTION_TIMEOUT`] (plus what a wait extended it by).
async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    slot: Slot,
    metrics: Arc<Metrics>,
    positions: Arc<Positions>,
    slots: Arc<Mutex<Slots>>,
) {
    let _slot = slot;
    // A wait may hold its connection past CONNECTION_TIMEOUT, by its own bounded timeout.
    let (extend, mut extended) = tokio::sync::watch::channel(Duration::ZERO);
    let service = service_fn(move |req| {
        let metrics = Arc::clone(&metrics);
        let positions = Arc::clone(&positions);
        let slots = Arc::clone(&slots);
        let extend = extend.clone();
        async move {
            Ok::<_, Infallible>(match req.uri().path() {
                "/wait" if is_get(&req) => {
                    let held = WaitHeld {
                        slots,
                        peer: peer.ip(),
                    };
                    wait(req, &metrics, &positions, &extend, held).await
                }
                _ => respond(&req, &metrics, &positions),
            })
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_BUF)
        // One request per connection: no idle keep-alive connections to hold open.
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let opened = tokio::time::Instant::now();
    loop {
        let deadline = opened + CONNECTION_TIMEOUT + *extended.borrow_and_update();
        tokio::select! {
            r = &mut conn => {
                if let Err(e) = r {
                    debug!(%peer, error = %e, "http connection ended");
                }
                break;
            }
            () = tokio::time::sleep_until(deadline) => {
                debug!(%peer, "http connection closed: too slow");
                break;
            }
            Ok(()) = extended.changed() => {}
        }
    }
}

/// Open connections at most, all peers together; probes and one scraper need a handful.
const MAX_CONNECTIONS: usize = 32;
/// Open connections at most from one peer (an IPv4 address, an IPv6 /64): one client, however many
/// connections it opens, leaves the other slots to the rest.
const MAX_PER_PEER: usize = 8;
/// The last slots, which only a peer with fewer than [`FEW`] connections open may take: even when a
/// few peers hold their share each, a kubelet (liveness and readiness probes at once) gets in.
const RESERVED_FOR_NEW_PEERS: usize = 8;
/// See [`RESERVED_FOR_NEW_PEERS`].
const FEW: usize = 2;
/// A client must send its request headers within this. A probe sends them at once (a few dozen
/// bytes); a connection that stalls gives its slot back within a second.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(1);
/// A whole connection, request and response, within this (slow readers included); a `/wait`
/// gets its `timeout_ms` (at most [`MAX_WAIT_MS`]) on top.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// hyper's read buffer (the smallest it allows); GET requests of probes are tiny.
const MAX_BUF: usize = 8192;
/// Open `/wait`s at most, all peers together: half the connections, so the other half always
/// serves short requests (probes, scrapes, `/position`).
const MAX_WAITS: usize = MAX_CONNECTIONS / 2;
/// Open `/wait`s at most from one peer (every loopback address counting as one): half of what a
/// peer may hold, so its other connections stay free for its probes.
const MAX_WAITS_PER_PEER: usize = MAX_PER_PEER / 2;
/// What an open `/wait` holds while it waits, charged to the open waits' byte budget
/// (`stored::MAX_WAIT_BYTES`): the connection's buffers and task.
const HTTP_WAIT_BYTES: usize = 4 * MAX_BUF;

/// The open connections, in total and per peer, and the open waits among them.
#[derive(Default)]
struct Slots {
    open: usize,
    by_peer: HashMap<IpAddr, usize>,
    waits: usize,
    waits_by_peer: HashMap<IpAddr, usize>,
}

impl Slots {
    /// Takes a slot for a connection from `peer` when the caps allow it.
    fn admit(&mut self, peer: IpAddr) -> bool {
        let mine = self.by_peer.get(&peer).copied().unwrap_or(0);
        let allowed = mine < MAX_PER_PEER
            && self.open < MAX_CONNECTIONS
            && (self.open < MAX_CONNECTIONS - RESERVED_FOR_NEW_PEERS || mine < FEW);
        if allowed {
            self.open += 1;
            *self.by_peer.entry(peer).or_default() += 1;
        }
        allowed
    }

    fn release(&mut self, peer: IpAddr) {
        self.open -= 1;
        decrement(&mut self.by_peer, peer);
    }

    /// Takes a wait slot for an admitted connection from `peer` when the caps allow it.
    fn admit_wait(&mut self, peer: IpAddr) -> bool {
        let mine = self.waits_by_peer.get(&peer).copied().unwrap_or(0);
        let allowed = self.waits < MAX_WAITS && mine < MAX_WAITS_PER_PEER;
        if allowed {
            self.waits += 1;
            *self.waits_by_peer.entry(peer).or_default() += 1;
        }
        allowed
    }

    fn release_wait(&mut self, peer: IpAddr) {
        self.waits -= 1;
        decrement(&mut self.waits_by_peer, peer);
    }
}

/// One less for `peer`; a peer with none left leaves the map, which so holds only open ones.
fn decrement(map: &mut HashMap<IpAddr, usize>, peer: IpAddr) {
    if let Some(n) = map.get_mut(&peer) {
        *n -= 1;
        if *n == 0 {
            map.remove(&peer);
        }
    }
}

/// What a `/wait` needs to take a wait slot: the listener's slots and the connection's peer.
struct WaitHeld {
    slots: Arc<Mutex<Slots>>,
    peer: IpAddr,
}

/// One open `/wait`'s wait slot, given back on drop.
struct WaitSlot {
    slots: Arc<Mutex<Slots>>,
    peer: IpAddr,
}

impl WaitSlot {
    fn take(held: WaitHeld) -> Option<WaitSlot> {
        let peer = wait_peer_key(held.peer);
        let admitted = held
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit_wait(peer);
        // Built only when admitted: a WaitSlot gives its slot back when dropped.
        admitted.then(|| WaitSlot {
            slots: held.slots,
            peer,
        })
    }
}

impl Drop for WaitSlot {
    fn drop(&mut self) {
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release_wait(self.peer);
    }
}

/// One admitted connection's slot, given back on drop.
struct Slot {
    slots: Arc<Mutex<Slots>>,
    peer: IpAddr,
}

impl Slot {
    fn take(slots: &Arc<Mutex<Slots>>, ip: IpAddr) -> Option<Slot> {
        let peer = peer_key(ip);
        let admitted = slots.lock().unwrap_or_else(|e| e.into_inner()).admit(peer);
        admitted.then(|| Slot {
            slots: Arc::clone(slots),
            peer,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(self.peer);
    }
}

/// Who counts as one peer: an IPv4 address (also when mapped into IPv6), or an IPv6 /64, since one
/// host is commonly given a whole /64 and could otherwise take a slot per address.
fn peer_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(bits.into())
        }
        v4 => v4,
    }
}

/// Who counts as one peer for wait slots: as [`peer_key`], except that every loopback address
/// (127.0.0.0/8, `::1`) is one, since every local process may use any of them.
fn wait_peer_key(ip: IpAddr) -> IpAddr {
    if ip.to_canonical().is_loopback() {
        IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
    } else {
        peer_key(ip)
    }
}

fn text(status: StatusCode, body: String, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

fn json(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    text(status, body + "\n", "application/json")
}

/// `{"error": "..."}` with `status`.
fn json_error(status: StatusCode, error: &str) -> Response<Full<Bytes>> {
    json(status, serde_json::json!({ "error": error }).to_string())
}

fn is_get(req: &Request<Incoming>) -> bool {
    req.method() == Method::GET || req.method() == Method::HEAD
}

/// `GET /wait?lsn=X/Y&timeout_ms=N`: 200 stored, 504 timed out, 400 bad input, 413/414 a body or
/// a query over [`MAX_REQUEST_BYTES`], 503 while this relay does not stream, or when its wait slots
/// ([`MAX_WAITS`], [`MAX_WAITS_PER_PEER`]) or the open waits' byte budget are taken. The request is
/// dropped before the wait: an open wait holds only its parsed LSN and timeout.
async fn wait(
    req: Request<Incoming>,
    metrics: &Metrics,
    positions: &Positions,
    extend: &tokio::sync::watch::Sender<Duration>,
    held: WaitHeld,
) -> Response<Full<Bytes>> {
    let query = req.uri().query().unwrap_or("");
    if query.len() > MAX_REQUEST_BYTES {
        metrics.position_refused_too_large.inc();
        return json_error(
            StatusCode::URI_TOO_LONG,
            &format!(
                "request: the query is {} bytes, more than {MAX_REQUEST_BYTES}: send only lsn and timeout_ms",
                query.len()
            ),
        );
    }
    if has_body(&req) {
        metrics.position_refused_too_large.inc();
        return json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request: /wait takes no body: send lsn and timeout_ms in the query",
        );
    }
    let wait = match WaitRequest::from_query(query) {
        Ok(w) => w,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    drop(req);
    let Some(_wait_slot) = WaitSlot::take(held) else {
        metrics.position_refused_overloaded.inc();
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many open waits on this listener (from your address, or in all): ask again later, or wait over NATS",
        );
    };
    let outcome = match positions.wait(wait, HTTP_WAIT_BYTES) {
        Ok(outcome) => outcome,
        Err(e) => return json_error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    };
    // Bounded by MAX_WAIT_MS (the request parser refuses more).
    let _ = extend.send(wait.timeout.min(Duration::from_millis(MAX_WAIT_MS)));
    match outcome.await {
        o @ WaitOutcome::Stored { .. } => json(StatusCode::OK, o.to_json()),
        o @ WaitOutcome::TimedOut { .. } => json(StatusCode::GATEWAY_TIMEOUT, o.to_json()),
        WaitOutcome::Overloaded => {
            metrics.position_refused_overloaded.inc();
            json_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many open waits: ask again later",
            )
        }
        WaitOutcome::Stopping => json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the relay is stopping: ask again",
        ),
    }
}

/// Whether the request announces a body (a length above zero, or chunks): `/wait` reads none, and a
/// client that sends one means something else.
fn has_body(req: &Request<Incoming>) -> bool {
    let headers = req.headers();
    headers.contains_key(hyper::header::TRANSFER_ENCODING)
        || headers
            .get(hyper::header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0")
}

fn respond(
    req: &Request<Incoming>,
    metrics: &Metrics,
    positions: &Positions,
) -> Response<Full<Bytes>> {
    if !is_get(req) {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "GET only\n".into(),
            "text/plain",
        );
    }
    match req.uri().path() {
        "/metrics" => text(
            StatusCode::OK,
            metrics.render(),
            "text/plain; version=0.0.4; charset=utf-8",
        ),
        "/healthz" => text(StatusCode::OK, "ok\n".into(), "text/plain"),
        "/readyz" if metrics.ready() => text(StatusCode::OK, "ready\n".into(), "text/plain"),
        "/readyz" => {
            let why = match (metrics.streaming.get(), metrics.nats_connected.get()) {
                (0, 0) => "not streaming from postgres; nats disconnected",
                (0, _) => "not streaming from postgres",
                _ => "nats disconnected",
            };
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{why}\n"),
                "text/plain",
            )
        }
        "/position" => match positions.position() {
            Ok(p) => json(StatusCode::OK, p.to_json()),
            Err(e) => json_error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        },
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: /metrics /healthz /readyz /position /wait\n".into(),
            "text/plain",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn one_peer_takes_at_most_its_share_and_new_peers_keep_room() {
        let mut slots = Slots::default();
        let flood = ip("10.0.0.1");
        let admitted = (0..100).filter(|_| slots.admit(flood)).count();
        assert_eq!(admitted, MAX_PER_PEER);
        // Three peers hold their share: only the reserved slots are left.
        for p in ["10.0.0.2", "10.0.0.3"] {
            for _ in 0..MAX_PER_PEER {
                assert!(slots.admit(ip(p)));
            }
        }
        assert_eq!(slots.open, MAX_CONNECTIONS - RESERVED_FOR_NEW_PEERS);
        assert!(!slots.admit(flood), "a full peer stays full");
        // A fourth peer may take the reserve only while it has next to nothing open.
        let busy = ip("10.0.0.4");
        assert!(slots.admit(busy) && slots.admit(busy));
        assert!(!slots.admit(busy), "the reserve is for new peers");
        // A probe from a new peer still gets in, twice (liveness and readiness).
        let kubelet = ip("10.0.0.9");
        assert!(slots.admit(kubelet) && slots.admit(kubelet));
        slots.release(kubelet);
        slots.release(kubelet);
        assert!(!slots.by_peer.contains_key(&kubelet));
        assert!(slots.admit(kubelet));
    }

    #[test]
    fn the_total_cap_holds_whatever_the_peers() {
        let mut slots = Slots::default();
        let admitted = (0..200u32)
            .filter(|i| slots.admit(IpAddr::V4((0x0a00_0000 + i / 2).into())))
            .count();
        assert_eq!(admitted, MAX_CONNECTIONS);
    }

    #[test]
    fn waits_take_at_most_half_the_slots_and_loopback_is_one_peer_for_them() {
        let mut slots = Slots::default();
        // Two waits from each of 16 loopback addresses (round 5, finding 8).
        let mut waiting = 0;
        for i in 2..18u32 {
            let addr = IpAddr::V4((0x7f00_0000 + i).into());
            for _ in 0..2 {
                if slots.admit(addr) {
                    if slots.admit_wait(wait_peer_key(addr)) {
                        waiting += 1;
                    } else {
                        // Refused at once: its connection closes.
                        slots.release(addr);
                    }
                }
            }
        }
        assert_eq!(
            waiting, MAX_WAITS_PER_PEER,
            "all of loopback is one peer for waits"
        );
        assert!(
            slots.admit(ip("127.0.0.200")),
            "a probe from a new address gets in"
        );
        // Remote peers together take at most half of the slots with waits.
        let mut slots = Slots::default();
        let remote = (0..100u32)
            .filter(|i| {
                let addr = IpAddr::V4((0x0a00_0000 + i).into());
                slots.admit(addr) && slots.admit_wait(wait_peer_key(addr))
            })
            .count();
        assert_eq!(remote, MAX_WAITS);
        slots.release_wait(wait_peer_key(ip("10.0.0.0")));
        assert!(slots.admit_wait(ip("10.0.0.77")));
        assert_eq!(wait_peer_key(ip("::1")), wait_peer_key(ip("127.3.2.1")));
        assert_eq!(wait_peer_key(ip("::ffff:127.0.0.9")), ip("127.0.0.1"));
        assert_eq!(wait_peer_key(ip("10.1.1.1")), ip("10.1.1.1"));
    }

    #[test]
    fn a_refused_wait_slot_gives_nothing_back() {
        let slots = Arc::new(Mutex::new(Slots::default()));
        let take = || {
            WaitSlot::take(WaitHeld {
                slots: Arc::clone(&slots),
                peer: ip("127.0.0.5"),
            })
        };
        let held: Vec<_> = (0..MAX_WAITS_PER_PEER).map(|_| take().unwrap()).collect();
        for _ in 0..10 {
            assert!(take().is_none());
        }
        assert_eq!(slots.lock().unwrap().waits, MAX_WAITS_PER_PEER);
        drop(held);
        assert_eq!(slots.lock().unwrap().waits, 0);
        assert!(slots.lock().unwrap().waits_by_peer.is_empty());
    }

    #[test]
    fn an_ipv6_slash_64_is_one_peer_and_mapped_ipv4_is_ipv4() {
        assert_eq!(
            peer_key(ip("2001:db8::1")),
            peer_key(ip("2001:db8::ffff:2"))
        );
        assert_ne!(peer_key(ip("2001:db8::1")), peer_key(ip("2001:db8:0:1::1")));
        assert_eq!(peer_key(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
    }
}
