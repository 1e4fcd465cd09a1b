//! How many parts a grouping of many groups is split into.
//!
//! DataFusion groups in two steps: each scan partition groups what it reads
//! (or, when nearly every row is a group of its own, passes its rows on
//! ungrouped), the rows are split by a hash of their group among as many
//! partitions as the session has cores, and each of those groups its share.
//! With a million groups on two cores, each final table holds half a
//! million groups, far larger than a core's cache: every row that arrives
//! looks up a group in memory the core had to fetch. Split into more parts
//! than cores, each table fits in the cache, and the parts run one after
//! another on the same cores. Measured on the busiest keys of the history of
//! 5,000,000 changes over 1,000,000 keys (`KEEP=1 SCALE=1
//! scripts/bench-query.sh`'s archive): the final grouping's time (`EXPLAIN
//! ANALYZE`) 284 ms in 2 parts, 151 ms in 32, 67 ms in 128; the whole
//! process (9 alternated runs, medians) 193 ms in 2 parts, 134 ms in 128.
//!
//! More parts cost where there are few groups: each part is a stream to
//! set up, sort and merge (1-3 ms more for a grouping by status or by day
//! and operation in 64 parts). So a grouping is split wider only when the
//! statistics of its input bound the groups it can have, and that bound is
//! large: a group column of numbers, dates or timestamps whose smallest
//! and largest values span more than a part's share. A span bounds the
//! groups, it does not count them: a timestamp column of few values far
//! apart is split wide too, for the milliseconds above. Text columns have no such
//! bound in the statistics, and are left as they are.
//!
//! A grouping that only counts rows by one integer key whose range the
//! statistics bound is not split at all: the walk puts a count in an
//! array in its place (see [`densecount`]).
//!
//! Only the hash split before a final grouping changes, and only where the
//! grouping's parts are merged into one stream above it through operators
//! that take any number of parts (projections, filters, per-part sorts): a
//! join or a union above that expects its inputs split alike is left as it
//! is.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::error::Result as DfResult;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{ExecutionPlan, Partitioning};

use crate::query::bounds::bounds;
use crate::query::densecount;

/// Groups per part that fit a core's cache: with 8-byte keys and counts,
/// about a megabyte of table.
const GROUPS_PER_PART: usize = 16_384;

/// The most parts a grouping is split into.
const MOST_PARTS: usize = 128;

/// Widens the hash split before a final grouping (see the module doc).
#[derive(Debug)]
pub(crate) struct GroupFanOut;

