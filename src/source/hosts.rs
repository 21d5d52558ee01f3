//! Trying the hosts of a connection string in order, as libpq does: the first one that accepts the
//! connection and matches `target_session_attrs` wins. After a failover the same list finds the
//! new primary, so the relay follows it with no restart and no configuration change.

use std::future::Future;

use super::conninfo::{ConnInfo, TargetSessionAttrs};
use super::error::SourceError;

/// What a server says about itself once connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ServerRole {
    /// A standby (`pg_is_in_recovery()`, reported as `in_hot_standby`).
    pub(crate) in_recovery: bool,
    /// Sessions default to read-only (a standby, or `default_transaction_read_only`).
    pub(crate) read_only: bool,
}

impl ServerRole {
    fn describe(self) -> &'static str {
        match (self.in_recovery, self.read_only) {
            (true, _) => "a standby",
            (false, true) => "a read-only primary",
            (false, false) => "a read-write primary",
        }
    }
}

/// Whether `role` is what `want` asks for; `standby_pass` is prefer-standby's first round.
fn acceptable(want: TargetSessionAttrs, role: ServerRole, standby_pass: bool) -> bool {
    match want {
        TargetSessionAttrs::Any => true,
        TargetSessionAttrs::ReadWrite => !role.read_only,
        TargetSessionAttrs::ReadOnly => role.read_only,
        TargetSessionAttrs::Primary => !role.in_recovery,
        TargetSessionAttrs::Standby => role.in_recovery,
        TargetSessionAttrs::PreferStandby => !standby_pass || role.in_recovery,
    }
}

/// Connects with `attempt` to each host in turn until one is acceptable. With one host its own
/// error comes back unchanged; with several, every host's error in one.
pub(super) async fn connect_first<T, F, Fut>(
    info: &ConnInfo,
    mut attempt: F,
) -> Result<T, SourceError>
where
    F: FnMut(ConnInfo) -> Fut,
    Fut: Future<Output = Result<(T, ServerRole), SourceError>>,
{
    let want = info.target_session_attrs;
    let passes: &[bool] = if want == TargetSessionAttrs::PreferStandby {
        &[true, false]
    } else {
        &[false]
    };
    let mut tried = Vec::new();
    for &standby_pass in passes {
        for (host, port) in info.host_order() {
            let target = format!("{host}:{port}");
            // The password file is read for each host (as libpq does), off the runtime's thread;
            // without one to read there is nothing to hand over.
            let for_host = if info.password.is_none() && info.passfile.is_some() {
                let (copy, name) = (info.clone(), host.clone());
                tokio::task::spawn_blocking(move || copy.for_host(&name, port))
                    .await
                    .unwrap_or_else(|_| info.for_host(&host, port))
            } else {
                info.for_host(&host, port)
            };
            match attempt(for_host).await {
                Ok((conn, role)) if acceptable(want, role, standby_pass) => return Ok(conn),
                Ok((_, role)) => tried.push((
                    target.clone(),
                    SourceError::WrongRole {
                        target,
                        found: role.describe(),
                        wanted: want.as_str(),
                    },
                )),
                Err(e) => tried.push((target, e)),
            }
        }
    }
    if tried.len() == 1 {
        return Err(tried.remove(0).1);
    }
    Err(SourceError::NoHost(tried))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRIMARY: ServerRole = ServerRole {
        in_recovery: false,
        read_only: false,
    };
    const STANDBY: ServerRole = ServerRole {
        in_recovery: true,
        read_only: true,
    };

    #[test]
    fn roles_match_libpq() {
        use TargetSessionAttrs::*;
        assert!(acceptable(ReadWrite, PRIMARY, false));
        assert!(!acceptable(ReadWrite, STANDBY, false));
        assert!(acceptable(Standby, STANDBY, false));
        assert!(!acceptable(Primary, STANDBY, false));
        assert!(!acceptable(PreferStandby, PRIMARY, true));
        assert!(acceptable(PreferStandby, PRIMARY, false));
        assert!(acceptable(Any, STANDBY, false));
    }

    #[tokio::test]
    async fn the_first_acceptable_host_wins_and_every_failure_is_named() {
        let info = ConnInfo::parse_with_env(
            "postgres://u@a:1,b:2,c:3/d?target_session_attrs=read-write",
            |_| None,
        )
        .unwrap();
        let got = connect_first(&info, |c| async move {
            match c.host.as_str() {
                "a" => Err(SourceError::Closed("down")),
                "b" => Ok(("b", STANDBY)),
                _ => Ok(("c", PRIMARY)),
            }
        })
        .await
        .unwrap();
        assert_eq!(got, "c");
        let info = ConnInfo::parse_with_env(
            "postgres://u@a:1,b:2/d?target_session_attrs=read-write",
            |_| None,
        )
        .unwrap();
        let e = connect_first(&info, |c| async move {
            match c.host.as_str() {
                "a" => Err::<((), ServerRole), _>(SourceError::Closed("down")),
                _ => Ok(((), STANDBY)),
            }
        })
        .await
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("a:1") && text.contains("b:2") && text.contains("standby"),
            "{text}"
        );
        assert!(e.is_transient(), "a failover in progress is worth retrying");
    }
}
