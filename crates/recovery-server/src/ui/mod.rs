//! The operators' console under `/ui/`: server-rendered HTML (maud templates, checked at
//! compile time) that works without JavaScript.
//!
//! Every page and action calls the API's own handler with the visitor's caller, so the console
//! can do exactly what the API lets that role do, through the same locked mutations; this
//! module only reads forms, checks that they are the visitor's ([`session`]) and renders.

mod chart;
mod pages;
pub mod session;

use crate::config::{OperatorCaller, Role};
use crate::error::{ApiError, ApiJson, ApiQuery};
use crate::routes;
use crate::state::AppState;
use axum::Router;
use axum::extract::rejection::FormRejection;
use axum::extract::{Form, FromRequest, FromRequestParts, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use session::{Visitor, check_form};

/// Rows of a plan and runs per page.
const PAGE: u32 = 50;
const RUNS_PAGE: u32 = 20;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(runs))
        .route("/ui/login", get(login_form).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/runs/{run_id}", get(run))
        .route("/ui/runs/{run_id}/takeover", post(takeover))
        .route("/ui/runs/{run_id}/approvals", post(approve))
        .route(
            "/ui/runs/{run_id}/approvals/{approval_id}/revoke",
            post(revoke),
        )
        .route("/ui/runs/{run_id}/extend", post(extend))
        .route("/ui/runs/{run_id}/resubmit", post(resubmit))
        .route("/ui/drift", get(drift))
        .route("/ui/audit", get(audit))
        .route("/ui/style.css", get(style))
}

async fn style() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        pages::STYLE,
    )
}

/// A form that cannot be read: a 422 page naming the field.
#[derive(Debug)]
struct BadForm(String);

impl IntoResponse for BadForm {
    fn into_response(self) -> Response {
        pages::error_page(
            StatusCode::UNPROCESSABLE_ENTITY,
            &format!("the form: {}", self.0),
        )
    }
}

/// A form's fields read as the API request they make (its limits and messages apply), a
/// refusal naming the field (as the API's does).
fn api_request<T: DeserializeOwned>(fields: Value) -> Result<T, BadForm> {
    serde_path_to_error::deserialize(fields)
        .map_err(|e| BadForm(format!("{}: {}", e.path(), e.inner())))
}

fn form<T>(form: Result<Form<T>, FormRejection>) -> Result<T, BadForm> {
    form.map(|Form(f)| f).map_err(|e| BadForm(e.body_text()))
}

/// A form whose fields carry the session's CSRF token.
trait SignedFields {
    fn csrf(&self) -> &str;
    /// The role the form's action needs, checked before the form is read: a visitor who may
    /// not act is refused (403) whatever the form holds, as the API refuses before a body.
    const ROLE: Role = Role::Viewer;
}

/// A state-changing form, accepted only from the visitor's own session and origin: the
/// visitor (or the sign-in page / 403), its role (403), then the fields (or a 422 page naming the field), then
/// the CSRF check (403). Every action takes its form through this one extractor.
struct SignedForm<T>(Visitor, T);

impl<T> FromRequest<AppState> for SignedForm<T>
where
    T: DeserializeOwned + SignedFields + Send,
{
    type Rejection = Response;

    async fn from_request(
        request: axum::extract::Request,
        state: &AppState,
    ) -> Result<Self, Response> {
        let (mut parts, body) = request.into_parts();
        let visitor = Visitor::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        visitor
            .caller
            .require(T::ROLE)
            .map_err(|refused| pages::api_error_page(&refused, None))?;
        let headers = parts.headers.clone();
        let request = axum::extract::Request::from_parts(parts, body);
        let sent = form(Form::<T>::from_request(request, state).await)
            .map_err(IntoResponse::into_response)?;
        check_form(&visitor, &headers, sent.csrf()).map_err(IntoResponse::into_response)?;
        Ok(Self(visitor, sent))
    }
}

/// `Query<T>` whose rejection is a 422 page naming the parameter, as forms are.
struct PageQuery<T>(T);

impl<T: DeserializeOwned + Send> FromRequestParts<AppState> for PageQuery<T> {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Response> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(query)| Self(query))
            .map_err(|e| {
                pages::error_page(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &format!("the address: {}", e.body_text()),
                )
            })
    }
}

