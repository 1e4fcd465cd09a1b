//! `json` and `jsonb`: values embedded as raw JSON after an allocation-free
//! syntax check, since one bad value would otherwise break the whole NDJSON
//! object it goes into.

use super::number::parse_number;

/// Embeds json/jsonb text as raw JSON. Returns false, having written
/// nothing, if the text is not valid JSON.
///
/// The server only ever sends valid JSON here, but one bad value would
/// otherwise corrupt a whole NDJSON stream, so the text is checked with a
/// single allocation-free syntax scan (far cheaper than building a
/// serde_json value). The `json` type keeps the input's whitespace, newlines
/// included; those can only sit between tokens, so they become spaces to
/// keep one change per line.
pub(crate) fn write_raw_json(out: &mut Vec<u8>, text: &[u8]) -> bool {
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

#[cfg(test)]
mod tests {
    use super::super::*;

    fn j(oid: u32, text: &str) -> String {
        let mut out = Vec::new();
        write_json(&mut out, oid, text.as_bytes());
        String::from_utf8(out).unwrap()
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
}
