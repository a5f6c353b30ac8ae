//! `RunManifest` (schema_version 2) and `PendingRejudge`, read as strictly as the Python
//! pydantic models validate them and written as Python's `atomic_write_json` writes them.
//!
//! Invariants:
//! - reading accepts exactly what the seed's models accept: unknown fields are refused,
//!   `schema_version` must equal 2 (an int or a float equal to 2, as pydantic's lax literal),
//!   `selection_policy` defaults to and must be `latest_allocated`, strict ints refuse `true`,
//!   `1.0` and `"1"`, booleans follow pydantic's lax rules, duplicate keys keep the last value;
//! - strict ints are held as `u64`: a larger value (accepted by Python) is refused with a clear
//!   error rather than truncated;
//! - writing follows the declaration order below, so a manifest read and written again keeps
//!   every field and value.

use crate::canonical::CanonicalError;
use crate::pretty::python_pretty;
use indexmap::IndexMap;
use regex::Regex;
use serde_json::{Map, Number, Value};
use std::sync::LazyLock;

/// The only manifest schema version this implementation reads and writes.
pub const SCHEMA_VERSION: u64 = 2;
/// The only selection policy of schema version 2.
pub const SELECTION_POLICY: &str = "latest_allocated";
/// `source_digest` / `config_digest` of a legacy import.
pub const UNVERIFIED: &str = "unverified";

static OPERATION_ID: LazyLock<Regex> =
    LazyLock::new(|| Regex::new("^[0-9a-f]{32}$").expect("static regex"));
static SHA256_HEX: LazyLock<Regex> =
    LazyLock::new(|| Regex::new("^[0-9a-f]{64}$").expect("static regex"));

/// Reserved execution numbers by logical rollout id, in manifest order (a fast hasher: plans
/// look every rollout up).
pub type NextAttempts = IndexMap<String, u64, foldhash::fast::RandomState>;

/// A judge-only re-judgment admitted before its judge call; it closes when its outcome is saved.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingRejudge {
    /// Unix seconds, finite, `>= 0`.
    pub admitted_at: f64,
    /// 32 lowercase hex digits.
    pub operation_id: String,
    /// The failure being re-judged (non-empty).
    pub predecessor_failure_id: String,
    /// SHA-256 (64 lowercase hex) of the predecessor failure line's bytes without its newline.
    pub predecessor_sha256: String,
}

/// The run manifest beside an output: the identity a resume is checked against.
#[derive(Debug, Clone, PartialEq)]
pub struct RunManifest {
    /// Controller-owned reservations: logical rollout id -> next execution number (>= 1).
    pub next_attempt: NextAttempts,
    pub run_id: String,
    pub source_digest: String,
    pub materialized_digest: String,
    pub config_digest: String,
    pub legacy_import: bool,
    pub identity_overridden: bool,
    /// The run's saved attempt cap (>= 1), or `None` for manifests from before it was saved.
    pub max_rollout_attempts: Option<u64>,
    /// Open judge-only re-judgments by attempt key `<rollout id>-a<attempt>`.
    pub pending_rejudge: IndexMap<String, PendingRejudge>,
    pub retry_terminal_timeouts: bool,
}

/// One field that did not validate, named by its dotted location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldProblem {
    pub field: String,
    pub problem: String,
}

/// Why bytes are not a readable manifest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("invalid JSON: {0}")]
    Json(String),
    #[error("the manifest must be a JSON object")]
    NotAnObject,
    #[error("{}", describe(.0))]
    Fields(Vec<FieldProblem>),
}

fn describe(problems: &[FieldProblem]) -> String {
    let parts: Vec<String> = problems
        .iter()
        .map(|p| format!("{}: {}", p.field, p.problem))
        .collect();
    format!(
        "{} validation error(s): {}",
        problems.len(),
        parts.join("; ")
    )
}

const FIELDS: [&str; 12] = [
    "schema_version",
    "selection_policy",
    "next_attempt",
    "run_id",
    "source_digest",
    "materialized_digest",
    "config_digest",
    "legacy_import",
    "identity_overridden",
    "max_rollout_attempts",
    "pending_rejudge",
    "retry_terminal_timeouts",
];
const REJUDGE_FIELDS: [&str; 4] = [
    "admitted_at",
    "operation_id",
    "predecessor_failure_id",
    "predecessor_sha256",
];

