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

use schemars::JsonSchema;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

pub(crate) mod effective;

use crate::archive::codec::Codec;
use crate::pgtls::TlsSettings;
use crate::sql::quote_ident;
use crate::{Error, Result};

/// Changes per object: the file-size dial. 100 keeps objects small enough that
/// a reader sees a change within a second at modest rates.
pub const DEFAULT_BATCH_SIZE: usize = 100;
/// A partial batch waits at most this long, so a committed change reaches the
/// archive within about a second even when writes are rare.
pub const DEFAULT_LINGER_MS: u64 = 200;
/// An object is cut at this many bytes even before `batch_size` changes (see
/// [`crate::batch::MAX_BATCH_BYTES`]).
pub const DEFAULT_MAX_BATCH_BYTES: usize = crate::batch::MAX_BATCH_BYTES;
/// The largest `delivery.max_batch_bytes`: every batch in memory (uploading,
/// waiting, being filled) may be this large, and a PUT holds it whole.
pub const MAX_MAX_BATCH_BYTES: i64 = 256 * 1024 * 1024;
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
/// Slot lag (WAL the server holds for us past the confirmed position) above
/// which `run` warns: 1 GiB is far above what a healthy pipeline lags (a few
/// MB between confirmations), and low enough to be noticed hours before a
/// busy server's disk or `max_slot_wal_keep_size` is at risk. 0 turns it off.
pub const DEFAULT_SLOT_LAG_WARN_BYTES: u64 = 1 << 30;
/// Rows a backfill reads per chunk: one short snapshot each, and the window
/// in which changed rows are left to their change.
pub const DEFAULT_BACKFILL_CHUNK_SIZE: u64 = 5000;
/// `read` events per object: bulk rows, so larger objects than streamed
/// changes' (a 100-million-row table is 100,000 objects, not a million).
pub const DEFAULT_BACKFILL_BATCH_SIZE: usize = 1000;
/// The most key ranges a backfill reads at once (each holds a connection).
pub const MAX_BACKFILL_PARALLELISM: i64 = 64;

/// `backfill.parallelism` by default: the number of cores, so rows are
/// read and rendered on every one.
pub fn default_backfill_parallelism() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}
/// Parquet codec of `compact`: zstd compresses NDJSON-shaped data about as
/// well as gzip at several times its speed, and every engine reads it.
pub const DEFAULT_COMPACT_COMPRESSION: &str = "zstd";
/// Rows per Parquet row group: the unit engines skip by statistics and the
/// writer buffers before encoding, so it bounds compact's memory per table.
pub const DEFAULT_COMPACT_ROW_GROUP_ROWS: usize = 131_072;
/// How long `compact` keeps the files a commit replaced: Delta's own
/// vacuum default, so `VERSION AS OF` reaches a week back.
pub const DEFAULT_COMPACT_RETAIN: Duration = Duration::from_secs(7 * 86_400);
/// NDJSON bytes compacted into one Parquet file at most (256 MiB): large
/// enough that engines open few files, small enough to rewrite cheaply.
pub const DEFAULT_COMPACT_FILE_BYTES: u64 = 256 << 20;
/// Memory the latest merge gives one bucket of keys (128 MiB): a table's
/// latest view is merged a bucket at a time, with as many buckets as it
/// takes for one to fit, so compact's peak memory stays a few hundred MB
/// whatever the number of rows.
pub const DEFAULT_COMPACT_MERGE_BYTES: u64 = 128 << 20;
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
    /// `destination.compression`: how archive objects are encoded.
    pub compression: Codec,
    pub delivery: DeliveryConfig,
    /// Where the console, `/metrics`, `/healthz` and `/readyz` are served;
    /// off when `None`.
    pub telemetry_listen: Option<std::net::SocketAddr>,
    /// `telemetry.slot_lag_warn_bytes`: slot lag that makes `run` warn and
    /// `status` and the console flag it; 0 = never.
    pub slot_lag_warn_bytes: u64,
    pub backfill: BackfillConfig,
    /// The `[compact]` section.
    pub compact: CompactConfig,
}

/// `[backfill]`: how existing rows are read and archived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackfillConfig {
    /// Rows per chunk (`waltail backfill --chunk-size` overrides it).
    pub chunk_size: u64,
    /// `read` events per object, while a batch holds only those.
    pub batch_size: usize,
    /// Key ranges read at once, each on its own connection.
    pub parallelism: usize,
}

/// How `waltail compact` writes Parquet (`[compact]`).
#[derive(Debug, Clone)]
pub struct CompactConfig {
    /// `compact.compression`: zstd, snappy, gzip or none.
    pub compression: Compression,
    /// `compact.compression_level`: zstd's (1-22) or gzip's (0-9); `None`:
    /// the codec's default here (zstd 3, gzip 6).
    pub compression_level: Option<u32>,
    /// `compact.row_group_rows`.
    pub row_group_rows: usize,
    /// `compact.file_bytes`: NDJSON input bytes per history file at most,
    /// and the Parquet bytes per latest-view file at most.
    pub file_bytes: u64,
    /// `compact.merge_bytes`: the estimated memory of one bucket of a
    /// latest view being merged.
    pub merge_bytes: u64,
    /// `compact.retain`: how long files a commit replaced stay, so time
    /// travel reaches the snapshots of that period.
    pub retain: Duration,
    /// `compact.vacuum`: whether a run deletes, at its end, the replaced
    /// files of the tables it committed to that are past `retain`.
    pub vacuum: bool,
}

impl Default for CompactConfig {
    fn default() -> Self {
        CompactConfig {
            compression: Compression::Zstd,
            compression_level: None,
            row_group_rows: DEFAULT_COMPACT_ROW_GROUP_ROWS,
            file_bytes: DEFAULT_COMPACT_FILE_BYTES,
            merge_bytes: DEFAULT_COMPACT_MERGE_BYTES,
            retain: DEFAULT_COMPACT_RETAIN,
            vacuum: true,
        }
    }
}

/// A Parquet codec `compact` may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Zstd,
    Snappy,
    Gzip,
    None,
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

/// A schema-qualified table name as configured.
///
/// How `source.tables` entries are read:
/// - `schema.table`, split at the dot; `orders` alone means `public.orders`.
///   Names are taken exactly as written (case-sensitive, never folded to
///   lower case), with surrounding spaces trimmed.
/// - Either part may be written SQL-style in double quotes, with `""` for a
///   quote: `"My Schema"."My.Table"`, `public."quo""te"`. A name needs quotes
///   when it holds a dot or a double quote, or starts or ends with a space.
///   (In TOML, single-quoted strings avoid escaping: `'public."a.b"'`.)
/// - Each part is 1 to 63 bytes (Postgres's limit) without control
///   characters; anything else is refused at load, before any SQL runs.
/// - `WALTAIL_SOURCE_TABLES` is split at commas, so a name holding a comma
///   can only be listed in the file.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

/// Postgres truncates identifiers to 63 bytes (NAMEDATALEN - 1).
const MAX_IDENT_BYTES: usize = 63;

impl TableName {
    /// The name quoted for SQL: `"public"."orders"`.
    pub fn quoted(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }

