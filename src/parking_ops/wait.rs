//! After a release is committed: waiting, bounded, until the relay reports it has stored through
//! the release's transaction, asked over the relay's HTTP listener (`http.listen`): `/position`
//! first, believed only when it serves this slot and this stream, then `/wait?lsn=…` (30 s at most
//! per request, the listener's own bound). Read-only; anything the listener says is kept as a
//! checked LSN or an escaped, bounded line.
//!
//! The LSN waited for is the server's WAL position read after the release's COMMIT returned, not
//! the message's own LSN: the relay's stored LSN is a commit's end (or, while idle, the WAL end a
//! keepalive reports), and only a position past the commit says the transaction was carried out.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::Settings;
use crate::lsn::Lsn;
use crate::relay_word::{self, get_within};
use crate::text::shown;

/// The longest `/wait` one request asks for (the listener's own bound).
const MAX_WAIT_PER_REQUEST: Duration = Duration::from_secs(30);

/// The most of an answer a line shows.
const SHOWN_BYTES: usize = 200;

/// How the wait ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Waited {
    /// `http.listen` is empty: there is no one to ask.
    NoListener,
    /// Nothing answered on `http.listen`, or it answered as no relay of this slot does (why).
    NotAsked(String),
    /// The relay has stored through the LSN: the release is carried out.
    Stored(Lsn),
    /// Not within the bound; how far the relay had stored when it last said.
    NotYet(Option<Lsn>),
}

impl Waited {
    /// The outcome as one line for the operator; the commands it offers carry the `--config`
    /// (and name the variables) `requeue` ran with, so that a copied one asks the same relay.
    pub fn line(&self, settings: &Settings) -> String {
        match self {
            Waited::NoListener => format!(
                "not waited: http.listen is empty, so no relay can be asked; {} shows when the key is released",
                settings.command("parked")
            ),
            Waited::NotAsked(why) => format!(
                "not waited: {why}; the request waits in the slot until a relay reads it ({} shows when)",
                settings.command("parked")
            ),
            Waited::Stored(lsn) => format!(
                "carried out: the relay has stored through {lsn}, past the request's transaction"
            ),
            Waited::NotYet(stored) => {
                let stored = stored.map_or("an unknown LSN".to_owned(), |l| l.to_string());
                format!(
                    "not carried out yet: the relay had stored through {stored}; the request is committed and waits in the \
                     slot ({} shows why the relay is behind)",
                    settings.command("status")
                )
            }
        }
    }
}

/// Waits at most `bound` for the relay serving `settings`' slot to store through `lsn`.
pub(super) async fn stored(settings: &Settings, lsn: Lsn, bound: Duration) -> Waited {
    let config = settings.config();
    let Some(word) = relay_word::ask(&config.http.listen).await else {
        return Waited::NoListener;
    };
    if !word.reached {
        let why = word.error.unwrap_or_default();
        return Waited::NotAsked(format!(
            "no relay answered on http.listen {}: {why}",
            word.address
        ));
    }
    let Some(position) = word.position else {
        let why = word.error.unwrap_or_else(|| "no position".into());
        return Waited::NotAsked(format!(
            "the relay on {} does not stream the slot now ({})",
            word.address,
            shown(&why, SHOWN_BYTES)
        ));
    };
    if position.slot != config.postgres.slot || position.stream != config.nats.stream {
        return Waited::NotAsked(format!(
            "the relay on {} serves slot {} and stream {}, not {} and {}",
            word.address, position.slot, position.stream, config.postgres.slot, config.nats.stream
        ));
    }
    let Ok(addr) = word.address.parse::<SocketAddr>() else {
        return Waited::NotAsked(format!("{} is not an address", word.address));
    };
    let deadline = Instant::now() + bound;
    let mut last = Some(position.stored_lsn);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Waited::NotYet(last);
        }
        let ask = left.min(MAX_WAIT_PER_REQUEST);
        let path = format!("/wait?lsn={lsn}&timeout_ms={}", ask.as_millis());
        // The listener answers when the wait ends: give it a moment past that.
        match get_within(addr, &path, ask + Duration::from_secs(2)).await {
            Ok((status, body)) => {
                let said = stored_lsn(&body);
                last = said.or(last);
                match status {
                    200 => return Waited::Stored(said.unwrap_or(lsn)),
                    504 => continue,
                    _ => {
                        return Waited::NotAsked(format!(
                            "the relay on {addr} answered /wait with {status}: {}",
                            shown(body.trim(), SHOWN_BYTES)
                        ));
                    }
                }
            }
            Err(e) => return Waited::NotAsked(shown(&e.to_string(), SHOWN_BYTES)),
        }
    }
}

/// `stored_lsn` of a `/wait` answer, when it is one.
fn stored_lsn(body: &str) -> Option<Lsn> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v.get("stored_lsn")?.as_str()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::{Waited, stored_lsn};
    use crate::lsn::Lsn;

    #[test]
    fn only_a_wait_answers_lsn_is_taken() {
        assert_eq!(
            stored_lsn(r#"{"stored": true, "stored_lsn": "0/10", "last_sequence": 3}"#),
            Some(Lsn(0x10))
        );
        assert_eq!(stored_lsn(r#"{"stored_lsn": "x"}"#), None);
        assert_eq!(stored_lsn("not json"), None);
    }

    #[test]
    fn every_outcome_is_one_line() {
        let mut settings = crate::config::Config::default().validate().unwrap();
        settings.origin.file = Some("/etc/relay-b.toml".into());
        for w in [
            Waited::NoListener,
            Waited::NotAsked("why".into()),
            Waited::Stored(Lsn(1)),
            Waited::NotYet(None),
            Waited::NotYet(Some(Lsn(2))),
        ] {
            let line = w.line(&settings);
            assert!(!line.contains('\n'), "{line}");
            // Every command offered carries the --config requeue ran with.
            assert_eq!(
                line.matches("`outbox-relay ").count(),
                line.matches("`outbox-relay --config /etc/relay-b.toml ")
                    .count(),
                "{line}"
            );
        }
        assert!(
            Waited::NoListener
                .line(&settings)
                .contains("`outbox-relay --config /etc/relay-b.toml parked` shows")
        );
    }
}
