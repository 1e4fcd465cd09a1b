//! From the archive's schema records and JSON values to typed Arrow columns.
//!
//! A table's columns are the union of every recorded shape (schema record
//! versions, in order), so a column added later simply appears; a column
//! whose type changed takes a type that holds both exactly ([`Kind::widen`])
//! or, when none does, text. Values are parsed from the JSON the source
//! renders (docs/output-contract.md, "Values") into [`Cell`]s, the one
//! in-memory form shared by the history writer, the latest view and, later,
//! `query`.
//!
//! The mapping (also in docs/compaction.md, "Types"):
//! int2/int4/int8/oid -> Int16/Int32/Int64, float4/float8 -> Float32/Float64
//! (NaN and infinities kept), bool, numeric(p,s) with p <= 38 -> Decimal128(p,s),
//! date -> Date32, timestamp -> Timestamp(us), timestamptz -> Timestamp(us, UTC)
//! (`infinity` as the largest value, `-infinity` the smallest, as DuckDB
//! does), json/jsonb/arrays/hstore -> Utf8 holding the JSON text, anything
//! else (text, uuid, numeric without a precision, intervals, ...) -> Utf8.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, BooleanBuilder, Date32Array, Date32Builder, Decimal128Array,
    Decimal128Builder, Float32Array, Float32Builder, Float64Array, Float64Builder, Int16Array,
    Int16Builder, Int32Array, Int32Builder, Int64Array, Int64Builder, StringArray, StringBuilder,
    TimestampMicrosecondArray, TimestampMicrosecondBuilder,
};
use arrow::datatypes::{DataType, TimeUnit};
use chrono::{DateTime, Datelike, NaiveDate, NaiveDateTime};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::archive::schema::SchemaRecord;

/// The Parquet/Arrow type a column is written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    Int16,
    Int32,
    Int64,
    Float32,
    Float64,
    Bool,
    Decimal {
        precision: u8,
        scale: i8,
    },
    Date,
    Timestamp,
    TimestampTz,
    /// Strings as they are; numbers and booleans as their JSON text.
    Text,
    /// The value's JSON text (json, jsonb, arrays, hstore).
    Json,
}

impl Kind {
    /// The kind of a recorded Postgres column.
    pub fn from_pg(type_oid: u32, type_modifier: i32, type_name: &str) -> Kind {
        match type_oid {
            21 => Kind::Int16,
            23 => Kind::Int32,
            20 | 26 => Kind::Int64,
            700 => Kind::Float32,
            701 => Kind::Float64,
            16 => Kind::Bool,
            1700 if type_modifier >= 4 => {
                let m = type_modifier - 4;
                let precision = (m >> 16) & 0xffff;
                // Postgres 15 allows a negative scale, stored as 11 bits.
                let scale = ((m & 0x7ff) ^ 1024) - 1024;
                if (1..=38).contains(&precision) && (0..=precision).contains(&scale) {
                    Kind::Decimal {
                        precision: precision as u8,
                        scale: scale as i8,
                    }
                } else {
                    Kind::Text
                }
            }
            1082 => Kind::Date,
            1114 => Kind::Timestamp,
            1184 => Kind::TimestampTz,
            114 | 3802 => Kind::Json,
            _ if type_name.ends_with("[]") || type_name == "hstore" => Kind::Json,
            _ => Kind::Text,
        }
    }

    pub fn data_type(self) -> DataType {
        match self {
            Kind::Int16 => DataType::Int16,
            Kind::Int32 => DataType::Int32,
            Kind::Int64 => DataType::Int64,
            Kind::Float32 => DataType::Float32,
            Kind::Float64 => DataType::Float64,
            Kind::Bool => DataType::Boolean,
            Kind::Decimal { precision, scale } => DataType::Decimal128(precision, scale),
            Kind::Date => DataType::Date32,
            Kind::Timestamp => DataType::Timestamp(TimeUnit::Microsecond, None),
            Kind::TimestampTz => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            Kind::Text | Kind::Json => DataType::Utf8,
        }
    }

