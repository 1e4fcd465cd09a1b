//! The configuration as written, before validation: the file's sections
//! as serde reads them (`deny_unknown_fields`, so an unknown key is an
//! error that names it), the `WALTAIL_<SECTION>_<KEY>` overrides merged
//! into the file's table, and the JSON Schema of the file. Kept apart from
//! the typed values (the parent module) and their validation
//! ([`super::validate`]), as ripgrep keeps its raw flags apart from the
//! validated ones: these types say what a user may write, those what the
//! program runs with.

use std::collections::BTreeMap;
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::Deserialize;

use super::{MAX_BACKFILL_PARALLELISM, MAX_MAX_BATCH_BYTES};
use crate::{Error, Result};

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
pub(super) struct RawConfig {
    /// Name used in object keys and the default slot and publication names:
    /// a-z, 0-9, _ and -, up to 63. Default "waltail".
    pub(super) pipeline: Option<String>,
    /// Folder of the local crash-safe state (<pipeline>.sqlite). Default
    /// "./waltail-state".
    pub(super) state_dir: Option<PathBuf>,
    /// The PostgreSQL database to archive.
    pub(super) source: Option<RawSource>,
    /// Where the archive goes. Without it: the folder ./waltail-archive.
    pub(super) destination: Option<RawDestination>,
    /// How changes become objects and how uploads are retried.
    pub(super) delivery: Option<RawDelivery>,
    /// The console, /metrics, /healthz and /readyz.
    pub(super) telemetry: Option<RawTelemetry>,
    /// How `waltail backfill` reads existing rows.
    pub(super) backfill: Option<RawBackfill>,
    /// How `waltail compact` writes Delta tables.
    pub(super) compact: Option<RawCompact>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Backfill")]
pub(super) struct RawBackfill {
    /// Rows read per chunk, one short snapshot each. Default 20000.
    #[schemars(range(min = 1, max = MAX_COUNT))]
    pub(super) chunk_size: Option<i64>,
    /// `read` events per object while a batch holds only those. Default 1000.
    #[schemars(range(min = 1, max = MAX_COUNT))]
    pub(super) batch_size: Option<i64>,
    /// Key ranges of a table read at once, each on its own connection with
    /// its own snapshots. Default: the number of cores.
    #[schemars(range(min = 1, max = MAX_BACKFILL_PARALLELISM))]
    pub(super) parallelism: Option<i64>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Compact")]
pub(super) struct RawCompact {
    /// Parquet codec. Default "zstd".
    #[schemars(extend("enum" = ["zstd", "snappy", "gzip", "none"]))]
    pub(super) compression: Option<String>,
    /// The codec's level: zstd 1 (fastest) to 22 (smallest), gzip 0 to 9.
    /// Default: zstd 3, gzip 6.
    #[schemars(range(min = 0, max = 22))]
    pub(super) compression_level: Option<i64>,
    /// Rows per Parquet row group. Default 131072.
    #[schemars(range(min = 1, max = MAX_ROW_GROUP_ROWS))]
    pub(super) row_group_rows: Option<i64>,
    /// NDJSON bytes per history file, and Parquet bytes per latest-view
    /// file, at most. Default 268435456 (256 MiB).
    #[schemars(range(min = 1, max = MAX_COMPACT_BYTES))]
    pub(super) file_bytes: Option<i64>,
    /// Memory for combining changes by key and for one bucket of a latest
    /// view being merged. Default 134217728 (128 MiB).
    #[schemars(range(min = 1, max = MAX_COMPACT_BYTES))]
    pub(super) merge_bytes: Option<i64>,
    /// How long files a commit replaced stay, so time travel reaches that
    /// far back: a duration such as "7d", "36h", "0s". Default "7d".
    pub(super) retain: Option<String>,
    /// Whether a run ends by deleting replaced files past `retain`.
    /// Default true.
    pub(super) vacuum: Option<bool>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Telemetry")]
pub(super) struct RawTelemetry {
    /// Address of the console, /metrics, /healthz and /readyz, e.g.
    /// "127.0.0.1:9187" (port 0: any free port). Default: off.
    pub(super) listen: Option<String>,
    /// Slot lag in bytes over which `run` warns and `status` flags it; 0
    /// turns it off. Default 1073741824 (1 GiB).
    #[schemars(range(min = 0))]
    pub(super) slot_lag_warn_bytes: Option<i64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Source")]
pub(super) struct RawSource {
    /// postgres://user[:password]@host:port/db (or key=value form), with
    /// sslmode and sslrootcert for TLS. Required.
    pub(super) url: Option<String>,
    /// Tables to archive as schema.table (`orders` is public.orders);
    /// quote a part SQL-style when it holds a dot or a quote. Required.
    pub(super) tables: Option<Vec<String>>,
    /// Publication, created if missing. Default waltail_<pipeline>.
    pub(super) publication: Option<String>,
    /// Logical replication slot, created if missing. Default
    /// waltail_<pipeline>.
    pub(super) slot: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Destination")]
pub(super) struct RawDestination {
    /// "file" (a folder) or "s3". Default "file", or "s3" when a bucket
    /// is set.
    #[serde(rename = "type")]
    #[schemars(extend("enum" = ["file", "s3"]))]
    pub(super) kind: Option<String>,
    /// The bucket, for type = "s3".
    pub(super) bucket: Option<String>,
    /// Key prefix, e.g. "waltail/prod"; the dated path follows it.
    pub(super) prefix: Option<String>,
    /// AWS region. Default AWS_REGION or AWS_DEFAULT_REGION, else
    /// us-east-1.
    pub(super) region: Option<String>,
    /// A custom endpoint URL: MinIO, R2, SeaweedFS, a VPC endpoint.
    pub(super) endpoint: Option<String>,
    /// Path-style addressing (MinIO and most compatible stores). Default
    /// false.
    pub(super) use_path_style: Option<bool>,
    /// Static credentials, with secret_access_key; without both, the AWS
    /// credential chain: the AWS_* variables, the shared files' profile,
    /// web identity, then container or instance credentials.
    pub(super) access_key_id: Option<String>,
    /// Never printed. A file holding it must be private (chmod 600).
    pub(super) secret_access_key: Option<String>,
    /// A profile of the shared AWS files (~/.aws/config and
    /// ~/.aws/credentials, or AWS_CONFIG_FILE and
    /// AWS_SHARED_CREDENTIALS_FILE); set, it is the only source, as the
    /// CLI's --profile. Default: the chain, with AWS_PROFILE, else "default".
    pub(super) profile: Option<String>,
    /// An IAM role to assume through STS, e.g.
    /// "arn:aws:iam::123456789012:role/archive-writer", with the
    /// credentials found otherwise; refreshed before they expire.
    pub(super) role_arn: Option<String>,
    /// The external id the role's trust policy asks for, if any.
    pub(super) external_id: Option<String>,
    /// The role session's name, seen in CloudTrail. Default "waltail".
    pub(super) role_session_name: Option<String>,
    /// The folder, for type = "file". Default "./waltail-archive".
    pub(super) path: Option<PathBuf>,
    /// How objects are encoded: "none" (.ndjson), "gzip" (.ndjson.gz) or
    /// "zstd" (.ndjson.zst). Default "none".
    #[schemars(extend("enum" = ["none", "gzip", "zstd"]))]
    pub(super) compression: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Delivery")]
pub(super) struct RawDelivery {
    /// Changes per object. Default 100.
    #[schemars(range(min = 1, max = MAX_COUNT))]
    pub(super) batch_size: Option<i64>,
    /// An object's size cap in bytes, 1 to 268435456. Default 8388608
    /// (8 MiB).
    #[schemars(range(min = 1, max = MAX_MAX_BATCH_BYTES))]
    pub(super) max_batch_bytes: Option<i64>,
    /// A partial batch leaves after this many milliseconds (0 to 3600000).
    /// Default 200.
    #[schemars(range(min = 0, max = MAX_MS))]
    pub(super) linger_ms: Option<i64>,
    /// Changes per second at most; 0 is unlimited. Default 0.
    #[schemars(range(min = 0, max = 4_294_967_295_i64))]
    pub(super) rate_limit: Option<i64>,
    /// Batches uploading at once. Default 4.
    #[schemars(range(min = 1, max = MAX_IN_FLIGHT))]
    pub(super) max_in_flight: Option<i64>,
    /// Attempts per batch before it is parked. Default 5.
    #[schemars(range(min = 1, max = MAX_ATTEMPTS))]
    pub(super) max_attempts: Option<i64>,
    /// Waits between attempts as durations, the last repeating. Default
    /// ["30s", "1m", "2m", "4m"].
    #[schemars(length(min = 1))]
    pub(super) backoff: Option<Vec<String>>,
    /// A PUT not answered in this many milliseconds is a failed attempt.
    /// Default 30000.
    #[schemars(range(min = 1, max = MAX_MS))]
    pub(super) request_timeout_ms: Option<i64>,
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

/// The largest value each bounded key takes (the schema says the same).
pub(super) const MAX_COUNT: i64 = 1_000_000;
pub(super) const MAX_IN_FLIGHT: i64 = 256;
pub(super) const MAX_ATTEMPTS: i64 = 1000;
pub(super) const MAX_MS: i64 = 3_600_000;
pub(super) const MAX_ROW_GROUP_ROWS: i64 = 100_000_000;
pub(super) const MAX_COMPACT_BYTES: i64 = 1 << 40;

/// `WALTAIL_*` variables that are not configuration keys.
pub(super) const NON_CONFIG_VARS: &[&str] = &["WALTAIL_LOG", "WALTAIL_CONFIG"];

pub(super) fn env_name(section: &str, key: &str) -> String {
    if section.is_empty() {
        format!("WALTAIL_{}", key.to_uppercase())
    } else {
        format!("WALTAIL_{}_{}", section.to_uppercase(), key.to_uppercase())
    }
}

/// Parses the file. The error gives the line, column and reason but never
/// the line's text, which may hold a secret.
pub(super) fn parse_toml(text: &str, origin: &str) -> Result<toml::Table> {
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

/// Sets each `WALTAIL_<SECTION>_<KEY>` variable's value into the file's
/// table, typed as [`KEYS`] says, before the table is deserialized.
pub(super) fn apply_env(table: &mut toml::Table, vars: &BTreeMap<String, String>) -> Result<()> {
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
