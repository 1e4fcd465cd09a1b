//! Buffers for transactions the server streams before they commit
//! (pgoutput protocol 2, Postgres 14+), bounded in memory.
//!
//! A streamed transaction's changes arrive in blocks while it is still in
//! progress; they may be archived only once it commits, and must be dropped
//! if it (or one of its subtransactions) aborts. Up to [`MEMORY_BUDGET`]
//! bytes of rendered changes are kept in memory across all open
//! transactions; past that, a transaction's changes go to a scratch SQLite
//! file in the state folder, which is emptied at every session start (the
//! server streams in-progress transactions again after a reconnect).

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rusqlite::{Connection, params};

use crate::envelope::{Change, Op, RowSet, TableRef};
use crate::{Error, Result};

/// Rendered bytes of in-progress changes kept in memory before spilling.
pub const MEMORY_BUDGET: usize = 16 * 1024 * 1024;

fn op_code(op: Op) -> i64 {
    match op {
        Op::Insert => 0,
        Op::Update => 1,
        Op::Delete => 2,
        Op::Truncate => 3,
        Op::Read => 4,
    }
}

fn op_from(code: i64) -> Op {
    match code {
        1 => Op::Update,
        2 => Op::Delete,
        3 => Op::Truncate,
        4 => Op::Read,
        _ => Op::Insert,
    }
}

fn size(c: &Change) -> usize {
    64 + c.data.as_ref().map_or(0, Vec::len) + c.old.as_ref().map_or(0, Vec::len)
}

/// The open streamed transactions' changes (top-level xid -> changes with
/// their subtransaction id, in stream order).
pub struct StreamBuffers {
    memory: HashMap<u32, Vec<(u32, Change)>>,
    memory_bytes: usize,
    budget: usize,
    spilled: HashSet<u32>,
    spill: Option<Connection>,
    path: PathBuf,
    tables: HashMap<String, Arc<TableRef>>,
}

/// A committed transaction's changes, read out in order, a chunk at a time.
pub struct Drain {
    memory: VecDeque<Change>,
    spilled_xid: Option<u32>,
    last_n: i64,
}

