//! Configuration drift: which dotted keys differ between the saved identity and the current one,
//! and whether each is semantic (refuses a resume) or operational (resumes with a journal line).
//!
//! Invariants: a list compares as one value; a key present on one side only counts; values
//! compare type-exactly, as their canonical JSON forms do (`1` and `1.0` differ, so do `true`
//! and `1`: whatever changes the digest names a key, decisions §5); the classifier's word lists
//! are data ([`DriftPolicy`]) applied in the order of decisions §5, and a key no rule classifies
//! is semantic (an unknown change refuses). [`python_equal`] is Python's `==`, kept for
//! comparing documents the way pydantic round trips do, never for drift.

use regex::Regex;
use serde_json::Value;
use std::collections::BTreeSet;

/// `_differing_keys(saved, current)`: dotted keys whose values differ.
pub fn differing_keys(saved: &Value, current: &Value) -> Vec<String> {
    let mut out = Vec::new();
    collect_differences(saved, current, "", &mut out);
    out
}

fn collect_differences(saved: &Value, current: &Value, prefix: &str, out: &mut Vec<String>) {
    match (saved, current) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                let child = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => collect_differences(x, y, &child, out),
                    _ => out.push(child),
                }
            }
        }
        _ if canonical_equal(saved, current) => {}
        _ => out.push(prefix.to_owned()),
    }
}

/// Whether two values have one canonical JSON form (what the digest reads, decisions §5): `1`
/// and `1.0` differ, so do `true` and `1`, and a changed digest always names a key.
pub fn canonical_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Null, Value::Null) => true,
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::String(x), Value::String(y)) => x == y,
        (Value::Number(_), Value::Number(_)) => {
            match (
                crate::canonical::canonical_value(a),
                crate::canonical::canonical_value(b),
            ) {
                (Ok(x), Ok(y)) => x == y,
                _ => false,
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| canonical_equal(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| canonical_equal(v, w)))
        }
        _ => false,
    }
}

/// Python's `==` on JSON values: numbers (and booleans, which are ints) compare by exact value.
pub fn python_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Null, Value::Null) => true,
        (Value::String(x), Value::String(y)) => x == y,
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| python_equal(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| python_equal(v, w)))
        }
        (Value::Bool(_) | Value::Number(_), Value::Bool(_) | Value::Number(_)) => {
            match (PyNumber::of(a), PyNumber::of(b)) {
                (Some(x), Some(y)) => x == y,
                _ => false,
            }
        }
        _ => false,
    }
}

/// A JSON number (or bool) as Python compares it.
#[derive(Debug, PartialEq)]
enum PyNumber {
    /// Integral value as normalised decimal digits (no `-0`).
    Int(String),
    /// A float that is not integral.
    Fraction(f64),
}

impl PyNumber {
    fn of(value: &Value) -> Option<Self> {
        match value {
            Value::Bool(b) => Some(Self::Int(if *b { "1" } else { "0" }.into())),
            Value::Number(n) => {
                let text = n.to_string();
                if text.bytes().any(|c| matches!(c, b'.' | b'e' | b'E')) {
                    let f: f64 = text.parse().ok()?;
                    if f.is_finite() && f.fract() == 0.0 {
                        let digits = format!("{f:.0}");
                        Some(Self::Int(if digits == "-0" { "0".into() } else { digits }))
                    } else {
                        Some(Self::Fraction(f))
                    }
                } else if text == "-0" {
                    Some(Self::Int("0".into()))
                } else {
                    Some(Self::Int(text))
                }
            }
            _ => None,
        }
    }
}

/// Why a key is semantic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SemanticReason {
    /// A segment is a listed semantic key (or contains `dataset`).
    ListedKey(String),
    /// A segment names a prompt / template / rubric asset path.
    AssetPath(String),
    /// The last segment names a path of what a run reads (`model_path`, `data_dir`, ...).
    ReadPath(String),
    /// An operator declared the whole key semantic (service configuration).
    DeclaredKey(String),
    /// A segment contains a semantic part (`judge`, `model`, ...).
    SemanticPart(String),
    /// No rule classifies the key: an unknown change refuses.
    Unclassified,
}

impl SemanticReason {
    /// A stable snake_case code and the segment it names, for API answers.
    pub fn describe(&self) -> (&'static str, Option<&str>) {
        match self {
            Self::ListedKey(segment) => ("listed_key", Some(segment)),
            Self::AssetPath(segment) => ("asset_path", Some(segment)),
            Self::ReadPath(segment) => ("read_path", Some(segment)),
            Self::DeclaredKey(key) => ("declared_key", Some(key)),
            Self::SemanticPart(segment) => ("semantic_part", Some(segment)),
            Self::Unclassified => ("unclassified", None),
        }
    }
}

