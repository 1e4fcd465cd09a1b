//! `waltail backfill`: shows the estimate, asks, records the request in the
//! local state, then follows it to the end with a progress bar. When no
//! pipeline runs, it runs the pipeline itself (streaming goes on as usual)
//! and stops it, flushed and confirmed, once the backfill is archived; when
//! one runs, that pipeline does the work and this command only watches.

use std::collections::BTreeMap;
use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::archive::key;
use crate::checkpoint::{Backfill, Checkpoint};
use crate::config::{Config, TableName};
use crate::pipeline::{self, RunOptions};
use crate::sink::Sink;
use crate::source::backfill::{
    Estimate, Mark, check_server, configured_table, connect, emit, ensure_watermark_table,
    estimate, plan, read_chunk,
};
use crate::source::catalog::TypeCatalog;
use crate::{Error, Result};

/// How often the state is read for progress and for the backfill's end:
/// the command sees the end at most this long after the state records it
/// (a read of a few rows of the state, cheap at this rate).
const POLL: Duration = Duration::from_millis(50);
/// Without a terminal, a progress line this often.
const LINE_EVERY: Duration = Duration::from_secs(10);
/// A running pipeline that has sampled no progress for this long is
/// probably gone.
const STALE_SECS: i64 = 30;
/// Rows read to time the estimate.
const SAMPLE_ROWS: u64 = 2000;

/// What `waltail backfill` was asked.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Tables as written on the command line; empty: every configured table.
    pub tables: Vec<String>,
    pub yes: bool,
    pub chunk_size: Option<u64>,
    pub cancel: bool,
}