    /// The name as it is written in `source.tables`: plain `schema.table`
    /// when that reads back the same, each part quoted where needed.
    pub fn config_form(&self) -> String {
        fn part(s: &str) -> String {
            if s.is_empty() || s.contains(['.', '"']) || s.trim() != s {
                quote_ident(s)
            } else {
                s.to_string()
            }
        }
        format!("{}.{}", part(&self.schema), part(&self.name))
    }
}

impl std::fmt::Display for TableName {
    /// `schema.table` unquoted, as the archive's `table` field spells it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// One part of a table entry: a quoted identifier (`""` for a quote) or plain
/// text up to the next dot. Returns the part and the text after it.
fn table_part(s: &str) -> Result<(String, &str), String> {
    let s = s.trim_start();
    if let Some(body) = s.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = body.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            if c == '"' {
                if chars.peek().map(|&(_, n)| n) == Some('"') {
                    chars.next();
                    out.push('"');
                } else {
                    return Ok((out, body[i + 1..].trim_start()));
                }
            } else {
                out.push(c);
            }
        }
        Err("a quoted name has no closing quote".into())
    } else {
        let end = s.find('.').unwrap_or(s.len());
        let part = s[..end].trim_end();
        if part.contains('"') {
            return Err(
                "a quote inside a plain name; quote the whole name, with \"\" for a quote".into(),
            );
        }
        Ok((part.to_string(), &s[end..]))
    }
}

fn check_part(what: &str, part: &str) -> Result<(), String> {
    if part.is_empty() {
        return Err(format!("the {what} name is empty"));
    }
    if part.len() > MAX_IDENT_BYTES {
        return Err(format!(
            "the {what} name is {} bytes; Postgres names are at most {MAX_IDENT_BYTES}",
            part.len()
        ));
    }
    if part.chars().any(char::is_control) {
        return Err(format!("the {what} name holds a control character"));
    }
    Ok(())
}

impl FromStr for TableName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parsed = (|| {
            let (first, rest) = table_part(s)?;
            let (schema, name) = if rest.is_empty() {
                ("public".to_string(), first)
            } else if let Some(rest) = rest.strip_prefix('.') {
                let (second, rest) = table_part(rest)?;
                if rest.starts_with('.') {
                    return Err(
                        "more than one dot; quote a name that holds a dot: \"schema\".\"my.table\""
                            .to_string(),
                    );
                }
                if !rest.is_empty() {
                    return Err("text after the closing quote".to_string());
                }
                (first, second)
            } else {
                return Err("text after the closing quote".to_string());
            };
            check_part("schema", &schema)?;
            check_part("table", &name)?;
            Ok(TableName { schema, name })
        })();
        parsed.map_err(|why: String| {
            format!(
                "{s:?} is not a table name ({why}); write schema.table, e.g. \"public.orders\", \
                 and quote names holding dots or quotes SQL-style: \"My Schema\".\"My.Table\""
            )
        })
    }
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
    /// `destination.profile`: the profile of the shared AWS files; `None`
    /// is AWS_PROFILE, else "default".
    pub profile: Option<String>,
    /// `destination.role_arn` and its options: the role to assume through
    /// STS with whatever credentials the rest of the chain finds.
    pub role: Option<AssumeRole>,
}

/// A role the S3 credentials come from (`destination.role_arn`).
#[derive(Debug, Clone)]
pub struct AssumeRole {
    pub arn: String,
    pub external_id: Option<String>,
    /// Default "waltail".
    pub session_name: String,
}

