//! The latest view at a seq the compacted view has passed (`query --at`),
//! rebuilt from the compacted history by the latest view's rules (see
//! [`super::merge`]): in seq order, an upsert replaces its key's row and
//! takes the previous version's value for each column it left out, an
//! update that moves the key removes the old key's row, a delete removes
//! the row, a truncate every row.
//!
//! Built when a statement scans it, for the columns the statement reads,
//! in two passes over the history files up to the seq:
//!
//! 1. The change columns only (`_seq`, `_op`, `_key`, `_old`,
//!    `_unchanged`): which history row each live key's value of each
//!    column the statement reads comes from ([`Versions`]). A value an
//!    update left out comes from the row before it; for a `count(*)` this
//!    pass is all.
//! 2. Those rows alone, in the columns read ([`RowSelection`]), put
//!    together into the view's rows by `interleave`.
//!
//! Rows are never turned into cells, and a column no statement reads is
//! never decoded. Memory: an entry per key seen up to the seq (since its
//! last truncate), a few batches of change columns, and the view's rows in
//! the columns read.
//!
//! Here the view and its two passes; in [`files`] the reads of history
//! files (change columns by row group, chosen rows); in [`versions`] the
//! keys and where each live key's values come from.

mod files;
mod versions;

use std::collections::VecDeque;
use std::sync::Arc;

use arrow::array::{Array, RecordBatch, RecordBatchOptions, new_null_array};
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::ExecutionPlan;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStore;
use parquet::arrow::arrow_reader::ArrowReaderMetadata;

use self::files::{change_columns, chosen_rows};
use self::versions::{NULL_ROW, RowId, Versions, split};
use super::views::data_schema;
use crate::lakehouse::typing::TableShape;
use crate::{Error, Result};

/// Rows per batch of the view.
const BATCH_ROWS: usize = 8192;

/// History files whose change columns are read at once: the one applied
/// and the next.
const READ_AHEAD: usize = 2;

/// Batches of change columns a file's reader holds ready.
const BATCHES_AHEAD: usize = 4;

/// History files whose chosen rows are read at once.
const ROWS_AT_ONCE: usize = 4;

/// `<schema>.<table>` at a seq before its compacted view: see the module
/// doc.
#[derive(Debug)]
pub(super) struct AtView {
    store: Arc<dyn ObjectStore>,
    shape: Arc<TableShape>,
    /// The history files holding changes up to `at`, keys in the store, in
    /// seq order.
    files: Vec<String>,
    at: u64,
    /// About how many keys there are (the compacted view's rows): room
    /// made at once rather than by growing the map again and again.
    expected_keys: usize,
    /// The data columns.
    schema: SchemaRef,
    /// The rows last built and the columns they hold: a statement reading
    /// those columns or some of them (at the prompt, where the snapshot's
    /// tables are kept while the archive is unchanged, or a self-join)
    /// takes them instead of rebuilding. One set at a time, so memory holds
    /// at most the view's rows in the columns one statement read.
    built: std::sync::Mutex<Option<(Vec<usize>, Vec<RecordBatch>)>>,
}

impl AtView {
    /// The view of `shape`'s table at seq `at` from its history `files`
    /// (keys in the store, by first seq, each holding changes up to `at`).
    pub(super) fn new(
        store: Arc<dyn ObjectStore>,
        shape: Arc<TableShape>,
        files: Vec<String>,
        at: u64,
        expected_keys: usize,
    ) -> AtView {
        let schema = data_schema(&shape);
        AtView {
            store,
            shape,
            files,
            at,
            expected_keys,
            schema,
            built: std::sync::Mutex::new(None),
        }
    }

