//! A table from keys (bytes) to a small value, for the loops that look up
//! every row's key in a table far larger than the processor's cache.
//!
//! Two of a query's loops do that: the rebuild of the latest view at a seq
//! (`at`: each change's key to the row of its version) and the key window
//! without a sort (`window`: each row's key to the row before it). The
//! table is open addressing (linear probing) of entries of 16 bytes of key
//! and the value. A key of up to [`INLINE`] bytes is held in its entry
//! itself, so looking it up reads one place in memory; a longer one is
//! kept in an arena, its bytes one after another. The table is our own
//! rather than a general one so that the place of a key's entry is known
//! from its hash before it is looked up: the loops hash their keys first
//! and ask for the entries of keys some rows ahead while they look up this
//! one (see [`super::prefetch`]).

use std::hash::BuildHasher;

use crate::{Error, Result};

/// Bits of a key's length in the place of a key kept in the arena.
const LEN_BITS: u32 = 24;

/// The longest key held in its entry rather than the arena.
const INLINE: usize = 15;

/// The first byte of a [`Stored`] key that lives in the arena: no inline
/// key's length.
const IN_ARENA: u8 = 0xFF;

/// The first byte of a free entry: no key's.
const FREE: u8 = 0xFE;

/// A key in the table: up to [`INLINE`] bytes after their length,
/// zero-padded, or [`IN_ARENA`] and then its place in the arena (the key's
/// offset << [`LEN_BITS`] | its length), or [`FREE`]. Two inline keys are
/// equal exactly when their 16 bytes are.
type Stored = [u8; 16];

/// The stored form of a free entry.
const FREE_ENTRY: Stored = {
    let mut s = [0u8; 16];
    s[0] = FREE;
    s
};

/// `key` inline, if it is short enough.
fn inline(key: &[u8]) -> Option<Stored> {
    (key.len() <= INLINE).then(|| {
        let mut stored = [0u8; 16];
        stored[0] = key.len() as u8;
        stored[1..=key.len()].copy_from_slice(key);
        stored
    })
}

/// The share of the table its keys may fill before it grows.
const FILL: (usize, usize) = (7, 10);

/// The hashing of a table's keys: one state may be shared by several
/// tables, so that keys hashed once (on any thread) can be looked up in
/// any of them.
pub(crate) type KeyHasher = foldhash::fast::RandomState;

/// Keys (bytes) to values of type `V`: see the module doc.
pub(crate) struct KeyTable<V> {
    arena: Vec<u8>,
    /// A power of two long; [`FREE`] first bytes mark the free entries.
    table: Vec<(Stored, V)>,
    /// Entries in use.
    len: usize,
    hasher: KeyHasher,
}

impl<V: Copy + Default> KeyTable<V> {
    /// A table with room for `keys` keys before it grows.
    pub(crate) fn with_capacity(keys: usize, hasher: KeyHasher) -> KeyTable<V> {
        KeyTable {
            arena: Vec::new(),
            table: vec![(FREE_ENTRY, V::default()); Self::entries_for(keys)],
            len: 0,
            hasher,
        }
    }

    /// The table's length for `keys` keys.
    fn entries_for(keys: usize) -> usize {
        (keys.max(8) * FILL.1 / FILL.0 + 1).next_power_of_two()
    }

    /// The bytes of a stored key.
    fn key<'a>(arena: &'a [u8], stored: &'a Stored) -> &'a [u8] {
        if stored[0] != IN_ARENA {
            return &stored[1..=stored[0] as usize];
        }
        let place = u64::from_le_bytes(stored[8..].try_into().expect("8 bytes"));
        let (offset, len) = (
            (place >> LEN_BITS) as usize,
            (place & ((1 << LEN_BITS) - 1)) as usize,
        );
        &arena[offset..offset + len]
    }

    /// The hash a key is looked up by.
    pub(crate) fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Where a key of hash `hash` is looked for first.
    fn home(&self, hash: u64) -> usize {
        hash as usize & (self.table.len() - 1)
    }

    /// Asks for the entry a key of hash `hash` is looked for first.
    pub(crate) fn prefetch(&self, hash: u64) {
        super::prefetch::prefetch(&self.table[self.home(hash)]);
    }

    /// `key`'s value, the key added with `V::default()` if new.
    pub(crate) fn slot(&mut self, key: &[u8]) -> Result<&mut V> {
        let hash = self.hash(key);
        self.slot_hashed(key, hash)
    }

