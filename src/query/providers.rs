//! The tables a query names, built from one [`Archive`] snapshot:
//!
//! - `<schema>.<table>`: the latest row per key. The compacted latest view
//!   (the files its Delta snapshot lists) with the changes not compacted yet
//!   applied over it ([`Overlay`]): the compacted rows of the keys those
//!   changes touch are filtered out and the overlay's rows added. Memory:
//!   the keys the uncompacted changes touch. With `--at` before the
//!   compacted view, the view is rebuilt from the history up to that seq
//!   instead, for the columns a statement reads ([`AtView`]).
//! - `history.<schema>.<table>`: every version, the compacted Parquet
//!   history (Hive-partitioned by `date`, which DataFusion prunes on) below
//!   the next seq its Delta log records, and the NDJSON tail from it, typed alike.
//! - `waltail.changes`: the envelopes of every NDJSON object.
//!
//! Tables are built when a statement first names them (the schema providers
//! are lazy), so a query reads only the parts of the archive it uses.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use arrow::array::{Array, BooleanArray, RecordBatch, StringViewArray};
use arrow::datatypes::{DataType, Schema};
use async_trait::async_trait;
use datafusion::catalog::{
    CatalogProvider, MemoryCatalogProvider, MemorySchemaProvider, SchemaProvider,
};
use datafusion::catalog::{MemTable, TableProvider};
use datafusion::common::DataFusionError;
use datafusion::datasource::ViewTable;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::datasource::provider_as_source;
use datafusion::error::Result as DfResult;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::{
    ColumnarValue, LogicalPlanBuilder, ScalarUDF, Volatility, create_udf,
};
use datafusion::prelude::{Expr, SessionContext, ident, lit};
use futures::{StreamExt, TryStreamExt};

use super::at::AtView;
use super::catalog::Archive;
use super::footers::{self, FOOTER_READ};
use super::kept::{Budget, KeptTable};
use super::merge::{Overlay, overlay_schema};
use super::pushdown::ParquetScan;
use super::tail::{Bounds, TailKind, TailTable, history_table_schema, typed_changes};
use super::views::{data_schema, with_views};
use crate::archive::listing;
use crate::lakehouse::compacted::{UNREADABLE_FIX, history_first_seq, history_seqs};
use crate::lakehouse::layout::history_schema;
use crate::lakehouse::layout::latest_schema;
use crate::lakehouse::session::table_url;
use crate::lakehouse::stored::text_column;
use crate::lakehouse::typing::array::read_cells;
use crate::lakehouse::typing::{Cell, TableShape};
use crate::{Error, Result};

/// Rows per batch of the tables built in memory.
const BATCH_ROWS: usize = 8192;

/// NDJSON objects fetched at once while merging the tail.
const FETCH_AHEAD: usize = 8;

