//! `waltail parked list` and `waltail parked replay`.
//!
//! A replay goes through the running pipeline when there is one (it holds
//! the pipeline's lock): the batch is marked for replay in the state and the
//! pipeline delivers it, then the batches held behind it, with its usual
//! per-row ordering. With no pipeline running, this command delivers them
//! itself while holding the lock, so the two never write at once.

use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;

use crate::checkpoint::{self, Checkpoint, ParkStatus};
use crate::config::Config;
use crate::delivery::parking;
use crate::delivery::{RetryPolicy, put_with_retry};
use crate::error::Report;
use crate::pipeline::lock_pipeline;
use crate::sink::Sink;
use crate::{Error, Result};

/// How long `replay` waits for the running pipeline to deliver.
const REPLAY_WAIT: Duration = Duration::from_secs(600);

/// Prints the parked and held batches.
pub(crate) fn list(config: &Config) -> Result<ExitCode> {
    let cp = super::open_state(config)?;
    let parked = cp.parked()?;
    if parked.is_empty() {
        println!("no parked batches");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<10} {:<21} {:<7} {:>8}  {:<20}  {:<24} LAST ERROR",
        "ID", "SEQS", "STATUS", "ATTEMPTS", "PARKED AT", "TABLES"
    );
    for p in &parked {
        println!(
            "{:<10} {:<21} {:<7} {:>8}  {:<20}  {:<24} {}",
            p.first_seq,
            format!("{}-{}", p.first_seq, p.last_seq),
            p.status.as_str(),
            p.attempts,
            p.parked_at,
            p.tables,
            p.last_error.as_deref().unwrap_or("-"),
        );
    }
    let held = parked
        .iter()
        .filter(|p| p.status == ParkStatus::Held)
        .count();
    println!(
        "{} parked, {held} held behind them; replay with `waltail parked replay <ID>` or `--all`",
        parked.len() - held
    );
    Ok(ExitCode::SUCCESS)
}

/// Replays one parked batch (`Some(id)`) or all of them.
pub(crate) async fn replay(config: &Config, id: Option<u64>) -> Result<ExitCode> {
    let mut cp = super::open_state(config)?;
    let wanted: Vec<u64> = cp
        .parked()?
        .iter()
        .filter(|p| p.status != ParkStatus::Held && id.is_none_or(|id| id == p.first_seq))
        .map(|p| p.first_seq)
        .collect();
    if wanted.is_empty() {
        return Err(Error::fatal(
            match id {
                Some(id) => format!("no parked batch with id {id}"),
                None => "no parked batches".to_string(),
            },
            "`waltail parked list` shows the parked batches and their ids",
        ));
    }
    cp.request_replay(id)?;
    match lock_pipeline(config)? {
        None => wait_for_pipeline(&cp, &wanted).await,
        Some(_lock) => deliver_here(config, &mut cp).await,
    }
}

/// The pipeline is running: it picks the request up; wait until it is done.
async fn wait_for_pipeline(cp: &Checkpoint, wanted: &[u64]) -> Result<ExitCode> {
    println!("the pipeline is running: it will deliver the batch(es); waiting...");
    let start = std::time::Instant::now();
    loop {
        let parked = cp.parked()?;
        let left: Vec<_> = parked
            .iter()
            .filter(|p| wanted.contains(&p.first_seq))
            .collect();
        if left.is_empty() {
            let held = parked
                .iter()
                .filter(|p| p.status == ParkStatus::Held)
                .count();
            println!(
                "delivered {} batch(es); {held} batch(es) still held",
                wanted.len()
            );
            return Ok(ExitCode::SUCCESS);
        }
        if left.iter().all(|p| p.status == ParkStatus::Parked) {
            for p in left {
                println!(
                    "batch {} failed again: {}",
                    p.first_seq,
                    p.last_error.as_deref().unwrap_or("-")
                );
            }
            return Ok(ExitCode::FAILURE);
        }
        if start.elapsed() > REPLAY_WAIT {
            println!(
                "the pipeline has not delivered the batch(es) yet; it keeps trying (see its log)"
            );
            return Ok(ExitCode::FAILURE);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// No pipeline is running: deliver the requested batches and release the
/// held ones, in seq order, until nothing more may leave.
async fn deliver_here(config: &Config, cp: &mut Checkpoint) -> Result<ExitCode> {
    let sink = Sink::new(&config.destination, config.delivery.request_timeout)?;
    let policy = RetryPolicy {
        max_attempts: config.delivery.max_attempts,
        backoff: config.delivery.backoff.clone(),
    };
    let mut delivered = 0;
    let mut failed = false;
    loop {
        let parked = cp.parked()?;
        let ready = parking::releasable(&parked);
        if ready.is_empty() {
            break;
        }
        for p in parked.into_iter().filter(|p| ready.contains(&p.first_seq)) {
            match put_with_retry(&sink, &p.key, Bytes::from(p.body.clone()), &policy).await {
                Ok(()) => {
                    sink.settle()?;
                    cp.unpark(p.first_seq)?;
                    delivered += 1;
                    println!("delivered {} (seqs {}-{})", p.key, p.first_seq, p.last_seq);
                }
                Err((e, attempts)) => {
                    let error = Report(&e).to_string();
                    println!("batch {} failed again: {error}", p.first_seq);
                    cp.park(&checkpoint::Parked {
                        status: ParkStatus::Parked,
                        attempts: p.attempts + attempts,
                        last_error: Some(error),
                        parked_at: chrono::Utc::now()
                            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                        ..p
                    })?;
                    failed = true;
                    // Later batches on its rows are blocked again; recompute.
                    break;
                }
            }
        }
    }
    let held = cp
        .parked()?
        .iter()
        .filter(|p| p.status == ParkStatus::Held)
        .count();
    println!("delivered {delivered} batch(es); {held} batch(es) still held");
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
