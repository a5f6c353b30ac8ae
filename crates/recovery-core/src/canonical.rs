//! Canonical JSON exactly as CPython's
//! `json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)`
//! writes it, and the SHA-256 digests taken of it.
//!
//! Two entry points produce the same bytes:
//! - [`canonicalize_text`] turns raw JSON text straight into canonical text without building a
//!   tree (the hot path of the materialized digest: strings without escapes are copied as they are);
//! - [`canonical_value`] serialises an already parsed [`serde_json::Value`] (configuration
//!   identities, manifests).
//!
//! Invariants (what CPython does, measured in `../shared/conformance/canonical-json.jsonl`):
//! - object keys sorted by code point (= byte order of their UTF-8), duplicate keys: the last wins;
//! - integers keep arbitrary precision (`-0` is `0`); anything with `.`/`e`/`E` is a float printed
//!   like Python's `repr` (`1e+16`, `1e-05`, `1.0`, `-0.0`);
//! - NaN, infinities (also from overflow such as `1e400`) and lone surrogates are refused;
//! - limits: nesting depth [`MAX_DEPTH`], integer length [`MAX_INT_DIGITS`] (CPython's own
//!   `int_max_str_digits`); beyond them a clear error, never a crash.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Deepest nesting accepted (CPython's recursion limit allows ~1,000; serde_json 128 by default).
pub const MAX_DEPTH: usize = 512;
/// Longest integer accepted, in digits: CPython 3.11 refuses longer ones when parsing.
pub const MAX_INT_DIGITS: usize = 4300;

/// Why a JSON text or value has no canonical form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CanonicalError {
    #[error("invalid JSON at byte {offset}: {reason}")]
    Syntax { offset: usize, reason: &'static str },
    #[error("the text is not valid UTF-8 (byte {offset})")]
    Utf8 { offset: usize },
    #[error("NaN and infinite numbers have no JSON form (byte {offset})")]
    NonFinite { offset: usize },
    #[error("lone UTF-16 surrogate in a string escape (byte {offset}) cannot be encoded as UTF-8")]
    LoneSurrogate { offset: usize },
    #[error("nesting deeper than {MAX_DEPTH} levels (byte {offset})")]
    TooDeep { offset: usize },
    #[error("integer longer than {MAX_INT_DIGITS} digits (byte {offset})")]
    IntegerTooLong { offset: usize },
}

/// SHA-256 of canonical text, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lowercase hex of a byte string.
pub fn hex(bytes: &[u8]) -> String {
    // A `write!` per byte was most of a journal line's id (profiled: a reindex).
    ::hex::encode(bytes)
}

/// `_digest(value)`: SHA-256 of the canonical JSON of a value.
pub fn digest(value: &Value) -> Result<String, CanonicalError> {
    Ok(sha256_hex(canonical_value(value)?.as_bytes()))
}

/// Canonical JSON of raw JSON text, then its SHA-256.
pub fn digest_text(text: &[u8]) -> Result<String, CanonicalError> {
    let mut out = Vec::with_capacity(text.len());
    canonicalize_text(text, &mut out)?;
    Ok(sha256_hex(&out))
}

/// A step of the way to a value inside a JSON document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathStep {
    Key(String),
    Index(usize),
}

/// The first number in `value` whose canonical form the digest refuses (a float past a double's
/// range, which Python reads as infinity and `json.dumps(allow_nan=False)` refuses, or an
/// integer longer than Python reads), with the way to it and the reason: found before a digest
/// is taken of a value so the refusal names the key (the digest's own error can only say
/// "byte 0", a value having no bytes). The rule is the canonicalizer's own number writer.
pub fn number_without_canonical_form(value: &Value) -> Option<(Vec<PathStep>, CanonicalError)> {
    fn walk(value: &Value, path: &mut Vec<PathStep>) -> Option<CanonicalError> {
        match value {
            Value::Number(number) => {
                write_number_text(number.to_string().as_bytes(), 0, &mut Vec::new()).err()
            }
            Value::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
                path.push(PathStep::Index(i));
                let found = walk(item, path);
                if found.is_none() {
                    path.pop();
                }
                found
            }),
            Value::Object(map) => map.iter().find_map(|(key, item)| {
                path.push(PathStep::Key(key.clone()));
                let found = walk(item, path);
                if found.is_none() {
                    path.pop();
                }
                found
            }),
            _ => None,
        }
    }
    let mut path = Vec::new();
    walk(value, &mut path).map(|error| (path, error))
}

