//! The confirmation frontier and what each delivery outcome does to it:
//! which seqs are durable (uploads finish in any order; a parked or held
//! batch is durable in the state), so `L` goes to a transaction's commit
//! end only when every seq up to its last change is durable, and `(L, S)`
//! is persisted before `L` is sent to the server, and the objects behind
//! them are durable before either is persisted ([`crate::sink::Sink::settle`]).

use std::collections::BTreeMap;

use tokio::time::Instant;

use super::{PROGRESS_EVERY, Pipeline};
use crate::Result;
use crate::batch::Batch;
use crate::checkpoint::{Cursor, ParkStatus, Parked, Progress};
use crate::console::{Fate, JOURNAL};
use crate::pgtime;
use crate::telemetry::METRICS;

/// Seqs written so far: all up to `upto`, and ranges beyond it written out
/// of order (uploads finish in any order).
pub(super) struct Frontier {
    pub(super) upto: u64,
    ahead: BTreeMap<u64, u64>,
}

impl Frontier {
    pub(super) fn new(upto: u64) -> Self {
        Frontier {
            upto,
            ahead: BTreeMap::new(),
        }
    }

    pub(super) fn mark(&mut self, first: u64, last: u64) {
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

impl Pipeline<'_> {
    /// Stores a batch in the parked table (durable: it counts as written for
    /// confirmation) and blocks its rows.
    pub(super) fn store_parked(
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

    pub(super) fn hold(&mut self, batch: Batch) -> Result<()> {
        tracing::info!(
            first_seq = batch.first_seq,
            last_seq = batch.last_seq,
            key = %batch.key,
            "holding a batch behind a parked batch on the same rows"
        );
        self.store_parked(&batch, ParkStatus::Held, 0, None)
    }

    pub(super) fn failed(&mut self, batch: Batch, attempts: u32, error: String) -> Result<()> {
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

    pub(super) fn written(&mut self, batch: Batch, bytes: usize) -> Result<()> {
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
            self.sink.settle()?;
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
    pub(super) fn release(&mut self) -> Result<()> {
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
    pub(super) fn advance(&mut self) {
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
    pub(super) fn persist(&mut self) -> Result<()> {
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
        // The done marks stand for objects written since the last commit:
        // those must be durable first (a folder's files are not until
        // synced). A cursor moved alone stands only for objects an earlier
        // commit made durable.
        if !self.done.is_empty() {
            self.sink.settle()?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
