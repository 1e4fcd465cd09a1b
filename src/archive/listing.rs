//! What is in the archive: its NDJSON objects (seq ranges and dates, parsed
//! from their keys) and its schema records, read through the same
//! object_store the sink writes with.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDate, Utc};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};

use crate::archive::codec::Codec;
use crate::archive::key::{parse_key, under};
use crate::archive::schema::SchemaRecord;
use crate::error::Disposition;
use crate::error::ErrorKind;
use crate::{Error, Result};

/// One archive object, `[prefix/]YYYY/MM/DD/<pipeline>-<first>-<last>.ndjson`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ArchiveObject {
    pub key: String,
    /// `YYYY-MM-DD`, from the key (the UTC commit date of its first change).
    pub date: String,
    pub first_seq: u64,
    pub last_seq: u64,
    pub size: u64,
}

/// An archive object as the store lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Listed {
    pub key: String,
    /// `YYYY-MM-DD`, from the key (the UTC commit date of its first change).
    pub date: String,
    pub first_seq: u64,
    pub last_seq: u64,
    pub size: u64,
    pub written: DateTime<Utc>,
}

/// Where a listing may start: the first seq wanted, and the date folder of
/// the object that held the seq before it (recorded by compaction).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resume {
    pub seq: u64,
    pub date: String,
}

/// Every archive object of `pipeline`, unsorted; other files under the
/// prefix (the compacted output, schema records, other pipelines) are
/// skipped.
///
/// With `from`, only the date folders from the day before `from.date` on
/// are listed: an archive's dates follow its seqs (a batch is dated by the
/// commit time of its first change, and commits are numbered in commit
/// order), and the day before covers clocks a little out of step around
/// midnight. So a query over a long archive lists days, not years. Of
/// those days, only the objects holding a seq from `from.seq` on are kept.
/// Should the object holding `from.seq` not be among them while later ones
/// are (a gap: a batch not written yet, or a date further back than that),
/// the whole prefix is listed instead. What this cannot see: objects
/// written after the last compaction by a source whose clock stepped back
/// more than a day, dated before the window while nothing newer is in it;
/// compaction lists everything, so the next run takes them and moves the
/// window.
///
/// `folder`: the archive's local folder (with the prefix), if it is one;
/// its days are then read directly (see [`folder_day`]).
pub(crate) async fn list_archive(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    pipeline: &str,
    from: Option<&Resume>,
    folder: Option<&std::path::Path>,
) -> Result<Vec<Listed>> {
    if let Some(from) = from
        && let Some(day_before) = NaiveDate::parse_from_str(&from.date, "%Y-%m-%d")
            .ok()
            .and_then(|d| d.pred_opt())
    {
        let day_before = day_before.to_string();
        let listed = list_days(store, prefix, pipeline, &day_before, from.seq, folder).await?;
        let holds = listed
            .iter()
            .any(|o| o.first_seq <= from.seq && from.seq <= o.last_seq);
        if holds || listed.is_empty() {
            return Ok(listed);
        }
        tracing::debug!(
            seq = from.seq,
            date = %from.date,
            "the object holding the first uncompacted seq is not in the recent date folders; listing everything"
        );
    }
    let root = prefix.map(ObjectPath::from);
    let metas: Vec<_> = store
        .list(root.as_ref())
        .try_collect()
        .await
        .map_err(|e| Error::store("LIST", prefix.unwrap_or("/").to_string(), e))?;
    Ok(metas
        .into_iter()
        .filter_map(|meta| parsed(meta, prefix, pipeline))
        .collect())
}

/// The object `meta` names, if it is one of `pipeline`'s under `prefix`.
fn parsed(meta: ObjectMeta, prefix: Option<&str>, pipeline: &str) -> Option<Listed> {
    let key = meta.location.to_string();
    let relative = match prefix {
        Some(p) => key.strip_prefix(p)?.strip_prefix('/')?,
        None => key.as_str(),
    };
    let (date, first_seq, last_seq) = parse_key(relative, pipeline)?;
    Some(Listed {
        key,
        date,
        first_seq,
        last_seq,
        size: meta.size,
        written: meta.last_modified,
    })
}

