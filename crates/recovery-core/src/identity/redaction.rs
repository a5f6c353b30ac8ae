//! Credential redaction (`_credential_safe`, decisions §3) and runtime-reference normalisation
//! (`_normalize_runtime_references`).
//!
//! Invariants: redaction runs on the raw tree before any interpolation is resolved, so a
//! credential is never read from the environment; it is idempotent; structure outside the
//! redacted values is untouched (a URL keeps its user, host, path and query; a string keeps the
//! text around a redacted interpolation); normalisation keeps the reference name and surrounding
//! text.

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
    // Every name the pattern matches holds one of these words. An ASCII name holding none is
    // answered without the pattern (the identity of each validate across drift asks of every
    // key of the configuration); other names go to the pattern, whose case-insensitivity also
    // folds letters such as the Kelvin sign into `k`.
    const WORDS: [&[u8]; 7] = [
        b"key",
        b"secret",
        b"passw",
        b"credential",
        b"cookie",
        b"authorization",
        b"token",
    ];
    let holds = |word: &[u8]| {
        name.as_bytes()
            .windows(word.len())
            .any(|w| w.eq_ignore_ascii_case(word))
    };
    if name.is_ascii() && !WORDS.iter().any(|word| holds(word)) {
        return false;
    }
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
///
/// Each pattern runs only on a string holding what it needs to match (an interpolation needs
/// `${`, an assignment `=`, an HTTP credential a leading `b`/`B`, a URL password `://` and `@`):
/// most configuration strings hold none, and the identity of every validate across drift redacts
/// all of them (profiled: the regex passes were 7% of such a validate's CPU). The answers are the
/// patterns' own; `redaction_skips_only_strings_a_pattern_cannot_change` checks the guards.
pub fn redact_string(s: &str) -> String {
    let mut text = if s.contains("${") {
        redact_interpolations(s)
    } else {
        s.to_owned()
    };
    if text.contains('=')
        && let Some(c) = ASSIGNMENT_RE.captures(&text)
        && is_credential_name(&c[1])
    {
        return format!("{}={REDACTED}", &c[1]);
    }
    if text
        .as_bytes()
        .first()
        .is_some_and(|b| b.eq_ignore_ascii_case(&b'b'))
        && let Some(c) = HTTP_CREDENTIAL_RE.captures(&text)
    {
        return format!("{} {REDACTED}", &c[1]);
    }
    if text.contains("://") && text.contains('@') {
        text = URL_PASSWORD_RE
            .replace_all(&text, |c: &Captures| redact_url(&c[0]))
            .into_owned();
    }
    text
}

/// The credential-named interpolations of a string holding `${`.
fn redact_interpolations(s: &str) -> String {
    let mut text = ENV_REFERENCE_RE
        .replace_all(s, |c: &Captures| {
            if is_credential_name(&c[1]) {
                REDACTED.to_owned()
            } else {
                c[0].to_owned()
            }
        })
        .into_owned();
    if text.contains("oc.env") {
        text = redact_unusual_env_references(&text);
    }
    CONFIG_REFERENCE_RE
        .replace_all(&text, |c: &Captures| {
            let last = c[1].rsplit('.').next().unwrap_or_default();
            if is_credential_name(last) {
                REDACTED.to_owned()
            } else {
                c[0].to_owned()
            }
        })
        .into_owned()
}

/// `${oc.env:...}` forms that Python's `_ENV_REFERENCE` does not see but OmegaConf resolves: a
/// quoted name (`${oc.env:'API_KEY'}`), a name computed by an interpolation (`${oc.env:${x}}`)
/// and a default holding one (`${oc.env:API_KEY,${x}}`). A credential-named or computed name
/// makes the whole occurrence `<redacted>`, so the variable is never read and never persisted.
/// The plain forms were handled by the Python-exact pattern before, so digests of ordinary
/// configurations stay byte-identical with Python's.
fn redact_unusual_env_references(text: &str) -> String {
    // OmegaConf allows whitespace around the resolver's name: `${ oc.env :NAME}`.
    static OPEN: LazyLock<Regex> = LazyLock::new(|| compile(r"\$\{\s*oc\.env\s*:"));
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = OPEN.find(rest) {
        out.push_str(&rest[..open.start()]);
        let body = &rest[open.end()..];
        let Some(end) = closing_brace(body) else {
            // Unbalanced: the resolver refuses it; nothing here to read from the environment.
            out.push_str(&rest[open.start()..]);
            return out;
        };
        let name = first_argument(&body[..end]);
        if name.contains("${") || is_credential_name(name) {
            out.push_str(REDACTED);
        } else {
            out.push_str(&rest[open.start()..open.end() + end + 1]);
        }
        rest = &body[end + 1..];
    }
    out.push_str(rest);
    out
}