/// The class of one differing key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyClass {
    Semantic(SemanticReason),
    Operational,
}

/// A differing key with its class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassifiedKey {
    pub key: String,
    pub class: KeyClass,
}

/// Drift of a resume, split by class; both lists sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Drift {
    pub semantic: Vec<ClassifiedKey>,
    pub operational: Vec<String>,
}

impl Drift {
    pub fn is_empty(&self) -> bool {
        self.semantic.is_empty() && self.operational.is_empty()
    }
}

/// Default semantic keys: a segment equal to one of these is semantic (decisions §5, step 1).
pub const SEMANTIC_KEYS: &[&str] = &[
    "split",
    "dataset",
    "datasets",
    "limit",
    "task_ids",
    "num_repeats",
    "seed",
    "model",
    "model_name",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_output_tokens",
    "tools",
    "system_prompt",
    "responses_create_params",
    "entrypoint",
];
/// A segment containing this is semantic (step 1).
pub const SEMANTIC_SUBSTRING: &str = "dataset";
/// A segment naming a prompt / template / rubric asset path is semantic (step 1).
pub const SEMANTIC_ASSET_PATH: &str =
    r"(^|_)(prompt|prompts|template|templates|rubric|rubrics)_(.+_)?(dir|path|paths|file|files)$";
/// The last word of a last segment (split on `_`) that names a path (step 1, with
/// [`READ_PATH_WORDS`]).
pub const PATH_WORDS: &[&str] = &["path", "paths", "dir", "dirs", "file", "files"];
/// An earlier word of a path-naming last segment that makes it name what a run reads (step 1):
/// `model_path`, `tokenizer_dir`, `data_dir`, `reference_files` are semantic; `log_dir`,
/// `cache_dir`, `output_dir` are not.
pub const READ_PATH_WORDS: &[&str] = &[
    "model",
    "models",
    "tokenizer",
    "weights",
    "checkpoint",
    "adapter",
    "lora",
    "data",
    "reference",
    "references",
    "eval",
    "gold",
    "answers",
    "judge",
    "verifier",
];
/// Words of a last segment (split on `_`) that make a key operational (step 2).
pub const OPERATIONAL_WORDS: &[&str] = &[
    "timeout",
    "timeouts",
    "deadline",
    "retry",
    "retries",
    "attempts",
    "backoff",
    "wait",
    "grace",
    "interval",
    "delay",
    "ttl",
    "heartbeat",
    "poll",
    "port",
    "ports",
    "host",
    "hosts",
    "url",
    "urls",
    "endpoint",
    "address",
    "proxy",
    "transport",
    "connect",
    "connection",
    "connections",
    "pool",
    "keepalive",
    "concurrency",
    "parallel",
    "parallelism",
    "workers",
    "threads",
    "health",
    "dir",
    "dirs",
    "path",
    "paths",
    "log",
    "logs",
    "logging",
    "verbose",
    "tracking",
    "telemetry",
    "wandb",
    "mlflow",
];
/// Last segments that are operational as a whole (step 2).
pub const OPERATIONAL_LAST_SEGMENTS: &[&str] = &["rate_limit"];
/// Substrings of any segment that make a key semantic (step 3).
pub const SEMANTIC_PARTS: &[&str] = &[
    "judge", "grad", "verif", "reward", "scor", "rubric", "metric", "prompt", "model",
];

/// Whether a last segment names a path of what a run reads: its last `_`-word is a path word and
/// an earlier word a read word (decisions §5, step 1).
fn names_a_read_path(segment: &str) -> bool {
    let words: Vec<&str> = segment.split('_').collect();
    match words.split_last() {
        Some((last, earlier)) => {
            PATH_WORDS.contains(last) && earlier.iter().any(|w| READ_PATH_WORDS.contains(w))
        }
        None => false,
    }
}

/// The drift classifier's policy. Operators extend it in service configuration, never in a run's
/// identity.
///
/// Shared, not copied, by its clones: every validate hands the service's policy to a blocking
/// thread, and a copied policy made fresh sets and a fresh regex whose matching state was built
/// again on first use (profiled: 2% of a validate across drift).
#[derive(Debug, Clone, Default)]
pub struct DriftPolicy {
    tables: std::sync::Arc<PolicyTables>,
}

