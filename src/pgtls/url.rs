//! Taking `sslmode` and `sslrootcert` out of the connection string, in
//! both of libpq's forms (URL and key=value): tokio-postgres knows neither
//! `verify-*` nor `sslrootcert`, so they are read here and the rest goes to
//! tokio-postgres unchanged.

use std::path::PathBuf;

use super::{SslMode, TlsSettings};

/// Splits `url` into the connection string tokio-postgres can parse (without
/// `sslmode` and `sslrootcert`) and the TLS settings they gave (default
/// `prefer`). Works on both the URL form (`postgres://...?sslmode=...`) and
/// the key=value form (`host=... sslmode=...`). The CA file is read here.
pub(crate) fn extract(url: &str) -> Result<(String, TlsSettings), String> {
    let (rest, mode, root) = split_tls_params(url)?;
    let mode = match mode {
        None => SslMode::Prefer,
        Some(m) => SslMode::parse(&m).ok_or_else(|| {
            format!(
                "sslmode={m} is not valid: use disable, allow, prefer, require, verify-ca or verify-full"
            )
        })?,
    };
    let root = match root {
        Some(r) if r.is_empty() => {
            return Err("sslrootcert is empty: give the path of the CA certificate (PEM)".into());
        }
        Some(r) if r == "system" => {
            return Err(
                "sslrootcert=system is not supported: give the path of the CA certificate (PEM)"
                    .into(),
            );
        }
        Some(r) => Some(PathBuf::from(r)),
        None => None,
    };
    Ok((rest, TlsSettings::new(mode, root)?))
}

type Split = (String, Option<String>, Option<String>);

fn split_tls_params(url: &str) -> Result<Split, String> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        split_url(url)
    } else {
        split_key_value(url)
    }
}

fn split_url(url: &str) -> Result<Split, String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), None, None));
    };
    let (mut mode, mut root) = (None, None);
    let mut kept = Vec::new();
    for part in query.split('&') {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        match percent_decode(k)?.as_str() {
            "sslmode" => mode = Some(percent_decode(v)?),
            "sslrootcert" => root = Some(percent_decode(v)?),
            _ => kept.push(part),
        }
    }
    let rest = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, mode, root))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent-encoding in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once decoded"))
}

/// key=value form, with libpq's quoting: `key = 'a \'quoted\' value'`.
fn split_key_value(s: &str) -> Result<Split, String> {
    let (mut mode, mut root) = (None, None);
    let mut kept = Vec::new();
    let mut chars = s.char_indices().peekable();
    loop {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, _)) = chars.peek() else {
            break;
        };
        let mut key = String::new();
        while let Some((_, c)) = chars.next_if(|(_, c)| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        if chars.next_if(|(_, c)| *c == '=').is_none() {
            // Not key=value: leave it to tokio-postgres to report.
            return Ok((s.to_string(), None, None));
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if(|(_, c)| *c == '\'').is_some() {
            loop {
                match chars.next() {
                    None => return Ok((s.to_string(), None, None)),
                    Some((_, '\'')) => break,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, c)) => value.push(c),
                        None => return Ok((s.to_string(), None, None)),
                    },
                    Some((_, c)) => value.push(c),
                }
            }
        } else {
            while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some((_, c)) = chars.next() {
                        value.push(c);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        let end = chars.peek().map_or(s.len(), |&(i, _)| i);
        match key.as_str() {
            "sslmode" => mode = Some(value),
            "sslrootcert" => root = Some(value),
            _ => kept.push(&s[start..end]),
        }
    }
    Ok((kept.join(" "), mode, root))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_form_loses_only_the_tls_keys() {
        let (rest, mode, root) = split_tls_params(
            "postgres://u@h:5/db?application_name=x&sslmode=verify-full&sslrootcert=%2Ftmp%2Fca%20x.pem&connect_timeout=3",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u@h:5/db?application_name=x&connect_timeout=3"
        );
        assert_eq!(mode.as_deref(), Some("verify-full"));
        assert_eq!(root.as_deref(), Some("/tmp/ca x.pem"));
        let (rest, mode, _) = split_tls_params("postgres://u@h/db?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://u@h/db");
        assert_eq!(mode.as_deref(), Some("require"));
        let (rest, mode, _) = split_tls_params("postgresql://u@h/db").unwrap();
        assert_eq!((rest.as_str(), mode), ("postgresql://u@h/db", None));
    }

    #[test]
    fn key_value_form_with_quotes() {
        let (rest, mode, root) = split_tls_params(
            r"host=h sslmode = verify-ca dbname=d sslrootcert='/a b/it\'s.pem' user=u",
        )
        .unwrap();
        assert_eq!(rest, "host=h dbname=d user=u");
        assert_eq!(mode.as_deref(), Some("verify-ca"));
        assert_eq!(root.as_deref(), Some("/a b/it's.pem"));
        let parsed: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(parsed.get_dbname(), Some("d"));
    }
}
