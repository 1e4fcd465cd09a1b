//! Quoting values into SQL text, for the statements waltail builds (setup,
//! checks, backfill, replication commands) and the ones it prints for the
//! operator to run.
//!
//! Quoting doubles the quote character and nothing else, which is exact for
//! Postgres with `standard_conforming_strings` on (the default since 9.1; a
//! backslash is then an ordinary character). Neither function refuses a NUL:
//! Postgres text cannot hold one and its protocol carries statements as C
//! strings, so a statement with a NUL is refused when it is sent (the
//! replication connection names the offending part, see
//! `source::replication`). A ground-floor module: it uses nothing else of the
//! crate.

/// Quotes an SQL identifier (doubling embedded double quotes), so any name is
/// safe in SQL and keeps its case: `my"slot` becomes `"my""slot"`.
pub(crate) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Quotes an SQL string literal (doubling embedded single quotes):
/// `it's` becomes `'it''s'`.
pub(crate) fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_double_their_double_quotes_only() {
        assert_eq!(quote_ident("orders"), "\"orders\"");
        assert_eq!(quote_ident("My Table"), "\"My Table\"");
        assert_eq!(quote_ident("my\"slot"), "\"my\"\"slot\"");
        assert_eq!(quote_ident("\"\""), "\"\"\"\"\"\"");
        assert_eq!(quote_ident("it's"), "\"it's\"");
        assert_eq!(quote_ident(""), "\"\"");
    }

    #[test]
    fn literals_double_their_single_quotes_only() {
        assert_eq!(quote_literal("1"), "'1'");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_literal("\"a\",'b'"), "'\"a\",''b'''");
        assert_eq!(quote_literal("a\\b"), "'a\\b'");
        assert_eq!(quote_literal(""), "''");
    }
}
