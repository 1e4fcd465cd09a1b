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
//! rows inserted into a watermark table, [`WATERMARK_TABLE`], which joins
//! the publication (the approach of Debezium's signalling table): each
//! insert is committed on its own and reaches the stream in commit order
//! like a message; the stream turns it into the same watermark and never
//! archives the table's changes. Each insert deletes the rows before it, so
//! the table stays empty but for the last watermark.

pub(crate) mod copy;
pub(crate) mod driver;
pub(crate) mod window;

pub(crate) use copy::read_chunk;

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio_postgres::Client;

use crate::config::{SourceConfig, TableName};
use crate::error::ErrorKind;
use crate::source::catalog::TypeCatalog;
use crate::source::pgoutput::{Column, Relation};
use crate::source::row::TableShape;
use crate::source::watermark::{
    MESSAGE_PREFIX, MESSAGES_VERSION, WATERMARK_TABLE, watermark_table,
};
use crate::sql::{quote_ident, quote_literal};
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
    fn has_xid8(self) -> bool {
        self.version >= 130000
    }
}
/// A chunk also ends at this many bytes of rendered rows, so wide rows keep
/// the memory of a chunk (read here, re-read by the pipeline) bounded.
const MAX_CHUNK_BYTES: usize = 16 << 20;

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
        client
            .execute(
                "SELECT pg_logical_emit_message(true, $1, $2)",
                &[&MESSAGE_PREFIX, &content],
            )
            .await
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

/// On a server older than [`MESSAGES_VERSION`]: creates
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
    client
        .query_one(list, &[])
        .await
        .map(|r| r.get(0))
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
        .query_one(
            &format!(
                "SELECT COALESCE(array_agg(x), '{{}}') FROM unnest($1::text[]) x
             WHERE NOT {visible}
               AND NOT EXISTS (
                   SELECT 1 FROM pg_stat_activity a
                   WHERE a.backend_xid::text = (x::numeric % 4294967296)::text
                     AND a.state IN ('idle in transaction', 'idle in transaction (aborted)'))"
            ),
            &[&xids],
        )
        .await
        .map(|r| r.get(0))
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

/// How one table is read: its columns as the stream sees them, and the key
/// that orders the chunks.
pub(crate) struct TablePlan {
    pub table: TableName,
    pub shape: TableShape,
    /// The schema record members the stream would write for this shape.
    pub members: String,
    /// `"a", "b"`: the published columns, in order.
    select_list: String,
    /// The key columns: quoted name, SQL type, place in the select list.
    key: Vec<(String, String, usize)>,
    /// What the key is, for messages ("primary key", "replica identity index").
    pub key_kind: &'static str,
    /// The key's one column, by name, if its type has no collation: the
    /// key space can be split into ranges (see [`split`]).
    splittable: Option<String>,
}

struct Attr {
    name: String,
    type_oid: u32,
    type_mod: i32,
    collatable: bool,
    type_name: String,
    attnum: i16,
}

