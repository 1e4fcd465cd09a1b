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

use std::hash::Hasher;

use siphasher::sip::SipHasher13;

/// The version of the row identity function, recorded in the local state.
pub const VERSION: u32 = 1;

/// One key value of a row, as the replication stream carries it.
#[derive(Debug, Clone, Copy)]
pub enum KeyValue<'a> {
    /// The value's text (or binary) form.
    Bytes(&'a [u8]),
    Null,
    /// An unchanged TOASTed value (not in a key in practice; kept distinct).
    Unchanged,
}

/// Builds the identity of one row of one table.
pub struct RowHasher(SipHasher13);

impl RowHasher {
    /// Starts the identity of a row of `table` (`schema.name`).
    pub fn new(table: &str) -> Self {
        let mut h = SipHasher13::new_with_keys(0, 0);
        // As `str`'s Hash impl wrote it: the bytes, then 0xFF.
        h.write(table.as_bytes());
        h.write_u8(0xFF);
        RowHasher(h)
    }

    /// Adds the next key value, in column order.
    pub fn key_value(&mut self, value: KeyValue<'_>) {
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

    pub fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// The identity that stands for every row of a table (a truncate).
pub fn table(table: &str) -> u64 {
    RowHasher::new(table).finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hash;

    /// The function as it was written before this module, with std's
    /// hasher and `Hash` impls: on the Rust that made the state format the
    /// two agree, which is what lets states written then keep their holds.
    fn with_std(table: &str, keys: &[KeyValue<'_>]) -> u64 {
        #[allow(deprecated)]
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
