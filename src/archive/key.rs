//! Object keys, written and parsed back in one place:
//! `[prefix/]YYYY/MM/DD/<pipeline>-<firstSeq>-<lastSeq>.ndjson`, then `.gz`
//! or `.zst` when the object is compressed (see [`super::codec`]); schema
//! records under `_schemas/`.
//!
//! The date is the UTC commit date of the batch's first change, never the
//! wall clock, so a retry after midnight writes the same key (DESIGN.md,
//! "How determinism can hold").

use chrono::Datelike;

use super::codec::Codec;
use crate::pgtime;

/// The object key of a batch.
pub(crate) fn batch_key(
    prefix: Option<&str>,
    pipeline: &str,
    commit_ts: i64,
    first_seq: u64,
    last_seq: u64,
    codec: Codec,
) -> String {
    let day = pgtime::to_utc(commit_ts);
    let mut key = String::with_capacity(64);
    if let Some(p) = prefix {
        key.push_str(p);
        key.push('/');
    }
    key.push_str(&format!(
        "{:04}/{:02}/{:02}/{pipeline}-{first_seq}-{last_seq}.ndjson{}",
        day.year(),
        day.month(),
        day.day(),
        codec.suffix()
    ));
    key
}

/// The key of a table's schema record, version `version` (from 1):
/// `[prefix/]_schemas/<schema>.<table>/<n>.json`, `table` being the
/// archive's `schema.table` name. The name is kept readable (letters of any
/// script, spaces, `;`, `'`, `.` stay as they are) and only the characters
/// S3 advises against in keys, `%` and `/` are percent-encoded (UTF-8,
/// upper-case hex): `public.Mixed Case`, `public.ünï`, `public.quo%22te`,
/// `public.a%2Fb`. The key is stored exactly as returned.
pub(crate) fn schema_key(prefix: Option<&str>, table: &str, version: u32) -> String {
    let p = prefix.map(|p| format!("{p}/")).unwrap_or_default();
    format!("{p}_schemas/{}/{version}.json", key_segment(table))
}

