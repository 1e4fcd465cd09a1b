//! A latest view in memory: one bucket of a table's rows, merged from the
//! previous generation's files and the run's changes, and written as the
//! new generation's files of that bucket (see the [latest view's](super)
//! opening comment for how rows are held).

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::DataType;
use compact_str::CompactString;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use futures::StreamExt;
use object_store::ObjectStoreExt;
use parquet::file::properties::WriterProperties;

use crate::compact::history::dictionaries_for;
use crate::compact::parquet_file::{Output, ParquetFile};
use crate::compact::spool::bucket_of;
use crate::error::ErrorKind;
use crate::lakehouse::change::{ChangeOp, TypedChange};
use crate::lakehouse::columns::{absent_bits, left_out};
use crate::lakehouse::compacted::UNREADABLE_FIX;
use crate::lakehouse::layout::{latest_schema, table_dir};
use crate::lakehouse::session::{ARCHIVE_URL, table_url};
use crate::lakehouse::typing::array::{build_array, read_cells};
use crate::lakehouse::typing::{Cell, TableShape};
use crate::{Error, Result};

/// Rows per Arrow batch written.
const BATCH_ROWS: usize = 8192;

/// Where a value of the view is: row `row` of source `src`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Loc {
    pub(super) src: u32,
    pub(super) row: u32,
}

/// The one row of nulls (source 0): the value of a column an upsert left
/// out when there is no earlier version to take it from.
const NULL: Loc = Loc { src: 0, row: 0 };

/// Rows the view takes its values from: a batch of the previous
/// generation, a spooled batch, or one row built from cells. Values stay in
/// these columns until the view is written: a row of the view is where its
/// values are, not a copy of them.
pub(super) struct Source {
    /// The data columns, as the shape's kinds.
    pub(super) columns: Vec<ArrayRef>,
    pub(super) seqs: Int64Array,
    pub(super) lsns: ArrayRef,
}

/// One current row: where its version is (`at`: its seq, LSN and values)
/// and, when that version left columns out (unchanged TOAST), where each
/// column's value is.
#[derive(Debug, Clone)]
pub(super) struct Row {
    pub(super) at: Loc,
    pub(super) columns: Option<Box<[Loc]>>,
}

impl Row {
    fn loc(&self, column: usize) -> Loc {
        self.columns.as_ref().map_or(self.at, |c| c[column])
    }
}

/// A table's latest rows, being merged.
pub struct LatestView {
    /// The table the view holds rows of.
    pub shape: Arc<TableShape>,
    pub(super) sources: Vec<Source>,
    pub(super) rows: HashMap<CompactString, Row, foldhash::fast::RandomState>,
}

