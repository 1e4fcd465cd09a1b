//! `lag`, `lead` and `row_number` over a key's versions, computed a batch
//! at a time rather than a partition at a time.
//!
//! The query a history is read for most is each key's versions in order:
//! the gap to the version before (`lag`), the one after (`lead`), the n-th
//! (`row_number`). DataFusion 55 runs such a window with one state per
//! window partition: for every key it makes a batch of that key's rows, a
//! state and an evaluator for each function, and joins the results again.
//! With a handful of versions per key, that costs several times the work
//! itself (see docs/performance.md#query). Over input sorted by the
//! partition keys these three functions need only the rows next to each
//! one, so [`KeyWindowExec`] computes them with array kernels over each
//! batch (with a few rows carried across batch boundaries), whatever the
//! number of keys.
//!
//! [`KeyWindowRule`] replaces a logical `Window` whose every function is
//! one of these (offsets literal and at most [`MAX_OFFSET`], `RESPECT
//! NULLS`, no `FILTER`), all over the same `PARTITION BY` and `ORDER BY`,
//! keys of a type compared exactly (not floating point), with a
//! [`KeyWindow`] node; [`KeyWindowPlanner`] plans it as a [`KeyWindowExec`]
//! that requires what DataFusion's window operator requires (its input
//! hash-partitioned on the keys and sorted by them and then the order),
//! so DataFusion adds the same sort and repartitioning. Any other window
//! is left to DataFusion. Memory: an input batch and at most
//! [`MAX_OFFSET`] rows on each side of it, whatever a partition's size.

use std::cmp::Ordering;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow::array::{
    Array, ArrayRef, BooleanArray, RecordBatch, RecordBatchOptions, UInt32Array, UInt64Array,
};
use arrow::compute::{cast, concat_batches, take};
use arrow::datatypes::{DataType, SchemaRef};
use async_trait::async_trait;
use datafusion::common::tree_node::{Transformed, TreeNodeRecursion};
use datafusion::common::{DFSchemaRef, ScalarValue};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::expr::{NullTreatment, WindowFunction, WindowFunctionParams};
use datafusion::logical_expr::{
    ExprSchemable, Extension, LogicalPlan, UserDefinedLogicalNode, UserDefinedLogicalNodeCore,
    Window, WindowFunctionDefinition,
};
use datafusion::optimizer::{ApplyOrder, OptimizerConfig, OptimizerRule};
use datafusion::physical_expr::{
    EquivalenceProperties, LexRequirement, OrderingRequirements, PhysicalExpr, PhysicalSortExpr,
    PhysicalSortRequirement,
};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::{BaselineMetrics, ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, ExecutionPlanProperties,
    InputDistributionRequirements, PlanProperties, RecordBatchStream,
};
use datafusion::physical_planner::{DefaultPhysicalPlanner, ExtensionPlanner, PhysicalPlanner};
use datafusion::prelude::Expr;
use futures::{Stream, StreamExt};

/// The largest `lag`/`lead` offset computed here: the rows carried from
/// one batch to the next. A larger one is left to DataFusion.
pub(crate) const MAX_OFFSET: i64 = 1024;

/// One function of the window, as the operator computes it.
#[derive(Debug, Clone, PartialEq)]
enum Shift {
    /// `lag` (negative) or `lead` (positive) by the offset, `default`
    /// where the row it names is outside the partition.
    Row {
        offset: i64,
        default: ScalarValue,
    },
    RowNumber,
}

