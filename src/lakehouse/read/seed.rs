//! The general parser: one pass of serde over a line the fast scanner
//! (see [`crate::lakehouse::line`]) does not take, straight into typed
//! cells (no `Value` tree), keeping an absent column apart from a null one.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::lakehouse::line::{FastLine, Row, Shapes, key_text};
use crate::lakehouse::typing::parse::{
    int_cell, not_valid, parse_cell, parse_decimal, parse_str_cell,
};
use crate::lakehouse::typing::{Cell, Kind, TableShape};

/// The general parser's single pass over `line`; `None` when `data` came
/// before `table`.
pub(super) fn parse_line<'s>(
    shapes: &'s Shapes,
    line: &str,
) -> Result<Option<FastLine<'s>>, String> {
    let mut de = sonic_rs::Deserializer::from_str(line);
    LineSeed { shapes }
        .deserialize(&mut de)
        .and_then(|p| de.end().map(|()| p))
        // Its first line: the next ones quote the line around the place.
        .map_err(|e| e.to_string().lines().next().unwrap_or_default().to_string())
}

struct LineSeed<'s> {
    shapes: &'s Shapes,
}

impl<'de, 's> DeserializeSeed<'de> for LineSeed<'s> {
    /// `None`: `data` came before `table`.
    type Value = Option<FastLine<'s>>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, 's> Visitor<'de> for LineSeed<'s> {
    type Value = Option<FastLine<'s>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a change envelope")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut line = FastLine {
            op: None,
            table: false,
            shape: None,
            data: None,
            old: None,
            seq: None,
            lsn: None,
            spare: Vec::new(),
        };
        let mut out_of_order = false;
        while let Some(Text(field)) = map.next_key()? {
            match &*field {
                "op" => line.op = Some(map.next_value::<Text>()?.0.as_ref().into()),
                "table" => {
                    let Text(table) = map.next_value()?;
                    line.shape = self.shapes.get(&table).map(|(i, s)| (i, &**s));
                    line.table = true;
                }
                "data" => match (line.table, &line.shape) {
                    (false, _) => {
                        out_of_order = true;
                        map.next_value::<IgnoredAny>()?;
                    }
                    (true, None) => {
                        map.next_value::<IgnoredAny>()?;
                    }
                    (true, Some((_, shape))) => {
                        line.data = map.next_value_seed(RowSeed { shape })?;
                    }
                },
                "old" => line.old = map.next_value()?,
                "seq" => line.seq = Some(map.next_value()?),
                "commit_lsn" => {
                    line.lsn = Some(map.next_value::<Text>()?.0.as_ref().into());
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok((!out_of_order).then_some(line))
    }
}

/// A string of the line, borrowed from it unless it has escapes. Serde's
/// own `Cow<str>` always copies (it borrows only for a `#[serde(borrow)]`
/// field): a dozen allocations per line for the field and column names.
struct Text<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TextVisitor;

        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text<'de>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_string())))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }

        d.deserialize_str(TextVisitor)
    }
}

struct RowSeed<'s> {
    shape: &'s TableShape,
}

impl<'de> DeserializeSeed<'de> for RowSeed<'_> {
    type Value = Option<Result<Row, String>>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for RowSeed<'_> {
    type Value = Option<Result<Row, String>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a row object or null")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let shape = self.shape;
        let mut cells = vec![Cell::Absent; shape.columns.len()];
        let mut keys = Vec::with_capacity(shape.key.len());
        let mut error = None;
        // `waltail run` writes a row's columns in the shape's order: the
        // next one is tried before the columns are searched.
        let mut next = 0;
        while let Some(Text(name)) = map.next_key()? {
            let found = match shape.columns.get(next) {
                Some(c) if c.name == name => Some(next),
                _ => shape.column(&name),
            };
            let Some(i) = found else {
                map.next_value::<IgnoredAny>()?;
                error.get_or_insert_with(|| {
                    format!("column {name:?} is in no schema record of {}", shape.table)
                });
                continue;
            };
            next = i + 1;
            let kind = shape.columns[i].kind;
            let is_key = shape.key.contains(&i);
            let cell = if is_key || kind == Kind::Json {
                let v: Value = map.next_value()?;
                let cell = parse_cell(kind, &v);
                if is_key {
                    keys.retain(|(k, _)| *k != i);
                    keys.push((i, v));
                }
                cell
            } else {
                map.next_value_seed(CellSeed { kind })?
            };
            match cell {
                Ok(c) => cells[i] = c,
                Err(e) => {
                    error.get_or_insert_with(|| format!("column {name:?}: {e}"));
                }
            }
        }
        Ok(Some(match error {
            Some(e) => Err(e),
            None => Ok(Row {
                cells,
                key: key_text(shape, |i| {
                    keys.iter().find(|(k, _)| *k == i).map(|(_, v)| v)
                }),
            }),
        }))
    }
}

/// One value of `data` parsed into a cell of `kind` as [`parse_cell`]
/// would parse its `Value`, without building one for numbers and strings.
struct CellSeed {
    kind: Kind,
}

impl<'de> DeserializeSeed<'de> for CellSeed {
    type Value = Result<Cell, String>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CellSeed {
    type Value = Result<Cell, String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Ok(Cell::Null))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(parse_cell(self.kind, &Value::Bool(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(match self.kind {
            kind @ (Kind::Int16 | Kind::Int32 | Kind::Int64) => {
                int_cell(kind, v).ok_or_else(|| not_valid(kind, v))
            }
            Kind::Decimal { precision, scale } => {
                parse_decimal(itoa::Buffer::new().format(v), precision, scale)
                    .map(Cell::Dec)
                    .ok_or_else(|| not_valid(self.kind, v))
            }
            kind => parse_cell(kind, &Value::from(v)),
        })
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(match self.kind {
            kind @ (Kind::Int16 | Kind::Int32 | Kind::Int64) => i64::try_from(v)
                .ok()
                .and_then(|v| int_cell(kind, v))
                .ok_or_else(|| not_valid(kind, v)),
            Kind::Decimal { precision, scale } => {
                parse_decimal(itoa::Buffer::new().format(v), precision, scale)
                    .map(Cell::Dec)
                    .ok_or_else(|| not_valid(self.kind, v))
            }
            kind => parse_cell(kind, &Value::from(v)),
        })
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(match self.kind {
            Kind::Float32 | Kind::Float64 => Ok(Cell::Float(v)),
            // serde_json formats a float with zmij, so this is the text
            // parse_cell would parse (and its error would show).
            Kind::Decimal { precision, scale } if v.is_finite() => {
                let mut text = zmij::Buffer::new();
                let text = text.format_finite(v);
                parse_decimal(text, precision, scale)
                    .map(Cell::Dec)
                    .ok_or_else(|| not_valid(self.kind, text))
            }
            kind => parse_cell(kind, &Value::from(v)),
        })
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(parse_str_cell(self.kind, v))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let v = Value::deserialize(de::value::MapAccessDeserializer::new(map))?;
        Ok(parse_cell(self.kind, &v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        let v = Value::deserialize(de::value::SeqAccessDeserializer::new(seq))?;
        Ok(parse_cell(self.kind, &v))
    }
}
