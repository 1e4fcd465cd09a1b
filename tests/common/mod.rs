//! Shared harness for the integration tests: real PostgreSQL and SeaweedFS
//! (started by scripts/services.sh, see scripts/test.sh), the real binary.
//!
//! Each test gets its own database, pipeline name and archive prefix, so tests
//! run in parallel without seeing each other. Processes the tests start are
//! stopped by pid when the test ends, pass or fail.

#![allow(dead_code)]

pub(crate) mod pg;
pub(crate) mod proxy;
pub(crate) mod s3;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{Attribute, ObjectStore, ObjectStoreExt};
use serde_json::Value;

pub(crate) fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// The logical-replication Postgres the tests use (admin URL).
pub(crate) fn pg_admin_url() -> String {
    env_or("WT_TEST_PG", "postgres://postgres@127.0.0.1:55440/postgres")
}

pub(crate) fn pg_replica_url() -> String {
    env_or(
        "WT_TEST_PG_REPLICA",
        "postgres://postgres@127.0.0.1:55441/postgres",
    )
}

pub(crate) struct S3 {
    pub endpoint: String,
    pub bucket: String,
    pub key: String,
    pub secret: String,
    pub put_key: String,
    pub put_secret: String,
}

pub(crate) fn s3() -> S3 {
    S3 {
        endpoint: env_or("WT_TEST_S3_ENDPOINT", "http://127.0.0.1:8333"),
        bucket: env_or("WT_TEST_S3_BUCKET", "waltail-test"),
        key: env_or("WT_TEST_S3_KEY", "waltail-test-key"),
        secret: env_or("WT_TEST_S3_SECRET", "waltail-test-secret"),
        put_key: env_or("WT_TEST_S3_PUT_KEY", "waltail-put-only-key"),
        put_secret: env_or("WT_TEST_S3_PUT_SECRET", "waltail-put-only-secret"),
    }
}

/// A unique, valid name for databases, pipelines and prefixes.
pub(crate) fn unique(tag: &str) -> String {
    format!("{tag}_{:012x}", fastrand::u64(..) >> 16)
}

/// A fresh database on the test server, dropped (with its slots) by `drop_db`.
pub(crate) struct TestDb {
    pub name: String,
    pub url: String,
    pub client: tokio_postgres::Client,
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| {
            panic!("cannot connect to the test Postgres at {url}: {e}; start it with scripts/services.sh up (scripts/test.sh does)")
        });
    tokio::spawn(conn);
    client
}

impl TestDb {
    pub(crate) async fn new(tag: &str) -> TestDb {
        Self::on(&pg_admin_url(), tag).await
    }

    pub(crate) async fn on(admin_url: &str, tag: &str) -> TestDb {
        let admin = connect(admin_url).await;
        let name = unique(tag);
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let url = format!("{}/{name}", admin_url.rsplit_once('/').unwrap().0);
        let client = connect(&url).await;
        client.batch_execute("SET TimeZone = 'UTC'").await.unwrap();
        TestDb { name, url, client }
    }

    /// The server's `server_version_num`, e.g. 150004: tests of what
    /// differs between majors branch on it (see scripts/test-matrix.sh).
    pub(crate) async fn server_version(&self) -> i64 {
        let row = self
            .client
            .query_one("SELECT current_setting('server_version_num')::bigint", &[])
            .await
            .unwrap();
        row.get(0)
    }

