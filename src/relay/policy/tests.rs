//! The policy held to its table and the table to docs/architecture.md: an example of every case
//! of every error type, judged by the policy's functions, must get the verdict the table states for
//! it, in the column the verdict names; and the doc must show the table as `render` writes it.

use std::time::Duration;

use super::*;
use crate::Lsn;
use crate::position::Position;

fn server(code: &str) -> SourceError {
    SourceError::Server {
        context: "test",
        error: Box::new(ServerError {
            severity: "ERROR".into(),
            code: code.into(),
            message: "m".into(),
            detail: None,
            hint: None,
        }),
    }
}

#[test]
fn classifies_sqlstates() {
    assert!(
        server("55006").is_transient(),
        "slot active elsewhere retries"
    );
    assert!(server("57P01").is_transient(), "admin shutdown retries");
    assert!(server("08006").is_transient());
    assert!(!server("28P01").is_transient(), "bad password is definite");
    assert!(!server("42704").is_transient(), "missing slot is definite");
    assert!(
        !server("55000").is_transient(),
        "invalidated slot is definite"
    );
}

/// docs/security.md, finding 4: a multi-host attempt where one host is down and another refused
/// the password (or TLS) is definite, whatever the order; all hosts down, or one down and one a
/// standby, retry.
#[test]
fn a_refusal_by_any_host_is_definite() {
    let down = || SourceError::Io {
        target: "db1:5432".into(),
        error: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
    };
    let standby = || SourceError::WrongRole {
        target: "db3:5432".into(),
        found: "a standby",
        wanted: "read-write",
    };
    let hosts = |es: Vec<SourceError>| {
        SourceError::NoHost(es.into_iter().map(|e| ("h".to_owned(), e)).collect())
    };
    for refusal in [
        server("28P01"),
        server("28000"),
        SourceError::Auth(crate::source::AuthError::BadSignature(
            std::io::Error::other("bad proof"),
        )),
        SourceError::Tls("the server does not support TLS".into()),
    ] {
        let e = hosts(vec![down(), refusal]);
        assert!(!e.is_transient(), "{e}");
        assert!(e.is_refusal(), "{e}");
    }
    assert!(!hosts(vec![server("28P01"), down()]).is_transient());
    assert!(hosts(vec![down(), down()]).is_transient());
    assert!(hosts(vec![down(), standby()]).is_transient());
    // A definite error that is not a refusal keeps the old rule: a host down may come back.
    assert!(hosts(vec![down(), server("3D000")]).is_transient());
}

/// The name a table row gives each variant of the error types the policy judges: a new variant
/// is a compile error here until it has an example below (and a verdict in the table).
fn source_case(e: &SourceError) -> &'static str {
    match e {
        SourceError::Io { .. } => "`Io`",
        SourceError::Timeout { .. } => "`Timeout`",
        SourceError::Server { .. } => "`Server`",
        SourceError::Auth(_) => "`Auth`",
        SourceError::Tls(_) => "`Tls`",
        SourceError::Protocol(_) => "`Protocol`",
        SourceError::Closed(_) => "`Closed`",
        SourceError::Version { .. } => "`Version`",
        SourceError::BadFrame { .. } => "`BadFrame`",
        SourceError::FrameTooLarge { .. } => "`FrameTooLarge`",
        SourceError::WrongRole { .. } => "`WrongRole`",
        SourceError::NoHost(_) => "`NoHost`",
    }
}

fn sink_case(e: &SinkError) -> &'static str {
    match e {
        SinkError::AckTimeout(..) => "`AckTimeout`",
        SinkError::Interrupted { .. } => "`Interrupted`",
        SinkError::Publish { .. } => "`Publish`",
        SinkError::Forged { .. } => "`Forged`",
        SinkError::Unshown { .. } => "`Unshown`",
        SinkError::FenceBroken { .. } => "`FenceBroken`",
        SinkError::CorePublish { .. } => "`CorePublish`",
        SinkError::BatchRefused { .. } => "`BatchRefused`",
        SinkError::Stopped => "`Stopped`",
        SinkError::StoredPastRefused { .. } => "`StoredPastRefused`",
        SinkError::Unproven { .. } => "`Unproven`",
        SinkError::Diverged { .. } => "`Diverged`",
        SinkError::Invalid { .. } => "`Invalid`",
        SinkError::DeadLetterRefused { .. } => "`DeadLetterRefused`",
        SinkError::ParkedFull { .. } => "`ParkedFull`",
        SinkError::ParkedTooMany { .. } => "`ParkedTooMany`",
    }
}

