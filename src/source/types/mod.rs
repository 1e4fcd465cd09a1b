//! Converts column values in Postgres text output format to JSON.
//!
//! Assumes the session settings waltail sets: `DateStyle=ISO`,
//! `TimeZone=UTC`, `IntervalStyle=iso_8601`, `bytea_output=hex`,
//! `extra_float_digits=1`.
//!
//! Guarantees of [`write_json`], for any input bytes and any type OID:
//!
//! * It never panics and always appends exactly one valid JSON value. When a
//!   value does not have the shape its type promises (which the server never
//!   sends, but corruption or a wrong OID could), the raw text is emitted as a
//!   JSON string instead, so no data is lost and no output line is broken.
//! * The appended bytes never contain a raw `\n` or `\r`, so the caller can
//!   build NDJSON lines from them.
//! * Scalars are written straight into `out`; the only per-value allocations
//!   are for arrays with quoted elements and for non-UTF-8 text.
//!
//! Mapping by type:
//!
//! * `int2`, `int4`, `int8`, `oid`: JSON number, verbatim.
//! * `float4`, `float8`: JSON number, verbatim (the server prints the shortest
//!   round-trip form); `NaN`, `Infinity`, `-Infinity` become JSON strings.
//! * `numeric`: a JSON number, verbatim (`19.990` stays `19.990`), when it has
//!   at most 15 significant digits, counted from the first non-zero digit to
//!   the last digit printed, trailing zeros included, and is not smaller than
//!   1e-300; any IEEE-754 double reader then gets exactly that decimal value
//!   back. Anything longer is a JSON string of the text, as are `NaN`,
//!   `Infinity` and `-Infinity`.
//! * `bool`: `true` / `false`.
//! * `json`, `jsonb`: embedded as raw JSON (see [`json::write_raw_json`] for why
//!   it is still checked).
//! * `timestamp`: `2024-03-01 12:34:56.789` becomes `"2024-03-01T12:34:56.789"`.
//! * `timestamptz`: `2024-03-01 12:34:56.789+00` becomes
//!   `"2024-03-01T12:34:56.789+00:00"`, as `to_jsonb()` prints it in UTC.
//! * `bytea`: `\x0102` becomes the padded standard base64 `"AQI="`.
//! * arrays of all the above: JSON arrays (nested for multi-dimensional
//!   arrays, bounds decorations such as `[0:2]=` dropped), elements mapped by
//!   their element type, `NULL` elements as `null`.
//! * text-like types, `date`, `time`, `timetz`, `uuid` and every other OID:
//!   a JSON string of the text as printed.

mod array;
mod bytea;
mod hstore;
mod json;
mod number;
mod oid;
mod string;
mod timestamp;

use array::write_array;
use bytea::write_bytea;
pub use hstore::write_hstore;
use json::write_raw_json;
use number::parse_number;
pub use oid::*;
pub use string::write_json_str;
use string::write_text_str;
use timestamp::write_timestamp;

