//! The subset of OmegaConf interpolation the configuration identity needs (decisions §2),
//! resolved against a JSON tree and an explicit environment map, never the process environment.
//!
//! Supported: absolute `${a.b.c}` (and `${a[0]}`), relative `${.x}` / `${..x}`, string templates,
//! whole-node references (a value that is exactly `${a}` takes the node, mapping or list),
//! escaped `\${...}`, `${oc.env:NAME}` / `${oc.env:NAME,default}` and `${oc.select:path,default}`.
//! OmegaConf quirks kept: an `oc.env` default is converted with Python's `str()` (`true` becomes
//! `"True"`, `1e3` becomes `"1000.0"`, `null` stays null, quotes are stripped); template pieces
//! are converted with `str()` (`None`, `True`, float `repr`); only strings containing `${` are
//! parsed at all. Resolver arguments follow OmegaConf's grammar (quoted strings, nested
//! interpolations). Anything else (another resolver, a cycle, a missing key or variable) is an
//! [`InterpolationError`] naming the key.

use crate::canonical::python_float_repr;
use regex::Regex;
use serde_json::{Map, Number, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::LazyLock;

/// One step of a path into the configuration tree.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
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

impl InterpolationError {
    /// This error with its key under `internal` (a tree resolved in place under a key of the
    /// caller's) named under `public` instead, as the sender knows the tree.
    pub fn rooted_at(mut self, internal: &str, public: &str) -> Self {
        if let Some(rest) = self.key.strip_prefix(internal)
            && (rest.is_empty() || rest.starts_with('.'))
        {
            self.key = format!("{public}{rest}");
        }
        self
    }
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
        name: Argument,
        default: Option<Argument>,
    },
    Select {
        key: Argument,
        default: Option<Argument>,
    },
}

/// A resolver argument as OmegaConf's grammar reads it: an unquoted primitive (typed when it is
/// one number, boolean or null token), a quoted string, a list or a mapping; primitives and
/// quoted strings may hold interpolations.
#[derive(Debug, Clone, PartialEq)]
enum Argument {
    Typed(Scalar),
    Text(Vec<Piece>),
    Quoted(Vec<Piece>),
    List(Vec<Argument>),
    Mapping(Vec<(String, Argument)>),
}

/// A piece of an argument's text.
#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Literal(String),
    Interpolation(Box<Expression>),
}

/// A typed primitive.
#[derive(Debug, Clone, PartialEq)]
enum Scalar {
    Null,
    Bool(bool),
    Int(String),
    Float(f64),
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
    /// Nodes and template bytes still allowed: references that repeat references grow
    /// exponentially (a 2 KB configuration can resolve to gigabytes), so resolution stops at a
    /// size no real configuration reaches.
    nodes_left: usize,
    bytes_left: usize,
    /// The interpolated strings resolved in this call (the tree is fixed during a call), with
    /// what resolving them took of the budgets: a string met again (a chain `k0: ${.k1}`,
    /// `k1: ${.k2}`, ... resolves every later link once per earlier one, cubic in its length:
    /// hostile review 55, F10) is answered from here and charged the same, so the budgets
    /// run out exactly where they would have.
    resolved: HashMap<Vec<Segment>, Memo>,
}

#[derive(Debug)]
struct Memo {
    value: Value,
    nodes: usize,
    bytes: usize,
}

/// The most nodes one resolution produces.
pub const MAX_RESOLVED_NODES: usize = 500_000;
/// The most bytes of string templates one resolution produces.
pub const MAX_RESOLVED_BYTES: usize = 64 << 20;
/// The most interpolations resolved one inside another (a chain of references): deeper ones are
/// refused before the stack runs out. OmegaConf stops well before it, with a `RecursionError`
/// (a chain of 100 references already).
pub const MAX_NESTED_INTERPOLATIONS: usize = 256;

