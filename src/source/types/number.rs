//! Numbers: checks a value's text against the JSON number grammar and
//! measures it, so `int*`, `float*` and `numeric` values are written
//! verbatim only when every JSON reader takes them (see [`super::write_json`]),
//! and json/jsonb numbers are checked by the same grammar.

/// What [`parse_number`] learned about a JSON-grammar number.
pub(crate) struct NumberShape {
    pub(crate) has_frac: bool,
    pub(crate) has_exp: bool,
    /// Integer-part digits after leading zeros.
    pub(crate) int_digits: usize,
    /// Digits from the first non-zero digit to the end of the mantissa.
    pub(crate) sig_digits: usize,
    /// Zeros between the decimal point and the first non-zero digit, when the
    /// integer part is zero.
    pub(crate) frac_leading_zeros: usize,
    pub(crate) exp: i64,
}

impl NumberShape {
    /// Whether a double-based JSON reader accepts the value: overflow to
    /// infinity is rejected by some (serde_json among them), while underflow
    /// just rounds towards zero. Only values within a factor of ten of
    /// f64::MAX pay for a real parse.
    pub(crate) fn fits_f64(&self, text: &[u8]) -> bool {
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
pub(crate) fn parse_number(text: &[u8]) -> Option<NumberShape> {
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
