//! Turns the replication stream into [`SourceEvent`]s: decodes pgoutput,
//! keeps the relation cache, renders each row's values as JSON once, and
//! skips transactions the pipeline has already confirmed.
//!
//! The source task blocks on the bounded event channel when the pipeline is
//! busy (backpressure: Postgres keeps the WAL meanwhile). The connection stays
//! alive because status updates are sent from a separate task (see
//! [`crate::pipeline`]), and reply requests are passed on at once.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{Notify, mpsc};

use crate::archive::envelope::{Change, Op, RowSet, table_hash};
use crate::lsn;
use crate::source::catalog::{ColumnType, TypeCatalog};
use crate::source::pgoutput::{self, ColumnValue, LogicalMessage, OldTuple};
use crate::source::replication::{ReplicationMessage, ReplicationStream};
pub use crate::source::row::TableSchema;
use crate::source::row::{RelationInfo, relation_info, row_hash, row_json, row_json_with};
use crate::source::spill::{Drain, MEMORY_BUDGET, StreamBuffers};
use crate::source::watermark::{MESSAGE_PREFIX, WATERMARK_TABLE};
use crate::{Error, Result};

/// What the source tells the pipeline, in stream order.
#[derive(Debug)]
pub enum SourceEvent {
    /// A transaction starts; its changes follow.
    Begin,
    /// One row change of the transaction, values rendered as JSON.
    Change(Change),
    /// The transaction is complete; `end_lsn` is what may be confirmed.
    Commit {
        /// The LSN just past the transaction's commit record: confirming it
        /// tells the server the whole transaction is archived.
        end_lsn: u64,
    },
    /// The server has sent everything up to `wal_end`.
    Keepalive {
        /// The server's current end of WAL, as its keepalive says.
        wal_end: u64,
    },
    /// A table's shape as of the changes that follow (sent by the server
    /// before the first change of a table in a session, and after DDL).
    Schema(TableSchema),
    /// A transactional logical message with waltail's prefix (a backfill
    /// watermark), at its place among the transaction's changes.
    Watermark {
        /// The message's content, as the backfill wrote it (see
        /// [`crate::source::watermark`]).
        content: bytes::Bytes,
        /// The LSN of the commit record of the transaction that wrote it.
        commit_lsn: u64,
        /// That transaction's commit time, microseconds since 2000-01-01 UTC.
        commit_ts: i64,
    },
}

struct Txn {
    commit_lsn: u64,
    commit_ts: i64,
    index: u32,
    skip: bool,
}

/// A committed streamed transaction being handed to the pipeline.
struct Emitting {
    drain: Drain,
    commit_lsn: u64,
    commit_ts: i64,
    end_lsn: u64,
    index: u32,
}

/// The stateful part of the source: relations, the open transaction, and
/// the buffers of streamed in-progress transactions (protocol 2).
pub struct Decoder {
    relations: HashMap<u32, RelationInfo>,
    /// Column types resolved for the next Relation message of each relation.
    resolved: HashMap<u32, Vec<Arc<ColumnType>>>,
    /// Transactions committed before this LSN were already confirmed.
    skip_before: u64,
    txn: Option<Txn>,
    /// The top-level xid of the stream block being received, if any.
    in_stream: Option<u32>,
    /// The (sub)transaction id carried by the current streamed message.
    msg_xid: Option<u32>,
    streams: StreamBuffers,
    emitting: Option<Emitting>,
    /// Relations that are the backfill watermark table (servers before 14;
    /// see `watermark::WATERMARK_TABLE`), with the place of their `content`
    /// column: an insert is a watermark, nothing of them is archived.
    watermark_rels: HashMap<u32, usize>,
}

impl Decoder {
    /// `spill` is the scratch folder for streamed transactions too large to
    /// keep in memory.
    pub fn new(skip_before: u64, spill: &std::path::Path) -> Result<Self> {
        Ok(Decoder {
            relations: HashMap::new(),
            resolved: HashMap::new(),
            skip_before,
            txn: None,
            in_stream: None,
            msg_xid: None,
            streams: StreamBuffers::new(spill, MEMORY_BUDGET)?,
            emitting: None,
            watermark_rels: HashMap::new(),
        })
    }