/// The index of the `}` closing an interpolation whose body starts `body` (nested `${...}` and
/// braces inside quotes counted as OmegaConf's grammar does for balanced input).
fn closing_brace(body: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut quote: Option<char> = None;
    for (i, c) in body.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '{') => depth += 1,
            (None, '}') if depth == 0 => return Some(i),
            (None, '}') => depth -= 1,
            _ => {}
        }
    }
    None
}

/// The first resolver argument of an interpolation body, trimmed and unquoted.
fn first_argument(args: &str) -> &str {
    let mut depth = 0usize;
    let mut end = args.len();
    for (i, c) in args.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let name = args[..end].trim();
    name.strip_prefix('\'')
        .and_then(|n| n.strip_suffix('\''))
        .or_else(|| name.strip_prefix('"').and_then(|n| n.strip_suffix('"')))
        .map_or(name, str::trim)
}

/// A URL with its password redacted: `scheme://user:<redacted>@host...`. The user information
/// ends at the URL's last `@`, so a password holding `@`, `/`, `?` or `#` (`postgres://u:p@ss/
/// w?rd@h`) is hidden whole. Where a `@` sits in a path or query after a port
/// (`https://h:8080/p?to=a@b`), the text between the port's colon and that `@` is hidden too:
/// syntax cannot tell it from a password, and a secret is never kept to spare a host.
fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some(at) = rest.rfind('@') else {
        return url.to_owned();
    };
    let user_info = &rest[..at];
    let Some(colon) = user_info.find(':') else {
        return url.to_owned();
    };
    if user_info[..colon].contains(['/', '?', '#']) {
        // A colon in a path (`https://h/a:b@c`): no user information.
        return url.to_owned();
    }
    format!(
        "{scheme}://{}:{REDACTED}@{}",
        &user_info[..colon],
        &rest[at + 1..]
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `redact_string` as it was before its guards: every pattern on every string.
    fn unguarded(s: &str) -> String {
        let mut text = redact_interpolations(s);
        if let Some(c) = ASSIGNMENT_RE.captures(&text)
            && is_credential_name(&c[1])
        {
            return format!("{}={REDACTED}", &c[1]);
        }
        if let Some(c) = HTTP_CREDENTIAL_RE.captures(&text) {
            return format!("{} {REDACTED}", &c[1]);
        }
        text = URL_PASSWORD_RE
            .replace_all(&text, |c: &Captures| redact_url(&c[0]))
            .into_owned();
        text
    }

    /// Strings made of the pieces each pattern looks for (and case variants, spaces and
    /// non-ASCII letters that fold like ASCII ones), so guards that skipped a string a pattern
    /// would change show up.
    fn pieces() -> impl Strategy<Value = String> {
        let piece = prop::sample::select(vec![
            "${",
            "}",
            "oc.env:",
            "${oc.env:",
            " oc.env :",
            "API_KEY",
            "api_key",
            "x.token",
            "MY_TOKEN",
            "=",
            "b",
            "B",
            "bearer",
            "BASIC",
            "Bearer ",
            "ſ",
            "\u{212a}",
            "basic\t",
            "://",
            "https://",
            "u:p",
            "@",
            "h.example",
            "/",
            "?",
            "#",
            ":",
            ",",
            "'",
            "\"",
            " ",
            "\n",
            "x",
            "_",
            "1",
            "é",
        ]);
        prop::collection::vec(piece, 0..12).prop_map(|p| p.concat())
    }

    /// Names made of the pieces credential names are made of, in any case.
    fn names() -> impl Strategy<Value = String> {
        let piece = prop::sample::select(vec![
            "api",
            "API",
            "_",
            "-",
            "key",
            "KEY",
            "Key",
            "secret",
            "SECRET",
            "passw",
            "PASSWORD",
            "or",
            "d",
            "cred",
            "credential",
            "Cookie",
            "authorization",
            "token",
            "TOKEN",
            "x",
            "max",
            "ſ",
            "\u{212a}",
            "é",
            "ey",
            "s",
            "ecret",
        ]);
        prop::collection::vec(piece, 0..6).prop_map(|p| p.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        #[test]
        fn a_name_without_a_credential_word_is_what_the_pattern_says(name in names()) {
            prop_assert_eq!(is_credential_name(&name), CREDENTIAL_NAME_RE.is_match(&name));
        }

        #[test]
        fn redaction_skips_only_strings_a_pattern_cannot_change(s in pieces()) {
            prop_assert_eq!(redact_string(&s), unguarded(&s));
        }
    }
}
