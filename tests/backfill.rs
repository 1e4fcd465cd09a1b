//! Backfill against real Postgres and SeaweedFS with the real binary: rows
//! that already exist arrive as `read` events while streaming and writes go
//! on, resume after kill -9, and the archive's replay equals the tables.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use serde_json::Value;

const TABLES: [&str; 3] = ["a", "b", "c"];

/// Three tables with three kinds of key: a primary key, a composite primary
/// key, and no primary key but a unique index as replica identity.
async fn three_tables(db: &TestDb, rows: i64) {
    db.exec(&format!(
        "CREATE TABLE a (id int PRIMARY KEY, v int, note text);
         CREATE TABLE b (id bigint, k text, v int, note text, PRIMARY KEY (k, id));
         CREATE TABLE c (id int NOT NULL, v int, note text);
         CREATE UNIQUE INDEX c_id ON c (id);
         ALTER TABLE c REPLICA IDENTITY USING INDEX c_id;
         INSERT INTO a SELECT g, g, 'a' || g FROM generate_series(1, {rows}) g;
         INSERT INTO b SELECT g, 'k' || g, g, repeat('b', g % 50) FROM generate_series(1, {rows}) g;
         INSERT INTO c SELECT g, g, NULL FROM generate_series(1, {rows}) g;
         ANALYZE a, b, c;"
    ))
    .await;
}

/// Writes to random rows of the three tables (updates, deletes, re-inserts
/// and new rows) in small transactions until `stop`; counts transactions.
async fn writer(url: String, rows: i64, seed: u64, stop: Arc<AtomicBool>, done: Arc<AtomicU64>) {
    let db = TestDb::attach(&url).await;
    let mut rng = fastrand::Rng::with_seed(seed);
    while !stop.load(Ordering::Relaxed) {
        let mut sql = String::from("BEGIN;");
        for _ in 0..rng.usize(1..5) {
            let t = TABLES[rng.usize(0..3)];
            let id = rng.i64(1..rows + rows / 10);
            let key = |id: i64| match t {
                "b" => format!("k = 'k{id}' AND id = {id}"),
                _ => format!("id = {id}"),
            };
            let values = |id: i64, v: u32| match t {
                "b" => format!("({id}, 'k{id}', {v}, 'w')"),
                _ => format!("({id}, {v}, 'w')"),
            };
            let conflict = match t {
                "b" => "(k, id)",
                _ => "(id)",
            };
            match rng.u8(0..4) {
                0 | 1 => sql.push_str(&format!(
                    "UPDATE {t} SET v = v + 1, note = 'u{}' WHERE {};",
                    rng.u32(..),
                    key(id)
                )),
                2 => sql.push_str(&format!("DELETE FROM {t} WHERE {};", key(id))),
                _ => sql.push_str(&format!(
                    "INSERT INTO {t} VALUES {} ON CONFLICT {conflict} DO UPDATE SET v = excluded.v;",
                    values(id, rng.u32(..1000))
                )),
            }
        }
        sql.push_str("COMMIT;");
        db.exec(&sql).await;
        done.fetch_add(1, Ordering::Relaxed);
    }
}

/// A second `waltail` beside `run` (same settings and local state), as a
/// user runs `waltail backfill` next to a running pipeline.
fn beside(run: &Waltail, db: &TestDb, pipeline: &str, tables: &str) -> Waltail {
    let mut cli = Waltail::new(db, pipeline, tables);
    cli.env = run.env.clone();
    let state_dir = run.dir.path().join("waltail-state");
    cli.set("WALTAIL_STATE_DIR", state_dir.to_str().unwrap());
    cli
}