impl StreamBuffers {
    /// Buffers spilling to `path` (removed now and created on first spill).
    pub fn new(path: &Path, budget: usize) -> Result<Self> {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("cannot remove {}", path.display()), e)),
        }
        Ok(StreamBuffers {
            memory: HashMap::new(),
            memory_bytes: 0,
            budget,
            spilled: HashSet::new(),
            spill: None,
            path: path.to_path_buf(),
            tables: HashMap::new(),
        })
    }

    /// No transaction is open.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty() && self.spilled.is_empty()
    }

    fn err(&self) -> impl Fn(rusqlite::Error) -> Error + use<> {
        let path = self.path.display().to_string();
        move |source| Error::State {
            path: path.clone(),
            source,
        }
    }

    fn spill_db(&mut self) -> Result<&Connection> {
        if self.spill.is_none() {
            let err = |source| Error::State {
                path: self.path.display().to_string(),
                source,
            };
            let conn = Connection::open(&self.path).map_err(err)?;
            // Scratch data, rebuilt from the server after any crash: no journal,
            // no syncs, and one transaction that is never committed (this
            // connection reads its own writes), so a spilled change costs an
            // insert into the page cache, not a write to the file.
            conn.execute_batch(
                "PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF;
                 CREATE TABLE spill (n INTEGER PRIMARY KEY AUTOINCREMENT, xid INTEGER NOT NULL,
                   subxid INTEGER NOT NULL, op INTEGER NOT NULL, tbl TEXT NOT NULL, data BLOB,
                   old BLOB, row1 INTEGER, row2 INTEGER);
                 CREATE INDEX spill_xid ON spill (xid, n);
                 BEGIN;",
            )
            .map_err(err)?;
            self.spill = Some(conn);
        }
        Ok(self.spill.as_ref().expect("opened above"))
    }

    fn write_spill(&mut self, xid: u32, subxid: u32, c: &Change) -> Result<()> {
        let rows = c.rows.as_slice();
        let (r1, r2) = (
            rows.first().map(|&r| r as i64),
            rows.get(1).map(|&r| r as i64),
        );
        let err = self.err();
        let db = self.spill_db()?;
        db.prepare_cached(
            "INSERT INTO spill (xid, subxid, op, tbl, data, old, row1, row2)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )
        .and_then(|mut st| {
            st.execute(params![
                xid,
                subxid,
                op_code(c.op),
                c.table.name,
                c.data,
                c.old,
                r1,
                r2
            ])
        })
        .map(|_| ())
        .map_err(err)
    }

    /// Adds a change of subtransaction `subxid` to transaction `xid`.
    pub fn push(&mut self, xid: u32, subxid: u32, change: Change) -> Result<()> {
        self.tables
            .entry(change.table.name.clone())
            .or_insert_with(|| change.table.clone());
        if self.spilled.contains(&xid) {
            return self.write_spill(xid, subxid, &change);
        }
        let n = size(&change);
        if self.memory_bytes + n > self.budget {
            // Move this transaction's buffered changes out, then go on on disk.
            let held = self.memory.remove(&xid).unwrap_or_default();
            for (sub, c) in &held {
                self.memory_bytes -= size(c);
                self.write_spill(xid, *sub, c)?;
            }
            self.write_spill(xid, subxid, &change)?;
            self.spilled.insert(xid);
            tracing::debug!(
                xid,
                changes = held.len() + 1,
                "spilled a streamed transaction to disk"
            );
            return Ok(());
        }
        self.memory_bytes += n;
        self.memory.entry(xid).or_default().push((subxid, change));
        Ok(())
    }

    /// Drops the changes of an aborted subtransaction (or, when `subxid ==
    /// xid`, of the whole transaction).
    pub fn abort(&mut self, xid: u32, subxid: u32) -> Result<()> {
        let whole = xid == subxid;
        if let Some(list) = self.memory.get_mut(&xid) {
            let before: usize = list.iter().map(|(_, c)| size(c)).sum();
            list.retain(|(s, _)| !whole && *s != subxid);
            let after: usize = list.iter().map(|(_, c)| size(c)).sum();
            self.memory_bytes -= before - after;
            if whole {
                self.memory.remove(&xid);
            }
        }
        if self.spilled.contains(&xid) {
            let err = self.err();
            let db = self.spill_db()?;
            let result = if whole {
                db.execute("DELETE FROM spill WHERE xid = ?1", [xid])
            } else {
                db.execute(
                    "DELETE FROM spill WHERE xid = ?1 AND subxid = ?2",
                    [xid, subxid],
                )
            };
            result.map_err(err)?;
            if whole {
                self.spilled.remove(&xid);
            }
        }
        Ok(())
    }

    /// Takes a committed transaction's changes for reading in order.
    pub fn take(&mut self, xid: u32) -> Drain {
        let memory: VecDeque<Change> = self
            .memory
            .remove(&xid)
            .unwrap_or_default()
            .into_iter()
            .map(|(_, c)| {
                self.memory_bytes -= size(&c);
                c
            })
            .collect();
        let spilled_xid = self.spilled.remove(&xid).then_some(xid);
        Drain {
            memory,
            spilled_xid,
            last_n: 0,
        }
    }

    /// The next up to `max` changes of `drain`; empty when it is done.
    pub fn next_chunk(&mut self, drain: &mut Drain, max: usize) -> Result<Vec<Change>> {
        if let Some(xid) = drain.spilled_xid {
            let tables = &self.tables;
            let last_n = drain.last_n;
            let err = self.err();
            let db = self
                .spill
                .as_ref()
                .expect("a spilled transaction has a spill file");
            let mut st = db
                .prepare_cached(
                    "SELECT n, op, tbl, data, old, row1, row2 FROM spill
                     WHERE xid = ?1 AND n > ?2 ORDER BY n LIMIT ?3",
                )
                .map_err(&err)?;
            let rows = st
                .query_map(params![xid, last_n, max as i64], |r| {
                    let name: String = r.get(2)?;
                    let mut rows = RowSet::default();
                    if let Some(h) = r.get::<_, Option<i64>>(5)? {
                        rows.push(h as u64);
                    }
                    if let Some(h) = r.get::<_, Option<i64>>(6)? {
                        rows.push(h as u64);
                    }
                    Ok((
                        r.get::<_, i64>(0)?,
                        Change {
                            op: op_from(r.get(1)?),
                            table: tables
                                .get(&name)
                                .cloned()
                                .unwrap_or_else(|| Arc::new(table_ref(&name))),
                            data: r.get(3)?,
                            old: r.get(4)?,
                            commit_lsn: 0,
                            commit_ts: 0,
                            index: 0,
                            rows,
                        },
                    ))
                })
                .map_err(&err)?;
            let mut out = Vec::with_capacity(max);
            for row in rows {
                let (n, c) = row.map_err(&err)?;
                drain.last_n = n;
                out.push(c);
            }
            drop(st);
            if out.len() < max {
                drain.spilled_xid = None;
                db.execute("DELETE FROM spill WHERE xid = ?1", [xid])
                    .map_err(&err)?;
            }
            if !out.is_empty() {
                return Ok(out);
            }
        }
        let n = max.min(drain.memory.len());
        Ok(drain.memory.drain(..n).collect())
    }
}