/// What the rule found in a `Window`'s function: its kind and, for
/// `lag`/`lead`, the value's expression; `None` for anything else.
fn shift_of(expr: &Expr, input: &LogicalPlan) -> Option<(Shift, Option<Expr>)> {
    let Expr::WindowFunction(w) = expr else {
        return None;
    };
    let WindowFunction {
        fun: WindowFunctionDefinition::WindowUDF(udf),
        params:
            WindowFunctionParams {
                args,
                filter: None,
                null_treatment,
                distinct: false,
                ..
            },
    } = w.as_ref()
    else {
        return None;
    };
    if null_treatment.is_some_and(|n| n != NullTreatment::RespectNulls) {
        return None;
    }
    let literal = |e: &Expr| match e {
        Expr::Literal(v, _) => Some(v.clone()),
        _ => None,
    };
    match (udf.name(), args.as_slice()) {
        ("row_number", []) => Some((Shift::RowNumber, None)),
        (name @ ("lag" | "lead"), [value, rest @ ..]) if rest.len() <= 2 => {
            let offset = match rest.first() {
                None => 1,
                Some(e) => match literal(e)?.cast_to(&DataType::Int64).ok()? {
                    ScalarValue::Int64(Some(n)) => n,
                    _ => return None,
                },
            };
            if !(0..=MAX_OFFSET).contains(&offset) {
                return None;
            }
            let data_type = value.get_type(input.schema()).ok()?;
            let default = match rest.get(1) {
                None => ScalarValue::try_from(&data_type).ok()?,
                Some(e) => literal(e)?.cast_to(&data_type).ok()?,
            };
            let offset = if name == "lag" { -offset } else { offset };
            Some((Shift::Row { offset, default }, Some(value.clone())))
        }
        _ => None,
    }
}

/// Whether rows of a partition key of this type are compared here as
/// DataFusion's window compares them: exactly, nulls equal. (Floating
/// point keys, where NaN and -0.0 have their own rules, and nested types
/// are left to DataFusion.)
fn exact_key(data_type: &DataType) -> bool {
    use DataType::*;
    match data_type {
        Float16 | Float32 | Float64 => false,
        Boolean | Utf8 | LargeUtf8 | Utf8View | Binary | LargeBinary | BinaryView
        | FixedSizeBinary(_) => true,
        t => t.is_primitive(),
    }
}

/// The window's functions if the operator computes all of them.
fn supported(window: &Window) -> bool {
    let input = window.input.as_ref();
    let mut spec: Option<(&[Expr], &[datafusion::logical_expr::SortExpr])> = None;
    for expr in &window.window_expr {
        if shift_of(expr, input).is_none() {
            return false;
        }
        let Expr::WindowFunction(w) = expr else {
            return false;
        };
        let here = (
            w.params.partition_by.as_slice(),
            w.params.order_by.as_slice(),
        );
        match spec {
            None => spec = Some(here),
            Some(s) if s == here => {}
            Some(_) => return false,
        }
    }
    let Some((partition_by, _)) = spec else {
        return false;
    };
    partition_by
        .iter()
        .all(|e| e.get_type(input.schema()).is_ok_and(|t| exact_key(&t)))
}

/// `builder` with the rule and the planner of these windows.
pub(crate) fn install(builder: SessionStateBuilder) -> SessionStateBuilder {
    builder
        .with_optimizer_rule(Arc::new(KeyWindowRule))
        .with_query_planner(Arc::new(WithKeyWindows))
}

/// Replaces a `Window` the operator computes with a [`KeyWindow`].
#[derive(Debug, Default)]
pub(crate) struct KeyWindowRule;

impl OptimizerRule for KeyWindowRule {
    fn name(&self) -> &str {
        "waltail_key_window"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        Some(ApplyOrder::BottomUp)
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> DfResult<Transformed<LogicalPlan>> {
        match plan {
            LogicalPlan::Window(window) if supported(&window) => {
                let node = KeyWindow {
                    input: window.input.as_ref().clone(),
                    window_expr: window.window_expr,
                    schema: window.schema,
                };
                Ok(Transformed::yes(LogicalPlan::Extension(Extension {
                    node: Arc::new(node),
                })))
            }
            other => Ok(Transformed::no(other)),
        }
    }
}

/// A `Window` of `lag`, `lead` and `row_number` over one `PARTITION BY`
/// and `ORDER BY`: the input's columns, then one per function.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct KeyWindow {
    input: LogicalPlan,
    window_expr: Vec<Expr>,
    schema: DFSchemaRef,
}

impl PartialOrd for KeyWindow {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        match self.input.partial_cmp(&other.input) {
            Some(Ordering::Equal) => self.window_expr.partial_cmp(&other.window_expr),
            o => o,
        }
    }
}

