//! The backfill task: runs inside the pipeline process (`waltail run`, or
//! `waltail backfill` when no pipeline runs), beside the stream. A table's
//! key space is split into ranges (see [`super::split`]) that
//! `backfill.parallelism` readers (lanes) take one after another, each on
//! its own connection, reading its range chunk after chunk between its own
//! watermarks. Requests come through the local state, so a `waltail
//! backfill` in another process reaches a running pipeline.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use super::handoff::Handoff;
use super::{
    Mark, Passed, Plans, Server, check_server, connect, emit, ensure_watermark_table, in_progress,
    plan, read_chunk, sessions_of, split, still_in_progress,
};
use crate::backoff::Backoff;
use crate::checkpoint::{Backfill, Checkpoint, KeyRange};
use crate::config::{Config, TableName};
use crate::error::{Disposition, Report};
use crate::source::catalog::TypeCatalog;
use crate::{Error, Result};

/// Waits between attempts after a connection problem: from 1 s doubling to 30 s.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// Ranges per reader: a reader done with a short range takes another, so
/// uneven ranges (the statistics are an estimate) still keep every reader
/// busy to the end.
const RANGES_PER_READER: usize = 4;

/// Starts and stops the backfill task. The pipeline reports each chunk it
/// has handed over on `passed`.
pub(crate) struct Driver {
    config: Arc<Config>,
    pipeline: ToPipeline,
    task: Option<JoinHandle<()>>,
}

/// What the readers share with the pipeline: the chunks it has passed, and
/// where they hand it their chunks' rows.
#[derive(Clone)]
struct ToPipeline {
    passed: watch::Receiver<Passed>,
    handoff: Handoff,
}

impl Driver {
    pub(crate) fn new(config: &Config, passed: watch::Receiver<Passed>) -> Self {
        Driver {
            config: Arc::new(config.clone()),
            pipeline: ToPipeline {
                passed,
                // Every lane's chunks that may wait for the pipeline at once.
                handoff: Handoff::new(config.backfill.parallelism * LOOKAHEAD),
            },
            task: None,
        }
    }

    /// Where the readers hand their chunks' rows to the pipeline.
    pub(crate) fn handoff(&self) -> &Handoff {
        &self.pipeline.handoff
    }

