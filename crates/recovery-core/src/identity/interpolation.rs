//! The subset of OmegaConf interpolation the configuration identity needs (decisions §2),
//! resolved against a JSON tree and an explicit environment map, never the process environment.
//!
//! Supported: absolute `${a.b.c}` (and `${a[0]}`), relative `${.x}` / `${..x}`, string templates,
//! whole-node references (a value that is exactly `${a}` takes the node, mapping or list),
//! escaped `\${...}`, `${oc.env:NAME}` / `${oc.env:NAME,default}` and `${oc.select:path,default}`.
//! OmegaConf quirks kept: an `oc.env` default is converted with Python's `str()` (`true` becomes
//! `"True"`, `1e3` becomes `"1000.0"`, `null` stays null, quotes are stripped); template pieces
//! are converted with `str()` (`None`, `True`, float `repr`); only strings containing `${` are
//! parsed at all. Anything else (another resolver, a nested interpolation inside resolver
//! arguments, a cycle, a missing key or variable) is an [`InterpolationError`] naming the key.

use crate::canonical::python_float_repr;
use regex::Regex;
use serde_json::{Map, Number, Value};
use std::collections::BTreeMap;
use std::sync::LazyLock;

/// One step of a path into the configuration tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Key(String),
    Index(usize),
}

/// Dotted display of a path (`a.b.0.c`).
pub fn display_path(path: &[Segment]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|s| match s {
            Segment::Key(k) => k.clone(),
            Segment::Index(i) => i.to_string(),
        })
        .collect();
    parts.join(".")
}

/// Why a value could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot resolve interpolation at '{key}': {message}")]
pub struct InterpolationError {
    /// Dotted key of the value being resolved.
    pub key: String,
    pub message: String,
}

static RESOLVER_CALL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\s*:(.*)$")
        .expect("static regex")
});
static INT_ELEMENT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[+-]?(?:0|[1-9](?:_?[0-9])*)$").expect("static regex"));
static FLOAT_ELEMENT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^[+-]?(?:(?:(?:[0-9](?:_?[0-9])*)?\.[0-9](?:_?[0-9])*|[0-9](?:_?[0-9])*\.)(?:[eE][+-]?[0-9](?:_?[0-9])*)?|[0-9](?:_?[0-9])*[eE][+-]?[0-9](?:_?[0-9])*)$")
        .expect("static regex")
});
static INF_NAN_ELEMENT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)^[+-]?(?:inf|nan)$").expect("static regex"));

/// A parsed piece of a string value.
#[derive(Debug, Clone, PartialEq)]
enum Part {
    Literal(String),
    Interpolation(Expression),
}

/// What is inside `${...}`.
#[derive(Debug, Clone, PartialEq)]
enum Expression {
    Node(String),
    Env {
        name: String,
        default: Option<Element>,
    },
    Select {
        key: String,
        default: Option<Element>,
    },
}

/// A resolver argument as OmegaConf's grammar reads it.
#[derive(Debug, Clone, PartialEq)]
enum Element {
    Null,
    Bool(bool),
    Int(String),
    Float(f64),
    Text(String),
}

/// Whether a string would be parsed as an interpolation at all.
pub fn has_interpolation(s: &str) -> bool {
    s.contains("${")
}

/// Resolves values of one tree. The tree may be replaced between calls (selected servers are
/// swapped for their filtered blocks), so the resolver borrows it per call.
#[derive(Debug)]
pub struct Resolver<'env> {
    env: &'env BTreeMap<String, String>,
    /// Paths of string values being resolved, to detect cycles.
    active: Vec<Vec<Segment>>,
}

impl<'env> Resolver<'env> {
    pub fn new(env: &'env BTreeMap<String, String>) -> Self {
        Self {
            env,
            active: Vec::new(),
        }
    }

