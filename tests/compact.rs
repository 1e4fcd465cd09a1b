//! `waltail compact` against real PostgreSQL and SeaweedFS, with the real
//! binary, read back by DuckDB (PyPI, installed by scripts/duckdb.sh) as a
//! user would: the latest view equals the source tables, the history holds
//! every archived change exactly once, across runs, schema changes, a
//! truncate, unchanged TOAST, a duplicated object and a kill -9.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::proxy::{Cut, Mode, Proxy};
use common::*;
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde_json::{Value, json};
use waltail::lakehouse::delta::{self, Role};

const TABLES_WITH_DOCS: &str = "public.orders,public.customers,public.docs";

/// Every object under `prefix`: key, size, last modified.
async fn listing(store: &dyn ObjectStore, prefix: &str) -> BTreeSet<(String, u64, String)> {
    let metas: Vec<_> = store
        .list(Some(&ObjectPath::from(prefix)))
        .try_collect()
        .await
        .unwrap();
    metas
        .into_iter()
        .map(|m| (m.location.to_string(), m.size, m.last_modified.to_rfc3339()))
        .collect()
}

/// A table of the test, with the expressions that bring Postgres and the
/// compacted Parquet to the same JSON.
struct Table {
    name: &'static str,
    pg: &'static str,
    duck: &'static str,
    /// Columns DuckDB returns as JSON text (json, jsonb and array columns).
    json_columns: &'static [usize],
}

const ORDERS: Table = Table {
    name: "orders",
    pg: "id, customer, status, total::text, items, paid, (extract(epoch from placed_at) * 1000000)::bigint, note, ratio, to_jsonb(tags)",
    duck: "id, customer, status, CAST(total AS VARCHAR), items, paid, epoch_us(placed_at), note, ratio, tags",
    json_columns: &[4, 9],
};
const CUSTOMERS: Table = Table {
    name: "customers",
    pg: "id, name, since::text, score::float8",
    duck: "id, name, CAST(since AS VARCHAR), score",
    json_columns: &[],
};
const CUSTOMERS_WITH_TIER: Table = Table {
    name: "customers",
    pg: "id, name, since::text, score::float8, tier",
    duck: "id, name, CAST(since AS VARCHAR), score, tier",
    json_columns: &[],
};
const DOCS: Table = Table {
    name: "docs",
    pg: "id, md5(body), n",
    duck: "id, md5(body), n",
    json_columns: &[],
};

/// Asserts that DuckDB's Delta reader over `dir/latest/public/<t>/` gives
/// the table's rows, and the deltalake package the same.
async fn assert_latest_equals_source(db: &TestDb, dir: &Path, t: &Table) {
    let pg: Vec<Vec<Value>> = db
        .client
        .query(
            &format!(
                "SELECT json_build_array({})::text FROM {} ORDER BY id",
                t.pg, t.name
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            serde_json::from_str::<Value>(&r.get::<_, String>(0))
                .unwrap()
                .as_array()
                .unwrap()
                .clone()
        })
        .collect();
    let table = dir.join("latest/public").join(t.name);
    delta_rows_agree(&table);
    let mut parquet = duck(&format!(
        "SELECT {} FROM delta_scan('{}') ORDER BY id",
        t.duck,
        table.display()
    ));
    for row in &mut parquet {
        for &i in t.json_columns {
            if let Value::String(s) = &row[i] {
                row[i] = serde_json::from_str(s).unwrap();
            }
        }
    }
    // Numbers compare by value: DuckDB's 1.0 is Postgres's 1.
    let pg: Vec<Vec<Value>> = pg.into_iter().map(numbers_as_f64).collect();
    let parquet: Vec<Vec<Value>> = parquet.into_iter().map(numbers_as_f64).collect();
    assert!(
        !pg.is_empty() || t.name == "customers",
        "{} is empty",
        t.name
    );
    assert_eq!(parquet, pg, "latest view of {} vs the table", t.name);
}

fn numbers_as_f64(row: Vec<Value>) -> Vec<Value> {
    row.into_iter()
        .map(|v| match v {
            Value::Number(n) if n.is_i64() && n.as_i64().unwrap().abs() < (1 << 53) => {
                json!(n.as_f64().unwrap())
            }
            other => other,
        })
        .collect()
}

/// Asserts that DuckDB's Delta reader over `dir/parquet/public/<t>/` (and
/// the deltalake package alike) gives each archived change of the table
/// exactly once: seq, op, key, and `status` / the
/// unchanged columns where the table has them.
fn assert_history_equals_archive(dir: &Path, table: &str, changes: &[Value]) {
    let expected: Vec<Vec<Value>> = changes
        .iter()
        .filter(|c| c["table"] == format!("public.{table}"))
        .map(|c| {
            let row = if c["data"].is_object() {
                &c["data"]
            } else {
                &c["old"]
            };
            let key = if c["op"] == "truncate" {
                Value::Null
            } else {
                Value::String(json!({"id": row["id"]}).to_string())
            };
            let unchanged = match (c["op"].as_str(), c["data"].as_object()) {
                (Some("update"), Some(d)) if table == "docs" && !d.contains_key("body") => {
                    json!("[\"body\"]")
                }
                _ => Value::Null,
            };
            vec![c["seq"].clone(), c["op"].clone(), key, unchanged]
        })
        .collect();
    let extra = if table == "docs" {
        "_unchanged"
    } else {
        "NULL"
    };
    let history = dir.join("parquet/public").join(table);
    delta_rows_agree(&history);
    let got = duck(&format!(
        "SELECT _seq, _op, _key, {extra} FROM delta_scan('{}') ORDER BY _seq",
        history.display()
    ));
    assert!(!expected.is_empty(), "no changes of {table}");
    assert_eq!(got, expected, "history of {table} vs the archive");
}

/// The archive's objects without the copies [`duplicate`] planted: of
/// objects with the same name, the one in the earliest date folder.
async fn archived_originals(prefix: &str) -> Vec<Object> {
    let mut objects = ndjson_objects(prefix).await;
    objects.sort_by(|a, b| a.key.cmp(&b.key));
    let mut names = BTreeSet::new();
    objects.retain(|o| names.insert(o.key.rsplit('/').next().unwrap().to_string()));
    objects
}

/// The archive's changes (duplicates planted by the test left out).
async fn archived_changes(prefix: &str, pipeline: &str) -> Vec<Value> {
    checked_changes(&archived_originals(prefix).await, Some(prefix), pipeline)
}

async fn wait_all_archived(db: &TestDb, prefix: &str, pipeline: &str) -> Vec<Value> {
    wait_replay_equals(
        db,
        async || archived_originals(prefix).await,
        Some(prefix),
        pipeline,
    )
    .await;
    // The docs table is written before the last workload, so it is in too.
    archived_changes(prefix, pipeline).await
}

/// Copies an archive object to a second key (a replay under another
/// name): the same name in the next day's folder (where a query, which
/// lists from the day before the last compacted object's date on, sees it
/// too).
async fn duplicate(prefix: &str, pipeline: &str, nth_last: usize) -> String {
    let store = admin_store();
    let objects = archived_objects(prefix, pipeline).await;
    let source = &objects[objects.len() - 1 - nth_last];
    let mut parts = source.rsplitn(5, '/');
    let name = parts.next().unwrap();
    let (d, m, y) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let next_day =
        chrono::NaiveDate::from_ymd_opt(y.parse().unwrap(), m.parse().unwrap(), d.parse().unwrap())
            .unwrap()
            .succ_opt()
            .unwrap()
            .format("%Y/%m/%d");
    let copy = format!("{prefix}/{next_day}/{name}");
    let body = store
        .get(&ObjectPath::from(source.as_str()))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    store
        .put(&ObjectPath::from(copy.as_str()), PutPayload::from(body))
        .await
        .unwrap();
    assert!(name.starts_with(pipeline));
    copy
}

/// Archive object keys, by first seq.
async fn archived_objects(prefix: &str, pipeline: &str) -> Vec<String> {
    let mut keys: Vec<(u64, String)> = archived_originals(prefix)
        .await
        .into_iter()
        .filter(|o| o.key.ends_with(".ndjson"))
        .map(|o| {
            let name = o.key.rsplit('/').next().unwrap().to_string();
            let first: u64 = name
                .strip_prefix(&format!("{pipeline}-"))
                .unwrap()
                .split('-')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            (first, o.key)
        })
        .collect();
    keys.sort();
    keys.into_iter().map(|(_, k)| k).collect()
}

fn compact(w: &Waltail, args: &[&str]) -> String {
    let mut all = vec!["compact"];
    all.extend_from_slice(args);
    let (status, stdout, stderr) = w.output(&all);
    assert!(
        status.success(),
        "compact failed ({status}):\n{stdout}\n{stderr}"
    );
    stdout
}

