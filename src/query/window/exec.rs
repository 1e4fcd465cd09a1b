//! The operator of [`super`]: `lag`, `lead` and `row_number` over rows
//! sorted by their partition keys, a batch at a time, with the rows a
//! shift reaches carried across batch boundaries.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow::array::AsArray;
use arrow::array::{Array, ArrayRef, RecordBatch, RecordBatchOptions, UInt32Array, UInt64Array};
use arrow::compute::{SortOptions, cast, concat_batches, take};
use arrow::datatypes::{DataType, SchemaRef};
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result as DfResult;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{
    EquivalenceProperties, LexRequirement, OrderingRequirements, PhysicalExpr, PhysicalSortExpr,
    PhysicalSortRequirement,
};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::{BaselineMetrics, ExecutionPlanMetricsSet};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, ExecutionPlanProperties,
    InputDistributionRequirements, PlanProperties, RecordBatchStream,
};
use futures::{Stream, StreamExt};

use super::collide;
use crate::query::operator::{on_keys, one_input_basics, only_child, visit};

/// One function of the window, as the operator computes it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Shift {
    /// `lag` (negative) or `lead` (positive) by the offset, `default`
    /// where the row it names is outside the partition.
    Row {
        offset: i64,
        default: ScalarValue,
    },
    RowNumber,
}

/// The most bytes of one partition's rows the sort by the key order column
/// sorts in place (see [`KeyWindowExec::execute`]); a larger partition is
/// sorted in runs of this size, merged.
const IN_PLACE_SORT_BYTES: usize = 256 << 20;

/// Computes `lag`, `lead` and `row_number` over input sorted by the
/// partition keys (then the order), partitioned on them.
#[derive(Debug, Clone)]
pub(super) struct KeyWindowExec {
    input: Arc<dyn ExecutionPlan>,
    schema: SchemaRef,
    partition_by: Vec<Arc<dyn PhysicalExpr>>,
    order_by: Vec<PhysicalSortExpr>,
    /// Each function, with its value for `lag`/`lead`.
    functions: Vec<(Shift, Option<Arc<dyn PhysicalExpr>>)>,
    /// The input's column of [`super::order::KeyOrderExec`], when the rows
    /// are sorted by it (and it is not passed on), instead of by the keys
    /// and the order.
    order_column: Option<usize>,
    properties: Arc<PlanProperties>,
    /// Time and rows, for `EXPLAIN ANALYZE`.
    metrics: ExecutionPlanMetricsSet,
}