/// What a [`DriftPolicy`] decides by.
#[derive(Debug)]
struct PolicyTables {
    /// Whole dotted keys an operator declared semantic (step 0).
    declared_semantic: BTreeSet<String>,
    semantic_keys: BTreeSet<String>,
    asset_path: Regex,
    operational_words: BTreeSet<String>,
    operational_last_segments: BTreeSet<String>,
    /// Whole dotted keys an operator declared operational (step 0).
    operational_keys: BTreeSet<String>,
    semantic_parts: Vec<String>,
}

impl Default for PolicyTables {
    fn default() -> Self {
        Self {
            declared_semantic: BTreeSet::new(),
            semantic_keys: SEMANTIC_KEYS.iter().map(|s| (*s).to_owned()).collect(),
            asset_path: Regex::new(SEMANTIC_ASSET_PATH).expect("static regex"),
            operational_words: OPERATIONAL_WORDS.iter().map(|s| (*s).to_owned()).collect(),
            operational_last_segments: OPERATIONAL_LAST_SEGMENTS
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            operational_keys: BTreeSet::new(),
            semantic_parts: SEMANTIC_PARTS.iter().map(|s| (*s).to_owned()).collect(),
        }
    }
}

impl DriftPolicy {
    /// The default policy extended by an operator: extra semantic keys (a dotted key declares
    /// that whole key semantic, step 0; a plain name is a semantic segment, step 1), extra
    /// operational words, and whole dotted keys declared operational (step 0).
    pub fn extended(
        semantic_keys: impl IntoIterator<Item = String>,
        operational_words: impl IntoIterator<Item = String>,
        operational_keys: impl IntoIterator<Item = String>,
    ) -> Self {
        let mut policy = PolicyTables::default();
        for key in semantic_keys {
            if key.contains('.') {
                policy.declared_semantic.insert(key);
            } else {
                policy.semantic_keys.insert(key);
            }
        }
        for word in operational_words {
            // A word holding `_` (`queue_depth`) can never be one `_`-separated word of a
            // segment: it names a whole last segment, as `rate_limit` does.
            if word.contains('_') {
                policy.operational_last_segments.insert(word);
            } else {
                policy.operational_words.insert(word);
            }
        }
        policy.operational_keys.extend(operational_keys);
        Self {
            tables: std::sync::Arc::new(policy),
        }
    }

    /// Classifies one dotted key (decisions §5, in order).
    pub fn classify(&self, key: &str) -> KeyClass {
        // Step 0: a whole key an operator declared takes that class.
        if self.tables.declared_semantic.contains(key) {
            return KeyClass::Semantic(SemanticReason::DeclaredKey(key.to_owned()));
        }
        if self.tables.operational_keys.contains(key) {
            return KeyClass::Operational;
        }
        let segments: Vec<&str> = key.split('.').collect();
        for segment in &segments {
            if self.tables.semantic_keys.contains(*segment) || segment.contains(SEMANTIC_SUBSTRING)
            {
                return KeyClass::Semantic(SemanticReason::ListedKey((*segment).to_owned()));
            }
            if self.tables.asset_path.is_match(segment) {
                return KeyClass::Semantic(SemanticReason::AssetPath((*segment).to_owned()));
            }
        }
        let last = segments.last().copied().unwrap_or_default();
        if names_a_read_path(last) {
            return KeyClass::Semantic(SemanticReason::ReadPath(last.to_owned()));
        }
        if self.tables.operational_last_segments.contains(last)
            || last
                .split('_')
                .any(|word| self.tables.operational_words.contains(word))
        {
            return KeyClass::Operational;
        }
        for segment in &segments {
            if let Some(part) = self
                .tables
                .semantic_parts
                .iter()
                .find(|p| segment.contains(p.as_str()))
            {
                return KeyClass::Semantic(SemanticReason::SemanticPart(part.clone()));
            }
        }
        KeyClass::Semantic(SemanticReason::Unclassified)
    }

    /// Splits differing keys into semantic and operational ones.
    pub fn classify_all(&self, keys: &[String]) -> Drift {
        let mut drift = Drift::default();
        for key in keys {
            match self.classify(key) {
                KeyClass::Operational => drift.operational.push(key.clone()),
                class => drift.semantic.push(ClassifiedKey {
                    key: key.clone(),
                    class,
                }),
            }
        }
        drift.operational.sort();
        drift.semantic.sort_by(|a, b| a.key.cmp(&b.key));
        drift
    }
}
