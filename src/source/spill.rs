//! Buffers for transactions the server streams before they commit
//! (pgoutput protocol 2, Postgres 14+), bounded in memory.
//!
//! A streamed transaction's changes arrive in blocks while it is still in
//! progress; they may be archived only once it commits, and must be dropped
//! if it (or one of its subtransactions) aborts. Up to [`MEMORY_BUDGET`]
//! bytes of rendered changes are kept in memory across all open
//! transactions; past that, a transaction's changes are appended to its own
//! scratch file in a folder of the state folder, emptied at every session
//! start (the server streams in-progress transactions again after a
//! reconnect).
//!
//! The file is append-only and read once, front to back, at commit: a
//! spilled change costs a buffered write and a buffered read, nothing per
//! change in a database (a SQLite table did this before and was over a
//! third of the CPU of archiving a 1,000,000-row transaction). A
//! subtransaction's abort is remembered and its changes are skipped when
//! the file is read.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::archive::envelope::{Change, Op, RowSet, TableRef};
use crate::{Error, Result};

/// Rendered bytes of in-progress changes kept in memory before spilling.
pub(crate) const MEMORY_BUDGET: usize = 16 * 1024 * 1024;

/// Buffer size of a spill file's writer and reader.
const IO_BUFFER: usize = 64 * 1024;

fn op_code(op: Op) -> u8 {
    match op {
        Op::Insert => 0,
        Op::Update => 1,
        Op::Delete => 2,
        Op::Truncate => 3,
        Op::Read => 4,
    }
}

fn op_from(code: u8) -> std::io::Result<Op> {
    Ok(match code {
        0 => Op::Insert,
        1 => Op::Update,
        2 => Op::Delete,
        3 => Op::Truncate,
        4 => Op::Read,
        _ => {
            return Err(std::io::Error::new(
                ErrorKind::InvalidData,
                format!("a spilled change has the unknown op code {code}"),
            ));
        }
    })
}

fn size(c: &Change) -> usize {
    64 + c.data.as_ref().map_or(0, Vec::len) + c.old.as_ref().map_or(0, Vec::len)
}

/// One spilled transaction: its file, open for appending, and the
/// subtransactions that aborted after some of their changes were written.
struct SpillFile {
    path: PathBuf,
    out: BufWriter<File>,
    aborted: HashSet<u32>,
}

/// The open streamed transactions' changes (top-level xid -> changes with
/// their subtransaction id, in stream order).
pub(crate) struct StreamBuffers {
    memory: HashMap<u32, Vec<(u32, Change)>>,
    memory_bytes: usize,
    budget: usize,
    spilled: HashMap<u32, SpillFile>,
    dir: PathBuf,
    /// Tables of spilled changes: a record names its table by index here.
    tables: Vec<Arc<TableRef>>,
    table_ids: HashMap<String, u32>,
    /// Spilled transactions taken for reading and not read to the end.
    reading: usize,
}

/// A spilled transaction being read back at its commit.
struct SpillReader {
    path: PathBuf,
    input: BufReader<File>,
    aborted: HashSet<u32>,
}

/// A committed transaction's changes, read out in order, a chunk at a time.
/// One dropped before its end (the session stopping) leaves its file to the
/// next session's start, which empties the folder.
pub(crate) struct Drain {
    memory: VecDeque<Change>,
    spilled: Option<SpillReader>,
}

