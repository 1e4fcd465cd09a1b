//! The command line: parses arguments, loads the configuration, runs the
//! command and turns errors into a message, a fix and an exit code.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::Error;
use crate::commands;
use crate::config::Config;
use crate::error::{ErrorKind, Report};
use crate::pipeline::RunOptions;
use crate::telemetry::{self, LogFormat};

/// Archive every committed PostgreSQL change to S3 or a local folder as NDJSON.
#[derive(Debug, Parser)]
#[command(name = "waltail", version, about, long_about = None)]
pub struct Cli {
    /// Configuration file [default: ./waltail.toml when it exists; every key
    /// can also be set as WALTAIL_<SECTION>_<KEY>]
    #[arg(
        long,
        short,
        global = true,
        env = "WALTAIL_CONFIG",
        value_name = "FILE"
    )]
    pub config: Option<PathBuf>,

    /// Log line format on stderr (filter with WALTAIL_LOG, e.g. debug)
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// What to do; each subcommand's help says what it does.
    #[command(subcommand)]
    pub command: Command,
}

/// waltail's subcommands; each variant's doc is its `--help` line.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check the source and the destination, printing the fix for each failure
    Check,
    /// Stream committed changes into the archive until SIGINT/SIGTERM
    Run {
        /// The recorded replication slot has disappeared: create a new one and
        /// continue numbering where the archive stopped (then run a backfill)
        #[arg(long)]
        recreate_slot: bool,
    },
    /// Archive the rows that already exist as `read` events, while streaming
    /// and writes go on (asks after showing an estimate)
    Backfill {
        /// Tables to backfill, as in source.tables [default: all of them]
        #[arg(value_name = "TABLE")]
        tables: Vec<String>,
        /// Start without asking
        #[arg(long, short)]
        yes: bool,
        /// Rows per chunk, each read in one short transaction [default:
        /// backfill.chunk_size, 20000]
        #[arg(long, value_name = "ROWS")]
        chunk_size: Option<u64>,
        /// Cancel the backfills in progress instead
        #[arg(long, conflicts_with_all = ["tables", "yes"])]
        cancel: bool,
    },
    /// Rewrite the archive as typed Parquet: every change per table and date,
    /// and a latest-row view per table (incremental, exactly once)
    #[cfg(feature = "lakehouse")]
    Compact {
        /// Tables to compact, as schema.table [default: every table in the archive]
        #[arg(value_name = "TABLE")]
        tables: Vec<String>,
        /// Show what would be compacted, write nothing
        #[arg(long)]
        dry_run: bool,
        /// Compact nothing; delete the files that no snapshot younger than
        /// compact.retain needs, and files no commit names that are older than
        /// a day (or compact.retain, if longer)
        #[arg(long, conflicts_with = "dry_run")]
        vacuum: bool,
    },
    /// Run SQL over the archive: `public.orders` is the latest row per key
    /// (compacted view plus the changes archived since), `history.public.orders`
    /// every version with `_op`, `_seq`, `_lsn`, `_key`, `_old`, `_unchanged`
    /// and `date`, and `waltail.changes` the raw envelopes (op, table, data,
    /// old, seq, idempotency_key, commit_lsn, date). With no SQL on a terminal,
    /// a prompt: statements end with `;`, `\timing` times them, `\q` or Ctrl-D
    /// quits; it keeps the tables it built while the archive is unchanged.
    #[command(
        after_help = "Examples:\n  waltail query \"SELECT status, count(*) FROM public.orders GROUP BY status\"\n  waltail query --at 2026-11-30T08:00:00Z \"SELECT * FROM orders WHERE id = 7\"\n  waltail query --format json -f report.sql > report.json\n  echo \"SELECT * FROM history.public.orders WHERE date = '2026-11-30'\" | waltail query -"
    )]
    #[cfg(feature = "lakehouse")]
    Query {
        /// The SQL (one or more statements); `-` reads it from stdin [default:
        /// stdin when it is not a terminal, else a prompt]
        #[arg(value_name = "SQL", conflicts_with = "file")]
        sql: Option<String>,
        /// Read the SQL from FILE (`-`: stdin)
        #[arg(long, short, value_name = "FILE")]
        file: Option<PathBuf>,
        /// Output format [default: table on a terminal, else csv]
        #[arg(long, value_enum)]
        format: Option<crate::query::output::Format>,
        /// The archive as it was at a seq (changes up to it) or an RFC 3339
        /// time (the changes archived by then, which is within about a
        /// second of their commit); the latest views are rebuilt from the
        /// history when the compacted ones are newer
        #[arg(long, value_name = "SEQ|TIME")]
        at: Option<crate::query::catalog::At>,
        /// Print each statement's time on stderr, split into the snapshot of
        /// the archive, planning and running (at the prompt, `\timing`
        /// turns it on and off)
        #[arg(long)]
        timing: bool,
        /// Memory for the columns of the latest views that a statement reads
        /// again: they are then decoded once and kept, so repeating a
        /// statement at the prompt or in a script skips the Parquet decoding
        /// (0: none kept)
        #[arg(long, value_name = "MiB", default_value_t = 1024)]
        keep_decoded: usize,
    },
    /// Not in this build (built without the `lakehouse` feature)
    #[cfg(not(feature = "lakehouse"))]
    Compact {
        /// What was given: refused whatever it is
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
    /// Not in this build (built without the `lakehouse` feature)
    #[cfg(not(feature = "lakehouse"))]
    Query {
        /// What was given: refused whatever it is
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
    /// Where the pipeline stands: position, lag, rate, parked batches
    Status {
        /// One JSON object instead of text
        #[arg(long)]
        json: bool,
    },
    /// Print the configuration this command line would use, as a waltail.toml:
    /// each key's value and where it came from (the file, a WALTAIL_*
    /// variable, the default); secrets are hidden
    Config {
        /// Print the JSON Schema of waltail.toml instead (editors complete and
        /// check the file with it; schemas/config.schema.json is this)
        #[arg(long)]
        schema: bool,
    },
    /// Print shell completions (bash, zsh, fish, elvish, powershell) to stdout
    Completions {
        /// The shell to print completions for
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff) to stdout: `waltail man > waltail.1`
    Man,
    /// Batches that failed every attempt, and the batches held behind them
    #[command(subcommand)]
    Parked(ParkedCommand),
}

/// `waltail parked` subcommands: look at and replay the parked batches.
#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked and held batches with their last error
    List,
    /// Deliver a parked batch again under the same key, then the batches held
    /// behind it, in order (through the running pipeline if there is one)
    Replay {
        /// The batch id (its first seq, as `parked list` shows)
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<u64>,
        /// Replay every parked batch
        #[arg(long)]
        all: bool,
    },
}

