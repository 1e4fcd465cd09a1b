//! `waltail compact`: the NDJSON archive rewritten as typed, partitioned
//! Parquet that DuckDB, Athena, Spark and Trino read directly: a history of
//! every change and a latest-row view per table, incrementally and exactly
//! once.
//!
//! The stages, one file each, in the order a run goes through them:
//!
//! ```text
//! listing (archive objects, schema records) --> manifest (plan: what is new,
//!     grouped into files; stored before anything is written)
//!     --> read (NDJSON lines -> typed changes, typing: records -> Arrow;
//!         columns: each object's changes as an Arrow batch per table)
//!     --> history (Parquet per table and date)  +  latest (merge, new generation)
//!     --> manifest (commit: one PUT) --> delete the previous generation
//! ```
//!
//! See [`manifest`] for why a rerun writes nothing new, why an interrupted
//! run is completed by the next one under the same names, and why no change
//! is compacted twice.

pub mod columns;
pub mod delta;
pub mod history;
pub mod latest;
pub mod listing;
pub mod lock;
pub mod manifest;
pub mod read;
mod scan;
pub mod session;
pub mod spool;
pub mod typing;

use std::collections::{BTreeMap, BTreeSet};
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

use self::history::HistoryFile;
use self::latest::{MergeInput, merge_bucket};
use self::lock::Lock;
use self::manifest::{Manifest, Plan, plan_files};
use self::typing::TableShape;
use crate::config::Config;
use crate::sink::Sink;
use crate::{Error, Result};

/// What to compact.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Only list what a run would do.
    pub dry_run: bool,
    /// `schema.table` names; all tables with schema records when empty.
    pub tables: Vec<String>,
    /// Take the compaction lock over even when its holder looks alive.
    pub force_unlock: bool,
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Whether the run completed an interrupted one.
    pub resumed: bool,
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
    /// The first seq not in the archive when a gap stopped the run.
    pub gap: Option<u64>,
    pub elapsed: Duration,
}

/// Runs `waltail compact` and prints its plan (dry run) or its summary.
pub async fn command(config: &Config, opts: &Options) -> Result<()> {
    let summary = compact(config, opts).await?;
    print!("{}", render(&summary, opts.dry_run));
    Ok(())
}

/// Compacts what is new in the archive (see the module doc), holding the
/// archive's compaction lock (see [`lock`]) unless it is a dry run.
pub async fn compact(config: &Config, opts: &Options) -> Result<Summary> {
    let started = Instant::now();
    let sink = Sink::with_retry(
        &config.destination,
        config.delivery.request_timeout,
        store_retry(),
    )?;
    if opts.dry_run {
        return run(config, opts, &sink, None, started).await;
    }
    // A local folder has no conditional writes, so the lock object alone
    // cannot keep two runs from both committing (a stale-lock takeover is
    // delete + create there): an OS lock on a file in the folder does, for
    // the whole run, and a dead process's is released by the kernel.
    let _folder_lock = match &config.destination {
        crate::config::DestinationConfig::File { path, prefix } => {
            Some(folder_lock(path, prefix.as_deref())?)
        }
        crate::config::DestinationConfig::S3(_) => None,
    };
    let lock = Lock::acquire(Arc::clone(sink.store()), sink.prefix(), opts.force_unlock).await?;
    let result = run(config, opts, &sink, Some(&lock), started).await;
    let released = lock.release().await;
    let summary = result?;
    released?;
    Ok(summary)
}

/// Holds an exclusive OS lock on `[prefix/]_waltail/compaction/run.lock` in
/// the archive folder until dropped.
fn folder_lock(root: &std::path::Path, prefix: Option<&str>) -> Result<std::fs::File> {
    let dir = match prefix {
        Some(p) => root.join(p),
        None => root.to_path_buf(),
    }
    .join("_waltail/compaction");
    let path = dir.join("run.lock");
    let io = |e| Error::io(format!("cannot lock {}", path.display()), e);
    std::fs::create_dir_all(&dir).map_err(io)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::fatal(
            format!(
                "another `waltail compact` is running on this folder (it holds {})",
                path.display()
            ),
            "wait for it to finish; the lock goes with its process, so there is nothing to unlock",
        )),
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

/// How compact's requests are retried: reads and writes of a run that
/// takes minutes should outlast a store that restarts or drops
/// connections for a few seconds (the streaming sink instead has its own,
/// longer policy and no client retries). Connection failures, 5xx, 429
/// and timeouts of idempotent requests are retried, from 100 ms growing
/// to 15 s, for 2 minutes at most. object_store draws each wait at random
/// between the first and the last one times the base, so waits can stay
/// short for a while: 15 retries were once spent within 2.7 s of a 3 s
/// outage; 60 leave the 2 minutes the limit that counts.
pub fn store_retry() -> object_store::RetryConfig {
    object_store::RetryConfig {
        backoff: object_store::BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(15),
            base: 2.0,
        },
        max_retries: 60,
        retry_timeout: Duration::from_secs(120),
    }
}

