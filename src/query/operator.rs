//! What waltail's own operators share as DataFusion plans: one input,
//! their expressions visited in order, and the trait methods every one of
//! them writes the same way.

use std::sync::Arc;

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::{Distribution, ExecutionPlan};

/// `f` on each of `exprs` until it says stop (`apply_expressions`).
pub(crate) fn visit<'a>(
    exprs: impl IntoIterator<Item = &'a Arc<dyn PhysicalExpr>>,
    f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
) -> DfResult<TreeNodeRecursion> {
    let mut recursion = TreeNodeRecursion::Continue;
    for e in exprs {
        recursion = f(e)?;
        if recursion == TreeNodeRecursion::Stop {
            break;
        }
    }
    Ok(recursion)
}

/// Inside an `impl ExecutionPlan` of an operator with fields `input`,
/// `properties` and `metrics`: `properties`, `children` (the input),
/// `with_new_children` (through `replace_children`, the properties
/// recomputed) and `metrics`, as each of waltail's operators has them.
macro_rules! one_input_basics {
    () => {
        fn properties(&self) -> &std::sync::Arc<datafusion::physical_plan::PlanProperties> {
            &self.properties
        }

        fn children(&self) -> Vec<&std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>> {
            vec![&self.input]
        }

        fn with_new_children(
            self: std::sync::Arc<Self>,
            children: Vec<std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>>,
        ) -> datafusion::error::Result<std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>>
        {
            self.replace_children(
                children,
                datafusion::physical_plan::execution_plan::ReplaceChildrenOptions::new(
                    datafusion::physical_plan::execution_plan::ChildrenPropertiesMode::Recompute,
                ),
            )
        }

        fn metrics(&self) -> Option<datafusion::physical_plan::metrics::MetricsSet> {
            Some(self.metrics.clone_inner())
        }
    };
}
pub(crate) use one_input_basics;

/// The one input `name` takes, from the children DataFusion gives it.
pub(crate) fn only_child(
    mut children: Vec<Arc<dyn ExecutionPlan>>,
    name: &str,
) -> DfResult<Arc<dyn ExecutionPlan>> {
    match children.len() {
        1 => Ok(children.swap_remove(0)),
        n => Err(DataFusionError::Internal(format!(
            "{name} takes one input, not {n}"
        ))),
    }
}

/// The input a window operator needs: each key's rows in one partition
/// (with no keys, every row in one).
pub(crate) fn on_keys(keys: &[Arc<dyn PhysicalExpr>]) -> Distribution {
    if keys.is_empty() {
        Distribution::SinglePartition
    } else {
        Distribution::KeyPartitioned(keys.to_vec())
    }
}
