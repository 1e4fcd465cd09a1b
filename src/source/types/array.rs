//! Arrays: a Postgres array literal (`{1,NULL,3}`, nested, with optional
//! bounds) as a JSON array whose elements are rendered by their element
//! type through [`super::write_json`].

use super::write_json;

/// Writes a Postgres array literal as a JSON array. `None` means the text is
/// malformed; the caller then discards the partial output.
///
/// Grammar (array_out with the `,` delimiter all supported types use):
/// optional `[lo:hi]...=` bounds, then `{` items `}` where an item is a
/// nested `{...}`, a `"quoted"` element with backslash escapes, or an
/// unquoted element in which `NULL` (any case) means null.
pub(crate) fn write_array(out: &mut Vec<u8>, elem: u32, text: &[u8]) -> Option<()> {
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
mod tests {
    use proptest::prelude::*;

    use super::super::*;

    fn j(oid: u32, text: &str) -> String {
        let mut out = Vec::new();
        write_json(&mut out, oid, text.as_bytes());
        String::from_utf8(out).unwrap()
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

    proptest! {
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
