//! The latest view: one row per key, the version with the highest seq,
//! written as `[prefix/]latest/<schema>/<table>/<generation>-<bucket>-<part>.parquet`
//! with the data columns and `_seq`, `_lsn`, `_key`.
//!
//! A run merges the previous generation (read back through DataFusion) with
//! its new changes, applied in seq order: an upsert replaces the row and
//! takes the previous version's value for every column it left out
//! (unchanged TOAST); an update that moves the key drops the old key's row;
//! a delete drops the row; a truncate drops every row. It then writes a new
//! generation under new names; the manifest switches to it in one PUT and
//! the previous generation is deleted after. Readers that want a consistent
//! view while a run replaces the files read the files the manifest lists.
//!
//! Buckets: a table's keys are split into `n` buckets by the hash of the
//! key ([`super::spool::bucket_of`], `n` a power of two recorded in the
//! manifest), and the view is merged and written bucket by bucket (two at
//! a time, see `compact::MERGERS`), as files
//! `<generation>-<bucket>-<part>.parquet`: memory holds the rows of two
//! buckets, not the table's. `n` grows (doubling) with the table; bucket
//! `b` of `n` then draws its previous rows from bucket `b % n_before`.
//! An update that moves a row to a key of another bucket is applied in
//! both: the old key's bucket drops the row, the new key's bucket takes the
//! values it left out (unchanged TOAST) from the old row, replaying the old
//! bucket up to that change when it comes later in the merge.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arrow::array::{Array, ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use compact_str::CompactString;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use futures::StreamExt;
use object_store::ObjectStoreExt;
use parquet::file::properties::WriterProperties;

use super::history::{Output, ParquetFile, dictionaries_for, table_dir};
use super::manifest::Move;
use super::read::{ChangeOp, TypedChange};
use super::session::{ARCHIVE_URL, table_url};
use super::spool::{Spool, Step, bucket_of};
use super::typing::{Cell, TableShape, build_array, read_cells};
use crate::{Error, Result};

/// Rows per Arrow batch written.
const BATCH_ROWS: usize = 8192;

/// One current row.
#[derive(Debug, Clone)]
struct Row {
    seq: u64,
    lsn: CompactString,
    cells: Vec<Cell>,
}

/// A table's latest rows, being merged.
pub struct LatestView {
    pub shape: Arc<TableShape>,
    rows: HashMap<CompactString, Row, foldhash::fast::RandomState>,
}

/// The latest view's Arrow schema.
pub fn latest_schema(shape: &TableShape) -> SchemaRef {
    let mut fields: Vec<Field> = shape
        .columns
        .iter()
        .map(|c| Field::new(&c.name, c.kind.data_type(), true))
        .collect();
    fields.extend([
        Field::new("_seq", DataType::Int64, false),
        Field::new("_lsn", DataType::Utf8, false),
        Field::new("_key", DataType::Utf8, false),
    ]);
    Arc::new(Schema::new(fields))
}

impl LatestView {
    /// A view with no rows.
    pub fn empty(shape: Arc<TableShape>) -> LatestView {
        LatestView {
            shape,
            rows: HashMap::default(),
        }
    }

    /// Reads the previous generation's `files` (keys in the store).
    pub async fn load(
        ctx: &SessionContext,
        shape: Arc<TableShape>,
        files: &[String],
    ) -> Result<LatestView> {
        LatestView::load_bucket(ctx, shape, files, 0, 1).await
    }

