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
//! * `json`, `jsonb`: embedded as raw JSON (see [`write_raw_json`] for why it
//!   is still checked).
//! * `timestamp`: `2024-03-01 12:34:56.789` becomes `"2024-03-01T12:34:56.789"`.
//! * `timestamptz`: `2024-03-01 12:34:56.789+00` becomes
//!   `"2024-03-01T12:34:56.789+00:00"`, as `to_jsonb()` prints it in UTC.
//! * `bytea`: `\x0102` becomes the padded standard base64 `"AQI="`.
//! * arrays of all the above: JSON arrays (nested for multi-dimensional
//!   arrays, bounds decorations such as `[0:2]=` dropped), elements mapped by
//!   their element type, `NULL` elements as `null`.
//! * text-like types, `date`, `time`, `timetz`, `uuid` and every other OID:
//!   a JSON string of the text as printed.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;

// The OIDs of the built-in types rendered here (`pg_type.oid`): fixed in
// every Postgres release, so they are constants, not catalog lookups.

/// `bool`: JSON `true` / `false`.
pub const BOOL: u32 = 16;
/// `bytea`: a base64 JSON string.
pub const BYTEA: u32 = 17;
/// `"char"`, the one-byte internal type: a JSON string.
pub const CHAR: u32 = 18;
/// `name`, the catalogs' identifier type: a JSON string.
pub const NAME: u32 = 19;
/// `int8` (`bigint`): a JSON number.
pub const INT8: u32 = 20;
/// `int2` (`smallint`): a JSON number.
pub const INT2: u32 = 21;
/// `int4` (`integer`): a JSON number.
pub const INT4: u32 = 23;
/// `text`: a JSON string.
pub const TEXT: u32 = 25;
/// `oid`: a JSON number.
pub const OID: u32 = 26;
/// `json`: embedded as JSON, its whitespace kept (newlines made spaces).
pub const JSON: u32 = 114;
/// `float4` (`real`): a JSON number; NaN and the infinities a string.
pub const FLOAT4: u32 = 700;
/// `float8` (`double precision`): a JSON number; NaN and the infinities a string.
pub const FLOAT8: u32 = 701;
/// `bpchar` (`char(n)`): a JSON string, blank padding kept.
pub const BPCHAR: u32 = 1042;
/// `varchar`: a JSON string.
pub const VARCHAR: u32 = 1043;
/// `date`: a JSON string, `2024-03-01`.
pub const DATE: u32 = 1082;
/// `time`: a JSON string, `12:34:56.789`.
pub const TIME: u32 = 1083;
/// `timestamp`: an ISO 8601 JSON string without offset.
pub const TIMESTAMP: u32 = 1114;
/// `timestamptz`: an ISO 8601 JSON string in UTC, `+00:00`.
pub const TIMESTAMPTZ: u32 = 1184;
/// `timetz`: a JSON string, `12:34:56+02`.
pub const TIMETZ: u32 = 1266;
/// `numeric`: a JSON number up to 15 significant digits (a double reads
/// it back exactly), else a JSON string.
pub const NUMERIC: u32 = 1700;
/// `uuid`: a JSON string.
pub const UUID: u32 = 2950;
/// `jsonb`: embedded as JSON.
pub const JSONB: u32 = 3802;

