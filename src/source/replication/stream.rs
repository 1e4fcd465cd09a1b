//! Streaming: the walsender's CopyData messages (XLogData and keepalives)
//! read from the receiving half, and standby status updates written by the
//! sending half, which is what releases WAL on the server.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use tokio::io::AsyncWriteExt;

use super::frame::{BoxedWrite, FrameReader, log_notice, unexpected, write_pending};
use crate::error::ReplicationError;
use crate::pgtime;

/// One message from the walsender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage {
    /// WAL data: for logical replication, one output plugin message (for
    /// pgoutput the first byte is its type: b'B', b'R', b'I', b'C', ...).
    XLogData {
        /// The LSN where this message's WAL data starts.
        wal_start: u64,
        /// The current end of WAL on the server.
        wal_end: u64,
        /// The server's clock when it sent the message, microseconds since
        /// 2000-01-01 UTC.
        server_clock: i64,
        /// The output plugin's message, undecoded.
        data: Bytes,
    },
    /// Primary keepalive. If `reply_requested`, send a status update soon or
    /// the server drops the connection after `wal_sender_timeout`.
    Keepalive {
        /// The current end of WAL on the server.
        wal_end: u64,
        /// The server's clock when it sent the keepalive, microseconds since
        /// 2000-01-01 UTC.
        server_clock: i64,
        /// The server asks for a status update at once.
        reply_requested: bool,
    },
}

/// Receiving half of a streaming replication connection.
pub struct ReplicationStream {
    pub(super) reader: FrameReader,
    pub(super) ended: bool,
}

impl std::fmt::Debug for ReplicationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationStream")
            .field("buffered", &self.reader.buf.len())
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl ReplicationStream {
    /// Whether the next message has already been received, so [`Self::next`]
    /// returns without waiting for the network.
    pub fn has_buffered(&self) -> bool {
        self.reader.has_frame()
    }

    /// Next message; `Ok(None)` once the server has ended the copy (CopyDone,
    /// CommandComplete, ReadyForQuery) and on every call after that.
    ///
    /// Cancel-safe: dropping the future (e.g. in `tokio::select!`) loses
    /// nothing, as partial frames stay in the stream's buffer.
    pub async fn next(&mut self) -> Result<Option<ReplicationMessage>, ReplicationError> {
        loop {
            let frame = match self.reader.next_frame().await {
                Ok(frame) => frame,
                // After the server's CopyDone, closing the socket is the normal
                // end of the conversation.
                Err(ReplicationError::Closed) if self.ended => return Ok(None),
                Err(e) => return Err(e),
            };
            match frame.tag {
                b'd' => {
                    if let Some(msg) = parse_copy_data(frame.raw.freeze())? {
                        return Ok(Some(msg));
                    }
                }
                b'c' | b'C' | b'Z' => {
                    self.ended = true;
                    return Ok(None);
                }
                tag => match frame.parse()? {
                    Message::ErrorResponse(body) => {
                        return Err(ReplicationError::from_fields(body.fields()));
                    }
                    Message::NoticeResponse(body) => log_notice(body.fields()),
                    Message::ParameterStatus(body) => {
                        if let (Ok(name), Ok(value)) = (body.name(), body.value()) {
                            tracing::debug!(name, value, "parameter status during replication");
                        }
                    }
                    _ => return Err(unexpected("replication", tag)),
                },
            }
        }
    }
}

/// Decodes one CopyData frame (header included). Unknown sub-messages are
/// skipped so a newer server cannot break the stream with an addition.
fn parse_copy_data(raw: Bytes) -> Result<Option<ReplicationMessage>, ReplicationError> {
    let mut body = raw.slice(5..);
    if body.is_empty() {
        return Err(ReplicationError::Protocol("empty CopyData".into()));
    }
    match body[0] {
        b'w' => {
            if body.len() < 25 {
                return Err(ReplicationError::Protocol(format!(
                    "XLogData header truncated ({} bytes)",
                    body.len()
                )));
            }
            body.advance(1);
            let wal_start = body.get_u64();
            let wal_end = body.get_u64();
            let server_clock = body.get_i64();
            Ok(Some(ReplicationMessage::XLogData {
                wal_start,
                wal_end,
                server_clock,
                data: body,
            }))
        }
        b'k' => {
            if body.len() < 18 {
                return Err(ReplicationError::Protocol(format!(
                    "keepalive truncated ({} bytes)",
                    body.len()
                )));
            }
            body.advance(1);
            let wal_end = body.get_u64();
            let server_clock = body.get_i64();
            let reply_requested = body.get_u8() != 0;
            Ok(Some(ReplicationMessage::Keepalive {
                wal_end,
                server_clock,
                reply_requested,
            }))
        }
        other => {
            tracing::warn!(kind = ?(other as char), "skipping unknown replication message");
            Ok(None)
        }
    }
}

