//! A minimal PostgreSQL *replication* connection (`replication=database`),
//! speaking just enough of the frontend/backend protocol to stream logical
//! decoding output (`START_REPLICATION ... LOGICAL`) and send standby status
//! updates.
//!
//! tokio-postgres cannot do this: it never sends `replication=database` in the
//! startup packet and has no CopyBoth support. So this module drives the wire
//! protocol itself, reusing `postgres-protocol` for message encoding, the
//! parsing of well-known backend messages, and MD5/SCRAM authentication.
//!
//! Guarantees:
//! - [`ReplicationStream::next`] is cancel-safe: the only await point is a
//!   `read_buf` into a buffer owned by the stream, so partially received frames
//!   survive a dropped future and no message is lost or duplicated.
//! - [`FeedbackSender::send_status`] never leaves half a message on the wire if
//!   its future is dropped: unsent bytes are kept and sent first next time.
//! - A frame announcing more than [`MAX_FRAME_LEN`] bytes is rejected before
//!   anything is allocated for it.
//! - Server errors keep their SQLSTATE ([`ReplicationError::code`]) so callers
//!   can tell a bad password (28P01) from a missing slot (42704), a busy slot
//!   (55006) or a missing permission (42501).
//!
//! TLS: an SSLRequest on TCP unless `sslmode=disable`, then rustls over the
//! socket as [`TlsSettings`] says (see [`crate::pgtls`]); never on a Unix socket.
//! Refusals are [`ReplicationError::Tls`].
//!
//! Not implemented (reported as [`ReplicationError::Unsupported`]): channel
//! binding, GSSAPI/SSPI/Kerberos authentication.
//!
//! `XLogData::data` is a zero-copy slice of the read buffer: holding one message
//! keeps its whole read chunk (up to [`READ_CHUNK`] bytes, or the frame) alive.

use std::borrow::Cow;
use std::collections::HashMap;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{self, ChannelBinding, ScramSha256};
use postgres_protocol::message::backend::{ErrorFields, Message};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_postgres::config::{Host, SslNegotiation};
// Re-exported by tokio-postgres; the backend parsers' iterators implement it.
use tokio_postgres::fallible_iterator::FallibleIterator;

use crate::error::ReplicationError;
use crate::lsn;
use crate::pgtime;
use crate::pgtls::{NEEDS_TLS_HINT, TlsError, TlsSettings};
use crate::sql::{quote_ident, quote_literal};

/// Largest frame accepted. The server builds every message in a StringInfo,
/// which is capped at MaxAllocSize (1 GiB - 1), so anything bigger is a corrupt
/// length rather than data; the slack covers the message headers.
pub const MAX_FRAME_LEN: usize = (1 << 30) + (1 << 16);

/// Minimum free space before each read, so one syscall can carry hundreds of
/// small XLogData messages.
pub const READ_CHUNK: usize = 64 * 1024;

const DEFAULT_PORT: u16 = 5432;

/// Backend tag PostgreSQL uses for CopyBothResponse; postgres-protocol's parser
/// does not know it.
const COPY_BOTH_RESPONSE_TAG: u8 = b'W';

impl ReplicationError {
    fn from_fields(mut fields: ErrorFields<'_>) -> Self {
        let mut severity_localized = None;
        let mut severity = None;
        let mut code = String::new();
        let mut message = String::new();
        let mut detail = None;
        let mut hint = None;
        // Field values are in the server encoding; lossy decoding keeps a
        // broken byte from hiding the actual error.
        while let Ok(Some(field)) = fields.next() {
            let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
            match field.type_() {
                b'S' => severity_localized = Some(value),
                b'V' => severity = Some(value),
                b'C' => code = value,
                b'M' => message = value,
                b'D' => detail = Some(value),
                b'H' => hint = Some(value),
                _ => {}
            }
        }
        ReplicationError::Server {
            // 'V' is never translated, so prefer it for anything that matches on it.
            severity: severity.or(severity_localized).unwrap_or_default(),
            code,
            message,
            detail,
            hint,
        }
    }
}

fn log_notice(fields: ErrorFields<'_>) {
    if let ReplicationError::Server {
        severity,
        code,
        message,
        ..
    } = ReplicationError::from_fields(fields)
    {
        tracing::info!(%severity, %code, "server notice: {message}");
    }
}

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

