//! The latest view: one row per key, the version with the highest seq,
//! written as `[prefix/]latest/<schema>/<table>/<generation>-<part>.parquet`
//! with the data columns and `_seq`, `_lsn`, `_key`.
//!
//! A run merges the previous generation (read back through DataFusion) with
//! its new changes, applied in seq order: an upsert replaces the row and
//! takes the previous version's value for every column it left out
//! (unchanged TOAST); an update that moves the key drops the old key's row;
//! a delete drops the row; a truncate drops every row. It then writes a new
//! generation under new names; the manifest switches to it in one PUT and
//! the previous generation is deleted after. Readers that want a consistent
//! view while a run replaces the files read the files the manifest lists.
//!
//! Memory: the rows of the table being merged (its keys and values), not
//! the archive's changes, which stream.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use futures::StreamExt;
use object_store::ObjectStore;
use parquet::file::properties::WriterProperties;

use super::history::{ParquetFile, table_dir};
use super::manifest::Move;
use super::read::{ChangeOp, TypedChange};
use super::session::table_url;
use super::typing::{Cell, TableShape, build_array, read_cells};
use crate::{Error, Result};

/// Rows per Arrow batch written.
const BATCH_ROWS: usize = 8192;

/// One current row.
#[derive(Debug, Clone)]
struct Row {
    seq: u64,
    lsn: Box<str>,
    cells: Vec<Cell>,
}

/// A table's latest rows, being merged.
pub struct LatestView {
    pub shape: Arc<TableShape>,
    rows: HashMap<Box<str>, Row>,
}

/// The latest view's Arrow schema.
pub fn latest_schema(shape: &TableShape) -> SchemaRef {
    let mut fields: Vec<Field> = shape
        .columns
        .iter()
        .map(|c| Field::new(&c.name, c.kind.data_type(), true))
        .collect();
    fields.extend([
        Field::new("_seq", DataType::Int64, false),
        Field::new("_lsn", DataType::Utf8, false),
        Field::new("_key", DataType::Utf8, false),
    ]);
    Arc::new(Schema::new(fields))
}

impl LatestView {
    /// A view with no rows.
    pub fn empty(shape: Arc<TableShape>) -> LatestView {
        LatestView {
            shape,
            rows: HashMap::new(),
        }
    }

    /// Reads the previous generation's `files` (keys in the store).
    pub async fn load(
        ctx: &SessionContext,
        shape: Arc<TableShape>,
        files: &[String],
    ) -> Result<LatestView> {
        let mut view = LatestView::empty(shape);
        if files.is_empty() {
            return Ok(view);
        }
        let urls: Vec<String> = files.iter().map(|k| table_url(k)).collect();
        let table = view.shape.table.clone();
        let df_error = |e: datafusion::error::DataFusionError| {
            Error::fatal(
                format!("cannot read the latest view of {table}: {e}"),
                "the files the compaction manifest lists must be readable; if they were removed, delete the manifest with the parquet/ and latest/ folders and compact again",
            )
        };
        let df = ctx
            .read_parquet(urls, ParquetReadOptions::default())
            .await
            .map_err(df_error)?;
        let mut stream = df.execute_stream().await.map_err(df_error)?;
        while let Some(batch) = stream.next().await {
            let batch = batch.map_err(df_error)?;
            view.absorb(&batch)?;
        }
        Ok(view)
    }

