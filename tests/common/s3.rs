//! A dedicated, throwaway SeaweedFS S3 endpoint per test, for tests that stop,
//! kill or restart the store (the shared one at WT_TEST_S3_ENDPOINT must never
//! be disturbed).
//!
//! `DedicatedS3::start()` runs scripts/s3-start.sh with its own S3_ROOT under
//! the temp folder and a free port base (S3_PORT_BASE: ten consecutive ports);
//! dropping it stops the server by pid (scripts/s3-stop.sh, continuing it first
//! if it was SIGSTOPped) and removes the folder. Same bucket and keys as the
//! shared one (the scripts' defaults). The methods block (a few seconds at
//! most), which is fine from #[tokio::test] too.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;

use super::{Object, Waltail, proc_stat_field};

/// The bucket and admin keys s3-start.sh uses by default.
pub(crate) const BUCKET: &str = "waltail-test";
pub(crate) const KEY: &str = "waltail-test-key";
pub(crate) const SECRET: &str = "waltail-test-secret";

/// Ports s3-start.sh derives from S3_PORT_BASE (base..base+9).
const PORTS: u16 = 10;

pub(crate) struct DedicatedS3 {
    root: PathBuf,
    base: u16,
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(name)
}

/// A base whose ten ports are free now, below the usual ephemeral range
/// (32768+) so outgoing connections are unlikely to take one meanwhile.
fn free_port_base() -> u16 {
    for _ in 0..200 {
        let base = fastrand::u16(2000..3200) * 10;
        let free =
            (base..base + PORTS).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok());
        if free {
            return base;
        }
    }
    panic!("no free range of {PORTS} ports found for a dedicated SeaweedFS");
}

fn script_command(name: &str, root: &Path) -> Command {
    let mut cmd = Command::new(script(name));
    cmd.env("S3_ROOT", root);
    for var in [
        "S3_PORT",
        "S3_PORT_BASE",
        "S3_KEEP",
        "S3_BUCKET",
        "S3_KEY",
        "S3_SECRET",
        "S3_PUT_KEY",
        "S3_PUT_SECRET",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn failure(what: &str, out: &Output, root: &Path) -> String {
    let log = std::fs::read_to_string(root.join("weed.log")).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(40).collect();
    format!(
        "{what} failed ({}):\n{}{}\nweed.log (last lines):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    )
}

/// Whether `pid` is gone or a zombie (killed, not yet reaped by init).
fn dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => proc_stat_field(&stat, 3).is_some_and(|state| state == "Z" || state == "X"),
    }
}

fn signal(pid: u32, sig: &str) -> bool {
    Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .output()
        .is_ok_and(|o| o.status.success())
}

impl DedicatedS3 {
    /// A fresh, empty store with the test bucket; retried on another port
    /// base if one of the chosen ports was taken in the meantime.
    pub(crate) fn start() -> DedicatedS3 {
        let root = std::env::temp_dir().join(format!(
            "waltail-ds3-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        ));
        let mut last = String::new();
        for _ in 0..3 {
            let base = free_port_base();
            let out = script_command("s3-start.sh", &root)
                .env("S3_PORT_BASE", base.to_string())
                .output()
                .unwrap();
            if out.status.success() {
                return DedicatedS3 { root, base };
            }
            last = failure("s3-start.sh", &out, &root);
            let _ = script_command("s3-stop.sh", &root).output();
        }
        let _ = std::fs::remove_dir_all(&root);
        panic!("{last}");
    }

    /// `http://127.0.0.1:<base>`.
    pub(crate) fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.base)
    }

    pub(crate) fn port_base(&self) -> u16 {
        self.base
    }

    /// The S3_ROOT folder: data/, weed.log, weed.pid, s3.json.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// The server's pid, from <root>/weed.pid.
    pub(crate) fn pid(&self) -> u32 {
        let pid = std::fs::read_to_string(self.root.join("weed.pid"))
            .expect("weed.pid: the dedicated SeaweedFS is not running");
        pid.trim().parse().unwrap()
    }

    /// SIGSTOP: connections are still accepted by the kernel, requests hang.
    pub(crate) fn stop_signal(&self) {
        assert!(signal(self.pid(), "STOP"), "kill -STOP failed");
    }

    /// SIGCONT after `stop_signal`.
    pub(crate) fn cont_signal(&self) {
        assert!(signal(self.pid(), "CONT"), "kill -CONT failed");
    }

    /// kill -9; returns once the process is gone (its ports are closed).
    pub(crate) fn kill9(&self) {
        let pid = self.pid();
        assert!(signal(pid, "KILL"), "kill -9 failed");
        let start = Instant::now();
        while !dead(pid) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "SeaweedFS {pid} still alive 10 s after kill -9"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // s3-stop.sh (run by s3-start.sh) would wait on a not-yet-reaped zombie.
        let _ = std::fs::remove_file(self.root.join("weed.pid"));
    }

    /// Starts the server again on the same ports and data (S3_KEEP=1); stops
    /// it first if it still runs. Returns when a signed PUT succeeds.
    pub(crate) fn restart_keep_data(&self) {
        if let Ok(pid) = std::fs::read_to_string(self.root.join("weed.pid"))
            && let Ok(pid) = pid.trim().parse::<u32>()
        {
            signal(pid, "CONT");
        }
        let out = script_command("s3-start.sh", &self.root)
            .env("S3_PORT_BASE", self.base.to_string())
            .env("S3_KEEP", "1")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            failure("s3-start.sh (S3_KEEP=1)", &out, &self.root)
        );
    }

    /// Points `w` at this store's test bucket under `prefix`, admin keys.
    pub(crate) fn configure(&self, w: &mut Waltail, prefix: &str) {
        w.s3(prefix)
            .set("WALTAIL_DESTINATION_ENDPOINT", &self.endpoint())
            .set("WALTAIL_DESTINATION_BUCKET", BUCKET)
            .set("WALTAIL_DESTINATION_ACCESS_KEY_ID", KEY)
            .set("WALTAIL_DESTINATION_SECRET_ACCESS_KEY", SECRET);
    }

    /// An object_store client on this store's bucket with the admin keys.
    pub(crate) fn admin_store(&self) -> Arc<dyn ObjectStore> {
        Arc::new(
            AmazonS3Builder::new()
                .with_bucket_name(BUCKET)
                .with_endpoint(self.endpoint())
                .with_region("us-east-1")
                .with_access_key_id(KEY)
                .with_secret_access_key(SECRET)
                .with_virtual_hosted_style_request(false)
                .with_allow_http(true)
                .build()
                .unwrap(),
        )
    }

    /// Every object under `prefix`, sorted by key (as `s3_objects` does for
    /// the shared store).
    pub(crate) async fn objects(&self, prefix: &str) -> Vec<Object> {
        super::objects_in(self.admin_store().as_ref(), prefix).await
    }
}

impl Drop for DedicatedS3 {
    fn drop(&mut self) {
        // A SIGSTOPped server would not act on SIGTERM; s3-stop.sh continues
        // it too, after the TERM.
        if let Ok(pid) = std::fs::read_to_string(self.root.join("weed.pid"))
            && let Ok(pid) = pid.trim().parse::<u32>()
        {
            signal(pid, "CONT");
        }
        let _ = script_command("s3-stop.sh", &self.root).output();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