impl UserDefinedLogicalNodeCore for KeyWindow {
    fn name(&self) -> &str {
        "KeyWindow"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.input]
    }

    fn schema(&self) -> &DFSchemaRef {
        &self.schema
    }

    fn expressions(&self) -> Vec<Expr> {
        self.window_expr.clone()
    }

    fn prevent_predicate_push_down_columns(&self) -> std::collections::HashSet<String> {
        // As for DataFusion's window: nothing is pushed below it (a filter
        // on the input would change which rows are next to which).
        self.schema
            .columns()
            .into_iter()
            .map(|c| c.flat_name())
            .collect()
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "KeyWindow: ")?;
        for (i, e) in self.window_expr.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }

    fn with_exprs_and_inputs(
        &self,
        exprs: Vec<Expr>,
        mut inputs: Vec<LogicalPlan>,
    ) -> DfResult<Self> {
        let input = inputs.swap_remove(0);
        // The input may have lost columns no one reads: the schema again.
        let window = Window::try_new(exprs, Arc::new(input))?;
        Ok(KeyWindow {
            input: Arc::unwrap_or_clone(window.input),
            window_expr: window.window_expr,
            schema: window.schema,
        })
    }

    fn necessary_children_exprs(&self, output_columns: &[usize]) -> Option<Vec<Vec<usize>>> {
        // The input's columns read above; DataFusion adds those the
        // functions read.
        let n = self.input.schema().fields().len();
        Some(vec![
            output_columns.iter().copied().filter(|&i| i < n).collect(),
        ])
    }
}

/// Plans a [`KeyWindow`] as a [`KeyWindowExec`].
#[derive(Debug, Default)]
pub(crate) struct KeyWindowPlanner;

#[async_trait]
impl ExtensionPlanner for KeyWindowPlanner {
    async fn plan_extension(
        &self,
        planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        session: &dyn datafusion::catalog::Session,
        planning_ctx: &datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext,
    ) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
        let Some(node) = node.as_any().downcast_ref::<KeyWindow>() else {
            return Ok(None);
        };
        let input_schema = logical_inputs[0].schema();
        let physical =
            |e: &Expr| planner.create_physical_expr(e, input_schema, session, planning_ctx);
        let Some(Expr::WindowFunction(first)) = node.window_expr.first() else {
            return Err(DataFusionError::Internal(
                "a KeyWindow without functions".into(),
            ));
        };
        let partition_by = first
            .params
            .partition_by
            .iter()
            .map(physical)
            .collect::<DfResult<Vec<_>>>()?;
        let order_by = first
            .params
            .order_by
            .iter()
            .map(|s| {
                Ok(PhysicalSortExpr {
                    expr: physical(&s.expr)?,
                    options: arrow::compute::SortOptions {
                        descending: !s.asc,
                        nulls_first: s.nulls_first,
                    },
                })
            })
            .collect::<DfResult<Vec<_>>>()?;
        let mut functions = Vec::with_capacity(node.window_expr.len());
        for expr in &node.window_expr {
            let (shift, value) = shift_of(expr, logical_inputs[0]).ok_or_else(|| {
                DataFusionError::Internal(format!("KeyWindow cannot compute {expr}"))
            })?;
            functions.push((shift, value.as_ref().map(physical).transpose()?));
        }
        let schema: SchemaRef = Arc::new(node.schema.as_arrow().clone());
        Ok(Some(Arc::new(KeyWindowExec::new(
            Arc::clone(&physical_inputs[0]),
            schema,
            partition_by,
            order_by,
            functions,
        ))))
    }
}

/// A query planner that plans [`KeyWindow`] nodes too.
#[derive(Debug, Default)]
pub(crate) struct WithKeyWindows;

#[async_trait]
impl QueryPlanner for WithKeyWindows {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn datafusion::catalog::Session,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        DefaultPhysicalPlanner::with_extension_planners(vec![Arc::new(KeyWindowPlanner)])
            .create_physical_plan(logical_plan, session)
            .await
    }
}

/// Computes `lag`, `lead` and `row_number` over input sorted by the
/// partition keys (then the order), partitioned on them.
#[derive(Debug)]
pub(crate) struct KeyWindowExec {
    input: Arc<dyn ExecutionPlan>,
    schema: SchemaRef,
    partition_by: Vec<Arc<dyn PhysicalExpr>>,
    order_by: Vec<PhysicalSortExpr>,
    /// Each function, with its value for `lag`/`lead`.
    functions: Vec<(Shift, Option<Arc<dyn PhysicalExpr>>)>,
    properties: Arc<PlanProperties>,
    /// Time and rows, for `EXPLAIN ANALYZE`.
    metrics: ExecutionPlanMetricsSet,
}

