//! Decoded columns kept in memory between statements, so a statement read
//! again (at the prompt, or later in one script) costs its work on the
//! rows, not the Parquet decoding.
//!
//! A repeated statement over the compacted latest view spent most of its
//! time decoding the same pages again (the count and sum of 357,600 rows:
//! 2-3 ms of a 3 ms statement; see docs/performance.md#query). A
//! [`KeptTable`] wraps the view's Parquet table:
//!
//! - the first time a set of columns is read, the scan is Parquet's own,
//!   with its pruning (a point query decodes a page, not the table);
//! - the second time, those columns (with any kept before) are decoded
//!   whole, once, and kept if they fit the [`Budget`]; the statement then
//!   reads them from memory, as does every later one that needs no other
//!   column. Filters stay above the scan, so answers are the same.
//!
//! The kept columns belong to the table, which belongs to one snapshot of
//! the archive: when a compaction or a new change makes a new snapshot,
//! its tables are built anew and the old ones, with what they kept, are
//! dropped. Memory: at most the budget in all, shared by every table of
//! the query; columns that do not fit are read from Parquet each time.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, SchemaRef};
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::error::Result as DfResult;
use datafusion::logical_expr::TableProviderFilterPushDown;
use datafusion::physical_plan::{ExecutionPlan, collect};
use datafusion::prelude::Expr;

/// The memory every kept column of a query may take, in bytes.
#[derive(Debug)]
pub(crate) struct Budget {
    limit: usize,
    used: AtomicUsize,
}

impl Budget {
    pub(crate) fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Takes `bytes` if they fit beside what is taken.
    fn take(&self, bytes: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&n| n <= self.limit)
            })
            .is_ok()
    }

    fn give(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }

    #[cfg(test)]
    fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

/// What a table keeps: the column sets read once, and the columns decoded
/// whole with their rows.
#[derive(Default)]
struct Kept {
    seen: HashSet<Vec<usize>>,
    /// The table's column indexes held, ascending; `batches` hold them in
    /// that order.
    columns: Vec<usize>,
    batches: Vec<RecordBatch>,
    bytes: usize,
    /// Column sets asked for that did not fit (with those kept): not
    /// decoded whole again.
    too_large: HashSet<Vec<usize>>,
}

/// A table whose columns read twice are kept in memory (see the module doc).
pub(crate) struct KeptTable {
    inner: Arc<dyn TableProvider>,
    /// The table's rows as its files say, to tell columns that cannot fit
    /// before decoding them.
    rows: usize,
    budget: Arc<Budget>,
    kept: Mutex<Kept>,
}

impl fmt::Debug for KeptTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kept = self.kept.lock().expect("not poisoned");
        f.debug_struct("KeptTable")
            .field("columns", &kept.columns)
            .field("bytes", &kept.bytes)
            .finish_non_exhaustive()
    }
}

impl KeptTable {
    pub(crate) fn new(
        inner: Arc<dyn TableProvider>,
        rows: usize,
        budget: Arc<Budget>,
    ) -> KeptTable {
        KeptTable {
            inner,
            rows,
            budget,
            kept: Mutex::new(Kept::default()),
        }
    }

    /// The least memory `columns` take decoded: their fixed widths (a text
    /// value's view alone) and a validity bit per row.
    fn least_bytes(&self, columns: &[usize]) -> usize {
        let schema = self.inner.schema();
        let per_row: usize = columns
            .iter()
            .map(|&c| match schema.field(c).data_type() {
                DataType::Utf8View | DataType::BinaryView => 16,
                DataType::Utf8 | DataType::Binary => 4,
                DataType::LargeUtf8 | DataType::LargeBinary => 8,
                t => t.primitive_width().unwrap_or(0),
            })
            .sum();
        self.rows
            .saturating_mul(per_row + columns.len().div_ceil(8))
    }

    /// A scan of the kept rows in `projection` (indexes of the table), if
    /// every one is held.
    fn memory_scan(
        &self,
        kept: &Kept,
        projection: &[usize],
        partitions: usize,
    ) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
        let Some(places) = projection
            .iter()
            .map(|c| kept.columns.binary_search(c).ok())
            .collect::<Option<Vec<usize>>>()
        else {
            return Ok(None);
        };
        if kept.columns.is_empty() {
            return Ok(None);
        }
        let schema = Arc::new(self.inner.schema().project(&kept.columns)?);
        // Spread over the session's partitions, so the work above the scan
        // runs on every core.
        let mut parts = vec![Vec::new(); partitions.clamp(1, kept.batches.len().max(1))];
        let n = parts.len();
        for (i, batch) in kept.batches.iter().enumerate() {
            parts[i % n].push(batch.clone());
        }
        let exec = MemorySourceConfig::try_new_exec(&parts, schema, Some(places))?;
        Ok(Some(exec))
    }
}

impl Drop for KeptTable {
    fn drop(&mut self) {
        let kept = self.kept.get_mut().expect("not poisoned");
        self.budget.give(kept.bytes);
    }
}

