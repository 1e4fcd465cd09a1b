//! TLS to Postgres, against a dedicated server with `ssl = on` whose
//! pg_hba.conf allows TCP only over TLS (`hostssl`), with a certificate for
//! localhost and 127.0.0.1 signed by a CA made for the test.

mod common;

use std::collections::BTreeMap;
use std::process::ExitStatus;
use std::time::Duration;

use common::pg::DedicatedPg;
use common::*;
use waltail::config::{Config, SourceConfig};
use waltail::error::ReplicationError;
use waltail::source::{self, replication::ReplicationConnection};

/// A host name the certificate does not name; hostaddr makes it reachable.
const OTHER_NAME: &str = "tls-test.invalid";

/// URL form: `postgres://postgres@<host>:<port>/<db>?<query>`.
fn url(pg: &DedicatedPg, db: &TestDb, host: &str, query: &str) -> String {
    format!(
        "postgres://postgres@{host}:{}/{}?{query}",
        pg.port(),
        db.name
    )
}

/// key=value form, reaching 127.0.0.1 under the name `host`.
fn kv(pg: &DedicatedPg, db: &TestDb, host: &str, rest: &str) -> String {
    format!(
        "host={host} hostaddr=127.0.0.1 port={} user=postgres dbname={} {rest}",
        pg.port(),
        db.name
    )
}

fn verify_full(ca: &std::path::Path) -> String {
    format!("sslmode=verify-full&sslrootcert={}", ca.display())
}

fn assert_fails(out: &(ExitStatus, String, String), line: &str, detail: &str, fix: &str) {
    let fail = assert_check_fails(out, line, fix);
    assert!(
        fail.contains(detail),
        "{line:?} should say {detail:?}:\n{}",
        out.1
    );
}

/// `waltail run` that must stop at once with exit 1, saying `what`.
fn assert_run_refused(w: &Waltail, what: &str) {
    let (status, stdout, stderr) = w.output(&["run"]);
    assert_eq!(status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains(what), "run should say {what:?}:\n{stderr}");
}

/// Sessions of `application_name` and whether each uses TLS.
async fn ssl_of(db: &TestDb, application_name: &str) -> Vec<bool> {
    db.client
        .query(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
             WHERE a.application_name = $1",
            &[&application_name],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test]
async fn check_and_run_over_verify_full() {
    let pg = DedicatedPg::start_tls();
    let db = TestDb::on(&pg.socket_url(), "tlsok").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, note text)")
        .await;
    let pipeline = unique("tls").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.t");

    // check, by IP address (the certificate's IP SAN).
    let check_dir = w.dir.path().join("check-archive");
    w.set("WALTAIL_DESTINATION_PATH", check_dir.to_str().unwrap());
    w.set(
        "WALTAIL_SOURCE_URL",
        &url(&pg, &db, "127.0.0.1", &verify_full(&pg.ca_file())),
    );
    let (status, stdout, stderr) = w.output(&["check"]);
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");

    // run, by name (the certificate's DNS SAN): one insert reaches the archive.
    let root = w.dir.path().join("archive");
    w.set("WALTAIL_DESTINATION_PATH", root.to_str().unwrap());
    w.set(
        "WALTAIL_SOURCE_URL",
        &url(&pg, &db, "localhost", &verify_full(&pg.ca_file())),
    );
    w.start();
    // The walsender's session is encrypted.
    let app = format!("waltail {pipeline}");
    assert_eq!(ssl_of(&db, &app).await, vec![true], "replication session");
    db.exec("INSERT INTO t VALUES (1, 'over tls')").await;
    let pipeline_ref = &pipeline;
    let root_ref = &root;
    eventually(
        Duration::from_secs(30),
        "the insert in the archive",
        || async move { !checked_changes(&file_objects(root_ref), None, pipeline_ref).is_empty() },
    )
    .await;
    let changes = checked_changes(&file_objects(&root), None, &pipeline);
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert_eq!(changes[0]["op"], "insert");
    assert_eq!(changes[0]["data"]["note"], "over tls");
    w.stop();
}

