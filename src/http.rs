//! The HTTP listener (`http.listen`): `/metrics` (Prometheus text), `/healthz` (200 while the process
//! runs), `/readyz` (200 only while streaming with both connections up, 503 otherwise).
//!
//! HTTP/1 only, GET only, no bodies read: probes and scrapers need nothing more. It reads the shared
//! [`Metrics`] and never touches the pipeline.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use crate::metrics::Metrics;

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
pub async fn bind(listen: &str) -> Result<TcpListener, BindError> {
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

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut last_emfile = None;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors (EMFILE/ENFILE) starves the Postgres and NATS connections too:
                // an operator must see it.
                if matches!(e.raw_os_error(), Some(23 | 24)) {
                    // Once a minute at most: the condition lasts, the log must not flood.
                    if last_emfile
                        .is_none_or(|t: std::time::Instant| t.elapsed() > Duration::from_secs(60))
                    {
                        warn!(error = %e, "http listener cannot accept: out of file descriptors");
                        last_emfile = Some(std::time::Instant::now());
                    }
                } else {
                    debug!(error = %e, "http accept failed");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Over the cap the connection is closed at once: probes retry, a flood gets nothing.
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            debug!(%peer, "http connection refused: too many open");
            continue;
        };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let _slot = slot;
            let service = service_fn(move |req| {
                let metrics = Arc::clone(&metrics);
                async move { Ok::<_, Infallible>(respond(&req, &metrics)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(MAX_BUF)
                // One request per connection: no idle keep-alive connections to hold open.
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, conn).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(%peer, error = %e, "http connection ended"),
                Err(_) => debug!(%peer, "http connection closed: too slow"),
            }
        });
    }
}

/// Open connections at most; probes and one scraper need a handful.
const MAX_CONNECTIONS: usize = 32;
/// A client must send its request headers within this.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// A whole connection, request and response, within this (slow readers included).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// hyper's read buffer (the smallest it allows); GET requests of probes are tiny.
const MAX_BUF: usize = 8192;

fn respond(req: &Request<Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String, content_type: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static(content_type),
        );
        r
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
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
            let why = match (
                Metrics::get(&metrics.streaming),
                Metrics::get(&metrics.nats_connected),
            ) {
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
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: /metrics /healthz /readyz\n".into(),
            "text/plain",
        ),
    }
}
