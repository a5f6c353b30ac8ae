//! Failure vocabulary and the responsibility policy (facts §14, decisions §7).
//!
//! Invariants: the registered kinds, legacy labels and stages are fixed vocabulary; which side is
//! responsible for a kind is [`ClassificationPolicy`] data, loaded from a run's saved policy JSON
//! when there is one (malformed is an error, never silently replaced by defaults); unregistered
//! and namespaced kinds are `unknown` unless a policy names them.

use regex::Regex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::LazyLock;

/// Registered failure kinds (`nemo_gym.core.failure_kinds`).
pub const REGISTERED_KINDS: &[&str] = &[
    "transport_unreachable",
    "transport_peer_drop",
    "transport_timeout",
    "transport_local_resource",
    "agent_run_error",
    "agent_request_failed",
    "agent_timeout",
    "agent_command_not_allowed",
    "agent_route_failed",
    "environment_server_failed",
    "protocol_violation",
    "judge_failed",
    "judge_unparseable",
    "verifier_error",
    "provider_unavailable",
    "provider_quota_exhausted",
    "provider_oom_killed",
    "session_lost",
    "session_expired",
    "session_release_failed",
    "cancelled",
    "kill_shaped",
    "shutdown",
    "persistence_failed",
    "cohort_incomplete",
    "model_transport_error",
    "model_server_error",
];

/// Legacy `_ng_failure_class` labels still seen in sidecars (never registered).
pub const LEGACY_LABELS: &[&str] = &[
    "timeout_exceeded",
    "skipped",
    "reference_missing",
    "eval_missing",
    "transport_ineligible",
    "judge_invalid",
    "remote_agent_error",
];

/// The shared name a legacy label stands for, where it has one.
pub fn shared_name(kind: &str) -> &str {
    match kind {
        "timeout_exceeded" => "agent_timeout",
        other => other,
    }
}

static KIND_NAME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\A[a-z][a-z0-9_]*\z").expect("static regex"));
static NAMESPACED_KIND: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\A[a-z][a-z0-9_]*:[a-z][a-z0-9_]*\z").expect("static regex"));

/// How a kind name stands in the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KindStatus {
    Registered,
    /// `<server>:<kind>`: groupable, never registered.
    Namespaced,
    /// A well-formed name nobody registered (accepted with a warning).
    Unregistered,
    /// Not a kind name at all.
    Invalid,
}

pub fn kind_status(kind: &str) -> KindStatus {
    if REGISTERED_KINDS.contains(&kind) {
        KindStatus::Registered
    } else if NAMESPACED_KIND.is_match(kind) {
        KindStatus::Namespaced
    } else if KIND_NAME.is_match(kind) {
        KindStatus::Unregistered
    } else {
        KindStatus::Invalid
    }
}

/// Where in a rollout's life a failure originated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FailureStage {
    Admission,
    Seed,
    Agent,
    Verification,
    Cleanup,
}

impl FailureStage {
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "admission" => Self::Admission,
            "seed" => Self::Seed,
            "agent" => Self::Agent,
            "verification" => Self::Verification,
            "cleanup" => Self::Cleanup,
            _ => return None,
        })
    }
}

/// Who is responsible for a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// The evaluation (infrastructure, harness, verifier) failed: retry within the budget.
    Evaluation,
    /// The evaluated model's own result: never sampled again.
    Model,
    Unknown,
}

impl FailureClass {
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "evaluation" => Self::Evaluation,
            "model" => Self::Model,
            "unknown" => Self::Unknown,
            _ => return None,
        })
    }
}

/// What an HTTP status says about a model call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HttpEvidence {
    Evaluation,
    Model,
    /// A timeout: never evidence of time spent on infrastructure.
    Timeout,
}

/// One HTTP status rule: statuses `from..=to` mean `evidence`. The first matching rule wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpRule {
    pub from: u16,
    pub to: u16,
    pub evidence: HttpEvidence,
}

/// The responsibility policy: one kind mapping, stage-dependent overrides, HTTP evidence rules,
/// server-fault call categories and material call kinds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassificationPolicy {
    /// Saved-policy format version.
    pub schema_version: u32,
    /// Kind -> class, whatever the stage.
    pub kinds: BTreeMap<String, FailureClass>,
    /// Kind -> class by originating stage; a kind listed here without its stage is `unknown`.
    pub stage_kinds: BTreeMap<String, BTreeMap<FailureStage, FailureClass>>,
    /// HTTP status rules, first match wins; unmatched statuses are no evidence.
    pub http: Vec<HttpRule>,
    /// Model-call `error_category` values that are server faults.
    pub server_fault_categories: Vec<String>,
    /// Call `error_category` values that never establish time spent on infrastructure.
    pub non_material_categories: Vec<String>,
    /// Per-call failure kinds that are server faults.
    pub material_call_kinds: Vec<String>,
    /// Registered kinds whose events identify sandbox/session or tool-server evidence.
    pub sandbox_or_tool_kinds: Vec<String>,
}

