//! The walk of [`super::hashed`]: a window's rows in the order of its
//! `ORDER BY`, each row's key looked up in a table that holds the key's
//! last row and count, so each row learns the row before it, tells that
//! row it is the one after, and learns its number.
//!
//! The rows are walked batch after batch: the input's batches ordered by
//! their first values when each is in order and none overlaps another (a
//! history's, see [`super::hashed`]), else every row sorted first. The
//! walk is shared among threads by the keys' hashes: each thread owns the
//! keys of its share of hashes and writes the links of their rows only.

use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::{Array, BinaryViewArray, RecordBatch, UInt32Array};
use arrow::compute::{concat_batches, take_record_batch};
use arrow::datatypes::DataType;
use arrow::row::Rows;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::physical_expr::PhysicalSortExpr;

use super::order::ordered_bits;
use crate::query::keytable::{KeyHasher, KeyTable};

/// A row: its batch (in the order walked) << 32 | its place in the batch.
pub(super) type RowAt = u64;

/// No row: before a key's first row, after its last.
pub(super) const NONE: RowAt = u64::MAX;

pub(super) fn row_at(batch: usize, row: usize) -> RowAt {
    (batch as u64) << 32 | row as u64
}

pub(super) fn split(at: RowAt) -> (usize, usize) {
    ((at >> 32) as usize, (at & 0xFFFF_FFFF) as usize)
}

/// How many rows ahead the walk asks for a key's entry.
const AHEAD: usize = 16;

/// The hash of rows whose key is null (they are one key).
pub(super) const NULL_HASH: u64 = 0;

/// A batch's keys, as the bytes the table looks up.
pub(super) enum Keys {
    /// No `PARTITION BY`: every row has the one empty key.
    None,
    /// One text or binary key, its bytes as they are; nulls apart.
    Bytes(BinaryViewArray),
    /// Any other keys, in arrow's row format (nulls included).
    Rows(Rows),
}

impl Keys {
    pub(super) fn get(&self, row: usize) -> Option<&[u8]> {
        match self {
            Keys::None => Some(&[]),
            Keys::Bytes(a) => a.is_valid(row).then(|| a.value(row)),
            Keys::Rows(rows) => Some(rows.row(row).data()),
        }
    }
}

/// A batch made ready for the walk: its keys and their hashes.
pub(super) struct Prepared {
    pub(super) keys: Keys,
    pub(super) hashes: Vec<u64>,
}

/// A key's entry in a thread's table.
#[derive(Clone, Copy)]
struct KeyState {
    last: RowAt,
    count: u64,
}

impl Default for KeyState {
    fn default() -> KeyState {
        KeyState {
            last: NONE,
            count: 0,
        }
    }
}

/// The thread that owns a key of hash `hash`: from bits the table's place
/// does not use.
fn owner(hash: u64, threads: usize) -> usize {
    (hash >> 40) as usize % threads
}

/// Runs `f` on each of `threads` threads with its number, for its result.
pub(super) fn on_threads<T: Send>(
    threads: usize,
    f: impl Fn(usize) -> DfResult<T> + Sync,
) -> DfResult<Vec<T>> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|t| s.spawn(move || f(t))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Each row's links and number, as the walk writes them: a row's are
/// written by the thread that owns its key. An empty list: not needed.
pub(super) struct Links {
    /// The row before each row of its key, for a `lag`.
    pub(super) before: Vec<Box<[AtomicU64]>>,
    /// The row after each row of its key, for a `lead`.
    pub(super) after: Vec<Box<[AtomicU64]>>,
    /// Each row's number among its key's rows, for a `row_number`.
    pub(super) numbers: Vec<Box<[AtomicU64]>>,
}

/// A list of `NONE` per row of `batches`, or none if not `wanted`.
pub(super) fn links(batches: &[RecordBatch], wanted: bool) -> Vec<Box<[AtomicU64]>> {
    if !wanted {
        return Vec::new();
    }
    batches
        .iter()
        .map(|b| (0..b.num_rows()).map(|_| AtomicU64::new(NONE)).collect())
        .collect()
}

/// The walk of thread `t` of `threads` over the rows of the keys it owns,
/// in the order of `keys`: each row's links written where [`Links`] keeps
/// them.
pub(super) fn walk_keys(
    keys: &[Prepared],
    t: usize,
    threads: usize,
    links: &Links,
    rows: usize,
    hasher: &KeyHasher,
) -> DfResult<()> {
    let mut table = KeyTable::<KeyState>::with_capacity(rows / threads / 4, hasher.clone());
    let mut null_key = KeyState::default();
    for (j, p) in keys.iter().enumerate() {
        for (r, &hash) in p.hashes.iter().enumerate() {
            if owner(hash, threads) != t {
                continue;
            }
            if let Some(&ahead) = p.hashes.get(r + AHEAD)
                && owner(ahead, threads) == t
            {
                table.prefetch(ahead);
            }
            let state = match p.keys.get(r) {
                Some(key) => table
                    .slot_hashed(key, hash)
                    .map_err(|e| DataFusionError::External(Box::new(e)))?,
                None => &mut null_key,
            };
            let here = row_at(j, r);
            if let Some(before) = links.before.get(j) {
                before[r].store(state.last, Ordering::Relaxed);
            }
            if !links.after.is_empty() && state.last != NONE {
                let (b, i) = split(state.last);
                links.after[b][i].store(here, Ordering::Relaxed);
            }
            state.last = here;
            state.count += 1;
            if let Some(numbers) = links.numbers.get(j) {
                numbers[r].store(state.count, Ordering::Relaxed);
            }
        }
    }
    Ok(())
}

