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
//! one write and one `fsync`, and one `unlink`, and the lock is held only
//! for the chunk's row of metadata. It is read back only after a restart,
//! or for a chunk the hand-over no longer holds: the pipeline gets the rows
//! in memory otherwise (`source::backfill::handoff`).
//!
//! A file is complete before the chunk is marked stored: written, synced,
//! its folder synced, then the state's commit. A chunk the state does not
//! say is stored is never read, so a file cut short by a crash is only
//! garbage, removed when its chunk is forgotten or by [`ChunkFiles::sweep`].

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
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
    pub(super) fn write(&self, chunk: i64, rows: &ChunkBody) -> std::io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(self.path(chunk))?;
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(MAGIC);
        header[8..].copy_from_slice(&(rows.len() as u32).to_le_bytes());
        file.write_all(&header)?;
        // In quarter-megabyte writes: a whole chunk (megabytes) in one write
        // spent several times longer in the kernel's copy into the page
        // cache than the same bytes in pieces (`perf` over
        // scripts/bench-backfill.sh).
        for part in rows.bytes.chunks(WRITE_BYTES) {
            file.write_all(part)?;
        }
        file.sync_data()?;
        File::open(&self.dir)?.sync_all()
    }

    /// A chunk's rows from its file: `Ok(None)` if there is no file,
    /// `Ok(Some(None))` if it is not a chunk file or is cut short.
    pub(super) fn read(&self, chunk: i64) -> std::io::Result<Option<Option<ChunkBody>>> {
        let mut file = match File::open(self.path(chunk)) {
            Ok(file) => file,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let size = file.metadata()?.len() as usize;
        let mut header = [0u8; HEADER];
        match file.read_exact(&mut header) {
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(Some(None)),
            other => other?,
        }
        let mut body = Vec::with_capacity(size.saturating_sub(HEADER));
        file.read_to_end(&mut body)?;
        Ok(Some(decode(&header, body)))
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

/// A chunk file's header: [`MAGIC`], then the number of rows (4 bytes LE).
const HEADER: usize = 12;

/// The rows of a chunk file whose first [`HEADER`] bytes are `header` and
/// the rest `body`; `None` if it is not one or is cut short.
fn decode(header: &[u8; HEADER], body: Vec<u8>) -> Option<ChunkBody> {
    let count = header.strip_prefix(MAGIC.as_slice())?;
    let count = u32::from_le_bytes(count.try_into().ok()?) as usize;
    ChunkBody::from_bytes(body).filter(|rows| rows.len() == count)
}

/// A chunk's rows in one buffer, as a chunk file holds them after its
/// header: per row, the row hash (8 bytes LE), the data's length (4 bytes
/// LE) and the data (the row's JSON object). A backfill reader renders
/// rows straight into it, its file is these bytes behind a header, and the
/// pipeline emits from it (in memory, or read back from the file after a
/// restart), so no row is allocated on its own on the way. A state written
/// by an earlier release holds its chunks' rows in this layout in the
/// database.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct ChunkBody {
    bytes: Vec<u8>,
    rows: usize,
}

impl ChunkBody {
    /// The bytes before each row's data: its hash and its data's length.
    pub(crate) const ROW_HEAD: usize = 12;

    /// Empty, with room for `bytes` of rows.
    pub(crate) fn with_capacity(bytes: usize) -> ChunkBody {
        ChunkBody {
            bytes: Vec::with_capacity(bytes),
            rows: 0,
        }
    }

    /// Appends a row whose data `render` appends to the buffer it is
    /// given; `render` returns the row's hash.
    pub(crate) fn push_with(&mut self, render: impl FnOnce(&mut Vec<u8>) -> u64) {
        let at = self.bytes.len();
        self.bytes.extend_from_slice(&[0; Self::ROW_HEAD]);
        let hash = render(&mut self.bytes);
        let len = u32::try_from(self.bytes.len() - at - Self::ROW_HEAD).expect("a row under 4 GiB");
        self.bytes[at..at + 8].copy_from_slice(&hash.to_le_bytes());
        self.bytes[at + 8..at + Self::ROW_HEAD].copy_from_slice(&len.to_le_bytes());
        self.rows += 1;
    }

    /// Appends a row.
    #[cfg(test)]
    pub(crate) fn push(&mut self, hash: u64, data: &[u8]) {
        self.push_with(|out| {
            out.extend_from_slice(data);
            hash
        });
    }

    /// How many rows.
    pub(crate) fn len(&self) -> usize {
        self.rows
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The bytes of the rows' data, without their hashes and lengths.
    pub(crate) fn data_bytes(&self) -> usize {
        self.bytes.len() - self.rows * Self::ROW_HEAD
    }

    /// The rows `(row hash, data)`, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &[u8])> + '_ {
        let mut rest = self.bytes.as_slice();
        std::iter::from_fn(move || {
            let (head, tail) = rest.split_first_chunk::<{ Self::ROW_HEAD }>()?;
            let hash = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
            let len = u32::from_le_bytes(head[8..].try_into().expect("4 bytes")) as usize;
            let (data, tail) = tail.split_at(len);
            rest = tail;
            Some((hash, data))
        })
    }

    /// Rows laid out as [`ChunkBody`] lays them out; `None` if they are cut
    /// short.
    pub(super) fn from_bytes(bytes: Vec<u8>) -> Option<ChunkBody> {
        let mut rows = 0;
        let mut rest = bytes.as_slice();
        while let Some((head, tail)) = rest.split_first_chunk::<{ Self::ROW_HEAD }>() {
            let len = u32::from_le_bytes(head[8..].try_into().expect("4 bytes")) as usize;
            rest = tail.get(len..)?;
            rows += 1;
        }
        rest.is_empty().then_some(ChunkBody { bytes, rows })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(rows: &[(u64, &[u8])]) -> ChunkBody {
        let mut body = ChunkBody::default();
        for (hash, data) in rows {
            body.push(*hash, data);
        }
        body
    }

    #[test]
    fn rows_come_back_as_they_went_in() {
        let mut rows = body(&[(1, b"abc"), (u64::MAX, b"")]);
        rows.push_with(|out| {
            out.extend_from_slice(b"{}");
            7
        });
        assert_eq!(rows.len(), 3);
        assert_eq!(rows.data_bytes(), 5);
        let back: Vec<(u64, &[u8])> = rows.iter().collect();
        assert_eq!(back, [(1, &b"abc"[..]), (u64::MAX, b""), (7, b"{}")]);
        assert_eq!(ChunkBody::from_bytes(rows.bytes.clone()), Some(rows));
    }

    #[test]
    fn a_cut_or_foreign_chunk_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let files = ChunkFiles::beside(&dir.path().join("p.sqlite"));
        std::fs::create_dir(files.dir()).unwrap();
        let rows = body(&[(1, b"abc"), (2, b"")]);
        files.write(1, &rows).unwrap();
        assert_eq!(files.read(1).unwrap(), Some(Some(rows.clone())));
        let file = std::fs::read(files.path(1)).unwrap();
        // Cut inside a row, at a row's end (the count tells), in the header.
        for cut in [file.len() - 1, file.len() - 12, 5] {
            std::fs::write(files.path(1), &file[..cut]).unwrap();
            assert_eq!(files.read(1).unwrap(), Some(None), "cut at {cut}");
        }
        std::fs::write(files.path(1), &file[8..]).unwrap();
        assert_eq!(files.read(1).unwrap(), Some(None), "no magic");
        // The layout an earlier release kept in the database.
        let bytes = rows.bytes.clone();
        assert_eq!(ChunkBody::from_bytes(bytes.clone()), Some(rows));
        assert_eq!(
            ChunkBody::from_bytes(bytes[..bytes.len() - 13].to_vec()),
            None
        );
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
            files.write(chunk, &body(&[(chunk as u64, b"x")])).unwrap();
        }
        std::fs::write(files.dir().join("stray.tmp"), b"").unwrap();
        assert_eq!(files.read(2).unwrap(), Some(Some(body(&[(2, b"x")]))));
        files.remove(1).unwrap();
        files.remove(1).unwrap();
        assert_eq!(files.read(1).unwrap(), None);
        assert_eq!(files.sweep(|c| c == 3).unwrap(), 2, "2.rows and stray.tmp");
        assert!(files.read(3).unwrap().is_some());
        assert_eq!(files.read(2).unwrap(), None);
    }
}
