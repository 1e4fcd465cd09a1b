//! Delivery under failure, against real Postgres and SeaweedFS with the real
//! binary: the store unreachable past the retry budget (parking, held rows,
//! replay), kill -9 at random moments, and Postgres restarts.

mod common;

use std::time::Duration;

use common::pg::DedicatedPg;
use common::proxy::{Mode, Proxy};
use common::*;

/// Seqs present in the archive under `prefix`.
async fn archived_seqs(prefix: &str) -> Vec<u64> {
    seqs_of(&s3_objects(prefix).await)
}

/// A running pipeline of `tables` writing to SeaweedFS through a proxy the
/// test can break, one change per object, parking after two attempts of a
/// second each: (proxy, pipeline, prefix, waltail).
fn behind_a_proxy(db: &TestDb, name: &str, tables: &str) -> (Proxy, String, String, Waltail) {
    let proxy = Proxy::start(s3_addr());
    let pipeline = unique(name).replace('_', "-");
    let prefix = format!("{name}/{pipeline}");
    let mut w = Waltail::new(db, &pipeline, tables);
    w.s3(&prefix)
        .set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url())
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "1")
        .set("WALTAIL_DELIVERY_MAX_ATTEMPTS", "2")
        .set("WALTAIL_DELIVERY_REQUEST_TIMEOUT_MS", "1000");
    w.start();
    (proxy, pipeline, prefix, w)
}