/// mimalloc's `mi_option_purge_delay`, by its place in `mi_option_t` of the
/// mimalloc 3 header that libmimalloc-sys 0.1.49 builds (the crate leaves
/// the option out of its constants); a test checks it reads the option's
/// documented default.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc's default purge delay in milliseconds (mimalloc 3).
const MI_DEFAULT_PURGE_DELAY: std::ffi::c_long = 1000;

/// Tells mimalloc to keep the memory the process frees rather than return
/// it to the OS a second later (its purge): a compaction frees and takes
/// again hundreds of MiB as its buffers, row groups and spool rounds come
/// and go, and each page taken again was faulted in and zeroed by the
/// kernel (transparent huge pages: 2 MiB at a time), 7-9% of its CPU in a
/// profile. Measured on the 5,000,000-change benchmark (this setting or
/// `MIMALLOC_PURGE_DELAY=-1`, alternated with the default): faster in 10
/// of 14 pairs on this noisy VM; the last five, wall 8.1 -> 7.2 s and CPU
/// 14.2 -> 13.2 s on average; peak RSS 10-20% more (what a run holds
/// at its peak stays its own until it ends, which is soon). A
/// `MIMALLOC_PURGE_DELAY` the user set wins; so does an allocator whose
/// option 15 is not the purge delay (another mimalloc version).
///
/// Every command also calls it once its work is done: at exit mimalloc
/// otherwise hands back every page it holds, one `madvise` per range (35
/// for a small query), memory the kernel takes back with the whole process
/// a moment later anyway. `perf record` of `waltail query` on the benchmark
/// archive of `scripts/bench-query.sh`: a tenth of a small query's process
/// went to that purge.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: both functions take and return plain integers. Called before
    // the runtime starts any thread, or after its work has returned and its
    // threads are idle (a purge running then reads the option as either
    // value, both valid).
    unsafe {
        if libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) == MI_DEFAULT_PURGE_DELAY {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        }
    }
}

