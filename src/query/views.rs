//! How a query reads text: as string views (`Utf8View`), in every table it
//! builds, compacted or not.
//!
//! DataFusion decodes Parquet text straight into views: a short value (an
//! op, a key, a status) sits inline in its 16-byte view instead of being
//! copied into a buffer, and grouping, sorting and comparing start on that
//! inline prefix. The files hold plain Parquet strings either way;
//! compaction builds them as `Utf8` ([`crate::lakehouse::layout`]). The
//! NDJSON tail and the merged overlay are built as `Utf8` and cast, so a
//! table's types do not depend on how much of it is compacted.

use std::sync::Arc;

use arrow::datatypes::{DataType, Schema, SchemaRef};

use crate::lakehouse::typing::TableShape;

/// `schema` with its `Utf8` columns as `Utf8View`.
pub(crate) fn with_views(schema: &Schema) -> SchemaRef {
    Arc::new(Schema::new(
        schema
            .fields()
            .iter()
            .map(|f| match f.data_type() {
                DataType::Utf8 => f.as_ref().clone().with_data_type(DataType::Utf8View),
                _ => f.as_ref().clone(),
            })
            .collect::<Vec<_>>(),
    ))
}

/// A table's data columns as a query reads them.
pub(crate) fn data_schema(shape: &TableShape) -> SchemaRef {
    with_views(&Schema::new(shape.data_fields().collect::<Vec<_>>()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lakehouse::layout::history_schema;

    #[test]
    fn text_is_read_as_views_and_nothing_else_changes() {
        let shape = TableShape::test_t();
        let stored = history_schema(&shape);
        let read = with_views(&stored);
        assert_eq!(read.fields().len(), stored.fields().len());
        for (s, r) in stored.fields().iter().zip(read.fields()) {
            assert_eq!(s.name(), r.name());
            assert_eq!(s.is_nullable(), r.is_nullable());
            let want = match s.data_type() {
                DataType::Utf8 => DataType::Utf8View,
                other => other.clone(),
            };
            assert_eq!(r.data_type(), &want, "{}", s.name());
        }
        assert!(
            read.fields()
                .iter()
                .any(|f| f.data_type() == &DataType::Utf8View)
        );
        let data = data_schema(&shape);
        assert_eq!(data.fields().len(), shape.columns.len());
        assert_eq!(data.fields()[..], read.fields()[..shape.columns.len()]);
    }
}