/// Replaying the archive gives exactly the three tables.
async fn assert_replay_equals_tables(db: &TestDb, prefix: &str, pipeline: &str) -> Vec<Value> {
    let mut last = BTreeMap::new();
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(90) {
        let objects = s3_objects(prefix).await;
        if !contiguous(&objects) {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        }
        let changes = checked_changes(&objects, Some(prefix), pipeline);
        let state = replay(&changes);
        let mut equal = true;
        for t in TABLES {
            let rows = db.rows(t).await;
            let archived = state
                .get(&format!("public.{t}"))
                .cloned()
                .unwrap_or_default();
            if rows != archived {
                equal = false;
                last.insert(
                    t,
                    (
                        rows.len(),
                        archived.len(),
                        first_difference(&rows, &archived),
                    ),
                );
            }
        }
        if equal {
            return changes;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("the archive's replay never equalled the tables: {last:?}");
}

fn first_difference(
    rows: &BTreeMap<String, Value>,
    archived: &BTreeMap<String, Value>,
) -> Option<String> {
    for (k, v) in rows {
        if archived.get(k) != Some(v) {
            return Some(format!("table {k}: {v}, archive: {:?}", archived.get(k)));
        }
    }
    archived
        .keys()
        .find(|k| !rows.contains_key(*k))
        .map(|k| format!("archive has {k}, the table does not"))
}

/// `read` events per (table, id), as (seq, commit_lsn) pairs.
fn reads_per_row(changes: &[Value]) -> BTreeMap<(String, String), Vec<(u64, String)>> {
    let mut reads: BTreeMap<_, Vec<_>> = BTreeMap::new();
    for c in changes.iter().filter(|c| c["op"] == "read") {
        reads
            .entry((c["table"].to_string(), c["data"]["id"].to_string()))
            .or_default()
            .push((c["seq"].as_u64().unwrap(), c["commit_lsn"].to_string()));
    }
    reads
}

/// Each row is read once.
fn assert_read_once(reads: &BTreeMap<(String, String), Vec<(u64, String)>>) {
    let twice: Vec<_> = reads.iter().filter(|(_, r)| r.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "{} rows were read more than once, e.g. {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
}

/// A running pipeline does the backfill asked for by another process, while
/// a writer updates, deletes and inserts rows of every table throughout.
/// Three readers at once: the tables keyed by one integer are split into
/// twelve ranges from their statistics, so their chunks' windows overlap;
/// the composite text key is read as one range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_while_writes_go_on() {
    const ROWS: i64 = 100_000;
    let db = TestDb::new("backfill").await;
    three_tables(&db, ROWS).await;
    let pipeline = unique("bf").replace('_', "-");
    let prefix = format!("backfill/{pipeline}");
    let mut run = Waltail::new(&db, &pipeline, "public.a, public.b, public.c");
    run.s3(&prefix)
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "500")
        .set("WALTAIL_DELIVERY_MAX_IN_FLIGHT", "8")
        .set("WALTAIL_BACKFILL_PARALLELISM", "3");
    run.start();

    let stop = Arc::new(AtomicBool::new(false));
    let txns = Arc::new(AtomicU64::new(0));
    let writing = tokio::spawn(writer(
        db.url.clone(),
        ROWS,
        fastrand::u64(..),
        stop.clone(),
        txns.clone(),
    ));

    let mut cli = beside(&run, &db, &pipeline, "public.a, public.b, public.c");
    cli.spawn(&["backfill", "--yes", "--chunk-size", "4000"]);
    let status = tokio::task::block_in_place(|| cli.wait_exit(Duration::from_secs(600)));
    let out = cli.log();
    assert!(status.success(), "backfill failed:\n{out}");
    assert!(
        out.contains("pipeline") && out.contains("is running"),
        "{out}"
    );
    for t in TABLES {
        assert!(out.contains(&format!("public.{t}: done")), "{out}");
    }
    let log = run.log();
    let started: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("backfill started"))
        .collect();
    for (t, parts) in [
        ("a", "ranges=12 readers=3"),
        ("b", "ranges=1 readers=1"),
        ("c", "ranges=12 readers=3"),
    ] {
        assert!(
            started
                .iter()
                .any(|l| l.contains(&format!("public.{t} ")) && l.contains(parts)),
            "public.{t} not read in {parts}: {started:?}"
        );
    }
    // Writes go on a little after the backfill, then stop.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    writing.await.unwrap();
    let written = txns.load(Ordering::Relaxed);
    assert!(written > 100, "the writer ran only {written} transactions");

    let changes = assert_replay_equals_tables(&db, &prefix, &pipeline).await;
    let reads = reads_per_row(&changes);
    assert!(
        reads.len() as i64 > 2 * ROWS,
        "too few rows read: {}",
        reads.len()
    );
    assert_read_once(&reads);
    // Before 14 the watermarks are rows of a table in the publication:
    // none is archived, and the table keeps only the last one.
    assert!(
        changes
            .iter()
            .all(|c| c["table"] != "public.waltail_watermarks"),
        "a watermark row was archived"
    );
    let exists: bool = db
        .client
        .query_one(
            "SELECT to_regclass('public.waltail_watermarks') IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let watermark_rows = if exists {
        db.client
            .query_one("SELECT count(*)::int FROM public.waltail_watermarks", &[])
            .await
            .unwrap()
            .get::<_, i32>(0)
    } else {
        -1
    };
    if db.server_version().await < 140000 {
        assert_eq!(watermark_rows, 1, "the table keeps the last watermark");
    } else {
        assert_eq!(watermark_rows, -1, "14+ writes logical messages, no table");
    }
    run.stop();
    db.drop_db().await;
}

