//! From the JSON values the source renders (docs/output-contract.md,
//! "Values") to [`Cell`]s of a column's [`Kind`]: exact or an error, never
//! a silent change of value. Dates and timestamps in the canonical forms
//! the source writes take fast parsers of their own; other forms go
//! through chrono.

use chrono::{DateTime, Datelike, NaiveDate, NaiveDateTime};
use serde_json::Value;

use super::{Cell, Kind};

/// Parses one JSON value as rendered by the source into a cell of `kind`;
/// the error says what the value is and why it does not fit.
pub fn parse_cell(kind: Kind, value: &Value) -> Result<Cell, String> {
    let bad = || not_valid(kind, value);
    Ok(match value {
        Value::Null => Cell::Null,
        Value::String(s) => return parse_str_cell(kind, s),
        Value::Number(n) => match kind {
            Kind::Int16 | Kind::Int32 | Kind::Int64 => {
                int_cell(kind, n.as_i64().ok_or_else(bad)?).ok_or_else(bad)?
            }
            Kind::Float32 | Kind::Float64 => Cell::Float(n.as_f64().ok_or_else(bad)?),
            Kind::Decimal { precision, scale } => {
                Cell::Dec(parse_decimal(&n.to_string(), precision, scale).ok_or_else(bad)?)
            }
            Kind::Text | Kind::Json => Cell::Str(n.to_string().into()),
            Kind::Bool | Kind::Date | Kind::Timestamp | Kind::TimestampTz => return Err(bad()),
        },
        Value::Bool(b) => match kind {
            Kind::Bool => Cell::Bool(*b),
            Kind::Text | Kind::Json => Cell::Str(value.to_string().into()),
            _ => return Err(bad()),
        },
        Value::Array(_) | Value::Object(_) => match kind {
            Kind::Text | Kind::Json => Cell::Str(value.to_string().into()),
            _ => return Err(bad()),
        },
    })
}

/// The error of a value (as JSON text) that is no valid `kind`.
pub fn not_valid(kind: Kind, value: impl std::fmt::Display) -> String {
    format!("{value} is not a valid {}", kind.describe())
}

/// An integer as a cell of an integer `kind`, if it fits.
pub fn int_cell(kind: Kind, n: i64) -> Option<Cell> {
    let fits = match kind {
        Kind::Int16 => i16::try_from(n).is_ok(),
        Kind::Int32 => i32::try_from(n).is_ok(),
        _ => true,
    };
    fits.then_some(Cell::Int(n))
}

/// [`parse_cell`] of a JSON string, without a `Value` around it (the
/// archive reader parses strings straight from the line).
pub fn parse_str_cell(kind: Kind, s: &str) -> Result<Cell, String> {
    let bad = || not_valid(kind, Value::from(s));
    Ok(match kind {
        Kind::Int16 | Kind::Int32 | Kind::Int64 | Kind::Bool => return Err(bad()),
        Kind::Float32 | Kind::Float64 => Cell::Float(match s {
            "NaN" => f64::NAN,
            "Infinity" => f64::INFINITY,
            "-Infinity" => f64::NEG_INFINITY,
            _ => return Err(bad()),
        }),
        Kind::Decimal { precision, scale } => {
            Cell::Dec(parse_decimal(s, precision, scale).ok_or_else(bad)?)
        }
        Kind::Date => Cell::Int(match s {
            "infinity" => i32::MAX as i64,
            "-infinity" => i32::MIN as i64,
            _ => match canonical_date(s.as_bytes()) {
                Some(days) => days,
                None => {
                    let (core, bc) = era(s);
                    let d = NaiveDate::parse_from_str(core, "%Y-%m-%d").map_err(|_| bad())?;
                    let d = if bc {
                        d.with_year(1 - d.year()).ok_or_else(bad)?
                    } else {
                        d
                    };
                    (d - NaiveDate::from_ymd_opt(1970, 1, 1).expect("valid")).num_days()
                }
            },
        }),
        Kind::Timestamp | Kind::TimestampTz => Cell::Int(match s {
            "infinity" => i64::MAX,
            "-infinity" => i64::MIN,
            _ => match canonical_timestamp(s.as_bytes(), kind == Kind::TimestampTz) {
                Some(micros) => micros,
                None => {
                    let (core, bc) = era(s);
                    let t = if kind == Kind::Timestamp {
                        NaiveDateTime::parse_from_str(core, "%Y-%m-%dT%H:%M:%S%.f")
                            .map_err(|_| bad())?
                    } else {
                        DateTime::parse_from_rfc3339(core)
                            .map_err(|_| bad())?
                            .naive_utc()
                    };
                    let t = if bc {
                        t.with_year(1 - t.year()).ok_or_else(bad)?
                    } else {
                        t
                    };
                    t.and_utc().timestamp_micros()
                }
            },
        }),
        Kind::Text => Cell::Str(s.into()),
        Kind::Json => Cell::Str(Value::from(s).to_string().into()),
    })
}

