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

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::{Instant, MissedTickBehavior};

use crate::archive::codec::Codec;
use crate::archive::envelope;
use crate::archive::{self, key};
use crate::backoff::Backoff;
use crate::batch::{Batch, Batcher, Cut, Intent};
use crate::checkpoint::{Checkpoint, Chunk, Cursor, ParkStatus, Parked, Progress};
use crate::config::Config;
use crate::console::{Fate, JOURNAL};
use crate::delivery::parking::ParkingLot;
use crate::delivery::{Delivery, Outcome, RetryPolicy, Wait};
use crate::error::Disposition;
use crate::error::ErrorKind;
use crate::lsn;
use crate::pgtime;
use crate::sink::Sink;
use crate::source::backfill::{
    self, CANCEL_CHUNK, Mark, Passed, Watermark, driver::Driver, window::Windows,
};
use crate::source::catalog::TypeCatalog;
use crate::source::replication::{FeedbackSender, ReplicationConnection};
use crate::source::stream::{self, Decoder, SourceEvent, TableSchema};
use crate::source::{self, setup};
use crate::sql::quote_ident;
use crate::telemetry::{LagWatch, METRICS};
use crate::{Error, Result};

/// Event batches buffered between the source and the pipeline (of at most
/// [`stream::EVENT_BATCH`] events each, so about 4,096 events). Small:
/// backpressure should reach Postgres quickly, and each event holds a
/// rendered row.
const EVENT_CHANNEL: usize = 16;
/// Status updates go out at least this often even while the pipeline is
/// blocked, and at least three times per wal_sender_timeout (see
/// [`status_interval`]), so the server never drops us as unresponsive.
const STATUS_INTERVAL: Duration = Duration::from_secs(10);
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
/// Reconnect waits: from 1 s doubling to 30 s.
const RECONNECT_MIN: Duration = Duration::from_secs(1);
const RECONNECT_MAX: Duration = Duration::from_secs(30);

/// Stop requests: the first asks for a graceful stop (flush, confirm, exit),
/// a second one for an immediate stop.
pub(crate) type Shutdown = watch::Receiver<u32>;

/// Options of `waltail run`.
#[derive(Debug, Clone, Default)]
pub(crate) struct RunOptions {
    /// Create a new slot when the recorded one has disappeared.
    pub recreate_slot: bool,
}

const META_SLOT: &str = "slot";

/// Streams until asked to stop (Ok) or until an error no retry can fix.
pub(crate) async fn run(config: &Config, opts: &RunOptions, mut shutdown: Shutdown) -> Result<()> {
    let mut checkpoint = Checkpoint::open(&config.state_file())?;
    let _lock = lock_pipeline(config)?.ok_or_else(|| {
        Error::fatal(
            format!(
                "pipeline {} is already running (its state {} is locked)",
                config.pipeline,
                config.state_file().display()
            ),
            "stop the other `waltail run` of this pipeline first; one pipeline has one reader",
        )
        .with_kind(ErrorKind::Locked)
    })?;
    let sink = Sink::new(&config.destination, config.delivery.request_timeout)?;
    // The pipeline reports each backfill chunk it has handed over; the
    // backfill task (spanning sessions) waits on it.
    let (chunks_done, chunks_done_rx) = watch::channel(Passed::default());
    let mut backfill = Driver::new(config, chunks_done_rx);
    let mut wait = Backoff::new(RECONNECT_MIN, RECONNECT_MAX);
    let mut set_up = false;
    loop {
        let started = Instant::now();
        let result = async {
            if !set_up {
                prepare(config, opts, &mut checkpoint).await?;
                set_up = true;
            }
            session(
                config,
                &mut checkpoint,
                &sink,
                shutdown.clone(),
                &mut backfill,
                &chunks_done,
            )
            .await
        }
        .await;
        match result {
            Ok(()) => return Ok(()),
            Err(e) if e.disposition() == Disposition::Retry && *shutdown.borrow() == 0 => {
                if started.elapsed() > RECONNECT_MAX * 2 {
                    wait.reset();
                }
                tracing::warn!(error = %crate::error::Report(&e), retry_in = ?wait.wait(), "source connection lost; reconnecting");
                tokio::select! {
                    _ = tokio::time::sleep(wait.wait()) => {}
                    _ = shutdown.changed() => return Ok(()),
                }
                wait.grow();
            }
            Err(e) => return Err(e),
        }
    }
}

