//! Backfill: the rows that already exist, archived as `read` events while
//! streaming goes on and writes continue.
//!
//! The table is read in chunks by key (keyset pagination). Each chunk is
//! read between two watermarks written into the WAL with
//! `pg_logical_emit_message` (DBLog's scheme, as in Debezium's incremental
//! snapshots):
//!
//! 1. write the low watermark (its own transaction);
//! 2. wait until the transactions in progress at that moment have ended
//!    (see [`in_progress`]: a commit can be in the WAL, before the low
//!    watermark, and still invisible to a new snapshot);
//! 3. read up to `chunk_size` rows after the last key, and store them in the
//!    local state;
//! 4. write the high watermark.
//!
//! The pipeline sees the watermarks in commit order among the changes. It
//! remembers which rows of the table changed between them; at the high
//! watermark it emits the chunk's other rows as `read` events. A row that
//! changed inside the window is dropped from the chunk: the change itself
//! is in the stream and is at least as new as what the chunk read, so a
//! `read` event never supersedes a newer change. Rows changed after the high
//! watermark get higher seqs than the chunk's `read` events.
//!
//! Crash safety rides on the pipeline's cursor: the slot is not confirmed
//! past a low watermark until its chunk's `read` events are archived, and
//! the chunk's rows stay in the local state until its high watermark is
//! confirmed. After a restart the stream brings both watermarks again and
//! the same rows come out with the same seqs and bytes.
//!
//! The watermarks are logical messages from PostgreSQL 14 on, where
//! pgoutput passes them on (the `messages` option). On 12 and 13 they are
//! rows inserted into a watermark table,
//! [`WATERMARK_TABLE`](crate::source::watermark::WATERMARK_TABLE), which joins
//! the publication (the approach of Debezium's signalling table): each
//! insert is committed on its own and reaches the stream in commit order
//! like a message; the stream turns it into the same watermark and never
//! archives the table's changes. Each insert deletes the rows before it, so
//! the table stays empty but for the last watermark.
//!
//! The submodules: [`table`] plans a table's read (key, size, ranges),
//! [`watermarks`] writes the watermarks, [`snapshot`] waits out the
//! transactions in progress at a low watermark, [`copy`] reads a chunk,
//! [`driver`] runs the readers, [`handoff`] passes their chunks' rows to
//! the pipeline in memory, and [`window`] is the pipeline's view of the
//! chunks between their watermarks.

pub(crate) mod copy;
pub(crate) mod driver;
pub(crate) mod handoff;
pub(crate) mod snapshot;
pub(crate) mod table;
pub(crate) mod watermarks;
pub(crate) mod window;

use std::sync::Arc;

pub(crate) use copy::read_chunk;
pub(crate) use snapshot::{in_progress, sessions_of, still_in_progress};
pub(crate) use table::{Estimate, Plans, TablePlan, estimate, plan, split};
use tokio_postgres::Client;
pub(crate) use watermarks::{CANCEL_CHUNK, Mark, Passed, Watermark, emit, ensure_watermark_table};

use crate::checkpoint::ChunkBody;
use crate::config::{SourceConfig, TableName};
use crate::error::ErrorKind;
use crate::source::watermark::MESSAGES_VERSION;
use crate::sql::quote_literal;
use crate::{Error, Result};

/// What a backfill can use on the source server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Server {
    /// `server_version_num`, e.g. 140005.
    pub version: i64,
}

impl Server {
    /// Whether watermarks are logical messages (else rows of the table).
    pub(crate) fn has_messages(self) -> bool {
        self.version >= MESSAGES_VERSION
    }

    /// Whether the `xid8` snapshot functions exist (13+); 12 has their
    /// `txid_*` forerunners, which take and give `bigint`.
    pub(crate) fn has_xid8(self) -> bool {
        self.version >= 130000
    }
}

/// A chunk also ends at this many bytes of rendered rows, so wide rows keep
/// the memory of a chunk (read here, re-read by the pipeline) bounded.
const MAX_CHUNK_BYTES: usize = 16 << 20;

/// An SQL connection whose text output matches the replication stream's.
pub(crate) async fn connect(source: &SourceConfig) -> Result<Client> {
    let client = crate::source::connect_sql(source).await?;
    let mut set = String::from("SET standard_conforming_strings = on;");
    for (name, value) in crate::source::OUTPUT_SETTINGS {
        set.push_str(&format!("SET {name} = {};", quote_literal(value)));
    }
    client
        .batch_execute(&set)
        .await
        .map_err(|e| Error::postgres("preparing the backfill connection", e))?;
    Ok(client)
}

/// What a backfill can use on the server (see [`Server`]).
pub(crate) async fn check_server(client: &Client) -> Result<Server> {
    let version: i64 = client
        .query_one("SELECT current_setting('server_version_num')::bigint", &[])
        .await
        .map_err(|e| Error::postgres("reading the server version", e))?
        .get(0);
    Ok(Server { version })
}

/// Rows read for one chunk.
pub(crate) struct ChunkRows {
    /// `(row identity hash, data JSON)` in key order.
    pub rows: ChunkBody,
    /// The key of the last row (a JSON array of text values).
    pub last_key: Option<String>,
    /// Fewer rows than asked for came back: the table is done.
    pub is_last: bool,
}

/// The configured table a name on the command line means.
pub(crate) fn configured_table(tables: &[TableName], arg: &str) -> Result<TableName> {
    let wanted: TableName = arg.parse().map_err(|e: String| Error::Config(e))?;
    tables
        .iter()
        .find(|t| **t == wanted)
        .cloned()
        .ok_or_else(|| {
            Error::fatal(
            format!("table {wanted} is not in source.tables, so its changes are not streamed"),
            "add it to source.tables (the publication follows on the next start), then backfill it",
        )
        .with_kind(ErrorKind::Source)
        })
}

/// For the schema record: the table as the envelope names it.
pub(crate) fn table_ref(schema: &str, table: &str) -> Arc<crate::archive::envelope::TableRef> {
    Arc::new(crate::archive::envelope::TableRef::new(schema, table))
}
