//! The commit stage of a compaction run: per table, the files the run
//! wrote become visible in one Delta log entry (see [`crate::lakehouse::delta`]
//! for the tables and reading their logs back; [`super::vacuum`] deletes
//! what no snapshot still needs).
//!
//! Each commit adds and removes files in one log entry and carries a `txn`
//! action: the app id of the pipeline and table, and as version the last
//! seq compacted, so a retried or resumed run never commits the same seqs
//! twice. The protocol is the lowest the table needs, so older readers open
//! it: reader 1 / writer 2, or reader 3 / writer 7 with the `timestampNtz`
//! feature when the table has a `timestamp without time zone` column (Delta
//! has no other type for it). A later table format (Iceberg) commits here,
//! beside Delta, without touching plan or write.

use std::collections::HashMap;
use std::time::Duration;

use deltalake_core::DeltaTableError;
use deltalake_core::kernel::transaction::{CommitBuilder, CommitProperties, TransactionError};
use deltalake_core::kernel::{Action, Add, MetadataExt, Remove, Transaction};
use deltalake_core::operations::create::CreateBuilder;
use deltalake_core::protocol::{DeltaOperation, OutputMode, SaveMode};
use object_store::ObjectStoreExt;
use url::Url;

use super::plan::{Plan, Tables};
use super::write::Written;
use crate::error::ErrorKind;
use crate::lakehouse::compacted;
use crate::lakehouse::delta::{
    self, BUCKETS_KEY, CHECKPOINT_INTERVAL, DataFile, Location, Published, Role, delta_error,
    has_timestamp_ntz, log_turn, schema,
};
use crate::lakehouse::typing::TableShape;
use crate::{Error, Result};

/// One run's commit to one table.
pub struct Commit<'a> {
    /// The table committed to.
    pub shape: &'a TableShape,
    /// Its history or its latest view.
    pub role: Role,
    /// The txn's app id: the pipeline's and the table's (see `delta::app_id`).
    pub app_id: &'a str,
    /// The last seq compacted (the txn version).
    pub seq: u64,
    /// The files this commit adds.
    pub adds: Vec<DataFile>,
    /// Paths (relative to the table) of files this commit replaces.
    pub removes: Vec<String>,
    /// The latest view's bucket count (ignored for a history).
    pub buckets: u32,
    /// More txn actions (app id, version) for the same commit.
    pub txns: Vec<(String, i64)>,
    /// Recorded in the commit's `commitInfo` (`waltail.*` keys).
    pub info: Vec<(String, serde_json::Value)>,
}

/// How many times a commit is tried when a broken connection leaves its
/// outcome unknown; the waits between tries double from [`FIRST_WAIT`]
/// (about 6 s in all), longer than the store's usual hiccups.
pub(super) const COMMIT_TRIES: u32 = 6;
pub(super) const FIRST_WAIT: Duration = Duration::from_millis(200);

/// Commits `commit` to the table at `dir` as `previous` left it (creating
/// it when there is none): adds, removes and the txn in one log entry.
/// Returns the new Delta version.
///
/// If another writer committed in between, delta-rs checks the two: a
/// commit that touched neither our txn nor our files (a vacuum) is let
/// through and ours is written after it; another run's commit to the same
/// table (its txn) stops ours with an error that says so.
///
/// The log entry is a create-if-absent PUT whose outcome a failure can
/// hide: a broken connection leaves it unknown, and the store client
/// sends it again after a 5xx or a connection closed before the answer,
/// when a first copy that was written makes the second fail as "already
/// there" (which delta-rs then reports as a conflict with ourselves). So
/// after any failure this reads the log back and looks for this call's
/// token in the commits since `previous`: there, the commit landed.
/// Otherwise a broken connection tries it again, against `previous`, so a
/// commit another run made meanwhile is still caught as a conflict.
///
/// In a local folder the files the commit names are made durable before
/// it, and the commit itself before this returns ([`Location::settle`]),
/// so a machine crash never leaves a log naming files that were not
/// written out, nor a latest view's commit without its history's.
pub async fn commit(
    loc: &Location,
    dir: &str,
    previous: Option<&Published>,
    commit: Commit<'_>,
) -> Result<u64> {
    loc.settle()?;
    let version = commit_tried(loc, dir, previous, commit).await?;
    loc.settle()?;
    Ok(version)
}

