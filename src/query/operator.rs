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

/// Whether every value of this type is an `i64` value, as the operators
/// that index keys by number (a bitmap, an array of counts) take them.
pub(crate) fn integer(data_type: &arrow::datatypes::DataType) -> bool {
    use arrow::datatypes::DataType::*;
    matches!(
        data_type,
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32
    )
}

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

/// What an operator of one input and one expression does to each of its
/// input partitions' batches, as a [`StepExec`] runs it: the filters and
/// the key bitmap around a join (`probefilter`, `keybitmap`) are such
/// steps, and share the plan's side of it.
pub(crate) trait BatchStep: std::fmt::Debug + Send + Sync {
    /// Its name in plans.
    fn name(&self) -> &'static str;

    /// The step for a plan built anew (new children): state it shares with
    /// another operator is not carried over.
    fn renewed(&self) -> Arc<dyn BatchStep>;

    /// One partition's batches through the step, `expr` evaluated on them.
    fn stream(
        &self,
        input: datafusion::execution::SendableRecordBatchStream,
        expr: Arc<dyn PhysicalExpr>,
        baseline: datafusion::physical_plan::metrics::BaselineMetrics,
    ) -> futures::stream::BoxStream<'static, DfResult<arrow::array::RecordBatch>>;
}

/// A [`BatchStep`] as a plan: its input's properties, order and
/// partitions kept.
#[derive(Debug, Clone)]
pub(crate) struct StepExec {
    input: Arc<dyn ExecutionPlan>,
    expr: Arc<dyn PhysicalExpr>,
    step: Arc<dyn BatchStep>,
    properties: Arc<datafusion::physical_plan::PlanProperties>,
    metrics: datafusion::physical_plan::metrics::ExecutionPlanMetricsSet,
}

impl StepExec {
    pub(crate) fn new(
        input: Arc<dyn ExecutionPlan>,
        expr: Arc<dyn PhysicalExpr>,
        step: Arc<dyn BatchStep>,
    ) -> StepExec {
        StepExec {
            properties: Arc::clone(input.properties()),
            input,
            expr,
            step,
            metrics: Default::default(),
        }
    }
}

impl datafusion::physical_plan::DisplayAs for StepExec {
    fn fmt_as(
        &self,
        _t: datafusion::physical_plan::DisplayFormatType,
        f: &mut std::fmt::Formatter,
    ) -> std::fmt::Result {
        write!(f, "{}: {}", self.step.name(), self.expr)
    }
}

impl ExecutionPlan for StepExec {
    fn name(&self) -> &'static str {
        self.step.name()
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        f(&self.expr)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: datafusion::physical_plan::execution_plan::ReplaceChildrenOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(StepExec::new(
            only_child(children, self.step.name())?,
            Arc::clone(&self.expr),
            self.step.renewed(),
        )))
    }

    one_input_basics!();

    fn execute(
        &self,
        partition: usize,
        context: Arc<datafusion::execution::TaskContext>,
    ) -> DfResult<datafusion::execution::SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let baseline =
            datafusion::physical_plan::metrics::BaselineMetrics::new(&self.metrics, partition);
        Ok(Box::pin(
            datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(
                self.input.schema(),
                self.step.stream(input, Arc::clone(&self.expr), baseline),
            ),
        ))
    }
}