    /// Starts the task if a backfill is waiting and the task is not running.
    pub(crate) fn poke(&mut self, state: &Checkpoint) -> Result<()> {
        if self.task.as_ref().is_some_and(|t| !t.is_finished()) {
            return Ok(());
        }
        if state.next_backfill()?.is_none() {
            return Ok(());
        }
        self.task = Some(tokio::spawn(run(
            self.config.clone(),
            self.pipeline.clone(),
        )));
        Ok(())
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Works through the waiting backfills; retries connection problems.
async fn run(config: Arc<Config>, pipeline: ToPipeline) {
    let mut wait = Backoff::new(RETRY_MIN, RETRY_MAX);
    loop {
        match work(&config, &pipeline).await {
            Ok(()) => return,
            Err(e) if e.disposition() == Disposition::Retry => {
                tracing::warn!(error = %Report(&e), retry_in = ?wait.wait(), "backfill interrupted; retrying");
                tokio::time::sleep(wait.wait()).await;
                wait.grow();
            }
            Err(e) => {
                tracing::error!(error = %Report(&e), "backfill stopped");
                if let Some(hint) = e.hint() {
                    tracing::error!("fix: {hint}");
                }
                return;
            }
        }
    }
}

async fn work(config: &Arc<Config>, pipeline: &ToPipeline) -> Result<()> {
    let mut state = Checkpoint::open(&config.state_file())?;
    let client = connect(&config.source).await?;
    let server = check_server(&client).await?;
    ensure_watermark_table(&client, server, &config.source).await?;
    let mut catalog = TypeCatalog::new(Some(client));
    while let Some(backfill) = state.next_backfill()? {
        let table = TableName {
            schema: backfill.schema.clone(),
            name: backfill.table.clone(),
        };
        let started = async {
            let plan = plan(&mut catalog, &table).await?;
            let client = catalog.client().expect("the catalog has a client");
            // Chunks left by a previous run may have their high watermarks
            // still on the way through the stream: were they read again now,
            // their rows would be emitted twice. An abort marker after each
            // lets the pipeline pass them (completing those whose high
            // watermark came) before any reader starts.
            let unfinished = state.unfinished_chunks(backfill.id)?;
            for &(chunk, lane) in &unfinished {
                emit(client, server, &config.pipeline, lane, chunk, Mark::Abort).await?;
            }
            for &(chunk, lane) in &unfinished {
                if pipeline
                    .passed
                    .clone()
                    .wait_for(|p| p.get(lane) >= chunk)
                    .await
                    .is_err()
                {
                    return Ok(None); // the pipeline is gone
                }
            }
            let Some(backfill) = state.backfill(backfill.id)? else {
                return Ok(None);
            };
            if state.ranges(backfill.id)?.is_empty() {
                // A backfill begun before ranges existed goes on as one walk
                // from where it is.
                let ranges = if backfill.last_key.is_some() || backfill.rows_read > 0 {
                    vec![(None, None)]
                } else {
                    split(
                        client,
                        &plan,
                        config.backfill.parallelism * RANGES_PER_READER,
                    )
                    .await?
                };
                state.add_ranges(backfill.id, &ranges, backfill.last_key.as_deref())?;
            }
            let ranges = state.ranges(backfill.id)?;
            if backfill.status == "pending" {
                state.set_backfill_status(backfill.id, "running", None)?;
                tracing::info!(
                    table = %table,
                    key = plan.key_kind,
                    chunk_size = backfill.chunk_size,
                    ranges = ranges.len(),
                    readers = config.backfill.parallelism.min(ranges.len()),
                    "backfill started"
                );
            } else {
                tracing::info!(table = %table, rows_read = backfill.rows_read, "backfill resumed");
            }
            Ok::<_, Error>(Some(ranges))
        }
        .await;
        let result = match started {
            Ok(Some(ranges)) => {
                read_ranges(config, server, &table, &backfill, ranges, pipeline).await
            }
            Ok(None) => return Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            fail_unless_retry(&mut state, &backfill, e)?;
        }
    }
    Ok(())
}

/// Marks the backfill failed for an error no retry fixes; hands retryable
/// ones back to [`run`].
fn fail_unless_retry(state: &mut Checkpoint, backfill: &Backfill, e: Error) -> Result<()> {
    if e.disposition() == Disposition::Retry {
        return Err(e);
    }
    let mut message = Report(&e).to_string();
    if let Some(hint) = e.hint() {
        message.push_str(&format!(" (fix: {hint})"));
    }
    tracing::error!(table = %format!("{}.{}", backfill.schema, backfill.table), error = %message, "backfill failed");
    state.set_backfill_status(backfill.id, "failed", Some(&message))
}

/// Reads the ranges not done yet with up to `backfill.parallelism` lanes at
/// once; returns when every lane has had its chunks passed by the pipeline,
/// or at the first error (the other lanes stop; their open chunks are
/// aborted when the task starts again).
async fn read_ranges(
    config: &Arc<Config>,
    server: Server,
    table: &TableName,
    backfill: &Backfill,
    ranges: Vec<KeyRange>,
    pipeline: &ToPipeline,
) -> Result<()> {
    let queue: VecDeque<KeyRange> = ranges.into_iter().filter(|r| !r.done).collect();
    let lanes = config.backfill.parallelism.min(queue.len()).max(1);
    let queue = Arc::new(Mutex::new(queue));
    let mut set = JoinSet::new();
    for lane in 0..lanes {
        set.spawn(read_lane(
            config.clone(),
            server,
            table.clone(),
            backfill.id,
            lane as u32,
            queue.clone(),
            pipeline.clone(),
        ));
    }
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(e) => {
                return Err(Error::fatal(
                    format!("a backfill reader of {table} stopped: {e}"),
                    "see the log above; `waltail backfill` resumes it",
                ));
            }
        }
    }
    Ok(())
}

/// One lane: its own connection and state handle; takes ranges from
/// `queue` until none is left, then waits until the pipeline has passed its
/// chunks.
async fn read_lane(
    config: Arc<Config>,
    server: Server,
    table: TableName,
    id: i64,
    lane: u32,
    queue: Arc<Mutex<VecDeque<KeyRange>>>,
    mut pipeline: ToPipeline,
) -> Result<()> {
    let mut state = Checkpoint::open(&config.state_file())?;
    let client = connect(&config.source).await?;
    let mut catalog = TypeCatalog::new(Some(client));
    let mut lane = Lane {
        config: &config,
        server,
        table: &table,
        id,
        lane,
        ahead: VecDeque::new(),
        pipeline: &mut pipeline,
        plans: Plans::default(),
    };
    loop {
        let range = queue.lock().expect("not poisoned").pop_front();
        let Some(range) = range else { break };
        if !lane.range(&mut state, &mut catalog, range).await? {
            return Ok(());
        }
    }
    // Done once the pipeline has passed this lane's last chunks.
    while let Some(oldest) = lane.ahead.pop_front() {
        if lane
            .pipeline
            .passed
            .wait_for(|p| p.get(lane.lane) >= oldest)
            .await
            .is_err()
        {
            return Ok(());
        }
    }
    Ok(())
}

