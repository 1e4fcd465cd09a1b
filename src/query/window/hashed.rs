//! The key window without a sort: each row's key looked up in a table, in
//! the order of the window's `ORDER BY`.
//!
//! A history's rows come in seq order: compact writes each file in seq
//! order, a file's batches follow one another, and no two files share a
//! seq. So the input's batches, taken in the order of their first values,
//! are already every key's rows in order, and what `lag`, `lead` and
//! `row_number` need of a row is the row of the same key that came before
//! it. [`HashedWindowExec`] takes every batch of its input (one partition
//! of it: the scans run in parallel below), orders the batches by their
//! first order values, and walks the rows in that order looking each key
//! up in a [`crate::query::keytable::KeyTable`]: the entry holds the key's last row and its count,
//! so each row learns the row before it (`lag`), tells that row it is the
//! one after (`lead`), and its number. Where the batches are not in order
//! (a value falls back within a batch, or two batches overlap), the rows
//! are sorted by the order value first, and the walk is the same.
//!
//! Against the sort by key (see [`super::order`]) this reads each key's
//! bytes where the scan left them, one after another, and touches memory
//! out of order only for the table's entries, which the walk asks for
//! ahead. The walk is shared among threads by the keys' hashes (see
//! [`super::walk`]). The output comes in as many partitions as threads,
//! the batches dealt among them.
//!
//! Memory: every input row, as a sort holds them, eight to twenty-four
//! bytes per row of links and numbers, and a table entry (32 bytes, and
//! the bytes of a key longer than 15) per key.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, RecordBatchOptions};
use arrow::array::{UInt64Array, new_null_array};
use arrow::compute::{cast, interleave};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::row::{RowConverter, SortField};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{
    EquivalenceProperties, Partitioning, PhysicalExpr, PhysicalSortExpr,
};
use datafusion::physical_plan::execution_plan::{
    Boundedness, EmissionType, ReplaceChildrenOptions,
};
use datafusion::physical_plan::metrics::{BaselineMetrics, ExecutionPlanMetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, InputDistributionRequirements,
    PlanProperties,
};
use futures::{StreamExt, TryStreamExt};
use tokio::sync::OnceCell;

use super::exec::Shift;
use super::walk::{
    Keys, Links, NONE, NULL_HASH, Prepared, bytes, in_order, links, on_threads, row_at, split,
    walk_keys,
};
use crate::query::keytable::KeyHasher;
use crate::query::operator::{one_input_basics, only_child, visit};

/// The largest `lag`/`lead` offset computed here: a row's k-th neighbour
/// is found by following k links, so a larger offset is left to the sort.
pub(super) const MAX_OFFSET: i64 = 16;

/// Computes `lag`, `lead` and `row_number` of rows over one key without a
/// sort (see the module doc), for an order by one value [`super::order::orderable`] takes.
#[derive(Debug, Clone)]
pub(super) struct HashedWindowExec {
    input: Arc<dyn ExecutionPlan>,
    schema: SchemaRef,
    partition_by: Vec<Arc<dyn PhysicalExpr>>,
    order: PhysicalSortExpr,
    /// Each function, with its value for `lag`/`lead`.
    functions: Vec<(Shift, Option<Arc<dyn PhysicalExpr>>)>,
    /// The threads that share the walk, and the output partitions.
    threads: usize,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
    /// The walk's result, made once for all the output partitions.
    walked: Arc<OnceCell<Result<Arc<Walked>, Arc<DataFusionError>>>>,
}

impl HashedWindowExec {
    pub(super) fn new(
        input: Arc<dyn ExecutionPlan>,
        schema: SchemaRef,
        partition_by: Vec<Arc<dyn PhysicalExpr>>,
        order: PhysicalSortExpr,
        functions: Vec<(Shift, Option<Arc<dyn PhysicalExpr>>)>,
        threads: usize,
    ) -> HashedWindowExec {
        let threads = threads.max(1);
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            Partitioning::UnknownPartitioning(threads),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        HashedWindowExec {
            input,
            schema,
            partition_by,
            order,
            functions,
            threads,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
            walked: Arc::new(OnceCell::new()),
        }
    }
}

impl DisplayAs for HashedWindowExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let names: Vec<&str> = self.schema.fields()
            [self.schema.fields().len() - self.functions.len()..]
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        write!(
            f,
            "HashedWindowExec: [{}], threads={}",
            names.join(", "),
            self.threads
        )
    }
}

