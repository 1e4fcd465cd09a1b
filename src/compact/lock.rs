//! One `compact` at a time per archive: a lock object,
//! `[prefix/]_waltail/compaction/lock.json`, created with a conditional PUT
//! (`PutMode::Create`: If-None-Match on S3, an exclusive link on a local
//! folder), so of two runs starting together exactly one gets it. The other
//! stops with who holds it and what to do.
//!
//! The holder refreshes the lock every [`HEARTBEAT`]; a lock not refreshed
//! for [`STALE_AFTER`] belongs to a run that died and is taken over, with a
//! conditional PUT on the e-tag read (`PutMode::Update`, so of two runs
//! taking over one wins). A lock of a process of this host that no longer
//! exists is taken over at once, and `--force-unlock` takes any lock over.
//!
//! The lock is the friendly part; what makes two runs unable to both
//! commit is the manifest's own conditional PUT (see
//! [`super::manifest::Manifest::commit`]): a run whose lock was taken over
//! fails there instead of overwriting the other run's result.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use super::listing::under;
use crate::{Error, Result};

/// Where the lock lives, under the prefix.
pub const LOCK_KEY: &str = "_waltail/compaction/lock.json";

/// How often the holder refreshes the lock.
pub const HEARTBEAT: Duration = Duration::from_secs(30);

/// A lock not refreshed for this long is stale (its run died on another
/// host, or hangs): ten heartbeats, so a slow store does not lose it.
pub const STALE_AFTER: Duration = Duration::from_secs(300);

/// What the lock object holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LockBody {
    /// Unique per run: tells the holder its own lock from another's.
    pub token: String,
    pub host: String,
    pub pid: u32,
    pub started_at: DateTime<Utc>,
    pub refreshed_at: DateTime<Utc>,
}

/// A held lock; released by [`Lock::release`] (a run that dies leaves it
/// to go stale).
pub struct Lock {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    body: LockBody,
    version: Arc<Mutex<Option<UpdateVersion>>>,
    lost: Arc<AtomicBool>,
    heartbeat: tokio::task::JoinHandle<()>,
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".into())
}

/// Whether process `pid` of this host exists (`true` when that cannot be
/// told: only a lock known to be dead is taken over early).
fn process_alive(pid: u32) -> bool {
    let proc = std::path::Path::new("/proc");
    !proc.exists() || proc.join(pid.to_string()).exists()
}

fn when(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

impl LockBody {
    fn new() -> LockBody {
        let now = Utc::now();
        LockBody {
            token: format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..)),
            host: host_name(),
            pid: std::process::id(),
            started_at: now,
            refreshed_at: now,
        }
    }

    fn bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec_pretty(self).expect("the lock serialises"))
    }

    /// Why the lock may be taken over, if it may.
    fn stale(&self, now: DateTime<Utc>) -> Option<String> {
        let idle = (now - self.refreshed_at).to_std().unwrap_or_default();
        if idle >= STALE_AFTER {
            return Some(format!("not refreshed for {} s", idle.as_secs()));
        }
        if self.host == host_name() && !process_alive(self.pid) {
            return Some(format!("process {} of this host is gone", self.pid));
        }
        None
    }

    fn held_error(&self, now: DateTime<Utc>) -> Error {
        let idle = (now - self.refreshed_at).to_std().unwrap_or_default();
        let wait = STALE_AFTER.saturating_sub(idle);
        Error::fatal(
            format!(
                "another compact is running on this archive (started by {} pid {} at {}, last seen {} s ago)",
                self.host,
                self.pid,
                when(self.started_at),
                idle.as_secs()
            ),
            format!(
                "let it finish; if it crashed, its lock is taken over once it is {} s old (in {} s), or pass --force-unlock when you are sure no other compact runs",
                STALE_AFTER.as_secs(),
                wait.as_secs()
            ),
        )
    }
}

/// Reads the lock: its body and version, or `None` when there is none.
async fn read(
    store: &dyn ObjectStore,
    path: &ObjectPath,
) -> Result<Option<(LockBody, UpdateVersion)>> {
    let got = match store.get(path).await {
        Ok(got) => got,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(Error::store("GET", path.to_string(), e)),
    };
    let version = UpdateVersion {
        e_tag: got.meta.e_tag.clone(),
        version: got.meta.version.clone(),
    };
    let bytes = got
        .bytes()
        .await
        .map_err(|e| Error::store("GET", path.to_string(), e))?;
    let body: LockBody = serde_json::from_slice(&bytes).map_err(|e| {
        Error::fatal(
            format!("the compaction lock {path} is not valid: {e}"),
            "delete it (or pass --force-unlock) when no compact runs",
        )
    })?;
    Ok(Some((body, version)))
}

