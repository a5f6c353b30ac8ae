//! Operator and collector actions on a run: masked-rerun approvals, attempt extensions,
//! resubmits, execution-number reservations and judge-only re-judgments.

use crate::config::{Caller, CollectorCaller, OperatorCaller, Role};
use crate::error::{ApiError, ApiErrorBody, ApiJson, ApiResult, ErrorCode};
use crate::state::AppState;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use recovery_core::plan::OutcomeCheck;
use recovery_runs::LockedRun;
use recovery_runs::operations::{Admission, Admitted};
use recovery_store::{Approval, AttemptExtension, Rejudgment, Resubmit};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalRequest {
    #[schema(minimum = 0)]
    pub task_index: i64,
    #[schema(minimum = 0)]
    pub rollout_index: i64,
    /// The masked attempt approved (exactly this one).
    #[schema(minimum = 0)]
    pub attempt_index: i64,
    #[serde(deserialize_with = "crate::limits::text")]
    #[schema(max_length = 4096)]
    pub reason: String,
}

/// Approve rerunning one masked result that kept an answer but has no grade (operator).
#[utoipa::path(post, path = "/runs/{run_id}/approvals", tag = "approvals", request_body = ApprovalRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = recovery_store::Approval, description = "The approval"),
        (status = 409, description = "not_eligible with the attempt's state and reason", body = ApiErrorBody),
        (status = 403, description = "Only operators approve", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 422, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn approve(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    OperatorCaller(caller): OperatorCaller,
    ApiJson(request): ApiJson<ApprovalRequest>,
) -> ApiResult<(StatusCode, Json<Approval>)> {
    for (field, index) in [
        ("task_index", request.task_index),
        ("rollout_index", request.rollout_index),
        ("attempt_index", request.attempt_index),
    ] {
        if index < 0 {
            return Err(ApiError::invalid_field(
                field,
                format!("{field}: {index} is not an index (0 or more)"),
            ));
        }
    }
    let (_, run) = state.locked_run(&run_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let triple = (
                request.task_index,
                request.rollout_index,
                request.attempt_index,
            );
            let cap = work.config.default_max_attempts;
            let approval = work
                .registry
                .approve(&run, &run_id, &caller.name, &request.reason, triple, cap)
                .await?;
            Ok((StatusCode::CREATED, Json(approval)))
        })
        .await
}

