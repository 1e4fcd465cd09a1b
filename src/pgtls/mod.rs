//! TLS to Postgres, for the SQL connection (a tokio-postgres connector) and
//! the replication connection (`ReplicationConnection` wraps its socket with
//! [`TlsSettings::handshake`]). rustls with the ring provider; no OpenSSL.
//!
//! The settings come from `source.url` as libpq reads them: `sslmode`
//! (`disable`, `allow`, `prefer`, `require`, `verify-ca`, `verify-full`;
//! default `prefer`) and `sslrootcert` (a PEM file of CA certificates).
//! tokio-postgres knows neither `verify-*` nor `sslrootcert`, so
//! [`extract`] takes them out of the string before tokio-postgres parses it.
//!
//! What is verified, as libpq does it:
//!
//! | sslmode | without sslrootcert | with sslrootcert |
//! |---|---|---|
//! | `disable` | no TLS | no TLS |
//! | `allow`, `prefer` | TLS if offered, certificate not checked | TLS if offered, chain checked |
//! | `require` | TLS, certificate not checked | TLS, chain checked (as `verify-ca`) |
//! | `verify-ca` | refused (needs sslrootcert) | TLS, chain checked, any host name |
//! | `verify-full` | refused (needs sslrootcert) | TLS, chain and host name checked |
//!
//! `allow` is treated like `prefer` (libpq tries plaintext first; we ask for
//! TLS first, which only differs against servers that reject TLS sessions).
//! Even when the certificate is not checked, the handshake signatures are,
//! so the session is encrypted to whoever holds the certificate's key.
//! Unix-socket connections never use TLS (libpq ignores sslmode there too).
//!
//! It sits below the configuration rather than inside `source`: the
//! configuration builds these settings while it reads `source.url`, so a
//! missing or unreadable `sslrootcert` is refused before anything connects.
//!
//! [`url`] reads the settings out of the connection string, [`verify`]
//! holds the checks below `verify-full`, [`error`] words failures with
//! their fix, [`connect`] is the tokio-postgres connector.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::io::{AsyncRead, AsyncWrite};

/// `sslmode`, with libpq's six values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    pub fn parse(s: &str) -> Option<SslMode> {
        Some(match s {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// TLS or nothing: a server without TLS is refused.
    pub fn requires_tls(self) -> bool {
        self >= SslMode::Require
    }

    /// The nearest mode tokio-postgres knows; the verification itself is in
    /// our connector.
    pub fn for_tokio_postgres(self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as Pg;
        match self {
            SslMode::Disable => Pg::Disable,
            SslMode::Allow | SslMode::Prefer => Pg::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Pg::Require,
        }
    }
}

impl std::fmt::Display for SslMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How much of the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verification {
    /// Any certificate (the handshake signatures still are checked).
    None,
    /// Signed by the CA in sslrootcert; any host name.
    Chain,
    /// Signed by the CA in sslrootcert and issued for the host connected to.
    Full,
}

/// The TLS settings of the source, from `source.url`.
#[derive(Clone)]
pub struct TlsSettings {
    pub mode: SslMode,
    pub root_cert: Option<PathBuf>,
    /// None for `disable`.
    client: Option<Arc<ClientConfig>>,
}

impl std::fmt::Debug for TlsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSettings")
            .field("mode", &self.mode)
            .field("root_cert", &self.root_cert)
            .finish_non_exhaustive()
    }
}

