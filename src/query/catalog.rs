//! What a query can see: one snapshot of the archive taken when the query
//! starts (its NDJSON objects, the tables' Delta snapshots, their shapes),
//! and the point `--at` puts it at.
//!
//! A snapshot is consistent with itself: the compacted files are the ones
//! the Delta snapshots list (for the history, those below the next seq the
//! latest view's log records),
//! and the NDJSON read over them starts at that same `next_seq`, so a change
//! is in exactly one of the two even while a compaction runs.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::archive::listing::{self, Resume, SchemaObjects};
use crate::lakehouse::compacted;
use crate::lakehouse::compacted::TableEntry;
use crate::lakehouse::delta::Location;
use crate::lakehouse::typing::TableShape;
use crate::{Error, Result};

/// One NDJSON object of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Object {
    pub key: String,
    /// `YYYY-MM-DD` from the key: the UTC commit date of its first change.
    pub date: String,
    pub first_seq: u64,
    pub last_seq: u64,
    /// The seqs of the object below this one are in an earlier object
    /// (the same batch written twice under different names): skipped.
    pub from_seq: u64,
    pub written: DateTime<Utc>,
}

/// Where `--at` puts the query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum At {
    Seq(u64),
    Time(DateTime<Utc>),
}

impl std::str::FromStr for At {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<At, String> {
        if let Ok(seq) = s.parse::<u64>() {
            // Seqs are stored as BIGINT: a larger one can name nothing.
            if seq > i64::MAX as u64 {
                return Err(format!(
                    "seq {s} is larger than any seq can be ({})",
                    i64::MAX
                ));
            }
            return Ok(At::Seq(seq));
        }
        DateTime::parse_from_rfc3339(s)
            .map(|t| At::Time(t.with_timezone(&Utc)))
            .map_err(|_| {
                format!("{s:?} is neither a seq (a number) nor an RFC 3339 time such as 2026-11-30T08:00:00Z")
            })
    }
}

/// What an earlier snapshot of the same archive read, for a new one to
/// keep what has not changed since (see [`Archive::load`]).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Previous<'a> {
    /// Each compacted table's entry.
    pub entries: Option<&'a BTreeMap<String, TableEntry>>,
    /// The schema records.
    pub schemas: Option<&'a SchemaObjects>,
    /// The tables' shapes (the prompt's last statement's): with them the
    /// checks of the schema records, of the logs and the listing run at
    /// once, and what the latter two found stands if the shapes are the
    /// same and no log moved.
    pub shapes: Option<&'a BTreeMap<String, Arc<TableShape>>>,
}

/// The tables' shapes the schema records give, by `schema.table`.
pub(crate) fn shapes(schemas: &SchemaObjects) -> BTreeMap<String, Arc<TableShape>> {
    schemas
        .by_table()
        .iter()
        .map(|(table, records)| {
            (
                table.clone(),
                Arc::new(TableShape::from_records(table, records)),
            )
        })
        .collect()
}

/// The archive as one query sees it.
#[derive(Debug)]
pub(crate) struct Archive {
    pub store: Arc<dyn ObjectStore>,
    pub prefix: Option<String>,
    /// Each compacted table as its Delta logs have it (see
    /// [`compacted::entries`]): one snapshot per log, read once.
    pub compacted: BTreeMap<String, TableEntry>,
    /// Every table with a schema record, by `schema.table`.
    pub shapes: BTreeMap<String, Arc<TableShape>>,
    /// The schema records the shapes were built from, as read.
    pub schema_objects: SchemaObjects,
    /// Every NDJSON object, once listed (see [`Archive::every_object`]).
    every: tokio::sync::OnceCell<Arc<Vec<Object>>>,
    pipeline: String,
    /// The NDJSON objects by first seq, repeats left out: those from the
    /// date folder where compaction stopped (see
    /// [`listing::list_archive`]), enough for every table's tail.
    pub objects: Vec<Object>,
    /// The last seq a query sees (`--at`); `None`: everything.
    pub max_seq: Option<u64>,
}

