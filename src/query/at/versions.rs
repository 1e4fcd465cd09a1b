//! Every key seen up to a seq, and where each live key's values come from:
//! the history row of its version, and for a column read that an update
//! left out, the row the value came from instead. Changes are applied in
//! seq order by the latest view's rules.

use std::hash::BuildHasher;
use std::sync::Arc;

use arrow::array::{Array, Int64Array, RecordBatch};
use hashbrown::HashMap;
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

/// A free entry of [`KeyRows`]' table: no row is this one (a row's file
/// is below 2^24 and its position below 2^40 - 3).
const FREE: RowId = RowId::MAX - 2;

/// The share of [`KeyRows`]' table its keys may fill before it grows.
const FILL: (usize, usize) = (7, 10);

/// How many keys ahead [`Versions::apply`] asks for a key's entry.
const AHEAD: usize = 16;

/// Every key seen up to a seq, with the history row of its version (or
/// [`GONE`]): an open-addressing table (linear probing) of 24-byte entries.
/// A key of up to [`INLINE`] bytes is held in its entry itself, so looking
/// it up reads one place in memory; a longer one is kept in an arena, its
/// bytes one after another. The table is most of a rebuild's memory, and
/// far larger than the processor's cache: each change's key is a cache
/// miss. The table is our own rather than a general one so that the place
/// of a key's entry is known from its hash before it is looked up, and
/// [`Versions::apply`] asks for the entries of the keys [`AHEAD`] changes
/// on while it applies this one (see [`crate::query::prefetch`]).
struct KeyRows {
    arena: Vec<u8>,
    /// A power of two long; [`FREE`] rows mark the free entries.
    table: Vec<(Stored, RowId)>,
    /// Entries in use.
    len: usize,
    hasher: foldhash::fast::RandomState,
}

impl KeyRows {
    fn with_capacity(keys: usize) -> KeyRows {
        KeyRows {
            arena: Vec::new(),
            table: vec![([0; 16], FREE); Self::entries_for(keys)],
            len: 0,
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// The table's length for `keys` keys.
    fn entries_for(keys: usize) -> usize {
        (keys.max(8) * FILL.1 / FILL.0 + 1).next_power_of_two()
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

    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key.as_bytes())
    }

    /// Where a key of hash `hash` is looked for first.
    fn home(&self, hash: u64) -> usize {
        hash as usize & (self.table.len() - 1)
    }

    /// Asks for the entry a key of hash `hash` is looked for first.
    fn prefetch(&self, hash: u64) {
        crate::query::prefetch::prefetch(&self.table[self.home(hash)]);
    }

    /// `key`'s row, the key added (with [`GONE`]) if new.
    fn slot(&mut self, key: &str) -> Result<&mut RowId> {
        let hash = self.hash(key);
        self.slot_hashed(key, hash)
    }

    /// [`KeyRows::slot`] for a key whose hash is `hash`.
    fn slot_hashed(&mut self, key: &str, hash: u64) -> Result<&mut RowId> {
        let bytes = key.as_bytes();
        let short = inline(bytes);
        let mask = self.table.len() - 1;
        let mut at = self.home(hash);
        loop {
            let (stored, row) = &self.table[at];
            if *row == FREE {
                break;
            }
            let same = match &short {
                Some(short) => stored == short,
                None => stored[0] == IN_ARENA && Self::key(&self.arena, stored) == bytes,
            };
            if same {
                return Ok(&mut self.table[at].1);
            }
            at = (at + 1) & mask;
        }
        if (self.len + 1) * FILL.1 > self.table.len() * FILL.0 {
            self.grow();
            return self.slot_hashed(key, hash);
        }
        let stored = match short {
            Some(short) => short,
            None => {
                let offset = self.arena.len() as u64;
                if bytes.len() as u64 >= 1 << LEN_BITS || offset >= 1 << (64 - LEN_BITS) {
                    return Err(Error::fatal(
                        "the keys up to the seq do not fit in memory (a key of 16 MiB, or 1 TiB of keys)",
                        "query a later seq",
                    ));
                }
                self.arena.extend_from_slice(bytes);
                let mut stored = [0u8; 16];
                stored[0] = IN_ARENA;
                let place = (offset << LEN_BITS) | bytes.len() as u64;
                stored[8..].copy_from_slice(&place.to_le_bytes());
                stored
            }
        };
        self.len += 1;
        self.table[at] = (stored, GONE);
        Ok(&mut self.table[at].1)
    }

    /// Doubles the table, every key hashed again from where it is kept.
    fn grow(&mut self) {
        let wider = vec![([0; 16], FREE); self.table.len() * 2];
        let old = std::mem::replace(&mut self.table, wider);
        let mask = self.table.len() - 1;
        for (stored, row) in old.into_iter().filter(|(_, row)| *row != FREE) {
            let mut at = self.home(self.hasher.hash_one(Self::key(&self.arena, &stored)));
            while self.table[at].1 != FREE {
                at = (at + 1) & mask;
            }
            self.table[at] = (stored, row);
        }
    }

    fn clear(&mut self) {
        self.table.fill(([0; 16], FREE));
        self.arena.clear();
        self.len = 0;
    }

    /// The rows of the live keys' versions.
    fn live(&self) -> impl Iterator<Item = RowId> + '_ {
        self.table
            .iter()
            .map(|(_, row)| *row)
            .filter(|r| *r != GONE && *r != FREE)
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
        // Each key's hash, for its entry to be asked for AHEAD changes before.
        let hashes: Vec<u64> = (0..batch.num_rows())
            .map(|i| {
                if keys.is_null(i) {
                    0
                } else {
                    self.keys.hash(keys.value(i))
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
                        Some(k) => Some(std::mem::replace(
                            self.keys.slot_hashed(k, hashes[i])?,
                            GONE,
                        )),
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
                    let slot = self.keys.slot_hashed(key, hashes[i])?;
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
        let mut live: Vec<RowId> = Vec::with_capacity(self.keys.len);
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
        // Beside them, a thousand keys short and long, so that the table
        // made for 2 keys grows several times: every key is hashed again
        // from where it is kept.
        let many: Vec<String> = (0..1_000)
            .map(|i| match i % 2 {
                0 => format!("{{\"id\":{i}}}"),
                _ => format!("{{\"id\":{i},\"region\":\"north\"}}"),
            })
            .collect();
        let keys: Vec<&str> = keys
            .into_iter()
            .chain(many.iter().map(String::as_str))
            .collect();
        let mut map = KeyRows::with_capacity(2);
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(*map.slot(k).unwrap(), GONE, "{k} is new");
            *map.slot(k).unwrap() = i as RowId;
        }
        assert!(map.table.len() >= 1_024, "{}", map.table.len());
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(*map.slot(k).unwrap(), i as RowId, "{k}");
        }
        let mut live: Vec<RowId> = map.live().collect();
        live.sort_unstable();
        assert_eq!(live, (0..keys.len() as RowId).collect::<Vec<_>>());
        assert_eq!(*map.slot("{\"id\":262681}").unwrap(), 2);
        map.clear();
        assert_eq!(map.live().count(), 0);
        assert_eq!(*map.slot("sixteen bytes...").unwrap(), GONE);
    }
}