    /// The fully resolved node at `path` of `root`.
    pub fn resolve_at(
        &mut self,
        root: &Value,
        path: &[Segment],
    ) -> Result<Value, InterpolationError> {
        let node = lookup(root, path).ok_or_else(|| InterpolationError {
            key: display_path(path),
            message: "key not found".into(),
        })?;
        self.resolve_value(root, node, path)
    }

    /// Resolves `value`, which lives at `path` of `root`.
    pub fn resolve_value(
        &mut self,
        root: &Value,
        value: &Value,
        path: &[Segment],
    ) -> Result<Value, InterpolationError> {
        match value {
            Value::String(s) if has_interpolation(s) => self.resolve_string(root, s, path),
            Value::Object(map) => {
                let mut resolved = Map::new();
                for (key, item) in map {
                    let mut child = path.to_vec();
                    child.push(Segment::Key(key.clone()));
                    resolved.insert(key.clone(), self.resolve_value(root, item, &child)?);
                }
                Ok(Value::Object(resolved))
            }
            Value::Array(items) => {
                let mut resolved = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let mut child = path.to_vec();
                    child.push(Segment::Index(i));
                    resolved.push(self.resolve_value(root, item, &child)?);
                }
                Ok(Value::Array(resolved))
            }
            other => Ok(other.clone()),
        }
    }

    fn resolve_string(
        &mut self,
        root: &Value,
        s: &str,
        path: &[Segment],
    ) -> Result<Value, InterpolationError> {
        let error = |message: String| InterpolationError {
            key: display_path(path),
            message,
        };
        if self.active.iter().any(|p| p == path) {
            return Err(error("recursive interpolation detected".into()));
        }
        let parts = parse_template(s).map_err(error)?;
        self.active.push(path.to_vec());
        let result = self.evaluate_parts(root, &parts, path);
        self.active.pop();
        result
    }

    fn evaluate_parts(
        &mut self,
        root: &Value,
        parts: &[Part],
        path: &[Segment],
    ) -> Result<Value, InterpolationError> {
        if let [Part::Interpolation(expression)] = parts {
            return self.evaluate(root, expression, path);
        }
        let mut text = String::new();
        for part in parts {
            match part {
                Part::Literal(literal) => text.push_str(literal),
                Part::Interpolation(expression) => {
                    let value = self.evaluate(root, expression, path)?;
                    text.push_str(&python_str(&value).ok_or_else(|| InterpolationError {
                        key: display_path(path),
                        message: "a mapping or list cannot be interpolated into a string".into(),
                    })?);
                }
            }
        }
        Ok(Value::String(text))
    }

    fn evaluate(
        &mut self,
        root: &Value,
        expression: &Expression,
        path: &[Segment],
    ) -> Result<Value, InterpolationError> {
        let error = |message: String| InterpolationError {
            key: display_path(path),
            message,
        };
        match expression {
            Expression::Node(reference) => {
                let target = absolute_path(reference, path).map_err(&error)?;
                self.follow(root, &target)?
                    .ok_or_else(|| error(format!("interpolation key '{reference}' not found")))
            }
            Expression::Select { key, default } => {
                let target = absolute_path(key, path).map_err(&error)?;
                match self.follow(root, &target)? {
                    Some(value) => Ok(value),
                    None => match default {
                        None => Ok(Value::Null),
                        Some(element) => element_value(element).map_err(error),
                    },
                }
            }
            Expression::Env { name, default } => match self.env.get(name) {
                Some(value) => Ok(Value::String(value.clone())),
                None => match default {
                    None => Err(error(format!("environment variable '{name}' not found"))),
                    Some(Element::Null) => Ok(Value::Null),
                    Some(element) => Ok(Value::String(element_str(element))),
                },
            },
        }
    }

    /// Walks `target` from the root, resolving an interpolated node met on the way (and going on
    /// inside its resolved value); `None` when a key is missing.
    fn follow(
        &mut self,
        root: &Value,
        target: &[Segment],
    ) -> Result<Option<Value>, InterpolationError> {
        let mut node = root;
        for (depth, segment) in target.iter().enumerate() {
            let Some(next) = step(node, segment) else {
                return Ok(None);
            };
            if let Value::String(s) = next
                && has_interpolation(s)
            {
                let mut current = self.resolve_string(root, s, &target[..=depth])?;
                for segment in &target[depth + 1..] {
                    let Some(inner) = step(&current, segment) else {
                        return Ok(None);
                    };
                    current = inner.clone();
                }
                return Ok(Some(current));
            }
            node = next;
        }
        Ok(Some(self.resolve_value(root, node, target)?))
    }
}