    /// Handles one replication message, appending the resulting events.
    pub fn handle(&mut self, msg: ReplicationMessage, out: &mut Vec<SourceEvent>) -> Result<()> {
        match msg {
            ReplicationMessage::Keepalive { wal_end, .. } => {
                // With a streamed transaction open, positions past its start
                // must not be confirmed as if nothing were pending.
                if self.in_stream.is_none() && self.streams.is_empty() && self.emitting.is_none() {
                    out.push(SourceEvent::Keepalive { wal_end });
                }
                Ok(())
            }
            ReplicationMessage::XLogData { data, .. } => {
                let (xid, msg) = pgoutput::decode_in(data, self.in_stream.is_some())?;
                self.msg_xid = xid;
                self.logical(msg, out)
            }
        }
    }

    /// Whether a committed streamed transaction is still being handed over
    /// (call [`Decoder::emit_chunk`] until it is not).
    pub fn is_emitting(&self) -> bool {
        self.emitting.is_some()
    }

    /// Appends up to `max` changes of the committed streamed transaction,
    /// then its Commit once all are out.
    pub fn emit_chunk(&mut self, out: &mut Vec<SourceEvent>, max: usize) -> Result<()> {
        let Some(e) = self.emitting.as_mut() else {
            return Ok(());
        };
        let chunk = self.streams.next_chunk(&mut e.drain, max)?;
        if chunk.is_empty() {
            out.push(SourceEvent::Commit { end_lsn: e.end_lsn });
            self.emitting = None;
            return Ok(());
        }
        for mut c in chunk {
            c.commit_lsn = e.commit_lsn;
            c.commit_ts = e.commit_ts;
            c.index = e.index;
            e.index += 1;
            out.push(SourceEvent::Change(c));
        }
        Ok(())
    }