/// A commit that is in the WAL (so the stream has it) but not yet visible to
/// new snapshots is not overwritten by the `read` of a chunk whose window
/// opens meanwhile: the chunk waits until it is visible (after 10 s with its
/// window closed, then reads again). Every commit passes
/// through that moment; a synchronous standby that never answers holds a
/// commit there for as long as the test needs (CI once caught the short
/// natural one: a row's read replayed over its newer update).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_not_yet_visible_is_not_overwritten_by_a_read() {
    let pg = common::pg::DedicatedPg::start();
    let db = TestDb::on(pg.url(), "bfvisible").await;
    three_tables(&db, 300).await;
    let pipeline = unique("bfvis").replace('_', "-");
    let prefix = format!("backfill/{pipeline}");
    let mut run = Waltail::new(&db, &pipeline, "public.a, public.b, public.c");
    run.s3(&prefix);
    run.start();

    // Sessions that ask for synchronous commit now wait for a standby that
    // never connects; everyone else commits locally.
    db.exec("CREATE TABLE sync_probe (n int)").await;
    db.exec("ALTER SYSTEM SET synchronous_standby_names = 'never_connects'")
        .await;
    db.exec("ALTER SYSTEM SET synchronous_commit = 'local'")
        .await;
    db.exec("SELECT pg_reload_conf()").await;
    let held = std::sync::Arc::new(TestDb::attach(&db.url).await);
    let pid: i32 = held
        .client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    held.exec("SET synchronous_commit = on").await;
    // The reload reaches the server's processes in their own time, and
    // commits wait only once the checkpointer has it (CI once saw the
    // update commit at once). A probe commit, on a table outside the
    // pipeline, shows when they wait; it is then let go.
    let mut probes = 0;
    while !commit_waits(&db, &held, pid, "INSERT INTO sync_probe VALUES (1)").await {
        probes += 1;
        assert!(probes < 60, "commits never waited for the standby");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    db.exec(&format!("SELECT pg_cancel_backend({pid})")).await;
    eventually(Duration::from_secs(30), "the probe let go", async || {
        !sync_rep_waits(&db, pid).await
    })
    .await;
    let updating = {
        let held = held.clone();
        tokio::spawn(async move {
            held.client
                .batch_execute("UPDATE a SET v = -1 WHERE id = 150")
                .await
        })
    };
    eventually(Duration::from_secs(30), "the commit held", async || {
        sync_rep_waits(&db, pid).await
    })
    .await;
    // The stream has the update; new snapshots do not see it yet.
    eventually(Duration::from_secs(30), "the update archived", async || {
        let objects = s3_objects(&prefix).await;
        contiguous(&objects)
            && checked_changes(&objects, Some(&prefix), &pipeline)
                .iter()
                .any(|c| c["op"] == "update" && c["data"]["v"] == -1)
    })
    .await;
    assert_eq!(db.rows("a").await["150"]["v"], 150);
    // A transaction left open (idle, with a change) has not begun to commit:
    // the backfill does not wait for it.
    let idle = TestDb::attach(&db.url).await;
    idle.exec("BEGIN; UPDATE b SET v = -2 WHERE id = 1").await;

    let mut cli = beside(&run, &db, &pipeline, "public.a, public.b, public.c");
    cli.spawn(&["backfill", "--yes", "--chunk-size", "100"]);
    tokio::task::block_in_place(|| {
        run.wait_log("waits for 1 transaction ", Duration::from_secs(30));
        // Longer than a chunk keeps its window open (the slot held at its
        // low watermark): it waits on with the window closed.
        run.wait_log("gave up its window", Duration::from_secs(30));
    });
    assert!(!updating.is_finished());
    // The standby wait given up: the commit becomes visible.
    db.exec(&format!("SELECT pg_cancel_backend({pid})")).await;
    updating.await.unwrap().unwrap();
    assert_eq!(db.rows("a").await["150"]["v"], -1);

    let status = tokio::task::block_in_place(|| cli.wait_exit(Duration::from_secs(120)));
    assert!(status.success(), "backfill failed:\n{}", cli.log());
    idle.exec("COMMIT").await;
    let changes = assert_replay_equals_tables(&db, &prefix, &pipeline).await;
    assert_read_once(&reads_per_row(&changes));
    assert_eq!(reads_per_row(&changes).len(), 900);
    run.stop();
}