/// The collection setting `retry_terminal_timeouts` as the Python module's settings model reads
/// a `bool` (pydantic 2, lax): `true`/`false`, the integers or floats 1 and 0, and the strings
/// `1 on t true y yes` / `0 off f false n no` in any case (a value that came through
/// `${oc.env:...}` is a string); absent is `false`. Anything else (`null`, `2`, `"maybe"`, a
/// padded `" true"`) is refused with the reason: the Python module refuses it too, and ignoring
/// it would silently leave timeouts terminal for a collector that asked otherwise.
pub fn timeout_retries_opt_in(setting: Option<&Value>) -> Result<bool, String> {
    let Some(value) = setting else {
        return Ok(false);
    };
    let read = match value {
        Value::Bool(flag) => Some(*flag),
        Value::Number(number) => match number.as_f64() {
            Some(1.0) => Some(true),
            Some(0.0) => Some(false),
            _ => None,
        },
        Value::String(text) => match text.to_ascii_lowercase().as_str() {
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            _ => None,
        },
        _ => None,
    };
    // The value is never repeated: a misplaced secret would be answered back.
    read.ok_or_else(|| {
        let kind = match value {
            Value::Null => "null",
            Value::Number(_) => "a number other than 1 or 0",
            Value::String(_) => "a string other than true/false, yes/no, on/off, t/f, y/n, 1/0",
            Value::Array(_) => "a list",
            _ => "an object",
        };
        format!(
            "config.retry_terminal_timeouts: must be true or false (as the Python module reads a bool), not {kind}"
        )
    })
}

impl RunManifest {
    /// A new run's manifest (`RunManifest.create`): the caller supplies the fresh run id
    /// (`uuid4().hex`) and the digests.
    pub fn create(
        run_id: impl Into<String>,
        source_digest: impl Into<String>,
        materialized_digest: impl Into<String>,
        config_digest: impl Into<String>,
        max_rollout_attempts: Option<u64>,
    ) -> Self {
        Self {
            next_attempt: NextAttempts::default(),
            run_id: run_id.into(),
            source_digest: source_digest.into(),
            materialized_digest: materialized_digest.into(),
            config_digest: config_digest.into(),
            legacy_import: false,
            identity_overridden: false,
            max_rollout_attempts,
            pending_rejudge: IndexMap::new(),
            retry_terminal_timeouts: false,
        }
    }

    /// `RunManifest.import_legacy(rows)`: an unverified identity over the saved rows' digest.
    pub fn import_legacy(
        run_id: impl Into<String>,
        materialized_digest: impl Into<String>,
    ) -> Self {
        Self {
            legacy_import: true,
            ..Self::create(run_id, UNVERIFIED, materialized_digest, UNVERIFIED, None)
        }
    }

    /// The run a manifest names, read without validating (or building) the rest: which run owns
    /// an output. `None` when the bytes hold no string `run_id`.
    pub fn run_id_of(bytes: &[u8]) -> Option<String> {
        #[derive(serde::Deserialize)]
        struct Owner {
            run_id: String,
        }
        serde_json::from_slice::<Owner>(bytes)
            .ok()
            .map(|o| o.run_id)
    }

