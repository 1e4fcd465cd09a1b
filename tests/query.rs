//! `waltail query` against real PostgreSQL and SeaweedFS (and a local
//! folder), with the real binary: after a mixed workload the latest view
//! equals the source table before any compaction, after it, and with an
//! uncompacted tail; DuckDB over the same Parquet agrees; `--at` gives the
//! earlier states (by seq and by time, also when it must rebuild from the
//! history); the output formats parse; a closed pipe is quiet; a SQL error
//! points at its place; filters on seq and date skip objects unread.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::proxy::Proxy;
use common::*;
use object_store::ObjectStoreExt;
use object_store::path::Path as ObjectPath;
use serde_json::{Value, json};

/// A table of the test, with the expressions that bring Postgres, waltail
/// query and DuckDB to the same JSON.
struct Table {
    name: &'static str,
    pg: &'static str,
    query: &'static str,
    duck: &'static str,
    /// Columns the engines return as JSON text.
    json_columns: &'static [usize],
}

const ORDERS: Table = Table {
    name: "orders",
    pg: "id, customer, status, total::text, items, paid, (extract(epoch from placed_at) * 1000000)::bigint, note, ratio, to_jsonb(tags)",
    query: "id, customer, status, CAST(total AS VARCHAR), items, paid, CAST(placed_at AS BIGINT), note, ratio, tags",
    duck: "id, customer, status, CAST(total AS VARCHAR), items, paid, epoch_us(placed_at), note, ratio, tags",
    json_columns: &[4, 9],
};
const CUSTOMERS: Table = Table {
    name: "customers",
    pg: "id, name, since::text, score::float8, tier",
    query: "id, name, CAST(since AS VARCHAR), CAST(score AS DOUBLE), tier",
    duck: "id, name, CAST(since AS VARCHAR), CAST(score AS DOUBLE), tier",
    json_columns: &[],
};
const DOCS: Table = Table {
    name: "docs",
    pg: "id, body, n, tag",
    query: "id, body, n, tag",
    duck: "id, body, n, tag",
    json_columns: &[],
};

fn numbers_as_f64(row: Vec<Value>) -> Vec<Value> {
    row.into_iter()
        .map(|v| match v {
            Value::Number(n) => json!(n.as_f64().unwrap()),
            other => other,
        })
        .collect()
}

fn normalize(rows: Vec<Vec<Value>>, t: &Table) -> Vec<Vec<Value>> {
    rows.into_iter()
        .map(|mut row| {
            for &i in t.json_columns {
                if let Value::String(s) = &row[i] {
                    row[i] = serde_json::from_str(s).unwrap();
                }
            }
            // Long texts (the TOASTed bodies) as a digest, so a failure prints short.
            for v in row.iter_mut() {
                if let Value::String(s) = v
                    && s.len() > 64
                {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    s.hash(&mut h);
                    *v = json!(format!("{} chars, hash {:x}", s.len(), h.finish()));
                }
            }
            numbers_as_f64(row)
        })
        .collect()
}

/// The source table's rows, by id, as comparable JSON.
async fn pg_rows(db: &TestDb, t: &Table) -> Vec<Vec<Value>> {
    let rows = db
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
    normalize(rows, t)
}

/// Runs `waltail query --format json` and returns the rows as arrays in
/// column order (the JSON objects' keys are the column names).
fn query_json(w: &Waltail, extra: &[&str], sql: &str) -> Vec<Vec<Value>> {
    let mut args = vec!["query", "--format", "json"];
    args.extend_from_slice(extra);
    args.push(sql);
    let (status, stdout, stderr) = w.output(&args);
    assert!(status.success(), "query {sql} failed ({status}):\n{stderr}");
    let v: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("the JSON output does not parse: {e}\n{stdout}"));
    // Objects keep the select list's order (serde_json preserve_order is
    // off, so rebuild it from the first object's keys in the text).
    let names = column_names(&stdout);
    v.as_array()
        .unwrap()
        .iter()
        .map(|o| names.iter().map(|n| o[n].clone()).collect())
        .collect()
}

/// The keys of the first object of a JSON array output, in text order.
fn column_names(json_text: &str) -> Vec<String> {
    let mut de = serde_json::Deserializer::from_str(json_text.trim_start_matches('['));
    let first: Option<serde_json::Map<String, Value>> =
        serde::Deserialize::deserialize(&mut de).ok();
    let Some(first) = first else {
        return Vec::new();
    };
    // Keys in the order they appear in the text.
    let mut keys: Vec<(usize, String)> = first
        .keys()
        .map(|k| {
            let needle = format!("{}:", serde_json::to_string(k).unwrap());
            (json_text.find(&needle).unwrap(), k.clone())
        })
        .collect();
    keys.sort();
    keys.into_iter().map(|(_, k)| k).collect()
}

fn latest_by_query(w: &Waltail, at: &[&str], t: &Table) -> Vec<Vec<Value>> {
    normalize(
        query_json(
            w,
            at,
            &format!("SELECT {} FROM public.{} ORDER BY id", t.query, t.name),
        ),
        t,
    )
}

async fn assert_query_equals_source(w: &Waltail, db: &TestDb, t: &Table, when: &str) {
    let pg = pg_rows(db, t).await;
    assert!(!pg.is_empty(), "{} is empty {when}", t.name);
    assert_eq!(
        latest_by_query(w, &[], t),
        pg,
        "public.{} vs the table {when}",
        t.name
    );
}

/// The types `public.orders` and its history give their text columns
/// (with `extra`, e.g. `--at`): string views whether the rows come from
/// the compacted files, the NDJSON tail or a rebuild from the history.
fn assert_text_read_as_views(w: &Waltail, extra: &[&str], when: &str) {
    for sql in [
        "SELECT arrow_typeof(status), arrow_typeof(items) FROM public.orders LIMIT 1",
        "SELECT arrow_typeof(status), arrow_typeof(_op), arrow_typeof(_key) FROM history.public.orders LIMIT 1",
    ] {
        let rows = query_json(w, extra, sql);
        assert_eq!(rows.len(), 1, "{when}: {sql}");
        for t in &rows[0] {
            assert_eq!(t, "Utf8View", "{when}: {sql}");
        }
    }
}

