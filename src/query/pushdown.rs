//! Which filters a Parquet scan evaluates while it decodes.
//!
//! Evaluated while decoding ("late materialization"), a filter decodes its
//! own columns first and the others only for the rows that pass. That pays
//! when few rows pass and the other columns are wide: a key looked up with
//! `SELECT *` decodes one row's text instead of a page's. It costs when
//! many rows pass, or when the other columns are narrow: the rows that pass
//! are scattered, and decoding a column at scattered rows is slower than
//! decoding it whole and filtering after. Measured over the latest view of
//! 894,140 rows and a history of 5,000,000 changes (`KEEP=1 SCALE=1
//! scripts/bench-query.sh`'s archive; the fastest of 5 to 11 whole
//! `waltail query` processes): `WHERE id = <key>` 16 ms with it and 30 ms
//! without; a range of `updated_at` that 1.9% of the rows pass, 23 ms with
//! it and 20 ms without; the history's updates (84% of its rows) joined to
//! the view, 83 ms with it and 70 ms without.
//!
//! DataFusion decides this per session. Here it is decided per scan, from
//! the scan's filters: a scan evaluates its filters while decoding only when
//! one of them compares a column to constants for equality (`=`, `IN`, or
//! an `OR` of those), which in an archive's tables is a key, an id or a
//! value looked up, except for `_op`, which has three values. Every scan
//! prunes files, row groups and pages with all of its filters either way.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::datasource::TableType;
use datafusion::datasource::listing::ListingTable;
use datafusion::datasource::physical_plan::{FileScanConfig, FileScanConfigBuilder, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result as DfResult;
use datafusion::logical_expr::{BinaryExpr, Operator, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::Expr;

/// The column of a change's operation: `insert`, `update` or `delete`.
const OP_COLUMN: &str = "_op";

/// A Parquet table (a [`ListingTable`]) whose scans evaluate their filters
/// while decoding when [`selective`] says they should.
#[derive(Debug)]
pub(crate) struct ParquetScan {
    inner: Arc<ListingTable>,
}

impl ParquetScan {
    pub(crate) fn new(inner: Arc<ListingTable>) -> Self {
        ParquetScan { inner }
    }
}

#[async_trait]
impl TableProvider for ParquetScan {
    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }

    fn table_type(&self) -> TableType {
        self.inner.table_type()
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> DfResult<Vec<TableProviderFilterPushDown>> {
        self.inner.supports_filters_pushdown(filters)
    }

    fn statistics(&self) -> Option<datafusion::common::Statistics> {
        self.inner.statistics()
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let plan = self.inner.scan(state, projection, filters, limit).await?;
        if !selective(filters) {
            return Ok(plan);
        }
        Ok(decoding_filters(&plan).unwrap_or(plan))
    }
}

/// Whether a scan with `filters` should evaluate them while decoding: one
/// of them is a [`lookup`].
pub(crate) fn selective(filters: &[Expr]) -> bool {
    filters.iter().any(lookup)
}

/// A column other than [`OP_COLUMN`] compared to constants for equality:
/// `=`, `IN`, or `OR` of those (which is what DataFusion makes of a short
/// `IN` list).
fn lookup(f: &Expr) -> bool {
    match f {
        Expr::BinaryExpr(BinaryExpr {
            left,
            op: Operator::Or,
            right,
        }) => lookup(left) && lookup(right),
        Expr::BinaryExpr(BinaryExpr {
            left,
            op: Operator::Eq,
            right,
        }) => match (left.as_ref(), right.as_ref()) {
            (Expr::Column(c), v) | (v, Expr::Column(c)) => c.name != OP_COLUMN && constant(v),
            _ => false,
        },
        Expr::InList(list) if !list.negated => match list.expr.as_ref() {
            Expr::Column(c) => c.name != OP_COLUMN && list.list.iter().all(constant),
            _ => false,
        },
        _ => false,
    }
}

fn constant(e: &Expr) -> bool {
    match e {
        Expr::Literal(..) => true,
        Expr::Cast(c) => constant(&c.expr),
        Expr::TryCast(c) => constant(&c.expr),
        _ => false,
    }
}

/// `plan`, a Parquet scan, with its filters evaluated while decoding; `None`
/// when `plan` is not one (no files: an empty plan).
fn decoding_filters(plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
    let exec = plan.downcast_ref::<DataSourceExec>()?;
    let config = exec.data_source().downcast_ref::<FileScanConfig>()?;
    let source = config
        .file_source()
        .downcast_ref::<ParquetSource>()?
        .clone()
        .with_pushdown_filters(true)
        .with_reorder_filters(true);
    let config = FileScanConfigBuilder::from(config.clone())
        .with_source(Arc::new(source))
        .build();
    Some(DataSourceExec::from_data_source(config))
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::file_format::parquet::ParquetFormat;
    use datafusion::datasource::listing::{ListingOptions, ListingTableConfig, ListingTableUrl};
    use datafusion::prelude::{SessionContext, col, in_list, lit};
    use parquet::arrow::ArrowWriter;

    use super::*;
    use crate::query::plans::plan_and_answer;

    /// `t (id, status)`: 1,000 rows of one Parquet file as a [`ParquetScan`],
    /// in a session that does not evaluate filters while decoding (as
    /// [`crate::query::session`]'s), and the folder's guard.
    async fn session() -> (SessionContext, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("status", DataType::Utf8, false),
        ]));
        let file = std::fs::File::create(dir.path().join("t.parquet")).unwrap();
        let mut writer = ArrowWriter::try_new(file, Arc::clone(&schema), None).unwrap();
        let ids: Vec<i64> = (0..1000).collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ids.clone())),
                Arc::new(StringArray::from_iter_values(
                    ids.iter().map(|i| format!("s{}", i % 3)),
                )),
            ],
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        let url = ListingTableUrl::parse(format!("{}/", dir.path().display())).unwrap();
        let config = ListingTableConfig::new(url)
            .with_listing_options(ListingOptions::new(Arc::new(ParquetFormat::default())))
            .with_schema(schema);
        let table = ParquetScan::new(Arc::new(ListingTable::try_new(config).unwrap()));
        let ctx = SessionContext::new();
        assert!(
            !ctx.state()
                .config()
                .options()
                .execution
                .parquet
                .pushdown_filters
        );
        ctx.register_table("t", Arc::new(table)).unwrap();
        (ctx, dir)
    }

    #[tokio::test]
    async fn a_lookup_is_filtered_while_decoding_and_a_range_after() {
        let (ctx, _dir) = session().await;
        // Evaluated in the scan: no FilterExec above it.
        let (plan, answer) = plan_and_answer(&ctx, "SELECT status FROM t WHERE id = 7").await;
        assert!(!plan.contains("FilterExec"), "{plan}");
        assert!(answer.contains("s1"), "{answer}");
        let (plan, answer) =
            plan_and_answer(&ctx, "SELECT count(*) FROM t WHERE id IN (7, 8, 2000)").await;
        assert!(!plan.contains("FilterExec"), "{plan}");
        assert!(answer.contains("| 2 "), "{answer}");
        // Filtered above the scan (which still prunes with it).
        let (plan, answer) = plan_and_answer(&ctx, "SELECT count(*) FROM t WHERE id < 10").await;
        assert!(plan.contains("FilterExec"), "{plan}");
        assert!(answer.contains("| 10 "), "{answer}");
        let (plan, answer) =
            plan_and_answer(&ctx, "SELECT count(*) FROM t WHERE id < 10 OR id = 500").await;
        assert!(plan.contains("FilterExec"), "{plan}");
        assert!(answer.contains("| 11 "), "{answer}");
    }

    #[test]
    fn equality_on_a_column_other_than_the_op_is_selective() {
        assert!(selective(&[col("id").eq(lit(7))]));
        assert!(selective(&[lit("k").eq(col("_key"))]));
        assert!(selective(&[in_list(
            col("id"),
            vec![lit(1), lit(2)],
            false
        )]));
        assert!(selective(&[
            col("_op").eq(lit("update")),
            col("id").eq(lit(7))
        ]));
        assert!(selective(&[col("id")
            .eq(lit(7))
            .or(col("_key").eq(lit("k")))]));
    }

    #[test]
    fn ranges_the_op_and_negations_are_not() {
        assert!(!selective(&[]));
        assert!(!selective(&[col("_op").eq(lit("update"))]));
        assert!(!selective(&[col("account").lt(lit(500))]));
        assert!(!selective(&[col("id").is_not_null()]));
        assert!(!selective(&[col("id").not_eq(lit(7))]));
        assert!(!selective(&[in_list(col("id"), vec![lit(1)], true)]));
        assert!(!selective(&[col("a").eq(col("b"))]));
        assert!(!selective(&[col("id").eq(lit(7)).or(col("id").lt(lit(3)))]));
        assert!(!selective(&[col("id")
            .eq(lit(7))
            .or(col("_op").eq(lit("delete")))]));
    }
}
