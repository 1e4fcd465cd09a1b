//! The store itself failing, against a dedicated SeaweedFS per test (never
//! the shared one), the shared Postgres and the real binary: a SIGSTOPped
//! store (requests hang past the request timeout, batches park, replay
//! delivers them) and a store killed with -9 and restarted on its data
//! within the retry budget (nothing parked, nothing lost, nothing twice).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::s3::DedicatedS3;
use common::*;

/// Seqs present in the archive under `prefix` (with repeats, if any).
async fn archived_seqs(s3: &DedicatedS3, prefix: &str) -> Vec<u64> {
    seqs_of(&s3.objects(prefix).await)
}

#[tokio::test]
async fn sigstopped_store_parks_after_the_retry_budget_and_replay_delivers() {
    let s3 = DedicatedS3::start();
    let db = TestDb::new("sigstop").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    let pipeline = unique("sigstop").replace('_', "-");
    let prefix = format!("sigstop/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.t");
    s3.configure(&mut w, &prefix);
    w.set("WALTAIL_DELIVERY_BATCH_SIZE", "1")
        .set("WALTAIL_DELIVERY_MAX_ATTEMPTS", "2")
        .set("WALTAIL_DELIVERY_BACKOFF", "50ms")
        .set("WALTAIL_DELIVERY_REQUEST_TIMEOUT_MS", "1000");
    w.start();
    db.exec("INSERT INTO t VALUES (1, 0), (2, 0), (3, 0), (4, 0)")
        .await;
    eventually(Duration::from_secs(30), "the inserts", async || {
        archived_seqs(&s3, &prefix).await == [1, 2, 3, 4]
    })
    .await;

    // The store hangs: connections are accepted by the kernel, never answered.
    s3.stop_signal();
    let stopped_at = Instant::now();
    db.exec("UPDATE t SET v = 1 WHERE id = 1").await; // seq 5
    db.exec("UPDATE t SET v = 1 WHERE id = 2").await; // seq 6
    eventually(Duration::from_secs(30), "seqs 5 and 6 parked", async || {
        w.parked_counts() == (2, 0)
    })
    .await;
    // Two attempts of 1 s each (plus 50 ms backoff): parked after about 2 s, not before.
    assert!(
        stopped_at.elapsed() >= Duration::from_millis(1900),
        "parked after {:?}, before the attempts could time out",
        stopped_at.elapsed()
    );
    db.exec("UPDATE t SET v = 2 WHERE id = 1").await; // seq 7: held behind 5
    eventually(Duration::from_secs(30), "seq 7 held", async || {
        w.parked_counts() == (2, 1)
    })
    .await;
    let (_, list, _) = w.output(&["parked", "list"]);
    assert!(
        list.contains("5-5") && list.contains("6-6") && list.contains("7-7"),
        "{list}"
    );

    s3.cont_signal();
    db.exec("UPDATE t SET v = 2 WHERE id = 3").await; // seq 8: flows on
    db.exec("UPDATE t SET v = 2 WHERE id = 2").await; // seq 9: held behind 6
    eventually(Duration::from_secs(30), "seq 8 delivered", async || {
        archived_seqs(&s3, &prefix).await.contains(&8)
    })
    .await;
    eventually(Duration::from_secs(30), "two held batches", async || {
        w.parked_counts() == (2, 2)
    })
    .await;
    let seqs = archived_seqs(&s3, &prefix).await;
    // The timed-out PUTs of 5 and 6 were buffered by the kernel and may be
    // carried out once the store continues (same key, same bytes as the
    // replay writes): they may be there; the held ones were never sent.
    println!("archived after SIGCONT, before replay: {seqs:?}");
    assert!(
        !seqs.contains(&7) && !seqs.contains(&9),
        "held seqs must not be in the archive before replay: {seqs:?}"
    );
    assert!(
        seqs.iter().all(|s| [1, 2, 3, 4, 5, 6, 8].contains(s)),
        "{seqs:?}"
    );

    // Replay through the running pipeline.
    let (status, stdout, stderr) = w.output(&["parked", "replay", "--all"]);
    assert!(status.success(), "replay failed:\n{stdout}\n{stderr}");
    assert_eq!(w.parked_counts(), (0, 0));
    let changes = checked_changes(&s3.objects(&prefix).await, Some(&prefix), &pipeline);
    assert_eq!(changes.len(), 9, "every seq archived exactly once");
    assert_eq!(replay(&changes)["public.t"], db.rows("t").await);

    // The pipeline goes on after the replay.
    db.exec("UPDATE t SET v = 3 WHERE id = 1; DELETE FROM t WHERE id = 4")
        .await; // seqs 10, 11
    eventually(Duration::from_secs(30), "seqs 10 and 11", async || {
        archived_seqs(&s3, &prefix).await.len() == 11
    })
    .await;
    let changes = checked_changes(&s3.objects(&prefix).await, Some(&prefix), &pipeline);
    assert_eq!(replay(&changes)["public.t"], db.rows("t").await);
    w.stop();
    db.drop_db().await;
}

