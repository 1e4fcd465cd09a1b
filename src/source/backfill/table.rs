//! What a backfill reads of one table: its columns as the stream renders
//! them and the key that orders its chunks ([`plan`]), its size before it
//! is read ([`estimate`]), and its key space cut into ranges for parallel
//! readers ([`split`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio_postgres::Client;
use tokio_postgres::types::Type;

use crate::checkpoint::ChunkBody;
use crate::config::TableName;
use crate::error::ErrorKind;
use crate::source::catalog::TypeCatalog;
use crate::source::pgoutput::{Column, Relation};
use crate::source::row::TableShape;
use crate::sql::quote_ident;
use crate::{Error, Result};

/// How one table is read: its columns as the stream sees them, and the key
/// that orders the chunks.
pub(crate) struct TablePlan {
    pub table: TableName,
    pub shape: TableShape,
    /// The schema record members the stream would write for this shape.
    pub members: String,
    /// `"a", "b"`: the published columns, in order.
    pub(crate) select_list: String,
    /// The key columns: quoted name, SQL type, place in the select list.
    pub(crate) key: Vec<(String, String, usize)>,
    /// What the key is, for messages ("primary key", "replica identity index").
    pub key_kind: &'static str,
    /// The key's one column, by name, if its type has no collation: the
    /// key space can be split into ranges (see [`split`]).
    splittable: Option<String>,
    /// The bytes of a rendered row in the last chunk read (0: none yet),
    /// so the next chunk's buffer is sized once rather than grown.
    row_bytes: AtomicUsize,
}

impl TablePlan {
    /// The bytes of a rendered row in the last chunk read; 0 before one.
    pub(crate) fn row_bytes(&self) -> usize {
        self.row_bytes.load(Ordering::Relaxed)
    }

    /// Notes the size of the rows of a chunk just read.
    pub(crate) fn note_rows(&self, rows: &ChunkBody) {
        if let Some(each) = rows.data_bytes().checked_div(rows.len()) {
            self.row_bytes.store(each, Ordering::Relaxed);
        }
    }
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
        row_bytes: AtomicUsize::new(0),
    })
}

/// What [`plan`] reads of the catalog, as one text: the table's oid and
/// replica identity, its columns, and its primary key and replica identity
/// index. A plan stays good while this text is the same.
const CATALOG_PRINT: &str = "
SELECT c.oid::text || ' ' || c.relreplident::text
    || ' ' || COALESCE((SELECT string_agg(format('%s:%I:%s:%s:%s:%s', a.attnum, a.attname, a.atttypid,
                                                 a.atttypmod, a.attgenerated, a.attcollation), ','
                                          ORDER BY a.attnum)
                        FROM pg_attribute a
                        WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '')
    || ' ' || COALESCE((SELECT string_agg(format('%s:%s:%s:%s', i.indexrelid, i.indkey::text,
                                                 i.indisprimary, i.indisreplident), ','
                                          ORDER BY i.indexrelid)
                        FROM pg_index i
                        WHERE i.indrelid = c.oid AND (i.indisprimary OR i.indisreplident)), '')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')";

/// A reader's plans, made again only when the table's catalog entry
/// changed. Every chunk checks (a column added or dropped meanwhile is read
/// and recorded as it now is), but the check is one round trip, where
/// planning takes several queries: at the default chunk size the plan
/// alone took about a fifth of a chunk's time.
#[derive(Default)]
pub(crate) struct Plans {
    last: Option<(String, Arc<TablePlan>)>,
}

impl Plans {
    /// The plan of `table` as the catalog now is.
    pub(crate) async fn get(
        &mut self,
        catalog: &mut TypeCatalog,
        table: &TableName,
    ) -> Result<Arc<TablePlan>> {
        let client = catalog
            .client()
            .ok_or_else(|| Error::fatal("backfill needs an SQL connection", "check source.url"))?;
        let now: Option<String> = client
            .query_typed(
                CATALOG_PRINT,
                &[(&table.schema, Type::TEXT), (&table.name, Type::TEXT)],
            )
            .await
            .map_err(|e| Error::postgres(format!("looking up table {table}"), e))?
            .first()
            .map(|r| r.get(0));
        // The print starts with the table's oid: another table never matches.
        if let (Some(now), Some((then, plan))) = (&now, &self.last)
            && now == then
        {
            return Ok(plan.clone());
        }
        let plan = Arc::new(plan(catalog, table).await?);
        // No print: `plan` said why (the table is gone).
        self.last = now.map(|now| (now, plan.clone()));
        Ok(plan)
    }
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