impl<'env> Resolver<'env> {
    pub fn new(env: &'env BTreeMap<String, String>) -> Self {
        Self {
            env,
            active: Vec::new(),
            nodes_left: MAX_RESOLVED_NODES,
            bytes_left: MAX_RESOLVED_BYTES,
            resolved: HashMap::new(),
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
        // The tree may have changed since the last call: nothing resolved then is reused.
        self.resolved.clear();
        self.resolve_node(root, value, path)
    }

    fn charge_nodes(&mut self, nodes: usize, path: &[Segment]) -> Result<(), InterpolationError> {
        self.nodes_left = self.nodes_left.checked_sub(nodes).ok_or_else(|| InterpolationError {
            key: display_path(path),
            message: format!(
                "the configuration resolves to more than {MAX_RESOLVED_NODES} values (references repeating references)"
            ),
        })?;
        Ok(())
    }

    fn charge_bytes(&mut self, bytes: usize, path: &[Segment]) -> Result<(), InterpolationError> {
        self.bytes_left = self
            .bytes_left
            .checked_sub(bytes)
            .ok_or_else(|| InterpolationError {
                key: display_path(path),
                message: format!(
                    "the configuration's templates resolve to more than {MAX_RESOLVED_BYTES} bytes"
                ),
            })?;
        Ok(())
    }

    fn resolve_node(
        &mut self,
        root: &Value,
        value: &Value,
        path: &[Segment],
    ) -> Result<Value, InterpolationError> {
        self.charge_nodes(1, path)?;
        match value {
            Value::String(s) if has_interpolation(s) => self.resolve_string(root, s, path),
            Value::Object(map) => {
                let mut resolved = Map::new();
                for (key, item) in map {
                    let mut child = path.to_vec();
                    child.push(Segment::Key(key.clone()));
                    resolved.insert(key.clone(), self.resolve_node(root, item, &child)?);
                }
                Ok(Value::Object(resolved))
            }
            Value::Array(items) => {
                let mut resolved = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let mut child = path.to_vec();
                    child.push(Segment::Index(i));
                    resolved.push(self.resolve_node(root, item, &child)?);
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
        if let Some(memo) = self.resolved.get(path) {
            let (value, nodes, bytes) = (memo.value.clone(), memo.nodes, memo.bytes);
            self.charge_nodes(nodes, path)?;
            self.charge_bytes(bytes, path)?;
            return Ok(value);
        }
        if self.active.iter().any(|p| p == path) {
            return Err(error("recursive interpolation detected".into()));
        }
        if self.active.len() >= MAX_NESTED_INTERPOLATIONS {
            return Err(error(format!(
                "interpolations nested deeper than {MAX_NESTED_INTERPOLATIONS} (a chain of references; OmegaConf stops before, with a RecursionError)"
            )));
        }
        let parts = parse_template(s).map_err(error)?;
        let (nodes_before, bytes_before) = (self.nodes_left, self.bytes_left);
        self.active.push(path.to_vec());
        let result = self.evaluate_parts(root, &parts, path);
        self.active.pop();
        if let Ok(value) = &result {
            let memo = Memo {
                value: value.clone(),
                nodes: nodes_before - self.nodes_left,
                bytes: bytes_before - self.bytes_left,
            };
            self.resolved.insert(path.to_vec(), memo);
        }
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
                    // OmegaConf puts a mapping or list into a template through `str()`.
                    let value = self.evaluate(root, expression, path)?;
                    text.push_str(&python_str(&value));
                }
            }
        }
        self.charge_bytes(text.len(), path)?;
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
                    .ok_or_else(|| error(REFERENCE_NOT_FOUND.to_owned()))
            }
            Expression::Select { key, default } => {
                let key = self.argument_text(root, key, path)?;
                let target = absolute_path(&key, path).map_err(&error)?;
                match self.follow(root, &target)? {
                    Some(value) => Ok(value),
                    None => match default {
                        None => Ok(Value::Null),
                        Some(argument) => {
                            let value = self.argument(root, argument, path)?;
                            value.into_json().map_err(error)
                        }
                    },
                }
            }
            Expression::Env { name, default } => {
                let name = self.argument_text(root, name, path)?;
                if name.is_empty() {
                    return Err(error("oc.env needs a variable name".into()));
                }
                match self.env.get(&name) {
                    Some(value) => Ok(Value::String(value.clone())),
                    None => match default {
                        None => Err(error(VARIABLE_NOT_FOUND.to_owned())),
                        Some(argument) => match self.argument(root, argument, path)? {
                            // `oc.env` passes its default through `str()`, except None.
                            Resolved::Json(Value::Null) => Ok(Value::Null),
                            value => Ok(Value::String(value.python_str())),
                        },
                    },
                }
            }
        }
    }

    /// An argument's value.
    fn argument(
        &mut self,
        root: &Value,
        argument: &Argument,
        path: &[Segment],
    ) -> Result<Resolved, InterpolationError> {
        Ok(match argument {
            Argument::Typed(scalar) => Resolved::of_scalar(scalar),
            Argument::Text(pieces) => {
                // A primitive that is one interpolation takes its value, typed.
                if let [Piece::Interpolation(expression)] = pieces.as_slice() {
                    Resolved::Json(self.evaluate(root, expression, path)?)
                } else {
                    Resolved::Json(Value::String(self.pieces_text(root, pieces, path)?))
                }
            }
            Argument::Quoted(pieces) => {
                Resolved::Json(Value::String(self.pieces_text(root, pieces, path)?))
            }
            Argument::List(items) => Resolved::List(
                items
                    .iter()
                    .map(|item| self.argument(root, item, path))
                    .collect::<Result<_, _>>()?,
            ),
            Argument::Mapping(entries) => Resolved::Mapping(
                entries
                    .iter()
                    .map(|(key, item)| Ok((key.clone(), self.argument(root, item, path)?)))
                    .collect::<Result<_, InterpolationError>>()?,
            ),
        })
    }

    /// An argument as text (a resolver's key or variable name): its value through `str()`.
    fn argument_text(
        &mut self,
        root: &Value,
        argument: &Argument,
        path: &[Segment],
    ) -> Result<String, InterpolationError> {
        Ok(self.argument(root, argument, path)?.python_str())
    }

    /// Literal text and interpolations (through `str()`), concatenated.
    fn pieces_text(
        &mut self,
        root: &Value,
        pieces: &[Piece],
        path: &[Segment],
    ) -> Result<String, InterpolationError> {
        let mut text = String::new();
        for piece in pieces {
            match piece {
                Piece::Literal(literal) => text.push_str(literal),
                Piece::Interpolation(expression) => {
                    text.push_str(&python_str(&self.evaluate(root, expression, path)?));
                }
            }
        }
        Ok(text)
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
            // A path through a redacted credential (a `secrets` mapping redacted whole) names a
            // credential: it resolves to the marker, never to a missing key.
            if node.as_str() == Some(super::tables::REDACTED) {
                return Ok(Some(node.clone()));
            }
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
        Ok(Some(self.resolve_node(root, node, target)?))
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
                "a relative key climbs {up} levels above its container, past the root"
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
            return Err(invalid_reference());
        }
        if !name.is_empty() {
            if name
                .chars()
                .any(|c| c.is_whitespace() || "${}[]:'\"\\".contains(c))
            {
                return Err(invalid_reference());
            }
            path.push(Segment::Key(name.to_owned()));
        }
        let mut remaining = indexes;
        while !remaining.is_empty() {
            let close = remaining.find(']').ok_or_else(invalid_reference)?;
            // `[0]` indexes a list; `[name]` is a key (OmegaConf's bracket keys).
            let inside = remaining[1..close].trim();
            if inside.is_empty() {
                return Err(invalid_reference());
            }
            path.push(match inside.parse::<usize>() {
                Ok(index) => Segment::Index(index),
                Err(_) => Segment::Key(inside.to_owned()),
            });
            remaining = &remaining[close + 1..];
            if !remaining.is_empty() && !remaining.starts_with('[') {
                return Err(invalid_reference());
            }
        }
    }
    Ok(path)
}

