//! The rows of backfill chunks that wait for their high watermark to be
//! confirmed: one file per chunk in a folder beside the state file
//! (`<pipeline>.chunks/<chunk>.rows`), while the state's tables say what
//! each chunk is and whether its rows are stored.
//!
//! Why files and not a blob in the database: a chunk is about a megabyte.
//! In SQLite it was written twice (the WAL, then the database at a
//! checkpoint) page by page, read back page by page, and every reader's
//! store held the database's single write lock meanwhile, so the
//! pipeline's own commits (intents, the cursor) waited behind it. A file is
//! one write and one `fsync`, one read, and one `unlink`, and the lock is
//! held only for the chunk's row of metadata.
//!
//! A file is complete before the chunk is marked stored: written, synced,
//! its folder synced, then the state's commit. A chunk the state does not
//! say is stored is never read, so a file cut short by a crash is only
//! garbage, removed when its chunk is forgotten or by [`ChunkFiles::sweep`].

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};

/// The size of the writes a chunk file is written in.
const WRITE_BYTES: usize = 256 << 10;

/// The first bytes of a chunk file; the version of its layout.
const MAGIC: &[u8; 8] = b"wtchunk1";

/// Where the chunk files of one state live.
#[derive(Debug, Clone)]
pub(super) struct ChunkFiles {
    dir: PathBuf,
}

impl ChunkFiles {
    /// The folder beside the state file `state` (`x.sqlite` → `x.chunks`).
    pub(super) fn beside(state: &Path) -> ChunkFiles {
        ChunkFiles {
            dir: state.with_extension("chunks"),
        }
    }

    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, chunk: i64) -> PathBuf {
        self.dir.join(format!("{chunk}.rows"))
    }

    /// Writes a chunk's rows and makes them durable: the file and the
    /// folder's entry for it are synced before this returns. The folder
    /// must exist (the state creates it as its own, private).
    pub(super) fn write(&self, chunk: i64, rows: &[(u64, Vec<u8>)]) -> std::io::Result<()> {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(self.path(chunk))?;
        // Through a small buffer: a whole chunk (megabytes) in one write
        // spent several times longer in the kernel's copy into the page
        // cache than the same bytes in quarter-megabyte writes (`perf`
        // over scripts/bench-backfill.sh), and no copy of the chunk is made.
        let mut out = BufWriter::with_capacity(WRITE_BYTES, file);
        encode(rows, &mut out)?;
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_data()?;
        File::open(&self.dir)?.sync_all()
    }

    /// A chunk's file, or `None` if there is none.
    pub(super) fn read(&self, chunk: i64) -> std::io::Result<Option<Vec<u8>>> {
        match std::fs::read(self.path(chunk)) {
            Ok(body) => Ok(Some(body)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes a chunk's file if there is one. No sync: a removal lost in
    /// a crash leaves a file [`ChunkFiles::sweep`] removes later.
    pub(super) fn remove(&self, chunk: i64) -> std::io::Result<()> {
        match std::fs::remove_file(self.path(chunk)) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Removes the files of the chunks `wanted` says are not wanted (and
    /// any other file in the folder); returns how many.
    pub(super) fn sweep(&self, wanted: impl Fn(i64) -> bool) -> std::io::Result<usize> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut removed = 0;
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            let chunk = name
                .to_str()
                .and_then(|n| n.strip_suffix(".rows"))
                .and_then(|n| n.parse::<i64>().ok());
            if chunk.is_none_or(|c| !wanted(c)) {
                match std::fs::remove_file(entry.path()) {
                    Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
                    _ => removed += 1,
                }
            }
        }
        Ok(removed)
    }
}

/// A chunk file: [`MAGIC`], the number of rows (4 bytes LE), then the rows
/// as [`encode_rows`] lays them out.
pub(super) fn encode(rows: &[(u64, Vec<u8>)], out: &mut impl Write) -> std::io::Result<()> {
    out.write_all(MAGIC)?;
    out.write_all(&(rows.len() as u32).to_le_bytes())?;
    encode_rows(rows, out)
}

/// The rows of a chunk file; `None` if it is not one or is cut short.
pub(super) fn decode(file: &[u8]) -> Option<Vec<(u64, Vec<u8>)>> {
    let rest = file.strip_prefix(MAGIC)?;
    let count = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    decode_rows(&rest[4..]).filter(|rows| rows.len() == count)
}

/// Per row: the row hash (8 bytes LE), the data's length (4 bytes LE) and
/// the data. A state written by an earlier release holds its chunks' rows
/// in this layout in the database.
pub(super) fn encode_rows(rows: &[(u64, Vec<u8>)], out: &mut impl Write) -> std::io::Result<()> {
    for (hash, data) in rows {
        out.write_all(&hash.to_le_bytes())?;
        out.write_all(&(data.len() as u32).to_le_bytes())?;
        out.write_all(data)?;
    }
    Ok(())
}

/// The rows of [`encode_rows`]; `None` if they are cut short.
pub(super) fn decode_rows(mut body: &[u8]) -> Option<Vec<(u64, Vec<u8>)>> {
    let mut rows = Vec::new();
    while !body.is_empty() {
        let hash = u64::from_le_bytes(body.get(..8)?.try_into().ok()?);
        let len = u32::from_le_bytes(body.get(8..12)?.try_into().ok()?) as usize;
        rows.push((hash, body.get(12..12 + len)?.to_vec()));
        body = &body[12 + len..];
    }
    Some(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_or_foreign_chunk_file_is_refused() {
        let rows = vec![(1, b"abc".to_vec()), (2, Vec::new())];
        let mut file = Vec::new();
        encode(&rows, &mut file).unwrap();
        assert_eq!(decode(&file).unwrap(), rows);
        // Cut inside a row, and cut at a row's end (the count tells).
        assert!(decode(&file[..file.len() - 1]).is_none());
        assert!(decode(&file[..file.len() - 12]).is_none());
        assert!(decode(&file[8..]).is_none(), "no magic");
        let mut legacy = Vec::new();
        encode_rows(&rows, &mut legacy).unwrap();
        assert_eq!(decode_rows(&legacy).unwrap(), rows);
        assert!(decode_rows(&legacy[..legacy.len() - 13]).is_none());
    }

    #[test]
    fn files_are_written_read_removed_and_swept() {
        let dir = tempfile::tempdir().unwrap();
        let files = ChunkFiles::beside(&dir.path().join("p.sqlite"));
        assert_eq!(files.dir(), dir.path().join("p.chunks"));
        assert_eq!(files.read(1).unwrap(), None);
        assert_eq!(files.sweep(|_| false).unwrap(), 0, "no folder yet");
        std::fs::create_dir(files.dir()).unwrap();
        for chunk in 1..=3 {
            files
                .write(chunk, &[(chunk as u64, b"x".to_vec())])
                .unwrap();
        }
        std::fs::write(files.dir().join("stray.tmp"), b"").unwrap();
        assert_eq!(
            decode(&files.read(2).unwrap().unwrap()).unwrap(),
            vec![(2, b"x".to_vec())]
        );
        files.remove(1).unwrap();
        files.remove(1).unwrap();
        assert_eq!(files.read(1).unwrap(), None);
        assert_eq!(files.sweep(|c| c == 3).unwrap(), 2, "2.rows and stray.tmp");
        assert!(files.read(3).unwrap().is_some());
        assert_eq!(files.read(2).unwrap(), None);
    }
}
