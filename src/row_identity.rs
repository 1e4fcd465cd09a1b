//! Row identities: the 64-bit hash of a table and a row's key values that
//! keeps the changes to one row in order (never two batches with the same
//! row in flight; later changes held behind a parked batch).
//!
//! The hashes outlive the process: parked and held batches keep theirs in
//! the local state, and a later build of waltail must recognise them, or a
//! change could pass the parked batch of its row. So the function is
//! specified here rather than left to the standard library, whose
//! `DefaultHasher` may change its algorithm between Rust releases: it is
//! SipHash-1-3 with the keys (0, 0), fed an explicit byte sequence. Those
//! are exactly the algorithm and bytes that `DefaultHasher::new()` and the
//! `Hash` impls of `str`, `[u8]` and `u8` used when the state format was
//! made (Rust 1.95), so states written before keep their holds; a test
//! pins both the equality and literal values. A change to this function is
//! a new [`VERSION`], which the state records (see
//! [`crate::checkpoint::Checkpoint::open`]).

use std::collections::HashMap;
use std::hash::Hasher;

use siphasher::sip::SipHasher13;

/// The version of the row identity function, recorded in the local state.
pub(crate) const VERSION: u32 = 1;

/// One key value of a row, as the replication stream carries it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum KeyValue<'a> {
    /// The value's text (or binary) form.
    Bytes(&'a [u8]),
    Null,
    /// An unchanged TOASTed value (not in a key in practice; kept distinct).
    Unchanged,
}

/// Builds the identity of one row of one table.
pub(crate) struct RowHasher(SipHasher13);

impl RowHasher {
    /// Starts the identity of a row of `table` (`schema.name`).
    pub(crate) fn new(table: &str) -> Self {
        let mut h = SipHasher13::new_with_keys(0, 0);
        // As `str`'s Hash impl wrote it: the bytes, then 0xFF.
        h.write(table.as_bytes());
        h.write_u8(0xFF);
        RowHasher(h)
    }

    /// Adds the next key value, in column order.
    pub(crate) fn key_value(&mut self, value: KeyValue<'_>) {
        match value {
            // As `[u8]`'s Hash impl wrote it: the length as a 64-bit
            // little-endian integer, then the bytes.
            KeyValue::Bytes(b) => {
                self.0.write(&(b.len() as u64).to_le_bytes());
                self.0.write(b);
            }
            KeyValue::Null => self.0.write_u8(0),
            KeyValue::Unchanged => self.0.write_u8(1),
        }
    }

    pub(crate) fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// The identity that stands for every row of a table (a truncate).
pub(crate) fn table(table: &str) -> u64 {
    RowHasher::new(table).finish()
}

/// The rows held by a set of batches (uploading, or parked and held), with
/// how many of them hold each. Another batch conflicts with them when it
/// has one of their rows, when it truncates a table they touch, or when
/// they truncate a table it touches: a truncate's row is its table's
/// identity ([`table`]), and a truncate changes every row of its table.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    rows: Counts,
    /// The tables the holding batches touch.
    tables: Counts,
}

/// How many holding batches have each row (or table) identity: hashes
/// already, hashed again in memory with a fast hasher (see
/// [`crate::batch::RowHashSet`]).
type Counts = HashMap<u64, u32, foldhash::fast::RandomState>;

