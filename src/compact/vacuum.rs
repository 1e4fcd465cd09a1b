//! Vacuum: deleting the files of a table that no snapshot still needs
//! (those a commit replaced, once `compact.retain` has passed; those no
//! commit names, left by runs that stopped before their commit), with
//! Delta's own vacuum, which records itself in the log.

use std::collections::HashSet;
use std::time::Duration;

use deltalake_core::DeltaTable;
use deltalake_core::operations::vacuum::VacuumMode;
use futures::{StreamExt, TryStreamExt};

use super::commit::{COMMIT_TRIES, FIRST_WAIT, Failure};
use crate::lakehouse::compacted;
use crate::lakehouse::delta::{self, Location, Role, delta_error, log_turn};
use crate::lakehouse::typing::TableShape;
use crate::{Error, Result};

/// What a vacuum deletes.
#[derive(Debug, Clone, Copy)]
pub struct Vacuum {
    /// Files a commit replaced, once this long has passed since: the
    /// snapshots time travel reaches are those younger than this.
    pub replaced_after: Duration,
    /// Files no commit names (written by a run that stopped before its
    /// commit), once they are this old; `None` leaves them. Only files
    /// older than any run can be: a run still writing has files that no
    /// commit names yet.
    pub unnamed_after: Option<Duration>,
}

/// Deletes what `what` says of the table at `dir`, and returns how many
/// files it deleted. A vacuum that deletes files records itself in the log
/// (Delta's VACUUM START and END commits, which change no data).
///
/// Those commits are create-if-absent PUTs like a run's (see [`commit`]);
/// when one's connection breaks the vacuum is done again from the start,
/// which is safe: it plans from the log again, deletes what is still
/// there, and its commits change no data. (Files the broken try deleted
/// are then not in the count.)
pub async fn vacuum(loc: &Location, role: Role, dir: &str, what: Vacuum) -> Result<usize> {
    let mut wait = FIRST_WAIT;
    let mut tried = 0;
    loop {
        tried += 1;
        let e = match vacuum_once(loc, role, dir, what).await {
            Ok(deleted) => return Ok(deleted),
            Err(Failure::Unsure(e)) if tried < COMMIT_TRIES => e,
            Err(Failure::Unsure(e) | Failure::Known(e)) => return Err(e),
        };
        tracing::warn!(
            dir,
            role = ?role,
            tried,
            error = %e,
            "a vacuum's commit lost its connection: vacuuming again"
        );
        tokio::time::sleep(wait).await;
        wait *= 2;
    }
}

/// One try of [`vacuum`].
async fn vacuum_once(
    loc: &Location,
    role: Role,
    dir: &str,
    what: Vacuum,
) -> std::result::Result<usize, Failure> {
    let url = loc.table_url(role, dir)?;
    let _turn = log_turn().await;
    let log_store = loc.log_store(&url);
    if !log_store
        .is_delta_table_location()
        .await
        .map_err(|e| delta_error("cannot list", &url, e))?
    {
        return Ok(0);
    }
    let mut table = DeltaTable::new(log_store);
    table
        .load()
        .await
        .map_err(|e| delta_error("cannot open", &url, e))?;
    let retention = |d: Duration| {
        chrono::Duration::from_std(d)
            .map_err(|e| Error::config(format!("compact.retain {d:?}: {e}")))
    };
    let mut deleted = 0;
    // The table's files, listed once if a pass has candidates.
    let mut stored: Option<HashSet<String>> = None;
    // Full lists the table's folder for files no commit names; Lite reads
    // only the log's removes, so it is safe at any retention.
    let passes = what
        .unnamed_after
        .map(|after| (VacuumMode::Full, after.max(what.replaced_after)))
        .into_iter()
        .chain([(VacuumMode::Lite, what.replaced_after)]);
    for (mode, after) in passes {
        let period = retention(after)?;
        let vacuum = |table: DeltaTable| {
            table
                .vacuum()
                .with_retention_period(period)
                .with_enforce_retention_duration(false)
                .with_mode(mode.clone())
        };
        // The log keeps a removed file's tombstone (for readers of older
        // versions) after vacuum deleted the file: without this dry run
        // every later vacuum would "delete" it again, with two commits.
        let (_, planned) = vacuum(table.clone())
            .with_dry_run(true)
            .await
            .map_err(|e| delta_error("cannot vacuum", &url, e))?;
        if planned.files_deleted.is_empty() {
            continue;
        }
        if stored.is_none() {
            let listed: Vec<object_store::ObjectMeta> = table
                .log_store()
                .object_store(None)
                .list(None)
                .try_collect()
                .await
                .map_err(|e| Error::store("LIST", url.to_string(), e))?;
            stored = Some(listed.into_iter().map(|m| m.location.to_string()).collect());
        }
        let stored = stored.as_mut().expect("listed above");
        let present: Vec<&String> = planned
            .files_deleted
            .iter()
            .filter(|f| stored.contains(*f))
            .collect();
        if present.is_empty() {
            continue;
        }
        deleted += present.len();
        for f in &planned.files_deleted {
            stored.remove(f);
        }
        let (vacuumed, _) = vacuum(table)
            .await
            .map_err(|e| Failure::of("cannot vacuum", &url, e))?;
        table = vacuumed;
    }
    Ok(deleted)
}