    /// The rows in `columns`, from the last ones built if they hold those
    /// columns.
    async fn rows_kept(&self, columns: &[usize]) -> Result<Vec<RecordBatch>> {
        if let Some((held, batches)) = self.built.lock().expect("not poisoned").as_ref()
            && let Some(places) = columns
                .iter()
                .map(|c| held.iter().position(|h| h == c))
                .collect::<Option<Vec<usize>>>()
        {
            return batches
                .iter()
                .map(|b| b.project(&places))
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| Error::bug(format!("projecting {}: {e}", self.shape.table)));
        }
        let batches = self.rows(columns).await?;
        *self.built.lock().expect("not poisoned") = Some((columns.to_vec(), batches.clone()));
        Ok(batches)
    }

    /// The view's rows in the data columns `columns` (indexes in the
    /// shape), as batches.
    async fn rows(&self, columns: &[usize]) -> Result<Vec<RecordBatch>> {
        let started = std::time::Instant::now();
        let (versions, metas) = self.versions(columns).await?;
        let replayed = started.elapsed();
        let schema = Arc::new(self.schema.project(columns).expect("columns of the shape"));
        let (batches, n) = if columns.is_empty() {
            // A count: the live keys, no values.
            let n = versions.live_count();
            let empty = |rows| {
                RecordBatch::try_new_with_options(
                    Arc::clone(&schema),
                    vec![],
                    &RecordBatchOptions::new().with_row_count(Some(rows)),
                )
                .expect("no columns")
            };
            let batches = (0..n)
                .step_by(BATCH_ROWS)
                .map(|start| empty(BATCH_ROWS.min(n - start)))
                .collect();
            (batches, n)
        } else {
            let live = versions.live();
            let batches = self
                .values(&schema, &versions, &metas, &live)
                .await?
                .iter()
                .flat_map(|b| {
                    (0..b.num_rows())
                        .step_by(BATCH_ROWS)
                        .map(|start| b.slice(start, BATCH_ROWS.min(b.num_rows() - start)))
                })
                .collect();
            (batches, live.len())
        };
        tracing::debug!(
            table = %self.shape.table,
            at = self.at,
            files = self.files.len(),
            rows = n,
            columns = columns.len(),
            replay_ms = replayed.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            "rebuilt the latest view at a seq from the history"
        );
        Ok(batches)
    }

    /// Pass 1: the changes up to `at`, file after file, row group after
    /// row group, the next files' change columns read (on other tasks)
    /// while one is applied. Also each file's metadata, for pass 2.
    async fn versions(&self, columns: &[usize]) -> Result<(Versions, Vec<ArrowReaderMetadata>)> {
        let mut versions = Versions::new(Arc::clone(&self.shape), columns, self.expected_keys);
        let mut reading = VecDeque::new();
        let mut metas = Vec::with_capacity(self.files.len());
        let mut files = self.files.iter().enumerate();
        loop {
            while reading.len() < READ_AHEAD {
                let Some((i, key)) = files.next() else { break };
                let (tx, rx) = tokio::sync::mpsc::channel(BATCHES_AHEAD);
                let task = tokio::spawn(change_columns(
                    Arc::clone(&self.store),
                    key.clone(),
                    self.at,
                    tx,
                ));
                reading.push_back((i, rx, task));
            }
            let Some((file, mut rx, task)) = reading.pop_front() else {
                break;
            };
            while let Some((first, batch)) = rx.recv().await {
                versions.apply(file, first, &batch, self.at)?;
            }
            // The channel closes when the task ends: with an error, or done.
            metas.push(
                task.await
                    .map_err(|e| Error::bug(format!("reading a history file stopped: {e}")))??,
            );
        }
        Ok((versions, metas))
    }

    /// Pass 2: the `live` versions (sorted) in the columns of `schema`,
    /// from the history rows their values come from.
    async fn values(
        &self,
        schema: &SchemaRef,
        versions: &Versions,
        metas: &[ArrowReaderMetadata],
        live: &[RowId],
    ) -> Result<Vec<RecordBatch>> {
        let columns = schema.fields().len();
        // Each column's source row per live key (`None`: the version's own
        // row for every column); then the rows each file gives.
        let sources: Option<Vec<Vec<RowId>>> = versions.any_carried().then(|| {
            (0..columns)
                .map(|c| live.iter().map(|&row| versions.source(row, c)).collect())
                .collect()
        });
        let mut wanted: Vec<Vec<u64>> = vec![Vec::new(); self.files.len()];
        let mut want = |row: RowId| {
            if row != NULL_ROW {
                let (file, position) = split(row);
                wanted[file].push(position);
            }
        };
        match &sources {
            Some(sources) => sources.iter().flatten().for_each(|&row| want(row)),
            None => live.iter().for_each(|&row| want(row)),
        }
        let wanted: Vec<Arc<[u64]>> = wanted
            .into_iter()
            .map(|mut positions| {
                positions.sort_unstable();
                positions.dedup();
                positions.into()
            })
            .collect();
        let reads: Vec<(usize, String, ArrowReaderMetadata, Arc<[u64]>)> = wanted
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.is_empty())
            .map(|(i, p)| (i, self.files[i].clone(), metas[i].clone(), Arc::clone(p)))
            .collect();
        let read: Vec<(usize, RecordBatch)> = futures::stream::iter(reads)
            .map(|(i, key, meta, positions)| {
                let (store, schema) = (Arc::clone(&self.store), Arc::clone(schema));
                async move {
                    tokio::spawn(chosen_rows(store, key, meta, positions, schema))
                        .await
                        .map_err(|e| Error::bug(format!("reading a history file stopped: {e}")))?
                        .map(|batch| (i, batch))
                }
            })
            .buffered(ROWS_AT_ONCE)
            .try_collect()
            .await?;
        let Some(sources) = sources else {
            // Every value is its version's: the files' rows, in file order,
            // are the live versions in row order.
            return Ok(read.into_iter().map(|(_, b)| b).collect());
        };
        // Where each file's rows are among the arrays `interleave` takes;
        // the last array is the null.
        let mut slot = vec![usize::MAX; self.files.len()];
        for (s, (file, _)) in read.iter().enumerate() {
            slot[*file] = s;
        }
        let nulls = read.len();
        let mut out = Vec::with_capacity(columns);
        for (c, field) in schema.fields().iter().enumerate() {
            let null = new_null_array(field.data_type(), 1);
            let arrays: Vec<&dyn Array> = read
                .iter()
                .map(|(_, b)| b.column(c).as_ref())
                .chain([null.as_ref()])
                .collect();
            let indices: Vec<(usize, usize)> = sources[c]
                .iter()
                .map(|&row| {
                    if row == NULL_ROW {
                        return (nulls, 0);
                    }
                    let (file, position) = split(row);
                    let index = wanted[file]
                        .binary_search(&position)
                        .expect("every source row was read");
                    (slot[file], index)
                })
                .collect();
            out.push(arrow::compute::interleave(&arrays, &indices).map_err(|e| {
                Error::bug(format!(
                    "assembling {}.{}: {e}",
                    self.shape.table,
                    field.name()
                ))
            })?);
        }
        let batch = RecordBatch::try_new(Arc::clone(schema), out)
            .map_err(|e| Error::bug(format!("assembling {}: {e}", self.shape.table)))?;
        Ok(vec![batch])
    }
}