/// Percent-encodes what must not appear raw in one key segment: control
/// characters, `/`, `%`, and the characters S3 and object_store avoid
/// (``\ { } ^ ` [ ] " < > ~ # | * ?``); a segment of dots alone is encoded
/// whole, so it is never `.` or `..`.
pub(crate) fn key_segment(name: &str) -> String {
    const RESERVED: &str = "/%\\{}^`[]\"<>~#|*?";
    let mut out = String::with_capacity(name.len());
    let all_dots = !name.is_empty() && name.bytes().all(|b| b == b'.');
    for c in name.chars() {
        if c.is_control() || RESERVED.contains(c) || (all_dots && c == '.') {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The key of the connection check's marker object.
pub(crate) fn check_key(prefix: Option<&str>) -> String {
    match prefix {
        Some(p) => format!("{p}/.waltail-check"),
        None => ".waltail-check".to_string(),
    }
}

/// `key` joined under the optional prefix.
#[cfg(feature = "lakehouse")]
pub(crate) fn under(prefix: Option<&str>, key: &str) -> String {
    match prefix {
        Some(p) => format!("{p}/{key}"),
        None => key.to_string(),
    }
}

/// Parses an archive key relative to the prefix:
/// `YYYY/MM/DD/<pipeline>-<a>-<b>.ndjson`, plain or compressed (`.gz`,
/// `.zst`).
#[cfg(feature = "lakehouse")]
pub(crate) fn parse_key(relative: &str, pipeline: &str) -> Option<(String, u64, u64)> {
    let mut parts = relative.split('/');
    let (y, m, d, name) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some()
        || y.len() != 4
        || m.len() != 2
        || d.len() != 2
        || ![y, m, d]
            .iter()
            .all(|p| p.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    let range = Codec::of_key(name)
        .1
        .strip_suffix(".ndjson")?
        .strip_prefix(pipeline)?
        .strip_prefix('-')?;
    let (a, b) = range.split_once('-')?;
    let (first, last) = (a.parse().ok()?, b.parse().ok()?);
    (first <= last).then(|| (format!("{y}-{m}-{d}"), first, last))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_uses_commit_date_in_utc() {
        // 2024-03-01 23:59:59.999999 UTC in Postgres micros.
        let ts: i64 = 1_709_337_599_999_999 - 946_684_800_000_000;
        assert_eq!(
            batch_key(Some("waltail/prod"), "orders", ts, 1, 100, Codec::None),
            "waltail/prod/2024/03/01/orders-1-100.ndjson"
        );
        assert_eq!(
            batch_key(None, "orders", ts + 1, 101, 101, Codec::None),
            "2024/03/02/orders-101-101.ndjson"
        );
        assert_eq!(
            batch_key(None, "orders", ts, 1, 100, Codec::Zstd),
            "2024/03/01/orders-1-100.ndjson.zst"
        );
    }

    #[test]
    fn check_key_sits_under_the_prefix() {
        assert_eq!(check_key(Some("a/b")), "a/b/.waltail-check");
        assert_eq!(check_key(None), ".waltail-check");
    }

    #[test]
    fn schema_keys_are_readable_and_exact() {
        let k = |t: &str| schema_key(Some("p"), t, 1);
        assert_eq!(k("public.orders"), "p/_schemas/public.orders/1.json");
        assert_eq!(
            k("public.Mixed Case"),
            "p/_schemas/public.Mixed Case/1.json"
        );
        assert_eq!(
            k("public.semi;colon"),
            "p/_schemas/public.semi;colon/1.json"
        );
        assert_eq!(k("public.quo\"te"), "p/_schemas/public.quo%22te/1.json");
        assert_eq!(k("public.ünï"), "p/_schemas/public.ünï/1.json");
        assert_eq!(k("public.a/b"), "p/_schemas/public.a%2Fb/1.json");
        assert_eq!(k("public.100%"), "p/_schemas/public.100%25/1.json");
        assert_eq!(k("public.tab\tx"), "p/_schemas/public.tab%09x/1.json");
        assert_eq!(key_segment(".."), "%2E%2E");
        // Every key is a valid object_store path, stored as written.
        for t in [
            "public.quo\"te",
            "public.ünï",
            "public.a/b",
            "s.#1",
            "x.\u{7f}",
        ] {
            let key = k(t);
            let path = object_store::path::Path::parse(&key).unwrap();
            assert_eq!(path.as_ref(), key);
        }
        // Distinct names, distinct keys.
        assert_ne!(k("public.a%2Fb"), k("public.a/b"));
    }

    #[cfg(feature = "lakehouse")]
    #[test]
    fn keys_parse_only_for_this_pipeline() {
        assert_eq!(
            parse_key("2024/03/01/orders-1-100.ndjson", "orders"),
            Some(("2024-03-01".into(), 1, 100))
        );
        assert_eq!(parse_key("2024/03/01/other-1-100.ndjson", "orders"), None);
        for compressed in [
            "2024/03/01/orders-1-100.ndjson.gz",
            "2024/03/01/orders-1-100.ndjson.zst",
        ] {
            assert_eq!(
                parse_key(compressed, "orders"),
                Some(("2024-03-01".into(), 1, 100))
            );
        }
        assert_eq!(
            parse_key("2024/03/01/orders-1-100.ndjson.bz2", "orders"),
            None
        );
        assert_eq!(parse_key("2024/03/01/orders-1-100.gz", "orders"), None);
        assert_eq!(
            parse_key("2024/03/01/orders-eu-1-100.ndjson", "orders"),
            None
        );
        assert_eq!(parse_key("parquet/public/orders/x.parquet", "orders"), None);
        assert_eq!(parse_key("2024/03/01/orders-9-1.ndjson", "orders"), None);
        assert_eq!(parse_key("2024/3/01/orders-1-1.ndjson", "orders"), None);
    }
}
