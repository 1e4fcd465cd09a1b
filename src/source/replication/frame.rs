//! The wire under the replication connection: the byte stream split into
//! backend messages (frames), with a bound on their size and a buffer that
//! makes reading cancel-safe; frontend bytes written so that a dropped
//! future leaves no half message; and the ErrorResponse and NoticeResponse
//! fields that every phase (startup, queries, streaming) reads alike.

use bytes::{Buf, BytesMut};
use postgres_protocol::message::backend::{ErrorFields, Message};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
// Re-exported by tokio-postgres; the backend parsers' iterators implement it.
use tokio_postgres::fallible_iterator::FallibleIterator;

use crate::error::ReplicationError;

/// Largest frame accepted. The server builds every message in a StringInfo,
/// which is capped at MaxAllocSize (1 GiB - 1), so anything bigger is a corrupt
/// length rather than data; the slack covers the message headers.
pub const MAX_FRAME_LEN: usize = (1 << 30) + (1 << 16);

/// Minimum free space before each read, so one syscall can carry hundreds of
/// small XLogData messages.
pub const READ_CHUNK: usize = 64 * 1024;

impl ReplicationError {
    /// The error that an ErrorResponse's (or a NoticeResponse's) fields describe.
    pub(crate) fn from_fields(mut fields: ErrorFields<'_>) -> Self {
        let mut severity_localized = None;
        let mut severity = None;
        let mut code = String::new();
        let mut message = String::new();
        let mut detail = None;
        let mut hint = None;
        // Field values are in the server encoding; lossy decoding keeps a
        // broken byte from hiding the actual error.
        while let Ok(Some(field)) = fields.next() {
            let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
            match field.type_() {
                b'S' => severity_localized = Some(value),
                b'V' => severity = Some(value),
                b'C' => code = value,
                b'M' => message = value,
                b'D' => detail = Some(value),
                b'H' => hint = Some(value),
                _ => {}
            }
        }
        ReplicationError::Server {
            // 'V' is never translated, so prefer it for anything that matches on it.
            severity: severity.or(severity_localized).unwrap_or_default(),
            code,
            message,
            detail,
            hint,
        }
    }
}

pub(crate) fn log_notice(fields: ErrorFields<'_>) {
    if let ReplicationError::Server {
        severity,
        code,
        message,
        ..
    } = ReplicationError::from_fields(fields)
    {
        tracing::info!(%severity, %code, "server notice: {message}");
    }
}

pub(crate) type BoxedRead = Box<dyn AsyncRead + Send + Unpin>;
pub(crate) type BoxedWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// One backend message, header included (`postgres_protocol` parsers expect
/// the header).
pub(crate) struct Frame {
    pub(crate) tag: u8,
    pub(crate) raw: BytesMut,
}

impl Frame {
    pub(crate) fn parse(self) -> Result<Message, ReplicationError> {
        let tag = self.tag;
        let mut raw = self.raw;
        match Message::parse(&mut raw) {
            Ok(Some(msg)) => Ok(msg),
            Ok(None) => Err(ReplicationError::Protocol(format!(
                "incomplete message with tag {:?}",
                tag as char
            ))),
            Err(e) => Err(ReplicationError::Protocol(format!(
                "cannot parse message with tag {:?}: {e}",
                tag as char
            ))),
        }
    }

    pub(crate) fn body(&self) -> &[u8] {
        &self.raw[5..]
    }
}

/// Splits the byte stream into frames. All state lives in `buf`, which is what
/// makes `next_frame` cancel-safe.
pub(crate) struct FrameReader {
    rd: BoxedRead,
    pub(crate) buf: BytesMut,
}

impl FrameReader {
    pub(crate) fn new(rd: BoxedRead) -> Self {
        FrameReader {
            rd,
            buf: BytesMut::with_capacity(READ_CHUNK),
        }
    }

    fn try_frame(&mut self) -> Result<Option<Frame>, ReplicationError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let tag = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len < 4 {
            return Err(ReplicationError::Protocol(format!(
                "invalid length {len} in message with tag {:?}",
                tag as char
            )));
        }
        if len > MAX_FRAME_LEN {
            return Err(ReplicationError::Protocol(format!(
                "message with tag {:?} announces {len} bytes, more than the {MAX_FRAME_LEN} allowed",
                tag as char
            )));
        }
        let total = len + 1;
        if self.buf.len() < total {
            // Reserve the whole frame at once so a large frame is not read
            // through a series of reallocations.
            self.buf.reserve(total - self.buf.len());
            return Ok(None);
        }
        Ok(Some(Frame {
            tag,
            raw: self.buf.split_to(total),
        }))
    }

    /// Whether a whole frame is already in the buffer (the next read will not
    /// wait for the network).
    pub(crate) fn has_frame(&self) -> bool {
        self.buf.len() >= 5
            && self.buf.len()
                > u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize
    }

    pub(crate) async fn next_frame(&mut self) -> Result<Frame, ReplicationError> {
        loop {
            if let Some(frame) = self.try_frame()? {
                return Ok(frame);
            }
            if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
                self.buf.reserve(READ_CHUNK);
            }
            // Cancel-safe: read_buf either appends to self.buf or does nothing.
            let n = self.rd.read_buf(&mut self.buf).await?;
            if n == 0 {
                if self.buf.is_empty() {
                    return Err(ReplicationError::Closed);
                }
                return Err(ReplicationError::Protocol(format!(
                    "connection closed in the middle of a message ({} bytes pending)",
                    self.buf.len()
                )));
            }
        }
    }
}

pub(crate) fn unexpected(phase: &str, tag: u8) -> ReplicationError {
    ReplicationError::Protocol(format!(
        "unexpected message with tag {:?} during {phase}",
        tag as char
    ))
}

pub(crate) async fn write_pending(
    writer: &mut BoxedWrite,
    out: &mut BytesMut,
) -> Result<(), ReplicationError> {
    // write_buf advances `out` only by what was written, so a dropped future
    // leaves the unsent tail in `out` for the next call.
    while out.has_remaining() {
        let n = writer.write_buf(out).await?;
        if n == 0 {
            return Err(ReplicationError::Closed);
        }
    }
    writer.flush().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_display_and_code() {
        let e = ReplicationError::Server {
            severity: "FATAL".into(),
            code: "28P01".into(),
            message: "password authentication failed".into(),
            detail: None,
            hint: Some("check it".into()),
        };
        assert_eq!(e.code(), Some("28P01"));
        assert_eq!(
            e.to_string(),
            "server error: FATAL: password authentication failed (SQLSTATE 28P01); hint: check it"
        );
        assert_eq!(ReplicationError::Closed.code(), None);
    }
}