    /// The narrowest kind that holds every value of both exactly, if any:
    /// a wider integer, float8 for int2/int4/float4, a decimal with room
    /// for both. `None` means the change cannot be read as one type.
    pub fn widen(self, other: Kind) -> Option<Kind> {
        use Kind::*;
        if self == other {
            return Some(self);
        }
        let int_digits = |k: Kind| match k {
            Int16 => Some(5),
            Int32 => Some(10),
            Int64 => Some(19),
            _ => None,
        };
        Some(match (self, other) {
            (Int16 | Int32 | Int64, Int16 | Int32 | Int64) => {
                if int_digits(self) > int_digits(other) {
                    self
                } else {
                    other
                }
            }
            (Int16 | Int32 | Float32, Float64) | (Float64, Int16 | Int32 | Float32) => Float64,
            (
                Decimal {
                    precision: p1,
                    scale: s1,
                },
                Decimal {
                    precision: p2,
                    scale: s2,
                },
            ) => {
                let scale = s1.max(s2);
                let whole = (p1 as i32 - s1 as i32).max(p2 as i32 - s2 as i32);
                let precision = whole + scale as i32;
                if precision > 38 {
                    return None;
                }
                Decimal {
                    precision: precision as u8,
                    scale,
                }
            }
            (Int16 | Int32 | Int64, Decimal { precision, scale })
            | (Decimal { precision, scale }, Int16 | Int32 | Int64) => {
                let int = if matches!(self, Decimal { .. }) {
                    other
                } else {
                    self
                };
                let whole = (precision as i32 - scale as i32).max(int_digits(int)?);
                if whole + scale as i32 > 38 {
                    return None;
                }
                Decimal {
                    precision: (whole + scale as i32) as u8,
                    scale,
                }
            }
            (Date, Timestamp) | (Timestamp, Date) => Timestamp,
            _ => return None,
        })
    }

    /// A name for messages: the Arrow type.
    pub fn describe(self) -> String {
        match self {
            Kind::Json => "Utf8 (JSON text)".into(),
            k => k.data_type().to_string(),
        }
    }
}

/// A column of a compacted table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Column {
    pub name: String,
    pub kind: Kind,
}

/// A table's compacted shape: the union of its recorded shapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableShape {
    /// `schema.table` as the archive names it.
    pub table: String,
    pub columns: Vec<Column>,
    /// Indexes of the key (replica identity) columns of the newest shape,
    /// in the order of their names (the order of a row key's JSON, see
    /// `read::key_json`); empty when the table has none (REPLICA IDENTITY
    /// NOTHING): such a table has a history but no latest view.
    pub key: Vec<usize>,
}

impl TableShape {
    /// `public.t (id bigint, doc text)` keyed by `id`: the table unit tests
    /// of compaction and query share.
    #[cfg(test)]
    pub fn test_t() -> TableShape {
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

    /// Folds a table's schema records (any order) into one shape.
    pub fn from_records(table: &str, records: &[SchemaRecord]) -> TableShape {
        let mut sorted: Vec<&SchemaRecord> = records.iter().collect();
        sorted.sort_by_key(|r| r.version);
        let mut columns: Vec<Column> = Vec::new();
        for r in &sorted {
            for c in &r.columns {
                let kind = Kind::from_pg(c.type_oid, c.type_modifier, &c.type_name);
                match columns.iter_mut().find(|x| x.name == c.name) {
                    Some(existing) => {
                        existing.kind = existing.kind.widen(kind).unwrap_or(Kind::Text);
                    }
                    None => columns.push(Column {
                        name: c.name.clone(),
                        kind,
                    }),
                }
            }
        }
        let mut key: Vec<usize> = sorted
            .last()
            .map(|r| {
                r.columns
                    .iter()
                    .filter(|c| c.key)
                    .filter_map(|c| columns.iter().position(|x| x.name == c.name))
                    .collect()
            })
            .unwrap_or_default();
        key.sort_by(|a, b| columns[*a].name.cmp(&columns[*b].name));
        key.dedup();
        TableShape {
            table: table.to_string(),
            columns,
            key,
        }
    }

    /// `(schema, table)`, split at the first dot as the archive writes them.
    pub fn schema_and_name(&self) -> (&str, &str) {
        self.table
            .split_once('.')
            .unwrap_or(("public", &self.table))
    }

    pub fn column(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }
}

/// One value in memory. `Absent` is a column an update left out (unchanged
/// TOAST): written as null in the history, carried forward in the latest view.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    Absent,
    Null,
    /// Integers, days since 1970 (dates) and microseconds (timestamps).
    Int(i64),
    Float(f64),
    Bool(bool),
    /// A decimal's unscaled value.
    Dec(i128),
    /// Inline up to 24 bytes, so most short texts cost no allocation.
    Str(compact_str::CompactString),
}