#[derive(Debug, Clone)]
pub struct DeliveryConfig {
    pub batch_size: usize,
    /// `delivery.max_batch_bytes`: an object's size cap in bytes.
    pub max_batch_bytes: usize,
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
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
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
//
// These types are also the JSON Schema of `waltail.toml`
// (`schemas/config.schema.json`, from `waltail config --schema`): their doc
// comments are what an editor shows beside each key. docs/configuration.md
// has the whole story of each.

/// waltail's configuration file (waltail.toml). Every key can also be set
/// by an environment variable WALTAIL_<SECTION>_<KEY>.
#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "waltail.toml")]
struct RawConfig {
    /// Name used in object keys and the default slot and publication names:
    /// a-z, 0-9, _ and -, up to 63. Default "waltail".
    pipeline: Option<String>,
    /// Folder of the local crash-safe state (<pipeline>.sqlite). Default
    /// "./waltail-state".
    state_dir: Option<PathBuf>,
    /// The PostgreSQL database to archive.
    source: Option<RawSource>,
    /// Where the archive goes. Without it: the folder ./waltail-archive.
    destination: Option<RawDestination>,
    /// How changes become objects and how uploads are retried.
    delivery: Option<RawDelivery>,
    /// The console, /metrics, /healthz and /readyz.
    telemetry: Option<RawTelemetry>,
    /// How `waltail backfill` reads existing rows.
    backfill: Option<RawBackfill>,
    /// How `waltail compact` writes Delta tables.
    compact: Option<RawCompact>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Backfill")]
struct RawBackfill {
    /// Rows read per chunk, one short snapshot each. Default 5000.
    #[schemars(range(min = 1, max = MAX_COUNT))]
    chunk_size: Option<i64>,
    /// `read` events per object while a batch holds only those. Default 1000.
    #[schemars(range(min = 1, max = MAX_COUNT))]
    batch_size: Option<i64>,
    /// Key ranges of a table read at once, each on its own connection with
    /// its own snapshots. Default: the number of cores.
    #[schemars(range(min = 1, max = MAX_BACKFILL_PARALLELISM))]
    parallelism: Option<i64>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Compact")]
struct RawCompact {
    /// Parquet codec. Default "zstd".
    #[schemars(extend("enum" = ["zstd", "snappy", "gzip", "none"]))]
    compression: Option<String>,
    /// The codec's level: zstd 1 (fastest) to 22 (smallest), gzip 0 to 9.
    /// Default: zstd 3, gzip 6.
    #[schemars(range(min = 0, max = 22))]
    compression_level: Option<i64>,
    /// Rows per Parquet row group. Default 131072.
    #[schemars(range(min = 1, max = MAX_ROW_GROUP_ROWS))]
    row_group_rows: Option<i64>,
    /// NDJSON bytes per history file, and Parquet bytes per latest-view
    /// file, at most. Default 268435456 (256 MiB).
    #[schemars(range(min = 1, max = MAX_COMPACT_BYTES))]
    file_bytes: Option<i64>,
    /// Memory for combining changes by key and for one bucket of a latest
    /// view being merged. Default 134217728 (128 MiB).
    #[schemars(range(min = 1, max = MAX_COMPACT_BYTES))]
    merge_bytes: Option<i64>,
    /// How long files a commit replaced stay, so time travel reaches that
    /// far back: a duration such as "7d", "36h", "0s". Default "7d".
    retain: Option<String>,
    /// Whether a run ends by deleting replaced files past `retain`.
    /// Default true.
    vacuum: Option<bool>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Telemetry")]
struct RawTelemetry {
    /// Address of the console, /metrics, /healthz and /readyz, e.g.
    /// "127.0.0.1:9187" (port 0: any free port). Default: off.
    listen: Option<String>,
    /// Slot lag in bytes over which `run` warns and `status` flags it; 0
    /// turns it off. Default 1073741824 (1 GiB).
    #[schemars(range(min = 0))]
    slot_lag_warn_bytes: Option<i64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Source")]
struct RawSource {
    /// postgres://user[:password]@host:port/db (or key=value form), with
    /// sslmode and sslrootcert for TLS. Required.
    url: Option<String>,
    /// Tables to archive as schema.table (`orders` is public.orders);
    /// quote a part SQL-style when it holds a dot or a quote. Required.
    tables: Option<Vec<String>>,
    /// Publication, created if missing. Default waltail_<pipeline>.
    publication: Option<String>,
    /// Logical replication slot, created if missing. Default
    /// waltail_<pipeline>.
    slot: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Destination")]
struct RawDestination {
    /// "file" (a folder) or "s3". Default "file", or "s3" when a bucket
    /// is set.
    #[serde(rename = "type")]
    #[schemars(extend("enum" = ["file", "s3"]))]
    kind: Option<String>,
    /// The bucket, for type = "s3".
    bucket: Option<String>,
    /// Key prefix, e.g. "waltail/prod"; the dated path follows it.
    prefix: Option<String>,
    /// AWS region. Default AWS_REGION or AWS_DEFAULT_REGION, else
    /// us-east-1.
    region: Option<String>,
    /// A custom endpoint URL: MinIO, R2, SeaweedFS, a VPC endpoint.
    endpoint: Option<String>,
    /// Path-style addressing (MinIO and most compatible stores). Default
    /// false.
    use_path_style: Option<bool>,
    /// Static credentials, with secret_access_key; without both, the AWS
    /// credential chain: the AWS_* variables, the shared files' profile,
    /// web identity, then container or instance credentials.
    access_key_id: Option<String>,
    /// Never printed. A file holding it must be private (chmod 600).
    secret_access_key: Option<String>,
    /// A profile of the shared AWS files (~/.aws/config and
    /// ~/.aws/credentials, or AWS_CONFIG_FILE and
    /// AWS_SHARED_CREDENTIALS_FILE); set, it is the only source, as the
    /// CLI's --profile. Default: the chain, with AWS_PROFILE, else "default".
    profile: Option<String>,
    /// An IAM role to assume through STS, e.g.
    /// "arn:aws:iam::123456789012:role/archive-writer", with the
    /// credentials found otherwise; refreshed before they expire.
    role_arn: Option<String>,
    /// The external id the role's trust policy asks for, if any.
    external_id: Option<String>,
    /// The role session's name, seen in CloudTrail. Default "waltail".
    role_session_name: Option<String>,
    /// The folder, for type = "file". Default "./waltail-archive".
    path: Option<PathBuf>,
    /// How objects are encoded: "none" (.ndjson), "gzip" (.ndjson.gz) or
    /// "zstd" (.ndjson.zst). Default "none".
    #[schemars(extend("enum" = ["none", "gzip", "zstd"]))]
    compression: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Delivery")]
struct RawDelivery {
    /// Changes per object. Default 100.
    #[schemars(range(min = 1, max = MAX_COUNT))]
    batch_size: Option<i64>,
    /// An object's size cap in bytes, 1 to 268435456. Default 8388608
    /// (8 MiB).
    #[schemars(range(min = 1, max = MAX_MAX_BATCH_BYTES))]
    max_batch_bytes: Option<i64>,
    /// A partial batch leaves after this many milliseconds (0 to 3600000).
    /// Default 200.
    #[schemars(range(min = 0, max = MAX_MS))]
    linger_ms: Option<i64>,
    /// Changes per second at most; 0 is unlimited. Default 0.
    #[schemars(range(min = 0, max = 4_294_967_295_i64))]
    rate_limit: Option<i64>,
    /// Batches uploading at once. Default 4.
    #[schemars(range(min = 1, max = MAX_IN_FLIGHT))]
    max_in_flight: Option<i64>,
    /// Attempts per batch before it is parked. Default 5.
    #[schemars(range(min = 1, max = MAX_ATTEMPTS))]
    max_attempts: Option<i64>,
    /// Waits between attempts as durations, the last repeating. Default
    /// ["30s", "1m", "2m", "4m"].
    #[schemars(length(min = 1))]
    backoff: Option<Vec<String>>,
    /// A PUT not answered in this many milliseconds is a failed attempt.
    /// Default 30000.
    #[schemars(range(min = 1, max = MAX_MS))]
    request_timeout_ms: Option<i64>,
}

/// The JSON Schema of the configuration file, as `schemas/config.schema.json`
/// holds it (a test keeps the two the same).
pub fn schema() -> String {
    let schema = schemars::schema_for!(RawConfig);
    serde_json::to_string_pretty(&schema).unwrap_or_default() + "\n"
}

/// How an environment override's text becomes a TOML value.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Str,
    Int,
    Bool,
    /// Comma-separated list of strings.
    List,
}

/// Every key that can be set, with its type: the source of truth for the
/// environment overrides (`WALTAIL_<SECTION>_<KEY>`).
pub(crate) const KEYS: &[(&str, &str, Kind)] = &[
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
    ("destination", "profile", Kind::Str),
    ("destination", "role_arn", Kind::Str),
    ("destination", "external_id", Kind::Str),
    ("destination", "role_session_name", Kind::Str),
    ("destination", "path", Kind::Str),
    ("destination", "compression", Kind::Str),
    ("delivery", "batch_size", Kind::Int),
    ("delivery", "linger_ms", Kind::Int),
    ("delivery", "max_batch_bytes", Kind::Int),
    ("delivery", "rate_limit", Kind::Int),
    ("delivery", "max_in_flight", Kind::Int),
    ("delivery", "max_attempts", Kind::Int),
    ("delivery", "backoff", Kind::List),
    ("delivery", "request_timeout_ms", Kind::Int),
    ("telemetry", "listen", Kind::Str),
    ("telemetry", "slot_lag_warn_bytes", Kind::Int),
    ("backfill", "chunk_size", Kind::Int),
    ("backfill", "batch_size", Kind::Int),
    ("backfill", "parallelism", Kind::Int),
    ("compact", "compression", Kind::Str),
    ("compact", "compression_level", Kind::Int),
    ("compact", "row_group_rows", Kind::Int),
    ("compact", "file_bytes", Kind::Int),
    ("compact", "merge_bytes", Kind::Int),
    ("compact", "retain", Kind::Str),
    ("compact", "vacuum", Kind::Bool),
];

/// What a configuration was read from: the file (if any), as parsed, and
/// the `WALTAIL_*` variables. `waltail config` tells each key's origin
/// from it.
#[derive(Debug, Clone)]
pub struct Sources {
    pub file: Option<PathBuf>,
    table: toml::Table,
    vars: BTreeMap<String, String>,
}

/// Where a key's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The `WALTAIL_*` variable of this name.
    Env(String),
    /// The config file.
    File,
    /// Nobody set it.
    Default,
}

impl Sources {
    /// Where `section.key` (`section` empty for a top-level key) came from.
    pub fn origin(&self, section: &str, key: &str) -> Origin {
        let name = env_name(section, key);
        if self.vars.contains_key(&name) {
            return Origin::Env(name);
        }
        let in_file = if section.is_empty() {
            self.table.contains_key(key)
        } else {
            self.table
                .get(section)
                .and_then(toml::Value::as_table)
                .is_some_and(|t| t.contains_key(key))
        };
        if in_file {
            Origin::File
        } else {
            Origin::Default
        }
    }
}

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
        Config::load_explained(path).map(|(config, _)| config)
    }

