//! The write stage of a compaction run: every file the run commits, none
//! of them visible yet. The plan's objects are read ahead and typed (see
//! [`super::reader`]); each table's changes go to its history file of the
//! planned group and to the spool, from which the new latest view is
//! merged a bucket of keys at a time; history files of a column's
//! narrower type are copied in the wider one. Every file name holds the
//! run's id, so a run never writes over a file a snapshot names or another
//! run is about to commit.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::Arc;

use datafusion::prelude::SessionContext;
use futures::{StreamExt, TryStreamExt};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use parquet::file::properties::WriterProperties;

use super::history::{self, HistoryFile};
use super::latest::{self, MergeInput, merge_bucket};
use super::parquet_file;
use super::plan::{Plan, Tables};
use super::reader::read_ahead;
use super::rewrite;
use super::spool::{self, Spool};
use super::summary::Summary;
use super::task::Task;
use crate::config::CompactConfig;
use crate::lakehouse::delta::DataFile;
use crate::lakehouse::{compacted, layout, read};
use crate::{Error, Result};

/// Where and how a run writes its files.
pub(crate) struct Files<'a> {
    pub output: parquet_file::Output,
    /// The archive's prefix in the store.
    pub prefix: Option<&'a str>,
    /// In every file name the run writes.
    pub run_id: &'a str,
    pub props: WriterProperties,
    pub config: &'a CompactConfig,
}

/// What the write stage wrote, by table, for the commit stage.
#[derive(Default)]
pub(crate) struct Written {
    /// The new history files, as the history's log adds them.
    pub history: BTreeMap<String, Vec<DataFile>>,
    /// Copies of the earlier history files in the wider types, and the
    /// files they replace (see [`super::rewrite`]).
    pub rewritten: BTreeMap<String, (Vec<DataFile>, Vec<String>)>,
    /// The new latest view (its files and their bucket count) of each
    /// keyed table that changed or has none yet.
    pub latest: BTreeMap<String, (Vec<DataFile>, u32)>,
}

/// Writes every file of the run: the history, the latest view, and the
/// rewritten history.
pub(crate) async fn write(
    files: &Files<'_>,
    ctx: &SessionContext,
    plan: &Plan,
    tables: &Tables,
    summary: &mut Summary,
) -> Result<Written> {
    let started = std::time::Instant::now();
    let mut spool = Spool::new(files.config.merge_bytes)?;
    let history = write_history(files, plan, tables, &mut spool, summary).await?;
    tracing::debug!(elapsed = ?started.elapsed(), "read and wrote the history");
    spool.finish().await?;
    tracing::debug!(elapsed = ?started.elapsed(), "spool written");
    let latest = write_latest(files, ctx, plan, tables, Arc::new(spool), summary).await?;
    let rewritten = rewrite_widened(files, plan, tables, summary).await?;
    Ok(Written {
        history,
        rewritten,
        latest,
    })
}

