//! One bucket of a table's latest view merged: the previous generation's
//! rows of the bucket and the spool's rounds replayed in seq order, the
//! old rows of updates that moved a key across buckets found on the way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use datafusion::prelude::SessionContext;

use super::view::{LatestView, Loc, Row, Source, file_bucket};
use crate::compact::spool::{Role, Spool, bucket_of};
use crate::lakehouse::change::ChangeOp;
use crate::lakehouse::typing::{Cell, TableShape};
use crate::{Error, Result};

/// What the bucket merges of one table read: the previous generation and
/// the run's spool. Shared by the merges running at once.
pub struct MergeInput {
    /// The session the previous generation's files are read with.
    pub ctx: SessionContext,
    /// The table merged.
    pub shape: Arc<TableShape>,
    /// The previous generation's files and its bucket count.
    pub previous: Vec<String>,
    /// The bucket count of the previous generation.
    pub previous_buckets: u32,
    /// The run's spool, finished.
    pub spool: Arc<Spool>,
    /// The bucket count of this merge (a multiple of `previous_buckets`).
    pub buckets: u32,
    /// By seq, the old row of each update that moved a row across buckets
    /// leaving columns out; filled as buckets are merged, and by replaying
    /// the old key's bucket up to that update when it was not merged that
    /// far yet. Only such updates use it; when the spool holds any
    /// (`TableSpool::carried_moves`: updates that changed a row's key
    /// leaving a column out, whichever buckets the keys fall in, which is
    /// known only later) buckets are merged one at a time, in order, so
    /// that only moves from a later bucket cost a replay; merged two at
    /// once, moves between the two would too. The result is the same.
    pub moved: Mutex<HashMap<u64, Option<Vec<Cell>>>>,
}

/// The old row of the update at `seq` that moved it from key `old` of
/// another bucket: from where that bucket's merge left it, or by replaying
/// that bucket up to the update when it is merged later.
async fn moved_cells(input: &MergeInput, old: &str, seq: u64) -> Result<Option<Vec<Cell>>> {
    let known = input.moved.lock().expect("not poisoned").get(&seq).cloned();
    if let Some(cells) = known {
        return Ok(cells);
    }
    let from = bucket_of(old, input.buckets);
    let before = Box::pin(merge_bucket(input, from, Some(seq))).await?;
    let cells = before.get(old);
    input
        .moved
        .lock()
        .expect("not poisoned")
        .insert(seq, cells.clone());
    Ok(cells)
}

/// The latest view of bucket `bucket`: the previous generation's rows of
/// the bucket with the run's changes of the bucket applied in seq order,
/// those before seq `until` only when it is given.
pub async fn merge_bucket(
    input: &MergeInput,
    bucket: u32,
    until: Option<u64>,
) -> Result<LatestView> {
    let n = input.buckets;
    let previous_bucket = bucket & (input.previous_buckets.max(1) - 1);
    let files: Vec<String> = input
        .previous
        .iter()
        .filter(|f| file_bucket(f) == previous_bucket)
        .cloned()
        .collect();
    let mut view =
        LatestView::load_bucket(&input.ctx, Arc::clone(&input.shape), &files, bucket, n).await?;
    let table = &input.shape.table;
    for file in input.spool.rounds(table) {
        let batches = input.spool.read_round(table, file, bucket, n)?;
        // The round's rows in seq order: (seq, batch, row). Stable: a
        // truncate written to several partitions of the bucket stays where
        // it was, and applying it twice is the same.
        let mut order: Vec<(u64, u32, u32)> = Vec::new();
        for (b, rows) in batches.iter().enumerate() {
            order.extend((0..rows.len()).map(|i| (rows.seq(i), b as u32, i as u32)));
        }
        order.sort_by_key(|o| o.0);
        let first = view.sources.len() as u32;
        for rows in &batches {
            view.add(Source {
                columns: rows.data().to_vec(),
                seqs: rows.seqs().clone(),
                lsns: Arc::clone(rows.lsns()),
            });
        }
        for (seq, b, i) in order {
            if until.is_some_and(|u| seq >= u) {
                return Ok(view);
            }
            let (rows, i) = (&batches[b as usize], i as usize);
            let at = Loc {
                src: first + b,
                row: i as u32,
            };
            let op = match rows.role(i) {
                Role::MoveOut { carry } => {
                    let (from, to) = (rows.key(i), rows.old_key(i));
                    let (Some(from), Some(to)) = (from, to) else {
                        return Err(Error::bug(format!(
                            "a spooled move of {table} without keys"
                        )));
                    };
                    if bucket_of(to, n) == bucket {
                        continue; // the update itself, in this bucket, moves it
                    }
                    if carry {
                        let row = view.remove(from);
                        input.moved.lock().expect("not poisoned").insert(seq, row);
                    } else {
                        view.rows.remove(from);
                    }
                    continue;
                }
                Role::Change(op) => op,
            };
            let (key, old_key) = (rows.key(i), rows.old_key(i));
            let absent = rows.absent(i);
            let moved_in = match (op, key, old_key) {
                (ChangeOp::Upsert, Some(key), Some(old))
                    if old != key && bucket_of(old, n) != bucket =>
                {
                    // Moved from another bucket: when it left columns
                    // out, it takes them from the old row.
                    let cells = match absent {
                        Some(_) => moved_cells(input, old, seq).await?,
                        None => None,
                    };
                    Some(cells.map(|cells| Row {
                        at: view.add_cells(&cells, seq, ""),
                        columns: None,
                    }))
                }
                _ => None,
            };
            view.apply_at(op, key, old_key, at, absent, moved_in);
        }
    }
    Ok(view)
}