/// Listings of date folders, or GETs and HEADs of small objects, in flight
/// at once: on S3 each is a round trip.
pub(crate) const REQUESTS_AT_ONCE: usize = 16;

/// The objects holding a seq from `from_seq` on in the date folders
/// `YYYY/MM/DD` from `from` (`YYYY-MM-DD`) on: years, then months, then
/// days found by delimiter listings, keeping those not before `from`, then
/// each day listed (read directly in a local `folder`).
async fn list_days(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    pipeline: &str,
    from: &str,
    from_seq: u64,
    folder: Option<&std::path::Path>,
) -> Result<Vec<Listed>> {
    // Child folders of `parent` named by `width` digits, with the date text
    // so far (`YYYY`, `YYYY-MM`, `YYYY-MM-DD`) not before `from`'s.
    async fn children(
        store: &dyn ObjectStore,
        parent: Option<ObjectPath>,
        text: String,
        width: usize,
        from: &str,
    ) -> Result<Vec<(ObjectPath, String)>> {
        let described = parent.as_ref().map_or("/".to_string(), |p| p.to_string());
        let listing = store
            .list_with_delimiter(parent.as_ref())
            .await
            .map_err(|e| Error::store("LIST", described, e))?;
        Ok(listing
            .common_prefixes
            .into_iter()
            .filter_map(|folder| {
                let name = folder.filename()?.to_string();
                if name.len() != width || !name.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                let text = if text.is_empty() {
                    name
                } else {
                    format!("{text}-{name}")
                };
                (text.as_str() >= &from[..text.len().min(from.len())]).then_some((folder, text))
            })
            .collect())
    }
    let root = prefix.map(ObjectPath::from);
    let mut level = children(store, root, String::new(), 4, from).await?;
    for _ in 0..2 {
        let found: Vec<Vec<(ObjectPath, String)>> = futures::stream::iter(level)
            .map(|(folder, text)| children(store, Some(folder), text, 2, from))
            .buffered(REQUESTS_AT_ONCE)
            .try_collect()
            .await?;
        level = found.into_iter().flatten().collect();
    }
    let days: Vec<Vec<Listed>> = futures::stream::iter(level)
        .map(|(day, text)| async move {
            if let Some(folder) = folder {
                let (folder, day) = (folder.to_path_buf(), day.to_string());
                let pipeline = pipeline.to_string();
                return tokio::task::spawn_blocking(move || {
                    folder_day(&folder, &text.replace('-', "/"), &day, &pipeline, from_seq)
                })
                .await
                .map_err(|e| Error::bug(format!("listing a day folder stopped: {e}")))?;
            }
            let described = day.to_string();
            let metas: Vec<ObjectMeta> = store
                .list(Some(&day))
                .try_collect()
                .await
                .map_err(|e| Error::store("LIST", described, e))?;
            Ok(metas
                .into_iter()
                .filter_map(|meta| parsed(meta, prefix, pipeline))
                .filter(|o| o.last_seq >= from_seq)
                .collect())
        })
        .buffer_unordered(REQUESTS_AT_ONCE)
        .try_collect()
        .await?;
    Ok(days.into_iter().flatten().collect())
}

