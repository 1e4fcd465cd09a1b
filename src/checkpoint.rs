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
//!   chunk handed to the pipeline), and the rows of the chunks whose high
//!   watermark is not confirmed yet, so a restart emits the same `read`
//!   events with the same bytes (see `source::backfill`).

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, params};

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
    done      INTEGER NOT NULL DEFAULT 0,
    codec     TEXT
);
CREATE TABLE IF NOT EXISTS progress (
    at        INTEGER PRIMARY KEY,
    next_seq  INTEGER NOT NULL,
    last_key  TEXT
);
CREATE TABLE IF NOT EXISTS schemas (
    tbl         TEXT NOT NULL,
    version     INTEGER NOT NULL,
    fingerprint TEXT NOT NULL,
    PRIMARY KEY (tbl, version)
);
CREATE TABLE IF NOT EXISTS parked (
    first_seq  INTEGER PRIMARY KEY,
    last_seq   INTEGER NOT NULL,
    key        TEXT NOT NULL,
    body       BLOB NOT NULL,
    rows       BLOB NOT NULL,
    tables     TEXT NOT NULL,
    status     TEXT NOT NULL CHECK (status IN ('parked', 'held', 'replay')),
    attempts   INTEGER NOT NULL,
    last_error TEXT,
    parked_at  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS backfills (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    schema_name  TEXT NOT NULL,
    table_name   TEXT NOT NULL,
    status       TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'cancelled', 'failed')),
    chunk_size   INTEGER NOT NULL,
    estimate     INTEGER NOT NULL,
    rows_read    INTEGER NOT NULL DEFAULT 0,
    rows_sent    INTEGER NOT NULL DEFAULT 0,
    last_key     TEXT,
    error        TEXT,
    requested_at TEXT NOT NULL,
    finished_at  TEXT
);
CREATE TABLE IF NOT EXISTS backfill_chunks (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    backfill  INTEGER NOT NULL,
    members   TEXT,
    last_key  TEXT,
    rows      INTEGER NOT NULL DEFAULT 0,
    is_last   INTEGER NOT NULL DEFAULT 0,
    stored    INTEGER NOT NULL DEFAULT 0,
    done      INTEGER NOT NULL DEFAULT 0,
    hw_end    INTEGER,
    body      BLOB,
    range_id  INTEGER,
    lane      INTEGER NOT NULL DEFAULT 0,
    skipped   BLOB
);
CREATE TABLE IF NOT EXISTS backfill_ranges (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    backfill  INTEGER NOT NULL,
    lo        TEXT,
    hi        TEXT,
    last_key  TEXT,
    done      INTEGER NOT NULL DEFAULT 0
);
";

/// Adds a column to a table of a state written before it existed (e.g.
/// `intents.codec`, before objects could be compressed: its intents are
/// plain NDJSON and the column stays NULL). Two processes opening the state
/// at once may both try; the loser finds the column there.
fn add_column(conn: &Connection, table: &str, column: &str, decl: &str) -> rusqlite::Result<()> {
    let has = |conn: &Connection| {
        conn.prepare("SELECT 1 FROM pragma_table_info(?1) WHERE name = ?2")?
            .exists([table, column])
    };
    if has(conn)? {
        return Ok(());
    }
    match conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {decl}")) {
        Err(_) if has(conn)? => Ok(()),
        other => other,
    }
}

/// The columns added to the state since its first release.
const ADDED_COLUMNS: [(&str, &str, &str); 4] = [
    ("intents", "codec", "TEXT"),
    // Parallel backfill: the key range a chunk reads, the reader (lane) it
    // belongs to, and which of its rows were left out at its high watermark.
    ("backfill_chunks", "range_id", "INTEGER"),
    ("backfill_chunks", "lane", "INTEGER NOT NULL DEFAULT 0"),
    ("backfill_chunks", "skipped", "BLOB"),
];

/// Where a parked-table batch stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParkStatus {
    /// Failed every attempt; waits for `waltail parked replay`.
    Parked,
    /// Touches a row of a parked batch; released after it, in seq order.
    Held,
    /// An operator asked for a replay; the running pipeline delivers it.
    Replay,
}

impl ParkStatus {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ParkStatus::Parked => "parked",
            ParkStatus::Held => "held",
            ParkStatus::Replay => "replay",
        }
    }

    fn parse(s: &str) -> ParkStatus {
        match s {
            "held" => ParkStatus::Held,
            "replay" => ParkStatus::Replay,
            _ => ParkStatus::Parked,
        }
    }
}

