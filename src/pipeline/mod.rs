//! Wires the stages together and keeps the guarantees that span them:
//!
//! ```text
//! source task --events--> sequencer + batcher --batches--> delivery --done--> checkpoint
//!      ^                                                                          |
//!      +------------- feedback task: confirm (L) to Postgres <---------------------+
//! ```
//!
//! - seq: the sequencer numbers changes from the cursor's `S`; the source has
//!   already skipped transactions committed before the cursor's `L`.
//! - confirmation: `L` moves to a transaction's commit end LSN only when every
//!   seq up to its last change is written; `(L, S)` is persisted before `L`
//!   is sent to the server. With nothing pending, a keepalive's `wal_end` is
//!   confirmed, so an idle publication does not hold WAL.
//! - backpressure: the pipeline stops taking events while a cut batch waits
//!   for an upload slot; the source then stops reading and Postgres keeps the
//!   WAL. The feedback task keeps answering the server meanwhile.
//! - session loss (Postgres restart, network): the session ends, the batches
//!   in hand are written, and a new session resumes from the persisted cursor.
//!
//! This file holds the core loop; [`session`] the pipeline's life around it
//! (lock, setup, sessions, reconnecting), [`confirm`] the confirmation
//! frontier, [`watermarks`] the backfill windows met in the stream.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};

use crate::Result;
use crate::archive::codec::Codec;
use crate::archive::envelope;
use crate::archive::{self, key};
use crate::batch::{Batch, Batcher, Cut, Intent};
use crate::checkpoint::{Checkpoint, Chunk, ChunkBody, Cursor, ParkStatus};
use crate::config::Config;
use crate::console::{Fate, JOURNAL};
use crate::delivery::parking::ParkingLot;
use crate::delivery::{Delivery, Outcome, RetryPolicy, Wait};
use crate::sink::Sink;
use crate::source::backfill::{
    self, CANCEL_CHUNK, Mark, Passed, Watermark, driver::Driver, window::Windows,
};
use crate::source::stream::{SourceEvent, TableSchema};
use crate::telemetry::{LagWatch, METRICS};

/// Cut batches that may wait per upload slot (`delivery.max_in_flight`).
/// Their intents are recorded together when the first of them starts, in
/// one transaction and one sync of the state: into a local folder, that
/// sync (it also writes out the objects' data before it) was the largest
/// cost per object, and with one batch waiting per slot it came every two
/// objects. The bytes waiting are capped too (see [`Pipeline::waiting_full`]).
const WAITING_PER_UPLOAD: usize = 4;
/// Events handled per turn of the pipeline's loop when they are queued.
const DRAIN_BURST: usize = 256;
/// How often the confirmed position is persisted and sent while changes flow.
const CONFIRM_INTERVAL: Duration = Duration::from_millis(100);
/// How often the state is checked for replay requests from `waltail parked replay`.
const REPLAY_POLL: Duration = Duration::from_millis(500);
/// How often progress (next seq, last object) is sampled for `waltail status`.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// Archived objects are logged one by one when they are at least this far
/// apart, else summarised, so a busy pipeline logs a line per interval.
const LOG_EVERY: Duration = Duration::from_secs(2);

/// Stop requests: the first asks for a graceful stop (flush, confirm, exit),
/// a second one for an immediate stop.
pub(crate) type Shutdown = watch::Receiver<u32>;

/// Options of `waltail run`.
#[derive(Debug, Clone, Default)]
pub(crate) struct RunOptions {
    /// Create a new slot when the recorded one has disappeared.
    pub recreate_slot: bool,
}

/// Why the pipeline loop ended without an error.
enum Ended {
    Shutdown,
    SourceClosed,
}

/// A committed transaction not yet confirmed.
#[derive(Debug, Clone, Copy)]
struct Pending {
    end_lsn: u64,
    /// Its last change's seq: the cursor's `S` is the next one.
    last_seq: u64,
    /// It may be confirmed once every seq up to here is written: its own
    /// last seq, or, for a backfill's low watermark, the last `read` event
    /// of its chunk (`u64::MAX` until the high watermark comes), so the
    /// stream brings the whole window again after a restart.
    until: u64,
}

#[derive(Default)]
struct Stats {
    changes: u64,
    objects: u64,
    bytes: u64,
    last_key: String,
    logged: Option<Instant>,
    since_log: u64,
    /// When progress was last sampled into the state.
    sampled: Option<Instant>,
}

