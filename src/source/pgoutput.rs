//! Decoder for the messages of the `pgoutput` logical replication plugin,
//! protocol versions 1 and 2 (PostgreSQL "Logical Replication Message
//! Formats"; version 2, asked for from PostgreSQL 14 on, adds the messages
//! of large transactions streamed while in progress, whose other messages
//! then carry the transaction id).
//!
//! [`decode`] takes the payload of one `XLogData` message and returns one
//! [`LogicalMessage`]. Guarantees:
//!
//! * It never panics, whatever the input bytes.
//! * A message is either decoded completely or rejected: a truncated message,
//!   an unknown tag, a negative length, invalid UTF-8 in a name, or bytes left
//!   over after the last field all return a [`DecodeError`]. Protocols 1 and
//!   2 define no optional trailing fields, so leftover bytes mean the framing
//!   is wrong and the row would be wrong too.
//! * Column values are zero-copy slices of the input [`Bytes`]; only names
//!   (relation, column, type, origin, message prefix) are copied into
//!   `String`s.
//! * Counts read from the wire never cause allocations larger than the
//!   remaining input could possibly describe.

use bytes::{Buf, Bytes};

use crate::error::DecodeError;
use crate::lsn::Lsn;

/// One decoded pgoutput message.
#[derive(Debug, Clone, PartialEq)]
pub enum LogicalMessage {
    /// `B`: a transaction starts; its changes follow, up to its Commit.
    Begin {
        /// The LSN of the transaction's commit record (known: pgoutput sends
        /// a transaction only once it has committed).
        final_lsn: Lsn,
        /// Microseconds since 2000-01-01 00:00:00 UTC.
        commit_ts: i64,
        /// The transaction's id.
        xid: u32,
    },
    /// `C`: the transaction that Begin opened is complete.
    Commit {
        /// Unused by the server; always 0.
        flags: u8,
        /// The LSN of the commit record.
        commit_lsn: Lsn,
        /// The LSN just past the transaction: what a status update confirms.
        end_lsn: Lsn,
        /// Microseconds since 2000-01-01 00:00:00 UTC.
        commit_ts: i64,
    },
    /// `O`: the transaction came from another server through replication
    /// origins; sent after Begin.
    Origin {
        /// The LSN of the commit on the origin server.
        commit_lsn: Lsn,
        /// The origin's name.
        name: String,
    },
    /// `R`: a table's shape, sent before its first change in a session and
    /// again after it changes.
    Relation(Relation),
    /// `Y`: a column type that is not built in (an enum, a domain, ...),
    /// sent before the first Relation that uses it.
    Type {
        /// The type's OID, as a Relation's columns name it.
        oid: u32,
        /// The type's schema; the empty string stands for `pg_catalog`.
        namespace: String,
        /// The type's name.
        name: String,
    },
    /// `I`: a row was inserted.
    Insert {
        /// The OID of the table, as its Relation message gave it.
        rel_id: u32,
        /// The new row.
        new: TupleData,
    },
    /// `U`: a row was updated.
    Update {
        /// The OID of the table, as its Relation message gave it.
        rel_id: u32,
        /// The old row or its key: sent only when the key changed (`K`) or
        /// the table is REPLICA IDENTITY FULL (`O`).
        old: Option<OldTuple>,
        /// The new row; unchanged TOASTed values are not sent.
        new: TupleData,
    },
    /// `D`: a row was deleted.
    Delete {
        /// The OID of the table, as its Relation message gave it.
        rel_id: u32,
        /// The deleted row's key, or the whole row under REPLICA IDENTITY FULL.
        old: OldTuple,
    },
    /// `T`: tables were truncated.
    Truncate {
        /// Bit 1 CASCADE, bit 2 RESTART IDENTITY.
        options: u8,
        /// The OIDs of the truncated tables (one TRUNCATE may name several).
        rel_ids: Vec<u32>,
    },
    /// `M`: a logical message (`pg_logical_emit_message`), which waltail
    /// uses for backfill watermarks.
    Message {
        /// Written inside a transaction (it comes between Begin and Commit)
        /// rather than at once.
        transactional: bool,
        /// The LSN of the message.
        lsn: Lsn,
        /// The prefix given to `pg_logical_emit_message`, e.g. `waltail`.
        prefix: String,
        /// The message's content, bytes as given.
        content: Bytes,
    },
    /// Protocol 2: the blocks of an in-progress transaction follow, up to
    /// [`LogicalMessage::StreamStop`]; data messages in them carry their
    /// (sub)transaction id.
    StreamStart {
        /// The id of the top-level transaction being streamed.
        xid: u32,
        /// The first block streamed of this transaction.
        first_segment: bool,
    },
    /// Protocol 2: the block that StreamStart opened ends; more blocks of
    /// the same or another transaction may follow.
    StreamStop,
    /// Protocol 2: the streamed transaction `xid` committed.
    StreamCommit {
        /// The id of the transaction that committed.
        xid: u32,
        /// Unused by the server; always 0.
        flags: u8,
        /// The LSN of the commit record.
        commit_lsn: Lsn,
        /// The LSN just past the transaction: what a status update confirms.
        end_lsn: Lsn,
        /// Microseconds since 2000-01-01 00:00:00 UTC.
        commit_ts: i64,
    },
    /// Protocol 2: the streamed (sub)transaction `subxid` of `xid` aborted
    /// (`subxid == xid`: the whole transaction).
    StreamAbort {
        /// The top-level transaction.
        xid: u32,
        /// The (sub)transaction that aborted.
        subxid: u32,
    },
}

