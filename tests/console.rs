//! The web console and the slot-lag warning, against real Postgres and
//! SeaweedFS with the real binary; the page runs in headless Chromium
//! (Debian's `chromium`, installed by scripts/services.sh), driven over the
//! DevTools protocol.
//!
//! - The page shows the pipeline, its first changes as they are captured
//!   and delivered, and a parked batch with its error; clicking Replay
//!   delivers it (and the batch held behind it) under the same key.
//! - The API refuses requests a page on another site could make (no
//!   `X-Waltail` header, a foreign Origin, a foreign Host), so they replay
//!   nothing, and no response holds a secret of the configuration.
//! - Slot lag over `telemetry.slot_lag_warn_bytes` is logged once (not per
//!   keepalive), flagged by the console and `waltail status`, and an all-clear
//!   is logged once it is back under.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::proxy::{Mode, Proxy};
use common::*;
use serde_json::{Value, json};

// ---- headless Chromium over the DevTools protocol ----

/// The browser: WT_TEST_CHROMIUM (scripts/services.sh sets it), else
/// `chromium` on PATH. A machine without one fails here, with the fix: the
/// console is only tested in a real browser, so this test is never skipped.
fn chromium_path() -> PathBuf {
    if let Ok(p) = std::env::var("WT_TEST_CHROMIUM")
        && !p.is_empty()
    {
        return p.into();
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        for name in ["chromium", "chromium-browser"] {
            if dir.join(name).is_file() {
                return dir.join(name);
            }
        }
    }
    panic!(
        "no Chromium to test the console in: run scripts/chromium.sh (scripts/services.sh up \
         does; as root it installs Debian's chromium), or set WT_TEST_CHROMIUM"
    );
}

/// A headless Chromium showing one page. Dropping it kills the browser and
/// every helper process it started (they share its process group).
struct Browser {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
}

impl Browser {
    fn open(url: &str) -> Browser {
        let dir = tempfile::tempdir().unwrap();
        let profile = dir.path().join("profile");
        let log = std::fs::File::create(dir.path().join("chromium.log")).unwrap();
        let chromium = chromium_path();
        let child = Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromium.display()));
        let mut browser = Browser {
            child,
            dir,
            port: 0,
        };
        // With port 0 it picks a free one and writes it here.
        let active = profile.join("DevToolsActivePort");
        let start = Instant::now();
        loop {
            let port = std::fs::read_to_string(&active)
                .ok()
                .and_then(|t| t.lines().next()?.trim().parse().ok());
            if let Some(port) = port {
                browser.port = port;
                return browser;
            }
            if let Some(status) = browser.child.try_wait().unwrap() {
                panic!("chromium exited ({status}):\n{}", browser.log());
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "chromium did not open its DevTools port in 30 s:\n{}",
                browser.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("chromium.log")).unwrap_or_default()
    }

    /// A DevTools session on the page.
    fn page(&self) -> Page {
        let start = Instant::now();
        let ws_url = loop {
            let (_, _, body) = http(
                &format!("127.0.0.1:{}", self.port),
                "GET",
                "/json/list",
                &[],
            );
            let targets: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            let page = targets
                .as_array()
                .into_iter()
                .flatten()
                .find(|t| t["type"] == "page");
            if let Some(url) = page.and_then(|t| t["webSocketDebuggerUrl"].as_str()) {
                break url.to_string();
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no page target: {body}"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let (ws, _) = tungstenite::client(ws_url.as_str(), stream).unwrap();
        Page { ws, next_id: 0 }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
    }
}

struct Page {
    ws: tungstenite::WebSocket<TcpStream>,
    next_id: u64,
}

impl Page {
    /// Evaluates `expr` in the page and returns its value (JSON).
    fn eval(&mut self, expr: &str) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let call = json!({
            "id": id,
            "method": "Runtime.evaluate",
            "params": { "expression": expr, "returnByValue": true, "awaitPromise": true },
        });
        self.ws
            .send(tungstenite::Message::text(call.to_string()))
            .unwrap();
        loop {
            let msg = self.ws.read().unwrap();
            let Ok(text) = msg.to_text() else { continue };
            let v: Value = serde_json::from_str(text).unwrap();
            if v["id"] != id {
                continue; // an event
            }
            assert!(v.get("error").is_none(), "{expr}: {}", v["error"]);
            if let Some(e) = v["result"].get("exceptionDetails") {
                panic!("{expr} threw: {e}");
            }
            return v["result"]["result"]["value"].clone();
        }
    }

    /// Waits until `expr` is true in the page; on timeout, fails with what
    /// the page shows.
    fn wait_for(&mut self, expr: &str, what: &str) {
        let start = Instant::now();
        while self.eval(expr) != Value::Bool(true) {
            if start.elapsed() > Duration::from_secs(30) {
                let text = self.eval("document.body.innerText");
                panic!("the page did not show {what} in 30 s ({expr}); it shows:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The cells' text of the rows matching `selector`.
    fn rows(&mut self, selector: &str) -> Vec<Vec<String>> {
        let v = self.eval(&format!(
            "[...document.querySelectorAll({})].map(tr => [...tr.children].map(td => td.textContent))",
            Value::from(selector)
        ));
        serde_json::from_value(v).unwrap()
    }
}

// ---- plain HTTP to the console ----

/// One HTTP/1.1 request: (status, headers in lower case, body). `Host` is
/// `addr` unless `headers` sets it.
fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: 0\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    // Read the head, then Content-Length bytes: Chromium's DevTools server
    // keeps the connection open whatever `Connection: close` says.
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "{addr}{path}: connection closed before the response head"
        );
        raw.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).to_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse::<usize>().unwrap());
    match length {
        Some(length) => {
            while raw.len() < head_end + length {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "{addr}{path}: connection closed mid-body");
                raw.extend_from_slice(&buf[..n]);
            }
        }
        None => {
            s.read_to_end(&mut raw).unwrap();
        }
    }
    let body = String::from_utf8_lossy(&raw[head_end..]).into_owned();
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, head, body)
}

