//! `waltail query`: SQL over the archive, with DataFusion, fresh to the last
//! archived change and able to look back (`--at`).
//!
//! The stages, one file each:
//!
//! ```text
//! catalog (one snapshot: NDJSON objects, Delta snapshots, shapes, --at as a seq)
//!     --> providers (the tables: latest = compacted latest + merge of the
//!         NDJSON tail; history = Parquet history + tail; waltail.changes)
//!         using tail (NDJSON objects -> typed batches, pruned by key name)
//!         and merge (the tail's keys over the compacted view),
//!         text read as string views (views)
//!     --> DataFusion (plan, optimize, execute) --> output (table, CSV, JSON)
//! ```
//!
//! Every statement takes its own snapshot, so at the prompt each statement
//! sees the archive as it is when it runs. The prompt keeps one DataFusion
//! session: while the snapshot is the same as the last statement's, the
//! tables built for it (the uncompacted changes parsed and merged over the
//! compacted view) and the Parquet footers read stay, so a statement
//! repeated at the prompt costs its scan, not the build; and a query runs
//! on the last snapshot while the next is taken, its result printed if the
//! snapshot is the same (see [`early`]).

mod at;
mod bounds;
mod branches;
pub(crate) mod catalog;
mod densecount;
mod early;
mod fanout;
mod footers;
mod kept;
mod keybitmap;
mod keytable;
mod known;
pub(crate) mod merge;
mod operator;
pub(crate) mod output;
#[cfg(test)]
mod plans;
mod prefetch;
mod probefilter;
pub(crate) mod providers;
mod pushdown;
mod reads;
pub(crate) mod tail;
mod views;
mod window;

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use datafusion::error::DataFusionError;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion::sql::parser::DFParserBuilder;
use datafusion::sql::sqlparser::dialect::GenericDialect;
use object_store::ObjectStore;

use self::catalog::{Archive, At, Previous};
use self::known::Known;
use self::output::{Format, Written};
use crate::config::{Config, DestinationConfig};
use crate::lakehouse::delta::Location;
use crate::lakehouse::session::ARCHIVE_URL;
use crate::sink::Sink;
use crate::{Error, Result};

/// Where the SQL comes from and how results go out.
#[derive(Debug, Clone, Default)]
pub(crate) struct Options {
    /// The SQL text; `-` reads stdin.
    pub sql: Option<String>,
    /// A file holding the SQL (`-`: stdin).
    pub file: Option<PathBuf>,
    /// Table on a terminal, CSV otherwise, when not given.
    pub format: Option<Format>,
    pub at: Option<At>,
    /// Each statement's time on stderr, by phase.
    pub timing: bool,
    /// Memory for decoded columns read again (see [`kept`]), in MiB.
    pub keep_decoded_mib: usize,
}

/// What every statement of one invocation shares.
pub(crate) struct Query {
    sink: Sink,
    /// The store the query reads through (see [`reads`]).
    store: Arc<reads::ReadStore>,
    loc: Location,
    pipeline: String,
    at: Option<At>,
    format: Format,
    /// Print each statement's time (`--timing`, `\timing` at the prompt).
    timing: AtomicBool,
    /// The session of every statement and the snapshot its tables were
    /// built from (see the module doc).
    session: tokio::sync::Mutex<Option<(SessionContext, Arc<Archive>)>>,
    /// The entries kept for the next query (see [`known`]).
    known: Known,
    /// What the decoded columns kept by every snapshot's tables may take.
    budget: Arc<kept::Budget>,
}

/// Where a statement's time went, for `--timing`.
#[derive(Debug, Default)]
struct Phases {
    snapshot: Duration,
    plan: Duration,
    run: Duration,
    /// The snapshot was the last statement's: its tables were reused.
    reused: bool,
    /// The statement ran on the last snapshot while the snapshot was taken.
    early: bool,
}

