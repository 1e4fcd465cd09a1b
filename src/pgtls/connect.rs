//! The tokio-postgres connector over rustls, for the SQL connections (the
//! replication connection does its own handshake with
//! [`super::TlsSettings::handshake`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

use super::{TlsError, TlsSettings};

/// The TLS connector tokio-postgres uses for the SQL connections.
#[derive(Clone)]
pub struct MakeRustlsConnect {
    pub(super) settings: TlsSettings,
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
