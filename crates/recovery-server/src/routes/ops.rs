//! Operator and collector actions on a run: masked-rerun approvals, attempt extensions,
//! resubmits, execution-number reservations and judge-only re-judgments.

use crate::config::{Caller, Role};
use crate::error::{ApiError, ApiErrorBody, ApiJson, ApiResult, ErrorCode};
use crate::routes::query::not_eligible;
use crate::routes::runs::audit;
use crate::runfiles;
use crate::state::AppState;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use recovery_core::manifest::PendingRejudge;
use recovery_core::plan::PlanState;
use recovery_runs::LockedRun;
use recovery_sidecar::SidecarPaths;
use recovery_store::{Approval, AttemptExtension, Rejudgment, Resubmit};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalRequest {
    pub task_index: i64,
    pub rollout_index: i64,
    /// The masked attempt approved (exactly this one).
    pub attempt_index: i64,
    pub reason: String,
}

/// Approve rerunning one masked result that kept an answer but has no grade (operator).
#[utoipa::path(post, path = "/runs/{run_id}/approvals", tag = "approvals", request_body = ApprovalRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = Object, description = "The approval"),
        (status = 409, description = "not_eligible with the attempt's state and reason", body = ApiErrorBody),
        (status = 403, description = "Only operators approve", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 422, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn approve(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
    ApiJson(request): ApiJson<ApprovalRequest>,
) -> ApiResult<(StatusCode, Json<Approval>)> {
    caller.require(Role::Operator)?;
    if request.reason.trim().is_empty() {
        return Err(ApiError::invalid("reason: say why this rerun is approved"));
    }
    let (_, run) = state.locked_run(&run_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let state = work;
            let cap = state.config.default_max_attempts;
            let work_paths = run.paths().clone();
            let (_, plan) = state
                .blocking(move || runfiles::build_plan(&work_paths, cap))
                .await?;
            let entry = plan
                .entries
                .iter()
                .find(|e| {
                    recovery_core::rows::index(e.task_index.as_ref()) == Some(request.task_index)
                        && recovery_core::rows::index(e.rollout_index.as_ref())
                            == Some(request.rollout_index)
                })
                .ok_or_else(|| {
                    ApiError::not_found(format!(
                        "run {run_id} has no rollout with task_index {} and rollout_index {}",
                        request.task_index, request.rollout_index
                    ))
                })?;
            let details = serde_json::json!({"state": entry.state, "reason": entry.reason, "latest_attempt": entry.latest_attempt});
            if entry.latest_attempt != Some(request.attempt_index) {
                return Err(not_eligible(
                    format!(
                        "attempt {} is not the rollout's latest attempt ({:?})",
                        request.attempt_index, entry.latest_attempt
                    ),
                    details,
                ));
            }
            if entry.state != PlanState::AwaitingApproval {
                return Err(not_eligible(
                    format!(
                        "only a masked result that kept an answer without a grade is eligible; this attempt is {:?}: {}",
                        entry.state, entry.reason
                    ),
                    details,
                ));
            }
            let approval = state
                .registry
                .record_approval(
                    &run,
                    &run_id,
                    &caller.name,
                    &request.reason,
                    (
                        request.task_index,
                        request.rollout_index,
                        request.attempt_index,
                    ),
                )
                .await?;
            audit(
                &state,
                &caller,
                "approval.create",
                Some(&run_id),
                serde_json::json!({"approval_id": approval.approval_id, "reason": request.reason}),
            )
            .await?;
            Ok((StatusCode::CREATED, Json(approval)))
        })
        .await
}