impl KeyWindowExec {
    fn new(
        input: Arc<dyn ExecutionPlan>,
        schema: SchemaRef,
        partition_by: Vec<Arc<dyn PhysicalExpr>>,
        order_by: Vec<PhysicalSortExpr>,
        functions: Vec<(Shift, Option<Arc<dyn PhysicalExpr>>)>,
    ) -> KeyWindowExec {
        // Rows leave in the order they came: the input's orderings hold.
        let orderings: Vec<Vec<PhysicalSortExpr>> = input
            .output_ordering()
            .map(|o| vec![o.iter().cloned().collect()])
            .unwrap_or_default();
        let properties = PlanProperties::new(
            EquivalenceProperties::new_with_orderings(Arc::clone(&schema), orderings),
            input.output_partitioning().clone(),
            input.pipeline_behavior(),
            input.boundedness(),
        );
        KeyWindowExec {
            input,
            schema,
            partition_by,
            order_by,
            functions,
            properties: Arc::new(properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for KeyWindowExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let names: Vec<&str> = self.schema.fields()
            [self.schema.fields().len() - self.functions.len()..]
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        write!(f, "KeyWindowExec: [{}]", names.join(", "))
    }
}

impl ExecutionPlan for KeyWindowExec {
    fn name(&self) -> &'static str {
        "KeyWindowExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn required_input_distribution(&self) -> Vec<Distribution> {
        self.input_distribution_requirements().into_per_child()
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        InputDistributionRequirements::new(vec![if self.partition_by.is_empty() {
            Distribution::SinglePartition
        } else {
            Distribution::KeyPartitioned(self.partition_by.clone())
        }])
    }

    fn required_input_ordering(&self) -> Vec<Option<OrderingRequirements>> {
        // The keys in either direction (equal keys together), then the order.
        let mut reqs: Vec<PhysicalSortRequirement> = self
            .partition_by
            .iter()
            .map(|e| PhysicalSortRequirement::new(Arc::clone(e), None))
            .collect();
        for s in &self.order_by {
            if !reqs.iter().any(|r| r.expr.eq(&s.expr)) {
                reqs.push(PhysicalSortRequirement::new(
                    Arc::clone(&s.expr),
                    Some(s.options),
                ));
            }
        }
        vec![
            LexRequirement::new(reqs)
                .and_then(|r| OrderingRequirements::new_alternatives([r], false)),
        ]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        let mut recursion = TreeNodeRecursion::Continue;
        for e in self
            .partition_by
            .iter()
            .chain(self.order_by.iter().map(|s| &s.expr))
            .chain(self.functions.iter().filter_map(|(_, v)| v.as_ref()))
        {
            recursion = f(e)?;
            if recursion == TreeNodeRecursion::Stop {
                break;
            }
        }
        Ok(recursion)
    }

    fn replace_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
        options: ReplaceChildrenOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 {
            return Err(DataFusionError::Internal(
                "KeyWindowExec takes one input".into(),
            ));
        }
        let input = children.swap_remove(0);
        Ok(Arc::new(match options.children_properties {
            ChildrenPropertiesMode::Keep => KeyWindowExec {
                input,
                schema: Arc::clone(&self.schema),
                partition_by: self.partition_by.clone(),
                order_by: self.order_by.clone(),
                functions: self.functions.clone(),
                properties: Arc::clone(&self.properties),
                metrics: ExecutionPlanMetricsSet::new(),
            },
            ChildrenPropertiesMode::Recompute => KeyWindowExec::new(
                input,
                Arc::clone(&self.schema),
                self.partition_by.clone(),
                self.order_by.clone(),
                self.functions.clone(),
            ),
        }))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let lookahead = self
            .functions
            .iter()
            .map(|(s, _)| match s {
                Shift::Row { offset, .. } => (*offset).max(0) as usize,
                Shift::RowNumber => 0,
            })
            .max()
            .unwrap_or(0);
        let lookback = self
            .functions
            .iter()
            .map(|(s, _)| match s {
                Shift::Row { offset, .. } => (-*offset).max(0) as usize,
                // The row before tells whether a partition goes on.
                Shift::RowNumber => 1,
            })
            .max()
            .unwrap_or(0)
            .max(1);
        Ok(Box::pin(KeyWindowStream {
            input,
            schema: Arc::clone(&self.schema),
            partition_by: self.partition_by.clone(),
            functions: self.functions.clone(),
            lookahead,
            lookback,
            buffer: None,
            history: 0,
            first_number: 0,
            done: false,
            baseline: BaselineMetrics::new(&self.metrics, partition),
        }))
    }
}

