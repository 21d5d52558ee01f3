//! The replication connection up to the point where streaming starts: TCP, TLS (SSLRequest), the
//! startup message with `replication=database`, authentication (SCRAM-SHA-256 with or without channel
//! binding, md5, cleartext), and the simple-query commands of the walsender (`IDENTIFY_SYSTEM`,
//! `TIMELINE_HISTORY`, `CREATE_REPLICATION_SLOT`, `START_REPLICATION`).
//!
//! Built on postgres-protocol's message codecs because tokio-postgres has no replication support.
//! postgres-protocol does not know CopyBothResponse (`'W'`): the framing in `wire` peels it off the
//! buffer before the generic parser would drop it as an unknown tag.

use std::collections::HashMap;

use bytes::BytesMut;
use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::sasl::{self, ScramSha256};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use secrecy::ExposeSecret;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::debug;

use super::auth_error::{AuthError, AuthRefusal};
use super::auth_policy::{AuthPolicy, Scram};
use super::conninfo::{AuthMethod, ConnInfo, SslMode};
use super::error::SourceError;
use super::hosts::{self, ServerRole};
use super::options::PgOutputOptions;
use super::socket::PgStream;
use super::stream::{ReplicationStream, StreamConfig};
use super::tls;
use super::wire::{
    Backend, MAX_FRAME_BYTES, Transport, log_notice, proto, quote_ident, read_backend,
    server_error, unexpected,
};
use crate::Lsn;
use crate::timeline::TimelineHistory;

/// The largest message accepted before authentication is over: SASL exchanges, error and notice
/// responses are a few hundred bytes.
const MAX_AUTH_FRAME_BYTES: usize = 64 * 1024;

/// What the walsender answered to `IDENTIFY_SYSTEM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemInfo {
    /// The cluster's unique system identifier.
    pub system_id: String,
    /// The current timeline id.
    pub timeline: u32,
    /// The current WAL flush position. Never a start position: it would skip unsent data.
    pub xlogpos: Lsn,
    /// The database connected to; `None` on a physical replication connection.
    pub dbname: Option<String>,
    /// The current timeline's ancestors and where each ended ([`ReplConnection::timeline_history`]);
    /// none as `IDENTIFY_SYSTEM` answers, which does not say.
    pub history: TimelineHistory,
}

/// An authenticated replication connection, idle (ReadyForQuery seen).
pub struct ReplConnection {
    io: Box<dyn Transport>,
    rbuf: BytesMut,
    wbuf: BytesMut,
    params: HashMap<String, String>,
    target: String,
    backend_pid: i32,
}

/// A row of a simple-query result: text values, `None` for NULL.
pub(crate) type Row = Vec<Option<String>>;

impl ReplConnection {
    /// Connects to the first of the URL's hosts that accepts and matches `target_session_attrs`:
    /// negotiates TLS per `sslmode`, authenticates (within `require_auth` and `channel_binding`), and
    /// waits for ReadyForQuery.
    pub async fn connect(info: &ConnInfo, application_name: &str) -> Result<Self, SourceError> {
        hosts::connect_first(info, |target| async move {
            let conn = Self::connect_one(&target, application_name).await?;
            let role = conn.role();
            Ok((conn, role))
        })
        .await
    }

    /// What the server reported about itself at startup (`in_hot_standby` and
    /// `default_transaction_read_only`, both reported by PG 14+).
    pub(crate) fn role(&self) -> ServerRole {
        let on = |k: &str| self.params.get(k).is_some_and(|v| v == "on");
        ServerRole {
            in_recovery: on("in_hot_standby"),
            read_only: on("in_hot_standby") || on("default_transaction_read_only"),
        }
    }

    async fn connect_one(info: &ConnInfo, application_name: &str) -> Result<Self, SourceError> {
        let target = format!("{}:{}", info.host, info.port);
        let secs = info.connect_timeout.as_secs();
        tokio::time::timeout(
            info.connect_timeout,
            Self::connect_inner(info, application_name),
        )
        .await
        .map_err(|_| SourceError::Timeout { target, secs })?
    }