/// Whether a key of this type is looked up by its bytes as they are.
pub(super) fn bytes(data_type: &DataType) -> bool {
    use DataType::*;
    matches!(
        data_type,
        Utf8 | LargeUtf8 | Utf8View | Binary | LargeBinary | BinaryView
    )
}

/// The batches in the order of `order`: as they are, ordered by their
/// first values, when each is in order and none overlaps another (peers
/// may meet at an edge); else all the rows sorted by the order value, in
/// batches of `batch_size`.
pub(super) fn in_order(
    batches: Vec<RecordBatch>,
    order: &PhysicalSortExpr,
    batch_size: usize,
) -> DfResult<Vec<RecordBatch>> {
    let values = |b: &RecordBatch| {
        let v = order.expr.evaluate(b)?.into_array(b.num_rows())?;
        ordered_bits(&v, order.options)
    };
    let mut spans = Vec::with_capacity(batches.len());
    let mut in_order = true;
    for b in &batches {
        let v = values(b)?;
        in_order &= v.windows(2).all(|w| w[0] <= w[1]);
        if !in_order {
            break;
        }
        spans.push((v[0], v[v.len() - 1]));
    }
    let mut order_of: Vec<usize> = (0..batches.len()).collect();
    if in_order {
        order_of.sort_by_key(|&j| spans[j]);
        in_order = order_of.windows(2).all(|w| spans[w[0]].1 <= spans[w[1]].0);
    }
    if in_order {
        let mut batches: Vec<Option<RecordBatch>> = batches.into_iter().map(Some).collect();
        return Ok(order_of
            .into_iter()
            .map(|j| batches[j].take().expect("each batch once"))
            .collect());
    }
    let Some(first) = batches.first() else {
        return Ok(batches);
    };
    let all = concat_batches(&first.schema(), &batches)?;
    drop(batches);
    let v = values(&all)?;
    let mut sorted: Vec<u32> = (0..all.num_rows() as u32).collect();
    sorted.sort_unstable_by_key(|&i| v[i as usize]);
    let all = take_record_batch(&all, &UInt32Array::from(sorted))?;
    let size = batch_size.max(1);
    Ok((0..all.num_rows())
        .step_by(size)
        .map(|at| all.slice(at, size.min(all.num_rows() - at)))
        .collect())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{AsArray, Int64Array};
    use arrow::datatypes::{Field, Schema};
    use datafusion::physical_expr::expressions::col;

    use super::*;

    fn batch(seqs: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("s", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(seqs.to_vec()))]).unwrap()
    }

    fn seqs(batches: &[RecordBatch]) -> Vec<Vec<i64>> {
        batches
            .iter()
            .map(|b| {
                b.column(0)
                    .as_primitive::<arrow::datatypes::Int64Type>()
                    .values()
                    .to_vec()
            })
            .collect()
    }

    /// Batches each in order and apart are taken as they are, ordered by
    /// their first values (peers may meet at an edge); any other input is
    /// sorted whole, descending too.
    #[test]
    fn batches_in_order_are_ordered_and_others_sorted() {
        let order = |descending| PhysicalSortExpr {
            expr: col("s", &batch(&[]).schema()).unwrap(),
            options: arrow::compute::SortOptions {
                descending,
                nulls_first: false,
            },
        };
        let apart = vec![batch(&[7, 9]), batch(&[1, 2, 3]), batch(&[3, 5])];
        assert_eq!(
            seqs(&in_order(apart, &order(false), 2).unwrap()),
            [vec![1, 2, 3], vec![3, 5], vec![7, 9]]
        );
        let descending = vec![batch(&[3, 2]), batch(&[9, 8]), batch(&[5, 4])];
        assert_eq!(
            seqs(&in_order(descending, &order(true), 2).unwrap()),
            [vec![9, 8], vec![5, 4], vec![3, 2]]
        );
        // A value falls back within a batch, or two batches overlap.
        for input in [
            vec![batch(&[1, 4, 2]), batch(&[5, 6])],
            vec![batch(&[1, 5]), batch(&[2, 6]), batch(&[7])],
        ] {
            let rows: usize = input.iter().map(RecordBatch::num_rows).sum();
            let sorted = seqs(&in_order(input, &order(false), 2).unwrap());
            assert!(sorted.iter().all(|b| b.len() <= 2), "{sorted:?}");
            let flat: Vec<i64> = sorted.concat();
            assert_eq!(flat.len(), rows);
            assert!(flat.windows(2).all(|w| w[0] <= w[1]), "{flat:?}");
        }
        assert!(in_order(Vec::new(), &order(false), 2).unwrap().is_empty());
    }
}