/// One output partition's computation: the rows not yet emitted, behind
/// the last `lookback` rows emitted.
struct KeyWindowStream {
    input: SendableRecordBatchStream,
    schema: SchemaRef,
    partition_by: Vec<Arc<dyn PhysicalExpr>>,
    functions: Vec<(Shift, Option<Arc<dyn PhysicalExpr>>)>,
    /// The most rows a `lead` looks ahead: rows held until they come.
    lookahead: usize,
    /// The most rows a `lag` (or `row_number`) looks back: rows kept.
    lookback: usize,
    /// The input rows kept: `history` emitted ones, then those not yet.
    buffer: Option<RecordBatch>,
    history: usize,
    /// The row number of the buffer's first row (0 if it has none yet).
    first_number: u64,
    done: bool,
    baseline: BaselineMetrics,
}

impl KeyWindowStream {
    /// Takes `batch` in; emits every row whose lookahead is in (all at the
    /// end, `last`).
    fn step(&mut self, batch: Option<RecordBatch>) -> DfResult<Option<RecordBatch>> {
        let last = batch.is_none();
        let buffer = match (self.buffer.take(), batch) {
            (Some(b), Some(n)) => concat_batches(&n.schema(), [&b, &n])?,
            (None, Some(n)) => n,
            (Some(b), None) => b,
            (None, None) => return Ok(None),
        };
        let n = buffer.num_rows();
        let end = if last {
            n
        } else {
            n.saturating_sub(self.lookahead)
        };
        if end <= self.history {
            self.buffer = Some(buffer);
            return Ok(None);
        }
        let part = partition_ids(&buffer, &self.partition_by)?;
        let numbers = row_numbers(&part, self.first_number);
        let rows = self.history..end;
        let mut columns: Vec<ArrayRef> = buffer
            .columns()
            .iter()
            .map(|c| c.slice(rows.start, rows.len()))
            .collect();
        let out_fields = &self.schema.fields()[buffer.num_columns()..];
        for ((shift, value), field) in self.functions.iter().zip(out_fields) {
            let column: ArrayRef = match shift {
                Shift::RowNumber => Arc::new(UInt64Array::from(numbers[rows.clone()].to_vec())),
                Shift::Row { offset, default } => {
                    let value = value
                        .as_ref()
                        .expect("lag and lead have a value")
                        .evaluate(&buffer)?
                        .into_array(n)?;
                    shifted(&value, &part, rows.clone(), *offset, default)?
                }
            };
            columns.push(if column.data_type() == field.data_type() {
                column
            } else {
                cast(&column, field.data_type())?
            });
        }
        let out = RecordBatch::try_new_with_options(
            Arc::clone(&self.schema),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(rows.len())),
        )?;
        // Keep the last `lookback` rows emitted and those not emitted.
        let keep_from = end.saturating_sub(self.lookback);
        self.first_number = numbers[keep_from];
        self.history = end - keep_from;
        self.buffer = Some(buffer.slice(keep_from, n - keep_from));
        Ok(Some(out))
    }
}

/// Each row's partition, numbered from 0 in the batch: a new number where
/// any key differs from the row before (nulls equal).
fn partition_ids(batch: &RecordBatch, keys: &[Arc<dyn PhysicalExpr>]) -> DfResult<Vec<u32>> {
    let n = batch.num_rows();
    let mut ids = vec![0u32; n];
    if n < 2 || keys.is_empty() {
        return Ok(ids);
    }
    let mut changed: Option<BooleanArray> = None;
    for key in keys {
        let values = key.evaluate(batch)?.into_array(n)?;
        let here = arrow::compute::kernels::cmp::distinct(
            &values.slice(1, n - 1),
            &values.slice(0, n - 1),
        )?;
        changed = Some(match changed {
            None => here,
            Some(c) => arrow::compute::or(&c, &here)?,
        });
    }
    let changed = changed.expect("at least one key");
    for i in 1..n {
        ids[i] = ids[i - 1] + u32::from(changed.value(i - 1));
    }
    Ok(ids)
}

