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
pub mod parquet_file;
pub(crate) mod plan;
mod reader;
pub(crate) mod rewrite;
pub mod spool;
mod summary;
mod task;
pub(crate) mod upgrade;
pub mod vacuum;
mod write;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use self::plan::{Plan, Tables, plan_files, select_tables, shapes};
pub use self::summary::{Summary, render};
pub use self::vacuum::vacuum_tables;
use self::write::Files;
use crate::archive::listing;
use crate::config::Config;
use crate::lakehouse;
use crate::lakehouse::compacted::{self, Compacted};
use crate::lakehouse::delta::Location;
use crate::lakehouse::typing::TableShape;
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
    let loc = Location::new(&config.destination, &store)?.settling(sink);
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
        let what = vacuum::Vacuum {
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

    // Plan: each table's two logs say where it continues, its columns and
    // files; the archive's objects from the earliest of those on, without
    // a gap, are what the run takes.
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
    let (Some(first), Some(last)) = (planned.files.first(), planned.files.last()) else {
        return Ok(Summary {
            gap: planned.gap,
            elapsed: started.elapsed(),
            ..Summary::default()
        });
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
    let tables = Tables {
        compacted,
        entries,
        shapes: Arc::new(shapes),
        widened,
    };
    let mut summary = Summary {
        gap: planned.gap,
        ..Summary::planned(&plan)
    };
    if opts.dry_run {
        summary.elapsed = started.elapsed();
        return Ok(summary);
    }

    // Write: every file the run commits, none visible yet. In every file
    // name: a run never writes over a file that a snapshot names, or that
    // another run on the same table is about to commit.
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let files = Files {
        output: parquet_file::Output {
            store: Arc::clone(&store),
            parts: sink.multipart().cloned(),
        },
        prefix,
        run_id: &run_id,
        props: parquet_file::writer_properties(&config.compact),
        config: &config.compact,
    };
    let ctx = lakehouse::session::session(Arc::clone(&store));
    let written = write::write(&files, &ctx, &plan, &tables, &mut summary).await?;

    // Commit: per table the history, then the latest view.
    let commits_started = Instant::now();
    summary.commits =
        commit::commit_run(&loc, &config.pipeline, &run_id, &plan, &tables, written).await?;
    summary.commit_time = commits_started.elapsed();
    if config.compact.vacuum {
        let committed: Vec<TableShape> = plan
            .tables
            .iter()
            .map(|t| tables.shapes[t].as_ref().clone())
            .collect();
        let what = vacuum::Vacuum {
            replaced_after: config.compact.retain,
            unnamed_after: None,
        };
        summary.vacuumed = vacuum_tables(&loc, &committed, what).await?;
    }
    summary.elapsed = started.elapsed();
    Ok(summary)
}