fn setup_case(e: &SetupError) -> &'static str {
    match e {
        SetupError::Postgres { .. } => "`Postgres`",
        SetupError::Nats(_) => "`Nats`",
        SetupError::Query(_) => "`Query`",
        SetupError::Prerequisite(_) => "`Prerequisite`",
        SetupError::Publication { .. } => "`Publication`",
        SetupError::Slot { .. } => "`Slot`",
        SetupError::Stream { .. } => "`Stream`",
        SetupError::NoJetStream(_) => "`NoJetStream`",
        SetupError::Create { .. } => "`Create`",
        SetupError::Taken { .. } => "`Taken`",
    }
}

fn io() -> SourceError {
    SourceError::Io {
        target: "db1:5432".into(),
        error: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
    }
}

fn hosts(es: Vec<SourceError>) -> SourceError {
    SourceError::NoHost(es.into_iter().map(|e| ("h".to_owned(), e)).collect())
}

/// One example of every case of `SourceError`.
fn source_examples() -> Vec<SourceError> {
    vec![
        io(),
        SourceError::Timeout {
            target: "db1:5432".into(),
            secs: 10,
        },
        server("08006"),
        server("55006"),
        server("28P01"),
        SourceError::Auth(crate::source::AuthError::BadSignature(
            std::io::Error::other("p"),
        )),
        SourceError::Tls("no TLS".into()),
        SourceError::Protocol("bad".into()),
        SourceError::Closed("replication stream ended"),
        SourceError::Version {
            version: 140000,
            what: "failover".into(),
            needs: "17",
        },
        SourceError::BadFrame {
            lsn: Lsn(1),
            reason: "short".into(),
        },
        SourceError::FrameTooLarge {
            tag: 'w',
            len: 1 << 30,
            max: 1 << 20,
        },
        SourceError::WrongRole {
            target: "db3:5432".into(),
            found: "a standby",
            wanted: "read-write",
        },
        hosts(vec![io(), io()]),
        hosts(vec![io(), server("28P01")]),
    ]
}

/// One example of every case of `SinkError`.
fn sink_examples() -> Vec<SinkError> {
    use crate::nats::{NatsError, NatsErrorKind};
    let nats = || NatsError::of(NatsErrorKind::Closed);
    let at = Position::in_transaction(Lsn(0x100), 0);
    vec![
        SinkError::AckTimeout(Duration::from_secs(5), "e-1".into()),
        SinkError::Interrupted { id: "e-1".into() },
        SinkError::Publish {
            id: "e-1".into(),
            source: nats(),
        },
        SinkError::Forged {
            id: "e-1".into(),
            source: crate::sink::Forged {
                stream: "OUTBOX".into(),
                why: "it names no stream".into(),
            },
        },
        SinkError::Unshown {
            position: at,
            stream: "OUTBOX".into(),
            sequence: 7,
            source: nats(),
        },
        SinkError::FenceBroken {
            id: "e-1".into(),
            expected: 6,
            source: nats(),
        },
        SinkError::CorePublish {
            id: "e-1".into(),
            source: nats(),
        },
        SinkError::BatchRefused {
            id: "e-1".into(),
            refusal: "too large".into(),
        },
        SinkError::Stopped,
        SinkError::StoredPastRefused {
            id: "e-1".into(),
            expected: 6,
            last: 8,
        },
        SinkError::Unproven {
            sequence: 9,
            count: 3,
            reason: "message 7 is gone".into(),
            over: None,
        },
        SinkError::Diverged {
            sequence: 9,
            tail: at,
            at,
            over: None,
        },
        SinkError::Invalid {
            id: "e-1".into(),
            lsn: Lsn(0x100),
            reason: "bad token".into(),
        },
        SinkError::DeadLetterRefused {
            id: "e-1".into(),
            lsn: Lsn(0x100),
            reason: "bad token".into(),
            refusal: "too large".into(),
        },
    ]
}

