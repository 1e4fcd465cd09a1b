//! How a watermark looks in the WAL, for the backfill that writes it and the
//! stream that recognises it: a logical message with [`MESSAGE_PREFIX`] from
//! PostgreSQL 14 on, a row of [`WATERMARK_TABLE`] before.

use crate::sql::quote_ident;

/// The prefix of waltail's logical messages (`pg_logical_emit_message`).
pub(crate) const MESSAGE_PREFIX: &str = "waltail";

/// The first server version whose pgoutput passes logical messages on;
/// older servers get their watermarks through [`WATERMARK_TABLE`].
pub(crate) const MESSAGES_VERSION: i64 = 140000;
/// The table whose rows are the watermarks on servers older than
/// [`MESSAGES_VERSION`] (schema, name): created by the first backfill,
/// shared by every pipeline of the database (a watermark names its
/// pipeline).
pub(crate) const WATERMARK_TABLE: (&str, &str) = ("public", "waltail_watermarks");

/// The watermark table's name, quoted for SQL.
pub(crate) fn watermark_table() -> String {
    format!(
        "{}.{}",
        quote_ident(WATERMARK_TABLE.0),
        quote_ident(WATERMARK_TABLE.1)
    )
}
