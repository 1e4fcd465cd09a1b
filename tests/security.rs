//! Security properties against the real services: secrets never appear in
//! any output, log, state or archived object; config files holding secrets
//! must be private; awkward table names work end to end or are refused
//! before any SQL runs.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;

const PG_PASSWORD: &str = "pgPw-7c41e9d2-never-shown";
const WRONG_S3_SECRET: &str = "wrongS3-0b9f77aa-never-shown";

/// Every text a run can leave behind: the state folder and the archive folder.
fn files_under(dir: &std::path::Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(bytes) = std::fs::read(&p) {
                out.push((
                    p.display().to_string(),
                    String::from_utf8_lossy(&bytes).into_owned(),
                ));
            }
        }
    }
    out
}

fn assert_no_secret(what: &str, text: &str, secrets: &[&str]) {
    for s in secrets {
        assert!(
            !text.contains(s),
            "a secret ({s}) appears in {what}:\n{text}"
        );
    }
}

#[tokio::test]
async fn secrets_never_leak() {
    let db = TestDb::new("secrets").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    let pipeline = unique("secrets").replace('_', "-");
    let prefix = unique("secrets");
    let s3_secret = s3().secret;
    let secrets = [PG_PASSWORD, s3_secret.as_str(), WRONG_S3_SECRET];
    // The shared server trusts local connections, so the password is carried
    // in the URL (and the connection succeeds) without being checked.
    let url = db
        .url
        .replacen("postgres@", &format!("postgres:{PG_PASSWORD}@"), 1);
    assert!(url.contains(PG_PASSWORD));
    let mut w = Waltail::new(&db, &pipeline, "public.t");
    w.s3(&prefix)
        .set("WALTAIL_SOURCE_URL", &url)
        .set("WALTAIL_LOG", "debug");
    let mut texts: Vec<(String, String)> = Vec::new();
    fn record(
        texts: &mut Vec<(String, String)>,
        what: &str,
        out: &(std::process::ExitStatus, String, String),
    ) {
        texts.push((format!("{what} stdout"), out.1.clone()));
        texts.push((format!("{what} stderr"), out.2.clone()));
    }

    let out = w.output(&["check"]);
    assert!(out.0.success(), "{}\n{}", out.1, out.2);
    record(&mut texts, "check", &out);

    w.start();
    db.exec("INSERT INTO t VALUES (1, 'a'), (2, 'b'); UPDATE t SET v = 'c' WHERE id = 1; DELETE FROM t WHERE id = 2")
        .await;
    eventually(Duration::from_secs(30), "4 changes archived", async || {
        let objects = s3_objects(&prefix).await;
        checked_changes(&objects, Some(&prefix), &pipeline).len() == 4
    })
    .await;
    w.stop();
    texts.push(("run log".into(), w.log()));

    let out = w.output(&["parked", "list"]);
    assert!(out.0.success(), "{}\n{}", out.1, out.2);
    record(&mut texts, "parked list", &out);
    record(&mut texts, "--help", &w.output(&["--help"]));
    record(&mut texts, "run --help", &w.output(&["run", "--help"]));
    record(&mut texts, "check --help", &w.output(&["check", "--help"]));

    // A failing check: a wrong S3 secret and a missing table.
    let mut bad = Waltail::new(&db, &pipeline, "public.t,public.missing");
    bad.s3(&prefix)
        .set("WALTAIL_SOURCE_URL", &url)
        .set("WALTAIL_LOG", "debug")
        .set("WALTAIL_DESTINATION_SECRET_ACCESS_KEY", WRONG_S3_SECRET);
    let out = bad.output(&["check"]);
    assert_eq!(out.0.code(), Some(1), "{}\n{}", out.1, out.2);
    assert!(out.1.contains("public.missing"), "{}", out.1);
    record(&mut texts, "failing check", &out);

    // A run that cannot start (missing table) fails with the password in the URL.
    let out = bad.output(&["run"]);
    assert_eq!(out.0.code(), Some(1), "{}\n{}", out.1, out.2);
    record(&mut texts, "failing run", &out);

    // Configuration errors: a broken file holding both secrets, a bad URL.
    let file = bad.dir.path().join("broken.toml");
    std::fs::write(
        &file,
        format!(
            "[source]\nurl = \"{url}\" oops\n[destination]\nsecret_access_key = \"{s3_secret}\" oops\n"
        ),
    )
    .unwrap();
    chmod(&file, 0o600);
    let out = bad.output(&["--config", file.to_str().unwrap(), "check"]);
    assert_eq!(out.0.code(), Some(2), "{}\n{}", out.1, out.2);
    assert!(out.2.contains("line 2"), "{}", out.2);
    record(&mut texts, "broken file", &out);
    for broken in [
        format!("{url}?sslmode=nonsense"),
        url.replacen(":55440", ":notaport", 1),
        format!("{url}?unknown_option=1"),
    ] {
        bad.set("WALTAIL_SOURCE_URL", &broken);
        let out = bad.output(&["check"]);
        assert_eq!(out.0.code(), Some(2), "{}\n{}", out.1, out.2);
        record(&mut texts, &format!("bad url {broken}"), &out);
    }

    for (what, text) in &texts {
        assert_no_secret(what, text, &secrets);
    }
    for (path, text) in files_under(w.dir.path()).into_iter().chain(
        files_under(bad.dir.path())
            .into_iter()
            .filter(|(p, _)| !p.ends_with("broken.toml")),
    ) {
        assert_no_secret(&path, &text, &secrets);
    }
    let objects = s3_objects(&prefix).await;
    assert!(objects.iter().any(|o| o.key.contains("_schemas/public.t/")));
    for o in &objects {
        assert_no_secret(&o.key, &format!("{}\n{}", o.key, o.body), &secrets);
    }
    db.drop_db().await;
}

