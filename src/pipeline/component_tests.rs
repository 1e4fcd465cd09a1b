//! The pipeline's core without processes: [`Pipeline::run`] fed source
//! events through its channel, over a temporary state file and an
//! in-memory store that can hold back or refuse chosen PUTs, on tokio's
//! paused clock (waits and backoffs take no real time).
//!
//! What they pin: confirmation follows durability in seq order, batches on
//! a parked batch's rows wait behind it while others flow, and a backfill
//! window leaves out the rows changed inside it and holds its low
//! watermark back until the chunk's `read` events are written.

use std::fmt;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use tokio::sync::{mpsc, watch};

use super::{Pipeline, Shutdown};
use crate::archive::envelope::{Change, Op, RowSet, TableRef};
use crate::checkpoint::{Checkpoint, Cursor, ParkStatus};
use crate::config::Config;
use crate::sink::Sink;
use crate::source::backfill::driver::Driver;
use crate::source::backfill::{Mark, Passed, Watermark};
use crate::source::stream::SourceEvent;

/// An in-memory store whose PUTs to keys containing `held` wait until the
/// gate opens, and whose PUTs to keys containing `refused` fail while
/// `refusing` is set.
#[derive(Debug)]
struct Scripted {
    inner: InMemory,
    held: Option<String>,
    gate: watch::Receiver<bool>,
    refused: Option<String>,
    refusing: AtomicBool,
    /// The keys of the PUTs that returned, in order.
    written: Mutex<Vec<String>>,
}

