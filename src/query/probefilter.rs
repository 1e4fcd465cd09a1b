//! A filter on a history's `_op` below the probe side of a hash join,
//! evaluated by the join on the rows it matched instead.
//!
//! DataFusion pushes every filter as far down as it goes: `WHERE h._op =
//! 'update'` in a join of the latest view to the history is evaluated on
//! every change the history's scans read, and the rows that pass are
//! copied before the join looks them up. A filter on `_op` usually passes
//! most rows (it has three values, and an archive is mostly updates, or
//! mostly inserts), while a join to a filtered side often matches few.
//! [`ProbeFilterInJoin`] makes the predicate the join's filter, evaluated
//! on the rows the join matched, and puts an [`EarlyFilter`] where the
//! filter was: it filters only where a partition's first batch shows that
//! few rows pass (`_op = 'delete'`), sparing the join their lookups, and
//! passes the batches of a common operation on as they are.
//!
//! Taken only where the join's build side is filtered (a filter or a scan
//! that filters while decoding): a build side of every row of a view
//! matches nearly every change of its history, and the join would then
//! evaluate the predicate on every change after looking up the ones the
//! filter would have taken out. Measured on the archive of `KEEP=1 SCALE=1
//! scripts/bench-query.sh` (5,100,000 changes; medians of 9 whole
//! processes, alternated), the latest view joined to the history's
//! updates:
//! - for the rows of 200 accounts of 10,000: 71.3 -> 57.0 ms;
//! - for every row (the rule does not apply): 145.7 and 139.8 ms;
//! - the history's deletes, for 200 accounts: 53.1 and 53.9 ms;
//! - for 9,000 accounts of 10,000, a filter that keeps most rows: 140.5 ->
//!   156.3 ms, the case where the rule costs.
//!
//! The rule takes an inner [`HashJoinExec`] without a join filter whose
//! probe side is a [`FilterExec`] on `_op` alone, or a union (or a
//! repartitioning) of such filters with one predicate (the history: one
//! scan per day). Any other plan is left as it is.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::compute::filter_record_batch;
use arrow::datatypes::{DataType, Field, Schema};
use datafusion::common::cast::as_boolean_array;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::common::{JoinSide, ScalarValue};
use datafusion::config::ConfigOptions;
use datafusion::datasource::physical_plan::{FileScanConfig, FileSource, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result as DfResult;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::logical_expr::JoinType;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{CastExpr, Column, Literal};
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::HashJoinExec;
use datafusion::physical_plan::joins::utils::{ColumnIndex, JoinFilter};
use datafusion::physical_plan::metrics::BaselineMetrics;
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::union::UnionExec;
use futures::StreamExt;
use futures::stream::BoxStream;

use crate::query::operator::{BatchStep, StepExec};

/// The history's column of each change's operation.
const OP: &str = "_op";

/// See the module doc.
#[derive(Debug, Default)]
pub(crate) struct ProbeFilterInJoin;

impl PhysicalOptimizerRule for ProbeFilterInJoin {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            if *join.join_type() != JoinType::Inner
                || join.filter().is_some()
                || !narrowed(join.left())
            {
                return Ok(Transformed::no(node));
            }
            let Some((right, predicate)) = unfiltered(join.right())? else {
                return Ok(Transformed::no(node));
            };
            // The filter reads the probe side's columns it names, in order.
            let schema = right.schema();
            let mut read: Vec<usize> = collect_columns(&predicate)
                .iter()
                .map(Column::index)
                .collect();
            read.sort_unstable();
            let expression = renumbered(&predicate, &read)?;
            let filter = JoinFilter::new(
                expression,
                read.iter()
                    .map(|&index| ColumnIndex {
                        index,
                        side: JoinSide::Right,
                    })
                    .collect(),
                Arc::new(Schema::new(
                    read.iter()
                        .map(|&i| schema.field(i).clone())
                        .collect::<Vec<Field>>(),
                )),
            );
            // The columns the join gave before: the probe side's new ones
            // come after them.
            let before = join.left().schema().fields().len() + join.right().schema().fields().len();
            let projection = match &join.projection {
                Some(p) => p.to_vec(),
                None => (0..before).collect(),
            };
            let new = join
                .builder()
                .with_new_children(vec![Arc::clone(join.left()), right])?
                .with_filter(Some(filter))
                .with_projection(Some(projection))
                .recompute_properties()
                .reset_state()
                .build_exec()?;
            Ok(Transformed::yes(new))
        })
        .data()
    }

    fn name(&self) -> &str {
        "waltail_probe_filter_in_join"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether the build side `plan` keeps only some of its rows: a filter,
/// or a scan that filters while it decodes, anywhere in it. A build side
/// of every row of a table matches nearly every change of its history,
/// and then the join would evaluate the predicate on every change, after
/// looking up the ones a filter before it would have taken out.
fn narrowed(plan: &Arc<dyn ExecutionPlan>) -> bool {
    let filters = plan.is::<FilterExec>()
        || plan
            .downcast_ref::<DataSourceExec>()
            .and_then(|e| e.data_source().downcast_ref::<FileScanConfig>())
            .and_then(|c| c.file_source().downcast_ref::<ParquetSource>())
            .is_some_and(|p| {
                p.filter().is_some() && p.table_parquet_options().global.pushdown_filters
            });
    filters || plan.children().into_iter().any(narrowed)
}

/// Whether `predicate` reads `_op` and nothing else.
fn on_op(predicate: &Arc<dyn PhysicalExpr>) -> bool {
    let columns = collect_columns(predicate);
    !columns.is_empty() && columns.iter().all(|c| c.name() == OP)
}

/// `expr` with its text literals as views: the text it compares is read
/// as views (see [`unfiltered`]).
fn with_views(expr: &Arc<dyn PhysicalExpr>) -> DfResult<Arc<dyn PhysicalExpr>> {
    Arc::clone(expr)
        .transform(|e| {
            let Some(l) = e.downcast_ref::<Literal>() else {
                return Ok(Transformed::no(e));
            };
            match l.value() {
                ScalarValue::Utf8(v) | ScalarValue::LargeUtf8(v) => Ok(Transformed::yes(Arc::new(
                    Literal::new(ScalarValue::Utf8View(v.clone())),
                )
                    as Arc<dyn PhysicalExpr>)),
                _ => Ok(Transformed::no(e)),
            }
        })
        .data()
}

/// `expr` with each column's index replaced by its place in `read`.
fn renumbered(expr: &Arc<dyn PhysicalExpr>, read: &[usize]) -> DfResult<Arc<dyn PhysicalExpr>> {
    Arc::clone(expr)
        .transform(|e| {
            let Some(c) = e.downcast_ref::<Column>() else {
                return Ok(Transformed::no(e));
            };
            let at = read
                .iter()
                .position(|&i| i == c.index())
                .expect("every column read is in the list");
            Ok(Transformed::yes(
                Arc::new(Column::new(c.name(), at)) as Arc<dyn PhysicalExpr>
            ))
        })
        .data()
}

/// A probe side without its filter on `_op`, and the filter's predicate.
type Unfiltered = (Arc<dyn ExecutionPlan>, Arc<dyn PhysicalExpr>);

/// The probe side `plan` without its filter on `_op`, and the filter's
/// predicate over it: its columns are the plan's, then those the filter
/// read that the plan did not pass on. `None`: not such a plan.
fn unfiltered(plan: &Arc<dyn ExecutionPlan>) -> DfResult<Option<Unfiltered>> {
    if let Some(filter) = plan.downcast_ref::<FilterExec>() {
        let predicate = filter.predicate();
        if !on_op(predicate) {
            return Ok(None);
        }
        let input = filter.input();
        let schema = input.schema();
        // The filter's columns, then those its predicate reads that it
        // leaves out: text as views, as the history's columns are (a
        // union's branches may read `_op` as plain text below their casts).
        let mut kept: Vec<usize> = match filter.projection() {
            Some(p) => p.to_vec(),
            None => (0..schema.fields().len()).collect(),
        };
        let passed = kept.len();
        let text = |i: usize| {
            matches!(
                schema.field(i).data_type(),
                DataType::Utf8 | DataType::LargeUtf8
            )
        };
        if collect_columns(predicate)
            .iter()
            .any(|c| kept.contains(&c.index()) && text(c.index()))
        {
            // Compared as plain text above: left as it is.
            return Ok(None);
        }
        let mut read: Vec<usize> = collect_columns(predicate)
            .iter()
            .map(Column::index)
            .filter(|i| !kept.contains(i))
            .collect();
        read.sort_unstable();
        kept.extend(read);
        let exprs = kept
            .iter()
            .enumerate()
            .map(|(at, &i)| {
                let field = schema.field(i);
                let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(field.name(), i));
                let expr = match at >= passed && text(i) {
                    true => Arc::new(CastExpr::new(column, DataType::Utf8View, None)),
                    false => column,
                };
                ProjectionExpr::new(expr, field.name().clone())
            })
            .collect::<Vec<_>>();
        let projected = Arc::new(ProjectionExec::try_new(exprs, Arc::clone(input))?);
        let predicate = with_views(&renumbered(predicate, &kept)?)?;
        let early = Arc::new(EarlyFilter::exec(projected, Arc::clone(&predicate)));
        return Ok(Some((early, predicate)));
    }
    if let Some(repartition) = plan.downcast_ref::<RepartitionExec>() {
        // Its partitioning reads the input's columns, which keep their places.
        let Some((input, predicate)) = unfiltered(repartition.input())? else {
            return Ok(None);
        };
        let options = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
        let plan = Arc::clone(plan).replace_children(vec![input], options)?;
        return Ok(Some((plan, predicate)));
    }
    if let Some(union) = plan.downcast_ref::<UnionExec>() {
        let mut children = Vec::new();
        let mut predicate: Option<Arc<dyn PhysicalExpr>> = None;
        for child in union.children() {
            let Some((child, p)) = unfiltered(child)? else {
                return Ok(None);
            };
            match &predicate {
                None => predicate = Some(p),
                Some(q) if q.as_ref() == p.as_ref() => {}
                Some(_) => return Ok(None),
            }
            children.push(child);
        }
        let Some(predicate) = predicate else {
            return Ok(None);
        };
        // The branches must agree on their columns' types, as a union's do.
        let types = |c: &Arc<dyn ExecutionPlan>| -> Vec<DataType> {
            c.schema()
                .fields()
                .iter()
                .map(|f| f.data_type().clone())
                .collect()
        };
        if children.iter().any(|c| types(c) != types(&children[0])) {
            return Ok(None);
        }
        return Ok(Some((UnionExec::try_new(children)?, predicate)));
    }
    Ok(None)
}

