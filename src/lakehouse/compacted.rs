//! What is compacted of each source table, read from its two Delta logs
//! (see [`super::delta`]): where the next run starts, the columns as
//! written, the latest view's files and buckets, the history's files. The
//! logs are the only record; this is their reading for a run and a query.

use std::collections::BTreeMap;

use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};

use super::delta::{self, DataFile, Location, Published, Role};
use super::layout::table_dir;
use super::typing::{Column, TableShape};
use crate::archive::listing::Resume;
use crate::{Error, Result};

/// What to do when a file a table's log lists cannot be read.
pub(crate) const UNREADABLE_FIX: &str = "the files a table's Delta log lists must stay in the store: restore them (from the store's versioning or a backup), or delete the table's folders under parquet/ and latest/ to compact it again from the archive";

/// One compacted table, as a run or a query needs it. A query keeps it
/// between statements and, in the state folder, between processes (see
/// `query::known`), for as long as [`logs_moved`] says its logs have not.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct TableEntry {
    /// Every change of the table with a lower seq is compacted.
    pub next_seq: u64,
    /// The date folder (`YYYY-MM-DD`) of the last object compacted, so
    /// that readers list only the date folders from there on (see
    /// [`crate::archive::listing::list_archive`]).
    pub next_date: Option<String>,
    /// The columns as written, in order, with their types: a later run
    /// checks that its types widen these.
    pub columns: Vec<Column>,
    /// The latest view's files (keys under the prefix): the snapshot's.
    pub latest: Vec<String>,
    /// Rows in the latest view.
    pub latest_rows: u64,
    /// Buckets the latest view is split into by key hash (a power of two;
    /// 0 before the first run, meaning 1). Only grows, so a later run finds
    /// each bucket's previous rows in one bucket's files.
    pub buckets: u32,
    /// Changes in the history.
    pub history_rows: u64,
    /// The history's files (keys under the prefix) below `next_seq`.
    pub history: Vec<String>,
    /// The size in bytes of each file of `latest` and `history`, by key, as
    /// the Delta log records it: a query answers a file's metadata from it
    /// instead of asking the store (a HEAD a file on S3). Missing in the
    /// entries an earlier build kept for the next query, which a query then
    /// reads afresh (see `query::known`).
    #[serde(default)]
    pub sizes: BTreeMap<String, u64>,
    /// The commits read, of the history and of the latest view (`None`:
    /// no log yet), so a reader can tell whether a log has moved on since
    /// (see [`logs_moved`]).
    pub logs: [Option<LogMark>; 2],
    /// Whether the table had a key when this was read: which log's seq is
    /// the next seq depends on it (see [`Compacted::next_seq`]).
    pub keyed: bool,
}

/// The commit a Delta log was read at: its version and, once looked up
/// (see [`mark_logs`]), the commit file's size and entity tag, which tell
/// that file from one of the same version written since (a table's
/// folders deleted and compacted again).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LogMark {
    pub version: u64,
    pub size: Option<u64>,
    pub e_tag: Option<String>,
}

impl TableEntry {
    /// The latest view's bucket count (at least 1).
    pub(crate) fn bucket_count(&self) -> u32 {
        self.buckets.max(1)
    }
}

/// A source table's history and latest view, as committed.
#[derive(Debug, Default)]
pub(crate) struct Compacted {
    pub history: Option<Published>,
    pub latest: Option<Published>,
    /// The date folder of the last object compacted (see [`date_app_id`]).
    pub next_date: Option<String>,
}

/// The app id of the txn that records, beside the seq, the date folder
/// (`YYYYMMDD` as its version) of the last object a run compacted: a query
/// lists the archive from there (see `listing::Resume`). In the same commit
/// as the seq, so the two never disagree.
pub(crate) fn date_app_id(app_id: &str) -> String {
    format!("{app_id}:date")
}

/// The date txn of a commit whose last object is in the folder `date`
/// (none when that is unknown), beside the seq's (see [`date_app_id`]).
pub(crate) fn date_txns(app_id: &str, date: Option<&str>) -> Vec<(String, i64)> {
    date.and_then(date_number)
        .map(|d| vec![(date_app_id(app_id), d)])
        .unwrap_or_default()
}

/// `YYYY-MM-DD` as the number `YYYYMMDD`, and back.
pub(crate) fn date_number(date: &str) -> Option<i64> {
    let digits: String = date.chars().filter(char::is_ascii_digit).collect();
    (digits.len() == 8).then(|| digits.parse().ok()).flatten()
}

fn number_date(n: i64) -> String {
    format!("{:04}-{:02}-{:02}", n / 10_000, n / 100 % 100, n % 100)
}

/// The folder of a table under `parquet/` or `latest/`: `<schema>/<table>`.
pub(crate) fn table_folder(shape: &TableShape) -> String {
    let root = table_dir(None, "", shape);
    root.trim_start_matches('/').to_string()
}

