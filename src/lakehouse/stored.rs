//! Compacted Parquet files read straight from the archive's store, for
//! the readers that need more control than a DataFusion scan gives: a
//! rewrite that copies a file in wider types (`compact`), and a view
//! rebuilt from the history at a seq (`query --at`), which reads chosen
//! columns of chosen rows in the file's own row order.

use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, StringArray, new_null_array};
use arrow::datatypes::{DataType, SchemaRef};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, TryFutureExt};
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::ArrowReaderOptions;
use parquet::arrow::async_reader::{AsyncFileReader, MetadataSuffixFetch};
use parquet::errors::ParquetError;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};

use crate::error::ErrorKind;
use crate::{Error, Result};

/// Bytes read from a file's end at first: the footer and, for the files
/// compact writes, the whole metadata, so opening a file is one request.
const FOOTER_HINT: usize = 64 * 1024;

/// A Parquet file in the store, read by ranges (parquet's own store reader
/// is deprecated in favour of this). With its size (from the Delta log),
/// the metadata is read from known offsets; without, by a suffix request.
#[derive(Debug, Clone)]
pub(crate) struct StoredFile {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    size: Option<u64>,
}

impl StoredFile {
    /// The file at `key`, of `size` bytes if known.
    pub(crate) fn new(store: Arc<dyn ObjectStore>, key: &str, size: Option<u64>) -> StoredFile {
        StoredFile {
            store,
            path: ObjectPath::from(key),
            size,
        }
    }
}

fn store_error(e: object_store::Error) -> ParquetError {
    ParquetError::External(Box::new(e))
}

impl AsyncFileReader for StoredFile {
    fn get_bytes(
        &mut self,
        range: std::ops::Range<u64>,
    ) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        self.store
            .get_range(&self.path, range)
            .map_err(store_error)
            .boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<std::ops::Range<u64>>,
    ) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        async move {
            self.store
                .get_ranges(&self.path, &ranges)
                .await
                .map_err(store_error)
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        async move {
            let reader = ParquetMetaDataReader::new()
                .with_arrow_reader_options(options)
                .with_prefetch_hint(Some(FOOTER_HINT));
            let metadata = match self.size {
                Some(size) => reader.load_and_finish(self, size).await?,
                None => reader.load_via_suffix_and_finish(self).await?,
            };
            Ok(Arc::new(metadata))
        }
        .boxed()
    }
}

impl MetadataSuffixFetch for &mut StoredFile {
    fn fetch_suffix(&mut self, suffix: usize) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        let options = GetOptions {
            range: Some(GetRange::Suffix(suffix as u64)),
            ..Default::default()
        };
        async move {
            let got = self
                .store
                .get_opts(&self.path, options)
                .await
                .map_err(store_error)?;
            got.bytes().await.map_err(store_error)
        }
        .boxed()
    }
}

/// A text column of a compacted file's batch, as a `StringArray` whatever
/// string type it was read in.
pub(crate) fn text_column(batch: &RecordBatch, name: &str) -> Result<StringArray> {
    let a: &ArrayRef = batch.column_by_name(name).ok_or_else(|| {
        Error::fatal(
            format!("a compacted file has no {name} column"),
            "compact the table again",
        )
        .with_kind(ErrorKind::Archive)
    })?;
    let a = arrow::compute::cast(a, &DataType::Utf8)
        .map_err(|e| Error::fatal(format!("{name}: {e}"), "compact the table again"))?;
    Ok(a.as_any()
        .downcast_ref::<StringArray>()
        .expect("cast to Utf8")
        .clone())
}

/// `batch` in `schema`: each column by name, cast to its type; a column
/// the batch lacks is all nulls.
pub(crate) fn cast(batch: &RecordBatch, schema: &SchemaRef) -> arrow::error::Result<RecordBatch> {
    let columns = schema
        .fields()
        .iter()
        .map(|field| match batch.column_by_name(field.name()) {
            Some(values) if values.data_type() == field.data_type() => Ok(Arc::clone(values)),
            Some(values) => arrow::compute::cast(values, field.data_type()),
            None => Ok(new_null_array(field.data_type(), batch.num_rows())),
        })
        .collect::<arrow::error::Result<Vec<ArrayRef>>>()?;
    RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &arrow::array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
    )
}

#[cfg(test)]
mod tests {
    use arrow::array::{Array, Int32Array, Int64Array};
    use arrow::datatypes::{Field, Schema};

    use super::*;

    #[test]
    fn a_batch_is_cast_by_name_and_a_missing_column_is_null() {
        let old = Arc::new(Schema::new(vec![
            Field::new("_op", DataType::Utf8, false),
            Field::new("n", DataType::Int32, true),
        ]));
        let batch = RecordBatch::try_new(
            old,
            vec![
                Arc::new(StringArray::from(vec!["i", "u"])),
                Arc::new(Int32Array::from(vec![Some(7), None])),
            ],
        )
        .unwrap();
        let new = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, true),
            Field::new("added", DataType::Utf8, true),
            Field::new("_op", DataType::Utf8, false),
        ]));
        let out = cast(&batch, &new).unwrap();
        let n = out.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        assert_eq!((n.value(0), n.is_null(1)), (7, true));
        assert_eq!(out.column(1).null_count(), 2);
        assert_eq!(out.column(2).as_ref(), batch.column(0).as_ref());
    }
}
