//! Opening a replication connection: the hosts to try, the socket and TLS
//! (an SSLRequest on TCP unless `sslmode=disable`, never on a Unix socket),
//! the startup packet with the output settings, and authentication
//! (cleartext, MD5, SCRAM-SHA-256 without channel binding), up to the
//! first ReadyForQuery.

use std::borrow::Cow;
use std::collections::HashMap;

use bytes::BytesMut;
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{self, ChannelBinding, ScramSha256};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_postgres::config::{Host, SslNegotiation};
// Re-exported by tokio-postgres; the backend parsers' iterators implement it.
use tokio_postgres::fallible_iterator::FallibleIterator;

use super::frame::{BoxedRead, BoxedWrite, FrameReader, log_notice, unexpected, write_pending};
use crate::error::ReplicationError;
use crate::pgtls::{NEEDS_TLS_HINT, TlsError, TlsSettings};

const DEFAULT_PORT: u16 = 5432;

/// What a replication connection is opened with: the Postgres settings and
/// the TLS settings. A plain tokio-postgres configuration gives its own
/// `sslmode` (disable, prefer or require, no CA);
/// [`crate::source::PgConfig`] carries the full settings of `source.url`.
pub trait ConnectParams {
    /// Host, port, user, password, database and timeouts.
    fn pg(&self) -> &tokio_postgres::Config;
    /// How to negotiate TLS: sslmode, CA and client certificate.
    fn tls(&self) -> Cow<'_, TlsSettings>;
}

impl ConnectParams for tokio_postgres::Config {
    fn pg(&self) -> &tokio_postgres::Config {
        self
    }
    fn tls(&self) -> Cow<'_, TlsSettings> {
        Cow::Owned(TlsSettings::from_tokio_postgres(self.get_ssl_mode()))
    }
}

impl ConnectParams for crate::source::PgConfig {
    fn pg(&self) -> &tokio_postgres::Config {
        &self.pg
    }
    fn tls(&self) -> Cow<'_, TlsSettings> {
        Cow::Borrowed(&self.tls)
    }
}

/// A replication-mode connection in the idle (ReadyForQuery) state.
pub struct ReplicationConnection {
    pub(super) reader: FrameReader,
    pub(super) writer: BoxedWrite,
    pub(super) out: BytesMut,
    parameters: HashMap<String, String>,
    backend_pid: Option<i32>,
}

impl std::fmt::Debug for ReplicationConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationConnection")
            .field("server_version", &self.server_version())
            .field("backend_pid", &self.backend_pid)
            .finish_non_exhaustive()
    }
}

enum Target {
    /// Address (hostaddr or host) and port, and the host name the server's
    /// certificate is checked against (host when given, as libpq does).
    Tcp(String, u16, String),
    #[cfg(unix)]
    Unix(std::path::PathBuf),
}

/// An open socket, with TLS or without.
struct Opened {
    rd: BoxedRead,
    wr: BoxedWrite,
    tls: bool,
}

impl Target {
    fn describe(&self) -> String {
        match self {
            Target::Tcp(host, port, _) if host.contains(':') => format!("[{host}]:{port}"),
            Target::Tcp(host, port, _) => format!("{host}:{port}"),
            #[cfg(unix)]
            Target::Unix(path) => path.display().to_string(),
        }
    }

