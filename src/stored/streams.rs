//! Which streams of the account store subjects under the position service's reply prefixes
//! ([`watch_streams`]): the part of the reply rule (`replies.rs`) that NATS permissions alone do
//! not give, since a stream may be given any subjects, `_INBOX.>` among them.
//!
//! One JetStream request per prefix: `$JS.API.STREAM.NAMES` with the subject filter `<prefix>>`,
//! which nats-server answers with the streams whose subjects overlap the filter (wildcards on
//! either side), so the answer is empty in an account that keeps inboxes out of its streams, however
//! many streams it has, and nothing else of the streams is read. Asked when the service starts and
//! every [`RECHECK`] after; a stream created in between is seen at the next check (creating one
//! takes JetStream rights that can do far worse to the relay's stream). While the answer is not
//! known (the first check, a failed one) the rules answer nothing: the service fails closed, and
//! says why once per change.

use std::time::Duration;

use serde::Deserialize;
use tokio::sync::watch;
use tracing::{info, warn};

use super::replies::Streams;

/// How often the account is asked again while the answer is known.
const RECHECK: Duration = Duration::from_secs(30);
/// How soon after a failed check the next one is made.
const RETRY: Duration = Duration::from_secs(5);
/// How long one request may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The part of `STREAM.NAMES`' answer that is read: the first page of names (at most 1,024, the
/// server's page) is all a refusal needs to name one.
#[derive(Deserialize)]
struct Names {
    #[serde(default)]
    streams: Option<Vec<String>>,
}

/// Asks JetStream through `client` which streams store subjects under each of `prefixes`, now and
/// every [`RECHECK`], into `out`, until `stopped` changes or closes.
pub(crate) async fn watch_streams(
    client: async_nats::Client,
    prefixes: Vec<String>,
    out: watch::Sender<Streams>,
    mut stopped: watch::Receiver<()>,
) {
    let js = async_nats::jetstream::ContextBuilder::new()
        .timeout(TIMEOUT)
        .build(client);
    let mut last: Option<Result<Streams, NamesError>> = None;
    loop {
        let now = check(&js, &prefixes).await;
        let pause = if now.is_ok() { RECHECK } else { RETRY };
        if last.as_ref() != Some(&now) {
            report(&prefixes, &now);
        }
        out.send_replace(now.clone().unwrap_or_default());
        last = Some(now);
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = stopped.changed() => return,
        }
    }
}

/// JetStream did not say which streams store a prefix's subjects: the filter asked, and what the
/// server or the client said (kept as text, so that two checks that failed alike compare equal and
/// log once).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("$JS.API.STREAM.NAMES for {filter}: {said}")]
pub(crate) struct NamesError {
    filter: String,
    said: String,
}

/// One check of every prefix.
async fn check(
    js: &async_nats::jetstream::Context,
    prefixes: &[String],
) -> Result<Streams, NamesError> {
    let mut by_prefix = Vec::with_capacity(prefixes.len());
    for p in prefixes {
        let filter = format!("{p}>");
        let answer: async_nats::jetstream::response::Response<Names> = js
            .request("STREAM.NAMES", &serde_json::json!({ "subject": filter }))
            .await
            .map_err(|e| NamesError {
                filter: filter.clone(),
                said: e.to_string(),
            })?;
        let names = match answer {
            async_nats::jetstream::response::Response::Ok(n) => n.streams.unwrap_or_default(),
            async_nats::jetstream::response::Response::Err { error } => {
                return Err(NamesError {
                    filter,
                    said: error.to_string(),
                });
            }
        };
        by_prefix.push(names.into_iter().min());
    }
    Ok(Streams::Checked(by_prefix))
}

/// One log line per change: what the service answers now.
fn report(prefixes: &[String], now: &Result<Streams, NamesError>) {
    match now {
        Err(e) => warn!(
            error = %crate::text::one_line(&e.to_string()),
            "the position service answers no request: it cannot tell which streams store subjects under \
             nats.service_reply_prefixes; allow the relay's NATS user to publish to $JS.API.STREAM.NAMES"
        ),
        Ok(Streams::Checked(by_prefix)) => {
            for (p, stream) in prefixes.iter().zip(by_prefix) {
                if let Some(stream) = stream {
                    warn!(
                        prefix = %p,
                        %stream,
                        "the position service answers no reply subject under this prefix: a stream of the \
                         account stores subjects under it; give the stream other subjects, or requesters \
                         another inbox prefix (nats.service_reply_prefixes)"
                    );
                }
            }
            if by_prefix.iter().all(Option::is_none) {
                info!(prefixes = ?prefixes, "the position service answers on requesters' inboxes under these prefixes");
            }
        }
        Ok(Streams::Unknown) => {}
    }
}