    pub(crate) async fn exec(&self, sql: &str) {
        self.client
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Every row of `table` as JSON (to_jsonb in UTC), by its `id` column.
    pub(crate) async fn rows(&self, table: &str) -> BTreeMap<String, Value> {
        let rows = self
            .client
            .query(&format!("SELECT to_jsonb(t)::text FROM {table} t"), &[])
            .await
            .unwrap();
        rows.iter()
            .map(|r| {
                let v: Value = serde_json::from_str(&r.get::<_, String>(0)).unwrap();
                (v["id"].to_string(), v)
            })
            .collect()
    }

    /// Another session on an existing test database.
    pub(crate) async fn attach(url: &str) -> TestDb {
        let client = connect(url).await;
        client.batch_execute("SET TimeZone = 'UTC'").await.unwrap();
        TestDb {
            name: String::new(),
            url: url.to_string(),
            client,
        }
    }

    /// A new session (after the server restarted).
    pub(crate) async fn reconnect(&mut self) {
        self.client = connect(&self.url).await;
        self.client
            .batch_execute("SET TimeZone = 'UTC'")
            .await
            .unwrap();
    }

    pub(crate) async fn drop_db(self) {
        drop(self.client);
        let admin = connect(&pg_admin_url()).await;
        let _ = admin
            .batch_execute(&format!(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = '{0}' AND active_pid IS NOT NULL;
                 SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{0}';
                 DROP DATABASE IF EXISTS {0} WITH (FORCE)",
                self.name
            ))
            .await;
    }
}

/// The waltail binary, configured through WALTAIL_* variables, in its own folder.
pub(crate) struct Waltail {
    pub dir: tempfile::TempDir,
    pub env: Vec<(String, String)>,
    child: Option<Child>,
    runs: usize,
}

/// Field `n` (1-based, as `man 5 proc` numbers them) of a
/// `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat` text. The command
/// (field 2) may hold spaces and parentheses, so the fields are counted
/// from its last closing parenthesis.
pub(crate) fn proc_stat_field(stat: &str, n: usize) -> Option<&str> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(n.checked_sub(3)?)
}

pub(crate) fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_waltail")
}

impl Waltail {
    pub(crate) fn new(db: &TestDb, pipeline: &str, tables: &str) -> Waltail {
        Waltail {
            dir: tempfile::tempdir().unwrap(),
            env: vec![
                ("WALTAIL_PIPELINE".into(), pipeline.into()),
                ("WALTAIL_SOURCE_URL".into(), db.url.clone()),
                ("WALTAIL_SOURCE_TABLES".into(), tables.into()),
                ("WALTAIL_DELIVERY_LINGER_MS".into(), "50".into()),
                ("WALTAIL_DELIVERY_BACKOFF".into(), "50ms".into()),
            ],
            child: None,
            runs: 0,
        }
    }

    /// A waltail for commands that need no database (`compact` of an
    /// archive written by the test).
    pub(crate) fn without_db(pipeline: &str, tables: &str) -> Waltail {
        Waltail {
            dir: tempfile::tempdir().unwrap(),
            env: vec![
                ("WALTAIL_PIPELINE".into(), pipeline.into()),
                (
                    "WALTAIL_SOURCE_URL".into(),
                    "postgres://nobody@127.0.0.1:1/none".into(),
                ),
                ("WALTAIL_SOURCE_TABLES".into(), tables.into()),
            ],
            child: None,
            runs: 0,
        }
    }

