//! `[nats]` connection settings, parsed once: the server list (credentials taken out of the URLs, so
//! the client and its logs never see them), the credentials (as secrets) and the TLS files.

use std::path::{Path, PathBuf};

use async_nats::ServerAddr;
use secrecy::SecretString;

use super::{ConfigError, NatsConfig, invalid};
use crate::secret_file::{self, Access};

/// How the relay proves who it is to NATS.
#[derive(Clone, Debug, Default)]
pub(crate) enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// A user and password, from `nats.user`/`nats.password` or the URL.
    UserPassword {
        /// The user name.
        user: String,
        /// The user's password.
        password: SecretString,
    },
    /// An authentication token, from `nats.token` or the URL.
    Token(SecretString),
    /// The seed of an NKey, read from `nats.nkey_seed_file`.
    NkeySeed(SecretString),
    /// `nats.creds_file`: a JWT and its seed.
    CredsFile(PathBuf),
}

/// The parsed `[nats]` connection settings.
#[derive(Clone, Debug)]
pub(crate) struct NatsSettings {
    /// `nats.url`, one address per server, without credentials.
    pub(crate) servers: Vec<ServerAddr>,
    /// The one set of credentials, from the URLs or the keys.
    pub(crate) auth: NatsAuth,
    /// `nats.tls_ca_file`: the only CA to trust; `None` for the system roots.
    pub(crate) tls_ca_file: Option<PathBuf>,
    /// Client certificate and key (mutual TLS).
    pub(crate) tls_client: Option<(PathBuf, PathBuf)>,
    /// TLS for every server, also `nats://` ones.
    pub(crate) tls_required: bool,
}

/// Parses and checks the connection part of `[nats]`.
pub(super) fn parse(n: &NatsConfig) -> Result<NatsSettings, ConfigError> {
    let (servers, url_auth) = servers_from_urls(&n.url)?;
    let auth = credentials(n, url_auth)?;
    let (tls_ca_file, tls_client) = tls_files(n)?;
    // A CA or a client certificate says the operator means TLS. Without requiring it, a server (or
    // someone in between) that does not offer TLS gets the credentials in plaintext.
    let tls_required = n.tls_required || tls_ca_file.is_some() || tls_client.is_some();
    Ok(NatsSettings {
        servers,
        auth,
        tls_ca_file,
        tls_client,
        tls_required,
    })
}

/// `nats.url`: one server per comma-separated URL, credentials taken out (the last URL that has
/// some gives them); at least one server.
fn servers_from_urls(urls: &str) -> Result<(Vec<ServerAddr>, NatsAuth), ConfigError> {
    let mut servers = Vec::new();
    let mut url_auth = NatsAuth::None;
    for raw in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let (server, auth) = server_from_url(raw)?;
        if !matches!(auth, NatsAuth::None) {
            url_auth = auth;
        }
        servers.push(server);
    }
    if servers.is_empty() {
        return Err(invalid("nats.url", "is empty: expected nats://host:4222"));
    }
    Ok((servers, url_auth))
}

/// One `nats://` or `tls://` URL with a host: its address without credentials, and the credentials.
fn server_from_url(raw: &str) -> Result<(ServerAddr, NatsAuth), ConfigError> {
    let mut url = url::Url::parse(raw).map_err(|e| {
        invalid(
            "nats.url",
            format!(
                "{} is not a URL ({e}): expected nats://host:4222, or a comma-separated list of them",
                super::redact_url(raw)
            ),
        )
    })?;
    match url.scheme() {
        "nats" | "tls" => {}
        "ws" | "wss" => {
            return Err(invalid(
                "nats.url",
                "websocket URLs (ws://, wss://) are not supported: use nats:// or tls:// (the relay speaks \
                 the NATS protocol over TCP, with TLS for tls://)",
            ));
        }
        other => {
            return Err(invalid(
                "nats.url",
                format!("scheme {other:?} is not supported: use nats:// or tls://"),
            ));
        }
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(
            "nats.url",
            "has no host: expected nats://host:4222",
        ));
    }
    let auth = url_credentials(&url)?;
    let _ = url.set_username("");
    let _ = url.set_password(None);
    let server = ServerAddr::from_url(url).map_err(|e| invalid("nats.url", e.to_string()))?;
    Ok((server, auth))
}

