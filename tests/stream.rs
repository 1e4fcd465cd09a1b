//! `waltail run` against real Postgres and SeaweedFS: the output contract,
//! replay equality, both destinations, restarts and least privilege.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test]
async fn s3_archive_follows_the_contract_and_replays_to_the_tables() {
    let db = TestDb::new("s3contract").await;
    db.exec(TABLES).await;
    let pipeline = unique("p").replace('_', "-");
    let prefix = format!("contract/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.s3(&prefix).set("WALTAIL_DELIVERY_BATCH_SIZE", "7");
    w.start();
    mixed_workload(&db, 1, 150, 0).await;
    let read = async || s3_objects(&prefix).await;
    let changes = wait_replay_equals(&db, read, Some(&prefix), &pipeline).await;
    assert!(
        changes.len() > 100,
        "workload produced {} changes",
        changes.len()
    );
    let objects = s3_objects(&prefix).await;
    for o in objects.iter().filter(|o| o.key.ends_with(".ndjson")) {
        assert_eq!(
            o.content_type.as_deref(),
            Some("application/x-ndjson"),
            "{}",
            o.key
        );
    }
    // Batches fill to batch_size under load; none exceeds it.
    let sizes: Vec<usize> = objects.iter().map(|o| o.body.lines().count()).collect();
    assert!(sizes.iter().all(|&n| n <= 7), "{sizes:?}");
    assert!(sizes.iter().filter(|&&n| n == 7).count() > 5, "{sizes:?}");
    // Values as the contract renders them.
    let insert = changes
        .iter()
        .find(|c| c["op"] == "insert" && c["table"] == "public.orders")
        .unwrap();
    assert!(
        insert["data"]["items"].is_object(),
        "jsonb embedded: {insert}"
    );
    assert!(
        insert["data"]["total"].is_number(),
        "numeric(10,2) as a number: {insert}"
    );
    assert_eq!(
        insert["data"]["tags"],
        serde_json::json!(["a", null, "b c"])
    );
    assert!(
        insert["data"]["placed_at"]
            .as_str()
            .unwrap()
            .ends_with("+00:00")
    );
    let delete = changes.iter().find(|c| c["op"] == "delete").unwrap();
    assert!(
        delete["data"].is_null() && delete["old"]["id"].is_number(),
        "{delete}"
    );
    assert_eq!(
        delete["old"].as_object().unwrap().len(),
        1,
        "default identity: key only: {delete}"
    );
    let update = changes.iter().find(|c| c["op"] == "update").unwrap();
    assert!(
        update["old"].is_null(),
        "default identity, key unchanged: {update}"
    );
    w.stop();
    db.drop_db().await;
}

#[tokio::test]
async fn default_destination_is_the_local_folder() {
    let db = TestDb::new("filedest").await;
    db.exec(TABLES).await;
    let pipeline = unique("files").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.start();
    // The streaming process runs on small pages (`cli::small_pages`), as
    // the kernel reports where it says (Linux 6.x does).
    let proc_status = std::fs::read_to_string(format!("/proc/{}/status", w.pid())).unwrap();
    if let Some(thp) = proc_status.lines().find(|l| l.starts_with("THP_enabled:")) {
        assert_eq!(thp.split_whitespace().nth(1), Some("0"), "{proc_status}");
    }
    // Under the batch policy (`cli::batch_scheduling`), every thread:
    // field 41 of /proc/<pid>/task/<tid>/stat is the policy, 3 SCHED_BATCH.
    for task in std::fs::read_dir(format!("/proc/{}/task", w.pid())).unwrap() {
        let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap();
        assert_eq!(proc_stat_field(&stat, 41), Some("3"), "{stat}");
    }
    workload_replays_from_the_folder(&db, &w, &pipeline, 2, 60).await;
    w.stop();
    db.drop_db().await;
}

/// Runs a mixed workload and waits until the archive in the default folder
/// replays to the tables.
async fn workload_replays_from_the_folder(
    db: &TestDb,
    w: &Waltail,
    pipeline: &str,
    seed: u64,
    txns: usize,
) {
    mixed_workload(db, seed, txns, 0).await;
    let root = w.dir.path().join("waltail-archive");
    let read = async || file_objects(&root);
    let changes = wait_replay_equals(db, read, None, pipeline).await;
    assert!(!changes.is_empty());
}

/// One pipeline has one reader: a second `waltail run` of the same pipeline
/// while the first streams exits 3 at once with the fix, and the first
/// goes on archiving as if nothing happened.
#[tokio::test]
async fn a_second_run_of_a_running_pipeline_exits_3_and_changes_nothing() {
    let db = TestDb::new("secondrun").await;
    db.exec(TABLES).await;
    let pipeline = unique("second").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.start();
    let (status, _, stderr) = w.output(&["run"]);
    assert_eq!(status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains(&format!("pipeline {pipeline} is already running"))
            && stderr.contains("fix: stop the other `waltail run`"),
        "{stderr}"
    );
    workload_replays_from_the_folder(&db, &w, &pipeline, 3, 30).await;
    w.stop();
    db.drop_db().await;
}

/// `delivery.max_batch_bytes` cuts an object by size before `batch_size`:
/// one transaction of wide rows becomes several objects, none much over the
/// cap, and the archive still replays to the table.
#[tokio::test]
async fn objects_are_cut_at_max_batch_bytes() {
    let db = TestDb::new("maxbytes").await;
    db.exec("CREATE TABLE w (id int PRIMARY KEY, v text)").await;
    let pipeline = unique("maxbytes").replace('_', "-");
    let prefix = format!("maxbytes/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.w");
    w.s3(&prefix)
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "1000")
        .set("WALTAIL_DELIVERY_MAX_BATCH_BYTES", "16384");
    w.start();
    db.exec("INSERT INTO w SELECT g, repeat('x', 1000) FROM generate_series(1, 100) g")
        .await;
    eventually(Duration::from_secs(30), "the 100 inserts", async || {
        seqs_of(&s3_objects(&prefix).await).len() == 100
    })
    .await;
    let changes = checked_changes(&s3_objects(&prefix).await, Some(&prefix), &pipeline);
    assert_eq!(replay(&changes)["public.w"], db.rows("w").await);
    let sizes: Vec<usize> = s3_objects(&prefix)
        .await
        .iter()
        .filter(|o| o.key.ends_with(".ndjson"))
        .map(|o| o.body.len())
        .collect();
    // Each line is about 1.2 KB: an object closes at the line that reaches
    // 16 KiB, so it is at most one line over.
    assert!(sizes.len() >= 6, "{sizes:?}");
    assert!(sizes.iter().all(|&n| n < 16384 + 1500), "{sizes:?}");
    w.stop();
    db.drop_db().await;
}