#[async_trait]
impl TableProvider for KeptTable {
    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }

    fn table_type(&self) -> TableType {
        self.inner.table_type()
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> DfResult<Vec<TableProviderFilterPushDown>> {
        // Kept rows are not filtered by the scan: every filter stays above it.
        Ok(self
            .inner
            .supports_filters_pushdown(filters)?
            .into_iter()
            .map(|p| match p {
                TableProviderFilterPushDown::Exact => TableProviderFilterPushDown::Inexact,
                other => other,
            })
            .collect())
    }

    fn statistics(&self) -> Option<datafusion::common::Statistics> {
        self.inner.statistics()
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let all: Vec<usize> = (0..self.schema().fields().len()).collect();
        let projection = projection.unwrap_or(&all);
        let partitions = state.config().target_partitions();
        let mut requested = projection.clone();
        requested.sort_unstable();
        requested.dedup();
        let whole: Option<Vec<usize>> = {
            let mut kept = self.kept.lock().expect("not poisoned");
            if let Some(exec) = self.memory_scan(&kept, projection, partitions)? {
                return Ok(exec);
            }
            // Read once, or known not to fit: Parquet's own scan, with its
            // pruning.
            if requested.is_empty()
                || kept.too_large.contains(&requested)
                || kept.seen.insert(requested.clone())
            {
                None
            } else {
                let mut set = requested.clone();
                set.extend(kept.columns.iter().copied());
                set.sort_unstable();
                set.dedup();
                // Columns that cannot fit are not decoded whole to find out.
                if self.least_bytes(&set) > self.budget.limit {
                    kept.too_large.insert(requested.clone());
                    None
                } else {
                    Some(set)
                }
            }
        };
        let Some(wanted) = whole else {
            return self
                .inner
                .scan(state, Some(projection), filters, limit)
                .await;
        };
        let whole = self.inner.scan(state, Some(&wanted), &[], None).await?;
        let batches = collect(whole, state.task_ctx()).await?;
        let bytes: usize = batches.iter().map(|b| b.get_array_memory_size()).sum();
        let mut kept = self.kept.lock().expect("not poisoned");
        // The new columns replace the ones kept (they hold them too).
        if !self.budget.take(bytes.saturating_sub(kept.bytes)) {
            // This statement reads what it decoded; the columns kept stay,
            // and these are not decoded whole again.
            kept.too_large.insert(requested);
            drop(kept);
            let fresh = Kept {
                columns: wanted,
                batches,
                ..Kept::default()
            };
            return Ok(self
                .memory_scan(&fresh, projection, partitions)?
                .expect("the columns just decoded"));
        }
        self.budget.give(kept.bytes.saturating_sub(bytes));
        kept.columns = wanted;
        kept.batches = batches;
        kept.bytes = bytes;
        Ok(self
            .memory_scan(&kept, projection, partitions)?
            .expect("the columns just kept"))
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::file_format::parquet::ParquetFormat;
    use datafusion::datasource::listing::{
        ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
    };
    use datafusion::prelude::SessionContext;
    use parquet::arrow::ArrowWriter;

    use super::*;

    /// A Parquet table of 1,000 rows `(id, account, status)` in 10 row
    /// groups, in a folder that lives as long as the returned guard.
    fn parquet_table() -> (Arc<dyn TableProvider>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("account", DataType::Int64, true),
            Field::new("status", DataType::Utf8, true),
        ]));
        let file = std::fs::File::create(dir.path().join("t.parquet")).unwrap();
        let props = parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(100))
            .build();
        let mut writer = ArrowWriter::try_new(file, Arc::clone(&schema), Some(props)).unwrap();
        for start in (0..1000).step_by(100) {
            let ids: Vec<i64> = (start..start + 100).collect();
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(Int64Array::from(ids.clone())),
                    Arc::new(Int64Array::from_iter(
                        ids.iter().map(|i| (i % 7 != 0).then_some(i % 50)),
                    )),
                    Arc::new(StringArray::from_iter_values(
                        ids.iter().map(|i| format!("s{}", i % 3)),
                    )),
                ],
            )
            .unwrap();
            writer.write(&batch).unwrap();
        }
        writer.close().unwrap();
        let url = ListingTableUrl::parse(format!("{}/", dir.path().display())).unwrap();
        let config = ListingTableConfig::new(url)
            .with_listing_options(ListingOptions::new(Arc::new(ParquetFormat::default())))
            .with_schema(schema);
        (Arc::new(ListingTable::try_new(config).unwrap()), dir)
    }

    async fn answer(ctx: &SessionContext, sql: &str) -> String {
        let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string()
    }

    /// Whether the statement's plan reads Parquet (else the kept rows).
    async fn reads_parquet(ctx: &SessionContext, sql: &str) -> bool {
        answer(ctx, &format!("EXPLAIN {sql}"))
            .await
            .contains("file_type=parquet")
    }

    const GROUP: &str = "SELECT status, count(*) AS n, sum(account) AS s FROM t \
                         WHERE account < 20 GROUP BY status ORDER BY status";
    const POINT: &str = "SELECT id, account FROM t WHERE id = 707";
    const ALL: &str = "SELECT * FROM t WHERE status = 's2' ORDER BY id DESC LIMIT 3";

    #[tokio::test]
    async fn columns_read_twice_are_kept_and_answer_as_parquet_does() {
        let (inner, _dir) = parquet_table();
        let reference = SessionContext::new();
        reference.register_table("t", Arc::clone(&inner)).unwrap();
        let budget = Budget::new(1 << 30);
        let kept = Arc::new(KeptTable::new(
            Arc::clone(&inner),
            1000,
            Arc::clone(&budget),
        ));
        let ctx = SessionContext::new();
        ctx.register_table("t", Arc::clone(&kept) as Arc<dyn TableProvider>)
            .unwrap();

        let want = answer(&reference, GROUP).await;
        // Read once: Parquet, nothing kept.
        assert_eq!(answer(&ctx, GROUP).await, want);
        assert_eq!(budget.used(), 0);
        // Read again: decoded whole, kept.
        assert_eq!(answer(&ctx, GROUP).await, want);
        assert!(budget.used() > 0);
        assert!(!reads_parquet(&ctx, GROUP).await);
        assert_eq!(answer(&ctx, GROUP).await, want);
        // Fewer columns come from memory too, filters applied above.
        assert!(!reads_parquet(&ctx, "SELECT sum(account) FROM t WHERE status = 's1'").await);
        for sql in [
            "SELECT count(*), sum(account) FROM t",
            "SELECT count(*) FROM t WHERE status = 's1'",
        ] {
            assert_eq!(
                answer(&ctx, sql).await,
                answer(&reference, sql).await,
                "{sql}"
            );
        }
        // A column not kept: Parquet, then kept beside the others.
        let used = budget.used();
        for _ in 0..2 {
            assert_eq!(answer(&ctx, POINT).await, answer(&reference, POINT).await);
        }
        assert!(budget.used() > used);
        assert!(!reads_parquet(&ctx, POINT).await);
        assert!(!reads_parquet(&ctx, GROUP).await);
        assert_eq!(answer(&ctx, POINT).await, answer(&reference, POINT).await);
        assert_eq!(answer(&ctx, GROUP).await, want);
        // The table gone, its memory is given back.
        ctx.deregister_table("t").unwrap();
        drop(kept);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn columns_over_the_budget_are_read_from_parquet_each_time() {
        let (inner, _dir) = parquet_table();
        let reference = SessionContext::new();
        reference.register_table("t", Arc::clone(&inner)).unwrap();
        let want = answer(&reference, ALL).await;
        // Rows unknown (0): the second read decodes them whole and finds
        // they do not fit; that statement reads them, nothing is kept.
        let budget = Budget::new(1_000);
        let ctx = SessionContext::new();
        let table = KeptTable::new(Arc::clone(&inner), 0, Arc::clone(&budget));
        ctx.register_table("t", Arc::new(table)).unwrap();
        assert_eq!(answer(&ctx, ALL).await, want);
        assert!(!reads_parquet(&ctx, ALL).await);
        assert_eq!(budget.used(), 0);
        for _ in 0..2 {
            assert!(reads_parquet(&ctx, ALL).await);
            assert_eq!(answer(&ctx, ALL).await, want);
            assert_eq!(budget.used(), 0);
        }
        // Another set of columns is tried on its own.
        for parquet in [true, false, true, true] {
            assert_eq!(reads_parquet(&ctx, GROUP).await, parquet);
        }
        assert_eq!(answer(&ctx, GROUP).await, answer(&reference, GROUP).await);
        assert_eq!(budget.used(), 0);
        // Rows known (as if the files said 10,000): two integers and a
        // text's offsets are more than 100,000 bytes, so they are never
        // decoded whole.
        let budget = Budget::new(100_000);
        let ctx = SessionContext::new();
        let table = KeptTable::new(inner, 10_000, Arc::clone(&budget));
        ctx.register_table("t", Arc::new(table)).unwrap();
        assert_eq!(answer(&ctx, ALL).await, want);
        assert!(reads_parquet(&ctx, ALL).await);
        assert_eq!(answer(&ctx, ALL).await, want);
        assert_eq!(budget.used(), 0);
        // One integer column fits (80,000 bytes and the validity bits).
        for _ in 0..2 {
            assert_eq!(
                answer(&ctx, "SELECT sum(id) FROM t").await,
                answer(&reference, "SELECT sum(id) FROM t").await
            );
        }
        assert!(budget.used() > 0);
    }

    #[test]
    fn a_budget_never_gives_out_more_than_its_limit() {
        let budget = Budget::new(100);
        assert!(budget.take(60));
        assert!(!budget.take(41));
        assert!(budget.take(40));
        budget.give(60);
        assert!(budget.take(60));
        assert!(!budget.take(1));
        assert_eq!(budget.used(), 100);
    }
}
