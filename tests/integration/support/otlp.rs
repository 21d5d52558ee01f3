//! An OTLP/HTTP trace receiver for the tests: a real HTTP/1.1 server (hyper) on a free loopback port
//! that decodes each `POST /v1/traces` body as the protocol's own `ExportTraceServiceRequest`
//! (`opentelemetry-proto`, protobuf), keeps the spans, and answers as a collector does. Tests judge
//! the relay's spans by what arrives here, exactly as a tracing backend would receive them.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;
use tokio::task::JoinHandle;

/// One span as received, ids in lower-case hex as a `traceparent` writes them.
#[derive(Debug, Clone)]
pub(crate) struct ReceivedSpan {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub trace_state: String,
    pub name: String,
    /// `SpanKind` of the protocol: 4 is PRODUCER.
    pub kind: i32,
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
    pub attributes: BTreeMap<String, String>,
    /// `StatusCode` of the protocol: 0 unset, 1 ok, 2 error.
    pub status_code: i32,
    pub status_message: String,
    /// The resource's `service.name`.
    pub service_name: String,
    /// The instrumentation scope's name.
    pub scope: String,
}

impl ReceivedSpan {
    pub(crate) fn attr(&self, key: &str) -> &str {
        self.attributes
            .get(key)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("span {} has no attribute {key}: {self:?}", self.name))
    }
}

/// See the module docs.
pub(crate) struct OtlpReceiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl OtlpReceiver {
    pub(crate) async fn start() -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (s, r) = (Arc::clone(&spans), Arc::clone(&requests));
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (s, r) = (Arc::clone(&s), Arc::clone(&r));
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        handle(req, Arc::clone(&s), Arc::clone(&r))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        OtlpReceiver {
            addr,
            spans,
            requests,
            task,
        }
    }

    /// What `telemetry.otlp_endpoint` is set to: the base URL, as for a collector.
    pub(crate) fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub(crate) fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap().clone()
    }

    /// `METHOD path content-type` of every request received.
    pub(crate) fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    /// Stops listening: from now on connections to the endpoint are refused.
    pub(crate) async fn stop(mut self) {
        self.task.abort();
        // The aborted accept loop drops the listener once it has ended.
        let _ = (&mut self.task).await;
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<Vec<String>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let line = format!(
        "{} {} {}",
        req.method(),
        req.uri().path(),
        req.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    );
    requests.lock().unwrap().push(line);
    let reply = |status: StatusCode, body: Vec<u8>| {
        Ok(Response::builder()
            .status(status)
            .header("content-type", "application/x-protobuf")
            .body(Full::new(Bytes::from(body)))
            .unwrap())
    };
    if req.uri().path() != "/v1/traces" {
        return reply(StatusCode::NOT_FOUND, Vec::new());
    }
    let Ok(body) = req.into_body().collect().await else {
        return reply(StatusCode::BAD_REQUEST, Vec::new());
    };
    let Ok(export) = ExportTraceServiceRequest::decode(body.to_bytes()) else {
        return reply(StatusCode::BAD_REQUEST, Vec::new());
    };
    let mut got = Vec::new();
    for rs in export.resource_spans {
        let service_name = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(kv.value.as_ref()))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            let scope = ss.scope.map(|s| s.name).unwrap_or_default();
            for span in ss.spans {
                let status = span.status.unwrap_or_default();
                got.push(ReceivedSpan {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    trace_state: span.trace_state,
                    name: span.name,
                    kind: span.kind,
                    start_unix_nano: span.start_time_unix_nano,
                    end_unix_nano: span.end_time_unix_nano,
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                        .collect(),
                    status_code: status.code,
                    status_message: status.message,
                    service_name: service_name.clone(),
                    scope: scope.clone(),
                });
            }
        }
    }
    spans.lock().unwrap().extend(got);
    reply(
        StatusCode::OK,
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}