/// Looks the table up and picks its key: the primary key, else the unique
/// index of REPLICA IDENTITY USING INDEX. Errors name the table and the fix.
pub(crate) async fn plan(catalog: &mut TypeCatalog, table: &TableName) -> Result<TablePlan> {
    let client = catalog
        .client()
        .ok_or_else(|| Error::fatal("backfill needs an SQL connection", "check source.url"))?;
    let pg = |what: &'static str| move |e| Error::postgres(format!("{what} of {table}"), e);
    let rel = client
        .query_opt(
            "SELECT c.oid, c.relreplident::text FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
            &[&table.schema, &table.name],
        )
        .await
        .map_err(pg("looking up the table"))?
        .ok_or_else(|| {
            Error::fatal(
                format!("table {table} does not exist"),
                "check the name (schema.table) and that the configured user can see it",
            )
            .with_kind(ErrorKind::Source)
        })?;
    let oid: u32 = rel.get(0);
    let identity: String = rel.get(1);
    let attrs: Vec<Attr> = client
        .query(
            "SELECT attname::text, atttypid, atttypmod, format_type(atttypid, atttypmod), attnum, attcollation <> 0
             FROM pg_attribute
             WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
             ORDER BY attnum",
            &[&oid],
        )
        .await
        .map_err(pg("reading the columns"))?
        .iter()
        .map(|r| Attr {
            name: r.get(0),
            type_oid: r.get(1),
            type_mod: r.get(2),
            type_name: r.get(3),
            attnum: r.get(4),
            collatable: r.get(5),
        })
        .collect();
    let index_columns = |which: &'static str| async move {
        client
            .query_opt(
                &format!(
                    "SELECT indkey::int2[] FROM pg_index WHERE indrelid = $1 AND {which} LIMIT 1"
                ),
                &[&oid],
            )
            .await
            .map(|r| r.map(|r| r.get::<_, Vec<i16>>(0)))
    };
    let primary = index_columns("indisprimary")
        .await
        .map_err(pg("reading the primary key"))?;
    let identity_index = index_columns("indisreplident")
        .await
        .map_err(pg("reading the replica identity"))?;
    // The columns pgoutput flags as the replica identity key: the row
    // identity of a change, which the chunk's rows must share.
    let identity_key: Vec<i16> = match identity.as_str() {
        "f" => attrs.iter().map(|a| a.attnum).collect(),
        "i" => identity_index.clone().unwrap_or_default(),
        "n" => {
            return Err(Error::fatal(
                format!(
                    "table {table} has REPLICA IDENTITY NOTHING, so changes to its rows cannot be matched with the rows a backfill reads"
                ),
                format!("ALTER TABLE {} REPLICA IDENTITY DEFAULT;", table.quoted()),
            ));
        }
        _ => primary.clone().unwrap_or_default(),
    };
    let (order_key, key_kind) = match (primary, identity_index) {
        (Some(k), _) => (k, "primary key"),
        (None, Some(k)) if identity == "i" => (k, "replica identity index"),
        _ => {
            return Err(Error::fatal(
                format!("table {table} has no primary key, so it cannot be read in chunks by key"),
                format!(
                    "add a primary key (ALTER TABLE {t} ADD PRIMARY KEY (...);), or make a unique index on NOT NULL columns \
                     its replica identity (ALTER TABLE {t} REPLICA IDENTITY USING INDEX <index>;), which backfill then uses",
                    t = table.quoted()
                ),
            )
            .with_kind(ErrorKind::Source));
        }
    };
    let mut key = Vec::with_capacity(order_key.len());
    for attnum in &order_key {
        let place = attrs.iter().position(|a| a.attnum == *attnum).ok_or_else(|| {
            Error::fatal(
                format!("the key of table {table} includes a generated column, which logical replication does not carry"),
                "give the table a key over ordinary columns",
            )
            .with_kind(ErrorKind::Source)
        })?;
        let a = &attrs[place];
        key.push((quote_ident(&a.name), a.type_name.clone(), place));
    }
    let splittable = match key.as_slice() {
        [(_, _, place)] if !attrs[*place].collatable => Some(attrs[*place].name.clone()),
        _ => None,
    };
    let mut types = Vec::with_capacity(attrs.len());
    for a in &attrs {
        types.push(catalog.resolve(a.type_oid, a.type_mod).await);
    }
    let relation = Relation {
        rel_id: oid,
        namespace: table.schema.clone(),
        name: table.name.clone(),
        replica_identity: identity.as_bytes().first().copied().unwrap_or(b'd'),
        columns: attrs
            .iter()
            .map(|a| Column {
                flags: u8::from(identity_key.contains(&a.attnum)),
                name: a.name.clone(),
                type_oid: a.type_oid,
                type_modifier: a.type_mod,
            })
            .collect(),
    };
    let (shape, schema) = TableShape::new(&relation, &types);
    let select_list = attrs
        .iter()
        .map(|a| quote_ident(&a.name))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(TablePlan {
        table: table.clone(),
        shape,
        members: schema.members,
        select_list,
        key,
        key_kind,
        splittable,
    })
}

/// The size of a table before it is read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Estimate {
    pub rows: u64,
    /// `rows` is a count, not the planner's statistics.
    pub exact: bool,
    pub bytes: u64,
}

