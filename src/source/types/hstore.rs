//! `hstore` (an extension type, found by name in the catalog): a JSON object
//! of strings and nulls.

use super::string::{write_json_str, write_text_str};

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

#[cfg(test)]
mod tests {
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
}
