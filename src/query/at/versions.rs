//! Every key seen up to a seq, and where each live key's values come from:
//! the history row of its version, and for a column read that an update
//! left out, the row the value came from instead. Changes are applied in
//! seq order by the latest view's rules.

use std::sync::Arc;

use arrow::array::{Array, Int64Array, RecordBatch};
use hashbrown::HashMap;
use serde_json::{Map, Value};

use crate::lakehouse::change::ChangeOp;
use crate::lakehouse::line::key_json;
use crate::lakehouse::read;
use crate::lakehouse::stored::text_column;
use crate::lakehouse::typing::TableShape;
use crate::query::keytable::{KeyHasher, KeyTable};
use crate::{Error, Result};

/// A history row: its file's place among the files a view reads and its
/// position in the file, `file << 40 | position`; [`NULL_ROW`]: a null
/// value.
pub(super) type RowId = u64;

/// A value no version had: null.
pub(super) const NULL_ROW: RowId = RowId::MAX;

fn row_id(file: usize, position: u64) -> RowId {
    ((file as u64) << 40) | position
}

/// A row's file and position.
pub(super) fn split(row: RowId) -> (usize, u64) {
    ((row >> 40) as usize, row & ((1 << 40) - 1))
}

/// The columns read among those an `_unchanged` text names, parsed again
/// only when the text differs from the `last` one.
fn left_out<'a>(
    last: &'a mut (String, Vec<u32>),
    shape: &TableShape,
    read_as: &[Option<u32>],
    text: &str,
) -> &'a [u32] {
    if last.0 != text {
        let names: Vec<String> = serde_json::from_str(text).unwrap_or_default();
        let read = names
            .iter()
            .filter_map(|n| shape.column(n))
            .filter_map(|c| read_as[c])
            .collect();
        *last = (text.to_string(), read);
    }
    &last.1
}

/// A key's entry when it has no version: deleted, or moved to another key.
const GONE: RowId = RowId::MAX - 1;

/// How many keys ahead [`Versions::apply`] asks for a key's entry.
const AHEAD: usize = 16;

/// A key's entry in [`Versions`]' table: the history row of its version,
/// or [`GONE`] (also what a key new to the table starts with).
#[derive(Clone, Copy)]
struct Version(RowId);

impl Default for Version {
    fn default() -> Version {
        Version(GONE)
    }
}

/// The keys up to a seq and where each live key's values come from: the
/// history row of its version, and for the columns read that an update
/// left out, the row each came from instead.
pub(super) struct Versions {
    shape: Arc<TableShape>,
    /// The place among the columns read of each data column, if read.
    read_as: Vec<Option<u32>>,
    /// Every key seen up to the seq, with its version (see [`KeyTable`]).
    keys: KeyTable<Version>,
    /// By a live version's row, for the columns read it left out: (index
    /// among the columns read, source row). Empty unless a column read
    /// was left out.
    carried: HashMap<RowId, Box<[(u32, RowId)]>>,
    /// The last `_unchanged` text and the columns read it names.
    last_unchanged: (String, Vec<u32>),
    /// The last seq applied: changes must come in seq order.
    last_seq: Option<i64>,
}

/// The row the value of the `c`-th column read of the version at `row`
/// comes from.
fn source(carried: &HashMap<RowId, Box<[(u32, RowId)]>>, row: RowId, c: usize) -> RowId {
    if row == GONE {
        return NULL_ROW;
    }
    carried
        .get(&row)
        .and_then(|cs| cs.iter().find(|(i, _)| *i as usize == c))
        .map_or(row, |(_, from)| *from)
}

impl Versions {
    /// For the data columns `columns`, room made for `expected` keys.
    pub(super) fn new(shape: Arc<TableShape>, columns: &[usize], expected: usize) -> Versions {
        let mut read_as = vec![None; shape.columns.len()];
        for (i, &c) in columns.iter().enumerate() {
            read_as[c] = Some(i as u32);
        }
        Versions {
            shape,
            read_as,
            keys: KeyTable::with_capacity(expected, KeyHasher::default()),
            carried: HashMap::default(),
            last_unchanged: (String::new(), Vec::new()),
            last_seq: None,
        }
    }