impl Compacted {
    /// Reads both logs of `shape`'s table.
    pub(crate) async fn load(
        loc: &Location,
        pipeline: &str,
        shape: &TableShape,
    ) -> Result<Compacted> {
        let app = delta::app_id(pipeline, &shape.table);
        let dir = table_folder(shape);
        let (history, latest) = tokio::try_join!(
            delta::load(loc, Role::History, &dir, &app),
            delta::load(loc, Role::Latest, &dir, &app)
        )?;
        let next_date = match &history {
            Some(h) => h.app_version(&date_app_id(&app)).await?.map(number_date),
            None => None,
        };
        Ok(Compacted {
            history,
            latest,
            next_date,
        })
    }

    /// Every change of the table with a lower seq is in its latest view
    /// (its history when it has no key), so a run starts there: the latest
    /// view is committed after the history, and a run stopped between the
    /// two is redone from the latest view's seq (see `compact::commit::commit_run`).
    pub(crate) fn next_seq(&self, keyed: bool) -> Option<u64> {
        let done = if keyed {
            self.latest.as_ref()?.seq?
        } else {
            self.history.as_ref()?.seq?
        };
        Some(done + 1)
    }

    /// Whether the run commits the history: its log is missing or behind
    /// `to_seq` (a run stopped between its two commits committed the
    /// history already; the next commits only the latest view).
    pub(crate) fn history_behind(&self, to_seq: u64) -> bool {
        let done = self.history.as_ref().and_then(|h| h.seq).unwrap_or(0);
        self.history.is_none() || done < to_seq
    }