/// A refusal of [`number_without_canonical_form`]'s finding, naming the key: the field path
/// (`config.a.b[1]`, starting at `field`) while its keys are plain names, the rest quoted after
/// it (`(at ["my server"]["port"])`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumberRefusal {
    /// The field path to the number, or to the last plain name on the way to it.
    pub field: String,
    /// `<field>: a number with no canonical form[ (at ...)]: <reason>`.
    pub message: String,
}

/// The first number in `value` (the document at `field`) whose digest cannot be taken, as a
/// refusal naming its key: `None` when every number has a canonical form.
pub fn refuse_number_without_canonical_form(field: &str, value: &Value) -> Option<NumberRefusal> {
    let (path, error) = number_without_canonical_form(value)?;
    let plain =
        |key: &str| !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    // The way to the number: as a field path while its keys are plain names, quoted after.
    let (mut named, mut rest) = (field.to_owned(), String::new());
    for step in &path {
        let (target, text) = match step {
            PathStep::Key(key) if plain(key) && rest.is_empty() => (&mut named, format!(".{key}")),
            PathStep::Key(key) => (
                &mut rest,
                format!("[{}]", serde_json::to_string(key).unwrap_or_default()),
            ),
            PathStep::Index(i) if rest.is_empty() => (&mut named, format!("[{i}]")),
            PathStep::Index(i) => (&mut rest, format!("[{i}]")),
        };
        target.push_str(&text);
    }
    let reason = match error {
        CanonicalError::IntegerTooLong { .. } => {
            format!("integer longer than {MAX_INT_DIGITS} digits")
        }
        _ => "NaN and infinite numbers have no JSON form".to_owned(),
    };
    let at = if rest.is_empty() {
        String::new()
    } else {
        format!(" (at {rest})")
    };
    Some(NumberRefusal {
        message: format!("{named}: a number with no canonical form{at}: {reason}"),
        field: named,
    })
}

/// Canonical JSON of a parsed value.
pub fn canonical_value(value: &Value) -> Result<String, CanonicalError> {
    let mut out = Vec::new();
    write_value(value, &mut out, 0)?;
    // Only UTF-8 was ever written: keys and strings come from `String`s, the rest is ASCII.
    String::from_utf8(out).map_err(|e| CanonicalError::Utf8 {
        offset: e.utf8_error().valid_up_to(),
    })
}