/// What became of a chunk between its watermarks.
enum Chunk {
    Read(super::ChunkRows),
    Cancelled,
    /// Transactions in progress at its low watermark went on too long.
    Busy(Vec<String>),
}

/// Chunks read, stored and watermarked ahead of the pipeline, per lane:
/// reading the next chunk overlaps with archiving the last one. Their rows
/// wait in their files and, handed over, in memory (see [`Handoff`]).
const LOOKAHEAD: usize = 2;

/// A reader of key ranges, one chunk at a time.
struct Lane<'a> {
    config: &'a Config,
    server: Server,
    table: &'a TableName,
    id: i64,
    lane: u32,
    /// Its chunks handed over and not yet passed by the pipeline.
    ahead: VecDeque<i64>,
    pipeline: &'a mut ToPipeline,
    plans: Plans,
}

impl Lane<'_> {
    /// Reads, stores and hands over the chunks of one range until it is
    /// done; false if the backfill was cancelled or the pipeline is gone
    /// (the next start resumes from the state).
    async fn range(
        &mut self,
        state: &mut Checkpoint,
        catalog: &mut TypeCatalog,
        range: KeyRange,
    ) -> Result<bool> {
        let (config, server, table, id, lane) =
            (self.config, self.server, self.table, self.id, self.lane);
        let mut after = range.last_key.clone().or(range.lo.clone());
        loop {
            let Some(backfill) = state.backfill(id)?.filter(Backfill::is_active) else {
                return Ok(false); // cancelled
            };
            let cycle = std::time::Instant::now();
            while self.ahead.len() >= LOOKAHEAD {
                let oldest = self.ahead.pop_front().expect("not empty");
                if self
                    .pipeline
                    .passed
                    .wait_for(|p| p.get(lane) >= oldest)
                    .await
                    .is_err()
                {
                    return Ok(false);
                }
            }
            let waited = cycle.elapsed();
            // Planned for every chunk: a column added or dropped meanwhile is
            // read (and recorded in the chunk's schema) as it now is.
            let plan = self.plans.get(catalog, table).await?;
            let client = catalog.client().expect("the catalog has a client");
            let chunk = state.new_chunk(id, range.id, lane)?;
            let started = std::time::Instant::now();
            let planned = started - cycle - waited;
            let mut stored_in = Duration::ZERO;
            let mut copied_in = Duration::ZERO;
            emit(client, server, &config.pipeline, lane, chunk, Mark::Low).await?;
            let mut read_took = Duration::ZERO;
            let read = async {
                let xids = in_progress(client, server).await?;
                match wait_for(client, server, state, table, id, xids, Some(WINDOW_WAIT)).await? {
                    Waited::Ended => {}
                    Waited::Cancelled => return Ok(Chunk::Cancelled),
                    Waited::TimedOut(xids) => return Ok(Chunk::Busy(xids)),
                }
                let copying = std::time::Instant::now();
                let rows = read_chunk(
                    client,
                    &plan,
                    after.as_deref(),
                    range.hi.as_deref(),
                    backfill.chunk_size,
                )
                .await?;
                copied_in = copying.elapsed();
                read_took = started.elapsed();
                let storing = std::time::Instant::now();
                state.store_chunk(
                    chunk,
                    &rows.rows,
                    rows.last_key.as_deref(),
                    rows.is_last,
                    &plan.members,
                )?;
                stored_in = storing.elapsed();
                Ok::<_, Error>(Chunk::Read(rows))
            }
            .await;
            let mut rows = match read {
                Ok(Chunk::Read(rows)) => rows,
                Ok(Chunk::Cancelled) => {
                    emit(client, server, &config.pipeline, lane, chunk, Mark::Abort).await?;
                    return Ok(false);
                }
                Ok(Chunk::Busy(xids)) => {
                    // The window closed, so the slot is not held at its low
                    // watermark while the wait goes on; then a new chunk reads
                    // from the same key.
                    emit(client, server, &config.pipeline, lane, chunk, Mark::Abort).await?;
                    tracing::info!(
                        table = %table,
                        chunk,
                        "a backfill chunk gave up its window after {WINDOW_WAIT:?} of waiting for transactions in progress; it starts again once they have ended"
                    );
                    let waited = wait_for(client, server, state, table, id, xids, None).await?;
                    if matches!(waited, Waited::Cancelled) {
                        return Ok(false);
                    }
                    continue;
                }
                Err(e) => {
                    // Closes the window now rather than at the next chunk, so
                    // the slot is not held at the low watermark meanwhile.
                    let _ = emit(client, server, &config.pipeline, lane, chunk, Mark::Abort).await;
                    return Err(e);
                }
            };
            let count = rows.rows.len();
            self.pipeline
                .handoff
                .give(chunk, Arc::new(std::mem::take(&mut rows.rows)));
            emit(client, server, &config.pipeline, lane, chunk, Mark::High).await?;
            tracing::debug!(
                chunk,
                lane,
                rows = count,
                waited = ?waited,
                planned = ?planned,
                read = ?read_took,
                copied = ?copied_in,
                stored = ?stored_in,
                took = ?started.elapsed(),
                "backfill chunk read and stored"
            );
            self.ahead.push_back(chunk);
            if rows.is_last {
                return Ok(true);
            }
            if rows.last_key.is_some() {
                after = rows.last_key;
            }
        }
    }
}

