//! The destination: one PUT per batch into S3 (or any S3-compatible store) or
//! a local folder, through `object_store`.
//!
//! The run path uses PutObject only (no List, Get or Delete), so credentials
//! limited to s3:PutObject on the prefix are enough. A PUT to an existing key
//! replaces it; since a batch's key and bytes are deterministic, a retried or
//! re-sent batch leaves exactly the same object.
//!
//! A PUT to S3 that returned is durable. A file written into a local folder
//! is not, until the kernel writes it out: [`Sink::settle`] makes every
//! object written so far durable. The pipeline calls it before it records
//! batches as written or confirms past them, and compaction around each
//! Delta commit.

pub(crate) mod credentials;
#[cfg(feature = "lakehouse")]
pub(crate) mod reread;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjectPath;
use object_store::{
    Attribute, Attributes, ClientOptions, ObjectStore, PutOptions, PutPayload, RetryConfig,
};
use secrecy::ExposeSecret;

use crate::archive::key;
use crate::config::{DestinationConfig, S3Config};
use crate::{Error, Result};

/// The content type of archive objects.
pub(crate) const NDJSON_CONTENT_TYPE: &str = "application/x-ndjson";

/// Connecting takes at most this long (then the attempt fails and delivery's
/// own retry policy, the product page's backoff, decides what next).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where objects go.
#[derive(Clone)]
pub(crate) struct Sink {
    store: Arc<dyn ObjectStore>,
    /// The same S3 store's part-by-part interface (see [`Sink::multipart`]).
    multipart: Option<Arc<dyn MultipartStore>>,
    prefix: Option<String>,
    /// Local files carry no content type (object_store's LocalFileSystem
    /// refuses attributes); S3 objects do.
    typed: bool,
    /// What makes written objects durable (see [`Sink::settle`]).
    settle: Settle,
    describe: String,
}

/// How a destination makes the objects written so far durable.
#[derive(Clone)]
enum Settle {
    /// S3: a PUT that returned is durable.
    Nothing,
    /// A local folder: the file system the folder is on is synced (the
    /// folder itself, opened once, names it).
    Folder(Arc<std::fs::File>),
    /// The pipeline's tests: a stand-in that counts or fails.
    #[cfg(test)]
    Hook(Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>),
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink")
            .field("store", &self.store)
            .field("multipart", &self.multipart.is_some())
            .field("prefix", &self.prefix)
            .field("typed", &self.typed)
            .field("settles", &!matches!(self.settle, Settle::Nothing))
            .field("describe", &self.describe)
            .finish()
    }
}

impl Sink {
    /// Builds the store for a destination. Nothing is sent yet.
    /// `timeout` bounds each request (`delivery.request_timeout_ms`).
    pub(crate) fn new(dest: &DestinationConfig, timeout: Duration) -> Result<Sink> {
        Sink::with_retry(
            dest,
            timeout,
            RetryConfig {
                max_retries: 0,
                ..RetryConfig::default()
            },
        )
    }

    /// [`Sink::new`] whose S3 client retries failed requests by `retry`
    /// (`compact` and `query`, which have no retry policy of their own).
    pub(crate) fn with_retry(
        dest: &DestinationConfig,
        timeout: Duration,
        retry: RetryConfig,
    ) -> Result<Sink> {
        let describe = dest.describe();
        match dest {
            DestinationConfig::File { path, prefix } => {
                std::fs::create_dir_all(path).map_err(|e| {
                    Error::io(
                        format!("cannot create the archive folder {}", path.display()),
                        e,
                    )
                })?;
                let store = LocalFileSystem::new_with_prefix(path)
                    .map_err(|e| Error::store("open", path.display().to_string(), e))?;
                let folder = std::fs::File::open(path).map_err(|e| {
                    Error::io(
                        format!("cannot open the archive folder {}", path.display()),
                        e,
                    )
                })?;
                Ok(Sink {
                    store: Arc::new(store),
                    multipart: None,
                    prefix: prefix.clone(),
                    typed: false,
                    settle: Settle::Folder(Arc::new(folder)),
                    describe,
                })
            }
            DestinationConfig::S3(s3) => {
                let store = Arc::new(s3_store(s3, timeout, retry)?);
                Ok(Sink {
                    store: Arc::clone(&store) as Arc<dyn ObjectStore>,
                    multipart: Some(store),
                    prefix: s3.prefix.clone(),
                    typed: true,
                    settle: Settle::Nothing,
                    describe,
                })
            }
        }
    }