/// Parses one JSON value as rendered by the source into a cell of `kind`;
/// the error says what the value is and why it does not fit.
pub fn parse_cell(kind: Kind, value: &Value) -> Result<Cell, String> {
    let bad = || not_valid(kind, value);
    Ok(match value {
        Value::Null => Cell::Null,
        Value::String(s) => return parse_str_cell(kind, s),
        Value::Number(n) => match kind {
            Kind::Int16 | Kind::Int32 | Kind::Int64 => {
                int_cell(kind, n.as_i64().ok_or_else(bad)?).ok_or_else(bad)?
            }
            Kind::Float32 | Kind::Float64 => Cell::Float(n.as_f64().ok_or_else(bad)?),
            Kind::Decimal { precision, scale } => {
                Cell::Dec(parse_decimal(&n.to_string(), precision, scale).ok_or_else(bad)?)
            }
            Kind::Text | Kind::Json => Cell::Str(n.to_string().into()),
            Kind::Bool | Kind::Date | Kind::Timestamp | Kind::TimestampTz => return Err(bad()),
        },
        Value::Bool(b) => match kind {
            Kind::Bool => Cell::Bool(*b),
            Kind::Text | Kind::Json => Cell::Str(value.to_string().into()),
            _ => return Err(bad()),
        },
        Value::Array(_) | Value::Object(_) => match kind {
            Kind::Text | Kind::Json => Cell::Str(value.to_string().into()),
            _ => return Err(bad()),
        },
    })
}

/// The error of a value (as JSON text) that is no valid `kind`.
pub fn not_valid(kind: Kind, value: impl std::fmt::Display) -> String {
    format!("{value} is not a valid {}", kind.describe())
}

/// An integer as a cell of an integer `kind`, if it fits.
pub fn int_cell(kind: Kind, n: i64) -> Option<Cell> {
    let fits = match kind {
        Kind::Int16 => i16::try_from(n).is_ok(),
        Kind::Int32 => i32::try_from(n).is_ok(),
        _ => true,
    };
    fits.then_some(Cell::Int(n))
}

/// [`parse_cell`] of a JSON string, without a `Value` around it (the
/// archive reader parses strings straight from the line).
pub fn parse_str_cell(kind: Kind, s: &str) -> Result<Cell, String> {
    let bad = || not_valid(kind, Value::from(s));
    Ok(match kind {
        Kind::Int16 | Kind::Int32 | Kind::Int64 | Kind::Bool => return Err(bad()),
        Kind::Float32 | Kind::Float64 => Cell::Float(match s {
            "NaN" => f64::NAN,
            "Infinity" => f64::INFINITY,
            "-Infinity" => f64::NEG_INFINITY,
            _ => return Err(bad()),
        }),
        Kind::Decimal { precision, scale } => {
            Cell::Dec(parse_decimal(s, precision, scale).ok_or_else(bad)?)
        }
        Kind::Date => Cell::Int(match s {
            "infinity" => i32::MAX as i64,
            "-infinity" => i32::MIN as i64,
            _ => match canonical_date(s.as_bytes()) {
                Some(days) => days,
                None => {
                    let (core, bc) = era(s);
                    let d = NaiveDate::parse_from_str(core, "%Y-%m-%d").map_err(|_| bad())?;
                    let d = if bc {
                        d.with_year(1 - d.year()).ok_or_else(bad)?
                    } else {
                        d
                    };
                    (d - NaiveDate::from_ymd_opt(1970, 1, 1).expect("valid")).num_days()
                }
            },
        }),
        Kind::Timestamp | Kind::TimestampTz => Cell::Int(match s {
            "infinity" => i64::MAX,
            "-infinity" => i64::MIN,
            _ => match canonical_timestamp(s.as_bytes(), kind == Kind::TimestampTz) {
                Some(micros) => micros,
                None => {
                    let (core, bc) = era(s);
                    let t = if kind == Kind::Timestamp {
                        NaiveDateTime::parse_from_str(core, "%Y-%m-%dT%H:%M:%S%.f")
                            .map_err(|_| bad())?
                    } else {
                        DateTime::parse_from_rfc3339(core)
                            .map_err(|_| bad())?
                            .naive_utc()
                    };
                    let t = if bc {
                        t.with_year(1 - t.year()).ok_or_else(bad)?
                    } else {
                        t
                    };
                    t.and_utc().timestamp_micros()
                }
            },
        }),
        Kind::Text => Cell::Str(s.into()),
        Kind::Json => Cell::Str(Value::from(s).to_string().into()),
    })
}