type BoxedRead = Box<dyn AsyncRead + Send + Unpin>;
type BoxedWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// One backend message, header included (`postgres_protocol` parsers expect
/// the header).
struct Frame {
    tag: u8,
    raw: BytesMut,
}

impl Frame {
    fn parse(self) -> Result<Message, ReplicationError> {
        let tag = self.tag;
        let mut raw = self.raw;
        match Message::parse(&mut raw) {
            Ok(Some(msg)) => Ok(msg),
            Ok(None) => Err(ReplicationError::Protocol(format!(
                "incomplete message with tag {:?}",
                tag as char
            ))),
            Err(e) => Err(ReplicationError::Protocol(format!(
                "cannot parse message with tag {:?}: {e}",
                tag as char
            ))),
        }
    }

    fn body(&self) -> &[u8] {
        &self.raw[5..]
    }
}

/// Splits the byte stream into frames. All state lives in `buf`, which is what
/// makes `next_frame` cancel-safe.
struct FrameReader {
    rd: BoxedRead,
    buf: BytesMut,
}

impl FrameReader {
    fn new(rd: BoxedRead) -> Self {
        FrameReader {
            rd,
            buf: BytesMut::with_capacity(READ_CHUNK),
        }
    }

    fn try_frame(&mut self) -> Result<Option<Frame>, ReplicationError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let tag = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len < 4 {
            return Err(ReplicationError::Protocol(format!(
                "invalid length {len} in message with tag {:?}",
                tag as char
            )));
        }
        if len > MAX_FRAME_LEN {
            return Err(ReplicationError::Protocol(format!(
                "message with tag {:?} announces {len} bytes, more than the {MAX_FRAME_LEN} allowed",
                tag as char
            )));
        }
        let total = len + 1;
        if self.buf.len() < total {
            // Reserve the whole frame at once so a large frame is not read
            // through a series of reallocations.
            self.buf.reserve(total - self.buf.len());
            return Ok(None);
        }
        Ok(Some(Frame {
            tag,
            raw: self.buf.split_to(total),
        }))
    }

    /// Whether a whole frame is already in the buffer (the next read will not
    /// wait for the network).
    fn has_frame(&self) -> bool {
        self.buf.len() >= 5
            && self.buf.len()
                > u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize
    }

    async fn next_frame(&mut self) -> Result<Frame, ReplicationError> {
        loop {
            if let Some(frame) = self.try_frame()? {
                return Ok(frame);
            }
            if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
                self.buf.reserve(READ_CHUNK);
            }
            // Cancel-safe: read_buf either appends to self.buf or does nothing.
            let n = self.rd.read_buf(&mut self.buf).await?;
            if n == 0 {
                if self.buf.is_empty() {
                    return Err(ReplicationError::Closed);
                }
                return Err(ReplicationError::Protocol(format!(
                    "connection closed in the middle of a message ({} bytes pending)",
                    self.buf.len()
                )));
            }
        }
    }
}