/// List a run's approvals (with their use and revocation).
#[utoipa::path(get, path = "/runs/{run_id}/approvals", tag = "approvals", params(("run_id" = String, Path, description = "Run id")),
    responses((status = 200, body = Vec<Object>), (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn list_approvals(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
) -> ApiResult<Json<Vec<Approval>>> {
    caller.require(Role::Viewer)?;
    state.run(&run_id).await?;
    Ok(Json(state.registry.store().list_approvals(&run_id).await?))
}

/// Revoke an approval before an attempt uses it (operator).
#[utoipa::path(delete, path = "/runs/{run_id}/approvals/{approval_id}", tag = "approvals",
    params(("run_id" = String, Path, description = "Run id"), ("approval_id" = String, Path, description = "Approval id")),
    responses((status = 204, description = "Revoked"), (status = 409, description = "Already used or revoked (conflict)", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 403, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn revoke_approval(
    State(state): State<AppState>,
    Path((run_id, approval_id)): Path<(String, String)>,
    caller: Caller,
) -> ApiResult<StatusCode> {
    caller.require(Role::Operator)?;
    let (_, run) = state.locked_run(&run_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let state = work;
            let approvals = state.registry.store().list_approvals(&run_id).await?;
            let approval = approvals
                .iter()
                .find(|a| a.approval_id == approval_id)
                .ok_or_else(|| {
                    ApiError::not_found(format!("run {run_id} has no approval {approval_id}"))
                })?;
            if approval.consumed_by_attempt.is_some() || approval.revoked_at.is_some() {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!("approval {approval_id} was already used or revoked"),
                ));
            }
            state.registry.revoke_approval(&run, &approval_id).await?;
            audit(
                &state,
                &caller,
                "approval.revoke",
                Some(&run_id),
                serde_json::json!({"approval_id": approval_id}),
            )
            .await?;
            Ok(StatusCode::NO_CONTENT)
        })
        .await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendRequest {
    /// Attempts added to every rollout's cap (1-100).
    pub extend_attempts: i64,
    pub reason: String,
}

/// Add attempts to every rollout's cap (operator, `--extend-attempts`).
#[utoipa::path(post, path = "/runs/{run_id}/attempts/extend", tag = "attempts", request_body = ExtendRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = Object), (status = 422, body = ApiErrorBody), (status = 404, body = ApiErrorBody), (status = 403, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn extend(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
    ApiJson(request): ApiJson<ExtendRequest>,
) -> ApiResult<(StatusCode, Json<AttemptExtension>)> {
    caller.require(Role::Operator)?;
    if !(1..=100).contains(&request.extend_attempts) {
        return Err(ApiError::invalid(
            "extend_attempts: must be between 1 and 100",
        ));
    }
    if request.reason.trim().is_empty() {
        return Err(ApiError::invalid("reason: say why attempts are added"));
    }
    let (_, run) = state.locked_run(&run_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let state = work;
            let extension = state
                .registry
                .record_extension(
                    &run,
                    &run_id,
                    &caller.name,
                    &request.reason,
                    request.extend_attempts,
                )
                .await?;
            audit(
                &state,
                &caller,
                "attempts.extend",
                Some(&run_id),
                serde_json::json!({"extend_attempts": request.extend_attempts, "reason": request.reason}),
            )
            .await?;
            Ok((StatusCode::CREATED, Json(extension)))
        })
        .await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResubmitRequest {
    pub reason: String,
}

/// Reset the failure budget: earlier failures no longer count (operator; no live lease).
#[utoipa::path(post, path = "/runs/{run_id}/attempts/resubmit", tag = "attempts", request_body = ResubmitRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = Object), (status = 423, description = "The run is leased or locked", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 403, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn resubmit(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
    ApiJson(request): ApiJson<ResubmitRequest>,
) -> ApiResult<(StatusCode, Json<Resubmit>)> {
    caller.require(Role::Operator)?;
    let (_, run) = state.locked_run(&run_id).await?;
    // No live lease may be writing failures while the history is repaired and counted.
    state.check_lease(&run_id, None).await?;
    let work = state.clone();
    state
        .detached(async move {
            let state = work;
            let resubmit = state
                .registry
                .record_resubmit(&run, &run_id, &caller.name)
                .await?;
            audit(
                &state,
                &caller,
                "attempts.resubmit",
                Some(&run_id),
                serde_json::json!({"line_offset": resubmit.line_offset, "reason": request.reason}),
            )
            .await?;
            Ok((StatusCode::CREATED, Json(resubmit)))
        })
        .await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReserveRequest {
    pub lease_id: String,
    /// Logical rollout ids to reserve the next execution number for.
    pub rollout_ids: Vec<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ReserveResponse {
    /// Rollout id -> reserved execution number.
    pub attempts: BTreeMap<String, i64>,
}

/// The run locked for a change by the holder of `lease_id` (checked inside the section, so the
/// lease cannot end between the check and the change).
async fn leased_run(state: &AppState, run_id: &str, lease_id: &str) -> ApiResult<LockedRun> {
    let (_, run) = state.locked_run(run_id).await?;
    let now = state.registry.clock().now_text();
    let live = state
        .registry
        .store()
        .get_lease(run_id)
        .await?
        .is_some_and(|l| l.lease_id == lease_id && l.expires_at > now);
    if !live {
        return Err(ApiError::new(
            ErrorCode::LeaseNotHeld,
            format!("lease {lease_id} does not hold run {run_id}"),
        ));
    }
    Ok(run)
}

/// Durably reserve execution numbers before dispatch (lease holder).
#[utoipa::path(post, path = "/runs/{run_id}/attempts/reserve", tag = "attempts", request_body = ReserveRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 200, body = ReserveResponse), (status = 409, description = "lease_not_held", body = ApiErrorBody),
        (status = 422, body = ApiErrorBody), (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn reserve(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
    ApiJson(request): ApiJson<ReserveRequest>,
) -> ApiResult<Json<ReserveResponse>> {
    caller.require(Role::Collector)?;
    let mut seen = std::collections::BTreeSet::new();
    for id in &request.rollout_ids {
        if !seen.insert(id) {
            return Err(ApiError::invalid(format!(
                "rollout_ids: {id} is listed twice"
            )));
        }
    }
    let run = leased_run(&state, &run_id, &request.lease_id).await?;
    let work = state.clone();
    state
        .detached(async move { reserve_locked(&work, &run, &run_id, &request.rollout_ids).await })
        .await
        .map(Json)
}

/// Reserves the next execution number of each rollout inside the run's critical section: read,
/// decide, publish the manifest, then mark used approvals. Nothing is written unless every id is
/// valid, so a refused reserve changes nothing.
async fn reserve_locked(
    state: &AppState,
    run: &LockedRun,
    run_id: &str,
    rollout_ids: &[String],
) -> ApiResult<ReserveResponse> {
    let cap = state.config.default_max_attempts;
    let work_paths = run.paths().clone();
    let (mut manifest, plan) = state
        .blocking(move || runfiles::build_plan(&work_paths, cap))
        .await?;
    let entries: std::collections::HashMap<&str, &recovery_core::plan::PlanEntry> = plan
        .entries
        .iter()
        .map(|e| (e.rollout_id.as_str(), e))
        .collect();
    let mut attempts = BTreeMap::new();
    for id in rollout_ids {
        let entry = entries.get(id.as_str()).ok_or_else(|| {
            ApiError::invalid(format!(
                "rollout_ids: {id} is not in this run's materialized inputs"
            ))
        })?;
        let attempt = manifest
            .next_attempt
            .get(id)
            .map_or_else(|| entry.latest_attempt.map_or(0, |l| l + 1), |n| *n as i64);
        manifest
            .next_attempt
            .insert(id.clone(), (attempt + 1) as u64);
        attempts.insert(id.clone(), attempt);
    }
    state.registry.write_manifest(run, &manifest, None).await?;
    // An approved masked rerun is used by the attempt reserved for it.
    let approvals = state.registry.store().list_approvals(run_id).await?;
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
            state
                .registry
                .store()
                .consume_approval(&approval.approval_id, *attempt)
                .await?;
        }
    }
    Ok(ReserveResponse { attempts })
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdmitRejudgeRequest {
    pub lease_id: String,
    pub rollout_id: String,
    pub attempt: u64,
    pub predecessor_failure_id: String,
    /// The predecessor failure line exactly as saved (its SHA-256 is recorded).
    pub predecessor_line: String,
}

/// The run's manifest, which must be readable to be changed.
async fn readable_manifest(
    state: &AppState,
    paths: &SidecarPaths,
) -> ApiResult<recovery_core::manifest::RunManifest> {
    let work_paths = paths.clone();
    match state
        .blocking(move || Ok(runfiles::read_manifest(&work_paths.manifest)))
        .await?
    {
        recovery_core::verdict::SavedManifest::Read(manifest) => Ok(*manifest),
        _ => Err(ApiError::new(
            ErrorCode::ManifestUnreadable,
            format!("{} cannot be read", paths.manifest.display()),
        )),
    }
}

/// The logical rollout id grammar (facts §1: `_ng_rollout_id`), which attempt keys build on.
static ROLLOUT_ID: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
    regex::Regex::new("^[A-Za-z0-9][A-Za-z0-9._-]*$").expect("static regex")
});