/// Takes the pipeline's lock file (`<state_dir>/<pipeline>.lock`), held while
/// `run` runs: `None` when another process holds it. `parked replay` uses it
/// to know whether to deliver itself or ask the running pipeline.
pub(crate) fn lock_pipeline(config: &Config) -> Result<Option<std::fs::File>> {
    let path = config.state_dir.join(format!("{}.lock", config.pipeline));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(Error::io(format!("cannot lock {}", path.display()), e))
        }
    }
}

/// Creates the publication and slot if missing, and refuses to go on when the
/// local state and the slot disagree (either would renumber changes and
/// overwrite archived objects).
async fn prepare(config: &Config, opts: &RunOptions, checkpoint: &mut Checkpoint) -> Result<()> {
    let client = source::connect_sql(&config.source).await?;
    setup::ensure_publication(&client, &config.source).await?;
    let exists = setup::slot_exists(&client, &config.source).await?;
    let cursor = checkpoint.cursor()?;
    let recorded = checkpoint.meta(META_SLOT)?;
    let slot = &config.source.slot;
    if exists && recorded.as_deref() != Some(slot.as_str()) {
        return Err(Error::fatal(
            format!(
                "replication slot {slot} exists, but the local state {} has no record of it",
                config.state_file().display()
            ),
            "restore the state_dir this pipeline ran with; if the slot belongs to another pipeline, set source.slot; \
             to start this pipeline afresh, drop the slot (SELECT pg_drop_replication_slot('<slot>');) and use a new pipeline name or prefix, \
             since seq numbering would restart at 1",
        )
        .with_kind(ErrorKind::SlotLost));
    }
    if !exists {
        if let Some(c) = cursor {
            if !opts.recreate_slot {
                return Err(Error::fatal(
                    format!(
                        "replication slot {slot} has disappeared (dropped or invalidated); changes committed after {} were not captured",
                        lsn::format(c.confirmed_lsn)
                    ),
                    "run `waltail run --recreate-slot` to create a new slot and continue numbering from seq \
                     where the archive stopped, then `waltail backfill` to capture the current rows",
                )
                .with_kind(ErrorKind::SlotLost));
            }
            tracing::warn!(slot = %slot, seq = c.next_seq, "recreating the replication slot; changes since the old slot was lost are not in the archive");
        }
        setup::create_slot(&client, &config.source).await?;
        checkpoint.set_meta(META_SLOT, slot)?;
    }
    Ok(())
}

