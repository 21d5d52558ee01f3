//! Connection settings as libpq takes them, for both connections the relay opens: a URL
//! (`postgres://u@h1:5432,h2:5432/db?target_session_attrs=read-write`) or the key=value form
//! (`host=h1,h2 port=5432 dbname=app`), with libpq's environment variables (`PGHOST`, `PGPASSWORD`,
//! `PGSSLMODE`, …) filling what the string leaves out, and the password file (`PGPASSFILE`,
//! `~/.pgpass`) consulted per host when no password is given.
//!
//! tokio-postgres' parser does the grammar (both forms, several hosts, percent-encoding, quoting).
//! The parameters it does not know, or knows with fewer values (`sslmode=verify-ca/verify-full`,
//! `sslrootcert`, `require_auth`, `target_session_attrs=primary/standby/prefer-standby`), are taken
//! out first and handled here. The password is a secret: never in `Debug` or `Display`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use secrecy::SecretString;

use super::auth_error::AuthRefusal;

/// libpq's `sslmode` meanings (<https://www.postgresql.org/docs/current/libpq-ssl.html>).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// TLS when the server offers it, plaintext otherwise; the certificate is not checked (libpq default).
    Prefer,
    /// TLS or fail; the certificate is not checked unless `sslrootcert` names a file (then like
    /// `verify-ca`). `sslrootcert=system` allows only `verify-full`.
    Require,
    /// TLS, the chain must lead to a trusted root; the host name is not checked.
    VerifyCa,
    /// TLS, trusted chain and the certificate must name the host.
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Result<Self, ConnInfoError> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            // libpq's `allow` tries plaintext first; we do not offer a mode weaker than `prefer`.
            other => return Err(ConnInfoError::BadParam("sslmode", other.to_owned())),
        })
    }
}

/// Where trusted root certificates come from for `verify-ca`/`verify-full`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RootCerts {
    /// A PEM file (`sslrootcert=/path/ca.pem`).
    File(PathBuf),
    /// The bundled Mozilla roots (`sslrootcert=system`, as libpq 16+ spells it).
    System,
}

/// libpq's `target_session_attrs`: which of the listed hosts is acceptable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TargetSessionAttrs {
    /// Any host that answers (the default).
    Any,
    /// Accepts writes (not a standby, `default_transaction_read_only` off).
    ReadWrite,
    /// Does not accept writes (a standby, or `default_transaction_read_only` on).
    ReadOnly,
    /// Not a standby.
    Primary,
    /// A standby.
    Standby,
    /// A standby if any answers, else any.
    PreferStandby,
}

impl TargetSessionAttrs {
    fn parse(s: &str) -> Result<Self, ConnInfoError> {
        Ok(match s {
            "any" => Self::Any,
            "read-write" => Self::ReadWrite,
            "read-only" => Self::ReadOnly,
            "primary" => Self::Primary,
            "standby" => Self::Standby,
            "prefer-standby" => Self::PreferStandby,
            other => {
                return Err(ConnInfoError::BadParam(
                    "target_session_attrs",
                    other.to_owned(),
                ));
            }
        })
    }

    /// The word libpq uses.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Any => "any",
            Self::ReadWrite => "read-write",
            Self::ReadOnly => "read-only",
            Self::Primary => "primary",
            Self::Standby => "standby",
            Self::PreferStandby => "prefer-standby",
        }
    }
}

/// libpq's `channel_binding`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChannelBindingMode {
    /// Never bind, even when the server offers it.
    Disable,
    /// Bind when the server offers SCRAM-SHA-256-PLUS over TLS (the default).
    Prefer,
    /// Refuse any authentication without channel binding (it proves no one relays the session).
    Require,
}

/// An authentication method `require_auth` can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AuthMethod {
    /// No authentication asked (trust).
    None,
    /// Cleartext password.
    Password,
    /// MD5-hashed password.
    Md5,
    /// SCRAM-SHA-256, with or without channel binding.
    ScramSha256,
}