impl PhysicalOptimizerRule for GroupFanOut {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let cores = config.execution.target_partitions;
        plan.transform_down(|node| {
            if !(node.is::<SortPreservingMergeExec>() || node.is::<CoalescePartitionsExec>()) {
                return Ok(Transformed::no(node));
            }
            let child = Arc::clone(node.children()[0]);
            Ok(match widen(&child, cores)? {
                Some(wide) => Transformed::yes(with_child(node, wide)?),
                None => Transformed::no(node),
            })
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "waltail_group_fan_out"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `plan` with the hash split under its final grouping widened, if it is
/// such a grouping of many groups (see [`parts`]) or reaches one through
/// operators that take any number of parts; `None` otherwise.
fn widen(plan: &Arc<dyn ExecutionPlan>, cores: usize) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    let passes = plan.is::<ProjectionExec>()
        || plan.is::<FilterExec>()
        || plan
            .downcast_ref::<SortExec>()
            .is_some_and(SortExec::preserve_partitioning);
    if passes {
        let Some(child) = widen(plan.children()[0], cores)? else {
            return Ok(None);
        };
        return Ok(Some(with_child(Arc::clone(plan), child)?));
    }
    let Some(aggregate) = plan.downcast_ref::<AggregateExec>() else {
        return Ok(None);
    };
    if *aggregate.mode() != AggregateMode::FinalPartitioned {
        return Ok(None);
    }
    let Some(split) = aggregate.input().downcast_ref::<RepartitionExec>() else {
        return Ok(None);
    };
    let Partitioning::Hash(exprs, n) = split.partitioning() else {
        return Ok(None);
    };
    let Some(first) = split.input().downcast_ref::<AggregateExec>() else {
        return Ok(None);
    };
    if let Some(dense) = densecount::dense(aggregate, first, cores)? {
        return Ok(Some(dense));
    }
    let parts = parts(first, cores)?;
    if *n >= parts {
        return Ok(None);
    }
    let mut wide = RepartitionExec::try_new(
        Arc::clone(split.input()),
        Partitioning::Hash(exprs.clone(), parts),
    )?;
    if split.preserve_order() {
        wide = wide.with_preserve_order();
    }
    Ok(Some(with_child(Arc::clone(plan), Arc::new(wide))?))
}

/// How many parts the grouping whose first step is `first` is split into:
/// one per [`GROUPS_PER_PART`] groups its input's statistics allow, between
/// `cores` and [`MOST_PARTS`]; `cores` when they bound no group column.
fn parts(first: &AggregateExec, cores: usize) -> DfResult<usize> {
    let mut widest = 0;
    for (expr, _) in first.group_expr().expr() {
        if let Some(column) = expr.downcast_ref::<Column>() {
            widest = widest.max(span(first.input(), column.index())?);
        }
    }
    Ok(widest
        .div_ceil(GROUPS_PER_PART)
        .clamp(cores, MOST_PARTS.max(cores)))
}

/// How many values column `index` of `plan` can hold, by its smallest and
/// largest values in the statistics (see [`bounds`]); 0 if they do not
/// say.
fn span(plan: &Arc<dyn ExecutionPlan>, index: usize) -> DfResult<usize> {
    Ok(bounds(plan, index)?
        .and_then(|b| b.min.distance(&b.max))
        .map_or(0, |d| d.saturating_add(1)))
}

/// `plan` over `child`, its properties (the number of parts) recomputed.
fn with_child(
    plan: Arc<dyn ExecutionPlan>,
    child: Arc<dyn ExecutionPlan>,
) -> DfResult<Arc<dyn ExecutionPlan>> {
    plan.replace_children(
        vec![child],
        ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
    )
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::prelude::SessionContext;

    use super::*;
    use crate::query::plans::{parquet_sessions, plan_and_answer};

    /// `t (id, v)` in a Parquet file: ids 0 to 199,999 (each twice), and
    /// `v` from 0 to 9; in two sessions of two cores, one with the rule.
    async fn sessions() -> (SessionContext, SessionContext, tempfile::TempDir) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("v", DataType::Int64, false),
        ]));
        let ids: Vec<i64> = (0..400_000).map(|i| i % 200_000).collect();
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(ids.clone())),
                Arc::new(Int64Array::from_iter_values(ids.iter().map(|i| i % 10))),
            ],
        )
        .unwrap();
        parquet_sessions(Arc::new(GroupFanOut), &batch).await
    }

    /// A grouping by a column whose statistics span 200,000 values is split
    /// in 13 parts; one by a column of ten values, or one a join reads, is
    /// left in two; the answers are the same as without the rule.
    #[tokio::test]
    async fn many_groups_are_split_in_cache_sized_parts() {
        let (plain, ctx, _dir) = sessions().await;
        let cases = [
            (
                "SELECT id, count(*) AS n, sum(v) FROM t GROUP BY id ORDER BY n DESC, id LIMIT 5",
                "Hash([id@0], 13)",
            ),
            (
                "SELECT v, count(*), sum(id) FROM t GROUP BY v ORDER BY v",
                "Hash([v@0], 2)",
            ),
            (
                "SELECT count(*), sum(g.n) FROM (SELECT id, count(*) AS n FROM t GROUP BY id) g \
                 JOIN t ON t.id = g.id WHERE t.v = 3",
                "Hash([id@0], 2)",
            ),
        ];
        for (sql, split) in cases {
            let (plan, answer) = plan_and_answer(&ctx, sql).await;
            assert!(plan.contains(split), "{sql}: {plan}");
            let (plain_plan, plain_answer) = plan_and_answer(&plain, sql).await;
            assert!(!plain_plan.contains("], 13)"), "{plain_plan}");
            assert_eq!(answer, plain_answer, "{sql}");
        }
    }
}
