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

pub mod array;
pub mod parse;

use arrow::datatypes::{DataType, Field, TimeUnit};
use serde::{Deserialize, Serialize};

use crate::archive::schema::SchemaRecord;

/// The Parquet/Arrow type a column is written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// int2.
    Int16,
    /// int4.
    Int32,
    /// int8 and oid.
    Int64,
    /// float4.
    Float32,
    /// float8.
    Float64,
    /// bool.
    Bool,
    /// numeric(p,s) with p <= 38.
    Decimal {
        /// Digits in all.
        precision: u8,
        /// Digits after the point.
        scale: i8,
    },
    /// date: days since 1970-01-01.
    Date,
    /// timestamp: microseconds, no time zone.
    Timestamp,
    /// timestamptz: microseconds, UTC.
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

    /// The Arrow type of the column.
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
    /// As in Postgres.
    pub name: String,
    /// The type it is written as.
    pub kind: Kind,
}

/// A table's compacted shape: the union of its recorded shapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableShape {
    /// `schema.table` as the archive names it.
    pub table: String,
    /// Every column any recorded shape had, in the order they came.
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

    /// The table's columns as Arrow fields, each nullable (a deleted row's,
    /// an unchanged TOAST value's or a later-added column's cell is null):
    /// the data columns of the history, the latest view, the compaction
    /// spool and the query's tables.
    pub fn data_fields(&self) -> impl Iterator<Item = Field> + '_ {
        self.columns
            .iter()
            .map(|c| Field::new(&c.name, c.kind.data_type(), true))
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

    /// The index of the column `name`.
    pub fn column(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }
}

/// One value in memory. `Absent` is a column an update left out (unchanged
/// TOAST): written as null in the history, carried forward in the latest view.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// Left out by the change (unchanged TOAST).
    Absent,
    /// SQL NULL.
    Null,
    /// Integers, days since 1970 (dates) and microseconds (timestamps).
    Int(i64),
    /// float4 and float8, NaN and infinities included.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A decimal's unscaled value.
    Dec(i128),
    /// Inline up to 24 bytes, so most short texts cost no allocation.
    Str(compact_str::CompactString),
}

#[cfg(test)]
mod tests {
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
}
