//! The latest merge's spool: a run's changes of each table, written to local
//! temporary files (Arrow IPC) by the hash of their row key, so that the
//! latest view can be merged a bucket of keys at a time (see
//! [`super::latest::merge_bucket`]) and memory holds a few buckets,
//! whatever the number of keys.
//!
//! A change goes to partition `key_hash(key) % PARTITIONS`; a bucket `b` of
//! `n` (a power of two) is the keys with `key_hash(key) % n == b`, so it
//! reads the partitions congruent to `b` (when `n <= PARTITIONS`) or one
//! partition, filtered (when `n > PARTITIONS`). The bucket count is chosen
//! after the spool is written, when the number of changes is known.
//!
//! Before a change is buffered it is combined with the key's earlier
//! changes of the round (see [`combine::combine`]): the key's net change, which is
//! what replaying them gives the merge. Keys that change often (a status
//! updated ten times) cost one spooled row, not ten; when a round holds
//! every key of the run, the spool and the merge handle one row per key
//! changed. An update that moves a row to another key and a truncate touch
//! other keys: each ends the combining of its table's keys before it is
//! buffered as it is. Combining costs hash lookups per change and holds
//! rows longer: a table whose round had at least [`MIN_ROUND_CHANGES`]
//! changes and saved less than a quarter of them (keys rarely repeat within
//! the memory budget: many more keys than fit) is spooled change by change
//! for the rest of the run (once no table combines, rounds shrink to
//! [`RAW_BUFFER_BYTES`]). The next run starts combining again. A round
//! need not end for that: after [`EARLY_CHANGES`] changes of a round, a
//! table whose repeats so far predict less than a quarter by the round's
//! end stops at once (see [`combining_may_pay`]). On the benchmark, whose
//! first 1,000,000 changes are inserts of new keys, the first round held
//! 353,381 changes before it showed nothing to combine; deciding after
//! 65,536 took compact's user CPU from 5.7-6.0 s to 5.5-5.75 s. The
//! price: a round that starts with 65,536 changes of new keys and changes
//! those keys again later in the same round (a bulk load, then its
//! updates) no longer combines them; its rows are spooled one per change,
//! which costs the merge more rows, not correctness.
//!
//! A table spooled change by change takes its rows from the history
//! writer ([`Spool::push_rows`]): [`change_rows`] takes them from the
//! Arrow batch the parse built (`columns::ChangeBatch`: the history's
//! columns, the op, the old key and the left-out columns) for a buffer of
//! 8,192 changes or more, and orders them by partition (`round::partition_rows`)
//! on the writer's encoding task; a round's file takes a slice of each buffer's
//! rows per partition. So a change is not held until its round is
//! written: holding it a round long and converting it again from
//! scattered rows made compact 8-22% slower (three alternated pairs).
//!
//! Buffers are flushed all together whenever they (and the combined rows)
//! hold about the spool's memory budget; each flush is a "round": one file
//! per table holding one Arrow batch per partition (batch `p` is partition
//! `p`, empty or not): 32 times fewer files than one per partition and
//! round, which made creating files 4% of compact's CPU (ext4 searches
//! for a free inode past the many just deleted). Rounds
//! cover consecutive seq ranges (changes are pushed in seq order), so a
//! bucket is replayed in seq order by reading round after round and
//! sorting each round's rows of the bucket by seq.
//!
//! Special rows: a truncate is written to every partition (it empties every
//! bucket); an update that moves a row to another key is written under the
//! new key and, as a [`Step::MoveOut`], under the old one, so the bucket
//! holding the old key drops that row.
//!
//! The files live in a temporary folder under `TMPDIR`, removed when the
//! spool is dropped (also on an error); a run killed -9 leaves it behind
//! (`waltail-spool-*`), the next run removes it (see [`folder`]) and starts
//! over from the archive.

mod combine;
mod folder;
mod round;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::datatypes::SchemaRef;

use self::combine::{EARLY_CHANGES, Pending, combine, combining_may_pay};
use self::folder::SpoolDir;
pub use self::round::{
    ChangeRows, PARTITIONS, Role, Spooled, Step, bucket_of, change_rows, key_hash, spool_schema,
};
use self::round::{partition, read_bucket, spool_error, write_round};
use crate::lakehouse::change::TypedChange;
use crate::lakehouse::columns::{Change, Counts};
use crate::lakehouse::typing::TableShape;
use crate::{Error, Result};