/// The value of the ASCII digits `b` (all of them digits), else `None`.
fn digits(b: &[u8]) -> Option<u32> {
    b.iter().try_fold(0u32, |n, &d| {
        d.is_ascii_digit().then(|| n * 10 + (d - b'0') as u32)
    })
}

/// Days from 0001-01-01 (chrono's day 1) to 1970-01-01.
const UNIX_EPOCH_DAY_FROM_CE: i64 = 719_163;

/// `YYYY-MM-DD` as the source writes dates of years 1-9999 AD (days since
/// 1970); `None` for any other form, left to chrono's general parser
/// (its format parser is what costs: the calendar is chrono's here too).
fn canonical_date(s: &[u8]) -> Option<i64> {
    let [y0, y1, y2, y3, b'-', m0, m1, b'-', d0, d1] = *s else {
        return None;
    };
    let year = digits(&[y0, y1, y2, y3])?;
    if year == 0 {
        return None;
    }
    let date = NaiveDate::from_ymd_opt(year as i32, digits(&[m0, m1])?, digits(&[d0, d1])?)?;
    Some(date.num_days_from_ce() as i64 - UNIX_EPOCH_DAY_FROM_CE)
}

/// `YYYY-MM-DDTHH:MM:SS[.fraction]` followed, for `tz`, by `+HH:MM` or
/// `-HH:MM`: the form the source writes timestamps in (microseconds since
/// 1970, UTC). `None` for any other form (a leap second, `Z`, a BC year,
/// ...), left to chrono's general parser, whose result this equals.
fn canonical_timestamp(s: &[u8], tz: bool) -> Option<i64> {
    if s.len() < 19 || s[10] != b'T' || s[13] != b':' || s[16] != b':' {
        return None;
    }
    let days = canonical_date(&s[..10])?;
    let (hour, minute, second) = (
        digits(&s[11..13])?,
        digits(&s[14..16])?,
        digits(&s[17..19])?,
    );
    if hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let mut rest = &s[19..];
    let mut micros = 0i64;
    if let Some(frac) = rest.strip_prefix(b".") {
        let n = frac.iter().take_while(|b| b.is_ascii_digit()).count();
        if n == 0 || n > 9 {
            return None;
        }
        // Nanoseconds truncated to microseconds, as chrono's are.
        let mut nanos = digits(&frac[..n])? as i64;
        for _ in n..9 {
            nanos *= 10;
        }
        micros = nanos / 1000;
        rest = &frac[n..];
    }
    let offset = if tz {
        let [sign, h0, h1, b':', m0, m1] = *rest else {
            return None;
        };
        let (oh, om) = (digits(&[h0, h1])?, digits(&[m0, m1])?);
        if oh > 23 || om > 59 {
            return None;
        }
        let secs = (oh * 3600 + om * 60) as i64;
        match sign {
            b'+' => secs,
            b'-' => -secs,
            _ => return None,
        }
    } else if rest.is_empty() {
        0
    } else {
        return None;
    };
    let secs = days * 86_400 + (hour * 3600 + minute * 60 + second) as i64 - offset;
    Some(secs * 1_000_000 + micros)
}

/// `"0044-03-15 BC"` -> (`"0044-03-15"`, true).
fn era(s: &str) -> (&str, bool) {
    match s.strip_suffix(" BC") {
        Some(core) => (core, true),
        None => (s, false),
    }
}

