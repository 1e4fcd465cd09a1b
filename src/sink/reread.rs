//! A store whose reads are tried again on any transient error, for the
//! readers we do not drive ourselves: delta-rs and its kernel read a
//! table's log through it.
//!
//! Why not leave it to the client's own retries: object_store retries a
//! request that failed to connect or timed out, but not a transport error
//! of "unknown" kind, such as a connection reset while the request is sent,
//! even for a GET; and it gives a body cut off mid-read only what is left
//! of the first request's budget. Our own reads start such a request again
//! (`archive::listing::get`); delta-rs reads a log entry once, and its
//! kernel hides the store's error from its callers, so the run would stop
//! on one dropped connection. Reads are idempotent, so trying them again
//! here is safe; writes pass through untouched (a Delta commit is a
//! create-if-absent PUT, whose retry `compact::commit` decides).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use crate::backoff::{Backoff, retry_transient};
use crate::error::{Disposition, store_disposition};

/// How long one read is tried again: as long as our own reads are.
const BUDGET: Duration = crate::archive::listing::GET_RETRY_FOR;

/// A body up to this size is read whole inside the retried request, so a
/// cut body is read again too (the log entries and checkpoints of a table
/// are this small; a data file's ranges are left to the client).
const WHOLE_BODY: u64 = 16 * 1024 * 1024;

/// The store given, with its reads tried again (see the module doc).
///
/// Only for a store that lists in key order (S3): a listing cut off is
/// resumed after the last key it gave.
#[derive(Debug)]
pub(crate) struct Reread(Arc<dyn ObjectStore>);

impl Reread {
    pub(crate) fn new(store: Arc<dyn ObjectStore>) -> Reread {
        Reread(store)
    }
}

impl std::fmt::Display for Reread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Worth another try: what the sink would retry, less the answers that
/// are about the request (a precondition, "not modified").
fn transient(e: &object_store::Error) -> bool {
    !matches!(
        e,
        object_store::Error::Precondition { .. }
            | object_store::Error::NotModified { .. }
            | object_store::Error::AlreadyExists { .. }
    ) && store_disposition(e) == Disposition::Retry
}

#[async_trait::async_trait]
impl ObjectStore for Reread {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.0.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.0.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        retry_transient(BUDGET, transient, || async {
            let got = self.0.get_opts(location, options.clone()).await?;
            if options.head || got.range.end - got.range.start > WHOLE_BODY {
                return Ok(got);
            }
            let (meta, range, attributes) =
                (got.meta.clone(), got.range.clone(), got.attributes.clone());
            let body = got.bytes().await?;
            Ok(GetResult {
                payload: GetResultPayload::Stream(
                    futures::stream::once(async move { Ok(body) }).boxed(),
                ),
                meta,
                range,
                attributes,
            })
        })
        .await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        retry_transient(BUDGET, transient, || self.0.get_ranges(location, ranges)).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.0.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        resumed(Arc::clone(&self.0), prefix.cloned(), None)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        resumed(Arc::clone(&self.0), prefix.cloned(), Some(offset.clone()))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        retry_transient(BUDGET, transient, || self.0.list_with_delimiter(prefix)).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.0.copy_opts(from, to, options).await
    }
}

