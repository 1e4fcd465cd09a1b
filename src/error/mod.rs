//! One error type for the library, and the one place that decides what a
//! failure means for the pipeline (retry, park, stop).
//!
//! Every error a user can cause carries a hint that says what to do about it,
//! so the binary can print `error: ...` followed by `fix: ...`.

use std::fmt;

mod replication;

pub use replication::{DecodeError, ReplicationError};

/// Library result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, at the level a caller acts on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid; the message names the key.
    #[error("{0}")]
    Config(String),

    /// A SQL command on the ordinary Postgres connection failed.
    #[error("{context}: {source}")]
    Postgres {
        /// What waltail was doing, e.g. `reading the publication's tables`.
        context: String,
        /// tokio-postgres's error, with the server's SQLSTATE when it sent one.
        #[source]
        source: tokio_postgres::Error,
    },

    /// The replication connection failed.
    #[error("{context}: {source}")]
    Replication {
        /// What waltail was doing, e.g. `starting replication`.
        context: String,
        /// Why the connection failed; boxed to keep `Error` small.
        #[source]
        source: Box<ReplicationError>,
    },

    /// The server sent a pgoutput message we cannot decode.
    #[error("cannot decode a pgoutput message: {0}")]
    Decode(#[from] DecodeError),

    /// A request to the destination failed. Displayed condensed (status,
    /// S3 error code and message), not with the raw XML body.
    #[error("{op} {key}: {}", summarize_store_error(cause))]
    Store {
        /// The request that failed, e.g. `PUT` or `LIST`.
        op: &'static str,
        /// The object key (or prefix) the request was for.
        key: String,
        /// object_store's error; not a `#[source]`, as the message already
        /// gives its summary. Boxed to keep `Error` small.
        cause: Box<object_store::Error>,
    },

    /// The local state store failed.
    #[error("local state ({path}): {source}")]
    State {
        /// The state database's file.
        path: String,
        /// SQLite's error.
        #[source]
        source: rusqlite::Error,
    },

    /// A local file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What waltail was doing, with the file's path.
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The pipeline cannot go on until an operator acts; `hint` says how,
    /// `kind` says to code what failed.
    #[error("{message}")]
    Fatal {
        /// What failed; [`Error::fatal`] says [`ErrorKind::Other`] until
        /// [`Error::with_kind`] says better.
        kind: ErrorKind,
        /// What is wrong, for the operator.
        message: String,
        /// What the operator should do about it.
        hint: String,
    },
}

/// What failed, for code that acts on it (exit codes, tests, callers of
/// the library); the message says it to people. New kinds may come, so
/// matches need a `_` arm.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The configuration (or a command's arguments) is invalid.
    Config,
    /// Another process holds what this one needs: the pipeline's lock (a
    /// `waltail run` of it is running) or a table's Delta log (another
    /// `waltail compact` committed first). Nothing was done.
    Locked,
    /// The replication slot is gone, or belongs to no state we have:
    /// changes may be missing, and only an operator can say what next.
    SlotLost,
    /// The source database is not as the command needs it: a table
    /// missing, without a key, or not streamed.
    Source,
    /// TLS to Postgres was refused (certificate, host name, sslmode).
    Tls,
    /// A SQL command on the ordinary Postgres connection failed.
    Postgres,
    /// The replication connection failed.
    Replication,
    /// The server sent a pgoutput message that cannot be decoded.
    Decode,
    /// The store refused the credentials or the permission (401, 403):
    /// no request will pass until they change.
    StoreAccess,
    /// A request to the store failed otherwise.
    Store,
    /// The archive holds something that cannot be read: a damaged object,
    /// schema record or compacted file.
    Archive,
    /// The local state is damaged, missing, or from another release.
    State,
    /// A local file operation failed.
    Io,
    /// waltail itself is wrong: please report it.
    Bug,
    /// Anything else that stops the command.
    Other,
}

/// What the pipeline does about a failed delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Try the same request again after the backoff.
    Retry,
    /// This batch cannot be written as it is; park it, the rest flows on.
    Park,
    /// Nothing a retry can fix for the whole pipeline: stop and say why.
    Stop,
}

impl Error {
    /// An invalid configuration; the message names the key and the constraint.
    pub fn config(message: impl Into<String>) -> Self {
        Error::Config(message.into())
    }

    /// A failure only an operator can fix: `message` says what is wrong,
    /// `hint` what to do. Its kind is [`ErrorKind::Other`]; see
    /// [`Error::with_kind`].
    pub fn fatal(message: impl Into<String>, hint: impl Into<String>) -> Self {
        Error::Fatal {
            kind: ErrorKind::Other,
            message: message.into(),
            hint: hint.into(),
        }
    }