impl ExecutionPlan for HashedWindowExec {
    fn name(&self) -> &'static str {
        "HashedWindowExec"
    }

    fn required_input_distribution(&self) -> Vec<Distribution> {
        self.input_distribution_requirements().into_per_child()
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        // Every row in one stream, the scans' batches whole and in their
        // own order: the walk orders them.
        InputDistributionRequirements::new(vec![Distribution::SinglePartition])
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        visit(
            self.partition_by
                .iter()
                .chain([&self.order.expr])
                .chain(self.functions.iter().filter_map(|(_, v)| v.as_ref())),
            f,
        )
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        // The output's properties do not depend on the input's.
        let input = only_child(children, "HashedWindowExec")?;
        Ok(Arc::new(HashedWindowExec {
            input,
            metrics: ExecutionPlanMetricsSet::new(),
            walked: Arc::new(OnceCell::new()),
            ..HashedWindowExec::clone(&self)
        }))
    }

    one_input_basics!();

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let this = self.clone();
        let baseline = BaselineMetrics::new(&self.metrics, partition);
        let threads = self.threads;
        let walked = futures::stream::once(async move {
            this.walked
                .get_or_init(|| this.walk(context, baseline.clone()))
                .await
                .clone()
                .map_err(DataFusionError::Shared)
                .map(|w| (w, this, baseline))
        });
        let batches = walked
            .map_ok(move |(w, this, baseline)| {
                let count = w.batches.len();
                futures::stream::iter((partition..count).step_by(threads)).map(move |j| {
                    let timer = baseline.elapsed_compute().timer();
                    let out = this.output(&w, j);
                    timer.done();
                    if let Ok(b) = &out {
                        baseline.record_output(b.num_rows());
                    }
                    out
                })
            })
            .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            batches,
        )))
    }
}

/// What the walk leaves: the rows in the order walked, and for each row
/// (by batch, then place) the links and numbers the functions need.
struct Walked {
    batches: Vec<RecordBatch>,
    /// By function (for `lag` and `lead`), by batch: the value.
    values: Vec<Vec<ArrayRef>>,
    /// Each row's key's row before it, if a `lag` needs it.
    before: Vec<Box<[AtomicU64]>>,
    /// Each row's key's row after it, if a `lead` needs it.
    after: Vec<Box<[AtomicU64]>>,
    /// Each row's number in its key, if a `row_number` needs it.
    numbers: Vec<Box<[AtomicU64]>>,
    /// The input rows' memory, given back when the output is read.
    _reservation: MemoryReservation,
}

impl fmt::Debug for Walked {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.debug_struct("Walked")
            .field("batches", &self.batches.len())
            .finish_non_exhaustive()
    }
}

impl HashedWindowExec {
    /// Reads the input whole and walks it (see the module doc).
    async fn walk(
        &self,
        context: Arc<TaskContext>,
        baseline: BaselineMetrics,
    ) -> Result<Arc<Walked>, Arc<DataFusionError>> {
        let run = async {
            let reservation =
                MemoryConsumer::new("HashedWindowExec").register(context.memory_pool());
            let mut input = self.input.execute(0, Arc::clone(&context))?;
            let mut batches = Vec::new();
            while let Some(batch) = input.next().await {
                let batch = batch?;
                if batch.num_rows() > 0 {
                    reservation.try_grow(batch.get_array_memory_size())?;
                    batches.push(batch);
                }
            }
            let this = self.clone();
            let batch_size = context.session_config().batch_size();
            tokio::task::spawn_blocking(move || {
                let timer = baseline.elapsed_compute().timer();
                let walked = this.walk_rows(batches, batch_size, reservation);
                timer.done();
                walked
            })
            .await
            .map_err(|e| DataFusionError::External(Box::new(e)))?
        };
        run.await.map(Arc::new).map_err(Arc::new)
    }

    fn walk_rows(
        &self,
        batches: Vec<RecordBatch>,
        batch_size: usize,
        reservation: MemoryReservation,
    ) -> DfResult<Walked> {
        let batches = in_order(batches, &self.order, batch_size)?;
        if batches.len() as u64 >= u64::from(u32::MAX) {
            return Err(DataFusionError::ResourcesExhausted(
                "a key window over more than 2^32 batches".into(),
            ));
        }
        let threads = self.threads;
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        let hasher = KeyHasher::default();
        let converter = self.converter()?;
        // Keys, hashes and values of each batch, the batches dealt among
        // the threads.
        let prepared = on_threads(threads, |t| {
            (t..batches.len())
                .step_by(threads)
                .map(|j| self.prepare(&batches[j], converter.as_ref(), &hasher))
                .collect::<DfResult<Vec<_>>>()
        })?;
        let mut dealt: Vec<_> = prepared.into_iter().map(Vec::into_iter).collect();
        let mut keys = Vec::with_capacity(batches.len());
        let mut values: Vec<Vec<ArrayRef>> = vec![Vec::new(); self.functions.len()];
        for j in 0..batches.len() {
            let (p, v) = dealt[j % threads].next().expect("each batch prepared");
            keys.push(p);
            for (f, v) in v.into_iter().enumerate() {
                if let Some(v) = v {
                    values[f].push(v);
                }
            }
        }
        let wants = |f: fn(&Shift) -> bool| self.functions.iter().any(|(s, _)| f(s));
        let links = Links {
            before: links(
                &batches,
                wants(|s| matches!(s, Shift::Row { offset, .. } if *offset < 0)),
            ),
            after: links(
                &batches,
                wants(|s| matches!(s, Shift::Row { offset, .. } if *offset > 0)),
            ),
            numbers: links(&batches, wants(|s| *s == Shift::RowNumber)),
        };
        let per_row = 8 * [&links.before, &links.after, &links.numbers]
            .iter()
            .filter(|l| !l.is_empty())
            .count();
        reservation.try_grow(rows * per_row)?;
        on_threads(threads, |t| {
            walk_keys(&keys, t, threads, &links, rows, &hasher)
        })?;
        let Links {
            before,
            after,
            numbers,
        } = links;
        Ok(Walked {
            batches,
            values,
            before,
            after,
            numbers,
            _reservation: reservation,
        })
    }