    /// Adds the rows of a batch of a previous generation.
    fn absorb(&mut self, batch: &RecordBatch) -> Result<()> {
        let n = batch.num_rows();
        let bad = |what: String| {
            Error::fatal(
                format!(
                    "the latest view of {} cannot be read: {what}",
                    self.shape.table
                ),
                "delete the manifest with the parquet/ and latest/ folders and compact again",
            )
        };
        let mut columns: Vec<Vec<Cell>> = Vec::with_capacity(self.shape.columns.len());
        for c in &self.shape.columns {
            columns.push(match batch.column_by_name(&c.name) {
                Some(array) => read_cells(c.kind, array).map_err(bad)?,
                // Added since that generation: null until a change sets it.
                None => vec![Cell::Null; n],
            });
        }
        let text = |name: &str| -> Result<StringArray> {
            let a = batch
                .column_by_name(name)
                .ok_or_else(|| bad(format!("no {name} column")))?;
            let a = arrow::compute::cast(a, &DataType::Utf8).map_err(|e| bad(e.to_string()))?;
            Ok(a.as_any()
                .downcast_ref::<StringArray>()
                .expect("cast to Utf8")
                .clone())
        };
        let keys = text("_key")?;
        let lsns = text("_lsn")?;
        let seqs = batch
            .column_by_name("_seq")
            .and_then(|a| a.as_any().downcast_ref::<Int64Array>())
            .ok_or_else(|| bad("no _seq column".into()))?;
        let mut iters: Vec<std::vec::IntoIter<Cell>> =
            columns.into_iter().map(Vec::into_iter).collect();
        for i in 0..n {
            let cells = iters
                .iter_mut()
                .map(|it| it.next().expect("one cell per row"))
                .collect();
            self.rows.insert(
                keys.value(i).into(),
                Row {
                    seq: seqs.value(i) as u64,
                    lsn: lsns.value(i).into(),
                    cells,
                },
            );
        }
        Ok(())
    }