fn compact(w: &Waltail) -> String {
    let (status, stdout, stderr) = w.output(&["compact"]);
    assert!(
        status.success(),
        "compact failed ({status}):\n{stdout}\n{stderr}"
    );
    stdout
}

/// One number from a query.
fn scalar(w: &Waltail, extra: &[&str], sql: &str) -> i64 {
    query_json(w, extra, sql)[0][0].as_i64().unwrap()
}

async fn create_tables(db: &TestDb) {
    db.exec(TABLES).await;
    db.exec("ALTER TABLE customers ADD COLUMN tier text").await;
    // A body stored out of line and uncompressed: an update of `n` alone
    // leaves it out of the change (unchanged TOAST).
    db.exec(
        "CREATE TABLE docs (id int PRIMARY KEY, body text, n int);
         ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;",
    )
    .await;
}

/// The archive's changes once every change of the source is in.
async fn all_archived(db: &TestDb, prefix: &str, pipeline: &str) -> Vec<Value> {
    wait_replay_equals(
        db,
        async || ndjson_objects(prefix).await,
        Some(prefix),
        pipeline,
    )
    .await
}

/// The archive's changes as they are now (at least `before`).
async fn all_archived_now(prefix: &str, pipeline: &str, before: Vec<Value>) -> Vec<Value> {
    let mut objects: Vec<Object> = Vec::new();
    for _ in 0..100 {
        objects = ndjson_objects(prefix).await;
        if contiguous(&objects) {
            break;
        }
        // An earlier upload may land after a later one.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let now = checked_changes(&objects, Some(prefix), pipeline);
    assert!(now.len() >= before.len());
    now
}

/// Waits until the archive holds the docs update that set `n = marker`
/// (the docs table is not in wait_replay_equals's comparison).
async fn wait_docs(prefix: &str, marker: i64) {
    for _ in 0..300 {
        let found = ndjson_objects(prefix).await.iter().any(|o| {
            o.key.ends_with(".ndjson")
                && o.body.lines().any(|l| {
                    let v: Value = serde_json::from_str(l).unwrap();
                    v["table"] == "public.docs" && v["data"]["n"] == json!(marker)
                })
        });
        if found {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("docs n = {marker} never reached the archive");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_latest_view_equals_the_source_before_and_after_compaction_and_with_a_tail() {
    let db = TestDb::new("query").await;
    create_tables(&db).await;
    let pipeline = unique("qy").replace('_', "-");
    let prefix = unique("query");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers,public.docs");
    w.s3(&prefix).set("WALTAIL_DELIVERY_BATCH_SIZE", "7");
    w.start();
    db.exec(
        "INSERT INTO docs SELECT i, (SELECT string_agg(md5(i::text || j::text), '') FROM generate_series(1, 400) j), 0
         FROM generate_series(1, 6) i",
    )
    .await;

    // Stage 1: inserts, updates (one leaving the TOASTed body out), deletes,
    // a truncate, an added column; nothing compacted yet.
    mixed_workload(&db, 41, 30, 0).await;
    db.exec("UPDATE docs SET n = 1 WHERE id IN (5, 6)").await;
    db.exec("TRUNCATE customers").await;
    db.exec("ALTER TABLE docs ADD COLUMN tag text").await;
    mixed_workload(&db, 42, 30, 0).await;
    db.exec("UPDATE docs SET tag = 'late', n = 3 WHERE id = 4")
        .await;
    let changes1 = all_archived(&db, &prefix, &pipeline).await;
    wait_docs(&prefix, 3).await;
    let changes1 = all_archived_now(&prefix, &pipeline, changes1).await;
    let seq1 = changes1.len() as i64;
    let snapshot1 = pg_rows(&db, &ORDERS).await;
    let docs1 = pg_rows(&db, &DOCS).await;
    assert!(
        changes1.iter().any(|c| c["table"] == "public.docs"
            && c["op"] == "update"
            && !c["data"].as_object().unwrap().contains_key("body")),
        "an update leaves the unchanged TOASTed body out"
    );
    assert!(changes1.iter().any(|c| c["op"] == "truncate"));
    for t in [&ORDERS, &CUSTOMERS, &DOCS] {
        assert_query_equals_source(&w, &db, t, "before any compaction").await;
    }
    assert_eq!(
        scalar(&w, &[], "SELECT count(*) FROM waltail.changes"),
        seq1,
        "every envelope once"
    );
    assert_eq!(
        scalar(&w, &[], "SELECT max(seq) FROM waltail.changes"),
        seq1
    );
    assert_text_read_as_views(&w, &[], "before any compaction");

    // Stage 2: compacted; the same answers, and DuckDB over the Delta tables agrees.
    compact(&w);
    for t in [&ORDERS, &CUSTOMERS, &DOCS] {
        assert_query_equals_source(&w, &db, t, "after compaction").await;
    }
    assert_text_read_as_views(&w, &[], "after compaction");
    let dir = tempfile::tempdir().unwrap();
    download(&prefix, dir.path()).await;
    for t in [&ORDERS, &CUSTOMERS, &DOCS] {
        let duck_rows = normalize(
            duck(&format!(
                "SELECT {} FROM delta_scan('{}/latest/public/{}') ORDER BY id",
                t.duck,
                dir.path().display(),
                t.name
            )),
            t,
        );
        assert_eq!(
            latest_by_query(&w, &[], t),
            duck_rows,
            "waltail query and DuckDB over latest/ for {}",
            t.name
        );
    }
    let sql = "SELECT _op, count(*) AS n, sum(_seq) AS s FROM history.public.orders GROUP BY _op ORDER BY _op";
    let duck_history = duck(&format!(
        "SELECT _op, count(*) AS n, sum(_seq) AS s FROM delta_scan('{}/parquet/public/orders') GROUP BY _op ORDER BY _op",
        dir.path().display()
    ));
    let duck_history: Vec<Vec<Value>> = duck_history.into_iter().map(numbers_as_f64).collect();
    let ours: Vec<Vec<Value>> = query_json(&w, &[], sql)
        .into_iter()
        .map(numbers_as_f64)
        .collect();
    assert_eq!(
        ours, duck_history,
        "the history by waltail query and DuckDB"
    );

    // A point in time between stage 2 and 3 (object times have seconds).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let between = chrono::Utc::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // Stage 3: an uncompacted tail over the compacted views.
    mixed_workload(&db, 43, 30, 10).await;
    db.exec("UPDATE docs SET n = 2 WHERE id IN (1, 5); DELETE FROM docs WHERE id = 2;")
        .await;
    db.exec("INSERT INTO customers VALUES (999, 'late', '2024-02-02', 1.5, 'new')")
        .await;
    let changes3 = all_archived(&db, &prefix, &pipeline).await;
    wait_docs(&prefix, 2).await;
    let changes3 = all_archived_now(&prefix, &pipeline, changes3).await;
    assert!(changes3.len() > changes1.len());
    // The last batch again under another name (a replay): counted once.
    let last = ndjson_objects(&prefix).await.into_iter().max_by_key(|o| {
        let name = o.key.rsplit('/').next().unwrap().to_string();
        name.rsplit('-')
            .next()
            .unwrap()
            .trim_end_matches(".ndjson")
            .parse::<u64>()
            .unwrap()
    });
    let last = last.unwrap();
    let name = last.key.rsplit('/').next().unwrap();
    admin_store()
        .put(
            &ObjectPath::from(format!("{prefix}/1999/01/01/{name}")),
            object_store::PutPayload::from(last.body.clone().into_bytes()),
        )
        .await
        .unwrap();
    assert_eq!(
        scalar(&w, &[], "SELECT count(*) FROM waltail.changes"),
        changes3.len() as i64,
        "a repeated object's changes once"
    );
    for t in [&ORDERS, &CUSTOMERS, &DOCS] {
        assert_query_equals_source(&w, &db, t, "with an uncompacted tail").await;
    }
    assert_text_read_as_views(&w, &[], "with an uncompacted tail");
    let orders_changes = changes3
        .iter()
        .filter(|c| c["table"] == "public.orders")
        .count() as i64;
    assert_eq!(
        scalar(&w, &[], "SELECT count(*) FROM history.public.orders"),
        orders_changes,
        "compacted history plus the tail, each change once"
    );
    assert_eq!(
        scalar(
            &w,
            &[],
            "SELECT count(*) FROM history.public.docs WHERE _unchanged IS NOT NULL"
        ),
        changes3
            .iter()
            .filter(|c| c["table"] == "public.docs"
                && c["op"] == "update"
                && !c["data"].as_object().unwrap().contains_key("body"))
            .count() as i64,
        "unchanged TOAST is marked in the tail's history as in the compacted one"
    );

    // --at: the earlier states, by seq (the compacted view, then a rebuild
    // from the history) and by time.
    let seq1s = seq1.to_string();
    assert_eq!(latest_by_query(&w, &["--at", &seq1s], &ORDERS), snapshot1);
    assert_eq!(latest_by_query(&w, &["--at", &seq1s], &DOCS), docs1);
    let at_time = between.to_rfc3339();
    assert_eq!(latest_by_query(&w, &["--at", &at_time], &ORDERS), snapshot1);
    assert_eq!(
        scalar(
            &w,
            &["--at", &seq1s],
            "SELECT count(*) FROM waltail.changes"
        ),
        seq1
    );
    compact(&w);
    for t in [&ORDERS, &CUSTOMERS, &DOCS] {
        assert_query_equals_source(&w, &db, t, "after the second compaction").await;
    }
    assert_eq!(
        latest_by_query(&w, &["--at", &seq1s], &ORDERS),
        snapshot1,
        "--at before the compacted view: rebuilt from the history"
    );
    assert_text_read_as_views(&w, &["--at", &seq1s], "rebuilt from the history");
    assert_eq!(latest_by_query(&w, &["--at", &seq1s], &DOCS), docs1);
    assert_eq!(latest_by_query(&w, &["--at", &at_time], &ORDERS), snapshot1);
    assert!(
        latest_by_query(&w, &["--at", "0"], &ORDERS).is_empty(),
        "nothing before the first change"
    );

    w.stop();
    db.drop_db().await;
}

/// A minimal CSV reader (RFC 4180 quoting).
fn parse_csv(text: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut row = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            ('"', true) => quoted = false,
            ('"', false) if field.is_empty() => quoted = true,
            (',', false) => row.push(std::mem::take(&mut field)),
            ('\n', false) => {
                row.push(std::mem::take(&mut field));
                rows.push(std::mem::take(&mut row));
            }
            (c, _) => field.push(c),
        }
    }
    assert!(!quoted, "an unterminated quote");
    if !field.is_empty() || !row.is_empty() {
        row.push(field);
        rows.push(row);
    }
    rows
}

/// The test tables in `db`, and a waltail archiving them into a local
/// folder in objects of 5 changes: (pipeline, waltail, the folder).
async fn local_archive(db: &TestDb, name: &str) -> (String, Waltail, std::path::PathBuf) {
    db.exec(TABLES).await;
    let pipeline = unique(name).replace('_', "-");
    let mut w = Waltail::new(db, &pipeline, "public.orders,public.customers");
    let archive = w.dir.path().join("archive");
    w.set("WALTAIL_DESTINATION_TYPE", "file")
        .set("WALTAIL_DESTINATION_PATH", archive.to_str().unwrap())
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "5");
    (pipeline, w, archive)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_local_folder_archive_answers_in_every_format_skips_pruned_objects_and_points_at_errors()
{
    let db = TestDb::new("queryfile").await;
    let (pipeline, mut w, archive) = local_archive(&db, "qf").await;
    w.start();
    mixed_workload(&db, 51, 40, 0).await;
    let root = archive.clone();
    let changes = wait_replay_equals(&db, async || file_objects(&root), None, &pipeline).await;
    w.stop();
    let customers = Table {
        pg: "id, name, since::text, score::float8",
        query: "id, name, CAST(since AS VARCHAR), CAST(score AS DOUBLE)",
        ..CUSTOMERS
    };
    for t in [&ORDERS, &customers] {
        assert_query_equals_source(&w, &db, t, "from a local folder").await;
    }

    // CSV and JSON parse, and say the same.
    let sql = "SELECT id, customer, status, CAST(total AS VARCHAR) AS total, items FROM public.orders ORDER BY id";
    let (status, csv, stderr) = w.output(&["query", "--format", "csv", sql]);
    assert!(status.success(), "{stderr}");
    let csv = parse_csv(&csv);
    assert_eq!(csv[0], ["id", "customer", "status", "total", "items"]);
    let json_rows = query_json(&w, &[], sql);
    assert_eq!(csv.len() - 1, json_rows.len());
    for (c, j) in csv[1..].iter().zip(&json_rows) {
        assert_eq!(c[0], j[0].to_string());
        assert_eq!(c[1], j[1].as_str().unwrap());
        assert_eq!(c[3], j[3].as_str().unwrap());
        // The jsonb column is JSON text in both, with its quotes intact.
        let items: Value = serde_json::from_str(&c[4]).unwrap_or(Value::Null);
        let j_items: Value = j[4]
            .as_str()
            .map(|s| serde_json::from_str(s).unwrap())
            .unwrap_or(Value::Null);
        assert_eq!(items, j_items);
    }
    let (status, ndjson, stderr) = w.output(&["query", "--format", "ndjson", sql]);
    assert!(status.success(), "{stderr}");
    let lines: Vec<Value> = ndjson
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), json_rows.len());
    let (status, table, _) = w.output(&["query", "--format", "table", sql]);
    assert!(status.success());
    assert!(table.contains("| id"), "{table}");
    assert!(
        table.contains(&format!("({} rows)", json_rows.len())),
        "{table}"
    );
    // SQL from a file and from stdin, several statements.
    let file = w.dir.path().join("q.sql");
    std::fs::write(
        &file,
        "SELECT 1 AS one;\nSELECT count(*) AS n FROM waltail.changes;\n",
    )
    .unwrap();
    let (status, out, stderr) =
        w.output(&["query", "--format", "csv", "-f", file.to_str().unwrap()]);
    assert!(status.success(), "{stderr}");
    assert_eq!(out, format!("one\n1\nn\n{}\n", changes.len()));
    let mut child = Command::new(bin())
        .args(["query", "--format", "csv", "-"])
        .current_dir(w.dir.path())
        .envs(w.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(
        child.stdin.as_mut().unwrap(),
        b"SELECT count(*) AS n FROM history.public.orders",
    )
    .unwrap();
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    let orders = changes
        .iter()
        .filter(|c| c["table"] == "public.orders")
        .count();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("n\n{orders}\n")
    );

    // A reader that goes away after one line: quiet, exit 0.
    for format in ["csv", "table", "json", "ndjson"] {
        let mut child = Command::new(bin())
            .args([
                "query",
                "--format",
                format,
                "SELECT a.seq, b.seq, a.data FROM waltail.changes a CROSS JOIN waltail.changes b",
            ])
            .current_dir(w.dir.path())
            .envs(w.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert!(!first.is_empty());
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        let status = child.wait().unwrap();
        assert!(status.success(), "{format}: {status}: {stderr}");
        assert_eq!(stderr, "", "{format}: a closed pipe is not an error");
    }

    // A SQL error: the message, the line and a caret under the place.
    let (status, _, stderr) = w.output(&["query", "SELECT id,\n       nope FROM public.orders"]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("nope"), "{stderr}");
    assert!(stderr.contains("at line 2, column 8"), "{stderr}");
    assert!(
        stderr.contains("  2 |        nope FROM public.orders\n    |        ^^^^"),
        "{stderr}"
    );
    let (status, _, stderr) = w.output(&["query", "SELECT * FORM public.orders"]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("at line 1, column 10"), "{stderr}");
    assert!(
        stderr.contains("  1 | SELECT * FORM public.orders\n    |          ^"),
        "{stderr}"
    );
    let (status, _, stderr) = w.output(&["query", "SELECT * FROM public.nope"]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("at line 1, column 15"), "{stderr}");

    // Pruning: an unreadable object dated 2020 with seqs far ahead. A query
    // that needs it fails on it; filters on seq or date skip it unread.
    let total = changes.len();
    let junk = archive.join(format!("2020/01/01/{pipeline}-900000-900009.ndjson"));
    std::fs::create_dir_all(junk.parent().unwrap()).unwrap();
    std::fs::write(&junk, "this is not an envelope\n").unwrap();
    let (status, _, stderr) = w.output(&["query", "SELECT count(*) FROM waltail.changes"]);
    assert!(
        !status.success(),
        "the junk object is read without a filter"
    );
    assert!(stderr.contains("900000-900009.ndjson line 1"), "{stderr}");
    for sql in [
        "SELECT count(*) FROM waltail.changes WHERE seq < 900000",
        "SELECT count(*) FROM waltail.changes WHERE seq BETWEEN 1 AND 899999",
        "SELECT count(*) FROM waltail.changes WHERE date > DATE '2020-01-01'",
        "SELECT count(*) FROM waltail.changes WHERE date >= '2021-06-01' AND op <> 'x'",
    ] {
        assert_eq!(scalar(&w, &[], sql), total as i64, "{sql}");
    }
    assert_eq!(
        scalar(
            &w,
            &[],
            "SELECT count(*) FROM history.public.orders WHERE _seq <= 899999"
        ),
        orders as i64
    );
    std::fs::remove_file(&junk).unwrap();

    // Compacted, with --at by time on file modification times.
    compact(&w);
    for t in [&ORDERS, &customers] {
        assert_query_equals_source(&w, &db, t, "after compaction, from a local folder").await;
    }
    // The date partition is the date in the object's key, as in the tail.
    let mut by_date: std::collections::BTreeMap<String, i64> = Default::default();
    for o in file_objects(&archive)
        .iter()
        .filter(|o| o.key.ends_with(".ndjson"))
    {
        let date = o.key[..10].replace('/', "-");
        let n = o
            .body
            .lines()
            .filter(|l| l.contains("\"table\":\"public.orders\""))
            .count();
        *by_date.entry(date).or_default() += n as i64;
    }
    let got: std::collections::BTreeMap<String, i64> = query_json(
        &w,
        &[],
        "SELECT CAST(date AS VARCHAR), count(*) FROM history.public.orders GROUP BY date",
    )
    .into_iter()
    .map(|r| (r[0].as_str().unwrap().to_string(), r[1].as_i64().unwrap()))
    .collect();
    by_date.retain(|_, n| *n > 0);
    assert_eq!(got, by_date, "history rows by date partition");
    let first = by_date.keys().next().unwrap().clone();
    assert_eq!(
        scalar(
            &w,
            &[],
            &format!("SELECT count(*) FROM history.public.orders WHERE date = '{first}'")
        ),
        by_date[&first]
    );
    db.drop_db().await;
}

/// Queries while `waltail compact` replaces the latest view (a local
/// folder, three rounds of new changes then a compaction): every query
/// either answers exactly the source's row count or fails saying to run it
/// again (or to complete the compaction); never a wrong count.
#[tokio::test(flavor = "multi_thread")]
async fn queries_during_a_compaction_answer_right_or_say_to_run_again() {
    let db = TestDb::new("queryrace").await;
    let (pipeline, mut w, archive) = local_archive(&db, "qr").await;
    let (mut answered, mut refused) = (0, 0);
    for round in 0..3u64 {
        w.start();
        mixed_workload(&db, 70 + round, 40, 0).await;
        let root = archive.clone();
        wait_replay_equals(&db, async || file_objects(&root), None, &pipeline).await;
        w.stop();
        let expected = db.rows("orders").await.len() as i64;
        let mut compacting = w.command(&["compact"]).spawn().unwrap();
        let mut after = 0;
        // Queries while it runs, and two after it ended.
        while after < 2 {
            if compacting.try_wait().unwrap().is_some() {
                after += 1;
            }
            let (status, stdout, stderr) = w.output(&[
                "query",
                "--format",
                "csv",
                "SELECT count(*) FROM public.orders",
            ]);
            if status.success() {
                let got: i64 = stdout.lines().nth(1).unwrap().trim().parse().unwrap();
                assert_eq!(got, expected, "round {round}: a wrong count\n{stderr}");
                answered += 1;
            } else {
                assert!(
                    stderr.contains("run the query again") || stderr.contains("to complete it"),
                    "round {round}: failed without saying to run it again:\n{stderr}"
                );
                refused += 1;
            }
        }
        assert!(compacting.wait().unwrap().success(), "round {round}");
    }
    eprintln!("{answered} queries answered, {refused} said to run again");
    assert!(answered >= 6);
}

/// `destination.compression`: an archive written as gzip, then zstd, then
/// plain NDJSON (the setting changed between runs) holds `.ndjson.gz`,
/// `.ndjson.zst` and `.ndjson` objects with the matching Content-Encoding,
/// which follow the contract once decoded; DuckDB's `read_ndjson_auto` and
/// Spark read all three from a copy of the archive, and `query` and `compact`
/// answer what the tables hold, before and after compaction.
#[tokio::test(flavor = "multi_thread")]
async fn an_archive_of_gzip_zstd_and_plain_objects_reads_everywhere() {
    let db = TestDb::new("codecs").await;
    create_tables(&db).await;
    let pipeline = unique("cz").replace('_', "-");
    let prefix = unique("codecs");
    let mut w = Waltail::new(&db, &pipeline, "public.orders,public.customers");
    w.s3(&prefix).set("WALTAIL_DELIVERY_BATCH_SIZE", "5");
    for (round, codec) in ["gzip", "zstd", "none"].into_iter().enumerate() {
        w.set("WALTAIL_DESTINATION_COMPRESSION", codec);
        w.start();
        mixed_workload(&db, 70 + round as u64, 25, 0).await;
        all_archived(&db, &prefix, &pipeline).await;
        w.stop();
    }
    let objects = ndjson_objects(&prefix).await;
    let changes = checked_changes(&objects, Some(&prefix), &pipeline);
    for (suffix, encoding) in [
        (".ndjson.gz", Some("gzip")),
        (".ndjson.zst", Some("zstd")),
        (".ndjson", None),
    ] {
        let of_kind: Vec<&Object> = objects.iter().filter(|o| o.key.ends_with(suffix)).collect();
        assert!(!of_kind.is_empty(), "no {suffix} object");
        for o in of_kind {
            assert_eq!(o.content_encoding.as_deref(), encoding, "{}", o.key);
            assert_eq!(
                o.content_type.as_deref(),
                Some("application/x-ndjson"),
                "{}",
                o.key
            );
        }
    }

    // DuckDB reads every object of the copy, each decoded by its name.
    let dir = tempfile::tempdir().unwrap();
    download(&prefix, dir.path()).await;
    let glob = dir.path().join("*/*/*/*.ndjson*");
    let rows = duck(&format!(
        "SELECT count(*), count(DISTINCT seq), max(seq) FROM read_ndjson_auto('{}')",
        glob.display()
    ));
    let n = changes.len() as i64;
    assert_eq!(rows[0], [json!(n), json!(n), json!(n)]);
    // So does Spark, decoding each by its name with Hadoop's codecs.
    let spark = spark_read(&glob);
    let per_suffix = |suffix: &str| {
        objects
            .iter()
            .filter(|o| o.key.ends_with(suffix))
            .map(|o| o.body.lines().count())
            .sum::<usize>()
    };
    assert_eq!(
        spark,
        json!({
            "changes": n, "seqs": n, "max_seq": n, "corrupt": 0,
            "by_suffix": {
                ".ndjson.gz": per_suffix(".ndjson.gz"),
                ".ndjson.zst": per_suffix(".ndjson.zst"),
                ".ndjson": per_suffix(".ndjson"),
            }
        })
    );

    for t in [&ORDERS, &CUSTOMERS] {
        assert_query_equals_source(&w, &db, t, "before compaction").await;
    }
    assert_eq!(scalar(&w, &[], "SELECT count(*) FROM waltail.changes"), n);
    compact(&w);
    for t in [&ORDERS, &CUSTOMERS] {
        assert_query_equals_source(&w, &db, t, "after compaction").await;
    }
    assert_eq!(
        scalar(&w, &[], "SELECT count(*) FROM history.public.orders"),
        changes
            .iter()
            .filter(|c| c["table"] == "public.orders")
            .count() as i64
    );
    db.drop_db().await;
}

/// A hand-written archive object of `public.t (id bigint key, n integer)`:
/// an insert of (seq, seq * 10) for each seq.
fn write_inserts(root: &std::path::Path, seqs: std::ops::RangeInclusive<u64>) {
    let day = root.join("2026/12/04");
    std::fs::create_dir_all(&day).unwrap();
    let name = format!("p-{}-{}.ndjson", seqs.start(), seqs.end());
    std::fs::write(day.join(name), inserts(seqs)).unwrap();
}

/// The NDJSON of [`write_inserts`]: an insert of (seq, seq * 10) a line.
fn inserts(seqs: std::ops::RangeInclusive<u64>) -> String {
    seqs.map(|seq| {
        json!({"op": "insert", "table": "public.t", "data": {"id": seq, "n": seq * 10},
               "old": null, "seq": seq, "idempotency_key": format!("k{seq}"),
               "commit_lsn": format!("0/{:X}", seq * 8)})
        .to_string()
            + "\n"
    })
    .collect()
}

/// The schema record of `public.t (id bigint key, n integer)`.
fn tiny_schema() -> String {
    json!({"table": "public.t", "version": 1, "replica_identity": "default", "columns": [
        {"name": "id", "type": "bigint", "type_oid": 20, "type_modifier": -1, "key": true},
        {"name": "n", "type": "integer", "type_oid": 23, "type_modifier": -1, "key": false}]})
    .to_string()
}

/// The schema record of a hand-written archive in `root` of `public.t (id
/// bigint key, n integer)` (see [`write_inserts`]); returns its folder.
fn tiny_archive(root: &std::path::Path) -> std::path::PathBuf {
    let dir = root.join("_schemas/public.t");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("1.json"), tiny_schema()).unwrap();
    dir
}

