//! What Postgres committed is what the archive holds: every type's JSON form,
//! unchanged TOAST, replica identities, TRUNCATE, partitions, schema records
//! and DDL. Real Postgres, the real binary, the local-folder destination.

#![recursion_limit = "256"]

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// Starts a pipeline on `tables`, runs `sql` (after streaming began), waits
/// until `n` changes are archived and returns them (contract-checked).
async fn archive_of(db: &TestDb, tables: &str, sql: &[&str], n: usize) -> (Waltail, Vec<Value>) {
    let pipeline = unique("fid").replace('_', "-");
    let mut w = Waltail::new(db, &pipeline, tables);
    w.start();
    for s in sql {
        db.exec(s).await;
    }
    let root = w.dir.path().join("waltail-archive");
    let start = std::time::Instant::now();
    let changes = loop {
        let changes = checked_changes(&file_objects(&root), None, &pipeline);
        if changes.len() >= n {
            break changes;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "only {} of {n} changes:\n{}",
            changes.len(),
            w.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(changes.len(), n, "{changes:#?}");
    w.stop();
    (w, changes)
}

/// A table with a column of every type the archive documents a form for.
const TYPE_TABLE: &str = "CREATE EXTENSION IF NOT EXISTS hstore;
         CREATE TYPE mood AS ENUM ('sad', 'happy');
         CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
         CREATE TYPE pair AS (a int, b text);
         CREATE TABLE ty (
           id int PRIMARY KEY, i2 smallint, i4 integer, i8 bigint, f4 real, f8 double precision,
           f8nan double precision, f8inf double precision, num numeric, num_big numeric, num_nan numeric,
           money money, b boolean, t text, vc varchar(10), ch char(3), by bytea, u uuid, j json, jb jsonb,
           d date, dinf date, tm time, tmz timetz, ts timestamp, tstz timestamptz, tsinf timestamptz,
           iv interval, ip inet, cidr cidr, mac macaddr, m mood, dom posint, comp pair, r int4range,
           h hstore, tsv tsvector, x xml, bits bit(4), vbits varbit, o oid, pt point, bx box,
           arr2 int[][], tarr text[], earr mood[], domarr posint[], jarr jsonb[], tsarr timestamptz[]
         )";

/// A row of it with a value in every column.
const TYPE_ROW: &str = r#"INSERT INTO ty VALUES (1, -32768, 2147483647, 9223372036854775807, 1.5, 0.1,
        'NaN', '-Infinity', 19.990, 123456789012345678901234.5, 'NaN',
        12.34, true, E'a"b\\c\nd', 'ünï', 'ab', '\xdeadbeef', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
        '{"a": 1, "b": [true, null]}', '{"b": 2, "a": "x"}',
        '2024-02-29', 'infinity', '13:14:15.5', '13:14:15+02', '2024-03-01 12:34:56.789',
        '2024-03-01 12:34:56.789+05:30', 'infinity',
        '1 year 2 mons 3 days 04:05:06.5', '192.168.0.1/24', '10.0.0.0/8', '08:00:2b:01:02:03',
        'happy', 5, ROW(1, 'x y'), '[1,5)', 'a=>1, b=>NULL', 'a fat cat', '<a>1</a>', B'1010', B'101',
        12345, '(1,2)', '((0,0),(1,1))', '{{1,2},{3,NULL}}', '{"a b","NULL",NULL,"q\"uote"}',
        '{sad,happy}', '{1,2}', ARRAY['{"k": 1}'::jsonb, NULL], ARRAY['2024-01-01 00:00:00+00'::timestamptz])"#;

#[tokio::test]
async fn every_type_has_its_documented_json_form() {
    let db = TestDb::new("types").await;
    db.exec(TYPE_TABLE).await;
    let insert = TYPE_ROW;
    let (_w, changes) = archive_of(
        &db,
        "public.ty",
        &[insert, "INSERT INTO ty (id) VALUES (2)"],
        2,
    )
    .await;
    let data = &changes[0]["data"];
    let expected = json!({
        "id": 1, "i2": -32768, "i4": 2147483647, "i8": 9223372036854775807_i64,
        "f4": 1.5, "f8": 0.1, "f8nan": "NaN", "f8inf": "-Infinity",
        "num": 19.99, "num_big": "123456789012345678901234.5", "num_nan": "NaN",
        "money": "$12.34", "b": true, "t": "a\"b\\c\nd", "vc": "ünï", "ch": "ab ",
        "by": "3q2+7w==", "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "j": {"a": 1, "b": [true, null]}, "jb": {"a": "x", "b": 2},
        "d": "2024-02-29", "dinf": "infinity", "tm": "13:14:15.5", "tmz": "13:14:15+02",
        "ts": "2024-03-01T12:34:56.789", "tstz": "2024-03-01T07:04:56.789+00:00", "tsinf": "infinity",
        "iv": "P1Y2M3DT4H5M6.5S", "ip": "192.168.0.1/24", "cidr": "10.0.0.0/8", "mac": "08:00:2b:01:02:03",
        "m": "happy", "dom": 5, "comp": "(1,\"x y\")", "r": "[1,5)", "h": {"a": "1", "b": null},
        "tsv": "'a' 'cat' 'fat'", "x": "<a>1</a>", "bits": "1010", "vbits": "101", "o": 12345,
        "pt": "(1,2)", "bx": "(1,1),(0,0)", "arr2": [[1, 2], [3, null]],
        "tarr": ["a b", "NULL", null, "q\"uote"], "earr": ["sad", "happy"], "domarr": [1, 2],
        "jarr": [{"k": 1}, null], "tsarr": ["2024-01-01T00:00:00+00:00"]
    });
    for (k, v) in expected.as_object().unwrap() {
        assert_eq!(&data[k], v, "column {k}");
    }
    assert_eq!(
        data.as_object().unwrap().len(),
        expected.as_object().unwrap().len()
    );
    // A row of NULLs: every column present, null.
    let nulls = &changes[1]["data"];
    assert!(
        nulls
            .as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| k == "id" || v.is_null()),
        "{nulls}"
    );
    assert_eq!(
        nulls.as_object().unwrap().len(),
        expected.as_object().unwrap().len()
    );
    db.drop_db().await;
}

