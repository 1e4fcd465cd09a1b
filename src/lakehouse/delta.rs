//! The Delta Lake side of the compacted tables: a source table's history
//! (`parquet/<schema>/<table>/`, partitioned by `date`) and latest view
//! (`latest/<schema>/<table>/`) are each a Delta table, a `_delta_log/`
//! beside its data files, so Spark, Trino, Athena, DuckDB and the
//! `deltalake` package read a whole snapshot without knowing waltail. This
//! module says where the tables are, what their schemas are, and reads a
//! log back; compaction's commit stage (`compact::commit`) writes it.
//!
//! Everything a later run needs is read back from the log: the txn version
//! (where it starts), the schema (the column types it must widen; each
//! field records its waltail kind), the configuration (the latest view's
//! bucket count) and the files. So the log can be the one record of
//! progress: a run that stops before its commit leaves only files no
//! snapshot names (vacuum deletes them), and a retried commit of a seq
//! already in the log is recognised by its txn.
//!
//! The log gets a checkpoint every [`CHECKPOINT_INTERVAL`] commits, so
//! opening a table reads one Parquet file and at most that many JSON
//! commits whatever its age.

use std::sync::Arc;

use deltalake_core::kernel::{DataType as DeltaType, MetadataValue, StructField, StructType};
use deltalake_core::logstore::{LogStoreRef, StorageConfig, default_logstore};
use deltalake_core::{DeltaTable, DeltaTableError};
use object_store::ObjectStore;
use url::Url;

use super::layout::partition_date;
use super::typing::{Column, Kind, TableShape};
use crate::config::DestinationConfig;
use crate::sink::Sink;
use crate::{Error, Result};

/// Commits between two checkpoints of a log (Delta's own default).
pub const CHECKPOINT_INTERVAL: u64 = 10;

/// The field metadata key that records a column's waltail kind: Delta's
/// `string` is both text and JSON, and a later run must know which.
const KIND_KEY: &str = "waltail.kind";

/// The table property that records a latest view's bucket count.
pub(crate) const BUCKETS_KEY: &str = "waltail.buckets";

/// Which of a source table's two Delta tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Every change, partitioned by `date`.
    History,
    /// One row per key.
    Latest,
}

impl Role {
    /// The folder under the prefix that holds this role's tables.
    pub fn root(self) -> &'static str {
        match self {
            Role::History => "parquet",
            Role::Latest => "latest",
        }
    }
}

/// Where the archive's Delta tables live, as delta-rs addresses them: a
/// store rooted where the URLs' paths start, and the archive's URL.
#[derive(Clone)]
pub struct Location {
    root: Arc<dyn ObjectStore>,
    /// The archive root (bucket and prefix, or folder), ending in `/`.
    base: Url,
    /// The writer's sink, whose [`Sink::settle`] makes files written into
    /// a local folder durable (see [`Location::settling`]); none for
    /// readers.
    sink: Option<Sink>,
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Location({})", self.base)
    }
}

impl Location {
    /// The Delta location of an archive. On S3 it shares the sink's store
    /// (bucket-rooted, retried as compact retries, its reads also after
    /// errors the client leaves: see [`Reread`](crate::sink::reread)); a
    /// folder gets a store
    /// rooted at `/` and `file://` URLs, so delta-rs sorts the folder's
    /// listings (a local file system lists in no order).
    pub fn new(dest: &DestinationConfig, store: &Arc<dyn ObjectStore>) -> Result<Location> {
        let bad = |what: String| {
            Error::config(format!(
                "cannot address the archive as Delta tables: {what}"
            ))
        };
        match dest {
            DestinationConfig::File { path, prefix } => {
                let abs = std::path::absolute(path)
                    .map_err(|e| Error::io(format!("cannot resolve {}", path.display()), e))?;
                let dir = match prefix {
                    Some(p) => abs.join(p),
                    None => abs,
                };
                let base = Url::from_directory_path(&dir)
                    .map_err(|()| bad(format!("{} is not an absolute path", dir.display())))?;
                Ok(Location {
                    root: Arc::new(object_store::local::LocalFileSystem::new()),
                    base,
                    sink: None,
                })
            }
            DestinationConfig::S3(s3) => {
                let mut url = format!("s3://{}/", s3.bucket);
                if let Some(p) = dest.prefix() {
                    url.push_str(p.trim_matches('/'));
                    url.push('/');
                }
                let base = Url::parse(&url).map_err(|e| bad(format!("{url}: {e}")))?;
                Ok(Location {
                    root: Arc::new(crate::sink::reread::Reread::new(Arc::clone(store))),
                    base,
                    sink: None,
                })
            }
        }
    }