    fn logical(&mut self, msg: LogicalMessage, out: &mut Vec<SourceEvent>) -> Result<()> {
        match msg {
            LogicalMessage::Begin {
                final_lsn,
                commit_ts,
                ..
            } => {
                let skip = final_lsn < self.skip_before;
                if skip {
                    tracing::debug!(
                        commit_lsn = %lsn::display(final_lsn),
                        "skipping a transaction confirmed before the restart"
                    );
                } else {
                    out.push(SourceEvent::Begin);
                }
                self.txn = Some(Txn {
                    commit_lsn: final_lsn,
                    commit_ts,
                    index: 0,
                    skip,
                });
            }
            LogicalMessage::Commit { end_lsn, .. } => {
                let txn = self
                    .txn
                    .take()
                    .ok_or_else(|| protocol("Commit without Begin"))?;
                if !txn.skip {
                    out.push(SourceEvent::Commit { end_lsn });
                }
            }
            LogicalMessage::Relation(rel)
                if (rel.namespace.as_str(), rel.name.as_str()) == WATERMARK_TABLE =>
            {
                let content = rel
                    .columns
                    .iter()
                    .position(|c| c.name == "content")
                    .ok_or_else(|| protocol("the watermark table has no content column"))?;
                self.resolved.remove(&rel.rel_id);
                self.watermark_rels.insert(rel.rel_id, content);
            }
            LogicalMessage::Insert { rel_id, new } if self.watermark_rels.contains_key(&rel_id) => {
                let content = match new.0.get(self.watermark_rels[&rel_id]) {
                    Some(ColumnValue::Text(t) | ColumnValue::Binary(t)) => t.clone(),
                    _ => return Err(protocol("a watermark row without content")),
                };
                self.watermark(content, out);
            }
            LogicalMessage::Update { rel_id, .. } | LogicalMessage::Delete { rel_id, .. }
                if self.watermark_rels.contains_key(&rel_id) => {}
            LogicalMessage::Truncate { rel_ids, .. }
                if rel_ids.iter().all(|r| self.watermark_rels.contains_key(r)) => {}
            LogicalMessage::Relation(rel) => {
                let types = self.resolved.remove(&rel.rel_id).unwrap_or_default();
                let (info, schema) = relation_info(&rel, &types);
                out.push(SourceEvent::Schema(schema));
                self.relations.insert(rel.rel_id, info);
            }
            LogicalMessage::Insert { rel_id, new } => {
                self.change(rel_id, out, |rel| {
                    Ok((
                        Op::Insert,
                        Some(row_json(rel, &new, false)),
                        None,
                        row_hash(rel, &new),
                        None,
                    ))
                })?;
            }
            LogicalMessage::Update { rel_id, old, new } => {
                self.change(rel_id, out, |rel| {
                    let new_hash = row_hash(rel, &new);
                    let (old_json, old_hash) = match &old {
                        None => (None, None),
                        Some(OldTuple::Key(t)) => {
                            (Some(row_json(rel, t, true)), Some(row_hash(rel, t)))
                        }
                        Some(OldTuple::Full(t)) => {
                            (Some(row_json(rel, t, false)), Some(row_hash(rel, t)))
                        }
                    };
                    let before = match &old {
                        Some(OldTuple::Full(t)) => Some(t),
                        _ => None,
                    };
                    Ok((
                        Op::Update,
                        Some(row_json_with(rel, &new, false, before)),
                        old_json,
                        new_hash,
                        old_hash,
                    ))
                })?;
            }
            LogicalMessage::Delete { rel_id, old } => {
                self.change(rel_id, out, |rel| {
                    let (json, hash) = match &old {
                        OldTuple::Key(t) => (row_json(rel, t, true), row_hash(rel, t)),
                        OldTuple::Full(t) => (row_json(rel, t, false), row_hash(rel, t)),
                    };
                    Ok((Op::Delete, None, Some(json), hash, None))
                })?;
            }
            LogicalMessage::Truncate { rel_ids, .. } => {
                let archived: Vec<u32> = rel_ids
                    .into_iter()
                    .filter(|r| !self.watermark_rels.contains_key(r))
                    .collect();
                for rel_id in archived {
                    self.change(rel_id, out, |rel| {
                        Ok((Op::Truncate, None, None, table_hash(&rel.table), None))
                    })?;
                }
            }
            LogicalMessage::StreamStart { xid, .. } => self.in_stream = Some(xid),
            LogicalMessage::StreamStop => self.in_stream = None,
            LogicalMessage::StreamAbort { xid, subxid } => self.streams.abort(xid, subxid)?,
            LogicalMessage::StreamCommit {
                xid,
                commit_lsn,
                end_lsn,
                commit_ts,
                ..
            } => {
                if commit_lsn < self.skip_before {
                    self.streams.abort(xid, xid)?;
                } else {
                    out.push(SourceEvent::Begin);
                    self.emitting = Some(Emitting {
                        drain: self.streams.take(xid)?,
                        commit_lsn,
                        commit_ts,
                        end_lsn,
                        index: 0,
                    });
                }
            }
            // Backfill watermarks: only transactional ones are ordered with
            // the changes (a watermark is never part of a streamed transaction:
            // it is committed on its own).
            LogicalMessage::Message {
                transactional: true,
                prefix,
                content,
                ..
            } if prefix == MESSAGE_PREFIX && self.in_stream.is_none() => {
                self.watermark(content, out);
            }
            // Origins, custom type names and other logical messages carry no row changes.
            LogicalMessage::Origin { .. }
            | LogicalMessage::Type { .. }
            | LogicalMessage::Message { .. } => {}
        }
        Ok(())
    }

    /// A backfill watermark (a logical message, or a row of the watermark
    /// table) at its place in the transaction; none in a streamed one (a
    /// watermark is committed on its own) or one already confirmed.
    fn watermark(&self, content: bytes::Bytes, out: &mut Vec<SourceEvent>) {
        if self.in_stream.is_some() {
            return;
        }
        if let Some(txn) = self.txn.as_ref().filter(|t| !t.skip) {
            out.push(SourceEvent::Watermark {
                content,
                commit_lsn: txn.commit_lsn,
                commit_ts: txn.commit_ts,
            });
        }
    }

