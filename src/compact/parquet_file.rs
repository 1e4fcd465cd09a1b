//! A Parquet file streamed to the store as it is written: a multipart
//! upload (visible only when complete) of 10 MiB parts, each tried again
//! alone, so memory holds at most a row group and a few parts per file
//! (see `Upload`). The history and the latest view write their files
//! with it, with the writer properties of every file compact writes.

use std::collections::VecDeque;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use object_store::buffered::BufWriter;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjectPath;
use object_store::{MultipartId, ObjectStore, ObjectStoreExt, PutPayload};
use parquet::arrow::AsyncArrowWriter;
use parquet::arrow::async_writer::AsyncFileWriter;
use parquet::basic::{Encoding, GzipLevel, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;

use super::task::Task;
use crate::config::{CompactConfig, Compression};
use crate::{Error, Result};

/// zstd's level without `compact.compression_level`: zstd's own default,
/// and DuckDB's.
const ZSTD_LEVEL: i32 = 3;

/// The writer properties of every file compact writes.
pub fn writer_properties(config: &CompactConfig) -> WriterProperties {
    // The level was checked against each codec's range with the config.
    let level = config.compression_level;
    let compression = match config.compression {
        Compression::Zstd => parquet::basic::Compression::ZSTD(
            ZstdLevel::try_new(level.map_or(ZSTD_LEVEL, |l| l as i32)).expect("a checked level"),
        ),
        Compression::Snappy => parquet::basic::Compression::SNAPPY,
        Compression::Gzip => {
            parquet::basic::Compression::GZIP(level.map_or_else(GzipLevel::default, |l| {
                GzipLevel::try_new(l).expect("a checked level")
            }))
        }
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
    // Seqs ascend by one within a file: delta encoding stores them in a few
    // bits each instead of 8 bytes for zstd to compress (with the data
    // columns below, 25% less history and 7% less CPU on the benchmark).
    builder = builder.set_column_encoding(ColumnPath::from("_seq"), Encoding::DELTA_BINARY_PACKED);
    builder.build()
}

/// Where compact's Parquet files go: the store and, for S3, its multipart
/// interface (see [`crate::sink::Sink::multipart`]), through which a large
/// file's parts are sent, and tried again, one by one.
#[derive(Clone)]
pub struct Output {
    /// The store the files go to.
    pub store: Arc<dyn ObjectStore>,
    /// The store's multipart interface, when it has one.
    pub parts: Option<Arc<dyn MultipartStore>>,
}

/// A Parquet file being streamed to the store.
pub struct ParquetFile {
    /// Its key in the store.
    pub key: String,
    writer: AsyncArrowWriter<Upload>,
    /// The rows written so far.
    pub rows: u64,
}

/// Files up to this size are kept in memory and PUT whole; larger ones
/// go in parts of this size (S3 wants at least 5 MiB per part but the
/// last, and R2 parts of one size).
pub(crate) const PART_BYTES: usize = 10 << 20;

/// Parts of one file being sent at once (each holds its 10 MiB).
const PARTS_IN_FLIGHT: usize = 3;

/// Where a Parquet file's bytes go. Up to [`PART_BYTES`] they are kept in
/// memory and PUT whole at the end, started again on a transient error for
/// 2 minutes (`listing::put`: object_store gives up on some connection
/// resets during a PUT). A larger file goes to S3 as a multipart upload:
/// each part is sent once full, [`PARTS_IN_FLIGHT`] at a time, and started
/// again alone the same way (a part is stored by its number, so sending it
/// twice is harmless), then the upload is completed with the same retry.
/// To the local folder, a large file goes through object_store's buffered
/// writer (a disk's errors are not retried). An upload that fails, or is
/// dropped unfinished (the run failed elsewhere), is aborted, best effort.
struct Upload {
    output: Output,
    path: ObjectPath,
    buffer: BytesMut,
    /// S3: the upload under way.
    multipart: Option<Multipart>,
    /// The local folder: the buffered writer, once the file is large.
    streamed: Option<BufWriter>,
    /// A failed upload takes no more bytes (it would be a truncated file).
    failed: bool,
}

struct Multipart {
    store: Arc<dyn MultipartStore>,
    id: MultipartId,
    /// Parts sent, in order.
    done: Vec<PartId>,
    /// Parts being sent, in order.
    sending: VecDeque<Task<Result<PartId>>>,
    /// Bytes in the parts so far.
    bytes: usize,
    completed: bool,
}

impl Upload {
    /// Sends the first [`PART_BYTES`] of the buffer (or all of it, for the
    /// last part) as the next part, starting the upload first if needed.
    async fn send_part(&mut self, store: &Arc<dyn MultipartStore>) -> Result<()> {
        let path = &self.path;
        let upload = match &mut self.multipart {
            Some(upload) => upload,
            None => {
                // Should a response be lost, a retry starts a second upload
                // and the first is never completed: a bucket lifecycle rule
                // on incomplete uploads removes it (see docs/compaction.md).
                let id = crate::archive::listing::retrying(|| async {
                    store
                        .create_multipart(path)
                        .await
                        .map_err(|e| Error::store("start the upload of", path.to_string(), e))
                })
                .await?;
                self.multipart.insert(Multipart {
                    store: Arc::clone(store),
                    id,
                    done: Vec::new(),
                    sending: VecDeque::new(),
                    bytes: 0,
                    completed: false,
                })
            }
        };
        if upload.sending.len() >= PARTS_IN_FLIGHT {
            let oldest = upload.sending.pop_front().expect("parts in flight");
            upload.done.push(oldest.join("a part upload").await??);
        }
        let take = PART_BYTES.min(self.buffer.len());
        let part = PutPayload::from(self.buffer.split_to(take).freeze());
        upload.bytes += take;
        let index = upload.done.len() + upload.sending.len();
        let (store, path, id) = (Arc::clone(store), path.clone(), upload.id.clone());
        upload.sending.push_back(Task::spawn(async move {
            crate::archive::listing::retrying(|| async {
                store
                    .put_part(&path, &id, index, part.clone())
                    .await
                    .map_err(|e| Error::store("PUT a part of", path.to_string(), e))
            })
            .await
        }));
        Ok(())
    }

    async fn write_bytes(&mut self, bytes: Bytes) -> Result<()> {
        if self.failed {
            return Err(Error::bug(format!(
                "{} was written after it failed",
                self.path
            )));
        }
        if let Some(streamed) = &mut self.streamed {
            return AsyncFileWriter::write(streamed, bytes)
                .await
                .map_err(|e| parquet_error(self.path.as_ref(), e));
        }
        self.buffer.extend_from_slice(&bytes);
        if self.buffer.len() <= PART_BYTES {
            return Ok(());
        }
        match self.output.parts.clone() {
            Some(store) => {
                while self.buffer.len() >= PART_BYTES {
                    self.send_part(&store).await?;
                }
                Ok(())
            }
            None => {
                let mut streamed =
                    BufWriter::new(Arc::clone(&self.output.store), self.path.clone());
                let buffered = std::mem::take(&mut self.buffer).freeze();
                let written = AsyncFileWriter::write(&mut streamed, buffered).await;
                self.streamed = Some(streamed);
                written.map_err(|e| parquet_error(self.path.as_ref(), e))
            }
        }
    }

    async fn complete_upload(&mut self) -> Result<()> {
        if self.failed {
            return Err(Error::bug(format!(
                "{} was completed after it failed",
                self.path
            )));
        }
        if let Some(streamed) = &mut self.streamed {
            return AsyncFileWriter::complete(streamed)
                .await
                .map_err(|e| parquet_error(self.path.as_ref(), e));
        }
        let store = match (&self.multipart, &self.output.parts) {
            (Some(_), Some(store)) => Arc::clone(store),
            _ => {
                let body = std::mem::take(&mut self.buffer).freeze();
                return crate::archive::listing::put(self.output.store.as_ref(), &self.path, body)
                    .await;
            }
        };
        if !self.buffer.is_empty() {
            self.send_part(&store).await?;
        }
        let upload = self.multipart.as_mut().expect("a part was sent");
        while let Some(part) = upload.sending.pop_front() {
            upload.done.push(part.join("a part upload").await??);
        }
        let (path, store) = (&self.path, &store);
        let (id, parts) = (&upload.id, &upload.done);
        let mut tries = 0;
        let completed = crate::archive::listing::retrying(|| {
            tries += 1;
            async move {
                store
                    .complete_multipart(path, id, parts.clone())
                    .await
                    .map(drop)
                    .map_err(|e| Error::store("complete the upload of", path.to_string(), e))
            }
        })
        .await;
        let completed = match completed {
            // A completion whose response was lost is done: S3 answers
            // its retry "no such upload". The file is there, whole.
            Err(e)
                if tries > 1
                    && matches!(&e, Error::Store { cause, .. } if matches!(**cause, object_store::Error::NotFound { .. })) =>
            {
                match self.output.store.head(path).await {
                    Ok(meta) if meta.size == upload.bytes as u64 => Ok(()),
                    _ => Err(e),
                }
            }
            other => other,
        };
        upload.completed = completed.is_ok();
        completed
    }

    /// After a failure: the upload and its parts are deleted (best effort:
    /// an upload left behind is invisible to readers, and a bucket
    /// lifecycle rule on incomplete uploads removes it).
    async fn abort(&mut self) {
        self.failed = true;
        if let Some(upload) = self.multipart.take() {
            upload.abort(&self.path).await;
        }
    }
}

impl Multipart {
    async fn abort(mut self, path: &ObjectPath) {
        if self.completed {
            return;
        }
        self.completed = true;
        // Parts still being sent stop first (dropping a Task aborts it).
        self.sending.clear();
        let aborted = crate::archive::listing::retrying(|| async {
            match self.store.abort_multipart(path, &self.id).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(Error::store("abort the upload of", path.to_string(), e)),
            }
        })
        .await;
        if let Err(e) = aborted {
            tracing::warn!(file = %path, error = %crate::error::Report(&e), "cannot abort an unfinished upload");
        }
    }
}

impl Drop for Upload {
    /// An upload dropped unfinished (the run failed elsewhere, or was
    /// stopped) is aborted on a task of its own, if the runtime still runs.
    fn drop(&mut self) {
        if let Some(upload) = self.multipart.take()
            && !upload.completed
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let path = self.path.clone();
            runtime.spawn(async move { upload.abort(&path).await });
        }
    }
}

