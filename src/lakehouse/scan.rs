//! The fast path of [`super::read::type_text`]: a line laid out exactly as
//! `waltail run` writes it is read by comparing the bytes it must have and
//! cutting the values out, with no JSON key decoded.
//!
//! The layout: the contract's field order
//! (`{"op","table","data","old","seq","idempotency_key","commit_lsn"}`), no
//! whitespace, strings without escapes where the line names things (the
//! op, the table, column names, the idempotency key, the LSN). Values are read as the general
//! parser reads them: numbers from their text, strings that need no
//! unescaping borrowed from the line; a JSON column's value, a key column's
//! value other than an integer or plain string, and `old` are handed to
//! sonic-rs (what the general parser uses) once their end is found.
//!
//! Anything else (another field order, an escape, a value that does not fit
//! its column, a table not compacted) gives `None`, and the caller reads
//! the line with the general parser, which reads every valid envelope and
//! words the errors. So this path never decides what a line means on its
//! own, only faster: the proptest `the_fast_path_agrees_with_the_general_one`
//! in `read` checks it gives what the general parser gives (one known
//! difference: sonic-rs reads a float's `-0` as 0, this path keeps the sign
//! Postgres printed). It parses the benchmark's lines twice as fast as
//! sonic-rs's serde deserializer did (`cargo bench --bench compact --
//! compact_parse`: 0.62 to 1.28 million lines/s).

use compact_str::CompactString;
use serde_json::{Map, Value};

use super::line::{FastLine, Row, Shapes, key_with};
use super::typing::parse::{int_cell, parse_cell, parse_decimal, parse_str_cell};
use super::typing::{Cell, Kind, TableShape};

/// Reads `line` if it has `waltail run`'s layout and every value fits its
/// column; `None` otherwise (the general parser then reads it).
#[cfg(test)]
pub(super) fn scan_line<'s>(shapes: &'s Shapes, line: &str) -> Option<FastLine<'s>> {
    scan_into(shapes, line, Vec::new())
}

