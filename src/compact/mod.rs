//! `waltail compact`: the NDJSON archive rewritten as Delta Lake tables
//! that Spark, Trino, Athena, DuckDB and polars read: per source table a
//! history of every change (partitioned by date) and a latest-row view,
//! incrementally and exactly once.
//!
//! A run is plan, write, commit; the tables' format (reading archive
//! lines, the columns, the Delta logs) is [`crate::lakehouse`]'s, which
//! query reads with:
//!
//! ```text
//! plan:   lakehouse::compacted (each table's two Delta logs: where it continues,
//!             its columns) + archive::listing (objects, schema records)
//!         --> plan (what is new, grouped into files)
//! write:  lakehouse::read (NDJSON lines -> typed changes -> Arrow batches per table)
//!         --> history (Parquet per table and date)  +  spool, latest (merge, new
//!             generation)  [+ rewrite: earlier history files again, when a
//!             column's type widened]
//! commit: commit (per table: the history's Delta commit, then the latest view's;
//!             vacuum)
//! ```
//!
//! Every file a run writes has a name of its own (the run's id is in it),
//! and nothing is visible until the commit that names it. Each commit
//! carries the last seq compacted as a Delta `txn` version, and a run
//! starts from the one its table's logs record: a run stopped at any point
//! is redone by the next one, and no change is compacted twice (see
//! [`plan`] and [`commit::commit`]).

pub mod commit;
pub mod history;
pub mod latest;
pub(crate) mod plan;
pub(crate) mod rewrite;
pub mod spool;
mod task;
pub(crate) mod upgrade;

use std::collections::{BTreeMap, BTreeSet};
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use object_store::ObjectStore;

use self::history::HistoryFile;
use self::latest::{MergeInput, merge_bucket};
use self::plan::{Plan, plan_files};
use self::task::Task;
use crate::archive::listing;
use crate::archive::schema::SchemaRecord;
use crate::config::Config;
use crate::error::ErrorKind;
use crate::lakehouse::compacted::{self, Compacted};
use crate::lakehouse::delta::{self, Location, Role};
use crate::lakehouse::typing::TableShape;
use crate::lakehouse::{layout, line, read, session};
use crate::sink::Sink;
use crate::{Error, Result};

/// What to compact.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Only list what a run would do.
    pub dry_run: bool,
    /// `schema.table` names; all tables with schema records when empty.
    pub tables: Vec<String>,
    /// Only vacuum the tables (see [`vacuum_tables`]), compact nothing.
    pub vacuum: bool,
}

/// How old a file that no commit names must be before `--vacuum` deletes
/// it: older than any run still writing can be (a run writes its files
/// before it commits them).
pub const UNNAMED_AFTER: Duration = Duration::from_secs(86_400);

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub objects: usize,
    pub bytes_in: u64,
    pub seqs: Option<(u64, u64)>,
    pub changes: u64,
    /// Changes skipped because their seq was already compacted (an object
    /// written twice under different names).
    pub repeats: u64,
    /// Objects left out because another object holds all their changes.
    pub repeated_objects: usize,
    pub history_files: usize,
    pub history_bytes: u64,
    pub latest_files: usize,
    pub latest_rows: u64,
    pub latest_bytes: u64,
    pub tables: BTreeSet<String>,
    /// Files vacuum deleted (see [`vacuum_tables`]).
    pub vacuumed: usize,
    /// History files written again in a column's wider type (see [`rewrite`]).
    pub rewritten: usize,
    /// Delta commits written, and the time they took.
    pub commits: usize,
    pub commit_time: Duration,
    /// The first seq not in the archive when a gap stopped the run.
    pub gap: Option<u64>,
    pub elapsed: Duration,
}

/// Compacts what is new in the archive (see the module doc). Runs on
/// different tables go on side by side; of two on the same table, the
/// second to commit stops and says so (see [`commit::commit`]).
pub async fn compact(config: &Config, opts: &Options) -> Result<Summary> {
    let started = Instant::now();
    let sink = Sink::with_retry(
        &config.destination,
        config.delivery.request_timeout,
        crate::lakehouse::store_retry(),
    )?;
    run(config, opts, &sink, started).await
}

