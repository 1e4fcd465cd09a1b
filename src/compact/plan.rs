//! What a run compacts: the archive objects that continue, without a gap,
//! where the tables' logs say compaction stopped, grouped into history
//! files. Fixed before anything is written.
//!
//! Exactly once rests on two rules:
//! - seqs are compacted as one contiguous run from the first seq in the
//!   archive: a run takes the objects that continue, without a gap, the
//!   lowest next seq of the tables it compacts, and nothing after a gap (a
//!   batch not in the archive yet, e.g. parked), so every change is applied
//!   once and in order; an object whose seqs are already compacted (a
//!   duplicate) is skipped;
//! - where a table continues is read from its Delta logs alone (the txn
//!   version of its last commit, see [`crate::lakehouse::compacted`]): a run that
//!   stopped before its commit left nothing a reader or the next run sees.

use crate::archive::listing::ArchiveObject;

/// What a run compacts, fixed before anything is written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    pub from_seq: u64,
    pub to_seq: u64,
    /// The tables compacted (`schema.table`).
    pub tables: Vec<String>,
    /// History files to write, in seq order.
    pub files: Vec<PlannedFile>,
    /// Objects left out because every change in them is in another object
    /// of the plan (the same batch written under two names).
    pub repeated: Vec<String>,
}

/// One history file per table: the changes of `objects` in `first..=last`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PlannedFile {
    pub date: String,
    pub first_seq: u64,
    pub last_seq: u64,
    pub objects: Vec<PlannedObject>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PlannedObject {
    pub key: String,
    pub size: u64,
    /// Seqs of this object below this one are already compacted (an object
    /// that overlaps an earlier one): they are skipped.
    pub from_seq: u64,
}

/// The objects a run takes: those continuing `next_seq` (or the archive's
/// first seq) without a gap, grouped into history files of one date and at
/// most `file_bytes` of NDJSON (or one object).
pub(crate) fn plan_files(
    objects: &[ArchiveObject],
    next_seq: Option<u64>,
    file_bytes: u64,
) -> Planned {
    let mut planned = Planned::default();
    let Some(start) = next_seq.or_else(|| objects.iter().map(|o| o.first_seq).min()) else {
        return planned;
    };
    let mut cursor = start;
    let files = &mut planned.files;
    let mut size = 0u64;
    // `objects` is sorted by first seq.
    for o in objects {
        if o.last_seq < cursor {
            if o.last_seq >= start {
                planned.repeated.push(o.key.clone());
            }
            continue; // compacted already, or a repeat of a taken object
        }
        if o.first_seq > cursor {
            planned.gap = Some(cursor);
            break;
        }
        let planned = PlannedObject {
            key: o.key.clone(),
            size: o.size,
            from_seq: cursor,
        };
        match files.last_mut() {
            Some(f) if f.date == o.date && size + o.size <= file_bytes => {
                f.last_seq = o.last_seq;
                f.objects.push(planned);
                size += o.size;
            }
            _ => {
                files.push(PlannedFile {
                    date: o.date.clone(),
                    first_seq: cursor,
                    last_seq: o.last_seq,
                    objects: vec![planned],
                });
                size = o.size;
            }
        }
        cursor = o.last_seq + 1;
    }
    planned
}

/// What [`plan_files`] found.
#[derive(Debug, Default)]
pub(crate) struct Planned {
    pub files: Vec<PlannedFile>,
    /// The first missing seq, when a gap stopped the plan.
    pub gap: Option<u64>,
    /// Objects whose changes are all in objects taken before them.
    pub repeated: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(date: &str, first: u64, last: u64, size: u64) -> ArchiveObject {
        ArchiveObject {
            key: format!("{date}/p-{first}-{last}.ndjson"),
            date: date.into(),
            first_seq: first,
            last_seq: last,
            size,
        }
    }

    #[test]
    fn plan_groups_by_date_and_size_and_stops_at_a_gap() {
        let objects = [
            obj("2024-01-01", 1, 10, 40),
            obj("2024-01-01", 11, 20, 40),
            obj("2024-01-01", 21, 30, 40),
            obj("2024-01-02", 31, 40, 40),
            obj("2024-01-02", 51, 60, 40),
        ];
        let p = plan_files(&objects, None, 100);
        let ranges: Vec<_> = p.files.iter().map(|f| (f.first_seq, f.last_seq)).collect();
        assert_eq!(ranges, [(1, 20), (21, 30), (31, 40)]);
        assert_eq!(p.gap, Some(41));
        let p = plan_files(&objects, Some(41), 100);
        assert!(p.files.is_empty());
        assert_eq!(p.gap, Some(41));
        assert!(p.repeated.is_empty(), "compacted before is not a repeat");
    }

    #[test]
    fn plan_skips_compacted_and_duplicated_seqs() {
        let objects = [
            obj("2024-01-01", 1, 10, 1),
            obj("2024-01-01", 1, 10, 1),
            obj("2024-01-01", 5, 14, 1),
            obj("2024-01-01", 15, 20, 1),
        ];
        let p = plan_files(&objects, Some(3), 1000);
        assert_eq!(p.gap, None);
        assert_eq!(p.repeated, [objects[1].key.clone()]);
        let f = &p.files[0];
        assert_eq!((f.first_seq, f.last_seq), (3, 20));
        let from: Vec<u64> = f.objects.iter().map(|o| o.from_seq).collect();
        assert_eq!(from, [3, 11, 15]);
    }
}
