//! The retry schedule: `max_attempts` attempts in all, waiting
//! `backoff[i]` (the last entry repeats) with ±20% jitter between them, so
//! many pipelines failing together do not retry in lockstep.

use std::time::Duration;

/// When to try again.
#[derive(Debug, Clone)]
pub(crate) struct RetryPolicy {
    pub max_attempts: u32,
    pub backoff: Vec<Duration>,
}

impl RetryPolicy {
    /// The wait after failed attempt number `attempt` (1-based), or `None`
    /// when no attempt is left.
    pub(crate) fn delay(&self, attempt: u32) -> Option<Duration> {
        if attempt >= self.max_attempts {
            return None;
        }
        let base = self
            .backoff
            .get(attempt as usize - 1)
            .or(self.backoff.last())
            .copied()
            .unwrap_or_default();
        let jitter = 0.8 + fastrand::f64() * 0.4;
        Some(base.mul_f64(jitter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_schedule_is_five_attempts_with_product_page_backoff() {
        let p = RetryPolicy {
            max_attempts: 5,
            backoff: crate::config::DEFAULT_BACKOFF.to_vec(),
        };
        let secs = [30.0, 60.0, 120.0, 240.0];
        for (i, base) in secs.iter().enumerate() {
            let d = p.delay(i as u32 + 1).unwrap().as_secs_f64();
            assert!(d >= base * 0.8 && d <= base * 1.2, "attempt {}: {d}", i + 1);
        }
        assert_eq!(p.delay(5), None);
    }

    #[test]
    fn last_backoff_repeats() {
        let p = RetryPolicy {
            max_attempts: 10,
            backoff: vec![Duration::from_millis(10)],
        };
        assert!(p.delay(9).unwrap() <= Duration::from_millis(12));
    }
}
