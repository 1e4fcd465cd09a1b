//! The history: every change of a table as a typed Parquet row, in files
//! `[prefix/]parquet/<schema>/<table>/date=YYYY-MM-DD/<firstSeq>-<lastSeq>.parquet`
//! (Hive-style, so `date` is a partition column for DuckDB, Athena, Spark,
//! Trino), with the metadata columns `_op`, `_seq`, `_lsn`, `_key`, `_old`
//! and `_unchanged` (the columns an update left unchanged, JSON).
//!
//! Files are streamed to the store (multipart upload, visible only when
//! complete), a row group at a time, so memory holds at most a row group
//! per table being written. Shared here: [`ParquetFile`], the writer the
//! latest view uses too.

use std::borrow::Borrow;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use bytes::Bytes;
use futures::future::BoxFuture;
use object_store::ObjectStore;
use object_store::buffered::BufWriter;
use object_store::path::Path as ObjectPath;
use parquet::arrow::AsyncArrowWriter;
use parquet::arrow::async_writer::AsyncFileWriter;
use parquet::basic::{GzipLevel, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;

use super::Task;
use super::read::TypedChange;
use super::typing::{TableShape, build_array};
use crate::config::{CompactConfig, Compression};
use crate::sink::layout::key_segment;
use crate::{Error, Result};

/// Rows converted to Arrow at a time: small enough to keep the row buffer
/// small, large enough for Arrow's per-batch costs not to matter.
const BATCH_ROWS: usize = 8192;

/// The writer properties of every file compact writes.
pub fn writer_properties(config: &CompactConfig) -> WriterProperties {
    let compression = match config.compression {
        Compression::Zstd => {
            parquet::basic::Compression::ZSTD(ZstdLevel::try_new(3).expect("a valid level"))
        }
        Compression::Snappy => parquet::basic::Compression::SNAPPY,
        Compression::Gzip => parquet::basic::Compression::GZIP(GzipLevel::default()),
        Compression::None => parquet::basic::Compression::UNCOMPRESSED,
    };
    let mut builder = WriterProperties::builder()
        .set_compression(compression)
        .set_max_row_group_row_count(Some(config.row_group_rows));
    // Values that (nearly) never repeat: a dictionary would only be built
    // to be dropped once it outgrows its page (parquet's interner showed as
    // 4% of compact's CPU). The other columns keep parquet's default, `_lsn`
    // too: every change of a transaction has its commit's.
    for unique in ["_seq", "_key", "_old"] {
        builder = builder.set_column_dictionary_enabled(ColumnPath::from(unique), false);
    }
    builder.build()
}

/// `[prefix/]<root>/<schema>/<table>`, names encoded as schema records' are.
pub fn table_dir(prefix: Option<&str>, root: &str, shape: &TableShape) -> String {
    let (schema, table) = shape.schema_and_name();
    super::listing::under(
        prefix,
        &format!("{root}/{}/{}", key_segment(schema), key_segment(table)),
    )
}

/// The history file of `shape` for seqs `first..=last` committed on `date`.
pub fn history_key(
    prefix: Option<&str>,
    shape: &TableShape,
    date: &str,
    first: u64,
    last: u64,
) -> String {
    format!(
        "{}/date={date}/{first}-{last}.parquet",
        table_dir(prefix, "parquet", shape)
    )
}

/// The history's Arrow schema: the data columns, then the metadata.
pub fn history_schema(shape: &TableShape) -> SchemaRef {
    let mut fields: Vec<Field> = shape
        .columns
        .iter()
        .map(|c| Field::new(&c.name, c.kind.data_type(), true))
        .collect();
    fields.extend([
        Field::new("_op", DataType::Utf8, false),
        Field::new("_seq", DataType::Int64, false),
        Field::new("_lsn", DataType::Utf8, false),
        Field::new("_key", DataType::Utf8, true),
        Field::new("_old", DataType::Utf8, true),
        Field::new("_unchanged", DataType::Utf8, true),
    ]);
    Arc::new(Schema::new(fields))
}

/// A Parquet file being streamed to the store.
pub struct ParquetFile {
    pub key: String,
    writer: AsyncArrowWriter<Upload>,
    pub rows: u64,
}

/// Files up to this size are kept in memory and PUT whole.
const SMALL_FILE: usize = 10 << 20;

/// Where a Parquet file's bytes go. Up to [`SMALL_FILE`] they are kept in
/// memory and PUT whole at the end, started again on a transient error for
/// 2 minutes (`listing::put`: object_store gives up on some connection
/// resets during a PUT); a larger file is streamed as a multipart upload,
/// whose parts object_store retries itself.
struct Upload {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    small: Vec<u8>,
    multipart: Option<BufWriter>,
}

impl AsyncFileWriter for Upload {
    fn write(&mut self, bytes: Bytes) -> BoxFuture<'_, parquet::errors::Result<()>> {
        Box::pin(async move {
            if self.multipart.is_none() && self.small.len() + bytes.len() <= SMALL_FILE {
                self.small.extend_from_slice(&bytes);
                return Ok(());
            }
            let (store, path) = (&self.store, &self.path);
            let upload = self
                .multipart
                .get_or_insert_with(|| BufWriter::new(Arc::clone(store), path.clone()));
            if !self.small.is_empty() {
                let small = std::mem::take(&mut self.small);
                AsyncFileWriter::write(upload, small.into()).await?;
            }
            AsyncFileWriter::write(upload, bytes).await
        })
    }

    fn complete(&mut self) -> BoxFuture<'_, parquet::errors::Result<()>> {
        Box::pin(async move {
            match &mut self.multipart {
                Some(upload) => AsyncFileWriter::complete(upload).await,
                None => {
                    let body = Bytes::from(std::mem::take(&mut self.small));
                    super::listing::put(self.store.as_ref(), &self.path, body)
                        .await
                        .map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))
                }
            }
        })
    }
}

