//! Credential redaction (`_credential_safe`, decisions §3) and runtime-reference normalisation
//! (`_normalize_runtime_references`).
//!
//! Invariants: redaction runs on the raw tree before any interpolation is resolved, so a
//! credential is never read from the environment; it is idempotent; structure outside the
//! redacted values is untouched; normalisation keeps the reference name and surrounding text.

use super::tables::{
    ASSIGNMENT, CONFIG_REFERENCE, CREDENTIAL_NAME, ENV_REFERENCE, HTTP_CREDENTIAL, REDACTED,
    RUNTIME_REFERENCE, SERVER_KINDS, SERVER_RUNTIME_OPTIONS, URL_PASSWORD,
};
use regex::{Captures, Regex};
use serde_json::{Map, Value};
use std::sync::LazyLock;

fn compile(pattern: &str) -> Regex {
    Regex::new(pattern).expect("static regex")
}

static CREDENTIAL_NAME_RE: LazyLock<Regex> = LazyLock::new(|| compile(CREDENTIAL_NAME));
static ASSIGNMENT_RE: LazyLock<Regex> = LazyLock::new(|| compile(ASSIGNMENT));
static HTTP_CREDENTIAL_RE: LazyLock<Regex> = LazyLock::new(|| compile(HTTP_CREDENTIAL));
static ENV_REFERENCE_RE: LazyLock<Regex> = LazyLock::new(|| compile(ENV_REFERENCE));
static CONFIG_REFERENCE_RE: LazyLock<Regex> = LazyLock::new(|| compile(CONFIG_REFERENCE));
static URL_PASSWORD_RE: LazyLock<Regex> = LazyLock::new(|| compile(URL_PASSWORD));
static RUNTIME_REFERENCE_RE: LazyLock<Regex> = LazyLock::new(|| compile(RUNTIME_REFERENCE));

/// `_is_credential_name`: whether a key, variable or setting name names a credential.
pub fn is_credential_name(name: &str) -> bool {
    CREDENTIAL_NAME_RE.is_match(name)
}

/// `_credential_safe(value, secret)`: the value with every credential replaced by `<redacted>`.
pub fn credential_safe(value: &Value, secret: bool) -> Value {
    if secret {
        return Value::String(REDACTED.to_owned());
    }
    match value {
        Value::Object(map) => {
            // A `{name: SOME_TOKEN, value: ...}` entry carries its credential in `value`.
            let named_credential =
                matches!(map.get("name"), Some(Value::String(n)) if is_credential_name(n));
            let mut out = Map::new();
            for (key, item) in map {
                let secret = is_credential_name(key) || (named_credential && key == "value");
                out.insert(key.clone(), credential_safe(item, secret));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|item| credential_safe(item, false))
                .collect(),
        ),
        Value::String(s) => Value::String(redact_string(s)),
        other => other.clone(),
    }
}

/// Redacts the credential shapes a string can hold.
pub fn redact_string(s: &str) -> String {
    let mut text = ENV_REFERENCE_RE
        .replace_all(s, |c: &Captures| {
            if is_credential_name(&c[1]) {
                REDACTED.to_owned()
            } else {
                c[0].to_owned()
            }
        })
        .into_owned();
    text = CONFIG_REFERENCE_RE
        .replace_all(&text, |c: &Captures| {
            let last = c[1].rsplit('.').next().unwrap_or_default();
            if is_credential_name(last) {
                REDACTED.to_owned()
            } else {
                c[0].to_owned()
            }
        })
        .into_owned();
    if let Some(c) = ASSIGNMENT_RE.captures(&text)
        && is_credential_name(&c[1])
    {
        return format!("{}={REDACTED}", &c[1]);
    }
    if let Some(c) = HTTP_CREDENTIAL_RE.captures(&text) {
        return format!("{} {REDACTED}", &c[1]);
    }
    URL_PASSWORD_RE
        .replace_all(&text, |c: &Captures| redact_url(&c[0]))
        .into_owned()
}

/// A URL with its password (see [`URL_PASSWORD`]) redacted: `scheme://user:<redacted>@host...`.
fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(first_at) = authority.find('@') else {
        return url.to_owned();
    };
    let Some(colon) = authority[..first_at].find(':') else {
        return url.to_owned();
    };
    let last_at = rest.rfind('@').unwrap_or(first_at);
    format!(
        "{scheme}://{}:{REDACTED}@{}",
        &rest[..colon],
        &rest[last_at + 1..]
    )
}

/// Whether a referenced name is a runtime (connection) setting: a top-level runtime option, or
/// `<server>.<kind>.<implementation>.<runtime option>`.
fn is_runtime_reference(reference: &str) -> bool {
    if SERVER_RUNTIME_OPTIONS.contains(&reference) {
        return true;
    }
    let parts: Vec<&str> = reference.split('.').collect();
    parts.len() == 4
        && SERVER_KINDS.contains(&parts[1])
        && SERVER_RUNTIME_OPTIONS.contains(&parts[3])
}

/// `_normalize_runtime_references`: every `${REF}` naming a runtime setting becomes the literal
/// `<runtime:REF>`, wherever clients nest it; literal values are never touched.
pub fn normalize_runtime_references(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), normalize_runtime_references(v)))
                .collect(),
        ),
        Value::Array(items) => {
            Value::Array(items.iter().map(normalize_runtime_references).collect())
        }
        Value::String(s) if s.contains("${") => Value::String(
            RUNTIME_REFERENCE_RE
                .replace_all(s, |c: &Captures| {
                    if is_runtime_reference(&c[1]) {
                        format!("<runtime:{}>", &c[1])
                    } else {
                        c[0].to_owned()
                    }
                })
                .into_owned(),
        ),
        other => other.clone(),
    }
}
