//! JSON string literals: the column names, every text-like value, and the
//! fallback of every other type whose text is not the shape its type
//! promises (so nothing is lost and no line is broken).

/// Appends `s` as a JSON string literal (quotes and escapes) to `out`.
pub fn write_json_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    escape_into(out, s);
    out.push(b'"');
}

/// Writes the escaped body of a JSON string, copying unescaped runs whole.
pub(crate) fn escape_into(out: &mut Vec<u8>, s: &str) {
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
pub(crate) fn write_text_str(out: &mut Vec<u8>, text: &[u8]) {
    match std::str::from_utf8(text) {
        Ok(s) => write_json_str(out, s),
        Err(_) => write_json_str(out, &String::from_utf8_lossy(text)),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn json_str_escapes() {
        let mut out = Vec::new();
        write_json_str(&mut out, "\u{8}\u{c}\u{1f}\u{7f}\u{2028}");
        assert_eq!(out, b"\"\\b\\f\\u001f\x7f\xe2\x80\xa8\"");
    }

    proptest! {
        #[test]
        fn json_str_round_trips(s in any::<String>()) {
            let mut out = Vec::new();
            write_json_str(&mut out, &s);
            prop_assert_eq!(serde_json::from_slice::<String>(&out).unwrap(), s);
        }
    }
}
