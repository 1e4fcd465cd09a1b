//! Every key seen up to a seq, and where each live key's values come from:
//! the history row of its version, and for a column read that an update
//! left out, the row the value came from instead. Changes are applied in
//! seq order by the latest view's rules.

use std::hash::BuildHasher;
use std::sync::Arc;

use arrow::array::{Array, Int64Array, RecordBatch};
use hashbrown::{HashMap, HashTable};
use serde_json::{Map, Value};

use crate::lakehouse::change::ChangeOp;
use crate::lakehouse::line::key_json;
use crate::lakehouse::read;
use crate::lakehouse::stored::text_column;
use crate::lakehouse::typing::TableShape;
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

/// Bits of a key's length in [`KeyRows`]' place of it.
const LEN_BITS: u32 = 24;

/// The longest key [`KeyRows`] holds in its table rather than its arena.
const INLINE: usize = 15;

/// The first byte of a [`Stored`] key that lives in the arena: no inline
/// key's length.
const IN_ARENA: u8 = 0xFF;

/// A key in [`KeyRows`]' table: up to [`INLINE`] bytes after their length,
/// zero-padded, or [`IN_ARENA`] and then its place in the arena (the key's
/// offset << [`LEN_BITS`] | its length). Two inline keys are equal exactly
/// when their 16 bytes are.
type Stored = [u8; 16];

/// `key` inline, if it is short enough.
fn inline(key: &[u8]) -> Option<Stored> {
    (key.len() <= INLINE).then(|| {
        let mut stored = [0u8; 16];
        stored[0] = key.len() as u8;
        stored[1..=key.len()].copy_from_slice(key);
        stored
    })
}

/// Every key seen up to a seq, with the history row of its version (or
/// [`GONE`]). A key of up to [`INLINE`] bytes is held in the table entry
/// itself (24 bytes with its row), so looking it up reads one place in
/// memory; a longer one is kept in an arena, its bytes one after another.
/// The map is most of a rebuild's memory, and memory first touched costs
/// a page fault a page.
struct KeyRows {
    arena: Vec<u8>,
    table: HashTable<(Stored, RowId)>,
    hasher: foldhash::fast::RandomState,
}

impl KeyRows {
    fn with_capacity(keys: usize) -> KeyRows {
        KeyRows {
            arena: Vec::new(),
            table: HashTable::with_capacity(keys),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// The bytes of a stored key.
    fn key<'a>(arena: &'a [u8], stored: &'a Stored) -> &'a [u8] {
        if stored[0] != IN_ARENA {
            return &stored[1..=stored[0] as usize];
        }
        let place = u64::from_le_bytes(stored[8..].try_into().expect("8 bytes"));
        let (offset, len) = (
            (place >> LEN_BITS) as usize,
            (place & ((1 << LEN_BITS) - 1)) as usize,
        );
        &arena[offset..offset + len]
    }

    /// `key`'s row, the key added (with [`GONE`]) if new.
    fn slot(&mut self, key: &str) -> Result<&mut RowId> {
        let key = key.as_bytes();
        let hash = self.hasher.hash_one(key);
        let short = inline(key);
        let (arena, hasher) = (&self.arena, &self.hasher);
        let entry = self.table.entry(
            hash,
            |(stored, _)| match &short {
                Some(short) => stored == short,
                None => stored[0] == IN_ARENA && Self::key(arena, stored) == key,
            },
            |(stored, _)| hasher.hash_one(Self::key(arena, stored)),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(e) => Ok(&mut e.into_mut().1),
            hashbrown::hash_table::Entry::Vacant(e) => {
                let stored = match short {
                    Some(short) => short,
                    None => {
                        let offset = self.arena.len() as u64;
                        if key.len() as u64 >= 1 << LEN_BITS || offset >= 1 << (64 - LEN_BITS) {
                            return Err(Error::fatal(
                                "the keys up to the seq do not fit in memory (a key of 16 MiB, or 1 TiB of keys)",
                                "query a later seq",
                            ));
                        }
                        self.arena.extend_from_slice(key);
                        let mut stored = [0u8; 16];
                        stored[0] = IN_ARENA;
                        let place = (offset << LEN_BITS) | key.len() as u64;
                        stored[8..].copy_from_slice(&place.to_le_bytes());
                        stored
                    }
                };
                Ok(&mut e.insert((stored, GONE)).into_mut().1)
            }
        }
    }

    fn clear(&mut self) {
        self.table.clear();
        self.arena.clear();
    }

    /// The rows of the live keys' versions.
    fn live(&self) -> impl Iterator<Item = RowId> + '_ {
        self.table
            .iter()
            .map(|(_, row)| *row)
            .filter(|r| *r != GONE)
    }
}

/// The keys up to a seq and where each live key's values come from: the
/// history row of its version, and for the columns read that an update
/// left out, the row each came from instead.
pub(super) struct Versions {
    shape: Arc<TableShape>,
    /// The place among the columns read of each data column, if read.
    read_as: Vec<Option<u32>>,
    keys: KeyRows,
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
            keys: KeyRows::with_capacity(expected),
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
        for i in 0..batch.num_rows() {
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
                        Some(k) => Some(std::mem::replace(self.keys.slot(k)?, GONE)),
                        None => match old(&self.shape) {
                            Some(k) => Some(std::mem::replace(self.keys.slot(&k)?, GONE)),
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
                        Some(o) => Some(std::mem::replace(self.keys.slot(&o)?, GONE)),
                        None => None,
                    };
                    let slot = self.keys.slot(key)?;
                    let replaced = std::mem::replace(slot, row);
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
        self.keys.live().count()
    }

    /// The live versions' rows, in the order they were written.
    pub(super) fn live(&self) -> Vec<RowId> {
        let mut live: Vec<RowId> = Vec::with_capacity(self.keys.table.len());
        live.extend(self.keys.live());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_short_and_long_are_told_apart_and_found_again() {
        let keys = [
            "",
            "{\"id\":1}",
            "{\"id\":262681}",
            "fifteen bytes..",
            "fifteen bytes...",
            "sixteen bytes...",
            "sixteen bytes..!",
            "a key well over fifteen bytes, in the arena",
        ];
        let mut map = KeyRows::with_capacity(2);
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(*map.slot(k).unwrap(), GONE, "{k} is new");
            *map.slot(k).unwrap() = i as RowId;
        }
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(*map.slot(k).unwrap(), i as RowId, "{k}");
        }
        let mut live: Vec<RowId> = map.live().collect();
        live.sort_unstable();
        assert_eq!(live, (0..keys.len() as RowId).collect::<Vec<_>>());
        // The table grew past its capacity: every key was hashed again
        // from where it is kept.
        assert_eq!(*map.slot("{\"id\":262681}").unwrap(), 2);
        map.clear();
        assert_eq!(map.live().count(), 0);
        assert_eq!(*map.slot("sixteen bytes...").unwrap(), GONE);
    }
}
