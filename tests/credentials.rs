//! S3 credentials as AWS users have them, against stores that check them:
//! a profile of the shared files and a role assumed through STS (moto, an
//! AWS we did not write, whose S3 checks each request's signature and IAM
//! policy), and credentials that expire, fetched again while uploads go on
//! (SeaweedFS, through the profile's `credential_process`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// `python -m moto.server` on a free port, stopped by pid when dropped.
struct Moto {
    child: Child,
    endpoint: String,
    /// The account made by tests/fixtures/aws.py: {key, secret, role_arn}.
    account: Value,
}

fn moto_python() -> String {
    venv_python(
        "WT_TEST_MOTO_PYTHON",
        "waltail-moto-venv",
        "moto",
        "moto.sh",
    )
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/aws.py")
}

impl Moto {
    fn start() -> Moto {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(moto_python())
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            // The fixture's six set-up calls go through; every later request
            // is authenticated and authorized as AWS would.
            .env("INITIAL_NO_AUTH_ACTION_COUNT", "6")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let endpoint = format!("http://127.0.0.1:{port}");
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "moto did not listen"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut moto = Moto {
            child,
            endpoint,
            account: Value::Null,
        };
        moto.account = serde_json::from_str(&moto.fixture(&["setup"])).unwrap();
        moto
    }

    fn fixture(&self, args: &[&str]) -> String {
        let out = Command::new(moto_python())
            .arg(fixture())
            .arg(args[0])
            .arg(&self.endpoint)
            .args(&args[1..])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "aws.py {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn field(&self, name: &str) -> &str {
        self.account[name].as_str().unwrap()
    }