    /// Applies one change; changes come in seq order.
    pub fn apply(&mut self, change: &TypedChange) {
        match change.op {
            ChangeOp::Truncate => self.rows.clear(),
            ChangeOp::Delete => {
                if let Some(k) = change.key.as_deref().or(change.old_key.as_deref()) {
                    self.rows.remove(k);
                }
            }
            ChangeOp::Upsert => {
                let Some(key) = change.key.as_deref() else {
                    return;
                };
                // An update that changed the key: the row was under the old one.
                let previous = match change.old_key.as_deref() {
                    Some(old) if old != key => self.rows.remove(old),
                    _ => None,
                };
                let previous = previous.or_else(|| self.rows.remove(key));
                let cells = change
                    .cells
                    .iter()
                    .enumerate()
                    .map(|(i, c)| match c {
                        Cell::Absent => previous
                            .as_ref()
                            .map(|p| p.cells[i].clone())
                            .unwrap_or(Cell::Null),
                        c => c.clone(),
                    })
                    .collect();
                self.rows.insert(
                    key.into(),
                    Row {
                        seq: change.seq,
                        lsn: change.lsn.as_str().into(),
                        cells,
                    },
                );
            }
        }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Writes the view as generation `generation` into `staging` (a folder
    /// readers of `latest/` do not see), rows ordered by key, in files of
    /// about `file_bytes` at most; returns where each file goes once the
    /// manifest points at it (see [`super::publish`]) and the bytes written.
    pub async fn write(
        &self,
        store: &Arc<dyn ObjectStore>,
        prefix: Option<&str>,
        staging: &str,
        generation: u64,
        props: &WriterProperties,
        file_bytes: u64,
    ) -> Result<(Vec<Move>, u64)> {
        let schema = latest_schema(&self.shape);
        let dir = table_dir(prefix, staging, &self.shape);
        let final_dir = table_dir(prefix, "latest", &self.shape);
        let mut keys: Vec<&Box<str>> = self.rows.keys().collect();
        keys.sort_unstable();
        let mut written = Vec::new();
        let mut bytes = 0;
        let mut file: Option<ParquetFile> = None;
        for chunk in keys.chunks(BATCH_ROWS) {
            if file.as_ref().is_some_and(|f| f.size() >= file_bytes) {
                let f = file.take().expect("checked");
                written.push(f.key.clone());
                bytes += f.finish().await?;
            }
            let f = match &mut file {
                Some(f) => f,
                None => file.insert(ParquetFile::create(
                    store,
                    format!("{dir}/{generation:08}-{:04}.parquet", written.len()),
                    Arc::clone(&schema),
                    props.clone(),
                )?),
            };
            let rows: Vec<&Row> = chunk.iter().map(|k| &self.rows[*k]).collect();
            let mut columns: Vec<ArrayRef> = self
                .shape
                .columns
                .iter()
                .enumerate()
                .map(|(i, c)| build_array(c.kind, rows.iter().map(|r| &r.cells[i])))
                .collect();
            columns.push(Arc::new(
                rows.iter().map(|r| r.seq as i64).collect::<Int64Array>(),
            ));
            columns.push(Arc::new(
                rows.iter().map(|r| Some(&*r.lsn)).collect::<StringArray>(),
            ));
            columns.push(Arc::new(
                chunk.iter().map(|k| Some(&***k)).collect::<StringArray>(),
            ));
            let batch = RecordBatch::try_new(Arc::clone(&schema), columns).map_err(|e| {
                Error::fatal(
                    format!("cannot build a batch of {}: {e}", f.key),
                    "this is a bug in waltail; please report it",
                )
            })?;
            f.write(&batch).await?;
        }
        // An empty table still gets a file, so readers find its columns.
        let f = match file {
            Some(f) => f,
            None => ParquetFile::create(
                store,
                format!("{dir}/{generation:08}-0000.parquet"),
                Arc::clone(&schema),
                props.clone(),
            )?,
        };
        written.push(f.key.clone());
        bytes += f.finish().await?;
        let moves = written
            .into_iter()
            .map(|from| Move {
                to: format!(
                    "{final_dir}/{}",
                    from.rsplit('/').next().expect("a file name")
                ),
                from,
            })
            .collect();
        Ok((moves, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::super::typing::{Column, Kind};
    use super::*;

    fn view() -> LatestView {
        LatestView {
            shape: Arc::new(TableShape {
                table: "public.t".into(),
                columns: vec![
                    Column {
                        name: "id".into(),
                        kind: Kind::Int64,
                    },
                    Column {
                        name: "doc".into(),
                        kind: Kind::Text,
                    },
                ],
                key: vec![0],
            }),
            rows: HashMap::new(),
        }
    }

    fn change(op: ChangeOp, seq: u64, id: i64, doc: Cell, old_key: Option<i64>) -> TypedChange {
        TypedChange {
            op_name: "x".into(),
            op,
            seq,
            lsn: "0/1".into(),
            key: Some(format!(r#"{{"id":{id}}}"#)),
            old_key: old_key.map(|k| format!(r#"{{"id":{k}}}"#)),
            cells: vec![Cell::Int(id), doc],
            old: None,
            unchanged: None,
        }
    }

    fn doc(v: &LatestView, id: i64) -> Option<Cell> {
        v.rows
            .get(format!(r#"{{"id":{id}}}"#).as_str())
            .map(|r| r.cells[1].clone())
    }

    #[test]
    fn unchanged_toast_is_carried_forward_even_across_a_key_change() {
        let mut v = view();
        v.apply(&change(
            ChangeOp::Upsert,
            1,
            1,
            Cell::Str("big".into()),
            None,
        ));
        v.apply(&change(ChangeOp::Upsert, 2, 1, Cell::Absent, None));
        assert_eq!(doc(&v, 1), Some(Cell::Str("big".into())));
        v.apply(&change(ChangeOp::Upsert, 3, 2, Cell::Absent, Some(1)));
        assert_eq!(doc(&v, 1), None, "the old key's row is gone");
        assert_eq!(doc(&v, 2), Some(Cell::Str("big".into())));
        assert_eq!(v.rows[r#"{"id":2}"#].seq, 3);
    }

    #[test]
    fn deletes_and_truncates_remove_rows() {
        let mut v = view();
        v.apply(&change(ChangeOp::Upsert, 1, 1, Cell::Null, None));
        v.apply(&change(ChangeOp::Upsert, 2, 2, Cell::Null, None));
        v.apply(&change(ChangeOp::Delete, 3, 1, Cell::Null, None));
        assert_eq!(v.len(), 1);
        let mut t = change(ChangeOp::Truncate, 4, 0, Cell::Null, None);
        t.key = None;
        v.apply(&t);
        assert!(v.is_empty());
        // A row inserted after the truncate stays.
        v.apply(&change(ChangeOp::Upsert, 5, 7, Cell::Null, None));
        assert_eq!(v.len(), 1);
    }

    #[test]
    fn an_update_to_a_deleted_rows_toasted_column_does_not_resurrect_its_value() {
        let mut v = view();
        v.apply(&change(
            ChangeOp::Upsert,
            1,
            1,
            Cell::Str("big".into()),
            None,
        ));
        v.apply(&change(ChangeOp::Delete, 2, 1, Cell::Null, None));
        v.apply(&change(ChangeOp::Upsert, 3, 1, Cell::Absent, None));
        assert_eq!(doc(&v, 1), Some(Cell::Null));
    }
}