    /// Reads manifest bytes exactly as `RunManifest.model_validate_json` would accept them.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self, ManifestError> {
        if let Some(read) = Self::from_plain_json_bytes(bytes) {
            return read;
        }
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| ManifestError::Json(e.to_string()))?;
        Self::from_value(&value)
    }

    /// The common manifest read without building its `next_attempt` as a JSON tree (a
    /// 100k-rollout manifest's tree took ~25 ms to build and copy, paid by every plan after a
    /// reservation rewrote it): the object's members are kept as raw text, and `next_attempt`
    /// is read straight into [`NextAttempts`] when every value is a plain decimal integer the
    /// manifest keeps (`[1-9][0-9]*`, at most [`MAX_NEXT_ATTEMPT`]). `None` when anything
    /// else is there (not an object, another kind of value, an error): the caller reads the
    /// bytes through [`Self::from_value`], so every refusal is that path's, word for word.
    fn from_plain_json_bytes(bytes: &[u8]) -> Option<Result<Self, ManifestError>> {
        use serde_json::value::RawValue;
        type Members<'a, S> = IndexMap<String, &'a RawValue, S>;
        // Duplicate names keep the first one's place and the last one's value, as `Map` does.
        let members: Members<'_, std::hash::RandomState> = serde_json::from_slice(bytes).ok()?;
        let next_attempt = match members.get("next_attempt") {
            Some(raw) => {
                let entries: Members<'_, foldhash::fast::RandomState> =
                    serde_json::from_str(raw.get()).ok()?;
                let mut next_attempt = NextAttempts::default();
                next_attempt.reserve(entries.len());
                for (key, raw) in entries {
                    next_attempt.insert(key, plain_execution_number(raw.get())?);
                }
                next_attempt
            }
            None => NextAttempts::default(),
        };
        let mut rest = Map::new();
        for (name, raw) in &members {
            if name == "next_attempt" {
                continue;
            }
            // serde_json reads at most 127 levels; a member read alone would be allowed one
            // more than inside the manifest, so one nested that deep is left to the full read.
            crate::canonical::check_depth_within(
                raw.get().as_bytes(),
                crate::canonical::MAX_DEPTH - 126,
            )
            .ok()?;
            rest.insert(name.clone(), serde_json::from_str(raw.get()).ok()?);
        }
        Some(Self::from_members(&rest, Some(next_attempt)))
    }

    /// Validates an already parsed JSON value.
    pub fn from_value(value: &Value) -> Result<Self, ManifestError> {
        let Value::Object(map) = value else {
            return Err(ManifestError::NotAnObject);
        };
        Self::from_members(map, None)
    }

    /// Validates a manifest object's members; `read_next_attempt` is its `next_attempt` when
    /// it was read already (and found valid), in which case `map` does not hold it.
    fn from_members(
        map: &Map<String, Value>,
        read_next_attempt: Option<NextAttempts>,
    ) -> Result<Self, ManifestError> {
        let mut problems = Vec::new();
        let mut problem = |field: &str, text: &str| {
            problems.push(FieldProblem {
                field: field.to_owned(),
                problem: text.to_owned(),
            });
        };
        for key in map.keys() {
            if !FIELDS.contains(&key.as_str()) {
                problem(key, "extra inputs are not permitted");
            }
        }
        if let Some(v) = map.get("schema_version")
            && !is_literal_two(v)
        {
            problem("schema_version", "input should be 2");
        }
        if let Some(v) = map.get("selection_policy")
            && v.as_str() != Some(SELECTION_POLICY)
        {
            problem("selection_policy", "input should be 'latest_allocated'");
        }
        let mut next_attempt = read_next_attempt.unwrap_or_default();
        match map.get("next_attempt") {
            None => {}
            Some(Value::Object(entries)) => {
                next_attempt.reserve(entries.len());
                for (key, v) in entries {
                    match strict_positive_int(v) {
                        // Execution numbers are signed 64-bit everywhere they are handed out
                        // and recorded (hostile review 45: 2^63 and beyond wrapped negative).
                        Ok(n) if n > MAX_NEXT_ATTEMPT => problem(
                            &format!("next_attempt.{key}"),
                            "integer larger than the largest execution number this implementation \
                             keeps (2^63 - 1)",
                        ),
                        Ok(n) => {
                            next_attempt.insert(key.clone(), n);
                        }
                        Err(text) => problem(&format!("next_attempt.{key}"), text),
                    }
                }
            }
            Some(_) => problem("next_attempt", "input should be a valid dictionary"),
        }
        let mut required_str = |field: &str| -> String {
            match map.get(field) {
                Some(Value::String(s)) => s.clone(),
                Some(_) => {
                    problem(field, "input should be a valid string");
                    String::new()
                }
                None => {
                    problem(field, "field required");
                    String::new()
                }
            }
        };
        let run_id = required_str("run_id");
        let source_digest = required_str("source_digest");
        let materialized_digest = required_str("materialized_digest");
        let config_digest = required_str("config_digest");
        let mut lax_bool_field = |field: &str| -> bool {
            match map.get(field) {
                None => false,
                Some(v) => lax_bool(v).unwrap_or_else(|| {
                    problem(field, "input should be a valid boolean");
                    false
                }),
            }
        };
        let legacy_import = lax_bool_field("legacy_import");
        let identity_overridden = lax_bool_field("identity_overridden");
        let retry_terminal_timeouts = lax_bool_field("retry_terminal_timeouts");
        let max_rollout_attempts = match map.get("max_rollout_attempts") {
            None | Some(Value::Null) => None,
            Some(v) => match strict_positive_int(v) {
                // As `next_attempt`: a cap no execution number reaches is refused, so the cap
                // with its extensions (each sum at most 2^63 - 1) never saturates into a guessed
                // one (hostile review 51, N3).
                Ok(n) if n > MAX_NEXT_ATTEMPT => {
                    problem(
                        "max_rollout_attempts",
                        "integer larger than the largest execution number this implementation \
                         keeps (2^63 - 1)",
                    );
                    None
                }
                Ok(n) => Some(n),
                Err(text) => {
                    problem("max_rollout_attempts", text);
                    None
                }
            },
        };
        let mut pending_rejudge = IndexMap::new();
        match map.get("pending_rejudge") {
            None => {}
            Some(Value::Object(entries)) => {
                for (key, v) in entries {
                    match PendingRejudge::from_value(v) {
                        Ok(p) => {
                            pending_rejudge.insert(key.clone(), p);
                        }
                        Err(list) => {
                            for p in list {
                                problem(&format!("pending_rejudge.{key}.{}", p.field), &p.problem);
                            }
                        }
                    }
                }
            }
            Some(_) => problem("pending_rejudge", "input should be a valid dictionary"),
        }
        if !problems.is_empty() {
            return Err(ManifestError::Fields(problems));
        }
        Ok(Self {
            next_attempt,
            run_id,
            source_digest,
            materialized_digest,
            config_digest,
            legacy_import,
            identity_overridden,
            max_rollout_attempts,
            pending_rejudge,
            retry_terminal_timeouts,
        })
    }

    /// `model_dump(mode="json")`, in declaration order.
    pub fn to_value(&self) -> Value {
        let mut map = Map::new();
        map.insert("schema_version".into(), Value::from(SCHEMA_VERSION));
        map.insert("selection_policy".into(), Value::from(SELECTION_POLICY));
        map.insert(
            "next_attempt".into(),
            Value::Object(
                self.next_attempt
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::from(*v)))
                    .collect(),
            ),
        );
        map.insert("run_id".into(), Value::from(self.run_id.as_str()));
        map.insert(
            "source_digest".into(),
            Value::from(self.source_digest.as_str()),
        );
        map.insert(
            "materialized_digest".into(),
            Value::from(self.materialized_digest.as_str()),
        );
        map.insert(
            "config_digest".into(),
            Value::from(self.config_digest.as_str()),
        );
        map.insert("legacy_import".into(), Value::from(self.legacy_import));
        map.insert(
            "identity_overridden".into(),
            Value::from(self.identity_overridden),
        );
        map.insert(
            "max_rollout_attempts".into(),
            self.max_rollout_attempts.map_or(Value::Null, Value::from),
        );
        map.insert(
            "pending_rejudge".into(),
            Value::Object(
                self.pending_rejudge
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_value()))
                    .collect(),
            ),
        );
        map.insert(
            "retry_terminal_timeouts".into(),
            Value::from(self.retry_terminal_timeouts),
        );
        Value::Object(map)
    }

    /// [`Self::to_value`] in the form of the manifest it rewrites: a field `previous` did not
    /// have stays absent while it holds its default, so a reader from before that field (pydantic
    /// `extra="forbid"`) keeps reading the run. New fields appear once they carry a value.
    pub fn to_value_like(&self, previous: &Value) -> Value {
        let mut value = self.to_value();
        if let (Value::Object(map), Value::Object(previous)) = (&mut value, previous) {
            map.retain(|key, v| previous.contains_key(key) || !is_default_field(key, v));
        }
        value
    }

    /// The bytes `RunManifest.write` publishes: pretty JSON, `ensure_ascii` escapes, newline.
    pub fn to_pretty_json(&self) -> Result<String, CanonicalError> {
        python_pretty(&self.to_value())
    }

    /// This manifest with the sticky `identity_overridden` flag set.
    pub fn overridden(&self) -> Self {
        Self {
            identity_overridden: true,
            ..self.clone()
        }
    }
}