/// The value of the ASCII digits `b` (all of them digits), else `None`.
fn digits(b: &[u8]) -> Option<u32> {
    b.iter().try_fold(0u32, |n, &d| {
        d.is_ascii_digit().then(|| n * 10 + (d - b'0') as u32)
    })
}

/// Days from 0001-01-01 (chrono's day 1) to 1970-01-01.
const UNIX_EPOCH_DAY_FROM_CE: i64 = 719_163;

/// `YYYY-MM-DD` as the source writes dates of years 1-9999 AD (days since
/// 1970); `None` for any other form, left to chrono's general parser
/// (its format parser is what costs: the calendar is chrono's here too).
fn canonical_date(s: &[u8]) -> Option<i64> {
    let [y0, y1, y2, y3, b'-', m0, m1, b'-', d0, d1] = *s else {
        return None;
    };
    let year = digits(&[y0, y1, y2, y3])?;
    if year == 0 {
        return None;
    }
    let date = NaiveDate::from_ymd_opt(year as i32, digits(&[m0, m1])?, digits(&[d0, d1])?)?;
    Some(date.num_days_from_ce() as i64 - UNIX_EPOCH_DAY_FROM_CE)
}

/// `YYYY-MM-DDTHH:MM:SS[.fraction]` followed, for `tz`, by `+HH:MM` or
/// `-HH:MM`: the form the source writes timestamps in (microseconds since
/// 1970, UTC). `None` for any other form (a leap second, `Z`, a BC year,
/// ...), left to chrono's general parser, whose result this equals.
fn canonical_timestamp(s: &[u8], tz: bool) -> Option<i64> {
    if s.len() < 19 || s[10] != b'T' || s[13] != b':' || s[16] != b':' {
        return None;
    }
    let days = canonical_date(&s[..10])?;
    let (hour, minute, second) = (
        digits(&s[11..13])?,
        digits(&s[14..16])?,
        digits(&s[17..19])?,
    );
    if hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let mut rest = &s[19..];
    let mut micros = 0i64;
    if let Some(frac) = rest.strip_prefix(b".") {
        let n = frac.iter().take_while(|b| b.is_ascii_digit()).count();
        if n == 0 || n > 9 {
            return None;
        }
        // Nanoseconds truncated to microseconds, as chrono's are.
        let mut nanos = digits(&frac[..n])? as i64;
        for _ in n..9 {
            nanos *= 10;
        }
        micros = nanos / 1000;
        rest = &frac[n..];
    }
    let offset = if tz {
        let [sign, h0, h1, b':', m0, m1] = *rest else {
            return None;
        };
        let (oh, om) = (digits(&[h0, h1])?, digits(&[m0, m1])?);
        if oh > 23 || om > 59 {
            return None;
        }
        let secs = (oh * 3600 + om * 60) as i64;
        match sign {
            b'+' => secs,
            b'-' => -secs,
            _ => return None,
        }
    } else if rest.is_empty() {
        0
    } else {
        return None;
    };
    let secs = days * 86_400 + (hour * 3600 + minute * 60 + second) as i64 - offset;
    Some(secs * 1_000_000 + micros)
}

/// `"0044-03-15 BC"` -> (`"0044-03-15"`, true).
fn era(s: &str) -> (&str, bool) {
    match s.strip_suffix(" BC") {
        Some(core) => (core, true),
        None => (s, false),
    }
}

/// Parses a decimal text (`-12.5`, `5.00`, `1e-7`) into its unscaled value
/// at `scale`, if it has no more fractional digits than `scale` and fits
/// `precision` digits.
pub fn parse_decimal(text: &str, precision: u8, scale: i8) -> Option<i128> {
    // One pass over the bytes (splitting the text first was 2% of compact).
    let bytes = text.as_bytes();
    let (neg, mut i) = match bytes.first() {
        Some(b'-') => (true, 1),
        Some(b'+') => (false, 1),
        _ => (false, 0),
    };
    let mut unscaled: i128 = 0;
    let (mut digits, mut frac_len, mut dot) = (0usize, 0i32, false);
    while let Some(&b) = bytes.get(i) {
        match b {
            b'0'..=b'9' => {
                unscaled = unscaled.checked_mul(10)?.checked_add((b - b'0') as i128)?;
                digits += 1;
                frac_len += i32::from(dot);
            }
            b'.' if !dot => dot = true,
            b'e' | b'E' => break,
            _ => return None,
        }
        i += 1;
    }
    if digits == 0 {
        return None;
    }
    let exp = if i < bytes.len() {
        text[i + 1..].parse::<i32>().ok()?
    } else {
        0
    };
    // value = unscaled * 10^(exp - frac_len); we want value * 10^scale.
    let shift = exp.checked_sub(frac_len)?.checked_add(scale as i32)?;
    if shift >= 0 {
        unscaled = unscaled.checked_mul(10i128.checked_pow(shift as u32)?)?;
    } else {
        let div = 10i128.checked_pow(shift.checked_neg()? as u32)?;
        if unscaled % div != 0 {
            return None;
        }
        unscaled /= div;
    }
    if unscaled >= 10i128.checked_pow(precision as u32)? {
        return None;
    }
    Some(if neg { -unscaled } else { unscaled })
}

