//! The store a query reads the archive through: the destination's, with
//! two changes to its reads.
//!
//! **A compacted file's metadata from the Delta log.** DataFusion asks the
//! store for the metadata (a HEAD) of every file a table names, before it
//! reads the file's footer. The snapshot's Delta logs already record each
//! file's size, and a compacted file is never rewritten under its name, so
//! the metadata of the files the snapshot names is answered from those
//! sizes (see [`ReadStore::know`]): on S3, a request less per file and
//! query. The time given is the Unix epoch: DataFusion compares it only with
//! what the same query, or the prompt's next statement, was given before.
//!
//! **A local folder's reads in place.** object_store's `LocalFileSystem`
//! hands every read to tokio's pool of blocking threads: a range read is
//! two hand-offs (the open and the stat, then the read), a file's metadata
//! one, and each opens the file anew: a thread woken and a worker waiting
//! for it, for reads the page cache answers in microseconds. A count over
//! the latest view's 17 files made 124 `futex` calls, 54 with the reads
//! done in place (`strace -f -c`; 17 metadata reads, 34 range reads). In a
//! folder a read of up to [`INLINE`] bytes is done in place: open, stat,
//! `pread`. Anything else (a larger read, a read the file cannot satisfy,
//! a listing, a write) goes to the folder's store as before, so its errors
//! and answers are the store's own. A read the page cache does not hold
//! blocks the worker that asked for it for as long as the disk takes; in
//! a query that worker's scan is waiting for those bytes anyway, and reads
//! larger than [`INLINE`] (where another scan's decoding would overlap a
//! long read) still go to the pool.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

/// The largest read done in place: larger ones go to the blocking pool.
const INLINE: u64 = 4 * 1024 * 1024;

/// The store a query reads through (see the module doc).
#[derive(Debug)]
pub(crate) struct ReadStore {
    inner: Arc<dyn ObjectStore>,
    /// The archive's local folder, when it is one: its small reads are
    /// done in place.
    folder: Option<Arc<LocalFileSystem>>,
    /// The size of each compacted file a snapshot named.
    sizes: RwLock<HashMap<Path, u64>>,
}

impl ReadStore {
    /// Reads through `inner` (an S3 store).
    pub(crate) fn new(inner: Arc<dyn ObjectStore>) -> ReadStore {
        ReadStore {
            inner,
            folder: None,
            sizes: RwLock::default(),
        }
    }

    /// Reads the folder `root`, as [`LocalFileSystem::new_with_prefix`].
    pub(crate) fn folder(root: &std::path::Path) -> object_store::Result<ReadStore> {
        let folder = Arc::new(LocalFileSystem::new_with_prefix(root)?);
        Ok(ReadStore {
            inner: Arc::clone(&folder) as Arc<dyn ObjectStore>,
            folder: Some(folder),
            sizes: RwLock::default(),
        })
    }

    /// Takes the sizes of compacted files (keys in the store) as their
    /// metadata from now on. A key keeps its size: files are never
    /// rewritten under their names.
    pub(crate) fn know<'a>(&self, sizes: impl IntoIterator<Item = (&'a String, &'a u64)>) {
        let mut known = self.sizes.write().unwrap_or_else(|e| e.into_inner());
        for (key, size) in sizes {
            known.entry(Path::from(key.as_str())).or_insert(*size);
        }
    }

    /// Whether the archive is a local folder, whose small reads are done
    /// in place.
    pub(crate) fn in_place(&self) -> bool {
        self.folder.is_some()
    }

    /// `location`'s metadata from the sizes known, if it is one of them.
    fn known(&self, location: &Path) -> Option<ObjectMeta> {
        let known = self.sizes.read().unwrap_or_else(|e| e.into_inner());
        known.get(location).map(|&size| ObjectMeta {
            location: location.clone(),
            last_modified: chrono::DateTime::UNIX_EPOCH,
            size,
            e_tag: None,
            version: None,
        })
    }

    /// `location`'s file, open, and its metadata as the folder's store
    /// gives it; `None` where the store should answer (no such file, a
    /// folder, any error).
    fn open(&self, location: &Path) -> Option<(File, ObjectMeta)> {
        let path: PathBuf = self.folder.as_ref()?.path_to_filesystem(location).ok()?;
        let file = File::open(&path).ok()?;
        let metadata = file.metadata().ok()?;
        if metadata.is_dir() {
            return None;
        }
        let modified = metadata.modified().ok()?;
        let size = metadata.len();
        let mtime = modified
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros();
        let inode = std::os::unix::fs::MetadataExt::ino(&metadata);
        let meta = ObjectMeta {
            location: location.clone(),
            last_modified: modified.into(),
            size,
            // The store's own scheme, so either's answer matches the other's.
            e_tag: Some(format!("{inode:x}-{mtime:x}-{size:x}")),
            version: None,
        };
        Some((file, meta))
    }
}

/// `range` of `file`, read whole; `None` if the file ends before it.
fn read(file: &File, range: &Range<u64>) -> Option<Bytes> {
    let mut buf = vec![0; usize::try_from(range.end - range.start).ok()?];
    file.read_exact_at(&mut buf, range.start).ok()?;
    Some(Bytes::from(buf))
}

