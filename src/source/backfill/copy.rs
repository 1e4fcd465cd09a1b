//! A chunk read with `COPY (SELECT ...) TO STDOUT`, in text format.
//!
//! COPY streams the rows without a round trip per batch of rows (a cursor
//! needs a `FETCH` per batch) and without the per-row allocations of the
//! simple query protocol, and its text format is each type's output
//! function, exactly what pgoutput sends: the rows render byte for byte as
//! the stream renders the same row. The binary format would need a decoder
//! per type to give the same text again (numeric, intervals, arrays, ranges,
//! every extension type), so it is not used.

use bytes::Bytes;
use futures::StreamExt;
use tokio_postgres::Client;

use super::{ChunkRows, MAX_CHUNK_BYTES, TablePlan};
use crate::checkpoint::ChunkBody;
use crate::source::row::Value;
use crate::sql::quote_literal;
use crate::{Error, Result};

/// Reads up to `limit` rows with keys after `after` and up to `upto` (keys
/// as [`ChunkRows::last_key`] gives them; `None`: unbounded), in key order,
/// in one snapshot (the statement's), rendered as the stream renders them.
/// Stops at [`MAX_CHUNK_BYTES`] of rendered rows; the rows after that are
/// read by the next chunk.
pub(crate) async fn read_chunk(
    client: &Client,
    plan: &TablePlan,
    after: Option<&str>,
    upto: Option<&str>,
    limit: u64,
) -> Result<ChunkRows> {
    let table = &plan.table;
    let key_list = plan
        .key
        .iter()
        .map(|(name, _, _)| name.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let mut conditions = Vec::new();
    if let Some(after) = after {
        conditions.push(format!("({key_list}) > ({})", key_literals(plan, after)?));
    }
    if let Some(upto) = upto {
        conditions.push(format!("({key_list}) <= ({})", key_literals(plan, upto)?));
    }
    let filter = if conditions.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", conditions.join(" AND "))
    };
    let sql = format!(
        "COPY (SELECT {} FROM {}{filter} ORDER BY {key_list} LIMIT {limit}) TO STDOUT",
        plan.select_list,
        table.quoted()
    );
    let pg = |e| Error::postgres(format!("reading a backfill chunk of {table}"), e);
    let stream = client.copy_out(sql.as_str()).await.map_err(pg)?;
    futures::pin_mut!(stream);
    let mut rows = ChunkBody::with_capacity(body_capacity(limit, plan.row_bytes()));
    let mut fields = Fields::default();
    // The message holding the last row read, and where the row is in it
    // (its key is where the next chunk starts).
    let mut last: Option<(Bytes, std::ops::Range<usize>)> = None;
    // A row split over two messages (the server sends one row per message,
    // but the protocol does not promise it).
    let mut partial: Vec<u8> = Vec::new();
    let mut full = false;
    let unreadable = |why: String| {
        Error::fatal(
            format!("a row of {table} from COPY could not be read: {why}"),
            "report this with the table's definition",
        )
    };
    'read: while let Some(data) = stream.next().await {
        let mut data = data.map_err(pg)?;
        if !partial.is_empty() {
            partial.extend_from_slice(&data);
            data = Bytes::from(std::mem::take(&mut partial));
        }
        let mut start = 0;
        let mut last_here = None;
        while let Some(end) = memchr::memchr(b'\n', &data[start..]).map(|i| start + i) {
            let line = &data[start..end];
            fields.split(line).map_err(unreadable)?;
            rows.push_with(|out| plan.shape.render_into(fields.values(line), out));
            last_here = Some(start..end);
            start = end + 1;
            if rows.data_bytes() >= MAX_CHUNK_BYTES {
                // More rows may follow: the next chunk starts after this one.
                full = true;
                last = last_here.map(|at| (data, at));
                break 'read;
            }
        }
        partial.extend_from_slice(&data[start..]);
        if let Some(at) = last_here {
            last = Some((data, at));
        }
    }
    if !full && !partial.is_empty() {
        return Err(Error::fatal(
            format!("COPY of {table} ended inside a row"),
            "report this with the server version",
        ));
    }
    let last_key = match &last {
        Some((data, at)) => {
            let line = &data[at.clone()];
            fields.split(line).map_err(unreadable)?;
            let key: Vec<String> = plan
                .key
                .iter()
                .map(|(_, _, place)| match fields.values(line).nth(*place) {
                    Some(Value::Text(v)) => String::from_utf8_lossy(v).into_owned(),
                    _ => String::new(),
                })
                .collect();
            Some(serde_json::to_string(&key).expect("strings serialise"))
        }
        None => None,
    };
    let is_last = !full && (rows.len() as u64) < limit;
    plan.note_rows(&rows);
    Ok(ChunkRows {
        rows,
        last_key,
        is_last,
    })
}

/// The room to start a chunk's rows with: `limit` rows of `row_bytes`
/// (the last chunk's) with an eighth to spare, no more than the most a
/// chunk holds; a quarter-megabyte before any chunk was read.
fn body_capacity(limit: u64, row_bytes: usize) -> usize {
    const MOST: usize = MAX_CHUNK_BYTES + MAX_CHUNK_BYTES / 8;
    match row_bytes {
        0 => 256 << 10,
        row => {
            (row + ChunkBody::ROW_HEAD)
                .saturating_mul(usize::try_from(limit).unwrap_or(usize::MAX))
                .saturating_mul(9)
                / 8
        }
    }
    .min(MOST)
}

