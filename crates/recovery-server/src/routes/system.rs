//! Health, readiness, metrics and the OpenAPI document.

use crate::state::AppState;
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "system", responses((status = 200, description = "ok")))]
pub async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: start-up is done (the sidecars under the roots reindexed) and the database answers.
#[utoipa::path(get, path = "/readyz", tag = "system", responses((status = 200, description = "ready"), (status = 503, description = "the service is starting (`starting`, with `Retry-After`), or the database does not answer")))]
pub async fn readyz(State(state): State<AppState>) -> axum::response::Response {
    if !state.is_ready() {
        return crate::error::ApiError::new(
            crate::error::ErrorCode::Starting,
            "the service is starting (reindexing the sidecars under its roots)",
        )
        .into_response();
    }
    match state.registry.store().ping().await {
        Ok(()) => (StatusCode::OK, "ready").into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "readiness check failed");
            (StatusCode::SERVICE_UNAVAILABLE, "database unavailable").into_response()
        }
    }
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", tag = "system", responses((status = 200, description = "Prometheus text format")))]
pub async fn metrics(State(state): State<AppState>) -> String {
    state.metrics.render()
}

/// This service's OpenAPI document.
#[utoipa::path(get, path = "/openapi.json", tag = "system", responses((status = 200, description = "OpenAPI 3.1 document")))]
pub async fn openapi() -> Json<serde_json::Value> {
    Json(crate::openapi_value())
}

/// Bring the database up to date with the files under the roots now (operator): runs written by
/// Python collectors are adopted, their journal lines indexed, superseded runs marked.
#[utoipa::path(post, path = "/reindex", tag = "system",
    responses((status = 200, body = recovery_runs::ReindexReport, description = "What was found and inserted"),
        (status = 403, body = crate::error::ApiErrorBody), (status = 401, body = crate::error::ApiErrorBody)))]
pub async fn reindex(
    State(state): State<AppState>,
    caller: crate::config::Caller,
) -> crate::error::ApiResult<Json<recovery_runs::ReindexReport>> {
    caller.require(crate::config::Role::Operator)?;
    let work = state.clone();
    let report = state
        .detached(async move { Ok(work.registry.reindex().await?) })
        .await?;
    Ok(Json(report))
}
