//! `count(*)` grouped by one integer column whose values the statistics
//! bound to a range of at most [`MOST_SLOTS`], counted in an array indexed
//! by the value instead of a hash table.
//!
//! The busiest keys of a history (`SELECT id, count(*) ... GROUP BY id`)
//! group every change by its key: DataFusion hashes each row's key, looks
//! it up in a table it grows as groups arrive (rehashing as it goes),
//! and does so twice, a first step per scan partition and a final one per
//! hash split. Keys are usually numbered densely, and the Parquet
//! statistics give their smallest and largest values, so a count per key
//! is an array of `max - min + 1` counters: a row adds one to the counter
//! its key indexes. `DenseCountExec` reads its input's partitions at once,
//! each into an array of its own, then adds the arrays together and emits
//! the keys counted. A key outside the range (the changes not compacted
//! yet have no statistics) is counted in a small hash map beside it, and
//! rows of a null key in one counter, so the answer never depends on the
//! statistics being right.
//!
//! Taken only where the grouping's parts are merged into one stream above
//! it through operators that take any number of parts (see
//! [`super::fanout`], whose walk finds it), and only for `count(*)` alone,
//! without `DISTINCT` or `FILTER`, and where the range is at most
//! [`SLOTS_PER_ROW`] times the rows: sparse keys are left to the hash
//! table. Memory: 8 bytes per value of the range per core, reserved from
//! the session's pool.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Int64Type, SchemaRef};
use datafusion::common::ScalarValue;
use datafusion::common::runtime::SpawnedTask;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::memory_pool::MemoryConsumer;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::execution_plan::{
    Boundedness, EmissionType, ReplaceChildrenOptions,
};
use datafusion::physical_plan::metrics::{BaselineMetrics, ExecutionPlanMetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, ExecutionPlanProperties,
    InputDistributionRequirements, PlanProperties,
};
use futures::StreamExt;

use crate::query::bounds::{Bounds, bounds};
use crate::query::operator::{integer, one_input_basics, only_child, visit};

/// The widest range of values counted in an array: 2^21, 16 MiB of
/// counters per input partition.
const MOST_SLOTS: usize = 1 << 21;

/// The most values of the range per row of the input the statistics count.
const SLOTS_PER_ROW: usize = 4;

/// The key column of `first` (a grouping's first step), a column of its
/// input, if it is `count(*)` alone grouped by one integer column.
fn counted_key(first: &AggregateExec) -> Option<Column> {
    let group = first.group_expr();
    if !group.is_single() || group.expr().len() != 1 || !group.null_expr().is_empty() {
        return None;
    }
    let (key, _) = &group.expr()[0];
    let column = key.downcast_ref::<Column>()?;
    let schema = first.input().schema();
    if !integer(schema.field(column.index()).data_type()) {
        return None;
    }
    let [count] = first.aggr_expr() else {
        return None;
    };
    let star = count.fun().name() == "count"
        && !count.is_distinct()
        && count.order_bys().is_empty()
        && count.expressions().iter().all(|e| {
            e.downcast_ref::<Literal>()
                .is_some_and(|l| !l.value().is_null())
        });
    let unfiltered = first.filter_expr().iter().all(Option::is_none);
    (star && unfiltered).then(|| column.clone())
}

/// See the module doc. One output partition.
#[derive(Debug, Clone)]
pub(crate) struct DenseCountExec {
    input: Arc<dyn ExecutionPlan>,
    key: Arc<dyn PhysicalExpr>,
    /// The smallest value the statistics give, and how many follow it.
    low: i64,
    slots: usize,
    /// The tasks that count, an array each: the input's partitions are
    /// dealt out among them.
    threads: usize,
    /// The final grouping's: the key, then the count.
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl DenseCountExec {
    pub(crate) fn new(
        input: Arc<dyn ExecutionPlan>,
        key: Arc<dyn PhysicalExpr>,
        low: i64,
        slots: usize,
        threads: usize,
        schema: SchemaRef,
    ) -> DenseCountExec {
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        DenseCountExec {
            input,
            key,
            low,
            slots,
            threads: threads.max(1),
            schema,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for DenseCountExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "DenseCountExec: key={}, low={}, slots={}, threads={}",
            self.key, self.low, self.slots, self.threads
        )
    }
}

impl ExecutionPlan for DenseCountExec {
    fn name(&self) -> &'static str {
        "DenseCountExec"
    }