fn chmod(path: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn a_readable_config_file_with_a_secret_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("waltail.toml");
    std::fs::write(
        &file,
        format!(
            "[source]\nurl = \"postgres://u:{PG_PASSWORD}@127.0.0.1:1/db\"\ntables = [\"t\"]\n"
        ),
    )
    .unwrap();
    chmod(&file, 0o644);
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin())
            .args(args)
            .current_dir(dir.path())
            .env_remove("WALTAIL_CONFIG")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Named with --config, and found as ./waltail.toml.
    for args in [
        &["--config", file.to_str().unwrap(), "check"][..],
        &["check"][..],
    ] {
        let (code, stderr) = run(args);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(
            stderr.contains("chmod 600") && stderr.contains("waltail.toml"),
            "{stderr}"
        );
        assert_no_secret("stderr", &stderr, &[PG_PASSWORD]);
    }
    // Private, it loads (and then fails to connect, exit 1).
    chmod(&file, 0o600);
    let (code, stderr) = run(&["check"]);
    assert_eq!(code, Some(1), "{stderr}");
}

const AWKWARD: &[(&str, &str, &str)] = &[
    // (as written in source.tables, the archive's "table", the schema record folder)
    (
        "public.\"Mixed Case\"",
        "public.Mixed Case",
        "public.Mixed Case",
    ),
    (
        "public.\"semi;colon\"",
        "public.semi;colon",
        "public.semi;colon",
    ),
    ("public.\"quo\"\"te\"", "public.quo\"te", "public.quo%22te"),
    ("public.\"ünï\"", "public.ünï", "public.ünï"),
    (
        "\"My Schema\".\"My.Table\"",
        "My Schema.My.Table",
        "My Schema.My.Table",
    ),
];

#[tokio::test]
async fn awkward_table_names_work_end_to_end() {
    let db = TestDb::new("awkward").await;
    db.exec("CREATE SCHEMA \"My Schema\"").await;
    for (entry, _, _) in AWKWARD {
        db.exec(&format!(
            "CREATE TABLE {entry} (id int PRIMARY KEY, v text)"
        ))
        .await;
    }
    let pipeline = unique("awkward").replace('_', "-");
    let prefix = unique("awkward");
    let tables: Vec<&str> = AWKWARD.iter().map(|(e, _, _)| *e).collect();
    let mut w = Waltail::new(&db, &pipeline, &tables.join(", "));
    w.s3(&prefix);
    let (status, stdout, stderr) = w.output(&["check"]);
    assert!(status.success(), "{stdout}\n{stderr}");

    let insert_all = async |id: i32| {
        for (entry, _, _) in AWKWARD {
            db.exec(&format!("INSERT INTO {entry} VALUES ({id}, 'x')"))
                .await;
        }
    };
    let wait_for = async |n: usize| {
        eventually(
            Duration::from_secs(30),
            &format!("{n} changes archived"),
            async || {
                let objects = s3_objects(&prefix).await;
                checked_changes(&objects, Some(&prefix), &pipeline).len() == n
            },
        )
        .await;
    };
    w.start();
    insert_all(1).await;
    wait_for(AWKWARD.len()).await;
    w.stop();
    // A restart finds the publication as configured and the schemas known.
    w.start();
    insert_all(2).await;
    wait_for(2 * AWKWARD.len()).await;
    w.stop();
    assert!(!w.log().contains("updated the publication"), "{}", w.log());

    let objects = s3_objects(&prefix).await;
    let changes = checked_changes(&objects, Some(&prefix), &pipeline);
    let got: BTreeSet<&str> = changes
        .iter()
        .map(|c| c["table"].as_str().unwrap())
        .collect();
    let want: BTreeSet<&str> = AWKWARD.iter().map(|(_, t, _)| *t).collect();
    assert_eq!(got, want);
    let schema_keys: BTreeSet<String> = objects
        .iter()
        .filter(|o| o.key.contains("/_schemas/"))
        .map(|o| o.key.clone())
        .collect();
    let want_keys: BTreeSet<String> = AWKWARD
        .iter()
        .map(|(_, _, folder)| format!("{prefix}/_schemas/{folder}/1.json"))
        .collect();
    assert_eq!(schema_keys, want_keys);
    for (_, table, folder) in AWKWARD {
        let key = format!("{prefix}/_schemas/{folder}/1.json");
        let body = &objects.iter().find(|o| o.key == key).unwrap().body;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["table"], *table, "{body}");
    }
    let published: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = $1",
            &[&format!("waltail_{}", pipeline.replace('-', "_"))],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(published, AWKWARD.len() as i64);
    db.drop_db().await;
}

#[tokio::test]
async fn unreadable_table_entries_are_refused_before_any_sql() {
    // The URL points nowhere: a refusal must come from the configuration.
    for (entry, says) in [
        ("public.\"unterminated", "no closing quote"),
        ("a.b.c", "more than one dot"),
        ("public.quo\"te", "quote the whole name"),
        (
            "public.\"this name is far too long for postgres to keep it whole: 68 bytes\"",
            "at most 63",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(bin())
            .arg("check")
            .current_dir(dir.path())
            .env_remove("WALTAIL_CONFIG")
            .env("WALTAIL_SOURCE_URL", "postgres://u@127.0.0.1:1/db")
            .env("WALTAIL_SOURCE_TABLES", entry)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{entry}: {stderr}");
        assert!(
            stderr.contains("source.tables") && stderr.contains(says),
            "{entry}: {stderr}"
        );
    }
}