/// `json[]`: a JSON array of [`JSON`]'s values.
pub const JSON_ARRAY: u32 = 199;
/// `bool[]`: a JSON array of [`BOOL`]'s values.
pub const BOOL_ARRAY: u32 = 1000;
/// `bytea[]`: a JSON array of [`BYTEA`]'s values.
pub const BYTEA_ARRAY: u32 = 1001;
/// `"char"[]`: a JSON array of [`CHAR`]'s values.
pub const CHAR_ARRAY: u32 = 1002;
/// `name[]`: a JSON array of [`NAME`]'s values.
pub const NAME_ARRAY: u32 = 1003;
/// `int2[]`: a JSON array of [`INT2`]'s values.
pub const INT2_ARRAY: u32 = 1005;
/// `int4[]`: a JSON array of [`INT4`]'s values.
pub const INT4_ARRAY: u32 = 1007;
/// `text[]`: a JSON array of [`TEXT`]'s values.
pub const TEXT_ARRAY: u32 = 1009;
/// `bpchar[]`: a JSON array of [`BPCHAR`]'s values.
pub const BPCHAR_ARRAY: u32 = 1014;
/// `varchar[]`: a JSON array of [`VARCHAR`]'s values.
pub const VARCHAR_ARRAY: u32 = 1015;
/// `int8[]`: a JSON array of [`INT8`]'s values.
pub const INT8_ARRAY: u32 = 1016;
/// `float4[]`: a JSON array of [`FLOAT4`]'s values.
pub const FLOAT4_ARRAY: u32 = 1021;
/// `float8[]`: a JSON array of [`FLOAT8`]'s values.
pub const FLOAT8_ARRAY: u32 = 1022;
/// `oid[]`: a JSON array of [`OID`]'s values.
pub const OID_ARRAY: u32 = 1028;
/// `timestamp[]`: a JSON array of [`TIMESTAMP`]'s values.
pub const TIMESTAMP_ARRAY: u32 = 1115;
/// `date[]`: a JSON array of [`DATE`]'s values.
pub const DATE_ARRAY: u32 = 1182;
/// `time[]`: a JSON array of [`TIME`]'s values.
pub const TIME_ARRAY: u32 = 1183;
/// `timestamptz[]`: a JSON array of [`TIMESTAMPTZ`]'s values.
pub const TIMESTAMPTZ_ARRAY: u32 = 1185;
/// `numeric[]`: a JSON array of [`NUMERIC`]'s values.
pub const NUMERIC_ARRAY: u32 = 1231;
/// `timetz[]`: a JSON array of [`TIMETZ`]'s values.
pub const TIMETZ_ARRAY: u32 = 1270;
/// `uuid[]`: a JSON array of [`UUID`]'s values.
pub const UUID_ARRAY: u32 = 2951;
/// `jsonb[]`: a JSON array of [`JSONB`]'s values.
pub const JSONB_ARRAY: u32 = 3807;

/// The element type of a supported array type, or `None` if `oid` is not one.
pub fn array_element_type(oid: u32) -> Option<u32> {
    Some(match oid {
        JSON_ARRAY => JSON,
        BOOL_ARRAY => BOOL,
        BYTEA_ARRAY => BYTEA,
        CHAR_ARRAY => CHAR,
        NAME_ARRAY => NAME,
        INT2_ARRAY => INT2,
        INT4_ARRAY => INT4,
        TEXT_ARRAY => TEXT,
        BPCHAR_ARRAY => BPCHAR,
        VARCHAR_ARRAY => VARCHAR,
        INT8_ARRAY => INT8,
        FLOAT4_ARRAY => FLOAT4,
        FLOAT8_ARRAY => FLOAT8,
        OID_ARRAY => OID,
        TIMESTAMP_ARRAY => TIMESTAMP,
        DATE_ARRAY => DATE,
        TIME_ARRAY => TIME,
        TIMESTAMPTZ_ARRAY => TIMESTAMPTZ,
        NUMERIC_ARRAY => NUMERIC,
        TIMETZ_ARRAY => TIMETZ,
        UUID_ARRAY => UUID,
        JSONB_ARRAY => JSONB,
        _ => return None,
    })
}

/// Every type OID below this is built into Postgres (FirstNormalObjectId);
/// user-defined types (enums, domains, composites, extension types) are above.
pub const FIRST_NORMAL_OID: u32 = 16384;

/// The array type of a supported element type (the inverse of [`array_element_type`]).
pub fn array_type_of(elem: u32) -> Option<u32> {
    const ARRAYS: [u32; 22] = [
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
    ];
    ARRAYS
        .into_iter()
        .find(|&a| array_element_type(a) == Some(elem))
}

/// Appends an hstore value (`"a"=>"1", "b"=>NULL`) as a JSON object of
/// strings and nulls; anything unparseable becomes a JSON string of the text.
pub fn write_hstore(out: &mut Vec<u8>, text: &[u8]) {
    let start = out.len();
    if parse_hstore(out, text).is_none() {
        out.truncate(start);
        write_text_str(out, text);
    }
}

