//! Typed changes as the history's Arrow columns, built where the archive is
//! parsed: the parse tasks append each change of a table to its
//! [`ChangeColumns`] and hand over one [`ChangeBatch`] per table and
//! object, so the run loop, the history writer and the spool take a batch
//! at a time, not a change at a time.
//!
//! Why: held as typed rows, each change was put behind a reference count
//! and moved through the run loop (one thread), buffered again by the
//! history writer and converted to columns on its encoding task, cell by
//! cell from rows spread over the heap. Appended where they are parsed,
//! the values go into columns once, on the parse tasks (both cores), and
//! the run loop handles a batch per table and object. Measured on the
//! 10,000-line benchmark archive, three alternated runs: user CPU 6.6-6.9
//! s -> 5.7-6.0 s, wall 4.0-4.7 s -> 3.6-3.7 s, the same output.
//!
//! A table whose spool still combines its changes (see [`crate::compact::spool`])
//! also needs them as typed rows: the parse keeps those beside the batch
//! (see [`super::line::Shapes::combines`]).

use std::borrow::Borrow;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BinaryArray, BinaryBuilder, Int64Array, StringArray, StringBuilder, UInt8Array,
};
use arrow::compute::concat;

use super::change::{ChangeOp, TypedChange, op_code};
use super::typing::array::ColumnBuilder;
use super::typing::{Cell, TableShape};

/// A change as its parts, borrowed from a [`TypedChange`].
#[derive(Debug, Clone, Copy)]
pub struct Change<'a> {
    /// See [`TypedChange::op_name`].
    pub op_name: &'static str,
    /// See [`TypedChange::op`].
    pub op: ChangeOp,
    /// See [`TypedChange::seq`].
    pub seq: u64,
    /// See [`TypedChange::lsn`].
    pub lsn: &'a str,
    /// See [`TypedChange::key`].
    pub key: Option<&'a str>,
    /// See [`TypedChange::old_key`].
    pub old_key: Option<&'a str>,
    /// See [`TypedChange::cells`].
    pub cells: &'a [Cell],
    /// See [`TypedChange::old`].
    pub old: Option<&'a str>,
    /// See [`TypedChange::unchanged`].
    pub unchanged: Option<&'a str>,
}

impl<'a> From<&'a TypedChange> for Change<'a> {
    fn from(c: &'a TypedChange) -> Change<'a> {
        Change {
            op_name: c.op_name,
            op: c.op,
            seq: c.seq,
            lsn: &c.lsn,
            key: c.key.as_deref(),
            old_key: c.old_key.as_deref(),
            cells: &c.cells,
            old: c.old.as_deref(),
            unchanged: c.unchanged.as_deref(),
        }
    }
}

impl Change<'_> {
    /// About the memory the change takes as typed values (the key, the seq
    /// and lsn, one cell per column and the text they hold): what the
    /// latest view's bucket count is chosen from. A latest view holds less
    /// per row (its values stay in Arrow batches), so the estimate errs on
    /// the safe side.
    pub fn row_bytes(&self) -> u64 {
        let text: usize = self
            .cells
            .iter()
            .map(|c| match c {
                Cell::Str(s) => s.len() + 16,
                _ => 0,
            })
            .sum();
        (120 + self.key.map_or(0, str::len) + self.lsn.len() + 32 * self.cells.len() + text) as u64
    }

    /// The key the row had before, when the change moved it to another.
    pub fn moved_from(&self) -> Option<&str> {
        self.key
            .zip(self.old_key)
            .filter(|(key, old)| self.op == ChangeOp::Upsert && old != key)
            .map(|(_, old)| old)
    }

    /// Whether the change moved its row to another key leaving columns out
    /// (unchanged TOAST): their values must be carried from the old key.
    pub fn carries(&self) -> bool {
        self.moved_from().is_some() && self.cells.contains(&Cell::Absent)
    }
}

/// One table's changes being appended (see the module doc).
pub struct ChangeColumns {
    /// Whether the table has a key (its changes are counted for the spool).
    keyed: bool,
    data: Vec<ColumnBuilder>,
    /// `_op` (names from a handful of statics: the text is copied once,
    /// when the batch is made).
    op_names: Vec<&'static str>,
    /// The spool's `_op`.
    ops: Vec<u8>,
    seqs: Vec<i64>,
    lsns: StringBuilder,
    keys: StringBuilder,
    olds: StringBuilder,
    unchanged: StringBuilder,
    old_keys: StringBuilder,
    absent: BinaryBuilder,
    /// Reused for each change's bitmap of left-out columns.
    bits: Vec<u8>,
    counts: Counts,
}