/// The least memory budget a spool takes, whatever it is given.
const MIN_BUFFER_BYTES: usize = 8 << 20;

/// The rows a round holds once no table combines its changes: enough for
/// files of a useful size, and no more memory than that takes.
const RAW_BUFFER_BYTES: usize = 32 << 20;

/// Changes a round must have had before its share of combined ones decides
/// whether its table goes on combining.
const MIN_ROUND_CHANGES: u64 = 10_000;

/// About the memory a spooled change holds: its row (see
/// [`Change::row_bytes`]), plus the JSON of its old row and unchanged
/// columns, which it keeps until it is written out (the old row is the
/// whole row under REPLICA IDENTITY FULL).
fn held_bytes(change: &TypedChange) -> usize {
    Change::from(change).row_bytes() as usize
        + change.old.as_ref().map_or(0, String::len)
        + change.unchanged.as_ref().map_or(0, String::len)
}

/// One table's spool.
pub struct TableSpool {
    /// The table spooled.
    pub shape: Arc<TableShape>,
    schema: SchemaRef,
    id: usize,
    buffers: Vec<Vec<Step>>,
    /// The table's file of each round it had changes in, in round order.
    files: Vec<PathBuf>,
    /// What the table's changes were (upserts, moves, their bytes).
    pub counts: Counts,
    /// The net change of each key changed since the table's last round or
    /// barrier (a move or a truncate), not yet buffered.
    pending: HashSet<Pending, foldhash::fast::RandomState>,
    /// Whether changes are combined (see the module doc).
    combining: bool,
    /// Once the table no longer combines: its round's rows as they came
    /// from the history writer ([`Spool::push_rows`]), buffer after buffer
    /// in seq order (each buffer's rows ordered by partition).
    rows: Vec<ChangeRows>,
    /// The first seq whose row is taken from those batches: the changes
    /// before it were pushed one by one while the table combined them.
    /// `u64::MAX` while it combines.
    rows_from: u64,
    /// Changes of the round that could be combined, and those that were.
    round_changes: u64,
    round_combined: u64,
}

/// Every table's spool of a run.
pub struct Spool {
    /// Shared with the writer of a round, so that the folder outlives it
    /// when the spool is dropped mid-write (an error).
    dir: Arc<SpoolDir>,
    tables: BTreeMap<String, TableSpool>,
    /// The estimated memory ([`held_bytes`]) of the buffered and the
    /// combined rows, and the Arrow memory of the rows pushed in batches.
    buffered: usize,
    /// Rows held (buffered and combined, all tables) before a round is
    /// written out; one round more may be being written meanwhile (see
    /// [`Spool::flush`]).
    budget: usize,
    /// The rows a round holds: `budget` while a table combines its changes,
    /// at most [`RAW_BUFFER_BYTES`] otherwise.
    limit: usize,
    /// Rounds written so far.
    rounds: u32,
    /// The round being written out, on a blocking thread of its own while
    /// the next one fills (at most one: memory holds two rounds' buffers).
    writing: Option<tokio::task::JoinHandle<Result<()>>>,
}

impl TableSpool {
    /// Buffers the combined changes: later changes are combined anew (a
    /// round's end, or a move or truncate about to be buffered as it is).
    fn settle_pending(&mut self) {
        for p in self.pending.drain() {
            self.buffers[partition(p.key())].push(Step::Change(p.0));
        }
    }

    /// Spools the rest of the run's changes as they are: their rows come
    /// in batches from the history writer, from the change after the last
    /// one pushed (call once the combined changes are buffered, and only
    /// once: a second call would move that change on and drop the rows of
    /// changes counted since, which the history writer may still hand on).
    fn stop_combining(&mut self) {
        debug_assert!(self.combining, "stopped combining twice");
        if !self.combining {
            return;
        }
        self.combining = false;
        self.pending = HashSet::default(); // its table's memory too
        self.rows_from = self.counts.last_seq + 1;
    }
}

impl Spool {
    /// An empty spool in a new temporary folder, holding about `budget`
    /// bytes of rows in memory (twice that while a round is written).
    pub fn new(budget: u64) -> Result<Spool> {
        let dir = SpoolDir::new_in(&std::env::temp_dir())?;
        Ok(Spool {
            dir: Arc::new(dir),
            tables: BTreeMap::new(),
            buffered: 0,
            budget: (budget as usize).max(MIN_BUFFER_BYTES),
            limit: (budget as usize).max(MIN_BUFFER_BYTES),
            rounds: 0,
            writing: None,
        })
    }