    /// Applies the changes up to `at` of a batch of the `file`-th history
    /// file whose first row is at position `first` in the file.
    pub(super) fn apply(
        &mut self,
        file: usize,
        first: u64,
        batch: &RecordBatch,
        at: u64,
    ) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let fix = "compact the table again";
        let seqs = arrow::compute::cast(
            batch
                .column_by_name("_seq")
                .ok_or_else(|| Error::fatal("a history file has no _seq column", fix))?,
            &arrow::datatypes::DataType::Int64,
        )
        .map_err(|e| Error::fatal(format!("_seq: {e}"), fix))?;
        let seqs = seqs
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("cast to Int64");
        let ops = text_column(batch, "_op")?;
        let keys = text_column(batch, "_key")?;
        let olds = text_column(batch, "_old")?;
        let unchanged = text_column(batch, "_unchanged")?;
        // Each key's hash, for its entry to be asked for AHEAD changes before.
        let hashes: Vec<u64> = (0..batch.num_rows())
            .map(|i| {
                if keys.is_null(i) {
                    0
                } else {
                    self.keys.hash(keys.value(i).as_bytes())
                }
            })
            .collect();
        for i in 0..batch.num_rows() {
            if let Some(&ahead) = hashes.get(i + AHEAD) {
                self.keys.prefetch(ahead);
            }
            let seq = seqs.value(i);
            // Compact writes the history in seq order, file after file.
            if self.last_seq.is_some_and(|l| l >= seq) {
                return Err(Error::fatal(
                    format!(
                        "{}: the history holds seq {seq} after seq {}, out of the order compact writes it in",
                        self.shape.table,
                        self.last_seq.unwrap_or_default()
                    ),
                    "delete the table's folders under parquet/ and latest/ and compact it again from the archive",
                ));
            }
            if seq > at as i64 {
                break;
            }
            self.last_seq = Some(seq);
            let (op, _) =
                read::parse_op(ops.value(i)).map_err(|e| Error::fatal(format!("_op: {e}"), fix))?;
            let key = (!keys.is_null(i)).then(|| keys.value(i));
            let old = |shape: &TableShape| {
                (!olds.is_null(i))
                    .then(|| serde_json::from_str::<Map<String, Value>>(olds.value(i)).ok())
                    .flatten()
                    .and_then(|o| key_json(shape, &o))
            };
            let row = row_id(file, first + i as u64);
            match op {
                ChangeOp::Truncate => {
                    self.keys.clear();
                    self.carried.clear();
                }
                ChangeOp::Delete => {
                    let gone = match key {
                        Some(k) => {
                            Some(std::mem::take(self.keys.slot_hashed(k.as_bytes(), hashes[i])?).0)
                        }
                        None => match old(&self.shape) {
                            Some(k) => Some(std::mem::take(self.keys.slot(k.as_bytes())?).0),
                            None => None,
                        },
                    };
                    if let Some(gone) = gone {
                        self.forget(gone);
                    }
                }
                ChangeOp::Upsert => {
                    let Some(key) = key else { continue };
                    // An update that moved the key: the row was under the old one.
                    let moved = match old(&self.shape).filter(|o| o.as_str() != key) {
                        Some(o) => Some(std::mem::take(self.keys.slot(o.as_bytes())?).0),
                        None => None,
                    };
                    let slot = self.keys.slot_hashed(key.as_bytes(), hashes[i])?;
                    let replaced = std::mem::replace(slot, Version(row)).0;
                    let previous = moved.unwrap_or(replaced);
                    if !unchanged.is_null(i) {
                        let left_out = left_out(
                            &mut self.last_unchanged,
                            &self.shape,
                            &self.read_as,
                            unchanged.value(i),
                        );
                        if !left_out.is_empty() {
                            let from: Box<[(u32, RowId)]> = left_out
                                .iter()
                                .map(|&c| (c, source(&self.carried, previous, c as usize)))
                                .collect();
                            self.carried.insert(row, from);
                        }
                    }
                    self.forget(previous);
                    if moved.is_some() {
                        self.forget(replaced);
                    }
                }
            }
        }
        Ok(())
    }

    /// Drops what is kept for a version no key has any more.
    fn forget(&mut self, row: RowId) {
        if !self.carried.is_empty() && row != GONE {
            self.carried.remove(&row);
        }
    }

    /// How many keys are live.
    pub(super) fn live_count(&self) -> usize {
        self.live_rows().count()
    }

    fn live_rows(&self) -> impl Iterator<Item = RowId> + '_ {
        self.keys.values().map(|v| v.0).filter(|r| *r != GONE)
    }

    /// The live versions' rows, in the order they were written.
    pub(super) fn live(&self) -> Vec<RowId> {
        let mut live: Vec<RowId> = Vec::with_capacity(self.keys.len());
        live.extend(self.live_rows());
        live.sort_unstable();
        live
    }

    /// The row the value of the `c`-th column read of the version at `row`
    /// comes from.
    pub(super) fn source(&self, row: RowId, c: usize) -> RowId {
        source(&self.carried, row, c)
    }

    /// Whether a live version takes a column read from another row.
    pub(super) fn any_carried(&self) -> bool {
        !self.carried.is_empty()
    }
}
