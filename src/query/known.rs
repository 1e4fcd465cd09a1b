//! The compacted tables as the last `waltail query` read them, kept in the
//! state folder (`<pipeline>.query.json`) for the next one.
//!
//! Opening a table's two Delta logs through delta-rs took 4-5 ms of a
//! 20 ms query on a local folder, and is a listing and several reads per
//! log on S3. A table whose logs have not moved on since (one or two HEADs
//! per log, see [`compacted::logs_moved`]) keeps the entry read then; a
//! table whose logs moved, or that the file does not know, is read again,
//! and the file rewritten. The schema records read are kept too (by each
//! object's size and entity tag, see [`SchemaObjects`]): with the shapes
//! they give, the next query checks the logs and lists the NDJSON while it
//! lists the records, as a statement at the prompt does, rather than after.
//! The file is only a shortcut: missing, unreadable,
//! of another archive or another waltail version, it is ignored, and a
//! state folder that does not exist or cannot be written means no file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::archive::listing::SchemaObjects;
use crate::lakehouse::compacted::{self, TableEntry};

/// Where the entries are kept, and for which archive.
#[derive(Debug)]
pub(crate) struct Known {
    path: PathBuf,
    archive: String,
}

/// The file's content.
#[derive(Serialize, Deserialize)]
struct KnownFile {
    /// The waltail version that wrote it: another reads its logs afresh.
    waltail: String,
    /// The archive root's URL and the pipeline, `<url>#<pipeline>`.
    archive: String,
    tables: BTreeMap<String, TableEntry>,
    #[serde(default)]
    schemas: SchemaObjects,
}

/// What the last query read: its compacted tables and schema records.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Kept {
    pub tables: BTreeMap<String, TableEntry>,
    pub schemas: SchemaObjects,
}

impl Known {
    /// The file of `pipeline` in `state_dir`, for the archive at `url`.
    pub(crate) fn new(state_dir: &Path, pipeline: &str, url: &url::Url) -> Known {
        Known {
            path: state_dir.join(format!("{pipeline}.query.json")),
            archive: format!("{url}#{pipeline}"),
        }
    }

    /// The entries the last query kept, if they are of this archive.
    pub(crate) fn read(&self) -> Option<Kept> {
        let bytes = std::fs::read(&self.path).ok()?;
        let file: KnownFile = serde_json::from_slice(&bytes)
            .inspect_err(|e| tracing::debug!(path = %self.path.display(), error = %e, "ignoring the kept Delta log entries"))
            .ok()?;
        (file.waltail == env!("CARGO_PKG_VERSION") && file.archive == self.archive).then(|| Kept {
            // An entry kept without its files' sizes (by an earlier build)
            // is read afresh, so that its files' metadata need no request.
            tables: file
                .tables
                .into_iter()
                .filter(|(_, e)| {
                    e.latest
                        .iter()
                        .chain(&e.history)
                        .all(|k| e.sizes.contains_key(k))
                })
                .collect(),
            schemas: file.schemas,
        })
    }

    /// Keeps `entries` for the next query: those whose commits were looked
    /// up (see [`compacted::mark_logs`]). Written to a file of its own and
    /// renamed over the last, so a concurrent query reads one or the other.
    pub(crate) fn write(&self, entries: &BTreeMap<String, TableEntry>, schemas: &SchemaObjects) {
        let Some(dir) = self.path.parent().filter(|d| d.is_dir()) else {
            return;
        };
        let file = KnownFile {
            waltail: env!("CARGO_PKG_VERSION").to_string(),
            archive: self.archive.clone(),
            tables: entries
                .iter()
                .filter(|(_, e)| e.logs.iter().flatten().all(compacted::LogMark::is_whole))
                .map(|(t, e)| (t.clone(), e.clone()))
                .collect(),
            schemas: schemas.clone(),
        };
        let written = serde_json::to_vec(&file)
            .map_err(std::io::Error::other)
            .and_then(|bytes| {
                let tmp = dir.join(format!(
                    ".{}.{}",
                    self.path.file_name().unwrap_or_default().to_string_lossy(),
                    std::process::id()
                ));
                std::fs::write(&tmp, bytes)?;
                std::fs::rename(&tmp, &self.path).inspect_err(|_| {
                    let _ = std::fs::remove_file(&tmp);
                })
            });
        if let Err(e) = written {
            tracing::debug!(path = %self.path.display(), error = %e, "cannot keep the Delta log entries");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lakehouse::compacted::LogMark;

    fn entry(version: u64) -> TableEntry {
        TableEntry {
            next_seq: 7,
            latest: vec!["latest/public/t/a.parquet".into()],
            sizes: BTreeMap::from([("latest/public/t/a.parquet".into(), 1_000)]),
            logs: [
                Some(LogMark {
                    version,
                    size: Some(100),
                    e_tag: Some("x".into()),
                }),
                None,
            ],
            keyed: true,
            ..TableEntry::default()
        }
    }

    #[test]
    fn entries_come_back_for_the_same_archive_only() {
        let dir = tempfile::tempdir().unwrap();
        let url = url::Url::parse("file:///srv/archive/").unwrap();
        let known = Known::new(dir.path(), "p", &url);
        assert_eq!(known.read(), None, "no file yet");
        let mut entries = BTreeMap::from([("public.t".to_string(), entry(3))]);
        // A log whose commit was not looked up is not kept.
        let mut unmarked = entry(4);
        unmarked.logs[0].as_mut().unwrap().size = None;
        entries.insert("public.u".into(), unmarked);
        // An entry without its files' sizes (kept by an earlier build) is
        // read afresh.
        let mut unsized_ = entry(5);
        unsized_.sizes.clear();
        entries.insert("public.v".into(), unsized_);
        let schemas: SchemaObjects = serde_json::from_value(serde_json::json!({
            "_schemas/public.t/1.json": {"size": 120, "e_tag": "e1", "record": {
                "table": "public.t", "version": 1, "replica_identity": "default",
                "columns": [{"name": "id", "type": "bigint", "type_oid": 20, "type_modifier": -1, "key": true}]
            }}
        }))
        .unwrap();
        known.write(&entries, &schemas);
        let back = known.read().unwrap();
        assert_eq!(back.tables.keys().collect::<Vec<_>>(), ["public.t"]);
        assert_eq!(back.tables["public.t"], entries["public.t"]);
        assert_eq!(
            back.schemas, schemas,
            "the schema records come back as read"
        );
        // Another archive or pipeline with the same state folder: nothing.
        let other = url::Url::parse("file:///srv/other/").unwrap();
        assert_eq!(Known::new(dir.path(), "p", &other).read(), None);
        std::fs::copy(
            dir.path().join("p.query.json"),
            dir.path().join("q.query.json"),
        )
        .unwrap();
        assert_eq!(Known::new(dir.path(), "q", &url).read(), None);
        // A damaged file is ignored, and replaced by the next write.
        std::fs::write(dir.path().join("p.query.json"), b"{\"waltail\":").unwrap();
        assert_eq!(known.read(), None);
        known.write(&entries, &schemas);
        assert!(known.read().is_some());
        // A state folder that does not exist: nothing written, no error.
        let gone = Known::new(&dir.path().join("missing"), "p", &url);
        gone.write(&entries, &schemas);
        assert_eq!(gone.read(), None);
    }
}