impl ChangeColumns {
    /// Columns for about `capacity` changes of `shape` (grown as needed).
    pub fn new(shape: &TableShape, capacity: usize) -> ChangeColumns {
        ChangeColumns {
            keyed: !shape.key.is_empty(),
            data: shape
                .columns
                .iter()
                .map(|c| ColumnBuilder::new(c.kind, capacity))
                .collect(),
            op_names: Vec::with_capacity(capacity),
            ops: Vec::with_capacity(capacity),
            seqs: Vec::with_capacity(capacity),
            lsns: StringBuilder::with_capacity(capacity, capacity * 12),
            keys: StringBuilder::with_capacity(capacity, capacity * 12),
            olds: StringBuilder::new(),
            unchanged: StringBuilder::new(),
            old_keys: StringBuilder::new(),
            absent: BinaryBuilder::new(),
            bits: Vec::new(),
            counts: Counts::default(),
        }
    }

    /// Appends one change (its cells as the shape lays them out).
    pub fn append(&mut self, change: Change<'_>) {
        for (builder, cell) in self.data.iter_mut().zip(change.cells) {
            builder.append(cell);
        }
        self.op_names.push(change.op_name);
        self.ops.push(op_code(change.op));
        self.seqs.push(change.seq as i64);
        self.lsns.append_value(change.lsn);
        self.keys.append_option(change.key);
        self.olds.append_option(change.old);
        self.unchanged.append_option(change.unchanged);
        self.old_keys.append_option(change.old_key);
        if fill_absent_bits(change.cells, &mut self.bits) {
            self.absent.append_value(&self.bits);
        } else {
            self.absent.append_null();
        }
        if self.keyed {
            self.counts.add(&change);
        }
    }

    /// The changes appended, as a batch.
    pub fn finish(mut self) -> ChangeBatch {
        let mut history: Vec<ArrayRef> = self.data.iter_mut().map(ColumnBuilder::finish).collect();
        let names: StringArray = self.op_names.iter().map(|&n| Some(n)).collect();
        history.push(Arc::new(names));
        history.push(Arc::new(Int64Array::from(std::mem::take(&mut self.seqs))));
        history.push(Arc::new(self.lsns.finish()));
        history.push(Arc::new(self.keys.finish()));
        history.push(Arc::new(self.olds.finish()));
        history.push(Arc::new(self.unchanged.finish()));
        ChangeBatch {
            history,
            ops: Arc::new(UInt8Array::from(self.ops)),
            old_keys: Arc::new(self.old_keys.finish()),
            absent: Arc::new(self.absent.finish()),
            counts: self.counts,
        }
    }
}

/// The columns `cells` leaves out (unchanged TOAST) as a bitmap, bit `j`
/// of byte `j / 8` for column `j`; `None` when it leaves none out.
pub fn absent_bits(cells: &[Cell]) -> Option<Vec<u8>> {
    let mut bits = Vec::new();
    fill_absent_bits(cells, &mut bits).then_some(bits)
}

/// Whether column `j` is left out in a bitmap of [`absent_bits`].
pub fn left_out(bits: &[u8], j: usize) -> bool {
    bits.get(j / 8).is_some_and(|b| b & (1 << (j % 8)) != 0)
}

/// [`absent_bits`] into `bits` (reused: no allocation per change);
/// whether `cells` leaves any column out.
fn fill_absent_bits(cells: &[Cell], bits: &mut Vec<u8>) -> bool {
    bits.clear();
    bits.resize(cells.len().div_ceil(8), 0);
    let mut any = false;
    for (i, cell) in cells.iter().enumerate() {
        if *cell == Cell::Absent {
            bits[i / 8] |= 1 << (i % 8);
            any = true;
        }
    }
    any
}

/// A table's changes of an object (or of several, [`ChangeBatch::concat`]),
/// in seq order, as columns.
#[derive(Debug, Clone)]
pub struct ChangeBatch {
    /// As `history::history_schema` lays them out: the data columns, then
    /// `_op`, `_seq`, `_lsn`, `_key`, `_old`, `_unchanged`.
    pub history: Vec<ArrayRef>,
    /// For the spool: each change's op (`change::op_code`), the key it had
    /// before, and the bitmap of the columns it left out.
    pub ops: ArrayRef,
    /// Each change's key before it (for a move or a delete).
    pub old_keys: ArrayRef,
    /// Each change's bitmap of left-out columns.
    pub absent: ArrayRef,
    /// What the spool counts of these changes (of a table with a key).
    pub counts: Counts,
}