impl Query {
    pub(crate) fn new(
        config: &Config,
        at: Option<At>,
        format: Format,
        timing: bool,
        keep_decoded: usize,
    ) -> Result<Query> {
        // Reads retried like compact's: a reset connection does not fail the query.
        let sink = Sink::with_retry(
            &config.destination,
            config.delivery.request_timeout,
            crate::lakehouse::store_retry(),
        )?;
        let loc = Location::new(&config.destination, sink.store())?;
        let store = Arc::new(match &config.destination {
            DestinationConfig::File { path, .. } => reads::ReadStore::folder(path)
                .map_err(|e| Error::store("open", path.display().to_string(), e))?,
            DestinationConfig::S3(_) => reads::ReadStore::new(Arc::clone(sink.store())),
        });
        Ok(Query {
            store,
            known: Known::new(&config.state_dir, &config.pipeline, loc.url()),
            loc,
            sink,
            pipeline: config.pipeline.clone(),
            at,
            format,
            timing: AtomicBool::new(timing),
            budget: kept::Budget::new(keep_decoded),
            session: tokio::sync::Mutex::new(None),
        })
    }

    /// The session over a fresh snapshot of the archive: the last
    /// statement's when the snapshot is the same (with the tables already
    /// built), else the same session with the new snapshot's tables.
    async fn session(&self, phases: &mut Phases) -> Result<(SessionContext, Arc<Archive>)> {
        let started = Instant::now();
        let mut kept = self.session.lock().await;
        // The first statement's session is built on another thread while
        // the snapshot is taken: registering DataFusion's functions and
        // rules is CPU work the snapshot's reads need not wait for.
        let building = kept.is_none().then(|| {
            let store: Arc<dyn ObjectStore> = Arc::clone(&self.store) as _;
            tokio::task::spawn_blocking(move || bare_session(store))
        });
        // The last statement's snapshot, or at the first what the last
        // query kept.
        let (on_disk, disk_shapes);
        let previous = match kept.as_ref() {
            Some((_, last)) => Previous {
                entries: Some(&last.compacted),
                schemas: Some(&last.schema_objects),
                shapes: Some(&last.shapes),
            },
            None => {
                on_disk = self.known.read();
                disk_shapes = on_disk.as_ref().map(|k| catalog::shapes(&k.schemas));
                Previous {
                    entries: on_disk.as_ref().map(|k| &k.tables),
                    schemas: on_disk.as_ref().map(|k| &k.schemas),
                    shapes: disk_shapes.as_ref(),
                }
            }
        };
        let archive = Archive::load(
            Arc::clone(&self.store) as _,
            &self.loc,
            self.sink.prefix(),
            &self.pipeline,
            self.at.as_ref(),
            &previous,
        )
        .await?;
        // The compacted files' metadata from the logs (see [`reads`]).
        self.store
            .know(archive.compacted.values().flat_map(|e| &e.sizes));
        if previous.entries != Some(&archive.compacted)
            || previous.schemas != Some(&archive.schema_objects)
        {
            self.known
                .write(&archive.compacted, &archive.schema_objects);
        }
        if let (Some(At::Time(t)), Some(seq)) = (&self.at, archive.max_seq) {
            eprintln!(
                "note: the archive as of {} is up to seq {seq}",
                t.to_rfc3339()
            );
        }
        // Footers are read ahead from a folder only (see [`footers`]).
        let read_ahead = self.store.in_place();
        let (ctx, archive) = match kept.take() {
            Some((ctx, last)) if last.same_snapshot(&archive) => {
                phases.reused = true;
                (ctx, last)
            }
            Some((ctx, _)) => {
                let archive = Arc::new(archive);
                providers::register(&ctx, Arc::clone(&archive), &self.budget, read_ahead)
                    .map_err(|e| sql_error("", e))?;
                (ctx, archive)
            }
            None => {
                let archive = Arc::new(archive);
                let ctx = match building {
                    Some(building) => building
                        .await
                        .map_err(|e| Error::bug(format!("building the session: {e}")))?,
                    None => bare_session(Arc::clone(&self.store) as _),
                };
                providers::register(&ctx, Arc::clone(&archive), &self.budget, read_ahead)
                    .map_err(|e| sql_error("", e))?;
                (ctx, archive)
            }
        };
        *kept = Some((ctx.clone(), Arc::clone(&archive)));
        phases.snapshot = started.elapsed();
        Ok((ctx, archive))
    }