pub(crate) async fn backfill(config: &Config, opts: Options) -> Result<ExitCode> {
    // As `run`: the pipeline may run here, so signals and telemetry too.
    let stop = super::stop_on_signals();
    super::serve_telemetry(config).await?;
    let mut state = Checkpoint::open(&config.state_file())?;
    if opts.cancel {
        return cancel(config, &mut state).await;
    }
    let active: Vec<Backfill> = state
        .backfills()?
        .into_iter()
        .filter(Backfill::is_active)
        .collect();
    // Without names, an unfinished backfill is resumed (after a crash or
    // Ctrl-C); the tables it already finished are not read again.
    let tables: Vec<TableName> = if opts.tables.is_empty() && !active.is_empty() {
        active
            .iter()
            .map(|b| TableName {
                schema: b.schema.clone(),
                name: b.table.clone(),
            })
            .collect()
    } else if opts.tables.is_empty() {
        config.source.tables.clone()
    } else {
        opts.tables
            .iter()
            .map(|t| configured_table(&config.source.tables, t))
            .collect::<Result<_>>()?
    };
    let client = connect(&config.source).await?;
    let mut catalog = TypeCatalog::new(Some(client));
    let mut ids = Vec::new();
    let mut new = Vec::new();
    for table in &tables {
        match active
            .iter()
            .find(|b| b.schema == table.schema && b.table == table.name)
        {
            Some(b) => {
                println!(
                    "{table}: resuming the backfill started {} ({} rows read so far)",
                    b.requested_at,
                    group(b.rows_read)
                );
                ids.push(b.id);
            }
            None => new.push(table.clone()),
        }
    }
    let chunk_size = opts.chunk_size.unwrap_or(config.backfill.chunk_size).max(1);
    if !new.is_empty() {
        let mut estimates = Vec::new();
        for table in &new {
            // Refuses tables without a usable key before anything is asked.
            let plan = plan(&mut catalog, table).await?;
            let client = catalog.client().expect("the catalog has a client");
            let size = estimate(client, table).await?;
            let started = Instant::now();
            let sample = read_chunk(client, &plan, None, None, SAMPLE_ROWS).await?;
            let read_rate = sample.rows.len() as f64 / started.elapsed().as_secs_f64().max(1e-6);
            let row_bytes = sample
                .rows
                .data_bytes()
                .checked_div(sample.rows.len())
                .unwrap_or(0)
                + ENVELOPE_BYTES;
            estimates.push(TableEstimate {
                table: table.clone(),
                size,
                read_rate,
                row_bytes,
                key_kind: plan.key_kind,
            });
        }
        let put = object_write_time(config, &estimates).await?;
        print_estimates(config, &estimates, put, chunk_size);
        if !opts.yes && !confirm()? {
            println!("nothing started");
            return Ok(ExitCode::SUCCESS);
        }
        for TableEstimate { table, size, .. } in &estimates {
            ids.push(state.request_backfill(&table.schema, &table.name, chunk_size, size.rows)?);
        }
    }
    drop(catalog);
    if ids.is_empty() {
        println!("no tables to backfill");
        return Ok(ExitCode::SUCCESS);
    }
    let started = Instant::now();
    let outcome = match pipeline::lock_pipeline(config)? {
        Some(lock) => {
            // No pipeline runs: run it here, and stop it once the backfill
            // is handed over (stopping flushes and confirms everything).
            drop(lock);
            println!(
                "running pipeline {} for the backfill (streaming goes on meanwhile)",
                config.pipeline
            );
            let run_opts = RunOptions::default();
            let run = pipeline::run(config, &run_opts, stop.subscribe());
            tokio::pin!(run);
            tokio::select! {
                ran = &mut run => {
                    // Stopped (a signal) or failed before the backfill ended.
                    ran?;
                    println!(
                        "interrupted; the backfill resumes from its last chunk on the next `waltail run` or `waltail backfill`"
                    );
                    return Ok(ExitCode::FAILURE);
                }
                watched = watch(config, ids.clone(), Some(stop)) => {
                    let watched = watched?;
                    run.await?;
                    watched
                }
            }
        }
        None => {
            println!(
                "pipeline {} is running: it does the backfill; this command follows it \
                 (Ctrl-C stops following, not the backfill)",
                config.pipeline
            );
            let mut interrupted = stop.subscribe();
            tokio::select! {
                watched = watch(config, ids.clone(), None) => watched?,
                _ = interrupted.changed() => {
                    println!("the backfill goes on in the running pipeline; `waltail status` shows its progress");
                    return Ok(ExitCode::SUCCESS);
                }
            }
        }
    };
    print_summary(&outcome, started.elapsed());
    Ok(if outcome.iter().all(|b| b.status == "done") {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Follows the backfills `ids` in the state until none is active; then, if
/// given `stop`, asks the pipeline to stop. Returns their final state.
async fn watch(
    config: &Config,
    ids: Vec<i64>,
    stop: Option<tokio::sync::watch::Sender<u32>>,
) -> Result<Vec<Backfill>> {
    let state = Checkpoint::open(&config.state_file())?;
    let read = |state: &Checkpoint| -> Result<Vec<Backfill>> {
        Ok(state
            .backfills()?
            .into_iter()
            .filter(|b| ids.contains(&b.id))
            .collect())
    };
    let terminal = std::io::stderr().is_terminal();
    let first = read(&state)?;
    let total: u64 = first.iter().map(|b| b.estimate.max(b.rows_read)).sum();
    let bar = ProgressBar::with_draw_target(
        Some(total),
        if terminal {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:24} [{bar:30}] {human_pos}/{human_len} rows  {per_sec}  ETA {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    let mut last_line = Instant::now();
    let mut warned = false;
    let finished = loop {
        let now = read(&state)?;
        let done: u64 = now.iter().map(|b| b.rows_read).sum();
        let total: u64 = now.iter().map(|b| b.estimate.max(b.rows_read)).sum();
        bar.set_length(total);
        bar.set_position(done);
        if let Some(current) = now.iter().find(|b| b.status == "running") {
            bar.set_message(format!("{}.{}", current.schema, current.table));
        }
        if !terminal && last_line.elapsed() >= LINE_EVERY {
            eprintln!("backfill: {} of ~{} rows", group(done), group(total));
            last_line = Instant::now();
        }
        if now.iter().all(|b| !b.is_active()) {
            break now;
        }
        // Following another process: say so if it seems to have stopped
        // (a running pipeline samples its progress every few seconds).
        if stop.is_none() && !warned {
            let sampled = state.progress()?.last().map(|p| p.at).unwrap_or(0);
            if chrono::Utc::now().timestamp() - sampled > STALE_SECS {
                bar.suspend(|| {
                    eprintln!(
                        "warning: pipeline {} has recorded no progress for {STALE_SECS} s; is `waltail run` still running? \
                         The backfill resumes from its last chunk when it runs again.",
                        config.pipeline
                    )
                });
                warned = true;
            }
        }
        tokio::time::sleep(POLL).await;
    };
    bar.finish_and_clear();
    if let Some(stop) = stop {
        stop.send_modify(|n| *n = (*n).max(1));
    }
    Ok(finished)
}

/// Cancels the active backfills, and closes a chunk window a stopped
/// backfill may have left open (it would hold the slot's position).
async fn cancel(config: &Config, state: &mut Checkpoint) -> Result<ExitCode> {
    let n = state.cancel_backfills()?;
    let client = connect(&config.source).await?;
    let server = check_server(&client).await?;
    ensure_watermark_table(&client, server, &config.source).await?;
    emit(
        &client,
        server,
        &config.pipeline,
        0,
        crate::source::backfill::CANCEL_CHUNK,
        Mark::Abort,
    )
    .await?;
    println!("cancelled {n} backfill(s)");
    Ok(ExitCode::SUCCESS)
}

/// What the estimate of one table is made of.
struct TableEstimate {
    table: TableName,
    size: Estimate,
    /// Rows per second read and rendered, measured on a sample.
    read_rate: f64,
    /// Average bytes of an envelope line, from the sample.
    row_bytes: usize,
    key_kind: &'static str,
}

/// Envelope bytes around `data` (op, table, seq, key, LSN): roughly.
const ENVELOPE_BYTES: usize = 150;

/// How long writing one batch-sized object takes on the destination: the
/// median of three writes of that size to the check key
/// (`[prefix/].waltail-check`, padding only: no row data goes there).
async fn object_write_time(config: &Config, estimates: &[TableEstimate]) -> Result<Duration> {
    let sink = Sink::new(&config.destination, config.delivery.request_timeout)?;
    let row_bytes = estimates.iter().map(|e| e.row_bytes).max().unwrap_or(0);
    let size = row_bytes * config.backfill.batch_size;
    let body = format!(
        "{{\"pipeline\":{},\"checked_at\":\"{}\",\"padding\":\"{}\"}}\n",
        serde_json::Value::from(config.pipeline.as_str()),
        chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        " ".repeat(size)
    );
    let key = key::check_key(sink.prefix());
    let mut times = Vec::new();
    for _ in 0..3 {
        let started = Instant::now();
        sink.put(&key, bytes::Bytes::from(body.clone()), "application/json")
            .await?;
        times.push(started.elapsed());
    }
    times.sort();
    Ok(times[1])
}

fn print_estimates(config: &Config, estimates: &[TableEstimate], put: Duration, chunk_size: u64) {
    println!(
        "{:<32} {:>14} {:>10} {:>12}  key",
        "table", "rows", "size", "expected"
    );
    let batch = config.backfill.batch_size.max(1) as f64;
    let in_flight = config.delivery.max_in_flight.max(1) as f64;
    let mut total_secs = 0.0;
    for TableEstimate {
        table,
        size: e,
        read_rate,
        key_kind: key,
        ..
    } in estimates
    {
        // Reading and writing overlap only in part: add them.
        let secs = e.rows as f64 / read_rate.max(1.0)
            + (e.rows as f64 / batch).ceil() * put.as_secs_f64() / in_flight;
        total_secs += secs;
        let rows = if e.exact {
            group(e.rows)
        } else {
            format!("~{}", group(e.rows))
        };
        println!(
            "{:<32} {:>14} {:>10} {:>12}  {key}",
            table.to_string(),
            rows,
            // A String: HumanBytes's Display ignores the column width.
            HumanBytes(e.bytes).to_string(),
            human_duration(secs)
        );
    }
    let read_rate = estimates
        .iter()
        .map(|e| e.read_rate)
        .fold(f64::MAX, f64::min);
    println!(
        "expected time {} (measured here: reading {} rows/s, one object of {} rows written in {:.1} ms); chunks of {} rows",
        human_duration(total_secs),
        group(read_rate as u64),
        group(batch as u64),
        put.as_secs_f64() * 1000.0,
        group(chunk_size)
    );
}

/// Asks on the terminal; refuses to guess without one.
fn confirm() -> Result<bool> {
    if !std::io::stdin().is_terminal() {
        return Err(Error::config(
            "backfill asks for confirmation, and there is no terminal to ask on; pass --yes to start without asking",
        ));
    }
    print!("start the backfill? [y/N] ");
    std::io::stdout()
        .flush()
        .map_err(|e| Error::io("writing to stdout", e))?;
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Error::io("reading the answer", e))?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}

fn print_summary(backfills: &[Backfill], took: Duration) {
    let mut by_status: BTreeMap<&str, usize> = BTreeMap::new();
    for b in backfills {
        *by_status.entry(b.status.as_str()).or_default() += 1;
        let changed = b.rows_read - b.rows_sent.min(b.rows_read);
        println!(
            "{}.{}: {} ({} rows read, {} archived as read events, {} skipped because they changed meanwhile and their change is archived)",
            b.schema,
            b.table,
            b.status,
            group(b.rows_read),
            group(b.rows_sent),
            group(changed)
        );
        if let Some(e) = &b.error {
            println!("  error: {e}");
        }
    }
    let rows: u64 = backfills.iter().map(|b| b.rows_read).sum();
    println!(
        "{} rows in {} ({}/s)",
        group(rows),
        human_duration(took.as_secs_f64()),
        group((rows as f64 / took.as_secs_f64().max(1e-3)) as u64)
    );
}

/// 1234567 -> "1,234,567".
fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn human_duration(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0 => "<1s".to_string(),
        1..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1000), "1,000");
        assert_eq!(group(1234567), "1,234,567");
        assert_eq!(human_duration(0.2), "<1s");
        assert_eq!(human_duration(75.0), "1m15s");
        assert_eq!(human_duration(7300.0), "2h01m");
    }
}
