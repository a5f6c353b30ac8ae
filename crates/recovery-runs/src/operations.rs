//! The run-level operations: create, validate a resume, reserve, admit and close re-judgments,
//! approve and revoke masked reruns, extend, resubmit, replace. Each change runs over a
//! [`LockedRun`] (so it cannot be called without the run's critical section); front ends (the
//! HTTP service, the CLI) only parse, authorize, lock, call one of these and map the result.
//!
//! Invariants: an operation decides from what it reads inside the section and writes nothing
//! until every check has passed, so a refused operation changes nothing; files are written
//! before rows (the files are the truth; reindex replays them); a run whose output the files
//! show to belong to another run is never acted on ([`Registry::check_owner`]).

use crate::approvals::{Follow, follow_journal};
use crate::cache::{MaterializedFacts, RunCaches};
use crate::registry::{Registry, RegistryError, journalled_approvals, unix_to_text};
use crate::runfiles::{self, RunFilesError};
use crate::runlock::{LockedRun, SharedRun};
use recovery_core::canonical::sha256_reader;
use recovery_core::drift::DriftPolicy;
use recovery_core::identity::{
    ConfigBundle, ConfigurationIdentity, IdentityError, RowReferences, holds_interpolation,
    resolved_collection_setting,
};
use recovery_core::manifest::{PendingRejudge, RunManifest, timeout_retries_opt_in};
use recovery_core::plan::{PlanEntry, PlanState};
use recovery_core::verdict::{
    CurrentRun, Mismatch, ResumeVerdict, SavedManifest, SavedRun, validate_resume,
};
use recovery_sidecar::SidecarPaths;
use recovery_store::{Approval, AttemptExtension, AuditEntry, Rejudgment, Resubmit, StoreError};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};

/// How many attempts one extension may add to every rollout's cap.
pub const EXTENSION_RANGE: std::ops::RangeInclusive<i64> = 1..=100;

/// What a resume across operational drift tells its collector (the service's answer and the
/// offline `validate` say the same).
pub fn drift_message(operational_keys: &[String]) -> String {
    format!(
        "Resuming across operational configuration drift: {}.",
        operational_keys.join(", ")
    )
}

/// Why an operation was refused or failed. Each variant is one stable API error code.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// A request field is malformed; the message starts with the field's path and `: `
    /// (`rows[3]: must be a JSON object`), which [`OpError::field`] reads back.
    #[error("{0}")]
    Invalid(String),
    /// The source dataset named by the request cannot be read (a resume with `allow_unsafe`
    /// goes on without a current identity).
    #[error("{0}")]
    SourceUnreadable(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{message}")]
    NotEligible { message: String, details: Value },
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    LeaseNotHeld(String),
    /// A live lease holds the run (the change needs it free).
    #[error("run {} is held by {}", .0.run_id, .0.holder)]
    Leased(Box<recovery_store::Lease>),
    #[error("{message}")]
    RunExists {
        message: String,
        run_id: Option<String>,
    },
    #[error("run {run_id} was superseded by run {by}, whose manifest is at its output now")]
    Superseded { run_id: String, by: String },
    #[error("{0}")]
    PathRefused(String),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error("{message}")]
    ResumeRefused {
        message: String,
        mismatches: Vec<Mismatch>,
    },
    #[error(transparent)]
    Files(#[from] RunFilesError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Lease(#[from] crate::LeaseError),
    #[error("background file work failed: {0}")]
    Join(String),
    /// A rule of this module was broken (a bug, never the caller's input).
    #[error("internal invariant broken: {0}")]
    Invariant(&'static str),
}

/// A field path as messages of [`OpError::Invalid`] start with: `name`, `rows[3]`,
/// `rows[3].key`.
static FIELD_PATH: LazyLock<regex::Regex> = LazyLock::new(|| {
    regex::Regex::new(r"^[A-Za-z_][A-Za-z0-9_]*(\[[0-9]+\]|\.[A-Za-z0-9_]+)*$")
        .expect("static regex")
});

impl OpError {
    /// The request field a refusal is about (`Invalid` and `SourceUnreadable` messages name it
    /// first), for the API's `details.field`.
    pub fn field(&self) -> Option<&str> {
        let (OpError::Invalid(message) | OpError::SourceUnreadable(message)) = self else {
            return None;
        };
        field_named_in(message)
    }
}

/// The request field a message names first (`source_path: ...`), if it names one.
pub fn field_named_in(message: &str) -> Option<&str> {
    let (field, _) = message.split_once(": ")?;
    // `body: ...` and `query: ...` are about the request as a whole, which is no field.
    (FIELD_PATH.is_match(field) && !matches!(field, "body" | "query")).then_some(field)
}

/// Runs blocking file work off the async executor.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, OpError> + Send + 'static,
) -> Result<T, OpError> {
    crate::background::spawn(work)
        .await
        .map_err(|e| OpError::Join(e.to_string()))?
}

fn io_failure(context: &str, source: std::io::Error) -> OpError {
    OpError::Files(RunFilesError::Io {
        context: context.to_owned(),
        source,
    })
}

/// The logical rollout id grammar (facts §1: `_ng_rollout_id`), which attempt keys build on.
static ROLLOUT_ID: LazyLock<regex::Regex> =
    LazyLock::new(|| regex::Regex::new("^[A-Za-z0-9][A-Za-z0-9._-]*$").expect("static regex"));

/// The section a validation runs in.
#[derive(Clone, Copy)]
enum Section<'a> {
    Shared(&'a SharedRun),
    Exclusive(&'a LockedRun),
}

impl Section<'_> {
    fn paths(&self) -> &SidecarPaths {
        match self {
            Section::Shared(run) => run.paths(),
            Section::Exclusive(run) => run.paths(),
        }
    }
}

/// A judge-only re-judgment to admit.
#[derive(Debug, Clone)]
pub struct Admission {
    pub rollout_id: String,
    pub attempt: u64,
    pub predecessor_failure_id: String,
    /// The predecessor failure line exactly as saved (without its newline).
    pub predecessor_line: String,
}

/// Whether an admission opened a re-judgment or found it open for the same predecessor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    Opened,
    AlreadyOpen,
}

/// A collector's resume request, its paths already confined.
#[derive(Debug, Clone)]
pub struct ResumeRequest {
    /// The collection settings and the server tree as sent: parsed only when no recent request
    /// sent the same texts (their identity is then taken from [`RunCaches::current_identities`]).
    pub config: Box<serde_json::value::RawValue>,
    pub global_config: Box<serde_json::value::RawValue>,
    pub environment: BTreeMap<String, String>,
    pub source: PathBuf,
    /// The rows materialized now: the array's raw JSON text (never built into trees; split
    /// into rows only when no recent request sent the same text); `None` takes the saved ones
    /// as current.
    pub rows: Option<Box<serde_json::value::RawValue>>,
    pub allow_unsafe: bool,
}

impl ResumeRequest {
    /// The raw texts are fields of a request (the service's body, the CLI's bundle), one level
    /// down: their nesting is bounded as the request's is, counted from its root, when they
    /// are first read.
    pub const LEVELS_ABOVE: usize = 1;
}

/// What a resume validation decided (refusals are [`OpError::ResumeRefused`] and friends).
#[derive(Debug, Clone)]
pub struct Resumed {
    /// `reuse`, `resume_with_drift`, `overridden` or `import_legacy`.
    pub outcome: &'static str,
    pub message: Option<String>,
    pub operational_keys: Vec<String>,
    pub drift_event_id: Option<String>,
    /// Mismatch codes an override accepted.
    pub reasons: Vec<String>,
    /// Semantic keys an override accepted.
    pub semantic_keys: Vec<String>,
    pub manifest: Option<Value>,
}

/// What a validation records beside its answer.
#[derive(Debug, Clone, Default)]
pub struct ResumeRecord {
    /// The current configuration digest the validation computed (also on refusal).
    pub config_digest: Option<String>,
    /// The validation's resume event, still to be committed. A resume across drift completes
    /// it and commits it in the drift row's transaction (one commit, not two), once its journal
    /// line is durable, leaving `None`; otherwise the caller completes and commits it.
    pub event: Option<recovery_store::ResumeEvent>,
}

/// A run to create: what the collector sent, its paths already confined.
#[derive(Debug, Clone)]
pub struct NewRun {
    pub source: PathBuf,
    pub config: Value,
    pub global_config: Value,
    pub environment: BTreeMap<String, String>,
    pub rows: Option<Vec<Value>>,
    pub max_rollout_attempts: Option<u64>,
    pub retry_terminal_timeouts: bool,
    pub replace: bool,
}

/// A run validated before its lock is taken: nothing is written before.
#[derive(Debug)]
pub struct PreparedRun {
    pub manifest: RunManifest,
    pub identity: ConfigurationIdentity,
    /// The materialized rows to publish, when they were sent.
    materialized: Option<Vec<u8>>,
    replace: bool,
}

/// A created run: its manifest and identity, and the files a replacement moved aside.
#[derive(Debug)]
pub struct CreatedRun {
    pub manifest: RunManifest,
    pub identity: ConfigurationIdentity,
    pub replaced: Vec<String>,
}

fn file_sha256(path: &Path) -> Result<String, OpError> {
    let cannot = |e: std::io::Error| {
        OpError::SourceUnreadable(format!("source_path: cannot read {}: {e}", path.display()))
    };
    sha256_reader(recovery_sidecar::open_regular_following(path).map_err(cannot)?).map_err(cannot)
}

impl Registry {
    /// Records an operator or collector action in the audit log.
    pub async fn audit(
        &self,
        actor: &str,
        action: &str,
        run_id: Option<&str>,
        details: Value,
    ) -> Result<(), StoreError> {
        self.store()
            .insert_audit(&AuditEntry {
                audit_id: recovery_sidecar::new_id(),
                at: self.clock().now_text(),
                actor: actor.to_owned(),
                action: action.to_owned(),
                run_id: run_id.map(str::to_owned),
                details,
            })
            .await
    }

    /// Refuses a change to `run_id` unless its manifest is at its output and names it: another
    /// run there (a Python collector's fresh start, a recreated directory) is adopted and this
    /// one reported superseded; a missing or unreadable manifest refuses, so nothing is written
    /// beside an output that no manifest ties to this run.
    pub async fn check_owner(&self, run: &LockedRun, run_id: &str) -> Result<(), OpError> {
        let path = run.paths().manifest.clone();
        let saved = blocking(move || Ok(runfiles::read_manifest(&path))).await?;
        let shown = run.paths().manifest.display();
        match saved {
            SavedManifest::Missing => Err(RunFilesError::NoManifest(format!(
                "run {run_id} has no manifest at {shown}: nothing is changed beside it"
            ))
            .into()),
            SavedManifest::Unreadable(reason) => Err(RunFilesError::ManifestUnreadable(format!(
                "Cannot read recovery manifest {shown}: {reason}"
            ))
            .into()),
            SavedManifest::Read(manifest) => {
                self.check_not_superseded(run, run_id, &manifest).await
            }
        }
    }

    /// Refuses `run_id` when the manifest at its output names another run (which is adopted).
    async fn check_not_superseded(
        &self,
        run: &LockedRun,
        run_id: &str,
        manifest: &RunManifest,
    ) -> Result<(), OpError> {
        if manifest.run_id == run_id {
            return Ok(());
        }
        self.adopt_locked(run).await?;
        Err(OpError::Superseded {
            run_id: run_id.to_owned(),
            by: manifest.run_id.clone(),
        })
    }