    fn required_input_distribution(&self) -> Vec<Distribution> {
        self.input_distribution_requirements().into_per_child()
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        InputDistributionRequirements::new(vec![Distribution::UnspecifiedDistribution])
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        visit([&self.key], f)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = only_child(children, "DenseCountExec")?;
        Ok(Arc::new(DenseCountExec {
            input,
            metrics: ExecutionPlanMetricsSet::new(),
            ..DenseCountExec::clone(&self)
        }))
    }

    one_input_basics!();

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        if partition != 0 {
            return Err(DataFusionError::Internal(format!(
                "DenseCountExec has one partition, not {partition}"
            )));
        }
        let this = self.clone();
        let baseline = BaselineMetrics::new(&self.metrics, partition);
        let batches = futures::stream::once(async move { this.count(context, baseline).await })
            .flat_map(|r| match r {
                Ok(batches) => futures::stream::iter(batches.into_iter().map(Ok)).boxed(),
                Err(e) => futures::stream::once(async { Err(e) }).boxed(),
            });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            batches,
        )))
    }
}

/// One input partition's counts.
struct Counts {
    low: i64,
    dense: Vec<u64>,
    /// Keys outside the range.
    sparse: HashMap<i64, u64>,
    nulls: u64,
}

impl Counts {
    fn new(low: i64, slots: usize) -> Counts {
        Counts {
            low,
            dense: vec![0; slots],
            sparse: HashMap::new(),
            nulls: 0,
        }
    }

    fn add(&mut self, keys: &Int64Array) {
        let slots = self.dense.len() as u64;
        let mut add = |key: i64| {
            // Below `low` wraps past the end: one comparison.
            let at = key.wrapping_sub(self.low) as u64;
            if at < slots {
                self.dense[at as usize] += 1;
            } else {
                *self.sparse.entry(key).or_insert(0) += 1;
            }
        };
        match keys.nulls() {
            None => keys.values().iter().for_each(|&k| add(k)),
            Some(valid) => {
                for (i, &k) in keys.values().iter().enumerate() {
                    if valid.is_valid(i) {
                        add(k);
                    }
                }
                self.nulls += valid.null_count() as u64;
            }
        }
    }

    fn merge(&mut self, other: Counts) {
        for (a, b) in self.dense.iter_mut().zip(other.dense) {
            *a += b;
        }
        for (k, n) in other.sparse {
            *self.sparse.entry(k).or_insert(0) += n;
        }
        self.nulls += other.nulls;
    }
}

impl DenseCountExec {
    /// Counts every input partition at once, then emits the keys counted.
    async fn count(
        &self,
        context: Arc<TaskContext>,
        baseline: BaselineMetrics,
    ) -> DfResult<Vec<RecordBatch>> {
        let partitions = self.input.output_partitioning().partition_count();
        let threads = self.threads.min(partitions).max(1);
        let reservation = MemoryConsumer::new("DenseCountExec").register(context.memory_pool());
        reservation.try_grow(threads * self.slots * size_of::<u64>())?;
        let tasks: Vec<SpawnedTask<DfResult<Counts>>> = (0..threads)
            .map(|t| {
                let inputs = (t..partitions)
                    .step_by(threads)
                    .map(|p| self.input.execute(p, Arc::clone(&context)))
                    .collect::<DfResult<Vec<_>>>()?;
                let key = Arc::clone(&self.key);
                let (low, slots) = (self.low, self.slots);
                let elapsed = baseline.elapsed_compute().clone();
                Ok(SpawnedTask::spawn(async move {
                    let mut counts = Counts::new(low, slots);
                    for mut input in inputs {
                        while let Some(batch) = input.next().await {
                            let batch = batch?;
                            let _timer = elapsed.timer();
                            let values = key.evaluate(&batch)?.into_array(batch.num_rows())?;
                            let values = cast(&values, &DataType::Int64)?;
                            counts.add(values.as_primitive::<Int64Type>());
                        }
                    }
                    Ok(counts)
                }))
            })
            .collect::<DfResult<_>>()?;
        let mut total: Option<Counts> = None;
        for task in tasks {
            let counts = task.join_unwind().await.map_err(|e| {
                DataFusionError::Execution(format!("DenseCountExec: a partition's task: {e}"))
            })??;
            match &mut total {
                Some(t) => t.merge(counts),
                None => total = Some(counts),
            }
        }
        let timer = baseline.elapsed_compute().timer();
        let out = match total {
            Some(t) => self.emit(t, context.session_config().batch_size())?,
            None => Vec::new(),
        };
        timer.done();
        baseline.record_output(out.iter().map(RecordBatch::num_rows).sum());
        Ok(out)
    }