    /// Runs the statements of `sql`, printing each result.
    pub(crate) async fn run(&self, sql: &str) -> Result<()> {
        let started = Instant::now();
        let mut phases = Phases::default();
        let located = |e: DataFusionError| sql_error(sql, e);
        let statements = DFParserBuilder::new(sql)
            .with_dialect(&GenericDialect {})
            .build()
            .and_then(|mut p| p.parse_statements())
            .map_err(located)?;
        if statements.is_empty() {
            return Err(Error::config("no SQL statement given"));
        }
        // A lone query at the prompt runs on the last snapshot while the
        // next is taken (see [`early`]).
        let last = self
            .session
            .lock()
            .await
            .as_ref()
            .map(|(ctx, _)| ctx.clone());
        let (session, early) = match (last, statements.front()) {
            (Some(last), Some(only)) if statements.len() == 1 && early::may_run_early(only) => {
                tokio::join!(self.session(&mut phases), early::run(&last, only.clone()))
            }
            _ => (self.session(&mut phases).await, None),
        };
        let (ctx, archive) = session?;
        let early = early.filter(|_| phases.reused);
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::new(stdout.lock());
        let options = datafusion::execution::context::SQLOptions::new().with_allow_dml(false);
        let count = statements.len();
        // Ok(true): the reader closed the pipe.
        let ran: Result<bool> = async {
            if let Some(early) = early {
                phases.early = true;
                phases.plan = early.plan;
                phases.run = early.run;
                let printing = Instant::now();
                let (written, _) =
                    output::write(&mut out, self.format, early.into_stream(), located).await?;
                phases.run += printing.elapsed();
                return Ok(written == Written::Closed);
            }
            for (i, statement) in statements.into_iter().enumerate() {
                let planning = Instant::now();
                let state = ctx.state();
                let plan = state.statement_to_plan(statement).await.map_err(located)?;
                options.verify_plan(&plan).map_err(located)?;
                let frame = ctx.execute_logical_plan(plan).await.map_err(located)?;
                let (physical, task) = early::physical(frame).await.map_err(located)?;
                phases.plan += planning.elapsed();
                let running = Instant::now();
                let stream =
                    datafusion::physical_plan::execute_stream(physical, task).map_err(located)?;
                // A statement without columns (SET) prints nothing, not even a separator.
                let printed = !stream.schema().fields().is_empty();
                let (written, _) = output::write(&mut out, self.format, stream, located).await?;
                phases.run += running.elapsed();
                if written == Written::Closed {
                    return Ok(true);
                }
                if self.format == Format::Table
                    && printed
                    && i + 1 < count
                    && writeln!(out).is_err()
                {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        .await;
        drop(out);
        if self.timing.load(Ordering::Relaxed) {
            // One write: stderr is unbuffered, and a line written in parts
            // interleaves with the terminal's echo of what is typed next.
            let line = format!(
                "Time: {:.1} ms (snapshot {:.1} ms{}, plan {:.1} ms, run {:.1} ms)\n",
                ms(started.elapsed()),
                ms(phases.snapshot),
                match (phases.reused, phases.early) {
                    (true, true) => ", unchanged: tables kept, the statement ran meanwhile",
                    (true, false) => ", unchanged: tables kept",
                    _ => "",
                },
                ms(phases.plan),
                ms(phases.run),
            );
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
        match ran {
            Ok(true) => Ok(()),
            Ok(false) => Ok(()),
            // A file that vanished mid-statement is most likely a vacuum:
            // say so, and to run it again, rather than show the store's
            // "not found".
            Err(e) => {
                archive.verify_unchanged().await?;
                Err(e)
            }
        }
    }

    /// The interactive prompt: statements end with `;`, `\q` or Ctrl-D quits.
    pub(crate) async fn prompt(&self) -> Result<ExitCode> {
        eprintln!(
            "waltail query: SQL over the archive; end statements with ';', \\timing times them, \\q or Ctrl-D quits. Try SHOW TABLES;"
        );
        let stdin = std::io::stdin();
        let mut buffer = String::new();
        loop {
            eprint!(
                "{}",
                if buffer.is_empty() {
                    "waltail> "
                } else {
                    "     -> "
                }
            );
            let _ = std::io::stderr().flush();
            let mut line = String::new();
            let n = stdin
                .lock()
                .read_line(&mut line)
                .map_err(|e| Error::io("cannot read from the terminal", e))?;
            if n == 0 {
                eprintln!();
                return Ok(ExitCode::SUCCESS);
            }
            if buffer.is_empty() && matches!(line.trim(), "\\q" | "quit" | "exit") {
                return Ok(ExitCode::SUCCESS);
            }
            if buffer.is_empty() && line.trim() == "\\timing" {
                let on = !self.timing.fetch_xor(true, Ordering::Relaxed);
                eprintln!("timing is {}", if on { "on" } else { "off" });
                continue;
            }
            buffer.push_str(&line);
            if !buffer.trim_end().ends_with(';') {
                continue;
            }
            let sql = std::mem::take(&mut buffer);
            if let Err(e) = self.run(&sql).await {
                eprintln!("error: {}", crate::error::Report(&e));
                if let Some(hint) = e.hint() {
                    eprintln!("  fix: {hint}");
                }
            }
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A session reading through `store` (the archive's), its tables not yet
/// registered (see [`providers::register`]).
fn bare_session(store: Arc<dyn ObjectStore>) -> SessionContext {
    let mut config = SessionConfig::new()
        .with_information_schema(true)
        .with_default_catalog_and_schema("datafusion", "public");
    // Spans let planning errors say where in the statement they are.
    config.options_mut().sql_parser.collect_spans = true;
    // A grouping's first step gives up on grouping a scan's rows when the
    // first rows it probes are nearly all groups of their own (DataFusion's
    // ratio, 0.8), and passes them on to the second step ungrouped. It
    // probes after 8,192 rows, one batch, rather than DataFusion's
    // 100,000: a scan of one day's history files is often smaller than
    // that, so a grouping by key never gave up, and grouped every row
    // twice. The busiest keys of 1,000,000 changes over 200,000 keys
    // (`KEEP=1 SCALE=0.2 scripts/bench-query.sh`'s archive): 50.3 -> 34.8
    // ms; of 5,000,000 over 1,000,000: 129.4 -> 113.8 ms (medians of 9
    // whole processes, alternated); groupings of few groups (by day and
    // operation, by status, the join) keep their times.
    config
        .options_mut()
        .execution
        .skip_partial_aggregation_probe_rows_threshold = 8192;
    // Filters are evaluated while decoding Parquet scan by scan, where
    // they select few rows (see [`pushdown`]), not session-wide. The
    // filters a top-k or a join derives while it runs are not pushed into
    // the scans at all: evaluated in the Parquet decoding row by row as
    // they tighten, they cost more than they saved (the top 10 by amount of
    // 357,600 latest rows: 34 ms with them, 22 ms without; the latest view
    // joined to the history: 101 ms with, 89 ms without).
    let optimizer = &mut config.options_mut().optimizer;
    optimizer.enable_topk_dynamic_filter_pushdown = false;
    optimizer.enable_join_dynamic_filter_pushdown = false;
    // lag, lead and row_number over a key's versions by batches (see
    // [`window`]).
    let state = window::install(
        SessionStateBuilder::new()
            .with_config(config)
            .with_default_features(),
    )
    // Groupings of many groups in cache-sized parts (see [`fanout`]).
    .with_physical_optimizer_rule(Arc::new(fanout::GroupFanOut))
    // A grouping's first step per union branch, without the keys the
    // branch holds constant (see [`branches`]); after the fan-out, which
    // reads the first step's input.
    .with_physical_optimizer_rule(Arc::new(branches::BranchGrouping))
    // A filter on `_op` under a join's probe side, evaluated by the join
    // on the rows it matched (see [`probefilter`]).
    .with_physical_optimizer_rule(Arc::new(probefilter::ProbeFilterInJoin))
    // A join on one integer key checks its probe side's keys against a
    // bitmap of its build side's (see [`keybitmap`]).
    .with_physical_optimizer_rule(Arc::new(keybitmap::KeyBitmapRule))
    .build();
    let ctx = SessionContext::new_with_state(state);
    let url = ObjectStoreUrl::parse(ARCHIVE_URL).expect("a valid URL");
    ctx.register_object_store(url.as_ref(), store);
    ctx
}

/// A DataFusion error as the user sees it: the message and, when
/// DataFusion or the parser knows it, where in the SQL it is.
pub(crate) fn sql_error(sql: &str, e: DataFusionError) -> Error {
    // An error of ours (reading the archive) raised inside DataFusion.
    if let DataFusionError::External(inner) = e.find_root()
        && let Some(ours) = inner.downcast_ref::<Error>()
    {
        return match ours {
            Error::Fatal {
                kind,
                message,
                hint,
            } => Error::fatal(message.clone(), hint.clone()).with_kind(*kind),
            other => Error::fatal(
                crate::error::Report(other).to_string(),
                other.hint().unwrap_or_default(),
            )
            .with_kind(other.kind()),
        };
    }
    let message = e.strip_backtrace();
    let mut text = message.clone();
    if let Some((line, column, width)) = locate(&e, &message) {
        text.push_str(&point(sql, line, column, width));
    }
    let hint = if message.contains("not found") || message.contains("No field named") {
        "SHOW TABLES lists the tables; SHOW COLUMNS FROM <table> their columns; `waltail query --help` says what each table holds"
    } else {
        "fix the statement; `waltail query --help` describes the tables"
    };
    Error::fatal(text, hint)
}

/// Where an error is: (line, column, width), from the diagnostic's span or
/// the parser's `at Line: N, Column: M`.
fn locate(e: &DataFusionError, message: &str) -> Option<(usize, usize, usize)> {
    if let Some(span) = e.diagnostic().and_then(|d| d.span)
        && span.start.line > 0
    {
        let width = if span.end.line == span.start.line && span.end.column > span.start.column {
            (span.end.column - span.start.column) as usize
        } else {
            1
        };
        return Some((span.start.line as usize, span.start.column as usize, width));
    }
    let at = message.rfind("at Line: ")?;
    let rest = &message[at + "at Line: ".len()..];
    let (line, rest) = rest.split_once(", Column: ")?;
    let column: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some((line.trim().parse().ok()?, column.parse().ok()?, 1))
}

/// The SQL line `line` with a caret under `column` (both from 1).
fn point(sql: &str, line: usize, column: usize, width: usize) -> String {
    let Some(text) = sql.lines().nth(line.saturating_sub(1)) else {
        return format!("\n  at line {line}, column {column}");
    };
    let pad: String = text
        .chars()
        .take(column.saturating_sub(1))
        .map(|c| if c == '\t' { '\t' } else { ' ' })
        .collect();
    let number = line.to_string();
    format!(
        "\n  at line {line}, column {column}:\n  {number} | {text}\n  {} | {pad}{}",
        " ".repeat(number.len()),
        "^".repeat(width.max(1))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_points_at_its_line_and_column() {
        let sql = "SELECT *\nFORM t";
        assert_eq!(
            point(sql, 2, 1, 4),
            "\n  at line 2, column 1:\n  2 | FORM t\n    | ^^^^"
        );
        assert_eq!(
            point("\tSELECT x", 1, 3, 1),
            "\n  at line 1, column 3:\n  1 | \tSELECT x\n    | \t ^"
        );
    }

    #[test]
    fn parser_errors_are_located_from_their_message() {
        let sql = "SELECT * FORM t";
        let e = DFParserBuilder::new(sql)
            .build()
            .and_then(|mut p| p.parse_statements())
            .unwrap_err();
        let message = e.strip_backtrace();
        let (line, column, _) = locate(&e, &message).unwrap();
        assert_eq!((line, column), (1, 10), "{message}");
    }

    #[tokio::test]
    async fn planning_errors_carry_the_span_of_the_name() {
        let ctx = SessionContext::new_with_config({
            let mut c = SessionConfig::new();
            c.options_mut().sql_parser.collect_spans = true;
            c
        });
        let sql = "SELECT 1 AS a\nFROM   nowhere";
        let e = ctx.sql(sql).await.unwrap_err();
        let shown = sql_error(sql, e).to_string();
        assert!(shown.contains("at line 2, column 8"), "{shown}");
        assert!(
            shown.contains("  2 | FROM   nowhere\n    |        ^"),
            "{shown}"
        );
    }
}