/// Adds a `note text` column to the archive of [`tiny_archive`] (its schema
/// record 2) and an insert at `seq` that has it (`note` = `added`).
fn add_note_column(root: &std::path::Path, seq: u64) {
    let schema2 = json!({"table": "public.t", "version": 2, "replica_identity": "default", "columns": [
        {"name": "id", "type": "bigint", "type_oid": 20, "type_modifier": -1, "key": true},
        {"name": "n", "type": "integer", "type_oid": 23, "type_modifier": -1, "key": false},
        {"name": "note", "type": "text", "type_oid": 25, "type_modifier": -1, "key": false}]});
    std::fs::write(root.join("_schemas/public.t/2.json"), schema2.to_string()).unwrap();
    let line = json!({"op": "insert", "table": "public.t", "data": {"id": seq, "n": seq * 10, "note": "added"},
        "old": null, "seq": seq, "idempotency_key": format!("k{seq}"), "commit_lsn": format!("0/{:X}", seq * 8)});
    std::fs::write(
        root.join(format!("2026/12/04/p-{seq}-{seq}.ndjson")),
        format!("{line}\n"),
    )
    .unwrap();
}

/// The environment of waltail over the archive of [`tiny_archive`], its
/// state folder `root/state`.
fn tiny_env(root: &std::path::Path) -> Vec<(&'static str, std::path::PathBuf)> {
    vec![
        ("WALTAIL_PIPELINE", "p".into()),
        (
            "WALTAIL_SOURCE_URL",
            "postgres://nobody@127.0.0.1:1/none".into(),
        ),
        ("WALTAIL_SOURCE_TABLES", "public.t".into()),
        ("WALTAIL_DESTINATION_TYPE", "file".into()),
        ("WALTAIL_DESTINATION_PATH", root.to_path_buf()),
        ("WALTAIL_STATE_DIR", root.join("state")),
    ]
}

