//! A wait that doubles from a floor to a ceiling: reconnecting to the
//! source, retrying the backfill task and a listing, polling for the end of
//! transactions. (Uploads have their own schedule, `delivery.backoff`, with
//! jitter: see `delivery::retry`.)

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