/// A listing that, when the store breaks it off, goes on after the last
/// key it gave (S3 lists in key order), within [`BUDGET`].
fn resumed(
    store: Arc<dyn ObjectStore>,
    prefix: Option<Path>,
    after: Option<Path>,
) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
    struct Listing {
        store: Arc<dyn ObjectStore>,
        prefix: Option<Path>,
        after: Option<Path>,
        inner: BoxStream<'static, object_store::Result<ObjectMeta>>,
        started: Instant,
        wait: Backoff,
        ended: bool,
    }
    impl Listing {
        fn open(&self) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
            match &self.after {
                Some(after) => self.store.list_with_offset(self.prefix.as_ref(), after),
                None => self.store.list(self.prefix.as_ref()),
            }
        }
    }
    let mut listing = Listing {
        store,
        prefix,
        after,
        inner: futures::stream::empty().boxed(),
        started: Instant::now(),
        wait: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
        ended: false,
    };
    listing.inner = listing.open();
    futures::stream::unfold(listing, |mut l| async move {
        loop {
            if l.ended {
                return None;
            }
            match l.inner.next().await? {
                Ok(meta) => {
                    l.after = Some(meta.location.clone());
                    return Some((Ok(meta), l));
                }
                Err(e) if transient(&e) && l.started.elapsed() + l.wait.wait() < BUDGET => {
                    tracing::info!(error = %crate::error::Report(&e), wait = ?l.wait.wait(), "listing again");
                    tokio::time::sleep(l.wait.wait()).await;
                    l.wait.grow();
                    l.inner = l.open();
                }
                Err(e) => {
                    l.ended = true;
                    return Some((Err(e), l));
                }
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::TryStreamExt;
    use object_store::ObjectStoreExt;
    use object_store::memory::InMemory;

    use super::*;

    /// A store whose first `fail` reads of each kind break as a dropped
    /// connection does, and whose listings break after their first entry.
    #[derive(Debug)]
    struct Flaky {
        inner: InMemory,
        fail: usize,
        gets: AtomicUsize,
        lists: AtomicUsize,
    }

    impl std::fmt::Display for Flaky {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "Flaky")
        }
    }

    fn dropped() -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: "error sending request".into(),
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for Flaky {
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
            let got = self.inner.get_opts(location, options).await?;
            if self.gets.fetch_add(1, Ordering::SeqCst) >= self.fail {
                return Ok(got);
            }
            // The answer's head arrives, its body is cut.
            let cut = futures::stream::once(async { Err(dropped()) }).boxed();
            Ok(GetResult {
                payload: GetResultPayload::Stream(cut),
                ..got
            })
        }
        fn delete_stream(
            &self,
            locations: BoxStream<'static, object_store::Result<Path>>,
        ) -> BoxStream<'static, object_store::Result<Path>> {
            self.inner.delete_stream(locations)
        }
        fn list(
            &self,
            prefix: Option<&Path>,
        ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
            let all = self.inner.list(prefix);
            if self.lists.fetch_add(1, Ordering::SeqCst) >= self.fail {
                return all;
            }
            all.take(1)
                .chain(futures::stream::once(async { Err(dropped()) }))
                .boxed()
        }
        fn list_with_offset(
            &self,
            prefix: Option<&Path>,
            offset: &Path,
        ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
            let all = self.inner.list_with_offset(prefix, offset);
            if self.lists.fetch_add(1, Ordering::SeqCst) >= self.fail {
                return all;
            }
            all.take(1)
                .chain(futures::stream::once(async { Err(dropped()) }))
                .boxed()
        }
        async fn list_with_delimiter(
            &self,
            prefix: Option<&Path>,
        ) -> object_store::Result<ListResult> {
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

    async fn flaky(fail: usize) -> Arc<Flaky> {
        let store = Flaky {
            inner: InMemory::new(),
            fail,
            gets: AtomicUsize::new(0),
            lists: AtomicUsize::new(0),
        };
        for i in 0..5 {
            let key = Path::from(format!("t/_delta_log/{i:020}.json"));
            store
                .inner
                .put(&key, format!("entry {i}").into())
                .await
                .unwrap();
        }
        Arc::new(store)
    }

    /// A read whose body is cut twice is read a third time, whole; a
    /// listing cut after each entry goes on after it, every key once and
    /// in order.
    #[tokio::test(start_paused = true)]
    async fn reads_and_listings_cut_off_are_done_again() {
        let store = flaky(2).await;
        let reread = Reread::new(Arc::clone(&store) as Arc<dyn ObjectStore>);
        let key = Path::from("t/_delta_log/00000000000000000003.json");
        let body = reread.get(&key).await.unwrap().bytes().await.unwrap();
        assert_eq!(&body[..], b"entry 3");
        assert_eq!(store.gets.load(Ordering::SeqCst), 3);

        let listed: Vec<String> = reread
            .list(Some(&Path::from("t/_delta_log")))
            .map_ok(|m| m.location.to_string())
            .try_collect()
            .await
            .unwrap();
        let want: Vec<String> = (0..5)
            .map(|i| format!("t/_delta_log/{i:020}.json"))
            .collect();
        assert_eq!(listed, want);
        assert_eq!(store.lists.load(Ordering::SeqCst), 3);
    }

    /// What is not transient comes back at once: a missing object is not
    /// looked for again.
    #[tokio::test(start_paused = true)]
    async fn a_missing_object_is_reported_at_once() {
        let store = flaky(0).await;
        let reread = Reread::new(Arc::clone(&store) as Arc<dyn ObjectStore>);
        let err = reread.get(&Path::from("t/none")).await.unwrap_err();
        assert!(matches!(err, object_store::Error::NotFound { .. }), "{err}");
    }
}
