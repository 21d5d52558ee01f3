//! The one place that decides what the relay does about an error ([`Verdict`]): restart the session
//! from the slot's position, wait as a standby, stop (a definite error: a bad setting, a lost slot,
//! data the relay cannot read, an event `outbox.on_invalid = "stop"` stops at), or stop because the
//! relay itself is wrong (a defect: something its code rules out happened; the message says it is
//! a bug and asks for a report, and the simulation counts it as a failure).
//!
//! Every error type a relay meets has its verdict function here ([`source`], [`sink`],
//! [`startup`], …), decided from the type and its structured data (SQLSTATE, variant, error code),
//! never from message text; the error types themselves (`src/source/error.rs`,
//! `src/sink/error.rs`, `src/relay/error.rs`, …) only say what happened. The functions that turn an
//! error into a session's end ([`from_source`], [`from_sink`], …) apply the verdict, so the
//! session, the connector, the state and start-up never decide for themselves. [`TABLE`] states
//! the same decisions for people: docs/architecture.md's "Errors: restart or stop" is that table,
//! and a test below holds the two to each other and to the functions (an example of every case).
//!
//! The rule: a Postgres *server* error is definite unless its SQLSTATE says the condition passes by
//! itself; a failure of the connection itself is transient; whatever the relay refuses on its own
//! (authentication policy, TLS, a protocol violation, a frame it cannot decode) is definite. On the
//! NATS side, a running relay restarts on every failure except the decisions about an event and
//! the defects. An error no one listed stops the relay, where a wrong password or a missing slot
//! retried quietly would look like a relay that is merely slow: stopping loses nothing (the slot
//! keeps the events).

use crate::metrics::CauseKind;
use crate::nats::ConnectError;
use crate::progress::OutOfOrderAck;
use crate::setup::SetupError;
use crate::sink::SinkError;
use crate::source::{ServerError, SourceError};
use crate::tail::TailError;

use super::error::{NatsTrouble, RelayError, Restart, SessionEnd};

/// What the relay does about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// End the session; the next starts from the slot's own position after the backoff (at start,
    /// before the first session: wait for the server and try again). The cause labels the metrics.
    Restart(CauseKind),
    /// Another relay streams the slot: wait as a standby, retrying at a steady pace.
    Standby,
    /// A definite error: the relay stops with the message (exit 1).
    Stop,
    /// Something the relay's code rules out happened: it stops, saying it is a bug.
    Defect,
}

/// The verdict on a replication-connection error.
pub(crate) fn source(e: &SourceError) -> Verdict {
    if e.sqlstate() == Some("55006") {
        // "replication slot … is active for PID …": another relay streams.
        Verdict::Standby
    } else if source_transient(e) {
        Verdict::Restart(CauseKind::Postgres)
    } else {
        Verdict::Stop
    }
}

/// Whether reconnecting and restarting from the confirmed LSN can succeed after `e`.
fn source_transient(e: &SourceError) -> bool {
    match e {
        SourceError::Io { .. }
        | SourceError::Timeout { .. }
        | SourceError::Closed(_)
        | SourceError::WrongRole { .. } => true,
        // One host down must not turn another's refusal into a retry: every attempt would log in
        // with the refused credentials again (an LDAP or PAM account locks, an address gets
        // banned). Any host that refused them, or TLS, makes the attempt definite.
        SourceError::NoHost(tried) => {
            !tried.iter().any(|(_, e)| e.is_refusal())
                && tried.iter().any(|(_, e)| source_transient(e))
        }
        SourceError::Server { error, .. } => server_transient(error),
        SourceError::Auth(_)
        | SourceError::Tls(_)
        | SourceError::Protocol(_)
        | SourceError::Version { .. }
        | SourceError::BadFrame { .. }
        | SourceError::FrameTooLarge { .. } => false,
    }
}

/// Whether a server error passes by itself. SQLSTATE classes from
/// <https://www.postgresql.org/docs/current/errcodes-appendix.html>.
fn server_transient(e: &ServerError) -> bool {
    let class = e.code.get(..2).unwrap_or("");
    match e.code.as_str() {
        // object_in_use: "replication slot … is active for PID …" (an old walsender lingers).
        "55006" => true,
        // cannot_connect_now (starting up / shutting down), admin/crash shutdown.
        "57P01" | "57P02" | "57P03" | "57P05" => true,
        // too_many_connections: another client may leave.
        "53300" => true,
        _ => matches!(class, "08" | "40" | "53" | "58"),
    }
}