    /// A sink over any store (the unit tests use InMemory and wrappers that
    /// hold back or refuse requests).
    #[cfg(test)]
    pub(crate) fn from_store(store: Arc<dyn ObjectStore>, prefix: Option<String>) -> Sink {
        Sink {
            store,
            multipart: None,
            prefix,
            typed: true,
            settle: Settle::Nothing,
            describe: "object store".into(),
        }
    }

    /// This sink with `settle` standing in for the folder's sync, so a
    /// test can see when it is called or make it fail.
    #[cfg(test)]
    pub(crate) fn settling_with(
        mut self,
        settle: impl Fn() -> std::io::Result<()> + Send + Sync + 'static,
    ) -> Sink {
        self.settle = Settle::Hook(Arc::new(settle));
        self
    }

    pub(crate) fn prefix(&self) -> Option<&str> {
        self.prefix.as_deref()
    }

    /// The store itself, for `compact` and `query`, which read and list.
    #[cfg(feature = "lakehouse")]
    pub(crate) fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// S3's multipart interface to the same store, where each part of an
    /// upload is sent by number: a part that failed can be sent again
    /// alone (object_store's own multipart writer numbers parts as it goes,
    /// so a failed part fails the upload). `None` for the local folder.
    #[cfg(feature = "lakehouse")]
    pub(crate) fn multipart(&self) -> Option<&Arc<dyn MultipartStore>> {
        self.multipart.as_ref()
    }

    /// `s3://bucket/prefix` or the folder, for messages.
    pub(crate) fn describe(&self) -> &str {
        &self.describe
    }

    /// Writes one object (whole, or not at all).
    pub(crate) async fn put(&self, key: &str, body: Bytes, content_type: &str) -> Result<()> {
        let mut opts = PutOptions::default();
        if self.typed {
            let mut attributes =
                Attributes::from_iter([(Attribute::ContentType, content_type.to_string())]);
            // A compressed archive object says how (its key does too).
            if content_type == NDJSON_CONTENT_TYPE
                && let Some(encoding) = crate::archive::codec::Codec::of_key(key)
                    .0
                    .content_encoding()
            {
                attributes.insert(Attribute::ContentEncoding, encoding.into());
            }
            opts.attributes = attributes;
        }
        // The key is stored exactly as given (layout encodes what must be
        // encoded), so the key in logs and state is the object's name.
        let path = ObjectPath::parse(key).map_err(|e| Error::store("PUT", key, e.into()))?;
        self.store
            .put_opts(&path, PutPayload::from(body), opts)
            .await
            .map(|_| ())
            .map_err(|source| Error::store("PUT", key, source))
    }

    /// Makes every object written so far durable: nothing for S3, whose
    /// PUT returns once the object is stored; for a local folder, a sync
    /// of the file system it is on (`syncfs`), which writes out the
    /// objects' data and their renames. Without it a confirmed change
    /// could be lost with the machine (power, kernel), though not with
    /// the process. One sync covers every object written before it, so
    /// the pipeline calls it once per state commit (at most every 100 ms
    /// while objects are written), not once per object.
    ///
    /// Blocking: the caller's next step is a state commit, which blocks
    /// on its own `fsync` too.
    pub(crate) fn settle(&self) -> Result<()> {
        let synced = match &self.settle {
            Settle::Nothing => return Ok(()),
            Settle::Folder(folder) => sync_file_system(folder),
            #[cfg(test)]
            Settle::Hook(hook) => hook(),
        };
        synced.map_err(|e| {
            Error::io(
                format!(
                    "cannot write the archive folder {} to disk (syncfs); what was written \
                     since the last sync is not recorded, and the next run writes it again",
                    self.describe
                ),
                e,
            )
        })
    }