async fn run(
    config: &Config,
    opts: &Options,
    sink: &Sink,
    lock: Option<&Lock>,
    started: Instant,
) -> Result<Summary> {
    let store = Arc::clone(sink.store());
    let prefix = sink.prefix();
    let check_lock = || lock.map_or(Ok(()), Lock::check);
    let mut manifest = Manifest::load(store.as_ref(), prefix).await?;
    if !opts.dry_run {
        // A run that stopped while publishing its latest view: finish that first.
        publish(store.as_ref(), prefix, &mut manifest).await?;
    }
    let schemas = listing::load_schemas(store.as_ref(), prefix).await?;

    let mut summary = Summary::default();
    let plan = match manifest.pending.clone() {
        Some(plan) => {
            summary.resumed = true;
            plan
        }
        None => {
            let tables = select_tables(&schemas, &opts.tables)?;
            // The whole archive, not only the date folders a query lists:
            // if the source's clock stepped back, objects newer than the
            // last compacted one sit in earlier folders, and a run must
            // find them rather than report nothing new. Listing costs one
            // request per 1,000 objects, little next to reading them.
            let objects = listing::list_objects(store.as_ref(), prefix, &config.pipeline).await?;
            // The earliest seq any selected table still needs.
            let from = tables
                .iter()
                .map(|t| manifest.tables.get(t).map(|e| e.next_seq))
                .collect::<Option<Vec<u64>>>()
                .and_then(|starts| starts.into_iter().min());
            let planned = plan_files(&objects, from, config.compact.file_bytes);
            summary.gap = planned.gap;
            let files = planned.files;
            let (Some(first), Some(last)) = (files.first(), files.last()) else {
                summary.elapsed = started.elapsed();
                return Ok(summary);
            };
            Plan {
                generation: manifest.generation + 1,
                from_seq: first.first_seq,
                to_seq: last.last_seq,
                tables: tables.into_iter().collect(),
                files,
                repeated: planned.repeated,
            }
        }
    };
    let shapes = shapes(&schemas, &plan.tables, &manifest)?;
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
    if !summary.resumed {
        manifest.pending = Some(plan.clone());
        check_lock()?;
        manifest.commit(store.as_ref(), prefix).await?;
    }

    let bar = progress_bar(summary.bytes_in);
    let props = history::writer_properties(&config.compact);
    let output = history::Output {
        store: Arc::clone(&store),
        parts: sink.multipart().cloned(),
    };
    let ctx = session::session(Arc::clone(&store));
    let mut spool = spool::Spool::new(config.compact.merge_bytes)?;
    let shapes = Arc::new(shapes);
    // By table index (see read::Shapes): no lookup by name per change.
    let starts: Arc<[u64]> = (0..shapes.len())
        .map(|i| table_start(&manifest, &shapes.shape(i).table))
        .collect();
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
                        let key = history::history_key(
                            prefix,
                            shape,
                            &file.date,
                            file.first_seq.max(start),
                            file.last_seq,
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
            let (_, rows, bytes, spooled) = hist.finish(spool.takes_rows(&table)).await?;
            for batch in spooled {
                spool.push_rows(&table, batch).await?;
            }
            summary.history_files += 1;
            summary.history_bytes += bytes;
            manifest.tables.entry(table).or_default().history_rows += rows;
        }
    }
    bar.finish_and_clear();
    tracing::debug!(elapsed = ?started.elapsed(), "read and wrote the history");

    spool.finish().await?;
    let spool = Arc::new(spool);
    tracing::debug!(elapsed = ?started.elapsed(), "spool written");

    // The new latest generation of every table that changed, or that has
    // no latest view yet, merged bucket by bucket.
    let target = latest::LatestTarget {
        output: output.clone(),
        prefix: prefix.map(str::to_string),
        staging: format!("{STAGING}/{:08}", plan.generation),
        generation: plan.generation,
        props: props.clone(),
        file_bytes: config.compact.file_bytes,
    };
    let mut moves = Vec::new();
    for table in &plan.tables {
        let shape = &shapes[table];
        let entry = manifest.tables.get(table).cloned().unwrap_or_default();
        let spooled = spool.table(table);
        if shape.key.is_empty() || (spooled.is_none() && !entry.latest.is_empty()) {
            // No key (REPLICA IDENTITY NOTHING): a history only. Or no change.
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
        let merged: Vec<Written> = futures::stream::iter(0..buckets)
            .map(|bucket| {
                let (input, target) = (Arc::clone(&input), target.clone());
                let task = Task::spawn(async move {
                    let view = merge_bucket(&input, bucket, None).await?;
                    let (written, bytes) = view.write_bucket(&target, bucket, false).await?;
                    Ok::<Written, Error>((written, bytes, view.len()))
                });
                async move { task.join("a latest view merge").await? }
            })
            .buffered(mergers)
            .try_collect()
            .await?;
        let (mut files, mut rows) = (Vec::new(), 0u64);
        for (written, bytes, len) in merged {
            rows += len as u64;
            summary.latest_bytes += bytes;
            files.extend(written);
        }
        if files.is_empty() {
            // An empty table still gets one file, so readers find its columns.
            let empty = latest::LatestView::empty(Arc::clone(shape));
            let (written, bytes) = empty.write_bucket(&target, buckets - 1, true).await?;
            summary.latest_bytes += bytes;
            files.extend(written);
        }
        let entry = manifest.tables.entry(table.clone()).or_default();
        summary.latest_files += files.len();
        summary.latest_rows += rows;
        entry.latest = files.iter().map(|m| m.to.clone()).collect();
        entry.latest_rows = rows;
        entry.buckets = buckets;
        moves.extend(files);
        tracing::debug!(%table, buckets, elapsed = ?started.elapsed(), "merged the latest view");
    }
    drop(spool);
    let last_date = plan.files.last().map(|f| f.date.clone());
    for table in &plan.tables {
        let entry = manifest.tables.entry(table.clone()).or_default();
        // Never backwards, whatever an older plan said.
        if plan.to_seq + 1 >= entry.next_seq {
            entry.next_seq = plan.to_seq + 1;
            entry.next_date = last_date.clone();
        }
        entry.columns = shapes[table].columns.clone();
    }
    manifest.generation = plan.generation;
    manifest.pending = None;
    manifest.publish = moves;
    check_lock()?;
    manifest.commit(store.as_ref(), prefix).await?;
    publish(store.as_ref(), prefix, &mut manifest).await?;
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// A spawned task that is aborted when its handle is dropped: when a run
/// fails, the tasks it started stop at their next await instead of going
/// on writing after the run has reported its error (their output is
/// deterministic, but a late write would be an orphan nothing cleans up).
pub(crate) struct Task<T>(tokio::task::JoinHandle<T>);

impl<T: Send + 'static> Task<T> {
    pub(crate) fn spawn(future: impl Future<Output = T> + Send + 'static) -> Task<T> {
        Task(tokio::spawn(future))
    }

    /// The task's output; an error if it panicked.
    pub(crate) async fn join(mut self, what: &str) -> Result<T> {
        (&mut self.0)
            .await
            .map_err(|e| Error::bug(format!("{what} failed: {e}")))
    }
}