/// A parked or held batch as stored.
#[derive(Debug, Clone)]
pub(crate) struct Parked {
    pub first_seq: u64,
    pub last_seq: u64,
    pub key: String,
    pub body: Vec<u8>,
    pub rows: Vec<u64>,
    pub tables: String,
    pub status: ParkStatus,
    pub attempts: u32,
    pub last_error: Option<String>,
    pub parked_at: String,
}

impl Parked {
    /// The tables the batch touches (kept by name, comma-separated).
    pub(crate) fn tables(&self) -> Vec<std::sync::Arc<crate::archive::envelope::TableRef>> {
        self.table_names()
            .map(|name| {
                std::sync::Arc::new(crate::archive::envelope::TableRef::from_name(
                    name.to_string(),
                ))
            })
            .collect()
    }

    /// The identities of the tables the batch touches (see
    /// [`row_identity::Holds`]).
    pub(crate) fn table_hashes(&self) -> Vec<u64> {
        self.table_names().map(row_identity::table).collect()
    }

    /// The names in `tables`, as [`crate::batch::Batch::table_names`]
    /// joined them.
    fn table_names(&self) -> impl Iterator<Item = &str> {
        self.tables.split(',').filter(|name| !name.is_empty())
    }
}

fn rows_to_blob(rows: &[u64]) -> Vec<u8> {
    rows.iter().flat_map(|r| r.to_le_bytes()).collect()
}

fn rows_from_blob(blob: &[u8]) -> Vec<u64> {
    blob.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

const PARKED_COLUMNS: &str =
    "first_seq, last_seq, key, body, rows, tables, status, attempts, last_error, parked_at";

fn parked_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Parked> {
    Ok(Parked {
        first_seq: r.get::<_, i64>(0)? as u64,
        last_seq: r.get::<_, i64>(1)? as u64,
        key: r.get(2)?,
        body: r.get(3)?,
        rows: rows_from_blob(&r.get::<_, Vec<u8>>(4)?),
        tables: r.get(5)?,
        status: ParkStatus::parse(&r.get::<_, String>(6)?),
        attempts: r.get::<_, i64>(7)? as u32,
        last_error: r.get(8)?,
        parked_at: r.get(9)?,
    })
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
        conn.execute_batch(SCHEMA).map_err(err)?;
        for (table, column, decl) in ADDED_COLUMNS {
            add_column(&conn, table, column, decl).map_err(err)?;
        }
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
    /// Stores a batch as parked or held and marks its intent done (it is
    /// durable here; restarts skip its seqs), in one transaction.
    pub(crate) fn park(&mut self, p: &Parked) -> Result<()> {
        let path = self.path.display().to_string();
        let err = |source| Error::State {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(err)?;
        tx.execute(
            &format!(
                "INSERT INTO parked ({PARKED_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
                 ON CONFLICT (first_seq) DO UPDATE SET status = excluded.status,
                     attempts = excluded.attempts, last_error = excluded.last_error,
                     parked_at = excluded.parked_at"
            ),
            params![
                p.first_seq as i64,
                p.last_seq as i64,
                p.key,
                p.body,
                rows_to_blob(&p.rows),
                p.tables,
                p.status.as_str(),
                p.attempts as i64,
                p.last_error,
                p.parked_at
            ],
        )
        .map_err(err)?;
        // A batch held before its PUT may have no intent yet.
        tx.execute(
            "INSERT INTO intents (first_seq, last_seq, done) VALUES (?1, ?2, 1)
             ON CONFLICT (first_seq) DO UPDATE SET done = 1",
            params![p.first_seq as i64, p.last_seq as i64],
        )
        .map_err(err)?;
        tx.commit().map_err(err)
    }

    /// Every parked, held or replay-requested batch, in seq order.
    pub(crate) fn parked(&self) -> Result<Vec<Parked>> {
        let mut stmt = self
            .conn
            .prepare(&format!(
                "SELECT {PARKED_COLUMNS} FROM parked ORDER BY first_seq"
            ))
            .map_err(self.err())?;
        let rows = stmt.query_map([], parked_row).map_err(self.err())?;
        rows.collect::<Result<Vec<_>, _>>().map_err(self.err())
    }

    /// Forgets a parked or held batch once it is written.
    pub(crate) fn unpark(&mut self, first_seq: u64) -> Result<()> {
        self.conn
            .execute(
                "DELETE FROM parked WHERE first_seq = ?1",
                [first_seq as i64],
            )
            .map(|_| ())
            .map_err(self.err())
    }

    /// Asks the running pipeline to replay parked batches (`None`: all of
    /// them). Returns how many were marked.
    pub(crate) fn request_replay(&mut self, first_seq: Option<u64>) -> Result<usize> {
        let n = match first_seq {
            Some(id) => self.conn.execute(
                "UPDATE parked SET status = 'replay' WHERE first_seq = ?1 AND status = 'parked'",
                [id as i64],
            ),
            None => self.conn.execute(
                "UPDATE parked SET status = 'replay' WHERE status = 'parked'",
                [],
            ),
        };
        n.map_err(self.err())
    }

    /// A number that changes whenever another connection (e.g. `waltail
    /// parked replay`) has committed to this database: cheap to poll.
    pub(crate) fn data_version(&self) -> Result<i64> {
        self.conn
            .query_row("PRAGMA data_version", [], |r| r.get(0))
            .map_err(self.err())
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

/// One backfill of one table, as requested and as far as it got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Backfill {
    pub id: i64,
    pub schema: String,
    pub table: String,
    /// pending, running, done, cancelled or failed.
    pub status: String,
    pub chunk_size: u64,
    /// Rows expected (from the estimate shown before it started).
    pub estimate: u64,
    /// Rows read in chunks handed to the pipeline.
    pub rows_read: u64,
    /// Of those, rows sent as `read` events (the others changed while their
    /// chunk was read; the change itself carries them).
    pub rows_sent: u64,
    /// For a backfill begun before key ranges existed: the key (a JSON
    /// array of the key columns' text values) of the last row handed over,
    /// where its one range resumes. Ranges keep their own (see [`KeyRange`]).
    pub last_key: Option<String>,
    pub error: Option<String>,
    pub requested_at: String,
    pub finished_at: Option<String>,
}

impl Backfill {
    pub(crate) fn is_active(&self) -> bool {
        self.status == "pending" || self.status == "running"
    }

    /// As `status --json` and the console show it.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "table": format!("{}.{}", self.schema, self.table),
            "status": self.status,
            "rows_read": self.rows_read,
            "rows_sent": self.rows_sent,
            "estimate": self.estimate,
            "requested_at": self.requested_at,
            "finished_at": self.finished_at,
            "error": self.error,
        })
    }
}