impl SourceError {
    /// True when reconnecting and restarting from the confirmed LSN can succeed: the policy's
    /// answer ([`source`]), asked by the tests of the replication client.
    pub fn is_transient(&self) -> bool {
        source_transient(self)
    }
}

/// The verdict on a publishing error: the decisions about an event stop, a window that cannot be
/// settled is a defect, everything else restarts.
pub(crate) fn sink(e: &SinkError) -> Verdict {
    match e {
        SinkError::Invalid { .. }
        | SinkError::DeadLetterRefused { .. }
        | SinkError::ParkedFull { .. }
        | SinkError::ParkedTooMany { .. } => Verdict::Stop,
        SinkError::Stopped => Verdict::Defect,
        SinkError::AckTimeout(..)
        | SinkError::Interrupted { .. }
        | SinkError::Publish { .. }
        | SinkError::Forged { .. }
        | SinkError::Unshown { .. }
        | SinkError::FenceBroken { .. }
        | SinkError::CorePublish { .. }
        | SinkError::BatchRefused { .. }
        | SinkError::StoredPastRefused { .. }
        | SinkError::Unproven { .. }
        | SinkError::Diverged { .. } => Verdict::Restart(CauseKind::Nats),
    }
}

/// The verdict on the NATS side of a running session: reaching NATS and reading the stream's tail
/// always restart (start-up has checked credentials and TLS already); publishing as [`sink`] says.
pub(crate) fn nats(e: &NatsTrouble) -> Verdict {
    match e {
        NatsTrouble::Connect(_) | NatsTrouble::Tail(_) | NatsTrouble::Unavailable(_) => {
            Verdict::Restart(CauseKind::Nats)
        }
        NatsTrouble::Sink(e) => sink(e),
    }
}

/// The verdict on a failure before the first session (setup and the first NATS connection): a
/// restart is a wait for that server, and only a server that cannot be reached is waited for.
/// Refused NATS credentials, TLS, an unreadable creds file, JetStream missing, and every check
/// setup makes on what it found are definite.
pub(crate) fn startup(e: &SetupError) -> Verdict {
    let postgres = |transient: bool| match transient {
        true => Verdict::Restart(CauseKind::Postgres),
        false => Verdict::Stop,
    };
    match e {
        SetupError::Postgres { source, .. } => postgres(source_transient(source)),
        SetupError::Nats(ConnectError::Connect { .. }) => Verdict::Restart(CauseKind::Nats),
        SetupError::Nats(_) => Verdict::Stop,
        SetupError::Query(q) => postgres(query_transient(q)),
        // A request JetStream did not answer in time: the connection went away during the checks.
        // Without responders NATS runs without JetStream, which is a setting (`-js`).
        SetupError::NoJetStream(g) if request_timed_out(g) => Verdict::Restart(CauseKind::Nats),
        SetupError::NoJetStream(_) => Verdict::Stop,
        SetupError::Create { source, .. } => {
            if let Some(q) = source.downcast_ref::<tokio_postgres::Error>() {
                postgres(query_transient(q))
            } else if let Some(s) = source.downcast_ref::<SourceError>() {
                postgres(source_transient(s))
            } else {
                Verdict::Stop
            }
        }
        SetupError::Prerequisite(_)
        | SetupError::Publication { .. }
        | SetupError::Slot { .. }
        | SetupError::Stream { .. }
        | SetupError::Taken { .. } => Verdict::Stop,
    }
}

/// A catalog query failed because the connection did (closed, I/O), or with a SQLSTATE the
/// replication source calls transient (the same classes: 08, 40, 53, 57P0x, 58).
fn query_transient(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if let Some(db) = e.as_db_error() {
        return server_transient(&ServerError {
            severity: db.severity().to_owned(),
            code: db.code().code().to_owned(),
            message: String::new(),
            detail: None,
            hint: None,
        });
    }
    // No server error and not closed: the socket failed underneath.
    std::error::Error::source(e).is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some())
}

fn request_timed_out(e: &async_nats::jetstream::context::GetStreamError) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<async_nats::RequestError>())
        .is_some_and(|r| r.kind() == async_nats::RequestErrorKind::TimedOut)
}

/// How a session ends on a replication-source error.
pub fn from_source(e: SourceError) -> SessionEnd {
    match source(&e) {
        Verdict::Standby => SessionEnd::Restart(Restart::SlotHeld(e)),
        Verdict::Restart(_) => SessionEnd::Restart(Restart::Postgres(e)),
        Verdict::Stop => SessionEnd::Fatal(RelayError::Source(e)),
        Verdict::Defect => SessionEnd::Fatal(RelayError::Defect(Box::new(e))),
    }
}