impl LatestView {
    /// A view with no rows.
    pub fn empty(shape: Arc<TableShape>) -> LatestView {
        let nulls = Source {
            columns: shape
                .columns
                .iter()
                .map(|c| arrow::array::new_null_array(&c.kind.data_type(), 1))
                .collect(),
            seqs: Int64Array::from(vec![0]),
            lsns: Arc::new(StringArray::from(vec![""])),
        };
        LatestView {
            shape,
            sources: vec![nulls],
            rows: HashMap::default(),
        }
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
                UNREADABLE_FIX,
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
                    UNREADABLE_FIX,
                )
                .with_kind(ErrorKind::Archive));
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
        let bad = |what: String| {
            Error::fatal(
                format!(
                    "the latest view of {} cannot be read: {what}",
                    self.shape.table
                ),
                UNREADABLE_FIX,
            )
        };
        let cast = |array: &ArrayRef, to: &DataType| {
            arrow::compute::cast(array, to)
                .map_err(|e| bad(format!("cannot read {} as {to}: {e}", array.data_type())))
        };
        let column = |batch: &RecordBatch, name: &str, to: &DataType| -> Result<ArrayRef> {
            let a = batch
                .column_by_name(name)
                .ok_or_else(|| bad(format!("no {name} column")))?;
            cast(a, to)
        };
        // Only this bucket's rows are kept: a file of a previous generation
        // with fewer buckets holds the rows of several.
        let filtered;
        let batch = if buckets > 1 {
            let keys = column(batch, "_key", &DataType::Utf8)?;
            let mine: arrow::array::BooleanArray = keys
                .as_string::<i32>()
                .iter()
                .map(|k| Some(k.is_some_and(|k| bucket_of(k, buckets) == bucket)))
                .collect();
            filtered = arrow::compute::filter_record_batch(batch, &mine)
                .map_err(|e| bad(e.to_string()))?;
            &filtered
        } else {
            batch
        };
        let n = batch.num_rows();
        if n == 0 {
            return Ok(());
        }
        let mut columns = Vec::with_capacity(self.shape.columns.len());
        for c in &self.shape.columns {
            columns.push(match batch.column_by_name(&c.name) {
                Some(array) => cast(array, &c.kind.data_type())?,
                // Added since that generation: null until a change sets it.
                None => arrow::array::new_null_array(&c.kind.data_type(), n),
            });
        }
        let keys = column(batch, "_key", &DataType::Utf8)?;
        let keys = keys.as_string::<i32>();
        let seqs = column(batch, "_seq", &DataType::Int64)?
            .as_primitive::<arrow::datatypes::Int64Type>()
            .clone();
        let lsns = column(batch, "_lsn", &DataType::Utf8)?;
        if keys.null_count() > 0 {
            return Err(bad("a row without _key".into()));
        }
        let src = self.add(Source {
            columns,
            seqs,
            lsns,
        });
        for i in 0..n {
            let row = Row {
                at: Loc { src, row: i as u32 },
                columns: None,
            };
            self.rows.insert(keys.value(i).into(), row);
        }
        Ok(())
    }

    /// Adds a source; its index.
    pub(super) fn add(&mut self, source: Source) -> u32 {
        self.sources.push(source);
        (self.sources.len() - 1) as u32
    }

    /// A source of one row of `cells` (absent ones null).
    pub(super) fn add_cells(&mut self, cells: &[Cell], seq: u64, lsn: &str) -> Loc {
        let columns = self
            .shape
            .columns
            .iter()
            .zip(cells)
            .map(|(c, cell)| build_array(c.kind, std::iter::once(cell)))
            .collect();
        let src = self.add(Source {
            columns,
            seqs: Int64Array::from(vec![seq as i64]),
            lsns: Arc::new(StringArray::from(vec![lsn])),
        });
        Loc { src, row: 0 }
    }

    /// Applies one change in hand; changes come in seq order.
    pub fn apply(&mut self, change: TypedChange) {
        let at = match change.op {
            ChangeOp::Upsert => self.add_cells(&change.cells, change.seq, &change.lsn),
            _ => NULL,
        };
        let absent = absent_bits(&change.cells);
        let (key, old_key) = (change.key.as_deref(), change.old_key.as_deref());
        self.apply_at(change.op, key, old_key, at, absent.as_deref(), None);
    }

    /// Applies a change whose version (for an upsert) is at `at`: a
    /// truncate empties the view, a delete removes the row under its key
    /// (or old key), an upsert replaces the row (see [`LatestView::put`]),
    /// removing it from its old key when it moved. `moved_in`: for an
    /// update that moved a row here from a key another bucket holds, the
    /// old row as that bucket had it (or `None`), instead.
    pub(super) fn apply_at(
        &mut self,
        op: ChangeOp,
        key: Option<&str>,
        old_key: Option<&str>,
        at: Loc,
        absent: Option<&[u8]>,
        moved_in: Option<Option<Row>>,
    ) {
        match op {
            ChangeOp::Truncate => self.rows.clear(),
            ChangeOp::Delete => {
                if let Some(k) = key.or(old_key) {
                    self.rows.remove(k);
                }
            }
            ChangeOp::Upsert => {
                let Some(key) = key else {
                    return;
                };
                let moved = match (moved_in, old_key) {
                    (Some(row), _) => row,
                    (None, Some(old)) if old != key => self.rows.remove(old),
                    (None, _) => None,
                };
                self.put(key, at, absent, moved);
            }
        }
    }

    /// Stores an upsert's row, version `at`, whose `absent` columns
    /// (unchanged TOAST) take the row's values before: `moved` (the row
    /// under its old key, when the change moved it and it was found), else
    /// the row under its key, else null. A row already under the key is
    /// replaced in place.
    fn put(&mut self, key: &str, at: Loc, absent: Option<&[u8]>, moved: Option<Row>) {
        let n = self.shape.columns.len();
        let absent = absent.filter(|bits| bits.iter().any(|b| *b != 0));
        let carried = |bits: &[u8], before: Option<&Row>| -> Box<[Loc]> {
            (0..n)
                .map(|j| match before {
                    Some(b) if left_out(bits, j) => b.loc(j),
                    None if left_out(bits, j) => NULL,
                    _ => at,
                })
                .collect()
        };
        match self.rows.get_mut(key) {
            Some(row) => {
                let columns = absent.map(|bits| carried(bits, Some(moved.as_ref().unwrap_or(row))));
                *row = Row { at, columns };
            }
            None => {
                let columns = absent.map(|bits| carried(bits, moved.as_ref()));
                self.rows.insert(key.into(), Row { at, columns });
            }
        }
    }

    /// The values of `row`.
    fn cells(&self, row: &Row) -> Vec<Cell> {
        self.shape
            .columns
            .iter()
            .enumerate()
            .map(|(j, c)| {
                let Loc { src, row } = row.loc(j);
                let array = self.sources[src as usize].columns[j].slice(row as usize, 1);
                read_cells(c.kind, &array)
                    .expect("a source holds the shape's kinds")
                    .pop()
                    .expect("one cell")
            })
            .collect()
    }

    /// Removes the row under `key`; its values.
    pub(super) fn remove(&mut self, key: &str) -> Option<Vec<Cell>> {
        let row = self.rows.remove(key)?;
        Some(self.cells(&row))
    }

    /// The values of the row under `key`.
    pub fn get(&self, key: &str) -> Option<Vec<Cell>> {
        self.rows.get(key).map(|r| self.cells(r))
    }

    /// The rows (keys) the view holds.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the view holds no row.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The values, seqs and LSNs of `rows`, in that order, as one source.
    fn gather(&self, rows: &[&Row]) -> Result<Source> {
        let take = |f: &dyn Fn(&Source) -> &dyn Array, loc: &dyn Fn(&Row) -> Loc| {
            let values: Vec<&dyn Array> = self.sources.iter().map(f).collect();
            let indices: Vec<(usize, usize)> = rows
                .iter()
                .map(|r| {
                    let l = loc(r);
                    (l.src as usize, l.row as usize)
                })
                .collect();
            arrow::compute::interleave(&values, &indices).map_err(|e| {
                Error::fatal(
                    format!("cannot gather the latest view of {}: {e}", self.shape.table),
                    "the text of one column in 8,192 rows of the view exceeds what one Arrow array holds (2 GiB); such rows cannot be compacted: report it with the table's row sizes",
                )
            })
        };
        let columns = (0..self.shape.columns.len())
            .map(|j| take(&|s| s.columns[j].as_ref(), &|r| r.loc(j)))
            .collect::<Result<_>>()?;
        let seqs = take(&|s| &s.seqs, &|r| r.at)?;
        Ok(Source {
            columns,
            seqs: seqs.as_primitive::<arrow::datatypes::Int64Type>().clone(),
            lsns: take(&|s| s.lsns.as_ref(), &|r| r.at)?,
        })
    }

    /// Writes the view as bucket `bucket` of `target`'s generation into
    /// the table's folder, rows ordered by key, in files
    /// `<generation>-<bucket>-<part>` of about `file_bytes` at most; an
    /// empty bucket writes no file unless `always`. No snapshot names them
    /// until the run's commit (see [`crate::lakehouse::delta`]). Returns the files
    /// (key under the prefix, bytes, rows).
    pub async fn write_bucket(
        &self,
        target: &LatestTarget,
        bucket: u32,
        always: bool,
    ) -> Result<Vec<WrittenFile>> {
        let LatestTarget {
            output,
            prefix,
            generation,
            props,
            file_bytes,
        } = target;
        let (prefix, file_bytes) = (prefix.as_deref(), *file_bytes);
        let stem = format!("{generation}-{bucket:04}");
        let schema = latest_schema(&self.shape);
        let dir = table_dir(prefix, "latest", &self.shape);
        let mut rows: Vec<(&CompactString, &Row)> = self.rows.iter().collect();
        rows.sort_unstable_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        let mut written = Vec::new();
        let mut file: Option<ParquetFile> = None;
        for chunk in rows.chunks(BATCH_ROWS) {
            let locs: Vec<&Row> = chunk.iter().map(|(_, r)| *r).collect();
            let Source {
                mut columns,
                seqs,
                lsns,
            } = self.gather(&locs)?;
            if file.as_ref().is_some_and(|f| f.size() >= file_bytes) {
                let f = file.take().expect("checked");
                written.push(WrittenFile::finish(f).await?);
            }
            let f = match &mut file {
                Some(f) => f,
                None => file.insert(ParquetFile::create(
                    output,
                    format!("{dir}/{stem}-{:04}.parquet", written.len()),
                    Arc::clone(&schema),
                    dictionaries_for(props.clone(), &self.shape, &columns, lsns.as_ref()),
                )?),
            };
            columns.push(Arc::new(seqs));
            columns.push(lsns);
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
            written.push(WrittenFile::finish(f).await?);
        }
        Ok(written)
    }
}

