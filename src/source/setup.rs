//! Creates (or reuses) the pipeline's publication and replication slot.
//!
//! Names come from the configuration (default `waltail_<pipeline>`) and are
//! always quoted as identifiers. The publication is kept equal to the
//! configured table list, so adding a table to the config is enough.

use tokio_postgres::Client;

use crate::config::{SourceConfig, TableName};
use crate::error::ErrorKind;
use crate::source::watermark::WATERMARK_TABLE;
use crate::sql::quote_ident;
use crate::{Error, Result};

/// The first server version whose publications take a partitioned table
/// (`publish_via_partition_root`, so its partitions' changes carry its name).
pub(crate) const PARTITION_ROOT_VERSION: i64 = 130000;

/// What to do about a partitioned table on a server older than
/// [`PARTITION_ROOT_VERSION`].
pub(crate) const PARTITIONED_FIX: &str = "list its partitions in source.tables instead (their changes then carry the partitions' names), or upgrade to PostgreSQL 13 or later";

/// Why a partitioned table cannot be archived from `version`.
pub(crate) fn partitioned_refusal(table: &str, version: &str) -> String {
    format!(
        "{table} is a partitioned table, and PostgreSQL {version} cannot publish one (13 and later can)"
    )
}

/// Makes the publication exist and publish exactly the configured tables.
pub(crate) async fn ensure_publication(client: &Client, source: &SourceConfig) -> Result<()> {
    let (version, version_text): (i32, String) = client
        .query_one(
            "SELECT current_setting('server_version_num')::int, current_setting('server_version')",
            &[],
        )
        .await
        .map_err(|e| Error::postgres("reading the server version", e))
        .map(|r| (r.get(0), r.get(1)))?;
    for t in &source.tables {
        let kind = client
            .query_opt(
                "SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
                &[&t.schema, &t.name],
            )
            .await
            .map_err(|e| Error::postgres("looking up the configured tables", e))?;
        let Some(kind) = kind else {
            return Err(Error::fatal(
                format!("table {t} does not exist"),
                format!(
                    "create it, or remove {:?} from source.tables",
                    t.config_form()
                ),
            )
            .with_kind(ErrorKind::Source));
        };
        if kind.get::<_, String>(0) == "p" && i64::from(version) < PARTITION_ROOT_VERSION {
            return Err(Error::fatal(
                partitioned_refusal(&t.to_string(), &version_text),
                PARTITIONED_FIX,
            )
            .with_kind(ErrorKind::Source));
        }
    }
    let table_list = source
        .tables
        .iter()
        .map(TableName::quoted)
        .collect::<Vec<_>>()
        .join(", ");
    let pubname = quote_ident(&source.publication);
    let existing = client
        .query_opt(
            "SELECT puballtables FROM pg_publication WHERE pubname = $1",
            &[&source.publication],
        )
        .await
        .map_err(|e| Error::postgres("looking up the publication", e))?;
    match existing {
        None => {
            // Changes to partitions carry the partitioned table's name (13+).
            let with = if i64::from(version) >= PARTITION_ROOT_VERSION {
                " WITH (publish_via_partition_root = true)"
            } else {
                ""
            };
            client
                .batch_execute(&format!(
                    "CREATE PUBLICATION {pubname} FOR TABLE {table_list}{with}"
                ))
                .await
                .map_err(|e| Error::postgres(format!("creating publication {pubname}"), e))?;
            tracing::info!(publication = %source.publication, tables = %table_list, "created the publication");
        }
        Some(row) => {
            let all_tables: bool = row.get(0);
            if all_tables {
                tracing::info!(publication = %source.publication, "reusing a FOR ALL TABLES publication");
                return Ok(());
            }
            let rows = client
                .query(
                    "SELECT schemaname::text, tablename::text FROM pg_publication_tables WHERE pubname = $1",
                    &[&source.publication],
                )
                .await
                .map_err(|e| Error::postgres("reading the publication's tables", e))?;
            let mut have: Vec<TableName> = rows
                .iter()
                .map(|r| TableName {
                    schema: r.get(0),
                    name: r.get(1),
                })
                .collect();
            have.sort();
            let mut want = source.tables.clone();
            // A backfill's watermark table stays (see `watermark::WATERMARK_TABLE`).
            let watermarks = TableName {
                schema: WATERMARK_TABLE.0.to_string(),
                name: WATERMARK_TABLE.1.to_string(),
            };
            let mut set_list = table_list.clone();
            if have.contains(&watermarks) && !want.contains(&watermarks) {
                set_list = format!("{set_list}, {}", watermarks.quoted());
                want.push(watermarks);
            }
            want.sort();
            if have != want {
                client
                    .batch_execute(&format!("ALTER PUBLICATION {pubname} SET TABLE {set_list}"))
                    .await
                    .map_err(|e| Error::postgres(format!("updating publication {pubname}"), e))?;
                tracing::info!(publication = %source.publication, tables = %table_list, "updated the publication's tables");
            }
        }
    }
    Ok(())
}

/// Whether the pipeline's slot exists; an existing slot of another plugin
/// or database is an error, never silently reused.
pub(crate) async fn slot_exists(client: &Client, source: &SourceConfig) -> Result<bool> {
    let row = client
        .query_opt(
            "SELECT plugin::text, database::text, current_database()::text
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&source.slot],
        )
        .await
        .map_err(|e| Error::postgres("looking up the replication slot", e))?;
    let Some(row) = row else {
        return Ok(false);
    };
    let plugin: Option<String> = row.get(0);
    let database: Option<String> = row.get(1);
    let current: String = row.get(2);
    if plugin.as_deref() != Some("pgoutput") || database.as_deref() != Some(current.as_str()) {
        return Err(Error::fatal(
            format!(
                "replication slot {} exists but belongs to plugin {:?} in database {:?}, not pgoutput in {current:?}",
                source.slot,
                plugin.unwrap_or_default(),
                database.unwrap_or_default()
            ),
            "choose another name with source.slot, or drop that slot if it is unused: SELECT pg_drop_replication_slot('<slot>');",
        ));
    }
    Ok(true)
}

/// Creates the pipeline's logical slot (pgoutput, in this database).
pub(crate) async fn create_slot(client: &Client, source: &SourceConfig) -> Result<()> {
    client
        .query(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&source.slot],
        )
        .await
        .map_err(|e| Error::postgres(format!("creating replication slot {}", source.slot), e))?;
    tracing::info!(slot = %source.slot, "created the replication slot");
    Ok(())
}
