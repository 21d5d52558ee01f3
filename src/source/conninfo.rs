//! Connection settings from the URL users give psql: `postgres://user:pass@host:port/db?sslmode=…`.
//!
//! One parser for both connections the relay opens: the replication connection (ours, on
//! postgres-protocol) and the control connection for ordinary SQL (tokio-postgres). tokio-postgres' own
//! parser cannot be used for the first (it rejects `replication=database`) and knows neither
//! `verify-ca`/`verify-full` nor `sslrootcert`, so both are derived from this struct instead.
//! The password is kept out of `Debug` and `Display`: settings are logged, secrets never.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// libpq's `sslmode` meanings (<https://www.postgresql.org/docs/current/libpq-ssl.html>).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// TLS when the server offers it, plaintext otherwise; the certificate is not checked (libpq default).
    Prefer,
    /// TLS or fail; the certificate is not checked unless `sslrootcert` is given (then like `verify-ca`).
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
pub enum RootCerts {
    /// A PEM file (`sslrootcert=/path/ca.pem`).
    File(PathBuf),
    /// The bundled Mozilla roots (`sslrootcert=system`, as libpq 16+ spells it).
    System,
}

/// A parsed connection URL.
#[derive(Clone, PartialEq, Eq)]
pub struct ConnInfo {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: Option<String>,
    pub dbname: String,
    pub sslmode: SslMode,
    pub sslrootcert: Option<RootCerts>,
    pub connect_timeout: Duration,
}

/// A URL that cannot be used; the message names the part and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ConnInfoError {
    #[error(
        "postgres url is not a URL ({0}): expected postgres://user:password@host:port/database"
    )]
    NotUrl(String),
    #[error("postgres url scheme {0:?} is not supported: use postgres:// or postgresql://")]
    Scheme(String),
    #[error("postgres url has no host: expected postgres://user:password@host:port/database")]
    NoHost,
    #[error("postgres url parameter {0}={1:?} is not valid")]
    BadParam(&'static str, String),
    #[error(
        "postgres url parameter {0:?} is not supported (supported: sslmode, sslrootcert, connect_timeout, application_name)"
    )]
    UnknownParam(String),
}

impl ConnInfo {
    /// Parses `postgres://[user[:password]@]host[:port][/dbname][?param=value&…]`.
    /// Defaults as libpq: port 5432, user `postgres`, database = user, sslmode `prefer`.
    pub fn parse(url: &str) -> Result<Self, ConnInfoError> {
        let u = url::Url::parse(url).map_err(|e| ConnInfoError::NotUrl(e.to_string()))?;
        if u.scheme() != "postgres" && u.scheme() != "postgresql" {
            return Err(ConnInfoError::Scheme(u.scheme().to_owned()));
        }
        let host = match u.host() {
            Some(url::Host::Ipv6(a)) => a.to_string(),
            Some(h) => h.to_string(),
            None => return Err(ConnInfoError::NoHost),
        };
        let decode = |s: &str| {
            percent_decode(s).ok_or_else(|| ConnInfoError::NotUrl("bad percent-encoding".into()))
        };
        let user = if u.username().is_empty() {
            "postgres".to_owned()
        } else {
            decode(u.username())?
        };
        let password = u.password().map(decode).transpose()?;
        let path = u.path().trim_start_matches('/');
        let dbname = if path.is_empty() {
            user.clone()
        } else {
            decode(path)?
        };
        let mut info = ConnInfo {
            host,
            port: u.port().unwrap_or(5432),
            user,
            password,
            dbname,
            sslmode: SslMode::Prefer,
            sslrootcert: None,
            connect_timeout: Duration::from_secs(10),
        };
        for (k, v) in u.query_pairs() {
            match &*k {
                "sslmode" => info.sslmode = SslMode::parse(&v)?,
                "sslrootcert" if v == "system" => info.sslrootcert = Some(RootCerts::System),
                "sslrootcert" => info.sslrootcert = Some(RootCerts::File(PathBuf::from(&*v))),
                "connect_timeout" => {
                    let secs: u64 = v
                        .parse()
                        .map_err(|_| ConnInfoError::BadParam("connect_timeout", v.to_string()))?;
                    info.connect_timeout = Duration::from_secs(secs.max(1));
                }
                // The relay sets its own application_name (unique per connection); accepting the
                // parameter keeps URLs shared with other tools usable.
                "application_name" => {}
                other => return Err(ConnInfoError::UnknownParam(other.to_owned())),
            }
        }
        Ok(info)
    }

    /// Settings for an ordinary SQL connection through tokio-postgres. TLS verification is done by
    /// the rustls config from [`super::tls`], so `verify-*` map to tokio-postgres' `Require`.
    pub fn tokio_postgres_config(&self, application_name: &str) -> tokio_postgres::Config {
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
            });
        if let Some(pw) = &self.password {
            c.password(pw);
        }
        c
    }
}

/// Shown in logs and errors: everything but the password.
impl fmt::Display for ConnInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "postgres://{}", self.user)?;
        if self.password.is_some() {
            f.write_str(":***")?;
        }
        write!(f, "@{}:{}/{}", self.host, self.port, self.dbname)
    }
}

impl fmt::Debug for ConnInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConnInfo({self}, sslmode={:?})", self.sslmode)
    }
}

/// Percent-decoding of URL user, password and path segments (`%40` → `@`).
fn percent_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_full_url() {
        let c = ConnInfo::parse(
            "postgres://relay:p%40ss@db.example:6543/app?sslmode=verify-full&sslrootcert=/ca.pem",
        )
        .unwrap();
        assert_eq!(c.host, "db.example");
        assert_eq!(c.port, 6543);
        assert_eq!(c.user, "relay");
        assert_eq!(c.password.as_deref(), Some("p@ss"));
        assert_eq!(c.dbname, "app");
        assert_eq!(c.sslmode, SslMode::VerifyFull);
        assert_eq!(c.sslrootcert, Some(RootCerts::File("/ca.pem".into())));
    }

    #[test]
    fn defaults_like_libpq() {
        let c = ConnInfo::parse("postgresql://127.0.0.1").unwrap();
        assert_eq!(
            (c.port, &*c.user, &*c.dbname),
            (5432, "postgres", "postgres")
        );
        assert_eq!(c.sslmode, SslMode::Prefer);
        assert_eq!(c.password, None);
    }

    #[test]
    fn display_and_debug_hide_the_password() {
        let c = ConnInfo::parse("postgres://u:secret@h/d").unwrap();
        assert!(!c.to_string().contains("secret"));
        assert!(!format!("{c:?}").contains("secret"));
        assert_eq!(c.to_string(), "postgres://u:***@h:5432/d");
    }

    #[test]
    fn rejects_bad_input_naming_the_part() {
        let e = ConnInfo::parse("mysql://h/d").unwrap_err().to_string();
        assert!(e.contains("scheme"), "{e}");
        let e = ConnInfo::parse("postgres://h/d?sslmode=bogus")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sslmode"), "{e}");
        let e = ConnInfo::parse("postgres://h/d?foo=1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("foo"), "{e}");
        assert!(ConnInfo::parse("not a url").is_err());
    }
}
