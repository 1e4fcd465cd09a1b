//! One 128-bit integer per row that sorts a key window's input: a number
//! of the key, then the order value.
//!
//! The key window needs its input sorted by the partition keys, then the
//! order. Sorted by the keys themselves (a `_key` such as `{"id":262681}`),
//! DataFusion's sort converts each row to its byte format and merges the
//! sorted batches by comparing those bytes: most of the window query's time
//! (see docs/performance.md#query). But the window needs only each key's
//! rows together and in order, not the keys in order. [`KeyOrderExec`]
//! takes 60 bits of a hash of each row's keys (DataFusion's own hashing,
//! the one its joins and repartitioning use; nulls hash alike) as the
//! key's number and appends `number << 65 | null bit << 64 | order value`
//! as a `Decimal128`: sorted by that one column, which DataFusion compares
//! as an integer, the rows come out grouped by number and ordered within
//! each, and [`order_key_numbers`] reads the number back. Taken when the
//! window orders by one expression that is an integer, a date or a
//! timestamp (what fits 64 bits in order).
//!
//! Keys whose hashes share 60 bits (about one pair in 10^6 queries over a
//! million keys) get one number, and their rows come out interleaved in
//! the order of their values; the window tells the keys apart by their
//! values and puts each key's rows together again (see [`super::collide`]).
//! A hash costs a tenth of numbering each distinct key in a hash table as
//! it comes (`EXPLAIN ANALYZE` of the window over 5,000,000 changes of
//! 1,000,000 keys: 53-57 ms of CPU against 566-661 ms) and holds no memory
//! per key; comparing each row's keys with the row before's, which the
//! collisions need, costs the window about 240 ms of it back.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow::array::{Array, ArrayRef, Decimal128Array, Int64Array, RecordBatch, UInt64Array};
use arrow::compute::{SortOptions, cast};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::hash_utils::{RandomState, create_hashes};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::{BaselineMetrics, ExecutionPlanMetricsSet};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, ExecutionPlanProperties,
    InputDistributionRequirements, PlanProperties, RecordBatchStream,
};
use futures::{Stream, StreamExt};

use crate::query::operator::{on_keys, one_input_basics, only_child, visit};

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

    one_input_basics!();

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        Ok(Box::pin(KeyOrderStream {
            input: self.input.execute(partition, context)?,
            schema: Arc::clone(&self.schema),
            keys: self.keys.clone(),
            order: Arc::clone(&self.order),
            options: self.options,
            hashes: Vec::new(),
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
    /// Each row's key hash, reused from batch to batch.
    hashes: Vec<u64>,
    baseline: BaselineMetrics,
}

/// The bits of a key's hash that make its number: the number takes the
/// bits above the null bit and the value, and the whole stays within the
/// 38 digits of its `Decimal128` (below 2^126).
pub(super) const NUMBER_BITS: u64 = (1 << 60) - 1;

/// The hash's seed: not the one DataFusion's repartitioning uses, whose
/// hashes of one partition's keys all agree in their low bits.
const SEED: u64 = 0x77a1_7a11_5eed_0001;

#[cfg(not(test))]
fn number_bits() -> u64 {
    NUMBER_BITS
}

/// Tests narrow the number to a few bits, so that keys share numbers.
#[cfg(test)]
pub(super) static TEST_NUMBER_BITS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(NUMBER_BITS);

#[cfg(test)]
fn number_bits() -> u64 {
    TEST_NUMBER_BITS.load(std::sync::atomic::Ordering::Relaxed)
}

impl KeyOrderStream {
    fn step(&mut self, batch: &RecordBatch) -> DfResult<RecordBatch> {
        let n = batch.num_rows();
        let keys = self
            .keys
            .iter()
            .map(|k| k.evaluate(batch)?.into_array(n))
            .collect::<DfResult<Vec<ArrayRef>>>()?;
        self.hashes.clear();
        self.hashes.resize(n, 0);
        if !keys.is_empty() {
            create_hashes(&keys, &RandomState::with_seed(SEED), &mut self.hashes)?;
        }
        let bits = number_bits();
        for h in &mut self.hashes {
            *h &= bits;
        }
        let value = self.order.evaluate(batch)?.into_array(n)?;
        let column = order_column(&self.hashes, &value, self.options)?;
        let mut columns = batch.columns().to_vec();
        columns.push(Arc::new(column));
        Ok(RecordBatch::try_new(Arc::clone(&self.schema), columns)?)
    }
}

/// Each row's `number << 65 | null bit << 64 | value bits` (see
/// [`ordered_bits`]).
fn order_column(
    numbers: &[u64],
    value: &ArrayRef,
    options: SortOptions,
) -> DfResult<Decimal128Array> {
    let values = numbers
        .iter()
        .zip(ordered_bits(value, options)?)
        .map(|(&number, bits)| (u128::from(number) << 65 | bits) as i128);
    Ok(Decimal128Array::from_iter_values(values).with_precision_and_scale(38, 0)?)
}

/// Each row's `null bit << 64 | value bits`: as unsigned integers, in the
/// order asked for. The value's bits are ordered as unsigned integers in
/// the direction asked for, and the null bit places nulls first or last.
/// `value` is of a type [`orderable`] takes.
pub(super) fn ordered_bits(value: &ArrayRef, options: SortOptions) -> DfResult<Vec<u128>> {
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
    // The null bit: 0 sorts before 1.
    Ok(bits
        .into_iter()
        .map(|bits| {
            let (bit, bits) = match bits {
                Some(b) => (options.nulls_first, if options.descending { !b } else { b }),
                None => (!options.nulls_first, 0),
            };
            u128::from(bit) << 64 | u128::from(bits)
        })
        .collect())
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
    fn sorted(ids: &[u64], values: ArrayRef, options: SortOptions) -> Vec<(u64, Option<i64>)> {
        let column = order_column(ids, &values, options).unwrap();
        let numbers = order_key_numbers(&(Arc::new(column.clone()) as ArrayRef)).unwrap();
        assert_eq!(numbers, ids);
        let mut rows: Vec<(i128, u64, Option<i64>)> = (0..ids.len())
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
        // The largest number stays positive and within 38 digits.
        let column = order_column(&[NUMBER_BITS], &unsigned.slice(0, 1), asc(true)).unwrap();
        assert!(column.value(0) > 0 && column.value(0) < 10i128.pow(38));
    }
}
