//! Upgrade in place of an archive compacted by a release before the Delta
//! Lake tables: those kept their progress in
//! `[prefix/]_waltail/compaction/manifest.json` (per table the next seq,
//! the date folder, the columns, the latest view's files and buckets) and
//! wrote the same Parquet files the Delta tables name. The first run of
//! this release writes, for every table the manifest knows, the two Delta
//! logs that name the files already there (nothing is rewritten), with the
//! manifest's next seq as the txn; then it keeps the manifest as
//! `manifest.upgraded.json` and deletes the old release's lock files and
//! staging folder.
//!
//! Each log is created only if the table has none, so a run stopped during
//! the upgrade is completed by the next one; the manifest stays the source
//! until every table has both logs. History files a run of the old release
//! wrote past the manifest's next seq, and never committed, are left out
//! (their seqs are compacted again).

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::file::metadata::{FooterTail, ParquetMetaDataReader};
use serde::Deserialize;

use super::commit;
use crate::archive::key::under;
use crate::archive::schema::SchemaRecord;
use crate::error::ErrorKind;
use crate::lakehouse::compacted::{UNREADABLE_FIX, date_txns, history_first_seq, table_folder};
use crate::lakehouse::delta::{self, DataFile, Location, Role};
use crate::lakehouse::layout::{partition_date, relative, table_dir};
use crate::lakehouse::typing::{Column, TableShape};
use crate::{Error, Result};

/// Where the earlier releases kept their progress, under the prefix.
pub(crate) const MANIFEST_KEY: &str = "_waltail/compaction/manifest.json";

/// Where the upgrade keeps the manifest it read, under the prefix.
const UPGRADED_KEY: &str = "_waltail/compaction/manifest.upgraded.json";

/// The old release's staging folder for latest-view files, under the prefix.
const STAGING_DIR: &str = "_waltail/compaction/staging";

/// The old release's lock objects, gone with it.
const LOCK_KEYS: [&str; 2] = [
    "_waltail/compaction/lock.json",
    "_waltail/compaction/run.lock",
];

/// The parts of the old manifest (format 1) the upgrade reads.
#[derive(Debug, Deserialize)]
struct Manifest {
    format: u32,
    tables: BTreeMap<String, Entry>,
    /// Latest-view files committed but not yet moved out of staging.
    #[serde(default)]
    publish: Vec<Move>,
}

#[derive(Debug, Deserialize)]
struct Entry {
    next_seq: u64,
    #[serde(default)]
    next_date: Option<String>,
    columns: Vec<Column>,
    /// Keys (under the prefix) of the latest view's files.
    latest: Vec<String>,
    #[serde(default)]
    buckets: u32,
}

#[derive(Debug, Deserialize)]
struct Move {
    from: String,
    to: String,
}

/// Whether the archive under `prefix` still has an old manifest.
pub(crate) async fn pending(store: &dyn ObjectStore, prefix: Option<&str>) -> Result<bool> {
    let path = ObjectPath::from(under(prefix, MANIFEST_KEY));
    match store.head(&path).await {
        Ok(_) => Ok(true),
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(Error::store("HEAD", path.to_string(), e)),
    }
}

/// Upgrades the archive in place if an old manifest is there (see the
/// module doc); returns the tables it wrote logs for.
pub(crate) async fn upgrade(
    store: &Arc<dyn ObjectStore>,
    prefix: Option<&str>,
    loc: &Location,
    pipeline: &str,
    schemas: &BTreeMap<String, Vec<SchemaRecord>>,
) -> Result<Vec<String>> {
    let path = ObjectPath::from(under(prefix, MANIFEST_KEY));
    let body = match store.get(&path).await {
        Ok(got) => got
            .bytes()
            .await
            .map_err(|e| Error::store("GET", path.to_string(), e))?,
        Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(Error::store("GET", path.to_string(), e)),
    };
    let manifest: Manifest = serde_json::from_slice(&body).map_err(|e| {
        Error::fatal(
            format!("the compaction manifest {path} of an earlier release is not valid: {e}"),
            "restore it from a backup; or delete it with the parquet/ and latest/ folders to compact everything again",
        )
        .with_kind(ErrorKind::Archive)
    })?;
    if manifest.format != 1 {
        return Err(Error::fatal(
            format!(
                "the compaction manifest {path} has format {}, which this release cannot upgrade",
                manifest.format
            ),
            "run the waltail release that wrote it, or delete it with the parquet/ and latest/ folders to compact everything again",
        ));
    }
    // The old release's last step, if a run stopped before it.
    for m in &manifest.publish {
        let to = ObjectPath::from(m.to.as_str());
        if let Err(object_store::Error::NotFound { .. }) = store.head(&to).await {
            let from = ObjectPath::from(m.from.as_str());
            store
                .copy(&from, &to)
                .await
                .map_err(|e| Error::store("COPY", m.from.clone(), e))?;
        }
    }
    let mut upgraded = Vec::new();
    for (table, entry) in &manifest.tables {
        let records = schemas.get(table).map(Vec::as_slice).unwrap_or_default();
        let newest = TableShape::from_records(table, records);
        // The columns the files were written with; the next run evolves
        // the schema from there as for any compacted table.
        let shape = TableShape {
            table: table.clone(),
            columns: entry.columns.clone(),
            key: newest
                .key
                .iter()
                .copied()
                .filter(|&i| i < entry.columns.len())
                .collect(),
        };
        if upgrade_table(store, prefix, loc, pipeline, &shape, entry).await? {
            upgraded.push(table.clone());
        }
    }
    let kept = ObjectPath::from(under(prefix, UPGRADED_KEY));
    store
        .put(&kept, body.into())
        .await
        .map_err(|e| Error::store("PUT", kept.to_string(), e))?;
    // The old release's staging folder holds only files no table names.
    let staging = ObjectPath::from(under(prefix, STAGING_DIR));
    let staged: Vec<ObjectPath> = store
        .list(Some(&staging))
        .map_ok(|m| m.location)
        .try_collect()
        .await
        .map_err(|e| Error::store("LIST", staging.to_string(), e))?;
    let keys = std::iter::once(MANIFEST_KEY)
        .chain(LOCK_KEYS)
        .map(|k| ObjectPath::from(under(prefix, k)))
        .chain(staged);
    for path in keys {
        match store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(Error::store("DELETE", path.to_string(), e)),
        }
    }
    if !upgraded.is_empty() {
        tracing::info!(tables = ?upgraded, "upgraded the compacted tables to Delta Lake in place");
    }
    Ok(upgraded)
}

