//! The footers of the Parquet files a statement scans, read while the
//! statement is planned.
//!
//! Planning a scan reads every file's footer and page index, for the
//! statistics that prune and size the plan, one file after another on the
//! thread that plans; the runtime's workers have nothing to do until the
//! plan runs. A table is built when a statement first names it, at the
//! start of planning (see [`super::providers`]), so its files are known
//! then: [`warm`] reads their footers on a worker, in the order the
//! planner reads them, into the session's cache of file metadata, where
//! the planner (and later the scan) finds them. The planner waits for
//! nothing: a footer it reaches first it reads itself, as it always did,
//! and its errors are the planner's to report, so a read that fails here
//! is dropped.
//!
//! From a local folder only, where a footer's read is a `pread` from the
//! page cache (see [`super::reads`]) and what the planner waits for is
//! the decoding. On an object store the planner already fetches footers
//! many at a time, each a round trip; read ahead as well, every footer the
//! planner reached while its read ahead was in flight would be fetched
//! twice.
//!
//! Measured on the archives of `scripts/bench-query.sh` (whole processes,
//! 9-11 alternated runs, fastest): at SCALE 0.2 the latest view joined to
//! the history 24.6 -> 20.7 ms, the count of the latest view 8.8 -> 7.7 ms,
//! the range filter 12.8 -> 9.7 ms; at SCALE 1 the join 52.5 -> 45.5 ms,
//! the top-k 14.0 -> 11.4 ms.

use std::sync::Arc;

use datafusion::datasource::listing::ListingTableUrl;
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnv;
use object_store::ObjectStoreExt;
use object_store::path::Path;

use crate::lakehouse::session::{ARCHIVE_URL, table_url};

/// How many bytes from a Parquet file's end the first read of its footer
/// takes. DataFusion's default is 512 KiB, one read for nearly any file on
/// an object store, where a second round trip costs more than the bytes.
/// Our files' footers are far smaller (2 KiB for a latest-view file, 11 KiB
/// for a 5 MB history file, at the benchmark's sizes), so each file read
/// 512 KiB it did not use: copied, and into memory faulted in for it.
/// 64 KiB still takes footer and page index in one read. Measured on the
/// archive of `scripts/bench-query.sh` at SCALE 1 (`SELECT count(*),
/// sum(amount)` over the latest view's 16 files, whole processes, 41
/// alternated runs): median 19.5 ms at 512 KiB, 17.4 ms at 64 KiB.
pub(crate) const FOOTER_READ: usize = 64 * 1024;

/// Reads the footers of the files at `keys` (keys in the archive's store)
/// into `runtime`'s cache of file metadata, on a worker of the current
/// runtime, one after another; returns at once. The handle is for tests:
/// nothing in a query waits for it. Without a runtime, or without the
/// archive's store in `runtime`, it reads nothing.
pub(crate) fn warm(
    runtime: &Arc<RuntimeEnv>,
    keys: &[String],
) -> Option<tokio::task::JoinHandle<()>> {
    if keys.is_empty() {
        return None;
    }
    let handle = tokio::runtime::Handle::try_current().ok()?;
    let url = ObjectStoreUrl::parse(ARCHIVE_URL).ok()?;
    let store = runtime.object_store(url).ok()?;
    let cache = runtime.cache_manager.get_file_metadata_cache();
    // The paths as the planner's listing has them: parsed from the same URL.
    let paths: Vec<Path> = keys
        .iter()
        .filter_map(|k| ListingTableUrl::parse(table_url(k)).ok())
        .map(|u| u.prefix().clone())
        .collect();
    Some(handle.spawn(async move {
        for path in paths {
            let Ok(meta) = store.head(&path).await else {
                continue;
            };
            // As DataFusion's Parquet format reads it when planning, so the
            // cached entry (footer and page index) is the one it asks for.
            let _ = DFParquetMetadata::new(store.as_ref(), &meta)
                .with_metadata_size_hint(Some(FOOTER_READ))
                .with_file_metadata_cache(Some(Arc::clone(&cache)))
                .fetch_metadata()
                .await;
        }
    }))
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, RecordBatch};
    use datafusion::datasource::file_format::parquet::ParquetFormat;
    use datafusion::datasource::listing::{ListingOptions, ListingTable, ListingTableConfig};
    use datafusion::prelude::SessionContext;

    use super::super::reads::ReadStore;
    use super::*;

    /// A Parquet file of three rows at `key` in `dir`; its size.
    fn three_rows(dir: &std::path::Path, key: &str) -> u64 {
        let path = dir.join(key);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let batch =
            RecordBatch::try_from_iter([("id", Arc::new(Int64Array::from(vec![1, 2, 3])) as _)])
                .unwrap();
        let file = std::fs::File::create(&path).unwrap();
        let mut writer = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        std::fs::metadata(&path).unwrap().len()
    }

    /// `SELECT count(*)` over the file at `key`, planned as the archive's
    /// tables are: DataFusion answers it from the footer's row count.
    async fn count(ctx: &SessionContext, key: &str) -> datafusion::error::Result<usize> {
        let options = ListingOptions::new(Arc::new(
            ParquetFormat::default().with_metadata_size_hint(Some(FOOTER_READ)),
        ));
        let config = ListingTableConfig::new(ListingTableUrl::parse(table_url(key))?)
            .with_listing_options(options)
            .infer_schema(&ctx.state())
            .await;
        // Without the footer the schema cannot be read either.
        let table = ListingTable::try_new(config?)?;
        ctx.read_table(Arc::new(table))?.count().await
    }

    #[tokio::test]
    async fn the_planner_finds_the_footers_read_ahead_in_the_sessions_cache() {
        let dir = tempfile::tempdir().unwrap();
        let (warmed, cold) = ("latest/public/t/a.parquet", "latest/public/t/b.parquet");
        let store = ReadStore::folder(dir.path()).unwrap();
        for key in [warmed, cold] {
            let size = three_rows(dir.path(), key);
            store.know([(&key.to_string(), &size)]);
        }
        let ctx = SessionContext::new();
        let url = ObjectStoreUrl::parse(ARCHIVE_URL).unwrap();
        ctx.register_object_store(url.as_ref(), Arc::new(store));
        let runtime = ctx.runtime_env();
        let keys = [warmed.to_string(), "latest/public/t/gone.parquet".into()];
        warm(&runtime, &keys).unwrap().await.unwrap();
        let cache = runtime.cache_manager.get_file_metadata_cache();
        assert!(cache.contains_key(&Path::from(warmed)));
        // A file that is not there is left out, without an error.
        assert_eq!(cache.len(), 1);

        // Both files' bytes overwritten, sizes kept: only the footer read
        // ahead can answer.
        for key in [warmed, cold] {
            let path = dir.path().join(key);
            let size = std::fs::metadata(&path).unwrap().len();
            std::fs::write(&path, vec![0u8; size as usize]).unwrap();
        }
        assert_eq!(count(&ctx, warmed).await.unwrap(), 3);
        assert!(count(&ctx, cold).await.is_err());
    }

    #[tokio::test]
    async fn nothing_is_read_without_files_or_the_archives_store() {
        let ctx = SessionContext::new();
        assert!(warm(&ctx.runtime_env(), &[]).is_none());
        assert!(warm(&ctx.runtime_env(), &["latest/x.parquet".into()]).is_none());
    }
}