/// Refusals name the key whose value holds the interpolation and say what is wrong, never text
/// of the value itself (a reference, a variable's name, a resolver's name): a value may hold a
/// credential no redaction pattern recognises, and refusals are recorded and logged.
const REFERENCE_NOT_FOUND: &str =
    "an interpolation refers to a key the configuration does not have";

/// A missing `oc.env` variable (see [`REFERENCE_NOT_FOUND`] for why it is not named).
const VARIABLE_NOT_FOUND: &str = "an oc.env interpolation names an environment variable the \
     request's `environment` does not hold (and has no default)";

/// Why a reference is not a key path. The reference is not quoted: it failed to be a name, so
/// it may be any text the value held (refusals are recorded and logged).
fn invalid_reference() -> String {
    "invalid interpolation key: a key path is names separated by '.', with [index] or [name] \
     steps, and holds no whitespace, '$', '{', '}', ':', quotes or backslashes"
        .to_owned()
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
            let end =
                matching_brace(bytes, i + 2).ok_or_else(|| unterminated_interpolation(&s[..i]))?;
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
        } else if b == b'{' {
            // A mapping argument (`{a: 1}`) nests like an interpolation.
            depth += 1;
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

/// A `${` with no `}` closing it, named by where it starts (the text before it is counted, never
/// quoted: the value may hold a credential the redaction did not recognise, and refusals are
/// recorded and logged).
fn unterminated_interpolation(before: &str) -> String {
    format!(
        "the interpolation starting at character {} is never closed (a '${{' without its '}}')",
        before.chars().count() + 1
    )
}

fn parse_expression(body: &str) -> Result<Expression, String> {
    let body = body.trim();
    if body.is_empty() {
        return Err("empty interpolation '${}'".into());
    }
    let Some(call) = RESOLVER_CALL.captures(body) else {
        if body.contains("${") {
            return Err(
                "an interpolation inside a key reference (`${a.${b}}`) is not supported".into(),
            );
        }
        return Ok(Expression::Node(body.to_owned()));
    };
    let name = &call[1];
    let args = parse_arguments(&call[2])?;
    match name {
        "oc.env" => {
            let (name, default) = one_or_two("oc.env", args)?;
            Ok(Expression::Env { name, default })
        }
        "oc.select" => {
            let (key, default) = one_or_two("oc.select", args)?;
            Ok(Expression::Select { key, default })
        }
        // The name is not repeated: it is whatever came before a `:` in the value.
        _ => Err(
            "unsupported interpolation resolver (supported: oc.env, oc.select; any other \
             `name:` at the start of an interpolation is read as a resolver)"
                .to_owned(),
        ),
    }
}

fn one_or_two(name: &str, mut args: Vec<Argument>) -> Result<(Argument, Option<Argument>), String> {
    match args.len() {
        1 => Ok((args.remove(0), None)),
        2 => {
            let default = args.pop();
            Ok((args.remove(0), default))
        }
        n => Err(format!("{name} takes 1 or 2 arguments, {n} given")),
    }
}

/// Characters an unquoted argument may hold (OmegaConf's `ID`, `UNQUOTED_CHAR`, `:` and
/// whitespace); anything else (`=`, `(`, `!`, a quote inside, ...) is a grammar error.
fn unquoted_allowed(c: char) -> bool {
    c.is_ascii_alphanumeric() || "_-/\\+.$%*@?|: \t".contains(c)
}

/// Characters a backslash escapes in an unquoted argument.
const ESCAPABLE: &str = "\\()[]{}:=, \t";

/// The resolver arguments of `text` (what follows `name:`), as OmegaConf's grammar reads them.
fn parse_arguments(text: &str) -> Result<Vec<Argument>, String> {
    let mut parser = Arguments { text, pos: 0 };
    let args = parser.sequence(None)?;
    if parser.pos < text.len() {
        return Err(parser.unexpected());
    }
    Ok(args)
}

struct Arguments<'a> {
    text: &'a str,
    pos: usize,
}