    /// A failure that means waltail itself is wrong (an invariant broken, a
    /// task of its own panicked): the message says what, the hint to report it.
    pub fn bug(message: impl Into<String>) -> Self {
        Error::fatal(message, "this is a bug in waltail; please report it")
            .with_kind(ErrorKind::Bug)
    }

    /// The same error, saying it is of `kind` (only a [`Error::Fatal`]
    /// carries a kind of its own; the others' follows from their variant).
    pub fn with_kind(mut self, kind: ErrorKind) -> Self {
        if let Error::Fatal { kind: k, .. } = &mut self {
            *k = kind;
        }
        self
    }

    /// What failed (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Config(_) => ErrorKind::Config,
            Error::Postgres { .. } => ErrorKind::Postgres,
            Error::Replication { source, .. } => match source.as_ref() {
                ReplicationError::Tls(_) => ErrorKind::Tls,
                // 42704: the slot does not exist; an invalidated slot
                // (max_slot_wal_keep_size) lost WAL it still needed.
                ReplicationError::Server { code, .. } if code == "42704" => ErrorKind::SlotLost,
                e if slot_invalidated(e) => ErrorKind::SlotLost,
                _ => ErrorKind::Replication,
            },
            Error::Decode(_) => ErrorKind::Decode,
            Error::Store { cause, .. } => match cause.as_ref() {
                object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. } => ErrorKind::StoreAccess,
                _ => ErrorKind::Store,
            },
            Error::State { .. } => ErrorKind::State,
            Error::Io { .. } => ErrorKind::Io,
            Error::Fatal { kind, .. } => *kind,
        }
    }

    /// A failed SQL command; `context` says what it was for.
    pub fn postgres(context: impl Into<String>, source: tokio_postgres::Error) -> Self {
        Error::Postgres {
            context: context.into(),
            source,
        }
    }

    /// A failed replication connection; `context` says what it was doing.
    pub fn replication(context: impl Into<String>, source: ReplicationError) -> Self {
        Error::Replication {
            context: context.into(),
            source: Box::new(source),
        }
    }

    /// A failed store request: `op` (`PUT`, `GET`, ...) on `key`.
    pub fn store(op: &'static str, key: impl Into<String>, source: object_store::Error) -> Self {
        Error::Store {
            op,
            key: key.into(),
            cause: Box::new(source),
        }
    }

    /// A failed local file operation; `context` names what and which file.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The one classification of failures (see DESIGN.md, "Retry").
    ///
    /// Retried: network errors, timeouts, 5xx and throttling from the store, a
    /// dropped replication connection. Stopped at once: credentials refused,
    /// a missing bucket or slot, a bad configuration, a corrupt local state:
    /// retrying those only delays the message the operator needs.
    pub fn disposition(&self) -> Disposition {
        match self {
            Error::Store { cause, .. } => store_disposition(cause),
            Error::Replication { source, .. } => match source.as_ref() {
                ReplicationError::Io(_)
                | ReplicationError::Closed
                | ReplicationError::Connect { .. } => Disposition::Retry,
                // Admin shutdown / crash recovery / too many connections: the server comes back.
                ReplicationError::Server { code, .. }
                    if matches!(
                        code.as_str(),
                        "57P01" | "57P02" | "57P03" | "53300" | "08006"
                    ) =>
                {
                    Disposition::Retry
                }
                // Slot in use by another process: usually the previous session has not ended yet.
                ReplicationError::Server { code, .. } if code == "55006" => Disposition::Retry,
                _ => Disposition::Stop,
            },
            Error::Postgres { source, .. } => {
                if source.is_closed() || source.as_db_error().is_none() {
                    Disposition::Retry
                } else {
                    match source.code().map(|c| c.code()) {
                        Some("57P01" | "57P02" | "57P03" | "53300") => Disposition::Retry,
                        _ => Disposition::Stop,
                    }
                }
            }
            // A full or read-only disk does not heal by retrying: stop and
            // say so (see `local_disk_hint`); the next start resumes.
            Error::Io { source, .. } if local_disk_problem(source.kind()) => Disposition::Stop,
            Error::Io { .. } => Disposition::Retry,
            Error::Config(_) | Error::Decode(_) | Error::State { .. } | Error::Fatal { .. } => {
                Disposition::Stop
            }
        }
    }

    /// What the operator should do, when we know.
    pub fn hint(&self) -> Option<String> {
        match self {
            Error::Fatal { hint, .. } => Some(hint.clone()),
            Error::Store { cause, .. } => store_hint(cause),
            Error::Replication { source, .. } => replication_hint(source),
            Error::Postgres { source, .. } => {
                postgres_hint(source.code().map(|c| c.code()).unwrap_or(""))
            }
            Error::Io { source, .. } => local_disk_hint(source.kind()),
            Error::State { source, .. } => {
                use rusqlite::ErrorCode;
                match source.sqlite_error_code() {
                    Some(ErrorCode::DiskFull) => local_disk_hint(std::io::ErrorKind::StorageFull),
                    Some(
                        ErrorCode::ReadOnly | ErrorCode::CannotOpen | ErrorCode::PermissionDenied,
                    ) => local_disk_hint(std::io::ErrorKind::ReadOnlyFilesystem),
                    _ => None,
                }
            }
            _ => None,
        }
    }
}

