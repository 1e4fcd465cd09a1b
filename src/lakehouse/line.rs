//! What reading an archive line gives, shared by the general reader
//! ([`super::read`]) and the fast scanner under it ([`super::scan`]): the
//! tables' shapes by index, the fields one pass finds, a row as cells, and
//! the row key's JSON text. Its own module so that the scanner does not
//! import the reader that calls it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use compact_str::CompactString;
use serde_json::{Map, Value};

use super::typing::{Cell, TableShape};

/// The key of a row as JSON: `{"name":value,...}` over the key columns in
/// the order of their names (serde_json's map order, which the keys of
/// every compacted archive were written in: the bucket of a row is the hash
/// of this text, so it must never change), a missing column as null.
pub fn key_json(shape: &TableShape, row: &Map<String, Value>) -> Option<CompactString> {
    key_text(shape, |i| row.get(&shape.columns[i].name))
}

/// [`key_json`] of the key columns' values `value(column index)`.
pub fn key_text<'v>(
    shape: &TableShape,
    value: impl Fn(usize) -> Option<&'v Value>,
) -> Option<CompactString> {
    key_with(shape, |out, i| {
        serde_json::to_writer(&mut *out, value(i).unwrap_or(&Value::Null))
            .expect("writes to memory")
    })
}

/// [`key_json`] with each key column's value written by `value(out,
/// column index)` as serde_json writes it.
pub fn key_with(shape: &TableShape, value: impl Fn(&mut Vec<u8>, usize)) -> Option<CompactString> {
    let write = |out: &mut Vec<u8>, i: usize| {
        serde_json::to_writer(&mut *out, &shape.columns[i].name).expect("writes to memory");
        out.push(b':');
        value(out, i);
    };
    if shape.key.is_empty() {
        return None;
    }
    let name = |i: usize| shape.columns[i].name.as_str();
    // `TableShape::from_records` orders the key by name; any other shape is
    // ordered here (a copy per key written).
    let by_name: std::borrow::Cow<[usize]> =
        if shape.key.windows(2).all(|w| name(w[0]) < name(w[1])) {
            std::borrow::Cow::Borrowed(&shape.key)
        } else {
            let mut key = shape.key.clone();
            key.sort_by(|a, b| name(*a).cmp(name(*b)));
            key.dedup();
            std::borrow::Cow::Owned(key)
        };
    thread_local! {
        /// Where a key is written before it is copied (inline, mostly):
        /// reused, so a key costs no allocation; let go of after a huge
        /// key, so a thread does not hold that much for the rest of a run.
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with_borrow_mut(|out| {
        out.clear();
        out.push(b'{');
        for (n, &i) in by_name.iter().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            write(out, i);
        }
        out.push(b'}');
        let key = CompactString::from_utf8(out.as_slice()).expect("serde_json writes UTF-8");
        if out.capacity() > 64 << 10 {
            *out = Vec::new();
        }
        Some(key)
    })
}

/// The shapes of the tables a run compacts, by name and by index: a typed
/// line names its table by index, so no reference count shared by the
/// threads is touched per line.
#[derive(Debug, Default)]
pub struct Shapes {
    list: Vec<Arc<TableShape>>,
    by_name: HashMap<String, usize>,
    /// By index: whether the table's spool still combines its changes,
    /// so that they are read as typed rows too (see [`super::read::ObjectReader`]).
    /// Every table with a key does at first; set off by the run once its
    /// spool stops (never back on within a run).
    combines: Vec<AtomicBool>,
}

impl Shapes {
    /// The shapes of a run's (or a query's) tables, by index.
    pub fn new(shapes: impl IntoIterator<Item = Arc<TableShape>>) -> Shapes {
        let list: Vec<Arc<TableShape>> = shapes.into_iter().collect();
        let by_name = list
            .iter()
            .enumerate()
            .map(|(i, s)| (s.table.clone(), i))
            .collect();
        let combines = list
            .iter()
            .map(|s| AtomicBool::new(!s.key.is_empty()))
            .collect();
        Shapes {
            list,
            by_name,
            combines,
        }
    }

    /// Whether the changes of table `i` are read as typed rows too: its
    /// spool combines them.
    pub fn combines(&self, i: usize) -> bool {
        self.combines[i].load(Ordering::Relaxed)
    }

    /// Table `i`'s spool no longer combines changes: objects read from now
    /// on give its changes as columns only. Objects read before still give
    /// rows, which the run then only counts.
    pub fn stop_combining(&self, i: usize) {
        self.combines[i].store(false, Ordering::Relaxed);
    }

    /// The index and shape of `table`.
    pub fn get(&self, table: &str) -> Option<(usize, &Arc<TableShape>)> {
        // A few names are compared faster than one is hashed (SipHash was
        // 2.5% of the parse).
        let i = if self.list.len() <= 8 {
            self.list.iter().position(|s| s.table == table)
        } else {
            self.by_name.get(table).copied()
        };
        i.map(|i| (i, &self.list[i]))
    }

    /// The shape of index `i` (from [`Shapes::get`] or a [`super::read::Line`]).
    pub fn shape(&self, i: usize) -> &Arc<TableShape> {
        &self.list[i]
    }

    /// How many tables there are (indexes `0..len()`).
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether there is no table.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

impl std::ops::Index<&str> for Shapes {
    type Output = Arc<TableShape>;

    /// The shape of `table`, which must be one of them.
    fn index(&self, table: &str) -> &Arc<TableShape> {
        self.get(table)
            .unwrap_or_else(|| panic!("{table} is not a compacted table"))
            .1
    }
}

/// What the single pass over a line found.
pub struct FastLine<'s> {
    /// The op, as the line names it.
    pub op: Option<CompactString>,
    /// Whether the line named its table.
    pub table: bool,
    /// The index and shape of the table it named.
    pub shape: Option<(usize, &'s TableShape)>,
    /// The row of `data` (`Err`: a value that does not fit its column,
    /// reported once the line is read).
    pub data: Option<Result<Row, String>>,
    /// The old row, when the line has one.
    pub old: Option<Map<String, Value>>,
    /// The line's seq.
    pub seq: Option<u64>,
    /// The commit LSN.
    pub lsn: Option<CompactString>,
    /// The vector for the cells, when `data` did not take it.
    pub spare: Vec<Cell>,
}

/// `data` as cells, with the row's key as [`key_json`] gives it.
pub struct Row {
    /// One cell per shape column.
    pub cells: Vec<Cell>,
    /// The row's key as JSON; `None` for a table without key.
    pub key: Option<CompactString>,
}
