//! The change envelope: one JSON line per change, in the output contract's
//! field order `{"op","table","data","old","seq","idempotency_key","commit_lsn"}`.
//!
//! A line's bytes depend only on the change and its seq (fixed field order,
//! values rendered once by the source with fixed formatting, an idempotency
//! key derived from the change's position), so re-sending a batch after a
//! crash or a retry produces identical bytes.

use std::sync::Arc;

use uuid::Uuid;

use crate::lsn;

/// Namespace of every idempotency key:
/// `UUIDv5(URL namespace, "https://waltail.dev/idempotency")`. A pipeline's
/// namespace is `UUIDv5(this, pipeline name)`; a change's key is
/// `UUIDv5(pipeline namespace, "<commit_lsn X/Y>/<index in transaction>")`.
pub fn waltail_namespace() -> Uuid {
    Uuid::new_v5(&Uuid::NAMESPACE_URL, b"https://waltail.dev/idempotency")
}

/// The namespace of one pipeline's idempotency keys.
pub fn pipeline_namespace(pipeline: &str) -> Uuid {
    Uuid::new_v5(&waltail_namespace(), pipeline.as_bytes())
}

/// What happened to the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A row was inserted: `data` is the new row, `old` is null.
    Insert,
    /// A row was updated: `data` is the new row, `old` the old one (or its
    /// key) when the replica identity gives it.
    Update,
    /// A row was deleted: `data` is null, `old` is its key or whole row.
    Delete,
    /// The table was truncated: every row of it is gone, `data` and `old` null.
    Truncate,
    /// A row read by a backfill snapshot, not a change in the WAL.
    Read,
}

impl Op {
    /// The op as the line's `"op"` spells it; [`Op::parse`] reads it back.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Insert => "insert",
            Op::Update => "update",
            Op::Delete => "delete",
            Op::Truncate => "truncate",
            Op::Read => "read",
        }
    }

    /// The op a line's `"op"` names, as [`Op::as_str`] writes it.
    pub fn parse(name: &str) -> Option<Op> {
        Some(match name {
            "insert" => Op::Insert,
            "update" => Op::Update,
            "delete" => Op::Delete,
            "truncate" => Op::Truncate,
            "read" => Op::Read,
            _ => return None,
        })
    }
}

/// A table as the envelope names it, with its JSON form computed once.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct TableRef {
    /// `schema.table`, as Postgres spells it.
    pub name: String,
    /// `name` as a JSON string literal, quotes included.
    pub json: String,
    /// The identity that stands for every row of the table (see
    /// [`crate::row_identity::table`]): a truncate's row.
    pub hash: u64,
}

impl TableRef {
    /// A table by its schema and name, as a relation message gives them.
    pub fn new(schema: &str, table: &str) -> TableRef {
        TableRef::from_name(format!("{schema}.{table}"))
    }

    /// A table by its `schema.table` name.
    pub fn from_name(name: String) -> TableRef {
        let json = serde_json::to_string(&name).expect("a string serialises");
        let hash = crate::row_identity::table(&name);
        TableRef { name, json, hash }
    }
}

/// One committed change, its values already rendered as JSON.
#[derive(Debug, Clone)]
pub struct Change {
    /// What happened to the row; the line's `"op"`.
    pub op: Op,
    /// The table changed, shared by every change of it so its name is
    /// rendered once.
    pub table: Arc<TableRef>,
    /// The row after the change, a JSON object; `None` renders as null.
    pub data: Option<Vec<u8>>,
    /// The row (or its key) before the change, when replica identity gives it.
    pub old: Option<Vec<u8>>,
    /// The LSN of the transaction's commit record.
    pub commit_lsn: u64,
    /// Commit time, microseconds since 2000-01-01 UTC.
    pub commit_ts: i64,
    /// Position of the change within its transaction, from 0.
    pub index: u32,
    /// Hashes of the rows this change touches (table + replica identity key),
    /// so delivery never has two batches with the same row in flight. A
    /// truncate carries the hash of its table alone, see [`table_hash`].
    pub rows: RowSet,
}

/// The rows a change touches; at most two (an update that moves its key).
pub type RowSet = smallvec_lite::Rows;

/// Hash identifying "every row of this table" for truncates.
pub fn table_hash(table: &TableRef) -> u64 {
    table.hash
}

/// A tiny fixed-capacity set of row hashes, to avoid a heap allocation per change.
///
/// Not the `smallvec` crate, whose `SmallVec<[u64; 2]>` is no drop-in:
/// `push` here is a set insert (an update whose old tuple has the same key
/// as its new one names that row once), the capacity is a hard cap that
/// never moves to the heap (a spill record has room for two hashes, see
/// `source::spill`), and the type is `Copy` in 24 bytes.
pub mod smallvec_lite {
    /// Up to two row hashes, without duplicates; a third is dropped (no
    /// change touches more than two rows).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct Rows {
        len: u8,
        items: [u64; 2],
    }

    impl Rows {
        /// The set holding the one row `h`.
        pub fn one(h: u64) -> Rows {
            Rows {
                len: 1,
                items: [h, 0],
            }
        }
        /// Adds `h` unless it is already there or the set is full.
        pub fn push(&mut self, h: u64) {
            if self.as_slice().contains(&h) {
                return;
            }
            if (self.len as usize) < self.items.len() {
                self.items[self.len as usize] = h;
                self.len += 1;
            }
        }
        /// The hashes held, in the order they were added.
        pub fn as_slice(&self) -> &[u64] {
            &self.items[..self.len as usize]
        }
    }
}