    /// [`Config::load`], with where each key came from (`waltail config`).
    pub fn load_explained(path: Option<&Path>) -> Result<(Config, Sources)> {
        let vars: BTreeMap<String, String> = std::env::vars()
            .filter(|(k, _)| k.starts_with("WALTAIL_"))
            .collect();
        Config::load_sources(path, vars)
    }

    /// [`Config::load`] with the `WALTAIL_*` variables given.
    pub fn load_with(path: Option<&Path>, vars: &BTreeMap<String, String>) -> Result<Config> {
        Config::load_sources(path, vars.clone()).map(|(config, _)| config)
    }

    fn load_sources(
        path: Option<&Path>,
        vars: BTreeMap<String, String>,
    ) -> Result<(Config, Sources)> {
        let default = Path::new(DEFAULT_CONFIG_FILE);
        let file = match path {
            Some(p) => p,
            None if default.exists() => default,
            None => {
                let config = Config::from_parts(None, "the environment", &vars)?;
                return Ok((
                    config,
                    Sources {
                        file: None,
                        table: toml::Table::new(),
                        vars,
                    },
                ));
            }
        };
        let origin = file.display().to_string();
        let text = std::fs::read_to_string(file)
            .map_err(|e| Error::config(format!("cannot read the config file {origin}: {e}")))?;
        let table = parse_toml(&text, &origin)?;
        check_file_mode(file, &table)?;
        let config = Config::from_table(table.clone(), &origin, &vars)?;
        let file = Some(file.to_path_buf());
        Ok((config, Sources { file, table, vars }))
    }

    /// Builds a configuration from the file's text and the `WALTAIL_*` variables
    /// (no file permission check: there is no file).
    pub fn from_parts(
        text: Option<&str>,
        origin: &str,
        vars: &BTreeMap<String, String>,
    ) -> Result<Config> {
        let table = match text {
            Some(t) => parse_toml(t, origin)?,
            None => toml::Table::new(),
        };
        Config::from_table(table, origin, vars)
    }

    fn from_table(
        mut table: toml::Table,
        origin: &str,
        vars: &BTreeMap<String, String>,
    ) -> Result<Config> {
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

/// Parses the file. The error gives the line, column and reason but never
/// the line's text, which may hold a secret.
fn parse_toml(text: &str, origin: &str) -> Result<toml::Table> {
    text.parse().map_err(|e: toml::de::Error| {
        let at = e
            .span()
            .map(|span| {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
                format!(" at line {line}, column {column}")
            })
            .unwrap_or_default();
        Error::config(format!(
            "{origin}: not valid TOML{at}: {}",
            e.message().trim_end()
        ))
    })
}

/// The secret a config file holds, if any: `destination.secret_access_key`
/// or a password in `source.url`.
fn file_secret(table: &toml::Table) -> Option<&'static str> {
    let section = |name: &str| table.get(name).and_then(toml::Value::as_table);
    if section("destination").is_some_and(|d| d.contains_key("secret_access_key")) {
        return Some("destination.secret_access_key");
    }
    let url = section("source")
        .and_then(|s| s.get("url"))
        .and_then(toml::Value::as_str)?;
    url_has_password(url).then_some("a password in source.url")
}

/// Whether a connection string holds a password.
fn url_has_password(url: &str) -> bool {
    let parsed = crate::pgtls::extract(url)
        .ok()
        .and_then(|(pg_url, _)| tokio_postgres::Config::from_str(&pg_url).ok());
    match parsed {
        Some(pg) => pg.get_password().is_some(),
        // Unparseable: assume a password if redaction would hide anything.
        None => redact_url(url) != url,
    }
}

/// A config file holding a secret must be private to its owner.
#[cfg(unix)]
fn check_file_mode(file: &Path, table: &toml::Table) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let Some(secret) = file_secret(table) else {
        return Ok(());
    };
    let mode = std::fs::metadata(file)
        .map_err(|e| {
            Error::config(format!(
                "cannot read the config file {}: {e}",
                file.display()
            ))
        })?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        let env = if secret.starts_with("destination") {
            "WALTAIL_DESTINATION_SECRET_ACCESS_KEY"
        } else {
            "PGPASSWORD"
        };
        return Err(Error::config(format!(
            "the config file {f} holds {secret} but other users may read it (mode {:03o}): \
             run `chmod 600 {f}`, or move the secret out of the file into {env}",
            mode & 0o777,
            f = file.display()
        )));
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_file_mode(_file: &Path, _table: &toml::Table) -> Result<()> {
    Ok(())
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

/// The largest value each bounded key takes (the schema says the same).
const MAX_COUNT: i64 = 1_000_000;
const MAX_IN_FLIGHT: i64 = 256;
const MAX_ATTEMPTS: i64 = 1000;
const MAX_MS: i64 = 3_600_000;
const MAX_ROW_GROUP_ROWS: i64 = 100_000_000;
const MAX_COMPACT_BYTES: i64 = 1 << 40;

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
    let (pg_url, tls) = crate::pgtls::extract(&url)
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
        if tables.contains(&name) {
            continue;
        }
        // The archive's `table` field and schema records name a table
        // `schema.table`: two tables must not read the same.
        if let Some(other) = tables
            .iter()
            .find(|o: &&TableName| o.to_string() == name.to_string())
        {
            return Err(Error::config(format!(
                "source.tables: {} and {} would both be archived as \"{name}\"; archive them in separate pipelines",
                other.config_form(),
                name.config_form()
            )));
        }
        tables.push(name);
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
    if publication.is_empty()
        || publication.len() > MAX_IDENT_BYTES
        || publication.chars().any(char::is_control)
    {
        return Err(Error::config(format!(
            "source.publication = {publication:?}: use 1 to 63 bytes without control characters"
        )));
    }

    let compression = match raw
        .destination
        .as_ref()
        .and_then(|d| d.compression.as_deref())
    {
        None => Codec::None,
        Some(name) => Codec::from_name(name).ok_or_else(|| {
            Error::config(format!(
                "destination.compression = {name:?}: use {}",
                Codec::NAMES.join(", ")
            ))
        })?,
    };
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
            if !(0..=MAX_MS).contains(&linger_ms) {
                return Err(Error::config(format!(
                    "delivery.linger_ms = {linger_ms}: must be between 0 and 3600000"
                )));
            }
            DeliveryConfig {
                batch_size: positive(
                    "delivery.batch_size",
                    d.batch_size,
                    DEFAULT_BATCH_SIZE as i64,
                    MAX_COUNT,
                )? as usize,
                max_batch_bytes: positive(
                    "delivery.max_batch_bytes",
                    d.max_batch_bytes,
                    DEFAULT_MAX_BATCH_BYTES as i64,
                    MAX_MAX_BATCH_BYTES,
                )? as usize,
                linger: Duration::from_millis(linger_ms as u64),
                rate_limit: rate_limit as u32,
                max_in_flight: positive(
                    "delivery.max_in_flight",
                    d.max_in_flight,
                    DEFAULT_MAX_IN_FLIGHT as i64,
                    MAX_IN_FLIGHT,
                )? as usize,
                max_attempts: positive(
                    "delivery.max_attempts",
                    d.max_attempts,
                    DEFAULT_MAX_ATTEMPTS as i64,
                    MAX_ATTEMPTS,
                )? as u32,
                backoff,
                request_timeout: Duration::from_millis(positive(
                    "delivery.request_timeout_ms",
                    d.request_timeout_ms,
                    DEFAULT_REQUEST_TIMEOUT_MS as i64,
                    MAX_MS,
                )? as u64),
            }
        }
    };