fn step<'v>(node: &'v Value, segment: &Segment) -> Option<&'v Value> {
    match (node, segment) {
        (Value::Object(map), Segment::Key(k)) => map.get(k),
        (Value::Object(map), Segment::Index(i)) => map.get(&i.to_string()),
        (Value::Array(items), Segment::Index(i)) => items.get(*i),
        (Value::Array(items), Segment::Key(k)) => items.get(k.parse::<usize>().ok()?),
        _ => None,
    }
}

fn lookup<'v>(root: &'v Value, path: &[Segment]) -> Option<&'v Value> {
    path.iter()
        .try_fold(root, |node, segment| step(node, segment))
}

/// Mutable access to the node at `path` (used to swap selected server blocks in).
pub fn lookup_mut<'v>(root: &'v mut Value, path: &[Segment]) -> Option<&'v mut Value> {
    let mut node = root;
    for segment in path {
        node = match (node, segment) {
            (Value::Object(map), Segment::Key(k)) => map.get_mut(k)?,
            (Value::Array(items), Segment::Index(i)) => items.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(node)
}

/// Turns a reference (`a.b`, `.x`, `..x`, `a[0].b`) into an absolute path, relative references
/// counting from the container of the value at `from`.
fn absolute_path(reference: &str, from: &[Segment]) -> Result<Vec<Segment>, String> {
    let dots = reference.bytes().take_while(|&b| b == b'.').count();
    let rest = &reference[dots..];
    let mut path: Vec<Segment> = if dots == 0 {
        Vec::new()
    } else {
        let container_len = from.len().saturating_sub(1);
        let up = dots - 1;
        if up > container_len {
            return Err(format!(
                "error resolving key '{reference}': no parent at that level"
            ));
        }
        from[..container_len - up].to_vec()
    };
    if rest.is_empty() {
        return if dots > 0 {
            Ok(path)
        } else {
            Err("empty interpolation key".into())
        };
    }
    for piece in rest.split('.') {
        let (name, indexes) = match piece.find('[') {
            Some(at) => (&piece[..at], &piece[at..]),
            None => (piece, ""),
        };
        if name.is_empty() && indexes.is_empty() {
            return Err(format!("invalid interpolation key '{reference}'"));
        }
        if !name.is_empty() {
            if name
                .chars()
                .any(|c| c.is_whitespace() || "${}[]:'\"\\".contains(c))
            {
                return Err(format!("invalid interpolation key '{reference}'"));
            }
            path.push(Segment::Key(name.to_owned()));
        }
        let mut remaining = indexes;
        while !remaining.is_empty() {
            let close = remaining
                .find(']')
                .ok_or_else(|| format!("invalid interpolation key '{reference}'"))?;
            let index: usize = remaining[1..close]
                .trim()
                .parse()
                .map_err(|_| format!("invalid interpolation key '{reference}'"))?;
            path.push(Segment::Index(index));
            remaining = &remaining[close + 1..];
            if !remaining.is_empty() && !remaining.starts_with('[') {
                return Err(format!("invalid interpolation key '{reference}'"));
            }
        }
    }
    Ok(path)
}

/// Splits a string value into literal text and interpolations, with OmegaConf's escapes: an odd
/// run of backslashes before `${` escapes it, each pair of them stands for one backslash.
fn parse_template(s: &str) -> Result<Vec<Part>, String> {
    let bytes = s.as_bytes();
    let mut parts = Vec::new();
    let mut literal = String::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            let run = bytes[i..].iter().take_while(|&&b| b == b'\\').count();
            if bytes[i + run..].starts_with(b"${") {
                literal.extend(std::iter::repeat_n('\\', run / 2));
                if run % 2 == 1 {
                    literal.push_str("${");
                    i += run + 2;
                    continue;
                }
                i += run;
            } else {
                literal.extend(std::iter::repeat_n('\\', run));
                i += run;
                continue;
            }
        }
        if bytes[i..].starts_with(b"${") {
            let end = matching_brace(bytes, i + 2)
                .ok_or_else(|| format!("unterminated interpolation in '{s}'"))?;
            if !literal.is_empty() {
                parts.push(Part::Literal(std::mem::take(&mut literal)));
            }
            parts.push(Part::Interpolation(parse_expression(&s[i + 2..end])?));
            i = end + 1;
            continue;
        }
        let ch = s[i..].chars().next().unwrap_or_default();
        literal.push(ch);
        i += ch.len_utf8().max(1);
    }
    if !literal.is_empty() {
        parts.push(Part::Literal(literal));
    }
    Ok(parts)
}

