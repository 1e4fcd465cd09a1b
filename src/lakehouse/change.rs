//! The change model every stage of `compact` shares: a change typed by its
//! table's shape and what it does to the table. The ground floor of
//! `compact`: it imports only the typing of cells, so the reader, the
//! columns, the history, the spool and the latest view build on it without
//! importing each other for it.

use compact_str::CompactString;

use super::typing::Cell;

/// What a change does to its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeOp {
    /// insert, update and read (a backfilled row): the row now has these values.
    Upsert,
    /// delete: the row is gone.
    Delete,
    /// truncate: every row of the table is gone.
    Truncate,
}

/// A change typed by its table's shape.
#[derive(Debug, Clone)]
pub struct TypedChange {
    /// As the archive names it (see [`super::read::parse_op`]).
    pub op_name: &'static str,
    /// What it does to the row.
    pub op: ChangeOp,
    /// Its seq in the archive.
    pub seq: u64,
    /// Inline: an LSN is at most 17 bytes.
    pub lsn: CompactString,
    /// The row's key as JSON (`{"id":1}`); `None` for a truncate or a table
    /// without key. Inline up to 24 bytes (most keys): no allocation per
    /// change, and a latest view's map compares keys without a pointer
    /// to follow.
    pub key: Option<CompactString>,
    /// The key the row had before, when the change moved it (or a delete).
    pub old_key: Option<CompactString>,
    /// One cell per shape column; `Absent` where `data` left it out.
    pub cells: Vec<Cell>,
    /// The old row as the archive holds it (JSON), for the history's `_old`.
    pub old: Option<String>,
    /// Columns left out of `data` by an update (unchanged TOAST), as a JSON
    /// array, so a reader of the history can tell them from nulls.
    pub unchanged: Option<String>,
}

/// A change's op in the spool's `_op` column.
pub fn op_code(op: ChangeOp) -> u8 {
    match op {
        ChangeOp::Upsert => 0,
        ChangeOp::Delete => 1,
        ChangeOp::Truncate => 2,
    }
}
