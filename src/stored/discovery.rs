//! The position service's answers to the NATS services API's discovery requests (`$SRV.PING`,
//! `$SRV.INFO`, `$SRV.STATS`, each also `.<name>` and `.<name>.<id>`), and the per-endpoint counts
//! that `STATS` reports.
//!
//! async-nats' service API answers discovery in a task of its own, on whatever reply subject a
//! request names, and offers no way to refuse one; the relay must refuse some (`replies.rs`). So the
//! relay answers discovery itself, under the same rules as its endpoints, with async-nats' own
//! types for the JSON: `nats micro ls/info/stats` read it as they read any service.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::service::endpoint;
use async_nats::service::{Info, PingResponse, Stats, error::Error as ServiceError};

/// The services API's subject prefix.
pub(crate) const API_PREFIX: &str = "$SRV";
/// The queue group of the endpoints: relays of the same slot share requests (only one serves).
pub(crate) const QUEUE_GROUP: &str = "q";

/// A discovery request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verb {
    Ping,
    Info,
    Stats,
}

impl Verb {
    pub(crate) const ALL: [Verb; 3] = [Verb::Ping, Verb::Info, Verb::Stats];

    fn name(self) -> &'static str {
        match self {
            Verb::Ping => "PING",
            Verb::Info => "INFO",
            Verb::Stats => "STATS",
        }
    }

    /// The three subjects of this verb for service `name` with instance `id`.
    pub(crate) fn subjects(self, name: &str, id: &str) -> [String; 3] {
        let verb = self.name();
        [
            format!("{API_PREFIX}.{verb}"),
            format!("{API_PREFIX}.{verb}.{name}"),
            format!("{API_PREFIX}.{verb}.{name}.{id}"),
        ]
    }
}

/// What an endpoint has done, for `STATS`.
#[derive(Clone, Debug, Default)]
pub(crate) struct Counts {
    requests: usize,
    errors: usize,
    last_error: Option<ServiceError>,
    processing: Duration,
}

impl Counts {
    /// One request answered after `took`, with `error` if it was one.
    pub(crate) fn answered(&mut self, took: Duration, error: Option<&ServiceError>) {
        self.requests += 1;
        self.processing += took;
        if let Some(e) = error {
            self.errors += 1;
            self.last_error = Some(e.clone());
        }
    }
}

/// One instance of the service, as discovery describes it.
pub(crate) struct Described {
    pub(crate) name: String,
    pub(crate) id: String,
    pub(crate) version: String,
    pub(crate) description: String,
    pub(crate) metadata: HashMap<String, String>,
    /// (endpoint name, subject), in the order `INFO` and `STATS` list them.
    pub(crate) endpoints: Vec<(String, String)>,
    pub(crate) started: async_nats::datetime::DateTime,
}

impl Described {
    /// The JSON answer to `verb`; `counts` are the endpoints' counts, in `endpoints` order.
    pub(crate) fn answer(&self, verb: Verb, counts: &[Counts]) -> Vec<u8> {
        let json = match verb {
            Verb::Ping => serde_json::to_vec(&PingResponse {
                kind: "io.nats.micro.v1.ping_response".into(),
                name: self.name.clone(),
                id: self.id.clone(),
                version: self.version.clone(),
                metadata: self.metadata.clone(),
            }),
            Verb::Info => serde_json::to_vec(&Info {
                kind: "io.nats.micro.v1.info_response".into(),
                name: self.name.clone(),
                id: self.id.clone(),
                description: self.description.clone(),
                version: self.version.clone(),
                metadata: self.metadata.clone(),
                endpoints: self
                    .endpoints
                    .iter()
                    .map(|(name, subject)| endpoint::Info {
                        name: name.clone(),
                        subject: subject.clone(),
                        queue_group: QUEUE_GROUP.into(),
                        metadata: HashMap::new(),
                    })
                    .collect(),
            }),
            Verb::Stats => serde_json::to_vec(&Stats {
                kind: "io.nats.micro.v1.stats_response".into(),
                name: self.name.clone(),
                id: self.id.clone(),
                version: self.version.clone(),
                started: self.started,
                endpoints: self
                    .endpoints
                    .iter()
                    .zip(counts.iter().chain(std::iter::repeat(&Counts::default())))
                    .map(|((name, subject), c)| endpoint::Stats {
                        name: name.clone(),
                        subject: subject.clone(),
                        requests: c.requests,
                        errors: c.errors,
                        processing_time: c.processing,
                        average_processing_time: c
                            .processing
                            .checked_div(c.requests.max(1) as u32)
                            .unwrap_or_default(),
                        last_error: c.last_error.clone(),
                        data: None,
                        queue_group: QUEUE_GROUP.into(),
                    })
                    .collect(),
            }),
        };
        // Plain structs of strings and numbers: serializing cannot fail.
        json.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn described() -> Described {
        Described {
            name: "outbox-relay".into(),
            id: "ID1".into(),
            version: "0.1.0".into(),
            description: "d".into(),
            metadata: HashMap::from([("slot".into(), "s".into())]),
            endpoints: vec![
                ("position".into(), "outbox-relay.s.position".into()),
                ("wait".into(), "outbox-relay.s.wait".into()),
            ],
            started: async_nats::datetime::now(),
        }
    }

    #[test]
    fn answers_read_as_the_services_api_writes_them() {
        let d = described();
        let ping: Value = serde_json::from_slice(&d.answer(Verb::Ping, &[])).unwrap();
        assert_eq!(ping["type"], "io.nats.micro.v1.ping_response");
        assert_eq!(
            (ping["name"].as_str(), ping["id"].as_str()),
            (Some("outbox-relay"), Some("ID1"))
        );
        let info: Info = serde_json::from_slice(&d.answer(Verb::Info, &[])).unwrap();
        assert_eq!(info.endpoints.len(), 2);
        assert_eq!(info.endpoints[1].subject, "outbox-relay.s.wait");
        assert_eq!(info.endpoints[1].queue_group, "q");
        assert_eq!(info.metadata["slot"], "s");
        let mut wait = Counts::default();
        wait.answered(Duration::from_millis(4), None);
        wait.answered(
            Duration::from_millis(2),
            Some(&ServiceError {
                code: 400,
                status: "lsn: bad".into(),
            }),
        );
        let stats: Stats =
            serde_json::from_slice(&d.answer(Verb::Stats, &[Counts::default(), wait])).unwrap();
        let w = &stats.endpoints[1];
        assert_eq!((w.requests, w.errors), (2, 1));
        assert_eq!(w.average_processing_time, Duration::from_millis(3));
        assert_eq!(w.last_error.as_ref().map(|e| e.code), Some(400));
        assert_eq!(stats.endpoints[0].requests, 0);
    }

    #[test]
    fn each_verb_has_its_three_subjects() {
        assert_eq!(
            Verb::Ping.subjects("outbox-relay", "ID1"),
            [
                "$SRV.PING",
                "$SRV.PING.outbox-relay",
                "$SRV.PING.outbox-relay.ID1"
            ]
        );
        assert_eq!(Verb::Stats.subjects("n", "i")[2], "$SRV.STATS.n.i");
    }
}