/// A Parquet file a run wrote: its key under the prefix, bytes and rows.
#[derive(Debug, Clone)]
pub struct WrittenFile {
    /// Its key in the store.
    pub key: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// The rows it holds.
    pub rows: u64,
}

impl WrittenFile {
    async fn finish(f: ParquetFile) -> Result<WrittenFile> {
        let (key, rows) = (f.key.clone(), f.rows);
        let bytes = f.finish().await?;
        Ok(WrittenFile { key, bytes, rows })
    }
}

/// Where and how a run writes its new latest generation.
#[derive(Clone)]
pub struct LatestTarget {
    /// Where the files go.
    pub output: Output,
    /// The archive's prefix in the store.
    pub prefix: Option<String>,
    /// Unique to the run (`<last seq>.<run id>`): a run never writes over
    /// a file a snapshot names, even one another run is committing.
    pub generation: String,
    /// The properties of every file compact writes (see
    /// [`crate::compact::parquet_file::writer_properties`]).
    pub props: WriterProperties,
    /// A bucket's rows go to files of about this many bytes.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> LatestView {
        LatestView::empty(Arc::new(TableShape::test_t()))
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
        v.get(&format!(r#"{{"id":{id}}}"#))
            .map(|cells| cells[1].clone())
    }

    /// The seq of the version under key `id`.
    fn seq(v: &LatestView, id: i64) -> u64 {
        let at = v.rows[format!(r#"{{"id":{id}}}"#).as_str()].at;
        v.sources[at.src as usize].seqs.value(at.row as usize) as u64
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
        assert_eq!(seq(&v, 2), 3);
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
        assert_eq!(seq(&v, 2), 4);
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
            generation: "1.run".into(),
            props: crate::compact::parquet_file::writer_properties(&Default::default()),
            file_bytes: 1 << 30,
        };
        let written = v.write_bucket(&target, 0, false).await.unwrap();
        assert_eq!(written.len(), 1);
        let path = object_store::path::Path::from(written[0].key.as_str());
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
