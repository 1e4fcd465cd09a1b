//! The secrets a configuration holds (the S3 secret key, a password in
//! `source.url`): a file holding one must be private to its owner, and a
//! connection string is redacted before it reaches a message or a log.

use std::path::Path;
use std::str::FromStr;

use crate::{Error, Result};

/// The secret a config file holds, if any: `destination.secret_access_key`
/// or a password in `source.url`.
pub(super) fn file_secret(table: &toml::Table) -> Option<&'static str> {
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
pub(super) fn url_has_password(url: &str) -> bool {
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
pub(super) fn check_file_mode(file: &Path, table: &toml::Table) -> Result<()> {
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
pub(super) fn check_file_mode(_file: &Path, _table: &toml::Table) -> Result<()> {
    Ok(())
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