    #[allow(clippy::type_complexity)]
    fn change(
        &mut self,
        rel_id: u32,
        out: &mut Vec<SourceEvent>,
        build: impl FnOnce(
            &RelationInfo,
        ) -> Result<(Op, Option<Vec<u8>>, Option<Vec<u8>>, u64, Option<u64>)>,
    ) -> Result<()> {
        // A regular transaction numbers its changes as they come; a streamed
        // one when it commits (its commit LSN is not known before).
        let position = match self.in_stream {
            Some(_) => None,
            None => {
                let txn = self
                    .txn
                    .as_mut()
                    .ok_or_else(|| protocol("a change outside a transaction"))?;
                let index = txn.index;
                txn.index += 1;
                if txn.skip {
                    return Ok(());
                }
                Some((txn.commit_lsn, txn.commit_ts, index))
            }
        };
        let rel = self.relations.get(&rel_id).ok_or_else(|| {
            protocol(&format!(
                "a change for relation {rel_id} before its Relation message"
            ))
        })?;
        let (op, data, old, hash, other) = build(rel)?;
        let mut rows = RowSet::one(hash);
        if let Some(h) = other {
            rows.push(h);
        }
        let (commit_lsn, commit_ts, index) = position.unwrap_or_default();
        let change = Change {
            op,
            table: rel.table.clone(),
            data,
            old,
            commit_lsn,
            commit_ts,
            index,
            rows,
        };
        match self.in_stream {
            Some(top) => self.streams.push(top, self.msg_xid.unwrap_or(top), change),
            None => {
                out.push(SourceEvent::Change(change));
                Ok(())
            }
        }
    }
}

fn protocol(what: &str) -> Error {
    Error::fatal(
        format!("unexpected replication stream: {what}"),
        "this is a bug in waltail or an unsupported server; report it with the server version",
    )
}

impl Decoder {
    /// Gives the resolved types of a Relation message's columns, before the
    /// message itself is handled (resolution is async; handling is not).
    pub fn set_types(&mut self, rel_id: u32, types: Vec<Arc<ColumnType>>) {
        self.resolved.insert(rel_id, types);
    }
}

/// Changes of a committed streamed transaction read out per step, so a
/// transaction of any size passes through in bounded memory.
const EMIT_CHUNK: usize = EVENT_BATCH;

/// Events handed to the pipeline in one message, at most (plus the few one
/// replication message can add). The events of the messages already
/// received go together, so the pipeline is woken once per burst rather
/// than once per event: on many small transactions, cross-thread wake-ups
/// per event were the largest single cost in a profile of `waltail run`.
/// Nothing waits for a batch to fill: it leaves as soon as the received
/// bytes are used up.
pub const EVENT_BATCH: usize = 256;

