//! The latest view at a seq the compacted view has passed (`query --at`),
//! rebuilt from the compacted history by the latest view's rules (see
//! [`super::merge`]): in seq order, an upsert replaces its key's row and
//! takes the previous version's value for each column it left out, an
//! update that moves the key removes the old key's row, a delete removes
//! the row, a truncate every row.
//!
//! Built when a statement scans it, for the columns the statement reads,
//! in two passes over the history files up to the seq:
//!
//! 1. The change columns only (`_seq`, `_op`, `_key`, `_old`,
//!    `_unchanged`): which history row each live key's value of each
//!    column the statement reads comes from ([`Versions`]). A value an
//!    update left out comes from the row before it; for a `count(*)` this
//!    pass is all.
//! 2. Those rows alone, in the columns read ([`RowSelection`]), put
//!    together into the view's rows by `interleave`.
//!
//! Rows are never turned into cells, and a column no statement reads is
//! never decoded. Memory: an entry per key live at some point up to the
//! seq, the change columns of two files, and the view's rows in the
//! columns read.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::Arc;

use arrow::array::{Array, Int64Array, RecordBatch, RecordBatchOptions, new_null_array};
use arrow::datatypes::{Schema, SchemaRef};
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::ExecutionPlan;
use futures::{StreamExt, TryStreamExt};
use hashbrown::{HashMap, HashTable};
use object_store::ObjectStore;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, RowSelection, RowSelector,
};
use parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use parquet::file::metadata::ParquetMetaData;
use parquet::file::statistics::Statistics;
use serde_json::{Map, Value};

use crate::lakehouse::change::ChangeOp;
use crate::lakehouse::compacted::UNREADABLE_FIX;
use crate::lakehouse::line::key_json;
use crate::lakehouse::read;
use crate::lakehouse::stored::{StoredFile, cast, text_column};
use crate::lakehouse::typing::TableShape;
use crate::{Error, Result};

/// Rows per batch of the view.
const BATCH_ROWS: usize = 8192;

/// History files whose change columns are read at once: the one applied
/// and the next.
const READ_AHEAD: usize = 2;

/// Batches of change columns a file's reader holds ready.
const BATCHES_AHEAD: usize = 4;

/// History files whose chosen rows are read at once.
const ROWS_AT_ONCE: usize = 4;

/// The change columns pass 1 reads.
const CHANGE_COLUMNS: [&str; 5] = ["_seq", "_op", "_key", "_old", "_unchanged"];

/// A history row: its file's place in [`AtView::files`] and its position
/// in the file, `file << 40 | position`; [`NULL_ROW`]: a null value.
type RowId = u64;

/// A value no version had: null.
const NULL_ROW: RowId = RowId::MAX;

fn row_id(file: usize, position: u64) -> RowId {
    ((file as u64) << 40) | position
}

fn split(row: RowId) -> (usize, u64) {
    ((row >> 40) as usize, row & ((1 << 40) - 1))
}

/// `<schema>.<table>` at a seq before its compacted view: see the module
/// doc.
#[derive(Debug)]
pub(super) struct AtView {
    store: Arc<dyn ObjectStore>,
    shape: Arc<TableShape>,
    /// The history files holding changes up to `at`, keys in the store, in
    /// seq order.
    files: Vec<String>,
    at: u64,
    /// About how many keys there are (the compacted view's rows): room
    /// made at once rather than by growing the map again and again.
    expected_keys: usize,
    /// The data columns.
    schema: SchemaRef,
}

impl AtView {
    /// The view of `shape`'s table at seq `at` from its history `files`
    /// (keys in the store, by first seq, each holding changes up to `at`).
    pub(super) fn new(
        store: Arc<dyn ObjectStore>,
        shape: Arc<TableShape>,
        files: Vec<String>,
        at: u64,
        expected_keys: usize,
    ) -> AtView {
        let schema = Arc::new(Schema::new(
            shape
                .columns
                .iter()
                .map(|c| arrow::datatypes::Field::new(&c.name, c.kind.data_type(), true))
                .collect::<Vec<_>>(),
        ));
        AtView {
            store,
            shape,
            files,
            at,
            expected_keys,
            schema,
        }
    }