/// Turns transparent huge pages off for this process (`prctl`), for every
/// command but `compact` (see [`huge_pages`]): mimalloc asks the kernel for
/// 2 MiB pages, and each one the process touches is zeroed whole, mostly
/// for nothing. Measured:
/// - `waltail query` on the benchmark archive of `scripts/bench-query.sh`
///   (`perf record`): a third of a small query's CPU went to
///   `clear_page_erms`; with small pages (and the fixed-address binary, see
///   `build.rs`) the whole process took 20-30% less wall time on the short
///   queries, and 4-12% more on the long ones (the window over every
///   version, `--at`), within this VM's swings but not in their favour:
///   short queries are the common case.
/// - `waltail run` (`scripts/bench-e2e.sh`, backlogs b and c, two
///   alternated pairs): the same CPU per object, peak RSS 37-39 MB -> 32-34
///   MB.
/// - `waltail backfill` (`scripts/bench-backfill.sh`, 1,000,000 rows into a
///   folder, two readers, eleven alternated pairs): no CPU
///   difference beyond this VM's swings; which binary ran first in a pair
///   mattered more.
///
/// It runs before `main` (the binary calls it from `.init_array`), before
/// the first allocation touches memory: mimalloc's first pages are touched
/// while Rust's runtime starts, and set in `main` it came too late for
/// them, two 2 MiB pages a query, zeroed by the kernel. On this VM that
/// zeroing is at times slow (a page the host took back is faulted in
/// again): `perf record` of ten top-k queries found one whose start spent
/// 28 ms in it, and the slowest quarter of their processes spent 5-10 ms.
/// A `MIMALLOC_ALLOW_THP` the user set wins.
pub fn small_pages() {
    huge_pages(false);
}

/// Turns transparent huge pages on or off for this process (`prctl`); the
/// pages faulted in from then on follow it. On for `compact`, which holds
/// hundreds of MiB for the whole run (see [`keep_freed_memory`]). A
/// `MIMALLOC_ALLOW_THP` the user set wins.
fn huge_pages(on: bool) {
    #[cfg(target_os = "linux")]
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: PR_SET_THP_DISABLE takes and returns plain integers and
        // touches no memory of ours. A kernel without it refuses with
        // EINVAL, and the process goes on as it was.
        unsafe {
            libc::prctl(libc::PR_SET_THP_DISABLE, libc::c_ulong::from(!on), 0, 0, 0);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = on;
}

/// Runs `waltail run` under the kernel's batch policy (`SCHED_BATCH`):
/// its threads never preempt the thread running on their core when they
/// wake, which is usually the walsender that just sent them a message.
/// Under the normal policy, a `waltail run` that keeps up with the
/// walsender is woken by each message and takes the walsender's core from
/// it; the two then trade the core message by message. Measured
/// (`scripts/bench-e2e.sh`, a local folder, 30,000 transactions of 10
/// inserts, a binary alternated with itself under `chrt -b 0`): the
/// walsender switched 56,919 times in a slow drain against 704 in a fast
/// one (`/proc/<pid>/schedstat`), and the batch policy drained at 1.25-1.64
/// of `pg_recvlogical`'s rate against 0.81-0.92, with half of waltail's
/// CPU per object. A thread of the batch policy still gets its fair share
/// of the CPU; it only waits for the running thread's slice when woken,
/// and the commit-to-object latency stayed under 100 ms at 2,000
/// transactions/s. The threads started afterwards (the runtime's) inherit
/// the policy. Only the normal policy is changed: a process started under
/// another (systemd's `CPUSchedulingPolicy=`, `chrt`) keeps it. A kernel
/// that refuses leaves the normal policy.
fn batch_scheduling() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: both calls take plain integers and a sched_param we own;
        // pid 0 is the calling thread.
        unsafe {
            if libc::sched_getscheduler(0) == libc::SCHED_OTHER {
                libc::sched_setscheduler(0, libc::SCHED_BATCH, &param);
            }
        }
    }
}