impl PendingRejudge {
    fn from_value(value: &Value) -> Result<Self, Vec<FieldProblem>> {
        let mut problems = Vec::new();
        let Value::Object(map) = value else {
            return Err(vec![FieldProblem {
                field: String::new(),
                problem: "input should be a valid dictionary".into(),
            }]);
        };
        let mut problem = |field: &str, text: &str| {
            problems.push(FieldProblem {
                field: field.to_owned(),
                problem: text.to_owned(),
            });
        };
        for key in map.keys() {
            if !REJUDGE_FIELDS.contains(&key.as_str()) {
                problem(key, "extra inputs are not permitted");
            }
        }
        let admitted_at = match map.get("admitted_at") {
            None => {
                problem("admitted_at", "field required");
                0.0
            }
            Some(Value::Number(n)) => match n.to_string().parse::<f64>() {
                Ok(f) if !f.is_finite() => {
                    problem("admitted_at", "input should be a finite number");
                    0.0
                }
                Ok(f) if f < 0.0 => {
                    problem("admitted_at", "input should be greater than or equal to 0");
                    0.0
                }
                Ok(f) => f,
                Err(_) => {
                    problem("admitted_at", "input should be a valid number");
                    0.0
                }
            },
            Some(_) => {
                problem("admitted_at", "input should be a valid number");
                0.0
            }
        };
        let mut string_field =
            |field: &str, check: &dyn Fn(&str) -> Option<&'static str>| -> String {
                match map.get(field) {
                    None => {
                        problem(field, "field required");
                        String::new()
                    }
                    Some(Value::String(s)) => {
                        if let Some(text) = check(s) {
                            problem(field, text);
                        }
                        s.clone()
                    }
                    Some(_) => {
                        problem(field, "input should be a valid string");
                        String::new()
                    }
                }
            };
        let operation_id = string_field("operation_id", &|s| {
            (!OPERATION_ID.is_match(s)).then_some("string should match pattern '^[0-9a-f]{32}$'")
        });
        let predecessor_failure_id = string_field("predecessor_failure_id", &|s| {
            s.is_empty()
                .then_some("string should have at least 1 character")
        });
        let predecessor_sha256 = string_field("predecessor_sha256", &|s| {
            (!SHA256_HEX.is_match(s)).then_some("string should match pattern '^[0-9a-f]{64}$'")
        });
        if !problems.is_empty() {
            return Err(problems);
        }
        Ok(Self {
            admitted_at,
            operation_id,
            predecessor_failure_id,
            predecessor_sha256,
        })
    }

    fn to_value(&self) -> Value {
        let mut map = Map::new();
        map.insert(
            "admitted_at".into(),
            Number::from_f64(self.admitted_at).map_or(Value::Null, Value::Number),
        );
        map.insert(
            "operation_id".into(),
            Value::from(self.operation_id.as_str()),
        );
        map.insert(
            "predecessor_failure_id".into(),
            Value::from(self.predecessor_failure_id.as_str()),
        );
        map.insert(
            "predecessor_sha256".into(),
            Value::from(self.predecessor_sha256.as_str()),
        );
        Value::Object(map)
    }
}