/// The objects of a local archive's day folder `folder/ymd` (`YYYY/MM/DD`;
/// `day` as the store names it) holding a seq from `from_seq` on. It is
/// read directly: a key says its seqs, so only the objects kept are looked
/// at for their size and time. The store's listing looks at every file
/// three times (`statx`), and a query lists two days of objects that are
/// nearly all compacted already: at the benchmark's 210 objects, 1.2 ms of
/// a 7 ms query process (`scripts/bench-query.sh`'s archive at SCALE 1).
/// Files the store would not list as objects (temporary ones, names that
/// are not UTF-8) are not archive keys either.
fn folder_day(
    folder: &std::path::Path,
    ymd: &str,
    day: &str,
    pipeline: &str,
    from_seq: u64,
) -> Result<Vec<Listed>> {
    let dir = folder.join(ymd);
    let cannot = |e| {
        Error::io(
            format!("cannot list the archive folder {}", dir.display()),
            e,
        )
    };
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(cannot(e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(cannot)?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some((date, first_seq, last_seq)) = parse_key(&format!("{ymd}/{name}"), pipeline)
        else {
            continue;
        };
        if last_seq < from_seq {
            continue;
        }
        // Followed as the store follows links; one gone meanwhile is not listed.
        let meta = match std::fs::metadata(entry.path()) {
            Ok(meta) if meta.is_file() => meta,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(cannot(e)),
        };
        out.push(Listed {
            key: format!("{day}/{name}"),
            date,
            first_seq,
            last_seq,
            size: meta.len(),
            written: meta.modified().map_err(cannot)?.into(),
        });
    }
    Ok(out)
}

/// Every archive object of `pipeline`, by first seq.
pub(crate) async fn list_objects(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    pipeline: &str,
) -> Result<Vec<ArchiveObject>> {
    let mut out: Vec<ArchiveObject> = list_archive(store, prefix, pipeline, None, None)
        .await?
        .into_iter()
        .map(|o| ArchiveObject {
            key: o.key,
            date: o.date,
            first_seq: o.first_seq,
            last_seq: o.last_seq,
            size: o.size,
        })
        .collect();
    out.sort_by(|a, b| (a.first_seq, a.last_seq, &a.key).cmp(&(b.first_seq, b.last_seq, &b.key)));
    Ok(out)
}

/// Every schema record under `[prefix/]_schemas/`, by table name.
pub(crate) async fn load_schemas(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
) -> Result<BTreeMap<String, Vec<SchemaRecord>>> {
    Ok(read_schemas(store, prefix, &SchemaObjects::default())
        .await?
        .by_table())
}

/// The schema records as read, by object key, each with the size and
/// entity tag of the object it was read from: a later snapshot lists the
/// records again but reads only the objects it does not have (records are
/// written once, under a name of their own; one whose size or tag differs
/// is read again).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SchemaObjects(BTreeMap<String, ReadRecord>);

/// A schema record and the size and entity tag of the object it was read from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ReadRecord {
    size: u64,
    e_tag: Option<String>,
    record: SchemaRecord,
}

impl SchemaObjects {
    /// The records by table.
    pub(crate) fn by_table(&self) -> BTreeMap<String, Vec<SchemaRecord>> {
        let mut out: BTreeMap<String, Vec<SchemaRecord>> = BTreeMap::new();
        for read in self.0.values() {
            out.entry(read.record.table.clone())
                .or_default()
                .push(read.record.clone());
        }
        out
    }
}

/// Lists the schema records and reads those `known` does not hold as they
/// are now (see [`SchemaObjects`]).
pub(crate) async fn read_schemas(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    known: &SchemaObjects,
) -> Result<SchemaObjects> {
    let root = ObjectPath::from(under(prefix, "_schemas"));
    let metas: Vec<ObjectMeta> = store
        .list(Some(&root))
        .try_collect()
        .await
        .map_err(|e| Error::store("LIST", root.to_string(), e))?;
    // An archive of many tables has a record per table and version.
    let records: Vec<(String, ReadRecord)> = futures::stream::iter(
        metas
            .into_iter()
            .filter(|m| m.location.as_ref().ends_with(".json")),
    )
    .map(|meta| async move {
        let key = meta.location.to_string();
        if let Some(read) = known.0.get(&key)
            && read.size == meta.size
            && read.e_tag == meta.e_tag
        {
            return Ok::<_, Error>((key, read.clone()));
        }
        let body = get(store, &meta.location).await?;
        let record: SchemaRecord = serde_json::from_slice(&body).map_err(|e| {
            Error::fatal(
                format!("schema record {} is not valid: {e}", meta.location),
                "schema records are written by `waltail run`; restore this object from a backup or a copy",
            )
            .with_kind(ErrorKind::Archive)
        })?;
        let read = ReadRecord {
            size: meta.size,
            e_tag: meta.e_tag,
            record,
        };
        Ok((key, read))
    })
    .buffered(REQUESTS_AT_ONCE)
    .try_collect()
    .await?;
    Ok(SchemaObjects(records.into_iter().collect()))
}