/// Vacuums the history and latest view of each of `tables` (see
/// [`vacuum`]), a few at a time; returns the files deleted.
pub async fn vacuum_tables(loc: &Location, tables: &[TableShape], what: Vacuum) -> Result<usize> {
    let vacuums = tables.iter().flat_map(|shape| {
        let dir = compacted::table_folder(shape);
        [Role::History, Role::Latest].map(move |role| {
            let dir = dir.clone();
            async move { vacuum(loc, role, &dir, what).await }
        })
    });
    let deleted: Vec<usize> = futures::stream::iter(vacuums)
        .buffer_unordered(delta::LOG_CALLS)
        .try_collect()
        .await?;
    Ok(deleted.into_iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compact::commit::{Commit, commit};
    use crate::lakehouse::delta::tests::folder;
    use crate::lakehouse::delta::{DataFile, app_id, load};

    #[tokio::test]
    async fn every_tenth_commit_writes_a_checkpoint_and_vacuum_deletes_what_no_snapshot_needs() {
        let dir = tempfile::tempdir().unwrap();
        let loc = folder(dir.path());
        let s = TableShape::test_t();
        let id = app_id("p", "public.t");
        let table = dir.path().join("latest/public/t");
        std::fs::create_dir_all(&table).unwrap();
        let mut previous = None;
        for seq in 0..10u64 {
            let name = format!("{seq}.parquet");
            std::fs::write(table.join(&name), b"x").unwrap();
            let c = Commit {
                shape: &s,
                role: Role::Latest,
                app_id: &id,
                seq,
                adds: vec![DataFile {
                    path: name,
                    size: 1,
                    rows: 1,
                    date: None,
                }],
                removes: previous.iter().cloned().collect(),
                buckets: 1,
                info: vec![],
                txns: vec![],
            };
            let p = load(&loc, Role::Latest, "public/t", &id).await.unwrap();
            commit(&loc, "public/t", p.as_ref(), c).await.unwrap();
            previous = Some(format!("{seq}.parquet"));
        }
        let log = table.join("_delta_log");
        assert!(log.join("00000000000000000009.checkpoint.parquet").exists());
        assert!(!log.join("00000000000000000008.checkpoint.parquet").exists());
        // A file no commit names (a run stopped before its commit).
        std::fs::write(table.join("orphan.parquet"), b"x").unwrap();
        // Within the retention nothing goes.
        let week = Duration::from_secs(7 * 86_400);
        let all = |after| Vacuum {
            replaced_after: after,
            unnamed_after: Some(after),
        };
        assert_eq!(
            vacuum(&loc, Role::Latest, "public/t", all(week))
                .await
                .unwrap(),
            0
        );
        // Past it, the replaced files go (once: a second vacuum finds
        // their tombstones, not the files); files no commit names stay
        // until they are as old as `unnamed_after` says.
        let replaced = Vacuum {
            replaced_after: Duration::ZERO,
            unnamed_after: Some(week),
        };
        let deleted = vacuum(&loc, Role::Latest, "public/t", replaced)
            .await
            .unwrap();
        assert_eq!(deleted, 9);
        assert!(table.join("orphan.parquet").exists());
        let again = vacuum(&loc, Role::Latest, "public/t", replaced)
            .await
            .unwrap();
        assert_eq!(again, 0);
        let deleted = vacuum(&loc, Role::Latest, "public/t", all(Duration::ZERO))
            .await
            .unwrap();
        assert_eq!(deleted, 1);
        assert!(table.join("9.parquet").exists());
        assert!(!table.join("0.parquet").exists() && !table.join("orphan.parquet").exists());
        let p = load(&loc, Role::Latest, "public/t", &id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((p.seq, p.files.len()), (Some(9), 1));
    }
}