    /// The spool of `table`, if any change of it was pushed.
    pub fn table(&self, table: &str) -> Option<&TableSpool> {
        self.tables.get(table)
    }

    /// Adds one change (changes come in seq order). Changes of a table
    /// without key are not merged into a latest view: skipped. Once its
    /// table no longer combines ([`Spool::takes_rows`]), a change is only
    /// counted here: its row must come through [`Spool::push_rows`].
    pub async fn push(&mut self, shape: &Arc<TableShape>, change: &Arc<TypedChange>) -> Result<()> {
        if shape.key.is_empty() {
            return Ok(());
        }
        if !self.tables.contains_key(&shape.table) {
            let id = self.tables.len();
            self.limit = self.budget; // a new table combines its changes
            self.tables.insert(
                shape.table.clone(),
                TableSpool {
                    shape: Arc::clone(shape),
                    schema: spool_schema(shape),
                    id,
                    buffers: (0..PARTITIONS).map(|_| Vec::new()).collect(),
                    files: Vec::new(),
                    counts: Counts::default(),
                    pending: HashSet::default(),
                    combining: true,
                    rows: Vec::new(),
                    rows_from: u64::MAX,
                    round_changes: 0,
                    round_combined: 0,
                },
            );
        }
        let t = self.tables.get_mut(&shape.table).expect("inserted above");
        let view = Change::from(&**change);
        if !t.counts.add(&view) {
            return Ok(()); // no key to place it by: nothing to merge
        }
        let (key, size) = (view.key, view.row_bytes() as usize);
        let (moved_from, carry) = (view.moved_from(), view.carries());
        if !t.combining {
            return Ok(()); // its row comes with the history's batch (push_rows)
        }
        match (key, moved_from) {
            (None, _) => {
                // A truncate.
                t.settle_pending();
                for b in &mut t.buffers {
                    b.push(Step::Change(Arc::clone(change)));
                }
                self.buffered += size * PARTITIONS as usize;
            }
            (Some(key), None) => {
                t.round_changes += 1;
                // Replaced in place: no tombstone left behind, as a remove
                // and an insert per change would.
                let net = match t.pending.get(key) {
                    Some(Pending(before)) => {
                        t.round_combined += 1;
                        self.buffered -= held_bytes(before);
                        combine(before, change)
                    }
                    None => Arc::clone(change),
                };
                self.buffered += held_bytes(&net);
                t.pending.replace(Pending(net));
                if t.round_changes == EARLY_CHANGES {
                    // The changes the round would hold at this rate.
                    let round = (t.round_changes as f64 * self.limit as f64
                        / self.buffered.max(1) as f64) as u64;
                    if !combining_may_pay(t.round_changes, t.round_combined, round) {
                        tracing::debug!(
                            table = %t.shape.table,
                            changes = t.round_changes,
                            combined = t.round_combined,
                            round,
                            "keys rarely repeat: spooling the rest of the run change by change"
                        );
                        t.settle_pending();
                        t.stop_combining();
                    }
                }
            }
            (Some(key), Some(old)) => {
                t.settle_pending();
                t.buffers[partition(key)].push(Step::Change(Arc::clone(change)));
                t.buffers[partition(old)].push(Step::MoveOut {
                    seq: change.seq,
                    from: old.to_string(),
                    to: key.to_string(),
                    carry,
                });
                self.buffered += held_bytes(change) + 64 + old.len() + key.len();
            }
        }
        if self.buffered >= self.limit {
            self.flush().await?;
        }
        Ok(())
    }

    /// Counts a batch of changes of a table that no longer combines them
    /// ([`Spool::takes_rows`]), given as a batch instead of one by one:
    /// their rows come through [`Spool::push_rows`].
    pub fn count(&mut self, shape: &TableShape, counts: &Counts) -> Result<()> {
        match self.tables.get_mut(&shape.table) {
            Some(t) if !t.combining => {
                t.counts.merge(counts);
                Ok(())
            }
            _ if shape.key.is_empty() => Ok(()),
            // Its changes would be lost: they must be pushed one by one.
            _ => Err(Error::bug(format!(
                "a batch of {} was counted while its changes are combined",
                shape.table
            ))),
        }
    }