/// Exit codes: 0 success, 1 a check or the pipeline failed, 2 bad configuration.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // Small pages are set before main (see [`small_pages`]); a compaction
    // takes huge pages again.
    if matches!(cli.command, Command::Compact { .. }) {
        huge_pages(true);
    }
    // These need no configuration.
    match &cli.command {
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            let mut out = Vec::new();
            clap_complete::generate(*shell, &mut cmd, "waltail", &mut out);
            return print_quietly(&out);
        }
        Command::Config { schema: true } => {
            return print_quietly(crate::config::schema().as_bytes());
        }
        // Said before anything else, whatever the configuration.
        #[cfg(not(feature = "lakehouse"))]
        Command::Compact { .. } | Command::Query { .. } => {
            eprintln!(
                "error: compact and query are not in this build of waltail: it was built streaming-only, without the `lakehouse` feature"
            );
            eprintln!(
                "  fix: install the full build (cargo install --locked --path <the repository> --profile dist, without --no-default-features)"
            );
            return ExitCode::FAILURE;
        }
        Command::Man => {
            let cmd = <Cli as clap::CommandFactory>::command();
            let mut out = Vec::new();
            if let Err(e) = clap_mangen::Man::new(cmd).render(&mut out) {
                eprintln!("error: cannot render the man page: {e}");
                return ExitCode::FAILURE;
            }
            return print_quietly(&out);
        }
        _ => {}
    }
    // A backfill or a compaction on a terminal draws a progress bar; routine log lines
    // would break it, so only warnings show there unless WALTAIL_LOG says.
    let quiet = matches!(
        cli.command,
        Command::Backfill { .. } | Command::Compact { .. }
    ) && std::io::IsTerminal::is_terminal(&std::io::stderr())
        // A query's output is its result: only warnings and errors beside it.
        || matches!(cli.command, Command::Query { .. });
    telemetry::init_logging(cli.log_format, if quiet { "warn" } else { "info" });
    let (config, sources) = match Config::load_explained(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {}", Report(&e));
            return ExitCode::from(2);
        }
    };
    if matches!(cli.command, Command::Config { .. }) {
        let text = crate::config::effective::render(&config, &sources);
        return print_quietly(text.as_bytes());
    }
    if matches!(cli.command, Command::Compact { .. }) {
        // Before any thread starts: mimalloc's options are not thread safe.
        keep_freed_memory();
    }
    if matches!(cli.command, Command::Run { .. }) {
        batch_scheduling();
    }
    let is_query = matches!(cli.command, Command::Query { .. });
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    #[cfg(feature = "lakehouse")]
    if is_query {
        // A query over a local folder reads every file through blocking
        // threads (object_store's LocalFileSystem); left at tokio's 512, a
        // query of 16 Parquet files started 14 of them, each with its own
        // allocator heap to fault in: 40% of the process's time went to
        // the kernel. One per core reads as fast (measured: 10-15% less
        // wall time, half the system time, the same user time), plus the
        // threads that reads of Delta logs block (see `LOG_CALLS`).
        builder.max_blocking_threads(
            std::thread::available_parallelism().map_or(2, std::num::NonZero::get)
                + crate::lakehouse::delta::LOG_CALLS,
        );
    }
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Check => commands::check::check(&config).await,
            Command::Run { recreate_slot } => {
                commands::run::run(&config, RunOptions { recreate_slot }).await
            }
            Command::Backfill {
                tables,
                yes,
                chunk_size,
                cancel,
            } => {
                let opts = commands::backfill::Options {
                    tables,
                    yes,
                    chunk_size,
                    cancel,
                };
                commands::backfill::backfill(&config, opts).await
            }
            Command::Status { json } => commands::status::status(&config, json).await,
            #[cfg(feature = "lakehouse")]
            Command::Compact {
                tables,
                dry_run,
                vacuum,
            } => {
                let opts = crate::compact::Options {
                    dry_run,
                    tables,
                    vacuum,
                };
                commands::compact::compact(&config, &opts)
                    .await
                    .map(|()| ExitCode::SUCCESS)
            }
            #[cfg(feature = "lakehouse")]
            Command::Query {
                sql,
                file,
                format,
                at,
                timing,
                keep_decoded,
            } => {
                let opts = crate::query::Options {
                    sql,
                    file,
                    format,
                    at,
                    timing,
                    keep_decoded_mib: keep_decoded,
                };
                commands::query::query(&config, &opts).await
            }
            #[cfg(not(feature = "lakehouse"))]
            Command::Compact { .. } | Command::Query { .. } => {
                unreachable!("handled before the configuration is loaded")
            }
            Command::Completions { .. } | Command::Man | Command::Config { .. } => {
                unreachable!("handled before the runtime starts")
            }
            Command::Parked(ParkedCommand::List) => commands::parked::list(&config),
            Command::Parked(ParkedCommand::Replay { id, all: _ }) => {
                commands::parked::replay(&config, id).await
            }
        }
    });
    keep_freed_memory();
    if is_query {
        // A query has printed its result and written what it keeps
        // (synchronously): nothing of it is left running that the process
        // must wait for, and waiting for the runtime's threads to stop one
        // by one took 0.3-0.5 ms of a short query's process.
        runtime.shutdown_background();
    } else {
        drop(runtime);
    }
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", Report(&e));
            if let Some(hint) = e.hint() {
                eprintln!("  fix: {hint}");
            }
            exit_code(&e)
        }
    }
}