/// 149 waits of 500 ms ±20% between 150 attempts: at least 59.6 s, far more
/// than the outage below (2 s down, then a few seconds for SeaweedFS to
/// start; once 24 s on a machine busy with a parallel build), so a loaded
/// machine does not turn a restart into a park.
const MAX_ATTEMPTS: u32 = 150;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_killed_and_restarted_within_the_retry_budget_loses_nothing_and_parks_nothing() {
    let s3 = DedicatedS3::start();
    let db = TestDb::new("s3kill").await;
    db.exec(TABLES).await;
    let pipeline = unique("s3kill").replace('_', "-");
    let prefix = format!("s3kill/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    s3.configure(&mut w, &prefix);
    w.set("WALTAIL_DELIVERY_BATCH_SIZE", "4")
        .set(
            "WALTAIL_DELIVERY_MAX_ATTEMPTS",
            MAX_ATTEMPTS.to_string().as_str(),
        )
        .set("WALTAIL_DELIVERY_BACKOFF", "500ms")
        .set("WALTAIL_DELIVERY_REQUEST_TIMEOUT_MS", "2000");
    w.start();

    // Steady writes throughout: small transactions, a few every 20 ms.
    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let url = db.url.clone();
        let done = done.clone();
        tokio::spawn(async move {
            let wdb = TestDb::attach(&url).await;
            let mut round = 0u64;
            while !done.load(Ordering::Relaxed) {
                mixed_workload(&wdb, 1000 + round, 5, 0).await;
                round += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            round
        })
    };

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = archived_seqs(&s3, &prefix).await.len();
    assert!(before > 0, "nothing archived before the kill");
    tokio::task::block_in_place(|| s3.kill9());
    let killed_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    tokio::task::block_in_place(|| s3.restart_keep_data());
    let outage = killed_at.elapsed();
    println!("store down for {outage:?}; {before} changes archived before the kill");
    let budget = Duration::from_millis(400 * u64::from(MAX_ATTEMPTS - 1));
    assert!(
        outage < budget,
        "the store was down {outage:?}, longer than the smallest retry budget {budget:?}: machine too loaded?"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    done.store(true, Ordering::Relaxed);
    let rounds = writer.await.unwrap();
    println!("{rounds} writer rounds");

    let read = async || s3.objects(&prefix).await;
    let changes = wait_replay_equals(&db, read, Some(&prefix), &pipeline).await;
    assert!(
        changes.len() > before,
        "{} changes, {before} before the kill",
        changes.len()
    );
    let (status, stdout, stderr) = w.output(&["parked", "list"]);
    assert!(status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("no parked batches"),
        "nothing may be parked:\n{stdout}\n{}",
        w.log()
    );
    let log = w.log();
    let most = log
        .lines()
        .filter(|l| l.contains("PUT failed; retrying"))
        .filter_map(|l| {
            l.split("attempt=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<u32>()
                .ok()
        })
        .max();
    println!("most attempts for one PUT during the outage: {most:?}");
    assert!(most.is_some(), "the outage was not noticed:\n{log}");
    w.stop();
    db.drop_db().await;
}