    /// Whether `table`'s rows are to come through [`Spool::push_rows`]:
    /// it has a key and no longer combines its changes.
    pub fn takes_rows(&self, table: &str) -> bool {
        self.tables.get(table).is_some_and(|t| !t.combining)
    }

    /// Adds the rows of `table`'s changes a buffer of the history writer
    /// held ([`change_rows`]): buffers come in seq order, each after its
    /// changes were pushed or counted. Only the rows of changes from the table's
    /// switch to change by change on are kept (those before were pushed
    /// one by one): a change is then spooled without being held or
    /// converted to Arrow a second time.
    pub async fn push_rows(&mut self, table: &str, rows: ChangeRows) -> Result<()> {
        let Some(t) = self.tables.get_mut(table) else {
            // Rows are built only for a table `takes_rows` named.
            return Err(Error::bug(format!(
                "spool rows of {table}, which has no spool"
            )));
        };
        let Some(rows) = rows.since(t.rows_from)? else {
            return Ok(());
        };
        self.buffered += rows.memory();
        t.rows.push(rows);
        if self.buffered >= self.limit {
            self.flush().await?;
        }
        Ok(())
    }

    /// Starts writing every buffered row out as one round (a file per
    /// table), once the previous round is written.
    pub async fn flush(&mut self) -> Result<()> {
        if self.buffered == 0 {
            return Ok(());
        }
        self.settle().await?;
        let round = self.rounds;
        let mut work = Vec::new();
        for t in self.tables.values_mut() {
            t.settle_pending();
            if t.combining
                && t.round_changes >= MIN_ROUND_CHANGES
                && t.round_combined * 4 < t.round_changes
            {
                tracing::debug!(
                    table = %t.shape.table,
                    changes = t.round_changes,
                    combined = t.round_combined,
                    "keys rarely repeat within a round: spooling the rest of the run change by change"
                );
                t.stop_combining();
            }
            (t.round_changes, t.round_combined) = (0, 0);
            if t.buffers.iter().all(Vec::is_empty) && t.rows.is_empty() {
                continue;
            }
            let partitions: Vec<Vec<Step>> = t.buffers.iter_mut().map(std::mem::take).collect();
            let rows = std::mem::take(&mut t.rows);
            let path = self.dir.path().join(format!("{}-{round}.arrow", t.id));
            t.files.push(path.clone());
            work.push((
                Arc::clone(&t.shape),
                Arc::clone(&t.schema),
                partitions,
                rows,
                path,
            ));
        }
        let dir = Arc::clone(&self.dir);
        self.writing = Some(tokio::task::spawn_blocking(move || {
            let _dir = dir;
            for (shape, schema, partitions, rows, path) in work {
                write_round(&shape, &schema, &partitions, &rows, &path)?;
            }
            Ok(())
        }));
        self.rounds += 1;
        self.buffered = 0;
        if self.tables.values().all(|t| !t.combining) {
            self.limit = self.budget.min(RAW_BUFFER_BYTES);
        }
        Ok(())
    }

    /// Writes out what is buffered and waits until every round is on disk:
    /// call before reading the spool back.
    pub async fn finish(&mut self) -> Result<()> {
        self.flush().await?;
        self.settle().await
    }

    /// Waits for the round being written, if any.
    async fn settle(&mut self) -> Result<()> {
        match self.writing.take() {
            Some(task) => task
                .await
                .map_err(|e| Error::bug(format!("the spool writer failed: {e}")))?,
            None => Ok(()),
        }
    }

    /// The files of `table`'s rounds, in round order. Only after
    /// [`Spool::finish`]: before, the last round may still be being written.
    pub fn rounds(&self, table: &str) -> &[PathBuf] {
        self.tables.get(table).map_or(&[], |t| t.files.as_slice())
    }

