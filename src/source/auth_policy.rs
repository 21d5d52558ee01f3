//! libpq's authentication policy, once, for both connections: which requests of the server
//! `require_auth` and `channel_binding` allow, which SCRAM mechanism to answer with, and when an
//! AuthenticationOk may be believed.
//!
//! The replication connection speaks the protocol itself ([`super::conn`]) and asks every question
//! here; the control connection (tokio-postgres) asks the first one through its stream guard
//! ([`super::auth_guard`]), because tokio-postgres answers the rest itself (it chooses
//! SCRAM-SHA-256-PLUS, refuses an unverifiable server signature and an early OK, and enforces
//! `channel_binding=require` for SCRAM).

use postgres_protocol::authentication::sasl::{self, ChannelBinding};

use super::auth_error::AuthRefusal;
use super::conninfo::{AuthMethod, ChannelBindingMode, ConnInfo, RequireAuth};

/// How far a SCRAM exchange got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scram {
    /// The server asked for no SASL exchange.
    NotStarted,
    /// Started; `bound`: with channel binding (SCRAM-SHA-256-PLUS).
    Started { bound: bool },
    /// The server's signature verified.
    Verified { bound: bool },
}

/// The policy of one connection attempt.
#[derive(Debug, Clone)]
pub(crate) struct AuthPolicy {
    require: RequireAuth,
    channel_binding: ChannelBindingMode,
}

impl AuthPolicy {
    pub(crate) fn new(info: &ConnInfo) -> Self {
        AuthPolicy {
            require: info.require_auth.clone(),
            channel_binding: info.channel_binding,
        }
    }

    /// Whether the policy restricts anything the stream guard must watch.
    pub(crate) fn is_set(&self) -> bool {
        self.require.is_set() || self.requires_channel_binding()
    }

    /// `channel_binding=require`.
    pub(crate) fn requires_channel_binding(&self) -> bool {
        self.channel_binding == ChannelBindingMode::Require
    }

    /// The server asks for `method`: may it? Refused before a password or its hash leaves.
    /// `channel_binding=require` refuses every method that cannot bind (all but SCRAM).
    pub(crate) fn allow(&self, method: AuthMethod) -> Result<(), AuthRefusal> {
        self.require.check(method)?;
        if method != AuthMethod::ScramSha256 && self.channel_binding == ChannelBindingMode::Require
        {
            return Err(AuthRefusal::CannotBind {
                method: method.as_str(),
            });
        }
        Ok(())
    }

    /// The server offers SASL with these mechanisms; `tls_hash` is the `tls-server-end-point` hash of
    /// its certificate when the connection is TLS. Returns the mechanism and binding to answer with:
    /// SCRAM-SHA-256-PLUS whenever it is offered over TLS (it ties the login to this TLS session, so
    /// no one can relay it), plain SCRAM saying "y" when the hash exists but no -PLUS was offered
    /// (which lets the server notice a stripped offer), "n" without TLS.
    pub(crate) fn choose_sasl(
        &self,
        plain: bool,
        plus: bool,
        tls_hash: Option<&Vec<u8>>,
    ) -> Result<(&'static str, ChannelBinding, Scram), AuthRefusal> {
        self.require.check(AuthMethod::ScramSha256)?;
        let hash = tls_hash.filter(|_| self.channel_binding != ChannelBindingMode::Disable);
        if self.channel_binding == ChannelBindingMode::Require && !(plus && hash.is_some()) {
            return Err(AuthRefusal::NoPlusOverTls);
        }
        let bound = plus && hash.is_some();
        let (mech, binding) = match (hash, plus, plain) {
            (Some(h), true, _) => (
                sasl::SCRAM_SHA_256_PLUS,
                ChannelBinding::tls_server_end_point(h.clone()),
            ),
            (Some(_), false, true) => (sasl::SCRAM_SHA_256, ChannelBinding::unrequested()),
            (None, _, true) => (sasl::SCRAM_SHA_256, ChannelBinding::unsupported()),
            _ => {
                return Err(AuthRefusal::NoSaslMechanism);
            }
        };
        Ok((mech, binding, Scram::Started { bound }))
    }