impl ParquetFile {
    pub fn create(
        store: &Arc<dyn ObjectStore>,
        key: String,
        schema: SchemaRef,
        props: WriterProperties,
    ) -> Result<ParquetFile> {
        let upload = Upload {
            store: Arc::clone(store),
            path: ObjectPath::from(key.as_str()),
            small: Vec::new(),
            multipart: None,
        };
        let writer = AsyncArrowWriter::try_new(upload, schema, Some(props))
            .map_err(|e| parquet_error(&key, e))?;
        Ok(ParquetFile {
            key,
            writer,
            rows: 0,
        })
    }

    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        self.rows += batch.num_rows() as u64;
        let key = &self.key;
        self.writer
            .write(batch)
            .await
            .map_err(|e| parquet_error(key, e))
    }

    /// Bytes written so far plus those buffered in the open row group.
    pub fn size(&self) -> u64 {
        (self.writer.bytes_written() + self.writer.in_progress_size()) as u64
    }

    /// Completes the file; it becomes visible whole. Returns its size.
    pub async fn finish(mut self) -> Result<u64> {
        self.writer
            .finish()
            .await
            .map_err(|e| parquet_error(&self.key, e))?;
        Ok(self.writer.bytes_written() as u64)
    }
}

pub fn parquet_error(key: &str, e: parquet::errors::ParquetError) -> Error {
    match e {
        parquet::errors::ParquetError::External(inner) => {
            match inner.downcast::<object_store::Error>() {
                Ok(store) => Error::store("PUT", key, *store),
                Err(other) => match other.downcast::<Error>() {
                    Ok(ours) => *ours,
                    Err(other) => Error::fatal(
                        format!("cannot write {key}: {other}"),
                        "check the destination and run `waltail compact` again",
                    ),
                },
            }
        }
        other => Error::fatal(
            format!("cannot write {key}: {other}"),
            "check the destination and run `waltail compact` again",
        ),
    }
}

/// A buffer of changes to write.
type Rows = Vec<Arc<TypedChange>>;

/// One table's history file of a planned group, opened at its first change.
///
/// A full buffer of rows is converted and encoded (Parquet, zstd: a fifth
/// of compact's CPU) on a task of its own while the next buffer fills, so
/// encoding runs beside the parse and the spool; at most one buffer is
/// being encoded, so memory holds two buffers.
pub struct HistoryFile {
    pub shape: Arc<TableShape>,
    schema: SchemaRef,
    /// The file, unless the encoding task has it.
    file: Option<ParquetFile>,
    /// Shared with the spool, which holds the same changes.
    rows: Rows,
    /// The buffer being encoded; gives back the file and the emptied buffer.
    encoding: Option<Task<Result<(ParquetFile, Rows)>>>,
}

impl HistoryFile {
    pub fn create(
        store: &Arc<dyn ObjectStore>,
        key: String,
        shape: Arc<TableShape>,
        props: WriterProperties,
    ) -> Result<HistoryFile> {
        let schema = history_schema(&shape);
        Ok(HistoryFile {
            file: Some(ParquetFile::create(store, key, Arc::clone(&schema), props)?),
            shape,
            schema,
            rows: Vec::with_capacity(BATCH_ROWS),
            encoding: None,
        })
    }

    pub async fn push(&mut self, change: Arc<TypedChange>) -> Result<()> {
        self.rows.push(change);
        if self.rows.len() >= BATCH_ROWS {
            self.flush().await?;
        }
        Ok(())
    }