impl TlsSettings {
    /// Settings for `mode` and the CA file `root_cert`, which is read now: an
    /// unreadable or empty file is an error that names it.
    pub fn new(mode: SslMode, root_cert: Option<PathBuf>) -> Result<TlsSettings, String> {
        if matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) && root_cert.is_none() {
            return Err(format!(
                "sslmode={mode} needs sslrootcert=/path/to/ca.pem, the CA certificate that signed the server's certificate"
            ));
        }
        let client = match mode {
            SslMode::Disable => None,
            _ => {
                let roots = root_cert.as_deref().map(load_roots).transpose()?;
                Some(Arc::new(client_config(mode, roots)?))
            }
        };
        Ok(TlsSettings {
            mode,
            root_cert,
            client,
        })
    }

    /// Settings for a plain tokio-postgres configuration (no sslrootcert).
    pub fn from_tokio_postgres(mode: tokio_postgres::config::SslMode) -> TlsSettings {
        use tokio_postgres::config::SslMode as Pg;
        let mode = match mode {
            Pg::Disable => SslMode::Disable,
            Pg::Require => SslMode::Require,
            _ => SslMode::Prefer,
        };
        TlsSettings::new(mode, None).expect("no file to read, so nothing can fail")
    }

    /// How much of the certificate is checked.
    pub fn verification(&self) -> Verification {
        match (self.mode, &self.root_cert) {
            (SslMode::VerifyFull, _) => Verification::Full,
            (SslMode::VerifyCa, _) | (_, Some(_)) => Verification::Chain,
            _ => Verification::None,
        }
    }

    /// The tokio-postgres connector for these settings.
    pub fn connector(&self) -> MakeRustlsConnect {
        MakeRustlsConnect {
            settings: self.clone(),
        }
    }

    /// Runs the TLS handshake over `stream` (after the server said 'S' to an
    /// SSLRequest) for the server `host` (the host name, not hostaddr, as
    /// libpq checks it).
    pub async fn handshake<S>(
        &self,
        host: &str,
        stream: S,
    ) -> Result<tokio_rustls::client::TlsStream<S>, TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let Some(client) = &self.client else {
            return Err(TlsError::fatal(
                "TLS was not asked for (sslmode=disable)",
                "remove sslmode=disable from source.url",
            ));
        };
        let name = ServerName::try_from(host.to_string()).map_err(|_| {
            TlsError::fatal(
                format!("{host:?} cannot be used as a TLS server name"),
                "connect by a DNS name or an IP address",
            )
        })?;
        tokio_rustls::TlsConnector::from(client.clone())
            .connect(name, stream)
            .await
            .map_err(|e| TlsError::from_handshake(e, host, self))
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_roots(path: &Path) -> Result<RootCertStore, String> {
    let pem = std::fs::read(path)
        .map_err(|e| format!("cannot read sslrootcert {}: {e}", path.display()))?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| {
            format!(
                "sslrootcert {} is not a valid PEM file: {e}",
                path.display()
            )
        })?;
        roots.add(cert).map_err(|e| {
            format!(
                "sslrootcert {} holds a certificate that cannot be used as a CA: {e}",
                path.display()
            )
        })?;
    }
    if roots.is_empty() {
        return Err(format!(
            "sslrootcert {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    Ok(roots)
}

fn client_config(mode: SslMode, roots: Option<RootCertStore>) -> Result<ClientConfig, String> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?;
    let mut config = match roots {
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Lax::any_certificate(provider)))
            .with_no_client_auth(),
        Some(roots) => {
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| format!("TLS setup: {e}"))?;
            if mode == SslMode::VerifyFull {
                builder.with_webpki_verifier(webpki).with_no_client_auth()
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(Lax::chain_only(webpki, provider)))
                    .with_no_client_auth()
            }
        }
    };
    // What libpq 17 sends; required by servers that accept direct TLS, ignored by older ones.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(config)
}

mod connect;
mod error;
mod url;
mod verify;

pub(crate) use self::connect::MakeRustlsConnect;
pub(crate) use self::error::NEEDS_TLS_HINT;
pub(crate) use self::error::TlsError;
pub(crate) use self::url::extract;
use self::verify::Lax;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_and_their_checks() {
        assert!(
            extract("host=h sslmode=verify-full")
                .unwrap_err()
                .contains("sslrootcert")
        );
        assert!(
            extract("host=h sslmode=strict")
                .unwrap_err()
                .contains("verify-full")
        );
        let (_, tls) = extract("host=h").unwrap();
        assert_eq!(
            (tls.mode, tls.verification()),
            (SslMode::Prefer, Verification::None)
        );
        let (_, tls) = extract("host=h sslmode=disable").unwrap();
        assert_eq!(tls.mode, SslMode::Disable);
        let err = extract("host=h sslmode=require sslrootcert=/nonexistent/ca.pem").unwrap_err();
        assert!(
            err.contains("cannot read sslrootcert /nonexistent/ca.pem"),
            "{err}"
        );
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = extract(&format!("host=h sslrootcert={}", empty.display())).unwrap_err();
        assert!(err.contains("no PEM certificate"), "{err}");
    }
}