/// Reads the plan's objects and writes each table's history file of each
/// planned group, handing each table's changes to the spool.
async fn write_history(
    files: &Files<'_>,
    plan: &Plan,
    tables: &Tables,
    spool: &mut Spool,
    summary: &mut Summary,
) -> Result<BTreeMap<String, Vec<DataFile>>> {
    let shapes = &tables.shapes;
    let bar = progress_bar(summary.bytes_in);
    // By table index (see line::Shapes): no lookup by name per change.
    let starts: Arc<[u64]> = (0..shapes.len())
        .map(|i| tables.start(&shapes.shape(i).table))
        .collect();
    let mut adds: BTreeMap<String, Vec<DataFile>> = BTreeMap::new();
    let mut objects = read_ahead(&files.output.store, plan, shapes, &starts);
    for file in &plan.files {
        let mut open: Vec<Option<HistoryFile>> = (0..shapes.len()).map(|_| None).collect();
        for object in &file.objects {
            bar.set_message(
                object
                    .key
                    .rsplit('/')
                    .next()
                    .unwrap_or_default()
                    .to_string(),
            );
            let parsed = objects
                .recv()
                .await
                .unwrap_or_else(|| Err(Error::bug("the archive reader stopped early")))?;
            // Repeats of changes compacted from an earlier object.
            summary.repeats += parsed.repeats;
            for read::TableChanges { table, batch, rows } in parsed.tables {
                let (shape, start) = (shapes.shape(table), starts[table]);
                match rows {
                    // Read while the table's spool combined, and it still does.
                    Some(rows) if !spool.takes_rows(&shape.table) => {
                        for change in rows {
                            spool.push(shape, &Arc::new(change)).await?;
                        }
                    }
                    _ => spool.count(shape, &batch.counts)?,
                }
                summary.changes += batch.len() as u64;
                let hist = match &mut open[table] {
                    Some(hist) => hist,
                    slot @ None => {
                        let key = layout::history_key(
                            files.prefix,
                            shape,
                            &file.date,
                            file.first_seq.max(start),
                            file.last_seq,
                            files.run_id,
                        );
                        let props = files.props.clone();
                        let shape = Arc::clone(shape);
                        slot.insert(HistoryFile::create(&files.output, key, shape, props)?)
                    }
                };
                let wants_rows = || spool.takes_rows(&shape.table);
                if let Some(rows) = hist.push(batch, wants_rows).await? {
                    spool.push_rows(&shape.table, rows).await?;
                }
                if spool.takes_rows(&shape.table) && shapes.combines(table) {
                    // Objects read from now on need no typed rows.
                    shapes.stop_combining(table);
                }
            }
            bar.inc(object.size);
        }
        // Each table's file of the group, in name order (deterministic).
        let mut open: Vec<HistoryFile> = open.into_iter().flatten().collect();
        open.sort_by(|a, b| a.shape.table.cmp(&b.shape.table));
        for hist in open {
            let table = hist.shape.table.clone();
            let dir = layout::table_dir(files.prefix, "parquet", &hist.shape);
            let (key, rows, bytes, spooled) = hist.finish(spool.takes_rows(&table)).await?;
            for batch in spooled {
                spool.push_rows(&table, batch).await?;
            }
            summary.history_files += 1;
            summary.history_bytes += bytes;
            adds.entry(table).or_default().push(DataFile {
                path: layout::relative(&dir, &key)?,
                size: bytes,
                rows,
                date: Some(file.date.clone()),
            });
        }
    }
    bar.finish_and_clear();
    Ok(adds)
}

/// Buckets of a latest view merged at once.
const MERGERS: usize = 2;

