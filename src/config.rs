//! Configuration: a TOML file plus `WALTAIL_<SECTION>_<KEY>` environment
//! overrides, validated into typed values before anything is built.
//!
//! The key names are the user's interface (DESIGN.md, "Configuration") and
//! the S3 fields are the product page's own names. Unknown keys are errors
//! that name the key; bad values are errors that name the key and say what is
//! allowed. Secrets live in [`SecretString`] so Debug output never shows them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::source::tls::TlsSettings;
use crate::{Error, Result};

/// Changes per object: the file-size dial. 100 keeps objects small enough that
/// a reader sees a change within a second at modest rates.
pub const DEFAULT_BATCH_SIZE: usize = 100;
/// A partial batch waits at most this long, so a committed change reaches the
/// archive within about a second even when writes are rare.
pub const DEFAULT_LINGER_MS: u64 = 200;
/// Batches uploading at once: enough to hide one PUT's latency behind others.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4;
/// Attempts per batch before it is given up (the product page's "5 times").
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Waits between attempts, from the product page; jitter is added.
pub const DEFAULT_BACKOFF: [Duration; 4] = [
    Duration::from_secs(30),
    Duration::from_secs(60),
    Duration::from_secs(120),
    Duration::from_secs(240),
];
/// A PUT that has not answered in this long is abandoned and counts as a
/// failed attempt: long enough for a 100 MB object on a slow link, short
/// enough that a hung connection does not stall a batch for minutes.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 30_000;
/// Where the archive goes when no `[destination]` is configured.
pub const DEFAULT_ARCHIVE_DIR: &str = "./waltail-archive";
pub const DEFAULT_STATE_DIR: &str = "./waltail-state";
pub const DEFAULT_PIPELINE: &str = "waltail";
pub const DEFAULT_CONFIG_FILE: &str = "waltail.toml";

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub pipeline: String,
    pub state_dir: PathBuf,
    pub source: SourceConfig,
    pub destination: DestinationConfig,
    pub delivery: DeliveryConfig,
}

#[derive(Clone)]
pub struct SourceConfig {
    /// The connection string as given: it may hold a password, so it stays secret.
    pub url: SecretString,
    /// The connection settings; `ssl_mode` is the nearest tokio-postgres
    /// knows, `tls` has the real one.
    pub pg: tokio_postgres::Config,
    /// `sslmode` and `sslrootcert` from the URL (tokio-postgres knows neither
    /// `verify-ca`/`verify-full` nor `sslrootcert`).
    pub tls: TlsSettings,
    pub tables: Vec<TableName>,
    pub publication: String,
    pub slot: String,
}

impl std::fmt::Debug for SourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceConfig")
            .field("url", &redact_url(self.url.expose_secret()))
            .field("tls", &self.tls)
            .field("tables", &self.tables)
            .field("publication", &self.publication)
            .field("slot", &self.slot)
            .finish()
    }
}

/// A schema-qualified table name as configured (`public.orders`, or `orders`
/// for the public schema).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

impl TableName {
    /// The name quoted for SQL: `"public"."orders"`.
    pub fn quoted(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }
}

impl std::fmt::Display for TableName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

impl FromStr for TableName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (schema, name) = match s.split_once('.') {
            Some((schema, name)) => (schema, name),
            None => ("public", s),
        };
        if schema.is_empty() || name.is_empty() || name.contains('.') {
            return Err(format!(
                "{s:?} is not a table name; write schema.table, e.g. \"public.orders\""
            ));
        }
        Ok(TableName {
            schema: schema.to_string(),
            name: name.to_string(),
        })
    }
}

/// Quotes an SQL identifier (doubling embedded quotes), so any name is safe in SQL.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Quotes an SQL string literal.
pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[derive(Debug, Clone)]
pub enum DestinationConfig {
    File {
        path: PathBuf,
        prefix: Option<String>,
    },
    S3(S3Config),
}

impl DestinationConfig {
    pub fn prefix(&self) -> Option<&str> {
        match self {
            DestinationConfig::File { prefix, .. } => prefix.as_deref(),
            DestinationConfig::S3(s3) => s3.prefix.as_deref(),
        }
    }