/// List a run's approvals (with their use and revocation).
#[utoipa::path(get, path = "/runs/{run_id}/approvals", tag = "approvals", params(("run_id" = String, Path, description = "Run id")),
    responses((status = 200, body = Vec<recovery_store::Approval>), (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn list_approvals(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
) -> ApiResult<Json<Vec<Approval>>> {
    caller.require(Role::Viewer)?;
    let (_, paths) = state.run(&run_id).await?;
    let cap = state.config.default_max_attempts;
    Ok(Json(state.registry.approvals(&paths, &run_id, cap).await?))
}

/// Revoke an approval before an attempt uses it (operator).
#[utoipa::path(delete, path = "/runs/{run_id}/approvals/{approval_id}", tag = "approvals",
    params(("run_id" = String, Path, description = "Run id"), ("approval_id" = String, Path, description = "Approval id")),
    responses((status = 204, description = "Revoked"), (status = 409, description = "Already used or revoked (conflict)", body = ApiErrorBody),
        (status = 422, description = "An approval id longer than 256 bytes (invalid_request)", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 403, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn revoke_approval(
    State(state): State<AppState>,
    Path((run_id, approval_id)): Path<(String, String)>,
    caller: Caller,
) -> ApiResult<StatusCode> {
    caller.require(Role::Operator)?;
    // Bounded as ids in bodies are (hostile review 39: a 300-byte id was looked up and echoed
    // in a 404).
    if approval_id.len() > recovery_core::journals::APPROVAL_ID_MAX {
        return Err(ApiError::invalid_field(
            "approval_id",
            format!(
                "approval_id: longer than {} bytes (the value is not repeated)",
                recovery_core::journals::APPROVAL_ID_MAX
            ),
        ));
    }
    let (_, run) = state.locked_run(&run_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let cap = work.config.default_max_attempts;
            work.registry
                .revoke(&run, &run_id, &caller.name, &approval_id, cap)
                .await?;
            Ok(StatusCode::NO_CONTENT)
        })
        .await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendRequest {
    /// Attempts added to every rollout's cap (1-100).
    #[serde(deserialize_with = "crate::limits::saturating_i64")]
    #[schema(minimum = 1, maximum = 100)]
    pub extend_attempts: i64,
    #[serde(deserialize_with = "crate::limits::text")]
    #[schema(max_length = 4096)]
    pub reason: String,
}

/// Add attempts to every rollout's cap (operator, `--extend-attempts`).
#[utoipa::path(post, path = "/runs/{run_id}/attempts/extend", tag = "attempts", request_body = ExtendRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = recovery_store::AttemptExtension), (status = 422, body = ApiErrorBody), (status = 409, description = "run_files_invalid: the extension or resubmit journals hold a line the plan refuses (repair it by hand first); nothing is written", body = ApiErrorBody), (status = 404, body = ApiErrorBody), (status = 403, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn extend(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    OperatorCaller(caller): OperatorCaller,
    ApiJson(request): ApiJson<ExtendRequest>,
) -> ApiResult<(StatusCode, Json<AttemptExtension>)> {
    let (_, run) = state.locked_run(&run_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let extension = work
                .registry
                .extend(
                    &run,
                    &run_id,
                    &caller.name,
                    &request.reason,
                    request.extend_attempts,
                )
                .await?;
            Ok((StatusCode::CREATED, Json(extension)))
        })
        .await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResubmitRequest {
    #[serde(deserialize_with = "crate::limits::text")]
    #[schema(max_length = 4096)]
    pub reason: String,
}

/// Reset the failure budget: earlier failures no longer count (operator; no live lease).
#[utoipa::path(post, path = "/runs/{run_id}/attempts/resubmit", tag = "attempts", request_body = ResubmitRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = recovery_store::Resubmit), (status = 423, description = "The run is leased or locked", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 403, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn resubmit(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    OperatorCaller(caller): OperatorCaller,
    ApiJson(request): ApiJson<ResubmitRequest>,
) -> ApiResult<(StatusCode, Json<Resubmit>)> {
    let (_, run) = state.locked_run(&run_id).await?;
    // No live lease may be writing failures while the history is repaired and counted.
    state.registry.check_unleased(&run, &run_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let resubmit = work
                .registry
                .resubmit(&run, &run_id, &caller.name, &request.reason)
                .await?;
            Ok((StatusCode::CREATED, Json(resubmit)))
        })
        .await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReserveRequest {
    #[serde(deserialize_with = "crate::limits::id")]
    #[schema(min_length = 1, max_length = 256)]
    pub lease_id: String,
    /// Logical rollout ids to reserve the next execution number for.
    #[serde(deserialize_with = "crate::limits::ids")]
    #[schema(max_items = 100000)]
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
    let (_, run) = match state.locked_run(run_id).await {
        Ok(locked) => locked,
        Err(e) => return Err(state.under_lease(e, run_id, Some(lease_id)).await),
    };
    state
        .registry
        .check_lease_holder(&run, run_id, lease_id)
        .await?;
    Ok(run)
}

/// Durably reserve execution numbers before dispatch (lease holder).
#[utoipa::path(post, path = "/runs/{run_id}/attempts/reserve", tag = "attempts", request_body = ReserveRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 200, body = ReserveResponse), (status = 409, description = "lease_not_held, or not_eligible: a rollout the plan does not run again (details.not_runnable)", body = ApiErrorBody),
        (status = 422, body = ApiErrorBody), (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn reserve(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    _: CollectorCaller,
    ApiJson(request): ApiJson<ReserveRequest>,
) -> ApiResult<Json<ReserveResponse>> {
    let run = leased_run(&state, &run_id, &request.lease_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let cap = work.config.default_max_attempts;
            let attempts = work
                .registry
                .reserve(&run, &run_id, &request.rollout_ids, cap)
                .await?;
            Ok(Json(ReserveResponse { attempts }))
        })
        .await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckOutcomeRequest {
    /// The outcome line exactly as the collector will append it (its final `\n` optional).
    #[serde(deserialize_with = "crate::limits::line")]
    #[schema(max_length = 1048576)]
    pub line: String,
}

/// Check an outcome line before saving it (the module's `check_outcome`, facts §11.2): the
/// file its `_ng_failure_class` routes it to, the rollout and attempt it is an outcome of, and
/// what the plan would make of it, by the rules the plan reads saved lines with; refused
/// (`outcome_refused`, `details.reason`) when reading it from the file would stop the plan:
/// a rollout not in the inputs, a missing or bad attempt index, mismatched indices, another
/// run's id, an invalid or inconsistent failure record, an unreserved attempt, a different
/// payload for a saved attempt. Writes nothing; no lease needed.
#[utoipa::path(post, path = "/runs/{run_id}/outcomes/check", tag = "attempts", request_body = CheckOutcomeRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 200, body = recovery_core::plan::OutcomeCheck, description = "The line would be admitted"),
        (status = 422, description = "outcome_refused (details.reason), invalid_request, rows_invalid (the saved files cannot be planned)", body = ApiErrorBody),
        (status = 409, description = "no_manifest, run_files_invalid or run_superseded", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody),
        (status = 503, description = "overloaded: retry after Retry-After", body = ApiErrorBody)))]