/// [`commit`] without the settling: the tries and the read-back.
async fn commit_tried(
    loc: &Location,
    dir: &str,
    previous: Option<&Published>,
    commit: Commit<'_>,
) -> Result<u64> {
    let token = uuid::Uuid::new_v4().to_string();
    let mut wait = FIRST_WAIT;
    let mut tried = 0;
    loop {
        tried += 1;
        let failure = match commit_once(loc, dir, previous, &commit, &token).await {
            Ok(version) => return Ok(version),
            Err(failure) => failure,
        };
        if let Some(version) = landed(loc, dir, previous, &commit, &token).await? {
            tracing::info!(
                table = %commit.shape.table,
                role = ?commit.role,
                version,
                "the Delta commit had landed, its answer lost"
            );
            return Ok(version);
        }
        let e = match failure {
            Failure::Unsure(e) if tried < COMMIT_TRIES => e,
            Failure::Unsure(e) | Failure::Known(e) => return Err(e),
        };
        tracing::warn!(
            table = %commit.shape.table,
            role = ?commit.role,
            tried,
            error = %e,
            "a Delta commit's connection broke and it had not landed: trying again"
        );
        tokio::time::sleep(wait).await;
        wait *= 2;
    }
}

/// The commitInfo key of a [`commit`] call's token.
const TOKEN_KEY: &str = "waltail.commit";

/// The version of the commit carrying `token`, if the table's log holds
/// one newer than `previous`. A landed commit whose version calls for a
/// checkpoint gets it here (delta-rs writes it after a commit it saw
/// succeed); without it readers only read more log entries.
async fn landed(
    loc: &Location,
    dir: &str,
    previous: Option<&Published>,
    commit: &Commit<'_>,
    token: &str,
) -> Result<Option<u64>> {
    let Some(now) = delta::load(loc, commit.role, dir, commit.app_id).await? else {
        return Ok(None);
    };
    let store = now.table.log_store().object_store(None);
    let since = previous.map_or(0, |p| p.version + 1);
    for version in since..=now.version {
        let entry = object_store::path::Path::from(format!("_delta_log/{version:020}.json"));
        let bytes = match async { store.get(&entry).await?.bytes().await }.await {
            Ok(bytes) => bytes,
            // Cleaned up after a checkpoint: an old entry, not this commit.
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(Error::store("GET", format!("{}{entry}", now.url), e)),
        };
        let ours = bytes.split(|&b| b == b'\n').any(|line| {
            serde_json::from_slice::<serde_json::Value>(line)
                .is_ok_and(|action| action["commitInfo"][TOKEN_KEY].as_str() == Some(token))
        });
        if !ours {
            continue;
        }
        if version == now.version && (version + 1).is_multiple_of(CHECKPOINT_INTERVAL) {
            let _turn = log_turn().await;
            if let Err(e) = deltalake_core::checkpoints::create_checkpoint(&now.table, None).await {
                tracing::warn!(url = %now.url, version, error = %e, "cannot write the checkpoint of a landed commit; readers read the log entries instead");
            }
        }
        return Ok(Some(version));
    }
    Ok(None)
}

/// Why a commit failed.
pub(super) enum Failure {
    /// The connection broke while the log entry was sent: it may have
    /// been written or not.
    Unsure(Error),
    /// An answer (a conflict, a refusal) or an error before the request:
    /// sending it again would not help. (It may still have been written,
    /// by a copy the client sent again: [`commit`] reads the log back.)
    Known(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Known(e)
    }
}

impl Failure {
    /// `e` as `what` (`cannot commit to`) the table at `url` failed. A
    /// request the store may or may not have carried out is a transport
    /// error or a 5xx after the client's retries (object_store's
    /// `Generic`), not an answer such as "already exists" or "denied".
    pub(super) fn of(what: &str, url: &Url, e: DeltaTableError) -> Failure {
        let unsure = matches!(
            &e,
            DeltaTableError::ObjectStore {
                source: object_store::Error::Generic { .. }
            } | DeltaTableError::Transaction {
                source: TransactionError::ObjectStore {
                    source: object_store::Error::Generic { .. }
                }
            }
        );
        let e = delta_error(what, url, e);
        if unsure {
            Failure::Unsure(e)
        } else {
            Failure::Known(e)
        }
    }
}

