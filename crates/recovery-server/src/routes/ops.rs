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
use recovery_sidecar::{RunLock, SidecarPaths};
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
    let (_, paths) = state.run(&run_id).await?;
    let cap = state.config.default_max_attempts;
    let work_paths = paths.clone();
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
            &paths,
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
    let (_, paths) = state.run(&run_id).await?;
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
    state.registry.revoke_approval(&paths, &approval_id).await?;
    audit(
        &state,
        &caller,
        "approval.revoke",
        Some(&run_id),
        serde_json::json!({"approval_id": approval_id}),
    )
    .await?;
    Ok(StatusCode::NO_CONTENT)
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
    let (_, paths) = state.run(&run_id).await?;
    let extension = state
        .registry
        .record_extension(
            &paths,
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
    let (_, paths) = state.run(&run_id).await?;
    state.check_lease(&run_id, None).await?;
    // The caller must own the run while the history is repaired and counted.
    let _lock = RunLock::for_output(&paths.run_lock, None)
        .map_err(|e| ApiError::new(ErrorCode::RunLocked, e.to_string()))?;
    let resubmit = state
        .registry
        .record_resubmit(&paths, &run_id, &caller.name)
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

async fn leased_manifest(
    state: &AppState,
    run_id: &str,
    lease_id: &str,
) -> ApiResult<SidecarPaths> {
    let (_, paths) = state.run(run_id).await?;
    if !state.leases.is_live(run_id, lease_id).await? {
        return Err(ApiError::new(
            ErrorCode::LeaseNotHeld,
            format!("lease {lease_id} does not hold run {run_id}"),
        ));
    }
    Ok(paths)
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
    let paths = leased_manifest(&state, &run_id, &request.lease_id).await?;
    let cap = state.config.default_max_attempts;
    let work_paths = paths.clone();
    let (mut manifest, plan) = state
        .blocking(move || runfiles::build_plan(&work_paths, cap))
        .await?;
    let mut attempts = BTreeMap::new();
    for id in &request.rollout_ids {
        let entry = plan
            .entries
            .iter()
            .find(|e| &e.rollout_id == id)
            .ok_or_else(|| {
                ApiError::invalid(format!(
                    "rollout_ids: {id} is not in this run's materialized inputs"
                ))
            })?;
        if attempts.contains_key(id) {
            return Err(ApiError::invalid(format!(
                "rollout_ids: {id} is listed twice"
            )));
        }
        let attempt = manifest
            .next_attempt
            .get(id)
            .map_or_else(|| entry.latest_attempt.map_or(0, |l| l + 1), |n| *n as i64);
        manifest
            .next_attempt
            .insert(id.clone(), (attempt + 1) as u64);
        attempts.insert(id.clone(), attempt);
    }
    state
        .registry
        .write_manifest(&paths, &manifest, None)
        .await?;
    // An approved masked rerun is used by the attempt reserved for it.
    let approvals = state.registry.store().list_approvals(&run_id).await?;
    for (id, attempt) in &attempts {
        let Some(entry) = plan
            .entries
            .iter()
            .find(|e| &e.rollout_id == id && e.state == PlanState::ApprovedRerun)
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
    Ok(Json(ReserveResponse { attempts }))
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

/// Admit a judge-only re-judgment before its judge call (lease holder).
#[utoipa::path(post, path = "/runs/{run_id}/rejudgments", tag = "rejudgments", request_body = AdmitRejudgeRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = Object), (status = 409, body = ApiErrorBody), (status = 422, body = ApiErrorBody), (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn admit_rejudgment(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
    ApiJson(request): ApiJson<AdmitRejudgeRequest>,
) -> ApiResult<(StatusCode, Json<Rejudgment>)> {
    caller.require(Role::Collector)?;
    if request.predecessor_failure_id.is_empty() {
        return Err(ApiError::invalid(
            "predecessor_failure_id: must not be empty",
        ));
    }
    let line = request
        .predecessor_line
        .strip_suffix('\n')
        .unwrap_or(&request.predecessor_line);
    if line.contains('\n') {
        return Err(ApiError::invalid(
            "predecessor_line: one saved line, without embedded newlines",
        ));
    }
    let paths = leased_manifest(&state, &run_id, &request.lease_id).await?;
    let mut manifest = readable_manifest(&state, &paths).await?;
    let key = format!("{}-a{}", request.rollout_id, request.attempt);
    if manifest.pending_rejudge.contains_key(&key) {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("a re-judgment of {key} is already open"),
        ));
    }
    let now = state.registry.clock().now();
    let pending = PendingRejudge {
        admitted_at: now.unix_timestamp_nanos() as f64 / 1e9,
        operation_id: recovery_sidecar::new_id(),
        predecessor_failure_id: request.predecessor_failure_id.clone(),
        predecessor_sha256: recovery_core::canonical::sha256_hex(line.as_bytes()),
    };
    manifest
        .pending_rejudge
        .insert(key.clone(), pending.clone());
    state
        .registry
        .write_manifest(&paths, &manifest, None)
        .await?;
    let rejudgment = Rejudgment {
        operation_id: pending.operation_id,
        run_id: run_id.clone(),
        attempt_key: key,
        admitted_at: recovery_sidecar::format_rfc3339(now),
        predecessor_failure_id: pending.predecessor_failure_id,
        predecessor_sha256: pending.predecessor_sha256,
        closed_at: None,
        outcome: None,
    };
    state.registry.record_rejudgment(&rejudgment).await?;
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
    let paths = leased_manifest(&state, &run_id, &request.lease_id).await?;
    let mut manifest = readable_manifest(&state, &paths).await?;
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
    state
        .registry
        .write_manifest(&paths, &manifest, None)
        .await?;
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
}