    /// The server says AuthenticationOk after `scram`: may it be believed? Without any exchange it
    /// is trust (or peer), which `require_auth` must allow; after SCRAM started, only once the
    /// server's signature verified (libpq: "server did not complete authentication"), because an
    /// impostor cannot compute it; and with `channel_binding=require`, only bound.
    pub(crate) fn ok(&self, scram: Scram) -> Result<(), AuthRefusal> {
        match scram {
            Scram::NotStarted => self.allow(AuthMethod::None),
            Scram::Started { .. } => Err(AuthRefusal::OkBeforeProof),
            Scram::Verified { bound: false }
                if self.channel_binding == ChannelBindingMode::Require =>
            {
                Err(AuthRefusal::OkUnbound)
            }
            Scram::Verified { .. } => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(params: &str) -> AuthPolicy {
        let info = ConnInfo::parse_with_env(&format!("postgres://h/d?{params}"), |_| None).unwrap();
        AuthPolicy::new(&info)
    }

    #[test]
    fn an_ok_is_believed_only_after_a_verified_signature() {
        let p = policy("sslmode=disable");
        assert_eq!(
            p.ok(Scram::Started { bound: true }),
            Err(AuthRefusal::OkBeforeProof)
        );
        assert!(p.ok(Scram::Verified { bound: false }).is_ok());
        assert!(p.ok(Scram::NotStarted).is_ok(), "trust, nothing required");
        let strict = policy("channel_binding=require&require_auth=scram-sha-256");
        assert!(strict.ok(Scram::NotStarted).is_err());
        assert_eq!(
            strict.ok(Scram::Verified { bound: false }),
            Err(AuthRefusal::OkUnbound)
        );
        assert!(strict.ok(Scram::Verified { bound: true }).is_ok());
    }

    #[test]
    fn channel_binding_require_refuses_methods_that_cannot_bind() {
        let p = policy("channel_binding=require");
        for m in [AuthMethod::Password, AuthMethod::Md5, AuthMethod::None] {
            assert_eq!(
                p.allow(m),
                Err(AuthRefusal::CannotBind { method: m.as_str() })
            );
        }
        assert!(p.allow(AuthMethod::ScramSha256).is_ok());
        assert_eq!(
            p.choose_sasl(true, false, Some(&vec![1])).err(),
            Some(AuthRefusal::NoPlusOverTls),
            "no -PLUS"
        );
        assert_eq!(
            p.choose_sasl(true, true, None).err(),
            Some(AuthRefusal::NoPlusOverTls),
            "no TLS"
        );
        let (mech, _, scram) = p.choose_sasl(true, true, Some(&vec![1])).unwrap();
        assert_eq!(mech, sasl::SCRAM_SHA_256_PLUS);
        assert_eq!(scram, Scram::Started { bound: true });
    }

    #[test]
    fn plus_is_chosen_whenever_offered_over_tls_unless_disabled() {
        let p = policy("sslmode=require");
        let (mech, _, _) = p.choose_sasl(true, true, Some(&vec![1])).unwrap();
        assert_eq!(mech, sasl::SCRAM_SHA_256_PLUS);
        let (mech, _, scram) = p.choose_sasl(true, false, Some(&vec![1])).unwrap();
        assert_eq!(mech, sasl::SCRAM_SHA_256);
        assert_eq!(scram, Scram::Started { bound: false });
        let off = policy("sslmode=require&channel_binding=disable");
        let (mech, _, _) = off.choose_sasl(true, true, Some(&vec![1])).unwrap();
        assert_eq!(mech, sasl::SCRAM_SHA_256);
        assert_eq!(
            policy("").choose_sasl(false, false, None).err(),
            Some(AuthRefusal::NoSaslMechanism)
        );
    }
}
