//! The certificate checks libpq makes below `verify-full` (which is
//! rustls's own WebPKI verifier): `verify-ca` checks the chain but not the
//! host name, and `require`/`prefer` without `sslrootcert` accept any
//! certificate. In both, the handshake must still be signed by the
//! certificate's key, so the session is encrypted to whoever holds it.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

/// A verifier laxer than WebPKI's, as libpq's modes below `verify-full` are.
#[derive(Debug)]
pub(super) struct Lax {
    /// `Some` for verify-ca: the chain must lead to a trusted CA (the host
    /// name is not checked). `None`: any certificate.
    chain: Option<Arc<WebPkiServerVerifier>>,
    /// The handshake signatures are checked with its algorithms, the same
    /// the WebPKI verifier was built with.
    provider: Arc<CryptoProvider>,
}

impl Lax {
    /// verify-ca: the chain is checked, the host name is not.
    pub(super) fn chain_only(
        chain: Arc<WebPkiServerVerifier>,
        provider: Arc<CryptoProvider>,
    ) -> Self {
        Lax {
            chain: Some(chain),
            provider,
        }
    }

    /// require/prefer without sslrootcert: any certificate.
    pub(super) fn any_certificate(provider: Arc<CryptoProvider>) -> Self {
        Lax {
            chain: None,
            provider,
        }
    }
}

impl ServerCertVerifier for Lax {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
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
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
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
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
