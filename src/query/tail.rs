//! The NDJSON objects as tables: `waltail.changes` (the raw envelopes) and
//! the part of each table's history not compacted yet, typed as the
//! compacted history is.
//!
//! Objects are read when a query runs, one at a time per partition, each
//! turned into one Arrow batch, so memory holds a few objects, not the
//! archive. Filters on the seq and on `date` are pushed down to the scan,
//! which skips every object whose key (date, seq range) shows it cannot
//! match, without reading it; DataFusion still applies the filters to the
//! rows (pushdown is `Inexact`).

use std::fmt;
use std::sync::Arc;

use arrow::array::{ArrayRef, Date32Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use async_trait::async_trait;
use chrono::NaiveDate;
use datafusion::catalog::Session;
use datafusion::common::ScalarValue;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{BinaryExpr, Expr, Operator, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use futures::StreamExt;
use object_store::ObjectStore;
use serde_json::Value;

use super::catalog::{Archive, Object};
use crate::archive::listing;
use crate::error::ErrorKind;
use crate::lakehouse::change::TypedChange;
use crate::lakehouse::layout::{history_columns, history_schema};
use crate::lakehouse::read::{Envelope, type_change};
use crate::lakehouse::typing::TableShape;
use crate::{Error, Result};

/// What a tail table holds.
#[derive(Debug, Clone)]
pub(crate) enum TailKind {
    /// Every envelope, as written.
    Changes,
    /// One table's changes, typed: the history's columns.
    History(Arc<TableShape>),
}

impl TailKind {
    /// The column holding the seq.
    fn seq_column(&self) -> &'static str {
        match self {
            TailKind::Changes => "seq",
            TailKind::History(_) => "_seq",
        }
    }
}

/// The schema of `waltail.changes`.
pub(crate) fn changes_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("op", DataType::Utf8, false),
        Field::new("table", DataType::Utf8, false),
        Field::new("data", DataType::Utf8, true),
        Field::new("old", DataType::Utf8, true),
        Field::new("seq", DataType::Int64, false),
        Field::new("idempotency_key", DataType::Utf8, false),
        Field::new("commit_lsn", DataType::Utf8, false),
        Field::new("date", DataType::Date32, false),
    ]))
}

/// The history's columns plus `date`, the partition column.
pub(crate) fn history_table_schema(shape: &TableShape) -> SchemaRef {
    let mut fields: Vec<Field> = history_schema(shape)
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields.push(date_field());
    Arc::new(Schema::new(fields))
}

/// `date` as the history's partition column is typed.
pub(crate) fn date_field() -> Field {
    Field::new("date", DataType::Date32, false)
}

/// Seq and date ranges a scan needs (inclusive); objects outside are skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub min_seq: u64,
    pub max_seq: u64,
    /// Days since 1970-01-01.
    pub min_date: i32,
    pub max_date: i32,
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds {
            min_seq: 0,
            max_seq: u64::MAX,
            min_date: i32::MIN,
            max_date: i32::MAX,
        }
    }
}

impl Bounds {
    /// Narrows the bounds by the filters that compare `seq_column` or
    /// `date` with a constant (`=`, `<`, `<=`, `>`, `>=`, `BETWEEN`); other
    /// filters do not narrow them.
    pub(crate) fn narrow(mut self, filters: &[Expr], seq_column: &str) -> Bounds {
        for f in filters {
            self.narrow_one(f, seq_column);
        }
        self
    }

    fn narrow_one(&mut self, f: &Expr, seq_column: &str) {
        match f {
            Expr::BinaryExpr(BinaryExpr { left, op, right }) if *op == Operator::And => {
                self.narrow_one(left, seq_column);
                self.narrow_one(right, seq_column);
            }
            Expr::BinaryExpr(BinaryExpr { left, op, right }) => {
                let (column, op, value) = match (column_name(left), literal(right)) {
                    (Some(c), Some(v)) => (c, *op, v),
                    _ => match (literal(left), column_name(right)) {
                        (Some(v), Some(c)) => match op.swap() {
                            Some(op) => (c, op, v),
                            None => return,
                        },
                        _ => return,
                    },
                };
                self.compare(&column, op, value, seq_column);
            }
            Expr::Between(b) if !b.negated => {
                if let (Some(c), Some(low), Some(high)) =
                    (column_name(&b.expr), literal(&b.low), literal(&b.high))
                {
                    self.compare(&c, Operator::GtEq, low, seq_column);
                    self.compare(&c, Operator::LtEq, high, seq_column);
                }
            }
            _ => {}
        }
    }