/// Index of the `}` closing an interpolation whose body starts at `start`.
fn matching_brace(bytes: &[u8], start: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = start;
    let mut quote: Option<u8> = None;
    while i < bytes.len() {
        let b = bytes[i];
        if let Some(q) = quote {
            if b == b'\\' {
                i += 2;
                continue;
            }
            if b == q {
                quote = None;
            }
        } else if b == b'\'' || b == b'"' {
            quote = Some(b);
        } else if bytes[i..].starts_with(b"${") {
            depth += 1;
            i += 2;
            continue;
        } else if b == b'}' {
            if depth == 0 {
                return Some(i);
            }
            depth -= 1;
        }
        i += 1;
    }
    None
}

fn parse_expression(body: &str) -> Result<Expression, String> {
    let body = body.trim();
    if body.is_empty() {
        return Err("empty interpolation '${}'".into());
    }
    let Some(call) = RESOLVER_CALL.captures(body) else {
        if body.contains("${") {
            return Err(format!(
                "nested interpolation '${{{body}}}' is not supported"
            ));
        }
        return Ok(Expression::Node(body.to_owned()));
    };
    let name = &call[1];
    let args = split_arguments(&call[2])?;
    match name {
        "oc.env" => {
            let (key, default) = one_or_two(name, args)?;
            let Element::Text(key) = key else {
                return Err("oc.env needs a variable name".into());
            };
            Ok(Expression::Env { name: key, default })
        }
        "oc.select" => {
            let (key, default) = one_or_two(name, args)?;
            let Element::Text(key) = key else {
                return Err("oc.select needs a key".into());
            };
            Ok(Expression::Select { key, default })
        }
        other => Err(format!(
            "unsupported interpolation resolver '{other}' (supported: oc.env, oc.select)"
        )),
    }
}

fn one_or_two(name: &str, mut args: Vec<Element>) -> Result<(Element, Option<Element>), String> {
    match args.len() {
        1 => Ok((args.remove(0), None)),
        2 => {
            let default = args.pop();
            Ok((args.remove(0), default))
        }
        n => Err(format!("{name} takes 1 or 2 arguments, {n} given")),
    }
}

fn split_arguments(text: &str) -> Result<Vec<Element>, String> {
    let mut args = Vec::new();
    let bytes = text.as_bytes();
    let mut start = 0;
    let mut quote: Option<u8> = None;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match quote {
            Some(q) => {
                if b == b'\\' {
                    i += 1;
                } else if b == q {
                    quote = None;
                }
            }
            None => match b {
                b'\'' | b'"' => quote = Some(b),
                b'[' | b']' | b'{' | b'}' => {
                    return Err(
                        "list, mapping and nested interpolation arguments are not supported".into(),
                    );
                }
                b',' => {
                    args.push(parse_element(&text[start..i])?);
                    start = i + 1;
                }
                _ => {}
            },
        }
        i += 1;
    }
    if quote.is_some() {
        return Err("unterminated quoted argument".into());
    }
    args.push(parse_element(&text[start..])?);
    Ok(args)
}

