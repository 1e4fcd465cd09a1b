//! A spawned task that stops with the run that started it.

use crate::{Error, Result};

/// A spawned task that is aborted when its handle is dropped: when a run
/// fails, the tasks it started stop at their next await instead of going
/// on writing after the run has reported its error (their output is
/// deterministic, but a late write would be an orphan nothing cleans up).
pub(super) struct Task<T>(tokio::task::JoinHandle<T>);

impl<T: Send + 'static> Task<T> {
    pub(super) fn spawn(future: impl Future<Output = T> + Send + 'static) -> Task<T> {
        Task(tokio::spawn(future))
    }

    /// The task's output; an error if it panicked.
    pub(super) async fn join(mut self, what: &str) -> Result<T> {
        (&mut self.0)
            .await
            .map_err(|e| Error::bug(format!("{what} failed: {e}")))
    }
}

impl<T> Drop for Task<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
