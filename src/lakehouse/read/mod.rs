//! Reading the archive's change lines into typed changes.
//!
//! The NDJSON is parsed here rather than by a generic JSON reader because
//! the contract distinguishes an absent column (unchanged TOAST, to carry
//! forward) from a null one, which a columnar JSON reader folds together.

mod seed;

use serde::Deserialize;
use serde_json::{Map, Value};

use self::seed::parse_line;
use super::change::{ChangeOp, TypedChange};
use super::columns::{ChangeBatch, ChangeColumns};
use super::line::{FastLine, Shapes, key_json};
use super::typing::parse::parse_cell;
use super::typing::{Cell, TableShape};
use crate::archive::envelope::Op;

/// One envelope line as written by `waltail run`.
#[derive(Debug, Deserialize)]
pub struct Envelope {
    /// `insert`, `update`, `delete`, `truncate` or `read`.
    pub op: String,
    /// `schema.table`.
    pub table: String,
    /// The row after the change.
    pub data: Option<Map<String, Value>>,
    /// The row (or its key) before it.
    pub old: Option<Map<String, Value>>,
    /// The change's seq.
    pub seq: u64,
    /// `<pipeline>:<seq>`.
    pub idempotency_key: String,
    /// The commit LSN, as `X/X`.
    pub commit_lsn: String,
}

/// Types one envelope; the error names the column and the value.
pub fn type_change(shape: &TableShape, env: Envelope) -> Result<TypedChange, String> {
    let (op, op_name) = parse_op(&env.op)?;
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
        op_name,
        op,
        seq: env.seq,
        lsn: env.commit_lsn.into(),
        key,
        old_key,
        cells,
        old: env.old.map(|o| Value::Object(o).to_string()),
        unchanged: (!unchanged.is_empty()).then(|| Value::Array(unchanged).to_string()),
    })
}

/// One archive line typed in a single pass by [`type_line`].
#[derive(Debug)]
pub struct Line {
    /// The line's seq.
    pub seq: u64,
    /// The table's index in the [`Shapes`] given and the typed change;
    /// `None` for a table not in them.
    pub change: Option<(usize, TypedChange)>,
}

/// One table's changes of an object, in seq order.
#[derive(Debug)]
pub struct TableChanges {
    /// The table's index in the [`Shapes`].
    pub table: usize,
    /// The changes as the history's columns.
    pub batch: ChangeBatch,
    /// The same changes as typed rows, when the table's spool combined its
    /// changes as the object was read ([`Shapes::combines`]).
    pub rows: Option<Vec<TypedChange>>,
}

/// An object's changes to compact, by table.
#[derive(Debug)]
pub struct ObjectChanges {
    /// Lines skipped because their seq was compacted from an earlier
    /// object.
    pub repeats: u64,
    /// By table index, the tables with changes.
    pub tables: Vec<TableChanges>,
}

/// Gathers the typed lines of one object into [`ObjectChanges`]: lines
/// before the object's first seq to compact are repeats, tables not
/// compacted are skipped, and so are a table's changes before the seq it
/// starts at (already compacted).
pub struct ObjectReader<'s> {
    shapes: &'s Shapes,
    from_seq: u64,
    starts: &'s [u64],
    /// About how many lines the object has: the first table's columns
    /// are made that large.
    lines: usize,
    repeats: u64,
    tables: Vec<Option<(ChangeColumns, Option<Vec<TypedChange>>)>>,
    /// The cells of the last change appended to columns only, for the
    /// next line's (see [`ObjectReader::spare`]).
    spare: Vec<Cell>,
}

impl<'s> ObjectReader<'s> {
    /// A reader of an object of about `lines` lines whose changes from
    /// `from_seq` on are compacted, table `i`'s from `starts[i]` on.
    pub fn new(shapes: &'s Shapes, from_seq: u64, starts: &'s [u64], lines: usize) -> Self {
        ObjectReader {
            shapes,
            from_seq,
            starts,
            lines,
            repeats: 0,
            tables: (0..shapes.len()).map(|_| None).collect(),
            spare: Vec::new(),
        }
    }

    /// A vector for the next line's cells ([`type_text_into`]): the last
    /// change's, once its values are in the columns, so that a change
    /// costs no allocation of its cells.
    pub fn spare(&mut self) -> Vec<Cell> {
        std::mem::take(&mut self.spare)
    }