impl KeyWindowExec {
    pub(super) fn new(
        input: Arc<dyn ExecutionPlan>,
        schema: SchemaRef,
        partition_by: Vec<Arc<dyn PhysicalExpr>>,
        order_by: Vec<PhysicalSortExpr>,
        functions: Vec<(Shift, Option<Arc<dyn PhysicalExpr>>)>,
        order_column: Option<usize>,
    ) -> KeyWindowExec {
        let properties = Self::properties(&input, &schema, order_column);
        KeyWindowExec {
            input,
            schema,
            partition_by,
            order_by,
            functions,
            order_column,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// Rows leave in the order they came: the input's orderings hold,
    /// unless they are by the order column, which is not passed on.
    fn properties(
        input: &Arc<dyn ExecutionPlan>,
        schema: &SchemaRef,
        order_column: Option<usize>,
    ) -> Arc<PlanProperties> {
        let orderings: Vec<Vec<PhysicalSortExpr>> = match order_column {
            Some(_) => Vec::new(),
            None => input
                .output_ordering()
                .map(|o| vec![o.iter().cloned().collect()])
                .unwrap_or_default(),
        };
        Arc::new(PlanProperties::new(
            EquivalenceProperties::new_with_orderings(Arc::clone(schema), orderings),
            input.output_partitioning().clone(),
            input.pipeline_behavior(),
            input.boundedness(),
        ))
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

    fn required_input_distribution(&self) -> Vec<Distribution> {
        self.input_distribution_requirements().into_per_child()
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        InputDistributionRequirements::new(vec![on_keys(&self.partition_by)])
    }

    fn required_input_ordering(&self) -> Vec<Option<OrderingRequirements>> {
        if let Some(i) = self.order_column {
            let column = Arc::new(Column::new(super::order::ORDER_COLUMN, i));
            let req = PhysicalSortRequirement::new(column, Some(SortOptions::default()));
            return vec![
                LexRequirement::new([req])
                    .and_then(|r| OrderingRequirements::new_alternatives([r], false)),
            ];
        }
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
        visit(
            self.partition_by
                .iter()
                .chain(self.order_by.iter().map(|s| &s.expr))
                .chain(self.functions.iter().filter_map(|(_, v)| v.as_ref())),
            f,
        )
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        options: ReplaceChildrenOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = only_child(children, "KeyWindowExec")?;
        let properties = match options.children_properties {
            ChildrenPropertiesMode::Keep => Arc::clone(&self.properties),
            ChildrenPropertiesMode::Recompute => {
                Self::properties(&input, &self.schema, self.order_column)
            }
        };
        Ok(Arc::new(KeyWindowExec {
            input,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
            ..KeyWindowExec::clone(&self)
        }))
    }

    one_input_basics!();

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let context = match self.order_column {
            // The sort below is by one integer column: sorted whole in
            // place, rather than batch by batch and merged, it takes a
            // quarter of the time (docs/performance.md#query), for a copy
            // of the partition's rows while it sorts, up to this bound.
            Some(_) => {
                let mut config = context.session_config().clone();
                let execution = &mut config.options_mut().execution;
                execution.sort_in_place_threshold_bytes = execution
                    .sort_in_place_threshold_bytes
                    .max(IN_PLACE_SORT_BYTES);
                Arc::new(TaskContext::new(
                    context.task_id(),
                    context.session_id(),
                    config,
                    context.scalar_functions().clone(),
                    context.higher_order_functions().clone(),
                    context.aggregate_functions().clone(),
                    context.window_functions().clone(),
                    context.runtime_env(),
                ))
            }
            None => context,
        };
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
            order_column: self.order_column,
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
    /// See [`KeyWindowExec`]: partitions told apart by it, and not output.
    order_column: Option<usize>,
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
        let mut end = if last {
            n
        } else {
            n.saturating_sub(self.lookahead)
        };
        let (buffer, part) = match self.order_column {
            Some(i) => {
                let p = collide::partitions(buffer, i, &self.partition_by, last, self.history)?;
                if let Some(held) = p.held_from {
                    end = end.min(held.max(self.history));
                }
                (p.rows, p.part)
            }
            None => {
                let part = partition_ids(&buffer, &self.partition_by)?;
                (buffer, part)
            }
        };
        // Nothing new to emit: every row is held for a `lead`, or for a
        // run of keys that share a number (see [`collide`]).
        if end <= self.history {
            self.buffer = Some(buffer);
            return Ok(None);
        }
        // Numbered only for a `row_number`: `lag` and `lead` need the
        // partitions alone.
        let numbers = self
            .functions
            .iter()
            .any(|(s, _)| *s == Shift::RowNumber)
            .then(|| row_numbers(&part, self.first_number));
        let rows = self.history..end;
        let mut columns: Vec<ArrayRef> = buffer
            .columns()
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != self.order_column)
            .map(|(_, c)| c.slice(rows.start, rows.len()))
            .collect();
        let out_fields = &self.schema.fields()[self.schema.fields().len() - self.functions.len()..];
        for ((shift, value), field) in self.functions.iter().zip(out_fields) {
            let column: ArrayRef = match shift {
                Shift::RowNumber => {
                    let numbers = numbers.as_ref().expect("numbered for a row_number");
                    Arc::new(UInt64Array::from(numbers[rows.clone()].to_vec()))
                }
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
        if let Some(numbers) = &numbers {
            self.first_number = numbers[keep_from];
        }
        self.history = end - keep_from;
        self.buffer = Some(carried(&buffer.slice(keep_from, n - keep_from))?);
        Ok(Some(out))
    }
}

/// The rows carried to the next batch, their text and binary views in
/// buffers of their own: a slice of a view array holds every buffer of
/// the array it came from, and each batch is joined to the rows carried
/// from the one before, so without this the buffers held (and copied at
/// each join) would grow with every batch.
fn carried(rows: &RecordBatch) -> DfResult<RecordBatch> {
    let columns = rows
        .columns()
        .iter()
        .map(|c| -> ArrayRef {
            match c.data_type() {
                DataType::Utf8View => Arc::new(c.as_string_view().gc()),
                DataType::BinaryView => Arc::new(c.as_binary_view().gc()),
                _ => Arc::clone(c),
            }
        })
        .collect();
    Ok(RecordBatch::try_new_with_options(
        rows.schema(),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(rows.num_rows())),
    )?)
}

/// Each row's partition, numbered from 0 in the batch: a new number where
/// any key differs from the row before (nulls equal).
fn partition_ids(batch: &RecordBatch, keys: &[Arc<dyn PhysicalExpr>]) -> DfResult<Vec<u32>> {
    let changes = collide::key_changes(batch, keys)?;
    let mut ids = vec![0u32; changes.len()];
    for i in 1..changes.len() {
        ids[i] = ids[i - 1] + u32::from(changes[i]);
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
    use arrow::array::{Int64Array, StringViewArray};
    use arrow::datatypes::{Field, Schema};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_expr::expressions::col;
    use datafusion::physical_plan::collect;

    use super::*;

    /// Batches each with its own text buffers hold only those (and the few
    /// carried rows'), however many batches came before.
    #[tokio::test]
    async fn carried_rows_do_not_keep_the_buffers_of_earlier_batches() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Utf8View, false),
        ]));
        let batches: Vec<RecordBatch> = (0..60)
            .map(|b| {
                let keys: Vec<i64> = (0..10).map(|i| (b * 10 + i) / 3).collect();
                let texts: Vec<String> = keys
                    .iter()
                    .map(|k| format!("a text longer than twelve bytes {k}"))
                    .collect();
                RecordBatch::try_new(
                    Arc::clone(&schema),
                    vec![
                        Arc::new(Int64Array::from(keys)),
                        Arc::new(StringViewArray::from_iter_values(texts)),
                    ],
                )
                .unwrap()
            })
            .collect();
        let input =
            MemorySourceConfig::try_new_exec(&[batches], Arc::clone(&schema), None).unwrap();
        let out_schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Utf8View, false),
            Field::new("before", DataType::Utf8View, true),
            Field::new("after", DataType::Utf8View, true),
        ]));
        let shift = |offset| Shift::Row {
            offset,
            default: ScalarValue::Utf8View(None),
        };
        let v = col("v", &schema).unwrap();
        let exec = KeyWindowExec::new(
            input,
            out_schema,
            vec![col("k", &schema).unwrap()],
            Vec::new(),
            vec![(shift(-1), Some(Arc::clone(&v))), (shift(2), Some(v))],
            None,
        );
        let out = collect(Arc::new(exec), Arc::new(TaskContext::default()))
            .await
            .unwrap();
        assert_eq!(out.iter().map(RecordBatch::num_rows).sum::<usize>(), 600);
        for (i, batch) in out.iter().enumerate() {
            for c in 1..4 {
                let buffers = batch.column(c).as_string_view().data_buffers().len();
                assert!(buffers <= 3, "batch {i}, column {c}: {buffers} buffers");
            }
        }
        // And the answers: key 7 is rows 21-23.
        let all = arrow::compute::concat_batches(&out[0].schema(), &out).unwrap();
        let text = |c: usize, row: usize| {
            let a = all.column(c).as_string_view();
            a.is_valid(row).then(|| a.value(row).to_string())
        };
        let t = |k: i64| Some(format!("a text longer than twelve bytes {k}"));
        assert_eq!((text(2, 21), text(3, 21)), (None, t(7)));
        assert_eq!((text(2, 22), text(3, 22)), (t(7), None));
        assert_eq!((text(2, 23), text(3, 23)), (t(7), None));
    }
}