impl AsyncFileWriter for Upload {
    fn write(&mut self, bytes: Bytes) -> BoxFuture<'_, parquet::errors::Result<()>> {
        Box::pin(async move {
            let written = self.write_bytes(bytes).await;
            if written.is_err() {
                self.abort().await;
            }
            written.map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))
        })
    }

    fn complete(&mut self) -> BoxFuture<'_, parquet::errors::Result<()>> {
        Box::pin(async move {
            let completed = self.complete_upload().await;
            if completed.is_err() {
                self.abort().await;
            }
            completed.map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))
        })
    }
}

impl ParquetFile {
    /// Starts the file `key` of `schema` on `output`; nothing is visible
    /// in the store before [`ParquetFile::finish`].
    pub fn create(
        output: &Output,
        key: String,
        schema: SchemaRef,
        props: WriterProperties,
    ) -> Result<ParquetFile> {
        let upload = Upload {
            output: output.clone(),
            path: ObjectPath::from(key.as_str()),
            buffer: BytesMut::new(),
            multipart: None,
            streamed: None,
            failed: false,
        };
        let writer = AsyncArrowWriter::try_new(upload, schema, Some(props))
            .map_err(|e| parquet_error(&key, e))?;
        Ok(ParquetFile {
            key,
            writer,
            rows: 0,
        })
    }

