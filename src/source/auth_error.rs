//! Why authentication failed, as a type: [`AuthError`] is what `SourceError::Auth` carries, and
//! [`AuthRefusal`] the part of it the policy decides. The policy's refusals (`require_auth`,
//! `channel_binding`), a password that is missing, a SCRAM exchange that fails and a method the relay
//! does not speak are each a variant, so a test or a caller names the case instead of searching the
//! text. Each variant prints the text an operator has always read.
//!
//! A leaf: the method is kept as libpq's word for it, so this file needs nothing of `conninfo`.

use std::io;

/// Why the relay refused, or could not complete, the server's authentication.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The policy (`require_auth`, `channel_binding`) refused what the server asked or offered.
    #[error(transparent)]
    Refused(#[from] AuthRefusal),
    /// `channel_binding=require`, and tokio-postgres gave up because the server did not bind.
    #[error("channel_binding=require, but the server did not use channel binding ({0})")]
    ServerDidNotBind(String),
    /// The server asks the replication connection for a password and none is configured.
    #[error(
        "password required: the server asks user {user:?} for one and none is given; put it in \
         postgres.url (postgres://user:password@host/db), PGPASSWORD or the password file \
         (~/.pgpass or PGPASSFILE)"
    )]
    NoPassword {
        /// The user the server asked about.
        user: String,
    },
    /// The server asks the control connection for a password and none is configured
    /// (tokio-postgres does not say for which user).
    #[error(
        "password required: the server asks for one and none is given; put it in postgres.url, \
         PGPASSWORD or the password file (~/.pgpass or PGPASSFILE)"
    )]
    NoPasswordControl,
    /// The server's final SCRAM message does not verify.
    #[error("SCRAM: server signature invalid: {0}")]
    BadSignature(io::Error),
    /// The server's SCRAM challenge cannot be answered.
    #[error("SCRAM: {0}")]
    Scram(io::Error),
    /// The server asks for a method the relay does not speak.
    #[error(
        "server asks for GSS/SSPI/Kerberos authentication, which is not supported: use \
         scram-sha-256 or md5 in pg_hba.conf"
    )]
    Unsupported,
}

/// What the authentication policy (`require_auth`, `channel_binding`) refuses. Cloned out of the
/// `io::Error` the control connection's stream guard reports it in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthRefusal {
    /// `require_auth` does not allow the method the server asked for.
    #[error(
        "the server asked for {method} authentication, which require_auth={require_auth} does not allow"
    )]
    NotAllowed {
        /// The method, as libpq names it (`md5`, `scram-sha-256`, `none`).
        method: &'static str,
        /// The `require_auth` setting, as written.
        require_auth: String,
    },
    /// `channel_binding=require`, and the server asked for a method that cannot bind.
    #[error(
        "channel_binding=require, but the server asked for {method} authentication, which has no \
         channel binding (a server without TLS or SCRAM, or someone in between)"
    )]
    CannotBind {
        /// The method, as libpq names it.
        method: &'static str,
    },
    /// `channel_binding=require`, and the server offers no SCRAM-SHA-256-PLUS over TLS.
    #[error(
        "channel_binding=require, but the server offers no SCRAM-SHA-256-PLUS over TLS \
         (use sslmode=verify-full and a server with TLS)"
    )]
    NoPlusOverTls,
    /// The server offers SASL without SCRAM-SHA-256.
    #[error("server offers no supported SASL mechanism (need SCRAM-SHA-256)")]
    NoSaslMechanism,
    /// AuthenticationOk before the server's SCRAM signature verified.
    #[error(
        "server did not complete SCRAM authentication: it said OK before proving it knows the \
         password (someone in between, or a broken server)"
    )]
    OkBeforeProof,
    /// `channel_binding=require`, and the server's signature verified without channel binding.
    #[error("channel_binding=require, but the server authenticated without channel binding")]
    OkUnbound,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_variant_prints_as_it_always_has() {
        // Operators read these in the relay's stop message; callers match the variant, so only
        // this test would notice a changed word.
        let cases: [(AuthError, &str); 12] = [
            (
                AuthRefusal::NotAllowed {
                    method: "md5",
                    require_auth: "scram-sha-256".into(),
                }
                .into(),
                "the server asked for md5 authentication, which require_auth=scram-sha-256 does not allow",
            ),
            (
                AuthRefusal::CannotBind { method: "md5" }.into(),
                "channel_binding=require, but the server asked for md5 authentication, which has no channel binding (a server without TLS or SCRAM, or someone in between)",
            ),
            (
                AuthRefusal::NoPlusOverTls.into(),
                "channel_binding=require, but the server offers no SCRAM-SHA-256-PLUS over TLS (use sslmode=verify-full and a server with TLS)",
            ),
            (
                AuthRefusal::NoSaslMechanism.into(),
                "server offers no supported SASL mechanism (need SCRAM-SHA-256)",
            ),
            (
                AuthRefusal::OkBeforeProof.into(),
                "server did not complete SCRAM authentication: it said OK before proving it knows the password (someone in between, or a broken server)",
            ),
            (
                AuthRefusal::OkUnbound.into(),
                "channel_binding=require, but the server authenticated without channel binding",
            ),
            (
                AuthError::ServerDidNotBind("db error".into()),
                "channel_binding=require, but the server did not use channel binding (db error)",
            ),
            (
                AuthError::NoPassword { user: "u".into() },
                "password required: the server asks user \"u\" for one and none is given; put it in postgres.url (postgres://user:password@host/db), PGPASSWORD or the password file (~/.pgpass or PGPASSFILE)",
            ),
            (
                AuthError::NoPasswordControl,
                "password required: the server asks for one and none is given; put it in postgres.url, PGPASSWORD or the password file (~/.pgpass or PGPASSFILE)",
            ),
            (
                AuthError::BadSignature(io::Error::other("bad proof")),
                "SCRAM: server signature invalid: bad proof",
            ),
            (
                AuthError::Scram(io::Error::other("bad nonce")),
                "SCRAM: bad nonce",
            ),
            (
                AuthError::Unsupported,
                "server asks for GSS/SSPI/Kerberos authentication, which is not supported: use scram-sha-256 or md5 in pg_hba.conf",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
    }
}