impl Arguments<'_> {
    fn peek(&self) -> Option<char> {
        self.text[self.pos..].chars().next()
    }

    /// The 1-based character position of the cursor, for messages that must not quote the
    /// arguments themselves.
    fn character(&self) -> usize {
        self.character_at(self.pos)
    }

    fn character_at(&self, byte: usize) -> usize {
        self.text[..byte].chars().count() + 1
    }

    fn skip_spaces(&mut self) {
        while let Some(c @ (' ' | '\t')) = self.peek() {
            self.pos += c.len_utf8();
        }
    }

    fn unexpected(&self) -> String {
        match self.peek() {
            Some(c) => format!(
                "unexpected '{c}' at character {} of the resolver arguments",
                self.character()
            ),
            None => "the resolver arguments end too soon".to_owned(),
        }
    }

    /// Elements separated by `,`, up to `close` (not consumed) or the end.
    fn sequence(&mut self, close: Option<char>) -> Result<Vec<Argument>, String> {
        let mut items = Vec::new();
        loop {
            items.push(self.element(close)?);
            self.skip_spaces();
            match self.peek() {
                Some(',') => self.pos += 1,
                c if c == close => return Ok(items),
                _ => return Err(self.unexpected()),
            }
        }
    }

    fn element(&mut self, close: Option<char>) -> Result<Argument, String> {
        self.skip_spaces();
        match self.peek() {
            Some('[') => {
                self.pos += 1;
                self.skip_spaces();
                let items = if self.peek() == Some(']') {
                    Vec::new()
                } else {
                    self.sequence(Some(']'))?
                };
                self.expect(']')?;
                Ok(Argument::List(items))
            }
            Some('{') => self.mapping(),
            Some(quote @ ('\'' | '"')) => {
                let pieces = self.quoted(quote)?;
                self.skip_spaces();
                Ok(Argument::Quoted(pieces))
            }
            _ => self.primitive(close),
        }
    }

    fn expect(&mut self, c: char) -> Result<(), String> {
        if self.peek() == Some(c) {
            self.pos += c.len_utf8();
            Ok(())
        } else {
            Err(self.unexpected())
        }
    }

    fn mapping(&mut self) -> Result<Argument, String> {
        self.pos += 1;
        let mut entries = Vec::new();
        loop {
            self.skip_spaces();
            if self.peek() == Some('}') && entries.is_empty() {
                break;
            }
            let start = self.pos;
            while self
                .peek()
                .is_some_and(|c| c.is_ascii_alphanumeric() || "_-".contains(c))
            {
                self.pos += 1;
            }
            let key = self.text[start..self.pos].to_owned();
            if key.is_empty() {
                return Err(self.unexpected());
            }
            self.skip_spaces();
            self.expect(':')?;
            let value = self.element(Some('}'))?;
            entries.push((key, value));
            self.skip_spaces();
            match self.peek() {
                Some(',') => self.pos += 1,
                Some('}') => break,
                _ => return Err(self.unexpected()),
            }
        }
        self.expect('}')?;
        Ok(Argument::Mapping(entries))
    }

    /// A quoted string: a run of backslashes before the quote stands for half as many, an odd
    /// one escapes the quote; other backslashes are kept; interpolations inside are resolved.
    fn quoted(&mut self, quote: char) -> Result<Vec<Piece>, String> {
        let start = self.pos;
        self.pos += 1;
        let bytes = self.text.as_bytes();
        let mut pieces = Vec::new();
        let mut literal = String::new();
        while self.pos < bytes.len() {
            let b = bytes[self.pos];
            if b == b'\\' {
                let run = bytes[self.pos..]
                    .iter()
                    .take_while(|&&b| b == b'\\')
                    .count();
                if bytes.get(self.pos + run) == Some(&(quote as u8)) {
                    literal.extend(std::iter::repeat_n('\\', run / 2));
                    self.pos += run;
                    if run % 2 == 1 {
                        literal.push(quote);
                        self.pos += 1;
                    }
                } else {
                    literal.extend(std::iter::repeat_n('\\', run));
                    self.pos += run;
                }
                continue;
            }
            if b == quote as u8 {
                self.pos += 1;
                if !literal.is_empty() {
                    pieces.push(Piece::Literal(literal));
                }
                return Ok(pieces);
            }
            if bytes[self.pos..].starts_with(b"${") {
                self.interpolation(&mut pieces, &mut literal)?;
                continue;
            }
            let c = self.peek().unwrap_or_default();
            literal.push(c);
            self.pos += c.len_utf8().max(1);
        }
        Err(format!(
            "a quoted resolver argument is never closed (its {quote} at character {} has no match)",
            self.character_at(start)
        ))
    }

    /// A nested `${...}` at the cursor, as a piece.
    fn interpolation(
        &mut self,
        pieces: &mut Vec<Piece>,
        literal: &mut String,
    ) -> Result<(), String> {
        let bytes = self.text.as_bytes();
        let end = matching_brace(bytes, self.pos + 2).ok_or_else(|| {
            format!(
                "the interpolation at character {} of the resolver arguments is never \
                     closed (a '${{' without its '}}')",
                self.character()
            )
        })?;
        if !literal.is_empty() {
            pieces.push(Piece::Literal(std::mem::take(literal)));
        }
        let expression = parse_expression(&self.text[self.pos + 2..end])?;
        pieces.push(Piece::Interpolation(Box::new(expression)));
        self.pos = end + 1;
        Ok(())
    }

    /// An unquoted argument, up to `,`, `close` or the end: typed when it is one number,
    /// boolean or null token; text otherwise (trimmed; escapes and interpolations resolved).
    fn primitive(&mut self, close: Option<char>) -> Result<Argument, String> {
        let bytes = self.text.as_bytes();
        let mut pieces = Vec::new();
        let mut literal = String::new();
        let mut plain = true;
        while let Some(c) = self.peek() {
            if c == ',' || Some(c) == close {
                break;
            }
            if c == '\\'
                && let Some(next) = self.text[self.pos + 1..].chars().next()
                && ESCAPABLE.contains(next)
            {
                literal.push(next);
                plain = false;
                self.pos += 1 + next.len_utf8();
                continue;
            }
            if bytes[self.pos..].starts_with(b"${") {
                self.interpolation(&mut pieces, &mut literal)?;
                plain = false;
                continue;
            }
            if !unquoted_allowed(c) {
                // The marker is where a credential was (a credential-named interpolation, a
                // URL's password): redaction runs before resolution (decisions §3), so the
                // sender never wrote this `<` (hostile review 53, F6: a URL default was told
                // only of a credential-named interpolation it did not hold).
                let hint = if self.text[self.pos..].starts_with(super::tables::REDACTED) {
                    format!(
                        "{} stands for a credential (a credential-named interpolation, or a URL's \
                         password) redacted before anything resolves; quote the argument that \
                         holds it",
                        super::tables::REDACTED
                    )
                } else {
                    "quote the argument".to_owned()
                };
                return Err(format!(
                    "'{c}' (character {} of the resolver arguments) is not allowed in an \
                     unquoted resolver argument: {hint}",
                    self.character()
                ));
            }
            literal.push(c);
            self.pos += c.len_utf8();
        }
        if !literal.is_empty() {
            pieces.push(Piece::Literal(literal));
        }
        trim_pieces(&mut pieces);
        if plain {
            let text = match pieces.first() {
                Some(Piece::Literal(t)) => t.as_str(),
                _ => "",
            };
            if let Some(scalar) = typed_scalar(text)? {
                return Ok(Argument::Typed(scalar));
            }
        }
        Ok(Argument::Text(pieces))
    }
}