fn write_value(value: &Value, out: &mut Vec<u8>, depth: usize) -> Result<(), CanonicalError> {
    if depth > MAX_DEPTH {
        return Err(CanonicalError::TooDeep { offset: 0 });
    }
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_number_text(n.to_string().as_bytes(), 0, out)?,
        Value::String(s) => write_string(s.as_bytes(), out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(item, out, depth + 1)?;
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(key.as_bytes(), out);
                out.push(b':');
                write_value(item, out, depth + 1)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

/// Writes a decoded (valid UTF-8) string, quoted, with Python's `ensure_ascii=False` escapes.
pub(crate) fn write_string(s: &[u8], out: &mut Vec<u8>) {
    out.push(b'"');
    write_escaped(s, out);
    out.push(b'"');
}

const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Writes a JSON number token the way CPython re-serialises what `json.loads` made of it.
fn write_number_text(text: &[u8], offset: usize, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
    let is_float = text.iter().any(|&b| matches!(b, b'.' | b'e' | b'E'));
    if !is_float {
        let digits = text.strip_prefix(b"-").unwrap_or(text);
        if digits.len() > MAX_INT_DIGITS {
            return Err(CanonicalError::IntegerTooLong { offset });
        }
        if digits == b"0" {
            out.push(b'0');
        } else {
            out.extend_from_slice(text);
        }
        return Ok(());
    }
    if write_simple_float(text, out) {
        return Ok(());
    }
    // The token is ASCII by construction (validated by the caller's grammar).
    let as_str = std::str::from_utf8(text).map_err(|_| CanonicalError::Syntax {
        offset,
        reason: "bad number",
    })?;
    let parsed: f64 = as_str.parse().map_err(|_| CanonicalError::Syntax {
        offset,
        reason: "bad number",
    })?;
    if !parsed.is_finite() {
        return Err(CanonicalError::NonFinite { offset });
    }
    write_python_float(parsed, out);
    Ok(())
}

/// Python's `repr(float)` for a finite float: shortest round-trip digits (from ryu), laid out
/// with exponent form when the decimal exponent is < -4 or >= 16.
pub fn python_float_repr(value: f64) -> String {
    let mut out = Vec::with_capacity(24);
    write_python_float(value, &mut out);
    String::from_utf8(out).unwrap_or_default()
}

pub(crate) fn write_python_float(value: f64, out: &mut Vec<u8>) {
    debug_assert!(value.is_finite());
    if value.is_sign_negative() {
        out.push(b'-');
    }
    let magnitude = value.abs();
    if magnitude == 0.0 {
        out.extend_from_slice(b"0.0");
        return;
    }
    let mut buffer = ryu::Buffer::new();
    let text = buffer.format_finite(magnitude).as_bytes();
    // Split ryu's layout into significant digits and `decpt` (value = 0.DIGITS * 10^decpt).
    let (mantissa, exponent) = match text.iter().position(|&b| b == b'e') {
        Some(at) => (&text[..at], parse_exponent(&text[at + 1..])),
        None => (text, 0),
    };
    let mut digits = [0u8; 32];
    let mut count = 0usize;
    let mut integer_digits = 0i32;
    let mut seen_dot = false;
    for &b in mantissa {
        if b == b'.' {
            seen_dot = true;
            continue;
        }
        if !seen_dot {
            integer_digits += 1;
        }
        digits[count] = b;
        count += 1;
    }
    let (digits, decpt) = normalize_digits(&digits[..count], integer_digits + exponent);
    layout_python_float(digits, decpt, out);
}

/// Strips leading zeros (moving the decimal point) and trailing zeros.
fn normalize_digits(digits: &[u8], mut decpt: i32) -> (&[u8], i32) {
    let mut first = 0;
    while first < digits.len() && digits[first] == b'0' {
        first += 1;
        decpt -= 1;
    }
    let mut last = digits.len();
    while last > first && digits[last - 1] == b'0' {
        last -= 1;
    }
    (&digits[first..last], decpt)
}

/// Python's `repr` layout of significant `digits` with the decimal point after `decpt` of them
/// (no sign; `digits` non-empty).
fn layout_python_float(digits: &[u8], decpt: i32, out: &mut Vec<u8>) {
    let n = digits.len() as i32;
    if decpt > -4 && decpt <= 16 {
        if decpt <= 0 {
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat_n(b'0', (-decpt) as usize));
            out.extend_from_slice(digits);
        } else if decpt < n {
            out.extend_from_slice(&digits[..decpt as usize]);
            out.push(b'.');
            out.extend_from_slice(&digits[decpt as usize..]);
        } else {
            out.extend_from_slice(digits);
            out.extend(std::iter::repeat_n(b'0', (decpt - n) as usize));
            out.extend_from_slice(b".0");
        }
    } else {
        out.push(digits[0]);
        if n > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        let e = decpt - 1;
        out.push(b'e');
        out.push(if e < 0 { b'-' } else { b'+' });
        let e = e.unsigned_abs();
        if e < 10 {
            out.push(b'0');
        }
        out.extend_from_slice(e.to_string().as_bytes());
    }
}

/// The float fast path: a JSON float token with at most 15 significant digits in the normal range
/// is the shortest round-trip form of its double already (any two decimals of <= 15 significant
/// digits map to distinct doubles), so Python's `repr` is those digits laid out. `false` when the
/// token needs the general path.
fn write_simple_float(token: &[u8], out: &mut Vec<u8>) -> bool {
    let (negative, rest) = match token.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, token),
    };
    let mut digits = [0u8; 32];
    let mut count = 0usize;
    let mut integer_digits = 0i32;
    let mut i = 0;
    let mut in_fraction = false;
    while let Some(&b) = rest.get(i) {
        match b {
            b'0'..=b'9' => {
                if count == digits.len() {
                    return false;
                }
                digits[count] = b;
                count += 1;
                if !in_fraction {
                    integer_digits += 1;
                }
            }
            b'.' => in_fraction = true,
            b'e' | b'E' => break,
            _ => return false,
        }
        i += 1;
    }
    let mut exponent = 0i32;
    if i < rest.len() {
        let text = &rest[i + 1..];
        let digits_only = text
            .strip_prefix(b"-")
            .or_else(|| text.strip_prefix(b"+"))
            .unwrap_or(text);
        if digits_only.is_empty() || digits_only.len() > 4 {
            return false;
        }
        exponent = parse_exponent(text);
    }
    let (significant, decpt) = normalize_digits(&digits[..count], integer_digits + exponent);
    if significant.is_empty() {
        out.extend_from_slice(if negative { b"-0.0" } else { b"0.0" });
        return true;
    }
    if significant.len() > 15 || !(-300..=300).contains(&decpt) {
        return false;
    }
    if negative {
        out.push(b'-');
    }
    layout_python_float(significant, decpt, out);
    true
}