/// Builds the Arrow array of `kind` from cells (absent as null).
pub fn build_array<'a>(kind: Kind, cells: impl Iterator<Item = &'a Cell>) -> ArrayRef {
    let mut builder = ColumnBuilder::new(kind, cells.size_hint().0);
    for cell in cells {
        builder.append(cell);
    }
    builder.finish()
}

/// One column's values of `kind`, appended a cell at a time (absent and
/// null, and a cell of another kind, as null): how the archive reader
/// builds the history's columns as it parses, so a change is not held as
/// cells until a buffer of them is converted.
pub enum ColumnBuilder {
    Int16(Int16Builder),
    Int32(Int32Builder),
    Int64(Int64Builder),
    Float32(Float32Builder),
    Float64(Float64Builder),
    Bool(BooleanBuilder),
    Decimal(Decimal128Builder, u8, i8),
    Date(Date32Builder),
    /// With the timezone (UTC) of a timestamptz.
    Timestamp(TimestampMicrosecondBuilder, bool),
    Text(StringBuilder),
}

impl ColumnBuilder {
    pub fn new(kind: Kind, capacity: usize) -> ColumnBuilder {
        match kind {
            Kind::Int16 => ColumnBuilder::Int16(Int16Builder::with_capacity(capacity)),
            Kind::Int32 => ColumnBuilder::Int32(Int32Builder::with_capacity(capacity)),
            Kind::Int64 => ColumnBuilder::Int64(Int64Builder::with_capacity(capacity)),
            Kind::Float32 => ColumnBuilder::Float32(Float32Builder::with_capacity(capacity)),
            Kind::Float64 => ColumnBuilder::Float64(Float64Builder::with_capacity(capacity)),
            Kind::Bool => ColumnBuilder::Bool(BooleanBuilder::with_capacity(capacity)),
            Kind::Decimal { precision, scale } => {
                ColumnBuilder::Decimal(Decimal128Builder::with_capacity(capacity), precision, scale)
            }
            Kind::Date => ColumnBuilder::Date(Date32Builder::with_capacity(capacity)),
            Kind::Timestamp | Kind::TimestampTz => ColumnBuilder::Timestamp(
                TimestampMicrosecondBuilder::with_capacity(capacity),
                kind == Kind::TimestampTz,
            ),
            // About 16 bytes a value to start with: grown as needed.
            Kind::Text | Kind::Json => {
                ColumnBuilder::Text(StringBuilder::with_capacity(capacity, capacity * 16))
            }
        }
    }

    /// Appends `cell`.
    pub fn append(&mut self, cell: &Cell) {
        match (self, cell) {
            (ColumnBuilder::Int16(b), Cell::Int(v)) => b.append_value(*v as i16),
            (ColumnBuilder::Int32(b), Cell::Int(v)) => b.append_value(*v as i32),
            (ColumnBuilder::Int64(b), Cell::Int(v)) => b.append_value(*v),
            (ColumnBuilder::Float32(b), Cell::Float(v)) => b.append_value(*v as f32),
            (ColumnBuilder::Float64(b), Cell::Float(v)) => b.append_value(*v),
            (ColumnBuilder::Bool(b), Cell::Bool(v)) => b.append_value(*v),
            (ColumnBuilder::Decimal(b, ..), Cell::Dec(v)) => b.append_value(*v),
            (ColumnBuilder::Date(b), Cell::Int(v)) => b.append_value(*v as i32),
            (ColumnBuilder::Timestamp(b, _), Cell::Int(v)) => b.append_value(*v),
            (ColumnBuilder::Text(b), Cell::Str(s)) => b.append_value(s),
            (builder, _) => builder.append_null(),
        }
    }

