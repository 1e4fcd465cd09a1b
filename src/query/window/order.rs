//! One 128-bit integer per row that sorts a key window's input: the key's
//! number in its partition, then the order value.
//!
//! The key window needs its input sorted by the partition keys, then the
//! order. Sorted by the keys themselves (a `_key` such as `{"id":262681}`),
//! DataFusion's sort converts each row to its byte format and merges the
//! sorted batches by comparing those bytes: most of the window query's time
//! (see docs/performance.md#query). But the window needs only each key's
//! rows together and in order, not the keys in order. [`KeyOrderExec`]
//! numbers each distinct key of a partition as it first sees it (with
//! DataFusion's own group interning, the exact comparison `GROUP BY` uses,
//! nulls one key), and appends `number << 65 | null bit << 64 | order value`
//! as a `Decimal128`: sorted by that one column, which DataFusion compares
//! as an integer, the rows come out grouped by key and ordered within each,
//! and [`order_key_numbers`] tells the partitions apart by the number
//! alone. Taken when the window orders by one expression that is an
//! integer, a date or a timestamp (what fits 64 bits in order).
//!
//! Memory: the distinct keys of a partition, the same as a `GROUP BY` over
//! them, reserved from the session's memory pool.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow::array::{Array, ArrayRef, Decimal128Array, Int64Array, RecordBatch, UInt64Array};
use arrow::compute::{SortOptions, cast};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::aggregates::group_values::{GroupValues, new_group_values};
use datafusion::physical_plan::aggregates::order::GroupOrdering;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::{BaselineMetrics, ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, ExecutionPlanProperties,
    InputDistributionRequirements, PlanProperties, RecordBatchStream,
};
use futures::{Stream, StreamExt};

use super::operator::{on_keys, only_child, visit};

/// The name of the column [`KeyOrderExec`] appends.
pub(super) const ORDER_COLUMN: &str = "__waltail_key_order";

/// Whether an order value of this type fits [`KeyOrderExec`]'s 64 bits in
/// its order: integers, dates, times and timestamps.
pub(super) fn orderable(data_type: &DataType) -> bool {
    use DataType::*;
    match data_type {
        UInt8 | UInt16 | UInt32 | UInt64 => true,
        Int8 | Int16 | Int32 | Int64 | Date32 | Date64 | Time32(_) | Time64(_) | Timestamp(..) => {
            arrow::compute::can_cast_types(data_type, &Int64)
        }
        _ => false,
    }
}

