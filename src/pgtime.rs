//! Postgres timestamps as the replication protocol carries them: signed
//! microseconds since the Postgres epoch, 2000-01-01 00:00:00 UTC (commit
//! times in pgoutput, the client clock in standby status updates). The one
//! place that converts them to and from Unix time. A ground-floor module: it
//! uses nothing else of the crate.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::{DateTime, Utc};

/// Microseconds between the Unix epoch and Postgres's epoch (2000-01-01 UTC).
pub(crate) const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// A Postgres timestamp as a UTC time; out of chrono's range, the Unix epoch.
pub(crate) fn to_utc(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros.saturating_add(PG_EPOCH_OFFSET_MICROS))
        .unwrap_or_default()
}

/// The wall clock as a Postgres timestamp (a clock before 1970 reads as the
/// Unix epoch).
pub(crate) fn now_micros() -> i64 {
    let since_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    i64::try_from(since_unix.as_micros()).unwrap_or(i64::MAX) - PG_EPOCH_OFFSET_MICROS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_is_the_postgres_epoch() {
        assert_eq!(to_utc(0).to_rfc3339(), "2000-01-01T00:00:00+00:00");
        assert_eq!(to_utc(-PG_EPOCH_OFFSET_MICROS).timestamp(), 0);
        assert_eq!(
            to_utc(1_709_337_599_999_999 - PG_EPOCH_OFFSET_MICROS).timestamp_micros(),
            1_709_337_599_999_999
        );
    }

    #[test]
    fn out_of_range_reads_as_the_unix_epoch() {
        assert_eq!(to_utc(i64::MAX), DateTime::<Utc>::default());
        assert_eq!(to_utc(i64::MIN), DateTime::<Utc>::default());
    }

    #[test]
    fn now_reads_back_as_now() {
        let before = Utc::now();
        let now = to_utc(now_micros());
        let after = Utc::now();
        assert!(before <= now && now <= after, "{before} {now} {after}");
    }
}