/// Whether a local file error is the disk's (full, read-only, not ours to
/// write), which waiting does not mend.
fn local_disk_problem(kind: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind;
    matches!(
        kind,
        ErrorKind::StorageFull | ErrorKind::ReadOnlyFilesystem | ErrorKind::PermissionDenied
    )
}

/// What to do about a local disk problem: `state_dir` holds the state and
/// the spill of large transactions, and nothing there is confirmed to the
/// server before it is durable, so a stop loses nothing.
fn local_disk_hint(kind: std::io::ErrorKind) -> Option<String> {
    let what = match kind {
        std::io::ErrorKind::StorageFull => {
            "free space on that filesystem (or point state_dir at a larger one)"
        }
        std::io::ErrorKind::ReadOnlyFilesystem | std::io::ErrorKind::PermissionDenied => {
            "make state_dir writable by the user waltail runs as"
        }
        _ => return None,
    };
    Some(format!(
        "{what}, then start waltail again: it resumes from the last position confirmed to Postgres, and nothing is lost (state_dir holds the state and the spill of large transactions)"
    ))
}

/// A 4xx answer other than 408 (timeout) and 429 (throttling).
///
/// Read from the text because object_store 0.13 gives no other way: the
/// statuses it has variants for (401, 403, 404, 409, 412, 304) are matched
/// as variants before this, and for the rest its `RetryError::status()`
/// sits in a private module, so the error cannot be downcast to it. The
/// test `a_400_from_a_real_server_is_a_client_error` holds the text to a
/// real answer, so an upgrade that changes it fails there.
/// [`Error::disposition`] of a store's error, for code that holds the
/// store's error itself (see `sink::reread`).
pub(crate) fn store_disposition(cause: &object_store::Error) -> Disposition {
    match cause {
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. }
        | object_store::Error::NotImplemented { .. }
        | object_store::Error::NotSupported { .. }
        | object_store::Error::UnknownConfigurationKey { .. } => Disposition::Stop,
        object_store::Error::NotFound { .. } => Disposition::Stop,
        // A 4xx other than auth/not-found (e.g. 400 EntityTooLarge) is
        // about this request, not the store.
        other if client_error(other) => Disposition::Park,
        _ => Disposition::Retry,
    }
}

fn client_error(err: &object_store::Error) -> bool {
    let text = err.to_string();
    text.split("status code: ")
        .nth(1)
        .and_then(|s| s.get(..3))
        .and_then(|code| code.parse::<u16>().ok())
        .is_some_and(|code| (400..500).contains(&code) && code != 408 && code != 429)
}

/// A one-line account of a store error: the HTTP status and the S3 error
/// code and message when the body has them, else object_store's text.
pub fn summarize_store_error(err: &object_store::Error) -> String {
    let text = err.to_string();
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let start = text.find(&open)? + open.len();
        let end = text[start..].find(&format!("</{name}>"))? + start;
        Some(text[start..end].to_string())
    };
    match tag("Code") {
        Some(code) => {
            let status = text
                .split("status code: ")
                .nth(1)
                .and_then(|s| s.split(':').next())
                .unwrap_or("error");
            let message = tag("Message").unwrap_or_default();
            format!("{status}: {code}: {message}")
        }
        None => text.lines().next().unwrap_or_default().to_string(),
    }
}

/// Why no S3 credential could be had (sink::credentials), kept whole so that
/// the hint can say what to set ([`CredentialsFailure::hint`]).
#[derive(Debug)]
pub struct CredentialsFailure {
    text: String,
    role: Option<String>,
    /// STS (or the provider's service) answered no, as opposed to no
    /// credentials found or none in time.
    refused: bool,
}