    async fn connect_inner(info: &ConnInfo, application_name: &str) -> Result<Self, SourceError> {
        let target = format!("{}:{}", info.host, info.port);
        let io_err = |error| SourceError::Io {
            target: target.clone(),
            error,
        };
        let mut tcp = PgStream::connect(&info.host, info.port)
            .await
            .map_err(io_err)?;
        let tls_config = match tcp.supports_tls() {
            true => tls::client_config_off_runtime(info)
                .await
                .map_err(|e| SourceError::Tls(e.to_string()))?,
            false => None,
        };
        let (io, end_point_hash): (Box<dyn Transport>, _) = match tls_config {
            None => (Box::new(tcp), None),
            Some(config) => {
                let mut buf = BytesMut::new();
                frontend::ssl_request(&mut buf);
                tcp.write_all(&buf).await.map_err(io_err)?;
                // Exactly one byte: anything the server (or a man in the middle) sends after it
                // would otherwise be taken as part of the encrypted stream.
                let answer = tcp.read_u8().await.map_err(io_err)?;
                match answer {
                    b'S' => {
                        let name = tls::server_name(&info.host)
                            .map_err(|e| SourceError::Tls(e.to_string()))?;
                        let stream = tokio_rustls::TlsConnector::from(config)
                            .connect(name, tcp)
                            .await
                            .map_err(|e| {
                                SourceError::Tls(format!("handshake with {target}: {e}"))
                            })?;
                        let binding = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .and_then(|c| tls::server_end_point_hash(c));
                        (Box::new(stream), binding)
                    }
                    b'N' if info.sslmode == SslMode::Prefer => (Box::new(tcp), None),
                    b'N' => {
                        return Err(SourceError::Tls(format!(
                            "server {target} does not accept TLS but sslmode={:?} requires it: \
                             enable ssl on the server or use sslmode=prefer",
                            info.sslmode
                        )));
                    }
                    other => {
                        return Err(SourceError::Protocol(format!(
                            "unexpected answer {other:#x} to SSLRequest from {target}"
                        )));
                    }
                }
            }
        };

        let mut conn = ReplConnection {
            io,
            rbuf: BytesMut::with_capacity(64 * 1024),
            wbuf: BytesMut::with_capacity(1024),
            params: HashMap::new(),
            target,
            backend_pid: 0,
        };
        conn.startup(info, application_name, end_point_hash).await?;
        Ok(conn)
    }

    /// The startup message, authentication, then the server's parameters until ReadyForQuery.
    async fn startup(
        &mut self,
        info: &ConnInfo,
        application_name: &str,
        end_point_hash: Option<Vec<u8>>,
    ) -> Result<(), SourceError> {
        self.send_startup(info, application_name).await?;
        self.authenticate(info, end_point_hash).await?;
        self.await_ready().await
    }

    async fn send_startup(
        &mut self,
        info: &ConnInfo,
        application_name: &str,
    ) -> Result<(), SourceError> {
        let params = [
            ("user", info.user.as_str()),
            ("database", info.dbname.as_str()),
            // A logical walsender: replication commands plus SQL, simple-query protocol only.
            ("replication", "database"),
            ("application_name", application_name),
            // pgoutput converts names and text values to the client encoding.
            ("client_encoding", "UTF8"),
        ];
        frontend::startup_message(params.iter().copied(), &mut self.wbuf).map_err(proto)?;
        self.flush().await
    }

