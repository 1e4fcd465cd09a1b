//! Reading the archive's change lines into typed changes.
//!
//! The NDJSON is parsed here rather than by a generic JSON reader because
//! the contract distinguishes an absent column (unchanged TOAST, to carry
//! forward) from a null one, which a columnar JSON reader folds together.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::typing::{Cell, TableShape, parse_cell};

/// One envelope line as written by `waltail run`.
#[derive(Debug, Deserialize)]
pub struct Envelope {
    pub op: String,
    pub table: String,
    pub data: Option<Map<String, Value>>,
    pub old: Option<Map<String, Value>>,
    pub seq: u64,
    pub idempotency_key: String,
    pub commit_lsn: String,
}

/// What a change does to its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeOp {
    /// insert, update and read (a backfilled row): the row now has these values.
    Upsert,
    Delete,
    Truncate,
}

/// A change typed by its table's shape.
#[derive(Debug, Clone)]
pub struct TypedChange {
    pub op_name: String,
    pub op: ChangeOp,
    pub seq: u64,
    pub lsn: String,
    /// The row's key as JSON (`{"id":1}`); `None` for a truncate or a table
    /// without key.
    pub key: Option<String>,
    /// The key the row had before, when the change moved it (or a delete).
    pub old_key: Option<String>,
    /// One cell per shape column; `Absent` where `data` left it out.
    pub cells: Vec<Cell>,
    pub old: Option<String>,
    /// Columns left out of `data` by an update (unchanged TOAST), as a JSON
    /// array, so a reader of the history can tell them from nulls.
    pub unchanged: Option<String>,
}

/// The key of a row as JSON: the key columns' values in key order.
pub fn key_json(shape: &TableShape, row: &Map<String, Value>) -> Option<String> {
    if shape.key.is_empty() {
        return None;
    }
    let mut key = Map::new();
    for &i in &shape.key {
        let name = &shape.columns[i].name;
        key.insert(name.clone(), row.get(name).cloned().unwrap_or(Value::Null));
    }
    Some(Value::Object(key).to_string())
}

/// Types one envelope; the error names the column and the value.
pub fn type_change(shape: &TableShape, env: Envelope) -> Result<TypedChange, String> {
    let op = match env.op.as_str() {
        "insert" | "update" | "read" => ChangeOp::Upsert,
        "delete" => ChangeOp::Delete,
        "truncate" => ChangeOp::Truncate,
        other => return Err(format!("unknown op {other:?}")),
    };
    let mut cells = vec![Cell::Absent; shape.columns.len()];
    let mut unchanged = Vec::new();
    if let Some(data) = &env.data {
        for (name, value) in data {
            let i = shape.column(name).ok_or_else(|| {
                format!("column {name:?} is in no schema record of {}", shape.table)
            })?;
            cells[i] = parse_cell(shape.columns[i].kind, value)
                .map_err(|e| format!("column {name:?}: {e}"))?;
        }
        if env.op == "update" {
            unchanged = shape
                .columns
                .iter()
                .zip(&cells)
                .filter(|(_, c)| **c == Cell::Absent)
                .map(|(col, _)| Value::from(col.name.as_str()))
                .collect();
        }
    }
    if op != ChangeOp::Upsert {
        cells.fill(Cell::Null);
    }
    let key = match op {
        ChangeOp::Upsert => env.data.as_ref().and_then(|d| key_json(shape, d)),
        ChangeOp::Delete => env
            .old
            .as_ref()
            .or(env.data.as_ref())
            .and_then(|d| key_json(shape, d)),
        ChangeOp::Truncate => None,
    };
    let old_key = env.old.as_ref().and_then(|o| key_json(shape, o));
    Ok(TypedChange {
        op_name: env.op,
        op,
        seq: env.seq,
        lsn: env.commit_lsn,
        key,
        old_key,
        cells,
        old: env.old.map(|o| Value::Object(o).to_string()),
        unchanged: (!unchanged.is_empty()).then(|| Value::Array(unchanged).to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::super::typing::{Column, Kind};
    use super::*;

    fn shape() -> TableShape {
        TableShape {
            table: "public.t".into(),
            columns: vec![
                Column {
                    name: "id".into(),
                    kind: Kind::Int64,
                },
                Column {
                    name: "doc".into(),
                    kind: Kind::Text,
                },
            ],
            key: vec![0],
        }
    }

    fn env(line: &str) -> Envelope {
        serde_json::from_str(line).unwrap()
    }

    #[test]
    fn an_update_without_a_toasted_column_marks_it_absent_not_null() {
        let c = type_change(
            &shape(),
            env(r#"{"op":"update","table":"public.t","data":{"id":1},"old":null,"seq":9,"idempotency_key":"k","commit_lsn":"0/1"}"#),
        )
        .unwrap();
        assert_eq!(c.cells, [Cell::Int(1), Cell::Absent]);
        assert_eq!(c.unchanged.as_deref(), Some(r#"["doc"]"#));
        assert_eq!(c.key.as_deref(), Some(r#"{"id":1}"#));
        let c = type_change(
            &shape(),
            env(r#"{"op":"insert","table":"public.t","data":{"id":1,"doc":null},"old":null,"seq":9,"idempotency_key":"k","commit_lsn":"0/1"}"#),
        )
        .unwrap();
        assert_eq!(c.cells, [Cell::Int(1), Cell::Null]);
        assert_eq!(c.unchanged, None);
    }

    #[test]
    fn a_delete_is_keyed_by_its_old_row() {
        let c = type_change(
            &shape(),
            env(r#"{"op":"delete","table":"public.t","data":null,"old":{"id":4},"seq":9,"idempotency_key":"k","commit_lsn":"0/1"}"#),
        )
        .unwrap();
        assert_eq!(c.op, ChangeOp::Delete);
        assert_eq!(c.key.as_deref(), Some(r#"{"id":4}"#));
        assert_eq!(c.cells, [Cell::Null, Cell::Null]);
        assert_eq!(c.old.as_deref(), Some(r#"{"id":4}"#));
    }

    #[test]
    fn an_unknown_column_is_an_error_that_names_it() {
        let err = type_change(
            &shape(),
            env(r#"{"op":"insert","table":"public.t","data":{"id":1,"zz":2},"old":null,"seq":9,"idempotency_key":"k","commit_lsn":"0/1"}"#),
        )
        .unwrap_err();
        assert!(err.contains("\"zz\""), "{err}");
    }
}
