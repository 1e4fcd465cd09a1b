//! The partitions of rows sorted by key number (see [`super::order`]), with
//! the rows of keys that share a number put together again.
//!
//! A key's number is part of its hash, so two keys can share one. Their
//! rows then form one run of that number, in the order of their values,
//! interleaved. The window tells the keys apart by comparing the keys
//! themselves, row to row, and where a run holds more than one key (a
//! collision), it reorders the run: each key's rows together, in the order
//! the keys first appear, each key's rows in the order they had. So the
//! rows a batch before already emitted, which are that run's first key,
//! keep their places, and doing it again changes nothing.
//!
//! A run can only be reordered whole, so a collided run that may go on in
//! the next batch is held (not emitted) until it ends: the memory of a
//! collision is the colliding keys' rows, where without one it is a batch.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use arrow::array::{Array, AsArray, GenericByteViewArray, make_comparator};
use arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use arrow::compute::{SortOptions, take_record_batch};
use arrow::datatypes::{ByteViewType, DataType};
use arrow::row::{RowConverter, SortField};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::physical_expr::PhysicalExpr;

use super::order::order_key_numbers;
use crate::query::prefetch::prefetch;

/// A buffer's rows in window order, and their partitions.
pub(super) struct Partitioned {
    /// The rows, each collided run reordered.
    pub(super) rows: RecordBatch,
    /// Each row's partition, numbered from 0.
    pub(super) part: Vec<u32>,
    /// Where a collided run that may go on in the next batch starts: no row
    /// from there on may be emitted yet.
    pub(super) held_from: Option<usize>,
}

/// Partitions `rows`, sorted by the key order column `order` (see
/// [`super::order`]) and keyed by `keys`; `last`: no rows come after them;
/// the first `emitted` rows were emitted (the window's lookback).
pub(super) fn partitions(
    rows: RecordBatch,
    order: usize,
    keys: &[Arc<dyn PhysicalExpr>],
    last: bool,
    emitted: usize,
) -> DfResult<Partitioned> {
    let numbers = order_key_numbers(rows.column(order))?;
    let same_number = |i: usize| numbers[i] == numbers[i - 1];
    let mut changes = changes_where(&rows, keys, same_number)?;
    let mut collided = collided_runs(&numbers, &changes);
    let held_from = match collided.last() {
        Some(run) if run.end == rows.num_rows() && !last => {
            let start = run.start;
            collided.pop();
            Some(start)
        }
        _ => None,
    };
    let rows = if collided.is_empty() {
        rows
    } else {
        let rows = regroup(&rows, &collided, keys, emitted)?;
        changes = changes_where(&rows, keys, same_number)?;
        rows
    };
    let mut part = vec![0u32; numbers.len()];
    for i in 1..numbers.len() {
        part[i] = part[i - 1] + u32::from(numbers[i] != numbers[i - 1] || changes[i]);
    }
    Ok(Partitioned {
        rows,
        part,
        held_from,
    })
}

/// For each row, whether any of its keys differs from the row before's
/// (nulls equal; the first row: `false`).
pub(super) fn key_changes(
    rows: &RecordBatch,
    keys: &[Arc<dyn PhysicalExpr>],
) -> DfResult<Vec<bool>> {
    changes_where(rows, keys, |_| true)
}

/// [`key_changes`], compared only for the rows where `compare(row)`; the
/// others `false`. Rows sorted by key number need comparing only where the
/// number is the row before's: a fifth of the rows a window over each
/// key's versions reads, and most of its cost when compared whole.
fn changes_where(
    rows: &RecordBatch,
    keys: &[Arc<dyn PhysicalExpr>],
    compare: impl Fn(usize) -> bool,
) -> DfResult<Vec<bool>> {
    let n = rows.num_rows();
    let mut changes = vec![false; n];
    for key in keys {
        let values = key.evaluate(rows)?.into_array(n)?;
        match values.data_type() {
            DataType::Utf8View => view_changes(values.as_string_view(), &mut changes, &compare),
            DataType::BinaryView => view_changes(values.as_binary_view(), &mut changes, &compare),
            _ => {
                let cmp = make_comparator(&values, &values, SortOptions::default())?;
                for (i, changed) in changes.iter_mut().enumerate().skip(1) {
                    if !*changed && compare(i) {
                        *changed = cmp(i, i - 1).is_ne();
                    }
                }
            }
        }
    }
    Ok(changes)
}

/// How many rows ahead [`view_changes`] asks for a key's bytes.
const AHEAD: usize = 16;

/// [`changes_where`] for one key of string or binary views. The rows come
/// sorted by number, so a key's bytes (those past the 12 a view holds
/// itself) lie wherever the Parquet decoding put them: reading them is a
/// cache miss a row, one after another. This asks the processor for the
/// bytes [`AHEAD`] rows before they are compared, so the misses overlap.
/// Equal views are equal keys when the bytes are inline; otherwise the
/// lengths and 4-byte prefixes the views hold decide most inequalities
/// before the bytes are read.
fn view_changes<T: ByteViewType + ?Sized>(
    keys: &GenericByteViewArray<T>,
    changes: &mut [bool],
    compare: &impl Fn(usize) -> bool,
) {
    let (views, buffers) = (keys.views(), keys.data_buffers());
    let bytes = |view: u128| -> &[u8] {
        let len = view as u32 as usize;
        if len <= 12 {
            return &[];
        }
        let buffer = (view >> 64) as u32 as usize;
        let offset = (view >> 96) as u32 as usize;
        &buffers[buffer][offset..offset + len]
    };
    let valid = |i: usize| keys.is_valid(i);
    for i in 1..changes.len() {
        if let Some(ahead) = views.get(i + AHEAD).map(|&v| bytes(v))
            && !ahead.is_empty()
        {
            prefetch(ahead.as_ptr());
        }
        if changes[i] || !compare(i) {
            continue;
        }
        changes[i] = match (valid(i), valid(i - 1)) {
            (true, true) => {
                let (a, b) = (views[i], views[i - 1]);
                // Length and prefix (the low 64 bits), then the inline
                // bytes or the buffer's.
                if a as u64 != b as u64 {
                    true
                } else if a as u32 <= 12 {
                    a != b
                } else {
                    bytes(a) != bytes(b)
                }
            }
            (a, b) => a != b,
        };
    }
}

