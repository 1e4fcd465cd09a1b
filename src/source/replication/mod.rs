//! A minimal PostgreSQL *replication* connection (`replication=database`),
//! speaking just enough of the frontend/backend protocol to stream logical
//! decoding output (`START_REPLICATION ... LOGICAL`) and send standby status
//! updates.
//!
//! tokio-postgres cannot do this: it never sends `replication=database` in the
//! startup packet and has no CopyBoth support. So this module drives the wire
//! protocol itself, reusing `postgres-protocol` for message encoding, the
//! parsing of well-known backend messages, and MD5/SCRAM authentication.
//!
//! Guarantees:
//! - [`ReplicationStream::next`] is cancel-safe: the only await point is a
//!   `read_buf` into a buffer owned by the stream, so partially received frames
//!   survive a dropped future and no message is lost or duplicated.
//! - [`FeedbackSender::send_status`] never leaves half a message on the wire if
//!   its future is dropped: unsent bytes are kept and sent first next time.
//! - A frame announcing more than [`MAX_FRAME_LEN`] bytes is rejected before
//!   anything is allocated for it.
//! - Server errors keep their SQLSTATE
//!   ([`ReplicationError::code`](crate::error::ReplicationError::code)) so
//!   callers can tell a bad password (28P01) from a missing slot (42704), a
//!   busy slot (55006) or a missing permission (42501).
//!
//! TLS: an SSLRequest on TCP unless `sslmode=disable`, then rustls over the
//! socket as [`TlsSettings`](crate::pgtls::TlsSettings) says (see
//! [`crate::pgtls`]); never on a Unix socket. Refusals are
//! [`ReplicationError::Tls`](crate::error::ReplicationError::Tls).
//!
//! Not implemented (reported as
//! [`ReplicationError::Unsupported`](crate::error::ReplicationError::Unsupported)):
//! channel binding, GSSAPI/SSPI/Kerberos authentication.
//!
//! `XLogData::data` is a zero-copy slice of the read buffer: holding one message
//! keeps its whole read chunk (up to [`READ_CHUNK`] bytes, or the frame) alive.
//!
//! The submodules follow a connection's life: [`frame`] is the wire (frames
//! in, bytes out, server errors), [`connect`] opens and authenticates,
//! [`command`] runs queries and `START_REPLICATION`, and [`stream`] holds the
//! two halves that streaming splits the connection into.

mod command;
mod connect;
mod frame;
mod stream;

pub use connect::{ConnectParams, ReplicationConnection};
pub use frame::{MAX_FRAME_LEN, READ_CHUNK};
pub use stream::{FeedbackSender, ReplicationMessage, ReplicationStream};