/// A file key: empty for none, else a path that must be a file.
fn existing_file(key: &str, path: &str) -> Result<Option<PathBuf>, ConfigError> {
    if path.is_empty() {
        return Ok(None);
    }
    if !Path::new(path).is_file() {
        return Err(invalid(key, format!("{path:?} is not a readable file")));
    }
    Ok(Some(PathBuf::from(path)))
}

/// The relay's one set of credentials: from the URLs, user/password, token, NKey seed or creds
/// file; given more than one way is refused (which one wins would be a guess).
fn credentials(n: &NatsConfig, url_auth: NatsAuth) -> Result<NatsAuth, ConfigError> {
    let mut ways = Vec::new();
    let mut auth = url_auth;
    if !matches!(auth, NatsAuth::None) {
        ways.push("credentials in nats.url");
    }
    if !n.user.is_empty() || !n.password.is_empty() {
        if n.user.is_empty() || n.password.is_empty() {
            return Err(invalid(
                "nats.user",
                "nats.user and nats.password go together: set both or neither",
            ));
        }
        ways.push("nats.user/nats.password");
        auth = NatsAuth::UserPassword {
            user: n.user.clone(),
            password: SecretString::from(n.password.clone()),
        };
    }
    if !n.token.is_empty() {
        ways.push("nats.token");
        auth = NatsAuth::Token(SecretString::from(n.token.clone()));
    }
    if let Some(path) = existing_file("nats.nkey_seed_file", &n.nkey_seed_file)? {
        ways.push("nats.nkey_seed_file");
        auth = NatsAuth::NkeySeed(read_nkey_seed(&path)?);
    }
    if let Some(path) = existing_file("nats.creds_file", &n.creds_file)? {
        ways.push("nats.creds_file");
        // Checked here, read again by the client at each connect (so a rotated file is picked up).
        secret_file::read(&path, Access::RootGroup)
            .map_err(|e| invalid("nats.creds_file", e.to_string()))?;
        auth = NatsAuth::CredsFile(path);
    }
    if ways.len() > 1 {
        return Err(invalid(
            "nats.url",
            format!(
                "the relay's NATS credentials are given more than one way ({}): keep one",
                ways.join(", ")
            ),
        ));
    }
    Ok(auth)
}

/// `nats.nkey_seed_file`: a secret file whose first line starting with S is the seed.
fn read_nkey_seed(path: &Path) -> Result<SecretString, ConfigError> {
    let seed = secret_file::read(path, Access::RootGroup)
        .map_err(|e| invalid("nats.nkey_seed_file", e.to_string()))?;
    let seed = seed
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with('S') && !l.is_empty())
        .ok_or_else(|| {
            invalid(
                "nats.nkey_seed_file",
                format!("{path:?} holds no NKey seed (a line starting with S)"),
            )
        })?;
    Ok(SecretString::from(seed.to_owned()))
}

/// A client certificate file and its key file.
type ClientCert = (PathBuf, PathBuf);

/// `nats.tls_ca_file`, and the client certificate and key, which go together.
fn tls_files(n: &NatsConfig) -> Result<(Option<PathBuf>, Option<ClientCert>), ConfigError> {
    let tls_ca_file = existing_file("nats.tls_ca_file", &n.tls_ca_file)?;
    let cert = existing_file("nats.tls_cert_file", &n.tls_cert_file)?;
    let key = existing_file("nats.tls_key_file", &n.tls_key_file)?;
    let tls_client = match (cert, key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => {
            return Err(invalid(
                "nats.tls_cert_file",
                "nats.tls_cert_file and nats.tls_key_file go together: set both or neither",
            ));
        }
    };
    Ok((tls_ca_file, tls_client))
}