    /// The view's rows in the data columns `columns` (indexes in the
    /// shape), as batches.
    async fn rows(&self, columns: &[usize]) -> Result<Vec<RecordBatch>> {
        let started = std::time::Instant::now();
        let versions = self.versions(columns).await?;
        let replayed = started.elapsed();
        let schema = Arc::new(self.schema.project(columns).expect("columns of the shape"));
        let (live, n) = if columns.is_empty() {
            (Vec::new(), versions.live_count())
        } else {
            let live = versions.live();
            let n = live.len();
            (live, n)
        };
        let batches = if columns.is_empty() {
            let empty = |rows| {
                RecordBatch::try_new_with_options(
                    Arc::clone(&schema),
                    vec![],
                    &RecordBatchOptions::new().with_row_count(Some(rows)),
                )
                .expect("no columns")
            };
            (0..n)
                .step_by(BATCH_ROWS)
                .map(|start| empty(BATCH_ROWS.min(n - start)))
                .collect()
        } else {
            self.values(&schema, &versions, &live)
                .await?
                .iter()
                .flat_map(|b| {
                    (0..b.num_rows())
                        .step_by(BATCH_ROWS)
                        .map(|start| b.slice(start, BATCH_ROWS.min(b.num_rows() - start)))
                })
                .collect()
        };
        tracing::debug!(
            table = %self.shape.table,
            at = self.at,
            files = self.files.len(),
            rows = n,
            columns = columns.len(),
            replay_ms = replayed.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            "rebuilt the latest view at a seq from the history"
        );
        Ok(batches)
    }

    /// Pass 1: the changes up to `at`, file after file, row group after
    /// row group, the next files' change columns read (on other tasks)
    /// while one is applied.
    async fn versions(&self, columns: &[usize]) -> Result<Versions> {
        let mut versions = Versions::new(Arc::clone(&self.shape), columns, self.expected_keys);
        let mut reading = VecDeque::new();
        let mut files = self.files.iter().enumerate();
        loop {
            while reading.len() < READ_AHEAD {
                let Some((i, key)) = files.next() else { break };
                let (tx, rx) = tokio::sync::mpsc::channel(BATCHES_AHEAD);
                let task = tokio::spawn(change_columns(
                    Arc::clone(&self.store),
                    key.clone(),
                    self.at,
                    tx,
                ));
                reading.push_back((i, rx, task));
            }
            let Some((file, mut rx, task)) = reading.pop_front() else {
                break;
            };
            while let Some((first, batch)) = rx.recv().await {
                versions.apply(file, first, &batch, self.at)?;
            }
            // The channel closes when the task ends: with an error, or done.
            task.await
                .map_err(|e| Error::bug(format!("reading a history file stopped: {e}")))??;
        }
        Ok(versions)
    }

