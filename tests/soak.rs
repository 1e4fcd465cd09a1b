//! The soak: a long mixed workload under every fault at once, then the
//! archive checked against the tables. Not part of the suite (`#[ignore]`);
//! `scripts/soak.sh` runs it (30 minutes by default, `WT_SOAK_SECS` to
//! change it) and prints its figures.
//!
//! While a writer commits small transactions (and now and then one of
//! 20,000 rows, streamed while in progress), the run is killed with -9
//! every 10-40 s and started again, the store freezes (the proxy forwards
//! nothing) for 5-25 s every 1-3 minutes, so uploads time out and batches
//! park and are replayed as an operator would (`waltail parked replay
//! --all`), and Postgres restarts every 3-5 minutes. At the end: every seq
//! from 1 to N in exactly one object, no change archived twice (one
//! idempotency key each), commit order kept, and the replay equal to the
//! tables.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::pg::DedicatedPg;
use common::proxy::{Mode, Proxy};
use common::*;
use serde_json::Value;

/// What the writer did, for the figures.
#[derive(Default)]
struct Written {
    transactions: AtomicU64,
    bulk: AtomicU64,
    failed: AtomicU64,
}

/// Commits mixed transactions until `stop`, reconnecting whenever the
/// server goes away (a transaction cut by a restart is counted failed: the
/// tables say whether it committed, and the replay is compared with them).
async fn writer(url: String, seed: u64, stop: Arc<AtomicBool>, written: Arc<Written>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut client = None;
    let mut t = 0usize;
    let mut next_bulk = Instant::now() + Duration::from_secs(rng.u64(20..60));
    while !stop.load(Ordering::Relaxed) {
        let Some(c) = client.as_ref() else {
            client = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                Ok((c, conn)) => {
                    tokio::spawn(conn);
                    Some(c)
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    None
                }
            };
            continue;
        };
        // Now and then a transaction of 20,000 inserts, and later one
        // that deletes them: larger than logical_decoding_work_mem, so
        // they are streamed while in progress and spilled by waltail.
        let bulk = Instant::now() >= next_bulk;
        let sql = if bulk {
            next_bulk = Instant::now() + Duration::from_secs(rng.u64(60..120));
            if written.bulk.load(Ordering::Relaxed).is_multiple_of(2) {
                "BEGIN; INSERT INTO orders (id, customer, status, total, note) \
                 SELECT g, 'bulk', 'new', g % 1000, repeat('x', 30) \
                 FROM generate_series(1000000, 1019999) g; COMMIT;"
                    .to_string()
            } else {
                "DELETE FROM orders WHERE id >= 1000000".to_string()
            }
        } else {
            t += 1;
            mixed_transaction(&mut rng, t, 0)
        };
        match c.batch_execute(&sql).await {
            Ok(()) if bulk => _ = written.bulk.fetch_add(1, Ordering::Relaxed),
            Ok(()) => _ = written.transactions.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                written.failed.fetch_add(1, Ordering::Relaxed);
                if c.is_closed() || e.is_closed() {
                    client = None;
                }
            }
        }
        // About 100 transactions a second: enough changes to fill many
        // objects between faults, few enough to check at the end.
        tokio::time::sleep(Duration::from_millis(8)).await;
    }
}

