//! Logging through `tracing`: human-readable on stderr by default, JSON lines
//! with `--log-format json`. The filter comes from `WALTAIL_LOG` (e.g.
//! `debug`, `waltail=debug`), default `info`.

use tracing_subscriber::EnvFilter;

/// The log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global subscriber. Call once, from the binary.
pub fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_env("WALTAIL_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
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
