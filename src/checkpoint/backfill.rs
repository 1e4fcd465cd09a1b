//! The backfills' side of the state: what was asked, how far each got,
//! and the rows of the chunks whose high watermark is not confirmed yet,
//! so a restart emits the same `read` events with the same bytes (see
//! `source::backfill`); and the progress samples `waltail status` shows.

use rusqlite::{OptionalExtension, params};

use super::Checkpoint;
use super::chunks::{ChunkBody, ChunkFiles};
use crate::error::ErrorKind;
use crate::{Error, Result};

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

    /// Stores a chunk's rows, before its high watermark is written: in the
    /// chunk's file (see [`chunks`]), synced, then the chunk marked stored.
    pub(crate) fn store_chunk(
        &mut self,
        chunk: i64,
        rows: &ChunkBody,
        last_key: Option<&str>,
        is_last: bool,
        members: &str,
    ) -> Result<()> {
        let files = self.chunk_files();
        super::create_private_dir(files.dir())?;
        files.write(chunk, rows).map_err(|e| {
            Error::io(
                format!(
                    "cannot store the rows of backfill chunk {chunk} in {}",
                    files.dir().display()
                ),
                e,
            )
        })?;
        self.conn
            .execute(
                "UPDATE backfill_chunks SET stored = 1, rows = ?2, last_key = ?3, is_last = ?4,
                     members = ?5
                 WHERE id = ?1",
                params![chunk, rows.len() as i64, last_key, is_last, members],
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

    /// A stored chunk's rows, in key order (empty once forgotten). A state
    /// of an earlier release may hold them in the database instead of a
    /// file.
    pub(crate) fn chunk_rows(&self, chunk: i64) -> Result<ChunkBody> {
        let found: Option<(bool, bool, Option<Vec<u8>>)> = self
            .conn
            .query_row(
                "SELECT stored, kept, body FROM backfill_chunks WHERE id = ?1",
                [chunk],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
            .map_err(self.err())?;
        let Some((stored, true, body)) = found else {
            return Ok(ChunkBody::default());
        };
        let files = self.chunk_files();
        let file = files.read(chunk).map_err(|e| {
            Error::io(
                format!(
                    "cannot read the rows of backfill chunk {chunk} in {}",
                    files.dir().display()
                ),
                e,
            )
        })?;
        let rows = match (file, body) {
            (Some(file), _) => file,
            (None, Some(body)) => ChunkBody::from_bytes(body),
            (None, None) if stored => None,
            (None, None) => Some(ChunkBody::default()),
        };
        rows.ok_or_else(|| {
            Error::fatal(
                format!(
                    "the rows of backfill chunk {chunk} in {} are damaged or missing",
                    files.dir().display()
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
        let path = self.path.display().to_string();
        let err = |source| Error::State {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(err)?;
        let forgotten: Vec<i64> = tx
            .prepare(
                "UPDATE backfill_chunks SET kept = 0, body = NULL WHERE kept = 1 AND id <= (
                     SELECT COALESCE(MAX(d.id), 0) FROM backfill_chunks d
                     WHERE d.done = 1 AND d.hw_end <= ?1 AND d.lane = backfill_chunks.lane)
                 RETURNING id",
            )
            .and_then(|mut stmt| {
                stmt.query_map([confirmed_lsn as i64], |r| r.get(0))?
                    .collect()
            })
            .map_err(err)?;
        tx.commit().map_err(err)?;
        let files = self.chunk_files();
        for chunk in forgotten {
            files
                .remove(chunk)
                .map_err(|e| self.file_error(&files, "remove", e))?;
        }
        Ok(())
    }

    /// Removes chunk files whose rows are no longer kept (left when a
    /// process stopped between forgetting a chunk and removing its file, or
    /// while writing a chunk it never stored and has since forgotten).
    /// Safe while readers store chunks: a chunk's row is in the state,
    /// kept, before its file is written.
    pub(crate) fn sweep_chunk_files(&self) -> Result<()> {
        let kept: std::collections::HashSet<i64> = self
            .conn
            .prepare("SELECT id FROM backfill_chunks WHERE kept = 1")
            .and_then(|mut stmt| stmt.query_map([], |r| r.get(0))?.collect())
            .map_err(self.err())?;
        let files = self.chunk_files();
        let removed = files
            .sweep(|chunk| kept.contains(&chunk))
            .map_err(|e| self.file_error(&files, "sweep", e))?;
        if removed > 0 {
            tracing::debug!(removed, dir = %files.dir().display(), "removed chunk files no longer kept");
        }
        Ok(())
    }

    fn chunk_files(&self) -> ChunkFiles {
        ChunkFiles::beside(&self.path)
    }

    fn file_error(&self, files: &ChunkFiles, doing: &str, e: std::io::Error) -> Error {
        Error::io(
            format!(
                "cannot {doing} backfill chunk files in {}",
                files.dir().display()
            ),
            e,
        )
    }
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

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

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
        let mut rows = ChunkBody::default();
        rows.push(7, b"{\"id\":1}");
        rows.push(u64::MAX, b"");
        let mut first = ChunkBody::default();
        first.push(7, b"{\"id\":1}");
        // Lane 0 reads the first range, lane 1 the second, at once.
        let c1 = cp.new_chunk(id, ranges[0].id, 0).unwrap();
        let c2 = cp.new_chunk(id, ranges[1].id, 1).unwrap();
        assert_eq!(cp.unfinished_chunks(id).unwrap(), vec![(c1, 0), (c2, 1)]);
        cp.store_chunk(c1, &rows, Some(r#"["2"]"#), true, "m")
            .unwrap();
        cp.store_chunk(c2, &first, Some(r#"["3"]"#), false, "m")
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
        cp.store_chunk(c3, &first, None, true, "m").unwrap();
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
        // The rows live in files beside the state; forgotten ones are gone.
        let file = |c: i64| dir.path().join(format!("s.chunks/{c}.rows"));
        assert!(!file(c1).exists() && !file(c2).exists() && !file(c3).exists());
        assert!(file(c4).exists());
        // A file left behind (a stop between the forgetting and the removal)
        // goes at the next sweep; a kept chunk's file stays.
        std::fs::write(file(c1), b"left").unwrap();
        cp.sweep_chunk_files().unwrap();
        assert!(!file(c1).exists() && file(c4).exists());
        // A kept chunk whose file is gone is an error, not an empty chunk.
        std::fs::remove_file(file(c4)).unwrap();
        let err = cp.chunk_rows(c4).unwrap_err().to_string();
        assert!(err.contains("damaged or missing"), "{err}");
    }

    /// A state of an earlier release kept chunk rows in the database: they
    /// are read from there until forgotten.
    #[test]
    fn chunk_rows_kept_in_the_database_by_an_earlier_release_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sqlite");
        let mut cp = Checkpoint::open(&path).unwrap();
        let id = cp.request_backfill("public", "t", 2, 3).unwrap();
        let c = cp.new_chunk(id, 0, 0).unwrap();
        let mut rows = ChunkBody::default();
        rows.push(1, b"abc");
        // The layout of a chunk file's rows, which is how it was kept.
        let body: Vec<u8> = [&1u64.to_le_bytes()[..], &3u32.to_le_bytes(), b"abc"].concat();
        cp.conn
            .execute(
                "UPDATE backfill_chunks SET stored = 1, rows = 1, body = ?2 WHERE id = ?1",
                params![c, body],
            )
            .unwrap();
        assert_eq!(cp.chunk_rows(c).unwrap(), rows);
        cp.complete_chunk(c, 10, 1, &[]).unwrap();
        cp.forget_chunks(10).unwrap();
        assert!(cp.chunk_rows(c).unwrap().is_empty());
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
}
