//! `waltail config`: the configuration a command would use, printed as a
//! `waltail.toml` with every key's effective value and, beside it, where
//! the value came from (the file, a `WALTAIL_*` variable, the default).
//! Secrets never print: the password in `source.url` shows as `***` and
//! the secret access key as a comment that says it is set. The output is
//! a config file that loads as it reads, so it can be saved and edited
//! (with the secrets put back).
//!
//! The keys are [`KEYS`], the list the environment overrides are read
//! from, so a new key shows here as soon as it can be set (a test checks
//! every key is printed or said not to apply).

use std::fmt::Write as _;
use std::time::Duration;

use secrecy::ExposeSecret;

use super::{Compression, Config, DestinationConfig, KEYS, Origin, Sources, redact_url};

/// The effective configuration as TOML with each key's origin.
pub(crate) fn render(config: &Config, sources: &Sources) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# The configuration waltail uses here: {}, then the WALTAIL_* variables,\n\
         # then the defaults. Secrets are hidden.",
        match &sources.file {
            Some(f) => format!("the file {}", f.display()),
            None => "no config file".to_string(),
        }
    );
    let mut section = None;
    for &(s, key, _) in KEYS {
        if section != Some(s) {
            section = Some(s);
            if !s.is_empty() {
                let _ = writeln!(out, "\n[{s}]");
            }
        }
        let origin = match sources.origin(s, key) {
            Origin::Env(name) => name,
            Origin::File => "file".to_string(),
            Origin::Default => "default".to_string(),
        };
        match value(config, s, key) {
            Value::Set(v) => {
                let _ = writeln!(out, "{key} = {v}  # {origin}");
            }
            Value::Unset(why) if origin == "default" => {
                let _ = writeln!(out, "# {key}: {why}");
            }
            Value::Unset(why) => {
                let _ = writeln!(out, "# {key}: {why}  # {origin}");
            }
            Value::NotHere => {}
        }
    }
    out
}