/// A replication-mode connection in the idle (ReadyForQuery) state.
pub struct ReplicationConnection {
    reader: FrameReader,
    writer: BoxedWrite,
    out: BytesMut,
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
        } if super::refused_for_no_tls(&code, &message) => ReplicationError::Server {
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

    fn store_parameter(&mut self, body: &postgres_protocol::message::backend::ParameterStatusBody) {
        if let (Ok(name), Ok(value)) = (body.name(), body.value()) {
            self.parameters.insert(name.to_owned(), value.to_owned());
        }
    }

    async fn flush_out(&mut self) -> Result<(), ReplicationError> {
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

    /// Runs `sql` with the simple-query protocol and returns the rows of the
    /// last result set that had a row description (None for NULL). On a server
    /// error the connection is drained to ReadyForQuery first, so it stays
    /// usable.
    pub async fn simple_query(
        &mut self,
        sql: &str,
    ) -> Result<Vec<Vec<Option<String>>>, ReplicationError> {
        check_no_nul("query", sql)?;
        frontend::query(sql, &mut self.out)?;
        self.flush_out().await?;

        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let frame = self.reader.next_frame().await?;
            let tag = frame.tag;
            if tag == COPY_BOTH_RESPONSE_TAG {
                return Err(ReplicationError::Protocol(
                    "the server entered CopyBoth mode; use start_replication for START_REPLICATION"
                        .into(),
                ));
            }
            match frame.parse()? {
                Message::RowDescription(_) => rows = Vec::new(),
                Message::DataRow(body) => rows.push(decode_row(&body)?),
                Message::CommandComplete(_) | Message::EmptyQueryResponse => {}
                Message::ErrorResponse(body) => {
                    error = Some(ReplicationError::from_fields(body.fields()))
                }
                Message::NoticeResponse(body) => log_notice(body.fields()),
                Message::ParameterStatus(body) => self.store_parameter(&body),
                Message::ReadyForQuery(_) => {
                    return match error {
                        Some(e) => Err(e),
                        None => Ok(rows),
                    };
                }
                Message::CopyInResponse(_) | Message::CopyOutResponse(_) => {
                    return Err(ReplicationError::Protocol(
                        "COPY is not supported by simple_query".into(),
                    ));
                }
                _ => return Err(unexpected("simple query", tag)),
            }
        }
    }

    /// Starts logical streaming from `slot` at `start_lsn` and splits the
    /// connection into its receiving and feedback halves. A server error
    /// (missing slot 42704, slot in use 55006, ...) is returned as
    /// [`ReplicationError::Server`] and the connection is dropped.
    pub async fn start_replication(
        mut self,
        slot: &str,
        start_lsn: u64,
        options: &[(&str, &str)],
    ) -> Result<(ReplicationStream, FeedbackSender), ReplicationError> {
        let sql = start_replication_sql(slot, start_lsn, options)?;
        tracing::debug!(%sql, "starting replication");
        frontend::query(&sql, &mut self.out)?;
        self.flush_out().await?;

        loop {
            let frame = self.reader.next_frame().await?;
            let tag = frame.tag;
            if tag == COPY_BOTH_RESPONSE_TAG {
                // Body: overall format (i8), column count (i16), formats (i16 each).
                // Nothing in it matters for logical replication; check its shape.
                if frame.body().len() < 3 {
                    return Err(ReplicationError::Protocol(
                        "truncated CopyBothResponse".into(),
                    ));
                }
                break;
            }
            match frame.parse()? {
                Message::ErrorResponse(body) => {
                    return Err(ReplicationError::from_fields(body.fields()));
                }
                Message::NoticeResponse(body) => log_notice(body.fields()),
                Message::ParameterStatus(body) => self.store_parameter(&body),
                _ => return Err(unexpected("START_REPLICATION", tag)),
            }
        }

        let stream = ReplicationStream {
            reader: self.reader,
            ended: false,
        };
        let sender = FeedbackSender {
            writer: self.writer,
            out: self.out,
        };
        Ok((stream, sender))
    }
}

fn sasl_next<'a>(
    it: &mut postgres_protocol::message::backend::SaslMechanisms<'a>,
) -> Result<Option<&'a str>, ReplicationError> {
    it.next()
        .map_err(|e| ReplicationError::Protocol(format!("bad SASL mechanism list: {e}")))
}

fn decode_row(
    body: &postgres_protocol::message::backend::DataRowBody,
) -> Result<Vec<Option<String>>, ReplicationError> {
    let buf = body.buffer();
    let mut ranges = body.ranges();
    let mut row = Vec::new();
    loop {
        let range = ranges
            .next()
            .map_err(|e| ReplicationError::Protocol(format!("bad DataRow: {e}")))?;
        match range {
            None => return Ok(row),
            Some(None) => row.push(None),
            Some(Some(r)) => {
                let text = std::str::from_utf8(&buf[r])
                    .map_err(|e| ReplicationError::Protocol(format!("non-UTF-8 column: {e}")))?;
                row.push(Some(text.to_owned()));
            }
        }
    }
}

fn unexpected(phase: &str, tag: u8) -> ReplicationError {
    ReplicationError::Protocol(format!(
        "unexpected message with tag {:?} during {phase}",
        tag as char
    ))
}

