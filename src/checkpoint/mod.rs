//! Local crash-safe state: the confirmed position and the batch intents.
//!
//! One SQLite database per pipeline in the state directory (rusqlite with
//! bundled SQLite; `synchronous = FULL`, so a commit is on disk before we
//! act on it). It holds:
//!
//! - the cursor `(L, S)`: `L` the last LSN confirmed to Postgres, `S` the seq
//!   the first change after `L` gets. It is written before `L` is sent to
//!   the server, never after, so on restart the server never resumes past a
//!   position whose seq we do not know.
//! - batch intents `(firstSeq, lastSeq)`: written before the batch's PUT and
//!   marked done after it. After a crash the same seqs are re-formed into
//!   exactly the same batch (same key, same bytes), so no seq range is ever
//!   written as two different objects.
//! - parked and held batches, with their bytes: a batch that failed every
//!   attempt is *parked* with its last error; a later batch touching one of
//!   its rows is *held* behind it. Both count as durable for confirmation.
//!   `waltail parked replay` delivers a parked batch under the same key and
//!   releases the held ones in seq order.
//! - backfills: what was asked, how far each got (the last key of the last
//!   chunk handed to the pipeline), and the chunks whose high watermark is
//!   not confirmed yet, whose rows wait in files beside the database (see
//!   [`chunks`]), so a restart emits the same `read` events with the same
//!   bytes (see `source::backfill`).
//!
//! This file holds the database, the cursor, the intents and the schema
//! versions; [`schema`] the tables, [`parked`] the parked and held batches,
//! [`backfill`] the backfills' chunks and the progress samples, [`chunks`]
//! the files of the chunks' rows.

mod backfill;
mod chunks;
pub(crate) mod parked;
mod schema;

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, params};

pub(crate) use self::backfill::{Backfill, Chunk, KeyRange, Progress};
pub(crate) use self::chunks::ChunkBody;
pub(crate) use self::parked::{ParkStatus, Parked};
use crate::archive::codec::Codec;
use crate::batch::Intent;
use crate::error::ErrorKind;
use crate::row_identity;
use crate::{Error, Result};

/// The `(L, S)` pair described in the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Cursor {
    pub confirmed_lsn: u64,
    pub next_seq: u64,
}

/// The meta key of the row identity's version (see [`row_identity`]).
const META_ROW_IDENTITY: &str = "row_identity";

/// The pipeline's local state store.
pub(crate) struct Checkpoint {
    conn: Connection,
    path: PathBuf,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("path", &self.path)
            .finish()
    }
}

/// Waits for another connection's write: retries every millisecond, for
/// up to [`BUSY_WAIT_MS`].
fn retry_busy(attempt: i32) -> bool {
    if attempt >= BUSY_WAIT_MS {
        return false;
    }
    std::thread::sleep(std::time::Duration::from_millis(1));
    true
}

/// How long a write waits for another connection's (in milliseconds).
const BUSY_WAIT_MS: i32 = 5000;