/// A backfill chunk as the pipeline needs it when its high watermark arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub id: i64,
    pub backfill: i64,
    pub schema: String,
    pub table: String,
    /// The table's schema record members, as the stream would write them.
    pub members: Option<String>,
    /// Its rows are stored (the high watermark follows only then).
    pub stored: bool,
    pub done: bool,
    /// The reader that read it; its watermarks carry the same lane.
    pub lane: u32,
}

/// A part of a table's key space that one reader walks in chunks: keys
/// after `lo` up to and including `hi` (each a JSON array of the key
/// columns' text values; `None`: unbounded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyRange {
    pub id: i64,
    pub lo: Option<String>,
    pub hi: Option<String>,
    /// The key of the last row handed over; the next chunk starts after it.
    pub last_key: Option<String>,
    pub done: bool,
}

const BACKFILL_COLUMNS: &str = "id, schema_name, table_name, status, chunk_size, estimate, \
     rows_read, rows_sent, last_key, error, requested_at, finished_at";

fn backfill_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Backfill> {
    Ok(Backfill {
        id: r.get(0)?,
        schema: r.get(1)?,
        table: r.get(2)?,
        status: r.get(3)?,
        chunk_size: r.get::<_, i64>(4)? as u64,
        estimate: r.get::<_, i64>(5)? as u64,
        rows_read: r.get::<_, i64>(6)? as u64,
        rows_sent: r.get::<_, i64>(7)? as u64,
        last_key: r.get(8)?,
        error: r.get(9)?,
        requested_at: r.get(10)?,
        finished_at: r.get(11)?,
    })
}

fn now_text() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

impl Checkpoint {
    /// Records a backfill request; the pipeline's backfill task takes it.
    pub(crate) fn request_backfill(
        &mut self,
        schema: &str,
        table: &str,
        chunk_size: u64,
        estimate: u64,
    ) -> Result<i64> {
        self.conn
            .execute(
                "INSERT INTO backfills (schema_name, table_name, status, chunk_size, estimate, requested_at)
                 VALUES (?1, ?2, 'pending', ?3, ?4, ?5)",
                params![schema, table, chunk_size as i64, estimate as i64, now_text()],
            )
            .map_err(self.err())?;
        Ok(self.conn.last_insert_rowid())
    }

