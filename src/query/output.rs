//! Results on stdout: a table for people, CSV, a JSON array or NDJSON for
//! programs. CSV and the JSON forms stream batch by batch; the table needs
//! every row first to size its columns.
//!
//! A reader that goes away (`waltail query ... | head -1`) is not an error:
//! [`write()`] reports it as [`Written::Closed`] and the command exits 0.

use std::io::Write;

use arrow::array::RecordBatch;
use arrow::error::ArrowError;
use datafusion::execution::SendableRecordBatchStream;
use futures::StreamExt;

use crate::{Error, Result};

/// How results are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns with a border (the default on a terminal)
    Table,
    /// A header line, then one line per row (the default otherwise)
    Csv,
    /// One JSON array of objects
    Json,
    /// One JSON object per line
    Ndjson,
}

/// Whether stdout took everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    All,
    /// The reader closed the pipe: stop quietly.
    Closed,
}

/// Writes a result stream to `out` in `format`; returns the rows written.
pub(crate) async fn write(
    out: &mut dyn Write,
    format: Format,
    mut stream: SendableRecordBatchStream,
    df_error: impl Fn(datafusion::error::DataFusionError) -> Error,
) -> Result<(Written, usize)> {
    let schema = stream.schema();
    let mut rows = 0;
    let result: std::result::Result<(), ArrowError> = async {
        if schema.fields().is_empty() {
            // A statement without a result (SET, CREATE VIEW): nothing to
            // print in any format (CSV would write an empty header `""`).
            while let Some(b) = stream.next().await {
                b.map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
            }
            return Ok(());
        }
        match format {
            Format::Table => {
                let mut batches: Vec<RecordBatch> = Vec::new();
                while let Some(b) = stream.next().await {
                    let b = b.map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
                    rows += b.num_rows();
                    batches.push(b);
                }
                let table = arrow::util::pretty::pretty_format_batches_with_schema(
                    schema.clone(),
                    &batches,
                )?;
                writeln!(out, "{table}")?;
                writeln!(out, "({rows} row{})", if rows == 1 { "" } else { "s" })?;
            }
            Format::Csv => {
                let mut w = arrow_csv::WriterBuilder::new()
                    .with_header(true)
                    .build(&mut *out);
                let mut any = false;
                while let Some(b) = stream.next().await {
                    let b = b.map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
                    rows += b.num_rows();
                    w.write(&b)?;
                    any = true;
                }
                if !any {
                    // The header alone.
                    w.write(&RecordBatch::new_empty(schema.clone()))?;
                }
            }
            Format::Json => {
                let mut w = arrow_json::WriterBuilder::new()
                    .with_explicit_nulls(true)
                    .build::<_, arrow_json::writer::JsonArray>(&mut *out);
                while let Some(b) = stream.next().await {
                    let b = b.map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
                    rows += b.num_rows();
                    w.write(&b)?;
                }
                w.finish()?;
                writeln!(out)?;
            }
            Format::Ndjson => {
                let mut w = arrow_json::WriterBuilder::new()
                    .with_explicit_nulls(true)
                    .build::<_, arrow_json::writer::LineDelimited>(&mut *out);
                while let Some(b) = stream.next().await {
                    let b = b.map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
                    rows += b.num_rows();
                    w.write(&b)?;
                }
                w.finish()?;
            }
        }
        out.flush()?;
        Ok(())
    }
    .await;
    match result {
        Ok(()) => Ok((Written::All, rows)),
        Err(e) if broken_pipe(&e) => Ok((Written::Closed, rows)),
        Err(ArrowError::ExternalError(e)) => {
            match e.downcast::<datafusion::error::DataFusionError>() {
                Ok(e) => Err(df_error(*e)),
                Err(e) => Err(Error::fatal(
                    format!("cannot write the result: {e}"),
                    "check stdout",
                )),
            }
        }
        Err(e) => Err(Error::fatal(
            format!("cannot write the result: {e}"),
            "check where stdout goes (a full disk?)",
        )),
    }
}

/// Whether writing failed because the reader closed the pipe.
fn broken_pipe(e: &ArrowError) -> bool {
    match e {
        ArrowError::IoError(_, io) => io.kind() == std::io::ErrorKind::BrokenPipe,
        ArrowError::CsvError(text) | ArrowError::JsonError(text) => {
            text.contains("Broken pipe") || text.contains("os error 32")
        }
        ArrowError::ExternalError(inner) => inner
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::physical_plan::stream::RecordBatchStreamAdapter;

    use super::*;

    fn stream() -> SendableRecordBatchStream {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(vec![1, 2])),
                Arc::new(StringArray::from(vec![Some("a,b"), None])),
            ],
        )
        .unwrap();
        Box::pin(RecordBatchStreamAdapter::new(
            schema,
            futures::stream::iter([Ok(batch)]),
        ))
    }

    async fn render(format: Format) -> String {
        let mut out = Vec::new();
        let (w, rows) = write(&mut out, format, stream(), |e| {
            Error::fatal(e.to_string(), "")
        })
        .await
        .unwrap();
        assert_eq!((w, rows), (Written::All, 2));
        String::from_utf8(out).unwrap()
    }

    #[tokio::test]
    async fn every_format_renders_the_rows() {
        assert_eq!(render(Format::Csv).await, "id,name\n1,\"a,b\"\n2,\n");
        assert_eq!(
            render(Format::Json).await,
            "[{\"id\":1,\"name\":\"a,b\"},{\"id\":2,\"name\":null}]\n"
        );
        assert_eq!(
            render(Format::Ndjson).await,
            "{\"id\":1,\"name\":\"a,b\"}\n{\"id\":2,\"name\":null}\n"
        );
        let table = render(Format::Table).await;
        assert!(table.contains("| 1  | a,b  |"), "{table}");
        assert!(table.ends_with("(2 rows)\n"), "{table}");
    }

    #[tokio::test]
    async fn no_rows_is_an_empty_array_or_a_header() {
        let empty = |format| async move {
            let schema = stream().schema();
            let none: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
                schema,
                futures::stream::iter(Vec::new()),
            ));
            let mut out = Vec::new();
            write(&mut out, format, none, |e| Error::fatal(e.to_string(), ""))
                .await
                .unwrap();
            String::from_utf8(out).unwrap()
        };
        assert_eq!(empty(Format::Json).await, "[]\n");
        assert_eq!(empty(Format::Csv).await, "id,name\n");
        assert_eq!(empty(Format::Ndjson).await, "");
    }

    #[tokio::test]
    async fn a_statement_without_columns_prints_nothing() {
        for format in [Format::Table, Format::Csv, Format::Json, Format::Ndjson] {
            let schema = Arc::new(Schema::empty());
            let batch = RecordBatch::new_empty(Arc::clone(&schema));
            let set: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
                schema,
                futures::stream::iter([Ok(batch)]),
            ));
            let mut out = Vec::new();
            let (w, rows) = write(&mut out, format, set, |e| Error::fatal(e.to_string(), ""))
                .await
                .unwrap();
            assert_eq!(
                (w, rows, out.as_slice()),
                (Written::All, 0, &b""[..]),
                "{format:?}"
            );
        }
    }

    /// A writer whose reader has gone.
    struct Closed;
    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
    }

    #[tokio::test]
    async fn a_closed_pipe_is_reported_not_an_error() {
        for format in [Format::Table, Format::Csv, Format::Json, Format::Ndjson] {
            let (w, _) = write(&mut Closed, format, stream(), |e| {
                Error::fatal(e.to_string(), "")
            })
            .await
            .unwrap();
            assert_eq!(w, Written::Closed, "{format:?}");
        }
    }
}