    /// Answers the server's authentication requests as the [`AuthPolicy`] allows, until an
    /// AuthenticationOk the policy believes.
    async fn authenticate(
        &mut self,
        info: &ConnInfo,
        end_point_hash: Option<Vec<u8>>,
    ) -> Result<(), SourceError> {
        let password = || password(info);
        let policy = AuthPolicy::new(info);
        let auth = |r: Result<(), AuthRefusal>| r.map_err(|r| SourceError::Auth(r.into()));
        let mut scram: Option<ScramSha256> = None;
        let mut progress = Scram::NotStarted;
        loop {
            match self.read_startup().await? {
                Backend::Message(Message::AuthenticationOk) => {
                    auth(policy.ok(progress))?;
                    break;
                }
                Backend::Message(Message::AuthenticationCleartextPassword) => {
                    auth(policy.allow(AuthMethod::Password))?;
                    frontend::password_message(password()?.as_bytes(), &mut self.wbuf)
                        .map_err(proto)?;
                    self.flush().await?;
                }
                Backend::Message(Message::AuthenticationMd5Password(body)) => {
                    auth(policy.allow(AuthMethod::Md5))?;
                    let hash = postgres_protocol::authentication::md5_hash(
                        info.user.as_bytes(),
                        password()?.as_bytes(),
                        body.salt(),
                    );
                    frontend::password_message(hash.as_bytes(), &mut self.wbuf).map_err(proto)?;
                    self.flush().await?;
                }
                Backend::Message(Message::AuthenticationSasl(body)) => {
                    let (mut plain, mut plus) = (false, false);
                    let mut mechs = body.mechanisms();
                    while let Some(m) = mechs.next().map_err(proto)? {
                        plain |= m == sasl::SCRAM_SHA_256;
                        plus |= m == sasl::SCRAM_SHA_256_PLUS;
                    }
                    let (mech, binding, started) = policy
                        .choose_sasl(plain, plus, end_point_hash.as_ref())
                        .map_err(|r| SourceError::Auth(r.into()))?;
                    let s = ScramSha256::new(password()?.as_bytes(), binding);
                    frontend::sasl_initial_response(mech, s.message(), &mut self.wbuf)
                        .map_err(proto)?;
                    self.flush().await?;
                    scram = Some(s);
                    progress = started;
                }
                Backend::Message(Message::AuthenticationSaslContinue(body)) => {
                    let s = scram.as_mut().ok_or_else(|| unexpected("SASL continue"))?;
                    self.sasl_continue(s, body.data()).await?;
                }
                Backend::Message(Message::AuthenticationSaslFinal(body)) => {
                    let s = scram.as_mut().ok_or_else(|| unexpected("SASL final"))?;
                    s.finish(body.data())
                        .map_err(|e| SourceError::Auth(AuthError::BadSignature(e)))?;
                    if let Scram::Started { bound } = progress {
                        progress = Scram::Verified { bound };
                    }
                }
                Backend::Message(Message::NoticeResponse(body)) => log_notice(body.fields()),
                Backend::Message(other) => return Err(refusal(other)?),
                Backend::CopyBothResponse => {
                    return Err(unexpected("message during authentication"));
                }
            }
        }
        Ok(())
    }

    /// The client's answer to the server's SCRAM challenge.
    async fn sasl_continue(&mut self, s: &mut ScramSha256, data: &[u8]) -> Result<(), SourceError> {
        s.update(data)
            .map_err(|e| SourceError::Auth(AuthError::Scram(e)))?;
        frontend::sasl_response(s.message(), &mut self.wbuf).map_err(proto)?;
        self.flush().await
    }

    /// The server's parameters and backend key, until ReadyForQuery.
    async fn await_ready(&mut self) -> Result<(), SourceError> {
        loop {
            match self.read().await? {
                Backend::Message(Message::ParameterStatus(body)) => {
                    let name = body.name().map_err(proto)?.to_owned();
                    let value = body.value().map_err(proto)?.to_owned();
                    self.params.insert(name, value);
                }
                Backend::Message(Message::BackendKeyData(body)) => {
                    self.backend_pid = body.process_id()
                }
                Backend::Message(Message::NoticeResponse(body)) => log_notice(body.fields()),
                Backend::Message(Message::ReadyForQuery(_)) => return Ok(()),
                Backend::Message(Message::ErrorResponse(body)) => {
                    return Err(SourceError::Server {
                        context: "connect",
                        error: Box::new(server_error(body.fields())?),
                    });
                }
                _ => return Err(unexpected("message during startup")),
            }
        }
    }