impl std::fmt::Display for CredentialsFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.role {
            Some(arn) => write!(f, "no S3 credentials for role {arn}: {}", self.text),
            None => write!(f, "no S3 credentials: {}", self.text),
        }
    }
}

impl std::error::Error for CredentialsFailure {}

impl CredentialsFailure {
    /// The provider chain's `text`, the role it tried to assume if any, and
    /// whether the provider `refused` (rather than found nothing).
    pub fn new(text: String, role: Option<String>, refused: bool) -> CredentialsFailure {
        CredentialsFailure {
            text,
            role,
            refused,
        }
    }

    /// What the operator should do.
    pub fn hint(&self) -> String {
        if self.role.is_some() && self.refused {
            return "STS refused to assume the role: its trust policy must allow the credentials \
                    that sign the request (the profile, AWS_* variables or instance role), and \
                    destination.external_id must be the one it asks for"
                .into();
        }
        if self.text.contains("profile") {
            return "check destination.profile (or AWS_PROFILE) against the shared files \
                    (~/.aws/config and ~/.aws/credentials, or AWS_CONFIG_FILE and \
                    AWS_SHARED_CREDENTIALS_FILE)"
                .into();
        }
        "set destination.access_key_id and destination.secret_access_key, or \
         AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile (destination.profile or \
         AWS_PROFILE), or run where an instance, container or web-identity role is given"
            .into()
    }
}

/// The fix for a failed request to the destination.
pub fn store_hint(err: &object_store::Error) -> Option<String> {
    if let object_store::Error::Unauthenticated { source, .. }
    | object_store::Error::Generic { source, .. } = err
        && let Some(failure) = source.downcast_ref::<CredentialsFailure>()
    {
        return Some(failure.hint());
    }
    let text = err.to_string();
    Some(match err {
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => {
            if text.contains("SignatureDoesNotMatch") || text.contains("InvalidAccessKeyId") {
                "the store refused the credentials: check destination.access_key_id and \
                 destination.secret_access_key (or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
                    .into()
            } else {
                "the store refused the request: grant s3:PutObject on the bucket and prefix \
                 to these credentials"
                    .into()
            }
        }
        object_store::Error::NotFound { .. } => {
            "the bucket does not exist (NoSuchBucket): create it, or fix destination.bucket".into()
        }
        _ if text.contains("NoSuchBucket") => {
            "the bucket does not exist: create it, or fix destination.bucket".into()
        }
        _ if text.contains("error sending request") || text.contains("Connection refused") => {
            "the store cannot be reached: check destination.endpoint and the network".into()
        }
        _ => return None,
    })
}

/// Whether the server said the slot was invalidated: max_slot_wal_keep_size
/// removed WAL the slot still needed (Postgres gives it no SQLSTATE of its
/// own, so its words tell).
fn slot_invalidated(err: &ReplicationError) -> bool {
    matches!(err, ReplicationError::Server { message, detail, .. }
        if message.contains("invalidated")
            || detail.as_deref().is_some_and(|d| d.contains("invalidated")))
}

fn replication_hint(err: &ReplicationError) -> Option<String> {
    match err {
        e if slot_invalidated(e) => Some(
            "the replication slot was invalidated (max_slot_wal_keep_size): changes after its \
             position are lost. Drop it (SELECT pg_drop_replication_slot('<slot>');), run \
             `waltail run --recreate-slot`, then backfill the tables"
                .into(),
        ),
        ReplicationError::Server { code, .. } => postgres_hint(code),
        ReplicationError::Connect { .. } => {
            Some("check the host and port in source.url, and that Postgres is running".into())
        }
        _ => None,
    }
}

fn postgres_hint(code: &str) -> Option<String> {
    Some(
        match code {
            "28P01" | "28000" => {
                "Postgres refused the login: check the user and password in source.url \
                 (or PGPASSWORD) and pg_hba.conf"
            }
            "42501" => {
                "the role lacks a privilege: ALTER ROLE <user> WITH REPLICATION; and grant \
                 SELECT on the tables"
            }
            "42704" => "the replication slot does not exist: run `waltail run` to create it",
            "55000" => "set wal_level = logical in postgresql.conf and restart Postgres",
            "53400" => {
                "all replication slots are in use: raise max_replication_slots or drop an \
                 unused slot"
            }
            _ => return None,
        }
        .to_string(),
    )
}