impl Checkpoint {
    /// Opens (or creates) the state file, and its folder with mode 0700.
    pub(crate) fn open(path: &Path) -> Result<Checkpoint> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            create_private_dir(dir)?;
        }
        let err = |source| Error::State {
            path: path.display().to_string(),
            source,
        };
        let conn = Connection::open(path).map_err(err)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(err)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(err)?;
        // Several connections write (the pipeline, its backfill task, the
        // CLI and console asking for replays). SQLite's own busy handler
        // sleeps in growing steps up to 100 ms, so a writer meeting a busy
        // pipeline could lose ~200 ms per write; retry every millisecond.
        conn.busy_handler(Some(retry_busy)).map_err(err)?;
        schema::create(&conn).map_err(err)?;
        let state = Checkpoint {
            conn,
            path: path.to_path_buf(),
        };
        state.check_row_identity()?;
        Ok(state)
    }

    /// Parked and held batches keep their rows' identities (see
    /// [`row_identity`]): a state whose identities come from another
    /// version of that function would let changes pass the batches of
    /// their rows, so it is refused. A state without the record was
    /// written before it existed, by the function of version 1.
    fn check_row_identity(&self) -> Result<()> {
        let ours = row_identity::VERSION.to_string();
        match self.meta(META_ROW_IDENTITY)? {
            None => self.set_meta(META_ROW_IDENTITY, &ours),
            Some(v) if v == ours => Ok(()),
            Some(v) => Err(Error::fatal(
                format!(
                    "the state {} identifies rows by version {v} of the row identity, and this waltail knows version {ours}",
                    self.path.display()
                ),
                "run the waltail release that wrote this state (it is newer than this one)",
            )
            .with_kind(ErrorKind::State)),
        }
    }

    fn err(&self) -> impl Fn(rusqlite::Error) -> Error + '_ {
        move |source| Error::State {
            path: self.path.display().to_string(),
            source,
        }
    }

    /// The cursor, or `None` when this pipeline has never confirmed anything.
    pub(crate) fn cursor(&self) -> Result<Option<Cursor>> {
        self.conn
            .query_row(
                "SELECT confirmed_lsn, next_seq FROM cursor WHERE id = 1",
                [],
                |r| {
                    Ok(Cursor {
                        confirmed_lsn: r.get::<_, i64>(0)? as u64,
                        next_seq: r.get::<_, i64>(1)? as u64,
                    })
                },
            )
            .optional()
            .map_err(self.err())
    }

    /// A free-form value kept beside the cursor (e.g. the slot's identity).
    pub(crate) fn meta(&self, key: &str) -> Result<Option<String>> {
        self.conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
            .map_err(self.err())
    }

    pub(crate) fn set_meta(&self, key: &str, value: &str) -> Result<()> {
        self.conn
            .execute(
                "INSERT INTO meta (key, value) VALUES (?1, ?2)
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                params![key, value],
            )
            .map(|_| ())
            .map_err(self.err())
    }

    /// Intents that are not wholly before `next_seq`, in seq order.
    pub(crate) fn open_intents(&self, next_seq: u64) -> Result<Vec<Intent>> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT first_seq, last_seq, done, codec FROM intents
                 WHERE last_seq >= ?1 ORDER BY first_seq",
            )
            .map_err(self.err())?;
        let rows = stmt
            .query_map([next_seq as i64], |r| {
                Ok((
                    r.get::<_, i64>(0)? as u64,
                    r.get::<_, i64>(1)? as u64,
                    r.get::<_, i64>(2)? != 0,
                    r.get::<_, Option<String>>(3)?,
                ))
            })
            .map_err(self.err())?;
        let rows = rows.collect::<Result<Vec<_>, _>>().map_err(self.err())?;
        rows.into_iter()
            .map(|(first_seq, last_seq, done, codec)| {
                // Written before compression existed: plain NDJSON.
                let codec = match codec.as_deref() {
                    None => Codec::None,
                    Some(name) => Codec::from_name(name).ok_or_else(|| {
                        Error::fatal(
                            format!(
                                "the local state {} records a batch encoded as {name:?}, which this waltail does not know",
                                self.path.display()
                            ),
                            "run the waltail release that wrote this state",
                        )
                        .with_kind(ErrorKind::State)
                    })?,
                };
                Ok(Intent {
                    first_seq,
                    last_seq,
                    done,
                    codec,
                })
            })
            .collect()
    }

    /// Records a batch's seq range before its PUT (durable on return).
    #[cfg(test)]
    pub(crate) fn record_intent(
        &mut self,
        first_seq: u64,
        last_seq: u64,
        codec: Codec,
    ) -> Result<()> {
        self.record_intents(&[(first_seq, last_seq, codec)])
    }

    /// Records the seq ranges of several batches in one transaction (one
    /// sync to disk for all of them; durable on return).
    pub(crate) fn record_intents(&mut self, ranges: &[(u64, u64, Codec)]) -> Result<()> {
        let path = self.path.display().to_string();
        let err = |source| Error::State {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(err)?;
        {
            let mut insert = tx
                .prepare_cached(
                    "INSERT INTO intents (first_seq, last_seq, done, codec) VALUES (?1, ?2, 0, ?3)
                     ON CONFLICT (first_seq) DO NOTHING",
                )
                .map_err(err)?;
            for &(first_seq, last_seq, codec) in ranges {
                insert
                    .execute(params![first_seq as i64, last_seq as i64, codec.name()])
                    .map_err(err)?;
            }
        }
        tx.commit().map_err(err)
    }

    /// Marks written batches done and, in the same transaction, moves the
    /// cursor (when given) and forgets intents wholly before it.
    pub(crate) fn commit(&mut self, done: &[u64], cursor: Option<Cursor>) -> Result<()> {
        let path = self.path.display().to_string();
        let err = |source| Error::State {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(err)?;
        for first_seq in done {
            tx.execute(
                "UPDATE intents SET done = 1 WHERE first_seq = ?1",
                [*first_seq as i64],
            )
            .map_err(err)?;
        }
        if let Some(c) = cursor {
            tx.execute(
                "INSERT INTO cursor (id, confirmed_lsn, next_seq) VALUES (1, ?1, ?2)
                 ON CONFLICT (id) DO UPDATE SET confirmed_lsn = excluded.confirmed_lsn,
                                                next_seq = excluded.next_seq",
                params![c.confirmed_lsn as i64, c.next_seq as i64],
            )
            .map_err(err)?;
            tx.execute(
                "DELETE FROM intents WHERE last_seq < ?1",
                [c.next_seq as i64],
            )
            .map_err(err)?;
        }
        tx.commit().map_err(err)
    }
}

impl Checkpoint {
    /// The version number recorded for this shape of `table`, if any.
    pub(crate) fn schema_version(&self, table: &str, fingerprint: &str) -> Result<Option<u32>> {
        self.conn
            .query_row(
                "SELECT version FROM schemas WHERE tbl = ?1 AND fingerprint = ?2",
                params![table, fingerprint],
                |r| r.get::<_, i64>(0),
            )
            .optional()
            .map(|v| v.map(|v| v as u32))
            .map_err(self.err())
    }

    /// The version a new shape of `table` gets.
    pub(crate) fn next_schema_version(&self, table: &str) -> Result<u32> {
        self.conn
            .query_row(
                "SELECT COALESCE(MAX(version), 0) + 1 FROM schemas WHERE tbl = ?1",
                [table],
                |r| r.get::<_, i64>(0),
            )
            .map(|v| v as u32)
            .map_err(self.err())
    }

    /// Records that `version` of `table` is written to the archive.
    pub(crate) fn record_schema(
        &mut self,
        table: &str,
        version: u32,
        fingerprint: &str,
    ) -> Result<()> {
        self.conn
            .execute(
                "INSERT OR IGNORE INTO schemas (tbl, version, fingerprint) VALUES (?1, ?2, ?3)",
                params![table, version as i64, fingerprint],
            )
            .map(|_| ())
            .map_err(self.err())
    }
}

/// Creates the state folder readable by its owner only: it tells where the
/// pipeline stands, and later holds parked changes.
fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| {
            Error::io(
                format!("cannot create the state folder {}", dir.display()),
                e,
            )
        })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A state written before the row identity's version was recorded
    /// (its parked rows hashed by std's `DefaultHasher`, which is version
    /// 1's function) keeps its held rows; a state of another version is
    /// refused rather than let changes pass the batches of their rows.
    #[test]
    fn a_state_keeps_its_row_identities_across_versions_of_waltail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sqlite");
        // A truncate's row as the release before wrote it: std's hasher
        // over the table's name.
        let held = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            "public.orders".to_string().hash(&mut h);
            h.finish()
        };
        {
            let mut cp = Checkpoint::open(&path).unwrap();
            cp.park(&Parked {
                first_seq: 1,
                last_seq: 2,
                key: "k".into(),
                body: b"{}\n".to_vec(),
                rows: vec![held],
                tables: "public.orders".into(),
                status: ParkStatus::Held,
                attempts: 0,
                last_error: None,
                parked_at: "2026-12-02T00:00:00Z".into(),
            })
            .unwrap();
            // As the release before the record wrote it.
            cp.conn
                .execute("DELETE FROM meta WHERE key = ?1", [META_ROW_IDENTITY])
                .unwrap();
        }
        let cp = Checkpoint::open(&path).unwrap();
        assert_eq!(cp.meta(META_ROW_IDENTITY).unwrap().as_deref(), Some("1"));
        let parked = cp.parked().unwrap();
        assert_eq!(parked[0].rows, vec![held]);
        // The same truncate, hashed by this release, is recognised.
        assert_eq!(
            crate::archive::envelope::table_hash(&crate::archive::envelope::TableRef::new(
                "public", "orders"
            )),
            held
        );
        cp.set_meta(META_ROW_IDENTITY, "2").unwrap();
        drop(cp);
        let err = Checkpoint::open(&path).unwrap_err().to_string();
        assert!(err.contains("version 2 of the row identity"), "{err}");
    }

    /// A state written before objects could be compressed gains the
    /// intents' codec column, its intents read as plain NDJSON, and new
    /// intents keep their codec.
    #[test]
    fn a_state_from_before_compression_keeps_its_intents_as_plain_ndjson() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.sqlite");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "CREATE TABLE intents (first_seq INTEGER PRIMARY KEY, last_seq INTEGER NOT NULL,
                                       done INTEGER NOT NULL DEFAULT 0);
                 INSERT INTO intents VALUES (1, 10, 0);",
            )
            .unwrap();
        }
        let mut cp = Checkpoint::open(&path).unwrap();
        cp.record_intent(11, 20, Codec::Zstd).unwrap();
        drop(cp);
        // A second opening finds the column there.
        let cp = Checkpoint::open(&path).unwrap();
        let codecs: Vec<(u64, Codec)> = cp
            .open_intents(1)
            .unwrap()
            .iter()
            .map(|i| (i.first_seq, i.codec))
            .collect();
        assert_eq!(codecs, [(1, Codec::None), (11, Codec::Zstd)]);
    }

    #[test]
    fn cursor_and_intents_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/p.sqlite");
        {
            let mut cp = Checkpoint::open(&path).unwrap();
            assert_eq!(cp.cursor().unwrap(), None);
            cp.record_intent(1, 100, Codec::None).unwrap();
            cp.record_intent(101, 150, Codec::Gzip).unwrap();
            cp.record_intent(151, 160, Codec::None).unwrap();
            cp.commit(
                &[1, 101],
                Some(Cursor {
                    confirmed_lsn: 42,
                    next_seq: 120,
                }),
            )
            .unwrap();
        }
        let cp = Checkpoint::open(&path).unwrap();
        assert_eq!(
            cp.cursor().unwrap(),
            Some(Cursor {
                confirmed_lsn: 42,
                next_seq: 120
            })
        );
        // [1,100] is wholly confirmed and forgotten; [101,150] straddles the cursor.
        assert_eq!(
            cp.open_intents(120).unwrap(),
            vec![
                Intent {
                    first_seq: 101,
                    last_seq: 150,
                    done: true,
                    codec: Codec::Gzip,
                },
                Intent {
                    first_seq: 151,
                    last_seq: 160,
                    done: false,
                    codec: Codec::None,
                }
            ]
        );
    }

    #[test]
    fn state_folder_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s/p.sqlite");
        Checkpoint::open(&path).unwrap();
        let mode = std::fs::metadata(dir.path().join("s"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
    }
}