impl std::fmt::Display for ReadStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for ReadStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        if options.head
            && options.if_match.is_none()
            && options.if_none_match.is_none()
            && options.if_modified_since.is_none()
            && options.if_unmodified_since.is_none()
            && let Some(meta) = self.known(location)
        {
            return Ok(GetResult {
                payload: GetResultPayload::Stream(futures::stream::empty().boxed()),
                range: 0..meta.size,
                meta,
                attributes: Default::default(),
            });
        }
        let in_place = || {
            let (file, meta) = self.open(location)?;
            options.check_preconditions(&meta).ok()?;
            let range = match &options.range {
                Some(r) => r.as_range(meta.size).ok()?,
                None => 0..meta.size,
            };
            let body = if options.head {
                Bytes::new()
            } else if range.end - range.start <= INLINE {
                read(&file, &range)?
            } else {
                return None;
            };
            Some(GetResult {
                payload: GetResultPayload::Stream(
                    futures::stream::once(async move { Ok(body) }).boxed(),
                ),
                meta,
                range,
                attributes: Default::default(),
            })
        };
        match in_place() {
            Some(got) => Ok(got),
            None => self.inner.get_opts(location, options).await,
        }
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        let total: u64 = ranges.iter().map(|r| r.end.saturating_sub(r.start)).sum();
        let in_place = || {
            if total > INLINE || ranges.iter().any(|r| r.start > r.end) {
                return None;
            }
            let (file, _) = self.open(location)?;
            ranges.iter().map(|r| read(&file, r)).collect()
        };
        match in_place() {
            Some(got) => Ok(got),
            None => self.inner.get_ranges(location, ranges).await,
        }
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use object_store::{GetRange, ObjectStoreExt};

    use super::*;

    /// Every read answers as the folder's own store does: whole objects,
    /// ranges, suffixes, several ranges, metadata, a read past the end, a
    /// missing object, a folder, a failed precondition, and a read larger
    /// than the in-place limit.
    #[tokio::test]
    async fn reads_answer_as_the_folders_store_does() {
        let dir = tempfile::tempdir().unwrap();
        let plain = LocalFileSystem::new_with_prefix(dir.path()).unwrap();
        let inline = ReadStore::folder(dir.path()).unwrap();
        let small = Path::from("a/small.bin");
        let large = Path::from("a/large.bin");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        plain.put(&small, data.clone().into()).await.unwrap();
        let big: Vec<u8> = (0..INLINE + 10).map(|i| (i % 253) as u8).collect();
        plain.put(&large, big.into()).await.unwrap();

        for location in [&small, &large] {
            let (a, b) = (
                plain.get(location).await.unwrap(),
                inline.get(location).await.unwrap(),
            );
            assert_eq!(a.meta, b.meta);
            assert_eq!(a.range, b.range);
            assert_eq!(a.bytes().await.unwrap(), b.bytes().await.unwrap());
            assert_eq!(
                plain.head(location).await.unwrap(),
                inline.head(location).await.unwrap()
            );
        }
        let ranges = [
            GetRange::Bounded(10..20),
            GetRange::Offset(9_990),
            GetRange::Suffix(64),
        ];
        for range in ranges {
            let options = GetOptions::new().with_range(Some(range.clone()));
            let (a, b) = (
                plain.get_opts(&small, options.clone()).await.unwrap(),
                inline.get_opts(&small, options).await.unwrap(),
            );
            assert_eq!(a.range, b.range, "{range:?}");
            assert_eq!(a.bytes().await.unwrap(), b.bytes().await.unwrap());
        }
        let several = [0..5, 100..4_000, 9_999..10_000];
        assert_eq!(
            plain.get_ranges(&small, &several).await.unwrap(),
            inline.get_ranges(&small, &several).await.unwrap()
        );
        assert_eq!(
            &inline.get_range(&small, 5..9).await.unwrap()[..],
            &data[5..9]
        );

        // Errors are the store's own.
        let past = inline.get_range(&small, 9_990..10_010).await;
        assert_eq!(
            format!("{:?}", plain.get_range(&small, 9_990..10_010).await),
            format!("{past:?}")
        );
        let missing = inline.get(&Path::from("a/missing.bin")).await;
        assert!(
            matches!(missing, Err(object_store::Error::NotFound { .. })),
            "{missing:?}"
        );
        assert!(inline.head(&Path::from("a")).await.is_err());
        let tag = inline.head(&small).await.unwrap().e_tag.unwrap();
        let stale = GetOptions::new().with_if_none_match(Some(tag));
        assert!(matches!(
            inline.get_opts(&small, stale).await,
            Err(object_store::Error::NotModified { .. })
        ));
    }

    /// The metadata of a file whose size is known is answered without the
    /// store (a key with no file behind it shows it), with the size first
    /// given; other keys, and a HEAD with a condition, ask the store.
    #[tokio::test]
    async fn known_sizes_answer_a_files_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let store = ReadStore::new(Arc::new(
            LocalFileSystem::new_with_prefix(dir.path()).unwrap(),
        ));
        let ghost = Path::from("latest/public/t/date=2026-11-01/1-9-ab.parquet");
        store.know([(&ghost.to_string(), &123)]);
        store.know([(&ghost.to_string(), &456)]);
        let meta = store.head(&ghost).await.unwrap();
        assert_eq!((meta.location.clone(), meta.size), (ghost.clone(), 123));
        let got = store
            .get_opts(&ghost, GetOptions::new().with_head(true))
            .await
            .unwrap();
        assert_eq!(got.range, 0..123);
        assert!(got.bytes().await.unwrap().is_empty());
        let conditional = GetOptions::new().with_head(true).with_if_match(Some("x"));
        assert!(matches!(
            store.get_opts(&ghost, conditional).await,
            Err(object_store::Error::NotFound { .. })
        ));
        assert!(matches!(
            store
                .head(&Path::from("latest/public/t/other.parquet"))
                .await,
            Err(object_store::Error::NotFound { .. })
        ));
    }
}
