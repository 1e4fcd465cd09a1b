//! A dedicated, throwaway PostgreSQL per test, for tests that restart or stop
//! the server (the shared one at WT_TEST_PG must never be restarted).
//!
//! `DedicatedPg::start()` runs scripts/pg-start.sh with its own PG_ROOT under
//! the temp folder and a free port; dropping it stops the server
//! (scripts/pg-stop.sh) and removes the folder. The methods block (a few
//! seconds at most), which is fine from #[tokio::test] too.
//!
//! `DedicatedPg::start_tls()` is the same server with `ssl = on`, a
//! certificate for `localhost` and `127.0.0.1` signed by a CA made for the
//! test (`ca_file()`; `other_ca_file()` is an unrelated CA), and a
//! pg_hba.conf that allows TCP only over TLS (`hostssl`); the Unix socket
//! (`socket_url()`) stays open for the test's own plaintext sessions.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub(crate) struct DedicatedPg {
    root: PathBuf,
    port: u16,
    url: String,
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Runs `openssl` with `args` split at spaces.
fn openssl(dir: &Path, args: &str) {
    let out = Command::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl (Debian: apt-get install openssl): {e}"));
    check(&format!("openssl {args}"), out);
}

/// A CA (`<name>.pem`, `<name>.key`) in `dir`.
fn make_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &format!(
            "req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
             -subj /CN={name} -keyout {name}.key -out {name}.pem \
             -addext basicConstraints=critical,CA:TRUE \
             -addext keyUsage=critical,keyCertSign,cRLSign"
        ),
    );
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(name)
}

/// PG_BIN, else the newest /usr/lib/postgresql/<version>/bin (as the scripts do).
fn pg_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("PG_BIN") {
        return bin.into();
    }
    let version = |p: &Path| -> Vec<u32> {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        name.split('.').map(|s| s.parse().unwrap_or(0)).collect()
    };
    std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries not found under /usr/lib/postgresql: set PG_BIN")
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists())
        .max_by_key(|bin| version(bin.parent().unwrap()))
        .expect("PostgreSQL server binaries not found under /usr/lib/postgresql: set PG_BIN")
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