#[tokio::test]
async fn seq_continues_across_graceful_and_hard_restarts() {
    let db = TestDb::new("restart").await;
    db.exec(TABLES).await;
    let pipeline = unique("restart").replace('_', "-");
    let p = pipeline.as_str();
    let mut w = Waltail::new(&db, p, "public.orders,public.customers");
    w.set("WALTAIL_DELIVERY_BATCH_SIZE", "5");
    let root = w.dir.path().join("waltail-archive");
    let read = async || file_objects(&root);

    w.start();
    mixed_workload(&db, 3, 40, 0).await;
    wait_replay_equals(&db, read, None, p).await;
    w.stop();

    // Changes committed while waltail is down arrive after the restart.
    mixed_workload(&db, 4, 40, 0).await;
    w.start();
    wait_replay_equals(&db, read, None, p).await;

    // kill -9 in the middle of a stream of changes, then restart.
    let writer = {
        let url = db.url.clone();
        tokio::spawn(async move {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            for i in 0..300 {
                client
                    .batch_execute(&format!(
                        "INSERT INTO customers VALUES ({}, 'k', NULL, 1) ON CONFLICT (id) DO UPDATE SET name = 'k{i}'",
                        1000 + i % 50
                    ))
                    .await
                    .unwrap();
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.kill9();
    writer.await.unwrap();
    w.start();
    let changes = wait_replay_equals(&db, read, None, p).await;
    // checked_changes has verified 1..=N contiguity and one object per seq.
    assert!(changes.len() > 300);
    w.stop();
    db.drop_db().await;
}

#[tokio::test]
async fn streaming_needs_put_object_only() {
    let db = TestDb::new("putonly").await;
    db.exec(TABLES).await;
    let pipeline = unique("p").replace('_', "-");
    let prefix = format!("putonly/{pipeline}");
    let s3 = s3();
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.s3(&prefix)
        .set("WALTAIL_DESTINATION_ACCESS_KEY_ID", &s3.put_key)
        .set("WALTAIL_DESTINATION_SECRET_ACCESS_KEY", &s3.put_secret);
    w.start();
    mixed_workload(&db, 5, 30, 0).await;
    let read = async || s3_objects(&prefix).await;
    wait_replay_equals(&db, read, Some(&prefix), &pipeline).await;
    w.stop();
    assert!(
        !w.log().contains("WARN"),
        "no request should have been refused:\n{}",
        w.log()
    );
    db.drop_db().await;
}

#[tokio::test]
async fn sigterm_flushes_the_partial_batch_and_exits_zero() {
    let db = TestDb::new("sigterm").await;
    db.exec(TABLES).await;
    let pipeline = unique("term").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.orders");
    // A linger far longer than the test: only the stop can flush the batch.
    w.set("WALTAIL_DELIVERY_LINGER_MS", "600000");
    w.start();
    db.exec("INSERT INTO orders (id, customer) VALUES (1, 'a'), (2, 'b')")
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let root = w.dir.path().join("waltail-archive");
    assert!(checked_changes(&file_objects(&root), None, &pipeline).is_empty());
    let status = w.stop_with("TERM");
    assert!(status.success(), "{status}\n{}", w.log());
    let changes = checked_changes(&file_objects(&root), None, &pipeline);
    assert_eq!(changes.len(), 2);
    // The slot was confirmed past the flushed transaction before exiting.
    let commit_lsn = changes[0]["commit_lsn"].as_str().unwrap().to_string();
    let row = db
        .client
        .query_one(
            "SELECT confirmed_flush_lsn > $1::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $2",
            &[&commit_lsn, &format!("waltail_{}", pipeline.replace('-', "_"))],
        )
        .await
        .unwrap();
    assert!(
        row.get::<_, bool>(0),
        "slot not confirmed past {commit_lsn}"
    );
    db.drop_db().await;
}

#[tokio::test]
async fn aws_environment_credentials_are_used_when_the_config_has_none() {
    let db = TestDb::new("awsenv").await;
    db.exec(TABLES).await;
    let pipeline = unique("awsenv").replace('_', "-");
    let prefix = format!("awsenv/{pipeline}");
    let s3 = s3();
    let mut w = Waltail::new(&db, &pipeline, "public.orders");
    w.s3(&prefix);
    w.env
        .retain(|(k, _)| !k.contains("ACCESS_KEY") && !k.ends_with("REGION"));
    w.set("AWS_ACCESS_KEY_ID", &s3.key)
        .set("AWS_SECRET_ACCESS_KEY", &s3.secret)
        .set("AWS_REGION", "us-east-1");
    w.start();
    db.exec("INSERT INTO orders (id, customer) VALUES (1, 'a')")
        .await;
    eventually(Duration::from_secs(30), "the insert archived", async || {
        s3_objects(&prefix)
            .await
            .iter()
            .any(|o| o.key.ends_with(".ndjson"))
    })
    .await;
    w.stop();
    db.drop_db().await;
}

/// With nothing pending, keepalive positions are confirmed: heavy writes to
/// tables outside the publication do not make the slot hold WAL.
#[tokio::test]
async fn an_idle_publication_does_not_hold_wal() {
    let db = TestDb::new("idlewal").await;
    db.exec(&format!(
        "{TABLES}; CREATE TABLE other (id serial PRIMARY KEY, pad text)"
    ))
    .await;
    let pipeline = unique("idle").replace('_', "-");
    let slot = format!("waltail_{}", pipeline.replace('-', "_"));
    let mut w = Waltail::new(&db, &pipeline, "public.orders");
    w.start();
    for _ in 0..20 {
        db.exec("INSERT INTO other (pad) SELECT repeat('x', 500) FROM generate_series(1, 2000)")
            .await;
    }
    let lag = async || -> i64 {
        db.client
            .query_one(
                "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0)
    };
    let written = 20 * 2000 * 500;
    eventually(
        Duration::from_secs(30),
        "the slot to confirm past the unrelated writes",
        async || lag().await < 1_000_000,
    )
    .await;
    assert!(lag().await < written / 10);
    w.stop();
    db.drop_db().await;
}

#[tokio::test]
async fn status_shows_position_rate_slot_and_lag() {
    let db = TestDb::new("status").await;
    db.exec(TABLES).await;
    let pipeline = unique("status").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    let (status, _, stderr) = w.output(&["status"]);
    assert_eq!(status.code(), Some(1), "no state yet: {stderr}");
    assert!(stderr.contains("waltail run"), "{stderr}");
    w.start();
    mixed_workload(&db, 31, 40, 0).await;
    let root = w.dir.path().join("waltail-archive");
    let read = async || file_objects(&root);
    let changes = wait_replay_equals(&db, read, None, &pipeline).await;
    // Let a progress sample with the last object land (every 5 s).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (ok, stdout, stderr) = w.output(&["status", "--json"]);
    assert!(ok.success(), "{stderr}");
    let s: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(s["pipeline"], pipeline.as_str());
    assert_eq!(s["next_seq"], changes.len() + 1);
    assert!(
        s["last_object"].as_str().unwrap().ends_with(".ndjson"),
        "{s}"
    );
    assert_eq!(s["parked"], 0);
    assert_eq!(s["slot"]["exists"], true);
    assert!(s["slot"]["active_pid"].is_i64(), "{s}");
    assert!(s["slot"]["lag_bytes"].as_i64().unwrap() < 10_000_000, "{s}");
    let (_, text, _) = w.output(&["status"]);
    assert!(
        text.contains("active (walsender pid") && text.contains("server WAL"),
        "{text}"
    );
    w.stop();
    let (_, text, _) = w.output(&["status"]);
    assert!(text.contains("inactive"), "{text}");
    db.drop_db().await;
}

#[tokio::test]
async fn telemetry_serves_metrics_health_and_readiness() {
    let db = TestDb::new("metrics").await;
    db.exec(TABLES).await;
    let pipeline = unique("metrics").replace('_', "-");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.set("WALTAIL_TELEMETRY_LISTEN", &addr);
    w.start();
    assert_eq!(http_get(&addr, "/healthz").0, 200);
    assert_eq!(http_get(&addr, "/readyz").0, 200);
    mixed_workload(&db, 41, 30, 0).await;
    let root = w.dir.path().join("waltail-archive");
    let read = async || file_objects(&root);
    let changes = wait_replay_equals(&db, read, None, &pipeline).await;
    let (code, body) = http_get(&addr, "/metrics");
    assert_eq!(code, 200);
    let value = |name: &str| -> f64 {
        body.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing:\n{body}"))
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(
        value("waltail_changes_archived_total"),
        changes.len() as f64
    );
    assert_eq!(
        value("waltail_changes_received_total"),
        changes.len() as f64
    );
    assert!(value("waltail_objects_written_total") >= 1.0);
    assert!(value("waltail_put_seconds_count") >= value("waltail_objects_written_total"));
    assert!(value("waltail_commit_to_archive_seconds_count") >= 1.0);
    assert_eq!(value("waltail_parked_batches"), 0.0);
    assert_eq!(value("waltail_ready"), 1.0);
    assert_eq!(http_get(&addr, "/nope").0, 404);
    // The Grafana dashboard in examples/ graphs what is exported, all of it.
    let exported: std::collections::BTreeSet<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../examples/grafana-dashboard.json")).unwrap();
    let metric = regex_lite::Regex::new(r"waltail_[a-z_]+").unwrap();
    let mut graphed = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for m in metric.find_iter(expr) {
                let family = m.as_str().trim_end_matches("_bucket");
                assert!(
                    exported.contains(family),
                    "panel {:?} graphs {family}, which /metrics does not export:\n{body}",
                    panel["title"]
                );
                graphed.insert(family.to_string());
            }
        }
    }
    for family in &exported {
        assert!(
            graphed.contains(*family),
            "no dashboard panel graphs {family}"
        );
    }
    w.stop();
    db.drop_db().await;
}