/// Polls for the end of the transactions of [`in_progress`] from every 1 ms
/// up to every [`POLL_MAX`]; says which sessions it waits for after
/// [`TELL_AFTER`], and again every [`TELL_EVERY`].
const POLL_MAX: Duration = Duration::from_millis(50);
const TELL_AFTER: Duration = Duration::from_secs(2);
const TELL_EVERY: Duration = Duration::from_secs(60);
/// How long a chunk waits with its window open: the slot is held at the low
/// watermark meanwhile, so a longer wait (a long-running write, a prepared
/// transaction, a synchronous standby that does not answer) goes on with
/// the window closed and the chunk starts again afterwards.
const WINDOW_WAIT: Duration = Duration::from_secs(10);

/// What a wait for the transactions in progress came to.
enum Waited {
    Ended,
    Cancelled,
    /// Some were still in progress after the time allowed.
    TimedOut(Vec<String>),
}

/// Waits until none of `xids` (from [`in_progress`]) can hold a commit the
/// stream has and a chunk's snapshot would not see, at most `limit`; stops
/// if the backfill is cancelled meanwhile.
async fn wait_for(
    client: &tokio_postgres::Client,
    server: Server,
    state: &mut Checkpoint,
    table: &TableName,
    id: i64,
    mut xids: Vec<String>,
    limit: Option<Duration>,
) -> Result<Waited> {
    let started = std::time::Instant::now();
    let mut told: Option<std::time::Instant> = None;
    let mut pause = Backoff::new(Duration::from_millis(1), POLL_MAX);
    loop {
        xids = still_in_progress(client, server, &xids).await?;
        if xids.is_empty() {
            return Ok(Waited::Ended);
        }
        if limit.is_some_and(|l| started.elapsed() >= l) {
            return Ok(Waited::TimedOut(xids));
        }
        if started.elapsed() >= TELL_AFTER {
            if !state.backfill(id)?.is_some_and(|b| b.is_active()) {
                return Ok(Waited::Cancelled);
            }
            if told.is_none_or(|t| t.elapsed() >= TELL_EVERY) {
                let n = xids.len();
                // Only for the log: a failure to look them up is said, not fatal.
                let sessions = sessions_of(client, &xids)
                    .await
                    .unwrap_or_else(|e| format!("not known ({})", Report(&e)));
                tracing::warn!(
                    table = %table,
                    waiting = ?started.elapsed(),
                    %sessions,
                    "the next backfill chunk waits for {n} transaction{} in progress when it began to end: \
                     one may have committed changes the stream already has but a read would not yet see",
                    if n == 1 { "" } else { "s" }
                );
                told = Some(std::time::Instant::now());
            }
        }
        tokio::time::sleep(pause.wait()).await;
        pause.grow();
    }
}
