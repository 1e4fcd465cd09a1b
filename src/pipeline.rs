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

use crate::batch::{Batch, Batcher, Cut};
use crate::checkpoint::{Checkpoint, Cursor};
use crate::config::{Config, quote_ident};
use crate::delivery::{Delivered, Delivery, RetryPolicy, Wait};
use crate::envelope;
use crate::error::Disposition;
use crate::sink::Sink;
use crate::source::pgoutput::format_lsn;
use crate::source::replication::{FeedbackSender, ReplicationConnection};
use crate::source::stream::{self, Decoder, SourceEvent};
use crate::source::{self, setup};
use crate::{Error, Result};

/// Events buffered between the source and the pipeline. Small: backpressure
/// should reach Postgres quickly, and each event holds a rendered row.
const EVENT_CHANNEL: usize = 4096;
/// Status updates go out at least this often, well inside the default
/// wal_sender_timeout (60 s), even while the pipeline is blocked.
const STATUS_INTERVAL: Duration = Duration::from_secs(10);
/// How often the confirmed position is persisted and sent while changes flow.
const CONFIRM_INTERVAL: Duration = Duration::from_millis(100);
/// Archived objects are logged one by one when they are at least this far
/// apart, else summarised, so a busy pipeline logs a line per interval.
const LOG_EVERY: Duration = Duration::from_secs(2);
/// Reconnect waits: from 1 s doubling to 30 s.
const RECONNECT_MIN: Duration = Duration::from_secs(1);
const RECONNECT_MAX: Duration = Duration::from_secs(30);

/// Stop requests: the first asks for a graceful stop (flush, confirm, exit),
/// a second one for an immediate stop.
pub type Shutdown = watch::Receiver<u32>;

/// Options of `waltail run`.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Create a new slot when the recorded one has disappeared.
    pub recreate_slot: bool,
}

const META_SLOT: &str = "slot";

/// Streams until asked to stop (Ok) or until an error no retry can fix.
pub async fn run(config: &Config, opts: &RunOptions, mut shutdown: Shutdown) -> Result<()> {
    let mut checkpoint = Checkpoint::open(&config.state_file())?;
    let sink = Sink::new(&config.destination)?;
    let mut wait = RECONNECT_MIN;
    let mut set_up = false;
    loop {
        let started = Instant::now();
        let result = async {
            if !set_up {
                prepare(config, opts, &mut checkpoint).await?;
                set_up = true;
            }
            session(config, &mut checkpoint, &sink, shutdown.clone()).await
        }
        .await;
        match result {
            Ok(()) => return Ok(()),
            Err(e) if e.disposition() == Disposition::Retry && *shutdown.borrow() == 0 => {
                if started.elapsed() > RECONNECT_MAX * 2 {
                    wait = RECONNECT_MIN;
                }
                tracing::warn!(error = %crate::error::Report(&e), retry_in = ?wait, "source connection lost; reconnecting");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.changed() => return Ok(()),
                }
                wait = (wait * 2).min(RECONNECT_MAX);
            }
            Err(e) => return Err(e),
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
        ));
    }
    if !exists {
        if let Some(c) = cursor {
            if !opts.recreate_slot {
                return Err(Error::fatal(
                    format!(
                        "replication slot {slot} has disappeared (dropped or invalidated); changes committed after {} were not captured",
                        format_lsn(c.confirmed_lsn)
                    ),
                    "run `waltail run --recreate-slot` to create a new slot and continue numbering from seq \
                     where the archive stopped, then `waltail backfill` to capture the current rows",
                ));
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
) -> Result<()> {
    let cursor = checkpoint.cursor()?.unwrap_or(Cursor {
        confirmed_lsn: 0,
        next_seq: 1,
    });
    let intents = checkpoint.open_intents(cursor.next_seq)?;
    let pg = source::pg_config(&config.source);
    let conn = ReplicationConnection::connect(&pg, &format!("waltail {}", config.pipeline))
        .await
        .map_err(|e| Error::replication("opening the replication connection", e))?;
    let publications = quote_ident(&config.source.publication);
    let (stream, feedback) = conn
        .start_replication(
            &config.source.slot,
            cursor.confirmed_lsn,
            &[("proto_version", "1"), ("publication_names", &publications)],
        )
        .await
        .map_err(|e| Error::replication("starting replication", e))?;
    tracing::info!(
        slot = %config.source.slot,
        from = %format_lsn(cursor.confirmed_lsn),
        next_seq = cursor.next_seq,
        pending_batches = intents.iter().filter(|i| !i.done).count(),
        destination = %sink.describe(),
        "streaming"
    );

    let (tx, rx) = mpsc::channel(EVENT_CHANNEL);
    let reply = Arc::new(Notify::new());
    let (confirm_tx, confirm_rx) = watch::channel(cursor.confirmed_lsn);
    let (stop_feedback, feedback_stopped) = oneshot::channel();
    let mut source_task = tokio::spawn(stream::run(
        stream,
        Decoder::new(cursor.confirmed_lsn),
        tx,
        reply.clone(),
    ));
    let feedback_task = tokio::spawn(feedback_loop(feedback, confirm_rx, reply, feedback_stopped));

    let delivery = Delivery::new(
        sink.clone(),
        &config.pipeline,
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
    );
    let mut pipeline = Pipeline {
        checkpoint,
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
        confirm: confirm_tx,
        stats: Stats::default(),
    };
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
                confirmed = %format_lsn(pipeline.cursor.confirmed_lsn),
                next_seq = pipeline.cursor.next_seq,
                "stopped"
            );
            Ok(())
        }
        Ended::SourceClosed => match (&mut source_task).await {
            Ok(Err(e)) => Err(e),
            _ => Err(Error::replication(
                "reading the replication stream",
                source::replication::ReplicationError::Closed,
            )),
        },
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
) -> Result<()> {
    let mut tick = tokio::time::interval(STATUS_INTERVAL);
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

/// Why the pipeline loop ended without an error.
enum Ended {
    Shutdown,
    SourceClosed,
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
}

struct Pipeline<'a> {
    checkpoint: &'a mut Checkpoint,
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
    /// Committed transactions not yet confirmed: (end LSN, last seq).
    txns: VecDeque<(u64, u64)>,
    open_txn: bool,
    /// Cut batches waiting for an upload slot, in seq order.
    waiting: VecDeque<Batch>,
    confirm: watch::Sender<u64>,
    stats: Stats,
}

