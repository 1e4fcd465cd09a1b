//! Where the compacted tables live and what their columns are: the history
//! (every change: the data columns, then `_op`, `_seq`, `_lsn`, `_key`,
//! `_old`, `_unchanged`) and the latest view (one row per key: the data
//! columns, then `_seq`, `_lsn`, `_key`). compact writes these layouts and
//! query reads them (and lays its NDJSON tail out the same way), so they
//! are written once, here.

use std::borrow::Borrow;
use std::sync::Arc;

use arrow::array::ArrayRef;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use super::change::TypedChange;
use super::columns::change_batch;
use super::typing::TableShape;
use crate::archive::key::key_segment;
use crate::{Error, Result};

/// `key` relative to the table folder `dir` (both under the prefix), as
/// a Delta log names its files.
pub(crate) fn relative(dir: &str, key: &str) -> Result<String> {
    key.strip_prefix(dir)
        .and_then(|k| k.strip_prefix('/'))
        .map(str::to_string)
        .ok_or_else(|| Error::bug(format!("{key} is not in {dir}")))
}

/// The `date` partition a history file's path names.
pub(crate) fn partition_date(path: &str) -> Option<String> {
    path.split('/')
        .find_map(|p| p.strip_prefix("date="))
        .map(str::to_string)
}

/// `[prefix/]<root>/<schema>/<table>`, names encoded as schema records' are.
pub fn table_dir(prefix: Option<&str>, root: &str, shape: &TableShape) -> String {
    let (schema, table) = shape.schema_and_name();
    crate::archive::key::under(
        prefix,
        &format!("{root}/{}/{}", key_segment(schema), key_segment(table)),
    )
}

/// The history file of `shape` for seqs `first..=last` committed on `date`.
pub fn history_key(
    prefix: Option<&str>,
    shape: &TableShape,
    date: &str,
    first: u64,
    last: u64,
    run: &str,
) -> String {
    format!(
        "{}/date={date}/{first}-{last}-{run}.parquet",
        table_dir(prefix, "parquet", shape)
    )
}

/// The history's Arrow schema: the data columns, then the metadata.
pub fn history_schema(shape: &TableShape) -> SchemaRef {
    with_data_columns(
        shape,
        [
            Field::new("_op", DataType::Utf8, false),
            Field::new("_seq", DataType::Int64, false),
            Field::new("_lsn", DataType::Utf8, false),
            Field::new("_key", DataType::Utf8, true),
            Field::new("_old", DataType::Utf8, true),
            Field::new("_unchanged", DataType::Utf8, true),
        ],
    )
}

/// The latest view's Arrow schema.
pub fn latest_schema(shape: &TableShape) -> SchemaRef {
    with_data_columns(
        shape,
        [
            Field::new("_seq", DataType::Int64, false),
            Field::new("_lsn", DataType::Utf8, false),
            Field::new("_key", DataType::Utf8, false),
        ],
    )
}

/// The table's data columns (each nullable: a deleted row's or an unchanged
/// TOAST value's cell is null), then `metadata`.
fn with_data_columns<const N: usize>(shape: &TableShape, metadata: [Field; N]) -> SchemaRef {
    let mut fields: Vec<Field> = shape.data_fields().collect();
    fields.extend(metadata);
    Arc::new(Schema::new(fields))
}

/// The history's columns (data, then `_op`, `_seq`, `_lsn`, `_key`, `_old`,
/// `_unchanged`) of typed changes, as [`history_schema`] lays them out
/// (`query` reads its NDJSON tail into them; compaction builds them as it
/// parses, see [`crate::lakehouse::columns`]).
pub fn history_columns<R: Borrow<TypedChange>>(shape: &TableShape, rows: &[R]) -> Vec<ArrayRef> {
    change_batch(shape, rows).history
}