/// How a session ends on trouble on the NATS side ([`nats`]).
fn from_nats(t: NatsTrouble) -> SessionEnd {
    match (nats(&t), t) {
        (Verdict::Stop, NatsTrouble::Sink(e)) => SessionEnd::Fatal(RelayError::Sink(e)),
        (Verdict::Defect, NatsTrouble::Sink(e)) => {
            SessionEnd::Fatal(RelayError::Defect(Box::new(e)))
        }
        (_, t) => SessionEnd::Restart(Restart::Nats(t)),
    }
}

/// How a session ends on a publishing error.
pub(crate) fn from_sink(e: SinkError) -> SessionEnd {
    from_nats(NatsTrouble::Sink(e))
}

/// How a session ends when the stream's tail cannot be read: a restart ([`nats`]).
pub(crate) fn from_tail(e: TailError) -> SessionEnd {
    from_nats(NatsTrouble::Tail(e))
}

/// How a running session ends when NATS cannot be reached: a restart, always ([`nats`]; the
/// connector's signature, which the simulation implements too, says so).
pub(crate) fn from_connect(e: ConnectError) -> Restart {
    Restart::Nats(NatsTrouble::Connect(e))
}

/// A pgoutput message that cannot be decoded: the relay stops (data it cannot read will not read
/// better on a retry), and nothing past `confirmed` is confirmed.
pub(crate) fn from_decode(
    confirmed: crate::Lsn,
    source: crate::pgoutput::DecodeError,
) -> RelayError {
    RelayError::Decode { confirmed, source }
}

/// Decoded messages that break the shape of a transaction stream (at `lsn`): the relay stops.
pub(crate) fn from_stage(lsn: crate::Lsn, source: crate::outbox::StageError) -> RelayError {
    RelayError::Stage { lsn, source }
}

/// An ack out of publish order: the sink's ordering broke, a defect. Nothing past it is confirmed.
pub(crate) fn from_order(e: OutOfOrderAck) -> RelayError {
    RelayError::Defect(Box::new(e))
}

/// Another client consumed the slot past events the stream lacks (`text` says which and how to
/// recover): every session refuses until the evidence is gone, restarting as Postgres trouble.
pub(crate) fn slot_consumed(text: String) -> SessionEnd {
    SessionEnd::Restart(Restart::SlotConsumed(text))
}

/// `START_REPLICATION` was refused with `e`; `invalidated`: when the slot's row says it is
/// invalidated (read only for SQLSTATE 55000), what is lost and how to recover
/// (`setup::lost_slot_message`). An invalidated slot stops the relay; anything else is any source
/// error.
pub(crate) fn start_refused(slot: &str, e: SourceError, invalidated: Option<String>) -> SessionEnd {
    match invalidated {
        Some(message) => SessionEnd::Fatal(RelayError::SlotInvalidated {
            slot: slot.to_owned(),
            message,
            source: e,
        }),
        None => from_source(e),
    }
}

/// A backfill's marker stands on the stream (`problem` says whose and how to finish it): the
/// relay stops, rather than stream a slot that may stand past rows the backfill never published.
pub(crate) fn backfill_unfinished(stream: &str, problem: String) -> SessionEnd {
    SessionEnd::Fatal(RelayError::Setup(SetupError::Stream {
        name: stream.to_owned(),
        problem,
    }))
}

/// One row of [`TABLE`]: an error type and the cases of each verdict, in words.
#[cfg_attr(not(test), allow(dead_code))] // Read by the tests that hold the doc and the code to it.
pub(crate) struct Row {
    /// The error, and what meets it.
    pub(crate) error: &'static str,
    /// Where its verdict is decided.
    pub(crate) decided: &'static str,
    /// The cases that restart (at start: that are waited for).
    pub(crate) restarts: &'static str,
    /// The cases that stop the relay.
    pub(crate) stops: &'static str,
    /// The cases that are defects.
    pub(crate) defects: &'static str,
}

