//! A table's history files rewritten when a column's type widens (an
//! `ALTER COLUMN ... TYPE bigint` on an `integer`, a numeric given more
//! digits).
//!
//! Without Delta's `typeWidening` table feature, every file a snapshot
//! names must hold the types of the snapshot's schema. Declaring the
//! feature is not an option: it raises the protocol to reader 3 / writer 7
//! with a feature that many readers in use do not know (Delta Lake on
//! Spark reads it from 4.0), and that the Delta writer compact commits
//! through (deltalake-core 1.1) refuses to commit to. So the run that first sees the wider type writes
//! each earlier history file again in it, and its history commit replaces
//! them with the new copies in the same log entry as its own files: every
//! snapshot holds its schema's types, and the narrower files stay for time
//! travel to earlier versions until `compact.retain` passes. The latest
//! view needs nothing of this: a run that merges it writes every file anew
//! in the current types.
//!
//! The copies are written before the commit, like every file of a run,
//! with the run's id in their names: a run stopped before its commit
//! leaves files no snapshot names, and the next run, which still finds the
//! narrower type in the log, rewrites them again.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use futures::{StreamExt, TryStreamExt};
use parquet::arrow::ParquetRecordBatchStreamBuilder;
use parquet::file::properties::WriterProperties;

use super::parquet_file::{Output, ParquetFile};
use crate::lakehouse::compacted::UNREADABLE_FIX;
use crate::lakehouse::delta::DataFile;
use crate::lakehouse::layout;
use crate::lakehouse::stored::{StoredFile, cast};
use crate::lakehouse::typing::{Column, TableShape};
use crate::{Error, Result};

/// Files rewritten at a time: each holds one row group of its source in
/// memory, so memory stays that of a few row groups.
const AT_ONCE: usize = 2;

/// The columns whose type in `shape` differs from the one they were
/// written with (`written`, from the history's log), as
/// `name: narrow -> wide`; empty when the files hold the shape's types.
/// Columns added since hold no values in the earlier files and need no
/// rewrite: Delta readers read them as null.
pub(crate) fn widened(written: &[Column], shape: &TableShape) -> Vec<String> {
    written
        .iter()
        .filter_map(|before| {
            let now = shape.columns.iter().find(|c| c.name == before.name)?;
            (now.kind != before.kind).then(|| {
                format!(
                    "{}: {} -> {}",
                    before.name,
                    before.kind.describe(),
                    now.kind.describe()
                )
            })
        })
        .collect()
}

/// Writes each of `files` (history files of `shape`'s table, paths
/// relative to its folder) again in `shape`'s types, under the name of
/// run `run` and the same seqs and date. Returns the copies, to add in the
/// commit that removes the originals.
pub(crate) async fn rewrite_history(
    output: &Output,
    prefix: Option<&str>,
    shape: &Arc<TableShape>,
    files: &[DataFile],
    run: &str,
    props: &WriterProperties,
) -> Result<Vec<DataFile>> {
    let dir = layout::table_dir(prefix, "parquet", shape);
    let schema = layout::history_schema(shape);
    futures::stream::iter(files)
        .map(|file| {
            let (dir, schema) = (&dir, &schema);
            async move {
                let (date, first, last) = seqs_and_date(file)?;
                let key = layout::history_key(prefix, shape, &date, first, last, run);
                let from = format!("{dir}/{}", file.path);
                let source = StoredFile::new(Arc::clone(&output.store), &from, Some(file.size));
                let (rows, size) = copy(output, source, &from, key.clone(), schema, props).await?;
                Ok(DataFile {
                    path: layout::relative(dir, &key)?,
                    size,
                    rows,
                    date: Some(date),
                })
            }
        })
        .buffered(AT_ONCE)
        .try_collect()
        .await
}

/// A history file's date and seqs, from its path
/// (`date=<date>/<first>-<last>[-<run>].parquet`).
fn seqs_and_date(file: &DataFile) -> Result<(String, u64, u64)> {
    let bad = || {
        Error::fatal(
            format!(
                "the history file {} does not have a name compact gives its files (date=<date>/<first seq>-<last seq>-<run>.parquet)",
                file.path
            ),
            UNREADABLE_FIX,
        )
    };
    let date = file.date.clone().ok_or_else(bad)?;
    let name = file
        .path
        .rsplit('/')
        .next()
        .and_then(|n| n.strip_suffix(".parquet"))
        .ok_or_else(bad)?;
    let mut seqs = name.split('-').map(str::parse::<u64>);
    match (seqs.next(), seqs.next()) {
        (Some(Ok(first)), Some(Ok(last))) => Ok((date, first, last)),
        _ => Err(bad()),
    }
}

/// Copies the Parquet file `from` to `to` with its columns cast to
/// `schema`'s types (a column it lacks written as nulls). Returns the rows
/// and the bytes written.
async fn copy(
    output: &Output,
    source: StoredFile,
    from: &str,
    to: String,
    schema: &SchemaRef,
    props: &WriterProperties,
) -> Result<(u64, u64)> {
    let unreadable = |e: &dyn std::fmt::Display| {
        Error::fatal(
            format!("cannot read the history file {from} to rewrite it in a wider type: {e}"),
            UNREADABLE_FIX,
        )
    };
    let mut batches = ParquetRecordBatchStreamBuilder::new(source)
        .await
        .map_err(|e| unreadable(&e))?
        .build()
        .map_err(|e| unreadable(&e))?;
    let mut file = ParquetFile::create(output, to, Arc::clone(schema), props.clone())?;
    while let Some(batch) = batches.next().await {
        let batch = batch.map_err(|e| unreadable(&e))?;
        file.write(&cast(&batch, schema).map_err(|e| unreadable(&e))?)
            .await?;
    }
    let rows = file.rows;
    Ok((rows, file.finish().await?))
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::lakehouse::typing::Kind;

    #[test]
    fn a_widened_column_is_named_and_an_added_one_is_not() {
        let mut shape = TableShape::test_t();
        let written = vec![Column {
            name: "id".into(),
            kind: Kind::Int32,
        }];
        assert_eq!(widened(&written, &shape), ["id: Int32 -> Int64"]);
        shape.columns[0].kind = Kind::Int32;
        assert!(widened(&written, &shape).is_empty(), "doc was added later");
    }

    #[test]
    fn a_history_files_seqs_and_date_come_from_its_name() {
        let file = |path: &str| DataFile {
            path: path.into(),
            size: 1,
            rows: 1,
            date: Some("2026-12-03".into()),
        };
        assert_eq!(
            seqs_and_date(&file("date=2026-12-03/5-90-ab12cd34.parquet")).unwrap(),
            ("2026-12-03".to_string(), 5, 90)
        );
        assert_eq!(
            seqs_and_date(&file("date=2026-12-03/5-90.parquet")).unwrap(),
            ("2026-12-03".to_string(), 5, 90)
        );
        assert!(seqs_and_date(&file("date=2026-12-03/x.parquet")).is_err());
    }
}
