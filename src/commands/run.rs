//! `waltail run`: streams until SIGINT/SIGTERM (the first flushes the batch
//! in hand and confirms it; a second stops at once).

use std::process::ExitCode;

use crate::Result;
use crate::config::Config;
use crate::pipeline::{self, RunOptions};

pub(crate) async fn run(config: &Config, opts: RunOptions) -> Result<ExitCode> {
    let stop = super::stop_on_signals();
    super::serve_telemetry(config).await?;
    pipeline::run(config, &opts, stop.subscribe()).await?;
    Ok(ExitCode::SUCCESS)
}