/// The runs of one number in which the key changes.
fn collided_runs(numbers: &[u64], changes: &[bool]) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let (mut start, mut collided) = (0, false);
    for i in 1..=numbers.len() {
        if i == numbers.len() || numbers[i] != numbers[i - 1] {
            if collided {
                runs.push(start..i);
            }
            (start, collided) = (i, false);
        } else if changes[i] {
            collided = true;
        }
    }
    runs
}

/// `rows` with each of `runs` reordered: its keys' rows together, in the
/// order the keys first appear, each key's in the order they were.
fn regroup(
    rows: &RecordBatch,
    runs: &[Range<usize>],
    keys: &[Arc<dyn PhysicalExpr>],
    emitted: usize,
) -> DfResult<RecordBatch> {
    let n = rows.num_rows();
    let values = keys
        .iter()
        .map(|k| k.evaluate(rows)?.into_array(n))
        .collect::<DfResult<Vec<ArrayRef>>>()?;
    let converter = RowConverter::new(
        values
            .iter()
            .map(|v| SortField::new(v.data_type().clone()))
            .collect(),
    )?;
    let mut order: Vec<u32> = (0..n as u32).collect();
    for run in runs {
        let slices: Vec<ArrayRef> = values
            .iter()
            .map(|v| v.slice(run.start, run.len()))
            .collect();
        let encoded = converter.convert_columns(&slices)?;
        let mut group_of = HashMap::new();
        let mut groups: Vec<Vec<u32>> = Vec::new();
        for (j, row) in encoded.iter().enumerate() {
            let g = *group_of.entry(row).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[g].push((run.start + j) as u32);
        }
        for (k, i) in groups.into_iter().flatten().enumerate() {
            order[run.start + k] = i;
        }
    }
    // The rows emitted are the first key of their run, so they stay put;
    // were one to move, the window's answers for the rows after it would
    // be wrong, so it is an error rather than an answer.
    if order[..emitted.min(n)]
        .iter()
        .enumerate()
        .any(|(i, &o)| o as usize != i)
    {
        return Err(DataFusionError::Internal(
            "the key window would reorder rows it already emitted".into(),
        ));
    }
    Ok(take_record_batch(rows, &UInt32Array::from(order))?)
}

#[cfg(test)]
mod tests {
    use arrow::array::{BinaryViewArray, StringViewArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::physical_expr::expressions::Column;

    use super::*;

    /// The views' comparison says what arrow's comparator says, for keys
    /// inline and not, sharing a length and a prefix or not, and nulls.
    #[test]
    fn view_keys_change_where_the_comparator_says() {
        let values = [
            None,
            None,
            Some("a"),
            Some("a"),
            Some("{\"id\":262681}"),
            Some("{\"id\":262681}"),
            Some("{\"id\":262682}"),
            Some("{\"id\":26268}"),
            Some("{\"id\":26268}"),
            Some("a long key of thirty-odd bytes, one"),
            Some("a long key of thirty-odd bytes, two"),
            Some("a long key of thirty-odd bytes, two"),
            None,
            Some(""),
            Some(""),
            Some("twelve bytes"),
            Some("twelve bytez"),
        ];
        let text: ArrayRef = Arc::new(StringViewArray::from(values.to_vec()));
        let binary: ArrayRef = Arc::new(BinaryViewArray::from(
            values
                .iter()
                .map(|v| v.map(str::as_bytes))
                .collect::<Vec<_>>(),
        ));
        for array in [text, binary] {
            let schema = Arc::new(Schema::new(vec![Field::new(
                "k",
                array.data_type().clone(),
                true,
            )]));
            assert!(matches!(
                array.data_type(),
                DataType::Utf8View | DataType::BinaryView
            ));
            let rows = RecordBatch::try_new(schema, vec![Arc::clone(&array)]).unwrap();
            let keys: Vec<Arc<dyn PhysicalExpr>> = vec![Arc::new(Column::new("k", 0))];
            let cmp = make_comparator(&array, &array, SortOptions::default()).unwrap();
            let expected: Vec<bool> = (0..values.len())
                .map(|i| i > 0 && cmp(i, i - 1).is_ne())
                .collect();
            assert_eq!(key_changes(&rows, &keys).unwrap(), expected);
            // Compared only where asked.
            let odd = changes_where(&rows, &keys, |i| i % 2 == 1).unwrap();
            let expected_odd: Vec<bool> = expected
                .iter()
                .enumerate()
                .map(|(i, &c)| c && i % 2 == 1)
                .collect();
            assert_eq!(odd, expected_odd);
        }
    }
}
