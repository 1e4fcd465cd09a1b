//! What is in the archive: its NDJSON objects (seq ranges and dates, parsed
//! from their keys) and its schema records, read through the same
//! object_store the sink writes with.

use std::collections::BTreeMap;

use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

use super::typing::SchemaRecord;
use crate::{Error, Result};

/// One archive object, `[prefix/]YYYY/MM/DD/<pipeline>-<first>-<last>.ndjson`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveObject {
    pub key: String,
    /// `YYYY-MM-DD`, from the key (the UTC commit date of its first change).
    pub date: String,
    pub first_seq: u64,
    pub last_seq: u64,
    pub size: u64,
}

/// `key` joined under the optional prefix.
pub fn under(prefix: Option<&str>, key: &str) -> String {
    match prefix {
        Some(p) => format!("{p}/{key}"),
        None => key.to_string(),
    }
}

/// Parses an archive key relative to the prefix: `YYYY/MM/DD/<pipeline>-<a>-<b>.ndjson`.
pub fn parse_key(relative: &str, pipeline: &str) -> Option<(String, u64, u64)> {
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
    let range = name
        .strip_suffix(".ndjson")?
        .strip_prefix(pipeline)?
        .strip_prefix('-')?;
    let (a, b) = range.split_once('-')?;
    let (first, last) = (a.parse().ok()?, b.parse().ok()?);
    (first <= last).then(|| (format!("{y}-{m}-{d}"), first, last))
}

/// Every archive object of `pipeline`, by first seq. Other files under the
/// prefix (the compacted output, schema records, other pipelines) are skipped.
pub async fn list_objects(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    pipeline: &str,
) -> Result<Vec<ArchiveObject>> {
    let root = prefix.map(ObjectPath::from);
    let described = prefix.unwrap_or("/").to_string();
    let metas: Vec<_> = store
        .list(root.as_ref())
        .try_collect()
        .await
        .map_err(|e| Error::store("LIST", described, e))?;
    let mut out = Vec::new();
    for meta in metas {
        let key = meta.location.to_string();
        let relative = match prefix {
            Some(p) => match key.strip_prefix(p).and_then(|k| k.strip_prefix('/')) {
                Some(r) => r,
                None => continue,
            },
            None => key.as_str(),
        };
        if let Some((date, first_seq, last_seq)) = parse_key(relative, pipeline) {
            out.push(ArchiveObject {
                key,
                date,
                first_seq,
                last_seq,
                size: meta.size,
            });
        }
    }
    out.sort_by(|a, b| (a.first_seq, a.last_seq, &a.key).cmp(&(b.first_seq, b.last_seq, &b.key)));
    Ok(out)
}

/// Every schema record under `[prefix/]_schemas/`, by table name.
pub async fn load_schemas(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
) -> Result<BTreeMap<String, Vec<SchemaRecord>>> {
    let root = ObjectPath::from(under(prefix, "_schemas"));
    let metas: Vec<_> = store
        .list(Some(&root))
        .try_collect()
        .await
        .map_err(|e| Error::store("LIST", root.to_string(), e))?;
    let mut out: BTreeMap<String, Vec<SchemaRecord>> = BTreeMap::new();
    for meta in metas
        .iter()
        .filter(|m| m.location.as_ref().ends_with(".json"))
    {
        let body = get(store, &meta.location).await?;
        let record: SchemaRecord = serde_json::from_slice(&body).map_err(|e| {
            Error::fatal(
                format!("schema record {} is not valid: {e}", meta.location),
                "schema records are written by `waltail run`; restore this object from a backup or a copy",
            )
        })?;
        out.entry(record.table.clone()).or_default().push(record);
    }
    Ok(out)
}

/// Reads a whole object.
pub async fn get(store: &dyn ObjectStore, path: &ObjectPath) -> Result<bytes::Bytes> {
    let got = store
        .get(path)
        .await
        .map_err(|e| Error::store("GET", path.to_string(), e))?;
    got.bytes()
        .await
        .map_err(|e| Error::store("GET", path.to_string(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_only_for_this_pipeline() {
        assert_eq!(
            parse_key("2024/03/01/orders-1-100.ndjson", "orders"),
            Some(("2024-03-01".into(), 1, 100))
        );
        assert_eq!(parse_key("2024/03/01/other-1-100.ndjson", "orders"), None);
        assert_eq!(
            parse_key("2024/03/01/orders-eu-1-100.ndjson", "orders"),
            None
        );
        assert_eq!(parse_key("parquet/public/orders/x.parquet", "orders"), None);
        assert_eq!(parse_key("2024/03/01/orders-9-1.ndjson", "orders"), None);
        assert_eq!(parse_key("2024/3/01/orders-1-1.ndjson", "orders"), None);
    }
}