/// `user:password@` or `token@` in a URL (percent-decoded).
fn url_credentials(url: &url::Url) -> Result<NatsAuth, ConfigError> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| invalid("nats.url", "its credentials are not valid UTF-8"))
    };
    Ok(match (url.username(), url.password()) {
        ("", None) => NatsAuth::None,
        (user, Some(password)) => NatsAuth::UserPassword {
            user: decode(user)?,
            password: SecretString::from(decode(password)?),
        },
        (token, None) => NatsAuth::Token(SecretString::from(decode(token)?)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::ExposeSecret;

    fn parse_url(url: &str) -> Result<NatsSettings, ConfigError> {
        parse(&NatsConfig {
            url: url.into(),
            ..NatsConfig::default()
        })
    }

    #[test]
    fn credentials_leave_the_url() {
        let s =
            parse_url("nats://relay:s%40cr3tpw@n1:4222,nats://relay:s%40cr3tpw@n2:4222").unwrap();
        assert_eq!(s.servers.len(), 2);
        for a in &s.servers {
            assert!(a.username().is_none() && a.password().is_none(), "{a:?}");
        }
        match &s.auth {
            NatsAuth::UserPassword { user, password } => {
                assert_eq!(user, "relay");
                assert_eq!(password.expose_secret(), "s@cr3tpw");
            }
            other => panic!("{other:?}"),
        }
        assert!(!format!("{s:?}").contains("cr3tpw"), "{s:?}");
        match parse_url("tls://t0ken@n1:4222").unwrap().auth {
            NatsAuth::Token(t) => assert_eq!(t.expose_secret(), "t0ken"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn websockets_and_other_schemes_are_refused() {
        for url in ["ws://h:80", "wss://h:443", "http://h:4222"] {
            let e = parse_url(url).unwrap_err().to_string();
            assert!(e.contains("nats.url") && e.contains("nats://"), "{e}");
        }
    }

    #[test]
    fn credentials_given_two_ways_are_refused() {
        let e = parse(&NatsConfig {
            url: "nats://a:b@h:4222".into(),
            token: "t".into(),
            ..NatsConfig::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("more than one way"), "{e}");
        assert!(!e.contains(":b@"), "{e}");
    }

    #[test]
    fn a_ca_or_client_certificate_requires_tls() {
        let dir = tempfile::tempdir().unwrap();
        let pem = dir.path().join("ca.pem");
        std::fs::write(&pem, "not checked here").unwrap();
        let pem = pem.display().to_string();
        let plain = parse_url("nats://h:4222").unwrap();
        assert!(!plain.tls_required);
        let with_ca = parse(&NatsConfig {
            url: "nats://h:4222".into(),
            tls_ca_file: pem.clone(),
            ..NatsConfig::default()
        })
        .unwrap();
        assert!(with_ca.tls_required);
        let with_cert = parse(&NatsConfig {
            url: "nats://h:4222".into(),
            tls_cert_file: pem.clone(),
            tls_key_file: pem,
            ..NatsConfig::default()
        })
        .unwrap();
        assert!(with_cert.tls_required);
    }

    #[test]
    fn seed_and_creds_files_others_can_read_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.nk");
        std::fs::write(
            &path,
            "SUAM5DTDXOWQB6TEWWAHUWV2XL6PGHF4KW4SXV6V7EUHKFUXTL6D3DCTGQ\n",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let shown = path.display().to_string();
        for (key, config) in [
            (
                "nats.nkey_seed_file",
                NatsConfig {
                    url: "nats://h:4222".into(),
                    nkey_seed_file: shown.clone(),
                    ..NatsConfig::default()
                },
            ),
            (
                "nats.creds_file",
                NatsConfig {
                    url: "nats://h:4222".into(),
                    creds_file: shown.clone(),
                    ..NatsConfig::default()
                },
            ),
        ] {
            let e = parse(&config).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("chmod 0600"), "{e}");
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let ok = parse(&NatsConfig {
            url: "nats://h:4222".into(),
            nkey_seed_file: shown,
            ..NatsConfig::default()
        })
        .unwrap();
        assert!(matches!(ok.auth, NatsAuth::NkeySeed(_)));
    }
}
