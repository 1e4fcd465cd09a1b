//! A pipeline's life around the core loop: the lock that makes it the one
//! reader of its slot, setting up the publication and slot (refusing a
//! state and a slot that disagree), each replication session from connect
//! to stop or loss with its feedback task, and reconnecting after a loss.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::{Instant, MissedTickBehavior};

use super::{Ended, Pipeline, RunOptions, Shutdown};
use crate::backoff::Backoff;
use crate::checkpoint::{Checkpoint, Cursor};
use crate::config::Config;
use crate::error::{Disposition, ErrorKind};
use crate::lsn;
use crate::sink::Sink;
use crate::source::backfill::{Passed, driver::Driver};
use crate::source::catalog::TypeCatalog;
use crate::source::replication::{FeedbackSender, ReplicationConnection};
use crate::source::stream::{self, Decoder};
use crate::source::{self, setup};
use crate::sql::quote_ident;
use crate::telemetry::METRICS;
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
/// Reconnect waits: from 1 s doubling to 30 s.
const RECONNECT_MIN: Duration = Duration::from_secs(1);
const RECONNECT_MAX: Duration = Duration::from_secs(30);

/// The meta key of the slot the state belongs to (see [`prepare`]).
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
}
