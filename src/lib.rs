//! waltail archives every committed PostgreSQL change to S3 (or any
//! S3-compatible store, or a local folder) as NDJSON objects under dated
//! prefixes.
//!
//! The modules follow the data flow:
//!
//! ```text
//! Postgres --replication (pgoutput)--> source --> Change --> archive::envelope (seq, key)
//!     --> batch (size, linger) --> delivery (in-flight limit, rate, retry,
//!     per-row order) --> sink (object_store PUT) --> checkpoint (confirm LSN)
//!
//! archive --> compact (typed Parquet: history per table and date, latest-row views)
//! archive + compacted Parquet --> query (SQL: latest rows, history, raw changes)
//! ```
//!
//! [`commands`] (one per command of [`cli`]) drive the pipeline and the
//! stages; nothing below imports them.
//!
//! [`pipeline`] wires the stages and holds the guarantees that span them: no
//! committed change is lost (the slot is confirmed only past transactions
//! wholly in the archive) and no seq range is written as two different
//! objects (batch intents are persisted before each PUT).

pub mod archive;
pub mod backoff;
pub mod batch;
pub mod checkpoint;
pub mod cli;
pub mod commands;
#[cfg(feature = "lakehouse")]
pub mod compact;
pub mod config;
pub mod console;
pub mod delivery;
pub mod error;
#[cfg(test)]
mod fuzzing;
pub mod http;
pub mod lsn;
pub mod pgtime;
pub mod pgtls;
pub mod pipeline;
#[cfg(feature = "lakehouse")]
pub mod query;
pub mod row_identity;
pub mod sink;
pub mod source;
pub mod sql;
pub mod telemetry;

pub use error::{Error, Result};