    /// Every backfill ever requested, oldest first.
    pub(crate) fn backfills(&self) -> Result<Vec<Backfill>> {
        let mut stmt = self
            .conn
            .prepare(&format!(
                "SELECT {BACKFILL_COLUMNS} FROM backfills ORDER BY id"
            ))
            .map_err(self.err())?;
        let rows = stmt.query_map([], backfill_row).map_err(self.err())?;
        rows.collect::<Result<Vec<_>, _>>().map_err(self.err())
    }

    /// Backfills in progress and the last `finished` finished ones, oldest
    /// first: what `status` and the console show.
    pub(crate) fn recent_backfills(&self, finished: usize) -> Result<Vec<Backfill>> {
        let all = self.backfills()?;
        let done: Vec<i64> = all
            .iter()
            .filter(|b| !b.is_active())
            .map(|b| b.id)
            .collect();
        let recent = &done[done.len().saturating_sub(finished)..];
        Ok(all
            .into_iter()
            .filter(|b| b.is_active() || recent.contains(&b.id))
            .collect())
    }

    pub(crate) fn backfill(&self, id: i64) -> Result<Option<Backfill>> {
        self.conn
            .query_row(
                &format!("SELECT {BACKFILL_COLUMNS} FROM backfills WHERE id = ?1"),
                [id],
                backfill_row,
            )
            .optional()
            .map_err(self.err())
    }

    /// The oldest backfill still to do (pending or running).
    pub(crate) fn next_backfill(&self) -> Result<Option<Backfill>> {
        self.conn
            .query_row(
                &format!(
                    "SELECT {BACKFILL_COLUMNS} FROM backfills
                     WHERE status IN ('pending', 'running') ORDER BY id LIMIT 1"
                ),
                [],
                backfill_row,
            )
            .optional()
            .map_err(self.err())
    }

    /// Moves an active backfill to `status` (running, failed, cancelled),
    /// with the error that ended it.
    pub(crate) fn set_backfill_status(
        &mut self,
        id: i64,
        status: &str,
        error: Option<&str>,
    ) -> Result<()> {
        let finished = (status != "running").then(now_text);
        self.conn
            .execute(
                "UPDATE backfills SET status = ?2, error = ?3, finished_at = ?4
                 WHERE id = ?1 AND status IN ('pending', 'running')",
                params![id, status, error, finished],
            )
            .map(|_| ())
            .map_err(self.err())
    }

    /// Cancels every pending or running backfill; returns how many.
    pub(crate) fn cancel_backfills(&mut self) -> Result<usize> {
        self.conn
            .execute(
                "UPDATE backfills SET status = 'cancelled', finished_at = ?1
                 WHERE status IN ('pending', 'running')",
                [now_text()],
            )
            .map_err(self.err())
    }

    /// The key ranges of `backfill`, in key order (none before its readers
    /// first start).
    pub(crate) fn ranges(&self, backfill: i64) -> Result<Vec<KeyRange>> {
        let mut stmt = self
            .conn
            .prepare("SELECT id, lo, hi, last_key, done FROM backfill_ranges WHERE backfill = ?1 ORDER BY id")
            .map_err(self.err())?;
        stmt.query_map([backfill], |r| {
            Ok(KeyRange {
                id: r.get(0)?,
                lo: r.get(1)?,
                hi: r.get(2)?,
                last_key: r.get(3)?,
                done: r.get(4)?,
            })
        })
        .and_then(|rows| rows.collect())
        .map_err(self.err())
    }

    /// Records the key ranges `(lo, hi)` of `backfill`, in key order; the
    /// first starts after `resume` (the position of a backfill begun before
    /// ranges existed) if given.
    pub(crate) fn add_ranges(
        &mut self,
        backfill: i64,
        ranges: &[(Option<String>, Option<String>)],
        resume: Option<&str>,
    ) -> Result<()> {
        let path = self.path.display().to_string();
        let err = |source| Error::State {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(err)?;
        for (i, (lo, hi)) in ranges.iter().enumerate() {
            tx.execute(
                "INSERT INTO backfill_ranges (backfill, lo, hi, last_key) VALUES (?1, ?2, ?3, ?4)",
                params![backfill, lo, hi, if i == 0 { resume } else { None }],
            )
            .map_err(err)?;
        }
        tx.commit().map_err(err)
    }

    /// A new chunk of `backfill` in key range `range`, read by reader
    /// `lane`, before its low watermark is written.
    pub(crate) fn new_chunk(&mut self, backfill: i64, range: i64, lane: u32) -> Result<i64> {
        self.conn
            .execute(
                "INSERT INTO backfill_chunks (backfill, range_id, lane) VALUES (?1, ?2, ?3)",
                params![backfill, range, lane],
            )
            .map_err(self.err())?;
        Ok(self.conn.last_insert_rowid())
    }

    /// The chunks of `backfill` that are not done, with their lanes: their
    /// high watermarks may still be on their way through the stream.
    pub(crate) fn unfinished_chunks(&self, backfill: i64) -> Result<Vec<(i64, u32)>> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT id, lane FROM backfill_chunks WHERE backfill = ?1 AND done = 0 ORDER BY id",
            )
            .map_err(self.err())?;
        stmt.query_map([backfill], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(|rows| rows.collect())
            .map_err(self.err())
    }

