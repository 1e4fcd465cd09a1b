//! The compacted tables' format, one home for its writer (`compact`) and
//! its reader (`query`): the typed change model an archive line is read
//! into (change, typing, line, scan, read, columns), where the tables live
//! and their columns (layout), and their Delta logs (delta, compacted).
//!
//! ```text
//! archive line --read (scan: the fast path)--> TypedChange (typing: Cell, TableShape)
//!     --columns--> Arrow batch laid out as layout's history / latest schema
//! Delta log --delta::load--> Published (txn version, schema, files)
//!     --compacted--> where each table continues, its columns
//! ```

pub mod change;
pub mod columns;
pub(crate) mod compacted;
pub mod delta;
pub mod layout;
pub mod line;
pub mod read;
mod scan;
pub mod session;
pub(crate) mod stored;
pub mod typing;

use std::time::Duration;

/// How the requests of compact and query are retried: reads and writes of
/// a run that takes minutes should outlast a store that restarts or drops
/// connections for a few seconds (the streaming sink instead has its own,
/// longer policy and no client retries). Connection failures, 5xx, 429
/// and timeouts of idempotent requests are retried, from 100 ms growing
/// to 15 s, for 2 minutes at most. object_store draws each wait at random
/// between the first and the last one times the base, so waits can stay
/// short for a while: 15 retries were once spent within 2.7 s of a 3 s
/// outage; 60 leave the 2 minutes the limit that counts.
pub(crate) fn store_retry() -> object_store::RetryConfig {
    object_store::RetryConfig {
        backoff: object_store::BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(15),
            base: 2.0,
        },
        max_retries: 60,
        retry_timeout: Duration::from_secs(120),
    }
}