    /// Pass 2: the `live` versions (sorted) in the columns of `schema`,
    /// from the history rows their values come from.
    async fn values(
        &self,
        schema: &SchemaRef,
        versions: &Versions,
        live: &[RowId],
    ) -> Result<Vec<RecordBatch>> {
        let columns = schema.fields().len();
        // Each column's source row per live key (`None`: the version's own
        // row for every column); then the rows each file gives.
        let sources: Option<Vec<Vec<RowId>>> = versions.any_carried().then(|| {
            (0..columns)
                .map(|c| live.iter().map(|&row| versions.source(row, c)).collect())
                .collect()
        });
        let mut wanted: Vec<Vec<u64>> = vec![Vec::new(); self.files.len()];
        let mut want = |row: RowId| {
            if row != NULL_ROW {
                let (file, position) = split(row);
                wanted[file].push(position);
            }
        };
        match &sources {
            Some(sources) => sources.iter().flatten().for_each(|&row| want(row)),
            None => live.iter().for_each(|&row| want(row)),
        }
        for positions in &mut wanted {
            positions.sort_unstable();
            positions.dedup();
        }
        let reads: Vec<(usize, String, Vec<u64>)> = wanted
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.is_empty())
            .map(|(i, p)| (i, self.files[i].clone(), p.clone()))
            .collect();
        let read: Vec<(usize, RecordBatch)> = futures::stream::iter(reads)
            .map(|(i, key, positions)| {
                let (store, schema) = (Arc::clone(&self.store), Arc::clone(schema));
                async move {
                    tokio::spawn(chosen_rows(store, key, positions, schema))
                        .await
                        .map_err(|e| Error::bug(format!("reading a history file stopped: {e}")))?
                        .map(|batch| (i, batch))
                }
            })
            .buffered(ROWS_AT_ONCE)
            .try_collect()
            .await?;
        let Some(sources) = sources else {
            // Every value is its version's: the files' rows, in file order,
            // are the live versions in row order.
            return Ok(read.into_iter().map(|(_, b)| b).collect());
        };
        // Where each file's rows are among the arrays `interleave` takes;
        // the last array is the null.
        let mut slot = vec![usize::MAX; self.files.len()];
        for (s, (file, _)) in read.iter().enumerate() {
            slot[*file] = s;
        }
        let nulls = read.len();
        let mut out = Vec::with_capacity(columns);
        for (c, field) in schema.fields().iter().enumerate() {
            let null = new_null_array(field.data_type(), 1);
            let arrays: Vec<&dyn Array> = read
                .iter()
                .map(|(_, b)| b.column(c).as_ref())
                .chain([null.as_ref()])
                .collect();
            let indices: Vec<(usize, usize)> = sources[c]
                .iter()
                .map(|&row| {
                    if row == NULL_ROW {
                        return (nulls, 0);
                    }
                    let (file, position) = split(row);
                    let index = wanted[file]
                        .binary_search(&position)
                        .expect("every source row was read");
                    (slot[file], index)
                })
                .collect();
            out.push(arrow::compute::interleave(&arrays, &indices).map_err(|e| {
                Error::bug(format!(
                    "assembling {}.{}: {e}",
                    self.shape.table,
                    field.name()
                ))
            })?);
        }
        let batch = RecordBatch::try_new(Arc::clone(schema), out)
            .map_err(|e| Error::bug(format!("assembling {}: {e}", self.shape.table)))?;
        Ok(vec![batch])
    }
}

#[async_trait]
impl TableProvider for AtView {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let columns: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..self.schema.fields().len()).collect(),
        };
        let batches = self
            .rows(&columns)
            .await
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        let schema = Arc::new(self.schema.project(&columns)?);
        Ok(MemorySourceConfig::try_new_exec(&[batches], schema, None)?)
    }
}

fn unreadable(key: &str, e: &dyn std::fmt::Display) -> Error {
    Error::fatal(
        format!("cannot read the history file {key}: {e}"),
        UNREADABLE_FIX,
    )
}

/// Sends the change columns of a history file's row groups that may hold
/// changes up to `at`, in batches of [`BATCH_ROWS`] (small enough for
/// their buffers to be used again rather than grown into fresh memory),
/// each with the position of its first row in the file; stops early if
/// no one receives them.
async fn change_columns(
    store: Arc<dyn ObjectStore>,
    key: String,
    at: u64,
    tx: tokio::sync::mpsc::Sender<(u64, RecordBatch)>,
) -> Result<()> {
    let mut file = StoredFile::new(store, &key, None);
    let meta = ArrowReaderMetadata::load_async(&mut file, ArrowReaderOptions::new())
        .await
        .map_err(|e| unreadable(&key, &e))?;
    let mask = roots(&meta, CHANGE_COLUMNS);
    for g in groups_up_to(meta.metadata(), at) {
        let mut batches =
            ParquetRecordBatchStreamBuilder::new_with_metadata(file.clone(), meta.clone())
                .with_row_groups(vec![g])
                .with_projection(mask.clone())
                .with_batch_size(BATCH_ROWS)
                .build()
                .map_err(|e| unreadable(&key, &e))?;
        let mut next = group_start(meta.metadata(), g);
        while let Some(batch) = batches.try_next().await.map_err(|e| unreadable(&key, &e))? {
            let n = batch.num_rows() as u64;
            if tx.send((next, batch)).await.is_err() {
                return Ok(());
            }
            next += n;
        }
    }
    Ok(())
}