impl<T> Drop for Task<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A written bucket of a latest view: its files, bytes and rows.
type Written = (Vec<manifest::Move>, u64, usize);

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
    shapes: &Arc<read::Shapes>,
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
                                let path = ObjectPath::from(key.as_str());
                                let body = listing::get(store.as_ref(), &path).await?;
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
    shapes: &read::Shapes,
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
    entry: &manifest::TableEntry,
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

/// Where a run writes its latest-view files before they are published.
const STAGING: &str = "_waltail/compaction/staging";

/// Moves the committed generation's latest-view files from staging into
/// `latest/`, then deletes every other file there (the previous generation,
/// or what a run stopped before its commit left) and the staged copies.
/// Copy before delete: for the moment in between a reader globbing
/// `latest/` may see both generations, never none. Idempotent, so a run
/// stopped half-way through is finished by the next one.
async fn publish(
    store: &dyn ObjectStore,
    prefix: Option<&str>,
    manifest: &mut Manifest,
) -> Result<()> {
    if manifest.publish.is_empty() {
        return Ok(());
    }
    for m in &manifest.publish {
        let (from, to) = (
            ObjectPath::from(m.from.as_str()),
            ObjectPath::from(m.to.as_str()),
        );
        match store.copy(&from, &to).await {
            Ok(()) => {}
            // Moved by a run that stopped before recording it.
            Err(object_store::Error::NotFound { .. }) if store.head(&to).await.is_ok() => {}
            Err(e) => return Err(Error::store("COPY", m.from.clone(), e)),
        }
    }
    let current: BTreeSet<&str> = manifest
        .tables
        .values()
        .flat_map(|e| e.latest.iter().map(String::as_str))
        .collect();
    let dirs: BTreeSet<&str> = manifest
        .publish
        .iter()
        .filter_map(|m| m.to.rsplit_once('/').map(|(dir, _)| dir))
        .collect();
    let mut stale = Vec::new();
    for dir in dirs {
        let dir = ObjectPath::from(dir);
        let metas: Vec<_> = store
            .list(Some(&dir))
            .try_collect()
            .await
            .map_err(|e| Error::store("LIST", dir.to_string(), e))?;
        stale.extend(
            metas
                .into_iter()
                .map(|m| m.location)
                .filter(|p| !current.contains(p.as_ref())),
        );
    }
    stale.extend(
        manifest
            .publish
            .iter()
            .map(|m| ObjectPath::from(m.from.as_str())),
    );
    for path in stale {
        match store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(Error::store("DELETE", path.to_string(), e)),
        }
    }
    manifest.publish.clear();
    manifest.commit(store, prefix).await
}