    fn compare(&mut self, column: &str, op: Operator, value: &ScalarValue, seq_column: &str) {
        if column == seq_column {
            let Some(v) = as_i64(value) else { return };
            // Seqs start at 1; a bound below 0 or above u64 is no bound.
            let (lo, hi) = match op {
                Operator::Eq => (v, v),
                Operator::Gt => (v.saturating_add(1), i64::MAX),
                Operator::GtEq => (v, i64::MAX),
                Operator::Lt => (i64::MIN, v.saturating_sub(1)),
                Operator::LtEq => (i64::MIN, v),
                _ => return,
            };
            self.min_seq = self.min_seq.max(lo.max(0) as u64);
            if hi < 0 {
                self.max_seq = 0;
                self.min_seq = self.min_seq.max(1);
            } else if hi != i64::MAX {
                self.max_seq = self.max_seq.min(hi as u64);
            }
        } else if column == "date" {
            let Some(d) = as_days(value) else { return };
            let (lo, hi) = match op {
                Operator::Eq => (d, d),
                Operator::Gt => (d.saturating_add(1), i32::MAX),
                Operator::GtEq => (d, i32::MAX),
                Operator::Lt => (i32::MIN, d.saturating_sub(1)),
                Operator::LtEq => (i32::MIN, d),
                _ => return,
            };
            self.min_date = self.min_date.max(lo);
            self.max_date = self.max_date.min(hi);
        }
    }

    /// Whether an object may hold a change within the bounds.
    pub(crate) fn may_hold(&self, o: &Object) -> bool {
        let day = days(&o.date).unwrap_or(0);
        o.from_seq <= self.max_seq
            && o.last_seq >= self.min_seq
            && (self.min_date..=self.max_date).contains(&day)
    }
}

/// A bare column only: through a cast (`CAST(seq AS DOUBLE) < 100.5`,
/// `CAST(seq AS VARCHAR) < '5'`) the comparison is not the column's own
/// order, so it bounds nothing.
fn column_name(e: &Expr) -> Option<String> {
    match e {
        Expr::Column(c) => Some(c.name.clone()),
        _ => None,
    }
}

fn literal(e: &Expr) -> Option<&ScalarValue> {
    match e {
        Expr::Literal(v, _) if !v.is_null() => Some(v),
        _ => None,
    }
}

/// An integer literal's value; other types (a float, a string) would be
/// rounded or compared differently, so they bound nothing.
fn as_i64(v: &ScalarValue) -> Option<i64> {
    match v {
        ScalarValue::Int8(Some(n)) => Some(i64::from(*n)),
        ScalarValue::Int16(Some(n)) => Some(i64::from(*n)),
        ScalarValue::Int32(Some(n)) => Some(i64::from(*n)),
        ScalarValue::Int64(Some(n)) => Some(*n),
        ScalarValue::UInt8(Some(n)) => Some(i64::from(*n)),
        ScalarValue::UInt16(Some(n)) => Some(i64::from(*n)),
        ScalarValue::UInt32(Some(n)) => Some(i64::from(*n)),
        ScalarValue::UInt64(Some(n)) => i64::try_from(*n).ok(),
        _ => None,
    }
}

fn as_days(v: &ScalarValue) -> Option<i32> {
    match v {
        ScalarValue::Utf8(Some(s))
        | ScalarValue::Utf8View(Some(s))
        | ScalarValue::LargeUtf8(Some(s)) => days(s),
        // A timestamp has a time of day: `date < TIMESTAMP '... 12:00'`
        // keeps that day, so only a date bounds whole days.
        ScalarValue::Date32(Some(d)) => Some(*d),
        _ => None,
    }
}

