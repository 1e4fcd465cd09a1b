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

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

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
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth(),
        Some(roots) => {
            let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("TLS setup: {e}"))?;
            if mode == SslMode::VerifyFull {
                builder.with_webpki_verifier(webpki).with_no_client_auth()
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
                    .with_no_client_auth()
            }
        }
    };
    // What libpq 17 sends; required by servers that accept direct TLS, ignored by older ones.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(config)
}

/// verify-ca: the chain must lead to a trusted CA; the host name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            // webpki checks the chain (and validity dates) before the name, so a
            // name error means everything else passed.
            Err(rustls::Error::InvalidCertificate(
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
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// require/prefer without sslrootcert: any certificate, but the handshake
/// must be signed by its key.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

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

    fn from_handshake(err: io::Error, host: &str, settings: &TlsSettings) -> TlsError {
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

// ---- the tokio-postgres connector ----

/// The TLS connector tokio-postgres uses for the SQL connections.
#[derive(Clone)]
pub struct MakeRustlsConnect {
    settings: TlsSettings,
}

impl<S> MakeTlsConnect<S> for MakeRustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = TlsError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, TlsError> {
        Ok(RustlsConnect {
            settings: self.settings.clone(),
            host: domain.to_string(),
        })
    }
}

/// One connection's TLS handshake (see [`MakeRustlsConnect`]).
pub struct RustlsConnect {
    settings: TlsSettings,
    host: String,
}

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = TlsError;
    type Future = BoxFuture<'static, Result<RustlsStream<S>, TlsError>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            self.settings
                .handshake(&self.host, stream)
                .await
                .map(RustlsStream)
        })
    }
}

/// A TLS session on a tokio-postgres socket.
pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        // SCRAM channel binding (tls-server-end-point) is not offered; SCRAM
        // still authenticates the server, and the certificate checks above apply.
        ChannelBinding::none()
    }
}

// ---- taking sslmode and sslrootcert out of the connection string ----

/// Splits `url` into the connection string tokio-postgres can parse (without
/// `sslmode` and `sslrootcert`) and the TLS settings they gave (default
/// `prefer`). Works on both the URL form (`postgres://...?sslmode=...`) and
/// the key=value form (`host=... sslmode=...`). The CA file is read here.
pub(crate) fn extract(url: &str) -> Result<(String, TlsSettings), String> {
    let (rest, mode, root) = split_tls_params(url)?;
    let mode = match mode {
        None => SslMode::Prefer,
        Some(m) => SslMode::parse(&m).ok_or_else(|| {
            format!(
                "sslmode={m} is not valid: use disable, allow, prefer, require, verify-ca or verify-full"
            )
        })?,
    };
    let root = match root {
        Some(r) if r.is_empty() => {
            return Err("sslrootcert is empty: give the path of the CA certificate (PEM)".into());
        }
        Some(r) if r == "system" => {
            return Err(
                "sslrootcert=system is not supported: give the path of the CA certificate (PEM)"
                    .into(),
            );
        }
        Some(r) => Some(PathBuf::from(r)),
        None => None,
    };
    Ok((rest, TlsSettings::new(mode, root)?))
}

type Split = (String, Option<String>, Option<String>);

fn split_tls_params(url: &str) -> Result<Split, String> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        split_url(url)
    } else {
        split_key_value(url)
    }
}

fn split_url(url: &str) -> Result<Split, String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), None, None));
    };
    let (mut mode, mut root) = (None, None);
    let mut kept = Vec::new();
    for part in query.split('&') {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        match percent_decode(k)?.as_str() {
            "sslmode" => mode = Some(percent_decode(v)?),
            "sslrootcert" => root = Some(percent_decode(v)?),
            _ => kept.push(part),
        }
    }
    let rest = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, mode, root))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent-encoding in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once decoded"))
}

/// key=value form, with libpq's quoting: `key = 'a \'quoted\' value'`.
fn split_key_value(s: &str) -> Result<Split, String> {
    let (mut mode, mut root) = (None, None);
    let mut kept = Vec::new();
    let mut chars = s.char_indices().peekable();
    loop {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, _)) = chars.peek() else {
            break;
        };
        let mut key = String::new();
        while let Some((_, c)) = chars.next_if(|(_, c)| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        if chars.next_if(|(_, c)| *c == '=').is_none() {
            // Not key=value: leave it to tokio-postgres to report.
            return Ok((s.to_string(), None, None));
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if(|(_, c)| *c == '\'').is_some() {
            loop {
                match chars.next() {
                    None => return Ok((s.to_string(), None, None)),
                    Some((_, '\'')) => break,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, c)) => value.push(c),
                        None => return Ok((s.to_string(), None, None)),
                    },
                    Some((_, c)) => value.push(c),
                }
            }
        } else {
            while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some((_, c)) = chars.next() {
                        value.push(c);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        let end = chars.peek().map_or(s.len(), |&(i, _)| i);
        match key.as_str() {
            "sslmode" => mode = Some(value),
            "sslrootcert" => root = Some(value),
            _ => kept.push(&s[start..end]),
        }
    }
    Ok((kept.join(" "), mode, root))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_form_loses_only_the_tls_keys() {
        let (rest, mode, root) = split_tls_params(
            "postgres://u@h:5/db?application_name=x&sslmode=verify-full&sslrootcert=%2Ftmp%2Fca%20x.pem&connect_timeout=3",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u@h:5/db?application_name=x&connect_timeout=3"
        );
        assert_eq!(mode.as_deref(), Some("verify-full"));
        assert_eq!(root.as_deref(), Some("/tmp/ca x.pem"));
        let (rest, mode, _) = split_tls_params("postgres://u@h/db?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://u@h/db");
        assert_eq!(mode.as_deref(), Some("require"));
        let (rest, mode, _) = split_tls_params("postgresql://u@h/db").unwrap();
        assert_eq!((rest.as_str(), mode), ("postgresql://u@h/db", None));
    }

    #[test]
    fn key_value_form_with_quotes() {
        let (rest, mode, root) = split_tls_params(
            r"host=h sslmode = verify-ca dbname=d sslrootcert='/a b/it\'s.pem' user=u",
        )
        .unwrap();
        assert_eq!(rest, "host=h dbname=d user=u");
        assert_eq!(mode.as_deref(), Some("verify-ca"));
        assert_eq!(root.as_deref(), Some("/a b/it's.pem"));
        let parsed: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(parsed.get_dbname(), Some("d"));
    }

    #[test]
    fn presented_names_are_plain() {
        assert_eq!(presented_name("DnsName(\"localhost\")"), "localhost");
        assert_eq!(presented_name("IpAddress(127.0.0.1)"), "127.0.0.1");
        assert_eq!(presented_name("DirectoryName"), "DirectoryName");
    }

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