async fn run(config: &Config, opts: &Options, sink: &Sink, started: Instant) -> Result<Summary> {
    let store = Arc::clone(sink.store());
    let prefix = sink.prefix();
    let loc = Location::new(&config.destination, &store)?;
    let schemas = listing::load_schemas(store.as_ref(), prefix).await?;
    if opts.dry_run && upgrade::pending(store.as_ref(), prefix).await? {
        return Err(Error::fatal(
            "this archive was compacted by an earlier release (it has _waltail/compaction/manifest.json): a dry run cannot say what the first run of this one does",
            "run `waltail compact` once: it writes the Delta logs for the files already compacted (nothing is rewritten) and compacts what is new",
        ));
    }
    // Every table the old manifest knows, not only the selected ones: it
    // is deleted once they all have their logs.
    upgrade::upgrade(&store, prefix, &loc, &config.pipeline, &schemas).await?;
    let selected: Vec<String> = select_tables(&schemas, &opts.tables)?.into_iter().collect();
    let records = |t: &str| schemas.get(t).map(Vec::as_slice).unwrap_or_default();
    let newest: Vec<TableShape> = selected
        .iter()
        .map(|t| TableShape::from_records(t, records(t)))
        .collect();
    if opts.vacuum {
        let what = commit::Vacuum {
            replaced_after: config.compact.retain,
            unnamed_after: Some(UNNAMED_AFTER),
        };
        let summary = Summary {
            vacuumed: vacuum_tables(&loc, &newest, what).await?,
            tables: selected.into_iter().collect(),
            elapsed: started.elapsed(),
            ..Summary::default()
        };
        return Ok(summary);
    }
    // Each table's two logs: where it continues, its columns and files.
    let compacted: BTreeMap<String, Compacted> = futures::future::try_join_all(
        newest
            .iter()
            .map(|shape| Compacted::load(&loc, &config.pipeline, shape)),
    )
    .await?
    .into_iter()
    .zip(&selected)
    .map(|(c, t)| (t.clone(), c))
    .collect();
    let entries: BTreeMap<String, compacted::TableEntry> = newest
        .iter()
        .map(|shape| {
            (
                shape.table.clone(),
                compacted[&shape.table].entry(shape, prefix),
            )
        })
        .collect();

    let mut summary = Summary::default();
    // The whole archive, not only the date folders a query lists: if the
    // source's clock stepped back, objects newer than the last compacted
    // one sit in earlier folders, and a run must find them rather than
    // report nothing new. Listing costs one request per 1,000 objects,
    // little next to reading them.
    let objects = listing::list_objects(store.as_ref(), prefix, &config.pipeline).await?;
    // The earliest seq any selected table still needs.
    let from = newest
        .iter()
        .map(|shape| compacted[&shape.table].next_seq(!shape.key.is_empty()))
        .collect::<Option<Vec<u64>>>()
        .and_then(|starts| starts.into_iter().min());
    let planned = plan_files(&objects, from, config.compact.file_bytes);
    summary.gap = planned.gap;
    let (Some(first), Some(last)) = (planned.files.first(), planned.files.last()) else {
        summary.elapsed = started.elapsed();
        return Ok(summary);
    };
    let plan = Plan {
        from_seq: first.first_seq,
        to_seq: last.last_seq,
        tables: selected.clone(),
        files: planned.files.clone(),
        repeated: planned.repeated,
    };
    let shapes = shapes(&schemas, &plan.tables, &entries)?;
    // Each table's columns whose type widened since its history was
    // written: its earlier files are rewritten (see `rewrite`).
    let widened: BTreeMap<String, Vec<String>> = plan
        .tables
        .iter()
        .map(|t| {
            let written = entries
                .get(t)
                .map(|e| e.columns.as_slice())
                .unwrap_or_default();
            (t.clone(), rewrite::widened(written, &shapes[t]))
        })
        .collect();
    summary.seqs = Some((plan.from_seq, plan.to_seq));
    summary.objects = plan.files.iter().map(|f| f.objects.len()).sum();
    summary.bytes_in = plan
        .files
        .iter()
        .flat_map(|f| &f.objects)
        .map(|o| o.size)
        .sum();
    summary.tables = plan.tables.iter().cloned().collect();
    summary.repeated_objects = plan.repeated.len();
    if opts.dry_run {
        summary.elapsed = started.elapsed();
        return Ok(summary);
    }
    // In every file name: a run never writes over a file that a snapshot
    // names, or that another run on the same table is about to commit.
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();

    let bar = progress_bar(summary.bytes_in);
    let props = history::writer_properties(&config.compact);
    let output = history::Output {
        store: Arc::clone(&store),
        parts: sink.multipart().cloned(),
    };
    let ctx = session::session(Arc::clone(&store));
    let mut spool = spool::Spool::new(config.compact.merge_bytes)?;
    let shapes = Arc::new(shapes);
    // By table index (see line::Shapes): no lookup by name per change.
    let starts: Arc<[u64]> = (0..shapes.len())
        .map(|i| {
            entries
                .get(&shapes.shape(i).table)
                .map_or(0, |e| e.next_seq)
        })
        .collect();
    // Each table's new history files, as the history's log adds them.
    let mut history_adds: BTreeMap<String, Vec<delta::DataFile>> = BTreeMap::new();
    let mut objects = read_ahead(&store, &plan, &shapes, &starts);
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
                            prefix,
                            shape,
                            &file.date,
                            file.first_seq.max(start),
                            file.last_seq,
                            &run_id,
                        );
                        let props = props.clone();
                        slot.insert(HistoryFile::create(&output, key, Arc::clone(shape), props)?)
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
            let dir = layout::table_dir(prefix, "parquet", &hist.shape);
            let (key, rows, bytes, spooled) = hist.finish(spool.takes_rows(&table)).await?;
            for batch in spooled {
                spool.push_rows(&table, batch).await?;
            }
            summary.history_files += 1;
            summary.history_bytes += bytes;
            history_adds
                .entry(table)
                .or_default()
                .push(delta::DataFile {
                    path: relative(&dir, &key)?,
                    size: bytes,
                    rows,
                    date: Some(file.date.clone()),
                });
        }
    }
    bar.finish_and_clear();
    tracing::debug!(elapsed = ?started.elapsed(), "read and wrote the history");

    spool.finish().await?;
    let spool = Arc::new(spool);
    tracing::debug!(elapsed = ?started.elapsed(), "spool written");

    // The new latest view of every keyed table that changed, or that has
    // none yet, merged bucket by bucket.
    let target = latest::LatestTarget {
        output: output.clone(),
        prefix: prefix.map(str::to_string),
        generation: format!("{:020}.{run_id}", plan.to_seq),
        props: props.clone(),
        file_bytes: config.compact.file_bytes,
    };
    let mut latest_writes: BTreeMap<String, (Vec<latest::WrittenFile>, u32)> = BTreeMap::new();
    for table in &plan.tables {
        let shape = &shapes[table];
        let entry = entries.get(table).cloned().unwrap_or_default();
        let spooled = spool.table(table);
        let unchanged = spooled.is_none() && widened[table].is_empty();
        if shape.key.is_empty() || (unchanged && compacted[table].latest.is_some()) {
            // No key (REPLICA IDENTITY NOTHING): a history only. Or no
            // change, in values or in types.
            continue;
        }
        let buckets = bucket_count(&entry, spooled, config.compact.merge_bytes);
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
        let mut files: Vec<latest::WrittenFile> = merged.into_iter().flatten().collect();
        if files.is_empty() {
            // An empty table still gets one file, so readers find its columns.
            let empty = latest::LatestView::empty(Arc::clone(shape));
            files = empty.write_bucket(&target, buckets - 1, true).await?;
        }
        summary.latest_files += files.len();
        summary.latest_rows += files.iter().map(|f| f.rows).sum::<u64>();
        summary.latest_bytes += files.iter().map(|f| f.bytes).sum::<u64>();
        latest_writes.insert(table.clone(), (files, buckets));
        tracing::debug!(%table, buckets, elapsed = ?started.elapsed(), "merged the latest view");
    }
    drop(spool);

    // The commits: per table the history, then the latest view (so a
    // latest view never holds a change its history lacks; a run stopped in
    // between is redone from the latest view's seq, and the history's files
    // from there are replaced).
    let last_date = plan.files.last().map(|f| f.date.clone());
    let commits_started = Instant::now();
    for table in &plan.tables {
        let shape = &shapes[table];
        let c = &compacted[table];
        let app = delta::app_id(&config.pipeline, table);
        let dir = compacted::table_folder(shape);
        let start = entries.get(table).map_or(0, |e| e.next_seq);
        let info = || {
            vec![
                (
                    "waltail.pipeline".to_string(),
                    config.pipeline.clone().into(),
                ),
                (
                    "waltail.fromSeq".to_string(),
                    start.max(plan.from_seq).into(),
                ),
                ("waltail.run".to_string(), run_id.clone().into()),
            ]
        };
        let history_done = c.history.as_ref().and_then(|h| h.seq).unwrap_or(0);
        if c.history.is_none() || history_done < plan.to_seq {
            // Files of a run stopped before its latest commit: replaced.
            let mut removes: Vec<String> = match &c.history {
                Some(h) if h.seq.is_some_and(|s| s >= start) => h
                    .files
                    .iter()
                    .filter(|f| compacted::history_first_seq(&f.path).is_some_and(|s| s >= start))
                    .map(|f| f.path.clone())
                    .collect(),
                _ => Vec::new(),
            };
            let mut adds = history_adds.remove(table).unwrap_or_default();
            // Files in a column's narrower type: replaced by copies in the
            // wider one (see `rewrite`).
            if let Some(h) = c.history.as_ref().filter(|_| !widened[table].is_empty()) {
                let earlier: Vec<delta::DataFile> = h
                    .files
                    .iter()
                    .filter(|f| !removes.contains(&f.path))
                    .cloned()
                    .collect();
                tracing::info!(%table, files = earlier.len(), columns = ?widened[table], "rewriting the history in the wider types");
                let history_props = history::history_properties(props.clone());
                let copies = rewrite::rewrite_history(
                    &output,
                    prefix,
                    shape,
                    &earlier,
                    &run_id,
                    &history_props,
                )
                .await?;
                summary.rewritten += copies.len();
                removes.extend(earlier.into_iter().map(|f| f.path));
                adds.extend(copies);
            }
            let txns = compacted::date_txns(&app, last_date.as_deref());
            commit::commit(
                &loc,
                &dir,
                c.history.as_ref(),
                commit::Commit {
                    shape,
                    role: Role::History,
                    app_id: &app,
                    seq: plan.to_seq,
                    adds,
                    removes,
                    buckets: 1,
                    info: info(),
                    txns,
                },
            )
            .await?;
            summary.commits += 1;
        }
        if shape.key.is_empty() {
            continue;
        }
        let (adds, removes, buckets) = match latest_writes.remove(table) {
            Some((files, buckets)) => {
                let latest_dir = layout::table_dir(prefix, "latest", shape);
                let adds = files
                    .iter()
                    .map(|f| {
                        Ok(delta::DataFile {
                            path: relative(&latest_dir, &f.key)?,
                            size: f.bytes,
                            rows: f.rows,
                            date: None,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let removes = c
                    .latest
                    .as_ref()
                    .map(|l| l.files.iter().map(|f| f.path.clone()).collect())
                    .unwrap_or_default();
                (adds, removes, buckets)
            }
            // No change: the commit only moves the txn on.
            None => (
                Vec::new(),
                Vec::new(),
                c.latest.as_ref().map_or(1, |l| l.buckets),
            ),
        };
        commit::commit(
            &loc,
            &dir,
            c.latest.as_ref(),
            commit::Commit {
                shape,
                role: Role::Latest,
                app_id: &app,
                seq: plan.to_seq,
                adds,
                removes,
                buckets,
                info: info(),
                txns: Vec::new(),
            },
        )
        .await?;
        summary.commits += 1;
    }
    summary.commit_time = commits_started.elapsed();
    if config.compact.vacuum {
        let committed: Vec<TableShape> = plan
            .tables
            .iter()
            .map(|t| shapes[t].as_ref().clone())
            .collect();
        let what = commit::Vacuum {
            replaced_after: config.compact.retain,
            unnamed_after: None,
        };
        summary.vacuumed = vacuum_tables(&loc, &committed, what).await?;
    }
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// Vacuums the history and latest view of each of `tables` (see
/// [`commit::vacuum`]), a few at a time; returns the files deleted.
pub async fn vacuum_tables(
    loc: &Location,
    tables: &[TableShape],
    what: commit::Vacuum,
) -> Result<usize> {
    let vacuums = tables.iter().flat_map(|shape| {
        let dir = compacted::table_folder(shape);
        [Role::History, Role::Latest].map(move |role| {
            let dir = dir.clone();
            async move { commit::vacuum(loc, role, &dir, what).await }
        })
    });
    let deleted: Vec<usize> = futures::stream::iter(vacuums)
        .buffer_unordered(delta::LOG_CALLS)
        .try_collect()
        .await?;
    Ok(deleted.into_iter().sum())
}

/// `key` relative to the table folder `dir` (both under the prefix).
fn relative(dir: &str, key: &str) -> Result<String> {
    key.strip_prefix(dir)
        .and_then(|k| k.strip_prefix('/'))
        .map(str::to_string)
        .ok_or_else(|| Error::bug(format!("{key} is not in {dir}")))
}

/// Buckets of a latest view merged at once.
const MERGERS: usize = 2;

/// Parsed groups (see [`GROUP_BYTES`]) waiting for the writer beside the
/// one it is taking objects from.
const READ_AHEAD: usize = 2;

/// Groups of objects fetched and parsed at once, each group's parse a task
/// of its own, so the NDJSON parse (a third of compact's CPU) uses every
/// core the history and spool writers leave free; their order is kept. On
/// the runtime's workers, not blocking threads: those would add runnable
/// threads beyond the cores, which measured 10-15% slower (a parse of
/// 10,000 lines holds a worker for ~30 ms; nothing in compact needs a lower
/// latency).
const PARSERS: usize = 2;

/// Consecutive objects are fetched and parsed as one group up to this many
/// bytes (a larger object is a group of its own): an archive of small
/// objects (a quiet source writes a few lines per object) costs one parse
/// task per group, not per object, and its GETs overlap (see [`FETCHES`]).
const GROUP_BYTES: u64 = 1 << 20;

/// GETs in flight within a group: objects of a few KiB are latency-bound
/// on S3, where two at a time (one per parser) would leave the run waiting
/// on round trips.
const FETCHES: usize = 16;

/// The plan's objects (key, first seq to compact) in plan order, cut into
/// groups of consecutive objects of at most [`GROUP_BYTES`] together (or
/// one larger object).
fn object_groups(plan: &Plan) -> Vec<Vec<(String, u64)>> {
    let mut groups: Vec<Vec<(String, u64)>> = Vec::new();
    let mut bytes = 0;
    for o in plan.files.iter().flat_map(|f| &f.objects) {
        let object = (o.key.clone(), o.from_seq);
        match groups.last_mut() {
            Some(group) if bytes + o.size <= GROUP_BYTES => {
                bytes += o.size;
                group.push(object);
            }
            _ => {
                bytes = o.size;
                groups.push(vec![object]);
            }
        }
    }
    groups
}

/// Reads and types the plan's objects, in plan order, [`PARSERS`] groups at
/// a time (see [`GROUP_BYTES`]); up to [`READ_AHEAD`] parsed groups wait
/// for the writer (so memory holds up to `READ_AHEAD + PARSERS + 1`
/// groups); stops when the receiver is dropped.
///
/// A group is fetched and parsed on one task, which goes on whether or not
/// the writer is taking groups; objects are handed over a group at a time.
/// Before, objects went one by one through a channel of four and the
/// fetches were driven by the loop that fed it: with objects of 100 lines
/// the channel was always full and the next group's GETs waited on it
/// (the run used 1.5-1.8 of its 2 cores).
fn read_ahead(
    store: &Arc<dyn ObjectStore>,
    plan: &Plan,
    shapes: &Arc<line::Shapes>,
    starts: &Arc<[u64]>,
) -> ReadAhead {
    let (tx, rx) = tokio::sync::mpsc::channel(READ_AHEAD);
    let store = Arc::clone(store);
    let (shapes, starts) = (Arc::clone(shapes), Arc::clone(starts));
    let groups = object_groups(plan);
    let task = Task::spawn(async move {
        let mut parsed = futures::stream::iter(groups)
            .map(|group| {
                let (store, shapes) = (Arc::clone(&store), Arc::clone(&shapes));
                let starts = Arc::clone(&starts);
                Task::spawn(async move {
                    let bodies: Vec<(String, u64, bytes::Bytes)> = futures::stream::iter(group)
                        .map(|(key, from_seq)| {
                            let store = Arc::clone(&store);
                            async move {
                                let body = listing::get_ndjson(store.as_ref(), &key).await?;
                                Ok::<_, Error>((key, from_seq, body))
                            }
                        })
                        .buffered(FETCHES)
                        .try_collect()
                        .await?;
                    bodies
                        .iter()
                        .map(|(key, from_seq, body)| {
                            parse_object(&shapes, &starts, key, *from_seq, body)
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .join("the archive reader")
            })
            .buffered(PARSERS);
        while let Some(group) = parsed.next().await {
            let group = group.and_then(|parsed| parsed);
            let failed = group.is_err();
            if tx.send(group).await.is_err() || failed {
                return;
            }
        }
    });
    ReadAhead {
        rx,
        group: Vec::new().into_iter(),
        _task: task,
    }
}

/// The changes of one object to compact: from seq `from_seq` on, table
/// `i`'s from `starts[i]` on (see [`read::ObjectReader`]); an error names
/// the object and the line.
fn parse_object(
    shapes: &line::Shapes,
    starts: &[u64],
    key: &str,
    from_seq: u64,
    body: &[u8],
) -> Result<read::ObjectChanges> {
    // About one line per 200 bytes.
    let mut reader = read::ObjectReader::new(shapes, from_seq, starts, body.len() / 200 + 1);
    // Checked whole, faster than line by line; an object that is not UTF-8
    // is read line by line, so the error says which line and where.
    let text = std::str::from_utf8(body).ok();
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', body).chain(std::iter::once(body.len()));
    for (n, end) in ends.enumerate() {
        let (start_of_line, line) = (start, &body[start..end]);
        start = end + 1;
        if line.is_empty() {
            continue;
        }
        let typed = match text {
            // Cut at newlines: char boundaries.
            Some(text) => read::type_text_into(shapes, &text[start_of_line..end], reader.spare()),
            None => read::type_line(shapes, line),
        };
        reader.push(typed.map_err(|what| {
            Error::fatal(
                format!("{key} line {}: {what}", n + 1),
                "archive objects are written by `waltail run`; restore this one from a copy, or move it away and compact again",
            )
            .with_kind(ErrorKind::Archive)
        })?);
    }
    Ok(reader.finish())
}

/// The changes of each object, in plan order.
struct ReadAhead {
    rx: tokio::sync::mpsc::Receiver<Result<Vec<read::ObjectChanges>>>,
    /// The objects left of the group being taken.
    group: std::vec::IntoIter<read::ObjectChanges>,
    /// Aborted when the reader is dropped.
    _task: Task<()>,
}

impl ReadAhead {
    async fn recv(&mut self) -> Option<Result<read::ObjectChanges>> {
        loop {
            if let Some(lines) = self.group.next() {
                return Some(Ok(lines));
            }
            match self.rx.recv().await? {
                Ok(group) => self.group = group.into_iter(),
                Err(e) => return Some(Err(e)),
            }
        }
    }
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

/// The tables a run compacts: the named ones (each must have a schema
/// record), or every table with one.
fn select_tables(
    schemas: &BTreeMap<String, Vec<SchemaRecord>>,
    named: &[String],
) -> Result<BTreeSet<String>> {
    if named.is_empty() {
        return Ok(schemas.keys().cloned().collect());
    }
    named
        .iter()
        .map(|t| {
            let t = if t.contains('.') {
                t.clone()
            } else {
                format!("public.{t}")
            };
            if schemas.contains_key(&t) {
                Ok(t)
            } else {
                Err(Error::config(format!(
                    "{t} has no schema record in the archive (_schemas/): name a table this pipeline archives, as schema.table{}",
                    if schemas.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " ({})",
                            schemas.keys().cloned().collect::<Vec<_>>().join(", ")
                        )
                    }
                )))
            }
        })
        .collect()
}

/// The shapes of the run's tables, checked against what earlier runs wrote:
/// a column's type may only widen.
fn shapes(
    schemas: &BTreeMap<String, Vec<SchemaRecord>>,
    tables: &[String],
    compacted: &BTreeMap<String, compacted::TableEntry>,
) -> Result<line::Shapes> {
    let mut out = Vec::new();
    for table in tables {
        let records = schemas.get(table).map(Vec::as_slice).unwrap_or_default();
        let shape = TableShape::from_records(table, records);
        if let Some(entry) = compacted.get(table) {
            for before in &entry.columns {
                let now = shape.columns.iter().find(|c| c.name == before.name);
                let ok = now.is_some_and(|c| before.kind.widen(c.kind) == Some(c.kind));
                if !ok {
                    let now = now.map_or("no column".to_string(), |c| c.kind.describe());
                    return Err(Error::fatal(
                        format!(
                            "{table}.{}: the compacted files hold {}, the archive's schema records now give {now}, and the one cannot be read as the other",
                            before.name,
                            before.kind.describe()
                        ),
                        format!(
                            "compact the table again with the new type: delete parquet/{0}/ and latest/{0}/ (with the '.' as '/'; their Delta logs go with them) and run `waltail compact {table}`",
                            table.replacen('.', "/", 1)
                        ),
                    ));
                }
            }
        }
        out.push(Arc::new(shape));
    }
    Ok(line::Shapes::new(out))
}

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

/// The text `compact` prints.
pub fn render(s: &Summary, dry_run: bool) -> String {
    let mut out = String::new();
    let gap = s.gap.map(|g| {
        format!(
            "seq {g} is not in the archive yet (a batch still uploading, or parked: see `waltail parked list`); the objects after it wait for the next run\n"
        )
    });
    let vacuumed =
        (s.vacuumed > 0).then(|| format!("  vacuumed {} files past compact.retain\n", s.vacuumed));
    let Some((first, last)) = s.seqs else {
        out.push_str("nothing new to compact\n");
        out.push_str(gap.as_deref().unwrap_or_default());
        return out;
    };
    let tables = s.tables.iter().cloned().collect::<Vec<_>>().join(", ");
    if dry_run {
        out.push_str(&format!(
            "would compact {} objects ({}), seqs {first}-{last}, tables {tables}\n",
            s.objects,
            HumanBytes(s.bytes_in),
        ));
    } else {
        out.push_str(&format!(
            "compacted {} objects ({}), seqs {first}-{last}, {} changes in {:.1} s\n",
            s.objects,
            HumanBytes(s.bytes_in),
            s.changes,
            s.elapsed.as_secs_f64(),
        ));
        out.push_str(&format!(
            "  history  {} files, {} changes, {}\n",
            s.history_files,
            s.changes,
            HumanBytes(s.history_bytes)
        ));
        out.push_str(&format!(
            "  latest   {} files, {} rows, {}\n",
            s.latest_files,
            s.latest_rows,
            HumanBytes(s.latest_bytes)
        ));
        if s.repeats > 0 || s.repeated_objects > 0 {
            out.push_str(&format!(
                "  skipped {} objects and {} changes repeating others (the same changes under another name)\n",
                s.repeated_objects, s.repeats
            ));
        }
        out.push_str(&format!(
            "  {:.0} changes/s, {} in -> {} out\n",
            s.changes as f64 / s.elapsed.as_secs_f64().max(1e-3),
            HumanBytes(s.bytes_in),
            HumanBytes(s.history_bytes + s.latest_bytes)
        ));
        if s.rewritten > 0 {
            out.push_str(&format!(
                "  rewrote  {} earlier history files in their columns' wider types\n",
                s.rewritten
            ));
        }
        out.push_str(&format!(
            "  delta    {} commits in {:.2} s\n",
            s.commits,
            s.commit_time.as_secs_f64()
        ));
        out.push_str(vacuumed.as_deref().unwrap_or_default());
    }
    out.push_str(gap.as_deref().unwrap_or_default());
    out
}

#[cfg(test)]
mod tests {
    use object_store::ObjectStoreExt;
    use object_store::path::Path as ObjectPath;

    use super::*;
    use crate::archive::schema::{RecordColumn, SchemaRecord};
    use crate::lakehouse::typing::{Column, Kind};

    /// Small objects are fetched and parsed together, in plan order, up to
    /// a mebibyte a group; an object larger than that is a group alone.
    #[test]
    fn small_objects_are_grouped_in_order_and_a_large_one_stands_alone() {
        let object = |key: &str, size: u64| plan::PlannedObject {
            key: key.into(),
            size,
            from_seq: 0,
        };
        let file = |objects| plan::PlannedFile {
            date: "2026-11-30".into(),
            first_seq: 1,
            last_seq: 1,
            objects,
        };
        let half = GROUP_BYTES / 2;
        let plan = Plan {
            from_seq: 1,
            to_seq: 1,
            tables: Vec::new(),
            // A group goes on across history files: only bytes cut it.
            files: vec![
                file(vec![object("a", half), object("b", half)]),
                file(vec![object("c", 1), object("d", 3 * GROUP_BYTES)]),
                file(vec![object("e", 1), object("f", 1)]),
            ],
            repeated: Vec::new(),
        };
        let groups = object_groups(&plan);
        let keys: Vec<Vec<&str>> = groups
            .iter()
            .map(|g| g.iter().map(|(key, _)| key.as_str()).collect())
            .collect();
        assert_eq!(keys, [vec!["a", "b"], vec!["c"], vec!["d"], vec!["e", "f"]]);
    }

    /// Every object comes back once and whole, in plan order, through
    /// groups of many small objects and groups of one large one; a bad
    /// line stops the reader after the groups before its own, with an
    /// error naming the object and the line.
    #[tokio::test]
    async fn objects_come_back_in_plan_order_and_a_bad_line_stops_the_reader() {
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let shapes = Arc::new(line::Shapes::new([Arc::new(TableShape::test_t())]));
        let line = |seq: u64| {
            format!(
                r#"{{"op":"insert","table":"public.t","data":{{"id":{seq},"doc":"d"}},"old":null,"seq":{seq},"idempotency_key":"k{seq}","commit_lsn":"0/1"}}"#
            ) + "\n"
        };
        // Every tenth object is over a group's size (a group of its own).
        let sizes: Vec<u64> = (0..40)
            .map(|i| if i % 10 == 9 { 9_000 } else { 200 })
            .collect();
        let (mut objects, mut seq) = (Vec::new(), 0);
        for (i, &lines) in sizes.iter().enumerate() {
            let body: String = (0..lines)
                .map(|_| {
                    seq += 1;
                    line(seq)
                })
                .collect();
            let key = format!("o{i:02}");
            let size = body.len() as u64;
            store
                .put(&ObjectPath::from(key.as_str()), body.into())
                .await
                .unwrap();
            objects.push(plan::PlannedObject {
                key,
                size,
                from_seq: 0,
            });
        }
        let plan = |objects: Vec<plan::PlannedObject>| Plan {
            from_seq: 1,
            to_seq: seq,
            tables: vec!["public.t".into()],
            files: vec![plan::PlannedFile {
                date: "2026-11-30".into(),
                first_seq: 1,
                last_seq: seq,
                objects,
            }],
            repeated: Vec::new(),
        };
        let whole = plan(objects.clone());
        let groups = object_groups(&whole);
        assert!(groups.iter().any(|g| g.len() > 1) && groups.iter().any(|g| g.len() == 1));
        let starts: Arc<[u64]> = Arc::from([0]);
        let mut reader = read_ahead(&store, &whole, &shapes, &starts);
        let mut next = 1;
        for &lines in &sizes {
            let got = reader.recv().await.unwrap().unwrap();
            let [table] = &got.tables[..] else {
                panic!("one table's changes");
            };
            let seqs = table.batch.seqs().values();
            assert_eq!(
                seqs,
                &(next as i64..(next + lines) as i64).collect::<Vec<_>>()
            );
            next += lines;
        }
        assert!(reader.recv().await.is_none());

        let bad = objects[25].clone();
        let body = line(1) + "not json\n";
        let size = body.len() as u64;
        store
            .put(&ObjectPath::from(bad.key.as_str()), body.into())
            .await
            .unwrap();
        objects[25].size = size;
        // The objects of the groups before the bad one's (a group's parse
        // fails whole; the run stops there, before anything is committed).
        let before: usize = groups
            .iter()
            .take_while(|g| !g.iter().any(|(key, _)| *key == bad.key))
            .map(Vec::len)
            .sum();
        assert!(before > 0);
        let mut reader = read_ahead(&store, &plan(objects), &shapes, &starts);
        for _ in 0..before {
            reader.recv().await.unwrap().unwrap();
        }
        let e = reader.recv().await.unwrap().unwrap_err();
        assert!(e.to_string().contains("o25 line 2"), "{e}");
        assert!(reader.recv().await.is_none());
    }

    fn record(version: u32, columns: &[(&str, u32, bool)]) -> SchemaRecord {
        SchemaRecord {
            table: "public.t".into(),
            version,
            columns: columns
                .iter()
                .map(|(name, oid, key)| RecordColumn {
                    name: name.to_string(),
                    type_name: String::new(),
                    type_oid: *oid,
                    type_modifier: -1,
                    key: *key,
                })
                .collect(),
            replica_identity: "default".into(),
        }
    }

    fn compacted(kind: Kind) -> BTreeMap<String, compacted::TableEntry> {
        let mut m = BTreeMap::new();
        m.insert(
            "public.t".into(),
            compacted::TableEntry {
                columns: vec![Column {
                    name: "v".into(),
                    kind,
                }],
                ..Default::default()
            },
        );
        m
    }

    #[test]
    fn a_later_shape_adds_columns_and_widens_types() {
        let schemas = BTreeMap::from([(
            "public.t".to_string(),
            vec![
                record(2, &[("id", 20, true), ("v", 20, false), ("w", 25, false)]),
                record(1, &[("id", 20, true), ("v", 23, false)]),
            ],
        )]);
        let shapes = shapes(&schemas, &["public.t".into()], &compacted(Kind::Int32)).unwrap();
        let shape = &shapes["public.t"];
        let names: Vec<(&str, Kind)> = shape
            .columns
            .iter()
            .map(|c| (c.name.as_str(), c.kind))
            .collect();
        assert_eq!(
            names,
            [("id", Kind::Int64), ("v", Kind::Int64), ("w", Kind::Text)]
        );
        assert_eq!(shape.key, [0]);
    }

    #[test]
    fn a_type_change_compacted_files_cannot_hold_is_an_error_with_the_fix() {
        let schemas = BTreeMap::from([(
            "public.t".to_string(),
            vec![record(1, &[("id", 20, true), ("v", 25, false)])],
        )]);
        let err = shapes(&schemas, &["public.t".into()], &compacted(Kind::Int64)).unwrap_err();
        assert!(err.to_string().contains("public.t.v"), "{err}");
        let hint = err.hint().unwrap();
        assert!(hint.contains("latest/public/t/"), "{hint}");
        assert!(hint.contains("waltail compact public.t"), "{hint}");
    }
}
