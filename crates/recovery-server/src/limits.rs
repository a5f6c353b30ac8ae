//! Bounded request fields: every free-text field and id a client sends has a length limit, so a
//! 10 MB `reason` or `lease_id` is refused naming the field instead of reaching the journal, the
//! database, the audit log or an echo.
//!
//! Used as `#[serde(deserialize_with = "limits::id")]` (and `opt_*` with `#[serde(default)]`); the
//! same numbers appear in the schema as `max_length`, so a generated client knows them.

use serde::de::{Deserialize, Deserializer, Error};

/// Ids (lease, rollout, failure), holder and host names.
pub const ID: usize = 256;
/// Reasons and other human text (an operator's note, an outcome word).
pub const TEXT: usize = 4096;
/// File system paths (Linux `PATH_MAX`).
pub const PATH: usize = 4096;
/// One saved JSONL line quoted back (a predecessor failure line).
pub const LINE: usize = 1 << 20;
/// Rollout ids in one reservation.
pub const ROLLOUT_IDS: usize = 100_000;

/// The largest attempt cap a run may be created with (a cap counts dispatches; extensions
/// are added to it).
pub const MAX_ROLLOUT_ATTEMPTS: u64 = 1_000_000;

/// An attempt cap written on a command line or in an environment variable, with the range a
/// request's cap is refused with.
pub fn parse_attempt_cap(text: &str) -> Result<u64, String> {
    text.trim()
        .parse::<u64>()
        .ok()
        .filter(|cap| (1..=MAX_ROLLOUT_ATTEMPTS).contains(cap))
        .ok_or_else(|| format!("'{text}' is not an integer between 1 and {MAX_ROLLOUT_ATTEMPTS}"))
}

/// A JSON number that must be an integer, kept whatever its size: one past 64 bits (which
/// serde_json reads as a float) saturates, so the caller's range check refuses it with the
/// range as it refuses `0` or `-1`. A fraction or another type is refused here, by its type
/// (never repeated: a string could be anything).
fn saturating_integer<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i128>, D::Error> {
    let Some(number) = optional_number(d, "an integer")? else {
        return Ok(None);
    };
    if let Some(n) = number.as_i64() {
        return Ok(Some(i128::from(n)));
    }
    if let Some(n) = number.as_u64() {
        return Ok(Some(i128::from(n)));
    }
    match number.as_f64() {
        Some(f) if f.fract() == 0.0 => Ok(Some(if f < 0.0 { i128::MIN } else { i128::MAX })),
        _ => Err(D::Error::custom(format!(
            "{number} is a float: must be an integer"
        ))),
    }
}

/// `null` or an integer (see [`saturating_integer`]); negative and too large alike become
/// numbers the caller's range refuses (`0` and `u64::MAX`).
pub fn opt_saturating_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Ok(saturating_integer(d)?.map(|n| u64::try_from(n.max(0)).unwrap_or(u64::MAX)))
}

/// An integer (see [`saturating_integer`]), clamped to `i64`.
pub fn saturating_i64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    match saturating_integer(d)? {
        Some(n) => Ok(i64::try_from(n).unwrap_or(if n < 0 { i64::MIN } else { i64::MAX })),
        None => Err(D::Error::custom("got null: must be an integer")),
    }
}

/// `null` (or absent) or a JSON number; any other type is refused by its type as not what the
/// field `must` be, never repeated (a string could be anything).
fn optional_number<'de, D: Deserializer<'de>>(
    d: D,
    must: &str,
) -> Result<Option<serde_json::Number>, D::Error> {
    match Option::<serde_json::Value>::deserialize(d)? {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Number(number)) => Ok(Some(number)),
        Some(other) => Err(D::Error::custom(format!(
            "got {}: must be {must}",
            json_kind(&other)
        ))),
    }
}

/// How a JSON value's type is named in a refusal.
fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// An attempt cap: a whole number from 1 to [`MAX_ROLLOUT_ATTEMPTS`]. Any other number is
/// refused with that range, the value named (`-1` and `10^30` as `0` is, not as a type).
pub fn opt_attempts<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let must = format!("an integer between 1 and {MAX_ROLLOUT_ATTEMPTS}");
    let Some(number) = optional_number(d, &must)? else {
        return Ok(None);
    };
    if let Some(cap) = number
        .as_u64()
        .filter(|cap| (1..=MAX_ROLLOUT_ATTEMPTS).contains(cap))
    {
        return Ok(Some(cap));
    }
    // A number written with `.`, `e` or `E` is a float (as CPython reads it), `1e3` too.
    let what = if number.is_f64() {
        "is a float: must be an integer"
    } else {
        "is out of range: must be"
    };
    Err(D::Error::custom(format!(
        "{number} {what} between 1 and {MAX_ROLLOUT_ATTEMPTS}"
    )))
}