    /// Refuses unless `lease_id` holds the run now (checked inside the section, so the lease
    /// cannot end between the check and the change).
    pub async fn check_lease_holder(
        &self,
        run: &LockedRun,
        run_id: &str,
        lease_id: &str,
    ) -> Result<(), OpError> {
        let live = self.live_lease_in(run, run_id).await?;
        if live.is_some_and(|l| l.is_presented_as(lease_id)) {
            Ok(())
        } else {
            Err(OpError::LeaseNotHeld(format!(
                "the lease presented does not hold run {run_id}"
            )))
        }
    }

    /// Refuses while a live lease holds the run (seen from inside its section).
    pub async fn check_unleased(&self, run: &LockedRun, run_id: &str) -> Result<(), OpError> {
        match self.live_lease_in(run, run_id).await? {
            Some(lease) => Err(OpError::Leased(Box::new(lease))),
            None => Ok(()),
        }
    }

    /// The run's live lease seen from inside its section: a lease whose process is gone (the
    /// section took the `flock` itself, so nobody holds it) is ended, audited, and not live.
    async fn live_lease_in(
        &self,
        run: &LockedRun,
        run_id: &str,
    ) -> Result<Option<recovery_store::Lease>, OpError> {
        let now = self.clock().now_text();
        let Some(lease) = self
            .store()
            .get_lease(run_id)
            .await?
            .filter(|l| l.expires_at > now)
        else {
            return Ok(None);
        };
        if !run.took_the_flock() {
            return Ok(Some(lease));
        }
        if !self.leases().is_ours(&lease) {
            // Another replica granted it and stopped (its flock went with it): the lease
            // outlives it, as a restart's does, and a running replica's sweep takes its locks
            // again (`Leases::adopt_live`); its collector is never refused meanwhile.
            return Ok(Some(lease));
        }
        self.store().release_lease(run_id, &lease.lease_id).await?;
        self.audit(
            "system",
            "lease.orphaned",
            Some(run_id),
            serde_json::json!({"holder": lease.holder, "host": lease.host, "pid": lease.pid, "replica": lease.replica, "why": "no process holds the run's flock: its holder is gone"}),
        )
        .await?;
        tracing::warn!(run_id, holder = %lease.holder, "a lease whose process is gone was ended");
        Ok(None)
    }

    /// The run's live lease: checked against the run's `flock` when this process does not hold
    /// it, so a lease whose process died (a crash, a kill) is ended rather than reported live.
    pub async fn live_lease(
        &self,
        paths: &SidecarPaths,
        run_id: &str,
    ) -> Result<Option<recovery_store::Lease>, OpError> {
        let lease = self.leases().holder(run_id).await?;
        if lease.is_none() || self.leases().held_lock(&paths.run_lock).is_some() {
            return Ok(lease);
        }
        match self.lock(paths).await {
            Ok(run) => self.live_lease_in(&run, run_id).await,
            // Another process holds the flock: the lease's holder, alive.
            Err(crate::RunLockError::Locked(_)) => Ok(lease),
            Err(e) => Err(RegistryError::from(e).into()),
        }
    }

    /// Works over the run's plan (indexed once, caught up with its files), inside its section.
    async fn locked_plan<T: Send + 'static>(
        &self,
        run: &LockedRun,
        default_cap: u64,
        work: impl FnOnce(&crate::plans::RunPlan<'_>) -> T + Send + 'static,
    ) -> Result<T, OpError> {
        let (paths, caches) = (run.paths().clone(), self.caches().clone());
        blocking(move || Ok(caches.plans.with_plan(&paths, default_cap, work)?)).await
    }

    /// Reserves the next execution number of each rollout: distinct and gapless per rollout,
    /// every one in the manifest before the answer; an approved masked rerun is used by the
    /// attempt reserved for it. A refused reserve writes nothing.
    pub async fn reserve(
        &self,
        run: &LockedRun,
        run_id: &str,
        rollout_ids: &[String],
        default_cap: u64,
    ) -> Result<BTreeMap<String, i64>, OpError> {
        // Each id is named by its place in the list (`rollout_ids[3]`), quoted: an empty or
        // odd one stays visible.
        let mut first_at: HashMap<&str, usize> = HashMap::new();
        for (i, id) in rollout_ids.iter().enumerate() {
            if let Some(first) = first_at.insert(id, i) {
                return Err(OpError::Invalid(format!(
                    "rollout_ids[{i}]: {id:?} is listed twice (first at rollout_ids[{first}])"
                )));
            }
        }
        let ids = rollout_ids.to_vec();
        let (mut manifest, found) = self
            .locked_plan(run, default_cap, move |plan| {
                let view = plan.view();
                let found: Vec<Option<PlanEntry>> =
                    ids.iter().map(|id| view.entry_for(id)).collect();
                (plan.manifest.clone(), found)
            })
            .await?;
        let found = found
            .into_iter()
            .zip(rollout_ids)
            .enumerate()
            .map(|(i, (entry, id))| {
                entry.ok_or_else(|| {
                    OpError::Invalid(format!(
                        "rollout_ids[{i}]: {id:?} is not in this run's materialized inputs"
                    ))
                })
            })
            .collect::<Result<Vec<PlanEntry>, OpError>>()?;
        refuse_unrunnable(&found)?;
        let mut entries: HashMap<&str, PlanEntry> = HashMap::new();
        let mut attempts = BTreeMap::new();
        for (id, entry) in rollout_ids.iter().zip(found) {
            let attempt = next_execution(&manifest, id, &entry)?;
            // `attempt` is below `MAX_NEXT_ATTEMPT`: the number after it is one a manifest holds.
            manifest.next_attempt.insert(id.clone(), attempt as u64 + 1);
            attempts.insert(id.clone(), attempt);
            entries.insert(id.as_str(), entry);
        }
        self.write_manifest(run, &manifest, None).await?;
        let approvals = self.store().list_approvals(run_id).await?;
        for (id, attempt) in &attempts {
            let Some(entry) = entries
                .get(id.as_str())
                .filter(|e| e.state == PlanState::ApprovedRerun)
            else {
                continue;
            };
            let triple = (
                recovery_core::rows::index(entry.task_index.as_ref()),
                recovery_core::rows::index(entry.rollout_index.as_ref()),
                entry.latest_attempt,
            );
            if let Some(approval) = approvals.iter().find(|a| {
                a.consumed_by_attempt.is_none()
                    && a.revoked_at.is_none()
                    && (
                        Some(a.task_index),
                        Some(a.rollout_index),
                        Some(a.attempt_index),
                    ) == triple
            }) {
                self.store()
                    .consume_approval(run_id, &approval.approval_id, *attempt)
                    .await?;
            }
        }
        Ok(attempts)
    }

    /// Admits a judge-only re-judgment: the attempt was reserved, the predecessor line is in
    /// the failures sidecar byte for byte, the ids follow the grammar. Admitting the same
    /// predecessor again answers the open re-judgment.
    pub async fn admit_rejudgment(
        &self,
        run: &LockedRun,
        run_id: &str,
        admission: &Admission,
    ) -> Result<(Admitted, Rejudgment), OpError> {
        check_admission(admission)?;
        let mut manifest = self.readable_manifest(run).await?;
        let key = format!("{}-a{}", admission.rollout_id, admission.attempt);
        let sha256 = recovery_core::canonical::sha256_hex(admission.predecessor_line.as_bytes());
        if let Some(open) = manifest.pending_rejudge.get(&key) {
            if open.predecessor_failure_id != admission.predecessor_failure_id
                || open.predecessor_sha256 != sha256
            {
                return Err(OpError::Conflict(format!(
                    "a re-judgment of {key} is already open for another predecessor"
                )));
            }
            let recorded = self
                .store()
                .list_rejudgments(run_id)
                .await?
                .into_iter()
                .find(|r| r.operation_id == open.operation_id);
            let rejudgment = recorded.unwrap_or_else(|| rejudgment_of(run_id, &key, open, None));
            return Ok((Admitted::AlreadyOpen, rejudgment));
        }
        let reserved = manifest
            .next_attempt
            .get(&admission.rollout_id)
            .is_some_and(|next| admission.attempt < *next);
        if !reserved {
            return Err(OpError::Invalid(format!(
                "attempt: {} of {} was never reserved in this run",
                admission.attempt, admission.rollout_id
            )));
        }
        // Only the attempt's judge failure is re-judged: the line names the rollout and the
        // attempt, and the plan has that attempt as the rollout's latest, judge_recoverable
        // (hostile review 35: a scored result, another rollout's line, another attempt's, or
        // the same predecessor after its successor was saved were admitted, and the re-judged
        // outcome then broke the plan).
        predecessor_names(admission)?;
        let rollout = admission.rollout_id.clone();
        let cap = manifest.max_rollout_attempts.unwrap_or(3);
        let entry = self
            .locked_plan(run, cap, move |plan| plan.view().entry_for(&rollout))
            .await?
            .ok_or_else(|| {
                OpError::Invalid(format!(
                    "rollout_id: {} is no rollout of this run",
                    admission.rollout_id
                ))
            })?;
        let attempt = i64::try_from(admission.attempt).unwrap_or(i64::MAX);
        if entry.latest_attempt != Some(attempt) || entry.state != PlanState::JudgeRecoverable {
            return Err(OpError::NotEligible {
                message: format!(
                    "only the latest attempt of a judge_recoverable rollout (a judge failure on a saved answer) is re-judged; attempt {} of {} is not: the rollout's latest attempt is {} and it is {}",
                    admission.attempt,
                    admission.rollout_id,
                    entry
                        .latest_attempt
                        .map_or_else(|| "none".to_owned(), |a| a.to_string()),
                    state_name(entry.state),
                ),
                details: serde_json::json!({"state": entry.state, "reason": entry.reason, "latest_attempt": entry.latest_attempt}),
            });
        }

        // A judge failure is a failure row in the sidecar, or a result whose grade failed
        // (`failure_kind: judge_unparseable`) in the results file: both are re-judged.
        let files = [run.paths().failures.clone(), run.paths().output.clone()];
        let expected = sha256.clone();
        let held = blocking(move || {
            for file in &files {
                // A torn final line is no saved line.
                if holds_line(file, |bytes, terminated| {
                    terminated && recovery_core::canonical::sha256_hex(bytes) == expected
                })
                .map_err(|e| io_failure("reading the run's outcomes", e))?
                {
                    return Ok(true);
                }
            }
            Ok(false)
        })
        .await?;
        if !held {
            return Err(OpError::Invalid(
                "predecessor_line: neither the failures sidecar nor the results file holds such a line (send the saved line's exact bytes)".into(),
            ));
        }
        let now = self.clock().now();
        let pending = PendingRejudge {
            admitted_at: now.unix_timestamp_nanos() as f64 / 1e9,
            operation_id: recovery_sidecar::new_id(),
            predecessor_failure_id: admission.predecessor_failure_id.clone(),
            predecessor_sha256: sha256,
        };
        manifest
            .pending_rejudge
            .insert(key.clone(), pending.clone());
        self.write_manifest(run, &manifest, None).await?;
        let rejudgment = rejudgment_of(
            run_id,
            &key,
            &pending,
            Some(recovery_sidecar::format_rfc3339(now)),
        );
        self.record_rejudgment(run, &rejudgment).await?;
        Ok((Admitted::Opened, rejudgment))
    }