impl Lock {
    /// Takes the lock of the archive under `prefix`, or fails with who
    /// holds it. `force` takes over any lock.
    pub async fn acquire(
        store: Arc<dyn ObjectStore>,
        prefix: Option<&str>,
        force: bool,
    ) -> Result<Lock> {
        let path = ObjectPath::from(under(prefix, LOCK_KEY));
        let body = LockBody::new();
        // A few rounds: the holder may release (or another run take over)
        // between our attempts.
        for _ in 0..5 {
            let create = PutOptions {
                mode: PutMode::Create,
                ..PutOptions::default()
            };
            match store
                .put_opts(&path, PutPayload::from(body.bytes()), create)
                .await
            {
                Ok(put) => return Ok(Lock::held(store, path, body, put.into())),
                Err(object_store::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(Error::store("PUT", path.to_string(), e)),
            }
            let Some((other, version)) = read(store.as_ref(), &path).await? else {
                continue; // released meanwhile
            };
            if other.token == body.token {
                // Our own create, answered late and retried.
                return Ok(Lock::held(store, path, body, version));
            }
            let now = Utc::now();
            let why = match (force, other.stale(now)) {
                (true, _) => "--force-unlock".to_string(),
                (false, Some(why)) => why,
                (false, None) => return Err(other.held_error(now)),
            };
            tracing::warn!(
                host = %other.host,
                pid = other.pid,
                started_at = %when(other.started_at),
                "taking over the compaction lock ({why})"
            );
            let update = PutOptions {
                mode: PutMode::Update(version),
                ..PutOptions::default()
            };
            match store
                .put_opts(&path, PutPayload::from(body.bytes()), update)
                .await
            {
                Ok(put) => return Ok(Lock::held(store, path, body, put.into())),
                // Taken over (or released) by another run first: look again.
                Err(object_store::Error::Precondition { .. }) => continue,
                // A local folder has no conditional update: delete, then
                // create (two runs doing this at once: one create wins).
                Err(object_store::Error::NotImplemented { .. }) => {
                    match store.delete(&path).await {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => continue,
                        Err(e) => return Err(Error::store("DELETE", path.to_string(), e)),
                    }
                }
                Err(e) => return Err(Error::store("PUT", path.to_string(), e)),
            }
        }
        match read(store.as_ref(), &path).await? {
            Some((other, _)) => Err(other.held_error(Utc::now())),
            None => Err(Error::fatal(
                format!("could not take the compaction lock {path}: it keeps changing"),
                "another compact is starting at the same time; run `waltail compact` again",
            )),
        }
    }

    fn held(
        store: Arc<dyn ObjectStore>,
        path: ObjectPath,
        body: LockBody,
        version: UpdateVersion,
    ) -> Lock {
        let version = Arc::new(Mutex::new(Some(version)));
        let lost = Arc::new(AtomicBool::new(false));
        let heartbeat = tokio::spawn(heartbeat(
            Arc::clone(&store),
            path.clone(),
            body.clone(),
            Arc::clone(&version),
            Arc::clone(&lost),
        ));
        Lock {
            store,
            path,
            body,
            version,
            lost,
            heartbeat,
        }
    }

    /// Fails when another run took the lock over (this one looked dead).
    pub fn check(&self) -> Result<()> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(Error::fatal(
                format!(
                    "this compact's lock {} was taken over by another run",
                    self.path
                ),
                "this run stopped before committing; the other run's result stands. Run `waltail compact` again once it is done",
            ));
        }
        Ok(())
    }

    /// Stops refreshing and deletes the lock, if it is still ours.
    pub async fn release(self) -> Result<()> {
        self.heartbeat.abort();
        let _ = self.version.lock().await; // no refresh in flight
        if self.lost.load(Ordering::SeqCst) {
            return Ok(());
        }
        match read(self.store.as_ref(), &self.path).await? {
            Some((body, _)) if body.token == self.body.token => {
                match self.store.delete(&self.path).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(Error::store("DELETE", self.path.to_string(), e)),
                }
            }
            _ => Ok(()),
        }
    }
}