/// Strips whitespace at both ends of an unquoted argument.
fn trim_pieces(pieces: &mut Vec<Piece>) {
    if let Some(Piece::Literal(first)) = pieces.first_mut() {
        *first = first.trim_start().to_owned();
    }
    if let Some(Piece::Literal(last)) = pieces.last_mut() {
        *last = last.trim_end().to_owned();
    }
    pieces.retain(|p| !matches!(p, Piece::Literal(t) if t.is_empty()));
}

/// The typed token an unquoted argument is, if it is one: null, a boolean, an int or a float.
fn typed_scalar(text: &str) -> Result<Option<Scalar>, String> {
    if text.eq_ignore_ascii_case("null") {
        return Ok(Some(Scalar::Null));
    }
    if text.eq_ignore_ascii_case("true") {
        return Ok(Some(Scalar::Bool(true)));
    }
    if text.eq_ignore_ascii_case("false") {
        return Ok(Some(Scalar::Bool(false)));
    }
    if INT_ELEMENT.is_match(text) {
        let digits: String = text.chars().filter(|&c| c != '_' && c != '+').collect();
        let digits = if digits.trim_start_matches('-') == "0" {
            "0".to_owned()
        } else {
            digits
        };
        return Ok(Some(Scalar::Int(digits)));
    }
    if FLOAT_ELEMENT.is_match(text) || INF_NAN_ELEMENT.is_match(text) {
        let cleaned: String = text.chars().filter(|&c| c != '_').collect();
        let value: f64 = cleaned
            .to_ascii_lowercase()
            .parse()
            .map_err(|_| format!("invalid number '{text}'"))?;
        return Ok(Some(Scalar::Float(value)));
    }
    Ok(None)
}

