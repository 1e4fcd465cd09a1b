//! The source: everything that talks to Postgres. Pre-flight checks
//! ([`check`]), creating the publication and slot ([`setup`]), the
//! replication connection ([`replication`]), the pgoutput decoder
//! ([`pgoutput`]), value rendering ([`types`]) and the event stream
//! ([`stream`]). Ordinary SQL goes through tokio-postgres.

pub mod catalog;
pub mod check;
pub mod pgoutput;
pub mod replication;
pub mod setup;
pub mod spill;
pub mod stream;
pub mod types;

use secrecy::ExposeSecret;

use crate::config::SourceConfig;
use crate::{Error, Result};

/// The connection settings, with the password from PGPASSWORD when the URL has none.
pub fn pg_config(source: &SourceConfig) -> tokio_postgres::Config {
    let mut pg = source.pg.clone();
    if pg.get_password().is_none()
        && let Ok(pw) = std::env::var("PGPASSWORD")
    {
        pg.password(pw);
    }
    pg
}

/// Where the source is, without secrets, for messages.
pub fn describe(source: &SourceConfig) -> String {
    crate::config::redact_url(source.url.expose_secret())
}

/// Opens an ordinary SQL connection (TLS arrives with the security work;
/// `sslmode=require` is refused with a clear error until then).
pub async fn connect_sql(source: &SourceConfig) -> Result<tokio_postgres::Client> {
    let mut pg = pg_config(source);
    pg.application_name("waltail");
    if matches!(pg.get_ssl_mode(), tokio_postgres::config::SslMode::Require) {
        return Err(Error::fatal(
            "sslmode=require is not supported yet",
            "use sslmode=disable or sslmode=prefer in source.url",
        ));
    }
    let (client, connection) = pg
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(|e| Error::postgres(format!("cannot connect to {}", describe(source)), e))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "SQL connection ended");
        }
    });
    Ok(client)
}
