//! Delivery: uploads batches with at most `max_in_flight` PUTs at once,
//! never two batches holding the same row, at the configured rate, retrying
//! each failed PUT on the retry schedule.
//!
//! A batch whose attempts are all used up (or that the store refuses for
//! good) comes back as [`Outcome::Failed`] so the pipeline can park it; an
//! error that no batch can get past (credentials refused, bucket missing)
//! ends delivery with `Err`, and the pipeline stops.

pub(crate) mod parking;
pub(crate) mod retry;

use std::time::Duration;

use bytes::Bytes;
pub(crate) use retry::RetryPolicy;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::batch::Batch;
use crate::error::{Disposition, Report};
use crate::row_identity::Holds;
use crate::sink::{NDJSON_CONTENT_TYPE, Sink};
use crate::telemetry::METRICS;
use crate::{Error, Result};

/// How a batch's delivery ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    Written {
        batch: Batch,
        bytes: usize,
    },
    /// Every attempt failed, or the store refused this batch for good.
    Failed {
        batch: Batch,
        attempts: u32,
        error: String,
    },
}

/// The uploads in flight and the rules for starting another.
pub(crate) struct Delivery {
    sink: Sink,
    policy: RetryPolicy,
    max_in_flight: usize,
    rate_limit: u32,
    /// When the rate limit next allows a batch to leave.
    rate_free_at: Instant,
    in_flight: JoinSet<Result<Outcome>>,
    /// The rows of the batches in flight (each row in one at most).
    holds: Holds,
}

/// Why a batch cannot leave yet.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// All upload slots are busy, or a row of the batch is in flight.
    Busy,
    /// The rate limit allows it at this time.
    Until(Instant),
}

impl Delivery {
    pub(crate) fn new(
        sink: Sink,
        policy: RetryPolicy,
        max_in_flight: usize,
        rate_limit: u32,
    ) -> Self {
        Delivery {
            sink,
            policy,
            max_in_flight,
            rate_limit,
            rate_free_at: Instant::now(),
            in_flight: JoinSet::new(),
            holds: Holds::default(),
        }
    }

    /// Writes one object now, outside the batch flow (schema records), on
    /// the same retry schedule.
    pub(crate) async fn put_now(&self, key: &str, body: Bytes, content_type: &str) -> Result<()> {
        put_with_retry_typed(&self.sink, key, body, &self.policy, content_type)
            .await
            .map_err(|(e, _)| e)
    }