    /// The keys counted, in batches of at most `batch_size` rows: the
    /// range's in order, then those outside it, then the null key's.
    fn emit(&self, counts: Counts, batch_size: usize) -> DfResult<Vec<RecordBatch>> {
        let mut keys: Vec<Option<i64>> = Vec::new();
        let mut numbers: Vec<i64> = Vec::new();
        let mut batches = Vec::new();
        let mut flush = |keys: &mut Vec<Option<i64>>, numbers: &mut Vec<i64>| -> DfResult<()> {
            if keys.is_empty() {
                return Ok(());
            }
            let key: ArrayRef = Arc::new(Int64Array::from(std::mem::take(keys)));
            let key = cast(&key, self.schema.field(0).data_type())?;
            let number: ArrayRef = Arc::new(Int64Array::from(std::mem::take(numbers)));
            batches.push(RecordBatch::try_new(
                Arc::clone(&self.schema),
                vec![key, number],
            )?);
            Ok(())
        };
        let counted = counts
            .dense
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(at, n)| (Some(counts.low.wrapping_add(at as i64)), *n))
            .chain(counts.sparse.iter().map(|(k, n)| (Some(*k), *n)))
            .chain((counts.nulls > 0).then_some((None, counts.nulls)));
        for (key, n) in counted {
            keys.push(key);
            numbers.push(i64::try_from(n).unwrap_or(i64::MAX));
            if keys.len() == batch_size.max(1) {
                flush(&mut keys, &mut numbers)?;
            }
        }
        flush(&mut keys, &mut numbers)?;
        Ok(batches)
    }
}

/// The grouping whose final step is `last` and first step `first`, as a
/// [`DenseCountExec`] over the first step's input, if it counts rows by
/// one integer key whose range the statistics bound (see the module doc).
pub(crate) fn dense(
    last: &AggregateExec,
    first: &AggregateExec,
    cores: usize,
) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    if last.limit_options().is_some() || last.filter_expr().iter().any(Option::is_some) {
        return Ok(None);
    }
    let Some(key) = counted_key(first) else {
        return Ok(None);
    };
    let Some(Bounds {
        min,
        max,
        rows: Some(rows),
    }) = bounds(first.input(), key.index())?
    else {
        return Ok(None);
    };
    let as_i64 = |v: ScalarValue| match v.cast_to(&DataType::Int64) {
        Ok(ScalarValue::Int64(Some(i))) => Some(i),
        _ => None,
    };
    let (Some(low), Some(high)) = (as_i64(min), as_i64(max)) else {
        return Ok(None);
    };
    let slots = (i128::from(high) - i128::from(low) + 1) as u128;
    if slots > MOST_SLOTS as u128 || slots > (rows as u128).saturating_mul(SLOTS_PER_ROW as u128) {
        return Ok(None);
    }
    Ok(Some(Arc::new(DenseCountExec::new(
        Arc::clone(first.input()),
        Arc::new(key),
        low,
        slots as usize,
        cores,
        last.schema(),
    ))))
}

#[cfg(test)]
mod tests {
    use arrow::datatypes::{Field, Schema};
    use datafusion::physical_plan::collect;
    use datafusion::prelude::SessionContext;

    use super::*;
    use crate::query::fanout::GroupFanOut;
    use crate::query::plans::{parquet_sessions, plan_and_answer};