    /// The history files of a run that stopped before its latest commit:
    /// files from seq `start` on, whose changes this run compacts again.
    /// Its history commit replaces them.
    pub(crate) fn stopped_run_files(&self, start: u64) -> Vec<String> {
        match &self.history {
            Some(h) if h.seq.is_some_and(|s| s >= start) => h
                .files
                .iter()
                .filter(|f| history_first_seq(&f.path).is_some_and(|s| s >= start))
                .map(|f| f.path.clone())
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The table as a run or query needs it, keys under `prefix`.
    pub(crate) fn entry(&self, shape: &TableShape, prefix: Option<&str>) -> TableEntry {
        let keyed = !shape.key.is_empty();
        let next_seq = self.next_seq(keyed).unwrap_or(0);
        // Files a run stopped between its two commits left in the history
        // are read from the NDJSON again until the next run replaces them
        // (see `compact::commit::commit_run`).
        let history: Vec<&DataFile> = self
            .history
            .iter()
            .flat_map(|h| &h.files)
            .filter(|f| history_first_seq(&f.path).is_none_or(|first| first < next_seq))
            .collect();
        let latest: Vec<&DataFile> = self.latest.iter().flat_map(|l| &l.files).collect();
        // Each file's key under the prefix, and its size.
        let keyed_files = |role: Role, files: Vec<&DataFile>| -> Vec<(String, u64)> {
            let dir = table_dir(prefix, role.root(), shape);
            files
                .into_iter()
                .map(|f| (format!("{dir}/{}", f.path), f.size))
                .collect()
        };
        let history = keyed_files(Role::History, history);
        let latest = keyed_files(Role::Latest, latest);
        TableEntry {
            next_seq,
            next_date: self.next_date.clone(),
            columns: self
                .history
                .as_ref()
                .map(|h| h.columns.clone())
                .unwrap_or_default(),
            sizes: history.iter().chain(&latest).cloned().collect(),
            latest: latest.into_iter().map(|(key, _)| key).collect(),
            latest_rows: self.latest.as_ref().map_or(0, Published::rows),
            buckets: self.latest.as_ref().map_or(0, |l| l.buckets),
            history_rows: self.history.as_ref().map_or(0, Published::rows),
            history: history.into_iter().map(|(key, _)| key).collect(),
            logs: [&self.history, &self.latest].map(|p| {
                p.as_ref().map(|p| LogMark {
                    version: p.version,
                    ..LogMark::default()
                })
            }),
            keyed,
        }
    }
}

/// Whether either log of `entry`'s table has moved on since it was read:
/// a commit after the one read exists, or the one read is gone or is
/// another file (see [`LogMark`]). Delta versions follow each other
/// without gaps, so the next version's commit file either exists or no
/// commit came since: one or two HEADs per log instead of reading it.
pub(crate) async fn logs_moved(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    shape: &TableShape,
    entry: &TableEntry,
) -> Result<bool> {
    let checks = [Role::History, Role::Latest]
        .into_iter()
        .zip(&entry.logs)
        .flat_map(|(role, mark)| {
            let next = mark.as_ref().map_or(0, |m| m.version + 1);
            let read = mark
                .as_ref()
                .filter(|m| m.is_whole())
                .map(|m| (commit_key(prefix, role, shape, m.version), m));
            [(commit_key(prefix, role, shape, next), None)]
                .into_iter()
                .chain(read.map(|(key, m)| (key, Some(m))))
        })
        .map(|(key, read)| async move {
            match (store.head(&key).await, read) {
                // The next commit: moved when it exists.
                (Ok(_), None) => Ok(true),
                (Err(object_store::Error::NotFound { .. }), None) => Ok(false),
                // The commit read: moved when it is gone or another file.
                (Ok(meta), Some(m)) => Ok(Some(meta.size) != m.size || meta.e_tag != m.e_tag),
                (Err(object_store::Error::NotFound { .. }), Some(_)) => Ok(true),
                (Err(e), _) => Err(Error::store("HEAD", key.to_string(), e)),
            }
        });
    let moved = futures::future::try_join_all(checks).await?;
    Ok(moved.into_iter().any(|m| m))
}

/// Looks up the size and entity tag of the commits `entry` was read at
/// (see [`LogMark`]). A commit file not found leaves its mark without
/// them, and [`LogMark::is_whole`] false.
pub(crate) async fn mark_logs(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    shape: &TableShape,
    entry: &mut TableEntry,
) -> Result<()> {
    let heads = [Role::History, Role::Latest]
        .into_iter()
        .zip(&mut entry.logs)
        .filter_map(|(role, mark)| mark.as_mut().map(|m| (role, m)))
        .map(|(role, mark)| async move {
            let key = commit_key(prefix, role, shape, mark.version);
            match store.head(&key).await {
                Ok(meta) => {
                    mark.size = Some(meta.size);
                    mark.e_tag = meta.e_tag;
                    Ok(())
                }
                Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(Error::store("HEAD", key.to_string(), e)),
            }
        });
    futures::future::try_join_all(heads).await?;
    Ok(())
}

impl LogMark {
    /// Whether the commit file's size was looked up (see [`mark_logs`]).
    pub(crate) fn is_whole(&self) -> bool {
        self.size.is_some()
    }
}

/// The commit file of `version` in a log of `shape`'s table.
fn commit_key(prefix: Option<&str>, role: Role, shape: &TableShape, version: u64) -> ObjectPath {
    ObjectPath::from(format!(
        "{}/_delta_log/{version:020}.json",
        table_dir(prefix, role.root(), shape)
    ))
}

/// Where the NDJSON after every one of `tables` continues, if their Delta
/// logs know it for each: the lowest `next_seq`, with the earliest date
/// (see [`crate::archive::listing::list_archive`]).
pub(crate) fn resume_for<'a>(
    compacted: &BTreeMap<String, TableEntry>,
    tables: impl IntoIterator<Item = &'a String>,
) -> Option<Resume> {
    let mut out: Option<Resume> = None;
    for table in tables {
        let entry = compacted.get(table)?;
        let date = entry.next_date.clone()?;
        out = Some(match out {
            None => Resume {
                seq: entry.next_seq,
                date,
            },
            Some(r) => Resume {
                seq: r.seq.min(entry.next_seq),
                date: r.date.min(date),
            },
        });
    }
    out
}

/// The first seq a history file holds, from its name
/// (`<first>-<last>[-<run>].parquet`).
pub(crate) fn history_first_seq(path: &str) -> Option<u64> {
    history_seqs(path).map(|(first, _)| first)
}

/// The first and last seq a history file holds, from its name
/// (`<first>-<last>[-<run>].parquet`).
pub(crate) fn history_seqs(path: &str) -> Option<(u64, u64)> {
    let name = path.rsplit('/').next()?.strip_suffix(".parquet")?;
    let mut parts = name.split('-');
    let first = parts.next()?.parse().ok()?;
    let last = parts.next()?.parse().ok()?;
    Some((first, last))
}

/// Every table of `shapes` that has been compacted, as [`Compacted::entry`]
/// gives it.
pub(crate) async fn entries<'a>(
    loc: &Location,
    pipeline: &str,
    prefix: Option<&str>,
    shapes: impl IntoIterator<Item = &'a TableShape>,
) -> Result<BTreeMap<String, TableEntry>> {
    let loads = shapes.into_iter().map(|shape| async move {
        let c = Compacted::load(loc, pipeline, shape).await?;
        Ok::<_, crate::Error>((shape, c))
    });
    let loaded = futures::future::try_join_all(loads).await?;
    Ok(loaded
        .into_iter()
        .filter(|(_, c)| c.history.is_some() || c.latest.is_some())
        .map(|(shape, c)| (shape.table.clone(), c.entry(shape, prefix)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip_through_txn_versions() {
        assert_eq!(date_number("2026-12-02"), Some(20261202));
        assert_eq!(number_date(20261202), "2026-12-02");
        assert_eq!(date_number("2026-1-2"), None);
        assert_eq!(
            history_first_seq("date=2026-12-02/15-90-ab12cd34.parquet"),
            Some(15)
        );
        assert_eq!(history_first_seq("date=2026-12-02/15-90.parquet"), Some(15));
        assert_eq!(
            history_seqs("parquet/public/t/date=2026-12-02/15-90-ab12cd34.parquet"),
            Some((15, 90))
        );
        assert_eq!(history_seqs("date=2026-12-02/part-0.parquet"), None);
        assert_eq!(table_folder(&TableShape::test_t()), "public/t");
    }
}