/// Reads a whole object.
///
/// The client's own retries (see `compact::store_retry`) leave out some
/// transport errors (a connection reset while a request is sent is of an
/// "unknown" kind to it), and a body cut off mid-read is retried only with
/// what is left of the first request's budget: so a GET whose error is
/// transient is started again here, for the same 2 minutes, waiting from
/// 100 ms to 5 s between tries.
pub(crate) async fn get(store: &dyn ObjectStore, path: &ObjectPath) -> Result<bytes::Bytes> {
    retrying(|| async {
        store
            .get(path)
            .await
            .map_err(|e| Error::store("GET", path.to_string(), e))?
            .bytes()
            .await
            .map_err(|e| Error::store("GET", path.to_string(), e))
    })
    .await
}

/// Reads a whole archive object's NDJSON: [`get`], then decoded by its
/// key's codec (`.ndjson.gz`, `.ndjson.zst`; see [`Codec`]) on the blocking
/// pool, since an object of megabytes takes milliseconds to inflate.
pub(crate) async fn get_ndjson(store: &dyn ObjectStore, key: &str) -> Result<bytes::Bytes> {
    let body = get(store, &ObjectPath::from(key)).await?;
    if Codec::of_key(key).0 == Codec::None {
        return Ok(body);
    }
    let key = key.to_string();
    tokio::task::spawn_blocking(move || Codec::decode(&key, body))
        .await
        .map_err(|e| Error::bug(format!("decoding an archive object stopped: {e}")))?
}

/// Writes a whole object, started again on a transient error as [`get`] is
/// (a PUT of the same bytes to the same key is idempotent).
pub(crate) async fn put(
    store: &dyn ObjectStore,
    path: &ObjectPath,
    body: bytes::Bytes,
) -> Result<()> {
    retrying(|| async {
        store
            .put(path, body.clone().into())
            .await
            .map(drop)
            .map_err(|e| Error::store("PUT", path.to_string(), e))
    })
    .await
}

/// Runs `attempt` until it succeeds, its error is not transient, or
/// [`GET_RETRY_FOR`] has passed, waiting from 100 ms to 5 s between tries.
pub(crate) async fn retrying<T, F: std::future::Future<Output = Result<T>>>(
    attempt: impl FnMut() -> F,
) -> Result<T> {
    crate::backoff::retry_transient(
        GET_RETRY_FOR,
        |e: &Error| e.disposition() == Disposition::Retry && !local_disk(e),
        attempt,
    )
    .await
}

/// An error of the local folder store (a disk's, not a network's): not
/// worth waiting for.
fn local_disk(e: &Error) -> bool {
    matches!(e, Error::Store { cause, .. }
        if matches!(cause.as_ref(), object_store::Error::Generic { store: "LocalFileSystem", .. }))
}

