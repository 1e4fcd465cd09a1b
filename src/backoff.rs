//! A wait that doubles from a floor to a ceiling: reconnecting to the
//! source, retrying the backfill task and a listing, polling for the end of
//! transactions, and a request to the store tried again
//! ([`retry_transient`]). (Uploads have their own schedule,
//! `delivery.backoff`, with jitter: see `delivery::retry`.)

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    /// Starts at `min`; each [`grow`](Self::grow) doubles it up to `max`.
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            current: min,
        }
    }

    /// The wait now.
    pub(crate) fn wait(&self) -> Duration {
        self.current
    }

    /// The next wait is twice this one, at most the ceiling.
    pub(crate) fn grow(&mut self) {
        self.current = (self.current * 2).min(self.max);
    }

    /// Back to the floor (after a success).
    pub(crate) fn reset(&mut self) {
        self.current = self.min;
    }
}

/// Runs `attempt` until it succeeds, fails with an error `transient` says
/// is for good, or `budget` would be spent by the next wait; waits from
/// 100 ms to 5 s between tries. Each try that failed is logged.
#[cfg(feature = "lakehouse")]
pub(crate) async fn retry_transient<T, E, F>(
    budget: Duration,
    transient: impl Fn(&E) -> bool,
    mut attempt: impl FnMut() -> F,
) -> Result<T, E>
where
    E: std::error::Error + 'static,
    F: std::future::Future<Output = Result<T, E>>,
{
    let started = std::time::Instant::now();
    let mut wait = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        match attempt().await {
            Err(e) if transient(&e) && started.elapsed() + wait.wait() < budget => {
                tracing::info!(error = %crate::error::Report(&e), wait = ?wait.wait(), "trying again");
                tokio::time::sleep(wait.wait()).await;
                wait.grow();
            }
            done => return done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_ceiling_and_resets_to_the_floor() {
        let mut b = Backoff::new(Duration::from_millis(300), Duration::from_secs(1));
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(b.wait().as_millis());
            b.grow();
        }
        assert_eq!(seen, [300, 600, 1000, 1000]);
        b.reset();
        assert_eq!(b.wait(), Duration::from_millis(300));
    }
}
