//! Object key layout: `[prefix/]YYYY/MM/DD/<pipeline>-<firstSeq>-<lastSeq>.ndjson`.
//!
//! The date is the UTC commit date of the batch's first change, never the
//! wall clock, so a retry after midnight writes the same key (DESIGN.md,
//! "How determinism can hold").

use chrono::{DateTime, Datelike, Utc};

/// Microseconds between the Unix epoch and Postgres's epoch (2000-01-01 UTC).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// A Postgres timestamp (microseconds since 2000-01-01 UTC) as a UTC time.
pub fn pg_time(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros.saturating_add(PG_EPOCH_OFFSET_MICROS))
        .unwrap_or_default()
}

/// The object key of a batch.
pub fn batch_key(
    prefix: Option<&str>,
    pipeline: &str,
    commit_ts: i64,
    first_seq: u64,
    last_seq: u64,
) -> String {
    let day = pg_time(commit_ts);
    let mut key = String::with_capacity(64);
    if let Some(p) = prefix {
        key.push_str(p);
        key.push('/');
    }
    key.push_str(&format!(
        "{:04}/{:02}/{:02}/{pipeline}-{first_seq}-{last_seq}.ndjson",
        day.year(),
        day.month(),
        day.day()
    ));
    key
}

/// The key of a table's schema record, version `version` (from 1).
pub fn schema_key(prefix: Option<&str>, table: &str, version: u32) -> String {
    let p = prefix.map(|p| format!("{p}/")).unwrap_or_default();
    format!("{p}_schemas/{table}/{version}.json")
}

/// The key of the connection check's marker object.
pub fn check_key(prefix: Option<&str>) -> String {
    match prefix {
        Some(p) => format!("{p}/.waltail-check"),
        None => ".waltail-check".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_uses_commit_date_in_utc() {
        // 2024-03-01 23:59:59.999999 UTC in Postgres micros.
        let ts: i64 = 1_709_337_599_999_999 - 946_684_800_000_000;
        assert_eq!(
            batch_key(Some("waltail/prod"), "orders", ts, 1, 100),
            "waltail/prod/2024/03/01/orders-1-100.ndjson"
        );
        assert_eq!(
            batch_key(None, "orders", ts + 1, 101, 101),
            "2024/03/02/orders-101-101.ndjson"
        );
    }

    #[test]
    fn check_key_sits_under_the_prefix() {
        assert_eq!(check_key(Some("a/b")), "a/b/.waltail-check");
        assert_eq!(check_key(None), ".waltail-check");
    }
}