    /// Closes an open re-judgment once its outcome is saved.
    pub async fn close_rejudgment(
        &self,
        run: &LockedRun,
        run_id: &str,
        operation_id: &str,
        outcome: &str,
    ) -> Result<(), OpError> {
        let mut manifest = self.readable_manifest(run).await?;
        let key = manifest
            .pending_rejudge
            .iter()
            .find(|(_, p)| p.operation_id == operation_id)
            .map(|(k, _)| k.clone())
            .ok_or_else(|| {
                OpError::NotFound(format!(
                    "run {run_id} has no open re-judgment {operation_id}"
                ))
            })?;
        manifest.pending_rejudge.shift_remove(&key);
        self.write_manifest(run, &manifest, None).await?;
        self.store()
            .close_rejudgment(operation_id, &self.clock().now_text(), outcome)
            .await?;
        Ok(())
    }

    /// Approves rerunning exactly one masked attempt that kept an answer without a grade.
    pub async fn approve(
        &self,
        run: &LockedRun,
        run_id: &str,
        by: &str,
        reason: &str,
        (task_index, rollout_index, attempt_index): (i64, i64, i64),
        default_cap: u64,
    ) -> Result<Approval, OpError> {
        if reason.trim().is_empty() {
            return Err(OpError::Invalid(
                "reason: say why this rerun is approved".into(),
            ));
        }
        let entry = self
            .locked_plan(run, default_cap, move |plan| {
                plan.view().entry_at_indices(task_index, rollout_index)
            })
            .await?
            .ok_or_else(|| {
                OpError::NotFound(format!(
                    "run {run_id} has no rollout with task_index {task_index} and rollout_index {rollout_index}"
                ))
            })?;
        let details = serde_json::json!({"state": entry.state, "reason": entry.reason, "latest_attempt": entry.latest_attempt});
        if entry.latest_attempt != Some(attempt_index) {
            return Err(OpError::NotEligible {
                message: match entry.latest_attempt {
                    Some(latest) => format!(
                        "attempt {attempt_index} is not the rollout's latest attempt ({latest})"
                    ),
                    None => format!(
                        "attempt {attempt_index} was never made: the rollout has no attempt yet"
                    ),
                },
                details,
            });
        }
        if entry.state != PlanState::AwaitingApproval {
            return Err(OpError::NotEligible {
                message: format!(
                    "only a masked result that kept an answer without a grade is eligible; this attempt is {}: {}",
                    state_name(entry.state),
                    entry.reason
                ),
                details,
            });
        }
        refuse_unterminated_approval(run.paths()).await?;
        let approval = self
            .record_approval(
                run,
                run_id,
                by,
                reason,
                (task_index, rollout_index, attempt_index),
            )
            .await?;
        self.audit(
            by,
            "approval.create",
            Some(run_id),
            serde_json::json!({"approval_id": approval.approval_id, "reason": reason}),
        )
        .await?;
        Ok(approval)
    }

    /// The run's approvals, each used one with the attempt that used it as the run's files
    /// tell (an attempt reserved after the approved one), also when the database did not see
    /// that reservation (a Python collector's). An approval the journal holds as the database
    /// does not (a line a Python collector or an operator wrote, a revoked id written again, a
    /// line edited) is listed as the journal says, as the plan honours it: the database learns
    /// it at the next reindex or revocation. Read-only; a run whose files cannot be planned is
    /// listed as the database has it.
    pub async fn approvals(
        &self,
        paths: &SidecarPaths,
        run_id: &str,
        default_cap: u64,
    ) -> Result<Vec<Approval>, OpError> {
        let mut approvals = self.store().list_approvals(run_id).await?;
        if let Some(journal) = journalled_approvals(paths).await {
            let follows = follow_journal(run_id, &approvals, journal);
            let mut removed_at: Option<String> = None;
            for follow in follows {
                match follow {
                    Follow::Insert(line) => approvals.push(line),
                    Follow::Restore(line) => {
                        if let Some(recorded) = approvals
                            .iter_mut()
                            .find(|a| a.approval_id == line.approval_id)
                        {
                            *recorded = line;
                        }
                    }
                    // Listed as revoked when the journal last changed.
                    Follow::Revoke(approval_id) => {
                        let at = removed_at
                            .get_or_insert_with(|| journal_changed_at(&paths.rerun_masked))
                            .clone();
                        if let Some(open) =
                            approvals.iter_mut().find(|a| a.approval_id == approval_id)
                        {
                            open.revoked_at = Some(at);
                        }
                    }
                }
            }
        }
        let open: Vec<(usize, (i64, i64, i64))> = approvals
            .iter()
            .enumerate()
            .filter(|(_, a)| a.consumed_by_attempt.is_none() && a.revoked_at.is_none())
            .map(|(i, a)| (i, a.triple()))
            .collect();
        if open.is_empty() {
            return Ok(approvals);
        }
        let (caches, paths) = (self.caches().clone(), paths.clone());
        let used =
            blocking(move || Ok(caches.plans.used_approvals(&paths, default_cap, open))).await?;
        for (i, attempt) in used {
            approvals[i].consumed_by_attempt = Some(attempt);
        }
        Ok(approvals)
    }

    /// Revokes an approval before an attempt uses it. Whether one did is read from the run's
    /// files (an attempt reserved after the approved one), not only from the database, which a
    /// rebuild or a Python collector's reservation leaves unaware of it.
    pub async fn revoke(
        &self,
        run: &LockedRun,
        run_id: &str,
        by: &str,
        approval_id: &str,
        default_cap: u64,
    ) -> Result<(), OpError> {
        // The approval as the journal holds it is recorded first, as a reindex would: the plan
        // honours it, so it can be revoked.
        if let Some(journal) = journalled_approvals(run.paths()).await {
            let recorded = self.store().list_approvals(run_id).await?;
            for follow in follow_journal(run_id, &recorded, journal) {
                match follow {
                    Follow::Insert(line) if line.approval_id == approval_id => {
                        self.store().insert_approval(&line).await?;
                    }
                    Follow::Restore(line) if line.approval_id == approval_id => {
                        self.store().restore_approval(&line).await?;
                    }
                    _ => {}
                }
            }
        }
        let approvals = self.store().list_approvals(run_id).await?;
        let approval = approvals
            .iter()
            .find(|a| a.approval_id == approval_id)
            .ok_or_else(|| {
                OpError::NotFound(format!("run {run_id} has no approval {approval_id}"))
            })?;
        if approval.consumed_by_attempt.is_some() || approval.revoked_at.is_some() {
            return Err(OpError::Conflict(format!(
                "approval {approval_id} was already used or revoked"
            )));
        }
        let triple = approval.triple();
        let used_by = self
            .locked_plan(run, default_cap, move |plan| {
                crate::plans::approval_used_by(&plan.view(), triple)
            })
            .await?;
        if let Some(attempt) = used_by {
            // The database learns it now (the approval's row said unused).
            self.store()
                .consume_approval(run_id, approval_id, attempt)
                .await?;
            return Err(OpError::Conflict(format!(
                "approval {approval_id} was already used: attempt {attempt} was reserved after the approved attempt {}",
                triple.2
            )));
        }
        self.revoke_approval(run, run_id, approval_id).await?;
        self.audit(
            by,
            "approval.revoke",
            Some(run_id),
            serde_json::json!({"approval_id": approval_id}),
        )
        .await?;
        Ok(())
    }

    /// Adds attempts to every rollout's cap (`--extend-attempts`).
    pub async fn extend(
        &self,
        run: &LockedRun,
        run_id: &str,
        by: &str,
        reason: &str,
        extend_attempts: i64,
    ) -> Result<AttemptExtension, OpError> {
        if !EXTENSION_RANGE.contains(&extend_attempts) {
            return Err(OpError::Invalid(format!(
                "extend_attempts: out of range: must be between {} and {}",
                EXTENSION_RANGE.start(),
                EXTENSION_RANGE.end()
            )));
        }
        if reason.trim().is_empty() {
            return Err(OpError::Invalid(
                "reason: say why attempts are added".into(),
            ));
        }
        // A journal the plan refuses (decisions §6: an unreadable line is an error, never a
        // guessed cap) is not appended to: the run would stay unplannable with the new line
        // after the bad one (hostile review 48). It is repaired by hand first.
        let paths = run.paths().clone();
        let extended = match blocking(move || Ok(runfiles::budget_inputs(&paths))).await? {
            Ok(inputs) => Some(inputs.extension),
            Err(RunFilesError::RowsInvalid(why)) => {
                return Err(OpError::Files(RunFilesError::Inconsistent(format!(
                    "{why}: the attempt extension journal is not appended to until it is repaired"
                ))));
            }
            Err(_) => None,
        };
        // Nor is a line appended that would make the journal one the plan refuses: the sum
        // past 2^63 - 1 (hostile review 51, N2).
        if let Some(total) = extended
            && i64::try_from(total)
                .ok()
                .and_then(|total| total.checked_add(extend_attempts))
                .is_none()
        {
            return Err(OpError::Files(RunFilesError::Inconsistent(format!(
                "extend_attempts: the run's extensions ({total}) and {extend_attempts} more would add up past {} attempts; nothing appended",
                i64::MAX
            ))));
        }
        let extension = self
            .record_extension(run, run_id, by, reason, extend_attempts)
            .await?;
        self.audit(
            by,
            "attempts.extend",
            Some(run_id),
            serde_json::json!({"extend_attempts": extend_attempts, "reason": reason}),
        )
        .await?;
        Ok(extension)
    }

    /// Resets the failure budget: earlier failures no longer count.
    pub async fn resubmit(
        &self,
        run: &LockedRun,
        run_id: &str,
        by: &str,
        reason: &str,
    ) -> Result<Resubmit, OpError> {
        // As every other operator action's: the audit says why (hostile review 55, F7).
        if reason.trim().is_empty() {
            return Err(OpError::Invalid(
                "reason: say why the failure budget is reset".into(),
            ));
        }
        let resubmit = self.record_resubmit(run, run_id, by).await?;
        self.audit(
            by,
            "attempts.resubmit",
            Some(run_id),
            serde_json::json!({"line_offset": resubmit.line_offset, "reason": reason}),
        )
        .await?;
        Ok(resubmit)
    }

    async fn readable_manifest(&self, run: &LockedRun) -> Result<RunManifest, OpError> {
        let path = run.paths().manifest.clone();
        blocking(move || match runfiles::read_manifest(&path) {
            recovery_core::verdict::SavedManifest::Read(manifest) => Ok(*manifest),
            _ => Err(RunFilesError::ManifestUnreadable(format!(
                "{} cannot be read",
                path.display()
            ))
            .into()),
        })
        .await
    }

    /// Checks a new run completely (paths, rows as the planner will see them, identity, source)
    /// before anything is written; refuses an output that shares files with the dataset or
    /// another run.
    pub async fn prepare_run(
        &self,
        paths: &SidecarPaths,
        request: NewRun,
        default_cap: u64,
    ) -> Result<PreparedRun, OpError> {
        self.check_output(paths, Some(&request.source)).await?;
        let paths = paths.clone();
        blocking(move || prepare(&request, &paths, default_cap)).await
    }