/// Appends the JSON form of one column value, given in Postgres text output format, to `out`.
pub fn write_json(out: &mut Vec<u8>, type_oid: u32, text: &[u8]) {
    match type_oid {
        INT2 | INT4 | INT8 | OID => {
            // int8 has at most 19 digits; a longer run is not from the server
            // and might overflow a JSON reader's number range.
            match parse_number(text) {
                Some(n) if !n.has_frac && !n.has_exp && n.int_digits <= 20 => {
                    out.extend_from_slice(text)
                }
                _ => write_text_str(out, text),
            }
        }
        FLOAT4 | FLOAT8 => match parse_number(text) {
            Some(n) if n.fits_f64(text) => out.extend_from_slice(text),
            _ => write_text_str(out, text),
        },
        NUMERIC => match parse_number(text) {
            Some(n) if !n.has_exp && n.sig_digits <= 15 && n.frac_leading_zeros < 300 => {
                out.extend_from_slice(text)
            }
            _ => write_text_str(out, text),
        },
        BOOL => match text {
            b"t" | b"true" => out.extend_from_slice(b"true"),
            b"f" | b"false" => out.extend_from_slice(b"false"),
            _ => write_text_str(out, text),
        },
        JSON | JSONB => {
            if !write_raw_json(out, text) {
                write_text_str(out, text);
            }
        }
        TIMESTAMP => write_timestamp(out, text, false),
        TIMESTAMPTZ => write_timestamp(out, text, true),
        BYTEA => {
            if !write_bytea(out, text) {
                write_text_str(out, text);
            }
        }
        _ => match array_element_type(type_oid) {
            Some(elem) => {
                let start = out.len();
                if write_array(out, elem, text).is_none() {
                    out.truncate(start);
                    write_text_str(out, text);
                }
            }
            None => write_text_str(out, text),
        },
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn j(oid: u32, text: &str) -> String {
        let mut out = Vec::new();
        write_json(&mut out, oid, text.as_bytes());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn integers() {
        assert_eq!(j(INT4, "42"), "42");
        assert_eq!(j(INT2, "-32768"), "-32768");
        assert_eq!(j(INT8, "9223372036854775807"), "9223372036854775807");
        assert_eq!(j(OID, "4294967295"), "4294967295");
        assert_eq!(j(INT4, "0"), "0");
        assert_eq!(j(INT4, "abc"), "\"abc\"");
        assert_eq!(j(INT4, "007"), "\"007\"");
        assert_eq!(j(INT4, ""), "\"\"");
    }

    #[test]
    fn floats() {
        assert_eq!(j(FLOAT8, "3.14"), "3.14");
        assert_eq!(j(FLOAT8, "1e+100"), "1e+100");
        assert_eq!(
            j(FLOAT8, "1.7976931348623157e+308"),
            "1.7976931348623157e+308"
        );
        assert_eq!(j(FLOAT8, "5e-324"), "5e-324");
        assert_eq!(j(FLOAT4, "-0"), "-0");
        assert_eq!(j(FLOAT4, "NaN"), "\"NaN\"");
        assert_eq!(j(FLOAT8, "Infinity"), "\"Infinity\"");
        assert_eq!(j(FLOAT8, "-Infinity"), "\"-Infinity\"");
        assert_eq!(j(FLOAT8, "1e999"), "\"1e999\"");
        assert_eq!(j(FLOAT8, "1.8e308"), "\"1.8e308\"");
        assert_eq!(j(FLOAT8, "1e-400"), "1e-400");
        for t in ["1e-400", "5e-324", "1.7976931348623157e+308"] {
            assert!(serde_json::from_str::<serde_json::Value>(t).is_ok(), "{t}");
        }
    }

    #[test]
    fn numerics() {
        assert_eq!(j(NUMERIC, "19.990"), "19.990");
        assert_eq!(j(NUMERIC, "-0.0001234"), "-0.0001234");
        assert_eq!(j(NUMERIC, "0"), "0");
        assert_eq!(j(NUMERIC, "0.000000000000000"), "0.000000000000000");
        assert_eq!(j(NUMERIC, "123456789012345"), "123456789012345");
        assert_eq!(j(NUMERIC, "1234567890.12345"), "1234567890.12345");
        assert_eq!(j(NUMERIC, "1234567890123456"), "\"1234567890123456\"");
        assert_eq!(j(NUMERIC, "12345678901.23450"), "\"12345678901.23450\"");
        assert_eq!(
            j(NUMERIC, "99999999999999999999.99"),
            "\"99999999999999999999.99\""
        );
        assert_eq!(j(NUMERIC, "NaN"), "\"NaN\"");
        assert_eq!(j(NUMERIC, "Infinity"), "\"Infinity\"");
        assert_eq!(j(NUMERIC, "-Infinity"), "\"-Infinity\"");
        let tiny = format!("0.{}1", "0".repeat(400));
        assert_eq!(j(NUMERIC, &tiny), format!("\"{tiny}\""));
    }

    #[test]
    fn bools_and_strings() {
        assert_eq!(j(BOOL, "t"), "true");
        assert_eq!(j(BOOL, "f"), "false");
        assert_eq!(j(BOOL, "x"), "\"x\"");
        assert_eq!(
            j(TEXT, "a \"q\" \\ \n\t\u{1}é"),
            r#""a \"q\" \\ \n\t\u0001é""#
        );
        assert_eq!(j(VARCHAR, ""), "\"\"");
        assert_eq!(j(BPCHAR, "ab  "), "\"ab  \"");
        assert_eq!(j(NAME, "pg_class"), "\"pg_class\"");
        assert_eq!(j(CHAR, "r"), "\"r\"");
        assert_eq!(
            j(UUID, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
            "\"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11\""
        );
        let mut out = Vec::new();
        write_json(&mut out, TEXT, b"a\xffb");
        assert_eq!(out, "\"a\u{fffd}b\"".as_bytes());
        // Unknown OIDs (interval here) keep their text.
        assert_eq!(j(1186, "1 day 02:00:00"), "\"1 day 02:00:00\"");
    }

    const ALL_OIDS: &[u32] = &[
        BOOL,
        BYTEA,
        CHAR,
        NAME,
        INT8,
        INT2,
        INT4,
        TEXT,
        OID,
        JSON,
        FLOAT4,
        FLOAT8,
        BPCHAR,
        VARCHAR,
        DATE,
        TIME,
        TIMESTAMP,
        TIMESTAMPTZ,
        TIMETZ,
        NUMERIC,
        UUID,
        JSONB,
        JSON_ARRAY,
        BOOL_ARRAY,
        BYTEA_ARRAY,
        CHAR_ARRAY,
        NAME_ARRAY,
        INT2_ARRAY,
        INT4_ARRAY,
        TEXT_ARRAY,
        BPCHAR_ARRAY,
        VARCHAR_ARRAY,
        INT8_ARRAY,
        FLOAT4_ARRAY,
        FLOAT8_ARRAY,
        OID_ARRAY,
        TIMESTAMP_ARRAY,
        DATE_ARRAY,
        TIME_ARRAY,
        TIMESTAMPTZ_ARRAY,
        NUMERIC_ARRAY,
        TIMETZ_ARRAY,
        UUID_ARRAY,
        JSONB_ARRAY,
        0,
        1186,
    ];

    fn check_valid(oid: u32, text: &[u8]) -> Result<(), TestCaseError> {
        let mut out = b"x".to_vec();
        write_json(&mut out, oid, text);
        let body = &out[1..];
        prop_assert!(
            serde_json::from_slice::<serde_json::Value>(body).is_ok(),
            "oid {} input {:?} gave {:?}",
            oid,
            String::from_utf8_lossy(text),
            String::from_utf8_lossy(body)
        );
        prop_assert!(!body.contains(&b'\n') && !body.contains(&b'\r'));
        Ok(())
    }

    proptest! {
        #[test]
        fn output_is_valid_json_for_arbitrary_bytes(
            oid in prop::sample::select(ALL_OIDS),
            text in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            check_valid(oid, &text)?;
        }

        #[test]
        fn output_is_valid_json_for_plausible_text(
            oid in prop::sample::select(ALL_OIDS),
            text in r#"[-+.eE0-9tfNaIiny{}\[\]:=,"\\ \n\x{1}\x{e9}\x{1F600}bx]{0,30}"#,
        ) {
            check_valid(oid, text.as_bytes())?;
        }

        #[test]
        fn output_is_valid_json_for_json_like_text(
            oid in prop::sample::select(&[JSON, JSONB, JSON_ARRAY, JSONB_ARRAY][..]),
            text in r#"[{}\[\]",:\\ud83 0-9.eE+\-truefalsn\n]{0,30}"#,
        ) {
            check_valid(oid, text.as_bytes())?;
        }
    }
}