/// `YYYY-MM-DD` as days since 1970-01-01.
pub(crate) fn days(date: &str) -> Option<i32> {
    let d = NaiveDate::parse_from_str(date, "%Y-%m-%d").ok()?;
    let epoch = NaiveDate::from_ymd_opt(1970, 1, 1).expect("valid");
    i32::try_from((d - epoch).num_days()).ok()
}

/// A tail table: the objects of a snapshot with seqs in `min_seq..=max_seq`.
#[derive(Debug)]
pub(crate) struct TailTable {
    store: Arc<dyn ObjectStore>,
    objects: Arc<Vec<Object>>,
    /// When set, the objects are every one of this archive's, listed at
    /// the first scan (`waltail.changes` reaches below compaction).
    every_of: Option<Arc<Archive>>,
    kind: TailKind,
    schema: SchemaRef,
    bounds: Bounds,
}

impl TailTable {
    pub(crate) fn new(
        store: Arc<dyn ObjectStore>,
        objects: Arc<Vec<Object>>,
        kind: TailKind,
        min_seq: u64,
        max_seq: Option<u64>,
    ) -> TailTable {
        let schema = match &kind {
            TailKind::Changes => changes_schema(),
            TailKind::History(shape) => history_table_schema(shape),
        };
        TailTable {
            store,
            objects,
            every_of: None,
            kind,
            schema,
            bounds: Bounds {
                min_seq,
                max_seq: max_seq.unwrap_or(u64::MAX),
                ..Bounds::default()
            },
        }
    }

    /// `waltail.changes` of `archive`: every object, listed when scanned,
    /// up to the snapshot's last seq (objects written since are left out,
    /// as the other tables of the query leave them out).
    pub(crate) fn every_change(archive: Arc<Archive>) -> TailTable {
        let mut table = TailTable::new(
            Arc::clone(&archive.store),
            Arc::new(Vec::new()),
            TailKind::Changes,
            0,
            Some(archive.max_seq.unwrap_or_else(|| archive.end_seq())),
        );
        table.every_of = Some(archive);
        table
    }
}

#[async_trait]
impl TableProvider for TailTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> DfResult<Vec<TableProviderFilterPushDown>> {
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let bounds = self.bounds.narrow(filters, self.kind.seq_column());
        let listed = match &self.every_of {
            Some(archive) => archive
                .every_object()
                .await
                .map_err(|e| DataFusionError::External(Box::new(e)))?,
            None => Arc::clone(&self.objects),
        };
        let objects: Vec<Object> = listed
            .iter()
            .filter(|o| bounds.may_hold(o))
            .cloned()
            .collect();
        tracing::debug!(
            read = objects.len(),
            of = listed.len(),
            ?bounds,
            "tail scan: objects that may match"
        );
        // Contiguous runs of objects per partition, at most target_partitions.
        let parts = state.config().target_partitions().max(1);
        let per = objects.len().div_ceil(parts).max(1);
        let mut partitions: Vec<Arc<dyn PartitionStream>> = objects
            .chunks(per)
            .map(|chunk| {
                Arc::new(TailPartition {
                    store: Arc::clone(&self.store),
                    objects: chunk.to_vec(),
                    kind: self.kind.clone(),
                    schema: Arc::clone(&self.schema),
                    bounds,
                }) as Arc<dyn PartitionStream>
            })
            .collect();
        if partitions.is_empty() {
            partitions.push(Arc::new(TailPartition {
                store: Arc::clone(&self.store),
                objects: Vec::new(),
                kind: self.kind.clone(),
                schema: Arc::clone(&self.schema),
                bounds,
            }));
        }
        Ok(Arc::new(StreamingTableExec::try_new(
            Arc::clone(&self.schema),
            partitions,
            projection,
            Vec::new(),
            false,
            limit,
        )?))
    }
}

/// One partition of a tail scan: some objects, read in order.
struct TailPartition {
    store: Arc<dyn ObjectStore>,
    objects: Vec<Object>,
    kind: TailKind,
    schema: SchemaRef,
    bounds: Bounds,
}

impl fmt::Debug for TailPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TailPartition")
            .field("objects", &self.objects.len())
            .finish()
    }
}