/// After an action: back to the run with what happened, or the API's refusal as a page.
fn done<T>(result: Result<T, ApiError>, run_id: &str, what: &str) -> Response {
    match result {
        Ok(_) => Redirect::to(&format!(
            "/ui/runs/{}?done={}",
            pages::url_encode(run_id),
            pages::url_encode(what)
        ))
        .into_response(),
        Err(error) => pages::api_error_page(&error, Some(run_id)),
    }
}

// --- sign-in -----------------------------------------------------------------------------------

async fn login_form(State(state): State<AppState>) -> Response {
    if state.config.tokens.is_empty() {
        return Redirect::to("/ui/").into_response();
    }
    pages::login(None).into_response()
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(
    State(state): State<AppState>,
    headers: HeaderMap,
    login: Result<Form<LoginForm>, FormRejection>,
) -> Response {
    if let Err(refusal) = session::same_origin(&headers) {
        return refusal.into_response();
    }
    let login = match form(login) {
        Ok(login) => login,
        Err(bad) => return bad.into_response(),
    };
    let caller = match state
        .config
        .authenticate(Some(&format!("Bearer {}", login.token.trim())))
    {
        Ok(caller) => caller,
        Err(_) => {
            return (
                StatusCode::UNAUTHORIZED,
                pages::login(Some("That token is not known to this service.")),
            )
                .into_response();
        }
    };
    let fingerprint = crate::config::TokenEntry::of_token(&state.config.tokens, &login.token)
        .map(crate::config::TokenEntry::fingerprint)
        .unwrap_or_default();
    match session::start(&state, &caller, fingerprint).await {
        Ok(cookie) => (
            StatusCode::SEE_OTHER,
            [
                (header::SET_COOKIE, cookie),
                (header::LOCATION, "/ui/".into()),
            ],
        )
            .into_response(),
        Err(refusal) => refusal.into_response(),
    }
}

#[derive(Debug, Deserialize)]
struct CsrfForm {
    /// Absent is refused like a wrong token (403), never as a malformed form.
    #[serde(default)]
    csrf: String,
}

impl SignedFields for CsrfForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

async fn logout(
    State(state): State<AppState>,
    SignedForm(visitor, _): SignedForm<CsrfForm>,
) -> Response {
    let cookie = session::end(&state, &visitor).await;
    (
        StatusCode::SEE_OTHER,
        [
            (header::SET_COOKIE, cookie),
            (header::LOCATION, "/ui/login".into()),
        ],
    )
        .into_response()
}

// --- pages -------------------------------------------------------------------------------------

#[derive(Debug, Default, Deserialize)]
struct RunsQuery {
    q: Option<String>,
    cursor: Option<String>,
}

async fn runs(
    State(state): State<AppState>,
    visitor: Visitor,
    PageQuery(query): PageQuery<RunsQuery>,
) -> Response {
    let search = query.q.as_deref().map(str::trim).filter(|q| !q.is_empty());
    let cursor = query
        .cursor
        .as_deref()
        .and_then(|text| crate::routes::query::CursorList::Runs.decode(text));
    let store = state.registry.store();
    let list = || async {
        match search {
            Some(text) => {
                store
                    .search_runs(text, RUNS_PAGE + 1, cursor.as_ref())
                    .await
            }
            None => store.list_runs(RUNS_PAGE + 1, cursor.as_ref()).await,
        }
    };
    let mut records = match list().await {
        Ok(records) => records,
        Err(e) => return pages::api_error_page(&e.into(), None),
    };
    // As the API's list: a restored run listed as superseded takes its output back first.
    match state.readopt_restored(&records).await {
        Ok(false) => {}
        Ok(true) => match list().await {
            Ok(again) => records = again,
            Err(e) => return pages::api_error_page(&e.into(), None),
        },
        Err(e) => return pages::api_error_page(&e, None),
    }
    let next = (records.len() > RUNS_PAGE as usize)
        .then(|| {
            records.truncate(RUNS_PAGE as usize);
            records.last().map(|r| {
                crate::routes::query::CursorList::Runs.encode(&recovery_store::Cursor {
                    at: r.created_at.clone(),
                    id: r.run_id.clone(),
                })
            })
        })
        .flatten();
    let mut rows = Vec::with_capacity(records.len());
    for record in records {
        rows.push(run_summary(&state, &visitor, record, None).await);
    }
    let now = state.registry.clock().now();
    pages::runs(&visitor, now, search, &rows, next.as_deref()).into_response()
}

/// What the runs table says of one run.
#[derive(Debug)]
pub struct RunSummary {
    pub record: recovery_store::RunRecord,
    pub holder: Option<routes::leases::HolderView>,
    /// The plan's summary (`state_counts`, `cap`), or why there is none.
    pub plan: Result<Value, String>,
    /// The run's latest validations, newest first: [`HISTORY_ROWS`] at most.
    pub history: Vec<recovery_store::ResumeEvent>,
    /// Whether older validations than those in `history` exist.
    pub older_history: bool,
}

/// How many validations a run's page lists.
pub const HISTORY_ROWS: usize = 50;

impl RunSummary {
    pub fn last_validation(&self) -> Option<&recovery_store::ResumeEvent> {
        self.history.first()
    }

    pub fn last_drift(&self) -> Option<&recovery_store::ResumeEvent> {
        self.history
            .iter()
            .find(|e| e.outcome == "resume_with_drift")
    }
}

/// The summary of a run; `plan` when the caller read the run's plan already.
async fn run_summary(
    state: &AppState,
    visitor: &Visitor,
    record: recovery_store::RunRecord,
    plan: Option<Result<Value, String>>,
) -> RunSummary {
    let run_id = record.run_id.clone();
    let holder = routes::leases::holder(
        State(state.clone()),
        Path(run_id.clone()),
        visitor.caller.clone(),
    )
    .await
    .ok()
    .map(|axum::Json(h)| h);
    let plan = match plan {
        Some(plan) => plan,
        None => plan_page(state, visitor, &run_id, None, Some(1), None).await,
    };
    let (events, older_history) = newest_history(state, &run_id).await;
    RunSummary {
        history: events,
        older_history,
        record,
        holder,
        plan,
    }
}

/// One page of a run's plan, as the API answers it.
async fn plan_page(
    state: &AppState,
    visitor: &Visitor,
    run_id: &str,
    plan_state: Option<&str>,
    limit: Option<u32>,
    cursor: Option<String>,
) -> Result<Value, String> {
    let params: routes::query::PlanParams =
        serde_json::from_value(json!({"state": plan_state, "limit": limit, "cursor": cursor}))
            .map_err(|e| format!("state: {e}"))?;
    let answer = routes::query::plan(
        State(state.clone()),
        Path(run_id.to_owned()),
        visitor.caller.clone(),
        ApiQuery(params),
    )
    .await
    .map_err(|e| e.message)?;
    serde_json::from_slice(&answer.0).map_err(|e| e.to_string())
}

#[derive(Debug, Default, Deserialize)]
struct RunQuery {
    state: Option<String>,
    cursor: Option<String>,
    done: Option<String>,
}

async fn run(
    State(state): State<AppState>,
    visitor: Visitor,
    Path(run_id): Path<String>,
    PageQuery(query): PageQuery<RunQuery>,
) -> Response {
    // The run's record, not its manifest: a 100k-rollout manifest takes a while to read, and
    // the plan (indexed once per run) answers the cap and the states.
    // Not held: the plan below reads the run again, and takes its own section.
    let (record, paths) = match state.run_on_disk(&run_id).await {
        Ok(reading) => (reading.record, reading.paths),
        Err(error) if error.code == crate::error::ErrorCode::RunSuperseded => {
            return superseded_run(&state, &visitor, &run_id, &error).await;
        }
        Err(error) => return pages::api_error_page(&error, None),
    };
    let filter = query.state.as_deref().filter(|s| !s.is_empty());
    let plan = plan_page(
        &state,
        &visitor,
        &run_id,
        filter,
        Some(PAGE),
        query.cursor.clone(),
    )
    .await;
    // The page's plan carries the whole run's counts too: one plan read per page.
    let summary = run_summary(&state, &visitor, record.clone(), Some(plan)).await;
    let approvals = state
        .registry
        .approvals(&paths, &run_id, state.config.default_max_attempts)
        .await
        .unwrap_or_default();
    let now = state.registry.clock().now();
    pages::run(
        &visitor,
        now,
        &pages::RunPage {
            record: &record,
            summary: &summary,
            filter,
            approvals: &approvals,
            done: query.done.as_deref().and_then(pages::done_message),
        },
    )
    .into_response()
}

/// A run's [`HISTORY_ROWS`] newest validations, and whether older ones exist (one more is read).
async fn newest_history(
    state: &AppState,
    run_id: &str,
) -> (Vec<recovery_store::ResumeEvent>, bool) {
    let mut events = state
        .registry
        .store()
        .list_resume_events(run_id, HISTORY_ROWS as u32 + 1)
        .await
        .unwrap_or_default();
    let older = events.len() > HISTORY_ROWS;
    events.truncate(HISTORY_ROWS);
    (events, older)
}

/// The page of a superseded run: its validations stay readable, as the API keeps them.
async fn superseded_run(
    state: &AppState,
    visitor: &Visitor,
    run_id: &str,
    error: &crate::error::ApiError,
) -> Response {
    let store = state.registry.store();
    let record = match store.get_run(run_id).await {
        Ok(Some(record)) => record,
        _ => return pages::api_error_page(error, None),
    };
    let Some(successor) = record.superseded_by.clone() else {
        return pages::api_error_page(error, None);
    };
    let (history, older) = newest_history(state, run_id).await;
    let now = state.registry.clock().now();
    pages::superseded_run(visitor, now, &record, &successor, &history, older).into_response()
}

#[derive(Debug, Default, Deserialize)]
struct DriftQuery {
    from: Option<String>,
    to: Option<String>,
    run_id: Option<String>,
    key: Option<String>,
}

async fn drift(
    State(state): State<AppState>,
    visitor: Visitor,
    PageQuery(query): PageQuery<DriftQuery>,
) -> Response {
    let blank = |v: &Option<String>| v.clone().filter(|s| !s.trim().is_empty());
    let params = routes::query::DriftParams {
        run_id: blank(&query.run_id),
        from: blank(&query.from),
        to: blank(&query.to),
        key: blank(&query.key),
        limit: Some(1000),
        cursor: None,
        // The newest thousand: the page lists the latest and charts the recent past.
        order: Some(routes::query::DriftOrder::Newest),
    };
    let page = routes::query::drift(
        State(state.clone()),
        visitor.caller.clone(),
        ApiQuery(params),
    )
    .await;
    // The API's answer is JSON text (passed through from the database): read back here.
    let page = page.and_then(|json| {
        serde_json::from_slice::<routes::query::DriftPage>(&json.0)
            .map_err(|e| crate::error::ApiError::internal("reading the drift page", e))
    });
    let page = match page {
        Ok(page) => page,
        Err(error) => return pages::api_error_page(&error, None),
    };
    let chart = chart::drift_chart(&page.events);
    let top = chart::top_keys(&page.events);
    let now = state.registry.clock().now();
    let filters = pages::DriftFilters {
        from: blank(&query.from),
        to: blank(&query.to),
        run_id: blank(&query.run_id),
        key: blank(&query.key),
    };
    pages::drift(&visitor, now, &filters, &page, chart.as_ref(), &top).into_response()
}

async fn audit(
    State(state): State<AppState>,
    visitor: Visitor,
    PageQuery(mut params): PageQuery<routes::audit::AuditParams>,
) -> Response {
    // The page's form sends the fields left empty: they filter nothing here.
    for value in [&mut params.run_id, &mut params.actor, &mut params.action] {
        if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
            *value = None;
        }
    }
    let filter = pages::AuditFilters {
        run_id: params.run_id.clone().filter(|s| !s.trim().is_empty()),
        actor: params.actor.clone().filter(|s| !s.trim().is_empty()),
        action: params.action.clone().filter(|s| !s.trim().is_empty()),
    };
    match routes::audit::audit(
        State(state.clone()),
        visitor.caller.clone(),
        ApiQuery(params),
    )
    .await
    {
        Ok(axum::Json(page)) => {
            let now = state.registry.clock().now();
            pages::audit(&visitor, now, &filter, &page.entries).into_response()
        }
        Err(error) => pages::api_error_page(&error, None),
    }
}