/// A recorded key (a JSON array of text values) as SQL literals cast to
/// the key's types.
fn key_literals(plan: &TablePlan, key: &str) -> Result<String> {
    let table = &plan.table;
    let values: Vec<String> = serde_json::from_str(key).map_err(|e| {
        Error::fatal(
            format!("the recorded backfill position of {table} is unreadable: {e}"),
            "cancel this backfill (`waltail backfill --cancel`) and start it again",
        )
    })?;
    if values.len() != plan.key.len() {
        return Err(Error::fatal(
            format!("the key of {table} changed since its backfill started"),
            "cancel this backfill (`waltail backfill --cancel`) and start it again",
        ));
    }
    Ok(plan
        .key
        .iter()
        .zip(&values)
        .map(|((_, type_name, _), v)| format!("{}::{type_name}", quote_literal(v)))
        .collect::<Vec<_>>()
        .join(", "))
}

/// One row of COPY's text format (without its newline) split into its
/// values: separated by tabs, `\N` for NULL, backslash escapes undone.
/// Kept from row to row, so splitting a row allocates nothing.
#[derive(Default)]
pub(crate) struct Fields {
    spans: Vec<Span>,
    /// The values that had escapes, undone.
    unescaped: Vec<u8>,
}

/// Where a value is: in the line, or undone into [`Fields::unescaped`].
#[derive(Clone, Copy)]
enum Span {
    Null,
    Line(usize, usize),
    Unescaped(usize, usize),
}

impl Fields {
    /// Splits `line`; its values are then [`Fields::values`].
    pub(crate) fn split(&mut self, line: &[u8]) -> std::result::Result<(), String> {
        self.spans.clear();
        self.unescaped.clear();
        let mut start = 0;
        loop {
            let end = memchr::memchr(b'\t', &line[start..]).map_or(line.len(), |i| start + i);
            let field = &line[start..end];
            self.spans.push(if field == b"\\N" {
                Span::Null
            } else if memchr::memchr(b'\\', field).is_none() {
                Span::Line(start, end)
            } else {
                let from = self.unescaped.len();
                unescape(field, &mut self.unescaped)?;
                Span::Unescaped(from, self.unescaped.len())
            });
            if end == line.len() {
                return Ok(());
            }
            start = end + 1;
        }
    }

    /// The values of the `line` last split, in column order: slices of
    /// the line where it had no escape.
    pub(crate) fn values<'a>(
        &'a self,
        line: &'a [u8],
    ) -> impl Iterator<Item = Value<'a>> + Clone + 'a {
        self.spans.iter().map(move |span| match *span {
            Span::Null => Value::Null,
            Span::Line(start, end) => Value::Text(&line[start..end]),
            Span::Unescaped(start, end) => Value::Text(&self.unescaped[start..end]),
        })
    }
}

/// Undoes COPY's text escapes: `\b \f \n \r \t \v`, `\\`, octal `\ooo`,
/// hex `\xhh`, and a backslash before any other character stands for it.
fn unescape(field: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), String> {
    let mut i = 0;
    while i < field.len() {
        let c = field[i];
        i += 1;
        if c != b'\\' {
            out.push(c);
            continue;
        }
        let Some(&e) = field.get(i) else {
            return Err("a value ends in a lone backslash".into());
        };
        i += 1;
        match e {
            b'b' => out.push(0x08),
            b'f' => out.push(0x0c),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'v' => out.push(0x0b),
            b'0'..=b'7' => {
                let mut v = u32::from(e - b'0');
                for _ in 0..2 {
                    match field.get(i) {
                        Some(&d @ b'0'..=b'7') => {
                            v = v * 8 + u32::from(d - b'0');
                            i += 1;
                        }
                        _ => break,
                    }
                }
                out.push(v as u8);
            }
            b'x' if field.get(i).is_some_and(u8::is_ascii_hexdigit) => {
                let mut v = 0u32;
                for _ in 0..2 {
                    match field.get(i).and_then(|d| (*d as char).to_digit(16)) {
                        Some(d) => {
                            v = v * 16 + d;
                            i += 1;
                        }
                        None => break,
                    }
                }
                out.push(v as u8);
            }
            other => out.push(other),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(line: &str) -> Vec<Option<String>> {
        let mut fields = Fields::default();
        fields.split(line.as_bytes()).unwrap();
        fields
            .values(line.as_bytes())
            .map(|v| match v {
                Value::Text(b) => Some(String::from_utf8(b.to_vec()).unwrap()),
                Value::Null => None,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn fields_split_at_tabs_with_nulls_and_empty_strings() {
        assert_eq!(
            values("1\t\\N\t\tx y"),
            vec![Some("1".into()), None, Some("".into()), Some("x y".into())]
        );
        assert_eq!(values(""), vec![Some("".into())]);
        assert_eq!(values("\\N"), vec![None]);
    }

    #[test]
    fn escapes_are_undone() {
        assert_eq!(
            values("a\\tb\\nc\\\\d\\re\\bf\\fg\\vh"),
            vec![Some("a\tb\nc\\d\re\u{8}f\u{c}g\u{b}h".into())]
        );
        // A literal `\N` inside a value is escaped, so it is text.
        assert_eq!(values("\\\\N"), vec![Some("\\N".into())]);
        assert_eq!(values("\\101\\x42\\q"), vec![Some("ABq".into())]);
        // Two escaped values and a plain one between them.
        assert_eq!(
            values("\\x41\tb\t\\x43"),
            vec![Some("A".into()), Some("b".into()), Some("C".into())]
        );
        assert!(Fields::default().split(b"x\\").is_err());
    }

    #[test]
    fn unescaped_values_are_slices_of_the_line() {
        let line = b"abc\tdef";
        let mut fields = Fields::default();
        fields.split(line).unwrap();
        let Some(Value::Text(v)) = fields.values(line).nth(1) else {
            panic!()
        };
        assert_eq!(v.as_ptr(), line[4..].as_ptr());
    }
}