fn parse_element(raw: &str) -> Result<Element, String> {
    let text = raw.trim();
    if text.contains("${") {
        return Err("nested interpolation arguments are not supported".into());
    }
    let quoted = text.len() >= 2
        && ((text.starts_with('\'') && text.ends_with('\''))
            || (text.starts_with('"') && text.ends_with('"')));
    if quoted {
        let inner = &text[1..text.len() - 1];
        let mut out = String::new();
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            if c == '\\' {
                match chars.next() {
                    Some(n @ ('\'' | '"' | '\\')) => out.push(n),
                    Some(n) => {
                        out.push('\\');
                        out.push(n);
                    }
                    None => out.push('\\'),
                }
            } else {
                out.push(c);
            }
        }
        return Ok(Element::Text(out));
    }
    if text.eq_ignore_ascii_case("null") {
        return Ok(Element::Null);
    }
    if text.eq_ignore_ascii_case("true") {
        return Ok(Element::Bool(true));
    }
    if text.eq_ignore_ascii_case("false") {
        return Ok(Element::Bool(false));
    }
    if INT_ELEMENT.is_match(text) {
        let digits: String = text.chars().filter(|&c| c != '_' && c != '+').collect();
        let digits = if digits.trim_start_matches('-') == "0" {
            "0".to_owned()
        } else {
            digits
        };
        return Ok(Element::Int(digits));
    }
    if FLOAT_ELEMENT.is_match(text) || INF_NAN_ELEMENT.is_match(text) {
        let cleaned: String = text.chars().filter(|&c| c != '_').collect();
        let value: f64 = cleaned
            .to_ascii_lowercase()
            .parse()
            .map_err(|_| format!("invalid number '{text}'"))?;
        return Ok(Element::Float(value));
    }
    Ok(Element::Text(text.to_owned()))
}

/// Python's `str()` of a resolver argument.
fn element_str(element: &Element) -> String {
    match element {
        Element::Null => "None".into(),
        Element::Bool(true) => "True".into(),
        Element::Bool(false) => "False".into(),
        Element::Int(digits) => digits.clone(),
        Element::Float(f) => python_float_str(*f),
        Element::Text(t) => t.clone(),
    }
}

/// A resolver argument as a JSON value (`oc.select` returns it unconverted).
fn element_value(element: &Element) -> Result<Value, String> {
    Ok(match element {
        Element::Null => Value::Null,
        Element::Bool(b) => Value::Bool(*b),
        Element::Int(digits) => Value::Number(
            serde_json::from_str::<Number>(digits).map_err(|e| format!("invalid integer: {e}"))?,
        ),
        Element::Float(f) => {
            Value::Number(Number::from_f64(*f).ok_or("a non-finite default has no JSON form")?)
        }
        Element::Text(t) => Value::String(t.clone()),
    })
}

fn python_float_str(f: f64) -> String {
    if f.is_nan() {
        "nan".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf".into() } else { "-inf".into() }
    } else {
        python_float_repr(f)
    }
}

/// Python's `str()` of a resolved scalar; `None` for containers.
fn python_str(value: &Value) -> Option<String> {
    Some(match value {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::String(s) => s.clone(),
        Value::Number(n) => {
            let text = n.to_string();
            if text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
                text.parse::<f64>().map(python_float_str).unwrap_or(text)
            } else if text.trim_start_matches('-') == "0" {
                "0".into()
            } else {
                text
            }
        }
        Value::Array(_) | Value::Object(_) => return None,
    })
}
