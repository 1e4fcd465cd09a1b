//! Schema records, `[prefix/]_schemas/<schema>.<table>/<n>.json` (see
//! [`super::key::schema_key`]): one type for the writer and the readers.
//!
//! The writer fingerprints a table's shape by the bytes of its
//! [`members`] (`"columns":[...],"replica_identity":"..."`), which the local
//! state also keeps for a backfill chunk; so those bytes must never change
//! for the same shape. serde_json writes fields in declaration order and
//! escapes strings exactly as the change lines do, and
//! `members_are_the_bytes_records_have_always_had` pins the form.

use serde::{Deserialize, Serialize};

use super::envelope::TableRef;

/// One schema record. (Serialized only where a reader keeps the records it
/// read, see `query::known`; the writer builds the record's bytes itself.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaRecord {
    /// `schema.table`, as the change lines name it.
    pub table: String,
    /// From 1, in the order the writer first saw each shape.
    pub version: u32,
    /// The table's columns in the order Postgres sends them in a row.
    pub columns: Vec<RecordColumn>,
    /// `default`, `full`, `index` or `nothing`.
    pub replica_identity: String,
}

/// A column as a schema record describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordColumn {
    /// The column's name, the key it has in a line's `data` and `old`.
    pub name: String,
    /// The type's name as Postgres formats it (`numeric(10,2)`), or
    /// `oid:<n>` when the catalog did not say.
    #[serde(rename = "type")]
    pub type_name: String,
    /// The type's OID in `pg_type`, what the relation message sends.
    pub type_oid: u32,
    /// The type modifier (`atttypmod`): length, precision and scale, or -1
    /// when the type has none.
    pub type_modifier: i32,
    /// Part of the replica identity (the primary key by default).
    pub key: bool,
}

/// What a record says of the table besides its name and version.
#[derive(Serialize)]
struct Shape<'a> {
    columns: &'a [RecordColumn],
    replica_identity: &'a str,
}

/// A shape's members, `"columns":[...],"replica_identity":"..."`: the
/// record's body without its name and version, the same bytes for the same
/// shape.
pub fn members(columns: &[RecordColumn], replica_identity: &str) -> String {
    let object = serde_json::to_string(&Shape {
        columns,
        replica_identity,
    })
    .expect("a shape serialises");
    // `{...}` without its braces.
    object[1..object.len() - 1].to_string()
}

/// The whole record object, version `version` of `table` with `members`
/// (from [`members`]), one line.
pub fn body(table: &TableRef, version: u32, members: &str) -> String {
    format!(
        "{{\"table\":{},\"version\":{version},{members}}}\n",
        table.json
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(name: &str, type_name: &str, key: bool) -> RecordColumn {
        RecordColumn {
            name: name.into(),
            type_name: type_name.into(),
            type_oid: 1700,
            type_modifier: 655366,
            key,
        }
    }

    /// The bytes the writer produced before this type existed, written out
    /// by hand: a change here would give every table a new schema version
    /// at the next start.
    #[test]
    fn members_are_the_bytes_records_have_always_had() {
        let columns = [
            column("id", "integer", true),
            column("quo\"te \\ tab\t ünï \u{1} \u{7f}", "numeric(10,2)", false),
        ];
        assert_eq!(
            members(&columns, "full"),
            "\"columns\":[{\"name\":\"id\",\"type\":\"integer\",\"type_oid\":1700,\
             \"type_modifier\":655366,\"key\":true},{\"name\":\"quo\\\"te \\\\ tab\\t ünï \
             \\u0001 \u{7f}\",\"type\":\"numeric(10,2)\",\"type_oid\":1700,\
             \"type_modifier\":655366,\"key\":false}],\"replica_identity\":\"full\""
        );
    }

    #[test]
    fn a_written_record_reads_back() {
        let columns = vec![column("id", "integer", true), column("note", "text", false)];
        let table = TableRef::new("public", "Mixed \"Case\"");
        let text = body(&table, 3, &members(&columns, "default"));
        assert!(text.ends_with("}\n"));
        let record: SchemaRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(
            record,
            SchemaRecord {
                table: "public.Mixed \"Case\"".into(),
                version: 3,
                columns,
                replica_identity: "default".into(),
            }
        );
    }
}
