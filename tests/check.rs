//! `waltail check` against real services: exit 0 when all is well, and each
//! failure named with its fix.

mod common;

use common::*;

#[tokio::test]
async fn check_passes_and_writes_the_marker() {
    let db = TestDb::new("checkok").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    let prefix = unique("check");
    let mut w = Waltail::new(&db, &unique("checkok").replace('_', "-"), "public.t");
    w.s3(&prefix);
    let (status, stdout, stderr) = w.output(&["check"]);
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    let keys: Vec<String> = s3_keys(&prefix).await;
    assert_eq!(keys, vec![format!("{prefix}/.waltail-check")]);
    // check creates nothing on the source.
    let slots: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'waltail_checkok%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0);
    db.drop_db().await;
}

#[tokio::test]
async fn check_reports_wal_level_replica_with_the_setting_to_change() {
    let db = TestDb::on(&pg_replica_url(), "walreplica").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    let w = Waltail::new(&db, &unique("walrep").replace('_', "-"), "public.t");
    assert_check_fails(&w.output(&["check"]), "wal_level", "wal_level = logical");
}

#[tokio::test]
async fn check_reports_a_role_without_replication() {
    let db = TestDb::new("norepl").await;
    let role = unique("plain");
    db.exec(&format!(
        "CREATE ROLE {role} LOGIN; CREATE TABLE t (id int PRIMARY KEY); GRANT SELECT ON t TO {role}"
    ))
    .await;
    let mut w = Waltail::new(&db, &unique("norepl").replace('_', "-"), "public.t");
    let url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    w.set("WALTAIL_SOURCE_URL", &url);
    assert_check_fails(
        &w.output(&["check"]),
        "replication privilege",
        "WITH REPLICATION",
    );
    db.drop_db().await;
}

#[tokio::test]
async fn check_reports_a_missing_table_and_one_without_a_key() {
    let db = TestDb::new("notable").await;
    db.exec("CREATE TABLE nokey (v int)").await;
    let w = Waltail::new(
        &db,
        &unique("notable").replace('_', "-"),
        "public.missing,public.nokey",
    );
    let out = w.output(&["check"]);
    assert_check_fails(&out, "table public.missing", "remove");
    assert_check_fails(&out, "table public.nokey", "ADD PRIMARY KEY");
    db.drop_db().await;
}

#[tokio::test]
async fn check_reports_a_wrong_s3_secret() {
    let db = TestDb::new("badsecret").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    let mut w = Waltail::new(&db, &unique("badsecret").replace('_', "-"), "public.t");
    w.s3("badsecret")
        .set("WALTAIL_DESTINATION_SECRET_ACCESS_KEY", "not-the-secret");
    let out = w.output(&["check"]);
    assert_check_fails(&out, "write access", "secret_access_key");
    assert!(
        !out.1.contains("not-the-secret") && !out.2.contains("not-the-secret"),
        "the secret leaked:\n{}\n{}",
        out.1,
        out.2
    );
    db.drop_db().await;
}

#[tokio::test]
async fn check_reports_a_missing_bucket() {
    let db = TestDb::new("nobucket").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    let mut w = Waltail::new(&db, &unique("nobucket").replace('_', "-"), "public.t");
    w.s3("x")
        .set("WALTAIL_DESTINATION_BUCKET", "no-such-bucket-here");
    assert_check_fails(&w.output(&["check"]), "write access", "bucket");
    db.drop_db().await;
}

#[tokio::test]
async fn bad_configuration_names_the_key_and_exits_2() {
    let db = TestDb::new("badcfg").await;
    let mut w = Waltail::new(&db, &unique("badcfg").replace('_', "-"), "public.t");
    w.set("WALTAIL_DELIVERY_BATCH_SIZE", "0");
    let (status, _, stderr) = w.output(&["check"]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("delivery.batch_size"), "{stderr}");
    std::fs::write(
        w.dir.path().join("waltail.toml"),
        "[source]\nurl = \"postgres://x@h/db\"\ntables = [\"t\"]\ncolour = 1\n",
    )
    .unwrap();
    w.env.retain(|(k, _)| k == "WALTAIL_PIPELINE");
    let (status, _, stderr) = w.output(&["check"]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("colour"), "{stderr}");
    db.drop_db().await;
}