    /// The rows of one round's `file` that belong to bucket `bucket` of
    /// `buckets`: a batch per partition of the bucket that has any, each
    /// in the order its rows were buffered (seq order, except that a
    /// round's combined rows come in no order: sort by seq to replay).
    pub fn read_round(
        &self,
        table: &str,
        file: &Path,
        bucket: u32,
        buckets: u32,
    ) -> Result<Vec<Spooled>> {
        if !self.tables.contains_key(table) {
            return Err(spool_error(format!("no spool for {table}")));
        }
        read_bucket(file, bucket, buckets)
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::StringArray;

    use super::super::latest::{LatestView, MergeInput, merge_bucket};
    use super::*;
    use crate::lakehouse::change::ChangeOp;
    use crate::lakehouse::columns::{change_batch, left_out};
    use crate::lakehouse::session;
    use crate::lakehouse::typing::Cell;
    use crate::lakehouse::typing::array::read_cells;

    fn shape() -> Arc<TableShape> {
        Arc::new(TableShape::test_t())
    }

    /// The steps of a round's bucket as they were spooled, in seq order.
    fn read_steps(spool: &Spool, table: &str, file: &Path, bucket: u32, buckets: u32) -> Vec<Step> {
        let shape = &spool.tables[table].shape;
        let mut out = Vec::new();
        for rows in spool.read_round(table, file, bucket, buckets).unwrap() {
            let columns: Vec<Vec<Cell>> = shape
                .columns
                .iter()
                .zip(rows.data())
                .map(|(c, a)| read_cells(c.kind, a).unwrap())
                .collect();
            for i in 0..rows.len() {
                let (seq, key) = (rows.seq(i), rows.key(i).map(str::to_string));
                let op = match rows.role(i) {
                    Role::MoveOut { carry } => {
                        out.push(Step::MoveOut {
                            seq,
                            from: key.unwrap(),
                            to: rows.old_key(i).unwrap().to_string(),
                            carry,
                        });
                        continue;
                    }
                    Role::Change(op) => op,
                };
                let absent = |j: usize| rows.absent(i).is_some_and(|bits| left_out(bits, j));
                let cells = (0..columns.len())
                    .map(|j| {
                        if absent(j) {
                            Cell::Absent
                        } else {
                            columns[j][i].clone()
                        }
                    })
                    .collect();
                out.push(Step::Change(Arc::new(TypedChange {
                    op_name: "",
                    op,
                    seq,
                    lsn: rows
                        .lsns()
                        .as_any()
                        .downcast_ref::<StringArray>()
                        .unwrap()
                        .value(i)
                        .into(),
                    key: key.map(Into::into),
                    old_key: rows.old_key(i).map(Into::into),
                    cells,
                    old: None,
                    unchanged: None,
                })));
            }
        }
        out.sort_by_key(Step::seq);
        out
    }

    /// The seqs of every row spooled for `table`, over all its rounds, in
    /// order (a finished spool).
    fn spooled_seqs(spool: &Spool, table: &str) -> Vec<u64> {
        let mut seqs: Vec<u64> = spool
            .rounds(table)
            .iter()
            .flat_map(|file| read_steps(spool, table, file, 0, 1))
            .map(|step| step.seq())
            .collect();
        seqs.sort();
        seqs
    }

    /// The spool rows of `changes` as a history writer's buffer gives them.
    fn rows_of(shape: &TableShape, changes: &[Arc<TypedChange>]) -> ChangeRows {
        change_rows(shape, &spool_schema(shape), &change_batch(shape, changes)).unwrap()
    }

    /// Pushes `change` as a run does: to the spool, then its row as the
    /// history writer gives it (a buffer of one).
    async fn spool_change(spool: &mut Spool, shape: &Arc<TableShape>, change: &Arc<TypedChange>) {
        spool.push(shape, change).await.unwrap();
        let rows = rows_of(shape, std::slice::from_ref(change));
        spool.push_rows(&shape.table, rows).await.unwrap();
    }

    fn change(op: ChangeOp, seq: u64, id: i64, doc: Cell, old: Option<i64>) -> Arc<TypedChange> {
        Arc::new(TypedChange {
            op_name: "",
            op,
            seq,
            lsn: format!("0/{seq}").into(),
            key: (op != ChangeOp::Truncate).then(|| format!(r#"{{"id":{id}}}"#).into()),
            old_key: old.map(|k| format!(r#"{{"id":{k}}}"#).into()),
            cells: vec![Cell::Int(id), doc],
            old: None,
            unchanged: None,
        })
    }

    /// No previous generation is read: one session serves every case.
    static CONTEXT: std::sync::LazyLock<datafusion::prelude::SessionContext> =
        std::sync::LazyLock::new(|| {
            session::session(Arc::new(object_store::memory::InMemory::new()))
        });

    proptest::proptest! {
        // Each case writes and reads a file per round, up to dozens.
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]

        /// Whatever the changes (upserts leaving the doc out, deletes,
        /// moves of a row to another key, truncates) and however often a
        /// round is cut, the view merged from the spool's combined rows,
        /// and from the rows that came in batches after the table stopped
        /// combining, is the view of every change applied in order.
        #[test]
        fn combined_changes_merge_into_the_view_every_change_gives(
            ops in proptest::collection::vec((0u8..10, 0i64..6, 0i64..6, 0u8..3), 1..60),
            budget in 0usize..3,
            stop in proptest::bool::ANY,
            buffer in 1usize..8,
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let shape = shape();
            let mut spool = Spool::new(0).unwrap();
            // A budget of a few rows, so rounds are cut mid-way.
            spool.budget = [400, 1500, 1 << 20][budget];
            spool.limit = spool.budget;
            let mut direct = LatestView::empty(Arc::clone(&shape));
            // The history writer's buffer: its rows reach the spool after
            // the changes, `buffer` at a time.
            let mut held = Vec::new();
            let half = ops.len() / 2;
            for (n, (kind, id, other, doc)) in ops.into_iter().enumerate() {
                let seq = n as u64 + 1;
                if stop && n == half && spool.table("public.t").is_some() {
                    // As a round that combined too little does: the rest of
                    // the run goes change by change.
                    rt.block_on(spool.flush()).unwrap();
                    spool.tables.get_mut("public.t").unwrap().stop_combining();
                }
                let doc = match doc {
                    0 => Cell::Absent,
                    1 => Cell::Null,
                    _ => Cell::Str(format!("v{seq}").into()),
                };
                let c = match kind {
                    0..=5 => change(ChangeOp::Upsert, seq, id, doc, None),
                    6 | 7 => change(ChangeOp::Delete, seq, id, Cell::Null, Some(id)),
                    8 => change(ChangeOp::Upsert, seq, id, doc, Some(other)),
                    _ => change(ChangeOp::Truncate, seq, 0, Cell::Null, None),
                };
                direct.apply((*c).clone());
                rt.block_on(spool.push(&shape, &c)).unwrap();
                held.push(c);
                if held.len() == buffer {
                    let rows = rows_of(&shape, &std::mem::take(&mut held));
                    rt.block_on(spool.push_rows("public.t", rows)).unwrap();
                }
            }
            if !held.is_empty() {
                rt.block_on(spool.push_rows("public.t", rows_of(&shape, &held))).unwrap();
            }
            rt.block_on(spool.finish()).unwrap();
            let spool = Arc::new(spool);
            // Merged as a run merges them: bucket after bucket (moves carry
            // values across buckets), one bucket, several, and more than
            // the spool's partitions.
            for buckets in [1u32, 4, 64] {
                let input = MergeInput {
                    ctx: CONTEXT.clone(),
                    shape: Arc::clone(&shape),
                    previous: Vec::new(),
                    previous_buckets: 1,
                    spool: Arc::clone(&spool),
                    buckets,
                    moved: Default::default(),
                };
                let views: Vec<LatestView> = (0..buckets)
                    .map(|b| rt.block_on(merge_bucket(&input, b, None)).unwrap())
                    .collect();
                let rows: usize = views.iter().map(LatestView::len).sum();
                proptest::prop_assert_eq!(rows, direct.len(), "{} buckets", buckets);
                for id in 0..6 {
                    let key = format!(r#"{{"id":{id}}}"#);
                    let merged = &views[bucket_of(&key, buckets) as usize];
                    proptest::prop_assert_eq!(merged.get(&key), direct.get(&key), "{} in {} buckets", key, buckets);
                }
            }
        }
    }

    /// Each table has a file of its own in each round it had changes in;
    /// a round without changes of a table leaves it no file, and every
    /// change is read back once from its table's files, whatever the
    /// bucket count.
    #[tokio::test]
    async fn each_table_reads_back_its_own_rounds() {
        let t = shape();
        let u = Arc::new(TableShape {
            table: "public.u".into(),
            ..TableShape::test_t()
        });
        let mut spool = Spool::new(1 << 30).unwrap();
        for seq in 1..=40u64 {
            let table = if seq % 2 == 0 { &t } else { &u };
            let c = change(ChangeOp::Upsert, seq, seq as i64, Cell::Null, None);
            spool.push(table, &c).await.unwrap();
        }
        spool.flush().await.unwrap();
        for seq in 41..=60u64 {
            let c = change(ChangeOp::Upsert, seq, seq as i64, Cell::Null, None);
            spool.push(&t, &c).await.unwrap();
        }
        spool.finish().await.unwrap();
        assert_eq!(spool.rounds("public.t").len(), 2);
        assert_eq!(spool.rounds("public.u").len(), 1);
        assert_ne!(spool.rounds("public.t")[0], spool.rounds("public.u")[0]);
        for (table, expected) in [
            (
                "public.t",
                (1..=60)
                    .filter(|s| s % 2 == 0 || *s > 40)
                    .collect::<Vec<u64>>(),
            ),
            ("public.u", (1..=40).filter(|s| s % 2 == 1).collect()),
        ] {
            for buckets in [1, 4, 64] {
                let mut seqs = Vec::new();
                for b in 0..buckets {
                    for file in spool.rounds(table) {
                        for step in read_steps(&spool, table, file, b, buckets) {
                            let key = step.key().unwrap();
                            assert_eq!(bucket_of(key, buckets), b, "{table}");
                            seqs.push(step.seq());
                        }
                    }
                }
                seqs.sort();
                assert_eq!(seqs, expected, "{table} in {buckets} buckets");
            }
        }
    }

    #[tokio::test]
    async fn a_table_whose_keys_rarely_repeat_stops_combining_and_one_whose_keys_do_goes_on() {
        let shape = shape();
        // 9,000 keys: a round of 10,000 changes combines 10% of them.
        for (keys, combining) in [(9_000, false), (100, true)] {
            // More than a round change by change holds.
            let mut spool = Spool::new(2 * RAW_BUFFER_BYTES as u64).unwrap();
            for seq in 1..=3 * MIN_ROUND_CHANGES {
                let id = (seq % keys) as i64;
                let c = change(ChangeOp::Upsert, seq, id, Cell::Null, None);
                spool_change(&mut spool, &shape, &c).await;
                if seq % MIN_ROUND_CHANGES == 0 {
                    spool.flush().await.unwrap();
                }
            }
            let t = spool.table("public.t").unwrap();
            assert_eq!(t.combining, combining, "{keys} keys");
            assert_eq!(t.counts.changes, 3 * MIN_ROUND_CHANGES);
            assert_eq!(spool.limit <= RAW_BUFFER_BYTES, !combining, "{keys} keys");
            spool.finish().await.unwrap();
            let rows: usize = spool
                .rounds("public.t")
                .iter()
                .map(|file| read_steps(&spool, "public.t", file, 0, 1).len())
                .sum();
            // Combined: one row per key and round; then one per change.
            let expected = if combining {
                3 * keys as usize
            } else {
                keys as usize + 2 * MIN_ROUND_CHANGES as usize
            };
            assert_eq!(rows, expected, "{keys} keys");
        }
    }

    /// Keys that never repeat stop the combining within the first round,
    /// once [`EARLY_CHANGES`] changes show it; every change comes back
    /// once. Keys that repeat go on combining.
    #[tokio::test]
    async fn a_table_whose_keys_never_repeat_stops_combining_within_its_first_round() {
        let shape = shape();
        for (keys, combining) in [(u64::MAX, false), (1_000, true)] {
            // A budget no round of this test fills.
            let mut spool = Spool::new(1 << 30).unwrap();
            let n = EARLY_CHANGES + 100;
            let mut late = Vec::new();
            for seq in 1..=n {
                let id = (seq % keys) as i64;
                let c = change(ChangeOp::Upsert, seq, id, Cell::Null, None);
                if seq <= EARLY_CHANGES {
                    spool_change(&mut spool, &shape, &c).await;
                } else {
                    // Their rows come after a round is written, as those of
                    // a history buffer still being encoded would.
                    spool.push(&shape, &c).await.unwrap();
                    late.push(c);
                }
                if seq == EARLY_CHANGES - 1 {
                    assert!(!spool.takes_rows("public.t"), "{keys} keys");
                }
            }
            assert_eq!(spool.rounds, 0, "no round was written");
            assert_eq!(spool.takes_rows("public.t"), !combining, "{keys} keys");
            spool.flush().await.unwrap();
            if !combining {
                spool
                    .push_rows("public.t", rows_of(&shape, &late))
                    .await
                    .unwrap();
            }
            spool.finish().await.unwrap();
            let seqs = spooled_seqs(&spool, "public.t");
            // Combined: the last change of each key; else every change.
            let want: Vec<u64> = if combining {
                (n - 999..=n).collect()
            } else {
                (1..=n).collect()
            };
            assert!(
                seqs == want,
                "{keys} keys: {} rows came back, {} expected, the last {:?}",
                seqs.len(),
                want.len(),
                seqs.last()
            );
        }
    }

    /// Rows that come in buffers straddling the switch from combining to
    /// change by change are spooled once: those pushed one by one before
    /// it are dropped from the buffer, the rest kept.
    #[tokio::test]
    async fn a_buffer_across_the_switch_to_change_by_change_is_spooled_once() {
        let shape = shape();
        for buffer in [2, 3, 7] {
            let mut spool = Spool::new(0).unwrap();
            let mut held = Vec::new();
            for seq in 1..=40u64 {
                if seq == 11 {
                    spool.flush().await.unwrap();
                    spool.tables.get_mut("public.t").unwrap().stop_combining();
                }
                let c = change(ChangeOp::Upsert, seq, seq as i64, Cell::Null, None);
                spool.push(&shape, &c).await.unwrap();
                held.push(c);
                if held.len() == buffer {
                    let rows = rows_of(&shape, &std::mem::take(&mut held));
                    spool.push_rows("public.t", rows).await.unwrap();
                }
            }
            spool
                .push_rows("public.t", rows_of(&shape, &held))
                .await
                .unwrap();
            spool.finish().await.unwrap();
            let seqs = spooled_seqs(&spool, "public.t");
            assert_eq!(seqs, (1..=40).collect::<Vec<u64>>(), "buffers of {buffer}");
        }
    }

    /// Whether the table combines its changes or they come in batches.
    #[tokio::test]
    async fn every_change_comes_back_once_in_its_bucket() {
        for combining in [true, false] {
            every_change_comes_back_once(combining).await;
        }
    }

    async fn every_change_comes_back_once(combining: bool) {
        let shape = shape();
        let mut spool = Spool::new(0).unwrap();
        let mut seq = 0;
        let mut next = || {
            seq += 1;
            seq
        };
        for id in 0..300 {
            let c = change(ChangeOp::Upsert, next(), id, Cell::Str("x".into()), None);
            spool_change(&mut spool, &shape, &c).await;
            if id == 0 && !combining {
                spool.flush().await.unwrap();
                spool.tables.get_mut("public.t").unwrap().stop_combining();
            }
            if id == 150 {
                spool.flush().await.unwrap(); // a second round
                let c = change(ChangeOp::Truncate, next(), 0, Cell::Null, None);
                spool_change(&mut spool, &shape, &c).await;
            }
        }
        let c = change(ChangeOp::Upsert, next(), 7, Cell::Absent, Some(299));
        spool_change(&mut spool, &shape, &c).await;
        spool.finish().await.unwrap();
        assert_eq!(spool.table("public.t").unwrap().combining, combining);
        for buckets in [1, 4, 32, 128] {
            let mut seen = Vec::new();
            let mut moves = 0;
            for b in 0..buckets {
                let mut truncates = 0;
                for file in spool.rounds("public.t") {
                    for step in read_steps(&spool, "public.t", file, b, buckets) {
                        match step {
                            Step::Change(c) if c.op == ChangeOp::Truncate => truncates += 1,
                            Step::Change(c) => {
                                assert_eq!(bucket_of(c.key.as_deref().unwrap(), buckets), b);
                                seen.push(c.seq);
                                if c.seq == 302 {
                                    assert_eq!(c.cells, [Cell::Int(7), Cell::Absent]);
                                }
                            }
                            Step::MoveOut {
                                from,
                                to,
                                carry,
                                seq,
                            } => {
                                assert_eq!(bucket_of(&from, buckets), b);
                                assert_eq!(
                                    (from.as_str(), to.as_str(), carry, seq),
                                    (r#"{"id":299}"#, r#"{"id":7}"#, true, 302)
                                );
                                moves += 1;
                            }
                        }
                    }
                }
                // A copy in each partition the bucket reads.
                let copies = (PARTITIONS / buckets).max(1);
                assert_eq!(truncates, copies, "bucket {b} of {buckets} is truncated");
            }
            seen.sort();
            let expected: Vec<u64> = (1..=302).filter(|s| *s != 152).collect();
            assert_eq!(seen, expected, "{buckets} buckets, combining {combining}");
            assert_eq!(moves, 1, "one move-out, {buckets} buckets");
        }
    }
}