    /// This location for a writer: its commits first make the files they
    /// name durable, and return once the commit itself is (`sink`'s
    /// [`Sink::settle`]: a local folder's file system synced; nothing on
    /// S3). Without it a machine crash could keep a commit whose Parquet
    /// files were never written out, or a latest view's commit without
    /// the history commit before it.
    pub(crate) fn settling(mut self, sink: &Sink) -> Location {
        self.sink = Some(sink.clone());
        self
    }

    /// Makes what was written through this location durable (nothing for a
    /// reader's location; see [`Location::settling`]).
    pub(crate) fn settle(&self) -> Result<()> {
        self.sink.as_ref().map_or(Ok(()), Sink::settle)
    }

    /// The archive root's URL (bucket and prefix, or folder).
    pub fn url(&self) -> &Url {
        &self.base
    }

    /// The archive root's local folder (with the prefix), if it is one.
    pub fn folder(&self) -> Option<std::path::PathBuf> {
        if self.base.scheme() == "file" {
            self.base.to_file_path().ok()
        } else {
            None
        }
    }

    /// The URL of the table of `shape` in `role`, ending in `/`.
    pub fn table_url(&self, role: Role, dir: &str) -> Result<Url> {
        self.base
            .join(&format!("{}/{dir}/", role.root()))
            .map_err(|e| Error::bug(format!("a table URL under {}: {e}", self.base)))
    }

    pub(crate) fn log_store(&self, url: &Url) -> LogStoreRef {
        let prefixed: Arc<dyn ObjectStore> = Arc::new(object_store::prefix::PrefixStore::new(
            Arc::clone(&self.root),
            object_store::path::Path::from(url.path()),
        ));
        default_logstore(
            prefixed,
            Arc::clone(&self.root),
            url,
            &StorageConfig::default(),
        )
    }
}

/// The app id of a table's txn actions: stable for the pipeline and table
/// (the same for its history and its latest view, which are two logs).
pub fn app_id(pipeline: &str, table: &str) -> String {
    format!("waltail:{pipeline}:{table}")
}

/// A committed Delta table as a run needs it.
pub struct Published {
    /// The snapshot as delta-rs loaded it, which the next commit is made
    /// against (so a concurrent commit is detected).
    pub(crate) table: DeltaTable,
    /// Where the table is.
    pub url: Url,
    /// The table's Delta version.
    pub version: u64,
    /// The last seq compacted into it (the txn version); `None` for a table
    /// no waltail run committed to.
    pub seq: Option<u64>,
    /// The data columns, with the kinds their fields record.
    pub columns: Vec<Column>,
    /// The latest view's buckets (1 for a history).
    pub buckets: u32,
    /// The data files: path relative to the table, size, rows.
    pub files: Vec<DataFile>,
}

impl std::fmt::Debug for Published {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Published")
            .field("url", &self.url.as_str())
            .field("version", &self.version)
            .field("seq", &self.seq)
            .field("files", &self.files.len())
            .finish()
    }
}

/// A data file of a snapshot, or one to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataFile {
    /// Relative to the table's folder, e.g. `date=2026-12-02/5-9-ab12cd34.parquet`.
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// The rows it holds.
    pub rows: u64,
    /// The history's `date` partition (`YYYY-MM-DD`).
    pub date: Option<String>,
}

impl Published {
    /// Rows in the table's current snapshot (from the files' statistics).
    pub fn rows(&self) -> u64 {
        self.files.iter().map(|f| f.rows).sum()
    }