    /// Opens the socket and negotiates TLS. A failure to reach the server is
    /// [`ReplicationError::Connect`] (the next host is tried); a TLS refusal
    /// is [`ReplicationError::Tls`].
    async fn open(
        &self,
        tls: &TlsSettings,
        negotiation: SslNegotiation,
    ) -> Result<Opened, ReplicationError> {
        let addr = self.describe();
        let connect_err = |source| ReplicationError::Connect {
            addr: addr.clone(),
            source,
        };
        match self {
            Target::Tcp(host, port, name) => {
                let mut stream = tokio::net::TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(connect_err)?;
                // Status updates are tiny and latency-sensitive (they release WAL
                // on the server); do not let Nagle hold them back.
                stream.set_nodelay(true).map_err(connect_err)?;
                if tls.mode == crate::pgtls::SslMode::Disable {
                    let (r, w) = stream.into_split();
                    return Ok(Opened {
                        rd: Box::new(r),
                        wr: Box::new(w),
                        tls: false,
                    });
                }
                if negotiation != SslNegotiation::Direct {
                    let mut out = BytesMut::new();
                    frontend::ssl_request(&mut out);
                    stream.write_all(&out).await.map_err(connect_err)?;
                    // Exactly one byte: anything after it must come through TLS.
                    let answer = stream.read_u8().await.map_err(connect_err)?;
                    match answer {
                        b'S' => {}
                        b'N' if tls.mode.requires_tls() => {
                            return Err(ReplicationError::Tls(TlsError::not_supported(tls.mode)));
                        }
                        b'N' => {
                            tracing::debug!(%addr, "the server does not offer TLS; plaintext (sslmode=prefer)");
                            let (r, w) = stream.into_split();
                            return Ok(Opened {
                                rd: Box::new(r),
                                wr: Box::new(w),
                                tls: false,
                            });
                        }
                        other => {
                            return Err(ReplicationError::Protocol(format!(
                                "unexpected answer {:?} to the SSLRequest",
                                other as char
                            )));
                        }
                    }
                }
                let stream = tls.handshake(name, stream).await.map_err(|e| {
                    if e.fatal {
                        ReplicationError::Tls(e)
                    } else {
                        connect_err(std::io::Error::other(e.message))
                    }
                })?;
                tracing::debug!(%addr, "TLS established");
                let (r, w) = tokio::io::split(stream);
                Ok(Opened {
                    rd: Box::new(r),
                    wr: Box::new(w),
                    tls: true,
                })
            }
            #[cfg(unix)]
            Target::Unix(path) => {
                let stream = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(connect_err)?;
                let (r, w) = stream.into_split();
                Ok(Opened {
                    rd: Box::new(r),
                    wr: Box::new(w),
                    tls: false,
                })
            }
        }
    }
}

