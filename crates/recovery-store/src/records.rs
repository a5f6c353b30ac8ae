//! The records the store keeps. Ids are those of the sidecar lines they mirror; times are
//! fixed-width RFC 3339 UTC text.

use serde::{Deserialize, Serialize};

/// A run and the identity its manifest records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RunRecord {
    pub run_id: String,
    pub output_path: String,
    pub source_digest: String,
    pub materialized_digest: String,
    pub config_digest: String,
    pub legacy_import: bool,
    pub identity_overridden: bool,
    pub max_rollout_attempts: Option<i64>,
    pub created_at: String,
    pub updated_at: String,
    /// The run that took this run's output over (this run is history only).
    #[serde(default)]
    pub superseded_by: Option<String>,
}

/// One `validate` outcome (refusals included).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResumeEvent {
    pub event_id: String,
    pub run_id: Option<String>,
    pub output_path: String,
    pub at: String,
    /// `reuse`, `resume_with_drift`, `refused`, `no_manifest`, `unreadable`, `overridden`,
    /// `import_legacy`, `locked`, `lease_not_held`, `superseded`, `invalid` (the request could
    /// not be acted on), `error` (the service failed).
    pub outcome: String,
    pub message: String,
    /// Mismatch codes.
    pub reasons: Vec<String>,
    pub semantic_keys: Vec<String>,
    pub operational_keys: Vec<String>,
    pub saved_config_digest: Option<String>,
    pub current_config_digest: Option<String>,
    /// The client name that asked.
    pub client: Option<String>,
}

/// One resume that proceeded across operational drift: keys and digests, never values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DriftEvent {
    pub event_id: String,
    pub run_id: String,
    pub at: String,
    pub saved_config_digest: String,
    pub current_config_digest: String,
    pub operational_keys: Vec<String>,
}

/// A keyset pagination cursor: the (time, id) of the last item seen.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Cursor {
    pub at: String,
    pub id: String,
}

impl Cursor {
    /// The opaque text form: `<at>|<id>`.
    pub fn encode(&self) -> String {
        format!("{}|{}", self.at, self.id)
    }

    pub fn decode(text: &str) -> Option<Self> {
        let (at, id) = text.split_once('|')?;
        (!at.is_empty() && !id.is_empty()).then(|| Self {
            at: at.to_owned(),
            id: id.to_owned(),
        })
    }
}

/// Which drift events to list.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DriftFilter {
    pub run_id: Option<String>,
    pub key: Option<String>,
    /// Inclusive lower bound (RFC 3339).
    pub from: Option<String>,
    /// Exclusive upper bound (RFC 3339).
    pub to: Option<String>,
    pub after: Option<Cursor>,
    pub limit: u32,
    /// Newest first (time, then id, descending; `after` is then the page's oldest).
    pub newest_first: bool,
}

/// Which drift events to follow in the order they were recorded: the filters of
/// [`DriftFilter`] and a position instead of a time cursor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriftFollow {
    pub run_id: Option<String>,
    pub key: Option<String>,
    /// Inclusive lower bound of `at` (RFC 3339).
    pub from: Option<String>,
    /// Exclusive upper bound of `at` (RFC 3339).
    pub to: Option<String>,
    /// Only events recorded after this position (0: from the first).
    pub after: i64,
    pub limit: u32,
}

/// A page of drift events in the order they were recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowedDrift {
    /// Each event with its recorded position, ascending.
    pub events: Vec<(i64, DriftEvent)>,
    /// The last position recorded when the page was read, in the same snapshot: when the page
    /// holds fewer than its limit, no event at or before `head` is left to find.
    pub head: i64,
    /// Which numbering the positions are of: a database made again numbers anew, under
    /// another epoch, so a position is only meaningful with its epoch.
    pub epoch: String,
}

/// An operator's approval to rerun exactly one masked attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Approval {
    pub approval_id: String,
    pub run_id: String,
    pub at: String,
    #[sqlx(rename = "by_actor")]
    pub by: String,
    pub reason: String,
    pub task_index: i64,
    pub rollout_index: i64,
    pub attempt_index: i64,
    pub consumed_by_attempt: Option<i64>,
    pub revoked_at: Option<String>,
}

