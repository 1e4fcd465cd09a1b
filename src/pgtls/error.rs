//! TLS failures worded for the operator: what went wrong (an unknown CA, a
//! name the certificate does not hold, a server that refuses TLS) and the
//! change to `source.url` that fixes it, and whether a retry can help.

use std::io;

use rustls::CertificateError;

use super::{SslMode, TlsSettings};

/// A TLS failure, worded for the operator, with what to do about it.
#[derive(Debug, Clone)]
pub struct TlsError {
    pub message: String,
    pub hint: String,
    /// True when retrying cannot help (a certificate or TLS refusal); false
    /// for a network error during the handshake.
    pub fatal: bool,
}

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for TlsError {}

/// The fix for a server that refused a plaintext session (pg_hba `hostssl`).
pub(crate) const NEEDS_TLS_HINT: &str = "the server requires TLS: set sslmode=require or stricter in source.url (e.g. ?sslmode=verify-full&sslrootcert=/path/to/ca.pem)";

impl TlsError {
    pub fn fatal(message: impl Into<String>, hint: impl Into<String>) -> TlsError {
        TlsError {
            message: message.into(),
            hint: hint.into(),
            fatal: true,
        }
    }

    /// The server answered 'N' to the SSLRequest under `mode`.
    pub fn not_supported(mode: SslMode) -> TlsError {
        TlsError::fatal(
            format!("the server does not support TLS (sslmode={mode})"),
            "turn TLS on in the server (ssl = on with ssl_cert_file and ssl_key_file in postgresql.conf), or lower sslmode in source.url to prefer",
        )
    }

    pub(super) fn from_handshake(err: io::Error, host: &str, settings: &TlsSettings) -> TlsError {
        match err
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>())
        {
            Some(e) => TlsError::from_rustls(e, host, settings),
            None => TlsError {
                message: format!("TLS handshake with {host} failed: {err}"),
                hint: "check that source.url points at Postgres and the network is stable".into(),
                fatal: false,
            },
        }
    }

    fn from_rustls(err: &rustls::Error, host: &str, settings: &TlsSettings) -> TlsError {
        let ca = settings
            .root_cert
            .as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        match err {
            rustls::Error::InvalidCertificate(cert) => match cert {
                CertificateError::UnknownIssuer
                | CertificateError::BadSignature
                | CertificateError::UnhandledCriticalExtension => TlsError::fatal(
                    format!(
                        "the server's certificate is not signed by the CA in sslrootcert ({ca})"
                    ),
                    "set sslrootcert in source.url to the CA certificate that signed the server's certificate",
                ),
                CertificateError::NotValidForNameContext { presented, .. } => TlsError::fatal(
                    format!(
                        "the certificate is for host {}, not {host}",
                        if presented.is_empty() {
                            "(none named)".to_string()
                        } else {
                            presented
                                .iter()
                                .map(|n| presented_name(n))
                                .collect::<Vec<_>>()
                                .join(", ")
                        }
                    ),
                    "connect to a host name the certificate names (source.url), or use sslmode=verify-ca to check the CA only",
                ),
                CertificateError::NotValidForName => TlsError::fatal(
                    format!("the certificate is not for host {host}"),
                    "connect to a host name the certificate names (source.url), or use sslmode=verify-ca to check the CA only",
                ),
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    TlsError::fatal(
                        "the server's certificate has expired",
                        "renew the server's certificate (ssl_cert_file) and reload Postgres",
                    )
                }
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    TlsError::fatal(
                        "the server's certificate is not valid yet",
                        "check the clocks of this machine and the server",
                    )
                }
                other => TlsError::fatal(
                    format!("the server's certificate was refused: {other:?}"),
                    "check the server's certificate and sslrootcert in source.url",
                ),
            },
            other => TlsError::fatal(
                format!("TLS handshake with {host} failed: {other}"),
                "check the server's TLS settings (ssl_min_protocol_version, certificate) and sslmode in source.url",
            ),
        }
    }
}

/// webpki describes a certificate's names as `DnsName("db.example")` and
/// `IpAddress(10.0.0.1)`; the operator wants the name.
fn presented_name(s: &str) -> &str {
    s.strip_prefix("DnsName(\"")
        .and_then(|r| r.strip_suffix("\")"))
        .or_else(|| {
            s.strip_prefix("IpAddress(")
                .and_then(|r| r.strip_suffix(')'))
        })
        .unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presented_names_are_plain() {
        assert_eq!(presented_name("DnsName(\"localhost\")"), "localhost");
        assert_eq!(presented_name("IpAddress(127.0.0.1)"), "127.0.0.1");
        assert_eq!(presented_name("DirectoryName"), "DirectoryName");
    }
}