    let telemetry = raw.telemetry.unwrap_or_default();
    let telemetry_listen = match telemetry.listen {
        None => None,
        Some(s) if s.is_empty() => None,
        Some(s) => Some(s.parse().map_err(|_| {
            Error::config(format!(
                "telemetry.listen = {s:?}: give an address and port, e.g. \"127.0.0.1:9187\""
            ))
        })?),
    };
    let slot_lag_warn_bytes = match telemetry.slot_lag_warn_bytes {
        None => DEFAULT_SLOT_LAG_WARN_BYTES,
        Some(n) if n >= 0 => n as u64,
        Some(n) => {
            return Err(Error::config(format!(
                "telemetry.slot_lag_warn_bytes = {n}: bytes of WAL, e.g. 1073741824 for 1 GiB; 0 turns the warning off"
            )));
        }
    };
    let backfill = raw.backfill.unwrap_or_default();
    let backfill = BackfillConfig {
        chunk_size: positive(
            "backfill.chunk_size",
            backfill.chunk_size,
            DEFAULT_BACKFILL_CHUNK_SIZE as i64,
            MAX_COUNT,
        )? as u64,
        batch_size: positive(
            "backfill.batch_size",
            backfill.batch_size,
            DEFAULT_BACKFILL_BATCH_SIZE as i64,
            MAX_COUNT,
        )? as usize,
        parallelism: positive(
            "backfill.parallelism",
            backfill.parallelism,
            default_backfill_parallelism() as i64,
            MAX_BACKFILL_PARALLELISM,
        )? as usize,
    };
    let compact = compact(raw.compact.unwrap_or_default())?;
    Ok(Config {
        compact,
        telemetry_listen,
        slot_lag_warn_bytes,
        backfill,
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
        compression,
        delivery,
    })
}

fn compact(c: RawCompact) -> Result<CompactConfig> {
    let compression = match c
        .compression
        .as_deref()
        .unwrap_or(DEFAULT_COMPACT_COMPRESSION)
    {
        "zstd" => Compression::Zstd,
        "snappy" => Compression::Snappy,
        "gzip" => Compression::Gzip,
        "none" => Compression::None,
        other => {
            return Err(Error::config(format!(
                "compact.compression = {other:?}: use zstd, snappy, gzip or none"
            )));
        }
    };
    // The levels each codec takes (parquet's ranges): a level out of range
    // or for a codec without levels is refused here, not at the first file.
    let compression_level = match (compression, c.compression_level) {
        (_, None) => None,
        (Compression::Zstd, Some(l @ 1..=22)) | (Compression::Gzip, Some(l @ 0..=9)) => {
            Some(l as u32)
        }
        (Compression::Zstd | Compression::Gzip, Some(l)) => {
            let (name, range) = match compression {
                Compression::Zstd => ("zstd", "1 (fastest) to 22 (smallest)"),
                _ => ("gzip", "0 (none) to 9 (smallest)"),
            };
            return Err(Error::config(format!(
                "compact.compression_level = {l}: {name} takes {range}"
            )));
        }
        (_, Some(l)) => {
            return Err(Error::config(format!(
                "compact.compression_level = {l}: only zstd and gzip have levels; remove the key or set compact.compression to zstd or gzip"
            )));
        }
    };
    let retain = match c.retain.as_deref() {
        None => DEFAULT_COMPACT_RETAIN,
        Some(s) => humantime::parse_duration(s).map_err(|e| {
            Error::config(format!(
                "compact.retain: {s:?} is not a duration ({e}); write e.g. \"7d\", \"36h\", \"0s\""
            ))
        })?,
    };
    Ok(CompactConfig {
        retain,
        vacuum: c.vacuum.unwrap_or(true),
        compression,
        compression_level,
        row_group_rows: positive(
            "compact.row_group_rows",
            c.row_group_rows,
            DEFAULT_COMPACT_ROW_GROUP_ROWS as i64,
            MAX_ROW_GROUP_ROWS,
        )? as usize,
        file_bytes: positive(
            "compact.file_bytes",
            c.file_bytes,
            DEFAULT_COMPACT_FILE_BYTES as i64,
            MAX_COMPACT_BYTES,
        )? as u64,
        merge_bytes: positive(
            "compact.merge_bytes",
            c.merge_bytes,
            DEFAULT_COMPACT_MERGE_BYTES as i64,
            MAX_COMPACT_BYTES,
        )? as u64,
    })
}

fn destination(d: RawDestination) -> Result<DestinationConfig> {
    let prefix = match d.prefix.as_deref().map(|p| p.trim_matches('/')) {
        None | Some("") => None,
        Some(p) => {
            if p.split('/')
                .any(|seg| seg.is_empty() || seg == "." || seg == "..")
                || p.chars().any(char::is_control)
            {
                return Err(Error::config(format!(
                    "destination.prefix = {p:?}: use path segments separated by single '/', without '.', '..' or control characters"
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
                ("profile", d.profile.is_some()),
                ("role_arn", d.role_arn.is_some()),
                ("external_id", d.external_id.is_some()),
                ("role_session_name", d.role_session_name.is_some()),
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
                    "destination.access_key_id and destination.secret_access_key go together: set both, or neither to use the AWS credential chain (AWS_* variables, a profile, an instance role)",
                ));
            }
            if d.profile.is_some() && d.access_key_id.is_some() {
                return Err(Error::config(
                    "destination.profile and destination.access_key_id both say where the credentials are: keep one",
                ));
            }
            let role = assume_role(d.role_arn, d.external_id, d.role_session_name)?;
            Ok(DestinationConfig::S3(S3Config {
                bucket,
                prefix,
                region: d.region,
                endpoint: d.endpoint,
                use_path_style: d.use_path_style.unwrap_or(false),
                access_key_id: d.access_key_id,
                secret_access_key: d.secret_access_key.map(SecretString::from),
                profile: d.profile,
                role,
            }))
        }
        other => Err(Error::config(format!(
            "destination.type = {other:?}: use \"s3\" or \"file\""
        ))),
    }
}

/// `destination.role_arn` with its options, checked as STS would check them,
/// so a typo stops at start rather than at the first upload.
fn assume_role(
    arn: Option<String>,
    external_id: Option<String>,
    session_name: Option<String>,
) -> Result<Option<AssumeRole>> {
    let Some(arn) = arn else {
        for (key, set) in [
            ("external_id", external_id.is_some()),
            ("role_session_name", session_name.is_some()),
        ] {
            if set {
                return Err(Error::config(format!(
                    "destination.{key} applies to an assumed role: set destination.role_arn too"
                )));
            }
        }
        return Ok(None);
    };
    if !(arn.starts_with("arn:") && arn.contains(":role/")) {
        return Err(Error::config(format!(
            "destination.role_arn = {arn:?}: give a role's ARN, e.g. \"arn:aws:iam::123456789012:role/archive-writer\""
        )));
    }
    if let Some(id) = &external_id
        && !(2..=1224).contains(&id.len())
    {
        return Err(Error::config(
            "destination.external_id: STS takes 2 to 1224 characters",
        ));
    }
    let session_name = session_name.unwrap_or_else(|| "waltail".to_string());
    let allowed = |c: char| c.is_ascii_alphanumeric() || "_+=,.@-".contains(c);
    if !(2..=64).contains(&session_name.len()) || !session_name.chars().all(allowed) {
        return Err(Error::config(format!(
            "destination.role_session_name = {session_name:?}: STS takes 2 to 64 of letters, digits and _+=,.@-"
        )));
    }
    Ok(Some(AssumeRole {
        arn,
        external_id,
        session_name,
    }))
}

/// The connection string with any password replaced by `***`, for messages.
///
/// URL form: the password from the user's `:` to the last `@` before the
/// query (so an unencoded `@`, `/`, `?` or `:` in it is hidden too), and any
/// `password=` query parameter. Key/value form: every `password=` value,
/// quoted (`'...'`, with `\'`) or plain.
pub fn redact_url(url: &str) -> String {
    if let Some(scheme_end) = url.find("://") {
        let (head, rest) = url.split_at(scheme_end + 3);
        // tokio-postgres reads the credentials up to the first '@' and the
        // password from the first ':' in them; a password with an unencoded
        // '@' runs on to the last '@' before the query.
        let (main, query) = match rest.find('@') {
            Some(first_at) => {
                let query_at = rest[first_at..]
                    .find('?')
                    .map_or(rest.len(), |q| first_at + q);
                let last_at = rest[..query_at].rfind('@').unwrap_or(first_at);
                let main = match rest[..first_at].find(':') {
                    Some(colon) => format!("{}:***{}", &rest[..colon], &rest[last_at..query_at]),
                    None => rest[..query_at].to_string(),
                };
                (main, &rest[query_at..])
            }
            None => match rest.find('?') {
                Some(q) => (rest[..q].to_string(), &rest[q..]),
                None => (rest.to_string(), ""),
            },
        };
        let query = if query.is_empty() {
            String::new()
        } else {
            let params: Vec<String> = query[1..]
                .split('&')
                .map(|kv| match kv.split_once('=') {
                    Some((k, _)) if k.trim().eq_ignore_ascii_case("password") => {
                        format!("{k}=***")
                    }
                    _ => kv.to_string(),
                })
                .collect();
            format!("?{}", params.join("&"))
        };
        return format!("{head}{main}{query}");
    }
    redact_key_values(url)
}

/// `password=value` (spaces around `=` allowed, value plain or `'quoted'`)
/// with the value replaced.
fn redact_key_values(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find("password") {
        let before_ok = pos == 0 || rest[..pos].ends_with(char::is_whitespace);
        let after = &rest[pos + "password".len()..];
        let after_ws = after.trim_start();
        if !(before_ok && after_ws.starts_with('=')) {
            out.push_str(&rest[..pos + "password".len()]);
            rest = after;
            continue;
        }
        out.push_str(&rest[..pos]);
        out.push_str("password=***");
        let value = after_ws[1..].trim_start();
        let end = if let Some(quoted) = value.strip_prefix('\'') {
            let mut escaped = false;
            let mut end = value.len();
            for (i, c) in quoted.char_indices() {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '\'' {
                    end = i + 2;
                    break;
                }
            }
            end
        } else {
            value.find(char::is_whitespace).unwrap_or(value.len())
        };
        rest = &value[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The schema names every key the environment can set, and no other:
    /// both come from the configuration, and drift would mislead editors.
    #[test]
    fn the_schema_has_every_key_and_no_other() {
        let schema: serde_json::Value = serde_json::from_str(&schema()).unwrap();
        fn first_ref(v: &serde_json::Value) -> Option<&str> {
            match v {
                serde_json::Value::Object(m) => m
                    .get("$ref")
                    .and_then(|r| r.as_str())
                    .or_else(|| m.values().find_map(first_ref)),
                serde_json::Value::Array(a) => a.iter().find_map(first_ref),
                _ => None,
            }
        }
        let mut keys = std::collections::BTreeSet::new();
        for (name, prop) in schema["properties"].as_object().unwrap() {
            match first_ref(prop) {
                Some(r) => {
                    let def = r.trim_start_matches("#/$defs/");
                    for key in schema["$defs"][def]["properties"]
                        .as_object()
                        .unwrap()
                        .keys()
                    {
                        keys.insert((name.clone(), key.clone()));
                    }
                }
                None => _ = keys.insert((String::new(), name.clone())),
            }
        }
        let expected: std::collections::BTreeSet<(String, String)> = KEYS
            .iter()
            .map(|(s, k, _)| (s.to_string(), k.to_string()))
            .collect();
        assert_eq!(keys, expected);
        assert_eq!(schema["additionalProperties"], false);
    }

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
    fn a_role_and_a_profile_are_checked_at_load() {
        let s3 = |extra: &str| {
            load(
                &format!("{MINIMAL}\n[destination]\nbucket = \"b\"\n{extra}\n"),
                &[],
            )
        };
        let err = |extra: &str| s3(extra).unwrap_err().to_string();
        let role = |c: Config| match c.destination {
            DestinationConfig::S3(s3) => s3.role,
            DestinationConfig::File { .. } => unreachable!(),
        };
        assert!(role(s3("").unwrap()).is_none());
        let r = role(s3("role_arn = \"arn:aws:iam::123456789012:role/w\"").unwrap()).unwrap();
        assert_eq!(r.session_name, "waltail");
        assert_eq!(r.external_id, None);
        let r = role(
            load(
                &format!("{MINIMAL}\n[destination]\nbucket = \"b\"\n"),
                &[
                    (
                        "WALTAIL_DESTINATION_ROLE_ARN",
                        "arn:aws-cn:iam::1:role/path/w",
                    ),
                    ("WALTAIL_DESTINATION_EXTERNAL_ID", "ext-1"),
                    ("WALTAIL_DESTINATION_ROLE_SESSION_NAME", "nightly@host"),
                ],
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (
                r.arn.as_str(),
                r.external_id.as_deref(),
                r.session_name.as_str()
            ),
            (
                "arn:aws-cn:iam::1:role/path/w",
                Some("ext-1"),
                "nightly@host"
            )
        );
        assert!(err("role_arn = \"archive-writer\"").contains("give a role's ARN"));
        assert!(err("external_id = \"x1\"").contains("set destination.role_arn too"));
        assert!(err("role_session_name = \"s1\"").contains("set destination.role_arn too"));
        let arn = "role_arn = \"arn:aws:iam::1:role/w\"";
        assert!(err(&format!("{arn}\nrole_session_name = \"a b\"")).contains("2 to 64"));
        assert!(err(&format!("{arn}\nexternal_id = \"x\"")).contains("2 to 1224"));
        assert!(
            err("profile = \"p\"\naccess_key_id = \"k\"\nsecret_access_key = \"s\"")
                .contains("keep one")
        );
        let file = load(
            &format!("{MINIMAL}\n[destination]\ntype = \"file\"\nprofile = \"p\"\n"),
            &[],
        );
        assert!(file.unwrap_err().to_string().contains("type = \"s3\" only"));
    }

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
    fn slot_lag_warning_defaults_to_a_gib_and_can_be_set_or_turned_off() {
        assert_eq!(load(MINIMAL, &[]).unwrap().slot_lag_warn_bytes, 1 << 30);
        let c = load(
            &format!("{MINIMAL}\n[telemetry]\nslot_lag_warn_bytes = 0\n"),
            &[],
        )
        .unwrap();
        assert_eq!(c.slot_lag_warn_bytes, 0);
        let c = load(
            MINIMAL,
            &[("WALTAIL_TELEMETRY_SLOT_LAG_WARN_BYTES", "65536")],
        )
        .unwrap();
        assert_eq!(c.slot_lag_warn_bytes, 65536);
        let err = load(MINIMAL, &[("WALTAIL_TELEMETRY_SLOT_LAG_WARN_BYTES", "-1")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("telemetry.slot_lag_warn_bytes"), "{err}");
    }

    #[test]
    fn compression_levels_are_checked_against_their_codec() {
        let level = |text: &str, vars: &[(&str, &str)]| {
            load(&format!("{MINIMAL}\n[compact]\n{text}\n"), vars)
                .map(|c| c.compact.compression_level)
                .map_err(|e| e.to_string())
        };
        assert_eq!(level("", &[]), Ok(None));
        assert_eq!(level("compression_level = 1", &[]), Ok(Some(1)));
        assert_eq!(level("compression_level = 22", &[]), Ok(Some(22)));
        assert_eq!(
            level("", &[("WALTAIL_COMPACT_COMPRESSION_LEVEL", "9")]),
            Ok(Some(9))
        );
        assert_eq!(
            level("compression = \"gzip\"\ncompression_level = 0", &[]),
            Ok(Some(0))
        );
        let err = level("compression_level = 23", &[]).unwrap_err();
        assert!(err.contains("zstd takes 1 (fastest) to 22"), "{err}");
        let err = level("compression = \"gzip\"\ncompression_level = 10", &[]).unwrap_err();
        assert!(err.contains("gzip takes 0 (none) to 9"), "{err}");
        let err = level("compression = \"snappy\"\ncompression_level = 3", &[]).unwrap_err();
        assert!(err.contains("only zstd and gzip have levels"), "{err}");
    }

    #[test]
    fn max_batch_bytes_defaults_to_8_mib_and_is_bounded() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.delivery.max_batch_bytes, 8 * 1024 * 1024);
        let c = load(
            &format!("{MINIMAL}\n[delivery]\nmax_batch_bytes = 65536\n"),
            &[],
        )
        .unwrap();
        assert_eq!(c.delivery.max_batch_bytes, 65536);
        let c = load(MINIMAL, &[("WALTAIL_DELIVERY_MAX_BATCH_BYTES", "1048576")]).unwrap();
        assert_eq!(c.delivery.max_batch_bytes, 1 << 20);
        for bad in ["0", "268435457"] {
            let err = load(MINIMAL, &[("WALTAIL_DELIVERY_MAX_BATCH_BYTES", bad)])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("delivery.max_batch_bytes = {bad}"))
                    && err.contains("between 1 and 268435456"),
                "{err}"
            );
        }
    }

    #[test]
    fn backfill_sizes_default_and_can_be_set() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(
            c.backfill,
            BackfillConfig {
                chunk_size: 5000,
                batch_size: 1000,
                parallelism: default_backfill_parallelism(),
            }
        );
        let c = load(
            &format!("{MINIMAL}\n[backfill]\nchunk_size = 20000\n"),
            &[("WALTAIL_BACKFILL_BATCH_SIZE", "250")],
        )
        .unwrap();
        assert_eq!((c.backfill.chunk_size, c.backfill.batch_size), (20000, 250));
        let err = load(MINIMAL, &[("WALTAIL_BACKFILL_CHUNK_SIZE", "0")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("backfill.chunk_size = 0"), "{err}");
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
        use crate::pgtls::SslMode;
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

    #[test]
    fn redact_url_hides_awkward_passwords() {
        for (url, secret) in [
            ("postgres://u:p@ss@h/db", "ss@h"),
            ("postgres://u:p/ss:w@h:5/db", "ss:w"),
            (
                "postgres://u@h/db?sslmode=disable&password=qwerty",
                "qwerty",
            ),
            ("postgresql://u:%40pw@h/db", "%40pw"),
            ("host=h password='a b\\' c' user=u", "b\\' c"),
            ("host=h password = spaced user=u", "spaced"),
            ("password=first host=h", "first"),
        ] {
            let r = redact_url(url);
            assert!(!r.contains(secret), "{url} -> {r}");
            assert!(r.contains("***"), "{url} -> {r}");
        }
        assert_eq!(
            redact_url("host=h user=password dbname=d"),
            "host=h user=password dbname=d"
        );
    }

    #[test]
    fn config_errors_never_show_secrets() {
        // A TOML syntax error on the secret's own line.
        let err = load(
            "[destination]\nsecret_access_key = \"s3cr3t-value\" junk\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 2"), "{err}");
        assert!(!err.contains("s3cr3t-value"), "{err}");
        for url in [
            "postgres://u:hunter2@h:notaport/db",
            "postgres://u:hunter2@h/db?sslmode=bogus",
            "postgres://u:hunter2@h/db?sslmode=verify-full&sslrootcert=/nonexistent",
            "postgres://u:hunter2@h/db?colour=blue",
            "postgres://u:hunter2@h",
            "host=h password=hunter2 port=x dbname=d",
            "host=h password='hunter2 dbname=d",
        ] {
            let err = load(MINIMAL, &[("WALTAIL_SOURCE_URL", url)])
                .unwrap_err()
                .to_string();
            assert!(!err.contains("hunter2"), "{url}: {err}");
        }
    }

    #[test]
    fn table_names_plain_and_quoted() {
        let t = |s: &str| s.parse::<TableName>().map(|t| (t.schema, t.name));
        let ok = |s: &str, schema: &str, name: &str| {
            assert_eq!(t(s), Ok((schema.to_string(), name.to_string())), "{s}")
        };
        ok("public.orders", "public", "orders");
        ok("orders", "public", "orders");
        ok("Sales.Orders", "Sales", "Orders");
        ok(" public . orders ", "public", "orders");
        ok("public.Mixed Case", "public", "Mixed Case");
        ok("public.semi;colon", "public", "semi;colon");
        ok("public.ünï", "public", "ünï");
        ok("\"My Schema\".\"My.Table\"", "My Schema", "My.Table");
        ok("public.\"quo\"\"te\"", "public", "quo\"te");
        ok("\"a.b\"", "public", "a.b");
        ok("\" padded \".t", " padded ", "t");
        ok(&format!("s.{}", "x".repeat(63)), "s", &"x".repeat(63));
        for bad in [
            "",
            ".orders",
            "public.",
            "a.b.c",
            "public.quo\"te",
            "public.\"open",
            "public.\"x\"y",
            "\"\".t",
            "public.tab\u{0}le",
            "public.new\nline",
            &format!("s.{}", "x".repeat(64)),
        ] {
            let err = t(bad).unwrap_err();
            assert!(err.contains("schema.table"), "{bad:?}: {err}");
        }
        let err = t("a.b.c").unwrap_err();
        assert!(err.contains("quote"), "{err}");
    }

    #[test]
    fn config_form_reads_back() {
        for (schema, name, form) in [
            ("public", "orders", "public.orders"),
            ("My Schema", "My.Table", "My Schema.\"My.Table\""),
            ("public", "quo\"te", "public.\"quo\"\"te\""),
            (" s", "t", "\" s\".t"),
        ] {
            let t = TableName {
                schema: schema.into(),
                name: name.into(),
            };
            assert_eq!(t.config_form(), form);
            assert_eq!(form.parse::<TableName>().unwrap(), t);
            assert_eq!(t.quoted().parse::<TableName>().unwrap(), t);
        }
    }

    #[test]
    fn tables_that_would_read_the_same_are_refused() {
        let err = load(
            "[source]\nurl = \"postgres://u@h/db\"\ntables = ['\"a.b\".c', 'a.\"b.c\"']\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("both be archived as \"a.b.c\""), "{err}");
    }

    #[cfg(unix)]
    fn file_with_mode(text: &str, mode: u32) -> (tempfile::TempDir, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("waltail.toml");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        (dir, path)
    }

    #[cfg(unix)]
    #[test]
    fn a_readable_file_with_a_secret_is_refused() {
        let vars = BTreeMap::new();
        let s3_secret = format!(
            "{MINIMAL}\n[destination]\nbucket = \"b\"\naccess_key_id = \"k\"\nsecret_access_key = \"s\"\n"
        );
        let pg_password = "[source]\nurl = \"postgres://u:pw@h/db\"\ntables = [\"t\"]\n";
        let kv_password = "[source]\nurl = \"host=h password=pw dbname=db\"\ntables = [\"t\"]\n";
        for text in [s3_secret.as_str(), pg_password, kv_password] {
            for mode in [0o644, 0o640, 0o604, 0o660, 0o611] {
                let (_dir, path) = file_with_mode(text, mode);
                let err = Config::load_with(Some(&path), &vars)
                    .unwrap_err()
                    .to_string();
                let fix = format!("chmod 600 {}", path.display());
                assert!(err.contains(&fix), "{err}");
                assert!(!err.contains("pw@") && !err.contains("=pw"), "{err}");
            }
            for mode in [0o600, 0o400, 0o700] {
                let (_dir, path) = file_with_mode(text, mode);
                Config::load_with(Some(&path), &vars).unwrap();
            }
        }
        // Without a secret a file may be world-readable.
        for text in [
            MINIMAL,
            "[source]\nurl = \"postgres://u@h/db\"\ntables = [\"t\"]\n[destination]\nbucket = \"b\"\n",
        ] {
            let (_dir, path) = file_with_mode(text, 0o644);
            Config::load_with(Some(&path), &vars).unwrap();
        }
        // A secret given in the environment does not make the file secret.
        let (_dir, path) = file_with_mode(MINIMAL, 0o644);
        let vars: BTreeMap<String, String> = [(
            "WALTAIL_SOURCE_URL".to_string(),
            "postgres://u:pw@h/db".to_string(),
        )]
        .into();
        Config::load_with(Some(&path), &vars).unwrap();
    }

    /// Arbitrary files and environment values give Ok or Err, never a panic.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn env_name_strategy() -> impl Strategy<Value = String> {
            let mut names: Vec<String> = KEYS.iter().map(|(s, k, _)| env_name(s, k)).collect();
            names.extend(["WALTAIL_LOG".into(), "WALTAIL_NOPE".into()]);
            proptest::sample::select(names)
        }