fn parse_exponent(text: &[u8]) -> i32 {
    let (negative, digits) = match text.first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let magnitude = digits
        .iter()
        .fold(0i32, |acc, &d| acc * 10 + i32::from(d - b'0'));
    if negative { -magnitude } else { magnitude }
}

/// Canonical JSON of one JSON text (surrounding JSON whitespace allowed), appended to `out`.
///
/// Accepts exactly what CPython's `json.loads` accepts, except values CPython would then refuse
/// to digest (NaN, infinities, lone surrogates), which are errors here directly.
pub fn canonicalize_text(input: &[u8], out: &mut Vec<u8>) -> Result<(), CanonicalError> {
    validate_utf8(input)?;
    canonicalize_valid_utf8(input, out, &mut Scratch::default())
}

/// Validates UTF-8 (SIMD-accelerated), reporting the offset of the first invalid byte.
pub(crate) fn validate_utf8(input: &[u8]) -> Result<(), CanonicalError> {
    if simdutf8::basic::from_utf8(input).is_ok() {
        return Ok(());
    }
    let offset = std::str::from_utf8(input)
        .err()
        .map_or(0, |e| e.valid_up_to());
    Err(CanonicalError::Utf8 { offset })
}

/// Reusable buffers of the canonicalizer, so that many texts (lines) allocate nothing.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    keys: Vec<u8>,
    members: Vec<Member>,
    reorder: Vec<u8>,
    order: Vec<usize>,
}

/// [`canonicalize_text`] for input already known to be valid UTF-8.
pub(crate) fn canonicalize_valid_utf8(
    input: &[u8],
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) -> Result<(), CanonicalError> {
    let start = out.len();
    match canonicalize_in_one_pass(input, out, scratch) {
        Err(error @ CanonicalError::NonFinite { .. }) => {
            out.truncate(start);
            replaced_infinity(input, out).ok_or(error)
        }
        result => result,
    }
}

/// The canonical text of a document whose infinite number is replaced by a repeated key before
/// it is written (`{"a": 1e999, "a": 1}`): Python reads it, the last value winning, and writes
/// it, where one pass refuses the number when it meets it (review 56, N1: a create took such a
/// configuration and its validate refused it). Read whole, repeats resolved, then written;
/// `None` when the number is still there (or the document is not one serde_json reads), and
/// the one-pass refusal stands.
fn replaced_infinity(input: &[u8], out: &mut Vec<u8>) -> Option<()> {
    check_depth(input).ok()?;
    let mut deserializer = serde_json::Deserializer::from_slice(input);
    deserializer.disable_recursion_limit();
    let value: Value = serde::Deserialize::deserialize(&mut deserializer).ok()?;
    deserializer.end().ok()?;
    out.extend_from_slice(canonical_value(&value).ok()?.as_bytes());
    Some(())
}

fn canonicalize_in_one_pass(
    input: &[u8],
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) -> Result<(), CanonicalError> {
    scratch.keys.clear();
    scratch.members.clear();
    let mut parser = TextCanonicalizer {
        input,
        pos: 0,
        scratch,
    };
    parser.skip_ws();
    parser.value(out, 0)?;
    parser.skip_ws();
    if parser.pos != input.len() {
        return Err(parser.syntax("extra data after the JSON value"));
    }
    Ok(())
}

/// Length of the run at the start of `bytes` that needs no string handling: up to the next
/// quote, backslash or control character. Eight bytes at a time with word arithmetic (each test
/// below is exact for "does any byte of the word match"), then the exact position bytewise.
#[inline]
fn plain_run(bytes: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    #[inline(always)]
    fn special(b: u8) -> bool {
        b == b'"' || b == b'\\' || b < 0x20
    }
    let mut i = 0;
    while let Some(chunk) = bytes.get(i..i + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let quote = w ^ (ONES * u64::from(b'"'));
        let backslash = w ^ (ONES * u64::from(b'\\'));
        let hits = (quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash)
            | (w.wrapping_sub(ONES * 0x20) & !w);
        if hits & HIGHS != 0 {
            break;
        }
        i += 8;
    }
    i + bytes[i..]
        .iter()
        .position(|&b| special(b))
        .unwrap_or(bytes.len() - i)
}