fn check_no_nul(what: &str, s: &str) -> Result<(), ReplicationError> {
    // The protocol uses C strings; a NUL would silently truncate the command.
    if s.contains('\0') {
        return Err(ReplicationError::Unsupported(format!(
            "{what} contains a NUL byte"
        )));
    }
    Ok(())
}

fn start_replication_sql(
    slot: &str,
    start_lsn: u64,
    options: &[(&str, &str)],
) -> Result<String, ReplicationError> {
    check_no_nul("slot name", slot)?;
    let mut sql = format!(
        "START_REPLICATION SLOT {} LOGICAL {}",
        quote_ident(slot),
        lsn::display(start_lsn)
    );
    if !options.is_empty() {
        let mut parts = Vec::with_capacity(options.len());
        for (name, value) in options {
            check_no_nul("option name", name)?;
            check_no_nul("option value", value)?;
            // Quoted so no option name can break out of the list; pgoutput's
            // option names are all lower case, which quoting preserves.
            parts.push(format!("{} {}", quote_ident(name), quote_literal(value)));
        }
        sql.push_str(" (");
        sql.push_str(&parts.join(", "));
        sql.push(')');
    }
    Ok(sql)
}

async fn write_pending(
    writer: &mut BoxedWrite,
    out: &mut BytesMut,
) -> Result<(), ReplicationError> {
    // write_buf advances `out` only by what was written, so a dropped future
    // leaves the unsent tail in `out` for the next call.
    while out.has_remaining() {
        let n = writer.write_buf(out).await?;
        if n == 0 {
            return Err(ReplicationError::Closed);
        }
    }
    writer.flush().await?;
    Ok(())
}

/// One message from the walsender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage {
    /// WAL data: for logical replication, one output plugin message (for
    /// pgoutput the first byte is its type: b'B', b'R', b'I', b'C', ...).
    XLogData {
        /// The LSN where this message's WAL data starts.
        wal_start: u64,
        /// The current end of WAL on the server.
        wal_end: u64,
        /// The server's clock when it sent the message, microseconds since
        /// 2000-01-01 UTC.
        server_clock: i64,
        /// The output plugin's message, undecoded.
        data: Bytes,
    },
    /// Primary keepalive. If `reply_requested`, send a status update soon or
    /// the server drops the connection after `wal_sender_timeout`.
    Keepalive {
        /// The current end of WAL on the server.
        wal_end: u64,
        /// The server's clock when it sent the keepalive, microseconds since
        /// 2000-01-01 UTC.
        server_clock: i64,
        /// The server asks for a status update at once.
        reply_requested: bool,
    },
}

/// Receiving half of a streaming replication connection.
pub struct ReplicationStream {
    reader: FrameReader,
    ended: bool,
}

impl std::fmt::Debug for ReplicationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationStream")
            .field("buffered", &self.reader.buf.len())
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl ReplicationStream {
    /// Whether the next message has already been received, so [`Self::next`]
    /// returns without waiting for the network.
    pub fn has_buffered(&self) -> bool {
        self.reader.has_frame()
    }

    /// Next message; `Ok(None)` once the server has ended the copy (CopyDone,
    /// CommandComplete, ReadyForQuery) and on every call after that.
    ///
    /// Cancel-safe: dropping the future (e.g. in `tokio::select!`) loses
    /// nothing, as partial frames stay in the stream's buffer.
    pub async fn next(&mut self) -> Result<Option<ReplicationMessage>, ReplicationError> {
        loop {
            let frame = match self.reader.next_frame().await {
                Ok(frame) => frame,
                // After the server's CopyDone, closing the socket is the normal
                // end of the conversation.
                Err(ReplicationError::Closed) if self.ended => return Ok(None),
                Err(e) => return Err(e),
            };
            match frame.tag {
                b'd' => {
                    if let Some(msg) = parse_copy_data(frame.raw.freeze())? {
                        return Ok(Some(msg));
                    }
                }
                b'c' | b'C' | b'Z' => {
                    self.ended = true;
                    return Ok(None);
                }
                tag => match frame.parse()? {
                    Message::ErrorResponse(body) => {
                        return Err(ReplicationError::from_fields(body.fields()));
                    }
                    Message::NoticeResponse(body) => log_notice(body.fields()),
                    Message::ParameterStatus(body) => {
                        if let (Ok(name), Ok(value)) = (body.name(), body.value()) {
                            tracing::debug!(name, value, "parameter status during replication");
                        }
                    }
                    _ => return Err(unexpected("replication", tag)),
                },
            }
        }
    }
}