    /// Reads the rows of bucket `bucket` of `buckets` from `files` (keys in
    /// the store): rows of other buckets are skipped.
    pub async fn load_bucket(
        ctx: &SessionContext,
        shape: Arc<TableShape>,
        files: &[String],
        bucket: u32,
        buckets: u32,
    ) -> Result<LatestView> {
        let mut view = LatestView::empty(shape);
        if files.is_empty() {
            return Ok(view);
        }
        let urls: Vec<String> = files.iter().map(|k| table_url(k)).collect();
        let table = view.shape.table.clone();
        let df_error = |e: datafusion::error::DataFusionError| {
            Error::fatal(
                format!("cannot read the latest view of {table}: {e}"),
                "the files the compaction manifest lists must be readable; if they were removed, delete the manifest with the parquet/ and latest/ folders and compact again",
            )
        };
        // DataFusion lists a missing key as an empty folder: without this
        // check a removed file would read as no rows, and the view written
        // from it would silently lose them.
        let url = ObjectStoreUrl::parse(ARCHIVE_URL).expect("a valid URL");
        let store = ctx.runtime_env().object_store(&url).map_err(df_error)?;
        for key in files {
            if let Err(object_store::Error::NotFound { .. }) = store
                .head(&object_store::path::Path::from(key.as_str()))
                .await
            {
                return Err(Error::fatal(
                    format!("{key} of the latest view of {table} is missing from the store"),
                    "the files the compaction manifest lists must be readable; if they were removed, delete the manifest with the parquet/ and latest/ folders and compact again",
                ));
            }
        }
        let df = ctx
            .read_parquet(urls, ParquetReadOptions::default())
            .await
            .map_err(df_error)?;
        let mut stream = df.execute_stream().await.map_err(df_error)?;
        while let Some(batch) = stream.next().await {
            let batch = batch.map_err(df_error)?;
            view.absorb(&batch, bucket, buckets)?;
        }
        Ok(view)
    }

    /// Adds the rows of a batch of a previous generation that are in
    /// bucket `bucket` of `buckets`.
    fn absorb(&mut self, batch: &RecordBatch, bucket: u32, buckets: u32) -> Result<()> {
        let n = batch.num_rows();
        let bad = |what: String| {
            Error::fatal(
                format!(
                    "the latest view of {} cannot be read: {what}",
                    self.shape.table
                ),
                "delete the manifest with the parquet/ and latest/ folders and compact again",
            )
        };
        let mut columns: Vec<Vec<Cell>> = Vec::with_capacity(self.shape.columns.len());
        for c in &self.shape.columns {
            columns.push(match batch.column_by_name(&c.name) {
                Some(array) => read_cells(c.kind, array).map_err(bad)?,
                // Added since that generation: null until a change sets it.
                None => vec![Cell::Null; n],
            });
        }
        let text = |name: &str| -> Result<StringArray> {
            let a = batch
                .column_by_name(name)
                .ok_or_else(|| bad(format!("no {name} column")))?;
            let a = arrow::compute::cast(a, &DataType::Utf8).map_err(|e| bad(e.to_string()))?;
            Ok(a.as_any()
                .downcast_ref::<StringArray>()
                .expect("cast to Utf8")
                .clone())
        };
        let keys = text("_key")?;
        let lsns = text("_lsn")?;
        let seqs = batch
            .column_by_name("_seq")
            .and_then(|a| a.as_any().downcast_ref::<Int64Array>())
            .ok_or_else(|| bad("no _seq column".into()))?;
        let mut iters: Vec<std::vec::IntoIter<Cell>> =
            columns.into_iter().map(Vec::into_iter).collect();
        for i in 0..n {
            let cells = iters
                .iter_mut()
                .map(|it| it.next().expect("one cell per row"))
                .collect();
            if buckets > 1 && bucket_of(keys.value(i), buckets) != bucket {
                continue;
            }
            self.rows.insert(
                keys.value(i).into(),
                Row {
                    seq: seqs.value(i) as u64,
                    lsn: lsns.value(i).into(),
                    cells,
                },
            );
        }
        Ok(())
    }

    /// Applies one change; changes come in seq order. Takes the change so
    /// that its values move into the view rather than being copied.
    pub fn apply(&mut self, change: TypedChange) {
        match change.op {
            ChangeOp::Truncate => self.rows.clear(),
            ChangeOp::Delete => {
                if let Some(k) = change.key.as_deref().or(change.old_key.as_deref()) {
                    self.rows.remove(k);
                }
            }
            ChangeOp::Upsert => {
                let Some(key) = change.key.as_deref() else {
                    return;
                };
                // An update that changed the key: the row was under the old one.
                let moved = match change.old_key.as_deref() {
                    Some(old) if old != key => self.rows.remove(old).map(|r| r.cells),
                    _ => None,
                };
                self.put(change, moved);
            }
        }
    }