impl StreamBuffers {
    /// Buffers spilling to files in the folder `dir` (removed now, with
    /// whatever an earlier session left in it, and created on first spill).
    pub(crate) fn new(dir: &Path, budget: usize) -> Result<Self> {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("cannot remove {}", dir.display()), e)),
        }
        Ok(StreamBuffers {
            memory: HashMap::new(),
            memory_bytes: 0,
            budget,
            spilled: HashMap::new(),
            dir: dir.to_path_buf(),
            tables: Vec::new(),
            table_ids: HashMap::new(),
            reading: 0,
        })
    }

    /// No transaction is open.
    pub(crate) fn is_empty(&self) -> bool {
        self.memory.is_empty() && self.spilled.is_empty()
    }

    fn table_id(&mut self, table: &Arc<TableRef>) -> u32 {
        if let Some(&id) = self.table_ids.get(&table.name) {
            return id;
        }
        let id = self.tables.len() as u32;
        self.tables.push(table.clone());
        self.table_ids.insert(table.name.clone(), id);
        id
    }

    fn open_spill(&mut self, xid: u32) -> Result<SpillFile> {
        let io =
            |what: &str, path: &Path, e| Error::io(format!("cannot {what} {}", path.display()), e);
        std::fs::create_dir_all(&self.dir).map_err(|e| io("create", &self.dir, e))?;
        let path = self.dir.join(format!("{xid}.spill"));
        let file = File::create(&path).map_err(|e| io("create", &path, e))?;
        Ok(SpillFile {
            path,
            out: BufWriter::with_capacity(IO_BUFFER, file),
            aborted: HashSet::new(),
        })
    }

    /// Appends one change to `file`: subxid u32, op u8, table u32, row
    /// count u8 and the rows (u64 each), then data and old as a u32 length
    /// plus one (0 for none) and their bytes; little-endian.
    fn write_record(file: &mut SpillFile, table: u32, subxid: u32, c: &Change) -> Result<()> {
        let rows = c.rows.as_slice();
        let mut head = [0u8; 4 + 1 + 4 + 1 + 16];
        head[0..4].copy_from_slice(&subxid.to_le_bytes());
        head[4] = op_code(c.op);
        head[5..9].copy_from_slice(&table.to_le_bytes());
        head[9] = rows.len() as u8;
        for (i, r) in rows.iter().enumerate() {
            head[10 + 8 * i..18 + 8 * i].copy_from_slice(&r.to_le_bytes());
        }
        let out = &mut file.out;
        let mut write = || -> std::io::Result<()> {
            out.write_all(&head[..10 + 8 * rows.len()])?;
            for part in [&c.data, &c.old] {
                match part {
                    None => out.write_all(&0u32.to_le_bytes())?,
                    Some(bytes) => {
                        // Postgres values are under 1 GiB; a row can't reach 4 GiB.
                        let len = u32::try_from(bytes.len() + 1).map_err(|_| {
                            std::io::Error::new(ErrorKind::InvalidData, "a change of 4 GiB or more")
                        })?;
                        out.write_all(&len.to_le_bytes())?;
                        out.write_all(bytes)?;
                    }
                }
            }
            Ok(())
        };
        write().map_err(|e| Error::io(format!("cannot write {}", file.path.display()), e))
    }

    /// Adds a change of subtransaction `subxid` to transaction `xid`.
    pub(crate) fn push(&mut self, xid: u32, subxid: u32, change: Change) -> Result<()> {
        if self.spilled.contains_key(&xid) {
            let table = self.table_id(&change.table);
            let file = self.spilled.get_mut(&xid).expect("checked above");
            return Self::write_record(file, table, subxid, &change);
        }
        let n = size(&change);
        if self.memory_bytes + n > self.budget {
            // Move this transaction's buffered changes out, then go on on disk.
            let held = self.memory.remove(&xid).unwrap_or_default();
            let mut file = self.open_spill(xid)?;
            for (sub, c) in held.iter().chain(std::iter::once(&(subxid, change))) {
                let table = self.table_id(&c.table);
                Self::write_record(&mut file, table, *sub, c)?;
            }
            for (_, c) in &held {
                self.memory_bytes -= size(c);
            }
            self.spilled.insert(xid, file);
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
    pub(crate) fn abort(&mut self, xid: u32, subxid: u32) -> Result<()> {
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
        if whole {
            if let Some(file) = self.spilled.remove(&xid) {
                remove(&file.path)?;
            }
        } else if let Some(file) = self.spilled.get_mut(&xid) {
            file.aborted.insert(subxid);
        }
        self.forget_tables();
        Ok(())
    }

    /// Table indexes are needed while a spilled transaction is open or
    /// being read.
    fn forget_tables(&mut self) {
        if self.spilled.is_empty() && self.reading == 0 {
            self.tables.clear();
            self.table_ids.clear();
        }
    }

    /// Takes a committed transaction's changes for reading in order.
    pub(crate) fn take(&mut self, xid: u32) -> Result<Drain> {
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
        let spilled = match self.spilled.remove(&xid) {
            None => None,
            Some(SpillFile {
                path,
                mut out,
                aborted,
            }) => {
                let io = |what: &str, e| Error::io(format!("cannot {what} {}", path.display()), e);
                out.flush().map_err(|e| io("write", e))?;
                drop(out);
                let file = File::open(&path).map_err(|e| io("read", e))?;
                self.reading += 1;
                Some(SpillReader {
                    input: BufReader::with_capacity(IO_BUFFER, file),
                    path,
                    aborted,
                })
            }
        };
        Ok(Drain { memory, spilled })
    }

    /// The next up to `max` changes of `drain`; empty when it is done.
    pub(crate) fn next_chunk(&mut self, drain: &mut Drain, max: usize) -> Result<Vec<Change>> {
        if let Some(reader) = drain.spilled.as_mut() {
            let mut out = Vec::with_capacity(max);
            while out.len() < max {
                match read_record(&mut reader.input, &self.tables) {
                    Ok(Some((subxid, change))) => {
                        if !reader.aborted.contains(&subxid) {
                            out.push(change);
                        }
                    }
                    Ok(None) => {
                        remove(&reader.path)?;
                        drain.spilled = None;
                        self.reading -= 1;
                        self.forget_tables();
                        break;
                    }
                    Err(e) => {
                        return Err(Error::io(
                            format!("cannot read {}", reader.path.display()),
                            e,
                        ));
                    }
                }
            }
            if !out.is_empty() {
                return Ok(out);
            }
        }
        let n = max.min(drain.memory.len());
        Ok(drain.memory.drain(..n).collect())
    }
}

fn remove(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("cannot remove {}", path.display()), e)),
    }
}