    /// Where the archive is, for messages: `s3://bucket/prefix` or a path.
    pub fn describe(&self) -> String {
        let prefix = self.prefix().map(|p| format!("/{p}")).unwrap_or_default();
        match self {
            DestinationConfig::File { path, .. } => format!("{}{prefix}", path.display()),
            DestinationConfig::S3(s3) => format!("s3://{}{prefix}", s3.bucket),
        }
    }
}

#[derive(Debug, Clone)]
pub struct S3Config {
    pub bucket: String,
    pub prefix: Option<String>,
    pub region: Option<String>,
    pub endpoint: Option<String>,
    pub use_path_style: bool,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<SecretString>,
}

#[derive(Debug, Clone)]
pub struct DeliveryConfig {
    pub batch_size: usize,
    pub linger: Duration,
    /// Changes per second; 0 means unlimited.
    pub rate_limit: u32,
    pub max_in_flight: usize,
    pub max_attempts: u32,
    pub backoff: Vec<Duration>,
    pub request_timeout: Duration,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            batch_size: DEFAULT_BATCH_SIZE,
            linger: Duration::from_millis(DEFAULT_LINGER_MS),
            rate_limit: 0,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff: DEFAULT_BACKOFF.to_vec(),
            request_timeout: Duration::from_millis(DEFAULT_REQUEST_TIMEOUT_MS),
        }
    }
}