fn parse_hstore(out: &mut Vec<u8>, text: &[u8]) -> Option<()> {
    // One quoted hstore token, unescaping \" and \\.
    fn token(text: &[u8], i: &mut usize) -> Option<Vec<u8>> {
        if text.get(*i) != Some(&b'"') {
            return None;
        }
        *i += 1;
        let mut v = Vec::new();
        loop {
            match *text.get(*i)? {
                b'"' => {
                    *i += 1;
                    return Some(v);
                }
                b'\\' => {
                    v.push(*text.get(*i + 1)?);
                    *i += 2;
                }
                c => {
                    v.push(c);
                    *i += 1;
                }
            }
        }
    }
    let skip_ws = |i: &mut usize| {
        while text.get(*i).is_some_and(|c| c.is_ascii_whitespace()) {
            *i += 1;
        }
    };
    let mut i = 0;
    let mut first = true;
    let mut wrote_any = false;
    out.push(b'{');
    skip_ws(&mut i);
    while i < text.len() {
        if !first {
            if text.get(i) != Some(&b',') {
                return None;
            }
            i += 1;
            skip_ws(&mut i);
        }
        first = false;
        let key = token(text, &mut i)?;
        skip_ws(&mut i);
        if text.get(i..i + 2) != Some(b"=>") {
            return None;
        }
        i += 2;
        skip_ws(&mut i);
        if !wrote_any {
            wrote_any = true;
        } else {
            out.push(b',');
        }
        write_json_str(out, std::str::from_utf8(&key).ok()?);
        out.push(b':');
        if text.get(i..i + 4) == Some(b"NULL") {
            i += 4;
            out.extend_from_slice(b"null");
        } else {
            let value = token(text, &mut i)?;
            write_json_str(out, std::str::from_utf8(&value).ok()?);
        }
        skip_ws(&mut i);
    }
    out.push(b'}');
    Some(())
}

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

/// Appends `s` as a JSON string literal (quotes and escapes) to `out`.
pub fn write_json_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    escape_into(out, s);
    out.push(b'"');
}

/// Writes the escaped body of a JSON string, copying unescaped runs whole.
fn escape_into(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..=0x1f => &[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[(b >> 4) as usize],
                HEX[(b & 0xf) as usize],
            ],
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        out.extend_from_slice(esc);
        run = i + 1;
    }
    out.extend_from_slice(&bytes[run..]);
}

/// The server sends UTF-8, but a value that is not must still become a
/// string rather than a panic; the lossy copy is only paid in that case.
fn write_text_str(out: &mut Vec<u8>, text: &[u8]) {
    match std::str::from_utf8(text) {
        Ok(s) => write_json_str(out, s),
        Err(_) => write_json_str(out, &String::from_utf8_lossy(text)),
    }
}

/// What [`parse_number`] learned about a JSON-grammar number.
struct NumberShape {
    has_frac: bool,
    has_exp: bool,
    /// Integer-part digits after leading zeros.
    int_digits: usize,
    /// Digits from the first non-zero digit to the end of the mantissa.
    sig_digits: usize,
    /// Zeros between the decimal point and the first non-zero digit, when the
    /// integer part is zero.
    frac_leading_zeros: usize,
    exp: i64,
}

impl NumberShape {
    /// Whether a double-based JSON reader accepts the value: overflow to
    /// infinity is rejected by some (serde_json among them), while underflow
    /// just rounds towards zero. Only values within a factor of ten of
    /// f64::MAX pay for a real parse.
    fn fits_f64(&self, text: &[u8]) -> bool {
        let mag = if self.int_digits > 0 {
            self.int_digits as i64
        } else {
            -(self.frac_leading_zeros as i64)
        };
        // The value is below 10^(mag + exp).
        match mag.saturating_add(self.exp) {
            ..=308 => true,
            309 => std::str::from_utf8(text)
                .ok()
                .and_then(|s| s.parse::<f64>().ok())
                .is_some_and(f64::is_finite),
            _ => false,
        }
    }
}