/// Whether session `pid` waits for a synchronous standby.
async fn sync_rep_waits(db: &TestDb, pid: i32) -> bool {
    db.client
        .query_opt(
            "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'SyncRep'",
            &[&pid],
        )
        .await
        .unwrap()
        .is_some()
}

/// Runs `sql` on `session` (backend `pid`, synchronous_commit on): true
/// once its commit waits for the standby (it is left waiting), false when
/// it commits at once.
async fn commit_waits(
    db: &TestDb,
    session: &std::sync::Arc<TestDb>,
    pid: i32,
    sql: &'static str,
) -> bool {
    let running = {
        let session = session.clone();
        tokio::spawn(async move { session.client.batch_execute(sql).await })
    };
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if sync_rep_waits(db, pid).await {
            return true;
        }
        if running.is_finished() {
            running.await.unwrap().unwrap();
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{sql} neither committed nor waited for the standby within 10 s");
}

/// `waltail backfill` with no pipeline running runs one itself; killed with
/// -9 in the middle, it resumes from its last chunk, and the archive holds
/// every row exactly once, with no seq in two objects. Three readers, so the
/// kills land while several chunks' windows are open, and a restart may find
/// the cursor past a chunk's low watermark but before its high one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_resumes_after_kill9() {
    const ROWS: i64 = 100_000;
    let db = TestDb::new("bfkill").await;
    three_tables(&db, ROWS).await;
    let pipeline = unique("bfkill").replace('_', "-");
    let prefix = format!("backfill/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.a, public.b, public.c");
    // Paced (300,000 rows take 15 s at least), so each kill lands in the
    // middle of the backfill however fast the machine is: unpaced, an idle
    // machine once finished it between two looks at the bucket.
    w.s3(&prefix)
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "500")
        .set("WALTAIL_DELIVERY_RATE_LIMIT", "20000")
        .set("WALTAIL_BACKFILL_PARALLELISM", "3");

    // Four kills: in two runs of this test with a count added, the last
    // start found a chunk done past the confirmed position once each (the
    // log's "go out again"), the case overlapping windows bring.
    for round in 0..4 {
        w.spawn(&["backfill", "--yes", "--chunk-size", "3000"]);
        let wanted = 30 + round * 60;
        eventually(Duration::from_secs(120), "some objects", async || {
            s3_objects(&prefix).await.len() >= wanted
        })
        .await;
        // Changes while nothing runs come through the slot afterwards.
        db.exec(&format!(
            "UPDATE a SET v = -1 WHERE id % 1000 = {round}; DELETE FROM c WHERE id % 997 = {round}"
        ))
        .await;
        tokio::task::block_in_place(|| w.kill9());
    }
    w.spawn(&["backfill", "--yes"]);
    let status = tokio::task::block_in_place(|| w.wait_exit(Duration::from_secs(600)));
    let out = w.log();
    assert!(status.success(), "{out}");
    assert!(out.contains("resuming the backfill"), "{out}");

    let changes = assert_replay_equals_tables(&db, &prefix, &pipeline).await;
    let reads = reads_per_row(&changes);
    assert_read_once(&reads);
    // Chunk rows wait in files beside the state until their high watermark
    // is confirmed: none is left once the backfill is archived, not even
    // those of the chunks the kills cut short.
    let chunks = w
        .dir
        .path()
        .join("waltail-state")
        .join(format!("{pipeline}.chunks"));
    let left: Vec<_> = std::fs::read_dir(&chunks)
        .unwrap_or_else(|e| panic!("{}: {e}", chunks.display()))
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left in {}: {left:?}", chunks.display());
    db.drop_db().await;
}