    /// Writes `batch` (a row group is uploaded once it is full).
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

/// Our error for a Parquet writer's: the store's error when the upload
/// failed (so it is retried or reported as the store's), else one that
/// names the file.
pub fn parquet_error(key: &str, e: parquet::errors::ParquetError) -> Error {
    match e {
        parquet::errors::ParquetError::External(inner) => {
            match inner.downcast::<object_store::Error>() {
                Ok(store) => Error::store("PUT", key, *store),
                Err(other) => match other.downcast::<Error>() {
                    Ok(ours) => *ours,
                    // The async writer wraps our writer's error once more.
                    Err(other) => match other.downcast::<parquet::errors::ParquetError>() {
                        Ok(nested) => parquet_error(key, *nested),
                        Err(other) => Error::fatal(
                            format!("cannot write {key}: {other}"),
                            "check the destination and run `waltail compact` again",
                        ),
                    },
                },
            }
        }
        other => Error::fatal(
            format!("cannot write {key}: {other}"),
            "check the destination and run `waltail compact` again",
        ),
    }
}

#[cfg(test)]
mod tests {
    use parquet::basic::{GzipLevel, ZstdLevel};
    use parquet::schema::types::ColumnPath;

    use super::*;
    use crate::config::Compression;

    /// The configured level reaches the codec; without one, zstd's is 3.
    #[test]
    fn the_compression_level_is_the_configured_one() {
        use parquet::basic::Compression as Codec;

        use crate::config::CompactConfig;
        let codec =
            |config: CompactConfig| writer_properties(&config).compression(&ColumnPath::from("id"));
        let zstd = |l| Codec::ZSTD(ZstdLevel::try_new(l).unwrap());
        assert_eq!(codec(CompactConfig::default()), zstd(3));
        let level = |l| CompactConfig {
            compression_level: Some(l),
            ..CompactConfig::default()
        };
        assert_eq!(codec(level(1)), zstd(1));
        assert_eq!(codec(level(19)), zstd(19));
        let gzip = CompactConfig {
            compression: Compression::Gzip,
            ..level(9)
        };
        assert_eq!(codec(gzip), Codec::GZIP(GzipLevel::try_new(9).unwrap()));
    }
}