/// Checks `text` against the JSON number grammar
/// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?` and measures it.
fn parse_number(text: &[u8]) -> Option<NumberShape> {
    let mut i = 0;
    let n = text.len();
    if text.first() == Some(&b'-') {
        i += 1;
    }
    let digits = |i: &mut usize| {
        let s = *i;
        while *i < n && text[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - s
    };
    let int_start = i;
    let int_len = digits(&mut i);
    if int_len == 0 || (int_len > 1 && text[int_start] == b'0') {
        return None;
    }
    let int_part = &text[int_start..i];
    let int_digits = int_part.iter().skip_while(|&&b| b == b'0').count();
    let mut shape = NumberShape {
        has_frac: false,
        has_exp: false,
        int_digits,
        sig_digits: int_digits,
        frac_leading_zeros: 0,
        exp: 0,
    };
    if i < n && text[i] == b'.' {
        i += 1;
        let fs = i;
        if digits(&mut i) == 0 {
            return None;
        }
        let frac = &text[fs..i];
        shape.has_frac = true;
        if int_digits > 0 {
            shape.sig_digits += frac.len();
        } else {
            let zeros = frac.iter().take_while(|&&b| b == b'0').count();
            shape.frac_leading_zeros = zeros;
            shape.sig_digits = frac.len() - zeros;
        }
    }
    if i < n && (text[i] == b'e' || text[i] == b'E') {
        i += 1;
        let neg = match text.get(i) {
            Some(b'-') => {
                i += 1;
                true
            }
            Some(b'+') => {
                i += 1;
                false
            }
            _ => false,
        };
        let es = i;
        if digits(&mut i) == 0 {
            return None;
        }
        let e = text[es..i].iter().fold(0i64, |acc, &d| {
            acc.saturating_mul(10).saturating_add(i64::from(d - b'0'))
        });
        shape.has_exp = true;
        shape.exp = if neg { -e } else { e };
    }
    (i == n).then_some(shape)
}

/// Embeds json/jsonb text as raw JSON. Returns false, having written
/// nothing, if the text is not valid JSON.
///
/// The server only ever sends valid JSON here, but one bad value would
/// otherwise corrupt a whole NDJSON stream, so the text is checked with a
/// single allocation-free syntax scan (far cheaper than building a
/// serde_json value). The `json` type keeps the input's whitespace, newlines
/// included; those can only sit between tokens, so they become spaces to
/// keep one change per line.
fn write_raw_json(out: &mut Vec<u8>, text: &[u8]) -> bool {
    if !is_valid_json(text) {
        return false;
    }
    let start = out.len();
    out.extend_from_slice(text);
    for b in &mut out[start..] {
        if *b == b'\n' || *b == b'\r' {
            *b = b' ';
        }
    }
    true
}

/// Nesting stack of one bit per level (object or array): the first 64
/// levels live in a word, deeper ones spill to a Vec.
struct NestStack {
    low: u64,
    depth: usize,
    spill: Vec<bool>,
}

impl NestStack {
    fn push(&mut self, is_obj: bool) {
        if self.depth < 64 {
            self.low = (self.low & !(1 << self.depth)) | (u64::from(is_obj) << self.depth);
        } else {
            self.spill.push(is_obj);
        }
        self.depth += 1;
    }

    fn top_is_obj(&self) -> bool {
        let d = self.depth - 1;
        if d < 64 {
            self.low & (1 << d) != 0
        } else {
            self.spill[d - 64]
        }
    }

    fn pop(&mut self) {
        self.depth -= 1;
        if self.depth >= 64 {
            self.spill.pop();
        }
    }
}

/// RFC 8259 syntax check, also rejecting lone UTF-16 surrogate escapes
/// (which common readers refuse). Iterative, so deep nesting cannot
/// overflow the stack.
fn is_valid_json(text: &[u8]) -> bool {
    if std::str::from_utf8(text).is_err() {
        return false;
    }
    let n = text.len();
    let ws = |i: &mut usize| {
        while *i < n && matches!(text[*i], b' ' | b'\t' | b'\n' | b'\r') {
            *i += 1;
        }
    };
    let mut stack = NestStack {
        low: 0,
        depth: 0,
        spill: Vec::new(),
    };
    let mut i = 0;
    // Reads `"key" :` and leaves `i` at the value.
    let key = |i: &mut usize| -> bool {
        ws(i);
        if !scan_json_string(text, i) {
            return false;
        }
        ws(i);
        if text.get(*i) != Some(&b':') {
            return false;
        }
        *i += 1;
        true
    };
    'value: loop {
        ws(&mut i);
        let Some(&b) = text.get(i) else {
            return false;
        };
        match b {
            b'{' => {
                i += 1;
                ws(&mut i);
                if text.get(i) == Some(&b'}') {
                    i += 1;
                } else {
                    stack.push(true);
                    if !key(&mut i) {
                        return false;
                    }
                    continue 'value;
                }
            }
            b'[' => {
                i += 1;
                ws(&mut i);
                if text.get(i) == Some(&b']') {
                    i += 1;
                } else {
                    stack.push(false);
                    continue 'value;
                }
            }
            b'"' => {
                if !scan_json_string(text, &mut i) {
                    return false;
                }
            }
            b't' | b'f' | b'n' => {
                let lit: &[u8] = match b {
                    b't' => b"true",
                    b'f' => b"false",
                    _ => b"null",
                };
                if !text[i..].starts_with(lit) {
                    return false;
                }
                i += lit.len();
            }
            b'-' | b'0'..=b'9' => {
                let s = i;
                while i < n && matches!(text[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
                    i += 1;
                }
                if parse_number(&text[s..i]).is_none() {
                    return false;
                }
            }
            _ => return false,
        }
        // After a complete value: close containers or move to the next item.
        loop {
            ws(&mut i);
            if stack.depth == 0 {
                return i == n;
            }
            match text.get(i) {
                Some(b',') => {
                    i += 1;
                    if stack.top_is_obj() && !key(&mut i) {
                        return false;
                    }
                    continue 'value;
                }
                Some(b'}') if stack.top_is_obj() => {
                    i += 1;
                    stack.pop();
                }
                Some(b']') if !stack.top_is_obj() => {
                    i += 1;
                    stack.pop();
                }
                _ => return false,
            }
        }
    }
}

/// Skips a JSON string starting at `text[*i] == b'"'`. The caller has
/// already checked that `text` is UTF-8.
fn scan_json_string(text: &[u8], i: &mut usize) -> bool {
    if text.get(*i) != Some(&b'"') {
        return false;
    }
    *i += 1;
    let hex4 = |at: usize| -> Option<u16> {
        let h = text.get(at..at + 4)?;
        let s = std::str::from_utf8(h).ok()?;
        if !h.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        u16::from_str_radix(s, 16).ok()
    };
    loop {
        let Some(&b) = text.get(*i) else {
            return false;
        };
        match b {
            b'"' => {
                *i += 1;
                return true;
            }
            b'\\' => match text.get(*i + 1) {
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => *i += 2,
                Some(b'u') => {
                    let Some(u) = hex4(*i + 2) else {
                        return false;
                    };
                    *i += 6;
                    match u {
                        0xD800..=0xDBFF => {
                            if text.get(*i..*i + 2) != Some(b"\\u") {
                                return false;
                            }
                            match hex4(*i + 2) {
                                Some(0xDC00..=0xDFFF) => *i += 6,
                                _ => return false,
                            }
                        }
                        0xDC00..=0xDFFF => return false,
                        _ => {}
                    }
                }
                _ => return false,
            },
            0..=0x1f => return false,
            _ => *i += 1,
        }
    }
}

/// timestamp / timestamptz: the ISO DateStyle separates date and time with
/// a space where ISO 8601 wants `T`; timestamptz offsets printed as bare
/// hours (`+00`) get `:00` so they match `to_jsonb()`. Text that does not
/// look like a timestamp (`infinity`) is passed through.
fn write_timestamp(out: &mut Vec<u8>, text: &[u8], with_zone: bool) {
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

/// bytea in hex output format (`\x0a0b`) to a base64 JSON string, converted
/// in stack-sized chunks so no buffer is allocated. Returns false, having
/// written nothing, if the text is not `\x` followed by an even number of
/// hex digits.
fn write_bytea(out: &mut Vec<u8>, text: &[u8]) -> bool {
    let Some(hex) = text.strip_prefix(b"\\x") else {
        return false;
    };
    if hex.len() % 2 != 0 {
        return false;
    }
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let start = out.len();
    out.push(b'"');
    // 48 bytes is a multiple of 3, so only the last chunk gets padding.
    let mut raw = [0u8; 48];
    let mut enc = [0u8; 64];
    for chunk in hex.chunks(96) {
        let len = chunk.len() / 2;
        for (k, pair) in chunk.chunks_exact(2).enumerate() {
            match (nibble(pair[0]), nibble(pair[1])) {
                (Some(h), Some(l)) => raw[k] = (h << 4) | l,
                _ => {
                    out.truncate(start);
                    return false;
                }
            }
        }
        match BASE64.encode_slice(&raw[..len], &mut enc) {
            Ok(w) => out.extend_from_slice(&enc[..w]),
            Err(_) => {
                out.truncate(start);
                return false;
            }
        }
    }
    out.push(b'"');
    true
}

/// Writes a Postgres array literal as a JSON array. `None` means the text is
/// malformed; the caller then discards the partial output.
///
/// Grammar (array_out with the `,` delimiter all supported types use):
/// optional `[lo:hi]...=` bounds, then `{` items `}` where an item is a
/// nested `{...}`, a `"quoted"` element with backslash escapes, or an
/// unquoted element in which `NULL` (any case) means null.
fn write_array(out: &mut Vec<u8>, elem: u32, text: &[u8]) -> Option<()> {
    let n = text.len();
    let mut i = 0;
    if text.first() == Some(&b'[') {
        let eq = text.iter().position(|&b| b == b'=')?;
        if !text[..eq]
            .iter()
            .all(|&b| matches!(b, b'[' | b']' | b':' | b'-' | b'0'..=b'9'))
        {
            return None;
        }
        i = eq + 1;
    }
    let ws = |i: &mut usize| {
        while *i < n && text[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    ws(&mut i);
    if text.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    out.push(b'[');
    let mut depth = 1usize;
    // Reused for every element that needs unescaping.
    let mut scratch: Vec<u8> = Vec::new();
    // true right after `{` or `,`: an item (or `}` after `{`) must follow.
    let mut want_item = true;
    let mut after_open = true;
    while depth > 0 {
        ws(&mut i);
        let &b = text.get(i)?;
        if want_item {
            match b {
                b'}' if after_open => {
                    i += 1;
                    out.push(b']');
                    depth -= 1;
                    want_item = false;
                    after_open = false;
                }
                b'{' => {
                    i += 1;
                    out.push(b'[');
                    depth += 1;
                    after_open = true;
                }
                b'"' => {
                    i += 1;
                    scratch.clear();
                    loop {
                        match *text.get(i)? {
                            b'"' => break,
                            b'\\' => {
                                scratch.push(*text.get(i + 1)?);
                                i += 2;
                            }
                            c => {
                                scratch.push(c);
                                i += 1;
                            }
                        }
                    }
                    i += 1;
                    write_json(out, elem, &scratch);
                    want_item = false;
                }
                b',' | b'}' => return None,
                _ => {
                    let s = i;
                    let mut escaped = false;
                    while i < n && !matches!(text[i], b',' | b'}' | b'{' | b'"') {
                        if text[i] == b'\\' {
                            escaped = true;
                            i += 1;
                        }
                        i += 1;
                    }
                    if i > n {
                        return None;
                    }
                    let raw = &text[s..i];
                    if escaped {
                        scratch.clear();
                        // Escaped bytes are kept even if they are whitespace.
                        let mut keep = 0;
                        let mut k = 0;
                        while k < raw.len() {
                            if raw[k] == b'\\' {
                                k += 1;
                                scratch.push(raw[k]);
                                keep = scratch.len();
                            } else {
                                scratch.push(raw[k]);
                            }
                            k += 1;
                        }
                        let trimmed = scratch.trim_ascii_end().len().max(keep);
                        write_json(out, elem, &scratch[..trimmed]);
                    } else {
                        let raw = raw.trim_ascii_end();
                        if raw.eq_ignore_ascii_case(b"NULL") {
                            out.extend_from_slice(b"null");
                        } else {
                            write_json(out, elem, raw);
                        }
                    }
                    want_item = false;
                }
            }
        } else {
            match b {
                b',' => {
                    i += 1;
                    out.push(b',');
                    want_item = true;
                    after_open = false;
                }
                b'}' => {
                    i += 1;
                    out.push(b']');
                    depth -= 1;
                }
                _ => return None,
            }
        }
    }
    ws(&mut i);
    (i == n).then_some(())
}

#[cfg(test)]
mod hstore_tests {
    use super::*;

    /// Renders after existing output, as inside a row object.
    fn hstore(text: &str) -> String {
        let mut out = b"{\"h\":".to_vec();
        write_hstore(&mut out, text.as_bytes());
        let s = String::from_utf8(out[5..].to_vec()).unwrap();
        out.push(b'}');
        serde_json::from_slice::<serde_json::Value>(&out).expect("valid JSON");
        s
    }

    #[test]
    fn hstore_becomes_an_object_of_strings_and_nulls() {
        assert_eq!(hstore(r#""a"=>"1", "b"=>NULL"#), r#"{"a":"1","b":null}"#);
        assert_eq!(hstore(r#""q\"k"=>"x\\y""#), r#"{"q\"k":"x\\y"}"#);
        assert_eq!(hstore(""), "{}");
        assert_eq!(hstore("garbage"), r#""garbage""#);
    }

    #[test]
    fn array_types_invert_element_types() {
        assert_eq!(array_type_of(INT4), Some(INT4_ARRAY));
        assert_eq!(array_type_of(TEXT), Some(TEXT_ARRAY));
        assert_eq!(array_type_of(12345), None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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

    #[test]
    fn json_embedding() {
        assert_eq!(
            j(JSONB, r#"{"a": [1, 2.5, null, true]}"#),
            r#"{"a": [1, 2.5, null, true]}"#
        );
        assert_eq!(
            j(JSON, "{\n  \"a\": \"x\\ny\"\r\n}"),
            "{   \"a\": \"x\\ny\"  }"
        );
        assert_eq!(j(JSON, "  [ ]  "), "  [ ]  ");
        assert_eq!(j(JSONB, "\"\\ud83d\\ude00\""), "\"\\ud83d\\ude00\"");
        assert_eq!(j(JSONB, "12"), "12");
        assert_eq!(j(JSONB, "{\"a\":{\"b\":[{}]}}"), "{\"a\":{\"b\":[{}]}}");
        // Not JSON: kept, as a string.
        assert_eq!(j(JSON, "{bad"), "\"{bad\"");
        assert_eq!(j(JSON, "[1,]"), "\"[1,]\"");
        assert_eq!(j(JSON, "{\"a\"}"), "\"{\\\"a\\\"}\"");
        assert_eq!(j(JSON, "\"\\ud800\""), "\"\\\"\\\\ud800\\\"\"");
        assert_eq!(j(JSON, ""), "\"\"");
        assert_eq!(j(JSON, "1 2"), "\"1 2\"");
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert_eq!(j(JSONB, &deep), deep);
        let deep_obj = format!("{}1{}", "{\"k\":[".repeat(100), "]}".repeat(100));
        assert_eq!(j(JSONB, &deep_obj), deep_obj);
        let unbalanced = format!("{}]}}", "[".repeat(70));
        assert!(j(JSONB, &unbalanced).starts_with('"'));
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

    #[test]
    fn bytea() {
        assert_eq!(j(BYTEA, "\\x"), "\"\"");
        assert_eq!(j(BYTEA, "\\x0102"), "\"AQI=\"");
        assert_eq!(j(BYTEA, "\\xDEADbeef"), "\"3q2+7w==\"");
        let long: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let hex: String = long.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            j(BYTEA, &format!("\\x{hex}")),
            format!("\"{}\"", BASE64.encode(&long))
        );
        assert_eq!(j(BYTEA, "\\x012"), "\"\\\\x012\"");
        assert_eq!(j(BYTEA, "\\xzz"), "\"\\\\xzz\"");
        assert_eq!(j(BYTEA, "abc"), "\"abc\"");
    }

    #[test]
    fn arrays() {
        assert_eq!(j(INT4_ARRAY, "{1,2,3}"), "[1,2,3]");
        assert_eq!(j(INT4_ARRAY, "{}"), "[]");
        assert_eq!(j(INT4_ARRAY, "{{1,2},{3,4}}"), "[[1,2],[3,4]]");
        assert_eq!(j(INT4_ARRAY, "[0:2]={1,NULL,3}"), "[1,null,3]");
        assert_eq!(j(INT4_ARRAY, "[1:1][-2:-1]={{1,2}}"), "[[1,2]]");
        assert_eq!(
            j(
                TEXT_ARRAY,
                r#"{"a b","x\"y",NULL,"NULL",plain,"back\\slash"}"#
            ),
            r#"["a b","x\"y",null,"NULL","plain","back\\slash"]"#
        );
        assert_eq!(j(TEXT_ARRAY, "{\"\"}"), "[\"\"]");
        assert_eq!(j(BOOL_ARRAY, "{t,f,NULL}"), "[true,false,null]");
        assert_eq!(
            j(FLOAT8_ARRAY, "{1.5,NaN,-Infinity}"),
            r#"[1.5,"NaN","-Infinity"]"#
        );
        assert_eq!(j(NUMERIC_ARRAY, "{19.990,NaN}"), r#"[19.990,"NaN"]"#);
        assert_eq!(
            j(JSONB_ARRAY, r#"{"{\"a\": 1}","[1, 2]",NULL}"#),
            r#"[{"a": 1},[1, 2],null]"#
        );
        assert_eq!(
            j(TIMESTAMPTZ_ARRAY, r#"{"2024-03-01 12:34:56+00",infinity}"#),
            r#"["2024-03-01T12:34:56+00:00","infinity"]"#
        );
        assert_eq!(j(BYTEA_ARRAY, r#"{"\\x0102",NULL}"#), r#"["AQI=",null]"#);
        assert_eq!(
            j(DATE_ARRAY, "{2024-03-01,infinity}"),
            r#"["2024-03-01","infinity"]"#
        );
        assert_eq!(
            j(UUID_ARRAY, "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}"),
            r#"["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]"#
        );
        assert_eq!(j(TEXT_ARRAY, r"{a\,b}"), r#"["a,b"]"#);
        assert_eq!(j(TEXT_ARRAY, r"{a\  ,b }"), r#"["a ","b"]"#);
        // Malformed: the whole text as a string.
        for bad in [
            "{1,2", "{1,,2}", "{,}", "1,2}", "{1}}", "{\"a}", "[0:2]{1}", "{1} x", "{1,}",
        ] {
            assert_eq!(
                j(INT4_ARRAY, bad),
                serde_json::to_string(bad).unwrap(),
                "{bad}"
            );
        }
    }

    #[test]
    fn json_str_escapes() {
        let mut out = Vec::new();
        write_json_str(&mut out, "\u{8}\u{c}\u{1f}\u{7f}\u{2028}");
        assert_eq!(out, b"\"\\b\\f\\u001f\x7f\xe2\x80\xa8\"");
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

        #[test]
        fn json_str_round_trips(s in any::<String>()) {
            let mut out = Vec::new();
            write_json_str(&mut out, &s);
            prop_assert_eq!(serde_json::from_slice::<String>(&out).unwrap(), s);
        }

        #[test]
        fn text_arrays_round_trip(items in proptest::collection::vec(proptest::option::of(any::<String>()), 0..6)) {
            // Build the literal the way array_out does: quote everything.
            let mut lit = String::from("{");
            for (k, it) in items.iter().enumerate() {
                if k > 0 { lit.push(','); }
                match it {
                    None => lit.push_str("NULL"),
                    Some(s) => {
                        lit.push('"');
                        for c in s.chars() {
                            if c == '"' || c == '\\' { lit.push('\\'); }
                            lit.push(c);
                        }
                        lit.push('"');
                    }
                }
            }
            lit.push('}');
            let mut out = Vec::new();
            write_json(&mut out, TEXT_ARRAY, lit.as_bytes());
            let got: Vec<Option<String>> = serde_json::from_slice(&out).unwrap();
            prop_assert_eq!(got, items);
        }
    }
}
