//! Configuration: a TOML file plus `WALTAIL_<SECTION>_<KEY>` environment
//! overrides, validated into typed values before anything is built.
//!
//! The key names are the user's interface (DESIGN.md, "Configuration") and
//! the S3 fields are the product page's own names. Unknown keys are errors
//! that name the key; bad values are errors that name the key and say what is
//! allowed. Secrets live in [`SecretString`] so Debug output never shows them.
//!
//! Loading goes file + environment ([`raw`]: as written, and the JSON
//! Schema) --> [`validate`] --> the typed values here; [`table_name`] parses
//! `source.tables` entries, [`secrets`] guards the file's mode and redacts
//! connection strings, [`effective`] tells each key's value and origin.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

pub(crate) mod effective;
mod raw;
mod secrets;
mod table_name;
mod validate;

pub use self::raw::schema;
use self::raw::{KEYS, RawConfig, apply_env, env_name, parse_toml};
use self::secrets::check_file_mode;
pub use self::secrets::redact_url;
pub use self::table_name::TableName;
use self::validate::validate;
use crate::archive::codec::Codec;
use crate::pgtls::TlsSettings;
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
/// in which changed rows are left to their change. Each chunk also costs
/// two watermarks, a wait for the transactions in progress and a synced
/// file, about 10 ms in all on a small machine: at 20,000 rows that is a
/// fifth of the chunk's time, at 5,000 more than half (docs/performance.md).
pub const DEFAULT_BACKFILL_CHUNK_SIZE: u64 = 20_000;
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
/// Where the local state goes when `state_dir` is not set: beside the
/// archive folder, so the demo keeps everything in one place.
pub const DEFAULT_STATE_DIR: &str = "./waltail-state";
/// The pipeline name when none is set (object keys, slot and publication).
pub const DEFAULT_PIPELINE: &str = "waltail";
/// The file read when no `--config` is given, if it exists.
pub const DEFAULT_CONFIG_FILE: &str = "waltail.toml";

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// `pipeline`: the name in object keys and the default slot and
    /// publication names.
    pub pipeline: String,
    /// `state_dir`: the folder of the local state (`<pipeline>.sqlite`) and
    /// the lock file.
    pub state_dir: PathBuf,
    /// The `[source]` section: the database to archive.
    pub source: SourceConfig,
    /// The `[destination]` section: where objects go.
    pub destination: DestinationConfig,
    /// `destination.compression`: how archive objects are encoded.
    pub compression: Codec,
    /// The `[delivery]` section: batching and retries.
    pub delivery: DeliveryConfig,
    /// Where the console, `/metrics`, `/healthz` and `/readyz` are served;
    /// off when `None`.
    pub telemetry_listen: Option<std::net::SocketAddr>,
    /// `telemetry.slot_lag_warn_bytes`: slot lag that makes `run` warn and
    /// `status` and the console flag it; 0 = never.
    pub slot_lag_warn_bytes: u64,
    /// The `[backfill]` section.
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
    /// `compact.row_group_rows`: rows per Parquet row group.
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
    /// The default: the best ratio for its speed.
    Zstd,
    /// Fast, larger files; what some older readers expect.
    Snappy,
    /// Read everywhere, slow to write.
    Gzip,
    /// Uncompressed.
    None,
}

/// `[source]`: the database, the tables, and the publication and slot
/// names.
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
    /// `source.tables`: the tables archived (the publication holds them).
    pub tables: Vec<TableName>,
    /// `source.publication`: default `waltail_<pipeline>` (its `-` as `_`).
    pub publication: String,
    /// `source.slot`: the replication slot; default as the publication.
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

/// `[destination]`: where the archive is.
#[derive(Debug, Clone)]
pub enum DestinationConfig {
    /// `type = "file"`: a local folder (the default, `./waltail-archive`).
    File {
        /// `destination.path`: the folder.
        path: PathBuf,
        /// `destination.prefix`: keys start with it inside the folder.
        prefix: Option<String>,
    },
    /// `type = "s3"`: a bucket of S3 or an S3-compatible store.
    S3(S3Config),
}

impl DestinationConfig {
    /// The key prefix every object and table is under, if any.
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

/// `type = "s3"`: the bucket and how to reach and sign for it (the
/// product page's names).
#[derive(Debug, Clone)]
pub struct S3Config {
    /// `destination.bucket`.
    pub bucket: String,
    /// `destination.prefix`: keys start with it.
    pub prefix: Option<String>,
    /// `destination.region`; `None`: from the AWS environment, else us-east-1.
    pub region: Option<String>,
    /// `destination.endpoint`: an S3-compatible store's URL (MinIO,
    /// SeaweedFS, R2...); `None` is AWS.
    pub endpoint: Option<String>,
    /// `destination.use_path_style`: `host/bucket/key` rather than
    /// `bucket.host/key`, which most self-hosted stores need.
    pub use_path_style: bool,
    /// `destination.access_key_id`; `None`: the AWS credential chain.
    pub access_key_id: Option<String>,
    /// `destination.secret_access_key`, kept secret in Debug output.
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
    /// `destination.role_arn`.
    pub arn: String,
    /// `destination.external_id`, when the role's trust policy asks for one.
    pub external_id: Option<String>,
    /// Default "waltail".
    pub session_name: String,
}

/// `[delivery]`: how changes become objects and how uploads are retried.
#[derive(Debug, Clone)]
pub struct DeliveryConfig {
    /// `delivery.batch_size`: changes per object at most.
    pub batch_size: usize,
    /// `delivery.max_batch_bytes`: an object's size cap in bytes.
    pub max_batch_bytes: usize,
    /// `delivery.linger_ms`: how long a partial batch waits for more
    /// changes before it is written.
    pub linger: Duration,
    /// Changes per second; 0 means unlimited.
    pub rate_limit: u32,
    /// `delivery.max_in_flight`: uploads at once.
    pub max_in_flight: usize,
    /// `delivery.max_attempts`: tries of one PUT before its batch is parked.
    pub max_attempts: u32,
    /// `delivery.backoff`: the waits between tries; the last one repeats.
    pub backoff: Vec<Duration>,
    /// `delivery.request_timeout_ms`: a PUT not answered in this long is a
    /// failed try.
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

/// What a configuration was read from: the file (if any), as parsed, and
/// the `WALTAIL_*` variables. `waltail config` tells each key's origin
/// from it.
#[derive(Debug, Clone)]
pub struct Sources {
    /// The config file read, if any.
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
                chunk_size: 20_000,
                batch_size: 1000,
                parallelism: default_backfill_parallelism(),
            }
        );
        let c = load(
            &format!("{MINIMAL}\n[backfill]\nchunk_size = 5000\n"),
            &[("WALTAIL_BACKFILL_BATCH_SIZE", "250")],
        )
        .unwrap();
        assert_eq!((c.backfill.chunk_size, c.backfill.batch_size), (5000, 250));
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
        use proptest::prelude::*;

        use super::*;

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
