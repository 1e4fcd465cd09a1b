//! Commands on an open replication connection: simple queries
//! (`IDENTIFY_SYSTEM`, `SHOW`) and `START_REPLICATION`, which turns the
//! connection into its two streaming halves.

use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
// Re-exported by tokio-postgres; the backend parsers' iterators implement it.
use tokio_postgres::fallible_iterator::FallibleIterator;

use super::connect::ReplicationConnection;
use super::frame::{log_notice, unexpected};
use super::stream::{FeedbackSender, ReplicationStream};
use crate::error::ReplicationError;
use crate::lsn;
use crate::sql::{quote_ident, quote_literal};

/// Backend tag PostgreSQL uses for CopyBothResponse; postgres-protocol's parser
/// does not know it.
const COPY_BOTH_RESPONSE_TAG: u8 = b'W';

impl ReplicationConnection {
    /// Runs `sql` with the simple-query protocol and returns the rows of the
    /// last result set that had a row description (None for NULL). On a server
    /// error the connection is drained to ReadyForQuery first, so it stays
    /// usable.
    pub async fn simple_query(
        &mut self,
        sql: &str,
    ) -> Result<Vec<Vec<Option<String>>>, ReplicationError> {
        check_no_nul("query", sql)?;
        frontend::query(sql, &mut self.out)?;
        self.flush_out().await?;

        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let frame = self.reader.next_frame().await?;
            let tag = frame.tag;
            if tag == COPY_BOTH_RESPONSE_TAG {
                return Err(ReplicationError::Protocol(
                    "the server entered CopyBoth mode; use start_replication for START_REPLICATION"
                        .into(),
                ));
            }
            match frame.parse()? {
                Message::RowDescription(_) => rows = Vec::new(),
                Message::DataRow(body) => rows.push(decode_row(&body)?),
                Message::CommandComplete(_) | Message::EmptyQueryResponse => {}
                Message::ErrorResponse(body) => {
                    error = Some(ReplicationError::from_fields(body.fields()))
                }
                Message::NoticeResponse(body) => log_notice(body.fields()),
                Message::ParameterStatus(body) => self.store_parameter(&body),
                Message::ReadyForQuery(_) => {
                    return match error {
                        Some(e) => Err(e),
                        None => Ok(rows),
                    };
                }
                Message::CopyInResponse(_) | Message::CopyOutResponse(_) => {
                    return Err(ReplicationError::Protocol(
                        "COPY is not supported by simple_query".into(),
                    ));
                }
                _ => return Err(unexpected("simple query", tag)),
            }
        }
    }

    /// Starts logical streaming from `slot` at `start_lsn` and splits the
    /// connection into its receiving and feedback halves. A server error
    /// (missing slot 42704, slot in use 55006, ...) is returned as
    /// [`ReplicationError::Server`] and the connection is dropped.
    pub async fn start_replication(
        mut self,
        slot: &str,
        start_lsn: u64,
        options: &[(&str, &str)],
    ) -> Result<(ReplicationStream, FeedbackSender), ReplicationError> {
        let sql = start_replication_sql(slot, start_lsn, options)?;
        tracing::debug!(%sql, "starting replication");
        frontend::query(&sql, &mut self.out)?;
        self.flush_out().await?;

        loop {
            let frame = self.reader.next_frame().await?;
            let tag = frame.tag;
            if tag == COPY_BOTH_RESPONSE_TAG {
                // Body: overall format (i8), column count (i16), formats (i16 each).
                // Nothing in it matters for logical replication; check its shape.
                if frame.body().len() < 3 {
                    return Err(ReplicationError::Protocol(
                        "truncated CopyBothResponse".into(),
                    ));
                }
                break;
            }
            match frame.parse()? {
                Message::ErrorResponse(body) => {
                    return Err(ReplicationError::from_fields(body.fields()));
                }
                Message::NoticeResponse(body) => log_notice(body.fields()),
                Message::ParameterStatus(body) => self.store_parameter(&body),
                _ => return Err(unexpected("START_REPLICATION", tag)),
            }
        }

        let stream = ReplicationStream {
            reader: self.reader,
            ended: false,
        };
        let sender = FeedbackSender {
            writer: self.writer,
            out: self.out,
        };
        Ok((stream, sender))
    }
}

fn decode_row(
    body: &postgres_protocol::message::backend::DataRowBody,
) -> Result<Vec<Option<String>>, ReplicationError> {
    let buf = body.buffer();
    let mut ranges = body.ranges();
    let mut row = Vec::new();
    loop {
        let range = ranges
            .next()
            .map_err(|e| ReplicationError::Protocol(format!("bad DataRow: {e}")))?;
        match range {
            None => return Ok(row),
            Some(None) => row.push(None),
            Some(Some(r)) => {
                let text = std::str::from_utf8(&buf[r])
                    .map_err(|e| ReplicationError::Protocol(format!("non-UTF-8 column: {e}")))?;
                row.push(Some(text.to_owned()));
            }
        }
    }
}

fn check_no_nul(what: &str, s: &str) -> Result<(), ReplicationError> {
    // The protocol uses C strings; a NUL would silently truncate the command.
    if s.contains('\0') {
        return Err(ReplicationError::Unsupported(format!(
            "{what} contains a NUL byte"
        )));
    }
    Ok(())
}

fn start_replication_sql(
    slot: &str,
    start_lsn: u64,
    options: &[(&str, &str)],
) -> Result<String, ReplicationError> {
    check_no_nul("slot name", slot)?;
    let mut sql = format!(
        "START_REPLICATION SLOT {} LOGICAL {}",
        quote_ident(slot),
        lsn::display(start_lsn)
    );
    if !options.is_empty() {
        let mut parts = Vec::with_capacity(options.len());
        for (name, value) in options {
            check_no_nul("option name", name)?;
            check_no_nul("option value", value)?;
            // Quoted so no option name can break out of the list; pgoutput's
            // option names are all lower case, which quoting preserves.
            parts.push(format!("{} {}", quote_ident(name), quote_literal(value)));
        }
        sql.push_str(" (");
        sql.push_str(&parts.join(", "));
        sql.push(')');
    }
    Ok(sql)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_quoting() {
        let sql = start_replication_sql(
            "my\"slot",
            0x16_B374_D848,
            &[("proto_version", "1"), ("publication_names", "\"a\",'b'")],
        )
        .unwrap();
        assert_eq!(
            sql,
            "START_REPLICATION SLOT \"my\"\"slot\" LOGICAL 16/B374D848 (\"proto_version\" '1', \"publication_names\" '\"a\",''b''')"
        );
        assert_eq!(
            start_replication_sql("s", 0, &[]).unwrap(),
            "START_REPLICATION SLOT \"s\" LOGICAL 0/0"
        );
        assert!(matches!(
            start_replication_sql("s\0", 0, &[]),
            Err(ReplicationError::Unsupported(_))
        ));
    }
}
