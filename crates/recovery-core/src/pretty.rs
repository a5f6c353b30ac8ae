//! The pretty JSON CPython's `json.dumps(value, indent=2, allow_nan=False) + "\n"` writes, as
//! `atomic_write_json` publishes manifests and identities.
//!
//! Invariants: keys keep insertion order (not sorted); `ensure_ascii` is on, so every character
//! outside `' '..='~'` is a `\uXXXX` escape (astral characters as surrogate pairs, lowercase hex);
//! items end with `,` at the line end, keys are followed by `": "`; empty containers print `{}`
//! and `[]`; numbers print like the canonical form (Python `repr` for floats).

use crate::canonical::{CanonicalError, MAX_DEPTH, canonical_value};
use serde_json::Value;

/// Pretty JSON of a value followed by a newline, exactly as Python writes it.
pub fn python_pretty(value: &Value) -> Result<String, CanonicalError> {
    let mut out = String::new();
    write(value, 0, &mut out)?;
    out.push('\n');
    Ok(out)
}

fn indent(level: usize, out: &mut String) {
    out.push('\n');
    for _ in 0..level {
        out.push_str("  ");
    }
}

fn write(value: &Value, level: usize, out: &mut String) -> Result<(), CanonicalError> {
    if level > MAX_DEPTH {
        return Err(CanonicalError::TooDeep { offset: 0 });
    }
    match value {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                indent(level + 1, out);
                write(item, level + 1, out)?;
            }
            indent(level, out);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                indent(level + 1, out);
                write_ascii_string(key, out);
                out.push_str(": ");
                write(item, level + 1, out)?;
            }
            indent(level, out);
            out.push('}');
        }
        Value::String(s) => write_ascii_string(s, out),
        // Scalars and empty containers print as in the canonical form.
        other => out.push_str(&canonical_value(other)?),
    }
    Ok(())
}

/// A JSON string with Python's `ensure_ascii=True` escapes.
pub fn write_ascii_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
}