impl PartitionStream for TailPartition {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let store = Arc::clone(&self.store);
        let kind = self.kind.clone();
        let schema = Arc::clone(&self.schema);
        let bounds = self.bounds;
        let stream = futures::stream::iter(self.objects.clone())
            .then(move |o| {
                let (store, kind, schema) = (Arc::clone(&store), kind.clone(), Arc::clone(&schema));
                async move {
                    let body = listing::get_ndjson(store.as_ref(), &o.key)
                        .await
                        .map_err(|e| DataFusionError::External(Box::new(e)))?;
                    object_batch(&kind, &schema, &o, &body, &bounds)
                        .map_err(|e| DataFusionError::External(Box::new(e)))
                }
            })
            .filter(|b| futures::future::ready(!matches!(b, Ok(b) if b.num_rows() == 0)));
        Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            stream,
        ))
    }
}

/// The envelopes of one object as they reach a reader, with their line
/// index: each seq once, in the object's order.
pub(crate) fn envelopes<'a>(
    o: &'a Object,
    body: &'a [u8],
    bounds: &'a Bounds,
) -> impl Iterator<Item = Result<(usize, Envelope)>> + 'a {
    body.split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, line)| !line.is_empty())
        .filter_map(move |(n, line)| {
            let env: Envelope = match serde_json::from_slice(line) {
                Ok(e) => e,
                Err(e) => return Some(Err(bad_line(o, n, e.to_string()))),
            };
            (env.seq >= o.from_seq && env.seq >= bounds.min_seq && env.seq <= bounds.max_seq)
                .then_some(Ok((n, env)))
        })
}

/// The error of a line that cannot be read.
pub(crate) fn bad_line(o: &Object, n: usize, what: String) -> Error {
    Error::fatal(
        format!("{} line {}: {what}", o.key, n + 1),
        "archive objects are written by `waltail run`; restore this one from a copy, or move it away; a filter on seq or date that excludes it skips it",
    )
    .with_kind(ErrorKind::Archive)
}

/// One object's rows for a tail table.
fn object_batch(
    kind: &TailKind,
    schema: &SchemaRef,
    o: &Object,
    body: &[u8],
    bounds: &Bounds,
) -> Result<RecordBatch> {
    let day = days(&o.date).unwrap_or(0);
    let columns: Vec<ArrayRef> = match kind {
        TailKind::Changes => {
            let mut envs = Vec::new();
            for env in envelopes(o, body, bounds) {
                envs.push(env?.1);
            }
            let text = |f: &dyn Fn(&Envelope) -> Option<String>| -> ArrayRef {
                Arc::new(envs.iter().map(f).collect::<StringArray>())
            };
            vec![
                text(&|e| Some(e.op.clone())),
                text(&|e| Some(e.table.clone())),
                text(&|e| {
                    e.data
                        .as_ref()
                        .map(|d| Value::Object(d.clone()).to_string())
                }),
                text(&|e| e.old.as_ref().map(|d| Value::Object(d.clone()).to_string())),
                Arc::new(envs.iter().map(|e| e.seq as i64).collect::<Int64Array>()),
                text(&|e| Some(e.idempotency_key.clone())),
                text(&|e| Some(e.commit_lsn.clone())),
                Arc::new(Date32Array::from(vec![day; envs.len()])),
            ]
        }
        TailKind::History(shape) => {
            let changes = typed_changes(shape, o, body, bounds)?;
            let mut columns = history_columns(shape, &changes);
            columns.push(Arc::new(Date32Array::from(vec![day; changes.len()])));
            columns
        }
    };
    RecordBatch::try_new(Arc::clone(schema), columns)
        .map_err(|e| Error::bug(format!("cannot build the rows of {}: {e}", o.key)))
}