/// Whether the failures sidecar holds a complete line with this SHA-256.
fn failures_hold_line(failures: &std::path::Path, sha256: &str) -> ApiResult<bool> {
    let lines = recovery_sidecar::read_lines(failures)
        .map_err(|e| ApiError::internal("reading the failures sidecar", e))?;
    Ok(lines
        .iter()
        .any(|line| recovery_core::canonical::sha256_hex(line) == sha256))
}

/// Admit a judge-only re-judgment before its judge call (lease holder). Admitting the same
/// predecessor again answers the open re-judgment (200).
#[utoipa::path(post, path = "/runs/{run_id}/rejudgments", tag = "rejudgments", request_body = AdmitRejudgeRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = Object, description = "Admitted"), (status = 200, body = Object, description = "Already admitted for this predecessor"),
        (status = 409, description = "Another re-judgment of this attempt is open, or lease_not_held", body = ApiErrorBody),
        (status = 422, description = "Bad id, unreserved attempt, or a predecessor line the failures sidecar does not hold", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn admit_rejudgment(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
    ApiJson(request): ApiJson<AdmitRejudgeRequest>,
) -> ApiResult<(StatusCode, Json<Rejudgment>)> {
    caller.require(Role::Collector)?;
    if !ROLLOUT_ID.is_match(&request.rollout_id) {
        return Err(ApiError::invalid(
            "rollout_id: must match ^[A-Za-z0-9][A-Za-z0-9._-]*$",
        ));
    }
    if request.predecessor_failure_id.is_empty() {
        return Err(ApiError::invalid(
            "predecessor_failure_id: must not be empty",
        ));
    }
    let line = request
        .predecessor_line
        .strip_suffix('\n')
        .unwrap_or(&request.predecessor_line)
        .to_owned();
    if line.contains('\n') {
        return Err(ApiError::invalid(
            "predecessor_line: one saved line, without embedded newlines",
        ));
    }
    let run = leased_run(&state, &run_id, &request.lease_id).await?;
    let work = state.clone();
    state
        .detached(async move { admit_locked(&work, &run, &run_id, &request, &line).await })
        .await
}

async fn admit_locked(
    state: &AppState,
    run: &LockedRun,
    run_id: &str,
    request: &AdmitRejudgeRequest,
    line: &str,
) -> ApiResult<(StatusCode, Json<Rejudgment>)> {
    let mut manifest = readable_manifest(state, run.paths()).await?;
    let key = format!("{}-a{}", request.rollout_id, request.attempt);
    let sha256 = recovery_core::canonical::sha256_hex(line.as_bytes());
    if let Some(open) = manifest.pending_rejudge.get(&key) {
        if open.predecessor_failure_id == request.predecessor_failure_id
            && open.predecessor_sha256 == sha256
        {
            let existing = state
                .registry
                .store()
                .list_rejudgments(run_id)
                .await?
                .into_iter()
                .find(|r| r.operation_id == open.operation_id)
                .unwrap_or_else(|| Rejudgment {
                    operation_id: open.operation_id.clone(),
                    run_id: run_id.to_owned(),
                    attempt_key: key.clone(),
                    admitted_at: recovery_runs::registry::unix_to_text(open.admitted_at),
                    predecessor_failure_id: open.predecessor_failure_id.clone(),
                    predecessor_sha256: open.predecessor_sha256.clone(),
                    closed_at: None,
                    outcome: None,
                });
            return Ok((StatusCode::OK, Json(existing)));
        }
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("a re-judgment of {key} is already open for another predecessor"),
        ));
    }
    let reserved = manifest
        .next_attempt
        .get(&request.rollout_id)
        .is_some_and(|next| request.attempt < *next);
    if !reserved {
        return Err(ApiError::invalid(format!(
            "attempt: {} of {} was never reserved in this run",
            request.attempt, request.rollout_id
        )));
    }
    let failures = run.paths().failures.clone();
    let expected = sha256.clone();
    if !state
        .blocking(move || failures_hold_line(&failures, &expected))
        .await?
    {
        return Err(ApiError::invalid(
            "predecessor_line: the failures sidecar holds no such line (its bytes must be the saved line's)",
        ));
    }
    let now = state.registry.clock().now();
    let pending = PendingRejudge {
        admitted_at: now.unix_timestamp_nanos() as f64 / 1e9,
        operation_id: recovery_sidecar::new_id(),
        predecessor_failure_id: request.predecessor_failure_id.clone(),
        predecessor_sha256: sha256,
    };
    manifest
        .pending_rejudge
        .insert(key.clone(), pending.clone());
    state.registry.write_manifest(run, &manifest, None).await?;
    let rejudgment = Rejudgment {
        operation_id: pending.operation_id,
        run_id: run_id.to_owned(),
        attempt_key: key,
        admitted_at: recovery_sidecar::format_rfc3339(now),
        predecessor_failure_id: pending.predecessor_failure_id,
        predecessor_sha256: pending.predecessor_sha256,
        closed_at: None,
        outcome: None,
    };
    state.registry.record_rejudgment(run, &rejudgment).await?;
    Ok((StatusCode::CREATED, Json(rejudgment)))
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CloseRejudgeRequest {
    pub lease_id: String,
    /// What the saved outcome was (`graded`, `failed`, ...).
    pub outcome: String,
}