fn check(what: &str, out: Output) -> Output {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

impl DedicatedPg {
    /// A fresh server with wal_level=logical; retried on another port if the
    /// chosen one was taken in the meantime.
    pub(crate) fn start() -> DedicatedPg {
        let root = std::env::temp_dir().join(format!(
            "waltail-dpg-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        ));
        let mut last = None;
        for _ in 0..3 {
            let port = free_port();
            let out = Command::new(script("pg-start.sh"))
                .env("PG_ROOT", &root)
                .env("PG_PORT", port.to_string())
                .env_remove("PG_KEEP")
                .env_remove("PG_WAL_LEVEL")
                .output()
                .unwrap();
            if out.status.success() {
                let stdout = String::from_utf8_lossy(&out.stdout);
                let url = stdout
                    .lines()
                    .rfind(|l| l.starts_with("postgres://"))
                    .unwrap_or_else(|| panic!("pg-start.sh printed no URL:\n{stdout}"))
                    .to_string();
                return DedicatedPg { root, port, url };
            }
            last = Some(out);
        }
        let out = last.unwrap();
        let log = std::fs::read_to_string(root.join("server.log")).unwrap_or_default();
        let _ = std::fs::remove_dir_all(&root);
        panic!(
            "pg-start.sh failed ({}):\n{}\nserver.log:\n{log}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Like [`start`](Self::start), with TLS on and TCP allowed only over TLS
    /// (see the module doc).
    pub(crate) fn start_tls() -> DedicatedPg {
        let pg = DedicatedPg::start();
        let dir = pg.root.join("tls");
        std::fs::create_dir_all(&dir).unwrap();
        make_ca(&dir, "ca");
        make_ca(&dir, "other-ca");
        openssl(
            &dir,
            "req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
             -subj /CN=localhost -keyout server.key -out server.csr",
        );
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName = DNS:localhost, IP:127.0.0.1\n\
             basicConstraints = critical, CA:FALSE\n\
             keyUsage = critical, digitalSignature\n\
             extendedKeyUsage = serverAuth\n",
        )
        .unwrap();
        openssl(
            &dir,
            "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
             -extfile server.ext -out server.pem",
        );
        // Postgres refuses a key file others can read, or owned by another user.
        let key = dir.join("server.key");
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        if is_root() {
            check(
                "chown",
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&dir)
                    .output()
                    .unwrap(),
            );
        }
        let data = pg.root.join("data");
        let mut conf = std::fs::read_to_string(data.join("postgresql.conf")).unwrap();
        conf.push_str(&format!(
            "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
            dir.join("server.pem").display(),
            key.display()
        ));
        std::fs::write(data.join("postgresql.conf"), conf).unwrap();
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\n\
             local replication all trust\n\
             hostssl all all 127.0.0.1/32 trust\n\
             hostssl replication all 127.0.0.1/32 trust\n\
             hostssl all all ::1/128 trust\n\
             hostssl replication all ::1/128 trust\n",
        )
        .unwrap();
        pg.restart();
        pg
    }

    /// The CA that signed the server's certificate (TLS servers only).
    pub(crate) fn ca_file(&self) -> PathBuf {
        self.root.join("tls").join("ca.pem")
    }

    /// A CA that did not sign it.
    pub(crate) fn other_ca_file(&self) -> PathBuf {
        self.root.join("tls").join("other-ca.pem")
    }

    /// The server over its Unix socket (no TLS needed there):
    /// `postgres://postgres@<percent-encoded socket dir>:<port>/postgres`.
    pub(crate) fn socket_url(&self) -> String {
        let dir = self.root.to_string_lossy().replace('/', "%2F");
        format!("postgres://postgres@{dir}:{}/postgres", self.port)
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres` (trust auth).
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// The PG_ROOT folder: data/, server.log, the unix socket.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// `pg_ctl <args>` on this server's data folder, as the postgres OS user
    /// when running as root (Postgres refuses to run as root).
    fn pg_ctl(&self, args: &[&str]) -> Output {
        self.pg_ctl_command(args).output().unwrap()
    }

    fn pg_ctl_command(&self, args: &[&str]) -> Command {
        let pg_ctl = pg_bin().join("pg_ctl");
        let mut cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(pg_ctl);
            c
        } else {
            Command::new(pg_ctl)
        };
        // -l always: without it the server would inherit our stdout pipe.
        cmd.arg("-D")
            .arg(self.root.join("data"))
            .arg("-l")
            .arg(self.root.join("server.log"))
            .args(args)
            .current_dir("/");
        cmd
    }

    /// Starts a fast restart that waits up to `secs` for the server to go
    /// down and come back; the caller waits for the child. A shutdown
    /// waits for each logical walsender's client to confirm the WAL it was
    /// sent, so it lasts as long as the client cannot (a store down, a
    /// batch parked).
    pub(crate) fn restart_in_background(&self, secs: u32) -> std::process::Child {
        self.pg_ctl_command(&["-m", "fast", "-w", "-t", &secs.to_string(), "restart"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    }

    /// Fast restart (open connections are terminated); returns when it accepts
    /// connections again.
    pub(crate) fn restart(&self) {
        check(
            "pg_ctl restart",
            self.pg_ctl(&["-m", "fast", "-w", "restart"]),
        );
    }

    /// Fast stop; returns when the server is down.
    pub(crate) fn stop(&self) {
        check("pg_ctl stop", self.pg_ctl(&["-m", "fast", "-w", "stop"]));
    }

    /// Starts the server again after `stop`, with its data.
    pub(crate) fn start_again(&self) {
        check("pg_ctl start", self.pg_ctl(&["-w", "start"]));
    }
}

impl Drop for DedicatedPg {
    fn drop(&mut self) {
        let _ = Command::new(script("pg-stop.sh"))
            .env("PG_ROOT", &self.root)
            .output();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
