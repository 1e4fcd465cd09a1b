//! WAL positions (LSNs) and their text form, the one Postgres's `pg_lsn`
//! prints and reads: `X/Y`, the high and low 32 bits in hex (`16/B374D848`).
//!
//! LSNs stay plain `u64`s through the crate (decoded, compared, stored in the
//! state file); this module is the one place that turns them into text and
//! back. A ground-floor module: it uses nothing else of the crate.

use std::fmt;

/// A WAL position, as Postgres's `pg_lsn`.
pub type Lsn = u64;

/// `lsn` in Postgres's text form, upper-case hex (`16/B374D848`, `0/0`).
pub fn format(lsn: Lsn) -> String {
    display(lsn).to_string()
}

/// `lsn` in Postgres's text form without allocating, for `write!` and log
/// fields: the same text as [`format()`].
pub fn display(lsn: Lsn) -> impl fmt::Display {
    struct Text(Lsn);
    impl fmt::Display for Text {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "{:X}/{:X}", self.0 >> 32, self.0 as u32)
        }
    }
    Text(lsn)
}

/// Reads Postgres's text form, as strictly as `pg_lsn` does: two parts of 1
/// to 8 hex digits (either case) around one `/`, nothing else (no sign, no
/// spaces). `None` for anything else.
pub fn parse(s: &str) -> Option<Lsn> {
    let (hi, lo) = s.split_once('/')?;
    // from_str_radix alone would accept a leading '+' and, with leading
    // zeros, more than 8 digits; pg_lsn accepts neither.
    let half = |p: &str| -> Option<u64> {
        if p.is_empty() || p.len() > 8 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u32::from_str_radix(p, 16).ok().map(u64::from)
    };
    Some((half(hi)? << 32) | half(lo)?)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn text_form_is_postgres_upper_case_hex() {
        assert_eq!(format(0x16_B374_D848), "16/B374D848");
        assert_eq!(format(0), "0/0");
        assert_eq!(format(0x1_0000_0000), "1/0");
        assert_eq!(format(u64::MAX), "FFFFFFFF/FFFFFFFF");
        assert_eq!(display(0x1A2B3C8).to_string(), "0/1A2B3C8");
    }

    #[test]
    fn parses_what_pg_lsn_accepts() {
        assert_eq!(parse("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(parse("0/0"), Some(0));
        assert_eq!(parse("ffffffff/ffffffff"), Some(u64::MAX));
        assert_eq!(parse("00000016/0b374d84"), Some(0x16_0B37_4D84));
    }

    #[test]
    fn rejects_what_pg_lsn_rejects() {
        for bad in [
            "",
            "nope",
            "/",
            "1/",
            "/1",
            "1",
            "+1/1",
            "1/+1",
            "1/-1",
            " 1/1",
            "1/1 ",
            "123456789/0",
            "0/000000001",
            "g/0",
            "1/2/3",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn round_trips(lsn in any::<u64>()) {
            prop_assert_eq!(parse(&format(lsn)), Some(lsn));
            prop_assert_eq!(parse(&format(lsn).to_lowercase()), Some(lsn));
        }
    }
}