    /// Refuses an output whose companions (the manifest first) belong to a run recorded at
    /// another output that shares them (`out.json` beside `out.jsonl`).
    async fn refuse_companions_of_another_output(
        &self,
        paths: &SidecarPaths,
    ) -> Result<(), OpError> {
        if let Some(owner) = recovery_sidecar::read_regular(&paths.manifest)
            .ok()
            .and_then(|bytes| RunManifest::from_json_bytes(&bytes).ok())
            && let Some(record) = self.store().get_run(&owner.run_id).await?
            && Path::new(&record.output_path) != paths.output
            && record.superseded_by.is_none()
        {
            return Err(OpError::PathRefused(format!(
                "output_path: its companions ({}) belong to run {} at {}",
                paths.manifest.display(),
                owner.run_id,
                record.output_path
            )));
        }
        Ok(())
    }

    /// Refuses an output a run cannot have: a link on the way, a file that is not a regular
    /// one, a name the service reads as a run's manifest, files that are another run's, and
    /// (for a create, which names its source) a companion that is the source dataset itself:
    /// a create moves stale companions aside, and would move the dataset (review 57, M1).
    async fn check_output(
        &self,
        paths: &SidecarPaths,
        source: Option<&Path>,
    ) -> Result<(), OpError> {
        let refuse = |why: String| Err(OpError::PathRefused(format!("output_path: {why}")));
        if let Some(link) = paths.symlinks().first() {
            return refuse(format!(
                "{} is a symbolic link: a run's files are written beside its output, never through a link",
                link.display()
            ));
        }
        paths.check_companion_types().map_err(RegistryError::from)?;
        match std::fs::symlink_metadata(&paths.output) {
            Ok(m) if m.is_dir() => {
                return refuse(format!("{} is a directory", paths.output.display()));
            }
            Ok(m) if !m.is_file() => {
                return refuse(format!(
                    "{} is not a regular file (a FIFO, socket or device)",
                    paths.output.display()
                ));
            }
            // Another name of the file may be another run's output: two runs would append to
            // one file.
            Ok(m) if std::os::unix::fs::MetadataExt::nlink(&m) > 1 => {
                return refuse(format!(
                    "{} has other names (hard links); a run's output has one",
                    paths.output.display()
                ));
            }
            _ => {}
        }
        if let Some(source) = source {
            if paths.output == source {
                return refuse("is the source dataset itself".into());
            }
            if let Some(companion) = paths.all().into_iter().find(|p| *p == source) {
                return refuse(format!(
                    "its companion {} is the source dataset: give the output or the dataset another name",
                    companion.display()
                ));
            }
        }
        let name = paths
            .output
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Names the service finds runs by (every start and reindex reads them as a manifest or
        // a replacement under way): an output so named would be reported unreadable forever.
        // A set-aside manifest (`*_manifest.json.replaced-<time>`) too: every reindex reads
        // those as replaced runs (hostile review 54, N3).
        if let Some(suffix) = ["_manifest.json", "_replace_intent.json"]
            .into_iter()
            .find(|suffix| name.ends_with(suffix))
            .or_else(|| {
                name.contains("_manifest.json.replaced-")
                    .then_some("_manifest.json.replaced-<time>")
            })
        {
            return refuse(format!(
                "is named as a run's {suffix} file, which the service reads as one: give the output another name"
            ));
        }
        self.check_companions(paths).await
    }

    /// Refuses an output whose files are another run's, or which is another run's file: checked
    /// when a create is prepared, and again under its directory's creation lock before anything
    /// is written (a create of another output sharing files may have been published meanwhile).
    async fn check_companions(&self, paths: &SidecarPaths) -> Result<(), OpError> {
        let refuse = |why: String| Err(OpError::PathRefused(format!("output_path: {why}")));
        let name = paths
            .output
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let directory = paths
            .output
            .parent()
            .map(Path::to_owned)
            .unwrap_or_default();
        self.refuse_companions_of_another_output(paths).await?;
        for suffix in recovery_sidecar::paths::COMPANION_SUFFIXES {
            let Some(stem) = name.strip_suffix(suffix).filter(|s| !s.is_empty()) else {
                continue;
            };
            if directory.join(format!("{stem}_manifest.json")).exists() {
                return refuse(format!("{name} is a companion file of the run at {stem}.*"));
            }
        }
        // Every companion, those never moved aside too (its lock file, its classification
        // policy: review 56, N2: `b_run.lock` created as an output first, then `b.jsonl`, made
        // two runs, one's lock file the other's output).
        for companion in paths.all().into_iter().filter(|p| *p != paths.output) {
            let recorded = self
                .store()
                .find_run_by_output(&companion.display().to_string())
                .await?;
            // A manifest beside it makes the companion a run's output only when that manifest
            // is found to be the companion's: `results.v2_resubmit_offset` has the stem
            // `results`, but `results_manifest.json` is the run of `results.jsonl` (hostile
            // review 53, F2: `results.v2.jsonl` beside `results.jsonl` was refused, untruly).
            let manifest = SidecarPaths::for_output(companion).manifest;
            let its_output =
                manifest.exists() && crate::registry::output_for_manifest(&manifest) == *companion;
            if its_output || recorded.is_some() {
                return refuse(format!(
                    "its companion {} is another run's output",
                    companion.display()
                ));
            }
        }
        Ok(())
    }

    /// Publishes a prepared run: refuses a run that exists (adopting it, so the id named
    /// resolves) unless replacing, moves a replaced run aside under names that never collide,
    /// publishes rows, outcome files, identity and manifest. On any error the previous state
    /// stands.
    pub async fn create(
        &self,
        run: &LockedRun,
        actor: &str,
        prepared: PreparedRun,
    ) -> Result<CreatedRun, OpError> {
        let paths = run.paths().clone();
        if prepared.replace {
            // A live lease on the run replaced means a collector is writing its output: the
            // replacement would leave that lease holding the new run's lock. Take it over (or
            // wait for it to end) first.
            let manifest = paths.manifest.clone();
            let old = blocking(move || {
                Ok(recovery_sidecar::read_regular(&manifest)
                    .ok()
                    .and_then(|bytes| RunManifest::run_id_of(&bytes)))
            })
            .await?;
            if let Some(old) = old {
                self.check_unleased(run, &old).await?;
                // Journal lines a collector wrote that no reindex read yet are read now: once
                // set aside, nothing reads the journals again (hostile review 52, F6).
                self.adopt_locked(run).await?;
            }
        }
        // Under the directory's creation lock: a create of an output sharing files with this
        // one (`q_failures.jsonl` beside `q.jsonl`) is either published and refuses this one
        // here, or waits for this one and is refused in turn (hostile review 55, F6).
        self.check_companions(&paths).await?;
        let seconds = self.clock().now().unix_timestamp();
        let (work_paths, rows) = (paths.clone(), prepared.materialized.clone());
        let replacing = prepared.replace.then(|| prepared.manifest.run_id.clone());
        let existing = blocking(move || {
            publish_files(&work_paths, rows.as_deref(), replacing.as_deref(), seconds)
        })
        .await?;
        let moved = match existing {
            Existing::Run => {
                // The companions' run may have been created for a sibling output sharing them
                // (`out.jsonl` beside `out.json`) after this create was checked: refused as
                // the check refuses it (hostile review 39: it was called unreadable).
                self.refuse_companions_of_another_output(&paths).await?;
                let Some(adopted) = self.adopt_locked(run).await? else {
                    // A manifest that names no run is unreadable, not a run to resume (hostile
                    // review 35: "run_exists" with no run).
                    return Err(RunFilesError::ManifestUnreadable(format!(
                        "{} is there but names no readable run: restore it, or replace it as an operator",
                        paths.manifest.display()
                    ))
                    .into());
                };
                return Err(OpError::RunExists {
                    message: format!(
                        "{} already has a manifest: resume it with validate, or replace it as an operator",
                        paths.output.display()
                    ),
                    run_id: Some(adopted.run_id),
                });
            }
            Existing::Fresh => Vec::new(),
            Existing::Replaced(moved) => moved,
        };
        let written = self
            .write_manifest(run, &prepared.manifest, Some(&prepared.identity.identity))
            .await;
        if let Err(e) = written {
            let published_rows = prepared.materialized.is_some() || !moved.is_empty();
            blocking(move || {
                unpublish(&paths, published_rows, &moved);
                Ok(())
            })
            .await?;
            return Err(e.into());
        }
        if !moved.is_empty() {
            // Published: the replacement stands (a crash before this is completed at start-up).
            let intent = paths.replace_intent.clone();
            blocking(move || {
                std::fs::remove_file(&intent)
                    .map_err(|e| io_failure("completing the replacement", e))
            })
            .await?;
        }
        let replaced: Vec<String> = moved
            .iter()
            .map(|(_, to)| to.display().to_string())
            .collect();
        if !replaced.is_empty() {
            self.audit(
                actor,
                "run.replace",
                Some(&prepared.manifest.run_id),
                serde_json::json!({"moved": replaced}),
            )
            .await?;
        }
        self.audit(
            actor,
            "run.created",
            Some(&prepared.manifest.run_id),
            serde_json::json!({"output_path": paths.output.display().to_string()}),
        )
        .await?;
        Ok(CreatedRun {
            manifest: prepared.manifest,
            identity: prepared.identity,
            replaced,
        })
    }

    /// Validates a resume and acts on the verdict: reuse, resume across operational drift (one
    /// journal line), an override with `allow_unsafe` (the manifest rewritten, sticky), or a
    /// refusal naming the semantic keys. The digest computed is reported into `digest` also
    /// when the resume is refused. Runs in the run's shared section (validations of one run
    /// side by side); a verdict that rewrites the manifest, or finds another run's manifest, is
    /// decided again in the exclusive section.
    pub async fn validate(
        &self,
        paths: &SidecarPaths,
        run_id: &str,
        request: ResumeRequest,
        policy: &DriftPolicy,
        record: &mut ResumeRecord,
    ) -> Result<Resumed, OpError> {
        let request = Arc::new(request);
        let shared = self.lock_shared(paths).await.map_err(RegistryError::from)?;
        let section = Section::Shared(&shared);
        if let Some(resumed) = self
            .validate_in(section, run_id, &request, policy, record)
            .await?
        {
            return Ok(resumed);
        }
        drop(shared);
        let run = self.lock(paths).await.map_err(RegistryError::from)?;
        self.validate_in(Section::Exclusive(&run), run_id, &request, policy, record)
            .await?
            .ok_or(OpError::Invariant(
                "a validation in the exclusive section asked for the exclusive section",
            ))
    }

    /// Keeps a resume's opt-in to retrying terminal timeouts in the manifest: a collection
    /// setting outside the identity (changing it is no drift), given on a resume and kept for
    /// every later one (facts §17, scenario 37; gap review 34: a resume's opt-in was ignored).
    /// Never taken back by a resume without it. Audited.
    async fn keep_timeout_opt_in(
        &self,
        run: &LockedRun,
        run_id: &str,
        actor: &str,
        manifest: &mut RunManifest,
    ) -> Result<(), OpError> {
        manifest.retry_terminal_timeouts = true;
        self.write_manifest(run, manifest, None).await?;
        self.audit(
            actor,
            "run.retry_terminal_timeouts",
            Some(run_id),
            serde_json::json!({"retry_terminal_timeouts": true}),
        )
        .await?;
        Ok(())
    }

    /// One validation in a section; `None` when the verdict needs the exclusive section.
    async fn validate_in(
        &self,
        section: Section<'_>,
        run_id: &str,
        request: &Arc<ResumeRequest>,
        policy: &DriftPolicy,
        record: &mut ResumeRecord,
    ) -> Result<Option<Resumed>, OpError> {
        let (paths, work) = (section.paths().clone(), request.clone());
        let caches = self.caches().clone();
        let work_policy = policy.clone();
        // Everything already derived and cached: deciding costs a few `stat`s, less than the
        // trip to a blocking thread.
        let decided = match decide_resume_cached(&caches, &paths, &work, policy) {
            Some(decided) => decided?,
            None => blocking(move || decide_resume(&caches, &paths, &work, &work_policy)).await?,
        };
        let Decided {
            saved,
            current_digest,
            verdict,
        } = decided;
        // A missing or unreadable manifest is the verdict's to answer (a legacy import
        // included); another run's manifest is never validated against.
        if let SavedManifest::Read(manifest) = &saved.manifest
            && manifest.run_id != run_id
        {
            let Section::Exclusive(run) = section else {
                return Ok(None);
            };
            self.check_not_superseded(run, run_id, manifest).await?;
        }
        record.config_digest = current_digest;
        let config_digest = record.config_digest.clone().unwrap_or_default();
        let resumed = |outcome, manifest: Option<Value>| Resumed {
            outcome,
            message: None,
            operational_keys: vec![],
            drift_event_id: None,
            reasons: vec![],
            semantic_keys: vec![],
            manifest,
        };
        // A resume that opts in to retrying terminal timeouts keeps the opt-in in the manifest
        // (written in the exclusive section).
        let actor = record
            .event
            .as_ref()
            .and_then(|event| event.client.clone())
            .unwrap_or_else(|| "system".to_owned());
        let asks_for_timeout_retries = opts_in_to_timeout_retries(request)?;
        let opting_in =
            |manifest: &RunManifest| !manifest.retry_terminal_timeouts && asks_for_timeout_retries;
        match verdict {
            ResumeVerdict::Reuse { mut manifest } => {
                if opting_in(&manifest) {
                    let Section::Exclusive(run) = section else {
                        return Ok(None);
                    };
                    self.keep_timeout_opt_in(run, run_id, &actor, &mut manifest)
                        .await?;
                }
                Ok(Some(resumed("reuse", Some(manifest.to_value()))))
            }
            ResumeVerdict::ResumeWithDrift {
                mut manifest,
                operational_keys,
            } => {
                if opting_in(&manifest) {
                    let Section::Exclusive(run) = section else {
                        return Ok(None);
                    };
                    self.keep_timeout_opt_in(run, run_id, &actor, &mut manifest)
                        .await?;
                }
                let (digest, keys, resume) = (&config_digest, &operational_keys, &mut record.event);
                let drift = match section {
                    Section::Shared(run) => {
                        self.record_drift_with(run, &manifest, digest, keys, resume)
                            .await?
                    }
                    Section::Exclusive(run) => {
                        self.record_drift_with(run, &manifest, digest, keys, resume)
                            .await?
                    }
                };
                tracing::warn!(run_id, keys = ?operational_keys, "resume across operational drift");
                Ok(Some(Resumed {
                    message: Some(drift_message(&operational_keys)),
                    operational_keys,
                    drift_event_id: Some(drift.event_id),
                    ..resumed("resume_with_drift", Some(manifest.to_value()))
                }))
            }
            ResumeVerdict::Refused {
                message,
                mismatches,
            } => Err(OpError::ResumeRefused {
                message,
                mismatches,
            }),
            ResumeVerdict::NoManifest { message } => Err(RunFilesError::NoManifest(message).into()),
            ResumeVerdict::Unreadable { message } => {
                Err(RunFilesError::ManifestUnreadable(message).into())
            }
            ResumeVerdict::Overridden {
                mut manifest,
                message,
                mismatches,
            } => {
                let Section::Exclusive(run) = section else {
                    return Ok(None);
                };
                if opting_in(&manifest) {
                    manifest.retry_terminal_timeouts = true;
                }
                self.write_manifest(run, &manifest, None).await?;
                tracing::warn!(
                    run_id,
                    "resume accepted with allow_unsafe: identity overridden"
                );
                Ok(Some(Resumed {
                    message: Some(message),
                    reasons: mismatches.iter().map(|m| m.code().to_owned()).collect(),
                    semantic_keys: Mismatch::semantic_keys(&mismatches),
                    ..resumed("overridden", Some(manifest.to_value()))
                }))
            }
            ResumeVerdict::ImportLegacy { message } => {
                let Section::Exclusive(run) = section else {
                    return Ok(None);
                };
                let mut manifest = self.import_legacy(run, run_id).await?;
                if opting_in(&manifest) {
                    self.keep_timeout_opt_in(run, run_id, &actor, &mut manifest)
                        .await?;
                }
                tracing::warn!(
                    run_id,
                    "saved outcomes without a manifest imported as legacy"
                );
                Ok(Some(Resumed {
                    message: Some(message),
                    ..resumed("import_legacy", Some(manifest.to_value()))
                }))
            }
        }
    }
}

impl Registry {
    /// `RunManifest.import_legacy`: saved outcomes without a manifest, resumed with
    /// `allow_unsafe`, get a legacy manifest (`legacy_import`, unverified digests, attempts
    /// numbered from the saved outcomes) after the checks of facts §11.6: the materialized
    /// inputs are there, and no saved outcome names a run (those lost their manifest; they are
    /// restored, never imported as legacy).
    async fn import_legacy(&self, run: &LockedRun, run_id: &str) -> Result<RunManifest, OpError> {
        self.import_legacy_as(run, run_id, "system").await
    }