/// One example of every case of `SetupError`: a Postgres error that restarts and one that stops.
fn setup_examples() -> Vec<SetupError> {
    let pg = |source| SetupError::Postgres {
        target: "127.0.0.1:5432".into(),
        check: "postgres.url".into(),
        source,
    };
    vec![
        pg(io()),
        pg(server("28P01")),
        SetupError::Prerequisite("wal_level".into()),
        SetupError::Publication {
            name: "p".into(),
            problem: "x".into(),
        },
        SetupError::Slot {
            name: "s".into(),
            problem: "x".into(),
        },
        SetupError::Stream {
            name: "S".into(),
            problem: "x".into(),
        },
        SetupError::Taken {
            key: "outbox.table",
            problem: "x".into(),
        },
        SetupError::Create {
            object: "stream".into(),
            source: Box::new(io()),
        },
        SetupError::Create {
            object: "stream".into(),
            source: "refused".into(),
        },
    ]
}

/// The column of a row that a verdict names.
fn column(row: &Row, verdict: Verdict) -> &'static str {
    match verdict {
        Verdict::Restart(_) | Verdict::Standby => row.restarts,
        Verdict::Stop => row.stops,
        Verdict::Defect => row.defects,
    }
}

fn row(error: &str) -> &'static Row {
    TABLE
        .iter()
        .find(|r| r.error.contains(error))
        .unwrap_or_else(|| panic!("no row of TABLE names {error}"))
}

/// Every example gets the verdict the table puts its case under.
#[test]
fn every_case_gets_the_verdict_the_table_states() {
    let sources = row("`SourceError`");
    for e in source_examples() {
        let v = source(&e);
        let case = source_case(&e);
        assert!(
            column(sources, v).contains(case),
            "{case} ({e}) is {v:?}, which the table does not say"
        );
    }
    let sinks = row("`SinkError`");
    for e in sink_examples() {
        let v = sink(&e);
        let case = sink_case(&e);
        assert!(
            column(sinks, v).contains(case),
            "{case} ({e}) is {v:?}, which the table does not say"
        );
        // In a running session, through the NATS side as a whole.
        assert_eq!(nats(&NatsTrouble::Sink(e)), v);
    }
    let setups = row("`SetupError`");
    for e in setup_examples() {
        let v = startup(&e);
        let case = setup_case(&e);
        assert!(
            column(setups, v).contains(case),
            "{case} ({e}) is {v:?} at start, which the table does not say"
        );
    }
}

/// Every case of the three error types has an example above (a name match alone cannot see a
/// variant nobody constructs).
#[test]
fn every_variant_has_an_example() {
    let names =
        |cases: Vec<&'static str>| cases.into_iter().collect::<std::collections::BTreeSet<_>>();
    let sources = names(source_examples().iter().map(source_case).collect());
    assert_eq!(sources.len(), 12, "{sources:?}");
    let sinks = names(sink_examples().iter().map(sink_case).collect());
    assert_eq!(sinks.len(), 14, "{sinks:?}");
    let setups = names(setup_examples().iter().map(setup_case).collect());
    // `Nats`, `Query` and `NoJetStream` wrap async-nats and tokio-postgres errors that cannot be
    // made without a server: their verdicts are tested by `startup.rs`'s tests and real servers.
    assert_eq!(setups.len(), 7, "{setups:?}");
}

#[test]
fn a_slot_held_by_another_relay_is_a_standby_and_a_defect_stops_saying_so() {
    assert_eq!(source(&server("55006")), Verdict::Standby);
    assert!(matches!(
        from_source(server("55006")),
        SessionEnd::Restart(Restart::SlotHeld(_))
    ));
    let order = crate::progress::OutOfOrderAck {
        expected: 4,
        got: 5,
    };
    let e = from_order(order);
    assert!(e.is_defect());
    let line = crate::error_chain::error_chain(&e);
    assert!(line.contains("a bug of its own"), "{line}");
    assert!(line.contains("Please report it"), "{line}");
    assert!(line.ends_with("acks must come in publish order"), "{line}");
    match from_sink(SinkError::Stopped) {
        SessionEnd::Fatal(e) => assert!(e.is_defect(), "{e}"),
        other => panic!("{other:?}"),
    }
}

/// docs/architecture.md shows the table as `render` writes it; on a change, paste what this
/// prints there.
#[test]
fn the_architecture_doc_shows_the_policy_table() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/architecture.md"))
        .expect("docs/architecture.md");
    let table = render();
    assert!(
        doc.contains(&table),
        "docs/architecture.md, \"Errors: restart or stop\", must show the policy's table \
         (src/relay/policy.rs, TABLE) as it is:\n{table}"
    );
}