#[async_trait]
impl TableProvider for AtView {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let columns: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..self.schema.fields().len()).collect(),
        };
        let batches = self
            .rows_kept(&columns)
            .await
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        let schema = Arc::new(self.schema.project(&columns)?);
        Ok(MemorySourceConfig::try_new_exec(&[batches], schema, None)?)
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::DataType;
    use object_store::memory::InMemory;
    use object_store::path::Path;
    use object_store::{ObjectStoreExt, PutPayload};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;

    use super::*;
    use crate::lakehouse::change::TypedChange;
    use crate::lakehouse::layout::{history_columns, history_schema};
    use crate::lakehouse::read::{Envelope, type_change};
    use crate::lakehouse::typing::Cell;
    use crate::query::merge::Overlay;

    /// Changes over a few keys: inserts, updates with and without `doc`
    /// (left out as an unchanged TOAST value), updates that move the key,
    /// deletes and a truncate, in an order drawn from a fixed seed.
    fn changes(shape: &TableShape) -> Vec<TypedChange> {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut draw = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        (1..=240)
            .map(|seq| {
                let id = draw(6) + 1;
                let line = match (seq, draw(10)) {
                    (120, _) => r#""op":"truncate","data":null,"old":null"#.to_string(),
                    (_, 0) => format!(r#""op":"delete","data":null,"old":{{"id":{id}}}"#),
                    (_, 1) => format!(
                        r#""op":"update","data":{{"id":{}}},"old":{{"id":{id}}}"#,
                        draw(6) + 1
                    ),
                    (_, 2..=4) => format!(r#""op":"update","data":{{"id":{id}}},"old":null"#),
                    _ => format!(
                        r#""op":"insert","data":{{"id":{id},"doc":"d{seq}"}},"old":null"#
                    ),
                };
                let line = format!(
                    r#"{{{line},"table":"public.t","seq":{seq},"idempotency_key":"p:{seq}","commit_lsn":"0/{seq:X}"}}"#
                );
                type_change(shape, serde_json::from_str::<Envelope>(&line).unwrap()).unwrap()
            })
            .collect()
    }

    /// The changes written as history files of 100 changes, in row groups
    /// of 16.
    async fn history(shape: &TableShape, changes: &[TypedChange]) -> (Arc<InMemory>, Vec<String>) {
        let store = Arc::new(InMemory::new());
        let mut files = Vec::new();
        for part in changes.chunks(100) {
            let (first, last) = (part[0].seq, part[part.len() - 1].seq);
            let key = format!("parquet/public/t/date=2026-12-01/{first}-{last}-r.parquet");
            let batch =
                RecordBatch::try_new(history_schema(shape), history_columns(shape, part)).unwrap();
            let props = WriterProperties::builder()
                .set_max_row_group_row_count(Some(16))
                .build();
            let mut out = Vec::new();
            let mut writer = ArrowWriter::try_new(&mut out, batch.schema(), Some(props)).unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
            store
                .put(&Path::from(key.as_str()), PutPayload::from(out))
                .await
                .unwrap();
            files.push(key);
        }
        (store, files)
    }

    fn id_and_doc(
        batches: &[RecordBatch],
        id: Option<usize>,
        doc: Option<usize>,
    ) -> Vec<(i64, Option<String>)> {
        let mut rows = Vec::new();
        for b in batches {
            for i in 0..b.num_rows() {
                let id = id.map_or(0, |c| {
                    b.column(c)
                        .as_any()
                        .downcast_ref::<Int64Array>()
                        .unwrap()
                        .value(i)
                });
                let doc = doc.and_then(|c| {
                    // Views from the view, plain strings from the overlay.
                    let a = arrow::compute::cast(b.column(c), &DataType::Utf8).unwrap();
                    let a = a.as_any().downcast_ref::<StringArray>().unwrap();
                    (!a.is_null(i)).then(|| a.value(i).to_string())
                });
                rows.push((id, doc));
            }
        }
        rows.sort();
        rows
    }

    #[tokio::test]
    async fn the_view_at_every_seq_is_the_one_the_changes_up_to_it_leave() {
        let shape = Arc::new(TableShape::test_t());
        let changes = changes(&shape);
        let (store, files) = history(&shape, &changes).await;
        let mut left_out = 0;
        for at in 1..=changes.len() as u64 {
            let mut overlay = Overlay::new(Arc::clone(&shape), false);
            for c in changes.iter().filter(|c| c.seq <= at) {
                overlay.apply(c.clone());
            }
            let expected = id_and_doc(&overlay.batches(7), Some(0), Some(1));
            let files: Vec<String> = files
                .iter()
                .filter(|f| crate::lakehouse::compacted::history_first_seq(f).unwrap() <= at)
                .cloned()
                .collect();
            let view = AtView::new(store.clone(), Arc::clone(&shape), files, at, 2);
            let both = view.rows(&[0, 1]).await.unwrap();
            assert_eq!(id_and_doc(&both, Some(0), Some(1)), expected, "at {at}");
            let swapped = view.rows(&[1, 0]).await.unwrap();
            assert_eq!(id_and_doc(&swapped, Some(1), Some(0)), expected, "at {at}");
            let docs = view.rows(&[1]).await.unwrap();
            let mut only: Vec<_> = expected.iter().map(|(_, d)| (0, d.clone())).collect();
            only.sort();
            assert_eq!(id_and_doc(&docs, None, Some(0)), only, "at {at}");
            let counted: usize = view
                .rows(&[])
                .await
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum();
            assert_eq!(counted, expected.len(), "at {at}");
            left_out += changes
                .iter()
                .filter(|c| c.seq == at && c.cells[1] == Cell::Absent && c.key.is_some())
                .count();
        }
        assert!(left_out > 20, "the changes leave doc out often: {left_out}");
    }

    /// A statement reading columns already built takes them: shown by
    /// deleting the history after the first statement.
    #[tokio::test]
    async fn a_statement_reading_columns_already_built_takes_them() {
        let shape = Arc::new(TableShape::test_t());
        let changes = changes(&shape);
        let (store, files) = history(&shape, &changes).await;
        let at = 150;
        let mut overlay = Overlay::new(Arc::clone(&shape), false);
        for c in changes.iter().filter(|c| c.seq <= at) {
            overlay.apply(c.clone());
        }
        let expected = id_and_doc(&overlay.batches(7), Some(0), Some(1));
        let sql = |ctx: datafusion::prelude::SessionContext, q: &'static str| async move {
            ctx.sql(q).await?.collect().await
        };
        let both = datafusion::prelude::SessionContext::new();
        let view = AtView::new(store.clone(), Arc::clone(&shape), files.clone(), at, 2);
        both.register_table("v", Arc::new(view)).unwrap();
        let only_doc = datafusion::prelude::SessionContext::new();
        let view = AtView::new(store.clone(), Arc::clone(&shape), files.clone(), at, 2);
        only_doc.register_table("v", Arc::new(view)).unwrap();
        let rows = sql(both.clone(), "SELECT id, doc FROM v").await.unwrap();
        assert_eq!(id_and_doc(&rows, Some(0), Some(1)), expected);
        sql(only_doc.clone(), "SELECT doc FROM v").await.unwrap();
        for f in &files {
            store.delete(&Path::from(f.as_str())).await.unwrap();
        }
        let rows = sql(both.clone(), "SELECT doc, id FROM v").await.unwrap();
        assert_eq!(id_and_doc(&rows, Some(1), Some(0)), expected);
        let rows = sql(both.clone(), "SELECT count(*) AS n FROM v")
            .await
            .unwrap();
        let n = rows[0]
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert_eq!(n.value(0) as usize, expected.len());
        assert!(sql(only_doc.clone(), "SELECT doc FROM v").await.is_ok());
        assert!(
            sql(only_doc, "SELECT id, doc FROM v").await.is_err(),
            "a column not built is read from the history, which is gone"
        );
    }
}
