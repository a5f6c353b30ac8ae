//! `GET /audit`: who did what, when, on which run (takeovers, approvals, revocations,
//! extensions, resubmits, replacements, expired and orphaned leases), newest first.

use crate::config::{Caller, Role};
use crate::error::{ApiErrorBody, ApiQuery, ApiResult};
use crate::state::AppState;
use axum::Json;
use axum::extract::State;
use recovery_store::{AuditEntry, AuditFilter, Cursor};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

/// Which audit entries to list.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AuditParams {
    /// Only entries about this run.
    #[serde(default, deserialize_with = "crate::limits::opt_id")]
    #[param(min_length = 1, max_length = 256)]
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
    /// Where the previous page ended (its `next_cursor`): older entries follow.
    #[param(max_length = 400)]
    pub cursor: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AuditPage {
    pub entries: Vec<AuditEntry>,
    /// Present when older entries match: pass it as `cursor` for the next page.
    pub next_cursor: Option<String>,
}

impl AuditParams {
    pub fn filter(&self) -> ApiResult<AuditFilter> {
        // An empty filter is refused, as on the drift lists (it reads as "match nothing").
        for (field, value) in [
            ("run_id", &self.run_id),
            ("actor", &self.actor),
            ("action", &self.action),
        ] {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                return Err(crate::error::ApiError::invalid_field(
                    field,
                    format!("{field}: must not be empty (leave it out to match every entry)"),
                ));
            }
        }
        // A misspelt action would match nothing, silently.
        if let Some(action) = self
            .action
            .as_deref()
            .filter(|a| !recovery_store::AUDIT_ACTIONS.contains(a))
        {
            return Err(crate::error::ApiError::invalid_field(
                "action",
                format!(
                    "action: {action:?} is no audited action (one of {})",
                    recovery_store::AUDIT_ACTIONS.join(", ")
                ),
            ));
        }
        Ok(AuditFilter {
            run_id: self.run_id.clone(),
            actor: self.actor.clone(),
            action: self.action.clone(),
            before: self
                .cursor
                .as_deref()
                .map(|text| {
                    crate::routes::query::time_cursor(crate::routes::query::CursorList::Audit, text)
                })
                .transpose()?,
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
    let mut filter = params.filter()?;
    let limit = filter.limit;
    // One more than the page: a cursor is given only when another entry follows.
    filter.limit += 1;
    let entries = state.registry.store().query_audit(&filter).await?;
    let list = crate::routes::query::CursorList::Audit;
    let (entries, next_cursor) = crate::error::keyset_page(entries, limit, list, |last| Cursor {
        at: last.at.clone(),
        id: last.audit_id.clone(),
    });
    Ok(Json(AuditPage {
        entries,
        next_cursor,
    }))
}