    /// The connection check: writes `[prefix/].waltail-check`, proving that
    /// the store is reachable and accepts our writes.
    pub(crate) async fn check(&self, pipeline: &str) -> Result<String> {
        let key = key::check_key(self.prefix());
        let body = format!(
            "{{\"pipeline\":{},\"checked_at\":\"{}\"}}\n",
            serde_json::Value::from(pipeline),
            chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        );
        self.put(&key, Bytes::from(body), "application/json")
            .await?;
        Ok(key)
    }
}

/// Syncs the file system `folder` is on.
#[cfg(target_os = "linux")]
fn sync_file_system(folder: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: syncfs only reads the descriptor, which `folder` keeps open.
    if unsafe { libc::syncfs(folder.as_raw_fd()) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Where `syncfs` is missing: `sync`, every file system.
#[cfg(not(target_os = "linux"))]
fn sync_file_system(_folder: &std::fs::File) -> std::io::Result<()> {
    // SAFETY: sync takes no arguments and cannot fail.
    unsafe { libc::sync() };
    Ok(())
}

fn s3_store(
    s3: &S3Config,
    timeout: Duration,
    retry: RetryConfig,
) -> Result<object_store::aws::AmazonS3> {
    // from_env picks up AWS_REGION / AWS_DEFAULT_REGION and AWS_ENDPOINT;
    // credentials are the file's static keys, else the AWS chain
    // (credentials.rs).
    let mut b = AmazonS3Builder::from_env().with_bucket_name(&s3.bucket);
    if let Some(region) = &s3.region {
        b = b.with_region(region);
    }
    if let Some(endpoint) = &s3.endpoint {
        b = b.with_endpoint(endpoint);
    }
    if s3.use_path_style {
        b = b.with_virtual_hosted_style_request(false);
    }
    match credentials::AwsChain::for_destination(s3) {
        Some(chain) => b = b.with_credentials(Arc::new(chain)),
        None => {
            if let (Some(id), Some(secret)) = (&s3.access_key_id, &s3.secret_access_key) {
                b = b
                    .with_access_key_id(id)
                    .with_secret_access_key(secret.expose_secret());
            }
        }
    }
    let allow_http = s3
        .endpoint
        .as_deref()
        .is_some_and(|e| e.starts_with("http://"));
    b = b
        .with_client_options(
            ClientOptions::new()
                .with_timeout(timeout)
                .with_connect_timeout(CONNECT_TIMEOUT),
        )
        // with_client_options replaces the whole options object, allow_http included.
        .with_allow_http(allow_http)
        .with_retry(retry);
    b.build()
        .map_err(|source| Error::store("configure", format!("s3://{}", s3.bucket), source))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder's objects are synced through the folder's file system; an
    /// S3 sink has nothing to sync.
    #[tokio::test]
    async fn a_folder_sink_syncs_its_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let dest = DestinationConfig::File {
            path: dir.path().join("archive"),
            prefix: None,
        };
        let sink = Sink::new(&dest, Duration::from_secs(5)).unwrap();
        // The handle it syncs through is the archive folder itself, so the
        // sync reaches the file system the objects are on.
        let Settle::Folder(held) = &sink.settle else {
            panic!("a folder sink that does not sync");
        };
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            let (held, folder) = (
                held.metadata().unwrap(),
                std::fs::metadata(dir.path().join("archive")).unwrap(),
            );
            assert_eq!((held.dev(), held.ino()), (folder.dev(), folder.ino()));
        }
        #[cfg(not(unix))]
        let _ = held;
        sink.put(
            "2000/01/01/t-1-1.ndjson",
            Bytes::from("{}\n"),
            NDJSON_CONTENT_TYPE,
        )
        .await
        .unwrap();
        sink.settle().unwrap();
        let written = dir.path().join("archive/2000/01/01/t-1-1.ndjson");
        assert_eq!(std::fs::read(written).unwrap(), b"{}\n");
        let s3 = Sink::from_store(Arc::new(object_store::memory::InMemory::new()), None);
        assert!(matches!(s3.settle, Settle::Nothing));
        s3.settle().unwrap();
    }
}