/// Parses a decimal text (`-12.5`, `5.00`, `1e-7`) into its unscaled value
/// at `scale`, if it has no more fractional digits than `scale` and fits
/// `precision` digits.
pub fn parse_decimal(text: &str, precision: u8, scale: i8) -> Option<i128> {
    // One pass over the bytes (splitting the text first was 2% of compact).
    let bytes = text.as_bytes();
    let (neg, mut i) = match bytes.first() {
        Some(b'-') => (true, 1),
        Some(b'+') => (false, 1),
        _ => (false, 0),
    };
    let mut unscaled: i128 = 0;
    let (mut digits, mut frac_len, mut dot) = (0usize, 0i32, false);
    while let Some(&b) = bytes.get(i) {
        match b {
            b'0'..=b'9' => {
                unscaled = unscaled.checked_mul(10)?.checked_add((b - b'0') as i128)?;
                digits += 1;
                frac_len += i32::from(dot);
            }
            b'.' if !dot => dot = true,
            b'e' | b'E' => break,
            _ => return None,
        }
        i += 1;
    }
    if digits == 0 {
        return None;
    }
    let exp = if i < bytes.len() {
        text[i + 1..].parse::<i32>().ok()?
    } else {
        0
    };
    // value = unscaled * 10^(exp - frac_len); we want value * 10^scale.
    let shift = exp.checked_sub(frac_len)?.checked_add(scale as i32)?;
    if shift >= 0 {
        unscaled = unscaled.checked_mul(10i128.checked_pow(shift as u32)?)?;
    } else {
        let div = 10i128.checked_pow(shift.checked_neg()? as u32)?;
        if unscaled % div != 0 {
            return None;
        }
        unscaled /= div;
    }
    if unscaled >= 10i128.checked_pow(precision as u32)? {
        return None;
    }
    Some(if neg { -unscaled } else { unscaled })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn decimals_parse_exactly_or_not_at_all() {
        assert_eq!(parse_decimal("5.00", 10, 2), Some(500));
        assert_eq!(parse_decimal("-12.5", 10, 2), Some(-1250));
        assert_eq!(parse_decimal("1e-2", 10, 2), Some(1));
        assert_eq!(parse_decimal("7", 3, 0), Some(7));
        assert_eq!(parse_decimal("1.005", 10, 2), None, "would round");
        assert_eq!(parse_decimal("1000", 3, 0), None, "too many digits");
        assert_eq!(parse_decimal("NaN", 10, 2), None);
        assert_eq!(parse_decimal("", 10, 2), None);
        for bad in [".", "-", "1.2.3", "+-5", "1e", "1e+", "1.5x"] {
            assert_eq!(parse_decimal(bad, 10, 2), None, "{bad}");
        }
        assert_eq!(parse_decimal("+.5", 10, 2), Some(50));
        assert_eq!(parse_decimal("5.", 10, 2), Some(500));
        assert_eq!(parse_decimal("1.5E+1", 10, 2), Some(1500));
        // An exponent out of range is no number, not an overflow.
        assert_eq!(parse_decimal("1e2147483647", 10, 2), None);
        assert_eq!(parse_decimal("1e-2147483648", 10, 2), None);
        assert_eq!(parse_decimal("1e-2147483648", 10, 0), None);
    }

    #[test]
    fn values_parse_into_cells_of_their_kind() {
        assert_eq!(parse_cell(Kind::Int16, &json!(7)), Ok(Cell::Int(7)));
        assert!(parse_cell(Kind::Int16, &json!(70000)).is_err());
        assert_eq!(
            parse_cell(Kind::Float64, &json!("-Infinity")),
            Ok(Cell::Float(f64::NEG_INFINITY))
        );
        assert_eq!(
            parse_cell(Kind::Date, &json!("1970-01-02")),
            Ok(Cell::Int(1))
        );
        assert_eq!(
            parse_cell(Kind::Date, &json!("0001-01-01 BC")),
            parse_cell(Kind::Date, &json!("0000-01-01"))
        );
        assert_eq!(
            parse_cell(Kind::Timestamp, &json!("1970-01-01T00:00:01.5")),
            Ok(Cell::Int(1_500_000))
        );
        assert_eq!(
            parse_cell(Kind::TimestampTz, &json!("1970-01-01T00:00:01+00:00")),
            Ok(Cell::Int(1_000_000))
        );
        assert_eq!(
            parse_cell(Kind::Timestamp, &json!("infinity")),
            Ok(Cell::Int(i64::MAX))
        );
        assert_eq!(parse_cell(Kind::Text, &json!(5)), Ok(Cell::Str("5".into())));
        assert_eq!(
            parse_cell(Kind::Json, &json!({"a": "x\"y"})),
            Ok(Cell::Str(r#"{"a":"x\"y"}"#.into()))
        );
        assert_eq!(parse_cell(Kind::Json, &json!(null)), Ok(Cell::Null));
    }

    /// chrono's parse of a date or timestamp, the general path.
    fn by_chrono(kind: Kind, s: &str) -> Option<i64> {
        let (core, bc) = era(s);
        let t = match kind {
            Kind::Date => {
                let d = NaiveDate::parse_from_str(core, "%Y-%m-%d").ok()?;
                let d = if bc { d.with_year(1 - d.year())? } else { d };
                return Some((d - NaiveDate::from_ymd_opt(1970, 1, 1)?).num_days());
            }
            Kind::Timestamp => NaiveDateTime::parse_from_str(core, "%Y-%m-%dT%H:%M:%S%.f").ok()?,
            _ => DateTime::parse_from_rfc3339(core).ok()?.naive_utc(),
        };
        let t = if bc { t.with_year(1 - t.year())? } else { t };
        Some(t.and_utc().timestamp_micros())
    }

    proptest::proptest! {
        /// The canonical forms' own parser gives chrono's value, and leaves
        /// every form it does not take (or an invalid one) to chrono.
        #[test]
        fn canonical_dates_and_timestamps_parse_as_chrono_does(
            year in 0u32..10_000, month in 0u32..14, day in 0u32..33,
            hour in 0u32..25, minute in 0u32..61, second in 0u32..61,
            frac in proptest::option::of("[0-9]{1,10}"),
            offset in proptest::option::of((proptest::bool::ANY, 0u32..25, 0u32..61)),
            tz in proptest::bool::ANY,
        ) {
            let date = format!("{year:04}-{month:02}-{day:02}");
            if let Some(days) = canonical_date(date.as_bytes()) {
                proptest::prop_assert_eq!(Some(days), by_chrono(Kind::Date, &date), "{}", date);
            }
            let mut ts = format!("{date}T{hour:02}:{minute:02}:{second:02}");
            if let Some(f) = &frac {
                ts = format!("{ts}.{f}");
            }
            if let Some((minus, h, m)) = offset {
                ts = format!("{ts}{}{h:02}:{m:02}", if minus { '-' } else { '+' });
            }
            let kind = if tz { Kind::TimestampTz } else { Kind::Timestamp };
            if let Some(micros) = canonical_timestamp(ts.as_bytes(), tz) {
                proptest::prop_assert_eq!(Some(micros), by_chrono(kind, &ts), "{}", ts);
            }
            // Whichever parser takes it, the cell is chrono's value.
            let cell = parse_str_cell(kind, &ts).ok();
            proptest::prop_assert_eq!(cell, by_chrono(kind, &ts).map(Cell::Int), "{}", ts);
        }
    }

    #[test]
    fn the_forms_the_source_writes_take_the_canonical_parsers() {
        assert_eq!(
            canonical_date(b"2024-02-29"),
            by_chrono(Kind::Date, "2024-02-29")
        );
        assert_eq!(canonical_date(b"2023-02-29"), None);
        let ts = "2026-11-05T11:00:01.990001+01:30";
        assert_eq!(
            canonical_timestamp(ts.as_bytes(), true),
            by_chrono(Kind::TimestampTz, ts)
        );
        let ts = "1969-12-31T23:59:59.5";
        assert_eq!(canonical_timestamp(ts.as_bytes(), false), Some(-500_000));
        // Left to chrono: a BC year, a leap second, `Z`.
        assert_eq!(canonical_timestamp(b"0044-03-15T00:00:00 BC", false), None);
        assert_eq!(
            canonical_timestamp(b"2016-12-31T23:59:60+00:00", true),
            None
        );
        assert_eq!(canonical_timestamp(b"2016-12-31T23:59:59Z", true), None);
    }
}