/// The new latest view of every keyed table that changed, or that has none
/// yet, merged from its previous view and the spool bucket by bucket.
async fn write_latest(
    files: &Files<'_>,
    ctx: &SessionContext,
    plan: &Plan,
    tables: &Tables,
    spool: Arc<Spool>,
    summary: &mut Summary,
) -> Result<BTreeMap<String, (Vec<DataFile>, u32)>> {
    let started = std::time::Instant::now();
    let target = latest::LatestTarget {
        output: files.output.clone(),
        prefix: files.prefix.map(str::to_string),
        generation: format!("{:020}.{}", plan.to_seq, files.run_id),
        props: files.props.clone(),
        file_bytes: files.config.file_bytes,
    };
    let mut views = BTreeMap::new();
    for table in &plan.tables {
        let shape = &tables.shapes[table];
        let entry = tables.entries.get(table).cloned().unwrap_or_default();
        let spooled = spool.table(table);
        let unchanged = spooled.is_none() && tables.widened[table].is_empty();
        if shape.key.is_empty() || (unchanged && tables.compacted[table].latest.is_some()) {
            // No key (REPLICA IDENTITY NOTHING): a history only. Or no
            // change, in values or in types.
            continue;
        }
        let buckets = bucket_count(&entry, spooled, files.config.merge_bytes);
        // Buckets are merged and written MERGERS at a time, each on a task
        // of its own (memory holds that many buckets); one at a time when
        // an update carried values across buckets, which would otherwise
        // cost replays (see MergeInput::moved).
        let mergers = if spooled.is_some_and(|s| s.counts.carried_moves > 0) {
            1
        } else {
            MERGERS
        };
        let input = Arc::new(MergeInput {
            ctx: ctx.clone(),
            shape: Arc::clone(shape),
            previous: entry.latest.clone(),
            previous_buckets: entry.bucket_count(),
            spool: Arc::clone(&spool),
            buckets,
            moved: Default::default(),
        });
        let merged: Vec<Vec<latest::WrittenFile>> = futures::stream::iter(0..buckets)
            .map(|bucket| {
                let (input, target) = (Arc::clone(&input), target.clone());
                let task = Task::spawn(async move {
                    let view = merge_bucket(&input, bucket, None).await?;
                    view.write_bucket(&target, bucket, false).await
                });
                async move { task.join("a latest view merge").await? }
            })
            .buffered(mergers)
            .try_collect()
            .await?;
        let mut written: Vec<latest::WrittenFile> = merged.into_iter().flatten().collect();
        if written.is_empty() {
            // An empty table still gets one file, so readers find its columns.
            let empty = latest::LatestView::empty(Arc::clone(shape));
            written = empty.write_bucket(&target, buckets - 1, true).await?;
        }
        summary.latest_files += written.len();
        summary.latest_rows += written.iter().map(|f| f.rows).sum::<u64>();
        summary.latest_bytes += written.iter().map(|f| f.bytes).sum::<u64>();
        let dir = layout::table_dir(files.prefix, "latest", shape);
        let adds = written
            .iter()
            .map(|f| {
                Ok(DataFile {
                    path: layout::relative(&dir, &f.key)?,
                    size: f.bytes,
                    rows: f.rows,
                    date: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        views.insert(table.clone(), (adds, buckets));
        tracing::debug!(%table, buckets, elapsed = ?started.elapsed(), "merged the latest view");
    }
    Ok(views)
}

/// Copies in the wider types of the earlier history files of each table
/// whose column types widened and whose history the run commits (see
/// [`super::rewrite`]), with the files they replace.
async fn rewrite_widened(
    files: &Files<'_>,
    plan: &Plan,
    tables: &Tables,
    summary: &mut Summary,
) -> Result<BTreeMap<String, (Vec<DataFile>, Vec<String>)>> {
    let mut rewritten = BTreeMap::new();
    for table in &plan.tables {
        let (c, widened) = (&tables.compacted[table], &tables.widened[table]);
        let Some(h) = c.history.as_ref() else {
            continue;
        };
        if widened.is_empty() || !c.history_behind(plan.to_seq) {
            continue;
        }
        // Files of a stopped run are replaced by this run's anyway.
        let replaced = c.stopped_run_files(tables.start(table));
        let earlier: Vec<DataFile> = h
            .files
            .iter()
            .filter(|f| !replaced.contains(&f.path))
            .cloned()
            .collect();
        tracing::info!(%table, files = earlier.len(), columns = ?widened, "rewriting the history in the wider types");
        let history_props = history::history_properties(files.props.clone());
        let copies = rewrite::rewrite_history(
            &files.output,
            files.prefix,
            &tables.shapes[table],
            &earlier,
            files.run_id,
            &history_props,
        )
        .await?;
        summary.rewritten += copies.len();
        let originals = earlier.into_iter().map(|f| f.path).collect();
        rewritten.insert(table.clone(), (copies, originals));
    }
    Ok(rewritten)
}

/// Most buckets a latest view is split into.
const MAX_BUCKETS: u32 = 1 << 16;

/// The buckets of a table's new latest view: enough that one holds about
/// `merge_bytes` (estimated from the rows the view may have: the previous
/// ones plus every upsert of the run, at the upserts' average size), a
/// power of two, and never fewer than before.
fn bucket_count(
    entry: &compacted::TableEntry,
    spooled: Option<&spool::TableSpool>,
    merge_bytes: u64,
) -> u32 {
    let (upserts, upsert_bytes) =
        spooled.map_or((0, 0), |s| (s.counts.upserts, s.counts.upsert_bytes));
    let per_row = upsert_bytes.checked_div(upserts).unwrap_or(256);
    let estimate = (entry.latest_rows + upserts).saturating_mul(per_row);
    let wanted = estimate
        .div_ceil(merge_bytes.max(1))
        .clamp(1, MAX_BUCKETS as u64) as u32;
    wanted.next_power_of_two().max(entry.bucket_count())
}

/// The read's progress on stderr, when it is a terminal.
fn progress_bar(total: u64) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:32} [{bar:30}] {binary_bytes}/{binary_total_bytes}  {binary_bytes_per_sec}  ETA {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar
}
