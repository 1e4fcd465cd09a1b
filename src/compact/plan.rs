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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::archive::listing::ArchiveObject;
use crate::archive::schema::SchemaRecord;
use crate::lakehouse::compacted::{self, Compacted};
use crate::lakehouse::line;
use crate::lakehouse::typing::TableShape;
use crate::{Error, Result};

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

/// The tables of a run, fixed with its plan: where each stands and its
/// shape, checked against what earlier runs wrote (see [`shapes`]).
pub(crate) struct Tables {
    /// Each table's two Delta logs.
    pub compacted: BTreeMap<String, Compacted>,
    /// What the logs say of each table: where it continues, its columns.
    pub entries: BTreeMap<String, compacted::TableEntry>,
    /// The shapes the run writes, by table index (see [`line::Shapes`]).
    pub shapes: Arc<line::Shapes>,
    /// Each table's columns whose type widened since its history was
    /// written: its earlier files are rewritten (see
    /// [`super::rewrite`]).
    pub widened: BTreeMap<String, Vec<String>>,
}

impl Tables {
    /// The seq table `table` continues from.
    pub(crate) fn start(&self, table: &str) -> u64 {
        self.entries.get(table).map_or(0, |e| e.next_seq)
    }
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

/// The tables a run compacts: the named ones (each must have a schema
/// record), or every table with one.
pub(crate) fn select_tables(
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
pub(crate) fn shapes(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::archive::schema::RecordColumn;
    use crate::lakehouse::typing::{Column, Kind};

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