/// Registers the archive's tables in `ctx`; with `read_ahead`, a table's
/// footers are read while the statement that names it is planned (see
/// [`footers`]).
pub(crate) fn register(
    ctx: &SessionContext,
    archive: Arc<Archive>,
    budget: &Arc<Budget>,
    read_ahead: bool,
) -> DfResult<()> {
    let mut by_schema: BTreeMap<String, Vec<Arc<TableShape>>> = BTreeMap::new();
    for shape in archive.shapes.values() {
        let (schema, _) = shape.schema_and_name();
        by_schema
            .entry(schema.to_string())
            .or_default()
            .push(Arc::clone(shape));
    }
    let default = ctx
        .catalog("datafusion")
        .ok_or_else(|| DataFusionError::Internal("no default catalog".into()))?;
    let history = Arc::new(MemoryCatalogProvider::new());
    let runtime = read_ahead.then(|| ctx.runtime_env());
    for (schema, shapes) in &by_schema {
        default.register_schema(
            schema,
            Arc::new(ArchiveSchema::new(
                Arc::clone(&archive),
                shapes,
                View::Latest,
                budget,
                runtime.as_ref(),
            )),
        )?;
        history.register_schema(
            schema,
            Arc::new(ArchiveSchema::new(
                Arc::clone(&archive),
                shapes,
                View::History,
                budget,
                runtime.as_ref(),
            )),
        )?;
    }
    ctx.register_catalog("history", history);
    let waltail = Arc::new(MemorySchemaProvider::new());
    waltail.register_table(
        "changes".into(),
        Arc::new(TailTable::every_change(Arc::clone(&archive))),
    )?;
    default.register_schema("waltail", waltail)?;
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum View {
    Latest,
    History,
}

/// The tables of one Postgres schema, built when first named.
#[derive(Debug)]
struct ArchiveSchema {
    archive: Arc<Archive>,
    view: View,
    /// By the table's name within the schema.
    shapes: BTreeMap<String, Arc<TableShape>>,
    built: Mutex<HashMap<String, Arc<dyn TableProvider>>>,
    /// For the decoded columns the latest views keep (see [`KeptTable`]).
    budget: Arc<Budget>,
    /// The session's, whose cache of file metadata [`footers::warm`]
    /// fills; `None`: no footers are read ahead.
    runtime: Option<Arc<RuntimeEnv>>,
}

impl ArchiveSchema {
    fn new(
        archive: Arc<Archive>,
        shapes: &[Arc<TableShape>],
        view: View,
        budget: &Arc<Budget>,
        runtime: Option<&Arc<RuntimeEnv>>,
    ) -> ArchiveSchema {
        ArchiveSchema {
            archive,
            view,
            shapes: shapes
                .iter()
                // A table without a key has a history but no latest view.
                .filter(|s| view == View::History || !s.key.is_empty())
                .map(|s| (s.schema_and_name().1.to_string(), Arc::clone(s)))
                .collect(),
            built: Mutex::new(HashMap::new()),
            budget: Arc::clone(budget),
            runtime: runtime.cloned(),
        }
    }
}

#[async_trait]
impl SchemaProvider for ArchiveSchema {
    fn table_names(&self) -> Vec<String> {
        self.shapes.keys().cloned().collect()
    }

    async fn table(&self, name: &str) -> DfResult<Option<Arc<dyn TableProvider>>> {
        let Some(shape) = self.shapes.get(name) else {
            return Ok(None);
        };
        if let Some(t) = self.built.lock().expect("not poisoned").get(name) {
            return Ok(Some(Arc::clone(t)));
        }
        // The footers of the compacted files the table scans, read while
        // the statement is planned (see [`footers`]).
        let scanned = match self.view {
            View::Latest if self.archive.rebuilds_latest(&shape.table).is_none() => {
                self.archive.latest_files(&shape.table)
            }
            View::Latest => &[],
            View::History => self.archive.history_files(&shape.table),
        };
        if let Some(runtime) = &self.runtime {
            footers::warm(runtime, scanned);
        }
        let table = match self.view {
            View::Latest => latest_table(&self.archive, shape, &self.budget).await,
            View::History => history_table(&self.archive, shape),
        }
        .map_err(|e| DataFusionError::External(Box::new(e)))?;
        self.built
            .lock()
            .expect("not poisoned")
            .insert(name.to_string(), Arc::clone(&table));
        Ok(Some(table))
    }

    fn table_exist(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }
}

fn df(e: DataFusionError) -> Error {
    Error::fatal(
        format!("cannot read the compacted files: {e}"),
        UNREADABLE_FIX,
    )
}

/// A session for the reads that build a table (not the user's session).
fn internal_session(archive: &Archive) -> SessionContext {
    crate::lakehouse::session::session(Arc::clone(&archive.store))
}

/// `plan`'s columns as `schema` has them, by name, cast where the types
/// differ: the NDJSON tail and the merged overlay are built as `Utf8`, and
/// a union's inputs must agree with the compacted files' views.
fn cast_to(plan: LogicalPlanBuilder, schema: &Schema) -> DfResult<LogicalPlanBuilder> {
    let columns: Vec<Expr> = schema
        .fields()
        .iter()
        .map(|f| datafusion::prelude::cast(ident(f.name()), f.data_type().clone()).alias(f.name()))
        .collect();
    plan.project(columns)
}

/// A Parquet table over explicit files or a folder, read as `schema` (its
/// text as views: see [`with_views`]).
fn parquet_table(
    urls: Vec<String>,
    schema: &Schema,
    partition_by_date: bool,
) -> DfResult<Arc<ParquetScan>> {
    let schema = with_views(schema);
    let mut options = ListingOptions::new(Arc::new(
        ParquetFormat::default().with_metadata_size_hint(Some(FOOTER_READ)),
    ))
    .with_file_extension(".parquet");
    if partition_by_date {
        options = options.with_table_partition_cols(vec![("date".into(), DataType::Date32)]);
    }
    let urls = urls
        .iter()
        .map(ListingTableUrl::parse)
        .collect::<DfResult<Vec<_>>>()?;
    let config = ListingTableConfig::new_with_multi_paths(urls)
        .with_listing_options(options)
        .with_schema(schema);
    Ok(Arc::new(ParquetScan::new(Arc::new(ListingTable::try_new(
        config,
    )?))))
}

/// The compacted history below `next`: the snapshot's files, each date's
/// as one scan with the date as a column (the files do not hold it: Delta
/// keeps partition values in the log), unioned; `None` without files. Only
/// the files the snapshot names: a folder also holds the log's
/// checkpoints, replaced files until vacuum, and files of runs that did
/// not commit. A file whose name says it ends below `next` (nearly all)
/// is read without the filter on `_seq`, so a query that does not name
/// `_seq` does not decode it.
fn compacted_history(
    files: &[String],
    shape: &TableShape,
    next: u64,
) -> DfResult<Option<LogicalPlanBuilder>> {
    // By date, then whether a row can be at or past `next`.
    let mut groups: BTreeMap<(&str, bool), Vec<String>> = BTreeMap::new();
    for key in files {
        let date = key
            .split('/')
            .find_map(|p| p.strip_prefix("date="))
            .unwrap_or_default();
        let below = history_seqs(key).is_some_and(|(_, last)| last < next);
        groups
            .entry((date, !below))
            .or_default()
            .push(table_url(key));
    }
    let schema = history_schema(shape);
    let mut plan: Option<LogicalPlanBuilder> = None;
    for ((date, past_next), urls) in groups {
        let mut scan = LogicalPlanBuilder::scan(
            "compacted",
            provider_as_source(parquet_table(urls, &schema, false)?),
            None,
        )?;
        if past_next {
            // The seqs from `next` on are read from the NDJSON.
            scan = scan.filter(ident("_seq").lt(lit(next as i64)))?;
        }
        let mut columns: Vec<Expr> = schema.fields().iter().map(|f| ident(f.name())).collect();
        columns.push(datafusion::prelude::cast(lit(date), DataType::Date32).alias("date"));
        let scan = scan.project(columns)?;
        plan = Some(match plan {
            None => scan,
            Some(p) => p.union(scan.build()?)?,
        });
    }
    Ok(plan)
}

/// `history.<schema>.<table>`: the compacted history below `next_seq` and
/// the NDJSON from it, up to `--at`.
fn history_table(
    archive: &Arc<Archive>,
    shape: &Arc<TableShape>,
) -> Result<Arc<dyn TableProvider>> {
    let next = archive.next_seq(&shape.table);
    let tail = TailTable::new(
        Arc::clone(&archive.store),
        Arc::new(archive.objects.clone()),
        TailKind::History(Arc::clone(shape)),
        next,
        archive.max_seq,
    );
    let build = || -> DfResult<Arc<dyn TableProvider>> {
        let tail = LogicalPlanBuilder::scan("tail", provider_as_source(Arc::new(tail)), None)?;
        let tail = cast_to(tail, &with_views(&history_table_schema(shape)))?;
        // The files of the history's snapshot hold the seqs below `next`
        // (see `compacted::Compacted::entry`); the NDJSON the rest.
        let mut plan = match compacted_history(archive.history_files(&shape.table), shape, next)? {
            Some(compacted) => compacted.union(tail.build()?)?,
            None => tail,
        };
        if let Some(n) = archive.max_seq {
            plan = plan.filter(ident("_seq").lt_eq(lit(n.min(i64::MAX as u64) as i64)))?;
        }
        Ok(Arc::new(ViewTable::new(plan.build()?, None)))
    };
    build().map_err(df)
}

/// A filter function over `_key`: true for keys in (or, `negated`, not in) `keys`.
fn key_filter(name: &str, keys: HashSet<Box<str>>, negated: bool) -> ScalarUDF {
    let keys = Arc::new(keys);
    create_udf(
        name,
        vec![DataType::Utf8View],
        DataType::Boolean,
        Volatility::Immutable,
        Arc::new(move |args: &[ColumnarValue]| {
            let arrays = ColumnarValue::values_to_arrays(args)?;
            let text = arrow::compute::cast(&arrays[0], &DataType::Utf8View)?;
            let text = text
                .as_any()
                .downcast_ref::<StringViewArray>()
                .expect("cast to Utf8View");
            let out: BooleanArray = text
                .iter()
                .map(|k| Some(k.is_some_and(|k| keys.contains(k)) != negated))
                .collect();
            Ok(ColumnarValue::Array(Arc::new(out)))
        }),
    )
}

/// `<schema>.<table>`: see the module doc.
async fn latest_table(
    archive: &Arc<Archive>,
    shape: &Arc<TableShape>,
    budget: &Arc<Budget>,
) -> Result<Arc<dyn TableProvider>> {
    let ctx = internal_session(archive);
    let next = archive.next_seq(&shape.table);
    let files = archive.latest_files(&shape.table);
    let data: Vec<Expr> = shape.columns.iter().map(|c| ident(&c.name)).collect();
    // The compacted view is newer than --at: rebuild from the history.
    if let Some(n) = archive.rebuilds_latest(&shape.table) {
        let mut files: Vec<(u64, String)> = archive
            .history_files(&shape.table)
            .iter()
            .filter_map(|key| {
                let first = history_first_seq(key)?;
                (first <= n && first < next).then(|| (first, key.clone()))
            })
            .collect();
        files.sort();
        let files = files.into_iter().map(|(_, key)| key).collect();
        let expected_keys = archive
            .compacted
            .get(&shape.table)
            .map_or(0, |e| e.latest_rows as usize);
        return Ok(Arc::new(AtView::new(
            Arc::clone(&archive.store),
            Arc::clone(shape),
            files,
            n,
            expected_keys,
        )));
    }
    let base = if files.is_empty() {
        None
    } else {
        Some(
            parquet_table(
                files.iter().map(|f| table_url(f)).collect(),
                &latest_schema(shape),
                false,
            )
            .map_err(df)?,
        )
    };
    let mut overlay = Overlay::new(Arc::clone(shape), base.is_some());
    apply_tail(archive, shape, next, archive.max_seq, &mut overlay).await?;
    let wanted = overlay.wanted();
    if let (Some(base), false) = (&base, wanted.is_empty()) {
        let rows = base_rows(&ctx, base, shape, wanted).await?;
        overlay.fill(&rows);
    }
    match base {
        Some(base) if overlay.base_visible() => {
            let rows = archive
                .compacted
                .get(&shape.table)
                .map_or(0, |e| e.latest_rows as usize);
            let base = Arc::new(KeptTable::new(base, rows, Arc::clone(budget)));
            let build = || -> DfResult<Arc<dyn TableProvider>> {
                let mut plan = LogicalPlanBuilder::scan("latest", provider_as_source(base), None)?;
                if !overlay.is_empty() {
                    let untouched = key_filter("waltail_untouched", overlay.touched(), true);
                    plan = plan.filter(untouched.call(vec![ident("_key")]))?;
                }
                let mut plan = plan.project(data.clone())?;
                if !overlay.is_empty() {
                    let mem = MemTable::try_new(
                        overlay_schema(shape),
                        vec![overlay.batches(BATCH_ROWS)],
                    )?;
                    let tail =
                        LogicalPlanBuilder::scan("tail", provider_as_source(Arc::new(mem)), None)?;
                    plan = plan.union(cast_to(tail, &data_schema(shape))?.build()?)?;
                }
                Ok(Arc::new(ViewTable::new(plan.build()?, None)))
            };
            build().map_err(df)
        }
        _ => memory_table(shape, &overlay),
    }
}

/// The overlay's rows as a table of the data columns.
fn memory_table(shape: &TableShape, overlay: &Overlay) -> Result<Arc<dyn TableProvider>> {
    let build = || -> DfResult<Arc<dyn TableProvider>> {
        let mem = MemTable::try_new(overlay_schema(shape), vec![overlay.batches(BATCH_ROWS)])?;
        let plan = LogicalPlanBuilder::scan("tail", provider_as_source(Arc::new(mem)), None)?;
        let plan = cast_to(plan, &data_schema(shape))?.build()?;
        Ok(Arc::new(ViewTable::new(plan, None)))
    };
    build().map_err(df)
}

/// Applies the table's changes with seqs `from..=to` from the NDJSON.
async fn apply_tail(
    archive: &Archive,
    shape: &TableShape,
    from: u64,
    to: Option<u64>,
    overlay: &mut Overlay,
) -> Result<()> {
    let bounds = Bounds {
        min_seq: from,
        max_seq: to.unwrap_or(u64::MAX),
        ..Bounds::default()
    };
    let objects: Vec<_> = archive
        .objects
        .iter()
        .filter(|o| bounds.may_hold(o))
        .cloned()
        .collect();
    let store = Arc::clone(&archive.store);
    let shape = Arc::new(shape.clone());
    // Objects are fetched and parsed several at a time (parsing on the
    // blocking pool, so on every core) and applied in seq order.
    let mut parsed = futures::stream::iter(objects)
        .map(|o| {
            let (store, shape) = (Arc::clone(&store), Arc::clone(&shape));
            async move {
                let body = listing::get_ndjson(store.as_ref(), &o.key).await?;
                tokio::task::spawn_blocking(move || typed_changes(&shape, &o, &body, &bounds))
                    .await
                    .map_err(|e| Error::bug(format!("parsing an archive object stopped: {e}")))?
            }
        })
        .buffered(FETCH_AHEAD);
    while let Some(changes) = parsed.try_next().await? {
        for change in changes {
            overlay.apply(change);
        }
    }
    Ok(())
}

/// The base rows of `keys`, by key.
async fn base_rows(
    ctx: &SessionContext,
    base: &Arc<ParquetScan>,
    shape: &TableShape,
    keys: HashSet<Box<str>>,
) -> Result<HashMap<Box<str>, Vec<Cell>>> {
    let wanted = key_filter("waltail_wanted", keys, false);
    let batches = ctx
        .read_table(Arc::clone(base) as Arc<dyn TableProvider>)
        .and_then(|t| t.filter(wanted.call(vec![ident("_key")])))
        .map_err(df)?
        .collect()
        .await
        .map_err(df)?;
    let mut out = HashMap::new();
    for batch in &batches {
        let cells = columns_of(shape, batch)?;
        let keys = text_column(batch, "_key")?;
        for (i, cells) in cells.into_iter().enumerate() {
            out.insert(keys.value(i).into(), cells);
        }
    }
    Ok(out)
}

/// A batch's rows as cells of the shape's columns (a column the batch
/// lacks, added since, is null).
fn columns_of(shape: &TableShape, batch: &RecordBatch) -> Result<Vec<Vec<Cell>>> {
    let n = batch.num_rows();
    let mut columns = Vec::with_capacity(shape.columns.len());
    for c in &shape.columns {
        columns.push(match batch.column_by_name(&c.name) {
            Some(a) => read_cells(c.kind, a).map_err(|e| {
                Error::fatal(
                    format!("{}.{}: {e}", shape.table, c.name),
                    "run `waltail compact` again; if the column changed type, compact the table again (see `waltail compact`'s message)",
                )
            })?,
            None => vec![Cell::Null; n],
        });
    }
    let mut rows: Vec<Vec<Cell>> = (0..n).map(|_| Vec::with_capacity(columns.len())).collect();
    for column in columns {
        for (row, cell) in rows.iter_mut().zip(column) {
            row.push(cell);
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a file whose name says it reaches `next` is filtered on
    /// `_seq`; the others are read without decoding it.
    #[test]
    fn only_history_files_reaching_the_next_seq_are_filtered_on_it() {
        let shape = TableShape::test_t();
        let files = [
            "parquet/public/t/date=2026-12-01/1-10-a.parquet".to_string(),
            "parquet/public/t/date=2026-12-02/11-19-b.parquet".to_string(),
            "parquet/public/t/date=2026-12-02/20-30-c.parquet".to_string(),
        ];
        let plan = compacted_history(&files, &shape, 20)
            .unwrap()
            .unwrap()
            .build()
            .unwrap();
        let text = plan.display_indent().to_string();
        assert_eq!(text.matches("Filter: ").count(), 1, "{text}");
        assert_eq!(text.matches("_seq < Int64(20)").count(), 1, "{text}");
        assert_eq!(text.matches("TableScan: compacted").count(), 3, "{text}");
    }
}