/// Compacts the archive of [`tiny_archive`] in `root`.
fn compact_tiny(root: &std::path::Path) {
    let out = Command::new(bin())
        .arg("compact")
        .envs(tiny_env(root))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// The prompt (on a terminal: `script` gives it one) keeps the tables it
/// built while the archive is unchanged, and a statement after a new
/// object arrived sees it; `\timing` prints each statement's phases.
#[test]
fn the_prompt_keeps_its_tables_while_the_archive_is_unchanged_and_sees_new_changes() {
    let root = tempfile::tempdir().unwrap();
    tiny_archive(root.path());
    write_inserts(root.path(), 1..=2);
    let env = tiny_env(root.path());
    let mut child = Command::new("script")
        .args([
            "-qfec",
            &format!("{} query --format csv", bin()),
            "/dev/null",
        ])
        .envs(env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("script (util-linux) runs the prompt on a terminal");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let mut stdout = child.stdout.take().unwrap();
    let reader = {
        let seen = std::sync::Arc::clone(&seen);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                seen.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };
    let mut stdin = child.stdin.take().unwrap();
    let mut say = |line: &str| {
        std::io::Write::write_all(&mut stdin, format!("{line}\n").as_bytes()).unwrap();
    };
    // The text after the prompt's `count` "Time:" line, once it is there.
    let wait_for = |what: &str, count: usize| -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let text = seen.lock().unwrap().clone();
            if text.matches(what).count() >= count {
                return text;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {count}x {what:?} from the prompt:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let times = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with("Time: "))
            .map(str::to_string)
            .collect()
    };
    wait_for("waltail> ", 1);
    say("\\timing");
    wait_for("timing is on", 1);
    say("SELECT count(*) AS rows, sum(n) AS total FROM public.t;");
    let text = wait_for("Time: ", 1);
    assert!(text.contains("rows,total\r\n2,30\r\n"), "{text}");
    say("SELECT count(*) AS rows, sum(n) AS total FROM public.t;");
    let text = wait_for("Time: ", 2);
    let t = times(&text);
    assert!(!t[0].contains("tables kept"), "{t:?}");
    assert!(
        t[1].contains("unchanged: tables kept") && t[1].contains("plan ") && t[1].contains("run "),
        "{t:?}"
    );
    // A lone query ran on the last snapshot while the snapshot was taken.
    assert!(t[1].contains("the statement ran meanwhile"), "{t:?}");
    // A new object: the next statement takes a new snapshot and sees it.
    write_inserts(root.path(), 3..=3);
    say("SELECT count(*) AS rows, sum(n) AS total FROM public.t;");
    let text = wait_for("Time: ", 3);
    // The answer of the early run on the last snapshot (2,30) is dropped.
    assert!(text.contains("rows,total\r\n3,60\r\n"), "{text}");
    assert_eq!(text.matches("rows,total\r\n2,30\r\n").count(), 2, "{text}");
    assert!(!times(&text)[2].contains("tables kept"), "{text}");
    // A compaction commits to the table's Delta logs: the next statement
    // reads the new snapshot (the same answer, now from Parquet), and the
    // one after keeps its tables again.
    compact_tiny(root.path());
    // The sixth reads `n` from memory: the fifth, a statement read again,
    // decoded it whole and kept it (`--keep-decoded`).
    for (i, kept) in [(4, false), (5, true), (6, true)] {
        say("SELECT count(*) AS rows, sum(n) AS total FROM public.t;");
        let text = wait_for("Time: ", i);
        assert_eq!(
            text.matches("rows,total\r\n3,60\r\n").count(),
            i - 2,
            "{text}"
        );
        assert_eq!(times(&text)[i - 1].contains("tables kept"), kept, "{text}");
    }
    // The plan shows it: the kept rows, not the Parquet files.
    say("EXPLAIN SELECT count(*) AS rows, sum(n) AS total FROM public.t;");
    let text = wait_for("Time: ", 7);
    let plan = &text[text.rfind("plan_type").expect("the EXPLAIN")..];
    assert!(
        plan.contains("partition_sizes=") && !plan.contains("file_type=parquet"),
        "{plan}"
    );
    // Settings made at the prompt stay for the statements after them.
    say("SET datafusion.execution.batch_size = 1234;");
    wait_for("Time: ", 8);
    say(
        "SELECT value FROM information_schema.df_settings WHERE name = 'datafusion.execution.batch_size';",
    );
    let text = wait_for("Time: ", 9);
    assert!(text.contains("value\r\n1234\r\n"), "{text}");
    // A column added (a new schema record, and a change that has it): the
    // next statement sees it, though no log moved.
    add_note_column(root.path(), 4);
    say("SELECT count(*) AS rows, max(note) AS note FROM public.t;");
    let text = wait_for("Time: ", 10);
    assert!(text.contains("rows,note\r\n4,added\r\n"), "{text}");
    // Compacted again: the new files are read, not the columns kept from
    // the old ones.
    compact_tiny(root.path());
    for i in [11, 12] {
        say("SELECT count(*) AS rows, sum(n) AS total FROM public.t;");
        let text = wait_for("Time: ", i);
        assert_eq!(
            text.matches("rows,total\r\n4,100\r\n").count(),
            i - 10,
            "{text}"
        );
    }
    say("\\q");
    drop(stdin);
    let status = child.wait().unwrap();
    reader.join().unwrap();
    assert!(status.success(), "{}", seen.lock().unwrap());
}

/// A statement read again decodes its columns once and keeps them, so a
/// third reads memory, not Parquet, with the same answer; with
/// `--keep-decoded 0` every statement reads Parquet.
#[test]
fn columns_read_again_are_kept_in_memory_unless_told_not_to() {
    let root = tempfile::tempdir().unwrap();
    tiny_archive(root.path());
    write_inserts(root.path(), 1..=50);
    let env = tiny_env(root.path());
    compact_tiny(root.path());
    let sql = "SELECT sum(n) AS total FROM public.t WHERE id > 10";
    let script = format!("{sql}; {sql}; {sql}; EXPLAIN {sql}");
    for (extra, parquet) in [(&[][..], false), (&["--keep-decoded", "0"][..], true)] {
        let out = Command::new(bin())
            .args(["query", "--format", "csv"])
            .args(extra)
            .arg(&script)
            .envs(env.clone())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        // 10 x (11 + ... + 50)
        assert_eq!(
            text.matches("total\n12200\n").count(),
            3,
            "{extra:?}: {text}"
        );
        let plan = &text[text.find("plan_type").expect("the EXPLAIN")..];
        assert_eq!(
            plan.contains("file_type=parquet"),
            parquet,
            "{extra:?}: {plan}"
        );
        assert_eq!(
            plan.contains("partition_sizes="),
            !parquet,
            "{extra:?}: {plan}"
        );
    }
}

/// One `waltail query` keeps the Delta log entries it read in the state
/// folder for the next: an unchanged archive is answered without reading a
/// log; a compaction since, or a table's folders deleted and compacted
/// again up to the very same log versions, makes the next query read the
/// logs afresh and answer from the new files.
#[test]
fn a_query_keeps_the_delta_logs_it_read_for_the_next_and_never_a_stale_one() {
    let root = tempfile::tempdir().unwrap();
    let schemas = tiny_archive(root.path());
    let state = root.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let mut env = tiny_env(root.path());
    env.push(("WALTAIL_LOG", "waltail=debug".into()));
    let run = |args: &[&str]| -> (String, String) {
        let out = Command::new(bin())
            .args(args)
            .envs(env.clone())
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        );
        assert!(out.status.success(), "{args:?}:\n{stdout}\n{stderr}");
        (stdout, stderr)
    };
    let count = || {
        run(&[
            "query",
            "--format",
            "csv",
            "SELECT count(*) AS rows, sum(n) AS total FROM public.t",
        ])
    };
    let logs_read = |stderr: &str| -> usize {
        let line = stderr
            .lines()
            .find(|l| l.contains("snapshot of the archive taken"))
            .unwrap_or_else(|| panic!("no snapshot line:\n{stderr}"));
        let n = line.split("logs_read=").nth(1).unwrap();
        n.split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    // Whether the logs were checked and the NDJSON listed while the schema
    // records were (the shapes kept matched the records listed).
    let early = |stderr: &str| stderr.contains(" early=true");
    let kept = state.join("p.query.json");

    write_inserts(root.path(), 1..=2);
    run(&["compact"]);
    let (out, err) = count();
    assert_eq!(out, "rows,total\n2,30\n");
    assert_eq!(logs_read(&err), 1, "nothing kept yet:\n{err}");
    assert!(!early(&err), "{err}");
    assert!(kept.exists(), "the entries are kept in {}", kept.display());
    // Unchanged: the kept entry answers, no log is read, and the kept
    // schema records let the checks run beside their listing.
    let (out, err) = count();
    assert_eq!(out, "rows,total\n2,30\n");
    assert_eq!(logs_read(&err), 0, "{err}");
    assert!(early(&err), "{err}");

    // A column added (a new schema record, and a change that has it): the
    // shapes kept no longer match, and the next query reads the new one.
    add_note_column(root.path(), 3);
    let (out, err) = run(&[
        "query",
        "--format",
        "csv",
        "SELECT id, note FROM public.t ORDER BY id",
    ]);
    assert_eq!(out, "id,note\n1,\n2,\n3,added\n", "{err}");
    assert!(!early(&err), "{err}");
    let (_, err) = count();
    assert!(early(&err), "the new record is kept too: {err}");
    std::fs::remove_file(schemas.join("2.json")).unwrap();
    std::fs::remove_file(root.path().join("2026/12/04/p-3-3.ndjson")).unwrap();
    let (out, err) = count();
    assert_eq!(out, "rows,total\n2,30\n", "{err}");

    // A compaction since: the logs moved on and are read again.
    write_inserts(root.path(), 3..=3);
    run(&["compact"]);
    let (out, err) = count();
    assert_eq!(out, "rows,total\n3,60\n");
    assert_eq!(logs_read(&err), 1, "{err}");
    let versions = |role: &str| -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(root.path().join(role).join("public/t/_delta_log"))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                .filter(|n| n.ends_with(".json"))
                .collect();
        v.sort();
        v
    };
    let before = (versions("parquet"), versions("latest"));

    // The table's folders deleted and compacted again, in as many runs:
    // the same log versions, other commit files. The kept entry names
    // files that are gone; it must not be used.
    std::fs::remove_dir_all(root.path().join("parquet")).unwrap();
    std::fs::remove_dir_all(root.path().join("latest")).unwrap();
    for f in std::fs::read_dir(root.path().join("2026/12/04")).unwrap() {
        std::fs::remove_file(f.unwrap().path()).unwrap();
    }
    write_inserts(root.path(), 1..=3);
    run(&["compact"]);
    write_inserts(root.path(), 4..=4);
    run(&["compact"]);
    assert_eq!(
        (versions("parquet"), versions("latest")),
        before,
        "the same versions again"
    );
    let (out, err) = count();
    assert_eq!(out, "rows,total\n4,100\n", "{err}");
    assert_eq!(logs_read(&err), 1, "{err}");
    let (out, err) = count();
    assert_eq!(out, "rows,total\n4,100\n");
    assert_eq!(logs_read(&err), 0, "{err}");

    // A damaged file is ignored and replaced.
    std::fs::write(&kept, b"{").unwrap();
    let (out, err) = count();
    assert_eq!(out, "rows,total\n4,100\n");
    assert_eq!(logs_read(&err), 1, "{err}");
    let (_, err) = count();
    assert_eq!(logs_read(&err), 0, "{err}");
}