    /// Imports the saved outcomes at an output that has no manifest as a legacy run (a NeMo
    /// Gym output from before manifests, or whose manifest is gone), for `actor`, who accepted
    /// that its identity cannot be verified: `RunManifest.import_legacy` over the files, its
    /// attempts renumbered from them (facts §11.6). Every later resume needs `allow_unsafe`.
    /// Refused when a manifest is there (`run_exists`) or nothing was saved (create the run).
    pub async fn import_legacy_output(
        &self,
        run: &LockedRun,
        actor: &str,
    ) -> Result<RunManifest, OpError> {
        let paths = run.paths().clone();
        let (has_manifest, saved, draft) = blocking(move || {
            Ok((
                std::fs::symlink_metadata(&paths.manifest).is_ok(),
                holds_an_outcome(&paths.output) || holds_an_outcome(&paths.failures),
                paths.draft_journal.exists(),
            ))
        })
        .await?;
        if has_manifest {
            // A manifest that names no run it could be validated as is unreadable, not a run
            // (hostile review 35: "run_exists" with no run to validate).
            let Some(record) = self.adopt_locked(run).await? else {
                return Err(RunFilesError::ManifestUnreadable(format!(
                    "{} is there but names no readable run: restore or remove it",
                    run.paths().manifest.display()
                ))
                .into());
            };
            return Err(OpError::RunExists {
                message: format!(
                    "{} has a manifest: validate its run instead",
                    run.paths().manifest.display()
                ),
                run_id: Some(record.run_id),
            });
        }
        // What a create refuses, an import refuses: an output that is another run's companion
        // (its lock file, its coverage snapshot, which the run rewrites), or whose companions
        // are another run's files (review 57, M4, M5: an import shared files with a run).
        self.check_output(run.paths(), None).await?;
        if draft {
            // The plan refuses a run beside a draft dispatch journal: nothing is imported that
            // could not be planned (hostile review 35).
            return Err(RunFilesError::Inconsistent(format!(
                "{} is a draft dispatch journal: the attempts it dispatched cannot be known; finish or remove it before importing",
                run.paths().draft_journal.display()
            ))
            .into());
        }
        if !saved {
            return Err(OpError::Invalid(format!(
                "output_path: {} holds no saved outcomes to import; create the run instead",
                run.paths().output.display()
            )));
        }
        self.import_legacy_as(run, &recovery_sidecar::new_id(), actor)
            .await
    }