    /// [`KeyTable::slot`] for a key whose hash is `hash`.
    pub(crate) fn slot_hashed(&mut self, key: &[u8], hash: u64) -> Result<&mut V> {
        let short = inline(key);
        let mask = self.table.len() - 1;
        let mut at = self.home(hash);
        loop {
            let (stored, _) = &self.table[at];
            if stored[0] == FREE {
                break;
            }
            let same = match &short {
                Some(short) => stored == short,
                None => stored[0] == IN_ARENA && Self::key(&self.arena, stored) == key,
            };
            if same {
                return Ok(&mut self.table[at].1);
            }
            at = (at + 1) & mask;
        }
        if (self.len + 1) * FILL.1 > self.table.len() * FILL.0 {
            self.grow();
            return self.slot_hashed(key, hash);
        }
        let stored = match short {
            Some(short) => short,
            None => {
                let offset = self.arena.len() as u64;
                if key.len() as u64 >= 1 << LEN_BITS || offset >= 1 << (64 - LEN_BITS) {
                    return Err(Error::fatal(
                        "the keys do not fit in memory (a key of 16 MiB, or 1 TiB of keys)",
                        "read fewer keys in one statement",
                    ));
                }
                self.arena.extend_from_slice(key);
                let mut stored = [0u8; 16];
                stored[0] = IN_ARENA;
                let place = (offset << LEN_BITS) | key.len() as u64;
                stored[8..].copy_from_slice(&place.to_le_bytes());
                stored
            }
        };
        self.len += 1;
        self.table[at] = (stored, V::default());
        Ok(&mut self.table[at].1)
    }

    /// Doubles the table, every key hashed again from where it is kept.
    fn grow(&mut self) {
        let wider = vec![(FREE_ENTRY, V::default()); self.table.len() * 2];
        let old = std::mem::replace(&mut self.table, wider);
        let mask = self.table.len() - 1;
        for (stored, value) in old.into_iter().filter(|(s, _)| s[0] != FREE) {
            let mut at = self.home(self.hasher.hash_one(Self::key(&self.arena, &stored)));
            while self.table[at].0[0] != FREE {
                at = (at + 1) & mask;
            }
            self.table[at] = (stored, value);
        }
    }

    /// Forgets every key.
    pub(crate) fn clear(&mut self) {
        self.table.fill((FREE_ENTRY, V::default()));
        self.arena.clear();
        self.len = 0;
    }

    /// How many keys the table holds.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The values of the keys held.
    pub(crate) fn values(&self) -> impl Iterator<Item = V> + '_ {
        self.table
            .iter()
            .filter(|(s, _)| s[0] != FREE)
            .map(|(_, v)| *v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_short_and_long_are_told_apart_and_found_again() {
        let keys = [
            "",
            "{\"id\":1}",
            "{\"id\":262681}",
            "fifteen bytes..",
            "fifteen bytes...",
            "sixteen bytes...",
            "sixteen bytes..!",
            "a key well over fifteen bytes, in the arena",
        ];
        // Beside them, a thousand keys short and long, so that the table
        // made for 2 keys grows several times: every key is hashed again
        // from where it is kept.
        let many: Vec<String> = (0..1_000)
            .map(|i| match i % 2 {
                0 => format!("{{\"id\":{i}}}"),
                _ => format!("{{\"id\":{i},\"region\":\"north\"}}"),
            })
            .collect();
        let keys: Vec<&str> = keys
            .into_iter()
            .chain(many.iter().map(String::as_str))
            .collect();
        let mut map = KeyTable::<u64>::with_capacity(2, KeyHasher::default());
        for (i, k) in keys.iter().enumerate() {
            let slot = map.slot(k.as_bytes()).unwrap();
            assert_eq!(*slot, 0, "{k} is new");
            *slot = i as u64 + 1;
        }
        assert!(map.table.len() >= 1_024, "{}", map.table.len());
        assert_eq!(map.len(), keys.len());
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(*map.slot(k.as_bytes()).unwrap(), i as u64 + 1, "{k}");
        }
        let mut values: Vec<u64> = map.values().collect();
        values.sort_unstable();
        assert_eq!(values, (1..=keys.len() as u64).collect::<Vec<_>>());
        assert_eq!(*map.slot(b"{\"id\":262681}").unwrap(), 3);
        map.clear();
        assert_eq!(map.values().count(), 0);
        assert_eq!(*map.slot(b"sixteen bytes...").unwrap(), 0);
    }
}