fn bounded<'de, D: Deserializer<'de>>(deserializer: D, max: usize) -> Result<String, D::Error> {
    let value = String::deserialize(deserializer)?;
    if value.len() > max {
        return Err(D::Error::custom(format!(
            "{} bytes is longer than the {max} this field takes",
            value.len()
        )));
    }
    Ok(value)
}

fn bounded_opt<'de, D: Deserializer<'de>>(
    deserializer: D,
    max: usize,
) -> Result<Option<String>, D::Error> {
    match Option::<String>::deserialize(deserializer)? {
        Some(value) if value.len() > max => Err(D::Error::custom(format!(
            "{} bytes is longer than the {max} this field takes",
            value.len()
        ))),
        other => Ok(other),
    }
}

pub fn id<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let value = bounded(d, ID)?;
    if value.is_empty() {
        // An empty id names nothing: refused here rather than looked up and not found.
        return Err(D::Error::custom("must not be empty"));
    }
    Ok(value)
}

/// A name shown to people (a lease's holder and host): bounded like [`id`], and without
/// control characters or bidirectional overrides, which would make one name pose as another.
pub fn name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let value = bounded(d, ID)?;
    if let Some(c) = value
        .chars()
        .find(|c| c.is_control() || is_invisible_format(*c))
    {
        return Err(D::Error::custom(format!(
            "holds the character U+{:04X}; names take no control or bidirectional characters",
            u32::from(c)
        )));
    }
    Ok(value)
}

/// Unicode format and separator characters that change how a name reads without showing:
/// bidirectional marks and overrides, zero-width characters, line and paragraph separators, the
/// soft hyphen, the byte-order mark and tags.
pub fn is_invisible_format(c: char) -> bool {
    matches!(
        c,
        '\u{00ad}'
            | '\u{061c}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}'
            | '\u{feff}'
            | '\u{e0000}'..='\u{e007f}'
    )
}

/// An optional id: absent is `None`; present, it is bounded and non-empty like [`id`] (an
/// empty `lease_id` or `run_id` names nothing, and is refused naming the field rather than
/// looked up and not found).
pub fn opt_id<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let value = bounded_opt(d, ID)?;
    if value.as_deref() == Some("") {
        return Err(D::Error::custom("must not be empty"));
    }
    Ok(value)
}

pub fn text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    bounded(d, TEXT)
}

/// A path of a body (`output_path`, `source_path`). A URL (`scheme://...`) is no file path, and
/// may carry a credential (`https://user:password@host`, a token in its query): it is refused
/// without being repeated, as paths are said back in refusals and kept in validation records
/// (hostile review 31). Other paths are taken as sent: reading credentials out of file names
/// by pattern refused sweep directories (`eos_token=eos`) and still missed `Bearer ...` in a
/// component (hostile review 32), so the README asks for no secrets in paths instead.
pub fn path<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    not_a_url(bounded(d, PATH)?)
}

/// [`path`] for an optional one (a lease's `checkpoint_dir`).
pub fn opt_path<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    bounded_opt(d, PATH)?.map(not_a_url).transpose()
}

fn not_a_url<E: serde::de::Error>(path: String) -> Result<String, E> {
    if path.contains("://") {
        return Err(E::custom(
            "is a URL, not a file path (a URL may carry a credential, so it is not repeated); \
             name a file under the service's roots",
        ));
    }
    Ok(path)
}

pub fn line<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    bounded(d, LINE)
}

/// A list of ids, each bounded like [`id`], at most [`ROLLOUT_IDS`] of them.
pub fn ids<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let values = Vec::<String>::deserialize(d)?;
    if values.len() > ROLLOUT_IDS {
        return Err(D::Error::custom(format!(
            "{} ids are more than the {ROLLOUT_IDS} one call takes",
            values.len()
        )));
    }
    if let Some((i, long)) = values.iter().enumerate().find(|(_, v)| v.len() > ID) {
        return Err(D::Error::custom(format!(
            "[{i}]: {} bytes is longer than the {ID} an id takes",
            long.len()
        )));
    }
    Ok(values)
}