pub async fn check_outcome(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    _: CollectorCaller,
    ApiJson(request): ApiJson<CheckOutcomeRequest>,
) -> ApiResult<Json<OutcomeCheck>> {
    let checked = state
        .with_plan(&run_id, move |plan| {
            plan.check_outcome(request.line.as_bytes())
        })
        .await?;
    checked.map(Json).map_err(|refusal| {
        ApiError::new(ErrorCode::OutcomeRefused, refusal.to_string())
            .with_details(serde_json::json!({"field": "line", "reason": refusal.reason()}))
    })
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdmitRejudgeRequest {
    #[serde(deserialize_with = "crate::limits::id")]
    #[schema(min_length = 1, max_length = 256)]
    pub lease_id: String,
    #[serde(deserialize_with = "crate::limits::id")]
    #[schema(min_length = 1, max_length = 256)]
    pub rollout_id: String,
    pub attempt: u64,
    #[serde(deserialize_with = "crate::limits::id")]
    #[schema(min_length = 1, max_length = 256)]
    pub predecessor_failure_id: String,
    /// The judge failure's line exactly as saved, in the failures sidecar or the results file
    /// (its SHA-256 is recorded; the re-judged outcome names it in
    /// `_ng_rejudge.predecessor_sha256`).
    #[serde(deserialize_with = "crate::limits::line")]
    #[schema(max_length = 1048576)]
    pub predecessor_line: String,
}

/// Admit a judge-only re-judgment before its judge call (lease holder). Admitting the same
/// predecessor again answers the open re-judgment (200). Save the re-judged outcome for the
/// same attempt with `_ng_rejudge: {operation_id, predecessor_failure_id, predecessor_sha256}`:
/// it takes the judge failure's place in the plan.
#[utoipa::path(post, path = "/runs/{run_id}/rejudgments", tag = "rejudgments", request_body = AdmitRejudgeRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = recovery_store::Rejudgment, description = "Admitted"), (status = 200, body = recovery_store::Rejudgment, description = "Already admitted for this predecessor"),
        (status = 409, description = "Another re-judgment of this attempt is open, lease_not_held, or not_eligible: the attempt is not the rollout's latest, judge_recoverable", body = ApiErrorBody),
        (status = 422, description = "Bad id, unreserved attempt, a predecessor line of another rollout or attempt, or one neither the failures sidecar nor the results file holds", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn admit_rejudgment(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    _: CollectorCaller,
    ApiJson(request): ApiJson<AdmitRejudgeRequest>,
) -> ApiResult<(StatusCode, Json<Rejudgment>)> {
    let admission = Admission {
        rollout_id: request.rollout_id,
        attempt: request.attempt,
        predecessor_failure_id: request.predecessor_failure_id,
        predecessor_line: request
            .predecessor_line
            .strip_suffix('\n')
            .unwrap_or(&request.predecessor_line)
            .to_owned(),
    };
    let run = leased_run(&state, &run_id, &request.lease_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            let (admitted, rejudgment) = work
                .registry
                .admit_rejudgment(&run, &run_id, &admission)
                .await?;
            let status = match admitted {
                Admitted::Opened => StatusCode::CREATED,
                Admitted::AlreadyOpen => StatusCode::OK,
            };
            Ok((status, Json(rejudgment)))
        })
        .await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CloseRejudgeRequest {
    #[serde(deserialize_with = "crate::limits::id")]
    #[schema(min_length = 1, max_length = 256)]
    pub lease_id: String,
    /// What the saved outcome was (`graded`, `failed`, ...).
    #[serde(deserialize_with = "crate::limits::id")]
    #[schema(min_length = 1, max_length = 256)]
    pub outcome: String,
}

/// Close a re-judgment once its outcome is saved (lease holder).
#[utoipa::path(post, path = "/runs/{run_id}/rejudgments/{operation_id}/close", tag = "rejudgments", request_body = CloseRejudgeRequest,
    params(("run_id" = String, Path, description = "Run id"), ("operation_id" = String, Path, description = "Operation id")),
    responses((status = 204, description = "Closed"), (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn close_rejudgment(
    State(state): State<AppState>,
    Path((run_id, operation_id)): Path<(String, String)>,
    _: CollectorCaller,
    ApiJson(request): ApiJson<CloseRejudgeRequest>,
) -> ApiResult<StatusCode> {
    let run = leased_run(&state, &run_id, &request.lease_id).await?;
    let work = state.clone();
    state
        .detached(async move {
            work.registry
                .close_rejudgment(&run, &run_id, &operation_id, &request.outcome)
                .await?;
            Ok(StatusCode::NO_CONTENT)
        })
        .await
}
