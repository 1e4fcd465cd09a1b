//! `waltail compact`: runs a compaction (or only plans it, `--dry-run`; or
//! only vacuums, `--vacuum`) and prints what it did.

use crate::Result;
use crate::compact::{self, Options};
use crate::config::Config;

/// Runs `waltail compact` and prints its plan (dry run) or its summary.
pub(crate) async fn compact(config: &Config, opts: &Options) -> Result<()> {
    let summary = compact::compact(config, opts).await?;
    if opts.vacuum {
        println!(
            "vacuumed {} files of {} tables: replaced more than {} ago, or named by no commit and older than {}",
            summary.vacuumed,
            summary.tables.len(),
            humantime::format_duration(config.compact.retain),
            humantime::format_duration(config.compact.retain.max(compact::UNNAMED_AFTER)),
        );
    } else {
        print!("{}", compact::render(&summary, opts.dry_run));
    }
    Ok(())
}
