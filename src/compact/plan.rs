//! The compaction manifest, `[prefix/]_waltail/compaction/manifest.json`:
//! what has been compacted, the current latest-view files, and the plan of
//! a run in progress.
//!
//! Exactly once rests on three rules:
//! - seqs are compacted as one contiguous run from the first seq in the
//!   archive: a run takes the objects that continue, without a gap, the
//!   lowest `next_seq` of the tables it compacts, and nothing after a gap (a batch not in the
//!   archive yet, e.g. parked), so every change is applied once and in order;
//!   an object whose seqs are already compacted (a duplicate) is skipped;
//! - a run first stores its plan (the objects, their grouping into history
//!   files, the latest-view generation), so the names of everything it writes
//!   are fixed before any of it is written; a run that is interrupted is
//!   resumed from its plan by the next one and writes the same names again;
//! - the manifest is replaced (one PUT, atomic) only once every file of the
//!   plan is written; the latest view's new generation is written to a
//!   staging folder first and moved into `latest/` after that PUT (then the
//!   previous generation is deleted), so an interrupted run never leaves two
//!   generations side by side there: at most for the moment of the move.

use std::collections::BTreeMap;

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};
use serde::{Deserialize, Serialize};

use super::listing::{ArchiveObject, under};
use super::typing::Column;
use crate::{Error, Result};

/// Where the manifest lives, under the prefix.
pub const MANIFEST_KEY: &str = "_waltail/compaction/manifest.json";

/// The manifest's format version; an unknown one is refused.
const FORMAT: u32 = 1;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    /// The generation of the latest-view files listed in `tables`.
    pub generation: u64,
    pub tables: BTreeMap<String, TableEntry>,
    /// A run that has started and not committed.
    pub pending: Option<Plan>,
    /// Latest-view files of the committed generation still to be moved from
    /// staging into `latest/` (a run stopped while publishing them).
    #[serde(default)]
    pub publish: Vec<Move>,
    /// The stored manifest's version as this one was read or last
    /// committed (`None`: there was none), for [`Manifest::commit`].
    #[serde(skip)]
    pub version: Option<UpdateVersion>,
}

/// A staged file and its final key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Move {
    pub from: String,
    pub to: String,
}

/// One compacted table.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TableEntry {
    /// Every change of the table with a lower seq is compacted.
    pub next_seq: u64,
    /// The date folder (`YYYY-MM-DD`) of the last object compacted, so
    /// that readers list only the date folders from there on (see
    /// [`super::listing::list_archive`]). Absent in manifests written
    /// before it was kept: they list everything until the next run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_date: Option<String>,
    /// The columns as written, in order, with their types: a later run
    /// checks that its types widen these.
    pub columns: Vec<Column>,
    /// The latest view's files (keys under the prefix), the only ones a
    /// reader should read for a consistent view while a run replaces them.
    pub latest: Vec<String>,
    /// Rows in the latest view.
    pub latest_rows: u64,
    /// Buckets the latest view is split into by key hash (a power of two;
    /// 0 in manifests written before buckets, meaning 1). Only grows, so a
    /// later run finds each bucket's previous rows in one bucket's files.
    #[serde(default)]
    pub buckets: u32,
    /// Changes in the history.
    pub history_rows: u64,
}

impl TableEntry {
    /// The latest view's bucket count (at least 1).
    pub fn bucket_count(&self) -> u32 {
        self.buckets.max(1)
    }
}

/// What a run compacts, fixed before anything is written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The latest-view generation this run writes.
    pub generation: u64,
    pub from_seq: u64,
    pub to_seq: u64,
    /// The tables compacted (`schema.table`).
    pub tables: Vec<String>,
    /// History files to write, in seq order.
    pub files: Vec<PlannedFile>,
    /// Objects left out because every change in them is in another object
    /// of the plan (the same batch written under two names).
    #[serde(default)]
    pub repeated: Vec<String>,
}