/// The position in its file of row group `g`'s first row.
fn group_start(metadata: &ParquetMetaData, g: usize) -> u64 {
    metadata.row_groups()[..g]
        .iter()
        .map(|r| r.num_rows() as u64)
        .sum()
}

/// The file's top-level columns of these names (names may hold dots,
/// which `ProjectionMask::columns` would take for nesting).
fn roots<'a>(
    meta: &ArrowReaderMetadata,
    names: impl IntoIterator<Item = &'a str>,
) -> ProjectionMask {
    let fields = meta.schema();
    let indices: Vec<usize> = names
        .into_iter()
        .filter_map(|n| fields.index_of(n).ok())
        .collect();
    ProjectionMask::roots(meta.parquet_schema(), indices)
}

/// The row groups whose `_seq` statistics allow a seq up to `at` (all
/// without statistics).
fn groups_up_to(metadata: &ParquetMetaData, at: u64) -> Vec<usize> {
    let seq = metadata
        .file_metadata()
        .schema_descr()
        .columns()
        .iter()
        .position(|c| c.name() == "_seq");
    (0..metadata.num_row_groups())
        .filter(|&g| {
            let min = seq.and_then(|s| match metadata.row_group(g).column(s).statistics() {
                Some(Statistics::Int64(s)) => s.min_opt().copied(),
                _ => None,
            });
            min.is_none_or(|m| m <= at as i64)
        })
        .collect()
}

/// The rows at `positions` (sorted) of a history file, in `schema`.
async fn chosen_rows(
    store: Arc<dyn ObjectStore>,
    key: String,
    positions: Vec<u64>,
    schema: SchemaRef,
) -> Result<RecordBatch> {
    let mut file = StoredFile::new(store, &key, None);
    let meta = ArrowReaderMetadata::load_async(&mut file, ArrowReaderOptions::new())
        .await
        .map_err(|e| unreadable(&key, &e))?;
    let total = meta.metadata().file_metadata().num_rows() as u64;
    let mask = roots(&meta, schema.fields().iter().map(|f| f.name().as_str()));
    // One batch of every row chosen: nothing to join afterwards.
    let batches: Vec<RecordBatch> = ParquetRecordBatchStreamBuilder::new_with_metadata(file, meta)
        .with_projection(mask)
        .with_row_selection(selection(&positions, total))
        .with_batch_size(positions.len().max(1))
        .build()
        .map_err(|e| unreadable(&key, &e))?
        .map(|b| {
            b.map_err(|e| unreadable(&key, &e))
                .and_then(|b| cast(&b, &schema).map_err(|e| unreadable(&key, &e)))
        })
        .try_collect()
        .await?;
    let batch = match batches.len() {
        1 => batches.into_iter().next().expect("one batch"),
        _ => arrow::compute::concat_batches(&schema, &batches).map_err(|e| unreadable(&key, &e))?,
    };
    if batch.num_rows() != positions.len() {
        return Err(unreadable(&key, &"it holds fewer rows than it did"));
    }
    Ok(batch)
}