/// One object member seen while canonicalizing: where its decoded key and its canonical text are.
#[derive(Debug, Clone, Copy)]
struct Member {
    /// First 8 bytes of the decoded key, big-endian, for fast ordering.
    prefix: u64,
    /// Decoded key: a range of the input (no escapes) or of the key scratch buffer.
    key_in_input: bool,
    key_start: usize,
    key_end: usize,
    /// Canonical `"key":value` text inside the output buffer.
    text_start: usize,
    text_end: usize,
}

struct TextCanonicalizer<'a> {
    input: &'a [u8],
    pos: usize,
    scratch: &'a mut Scratch,
}

/// Big-endian first 8 bytes (zero padded): orders like the bytes, up to ties.
#[inline]
fn key_prefix(key: &[u8]) -> u64 {
    let mut bytes = [0u8; 8];
    let n = key.len().min(8);
    bytes[..n].copy_from_slice(&key[..n]);
    u64::from_be_bytes(bytes)
}

impl TextCanonicalizer<'_> {
    fn syntax(&self, reason: &'static str) -> CanonicalError {
        CanonicalError::Syntax {
            offset: self.pos,
            reason,
        }
    }

    #[inline]
    fn skip_ws(&mut self) {
        while let Some(&b) = self.input.get(self.pos) {
            if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    fn value(&mut self, out: &mut Vec<u8>, depth: usize) -> Result<(), CanonicalError> {
        match self.input.get(self.pos) {
            Some(b'{') => self.object(out, depth + 1),
            Some(b'[') => self.array(out, depth + 1),
            Some(b'"') => {
                self.pos += 1;
                self.string_value(out)
            }
            Some(b't') => self.literal(b"true", out),
            Some(b'f') => self.literal(b"false", out),
            Some(b'n') => self.literal(b"null", out),
            Some(b'N') if self.input[self.pos..].starts_with(b"NaN") => {
                Err(CanonicalError::NonFinite { offset: self.pos })
            }
            Some(b'I') if self.input[self.pos..].starts_with(b"Infinity") => {
                Err(CanonicalError::NonFinite { offset: self.pos })
            }
            Some(b'-') if self.input[self.pos..].starts_with(b"-Infinity") => {
                Err(CanonicalError::NonFinite { offset: self.pos })
            }
            Some(b'-' | b'0'..=b'9') => self.number(out),
            Some(_) => Err(self.syntax("expected a value")),
            None => Err(self.syntax("unexpected end of input")),
        }
    }

    fn literal(&mut self, word: &'static [u8], out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        if self.input[self.pos..].starts_with(word) {
            self.pos += word.len();
            out.extend_from_slice(word);
            Ok(())
        } else {
            Err(self.syntax("expected a value"))
        }
    }

    fn number(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        let start = self.pos;
        let bytes = self.input;
        let mut p = self.pos;
        if bytes.get(p) == Some(&b'-') {
            p += 1;
        }
        match bytes.get(p) {
            Some(b'0') => p += 1,
            Some(b'1'..=b'9') => {
                while matches!(bytes.get(p), Some(b'0'..=b'9')) {
                    p += 1;
                }
            }
            _ => {
                self.pos = p;
                return Err(self.syntax("expected a digit"));
            }
        }
        // Like CPython's scanner: a fraction or exponent without digits ends the number there,
        // and the stray character is then a syntax error of the enclosing structure.
        if bytes.get(p) == Some(&b'.') && matches!(bytes.get(p + 1), Some(b'0'..=b'9')) {
            p += 2;
            while matches!(bytes.get(p), Some(b'0'..=b'9')) {
                p += 1;
            }
        }
        if matches!(bytes.get(p), Some(b'e' | b'E')) {
            let mut q = p + 1;
            if matches!(bytes.get(q), Some(b'+' | b'-')) {
                q += 1;
            }
            if matches!(bytes.get(q), Some(b'0'..=b'9')) {
                while matches!(bytes.get(q), Some(b'0'..=b'9')) {
                    q += 1;
                }
                p = q;
            }
        }
        self.pos = p;
        write_number_text(&bytes[start..p], start, out)
    }

    /// Parses a string body (after the opening quote) and writes its canonical form.
    fn string_value(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        out.push(b'"');
        let bytes = self.input;
        loop {
            let rest = &bytes[self.pos..];
            // Copy the longest run that needs no escaping either way.
            let run = plain_run(rest);
            out.extend_from_slice(&rest[..run]);
            self.pos += run;
            match bytes.get(self.pos) {
                Some(b'"') => {
                    self.pos += 1;
                    out.push(b'"');
                    return Ok(());
                }
                Some(b'\\') => match bytes.get(self.pos + 1) {
                    // These escapes are already what Python writes: copy them as they are.
                    Some(b'"' | b'\\' | b'n' | b'r' | b't' | b'b' | b'f') => {
                        out.extend_from_slice(&bytes[self.pos..self.pos + 2]);
                        self.pos += 2;
                    }
                    _ => {
                        let mut decoded = [0u8; 4];
                        let len = self.escape(&mut decoded)?;
                        write_escaped(&decoded[..len], out);
                    }
                },
                Some(_) => return Err(self.syntax("control character in a string")),
                None => return Err(self.syntax("unterminated string")),
            }
        }
    }

    /// Parses a key (after its opening quote); returns its decoded bytes' location.
    fn key(&mut self) -> Result<(bool, usize, usize), CanonicalError> {
        let bytes = self.input;
        let start = self.pos;
        let run = Some(plain_run(&bytes[start..])).filter(|&r| start + r < bytes.len());
        match run.map(|r| (r, bytes[start + r])) {
            Some((r, b'"')) => {
                self.pos = start + r + 1;
                return Ok((true, start, start + r));
            }
            Some((_, b'\\')) => {}
            Some(_) => {
                self.pos = start + run.unwrap_or(0);
                return Err(self.syntax("control character in a string"));
            }
            None => {
                self.pos = bytes.len();
                return Err(self.syntax("unterminated string"));
            }
        }
        // Slow path: the key has escapes; decode it into the key buffer.
        let key_start = self.scratch.keys.len();
        loop {
            let rest = &bytes[self.pos..];
            let run = plain_run(rest);
            self.scratch.keys.extend_from_slice(&rest[..run]);
            self.pos += run;
            match bytes.get(self.pos) {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok((false, key_start, self.scratch.keys.len()));
                }
                Some(b'\\') => {
                    let mut decoded = [0u8; 4];
                    let len = self.escape(&mut decoded)?;
                    self.scratch.keys.extend_from_slice(&decoded[..len]);
                }
                Some(_) => return Err(self.syntax("control character in a string")),
                None => return Err(self.syntax("unterminated string")),
            }
        }
    }

    /// Decodes one escape sequence at `pos` (a backslash) into UTF-8.
    fn escape(&mut self, buf: &mut [u8; 4]) -> Result<usize, CanonicalError> {
        let at = self.pos;
        let Some(&kind) = self.input.get(at + 1) else {
            return Err(self.syntax("unterminated string"));
        };
        self.pos = at + 2;
        let simple = match kind {
            b'"' => b'"',
            b'\\' => b'\\',
            b'/' => b'/',
            b'b' => 0x08,
            b'f' => 0x0c,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => {
                let first = self.hex4(at + 2)?;
                self.pos = at + 6;
                let code = if (0xD800..0xDC00).contains(&first) {
                    let low = if self.input.get(at + 6) == Some(&b'\\')
                        && self.input.get(at + 7) == Some(&b'u')
                    {
                        Some(self.hex4(at + 8)?)
                    } else {
                        None
                    };
                    match low {
                        Some(low) if (0xDC00..0xE000).contains(&low) => {
                            self.pos = at + 12;
                            0x10000 + ((first - 0xD800) << 10) + (low - 0xDC00)
                        }
                        _ => return Err(CanonicalError::LoneSurrogate { offset: at }),
                    }
                } else if (0xDC00..0xE000).contains(&first) {
                    return Err(CanonicalError::LoneSurrogate { offset: at });
                } else {
                    first
                };
                let ch =
                    char::from_u32(code).ok_or(CanonicalError::LoneSurrogate { offset: at })?;
                return Ok(ch.encode_utf8(buf).len());
            }
            _ => {
                self.pos = at;
                return Err(self.syntax("invalid escape"));
            }
        };
        buf[0] = simple;
        Ok(1)
    }

    fn hex4(&self, at: usize) -> Result<u32, CanonicalError> {
        let digits = self.input.get(at..at + 4).ok_or(CanonicalError::Syntax {
            offset: at,
            reason: "invalid \\u escape",
        })?;
        let mut code = 0u32;
        for &d in digits {
            let v = match d {
                b'0'..=b'9' => d - b'0',
                b'a'..=b'f' => d - b'a' + 10,
                b'A'..=b'F' => d - b'A' + 10,
                _ => {
                    return Err(CanonicalError::Syntax {
                        offset: at,
                        reason: "invalid \\u escape",
                    });
                }
            };
            code = code * 16 + u32::from(v);
        }
        Ok(code)
    }

    fn array(&mut self, out: &mut Vec<u8>, depth: usize) -> Result<(), CanonicalError> {
        if depth > MAX_DEPTH {
            return Err(CanonicalError::TooDeep { offset: self.pos });
        }
        self.pos += 1;
        out.push(b'[');
        self.skip_ws();
        if self.input.get(self.pos) == Some(&b']') {
            self.pos += 1;
            out.push(b']');
            return Ok(());
        }
        loop {
            self.skip_ws();
            self.value(out, depth)?;
            self.skip_ws();
            match self.input.get(self.pos) {
                Some(b',') => {
                    self.pos += 1;
                    out.push(b',');
                }
                Some(b']') => {
                    self.pos += 1;
                    out.push(b']');
                    return Ok(());
                }
                _ => return Err(self.syntax("expected ',' or ']'")),
            }
        }
    }

    fn object(&mut self, out: &mut Vec<u8>, depth: usize) -> Result<(), CanonicalError> {
        if depth > MAX_DEPTH {
            return Err(CanonicalError::TooDeep { offset: self.pos });
        }
        self.pos += 1;
        let object_start = out.len();
        out.push(b'{');
        self.skip_ws();
        if self.input.get(self.pos) == Some(&b'}') {
            self.pos += 1;
            out.push(b'}');
            return Ok(());
        }
        let members_base = self.scratch.members.len();
        let keys_base = self.scratch.keys.len();
        loop {
            self.skip_ws();
            if self.input.get(self.pos) != Some(&b'"') {
                return Err(self.syntax("expected a string key"));
            }
            self.pos += 1;
            let text_start = out.len();
            let (key_in_input, key_start, key_end) = self.key()?;
            if key_in_input {
                // No escapes in the input: the canonical key may still need some (never, since
                // only quote, backslash and controls are escaped and none of them is present).
                out.push(b'"');
                out.extend_from_slice(&self.input[key_start..key_end]);
                out.push(b'"');
            } else {
                let decoded = &self.scratch.keys[key_start..key_end];
                write_string(decoded, out);
            }
            self.skip_ws();
            if self.input.get(self.pos) != Some(&b':') {
                return Err(self.syntax("expected ':'"));
            }
            self.pos += 1;
            out.push(b':');
            self.skip_ws();
            self.value(out, depth)?;
            let prefix = key_prefix(if key_in_input {
                &self.input[key_start..key_end]
            } else {
                &self.scratch.keys[key_start..key_end]
            });
            self.scratch.members.push(Member {
                prefix,
                key_in_input,
                key_start,
                key_end,
                text_start,
                text_end: out.len(),
            });
            self.skip_ws();
            match self.input.get(self.pos) {
                Some(b',') => {
                    self.pos += 1;
                    out.push(b',');
                }
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(self.syntax("expected ',' or '}'")),
            }
        }
        self.finish_object(out, object_start, members_base);
        self.scratch.members.truncate(members_base);
        self.scratch.keys.truncate(keys_base);
        Ok(())
    }

    /// Orders the members of the object written at `object_start` by key, keeping the last of
    /// duplicate keys, and closes it.
    fn finish_object(&mut self, out: &mut Vec<u8>, object_start: usize, members_base: usize) {
        let input = self.input;
        let Scratch {
            keys,
            members,
            reorder,
            order,
        } = &mut *self.scratch;
        let members = &members[members_base..];
        let key = |m: &Member| -> &[u8] {
            if m.key_in_input {
                &input[m.key_start..m.key_end]
            } else {
                &keys[m.key_start..m.key_end]
            }
        };
        let compare =
            |a: &Member, b: &Member| a.prefix.cmp(&b.prefix).then_with(|| key(a).cmp(key(b)));
        if members.windows(2).all(|w| compare(&w[0], &w[1]).is_lt()) {
            out.push(b'}');
            return;
        }
        order.clear();
        order.extend(0..members.len());
        // By key, then by position so that the last of duplicate keys ends its run.
        order.sort_unstable_by(|&a, &b| compare(&members[a], &members[b]).then(a.cmp(&b)));
        reorder.clear();
        reorder.extend_from_slice(&out[object_start..]);
        out.truncate(object_start + 1);
        let mut first = true;
        for (i, &index) in order.iter().enumerate() {
            if let Some(&next) = order.get(i + 1)
                && compare(&members[next], &members[index]).is_eq()
            {
                continue;
            }
            if !first {
                out.push(b',');
            }
            first = false;
            let m = &members[index];
            out.extend_from_slice(&reorder[m.text_start - object_start..m.text_end - object_start]);
        }
        out.push(b'}');
    }
}