    /// The bucket's keys, read with the role.
    fn keys(&self) -> Vec<String> {
        let listed = self.fixture(&[
            "keys",
            self.field("key"),
            self.field("secret"),
            self.field("role_arn"),
        ]);
        serde_json::from_str(&listed).unwrap()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A pipeline into `bucket` at `endpoint` with no static keys: the shared
/// files `config` and `credentials` are written to its folder and are all
/// it has.
fn with_shared_files(
    db: &TestDb,
    tag: &str,
    endpoint: &str,
    bucket: &str,
    config: &str,
    credentials: &str,
) -> Waltail {
    let mut w = Waltail::new(db, &unique(tag).replace('_', "-"), "public.t");
    let dir = w.dir.path().to_path_buf();
    std::fs::write(dir.join("aws-config"), config).unwrap();
    std::fs::write(dir.join("aws-credentials"), credentials).unwrap();
    w.set("WALTAIL_DESTINATION_TYPE", "s3")
        .set("WALTAIL_DESTINATION_BUCKET", bucket)
        .set("WALTAIL_DESTINATION_PREFIX", tag)
        .set("WALTAIL_DESTINATION_ENDPOINT", endpoint)
        .set("WALTAIL_DESTINATION_REGION", "us-east-1")
        .set("WALTAIL_DESTINATION_USE_PATH_STYLE", "true")
        .set("AWS_CONFIG_FILE", dir.join("aws-config").to_str().unwrap())
        .set(
            "AWS_SHARED_CREDENTIALS_FILE",
            dir.join("aws-credentials").to_str().unwrap(),
        )
        // Nothing from this machine's instance metadata.
        .set("AWS_EC2_METADATA_DISABLED", "true");
    w
}

/// `destination.role_arn` with a profile's key: STS (moto) hands out the
/// role's credentials and the archive is written with them. The profile's
/// own key may only assume the role, so a PUT signed with it is refused:
/// shown by the same run without the role, and with a wrong external id.
#[tokio::test]
async fn a_role_assumed_through_sts_writes_the_archive() {
    let moto = Moto::start();
    let db = TestDb::new("assumerole").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    let credentials = format!(
        "[writer]\naws_access_key_id = {}\naws_secret_access_key = {}\n",
        moto.field("key"),
        moto.field("secret")
    );
    let mut w = with_shared_files(
        &db,
        "assumerole",
        &moto.endpoint,
        "archive",
        "[profile writer]\nregion = us-east-1\n",
        &credentials,
    );
    w.set("WALTAIL_DESTINATION_PROFILE", "writer")
        .set("AWS_ENDPOINT_URL_STS", &moto.endpoint);

    // The profile's key alone: moto refuses the PUT (AccessDenied).
    let out = w.output(&["check"]);
    assert_check_fails(&out, "write access", "s3:PutObject");

    // A wrong external id: STS refuses, and check says where to look.
    w.set("WALTAIL_DESTINATION_ROLE_ARN", moto.field("role_arn"))
        .set("WALTAIL_DESTINATION_EXTERNAL_ID", "not-the-id");
    let out = w.output(&["check"]);
    assert_check_fails(&out, "write access", "trust policy");

    w.set("WALTAIL_DESTINATION_EXTERNAL_ID", "archive-ext-1")
        .set("WALTAIL_DESTINATION_ROLE_SESSION_NAME", "waltail-test");
    let (status, stdout, stderr) = w.output(&["check"]);
    assert!(status.success(), "{stdout}\n{stderr}");
    assert_eq!(moto.keys(), vec!["assumerole/.waltail-check".to_string()]);

    w.start();
    db.exec("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 3) g")
        .await;
    let start = Instant::now();
    let archived = loop {
        let keys = moto.keys();
        if let Some(k) = keys.iter().find(|k| k.ends_with("-1-3.ndjson")) {
            break k.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no object with seqs 1-3 in {keys:?}:\n{}",
            w.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(archived.starts_with("assumerole/"), "{archived}");
    w.stop();
    // compact and query read and write with the same role.
    let (status, stdout, stderr) = w.output(&["compact"]);
    assert!(status.success(), "{stdout}\n{stderr}");
    let (status, stdout, stderr) = w.output(&[
        "query",
        "--format",
        "csv",
        "SELECT count(*) AS n, max(v) AS v FROM public.t",
    ]);
    assert!(status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "n,v\n3,v3", "{stderr}");
    db.drop_db().await;
}

/// A profile of the shared files signs for the archive (SeaweedFS checks the
/// signature); a profile that is not in them stops check with the files to
/// look at.
#[tokio::test]
async fn a_profile_of_the_shared_files_signs_for_the_archive() {
    let s3 = s3();
    let db = TestDb::new("profile").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    let prefix = unique("profile");
    let credentials = format!(
        "[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n\
         [archive]\naws_access_key_id = {}\naws_secret_access_key = {}\n",
        s3.key, s3.secret
    );
    let mut w = with_shared_files(&db, &prefix, &s3.endpoint, &s3.bucket, "", &credentials);

    // AWS_PROFILE, as the CLI takes it.
    w.set("AWS_PROFILE", "archive");
    let (status, stdout, stderr) = w.output(&["check"]);
    assert!(status.success(), "{stdout}\n{stderr}");

    // destination.profile over AWS_PROFILE.
    w.set("AWS_PROFILE", "default")
        .set("WALTAIL_DESTINATION_PROFILE", "archive");
    let (status, stdout, stderr) = w.output(&["check"]);
    assert!(status.success(), "{stdout}\n{stderr}");
    let keys: Vec<String> = s3_keys(&prefix).await;
    assert_eq!(keys, vec![format!("{prefix}/.waltail-check")]);

    w.set("WALTAIL_DESTINATION_PROFILE", "missing");
    let out = w.output(&["check"]);
    let report = assert_check_fails(&out, "write access", "AWS_CONFIG_FILE");
    assert!(report.contains("missing"), "{report}");
    db.drop_db().await;
}

/// Credentials that run out 30 s after they are handed out (the profile's
/// `credential_process`, as an SSO or vault helper gives them) are fetched
/// again before they do, while rows stream: every row is archived and no
/// upload fails.
#[tokio::test]
async fn expiring_credentials_are_fetched_again_before_they_run_out() {
    let s3 = s3();
    let db = TestDb::new("expiring").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    let prefix = unique("expiring");
    let mut w = with_shared_files(&db, &prefix, &s3.endpoint, &s3.bucket, "", "");
    let dir = w.dir.path().to_path_buf();
    let helper = dir.join("credentials-helper.sh");
    std::fs::write(
        &helper,
        format!(
            "#!/bin/sh\n\
             date +%s >> {calls}\n\
             printf '{{\"Version\": 1, \"AccessKeyId\": \"{key}\", \"SecretAccessKey\": \"{secret}\", \"Expiration\": \"%s\"}}' \
               \"$(date -u -d '+30 seconds' +%Y-%m-%dT%H:%M:%SZ)\"\n",
            calls = dir.join("calls").display(),
            key = s3.key,
            secret = s3.secret
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(
        dir.join("aws-config"),
        format!(
            "[profile rotating]\ncredential_process = {}\n",
            helper.display()
        ),
    )
    .unwrap();
    w.set("WALTAIL_DESTINATION_PROFILE", "rotating")
        .set("WALTAIL_LOG", "waltail=debug");
    let pipeline = w
        .env
        .iter()
        .find(|(k, _)| k == "WALTAIL_PIPELINE")
        .map(|(_, v)| v.clone())
        .unwrap();
    w.start();
    let calls = || {
        std::fs::read_to_string(dir.join("calls"))
            .unwrap_or_default()
            .lines()
            .count()
    };
    // 40 s of one row every 100 ms: the credential is fetched again at
    // about 15 s and 30 s.
    let start = Instant::now();
    let mut rows = 0;
    while start.elapsed() < Duration::from_secs(40) {
        rows += 1;
        db.exec(&format!("INSERT INTO t VALUES ({rows})")).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let start = Instant::now();
    loop {
        let objects = s3_objects(&prefix).await;
        let archived = checked_changes(&objects, Some(&prefix), &pipeline);
        if archived.len() == rows {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{} of {rows} rows archived:\n{}",
            archived.len(),
            w.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let log = w.log();
    w.stop();
    assert!(calls() >= 3, "the helper ran {} times:\n{log}", calls());
    // Each fetch came before the one before it ran out (30 s): at about
    // half its lifetime.
    let times: Vec<u64> = std::fs::read_to_string(dir.join("calls"))
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    for pair in times.windows(2) {
        assert!(pair[1] - pair[0] < 25, "fetched at {times:?}");
    }
    assert_eq!(
        log.matches("S3 credentials fetched").count(),
        calls(),
        "{log}"
    );
    for failed in ["WARN", "ERROR", "retry"] {
        assert!(!log.contains(failed), "{failed} in the log:\n{log}");
    }
    db.drop_db().await;
}