impl fmt::Display for Scripted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scripted({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for Scripted {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        let key = location.as_ref();
        if self.held.as_deref().is_some_and(|h| key.contains(h)) {
            let mut gate = self.gate.clone();
            let _ = gate.wait_for(|open| *open).await;
        }
        if self.refusing.load(Ordering::SeqCst)
            && self.refused.as_deref().is_some_and(|r| key.contains(r))
        {
            return Err(object_store::Error::Generic {
                store: "Scripted",
                source: "the store is down for this key".into(),
            });
        }
        let put = self.inner.put_opts(location, payload, opts).await?;
        self.written.lock().unwrap().push(key.to_string());
        Ok(put)
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjectPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjectPath>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// One test's configuration, state file and store.
struct Rig {
    _dir: tempfile::TempDir,
    config: Config,
    store: Arc<Scripted>,
    open_gate: watch::Sender<bool>,
    /// The keys written by the time of each [`Sink::settle`], one list per call.
    settled: Arc<Mutex<Vec<Vec<String>>>>,
    /// Whether [`Sink::settle`] fails (a disk that cannot write).
    settle_fails: Arc<AtomicBool>,
}

impl Rig {
    /// Objects of `batch_size` changes, one attempt each; PUTs to keys with
    /// `held` wait for [`Rig::open_gate`], PUTs to keys with `refused` fail
    /// until [`Rig::heal`].
    fn new(batch_size: usize, held: Option<&str>, refused: Option<&str>) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("waltail.toml");
        std::fs::write(
            &file,
            format!(
                "pipeline = \"t\"\nstate_dir = {:?}\n\
                 [source]\nurl = \"postgres://u@localhost/db?host=/nonexistent\"\ntables = [\"public.t\"]\n\
                 [delivery]\nbatch_size = {batch_size}\nmax_attempts = 1\nlinger_ms = 50\n",
                dir.path().join("state")
            ),
        )
        .unwrap();
        let config = Config::load_with(Some(&file), &Default::default()).unwrap();
        let (open_gate, gate) = watch::channel(false);
        let store = Arc::new(Scripted {
            inner: InMemory::new(),
            held: held.map(str::to_string),
            gate,
            refused: refused.map(str::to_string),
            refusing: AtomicBool::new(refused.is_some()),
            written: Mutex::new(Vec::new()),
        });
        Rig {
            _dir: dir,
            config,
            store,
            open_gate,
            settled: Arc::default(),
            settle_fails: Arc::default(),
        }
    }

    fn state(&self) -> Checkpoint {
        Checkpoint::open(&self.config.state_file()).unwrap()
    }

    /// A sink over the store whose settling is seen: each call records the
    /// keys written by then, or fails while `settle_fails` is set.
    fn sink(&self) -> Sink {
        let (store, settled, fails) = (
            self.store.clone(),
            self.settled.clone(),
            self.settle_fails.clone(),
        );
        Sink::from_store(self.store.clone(), None).settling_with(move || {
            if fails.load(Ordering::SeqCst) {
                return Err(std::io::Error::other("the disk refuses to write"));
            }
            let written = store.written.lock().unwrap().clone();
            settled.lock().unwrap().push(written);
            Ok(())
        })
    }

    fn heal(&self) {
        self.store.refusing.store(false, Ordering::SeqCst);
    }

    /// The archive's object keys, sorted.
    async fn keys(&self) -> Vec<String> {
        use futures::TryStreamExt;
        let mut keys: Vec<String> = self
            .store
            .list(None)
            .map_ok(|m| m.location.to_string())
            .try_collect()
            .await
            .unwrap();
        keys.sort();
        keys
    }

    async fn body(&self, key: &str) -> String {
        let got = self.store.get(&ObjectPath::from(key)).await.unwrap();
        String::from_utf8(got.bytes().await.unwrap().to_vec()).unwrap()
    }
}

/// What a test does while the pipeline runs: it gets the event sender, the
/// confirmed LSN and the stop switch, and returns once the pipeline may
/// stop.
struct Feed {
    events: mpsc::Sender<Vec<SourceEvent>>,
    confirmed: watch::Receiver<u64>,
    stop: watch::Sender<u32>,
    /// Where the backfill's readers hand chunks' rows to the pipeline.
    handoff: crate::source::backfill::handoff::Handoff,
}

impl Feed {
    async fn send(&self, events: Vec<SourceEvent>) {
        self.events.send(events).await.unwrap();
    }

    /// Waits (on the paused clock) until `lsn` is confirmed.
    async fn confirmed_at_least(&mut self, lsn: u64) {
        tokio::time::timeout(
            Duration::from_secs(600),
            self.confirmed.wait_for(|&c| c >= lsn),
        )
        .await
        .unwrap_or_else(|_| panic!("{lsn} not confirmed in 10 minutes"))
        .unwrap();
    }
}

/// Runs the pipeline from the state's cursor while `script` feeds it, then
/// stops it gracefully; returns the cursor it stopped at.
async fn run_with<F, Fut>(rig: &Rig, script: F) -> Cursor
where
    F: FnOnce(Feed) -> Fut,
    Fut: std::future::Future<Output = Feed>,
{
    run_to_end(rig, script).await.unwrap()
}

/// [`run_with`], returning the pipeline's error if it stopped on one.
async fn run_to_end<F, Fut>(rig: &Rig, script: F) -> crate::Result<Cursor>
where
    F: FnOnce(Feed) -> Fut,
    Fut: std::future::Future<Output = Feed>,
{
    let mut state = rig.state();
    let cursor = state.cursor().unwrap().unwrap_or(Cursor {
        confirmed_lsn: 0,
        next_seq: 1,
    });
    let intents = state.open_intents(cursor.next_seq).unwrap();
    let (confirm, confirmed) = watch::channel(cursor.confirmed_lsn);
    let (passed, passed_rx) = watch::channel(Passed::default());
    let mut driver = Driver::new(&rig.config, passed_rx);
    let handoff = driver.handoff().clone();
    let mut pipeline = Pipeline::new(
        &rig.config,
        &mut state,
        &rig.sink(),
        cursor,
        intents,
        confirm,
        &mut driver,
        &passed,
    )
    .unwrap();
    let (tx, rx) = mpsc::channel(16);
    let (stop, stop_rx): (watch::Sender<u32>, Shutdown) = watch::channel(0);
    let feed = async {
        let feed = script(Feed {
            events: tx,
            confirmed,
            stop,
            handoff,
        })
        .await;
        // The pipeline may have stopped already, on an error.
        let _ = feed.stop.send(1);
        // Kept until the pipeline ends, so it sees a stop, not a closed source.
        feed
    };
    let (ended, _feed) = tokio::join!(pipeline.run(rx, stop_rx), feed);
    ended.map(|_| pipeline.cursor)
}

fn change(row: u64) -> SourceEvent {
    SourceEvent::Change(Change {
        op: Op::Insert,
        table: Arc::new(TableRef::from_name("public.t".into())),
        data: Some(format!("{{\"id\":{row}}}").into_bytes()),
        old: None,
        commit_lsn: 0,
        commit_ts: 0,
        index: 0,
        rows: RowSet::one(row),
    })
}

/// A transaction of inserts of `rows`, ending at `end_lsn`.
fn txn(rows: &[u64], end_lsn: u64) -> Vec<SourceEvent> {
    let mut events = vec![SourceEvent::Begin];
    events.extend(rows.iter().map(|&r| change(r)));
    events.push(SourceEvent::Commit { end_lsn });
    events
}

fn key(first: u64, last: u64) -> String {
    format!("2000/01/01/t-{first}-{last}.ndjson")
}

/// Objects finish in any order, but the slot is confirmed only past
/// transactions whose every change is written: the second transaction's
/// object lands first and nothing is confirmed until the first one's does.
#[tokio::test(start_paused = true)]
async fn confirmation_waits_for_every_earlier_object() {
    let rig = Rig::new(2, Some("t-1-2."), None);
    let cursor = run_with(&rig, |mut feed| async {
        feed.send(txn(&[1, 2], 100)).await;
        feed.send(txn(&[3, 4], 200)).await;
        // Long enough for the second object and many confirmation ticks.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(rig.keys().await, vec![key(3, 4)]);
        assert_eq!(
            *feed.confirmed.borrow(),
            0,
            "confirmed past a missing object"
        );
        assert_eq!(rig.state().cursor().unwrap(), None);
        rig.open_gate.send(true).unwrap();
        feed.confirmed_at_least(200).await;
        feed
    })
    .await;
    assert_eq!(
        cursor,
        Cursor {
            confirmed_lsn: 200,
            next_seq: 5
        }
    );
    assert_eq!(rig.state().cursor().unwrap(), Some(cursor));
    assert_eq!(rig.keys().await, vec![key(1, 2), key(3, 4)]);
}

/// Written objects are made durable (the folder's sync) before the state
/// records them or the slot is confirmed past them: every state commit
/// that confirmed something follows a settle that saw the objects.
#[tokio::test(start_paused = true)]
async fn objects_are_settled_before_the_state_records_them() {
    let rig = Rig::new(2, None, None);
    let cursor = run_with(&rig, |mut feed| async {
        feed.send(txn(&[1, 2], 100)).await;
        feed.confirmed_at_least(100).await;
        let first = rig.settled.lock().unwrap().clone();
        assert_eq!(first, vec![vec![key(1, 2)]], "one settle, after the PUT");
        // Idle: confirmation ticks pass with nothing new to settle.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(rig.settled.lock().unwrap().len(), 1);
        feed.send(txn(&[3, 4], 200)).await;
        feed.confirmed_at_least(200).await;
        feed
    })
    .await;
    assert_eq!(cursor.confirmed_lsn, 200);
    assert_eq!(
        rig.settled.lock().unwrap().last().unwrap(),
        &vec![key(1, 2), key(3, 4)]
    );
}

/// When the written objects cannot be made durable (a folder whose disk
/// fails its sync), the pipeline stops with an error that says so, and
/// nothing is recorded or confirmed: the next start writes them again.
#[tokio::test(start_paused = true)]
async fn objects_that_cannot_be_settled_are_neither_recorded_nor_confirmed() {
    let rig = Rig::new(2, None, None);
    rig.settle_fails.store(true, Ordering::SeqCst);
    let ended = run_to_end(&rig, |feed| async {
        feed.send(txn(&[1, 2], 100)).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(*feed.confirmed.borrow(), 0, "confirmed what is not durable");
        feed
    })
    .await;
    let error = crate::error::Report(&ended.unwrap_err()).to_string();
    assert!(error.contains("to disk (syncfs)"), "{error}");
    assert!(error.contains("the disk refuses to write"), "{error}");
    assert_eq!(rig.keys().await, vec![key(1, 2)], "the PUT itself was made");
    let state = rig.state();
    assert_eq!(state.cursor().unwrap(), None);
    let intents = state.open_intents(1).unwrap();
    assert_eq!(intents.len(), 1);
    assert!(!intents[0].done, "recorded as written though not durable");
}

/// A table's schema record is written once and then recorded in the state
/// (never written again): it too is recorded only once durable.
#[tokio::test(start_paused = true)]
async fn a_schema_record_that_cannot_be_settled_is_not_recorded() {
    let rig = Rig::new(2, None, None);
    rig.settle_fails.store(true, Ordering::SeqCst);
    let record = crate::source::row::TableSchema {
        table: Arc::new(TableRef::from_name("public.t".into())),
        members: "\"columns\":[]".into(),
    };
    let ended = run_to_end(&rig, |feed| async {
        feed.send(vec![SourceEvent::Schema(record)]).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        feed
    })
    .await;
    let error = crate::error::Report(&ended.unwrap_err()).to_string();
    assert!(error.contains("to disk (syncfs)"), "{error}");
    assert_eq!(rig.keys().await.len(), 1, "the record's PUT was made");
    let fingerprint = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, b"\"columns\":[]");
    assert_eq!(
        rig.state()
            .schema_version("public.t", &fingerprint.to_string())
            .unwrap(),
        None,
        "recorded though not durable"
    );
}

/// A batch that fails its attempts is parked; the next batch on one of its
/// rows is held behind it, one on other rows is written; parked and held
/// count as durable, so the slot is confirmed past all three. A replay
/// asked for from another process delivers the parked batch, then the held
/// one, in seq order.
#[tokio::test(start_paused = true)]
async fn a_batch_on_a_parked_row_waits_behind_it_while_others_flow() {
    let rig = Rig::new(2, None, Some("t-1-2."));
    let cursor = run_with(&rig, |mut feed| async {
        feed.send(txn(&[1, 2], 100)).await;
        feed.send(txn(&[1, 5], 200)).await;
        feed.send(txn(&[6, 7], 300)).await;
        feed.confirmed_at_least(300).await;
        assert_eq!(rig.keys().await, vec![key(5, 6)]);
        let lot: Vec<(u64, ParkStatus)> = rig
            .state()
            .parked()
            .unwrap()
            .iter()
            .map(|p| (p.first_seq, p.status))
            .collect();
        assert_eq!(lot, vec![(1, ParkStatus::Parked), (3, ParkStatus::Held)]);
        rig.heal();
        assert_eq!(rig.state().request_replay(None).unwrap(), 1);
        for _ in 0..100 {
            if rig.keys().await.len() == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        feed
    })
    .await;
    assert_eq!(cursor.confirmed_lsn, 300);
    assert_eq!(rig.keys().await, vec![key(1, 2), key(3, 4), key(5, 6)]);
    assert!(rig.state().parked().unwrap().is_empty());
    assert!(rig.body(&key(3, 4)).await.contains("\"seq\":3"));
    // Each replayed batch was made durable before it left the lot: a
    // settle saw the parked one before the held one was written.
    let settled = rig.settled.lock().unwrap();
    assert!(
        settled
            .iter()
            .any(|w| w.contains(&key(1, 2)) && !w.contains(&key(3, 4))),
        "{settled:?}"
    );
    assert!(settled.last().unwrap().contains(&key(3, 4)), "{settled:?}");
}

fn watermark(chunk: i64, mark: Mark, end_lsn: u64) -> Vec<SourceEvent> {
    let content = serde_json::to_vec(&Watermark {
        pipeline: "t".into(),
        chunk,
        mark,
        lane: 0,
    })
    .unwrap();
    vec![
        SourceEvent::Begin,
        SourceEvent::Watermark {
            content: content.into(),
            commit_lsn: end_lsn,
            commit_ts: 0,
        },
        SourceEvent::Commit { end_lsn },
    ]
}

/// A chunk of rows 11, 12 and 13 read between two watermarks while row 12
/// changes in the stream: the chunk's `read` events leave 12 out (the
/// change is newer), go out in the high watermark's place, the chunk is
/// recorded done, and the low watermark's transaction is confirmed only
/// once those `read` events are written. The rows are read from the
/// chunk's file, as after a restart.
#[tokio::test(start_paused = true)]
async fn a_backfill_window_leaves_out_rows_changed_inside_it() {
    backfill_window(false).await;
}

/// The same, with the rows handed over in memory as a running backfill
/// does; the chunk's file is removed, so they can come from nowhere else.
#[tokio::test(start_paused = true)]
async fn a_backfill_chunk_handed_over_in_memory_is_emitted_without_its_file() {
    backfill_window(true).await;
}

async fn backfill_window(handed_over: bool) {
    let rig = Rig::new(2, Some("t-3-4."), None);
    let mut rows = crate::checkpoint::ChunkBody::default();
    for r in [11, 12, 13] {
        rows.push(r, format!("{{\"id\":{r}}}").as_bytes());
    }
    let chunk = {
        let mut state = rig.state();
        let backfill = state.request_backfill("public", "t", 3, 3).unwrap();
        state.add_ranges(backfill, &[(None, None)], None).unwrap();
        let range = state.ranges(backfill).unwrap()[0].id;
        let chunk = state.new_chunk(backfill, range, 0).unwrap();
        state
            .store_chunk(chunk, &rows, Some("13"), true, "\"columns\":[]")
            .unwrap();
        if handed_over {
            let file = rig
                .config
                .state_file()
                .with_extension("chunks")
                .join(format!("{chunk}.rows"));
            std::fs::remove_file(file).unwrap();
        }
        chunk
    };
    let cursor = run_with(&rig, |mut feed| async {
        if handed_over {
            feed.handoff.give(chunk, Arc::new(rows));
        }
        feed.send(watermark(chunk, Mark::Low, 100)).await;
        feed.send(txn(&[12], 200)).await;
        feed.send(watermark(chunk, Mark::High, 300)).await;
        // The change to 12 is seq 1; the read events of 11 and 13 are seqs
        // 2 and 3, then an insert of 14 is seq 4; the object 3-4 waits.
        feed.send(txn(&[14], 400)).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            *feed.confirmed.borrow() < 100,
            "the low watermark is confirmed before its chunk's read events are written"
        );
        rig.open_gate.send(true).unwrap();
        feed.confirmed_at_least(400).await;
        feed
    })
    .await;
    assert_eq!(cursor.next_seq, 5);
    let mut text = rig.body(&key(1, 2)).await;
    text += &rig.body(&key(3, 4)).await;
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seen: Vec<(String, i64)> = lines
        .iter()
        .map(|l| {
            (
                l["op"].as_str().unwrap().to_string(),
                l["data"]["id"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            ("insert".into(), 12),
            ("read".into(), 11),
            ("read".into(), 13),
            ("insert".into(), 14)
        ]
    );
    let state = rig.state();
    assert!(state.chunk(chunk).unwrap().unwrap().done);
    assert_eq!(state.chunk_skipped(chunk).unwrap(), vec![1]);
}