/// Writes the table's missing logs; whether it wrote one.
async fn upgrade_table(
    store: &Arc<dyn ObjectStore>,
    prefix: Option<&str>,
    loc: &Location,
    pipeline: &str,
    shape: &TableShape,
    entry: &Entry,
) -> Result<bool> {
    let Some(seq) = entry.next_seq.checked_sub(1) else {
        return Ok(false);
    };
    let app = delta::app_id(pipeline, &shape.table);
    let dir = table_folder(shape);
    let info = || {
        vec![
            ("waltail.pipeline".to_string(), pipeline.into()),
            ("waltail.upgrade".to_string(), true.into()),
        ]
    };
    let mut wrote = false;
    if delta::load(loc, Role::History, &dir, &app).await?.is_none() {
        let root = table_dir(prefix, "parquet", shape);
        let listed: Vec<object_store::ObjectMeta> = store
            .list(Some(&ObjectPath::from(root.as_str())))
            .try_collect()
            .await
            .map_err(|e| Error::store("LIST", root.clone(), e))?;
        let mut adds = Vec::new();
        for meta in listed {
            let key = meta.location.to_string();
            let Some(path) = key.strip_prefix(&format!("{root}/")) else {
                continue;
            };
            // Compacted by the old release: seqs below its next seq.
            let compacted = path.ends_with(".parquet")
                && !path.starts_with("_delta_log/")
                && history_first_seq(path).is_some_and(|first| first < entry.next_seq);
            if !compacted {
                continue;
            }
            adds.push(DataFile {
                path: path.to_string(),
                size: meta.size,
                rows: rows(store, &meta).await?,
                date: partition_date(path),
            });
        }
        let txns = date_txns(&app, entry.next_date.as_deref());
        commit::commit(
            loc,
            &dir,
            None,
            commit::Commit {
                shape,
                role: Role::History,
                app_id: &app,
                seq,
                adds,
                removes: Vec::new(),
                buckets: 1,
                txns,
                info: info(),
            },
        )
        .await?;
        wrote = true;
    }
    if !entry.latest.is_empty() && delta::load(loc, Role::Latest, &dir, &app).await?.is_none() {
        let root = table_dir(prefix, "latest", shape);
        let mut adds = Vec::new();
        for key in &entry.latest {
            let path = ObjectPath::from(key.as_str());
            let meta = store
                .head(&path)
                .await
                .map_err(|e| Error::store("HEAD", key.clone(), e))?;
            adds.push(DataFile {
                path: relative(&root, key)?,
                size: meta.size,
                rows: rows(store, &meta).await?,
                date: None,
            });
        }
        commit::commit(
            loc,
            &dir,
            None,
            commit::Commit {
                shape,
                role: Role::Latest,
                app_id: &app,
                seq,
                adds,
                removes: Vec::new(),
                buckets: entry.buckets.max(1),
                txns: Vec::new(),
                info: info(),
            },
        )
        .await?;
        wrote = true;
    }
    Ok(wrote)
}

/// The rows of a Parquet file, from its footer (two ranged GETs).
async fn rows(store: &Arc<dyn ObjectStore>, meta: &object_store::ObjectMeta) -> Result<u64> {
    let key = meta.location.to_string();
    let bad = |e: String| {
        Error::fatal(
            format!("cannot read the Parquet footer of {key}: {e}"),
            UNREADABLE_FIX,
        )
        .with_kind(ErrorKind::Archive)
    };
    let get = async |range: std::ops::Range<u64>| {
        store
            .get_range(&meta.location, range)
            .await
            .map_err(|e| Error::store("GET", key.clone(), e))
    };
    let size = meta.size;
    if size < 8 {
        return Err(bad(format!("{size} bytes")));
    }
    let tail = get(size - 8..size).await?;
    let tail: [u8; 8] = tail[..]
        .try_into()
        .map_err(|_| bad("a short read".into()))?;
    let length = FooterTail::try_new(&tail)
        .map_err(|e| bad(e.to_string()))?
        .metadata_length() as u64;
    let start = size
        .checked_sub(8 + length)
        .ok_or_else(|| bad(format!("a footer of {length} bytes in {size}")))?;
    let footer = get(start..size - 8).await?;
    let metadata =
        ParquetMetaDataReader::decode_metadata(&footer).map_err(|e| bad(e.to_string()))?;
    Ok(metadata.file_metadata().num_rows().max(0) as u64)
}