/// Decodes one CopyData frame (header included). Unknown sub-messages are
/// skipped so a newer server cannot break the stream with an addition.
fn parse_copy_data(raw: Bytes) -> Result<Option<ReplicationMessage>, ReplicationError> {
    let mut body = raw.slice(5..);
    if body.is_empty() {
        return Err(ReplicationError::Protocol("empty CopyData".into()));
    }
    match body[0] {
        b'w' => {
            if body.len() < 25 {
                return Err(ReplicationError::Protocol(format!(
                    "XLogData header truncated ({} bytes)",
                    body.len()
                )));
            }
            body.advance(1);
            let wal_start = body.get_u64();
            let wal_end = body.get_u64();
            let server_clock = body.get_i64();
            Ok(Some(ReplicationMessage::XLogData {
                wal_start,
                wal_end,
                server_clock,
                data: body,
            }))
        }
        b'k' => {
            if body.len() < 18 {
                return Err(ReplicationError::Protocol(format!(
                    "keepalive truncated ({} bytes)",
                    body.len()
                )));
            }
            body.advance(1);
            let wal_end = body.get_u64();
            let server_clock = body.get_i64();
            let reply_requested = body.get_u8() != 0;
            Ok(Some(ReplicationMessage::Keepalive {
                wal_end,
                server_clock,
                reply_requested,
            }))
        }
        other => {
            tracing::warn!(kind = ?(other as char), "skipping unknown replication message");
            Ok(None)
        }
    }
}

/// Sending half: standby status updates and the graceful end of streaming.
pub struct FeedbackSender {
    writer: BoxedWrite,
    out: BytesMut,
}

impl std::fmt::Debug for FeedbackSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeedbackSender")
            .field("pending", &self.out.len())
            .finish_non_exhaustive()
    }
}

impl FeedbackSender {
    /// Sends a standby status update with write = flush = apply = `lsn`. The
    /// flush position is what advances the slot's `confirmed_flush_lsn`, so
    /// only pass an LSN whose data is durably archived.
    pub async fn send_status(
        &mut self,
        lsn: u64,
        reply_requested: bool,
    ) -> Result<(), ReplicationError> {
        encode_status(lsn, pgtime::now_micros(), reply_requested, &mut self.out);
        write_pending(&mut self.writer, &mut self.out).await
    }

    /// Ends streaming gracefully: CopyDone, then Terminate, then shuts down the
    /// write half.
    pub async fn close(mut self) -> Result<(), ReplicationError> {
        frontend::copy_done(&mut self.out);
        frontend::terminate(&mut self.out);
        write_pending(&mut self.writer, &mut self.out).await?;
        self.writer.shutdown().await?;
        Ok(())
    }
}

