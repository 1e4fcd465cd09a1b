//! Fuzzing for the parsers that read bytes from outside: the pgoutput
//! decoder, the replication protocol's framing, and `compact`'s fast NDJSON
//! line reader. `cargo fuzz` needs a nightly compiler, so the campaigns are
//! proptest properties, each in its parser's tests (named `fuzz_*`), that
//! start from valid inputs and apply the edits a mutation fuzzer makes:
//! bit flips, bytes set to boundary values, big-endian lengths overwritten,
//! insertions, removals, cuts and repeated runs. The suite runs a few
//! hundred or thousand cases of each; `scripts/fuzz.sh` runs millions
//! (`WALTAIL_FUZZ_CASES`).

use proptest::prelude::*;

/// The cases each campaign runs: `WALTAIL_FUZZ_CASES`, or `suite` in the
/// suite.
pub(crate) fn config(suite: u32) -> ProptestConfig {
    let cases = std::env::var("WALTAIL_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(suite);
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

/// One edit of an input; positions are taken modulo its length.
#[derive(Debug, Clone)]
pub(crate) enum Edit {
    /// Flips one bit.
    Flip(usize, u8),
    /// Sets a byte.
    Set(usize, u8),
    /// Writes a 4-byte big-endian value (lengths and counts are `i32`/
    /// `u32` in both protocols; a 2-byte count is half of one).
    Word(usize, u32),
    Insert(usize, u8),
    Remove(usize),
    /// Keeps only the first `n` bytes.
    Cut(usize),
    /// Repeats the run at `at` of `len` bytes right after itself.
    Repeat(usize, usize),
}

/// Bytes a fuzzer's dictionary would hold: boundaries, and the characters
/// that structure the inputs (message tags, JSON's punctuation).
fn byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        any::<u8>(),
        prop::sample::select(
            b"\0\x01\x7f\x80\xff{}[]\":,\\-.0123456789eEntfABCORYIUDTMSEcwkdu".to_vec()
        ),
    ]
}

/// Boundary values for lengths and counts.
fn word() -> impl Strategy<Value = u32> {
    prop_oneof![
        any::<u32>(),
        prop::sample::select(vec![
            0,
            1,
            2,
            3,
            4,
            5,
            0x7fff,
            0xffff,
            0x7fff_ffff,
            0x8000_0000,
            u32::MAX
        ]),
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    let at = any::<usize>();
    prop_oneof![
        (at, 0..8u8).prop_map(|(a, b)| Edit::Flip(a, b)),
        (at, byte()).prop_map(|(a, b)| Edit::Set(a, b)),
        (at, word()).prop_map(|(a, w)| Edit::Word(a, w)),
        (at, byte()).prop_map(|(a, b)| Edit::Insert(a, b)),
        at.prop_map(Edit::Remove),
        at.prop_map(Edit::Cut),
        (at, 1..16usize).prop_map(|(a, n)| Edit::Repeat(a, n)),
    ]
}

/// One to eight edits.
pub(crate) fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec(edit(), 1..=8)
}

/// `input` with `edits` applied in order.
pub(crate) fn apply(input: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut v = input.to_vec();
    for e in edits {
        let len = v.len();
        let at = |a: usize| if len == 0 { 0 } else { a % len };
        match *e {
            Edit::Flip(a, bit) if len > 0 => v[at(a)] ^= 1 << bit,
            Edit::Set(a, b) if len > 0 => v[at(a)] = b,
            Edit::Word(a, w) if len > 0 => {
                for (i, b) in w.to_be_bytes().into_iter().enumerate() {
                    if let Some(slot) = v.get_mut(at(a) + i) {
                        *slot = b;
                    }
                }
            }
            Edit::Insert(a, b) => v.insert(if len == 0 { 0 } else { a % (len + 1) }, b),
            Edit::Remove(a) if len > 0 => _ = v.remove(at(a)),
            Edit::Cut(n) => v.truncate(n % (len + 1)),
            Edit::Repeat(a, n) if len > 0 => {
                let from = at(a);
                let run: Vec<u8> = v[from..(from + n).min(len)].to_vec();
                let to = from + run.len();
                v.splice(to..to, run);
            }
            _ => {}
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_do_what_they_say() {
        let input = b"abcdef";
        assert_eq!(apply(input, &[Edit::Flip(6, 1)]), b"cbcdef");
        assert_eq!(apply(input, &[Edit::Set(1, b'X')]), b"aXcdef");
        assert_eq!(apply(input, &[Edit::Word(4, 0x0102_0304)]), b"abcd\x01\x02");
        assert_eq!(apply(input, &[Edit::Insert(6, b'!')]), b"abcdef!");
        assert_eq!(apply(input, &[Edit::Remove(0)]), b"bcdef");
        assert_eq!(apply(input, &[Edit::Cut(3)]), b"abc");
        assert_eq!(apply(input, &[Edit::Repeat(1, 2)]), b"abcbcdef");
        assert_eq!(apply(b"", &[Edit::Set(3, 1), Edit::Insert(9, 7)]), b"\x07");
    }
}