    fn append_null(&mut self) {
        match self {
            ColumnBuilder::Int16(b) => b.append_null(),
            ColumnBuilder::Int32(b) => b.append_null(),
            ColumnBuilder::Int64(b) => b.append_null(),
            ColumnBuilder::Float32(b) => b.append_null(),
            ColumnBuilder::Float64(b) => b.append_null(),
            ColumnBuilder::Bool(b) => b.append_null(),
            ColumnBuilder::Decimal(b, ..) => b.append_null(),
            ColumnBuilder::Date(b) => b.append_null(),
            ColumnBuilder::Timestamp(b, _) => b.append_null(),
            ColumnBuilder::Text(b) => b.append_null(),
        }
    }

    /// The values appended since the last call, as an array of the
    /// column's Arrow type.
    pub fn finish(&mut self) -> ArrayRef {
        match self {
            ColumnBuilder::Int16(b) => Arc::new(b.finish()),
            ColumnBuilder::Int32(b) => Arc::new(b.finish()),
            ColumnBuilder::Int64(b) => Arc::new(b.finish()),
            ColumnBuilder::Float32(b) => Arc::new(b.finish()),
            ColumnBuilder::Float64(b) => Arc::new(b.finish()),
            ColumnBuilder::Bool(b) => Arc::new(b.finish()),
            ColumnBuilder::Decimal(b, precision, scale) => Arc::new(
                b.finish()
                    .with_precision_and_scale(*precision, *scale)
                    .expect("precision and scale were validated"),
            ),
            ColumnBuilder::Date(b) => Arc::new(b.finish()),
            ColumnBuilder::Timestamp(b, false) => Arc::new(b.finish()),
            ColumnBuilder::Timestamp(b, true) => Arc::new(b.finish().with_timezone("UTC")),
            ColumnBuilder::Text(b) => Arc::new(b.finish()),
        }
    }
}

