//! The reads of history files a rebuild makes: the change columns of the
//! row groups that may hold changes up to a seq, streamed in small batches
//! with each batch's place in its file; and chosen rows in chosen columns.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStore;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, RowSelection, RowSelector,
};
use parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use parquet::file::metadata::ParquetMetaData;
use parquet::file::statistics::Statistics;

use crate::lakehouse::compacted::UNREADABLE_FIX;
use crate::lakehouse::stored::{StoredFile, cast};
use crate::{Error, Result};

/// Rows per batch of change columns.
const BATCH_ROWS: usize = 8192;

/// The change columns pass 1 reads.
const CHANGE_COLUMNS: [&str; 5] = ["_seq", "_op", "_key", "_old", "_unchanged"];

fn unreadable(key: &str, e: &dyn std::fmt::Display) -> Error {
    Error::fatal(
        format!("cannot read the history file {key}: {e}"),
        UNREADABLE_FIX,
    )
}

/// Sends the change columns of a history file's row groups that may hold
/// changes up to `at`, in batches of [`BATCH_ROWS`] (small enough for
/// their buffers to be used again rather than grown into fresh memory),
/// each with the position of its first row in the file; stops early if
/// no one receives them. Returns the file's metadata, for the second pass
/// to read its chosen rows without loading it again.
pub(super) async fn change_columns(
    store: Arc<dyn ObjectStore>,
    key: String,
    at: u64,
    tx: tokio::sync::mpsc::Sender<(u64, RecordBatch)>,
) -> Result<ArrowReaderMetadata> {
    let mut file = StoredFile::new(store, &key, None);
    let meta = ArrowReaderMetadata::load_async(&mut file, ArrowReaderOptions::new())
        .await
        .map_err(|e| unreadable(&key, &e))?;
    let mask = roots(&meta, CHANGE_COLUMNS);
    for g in groups_up_to(meta.metadata(), at) {
        let mut batches =
            ParquetRecordBatchStreamBuilder::new_with_metadata(file.clone(), meta.clone())
                .with_row_groups(vec![g])
                .with_projection(mask.clone())
                .with_batch_size(BATCH_ROWS)
                .build()
                .map_err(|e| unreadable(&key, &e))?;
        let mut next = group_start(meta.metadata(), g);
        while let Some(batch) = batches.try_next().await.map_err(|e| unreadable(&key, &e))? {
            let n = batch.num_rows() as u64;
            if tx.send((next, batch)).await.is_err() {
                return Ok(meta);
            }
            next += n;
        }
    }
    Ok(meta)
}

/// The position in its file of row group `g`'s first row.
fn group_start(metadata: &ParquetMetaData, g: usize) -> u64 {
    metadata.row_groups()[..g]
        .iter()
        .map(|r| r.num_rows() as u64)
        .sum()
}

/// The file's top-level columns of these names (names may hold dots,
/// which `ProjectionMask::columns` would take for nesting).
fn roots<'a>(
    meta: &ArrowReaderMetadata,
    names: impl IntoIterator<Item = &'a str>,
) -> ProjectionMask {
    let fields = meta.schema();
    let indices: Vec<usize> = names
        .into_iter()
        .filter_map(|n| fields.index_of(n).ok())
        .collect();
    ProjectionMask::roots(meta.parquet_schema(), indices)
}

/// The row groups whose `_seq` statistics allow a seq up to `at` (all
/// without statistics).
fn groups_up_to(metadata: &ParquetMetaData, at: u64) -> Vec<usize> {
    let seq = metadata
        .file_metadata()
        .schema_descr()
        .columns()
        .iter()
        .position(|c| c.name() == "_seq");
    (0..metadata.num_row_groups())
        .filter(|&g| {
            let min = seq.and_then(|s| match metadata.row_group(g).column(s).statistics() {
                Some(Statistics::Int64(s)) => s.min_opt().copied(),
                _ => None,
            });
            min.is_none_or(|m| m <= at as i64)
        })
        .collect()
}

/// The rows at `positions` (sorted) of a history file, in `schema`; `meta`
/// as pass 1 loaded it.
pub(super) async fn chosen_rows(
    store: Arc<dyn ObjectStore>,
    key: String,
    meta: ArrowReaderMetadata,
    positions: Arc<[u64]>,
    schema: SchemaRef,
) -> Result<RecordBatch> {
    let file = StoredFile::new(store, &key, None);
    let total = meta.metadata().file_metadata().num_rows() as u64;
    let mask = roots(&meta, schema.fields().iter().map(|f| f.name().as_str()));
    // One batch of every row chosen: nothing to join afterwards.
    let batches: Vec<RecordBatch> = ParquetRecordBatchStreamBuilder::new_with_metadata(file, meta)
        .with_projection(mask)
        .with_row_selection(selection(&positions, total))
        .with_batch_size(positions.len().max(1))
        .build()
        .map_err(|e| unreadable(&key, &e))?
        .map(|b| {
            b.map_err(|e| unreadable(&key, &e))
                .and_then(|b| cast(&b, &schema).map_err(|e| unreadable(&key, &e)))
        })
        .try_collect()
        .await?;
    let batch = match batches.len() {
        1 => batches.into_iter().next().expect("one batch"),
        _ => arrow::compute::concat_batches(&schema, &batches).map_err(|e| unreadable(&key, &e))?,
    };
    if batch.num_rows() != positions.len() {
        return Err(unreadable(&key, &"it holds fewer rows than it did"));
    }
    Ok(batch)
}

/// The rows at `positions` (sorted, distinct) of `total`.
fn selection(positions: &[u64], total: u64) -> RowSelection {
    // Sized once: the list can be most of a pass's memory, and growing it
    // copies it into fresh pages again and again.
    let runs = positions.windows(2).filter(|w| w[1] != w[0] + 1).count() + 1;
    let mut selectors: Vec<RowSelector> = Vec::with_capacity(2 * runs + 1);
    let mut next = 0;
    for &p in positions {
        if p > next {
            selectors.push(RowSelector::skip((p - next) as usize));
        }
        match selectors.last_mut() {
            Some(s) if !s.skip => s.row_count += 1,
            _ => selectors.push(RowSelector::select(1)),
        }
        next = p + 1;
    }
    if total > next {
        selectors.push(RowSelector::skip((total - next) as usize));
    }
    selectors.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selection_takes_exactly_the_positions() {
        let s = selection(&[0, 1, 2, 5, 9], 12);
        let expected: Vec<RowSelector> = vec![
            RowSelector::select(3),
            RowSelector::skip(2),
            RowSelector::select(1),
            RowSelector::skip(3),
            RowSelector::select(1),
            RowSelector::skip(2),
        ];
        assert_eq!(Vec::<RowSelector>::from(s), expected);
        assert_eq!(
            Vec::<RowSelector>::from(selection(&[3], 4)),
            vec![RowSelector::skip(3), RowSelector::select(1)]
        );
    }
}