impl Stats {
    /// Logs what was archived since the last line, at most every [`LOG_EVERY`].
    fn maybe_log(&mut self) {
        if self.since_log > 0 && self.logged.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            tracing::info!(
                changes = self.since_log,
                total_changes = self.changes,
                total_objects = self.objects,
                total_bytes = self.bytes,
                last = %self.last_key,
                "archived"
            );
            self.logged = Some(Instant::now());
            self.since_log = 0;
        }
    }
}

struct Pipeline<'a> {
    checkpoint: &'a mut Checkpoint,
    pipeline: String,
    /// `destination.compression`, for batches that have no codec yet.
    compression: Codec,
    /// Which rows new batches must not pass, and which parked-table
    /// batches may leave.
    parking: ParkingLot,
    /// The state's data version when last checked for replay requests.
    data_version: i64,
    /// The destination: its prefix for keys, and [`Sink::settle`] before
    /// each state commit (the uploads go through `delivery`, which holds
    /// its own handle).
    sink: Sink,
    delivery: Delivery,
    batcher: Batcher,
    /// The seq the next change gets.
    next_seq: u64,
    /// What is (or is about to be) persisted and confirmed.
    cursor: Cursor,
    dirty: bool,
    /// Written batches (by first seq) whose done mark is not persisted yet.
    done: Vec<u64>,
    frontier: Frontier,
    /// Committed transactions not yet confirmed, in commit order.
    txns: VecDeque<Pending>,
    open_txn: bool,
    /// Cut batches waiting for an upload slot, in seq order.
    waiting: VecDeque<Batch>,
    /// How many batches may wait ([`WAITING_PER_UPLOAD`] per upload slot).
    waiting_max: usize,
    /// The bytes of the waiting batches' bodies (less than
    /// `delivery.max_batch_bytes` wait before the last one joins, whatever
    /// the count).
    waiting_bytes: usize,
    /// `delivery.max_batch_bytes`.
    max_batch_bytes: usize,
    confirm: watch::Sender<u64>,
    stats: Stats,
    /// The backfill chunks whose watermarks are being passed, by lane (one
    /// per reader of `backfill.parallelism`; their windows overlap).
    windows: Windows,
    /// Chunk rows in the state can go once this LSN is confirmed.
    forget_at: Option<u64>,
    backfill: &'a mut Driver,
    chunks_done: &'a watch::Sender<Passed>,
    /// Warns when the slot lag passes `telemetry.slot_lag_warn_bytes`.
    lag: LagWatch,
}

impl<'a> Pipeline<'a> {
    /// The pipeline's core over the local state, the sink and the backfill
    /// driver, from `cursor` on with the batch `intents` recorded after it;
    /// `confirm` is told each LSN that may be confirmed to the server.
    /// Nothing here reads the source: [`Pipeline::run`] takes its events
    /// from a channel, so the core runs without Postgres in tests.
    #[allow(clippy::too_many_arguments)]
    fn new(
        config: &Config,
        checkpoint: &'a mut Checkpoint,
        sink: &Sink,
        cursor: Cursor,
        intents: Vec<Intent>,
        confirm: watch::Sender<u64>,
        backfill: &'a mut Driver,
        chunks_done: &'a watch::Sender<Passed>,
    ) -> Result<Pipeline<'a>> {
        let delivery = Delivery::new(
            sink.clone(),
            RetryPolicy {
                max_attempts: config.delivery.max_attempts,
                backoff: config.delivery.backoff.clone(),
            },
            config.delivery.max_in_flight,
            config.delivery.rate_limit,
        );
        let namespace = envelope::pipeline_namespace(&config.pipeline);
        let batcher = Batcher::new(
            config.delivery.batch_size,
            config.delivery.linger,
            namespace,
            intents,
        )
        .with_read_batch_size(config.backfill.batch_size)
        .with_max_bytes(config.delivery.max_batch_bytes);
        let parked = checkpoint.parked()?;
        if !parked.is_empty() {
            tracing::warn!(
                batches = parked
                    .iter()
                    .filter(|p| p.status != ParkStatus::Held)
                    .count(),
                held = parked
                    .iter()
                    .filter(|p| p.status == ParkStatus::Held)
                    .count(),
                "batches are parked; `waltail parked list` shows them, `waltail parked replay` delivers them"
            );
        }
        let data_version = checkpoint.data_version()?;
        checkpoint.forget_chunks(cursor.confirmed_lsn)?;
        checkpoint.sweep_chunk_files()?;
        backfill.poke(checkpoint)?;
        let mut pipeline = Pipeline {
            checkpoint,
            pipeline: config.pipeline.clone(),
            compression: config.compression,
            parking: ParkingLot::default(),
            data_version,
            sink: sink.clone(),
            delivery,
            batcher,
            next_seq: cursor.next_seq,
            cursor,
            dirty: false,
            done: Vec::new(),
            frontier: Frontier::new(cursor.next_seq - 1),
            txns: VecDeque::new(),
            open_txn: false,
            waiting: VecDeque::new(),
            waiting_max: config.delivery.max_in_flight.max(1) * WAITING_PER_UPLOAD,
            waiting_bytes: 0,
            max_batch_bytes: config.delivery.max_batch_bytes,
            confirm,
            stats: Stats::default(),
            windows: Windows::default(),
            forget_at: None,
            backfill,
            chunks_done,
            lag: LagWatch::new(config.slot_lag_warn_bytes, &config.source.slot),
        };
        pipeline.release()?;
        Ok(pipeline)
    }
}