    /// Hands the buffered rows to an encoding task, once the previous one
    /// is done.
    async fn flush(&mut self) -> Result<()> {
        if self.rows.is_empty() {
            return Ok(());
        }
        let (mut file, spare) = self.settle().await?;
        let rows = std::mem::replace(&mut self.rows, spare);
        let (shape, schema) = (Arc::clone(&self.shape), Arc::clone(&self.schema));
        self.encoding = Some(Task::spawn(async move {
            let columns = history_columns(&shape, &rows);
            let batch = RecordBatch::try_new(schema, columns)
                .map_err(|e| Error::bug(format!("cannot build a batch of {}: {e}", file.key)))?;
            file.write(&batch).await?;
            let mut rows = rows;
            rows.clear();
            Ok((file, rows))
        }));
        Ok(())
    }

    /// Waits for the encoding task, if any: the file and an empty buffer.
    async fn settle(&mut self) -> Result<(ParquetFile, Rows)> {
        match (self.encoding.take(), self.file.take()) {
            (Some(task), _) => task.join("the history encoder").await?,
            (None, Some(file)) => Ok((file, Vec::with_capacity(BATCH_ROWS))),
            (None, None) => Err(Error::bug(format!(
                "the history file of {} was used after it failed",
                self.shape.table
            ))),
        }
    }

    /// Writes what is buffered and completes the file: (key, rows, bytes).
    pub async fn finish(mut self) -> Result<(String, u64, u64)> {
        self.flush().await?;
        let (file, _) = self.settle().await?;
        let key = file.key.clone();
        let rows = file.rows;
        let bytes = file.finish().await?;
        Ok((key, rows, bytes))
    }
}
/// The history's columns (data, then `_op`, `_seq`, `_lsn`, `_key`, `_old`,
/// `_unchanged`) of typed changes, as [`history_schema`] lays them out
/// (compaction writes them; `query` reads its NDJSON tail into them).
pub fn history_columns<R: Borrow<TypedChange>>(shape: &TableShape, rows: &[R]) -> Vec<ArrayRef> {
    let rows: Vec<&TypedChange> = rows.iter().map(Borrow::borrow).collect();
    let mut columns: Vec<ArrayRef> = shape
        .columns
        .iter()
        .enumerate()
        .map(|(i, c)| build_array(c.kind, rows.iter().map(|r| &r.cells[i])))
        .collect();
    let text = |f: &dyn Fn(&TypedChange) -> Option<&str>| -> ArrayRef {
        Arc::new(rows.iter().map(|r| f(r)).collect::<StringArray>())
    };
    columns.push(text(&|r| Some(r.op_name.as_str())));
    columns.push(Arc::new(
        rows.iter().map(|r| r.seq as i64).collect::<Int64Array>(),
    ));
    columns.push(text(&|r| Some(r.lsn.as_str())));
    columns.push(text(&|r| r.key.as_deref()));
    columns.push(text(&|r| r.old.as_deref()));
    columns.push(text(&|r| r.unchanged.as_deref()));
    columns
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compact::read::ChangeOp;
    use crate::compact::typing::Cell;
    use arrow::array::AsArray;
    use arrow::datatypes::Int64Type;
    use object_store::ObjectStoreExt;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    #[tokio::test]
    async fn a_file_of_several_buffers_holds_every_change_once_in_order() {
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let shape = Arc::new(TableShape::test_t());
        let props = writer_properties(&crate::config::CompactConfig::default());
        let mut file = HistoryFile::create(&store, "h.parquet".into(), shape, props).unwrap();
        // Past two full buffers: the second waits for the first's encoder.
        let n = 2 * BATCH_ROWS as u64 + 1;
        for seq in 1..=n {
            let change = TypedChange {
                op_name: "insert".into(),
                op: ChangeOp::Upsert,
                seq,
                lsn: format!("0/{seq:X}"),
                key: Some(format!(r#"{{"id":{seq}}}"#)),
                old_key: None,
                cells: vec![
                    Cell::Int(seq as i64),
                    Cell::Str(format!("doc {seq}").into()),
                ],
                old: None,
                unchanged: None,
            };
            file.push(Arc::new(change)).await.unwrap();
        }
        let (key, rows, _) = file.finish().await.unwrap();
        assert_eq!(rows, n);
        let bytes = store
            .get(&ObjectPath::from(key.as_str()))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        let mut seqs = Vec::new();
        for batch in ParquetRecordBatchReaderBuilder::try_new(bytes)
            .unwrap()
            .build()
            .unwrap()
        {
            let batch = batch.unwrap();
            let column = batch.column_by_name("_seq").unwrap();
            seqs.extend(column.as_primitive::<Int64Type>().values().iter().copied());
        }
        assert_eq!(seqs, (1..=n as i64).collect::<Vec<_>>());
    }
}