impl AuthMethod {
    /// The word libpq uses.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            AuthMethod::None => "none",
            AuthMethod::Password => "password",
            AuthMethod::Md5 => "md5",
            AuthMethod::ScramSha256 => "scram-sha-256",
        }
    }
}

/// libpq's `require_auth`: the methods the server may ask for (`!` negates the whole list).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RequireAuth {
    /// `None` = any method (the default).
    allowed: Option<Vec<AuthMethod>>,
    negated: bool,
    /// As written, for messages.
    text: String,
}

impl RequireAuth {
    fn parse(s: &str) -> Result<Self, ConnInfoError> {
        let bad = || ConnInfoError::BadParam("require_auth", s.to_owned());
        let mut methods = Vec::new();
        let mut negated = None;
        for word in s.split(',').map(str::trim) {
            let (neg, name) = match word.strip_prefix('!') {
                Some(n) => (true, n),
                None => (false, word),
            };
            // libpq: negated and plain entries cannot be mixed.
            if *negated.get_or_insert(neg) != neg {
                return Err(bad());
            }
            methods.push(match name {
                "none" => AuthMethod::None,
                "password" => AuthMethod::Password,
                "md5" => AuthMethod::Md5,
                "scram-sha-256" => AuthMethod::ScramSha256,
                _ => return Err(bad()),
            });
        }
        Ok(RequireAuth {
            allowed: Some(methods),
            negated: negated.unwrap_or(false),
            text: s.to_owned(),
        })
    }

    /// Whether the server may authenticate this way; the error says what was refused.
    pub(crate) fn check(&self, method: AuthMethod) -> Result<(), AuthRefusal> {
        let Some(list) = &self.allowed else {
            return Ok(());
        };
        if list.contains(&method) != self.negated {
            Ok(())
        } else {
            Err(AuthRefusal::NotAllowed {
                method: method.as_str(),
                require_auth: self.text.clone(),
            })
        }
    }

    /// Whether any method was restricted.
    pub(crate) fn is_set(&self) -> bool {
        self.allowed.is_some()
    }
}

/// A parsed connection string: every host, and the settings they share.
#[derive(Clone)]
pub struct ConnInfo {
    /// The hosts to try, in order.
    pub(crate) hosts: Vec<(String, u16)>,
    /// The host this copy is for ([`ConnInfo::for_host`]); the first one otherwise.
    pub host: String,
    /// The port of `host`.
    pub(crate) port: u16,
    /// The user to log in as.
    pub(crate) user: String,
    /// From the string or `PGPASSWORD`; `~/.pgpass` is looked up per host when this is `None`.
    pub(crate) password: Option<SecretString>,
    /// The password file (`passfile`, `PGPASSFILE`, else `~/.pgpass`); `None` without `HOME`.
    pub(crate) passfile: Option<PathBuf>,
    /// The database to connect to (the user name when none is given).
    pub(crate) dbname: String,
    /// Whether to use TLS and how to check the server's certificate.
    pub(crate) sslmode: SslMode,
    /// The trusted roots (`sslrootcert`); `None` when not given.
    pub(crate) sslrootcert: Option<RootCerts>,
    /// How long to wait for each host to connect (`connect_timeout`).
    pub(crate) connect_timeout: Duration,
    /// Which of the hosts is acceptable.
    pub(crate) target_session_attrs: TargetSessionAttrs,
    /// `load_balance_hosts=random`: start at a random host (then the rest in order), so relays spread.
    pub(crate) load_balance: bool,
    /// Whether SCRAM must, may or must not be bound to the TLS session.
    pub(crate) channel_binding: ChannelBindingMode,
    /// The authentication methods the server may ask for.
    pub(crate) require_auth: RequireAuth,
}