impl Pipeline<'_> {
    async fn run(
        &mut self,
        mut rx: mpsc::Receiver<SourceEvent>,
        mut shutdown: Shutdown,
    ) -> Result<Ended> {
        let mut confirm_tick = tokio::time::interval(CONFIRM_INTERVAL);
        confirm_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut stopping: Option<Ended> = None;
        let mut source_open = true;
        let mut shutdown_open = true;
        loop {
            let rate_wait = self.dispatch();
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
            let accepting = stopping.is_none() && source_open && self.waiting.is_empty();
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
                        self.cut_partial()?;
                    }
                }
                Some(result) = self.delivery.next(), if !self.delivery.is_idle() => {
                    match result {
                        Ok(d) => self.delivered(d),
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
                _ = confirm_tick.tick() => self.persist()?,
                event = rx.recv(), if accepting => match event {
                    Some(event) => self.event(event)?,
                    None => {
                        source_open = false;
                        if stopping.is_none() {
                            stopping = Some(Ended::SourceClosed);
                            self.cut_partial()?;
                        }
                    }
                },
            }
        }
    }

    fn event(&mut self, event: SourceEvent) -> Result<()> {
        match event {
            SourceEvent::Begin => self.open_txn = true,
            SourceEvent::Change(change) => {
                let seq = self.next_seq;
                self.next_seq += 1;
                match self.batcher.push(seq, &change) {
                    None => {}
                    Some(Cut::Ready(batch)) => self.enqueue(batch)?,
                    Some(Cut::AlreadyWritten {
                        first_seq,
                        last_seq,
                    }) => {
                        self.frontier.mark(first_seq, last_seq);
                        self.advance();
                    }
                }
            }
            SourceEvent::Commit { end_lsn } => {
                self.open_txn = false;
                self.txns.push_back((end_lsn, self.next_seq - 1));
                self.advance();
            }
            SourceEvent::Keepalive { wal_end } => {
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

    /// Records the batch's intent (durably, before any PUT) and queues it.
    fn enqueue(&mut self, batch: Batch) -> Result<()> {
        if !batch.recorded {
            self.checkpoint
                .record_intent(batch.first_seq, batch.last_seq)?;
        }
        self.waiting.push_back(batch);
        Ok(())
    }

    fn cut_partial(&mut self) -> Result<()> {
        match self.batcher.take() {
            Some(batch) => self.enqueue(batch),
            None => Ok(()),
        }
    }

    /// Starts the waiting batches that may start; returns when the rate limit
    /// next allows one, if that is what holds them.
    fn dispatch(&mut self) -> Option<Instant> {
        while let Some(batch) = self.waiting.front() {
            match self.delivery.can_start(batch) {
                Ok(()) => {
                    let batch = self.waiting.pop_front().expect("front exists");
                    self.delivery.start(batch);
                }
                Err(Wait::Busy) => return None,
                Err(Wait::Until(t)) => return Some(t),
            }
        }
        None
    }

    fn delivered(&mut self, d: Delivered) {
        self.done.push(d.first_seq);
        self.frontier.mark(d.first_seq, d.last_seq);
        self.advance();
        let n = d.last_seq - d.first_seq + 1;
        let s = &mut self.stats;
        s.changes += n;
        s.objects += 1;
        s.bytes += d.bytes as u64;
        s.since_log += n;
        s.last_key = d.key;
        tracing::debug!(key = %s.last_key, changes = n, "archived");
        if s.logged.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            tracing::info!(
                changes = s.since_log,
                total_changes = s.changes,
                total_objects = s.objects,
                total_bytes = s.bytes,
                last = %s.last_key,
                "archived"
            );
            s.logged = Some(Instant::now());
            s.since_log = 0;
        }
    }

    /// Moves the cursor past every committed transaction wholly written.
    fn advance(&mut self) {
        while let Some(&(end_lsn, last_seq)) = self.txns.front() {
            if last_seq > self.frontier.upto {
                break;
            }
            self.txns.pop_front();
            self.cursor = Cursor {
                confirmed_lsn: end_lsn.max(self.cursor.confirmed_lsn),
                next_seq: last_seq + 1,
            };
            self.dirty = true;
        }
    }

    /// Persists done marks and the cursor, then lets the feedback task confirm.
    fn persist(&mut self) -> Result<()> {
        if !self.dirty && self.done.is_empty() {
            return Ok(());
        }
        let cursor = self.dirty.then_some(self.cursor);
        self.checkpoint.commit(&self.done, cursor)?;
        self.done.clear();
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
