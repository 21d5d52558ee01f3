//! The HTTP listener (`http.listen`): `/metrics` (Prometheus text), `/healthz` (200 while the process
//! runs), `/readyz` (200 only while streaming with both connections up, 503 otherwise).
//!
//! HTTP/1 only, GET only, no bodies read: probes and scrapers need nothing more. It reads the shared
//! [`Metrics`] and never touches the pipeline.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::debug;

use crate::metrics::Metrics;

/// Binds `listen`. Fails with a line naming `http.listen` when the address cannot be used.
pub async fn bind(listen: &str) -> Result<TcpListener, String> {
    let addr: SocketAddr = listen
        .parse()
        .map_err(|_| format!("http.listen {listen:?} is not an address like 127.0.0.1:9187"))?;
    TcpListener::bind(addr).await.map_err(|e| {
        format!(
            "http.listen {listen}: cannot listen ({e}): pick a free address, or \"\" to disable the listener"
        )
    })
}

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                debug!(error = %e, "http accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let metrics = Arc::clone(&metrics);
                async move { Ok::<_, Infallible>(respond(&req, &metrics)) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(%peer, error = %e, "http connection ended");
            }
        });
    }
}

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