/// One try of [`commit`].
async fn commit_once(
    loc: &Location,
    dir: &str,
    previous: Option<&Published>,
    commit: &Commit<'_>,
    token: &str,
) -> std::result::Result<u64, Failure> {
    let url = loc.table_url(commit.role, dir)?;
    let schema = schema(commit.shape, commit.role)?;
    let _turn = log_turn().await;
    let now = chrono::Utc::now().timestamp_millis();
    let mut actions: Vec<Action> = commit
        .adds
        .iter()
        .map(|f| {
            Action::Add(Add {
                path: f.path.clone(),
                partition_values: match commit.role {
                    Role::History => HashMap::from([("date".to_string(), f.date.clone())]),
                    Role::Latest => HashMap::new(),
                },
                size: f.size as i64,
                modification_time: now,
                data_change: true,
                stats: Some(format!("{{\"numRecords\":{}}}", f.rows)),
                ..Default::default()
            })
        })
        .collect();
    actions.extend(commit.removes.iter().map(|path| {
        Action::Remove(Remove {
            path: path.clone(),
            data_change: true,
            deletion_timestamp: Some(now),
            extended_file_metadata: Some(false),
            ..Default::default()
        })
    }));
    let txn = Transaction::new_with_last_update(commit.app_id, commit.seq as i64, Some(now));
    let mut txns = vec![txn];
    txns.extend(
        commit
            .txns
            .iter()
            .map(|(id, v)| Transaction::new_with_last_update(id, *v, Some(now))),
    );
    let props = CommitProperties::default()
        .with_application_transactions(txns)
        .with_metadata(commit.info.iter().cloned().chain([
            ("waltail.seq".to_string(), commit.seq.into()),
            (TOKEN_KEY.to_string(), token.into()),
        ]));
    let buckets = match commit.role {
        Role::History => None,
        Role::Latest => Some(commit.buckets.max(1)),
    };
    let partitions: Vec<&str> = match commit.role {
        Role::History => vec!["date"],
        Role::Latest => vec![],
    };
    let conflict = |e: DeltaTableError| {
        match e {
        DeltaTableError::Transaction {
            source: TransactionError::CommitConflict(c),
        } => Failure::Known(
            Error::fatal(
                format!(
                    "another `waltail compact` committed to {} while this run was writing ({c})",
                    commit.shape.table
                ),
                "nothing of this run is visible; run `waltail compact` again once the other run has finished",
            )
            .with_kind(ErrorKind::Locked),
        ),
        DeltaTableError::Transaction {
            source: TransactionError::VersionAlreadyExists(v),
        }
        | DeltaTableError::VersionAlreadyExists(v) => Failure::Known(
            Error::fatal(
                format!("another writer committed version {v} of {url} first, again and again"),
                "run `waltail compact` again once the other writer has finished",
            )
            .with_kind(ErrorKind::Locked),
        ),
        e => Failure::of("cannot commit to", &url, e),
    }
    };
    let log_store = loc.log_store(&url);
    let Some(previous) = previous else {
        let mut config: Vec<(String, String)> = vec![(
            "delta.checkpointInterval".into(),
            CHECKPOINT_INTERVAL.to_string(),
        )];
        if let Some(b) = buckets {
            config.push((BUCKETS_KEY.into(), b.to_string()));
        }
        let table = CreateBuilder::new()
            .with_log_store(log_store)
            .with_columns(schema.fields().cloned())
            .with_partition_columns(partitions)
            .with_configuration(config.into_iter().map(|(k, v)| (k, Some(v))))
            .with_save_mode(SaveMode::ErrorIfExists)
            // `waltail.buckets` is ours: kept, not refused as an unknown `delta.*` key.
            .with_raise_if_key_not_exists(false)
            .with_actions(actions)
            // No retry: delta-rs would write a create that finds version 0
            // taken (another run created the table first) on top of it,
            // unchecked.
            .with_commit_properties(props.with_max_retries(0))
            .await
            .map_err(|e| match e {
                DeltaTableError::GenericError { .. }
                | DeltaTableError::VersionAlreadyExists(0)
                | DeltaTableError::Transaction {
                    source: TransactionError::MaxCommitAttempts(_),
                } => {
                    Failure::Known(Error::fatal(
                        format!(
                            "another `waltail compact` created {url} while this run was writing ({e})"
                        ),
                        "nothing of this run is visible; run `waltail compact` again once the other run has finished",
                    )
                    .with_kind(ErrorKind::Locked))
                }
                e => conflict(e),
            })?;
        return Ok(table.version().unwrap_or(0));
    };
    let state = previous
        .table
        .snapshot()
        .map_err(|e| delta_error("cannot read", &url, e))?;
    // The schema grows with the table's columns (schema evolution), and the
    // bucket count with the view: both are the table's metadata.
    let current = state.schema();
    let buckets_changed = buckets.is_some_and(|b| b != previous.buckets);
    if current.as_ref() != &schema || buckets_changed {
        let mut metadata = state
            .metadata()
            .clone()
            .with_schema(&schema)
            .map_err(|e| delta_error("cannot change the schema of", &url, e.into()))?;
        if let Some(b) = buckets {
            metadata = metadata
                .add_config_key(BUCKETS_KEY.into(), b.to_string())
                .map_err(|e| delta_error("cannot change the configuration of", &url, e.into()))?;
        }
        actions.push(Action::Metadata(metadata));
        if has_timestamp_ntz(&schema) && !has_timestamp_ntz(current.as_ref()) {
            actions.push(Action::Protocol(timestamp_ntz_protocol(&url)?));
        }
    }
    let operation = DeltaOperation::StreamingUpdate {
        output_mode: match commit.role {
            Role::History => OutputMode::Append,
            Role::Latest => OutputMode::Update,
        },
        query_id: commit.app_id.to_string(),
        epoch_id: commit.seq as i64,
    };
    let done = CommitBuilder::from(props)
        .with_actions(actions)
        .build(Some(state), log_store, operation)
        .await
        .map_err(conflict)?;
    Ok(done.version())
}