    pub(crate) fn set(&mut self, key: &str, value: &str) -> &mut Self {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.into(), value.into()));
        self
    }

    /// Points the pipeline at the test bucket under `prefix` with the admin keys.
    pub(crate) fn s3(&mut self, prefix: &str) -> &mut Self {
        let s3 = s3();
        self.set("WALTAIL_DESTINATION_TYPE", "s3")
            .set("WALTAIL_DESTINATION_BUCKET", &s3.bucket)
            .set("WALTAIL_DESTINATION_PREFIX", prefix)
            .set("WALTAIL_DESTINATION_ENDPOINT", &s3.endpoint)
            .set("WALTAIL_DESTINATION_REGION", "us-east-1")
            .set("WALTAIL_DESTINATION_USE_PATH_STYLE", "true")
            .set("WALTAIL_DESTINATION_ACCESS_KEY_ID", &s3.key)
            .set("WALTAIL_DESTINATION_SECRET_ACCESS_KEY", &s3.secret)
    }

    pub(crate) fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin());
        cmd.args(args).current_dir(self.dir.path());
        for (k, _) in std::env::vars() {
            if k.starts_with("WALTAIL_") || k.starts_with("AWS_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// Runs a command to completion: (exit status, stdout, stderr).
    pub(crate) fn output(&self, args: &[&str]) -> (ExitStatus, String, String) {
        let out = self.command(args).output().unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    pub(crate) fn log_path(&self, run: usize) -> PathBuf {
        self.dir.path().join(format!("run-{run}.log"))
    }

    /// Starts `waltail run` in the background and waits until it streams.
    pub(crate) fn start(&mut self) {
        self.spawn(&["run"]);
        self.wait_log("streaming", Duration::from_secs(30));
    }

    /// Starts `waltail <args>` in the background, stdout and stderr into
    /// this run's log.
    pub(crate) fn spawn(&mut self, args: &[&str]) {
        assert!(self.child.is_none(), "already running");
        self.runs += 1;
        let log = std::fs::File::create(self.log_path(self.runs)).unwrap();
        let child = self
            .command(args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Waits for the background command to exit by itself.
    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("a command is running");
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                panic!("waltail did not exit within {timeout:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.log_path(self.runs)).unwrap_or_default()
    }

    pub(crate) fn wait_log(&mut self, needle: &str, timeout: Duration) {
        let start = Instant::now();
        while !self.log().contains(needle) {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait().unwrap()
            {
                panic!(
                    "waltail exited ({status}) before logging {needle:?}:\n{}",
                    self.log()
                );
            }
            assert!(
                start.elapsed() < timeout,
                "no {needle:?} in the log after {timeout:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// Sends `sig` and waits for the exit.
    pub(crate) fn stop_with(&mut self, sig: &str) -> ExitStatus {
        self.signal(sig);
        let mut child = self.child.take().unwrap();
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!(
                    "waltail did not exit within 60 s of SIG{sig}:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Graceful stop: SIGINT, which must flush, confirm and exit 0.
    pub(crate) fn stop(&mut self) {
        let status = self.stop_with("INT");
        assert!(
            status.success(),
            "waltail exited with {status}:\n{}",
            self.log()
        );
    }

    /// (parked, held) batches as `waltail parked list` shows them.
    pub(crate) fn parked_counts(&self) -> (usize, usize) {
        let (status, stdout, stderr) = self.output(&["parked", "list"]);
        assert!(status.success(), "{stdout}{stderr}");
        let count = |s: &str| {
            stdout
                .lines()
                .filter(|l| l.split_whitespace().nth(2) == Some(s))
                .count()
        };
        (count("parked"), count("held"))
    }

    /// kill -9.
    pub(crate) fn kill9(&mut self) {
        let _ = self.stop_with("KILL");
    }
}

impl Drop for Waltail {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One archive object as read back.
#[derive(Debug, Clone)]
pub(crate) struct Object {
    pub key: String,
    /// The object's text: an archive object's NDJSON, decoded when it is
    /// compressed (`.ndjson.gz`, `.ndjson.zst`).
    pub body: String,
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
}

/// Whether `key` names an archive object (`.ndjson`, plain or compressed).
pub(crate) fn is_archive_object(key: &str) -> bool {
    waltail::archive::codec::Codec::of_key(key)
        .1
        .ends_with(".ndjson")
}

/// An object's bytes as text, decoded by its key's codec; `None` if they
/// are not text.
fn text_of(key: &str, bytes: bytes::Bytes) -> Option<String> {
    let bytes = if is_archive_object(key) {
        waltail::archive::codec::Codec::decode(key, bytes).unwrap_or_else(|e| panic!("{key}: {e}"))
    } else {
        bytes
    };
    String::from_utf8(bytes.to_vec()).ok()
}

pub(crate) fn admin_store() -> Arc<dyn ObjectStore> {
    let s3 = s3();
    Arc::new(
        AmazonS3Builder::new()
            .with_bucket_name(&s3.bucket)
            .with_endpoint(&s3.endpoint)
            .with_region("us-east-1")
            .with_access_key_id(&s3.key)
            .with_secret_access_key(&s3.secret)
            .with_virtual_hosted_style_request(false)
            .with_allow_http(true)
            .build()
            .unwrap(),
    )
}

/// Every object under `prefix` in the test bucket.
pub(crate) async fn s3_objects(prefix: &str) -> Vec<Object> {
    objects_in(admin_store().as_ref(), prefix).await
}

/// The keys of the objects under `prefix` in the test bucket, in order.
pub(crate) async fn s3_keys(prefix: &str) -> Vec<String> {
    s3_objects(prefix)
        .await
        .into_iter()
        .map(|o| o.key)
        .collect()
}

/// Every object under `prefix` in `store`, with its content type, by key.
pub(crate) async fn objects_in(store: &dyn ObjectStore, prefix: &str) -> Vec<Object> {
    objects_where(store, prefix, |_| true).await
}

/// The objects under `prefix` in `store` whose key `keep` accepts (their
/// bodies must be text), with their content type, by key.
pub(crate) async fn objects_where(
    store: &dyn ObjectStore,
    prefix: &str,
    keep: impl Fn(&str) -> bool,
) -> Vec<Object> {
    let metas: Vec<_> = store
        .list(Some(&ObjectPath::from(prefix)))
        .try_collect()
        .await
        .unwrap();
    let mut out = Vec::new();
    for meta in metas.into_iter().filter(|m| keep(m.location.as_ref())) {
        let got = store.get(&meta.location).await.unwrap();
        let content_type = got
            .attributes
            .get(&Attribute::ContentType)
            .map(|v| v.to_string());
        let content_encoding = got
            .attributes
            .get(&Attribute::ContentEncoding)
            .map(|v| v.to_string());
        let key = meta.location.to_string();
        let body = text_of(&key, got.bytes().await.unwrap()).unwrap();
        out.push(Object {
            key,
            body,
            content_type,
            content_encoding,
        });
    }
    out.sort_by(|a, b| a.key.cmp(&b.key));
    out
}

/// Every file under `root`, keys relative to it.
pub(crate) fn file_objects(root: &Path) -> Vec<Object> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<Object>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, root, out);
            } else if !p.to_string_lossy().contains('#') {
                // `key#n` files are object_store's staging files, renamed into
                // place when whole; a file may also be renamed under us.
                let key = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                let Some(body) = std::fs::read(&p).ok().and_then(|b| text_of(&key, b.into()))
                else {
                    continue;
                };
                out.push(Object {
                    key,
                    body,
                    content_type: None,
                    content_encoding: None,
                });
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort_by(|a, b| a.key.cmp(&b.key));
    out
}

/// The archive's changes, checked against the output contract:
/// - keys are `[prefix/]YYYY/MM/DD/<pipeline>-<first>-<last>.ndjson` (then
///   `.gz` or `.zst` when compressed) and the
///   lines of each object carry exactly seqs first..=last, in order;
/// - every line validates against schemas/change.schema.json, with the
///   contract's field order;
/// - seqs over all objects are 1..=N, each in exactly one object, and
///   commit_lsn never goes back as seq grows.
pub(crate) fn checked_changes(
    objects: &[Object],
    prefix: Option<&str>,
    pipeline: &str,
) -> Vec<Value> {
    let schema: Value =
        serde_json::from_str(include_str!("../../schemas/change.schema.json")).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let key_re = format!(
        "^{}[0-9]{{4}}/[0-9]{{2}}/[0-9]{{2}}/{pipeline}-([0-9]+)-([0-9]+)\\.ndjson(?:\\.gz|\\.zst)?$",
        prefix.map(|p| format!("{p}/")).unwrap_or_default()
    );
    let key_re = regex_lite::Regex::new(&key_re).unwrap();
    let mut by_seq: BTreeMap<u64, Value> = BTreeMap::new();
    for obj in objects.iter().filter(|o| is_archive_object(&o.key)) {
        let caps = key_re
            .captures(&obj.key)
            .unwrap_or_else(|| panic!("key {} does not follow the layout {key_re}", obj.key));
        let first: u64 = caps[1].parse().unwrap();
        let last: u64 = caps[2].parse().unwrap();
        assert!(
            obj.body.ends_with('\n'),
            "{} does not end with a newline",
            obj.key
        );
        let lines: Vec<&str> = obj.body.lines().collect();
        assert_eq!(
            lines.len() as u64,
            last - first + 1,
            "line count of {}",
            obj.key
        );
        for (i, line) in lines.iter().enumerate() {
            let v: Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{}: {e}: {line}", obj.key));
            if let Err(e) = validator.validate(&v) {
                panic!("{} line {i} violates the schema: {e}\n{line}", obj.key);
            }
            let order: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
            assert!(
                line.starts_with("{\"op\":") && order.len() == 7,
                "field order/number in {line}"
            );
            let seq = v["seq"].as_u64().unwrap();
            assert_eq!(seq, first + i as u64, "seq order in {}", obj.key);
            assert!(
                by_seq.insert(seq, v).is_none(),
                "seq {seq} is in two objects"
            );
        }
    }
    let changes: Vec<Value> = by_seq.into_values().collect();
    for (i, c) in changes.iter().enumerate() {
        assert_eq!(
            c["seq"].as_u64().unwrap(),
            i as u64 + 1,
            "seqs must be 1..=N without gaps"
        );
    }
    let lsn = |v: &Value| {
        let (hi, lo) = v["commit_lsn"].as_str().unwrap().split_once('/').unwrap();
        (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
    };
    for w in changes.windows(2) {
        assert!(
            lsn(&w[0]) <= lsn(&w[1]),
            "commit order broken between {} and {}",
            w[0],
            w[1]
        );
    }
    changes
}

/// Replays changes (latest by seq per table and id; deletes remove the row).
pub(crate) fn replay(changes: &[Value]) -> BTreeMap<String, BTreeMap<String, Value>> {
    let mut tables: BTreeMap<String, BTreeMap<String, Value>> = BTreeMap::new();
    for c in changes {
        let t = tables
            .entry(c["table"].as_str().unwrap().to_string())
            .or_default();
        match c["op"].as_str().unwrap() {
            "insert" | "update" | "read" => {
                if let Some(old) = c["old"].as_object() {
                    t.remove(&old["id"].to_string());
                }
                t.insert(c["data"]["id"].to_string(), c["data"].clone());
            }
            "delete" => {
                t.remove(&c["old"]["id"].to_string());
            }
            "truncate" => t.clear(),
            op => panic!("unknown op {op}"),
        }
    }
    tables
}

/// The seqs of the change lines in `objects`, sorted.
pub(crate) fn seqs_of(objects: &[Object]) -> Vec<u64> {
    let mut seqs: Vec<u64> = objects
        .iter()
        .filter(|o| is_archive_object(&o.key))
        .flat_map(|o| {
            o.body
                .lines()
                .map(|l| {
                    serde_json::from_str::<Value>(l).unwrap()["seq"]
                        .as_u64()
                        .unwrap()
                })
                .collect::<Vec<_>>()
        })
        .collect();
    seqs.sort();
    seqs
}

/// Asserts that `waltail check` (its `output`) failed on the check named
/// `line`, with a fix mentioning `fix`; returns the FAIL line.
pub(crate) fn assert_check_fails(
    out: &(std::process::ExitStatus, String, String),
    line: &str,
    fix: &str,
) -> String {
    let (status, stdout, stderr) = out;
    assert_eq!(status.code(), Some(1), "exit code\n{stdout}\n{stderr}");
    let fail = stdout
        .lines()
        .position(|l| l.contains("FAIL") && l.contains(line))
        .unwrap_or_else(|| panic!("no FAIL line for {line:?}:\n{stdout}"));
    let next = stdout.lines().nth(fail + 1).unwrap_or_default();
    assert!(
        next.contains("fix:") && next.contains(fix),
        "fix for {line:?} should mention {fix:?}:\n{stdout}"
    );
    stdout.lines().nth(fail).unwrap_or_default().to_string()
}

/// Polls until `check` returns true, or fails with `what`.
pub(crate) async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) const TABLES: &str = "
    CREATE TABLE orders (id bigint PRIMARY KEY, customer text NOT NULL, status text,
                         total numeric(10,2), items jsonb, paid boolean, placed_at timestamptz,
                         note varchar(40), ratio double precision, tags text[]);
    CREATE TABLE customers (id integer PRIMARY KEY, name text, since date, score real);
";

/// Inserts, updates and deletes across both tables in many transactions of
/// varying size, from a deterministic generator.
pub(crate) async fn mixed_workload(db: &TestDb, seed: u64, txns: usize, id_base: i64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for t in 0..txns {
        db.exec(&mixed_transaction(&mut rng, t, id_base)).await;
    }
}

/// One transaction of [`mixed_workload`] (the `t`-th): 1 to 5 inserts,
/// updates and deletes of ids `id_base..id_base + 40` across both tables.
pub(crate) fn mixed_transaction(rng: &mut fastrand::Rng, t: usize, id_base: i64) -> String {
    let mut sql = String::from("BEGIN;");
    for _ in 0..rng.usize(1..6) {
        let id = id_base + rng.i64(0..40);
        match rng.u8(0..6) {
            0 | 1 => sql.push_str(&format!(
                "INSERT INTO orders VALUES ({id}, 'c{id}', 'new', {}.{:02}, '{{\"n\": {t}, \"s\": \"x\\\"y\"}}', {}, now(), 'v{t}', {}, ARRAY['a', NULL, 'b c'])
                 ON CONFLICT (id) DO UPDATE SET status = 'reinserted', total = excluded.total;",
                rng.u32(0..1000), rng.u32(0..100), rng.bool(), rng.f64()
            )),
            2 => sql.push_str(&format!("UPDATE orders SET status = 'paid{t}', paid = true, items = NULL WHERE id = {id};")),
            3 => sql.push_str(&format!("DELETE FROM orders WHERE id = {id};")),
            4 => sql.push_str(&format!(
                "INSERT INTO customers VALUES ({id}, 'n{t}', DATE '2024-01-01' + {t}, {}) ON CONFLICT (id) DO UPDATE SET name = excluded.name;",
                rng.u16(..)
            )),
            _ => sql.push_str(&format!("DELETE FROM customers WHERE id = {id};")),
        }
    }
    sql.push_str("COMMIT;");
    sql
}

/// Whether the objects hold seqs 1..=N with no gap yet (uploads in flight
/// finish in any order, so a later object can land before an earlier one).
pub(crate) fn contiguous(objects: &[Object]) -> bool {
    seqs_of(objects)
        .iter()
        .enumerate()
        .all(|(i, s)| *s == i as u64 + 1)
}

/// Waits until replaying the archive gives exactly the tables' rows.
pub(crate) async fn wait_replay_equals(
    db: &TestDb,
    read: impl AsyncFn() -> Vec<Object>,
    prefix: Option<&str>,
    pipeline: &str,
) -> Vec<serde_json::Value> {
    let mut last = Vec::new();
    let mut agreed = false;
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let objects = read().await;
        if !contiguous(&objects) {
            // Uploads finish out of order: wait for the gap to fill.
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let changes = checked_changes(&objects, prefix, pipeline);
        let state = replay(&changes);
        let orders = db.rows("orders").await;
        let customers = db.rows("customers").await;
        let empty = Default::default();
        if state.get("public.orders").unwrap_or(&empty) == &orders
            && state.get("public.customers").unwrap_or(&empty) == &customers
        {
            agreed = true;
            last = changes;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(agreed, "the archive's replay never equalled the tables");
    last
}

/// A plain HTTP GET against the telemetry endpoint: (status code, body).
pub(crate) fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let code = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// The test S3 server's socket address (for fault-injecting proxies).
pub(crate) fn s3_addr() -> std::net::SocketAddr {
    let endpoint = s3().endpoint;
    let hostport = endpoint.trim_start_matches("http://").trim_end_matches('/');
    std::net::ToSocketAddrs::to_socket_addrs(hostport)
        .unwrap()
        .next()
        .unwrap()
}

/// The python of a reader's venv: `$var` (set by scripts/services.sh up),
/// else the venv `~/.cache/<venv>` that `scripts/<script>` installs.
pub(crate) fn venv_python(var: &str, venv: &str, what: &str, script: &str) -> String {
    let python = std::env::var(var).unwrap_or_else(|_| {
        format!(
            "{}/.cache/{venv}/bin/python",
            std::env::var("HOME").unwrap()
        )
    });
    assert!(
        Path::new(&python).exists(),
        "no {what} python at {python}: run scripts/{script} (scripts/services.sh up does)"
    );
    python
}

/// The python of the venv DuckDB is installed in.
pub(crate) fn duckdb_python() -> String {
    venv_python(
        "WT_TEST_DUCKDB_PYTHON",
        "waltail-duckdb-venv",
        "DuckDB",
        "duckdb.sh",
    )
}

/// Spark (PySpark, local mode) reading the NDJSON objects at `glob`: what
/// tests/readers/spark.py prints.
pub(crate) fn spark_read(glob: &Path) -> Value {
    let python = venv_python(
        "WT_TEST_SPARK_PYTHON",
        "waltail-spark-venv",
        "PySpark",
        "spark.sh",
    );
    let out = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/readers/spark.py"))
        .arg(glob)
        .env("SPARK_LOCAL_IP", "127.0.0.1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "spark.py {}:\n{}",
        glob.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let last = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    serde_json::from_str(&last).unwrap_or_else(|e| panic!("spark.py printed {last:?}: {e}"))
}

/// Runs one DuckDB query; its rows as JSON arrays (decimals as strings).
/// DuckDB's Delta extension is loaded (offline, from its PyPI wheel; see
/// scripts/duckdb.sh), so the query can read a table with `delta_scan`.
pub(crate) fn duck(sql: &str) -> Vec<Vec<Value>> {
    let out = Command::new(duckdb_python())
        .args([
            "-c",
            "import duckdb, json, sys\n\
             from importlib.metadata import files\n\
             ext = [f.locate() for f in files('duckdb-ext-delta') if f.name == 'delta.duckdb_extension'][0]\n\
             con = duckdb.connect(config={'autoinstall_known_extensions': False, 'autoload_known_extensions': False})\n\
             con.execute('SET enable_progress_bar = false')\n\
             con.execute(\"LOAD '%s'\" % ext)\n\
             rows = con.sql(sys.argv[1]).fetchall()\n\
             print(json.dumps([list(r) for r in rows], default=str))",
            sql,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "duckdb failed on {sql}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "duckdb printed no JSON for {sql} ({e}):\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().clone())
        .collect()
}

/// A Delta table (a folder, or `s3://` in the test bucket) as `engine`
/// (`duckdb` or `deltalake`, see tests/readers/delta.py) reads it, at
/// `version` or its newest: the header
/// (version, columns, protocol) and the rows, sorted.
pub(crate) fn read_delta(engine: &str, table: &Path, version: Option<u64>) -> (Value, Vec<Value>) {
    let mut cmd = Command::new(duckdb_python());
    // For an `s3://` table: the test bucket's server and keys.
    let s3 = s3();
    cmd.env("WT_S3_ENDPOINT", &s3.endpoint)
        .env("WT_S3_KEY", &s3.key)
        .env("WT_S3_SECRET", &s3.secret);
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/readers/delta.py"
    ))
    .arg(engine)
    .arg(table);
    if let Some(v) = version {
        cmd.arg("--version").arg(v.to_string());
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{engine} cannot read {}: {}",
        table.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap());
    let header = lines.next().unwrap();
    (header, lines.collect())
}

/// Asserts that DuckDB and the deltalake package read the Delta table at
/// `table` alike; returns the rows.
pub(crate) fn delta_rows_agree(table: &Path) -> Vec<Value> {
    let (_, duck) = read_delta("duckdb", table, None);
    let (_, deltalake) = read_delta("deltalake", table, None);
    assert!(
        duck == deltalake,
        "DuckDB and deltalake read {} differently",
        table.display()
    );
    deltalake
}

/// Copies every object under `prefix` into `dir` (keys relative to the
/// prefix), so DuckDB reads the Parquet files exactly as written.
pub(crate) async fn download(prefix: &str, dir: &Path) {
    let store = admin_store();
    let metas: Vec<_> = store
        .list(Some(&ObjectPath::from(prefix)))
        .try_collect()
        .await
        .unwrap();
    for meta in metas {
        let key = meta.location.to_string();
        let relative = key.strip_prefix(&format!("{prefix}/")).unwrap();
        let target = dir.join(relative);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        let body = store
            .get(&meta.location)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        std::fs::write(target, body).unwrap();
    }
}

/// The archive's NDJSON objects under `prefix` (not the Parquet beside them).
pub(crate) async fn ndjson_objects(prefix: &str) -> Vec<Object> {
    objects_where(admin_store().as_ref(), prefix, is_archive_object).await
}