/// An outage of the store: one batch fails on connection resets, one on a
/// blackholed connection; both park after their attempts. Later changes to
/// their rows are held, another row flows on, and replay (through the
/// running pipeline, or by the CLI when none runs) delivers the rest.
async fn outage_then_replay(replay_while_running: bool) {
    let db = TestDb::new("outage").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    let (proxy, pipeline, prefix, mut w) = behind_a_proxy(&db, "outage", "public.t");
    db.exec("INSERT INTO t VALUES (1, 0), (2, 0), (3, 0), (4, 0)")
        .await;
    eventually(Duration::from_secs(30), "the inserts", async || {
        archived_seqs(&prefix).await.len() == 4
    })
    .await;

    proxy.set_mode(Mode::Reset);
    db.exec("UPDATE t SET v = 1 WHERE id = 1").await; // seq 5
    eventually(Duration::from_secs(30), "seq 5 parked", async || {
        w.parked_counts().0 == 1
    })
    .await;
    proxy.set_mode(Mode::Blackhole);
    db.exec("UPDATE t SET v = 1 WHERE id = 2").await; // seq 6
    eventually(Duration::from_secs(30), "seq 6 parked", async || {
        w.parked_counts().0 == 2
    })
    .await;

    proxy.set_mode(Mode::Pass);
    db.exec("UPDATE t SET v = 2 WHERE id = 1").await; // seq 7: held behind 5
    db.exec("UPDATE t SET v = 2 WHERE id = 3").await; // seq 8: flows on
    let before_last: String = db
        .client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    db.exec("UPDATE t SET v = 2 WHERE id = 2").await; // seq 9: held behind 6
    eventually(Duration::from_secs(30), "seq 8 delivered", async || {
        archived_seqs(&prefix).await.contains(&8)
    })
    .await;
    eventually(Duration::from_secs(30), "two held batches", async || {
        w.parked_counts() == (2, 2)
    })
    .await;
    assert_eq!(
        archived_seqs(&prefix).await,
        vec![1, 2, 3, 4, 8],
        "parked and held seqs must not be in the archive yet"
    );
    let (_, list, _) = w.output(&["parked", "list"]);
    assert!(list.contains("public.t") && list.contains("5-5"), "{list}");

    // The slot is confirmed past the last (held) transaction: parked and held
    // batches are durable locally, so they must not hold WAL.
    let slot = format!("waltail_{}", pipeline.replace('-', "_"));
    eventually(Duration::from_secs(10), "the slot confirmed past the held transaction", async || {
        db.client
            .query_one(
                "SELECT confirmed_flush_lsn > $1::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $2",
                &[&before_last, &slot],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;

    if !replay_while_running {
        w.stop();
    }
    let (status, stdout, stderr) = w.output(&["parked", "replay", "--all"]);
    assert!(status.success(), "replay failed:\n{stdout}\n{stderr}");
    let read = async || s3_objects(&prefix).await;
    let changes = checked_changes(&read().await, Some(&prefix), &pipeline);
    assert_eq!(
        changes.len(),
        9,
        "every seq archived exactly once after replay"
    );
    assert_eq!(w.parked_counts(), (0, 0));
    let mut db = db;
    db.reconnect().await;
    let rows = db.rows("t").await;
    let state = replay(&changes);
    assert_eq!(state["public.t"], rows);
    if replay_while_running {
        w.stop();
    }
    db.drop_db().await;
}

#[tokio::test]
async fn outage_parks_batches_holds_their_rows_and_replay_through_the_running_pipeline_delivers_all()
 {
    outage_then_replay(true).await;
}

#[tokio::test]
async fn replay_without_a_running_pipeline_delivers_parked_then_held_batches() {
    outage_then_replay(false).await;
}

/// A truncate changes every row of its table: it waits behind a parked
/// batch of one of that table's rows, and the table's later changes (of
/// any row) wait behind the held truncate, while another table flows on;
/// replay delivers them in seq order.
#[tokio::test]
async fn a_truncate_waits_behind_a_parked_batch_of_its_tables_rows() {
    let db = TestDb::new("trunc").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    db.exec("CREATE TABLE u (id int PRIMARY KEY, v int)").await;
    let (proxy, pipeline, prefix, mut w) = behind_a_proxy(&db, "trunc", "public.t, public.u");
    db.exec("INSERT INTO t VALUES (1, 0), (2, 0)").await; // seqs 1, 2
    db.exec("INSERT INTO u VALUES (1, 0)").await; // seq 3
    eventually(Duration::from_secs(30), "the inserts", async || {
        archived_seqs(&prefix).await.len() == 3
    })
    .await;

    proxy.set_mode(Mode::Reset);
    db.exec("UPDATE t SET v = 1 WHERE id = 1").await; // seq 4: parked
    eventually(Duration::from_secs(30), "seq 4 parked", async || {
        w.parked_counts().0 == 1
    })
    .await;
    proxy.set_mode(Mode::Pass);
    db.exec("TRUNCATE t").await; // seq 5: held behind 4 (row 1 is t's)
    db.exec("INSERT INTO t VALUES (3, 0)").await; // seq 6: held behind the truncate
    db.exec("UPDATE u SET v = 1 WHERE id = 1").await; // seq 7: flows
    eventually(Duration::from_secs(30), "seq 7 delivered", async || {
        archived_seqs(&prefix).await.contains(&7)
    })
    .await;
    eventually(Duration::from_secs(30), "two held batches", async || {
        w.parked_counts() == (1, 2)
    })
    .await;
    assert_eq!(
        archived_seqs(&prefix).await,
        vec![1, 2, 3, 7],
        "nothing of t may pass its parked batch"
    );

    let (status, stdout, stderr) = w.output(&["parked", "replay", "--all"]);
    assert!(status.success(), "replay failed:\n{stdout}\n{stderr}");
    let changes = checked_changes(&s3_objects(&prefix).await, Some(&prefix), &pipeline);
    assert_eq!(
        changes.len(),
        7,
        "every seq archived exactly once after replay"
    );
    assert_eq!(w.parked_counts(), (0, 0));
    let mut db = db;
    db.reconnect().await;
    let state = replay(&changes);
    assert_eq!(state["public.t"], db.rows("t").await);
    assert_eq!(state["public.u"], db.rows("u").await);
    w.stop();
    db.drop_db().await;
}

#[tokio::test]
async fn kill_9_at_random_moments_loses_nothing_and_never_writes_a_seq_twice() {
    let db = TestDb::new("kill9").await;
    db.exec(TABLES).await;
    let pipeline = unique("kill9").replace('_', "-");
    let prefix = format!("kill9/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.s3(&prefix).set("WALTAIL_DELIVERY_BATCH_SIZE", "4");
    let seed = std::env::var("WT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("seed {seed} (set WT_TEST_SEED to repeat)");
    let mut rng = fastrand::Rng::with_seed(seed);
    for round in 0..8u64 {
        w.start();
        let url = db.url.clone();
        let writer_seed = rng.u64(..);
        let writer = tokio::spawn(async move {
            let wdb = TestDb::attach(&url).await;
            mixed_workload(&wdb, writer_seed, 80, 0).await;
        });
        tokio::time::sleep(Duration::from_millis(rng.u64(50..700))).await;
        w.kill9();
        writer.await.unwrap();
        println!("round {round}: killed");
    }
    w.start();
    let read = async || s3_objects(&prefix).await;
    let changes = wait_replay_equals(&db, read, Some(&prefix), &pipeline).await;
    assert!(changes.len() > 500, "{}", changes.len());
    w.stop();
    db.drop_db().await;
}

#[tokio::test]
async fn postgres_restart_mid_stream_reconnects_and_loses_nothing() {
    let pg = DedicatedPg::start();
    let mut db = TestDb::on(pg.url(), "pgrestart").await;
    db.exec(TABLES).await;
    let pipeline = unique("pgrestart").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.set("WALTAIL_DELIVERY_BATCH_SIZE", "3");
    let root = w.dir.path().join("waltail-archive");
    let read = async || file_objects(&root);
    w.start();
    mixed_workload(&db, 11, 60, 0).await;
    pg.restart();
    db.reconnect().await;
    mixed_workload(&db, 12, 60, 0).await;
    pg.restart();
    db.reconnect().await;
    mixed_workload(&db, 13, 60, 0).await;
    wait_replay_equals(&db, read, None, &pipeline).await;
    assert!(w.log().contains("reconnecting"), "{}", w.log());
    w.stop();
}

/// While uploads hang, the pipeline stops reading from Postgres (backpressure)
/// but keeps answering the walsender, so it is not disconnected after
/// wal_sender_timeout; when the store answers again everything arrives.
#[tokio::test]
async fn a_hung_store_applies_backpressure_without_losing_the_replication_connection() {
    let pg = DedicatedPg::start();
    let db = TestDb::on(pg.url(), "backpressure").await;
    db.exec("ALTER SYSTEM SET wal_sender_timeout = '2s'").await;
    db.exec("SELECT pg_reload_conf()").await;
    db.exec(TABLES).await;
    let proxy = Proxy::start(s3_addr());
    let pipeline = unique("bp").replace('_', "-");
    let prefix = format!("backpressure/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.s3(&prefix)
        .set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url())
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "500")
        .set("WALTAIL_DELIVERY_MAX_IN_FLIGHT", "1")
        .set("WALTAIL_DELIVERY_REQUEST_TIMEOUT_MS", "9000");
    w.start();
    let walsender_pid = async || -> Option<i32> {
        db.client
            .query_opt(
                "SELECT pid FROM pg_stat_replication WHERE application_name LIKE 'waltail%'",
                &[],
            )
            .await
            .unwrap()
            .map(|r| r.get(0))
    };
    let pid = walsender_pid()
        .await
        .expect("waltail's walsender is connected");
    proxy.set_mode(Mode::Blackhole);
    mixed_workload(&db, 21, 100, 0).await;
    // Enough to fill the event channel and the socket buffers, so the
    // walsender itself blocks on a full connection.
    db.exec("INSERT INTO customers SELECT g, repeat('x', 200), NULL, 1 FROM generate_series(100000, 199999) g").await;
    // Three times wal_sender_timeout with the one upload slot hung.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        walsender_pid().await,
        Some(pid),
        "the walsender was replaced:\n{}",
        w.log()
    );
    assert!(!w.log().contains("reconnecting"), "{}", w.log());
    proxy.set_mode(Mode::Pass);
    let read = async || s3_objects(&prefix).await;
    wait_replay_equals(&db, read, Some(&prefix), &pipeline).await;
    assert!(w.parked_counts() == (0, 0), "nothing should have parked");
    w.stop();
}

/// A slot invalidated by max_slot_wal_keep_size while waltail was stopped:
/// `run` stops with a message that says what was lost and how to recover.
#[tokio::test]
async fn an_invalidated_slot_stops_run_with_the_recovery_steps() {
    let pg = DedicatedPg::start();
    let db = TestDb::on(pg.url(), "invalidated").await;
    db.exec("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        .await;
    db.exec("SELECT pg_reload_conf()").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, pad text)")
        .await;
    let pipeline = unique("inval").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.t");
    w.start();
    w.stop();
    for i in 0..6 {
        db.exec(&format!(
            "INSERT INTO t SELECT g, repeat('x', 1000) FROM generate_series({0} * 10000, {0} * 10000 + 9999) g; SELECT pg_switch_wal(); CHECKPOINT;",
            i
        ))
        .await;
    }
    let status: String = db
        .client
        .query_one(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name LIKE 'waltail_inval%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(status, "lost", "the test needs an invalidated slot");
    let (code, _, stderr) = w.output(&["run"]);
    assert_eq!(code.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("invalidated") && stderr.contains("--recreate-slot"),
        "{stderr}"
    );
}

/// A tmpfs of limited size mounted at a folder, unmounted when dropped: a
/// small disk to fill. Needs root (CI runs as root).
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(dir: &std::path::Path, size: &str) -> SmallDisk {
        std::fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "waltail-test"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "this test mounts a small tmpfs and needs root: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk(dir.to_path_buf())
    }

    /// The disk grown to `size`, its files kept: the space came back.
    fn grow(&self, size: &str) {
        let out = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// The state folder's disk fills while a large transaction spills there:
/// `run` stops with the error and what to do (not a retry loop); once the
/// disk has room, the next start archives everything, each change once.
#[tokio::test]
async fn a_full_state_disk_stops_run_saying_what_to_do_and_the_next_start_loses_nothing() {
    let pg = DedicatedPg::start();
    let db = TestDb::on(pg.url(), "diskfull").await;
    db.exec("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'")
        .await;
    db.exec("SELECT pg_reload_conf()").await;
    db.exec("CREATE TABLE big (id int PRIMARY KEY, pad text)")
        .await;
    let pipeline = unique("diskfull").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.big");
    let state = w.dir.path().join("state");
    let disk = SmallDisk::mount(&state, "4m");
    w.set("WALTAIL_STATE_DIR", state.to_str().unwrap())
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "1000");
    let root = w.dir.path().join("waltail-archive");
    let archived =
        || -> Vec<serde_json::Value> { checked_changes(&file_objects(&root), None, &pipeline) };
    w.start();
    db.exec("INSERT INTO big SELECT g, 'before' FROM generate_series(1, 10) g")
        .await;
    let start = std::time::Instant::now();
    while archived().len() < 10 {
        assert!(start.elapsed() < Duration::from_secs(30), "{}", w.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // About 60 MB rendered: streamed while in progress, spilled past the
    // 16 MB memory budget into state_dir, whose disk holds 4 MB.
    db.exec("INSERT INTO big SELECT g, repeat('x', 500) FROM generate_series(11, 100010) g")
        .await;
    let status = w.wait_exit(Duration::from_secs(120));
    let log = w.log();
    assert!(!status.success(), "{log}");
    assert!(
        (log.contains("No space left on device") || log.contains("disk is full"))
            && log.contains("free space on that filesystem"),
        "{log}"
    );
    assert!(!log.contains("reconnecting"), "no retry loop: {log}");
    assert_eq!(archived().len(), 10, "nothing of the large transaction yet");

    disk.grow("512m");
    w.start();
    db.exec("UPDATE big SET pad = 'after' WHERE id = 1").await;
    let start = std::time::Instant::now();
    let changes = loop {
        let changes = archived();
        if changes.len() >= 100_011 {
            break changes;
        }
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "{} of 100,011 changes:\n{}",
            changes.len(),
            w.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // checked_changes checked the contract (seqs 1..=N, each once).
    assert_eq!(changes.len(), 100_011);
    assert_eq!(replay(&changes)["public.big"], db.rows("big").await);
    w.stop();
    drop(disk);
}

/// Batches whose PUTs were under way when the run was killed keep the
/// encoding they were cut with when `destination.compression` changed
/// before the restart: they are sent again under their recorded keys
/// (`.ndjson.gz`), and only the batches cut after the restart follow the
/// new setting. So no seq range gets a second object under another name.
#[tokio::test]
async fn batches_sent_again_after_the_compression_changed_keep_their_keys() {
    let db = TestDb::new("codecchange").await;
    db.exec(TABLES).await;
    let proxy = Proxy::start(s3_addr());
    let pipeline = unique("cc").replace('_', "-");
    let prefix = format!("codecchange/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.s3(&prefix)
        .set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url())
        .set("WALTAIL_DESTINATION_COMPRESSION", "gzip")
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "4")
        .set("WALTAIL_DELIVERY_REQUEST_TIMEOUT_MS", "60000");
    w.start();
    // A change of each table goes through first: the tables' schema
    // records are written (they would wait for the store before any batch
    // is cut).
    db.exec(
        "INSERT INTO customers VALUES (1000, 'x', DATE '2024-01-01', 1);
         INSERT INTO orders (id, customer) VALUES (1000, 'x')",
    )
    .await;
    let read = async || s3_objects(&prefix).await;
    wait_replay_equals(&db, read, Some(&prefix), &pipeline).await;
    proxy.set_mode(Mode::Blackhole);
    mixed_workload(&db, 5, 10, 0).await;
    // The batches are cut and their intents recorded as their PUTs start
    // (and hang): the state says which are under way.
    let state = w
        .dir
        .path()
        .join(format!("waltail-state/{pipeline}.sqlite"));
    eventually(Duration::from_secs(20), "intents recorded", || {
        let state = state.clone();
        async move {
            let conn = rusqlite::Connection::open(&state).unwrap();
            conn.query_row(
                "SELECT count(*) FROM intents WHERE codec = 'gzip' AND done = 0",
                [],
                |r| r.get::<_, i64>(0),
            )
            .unwrap()
                > 0
        }
    })
    .await;
    w.kill9();
    let pending: Vec<(i64, i64)> = {
        let conn = rusqlite::Connection::open(&state).unwrap();
        let mut rows = conn
            .prepare("SELECT first_seq, last_seq FROM intents WHERE done = 0")
            .unwrap();
        rows.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    proxy.set_mode(Mode::Pass);
    w.set("WALTAIL_DESTINATION_COMPRESSION", "none");
    w.start();
    mixed_workload(&db, 6, 10, 0).await;
    wait_replay_equals(&db, read, Some(&prefix), &pipeline).await;
    let objects = s3_objects(&prefix).await;
    for (first, last) in &pending {
        let name = format!("-{first}-{last}.ndjson.gz");
        assert!(
            objects.iter().any(|o| o.key.ends_with(&name)),
            "the batch {first}-{last} cut as gzip was sent again under another key: {:?}",
            objects.iter().map(|o| &o.key).collect::<Vec<_>>()
        );
    }
    assert!(
        objects.iter().any(|o| o.key.ends_with(".ndjson")),
        "batches cut after the restart follow the new setting"
    );
    w.stop();
    db.drop_db().await;
}