/// One replication session, from connect to stop or loss.
async fn session(
    config: &Config,
    checkpoint: &mut Checkpoint,
    sink: &Sink,
    shutdown: Shutdown,
    backfill: &mut Driver,
    chunks_done: &watch::Sender<Passed>,
) -> Result<()> {
    let cursor = checkpoint.cursor()?.unwrap_or(Cursor {
        confirmed_lsn: 0,
        next_seq: 1,
    });
    let intents = checkpoint.open_intents(cursor.next_seq)?;
    let pg = source::pg_config(&config.source);
    let mut conn = ReplicationConnection::connect(&pg, &format!("waltail {}", config.pipeline))
        .await
        .map_err(|e| Error::replication("opening the replication connection", e))?;
    let status_every = status_interval(&mut conn).await?;
    let publications = quote_ident(&config.source.publication);
    // Protocol 2 (14+) streams large transactions while they are in progress,
    // so the server does not spill them to its own disk first.
    let major: u32 = conn
        .server_version()
        .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // Logical messages (backfill watermarks) reach pgoutput from 14 on too.
    let options: Vec<(&str, &str)> = if major >= 14 {
        vec![
            ("proto_version", "2"),
            ("streaming", "on"),
            ("messages", "true"),
            ("publication_names", &publications),
        ]
    } else {
        vec![("proto_version", "1"), ("publication_names", &publications)]
    };
    // Earlier builds spilled into a SQLite file; it holds nothing a
    // session needs (the server streams open transactions again).
    let _ = std::fs::remove_file(
        config
            .state_dir
            .join(format!("{}.spill.sqlite", config.pipeline)),
    );
    let decoder = Decoder::new(
        cursor.confirmed_lsn,
        &config.state_dir.join(format!("{}.spill", config.pipeline)),
    )?;
    let (stream, feedback) = conn
        .start_replication(&config.source.slot, cursor.confirmed_lsn, &options)
        .await
        .map_err(|e| Error::replication("starting replication", e))?;
    // Ready from here: the "streaming" line below is what operators (and
    // the tests) wait for.
    let _ready = ReadyWhileStreaming::new();
    tracing::info!(
        slot = %config.source.slot,
        from = %lsn::format(cursor.confirmed_lsn),
        next_seq = cursor.next_seq,
        pending_batches = intents.iter().filter(|i| !i.done).count(),
        destination = %sink.describe(),
        "streaming"
    );

    let (tx, rx) = mpsc::channel(EVENT_CHANNEL);
    let reply = Arc::new(Notify::new());
    let (confirm_tx, confirm_rx) = watch::channel(cursor.confirmed_lsn);
    let (stop_feedback, feedback_stopped) = oneshot::channel();
    // Column types are looked up on their own SQL connection; without one
    // (e.g. a permission problem) values still render by built-in rules.
    let catalog = match source::connect_sql(&config.source).await {
        Ok(client) => TypeCatalog::new(Some(client)),
        Err(e) => {
            tracing::warn!(error = %crate::error::Report(&e), "cannot open a catalog connection; user-defined types render as text");
            TypeCatalog::new(None)
        }
    };
    let mut source_task = tokio::spawn(stream::run(stream, decoder, catalog, tx, reply.clone()));
    let feedback_task = tokio::spawn(feedback_loop(
        feedback,
        confirm_rx,
        reply,
        feedback_stopped,
        status_every,
    ));

    let mut pipeline = Pipeline::new(
        config,
        checkpoint,
        sink,
        cursor,
        intents,
        confirm_tx,
        backfill,
        chunks_done,
    )?;
    let ended = pipeline.run(rx, shutdown).await;
    let _ = stop_feedback.send(());
    let feedback_result = feedback_task.await;
    match ended? {
        Ended::Shutdown => {
            source_task.abort();
            if let Ok(Err(e)) = feedback_result {
                tracing::warn!(error = %crate::error::Report(&e), "could not send the final confirmation; it is persisted and will be sent on the next start");
            }
            tracing::info!(
                confirmed = %lsn::format(pipeline.cursor.confirmed_lsn),
                next_seq = pipeline.cursor.next_seq,
                "stopped"
            );
            Ok(())
        }
        Ended::SourceClosed => match (&mut source_task).await {
            Ok(Err(e)) => Err(e),
            _ => Err(Error::replication(
                "reading the replication stream",
                crate::error::ReplicationError::Closed,
            )),
        },
    }
}

/// `/readyz` answers 200 while this lives (one per streaming session,
/// whichever way the session ends).
struct ReadyWhileStreaming;

impl ReadyWhileStreaming {
    fn new() -> Self {
        METRICS.ready.set(1);
        ReadyWhileStreaming
    }
}

impl Drop for ReadyWhileStreaming {
    fn drop(&mut self) {
        METRICS.ready.set(0);
    }
}

/// Sends standby status updates: when the confirmed position moves, when the
/// server asks, and every [`STATUS_INTERVAL`] regardless, so the walsender
/// never times out while the pipeline is blocked on a slow destination.
async fn feedback_loop(
    mut feedback: FeedbackSender,
    mut confirmed: watch::Receiver<u64>,
    reply: Arc<Notify>,
    mut stop: oneshot::Receiver<()>,
    every: Duration,
) -> Result<()> {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let err = |e| Error::replication("sending a status update", e);
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => {
                let lsn = *confirmed.borrow();
                feedback.send_status(lsn, false).await.map_err(err)?;
                return feedback.close().await.map_err(err);
            }
            changed = confirmed.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
            }
            _ = reply.notified() => {}
            _ = tick.tick() => {}
        }
        let lsn = *confirmed.borrow_and_update();
        feedback.send_status(lsn, false).await.map_err(err)?;
    }
}

