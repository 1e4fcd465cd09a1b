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
    /// No TCP (or Unix socket) connection to the server could be opened.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address tried, `host:port` or the socket's path.
        addr: String,
        /// The operating system's error (refused, timed out, no route).
        source: std::io::Error,
    },
    /// Reading or writing an open connection failed (usually it dropped);
    /// retried.
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
        /// The ErrorResponse's `S` field: `ERROR`, `FATAL` or `PANIC`.
        severity: String,
        /// The `C` field, the SQLSTATE.
        code: String,
        /// The `M` field, the primary message.
        message: String,
        /// The `D` field, a secondary message with details, if sent.
        detail: Option<String>,
        /// The `H` field, the server's suggestion, if sent.
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
    /// The server closed the connection (end of stream) without an error;
    /// retried.
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
    /// The message ended before a field it must have.
    #[error("pgoutput message is truncated: it ends before the {what}")]
    Truncated {
        /// The field that was missing, e.g. `relation id`.
        what: &'static str,
    },
    /// The message's first byte names no message type we know (a newer
    /// protocol version, or a corrupt stream).
    #[error("unknown pgoutput message tag {:?} (0x{:02x})", char::from(*.0), .0)]
    UnknownMessage(u8),
    /// A TupleData column's kind byte is none of `n` (null), `u` (unchanged
    /// TOAST), `t` (text) or `b` (binary); the byte is given.
    #[error("unknown tuple column kind {:?} (0x{:02x}); expected 'n', 'u', 't' or 'b'", char::from(*.0), .0)]
    UnknownTupleKind(u8),
    /// An Insert, Update or Delete has a byte other than `K`, `O` or `N`
    /// where a tuple must start.
    #[error("unexpected tuple marker {:?} (0x{found:02x}) in {context}", char::from(*.found))]
    UnexpectedTupleMarker {
        /// The message and the markers it allows there.
        context: &'static str,
        /// The byte found instead.
        found: u8,
    },
    /// A string (a name, a column's text value) is not UTF-8, though the
    /// connection asks for UTF-8 (`client_encoding`).
    #[error("the {what} is not valid UTF-8")]
    InvalidUtf8 {
        /// The field, e.g. `column name`.
        what: &'static str,
    },
    /// A length prefix (Int32) is negative where only a length can stand.
    #[error("negative length {len} for the {what}")]
    NegativeLength {
        /// The field whose length it is.
        what: &'static str,
        /// The length sent.
        len: i32,
    },
    /// Bytes remain after a message's last field: the format is not the
    /// one we decode (another protocol version), so we refuse to guess.
    #[error("{count} unexpected byte(s) after the end of a {message} message")]
    TrailingBytes {
        /// The message type, e.g. `Commit`.
        message: &'static str,
        /// How many bytes were left over.
        count: usize,
    },
}