/// Appends the order column (see the module doc) to its input, which it
/// requires partitioned on the keys.
#[derive(Debug, Clone)]
pub(super) struct KeyOrderExec {
    input: Arc<dyn ExecutionPlan>,
    schema: SchemaRef,
    keys: Vec<Arc<dyn PhysicalExpr>>,
    order: Arc<dyn PhysicalExpr>,
    options: SortOptions,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl KeyOrderExec {
    pub(super) fn new(
        input: Arc<dyn ExecutionPlan>,
        keys: Vec<Arc<dyn PhysicalExpr>>,
        order: Arc<dyn PhysicalExpr>,
        options: SortOptions,
    ) -> KeyOrderExec {
        let mut fields: Vec<Arc<Field>> = input.schema().fields().iter().cloned().collect();
        fields.push(Arc::new(Field::new(
            ORDER_COLUMN,
            DataType::Decimal128(38, 0),
            false,
        )));
        let schema = Arc::new(Schema::new_with_metadata(
            fields,
            input.schema().metadata().clone(),
        ));
        let properties = PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            input.output_partitioning().clone(),
            input.pipeline_behavior(),
            input.boundedness(),
        );
        KeyOrderExec {
            input,
            schema,
            keys,
            order,
            options,
            properties: Arc::new(properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for KeyOrderExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let keys: Vec<String> = self.keys.iter().map(|k| k.to_string()).collect();
        write!(
            f,
            "KeyOrderExec: keys=[{}], order={} {}",
            keys.join(", "),
            self.order,
            if self.options.descending {
                "DESC"
            } else {
                "ASC"
            }
        )
    }
}

impl ExecutionPlan for KeyOrderExec {
    fn name(&self) -> &'static str {
        "KeyOrderExec"
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
        InputDistributionRequirements::new(vec![on_keys(&self.keys)])
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        visit(self.keys.iter().chain([&self.order]), f)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        options: ReplaceChildrenOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = only_child(children, "KeyOrderExec")?;
        Ok(Arc::new(match options.children_properties {
            ChildrenPropertiesMode::Keep => KeyOrderExec {
                input,
                metrics: ExecutionPlanMetricsSet::new(),
                ..KeyOrderExec::clone(&self)
            },
            // The appended column and the partitioning follow the input.
            ChildrenPropertiesMode::Recompute => KeyOrderExec::new(
                input,
                self.keys.clone(),
                Arc::clone(&self.order),
                self.options,
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
        let key_fields: Vec<Field> = self
            .keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                Ok(Field::new(
                    format!("k{i}"),
                    k.data_type(&self.input.schema())?,
                    true,
                ))
            })
            .collect::<DfResult<_>>()?;
        let numbers = new_group_values(Arc::new(Schema::new(key_fields)), &GroupOrdering::None)?;
        let reservation = MemoryConsumer::new(format!("KeyOrderExec[{partition}]"))
            .register(context.memory_pool());
        Ok(Box::pin(KeyOrderStream {
            input: self.input.execute(partition, context)?,
            schema: Arc::clone(&self.schema),
            keys: self.keys.clone(),
            order: Arc::clone(&self.order),
            options: self.options,
            numbers,
            ids: Vec::new(),
            reservation,
            baseline: BaselineMetrics::new(&self.metrics, partition),
        }))
    }
}

struct KeyOrderStream {
    input: SendableRecordBatchStream,
    schema: SchemaRef,
    keys: Vec<Arc<dyn PhysicalExpr>>,
    order: Arc<dyn PhysicalExpr>,
    options: SortOptions,
    /// Each distinct key seen in this partition, by its number.
    numbers: Box<dyn GroupValues>,
    ids: Vec<usize>,
    reservation: MemoryReservation,
    baseline: BaselineMetrics,
}

/// The most keys one partition can number: the number takes the bits above
/// the null bit and the value, and the whole stays within the 38 digits of
/// its `Decimal128` (below 2^126).
const MAX_KEYS: usize = 1 << 60;

impl KeyOrderStream {
    fn step(&mut self, batch: &RecordBatch) -> DfResult<RecordBatch> {
        let n = batch.num_rows();
        let keys = self
            .keys
            .iter()
            .map(|k| k.evaluate(batch)?.into_array(n))
            .collect::<DfResult<Vec<ArrayRef>>>()?;
        if keys.is_empty() {
            self.ids.clear();
            self.ids.resize(n, 0);
        } else {
            self.numbers.intern(&keys, &mut self.ids)?;
            self.reservation.try_resize(self.numbers.size())?;
            if self.numbers.len() > MAX_KEYS {
                return Err(DataFusionError::ResourcesExhausted(format!(
                    "more than {MAX_KEYS} keys in one window partition"
                )));
            }
        }
        let value = self.order.evaluate(batch)?.into_array(n)?;
        let column = order_column(&self.ids, &value, self.options)?;
        let mut columns = batch.columns().to_vec();
        columns.push(Arc::new(column));
        Ok(RecordBatch::try_new(Arc::clone(&self.schema), columns)?)
    }
}

/// Each row's `number << 65 | null bit << 64 | value bits`: the value's
/// bits ordered as unsigned integers in the order asked for, and the null
/// bit placing nulls first or last.
fn order_column(
    ids: &[usize],
    value: &ArrayRef,
    options: SortOptions,
) -> DfResult<Decimal128Array> {
    // Signed values shifted into the unsigned range keep their order.
    let bits: Vec<Option<u64>> = match value.data_type() {
        DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => {
            let v = cast(value, &DataType::UInt64)?;
            let v = v
                .as_any()
                .downcast_ref::<UInt64Array>()
                .expect("cast to UInt64");
            v.iter().collect()
        }
        _ => {
            let v = cast(value, &DataType::Int64)?;
            let v = v
                .as_any()
                .downcast_ref::<Int64Array>()
                .expect("cast to Int64");
            v.iter()
                .map(|x| x.map(|x| (x as u64) ^ (1 << 63)))
                .collect()
        }
    };
    // The null bit: 0 sorts before 1, within a key.
    let values = ids.iter().zip(bits).map(|(&id, bits)| {
        let (bit, bits) = match bits {
            Some(b) => (options.nulls_first, if options.descending { !b } else { b }),
            None => (!options.nulls_first, 0),
        };
        ((id as u128) << 65 | u128::from(bit) << 64 | u128::from(bits)) as i128
    });
    Ok(Decimal128Array::from_iter_values(values).with_precision_and_scale(38, 0)?)
}

/// The key number of each order value (see [`order_column`]).
pub(super) fn order_key_numbers(column: &ArrayRef) -> DfResult<Vec<u64>> {
    let column = column
        .as_any()
        .downcast_ref::<Decimal128Array>()
        .ok_or_else(|| DataFusionError::Internal("the key order is not a Decimal128".into()))?;
    Ok(column.values().iter().map(|v| (*v >> 65) as u64).collect())
}

impl Stream for KeyOrderStream {
    type Item = DfResult<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.input.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(batch))) => {
                let elapsed = self.baseline.elapsed_compute().clone();
                let timer = elapsed.timer();
                let out = self.step(&batch);
                timer.done();
                if let Ok(out) = &out {
                    self.baseline.record_output(out.num_rows());
                }
                Poll::Ready(Some(out))
            }
            other => other,
        }
    }
}