#[tokio::test]
async fn refusals_say_what_to_do() {
    let pg = DedicatedPg::start_tls();
    let db = TestDb::on(&pg.socket_url(), "tlsno").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    let pipeline = unique("tlsno").replace('_', "-");
    let mut w = Waltail::new(&db, &pipeline, "public.t");

    // A CA that did not sign the server's certificate.
    w.set(
        "WALTAIL_SOURCE_URL",
        &url(&pg, &db, "127.0.0.1", &verify_full(&pg.other_ca_file())),
    );
    assert_fails(
        &w.output(&["check"]),
        "connect",
        "the server's certificate is not signed by the CA in sslrootcert",
        "sslrootcert",
    );
    assert_run_refused(&w, "not signed by the CA in sslrootcert");

    // verify-full to a name the certificate does not hold...
    let ca = pg.ca_file();
    w.set(
        "WALTAIL_SOURCE_URL",
        &kv(
            &pg,
            &db,
            OTHER_NAME,
            &format!("sslmode=verify-full sslrootcert={}", ca.display()),
        ),
    );
    assert_fails(
        &w.output(&["check"]),
        "connect",
        &format!("the certificate is for host localhost, 127.0.0.1, not {OTHER_NAME}"),
        "verify-ca",
    );
    // ...which verify-ca accepts, as it checks the CA only.
    w.set(
        "WALTAIL_SOURCE_URL",
        &kv(
            &pg,
            &db,
            OTHER_NAME,
            &format!("sslmode=verify-ca sslrootcert={}", ca.display()),
        ),
    );
    let (status, stdout, stderr) = w.output(&["check"]);
    assert!(status.success(), "verify-ca:\n{stdout}\n{stderr}");

    // require without a CA: encrypted, certificate not checked.
    w.set(
        "WALTAIL_SOURCE_URL",
        &url(&pg, &db, "127.0.0.1", "sslmode=require"),
    );
    let (status, stdout, stderr) = w.output(&["check"]);
    assert!(status.success(), "require:\n{stdout}\n{stderr}");

    // No TLS at all: the hostssl-only server refuses, and we say to turn TLS on.
    w.set(
        "WALTAIL_SOURCE_URL",
        &url(&pg, &db, "127.0.0.1", "sslmode=disable"),
    );
    assert_fails(
        &w.output(&["check"]),
        "connect",
        "no encryption",
        "the server requires TLS: set sslmode=require or stricter",
    );
    assert_run_refused(&w, "set sslmode=require or stricter");

    // An unreadable CA file is a configuration error (exit 2) that names it.
    w.set(
        "WALTAIL_SOURCE_URL",
        &url(
            &pg,
            &db,
            "127.0.0.1",
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        ),
    );
    let (status, stdout, stderr) = w.output(&["check"]);
    assert_eq!(status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("cannot read sslrootcert /nonexistent/ca.pem"),
        "{stderr}"
    );
}

