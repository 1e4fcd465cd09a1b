//! A grouping over a union, its first step run branch by branch without
//! the group keys a branch holds constant.
//!
//! A table of the history is a union of one scan per day folder, each
//! with the day as a constant column (the Hive-style `date=` folder), and
//! the changes not compacted yet. Counting by day and operation over it,
//! DataFusion's first grouping step hashes and compares both keys of every
//! row, the day included, though each scan has one day only: a grouping by
//! two columns, DataFusion's general multi-column path. Run per branch, a
//! branch whose scan holds the day constant groups by the operation alone
//! (the single-column path, no hashing of the day) and puts the day back
//! as a constant column on its few output rows. The second step, which
//! merges the first step's rows by all keys, is unchanged. Measured on the
//! history of 5,100,000 changes (`KEEP=1 SCALE=1 scripts/bench-query.sh`'s
//! archive): `EXPLAIN ANALYZE` of the first step by day and operation
//! 38-43 ms of CPU, run per day 20-25 ms; the whole process 44.0 -> 30.4
//! ms (medians of 21, alternated with the build before).
//!
//! A branch keeps the original first step when no key is constant in it,
//! or when every key is: grouped by nothing, an empty branch would give
//! one row (a count of 0) where a grouping gives none. Groupings with
//! grouping sets, ordered aggregates or a limit are left as they are.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::error::Result as DfResult;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::{AcrossPartitions, PhysicalExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

/// Runs a grouping's first step per union branch (see the module doc).
#[derive(Debug)]
pub(crate) struct BranchGrouping;

impl PhysicalOptimizerRule for BranchGrouping {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(first) = node.downcast_ref::<AggregateExec>() else {
                return Ok(Transformed::no(node));
            };
            let splits = *first.mode() == AggregateMode::Partial
                && first.group_expr().is_single()
                && !first.group_expr().expr().is_empty()
                && first.limit_options().is_none()
                && first.aggr_expr().iter().all(|a| a.order_bys().is_empty())
                && first.input().is::<UnionExec>();
            if !splits {
                return Ok(Transformed::no(node));
            }
            let mut changed = false;
            let mut branches = Vec::new();
            for branch in first.input().children() {
                branches.push(match per_branch(first, branch)? {
                    Some(plan) => {
                        changed = true;
                        plan
                    }
                    None => Arc::new(AggregateExec::try_new(
                        AggregateMode::Partial,
                        first.group_expr().clone(),
                        first.aggr_expr().to_vec(),
                        first.filter_expr().to_vec(),
                        Arc::clone(branch),
                        first.input_schema(),
                    )?),
                });
            }
            if !changed {
                return Ok(Transformed::no(node));
            }
            Ok(Transformed::yes(UnionExec::try_new(branches)?))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "waltail_branch_grouping"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The first step `first` over `branch` alone, grouped by the keys the
/// branch does not hold constant, the constant ones put back as literals
/// in the first step's own output columns; `None` when no key or every key
/// is constant in the branch.
fn per_branch(
    first: &AggregateExec,
    branch: &Arc<dyn ExecutionPlan>,
) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    let keys = first.group_expr().expr();
    let properties = branch.equivalence_properties();
    let constants: Vec<_> = keys
        .iter()
        .map(|(expr, _)| match properties.is_expr_constant(expr) {
            Some(AcrossPartitions::Uniform(Some(value))) => Some(value),
            _ => None,
        })
        .collect();
    let varying: Vec<_> = keys
        .iter()
        .zip(&constants)
        .filter(|(_, constant)| constant.is_none())
        .map(|(key, _)| key.clone())
        .collect();
    if varying.is_empty() || varying.len() == keys.len() {
        return Ok(None);
    }
    let narrow = Arc::new(AggregateExec::try_new(
        AggregateMode::Partial,
        PhysicalGroupBy::new_single(varying),
        first.aggr_expr().to_vec(),
        first.filter_expr().to_vec(),
        Arc::clone(branch),
        first.input_schema(),
    )?);
    let wide = first.schema();
    let narrow_schema = narrow.schema();
    let mut next = 0;
    let mut exprs = Vec::with_capacity(wide.fields().len());
    for (i, field) in wide.fields().iter().enumerate() {
        let expr: Arc<dyn PhysicalExpr> = match constants.get(i) {
            Some(Some(value)) => Arc::new(Literal::new(value.cast_to(field.data_type())?)),
            _ => {
                let column = Column::new(narrow_schema.field(next).name(), next);
                next += 1;
                Arc::new(column)
            }
        };
        exprs.push(ProjectionExpr::new(expr, field.name().clone()));
    }
    Ok(Some(Arc::new(ProjectionExec::try_new(exprs, narrow)?)))
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::prelude::SessionContext;

