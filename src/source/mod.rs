//! The source: everything that talks to Postgres. Pre-flight checks
//! ([`check`]), creating the publication and slot ([`setup`]), the
//! replication connection ([`replication`]), the pgoutput decoder
//! ([`pgoutput`]), value rendering ([`types`]), row rendering ([`row`]) and
//! the event stream ([`stream`]). Ordinary SQL goes through tokio-postgres.

pub(crate) mod backfill;
pub(crate) mod catalog;
pub(crate) mod check;
pub mod pgoutput;
pub mod replication;
pub(crate) mod row;
pub(crate) mod setup;
pub(crate) mod spill;
pub mod stream;
pub mod types;
pub(crate) mod watermark;

use secrecy::ExposeSecret;

/// Session settings that fix how values are printed as text. The
/// replication connection sends them at startup (the walsender formats
/// pgoutput values with them); the backfill's SQL connection SETs them, so a
/// row read by SQL renders exactly as the same row in the stream.
pub const OUTPUT_SETTINGS: [(&str, &str); 5] = [
    ("DateStyle", "ISO"),
    ("TimeZone", "UTC"),
    ("IntervalStyle", "iso_8601"),
    ("extra_float_digits", "1"),
    ("bytea_output", "hex"),
];

use crate::config::SourceConfig;
use crate::error::ErrorKind;
use crate::pgtls;
use crate::{Error, Result};

/// The connection settings of the source: tokio-postgres's, plus the TLS
/// settings it cannot hold. Derefs to the tokio-postgres configuration.
#[derive(Debug, Clone)]
pub struct PgConfig {
    /// Host, port, user, password, database and the other libpq settings.
    pub pg: tokio_postgres::Config,
    /// `sslmode`, the CA and the client certificate, which tokio-postgres's
    /// configuration has no room for.
    pub tls: pgtls::TlsSettings,
}

impl std::ops::Deref for PgConfig {
    type Target = tokio_postgres::Config;
    fn deref(&self) -> &tokio_postgres::Config {
        &self.pg
    }
}

impl std::ops::DerefMut for PgConfig {
    fn deref_mut(&mut self) -> &mut tokio_postgres::Config {
        &mut self.pg
    }
}

/// The connection settings, with the password from PGPASSWORD when the URL has none.
pub fn pg_config(source: &SourceConfig) -> PgConfig {
    let mut pg = source.pg.clone();
    if pg.get_password().is_none()
        && let Ok(pw) = std::env::var("PGPASSWORD")
    {
        pg.password(pw);
    }
    PgConfig {
        pg,
        tls: source.tls.clone(),
    }
}

/// Where the source is, without secrets, for messages.
pub fn describe(source: &SourceConfig) -> String {
    crate::config::redact_url(source.url.expose_secret())
}

/// Opens an ordinary SQL connection, over TLS as `sslmode` says.
pub async fn connect_sql(source: &SourceConfig) -> Result<tokio_postgres::Client> {
    let mut pg = pg_config(source);
    pg.application_name("waltail");
    // libpq never uses TLS on a Unix socket (the server would refuse it).
    if !pg.get_hosts().is_empty()
        && pg
            .get_hosts()
            .iter()
            .all(|h| !matches!(h, tokio_postgres::config::Host::Tcp(_)))
    {
        pg.ssl_mode(tokio_postgres::config::SslMode::Disable);
    }
    let (client, connection) = pg
        .pg
        .connect(pg.tls.connector())
        .await
        .map_err(|e| connect_error(source, e))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "SQL connection ended");
        }
    });
    Ok(client)
}

/// A failed SQL connect, with TLS failures worded for the operator: those
/// are fatal (a retry meets the same certificate), everything else keeps
/// tokio-postgres's error and its usual retry rules.
fn connect_error(source: &SourceConfig, e: tokio_postgres::Error) -> Error {
    let context = format!("cannot connect to {}", describe(source));
    let cause = std::error::Error::source(&e);
    if let Some(tls) = cause.and_then(|c| c.downcast_ref::<pgtls::TlsError>())
        && tls.fatal
    {
        return Error::fatal(format!("{context}: {tls}"), tls.hint.clone())
            .with_kind(ErrorKind::Tls);
    }
    // tokio-postgres's own words when the server answers 'N' to the SSLRequest.
    if cause.is_some_and(|c| c.to_string().contains("server does not support TLS")) {
        let tls = pgtls::TlsError::not_supported(source.tls.mode);
        return Error::fatal(format!("{context}: {tls}"), tls.hint).with_kind(ErrorKind::Tls);
    }
    if let Some(db) = e.as_db_error()
        && refused_for_no_tls(db.code().code(), db.message())
    {
        return Error::fatal(
            format!("{context}: {}: {}", db.severity(), db.message()),
            pgtls::NEEDS_TLS_HINT,
        )
        .with_kind(ErrorKind::Tls);
    }
    Error::postgres(context, e)
}

/// pg_hba.conf has only `hostssl` lines for this client, and it came without
/// TLS: "no pg_hba.conf entry for host ..., no encryption" (12+; "SSL off"
/// before).
pub fn refused_for_no_tls(code: &str, message: &str) -> bool {
    code == "28000"
        && message.contains("pg_hba.conf")
        && (message.ends_with("no encryption") || message.ends_with("SSL off"))
}