impl Pipeline<'_> {
    async fn run(
        &mut self,
        mut rx: mpsc::Receiver<Vec<SourceEvent>>,
        mut shutdown: Shutdown,
    ) -> Result<Ended> {
        let mut confirm_tick = tokio::time::interval(CONFIRM_INTERVAL);
        confirm_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut replay_tick = tokio::time::interval(REPLAY_POLL);
        replay_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut stopping: Option<Ended> = None;
        let mut source_open = true;
        let mut shutdown_open = true;
        // The rest of the last batch from the source, taken a burst at a time.
        let mut inbox = Vec::new().into_iter();
        loop {
            let rate_wait = self.dispatch()?;
            if let Some(reason) = &stopping
                && self.waiting.is_empty()
                && self.delivery.is_idle()
            {
                self.persist()?;
                return Ok(match reason {
                    Ended::Shutdown => Ended::Shutdown,
                    Ended::SourceClosed => Ended::SourceClosed,
                });
            }
            // Batches cut while the uploads are busy wait (see
            // WAITING_PER_UPLOAD), so their intents share a sync.
            let accepting = stopping.is_none() && source_open && !self.waiting_full();
            let linger = self.batcher.deadline();
            tokio::select! {
                biased;
                changed = shutdown.changed(), if shutdown_open => {
                    if changed.is_err() {
                        // Nobody can ask us to stop any more.
                        shutdown_open = false;
                        continue;
                    }
                    let n = *shutdown.borrow_and_update();
                    if n >= 2 {
                        tracing::warn!("second stop request: stopping without waiting for uploads; they will be redone on the next start");
                        self.persist()?;
                        return Ok(Ended::Shutdown);
                    }
                    if stopping.is_none() {
                        tracing::info!("stopping: writing the batches in hand, then confirming");
                        stopping = Some(Ended::Shutdown);
                        self.parking.stop();
                        self.cut_partial()?;
                    }
                }
                Some(result) = self.delivery.next(), if !self.delivery.is_idle() => {
                    match result {
                        Ok(Outcome::Written { batch, bytes }) => self.written(batch, bytes)?,
                        Ok(Outcome::Failed { batch, attempts, error }) => self.failed(batch, attempts, error)?,
                        Err(e) => {
                            self.persist()?;
                            return Err(e);
                        }
                    }
                }
                _ = tokio::time::sleep_until(rate_wait.unwrap_or_else(far_future)), if rate_wait.is_some() => {}
                _ = tokio::time::sleep_until(linger.unwrap_or_else(far_future)), if linger.is_some() && stopping.is_none() => {
                    self.cut_partial()?;
                }
                _ = confirm_tick.tick() => {
                    self.persist()?;
                    self.stats.maybe_log();
                }
                _ = replay_tick.tick(), if stopping.is_none() => {
                    let version = self.checkpoint.data_version()?;
                    if version != self.data_version {
                        self.data_version = version;
                        self.release()?;
                        self.backfill.poke(self.checkpoint)?;
                    }
                }
                _ = std::future::ready(()), if accepting && inbox.len() > 0 => {
                    self.take_events(&mut inbox, &mut rx).await?;
                }
                batch = rx.recv(), if accepting && inbox.len() == 0 => match batch {
                    Some(batch) => {
                        inbox = batch.into_iter();
                        self.take_events(&mut inbox, &mut rx).await?;
                    }
                    None => {
                        source_open = false;
                        if stopping.is_none() {
                            stopping = Some(Ended::SourceClosed);
                            self.parking.stop();
                            self.cut_partial()?;
                        }
                    }
                },
            }
        }
    }

    /// Handles the events already received, up to [`DRAIN_BURST`] of them
    /// without another turn of the loop (the stop request and finished
    /// uploads are looked at between bursts), and fewer once cut batches
    /// wait for upload slots (backpressure).
    async fn take_events(
        &mut self,
        inbox: &mut std::vec::IntoIter<SourceEvent>,
        rx: &mut mpsc::Receiver<Vec<SourceEvent>>,
    ) -> Result<()> {
        let mut handled = 0;
        while handled < DRAIN_BURST && !self.waiting_full() {
            match inbox.next() {
                Some(event) => {
                    self.event(event).await?;
                    handled += 1;
                }
                None => match rx.try_recv() {
                    Ok(batch) => *inbox = batch.into_iter(),
                    Err(_) => break,
                },
            }
        }
        Ok(())
    }

    async fn event(&mut self, event: SourceEvent) -> Result<()> {
        match event {
            SourceEvent::Schema(record) => self.schema(record).await?,
            SourceEvent::Begin => self.open_txn = true,
            SourceEvent::Change(change) => {
                self.windows.observe(&change);
                self.push_change(&change)?;
            }
            SourceEvent::Watermark {
                content,
                commit_lsn,
                commit_ts,
            } => self.watermark(&content, commit_lsn, commit_ts).await?,
            SourceEvent::Commit { end_lsn } => {
                self.open_txn = false;
                let last_seq = self.next_seq - 1;
                let committed = self.windows.commit(end_lsn);
                // A low watermark's transaction is held until the chunk's
                // `read` events are written.
                let until = if committed.low { u64::MAX } else { last_seq };
                if let Some((lane, w)) = committed.completed {
                    // Recorded first: once the low watermark is released,
                    // the cursor may pass it, and a restart then finds the
                    // chunk done (see `watermark`).
                    let sent = w.sent.expect("a completed window");
                    self.checkpoint
                        .complete_chunk(w.chunk, end_lsn, sent, &w.skipped)?;
                    self.hold_low(w.low_end, last_seq);
                    self.report_chunk(lane, w.chunk);
                    self.forget_at = Some(end_lsn);
                }
                self.txns.push_back(Pending {
                    end_lsn,
                    last_seq,
                    until,
                });
                self.advance();
            }
            SourceEvent::Keepalive { wal_end } => {
                // Before its first confirmation a new pipeline's cursor is
                // 0, not the slot's start: measured from it, the lag would be
                // the server's whole WAL history.
                if self.cursor.confirmed_lsn > 0 {
                    let lag = wal_end.saturating_sub(self.cursor.confirmed_lsn);
                    METRICS.slot_lag_bytes.set(lag as i64);
                    self.lag.observe(lag);
                }
                let idle = !self.open_txn
                    && self.txns.is_empty()
                    && self.batcher.is_empty()
                    && self.waiting.is_empty()
                    && self.delivery.is_idle();
                if idle && wal_end > self.cursor.confirmed_lsn {
                    self.cursor = Cursor {
                        confirmed_lsn: wal_end,
                        next_seq: self.next_seq,
                    };
                    self.dirty = true;
                    self.persist()?;
                }
            }
        }
        Ok(())
    }

    /// Numbers a change and hands it to the batcher.
    fn push_change(&mut self, change: &envelope::Change) -> Result<()> {
        METRICS.changes_received.inc();
        let seq = self.next_seq;
        self.next_seq += 1;
        JOURNAL.captured(seq, change);
        match self.batcher.push(seq, change) {
            None => {}
            Some(Cut::Ready(batch)) => self.enqueue(batch)?,
            Some(Cut::AlreadyWritten {
                first_seq,
                last_seq,
            }) => {
                JOURNAL.settled(first_seq, last_seq, Fate::ArchivedBefore, None);
                self.frontier.mark(first_seq, last_seq);
                self.advance();
            }
        }
        Ok(())
    }

    /// Writes a table's schema record the first time this shape is seen, as
    /// `[prefix/]_schemas/<schema>.<table>/<n>.json`, before any change in
    /// that shape can be confirmed. Versions are numbered by first sight and
    /// recognised by content, so a restart rewrites the same key and bytes.
    async fn schema(&mut self, record: TableSchema) -> Result<()> {
        let table = &record.table.name;
        let fingerprint =
            uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, record.members.as_bytes()).to_string();
        if self
            .checkpoint
            .schema_version(table, &fingerprint)?
            .is_some()
        {
            return Ok(());
        }
        let version = self.checkpoint.next_schema_version(table)?;
        let body = archive::schema::body(&record.table, version, &record.members);
        let key = key::schema_key(self.sink.prefix(), table, version);
        self.delivery
            .put_now(&key, bytes::Bytes::from(body), "application/json")
            .await?;
        // Recorded, the schema is never written again: it must be durable.
        self.sink.settle()?;
        self.checkpoint
            .record_schema(table, version, &fingerprint)?;
        tracing::info!(%key, "recorded a table schema");
        Ok(())
    }

    /// Queues a cut batch; its intent is recorded before its PUT starts
    /// (see [`Pipeline::record_waiting`]).
    fn enqueue(&mut self, mut batch: Batch) -> Result<()> {
        let codec = *batch.codec.get_or_insert(self.compression);
        batch.key = key::batch_key(
            self.sink.prefix(),
            &self.pipeline,
            batch.commit_ts,
            batch.first_seq,
            batch.last_seq,
            codec,
        );
        batch.body = codec.encode(std::mem::take(&mut batch.body))?;
        self.waiting_bytes += batch.body.len();
        self.waiting.push_back(batch);
        Ok(())
    }

    /// Records the intents of every waiting batch not recorded yet, in one
    /// transaction: one sync to disk covers all the batches cut while the
    /// uploads were busy, instead of one per batch. Recorded intents stay a
    /// prefix of the cut batches (waiting is in seq order), so a restart
    /// re-forms them and batches anew after the last.
    fn record_waiting(&mut self) -> Result<()> {
        let ranges: Vec<(u64, u64, Codec)> = self
            .waiting
            .iter()
            .filter(|b| !b.recorded)
            .map(|b| (b.first_seq, b.last_seq, b.codec.unwrap_or(self.compression)))
            .collect();
        self.checkpoint.record_intents(&ranges)?;
        for b in self.waiting.iter_mut() {
            b.recorded = true;
        }
        Ok(())
    }

    /// Whether cut batches wait in such number or size that no more events
    /// are taken (backpressure to the source).
    fn waiting_full(&self) -> bool {
        self.waiting.len() >= self.waiting_max || self.waiting_bytes >= self.max_batch_bytes
    }

    fn pop_waiting(&mut self) -> Batch {
        let batch = self.waiting.pop_front().expect("a waiting batch");
        self.waiting_bytes -= batch.body.len();
        batch
    }

    fn cut_partial(&mut self) -> Result<()> {
        match self.batcher.take() {
            Some(batch) => self.enqueue(batch),
            None => Ok(()),
        }
    }

    /// Starts the batches that may start: released parked batches first,
    /// then new ones; a new batch touching a parked or held row is held
    /// behind it instead. Returns when the rate limit next allows a batch,
    /// if that is what holds them.
    fn dispatch(&mut self) -> Result<Option<Instant>> {
        while let Some(batch) = self.parking.next() {
            match self.delivery.can_start(batch) {
                Ok(()) => {
                    let batch = self.parking.take().expect("next exists");
                    self.delivery.start(batch);
                }
                Err(Wait::Busy) => break,
                Err(Wait::Until(t)) => return Ok(Some(t)),
            }
        }
        while let Some(batch) = self.waiting.front() {
            if self.parking.blocks(batch) {
                let batch = self.pop_waiting();
                self.hold(batch)?;
                continue;
            }
            match self.delivery.can_start(batch) {
                Ok(()) => {
                    if !batch.recorded {
                        self.record_waiting()?;
                    }
                    let batch = self.pop_waiting();
                    self.delivery.start(batch);
                }
                Err(Wait::Busy) => return Ok(None),
                Err(Wait::Until(t)) => return Ok(Some(t)),
            }
        }
        Ok(None)
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}

#[cfg(test)]
mod component_tests;
mod confirm;
mod session;
mod watermarks;

use self::confirm::Frontier;
pub(crate) use self::session::{lock_pipeline, run};