/// The row number of each row given its partition ids and the first
/// row's number (0: it starts a partition, so 1).
fn row_numbers(part: &[u32], first: u64) -> Vec<u64> {
    let mut out = Vec::with_capacity(part.len());
    for (i, p) in part.iter().enumerate() {
        out.push(match i {
            0 => first.max(1),
            _ if part[i - 1] == *p => out[i - 1] + 1,
            _ => 1,
        });
    }
    out
}

/// `value` at `offset` rows from each row in `rows`, where that row is in
/// the same partition; `default` elsewhere.
fn shifted(
    value: &ArrayRef,
    part: &[u32],
    rows: std::ops::Range<usize>,
    offset: i64,
    default: &ScalarValue,
) -> DfResult<ArrayRef> {
    let n = part.len() as i64;
    let indices: UInt32Array = rows
        .clone()
        .map(|i| {
            let j = i as i64 + offset;
            (0..n)
                .contains(&j)
                .then_some(j as usize)
                .and_then(|j| (part[j] == part[i]).then_some(j as u32))
        })
        .collect();
    let taken = take(value.as_ref(), &indices, None)?;
    if default.is_null() {
        return Ok(taken);
    }
    // Where the row is outside the partition: the default.
    let outside = arrow::compute::is_null(&indices)?;
    let default = default.to_scalar()?;
    Ok(arrow::compute::kernels::zip::zip(
        &outside, &default, &taken,
    )?)
}

impl Stream for KeyWindowStream {
    type Item = DfResult<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            let next = match self.input.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(batch))) => Some(batch),
                Poll::Ready(None) => {
                    self.done = true;
                    None
                }
            };
            let elapsed = self.baseline.elapsed_compute().clone();
            let timer = elapsed.timer();
            let stepped = self.step(next);
            timer.done();
            match stepped {
                Ok(Some(out)) => {
                    self.baseline.record_output(out.num_rows());
                    return Poll::Ready(Some(Ok(out)));
                }
                Ok(None) => continue,
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }
}

