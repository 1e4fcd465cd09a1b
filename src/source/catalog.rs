//! Type lookups for the columns of replicated tables: the type's SQL name
//! (for the schema records) and how its values are rendered as JSON.
//!
//! Built-in types need no lookup. User-defined ones are resolved once per
//! (oid, typmod) through the catalog: a domain renders as its base type, an
//! enum as a string, an array of either as a JSON array, hstore as an object;
//! anything else as its text form. The catalog is the current one, not the
//! one at the time of the change: a type dropped since falls back to text.

use std::collections::HashMap;
use std::sync::Arc;

use tokio_postgres::Client;

use crate::source::types::{self, FIRST_NORMAL_OID, TEXT, TEXT_ARRAY};

/// How a column's values become JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Render {
    /// [`types::write_json`] with this (built-in) type OID.
    Builtin(u32),
    /// [`types::write_hstore`].
    Hstore,
}

impl Render {
    /// Appends the JSON form of a text-format value.
    pub fn write(self, out: &mut Vec<u8>, text: &[u8]) {
        match self {
            Render::Builtin(oid) => types::write_json(out, oid, text),
            Render::Hstore => types::write_hstore(out, text),
        }
    }
}

/// A column type as the archive describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnType {
    /// As `format_type` prints it, e.g. `numeric(10,2)`, `public.mood`.
    pub name: String,
    pub render: Render,
}

/// Resolves and caches column types.
pub struct TypeCatalog {
    client: Option<Client>,
    cache: HashMap<(u32, i32), Arc<ColumnType>>,
}

struct TypeRow {
    typtype: String,
    basetype: u32,
    elem: u32,
    name: String,
    category: String,
}

impl TypeCatalog {
    /// `client: None` resolves without the catalog (built-in rules only).
    pub fn new(client: Option<Client>) -> Self {
        TypeCatalog {
            client,
            cache: HashMap::new(),
        }
    }

    /// The catalog's SQL connection, for other lookups on the same session.
    pub fn client(&self) -> Option<&Client> {
        self.client.as_ref()
    }

    pub async fn resolve(&mut self, oid: u32, typmod: i32) -> Arc<ColumnType> {
        if let Some(t) = self.cache.get(&(oid, typmod)) {
            return t.clone();
        }
        let name = self.format_type(oid, typmod).await;
        let render = self.render(oid).await;
        let t = Arc::new(ColumnType { name, render });
        self.cache.insert((oid, typmod), t.clone());
        t
    }

    async fn format_type(&self, oid: u32, typmod: i32) -> String {
        if let Some(client) = &self.client {
            match client
                .query_one("SELECT format_type($1, $2)", &[&oid, &typmod])
                .await
            {
                Ok(row) => {
                    if let Some(name) = row.get::<_, Option<String>>(0) {
                        return name;
                    }
                }
                Err(e) => tracing::warn!(oid, error = %e, "cannot look up a column type's name"),
            }
        }
        format!("oid:{oid}")
    }

    async fn row(&self, oid: u32) -> Option<TypeRow> {
        let client = self.client.as_ref()?;
        let row = client
            .query_opt(
                "SELECT typtype::text, typbasetype, typelem, typname::text, typcategory::text
                 FROM pg_type WHERE oid = $1",
                &[&oid],
            )
            .await
            .inspect_err(|e| tracing::warn!(oid, error = %e, "cannot look up a column type"))
            .ok()??;
        Some(TypeRow {
            typtype: row.get(0),
            basetype: row.get(1),
            elem: row.get(2),
            name: row.get(3),
            category: row.get(4),
        })
    }

    /// How values of `oid` render; domains and arrays are followed a few levels.
    async fn render(&self, oid: u32) -> Render {
        let mut oid = oid;
        for _ in 0..8 {
            if oid < FIRST_NORMAL_OID {
                return Render::Builtin(oid);
            }
            let Some(t) = self.row(oid).await else {
                return Render::Builtin(oid);
            };
            match (t.typtype.as_str(), t.category.as_str()) {
                ("d", _) => oid = t.basetype,
                ("e", _) => return Render::Builtin(TEXT),
                (_, "A") if t.elem != 0 => {
                    let elem = Box::pin(self.render(t.elem)).await;
                    return Render::Builtin(match elem {
                        Render::Builtin(e) => types::array_type_of(e).unwrap_or(TEXT_ARRAY),
                        Render::Hstore => TEXT_ARRAY,
                    });
                }
                _ if t.name == "hstore" => return Render::Hstore,
                _ => return Render::Builtin(oid),
            }
        }
        Render::Builtin(oid)
    }
}