    /// The version of another app id's txn in this snapshot.
    pub async fn app_version(&self, app_id: &str) -> Result<Option<i64>> {
        let _turn = log_turn().await;
        let state = self
            .table
            .snapshot()
            .map_err(|e| delta_error("cannot read", &self.url, e))?;
        state
            .transaction_version(self.table.log_store().as_ref(), app_id)
            .await
            .map_err(|e| delta_error("cannot read the txn of", &self.url, e))
    }
}

/// How many calls into the Delta log (open, commit, vacuum) run at once.
/// The log reader blocks a thread of tokio's blocking pool per call while
/// its reads, on a local folder, need another thread of that pool: a
/// process whose pool is capped (`waltail query`'s, see `cli`) keeps room
/// for the reads by allowing no more calls than this beside them.
pub const LOG_CALLS: usize = 2;

static LOG_PERMITS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(LOG_CALLS);

/// A turn at the Delta log (see [`LOG_CALLS`]); never taken while one is
/// held, so calls cannot wait on each other.
pub(crate) async fn log_turn() -> tokio::sync::SemaphorePermit<'static> {
    LOG_PERMITS
        .acquire()
        .await
        .expect("the log semaphore is never closed")
}

pub(crate) fn delta_error(what: &str, url: &Url, e: DeltaTableError) -> Error {
    Error::fatal(
        format!("{what} the Delta table {url}: {e}"),
        "check that the destination is reachable and run `waltail compact` again",
    )
}

/// Loads the table at `url`, or `None` when it has no log yet.
pub async fn load(
    loc: &Location,
    role: Role,
    dir: &str,
    app_id: &str,
) -> Result<Option<Published>> {
    let url = loc.table_url(role, dir)?;
    let _turn = log_turn().await;
    let log_store = loc.log_store(&url);
    let exists = log_store
        .is_delta_table_location()
        .await
        .map_err(|e| delta_error("cannot list", &url, e))?;
    if !exists {
        return Ok(None);
    }
    let mut table = DeltaTable::new(log_store);
    table
        .load()
        .await
        .map_err(|e| delta_error("cannot open", &url, e))?;
    published(table, url, app_id).await.map(Some)
}

async fn published(table: DeltaTable, url: Url, app_id: &str) -> Result<Published> {
    let state = table
        .snapshot()
        .map_err(|e| delta_error("cannot read", &url, e))?;
    let seq = state
        .transaction_version(table.log_store().as_ref(), app_id)
        .await
        .map_err(|e| delta_error("cannot read the txn of", &url, e))?
        .map(|v| v.max(0) as u64);
    let schema = state.schema();
    let columns = schema
        .fields()
        .filter_map(|f| {
            let MetadataValue::String(kind) = f.metadata().get(KIND_KEY)? else {
                return None;
            };
            let kind: Kind = serde_json::from_str(kind).ok()?;
            Some(Column {
                name: f.name().clone(),
                kind,
            })
        })
        .collect();
    let buckets = state
        .metadata()
        .configuration()
        .get(BUCKETS_KEY)
        .and_then(|b| b.parse().ok())
        .unwrap_or(1);
    let files = state
        .log_data()
        .iter()
        .map(|f| {
            let path = f.path().into_owned();
            let rows = f
                .stats()
                .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
                .and_then(|s| s["numRecords"].as_u64())
                .unwrap_or(0);
            let date = partition_date(&path);
            DataFile {
                size: f.size().max(0) as u64,
                rows,
                date,
                path,
            }
        })
        .collect();
    Ok(Published {
        version: state.version(),
        url,
        seq,
        columns,
        buckets,
        files,
        table,
    })
}