impl RecordBatchStream for KeyWindowStream {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray, StringViewArray};
    use arrow::datatypes::{Field, Schema};
    use datafusion::catalog::MemTable;
    use datafusion::prelude::{SessionConfig, SessionContext};

    use super::*;

    /// k1, k2, s, x, t, f.
    type Row = (
        Option<String>,
        Option<i64>,
        i64,
        Option<i64>,
        Option<String>,
        f64,
    );

    /// 600 rows in batches of 7: keys with nulls and few values (so each
    /// partition spans batches), a unique order, values with nulls.
    fn table() -> MemTable {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k1", DataType::Utf8, true),
            Field::new("k2", DataType::Int64, true),
            Field::new("s", DataType::Int64, false),
            Field::new("x", DataType::Int64, true),
            Field::new("t", DataType::Utf8View, true),
            Field::new("f", DataType::Float64, true),
        ]));
        let mut state = 42u64;
        let mut next = move |m: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % m
        };
        let rows: Vec<Row> = (0..600)
            .map(|i| {
                let k1 = match next(9) {
                    0 => None,
                    v => Some(format!("key-{v}")),
                };
                let k2 = match next(40) {
                    0 => None,
                    v => Some(v as i64),
                };
                let x = (next(5) != 0).then(|| next(1000) as i64);
                let t = (next(4) != 0).then(|| format!("a rather longer text {}", next(50)));
                (k1, k2, (i * 7919) % 600, x, t, next(3) as f64)
            })
            .collect();
        let batches = rows
            .chunks(7)
            .map(|c| {
                RecordBatch::try_new(
                    Arc::clone(&schema),
                    vec![
                        Arc::new(c.iter().map(|r| r.0.clone()).collect::<StringArray>()),
                        Arc::new(c.iter().map(|r| r.1).collect::<Int64Array>()),
                        Arc::new(c.iter().map(|r| Some(r.2)).collect::<Int64Array>()),
                        Arc::new(c.iter().map(|r| r.3).collect::<Int64Array>()),
                        Arc::new(c.iter().map(|r| r.4.clone()).collect::<StringViewArray>()),
                        Arc::new(
                            c.iter()
                                .map(|r| Some(r.5))
                                .collect::<arrow::array::Float64Array>(),
                        ),
                    ],
                )
                .unwrap()
            })
            .collect::<Vec<_>>();
        // Three input partitions, so the keys are repartitioned.
        let parts = batches.chunks(29).map(|c| c.to_vec()).collect();
        MemTable::try_new(schema, parts).unwrap()
    }

    fn contexts() -> (SessionContext, SessionContext) {
        let config = || {
            SessionConfig::new()
                .with_batch_size(5)
                .with_target_partitions(3)
        };
        let reference = SessionContext::new_with_config(config());
        let ours = SessionContext::new_with_state(
            install(
                SessionStateBuilder::new()
                    .with_config(config())
                    .with_default_features(),
            )
            .build(),
        );
        for ctx in [&reference, &ours] {
            ctx.register_table("t", Arc::new(table())).unwrap();
        }
        (reference, ours)
    }

    async fn text(ctx: &SessionContext, sql: &str) -> String {
        let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string()
    }

    async fn plan(ctx: &SessionContext, sql: &str) -> String {
        text(ctx, &format!("EXPLAIN {sql}")).await
    }

    /// Each query answers as DataFusion's own window answers it, and runs
    /// through the operator.
    #[tokio::test]
    async fn lag_lead_and_row_number_answer_as_datafusion_does() {
        let (reference, ours) = contexts();
        let queries = [
            "SELECT s, k1, x, lag(x) OVER (PARTITION BY k1 ORDER BY s) AS a, \
             lead(x) OVER (PARTITION BY k1 ORDER BY s) AS b, \
             row_number() OVER (PARTITION BY k1 ORDER BY s) AS c FROM t ORDER BY s",
            "SELECT s, lag(x, 3, -1) OVER w AS a, lead(x, 2, 7) OVER w AS b, \
             lag(t) OVER w AS c, lead(t, 4, 'none') OVER w AS d, row_number() OVER w AS e \
             FROM t WINDOW w AS (PARTITION BY k1, k2 ORDER BY s DESC) ORDER BY s",
            "SELECT s, lag(x, 2) OVER (ORDER BY s DESC) AS a, lead(s, 0) OVER (ORDER BY s) AS b, \
             row_number() OVER (ORDER BY s) AS c FROM t ORDER BY s",
            "SELECT s, lead(k1, 5) OVER (PARTITION BY k2 ORDER BY x, s) AS a, \
             lag(s, 1024) OVER (PARTITION BY k2 ORDER BY x, s) AS b FROM t ORDER BY s",
            "SELECT count(*), sum(gap), max(gap) FROM (SELECT s - lag(s) OVER \
             (PARTITION BY upper(k1) ORDER BY s) AS gap FROM t) g WHERE gap IS NOT NULL",
            "SELECT k2, max(n) FROM (SELECT k2, row_number() OVER (PARTITION BY k2 ORDER BY s) AS n \
             FROM t WHERE x > 100) g GROUP BY k2 ORDER BY k2",
        ];
        for sql in queries {
            assert_eq!(text(&ours, sql).await, text(&reference, sql).await, "{sql}");
            let p = plan(&ours, sql).await;
            assert!(p.contains("KeyWindowExec"), "{sql}\n{p}");
            assert!(!p.contains("WindowAggExec"), "{sql}\n{p}");
        }
    }

    /// What the operator does not compute stays with DataFusion, with the
    /// same answers.
    #[tokio::test]
    async fn other_windows_stay_with_datafusion() {
        let (reference, ours) = contexts();
        let queries = [
            "SELECT s, lag(x) IGNORE NULLS OVER (PARTITION BY k1 ORDER BY s) AS a FROM t ORDER BY s",
            "SELECT s, sum(x) OVER (PARTITION BY k1 ORDER BY s) AS a FROM t ORDER BY s",
            "SELECT s, lag(x, 1025) OVER (PARTITION BY k1 ORDER BY s) AS a FROM t ORDER BY s",
            "SELECT s, lag(x) OVER (PARTITION BY f ORDER BY s) AS a FROM t ORDER BY s",
            "SELECT s, lag(x) OVER (PARTITION BY k1 ORDER BY s) AS a, \
             rank() OVER (PARTITION BY k1 ORDER BY s) AS b FROM t ORDER BY s",
        ];
        for sql in queries {
            assert_eq!(text(&ours, sql).await, text(&reference, sql).await, "{sql}");
            let p = plan(&ours, sql).await;
            assert!(!p.contains("KeyWindowExec"), "{sql}\n{p}");
        }
    }
}