    /// `t (id, v)` in a Parquet file: 100,000 rows, `id` from -5,000 to
    /// 14,999 (null in every 50th row), `v` from 0 to 6 (null in every
    /// 11th); in two sessions of two cores, one with the rule.
    async fn sessions() -> (SessionContext, SessionContext, tempfile::TempDir) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("v", DataType::Int32, true),
        ]));
        let ids: Int64Array = (0..100_000)
            .map(|i| (i % 50 != 0).then_some(i64::from(i % 20_000) - 5_000))
            .collect();
        let vs: arrow::array::Int32Array = (0..100_000)
            .map(|i| (i % 11 != 0).then_some(i % 7))
            .collect();
        let batch = RecordBatch::try_new(schema, vec![Arc::new(ids), Arc::new(vs)]).unwrap();
        parquet_sessions(Arc::new(GroupFanOut), &batch).await
    }

    #[tokio::test]
    async fn a_count_by_a_bounded_integer_key_is_counted_in_an_array() {
        let (plain, ctx, _dir) = sessions().await;
        let dense = [
            "SELECT id, count(*) AS n FROM t GROUP BY id ORDER BY n DESC, id LIMIT 5",
            "SELECT id, count(*) AS n FROM t GROUP BY id ORDER BY id NULLS FIRST LIMIT 5",
            "SELECT v, count(1) FROM t GROUP BY v ORDER BY v",
            "SELECT id, count(*) FROM t WHERE v = 3 GROUP BY id ORDER BY id DESC LIMIT 7",
        ];
        let hashed = [
            // Another aggregate, a count of a column, a distinct count.
            "SELECT id, count(*), sum(v) FROM t GROUP BY id ORDER BY id LIMIT 5",
            "SELECT id, count(v) AS n FROM t GROUP BY id ORDER BY n DESC, id LIMIT 5",
            "SELECT v, count(DISTINCT id) FROM t GROUP BY v ORDER BY v",
            // A key made of two columns, or computed.
            "SELECT id, v, count(*) FROM t GROUP BY id, v ORDER BY id, v LIMIT 5",
            "SELECT id * 1000, count(*) FROM t GROUP BY id * 1000 ORDER BY 1 LIMIT 5",
        ];
        for sql in dense.iter().chain(&hashed) {
            let (plan, answer) = plan_and_answer(&ctx, sql).await;
            assert_eq!(
                plan.contains("DenseCountExec"),
                dense.contains(sql),
                "{sql}: {plan}"
            );
            let (_, plain_answer) = plan_and_answer(&plain, sql).await;
            assert_eq!(answer, plain_answer, "{sql}");
        }
    }

    /// Keys outside the range the operator was given (statistics that are
    /// wrong, or changes without any) are counted all the same.
    #[tokio::test]
    async fn keys_outside_the_range_are_counted_too() {
        let (_, ctx, _dir) = sessions().await;
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("count(*)", DataType::Int64, false),
        ]));
        for (low, slots) in [(10, 5), (-5_000, 20_000), (i64::MAX - 2, 3), (0, 1)] {
            // A plan of its own each time: a scan is read once.
            let ids = ctx
                .sql("SELECT id FROM t")
                .await
                .unwrap()
                .create_physical_plan()
                .await
                .unwrap();
            let exec = Arc::new(DenseCountExec::new(
                ids,
                Arc::new(Column::new("id", 0)),
                low,
                slots,
                2,
                Arc::clone(&schema),
            ));
            let batches = collect(exec, ctx.task_ctx()).await.unwrap();
            let mut counted: Vec<(Option<i64>, i64)> = batches
                .iter()
                .flat_map(|b| {
                    let keys = b.column(0).as_primitive::<Int64Type>().clone();
                    let n = b.column(1).as_primitive::<Int64Type>().clone();
                    (0..b.num_rows())
                        .map(move |i| (keys.is_valid(i).then(|| keys.value(i)), n.value(i)))
                })
                .collect();
            counted.sort_unstable();
            let mut expected: Vec<(Option<i64>, i64)> = (-5_000..15_000)
                .map(|k| (Some(k), 5 - i64::from((k + 5_000) % 50 == 0) * 5))
                .filter(|(_, n)| *n > 0)
                .collect();
            expected.push((None, 2_000));
            expected.sort_unstable();
            assert!(
                counted == expected,
                "low {low}, slots {slots}: {} keys counted",
                counted.len()
            );
        }
    }
}