/// Reader 3 / writer 7 with `timestampNtz`: what a table needs once it has
/// a `timestamp without time zone` column.
fn timestamp_ntz_protocol(url: &Url) -> Result<deltalake_core::kernel::Protocol> {
    serde_json::from_value(serde_json::json!({
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": ["timestampNtz"],
        "writerFeatures": ["timestampNtz"],
    }))
    .map_err(|e| Error::bug(format!("the timestampNtz protocol of {url}: {e}")))
}

/// The commit stage of a run: per table the history, then the latest view
/// (so a latest view never holds a change its history lacks; a run stopped
/// in between is redone from the latest view's seq, and the history's files
/// from there are replaced). Returns the commits written.
pub(crate) async fn commit_run(
    loc: &Location,
    pipeline: &str,
    run_id: &str,
    plan: &Plan,
    tables: &Tables,
    mut written: Written,
) -> Result<usize> {
    let last_date = plan.files.last().map(|f| f.date.clone());
    let mut commits = 0;
    for table in &plan.tables {
        let shape = &tables.shapes[table];
        let c = &tables.compacted[table];
        let app = delta::app_id(pipeline, table);
        let dir = compacted::table_folder(shape);
        let start = tables.start(table);
        let info = || {
            vec![
                ("waltail.pipeline".to_string(), pipeline.into()),
                (
                    "waltail.fromSeq".to_string(),
                    start.max(plan.from_seq).into(),
                ),
                ("waltail.run".to_string(), run_id.into()),
            ]
        };
        if c.history_behind(plan.to_seq) {
            // Files of a run stopped before its latest commit: replaced.
            let mut removes = c.stopped_run_files(start);
            let mut adds = written.history.remove(table).unwrap_or_default();
            // Files in a column's narrower type: replaced by copies in the
            // wider one.
            if let Some((copies, originals)) = written.rewritten.remove(table) {
                removes.extend(originals);
                adds.extend(copies);
            }
            let txns = compacted::date_txns(&app, last_date.as_deref());
            let history = Commit {
                shape,
                role: Role::History,
                app_id: &app,
                seq: plan.to_seq,
                adds,
                removes,
                buckets: 1,
                info: info(),
                txns,
            };
            commit(loc, &dir, c.history.as_ref(), history).await?;
            commits += 1;
        }
        if shape.key.is_empty() {
            continue;
        }
        let (adds, removes, buckets) = match written.latest.remove(table) {
            Some((adds, buckets)) => {
                let removes = c
                    .latest
                    .as_ref()
                    .map(|l| l.files.iter().map(|f| f.path.clone()).collect())
                    .unwrap_or_default();
                (adds, removes, buckets)
            }
            // No change: the commit only moves the txn on.
            None => (
                Vec::new(),
                Vec::new(),
                c.latest.as_ref().map_or(1, |l| l.buckets),
            ),
        };
        let latest = Commit {
            shape,
            role: Role::Latest,
            app_id: &app,
            seq: plan.to_seq,
            adds,
            removes,
            buckets,
            info: info(),
            txns: Vec::new(),
        };
        commit(loc, &dir, c.latest.as_ref(), latest).await?;
        commits += 1;
    }
    Ok(commits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lakehouse::delta::tests::{folder, shape};
    use crate::lakehouse::delta::{app_id, load};

    /// In a folder, a commit makes the files it names durable before it
    /// is written and itself durable before it returns; a sync that fails
    /// before it means no commit at all.
    #[tokio::test]
    async fn a_commit_is_settled_before_and_after_and_not_made_if_that_fails() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{Arc, Mutex};
        let dir = tempfile::tempdir().unwrap();
        let log = dir
            .path()
            .join("latest/public/t/_delta_log/00000000000000000000.json");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let fails = Arc::new(AtomicBool::new(true));
        let sink = {
            let (log, seen, fails) = (log.clone(), seen.clone(), fails.clone());
            let store = Arc::new(object_store::memory::InMemory::new());
            crate::sink::Sink::from_store(store, None).settling_with(move || {
                if fails.load(Ordering::SeqCst) {
                    return Err(std::io::Error::other("the disk refuses to write"));
                }
                seen.lock().unwrap().push(log.exists());
                Ok(())
            })
        };
        let loc = folder(dir.path()).settling(&sink);
        let s = shape();
        let id = app_id("p", "public.t");
        std::fs::create_dir_all(dir.path().join("latest/public/t")).unwrap();
        let one = || Commit {
            shape: &s,
            role: Role::Latest,
            app_id: &id,
            seq: 41,
            adds: vec![DataFile {
                path: "a.parquet".into(),
                size: 10,
                rows: 3,
                date: None,
            }],
            removes: vec![],
            buckets: 1,
            info: vec![],
            txns: vec![],
        };
        let failed = commit(&loc, "public/t", None, one()).await.unwrap_err();
        assert!(
            crate::error::Report(&failed)
                .to_string()
                .contains("the disk refuses to write")
        );
        assert!(!log.exists(), "committed files that are not durable");
        fails.store(false, Ordering::SeqCst);
        assert_eq!(commit(&loc, "public/t", None, one()).await.unwrap(), 0);
        assert_eq!(
            *seen.lock().unwrap(),
            [false, true],
            "one settle before the commit, one after"
        );
    }

    #[tokio::test]
    async fn a_commit_is_read_back_with_its_txn_columns_buckets_and_files() {
        let dir = tempfile::tempdir().unwrap();
        let loc = folder(dir.path());
        let s = shape();
        let id = app_id("p", "public.t");
        assert!(
            load(&loc, Role::Latest, "public/t", &id)
                .await
                .unwrap()
                .is_none()
        );
        let file = |path: &str, rows| DataFile {
            path: path.into(),
            size: 10,
            rows,
            date: None,
        };
        std::fs::create_dir_all(dir.path().join("latest/public/t")).unwrap();
        let commit1 = Commit {
            shape: &s,
            role: Role::Latest,
            app_id: &id,
            seq: 41,
            adds: vec![file("a.parquet", 3), file("b.parquet", 4)],
            removes: vec![],
            buckets: 2,
            info: vec![],
            txns: vec![],
        };
        assert_eq!(commit(&loc, "public/t", None, commit1).await.unwrap(), 0);
        let p = load(&loc, Role::Latest, "public/t", &id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((p.version, p.seq, p.buckets, p.rows()), (0, Some(41), 2, 7));
        assert_eq!(p.columns, s.columns);
        let commit2 = Commit {
            shape: &s,
            role: Role::Latest,
            app_id: &id,
            seq: 90,
            adds: vec![file("c.parquet", 5)],
            removes: vec!["a.parquet".into()],
            buckets: 4,
            info: vec![],
            txns: vec![],
        };
        assert_eq!(
            commit(&loc, "public/t", Some(&p), commit2).await.unwrap(),
            1
        );
        let p = load(&loc, Role::Latest, "public/t", &id)
            .await
            .unwrap()
            .unwrap();
        let mut paths: Vec<&str> = p.files.iter().map(|f| f.path.as_str()).collect();
        paths.sort();
        assert_eq!((p.version, p.seq, p.buckets), (1, Some(90), 4));
        assert_eq!(paths, ["b.parquet", "c.parquet"]);
        // Two runs from the same snapshot: the second's txn conflicts.
        let first = load(&loc, Role::Latest, "public/t", &id)
            .await
            .unwrap()
            .unwrap();
        let run = |seq| Commit {
            shape: &s,
            role: Role::Latest,
            app_id: &id,
            seq,
            adds: vec![file(&format!("{seq}.parquet"), 1)],
            removes: vec![],
            buckets: 4,
            info: vec![],
            txns: vec![],
        };
        commit(&loc, "public/t", Some(&first), run(92))
            .await
            .unwrap();
        let err = commit(&loc, "public/t", Some(&first), run(95))
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("another `waltail compact`"),
            "{err}"
        );
        assert_eq!(err.kind(), crate::error::ErrorKind::Locked);
    }
}
