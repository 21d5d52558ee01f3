//! Unit tests of `conninfo`.

use super::*;
use secrecy::ExposeSecret;

fn parse(s: &str) -> Result<ConnInfo, ConnInfoError> {
    ConnInfo::parse_with_env(s, |_| None)
}

#[test]
fn parses_full_url() {
    let c = parse(
        "postgres://relay:p%40ss@db.example:6543/app?sslmode=verify-full&sslrootcert=/ca.pem",
    )
    .unwrap();
    assert_eq!(c.hosts, vec![("db.example".to_owned(), 6543)]);
    assert_eq!(c.user, "relay");
    assert_eq!(c.password.as_ref().unwrap().expose_secret(), "p@ss");
    assert_eq!(c.dbname, "app");
    assert_eq!(c.sslmode, SslMode::VerifyFull);
    assert_eq!(c.sslrootcert, Some(RootCerts::File("/ca.pem".into())));
}

#[test]
fn defaults_like_libpq() {
    let c = parse("postgresql://127.0.0.1").unwrap();
    assert_eq!(
        (c.port, &*c.user, &*c.dbname),
        (5432, "postgres", "postgres")
    );
    assert_eq!(c.sslmode, SslMode::Prefer);
    assert!(c.password.is_none());
    assert_eq!(c.target_session_attrs, TargetSessionAttrs::Any);
}

#[test]
fn several_hosts_and_target_session_attrs() {
    let c = parse(
        "postgres://u@h1:5432,h2:5433/app?target_session_attrs=read-write&load_balance_hosts=random",
    )
    .unwrap();
    assert_eq!(
        c.hosts,
        vec![("h1".to_owned(), 5432), ("h2".to_owned(), 5433)]
    );
    assert_eq!(c.target_session_attrs, TargetSessionAttrs::ReadWrite);
    assert!(c.load_balance);
    let c =
        parse("host=h1,h2 port=5432 dbname=app user=relay target_session_attrs=primary").unwrap();
    assert_eq!(c.hosts.len(), 2);
    assert_eq!(c.hosts[1], ("h2".to_owned(), 5432));
    assert_eq!(c.target_session_attrs, TargetSessionAttrs::Primary);
    assert_eq!(c.dbname, "app");
}

#[test]
fn key_value_quoting_and_our_parameters() {
    let c = parse(
        "host=h password='it''s' dbname='my db' sslmode=verify-ca sslrootcert=/ca.pem require_auth=scram-sha-256 channel_binding=require",
    );
    // libpq escapes a quote with a backslash, not by doubling it.
    assert!(c.is_err());
    let c = parse(
        r"host=h password='it\'s a \\secret' dbname='my db' sslmode=verify-ca sslrootcert=/ca.pem require_auth=scram-sha-256 channel_binding=require",
    )
    .unwrap();
    assert_eq!(c.password.unwrap().expose_secret(), r"it's a \secret");
    assert_eq!(c.dbname, "my db");
    assert_eq!(c.sslmode, SslMode::VerifyCa);
    assert_eq!(c.channel_binding, ChannelBindingMode::Require);
    assert!(c.require_auth.check(AuthMethod::ScramSha256).is_ok());
    assert_eq!(
        c.require_auth.check(AuthMethod::Password),
        Err(AuthRefusal::NotAllowed {
            method: "password",
            require_auth: "scram-sha-256".into()
        })
    );
}

#[test]
fn unencoded_specials_in_a_password() {
    // The first '@' ends the credentials: the rest would become the host, or a port.
    let e = parse("postgres://u:p@ss@h/d").unwrap_err().to_string();
    assert!(e.contains("percent-encode") && !e.contains("ss@h"), "{e}");
    let e = parse("postgres://u:p@ss:w@h/d").unwrap_err().to_string();
    assert!(e.contains("percent-encode"), "{e}");
    let c = parse("postgres://u:p%40ss%3Aw@h/d").unwrap();
    assert_eq!(c.password.unwrap().expose_secret(), "p@ss:w");
}

#[test]
fn negated_require_auth() {
    let c = parse("postgres://h/d?require_auth=!password,!md5").unwrap();
    assert!(c.require_auth.check(AuthMethod::ScramSha256).is_ok());
    assert!(c.require_auth.check(AuthMethod::None).is_ok());
    assert!(c.require_auth.check(AuthMethod::Md5).is_err());
    assert!(parse("postgres://h/d?require_auth=!password,md5").is_err());
}

#[test]
fn environment_fills_what_the_string_leaves_out() {
    let env = |k: &str| match k {
        "PGPASSWORD" => Some("from-env".to_owned()),
        "PGSSLMODE" => Some("require".to_owned()),
        "PGUSER" => Some("relay".to_owned()),
        _ => None,
    };
    let c = ConnInfo::parse_with_env("postgres://h/d", env).unwrap();
    assert_eq!(c.password.unwrap().expose_secret(), "from-env");
    assert_eq!(c.sslmode, SslMode::Require);
    assert_eq!(c.user, "relay");
    let c = ConnInfo::parse_with_env("postgres://u:given@h/d?sslmode=disable", env).unwrap();
    assert_eq!(c.password.unwrap().expose_secret(), "given");
    assert_eq!(c.sslmode, SslMode::Disable);
}