/// Escapes an already decoded fragment with Python's `ensure_ascii=False` rules (no quotes).
fn write_escaped(s: &[u8], out: &mut Vec<u8>) {
    let mut start = 0;
    for (i, &b) in s.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&s[start..i]);
        if escape.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX_DIGITS[(b >> 4) as usize]);
            out.push(HEX_DIGITS[(b & 0xf) as usize]);
        } else {
            out.extend_from_slice(escape);
        }
        start = i + 1;
    }
    out.extend_from_slice(&s[start..]);
}
/// Refuses text nested deeper than [`MAX_DEPTH`] before any parser recurses into it: one pass
/// over the bytes counting brackets outside strings (a string's `\"` never ends it). Text that
/// is not JSON passes here and is refused by the parser that follows, with its own message.
/// Strings, most of a row's bytes, are skipped with `memchr` to their next quote or backslash.
pub fn check_depth(text: &[u8]) -> Result<(), CanonicalError> {
    check_depth_within(text, 0)
}

/// [`check_depth`] of a text that sits `levels_above` levels down in a larger document (a
/// field of a request body read as a raw text is one level down): its nesting counts from
/// that document's root.
pub fn check_depth_within(text: &[u8], levels_above: usize) -> Result<(), CanonicalError> {
    let mut depth = levels_above;
    let mut at = 0;
    while let Some(&byte) = text.get(at) {
        match byte {
            b'"' => match string_end(text, at + 1) {
                Some(end) => at = end,
                // Unterminated: nothing after it counts.
                None => return Ok(()),
            },
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(CanonicalError::TooDeep { offset: at });
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        at += 1;
    }
    Ok(())
}

/// The offset of the quote that ends the string whose text starts at `from` (a backslash
/// escapes the byte after it, whatever it is).
fn string_end(text: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let found = from + memchr::memchr2(b'"', b'\\', text.get(from..)?)?;
        if text[found] == b'"' {
            return Some(found);
        }
        from = found + 2;
    }
}