/// What one key shows.
enum Value {
    /// Its value, as TOML.
    Set(toml::Value),
    /// Not set; the text says what that means.
    Unset(&'static str),
    /// It does not apply to this configuration (an S3 key of a folder).
    NotHere,
}

fn text(s: impl Into<String>) -> Value {
    Value::Set(toml::Value::String(s.into()))
}

fn int(n: impl TryInto<i64>) -> Value {
    Value::Set(toml::Value::Integer(n.try_into().unwrap_or(i64::MAX)))
}

fn duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

fn value(c: &Config, section: &str, key: &str) -> Value {
    let d = &c.delivery;
    let k = &c.compact;
    match (section, key) {
        ("", "pipeline") => text(&c.pipeline),
        ("", "state_dir") => text(c.state_dir.display().to_string()),
        ("source", "url") => text(redact_url(c.source.url.expose_secret())),
        ("source", "tables") => Value::Set(toml::Value::Array(
            c.source
                .tables
                .iter()
                .map(|t| toml::Value::String(t.config_form()))
                .collect(),
        )),
        ("source", "publication") => text(&c.source.publication),
        ("source", "slot") => text(&c.source.slot),
        ("destination", "compression") => text(c.compression.name()),
        ("destination", _) => destination(&c.destination, key),
        ("delivery", "batch_size") => int(d.batch_size),
        ("delivery", "linger_ms") => int(d.linger.as_millis()),
        ("delivery", "max_batch_bytes") => int(d.max_batch_bytes),
        ("delivery", "rate_limit") => int(d.rate_limit),
        ("delivery", "max_in_flight") => int(d.max_in_flight),
        ("delivery", "max_attempts") => int(d.max_attempts),
        ("delivery", "backoff") => Value::Set(toml::Value::Array(
            d.backoff
                .iter()
                .map(|w| toml::Value::String(duration(*w)))
                .collect(),
        )),
        ("delivery", "request_timeout_ms") => int(d.request_timeout.as_millis()),
        ("telemetry", "listen") => match c.telemetry_listen {
            Some(addr) => text(addr.to_string()),
            None => Value::Unset("not set: no console, /metrics or health endpoints"),
        },
        ("telemetry", "slot_lag_warn_bytes") => int(c.slot_lag_warn_bytes),
        ("backfill", "chunk_size") => int(c.backfill.chunk_size),
        ("backfill", "batch_size") => int(c.backfill.batch_size),
        ("backfill", "parallelism") => int(c.backfill.parallelism),
        ("compact", "compression") => text(match k.compression {
            Compression::Zstd => "zstd",
            Compression::Snappy => "snappy",
            Compression::Gzip => "gzip",
            Compression::None => "none",
        }),
        ("compact", "compression_level") => match k.compression_level {
            Some(l) => int(l),
            None if matches!(k.compression, Compression::Zstd | Compression::Gzip) => {
                Value::Unset("not set: the codec's default (zstd 3, gzip 6)")
            }
            None => Value::NotHere,
        },
        ("compact", "row_group_rows") => int(k.row_group_rows),
        ("compact", "file_bytes") => int(k.file_bytes),
        ("compact", "merge_bytes") => int(k.merge_bytes),
        ("compact", "retain") => text(duration(k.retain)),
        ("compact", "vacuum") => Value::Set(toml::Value::Boolean(k.vacuum)),
        _ => Value::Unset("(not shown)"),
    }
}

fn destination(d: &DestinationConfig, key: &str) -> Value {
    let prefix = || match d.prefix() {
        Some(p) => text(p),
        None => Value::Unset("not set: objects start at the root"),
    };
    match d {
        DestinationConfig::File { path, .. } => match key {
            "type" => text("file"),
            "path" => text(path.display().to_string()),
            "prefix" => prefix(),
            _ => Value::NotHere,
        },
        DestinationConfig::S3(s3) => match key {
            "type" => text("s3"),
            "bucket" => text(&s3.bucket),
            "prefix" => prefix(),
            "region" => match &s3.region {
                Some(r) => text(r),
                None => Value::Unset("not set: AWS_REGION or AWS_DEFAULT_REGION, else us-east-1"),
            },
            "endpoint" => match &s3.endpoint {
                Some(e) => text(e),
                None => Value::Unset("not set: AWS S3 of the region"),
            },
            "use_path_style" => Value::Set(toml::Value::Boolean(s3.use_path_style)),
            "access_key_id" => match &s3.access_key_id {
                Some(k) => text(k),
                None => Value::Unset("not set: the AWS credential chain"),
            },
            "secret_access_key" => match &s3.secret_access_key {
                Some(_) => Value::Unset("set (hidden)"),
                None => Value::NotHere,
            },
            "profile" => match (&s3.profile, &s3.access_key_id) {
                (Some(p), _) => text(p),
                (None, None) => Value::Unset("not set: AWS_PROFILE, else \"default\""),
                (None, Some(_)) => Value::Unset("not used: the static keys above"),
            },
            "role_arn" => match &s3.role {
                Some(r) => text(&r.arn),
                None => Value::Unset("not set: no role is assumed"),
            },
            "external_id" => match s3.role.as_ref().map(|r| r.external_id.as_ref()) {
                Some(Some(id)) => text(id),
                Some(None) => Value::Unset("not set"),
                None => Value::Unset("not used: no role_arn"),
            },
            "role_session_name" => match &s3.role {
                Some(r) => text(&r.session_name),
                None => Value::Unset("not used: no role_arn"),
            },
            _ => Value::NotHere,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn explained(text: &str, vars: &[(&str, &str)]) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("waltail.toml");
        std::fs::write(&path, text).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let vars: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (config, sources) = Config::load_sources(Some(&path), vars).unwrap();
        render(&config, &sources)
    }

    const S3: &str = r#"
pipeline = "shop"
[source]
url = "postgres://app:hunter2@db:5432/shop"
tables = ["public.orders", 'public."a.b"']
[destination]
type = "s3"
bucket = "archive"
access_key_id = "AKIAEXAMPLE"
secret_access_key = "wJalrXUtnFEMIEXAMPLEKEY"
[delivery]
batch_size = 500
"#;

    #[test]
    fn every_key_says_its_value_and_origin_and_no_secret_shows() {
        let out = explained(S3, &[("WALTAIL_DELIVERY_LINGER_MS", "1000")]);
        assert!(out.contains("pipeline = \"shop\"  # file"), "{out}");
        assert!(
            out.contains("url = \"postgres://app:***@db:5432/shop\"  # file"),
            "{out}"
        );
        assert!(
            out.contains(r#"tables = ["public.orders", 'public."a.b"']  # file"#),
            "{out}"
        );
        assert!(out.contains("batch_size = 500  # file"), "{out}");
        assert!(
            out.contains("linger_ms = 1000  # WALTAIL_DELIVERY_LINGER_MS"),
            "{out}"
        );
        assert!(out.contains("max_in_flight = 4  # default"), "{out}");
        assert!(
            out.contains("backoff = [\"30s\", \"1m\", \"2m\", \"4m\"]  # default"),
            "{out}"
        );
        assert!(
            out.contains("# secret_access_key: set (hidden)  # file"),
            "{out}"
        );
        assert!(out.contains("retain = \"7days\"  # default"), "{out}");
        assert!(!out.contains("hunter2") && !out.contains("wJalr"), "{out}");
        assert!(
            !out.contains("(not shown)"),
            "a key has no rendering: {out}"
        );
        // Every key of an S3 configuration is printed, set or not.
        for (section, key, _) in KEYS {
            if *section == "destination" && *key == "path" {
                continue;
            }
            assert!(
                out.lines()
                    .any(|l| l.starts_with(&format!("{key} = "))
                        || l.starts_with(&format!("# {key}: "))),
                "{section}.{key} is not printed:\n{out}"
            );
        }
    }

    /// What it prints is a configuration file that loads to the same
    /// configuration (the secrets aside).
    #[test]
    fn the_output_reads_back_as_the_same_configuration() {
        let out = explained(
            "[source]\nurl = \"postgres://u@h/db\"\ntables = [\"public.t\"]\n",
            &[],
        );
        assert!(out.contains("type = \"file\"  # default"), "{out}");
        assert!(out.contains("# listen: not set"), "{out}");
        let vars = BTreeMap::new();
        let again = Config::from_parts(Some(&out), "printed", &vars).unwrap();
        let (first, sources) = Config::load_sources(None, {
            let mut v = BTreeMap::new();
            v.insert(
                "WALTAIL_SOURCE_URL".to_string(),
                "postgres://u@h/db".to_string(),
            );
            v.insert("WALTAIL_SOURCE_TABLES".to_string(), "public.t".to_string());
            v
        })
        .unwrap();
        assert_eq!(render(&again, &sources), render(&first, &sources));
    }
}
