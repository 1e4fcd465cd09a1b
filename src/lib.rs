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
//! archive --> compact (plan, write, commit) --> Delta tables: a history per table
//!     (by date) and a latest-row view, in the format of [`lakehouse`]
//! archive + lakehouse tables --> query (SQL: latest rows, history, raw changes)
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
pub(crate) mod backoff;
pub mod batch;
pub(crate) mod checkpoint;
pub mod cli;
pub(crate) mod commands;
#[cfg(feature = "lakehouse")]
pub mod compact;
pub mod config;
pub(crate) mod console;
pub(crate) mod delivery;
pub mod error;
#[cfg(test)]
mod fuzzing;
pub(crate) mod http;
#[cfg(feature = "lakehouse")]
pub mod lakehouse;
pub mod lsn;
pub(crate) mod pgtime;
pub(crate) mod pgtls;
pub(crate) mod pipeline;
#[cfg(feature = "lakehouse")]
pub(crate) mod query;
pub(crate) mod row_identity;
pub(crate) mod sink;
pub mod source;
pub(crate) mod sql;
pub(crate) mod telemetry;

pub use error::{Error, Result};
