//! The spool's folder under `TMPDIR`, and the folders runs killed -9 (or by
//! the kernel's OOM killer) left there.
//!
//! A spool can hold gigabytes. A run that ends in any way its process
//! survives removes its folder; a killed one cannot, so every run first
//! removes the folders no live run holds. A run holds its folder by an
//! exclusive `flock` on the `lock` file in it, which the kernel releases
//! when the process dies, however it dies: a lock the sweep can take
//! belongs to nobody. A folder without a lock file is one an earlier
//! release left, or one a run has just made and not yet locked (that takes
//! microseconds), so it is removed only once it has not changed for
//! [`UNLOCKED_AGE`].

use std::fs::File;
use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::{Error, Result};

/// The start of every spool folder's name.
const PREFIX: &str = "waltail-spool-";

/// The file a live run holds locked in its spool folder.
const LOCK: &str = "lock";

/// How long a spool folder without a lock file must have been left alone
/// before a sweep removes it.
const UNLOCKED_AGE: Duration = Duration::from_secs(3600);

/// A spool folder, removed with its contents when dropped, and held
/// against other runs' sweeps while it lives.
#[derive(Debug)]
pub(super) struct SpoolDir {
    dir: tempfile::TempDir,
    /// Locked for as long as the folder lives.
    _lock: File,
}

impl SpoolDir {
    /// A new spool folder in `parent` (`TMPDIR` in use), after removing
    /// the folders killed runs left there.
    pub(super) fn new_in(parent: &Path) -> Result<SpoolDir> {
        sweep(parent);
        let dir = tempfile::Builder::new()
            .prefix(PREFIX)
            .tempdir_in(parent)
            .map_err(|e| Error::io("cannot create the compaction spool folder under TMPDIR", e))?;
        let lock = File::create(dir.path().join(LOCK))
            .and_then(|f| f.try_lock().map(|()| f).map_err(std::io::Error::from))
            .map_err(|e| Error::io("cannot lock the compaction spool folder", e))?;
        Ok(SpoolDir { dir, _lock: lock })
    }

    pub(super) fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Removes the spool folders in `parent` that no live run holds; says what
/// it removed. A folder it cannot read or remove is left, with a warning:
/// the run goes on regardless.
fn sweep(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let ours = entry.file_name().to_string_lossy().starts_with(PREFIX);
        if !ours || !entry.file_type().is_ok_and(|t| t.is_dir()) || !left(&path) {
            continue;
        }
        let bytes = size(&path);
        match std::fs::remove_dir_all(&path) {
            Ok(()) => tracing::info!(
                folder = %path.display(),
                bytes,
                "removed a compaction spool that a killed run left behind"
            ),
            Err(e) => tracing::warn!(
                folder = %path.display(),
                error = %e,
                "cannot remove a compaction spool that a killed run left behind; remove it by hand"
            ),
        }
    }
}

/// Whether no live run holds the spool folder `dir`.
fn left(dir: &Path) -> bool {
    match File::open(dir.join(LOCK)) {
        // Taken: its run is gone. The lock goes with the file.
        Ok(lock) => lock.try_lock().is_ok(),
        Err(_) => std::fs::metadata(dir)
            .and_then(|m| m.modified())
            .is_ok_and(|at| {
                SystemTime::now()
                    .duration_since(at)
                    .is_ok_and(|age| age >= UNLOCKED_AGE)
            }),
    }
}

/// The bytes of the files directly in `dir` (a spool has no subfolders).
fn size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(spool: &SpoolDir) -> String {
        let name = spool.path().file_name().unwrap();
        name.to_string_lossy().into_owned()
    }

    fn spools(parent: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(parent)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_new_spool_removes_the_folders_no_live_run_holds_and_only_those() {
        let parent = tempfile::tempdir().unwrap();
        let p = parent.path();
        // A live run's spool: locked.
        let live = SpoolDir::new_in(p).unwrap();
        let live_name = name(&live);
        // A killed run's: its lock file is there, nobody holds it.
        std::fs::create_dir(p.join("waltail-spool-killed")).unwrap();
        File::create(p.join("waltail-spool-killed/lock")).unwrap();
        std::fs::write(p.join("waltail-spool-killed/0-0.arrow"), [0u8; 100]).unwrap();
        // Without a lock file: new (a run about to lock it), and old.
        std::fs::create_dir(p.join("waltail-spool-new")).unwrap();
        std::fs::create_dir(p.join("waltail-spool-old")).unwrap();
        File::open(p.join("waltail-spool-old"))
            .unwrap()
            .set_modified(SystemTime::now() - UNLOCKED_AGE - Duration::from_secs(1))
            .unwrap();
        // Not ours.
        std::fs::create_dir(p.join("other")).unwrap();
        std::fs::write(p.join("waltail-spool-file"), b"a file").unwrap();

        let second = SpoolDir::new_in(p).unwrap();
        let second_name = name(&second);
        let mut expected = vec![
            "other".to_string(),
            live_name.clone(),
            second_name.clone(),
            "waltail-spool-file".into(),
            "waltail-spool-new".into(),
        ];
        expected.sort();
        assert_eq!(spools(p), expected);
        // Dropped, a spool's folder goes; the other live one stays.
        drop(second);
        assert!(p.join(&live_name).is_dir());
        assert!(!p.join(&second_name).exists());
    }
}