    async fn import_legacy_as(
        &self,
        run: &LockedRun,
        run_id: &str,
        actor: &str,
    ) -> Result<RunManifest, OpError> {
        let (paths, id) = (run.paths().clone(), run_id.to_owned());
        let manifest = blocking(move || {
            let manifest = crate::plans::legacy_manifest(&paths, &id)?;
            // A run with a manifest has both outcome files (an older collector wrote no
            // failures sidecar): the missing one is created empty, never truncated.
            for file in [&paths.output, &paths.failures] {
                std::os::unix::fs::OpenOptionsExt::custom_flags(
                    std::fs::OpenOptions::new().create(true).append(true),
                    // A FIFO planted there is never waited on.
                    libc::O_NOFOLLOW | libc::O_NONBLOCK,
                )
                .open(file)
                .map_err(|e| io_failure("creating an empty outcome file", e))?;
            }
            Ok(manifest)
        })
        .await?;
        self.write_manifest(run, &manifest, None).await?;
        self.audit(
            actor,
            "run.import_legacy",
            Some(run_id),
            serde_json::json!({"next_attempt": manifest.next_attempt.len()}),
        )
        .await?;
        Ok(manifest)
    }
}

/// The predecessor line names the admission's rollout and attempt.
fn predecessor_names(admission: &Admission) -> Result<(), OpError> {
    let facts =
        recovery_core::facts::OutcomeFacts::from_line(admission.predecessor_line.as_bytes())
            .ok()
            .flatten()
            .ok_or_else(|| {
                OpError::Invalid("predecessor_line: not a saved outcome (a JSON object)".into())
            })?;
    let mut buffer = String::new();
    let named = facts.identity.logical_id(&mut buffer).ok() == Some(admission.rollout_id.as_str());
    let attempt = matches!(facts.attempt, recovery_core::facts::AttemptField::Valid(a) if u64::try_from(a).ok() == Some(admission.attempt));
    if named && attempt {
        Ok(())
    } else {
        Err(OpError::Invalid(format!(
            "predecessor_line: not an outcome of attempt {} of {}",
            admission.attempt, admission.rollout_id
        )))
    }
}

fn check_admission(admission: &Admission) -> Result<(), OpError> {
    if !ROLLOUT_ID.is_match(&admission.rollout_id) {
        return Err(OpError::Invalid(
            "rollout_id: must match ^[A-Za-z0-9][A-Za-z0-9._-]*$".into(),
        ));
    }
    if admission.predecessor_failure_id.is_empty() {
        return Err(OpError::Invalid(
            "predecessor_failure_id: must not be empty".into(),
        ));
    }
    if admission.predecessor_line.contains('\n') {
        return Err(OpError::Invalid(
            "predecessor_line: one saved line, without embedded newlines".into(),
        ));
    }
    Ok(())
}

fn rejudgment_of(
    run_id: &str,
    key: &str,
    pending: &PendingRejudge,
    admitted_at: Option<String>,
) -> Rejudgment {
    Rejudgment {
        operation_id: pending.operation_id.clone(),
        run_id: run_id.to_owned(),
        attempt_key: key.to_owned(),
        admitted_at: admitted_at.unwrap_or_else(|| unix_to_text(pending.admitted_at)),
        predecessor_failure_id: pending.predecessor_failure_id.clone(),
        predecessor_sha256: pending.predecessor_sha256.clone(),
        closed_at: None,
        outcome: None,
    }
}

/// The saved run as `validate_resume` reads it, derived state from the caches.
fn saved_run(caches: &RunCaches, paths: &SidecarPaths) -> (SavedRun, Option<Arc<RowReferences>>) {
    let materialized = caches.materialized.get(&paths.materialized, |path| {
        Ok::<_, String>(MaterializedFacts {
            digest: runfiles::digest_rows_file(path)?,
            references: Arc::new(runfiles::row_references(path)?),
        })
    });
    let identity = caches
        .identities
        .get(&paths.identity, |path| {
            recovery_sidecar::read_regular(path)
                .map(|bytes| serde_json::from_slice::<Value>(&bytes).ok().map(Arc::new))
        })
        .ok()
        .flatten();
    let saved = SavedRun {
        manifest_path: paths.manifest.display().to_string(),
        manifest: saved_manifest(caches, &paths.manifest),
        materialized: materialized
            .as_ref()
            .map(|m| m.digest.clone())
            .map_err(Clone::clone),
        identity: identity.map(|v| (*v).clone()),
    };
    (saved, materialized.ok().map(|m| m.references))
}

/// The run's manifest as read, from the cache while the file is the one read before.
fn saved_manifest(caches: &RunCaches, path: &std::path::Path) -> SavedManifest {
    let Ok(manifest) = caches.manifests.get(path, |path| {
        Ok::<_, std::convert::Infallible>(runfiles::read_manifest(path))
    });
    manifest
}

/// The saved run and the current one as `validate_resume` compares them. The current identity
/// of a request whose configuration, environment and rows a recent request sent too is taken
/// from the cache; the identity's earlier forms are computed only when the current form does
/// not name the saved digest.
fn current_run(
    caches: &RunCaches,
    paths: &SidecarPaths,
    request: &ResumeRequest,
) -> Result<(SavedRun, Option<CurrentRun>), OpError> {
    let (saved, saved_references) = saved_run(caches, paths);
    let (materialized_digest, references) = match &request.rows {
        Some(rows) => {
            let facts = caches
                .sent_rows
                .get_or_try(rows_key(rows), || raw_rows_facts(rows))?;
            (facts.digest.clone(), facts.references.clone())
        }
        None => (
            saved.materialized.clone().unwrap_or_default(),
            saved_references.unwrap_or_default(),
        ),
    };
    let identity = caches
        .current_identities
        .get_or_try(identity_key(request, &materialized_digest), || {
            current_identity(request, &references)
        })
        .and_then(|identity| {
            if current_form_suffices(&identity, &saved) {
                return Ok(identity);
            }
            let (config, global_config) = parsed_configuration(request)?;
            let mut identity = (*identity).clone();
            identity.add_earlier_forms(ConfigBundle {
                config: &config,
                global_config: &global_config,
                rows: &references,
                environment: &request.environment,
            })?;
            Ok(Arc::new(identity))
        });
    // Like the collector (facts §11.6): the current identity includes the source's digest; when
    // it cannot be computed (a configuration error, a source file that is gone) the error
    // propagates, unless `allow_unsafe`, which resumes over no current identity (overridden).
    let current = identity.and_then(|config| {
        Ok(CurrentRun {
            source_digest: caches.sources.get(&request.source, file_sha256)?,
            materialized_digest,
            config,
        })
    });
    let current = match current {
        Ok(current) => Some(current),
        Err(e @ (OpError::Identity(_) | OpError::SourceUnreadable(_))) => {
            if !request.allow_unsafe {
                return Err(e);
            }
            None
        }
        Err(other) => return Err(other),
    };
    Ok((saved, current))
}

/// A resume decided from a run's files (before anything is acted on).
#[derive(Debug)]
pub struct Decided {
    pub saved: SavedRun,
    /// The current configuration digest, when it could be computed.
    pub current_digest: Option<String>,
    pub verdict: ResumeVerdict,
}

/// When a journal last changed (now, when it is gone).
fn journal_changed_at(path: &Path) -> String {
    let modified = std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| std::time::SystemTime::now());
    let seconds = modified
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    unix_to_text(seconds)
}

/// An approval is never appended after an unterminated line: the append would end that line
/// (facts §11.1 `prepare_append`: a tail that is whole JSON gets its newline), and a line that
/// approved nothing would approve, with nobody's approval recorded (hostile review 43), or it
/// would remove it. The operator decides: end the line, or remove it. Nothing is written.
async fn refuse_unterminated_approval(paths: &SidecarPaths) -> Result<(), OpError> {
    let path = paths.rerun_masked.clone();
    let tail = blocking(move || {
        recovery_sidecar::unterminated_tail(&path).map_err(|source| {
            OpError::Files(RunFilesError::Io {
                context: format!("reading {}", path.display()),
                source,
            })
        })
    })
    .await?;
    // A blank tail is cut off by the append and can approve nothing (hostile review 46, N7:
    // it was refused with advice to end it "to make it an approval").
    if recovery_core::rows::is_blank(&tail) {
        return Ok(());
    }
    Err(OpError::Files(RunFilesError::Inconsistent(format!(
        "the approvals journal {} ends with an unterminated line ({} bytes) that approves nothing: \
         end it with a newline to make it an approval, or remove it, then approve again",
        paths.rerun_masked.display(),
        tail.len()
    ))))
}

/// Decides a resume from the run's files and the request (blocking): the load-time checks of
/// the run's files, then `validate_resume` over the saved run and the current one. The one
/// decision the service's validate and the offline `validate` command both make.
pub fn decide_resume(
    caches: &RunCaches,
    paths: &SidecarPaths,
    request: &ResumeRequest,
    policy: &DriftPolicy,
) -> Result<Decided, OpError> {
    runfiles::check_run_files(paths)?;
    let (saved, current) = current_run(caches, paths, request)?;
    Ok(decided(saved, current, request, policy))
}

fn decided(
    saved: SavedRun,
    current: Option<CurrentRun>,
    request: &ResumeRequest,
    policy: &DriftPolicy,
) -> Decided {
    let verdict = validate_resume(&saved, current.as_ref(), request.allow_unsafe, policy);
    Decided {
        current_digest: current.map(|c| c.config.config_digest.clone()),
        saved,
        verdict,
    }
}

/// [`decide_resume`] when everything it derives is cached (see [`current_run_cached`]).
fn decide_resume_cached(
    caches: &RunCaches,
    paths: &SidecarPaths,
    request: &ResumeRequest,
    policy: &DriftPolicy,
) -> Option<Result<Decided, OpError>> {
    Some(
        current_run_cached(caches, paths, request)?
            .map(|(saved, current)| decided(saved, current, request, policy)),
    )
}

/// Manifests up to this size are read on the async worker by [`current_run_cached`].
const INLINE_MANIFEST_BYTES: u64 = 64 * 1024;

/// [`current_run`] when everything it derives is cached (the source's digest, the saved rows'
/// facts and identity, the request's current identity), no rows are sent, the manifest is
/// small and the current form alone decides: a few `stat`s, the load-time checks of the run's
/// files and one small read. `None` when something would have to be derived, found by `stat`s
/// alone. (Computing a small identity here instead of on a blocking thread was measured slower
/// under the drift load: 4,500-5,400 against 5,200-5,900 events/s.)
fn current_run_cached(
    caches: &RunCaches,
    paths: &SidecarPaths,
    request: &ResumeRequest,
) -> Option<Result<(SavedRun, Option<CurrentRun>), OpError>> {
    if request.rows.is_some()
        || std::fs::metadata(&paths.manifest).ok()?.len() > INLINE_MANIFEST_BYTES
    {
        return None;
    }
    let materialized = caches.materialized.peek(&paths.materialized)?;
    caches.identities.peek(&paths.identity)?;
    let source_digest = caches.sources.peek(&request.source)?;
    let identity = caches
        .current_identities
        .peek(&identity_key(request, &materialized.digest))?;
    // Only `stat`s so far (a miss costs no more); the load-time checks come before any read.
    if let Err(e) = runfiles::check_run_files(paths) {
        return Some(Err(e.into()));
    }
    let (saved, _) = saved_run(caches, paths);
    current_form_suffices(&identity, &saved).then(|| {
        Ok((
            saved,
            Some(CurrentRun {
                source_digest,
                materialized_digest: materialized.digest,
                config: identity,
            }),
        ))
    })
}

/// The request's current identity (its current form only), over the rows' server references.
fn current_identity(
    request: &ResumeRequest,
    references: &RowReferences,
) -> Result<ConfigurationIdentity, OpError> {
    let (config, global_config) = parsed_configuration(request)?;
    Ok(ConfigurationIdentity::compute_current(ConfigBundle {
        config: &config,
        global_config: &global_config,
        rows: references,
        environment: &request.environment,
    })?)
}

/// Whether the current form alone decides the resume: it names the saved digest, or it drifts
/// from a verified saved identity only in keys no earlier form changes (so no earlier form can
/// name the saved digest, and they need not be computed: a resume across drift costs one
/// identity, not every form).
fn current_form_suffices(identity: &ConfigurationIdentity, saved: &SavedRun) -> bool {
    let SavedManifest::Read(manifest) = &saved.manifest else {
        return false;
    };
    manifest.config_digest == identity.config_digest
        || saved.identity.as_ref().is_some_and(|saved_identity| {
            !identity.earlier_form_could_be(saved_identity, &manifest.config_digest)
        })
}

/// The request's configuration texts as JSON values.
fn parsed_configuration(request: &ResumeRequest) -> Result<(Value, Value), OpError> {
    Ok((
        parsed_configuration_field("config", &request.config)?,
        parsed_configuration_field("global_config", &request.global_config)?,
    ))
}

/// One of the request's configuration texts as a JSON value, read by the core's reader:
/// nesting up to the 512 levels a digest takes, counted from the request body the texts are
/// fields of, as create reads them.
fn parsed_configuration_field(
    field: &str,
    raw: &serde_json::value::RawValue,
) -> Result<Value, OpError> {
    let text = raw.get().as_bytes();
    recovery_core::canonical::check_depth_within(text, ResumeRequest::LEVELS_ABOVE)
        .and_then(|()| recovery_core::canonical::parse_json(text))
        .map_err(|e| {
            // A number with no canonical form is named by its key, as a create names it
            // (hostile review 54: validate said `config: ... (byte 56)`). Only this refusal
            // parses the text a second time.
            let named = serde_json::from_slice::<Value>(text)
                .ok()
                .and_then(|value| refuse_numbers_without_canonical_form(field, &value).err());
            named.unwrap_or_else(|| OpError::Invalid(format!("{field}: {e}")))
        })
}

