//! The changes not compacted yet, applied over a compacted latest view
//! without loading that view: an overlay of the keys the changes touch.
//!
//! The rules are the latest view's (see `compact::latest`): changes come in
//! seq order; an upsert replaces its key's row and takes the previous
//! version's value for each column it left out (unchanged TOAST); an update
//! that moves the key removes the old key's row; a delete removes the row; a
//! truncate removes every row, the compacted ones included.
//!
//! The previous version of a row the overlay has not seen yet is in the
//! compacted view (the base). It is only needed for the columns an upsert
//! left out, so the overlay records which base row to fill them from, and
//! the caller fetches just those rows ([`Overlay::wanted`]) and hands them
//! back ([`Overlay::fill`]). The result is the base minus every key the
//! overlay holds ([`Overlay::touched`]) plus the overlay's live rows.
//!
//! Memory: one entry per key the changes touch, not the base's rows.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, StringArray};
use arrow::datatypes::{Field, Schema, SchemaRef};

use crate::lakehouse::change::{ChangeOp, TypedChange};
use crate::lakehouse::typing::array::build_array;
use crate::lakehouse::typing::{Cell, TableShape};

/// A row as the changes left it.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    cells: Vec<Cell>,
    /// The base key whose values fill the `Absent` cells, when the row took
    /// them from a version only the base holds.
    fill_from: Option<Box<str>>,
}

/// The keys touched by the changes since the base, and what became of them.
#[derive(Debug)]
pub(crate) struct Overlay {
    shape: Arc<TableShape>,
    /// `None`: the key's row is gone (deleted, or moved to another key).
    rows: HashMap<Box<str>, Option<Row>>,
    /// Whether the base's rows still count (no truncate since, and there is
    /// a base at all).
    base_visible: bool,
}

impl Overlay {
    /// An overlay over a base (`has_base`), or a view built from nothing.
    pub(crate) fn new(shape: Arc<TableShape>, has_base: bool) -> Overlay {
        Overlay {
            shape,
            rows: HashMap::new(),
            base_visible: has_base,
        }
    }

    /// Applies one change; changes come in seq order. The change is taken
    /// whole: its cells move into the row, and the previous version's
    /// cells move into the columns it left out, with no copy of either.
    pub(crate) fn apply(&mut self, change: TypedChange) {
        match change.op {
            ChangeOp::Truncate => {
                self.rows.clear();
                self.base_visible = false;
            }
            ChangeOp::Delete => {
                if let Some(k) = change.key.as_deref().or(change.old_key.as_deref()) {
                    self.set(k, None);
                }
            }
            ChangeOp::Upsert => {
                let Some(key) = change.key.as_deref() else {
                    return;
                };
                let mut previous = match change.old_key.as_deref() {
                    // An update that changed the key: the row was under the old one.
                    Some(old) if old != key => {
                        let p = self.take(old);
                        self.set(old, None);
                        p
                    }
                    _ => self.take(key),
                };
                let mut fill_from = None;
                let mut cells = change.cells;
                for (i, cell) in cells.iter_mut().enumerate() {
                    if *cell != Cell::Absent {
                        continue;
                    }
                    *cell = match &mut previous {
                        Some(p) => {
                            if p.cells[i] == Cell::Absent {
                                fill_from.clone_from(&p.fill_from);
                            }
                            std::mem::replace(&mut p.cells[i], Cell::Null)
                        }
                        None => Cell::Null,
                    };
                }
                self.set(key, Some(Row { cells, fill_from }));
            }
        }
    }

    /// Sets `key`'s entry, allocating the key only when it is new.
    fn set(&mut self, key: &str, row: Option<Row>) {
        match self.rows.get_mut(key) {
            Some(slot) => *slot = row,
            None => {
                self.rows.insert(key.into(), row);
            }
        }
    }

    /// The previous version of `key`'s row, moved out of the overlay (its
    /// entry is set again by the caller): the overlay's, else the base's
    /// (its values still to fetch: every cell `Absent`), else none.
    fn take(&mut self, key: &str) -> Option<Row> {
        match self.rows.get_mut(key) {
            Some(row) => row.take(),
            None if self.base_visible => Some(Row {
                cells: vec![Cell::Absent; self.shape.columns.len()],
                fill_from: Some(key.into()),
            }),
            None => None,
        }
    }

    /// The base keys whose rows [`Overlay::fill`] needs.
    pub(crate) fn wanted(&self) -> HashSet<Box<str>> {
        self.rows
            .values()
            .flatten()
            .filter_map(|r| r.fill_from.clone())
            .collect()
    }

    /// Fills the left-out cells from the base rows of [`Overlay::wanted`]
    /// (key -> cells); a key the base lacks fills with nulls.
    pub(crate) fn fill(&mut self, base: &HashMap<Box<str>, Vec<Cell>>) {
        for row in self.rows.values_mut().flatten() {
            let Some(from) = row.fill_from.take() else {
                continue;
            };
            let source = base.get(&from);
            for (i, cell) in row.cells.iter_mut().enumerate() {
                if *cell == Cell::Absent {
                    *cell = source.map_or(Cell::Null, |s| s[i].clone());
                }
            }
        }
    }

    /// Whether the base's rows are still part of the view.
    pub(crate) fn base_visible(&self) -> bool {
        self.base_visible
    }

    /// Every key whose base row the view must not show.
    pub(crate) fn touched(&self) -> HashSet<Box<str>> {
        self.rows.keys().cloned().collect()
    }