impl Holds {
    /// Whether a batch with these rows, touching these tables, must wait
    /// behind the holding batches.
    pub(crate) fn conflicts<'a>(
        &self,
        rows: impl IntoIterator<Item = &'a u64>,
        tables: impl IntoIterator<Item = u64>,
    ) -> bool {
        rows.into_iter()
            .any(|r| self.rows.contains_key(r) || self.tables.contains_key(r))
            || tables.into_iter().any(|t| self.rows.contains_key(&t))
    }

    pub(crate) fn add<'a>(
        &mut self,
        rows: impl IntoIterator<Item = &'a u64>,
        tables: impl IntoIterator<Item = u64>,
    ) {
        for r in rows {
            *self.rows.entry(*r).or_default() += 1;
        }
        for t in tables {
            *self.tables.entry(t).or_default() += 1;
        }
    }

    pub(crate) fn remove<'a>(
        &mut self,
        rows: impl IntoIterator<Item = &'a u64>,
        tables: impl IntoIterator<Item = u64>,
    ) {
        fn release(map: &mut Counts, key: u64) {
            if let Some(n) = map.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&key);
                }
            }
        }
        for r in rows {
            release(&mut self.rows, *r);
        }
        for t in tables {
            release(&mut self.tables, t);
        }
    }

    pub(crate) fn clear(&mut self) {
        self.rows.clear();
        self.tables.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::hash::Hash;

    use super::*;

    /// The function as it was written before this module, with std's
    /// hasher and `Hash` impls: on the Rust that made the state format the
    /// two agree, which is what lets states written then keep their holds.
    fn with_std(table: &str, keys: &[KeyValue<'_>]) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        table.to_string().hash(&mut h);
        for k in keys {
            match k {
                KeyValue::Bytes(b) => b.hash(&mut h),
                KeyValue::Null => 0u8.hash(&mut h),
                KeyValue::Unchanged => 1u8.hash(&mut h),
            }
        }
        h.finish()
    }

    fn ours(table: &str, keys: &[KeyValue<'_>]) -> u64 {
        let mut h = RowHasher::new(table);
        for k in keys {
            h.key_value(*k);
        }
        h.finish()
    }

    fn cases() -> Vec<(&'static str, Vec<KeyValue<'static>>)> {
        vec![
            ("public.orders", vec![KeyValue::Bytes(b"1")]),
            ("public.orders", vec![KeyValue::Bytes(b"42")]),
            (
                "shop.line_items",
                vec![KeyValue::Bytes(b"7"), KeyValue::Bytes(b"ab\0c")],
            ),
            ("public.t", vec![KeyValue::Null, KeyValue::Unchanged]),
            ("public.t", vec![KeyValue::Bytes(b"")]),
            ("\"odd.schema\".\"t\"", vec![KeyValue::Bytes(&[0xFF; 40])]),
            ("public.orders", vec![]),
        ]
    }

    #[test]
    fn the_identity_is_what_std_computed_when_the_state_format_was_made() {
        for (table, keys) in cases() {
            assert_eq!(
                ours(table, &keys),
                with_std(table, &keys),
                "{table} {keys:?}"
            );
        }
        assert_eq!(table("public.orders"), ours("public.orders", &[]));
    }

    /// Per-row order with truncates: a truncate holds every row of its
    /// table, and waits for every batch touching its table.
    #[test]
    fn holds_conflict_on_rows_and_on_truncated_tables() {
        let (orders, items) = (table("public.orders"), table("public.items"));
        let (row1, row2) = (
            ours("public.orders", &[KeyValue::Bytes(b"1")]),
            ours("public.orders", &[KeyValue::Bytes(b"2")]),
        );
        let mut holds = Holds::default();
        // A batch of order 1 is held.
        holds.add(&[row1], [orders]);
        assert!(holds.conflicts(&[row1], [orders]), "the same row");
        assert!(
            !holds.conflicts(&[row2], [orders]),
            "another row of the table flows"
        );
        assert!(
            holds.conflicts(&[orders], [orders]),
            "a truncate of its table waits"
        );
        assert!(
            !holds.conflicts(&[items], [items]),
            "a truncate of another table flows"
        );
        holds.remove(&[row1], [orders]);
        assert!(!holds.conflicts(&[orders], [orders]));
        // A truncate of orders is held.
        holds.add(&[orders], [orders]);
        assert!(
            holds.conflicts(&[row2], [orders]),
            "any row of the truncated table waits"
        );
        assert!(!holds.conflicts(&[ours("public.items", &[KeyValue::Bytes(b"1")])], [items]));
        holds.clear();
        assert!(!holds.conflicts(&[row2], [orders]));
    }

    /// Literal values: whatever the standard library does later, these stay.
    #[test]
    fn identities_are_pinned() {
        let got: Vec<u64> = cases().iter().map(|(t, k)| ours(t, k)).collect();
        assert_eq!(
            got, PINNED,
            "row identities changed: that needs a new VERSION"
        );
    }

    const PINNED: [u64; 7] = [
        17950230971948558190,
        13850818274590164425,
        17218026610653559764,
        10513198008119086951,
        4850853878783907687,
        5527268347582217124,
        7678704008775777204,
    ];
}