    /// Applies an update that moved a row here from a key of another
    /// bucket: `moved` is the old row's values at that change (`None` when
    /// there was no such row), as [`LatestView::apply`] would have found it.
    pub fn apply_moved_in(&mut self, change: TypedChange, moved: Option<Vec<Cell>>) {
        self.put(change, moved);
    }

    /// Stores an upsert's row, its absent (unchanged TOAST) cells taken
    /// from the row's values before: `moved` (the row under its old key,
    /// when the change moved it and it was found), else the row under its
    /// key, else null. A row already under the key is replaced in place:
    /// no second lookup, no new key, and its values move rather than copy.
    fn put(&mut self, change: TypedChange, mut moved: Option<Vec<Cell>>) {
        let TypedChange {
            key: Some(key),
            mut cells,
            seq,
            lsn,
            ..
        } = change
        else {
            return;
        };
        match self.rows.get_mut(key.as_str()) {
            Some(row) => {
                take_absent(
                    &mut cells,
                    Some(moved.as_deref_mut().unwrap_or(&mut row.cells)),
                );
                *row = Row { seq, lsn, cells };
            }
            None => {
                take_absent(&mut cells, moved.as_deref_mut());
                self.rows.insert(key, Row { seq, lsn, cells });
            }
        }
    }

    /// Removes the row under `key`; its values.
    pub fn remove(&mut self, key: &str) -> Option<Vec<Cell>> {
        self.rows.remove(key).map(|r| r.cells)
    }