/// A connection string that cannot be used; the message names the part and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ConnInfoError {
    /// The string is neither a valid URL nor a valid key=value list.
    #[error(
        "postgres url cannot be parsed ({0}): expected postgres://user:password@host:port/database \
         (percent-encode '@', ':', '/' and '%' in a password, e.g. p%40ss for p@ss) or host=… dbname=…"
    )]
    Syntax(String),
    /// The URL's scheme is not `postgres://` or `postgresql://`.
    #[error("postgres url scheme {0:?} is not supported: use postgres:// or postgresql://")]
    Scheme(String),
    /// Neither the string nor `PGHOST` names a host.
    #[error("postgres url has no host: expected postgres://user:password@host:port/database")]
    NoHost,
    /// `sslrootcert=system` with a mode weaker than `verify-full` (libpq 16+ refuses it too).
    #[error(
        "postgres url: sslrootcert=system needs sslmode=verify-full, not {0:?} (any public CA can \
         certify any name, so the name must be checked): drop sslmode or set it to verify-full"
    )]
    WeakSystemRoots(SslMode),
    /// A parameter has a value the relay does not accept; holds its name and value.
    #[error("postgres url parameter {0}={1:?} is not valid")]
    BadParam(&'static str, String),
    /// The number of ports is neither one nor the number of hosts.
    #[error("postgres url lists {hosts} hosts but {ports} ports: give one port, or one per host")]
    Ports {
        /// Hosts listed.
        hosts: usize,
        /// Ports listed.
        ports: usize,
    },
}

/// Parameters handled here rather than by tokio-postgres.
///
/// `channel_binding` and `load_balance_hosts` are here although tokio-postgres knows them: taken out
/// as keys, their values cannot be mistaken for text elsewhere in the string, and the environment
/// fills them the same way as the others.
const OURS: &[&str] = &[
    "sslmode",
    "sslrootcert",
    "require_auth",
    "target_session_attrs",
    "passfile",
    "channel_binding",
    "load_balance_hosts",
];

/// Takes [`OURS`] out of a URL or key=value string, refusing other schemes and plain words; the
/// rest is for tokio-postgres.
fn split_ours(s: &str) -> Result<(String, Vec<(String, String)>), ConnInfoError> {
    let s = s.trim();
    if let Some((scheme, _)) = s.split_once("://") {
        if scheme != "postgres" && scheme != "postgresql" {
            return Err(ConnInfoError::Scheme(scheme.to_owned()));
        }
        Ok(split_url(s))
    } else if s.contains('=') || s.is_empty() {
        split_key_values(s)
    } else {
        Err(ConnInfoError::Syntax(
            "neither a URL nor key=value pairs".into(),
        ))
    }
}

/// tokio-postgres parses what [`split_ours`] left.
fn parse_rest(rest: &str) -> Result<tokio_postgres::Config, ConnInfoError> {
    tokio_postgres::Config::from_str(rest).map_err(|e| {
        // "invalid connection string" alone; the source names the option or value.
        let why = std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string());
        ConnInfoError::Syntax(why)
    })
}

/// The values of [`OURS`] taken from the string, with the environment behind them.
struct Params<'a, E> {
    ours: &'a [(String, String)],
    env: &'a E,
}

impl<E: Fn(&str) -> Option<String>> Params<'_, E> {
    /// The string's last value for `key`, else `var` from the environment if not empty.
    fn get(&self, key: &str, var: &str) -> Option<String> {
        self.ours
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .or_else(|| (self.env)(var).filter(|v| !v.is_empty()))
    }
}