    /// Stores a chunk's rows `(row hash, data JSON)`, before its high
    /// watermark is written. The rows go in as one blob (see [`chunk_body`]):
    /// one write per chunk, not one per row.
    pub(crate) fn store_chunk(
        &mut self,
        chunk: i64,
        rows: &[(u64, Vec<u8>)],
        last_key: Option<&str>,
        is_last: bool,
        members: &str,
    ) -> Result<()> {
        self.conn
            .execute(
                "UPDATE backfill_chunks SET stored = 1, rows = ?2, last_key = ?3, is_last = ?4,
                     members = ?5, body = ?6
                 WHERE id = ?1",
                params![
                    chunk,
                    rows.len() as i64,
                    last_key,
                    is_last,
                    members,
                    chunk_body(rows)
                ],
            )
            .map(|_| ())
            .map_err(self.err())
    }

    pub(crate) fn chunk(&self, chunk: i64) -> Result<Option<Chunk>> {
        self.conn
            .query_row(
                "SELECT c.id, c.backfill, b.schema_name, b.table_name, c.members, c.stored, c.done, c.lane
                 FROM backfill_chunks c JOIN backfills b ON b.id = c.backfill WHERE c.id = ?1",
                [chunk],
                |r| {
                    Ok(Chunk {
                        id: r.get(0)?,
                        backfill: r.get(1)?,
                        schema: r.get(2)?,
                        table: r.get(3)?,
                        members: r.get(4)?,
                        stored: r.get(5)?,
                        done: r.get(6)?,
                        lane: r.get(7)?,
                    })
                },
            )
            .optional()
            .map_err(self.err())
    }

    /// A stored chunk's rows `(row hash, data JSON)`, in key order (empty
    /// once forgotten).
    pub(crate) fn chunk_rows(&self, chunk: i64) -> Result<Vec<(u64, Vec<u8>)>> {
        let body: Option<Vec<u8>> = self
            .conn
            .query_row(
                "SELECT body FROM backfill_chunks WHERE id = ?1",
                [chunk],
                |r| r.get(0),
            )
            .optional()
            .map_err(self.err())?
            .flatten();
        chunk_rows_of(body.as_deref().unwrap_or_default()).ok_or_else(|| {
            Error::fatal(
                format!(
                    "backfill chunk {chunk} in {} is damaged",
                    self.path.display()
                ),
                "cancel the backfill (`waltail backfill --cancel`) and start it again",
            )
            .with_kind(ErrorKind::State)
        })
    }