impl RecordBatchStream for KeyOrderStream {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int32Array, UInt64Array};

    use super::*;

    /// The rows of `ids` and `values` in the order of their order column.
    fn sorted(ids: &[usize], values: ArrayRef, options: SortOptions) -> Vec<(usize, Option<i64>)> {
        let column = order_column(ids, &values, options).unwrap();
        let numbers = order_key_numbers(&(Arc::new(column.clone()) as ArrayRef)).unwrap();
        assert_eq!(numbers, ids.iter().map(|&i| i as u64).collect::<Vec<_>>());
        let mut rows: Vec<(i128, usize, Option<i64>)> = (0..ids.len())
            .map(|i| {
                let v = cast(&values, &DataType::Int64).unwrap();
                let v = v.as_any().downcast_ref::<Int64Array>().unwrap();
                (column.value(i), ids[i], v.is_valid(i).then(|| v.value(i)))
            })
            .collect();
        rows.sort();
        rows.into_iter().map(|(_, id, v)| (id, v)).collect()
    }

    #[test]
    fn the_order_column_groups_keys_and_orders_values_nulls_and_signs() {
        let ids = [1, 0, 1, 0, 0, 1, 0];
        let values: ArrayRef = Arc::new(Int32Array::from(vec![
            Some(5),
            Some(-3),
            None,
            Some(i32::MAX),
            None,
            Some(i32::MIN),
            Some(0),
        ]));
        let asc = |nulls_first| SortOptions {
            descending: false,
            nulls_first,
        };
        let desc = |nulls_first| SortOptions {
            descending: true,
            nulls_first,
        };
        let big = Some(i64::from(i32::MAX));
        let small = Some(i64::from(i32::MIN));
        assert_eq!(
            sorted(&ids, Arc::clone(&values), asc(false)),
            [
                (0, Some(-3)),
                (0, Some(0)),
                (0, big),
                (0, None),
                (1, small),
                (1, Some(5)),
                (1, None)
            ]
        );
        assert_eq!(
            sorted(&ids, Arc::clone(&values), asc(true)),
            [
                (0, None),
                (0, Some(-3)),
                (0, Some(0)),
                (0, big),
                (1, None),
                (1, small),
                (1, Some(5))
            ]
        );
        assert_eq!(
            sorted(&ids, Arc::clone(&values), desc(true)),
            [
                (0, None),
                (0, big),
                (0, Some(0)),
                (0, Some(-3)),
                (1, None),
                (1, Some(5)),
                (1, small)
            ]
        );
        assert_eq!(
            sorted(&ids, values, desc(false)),
            [
                (0, big),
                (0, Some(0)),
                (0, Some(-3)),
                (0, None),
                (1, Some(5)),
                (1, small),
                (1, None)
            ]
        );
        // Unsigned values keep their order up to the largest.
        let unsigned: ArrayRef = Arc::new(UInt64Array::from(vec![u64::MAX, 0, 1 << 63]));
        let column = order_column(&[7, 7, 7], &unsigned, asc(false)).unwrap();
        assert!(column.value(1) < column.value(2) && column.value(2) < column.value(0));
        // The largest number of keys stays positive and within 38 digits.
        let column = order_column(&[MAX_KEYS], &unsigned.slice(0, 1), asc(true)).unwrap();
        assert!(column.value(0) > 0 && column.value(0) < 10i128.pow(38));
    }
}