/// A row that a backfill reads (`COPY` text) is, byte for byte, the `data`
/// its insert produced in the stream (pgoutput text), for every type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfilled_row_is_byte_for_byte_its_streamed_insert() {
    let db = TestDb::new("typesread").await;
    db.exec(TYPE_TABLE).await;
    let (mut w, _) = archive_of(
        &db,
        "public.ty",
        &[TYPE_ROW, "INSERT INTO ty (id) VALUES (2)"],
        2,
    )
    .await;
    w.spawn(&["backfill", "--yes", "public.ty"]);
    let status = tokio::task::block_in_place(|| w.wait_exit(Duration::from_secs(60)));
    assert!(status.success(), "{}", w.log());
    let root = w.dir.path().join("waltail-archive");
    // `data` as written: envelopes put it between `"data":` and `,"old":`.
    let mut data: std::collections::BTreeMap<(String, String), String> = Default::default();
    for object in file_objects(&root) {
        for line in object.body.lines().filter(|l| l.starts_with("{\"op\"")) {
            let v: Value = serde_json::from_str(line).unwrap();
            let raw = &line[line.find("\"data\":").unwrap() + 7..line.find(",\"old\":").unwrap()];
            data.insert(
                (
                    v["op"].as_str().unwrap().into(),
                    v["data"]["id"].to_string(),
                ),
                raw.to_string(),
            );
        }
    }
    for id in ["1", "2"] {
        let inserted = &data[&("insert".to_string(), id.to_string())];
        let read = data
            .get(&("read".to_string(), id.to_string()))
            .unwrap_or_else(|| panic!("no read event for row {id}: {data:?}"));
        assert_eq!(read, inserted, "row {id}");
    }
    db.drop_db().await;
}