/// Hosts to try, in order, mirroring tokio-postgres/libpq: `hostaddr[i]`
/// overrides `host[i]`; one port applies to all hosts, otherwise one per host.
fn targets(config: &tokio_postgres::Config) -> Result<Vec<Target>, ReplicationError> {
    let hosts = config.get_hosts();
    let hostaddrs = config.get_hostaddrs();
    let ports = config.get_ports();
    if hosts.is_empty() && hostaddrs.is_empty() {
        return Err(ReplicationError::Unsupported(
            "the connection configuration has neither host nor hostaddr".into(),
        ));
    }
    if !hosts.is_empty() && !hostaddrs.is_empty() && hosts.len() != hostaddrs.len() {
        return Err(ReplicationError::Unsupported(format!(
            "number of hosts ({}) differs from number of hostaddrs ({})",
            hosts.len(),
            hostaddrs.len()
        )));
    }
    let n = hosts.len().max(hostaddrs.len());
    if ports.len() > 1 && ports.len() != n {
        return Err(ReplicationError::Unsupported(format!(
            "{} ports given for {n} hosts",
            ports.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let port = ports
            .get(i)
            .or_else(|| ports.first())
            .copied()
            .unwrap_or(DEFAULT_PORT);
        let target = match (hostaddrs.get(i), hosts.get(i)) {
            (Some(addr), Some(Host::Tcp(host))) => {
                Target::Tcp(addr.to_string(), port, host.clone())
            }
            (Some(addr), _) => Target::Tcp(addr.to_string(), port, addr.to_string()),
            (None, Some(Host::Tcp(host))) => Target::Tcp(host.clone(), port, host.clone()),
            #[cfg(unix)]
            (None, Some(Host::Unix(dir))) => Target::Unix(dir.join(format!(".s.PGSQL.{port}"))),
            (None, None) => unreachable!("n is the larger of both lengths"),
        };
        out.push(target);
    }
    Ok(out)
}

/// A plaintext session refused by pg_hba.conf's `hostssl` lines gets the fix
/// as its hint.
fn explain_no_tls(err: ReplicationError) -> ReplicationError {
    match err {
        ReplicationError::Server {
            severity,
            code,
            message,
            detail,
            hint: None,
        } if crate::source::refused_for_no_tls(&code, &message) => ReplicationError::Server {
            severity,
            code,
            message,
            detail,
            hint: Some(NEEDS_TLS_HINT.to_string()),
        },
        other => other,
    }
}

fn check_supported(config: &tokio_postgres::Config) -> Result<(), ReplicationError> {
    if config.get_channel_binding() == tokio_postgres::config::ChannelBinding::Require {
        return Err(ReplicationError::Unsupported(
            "channel_binding=require is not supported; remove it from source.url".into(),
        ));
    }
    Ok(())
}

impl ReplicationConnection {
    /// Connects with the host/port/user/password/dbname of `config`, trying each
    /// host in order until a socket opens (like libpq, an authentication,
    /// TLS or server error on a reachable host is returned, not skipped), then
    /// negotiates TLS as `config`'s TLS settings say, authenticates and waits
    /// for ReadyForQuery.
    pub async fn connect(
        params: &impl ConnectParams,
        application_name: &str,
    ) -> Result<Self, ReplicationError> {
        let config = params.pg();
        let tls = params.tls();
        check_supported(config)?;
        let user = match config.get_user() {
            Some(user) => user.to_owned(),
            // libpq falls back to the OS user name; so do we.
            None => std::env::var("USER")
                .or_else(|_| std::env::var("LOGNAME"))
                .map_err(|_| {
                    ReplicationError::Unsupported("no user in the connection configuration".into())
                })?,
        };
        let targets = targets(config)?;
        let timeout = config.get_connect_timeout().copied();

        let negotiation = config.get_ssl_negotiation();
        let mut last_err = None;
        for target in &targets {
            let addr = target.describe();
            let open = target.open(&tls, negotiation);
            let opened = match timeout {
                Some(t) => match tokio::time::timeout(t, open).await {
                    Ok(r) => r,
                    Err(_) => Err(ReplicationError::Connect {
                        addr: addr.clone(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("timed out after {t:?}"),
                        ),
                    }),
                },
                None => open.await,
            };
            match opened {
                Ok(Opened { rd, wr, tls }) => {
                    tracing::debug!(%addr, tls, "replication socket open");
                    let mut conn = ReplicationConnection {
                        reader: FrameReader::new(rd),
                        writer: wr,
                        out: BytesMut::with_capacity(1024),
                        parameters: HashMap::new(),
                        backend_pid: None,
                    };
                    return match conn.startup(config, &user, application_name).await {
                        Ok(()) => Ok(conn),
                        Err(e) if !tls => Err(explain_no_tls(e)),
                        Err(e) => Err(e),
                    };
                }
                Err(e @ ReplicationError::Connect { .. }) => {
                    tracing::warn!(%addr, error = %e, "cannot open replication socket");
                    last_err = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last_err.expect("targets() never returns an empty list"))
    }

    async fn startup(
        &mut self,
        config: &tokio_postgres::Config,
        user: &str,
        application_name: &str,
    ) -> Result<(), ReplicationError> {
        let mut params: Vec<(&str, &str)> = vec![
            ("user", user),
            ("replication", "database"),
            ("application_name", application_name),
            // Rows from simple_query are decoded as UTF-8.
            ("client_encoding", "UTF8"),
        ];
        // Settings in the startup packet also apply to the walsender, so
        // pgoutput/SQL text output is formatted predictably.
        params.extend(crate::source::OUTPUT_SETTINGS);
        if let Some(db) = config.get_dbname() {
            params.push(("database", db));
        }
        if let Some(options) = config.get_options() {
            params.push(("options", options));
        }
        frontend::startup_message(params.iter().copied(), &mut self.out)?;
        self.flush_out().await?;
        self.authenticate(user, config.get_password()).await?;

        loop {
            let frame = self.reader.next_frame().await?;
            let tag = frame.tag;
            match frame.parse()? {
                Message::ReadyForQuery(_) => return Ok(()),
                Message::ParameterStatus(body) => self.store_parameter(&body),
                Message::BackendKeyData(body) => self.backend_pid = Some(body.process_id()),
                Message::NoticeResponse(body) => log_notice(body.fields()),
                Message::ErrorResponse(body) => {
                    return Err(ReplicationError::from_fields(body.fields()));
                }
                _ => return Err(unexpected("startup", tag)),
            }
        }
    }

    async fn authenticate(
        &mut self,
        user: &str,
        password: Option<&[u8]>,
    ) -> Result<(), ReplicationError> {
        let need_password = |method: &str| {
            password.ok_or_else(|| {
                ReplicationError::Unsupported(format!(
                    "the server requires {method} authentication but no password was given"
                ))
            })
        };
        let mut scram: Option<ScramSha256> = None;
        loop {
            let frame = self.reader.next_frame().await?;
            let tag = frame.tag;
            match frame.parse()? {
                Message::AuthenticationOk => return Ok(()),
                Message::AuthenticationCleartextPassword => {
                    let pw = need_password("password")?;
                    frontend::password_message(pw, &mut self.out)?;
                    self.flush_out().await?;
                }
                Message::AuthenticationMd5Password(body) => {
                    let pw = need_password("md5")?;
                    let hash = md5_hash(user.as_bytes(), pw, body.salt());
                    frontend::password_message(hash.as_bytes(), &mut self.out)?;
                    self.flush_out().await?;
                }
                Message::AuthenticationSasl(body) => {
                    let mut mechanisms = body.mechanisms();
                    let mut has_scram = false;
                    while let Some(m) = sasl_next(&mut mechanisms)? {
                        has_scram |= m == sasl::SCRAM_SHA_256;
                    }
                    if !has_scram {
                        return Err(ReplicationError::Unsupported(
                            "the server offers no SASL mechanism we support (only SCRAM-SHA-256 without channel binding)".into(),
                        ));
                    }
                    let pw = need_password("SCRAM-SHA-256")?;
                    let s = ScramSha256::new(pw, ChannelBinding::unsupported());
                    frontend::sasl_initial_response(
                        sasl::SCRAM_SHA_256,
                        s.message(),
                        &mut self.out,
                    )?;
                    self.flush_out().await?;
                    scram = Some(s);
                }
                Message::AuthenticationSaslContinue(body) => {
                    let s = scram
                        .as_mut()
                        .ok_or_else(|| unexpected("authentication", tag))?;
                    s.update(body.data())
                        .map_err(|e| ReplicationError::Protocol(format!("SCRAM: {e}")))?;
                    frontend::sasl_response(s.message(), &mut self.out)?;
                    self.flush_out().await?;
                }
                Message::AuthenticationSaslFinal(body) => {
                    let s = scram
                        .as_mut()
                        .ok_or_else(|| unexpected("authentication", tag))?;
                    // Verifies the server signature: a server that does not know
                    // the password cannot impersonate the real one.
                    s.finish(body.data()).map_err(|e| {
                        ReplicationError::Protocol(format!("SCRAM server verification: {e}"))
                    })?;
                }
                Message::AuthenticationGss
                | Message::AuthenticationGssContinue(_)
                | Message::AuthenticationSspi
                | Message::AuthenticationKerberosV5
                | Message::AuthenticationScmCredential => {
                    return Err(ReplicationError::Unsupported(
                        "the server requires GSSAPI/SSPI/Kerberos/SCM authentication".into(),
                    ));
                }
                Message::NoticeResponse(body) => log_notice(body.fields()),
                Message::ErrorResponse(body) => {
                    return Err(ReplicationError::from_fields(body.fields()));
                }
                _ => return Err(unexpected("authentication", tag)),
            }
        }
    }

    pub(super) fn store_parameter(
        &mut self,
        body: &postgres_protocol::message::backend::ParameterStatusBody,
    ) {
        if let (Ok(name), Ok(value)) = (body.name(), body.value()) {
            self.parameters.insert(name.to_owned(), value.to_owned());
        }
    }

    pub(super) async fn flush_out(&mut self) -> Result<(), ReplicationError> {
        write_pending(&mut self.writer, &mut self.out).await
    }

    /// `server_version` as reported by the server at startup, e.g. "15.6 (Debian ...)".
    pub fn server_version(&self) -> Option<&str> {
        self.parameter("server_version")
    }

    /// Any ParameterStatus value the server reported.
    pub fn parameter(&self, name: &str) -> Option<&str> {
        self.parameters.get(name).map(String::as_str)
    }

    /// Process id of the walsender serving this connection.
    pub fn backend_pid(&self) -> Option<i32> {
        self.backend_pid
    }
}

fn sasl_next<'a>(
    it: &mut postgres_protocol::message::backend::SaslMechanisms<'a>,
) -> Result<Option<&'a str>, ReplicationError> {
    it.next()
        .map_err(|e| ReplicationError::Protocol(format!("bad SASL mechanism list: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-connection fake server that answers 'N' to the SSLRequest, then
    /// (if the client goes on in plaintext) reads the startup packet and
    /// refuses it as pg_hba.conf's `hostssl`-only lines do.
    async fn server_without_tls() -> (u16, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 8];
            sock.read_exact(&mut req).await.unwrap();
            sock.write_all(b"N").await.unwrap();
            let mut startup = Vec::new();
            let mut len = [0u8; 4];
            if sock.read_exact(&mut len).await.is_ok() {
                let mut rest = vec![0u8; u32::from_be_bytes(len) as usize - 4];
                sock.read_exact(&mut rest).await.unwrap();
                startup = rest;
                let mut body = Vec::new();
                for (t, v) in [
                    (b'S', "FATAL"),
                    (b'V', "FATAL"),
                    (b'C', "28000"),
                    (
                        b'M',
                        "no pg_hba.conf entry for host \"127.0.0.1\", user \"x\", database \"x\", no encryption",
                    ),
                ] {
                    body.push(t);
                    body.extend_from_slice(v.as_bytes());
                    body.push(0);
                }
                body.push(0);
                let mut msg = vec![b'E'];
                msg.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
                msg.extend_from_slice(&body);
                sock.write_all(&msg).await.unwrap();
            }
            req.iter().copied().chain(startup).collect()
        });
        (port, task)
    }

    #[tokio::test]
    async fn require_refuses_a_server_without_tls() {
        let (port, server) = server_without_tls().await;
        let config: tokio_postgres::Config =
            format!("host=127.0.0.1 port={port} user=x sslmode=require")
                .parse()
                .unwrap();
        let err = ReplicationConnection::connect(&config, "t")
            .await
            .unwrap_err();
        assert!(
            matches!(err, ReplicationError::Tls(ref e) if e.message == "the server does not support TLS (sslmode=require)"),
            "{err}"
        );
        let seen = server.await.unwrap();
        // SSLRequest: length 8, code 80877103.
        assert_eq!(&seen[..8], &[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]);
    }

    #[tokio::test]
    async fn prefer_falls_back_to_plaintext_and_explains_a_hostssl_refusal() {
        let (port, server) = server_without_tls().await;
        let config: tokio_postgres::Config = format!("host=127.0.0.1 port={port} user=x")
            .parse()
            .unwrap();
        let err = ReplicationConnection::connect(&config, "t")
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some("28000"));
        assert!(
            err.to_string()
                .contains("hint: the server requires TLS: set sslmode=require"),
            "{err}"
        );
        let seen = server.await.unwrap();
        assert!(seen.len() > 8, "no startup packet after 'N'");
    }

    #[tokio::test]
    async fn connect_failure_reports_last_address() {
        // Port 1 on loopback is closed on any sane test machine.
        let config: tokio_postgres::Config =
            "host=127.0.0.1,localhost port=1 user=x".parse().unwrap();
        let err = ReplicationConnection::connect(&config, "t")
            .await
            .unwrap_err();
        match err {
            ReplicationError::Connect { addr, .. } => assert_eq!(addr, "localhost:1"),
            other => panic!("unexpected {other}"),
        }
    }
}