fn encode_status(lsn: u64, clock: i64, reply_requested: bool, out: &mut BytesMut) {
    const BODY_LEN: usize = 1 + 8 + 8 + 8 + 8 + 1;
    out.reserve(1 + 4 + BODY_LEN);
    out.put_u8(b'd');
    out.put_u32((4 + BODY_LEN) as u32);
    out.put_u8(b'r');
    out.put_u64(lsn);
    out.put_u64(lsn);
    out.put_u64(lsn);
    out.put_i64(clock);
    out.put_u8(u8::from(reply_requested));
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::DuplexStream;

    fn stream_over(rd: DuplexStream) -> ReplicationStream {
        ReplicationStream {
            reader: FrameReader::new(Box::new(rd)),
            ended: false,
        }
    }

    fn xlogdata_frame(wal_start: u64, payload: &[u8]) -> Vec<u8> {
        let mut v = vec![b'd'];
        v.extend_from_slice(&((4 + 25 + payload.len()) as u32).to_be_bytes());
        v.push(b'w');
        v.extend_from_slice(&wal_start.to_be_bytes());
        v.extend_from_slice(&(wal_start + 100).to_be_bytes());
        v.extend_from_slice(&42i64.to_be_bytes());
        v.extend_from_slice(payload);
        v
    }

    /// A reader that hands out `data` in pieces of the given sizes (then
    /// whatever is left), as a socket delivers a stream in reads.
    struct Pieces {
        data: Bytes,
        sizes: Vec<usize>,
    }

    impl AsyncRead for Pieces {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let me = &mut *self;
            let size = me.sizes.pop().unwrap_or(usize::MAX).max(1);
            let n = size.min(me.data.len()).min(buf.remaining());
            buf.put_slice(&me.data.split_to(n));
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// What the walsender sends during streaming, with the messages the
    /// stream must give for it (ParameterStatus, notices and unknown
    /// CopyData kinds give none).
    fn arb_conversation()
    -> impl proptest::strategy::Strategy<Value = (Vec<u8>, Vec<ReplicationMessage>)> {
        use proptest::prelude::*;
        let item = prop_oneof![
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..40)).prop_map(|(at, p)| {
                let msg = ReplicationMessage::XLogData {
                    wal_start: at,
                    wal_end: at.wrapping_add(100),
                    server_clock: 42,
                    data: Bytes::from(p.clone()),
                };
                (xlogdata_frame(at, &p), Some(msg))
            }),
            (any::<u64>(), any::<i64>(), any::<bool>()).prop_map(|(end, clock, reply)| {
                let mut v = vec![b'd', 0, 0, 0, 22, b'k'];
                v.extend_from_slice(&end.to_be_bytes());
                v.extend_from_slice(&clock.to_be_bytes());
                v.push(u8::from(reply));
                let msg = ReplicationMessage::Keepalive {
                    wal_end: end,
                    server_clock: clock,
                    reply_requested: reply,
                };
                (v, Some(msg))
            }),
            Just((vec![b'S', 0, 0, 0, 8, b'a', 0, b'b', 0], None)),
            Just((
                vec![
                    b'N', 0, 0, 0, 14, b'S', b'N', b'O', b'T', b'E', 0, b'M', b'x', 0, 0
                ],
                None
            )),
            Just((vec![b'd', 0, 0, 0, 6, b'x', 1], None)),
        ];
        (proptest::collection::vec(item, 0..8), any::<bool>()).prop_map(|(items, done)| {
            let mut bytes = Vec::new();
            let mut msgs = Vec::new();
            for (frame, msg) in items {
                bytes.extend(frame);
                msgs.extend(msg);
            }
            if done {
                bytes.extend_from_slice(&[b'c', 0, 0, 0, 4]);
            }
            (bytes, msgs)
        })
    }

    /// Every message of `bytes` read in pieces of `sizes`, until the end
    /// or the first error.
    fn read_all(
        bytes: Vec<u8>,
        sizes: Vec<usize>,
    ) -> (Vec<ReplicationMessage>, Option<ReplicationError>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut stream = ReplicationStream {
                reader: FrameReader::new(Box::new(Pieces {
                    data: Bytes::from(bytes),
                    sizes,
                })),
                ended: false,
            };
            let mut got = Vec::new();
            loop {
                match stream.next().await {
                    Ok(Some(m)) => got.push(m),
                    Ok(None) => return (got, None),
                    Err(e) => return (got, Some(e)),
                }
            }
        })
    }

    proptest::proptest! {
        #![proptest_config(crate::fuzzing::config(256))]

        /// The framing's fuzz campaign (see `crate::fuzzing`): a
        /// conversation read in pieces of any size gives its messages,
        /// whatever the pieces; with a fuzzer's edits it ends (an error,
        /// or the end) without a panic, and what it gave before is a
        /// whole message each.
        #[test]
        fn fuzz_framing(
            (bytes, msgs) in arb_conversation(),
            sizes in proptest::collection::vec(1..64usize, 0..64),
            edits in crate::fuzzing::edits(),
        ) {
            let ended = bytes.ends_with(&[b'c', 0, 0, 0, 4]);
            let (got, err) = read_all(bytes.clone(), sizes.clone());
            proptest::prop_assert_eq!(&got, &msgs);
            // The end of the copy ends it; a socket closed without it is
            // the end only once the server said so.
            proptest::prop_assert_eq!(err.is_some(), !ended, "{:?}", err);
            let edited = crate::fuzzing::apply(&bytes, &edits);
            let (got, _) = read_all(edited.clone(), sizes);
            // Every message took a frame of at least 5 bytes.
            proptest::prop_assert!(got.len() * 5 <= edited.len());
        }
    }

    #[test]
    fn sql_quoting() {
        let sql = start_replication_sql(
            "my\"slot",
            0x16_B374_D848,
            &[("proto_version", "1"), ("publication_names", "\"a\",'b'")],
        )
        .unwrap();
        assert_eq!(
            sql,
            "START_REPLICATION SLOT \"my\"\"slot\" LOGICAL 16/B374D848 (\"proto_version\" '1', \"publication_names\" '\"a\",''b''')"
        );
        assert_eq!(
            start_replication_sql("s", 0, &[]).unwrap(),
            "START_REPLICATION SLOT \"s\" LOGICAL 0/0"
        );
        assert!(matches!(
            start_replication_sql("s\0", 0, &[]),
            Err(ReplicationError::Unsupported(_))
        ));
    }

    #[test]
    fn status_update_layout() {
        let mut out = BytesMut::new();
        encode_status(0x0102_0304_0506_0708, -5, true, &mut out);
        assert_eq!(out.len(), 1 + 4 + 34);
        assert_eq!(out[0], b'd');
        assert_eq!(&out[1..5], &38u32.to_be_bytes());
        assert_eq!(out[5], b'r');
        for i in 0..3 {
            let at = 6 + 8 * i;
            assert_eq!(&out[at..at + 8], &0x0102_0304_0506_0708u64.to_be_bytes());
        }
        assert_eq!(&out[30..38], &(-5i64).to_be_bytes());
        assert_eq!(out[38], 1);
    }

    #[test]
    fn error_display_and_code() {
        let e = ReplicationError::Server {
            severity: "FATAL".into(),
            code: "28P01".into(),
            message: "password authentication failed".into(),
            detail: None,
            hint: Some("check it".into()),
        };
        assert_eq!(e.code(), Some("28P01"));
        assert_eq!(
            e.to_string(),
            "server error: FATAL: password authentication failed (SQLSTATE 28P01); hint: check it"
        );
        assert_eq!(ReplicationError::Closed.code(), None);
    }

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

    #[tokio::test]
    async fn oversized_frame_is_rejected_without_allocating() {
        let (mut wr, rd) = tokio::io::duplex(64);
        let mut stream = stream_over(rd);
        wr.write_all(&[b'd', 0x7f, 0xff, 0xff, 0xff]).await.unwrap();
        let err = stream.next().await.unwrap_err();
        assert!(matches!(err, ReplicationError::Protocol(_)), "{err}");
        assert!(stream.reader.buf.capacity() < 1 << 20);
    }

    #[tokio::test]
    async fn parses_messages_and_end_of_copy() {
        let (mut wr, rd) = tokio::io::duplex(1 << 16);
        let mut stream = stream_over(rd);
        let mut bytes = xlogdata_frame(7, b"Bxyz");
        // Keepalive with reply requested.
        bytes.extend_from_slice(&[b'd', 0, 0, 0, 22, b'k']);
        bytes.extend_from_slice(&9u64.to_be_bytes());
        bytes.extend_from_slice(&3i64.to_be_bytes());
        bytes.push(1);
        // ParameterStatus is skipped.
        bytes.extend_from_slice(&[b'S', 0, 0, 0, 8, b'a', 0, b'b', 0]);
        bytes.extend_from_slice(&[b'c', 0, 0, 0, 4]);
        wr.write_all(&bytes).await.unwrap();
        drop(wr);

        assert_eq!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::XLogData {
                wal_start: 7,
                wal_end: 107,
                server_clock: 42,
                data: Bytes::from_static(b"Bxyz"),
            })
        );
        assert_eq!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::Keepalive {
                wal_end: 9,
                server_clock: 3,
                reply_requested: true
            })
        );
        assert_eq!(stream.next().await.unwrap(), None);
        // EOF after the server's CopyDone is a normal end, repeatedly.
        assert_eq!(stream.next().await.unwrap(), None);
    }

    #[tokio::test]
    async fn error_response_and_unexpected_eof() {
        let (mut wr, rd) = tokio::io::duplex(1 << 16);
        let mut stream = stream_over(rd);
        let mut body = Vec::new();
        for (t, v) in [
            (b'S', "ERREUR"),
            (b'V', "ERROR"),
            (b'C', "55006"),
            (b'M', "busy"),
        ] {
            body.push(t);
            body.extend_from_slice(v.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut bytes = vec![b'E'];
        bytes.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        bytes.extend_from_slice(&body);
        wr.write_all(&bytes).await.unwrap();
        let err = stream.next().await.unwrap_err();
        assert_eq!(err.code(), Some("55006"));
        assert!(
            err.to_string().starts_with("server error: ERROR: busy"),
            "{err}"
        );
        drop(wr);
        assert!(matches!(stream.next().await, Err(ReplicationError::Closed)));
    }

    /// Feeds frames one byte at a time while cancelling `next()` whenever it
    /// would block: every message must still arrive intact and in order.
    #[tokio::test]
    async fn next_is_cancel_safe_with_split_frames() {
        let (mut wr, rd) = tokio::io::duplex(3);
        let mut stream = stream_over(rd);
        const N: u64 = 300;
        let writer = tokio::spawn(async move {
            for i in 0..N {
                let frame = xlogdata_frame(i, format!("I{i}").as_bytes());
                for b in frame {
                    wr.write_all(&[b]).await.unwrap();
                    tokio::task::yield_now().await;
                }
            }
            wr.write_all(&[b'c', 0, 0, 0, 4]).await.unwrap();
        });
        let mut got = 0u64;
        let mut cancelled = 0u64;
        loop {
            tokio::select! {
                biased;
                msg = stream.next() => match msg.unwrap() {
                    Some(ReplicationMessage::XLogData { wal_start, data, .. }) => {
                        assert_eq!(wal_start, got);
                        assert_eq!(data, Bytes::from(format!("I{got}")));
                        got += 1;
                    }
                    Some(other) => panic!("unexpected {other:?}"),
                    None => break,
                },
                // Completes on its second poll: when the stream is still
                // pending then, its next() future is dropped mid-frame.
                _ = tokio::task::yield_now() => {
                    cancelled += 1;
                }
            }
        }
        writer.await.unwrap();
        assert_eq!(got, N);
        assert!(
            cancelled > N,
            "cancellation was not exercised ({cancelled})"
        );
    }

    /// The source sends the events of every message already received as
    /// one batch: `has_buffered` must say yes exactly while a whole frame
    /// waits, never for a partial one (that would wait on the network).
    #[tokio::test]
    async fn has_buffered_is_true_only_for_whole_received_frames() {
        let (mut wr, rd) = tokio::io::duplex(1 << 16);
        let mut stream = stream_over(rd);
        assert!(!stream.has_buffered());
        let mut two = xlogdata_frame(1, b"I1");
        two.extend(xlogdata_frame(2, b"I2"));
        let second = xlogdata_frame(3, b"I3");
        two.extend_from_slice(&second[..10]);
        wr.write_all(&two).await.unwrap();
        // One read takes all three (the last one cut short).
        assert!(matches!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::XLogData { wal_start: 1, .. })
        ));
        assert!(stream.has_buffered());
        assert!(matches!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::XLogData { wal_start: 2, .. })
        ));
        assert!(!stream.has_buffered(), "a partial frame is not a message");
        wr.write_all(&second[10..]).await.unwrap();
        assert!(matches!(
            stream.next().await.unwrap(),
            Some(ReplicationMessage::XLogData { wal_start: 3, .. })
        ));
        assert!(!stream.has_buffered());
    }

    #[tokio::test]
    async fn send_status_and_close_write_expected_bytes() {
        let (wr, mut rd) = tokio::io::duplex(1 << 16);
        let mut sender = FeedbackSender {
            writer: Box::new(wr),
            out: BytesMut::new(),
        };
        sender.send_status(0x10, false).await.unwrap();
        sender.close().await.unwrap();
        let mut all = Vec::new();
        rd.read_to_end(&mut all).await.unwrap();
        assert_eq!(all.len(), 39 + 5 + 5);
        assert_eq!(&all[6..14], &0x10u64.to_be_bytes());
        assert_eq!(&all[39..], &[b'c', 0, 0, 0, 4, b'X', 0, 0, 0, 4]);
    }
}