/// The hosts (or socket directories), from the string or `PGHOST`: at least one, and none with an
/// '@' (an unencoded '@' in the password leaves the rest of it in the host name).
fn hosts_from(
    pg: &tokio_postgres::Config,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<Vec<String>, ConnInfoError> {
    let mut hosts: Vec<String> = Vec::new();
    for h in pg.get_hosts() {
        match h {
            tokio_postgres::config::Host::Tcp(h) => hosts.push(h.clone()),
            tokio_postgres::config::Host::Unix(p) => hosts.push(p.display().to_string()),
        }
    }
    if hosts.is_empty() {
        hosts = env("PGHOST")
            .map(|h| h.split(',').map(|h| h.trim().to_owned()).collect())
            .unwrap_or_default();
    }
    hosts.retain(|h| !h.is_empty());
    if hosts.is_empty() {
        return Err(ConnInfoError::NoHost);
    }
    if let Some(h) = hosts.iter().find(|h| h.contains('@')) {
        return Err(ConnInfoError::Syntax(format!(
            "host {:?} contains '@'",
            h.rsplit('@').next().unwrap_or_default()
        )));
    }
    Ok(hosts)
}

/// One port per host, from the string or `PGPORT`: none means 5432, one applies to every host.
fn ports_for(
    pg: &tokio_postgres::Config,
    env: &impl Fn(&str) -> Option<String>,
    hosts: usize,
) -> Result<Vec<u16>, ConnInfoError> {
    let mut ports: Vec<u16> = pg.get_ports().to_vec();
    if ports.is_empty()
        && let Some(p) = env("PGPORT")
    {
        for p in p.split(',') {
            ports.push(
                p.trim()
                    .parse()
                    .map_err(|_| ConnInfoError::BadParam("port", p.to_owned()))?,
            );
        }
    }
    Ok(match ports.len() {
        0 => vec![5432; hosts],
        1 => vec![ports[0]; hosts],
        n if n == hosts => ports,
        n => return Err(ConnInfoError::Ports { hosts, ports: n }),
    })
}

/// User (default `postgres`), password and database (default the user), each from the string or
/// its environment variable.
fn credentials(
    pg: &tokio_postgres::Config,
    env: &impl Fn(&str) -> Option<String>,
) -> (String, Option<SecretString>, String) {
    let user = pg
        .get_user()
        .map(str::to_owned)
        .or_else(|| env("PGUSER"))
        .unwrap_or_else(|| "postgres".to_owned());
    let password = pg
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .or_else(|| env("PGPASSWORD"))
        .map(SecretString::from);
    let dbname = pg
        .get_dbname()
        .map(str::to_owned)
        .or_else(|| env("PGDATABASE"))
        .unwrap_or_else(|| user.clone());
    (user, password, dbname)
}

/// `connect_timeout` or `PGCONNECT_TIMEOUT` (default 10 s), at least a second.
fn connect_timeout(
    pg: &tokio_postgres::Config,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<Duration, ConnInfoError> {
    Ok(match pg.get_connect_timeout() {
        Some(t) => *t,
        None => match env("PGCONNECT_TIMEOUT") {
            Some(v) => Duration::from_secs(
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| ConnInfoError::BadParam("connect_timeout", v.clone()))?,
            ),
            None => Duration::from_secs(10),
        },
    }
    .max(Duration::from_secs(1)))
}

/// `sslmode` and `sslrootcert`: the system roots imply, and allow only, `verify-full`.
fn tls_settings(
    params: &Params<'_, impl Fn(&str) -> Option<String>>,
) -> Result<(SslMode, Option<RootCerts>), ConnInfoError> {
    let sslrootcert = params
        .get("sslrootcert", "PGSSLROOTCERT")
        .map(|v| match v.as_str() {
            "system" => RootCerts::System,
            _ => RootCerts::File(PathBuf::from(v)),
        });
    let sslmode = match params.get("sslmode", "PGSSLMODE") {
        Some(v) => SslMode::parse(&v)?,
        // libpq 16+: the public roots imply verify-full. Any CA in the bundle can certify any
        // name, so trusting the bundle without checking the name trusts everyone.
        None if sslrootcert == Some(RootCerts::System) => SslMode::VerifyFull,
        None => SslMode::Prefer,
    };
    if sslrootcert == Some(RootCerts::System) && sslmode != SslMode::VerifyFull {
        return Err(ConnInfoError::WeakSystemRoots(sslmode));
    }
    Ok((sslmode, sslrootcert))
}

/// Which host to accept and how to authenticate: the session parameters of [`OURS`].
struct SessionSettings {
    target_session_attrs: TargetSessionAttrs,
    require_auth: RequireAuth,
    channel_binding: ChannelBindingMode,
    load_balance: bool,
}

impl SessionSettings {
    fn from_params(
        params: &Params<'_, impl Fn(&str) -> Option<String>>,
    ) -> Result<Self, ConnInfoError> {
        let target_session_attrs = match params.get("target_session_attrs", "PGTARGETSESSIONATTRS")
        {
            Some(v) => TargetSessionAttrs::parse(&v)?,
            None => TargetSessionAttrs::Any,
        };
        let require_auth = match params.get("require_auth", "PGREQUIREAUTH") {
            Some(v) => RequireAuth::parse(&v)?,
            None => RequireAuth::default(),
        };
        let channel_binding = match params.get("channel_binding", "PGCHANNELBINDING").as_deref() {
            Some("disable") => ChannelBindingMode::Disable,
            Some("require") => ChannelBindingMode::Require,
            Some("prefer") | None => ChannelBindingMode::Prefer,
            Some(other) => {
                return Err(ConnInfoError::BadParam("channel_binding", other.to_owned()));
            }
        };
        let load_balance = match params
            .get("load_balance_hosts", "PGLOADBALANCEHOSTS")
            .as_deref()
        {
            Some("random") => true,
            Some("disable") | None => false,
            Some(other) => {
                return Err(ConnInfoError::BadParam(
                    "load_balance_hosts",
                    other.to_owned(),
                ));
            }
        };
        Ok(Self {
            target_session_attrs,
            require_auth,
            channel_binding,
            load_balance,
        })
    }
}

/// `passfile` or `PGPASSFILE`, else `~/.pgpass`.
fn param_passfile(params: &Params<'_, impl Fn(&str) -> Option<String>>) -> Option<PathBuf> {
    params
        .get("passfile", "PGPASSFILE")
        .map(PathBuf::from)
        .or_else(|| (params.env)("HOME").map(|h| PathBuf::from(h).join(".pgpass")))
}

impl ConnInfo {
    /// Parses a connection string, with libpq's environment variables for what it leaves out.
    pub fn parse(s: &str) -> Result<Self, ConnInfoError> {
        Self::parse_with_env(s, |k| std::env::var(k).ok())
    }

    /// As [`ConnInfo::parse`], with the environment given (tests).
    pub(crate) fn parse_with_env(
        s: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConnInfoError> {
        let (rest, ours) = split_ours(s)?;
        let pg = parse_rest(&rest)?;
        let params = Params {
            ours: &ours,
            env: &env,
        };
        let hosts = hosts_from(&pg, &env)?;
        let ports = ports_for(&pg, &env, hosts.len())?;
        let hosts: Vec<(String, u16)> = hosts.into_iter().zip(ports).collect();
        let (user, password, dbname) = credentials(&pg, &env);
        let connect_timeout = connect_timeout(&pg, &env)?;
        let (sslmode, sslrootcert) = tls_settings(&params)?;
        let session = SessionSettings::from_params(&params)?;
        let passfile = param_passfile(&params);
        let (host, port) = hosts[0].clone();
        Ok(ConnInfo {
            hosts,
            host,
            port,
            user,
            password,
            passfile,
            dbname,
            sslmode,
            sslrootcert,
            connect_timeout,
            target_session_attrs: session.target_session_attrs,
            load_balance: session.load_balance,
            channel_binding: session.channel_binding,
            require_auth: session.require_auth,
        })
    }

    /// This configuration for one of its hosts, with the password for it (the string's, or the
    /// password file's entry for this host, port, database and user).
    pub(crate) fn for_host(&self, host: &str, port: u16) -> ConnInfo {
        let mut c = self.clone();
        c.host = host.to_owned();
        c.port = port;
        if c.password.is_none()
            && let Some(file) = &self.passfile
        {
            // libpq matches a connection through its default socket directory by the name
            // `localhost`, and one through any other directory by the directory's path: a
            // `localhost` line is not meant for every server with a socket somewhere.
            let name = if super::socket::is_socket_dir(host)
                && super::socket::is_default_socket_dir(host)
            {
                "localhost"
            } else {
                host
            };
            c.password = super::passfile::lookup(file, name, port, &self.dbname, &self.user)
                .map(SecretString::from);
        }
        c
    }

    /// The hosts in the order to try them: as listed, or from a random start with `load_balance_hosts=random`.
    pub(crate) fn host_order(&self) -> Vec<(String, u16)> {
        let mut hosts = self.hosts.clone();
        if self.load_balance && hosts.len() > 1 {
            // Spread relays over the hosts; the clock's nanoseconds are random enough for that.
            let seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() as usize)
                .unwrap_or(0);
            let n = hosts.len();
            hosts.rotate_left(seed % n);
        }
        hosts
    }

    /// Settings for an ordinary SQL connection to this copy's host through tokio-postgres. TLS
    /// verification is done by the rustls config from `source::tls`, so `verify-*` map to
    /// tokio-postgres' `Require`.
    pub(crate) fn tokio_postgres_config(&self, application_name: &str) -> tokio_postgres::Config {
        use secrecy::ExposeSecret;
        let mut c = tokio_postgres::Config::new();
        c.host(&self.host)
            .port(self.port)
            .user(&self.user)
            .dbname(&self.dbname)
            .application_name(application_name)
            .connect_timeout(self.connect_timeout)
            .ssl_mode(match self.sslmode {
                SslMode::Disable => tokio_postgres::config::SslMode::Disable,
                SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
                _ => tokio_postgres::config::SslMode::Require,
            })
            .channel_binding(match self.channel_binding {
                ChannelBindingMode::Disable => tokio_postgres::config::ChannelBinding::Disable,
                ChannelBindingMode::Prefer => tokio_postgres::config::ChannelBinding::Prefer,
                ChannelBindingMode::Require => tokio_postgres::config::ChannelBinding::Require,
            });
        if let Some(pw) = &self.password {
            c.password(pw.expose_secret());
        }
        c
    }
}

/// `postgres://…?a=b&c=d` → the URL without our parameters, and ours.
fn split_url(s: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = s.split_once('?') else {
        return (s.to_owned(), Vec::new());
    };
    let mut ours = Vec::new();
    let mut kept = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        if OURS.contains(&k.as_ref()) {
            ours.push((k.into_owned(), v.into_owned()));
        } else if k != "application_name" {
            // The relay names its own connections; accepting the parameter keeps URLs shared with
            // other tools usable.
            kept.append_pair(&k, &v);
        }
    }
    let kept = kept.finish();
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{kept}")
    };
    (rest, ours)
}

/// `host=h dbname='my db'` → the string without our parameters, and ours. Values follow libpq's
/// quoting: single quotes, with `\'` and `\\` inside.
fn split_key_values(s: &str) -> Result<(String, Vec<(String, String)>), ConnInfoError> {
    let mut ours = Vec::new();
    let mut kept = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(ConnInfoError::Syntax(format!("{key:?} has no '=value'")));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    None => return Err(ConnInfoError::Syntax("unterminated quote".into())),
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        if OURS.contains(&key.as_str()) {
            ours.push((key, value));
        } else if key != "application_name" {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            kept.push(format!("{key}='{quoted}'"));
        }
    }
    Ok((kept.join(" "), ours))
}

/// Shown in logs and errors: everything but the password.
impl fmt::Display for ConnInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "postgres://{}", self.user)?;
        if self.password.is_some() {
            f.write_str(":***")?;
        }
        let hosts: Vec<String> = self.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect();
        write!(f, "@{}/{}", hosts.join(","), self.dbname)
    }
}

impl fmt::Debug for ConnInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ConnInfo({self}, sslmode={:?}, target_session_attrs={})",
            self.sslmode,
            self.target_session_attrs.as_str()
        )
    }
}

#[cfg(test)]
mod tests;