/// Close a re-judgment once its outcome is saved (lease holder).
#[utoipa::path(post, path = "/runs/{run_id}/rejudgments/{operation_id}/close", tag = "rejudgments", request_body = CloseRejudgeRequest,
    params(("run_id" = String, Path, description = "Run id"), ("operation_id" = String, Path, description = "Operation id")),
    responses((status = 204, description = "Closed"), (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn close_rejudgment(
    State(state): State<AppState>,
    Path((run_id, operation_id)): Path<(String, String)>,
    caller: Caller,
    ApiJson(request): ApiJson<CloseRejudgeRequest>,
) -> ApiResult<StatusCode> {
    caller.require(Role::Collector)?;
    let run = leased_run(&state, &run_id, &request.lease_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let state = work;
            let mut manifest = readable_manifest(&state, run.paths()).await?;
            let key = manifest
                .pending_rejudge
                .iter()
                .find(|(_, p)| p.operation_id == operation_id)
                .map(|(k, _)| k.clone());
            let Some(key) = key else {
                return Err(ApiError::not_found(format!(
                    "run {run_id} has no open re-judgment {operation_id}"
                )));
            };
            manifest.pending_rejudge.shift_remove(&key);
            state.registry.write_manifest(&run, &manifest, None).await?;
            state
                .registry
                .store()
                .close_rejudgment(
                    &operation_id,
                    &state.registry.clock().now_text(),
                    &request.outcome,
                )
                .await?;
            Ok(StatusCode::NO_CONTENT)
        })
        .await
}