#[test]
fn display_and_debug_hide_the_password() {
    let c = parse("postgres://u:secret@h/d").unwrap();
    assert!(!c.to_string().contains("secret"));
    assert!(!format!("{c:?}").contains("secret"));
    assert_eq!(c.to_string(), "postgres://u:***@h:5432/d");
}

#[test]
fn rejects_bad_input_naming_the_part() {
    let e = parse("mysql://h/d").unwrap_err().to_string();
    assert!(e.contains("scheme"), "{e}");
    let e = parse("postgres://h/d?sslmode=bogus")
        .unwrap_err()
        .to_string();
    assert!(e.contains("sslmode"), "{e}");
    let e = parse("postgres://h/d?foo=1").unwrap_err().to_string();
    assert!(e.contains("foo"), "{e}");
    let e = parse("postgres://u@h:port/d").unwrap_err().to_string();
    assert!(e.contains("percent-encode"), "{e}");
    assert!(parse("not a url").is_err());
}

#[test]
fn system_roots_imply_verify_full_and_refuse_weaker_modes() {
    let c = parse("postgres://u@db.example/app?sslrootcert=system").unwrap();
    assert_eq!(c.sslmode, SslMode::VerifyFull);
    for mode in ["disable", "prefer", "require", "verify-ca"] {
        let e = parse(&format!(
            "postgres://u@db.example/app?sslrootcert=system&sslmode={mode}"
        ))
        .unwrap_err();
        assert!(
            matches!(e, ConnInfoError::WeakSystemRoots(_)),
            "{mode}: {e:?}"
        );
        assert!(e.to_string().contains("verify-full"), "{e}");
    }
    // From the environment just the same, as libpq does.
    let env = |k: &str| match k {
        "PGSSLROOTCERT" => Some("system".to_owned()),
        "PGSSLMODE" => Some("require".to_owned()),
        _ => None,
    };
    let e = ConnInfo::parse_with_env("host=db.example", env).unwrap_err();
    assert!(
        matches!(e, ConnInfoError::WeakSystemRoots(SslMode::Require)),
        "{e:?}"
    );
    // A file of roots keeps libpq's older rule: require with roots checks the chain.
    let c = parse("postgres://u@h/app?sslrootcert=/ca.pem&sslmode=require").unwrap();
    assert_eq!(c.sslmode, SslMode::Require);
}

#[test]
fn settings_are_read_as_keys_not_found_as_text() {
    let env = |k: &str| match k {
        "PGCHANNELBINDING" => Some("require".to_owned()),
        "PGLOADBALANCEHOSTS" => Some("random".to_owned()),
        _ => None,
    };
    for s in [
        "host=h1,h2 dbname=channel_binding_load_balance_hosts",
        "postgres://h1,h2/channel_binding?application_name=load_balance_hosts",
    ] {
        let c = ConnInfo::parse_with_env(s, env).unwrap();
        assert_eq!(c.channel_binding, ChannelBindingMode::Require, "{s}");
        assert!(c.load_balance, "{s}");
    }
    let c = ConnInfo::parse_with_env("host=h channel_binding=disable", env).unwrap();
    assert_eq!(c.channel_binding, ChannelBindingMode::Disable);
    let e = parse("host=h load_balance_hosts=sometimes").unwrap_err();
    assert!(e.to_string().contains("load_balance_hosts"), "{e}");
}

/// docs/security.md, finding 10: the password file's `localhost` lines match a socket connection
/// only through a default socket directory, as in libpq; another directory is matched by its own
/// path, so a password meant for the local server is not sent to whatever listens in another
/// directory.
#[test]
fn the_password_file_matches_localhost_only_for_the_default_socket_directory() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pgpass");
    std::fs::write(
        &file,
        "localhost:5432:app:relay:local-pw\n/srv/pg/sockets:5432:app:relay:srv-pw\n",
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let passfile = file.display().to_string();
    let password = |host: &str| {
        let c = ConnInfo::parse_with_env(
            &format!("host={host} port=5432 dbname=app user=relay"),
            |k| (k == "PGPASSFILE").then(|| passfile.clone()),
        )
        .unwrap();
        c.for_host(host, 5432)
            .password
            .map(|p| p.expose_secret().to_owned())
    };
    for default in ["/var/run/postgresql", "/run/postgresql", "/tmp", "/tmp/"] {
        assert_eq!(password(default).as_deref(), Some("local-pw"), "{default}");
    }
    assert_eq!(password("/srv/pg/sockets").as_deref(), Some("srv-pw"));
    assert_eq!(password("/home/mallory/sock"), None);
    assert_eq!(password("localhost").as_deref(), Some("local-pw"));
}
