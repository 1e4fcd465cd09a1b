//! `bytea`: the hex output format (`bytea_output=hex`) re-encoded as a
//! padded standard base64 JSON string, without a buffer per value.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;

/// bytea in hex output format (`\x0a0b`) to a base64 JSON string, converted
/// in stack-sized chunks so no buffer is allocated. Returns false, having
/// written nothing, if the text is not `\x` followed by an even number of
/// hex digits.
pub(crate) fn write_bytea(out: &mut Vec<u8>, text: &[u8]) -> bool {
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

#[cfg(test)]
mod tests {
    use super::super::*;
    use super::*;

    fn j(oid: u32, text: &str) -> String {
        let mut out = Vec::new();
        write_json(&mut out, oid, text.as_bytes());
        String::from_utf8(out).unwrap()
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
}
