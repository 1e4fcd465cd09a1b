//! `source.tables` entries: schema-qualified table names, parsed and
//! checked as Postgres would take them, so a bad name is refused at load,
//! before any SQL runs.

use std::str::FromStr;

use crate::sql::quote_ident;

/// A schema-qualified table name as configured.
///
/// How `source.tables` entries are read:
/// - `schema.table`, split at the dot; `orders` alone means `public.orders`.
///   Names are taken exactly as written (case-sensitive, never folded to
///   lower case), with surrounding spaces trimmed.
/// - Either part may be written SQL-style in double quotes, with `""` for a
///   quote: `"My Schema"."My.Table"`, `public."quo""te"`. A name needs quotes
///   when it holds a dot or a double quote, or starts or ends with a space.
///   (In TOML, single-quoted strings avoid escaping: `'public."a.b"'`.)
/// - Each part is 1 to 63 bytes (Postgres's limit) without control
///   characters; anything else is refused at load, before any SQL runs.
/// - `WALTAIL_SOURCE_TABLES` is split at commas, so a name holding a comma
///   can only be listed in the file.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableName {
    /// The schema, as Postgres stores it (unquoted names folded to lower case).
    pub schema: String,
    /// The table, as Postgres stores it.
    pub name: String,
}

/// Postgres truncates identifiers to 63 bytes (NAMEDATALEN - 1).
pub(super) const MAX_IDENT_BYTES: usize = 63;

impl TableName {
    /// The name quoted for SQL: `"public"."orders"`.
    pub fn quoted(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }

    /// The name as it is written in `source.tables`: plain `schema.table`
    /// when that reads back the same, each part quoted where needed.
    pub fn config_form(&self) -> String {
        fn part(s: &str) -> String {
            if s.is_empty() || s.contains(['.', '"']) || s.trim() != s {
                quote_ident(s)
            } else {
                s.to_string()
            }
        }
        format!("{}.{}", part(&self.schema), part(&self.name))
    }
}

impl std::fmt::Display for TableName {
    /// `schema.table` unquoted, as the archive's `table` field spells it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// One part of a table entry: a quoted identifier (`""` for a quote) or plain
/// text up to the next dot. Returns the part and the text after it.
fn table_part(s: &str) -> Result<(String, &str), String> {
    let s = s.trim_start();
    if let Some(body) = s.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = body.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            if c == '"' {
                if chars.peek().map(|&(_, n)| n) == Some('"') {
                    chars.next();
                    out.push('"');
                } else {
                    return Ok((out, body[i + 1..].trim_start()));
                }
            } else {
                out.push(c);
            }
        }
        Err("a quoted name has no closing quote".into())
    } else {
        let end = s.find('.').unwrap_or(s.len());
        let part = s[..end].trim_end();
        if part.contains('"') {
            return Err(
                "a quote inside a plain name; quote the whole name, with \"\" for a quote".into(),
            );
        }
        Ok((part.to_string(), &s[end..]))
    }
}

fn check_part(what: &str, part: &str) -> Result<(), String> {
    if part.is_empty() {
        return Err(format!("the {what} name is empty"));
    }
    if part.len() > MAX_IDENT_BYTES {
        return Err(format!(
            "the {what} name is {} bytes; Postgres names are at most {MAX_IDENT_BYTES}",
            part.len()
        ));
    }
    if part.chars().any(char::is_control) {
        return Err(format!("the {what} name holds a control character"));
    }
    Ok(())
}

impl FromStr for TableName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parsed = (|| {
            let (first, rest) = table_part(s)?;
            let (schema, name) = if rest.is_empty() {
                ("public".to_string(), first)
            } else if let Some(rest) = rest.strip_prefix('.') {
                let (second, rest) = table_part(rest)?;
                if rest.starts_with('.') {
                    return Err(
                        "more than one dot; quote a name that holds a dot: \"schema\".\"my.table\""
                            .to_string(),
                    );
                }
                if !rest.is_empty() {
                    return Err("text after the closing quote".to_string());
                }
                (first, second)
            } else {
                return Err("text after the closing quote".to_string());
            };
            check_part("schema", &schema)?;
            check_part("table", &name)?;
            Ok(TableName { schema, name })
        })();
        parsed.map_err(|why: String| {
            format!(
                "{s:?} is not a table name ({why}); write schema.table, e.g. \"public.orders\", \
                 and quote names holding dots or quotes SQL-style: \"My Schema\".\"My.Table\""
            )
        })
    }
}
