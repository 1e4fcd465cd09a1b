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
use crate::source::pgoutput::{ColumnValue, TupleData};
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
    let mut rows = Vec::new();
    let mut bytes = 0usize;
    let mut values = Vec::new();
    let mut last = TupleData(Vec::new());
    // A row split over two messages (the server sends one row per message,
    // but the protocol does not promise it).
    let mut partial: Vec<u8> = Vec::new();
    let mut full = false;
    'read: while let Some(data) = stream.next().await {
        let mut data = data.map_err(pg)?;
        if !partial.is_empty() {
            partial.extend_from_slice(&data);
            data = Bytes::from(std::mem::take(&mut partial));
        }
        let mut start = 0;
        while let Some(end) = memchr::memchr(b'\n', &data[start..]).map(|i| start + i) {
            let line = data.slice(start..end);
            start = end + 1;
            values.clear();
            row_values(&line, &mut values).map_err(|why| {
                Error::fatal(
                    format!("a row of {table} from COPY could not be read: {why}"),
                    "report this with the table's definition",
                )
            })?;
            let tuple = TupleData(std::mem::take(&mut values));
            let (json, hash) = plan.shape.render_tuple(&tuple);
            bytes += json.len();
            rows.push((hash, json));
            values = std::mem::replace(&mut last, tuple).0;
            if bytes >= MAX_CHUNK_BYTES {
                // More rows may follow: the next chunk starts after this one.
                full = true;
                break 'read;
            }
        }
        partial.extend_from_slice(&data[start..]);
    }
    if !full && !partial.is_empty() {
        return Err(Error::fatal(
            format!("COPY of {table} ended inside a row"),
            "report this with the server version",
        ));
    }
    let last_key = (!rows.is_empty()).then(|| {
        let key: Vec<String> = plan
            .key
            .iter()
            .map(|(_, _, place)| match last.0.get(*place) {
                Some(ColumnValue::Text(v)) => String::from_utf8_lossy(v).into_owned(),
                _ => String::new(),
            })
            .collect();
        serde_json::to_string(&key).expect("strings serialise")
    });
    let is_last = !full && (rows.len() as u64) < limit;
    Ok(ChunkRows {
        rows,
        last_key,
        is_last,
    })
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

/// Splits one row of COPY's text format (without its newline) into its
/// values: separated by tabs, `\N` for NULL, backslash escapes undone.
/// Values without an escape are slices of `line`, not copies.
pub(crate) fn row_values(
    line: &Bytes,
    out: &mut Vec<ColumnValue>,
) -> std::result::Result<(), String> {
    let mut start = 0;
    loop {
        let end = memchr::memchr(b'\t', &line[start..]).map_or(line.len(), |i| start + i);
        let field = &line[start..end];
        out.push(if field == b"\\N" {
            ColumnValue::Null
        } else if memchr::memchr(b'\\', field).is_none() {
            ColumnValue::Text(line.slice(start..end))
        } else {
            ColumnValue::Text(Bytes::from(unescape(field)?))
        });
        if end == line.len() {
            return Ok(());
        }
        start = end + 1;
    }
}

/// Undoes COPY's text escapes: `\b \f \n \r \t \v`, `\\`, octal `\ooo`,
/// hex `\xhh`, and a backslash before any other character stands for it.
fn unescape(field: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(field.len());
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
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(line: &str) -> Vec<Option<String>> {
        let mut out = Vec::new();
        row_values(&Bytes::copy_from_slice(line.as_bytes()), &mut out).unwrap();
        out.into_iter()
            .map(|v| match v {
                ColumnValue::Text(b) => Some(String::from_utf8(b.to_vec()).unwrap()),
                ColumnValue::Null => None,
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
        let mut out = Vec::new();
        assert!(row_values(&Bytes::from_static(b"x\\"), &mut out).is_err());
    }

    #[test]
    fn unescaped_values_are_slices_of_the_line() {
        let line = Bytes::from_static(b"abc\tdef");
        let mut out = Vec::new();
        row_values(&line, &mut out).unwrap();
        let ColumnValue::Text(v) = &out[1] else {
            panic!()
        };
        assert_eq!(v.as_ptr(), line[4..].as_ptr());
    }
}
