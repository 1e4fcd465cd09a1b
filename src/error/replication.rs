//! What the replication connection and the pgoutput decoder fail with.
//!
//! The types live here, below the source that produces them, so that
//! [`super::Error::disposition`] and [`super::Error::hint`] can read a
//! SQLSTATE or a dropped connection without the error module importing the
//! source.

use crate::pgtls::TlsError;

/// Why the replication connection failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("I/O error on the replication connection: {0}")]
    Io(#[from] std::io::Error),
    /// TLS was refused: the certificate, or a server without TLS under
    /// `sslmode=require` or stricter. Retrying will not help.
    #[error("{}; hint: {}", .0.message, .0.hint)]
    Tls(TlsError),
    /// An ErrorResponse from the server. `code` is the SQLSTATE, e.g. 28P01 bad
    /// password, 42704 missing slot, 55006 slot in use, 42501 no permission.
    #[error("server error: {severity}: {message} (SQLSTATE {code}){}{}",
        .detail.as_deref().map(|d| format!("; detail: {d}")).unwrap_or_default(),
        .hint.as_deref().map(|h| format!("; hint: {h}")).unwrap_or_default())]
    Server {
        severity: String,
        code: String,
        message: String,
        detail: Option<String>,
        hint: Option<String>,
    },
    /// Something the configuration or the server asks for that this module does
    /// not implement (TLS, an authentication method, ...), or a configuration
    /// that cannot work at all (no host, no password). Retrying will not help.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The server sent something this module did not expect at that point.
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("connection closed by the server")]
    Closed,
}

impl ReplicationError {
    /// The SQLSTATE of a server error, `None` for every other kind.
    pub fn code(&self) -> Option<&str> {
        match self {
            ReplicationError::Server { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// Why a pgoutput message could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("pgoutput message is truncated: it ends before the {what}")]
    Truncated { what: &'static str },
    #[error("unknown pgoutput message tag {:?} (0x{:02x})", char::from(*.0), .0)]
    UnknownMessage(u8),
    #[error("unknown tuple column kind {:?} (0x{:02x}); expected 'n', 'u', 't' or 'b'", char::from(*.0), .0)]
    UnknownTupleKind(u8),
    #[error("unexpected tuple marker {:?} (0x{found:02x}) in {context}", char::from(*.found))]
    UnexpectedTupleMarker { context: &'static str, found: u8 },
    #[error("the {what} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str },
    #[error("negative length {len} for the {what}")]
    NegativeLength { what: &'static str, len: i32 },
    #[error("{count} unexpected byte(s) after the end of a {message} message")]
    TrailingBytes { message: &'static str, count: usize },
}