    /// Takes the object's next line.
    pub fn push(&mut self, line: Line) {
        if line.seq < self.from_seq {
            self.repeats += 1;
            return;
        }
        let Some((table, change)) = line.change else {
            return; // a table not compacted in this run
        };
        if change.seq < self.starts[table] {
            return;
        }
        let (columns, rows) = self.tables[table].get_or_insert_with(|| {
            // Most objects hold one table: only the first is sized for all.
            let capacity = self.lines;
            self.lines = self.lines.min(1024);
            let shape = self.shapes.shape(table);
            let rows = self.shapes.combines(table).then(Vec::new);
            (ChangeColumns::new(shape, capacity), rows)
        });
        columns.append((&change).into());
        match rows {
            Some(rows) => rows.push(change),
            None => self.spare = change.cells,
        }
    }

    /// The object's changes, by table.
    pub fn finish(self) -> ObjectChanges {
        let tables = self
            .tables
            .into_iter()
            .enumerate()
            .filter_map(|(table, t)| t.map(|t| (table, t)))
            .map(|(table, (columns, rows))| TableChanges {
                table,
                batch: columns.finish(),
                rows,
            })
            .collect();
        ObjectChanges {
            repeats: self.repeats,
            tables,
        }
    }
}

/// Parses and types one envelope line without building a JSON map of its
/// row: `data`'s values are parsed straight into cells (key and json
/// columns through a `Value`, so their text is exactly what
/// [`type_change`] gives). A line laid out as `waltail run` writes it
/// takes the fast path (`scan`); any other, the general parser, sonic-rs's
/// serde deserializer (SIMD scanning; the same visitors as serde_json's,
/// which was 10% slower end to end). Lines whose fields come in another
/// order than `waltail run` writes (`table` before `data`) take the
/// [`Envelope`] path. The result equals `type_change(shape, envelope)`.
pub fn type_line(shapes: &Shapes, line: &[u8]) -> Result<Line, String> {
    // Checked once here, so the parser does not check every string again
    // (it does for a byte slice: a tenth of the parse).
    let line = std::str::from_utf8(line).map_err(|e| format!("the line is not UTF-8: {e}"))?;
    type_text(shapes, line)
}

/// [`type_line`] of a line already known to be UTF-8 (an object is checked
/// at once: faster than line by line).
pub fn type_text(shapes: &Shapes, line: &str) -> Result<Line, String> {
    type_text_into(shapes, line, Vec::new())
}

/// [`type_text`] with the change's cells in `cells` (emptied first), when
/// the line takes the fast path: a vector reused from change to change
/// (see [`ObjectReader::spare`]).
pub fn type_text_into(shapes: &Shapes, line: &str, cells: Vec<Cell>) -> Result<Line, String> {
    let found = match super::scan::scan_into(shapes, line, cells) {
        Some(found) => Some(found),
        None => parse_line(shapes, line)?,
    };
    typed_line(shapes, line, found)
}

/// The change of `line` from what a pass over it found (`None`: `data`
/// came before `table`, so the line is read again as an [`Envelope`]).
fn typed_line(shapes: &Shapes, line: &str, found: Option<FastLine>) -> Result<Line, String> {
    let Some(fast) = found else {
        // `data` came before `table`: the general path.
        let env: Envelope = serde_json::from_str(line).map_err(|e| e.to_string())?;
        let seq = env.seq;
        let change = match shapes.get(&env.table) {
            Some((i, shape)) => Some((i, type_change(shape, env)?)),
            None => None,
        };
        return Ok(Line { seq, change });
    };
    let missing = |f: &str| format!("missing field `{f}`");
    let seq = fast.seq.ok_or_else(|| missing("seq"))?;
    let op_name = fast.op.ok_or_else(|| missing("op"))?;
    let lsn = fast.lsn.ok_or_else(|| missing("commit_lsn"))?;
    let Some((table, shape)) = fast.shape else {
        if !fast.table {
            return Err(missing("table"));
        }
        return Ok(Line { seq, change: None });
    };
    let (op, op_name) = parse_op(&op_name)?;
    let (mut cells, data_key) = match fast.data {
        Some(row) => {
            let row = row?;
            (row.cells, Some(row.key))
        }
        None => {
            let mut cells = fast.spare;
            cells.clear();
            cells.resize(shape.columns.len(), Cell::Absent);
            (cells, None)
        }
    };
    let unchanged = if data_key.is_some() && op_name == "update" {
        unchanged_columns(shape, &cells)
    } else {
        None
    };
    if op != ChangeOp::Upsert {
        cells.fill(Cell::Null);
    }
    let data_key = data_key.flatten();
    let key = match op {
        ChangeOp::Upsert => data_key,
        ChangeOp::Delete => fast
            .old
            .as_ref()
            .and_then(|o| key_json(shape, o))
            .or(data_key),
        ChangeOp::Truncate => None,
    };
    let old_key = fast.old.as_ref().and_then(|o| key_json(shape, o));
    let change = TypedChange {
        op_name,
        op,
        seq,
        lsn,
        key,
        old_key,
        cells,
        old: fast.old.map(|o| Value::Object(o).to_string()),
        unchanged,
    };
    Ok(Line {
        seq,
        change: Some((table, change)),
    })
}