/// A resolved resolver argument (Python's view: a float may be non-finite, a list or mapping
/// keeps its resolved items).
#[derive(Debug, Clone)]
enum Resolved {
    Json(Value),
    Float(f64),
    List(Vec<Resolved>),
    Mapping(Vec<(String, Resolved)>),
}

impl Resolved {
    fn of_scalar(scalar: &Scalar) -> Self {
        match scalar {
            Scalar::Null => Self::Json(Value::Null),
            Scalar::Bool(b) => Self::Json(Value::Bool(*b)),
            Scalar::Int(digits) => serde_json::from_str::<Number>(digits)
                .map(|n| Self::Json(Value::Number(n)))
                .unwrap_or_else(|_| Self::Json(Value::String(digits.clone()))),
            Scalar::Float(f) => Self::Float(*f),
        }
    }

    /// Python's `str()` of the value.
    fn python_str(&self) -> String {
        match self {
            Self::Json(value) => python_str(value),
            Self::Float(f) => python_float_str(*f),
            Self::List(_) | Self::Mapping(_) => self.python_repr(),
        }
    }

    /// Python's `repr()` of the value.
    fn python_repr(&self) -> String {
        match self {
            Self::Json(value) => python_repr(value),
            Self::Float(f) => python_float_str(*f),
            Self::List(items) => format!(
                "[{}]",
                items
                    .iter()
                    .map(Self::python_repr)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Self::Mapping(entries) => format!(
                "{{{}}}",
                entries
                    .iter()
                    .map(|(k, v)| format!("{}: {}", python_string_repr(k), v.python_repr()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    /// The value as JSON (`oc.select` returns its default unconverted).
    fn into_json(self) -> Result<Value, String> {
        Ok(match self {
            Self::Json(value) => value,
            Self::Float(f) => {
                Value::Number(Number::from_f64(f).ok_or("a non-finite default has no JSON form")?)
            }
            Self::List(items) => Value::Array(
                items
                    .into_iter()
                    .map(Self::into_json)
                    .collect::<Result<_, _>>()?,
            ),
            Self::Mapping(entries) => Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| Ok((k, v.into_json()?)))
                    .collect::<Result<Map<String, Value>, String>>()?,
            ),
        })
    }
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

/// Python's `str()` of a resolved value (a mapping or list as its `repr()`, as OmegaConf puts
/// it into a template).
fn python_str(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => python_repr(other),
    }
}

/// Python's `repr()` of a JSON value.
fn python_repr(value: &Value) -> String {
    match value {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::String(s) => python_string_repr(s),
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
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(python_repr).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{}: {}", python_string_repr(k), python_repr(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Python's `repr()` of a string: single quotes unless it holds one and no double quote.
fn python_string_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}