    /// `server_version_num` derived from the `server_version` parameter ("15.18 (Debian …)" → 150018).
    pub(crate) fn server_version_num(&self) -> u32 {
        self.params
            .get("server_version")
            .map(|v| parse_server_version(v))
            .unwrap_or(0)
    }

    /// The walsender's process id (its `pg_stat_replication.pid`).
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// Runs one simple query; returns the rows of its (last) result set.
    pub(crate) async fn simple_query(&mut self, sql: &str) -> Result<Vec<Row>, SourceError> {
        frontend::query(sql, &mut self.wbuf).map_err(proto)?;
        self.flush().await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            match self.read().await? {
                Backend::Message(Message::RowDescription(_)) => rows.clear(),
                Backend::Message(Message::DataRow(body)) => {
                    let buf = body.buffer();
                    let mut row = Vec::new();
                    let mut ranges = body.ranges();
                    while let Some(r) = ranges.next().map_err(proto)? {
                        row.push(match r {
                            Some(r) => Some(
                                std::str::from_utf8(buf.get(r).unwrap_or_default())
                                    .map_err(|_| unexpected("non-UTF-8 column"))?
                                    .to_owned(),
                            ),
                            None => None,
                        });
                    }
                    rows.push(row);
                }
                Backend::Message(Message::CommandComplete(_) | Message::EmptyQueryResponse) => {}
                Backend::Message(Message::NoticeResponse(body)) => log_notice(body.fields()),
                Backend::Message(Message::ErrorResponse(body)) => {
                    error = Some(server_error(body.fields())?)
                }
                Backend::Message(Message::ReadyForQuery(_)) => {
                    return match error {
                        Some(error) => Err(SourceError::Server {
                            context: "query",
                            error: Box::new(error),
                        }),
                        None => Ok(rows),
                    };
                }
                Backend::Message(Message::ParameterStatus(_)) => {}
                _ => return Err(unexpected("message in query response")),
            }
        }
    }

    /// `IDENTIFY_SYSTEM`.
    pub async fn identify_system(&mut self) -> Result<SystemInfo, SourceError> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = rows
            .first()
            .filter(|r| r.len() >= 4)
            .ok_or_else(|| unexpected("IDENTIFY_SYSTEM result"))?;
        let text = |i: usize| row[i].clone().unwrap_or_default();
        let timeline = text(1).parse().map_err(|_| unexpected("timeline"))?;
        Ok(SystemInfo {
            system_id: text(0),
            timeline,
            xlogpos: text(2).parse().map_err(|_| unexpected("xlogpos"))?,
            dbname: row[3].clone(),
            history: TimelineHistory::root(timeline),
        })
    }

    /// `TIMELINE_HISTORY timeline`: the server's history file of `timeline`, parsed. Timeline 1
    /// has no history file (the server refuses the command for it): it has no ancestors.
    pub async fn timeline_history(
        &mut self,
        timeline: u32,
    ) -> Result<TimelineHistory, SourceError> {
        if timeline <= 1 {
            return Ok(TimelineHistory::root(timeline));
        }
        let rows = self
            .simple_query(&format!("TIMELINE_HISTORY {timeline}"))
            .await?;
        // Columns: filename, content (the file as it is on the server's disk).
        let content = rows
            .first()
            .and_then(|r| r.get(1).cloned().flatten())
            .ok_or_else(|| unexpected("TIMELINE_HISTORY result"))?;
        TimelineHistory::parse(timeline, &content).map_err(|e| SourceError::Protocol(e.to_string()))
    }

    /// Creates a logical slot with pgoutput and no snapshot (the relay streams from the slot's
    /// consistent point on; it never copies existing rows). Returns the consistent point.
    pub async fn create_slot(&mut self, slot: &str, temporary: bool) -> Result<Lsn, SourceError> {
        let slot = quote_ident(slot);
        let temp = if temporary { " TEMPORARY" } else { "" };
        // PG15 changed the syntax; the old keywords are gone in newer servers.
        let sql = if self.server_version_num() >= 150000 {
            format!("CREATE_REPLICATION_SLOT {slot}{temp} LOGICAL pgoutput (SNAPSHOT 'nothing')")
        } else {
            format!("CREATE_REPLICATION_SLOT {slot}{temp} LOGICAL pgoutput NOEXPORT_SNAPSHOT")
        };
        let rows = self.simple_query(&sql).await?;
        rows.first()
            .and_then(|r| r.get(1).cloned().flatten())
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected("CREATE_REPLICATION_SLOT result"))
    }

    /// Creates a logical pgoutput slot and exports the snapshot it starts at (PG 15+ syntax), for a
    /// backfill: rows read in that snapshot are exactly those committed before the slot's first
    /// change. The snapshot stays importable (`SET TRANSACTION SNAPSHOT`) until this connection
    /// runs another command or closes. `failover` (PG 17+) makes it a failover slot.
    pub(crate) async fn create_slot_with_snapshot(
        &mut self,
        slot: &str,
        failover: bool,
    ) -> Result<(Lsn, String), SourceError> {
        let version = self.server_version_num();
        if version < 150000 {
            return Err(SourceError::Version {
                version,
                what: "CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')".into(),
                needs: "15",
            });
        }
        let failover = if failover && version >= 170000 {
            ", FAILOVER true"
        } else {
            ""
        };
        let sql = format!(
            "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput (SNAPSHOT 'export'{failover})",
            quote_ident(slot)
        );
        let rows = self.simple_query(&sql).await?;
        let row = rows
            .first()
            .ok_or_else(|| unexpected("CREATE_REPLICATION_SLOT result"))?;
        let lsn = row
            .get(1)
            .cloned()
            .flatten()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected("CREATE_REPLICATION_SLOT consistent point"))?;
        let snapshot = row
            .get(2)
            .cloned()
            .flatten()
            .ok_or_else(|| unexpected("CREATE_REPLICATION_SLOT snapshot name"))?;
        Ok((lsn, snapshot))
    }

    /// PG 17+: makes an existing slot a failover slot (`ALTER_REPLICATION_SLOT … (FAILOVER true)`,
    /// a replication command with no SQL equivalent). The slot must not be in use.
    pub(crate) async fn alter_slot_failover(&mut self, slot: &str) -> Result<(), SourceError> {
        let sql = format!(
            "ALTER_REPLICATION_SLOT {} (FAILOVER true)",
            quote_ident(slot)
        );
        self.simple_query(&sql).await.map(|_| ())
    }

    /// Sends `START_REPLICATION` and waits for CopyBothResponse. Errors the server finds in the slot,
    /// the publication or the options arrive before CopyBoth and come back here, with the connection
    /// still usable; once streaming, the connection belongs to the returned stream.
    pub async fn start_replication(
        mut self,
        slot: &str,
        start: Lsn,
        options: &PgOutputOptions,
        config: StreamConfig,
    ) -> Result<ReplicationStream, (SourceError, Option<ReplConnection>)> {
        let opts = match options.to_sql(self.server_version_num()) {
            Ok(o) => o,
            Err(e) => return Err((e, Some(self))),
        };
        let sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {start} ({opts})",
            quote_ident(slot)
        );
        debug!(%sql, "starting replication");
        if let Err(e) = frontend::query(&sql, &mut self.wbuf).map_err(proto) {
            return Err((e, Some(self)));
        }
        if let Err(e) = self.flush().await {
            return Err((e, None));
        }
        let mut error = None;
        loop {
            match self.read().await {
                Err(e) => return Err((e, None)),
                Ok(Backend::CopyBothResponse) => break,
                Ok(Backend::Message(Message::NoticeResponse(body))) => log_notice(body.fields()),
                Ok(Backend::Message(Message::ErrorResponse(body))) => {
                    match server_error(body.fields()) {
                        Ok(e) => error = Some(e),
                        Err(e) => return Err((e, None)),
                    }
                }
                Ok(Backend::Message(Message::ReadyForQuery(_))) => {
                    let e = error.map_or_else(
                        || unexpected("START_REPLICATION ended without streaming"),
                        |error| SourceError::Server {
                            context: "START_REPLICATION",
                            error: Box::new(error),
                        },
                    );
                    return Err((e, Some(self)));
                }
                Ok(_) => return Err((unexpected("answer to START_REPLICATION"), None)),
            }
        }
        let ReplConnection {
            io,
            rbuf,
            target,
            backend_pid,
            ..
        } = self;
        Ok(ReplicationStream::spawn(
            io,
            rbuf,
            target,
            backend_pid,
            start,
            config,
        ))
    }

    /// Closes the connection politely (Terminate).
    pub async fn close(mut self) {
        frontend::terminate(&mut self.wbuf);
        let _ = self.flush().await;
        let _ = self.io.shutdown().await;
    }

    async fn flush(&mut self) -> Result<(), SourceError> {
        let buf = self.wbuf.split();
        self.io
            .write_all(&buf)
            .await
            .map_err(|error| SourceError::Io {
                target: self.target.clone(),
                error,
            })?;
        self.io.flush().await.map_err(|error| SourceError::Io {
            target: self.target.clone(),
            error,
        })
    }

    /// A message of the authentication exchange: every one is tiny, so a length prefix beyond
    /// [`MAX_AUTH_FRAME_BYTES`] is refused before any buffer grows for it (an unauthenticated peer
    /// must not make the relay allocate a gigabyte).
    async fn read_startup(&mut self) -> Result<Backend, SourceError> {
        read_backend(
            &mut self.io,
            &mut self.rbuf,
            &self.target,
            MAX_AUTH_FRAME_BYTES,
        )
        .await
    }

    async fn read(&mut self) -> Result<Backend, SourceError> {
        // Before streaming the server sends only small answers; the streaming phase has its own cap
        // (StreamConfig::max_frame_bytes).
        read_backend(&mut self.io, &mut self.rbuf, &self.target, MAX_FRAME_BYTES).await
    }
}

