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

use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use object_store::ObjectStore;
use object_store::buffered::BufWriter;
use object_store::path::Path as ObjectPath;
use parquet::arrow::AsyncArrowWriter;
use parquet::basic::{GzipLevel, ZstdLevel};
use parquet::file::properties::WriterProperties;

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
    WriterProperties::builder()
        .set_compression(compression)
        .set_max_row_group_row_count(Some(config.row_group_rows))
        .build()
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
    writer: AsyncArrowWriter<BufWriter>,
    pub rows: u64,
}

impl ParquetFile {
    pub fn create(
        store: &Arc<dyn ObjectStore>,
        key: String,
        schema: SchemaRef,
        props: WriterProperties,
    ) -> Result<ParquetFile> {
        let path = ObjectPath::from(key.as_str());
        let writer =
            AsyncArrowWriter::try_new(BufWriter::new(Arc::clone(store), path), schema, Some(props))
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
                Err(other) => Error::fatal(
                    format!("cannot write {key}: {other}"),
                    "check the destination and run `waltail compact` again",
                ),
            }
        }
        other => Error::fatal(
            format!("cannot write {key}: {other}"),
            "check the destination and run `waltail compact` again",
        ),
    }
}

/// One table's history file of a planned group, opened at its first change.
pub struct HistoryFile {
    pub shape: Arc<TableShape>,
    schema: SchemaRef,
    file: ParquetFile,
    rows: Vec<TypedChange>,
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
            file: ParquetFile::create(store, key, Arc::clone(&schema), props)?,
            shape,
            schema,
            rows: Vec::with_capacity(BATCH_ROWS),
        })
    }

    pub async fn push(&mut self, change: TypedChange) -> Result<()> {
        self.rows.push(change);
        if self.rows.len() >= BATCH_ROWS {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<()> {
        if self.rows.is_empty() {
            return Ok(());
        }
        let rows = std::mem::take(&mut self.rows);
        let columns = history_columns(&self.shape, &rows);
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), columns).map_err(|e| {
            Error::fatal(
                format!("cannot build a batch of {}: {e}", self.file.key),
                "this is a bug in waltail; please report it",
            )
        })?;
        self.rows = rows;
        self.rows.clear();
        self.file.write(&batch).await
    }

    /// Writes what is buffered and completes the file: (key, rows, bytes).
    pub async fn finish(mut self) -> Result<(String, u64, u64)> {
        self.flush().await?;
        let key = self.file.key.clone();
        let rows = self.file.rows;
        let bytes = self.file.finish().await?;
        Ok((key, rows, bytes))
    }
}
/// The history's columns (data, then `_op`, `_seq`, `_lsn`, `_key`, `_old`,
/// `_unchanged`) of typed changes, as [`history_schema`] lays them out
/// (compaction writes them; `query` reads its NDJSON tail into them).
pub fn history_columns(shape: &TableShape, rows: &[TypedChange]) -> Vec<ArrayRef> {
    let mut columns: Vec<ArrayRef> = shape
        .columns
        .iter()
        .enumerate()
        .map(|(i, c)| build_array(c.kind, rows.iter().map(|r| &r.cells[i])))
        .collect();
    let text = |f: &dyn Fn(&TypedChange) -> Option<&str>| -> ArrayRef {
        Arc::new(rows.iter().map(f).collect::<StringArray>())
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