/// The first seq `table` still needs (0 when it was never compacted). While
/// a run is pending the manifest's entries are still the previous run's.
fn table_start(manifest: &Manifest, table: &str) -> u64 {
    manifest.tables.get(table).map_or(0, |e| e.next_seq)
}

/// The tables a run compacts: the named ones (each must have a schema
/// record), or every table with one.
fn select_tables(
    schemas: &BTreeMap<String, Vec<typing::SchemaRecord>>,
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
    schemas: &BTreeMap<String, Vec<typing::SchemaRecord>>,
    tables: &[String],
    manifest: &Manifest,
) -> Result<read::Shapes> {
    let mut out = Vec::new();
    for table in tables {
        let records = schemas.get(table).map(Vec::as_slice).unwrap_or_default();
        let shape = TableShape::from_records(table, records);
        if let Some(entry) = manifest.tables.get(table) {
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
                            "compact the table again with the new type: delete parquet/{0}/ and latest/{0}/ (with the '.' as '/'), remove \"{table}\" from the tables of _waltail/compaction/manifest.json, and run `waltail compact {table}`",
                            table.replacen('.', "/", 1)
                        ),
                    ));
                }
            }
        }
        out.push(Arc::new(shape));
    }
    Ok(read::Shapes::new(out))
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
    let Some((first, last)) = s.seqs else {
        out.push_str("nothing new to compact\n");
        out.push_str(gap.as_deref().unwrap_or_default());
        return out;
    };
    let tables = s.tables.iter().cloned().collect::<Vec<_>>().join(", ");
    if dry_run {
        out.push_str(&format!(
            "would compact {} objects ({}), seqs {first}-{last}, tables {tables}{}\n",
            s.objects,
            HumanBytes(s.bytes_in),
            if s.resumed {
                " (completing an interrupted run)"
            } else {
                ""
            }
        ));
    } else {
        out.push_str(&format!(
            "compacted {} objects ({}), seqs {first}-{last}, {} changes in {:.1} s{}\n",
            s.objects,
            HumanBytes(s.bytes_in),
            s.changes,
            s.elapsed.as_secs_f64(),
            if s.resumed {
                " (completed an interrupted run)"
            } else {
                ""
            }
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
    }
    out.push_str(gap.as_deref().unwrap_or_default());
    out
}

#[cfg(test)]
mod tests {
    use super::typing::{Column, Kind, RecordColumn, SchemaRecord};
    use super::*;

    /// Small objects are fetched and parsed together, in plan order, up to
    /// a mebibyte a group; an object larger than that is a group alone.
    #[test]
    fn small_objects_are_grouped_in_order_and_a_large_one_stands_alone() {
        let object = |key: &str, size: u64| manifest::PlannedObject {
            key: key.into(),
            size,
            from_seq: 0,
        };
        let file = |objects| manifest::PlannedFile {
            date: "2026-11-30".into(),
            first_seq: 1,
            last_seq: 1,
            objects,
        };
        let half = GROUP_BYTES / 2;
        let plan = Plan {
            generation: 1,
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
        let shapes = Arc::new(read::Shapes::new([Arc::new(TableShape::test_t())]));
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
            objects.push(manifest::PlannedObject {
                key,
                size,
                from_seq: 0,
            });
        }
        let plan = |objects: Vec<manifest::PlannedObject>| Plan {
            generation: 1,
            from_seq: 1,
            to_seq: seq,
            tables: vec!["public.t".into()],
            files: vec![manifest::PlannedFile {
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

    #[test]
    fn one_run_at_a_time_holds_a_folder_and_lets_go_when_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        let first = folder_lock(dir.path(), Some("p")).unwrap();
        assert!(dir.path().join("p/_waltail/compaction/run.lock").exists());
        let e = folder_lock(dir.path(), Some("p")).unwrap_err().to_string();
        assert!(e.contains("another `waltail compact` is running"), "{e}");
        // Another prefix is another archive.
        drop(folder_lock(dir.path(), None).unwrap());
        drop(first);
        folder_lock(dir.path(), Some("p")).unwrap();
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

    fn compacted(kind: Kind) -> Manifest {
        let mut m = Manifest::default();
        m.tables.insert(
            "public.t".into(),
            manifest::TableEntry {
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
