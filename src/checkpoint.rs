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

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, params};

use crate::{Error, Result};

/// The `(L, S)` pair described in the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cursor {
    pub confirmed_lsn: u64,
    pub next_seq: u64,
}

/// A batch whose seq range is fixed: `done` once its object is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Intent {
    pub first_seq: u64,
    pub last_seq: u64,
    pub done: bool,
}

/// The pipeline's local state store.
pub struct Checkpoint {
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

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cursor (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    confirmed_lsn INTEGER NOT NULL,
    next_seq      INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS intents (
    first_seq INTEGER PRIMARY KEY,
    last_seq  INTEGER NOT NULL,
    done      INTEGER NOT NULL DEFAULT 0
);
";

impl Checkpoint {
    /// Opens (or creates) the state file, and its folder with mode 0700.
    pub fn open(path: &Path) -> Result<Checkpoint> {
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
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(err)?;
        conn.execute_batch(SCHEMA).map_err(err)?;
        Ok(Checkpoint {
            conn,
            path: path.to_path_buf(),
        })
    }

    fn err(&self) -> impl Fn(rusqlite::Error) -> Error + '_ {
        move |source| Error::State {
            path: self.path.display().to_string(),
            source,
        }
    }

    /// The cursor, or `None` when this pipeline has never confirmed anything.
    pub fn cursor(&self) -> Result<Option<Cursor>> {
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
    pub fn meta(&self, key: &str) -> Result<Option<String>> {
        self.conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
            .map_err(self.err())
    }

    pub fn set_meta(&self, key: &str, value: &str) -> Result<()> {
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
    pub fn open_intents(&self, next_seq: u64) -> Result<Vec<Intent>> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT first_seq, last_seq, done FROM intents
                 WHERE last_seq >= ?1 ORDER BY first_seq",
            )
            .map_err(self.err())?;
        let rows = stmt
            .query_map([next_seq as i64], |r| {
                Ok(Intent {
                    first_seq: r.get::<_, i64>(0)? as u64,
                    last_seq: r.get::<_, i64>(1)? as u64,
                    done: r.get::<_, i64>(2)? != 0,
                })
            })
            .map_err(self.err())?;
        rows.collect::<Result<Vec<_>, _>>().map_err(self.err())
    }

    /// Records a batch's seq range before its PUT (durable on return).
    pub fn record_intent(&mut self, first_seq: u64, last_seq: u64) -> Result<()> {
        self.conn
            .execute(
                "INSERT INTO intents (first_seq, last_seq, done) VALUES (?1, ?2, 0)
                 ON CONFLICT (first_seq) DO NOTHING",
                params![first_seq as i64, last_seq as i64],
            )
            .map(|_| ())
            .map_err(self.err())
    }

    /// Marks written batches done and, in the same transaction, moves the
    /// cursor (when given) and forgets intents wholly before it.
    pub fn commit(&mut self, done: &[u64], cursor: Option<Cursor>) -> Result<()> {
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
mod tests {
    use super::*;

    #[test]
    fn cursor_and_intents_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/p.sqlite");
        {
            let mut cp = Checkpoint::open(&path).unwrap();
            assert_eq!(cp.cursor().unwrap(), None);
            cp.record_intent(1, 100).unwrap();
            cp.record_intent(101, 150).unwrap();
            cp.record_intent(151, 160).unwrap();
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
                    done: true
                },
                Intent {
                    first_seq: 151,
                    last_seq: 160,
                    done: false
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