/// Sending half: standby status updates and the graceful end of streaming.
pub struct FeedbackSender {
    pub(super) writer: BoxedWrite,
    pub(super) out: BytesMut,
}

impl std::fmt::Debug for FeedbackSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeedbackSender")
            .field("pending", &self.out.len())
            .finish_non_exhaustive()
    }
}

impl FeedbackSender {
    /// Sends a standby status update with write = flush = apply = `lsn`. The
    /// flush position is what advances the slot's `confirmed_flush_lsn`, so
    /// only pass an LSN whose data is durably archived.
    pub async fn send_status(
        &mut self,
        lsn: u64,
        reply_requested: bool,
    ) -> Result<(), ReplicationError> {
        encode_status(lsn, pgtime::now_micros(), reply_requested, &mut self.out);
        write_pending(&mut self.writer, &mut self.out).await
    }

    /// Ends streaming gracefully: CopyDone, then Terminate, then shuts down the
    /// write half.
    pub async fn close(mut self) -> Result<(), ReplicationError> {
        frontend::copy_done(&mut self.out);
        frontend::terminate(&mut self.out);
        write_pending(&mut self.writer, &mut self.out).await?;
        self.writer.shutdown().await?;
        Ok(())
    }
}

fn encode_status(lsn: u64, clock: i64, reply_requested: bool, out: &mut BytesMut) {
    const BODY_LEN: usize = 1 + 8 + 8 + 8 + 8 + 1;
    out.reserve(1 + 4 + BODY_LEN);
    out.put_u8(b'd');
    out.put_u32((4 + BODY_LEN) as u32);
    out.put_u8(b'r');
    out.put_u64(lsn);
    out.put_u64(lsn);
    out.put_u64(lsn);
    out.put_i64(clock);
    out.put_u8(u8::from(reply_requested));
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncRead, AsyncReadExt, DuplexStream};

    use super::*;

    fn stream_over(rd: DuplexStream) -> ReplicationStream {
        ReplicationStream {
            reader: FrameReader::new(Box::new(rd)),
            ended: false,
        }
    }

    fn xlogdata_frame(wal_start: u64, payload: &[u8]) -> Vec<u8> {
        let mut v = vec![b'd'];
        v.extend_from_slice(&((4 + 25 + payload.len()) as u32).to_be_bytes());
        v.push(b'w');
        v.extend_from_slice(&wal_start.to_be_bytes());
        v.extend_from_slice(&(wal_start + 100).to_be_bytes());
        v.extend_from_slice(&42i64.to_be_bytes());
        v.extend_from_slice(payload);
        v
    }

    /// A reader that hands out `data` in pieces of the given sizes (then
    /// whatever is left), as a socket delivers a stream in reads.
    struct Pieces {
        data: Bytes,
        sizes: Vec<usize>,
    }

    impl AsyncRead for Pieces {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let me = &mut *self;
            let size = me.sizes.pop().unwrap_or(usize::MAX).max(1);
            let n = size.min(me.data.len()).min(buf.remaining());
            buf.put_slice(&me.data.split_to(n));
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// What the walsender sends during streaming, with the messages the
    /// stream must give for it (ParameterStatus, notices and unknown
    /// CopyData kinds give none).
    fn arb_conversation()
    -> impl proptest::strategy::Strategy<Value = (Vec<u8>, Vec<ReplicationMessage>)> {
        use proptest::prelude::*;
        let item = prop_oneof![
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..40)).prop_map(|(at, p)| {
                let msg = ReplicationMessage::XLogData {
                    wal_start: at,
                    wal_end: at.wrapping_add(100),
                    server_clock: 42,
                    data: Bytes::from(p.clone()),
                };
                (xlogdata_frame(at, &p), Some(msg))
            }),
            (any::<u64>(), any::<i64>(), any::<bool>()).prop_map(|(end, clock, reply)| {
                let mut v = vec![b'd', 0, 0, 0, 22, b'k'];
                v.extend_from_slice(&end.to_be_bytes());
                v.extend_from_slice(&clock.to_be_bytes());
                v.push(u8::from(reply));
                let msg = ReplicationMessage::Keepalive {
                    wal_end: end,
                    server_clock: clock,
                    reply_requested: reply,
                };
                (v, Some(msg))
            }),
            Just((vec![b'S', 0, 0, 0, 8, b'a', 0, b'b', 0], None)),
            Just((
                vec![
                    b'N', 0, 0, 0, 14, b'S', b'N', b'O', b'T', b'E', 0, b'M', b'x', 0, 0
                ],
                None
            )),
            Just((vec![b'd', 0, 0, 0, 6, b'x', 1], None)),
        ];
        (proptest::collection::vec(item, 0..8), any::<bool>()).prop_map(|(items, done)| {
            let mut bytes = Vec::new();
            let mut msgs = Vec::new();
            for (frame, msg) in items {
                bytes.extend(frame);
                msgs.extend(msg);
            }
            if done {
                bytes.extend_from_slice(&[b'c', 0, 0, 0, 4]);
            }
            (bytes, msgs)
        })
    }

    /// Every message of `bytes` read in pieces of `sizes`, until the end
    /// or the first error.
    fn read_all(
        bytes: Vec<u8>,
        sizes: Vec<usize>,
    ) -> (Vec<ReplicationMessage>, Option<ReplicationError>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut stream = ReplicationStream {
                reader: FrameReader::new(Box::new(Pieces {
                    data: Bytes::from(bytes),
                    sizes,
                })),
                ended: false,
            };
            let mut got = Vec::new();
            loop {
                match stream.next().await {
                    Ok(Some(m)) => got.push(m),
                    Ok(None) => return (got, None),
                    Err(e) => return (got, Some(e)),
                }
            }
        })
    }

    proptest::proptest! {
        #![proptest_config(crate::fuzzing::config(256))]

        /// The framing's fuzz campaign (see `crate::fuzzing`): a
        /// conversation read in pieces of any size gives its messages,
        /// whatever the pieces; with a fuzzer's edits it ends (an error,
        /// or the end) without a panic, and what it gave before is a
        /// whole message each.
        #[test]
        fn fuzz_framing(
            (bytes, msgs) in arb_conversation(),
            sizes in proptest::collection::vec(1..64usize, 0..64),
            edits in crate::fuzzing::edits(),
        ) {
            let ended = bytes.ends_with(&[b'c', 0, 0, 0, 4]);
            let (got, err) = read_all(bytes.clone(), sizes.clone());
            proptest::prop_assert_eq!(&got, &msgs);
            // The end of the copy ends it; a socket closed without it is
            // the end only once the server said so.
            proptest::prop_assert_eq!(err.is_some(), !ended, "{:?}", err);
            let edited = crate::fuzzing::apply(&bytes, &edits);
            let (got, _) = read_all(edited.clone(), sizes);
            // Every message took a frame of at least 5 bytes.
            proptest::prop_assert!(got.len() * 5 <= edited.len());
        }
    }

    #[test]
    fn status_update_layout() {
        let mut out = BytesMut::new();
        encode_status(0x0102_0304_0506_0708, -5, true, &mut out);
        assert_eq!(out.len(), 1 + 4 + 34);
        assert_eq!(out[0], b'd');
        assert_eq!(&out[1..5], &38u32.to_be_bytes());
        assert_eq!(out[5], b'r');
        for i in 0..3 {
            let at = 6 + 8 * i;
            assert_eq!(&out[at..at + 8], &0x0102_0304_0506_0708u64.to_be_bytes());
        }
        assert_eq!(&out[30..38], &(-5i64).to_be_bytes());
        assert_eq!(out[38], 1);
    }

    #[tokio::test]
    async fn oversized_frame_is_rejected_without_allocating() {
        let (mut wr, rd) = tokio::io::duplex(64);
        let mut stream = stream_over(rd);
        wr.write_all(&[b'd', 0x7f, 0xff, 0xff, 0xff]).await.unwrap();
        let err = stream.next().await.unwrap_err();
        assert!(matches!(err, ReplicationError::Protocol(_)), "{err}");
        assert!(stream.reader.buf.capacity() < 1 << 20);
    }

    #[tokio::test]
    async fn parses_messages_and_end_of_copy() {
        let (mut wr, rd) = tokio::io::duplex(1 << 16);
        let mut stream = stream_over(rd);
        let mut bytes = xlogdata_frame(7, b"Bxyz");
        // Keepalive with reply requested.
        bytes.extend_from_slice(&[b'd', 0, 0, 0, 22, b'k']);
        bytes.extend_from_slice(&9u64.to_be_bytes());
        bytes.extend_from_slice(&3i64.to_be_bytes());
        bytes.push(1);
        // ParameterStatus is skipped.
        bytes.extend_from_slice(&[b'S', 0, 0, 0, 8, b'a', 0, b'b', 0]);
        bytes.extend_from_slice(&[b'c', 0, 0, 0, 4]);
        wr.write_all(&bytes).await.unwrap();
        drop(wr);

        assert_eq!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::XLogData {
                wal_start: 7,
                wal_end: 107,
                server_clock: 42,
                data: Bytes::from_static(b"Bxyz"),
            })
        );
        assert_eq!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::Keepalive {
                wal_end: 9,
                server_clock: 3,
                reply_requested: true
            })
        );
        assert_eq!(stream.next().await.unwrap(), None);
        // EOF after the server's CopyDone is a normal end, repeatedly.
        assert_eq!(stream.next().await.unwrap(), None);
    }

    #[tokio::test]
    async fn error_response_and_unexpected_eof() {
        let (mut wr, rd) = tokio::io::duplex(1 << 16);
        let mut stream = stream_over(rd);
        let mut body = Vec::new();
        for (t, v) in [
            (b'S', "ERREUR"),
            (b'V', "ERROR"),
            (b'C', "55006"),
            (b'M', "busy"),
        ] {
            body.push(t);
            body.extend_from_slice(v.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut bytes = vec![b'E'];
        bytes.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        bytes.extend_from_slice(&body);
        wr.write_all(&bytes).await.unwrap();
        let err = stream.next().await.unwrap_err();
        assert_eq!(err.code(), Some("55006"));
        assert!(
            err.to_string().starts_with("server error: ERROR: busy"),
            "{err}"
        );
        drop(wr);
        assert!(matches!(stream.next().await, Err(ReplicationError::Closed)));
    }

    /// Feeds frames one byte at a time while cancelling `next()` whenever it
    /// would block: every message must still arrive intact and in order.
    #[tokio::test]
    async fn next_is_cancel_safe_with_split_frames() {
        let (mut wr, rd) = tokio::io::duplex(3);
        let mut stream = stream_over(rd);
        const N: u64 = 300;
        let writer = tokio::spawn(async move {
            for i in 0..N {
                let frame = xlogdata_frame(i, format!("I{i}").as_bytes());
                for b in frame {
                    wr.write_all(&[b]).await.unwrap();
                    tokio::task::yield_now().await;
                }
            }
            wr.write_all(&[b'c', 0, 0, 0, 4]).await.unwrap();
        });
        let mut got = 0u64;
        let mut cancelled = 0u64;
        loop {
            tokio::select! {
                biased;
                msg = stream.next() => match msg.unwrap() {
                    Some(ReplicationMessage::XLogData { wal_start, data, .. }) => {
                        assert_eq!(wal_start, got);
                        assert_eq!(data, Bytes::from(format!("I{got}")));
                        got += 1;
                    }
                    Some(other) => panic!("unexpected {other:?}"),
                    None => break,
                },
                // Completes on its second poll: when the stream is still
                // pending then, its next() future is dropped mid-frame.
                _ = tokio::task::yield_now() => {
                    cancelled += 1;
                }
            }
        }
        writer.await.unwrap();
        assert_eq!(got, N);
        assert!(
            cancelled > N,
            "cancellation was not exercised ({cancelled})"
        );
    }

    /// The source sends the events of every message already received as
    /// one batch: `has_buffered` must say yes exactly while a whole frame
    /// waits, never for a partial one (that would wait on the network).
    #[tokio::test]
    async fn has_buffered_is_true_only_for_whole_received_frames() {
        let (mut wr, rd) = tokio::io::duplex(1 << 16);
        let mut stream = stream_over(rd);
        assert!(!stream.has_buffered());
        let mut two = xlogdata_frame(1, b"I1");
        two.extend(xlogdata_frame(2, b"I2"));
        let second = xlogdata_frame(3, b"I3");
        two.extend_from_slice(&second[..10]);
        wr.write_all(&two).await.unwrap();
        // One read takes all three (the last one cut short).
        assert!(matches!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::XLogData { wal_start: 1, .. })
        ));
        assert!(stream.has_buffered());
        assert!(matches!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::XLogData { wal_start: 2, .. })
        ));
        assert!(!stream.has_buffered(), "a partial frame is not a message");
        wr.write_all(&second[10..]).await.unwrap();
        assert!(matches!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::XLogData { wal_start: 3, .. })
        ));
        assert!(!stream.has_buffered());
    }

    #[tokio::test]
    async fn send_status_and_close_write_expected_bytes() {
        let (wr, mut rd) = tokio::io::duplex(1 << 16);
        let mut sender = FeedbackSender {
            writer: Box::new(wr),
            out: BytesMut::new(),
        };
        sender.send_status(0x10, false).await.unwrap();
        sender.close().await.unwrap();
        let mut all = Vec::new();
        rd.read_to_end(&mut all).await.unwrap();
        assert_eq!(all.len(), 39 + 5 + 5);
        assert_eq!(&all[6..14], &0x10u64.to_be_bytes());
        assert_eq!(&all[39..], &[b'c', 0, 0, 0, 4, b'X', 0, 0, 0, 4]);
    }
}