/// How often to send status updates: [`STATUS_INTERVAL`], or a third of the
/// server's wal_sender_timeout when that is shorter.
async fn status_interval(conn: &mut ReplicationConnection) -> Result<Duration> {
    let rows = conn
        .simple_query("SHOW wal_sender_timeout")
        .await
        .map_err(|e| Error::replication("reading wal_sender_timeout", e))?;
    let text = rows
        .first()
        .and_then(|r| r.first().cloned().flatten())
        .unwrap_or_default();
    Ok(match parse_pg_duration(&text) {
        Some(t) if !t.is_zero() => STATUS_INTERVAL.min(t / 3).max(Duration::from_millis(100)),
        _ => STATUS_INTERVAL, // 0 disables the server's timeout
    })
}

/// Parses a Postgres duration setting as SHOW prints it (`60s`, `2min`, `500ms`, `0`).
fn parse_pg_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (num, unit) = text.split_at(split);
    let n: u64 = num.parse().ok()?;
    Some(match unit.trim() {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "min" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        "d" => Duration::from_secs(n * 86_400),
        _ => return None,
    })
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

/// Seqs written so far: all up to `upto`, and ranges beyond it written out
/// of order (uploads finish in any order).
struct Frontier {
    upto: u64,
    ahead: BTreeMap<u64, u64>,
}

impl Frontier {
    fn new(upto: u64) -> Self {
        Frontier {
            upto,
            ahead: BTreeMap::new(),
        }
    }

