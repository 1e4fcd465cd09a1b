//! [`Cell`]s to and from Arrow arrays of a column's [`Kind`]: the history
//! writer and the latest view build their columns here, and the latest
//! view's merge reads the previous generation's values back.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, BooleanBuilder, Date32Array, Date32Builder, Decimal128Array,
    Decimal128Builder, Float32Array, Float32Builder, Float64Array, Float64Builder, Int16Array,
    Int16Builder, Int32Array, Int32Builder, Int64Array, Int64Builder, StringArray, StringBuilder,
    TimestampMicrosecondArray, TimestampMicrosecondBuilder,
};

use super::{Cell, Kind};

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
    /// int2.
    Int16(Int16Builder),
    /// int4.
    Int32(Int32Builder),
    /// int8 and oid.
    Int64(Int64Builder),
    /// float4.
    Float32(Float32Builder),
    /// float8.
    Float64(Float64Builder),
    /// bool.
    Bool(BooleanBuilder),
    /// numeric, with its precision and scale.
    Decimal(Decimal128Builder, u8, i8),
    /// date.
    Date(Date32Builder),
    /// With the timezone (UTC) of a timestamptz.
    Timestamp(TimestampMicrosecondBuilder, bool),
    /// Text and JSON text.
    Text(StringBuilder),
}

impl ColumnBuilder {
    /// A builder for `capacity` cells of `kind`.
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

    use super::*;

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