/// Writes to stdout; a closed pipe (`| head`) is not an error.
fn print_quietly(bytes: &[u8]) -> ExitCode {
    use std::io::Write;
    match std::io::stdout().write_all(bytes) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The exit code of a command that failed with `e` (the README lists
/// them): 2 for an invalid configuration, or a usage problem the command
/// found (e.g. a confirmation that cannot be asked); 3 when another process
/// holds the pipeline or the table, so nothing was done and a supervisor
/// can tell it from a failure; 1 for everything else.
fn exit_code(e: &Error) -> ExitCode {
    match e.kind() {
        ErrorKind::Config => ExitCode::from(2),
        ErrorKind::Locked => ExitCode::from(3),
        _ => ExitCode::FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Option 15 is mimalloc's purge delay: it reads that option's
    /// documented default (a libmimalloc-sys building another mimalloc
    /// fails here), and compact's setting turns purging off.
    #[test]
    fn compact_keeps_the_memory_it_frees() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return; // the user's setting, which keep_freed_memory leaves alone
        }
        // SAFETY: reads and writes an integer option; nothing else in the
        // tests touches mimalloc's options.
        let delay = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(delay(), MI_DEFAULT_PURGE_DELAY);
        keep_freed_memory();
        assert_eq!(delay(), -1);
    }
}
