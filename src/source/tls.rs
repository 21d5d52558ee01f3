//! TLS for both Postgres connections: a rustls client config that gives libpq's `sslmode` meanings,
//! and the `tls-server-end-point` channel-binding hash SCRAM-SHA-256-PLUS needs.
//!
//! `prefer`/`require` encrypt without checking who answers (as libpq does); `verify-ca` checks the chain
//! but not the name; `verify-full` checks both. Signatures in the handshake are always verified, so a
//! `require` connection is still protected against passive eavesdropping.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, Error, RootCertStore, SignatureScheme,
};

use super::conninfo::{ConnInfo, RootCerts, SslMode};

/// A TLS setting that cannot be used: names the file or setting.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TlsConfigError {
    /// The `sslrootcert` file cannot be read as PEM.
    #[error("cannot read sslrootcert {path}: {error}")]
    RootCertFile {
        /// The file's path.
        path: String,
        /// Why it cannot be read (shown, not returned: the error travels on as text).
        error: rustls::pki_types::pem::Error,
    },
    /// The `sslrootcert` file holds no certificate rustls accepts as a root.
    #[error("sslrootcert {0} holds no usable certificate")]
    NoRoots(String),
    /// `verify-ca` or `verify-full` without `sslrootcert`.
    #[error("sslmode={0} needs sslrootcert=<file> (or sslrootcert=system) in the postgres url")]
    MissingRoots(&'static str),
    /// rustls refused the configuration. Its text is shown, not returned as a source: the error
    /// travels on as text (`SourceError::Tls`).
    #[error("TLS setup failed: {0}")]
    Rustls(rustls::Error),
}

impl From<rustls::Error> for TlsConfigError {
    fn from(e: rustls::Error) -> Self {
        TlsConfigError::Rustls(e)
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The rustls config for `info.sslmode`, or `None` for `disable`.
pub(super) fn client_config(info: &ConnInfo) -> Result<Option<Arc<ClientConfig>>, TlsConfigError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()?;
    let verify = match (info.sslmode, &info.sslrootcert) {
        (SslMode::Disable, _) => return Ok(None),
        (SslMode::Prefer, _) | (SslMode::Require, None) => None,
        // libpq: `require` with a root certificate behaves like `verify-ca`.
        (SslMode::Require, Some(roots)) => Some((roots, false)),
        (SslMode::VerifyCa, Some(roots)) => Some((roots, false)),
        (SslMode::VerifyFull, Some(roots)) => Some((roots, true)),
        (SslMode::VerifyCa, None) => return Err(TlsConfigError::MissingRoots("verify-ca")),
        (SslMode::VerifyFull, None) => return Err(TlsConfigError::MissingRoots("verify-full")),
    };
    let config = match verify {
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoNameNoChain(
                provider.signature_verification_algorithms,
            )))
            .with_no_client_auth(),
        Some((roots, check_name)) => {
            let roots = Arc::new(root_store(roots)?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?;
            if check_name {
                builder.with_webpki_verifier(webpki).with_no_client_auth()
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
                    .with_no_client_auth()
            }
        }
    };
    Ok(Some(Arc::new(config)))
}

/// [`client_config`] on the runtime's blocking pool: it reads the `sslrootcert` file, and the relay's
/// one runtime thread must not wait for a disk (or a network file system) meanwhile. Read at every
/// connect, so a rotated CA file is picked up by the next connection.
pub(super) async fn client_config_off_runtime(
    info: &ConnInfo,
) -> Result<Option<Arc<ClientConfig>>, TlsConfigError> {
    if info.sslmode == SslMode::Disable {
        return Ok(None);
    }
    let info = info.clone();
    tokio::task::spawn_blocking(move || client_config(&info))
        .await
        .unwrap_or_else(|e| {
            Err(TlsConfigError::Rustls(rustls::Error::General(format!(
                "reading the TLS settings failed: {e}"
            ))))
        })
}

fn root_store(roots: &RootCerts) -> Result<RootCertStore, TlsConfigError> {
    let mut store = RootCertStore::empty();
    match roots {
        RootCerts::System => store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        RootCerts::File(path) => {
            let shown = path.display().to_string();
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|error| TlsConfigError::RootCertFile {
                    path: shown.clone(),
                    error,
                })?;
            let (added, _) = store.add_parsable_certificates(certs);
            if added == 0 {
                return Err(TlsConfigError::NoRoots(shown));
            }
        }
    }
    Ok(store)
}

/// The server name for SNI and `verify-full`: a DNS name or an IP address.
pub(super) fn server_name(host: &str) -> Result<ServerName<'static>, TlsConfigError> {
    ServerName::try_from(host.to_owned())
        .map_err(|_| TlsConfigError::Rustls(Error::General(format!("invalid host name {host:?}"))))
}

/// `sslmode=prefer/require` without roots: encryption only, like libpq. Handshake signatures are still
/// checked so the session keys belong to the certificate's key.
#[derive(Debug)]
struct NoNameNoChain(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for NoNameNoChain {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// `verify-ca`: the full WebPKI check, except that a certificate for another name is accepted.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// RFC 5929 `tls-server-end-point`: the hash of the server certificate, with the hash of its signature
/// algorithm, SHA-256 for MD5/SHA-1. `None` when the algorithm defines no hash (e.g. Ed25519): then
/// SCRAM runs without channel binding, as libpq does.
pub(super) fn server_end_point_hash(cert_der: &[u8]) -> Option<Vec<u8>> {
    use sha2::Digest;
    use x509_cert::der::Decode;
    let cert = x509_cert::Certificate::from_der(cert_der).ok()?;
    let oid = cert.signature_algorithm.oid.to_string();
    match oid.as_str() {
        // md5WithRSA, sha1WithRSA, sha256WithRSA, ecdsa-with-SHA1, ecdsa-with-SHA256, RSASSA-PSS
        // (the server uses SHA-256 for PSS as well).
        "1.2.840.113549.1.1.4"
        | "1.2.840.113549.1.1.5"
        | "1.2.840.113549.1.1.11"
        | "1.2.840.10045.4.1"
        | "1.2.840.10045.4.3.2"
        | "1.2.840.113549.1.1.10" => Some(sha2::Sha256::digest(cert_der).to_vec()),
        "1.2.840.113549.1.1.12" | "1.2.840.10045.4.3.3" => {
            Some(sha2::Sha384::digest(cert_der).to_vec())
        }
        "1.2.840.113549.1.1.13" | "1.2.840.10045.4.3.4" => {
            Some(sha2::Sha512::digest(cert_der).to_vec())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(url: &str) -> ConnInfo {
        ConnInfo::parse(url).unwrap()
    }

    #[test]
    fn disable_means_no_tls() {
        assert!(
            client_config(&info("postgres://h/d?sslmode=disable"))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn verify_modes_need_roots() {
        let e = client_config(&info("postgres://h/d?sslmode=verify-full")).unwrap_err();
        assert!(e.to_string().contains("sslrootcert"), "{e}");
    }

    #[test]
    fn missing_root_file_names_it() {
        let e = client_config(&info(
            "postgres://h/d?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem",
        ))
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
    }

    #[test]
    fn system_roots_load() {
        let c = client_config(&info(
            "postgres://h/d?sslmode=verify-full&sslrootcert=system",
        ));
        assert!(c.unwrap().is_some());
    }
}