/// How long a GET or PUT of a whole object is tried again (see [`get`]).
pub(crate) const GET_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(120);

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use object_store::PutPayload;

    use super::*;

    /// Schema records already read are taken from `known` while their
    /// object's size and tag are the same; a new or rewritten record is
    /// read, a deleted one is gone.
    #[tokio::test]
    async fn schema_records_already_read_are_not_read_again() {
        let store = object_store::memory::InMemory::new();
        let record = |table: &str, version: u32| {
            serde_json::json!({"table": table, "version": version, "columns": [], "replica_identity": "default"})
                .to_string()
        };
        let put = |key: &str, body: String| {
            let key = ObjectPath::from(key);
            let store = &store;
            async move { store.put(&key, PutPayload::from(body)).await.unwrap() }
        };
        put("_schemas/public.a/1.json", record("public.a", 1)).await;
        put("_schemas/public.b/1.json", record("public.b", 1)).await;
        let first = read_schemas(&store, None, &SchemaObjects::default())
            .await
            .unwrap();
        assert_eq!(first.by_table().len(), 2);
        // What `known` holds for an unchanged object is what comes back:
        // here a version the object does not say, so a GET would show.
        let mut known = first.clone();
        known
            .0
            .get_mut("_schemas/public.a/1.json")
            .unwrap()
            .record
            .version = 9;
        let again = read_schemas(&store, None, &known).await.unwrap();
        assert_eq!(again.by_table()["public.a"][0].version, 9, "not read again");
        // Rewritten, added, deleted.
        put("_schemas/public.a/1.json", record("public.a", 1)).await;
        put("_schemas/public.c/1.json", record("public.c", 1)).await;
        store
            .delete(&ObjectPath::from("_schemas/public.b/1.json"))
            .await
            .unwrap();
        let now = read_schemas(&store, None, &known).await.unwrap().by_table();
        assert_eq!(now["public.a"][0].version, 1, "a rewritten object is read");
        assert_eq!(now.keys().collect::<Vec<_>>(), ["public.a", "public.c"]);
    }

    /// Lists only from the day before the resume date, and of those days
    /// only the objects holding a seq from the resume seq on, in memory, in
    /// a local folder through the store and in a local folder read
    /// directly; everything when the object holding the resume seq is not
    /// in those days while later ones are.
    #[tokio::test]
    async fn a_resumed_listing_reads_the_recent_days_and_falls_back_on_a_gap() {
        let dir = tempfile::tempdir().unwrap();
        let stores: Vec<Arc<dyn ObjectStore>> = vec![
            Arc::new(object_store::memory::InMemory::new()),
            Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap()),
        ];
        let keys = [
            "p/2025/12/31/w-1-10.ndjson",
            "p/2026/01/01/w-11-20.ndjson",
            "p/2026/11/28/w-21-30.ndjson",
            "p/2026/11/29/w-31-40.ndjson",
            "p/2026/11/30/w-41-50.ndjson",
            "p/2026/11/30/other-1-5.ndjson",
            "p/2027/01/01/w-51-60.ndjson",
            "p/parquet/public/t/date=2026-11-30/1-40.parquet",
            "p/latest/public/t/1-0-0.parquet",
            "p/_waltail/compaction/manifest.json",
        ];
        let folder = dir.path().join("p");
        let cases = [
            (&stores[0], None),
            (&stores[1], None),
            (&stores[1], Some(folder)),
        ];
        for (store, folder) in cases {
            for key in keys {
                store
                    .put(&ObjectPath::from(key), PutPayload::from_static(b"{}"))
                    .await
                    .unwrap();
            }
            let firsts = |mut v: Vec<Listed>| {
                v.sort_by_key(|o| o.first_seq);
                v.iter().map(|o| o.first_seq).collect::<Vec<_>>()
            };
            let list = |from: Option<Resume>| {
                let store = Arc::clone(store);
                let folder = folder.clone();
                async move {
                    let listed = list_archive(
                        store.as_ref(),
                        Some("p"),
                        "w",
                        from.as_ref(),
                        folder.as_deref(),
                    )
                    .await
                    .unwrap();
                    for o in &listed {
                        assert_eq!(o.size, 2, "{}", o.key);
                        assert!(o.key.starts_with("p/") && o.key.ends_with(".ndjson"));
                    }
                    firsts(listed)
                }
            };
            let resume = |seq: u64, date: &str| {
                Some(Resume {
                    seq,
                    date: date.into(),
                })
            };
            assert_eq!(list(None).await, [1, 11, 21, 31, 41, 51]);
            assert_eq!(list(resume(41, "2026-11-30")).await, [41, 51]);
            assert_eq!(list(resume(35, "2026-11-29")).await, [31, 41, 51]);
            // Across a year's end: the day before 2026-01-01.
            assert_eq!(list(resume(15, "2026-01-01")).await, [11, 21, 31, 41, 51]);
            // Nothing new since: the recent days suffice, and hold nothing.
            assert_eq!(list(resume(61, "2027-01-01")).await, Vec::<u64>::new());
            // Seq 15 is dated far earlier than the resume date says: all.
            assert_eq!(
                list(resume(15, "2026-11-30")).await,
                [1, 11, 21, 31, 41, 51]
            );
        }
    }
}
