//! `timestamp` and `timestamptz`: the ISO DateStyle text made ISO 8601, with
//! the offsets `to_jsonb()` prints. `date`, `time` and `timetz` need no
//! change and stay plain strings; their tests are here too.

use super::string::{escape_into, write_json_str, write_text_str};

/// timestamp / timestamptz: the ISO DateStyle separates date and time with
/// a space where ISO 8601 wants `T`; timestamptz offsets printed as bare
/// hours (`+00`) get `:00` so they match `to_jsonb()`. Text that does not
/// look like a timestamp (`infinity`) is passed through.
pub(crate) fn write_timestamp(out: &mut Vec<u8>, text: &[u8], with_zone: bool) {
    let Ok(s) = std::str::from_utf8(text) else {
        return write_text_str(out, text);
    };
    let b = s.as_bytes();
    let sep = (1..b.len().saturating_sub(1))
        .find(|&p| b[p] == b' ' && b[p - 1].is_ascii_digit() && b[p + 1].is_ascii_digit());
    let Some(p) = sep else {
        return write_json_str(out, s);
    };
    let (date, rest) = (&s[..p], &s[p + 1..]);
    let (core, era) = match rest.strip_suffix(" BC") {
        Some(c) => (c, " BC"),
        None => (rest, ""),
    };
    out.push(b'"');
    escape_into(out, date);
    out.push(b'T');
    escape_into(out, core);
    if with_zone {
        // The offset starts at the last sign; the time part has none.
        if let Some(q) = core.rfind(['+', '-']) {
            let off = &core.as_bytes()[q + 1..];
            if !off.is_empty() && off.len() <= 2 && off.iter().all(u8::is_ascii_digit) {
                out.extend_from_slice(b":00");
            }
        }
    }
    escape_into(out, era);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::super::*;

    fn j(oid: u32, text: &str) -> String {
        let mut out = Vec::new();
        write_json(&mut out, oid, text.as_bytes());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn dates_and_times() {
        assert_eq!(j(DATE, "2024-03-01"), "\"2024-03-01\"");
        assert_eq!(j(DATE, "infinity"), "\"infinity\"");
        assert_eq!(j(DATE, "0044-03-15 BC"), "\"0044-03-15 BC\"");
        assert_eq!(j(TIME, "12:34:56.789"), "\"12:34:56.789\"");
        assert_eq!(j(TIMETZ, "12:34:56+05:30"), "\"12:34:56+05:30\"");
        assert_eq!(
            j(TIMESTAMP, "2024-03-01 12:34:56.789"),
            "\"2024-03-01T12:34:56.789\""
        );
        assert_eq!(j(TIMESTAMP, "infinity"), "\"infinity\"");
        assert_eq!(j(TIMESTAMP, "-infinity"), "\"-infinity\"");
        assert_eq!(
            j(TIMESTAMP, "0044-03-15 12:00:00 BC"),
            "\"0044-03-15T12:00:00 BC\""
        );
        assert_eq!(
            j(TIMESTAMPTZ, "2024-03-01 12:34:56.789+00"),
            "\"2024-03-01T12:34:56.789+00:00\""
        );
        assert_eq!(
            j(TIMESTAMPTZ, "2024-03-01 12:34:56+05:30"),
            "\"2024-03-01T12:34:56+05:30\""
        );
        assert_eq!(
            j(TIMESTAMPTZ, "2024-03-01 12:34:56-03"),
            "\"2024-03-01T12:34:56-03:00\""
        );
        assert_eq!(
            j(TIMESTAMPTZ, "1900-01-01 00:00:00+00:09:21"),
            "\"1900-01-01T00:00:00+00:09:21\""
        );
        assert_eq!(
            j(TIMESTAMPTZ, "0044-03-15 12:00:00+00 BC"),
            "\"0044-03-15T12:00:00+00:00 BC\""
        );
        assert_eq!(j(TIMESTAMPTZ, "infinity"), "\"infinity\"");
    }
}