/// The password the server asks for, or why there is none.
fn password(info: &ConnInfo) -> Result<&str, SourceError> {
    info.password
        .as_ref()
        .map(|p| p.expose_secret())
        .ok_or_else(|| {
            SourceError::Auth(AuthError::NoPassword {
                user: info.user.clone(),
            })
        })
}

/// Why authentication ends at `msg`: the server's error, a method the relay does not speak, or a
/// message that has no place there.
fn refusal(msg: Message) -> Result<SourceError, SourceError> {
    Ok(match msg {
        Message::ErrorResponse(body) => SourceError::Server {
            context: "connect",
            error: Box::new(server_error(body.fields())?),
        },
        Message::AuthenticationGss
        | Message::AuthenticationKerberosV5
        | Message::AuthenticationSspi
        | Message::AuthenticationScmCredential
        | Message::AuthenticationGssContinue(_) => SourceError::Auth(AuthError::Unsupported),
        _ => unexpected("message during authentication"),
    })
}

/// "15.18 (Debian 15.18-0+deb12u1)" → 150018; "17devel" → 170000; "9.6.3" → 90603.
pub(crate) fn parse_server_version(v: &str) -> u32 {
    let v = v.split_whitespace().next().unwrap_or("");
    let mut nums = v
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().unwrap_or(0));
    let major = nums.next().unwrap_or(0);
    let minor = nums.next().unwrap_or(0);
    if major >= 10 {
        major * 10000 + minor
    } else {
        major * 10000 + minor * 100 + nums.next().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_versions() {
        assert_eq!(
            parse_server_version("15.18 (Debian 15.18-0+deb12u1)"),
            150018
        );
        assert_eq!(parse_server_version("17.2"), 170002);
        assert_eq!(parse_server_version("18devel"), 180000);
        assert_eq!(parse_server_version("9.6.3"), 90603);
    }
}