fn table_ref(name: &str) -> TableRef {
    let (schema, table) = name.split_once('.').unwrap_or(("public", name));
    TableRef::new(schema, table)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(i: u64) -> Change {
        Change {
            op: Op::Insert,
            table: Arc::new(TableRef::new("public", "t")),
            data: Some(format!("{{\"id\":{i}}}").into_bytes()),
            old: None,
            commit_lsn: 0,
            commit_ts: 0,
            index: 0,
            rows: RowSet::one(i),
        }
    }

    fn drain_all(b: &mut StreamBuffers, xid: u32) -> Vec<String> {
        let mut d = b.take(xid);
        let mut out = Vec::new();
        loop {
            let chunk = b.next_chunk(&mut d, 3).unwrap();
            if chunk.is_empty() {
                return out;
            }
            out.extend(
                chunk
                    .into_iter()
                    .map(|c| String::from_utf8(c.data.unwrap()).unwrap()),
            );
        }
    }

    #[test]
    fn aborted_subtransactions_are_dropped_in_memory_and_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        for budget in [usize::MAX, 200] {
            let mut b = StreamBuffers::new(&dir.path().join("spill.sqlite"), budget).unwrap();
            for i in 0..10 {
                // Subtransaction 8 holds the odd rows; it aborts.
                b.push(7, if i % 2 == 1 { 8 } else { 7 }, change(i))
                    .unwrap();
            }
            b.push(9, 9, change(100)).unwrap();
            b.abort(7, 8).unwrap();
            b.abort(9, 9).unwrap();
            let got = drain_all(&mut b, 7);
            let want: Vec<String> = (0..10)
                .step_by(2)
                .map(|i| format!("{{\"id\":{i}}}"))
                .collect();
            assert_eq!(got, want, "budget {budget}");
            assert!(b.is_empty());
            assert_eq!(b.memory_bytes, 0);
        }
    }

    #[test]
    fn order_is_kept_across_the_spill() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = StreamBuffers::new(&dir.path().join("spill.sqlite"), 500).unwrap();
        for i in 0..50 {
            b.push(1, 1, change(i)).unwrap();
        }
        assert!(b.memory_bytes <= 500);
        let got = drain_all(&mut b, 1);
        assert_eq!(got.len(), 50);
        assert!(
            got.iter()
                .enumerate()
                .all(|(i, s)| *s == format!("{{\"id\":{i}}}"))
        );
    }
}