/// The Delta schema of a role's table: its Arrow columns as Delta types
/// (each data column's waltail kind in its metadata), and for a history the
/// `date` partition column, which the files do not hold.
pub fn schema(shape: &TableShape, role: Role) -> Result<StructType> {
    let mut fields: Vec<StructField> = shape
        .columns
        .iter()
        .map(|c| {
            let kind = serde_json::to_string(&c.kind)
                .map_err(|e| Error::bug(format!("a column kind as JSON: {e}")))?;
            Ok(StructField::new(&c.name, delta_type(c.kind)?, true)
                .with_metadata([(KIND_KEY, MetadataValue::String(kind))]))
        })
        .collect::<Result<_>>()?;
    let string = |name: &str, nullable| StructField::new(name, DeltaType::STRING, nullable);
    match role {
        Role::History => fields.extend([
            string("_op", false),
            StructField::new("_seq", DeltaType::LONG, false),
            string("_lsn", false),
            string("_key", true),
            string("_old", true),
            string("_unchanged", true),
            StructField::new("date", DeltaType::DATE, true),
        ]),
        Role::Latest => fields.extend([
            StructField::new("_seq", DeltaType::LONG, false),
            string("_lsn", false),
            string("_key", false),
        ]),
    }
    StructType::try_new(fields).map_err(|e| {
        Error::fatal(
            format!("{}: no Delta schema for its columns: {e}", shape.table),
            "rename the column in Postgres, or leave the table out of `waltail compact`",
        )
    })
}

/// The Delta type a kind is written as (the Arrow type of
/// [`Kind::data_type`], named as Delta names it).
fn delta_type(kind: Kind) -> Result<DeltaType> {
    Ok(match kind {
        Kind::Int16 => DeltaType::SHORT,
        Kind::Int32 => DeltaType::INTEGER,
        Kind::Int64 => DeltaType::LONG,
        Kind::Float32 => DeltaType::FLOAT,
        Kind::Float64 => DeltaType::DOUBLE,
        Kind::Bool => DeltaType::BOOLEAN,
        Kind::Decimal { precision, scale } => DeltaType::decimal(precision, scale.max(0) as u8)
            .map_err(|e| Error::bug(format!("decimal({precision}, {scale}): {e}")))?,
        Kind::Date => DeltaType::DATE,
        Kind::Timestamp => DeltaType::TIMESTAMP_NTZ,
        Kind::TimestampTz => DeltaType::TIMESTAMP,
        Kind::Text | Kind::Json => DeltaType::STRING,
    })
}

/// Whether a table needs the `timestampNtz` feature (a `timestamp without
/// time zone` column).
pub(crate) fn has_timestamp_ntz(schema: &StructType) -> bool {
    schema
        .fields()
        .any(|f| f.data_type() == &DeltaType::TIMESTAMP_NTZ)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The Delta location of an archive in the folder `root` (a folder's
    /// tables use a store of their own: the one given is not used).
    pub(crate) fn folder(root: &std::path::Path) -> Location {
        let dest = DestinationConfig::File {
            path: root.to_path_buf(),
            prefix: None,
        };
        let unused: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        Location::new(&dest, &unused).unwrap()
    }

    /// `test_t` with a `timestamp without time zone` column.
    pub(crate) fn shape() -> TableShape {
        let mut s = TableShape::test_t();
        s.columns.push(Column {
            name: "at".into(),
            kind: Kind::Timestamp,
        });
        s
    }

    #[test]
    fn kinds_map_to_delta_types_and_back_through_the_field_metadata() {
        let s = shape();
        let schema = schema(&s, Role::History).unwrap();
        let names: Vec<&str> = schema.fields().map(|f| f.name().as_str()).collect();
        assert_eq!(
            names,
            [
                "id",
                "doc",
                "at",
                "_op",
                "_seq",
                "_lsn",
                "_key",
                "_old",
                "_unchanged",
                "date"
            ]
        );
        assert_eq!(
            schema.field("at").unwrap().data_type(),
            &DeltaType::TIMESTAMP_NTZ
        );
        assert!(has_timestamp_ntz(&schema));
        assert!(!has_timestamp_ntz(
            &super::schema(&TableShape::test_t(), Role::Latest).unwrap()
        ));
        assert_eq!(
            partition_date("date=2026-12-02/1-2-ab.parquet").as_deref(),
            Some("2026-12-02")
        );
        assert_eq!(partition_date("0-1-2.parquet"), None);
    }
}
