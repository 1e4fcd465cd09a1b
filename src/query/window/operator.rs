//! What the window's operators share as DataFusion plans: one input, and
//! their expressions visited in order.

use std::sync::Arc;

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::{Distribution, ExecutionPlan};

/// `f` on each of `exprs` until it says stop (`apply_expressions`).
pub(super) fn visit<'a>(
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

/// The one input `name` takes, from the children DataFusion gives it.
pub(super) fn only_child(
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
pub(super) fn on_keys(keys: &[Arc<dyn PhysicalExpr>]) -> Distribution {
    if keys.is_empty() {
        Distribution::SinglePartition
    } else {
        Distribution::KeyPartitioned(keys.to_vec())
    }
}