/// `scan_line` (the tests' entry) with the change's cells in `cells` (emptied first: a
/// vector reused from line to line, not one allocated per change).
pub(super) fn scan_into<'s>(
    shapes: &'s Shapes,
    line: &str,
    cells: Vec<Cell>,
) -> Option<FastLine<'s>> {
    let mut c = Cursor { s: line, at: 0 };
    c.eat(br#"{"op":"#)?;
    // The op is checked by the caller, as a line the general parser read.
    let op = c.plain_string()?;
    c.eat(br#","table":"#)?;
    let (i, shape) = shapes.get(c.plain_string()?)?;
    c.eat(br#","data":"#)?;
    let (data, spare) = if c.eat(b"null").is_some() {
        (None, cells)
    } else {
        (Some(Ok(row(&mut c, shape, cells)?)), Vec::new())
    };
    c.eat(br#","old":"#)?;
    let old = if c.eat(b"null").is_some() {
        None
    } else {
        let text = c.value_text()?;
        Some(sonic_rs::from_str::<Map<String, Value>>(text).ok()?)
    };
    c.eat(br#","seq":"#)?;
    let (seq, true) = c.number()? else {
        return None;
    };
    let seq = seq.parse::<u64>().ok()?;
    c.eat(br#","idempotency_key":"#)?;
    c.plain_string()?;
    c.eat(br#","commit_lsn":"#)?;
    let lsn = c.plain_string()?;
    c.eat(b"}")?;
    (c.at == line.len()).then_some(FastLine {
        op: Some(op.into()),
        table: true,
        shape: Some((i, &**shape)),
        data,
        old,
        seq: Some(seq),
        lsn: Some(CompactString::from(lsn)),
        spare,
    })
}

/// `data`'s object (at its `{`) as cells, columns in any order.
fn row(c: &mut Cursor, shape: &TableShape, mut cells: Vec<Cell>) -> Option<Row> {
    cells.clear();
    cells.resize(shape.columns.len(), Cell::Absent);
    // Key columns' values as serde_json writes them (an integer's or a
    // plain string's text, as the line has it), or their `Value`.
    let mut keys: Vec<(usize, Result<&str, Value>)> = Vec::with_capacity(shape.key.len());
    c.eat(b"{")?;
    let mut end = c.eat(b"}").is_some();
    // The next column in the shape's order is tried first: `waltail run`
    // writes them in that order.
    let mut next = 0;
    while !end {
        let i = match shape.columns.get(next) {
            Some(col) if c.eat_name(&col.name).is_some() => next,
            _ => {
                let i = shape.column(c.plain_string()?)?;
                c.eat(b":")?;
                i
            }
        };
        next = i + 1;
        let kind = shape.columns[i].kind;
        if shape.key.contains(&i) {
            let (cell, value) = key_cell(c, kind)?;
            cells[i] = cell;
            keys.retain(|(k, _)| *k != i);
            keys.push((i, value));
        } else {
            cells[i] = cell(c, kind)?;
        }
        end = c.eat(b"}").is_some();
        if !end {
            c.eat(b",")?;
        }
    }
    let key = key_with(shape, |out, i| match keys.iter().find(|(k, _)| *k == i) {
        Some((_, Ok(text))) => out.extend_from_slice(text.as_bytes()),
        Some((_, Err(value))) => serde_json::to_writer(&mut *out, value).expect("writes to memory"),
        None => out.extend_from_slice(b"null"),
    });
    Some(Row { cells, key })
}

/// A key column's cell, and its value as serde_json writes it: the text
/// of an integer or of a string without escapes is what serde_json writes
/// for the value read from it; anything else goes through a `Value`, as in
/// the general parser.
fn key_cell<'a>(c: &mut Cursor<'a>, kind: Kind) -> Option<(Cell, Result<&'a str, Value>)> {
    let at = c.at;
    match c.peek()? {
        b'"' => {
            if let Some(s) = c.plain_string() {
                let cell = parse_str_cell(kind, s).ok()?;
                return Some((cell, Ok(&c.s[at..c.at])));
            }
        }
        b'-' | b'0'..=b'9' => {
            let (text, int) = c.number()?;
            if let Some(n) = int.then(|| integer(text)).flatten() {
                let cell = match kind {
                    Kind::Int16 | Kind::Int32 | Kind::Int64 => int_cell(kind, n)?,
                    _ => parse_cell(kind, &Value::from(n)).ok()?,
                };
                return Some((cell, Ok(text)));
            }
            c.at = at;
        }
        _ => {}
    }
    let value: Value = sonic_rs::from_str(c.value_text()?).ok()?;
    let cell = parse_cell(kind, &value).ok()?;
    Some((cell, Err(value)))
}

/// One value of a non-key column, as the general parser's `CellSeed` gives
/// it; `None` for what the fast path leaves to it.
fn cell(c: &mut Cursor, kind: Kind) -> Option<Cell> {
    match c.peek()? {
        b'n' => c.eat(b"null").map(|()| Cell::Null),
        b'"' if kind != Kind::Json => {
            let s = c.plain_string()?;
            parse_str_cell(kind, s).ok()
        }
        b'-' | b'0'..=b'9' if kind != Kind::Json => {
            let (text, int) = c.number()?;
            number_cell(kind, text, int)
        }
        b't' if kind == Kind::Bool => c.eat(b"true").map(|()| Cell::Bool(true)),
        b'f' if kind == Kind::Bool => c.eat(b"false").map(|()| Cell::Bool(false)),
        _ if kind == Kind::Json => {
            let value: Value = sonic_rs::from_str(c.value_text()?).ok()?;
            parse_cell(kind, &value).ok()
        }
        _ => None,
    }
}

/// A number's text as a cell of `kind`. Decimals are parsed from the text
/// when it has at most 15 digits before any exponent (what `waltail run`
/// writes as a number): the general parser goes through an f64 and its
/// shortest text, the same value for those, not for longer ones. Numbers
/// in text, date and time columns are left to the general parser, which
/// formats them as serde_json does.
fn number_cell(kind: Kind, text: &str, int: bool) -> Option<Cell> {
    match kind {
        Kind::Decimal { .. }
            if text
                .bytes()
                .take_while(|b| !matches!(b, b'e' | b'E'))
                .filter(u8::is_ascii_digit)
                .count()
                > 15 =>
        {
            None
        }
        Kind::Int16 | Kind::Int32 | Kind::Int64 if int => int_cell(kind, integer(text)?),
        Kind::Float32 | Kind::Float64 => {
            let v: f64 = text.parse().ok()?;
            v.is_finite().then_some(Cell::Float(v))
        }
        Kind::Decimal { precision, scale } => parse_decimal(text, precision, scale).map(Cell::Dec),
        _ => None,
    }
}

/// An integer's text as an i64 (not `-0`, which the general parser may
/// read as a float; nor one beyond i64, which it reads as a u64 or a
/// float).
fn integer(text: &str) -> Option<i64> {
    if text == "-0" {
        return None;
    }
    text.parse().ok()
}

/// The longest number text the fast path reads.
const MAX_NUMBER: usize = 64;

/// The deepest nesting of a value the fast path hands to sonic-rs: it
/// counts from the value, the general parser from the line, and both stop
/// at sonic-rs's limit (255 levels).
const MAX_DEPTH: usize = 200;

/// Bytes that end a string's plain run: the quote, an escape, and the
/// control characters JSON does not allow in a string.
static STRING_STOP: [bool; 256] = {
    let mut stop = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        stop[b] = true;
        b += 1;
    }
    stop[b'"' as usize] = true;
    stop[b'\\' as usize] = true;
    stop
};

/// A position in a line.
struct Cursor<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    fn rest(&self) -> &'a [u8] {
        &self.s.as_bytes()[self.at..]
    }

    fn peek(&self) -> Option<u8> {
        self.rest().first().copied()
    }

    /// Steps over `lit` if the line goes on with it.
    fn eat(&mut self, lit: &[u8]) -> Option<()> {
        self.rest().starts_with(lit).then(|| self.at += lit.len())
    }

    /// Steps over `"name":` if the line goes on with it. A name that
    /// needs escaping never matches (raw, it would be invalid JSON; escaped,
    /// it is not these bytes).
    fn eat_name(&mut self, name: &str) -> Option<()> {
        let rest = self.rest();
        let n = name.len();
        (!name.bytes().any(|b| STRING_STOP[b as usize])
            && rest.len() > n + 2
            && rest[0] == b'"'
            && &rest[1..=n] == name.as_bytes()
            && rest[n + 1] == b'"'
            && rest[n + 2] == b':')
            .then(|| self.at += n + 3)
    }

    /// A string (at its opening quote) that needs no unescaping: its text.
    fn plain_string(&mut self) -> Option<&'a str> {
        let rest = self.rest();
        if rest.first() != Some(&b'"') {
            return None;
        }
        let len = rest[1..].iter().position(|&b| STRING_STOP[b as usize])?;
        if rest[1 + len] != b'"' {
            return None;
        }
        let start = self.at + 1;
        self.at = start + len + 1;
        // Both ends are ASCII quotes: char boundaries of the UTF-8 line.
        Some(&self.s[start..start + len])
    }

    /// A number's text, as JSON's grammar has it, and whether it is an
    /// integer (no fraction, no exponent). Not one longer than
    /// [`MAX_NUMBER`]: sonic-rs caps the exponents it reads, so its value of
    /// a text that long may not be the exact one read here.
    fn number(&mut self) -> Option<(&'a str, bool)> {
        let b = self.rest();
        let digits = |mut i: usize| {
            while b.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            i
        };
        let mut i = usize::from(b.first() == Some(&b'-'));
        i = match b.get(i)? {
            b'0' => i + 1,
            b'1'..=b'9' => digits(i + 1),
            _ => return None,
        };
        let int = !matches!(b.get(i), Some(b'.' | b'e' | b'E'));
        if b.get(i) == Some(&b'.') {
            let end = digits(i + 1);
            if end == i + 1 {
                return None;
            }
            i = end;
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            let end = digits(i);
            if end == i {
                return None;
            }
            i = end;
        }
        if i > MAX_NUMBER {
            return None;
        }
        let start = self.at;
        self.at += i;
        Some((&self.s[start..start + i], int))
    }

    /// The text of the value here, found by its end only (brackets and
    /// strings matched, nothing else checked): whoever takes it parses it.
    fn value_text(&mut self) -> Option<&'a str> {
        let b = self.rest();
        // The index after the string whose opening quote is at `i`.
        let string_end = |mut i: usize| {
            i += 1;
            while *b.get(i)? != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            Some(i + 1)
        };
        let len = match *b.first()? {
            b'"' => string_end(0)?,
            b'{' | b'[' => {
                let mut depth = 0usize;
                let mut i = 0;
                loop {
                    match *b.get(i)? {
                        b'"' => {
                            i = string_end(i)?;
                            continue;
                        }
                        b'{' | b'[' => {
                            depth += 1;
                            if depth > MAX_DEPTH {
                                return None;
                            }
                        }
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                break i + 1;
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
            _ => b
                .iter()
                .position(|&c| matches!(c, b',' | b'}' | b']'))
                .unwrap_or(b.len()),
        };
        let start = self.at;
        self.at += len;
        Some(&self.s[start..start + len])
    }
}
