//! `GET /audit`: who did what, when, on which run (takeovers, approvals, revocations,
//! extensions, resubmits, replacements, expired and orphaned leases), newest first.

use crate::config::{Caller, Role};
use crate::error::{ApiErrorBody, ApiQuery, ApiResult};
use crate::state::AppState;
use axum::Json;
use axum::extract::State;
use recovery_store::{AuditEntry, AuditFilter};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

/// Which audit entries to list.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AuditParams {
    /// Only entries about this run.
    #[serde(default, deserialize_with = "crate::limits::opt_id")]
    #[param(max_length = 256)]
    pub run_id: Option<String>,
    /// Only entries by this actor (a token's name, `local` or `system`).
    #[param(max_length = 256)]
    pub actor: Option<String>,
    /// Only this action (`lease.takeover`, `approval.create`, ...).
    #[param(max_length = 256)]
    pub action: Option<String>,
    /// At most this many (1-1000, default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AuditPage {
    pub entries: Vec<AuditEntry>,
}

impl AuditParams {
    pub fn filter(&self) -> ApiResult<AuditFilter> {
        let blank = |v: &Option<String>| v.clone().filter(|s| !s.trim().is_empty());
        Ok(AuditFilter {
            run_id: blank(&self.run_id),
            actor: blank(&self.actor),
            action: blank(&self.action),
            limit: crate::error::page_limit(self.limit, 100)?,
        })
    }
}

/// The audit log, newest first (viewer).
#[utoipa::path(get, path = "/audit", tag = "system", params(AuditParams),
    responses((status = 200, body = AuditPage), (status = 422, body = ApiErrorBody)))]
pub async fn audit(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(params): ApiQuery<AuditParams>,
) -> ApiResult<Json<AuditPage>> {
    caller.require(Role::Viewer)?;
    let entries = state
        .registry
        .store()
        .query_audit(&params.filter()?)
        .await?;
    Ok(Json(AuditPage { entries }))
}