fn source_config(url: &str) -> SourceConfig {
    let vars: BTreeMap<String, String> = [
        ("WALTAIL_SOURCE_URL", url),
        ("WALTAIL_SOURCE_TABLES", "public.t"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    Config::from_parts(None, "test", &vars).unwrap().source
}

/// Opens a replication connection for `url`, runs IDENTIFY_SYSTEM, and
/// reports whether the session used TLS (seen from the server).
async fn replicate(db: &TestDb, url: &str) -> Result<bool, ReplicationError> {
    let source = source_config(url);
    let app = unique("repl");
    let mut conn = ReplicationConnection::connect(&source::pg_config(&source), &app).await?;
    let rows = conn.simple_query("IDENTIFY_SYSTEM").await?;
    assert!(rows[0][0].is_some(), "IDENTIFY_SYSTEM returned {rows:?}");
    let ssl = ssl_of(db, &app).await;
    assert_eq!(ssl.len(), 1, "one session of {app}");
    Ok(ssl[0])
}

/// The replication connection (our own protocol client) on its own: `check`
/// and `run` stop at the SQL connection's refusal before reaching it.
#[tokio::test]
async fn replication_connection_over_tls() {
    let pg = DedicatedPg::start_tls();
    let db = TestDb::on(&pg.socket_url(), "tlsrepl").await;
    let (ca, other) = (pg.ca_file(), pg.other_ca_file());

    for host in ["127.0.0.1", "localhost"] {
        let u = url(&pg, &db, host, &verify_full(&ca));
        assert!(replicate(&db, &u).await.unwrap(), "verify-full via {host}");
    }
    for query in ["sslmode=require", "sslmode=prefer", "application_name=x"] {
        let u = url(&pg, &db, "127.0.0.1", query);
        assert!(replicate(&db, &u).await.unwrap(), "{query}");
    }
    let u = kv(
        &pg,
        &db,
        OTHER_NAME,
        &format!("sslmode=verify-ca sslrootcert={}", ca.display()),
    );
    assert!(replicate(&db, &u).await.unwrap(), "verify-ca, other name");

    let u = url(&pg, &db, "127.0.0.1", &verify_full(&other));
    let err = replicate(&db, &u).await.unwrap_err();
    assert!(
        matches!(err, ReplicationError::Tls(_))
            && err
                .to_string()
                .contains("the server's certificate is not signed by the CA in sslrootcert"),
        "{err}"
    );
    let u = kv(
        &pg,
        &db,
        OTHER_NAME,
        &format!("sslmode=verify-full sslrootcert={}", ca.display()),
    );
    let err = replicate(&db, &u).await.unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "the certificate is for host localhost, 127.0.0.1, not {OTHER_NAME}"
        )),
        "{err}"
    );
    // A CA file that is a valid CA for a *require* session: verified like verify-ca.
    let u = url(
        &pg,
        &db,
        "127.0.0.1",
        &format!("sslmode=require&sslrootcert={}", other.display()),
    );
    let err = replicate(&db, &u).await.unwrap_err();
    assert!(err.to_string().contains("not signed by the CA"), "{err}");

    let u = url(&pg, &db, "127.0.0.1", "sslmode=disable");
    let err = replicate(&db, &u).await.unwrap_err();
    assert_eq!(err.code(), Some("28000"), "{err}");
    assert!(
        err.to_string()
            .contains("the server requires TLS: set sslmode=require or stricter"),
        "{err}"
    );
}

#[tokio::test]
async fn require_refuses_a_server_without_tls_and_prefer_falls_back() {
    let pg = DedicatedPg::start();
    let db = TestDb::on(pg.url(), "notls").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    let mut w = Waltail::new(&db, &unique("notls").replace('_', "-"), "public.t");
    w.set(
        "WALTAIL_SOURCE_URL",
        &url(&pg, &db, "127.0.0.1", "sslmode=require"),
    );
    assert_fails(
        &w.output(&["check"]),
        "connect",
        "the server does not support TLS (sslmode=require)",
        "ssl = on",
    );
    let u = url(&pg, &db, "127.0.0.1", "sslmode=require");
    let err = replicate(&db, &u).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("the server does not support TLS (sslmode=require)"),
        "{err}"
    );
    // prefer (the default): plaintext when the server has no TLS.
    w.set("WALTAIL_SOURCE_URL", &url(&pg, &db, "127.0.0.1", ""));
    let (status, stdout, stderr) = w.output(&["check"]);
    assert!(status.success(), "prefer:\n{stdout}\n{stderr}");
    assert!(
        !replicate(&db, &url(&pg, &db, "127.0.0.1", ""))
            .await
            .unwrap()
    );
}