/// Length-prefixed parts, hashed: no two different sequences of parts share a key. BLAKE3, as
/// collision resistant as SHA-256 (a sender cannot make other rows pass for cached ones) and
/// about three times as fast: a validate with 1,000 rows inline hashes ~100 KB for its key.
/// Keys live only in memory; every digest that is saved or compared with Python stays SHA-256.
fn key_of<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new();
    for part in parts {
        hasher.update(&(part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    hasher.finalize().into()
}

/// What a current identity is computed from: the configuration texts, the environment sent and
/// the rows (named by their materialized digest, which their server references derive from).
fn identity_key(request: &ResumeRequest, materialized_digest: &str) -> [u8; 32] {
    let environment = request
        .environment
        .iter()
        .flat_map(|(k, v)| [k.as_bytes(), v.as_bytes()]);
    key_of(
        [
            request.config.get().as_bytes(),
            request.global_config.get().as_bytes(),
            materialized_digest.as_bytes(),
            &(request.environment.len() as u64).to_le_bytes()[..],
        ]
        .into_iter()
        .chain(environment),
    )
}

/// The rows' text, as a key.
fn rows_key(rows: &serde_json::value::RawValue) -> [u8; 32] {
    key_of([rows.get().as_bytes()])
}

/// The materialized digest and server references of rows sent as raw JSON texts: each row one
/// JSONL line (whitespace newlines inside a row's text are blanks between tokens, since a JSON
/// string cannot hold a raw newline), digested from its text as the file would be.
fn raw_rows_facts(rows: &serde_json::value::RawValue) -> Result<MaterializedFacts, OpError> {
    recovery_core::canonical::check_depth_within(
        rows.get().as_bytes(),
        ResumeRequest::LEVELS_ABOVE,
    )
    .map_err(|e| OpError::Invalid(format!("rows: {e}")))?;
    let mut deserializer = serde_json::Deserializer::from_str(rows.get());
    deserializer.disable_recursion_limit();
    let rows: Vec<&serde_json::value::RawValue> =
        serde::Deserialize::deserialize(&mut deserializer).map_err(|e| {
            // A data error would repeat what `rows` holds instead (`string "..."`).
            OpError::Invalid(if e.is_data() {
                "rows: must be an array of objects".to_owned()
            } else {
                format!("rows: must be an array of objects: {e}")
            })
        })?;
    let mut text = Vec::with_capacity(rows.iter().map(|r| r.get().len() + 1).sum());
    let mut references = RowReferences::default();
    for (i, row) in rows.iter().enumerate() {
        let raw = row.get().as_bytes();
        if raw.first() != Some(&b'{') {
            return Err(OpError::Invalid(format!(
                "rows[{i}]: must be a JSON object"
            )));
        }
        references
            .add_raw_row(raw)
            .map_err(|e| OpError::Invalid(format!("rows[{i}]: {e}")))?;
        text.extend(
            raw.iter()
                .map(|&b| if b == b'\n' || b == b'\r' { b' ' } else { b }),
        );
        text.push(b'\n');
    }
    let digest = recovery_core::materialized::materialized_digest(text.as_slice(), 1)
        .map_err(|e| {
            row_digest_error(e, |i| {
                rows.get(i)
                    .and_then(|row| serde_json::from_str(row.get()).ok())
            })
        })?
        .sha256;
    Ok(MaterializedFacts {
        digest,
        references: Arc::new(references),
    })
}

/// A digest refusal of rows laid out one per line, naming the row (line n is `rows[n - 1]`),
/// and the key when the row holds a number no digest can be taken of (`rows[0].question: ...`,
/// as a configuration's is named; hostile review 55, F4: the row's name and a byte offset into
/// its re-serialisation). `row(i)` gives row `i` read as a value (only this refusal reads it).
fn row_digest_error(
    error: recovery_core::materialized::MaterializedError,
    row: impl Fn(usize) -> Option<Value>,
) -> OpError {
    use recovery_core::materialized::MaterializedError;
    match error {
        MaterializedError::Line { line, source } => {
            let i = line.saturating_sub(1);
            let field = format!("rows[{i}]");
            let named = usize::try_from(i).ok().and_then(&row).and_then(|value| {
                recovery_core::canonical::refuse_number_without_canonical_form(&field, &value)
            });
            match named {
                Some(refusal) => OpError::Invalid(refusal.message),
                None => OpError::Invalid(format!("{field}: {source}")),
            }
        }
        other => OpError::Invalid(format!("rows: {other}")),
    }
}

/// The companions a replacement moves aside (never deletes).
fn movable(paths: &SidecarPaths) -> [&PathBuf; 12] {
    [
        &paths.output,
        &paths.failures,
        &paths.materialized,
        &paths.manifest,
        &paths.identity,
        &paths.resume_drift,
        &paths.coverage,
        &paths.attempt_extension,
        &paths.rerun_masked,
        &paths.resubmit_offset,
        &paths.resubmit_results_offset,
        &paths.aggregate_metrics,
    ]
}

/// A replacement under way, written before anything moves (`<stem>_replace_intent.json`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ReplaceIntent {
    /// The output replaced.
    pub output: PathBuf,
    /// The run that will own the output once its manifest is published.
    pub new_run_id: String,
    /// Companions moved aside: (from, to).
    pub moves: Vec<(PathBuf, PathBuf)>,
}

/// Refuses a reservation for rollouts the plan does not run: a scored or model-final answer is
/// never sampled again, a masked answer only once an operator approved it, and a rollout whose
/// failures used up its attempts only after an extension. The refusal names every such rollout
/// with its state (the first 100), and nothing is reserved.
fn refuse_unrunnable(entries: &[PlanEntry]) -> Result<(), OpError> {
    let unrunnable: Vec<&PlanEntry> = entries
        .iter()
        .filter(|entry| entry.next_attempt.is_none())
        .collect();
    let Some(first) = unrunnable.first() else {
        return Ok(());
    };
    let listed: Vec<Value> = unrunnable
        .iter()
        .take(100)
        .map(|entry| {
            serde_json::json!({
                "rollout_id": entry.rollout_id,
                "state": entry.state,
                "reason": entry.reason,
            })
        })
        .collect();
    Err(OpError::NotEligible {
        message: format!(
            "rollout_ids: {} of the rollouts are not run again by this run's plan (the first, \
             {:?}: {}; details list up to 100); reserve only what GET /runs/{{id}}/plan lists \
             with a next_attempt",
            unrunnable.len(),
            first.rollout_id,
            first.reason
        ),
        details: serde_json::json!({
            "field": "rollout_ids",
            "not_runnable": listed,
            // The list stops at 100; the count is every one.
            "not_runnable_count": unrunnable.len(),
        }),
    })
}

/// Moves every existing companion aside under one suffix that no existing file carries
/// (`.replaced-<unix seconds>`, then `-2`, `-3`, ...), so a saved result is never overwritten.
/// The plan is journalled first ([`ReplaceIntent`]) so a crash midway is undone at the next
/// start. Returns the (from, to) pairs moved; on error, what was moved is moved back.
fn move_aside(
    paths: &SidecarPaths,
    seconds: i64,
    new_run_id: &str,
) -> std::io::Result<Vec<(PathBuf, PathBuf)>> {
    let target = |path: &Path, suffix: &str| PathBuf::from(format!("{}{suffix}", path.display()));
    let suffix = (1..)
        .map(|n| match n {
            1 => format!(".replaced-{seconds}"),
            n => format!(".replaced-{seconds}-{n}"),
        })
        .find(|suffix| {
            movable(paths)
                .iter()
                .all(|p| std::fs::symlink_metadata(target(p, suffix)).is_err())
        })
        .unwrap_or_default();
    let planned: Vec<(PathBuf, PathBuf)> = movable(paths)
        .into_iter()
        .filter(|p| p.exists())
        .map(|p| (p.clone(), target(p, &suffix)))
        .collect();
    if planned.is_empty() {
        // Nothing to move (a replacement of an output that has no run yet): a plain create,
        // with no intent for the next start to find and report as an interrupted replacement.
        return Ok(Vec::new());
    }
    let intent = ReplaceIntent {
        output: paths.output.clone(),
        new_run_id: new_run_id.to_owned(),
        moves: planned.clone(),
    };
    let text = serde_json::to_vec(&intent).map_err(std::io::Error::other)?;
    recovery_sidecar::atomic_write(&paths.replace_intent, &text, None)?;
    let mut moved = Vec::new();
    for (from, to) in planned {
        if let Err(e) = std::fs::rename(&from, &to) {
            move_back(&moved);
            return Err(e);
        }
        moved.push((from, to));
    }
    Ok(moved)
}

/// Finishes or undoes a replacement a crash interrupted: when the new run's manifest was
/// published the replacement stands; otherwise everything it wrote is removed and the old run's
/// files are moved back. Either way the intent is removed. Returns whether it rolled back.
pub fn recover_replacement(paths: &SidecarPaths) -> std::io::Result<Option<bool>> {
    let intent: ReplaceIntent = match recovery_sidecar::read_regular(&paths.replace_intent) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(std::io::Error::other)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let published = recovery_sidecar::read_regular(&paths.manifest)
        .ok()
        .and_then(|bytes| RunManifest::from_json_bytes(&bytes).ok())
        .is_some_and(|m| m.run_id == intent.new_run_id);
    if !published {
        // Nothing acknowledged the new run: what it wrote goes, the old run comes back. The new
        // run writes only once every move is done; before that, only moved files come back.
        if intent.moves.iter().all(|(_, to)| to.exists()) {
            for path in movable(paths) {
                let _ = std::fs::remove_file(path);
            }
        }
        move_back(&intent.moves);
    }
    std::fs::remove_file(&paths.replace_intent)?;
    Ok(Some(!published))
}

/// Renames a stale derived file to the first free `<name>.stale-<unix seconds>[-N]`.
fn set_aside(path: &Path, seconds: i64) -> std::io::Result<()> {
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    let free = (1..)
        .map(|n| match n {
            1 => PathBuf::from(format!("{}.stale-{seconds}", path.display())),
            n => PathBuf::from(format!("{}.stale-{seconds}-{n}", path.display())),
        })
        .find(|to| std::fs::symlink_metadata(to).is_err())
        .unwrap_or_default();
    std::fs::rename(path, free)
}

/// Undoes [`move_aside`] (best effort: every move that can be undone is).
fn move_back(moved: &[(PathBuf, PathBuf)]) {
    for (from, to) in moved.iter().rev() {
        if to.exists() {
            let _ = std::fs::remove_file(from);
            let _ = std::fs::rename(to, from);
        }
    }
}

fn non_empty(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.len() > 0)
}

/// Refuses inventories the planner would refuse later (duplicate or malformed logical ids,
/// indices that are not integers), naming the row, and an empty one: a run with nothing to
/// collect is complete at once, so a collector that materialized nothing by mistake would be
/// told its evaluation finished.
fn check_inventory<'a>(rows: impl IntoIterator<Item = &'a Value>) -> Result<(), OpError> {
    use recovery_core::rows::{ROLLOUT_INDEX_KEY, TASK_INDEX_KEY};
    let mut rows = rows.into_iter().peekable();
    if rows.peek().is_none() {
        return Err(OpError::Invalid(
            "rows: no rows: a run needs at least one materialized row to collect (an empty \
             run would be complete at once)"
                .to_owned(),
        ));
    }
    let mut seen = HashMap::new();
    for (i, row) in rows.enumerate() {
        if !row.is_object() {
            return Err(OpError::Invalid(format!(
                "rows[{i}]: must be a JSON object"
            )));
        }
        for key in [TASK_INDEX_KEY, ROLLOUT_INDEX_KEY] {
            if row
                .get(key)
                .is_some_and(|v| recovery_core::rows::index(Some(v)).is_none())
            {
                return Err(OpError::Invalid(format!(
                    "rows[{i}].{key}: must be an integer (of 64 bits)"
                )));
            }
        }
        let id = recovery_core::rows::logical_rollout_id(row)
            .map_err(|e| OpError::Invalid(format!("rows[{i}]: {e}")))?;
        if let Some(first) = seen.insert(id.clone(), i) {
            return Err(OpError::Invalid(format!(
                "rows[{i}]: Duplicate logical rollout id '{id}' (rows[{first}] has it too)"
            )));
        }
    }
    Ok(())
}

