//! The watermarks a backfill writes around each chunk (step 1 and 4 of the
//! scheme in [`super`]): what one says, how the pipeline tracks the chunks
//! it has passed, and how one is written into the WAL, as a logical message
//! or, before PostgreSQL 14, as a row of the watermark table.

use serde::{Deserialize, Serialize};
use tokio_postgres::Client;
use tokio_postgres::types::Type;

use super::Server;
use crate::config::SourceConfig;
use crate::error::ErrorKind;
use crate::source::watermark::{MESSAGE_PREFIX, WATERMARK_TABLE, watermark_table};
use crate::sql::quote_ident;
use crate::{Error, Result};

/// A watermark as written into the WAL (the message content, JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Watermark {
    pub pipeline: String,
    pub chunk: i64,
    pub mark: Mark,
    /// The reader that wrote it (see `backfill.parallelism`); the chunks of
    /// one lane pass through the stream one after another. Watermarks
    /// written before lanes existed have none: lane 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lane: u32,
}

fn is_zero(lane: &u32) -> bool {
    *lane == 0
}

/// The chunk id of the abort that `waltail backfill --cancel` writes: it
/// closes every lane's window.
pub(crate) const CANCEL_CHUNK: i64 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Mark {
    /// Before the chunk is read.
    Low,
    /// After the chunk is read and stored.
    High,
    /// The chunk will never get its high watermark (the backfill stopped).
    Abort,
}

/// How far the pipeline has passed each lane's chunks: the highest chunk id
/// per lane (a lane's chunks pass in the order of their ids).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Passed(Vec<i64>);

impl Passed {
    /// The highest chunk of `lane` passed so far (0: none).
    pub(crate) fn get(&self, lane: u32) -> i64 {
        self.0.get(lane as usize).copied().unwrap_or(0)
    }

    /// Records `chunk` of `lane` as passed; whether that moved the lane on.
    pub(crate) fn pass(&mut self, lane: u32, chunk: i64) -> bool {
        let lane = lane as usize;
        if self.0.len() <= lane {
            self.0.resize(lane + 1, 0);
        }
        let newer = chunk > self.0[lane];
        self.0[lane] = self.0[lane].max(chunk);
        newer
    }
}

/// Writes a watermark into the WAL, in its own transaction: a logical
/// message, or on an older server a row of [`WATERMARK_TABLE`] (the rows
/// before it deleted in the same transaction).
pub(crate) async fn emit(
    client: &Client,
    server: Server,
    pipeline: &str,
    lane: u32,
    chunk: i64,
    mark: Mark,
) -> Result<()> {
    let content = serde_json::to_string(&Watermark {
        pipeline: pipeline.to_string(),
        chunk,
        mark,
        lane,
    })
    .expect("a watermark serialises");
    let written = if server.has_messages() {
        // Typed: one round trip, no statement prepared first.
        client
            .query_typed(
                "SELECT pg_logical_emit_message(true, $1, $2)",
                &[(&MESSAGE_PREFIX, Type::TEXT), (&content, Type::TEXT)],
            )
            .await
            .map(|_| 0)
    } else {
        // One transaction (a simple query's statements share one): the
        // lock makes the parallel readers' watermarks take turns, so each
        // deletes the one before it and the table keeps only the last. Two
        // at once would each delete the old row and leave both new ones.
        let table = watermark_table();
        client
            .batch_execute(&format!(
                "LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE; \
                 WITH gone AS (DELETE FROM {table}) INSERT INTO {table} (content) VALUES ({})",
                crate::sql::quote_literal(&content)
            ))
            .await
            .map(|()| 0)
    };
    written.map_err(|e| Error::postgres("writing a backfill watermark", e))?;
    Ok(())
}

/// On a server older than
/// [`MESSAGES_VERSION`](crate::source::watermark::MESSAGES_VERSION): creates
/// [`WATERMARK_TABLE`] if it is missing and adds it to the pipeline's
/// publication if it is not there, so the stream sees its rows. Nothing on
/// a newer server.
pub(crate) async fn ensure_watermark_table(
    client: &Client,
    server: Server,
    source: &SourceConfig,
) -> Result<()> {
    if server.has_messages() {
        return Ok(());
    }
    let table = watermark_table();
    let fix = || {
        format!(
            "the role needs CREATE on schema {0} (GRANT CREATE ON SCHEMA {0} TO <role>;), or create the table yourself and give it to the role: CREATE TABLE {table} (id bigserial PRIMARY KEY, content text NOT NULL); ALTER TABLE {table} OWNER TO <role>;",
            quote_ident(WATERMARK_TABLE.0)
        )
    };
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, content text NOT NULL)"
        ))
        .await
        .map_err(|e| {
            Error::fatal(
                format!("cannot create the backfill watermark table {table}: {e}"),
                fix(),
            )
            .with_kind(ErrorKind::Source)
        })?;
    let published: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication p
                 WHERE p.pubname = $1 AND (p.puballtables OR EXISTS (
                     SELECT 1 FROM pg_publication_tables t
                     WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3)))",
            &[&source.publication, &WATERMARK_TABLE.0, &WATERMARK_TABLE.1],
        )
        .await
        .map_err(|e| Error::postgres("looking up the publication's tables", e))?
        .get(0);
    if !published {
        client
            .batch_execute(&format!(
                "ALTER PUBLICATION {} ADD TABLE {table}",
                quote_ident(&source.publication)
            ))
            .await
            .map_err(|e| {
                Error::fatal(
                    format!(
                        "cannot add the backfill watermark table {table} to publication {}: {e}",
                        source.publication
                    ),
                    format!("the role must own the table and the publication; {}", fix()),
                )
            })?;
        tracing::info!(table = %table, publication = %source.publication, "added the backfill watermark table to the publication (PostgreSQL before 14 has no logical messages in pgoutput)");
    }
    Ok(())
}
