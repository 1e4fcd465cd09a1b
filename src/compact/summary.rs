//! What a compaction run did, and the text `waltail compact` prints of it.

use std::collections::BTreeSet;
use std::time::Duration;

use indicatif::HumanBytes;

use super::plan::Plan;

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Archive objects read.
    pub objects: usize,
    /// Their bytes (NDJSON as stored).
    pub bytes_in: u64,
    /// The first and last seq compacted.
    pub seqs: Option<(u64, u64)>,
    /// Changes compacted.
    pub changes: u64,
    /// Changes skipped because their seq was already compacted (an object
    /// written twice under different names).
    pub repeats: u64,
    /// Objects left out because another object holds all their changes.
    pub repeated_objects: usize,
    /// History files written.
    pub history_files: usize,
    /// Their bytes.
    pub history_bytes: u64,
    /// Latest-view files written.
    pub latest_files: usize,
    /// The rows of the new latest views.
    pub latest_rows: u64,
    /// Their bytes.
    pub latest_bytes: u64,
    /// The tables compacted (`schema.table`).
    pub tables: BTreeSet<String>,
    /// Files vacuum deleted (see [`super::vacuum_tables`]).
    pub vacuumed: usize,
    /// History files written again in a column's wider type (see [`super::rewrite`]).
    pub rewritten: usize,
    /// Delta commits written.
    pub commits: usize,
    /// The time the commits took.
    pub commit_time: Duration,
    /// The first seq not in the archive when a gap stopped the run.
    pub gap: Option<u64>,
    /// The run's wall time.
    pub elapsed: Duration,
}

impl Summary {
    /// What `plan` takes: the objects, their bytes and seqs, the tables.
    pub(crate) fn planned(plan: &Plan) -> Summary {
        let objects = || plan.files.iter().flat_map(|f| &f.objects);
        Summary {
            seqs: Some((plan.from_seq, plan.to_seq)),
            objects: objects().count(),
            bytes_in: objects().map(|o| o.size).sum(),
            tables: plan.tables.iter().cloned().collect(),
            repeated_objects: plan.repeated.len(),
            ..Summary::default()
        }
    }
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