/// The console's address, from the log line of a pipeline started with
/// `telemetry.listen = 127.0.0.1:0`.
fn console_addr(w: &Waltail) -> String {
    let log = w.log();
    log.lines()
        .find(|l| l.contains("serving the console"))
        .and_then(|l| l.split("addr=").nth(1))
        .and_then(|a| a.split_whitespace().next())
        .unwrap_or_else(|| panic!("no console address in the log:\n{log}"))
        .to_string()
}

async fn archived_seqs(prefix: &str) -> Vec<u64> {
    seqs_of(&s3_objects(prefix).await)
}

/// A pipeline of `public.t` into the test bucket through `proxy`, one change
/// per object, parking after two quick attempts, with its console on.
fn pipeline_through(db: &TestDb, proxy: &Proxy, tag: &str) -> (Waltail, String, String) {
    let pipeline = unique(tag).replace('_', "-");
    let prefix = format!("console/{pipeline}");
    let mut w = Waltail::new(db, &pipeline, "public.t");
    w.s3(&prefix)
        .set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url())
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "1")
        .set("WALTAIL_DELIVERY_MAX_ATTEMPTS", "2")
        .set("WALTAIL_DELIVERY_REQUEST_TIMEOUT_MS", "1000")
        .set("WALTAIL_TELEMETRY_LISTEN", "127.0.0.1:0");
    (w, pipeline, prefix)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_shows_first_changes_and_a_parked_batch_and_its_replay_button_delivers_it() {
    let db = TestDb::new("console").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    let proxy = Proxy::start(s3_addr());
    let (mut w, pipeline, prefix) = pipeline_through(&db, &proxy, "console");
    w.start();
    let addr = console_addr(&w);
    db.exec("INSERT INTO t VALUES (1, 0), (2, 0), (3, 0)").await; // seqs 1-3
    eventually(Duration::from_secs(30), "seqs 1-3", async || {
        archived_seqs(&prefix).await == [1, 2, 3]
    })
    .await;
    let key_of = async |seq: u64| -> String {
        s3_objects(&prefix)
            .await
            .into_iter()
            .map(|o| o.key)
            .find(|k| k.ends_with(&format!("-{seq}-{seq}.ndjson")))
            .unwrap_or_else(|| panic!("no object for seq {seq}"))
    };
    let key1 = key_of(1).await;

    let browser = Browser::open(&format!("http://{addr}/"));
    let mut page = browser.page();

    // The pipeline, and its first changes as captured and delivered.
    page.wait_for(
        "document.querySelectorAll('#first tr.event.delivered').length === 3",
        "three delivered changes",
    );
    assert_eq!(
        page.eval("document.getElementById('pipeline').textContent"),
        pipeline
    );
    assert_eq!(
        page.eval("document.getElementById('ready').textContent"),
        "streaming"
    );
    let first = page.rows("#first tr.event");
    assert_eq!(first[0][..3], ["1", "insert", "public.t"]);
    assert_eq!(first[0][4], "delivered");
    assert_eq!(first[0][5], key1, "the object key the change went to");
    assert_eq!(
        page.eval("document.getElementById('last_key').textContent")
            .as_str()
            .map(|k| k.ends_with(".ndjson")),
        Some(true)
    );

    // The store resets every connection: seq 4 parks after its two attempts.
    proxy.set_mode(Mode::Reset);
    db.exec("UPDATE t SET v = 1 WHERE id = 1").await; // seq 4
    page.wait_for(
        "document.querySelector('#parked tr.batch.parked[data-id=\"4\"]') !== null",
        "batch 4 parked",
    );
    proxy.set_mode(Mode::Pass);
    db.exec("UPDATE t SET v = 2 WHERE id = 1").await; // seq 5: held behind 4
    db.exec("UPDATE t SET v = 2 WHERE id = 2").await; // seq 6: flows on
    page.wait_for(
        "document.querySelector('#parked tr.batch[data-id=\"5\"]') !== null",
        "batch 5 held",
    );
    page.wait_for(
        "document.querySelector('#first tr.event[data-seq=\"6\"]').classList.contains('delivered')",
        "seq 6 delivered",
    );
    let parked = page.rows("#parked tr.batch");
    assert_eq!(parked.len(), 2, "{parked:?}");
    let (p4, p5) = (&parked[0], &parked[1]);
    assert_eq!(p4[..5], ["4", "4-4", "parked", "2", "public.t"], "{p4:?}");
    assert!(
        p4[5].starts_with(&prefix) && p4[5].ends_with("-4-4.ndjson"),
        "{p4:?}"
    );
    assert!(p4[6].len() > 10, "the last error is shown: {p4:?}");
    assert_eq!(p4[8], "Replay");
    assert_eq!(p5[..3], ["5", "5-5", "held"], "{p5:?}");
    assert_eq!(
        page.eval("document.querySelector('#parked tr[data-id=\"5\"] button.replay').hidden"),
        true,
        "a held batch has no Replay button: it follows the parked one"
    );
    let fates = page.rows("#first tr.event");
    assert_eq!(
        (fates[3][4].as_str(), fates[4][4].as_str()),
        ("parked", "held")
    );
    assert_eq!(
        page.eval("document.getElementById('parked_summary').textContent"),
        "1 parked, 1 held"
    );
    let seqs = archived_seqs(&prefix).await;
    assert_eq!(seqs, [1, 2, 3, 6], "4 and 5 wait for the replay");

    // One click on Replay: 4 is delivered under its key, then 5 behind it.
    page.eval("document.querySelector('#parked tr[data-id=\"4\"] button.replay').click(); true");
    eventually(
        Duration::from_secs(30),
        "seqs 4 and 5 after the replay",
        async || archived_seqs(&prefix).await == [1, 2, 3, 4, 5, 6],
    )
    .await;
    assert_eq!(
        key_of(4).await,
        p4[5],
        "replayed under the key it was parked with"
    );
    // The object is visible a moment before its row leaves the parked
    // table (PUT, then unpark): wait for the state too.
    eventually(
        Duration::from_secs(10),
        "an empty parked table after the replay",
        async || w.parked_counts() == (0, 0),
    )
    .await;
    page.wait_for(
        "document.querySelectorAll('#parked tr.batch').length === 0 \
         && document.getElementById('parked').textContent.includes('no parked batches')",
        "no parked batches",
    );
    page.wait_for(
        "[...document.querySelectorAll('#first tr.event')].every(tr => tr.classList.contains('delivered'))",
        "every change delivered",
    );
    assert!(
        page.eval("document.getElementById('message').textContent")
            .as_str()
            .unwrap()
            .contains("requested")
    );
    assert!(
        w.log().contains("replay requested from the console"),
        "{}",
        w.log()
    );
    let changes = checked_changes(&s3_objects(&prefix).await, Some(&prefix), &pipeline);
    assert_eq!(replay(&changes)["public.t"], db.rows("t").await);

    drop(page);
    drop(browser);
    w.stop();
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_api_refuses_cross_site_requests_and_shows_no_secret() {
    let db = TestDb::new("consoleapi").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    let proxy = Proxy::start(s3_addr());
    let (mut w, pipeline, prefix) = pipeline_through(&db, &proxy, "consoleapi");
    // A password in the URL (trust auth ignores it) and the S3 keys: neither
    // may appear in anything the console serves.
    let password = "console-pw-4f1c9e";
    let url = db
        .url
        .replacen("postgres@", &format!("postgres:{password}@"), 1);
    assert_ne!(url, db.url);
    w.set("WALTAIL_SOURCE_URL", &url);
    w.start();
    let addr = console_addr(&w);
    db.exec("INSERT INTO t VALUES (1, 0)").await; // seq 1
    eventually(Duration::from_secs(30), "seq 1", async || {
        archived_seqs(&prefix).await == [1]
    })
    .await;
    proxy.set_mode(Mode::Reset);
    db.exec("UPDATE t SET v = 1 WHERE id = 1").await; // seq 2: parks
    eventually(Duration::from_secs(30), "seq 2 parked", async || {
        w.parked_counts() == (1, 0)
    })
    .await;
    proxy.set_mode(Mode::Pass);
    db.exec("UPDATE t SET v = 2 WHERE id = 1").await; // seq 3: held
    eventually(Duration::from_secs(30), "seq 3 held", async || {
        w.parked_counts() == (1, 1)
    })
    .await;

    let replay2 = "/api/parked/2/replay";
    let own = format!("http://{addr}");
    let port = addr.rsplit_once(':').unwrap().1;
    let evil_host = format!("evil.example:{port}");
    let refused = |method: &str, what: &str, headers: &[(&str, &str)], code: u16| {
        let (got, head, body) = http(&addr, method, replay2, headers);
        assert_eq!(got, code, "{what}: {head}\n{body}");
        assert!(!head.contains("access-control-allow"), "{what}: {head}");
    };
    let form = ("Content-Type", "application/x-www-form-urlencoded");
    refused(
        "POST",
        "no X-Waltail header (a form post)",
        &[("Origin", &own), form],
        403,
    );
    let evil = ("Origin", "http://evil.example");
    refused(
        "POST",
        "another site's page",
        &[("X-Waltail", "1"), evil],
        403,
    );
    refused(
        "POST",
        "a sandboxed page",
        &[("X-Waltail", "1"), ("Origin", "null")],
        403,
    );
    let rebound = [("X-Waltail", "1"), ("Host", evil_host.as_str()), evil];
    refused("POST", "DNS rebinding (foreign Host)", &rebound, 403);
    refused(
        "GET",
        "a GET (a link or an image)",
        &[("X-Waltail", "1")],
        405,
    );
    let preflight = [
        evil,
        ("Access-Control-Request-Method", "POST"),
        ("Access-Control-Request-Headers", "x-waltail"),
    ];
    refused("OPTIONS", "a CORS preflight", &preflight, 405);
    // A page on another site cannot even read the state through rebinding.
    let (code, _, _) = http(&addr, "GET", "/api/state", &[("Host", &evil_host)]);
    assert_eq!(code, 403);
    // Held batches are replayed by replaying the batch they wait behind.
    let (code, _, body) = http(&addr, "POST", "/api/parked/3/replay", &[("X-Waltail", "1")]);
    assert_eq!(code, 409, "{body}");
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/parked/99/replay",
        &[("X-Waltail", "1")],
    );
    assert_eq!(code, 404, "{body}");
    // The pipeline polls the state every 0.5 s: nothing was marked, nothing moves.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        w.parked_counts(),
        (1, 1),
        "a refused request replayed something"
    );
    assert_eq!(archived_seqs(&prefix).await, [1]);

    // What the console serves: no secret, and framing forbidden.
    let s3 = s3();
    for path in ["/", "/console.js", "/api/state", "/api/parked"] {
        let (code, head, body) = http(&addr, "GET", path, &[]);
        assert_eq!(code, 200, "{path}: {body}");
        for secret in [password, s3.secret.as_str(), s3.key.as_str()] {
            assert!(
                !body.contains(secret) && !head.contains(secret),
                "{path} shows {secret}:\n{body}"
            );
        }
        assert!(
            head.contains("frame-ancestors 'none'") && head.contains("x-frame-options: deny"),
            "{path}: {head}"
        );
    }
    let (_, _, state) = http(
        &addr,
        "GET",
        "/api/state",
        &[("Host", &format!("localhost:{port}"))],
    );
    let state: Value = serde_json::from_str(&state).unwrap();
    assert_eq!(state["pipeline"], pipeline.as_str());
    assert_eq!(state["destination"], format!("s3://{}/{prefix}", s3.bucket));
    assert_eq!(
        (state["parked"].as_u64(), state["held"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(state["ready"], true);
    let (_, _, parked) = http(&addr, "GET", "/api/parked", &[]);
    let parked: Value = serde_json::from_str(&parked).unwrap();
    assert_eq!(parked["total"], 2);
    assert_eq!(parked["batches"][0]["id"], 2);
    assert_eq!(parked["batches"][0]["status"], "parked");
    assert!(
        parked["batches"][0]["last_error"]
            .as_str()
            .is_some_and(|e| !e.is_empty())
    );

    // The same request from the console's own page (or curl) is carried out.
    let (code, _, body) = http(
        &addr,
        "POST",
        replay2,
        &[("X-Waltail", "1"), ("Origin", own.as_str())],
    );
    assert_eq!(code, 202, "{body}");
    eventually(
        Duration::from_secs(30),
        "seqs 2 and 3 after the replay",
        async || archived_seqs(&prefix).await == [1, 2, 3],
    )
    .await;
    // The object is visible a moment before its row leaves the parked
    // table (PUT, then unpark): wait for the state too.
    eventually(
        Duration::from_secs(10),
        "an empty parked table after the replay",
        async || w.parked_counts() == (0, 0),
    )
    .await;
    let (code, _, _) = http(&addr, "POST", replay2, &[("X-Waltail", "1")]);
    assert_eq!(code, 404, "delivered: nothing left to replay");
    w.stop();
    assert!(!w.log().contains(password), "{}", w.log());
    db.drop_db().await;
}

/// Bytes of slot lag over which the test pipeline warns.
const LAG_WARN: u64 = 64 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_lag_over_the_threshold_warns_once_shows_in_status_and_console_then_clears() {
    let db = TestDb::new("lagwarn").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, v int); CREATE TABLE noise (id int PRIMARY KEY, pad text)")
        .await;
    let proxy = Proxy::start(s3_addr());
    let pipeline = unique("lagwarn").replace('_', "-");
    let prefix = format!("console/{pipeline}");
    let mut w = Waltail::new(&db, &pipeline, "public.t");
    w.s3(&prefix)
        .set("WALTAIL_DESTINATION_ENDPOINT", &proxy.url())
        .set("WALTAIL_DELIVERY_BATCH_SIZE", "1")
        // A hung PUT is abandoned after 2 s and tried again, for minutes.
        .set("WALTAIL_DELIVERY_REQUEST_TIMEOUT_MS", "2000")
        .set("WALTAIL_DELIVERY_MAX_ATTEMPTS", "100")
        .set("WALTAIL_TELEMETRY_LISTEN", "127.0.0.1:0")
        .set(
            "WALTAIL_TELEMETRY_SLOT_LAG_WARN_BYTES",
            &LAG_WARN.to_string(),
        );
    w.start();
    let addr = console_addr(&w);
    db.exec("INSERT INTO t VALUES (1, 0)").await;
    eventually(Duration::from_secs(30), "seq 1", async || {
        archived_seqs(&prefix).await == [1]
    })
    .await;
    let warnings = |w: &Waltail| w.log().matches("slot lag is over").count();
    // A new pipeline's cursor starts at 0/0: its first keepalive once
    // counted the server's whole WAL history as lag and warned.
    assert_eq!(warnings(&w), 0, "{}", w.log());

    // The store hangs with seq 2 in flight: nothing can be confirmed past
    // it, while a table outside the publication takes about 1 MB of WAL.
    proxy.set_mode(Mode::Blackhole);
    db.exec("INSERT INTO t VALUES (2, 0)").await;
    db.exec("INSERT INTO noise SELECT g, repeat('x', 400) FROM generate_series(1, 2000) g")
        .await;
    w.wait_log("slot lag is over", Duration::from_secs(30));
    let state =
        || -> Value { serde_json::from_str(&http(&addr, "GET", "/api/state", &[]).2).unwrap() };
    let s = state();
    assert_eq!(s["slot_lag_warning"], true, "{s}");
    assert!(s["slot_lag_bytes"].as_u64().unwrap() > LAG_WARN, "{s}");
    assert_eq!(s["slot_lag_warn_bytes"], LAG_WARN);
    let (code, stdout, stderr) = w.output(&["status", "--json"]);
    assert!(code.success(), "{stdout}{stderr}");
    let status: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(status["lag_warning"], true, "{status}");
    assert!(
        status["slot"]["lag_bytes"].as_i64().unwrap() > LAG_WARN as i64,
        "{status}"
    );
    let (_, text, _) = w.output(&["status"]);
    assert!(
        text.contains("WARNING") && text.contains("slot_lag_warn_bytes"),
        "{text}"
    );

    // More WAL while still over: many keepalives, still one warning.
    for round in 0..3 {
        db.exec(&format!(
            "INSERT INTO noise SELECT g, repeat('y', 400) FROM generate_series({0} * 10000 + 10000, {0} * 10000 + 10500) g",
            round
        ))
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(state()["slot_lag_bytes"].as_u64().unwrap() > LAG_WARN);
    assert_eq!(
        warnings(&w),
        1,
        "warned more than once while over:\n{}",
        w.log()
    );

    // The store answers again: seq 2 is written, the position confirmed,
    // and the next keepalive finds the lag back under.
    proxy.set_mode(Mode::Pass);
    eventually(Duration::from_secs(30), "seq 2", async || {
        archived_seqs(&prefix).await == [1, 2]
    })
    .await;
    let start = Instant::now();
    let mut id = 100_000;
    while !w.log().contains("slot lag is back under") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no all-clear:\n{}",
            w.log()
        );
        // Keepalives follow new WAL.
        db.exec(&format!("INSERT INTO noise VALUES ({id}, 'z')"))
            .await;
        id += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(warnings(&w), 1, "{}", w.log());
    for line in w.log().lines().filter(|l| l.contains("slot lag")) {
        println!("{line}");
    }
    let s = state();
    assert_eq!(s["slot_lag_warning"], false, "{s}");
    eventually(
        Duration::from_secs(30),
        "status without the warning",
        async || {
            let (_, stdout, _) = w.output(&["status", "--json"]);
            serde_json::from_str::<Value>(&stdout).unwrap()["lag_warning"] == false
        },
    )
    .await;
    w.stop();
    db.drop_db().await;
}