/// One history file per table: the changes of `objects` in `first..=last`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedFile {
    pub date: String,
    pub first_seq: u64,
    pub last_seq: u64,
    pub objects: Vec<PlannedObject>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedObject {
    pub key: String,
    pub size: u64,
    /// Seqs of this object below this one are already compacted (an object
    /// that overlaps an earlier one): they are skipped.
    pub from_seq: u64,
}

impl Manifest {
    pub fn path(prefix: Option<&str>) -> ObjectPath {
        ObjectPath::from(under(prefix, MANIFEST_KEY))
    }

    /// The manifest, or an empty one before the first run.
    pub async fn load(store: &dyn ObjectStore, prefix: Option<&str>) -> Result<Manifest> {
        let path = Self::path(prefix);
        let (body, version) = match store.get(&path).await {
            Ok(got) => {
                let version = UpdateVersion {
                    e_tag: got.meta.e_tag.clone(),
                    version: got.meta.version.clone(),
                };
                let body = got
                    .bytes()
                    .await
                    .map_err(|e| Error::store("GET", path.to_string(), e))?;
                (body, version)
            }
            Err(object_store::Error::NotFound { .. }) => {
                return Ok(Manifest {
                    format: FORMAT,
                    ..Manifest::default()
                });
            }
            Err(e) => return Err(Error::store("GET", path.to_string(), e)),
        };
        let mut manifest: Manifest = serde_json::from_slice(&body).map_err(|e| {
            Error::fatal(
                format!("the compaction manifest {path} is not valid: {e}"),
                "restore it from a backup; or delete it with the parquet/ and latest/ folders to compact everything again",
            )
        })?;
        if manifest.format != FORMAT {
            return Err(Error::fatal(
                format!(
                    "the compaction manifest {path} has format {}, this waltail knows {FORMAT}",
                    manifest.format
                ),
                "run the waltail version that wrote it, or a newer one",
            ));
        }
        manifest.version = Some(version);
        Ok(manifest)
    }

    /// Replaces the manifest if it is still the version this one was read
    /// as (or last committed): a conditional PUT (If-Match on S3; If-None-
    /// Match when there was none), so a run cannot overwrite what another
    /// run committed meanwhile. A local folder has no conditional replace:
    /// there the lock alone keeps runs apart.
    pub async fn commit(&mut self, store: &dyn ObjectStore, prefix: Option<&str>) -> Result<()> {
        let path = Self::path(prefix);
        let body = Bytes::from(serde_json::to_vec_pretty(self).expect("the manifest serialises"));
        let mode = match self.version.clone() {
            Some(v) => PutMode::Update(v),
            None => PutMode::Create,
        };
        let put = |mode| {
            store.put_opts(
                &path,
                PutPayload::from(body.clone()),
                PutOptions {
                    mode,
                    ..PutOptions::default()
                },
            )
        };
        let result = match put(mode).await {
            Err(object_store::Error::NotImplemented { .. }) => put(PutMode::Overwrite).await,
            other => other,
        };
        match result {
            Ok(put) => {
                self.version = Some(put.into());
                Ok(())
            }
            Err(
                e @ (object_store::Error::Precondition { .. }
                | object_store::Error::AlreadyExists { .. }),
            ) => {
                // Our own PUT, answered late and retried, looks like this
                // too: the stored bytes tell.
                if let Ok(got) = store.get(&path).await {
                    let version = UpdateVersion {
                        e_tag: got.meta.e_tag.clone(),
                        version: got.meta.version.clone(),
                    };
                    if got.bytes().await.is_ok_and(|b| b == body) {
                        self.version = Some(version);
                        return Ok(());
                    }
                }
                Err(Error::fatal(
                    format!(
                        "the compaction manifest {path} was changed by another compact while this one ran ({e})"
                    ),
                    "nothing of this run is visible; the other run's result stands. Run `waltail compact` again",
                ))
            }
            Err(e) => Err(Error::store("PUT", path.to_string(), e)),
        }
    }

