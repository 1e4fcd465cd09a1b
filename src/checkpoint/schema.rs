//! The state file's tables, created when missing, and the columns added
//! to them since the first release (a state written by an earlier release
//! opens as it is and gains them).

use rusqlite::Connection;

/// Creates what a state file lacks: its tables, and the columns added
/// since its release wrote it.
pub(super) fn create(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(SCHEMA)?;
    for (table, column, decl) in ADDED_COLUMNS {
        add_column(conn, table, column, decl)?;
    }
    Ok(())
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
const ADDED_COLUMNS: [(&str, &str, &str); 5] = [
    ("intents", "codec", "TEXT"),
    // Parallel backfill: the key range a chunk reads, the reader (lane) it
    // belongs to, and which of its rows were left out at its high watermark.
    ("backfill_chunks", "range_id", "INTEGER"),
    ("backfill_chunks", "lane", "INTEGER NOT NULL DEFAULT 0"),
    ("backfill_chunks", "skipped", "BLOB"),
    // Chunk rows in files beside the state: whether a chunk's rows are
    // kept (in its file, or in `body` for a state of an earlier release)
    // or forgotten.
    ("backfill_chunks", "kept", "INTEGER NOT NULL DEFAULT 1"),
];