    fn mark(&mut self, first: u64, last: u64) {
        self.ahead.insert(first, last);
        while let Some((&first, &last)) = self.ahead.first_key_value() {
            if first > self.upto + 1 {
                break;
            }
            self.ahead.pop_first();
            self.upto = self.upto.max(last);
        }
    }
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
    prefix: Option<String>,
    /// `destination.compression`, for batches that have no codec yet.
    compression: Codec,
    /// Which rows new batches must not pass, and which parked-table
    /// batches may leave.
    parking: ParkingLot,
    /// The state's data version when last checked for replay requests.
    data_version: i64,
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
        backfill.poke(checkpoint)?;
        let mut pipeline = Pipeline {
            checkpoint,
            pipeline: config.pipeline.clone(),
            prefix: sink.prefix().map(str::to_string),
            compression: config.compression,
            parking: ParkingLot::default(),
            data_version,
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
        let key = key::schema_key(self.prefix.as_deref(), table, version);
        self.delivery
            .put_now(&key, bytes::Bytes::from(body), "application/json")
            .await?;
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
            self.prefix.as_deref(),
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

    /// Stores a batch in the parked table (durable: it counts as written for
    /// confirmation) and blocks its rows.
    fn store_parked(
        &mut self,
        batch: &Batch,
        status: ParkStatus,
        attempts: u32,
        error: Option<String>,
    ) -> Result<()> {
        self.checkpoint.park(&Parked {
            first_seq: batch.first_seq,
            last_seq: batch.last_seq,
            key: batch.key.clone(),
            body: batch.body.clone(),
            rows: batch.rows.iter().copied().collect(),
            tables: batch.table_names(),
            status,
            attempts,
            last_error: error,
            parked_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        })?;
        self.data_version = self.checkpoint.data_version()?;
        let fate = match status {
            ParkStatus::Held => Fate::Held,
            _ => Fate::Parked,
        };
        JOURNAL.settled(batch.first_seq, batch.last_seq, fate, Some(&batch.key));
        if !batch.from_parked {
            match status {
                ParkStatus::Held => METRICS.held_batches.inc(),
                _ => METRICS.parked_batches.inc(),
            };
            self.parking.parked(batch);
            self.frontier.mark(batch.first_seq, batch.last_seq);
            self.advance();
        }
        Ok(())
    }

    fn hold(&mut self, batch: Batch) -> Result<()> {
        tracing::info!(
            first_seq = batch.first_seq,
            last_seq = batch.last_seq,
            key = %batch.key,
            "holding a batch behind a parked batch on the same rows"
        );
        self.store_parked(&batch, ParkStatus::Held, 0, None)
    }

    fn failed(&mut self, batch: Batch, attempts: u32, error: String) -> Result<()> {
        tracing::error!(
            id = batch.first_seq,
            key = %batch.key,
            attempts,
            error = %error,
            "parked a batch that could not be written; later changes to its rows wait behind it. \
             Replay it with `waltail parked replay {}`", batch.first_seq
        );
        if batch.from_parked {
            self.parking.settled(batch.first_seq);
        }
        self.store_parked(&batch, ParkStatus::Parked, attempts, Some(error))
    }

    fn written(&mut self, batch: Batch, bytes: usize) -> Result<()> {
        let n = batch.changes();
        METRICS.changes_archived.inc_by(n);
        METRICS.objects_written.inc();
        METRICS.bytes_written.inc_by(bytes as u64);
        JOURNAL.settled(
            batch.first_seq,
            batch.last_seq,
            Fate::Delivered,
            Some(&batch.key),
        );
        if !batch.from_parked {
            let committed = pgtime::to_utc(batch.commit_ts);
            if let Ok(age) = (chrono::Utc::now() - committed).to_std() {
                METRICS.commit_to_archive_seconds.observe(age.as_secs_f64());
            }
        }
        if batch.from_parked {
            self.checkpoint.unpark(batch.first_seq)?;
            self.parking.settled(batch.first_seq);
            tracing::info!(key = %batch.key, "delivered a parked or held batch");
            self.release()?;
        } else {
            self.done.push(batch.first_seq);
            self.frontier.mark(batch.first_seq, batch.last_seq);
            self.advance();
        }
        let s = &mut self.stats;
        s.changes += n;
        s.objects += 1;
        s.bytes += bytes as u64;
        s.since_log += n;
        s.last_key = batch.key;
        tracing::debug!(key = %s.last_key, changes = n, "archived");
        s.maybe_log();
        Ok(())
    }

    /// Re-reads the parked table: recomputes the blocked rows and queues the
    /// batches that may now leave (replay requests, then held batches whose
    /// rows are clear).
    fn release(&mut self) -> Result<()> {
        let parked = self.checkpoint.parked()?;
        let held = parked
            .iter()
            .filter(|p| p.status == ParkStatus::Held)
            .count() as i64;
        METRICS.held_batches.set(held);
        METRICS.parked_batches.set(parked.len() as i64 - held);
        self.parking.reload(parked);
        Ok(())
    }

    /// Moves the cursor past every committed transaction wholly written.
    fn advance(&mut self) {
        while let Some(&p) = self.txns.front() {
            if p.last_seq > self.frontier.upto || p.until > self.frontier.upto {
                break;
            }
            self.txns.pop_front();
            self.cursor = Cursor {
                confirmed_lsn: p.end_lsn.max(self.cursor.confirmed_lsn),
                next_seq: p.last_seq + 1,
            };
            self.dirty = true;
        }
    }

    /// Persists done marks and the cursor, then lets the feedback task confirm.
    fn persist(&mut self) -> Result<()> {
        if self
            .stats
            .sampled
            .is_none_or(|t| t.elapsed() >= PROGRESS_EVERY)
        {
            self.checkpoint.record_progress(&Progress {
                at: chrono::Utc::now().timestamp(),
                next_seq: self.next_seq,
                last_key: (!self.stats.last_key.is_empty()).then(|| self.stats.last_key.clone()),
            })?;
            self.stats.sampled = Some(Instant::now());
        }
        if !self.dirty && self.done.is_empty() {
            return Ok(());
        }
        let cursor = self.dirty.then_some(self.cursor);
        self.checkpoint.commit(&self.done, cursor)?;
        self.done.clear();
        if let Some(at) = self.forget_at
            && self.cursor.confirmed_lsn >= at
        {
            self.checkpoint.forget_chunks(self.cursor.confirmed_lsn)?;
            self.forget_at = None;
        }
        if self.dirty {
            self.dirty = false;
            self.confirm.send_replace(self.cursor.confirmed_lsn);
        }
        Ok(())
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}

#[cfg(test)]
mod component_tests;
mod watermarks;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pg_durations_parse_as_show_prints_them() {
        assert_eq!(parse_pg_duration("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse_pg_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_pg_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_pg_duration("soon"), None);
    }

    #[test]
    fn frontier_advances_over_out_of_order_completions() {
        let mut f = Frontier::new(10);
        f.mark(16, 20);
        assert_eq!(f.upto, 10);
        f.mark(11, 15);
        assert_eq!(f.upto, 20);
        // A written batch straddling the start (re-formed after a restart).
        let mut f = Frontier::new(12);
        f.mark(5, 14);
        assert_eq!(f.upto, 14);
    }
}