/// The decisions above, for people: docs/architecture.md's "Errors: restart or stop" table is
/// [`render`]ed from it (a test holds the doc to it, and it to the functions).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const TABLE: &[Row] = &[
    Row {
        error: "Replication connection and stream (`SourceError`)",
        decided: "`policy::source`",
        restarts: "`Io`, `Timeout`, `Closed` (including the stream ending), `WrongRole` (a standby during a \
                   failover), `NoHost` when no host refused and any host's error restarts; `Server` with SQLSTATE \
                   class 08, 40, 53 or 58, or 57P01, 57P02, 57P03, 57P05; `Server` 55006 (the slot held by another \
                   relay) is the standby's wait, every ~0.4 s rather than on the growing backoff",
        stops: "`Auth`, `Tls`, `Protocol`, `Version`, `BadFrame`, `FrameTooLarge`, `NoHost` when any host refused \
                the credentials or TLS; every other `Server` error (28P01 bad password, 3D000 no database, 42704 no \
                slot, 42501 permission, …)",
        defects: "",
    },
    Row {
        error: "`START_REPLICATION` refused with 55000",
        decided: "`policy::start_refused`, after `classify_start_error` (`src/relay/connector.rs`) read the slot's row",
        restarts: "",
        stops: "`RelayError::SlotInvalidated` when the row says invalidated; otherwise as any `SourceError`",
        defects: "",
    },
    Row {
        error: "The partition lookup (a relation the publication sends under a partition's name)",
        decided: "`policy::source` (`Servers::partitions`, `src/relay/connector.rs`)",
        restarts: "failure or 10 s timeout, as `SourceError::Io`",
        stops: "",
        defects: "",
    },
    Row {
        error: "Another client consumed the slot past events the stream lacks",
        decided: "`policy::slot_consumed` (`State::slot_checked`)",
        restarts: "`Restart::SlotConsumed`, cause `postgres`, until the evidence is gone",
        stops: "",
        defects: "",
    },
    Row {
        error: "An unfinished backfill's marker on the stream",
        decided: "`policy::backfill_unfinished` (`refuse_under_backfill`)",
        restarts: "",
        stops: "always",
        defects: "",
    },
    Row {
        error: "NATS connect, reading the stream's tail (`ConnectError`, `TailError`)",
        decided: "`policy::nats`",
        restarts: "always (`Restart::Nats`): start-up has already checked credentials and TLS",
        stops: "",
        defects: "",
    },
    Row {
        error: "Publishing (`SinkError`)",
        decided: "`policy::sink`",
        restarts: "`AckTimeout`, `Publish`, `Forged`, `Unshown`, `CorePublish`, `FenceBroken`, `BatchRefused`, \
                   `Interrupted` (a clean stop while a message's settling waited); \
                   `Diverged`, `Unproven`, `StoredPastRefused` also set `distrust` (see the fence above)",
        stops: "`Invalid` (`outbox.on_invalid = \"stop\"`), `ParkedFull`, `ParkedTooMany` (`outbox.max_parked_keys` reached), `DeadLetterRefused` (not even the minimal dead letter \
                is stored)",
        defects: "`Stopped` (the window holds nothing it can settle where it must)",
    },
    Row {
        error: "Decoding and stream shape (`DecodeError`, `StageError`)",
        decided: "`policy::from_decode`, `policy::from_stage`",
        restarts: "",
        stops: "`RelayError::Decode`, `RelayError::Stage`",
        defects: "",
    },
    Row {
        error: "Acks out of publish order (`OutOfOrderAck`)",
        decided: "`policy::from_order`",
        restarts: "",
        stops: "",
        defects: "always",
    },
    Row {
        error: "Before the first session: setup and the first NATS connection (`SetupError`)",
        decided: "`policy::startup` (`startup::wait_for_servers`)",
        restarts: "waited for: `Postgres` when its `SourceError` restarts, `Query` whose connection closed or failed \
                   or whose SQLSTATE restarts, `Create` whose cause is either, `NoJetStream` when the request timed \
                   out, `Nats` when no server could be reached (`ConnectError::Connect`)",
        stops: "`Nats` refusing the credentials or TLS, or an unreadable creds file; `NoJetStream`; \
                `Prerequisite`, `Publication`, `Slot`, `Stream`, `Taken` (another relay relays the table or \
                the prefix); every other `Postgres`, `Query` or `Create`",
        defects: "",
    },
];

/// [`TABLE`] as the Markdown table docs/architecture.md shows.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn render() -> String {
    let mut out = String::from(
        "| Error | Decided in | Restarts | Stops | Defect: stops, and says it is a bug |\n\
         | --- | --- | --- | --- | --- |\n",
    );
    for r in TABLE {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            r.error, r.decided, r.restarts, r.stops, r.defects
        ));
    }
    out
}

#[cfg(test)]
mod tests;
