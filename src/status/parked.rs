//! The parked keys as `status` reads and judges them: the stream's parking subjects read once
//! through the parking ledger (`parking::ledger::each_parked`, the very reader `outbox-relay
//! parked` and the relay's start use), counted ([`ParkedStatus`]), and any parked key made a
//! problem that names the two commands an operator acts with ([`parked_problem`]). A parked key
//! holds its events back from their consumers until someone requeues or discards it, so it is
//! never healthy, however long it has been parked.
//!
//! Bounded: the read stops past `outbox.max_parked_keys` keys (the relay stops before it parks
//! more; `more` says the stream shows more), and at most [`FIRST`] keys are kept to be shown,
//! each field cut to a bounded, escaped line (`parking_ops::Parked`).

use std::time::Duration;

use serde::Serialize;

use crate::config::Settings;
use crate::nats::NatsPort;
use crate::parking::ledger::each_parked;
use crate::parking::set::since_unix_ms;
use crate::parking_ops::Parked;

/// How many parked keys `status` shows (the rest are counted: `outbox-relay parked` lists them).
pub(crate) const FIRST: usize = 10;

/// How long the read waits for the server's next message.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The parked keys the stream shows.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ParkedStatus {
    /// Parked keys (counted up to `outbox.max_parked_keys`).
    pub(crate) keys: u64,
    /// The events their runs hold, the poison events included.
    pub(crate) events: u64,
    /// The commit time of the oldest poison event (RFC 3339).
    pub(crate) oldest_since: Option<String>,
    /// Seconds since then, as of this `status` (`None`: no key, or a time the relay did not write).
    pub(crate) oldest_age_secs: Option<u64>,
    /// The first [`FIRST`] keys, in the stream's order of their parking subjects.
    pub(crate) first: Vec<Parked>,
    /// The stream shows more keys than `outbox.max_parked_keys`; they are not counted.
    pub(crate) more: bool,
}

/// The parking subjects could not be read: the stream, the subjects, and why.
#[derive(Debug, thiserror::Error)]
#[error("stream {stream}: reading the parked keys ({filter}): {why}")]
pub struct ParkedReadError {
    stream: String,
    filter: String,
    why: String,
}

/// Every parked key `port`'s stream shows, counted, the first [`FIRST`] kept.
pub async fn read_parked(
    port: &NatsPort,
    settings: &Settings,
) -> Result<ParkedStatus, ParkedReadError> {
    let c = settings.config();
    let max = usize::try_from(c.outbox.max_parked_keys).unwrap_or(usize::MAX);
    let mut st = ParkedStatus::default();
    let mut oldest: Option<(u64, String)> = None;
    let read = each_parked(
        port,
        &c.nats.stream,
        &c.nats.dead_letter_subject,
        max,
        READ_TIMEOUT,
        |e| {
            if st.keys as usize >= max {
                st.more = true;
                return Err(());
            }
            st.keys += 1;
            st.events = st.events.saturating_add(e.parked.count);
            // RFC 3339 texts of the relay's one form sort as times; a foreign text sorts last.
            let since = since_unix_ms(&e.parked.since).unwrap_or(u64::MAX);
            if oldest.as_ref().is_none_or(|(t, _)| since < *t) {
                oldest = Some((since, e.parked.since.clone()));
            }
            if st.first.len() < FIRST {
                st.first.push(Parked::from_entry(&e));
            }
            Ok(())
        },
    )
    .await
    .map_err(|e| ParkedReadError {
        stream: c.nats.stream.clone(),
        filter: crate::parking::parked_filter(&c.nats.dead_letter_subject),
        why: crate::error_chain::error_chain(&e),
    })?;
    // `Err(())`: stopped at the bound, which `more` says.
    let _ = read;
    if let Some((ms, since)) = oldest {
        st.oldest_since = Some(crate::text::shown(&since, 64));
        st.oldest_age_secs = (ms != u64::MAX).then(|| age_secs(ms));
    }
    Ok(st)
}

/// Seconds from `unix_ms` to now (0 for a time in the future: clocks differ).
fn age_secs(unix_ms: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    now.saturating_sub(unix_ms) / 1000
}