/// What an op the archive writes does, and its name as a static (not a
/// String per change).
pub fn parse_op(op: &str) -> Result<(ChangeOp, &'static str), String> {
    let op = Op::parse(op).ok_or_else(|| format!("unknown op {op:?}"))?;
    let change = match op {
        Op::Insert | Op::Update | Op::Read => ChangeOp::Upsert,
        Op::Delete => ChangeOp::Delete,
        Op::Truncate => ChangeOp::Truncate,
    };
    Ok((change, op.as_str()))
}

/// The columns an update left out, as a JSON array.
fn unchanged_columns(shape: &TableShape, cells: &[Cell]) -> Option<String> {
    let absent: Vec<Value> = shape
        .columns
        .iter()
        .zip(cells)
        .filter(|(_, c)| **c == Cell::Absent)
        .map(|(col, _)| Value::from(col.name.as_str()))
        .collect();
    (!absent.is_empty()).then(|| Value::Array(absent).to_string())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::typing::{Column, Kind};
    use super::*;

    fn shape() -> TableShape {
        TableShape::test_t()
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
    fn a_line_typed_in_one_pass_equals_the_envelope_typed() {
        let shape = TableShape {
            table: "public.t".into(),
            columns: [
                ("id", Kind::Int64),
                ("code", Kind::Text),
                ("n", Kind::Int16),
                ("f", Kind::Float64),
                ("r", Kind::Float32),
                (
                    "d",
                    Kind::Decimal {
                        precision: 12,
                        scale: 2,
                    },
                ),
                ("day", Kind::Date),
                ("at", Kind::TimestampTz),
                ("doc", Kind::Json),
                ("t", Kind::Text),
                ("ok", Kind::Bool),
            ]
            .into_iter()
            .map(|(name, kind)| Column {
                name: name.into(),
                kind,
            })
            .collect(),
            key: vec![1, 0],
        };
        let shapes = Shapes::new([Arc::new(shape.clone())]);
        let lines = [
            r#"{"op":"insert","table":"public.t","data":{"id":1,"code":"a\u00e9\"b","n":-3,"f":1.5,"r":2,"d":12.34,"day":"2024-02-29","at":"2024-01-01T00:00:00.5+00:00","doc":{"z":1,"a":[1,"x"]},"t":"caf\u00e9","ok":true},"old":null,"seq":1,"idempotency_key":"k","commit_lsn":"0/1"}"#,
            r#"{"op":"update","table":"public.t","data":{"id":2,"code":"b","t":5,"f":"NaN","d":"7","doc":[1,2]},"old":{"id":1,"code":"a"},"seq":2,"idempotency_key":"k","commit_lsn":"0/2"}"#,
            r#"{"op":"update","table":"public.t","data":{"id":2,"code":"b","t":{"x":[true]},"f":-1e300,"d":-0.5,"doc":null},"old":null,"seq":3,"idempotency_key":"k","commit_lsn":"0/3"}"#,
            r#"{"op":"delete","table":"public.t","data":null,"old":{"code":"b","id":2,"t":null},"seq":4,"idempotency_key":"k","commit_lsn":"0/4"}"#,
            r#"{"op":"truncate","table":"public.t","data":null,"old":null,"seq":5,"idempotency_key":"k","commit_lsn":"0/5"}"#,
            r#"{"data":{"id":9,"code":"z"},"op":"read","table":"public.t","old":null,"seq":6,"idempotency_key":"k","commit_lsn":"0/6"}"#,
            r#"{"op":"insert","table":"public.other","data":{"x":1},"old":null,"seq":7,"idempotency_key":"k","commit_lsn":"0/7"}"#,
            // Escaped names and values: unescaped copies, not borrowed text.
            r#"{"o\u0070":"upd\u0061te","t\u0061ble":"public.\u0074","data":{"\u0069d":3,"c\u006fde":"q"},"old":null,"seq":8,"idempotency_key":"k","commit_l\u0073n":"0\/8"}"#,
        ];
        for line in lines {
            let fast = type_line(&shapes, line.as_bytes()).unwrap();
            let env: Envelope = serde_json::from_str(line).unwrap();
            assert_eq!(fast.seq, env.seq);
            let slow = shapes
                .get(&env.table)
                .map(|(_, s)| type_change(s, env).unwrap());
            assert_eq!(
                format!("{:?}", fast.change.map(|(_, c)| c)),
                format!("{slow:?}"),
                "{line}"
            );
        }
        for bad in [
            r#"{"op":"insert","table":"public.t","data":{"id":1,"zz":2},"old":null,"seq":9,"idempotency_key":"k","commit_lsn":"0/1"}"#,
            r#"{"op":"insert","table":"public.t","data":{"id":1,"n":70000},"old":null,"seq":9,"idempotency_key":"k","commit_lsn":"0/1"}"#,
            r#"{"op":"insert","table":"public.t","data":{"id":1,"d":1.234},"old":null,"seq":9,"idempotency_key":"k","commit_lsn":"0/1"}"#,
            r#"{"op":"nope","table":"public.t","data":{"id":1},"old":null,"seq":9,"idempotency_key":"k","commit_lsn":"0/1"}"#,
            r#"{"op":"insert","table":"public.t","data":{"id":1}"#,
        ] {
            let fast = type_line(&shapes, bad.as_bytes()).expect_err(bad);
            let slow = serde_json::from_str::<Envelope>(bad)
                .map_err(|e| e.to_string())
                .and_then(|env| type_change(&shape, env))
                .unwrap_err();
            assert!(!fast.contains('\n'), "{fast}");
            if bad.ends_with(r#"{"id":1}"#) {
                // A syntax error: the two parsers word it differently.
                let eof = "EOF while parsing";
                assert!(
                    fast.starts_with(eof) && slow.starts_with(eof),
                    "{fast} / {slow}"
                );
                continue;
            }
            let what = |e: &str| e.split(':').next().unwrap().to_string();
            assert_eq!(what(&fast), what(&slow), "{bad}");
        }
    }

    #[test]
    fn a_key_is_written_in_column_name_order_as_every_archive_was() {
        // The bucket of a row is the hash of this text: it must not change.
        let mut shape = shape();
        shape.columns.push(Column {
            name: "code".into(),
            kind: Kind::Text,
        });
        shape.key = vec![0, 2];
        let row = serde_json::from_str(r#"{"code":"a\"é","id":7,"doc":1}"#).unwrap();
        assert_eq!(key_json(&shape, &row).unwrap(), r#"{"code":"a\"é","id":7}"#);
        shape.key = vec![2];
        assert_eq!(key_json(&shape, &Map::new()).unwrap(), r#"{"code":null}"#);
        shape.key = vec![];
        assert_eq!(key_json(&shape, &row), None);
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

    /// The text of the decimal `digits` / 10^`scale`, negated if `negative`
    /// (`-0.05` for 5, 2, true), as Postgres prints a numeric.
    fn decimal_text(digits: u64, scale: u32, negative: bool) -> String {
        let d = format!("{digits:0>width$}", width = scale as usize + 1);
        let (int, frac) = d.split_at(d.len() - scale as usize);
        let sign = if negative { "-" } else { "" };
        if scale == 0 {
            format!("{sign}{int}")
        } else {
            format!("{sign}{int}.{frac}")
        }
    }

    proptest::proptest! {
        /// A float8 value as the source prints it (shortest round trip) and
        /// a numeric of up to 15 significant digits (what `waltail run`
        /// writes as a JSON number) come back exactly: the line parser's
        /// number reading loses nothing.
        #[test]
        fn numbers_come_back_exactly(
            bits in proptest::num::u64::ANY,
            digits in 1u64..1_000_000_000_000_000,
            scale in 0u32..15,
            negative in proptest::bool::ANY,
        ) {
            let f = f64::from_bits(bits);
            proptest::prop_assume!(f.is_finite());
            let unscaled = (digits as i128) * if negative { -1 } else { 1 };
            let text = decimal_text(digits, scale, negative);
            let shape = TableShape {
                table: "public.t".into(),
                columns: [
                    ("id", Kind::Int64),
                    ("f", Kind::Float64),
                    ("d", Kind::Decimal { precision: 38, scale: 14 }),
                ]
                .into_iter()
                .map(|(name, kind)| Column { name: name.into(), kind })
                .collect(),
                key: vec![0],
            };
            let shapes = Shapes::new([Arc::new(shape)]);
            let line = format!(
                r#"{{"op":"insert","table":"public.t","data":{{"id":1,"f":{f:?},"d":{text}}},"old":null,"seq":1,"idempotency_key":"k","commit_lsn":"0/1"}}"#
            );
            let (_, c) = type_line(&shapes, line.as_bytes()).unwrap().change.unwrap();
            proptest::prop_assert_eq!(&c.cells[1], &Cell::Float(f), "{}", line);
            let want = unscaled * 10i128.pow(14 - scale);
            proptest::prop_assert_eq!(&c.cells[2], &Cell::Dec(want), "{}", line);
        }
    }

    /// JSON value texts of every form a line may hold: what each kind of
    /// column takes, in the forms the source writes and others, and what no
    /// column takes.
    fn any_value() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            (0i64..40_000).prop_map(|n| n.to_string()),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| format!("{f:?}")),
            (1u64..1_000_000_000_000_000, 0u32..15, any::<bool>())
                .prop_map(|(d, scale, neg)| decimal_text(d, scale, neg)),
            (1u32..99_999, -9i32..9).prop_map(|(m, e)| format!("{m}e{e}")),
            "[0-9]{1,3}\\.[0-9]{20,30}",
            "\"[a-z0-9 é.:+-]{0,12}\"",
            "\"(\\\\[nt\"\\\\/]|\\\\u00e9|[a-z])*\"",
            proptest::sample::select(vec![
                "null",
                "-0",
                "18446744073709551615",
                "1e400",
                "true",
                "false",
                "\"2024-02-29\"",
                "\"2024-01-01T00:00:00.5+00:00\"",
                "\"2026-11-03T11:20:01.460001+00:00\"",
                "\"NaN\"",
                "\"12.50\"",
                "{\"z\":1,\"a\":[1,\"x}\\\"\"]}",
                "[1,{\"b\":null},\"]\"]",
                "{}",
            ])
            .prop_map(String::from),
        ]
    }

    /// Value texts a column of `kind` takes, in the forms the source writes
    /// and others; now and then any value.
    fn value_of(kind: Kind) -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let fits: BoxedStrategy<String> = match kind {
            Kind::Int16 | Kind::Int32 => (-40_000i64..40_000).prop_map(|n| n.to_string()).boxed(),
            Kind::Int64 => any::<i64>().prop_map(|n| n.to_string()).boxed(),
            // No -0 (here or below): sonic-rs reads it as 0, the fast path
            // keeps the sign (see `the_fast_path_reads_what_waltail_run_writes`).
            Kind::Float32 | Kind::Float64 => prop_oneof![
                any::<f64>()
                    .prop_filter("finite", |f| f.is_finite())
                    .prop_map(|f| format!("{f:?}")),
                any::<i32>().prop_map(|n| n.to_string()),
                "-?[0-9]{1,3}\\.[0-9]{15,30}(e-?[0-9]{1,2})?",
                Just("\"-Infinity\"".to_string()),
            ]
            .boxed(),
            Kind::Decimal { .. } => prop_oneof![
                (0u64..99_999_999, 0u32..5, any::<bool>())
                    .prop_map(|(d, scale, neg)| decimal_text(d, scale, neg)),
                (1u32..99_999, -4i32..6).prop_map(|(m, e)| format!("{m}e{e}")),
                // Longer than `waltail run` writes as a number: the general
                // parser's f64 rounds them; the fast path leaves them to it.
                "[1-9][0-9]{11,15}\\.[0-9]{4}",
                Just("\"12.50\"".to_string()),
            ]
            .boxed(),
            Kind::Date => "\"20[0-9]{2}-0[1-9]-[12][0-9]\"".boxed(),
            Kind::TimestampTz | Kind::Timestamp => {
                "\"20[0-9]{2}-0[1-9]-[12][0-9]T[01][0-9]:[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?\\+00:00\"".boxed()
            }
            Kind::Bool => prop_oneof![Just("true".to_string()), Just("false".to_string())].boxed(),
            Kind::Text | Kind::Json => prop_oneof![
                4 => "\"[a-z0-9 é.:+-]{0,30}\"",
                1 => "\"(\\\\[nt\"\\\\/]|\\\\u00e9|[a-z])*\"",
                1 => Just("{\"z\":1,\"a\":[1,\"x}\\\"\"]}".to_string()),
                1 => Just("[1,{\"b\":null},\"]\"]".to_string()),
            ]
            .boxed(),
        };
        let float = matches!(kind, Kind::Float32 | Kind::Float64);
        prop_oneof![16 => fits, 2 => Just("null".to_string()), 1 => any_value()]
            .prop_filter("no -0 in a float column", move |v| {
                !(float && v.starts_with("-0") && v.parse::<f64>() == Ok(0.0))
            })
    }

    /// The table the fast path's proptest writes lines of: a column of
    /// every kind, keyed by `code` and `id`.
    const COLUMNS: [(&str, Kind); 10] = [
        ("id", Kind::Int64),
        ("code", Kind::Text),
        ("n", Kind::Int16),
        ("f", Kind::Float64),
        ("r", Kind::Float32),
        (
            "d",
            Kind::Decimal {
                precision: 20,
                scale: 4,
            },
        ),
        ("day", Kind::Date),
        ("at", Kind::TimestampTz),
        ("doc", Kind::Json),
        ("ok", Kind::Bool),
    ];

    proptest::proptest! {
        #![proptest_config(crate::fuzzing::config(3000))]

        /// Whatever line the fast path reads, it reads as the general
        /// parser does; what it leaves, the general parser reads. Also the
        /// fast path's fuzz campaign (see `crate::fuzzing`): half the lines
        /// get a mutation fuzzer's edits too.
        #[test]
        fn the_fast_path_agrees_with_the_general_one(
            values in COLUMNS.map(|(_, kind)| proptest::strategy::Strategy::boxed(value_of(kind))).to_vec(),
            hows in proptest::collection::vec(0u8..12, 10),
            op in proptest::sample::select(vec!["insert", "update", "delete", "read", "truncate", "nope"]),
            data_null in proptest::bool::weighted(0.1),
            old in proptest::sample::select(vec![
                "null", r#"{"id":4}"#, r#"{"code":"b","id":2,"t":null}"#, r#"{"id":1.5}"#, "3",
            ]),
            table in proptest::sample::select(vec![
                "\"public.t\"", "\"public.t\"", "\"public.t\"", "\"public.other\"", "\"public.\\u0074\"",
            ]),
            lsn in proptest::sample::select(vec!["\"0/1A\"", "\"0/1A\"", "\"0/1A\"", "\"0\\/1\""]),
            tweak in 0u8..16,
            edits in proptest::option::of(crate::fuzzing::edits()),
        ) {
            let shape = TableShape {
                table: "public.t".into(),
                columns: COLUMNS
                    .iter()
                    .map(|&(name, kind)| Column { name: name.to_string(), kind })
                    .collect(),
                key: vec![1, 0],
            };
            let shapes = Shapes::new([Arc::new(shape)]);
            // Columns the value's draw leaves out (0) or writes in the
            // shape's order, the last ones first (7), or under a name that
            // is in no record (6, once).
            let mut members: Vec<String> = Vec::new();
            for (i, (value, how)) in values.iter().zip(&hows).enumerate() {
                match how {
                    0 => {}
                    6 if i == 9 => members.push(format!(r#""zz":{value}"#)),
                    _ => members.push(format!(r#""{}":{value}"#, COLUMNS[i].0)),
                }
            }
            if hows[0] == 7 {
                members.reverse();
            }
            let data = if data_null { "null".to_string() } else { format!("{{{}}}", members.join(",")) };
            let mut line = format!(
                r#"{{"op":"{op}","table":{table},"data":{data},"old":{old},"seq":{},"idempotency_key":"k","commit_lsn":{lsn}}}"#,
                hows[1] as u64 * 1000 + 1
            );
            match tweak {
                0 if hows[2] == 0 => line = line.replacen(r#""op":"#, r#""op" : "#, 1),
                1 => line.push(' '),
                2 => line = line.replacen(r#","seq":"#, r#","extra":[1],"seq":"#, 1),
                3 => line.pop().map(|_| ()).unwrap_or(()),
                _ => {}
            }
            if let Some(edits) = &edits {
                line = String::from_utf8_lossy(&crate::fuzzing::apply(line.as_bytes(), edits)).into_owned();
            }
            let general = parse_line(&shapes, &line).and_then(|found| typed_line(&shapes, &line, found));
            if let Some(found) = super::super::scan::scan_line(&shapes, &line) {
                // Errors too: an unknown op is found by `typed_line`, the
                // same for both paths.
                let fast = typed_line(&shapes, &line, Some(found));
                proptest::prop_assert!(general.is_ok() || op == "nope" || edits.is_some(), "{}: {:?}", line, general);
                proptest::prop_assert_eq!(format!("{fast:?}"), format!("{general:?}"), "{}", line);
            }
            // And `type_text`, whichever path it takes, is the general parser.
            let typed = type_text(&shapes, &line);
            proptest::prop_assert_eq!(format!("{typed:?}"), format!("{general:?}"), "{}", line);
            // Also with the cells of an earlier change to reuse.
            let reused = type_text_into(&shapes, &line, vec![Cell::Int(7), Cell::Absent, Cell::Null]);
            proptest::prop_assert_eq!(format!("{reused:?}"), format!("{general:?}"), "{}", line);
        }
    }

    /// An object's reader skips repeats (counted), tables not compacted
    /// and a table's changes before its start; its batch is the changes'
    /// columns, with typed rows only while the table's spool combines.
    #[test]
    fn an_object_reader_keeps_what_the_run_compacts() {
        use super::super::columns::change_batch;
        let shapes = Shapes::new([Arc::new(shape())]);
        let line = |op: &str, table: &str, data: &str, old: &str, seq: u64| {
            format!(
                r#"{{"op":"{op}","table":"{table}","data":{data},"old":{old},"seq":{seq},"idempotency_key":"k","commit_lsn":"0/{seq:X}"}}"#
            )
        };
        let lines = [
            line("insert", "public.t", r#"{"id":1,"doc":"a"}"#, "null", 1),
            line("insert", "public.t", r#"{"id":2,"doc":"b"}"#, "null", 2),
            line("insert", "public.other", r#"{"x":1}"#, "null", 3),
            line("update", "public.t", r#"{"id":2}"#, "null", 4),
            line("delete", "public.t", "null", r#"{"id":1}"#, 5),
            // A general-path line: `data` before `table`.
            r#"{"data":{"id":3,"doc":"c"},"op":"update","table":"public.t","old":{"id":9},"seq":6,"idempotency_key":"k","commit_lsn":"0/6"}"#.to_string(),
            line("truncate", "public.t", "null", "null", 7),
        ];
        // Seqs from 2 are this object's, the table's from 4 on.
        let starts = [4];
        let read = |shapes: &Shapes| {
            let mut reader = ObjectReader::new(shapes, 2, &starts, lines.len());
            for l in &lines {
                let spare = reader.spare();
                reader.push(type_text_into(shapes, l, spare).unwrap());
            }
            reader.finish()
        };
        let kept: Vec<TypedChange> = lines[3..]
            .iter()
            .map(|l| type_text(&shapes, l).unwrap().change.unwrap().1)
            .collect();
        let want = change_batch(shapes.shape(0), &kept);
        let combined = read(&shapes);
        assert_eq!(combined.repeats, 1);
        let [t] = &combined.tables[..] else {
            panic!("one table");
        };
        assert_eq!(t.table, 0);
        assert_eq!(t.batch.history, want.history);
        assert_eq!(
            (&t.batch.ops, &t.batch.old_keys, &t.batch.absent),
            (&want.ops, &want.old_keys, &want.absent)
        );
        assert_eq!(t.batch.counts, want.counts);
        assert_eq!(t.batch.counts.changes, 4);
        assert_eq!(t.batch.counts.upserts, 2);
        assert_eq!(
            format!("{:?}", t.rows.as_ref().unwrap()),
            format!("{kept:?}")
        );
        // Once the spool no longer combines: the same columns, no rows.
        shapes.stop_combining(0);
        let columns_only = read(&shapes);
        let [t] = &columns_only.tables[..] else {
            panic!("one table");
        };
        assert!(t.rows.is_none());
        assert_eq!(t.batch.history, want.history);
        assert_eq!(t.batch.counts, want.counts);
    }

    /// The fast path does read lines as `waltail run` writes them (the
    /// agreement test above would pass if it read none).
    #[test]
    fn the_fast_path_reads_what_waltail_run_writes() {
        let shapes = Shapes::new([Arc::new(shape())]);
        for line in [
            r#"{"op":"insert","table":"public.t","data":{"id":1,"doc":"a b"},"old":null,"seq":1,"idempotency_key":"k","commit_lsn":"0/1"}"#,
            r#"{"op":"update","table":"public.t","data":{"id":1},"old":{"id":2},"seq":2,"idempotency_key":"k","commit_lsn":"0/2"}"#,
            r#"{"op":"delete","table":"public.t","data":null,"old":{"id":1},"seq":3,"idempotency_key":"k","commit_lsn":"0/3"}"#,
            r#"{"op":"truncate","table":"public.t","data":null,"old":null,"seq":4,"idempotency_key":"k","commit_lsn":"0/4"}"#,
        ] {
            assert!(
                super::super::scan::scan_line(&shapes, line).is_some(),
                "{line}"
            );
        }
        // Left to the general parser: a decimal of more than 15 digits
        // (its f64 would round it), a name that needs escaping (here raw,
        // which is invalid JSON), a value nested deeper than the general
        // parser's limit allows, counted from the line.
        let mut decimal = shape();
        decimal.columns[1].kind = Kind::Decimal {
            precision: 20,
            scale: 4,
        };
        let decimal = Shapes::new([Arc::new(decimal)]);
        let line = r#"{"op":"insert","table":"public.t","data":{"id":1,"doc":1234567890123456.7891},"old":null,"seq":1,"idempotency_key":"k","commit_lsn":"0/1"}"#;
        assert!(super::super::scan::scan_line(&decimal, line).is_none());
        let mut tab = shape();
        tab.columns[1].name = "a\tb".into();
        let tab = Shapes::new([Arc::new(tab)]);
        let line = "{\"op\":\"insert\",\"table\":\"public.t\",\"data\":{\"id\":1,\"a\tb\":\"x\"},\"old\":null,\"seq\":1,\"idempotency_key\":\"k\",\"commit_lsn\":\"0/1\"}";
        assert!(super::super::scan::scan_line(&tab, line).is_none());
        assert!(type_text(&tab, line).is_err());
        let mut json = shape();
        json.columns[1].kind = Kind::Json;
        let json = Shapes::new([Arc::new(json)]);
        let deep = |n: usize| {
            format!(
                r#"{{"op":"insert","table":"public.t","data":{{"id":1,"doc":{}{}}},"old":null,"seq":1,"idempotency_key":"k","commit_lsn":"0/1"}}"#,
                "[".repeat(n),
                "]".repeat(n)
            )
        };
        // A debug build's frames are large: parsed on a thread with room.
        std::thread::Builder::new()
            .stack_size(256 << 20)
            .spawn(move || {
                assert!(super::super::scan::scan_line(&json, &deep(200)).is_some());
                assert!(super::super::scan::scan_line(&json, &deep(254)).is_none());
                assert!(type_text(&json, &deep(254)).is_err());
            })
            .unwrap()
            .join()
            .unwrap();
        // Postgres prints a float8 -0 as `-0`; sonic-rs reads it as 0, the
        // fast path as -0.
        let mut shape = shape();
        shape.columns[1].kind = Kind::Float64;
        let shapes = Shapes::new([Arc::new(shape)]);
        let line = r#"{"op":"insert","table":"public.t","data":{"id":1,"doc":-0},"old":null,"seq":1,"idempotency_key":"k","commit_lsn":"0/1"}"#;
        let (_, c) = type_text(&shapes, line).unwrap().change.unwrap();
        assert!(matches!(c.cells[1], Cell::Float(f) if f == 0.0 && f.is_sign_negative()));
    }

    #[test]
    fn a_line_that_is_not_utf8_is_an_error_that_says_where() {
        let shapes = Shapes::new([Arc::new(shape())]);
        let mut line = br#"{"op":"insert","table":"public.t","data":{"id":1,"doc":"x"#.to_vec();
        line.extend_from_slice(
            b"\xff\"},\"old\":null,\"seq\":9,\"idempotency_key\":\"k\",\"commit_lsn\":\"0/1\"}",
        );
        let err = type_line(&shapes, &line).err().unwrap();
        assert!(
            err.contains("not UTF-8") && err.contains("index 57"),
            "{err}"
        );
    }
}
