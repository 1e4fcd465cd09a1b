//! Rows as the archive holds them: a table's columns as a Relation message
//! (or the catalog, for a backfill) describes them, and a row of it
//! rendered as the envelope's JSON object with its row identity. The
//! stream and the backfill both render through here, so a row read by SQL
//! has the same bytes and the same identity as a change of that row.

use std::sync::Arc;

use crate::archive::envelope::TableRef;
use crate::archive::schema::{self, RecordColumn};
use crate::row_identity::{KeyValue, RowHasher};
use crate::source::catalog::{ColumnType, Render};
use crate::source::pgoutput::{ColumnValue, Relation, TupleData};
use crate::source::types;

/// A table's columns, types, key and replica identity as first seen, ready
/// to be recorded: `members` is [`schema::members`]' bytes, the same for
/// the same shape, so the pipeline can tell versions apart by content.
#[derive(Debug, Clone)]
pub struct TableSchema {
    /// The table this shape is of.
    pub table: Arc<TableRef>,
    /// The record's columns and replica identity as JSON members, the
    /// bytes that fingerprint the shape.
    pub members: String,
}

struct ColumnInfo {
    /// `"name":` ready to append.
    key_json: Vec<u8>,
    render: Render,
    is_key: bool,
}

/// A table's columns ready to render, as the decoder keeps one per
/// relation id.
pub(crate) struct RelationInfo {
    pub(crate) table: Arc<TableRef>,
    columns: Vec<ColumnInfo>,
    has_key: bool,
}

/// A column's value as rendering reads it, borrowed: from a decoded tuple
/// (the stream) or straight from a line of `COPY` (backfill), so neither
/// copies a value, nor touches a shared buffer's count per value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Value<'a> {
    Null,
    UnchangedToast,
    Text(&'a [u8]),
    Binary(&'a [u8]),
}

impl ColumnValue {
    fn view(&self) -> Value<'_> {
        match self {
            ColumnValue::Null => Value::Null,
            ColumnValue::UnchangedToast => Value::UnchangedToast,
            ColumnValue::Text(b) => Value::Text(b),
            ColumnValue::Binary(b) => Value::Binary(b),
        }
    }
}

/// A table's columns as the stream renders them, for rows read by SQL
/// (backfill): the same JSON and the same row identity as a change of the
/// same row would have.
pub(crate) struct TableShape(RelationInfo);

impl TableShape {
    /// `rel` as the server's Relation message would describe the table.
    pub(crate) fn new(rel: &Relation, types: &[Arc<ColumnType>]) -> (TableShape, TableSchema) {
        let (info, schema) = relation_info(rel, types);
        (TableShape(info), schema)
    }

    /// Appends the row as a JSON object to `out` and returns its identity
    /// for per-row ordering (see `Change::rows`), from text-format values
    /// in column order, e.g. slices of a `COPY` row that need no copy.
    pub(crate) fn render_into<'a>(
        &self,
        values: impl Iterator<Item = Value<'a>> + Clone,
        out: &mut Vec<u8>,
    ) -> u64 {
        write_object(&self.0, values.clone(), false, out);
        hash_values(&self.0, values)
    }
}

/// The columns of `rel` ready to render (with the types the catalog
/// resolved, in column order), and the schema record they make.
pub(crate) fn relation_info(
    rel: &Relation,
    types: &[Arc<ColumnType>],
) -> (RelationInfo, TableSchema) {
    let table = Arc::new(TableRef::new(&rel.namespace, &rel.name));
    let mut described = Vec::with_capacity(rel.columns.len());
    let columns: Vec<ColumnInfo> = rel
        .columns
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut key_json = Vec::with_capacity(c.name.len() + 3);
            types::write_json_str(&mut key_json, &c.name);
            let (type_name, render) = match types.get(i) {
                Some(t) => (t.name.clone(), t.render),
                None => (format!("oid:{}", c.type_oid), Render::Builtin(c.type_oid)),
            };
            described.push(RecordColumn {
                name: c.name.clone(),
                type_name,
                type_oid: c.type_oid,
                type_modifier: c.type_modifier,
                key: c.is_key(),
            });
            key_json.push(b':');
            ColumnInfo {
                key_json,
                render,
                is_key: c.is_key(),
            }
        })
        .collect();
    let identity = match rel.replica_identity {
        b'f' => "full",
        b'i' => "index",
        b'n' => "nothing",
        _ => "default",
    };
    let members = schema::members(&described, identity);
    let has_key = columns.iter().any(|c| c.is_key);
    (
        RelationInfo {
            table: table.clone(),
            columns,
            has_key,
        },
        TableSchema { table, members },
    )
}

/// The row as a JSON object in column order. An unchanged TOASTed value is
/// left out (key absent, not null): the server did not send it.
pub(crate) fn row_json(rel: &RelationInfo, tuple: &TupleData, key_only: bool) -> Vec<u8> {
    row_json_with(rel, tuple, key_only, None)
}

/// [`row_json`], taking unchanged TOASTed values from `before` (the old row
/// sent with REPLICA IDENTITY FULL) when it has them.
pub(crate) fn row_json_with(
    rel: &RelationInfo,
    tuple: &TupleData,
    key_only: bool,
    before: Option<&TupleData>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + tuple.0.len() * 16);
    let values = tuple.0.iter().enumerate().map(|(i, value)| {
        match (value, before.and_then(|b| b.0.get(i))) {
            (ColumnValue::UnchangedToast, Some(old)) => old.view(),
            _ => value.view(),
        }
    });
    write_object(rel, values, key_only, &mut out);
    out
}

/// Appends the JSON object of `values` (in column order) to `out`; an
/// unchanged TOASTed value is left out.
fn write_object<'a>(
    rel: &RelationInfo,
    values: impl Iterator<Item = Value<'a>>,
    key_only: bool,
    out: &mut Vec<u8>,
) {
    out.push(b'{');
    let mut first = true;
    for (col, value) in rel.columns.iter().zip(values) {
        if key_only && rel.has_key && !col.is_key {
            continue;
        }
        if value == Value::UnchangedToast {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(&col.key_json);
        match value {
            Value::Text(text) => col.render.write(out, text),
            Value::Binary(bytes) => {
                // Never requested (we ask for text); kept faithful if it comes.
                use base64::Engine;
                let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
                types::write_json_str(out, &b64)
            }
            Value::Null | Value::UnchangedToast => out.extend_from_slice(b"null"),
        }
    }
    out.push(b'}');
}

/// Identifies the row (table + replica identity key) for per-row ordering.
/// Without key columns the whole table counts as one row.
pub(crate) fn row_hash(rel: &RelationInfo, tuple: &TupleData) -> u64 {
    hash_values(rel, tuple.0.iter().map(ColumnValue::view))
}

fn hash_values<'a>(rel: &RelationInfo, values: impl Iterator<Item = Value<'a>>) -> u64 {
    let mut h = RowHasher::new(&rel.table.name);
    for (col, value) in rel.columns.iter().zip(values) {
        if col.is_key {
            h.key_value(match value {
                Value::Text(b) | Value::Binary(b) => KeyValue::Bytes(b),
                Value::Null => KeyValue::Null,
                Value::UnchangedToast => KeyValue::Unchanged,
            });
        }
    }
    h.finish()
}