        /// TOML-ish text: fragments of real config mixed with noise.
        fn toml_like() -> impl Strategy<Value = String> {
            let fragment = prop_oneof![
                Just("[source]\n".to_string()),
                Just("[destination]\n".to_string()),
                Just("[delivery]\n".to_string()),
                Just("url = \"postgres://u:p@h/db\"\n".to_string()),
                Just("tables = [\"t\"]\n".to_string()),
                Just("bucket = \"b\"\n".to_string()),
                Just("batch_size = 99999999999999999999\n".to_string()),
                Just("backoff = []\n".to_string()),
                "[a-z_]{1,12} = [^\n]{0,20}\n",
                "tables = \\[\"[^\"]{0,20}\"\\]\n",
                "url = \"[^\"]{0,40}\"\n",
                "prefix = \"[^\"]{0,20}\"\n",
                any::<String>(),
            ];
            proptest::collection::vec(fragment, 0..8).prop_map(|v| v.concat())
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            #[test]
            fn any_file_text_is_ok_or_err(text in any::<String>()) {
                let _ = Config::from_parts(Some(&text), "fuzz.toml", &BTreeMap::new());
            }

            #[test]
            fn config_like_text_and_env_are_ok_or_err(
                text in toml_like(),
                vars in proptest::collection::btree_map(env_name_strategy(), any::<String>(), 0..6),
            ) {
                let _ = Config::from_parts(Some(&text), "fuzz.toml", &vars);
                let _ = Config::from_parts(None, "the environment", &vars);
            }

            #[test]
            fn env_values_on_a_valid_file_are_ok_or_err(
                name in env_name_strategy(),
                value in any::<String>(),
            ) {
                let vars = [(name, value)].into();
                let _ = Config::from_parts(Some(MINIMAL), "fuzz.toml", &vars);
            }

            #[test]
            fn redact_url_hides_any_url_password(
                user in "[a-z]{1,8}",
                password in "[^\\s@]{1,16}",
                rest in "[a-z0-9.:/?=&]{0,20}",
            ) {
                let url = format!("postgres://{user}:{password}@{rest}");
                let r = redact_url(&url);
                prop_assert!(!r.contains(&format!(":{password}@")), "{} -> {}", url, r);
            }

            #[test]
            fn table_entries_are_ok_or_err(s in any::<String>()) {
                let _ = s.parse::<TableName>();
            }

            #[test]
            fn quoted_names_read_back(
                schema in "[^\\x00-\\x1f\\x7f]{1,20}",
                name in "[^\\x00-\\x1f\\x7f]{1,20}",
            ) {
                prop_assume!(schema.len() <= 63 && name.len() <= 63);
                prop_assume!(!schema.chars().chain(name.chars()).any(char::is_control));
                let t = TableName { schema, name };
                prop_assert_eq!(t.quoted().parse::<TableName>(), Ok(t.clone()));
                prop_assert_eq!(t.config_form().parse::<TableName>(), Ok(t));
            }
        }
    }
}