// --- actions -----------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
struct TakeoverForm {
    /// Absent is refused like a wrong token (403), never as a malformed form.
    #[serde(default)]
    csrf: String,
    holder: String,
    reason: String,
    /// The confirmation checkbox (absent when unticked).
    confirm: Option<String>,
}

impl SignedFields for TakeoverForm {
    const ROLE: Role = Role::Operator;

    fn csrf(&self) -> &str {
        &self.csrf
    }
}

async fn takeover(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    SignedForm(visitor, sent): SignedForm<TakeoverForm>,
) -> Response {
    if sent.confirm.as_deref() != Some("yes") {
        return pages::error_page(
            StatusCode::UNPROCESSABLE_ENTITY,
            "confirm: tick the box to end the current holder's lease",
        );
    }
    let request = match api_request(json!({
        "holder": sent.holder, "host": "console", "pid": 0, "reason": sent.reason,
    })) {
        Ok(request) => request,
        Err(bad) => return bad.into_response(),
    };
    let operator = visitor.caller.name.clone();
    let taken = async {
        let caller = OperatorCaller::checked(visitor.caller)?;
        routes::leases::takeover(
            State(state.clone()),
            Path(run_id.clone()),
            caller,
            ApiJson(request),
        )
        .await
    }
    .await;
    // A browser cannot hand the new lease to a collector, and a lease nobody can use would keep
    // every collector out until it expires: the console's takeover ends it at once (audited
    // `lease.takeover` then `lease.released`), and the run is free for the next collector.
    let result = match taken {
        Ok((_, axum::Json(granted))) => state
            .leases
            .release(&operator, &run_id, &granted.lease_id)
            .await
            .map_err(ApiError::from),
        Err(error) => Err(error),
    };
    done(result, &run_id, "takeover")
}