/// Schema of a relation, sent before the first change to it (and again
/// whenever it changes).
#[derive(Debug, Clone, PartialEq)]
pub struct Relation {
    /// The table's OID, which the change messages name it by.
    pub rel_id: u32,
    /// As sent: the empty string stands for `pg_catalog`.
    pub namespace: String,
    /// The table's name.
    pub name: String,
    /// `b'd'` default, `b'n'` nothing, `b'f'` full, `b'i'` index.
    pub replica_identity: u8,
    /// The columns in the order tuples give their values.
    pub columns: Vec<Column>,
}

/// One column of a [`Relation`].
#[derive(Debug, Clone, PartialEq)]
pub struct Column {
    /// Bit 1 marks a column of the replica identity key; see [`Column::is_key`].
    pub flags: u8,
    /// The column's name.
    pub name: String,
    /// The OID of the column's type.
    pub type_oid: u32,
    /// The type modifier (`atttypmod`): length, precision, scale; -1 for none.
    pub type_modifier: i32,
}

impl Column {
    /// Whether the column is part of the replica identity key.
    pub fn is_key(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// The old row of an Update or Delete.
#[derive(Debug, Clone, PartialEq)]
pub enum OldTuple {
    /// `'K'`: only the replica identity key columns are set; others are Null.
    Key(TupleData),
    /// `'O'`: the full old row (REPLICA IDENTITY FULL).
    Full(TupleData),
}

/// A row's values (TupleData), one per column in the Relation's order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TupleData(pub Vec<ColumnValue>);

/// One column's value in a [`TupleData`].
#[derive(Debug, Clone, PartialEq)]
pub enum ColumnValue {
    /// `n`: SQL NULL (or, in a `K` old tuple, a column not in the key).
    Null,
    /// A TOASTed value that the update did not change, so it was not sent.
    UnchangedToast,
    /// `t`: the value in the type's text format, as `SELECT` would print it.
    Text(Bytes),
    /// `b`: the value in the type's binary format; only sent when binary
    /// mode is asked for, which waltail does not.
    Binary(Bytes),
}

/// Decodes one pgoutput (protocol v1) message.
pub fn decode(buf: Bytes) -> Result<LogicalMessage, DecodeError> {
    decode_with(buf, false).map(|(_, msg)| msg)
}

/// Decodes one message of a protocol 2 stream: `in_stream` is true between
/// StreamStart and StreamStop, where data messages carry a leading xid,
/// returned beside the message.
pub fn decode_in(
    buf: Bytes,
    in_stream: bool,
) -> Result<(Option<u32>, LogicalMessage), DecodeError> {
    decode_with(buf, in_stream)
}

/// Decodes one message; `in_stream` is true inside a protocol v2 streamed
/// transaction, where data messages carry a leading xid. Kept separate so
/// streaming can be added without touching the v1 layouts.
fn decode_with(buf: Bytes, in_stream: bool) -> Result<(Option<u32>, LogicalMessage), DecodeError> {
    let mut r = Reader { buf };
    let tag = r.u8("message tag")?;
    let stream_xid = |r: &mut Reader| -> Result<Option<u32>, DecodeError> {
        if in_stream {
            r.u32("transaction id").map(Some)
        } else {
            Ok(None)
        }
    };
    let (xid, msg, name) = match tag {
        b'B' => {
            let final_lsn = r.u64("final LSN")?;
            let commit_ts = r.i64("commit timestamp")?;
            let xid = r.u32("transaction id")?;
            let msg = LogicalMessage::Begin {
                final_lsn,
                commit_ts,
                xid,
            };
            (None, msg, "Begin")
        }
        b'C' => {
            let flags = r.u8("commit flags")?;
            let commit_lsn = r.u64("commit LSN")?;
            let end_lsn = r.u64("end LSN")?;
            let commit_ts = r.i64("commit timestamp")?;
            let msg = LogicalMessage::Commit {
                flags,
                commit_lsn,
                end_lsn,
                commit_ts,
            };
            (None, msg, "Commit")
        }
        b'O' => {
            let commit_lsn = r.u64("origin commit LSN")?;
            let name = r.string("origin name")?;
            (None, LogicalMessage::Origin { commit_lsn, name }, "Origin")
        }
        b'R' => {
            let xid = stream_xid(&mut r)?;
            let rel_id = r.u32("relation id")?;
            let namespace = r.string("relation namespace")?;
            let name = r.string("relation name")?;
            let replica_identity = r.u8("replica identity")?;
            let n = r.u16("column count")? as usize;
            // flags + NUL-terminated name + type oid + typmod
            const MIN_COLUMN_LEN: usize = 1 + 1 + 4 + 4;
            let mut columns = Vec::with_capacity(n.min(r.buf.len() / MIN_COLUMN_LEN));
            for _ in 0..n {
                columns.push(Column {
                    flags: r.u8("column flags")?,
                    name: r.string("column name")?,
                    type_oid: r.u32("column type")?,
                    type_modifier: r.i32("column type modifier")?,
                });
            }
            let rel = Relation {
                rel_id,
                namespace,
                name,
                replica_identity,
                columns,
            };
            (xid, LogicalMessage::Relation(rel), "Relation")
        }
        b'Y' => {
            let xid = stream_xid(&mut r)?;
            let oid = r.u32("type oid")?;
            let namespace = r.string("type namespace")?;
            let name = r.string("type name")?;
            let msg = LogicalMessage::Type {
                oid,
                namespace,
                name,
            };
            (xid, msg, "Type")
        }
        b'I' => {
            let xid = stream_xid(&mut r)?;
            let rel_id = r.u32("relation id")?;
            match r.u8("new tuple marker")? {
                b'N' => {}
                found => {
                    return Err(DecodeError::UnexpectedTupleMarker {
                        context: "Insert (expected 'N')",
                        found,
                    });
                }
            }
            let new = r.tuple()?;
            (xid, LogicalMessage::Insert { rel_id, new }, "Insert")
        }
        b'U' => {
            let xid = stream_xid(&mut r)?;
            let rel_id = r.u32("relation id")?;
            let mut marker = r.u8("tuple marker")?;
            let old = match marker {
                b'K' | b'O' => {
                    let t = r.tuple()?;
                    let old = if marker == b'K' {
                        OldTuple::Key(t)
                    } else {
                        OldTuple::Full(t)
                    };
                    marker = r.u8("new tuple marker")?;
                    Some(old)
                }
                _ => None,
            };
            if marker != b'N' {
                return Err(DecodeError::UnexpectedTupleMarker {
                    context: "Update (expected 'K', 'O' or 'N')",
                    found: marker,
                });
            }
            let new = r.tuple()?;
            (xid, LogicalMessage::Update { rel_id, old, new }, "Update")
        }
        b'D' => {
            let xid = stream_xid(&mut r)?;
            let rel_id = r.u32("relation id")?;
            let old = match r.u8("old tuple marker")? {
                b'K' => OldTuple::Key(r.tuple()?),
                b'O' => OldTuple::Full(r.tuple()?),
                found => {
                    return Err(DecodeError::UnexpectedTupleMarker {
                        context: "Delete (expected 'K' or 'O')",
                        found,
                    });
                }
            };
            (xid, LogicalMessage::Delete { rel_id, old }, "Delete")
        }
        b'T' => {
            let xid = stream_xid(&mut r)?;
            let n = r.u32("relation count")? as usize;
            let options = r.u8("truncate options")?;
            let mut rel_ids = Vec::with_capacity(n.min(r.buf.len() / 4));
            for _ in 0..n {
                rel_ids.push(r.u32("truncated relation id")?);
            }
            (
                xid,
                LogicalMessage::Truncate { options, rel_ids },
                "Truncate",
            )
        }
        b'M' => {
            let xid = stream_xid(&mut r)?;
            let flags = r.u8("message flags")?;
            let lsn = r.u64("message LSN")?;
            let prefix = r.string("message prefix")?;
            let content = r.counted_bytes("message content")?;
            let msg = LogicalMessage::Message {
                transactional: flags & 1 == 1,
                lsn,
                prefix,
                content,
            };
            (xid, msg, "Message")
        }
        b'S' => {
            let xid = r.u32("transaction id")?;
            let first_segment = r.u8("first segment flag")? == 1;
            (
                None,
                LogicalMessage::StreamStart { xid, first_segment },
                "Stream Start",
            )
        }
        b'E' => (None, LogicalMessage::StreamStop, "Stream Stop"),
        b'c' => {
            let xid = r.u32("transaction id")?;
            let flags = r.u8("commit flags")?;
            let commit_lsn = r.u64("commit LSN")?;
            let end_lsn = r.u64("end LSN")?;
            let commit_ts = r.i64("commit timestamp")?;
            let msg = LogicalMessage::StreamCommit {
                xid,
                flags,
                commit_lsn,
                end_lsn,
                commit_ts,
            };
            (None, msg, "Stream Commit")
        }
        b'A' => {
            let xid = r.u32("transaction id")?;
            let subxid = r.u32("subtransaction id")?;
            (
                None,
                LogicalMessage::StreamAbort { xid, subxid },
                "Stream Abort",
            )
        }
        other => return Err(DecodeError::UnknownMessage(other)),
    };
    if !r.buf.is_empty() {
        return Err(DecodeError::TrailingBytes {
            message: name,
            count: r.buf.len(),
        });
    }
    Ok((xid, msg))
}

/// Cursor over the payload; every read checks the length first so a short
/// buffer becomes `Truncated` instead of a `Buf` panic.
struct Reader {
    buf: Bytes,
}

impl Reader {
    fn need(&self, n: usize, what: &'static str) -> Result<(), DecodeError> {
        if self.buf.len() < n {
            Err(DecodeError::Truncated { what })
        } else {
            Ok(())
        }
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        self.need(1, what)?;
        Ok(self.buf.get_u8())
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        self.need(2, what)?;
        Ok(self.buf.get_u16())
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.need(4, what)?;
        Ok(self.buf.get_u32())
    }

    fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        self.need(4, what)?;
        Ok(self.buf.get_i32())
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        self.need(8, what)?;
        Ok(self.buf.get_u64())
    }

    fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        self.need(8, what)?;
        Ok(self.buf.get_i64())
    }

    fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let end = self
            .buf
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::Truncated { what })?;
        let s = std::str::from_utf8(&self.buf[..end])
            .map_err(|_| DecodeError::InvalidUtf8 { what })?
            .to_owned();
        self.buf.advance(end + 1);
        Ok(s)
    }

    /// An Int32 length followed by that many bytes.
    fn counted_bytes(&mut self, what: &'static str) -> Result<Bytes, DecodeError> {
        let len = self.i32(what)?;
        let len = usize::try_from(len).map_err(|_| DecodeError::NegativeLength { what, len })?;
        self.need(len, what)?;
        Ok(self.buf.split_to(len))
    }

    fn tuple(&mut self) -> Result<TupleData, DecodeError> {
        let n = self.u16("tuple column count")? as usize;
        // Each column needs at least its one kind byte.
        let mut cols = Vec::with_capacity(n.min(self.buf.len()));
        for _ in 0..n {
            let v = match self.u8("tuple column kind")? {
                b'n' => ColumnValue::Null,
                b'u' => ColumnValue::UnchangedToast,
                b't' => ColumnValue::Text(self.counted_bytes("text column value")?),
                b'b' => ColumnValue::Binary(self.counted_bytes("binary column value")?),
                other => return Err(DecodeError::UnknownTupleKind(other)),
            };
            cols.push(v);
        }
        Ok(TupleData(cols))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Encodes messages the way pgoutput does, so the tests check the
    /// decoder against the documented layout rather than against itself.
    fn encode(msg: &LogicalMessage) -> Vec<u8> {
        fn s(out: &mut Vec<u8>, v: &str) {
            out.extend_from_slice(v.as_bytes());
            out.push(0);
        }
        fn tuple(out: &mut Vec<u8>, t: &TupleData) {
            out.extend_from_slice(&(t.0.len() as u16).to_be_bytes());
            for c in &t.0 {
                match c {
                    ColumnValue::Null => out.push(b'n'),
                    ColumnValue::UnchangedToast => out.push(b'u'),
                    ColumnValue::Text(b) | ColumnValue::Binary(b) => {
                        out.push(if matches!(c, ColumnValue::Text(_)) {
                            b't'
                        } else {
                            b'b'
                        });
                        out.extend_from_slice(&(b.len() as i32).to_be_bytes());
                        out.extend_from_slice(b);
                    }
                }
            }
        }
        fn old(out: &mut Vec<u8>, o: &OldTuple) {
            match o {
                OldTuple::Key(t) => {
                    out.push(b'K');
                    tuple(out, t);
                }
                OldTuple::Full(t) => {
                    out.push(b'O');
                    tuple(out, t);
                }
            }
        }
        let mut o = Vec::new();
        match msg {
            LogicalMessage::Begin {
                final_lsn,
                commit_ts,
                xid,
            } => {
                o.push(b'B');
                o.extend_from_slice(&final_lsn.to_be_bytes());
                o.extend_from_slice(&commit_ts.to_be_bytes());
                o.extend_from_slice(&xid.to_be_bytes());
            }
            LogicalMessage::Commit {
                flags,
                commit_lsn,
                end_lsn,
                commit_ts,
            } => {
                o.push(b'C');
                o.push(*flags);
                o.extend_from_slice(&commit_lsn.to_be_bytes());
                o.extend_from_slice(&end_lsn.to_be_bytes());
                o.extend_from_slice(&commit_ts.to_be_bytes());
            }
            LogicalMessage::Origin { commit_lsn, name } => {
                o.push(b'O');
                o.extend_from_slice(&commit_lsn.to_be_bytes());
                s(&mut o, name);
            }
            LogicalMessage::Relation(r) => {
                o.push(b'R');
                o.extend_from_slice(&r.rel_id.to_be_bytes());
                s(&mut o, &r.namespace);
                s(&mut o, &r.name);
                o.push(r.replica_identity);
                o.extend_from_slice(&(r.columns.len() as u16).to_be_bytes());
                for c in &r.columns {
                    o.push(c.flags);
                    s(&mut o, &c.name);
                    o.extend_from_slice(&c.type_oid.to_be_bytes());
                    o.extend_from_slice(&c.type_modifier.to_be_bytes());
                }
            }
            LogicalMessage::Type {
                oid,
                namespace,
                name,
            } => {
                o.push(b'Y');
                o.extend_from_slice(&oid.to_be_bytes());
                s(&mut o, namespace);
                s(&mut o, name);
            }
            LogicalMessage::Insert { rel_id, new } => {
                o.push(b'I');
                o.extend_from_slice(&rel_id.to_be_bytes());
                o.push(b'N');
                tuple(&mut o, new);
            }
            LogicalMessage::Update {
                rel_id,
                old: ot,
                new,
            } => {
                o.push(b'U');
                o.extend_from_slice(&rel_id.to_be_bytes());
                if let Some(ot) = ot {
                    old(&mut o, ot);
                }
                o.push(b'N');
                tuple(&mut o, new);
            }
            LogicalMessage::Delete { rel_id, old: ot } => {
                o.push(b'D');
                o.extend_from_slice(&rel_id.to_be_bytes());
                old(&mut o, ot);
            }
            LogicalMessage::Truncate { options, rel_ids } => {
                o.push(b'T');
                o.extend_from_slice(&(rel_ids.len() as u32).to_be_bytes());
                o.push(*options);
                for id in rel_ids {
                    o.extend_from_slice(&id.to_be_bytes());
                }
            }
            LogicalMessage::Message {
                transactional,
                lsn,
                prefix,
                content,
            } => {
                o.push(b'M');
                o.push(u8::from(*transactional));
                o.extend_from_slice(&lsn.to_be_bytes());
                s(&mut o, prefix);
                o.extend_from_slice(&(content.len() as i32).to_be_bytes());
                o.extend_from_slice(content);
            }
            LogicalMessage::StreamStart { xid, first_segment } => {
                o.push(b'S');
                o.extend_from_slice(&xid.to_be_bytes());
                o.push(u8::from(*first_segment));
            }
            LogicalMessage::StreamStop => o.push(b'E'),
            LogicalMessage::StreamCommit {
                xid,
                flags,
                commit_lsn,
                end_lsn,
                commit_ts,
            } => {
                o.push(b'c');
                o.extend_from_slice(&xid.to_be_bytes());
                o.push(*flags);
                o.extend_from_slice(&commit_lsn.to_be_bytes());
                o.extend_from_slice(&end_lsn.to_be_bytes());
                o.extend_from_slice(&commit_ts.to_be_bytes());
            }
            LogicalMessage::StreamAbort { xid, subxid } => {
                o.push(b'A');
                o.extend_from_slice(&xid.to_be_bytes());
                o.extend_from_slice(&subxid.to_be_bytes());
            }
        }
        o
    }

    #[test]
    fn protocol_2_stream_messages_round_trip_and_truncations_fail() {
        for msg in [
            LogicalMessage::StreamStart {
                xid: 9,
                first_segment: true,
            },
            LogicalMessage::StreamStop,
            LogicalMessage::StreamCommit {
                xid: 9,
                flags: 0,
                commit_lsn: 0x1_0000_0010,
                end_lsn: 0x1_0000_0040,
                commit_ts: 12345,
            },
            LogicalMessage::StreamAbort { xid: 9, subxid: 10 },
        ] {
            let wire = encode(&msg);
            assert_eq!(decode(Bytes::from(wire.clone())).unwrap(), msg);
            for cut in 1..wire.len() {
                assert!(
                    decode(Bytes::from(wire[..cut].to_vec())).is_err(),
                    "{msg:?} cut at {cut}"
                );
            }
        }
    }

    fn text(s: &str) -> ColumnValue {
        ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    fn row() -> TupleData {
        TupleData(vec![
            text("42"),
            ColumnValue::Null,
            ColumnValue::UnchangedToast,
            ColumnValue::Binary(Bytes::from_static(&[0, 1, 2, 255])),
            text(""),
        ])
    }

    fn samples() -> Vec<LogicalMessage> {
        let key = TupleData(vec![text("42"), ColumnValue::Null]);
        vec![
            LogicalMessage::Begin {
                final_lsn: 0x16_B374_D848,
                commit_ts: 762_000_000_123_456,
                xid: 747,
            },
            LogicalMessage::Commit {
                flags: 0,
                commit_lsn: 0x16_B374_D848,
                end_lsn: 0x16_B374_D878,
                commit_ts: -5,
            },
            LogicalMessage::Origin {
                commit_lsn: 1,
                name: "node_a".into(),
            },
            LogicalMessage::Relation(Relation {
                rel_id: 16385,
                namespace: "public".into(),
                name: "wörter".into(),
                replica_identity: b'd',
                columns: vec![
                    Column {
                        flags: 1,
                        name: "id".into(),
                        type_oid: 23,
                        type_modifier: -1,
                    },
                    Column {
                        flags: 0,
                        name: "name".into(),
                        type_oid: 1043,
                        type_modifier: 259,
                    },
                ],
            }),
            LogicalMessage::Relation(Relation {
                rel_id: 1,
                namespace: String::new(),
                name: "t".into(),
                replica_identity: b'n',
                columns: vec![],
            }),
            LogicalMessage::Type {
                oid: 90001,
                namespace: "public".into(),
                name: "mood".into(),
            },
            LogicalMessage::Insert {
                rel_id: 16385,
                new: row(),
            },
            LogicalMessage::Insert {
                rel_id: 16385,
                new: TupleData::default(),
            },
            LogicalMessage::Update {
                rel_id: 16385,
                old: None,
                new: row(),
            },
            LogicalMessage::Update {
                rel_id: 16385,
                old: Some(OldTuple::Key(key.clone())),
                new: row(),
            },
            LogicalMessage::Update {
                rel_id: 16385,
                old: Some(OldTuple::Full(row())),
                new: row(),
            },
            LogicalMessage::Delete {
                rel_id: 16385,
                old: OldTuple::Key(key),
            },
            LogicalMessage::Delete {
                rel_id: 16385,
                old: OldTuple::Full(row()),
            },
            LogicalMessage::Truncate {
                options: 3,
                rel_ids: vec![16385, 16390],
            },
            LogicalMessage::Message {
                transactional: true,
                lsn: 99,
                prefix: "waltail".into(),
                content: Bytes::from_static(b"hello\0world"),
            },
            LogicalMessage::Message {
                transactional: false,
                lsn: 0,
                prefix: String::new(),
                content: Bytes::new(),
            },
        ]
    }

    #[test]
    fn round_trips_every_kind() {
        for m in samples() {
            let bytes = encode(&m);
            assert_eq!(decode(Bytes::from(bytes)).unwrap(), m);
        }
    }

    #[test]
    fn known_wire_bytes() {
        // Insert into rel 7 of (int 5, NULL, unchanged toast), written by hand.
        let wire = b"I\0\0\0\x07N\0\x03t\0\0\0\x015nu";
        let m = decode(Bytes::from_static(wire)).unwrap();
        assert_eq!(
            m,
            LogicalMessage::Insert {
                rel_id: 7,
                new: TupleData(vec![
                    text("5"),
                    ColumnValue::Null,
                    ColumnValue::UnchangedToast
                ]),
            }
        );
    }

    #[test]
    fn column_values_are_slices_of_the_input() {
        let wire = Bytes::from(encode(&LogicalMessage::Insert {
            rel_id: 1,
            new: TupleData(vec![text("abcdef")]),
        }));
        let range = wire.as_ptr_range();
        let LogicalMessage::Insert { new, .. } = decode(wire.clone()).unwrap() else {
            panic!("not an insert");
        };
        let ColumnValue::Text(v) = &new.0[0] else {
            panic!("not text");
        };
        assert!(range.contains(&v.as_ptr()));
    }

    #[test]
    fn rejects_bad_input() {
        assert!(matches!(
            decode(Bytes::new()),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"Z")),
            Err(DecodeError::UnknownMessage(b'Z'))
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"I\0\0\0\x07N\0\x01x")),
            Err(DecodeError::UnknownTupleKind(b'x'))
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"I\0\0\0\x07N\0\x01t\xff\xff\xff\xff")),
            Err(DecodeError::NegativeLength { len: -1, .. })
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"I\0\0\0\x07X\0\0")),
            Err(DecodeError::UnexpectedTupleMarker { found: b'X', .. })
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"D\0\0\0\x07N\0\0")),
            Err(DecodeError::UnexpectedTupleMarker { found: b'N', .. })
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"O\0\0\0\0\0\0\0\x01\xff\0")),
            Err(DecodeError::InvalidUtf8 { .. })
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"I\0\0\0\x07N\0\0!")),
            Err(DecodeError::TrailingBytes { count: 1, .. })
        ));
        // A huge count with no data behind it must fail fast, not allocate.
        assert!(matches!(
            decode(Bytes::from_static(b"T\xff\xff\xff\xff\0")),
            Err(DecodeError::Truncated { .. })
        ));
        let msg = DecodeError::Truncated {
            what: "relation id",
        }
        .to_string();
        assert_eq!(
            msg,
            "pgoutput message is truncated: it ends before the relation id"
        );
        assert!(
            DecodeError::UnknownMessage(b'Z')
                .to_string()
                .contains("'Z' (0x5a)")
        );
    }

    #[test]
    fn in_stream_reads_leading_xid() {
        let mut wire = vec![b'I'];
        wire.extend_from_slice(&77u32.to_be_bytes());
        wire.extend_from_slice(
            &encode(&LogicalMessage::Insert {
                rel_id: 9,
                new: row(),
            })[1..],
        );
        let (xid, msg) = decode_with(Bytes::from(wire), true).unwrap();
        assert_eq!(xid, Some(77));
        assert_eq!(
            msg,
            LogicalMessage::Insert {
                rel_id: 9,
                new: row()
            }
        );
    }

    fn arb_value() -> impl Strategy<Value = ColumnValue> {
        prop_oneof![
            Just(ColumnValue::Null),
            Just(ColumnValue::UnchangedToast),
            proptest::collection::vec(any::<u8>(), 0..12)
                .prop_map(|v| ColumnValue::Text(Bytes::from(v))),
            proptest::collection::vec(any::<u8>(), 0..12)
                .prop_map(|v| ColumnValue::Binary(Bytes::from(v))),
        ]
    }

    fn arb_tuple() -> impl Strategy<Value = TupleData> {
        proptest::collection::vec(arb_value(), 0..6).prop_map(TupleData)
    }

    fn arb_old() -> impl Strategy<Value = OldTuple> {
        prop_oneof![
            arb_tuple().prop_map(OldTuple::Key),
            arb_tuple().prop_map(OldTuple::Full)
        ]
    }

    fn arb_message() -> impl Strategy<Value = LogicalMessage> {
        let name = "[a-zé]{0,6}";
        prop_oneof![
            (any::<u64>(), any::<i64>(), any::<u32>()).prop_map(|(final_lsn, commit_ts, xid)| {
                LogicalMessage::Begin {
                    final_lsn,
                    commit_ts,
                    xid,
                }
            }),
            (any::<u32>(), arb_tuple())
                .prop_map(|(rel_id, new)| LogicalMessage::Insert { rel_id, new }),
            (any::<u32>(), proptest::option::of(arb_old()), arb_tuple())
                .prop_map(|(rel_id, old, new)| LogicalMessage::Update { rel_id, old, new }),
            (any::<u32>(), arb_old())
                .prop_map(|(rel_id, old)| LogicalMessage::Delete { rel_id, old }),
            (any::<u8>(), proptest::collection::vec(any::<u32>(), 0..5))
                .prop_map(|(options, rel_ids)| LogicalMessage::Truncate { options, rel_ids }),
            (
                any::<u32>(),
                name,
                name,
                proptest::collection::vec((any::<u8>(), name, any::<u32>(), any::<i32>()), 0..4)
            )
                .prop_map(|(rel_id, namespace, rname, cols)| LogicalMessage::Relation(
                    Relation {
                        rel_id,
                        namespace,
                        name: rname,
                        replica_identity: b'f',
                        columns: cols
                            .into_iter()
                            .map(|(flags, name, type_oid, type_modifier)| Column {
                                flags,
                                name,
                                type_oid,
                                type_modifier
                            })
                            .collect(),
                    }
                )),
            (
                any::<bool>(),
                any::<u64>(),
                name,
                proptest::collection::vec(any::<u8>(), 0..10)
            )
                .prop_map(|(transactional, lsn, prefix, c)| LogicalMessage::Message {
                    transactional,
                    lsn,
                    prefix,
                    content: Bytes::from(c)
                }),
        ]
    }

    proptest! {
        #[test]
        fn never_panics_on_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(Bytes::from(data));
        }

        #[test]
        fn never_panics_with_valid_tag(tag in prop::sample::select(b"BCORYIUDTM".to_vec()),
                                       data in proptest::collection::vec(any::<u8>(), 0..128)) {
            let mut v = vec![tag];
            v.extend(data);
            let _ = decode(Bytes::from(v));
        }

        #[test]
        fn generated_messages_round_trip_and_prefixes_fail(m in arb_message()) {
            let full = encode(&m);
            prop_assert_eq!(decode(Bytes::from(full.clone())).unwrap(), m);
            for cut in 0..full.len() {
                prop_assert!(decode(Bytes::copy_from_slice(&full[..cut])).is_err());
            }
        }
    }

    proptest! {
        #![proptest_config(crate::fuzzing::config(256))]

        /// The decoder's fuzz campaign (see `crate::fuzzing`): valid
        /// messages with a mutation fuzzer's edits. It never panics, and
        /// whatever it accepts has the length pgoutput encodes the message
        /// it returns in (nothing read past, nothing left over) and reads
        /// back as the same message. (Not the same bytes: flag bits it
        /// does not know, as in a logical message's flags, are ignored.)
        #[test]
        fn fuzz_decode(
            m in arb_message(),
            edits in crate::fuzzing::edits(),
            in_stream in any::<bool>(),
        ) {
            let bytes = crate::fuzzing::apply(&encode(&m), &edits);
            if let Ok(decoded) = decode(Bytes::from(bytes.clone())) {
                let again = encode(&decoded);
                prop_assert_eq!(again.len(), bytes.len(), "{:?}", decoded);
                prop_assert_eq!(decode(Bytes::from(again)).unwrap(), decoded);
            }
            let _ = decode_in(Bytes::from(bytes), in_stream);
        }
    }

    #[test]
    fn every_strict_prefix_is_an_error_and_extensions_too() {
        for m in samples() {
            let full = encode(&m);
            for cut in 0..full.len() {
                let r = decode(Bytes::copy_from_slice(&full[..cut]));
                assert!(r.is_err(), "prefix {cut} of {m:?} decoded as {r:?}");
            }
            let mut longer = full.clone();
            longer.push(0);
            assert!(decode(Bytes::from(longer)).is_err());
        }
    }
}
