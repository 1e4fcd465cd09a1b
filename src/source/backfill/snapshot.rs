//! The wait between a low watermark and the chunk's read (step 2 of the
//! scheme in [`super`]): which transactions were in progress, which of them
//! may still hold a commit the stream has and a new snapshot would not see,
//! and who runs them, for the log.

use tokio_postgres::Client;
use tokio_postgres::types::Type;

use super::Server;
use crate::{Error, Result};

/// The transactions in progress now (their full xids, as text): the ones a
/// chunk read after a low watermark waits for (see [`still_in_progress`]).
///
/// Why wait: a transaction's commit record goes into the WAL before the
/// transaction leaves the server's list of running ones, and only then do new
/// snapshots see it. In between, the stream already has its changes while a
/// snapshot does not: a commit just before the low watermark, outside the
/// window, would let the chunk read the row as it was before, and the chunk's
/// `read` event (emitted at the high watermark, later in the stream) would
/// put that older row back over the newer change. Every transaction that can
/// be in that state is in progress in a snapshot taken after the low
/// watermark, so once these have ended a snapshot sees every commit before
/// the watermark; transactions that begin later commit after it, inside the
/// window or after it, as the scheme expects. (PostgreSQL waits similarly,
/// for every running transaction, before it exports the snapshot of a new
/// replication slot.)
pub(crate) async fn in_progress(client: &Client, server: Server) -> Result<Vec<String>> {
    // A snapshot's list stops at its xmax, one past the newest finished xid:
    // a transaction with a newer xid is in progress but not listed. An xid
    // taken and finished now, after the watermark, moves xmax past every
    // transaction that committed before the watermark (their xids are older).
    let (take, list) = if server.has_xid8() {
        (
            "SELECT pg_current_xact_id()",
            "SELECT COALESCE(array_agg(x::text), '{}') FROM pg_snapshot_xip(pg_current_snapshot()) x",
        )
    } else {
        (
            "SELECT txid_current()",
            "SELECT COALESCE(array_agg(x::text), '{}') FROM txid_snapshot_xip(txid_current_snapshot()) x",
        )
    };
    client
        .batch_execute(take)
        .await
        .map_err(|e| Error::postgres("taking a transaction id", e))?;
    // Typed: one round trip, no statement prepared first (as below).
    client
        .query_typed(list, &[])
        .await
        .map(|rows| rows[0].get(0))
        .map_err(|e| Error::postgres("listing the transactions in progress", e))
}

/// Those of `xids` (from [`in_progress`]) that may still hold a commit the
/// stream has and a snapshot would not see: not ended yet, and not visibly
/// idle inside their transaction block (such a session has not begun to
/// commit, so its commit comes after the low watermark: a forgotten open
/// transaction does not hold the backfill). Sessions of other users, whose
/// state the configured user may not see, and prepared transactions are
/// waited for.
pub(crate) async fn still_in_progress(
    client: &Client,
    server: Server,
    xids: &[String],
) -> Result<Vec<String>> {
    let visible = if server.has_xid8() {
        "pg_visible_in_snapshot(x::xid8, pg_current_snapshot())"
    } else {
        "txid_visible_in_snapshot(x::bigint, txid_current_snapshot())"
    };
    client
        .query_typed(
            &format!(
                "SELECT COALESCE(array_agg(x), '{{}}') FROM unnest($1::text[]) x
             WHERE NOT {visible}
               AND NOT EXISTS (
                   SELECT 1 FROM pg_stat_activity a
                   WHERE a.backend_xid::text = (x::numeric % 4294967296)::text
                     AND a.state IN ('idle in transaction', 'idle in transaction (aborted)'))"
            ),
            &[(&xids, Type::TEXT_ARRAY)],
        )
        .await
        .map(|rows| rows[0].get(0))
        .map_err(|e| Error::postgres("checking the transactions in progress", e))
}

/// The sessions running `xids`, for the log: pid, state, since when, and
/// the start of the query, where the configured user may see them; prepared
/// transactions by gid.
pub(crate) async fn sessions_of(client: &Client, xids: &[String]) -> Result<String> {
    let rows = client
        .query(
            "SELECT format('pid %s (%s)', a.pid, COALESCE(
                 a.state || ' since ' || date_trunc('second', a.xact_start) || ': '
                     || left(regexp_replace(a.query, '\\s+', ' ', 'g'), 60),
                 'another user''s session: its state is shown to superusers and members of pg_read_all_stats'))
             FROM pg_stat_activity a
             WHERE a.backend_xid::text IN (SELECT (x::numeric % 4294967296)::text FROM unnest($1::text[]) x)
             UNION ALL
             SELECT format('prepared transaction %L', p.gid) FROM pg_prepared_xacts p
             WHERE p.transaction::text IN (SELECT (x::numeric % 4294967296)::text FROM unnest($1::text[]) x)",
            &[&xids],
        )
        .await
        .map_err(|e| Error::postgres("looking up the sessions in progress", e))?;
    let found: Vec<String> = rows.iter().filter_map(|r| r.get(0)).collect();
    Ok(if found.is_empty() {
        "none found (they may have just ended)".into()
    } else {
        found.join("; ")
    })
}