#[derive(Debug, Deserialize)]
struct ApproveForm {
    /// Absent is refused like a wrong token (403), never as a malformed form.
    #[serde(default)]
    csrf: String,
    task_index: i64,
    rollout_index: i64,
    attempt_index: i64,
    reason: String,
}

impl SignedFields for ApproveForm {
    const ROLE: Role = Role::Operator;

    fn csrf(&self) -> &str {
        &self.csrf
    }
}

async fn approve(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    SignedForm(visitor, sent): SignedForm<ApproveForm>,
) -> Response {
    let request = match api_request(json!({
        "task_index": sent.task_index, "rollout_index": sent.rollout_index,
        "attempt_index": sent.attempt_index, "reason": sent.reason,
    })) {
        Ok(request) => request,
        Err(bad) => return bad.into_response(),
    };
    let result = async {
        let caller = OperatorCaller::checked(visitor.caller)?;
        routes::ops::approve(State(state), Path(run_id.clone()), caller, ApiJson(request)).await
    }
    .await;
    done(result, &run_id, "approved")
}

async fn revoke(
    State(state): State<AppState>,
    Path((run_id, approval_id)): Path<(String, String)>,
    SignedForm(visitor, _): SignedForm<CsrfForm>,
) -> Response {
    let result = routes::ops::revoke_approval(
        State(state),
        Path((run_id.clone(), approval_id)),
        visitor.caller,
    )
    .await;
    done(result, &run_id, "revoked")
}