    /// The values of the row under `key`.
    pub fn get(&self, key: &str) -> Option<&[Cell]> {
        self.rows.get(key).map(|r| r.cells.as_slice())
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Writes the view as bucket `bucket` of `target`'s generation into its
    /// staging folder (which readers of `latest/` do not see), rows ordered
    /// by key, in files `<generation>-<bucket>-<part>` of about
    /// `file_bytes` at most; an empty bucket writes no file unless
    /// `always`. Returns where each file goes once the manifest points at
    /// it (see [`super::publish`]) and the bytes written.
    pub async fn write_bucket(
        &self,
        target: &LatestTarget,
        bucket: u32,
        always: bool,
    ) -> Result<(Vec<Move>, u64)> {
        let LatestTarget {
            output,
            prefix,
            staging,
            generation,
            props,
            file_bytes,
        } = target;
        let (prefix, file_bytes) = (prefix.as_deref(), *file_bytes);
        let stem = format!("{generation:08}-{bucket:04}");
        let schema = latest_schema(&self.shape);
        let dir = table_dir(prefix, staging, &self.shape);
        let final_dir = table_dir(prefix, "latest", &self.shape);
        let mut rows: Vec<(&CompactString, &Row)> = self.rows.iter().collect();
        rows.sort_unstable_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        let mut written = Vec::new();
        let mut bytes = 0;
        let mut file: Option<ParquetFile> = None;
        for chunk in rows.chunks(BATCH_ROWS) {
            if file.as_ref().is_some_and(|f| f.size() >= file_bytes) {
                let f = file.take().expect("checked");
                written.push(f.key.clone());
                bytes += f.finish().await?;
            }
            let f = match &mut file {
                Some(f) => f,
                None => file.insert(ParquetFile::create(
                    output,
                    format!("{dir}/{stem}-{:04}.parquet", written.len()),
                    Arc::clone(&schema),
                    dictionaries_for(
                        props.clone(),
                        &self.shape,
                        chunk
                            .iter()
                            .map(|(_, r)| (r.cells.as_slice(), r.lsn.as_str())),
                    ),
                )?),
            };
            let rows: Vec<&Row> = chunk.iter().map(|(_, r)| *r).collect();
            let mut columns: Vec<ArrayRef> = self
                .shape
                .columns
                .iter()
                .enumerate()
                .map(|(i, c)| build_array(c.kind, rows.iter().map(|r| &r.cells[i])))
                .collect();
            columns.push(Arc::new(
                rows.iter().map(|r| r.seq as i64).collect::<Int64Array>(),
            ));
            columns.push(Arc::new(
                rows.iter().map(|r| Some(&*r.lsn)).collect::<StringArray>(),
            ));
            columns.push(Arc::new(
                chunk
                    .iter()
                    .map(|(k, _)| Some(k.as_str()))
                    .collect::<StringArray>(),
            ));
            let batch = RecordBatch::try_new(Arc::clone(&schema), columns)
                .map_err(|e| Error::bug(format!("cannot build a batch of {}: {e}", f.key)))?;
            f.write(&batch).await?;
        }
        // An empty table still gets a file, so readers find its columns.
        let f = match file {
            Some(f) => Some(f),
            None if always => Some(ParquetFile::create(
                output,
                format!("{dir}/{stem}-0000.parquet"),
                Arc::clone(&schema),
                props.clone(),
            )?),
            None => None,
        };
        if let Some(f) = f {
            written.push(f.key.clone());
            bytes += f.finish().await?;
        }
        let moves = written
            .into_iter()
            .map(|from| Move {
                to: format!(
                    "{final_dir}/{}",
                    from.rsplit('/').next().expect("a file name")
                ),
                from,
            })
            .collect();
        Ok((moves, bytes))
    }
}

/// Where and how a run writes its new latest generation.
#[derive(Clone)]
pub struct LatestTarget {
    pub output: Output,
    pub prefix: Option<String>,
    /// The folder files are written to before they are published.
    pub staging: String,
    pub generation: u64,
    pub props: WriterProperties,
    pub file_bytes: u64,
}

/// The bucket a latest-view file holds, from its name:
/// `<generation>-<bucket>-<part>.parquet`; files of a generation written
/// before buckets existed (`<generation>-<part>.parquet`) hold bucket 0 of 1.
pub fn file_bucket(key: &str) -> u32 {
    let name = key.rsplit('/').next().unwrap_or(key);
    let stem = name.strip_suffix(".parquet").unwrap_or(name);
    let parts: Vec<&str> = stem.split('-').collect();
    match parts.as_slice() {
        [_, bucket, _] => bucket.parse().unwrap_or(0),
        _ => 0,
    }
}

/// What the bucket merges of one table read: the previous generation and
/// the run's spool. Shared by the merges running at once.
pub struct MergeInput {
    pub ctx: SessionContext,
    pub shape: Arc<TableShape>,
    /// The previous generation's files and its bucket count.
    pub previous: Vec<String>,
    pub previous_buckets: u32,
    pub spool: Arc<Spool>,
    /// The bucket count of this merge (a multiple of `previous_buckets`).
    pub buckets: u32,
    /// By seq, the old row of each update that moved a row across buckets
    /// leaving columns out; filled as buckets are merged, and by replaying
    /// the old key's bucket up to that update when it was not merged that
    /// far yet. Only such updates use it; when the spool holds any
    /// (`TableSpool::carried_moves`: updates that changed a row's key
    /// leaving a column out, whichever buckets the keys fall in, which is
    /// known only later) buckets are merged one at a time, in order, so
    /// that only moves from a later bucket cost a replay; merged two at
    /// once, moves between the two would too. The result is the same.
    pub moved: Mutex<HashMap<u64, Option<Vec<Cell>>>>,
}

/// Fills `cells`' absent (unchanged TOAST) cells with `previous`' values,
/// moved out of it (it is being replaced), or with nulls without one.
fn take_absent(cells: &mut [Cell], mut previous: Option<&mut [Cell]>) {
    for (i, cell) in cells.iter_mut().enumerate() {
        if matches!(cell, Cell::Absent) {
            *cell = match previous.as_deref_mut() {
                Some(p) => std::mem::replace(&mut p[i], Cell::Null),
                None => Cell::Null,
            };
        }
    }
}

/// The latest view of bucket `bucket`: the previous generation's rows of
/// the bucket with the run's changes of the bucket applied in seq order,
/// those before seq `until` only when it is given.
pub async fn merge_bucket(
    input: &MergeInput,
    bucket: u32,
    until: Option<u64>,
) -> Result<LatestView> {
    let n = input.buckets;
    let previous_bucket = bucket & (input.previous_buckets.max(1) - 1);
    let files: Vec<String> = input
        .previous
        .iter()
        .filter(|f| file_bucket(f) == previous_bucket)
        .cloned()
        .collect();
    let mut view =
        LatestView::load_bucket(&input.ctx, Arc::clone(&input.shape), &files, bucket, n).await?;
    let table = &input.shape.table;
    for file in input.spool.rounds(table) {
        for step in input.spool.read_round(table, file, bucket, n)? {
            if until.is_some_and(|u| step.seq() >= u) {
                return Ok(view);
            }
            match step {
                Step::MoveOut {
                    seq,
                    from,
                    to,
                    carry,
                } => {
                    if bucket_of(&to, n) == bucket {
                        continue; // the update itself, in this bucket, moves it
                    }
                    let row = view.remove(&from);
                    if carry {
                        input.moved.lock().expect("not poisoned").insert(seq, row);
                    }
                }
                Step::Change(c) => {
                    let moved_from = match (&c.old_key, &c.key) {
                        (Some(old), Some(key)) if c.op == ChangeOp::Upsert && old != key => {
                            Some(bucket_of(old, n)).filter(|b| *b != bucket)
                        }
                        _ => None,
                    };
                    let Some(from) = moved_from else {
                        view.apply(Arc::unwrap_or_clone(c));
                        continue;
                    };
                    let carried = if c.cells.contains(&Cell::Absent) {
                        let known = input
                            .moved
                            .lock()
                            .expect("not poisoned")
                            .get(&c.seq)
                            .cloned();
                        match known {
                            Some(row) => row,
                            None => {
                                // The old key's bucket is merged later:
                                // replay it up to this change.
                                let old = c.old_key.as_deref().expect("matched above");
                                let before =
                                    Box::pin(merge_bucket(input, from, Some(c.seq))).await?;
                                let row = before.get(old).map(<[Cell]>::to_vec);
                                input
                                    .moved
                                    .lock()
                                    .expect("not poisoned")
                                    .insert(c.seq, row.clone());
                                row
                            }
                        }
                    } else {
                        None
                    };
                    view.apply_moved_in(Arc::unwrap_or_clone(c), carried);
                }
            }
        }
    }
    Ok(view)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> LatestView {
        LatestView {
            shape: Arc::new(TableShape::test_t()),
            rows: HashMap::default(),
        }
    }

    fn change(op: ChangeOp, seq: u64, id: i64, doc: Cell, old_key: Option<i64>) -> TypedChange {
        TypedChange {
            op_name: "update",
            op,
            seq,
            lsn: "0/1".into(),
            key: Some(format!(r#"{{"id":{id}}}"#).into()),
            old_key: old_key.map(|k| format!(r#"{{"id":{k}}}"#).into()),
            cells: vec![Cell::Int(id), doc],
            old: None,
            unchanged: None,
        }
    }

    fn doc(v: &LatestView, id: i64) -> Option<Cell> {
        v.rows
            .get(format!(r#"{{"id":{id}}}"#).as_str())
            .map(|r| r.cells[1].clone())
    }

    #[test]
    fn unchanged_toast_is_carried_forward_even_across_a_key_change() {
        let mut v = view();
        v.apply(change(
            ChangeOp::Upsert,
            1,
            1,
            Cell::Str("big".into()),
            None,
        ));
        v.apply(change(ChangeOp::Upsert, 2, 1, Cell::Absent, None));
        assert_eq!(doc(&v, 1), Some(Cell::Str("big".into())));
        v.apply(change(ChangeOp::Upsert, 3, 2, Cell::Absent, Some(1)));
        assert_eq!(doc(&v, 1), None, "the old key's row is gone");
        assert_eq!(doc(&v, 2), Some(Cell::Str("big".into())));
        assert_eq!(v.rows[r#"{"id":2}"#].seq, 3);
    }

    /// A move carries from the row under the old key when there is one,
    /// else from the row already under the new key; it replaces that row.
    #[test]
    fn a_move_onto_a_key_that_has_a_row_carries_from_the_right_one() {
        let mut v = view();
        v.apply(change(
            ChangeOp::Upsert,
            1,
            1,
            Cell::Str("one".into()),
            None,
        ));
        v.apply(change(
            ChangeOp::Upsert,
            2,
            2,
            Cell::Str("two".into()),
            None,
        ));
        // Both keys have a row: the moved row's value wins.
        v.apply(change(ChangeOp::Upsert, 3, 2, Cell::Absent, Some(1)));
        assert_eq!(doc(&v, 1), None);
        assert_eq!(doc(&v, 2), Some(Cell::Str("one".into())));
        // The old key has no row: the new key's own row is carried.
        v.apply(change(ChangeOp::Upsert, 4, 2, Cell::Absent, Some(9)));
        assert_eq!(doc(&v, 2), Some(Cell::Str("one".into())));
        assert_eq!(v.rows[r#"{"id":2}"#].seq, 4);
        // Neither has one: null.
        v.apply(change(ChangeOp::Upsert, 5, 3, Cell::Absent, Some(8)));
        assert_eq!(doc(&v, 3), Some(Cell::Null));
        assert_eq!(v.len(), 2);
    }

    #[test]
    fn deletes_and_truncates_remove_rows() {
        let mut v = view();
        v.apply(change(ChangeOp::Upsert, 1, 1, Cell::Null, None));
        v.apply(change(ChangeOp::Upsert, 2, 2, Cell::Null, None));
        v.apply(change(ChangeOp::Delete, 3, 1, Cell::Null, None));
        assert_eq!(v.len(), 1);
        let mut t = change(ChangeOp::Truncate, 4, 0, Cell::Null, None);
        t.key = None;
        v.apply(t);
        assert!(v.is_empty());
        // A row inserted after the truncate stays.
        v.apply(change(ChangeOp::Upsert, 5, 7, Cell::Null, None));
        assert_eq!(v.len(), 1);
    }

    #[test]
    fn an_update_to_a_deleted_rows_toasted_column_does_not_resurrect_its_value() {
        let mut v = view();
        v.apply(change(
            ChangeOp::Upsert,
            1,
            1,
            Cell::Str("big".into()),
            None,
        ));
        v.apply(change(ChangeOp::Delete, 2, 1, Cell::Null, None));
        v.apply(change(ChangeOp::Upsert, 3, 1, Cell::Absent, None));
        assert_eq!(doc(&v, 1), Some(Cell::Null));
    }

    /// The latest view's files, like the history's, are written without a
    /// dictionary for columns whose values nearly never repeat (the key
    /// here), and with one for the others; rows in key order.
    #[tokio::test]
    async fn a_view_column_that_rarely_repeats_is_written_without_a_dictionary() {
        use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
        use parquet::schema::types::ColumnPath;
        let mut v = view();
        for id in 1..=3000 {
            let doc = Cell::Str(format!("status {}", id % 7).into());
            v.apply(change(ChangeOp::Upsert, id as u64, id, doc, None));
        }
        let store = Arc::new(object_store::memory::InMemory::new());
        let target = LatestTarget {
            output: Output {
                store: store.clone(),
                parts: None,
            },
            prefix: None,
            staging: "staging".into(),
            generation: 1,
            props: super::super::history::writer_properties(&Default::default()),
            file_bytes: 1 << 30,
        };
        let (moves, _) = v.write_bucket(&target, 0, false).await.unwrap();
        assert_eq!(moves.len(), 1);
        let path = object_store::path::Path::from(moves[0].from.as_str());
        let bytes = store.get(&path).await.unwrap().bytes().await.unwrap();
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).unwrap();
        let group = reader.metadata().row_group(0);
        let dictionary = |name: &str| {
            let path = ColumnPath::from(name);
            let column = group.columns().iter().find(|c| *c.column_path() == path);
            column.unwrap().dictionary_page_offset().is_some()
        };
        assert!(!dictionary("id"));
        assert!(dictionary("doc"));
        let batches: Vec<RecordBatch> = reader.build().unwrap().map(Result::unwrap).collect();
        let keys: Vec<String> = batches
            .iter()
            .flat_map(|b| {
                let keys = b.column_by_name("_key").unwrap();
                let keys = keys.as_any().downcast_ref::<StringArray>().unwrap();
                keys.iter()
                    .map(|k| k.unwrap().to_string())
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(keys.len(), 3000);
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "rows in key order");
    }
}