impl Archive {
    /// Takes a snapshot of the archive, placed at `at`. With `previous`,
    /// what an earlier snapshot of the same archive read (the prompt's last
    /// statement's, or the last query's entries, see [`super::known`]): a
    /// table that had an entry for the same key and whose Delta logs have
    /// not moved on keeps it (see [`compacted::logs_moved`]) rather than
    /// reading its logs again, and schema records already read are not
    /// read again (see [`SchemaObjects`]).
    pub(crate) async fn load(
        store: Arc<dyn ObjectStore>,
        loc: &Location,
        prefix: Option<&str>,
        pipeline: &str,
        at: Option<&At>,
        previous: &Previous<'_>,
    ) -> Result<Archive> {
        let started = std::time::Instant::now();
        let folder = loc.folder();
        let no_schemas = SchemaObjects::default();
        let unchanged = match (previous.shapes, previous.entries) {
            (Some(shapes), Some(entries)) => Some((shapes, entries)),
            _ => None,
        };
        // The prompt's case: the logs checked and the NDJSON listed as the
        // last statement's snapshot had them, while the schema records are.
        let (schema_objects, logs_kept, early_objects) = tokio::try_join!(
            listing::read_schemas(
                store.as_ref(),
                prefix,
                previous.schemas.unwrap_or(&no_schemas),
            ),
            async {
                match unchanged {
                    Some((shapes, entries)) => {
                        all_kept(store.as_ref(), prefix, shapes, entries).await
                    }
                    None => Ok(false),
                }
            },
            async {
                match unchanged {
                    Some((shapes, entries)) => {
                        let resume = resume_at(at, entries, shapes.keys());
                        list(
                            store.as_ref(),
                            prefix,
                            pipeline,
                            resume.as_ref(),
                            folder.as_deref(),
                        )
                        .await
                        .map(Some)
                    }
                    None => Ok(None),
                }
            },
        )?;
        let read_schemas = started.elapsed();
        let shapes = shapes(&schema_objects);
        let early = logs_kept && unchanged.is_some_and(|(last, _)| *last == shapes);
        let (compacted, logs_read, objects) = match (unchanged, early_objects) {
            (Some((_, entries)), Some(objects)) if early => (entries.clone(), 0, objects),
            _ => {
                // The logs are read after the schema records: a table's
                // compacted columns are among the records the run read.
                let (compacted, logs_read) = compacted_since(
                    store.as_ref(),
                    loc,
                    pipeline,
                    prefix,
                    &shapes,
                    previous.entries.unwrap_or(&BTreeMap::new()),
                )
                .await?;
                let resume = resume_at(at, &compacted, shapes.keys());
                let objects = list(
                    store.as_ref(),
                    prefix,
                    pipeline,
                    resume.as_ref(),
                    folder.as_deref(),
                )
                .await?;
                (compacted, logs_read, objects)
            }
        };
        let resume = resume_at(at, &compacted, shapes.keys());
        let read_logs = started.elapsed();
        tracing::debug!(
            schemas_ms = read_schemas.as_secs_f64() * 1e3,
            logs_and_listing_ms = (read_logs - read_schemas).as_secs_f64() * 1e3,
            logs_read,
            early,
            objects = objects.len(),
            "snapshot of the archive taken"
        );
        let every = tokio::sync::OnceCell::new();
        if resume.is_none() {
            let _ = every.set(Arc::new(objects.clone()));
        }
        let max_seq = match at {
            None => None,
            Some(At::Seq(n)) => Some(*n),
            Some(At::Time(t)) => Some(seq_at_time(&objects, *t)),
        };
        Ok(Archive {
            store,
            prefix: prefix.map(str::to_string),
            compacted,
            shapes,
            schema_objects,
            objects,
            every,
            pipeline: pipeline.to_string(),
            max_seq,
        })
    }

    /// Whether `other` sees the same archive: the same tables and shapes,
    /// compacted files and objects, at the same point. (Objects and
    /// compacted files are never rewritten under their names.)
    pub(crate) fn same_snapshot(&self, other: &Archive) -> bool {
        self.prefix == other.prefix
            && self.max_seq == other.max_seq
            && self.shapes == other.shapes
            && self.compacted == other.compacted
            && self.objects == other.objects
    }

    /// Every NDJSON object, compacted or not (`waltail.changes`): listed
    /// when first needed if the snapshot listed only the recent ones.
    pub(crate) async fn every_object(&self) -> Result<Arc<Vec<Object>>> {
        self.every
            .get_or_try_init(|| async {
                list(
                    self.store.as_ref(),
                    self.prefix.as_deref(),
                    &self.pipeline,
                    None,
                    None,
                )
                .await
                .map(Arc::new)
            })
            .await
            .cloned()
    }

    /// The last seq of the snapshot: of its newest object, or compacted.
    pub(crate) fn end_seq(&self) -> u64 {
        let listed = self.objects.iter().map(|o| o.last_seq).max().unwrap_or(0);
        let compacted = self
            .compacted
            .values()
            .map(|e| e.next_seq.saturating_sub(1))
            .max()
            .unwrap_or(0);
        listed.max(compacted)
    }