/// The estimate is shown and confirmed first; without a terminal `--yes`
/// is required; tables without a usable key, or not configured, are
/// refused with the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_asks_first_and_refuses_what_it_cannot_do() {
    let db = TestDb::new("bfask").await;
    db.exec(
        "CREATE TABLE small (id int PRIMARY KEY, v text);
         INSERT INTO small SELECT g, 'v' || g FROM generate_series(1, 1234) g;
         CREATE TABLE nokey (id int, v text);
         INSERT INTO nokey VALUES (1, 'x');",
    )
    .await;
    let pipeline = unique("bfask").replace('_', "-");
    let prefix = format!("backfill/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.small, public.nokey");
    w.s3(&prefix);

    // No terminal, no --yes: refused before anything starts.
    let (status, stdout, stderr) = w.output(&["backfill", "public.small"]);
    assert_eq!(status.code(), Some(2), "{stdout}{stderr}");
    assert!(stderr.contains("--yes"), "{stderr}");
    assert!(
        stdout.contains("public.small") && stdout.contains("1,234"),
        "{stdout}"
    );

    // On a terminal: the estimate, the question, and "n" starts nothing.
    let script = |answer: &str| {
        let mut cmd = std::process::Command::new("script");
        cmd.args([
            "-qec",
            &format!("{} backfill public.small", bin()),
            "/dev/null",
        ])
        .current_dir(w.dir.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        for (k, v) in &w.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        use std::io::Write;
        // The answer comes after the question is on the screen.
        std::thread::sleep(Duration::from_secs(3));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(format!("{answer}\n").as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (status, out) = tokio::task::block_in_place(|| script("n"));
    assert!(status.success(), "{out}");
    assert!(out.contains("1,234") && out.contains("expected"), "{out}");
    assert!(out.contains("start the backfill? [y/N]"), "{out}");
    assert!(out.contains("nothing started"), "{out}");
    assert!(
        s3_objects(&prefix)
            .await
            .iter()
            .all(|o| !o.key.ends_with(".ndjson"))
    );

    let (status, out) = tokio::task::block_in_place(|| script("y"));
    assert!(status.success(), "{out}");
    assert!(out.contains("public.small: done (1,234 rows read"), "{out}");
    let changes = checked_changes(&s3_objects(&prefix).await, Some(&prefix), &pipeline);
    assert_eq!(changes.len(), 1234);
    assert!(changes.iter().all(|c| c["op"] == "read"));
    assert_eq!(replay(&changes)["public.small"], db.rows("small").await);
    let (_, json, _) = w.output(&["status", "--json"]);
    let status: Value = serde_json::from_str(&json).unwrap();
    let backfill = &status["backfills"][0];
    assert_eq!(backfill["table"], "public.small", "{status}");
    assert_eq!(backfill["status"], "done", "{status}");
    assert_eq!(backfill["rows_read"], 1234, "{status}");
    assert_eq!(backfill["estimate"], 1234, "{status}");
    let (_, text, _) = w.output(&["status"]);
    assert!(
        text.contains("backfill     public.small: done, 1234 of ~1234 rows (100%)"),
        "{text}"
    );

    // A table without a key: the error names it and the two fixes.
    let (status, stdout, stderr) = w.output(&["backfill", "--yes", "public.nokey"]);
    assert_eq!(status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stderr.contains("table public.nokey has no primary key"),
        "{stderr}"
    );
    assert!(
        stderr.contains("ADD PRIMARY KEY") && stderr.contains("REPLICA IDENTITY USING INDEX"),
        "{stderr}"
    );
    // A table outside source.tables.
    let (status, _, stderr) = w.output(&["backfill", "--yes", "public.other"]);
    assert_eq!(status.code(), Some(1));
    assert!(stderr.contains("not in source.tables"), "{stderr}");
    db.drop_db().await;
}

/// `waltail backfill --cancel` stops a backfill in progress: the command
/// following it ends (exit 1, cancelled), streaming goes on, and the slot's
/// position is not held back at a chunk's low watermark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_can_be_cancelled() {
    let db = TestDb::new("bfcancel").await;
    db.exec(
        "CREATE TABLE a (id int PRIMARY KEY, v int, note text);
         INSERT INTO a SELECT g, g, 'a' FROM generate_series(1, 200000) g;
         ANALYZE a;",
    )
    .await;
    let pipeline = unique("bfcancel").replace('_', "-");
    let prefix = format!("backfill/{pipeline}");
    let mut run = Waltail::new(&db, &pipeline, "public.a");
    run.s3(&prefix)
        .set("WALTAIL_TELEMETRY_LISTEN", "127.0.0.1:0");
    run.start();
    let log = run.log();
    let console = log
        .split("serving the console at http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("no console address in the log:\n{log}"))
        .to_string();
    let console_backfill = || {
        let (code, body) = http_get(&console, "/api/state");
        assert_eq!(code, 200, "{body}");
        let state: Value = serde_json::from_str(&body).unwrap();
        state["backfills"][0].clone()
    };
    let mut cli = beside(&run, &db, &pipeline, "public.a");
    cli.spawn(&["backfill", "--yes", "--chunk-size", "500"]);
    eventually(Duration::from_secs(60), "some read events", async || {
        s3_objects(&prefix)
            .await
            .iter()
            .filter(|o| o.key.ends_with(".ndjson"))
            .count()
            >= 3
    })
    .await;

    let shown = console_backfill();
    assert_eq!(shown["table"], "public.a", "{shown}");
    assert_eq!(shown["status"], "running", "{shown}");
    assert_eq!(shown["estimate"], 200_000, "{shown}");
    let (status, stdout, stderr) = run.output(&["backfill", "--cancel"]);
    assert!(status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("cancelled 1 backfill(s)"), "{stdout}");
    let status = tokio::task::block_in_place(|| cli.wait_exit(Duration::from_secs(60)));
    let out = cli.log();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("public.a: cancelled"), "{out}");
    assert_eq!(console_backfill()["status"], "cancelled");

    // Streaming goes on, and everything up to now gets confirmed.
    db.exec("INSERT INTO a VALUES (300001, 1, 'after')").await;
    let lsn: String = db
        .client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    eventually(
        Duration::from_secs(30),
        "the slot confirmed past the insert",
        async || {
            db.client
            .query_one(
                "SELECT bool_and(confirmed_flush_lsn >= $1::text::pg_lsn) FROM pg_replication_slots
                 WHERE database = current_database()",
                &[&lsn],
            )
            .await
            .unwrap()
            .get::<_, Option<bool>>(0)
            == Some(true)
        },
    )
    .await;
    let objects = s3_objects(&prefix).await;
    let changes = checked_changes(&objects, Some(&prefix), &pipeline);
    let reads = changes.iter().filter(|c| c["op"] == "read").count();
    assert!(
        reads < 200_000,
        "the backfill was not cancelled: {reads} rows read"
    );
    assert!(
        changes
            .iter()
            .any(|c| c["op"] == "insert" && c["data"]["id"] == 300001),
        "the insert after the cancel is not archived"
    );
    run.stop();
    db.drop_db().await;
}

/// A column added while a table is read is read (and recorded in the
/// schema) from the next chunk on: each reader checks the table's catalog
/// entry before every chunk and plans again when it changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_added_during_a_backfill_is_read_from_the_next_chunk() {
    const ROWS: usize = 40_000;
    let db = TestDb::new("bfalter").await;
    db.exec(&format!(
        "CREATE TABLE a (id int PRIMARY KEY, v int);
         INSERT INTO a SELECT g, g FROM generate_series(1, {ROWS}) g;
         ANALYZE a;"
    ))
    .await;
    let pipeline = unique("bfalter").replace('_', "-");
    let prefix = format!("backfill/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.a");
    // Paced, so the column comes in the middle of the table.
    w.s3(&prefix)
        .set("WALTAIL_DELIVERY_RATE_LIMIT", "5000")
        .set("WALTAIL_BACKFILL_PARALLELISM", "2");
    w.spawn(&["backfill", "--yes", "--chunk-size", "500"]);
    eventually(Duration::from_secs(60), "some read events", async || {
        s3_objects(&prefix).await.len() >= 5
    })
    .await;
    db.exec("ALTER TABLE a ADD COLUMN extra text DEFAULT 'x'")
        .await;
    let status = tokio::task::block_in_place(|| w.wait_exit(Duration::from_secs(120)));
    assert!(status.success(), "{}", w.log());

    let objects = s3_objects(&prefix).await;
    let mut reads: Vec<Value> = checked_changes(&objects, Some(&prefix), &pipeline)
        .into_iter()
        .filter(|c| c["op"] == "read")
        .collect();
    reads.sort_by_key(|c| c["seq"].as_u64().unwrap());
    assert_eq!(reads.len(), ROWS);
    let ids: std::collections::BTreeSet<i64> = reads
        .iter()
        .map(|c| c["data"]["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids.len(), ROWS, "every row read once");
    let with: Vec<bool> = reads
        .iter()
        .map(|c| c["data"].get("extra").is_some())
        .collect();
    let first = with
        .iter()
        .position(|&w| w)
        .expect("no read event has the added column");
    assert!(first > 0, "every read event has the added column");
    // Chunks already read when the column came may still go out after it
    // (the other reader's), but a reader that saw it never reads without it.
    let after: Vec<&Value> = reads[first..].iter().collect();
    let without = after
        .iter()
        .filter(|c| c["data"].get("extra").is_none())
        .count();
    assert!(
        without <= 2 * 500,
        "{without} read events after the first with the column lack it"
    );
    assert!(
        after
            .iter()
            .filter(|c| c["data"].get("extra").is_some())
            .all(|c| c["data"]["extra"] == "x")
    );
    db.drop_db().await;
}
