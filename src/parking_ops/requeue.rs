//! `outbox-relay requeue`: one call of a sql/09_requeue.sql function on the control connection
//! (`postgres.url`, or `--postgres-url` for an operator's own login), which commits one control
//! message, and what it returned (the request id, the message's LSN); then the bounded wait for the
//! relay to carry it out (`wait.rs`).

use std::fmt;
use std::time::Duration;

use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use super::error::RequeueError;
use super::functions::{Function, control_prefix, installed};
use super::key::Key;
use super::parked::is_parked;
use super::wait::Waited;
use crate::config::Settings;
use crate::error_chain::error_line;
use crate::lsn::Lsn;
use crate::source::{ConnInfo, connect_control, query_error_text};
use crate::text::shown;

/// What the operator asks the relay to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Republish the key's parked run, checked again, and release it.
    Requeue(Key),
    /// Release the key without republishing.
    Discard(Key),
    /// Republish one dead letter, checked again.
    RequeueEvent(String),
}

impl Request {
    fn function(&self) -> Function {
        match self {
            Request::Requeue(_) => Function::Requeue,
            Request::Discard(_) => Function::Discard,
            Request::RequeueEvent(_) => Function::RequeueEvent,
        }
    }
}

/// `requeue Claim/4711`, `discard Claim/4711`, `requeue event 6f1c…`, escaped.
impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Request::Requeue(k) => write!(f, "requeue {k}"),
            Request::Discard(k) => write!(f, "discard {k}"),
            Request::RequeueEvent(id) => write!(f, "requeue event {}", shown(id, 200)),
        }
    }
}

/// A request the database committed.
#[derive(Clone, Debug)]
pub struct Sent {
    /// What was asked.
    pub request: Request,
    /// The request's id (`Outbox-Control-Id` on what the relay writes for it).
    pub id: String,
    /// The control message's LSN.
    pub lsn: Lsn,
    /// The server's WAL position after the COMMIT: the relay has carried the request out once it
    /// has stored through here.
    pub committed_by: Lsn,
    /// The function called, schema-qualified.
    pub function: String,
}

impl fmt::Display for Sent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: request {} committed, control message at {} ({})",
            self.request,
            self.id,
            self.lsn,
            shown(&self.function, 200)
        )
    }
}

/// Refuses a dead letter's requeue, with or without `--force`, when the relay these settings
/// describe asks Postgres for no logical messages: it would never see the request, and `requeue`
/// would then report it stored.
pub fn refuse_event(settings: &Settings, request: &Request) -> Result<(), RequeueError> {
    match request {
        Request::RequeueEvent(id) if !crate::parking::control::messages_read(settings) => {
            Err(RequeueError::NoMessages {
                event: shown(id, 200),
            })
        }
        _ => Ok(()),
    }
}

/// Refuses a requeue or discard of a key the stream does not show parked (the newest message of
/// its parking subject is no parked copy), or when that cannot be read. A dead letter's requeue is
/// not checked here: the relay looks for it when it reads the request.
pub async fn refuse_unparked(settings: &Settings, request: &Request) -> Result<(), RequeueError> {
    let (key, op) = match request {
        Request::Requeue(k) => (k, "requeue"),
        Request::Discard(k) => (k, "discard"),
        Request::RequeueEvent(_) => return Ok(()),
    };
    match is_parked(settings, key).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(RequeueError::NotParked {
            key: key.to_string(),
            parked: settings.command("parked"),
            op,
        }),
        Err(e) => Err(RequeueError::ParkedUnknown {
            key: key.to_string(),
            why: error_line(&e),
        }),
    }
}

/// Calls the function for `request` installed for this relay's prefix and returns what it
/// committed. `postgres_url` replaces `postgres.url` for this call (an operator's own login).
pub async fn send(
    settings: &Settings,
    postgres_url: Option<&str>,
    request: Request,
) -> Result<Sent, RequeueError> {
    let pg = match postgres_url {
        Some(url) => {
            let info = ConnInfo::parse(url).map_err(|e| RequeueError::Url(e.to_string()))?;
            connect_control(&info, "outbox-relay requeue").await?
        }
        None => connect_control(&settings.conn, "outbox-relay requeue").await?,
    };
    let function = request.function();
    let prefix = control_prefix(&settings.config().name);
    let name = installed(&pg, function, &prefix).await?;
    let call = match &request {
        Request::Requeue(k) | Request::Discard(k) => {
            pg.query_one(
                &format!("SELECT request::text, lsn::text FROM {name}($1, $2)"),
                &[&k.aggregate_type, &k.aggregate_id],
            )
            .await
        }
        Request::RequeueEvent(id) => {
            pg.query_one(
                &format!("SELECT request::text, lsn::text FROM {name}($1)"),
                &[id],
            )
            .await
        }
    };
    let row = match call {
        Ok(row) => row,
        Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            return Err(RequeueError::Refused {
                function: shown(&name, 200),
                role: session_user(&pg).await,
            });
        }
        Err(e) => {
            return Err(RequeueError::Query {
                function: function.signature(),
                error: query_error_text(&e),
            });
        }
    };
    let id: String = row.get(0);
    let lsn: String = row.get(1);
    // Autocommit: the call's transaction has committed once it returned, so the WAL position now is
    // past its commit record.
    let committed_by: Result<String, _> = pg
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .map(|r| r.get(0));
    let parse = |s: &str| {
        s.parse::<Lsn>().map_err(|e| RequeueError::Query {
            function: function.signature(),
            error: format!("returned LSN {}: {e}", shown(s, 40)),
        })
    };
    let lsn = parse(&lsn)?;
    let committed_by = match committed_by {
        Ok(s) => parse(&s)?,
        // The request is committed all the same; wait for its message's own LSN.
        Err(_) => lsn,
    };
    Ok(Sent {
        request,
        id,
        lsn,
        committed_by,
        function: name,
    })
}

/// The login role, for the grant to suggest.
async fn session_user(pg: &Client) -> String {
    pg.query_one("SELECT quote_ident(session_user)", &[])
        .await
        .map(|r| shown(&r.get::<_, String>(0), 100))
        .unwrap_or_else(|_| "<your login role>".into())
}

/// Waits at most `bound` for the relay to report `sent`'s transaction stored.
pub async fn wait_stored(settings: &Settings, sent: &Sent, bound: Duration) -> Waited {
    super::wait::stored(settings, sent.committed_by, bound).await
}
