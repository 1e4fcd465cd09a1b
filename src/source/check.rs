//! Pre-flight checks of the source (`waltail check`): each finding says
//! what is wrong and the SQL or setting that fixes it. Nothing is created.

use tokio_postgres::Client;

use crate::config::SourceConfig;
use crate::error::ReplicationError;
use crate::pgtls::NEEDS_TLS_HINT;
use crate::source;
use crate::source::replication::ReplicationConnection;
use crate::source::setup::{PARTITION_ROOT_VERSION, PARTITIONED_FIX, partitioned_refusal};
use crate::source::watermark::{MESSAGES_VERSION, WATERMARK_TABLE, watermark_table};
use crate::sql::{quote_ident, quote_literal};

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Pass,
    /// Works, but something deserves attention.
    Warn,
    /// Works; a setting could make it better.
    Advice,
    Fail,
}

/// One check's result.
#[derive(Debug, Clone)]
pub(crate) struct Finding {
    pub status: Status,
    pub name: String,
    pub detail: String,
    pub fix: Option<String>,
}

impl Finding {
    fn pass(name: impl Into<String>, detail: impl Into<String>) -> Self {
        Finding {
            status: Status::Pass,
            name: name.into(),
            detail: detail.into(),
            fix: None,
        }
    }
    fn with(
        status: Status,
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Finding {
            status,
            name: name.into(),
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

/// Below this, a large transaction spills to disk while being decoded (measured:
/// 1 GB made a 1M-row transaction 1.4x faster than the 64 MB default).
const ADVISED_DECODING_WORK_MEM_KB: i64 = 256 * 1024;

/// Runs every source check. Stops early only when Postgres cannot be reached.
pub(crate) async fn run(source: &SourceConfig) -> Vec<Finding> {
    let mut out = Vec::new();
    let client = match source::connect_sql(source).await {
        Ok(c) => c,
        Err(e) => {
            out.push(Finding::with(
                Status::Fail,
                "connect",
                crate::error::Report(&e).to_string(),
                e.hint()
                    .unwrap_or_else(|| "check source.url and that Postgres is running".into()),
            ));
            return out;
        }
    };
    out.push(Finding::pass("connect", source::describe(source)));
    if let Err(e) = sql_checks(&client, source, &mut out).await {
        out.push(Finding::with(
            Status::Fail,
            "catalog queries",
            e.to_string(),
            "the role must be able to read pg_catalog; check the error above",
        ));
    }
    out.push(replication_check(source).await);
    out
}

async fn one(client: &Client, sql: &str) -> Result<String, tokio_postgres::Error> {
    let row = client.query_one(sql, &[]).await?;
    Ok(row.get::<_, Option<String>>(0).unwrap_or_default())
}

async fn sql_checks(
    client: &Client,
    source: &SourceConfig,
    out: &mut Vec<Finding>,
) -> Result<(), tokio_postgres::Error> {
    // Version.
    let version_num: i64 = one(client, "SHOW server_version_num")
        .await?
        .parse()
        .unwrap_or(0);
    let version = one(client, "SHOW server_version").await?;
    out.push(if version_num >= 120000 {
        Finding::pass("server version", format!("{version} (12 or newer)"))
    } else {
        Finding::with(
            Status::Fail,
            "server version",
            format!("{version} is older than 12"),
            "upgrade Postgres to version 12 or newer",
        )
    });

    // wal_level.
    let wal_level = one(client, "SHOW wal_level").await?;
    out.push(if wal_level == "logical" {
        Finding::pass("wal_level", "logical")
    } else {
        Finding::with(
            Status::Fail,
            "wal_level",
            format!("wal_level is {wal_level}, logical decoding needs logical"),
            "ALTER SYSTEM SET wal_level = logical; then restart Postgres (on RDS: set rds.logical_replication = 1 in the parameter group)",
        )
    });

    // Replication privilege.
    let row = client
        .query_one(
            "SELECT current_user::text, r.rolsuper, r.rolreplication,
                    EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rds_replication')
                      AND pg_has_role(current_user, 'rds_replication', 'MEMBER')
             FROM pg_roles r WHERE r.rolname = current_user",
            &[],
        )
        .await?;
    let user: String = row.get(0);
    let (superuser, replication, rds): (bool, bool, bool) = (row.get(1), row.get(2), row.get(3));
    out.push(if superuser || replication || rds {
        Finding::pass(
            "replication privilege",
            format!("role {user} may replicate"),
        )
    } else {
        Finding::with(
            Status::Fail,
            "replication privilege",
            format!("role {user} has neither REPLICATION nor rds_replication"),
            format!(
                "ALTER ROLE {} WITH REPLICATION;  (on RDS: GRANT rds_replication TO {};)",
                quote_ident(&user),
                quote_ident(&user)
            ),
        )
    });

    // Slot.
    let ours = client
        .query_opt(
            "SELECT plugin::text, database::text = current_database(), active_pid
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&source.slot],
        )
        .await?;
    let max_slots: i64 = one(client, "SHOW max_replication_slots")
        .await?
        .parse()
        .unwrap_or(0);
    let used: i64 = client
        .query_one("SELECT count(*) FROM pg_replication_slots", &[])
        .await?
        .get(0);
    out.push(match ours {
        Some(row) => {
            let plugin: Option<String> = row.get(0);
            let same_db: Option<bool> = row.get(1);
            let active: Option<i32> = row.get(2);
            if plugin.as_deref() != Some("pgoutput") || same_db != Some(true) {
                Finding::with(
                    Status::Fail,
                    "replication slot",
                    format!("slot {} exists but is not a pgoutput slot of this database", source.slot),
                    format!("set another source.slot, or drop it if unused: SELECT pg_drop_replication_slot({});", quote_literal(&source.slot)),
                )
            } else if let Some(pid) = active {
                Finding::with(
                    Status::Warn,
                    "replication slot",
                    format!("slot {} exists and is in use by process {pid}", source.slot),
                    "stop the other waltail run of this pipeline first: a slot serves one reader at a time",
                )
            } else {
                Finding::pass("replication slot", format!("slot {} exists and will be reused", source.slot))
            }
        }
        None if used < max_slots => Finding::pass(
            "replication slot",
            format!("slot {} will be created ({used} of max_replication_slots = {max_slots} in use)", source.slot),
        ),
        None => {
            let inactive: Vec<String> = client
                .query("SELECT slot_name::text FROM pg_replication_slots WHERE NOT active", &[])
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
            Finding::with(
                Status::Fail,
                "replication slot",
                format!("all {max_slots} replication slots are in use"),
                format!(
                    "raise max_replication_slots in postgresql.conf and restart, or drop an unused slot{}",
                    if inactive.is_empty() { String::new() } else { format!(" (inactive: {}): SELECT pg_drop_replication_slot('<name>');", inactive.join(", ")) }
                ),
            )
        }
    });

    // Tables and replica identity.
    for t in &source.tables {
        let row = client
            .query_opt(
                "SELECT c.relreplident::text,
                        EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
                        EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident),
                        has_table_privilege(c.oid, 'SELECT'),
                        c.relkind = 'p'
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
                &[&t.schema, &t.name],
            )
            .await?;
        let name = format!("table {t}");
        let Some(row) = row else {
            out.push(Finding::with(
                Status::Fail,
                name,
                "does not exist",
                format!("create the table, or remove \"{t}\" from source.tables"),
            ));
            continue;
        };
        let ident: String = row.get(0);
        let (has_pk, has_ident_index, can_select, partitioned): (bool, bool, bool, bool) =
            (row.get(1), row.get(2), row.get(3), row.get(4));
        let q = t.quoted();
        if partitioned && version_num < PARTITION_ROOT_VERSION {
            out.push(Finding::with(
                Status::Fail,
                name,
                partitioned_refusal(&t.to_string(), &version),
                PARTITIONED_FIX,
            ));
            continue;
        }
        out.push(match ident.as_str() {
            "d" if has_pk => Finding::pass(name, "primary key"),
            "i" if has_ident_index => Finding::pass(name, "replica identity index"),
            "f" => Finding::pass(name, "replica identity full"),
            "n" => Finding::with(
                Status::Warn,
                name,
                "REPLICA IDENTITY NOTHING: deletes and updates carry no old key, and Postgres rejects them while the table is published",
                format!("ALTER TABLE {q} REPLICA IDENTITY DEFAULT; (with a primary key) or ALTER TABLE {q} REPLICA IDENTITY FULL;"),
            ),
            _ => Finding::with(
                Status::Fail,
                name,
                "has no primary key or replica identity: updates and deletes could not be archived (Postgres rejects them once published)",
                format!("ALTER TABLE {q} ADD PRIMARY KEY (<columns>);  or  ALTER TABLE {q} REPLICA IDENTITY USING INDEX <unique index>;  or  ALTER TABLE {q} REPLICA IDENTITY FULL;"),
            ),
        });
        if !can_select {
            out.push(Finding::with(
                Status::Warn,
                format!("table {t}"),
                "the role may not SELECT it (needed for backfill)",
                format!("GRANT SELECT ON {q} TO {};", quote_ident(&user)),
            ));
        }
    }

    // Publication.
    let exists = client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&source.publication],
        )
        .await?
        .is_some();
    if exists {
        out.push(Finding::pass(
            "publication",
            format!("{} exists and will be reused", source.publication),
        ));
    } else {
        let can_create: bool = client
            .query_one(
                "SELECT has_database_privilege(current_database(), 'CREATE')",
                &[],
            )
            .await?
            .get(0);
        out.push(if can_create || superuser {
            Finding::pass("publication", format!("{} will be created", source.publication))
        } else {
            let db = one(client, "SELECT current_database()::text").await?;
            Finding::with(
                Status::Fail,
                "publication",
                format!("{} does not exist and role {user} may not create it", source.publication),
                format!(
                    "GRANT CREATE ON DATABASE {} TO {};  (the role must also own the tables), or create it yourself: CREATE PUBLICATION {} FOR TABLE ...;",
                    quote_ident(&db), quote_ident(&user), quote_ident(&source.publication)
                ),
            )
        });
    }

    // Backfill's watermarks before 14: rows of a table the first backfill
    // creates (see `watermark::WATERMARK_TABLE`).
    if version_num < MESSAGES_VERSION {
        let table = watermark_table();
        let name = "backfill watermarks";
        let exists: bool = client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
            .await?
            .get(0);
        let can_create: bool = client
            .query_one(
                "SELECT has_schema_privilege($1, 'CREATE')",
                &[&WATERMARK_TABLE.0],
            )
            .await?
            .get(0);
        out.push(if exists {
            Finding::pass(name, format!("{table} exists"))
        } else if can_create || superuser {
            Finding::pass(
                name,
                format!("{version} has no logical messages in pgoutput: the first backfill creates {table} and adds it to the publication"),
            )
        } else {
            Finding::with(
                Status::Warn,
                name,
                format!("{version} has no logical messages in pgoutput, so backfill needs the table {table}, which role {user} may not create (streaming does not need it)"),
                format!(
                    "GRANT CREATE ON SCHEMA {0} TO {1};  or create it yourself: CREATE TABLE {table} (id bigserial PRIMARY KEY, content text NOT NULL); ALTER TABLE {table} OWNER TO {1};",
                    quote_ident(WATERMARK_TABLE.0),
                    quote_ident(&user)
                ),
            )
        });
    }

    // Decoding memory (advice only; the setting came with 13).
    let work_mem = client
        .query_opt(
            "SELECT setting::bigint FROM pg_settings WHERE name = 'logical_decoding_work_mem'",
            &[],
        )
        .await?;
    let Some(work_mem) = work_mem else {
        out.push(Finding::pass(
            "logical_decoding_work_mem",
            format!("not in {version}: large transactions are decoded through the server's disk"),
        ));
        return Ok(());
    };
    let kb: i64 = work_mem.get(0);
    out.push(if kb >= ADVISED_DECODING_WORK_MEM_KB {
        Finding::pass("logical_decoding_work_mem", format!("{} MB", kb / 1024))
    } else {
        Finding::with(
            Status::Advice,
            "logical_decoding_work_mem",
            format!("{} MB: transactions larger than this spill to disk while being decoded", kb / 1024),
            "ALTER SYSTEM SET logical_decoding_work_mem = '1GB'; SELECT pg_reload_conf();  (faster for large transactions; see Tuning in docs/operations.md)",
        )
    });
    Ok(())
}

/// Opens a replication connection, as `run` will, and identifies the system.
async fn replication_check(source: &SourceConfig) -> Finding {
    let pg = source::pg_config(source);
    let result = async {
        let mut conn = ReplicationConnection::connect(&pg, "waltail-check").await?;
        conn.simple_query("IDENTIFY_SYSTEM").await
    }
    .await;
    match result {
        Ok(rows) => {
            let system = rows
                .first()
                .and_then(|r| r.first().cloned().flatten())
                .unwrap_or_default();
            Finding::pass(
                "replication connection",
                format!("system identifier {system}"),
            )
        }
        Err(ReplicationError::Tls(tls)) => Finding::with(
            Status::Fail,
            "replication connection",
            tls.message,
            tls.hint,
        ),
        Err(e) => {
            let fix = match &e {
                ReplicationError::Server { hint: Some(h), .. } if h == NEEDS_TLS_HINT => h.clone(),
                _ => "allow the role to connect for replication in pg_hba.conf (the line must match this database), and check max_wal_senders".into(),
            };
            Finding::with(Status::Fail, "replication connection", e.to_string(), fix)
        }
    }
}