/// Evaluation-side kinds of the default policy (decisions §7).
pub const DEFAULT_EVALUATION_KINDS: &[&str] = &[
    "transport_unreachable",
    "transport_peer_drop",
    "transport_timeout",
    "transport_local_resource",
    "agent_request_failed",
    "agent_route_failed",
    "environment_server_failed",
    "protocol_violation",
    "judge_failed",
    "judge_unparseable",
    "verifier_error",
    "provider_unavailable",
    "provider_quota_exhausted",
    "session_lost",
    "session_expired",
    "session_release_failed",
    "cancelled",
    "kill_shaped",
    "shutdown",
    "persistence_failed",
    "cohort_incomplete",
    "model_transport_error",
    "model_server_error",
];
/// Model-side kinds of the default policy.
pub const DEFAULT_MODEL_KINDS: &[&str] = &[
    "agent_run_error",
    "agent_timeout",
    "agent_command_not_allowed",
];
/// Stage-dependent kinds of the default policy.
pub const DEFAULT_STAGE_KINDS: &[(&str, &[(FailureStage, FailureClass)])] = &[(
    "provider_oom_killed",
    &[
        (FailureStage::Agent, FailureClass::Model),
        (FailureStage::Seed, FailureClass::Evaluation),
    ],
)];
/// `SERVER_FAULT_CATEGORIES`.
pub const DEFAULT_SERVER_FAULT_CATEGORIES: &[&str] = &["upstream_error", "connection"];
/// Timeout, cancellation and truncated-stream evidence.
pub const DEFAULT_NON_MATERIAL_CATEGORIES: &[&str] = &["timeout", "cancelled", "stream_truncated"];
/// `_MATERIAL_CALL_FAILURE_KINDS`.
pub const DEFAULT_MATERIAL_CALL_KINDS: &[&str] = &[
    "model_transport_error",
    "model_server_error",
    "transport_unreachable",
    "transport_peer_drop",
];
/// Registered provider/session (sandbox) and tool-server kinds.
pub const DEFAULT_SANDBOX_OR_TOOL_KINDS: &[&str] = &[
    "provider_unavailable",
    "provider_quota_exhausted",
    "provider_oom_killed",
    "session_lost",
    "session_expired",
    "session_release_failed",
    "environment_server_failed",
];

impl Default for ClassificationPolicy {
    fn default() -> Self {
        let strings = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let mut kinds = BTreeMap::new();
        for kind in DEFAULT_EVALUATION_KINDS {
            kinds.insert((*kind).to_owned(), FailureClass::Evaluation);
        }
        for kind in DEFAULT_MODEL_KINDS {
            kinds.insert((*kind).to_owned(), FailureClass::Model);
        }
        let stage_kinds = DEFAULT_STAGE_KINDS
            .iter()
            .map(|(kind, stages)| ((*kind).to_owned(), stages.iter().copied().collect()))
            .collect();
        Self {
            schema_version: 1,
            kinds,
            stage_kinds,
            http: vec![
                HttpRule {
                    from: 408,
                    to: 408,
                    evidence: HttpEvidence::Timeout,
                },
                HttpRule {
                    from: 504,
                    to: 504,
                    evidence: HttpEvidence::Timeout,
                },
                HttpRule {
                    from: 429,
                    to: 429,
                    evidence: HttpEvidence::Evaluation,
                },
                HttpRule {
                    from: 500,
                    to: 599,
                    evidence: HttpEvidence::Evaluation,
                },
                HttpRule {
                    from: 400,
                    to: 499,
                    evidence: HttpEvidence::Model,
                },
            ],
            server_fault_categories: strings(DEFAULT_SERVER_FAULT_CATEGORIES),
            non_material_categories: strings(DEFAULT_NON_MATERIAL_CATEGORIES),
            material_call_kinds: strings(DEFAULT_MATERIAL_CALL_KINDS),
            sandbox_or_tool_kinds: strings(DEFAULT_SANDBOX_OR_TOOL_KINDS),
        }
    }
}

/// Why a saved policy cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed failure classification policy: {0}")]
pub struct PolicyError(pub String);

impl ClassificationPolicy {
    /// Reads a run's saved policy (`<stem>_failure_classification.json`). Every field is required:
    /// a saved policy states the whole policy the run was collected under.
    pub fn from_json(bytes: &[u8]) -> Result<Self, PolicyError> {
        let policy: Self = serde_json::from_slice(bytes).map_err(|e| PolicyError(e.to_string()))?;
        if policy.schema_version != 1 {
            return Err(PolicyError(format!(
                "schema_version {} is not supported (expected 1)",
                policy.schema_version
            )));
        }
        if let Some(rule) = policy
            .http
            .iter()
            .find(|r| r.from > r.to || r.from < 100 || r.to > 599)
        {
            return Err(PolicyError(format!(
                "http rule {}..={} is not a range of HTTP statuses",
                rule.from, rule.to
            )));
        }
        Ok(policy)
    }

    /// The responsibility for a kind at an (optional) originating stage.
    pub fn classify(&self, kind: &str, stage: Option<FailureStage>) -> FailureClass {
        let kind = shared_name(kind);
        if let Some(stages) = self.stage_kinds.get(kind) {
            return stage
                .and_then(|s| stages.get(&s).copied())
                .unwrap_or(FailureClass::Unknown);
        }
        self.kinds
            .get(kind)
            .copied()
            .unwrap_or(FailureClass::Unknown)
    }

    /// What an HTTP status says, if anything.
    pub fn http_evidence(&self, status: i64) -> Option<HttpEvidence> {
        self.http
            .iter()
            .find(|r| i64::from(r.from) <= status && status <= i64::from(r.to))
            .map(|r| r.evidence)
    }
}
