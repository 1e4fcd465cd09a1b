//! What an operator sees of a running pipeline: logs through `tracing`
//! (human-readable on stderr by default, JSON lines with `--log-format json`;
//! the filter comes from `WALTAIL_LOG`, e.g. `debug`, `waltail=debug`,
//! default `info`), the process's metrics and the slot-lag warning. The
//! HTTP server that shows them is [`crate::http`].

use tracing_subscriber::EnvFilter;

/// The log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global subscriber. Call once, from the binary.
/// Logs to stderr, waltail's own events at `default` level and its
/// dependencies' at warn, unless WALTAIL_LOG sets a filter.
pub fn init_logging(format: LogFormat, default: &str) {
    // Dependencies say only warnings and errors by default: the Delta
    // kernel alone logs several info lines per table a run opens.
    let filter = EnvFilter::try_from_env("WALTAIL_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("warn,waltail={default}")));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

// ---- metrics ----

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A Prometheus histogram of durations, lock-free.
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    const fn new() -> Self {
        Histogram {
            buckets: [const { AtomicU64::new(0) }; BUCKETS.len()],
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (b, bound) in self.buckets.iter().zip(BUCKETS) {
            if secs <= bound {
                b.fetch_add(1, Relaxed);
            }
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_micros.fetch_add(d.as_micros() as u64, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, bound) in self.buckets.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {}", b.load(Relaxed));
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// The process's metrics. One pipeline runs per process, so one global set
/// (like a Prometheus default registry) saves threading it through every stage.
pub struct Metrics {
    pub changes_received: AtomicU64,
    pub changes_archived: AtomicU64,
    pub objects_written: AtomicU64,
    pub bytes_written: AtomicU64,
    pub put_retries: AtomicU64,
    pub parked_batches: AtomicI64,
    pub held_batches: AtomicI64,
    /// Server WAL sent so far (last keepalive) minus the confirmed position.
    pub slot_lag_bytes: AtomicI64,
    pub put_seconds: Histogram,
    /// From a batch's first commit to its object being written.
    pub commit_to_archive_seconds: Histogram,
    /// A replication session is streaming.
    pub ready: AtomicBool,
}

pub static METRICS: Metrics = Metrics {
    changes_received: AtomicU64::new(0),
    changes_archived: AtomicU64::new(0),
    objects_written: AtomicU64::new(0),
    bytes_written: AtomicU64::new(0),
    put_retries: AtomicU64::new(0),
    parked_batches: AtomicI64::new(0),
    held_batches: AtomicI64::new(0),
    slot_lag_bytes: AtomicI64::new(0),
    put_seconds: Histogram::new(),
    commit_to_archive_seconds: Histogram::new(),
    ready: AtomicBool::new(false),
};

impl Metrics {
    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let counters: [(&str, &str, &AtomicU64); 5] = [
            (
                "waltail_changes_received_total",
                "Changes read from Postgres.",
                &self.changes_received,
            ),
            (
                "waltail_changes_archived_total",
                "Changes written to the archive.",
                &self.changes_archived,
            ),
            (
                "waltail_objects_written_total",
                "Objects written to the archive.",
                &self.objects_written,
            ),
            (
                "waltail_bytes_written_total",
                "Bytes of archive objects written.",
                &self.bytes_written,
            ),
            (
                "waltail_put_retries_total",
                "Failed PUT attempts that were retried.",
                &self.put_retries,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
        let gauges: [(&str, &str, i64); 4] = [
            (
                "waltail_parked_batches",
                "Batches parked after failing every attempt.",
                self.parked_batches.load(Relaxed),
            ),
            (
                "waltail_held_batches",
                "Batches held behind parked batches on the same rows.",
                self.held_batches.load(Relaxed),
            ),
            (
                "waltail_slot_lag_bytes",
                "WAL the server has sent past the confirmed position.",
                self.slot_lag_bytes.load(Relaxed),
            ),
            (
                "waltail_ready",
                "1 while a replication session is streaming.",
                i64::from(self.ready.load(Relaxed)),
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        self.put_seconds.render(
            &mut out,
            "waltail_put_seconds",
            "Duration of each PUT attempt.",
        );
        self.commit_to_archive_seconds.render(
            &mut out,
            "waltail_commit_to_archive_seconds",
            "From a batch's first commit to its object being written.",
        );
        out
    }
}

// ---- slot lag warning ----

/// While the lag stays over the threshold the warning is repeated this often:
/// a standing reminder in the log, not a line per keepalive.
pub const LAG_WARN_REPEAT: Duration = Duration::from_secs(300);

/// Warns when the slot lag passes `telemetry.slot_lag_warn_bytes`, again at
/// most every [`LAG_WARN_REPEAT`] while it stays over, and says when it is
/// back under. Fed by the pipeline on every keepalive.
#[derive(Debug)]
pub struct LagWatch {
    threshold: u64,
    slot: String,
    /// When the lag went over, while it is over.
    over_since: Option<Instant>,
    warned_at: Option<Instant>,
}

/// What [`LagWatch::check`] decided to say.
#[derive(Debug, PartialEq, Eq)]
enum LagNotice {
    /// Over the threshold, for this long so far.
    Over(Duration),
    /// Back under after this long over.
    Back(Duration),
}

impl LagWatch {
    /// A watch on `slot`; `threshold` 0 never warns.
    pub fn new(threshold: u64, slot: &str) -> LagWatch {
        LagWatch {
            threshold,
            slot: slot.to_string(),
            over_since: None,
            warned_at: None,
        }
    }

    /// Takes the lag measured now and logs what needs saying.
    pub fn observe(&mut self, lag_bytes: u64) {
        match self.check(lag_bytes, Instant::now()) {
            Some(LagNotice::Over(over_for)) => tracing::warn!(
                slot = %self.slot,
                lag_bytes,
                threshold_bytes = self.threshold,
                over_for = ?over_for,
                "replication slot lag is over telemetry.slot_lag_warn_bytes: Postgres keeps this WAL \
                 until waltail confirms it. Look for a slow or failing destination (PUT retries, \
                 parked batches) or a long transaction; `waltail status` shows the lag"
            ),
            Some(LagNotice::Back(over_for)) => tracing::info!(
                slot = %self.slot,
                lag_bytes,
                threshold_bytes = self.threshold,
                over_for = ?over_for,
                "replication slot lag is back under telemetry.slot_lag_warn_bytes"
            ),
            None => {}
        }
    }

    fn check(&mut self, lag_bytes: u64, now: Instant) -> Option<LagNotice> {
        if self.threshold == 0 {
            return None;
        }
        if lag_bytes > self.threshold {
            let since = *self.over_since.get_or_insert(now);
            if self
                .warned_at
                .is_some_and(|t| now.duration_since(t) < LAG_WARN_REPEAT)
            {
                return None;
            }
            self.warned_at = Some(now);
            return Some(LagNotice::Over(now.duration_since(since)));
        }
        let since = self.over_since.take()?;
        self.warned_at = None;
        Some(LagNotice::Back(now.duration_since(since)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_warning_once_then_every_few_minutes_then_back_under() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut w = LagWatch::new(1000, "s");
        assert_eq!(w.check(1000, at(0)), None, "at the threshold is not over");
        assert_eq!(w.check(1001, at(1)), Some(LagNotice::Over(Duration::ZERO)));
        assert_eq!(w.check(5000, at(2)), None);
        assert_eq!(w.check(5000, at(300)), None);
        assert_eq!(
            w.check(5000, at(301)),
            Some(LagNotice::Over(Duration::from_secs(300)))
        );
        assert_eq!(
            w.check(10, at(310)),
            Some(LagNotice::Back(Duration::from_secs(309)))
        );
        assert_eq!(w.check(10, at(311)), None);
        // Over again: a fresh warning at once.
        assert_eq!(
            w.check(2000, at(312)),
            Some(LagNotice::Over(Duration::ZERO))
        );
    }

    #[test]
    fn lag_warning_off_at_zero() {
        let mut w = LagWatch::new(0, "s");
        assert_eq!(w.check(u64::MAX, Instant::now()), None);
    }
}