#[derive(Debug, Deserialize)]
struct ExtendForm {
    /// Absent is refused like a wrong token (403), never as a malformed form.
    #[serde(default)]
    csrf: String,
    /// As typed: the API refuses what is no integer, naming the field (hostile review 39: the
    /// form's own parse said only "invalid digit found in string").
    extend_attempts: String,
    reason: String,
}

impl SignedFields for ExtendForm {
    const ROLE: Role = Role::Operator;

    fn csrf(&self) -> &str {
        &self.csrf
    }
}

async fn extend(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    SignedForm(visitor, sent): SignedForm<ExtendForm>,
) -> Response {
    let request = match api_request(
        json!({"extend_attempts": sent.extend_attempts.trim().parse::<i64>().map_or_else(|_| Value::from(sent.extend_attempts), Value::from), "reason": sent.reason}),
    ) {
        Ok(request) => request,
        Err(bad) => return bad.into_response(),
    };
    let result = async {
        let caller = OperatorCaller::checked(visitor.caller)?;
        routes::ops::extend(State(state), Path(run_id.clone()), caller, ApiJson(request)).await
    }
    .await;
    done(result, &run_id, "extended")
}

#[derive(Debug, Deserialize)]
struct ReasonForm {
    /// Absent is refused like a wrong token (403), never as a malformed form.
    #[serde(default)]
    csrf: String,
    reason: String,
}

impl SignedFields for ReasonForm {
    const ROLE: Role = Role::Operator;

    fn csrf(&self) -> &str {
        &self.csrf
    }
}

async fn resubmit(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    SignedForm(visitor, sent): SignedForm<ReasonForm>,
) -> Response {
    let request = match api_request(json!({"reason": sent.reason})) {
        Ok(request) => request,
        Err(bad) => return bad.into_response(),
    };
    let result = async {
        let caller = OperatorCaller::checked(visitor.caller)?;
        routes::ops::resubmit(State(state), Path(run_id.clone()), caller, ApiJson(request)).await
    }
    .await;
    done(result, &run_id, "resubmitted")
}