impl Approval {
    /// The attempt it approves rerunning: `(task index, rollout index, attempt index)`.
    pub fn triple(&self) -> (i64, i64, i64) {
        (self.task_index, self.rollout_index, self.attempt_index)
    }
}

/// Attempts an explicit recovery added to every rollout's cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct AttemptExtension {
    pub event_id: String,
    pub run_id: String,
    pub at: String,
    #[sqlx(rename = "by_actor")]
    pub by: String,
    pub reason: String,
    pub extend_attempts: i64,
}

/// A resubmit: failures-sidecar lines up to `line_offset` no longer count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Resubmit {
    pub event_id: String,
    pub run_id: String,
    pub at: String,
    #[sqlx(rename = "by_actor")]
    pub by: String,
    pub line_offset: i64,
}

/// A judge-only re-judgment, open until its outcome is saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Rejudgment {
    pub operation_id: String,
    pub run_id: String,
    pub attempt_key: String,
    pub admitted_at: String,
    pub predecessor_failure_id: String,
    pub predecessor_sha256: String,
    pub closed_at: Option<String>,
    pub outcome: Option<String>,
}

/// Who holds a run, until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct Lease {
    pub run_id: String,
    /// What is kept of the holder's lease id: its [`crate::lease_digest`], never the id.
    pub lease_id: String,
    /// Client-supplied name.
    pub holder: String,
    pub host: String,
    pub pid: i64,
    pub acquired_at: String,
    pub renewed_at: String,
    pub expires_at: String,
    /// The service replica holding the run's `flock`.
    pub replica: String,
}

impl Lease {
    /// Whether `presented`, a lease id as its holder sends it, is this lease's.
    pub fn is_presented_as(&self, presented: &str) -> bool {
        self.lease_id == crate::lease_digest(presented)
    }
}

/// Which audit entries to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditFilter {
    pub run_id: Option<String>,
    pub actor: Option<String>,
    pub action: Option<String>,
    /// Only entries older than this one (the last of the page before: newest first).
    pub before: Option<Cursor>,
    pub limit: u32,
}

/// Every action the audit log records (a closed list: a filter on another is refused, and an
/// entry of another is a bug, asserted in debug builds).
pub const AUDIT_ACTIONS: [&str; 18] = [
    "run.created",
    "run.replace",
    "run.superseded",
    "run.import_legacy",
    "run.retry_terminal_timeouts",
    "lease.acquired",
    "lease.released",
    "lease.takeover",
    "lease.expired",
    "lease.adopted",
    "lease.lost",
    "lease.orphaned",
    "lease.lock_retaken",
    "lease.lock_displaced",
    "approval.create",
    "approval.revoke",
    "attempts.extend",
    "attempts.resubmit",
];

/// An operator action, audited.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditEntry {
    pub audit_id: String,
    pub at: String,
    pub actor: String,
    pub action: String,
    pub run_id: Option<String>,
    pub details: serde_json::Value,
}

/// A signed-in console session, kept under the SHA-256 of its random id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct ConsoleSession {
    pub session_hash: String,
    /// The token's name (the token itself is never kept).
    pub name: String,
    /// `viewer`, `collector` or `operator`.
    pub role: String,
    pub created_at: String,
    pub expires_at: String,
    /// Which token opened the session: a domain-separated SHA-256 of the token's SHA-256
    /// (`None` for sessions recorded before it was kept: they open nothing).
    pub token_fingerprint: Option<String>,
}

/// How far an append-only journal was indexed (migrations 0004 and, SQLite, 0012).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalMarkRow {
    /// The file's device and inode when it was read.
    pub device: i64,
    pub inode: i64,
    /// The byte offset indexed up to: the end of the last line read.
    pub indexed_to: i64,
    /// SHA-256 (hex) of up to 4,096 bytes ending at `indexed_to`; `None` on marks older than it.
    pub before_mark: Option<String>,
}