/// Parses JSON text into a [`Value`] accepting what CPython's `json.loads` accepts within the
/// documented limits (depth up to [`MAX_DEPTH`], where serde_json alone stops at 128). Numbers keep
/// their text, duplicate keys keep the last value.
pub fn parse_json(text: &[u8]) -> Result<Value, CanonicalError> {
    // The canonicalizer enforces the grammar and every limit; only then is the tree built.
    let mut scratch = Vec::with_capacity(text.len());
    canonicalize_text(text, &mut scratch)?;
    let mut deserializer = serde_json::Deserializer::from_slice(text);
    deserializer.disable_recursion_limit();
    let value =
        serde::Deserialize::deserialize(&mut deserializer).map_err(|_| CanonicalError::Syntax {
            offset: 0,
            reason: "invalid JSON",
        })?;
    deserializer.end().map_err(|_| CanonicalError::Syntax {
        offset: 0,
        reason: "extra data after the JSON value",
    })?;
    Ok(value)
}

/// `_file_digest(path)`: SHA-256 of raw bytes read in 1 MiB chunks (the chunk size does not
/// change the result), lowercase hex.
pub fn sha256_reader(mut reader: impl std::io::Read) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        match reader.read(&mut buffer) {
            Ok(0) => return Ok(hex(&hasher.finalize())),
            Ok(n) => hasher.update(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}