    /// The row format of the keys, unless they are none or one text or
    /// binary column (see [`Keys`]).
    fn converter(&self) -> DfResult<Option<RowConverter>> {
        let schema = self.input.schema();
        let types = self
            .partition_by
            .iter()
            .map(|e| e.data_type(&schema))
            .collect::<DfResult<Vec<_>>>()?;
        if types.is_empty() || matches!(types.as_slice(), [t] if bytes(t)) {
            return Ok(None);
        }
        Ok(Some(RowConverter::new(
            types.into_iter().map(SortField::new).collect(),
        )?))
    }

    /// A batch's keys and their hashes, and each function's value.
    fn prepare(
        &self,
        batch: &RecordBatch,
        converter: Option<&RowConverter>,
        hasher: &KeyHasher,
    ) -> DfResult<(Prepared, Vec<Option<ArrayRef>>)> {
        let n = batch.num_rows();
        let columns = self
            .partition_by
            .iter()
            .map(|e| e.evaluate(batch)?.into_array(n))
            .collect::<DfResult<Vec<_>>>()?;
        let keys = match (converter, columns.as_slice()) {
            (Some(c), _) => Keys::Rows(c.convert_columns(&columns)?),
            (None, []) => Keys::None,
            (None, [c]) => Keys::Bytes(cast(c, &DataType::BinaryView)?.as_binary_view().clone()),
            (None, _) => {
                return Err(DataFusionError::Internal(
                    "several keys without a row format".into(),
                ));
            }
        };
        let hashes = (0..n)
            .map(|r| {
                keys.get(r)
                    .map_or(NULL_HASH, |k| std::hash::BuildHasher::hash_one(hasher, k))
            })
            .collect();
        let values = self
            .functions
            .iter()
            .map(|(_, v)| {
                v.as_ref()
                    .map(|v| v.evaluate(batch)?.into_array(n))
                    .transpose()
            })
            .collect::<DfResult<Vec<_>>>()?;
        Ok((Prepared { keys, hashes }, values))
    }

    /// The `j`-th batch walked, with its functions.
    fn output(&self, walked: &Walked, j: usize) -> DfResult<RecordBatch> {
        let batch = &walked.batches[j];
        let n = batch.num_rows();
        let mut columns = batch.columns().to_vec();
        let out_fields = &self.schema.fields()[self.schema.fields().len() - self.functions.len()..];
        for (f, ((shift, _), field)) in self.functions.iter().zip(out_fields).enumerate() {
            let column: ArrayRef = match shift {
                Shift::RowNumber => Arc::new(UInt64Array::from_iter_values(
                    walked.numbers[j].iter().map(|n| n.load(Ordering::Relaxed)),
                )),
                Shift::Row { offset: 0, .. } => Arc::clone(&walked.values[f][j]),
                Shift::Row { offset, default } => {
                    let values = &walked.values[f];
                    let default = match default.is_null() {
                        true => new_null_array(values[j].data_type(), 1),
                        false => default.to_array_of_size(1)?,
                    };
                    let links = if *offset < 0 {
                        &walked.before
                    } else {
                        &walked.after
                    };
                    let steps = offset.unsigned_abs();
                    let at: Vec<(usize, usize)> = (0..n)
                        .map(|r| {
                            let mut at = row_at(j, r);
                            for _ in 0..steps {
                                let (b, i) = split(at);
                                at = links[b][i].load(Ordering::Relaxed);
                                if at == NONE {
                                    return (values.len(), 0);
                                }
                            }
                            split(at)
                        })
                        .collect();
                    let mut sources: Vec<&dyn Array> = values.iter().map(|v| v.as_ref()).collect();
                    sources.push(default.as_ref());
                    interleave(&sources, &at)?
                }
            };
            columns.push(if column.data_type() == field.data_type() {
                column
            } else {
                cast(&column, field.data_type())?
            });
        }
        Ok(RecordBatch::try_new_with_options(
            Arc::clone(&self.schema),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(n)),
        )?)
    }
}