    /// Whether the overlay changes nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.base_visible
    }

    /// The live rows, in key order, as batches of the data columns and `_key`.
    pub(crate) fn batches(&self, rows_per_batch: usize) -> Vec<RecordBatch> {
        let schema = overlay_schema(&self.shape);
        let mut live: Vec<(&Box<str>, &Row)> = self
            .rows
            .iter()
            .filter_map(|(k, r)| r.as_ref().map(|r| (k, r)))
            .collect();
        live.sort_unstable_by(|a, b| a.0.cmp(b.0));
        live.chunks(rows_per_batch.max(1))
            .map(|chunk| {
                let mut columns: Vec<ArrayRef> = self
                    .shape
                    .columns
                    .iter()
                    .enumerate()
                    .map(|(i, c)| build_array(c.kind, chunk.iter().map(|(_, r)| &r.cells[i])))
                    .collect();
                columns.push(Arc::new(
                    chunk
                        .iter()
                        .map(|(k, _)| Some(&***k))
                        .collect::<StringArray>(),
                ));
                RecordBatch::try_new(Arc::clone(&schema), columns)
                    .expect("columns built from the shape")
            })
            .collect()
    }
}

/// The data columns and `_key`.
pub(crate) fn overlay_schema(shape: &TableShape) -> SchemaRef {
    let mut fields: Vec<Field> = shape.data_fields().collect();
    fields.push(Field::new("_key", arrow::datatypes::DataType::Utf8, false));
    Arc::new(Schema::new(fields))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Arc<TableShape> {
        Arc::new(TableShape::test_t())
    }

    fn key(id: i64) -> compact_str::CompactString {
        format!(r#"{{"id":{id}}}"#).into()
    }

    fn upsert(seq: u64, id: i64, doc: Cell, old: Option<i64>) -> TypedChange {
        TypedChange {
            op_name: "update",
            op: ChangeOp::Upsert,
            seq,
            lsn: "0/1".into(),
            key: Some(key(id)),
            old_key: old.map(key),
            cells: vec![Cell::Int(id), doc],
            old: None,
            unchanged: None,
        }
    }

    fn delete(seq: u64, id: i64) -> TypedChange {
        TypedChange {
            op: ChangeOp::Delete,
            cells: vec![Cell::Null, Cell::Null],
            ..upsert(seq, id, Cell::Null, None)
        }
    }

    fn docs(o: &Overlay) -> Vec<(i64, Cell)> {
        let mut out = Vec::new();
        for (_, row) in o.rows.iter() {
            if let Some(r) = row {
                let Cell::Int(id) = r.cells[0] else { panic!() };
                out.push((id, r.cells[1].clone()));
            }
        }
        out.sort_by_key(|(id, _)| *id);
        out
    }

    #[test]
    fn a_left_out_column_is_fetched_from_the_base_only_when_the_overlay_lacks_it() {
        let mut o = Overlay::new(shape(), true);
        // Key 1: first touched by an update without the TOASTed doc.
        o.apply(upsert(10, 1, Cell::Absent, None));
        // Key 2: inserted in the tail, then updated without doc.
        o.apply(upsert(11, 2, Cell::Str("mine".into()), None));
        o.apply(upsert(12, 2, Cell::Absent, None));
        // Key 3 moved to key 4 without doc: fetched under its old key.
        o.apply(upsert(13, 4, Cell::Absent, Some(3)));
        assert_eq!(
            o.wanted(),
            HashSet::from([key(1).into(), key(3).into()]),
            "only rows whose previous version is in the base"
        );
        let base = HashMap::from([
            (key(1).into(), vec![Cell::Int(1), Cell::Str("big1".into())]),
            (key(3).into(), vec![Cell::Int(3), Cell::Str("big3".into())]),
        ]);
        o.fill(&base);
        assert_eq!(
            docs(&o),
            [
                (1, Cell::Str("big1".into())),
                (2, Cell::Str("mine".into())),
                (4, Cell::Str("big3".into()))
            ]
        );
        assert!(
            o.touched().contains(key(3).as_str()),
            "the moved key's base row is hidden"
        );
        assert!(o.base_visible());
    }

    #[test]
    fn a_truncate_hides_the_base_and_nothing_is_fetched_after_it() {
        let mut o = Overlay::new(shape(), true);
        o.apply(upsert(1, 1, Cell::Str("a".into()), None));
        o.apply(TypedChange {
            op: ChangeOp::Truncate,
            key: None,
            ..delete(2, 0)
        });
        assert!(!o.base_visible());
        o.apply(upsert(3, 5, Cell::Absent, None));
        assert!(o.wanted().is_empty());
        assert_eq!(docs(&o), [(5, Cell::Null)]);
    }

    #[test]
    fn deletes_hide_base_rows_and_a_reinsert_does_not_resurrect_old_values() {
        let mut o = Overlay::new(shape(), true);
        o.apply(delete(1, 7));
        assert!(o.touched().contains(key(7).as_str()));
        assert!(docs(&o).is_empty());
        o.apply(upsert(2, 7, Cell::Absent, None));
        assert!(
            o.wanted().is_empty(),
            "the deleted base row is not a previous version"
        );
        assert_eq!(docs(&o), [(7, Cell::Null)]);
        let batches = o.batches(10);
        assert_eq!(batches[0].num_rows(), 1);
        assert_eq!(batches[0].num_columns(), 3);
    }

    #[test]
    fn without_a_base_nothing_is_wanted_and_everything_is_the_overlay() {
        let mut o = Overlay::new(shape(), false);
        o.apply(upsert(1, 1, Cell::Absent, None));
        o.apply(upsert(2, 2, Cell::Str("x".into()), None));
        assert!(o.wanted().is_empty());
        assert!(!o.is_empty());
        let rows: usize = o.batches(1).iter().map(|b| b.num_rows()).sum();
        assert_eq!(rows, 2);
    }
}
