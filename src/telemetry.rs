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
pub(crate) fn init_logging(format: LogFormat, default: &str) {
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

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The process's metrics (prometheus-client's counters, gauges and
/// histograms: atomics, cloned handles into one registry). One pipeline
/// runs per process, so one global set (like a Prometheus default
/// registry) saves threading it through every stage.
pub(crate) struct Metrics {
    pub changes_received: Counter,
    pub changes_archived: Counter,
    pub objects_written: Counter,
    pub bytes_written: Counter,
    pub put_retries: Counter,
    pub parked_batches: Gauge,
    pub held_batches: Gauge,
    /// Server WAL sent so far (last keepalive) minus the confirmed position.
    pub slot_lag_bytes: Gauge,
    /// Each PUT attempt, in seconds.
    pub put_seconds: Histogram,
    /// From a batch's first commit to its object being written, in seconds.
    pub commit_to_archive_seconds: Histogram,
    /// 1 while a replication session is streaming.
    pub ready: Gauge,
    registry: Registry,
}

pub(crate) static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

impl Metrics {
    fn new() -> Metrics {
        let histogram = || Histogram::new(BUCKETS);
        let mut m = Metrics {
            changes_received: Counter::default(),
            changes_archived: Counter::default(),
            objects_written: Counter::default(),
            bytes_written: Counter::default(),
            put_retries: Counter::default(),
            parked_batches: Gauge::default(),
            held_batches: Gauge::default(),
            slot_lag_bytes: Gauge::default(),
            put_seconds: histogram(),
            commit_to_archive_seconds: histogram(),
            ready: Gauge::default(),
            registry: Registry::with_prefix("waltail"),
        };
        // Names without the `_total` of counters, which the encoder adds;
        // help without its final full stop, which the registry adds.
        let counters = [
            (
                "changes_received",
                "Changes read from Postgres",
                &m.changes_received,
            ),
            (
                "changes_archived",
                "Changes written to the archive",
                &m.changes_archived,
            ),
            (
                "objects_written",
                "Objects written to the archive",
                &m.objects_written,
            ),
            (
                "bytes_written",
                "Bytes of archive objects written",
                &m.bytes_written,
            ),
            (
                "put_retries",
                "Failed PUT attempts that were retried",
                &m.put_retries,
            ),
        ];
        for (name, help, counter) in counters {
            m.registry.register(name, help, counter.clone());
        }
        let gauges = [
            (
                "parked_batches",
                "Batches parked after failing every attempt",
                &m.parked_batches,
            ),
            (
                "held_batches",
                "Batches held behind parked batches on the same rows",
                &m.held_batches,
            ),
            (
                "slot_lag_bytes",
                "WAL the server has sent past the confirmed position",
                &m.slot_lag_bytes,
            ),
            (
                "ready",
                "1 while a replication session is streaming",
                &m.ready,
            ),
        ];
        for (name, help, gauge) in gauges {
            m.registry.register(name, help, gauge.clone());
        }
        m.registry.register(
            "put_seconds",
            "Duration of each PUT attempt",
            m.put_seconds.clone(),
        );
        m.registry.register(
            "commit_to_archive_seconds",
            "From a batch's first commit to its object being written",
            m.commit_to_archive_seconds.clone(),
        );
        m
    }

    /// The Prometheus text exposition (version 0.0.4) of every metric.
    pub(crate) fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        prometheus_text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}

/// The `Content-Type` of [`Metrics::render`]'s text.
pub(crate) const METRICS_CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

// ---- slot lag warning ----

/// While the lag stays over the threshold the warning is repeated this often:
/// a standing reminder in the log, not a line per keepalive.
pub(crate) const LAG_WARN_REPEAT: Duration = Duration::from_secs(300);

/// Warns when the slot lag passes `telemetry.slot_lag_warn_bytes`, again at
/// most every [`LAG_WARN_REPEAT`] while it stays over, and says when it is
/// back under. Fed by the pipeline on every keepalive.
#[derive(Debug)]
pub(crate) struct LagWatch {
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
    pub(crate) fn new(threshold: u64, slot: &str) -> LagWatch {
        LagWatch {
            threshold,
            slot: slot.to_string(),
            over_since: None,
            warned_at: None,
        }
    }

    /// Takes the lag measured now and logs what needs saying.
    pub(crate) fn observe(&mut self, lag_bytes: u64) {
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

    /// The exposition keeps the names, types and help that dashboards and
    /// alerts were written against, in Prometheus's text format.
    #[test]
    fn metrics_render_in_the_prometheus_text_format() {
        let m = Metrics::new();
        m.changes_archived.inc_by(7);
        m.held_batches.set(2);
        m.put_seconds.observe(0.03);
        let text = m.render();
        for line in [
            "# HELP waltail_changes_archived_total Changes written to the archive.",
            "# TYPE waltail_changes_archived_total counter",
            "waltail_changes_archived_total 7",
            "# TYPE waltail_held_batches gauge",
            "waltail_held_batches 2",
            "# TYPE waltail_put_seconds histogram",
            "waltail_put_seconds_bucket{le=\"0.025\"} 0",
            "waltail_put_seconds_bucket{le=\"0.05\"} 1",
            "waltail_put_seconds_bucket{le=\"+Inf\"} 1",
            "waltail_put_seconds_count 1",
            "# TYPE waltail_ready gauge",
            "# TYPE waltail_commit_to_archive_seconds histogram",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing:\n{text}");
        }
        assert!(!text.contains(".."), "{text}");
    }
}