async fn create_tables(db: &TestDb) {
    db.exec(TABLES).await;
    // A body stored out of line and uncompressed: an update of `n` alone
    // leaves it out of the change (unchanged TOAST).
    db.exec(
        "CREATE TABLE docs (id int PRIMARY KEY, body text, n int);
         ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn compacted_parquet_gives_duckdb_the_tables_and_every_change_across_runs() {
    let db = TestDb::new("compact").await;
    create_tables(&db).await;
    let pipeline = unique("cp").replace('_', "-");
    let prefix = unique("compact");
    let mut w = Waltail::new(&db, &pipeline, TABLES_WITH_DOCS);
    w.s3(&prefix).set("WALTAIL_DELIVERY_BATCH_SIZE", "7");
    w.start();

    // Run 1: inserts, updates, deletes; large documents.
    db.exec(
        "INSERT INTO docs SELECT i, (SELECT string_agg(md5(i::text || j::text), '') FROM generate_series(1, 400) j), 0
         FROM generate_series(1, 3) i",
    )
    .await;
    mixed_workload(&db, 11, 40, 0).await;
    let changes = wait_all_archived(&db, &prefix, &pipeline).await;
    // A replayed batch under another name, before it is compacted.
    duplicate(&prefix, &pipeline, 2).await;

    let dry = compact(&w, &["--dry-run"]);
    assert!(dry.contains("would compact"), "{dry}");
    assert!(
        !listing(admin_store().as_ref(), &prefix)
            .await
            .iter()
            .any(|o| o.0.contains("parquet")),
        "a dry run writes nothing"
    );
    let out = compact(&w, &[]);
    assert!(out.contains(&format!("{} changes", changes.len())), "{out}");
    assert!(
        out.contains("skipped"),
        "the duplicate was read and dropped: {out}"
    );
    let dir = tempfile::tempdir().unwrap();
    download(&prefix, dir.path()).await;
    for t in [&ORDERS, &CUSTOMERS, &DOCS] {
        assert_latest_equals_source(&db, dir.path(), t).await;
        assert_history_equals_archive(dir.path(), t.name, &changes);
    }
    // Typed columns, as the schema records give them.
    let types = duck(&format!(
        "SELECT typeof(total), typeof(placed_at), typeof(id), typeof(paid) FROM delta_scan('{}/latest/public/orders') LIMIT 1",
        dir.path().display()
    ));
    assert_eq!(
        types[0],
        [
            json!("DECIMAL(10,2)"),
            json!("TIMESTAMP WITH TIME ZONE"),
            json!("BIGINT"),
            json!("BOOLEAN")
        ]
    );
    let run1 = read_delta("deltalake", &dir.path().join("latest/public/orders"), None).1;

    // Run 2: unchanged TOAST, a truncate, an added column, more of the rest.
    db.exec("UPDATE docs SET n = n + 1 WHERE id <= 2; DELETE FROM docs WHERE id = 3;")
        .await;
    db.exec("TRUNCATE customers").await;
    db.exec("ALTER TABLE customers ADD COLUMN tier text").await;
    mixed_workload(&db, 12, 40, 20).await;
    db.exec("UPDATE customers SET tier = 'gold' WHERE id % 3 = 0")
        .await;
    mixed_workload(&db, 13, 5, 20).await;
    let changes = wait_all_archived(&db, &prefix, &pipeline).await;
    assert!(
        changes.iter().any(|c| c["op"] == "truncate"),
        "the truncate is archived"
    );
    assert!(
        changes.iter().any(|c| c["table"] == "public.docs"
            && c["op"] == "update"
            && !c["data"].as_object().unwrap().contains_key("body")),
        "an update leaves the unchanged TOASTed body out"
    );
    // A duplicate of an object compacted by run 1, and one of run 2's.
    duplicate(
        &prefix,
        &pipeline,
        archived_objects(&prefix, &pipeline).await.len() - 1,
    )
    .await;
    duplicate(&prefix, &pipeline, 1).await;

    let out = compact(&w, &[]);
    assert!(out.contains("compacted"), "{out}");
    assert!(
        out.contains("skipped"),
        "the duplicate was read and dropped: {out}"
    );
    let dir = tempfile::tempdir().unwrap();
    download(&prefix, dir.path()).await;
    for t in [&ORDERS, &CUSTOMERS_WITH_TIER, &DOCS] {
        assert_latest_equals_source(&db, dir.path(), t).await;
        assert_history_equals_archive(dir.path(), t.name, &changes);
    }
    // Time travel: the version before this run's is the view run 1 left.
    let orders = dir.path().join("latest/public/orders");
    let (header, _) = read_delta("deltalake", &orders, None);
    let now = header["version"].as_u64().unwrap();
    assert!(now >= 1, "{header}");
    for engine in ["deltalake", "duckdb"] {
        let (_, before) = read_delta(engine, &orders, Some(now - 1));
        assert!(
            before == run1,
            "{engine}: version {} is not run 1's view",
            now - 1
        );
    }

    // Run 3: nothing new, nothing written.
    let before = listing(admin_store().as_ref(), &prefix).await;
    let out = compact(&w, &[]);
    assert!(out.contains("nothing new to compact"), "{out}");
    assert_eq!(listing(admin_store().as_ref(), &prefix).await, before);

    w.stop();
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_compaction_killed_before_its_commits_shows_nothing_and_the_next_run_compacts_once() {
    let db = TestDb::new("compactkill").await;
    create_tables(&db).await;
    let pipeline = unique("ck").replace('_', "-");
    let prefix = unique("compactkill");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.s3(&prefix).set("WALTAIL_DELIVERY_BATCH_SIZE", "3");
    w.start();
    mixed_workload(&db, 21, 60, 0).await;
    let changes = wait_all_archived(&db, &prefix, &pipeline).await;
    w.stop();

    // Through a slow link, so the run is still reading when it is killed;
    // small history files, so some are complete by then.
    let s3 = s3();
    let target = s3.endpoint.trim_start_matches("http://").parse().unwrap();
    let proxy = Proxy::start(target);
    proxy.set_mode(Mode::Delay(Duration::from_millis(15)));
    w.set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url())
        .set("WALTAIL_COMPACT_FILE_BYTES", "3000");
    w.spawn(&["compact"]);
    let start = Instant::now();
    loop {
        let history = listing(admin_store().as_ref(), &format!("{prefix}/parquet")).await;
        if !history.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no history file was written:\n{}",
            w.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.set_mode(Mode::Blackhole);
    w.kill9();
    // Killed before its commits: history files, and no table a reader sees.
    let dir = tempfile::tempdir().unwrap();
    download(&prefix, dir.path()).await;
    assert!(
        !walk(&dir.path().join("parquet")).is_empty(),
        "history files were written"
    );
    for role in ["parquet", "latest"] {
        let log = dir.path().join(role).join("public/orders/_delta_log");
        assert!(!log.exists(), "nothing is committed: {}", log.display());
    }

    // The next run, with other settings, compacts everything once: the
    // killed run's files are in no snapshot.
    proxy.set_mode(Mode::Pass);
    w.set("WALTAIL_DESTINATION_ENDPOINT", &s3.endpoint)
        .set("WALTAIL_COMPACT_FILE_BYTES", "100000000");
    let out = compact(&w, &[]);
    assert!(out.contains(&format!("{} changes", changes.len())), "{out}");
    let dir = tempfile::tempdir().unwrap();
    download(&prefix, dir.path()).await;
    for t in [&ORDERS, &CUSTOMERS] {
        assert_latest_equals_source(&db, dir.path(), t).await;
        assert_history_equals_archive(dir.path(), t.name, &changes);
    }
    let before = listing(admin_store().as_ref(), &prefix).await;
    let out = compact(&w, &[]);
    assert!(out.contains("nothing new to compact"), "{out}");
    assert_eq!(listing(admin_store().as_ref(), &prefix).await, before);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_local_folder_archive_compacts_in_place() {
    let db = TestDb::new("compactfile").await;
    create_tables(&db).await;
    let pipeline = unique("cf").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    let archive: PathBuf = w.dir.path().join("archive");
    w.set("WALTAIL_DESTINATION_TYPE", "file")
        .set("WALTAIL_DESTINATION_PATH", archive.to_str().unwrap())
        .set("WALTAIL_COMPACT_COMPRESSION", "snappy");
    w.start();
    mixed_workload(&db, 31, 30, 0).await;
    let root = archive.clone();
    let changes = wait_replay_equals(&db, async || file_objects(&root), None, &pipeline).await;
    let out = compact(&w, &["public.orders", "public.customers"]);
    assert!(out.contains(&format!("{} changes", changes.len())), "{out}");
    for t in [&ORDERS, &CUSTOMERS] {
        assert_latest_equals_source(&db, &archive, t).await;
        assert_history_equals_archive(&archive, t.name, &changes);
    }
    let codec = duck(&format!(
        "SELECT DISTINCT compression FROM parquet_metadata('{}/latest/public/orders/*.parquet')",
        archive.display()
    ));
    assert_eq!(codec, [[json!("SNAPPY")]]);
    let out = compact(&w, &[]);
    assert!(out.contains("nothing new to compact"), "{out}");
    let (status, _, stderr) = w.output(&["compact", "public.nope"]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("public.nope"), "{stderr}");
    // A level for a codec without levels is refused, saying what to do.
    w.set("WALTAIL_COMPACT_COMPRESSION_LEVEL", "3");
    let (status, _, stderr) = w.output(&["compact"]);
    assert_eq!(status.code(), Some(2), "bad configuration: {stderr}");
    assert!(
        stderr.contains("only zstd and gzip have levels"),
        "{stderr}"
    );
    w.stop();
    db.drop_db().await;
}

/// A generated archive of one table `public.t (id bigint key, doc text, n
/// int)` in a local folder: inserts, updates (one in three leaving `doc`
/// out, as unchanged TOAST), deletes, updates that move a row to a new key
/// (some leaving `doc` out), and a truncate at `truncate_at`; written as NDJSON objects of 50
/// changes with its schema record. Returns the expected latest rows (id ->
/// [doc, n, seq]) after `seqs` changes, by a model of the contract.
struct GeneratedArchive {
    lines: Vec<String>,
    expected: std::collections::BTreeMap<i64, (Value, Value, u64)>,
}

fn generate_archive(changes: u64, keys: i64, seed: u64, truncate_at: u64) -> GeneratedArchive {
    generate_archive_with(changes, keys, seed, truncate_at, true)
}

/// [`generate_archive`]; `moves_leave_out`: whether an update that moves a
/// row to a new key may leave a column out (which makes compact merge the
/// buckets of the run one at a time, to carry the value across).
fn generate_archive_with(
    changes: u64,
    keys: i64,
    seed: u64,
    truncate_at: u64,
    moves_leave_out: bool,
) -> GeneratedArchive {
    use std::collections::BTreeMap;
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut rows: BTreeMap<i64, (Value, Value, u64)> = BTreeMap::new();
    let mut lines = Vec::new();
    let mut next_id = keys;
    for seq in 1..=changes {
        let line = |op: &str, data: Value, old: Value| {
            json!({"op": op, "table": "public.t", "data": data, "old": old, "seq": seq,
                   "idempotency_key": format!("k{seq}"), "commit_lsn": format!("0/{:X}", seq * 8)})
            .to_string()
        };
        if seq == truncate_at {
            rows.clear();
            lines.push(line("truncate", Value::Null, Value::Null));
            continue;
        }
        let id = rng.i64(0..keys);
        let doc = json!(format!("doc {id} {seq}"));
        let n = json!(rng.i32(0..1000));
        let l = match rows.get(&id).cloned() {
            None => {
                rows.insert(id, (doc.clone(), n.clone(), seq));
                line("insert", json!({"id": id, "doc": doc, "n": n}), Value::Null)
            }
            Some((old_doc, _, _)) => match rng.u8(0..10) {
                0..=1 => {
                    rows.remove(&id);
                    line("delete", Value::Null, json!({"id": id}))
                }
                2..=3 => {
                    // The key changes: a new id, the row moves.
                    next_id += 1;
                    let to = next_id;
                    rows.remove(&id);
                    let keep = rng.bool() && moves_leave_out;
                    let data = if keep {
                        json!({"id": to, "n": n})
                    } else {
                        json!({"id": to, "doc": doc, "n": n})
                    };
                    let new_doc = if keep { old_doc } else { doc };
                    rows.insert(to, (new_doc, n.clone(), seq));
                    line("update", data, json!({"id": id}))
                }
                _ => {
                    let keep = rng.u8(0..3) == 0;
                    let data = if keep {
                        json!({"id": id, "n": n})
                    } else {
                        json!({"id": id, "doc": doc, "n": n})
                    };
                    let new_doc = if keep { old_doc } else { doc };
                    rows.insert(id, (new_doc, n.clone(), seq));
                    line("update", data, Value::Null)
                }
            },
        };
        lines.push(l);
    }
    GeneratedArchive {
        lines,
        expected: rows,
    }
}

/// Writes changes `from..=to` (1-based seqs) of `archive` into `root` as
/// objects of 50 lines, with the schema record.
fn write_archive(root: &Path, archive: &GeneratedArchive, from: u64, to: u64) {
    let schema = json!({"table": "public.t", "version": 1, "replica_identity": "default", "columns": [
        {"name": "id", "type": "bigint", "type_oid": 20, "type_modifier": -1, "key": true},
        {"name": "doc", "type": "text", "type_oid": 25, "type_modifier": -1, "key": false},
        {"name": "n", "type": "integer", "type_oid": 23, "type_modifier": -1, "key": false}]});
    let dir = root.join("_schemas/public.t");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("1.json"), schema.to_string()).unwrap();
    let day = root.join("2026/11/30");
    std::fs::create_dir_all(&day).unwrap();
    let mut first = from;
    while first <= to {
        let last = (first + 49).min(to);
        let body: String = (first..=last)
            .map(|s| format!("{}\n", archive.lines[s as usize - 1]))
            .collect();
        std::fs::write(day.join(format!("gen-{first}-{last}.ndjson")), body).unwrap();
        first = last + 1;
    }
}

/// Compacts the local archive at `root` in this process.
async fn compact_in_process(root: &Path, merge_bytes: u64) -> waltail::compact::Summary {
    let toml = format!(
        "pipeline = \"gen\"\nstate_dir = \"{}/state\"\n[source]\nurl = \"postgres://x@127.0.0.1:1/x\"\ntables = [\"public.t\"]\n[destination]\ntype = \"file\"\npath = \"{}\"\n[compact]\nmerge_bytes = {merge_bytes}\n",
        root.display(),
        root.display()
    );
    let config = waltail::config::Config::from_parts(
        Some(&toml),
        "test",
        &std::collections::BTreeMap::new(),
    )
    .unwrap();
    waltail::compact::compact(&config, &waltail::compact::Options::default())
        .await
        .unwrap()
}

/// A Delta table of public.t in the archive folder `root`, as committed.
async fn snapshot(root: &Path, role: Role) -> Option<delta::Published> {
    let dest = waltail::config::DestinationConfig::File {
        path: root.to_path_buf(),
        prefix: None,
    };
    let store: std::sync::Arc<dyn ObjectStore> =
        std::sync::Arc::new(object_store::local::LocalFileSystem::new_with_prefix(root).unwrap());
    let loc = delta::Location::new(&dest, &store).unwrap();
    delta::load(&loc, role, "public/t", &delta::app_id("gen", "public.t"))
        .await
        .unwrap()
}

/// The latest view of public.t, the files of its current snapshot read
/// whole: id -> [doc, n, _seq], and the number of files.
async fn read_latest(root: &Path) -> (std::collections::BTreeMap<i64, (Value, Value, u64)>, usize) {
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Int32Type, Int64Type};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let mut rows = std::collections::BTreeMap::new();
    let table = snapshot(root, Role::Latest).await.expect("a latest view");
    let files = table.files.len();
    for f in &table.files {
        let file = std::fs::File::open(root.join("latest/public/t").join(&f.path)).unwrap();
        for batch in ParquetRecordBatchReaderBuilder::try_new(file)
            .unwrap()
            .build()
            .unwrap()
        {
            let batch = batch.unwrap();
            let ids = batch
                .column_by_name("id")
                .unwrap()
                .as_primitive::<Int64Type>();
            let docs = batch.column_by_name("doc").unwrap().as_string::<i32>();
            let ns = batch
                .column_by_name("n")
                .unwrap()
                .as_primitive::<Int32Type>();
            let seqs = batch
                .column_by_name("_seq")
                .unwrap()
                .as_primitive::<Int64Type>();
            for i in 0..batch.num_rows() {
                let doc = if docs.is_null(i) {
                    Value::Null
                } else {
                    json!(docs.value(i))
                };
                let n = if ns.is_null(i) {
                    Value::Null
                } else {
                    json!(ns.value(i))
                };
                let before = rows.insert(ids.value(i), (doc, n, seqs.value(i) as u64));
                assert!(before.is_none(), "id {} twice in latest/", ids.value(i));
            }
        }
    }
    (rows, files)
}

async fn latest_buckets(root: &Path) -> u32 {
    snapshot(root, Role::Latest).await.unwrap().buckets
}

#[tokio::test(flavor = "multi_thread")]
async fn a_latest_view_merged_bucket_by_bucket_equals_the_one_merged_whole() {
    // Key moves that leave a column out: buckets merged one at a time.
    merged_bucket_by_bucket_equals_merged_whole(true).await;
    // None: buckets merged two at a time.
    merged_bucket_by_bucket_equals_merged_whole(false).await;
}

async fn merged_bucket_by_bucket_equals_merged_whole(moves_leave_out: bool) {
    let archive = generate_archive_with(6000, 400, 7, 3000, moves_leave_out);
    let half = generate_archive_with(2999, 400, 7, 3000, moves_leave_out);
    assert_eq!(&archive.lines[..2999], &half.lines[..]);
    let moves: Vec<&String> = archive
        .lines
        .iter()
        .filter(|l| l.contains(r#""op":"update""#) && !l.contains(r#""old":null"#))
        .collect();
    assert!(moves.len() > 200, "key moves: {}", moves.len());
    let leaving_out = moves.iter().filter(|l| !l.contains(r#""doc""#)).count();
    match moves_leave_out {
        true => assert!(leaving_out > 50, "{leaving_out} leave doc out"),
        false => assert_eq!(leaving_out, 0),
    }

    let whole = tempfile::tempdir().unwrap();
    let bucketed = tempfile::tempdir().unwrap();
    // Run 1: seqs 1..=2999 (the truncate is seq 3000).
    for (root, merge_bytes) in [(whole.path(), 1 << 30), (bucketed.path(), 60_000)] {
        write_archive(root, &archive, 1, 2999);
        let s = compact_in_process(root, merge_bytes).await;
        assert_eq!(s.changes, 2999);
        let (latest, _) = read_latest(root).await;
        assert_eq!(latest, half.expected, "run 1, merge_bytes {merge_bytes}");
    }
    assert_eq!(latest_buckets(whole.path()).await, 1);
    let first = latest_buckets(bucketed.path()).await;
    assert!((4..=32).contains(&first), "{first} buckets");

    // Run 2: the rest, the truncate included; the bucketed archive's
    // buckets grow past the spool's partitions.
    for (root, merge_bytes) in [(whole.path(), 1 << 30), (bucketed.path(), 2_000)] {
        write_archive(root, &archive, 3000, 6000);
        compact_in_process(root, merge_bytes).await;
        let (latest, files) = read_latest(root).await;
        assert_eq!(latest, archive.expected, "run 2, merge_bytes {merge_bytes}");
        assert!(files >= 1);
    }
    assert_eq!(latest_buckets(whole.path()).await, 1);
    let second = latest_buckets(bucketed.path()).await;
    assert!(second > 32 && second > first, "{second} buckets");
}

/// A table whose first changes rarely repeat a key stops combining them
/// within its first spool round (after 65,536 changes): the rest of the
/// run (updates, key moves leaving a column out, deletes, a truncate)
/// reaches the spool as the parse's batches, and objects parsed before
/// the switch as typed rows only counted. The latest view is still the
/// one the changes give.
#[tokio::test(flavor = "multi_thread")]
async fn a_table_that_stops_combining_within_a_round_merges_every_change() {
    use std::sync::{Arc, Mutex};
    // 400,000 keys: 8% of the first 65,536 changes repeat one, and a round
    // of 20 MiB (about 80,000 changes) would combine about 10%; the round
    // is written while the history writer still holds counted changes.
    let archive = generate_archive(130_000, 400_000, 11, 100_000);
    let root = tempfile::tempdir().unwrap();
    write_archive(root.path(), &archive, 1, 130_000);
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Log {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    // The run loop, which the spool is pushed from, is this test's future.
    let guard = tracing::subscriber::set_default(subscriber);
    let summary = compact_in_process(root.path(), 20 << 20).await;
    drop(guard);
    let log = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    assert!(
        log.contains("keys rarely repeat: spooling the rest of the run change by change")
            && log.contains("changes=65536"),
        "{log}"
    );
    assert_eq!(summary.changes, 130_000);
    let moves = archive
        .lines
        .iter()
        .filter(|l| l.contains(r#""op":"update""#) && !l.contains(r#""old":null"#))
        .count();
    assert!(moves > 1_000, "key moves: {moves}");
    let (latest, _) = read_latest(root.path()).await;
    assert_eq!(latest.len(), archive.expected.len());
    assert!(latest == archive.expected, "the latest view differs");
}

/// A run that stopped after its history's commit and before its latest
/// view's (simulated by deleting the latest view's last commit) leaves the
/// two logs at different seqs: the next run redoes the latest view from
/// its seq, and replaces the history's files from there when it has more
/// to add (or adds nothing to the history when it has not).
#[tokio::test(flavor = "multi_thread")]
async fn a_run_stopped_between_its_two_commits_is_redone_from_the_latest_view() {
    let archive = generate_archive(2500, 200, 17, 1500);
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let latest_log = root.join("latest/public/t/_delta_log");
    let history_seqs = async || {
        duck(&format!(
            "SELECT count(*), count(DISTINCT _seq), max(_seq) FROM delta_scan('{}/parquet/public/t')",
            root.display()
        ))
    };
    write_archive(root, &archive, 1, 1000);
    compact_in_process(root, 64 << 20).await;
    write_archive(root, &archive, 1001, 2000);
    compact_in_process(root, 64 << 20).await;
    std::fs::remove_file(latest_log.join(format!("{:020}.json", 1))).unwrap();
    assert_eq!(snapshot(root, Role::Latest).await.unwrap().seq, Some(1000));
    assert_eq!(snapshot(root, Role::History).await.unwrap().seq, Some(2000));

    // Nothing new: the latest view catches up, the history stays.
    let s = compact_in_process(root, 64 << 20).await;
    assert_eq!(s.changes, 1000);
    assert_eq!(snapshot(root, Role::Latest).await.unwrap().seq, Some(2000));
    assert_eq!(
        history_seqs().await,
        [[json!(2000), json!(2000), json!(2000)]]
    );
    let mut model = generate_archive(2000, 200, 17, 1500);
    assert_eq!(read_latest(root).await.0, model.expected);

    // Again, with more to compact: the history's files from seq 1001 are
    // replaced by the run's.
    std::fs::remove_file(latest_log.join(format!("{:020}.json", 1))).unwrap();
    write_archive(root, &archive, 2001, 2500);
    let s = compact_in_process(root, 64 << 20).await;
    assert_eq!(s.changes, 1500);
    assert_eq!(
        history_seqs().await,
        [[json!(2500), json!(2500), json!(2500)]]
    );
    model = archive;
    assert_eq!(read_latest(root).await.0, model.expected);
    let history = snapshot(root, Role::History).await.unwrap();
    assert_eq!(history.seq, Some(2500));
}

/// A table without a key (REPLICA IDENTITY NOTHING) gets a history of
/// every change and no latest view: its changes never reach the spool.
#[tokio::test(flavor = "multi_thread")]
async fn a_table_without_a_key_gets_a_history_and_no_latest_view() {
    use arrow::array::AsArray;
    use arrow::datatypes::Int64Type;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let root = tempfile::tempdir().unwrap();
    let schema = json!({"table": "public.t", "version": 1, "replica_identity": "nothing", "columns": [
        {"name": "id", "type": "bigint", "type_oid": 20, "type_modifier": -1, "key": false},
        {"name": "doc", "type": "text", "type_oid": 25, "type_modifier": -1, "key": false},
        {"name": "n", "type": "integer", "type_oid": 23, "type_modifier": -1, "key": false}]});
    let dir = root.path().join("_schemas/public.t");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("1.json"), schema.to_string()).unwrap();
    let day = root.path().join("2026/11/30");
    std::fs::create_dir_all(&day).unwrap();
    let n = 1_000u64;
    for first in (1..=n).step_by(100) {
        let body: String = (first..first + 100)
            .map(|seq| {
                let (op, data) = match seq % 4 {
                    0 => ("delete", Value::Null),
                    1 => ("update", json!({"id": seq % 50, "n": seq})),
                    _ => ("insert", json!({"id": seq % 50, "doc": format!("d{seq}"), "n": seq})),
                };
                json!({"op": op, "table": "public.t", "data": data, "old": null, "seq": seq,
                       "idempotency_key": format!("k{seq}"), "commit_lsn": format!("0/{:X}", seq * 8)})
                .to_string()
                    + "\n"
            })
            .collect();
        std::fs::write(day.join(format!("gen-{first}-{}.ndjson", first + 99)), body).unwrap();
    }
    let summary = compact_in_process(root.path(), 64 << 20).await;
    assert_eq!(summary.changes, n);
    assert_eq!((summary.latest_files, summary.latest_rows), (0, 0));
    assert!(!root.path().join("latest").exists());
    let mut seqs = Vec::new();
    let history = snapshot(root.path(), Role::History).await.unwrap();
    assert_eq!(history.seq, Some(n));
    for f in &history.files {
        let file = std::fs::File::open(root.path().join("parquet/public/t").join(&f.path)).unwrap();
        for batch in ParquetRecordBatchReaderBuilder::try_new(file)
            .unwrap()
            .build()
            .unwrap()
        {
            let batch = batch.unwrap();
            let column = batch.column_by_name("_seq").unwrap();
            seqs.extend(column.as_primitive::<Int64Type>().values().iter().copied());
        }
    }
    seqs.sort();
    assert_eq!(seqs, (1..=n as i64).collect::<Vec<_>>());
    // A rerun writes nothing new.
    assert_eq!(compact_in_process(root.path(), 64 << 20).await.changes, 0);
}

/// Uploads changes `from..=to` of `archive` under `prefix`, as
/// [`write_archive`] lays them out.
async fn upload_archive(prefix: &str, archive: &GeneratedArchive, from: u64, to: u64) {
    let dir = tempfile::tempdir().unwrap();
    write_archive(dir.path(), archive, from, to);
    upload_dir(dir.path(), prefix).await;
}

/// A proxy to the test S3 server, and `waltail` (pipeline `gen`, table
/// public.t, no database, info log) on the archive under `prefix` through
/// it.
fn through_proxy(prefix: &str) -> (Proxy, Waltail) {
    let s3 = s3();
    let proxy = Proxy::start(s3.endpoint.trim_start_matches("http://").parse().unwrap());
    let mut w = Waltail::without_db("gen", "public.t");
    w.s3(prefix)
        .set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url())
        .set("WALTAIL_LOG", "waltail=info");
    (proxy, w)
}

/// Downloads the tables under `prefix`: the latest view must equal
/// `archive`'s, and the history hold each of its first `changes` seqs once.
async fn assert_s3_tables_whole(prefix: &str, archive: &GeneratedArchive, changes: u64) {
    let dir = tempfile::tempdir().unwrap();
    download(prefix, dir.path()).await;
    assert_eq!(read_latest(dir.path()).await.0, archive.expected);
    let history = duck(&format!(
        "SELECT count(*), count(DISTINCT _seq), min(_seq), max(_seq) FROM delta_scan('{}/parquet/public/t')",
        dir.path().display()
    ));
    assert_eq!(
        history,
        [[json!(changes), json!(changes), json!(1), json!(changes)]]
    );
}

/// Uploads every file under `dir` to the test bucket under `prefix`, at
/// its path relative to `dir`.
async fn upload_dir(dir: &Path, prefix: &str) {
    let store = admin_store();
    for entry in walk(dir) {
        let key = format!("{prefix}/{}", entry.strip_prefix(dir).unwrap().display());
        store
            .put(
                &ObjectPath::from(key.as_str()),
                PutPayload::from(std::fs::read(&entry).unwrap()),
            )
            .await
            .unwrap();
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// Starts `w` (`args`) on the archive under `prefix` through `proxy`, each
/// chunk held 20 ms, and returns once it has written a history file: it is
/// then writing and has not committed.
async fn spawn_slow_until_history(w: &mut Waltail, proxy: &Proxy, prefix: &str, args: &[&str]) {
    proxy.set_mode(Mode::Delay(Duration::from_millis(20)));
    w.s3(prefix)
        .set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url());
    w.spawn(args);
    wait_for_history(prefix).await;
}

/// Waits until a run has written a history file under `prefix`.
async fn wait_for_history(prefix: &str) {
    wait_until(
        "the run has written history",
        Duration::from_secs(60),
        async || {
            !listing(admin_store().as_ref(), &format!("{prefix}/parquet"))
                .await
                .is_empty()
        },
    )
    .await;
}

/// Waits until `what` holds, polling.
async fn wait_until(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < timeout, "not within {timeout:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn of_two_compacts_of_one_table_at_once_one_commits_and_the_other_stops_saying_why() {
    let archive = generate_archive(3000, 300, 11, 1500);
    let prefix = unique("compacttwo");
    upload_archive(&prefix, &archive, 1, 3000).await;
    let s3 = s3();
    let proxy = Proxy::start(s3.endpoint.trim_start_matches("http://").parse().unwrap());
    let mut slow = Waltail::without_db("gen", "public.t");
    spawn_slow_until_history(&mut slow, &proxy, &prefix, &["compact"]).await;
    // Hold the slow run's requests while the second one runs: it must not
    // reach its first commit before the other has committed.
    proxy.set_mode(Mode::Delay(Duration::from_secs(2)));
    // No lock: a second run goes ahead and commits first.
    let mut other = Waltail::without_db("gen", "public.t");
    other.s3(&prefix);
    let (status, stdout, stderr) = other.output(&["compact"]);
    assert!(status.success(), "{stdout}{stderr}");
    proxy.set_mode(Mode::Pass);
    // The first then finds the table committed and stops, saying so.
    let status = slow.wait_exit(Duration::from_secs(120));
    assert!(!status.success(), "{}", slow.log());
    assert!(
        slow.log().contains("another `waltail compact`"),
        "{}",
        slow.log()
    );
    assert_s3_tables_whole(&prefix, &archive, 3000).await;
    let (status, stdout, stderr) = other.output(&["compact"]);
    assert!(status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("nothing new to compact"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread")]
async fn compacts_of_two_tables_at_once_both_commit() {
    // One archive, two tables: public.t's changes, and every third object
    // of them again as public.u's (same columns).
    let archive = generate_archive(3000, 300, 13, 3001);
    let root = tempfile::tempdir().unwrap();
    write_archive(root.path(), &archive, 1, 3000);
    let schemas = root.path().join("_schemas");
    std::fs::create_dir_all(schemas.join("public.u")).unwrap();
    let t = std::fs::read_to_string(schemas.join("public.t/1.json")).unwrap();
    std::fs::write(
        schemas.join("public.u/1.json"),
        t.replace("public.t", "public.u"),
    )
    .unwrap();
    let mut u_seqs = 0;
    for (i, object) in walk(&root.path().join("2026")).into_iter().enumerate() {
        if i % 3 == 0 {
            let body = std::fs::read_to_string(&object).unwrap();
            u_seqs += body.lines().count();
            std::fs::write(&object, body.replace("\"public.t\"", "\"public.u\"")).unwrap();
        }
    }
    let prefix = unique("compactboth");
    upload_dir(root.path(), &prefix).await;
    let s3 = s3();
    let proxy = Proxy::start(s3.endpoint.trim_start_matches("http://").parse().unwrap());
    let mut slow = Waltail::without_db("gen", "public.t,public.u");
    spawn_slow_until_history(&mut slow, &proxy, &prefix, &["compact", "public.t"]).await;
    let mut other = Waltail::without_db("gen", "public.t,public.u");
    other.s3(&prefix);
    let (status, stdout, stderr) = other.output(&["compact", "public.u"]);
    assert!(status.success(), "{stdout}{stderr}");
    proxy.set_mode(Mode::Pass);
    let status = slow.wait_exit(Duration::from_secs(120));
    assert!(status.success(), "{}", slow.log());
    let dir = tempfile::tempdir().unwrap();
    download(&prefix, dir.path()).await;
    for (table, n) in [("t", 3000 - u_seqs), ("u", u_seqs)] {
        let rows = duck(&format!(
            "SELECT count(*), count(DISTINCT _seq) FROM delta_scan('{}/parquet/public/{table}')",
            dir.path().display()
        ));
        assert_eq!(rows, [[json!(n), json!(n)]], "history of public.{table}");
        // Read where they are, on S3, both readers see what they see in the copy.
        for role in ["parquet", "latest"] {
            let on_s3 = format!("s3://{}/{prefix}/{role}/public/{table}", s3.bucket);
            let copy = dir.path().join(format!("{role}/public/{table}"));
            for engine in ["duckdb", "deltalake"] {
                assert_eq!(
                    read_delta(engine, Path::new(&on_s3), None).1,
                    read_delta(engine, &copy, None).1,
                    "{engine} on {on_s3}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_compact_outlasts_a_store_that_drops_connections_for_seconds() {
    let archive = generate_archive(3000, 300, 12, 1500);
    let prefix = unique("compactretry");
    upload_archive(&prefix, &archive, 1, 3000).await;
    let s3 = s3();
    let proxy = Proxy::start(s3.endpoint.trim_start_matches("http://").parse().unwrap());
    proxy.set_mode(Mode::Delay(Duration::from_millis(10)));
    let mut w = Waltail::without_db("gen", "public.t");
    w.s3(&prefix)
        .set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url())
        .set("WALTAIL_COMPACT_FILE_BYTES", "20000");
    w.spawn(&["compact"]);
    wait_for_history(&prefix).await;
    // The store is gone for three seconds: every connection reset.
    proxy.set_mode(Mode::Reset);
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set_mode(Mode::Pass);
    let status = w.wait_exit(Duration::from_secs(180));
    assert!(status.success(), "{}", w.log());
    assert_s3_tables_whole(&prefix, &archive, 3000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_large_file_goes_to_s3_in_parts_through_connection_resets() {
    // 6,000 inserts of 3,000 random letters (incompressible): about 14 MB
    // of Parquet, so the history file and the latest view's file each go
    // as a multipart upload of 10 MiB parts.
    let mut rng = fastrand::Rng::with_seed(11);
    let mut archive = GeneratedArchive {
        lines: Vec::new(),
        expected: Default::default(),
    };
    for seq in 1..=6000u64 {
        let doc: String = std::iter::repeat_with(|| rng.alphanumeric())
            .take(3000)
            .collect();
        let (id, n) = (seq as i64, json!(seq % 1000));
        archive.lines.push(
            json!({"op": "insert", "table": "public.t", "data": {"id": id, "doc": doc, "n": n},
                   "old": null, "seq": seq, "idempotency_key": format!("k{seq}"),
                   "commit_lsn": format!("0/{:X}", seq * 8)})
            .to_string(),
        );
        archive.expected.insert(id, (json!(doc), n, seq));
    }
    let prefix = unique("compactparts");
    upload_archive(&prefix, &archive, 1, 6000).await;
    let (proxy, mut w) = through_proxy(&prefix);
    // Every connection is reset for 0.4 s of every 1.2 s until the run
    // ends: parts, completions and reads alike are cut and sent again.
    w.spawn(&["compact"]);
    let running = std::sync::atomic::AtomicBool::new(true);
    let status = std::thread::scope(|s| {
        s.spawn(|| {
            while running.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(800));
                proxy.set_mode(Mode::Reset);
                std::thread::sleep(Duration::from_millis(400));
                proxy.set_mode(Mode::Pass);
            }
        });
        let status = w.wait_exit(Duration::from_secs(300));
        running.store(false, std::sync::atomic::Ordering::Relaxed);
        status
    });
    assert!(status.success(), "{}", w.log());
    let dir = tempfile::tempdir().unwrap();
    download(&prefix, dir.path()).await;
    let history: Vec<_> = std::fs::read_dir(dir.path().join("parquet/public/t/date=2026-11-30"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .collect();
    assert!(
        history.iter().any(|&len| len > 10 << 20),
        "no history file needed parts: {history:?}"
    );
    // S3 tags an object uploaded in N parts `"<md5 of the parts' md5s>-N"`.
    let metas: Vec<_> = admin_store()
        .list(Some(&ObjectPath::from(format!("{prefix}/parquet"))))
        .try_collect()
        .await
        .unwrap();
    let tags: Vec<_> = metas
        .iter()
        .map(|m| m.e_tag.clone().unwrap_or_default())
        .collect();
    assert!(
        tags.iter().any(|t| t.trim_matches('"').ends_with("-2")),
        "no history file went in two parts: {tags:?}"
    );
    assert_eq!(read_latest(dir.path()).await.0, archive.expected);
    let counted = duck(&format!(
        "SELECT count(*), count(DISTINCT _seq), sum(length(doc)) FROM delta_scan('{}/parquet/public/t')",
        dir.path().display()
    ));
    assert_eq!(counted, [[json!(6000), json!(6000), json!(18_000_000)]]);
}

/// A Delta commit is one create-if-absent PUT of a log entry, whose
/// outcome a broken connection hides. The run reads the log back: a commit
/// that never reached the store is tried again, one that landed (only its
/// answer lost, or the store client sent it again and the copy was refused
/// as "already there") is taken as done; either way each table gets one
/// version per run.
#[tokio::test(flavor = "multi_thread")]
async fn a_delta_commit_cut_by_the_network_is_tried_again_or_found_landed() {
    const LOG_ENTRY: &[&str] = &["PUT ", "/_delta_log/", ".json HTTP/1."];
    let archive = generate_archive(4500, 300, 14, 1500);
    let prefix = unique("compactcommitcut");
    let (proxy, mut w) = through_proxy(&prefix);
    let versions = async || {
        let dir = tempfile::tempdir().unwrap();
        download(&prefix, dir.path()).await;
        ["parquet/public/t", "latest/public/t"].map(|t| {
            commit_infos(&dir.path().join(t))
                .iter()
                .map(|c| c["waltail.seq"].as_u64().unwrap())
                .collect::<Vec<_>>()
        })
    };
    // Compacts the changes up to `to`, cutting `cuts` commits `at`; gives
    // the times the log said a commit was tried again, and found landed.
    let mut done = 0;
    let mut run = async |to: u64, at: Cut, cuts: usize| {
        upload_archive(&prefix, &archive, done + 1, to).await;
        done = to;
        proxy.set_mode(Mode::CutRequests {
            line: LOG_ENTRY,
            at,
            limit: cuts,
        });
        let (status, _, log) = w.output(&["compact"]);
        assert!(status.success(), "compact failed ({status}):\n{log}");
        assert_eq!(proxy.cuts(), cuts, "{log}");
        let said = |what: &str| log.matches(what).count();
        (
            said("it had not landed: trying again"),
            said("the Delta commit had landed"),
        )
    };
    // The history's first commit never reaches the store, twice.
    assert_eq!(run(1500, Cut::Before, 2).await, (2, 0));
    assert_eq!(versions().await, [vec![1500], vec![1500]]);
    // Both commits of the next run land, and the answers are lost.
    assert_eq!(run(3000, Cut::Answer, 2).await, (0, 2));
    assert_eq!(versions().await, [vec![1500, 3000], vec![1500, 3000]]);
    // The history's commit lands, and the connection closes before the
    // answer.
    assert_eq!(run(4500, Cut::AnswerClosed, 1).await, (0, 1));
    let seqs = vec![1500, 3000, 4500];
    assert_eq!(versions().await, [seqs.clone(), seqs]);
    assert_s3_tables_whole(&prefix, &archive, 4500).await;
    // A vacuum's first commit (VACUUM START) lands and its answer is lost:
    // the vacuum is done again, and the latest view's replaced files go.
    proxy.set_mode(Mode::CutRequests {
        line: &["PUT ", "latest/public/t/_delta_log/", ".json HTTP/1."],
        at: Cut::Answer,
        limit: 1,
    });
    w.set("WALTAIL_COMPACT_RETAIN", "0s");
    let (status, stdout, log) = w.output(&["compact", "--vacuum"]);
    assert!(
        status.success(),
        "compact --vacuum failed ({status}):\n{log}"
    );
    assert_eq!(proxy.cuts(), 1, "{log}");
    assert_eq!(log.matches("vacuuming again").count(), 1, "{log}");
    let dir = tempfile::tempdir().unwrap();
    download(&prefix, dir.path()).await;
    let (latest, files) = read_latest(dir.path()).await;
    assert_eq!(latest, archive.expected);
    let stored = walk(&dir.path().join("latest/public/t"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .filter(|p| !p.to_string_lossy().contains("_delta_log"))
        .count();
    assert_eq!(stored, files, "only the current files are left: {stdout}");
}

/// A latest view as `engine` reads it at `version` (the newest: `None`):
/// id -> (doc, n, _seq), as [`GeneratedArchive::expected`] holds it.
fn latest_by_reader(
    engine: &str,
    root: &Path,
    version: Option<u64>,
) -> std::collections::BTreeMap<i64, (Value, Value, u64)> {
    let (header, rows) = read_delta(engine, &root.join("latest/public/t"), version);
    let at = |name: &str| {
        header["columns"]
            .as_array()
            .unwrap()
            .iter()
            .position(|c| c == name)
            .unwrap()
    };
    let (id, doc, n, seq) = (at("id"), at("doc"), at("n"), at("_seq"));
    rows.iter()
        .map(|r| {
            let seq = r[seq].as_u64().unwrap();
            (r[id].as_i64().unwrap(), (r[doc].clone(), r[n].clone(), seq))
        })
        .collect()
}

/// Files a commit replaced stay while `compact.retain` covers them, so
/// every reader travels back to the view a run replaced; past it, the
/// vacuum at the end of a run deletes them, and `compact --vacuum` also
/// deletes the files a killed run left that no commit names.
#[tokio::test(flavor = "multi_thread")]
async fn replaced_files_stay_for_time_travel_until_retain_passes_then_vacuum_deletes_them() {
    let archive = generate_archive(1500, 150, 23, 1200);
    let mut w = Waltail::without_db("gen", "public.t");
    let root = w.dir.path().join("archive");
    w.set("WALTAIL_DESTINATION_TYPE", "file")
        .set("WALTAIL_DESTINATION_PATH", root.to_str().unwrap());
    let latest = root.join("latest/public/t");
    let data_files = || -> Vec<PathBuf> {
        walk(&latest)
            .into_iter()
            .filter(|p| {
                p.extension().is_some_and(|e| e == "parquet")
                    && !p.to_string_lossy().contains("_delta_log")
            })
            .collect()
    };
    write_archive(&root, &archive, 1, 500);
    compact(&w, &[]);
    let first_view = generate_archive(500, 150, 23, 1200).expected;
    write_archive(&root, &archive, 501, 1000);
    let out = compact(&w, &[]);
    assert!(!out.contains("vacuumed"), "within retain: {out}");
    // Version 0 is the first run's view, in both readers; the newest is the second's.
    for engine in ["duckdb", "deltalake"] {
        assert_eq!(
            latest_by_reader(engine, &root, Some(0)),
            first_view,
            "{engine}"
        );
    }
    let second_view = generate_archive(1000, 150, 23, 1200).expected;
    assert_eq!(latest_by_reader("duckdb", &root, None), second_view);
    // A file of a run killed before its commit, written two days ago.
    let orphan = latest.join("00000000000000000999.deadbeef-0000-0000.parquet");
    std::fs::copy(&data_files()[0], &orphan).unwrap();
    let two_days_ago = std::time::SystemTime::now() - Duration::from_secs(2 * 86_400);
    std::fs::File::options()
        .write(true)
        .open(&orphan)
        .unwrap()
        .set_modified(two_days_ago)
        .unwrap();

    // Past retain, a run's vacuum deletes the files its commits and the
    // earlier ones replaced; it leaves the orphan (a run may still be writing).
    w.set("WALTAIL_COMPACT_RETAIN", "0s");
    write_archive(&root, &archive, 1001, 1500);
    let out = compact(&w, &[]);
    assert!(out.contains("vacuumed"), "{out}");
    assert!(orphan.exists());
    assert_eq!(latest_by_reader("deltalake", &root, None), archive.expected);
    let current = snapshot(&root, Role::Latest).await.unwrap().files.len();
    assert_eq!(
        data_files().len(),
        current + 1,
        "the current files and the orphan"
    );

    // `--vacuum` deletes the orphan, a day old; the current view is whole.
    let (status, stdout, stderr) = w.output(&["compact", "--vacuum"]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.starts_with("vacuumed 1 files of 1 tables"),
        "{stdout}"
    );
    assert!(!orphan.exists());
    assert_eq!(data_files().len(), current);
    let rows = delta_rows_agree(&latest);
    assert_eq!(rows.len(), archive.expected.len());
    assert_eq!(latest_by_reader("duckdb", &root, None), archive.expected);
    // Nothing is left to delete; a bad retain is refused saying how to write one.
    let (_, stdout, _) = w.output(&["compact", "--vacuum"]);
    assert!(stdout.starts_with("vacuumed 0 files"), "{stdout}");
    w.set("WALTAIL_COMPACT_RETAIN", "a week");
    let (status, _, stderr) = w.output(&["compact"]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("compact.retain") && stderr.contains("\"7d\""),
        "{stderr}"
    );
}

/// Copies the folder `from` into `to`, file by file.
fn copy_dir(from: &Path, to: &Path) {
    for file in walk(from) {
        let target = to.join(file.strip_prefix(from).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&file, &target).unwrap();
    }
}

/// An archive compacted by the release before the Delta tables (the
/// fixture: seqs 1-600 of `generate_archive(1000, 150, 31, 800)`, compacted
/// by that release's `waltail compact`, see tests/fixtures/README.md) is
/// upgraded in place by the first run: its files get Delta logs without
/// being rewritten, every reader sees the rows it saw before, and the next
/// changes are compacted once on top.
#[tokio::test(flavor = "multi_thread")]
async fn an_archive_compacted_before_delta_is_upgraded_in_place() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/compacted-before-delta");
    let mut w = Waltail::without_db("gen", "public.t");
    let root = w.dir.path().join("archive");
    copy_dir(&fixture, &root);
    w.set("WALTAIL_DESTINATION_TYPE", "file")
        .set("WALTAIL_DESTINATION_PATH", root.to_str().unwrap());
    let manifest = root.join("_waltail/compaction/manifest.json");
    assert!(manifest.exists());
    let data_files = || -> BTreeSet<(PathBuf, std::time::SystemTime)> {
        walk(&root)
            .into_iter()
            .filter(|p| {
                p.extension().is_some_and(|e| e == "parquet")
                    && !p.to_string_lossy().contains("_delta_log")
            })
            .map(|p| {
                let modified = std::fs::metadata(&p).unwrap().modified().unwrap();
                (p, modified)
            })
            .collect()
    };
    // What a reader saw before: the manifest's latest files and the history.
    let old: Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    let latest_files: Vec<String> = old["tables"]["public.t"]["latest"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| format!("'{}/{}'", root.display(), k.as_str().unwrap()))
        .collect();
    let before_latest = duck(&format!(
        "SELECT id, doc, n, _seq FROM read_parquet([{}]) ORDER BY id",
        latest_files.join(", ")
    ));
    let before_history = duck(&format!(
        "SELECT count(*), count(DISTINCT _seq), max(_seq) FROM read_parquet('{}/parquet/public/t/*/*.parquet')",
        root.display()
    ));
    assert_eq!(before_history, [[json!(600), json!(600), json!(600)]]);
    let files_before = data_files();

    // The first run writes the logs and nothing else: nothing new to compact.
    let out = compact(&w, &[]);
    assert!(out.contains("nothing new to compact"), "{out}");
    assert!(!manifest.exists());
    assert!(
        root.join("_waltail/compaction/manifest.upgraded.json")
            .exists()
    );
    assert_eq!(
        data_files(),
        files_before,
        "no file written, moved or rewritten"
    );
    let latest = root.join("latest/public/t");
    let rows = delta_rows_agree(&latest);
    assert_eq!(rows.len(), before_latest.len());
    let after_latest = duck(&format!(
        "SELECT id, doc, n, _seq FROM delta_scan('{}') ORDER BY id",
        latest.display()
    ));
    assert_eq!(after_latest, before_latest);
    let history = root.join("parquet/public/t");
    delta_rows_agree(&history);
    let after_history = duck(&format!(
        "SELECT count(*), count(DISTINCT _seq), max(_seq) FROM delta_scan('{}')",
        history.display()
    ));
    assert_eq!(after_history, before_history);
    assert_eq!(snapshot(&root, Role::Latest).await.unwrap().seq, Some(600));
    assert_eq!(snapshot(&root, Role::History).await.unwrap().seq, Some(600));

    // An upgrade stopped after the history's log: the next run writes the
    // latest view's and leaves the history's as it was.
    std::fs::remove_dir_all(latest.join("_delta_log")).unwrap();
    std::fs::copy(
        root.join("_waltail/compaction/manifest.upgraded.json"),
        &manifest,
    )
    .unwrap();
    let out = compact(&w, &[]);
    assert!(out.contains("nothing new to compact"), "{out}");
    assert!(!manifest.exists());
    let history_log = snapshot(&root, Role::History).await.unwrap();
    assert_eq!((history_log.version, history_log.seq), (0, Some(600)));
    assert_eq!(
        latest_by_reader("deltalake", &root, None).len(),
        before_latest.len()
    );

    // The changes after it are compacted once, on top.
    let archive = generate_archive(1000, 150, 31, 800);
    write_archive(&root, &archive, 601, 1000);
    let out = compact(&w, &[]);
    assert!(out.contains("400 changes"), "{out}");
    assert_eq!(latest_by_reader("duckdb", &root, None), archive.expected);
    assert_eq!(latest_by_reader("deltalake", &root, None), archive.expected);
    assert_eq!(
        duck(&format!(
            "SELECT count(*), count(DISTINCT _seq), min(_seq), max(_seq) FROM delta_scan('{}')",
            history.display()
        )),
        [[json!(1000), json!(1000), json!(1), json!(1000)]]
    );
    // The view before the new run is the upgrade's, in every reader.
    let upgraded = snapshot(&root, Role::Latest).await.unwrap().version - 1;
    let before: std::collections::BTreeMap<i64, (Value, Value, u64)> = before_latest
        .iter()
        .map(|r| {
            let seq = r[3].as_u64().unwrap();
            (r[0].as_i64().unwrap(), (r[1].clone(), r[2].clone(), seq))
        })
        .collect();
    for engine in ["duckdb", "deltalake"] {
        assert_eq!(
            latest_by_reader(engine, &root, Some(upgraded)),
            before,
            "{engine}"
        );
    }
    let out = compact(&w, &[]);
    assert!(out.contains("nothing new to compact"), "{out}");
}

/// The commits of the Delta log at `table`, in version order: each one's
/// `commitInfo` (operation, `waltail.*` keys).
fn commit_infos(table: &Path) -> Vec<Value> {
    let mut commits: Vec<PathBuf> = std::fs::read_dir(table.join("_delta_log"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    commits.sort();
    commits
        .iter()
        .map(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).unwrap())
                .find_map(|a| a.get("commitInfo").cloned())
                .unwrap_or_else(|| panic!("no commitInfo in {}", p.display()))
        })
        .collect()
}

/// Where a kill -9 of a compact run falls.
#[derive(Debug)]
enum Kill {
    /// This long after the start (drawn at random).
    After(Duration),
    /// Right at the start: before any commit.
    Start,
    /// As soon as the history's commit is seen: between the two commits.
    HistoryCommitted,
    /// As soon as the latest view's commit is seen: after both.
    LatestCommitted,
    /// As soon as the run's spool folder is there and locked: while files
    /// are written.
    SpoolMade,
}

/// kill -9 at moments spread over runs (seeded, so a failure repeats):
/// before any file, while they are written, between the two commits, after
/// them; then, whatever the machine's load did to those times, once right at
/// the start, once as the history commits, once as the latest view does,
/// and once as the run's spool is made. The next run always goes on and
/// removes the spool a killed one left; at the end the tables hold every
/// change once, both readers open them, and each commit of the latest view
/// starts at the seq after the one before it.
#[tokio::test(flavor = "multi_thread")]
async fn compacts_killed_at_any_moment_lose_nothing_and_commit_nothing_twice() {
    let total = 10_000;
    let archive = generate_archive(total, 400, 41, 4500);
    let mut w = Waltail::without_db("gen", "public.t");
    let root = w.dir.path().join("archive");
    // The runs' spools, where this test sees what killed runs leave.
    let tmp = w.dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    w.set("WALTAIL_DESTINATION_TYPE", "file")
        .set("WALTAIL_DESTINATION_PATH", root.to_str().unwrap())
        .set("TMPDIR", tmp.to_str().unwrap());
    write_archive(&root, &archive, 1, 1000);
    compact(&w, &[]);
    // How long a run of 1,000 changes over a view takes here.
    write_archive(&root, &archive, 1001, 2000);
    let started = Instant::now();
    compact(&w, &[]);
    let run = started.elapsed();
    let (mut written, mut rng) = (2000, fastrand::Rng::with_seed(41));
    let directed = [
        Kill::Start,
        Kill::HistoryCommitted,
        Kill::LatestCommitted,
        Kill::SpoolMade,
    ];
    // The directed kills each get 1,000 new changes of their own, so each
    // run has work (the spool's last).
    let reserved = 1000 * directed.len() as u64;
    let moments = (0..12)
        .map(|_| Kill::After(run.mul_f64(rng.f64() * 1.6)))
        .chain(directed);
    let seq = async |role| snapshot(&root, role).await.and_then(|p| p.seq);
    let spools = || -> BTreeSet<std::ffi::OsString> {
        std::fs::read_dir(&tmp)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect()
    };
    let (mut none, mut both) = (0, 0);
    for (round, moment) in moments.enumerate() {
        let caught_up = seq(Role::Latest).await == Some(written);
        // A random kill's round writes every other round and whenever the
        // runs caught up, within its share; a directed one always writes.
        let write = match moment {
            Kill::After(_) => written < total - reserved && (caught_up || round % 2 == 0),
            _ => true,
        };
        if write {
            write_archive(&root, &archive, written + 1, written + 1000);
            written += 1000;
        }
        let had_work = seq(Role::Latest).await != Some(written);
        let history_before = seq(Role::History).await;
        let spools_before = spools();
        w.spawn(&["compact"]);
        let waited = Instant::now();
        match moment {
            Kill::After(d) => std::thread::sleep(d),
            Kill::Start => {}
            _ => loop {
                let reached = match moment {
                    Kill::HistoryCommitted => seq(Role::History).await != history_before,
                    Kill::LatestCommitted => seq(Role::Latest).await == Some(written),
                    // Made and locked: a folder killed in the microseconds
                    // before its lock file exists is, by design, swept only
                    // after an hour (spool::folder), not by the next run.
                    _ => spools()
                        .difference(&spools_before)
                        .any(|s| tmp.join(s).join("lock").exists()),
                };
                if reached {
                    break;
                }
                assert!(
                    waited.elapsed() < Duration::from_secs(60),
                    "{moment:?} not reached in 60 s"
                );
                std::thread::sleep(Duration::from_millis(1));
            },
        }
        w.kill9();
        let (history, latest) = (seq(Role::History).await, seq(Role::Latest).await);
        assert!(history >= latest, "the history is committed first");
        match latest {
            _ if !had_work => {}
            Some(s) if s == written => both += 1,
            _ if history == history_before => none += 1,
            _ => {}
        }
    }
    assert_eq!(written, total);
    assert!(
        none > 0 && both > 0,
        "kills before ({none}) and after ({both}) the commits of a run of {run:?}"
    );
    // The last run killed left its spool (each run removed those before
    // it); the next run removes it, and leaves none of its own.
    assert_eq!(spools().len(), 1, "the spool of the last run killed");
    let (status, out, err) = w.output(&["compact"]);
    assert!(status.success() && !out.contains("error"), "{out}\n{err}");
    assert!(err.contains("removed a compaction spool"), "{err}");
    assert_eq!(spools().len(), 0, "no spool left after a whole run");
    let history = root.join("parquet/public/t");
    let latest = root.join("latest/public/t");
    assert_eq!(
        duck(&format!(
            "SELECT count(*), count(DISTINCT _seq), min(_seq), max(_seq) FROM delta_scan('{}')",
            history.display()
        )),
        [[json!(total), json!(total), json!(1), json!(total)]]
    );
    assert_eq!(delta_rows_agree(&history).len() as u64, total);
    delta_rows_agree(&latest);
    assert_eq!(latest_by_reader("duckdb", &root, None), archive.expected);
    assert_eq!(latest_by_reader("deltalake", &root, None), archive.expected);
    let mut next = 1;
    for info in commit_infos(&latest) {
        let Some(seq) = info["waltail.seq"].as_u64() else {
            continue; // a vacuum's commit
        };
        assert_eq!(info["waltail.fromSeq"].as_u64(), Some(next), "{info}");
        next = seq + 1;
    }
    assert_eq!(next, total + 1);
}

/// A reader looping over a latest view while a run replaces it counts the
/// rows of the view before or of the view after, never anything else: each
/// read is one snapshot of the log.
#[tokio::test(flavor = "multi_thread")]
async fn readers_looping_over_a_latest_view_during_a_compact_see_the_old_view_or_the_new() {
    let total = 20_000;
    let archive = generate_archive(total, 6000, 43, total + 1);
    let mut w = Waltail::without_db("gen", "public.t");
    let root = w.dir.path().join("archive");
    w.set("WALTAIL_DESTINATION_TYPE", "file")
        .set("WALTAIL_DESTINATION_PATH", root.to_str().unwrap());
    write_archive(&root, &archive, 1, 2000);
    compact(&w, &[]);
    let before = generate_archive(2000, 6000, 43, total + 1).expected.len();
    let after = archive.expected.len();
    assert_ne!(before, after);
    write_archive(&root, &archive, 2001, total);
    let latest = root.join("latest/public/t");
    let readers: Vec<_> = ["duckdb", "deltalake"]
        .into_iter()
        .map(|engine| {
            let child = std::process::Command::new(duckdb_python())
                .arg(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/tests/readers/delta.py"
                ))
                .arg(engine)
                .arg(&latest)
                .args(["--count-loop", "25"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            (engine, child)
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let started = Instant::now();
    compact(&w, &[]);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "the run must end while the readers loop: {took:?}"
    );
    for (engine, child) in readers {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{engine}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let counts: Vec<usize> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect();
        assert!(
            counts.iter().all(|&c| c == before || c == after),
            "{engine} counted {counts:?}; the views hold {before} and {after}"
        );
        assert_eq!(counts.first(), Some(&before), "{engine}: {counts:?}");
        assert_eq!(counts.last(), Some(&after), "{engine}: {counts:?}");
    }
}

const WIDEN: Table = Table {
    name: "widen",
    pg: "id, n, amount::text",
    duck: "id, n, CAST(amount AS VARCHAR)",
    json_columns: &[],
};

/// The Arrow types of `columns` in each data file of the Delta table at
/// `table` (a local folder), as the file itself stores them.
fn file_types(table: &Path, columns: &[&str]) -> Vec<(String, Vec<String>)> {
    let (header, _) = read_delta("deltalake", table, None);
    let files = delta_files(table, header["version"].as_u64().unwrap());
    files
        .into_iter()
        .map(|path| {
            let file = std::fs::File::open(table.join(&path)).unwrap();
            let reader =
                parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                    .unwrap();
            let schema = reader.schema();
            let types = columns
                .iter()
                .map(|c| schema.field_with_name(c).unwrap().data_type().to_string())
                .collect();
            (path, types)
        })
        .collect()
}

/// The data files (relative paths) a Delta table's `version` names, from
/// its JSON commits (no checkpoint is written in the first ten).
fn delta_files(table: &Path, version: u64) -> BTreeSet<String> {
    let mut files = BTreeSet::new();
    for v in 0..=version {
        let log = std::fs::read_to_string(table.join(format!("_delta_log/{v:020}.json"))).unwrap();
        for action in log
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
        {
            if let Some(path) = action["add"]["path"].as_str() {
                files.insert(path.to_string());
            }
            if let Some(path) = action["remove"]["path"].as_str() {
                files.remove(path);
            }
        }
    }
    files
}

/// Waits until the local folder archive `root` replays to exactly the rows
/// of `table`; returns its changes.
async fn wait_folder_replays(db: &TestDb, root: &Path, pipeline: &str, table: &str) -> Vec<Value> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let objects: Vec<Object> = file_objects(root)
            .into_iter()
            .filter(|o| !o.key.starts_with("parquet/") && !o.key.starts_with("latest/"))
            .collect();
        if contiguous(&objects) {
            let changes = checked_changes(&objects, None, pipeline);
            if replay(&changes).get(&format!("public.{table}")) == Some(&db.rows(table).await) {
                return changes;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("the archive's replay never equalled {table}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_column_that_widens_rewrites_the_earlier_history_in_the_wider_type() {
    let db = TestDb::new("compactwiden").await;
    db.exec("CREATE TABLE widen (id int PRIMARY KEY, n int, amount numeric(6,2))")
        .await;
    let pipeline = unique("cw").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.widen");
    let archive: PathBuf = w.dir.path().join("archive");
    w.set("WALTAIL_DESTINATION_TYPE", "file")
        .set("WALTAIL_DESTINATION_PATH", archive.to_str().unwrap());
    w.start();
    db.exec("INSERT INTO widen SELECT g, g, g / 100.0 FROM generate_series(1, 20) g")
        .await;
    db.exec("UPDATE widen SET n = -n WHERE id <= 5").await;
    wait_folder_replays(&db, &archive, &pipeline, "widen").await;
    compact(&w, &[]);
    let history = archive.join("parquet/public/widen");
    let (_, before) = read_delta("deltalake", &history, None);
    let narrow = file_types(&history, &["n", "amount"]);
    assert!(
        narrow
            .iter()
            .all(|(_, t)| t == &["Int32", "Decimal128(6, 2)"]),
        "{narrow:?}"
    );

    // Both columns widen; new values need the room.
    db.exec(
        "ALTER TABLE widen ALTER COLUMN n TYPE bigint, ALTER COLUMN amount TYPE numeric(14,2);
         INSERT INTO widen VALUES (21, 5000000000, 123456789012.34);
         UPDATE widen SET n = 3000000000 WHERE id = 1;",
    )
    .await;
    let changes = wait_folder_replays(&db, &archive, &pipeline, "widen").await;
    let out = compact(&w, &[]);
    assert!(
        out.contains(&format!("rewrote  {} earlier history files", narrow.len())),
        "{out}"
    );
    assert_latest_equals_source(&db, &archive, &WIDEN).await;
    assert_history_equals_archive(&archive, "widen", &changes);
    // Every file of the history's snapshot holds the wider types, so a
    // reader that checks files against the schema reads them all.
    let wide = file_types(&history, &["n", "amount"]);
    assert!(wide.len() > narrow.len(), "{wide:?}");
    assert!(
        wide.iter()
            .all(|(_, t)| t == &["Int64", "Decimal128(14, 2)"]),
        "{wide:?}"
    );
    // Values as numbers: the archive writes numeric 0.10 as 0.1.
    let numbers = |row: &[Value]| -> (u64, Option<i64>, Option<f64>) {
        let amount = |v: &Value| v.as_f64().or_else(|| v.as_str()?.parse().ok());
        (row[0].as_u64().unwrap(), row[1].as_i64(), amount(&row[2]))
    };
    let expected: Vec<_> = changes
        .iter()
        .map(|c| {
            let row = if c["data"].is_object() {
                &c["data"]
            } else {
                &c["old"]
            };
            numbers(&[c["seq"].clone(), row["n"].clone(), row["amount"].clone()])
        })
        .collect();
    let got: Vec<_> = duck(&format!(
        "SELECT _seq, n, CAST(amount AS VARCHAR) FROM delta_scan('{}') ORDER BY _seq",
        history.display()
    ))
    .iter()
    .map(|r| numbers(r))
    .collect();
    assert_eq!(got, expected, "history values");
    // The version before the rewrite still reads, from the narrower files.
    for engine in ["deltalake", "duckdb"] {
        let (header, rows) = read_delta(engine, &history, Some(0));
        assert_eq!(header["version"], 0, "{engine}");
        assert_eq!(rows, before, "{engine}: version 0");
    }
    let out = compact(&w, &[]);
    assert!(out.contains("nothing new to compact"), "{out}");
    w.stop();
    db.drop_db().await;
}