    /// The places (in key order) of the rows a done chunk left out at its
    /// high watermark: they changed inside its window.
    pub(crate) fn chunk_skipped(&self, chunk: i64) -> Result<Vec<u32>> {
        let blob: Option<Vec<u8>> = self
            .conn
            .query_row(
                "SELECT skipped FROM backfill_chunks WHERE id = ?1",
                [chunk],
                |r| r.get(0),
            )
            .optional()
            .map_err(self.err())?
            .flatten();
        Ok(blob
            .unwrap_or_default()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("four bytes")))
            .collect())
    }

    /// Records that a chunk's rows were handed to the pipeline (`sent` of
    /// them as `read` events; the rows at the places `skipped` left out) at
    /// the high watermark ending at `hw_end`: its key range moves past its
    /// last key and is done after its last chunk; the backfill is done when
    /// every range is. Idempotent: a chunk seen again after a restart
    /// counts once.
    pub(crate) fn complete_chunk(
        &mut self,
        chunk: i64,
        hw_end: u64,
        sent: u64,
        skipped: &[u32],
    ) -> Result<()> {
        let path = self.path.display().to_string();
        let err = |source| Error::State {
            path: path.clone(),
            source,
        };
        let skipped: Vec<u8> = skipped.iter().flat_map(|i| i.to_le_bytes()).collect();
        let tx = self.conn.transaction().map_err(err)?;
        let changed = tx
            .execute(
                "UPDATE backfill_chunks SET done = 1, hw_end = ?2, skipped = ?3 WHERE id = ?1 AND done = 0",
                params![chunk, hw_end as i64, skipped],
            )
            .map_err(err)?;
        if changed == 1 {
            tx.execute(
                "UPDATE backfill_ranges SET
                     last_key = COALESCE((SELECT last_key FROM backfill_chunks WHERE id = ?1), last_key),
                     done = MAX(done, (SELECT is_last FROM backfill_chunks WHERE id = ?1))
                 WHERE id = (SELECT range_id FROM backfill_chunks WHERE id = ?1)",
                [chunk],
            )
            .map_err(err)?;
            // A chunk without a range was read before ranges existed: its
            // table was one walk, which its last chunk ends.
            tx.execute(
                "WITH c AS (SELECT * FROM backfill_chunks WHERE id = ?1),
                      finished AS (SELECT CASE WHEN c.range_id IS NULL THEN c.is_last = 1
                          ELSE NOT EXISTS (SELECT 1 FROM backfill_ranges r
                                           WHERE r.backfill = c.backfill AND r.done = 0) END AS yes FROM c)
                 UPDATE backfills SET
                     rows_read = rows_read + (SELECT rows FROM c),
                     rows_sent = rows_sent + ?2,
                     last_key = CASE WHEN (SELECT range_id FROM c) IS NULL
                                     THEN COALESCE((SELECT last_key FROM c), last_key) ELSE last_key END,
                     status = CASE WHEN (SELECT yes FROM finished)
                                   AND status IN ('pending', 'running') THEN 'done' ELSE status END,
                     finished_at = CASE WHEN (SELECT yes FROM finished) THEN ?3 ELSE finished_at END
                 WHERE id = (SELECT backfill FROM c)",
                params![chunk, sent as i64, now_text()],
            )
            .map_err(err)?;
        }
        tx.commit().map_err(err)
    }

    /// Drops the rows of every chunk up to the last one of its lane whose
    /// high watermark is confirmed (at or before `confirmed_lsn`): the
    /// stream will not bring those watermarks again. By lane, because a
    /// lane's chunks pass through the stream one after another, while
    /// another lane's chunk with a lower id may still be on its way.
    pub(crate) fn forget_chunks(&mut self, confirmed_lsn: u64) -> Result<()> {
        self.conn
            .execute(
                "UPDATE backfill_chunks SET body = NULL WHERE body IS NOT NULL AND id <= (
                     SELECT COALESCE(MAX(d.id), 0) FROM backfill_chunks d
                     WHERE d.done = 1 AND d.hw_end <= ?1 AND d.lane = backfill_chunks.lane)",
                [confirmed_lsn as i64],
            )
            .map(|_| ())
            .map_err(self.err())
    }
}