/// Whether a dumped field holds the default a manifest without that field reads as.
fn is_default_field(key: &str, value: &Value) -> bool {
    match key {
        "max_rollout_attempts" => value.is_null(),
        "next_attempt" | "pending_rejudge" => value.as_object().is_some_and(Map::is_empty),
        "legacy_import" | "identity_overridden" | "retry_terminal_timeouts" => {
            value == &Value::Bool(false)
        }
        _ => false,
    }
}

/// pydantic's lax `Literal[2]`: the int 2, or a float equal to 2.
fn is_literal_two(value: &Value) -> bool {
    match value {
        Value::Number(n) => {
            let text = n.to_string();
            if text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
                text.parse::<f64>().is_ok_and(|f| f == 2.0)
            } else {
                text == "2"
            }
        }
        _ => false,
    }
}

/// pydantic's `Annotated[int, Field(ge=1, strict=True)]`: a JSON integer (never a bool, float
/// or string) of at least 1.
/// The largest `next_attempt` a manifest may hold: execution numbers are `i64` wherever they are
/// handed out and recorded (JSON answers, database rows, outcome lines as the plan reads them).
pub const MAX_NEXT_ATTEMPT: u64 = i64::MAX as u64;

/// A `next_attempt` value written as a plain decimal integer the manifest keeps
/// (`[1-9][0-9]*`, at most [`MAX_NEXT_ATTEMPT`]): what [`strict_positive_int`] accepts with no
/// problem. `None` for anything else, which the full read judges.
fn plain_execution_number(text: &str) -> Option<u64> {
    let plain = text.bytes().all(|b| b.is_ascii_digit()) && !text.starts_with('0');
    plain
        .then(|| text.parse::<u64>().ok())
        .flatten()
        .filter(|n| *n <= MAX_NEXT_ATTEMPT)
}

fn strict_positive_int(value: &Value) -> Result<u64, &'static str> {
    let Value::Number(n) = value else {
        return Err("input should be a valid integer");
    };
    let text = n.as_str();
    if text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
        return Err("input should be a valid integer");
    }
    if text.starts_with('-') || text == "0" {
        return Err("input should be greater than or equal to 1");
    }
    text.parse::<u64>()
        .map_err(|_| "integer larger than this implementation supports (2^64 - 1)")
}

/// pydantic's lax `bool`: JSON booleans, the numbers 0 and 1, and its accepted words.
fn lax_bool(value: &Value) -> Option<bool> {
    match value {
        Value::Bool(b) => Some(*b),
        Value::Number(n) => match n.to_string().parse::<f64>() {
            Ok(0.0) => Some(false),
            Ok(1.0) => Some(true),
            _ => None,
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    }
}