/// Refreshes the lock every [`HEARTBEAT`]; marks it lost when another run
/// replaced it. A failed refresh is retried at the next beat (the lock
/// goes stale only after ten).
async fn heartbeat(
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    mut body: LockBody,
    version: Arc<Mutex<Option<UpdateVersion>>>,
    lost: Arc<AtomicBool>,
) {
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        let mut current = version.lock().await;
        body.refreshed_at = Utc::now();
        let mode = match current.clone() {
            Some(v) => PutMode::Update(v),
            None => PutMode::Overwrite,
        };
        let put = |mode| {
            store.put_opts(
                &path,
                PutPayload::from(body.bytes()),
                PutOptions {
                    mode,
                    ..PutOptions::default()
                },
            )
        };
        let result = match put(mode).await {
            Err(object_store::Error::NotImplemented { .. }) => {
                // A local folder: check that the lock is still ours, then replace it.
                match read(store.as_ref(), &path).await {
                    Ok(Some((b, _))) if b.token == body.token => put(PutMode::Overwrite).await,
                    Ok(_) => Err(object_store::Error::Precondition {
                        path: path.to_string(),
                        source: "the lock holds another run's token".into(),
                    }),
                    Err(_) => continue,
                }
            }
            other => other,
        };
        match result {
            Ok(put) => *current = Some(put.into()),
            Err(object_store::Error::Precondition { .. }) => {
                // Replaced, or our previous refresh landed but its answer
                // was lost: the token tells.
                match read(store.as_ref(), &path).await {
                    Ok(Some((b, v))) if b.token == body.token => *current = Some(v),
                    Ok(_) => {
                        tracing::error!("the compaction lock was taken over by another run");
                        lost.store(true, Ordering::SeqCst);
                        return;
                    }
                    Err(_) => {}
                }
            }
            Err(e) => tracing::warn!("cannot refresh the compaction lock: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use object_store::local::LocalFileSystem;
    use object_store::memory::InMemory;

    use super::*;

    async fn two_runs_one_lock(store: Arc<dyn ObjectStore>) {
        let first = Lock::acquire(Arc::clone(&store), Some("p"), false)
            .await
            .unwrap();
        let err = Lock::acquire(Arc::clone(&store), Some("p"), false)
            .await
            .err()
            .expect("the second run is refused");
        assert!(
            err.to_string().contains("another compact is running"),
            "{err}"
        );
        assert!(err.hint().unwrap().contains("--force-unlock"));
        // Forced: taken over; the first run finds out at its next beat.
        let second = Lock::acquire(Arc::clone(&store), Some("p"), true)
            .await
            .unwrap();
        first.check().unwrap();
        second.release().await.unwrap();
        first.release().await.unwrap();
        // Released: the next run gets it.
        let third = Lock::acquire(Arc::clone(&store), Some("p"), false)
            .await
            .unwrap();
        third.release().await.unwrap();
        assert!(
            read(
                store.as_ref(),
                &ObjectPath::from("p/_waltail/compaction/lock.json")
            )
            .await
            .unwrap()
            .is_none()
        );
    }

    #[tokio::test]
    async fn one_run_holds_the_lock_in_memory_and_in_a_folder() {
        two_runs_one_lock(Arc::new(InMemory::new())).await;
        let dir = tempfile::tempdir().unwrap();
        two_runs_one_lock(Arc::new(
            LocalFileSystem::new_with_prefix(dir.path()).unwrap(),
        ))
        .await;
    }

    #[tokio::test]
    async fn a_stale_or_dead_holders_lock_is_taken_over() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let path = ObjectPath::from(LOCK_KEY);
        let mut old = LockBody::new();
        old.refreshed_at = Utc::now() - chrono::Duration::seconds(STALE_AFTER.as_secs() as i64 + 1);
        old.host = "elsewhere".into();
        store
            .put(&path, PutPayload::from(old.bytes()))
            .await
            .unwrap();
        let lock = Lock::acquire(Arc::clone(&store), None, false)
            .await
            .unwrap();
        lock.release().await.unwrap();

        // A process of this host that is gone.
        let mut dead = LockBody::new();
        dead.pid = u32::MAX - 1;
        store
            .put(&path, PutPayload::from(dead.bytes()))
            .await
            .unwrap();
        let lock = Lock::acquire(Arc::clone(&store), None, false)
            .await
            .unwrap();
        // A live one of another host is not taken over.
        let mut live = LockBody::new();
        live.host = "elsewhere".into();
        store
            .put(&path, PutPayload::from(live.bytes()))
            .await
            .unwrap();
        tokio::time::pause();
        tokio::time::sleep(HEARTBEAT + Duration::from_secs(1)).await;
        tokio::time::resume();
        for _ in 0..100 {
            if lock.check().is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let err = lock.check().unwrap_err();
        assert!(err.to_string().contains("taken over"), "{err}");
        let err = Lock::acquire(Arc::clone(&store), None, false)
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("elsewhere pid"), "{err}");
    }
}
