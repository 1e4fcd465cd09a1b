//! The commands of the command line, one module each: what a command asks,
//! prints and exits with. They sit above everything else: they drive the
//! pipeline and the stages, and no stage imports them (or the pipeline)
//! back. `cli` parses the arguments and dispatches here.

pub(crate) mod backfill;
pub(crate) mod check;
#[cfg(feature = "lakehouse")]
pub(crate) mod compact;
pub(crate) mod parked;
#[cfg(feature = "lakehouse")]
pub(crate) mod query;
pub(crate) mod run;
pub(crate) mod status;

use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::error::ErrorKind;
use crate::{Error, Result};

/// The pipeline's local state, for the commands that read what `run` left
/// (`status`, `parked`): they never create one.
pub(crate) fn open_state(config: &Config) -> Result<Checkpoint> {
    let path = config.state_file();
    if !path.exists() {
        return Err(Error::fatal(
            format!(
                "pipeline {} has no state at {}",
                config.pipeline,
                path.display()
            ),
            "run `waltail run` first, or run this from the folder (or with the --config and state_dir) that `waltail run` uses",
        )
        .with_kind(ErrorKind::State));
    }
    Checkpoint::open(&path)
}

/// Counts SIGINT/SIGTERM: the first asks for a graceful stop, a second one
/// for an immediate stop (see [`crate::pipeline::Shutdown`]).
pub(crate) fn stop_on_signals() -> tokio::sync::watch::Sender<u32> {
    let (tx, _) = tokio::sync::watch::channel(0u32);
    let signals = tx.clone();
    tokio::spawn(async move {
        let tx = signals;
        let (Ok(mut term), Ok(mut int)) = (
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()),
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()),
        ) else {
            return;
        };
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tx.send_modify(|n| *n += 1);
        }
    });
    tx
}

/// Serves the console, /metrics, /healthz and /readyz when
/// telemetry.listen is set (`run` and `backfill`).
pub(crate) async fn serve_telemetry(config: &Config) -> Result<()> {
    if let Some(addr) = config.telemetry_listen {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            Error::fatal(
                format!("cannot listen on {addr} for telemetry: {e}"),
                "choose a free address in telemetry.listen (WALTAIL_TELEMETRY_LISTEN), or remove it",
            )
        })?;
        // The address bound, not the one asked for: port 0 picks a free one.
        let addr = listener.local_addr().unwrap_or(addr);
        tracing::info!(%addr, "serving the console at http://{addr}/, and /metrics, /healthz and /readyz");
        let console = crate::console::Console::new(config, addr);
        tokio::spawn(crate::http::serve(listener, console));
    }
    Ok(())
}