#[tokio::test]
#[ignore = "a 30-minute soak: scripts/soak.sh runs it"]
async fn soak_under_kills_freezes_and_restarts_loses_nothing_and_duplicates_nothing() {
    let secs: u64 = env_or("WT_SOAK_SECS", "1800").parse().unwrap();
    let seed = std::env::var("WT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("soak of {secs} s, seed {seed} (set WT_TEST_SEED to repeat)");
    let mut rng = fastrand::Rng::with_seed(seed);

    let pg = DedicatedPg::start();
    let mut db = TestDb::on(pg.url(), "soak").await;
    db.exec(TABLES).await;
    // Large transactions are streamed in progress from 14 (and sent whole
    // at their commit before), whatever their size.
    db.exec("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'")
        .await;
    db.exec("SELECT pg_reload_conf()").await;
    let proxy = Proxy::start(s3_addr());
    let pipeline = unique("soak").replace('_', "-");
    let prefix = format!("soak/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.s3(&prefix)
        .set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url())
        .set("WALTAIL_DELIVERY_REQUEST_TIMEOUT_MS", "2000")
        .set("WALTAIL_DELIVERY_MAX_IN_FLIGHT", "4");
    w.start();

    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(Written::default());
    let writing = tokio::spawn(writer(
        db.url.clone(),
        rng.u64(..),
        stop.clone(),
        written.clone(),
    ));

    let (mut kills, mut freezes, mut restarts, mut replays) = (0u32, 0u32, 0u32, 0u32);
    let start = Instant::now();
    let end = start + Duration::from_secs(secs);
    let mut next_kill = Instant::now() + Duration::from_secs(rng.u64(10..=40));
    let mut next_freeze = Instant::now() + Duration::from_secs(rng.u64(60..=180));
    let mut next_restart = Instant::now() + Duration::from_secs(rng.u64(180..=300));
    let mut frozen_until: Option<Instant> = None;
    // A restart runs on while the loop goes on: the server's shutdown
    // waits until waltail has confirmed what it was sent, which needs a
    // frozen store back and parked batches replayed (or the run killed).
    let mut restarting: Option<(Instant, std::process::Child)> = None;
    let mut longest_restart = Duration::ZERO;
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = Instant::now();
        if now >= next_kill {
            w.kill9();
            kills += 1;
            // Started again at once, or after a pause as a supervisor's
            // backoff would; it may have to wait for a frozen store or for
            // Postgres to come back.
            tokio::time::sleep(Duration::from_millis(rng.u64(0..2000))).await;
            w.spawn(&["run"]);
            w.wait_log("streaming", Duration::from_secs(300));
            next_kill = Instant::now() + Duration::from_secs(rng.u64(10..=40));
        }
        // A freeze runs on while the run is killed and Postgres restarts.
        if frozen_until.is_some_and(|t| now >= t) {
            proxy.set_mode(Mode::Pass);
            frozen_until = None;
            // What an operator does once the store is back: replay what
            // parked. It may find nothing parked, or the run killed under
            // it; what is left is replayed at the end.
            let (status, _, _) = w.output(&["parked", "replay", "--all"]);
            replays += u32::from(status.success());
            next_freeze = Instant::now() + Duration::from_secs(rng.u64(60..=180));
        } else if frozen_until.is_none() && now >= next_freeze {
            let held = Duration::from_secs(rng.u64(5..=25));
            println!(
                "{:>5} s: the store freezes for {held:?}",
                start.elapsed().as_secs()
            );
            proxy.set_mode(Mode::Blackhole);
            frozen_until = Some(now + held);
            freezes += 1;
        }
        if let Some((since, child)) = restarting.as_mut() {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "pg_ctl restart failed: {status}");
                let took = since.elapsed();
                println!(
                    "{:>5} s: Postgres is back after {took:.1?}",
                    start.elapsed().as_secs()
                );
                longest_restart = longest_restart.max(took);
                restarts += 1;
                restarting = None;
                next_restart = Instant::now() + Duration::from_secs(rng.u64(180..=300));
            }
        } else if now >= next_restart {
            println!("{:>5} s: Postgres restarts", start.elapsed().as_secs());
            restarting = Some((Instant::now(), pg.restart_in_background(900)));
        }
    }
    proxy.set_mode(Mode::Pass);
    if let Some((since, mut child)) = restarting.take() {
        // What holds it back (a parked batch) is replayed below; a restart
        // that started must end before the tables are read.
        let _ = w.output(&["parked", "replay", "--all"]);
        assert!(child.wait().unwrap().success(), "pg_ctl restart failed");
        longest_restart = longest_restart.max(since.elapsed());
        restarts += 1;
    }
    stop.store(true, Ordering::Relaxed);
    writing.await.unwrap();
    db.reconnect().await;

    // Whatever is still parked is replayed, then the archive must reach
    // the tables. Objects never change once written, so each is fetched
    // once however many times this looks.
    let store = admin_store();
    let mut objects: BTreeMap<String, Object> = BTreeMap::new();
    let settle = Instant::now();
    let changes = loop {
        assert!(
            settle.elapsed() < Duration::from_secs(600),
            "the archive did not reach the tables within 10 minutes of the last fault:\n{}",
            w.log()
        );
        if w.parked_counts().0 > 0 {
            let (status, stdout, stderr) = w.output(&["parked", "replay", "--all"]);
            assert!(status.success(), "{stdout}{stderr}");
        }
        let new = objects_where(store.as_ref(), &prefix, |k| !objects.contains_key(k)).await;
        objects.extend(new.into_iter().map(|o| (o.key.clone(), o)));
        let all: Vec<Object> = objects.values().cloned().collect();
        if contiguous(&all) {
            let changes = checked_changes(&all, Some(&prefix), &pipeline);
            let state = replay(&changes);
            let empty = BTreeMap::new();
            if state.get("public.orders").unwrap_or(&empty) == &db.rows("orders").await
                && state.get("public.customers").unwrap_or(&empty) == &db.rows("customers").await
            {
                break changes;
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let keys: BTreeSet<&str> = changes
        .iter()
        .map(|c| c["idempotency_key"].as_str().unwrap())
        .collect();
    assert_eq!(keys.len(), changes.len(), "a change was archived twice");
    let streamed =
        |c: &&Value| c["data"]["customer"] == "bulk" || c["old"]["id"].as_i64() >= Some(1_000_000);
    println!(
        "soak passed: {secs} s, seed {seed}; {kills} kill -9s, {freezes} store freezes \
         ({replays} replays), {restarts} Postgres restarts (the longest {longest_restart:.1?}); {} transactions and {} of \
         20,000 rows committed ({} cut by a restart); {} changes in {} objects, seqs 1..={} \
         each once, 0 lost, 0 duplicated; {} changes of large transactions",
        written.transactions.load(Ordering::Relaxed),
        written.bulk.load(Ordering::Relaxed),
        written.failed.load(Ordering::Relaxed),
        changes.len(),
        objects.len(),
        changes.len(),
        changes.iter().filter(streamed).count(),
    );
    assert!(kills > 0 && changes.len() > 1000, "the soak did too little");
    w.stop();
}