/// Reads the record [`StreamBuffers::write_record`] wrote; `None` at the end
/// of the file.
fn read_record(
    input: &mut BufReader<File>,
    tables: &[Arc<TableRef>],
) -> std::io::Result<Option<(u32, Change)>> {
    use std::io::BufRead as _;
    if input.fill_buf()?.is_empty() {
        return Ok(None);
    }
    let mut head = [0u8; 10];
    input.read_exact(&mut head)?;
    let u32_at = |b: &[u8], i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let subxid = u32_at(&head, 0);
    let table = tables
        .get(u32_at(&head, 5) as usize)
        .cloned()
        .ok_or_else(|| {
            std::io::Error::new(
                ErrorKind::InvalidData,
                "a spilled change names an unknown table",
            )
        })?;
    let mut rows = RowSet::default();
    for _ in 0..head[9].min(2) {
        let mut r = [0u8; 8];
        input.read_exact(&mut r)?;
        rows.push(u64::from_le_bytes(r));
    }
    let mut part = || -> std::io::Result<Option<Vec<u8>>> {
        let mut len = [0u8; 4];
        input.read_exact(&mut len)?;
        match u32::from_le_bytes(len) {
            0 => Ok(None),
            n => {
                let mut bytes = vec![0u8; n as usize - 1];
                input.read_exact(&mut bytes)?;
                Ok(Some(bytes))
            }
        }
    };
    let data = part()?;
    let old = part()?;
    Ok(Some((
        subxid,
        Change {
            op: op_from(head[4])?,
            table,
            data,
            old,
            commit_lsn: 0,
            commit_ts: 0,
            index: 0,
            rows,
        },
    )))
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
        let mut d = b.take(xid).unwrap();
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
            let mut b = StreamBuffers::new(&dir.path().join("spill"), budget).unwrap();
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
    fn a_spilled_change_reads_back_with_every_field() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = StreamBuffers::new(&dir.path().join("spill"), 0).unwrap();
        let mut rows = RowSet::one(u64::MAX);
        rows.push(3);
        let changes = vec![
            Change {
                op: Op::Update,
                table: Arc::new(TableRef::new("s", "a")),
                data: Some(b"{\"k\":2}".to_vec()),
                old: Some(b"{\"k\":1}".to_vec()),
                commit_lsn: 0,
                commit_ts: 0,
                index: 0,
                rows,
            },
            Change {
                op: Op::Delete,
                table: Arc::new(TableRef::new("s", "b")),
                data: None,
                old: Some(Vec::new()),
                commit_lsn: 0,
                commit_ts: 0,
                index: 0,
                rows: RowSet::default(),
            },
            Change {
                op: Op::Truncate,
                table: Arc::new(TableRef::new("s", "a")),
                data: None,
                old: None,
                commit_lsn: 0,
                commit_ts: 0,
                index: 0,
                rows: RowSet::one(0),
            },
        ];
        for c in &changes {
            b.push(5, 5, c.clone()).unwrap();
        }
        // Another spilled transaction aborts while this one is read: the
        // table names the reader needs stay known.
        b.push(6, 6, changes[0].clone()).unwrap();
        let mut d = b.take(5).unwrap();
        let first = b.next_chunk(&mut d, 1).unwrap();
        b.abort(6, 6).unwrap();
        let mut got = first;
        got.extend(b.next_chunk(&mut d, 10).unwrap());
        assert!(b.next_chunk(&mut d, 10).unwrap().is_empty());
        let show = |c: &Change| {
            (
                c.op,
                c.table.name.clone(),
                c.table.json.clone(),
                c.data.clone(),
                c.old.clone(),
                c.rows,
            )
        };
        assert_eq!(
            got.iter().map(show).collect::<Vec<_>>(),
            changes.iter().map(show).collect::<Vec<_>>()
        );
        assert!(b.is_empty());
        assert_eq!(
            std::fs::read_dir(dir.path().join("spill")).unwrap().count(),
            0,
            "read and aborted spill files are removed"
        );
    }

    #[test]
    fn order_is_kept_across_the_spill() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = StreamBuffers::new(&dir.path().join("spill"), 500).unwrap();
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