/// `Uuid::new_v5(namespace, name)`, hashed with RustCrypto's `sha1`, which
/// uses the CPU's SHA instructions where it has them, instead of uuid's
/// portable `sha1_smol`: this runs once per change (3% of the pipeline's
/// CPU in a backfill's profile). The same bytes: a test compares the two.
pub fn v5(namespace: &Uuid, name: &[u8]) -> Uuid {
    use sha1::Digest as _;
    let mut hash = sha1::Sha1::new();
    hash.update(namespace.as_bytes());
    hash.update(name);
    let digest = hash.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_sha1_bytes(bytes).into_uuid()
}

/// Appends the change's envelope line (with its trailing newline) to `out`.
pub fn write_line(out: &mut Vec<u8>, namespace: &Uuid, change: &Change, seq: u64) {
    use std::io::Write as _;
    // The key's name `<commit_lsn X/Y>/<index>` is built on the stack: this
    // runs once per change, so no allocation here.
    let mut name = [0u8; 40];
    let name_len = {
        let mut cursor = &mut name[..];
        write!(
            cursor,
            "{}/{}",
            lsn::display(change.commit_lsn),
            change.index
        )
        .expect("fits in 40 bytes");
        40 - cursor.len()
    };
    let lsn_len = name[..name_len]
        .iter()
        .rposition(|&b| b == b'/')
        .expect("the name has an index part");
    out.extend_from_slice(b"{\"op\":\"");
    out.extend_from_slice(change.op.as_str().as_bytes());
    out.extend_from_slice(b"\",\"table\":");
    out.extend_from_slice(change.table.json.as_bytes());
    out.extend_from_slice(b",\"data\":");
    out.extend_from_slice(change.data.as_deref().unwrap_or(b"null"));
    out.extend_from_slice(b",\"old\":");
    out.extend_from_slice(change.old.as_deref().unwrap_or(b"null"));
    out.extend_from_slice(b",\"seq\":");
    write!(out, "{seq}").expect("writing to a Vec cannot fail");
    out.extend_from_slice(b",\"idempotency_key\":\"");
    let key = v5(namespace, &name[..name_len]);
    out.extend_from_slice(
        key.hyphenated()
            .encode_lower(&mut Uuid::encode_buffer())
            .as_bytes(),
    );
    out.extend_from_slice(b"\",\"commit_lsn\":\"");
    out.extend_from_slice(&name[..lsn_len]);
    out.extend_from_slice(b"\"}\n");
}

/// The idempotency key of the change at `index` in the transaction committed at `lsn`.
pub fn idempotency_key(namespace: &Uuid, lsn: &str, index: u32) -> Uuid {
    let name = format!("{lsn}/{index}");
    v5(namespace, name.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys must not change across releases: [`v5`] gives uuid's own v5.
    #[test]
    fn v5_is_uuids_v5() {
        let pipeline = pipeline_namespace("orders");
        for ns in [Uuid::NAMESPACE_URL, Uuid::NAMESPACE_OID, pipeline] {
            for name in [
                &b""[..],
                b"0/1/0",
                b"16/B374D848/4294967295",
                &[7u8; 55],
                &[7u8; 56],
                &[9u8; 200],
            ] {
                assert_eq!(v5(&ns, name), Uuid::new_v5(&ns, name), "{name:?}");
            }
        }
    }

    fn change(op: Op) -> Change {
        Change {
            op,
            table: Arc::new(TableRef::new("public", "orders")),
            data: Some(br#"{"id":42,"status":"shipped"}"#.to_vec()),
            old: None,
            commit_lsn: 0x1A2B3C8,
            commit_ts: 0,
            index: 3,
            rows: RowSet::one(1),
        }
    }

    #[test]
    fn line_has_contract_field_order() {
        let ns = pipeline_namespace("orders");
        let mut out = Vec::new();
        write_line(&mut out, &ns, &change(Op::Update), 137);
        let text = String::from_utf8(out).unwrap();
        assert!(text.ends_with('\n'));
        let prefix = r#"{"op":"update","table":"public.orders","data":{"id":42,"status":"shipped"},"old":null,"seq":137,"idempotency_key":""#;
        assert!(text.starts_with(prefix), "{text}");
        assert!(text.ends_with("\"commit_lsn\":\"0/1A2B3C8\"}\n"), "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["seq"], 137);
    }

    #[test]
    fn line_key_and_lsn_match_the_documented_derivation() {
        let ns = pipeline_namespace("orders");
        for lsn in [0u64, 0x1A2B3C8, 0xFFFF_FFFF_FFFF_FFFF, 0x1_0000_0000] {
            let mut c = change(Op::Insert);
            c.commit_lsn = lsn;
            c.index = 4_000_000_000;
            let mut out = Vec::new();
            write_line(&mut out, &ns, &c, u64::MAX);
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(v["commit_lsn"], lsn::format(lsn));
            assert_eq!(v["seq"].as_u64(), Some(u64::MAX));
            let key = idempotency_key(&ns, &lsn::format(lsn), c.index);
            assert_eq!(v["idempotency_key"], key.to_string());
        }
    }

    #[test]
    fn idempotency_key_is_stable_and_position_dependent() {
        let ns = pipeline_namespace("orders");
        let a = idempotency_key(&ns, "0/1A2B3C8", 0);
        assert_eq!(a, idempotency_key(&ns, "0/1A2B3C8", 0));
        assert_ne!(a, idempotency_key(&ns, "0/1A2B3C8", 1));
        assert_ne!(
            a,
            idempotency_key(&pipeline_namespace("other"), "0/1A2B3C8", 0)
        );
        assert_eq!(a.get_version_num(), 5);
    }
}