#[tokio::test]
async fn numeric_text_is_written_verbatim() {
    let db = TestDb::new("numeric").await;
    db.exec("CREATE TABLE n (id int PRIMARY KEY, v numeric)")
        .await;
    let pipeline = unique("num").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.n");
    w.start();
    db.exec("INSERT INTO n VALUES (1, 19.990), (2, -0.000001), (3, 1234567890.12345)")
        .await;
    let root = w.dir.path().join("waltail-archive");
    let start = std::time::Instant::now();
    let body = loop {
        let body: String = file_objects(&root)
            .iter()
            .filter(|o| o.key.ends_with(".ndjson"))
            .map(|o| o.body.clone())
            .collect();
        if body.lines().count() == 3 {
            break body;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(body.contains(r#""v":19.990}"#), "{body}");
    assert!(body.contains(r#""v":-0.000001}"#), "{body}");
    assert!(body.contains(r#""v":1234567890.12345}"#), "{body}");
    w.stop();
    db.drop_db().await;
}

#[tokio::test]
async fn unchanged_toast_is_absent_and_full_identity_carries_it() {
    let db = TestDb::new("toast").await;
    // md5 chains do not compress, so 20 kB is stored out of line (TOAST).
    db.exec(
        "CREATE TABLE big (id int PRIMARY KEY, note text, doc text);
         CREATE TABLE bigfull (id int PRIMARY KEY, note text, doc text);
         ALTER TABLE bigfull REPLICA IDENTITY FULL;",
    )
    .await;
    let doc = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 640) g)";
    let (_w, changes) = archive_of(
        &db,
        "public.big,public.bigfull",
        &[
            &format!(
                "INSERT INTO big VALUES (1, 'a', {doc}); INSERT INTO bigfull VALUES (1, 'a', {doc})"
            ),
            "UPDATE big SET note = 'b' WHERE id = 1; UPDATE bigfull SET note = 'b' WHERE id = 1",
        ],
        4,
    )
    .await;
    assert_eq!(changes[0]["data"]["doc"].as_str().unwrap().len(), 640 * 32);
    let upd = &changes[2];
    assert_eq!(upd["table"], "public.big");
    assert_eq!(upd["data"]["note"], "b");
    assert!(
        upd["data"].get("doc").is_none(),
        "unchanged TOAST must be absent, not null: {upd}"
    );
    assert!(upd["old"].is_null());
    let full = &changes[3];
    assert_eq!(full["table"], "public.bigfull");
    assert_eq!(
        full["data"]["doc"].as_str().unwrap().len(),
        640 * 32,
        "FULL identity sends the value"
    );
    assert_eq!(full["old"]["note"], "a");
    db.drop_db().await;
}

#[tokio::test]
async fn replica_identity_decides_what_old_holds() {
    let db = TestDb::new("identity").await;
    db.exec(
        "CREATE TABLE def (id int PRIMARY KEY, v text);
         CREATE TABLE full_ (id int PRIMARY KEY, v text);
         ALTER TABLE full_ REPLICA IDENTITY FULL;
         CREATE TABLE idx (a int NOT NULL, b int NOT NULL, v text);
         CREATE UNIQUE INDEX idx_ab ON idx (a, b);
         ALTER TABLE idx REPLICA IDENTITY USING INDEX idx_ab;",
    )
    .await;
    let (_w, c) = archive_of(
        &db,
        "public.def,public.full_,public.idx",
        &[
            "INSERT INTO def VALUES (1, 'x'); INSERT INTO full_ VALUES (1, 'x'); INSERT INTO idx VALUES (1, 2, 'x')",
            "UPDATE def SET v = 'y'",       // 3: key unchanged: old null
            "UPDATE def SET id = 2",        // 4: key changed: old key
            "UPDATE full_ SET v = 'y'",     // 5: old row
            "UPDATE idx SET v = 'y'",       // 6: index unchanged: old null
            "DELETE FROM def",              // 7
            "DELETE FROM full_",            // 8
            "DELETE FROM idx",              // 9
        ],
        10,
    )
    .await;
    assert!(c[3]["old"].is_null(), "{}", c[3]);
    assert_eq!(c[4]["old"], json!({"id": 1}));
    assert_eq!(c[4]["data"], json!({"id": 2, "v": "y"}));
    assert_eq!(c[5]["old"], json!({"id": 1, "v": "x"}));
    assert!(c[6]["old"].is_null(), "{}", c[6]);
    assert_eq!(
        (c[7]["op"].as_str(), &c[7]["old"]),
        (Some("delete"), &json!({"id": 2}))
    );
    assert_eq!(
        c[8]["old"],
        json!({"id": 1, "v": "y"}),
        "FULL: the whole row"
    );
    assert_eq!(
        c[9]["old"],
        json!({"a": 1, "b": 2}),
        "USING INDEX: the index columns"
    );
    assert!(c[7..].iter().all(|x| x["data"].is_null()));
    db.drop_db().await;
}

#[tokio::test]
async fn truncate_writes_one_line_per_table() {
    let db = TestDb::new("trunc").await;
    db.exec("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY)")
        .await;
    let (_w, c) = archive_of(
        &db,
        "public.a,public.b",
        &[
            "INSERT INTO a VALUES (1); INSERT INTO b VALUES (1)",
            "TRUNCATE a, b",
        ],
        4,
    )
    .await;
    let truncs: Vec<&Value> = c.iter().filter(|x| x["op"] == "truncate").collect();
    assert_eq!(truncs.len(), 2);
    let mut tables: Vec<&str> = truncs
        .iter()
        .map(|x| x["table"].as_str().unwrap())
        .collect();
    tables.sort();
    assert_eq!(tables, ["public.a", "public.b"]);
    assert!(
        truncs
            .iter()
            .all(|x| x["data"].is_null() && x["old"].is_null())
    );
    assert_eq!(truncs[0]["commit_lsn"], truncs[1]["commit_lsn"]);
    assert_ne!(truncs[0]["idempotency_key"], truncs[1]["idempotency_key"]);
    db.drop_db().await;
}

#[tokio::test]
async fn changes_to_partitions_carry_the_parent_name() {
    let db = TestDb::new("parts").await;
    db.exec(
        "CREATE TABLE events (id int, region text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
         CREATE TABLE events_eu PARTITION OF events FOR VALUES IN ('eu');
         CREATE TABLE events_us PARTITION OF events FOR VALUES IN ('us');",
    )
    .await;
    let sql = [
        "INSERT INTO events VALUES (1, 'eu'), (2, 'us')",
        "DELETE FROM events WHERE region = 'us'",
    ];
    if db.server_version().await >= 130000 {
        let (_w, c) = archive_of(&db, "public.events", &sql, 3).await;
        assert!(c.iter().all(|x| x["table"] == "public.events"), "{c:#?}");
    } else {
        // 12 cannot publish a partitioned table: check and run say so and
        // what to do, and the partitions listed instead are archived.
        let w = Waltail::new(&db, &unique("parts").replace('_', "-"), "public.events");
        let (status, stdout, _) = w.output(&["check"]);
        assert!(!status.success(), "{stdout}");
        assert!(
            stdout.contains("public.events is a partitioned table")
                && stdout.contains("list its partitions in source.tables"),
            "{stdout}"
        );
        let (status, _, stderr) = w.output(&["run"]);
        assert!(!status.success(), "{stderr}");
        assert!(
            stderr.contains("cannot publish one") && stderr.contains("list its partitions"),
            "{stderr}"
        );
        let (_w, c) = archive_of(&db, "public.events_eu,public.events_us", &sql, 3).await;
        let tables: Vec<&Value> = c.iter().map(|x| &x["table"]).collect();
        assert_eq!(
            tables,
            ["public.events_eu", "public.events_us", "public.events_us"],
            "{c:#?}"
        );
    }
    db.drop_db().await;
}

#[tokio::test]
async fn ddl_between_changes_gives_new_shapes_and_schema_versions() {
    let db = TestDb::new("ddl").await;
    db.exec("CREATE TABLE s (id int PRIMARY KEY, a int, b text)")
        .await;
    let (w, c) = archive_of(
        &db,
        "public.s",
        &[
            "INSERT INTO s VALUES (1, 1, 'x')",
            "ALTER TABLE s ADD COLUMN c jsonb",
            "INSERT INTO s VALUES (2, 2, 'y', '{\"k\": true}')",
            "ALTER TABLE s DROP COLUMN b",
            "INSERT INTO s VALUES (3, 3, NULL)",
            "ALTER TABLE s RENAME COLUMN a TO aa",
            "INSERT INTO s VALUES (4, 4, NULL)",
            "ALTER TABLE s ALTER COLUMN aa TYPE bigint",
            "INSERT INTO s VALUES (5, 5, NULL)",
        ],
        5,
    )
    .await;
    assert_eq!(c[0]["data"], json!({"id": 1, "a": 1, "b": "x"}));
    assert_eq!(
        c[1]["data"],
        json!({"id": 2, "a": 2, "b": "y", "c": {"k": true}})
    );
    assert_eq!(c[2]["data"], json!({"id": 3, "a": 3, "c": null}));
    assert_eq!(c[3]["data"], json!({"id": 4, "aa": 4, "c": null}));
    assert_eq!(c[4]["data"], json!({"id": 5, "aa": 5, "c": null}));
    let root = w.dir.path().join("waltail-archive");
    let schemas: Vec<Object> = file_objects(&root)
        .into_iter()
        .filter(|o| o.key.starts_with("_schemas/public.s/"))
        .collect();
    let keys: Vec<&str> = schemas.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "_schemas/public.s/1.json",
            "_schemas/public.s/2.json",
            "_schemas/public.s/3.json",
            "_schemas/public.s/4.json",
            "_schemas/public.s/5.json"
        ]
    );
    let last: Value = serde_json::from_str(&schemas[4].body).unwrap();
    assert_eq!(last["version"], 5);
    assert_eq!(last["replica_identity"], "default");
    assert_eq!(
        last["columns"],
        json!([
            {"name": "id", "type": "integer", "type_oid": 23, "type_modifier": -1, "key": true},
            {"name": "aa", "type": "bigint", "type_oid": 20, "type_modifier": -1, "key": false},
            {"name": "c", "type": "jsonb", "type_oid": 3802, "type_modifier": -1, "key": false}
        ])
    );
    // A restart sees the same shape again and records nothing new.
    let mut w = w;
    w.start();
    db.exec("INSERT INTO s VALUES (6, 6, NULL)").await;
    eventually(Duration::from_secs(30), "the 6th change", async || {
        checked_changes(
            &file_objects(&root),
            None,
            &w.env
                .iter()
                .find(|(k, _)| k == "WALTAIL_PIPELINE")
                .unwrap()
                .1,
        )
        .len()
            == 6
    })
    .await;
    w.stop();
    let count = file_objects(&root)
        .iter()
        .filter(|o| o.key.starts_with("_schemas/"))
        .count();
    assert_eq!(count, 5);
    db.drop_db().await;
}

#[tokio::test]
async fn check_warns_about_replica_identity_nothing_with_the_fix() {
    let db = TestDb::new("nothing").await;
    db.exec("CREATE TABLE n (id int PRIMARY KEY); ALTER TABLE n REPLICA IDENTITY NOTHING")
        .await;
    let w = Waltail::new(&db, &unique("nothing").replace('_', "-"), "public.n");
    let (status, stdout, _) = w.output(&["check"]);
    assert!(
        status.success(),
        "a warning does not fail the check:\n{stdout}"
    );
    let line = stdout
        .lines()
        .position(|l| l.contains("WARN") && l.contains("table public.n"))
        .expect(&stdout);
    assert!(
        stdout
            .lines()
            .nth(line + 1)
            .unwrap()
            .contains("REPLICA IDENTITY DEFAULT"),
        "{stdout}"
    );
    db.drop_db().await;
}

/// Protocol 2 (Postgres 14+): a transaction larger than
/// logical_decoding_work_mem is streamed while in progress, buffered (and
/// spilled past the memory budget), archived at its commit; a rolled-back
/// subtransaction and an aborted streamed transaction leave nothing behind.
/// On 12 and 13 (protocol 1) the server sends it whole at its commit: the
/// archive must be the same.
#[tokio::test]
async fn streamed_large_transactions_keep_commits_and_drop_aborts() {
    let pg = common::pg::DedicatedPg::start();
    let db = TestDb::on(pg.url(), "streamed").await;
    // 12 has no such setting: it decodes a large transaction through its
    // own disk and sends it at the commit, which the test checks the same.
    if db.server_version().await >= 130000 {
        db.exec("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'")
            .await;
        db.exec("SELECT pg_reload_conf()").await;
    }
    db.exec("CREATE TABLE big (id int PRIMARY KEY, pad text)")
        .await;
    let pipeline = unique("streamed").replace('_', "-");
    let slot = format!("waltail_{}", pipeline.replace('-', "_"));
    let mut w = Waltail::new(&db, &pipeline, "public.big");
    w.set("WALTAIL_DELIVERY_BATCH_SIZE", "1000");
    w.start();
    // 200,000 rows of ~150 bytes rendered: past the 16 MB memory budget.
    db.exec(
        "BEGIN;
         INSERT INTO big SELECT g, repeat('p', 100) FROM generate_series(1, 100000) g;
         SAVEPOINT s;
         INSERT INTO big SELECT g, 'rolled back' FROM generate_series(500001, 520000) g;
         ROLLBACK TO SAVEPOINT s;
         INSERT INTO big SELECT g, repeat('q', 100) FROM generate_series(100001, 200000) g;
         COMMIT;",
    )
    .await;
    db.exec("BEGIN; INSERT INTO big SELECT g, 'aborted' FROM generate_series(600001, 630000) g; ROLLBACK;")
        .await;
    db.exec("UPDATE big SET pad = 'after' WHERE id = 1").await;
    let root = w.dir.path().join("waltail-archive");
    let start = std::time::Instant::now();
    loop {
        let lines: usize = file_objects(&root)
            .iter()
            .filter(|o| o.key.ends_with(".ndjson"))
            .map(|o| o.body.lines().count())
            .sum();
        if lines >= 200_001 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{lines} changes so far\n{}",
            w.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let changes = checked_changes(&file_objects(&root), None, &pipeline);
    assert_eq!(changes.len(), 200_001);
    let state = replay(&changes);
    assert_eq!(state["public.big"].len(), 200_000);
    assert!(
        changes
            .iter()
            .all(|c| c["data"]["pad"] != "rolled back" && c["data"]["pad"] != "aborted")
    );
    assert_eq!(changes[200_000]["data"]["pad"], "after");
    if db.server_version().await >= 140000 {
        let streamed: i64 = db
            .client
            .query_one(
                "SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            streamed >= 1,
            "the server did not stream the transaction (stream_txns = {streamed})"
        );
    }
    w.stop();
}