/// A chunk's rows as one blob: per row, the row hash (8 bytes LE), the
/// data's length (4 bytes LE) and the data.
fn chunk_body(rows: &[(u64, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.iter().map(|(_, d)| d.len() + 12).sum());
    for (hash, data) in rows {
        out.extend_from_slice(&hash.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(data);
    }
    out
}

/// The rows of [`chunk_body`]; `None` if the blob is cut short.
fn chunk_rows_of(mut body: &[u8]) -> Option<Vec<(u64, Vec<u8>)>> {
    let mut rows = Vec::new();
    while !body.is_empty() {
        let hash = u64::from_le_bytes(body.get(..8)?.try_into().ok()?);
        let len = u32::from_le_bytes(body.get(8..12)?.try_into().ok()?) as usize;
        rows.push((hash, body.get(12..12 + len)?.to_vec()));
        body = &body[12 + len..];
    }
    Some(rows)
}

/// A progress sample: at `at` (Unix seconds) the next seq was `next_seq`
/// and the last object written was `last_key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Progress {
    pub at: i64,
    pub next_seq: u64,
    pub last_key: Option<String>,
}

/// Samples older than this are dropped: `waltail status` shows the recent rate.
const PROGRESS_KEEP_SECS: i64 = 600;

impl Checkpoint {
    /// Records a progress sample (for `waltail status`), keeping ten minutes.
    pub(crate) fn record_progress(&mut self, p: &Progress) -> Result<()> {
        let path = self.path.display().to_string();
        let err = |source| Error::State {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(err)?;
        tx.execute(
            "INSERT OR REPLACE INTO progress (at, next_seq, last_key) VALUES (?1, ?2, ?3)",
            params![p.at, p.next_seq as i64, p.last_key],
        )
        .map_err(err)?;
        tx.execute(
            "DELETE FROM progress WHERE at < ?1",
            [p.at - PROGRESS_KEEP_SECS],
        )
        .map_err(err)?;
        tx.commit().map_err(err)
    }

    /// Progress samples, oldest first.
    pub(crate) fn progress(&self) -> Result<Vec<Progress>> {
        let mut stmt = self
            .conn
            .prepare("SELECT at, next_seq, last_key FROM progress ORDER BY at")
            .map_err(self.err())?;
        let rows = stmt
            .query_map([], |r| {
                Ok(Progress {
                    at: r.get(0)?,
                    next_seq: r.get::<_, i64>(1)? as u64,
                    last_key: r.get(2)?,
                })
            })
            .map_err(self.err())?;
        rows.collect::<Result<Vec<_>, _>>().map_err(self.err())
    }
}

impl Checkpoint {
    /// Like [`Checkpoint::parked`], without the batches' bytes and rows (left
    /// empty): for listings polled often, such as the console's.
    pub(crate) fn parked_listing(&self) -> Result<Vec<Parked>> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT first_seq, last_seq, key, X'', X'', tables, status, attempts, last_error, parked_at
                 FROM parked ORDER BY first_seq",
            )
            .map_err(self.err())?;
        let rows = stmt.query_map([], parked_row).map_err(self.err())?;
        rows.collect::<Result<Vec<_>, _>>().map_err(self.err())
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

    #[test]
    fn backfill_chunks_complete_once_and_are_forgotten_when_confirmed() {
        let dir = tempfile::tempdir().unwrap();
        let mut cp = Checkpoint::open(&dir.path().join("s.sqlite")).unwrap();
        let id = cp.request_backfill("public", "t", 2, 3).unwrap();
        cp.add_ranges(
            id,
            &[
                (None, Some(r#"["2"]"#.into())),
                (Some(r#"["2"]"#.into()), None),
            ],
            None,
        )
        .unwrap();
        let ranges = cp.ranges(id).unwrap();
        assert_eq!(ranges.len(), 2);
        let rows = vec![(7u64, b"{\"id\":1}".to_vec()), (u64::MAX, Vec::new())];
        // Lane 0 reads the first range, lane 1 the second, at once.
        let c1 = cp.new_chunk(id, ranges[0].id, 0).unwrap();
        let c2 = cp.new_chunk(id, ranges[1].id, 1).unwrap();
        assert_eq!(cp.unfinished_chunks(id).unwrap(), vec![(c1, 0), (c2, 1)]);
        cp.store_chunk(c1, &rows, Some(r#"["2"]"#), true, "m")
            .unwrap();
        cp.store_chunk(c2, &rows[..1], Some(r#"["3"]"#), false, "m")
            .unwrap();
        assert_eq!(cp.chunk_rows(c1).unwrap(), rows);
        let chunk = cp.chunk(c1).unwrap().unwrap();
        assert!(chunk.stored && !chunk.done);
        assert_eq!(
            (chunk.schema.as_str(), chunk.table.as_str(), chunk.lane),
            ("public", "t", 0)
        );
        // Seen again after a restart: counted once; its left-out rows kept.
        cp.complete_chunk(c2, 100, 1, &[]).unwrap();
        cp.complete_chunk(c1, 150, 1, &[1]).unwrap();
        cp.complete_chunk(c1, 150, 1, &[1]).unwrap();
        assert_eq!(cp.chunk_skipped(c1).unwrap(), vec![1]);
        let b = cp.backfill(id).unwrap().unwrap();
        assert_eq!(
            (b.rows_read, b.rows_sent, b.status.as_str()),
            (3, 2, "pending")
        );
        // Ranges keep their positions; the backfill's own is for one walk.
        assert_eq!(b.last_key, None);
        let ranges = cp.ranges(id).unwrap();
        assert!(ranges[0].done && !ranges[1].done);
        assert_eq!(ranges[1].last_key.as_deref(), Some(r#"["3"]"#));
        assert_eq!(cp.unfinished_chunks(id).unwrap(), vec![]);
        // Lane 1's next chunk: its range, and so the backfill, is done.
        let c3 = cp.new_chunk(id, ranges[1].id, 1).unwrap();
        // Lane 0's chunk c4, after c3 by id, is still on its way.
        let c4 = cp.new_chunk(id, ranges[0].id, 0).unwrap();
        cp.store_chunk(c4, &rows, None, false, "m").unwrap();
        cp.store_chunk(c3, &rows[..1], None, true, "m").unwrap();
        cp.complete_chunk(c3, 200, 1, &[]).unwrap();
        assert_eq!(cp.backfill(id).unwrap().unwrap().status, "done");
        // Rows stay until their high watermark is confirmed, by lane: c3's
        // confirmation does not take c4 (lane 0, not done) with it.
        cp.forget_chunks(120).unwrap();
        assert!(cp.chunk_rows(c2).unwrap().is_empty());
        assert_eq!(cp.chunk_rows(c1).unwrap().len(), 2);
        cp.forget_chunks(200).unwrap();
        assert!(cp.chunk_rows(c1).unwrap().is_empty());
        assert!(cp.chunk_rows(c3).unwrap().is_empty());
        assert_eq!(cp.chunk_rows(c4).unwrap().len(), 2);
    }

    /// A state from before ranges and lanes: its chunk tables gain their
    /// columns, and a chunk read then (no range) completes its backfill as
    /// one walk did.
    #[test]
    fn a_backfill_begun_before_ranges_completes_as_one_walk() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sqlite");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "CREATE TABLE backfill_chunks (
                     id INTEGER PRIMARY KEY AUTOINCREMENT, backfill INTEGER NOT NULL,
                     members TEXT, last_key TEXT, rows INTEGER NOT NULL DEFAULT 0,
                     is_last INTEGER NOT NULL DEFAULT 0, stored INTEGER NOT NULL DEFAULT 0,
                     done INTEGER NOT NULL DEFAULT 0, hw_end INTEGER, body BLOB);
                 INSERT INTO backfill_chunks (backfill, last_key, rows, is_last, stored)
                     VALUES (1, '[\"9\"]', 4, 1, 1);",
            )
            .unwrap();
        }
        let mut cp = Checkpoint::open(&path).unwrap();
        let id = cp.request_backfill("public", "t", 2, 3).unwrap();
        assert_eq!(id, 1);
        assert_eq!(cp.unfinished_chunks(id).unwrap(), vec![(1, 0)]);
        cp.complete_chunk(1, 10, 4, &[]).unwrap();
        let b = cp.backfill(id).unwrap().unwrap();
        assert_eq!(
            (b.status.as_str(), b.last_key.as_deref()),
            ("done", Some(r#"["9"]"#))
        );
    }

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
    fn a_cut_chunk_body_is_refused() {
        let body = chunk_body(&[(1, b"abc".to_vec())]);
        assert!(chunk_rows_of(&body[..body.len() - 1]).is_none());
        assert_eq!(chunk_rows_of(&body).unwrap(), vec![(1, b"abc".to_vec())]);
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

    /// A parked batch of seqs `first_seq..first_seq + 9` touching `rows`
    /// of `public.t` (the parking lot's tests use it too).
    pub(crate) fn parked(first_seq: u64, rows: &[u64], status: ParkStatus) -> Parked {
        Parked {
            first_seq,
            last_seq: first_seq + 9,
            key: format!("k{first_seq}"),
            body: b"{}\n".to_vec(),
            rows: rows.to_vec(),
            tables: "public.t".into(),
            status,
            attempts: 5,
            last_error: Some("boom".into()),
            parked_at: "2026-01-01T00:00:00Z".into(),
        }
    }

    #[test]
    fn parked_batches_round_trip_and_mark_their_intent_done() {
        let dir = tempfile::tempdir().unwrap();
        let mut cp = Checkpoint::open(&dir.path().join("p.sqlite")).unwrap();
        cp.record_intent(1, 10, Codec::None).unwrap();
        cp.park(&parked(1, &[7, 8], ParkStatus::Parked)).unwrap();
        assert!(cp.open_intents(1).unwrap()[0].done);
        let got = cp.parked().unwrap();
        assert_eq!(got[0].rows, vec![7, 8]);
        assert_eq!(got[0].last_error.as_deref(), Some("boom"));
        assert_eq!(cp.request_replay(None).unwrap(), 1);
        assert_eq!(cp.parked().unwrap()[0].status, ParkStatus::Replay);
        cp.unpark(1).unwrap();
        assert!(cp.parked().unwrap().is_empty());
    }

    #[test]
    fn parked_listing_leaves_out_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let mut cp = Checkpoint::open(&dir.path().join("p.sqlite")).unwrap();
        cp.park(&parked(1, &[7], ParkStatus::Parked)).unwrap();
        cp.park(&parked(11, &[7], ParkStatus::Held)).unwrap();
        let listed = cp.parked_listing().unwrap();
        assert_eq!(listed.len(), 2);
        assert_eq!((listed[0].key.as_str(), listed[0].attempts), ("k1", 5));
        assert_eq!(listed[1].status, ParkStatus::Held);
        assert!(
            listed
                .iter()
                .all(|p| p.body.is_empty() && p.rows.is_empty())
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