/// Reads cells of `kind` back from an array written by [`build_array`]
/// (possibly with a narrower type of an earlier run: it is cast first).
pub fn read_cells(kind: Kind, array: &ArrayRef) -> Result<Vec<Cell>, String> {
    let array = arrow::compute::cast(array, &kind.data_type()).map_err(|e| {
        format!(
            "cannot read {} as {}: {e}",
            array.data_type(),
            kind.describe()
        )
    })?;
    let n = array.len();
    let mut out = Vec::with_capacity(n);
    macro_rules! each {
        ($ty:ty, $f:expr) => {{
            let a = array
                .as_any()
                .downcast_ref::<$ty>()
                .expect("cast to this type");
            for i in 0..n {
                out.push(if a.is_null(i) {
                    Cell::Null
                } else {
                    $f(a.value(i))
                });
            }
        }};
    }
    match kind {
        Kind::Int16 => each!(Int16Array, |v: i16| Cell::Int(v as i64)),
        Kind::Int32 => each!(Int32Array, |v: i32| Cell::Int(v as i64)),
        Kind::Int64 => each!(Int64Array, Cell::Int),
        Kind::Float32 => each!(Float32Array, |v: f32| Cell::Float(v as f64)),
        Kind::Float64 => each!(Float64Array, Cell::Float),
        Kind::Bool => each!(BooleanArray, Cell::Bool),
        Kind::Decimal { .. } => each!(Decimal128Array, Cell::Dec),
        Kind::Date => each!(Date32Array, |v: i32| Cell::Int(v as i64)),
        Kind::Timestamp | Kind::TimestampTz => each!(TimestampMicrosecondArray, Cell::Int),
        Kind::Text | Kind::Json => each!(StringArray, |v: &str| Cell::Str(v.into())),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::archive::schema::RecordColumn;

    #[test]
    fn numeric_typmod_gives_decimal_when_it_fits() {
        let typmod = |p: i32, s: i32| ((p << 16) | s) + 4;
        assert_eq!(
            Kind::from_pg(1700, typmod(10, 2), "numeric(10,2)"),
            Kind::Decimal {
                precision: 10,
                scale: 2
            }
        );
        assert_eq!(Kind::from_pg(1700, -1, "numeric"), Kind::Text);
        assert_eq!(
            Kind::from_pg(1700, typmod(60, 2), "numeric(60,2)"),
            Kind::Text
        );
        assert_eq!(Kind::from_pg(1009, -1, "text[]"), Kind::Json);
    }

    #[test]
    fn decimals_parse_exactly_or_not_at_all() {
        assert_eq!(parse_decimal("5.00", 10, 2), Some(500));
        assert_eq!(parse_decimal("-12.5", 10, 2), Some(-1250));
        assert_eq!(parse_decimal("1e-2", 10, 2), Some(1));
        assert_eq!(parse_decimal("7", 3, 0), Some(7));
        assert_eq!(parse_decimal("1.005", 10, 2), None, "would round");
        assert_eq!(parse_decimal("1000", 3, 0), None, "too many digits");
        assert_eq!(parse_decimal("NaN", 10, 2), None);
        assert_eq!(parse_decimal("", 10, 2), None);
        for bad in [".", "-", "1.2.3", "+-5", "1e", "1e+", "1.5x"] {
            assert_eq!(parse_decimal(bad, 10, 2), None, "{bad}");
        }
        assert_eq!(parse_decimal("+.5", 10, 2), Some(50));
        assert_eq!(parse_decimal("5.", 10, 2), Some(500));
        assert_eq!(parse_decimal("1.5E+1", 10, 2), Some(1500));
        // An exponent out of range is no number, not an overflow.
        assert_eq!(parse_decimal("1e2147483647", 10, 2), None);
        assert_eq!(parse_decimal("1e-2147483648", 10, 2), None);
        assert_eq!(parse_decimal("1e-2147483648", 10, 0), None);
    }

    #[test]
    fn values_parse_into_cells_of_their_kind() {
        assert_eq!(parse_cell(Kind::Int16, &json!(7)), Ok(Cell::Int(7)));
        assert!(parse_cell(Kind::Int16, &json!(70000)).is_err());
        assert_eq!(
            parse_cell(Kind::Float64, &json!("-Infinity")),
            Ok(Cell::Float(f64::NEG_INFINITY))
        );
        assert_eq!(
            parse_cell(Kind::Date, &json!("1970-01-02")),
            Ok(Cell::Int(1))
        );
        assert_eq!(
            parse_cell(Kind::Date, &json!("0001-01-01 BC")),
            parse_cell(Kind::Date, &json!("0000-01-01"))
        );
        assert_eq!(
            parse_cell(Kind::Timestamp, &json!("1970-01-01T00:00:01.5")),
            Ok(Cell::Int(1_500_000))
        );
        assert_eq!(
            parse_cell(Kind::TimestampTz, &json!("1970-01-01T00:00:01+00:00")),
            Ok(Cell::Int(1_000_000))
        );
        assert_eq!(
            parse_cell(Kind::Timestamp, &json!("infinity")),
            Ok(Cell::Int(i64::MAX))
        );
        assert_eq!(parse_cell(Kind::Text, &json!(5)), Ok(Cell::Str("5".into())));
        assert_eq!(
            parse_cell(Kind::Json, &json!({"a": "x\"y"})),
            Ok(Cell::Str(r#"{"a":"x\"y"}"#.into()))
        );
        assert_eq!(parse_cell(Kind::Json, &json!(null)), Ok(Cell::Null));
    }

    /// chrono's parse of a date or timestamp, the general path.
    fn by_chrono(kind: Kind, s: &str) -> Option<i64> {
        let (core, bc) = era(s);
        let t = match kind {
            Kind::Date => {
                let d = NaiveDate::parse_from_str(core, "%Y-%m-%d").ok()?;
                let d = if bc { d.with_year(1 - d.year())? } else { d };
                return Some((d - NaiveDate::from_ymd_opt(1970, 1, 1)?).num_days());
            }
            Kind::Timestamp => NaiveDateTime::parse_from_str(core, "%Y-%m-%dT%H:%M:%S%.f").ok()?,
            _ => DateTime::parse_from_rfc3339(core).ok()?.naive_utc(),
        };
        let t = if bc { t.with_year(1 - t.year())? } else { t };
        Some(t.and_utc().timestamp_micros())
    }

    proptest::proptest! {
        /// The canonical forms' own parser gives chrono's value, and leaves
        /// every form it does not take (or an invalid one) to chrono.
        #[test]
        fn canonical_dates_and_timestamps_parse_as_chrono_does(
            year in 0u32..10_000, month in 0u32..14, day in 0u32..33,
            hour in 0u32..25, minute in 0u32..61, second in 0u32..61,
            frac in proptest::option::of("[0-9]{1,10}"),
            offset in proptest::option::of((proptest::bool::ANY, 0u32..25, 0u32..61)),
            tz in proptest::bool::ANY,
        ) {
            let date = format!("{year:04}-{month:02}-{day:02}");
            if let Some(days) = canonical_date(date.as_bytes()) {
                proptest::prop_assert_eq!(Some(days), by_chrono(Kind::Date, &date), "{}", date);
            }
            let mut ts = format!("{date}T{hour:02}:{minute:02}:{second:02}");
            if let Some(f) = &frac {
                ts = format!("{ts}.{f}");
            }
            if let Some((minus, h, m)) = offset {
                ts = format!("{ts}{}{h:02}:{m:02}", if minus { '-' } else { '+' });
            }
            let kind = if tz { Kind::TimestampTz } else { Kind::Timestamp };
            if let Some(micros) = canonical_timestamp(ts.as_bytes(), tz) {
                proptest::prop_assert_eq!(Some(micros), by_chrono(kind, &ts), "{}", ts);
            }
            // Whichever parser takes it, the cell is chrono's value.
            let cell = parse_str_cell(kind, &ts).ok();
            proptest::prop_assert_eq!(cell, by_chrono(kind, &ts).map(Cell::Int), "{}", ts);
        }
    }

    #[test]
    fn a_shapes_key_is_ordered_by_column_name_as_its_json_is() {
        let col = |name: &str, key: bool| RecordColumn {
            name: name.into(),
            type_name: String::new(),
            type_oid: 20,
            type_modifier: -1,
            key,
        };
        let record = SchemaRecord {
            table: "public.t".into(),
            version: 1,
            columns: vec![col("id", true), col("v", false), col("code", true)],
            replica_identity: "default".into(),
        };
        let shape = TableShape::from_records("public.t", &[record]);
        assert_eq!(shape.key, [2, 0], "code, then id");
    }

    #[test]
    fn the_forms_the_source_writes_take_the_canonical_parsers() {
        assert_eq!(
            canonical_date(b"2024-02-29"),
            by_chrono(Kind::Date, "2024-02-29")
        );
        assert_eq!(canonical_date(b"2023-02-29"), None);
        let ts = "2026-11-05T11:00:01.990001+01:30";
        assert_eq!(
            canonical_timestamp(ts.as_bytes(), true),
            by_chrono(Kind::TimestampTz, ts)
        );
        let ts = "1969-12-31T23:59:59.5";
        assert_eq!(canonical_timestamp(ts.as_bytes(), false), Some(-500_000));
        // Left to chrono: a BC year, a leap second, `Z`.
        assert_eq!(canonical_timestamp(b"0044-03-15T00:00:00 BC", false), None);
        assert_eq!(
            canonical_timestamp(b"2016-12-31T23:59:60+00:00", true),
            None
        );
        assert_eq!(canonical_timestamp(b"2016-12-31T23:59:59Z", true), None);
    }

    #[test]
    fn widening_keeps_every_value_or_refuses() {
        use Kind::*;
        assert_eq!(Int32.widen(Int64), Some(Int64));
        assert_eq!(Int64.widen(Int16), Some(Int64));
        assert_eq!(Int32.widen(Float64), Some(Float64));
        assert_eq!(Int64.widen(Float64), None, "float8 loses int8 digits");
        assert_eq!(
            Decimal {
                precision: 10,
                scale: 2
            }
            .widen(Decimal {
                precision: 12,
                scale: 4
            }),
            Some(Decimal {
                precision: 12,
                scale: 4
            })
        );
        assert_eq!(Int64.widen(Text), None);
    }

    #[test]
    fn cells_round_trip_through_arrow() {
        let kinds = [
            (Kind::Int16, vec![Cell::Int(-3), Cell::Null]),
            (
                Kind::Float32,
                vec![Cell::Float(1.5), Cell::Float(f64::INFINITY)],
            ),
            (
                Kind::Decimal {
                    precision: 10,
                    scale: 2,
                },
                vec![Cell::Dec(12345), Cell::Null],
            ),
            (Kind::TimestampTz, vec![Cell::Int(i64::MIN), Cell::Int(5)]),
            (Kind::Json, vec![Cell::Str("[1]".into()), Cell::Null]),
        ];
        for (kind, cells) in kinds {
            let array = build_array(kind, cells.iter());
            assert_eq!(array.data_type(), &kind.data_type());
            assert_eq!(read_cells(kind, &array).unwrap(), cells, "{kind:?}");
        }
        // An earlier run's narrower column reads as the wider kind.
        let narrow = build_array(Kind::Int32, [Cell::Int(9)].iter());
        assert_eq!(read_cells(Kind::Int64, &narrow).unwrap(), [Cell::Int(9)]);
    }
}