/// Tables estimated below this many rows are counted exactly.
const COUNT_BELOW: f64 = 100_000.0;

/// Rows from the planner's statistics (summed over partitions), counted
/// exactly when the table is small or was never analyzed; bytes on disk.
pub(crate) async fn estimate(client: &Client, table: &TableName) -> Result<Estimate> {
    let pg = |what: &'static str| move |e| Error::postgres(format!("{what} of {table}"), e);
    let row = client
        .query_one(
            "SELECT COALESCE(SUM(GREATEST(c.reltuples, 0)), 0)::float8,
                    bool_or(c.reltuples < 0 OR (c.reltuples = 0 AND c.relpages > 0)),
                    COALESCE(SUM(pg_total_relation_size(t.relid)), 0)::int8
             FROM (SELECT relid FROM pg_partition_tree($1::text::regclass) WHERE isleaf
                   UNION SELECT $1::text::regclass) t
             JOIN pg_class c ON c.oid = t.relid
             WHERE c.relkind = 'r'",
            &[&table.quoted()],
        )
        .await
        .map_err(pg("estimating the size"))?;
    let stats: f64 = row.get(0);
    let unknown: Option<bool> = row.get(1);
    let bytes: i64 = row.get(2);
    let (rows, exact) = if stats < COUNT_BELOW || unknown.unwrap_or(true) {
        let n: i64 = client
            .query_one(&format!("SELECT count(*) FROM {}", table.quoted()), &[])
            .await
            .map_err(pg("counting the rows"))?
            .get(0);
        (n as u64, true)
    } else {
        (stats as u64, false)
    };
    Ok(Estimate {
        rows,
        exact,
        bytes: bytes as u64,
    })
}

/// Splits the key space of `plan`'s table into up to `parts` ranges of
/// about equal rows, from the planner's histogram of the key (`pg_stats`),
/// so several readers start at once. Only a key of one column whose type
/// has no collation is split: the bounds are sorted and compared by the
/// type's own order, the same as the chunks' `ORDER BY` and key filters,
/// so the ranges cover every key exactly once. Any other key, or a table
/// without statistics, is one range (read by one reader, chunk after chunk).
pub(crate) async fn split(
    client: &Client,
    plan: &TablePlan,
    parts: usize,
) -> Result<Vec<(Option<String>, Option<String>)>> {
    let whole = vec![(None, None)];
    let Some(column) = plan.splittable.as_ref().filter(|_| parts > 1) else {
        return Ok(whole);
    };
    let type_name = &plan.key[0].1;
    let table = &plan.table;
    // The histogram of a partitioned table is on its root (inherited = true).
    let bounds: Vec<String> = client
        .query(
            &format!(
                "SELECT b::text FROM (
                     SELECT DISTINCT b::{type_name} AS b FROM pg_stats s,
                         unnest(s.histogram_bounds::text::text[]) b
                     WHERE s.schemaname = $1 AND s.tablename = $2 AND s.attname = $3) x
                 ORDER BY x.b"
            ),
            &[&table.schema, &table.name, column],
        )
        .await
        .map_err(|e| Error::postgres(format!("reading the key statistics of {table}"), e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if bounds.len() < 3 {
        return Ok(whole);
    }
    // parts - 1 cut points, evenly through the bounds (each histogram bucket
    // holds about the same number of rows); the ends stay open.
    let inner = &bounds[1..bounds.len() - 1];
    let cuts = (parts - 1).min(inner.len());
    let mut points: Vec<String> = (1..=cuts)
        .map(|i| inner[(i * inner.len()) / (cuts + 1)].clone())
        .collect();
    points.dedup();
    let key = |v: &String| serde_json::to_string(&[v]).expect("strings serialise");
    let mut ranges = Vec::with_capacity(points.len() + 1);
    let mut lo = None;
    for p in &points {
        ranges.push((lo.clone(), Some(key(p))));
        lo = Some(key(p));
    }
    ranges.push((lo, None));
    Ok(ranges)
}

/// Rows read for one chunk.
pub(crate) struct ChunkRows {
    /// `(row identity hash, data JSON)` in key order.
    pub rows: Vec<(u64, Vec<u8>)>,
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