    use super::*;
    use crate::query::plans::{plan_and_answer, without_and_with};

    /// `t (v, w)`: 3,000 rows, `v` of 7 values and `w` of 5; in two
    /// sessions of two cores, one with the rule.
    fn sessions() -> (SessionContext, SessionContext) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("v", DataType::Int64, false),
            Field::new("w", DataType::Int64, true),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values((0..3_000).map(|i| i % 7))),
                Arc::new(Int64Array::from_iter(
                    (0..3_000).map(|i| (i % 11 != 0).then_some(i % 5)),
                )),
            ],
        )
        .unwrap();
        let (plain, with) = without_and_with(Arc::new(BranchGrouping));
        for ctx in [&plain, &with] {
            ctx.register_batch("t", batch.clone()).unwrap();
        }
        (plain, with)
    }

    /// Three branches, each with its own day as a constant column: the
    /// count, sum and filtered count by day and `v` are grouped by `v`
    /// alone in each branch, and equal the answer without the rule, also
    /// where a branch's rows are all filtered out (no group of count 0).
    /// Grouped by the day alone, or by a column no branch holds constant,
    /// the plan is left as it is.
    #[tokio::test]
    async fn a_branch_groups_without_the_keys_it_holds_constant() {
        let (plain, ctx) = sessions();
        let days = "SELECT DATE '2026-11-01' AS d, v, w FROM t \
             UNION ALL SELECT DATE '2026-11-02' AS d, v, w FROM t WHERE v < 3 \
             UNION ALL SELECT DATE '2026-11-03' AS d, v, w FROM t WHERE v > 100";
        let split = [
            format!(
                "SELECT d, v, count(*), sum(w), count(*) FILTER (WHERE w > 2) FROM ({days}) \
                 GROUP BY d, v ORDER BY d, v"
            ),
            format!("SELECT v, d, avg(w) FROM ({days}) GROUP BY v, d ORDER BY v, d"),
        ];
        for sql in &split {
            let (plan, answer) = plan_and_answer(&ctx, sql).await;
            let by_v_alone = "mode=Partial, gby=[v@1 as v], aggr";
            assert_eq!(plan.matches(by_v_alone).count(), 3, "{sql}: {plan}");
            let (plain_plan, plain_answer) = plan_and_answer(&plain, sql).await;
            assert!(!plain_plan.contains(by_v_alone), "{plain_plan}");
            assert_eq!(answer, plain_answer, "{sql}");
            assert!(answer.contains("2026-11-02"), "{answer}");
            assert!(!answer.contains("2026-11-03"), "{answer}");
        }
        let kept = [
            format!("SELECT d, count(*) FROM ({days}) GROUP BY d ORDER BY d"),
            format!("SELECT w, count(*) FROM ({days}) GROUP BY w ORDER BY w"),
        ];
        for sql in &kept {
            let (plan, answer) = plan_and_answer(&ctx, sql).await;
            let (plain_plan, plain_answer) = plan_and_answer(&plain, sql).await;
            assert_eq!(plan, plain_plan, "{sql}");
            assert_eq!(answer, plain_answer, "{sql}");
        }
    }
}