    /// The first seq of `table` not in its compacted files (0: none are).
    pub(crate) fn next_seq(&self, table: &str) -> u64 {
        self.compacted.get(table).map_or(0, |e| e.next_seq)
    }

    /// The seq `--at` places the latest view of `table` at, when that is
    /// before its compacted view (which is then rebuilt from the history).
    pub(crate) fn rebuilds_latest(&self, table: &str) -> Option<u64> {
        let next = self.next_seq(table);
        self.max_seq
            .filter(|&n| next > 0 && n.saturating_add(1) < next)
    }

    /// The compacted latest-view files of `table`, keys in the store.
    pub(crate) fn latest_files(&self, table: &str) -> &[String] {
        self.compacted
            .get(table)
            .map(|e| e.latest.as_slice())
            .unwrap_or_default()
    }

    /// The compacted history files of `table` below its `next_seq`, keys
    /// in the store.
    pub(crate) fn history_files(&self, table: &str) -> &[String] {
        self.compacted
            .get(table)
            .map(|e| e.history.as_slice())
            .unwrap_or_default()
    }

    /// After a statement failed: whether files of this snapshot are gone,
    /// which a vacuum past `compact.retain` does (replaced files stay that
    /// long, so a query shorter than the retention never sees it); if so,
    /// an error that says so and to run the query again.
    pub(crate) async fn verify_unchanged(&self) -> Result<()> {
        for entry in self.compacted.values() {
            for file in entry.latest.iter().chain(&entry.history) {
                if let Err(object_store::Error::NotFound { .. }) =
                    self.store.head(&ObjectPath::from(file.as_str())).await
                {
                    return Err(Error::fatal(
                        format!(
                            "`waltail compact` vacuumed files of the snapshot this query read ({file} is gone), so the answer may lack compacted rows"
                        ),
                        "run the query again; keep compact.retain longer than your queries take",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The compacted tables as [`compacted::entries`] reads them, each with
/// its commits looked up (see [`compacted::mark_logs`]), but keeping
/// `previous`'s entry of each table whose key is the same and whose logs
/// have not moved on; with the number of tables whose logs were read. A
/// table `previous` has no entry for is read: a HEAD of its first commit
/// could not tell a table never compacted from one whose early commits
/// the log's clean-up removed.
async fn compacted_since(
    store: &dyn ObjectStore,
    loc: &Location,
    pipeline: &str,
    prefix: Option<&str>,
    shapes: &BTreeMap<String, Arc<TableShape>>,
    previous: &BTreeMap<String, TableEntry>,
) -> Result<(BTreeMap<String, TableEntry>, usize)> {
    let checks = shapes.values().map(|shape| async move {
        let before = previous.get(&shape.table);
        let kept = stands(store, prefix, shape, before).await?;
        Ok::<_, Error>((shape, before.filter(|_| kept).cloned()))
    });
    let checked = futures::future::try_join_all(checks).await?;
    let read: Vec<&TableShape> = checked
        .iter()
        .filter(|c| c.1.is_none())
        .map(|c| c.0.as_ref())
        .collect();
    let logs_read = read.len();
    let mut entries = compacted::entries(loc, pipeline, prefix, read).await?;
    let marks = entries.iter_mut().map(|(table, entry)| {
        let shape = &shapes[table];
        compacted::mark_logs(store, prefix, shape, entry)
    });
    futures::future::try_join_all(marks).await?;
    for (shape, kept) in checked {
        if let Some(entry) = kept {
            entries.insert(shape.table.clone(), entry);
        }
    }
    Ok((entries, logs_read))
}

/// Where the listing of the NDJSON starts: every object for a time (it is
/// placed among every object's write time), else where compaction stopped
/// for the tables' tails.
fn resume_at<'a>(
    at: Option<&At>,
    compacted: &BTreeMap<String, TableEntry>,
    tables: impl IntoIterator<Item = &'a String>,
) -> Option<Resume> {
    match at {
        Some(At::Time(_)) => None,
        _ => compacted::resume_for(compacted, tables),
    }
}

/// Whether `entry`, read earlier for `shape`'s table, still stands: it was
/// read for the same key (which log's seq is the next seq depends on it),
/// and neither log has moved on since.
async fn stands(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    shape: &TableShape,
    entry: Option<&TableEntry>,
) -> Result<bool> {
    let keyed = !shape.key.is_empty();
    match entry {
        Some(e) if e.keyed == keyed => Ok(!compacted::logs_moved(store, prefix, shape, e).await?),
        _ => Ok(false),
    }
}

/// Whether every table of `shapes` has an entry in `entries`, for the same
/// key, whose logs have not moved on.
async fn all_kept(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    shapes: &BTreeMap<String, Arc<TableShape>>,
    entries: &BTreeMap<String, TableEntry>,
) -> Result<bool> {
    let checks = shapes
        .values()
        .map(|shape| stands(store, prefix, shape, entries.get(&shape.table)));
    Ok(futures::future::try_join_all(checks)
        .await?
        .into_iter()
        .all(|kept| kept))
}

/// The archive's NDJSON objects, by first seq then write time, each with
/// the seqs no earlier object holds; objects holding none are left out.
async fn list(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    pipeline: &str,
    from: Option<&Resume>,
    folder: Option<&std::path::Path>,
) -> Result<Vec<Object>> {
    let listed = listing::list_archive(store, prefix, pipeline, from, folder).await?;
    Ok(dedupe(
        listed
            .into_iter()
            .map(|o| Object {
                key: o.key,
                date: o.date,
                first_seq: o.first_seq,
                last_seq: o.last_seq,
                from_seq: o.first_seq,
                written: o.written,
            })
            .collect(),
    ))
}

/// Sorts objects by first seq (the earliest written first among equals) and
/// keeps, of each, only the seqs no earlier object holds.
pub(crate) fn dedupe(mut all: Vec<Object>) -> Vec<Object> {
    all.sort_by(|a, b| {
        (
            a.first_seq,
            std::cmp::Reverse(a.last_seq),
            a.written,
            &a.key,
        )
            .cmp(&(
                b.first_seq,
                std::cmp::Reverse(b.last_seq),
                b.written,
                &b.key,
            ))
    });
    let mut out: Vec<Object> = Vec::with_capacity(all.len());
    // Seqs below `next` are held by an object already taken.
    let mut next = 0u64;
    for mut o in all {
        if o.last_seq < next {
            continue;
        }
        o.from_seq = o.first_seq.max(next);
        next = o.last_seq + 1;
        out.push(o);
    }
    out
}

/// The last seq of the archive as it stood at `t`: the end of the run of
/// objects, from the first, that were all written by then. Objects are
/// written within about a second of their changes' commit (the batch
/// linger), and the envelope carries no commit time, so this is the time
/// the changes reached the archive.
pub(crate) fn seq_at_time(objects: &[Object], t: DateTime<Utc>) -> u64 {
    let mut seq = 0;
    for o in objects {
        if o.written > t {
            break;
        }
        seq = o.last_seq;
    }
    seq
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(key: &str, first: u64, last: u64, secs: i64) -> Object {
        Object {
            key: key.into(),
            date: "2026-01-01".into(),
            first_seq: first,
            last_seq: last,
            from_seq: first,
            written: DateTime::from_timestamp(secs, 0).unwrap(),
        }
    }

    #[test]
    fn repeated_objects_are_dropped_and_overlaps_trimmed() {
        let objects = dedupe(vec![
            obj("b", 11, 20, 5),
            obj("a", 1, 10, 1),
            obj("copy-of-a", 1, 10, 9),
            obj("overlap", 15, 25, 6),
        ]);
        let got: Vec<(&str, u64)> = objects
            .iter()
            .map(|o| (o.key.as_str(), o.from_seq))
            .collect();
        assert_eq!(got, [("a", 1), ("b", 11), ("overlap", 21)]);
    }

    #[test]
    fn a_time_is_the_last_seq_of_the_objects_written_by_then() {
        let objects = dedupe(vec![
            obj("a", 1, 10, 100),
            obj("b", 11, 20, 200),
            obj("c", 21, 30, 300),
        ]);
        let at = |s| seq_at_time(&objects, DateTime::from_timestamp(s, 0).unwrap());
        assert_eq!(at(50), 0);
        assert_eq!(at(100), 10);
        assert_eq!(at(299), 20);
        assert_eq!(at(1000), 30);
        // A later object written before an earlier one does not count.
        let objects = dedupe(vec![
            obj("a", 1, 10, 100),
            obj("b", 11, 20, 300),
            obj("c", 21, 30, 200),
        ]);
        assert_eq!(
            seq_at_time(&objects, DateTime::from_timestamp(250, 0).unwrap()),
            10
        );
    }

    #[test]
    fn at_takes_a_seq_or_an_rfc3339_time() {
        assert_eq!("42".parse::<At>(), Ok(At::Seq(42)));
        assert_eq!(
            "2026-11-30T08:00:00+01:00".parse::<At>(),
            Ok(At::Time(
                DateTime::from_timestamp(1_796_022_000, 0).unwrap()
            ))
        );
        assert!("yesterday".parse::<At>().unwrap_err().contains("RFC 3339"));
    }
}