    /// Replaces the manifest (one PUT: readers see the old or the new one).
    pub async fn store(&self, store: &dyn ObjectStore, prefix: Option<&str>) -> Result<()> {
        let path = Self::path(prefix);
        let body = serde_json::to_vec_pretty(self).expect("the manifest serialises");
        store
            .put(&path, PutPayload::from(Bytes::from(body)))
            .await
            .map(|_| ())
            .map_err(|e| Error::store("PUT", path.to_string(), e))
    }
}

/// The objects a run takes: those continuing `next_seq` (or the archive's
/// first seq) without a gap, grouped into history files of one date and at
/// most `file_bytes` of NDJSON (or one object).
pub fn plan_files(objects: &[ArchiveObject], next_seq: Option<u64>, file_bytes: u64) -> Planned {
    let mut planned = Planned::default();
    let Some(start) = next_seq.or_else(|| objects.iter().map(|o| o.first_seq).min()) else {
        return planned;
    };
    let mut cursor = start;
    let files = &mut planned.files;
    let mut size = 0u64;
    // `objects` is sorted by first seq.
    for o in objects {
        if o.last_seq < cursor {
            if o.last_seq >= start {
                planned.repeated.push(o.key.clone());
            }
            continue; // compacted already, or a repeat of a taken object
        }
        if o.first_seq > cursor {
            planned.gap = Some(cursor);
            break;
        }
        let planned = PlannedObject {
            key: o.key.clone(),
            size: o.size,
            from_seq: cursor,
        };
        match files.last_mut() {
            Some(f) if f.date == o.date && size + o.size <= file_bytes => {
                f.last_seq = o.last_seq;
                f.objects.push(planned);
                size += o.size;
            }
            _ => {
                files.push(PlannedFile {
                    date: o.date.clone(),
                    first_seq: cursor,
                    last_seq: o.last_seq,
                    objects: vec![planned],
                });
                size = o.size;
            }
        }
        cursor = o.last_seq + 1;
    }
    planned
}

/// What [`plan_files`] found.
#[derive(Debug, Default)]
pub struct Planned {
    pub files: Vec<PlannedFile>,
    /// The first missing seq, when a gap stopped the plan.
    pub gap: Option<u64>,
    /// Objects whose changes are all in objects taken before them.
    pub repeated: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(date: &str, first: u64, last: u64, size: u64) -> ArchiveObject {
        ArchiveObject {
            key: format!("{date}/p-{first}-{last}.ndjson"),
            date: date.into(),
            first_seq: first,
            last_seq: last,
            size,
        }
    }

    #[test]
    fn plan_groups_by_date_and_size_and_stops_at_a_gap() {
        let objects = [
            obj("2024-01-01", 1, 10, 40),
            obj("2024-01-01", 11, 20, 40),
            obj("2024-01-01", 21, 30, 40),
            obj("2024-01-02", 31, 40, 40),
            obj("2024-01-02", 51, 60, 40),
        ];
        let p = plan_files(&objects, None, 100);
        let ranges: Vec<_> = p.files.iter().map(|f| (f.first_seq, f.last_seq)).collect();
        assert_eq!(ranges, [(1, 20), (21, 30), (31, 40)]);
        assert_eq!(p.gap, Some(41));
        let p = plan_files(&objects, Some(41), 100);
        assert!(p.files.is_empty());
        assert_eq!(p.gap, Some(41));
        assert!(p.repeated.is_empty(), "compacted before is not a repeat");
    }

    #[test]
    fn plan_skips_compacted_and_duplicated_seqs() {
        let objects = [
            obj("2024-01-01", 1, 10, 1),
            obj("2024-01-01", 1, 10, 1),
            obj("2024-01-01", 5, 14, 1),
            obj("2024-01-01", 15, 20, 1),
        ];
        let p = plan_files(&objects, Some(3), 1000);
        assert_eq!(p.gap, None);
        assert_eq!(p.repeated, [objects[1].key.clone()]);
        let f = &p.files[0];
        assert_eq!((f.first_seq, f.last_seq), (3, 20));
        let from: Vec<u64> = f.objects.iter().map(|o| o.from_seq).collect();
        assert_eq!(from, [3, 11, 15]);
    }
}
