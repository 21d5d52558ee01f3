//! The pgoutput options of `START_REPLICATION`, gated by server version.
//!
//! The walsender builds its decoding context (option parsing, publication lookup) before it answers
//! with CopyBoth, so a wrong option comes back as an ErrorResponse. Checking here first gives a clearer
//! message and never sends an option the server does not know ("unrecognized pgoutput option").
//! Version table: docs/pgoutput.md#options-and-protocol-versions (from Postgres' worker.c and
//! pgoutput.c).

use super::error::SourceError;
use super::wire::{quote_ident, quote_literal};

/// What the relay asks pgoutput for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgOutputOptions {
    /// `None`: the highest version the server speaks (4 on 16+, 3 on 15, 2 on 14, else 1).
    pub proto_version: Option<u32>,
    /// The publications to stream (`publication_names`).
    pub publication_names: Vec<String>,
    /// Logical decoding messages (`pg_logical_emit_message`), PG14+.
    pub messages: bool,
    /// Binary column values (typsend), PG14+. The relay wants text: the jsonb text is the payload.
    pub(crate) binary: bool,
    /// `origin 'none'|'any'`, PG16+.
    pub origin: Option<String>,
}

impl PgOutputOptions {
    /// Defaults for the relay: text values, no streaming of in-progress transactions (the relay can
    /// publish a committed transaction's events as they arrive; see
    /// docs/pgoutput.md#large-transactions).
    pub fn new(publications: impl IntoIterator<Item = String>) -> Self {
        PgOutputOptions {
            proto_version: None,
            publication_names: publications.into_iter().collect(),
            messages: false,
            binary: false,
            origin: None,
        }
    }

    /// The parenthesised option list for a server of `version` (server_version_num).
    pub(crate) fn to_sql(&self, version: u32) -> Result<String, SourceError> {
        let max_proto = match version {
            160000.. => 4,
            150000.. => 3,
            140000.. => 2,
            _ => 1,
        };
        let proto = self.proto_version.unwrap_or(max_proto);
        if proto == 0 || proto > 4 {
            return Err(SourceError::Protocol(format!(
                "pgoutput proto_version {proto} does not exist: use 1 to 4"
            )));
        }
        if proto > max_proto {
            return Err(SourceError::Version {
                version,
                what: format!("pgoutput proto_version {proto} (it supports 1 to {max_proto})"),
                needs: match proto {
                    2 => "14",
                    3 => "15",
                    _ => "16",
                },
            });
        }
        if self.publication_names.is_empty() {
            return Err(SourceError::Protocol(
                "no publication given: set postgres.publication".into(),
            ));
        }
        let names = self
            .publication_names
            .iter()
            .map(|p| quote_ident(p))
            .collect::<Vec<_>>()
            .join(",");
        let mut out = format!(
            "proto_version '{proto}', publication_names {}",
            quote_literal(&names)
        );
        if self.messages {
            need(version, 140000, "14", "the messages option")?;
            out.push_str(", messages 'true'");
        }
        if self.binary {
            need(version, 140000, "14", "the binary option")?;
            out.push_str(", binary 'true'");
        }
        if let Some(origin) = &self.origin {
            need(version, 160000, "16", "the origin option")?;
            out.push_str(&format!(", origin {}", quote_literal(origin)));
        }
        Ok(out)
    }
}

fn need(version: u32, min: u32, needs: &'static str, what: &str) -> Result<(), SourceError> {
    if version < min {
        return Err(SourceError::Version {
            version,
            what: what.to_owned(),
            needs,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> PgOutputOptions {
        PgOutputOptions::new(["outbox_relay".to_owned()])
    }

    #[test]
    fn picks_highest_proto_for_server() {
        assert!(
            opts()
                .to_sql(150018)
                .unwrap()
                .starts_with("proto_version '3'")
        );
        assert!(
            opts()
                .to_sql(170002)
                .unwrap()
                .starts_with("proto_version '4'")
        );
        assert!(
            opts()
                .to_sql(140000)
                .unwrap()
                .starts_with("proto_version '2'")
        );
    }

    #[test]
    fn quotes_publication_names() {
        let o = PgOutputOptions::new(["a".to_owned(), "we'ird\"".to_owned()]);
        let sql = o.to_sql(150000).unwrap();
        assert!(
            sql.ends_with(r#"publication_names '"a","we''ird"""'"#),
            "{sql}"
        );
    }

    #[test]
    fn rejects_options_the_server_lacks() {
        let mut o = opts();
        o.proto_version = Some(5);
        let e = o.to_sql(170000).unwrap_err().to_string();
        assert!(e.contains("proto_version 5") && e.contains("1 to 4"), "{e}");
        o.proto_version = Some(4);
        let e = o.to_sql(150000).unwrap_err().to_string();
        assert!(e.contains("Postgres 16"), "{e}");
        let mut o = opts();
        o.origin = Some("none".into());
        let e = o.to_sql(150000).unwrap_err().to_string();
        assert!(e.contains("origin") && e.contains("16"), "{e}");
        let mut o = opts();
        o.messages = true;
        assert!(o.to_sql(130000).is_err());
        assert!(o.to_sql(140000).unwrap().contains("messages 'true'"));
    }
}