/// Prints an error with its whole cause chain and hint, as the binary shows it.
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            // Error types that already embed their source in Display would repeat it.
            if !self.0.to_string().contains(&text) {
                write!(f, ": {text}")?;
            }
            cause = c.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store answering 400 to a PUT, as S3 does to a body over its limit
    /// (here a socket that answers every request so): the batch is parked,
    /// not retried for ever, and the account names the S3 code.
    #[tokio::test]
    async fn a_400_from_a_real_server_is_a_client_error() {
        use object_store::ObjectStoreExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut request = vec![0u8; 64 * 1024];
                    let _ = socket.read(&mut request).await;
                    let body =
                        "<Error><Code>EntityTooLarge</Code><Message>too big</Message></Error>";
                    let answer = format!(
                        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/xml\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = socket.write_all(answer.as_bytes()).await;
                });
            }
        });
        let store = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name("archive")
            .with_region("us-east-1")
            .with_endpoint(format!("http://{addr}"))
            .with_allow_http(true)
            .with_access_key_id("key")
            .with_secret_access_key("secret")
            .with_retry(object_store::RetryConfig {
                max_retries: 0,
                ..Default::default()
            })
            .build()
            .unwrap();
        let err = store
            .put(&"a.ndjson".into(), "line\n".into())
            .await
            .unwrap_err();
        assert!(client_error(&err), "{err}");
        assert!(
            summarize_store_error(&err).starts_with("400 Bad Request: EntityTooLarge"),
            "{}",
            summarize_store_error(&err)
        );
        assert_eq!(
            Error::store("put", "a.ndjson", err).disposition(),
            Disposition::Park
        );
    }

    #[test]
    fn credential_hints_say_what_to_set() {
        let f = |text: &str, role: Option<&str>, refused: bool| {
            CredentialsFailure::new(text.into(), role.map(str::to_string), refused).hint()
        };
        let no = "no providers in chain provided credentials";
        assert!(f(no, None, false).contains("AWS_PROFILE"));
        assert!(f("profile `x` was not defined", None, false).contains("AWS_CONFIG_FILE"));
        let role = Some("arn:aws:iam::1:role/r");
        assert!(f("service error", role, true).contains("trust policy"));
        assert!(!f("dispatch failure", role, false).contains("trust policy"));
    }

    /// Code can tell failures apart by kind, whatever their words: a
    /// fatal error keeps the kind it was given (through a DataFusion error
    /// too, see `query::sql_error`), the others' follows from their variant.
    #[test]
    fn every_error_says_what_failed() {
        assert_eq!(Error::fatal("m", "h").kind(), ErrorKind::Other);
        let locked =
            Error::fatal("pipeline p is already running", "h").with_kind(ErrorKind::Locked);
        assert_eq!(locked.kind(), ErrorKind::Locked);
        assert_eq!(locked.hint().as_deref(), Some("h"));
        assert_eq!(Error::bug("x").kind(), ErrorKind::Bug);
        assert_eq!(Error::config("c").kind(), ErrorKind::Config);
        assert_eq!(
            Error::config("c").with_kind(ErrorKind::Locked).kind(),
            ErrorKind::Config,
            "only a fatal error takes a kind"
        );
        let tls = ReplicationError::Tls(crate::pgtls::TlsError::fatal("refused", "fix"));
        assert_eq!(Error::replication("connecting", tls).kind(), ErrorKind::Tls);
        assert_eq!(
            Error::replication("reading", ReplicationError::Closed).kind(),
            ErrorKind::Replication
        );
        let io = std::io::Error::other("disk");
        assert_eq!(Error::io("writing", io).kind(), ErrorKind::Io);
        let server = |code: &str, message: &str| ReplicationError::Server {
            severity: "ERROR".into(),
            code: code.into(),
            message: message.into(),
            detail: None,
            hint: None,
        };
        let slot = |e| Error::replication("starting replication", e).kind();
        assert_eq!(
            slot(server("42704", "replication slot \"s\" does not exist")),
            ErrorKind::SlotLost
        );
        assert_eq!(
            slot(server(
                "55000",
                "can no longer get changes from replication slot \"s\": this slot has been invalidated"
            )),
            ErrorKind::SlotLost
        );
        assert_eq!(
            slot(server("55006", "replication slot \"s\" is active")),
            ErrorKind::Replication
        );
        let denied = object_store::Error::PermissionDenied {
            path: "k".into(),
            source: "403".into(),
        };
        assert_eq!(
            Error::store("PUT", "k", denied).kind(),
            ErrorKind::StoreAccess
        );
        let generic = object_store::Error::Generic {
            store: "S3",
            source: "reset".into(),
        };
        assert_eq!(Error::store("PUT", "k", generic).kind(), ErrorKind::Store);
    }
}