    pub(crate) fn is_idle(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// Whether `batch` may start now.
    pub(crate) fn can_start(&self, batch: &Batch) -> Result<(), Wait> {
        if self.in_flight.len() >= self.max_in_flight
            || self.holds.conflicts(&batch.rows, batch.table_hashes())
        {
            return Err(Wait::Busy);
        }
        if self.rate_limit > 0 && Instant::now() < self.rate_free_at {
            return Err(Wait::Until(self.rate_free_at));
        }
        Ok(())
    }

    /// Starts uploading `batch` under `batch.key` (call [`Delivery::can_start`] first).
    pub(crate) fn start(&mut self, mut batch: Batch) {
        if self.rate_limit > 0 {
            let cost = Duration::from_secs_f64(batch.changes() as f64 / self.rate_limit as f64);
            self.rate_free_at = self.rate_free_at.max(Instant::now()) + cost;
        }
        self.holds.add(&batch.rows, batch.table_hashes());
        let sink = self.sink.clone();
        let policy = self.policy.clone();
        self.in_flight.spawn(async move {
            let body = Bytes::from(std::mem::take(&mut batch.body));
            let bytes = body.len();
            let result = put_with_retry(&sink, &batch.key, body.clone(), &policy).await;
            batch.body = body.into();
            match result {
                Ok(()) => Ok(Outcome::Written { batch, bytes }),
                Err((e, attempts)) => match e.disposition() {
                    Disposition::Stop => Err(e),
                    Disposition::Retry | Disposition::Park => Ok(Outcome::Failed {
                        batch,
                        attempts,
                        error: Report(&e).to_string(),
                    }),
                },
            }
        });
    }

    /// Waits for the next upload to finish. `None` when nothing is in flight.
    pub(crate) async fn next(&mut self) -> Option<Result<Outcome>> {
        let joined = self.in_flight.join_next().await?;
        let result = match joined {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(Error::fatal(
                format!("an upload task ended: {e}"),
                "report this bug",
            )),
        };
        if let Ok(Outcome::Written { batch, .. } | Outcome::Failed { batch, .. }) = &result {
            self.holds.remove(&batch.rows, batch.table_hashes());
        }
        Some(result)
    }
}

/// PUTs one object, retrying on the schedule. Gives up at once on errors
/// that no retry can fix (see [`Error::disposition`]), returning the error
/// and the number of attempts made.
pub(crate) async fn put_with_retry(
    sink: &Sink,
    key: &str,
    body: Bytes,
    policy: &RetryPolicy,
) -> Result<(), (Error, u32)> {
    put_with_retry_typed(sink, key, body, policy, NDJSON_CONTENT_TYPE).await
}

async fn put_with_retry_typed(
    sink: &Sink,
    key: &str,
    body: Bytes,
    policy: &RetryPolicy,
    content_type: &str,
) -> Result<(), (Error, u32)> {
    let mut attempt = 1;
    loop {
        let started = std::time::Instant::now();
        let result = sink.put(key, body.clone(), content_type).await;
        METRICS.put_seconds.observe(started.elapsed().as_secs_f64());
        match result {
            Ok(()) => return Ok(()),
            Err(e) => {
                let delay = match e.disposition() {
                    Disposition::Retry => policy.delay(attempt),
                    Disposition::Park | Disposition::Stop => None,
                };
                let Some(delay) = delay else {
                    return Err((e, attempt));
                };
                tracing::warn!(
                    key,
                    attempt,
                    retry_in = ?delay,
                    error = %Report(&e),
                    "PUT failed; retrying"
                );
                METRICS.put_retries.inc();
                tokio::time::sleep(delay).await;
                attempt += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn batch(first: u64, rows: &[u64]) -> Batch {
        Batch {
            first_seq: first,
            last_seq: first,
            commit_ts: 0,
            body: b"{}\n".to_vec(),
            rows: rows.iter().copied().collect(),
            tables: Vec::new(),
            recorded: false,
            key: format!("k-{first}"),
            from_parked: false,
            codec: None,
        }
    }

    fn delivery(max_in_flight: usize, rate_limit: u32) -> Delivery {
        let store = Arc::new(object_store::memory::InMemory::new());
        Delivery::new(
            Sink::from_store(store, None),
            RetryPolicy {
                max_attempts: 1,
                backoff: vec![Duration::ZERO],
            },
            max_in_flight,
            rate_limit,
        )
    }

    #[tokio::test]
    async fn a_row_is_never_in_two_uploads_at_once() {
        let mut d = delivery(4, 0);
        d.start(batch(1, &[10, 11]));
        assert_eq!(d.can_start(&batch(2, &[11])), Err(Wait::Busy));
        assert_eq!(d.can_start(&batch(3, &[12])), Ok(()));
        let Some(Ok(Outcome::Written { batch: done, .. })) = d.next().await else {
            panic!("the upload should succeed");
        };
        assert_eq!(done.first_seq, 1);
        assert_eq!(d.can_start(&batch(2, &[11])), Ok(()));
    }

    #[tokio::test]
    async fn at_most_max_in_flight_uploads() {
        let mut d = delivery(2, 0);
        d.start(batch(1, &[1]));
        d.start(batch(2, &[2]));
        assert_eq!(d.can_start(&batch(3, &[3])), Err(Wait::Busy));
        d.next().await.unwrap().unwrap();
        assert_eq!(d.can_start(&batch(3, &[3])), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limit_spaces_batches_by_their_size() {
        let mut d = delivery(8, 100); // 100 changes/s
        let mut b = batch(1, &[1]);
        b.last_seq = 50; // 50 changes: half a second of budget
        d.start(b);
        match d.can_start(&batch(51, &[2])) {
            Err(Wait::Until(t)) => {
                let wait = t - Instant::now();
                assert!(
                    wait > Duration::from_millis(450) && wait <= Duration::from_millis(500),
                    "{wait:?}"
                );
            }
            other => panic!("expected a rate wait, got {other:?}"),
        }
    }
}