/// The rows to publish, their digest and their server references, checked as the planner will.
fn prepare_rows(
    rows: Option<&Vec<Value>>,
    paths: &SidecarPaths,
) -> Result<(Option<Vec<u8>>, String, RowReferences), OpError> {
    let rows_invalid = |e: String| OpError::Files(RunFilesError::RowsInvalid(e));
    if let Some(rows) = rows {
        check_inventory(rows)?;
        let mut text = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            text.extend(
                serde_json::to_vec(row).map_err(|e| OpError::Invalid(format!("rows[{i}]: {e}")))?,
            );
            text.push(b'\n');
        }
        let digest = recovery_core::materialized::materialized_digest(text.as_slice(), 1)
            .map_err(|e| row_digest_error(e, |i| rows.get(i).cloned()))?
            .sha256;
        return Ok((Some(text), digest, RowReferences::from_rows(rows)));
    }
    if !paths.materialized.is_file() {
        return Err(OpError::Invalid(format!(
            "rows: send the materialized rows, or write {} first",
            paths.materialized.display()
        )));
    }
    let name = paths.materialized.display().to_string();
    let file = recovery_sidecar::open_regular(&paths.materialized)
        .map_err(|e| rows_invalid(format!("{name}: {e}")))?;
    let values = recovery_core::rows::read_materialized(file, &name)
        .map_err(|e| rows_invalid(e.to_string()))?;
    check_inventory(&values)?;
    let digest = runfiles::digest_rows_file(&paths.materialized).map_err(rows_invalid)?;
    Ok((None, digest, RowReferences::from_rows(&values)))
}

/// Refuses a configuration holding a number its digest cannot be taken of (`1e999`, which
/// Python reads as infinity), naming the key: `config.a.b[2]: ...` (hostile review 53, F1: the
/// digest's refusal said `identity_error ... (byte 0)`, naming nothing).
fn refuse_numbers_without_canonical_form(field: &str, value: &Value) -> Result<(), OpError> {
    match recovery_core::canonical::refuse_number_without_canonical_form(field, value) {
        Some(refusal) => Err(OpError::Invalid(refusal.message)),
        None => Ok(()),
    }
}

fn prepare(
    request: &NewRun,
    paths: &SidecarPaths,
    default_cap: u64,
) -> Result<PreparedRun, OpError> {
    if request.max_rollout_attempts == Some(0) {
        return Err(OpError::Invalid(
            "max_rollout_attempts: must be at least 1".into(),
        ));
    }
    let (materialized, digest, references) = prepare_rows(request.rows.as_ref(), paths)?;
    for (field, value) in [
        ("config", &request.config),
        ("global_config", &request.global_config),
    ] {
        refuse_numbers_without_canonical_form(field, value)?;
    }
    let identity = ConfigurationIdentity::compute(ConfigBundle {
        config: &request.config,
        global_config: &request.global_config,
        rows: &references,
        environment: &request.environment,
    })?;
    let mut manifest = RunManifest::create(
        recovery_sidecar::new_id(),
        file_sha256(&request.source)?,
        digest,
        identity.config_digest.clone(),
        Some(request.max_rollout_attempts.unwrap_or(default_cap)),
    );
    let opt_in = resolved_collection_setting(
        &ConfigBundle {
            config: &request.config,
            global_config: &request.global_config,
            rows: &references,
            environment: &request.environment,
        },
        "retry_terminal_timeouts",
    )?;
    manifest.retry_terminal_timeouts = request.retry_terminal_timeouts
        || timeout_retries_opt_in(opt_in.as_ref()).map_err(OpError::Invalid)?;
    Ok(PreparedRun {
        manifest,
        identity,
        materialized,
        replace: request.replace,
    })
}

/// What the locked part of a create found on disk.
enum Existing {
    /// Nothing to keep: started fresh.
    Fresh,
    /// A run is there and no replacement was asked for: nothing written.
    Run,
    /// Moved aside for a replacement: (from, to).
    Replaced(Vec<(PathBuf, PathBuf)>),
}

/// Under the run's lock: refuse a run that exists (unless replacing), move a replaced run aside,
/// publish the materialized rows and fresh outcome files. Undone on error.
fn publish_files(
    paths: &SidecarPaths,
    rows: Option<&[u8]>,
    replace: Option<&str>,
    seconds: i64,
) -> Result<Existing, OpError> {
    let new_run_id = replace;
    let replace = new_run_id.is_some();
    let exists = paths.manifest.exists();
    if exists && !replace {
        return Ok(Existing::Run);
    }
    if !exists && !replace && (non_empty(&paths.output) || non_empty(&paths.failures)) {
        return Err(OpError::RunExists {
            message: format!(
                "{} holds saved outcomes without a manifest (a legacy cache): it is never started fresh silently; import it as a legacy run with POST /runs/import_legacy and allow_unsafe (its saved outcomes kept, its identity unverified), or, as an operator, start it afresh with replace: true (the saved outcomes are moved aside, never deleted)",
                paths.output.display()
            ),
            run_id: None,
        });
    }
    let moved = match new_run_id {
        Some(id) => {
            move_aside(paths, seconds, id).map_err(|e| io_failure("moving the old run aside", e))?
        }
        None => Vec::new(),
    };
    let publish = || -> std::io::Result<()> {
        if let Some(parent) = paths.output.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let kept = moved.iter().find(|(from, _)| *from == paths.materialized);
        let rows = match (rows, kept) {
            (Some(text), _) => Some(text.to_vec()),
            // The replaced run's rows stay the new run's inputs.
            (None, Some((_, aside))) => Some(recovery_sidecar::read_regular(aside)?),
            (None, None) => None,
        };
        if let Some(rows) = rows {
            recovery_sidecar::atomic_write(&paths.materialized, &rows, None)?;
        }
        // A fresh start: stale derived files are set aside (never deleted), empty outcome
        // files are created.
        for stale in [
            &paths.draft_journal,
            &paths.coverage,
            &paths.aggregate_metrics,
        ] {
            set_aside(stale, seconds)?;
        }
        for outcome in [&paths.output, &paths.failures] {
            std::os::unix::fs::OpenOptionsExt::custom_flags(
                std::fs::OpenOptions::new().create(true).append(true),
                // A FIFO swapped in since the checks is never waited on.
                libc::O_NOFOLLOW | libc::O_NONBLOCK,
            )
            .open(outcome)?;
        }
        Ok(())
    };
    match publish() {
        Ok(()) if moved.is_empty() => Ok(Existing::Fresh),
        Ok(()) => Ok(Existing::Replaced(moved)),
        Err(e) => {
            move_back(&moved);
            let _ = std::fs::remove_file(&paths.replace_intent);
            Err(io_failure("publishing the run's files", e))
        }
    }
}

/// Removes what a create published and moves a replaced run back (the previous state stands).
fn unpublish(paths: &SidecarPaths, published_rows: bool, moved: &[(PathBuf, PathBuf)]) {
    for path in [&paths.manifest, &paths.identity] {
        let _ = std::fs::remove_file(path);
    }
    if published_rows {
        let _ = std::fs::remove_file(&paths.materialized);
    }
    move_back(moved);
    let _ = std::fs::remove_file(&paths.replace_intent);
}

/// Whether a resume's collection settings opt in to retrying terminal timeouts: the setting
/// resolved as the collector's configuration resolves it (`${oc.env:...}` included), then read
/// as [`timeout_retries_opt_in`] reads it (a value that is no boolean is refused). Read only
/// when the text names the setting (the fast path of a validate never parses its
/// configuration), and the server tree only when the setting interpolates (configuration dumps
/// name it, mostly as a plain `false`).
fn opts_in_to_timeout_retries(request: &ResumeRequest) -> Result<bool, OpError> {
    const SETTING: &str = "retry_terminal_timeouts";
    if !request.config.get().contains(SETTING) {
        return Ok(false);
    }
    let config = parsed_configuration_field("config", &request.config)?;
    let global_config = match config.get(SETTING) {
        Some(value) if holds_interpolation(value) => {
            parsed_configuration_field("global_config", &request.global_config)?
        }
        _ => Value::Null,
    };
    let setting = resolved_collection_setting(
        &ConfigBundle {
            config: &config,
            global_config: &global_config,
            rows: &RowReferences::default(),
            environment: &request.environment,
        },
        SETTING,
    )?;
    timeout_retries_opt_in(setting.as_ref()).map_err(OpError::Invalid)
}

/// Whether a JSONL file holds a line that `wanted` takes, given its bytes without the newline
/// and whether it ended with one (a final line without is torn, or its writer is still on
/// it); read a line at a time (a results file may be gigabytes). A missing file holds none.
fn holds_line(path: &Path, wanted: impl Fn(&[u8], bool) -> bool) -> std::io::Result<bool> {
    use std::io::BufRead as _;
    let file = match recovery_sidecar::open_regular(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        opened => opened?,
    };
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    let mut line = Vec::new();
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line)? == 0 {
            return Ok(false);
        }
        let (bytes, terminated) = match line.strip_suffix(b"\n") {
            Some(bytes) => (bytes, true),
            None => (line.as_slice(), false),
        };
        if wanted(bytes, terminated) {
            return Ok(true);
        }
    }
}

/// Whether an outcome file saved anything: a line that is not blank (as `str.strip()` reads
/// blank; hostile review 36: a file of blank lines was imported). An unreadable file is
/// refused later, by the import's own reading.
fn holds_an_outcome(path: &Path) -> bool {
    holds_line(path, |bytes, _| {
        !recovery_core::materialized::is_blank_line(bytes)
    })
    .unwrap_or(false)
}

/// A plan state's name as the API writes it (`judge_recoverable`).
fn state_name(state: PlanState) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The execution number a reservation of rollout `id` hands out: the manifest's `next_attempt`,
/// else the one after the latest attempt the run's files hold, else 0. Refused when the number
/// after it could not be kept (hostile review 45: 2^64 - 1 wrapped to -1 and wrote a manifest
/// this service then refused to read).
fn next_execution(manifest: &RunManifest, id: &str, entry: &PlanEntry) -> Result<i64, OpError> {
    let (attempt, from) = match manifest.next_attempt.get(id) {
        Some(next) => (
            i64::try_from(*next).ok(),
            format!("next_attempt.{id} is {next}"),
        ),
        None => match entry.latest_attempt {
            Some(latest) => (
                latest.checked_add(1),
                format!("its latest attempt is {latest}"),
            ),
            None => (Some(0), String::new()),
        },
    };
    attempt
        .filter(|attempt| (*attempt as u64) < recovery_core::manifest::MAX_NEXT_ATTEMPT)
        .ok_or_else(|| {
            RunFilesError::Inconsistent(format!(
                "rollout {id} has no execution number left: {from}, and the largest this \
                 service hands out is {}",
                recovery_core::manifest::MAX_NEXT_ATTEMPT - 1
            ))
            .into()
        })
}