/// A filter that filters only where it takes out many rows: each input
/// partition's first batch tells. Below a join that evaluates the same
/// predicate on what it matched (see the module doc), it keeps a filter on
/// a rare operation (`_op = 'delete'`) before the join, where it spares
/// the join most of its lookups, and passes the batches of a common one on
/// as they are. A [`StepExec`] with it shows as `EarlyFilterExec`.
#[derive(Debug)]
pub(crate) struct EarlyFilter;

/// The share of a partition's first batch's rows at or below which
/// [`EarlyFilter`] filters.
const EARLY: (usize, usize) = (1, 2);

impl EarlyFilter {
    fn exec(input: Arc<dyn ExecutionPlan>, predicate: Arc<dyn PhysicalExpr>) -> StepExec {
        StepExec::new(input, predicate, Arc::new(EarlyFilter))
    }
}

impl BatchStep for EarlyFilter {
    fn name(&self) -> &'static str {
        "EarlyFilterExec"
    }

    fn renewed(&self) -> Arc<dyn BatchStep> {
        Arc::new(EarlyFilter)
    }

    fn stream(
        &self,
        input: SendableRecordBatchStream,
        predicate: Arc<dyn PhysicalExpr>,
        baseline: BaselineMetrics,
    ) -> BoxStream<'static, DfResult<RecordBatch>> {
        // None until a batch with rows tells whether to filter.
        let mut filtering: Option<bool> = None;
        input
            .map(move |batch| {
                let batch = batch?;
                if filtering == Some(false) || batch.num_rows() == 0 {
                    baseline.record_output(batch.num_rows());
                    return Ok(batch);
                }
                let timer = baseline.elapsed_compute().timer();
                let mask = predicate.evaluate(&batch)?.into_array(batch.num_rows())?;
                let mask = as_boolean_array(&mask)?;
                let filter = *filtering.get_or_insert_with(|| {
                    mask.true_count() * EARLY.1 <= batch.num_rows() * EARLY.0
                });
                let out = match filter {
                    true => filter_record_batch(&batch, mask)?,
                    false => batch,
                };
                timer.done();
                baseline.record_output(out.num_rows());
                Ok(out)
            })
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, RecordBatch, StringViewArray};
    use datafusion::prelude::SessionContext;

    use super::*;
    use crate::query::plans::{plan_and_answer, without_and_with};

    /// `l (id, account)`: 300 keys; `h1` and `h2 (id, amount, _op)`: 2,000
    /// changes each, mostly updates, over 1,000 ids; in two sessions, one
    /// with the rule.
    fn sessions() -> (SessionContext, SessionContext) {
        let latest = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, false),
                Field::new("account", DataType::Int64, false),
            ])),
            vec![
                Arc::new(Int64Array::from_iter_values((0..300).map(|i| i * 3))),
                Arc::new(Int64Array::from_iter_values((0..300).map(|i| i % 50))),
            ],
        )
        .unwrap();
        let history = |seed: i64| {
            RecordBatch::try_new(
                Arc::new(Schema::new(vec![
                    Field::new("id", DataType::Int64, true),
                    Field::new("amount", DataType::Int64, true),
                    Field::new("_op", DataType::Utf8View, false),
                ])),
                vec![
                    Arc::new(Int64Array::from_iter(
                        (0..2_000).map(|i| (i % 13 != 0).then_some((i * 7 + seed) % 1_000)),
                    )),
                    Arc::new(Int64Array::from_iter_values((0..2_000).map(|i| i + seed))),
                    Arc::new(StringViewArray::from_iter_values((0..2_000).map(
                        |i| match i % 10 {
                            0 => "insert",
                            1 => "delete",
                            _ => "update",
                        },
                    ))),
                ],
            )
            .unwrap()
        };
        let (plain, with) = without_and_with(Arc::new(ProbeFilterInJoin));
        for ctx in [&plain, &with] {
            ctx.register_batch("l", latest.clone()).unwrap();
            ctx.register_batch("h1", history(1)).unwrap();
            ctx.register_batch("h2", history(2)).unwrap();
        }
        (plain, with)
    }

    /// A filter on `_op` of a union of histories, or of one, is evaluated
    /// by the join (no filter above the scans), with the answer of the plan
    /// without the rule; other filters, and joins that are not inner, keep
    /// their plans.
    #[tokio::test]
    async fn a_filter_on_op_is_evaluated_by_the_join() {
        let (plain, ctx) = sessions();
        let union = "(SELECT * FROM h1 UNION ALL SELECT * FROM h2)";
        let moved = [
            format!(
                "SELECT l.account, count(*), sum(h.amount) FROM l JOIN {union} h ON h.id = l.id \
                 WHERE h._op = 'update' AND l.account < 20 GROUP BY l.account ORDER BY l.account"
            ),
            "SELECT h._op, count(*), sum(h.amount) FROM l JOIN h1 h ON h.id = l.id \
             WHERE h._op IN ('insert', 'delete') AND l.account < 30 GROUP BY h._op ORDER BY h._op"
                .to_string(),
            format!(
                "SELECT h._op, l.account, count(*) FROM l JOIN {union} h ON h.id = l.id \
                 WHERE h._op <> 'update' AND l.account > 10 GROUP BY h._op, l.account \
                 ORDER BY h._op, l.account"
            ),
        ];
        for sql in &moved {
            let (plan, answer) = plan_and_answer(&ctx, sql).await;
            assert!(plan.contains("HashJoinExec"), "{sql}: {plan}");
            assert!(plan.contains(", filter="), "{sql}: {plan}");
            assert!(!plan.contains(" FilterExec: _op"), "{sql}: {plan}");
            assert!(plan.contains(" EarlyFilterExec: _op"), "{sql}: {plan}");
            let (plain_plan, plain_answer) = plan_and_answer(&plain, sql).await;
            assert!(plain_plan.contains(" FilterExec: _op"), "{plain_plan}");
            assert_eq!(answer, plain_answer, "{sql}");
            assert!(answer.lines().count() > 5, "{answer}");
        }
        let kept = [
            format!("SELECT count(*) FROM l JOIN {union} h ON h.id = l.id WHERE h.amount > 100"),
            // Every row of the view: the join matches nearly every change.
            format!("SELECT count(*) FROM l JOIN {union} h ON h.id = l.id WHERE h._op = 'update'"),
            format!(
                "SELECT count(*) FROM l LEFT JOIN {union} h ON h.id = l.id AND h._op = 'update'"
            ),
        ];
        for sql in &kept {
            let (plan, answer) = plan_and_answer(&ctx, sql).await;
            let (plain_plan, plain_answer) = plan_and_answer(&plain, sql).await;
            assert_eq!(plan, plain_plan, "{sql}");
            assert_eq!(answer, plain_answer, "{sql}");
        }
    }

    /// The early filter filters where its first batch says few rows pass,
    /// and passes every batch on as it is where most do.
    #[tokio::test]
    async fn the_early_filter_filters_only_rare_rows() {
        use datafusion::datasource::memory::MemorySourceConfig;
        use datafusion::execution::TaskContext;
        use datafusion::physical_expr::expressions::{BinaryExpr, col, lit};
        use datafusion::physical_plan::collect;

        let schema = Arc::new(Schema::new(vec![Field::new(
            "_op",
            DataType::Utf8View,
            false,
        )]));
        let batch = |ops: Vec<&str>| {
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![Arc::new(StringViewArray::from_iter_values(ops))],
            )
            .unwrap()
        };
        let ops = |update: usize| {
            (0..10)
                .map(|i| if i < update { "update" } else { "delete" })
                .collect::<Vec<_>>()
        };
        for (op, first, rows) in [("delete", 9, 1 + 7), ("update", 9, 10 + 10)] {
            let input = MemorySourceConfig::try_new_exec(
                &[vec![batch(ops(first)), batch(ops(3))]],
                Arc::clone(&schema),
                None,
            )
            .unwrap();
            let predicate = Arc::new(BinaryExpr::new(
                col("_op", &schema).unwrap(),
                datafusion::logical_expr::Operator::Eq,
                lit(ScalarValue::Utf8View(Some(op.into()))),
            ));
            let exec = Arc::new(EarlyFilter::exec(input, predicate));
            let out = collect(exec, Arc::new(TaskContext::default()))
                .await
                .unwrap();
            let n: usize = out.iter().map(RecordBatch::num_rows).sum();
            assert_eq!(n, rows, "{op}");
        }
    }
}