/// The rows at `positions` (sorted, distinct) of `total`.
fn selection(positions: &[u64], total: u64) -> RowSelection {
    // Sized once: the list can be most of a pass's memory, and growing it
    // copies it into fresh pages again and again.
    let runs = positions.windows(2).filter(|w| w[1] != w[0] + 1).count() + 1;
    let mut selectors: Vec<RowSelector> = Vec::with_capacity(2 * runs + 1);
    let mut next = 0;
    for &p in positions {
        if p > next {
            selectors.push(RowSelector::skip((p - next) as usize));
        }
        match selectors.last_mut() {
            Some(s) if !s.skip => s.row_count += 1,
            _ => selectors.push(RowSelector::select(1)),
        }
        next = p + 1;
    }
    if total > next {
        selectors.push(RowSelector::skip((total - next) as usize));
    }
    selectors.into()
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

/// Every key seen up to a seq, with the history row of its version (or
/// [`GONE`]). The keys' bytes are kept one after another in an arena and
/// the table holds 16 bytes per key: the map is most of a rebuild's
/// memory, and memory first touched costs a page fault a page.
struct KeyRows {
    arena: Vec<u8>,
    /// (the key's offset in `arena` << [`LEN_BITS`] | its length, row)
    table: HashTable<(u64, RowId)>,
    hasher: foldhash::fast::RandomState,
}

impl KeyRows {
    fn with_capacity(keys: usize) -> KeyRows {
        KeyRows {
            arena: Vec::with_capacity(keys.saturating_mul(16)),
            table: HashTable::with_capacity(keys),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    fn key(arena: &[u8], place: u64) -> &[u8] {
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
        let (arena, hasher) = (&self.arena, &self.hasher);
        let entry = self.table.entry(
            hash,
            |(place, _)| Self::key(arena, *place) == key,
            |(place, _)| hasher.hash_one(Self::key(arena, *place)),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(e) => Ok(&mut e.into_mut().1),
            hashbrown::hash_table::Entry::Vacant(e) => {
                let offset = self.arena.len() as u64;
                if key.len() as u64 >= 1 << LEN_BITS || offset >= 1 << (64 - LEN_BITS) {
                    return Err(Error::fatal(
                        "the keys up to the seq do not fit in memory (a key of 16 MiB, or 1 TiB of keys)",
                        "query a later seq",
                    ));
                }
                self.arena.extend_from_slice(key);
                let place = (offset << LEN_BITS) | key.len() as u64;
                Ok(&mut e.insert((place, GONE)).into_mut().1)
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
struct Versions {
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
    fn new(shape: Arc<TableShape>, columns: &[usize], expected: usize) -> Versions {
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
    fn apply(&mut self, file: usize, first: u64, batch: &RecordBatch, at: u64) -> Result<()> {
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
    fn live_count(&self) -> usize {
        self.keys.live().count()
    }

    /// The live versions' rows, in the order they were written.
    fn live(&self) -> Vec<RowId> {
        let mut live: Vec<RowId> = Vec::with_capacity(self.keys.table.len());
        live.extend(self.keys.live());
        live.sort_unstable();
        live
    }

    /// The row the value of the `c`-th column read of the version at `row`
    /// comes from.
    fn source(&self, row: RowId, c: usize) -> RowId {
        source(&self.carried, row, c)
    }

    /// Whether a live version takes a column read from another row.
    fn any_carried(&self) -> bool {
        !self.carried.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};
    use object_store::memory::InMemory;
    use object_store::path::Path;
    use object_store::{ObjectStoreExt, PutPayload};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;

    use super::*;
    use crate::lakehouse::change::TypedChange;
    use crate::lakehouse::layout::{history_columns, history_schema};
    use crate::lakehouse::read::{Envelope, type_change};
    use crate::lakehouse::typing::Cell;
    use crate::query::merge::Overlay;

    /// Changes over a few keys: inserts, updates with and without `doc`
    /// (left out as an unchanged TOAST value), updates that move the key,
    /// deletes and a truncate, in an order drawn from a fixed seed.
    fn changes(shape: &TableShape) -> Vec<TypedChange> {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut draw = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        (1..=240)
            .map(|seq| {
                let id = draw(6) + 1;
                let line = match (seq, draw(10)) {
                    (120, _) => r#""op":"truncate","data":null,"old":null"#.to_string(),
                    (_, 0) => format!(r#""op":"delete","data":null,"old":{{"id":{id}}}"#),
                    (_, 1) => format!(
                        r#""op":"update","data":{{"id":{}}},"old":{{"id":{id}}}"#,
                        draw(6) + 1
                    ),
                    (_, 2..=4) => format!(r#""op":"update","data":{{"id":{id}}},"old":null"#),
                    _ => format!(
                        r#""op":"insert","data":{{"id":{id},"doc":"d{seq}"}},"old":null"#
                    ),
                };
                let line = format!(
                    r#"{{{line},"table":"public.t","seq":{seq},"idempotency_key":"p:{seq}","commit_lsn":"0/{seq:X}"}}"#
                );
                type_change(shape, serde_json::from_str::<Envelope>(&line).unwrap()).unwrap()
            })
            .collect()
    }

    /// The changes written as history files of 100 changes, in row groups
    /// of 16.
    async fn history(shape: &TableShape, changes: &[TypedChange]) -> (Arc<InMemory>, Vec<String>) {
        let store = Arc::new(InMemory::new());
        let mut files = Vec::new();
        for part in changes.chunks(100) {
            let (first, last) = (part[0].seq, part[part.len() - 1].seq);
            let key = format!("parquet/public/t/date=2026-12-01/{first}-{last}-r.parquet");
            let batch =
                RecordBatch::try_new(history_schema(shape), history_columns(shape, part)).unwrap();
            let props = WriterProperties::builder()
                .set_max_row_group_row_count(Some(16))
                .build();
            let mut out = Vec::new();
            let mut writer = ArrowWriter::try_new(&mut out, batch.schema(), Some(props)).unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
            store
                .put(&Path::from(key.as_str()), PutPayload::from(out))
                .await
                .unwrap();
            files.push(key);
        }
        (store, files)
    }

    fn id_and_doc(
        batches: &[RecordBatch],
        id: Option<usize>,
        doc: Option<usize>,
    ) -> Vec<(i64, Option<String>)> {
        let mut rows = Vec::new();
        for b in batches {
            for i in 0..b.num_rows() {
                let id = id.map_or(0, |c| {
                    b.column(c)
                        .as_any()
                        .downcast_ref::<Int64Array>()
                        .unwrap()
                        .value(i)
                });
                let doc = doc.and_then(|c| {
                    let a = b.column(c).as_any().downcast_ref::<StringArray>().unwrap();
                    (!a.is_null(i)).then(|| a.value(i).to_string())
                });
                rows.push((id, doc));
            }
        }
        rows.sort();
        rows
    }

    #[tokio::test]
    async fn the_view_at_every_seq_is_the_one_the_changes_up_to_it_leave() {
        let shape = Arc::new(TableShape::test_t());
        let changes = changes(&shape);
        let (store, files) = history(&shape, &changes).await;
        let mut left_out = 0;
        for at in 1..=changes.len() as u64 {
            let mut overlay = Overlay::new(Arc::clone(&shape), false);
            for c in changes.iter().filter(|c| c.seq <= at) {
                overlay.apply(c.clone());
            }
            let expected = id_and_doc(&overlay.batches(7), Some(0), Some(1));
            let files: Vec<String> = files
                .iter()
                .filter(|f| crate::lakehouse::compacted::history_first_seq(f).unwrap() <= at)
                .cloned()
                .collect();
            let view = AtView::new(store.clone(), Arc::clone(&shape), files, at, 2);
            let both = view.rows(&[0, 1]).await.unwrap();
            assert_eq!(id_and_doc(&both, Some(0), Some(1)), expected, "at {at}");
            let swapped = view.rows(&[1, 0]).await.unwrap();
            assert_eq!(id_and_doc(&swapped, Some(1), Some(0)), expected, "at {at}");
            let docs = view.rows(&[1]).await.unwrap();
            let mut only: Vec<_> = expected.iter().map(|(_, d)| (0, d.clone())).collect();
            only.sort();
            assert_eq!(id_and_doc(&docs, None, Some(0)), only, "at {at}");
            let counted: usize = view
                .rows(&[])
                .await
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum();
            assert_eq!(counted, expected.len(), "at {at}");
            left_out += changes
                .iter()
                .filter(|c| c.seq == at && c.cells[1] == Cell::Absent && c.key.is_some())
                .count();
        }
        assert!(left_out > 20, "the changes leave doc out often: {left_out}");
    }

    #[test]
    fn a_selection_takes_exactly_the_positions() {
        let s = selection(&[0, 1, 2, 5, 9], 12);
        let expected: Vec<RowSelector> = vec![
            RowSelector::select(3),
            RowSelector::skip(2),
            RowSelector::select(1),
            RowSelector::skip(3),
            RowSelector::select(1),
            RowSelector::skip(2),
        ];
        assert_eq!(Vec::<RowSelector>::from(s), expected);
        assert_eq!(
            Vec::<RowSelector>::from(selection(&[3], 4)),
            vec![RowSelector::skip(3), RowSelector::select(1)]
        );
    }
}