/// Reads the replication stream until it ends or fails, sending events to
/// the pipeline in batches (see [`EVENT_BATCH`]). Reply requests are
/// signalled on `reply` immediately, before any backpressure can delay them.
pub async fn run(
    mut stream: ReplicationStream,
    mut decoder: Decoder,
    mut catalog: TypeCatalog,
    tx: mpsc::Sender<Vec<SourceEvent>>,
    reply: Arc<Notify>,
) -> Result<()> {
    let mut events = Vec::with_capacity(EVENT_BATCH);
    loop {
        let msg = stream
            .next()
            .await
            .map_err(|e| Error::replication("reading the replication stream", e))?;
        let Some(msg) = msg else {
            return Err(Error::replication(
                "reading the replication stream",
                crate::error::ReplicationError::Closed,
            ));
        };
        if let ReplicationMessage::Keepalive {
            reply_requested: true,
            ..
        } = msg
        {
            reply.notify_one();
        }
        if let ReplicationMessage::XLogData { data, .. } = &msg
            && data.first() == Some(&b'R')
            && let (_, LogicalMessage::Relation(rel)) =
                pgoutput::decode_in(data.clone(), decoder.in_stream.is_some())?
        {
            let mut types = Vec::with_capacity(rel.columns.len());
            for c in &rel.columns {
                types.push(catalog.resolve(c.type_oid, c.type_modifier).await);
            }
            decoder.set_types(rel.rel_id, types);
        }
        decoder.handle(msg, &mut events)?;
        loop {
            if events.len() >= EVENT_BATCH
                || (!events.is_empty() && !decoder.is_emitting() && !stream.has_buffered())
            {
                let batch = std::mem::replace(&mut events, Vec::with_capacity(EVENT_BATCH));
                if tx.send(batch).await.is_err() {
                    // The pipeline has stopped; it decides what happens next.
                    return Ok(());
                }
            }
            if !decoder.is_emitting() {
                break;
            }
            decoder.emit_chunk(&mut events, EMIT_CHUNK)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REL: u32 = 16_401;

    fn xlog(bytes: Vec<u8>) -> ReplicationMessage {
        ReplicationMessage::XLogData {
            wal_start: 0x100,
            wal_end: 0x200,
            server_clock: 0,
            data: bytes::Bytes::from(bytes),
        }
    }

    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    fn tuple(out: &mut Vec<u8>, values: &[&str]) {
        out.extend_from_slice(&(values.len() as u16).to_be_bytes());
        for v in values {
            out.push(b't');
            out.extend_from_slice(&(v.len() as i32).to_be_bytes());
            out.extend_from_slice(v.as_bytes());
        }
    }

    /// A watermark transaction as PostgreSQL 12 and 13 send it: the
    /// table's Relation, then the delete of the previous row and the
    /// insert of the new one.
    #[test]
    fn rows_of_the_watermark_table_are_watermarks_and_never_changes() {
        let dir = tempfile::tempdir().unwrap();
        let mut decoder = Decoder::new(0, dir.path()).unwrap();
        let mut events = Vec::new();
        let mut relation = vec![b'R'];
        relation.extend_from_slice(&REL.to_be_bytes());
        cstr(&mut relation, WATERMARK_TABLE.0);
        cstr(&mut relation, WATERMARK_TABLE.1);
        relation.push(b'd');
        relation.extend_from_slice(&2u16.to_be_bytes());
        for (flags, name, oid) in [(1u8, "id", 20u32), (0, "content", 25)] {
            relation.push(flags);
            cstr(&mut relation, name);
            relation.extend_from_slice(&oid.to_be_bytes());
            relation.extend_from_slice(&(-1i32).to_be_bytes());
        }
        let mut begin = vec![b'B'];
        begin.extend_from_slice(&0x180u64.to_be_bytes());
        begin.extend_from_slice(&0i64.to_be_bytes());
        begin.extend_from_slice(&7u32.to_be_bytes());
        let mut delete = vec![b'D'];
        delete.extend_from_slice(&REL.to_be_bytes());
        delete.push(b'K');
        tuple(&mut delete, &["6", ""]);
        let content = r#"{"pipeline":"p","chunk":3,"mark":"low"}"#;
        let mut insert = vec![b'I'];
        insert.extend_from_slice(&REL.to_be_bytes());
        insert.push(b'N');
        tuple(&mut insert, &["7", content]);
        let mut truncate = vec![b'T'];
        truncate.extend_from_slice(&1u32.to_be_bytes());
        truncate.push(0);
        truncate.extend_from_slice(&REL.to_be_bytes());
        let mut commit = vec![b'C', 0];
        commit.extend_from_slice(&0x180u64.to_be_bytes());
        commit.extend_from_slice(&0x190u64.to_be_bytes());
        commit.extend_from_slice(&0i64.to_be_bytes());
        for m in [relation, begin, delete, insert, truncate, commit] {
            decoder.handle(xlog(m), &mut events).unwrap();
        }
        assert_eq!(events.len(), 3, "Begin, the watermark, Commit: {events:?}");
        assert!(matches!(events[0], SourceEvent::Begin));
        let SourceEvent::Watermark {
            content: got,
            commit_lsn,
            ..
        } = &events[1]
        else {
            panic!("{:?}", events[1]);
        };
        assert_eq!((got.as_ref(), *commit_lsn), (content.as_bytes(), 0x180));
        assert!(matches!(events[2], SourceEvent::Commit { end_lsn: 0x190 }));
    }
}