// ---- raw form, as written in the file ----

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    pipeline: Option<String>,
    state_dir: Option<PathBuf>,
    source: Option<RawSource>,
    destination: Option<RawDestination>,
    delivery: Option<RawDelivery>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    url: Option<String>,
    tables: Option<Vec<String>>,
    publication: Option<String>,
    slot: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDestination {
    #[serde(rename = "type")]
    kind: Option<String>,
    bucket: Option<String>,
    prefix: Option<String>,
    region: Option<String>,
    endpoint: Option<String>,
    use_path_style: Option<bool>,
    access_key_id: Option<String>,
    secret_access_key: Option<String>,
    path: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDelivery {
    batch_size: Option<i64>,
    linger_ms: Option<i64>,
    rate_limit: Option<i64>,
    max_in_flight: Option<i64>,
    max_attempts: Option<i64>,
    backoff: Option<Vec<String>>,
    request_timeout_ms: Option<i64>,
}

/// How an environment override's text becomes a TOML value.
#[derive(Clone, Copy)]
enum Kind {
    Str,
    Int,
    Bool,
    /// Comma-separated list of strings.
    List,
}

/// Every key that can be set, with its type: the source of truth for the
/// environment overrides (`WALTAIL_<SECTION>_<KEY>`).
const KEYS: &[(&str, &str, Kind)] = &[
    ("", "pipeline", Kind::Str),
    ("", "state_dir", Kind::Str),
    ("source", "url", Kind::Str),
    ("source", "tables", Kind::List),
    ("source", "publication", Kind::Str),
    ("source", "slot", Kind::Str),
    ("destination", "type", Kind::Str),
    ("destination", "bucket", Kind::Str),
    ("destination", "prefix", Kind::Str),
    ("destination", "region", Kind::Str),
    ("destination", "endpoint", Kind::Str),
    ("destination", "use_path_style", Kind::Bool),
    ("destination", "access_key_id", Kind::Str),
    ("destination", "secret_access_key", Kind::Str),
    ("destination", "path", Kind::Str),
    ("delivery", "batch_size", Kind::Int),
    ("delivery", "linger_ms", Kind::Int),
    ("delivery", "rate_limit", Kind::Int),
    ("delivery", "max_in_flight", Kind::Int),
    ("delivery", "max_attempts", Kind::Int),
    ("delivery", "backoff", Kind::List),
    ("delivery", "request_timeout_ms", Kind::Int),
];

/// `WALTAIL_*` variables that are not configuration keys.
const NON_CONFIG_VARS: &[&str] = &["WALTAIL_LOG", "WALTAIL_CONFIG"];

fn env_name(section: &str, key: &str) -> String {
    if section.is_empty() {
        format!("WALTAIL_{}", key.to_uppercase())
    } else {
        format!("WALTAIL_{}_{}", section.to_uppercase(), key.to_uppercase())
    }
}

impl Config {
    /// Loads the configuration: the file at `path` (or `./waltail.toml` when it
    /// exists and no path was given), then the environment overrides.
    pub fn load(path: Option<&Path>) -> Result<Config> {
        let vars: BTreeMap<String, String> = std::env::vars()
            .filter(|(k, _)| k.starts_with("WALTAIL_"))
            .collect();
        let (text, origin) = match path {
            Some(p) => (
                Some(std::fs::read_to_string(p).map_err(|e| {
                    Error::config(format!("cannot read the config file {}: {e}", p.display()))
                })?),
                p.display().to_string(),
            ),
            None => {
                let default = Path::new(DEFAULT_CONFIG_FILE);
                if default.exists() {
                    (
                        Some(std::fs::read_to_string(default).map_err(|e| {
                            Error::config(format!("cannot read {DEFAULT_CONFIG_FILE}: {e}"))
                        })?),
                        DEFAULT_CONFIG_FILE.to_string(),
                    )
                } else {
                    (None, "the environment".to_string())
                }
            }
        };
        Config::from_parts(text.as_deref(), &origin, &vars)
    }

    /// Builds a configuration from the file's text and the `WALTAIL_*` variables.
    pub fn from_parts(
        text: Option<&str>,
        origin: &str,
        vars: &BTreeMap<String, String>,
    ) -> Result<Config> {
        let mut table: toml::Table = match text {
            Some(t) => t
                .parse()
                .map_err(|e: toml::de::Error| Error::config(format!("{origin}: {e}")))?,
            None => toml::Table::new(),
        };
        apply_env(&mut table, vars)?;
        let raw = RawConfig::deserialize(table)
            .map_err(|e| Error::config(format!("{origin}: {}", e.message().trim_end())))?;
        validate(raw)
    }

    /// The file name of this pipeline's local state.
    pub fn state_file(&self) -> PathBuf {
        self.state_dir.join(format!("{}.sqlite", self.pipeline))
    }
}

fn apply_env(table: &mut toml::Table, vars: &BTreeMap<String, String>) -> Result<()> {
    for (name, text) in vars {
        if NON_CONFIG_VARS.contains(&name.as_str()) {
            continue;
        }
        let Some((section, key, kind)) = KEYS
            .iter()
            .find(|(s, k, _)| env_name(s, k) == *name)
            .copied()
        else {
            let known: Vec<String> = KEYS.iter().map(|(s, k, _)| env_name(s, k)).collect();
            return Err(Error::config(format!(
                "unknown environment variable {name}: waltail reads {}",
                known.join(", ")
            )));
        };
        let value =
            match kind {
                Kind::Str => toml::Value::String(text.clone()),
                Kind::Int => toml::Value::Integer(text.trim().parse().map_err(|_| {
                    Error::config(format!("{name}={text:?}: expected a whole number"))
                })?),
                Kind::Bool => toml::Value::Boolean(match text.trim() {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    _ => {
                        return Err(Error::config(format!(
                            "{name}={text:?}: expected true or false"
                        )));
                    }
                }),
                Kind::List => toml::Value::Array(
                    text.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(|s| toml::Value::String(s.to_string()))
                        .collect(),
                ),
            };
        if section.is_empty() {
            table.insert(key.to_string(), value);
        } else {
            let entry = table
                .entry(section.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let toml::Value::Table(t) = entry else {
                return Err(Error::config(format!("`{section}` must be a table")));
            };
            t.insert(key.to_string(), value);
        }
    }
    Ok(())
}

fn positive(key: &str, v: Option<i64>, default: i64, max: i64) -> Result<i64> {
    let v = v.unwrap_or(default);
    if v < 1 || v > max {
        return Err(Error::config(format!(
            "{key} = {v}: must be between 1 and {max}"
        )));
    }
    Ok(v)
}

fn valid_name(key: &str, v: &str) -> Result<()> {
    if v.is_empty()
        || v.len() > 63
        || !v
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    {
        return Err(Error::config(format!(
            "{key} = {v:?}: use 1 to 63 characters of a-z, 0-9, _ and -"
        )));
    }
    Ok(())
}

fn validate(raw: RawConfig) -> Result<Config> {
    let pipeline = raw.pipeline.unwrap_or_else(|| DEFAULT_PIPELINE.to_string());
    valid_name("pipeline", &pipeline)?;
    let state_dir = raw
        .state_dir
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR));

    let source = raw.source.ok_or_else(|| {
        Error::config("[source] is missing: set source.url and source.tables (or WALTAIL_SOURCE_URL and WALTAIL_SOURCE_TABLES)")
    })?;
    let url = source.url.ok_or_else(|| {
        Error::config("source.url is missing: e.g. url = \"postgres://user@host:5432/db\" (or WALTAIL_SOURCE_URL)")
    })?;
    // sslmode and sslrootcert are ours: tokio-postgres would refuse verify-ca,
    // verify-full and sslrootcert.
    let (pg_url, tls) = crate::source::tls::extract(&url)
        .map_err(|e| Error::config(format!("source.url = {:?}: {e}", redact_url(&url))))?;
    let mut pg = tokio_postgres::Config::from_str(&pg_url).map_err(|e| {
        Error::config(format!(
            "source.url = {:?} is not a Postgres connection string: {e}",
            redact_url(&url)
        ))
    })?;
    pg.ssl_mode(tls.mode.for_tokio_postgres());
    if pg.get_dbname().is_none() {
        return Err(Error::config(format!(
            "source.url = {:?} names no database: add it, e.g. postgres://user@host:5432/shop",
            redact_url(&url)
        )));
    }
    let tables_raw = source.tables.unwrap_or_default();
    if tables_raw.is_empty() {
        return Err(Error::config(
            "source.tables is empty: list the tables to archive, e.g. tables = [\"public.orders\"]",
        ));
    }
    let mut tables = Vec::new();
    for t in &tables_raw {
        let name: TableName = t
            .parse()
            .map_err(|e| Error::config(format!("source.tables: {e}")))?;
        if !tables.contains(&name) {
            tables.push(name);
        }
    }
    let derived = format!("waltail_{}", pipeline.replace('-', "_"));
    let publication = source.publication.unwrap_or_else(|| derived.clone());
    let slot = source.slot.unwrap_or(derived);
    if slot.is_empty()
        || slot.len() > 63
        || !slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(Error::config(format!(
            "source.slot = {slot:?}: Postgres allows 1 to 63 characters of a-z, 0-9 and _ in slot names"
        )));
    }
    if publication.is_empty() || publication.len() > 63 {
        return Err(Error::config(format!(
            "source.publication = {publication:?}: use 1 to 63 characters"
        )));
    }

    let destination = match raw.destination {
        None => DestinationConfig::File {
            path: PathBuf::from(DEFAULT_ARCHIVE_DIR),
            prefix: None,
        },
        Some(d) => destination(d)?,
    };

    let delivery = match raw.delivery {
        None => DeliveryConfig::default(),
        Some(d) => {
            let backoff = match d.backoff {
                None => DEFAULT_BACKOFF.to_vec(),
                Some(list) if list.is_empty() => {
                    return Err(Error::config(
                        "delivery.backoff is empty: give at least one wait, e.g. [\"30s\"]",
                    ));
                }
                Some(list) => list
                    .iter()
                    .map(|s| {
                        humantime::parse_duration(s).map_err(|e| {
                            Error::config(format!(
                                "delivery.backoff: {s:?} is not a duration ({e}); write e.g. \"500ms\", \"30s\", \"2m\""
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?,
            };
            let rate_limit = d.rate_limit.unwrap_or(0);
            if !(0..=u32::MAX as i64).contains(&rate_limit) {
                return Err(Error::config(format!(
                    "delivery.rate_limit = {rate_limit}: changes per second, 0 for unlimited"
                )));
            }
            let linger_ms = d.linger_ms.unwrap_or(DEFAULT_LINGER_MS as i64);
            if !(0..=3_600_000).contains(&linger_ms) {
                return Err(Error::config(format!(
                    "delivery.linger_ms = {linger_ms}: must be between 0 and 3600000"
                )));
            }
            DeliveryConfig {
                batch_size: positive(
                    "delivery.batch_size",
                    d.batch_size,
                    DEFAULT_BATCH_SIZE as i64,
                    1_000_000,
                )? as usize,
                linger: Duration::from_millis(linger_ms as u64),
                rate_limit: rate_limit as u32,
                max_in_flight: positive(
                    "delivery.max_in_flight",
                    d.max_in_flight,
                    DEFAULT_MAX_IN_FLIGHT as i64,
                    256,
                )? as usize,
                max_attempts: positive(
                    "delivery.max_attempts",
                    d.max_attempts,
                    DEFAULT_MAX_ATTEMPTS as i64,
                    1000,
                )? as u32,
                backoff,
                request_timeout: Duration::from_millis(positive(
                    "delivery.request_timeout_ms",
                    d.request_timeout_ms,
                    DEFAULT_REQUEST_TIMEOUT_MS as i64,
                    3_600_000,
                )? as u64),
            }
        }
    };

    Ok(Config {
        pipeline,
        state_dir,
        source: SourceConfig {
            url: SecretString::from(url),
            pg,
            tls,
            tables,
            publication,
            slot,
        },
        destination,
        delivery,
    })
}

fn destination(d: RawDestination) -> Result<DestinationConfig> {
    let prefix = match d.prefix.as_deref().map(|p| p.trim_matches('/')) {
        None | Some("") => None,
        Some(p) => {
            if p.split('/')
                .any(|seg| seg.is_empty() || seg == "." || seg == "..")
            {
                return Err(Error::config(format!(
                    "destination.prefix = {p:?}: use path segments separated by single '/', without '.' or '..'"
                )));
            }
            Some(p.to_string())
        }
    };
    let kind = match d.kind.as_deref() {
        Some(k) => k.to_string(),
        None if d.bucket.is_some() => "s3".to_string(),
        None => "file".to_string(),
    };
    match kind.as_str() {
        "file" => {
            for (key, set) in [
                ("bucket", d.bucket.is_some()),
                ("region", d.region.is_some()),
                ("endpoint", d.endpoint.is_some()),
                ("use_path_style", d.use_path_style.is_some()),
                ("access_key_id", d.access_key_id.is_some()),
                ("secret_access_key", d.secret_access_key.is_some()),
            ] {
                if set {
                    return Err(Error::config(format!(
                        "destination.{key} applies to type = \"s3\" only; this destination is type = \"file\""
                    )));
                }
            }
            Ok(DestinationConfig::File {
                path: d.path.unwrap_or_else(|| PathBuf::from(DEFAULT_ARCHIVE_DIR)),
                prefix,
            })
        }
        "s3" => {
            if d.path.is_some() {
                return Err(Error::config(
                    "destination.path applies to type = \"file\" only; for S3 use bucket and prefix",
                ));
            }
            let bucket = d
                .bucket
                .filter(|b| !b.is_empty())
                .ok_or_else(|| Error::config("destination.bucket is required for type = \"s3\""))?;
            if let Some(endpoint) = &d.endpoint
                && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
            {
                return Err(Error::config(format!(
                    "destination.endpoint = {endpoint:?}: give a URL, e.g. \"https://s3.us-east-1.amazonaws.com\" or \"http://127.0.0.1:8333\""
                )));
            }
            if d.access_key_id.is_some() != d.secret_access_key.is_some() {
                return Err(Error::config(
                    "destination.access_key_id and destination.secret_access_key go together: set both, or neither to use the AWS_* variables",
                ));
            }
            Ok(DestinationConfig::S3(S3Config {
                bucket,
                prefix,
                region: d.region,
                endpoint: d.endpoint,
                use_path_style: d.use_path_style.unwrap_or(false),
                access_key_id: d.access_key_id,
                secret_access_key: d.secret_access_key.map(SecretString::from),
            }))
        }
        other => Err(Error::config(format!(
            "destination.type = {other:?}: use \"s3\" or \"file\""
        ))),
    }
}

/// The connection string with any password replaced, for messages.
pub fn redact_url(url: &str) -> String {
    // URL form: scheme://user:password@host...
    if let Some(rest) = url.split_once("://").map(|(_, r)| r)
        && let Some((userinfo, _)) = rest.split_once('@')
        && let Some((_, password)) = userinfo.split_once(':')
        && !password.is_empty()
    {
        return url.replacen(&format!(":{password}@"), ":***@", 1);
    }
    // key=value form: password=...
    let mut out = Vec::new();
    for part in url.split_whitespace() {
        if part.starts_with("password=") {
            out.push("password=***".to_string());
        } else {
            out.push(part.to_string());
        }
    }
    if url.contains("password=") {
        out.join(" ")
    } else {
        url.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str, vars: &[(&str, &str)]) -> Result<Config> {
        let vars = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_parts(Some(text), "test.toml", &vars)
    }

    const MINIMAL: &str = r#"
        [source]
        url = "postgres://u@localhost/db"
        tables = ["public.orders", "customers"]
    "#;

    #[test]
    fn minimal_config_takes_documented_defaults() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.pipeline, "waltail");
        assert_eq!(c.source.slot, "waltail_waltail");
        assert_eq!(c.source.publication, "waltail_waltail");
        assert_eq!(c.source.tables[1].to_string(), "public.customers");
        assert_eq!(c.delivery.batch_size, 100);
        assert_eq!(c.delivery.max_attempts, 5);
        assert_eq!(c.delivery.backoff[3], Duration::from_secs(240));
        assert!(
            matches!(c.destination, DestinationConfig::File { ref path, .. } if path == Path::new("./waltail-archive"))
        );
    }

    #[test]
    fn unknown_key_is_named() {
        let err = load(&format!("{MINIMAL}\n[delivery]\nbatch_sise = 5\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("batch_sise"), "{err}");
    }

    #[test]
    fn env_overrides_file_and_types_values() {
        let c = load(
            MINIMAL,
            &[
                ("WALTAIL_DELIVERY_BATCH_SIZE", "7"),
                ("WALTAIL_DESTINATION_BUCKET", "b"),
                ("WALTAIL_DESTINATION_USE_PATH_STYLE", "true"),
                ("WALTAIL_SOURCE_TABLES", "a.b, c.d"),
                ("WALTAIL_PIPELINE", "orders"),
            ],
        )
        .unwrap();
        assert_eq!(c.delivery.batch_size, 7);
        assert_eq!(c.pipeline, "orders");
        assert_eq!(c.source.slot, "waltail_orders");
        assert_eq!(c.source.tables.len(), 2);
        let DestinationConfig::S3(s3) = c.destination else {
            panic!("bucket implies s3")
        };
        assert!(s3.use_path_style);
    }

    #[test]
    fn unknown_env_var_is_named() {
        let err = load(MINIMAL, &[("WALTAIL_DESTINATION_BUKET", "x")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("WALTAIL_DESTINATION_BUKET"), "{err}");
    }

    #[test]
    fn bad_values_say_what_is_allowed() {
        let err = load(&format!("{MINIMAL}\n[delivery]\nbatch_size = 0\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("delivery.batch_size") && err.contains("between 1"),
            "{err}"
        );
        let err = load(&format!("{MINIMAL}\n[destination]\ntype = \"gcs\"\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"s3\" or \"file\""), "{err}");
        let err = load(
            &format!("{MINIMAL}\n[delivery]\nbackoff = [\"soon\"]\n"),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("delivery.backoff"), "{err}");
        let err = load("pipeline = \"Bad Name\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("pipeline"), "{err}");
    }

    #[test]
    fn secrets_do_not_show_in_debug() {
        let c = load(
            r#"
            [source]
            url = "postgres://u:hunter2@localhost/db"
            tables = ["t"]
            [destination]
            bucket = "b"
            access_key_id = "AKIA"
            secret_access_key = "s3cr3t"
            "#,
            &[],
        )
        .unwrap();
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("hunter2") && !dbg.contains("s3cr3t"), "{dbg}");
    }

    #[test]
    fn tls_settings_come_from_the_url() {
        use crate::source::tls::SslMode;
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.source.tls.mode, SslMode::Prefer);
        let c = load(
            MINIMAL,
            &[("WALTAIL_SOURCE_URL", "host=h dbname=d sslmode=require")],
        )
        .unwrap();
        assert_eq!(c.source.tls.mode, SslMode::Require);
        assert_eq!(
            c.source.pg.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        let err = load(
            MINIMAL,
            &[(
                "WALTAIL_SOURCE_URL",
                "postgres://u:pw@h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
            )],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("source.url")
                && err.contains("/nonexistent/ca.pem")
                && !err.contains("pw@"),
            "{err}"
        );
        let err = load(
            MINIMAL,
            &[("WALTAIL_SOURCE_URL", "postgres://u@h/db?sslmode=verify")],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("verify-full"), "{err}");
    }

    #[test]
    fn redact_url_hides_passwords() {
        assert_eq!(
            redact_url("postgres://u:pw@h:5/db"),
            "postgres://u:***@h:5/db"
        );
        assert_eq!(
            redact_url("host=h password=pw user=u"),
            "host=h password=*** user=u"
        );
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
    }
}