/// Whether `status` reads the parking subjects: in park mode, or when the stream stores them
/// anyway (keys parked before `outbox.on_invalid` changed stay parked: only a requeue or a discard
/// releases them). A stream that stores no parking subject can hold no parked key.
pub(super) fn reads_parked(settings: &Settings, subjects: Option<&[String]>) -> bool {
    let probe = crate::parking::parked_subject(
        &settings.config().nats.dead_letter_subject,
        crate::parking::KeyHash::of(None, None),
    );
    settings.park_on_invalid
        || subjects.is_some_and(|s| s.iter().any(|f| crate::route::subject_covers(f, &probe)))
}

/// Any parked key, as a problem: how many, since when, the first one and its reason, and the two
/// commands that list and release them, with the `--config` (and the variables) `status` ran with:
/// copied without them, they would read or release another relay's keys. No clock in the line (the
/// age is in `--json`), so the same stream reads as the same line.
pub(super) fn parked_problem(
    settings: &Settings,
    stream: &str,
    p: &ParkedStatus,
) -> Option<String> {
    let first = p.first.first()?;
    let more = if p.more {
        ", and more past outbox.max_parked_keys"
    } else {
        ""
    };
    Some(format!(
        "stream {stream}: {} parked key{} ({} event{}{more}) held back from their consumers since {}, \
         the first {first}; list them with {}, fix the cause, then {} (or --discard): \
         docs/recovery.md, \"A parked key\"",
        p.keys,
        if p.keys == 1 { "" } else { "s" },
        p.events,
        if p.events == 1 { "" } else { "s" },
        p.oldest_since.as_deref().unwrap_or("an unknown time"),
        settings.command("parked"),
        settings.command("requeue --key TYPE/ID"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parked(since: &str) -> Parked {
        Parked {
            aggregate_type: Some("Claim".into()),
            aggregate_id: Some("4711".into()),
            count: 2,
            since: since.into(),
            reason: "schema Claim.json: /amount: must be a number".into(),
            poison: "e-7001".into(),
            subject: "outbox.dead.parked.00ff".into(),
        }
    }

    #[test]
    fn a_parked_key_is_a_problem_naming_both_commands_and_none_is_not() {
        let mut settings = crate::config::Config::default().validate().unwrap();
        assert_eq!(
            parked_problem(&settings, "OUTBOX", &ParkedStatus::default()),
            None
        );
        let p = ParkedStatus {
            keys: 3,
            events: 7,
            oldest_since: Some("2026-01-01T00:00:00Z".into()),
            oldest_age_secs: Some(10),
            first: vec![parked("2026-01-02T00:00:00Z")],
            more: true,
        };
        let line = parked_problem(&settings, "OUTBOX", &p).unwrap();
        for part in [
            "stream OUTBOX: 3 parked keys (7 events, and more past outbox.max_parked_keys)",
            "since 2026-01-01T00:00:00Z",
            "Claim/4711: 2 events parked since 2026-01-02T00:00:00Z behind e-7001",
            "`outbox-relay parked`",
            "`outbox-relay requeue --key TYPE/ID`",
        ] {
            assert!(line.contains(part), "{part:?} not in {line}");
        }
        assert!(!line.contains('\n'));
        // Run with --config: both commands carry it, or they act on the default relay's stream.
        settings.origin.file = Some("/etc/relay b.toml".into());
        let line = parked_problem(&settings, "OUTBOX", &p).unwrap();
        for part in [
            "list them with `outbox-relay --config '/etc/relay b.toml' parked`",
            "then `outbox-relay --config '/etc/relay b.toml' requeue --key TYPE/ID` (or --discard)",
        ] {
            assert!(line.contains(part), "{part:?} not in {line}");
        }
    }

    #[test]
    fn the_parking_subjects_are_read_in_park_mode_or_when_the_stream_stores_them() {
        let settings = |park: bool| {
            let mut c = crate::config::Config::default();
            c.nats.fence = true;
            if park {
                c.outbox.on_invalid = crate::config::OnInvalid::Park;
            }
            c.validate().unwrap()
        };
        let dl = settings(false);
        assert!(!reads_parked(&dl, None));
        assert!(!reads_parked(&dl, Some(&["outbox.>".into()][..])));
        assert!(reads_parked(&settings(true), None));
        let dead = &dl.config().nats.dead_letter_subject;
        assert!(reads_parked(&dl, Some(&[format!("{dead}.>")][..])));
    }
}
