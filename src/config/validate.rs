//! The raw configuration ([`super::raw`]) checked into the typed values
//! the program runs with: defaults filled in, ranges and names checked,
//! every error naming the key and saying what is allowed, before anything
//! is built.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use secrecy::SecretString;

use super::raw::*;
use super::secrets::redact_url;
use super::table_name::MAX_IDENT_BYTES;
use super::*;
use crate::{Error, Result};

/// The value of `key` (`default` when unset), which must be 1 to `max`.
pub(super) fn positive(key: &str, v: Option<i64>, default: i64, max: i64) -> Result<i64> {
    let v = v.unwrap_or(default);
    if v < 1 || v > max {
        return Err(Error::config(format!(
            "{key} = {v}: must be between 1 and {max}"
        )));
    }
    Ok(v)
}

/// A pipeline name: it goes into object keys and the default slot and
/// publication names, so it takes what all three allow.
pub(super) fn valid_name(key: &str, v: &str) -> Result<()> {
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

/// The whole configuration, checked (see the module doc).
pub(super) fn validate(raw: RawConfig) -> Result<Config> {
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

/// The `[compact]` section, checked.
pub(super) fn compact(c: RawCompact) -> Result<CompactConfig> {
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

/// The `[destination]` section, checked: a folder or an S3 bucket.
pub(super) fn destination(d: RawDestination) -> Result<DestinationConfig> {
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
pub(super) fn assume_role(
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