impl ChangeBatch {
    /// The changes in the batch.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the batch holds no change.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many of the history's columns are the table's (the rest are
    /// `_op`, `_seq`, `_lsn`, `_key`, `_old` and `_unchanged`).
    pub fn data_columns(&self) -> usize {
        self.history.len() - 6
    }

    /// The batches one after the other, as one.
    pub fn concat(batches: &[ChangeBatch]) -> arrow::error::Result<ChangeBatch> {
        if let [one] = batches {
            return Ok(one.clone());
        }
        let column = |f: &dyn Fn(&ChangeBatch) -> &ArrayRef| {
            let arrays: Vec<&dyn Array> = batches.iter().map(|b| f(b).as_ref()).collect();
            concat(&arrays)
        };
        let width = batches.first().map_or(0, |b| b.history.len());
        let history = (0..width)
            .map(|i| column(&|b| &b.history[i]))
            .collect::<arrow::error::Result<Vec<_>>>()?;
        let mut counts = Counts::default();
        for b in batches {
            counts.merge(&b.counts);
        }
        Ok(ChangeBatch {
            history,
            ops: column(&|b| &b.ops)?,
            old_keys: column(&|b| &b.old_keys)?,
            absent: column(&|b| &b.absent)?,
            counts,
        })
    }

    /// Each change's seq (the history's `_seq`).
    pub fn seqs(&self) -> &Int64Array {
        self.history[self.data_columns() + SEQ]
            .as_any()
            .downcast_ref()
            .expect("built as integers")
    }

    /// The old keys, as the spool's `_old_key` column.
    pub fn old_keys(&self) -> &StringArray {
        self.old_keys
            .as_any()
            .downcast_ref()
            .expect("built as strings")
    }

    /// The bitmaps of left-out columns, as the spool's `_absent` column.
    pub fn absent(&self) -> &BinaryArray {
        self.absent
            .as_any()
            .downcast_ref()
            .expect("built as binary")
    }
}

/// The batch of typed changes (of one table, in seq order).
pub fn change_batch<R: Borrow<TypedChange>>(shape: &TableShape, changes: &[R]) -> ChangeBatch {
    let mut columns = ChangeColumns::new(shape, changes.len());
    for c in changes {
        columns.append(c.borrow().into());
    }
    columns.finish()
}

/// Where `_seq`, `_lsn` and `_key` are among the history's columns, after
/// the data columns and `_op` (see `history::history_schema`).
pub const SEQ: usize = 1;
/// `_lsn`'s position (see [`SEQ`]).
pub const LSN: usize = 2;
/// `_key`'s position (see [`SEQ`]).
pub const KEY: usize = 3;

/// What the spool counts of a table's changes (see [`Counts::add`]): the
/// latest view's bucket count and its merge order are chosen from it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Changes spooled (not counting the copies of truncates and moves).
    pub changes: u64,
    /// Upserts spooled: at most this many rows are added to the view.
    pub upserts: u64,
    /// The sum of [`Change::row_bytes`] over the upserts.
    pub upsert_bytes: u64,
    /// Updates that moved a row to a key of another bucket leaving columns
    /// out: their merge needs the old row from that bucket, so buckets are
    /// then merged one after the other (see `latest::MergeInput::moved`).
    pub carried_moves: u64,
    /// The seq of the last change counted.
    pub last_seq: u64,
}

impl Counts {
    /// Counts one change of a table with a key (in seq order); a change
    /// without a key (but a truncate) places nothing: not counted (`false`).
    pub fn add(&mut self, change: &Change<'_>) -> bool {
        if change.op != ChangeOp::Truncate && change.key.is_none() {
            return false;
        }
        self.changes += 1;
        self.last_seq = change.seq;
        self.carried_moves += change.carries() as u64;
        if change.op == ChangeOp::Upsert {
            self.upserts += 1;
            self.upsert_bytes += change.row_bytes();
        }
        true
    }

    /// Adds the counts of later changes.
    pub fn merge(&mut self, later: &Counts) {
        self.changes += later.changes;
        self.upserts += later.upserts;
        self.upsert_bytes += later.upsert_bytes;
        self.carried_moves += later.carried_moves;
        if later.changes > 0 {
            self.last_seq = later.last_seq;
        }
    }
}