/// A query of an S3 archive asks the store for no compacted file's
/// metadata, which would be a HEAD a file and query: the Delta logs give
/// the files' sizes. Through a proxy that records the requests, two
/// queries (the first reads the logs, the second keeps them from the state
/// folder) read the latest view's and the history's files and never ask
/// for their metadata.
#[tokio::test(flavor = "multi_thread")]
async fn a_query_of_s3_asks_no_metadata_of_the_compacted_files() {
    let prefix = unique("heads");
    let store = admin_store();
    let put = |key: String, body: String| {
        let store = store.clone();
        async move {
            store
                .put(&ObjectPath::from(key), body.into())
                .await
                .unwrap()
        }
    };
    put(format!("{prefix}/_schemas/public.t/1.json"), tiny_schema()).await;
    for (first, last) in [(1u64, 50u64), (51, 100)] {
        let key = format!("{prefix}/2026/12/04/p-{first}-{last}.ndjson");
        put(key, inserts(first..=last)).await;
    }
    let mut w = Waltail::without_db("p", "public.t");
    w.s3(&prefix);
    let (status, stdout, stderr) = w.output(&["compact"]);
    assert!(status.success(), "{stdout}{stderr}");
    let proxy = Proxy::start(s3().endpoint.trim_start_matches("http://").parse().unwrap());
    w.set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url());
    for _ in 0..2 {
        let sql = "SELECT count(*) AS c, sum(n) AS s FROM public.t \
                   UNION ALL SELECT count(*), sum(n) FROM history.public.t";
        let (status, stdout, stderr) = w.output(&["query", "--format", "csv", sql]);
        assert!(status.success(), "{stdout}{stderr}");
        let rows: Vec<&str> = stdout.lines().skip(1).collect();
        assert_eq!(rows, ["100,50500", "100,50500"], "{stdout}");
    }
    let requests = proxy.requests();
    let data_files = |method: &str| {
        requests
            .iter()
            .filter(|l| {
                l.starts_with(method) && l.contains(".parquet") && !l.contains("_delta_log")
            })
            .count()
    };
    assert!(data_files("GET ") >= 4, "the files are read: {requests:#?}");
    assert_eq!(data_files("HEAD "), 0, "{requests:#?}");
}