/// The changes of `shape`'s table in one object, typed.
pub(crate) fn typed_changes(
    shape: &TableShape,
    o: &Object,
    body: &[u8],
    bounds: &Bounds,
) -> Result<Vec<TypedChange>> {
    let mut out = Vec::new();
    for env in envelopes(o, body, bounds) {
        let (n, env) = env?;
        if env.table != shape.table {
            continue;
        }
        out.push(type_change(shape, env).map_err(|e| bad_line(o, n, e))?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use datafusion::prelude::{cast, col, lit};

    use super::*;

    fn obj(date: &str, first: u64, last: u64) -> Object {
        Object {
            key: format!("{first}"),
            date: date.into(),
            first_seq: first,
            last_seq: last,
            from_seq: first,
            written: chrono::DateTime::from_timestamp(0, 0).unwrap(),
        }
    }

    #[test]
    fn seq_and_date_filters_skip_objects_that_cannot_match() {
        let objects = [
            obj("2026-01-01", 1, 10),
            obj("2026-01-01", 11, 20),
            obj("2026-01-02", 21, 30),
        ];
        let kept = |filters: &[Expr], seq: &str| -> Vec<u64> {
            let b = Bounds::default().narrow(filters, seq);
            objects
                .iter()
                .filter(|o| b.may_hold(o))
                .map(|o| o.first_seq)
                .collect()
        };
        assert_eq!(kept(&[col("_seq").gt(lit(15i64))], "_seq"), [11, 21]);
        assert_eq!(kept(&[lit(10i64).gt_eq(col("_seq"))], "_seq"), [1]);
        assert_eq!(kept(&[col("seq").eq(lit(20i64))], "seq"), [11]);
        assert_eq!(
            kept(&[col("seq").between(lit(12i64), lit(22i64))], "seq"),
            [11, 21]
        );
        assert_eq!(
            kept(
                &[col("seq").gt(lit(5i64)).and(col("seq").lt(lit(11i64)))],
                "seq"
            ),
            [1]
        );
        assert_eq!(kept(&[col("date").eq(lit("2026-01-02"))], "seq"), [21]);
        assert_eq!(
            kept(
                &[col("date").lt(lit(ScalarValue::Date32(days("2026-01-02"))))],
                "seq"
            ),
            [1, 11]
        );
        // Other filters, and OR, narrow nothing.
        assert_eq!(
            kept(
                &[col("seq").gt(lit(25i64)).or(col("seq").lt(lit(2i64)))],
                "seq"
            ),
            [1, 11, 21]
        );
        assert_eq!(kept(&[col("_seq").gt(lit(25i64))], "seq"), [1, 11, 21]);
        assert_eq!(kept(&[col("seq").lt(lit(0i64))], "seq"), Vec::<u64>::new());
        // Through a cast, or against a float or a timestamp, the comparison
        // is not the column's own order: no bound (seq 20 < 20.5 is kept).
        assert_eq!(kept(&[col("seq").lt(lit(20.5f64))], "seq"), [1, 11, 21]);
        assert_eq!(
            kept(
                &[cast(col("seq"), DataType::Float64).lt(lit(20.5f64))],
                "seq"
            ),
            [1, 11, 21]
        );
        assert_eq!(
            kept(&[cast(col("seq"), DataType::Utf8).lt(lit("5"))], "seq"),
            [1, 11, 21]
        );
        assert_eq!(
            kept(
                &[col("date").lt(lit(ScalarValue::TimestampSecond(Some(1_767_268_800), None)))],
                "seq"
            ),
            [1, 11, 21]
        );
    }

    #[test]
    fn an_objects_repeated_seqs_and_out_of_bounds_seqs_are_left_out() {
        let mut o = obj("2026-01-01", 1, 3);
        o.from_seq = 2;
        let body = (1..=3)
            .map(|s| format!(r#"{{"op":"insert","table":"public.t","data":{{"id":{s}}},"old":null,"seq":{s},"idempotency_key":"k{s}","commit_lsn":"0/1"}}"#))
            .collect::<Vec<_>>()
            .join("\n");
        let bounds = Bounds {
            max_seq: 2,
            ..Bounds::default()
        };
        let seqs: Vec<u64> = envelopes(&o, body.as_bytes(), &bounds)
            .map(|e| e.unwrap().1.seq)
            .collect();
        assert_eq!(seqs, [2]);
        let batch = object_batch(
            &TailKind::Changes,
            &changes_schema(),
            &o,
            body.as_bytes(),
            &Bounds::default(),
        )
        .unwrap();
        assert_eq!(batch.num_rows(), 2);
        let bad = envelopes(&o, b"{not json", &bounds)
            .next()
            .unwrap()
            .unwrap_err();
        assert!(bad.to_string().contains("line 1"), "{bad}");
    }
}
