//! Runs: create a run's manifest, validate a resume, read runs.

use crate::config::{Caller, CollectorCaller, Role};
use crate::error::{
    ApiError, ApiErrorBody, ApiJson, ApiJsonBytes, ApiQuery, ApiResult, ErrorCode, lease_holder,
    mismatch_details, parse_shallow_json_body,
};
use crate::routes::query::CursorList;
use crate::state::AppState;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use recovery_core::verdict::Mismatch;
use recovery_runs::OpError;
use recovery_runs::operations::{NewRun, ResumeRecord, ResumeRequest};
use recovery_runs::runfiles;
use recovery_sidecar::SidecarPaths;
use recovery_store::{Cursor, ResumeEvent, RunRecord};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path as FsPath;
use utoipa::{IntoParams, ToSchema};

/// A configuration bundle as a collector sends it (interpolations unresolved).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"output_path": "exp/out.jsonl", "config": {"limit": 2, "responses_create_params": {"temperature": 0.3}},
    "global_config": {"policy": {"responses_api_models": {"vllm_model": {"model": "m", "port": 9001}}},
        "agent": {"responses_api_agents": {"simple_agent": {"sandbox_port": 8000,
            "model_server": {"type": "responses_api_models", "name": "policy"}}}}},
    "source_path": "data/train.jsonl",
    "rows": [{"agent_ref": {"name": "agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0, "question": "1+1?"},
        {"agent_ref": {"name": "agent"}, "_ng_task_index": 1, "_ng_rollout_index": 0, "question": "2+2?"}]}))]
pub struct CreateRunRequest {
    /// Output JSONL path (under the service's roots).
    #[serde(deserialize_with = "crate::limits::path")]
    #[schema(max_length = 4096)]
    pub output_path: String,
    /// The source dataset file (its bytes give `source_digest`).
    #[serde(deserialize_with = "crate::limits::path")]
    #[schema(max_length = 4096)]
    pub source_path: String,
    /// Collection settings.
    #[schema(value_type = Object)]
    pub config: Value,
    /// The raw server configuration tree, interpolations unresolved.
    #[schema(value_type = Object)]
    pub global_config: Value,
    /// Environment variables the configuration may interpolate (never persisted).
    #[serde(default)]
    pub environment: BTreeMap<String, String>,
    /// Materialized rows; when absent, the materialized-inputs file beside the output is used.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub rows: Option<Vec<Value>>,
    /// The run's attempt cap (default: the service's), 1 to 1,000,000.
    #[serde(default, deserialize_with = "crate::limits::opt_attempts")]
    #[schema(minimum = 1, maximum = 1_000_000)]
    pub max_rollout_attempts: Option<u64>,
    #[serde(default)]
    pub retry_terminal_timeouts: bool,
    /// Operator only: move an existing run's sidecars aside and start a new run.
    #[serde(default)]
    pub replace: bool,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RunCreated {
    pub run_id: String,
    pub output_path: String,
    pub source_digest: String,
    pub materialized_digest: String,
    pub config_digest: String,
    /// Digest of the pre-0.5.0 form, for reference.
    pub legacy_config_digest: Option<String>,
    #[schema(value_type = Object)]
    pub manifest: Value,
    /// Sidecars moved aside by a replacement.
    pub replaced: Vec<String>,
}

/// A configuration of the wrong JSON type is a malformed request, as any wrong-typed field.
fn not_an_object(field: &str) -> ApiError {
    ApiError::invalid_field(field, format!("{field}: must be a JSON object"))
}

/// A path confined under the roots (it may not exist).
fn confined_path(state: &AppState, path: &str, field: &str) -> ApiResult<std::path::PathBuf> {
    state
        .registry
        .confinement()
        .resolve(std::path::Path::new(path))
        .map_err(|e| ApiError::new(ErrorCode::PathRefused, format!("{field}: {e}")))
}

fn confined_file(state: &AppState, path: &str, field: &str) -> ApiResult<std::path::PathBuf> {
    let resolved = confined_path(state, path, field)?;
    if !resolved.is_file() {
        return Err(ApiError::invalid_field(
            field,
            format!("{field}: {} is not a readable file", resolved.display()),
        ));
    }
    Ok(resolved)
}

/// The companion paths of a request's `output_path`, which must name a file under the roots.
fn output_paths(state: &AppState, output_path: &str) -> ApiResult<recovery_sidecar::SidecarPaths> {
    if output_path.trim().is_empty() {
        return Err(ApiError::invalid_field(
            "output_path",
            "output_path: must not be empty; name the JSONL file the run writes",
        ));
    }
    let last = output_path.rsplit('/').next().unwrap_or_default();
    if matches!(last, "" | "." | "..") {
        // `Path` forgets a trailing `/` or `/.`: `exp/` would name a file `exp`.
        return Err(ApiError::new(
            crate::error::ErrorCode::PathRefused,
            "output_path: ends with /, /. or /.. (names a directory); name the JSONL file",
        ));
    }
    if output_path.chars().any(char::is_control) {
        return Err(ApiError::new(
            crate::error::ErrorCode::PathRefused,
            "output_path: holds a control character (a newline, a tab)",
        ));
    }
    state
        .registry
        .paths_for(FsPath::new(output_path))
        .map_err(|e| match e {
            recovery_runs::RegistryError::Path(e) => {
                ApiError::new(ErrorCode::PathRefused, format!("output_path: {e}"))
            }
            other => other.into(),
        })
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ImportLegacyRequest {
    /// The output whose saved outcomes have no manifest.
    #[serde(deserialize_with = "crate::limits::path")]
    #[schema(max_length = 4096)]
    pub output_path: String,
    /// Must be `true`: the imported run's identity cannot be verified, and every later
    /// resume needs `allow_unsafe` too (the Python module's `allow_unsafe_resume`).
    #[serde(alias = "allow_unsafe_resume")]
    pub allow_unsafe: bool,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LegacyImported {
    pub run_id: String,
    pub output_path: String,
    #[schema(value_type = Object)]
    pub manifest: Value,
}

/// Import the saved outcomes of an output without a manifest (a NeMo Gym output from before
/// manifests) as a legacy run, as the Python module's resume with `allow_unsafe_resume` does:
/// a manifest with `legacy_import`, attempts numbered from the files. Audited
/// `run.import_legacy`.
#[utoipa::path(post, path = "/runs/import_legacy", tag = "runs", request_body = ImportLegacyRequest,
    responses(
        (status = 201, description = "Imported", body = LegacyImported),
        (status = 409, description = "A manifest is there (run_exists naming its run), or the saved outcomes name a run (restore its manifest)", body = ApiErrorBody),
        (status = 422, description = "allow_unsafe is not true, nothing saved to import, or unreadable outcomes", body = ApiErrorBody),
        (status = 423, description = "Another process holds the run lock (run_locked)", body = ApiErrorBody),
        (status = 401, body = ApiErrorBody), (status = 403, body = ApiErrorBody)))]
pub async fn import_legacy(
    State(state): State<AppState>,
    CollectorCaller(caller): CollectorCaller,
    ApiJson(request): ApiJson<ImportLegacyRequest>,
) -> ApiResult<(StatusCode, Json<LegacyImported>)> {
    if !request.allow_unsafe {
        return Err(ApiError::invalid_field(
            "allow_unsafe",
            "allow_unsafe: must be true: an imported run's identity cannot be verified (every later resume needs allow_unsafe too)",
        ));
    }
    let paths = output_paths(&state, &request.output_path)?;
    // Nothing is locked (a lock file made) beside an output that holds nothing to import.
    if !paths.output.is_file() && !paths.failures.is_file() {
        return Err(ApiError::invalid_field(
            "output_path",
            format!(
                "output_path: {} holds no saved outcomes to import; create the run instead",
                paths.output.display()
            ),
        ));
    }
    // Under the directory's creation lock, as a create: the companion checks and the import
    // are one step against creates and imports of outputs sharing files.
    let run = state.registry.lock_creating(&paths).await?;
    let work = state.clone();
    let manifest = state
        .detached(async move {
            Ok(work
                .registry
                .import_legacy_output(&run, &caller.name)
                .await?)
        })
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(LegacyImported {
            run_id: manifest.run_id.clone(),
            output_path: paths.output.display().to_string(),
            manifest: manifest.to_value(),
        }),
    ))
}

/// Create a run: its manifest, saved identity and (when rows are sent) materialized inputs.
#[utoipa::path(post, path = "/runs", tag = "runs", request_body = CreateRunRequest,
    responses(
        (status = 201, description = "Run created", body = RunCreated),
        (status = 409, description = "A manifest exists (run_exists), or a legacy cache holds outcomes", body = ApiErrorBody),
        (status = 422, description = "invalid_request, path_refused or identity_error", body = ApiErrorBody),
        (status = 423, description = "Another process holds the run lock (run_locked)", body = ApiErrorBody),
        (status = 401, body = ApiErrorBody), (status = 403, body = ApiErrorBody)))]
pub async fn create_run(
    State(state): State<AppState>,
    CollectorCaller(caller): CollectorCaller,
    ApiJson(request): ApiJson<CreateRunRequest>,
) -> ApiResult<(StatusCode, Json<RunCreated>)> {
    if request.replace {
        caller.require(Role::Operator)?;
    }
    for (field, value) in [
        ("config", &request.config),
        ("global_config", &request.global_config),
    ] {
        if !value.is_object() {
            return Err(not_an_object(field));
        }
    }
    let paths = output_paths(&state, &request.output_path)?;
    let new_run = NewRun {
        source: confined_file(&state, &request.source_path, "source_path")?,
        config: request.config,
        global_config: request.global_config,
        environment: request.environment,
        rows: request.rows,
        max_rollout_attempts: request.max_rollout_attempts,
        retry_terminal_timeouts: request.retry_terminal_timeouts,
        replace: request.replace,
    };
    // Everything that can refuse the request is checked before anything is written.
    let prepared = state
        .registry
        .prepare_run(&paths, new_run, state.config.default_max_attempts)
        .await?;
    let run = state.registry.lock_creating(&paths).await?;
    let work = state.clone();
    let created = state
        .detached(async move { Ok(work.registry.create(&run, &caller.name, prepared).await?) })
        .await?;
    metrics::counter!("rollout_recovery_runs_created_total").increment(1);
    let (manifest, identity) = (&created.manifest, &created.identity);
    Ok((
        StatusCode::CREATED,
        Json(RunCreated {
            run_id: manifest.run_id.clone(),
            output_path: paths.output.display().to_string(),
            source_digest: manifest.source_digest.clone(),
            materialized_digest: manifest.materialized_digest.clone(),
            config_digest: manifest.config_digest.clone(),
            legacy_config_digest: identity.legacy_digest.clone(),
            manifest: manifest.to_value(),
            replaced: created.replaced,
        }),
    ))
}

/// A collector's pre-flight before (re)starting a run.
// Read by `parse_shallow_json_body`: every nested field stays a raw text, a string or a flat
// map of strings.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"config": {"limit": 2, "responses_create_params": {"temperature": 0.3}},
    "global_config": {"policy": {"responses_api_models": {"vllm_model": {"model": "m", "port": 9001}}},
        "agent": {"responses_api_agents": {"simple_agent": {"sandbox_port": 8000,
            "model_server": {"type": "responses_api_models", "name": "policy"}}}}},
    "source_path": "data/train.jsonl"}))]
pub struct ValidateRequest {
    /// Collection settings (kept as sent: a recent request with the same texts reuses their
    /// computed identity).
    #[schema(value_type = Object)]
    pub config: Box<serde_json::value::RawValue>,
    /// The raw server configuration tree, interpolations unresolved.
    #[schema(value_type = Object)]
    pub global_config: Box<serde_json::value::RawValue>,
    #[serde(default)]
    pub environment: BTreeMap<String, String>,
    /// The source dataset as the collector will read it now.
    #[serde(deserialize_with = "crate::limits::path")]
    #[schema(max_length = 4096)]
    pub source_path: String,
    /// The rows the collector materialized now; when absent the saved ones are taken as current.
    /// Read as raw texts, off the async workers.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub rows: Option<Box<serde_json::value::RawValue>>,
    /// Accept a mismatching identity (sticky: every later resume needs it too). The collector's
    /// own name for it, `allow_unsafe_resume`, which refusal messages use, is accepted too.
    #[serde(default, alias = "allow_unsafe_resume")]
    pub allow_unsafe: bool,
    /// The caller's lease on the run, when it holds one.
    #[serde(default, deserialize_with = "crate::limits::opt_id")]
    #[schema(min_length = 1, max_length = 256)]
    pub lease_id: Option<String>,
}

/// The answer to a validate.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ValidateResponse {
    /// `reuse`, `resume_with_drift`, `overridden` or `import_legacy`.
    pub outcome: String,
    pub run_id: String,
    pub message: Option<String>,
    /// Keys journalled for a resume across operational drift.
    pub operational_keys: Vec<String>,
    /// The semantic keys an override (`overridden`) accepted with `allow_unsafe`, as its
    /// recorded event names them; empty for every other outcome.
    pub semantic_keys: Vec<String>,
    pub drift_event_id: Option<String>,
    pub config_digest: String,
    /// Whether the request's `rows` were compared with the saved materialized inputs; `false`
    /// when none were sent (the saved ones were taken as current).
    pub rows_compared: bool,
    #[schema(value_type = Option<Object>)]
    pub manifest: Option<Value>,
}

/// Validate a resume: reuse, resume across operational drift (journalled), or refuse naming the
/// semantic keys. Every outcome is recorded.
#[utoipa::path(post, path = "/runs/{run_id}/validate", tag = "runs", request_body = ValidateRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses(
        (status = 200, description = "Resume allowed (reuse, resume_with_drift, overridden, import_legacy)", body = ValidateResponse),
        (status = 409, description = "resume_refused naming keys and reasons, or no_manifest", body = ApiErrorBody),
        (status = 422, description = "manifest_unreadable, identity_error, invalid_request", body = ApiErrorBody),
        (status = 423, description = "Another client holds the run's lease (run_locked, with the holder)", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody), (status = 403, body = ApiErrorBody)))]
pub async fn validate(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    CollectorCaller(caller): CollectorCaller,
    ApiJsonBytes(body): ApiJsonBytes,
) -> ApiResult<Json<ValidateResponse>> {
    // The run is looked up before the body is read: a validate of an unknown run answers 404
    // whatever it sent (hostile review 43, F9: a bad body of an unknown run answered 422).
    let (run, paths) = match state.run(&run_id).await {
        // A validate of a run another run took over is recorded as such, every time (the
        // first one, which finds the takeover on disk, is recorded by the operation).
        Err(error) if error.code == ErrorCode::RunSuperseded => {
            record_superseded(&state, &run_id, &caller.name, &error).await?;
            return Err(error);
        }
        found => found?,
    };
    // Rows may be thousands: a large body is read off the async workers (a small one costs
    // less to read than to hand over), rows and configuration kept as raw texts, so the body
    // needs no depth pass of its own (their readers bound it).
    let request: ValidateRequest = if body.len() <= crate::state::INLINE_BODY_BYTES {
        parse_shallow_json_body(&body)?
    } else {
        state
            .blocking(move || parse_shallow_json_body(&body))
            .await?
    };
    let event = new_resume_event(&state, &run, &caller.name);
    let work = state.clone();
    // Detached: a journal line and its rows are never split by a client that goes away.
    state
        .detached(async move {
            let state = work;
            let mut record = ResumeRecord {
                config_digest: None,
                event: Some(event),
            };
            let result = validate_inner(&state, &paths, request, &mut record).await;
            let outcome = match &result {
                Ok(answer) => answer.outcome.clone(),
                Err(error) => error.code.resume_outcome().into(),
            };
            // A resume across drift committed its event with the drift row.
            if let Some(mut event) = record.event {
                if let Err(error) = &result {
                    event.outcome = outcome.clone();
                    event.message = error.message.clone();
                }
                state
                    .registry
                    .store()
                    .insert_grouped(vec![recovery_store::GroupedRow::Resume(event)])
                    .await?;
            }
            metrics::counter!("rollout_recovery_validations_total", "outcome" => outcome)
                .increment(1);
            result
        })
        .await
        .map(Json)
}

/// The resume event a validate of `run` is recorded with, its outcome still to be filled in.
fn new_resume_event(state: &AppState, run: &RunRecord, client: &str) -> ResumeEvent {
    ResumeEvent {
        event_id: recovery_sidecar::new_id(),
        run_id: Some(run.run_id.clone()),
        output_path: run.output_path.clone(),
        at: state.registry.clock().now_text(),
        outcome: String::new(),
        message: String::new(),
        reasons: vec![],
        semantic_keys: vec![],
        operational_keys: vec![],
        saved_config_digest: Some(run.config_digest.clone()),
        current_config_digest: None,
        client: Some(client.to_owned()),
    }
}

/// Records a validate refused because its run was superseded (`error`), as every refusal is.
async fn record_superseded(
    state: &AppState,
    run_id: &str,
    client: &str,
    error: &ApiError,
) -> ApiResult<()> {
    let store = state.registry.store();
    let Some(run) = store.get_run(run_id).await? else {
        return Ok(());
    };
    let outcome = error.code.resume_outcome();
    let mut event = new_resume_event(state, &run, client);
    event.outcome = outcome.into();
    event.message = error.message.clone();
    store
        .insert_grouped(vec![recovery_store::GroupedRow::Resume(event)])
        .await?;
    metrics::counter!("rollout_recovery_validations_total", "outcome" => outcome).increment(1);
    Ok(())
}

async fn validate_inner(
    state: &AppState,
    paths: &SidecarPaths,
    request: ValidateRequest,
    record: &mut ResumeRecord,
) -> ApiResult<ValidateResponse> {
    let run_id = record
        .event
        .as_ref()
        .and_then(|event| event.run_id.clone())
        .unwrap_or_default();
    let lease_id = request.lease_id;
    // What the body alone refuses is answered before the lease is looked at: a caller
    // without the lease learns what to fix, not only that the run is held.
    for (field, raw) in [
        ("config", &request.config),
        ("global_config", &request.global_config),
    ] {
        // Kept as raw text: its first character tells an object.
        if !raw.get().trim_start().starts_with('{') {
            return Err(not_an_object(field));
        }
    }
    let source = confined_path(state, &request.source_path, "source_path")?;
    state
        .check_lease(paths, &run_id, lease_id.as_deref())
        .await?;
    let rows_compared = request.rows.is_some();
    // Moved, never copied: the rows may be megabytes.
    let resume = ResumeRequest {
        config: request.config,
        global_config: request.global_config,
        environment: request.environment,
        // A source that is gone is the decision's to answer (refused, or overridden with
        // allow_unsafe: facts §17 scenario 31).
        source,
        rows: request.rows,
        allow_unsafe: request.allow_unsafe,
    };
    // The verdict is read and acted on inside the run's section: a manifest rewrite or a journal
    // line never races another writer, and is refused while another process owns the run.
    let result = state
        .registry
        .validate(paths, &run_id, resume, &state.config.drift_policy, record)
        .await;
    let config_digest = record.config_digest.clone();
    note(record, |event| {
        event.current_config_digest = config_digest.clone()
    });
    match result {
        Ok(resumed) => {
            note(record, |event| {
                event.outcome = resumed.outcome.into();
                event.reasons = resumed.reasons;
                event.semantic_keys = resumed.semantic_keys.clone();
                event.operational_keys = resumed.operational_keys.clone();
                if matches!(resumed.outcome, "overridden" | "import_legacy") {
                    event.message = resumed.message.clone().unwrap_or_default();
                }
            });
            Ok(ValidateResponse {
                outcome: resumed.outcome.into(),
                run_id,
                message: resumed.message,
                operational_keys: resumed.operational_keys,
                semantic_keys: resumed.semantic_keys,
                drift_event_id: resumed.drift_event_id,
                config_digest: config_digest.unwrap_or_default(),
                rows_compared,
                manifest: resumed.manifest,
            })
        }
        Err(OpError::ResumeRefused {
            message,
            mismatches,
        }) => {
            note(record, |event| {
                event.reasons = mismatches.iter().map(|m| m.code().to_owned()).collect();
                event.semantic_keys = Mismatch::semantic_keys(&mismatches);
            });
            Err(ApiError::new(ErrorCode::ResumeRefused, message)
                .with_details(mismatch_details(&mismatches)))
        }
        Err(other) => Err(state
            .under_lease(other.into(), &run_id, lease_id.as_deref())
            .await),
    }
}

/// Completes the validation's resume event, unless it was already committed (a resume across
/// drift commits its event with the drift row).
fn note(record: &mut ResumeRecord, fill: impl FnOnce(&mut ResumeEvent)) {
    if let Some(event) = record.event.as_mut() {
        fill(event);
    }
}

/// A run as dashboards see it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RunView {
    pub run: RunRecord,
    /// The manifest on disk (null when missing or unreadable).
    #[schema(value_type = Option<Object>)]
    pub manifest: Option<Value>,
    pub manifest_problem: Option<String>,
    /// The live lease holder, if any (without the lease id).
    #[schema(value_type = Option<crate::error::LeaseHolder>)]
    pub lease: Option<Value>,
    pub saved_cap: Option<u64>,
    /// Null while the journals the budget reads cannot be read (see `budget_problem`).
    pub attempt_extension: Option<u64>,
    /// Saved cap (or the service default) plus the extension; null while either is unknown
    /// (never a guessed cap).
    pub effective_cap: Option<u64>,
    /// Why the attempt budget cannot be read (an unreadable extension or resubmit journal),
    /// the error the plan answers with.
    pub budget_problem: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RunList {
    pub runs: Vec<RunRecord>,
    /// Pass as `cursor` for the next page.
    pub next_cursor: Option<String>,
}

/// Which runs to list, or the output path to look one up by.
#[derive(Debug, Clone, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// At most this many (1-1000, default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
    /// Where the previous page ended (its `next_cursor`).
    #[param(max_length = 400)]
    pub cursor: Option<String>,
    /// Find the run recorded for this output path (a URL is refused, as in bodies).
    #[param(max_length = 4096)]
    #[serde(default, deserialize_with = "crate::limits::opt_path")]
    pub output_path: Option<String>,
}

/// List runs (newest first), or look one up by output path.
#[utoipa::path(get, path = "/runs", tag = "runs", params(ListParams),
    responses((status = 200, body = RunList), (status = 422, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn list_runs(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(params): ApiQuery<ListParams>,
) -> ApiResult<Json<RunList>> {
    caller.require(Role::Viewer)?;
    if let Some(output) = params.output_path {
        if output.trim().is_empty() {
            return Err(ApiError::invalid_field(
                "output_path",
                "output_path: must not be empty (leave it out to list every run)",
            ));
        }
        let resolved = state
            .registry
            .confinement()
            .resolve(std::path::Path::new(&output))
            .map_err(|e| {
                ApiError::new(ErrorCode::PathRefused, format!("output_path: {e}"))
                    .with_details(serde_json::json!({"field": "output_path"}))
            })?;
        // The files are the truth: a run they hold is adopted (a Python collector's fresh start
        // included); without a manifest, the recorded run is answered.
        let run = match state.registry.adopt(&resolved).await? {
            Some(run) => Some(run),
            None => {
                state
                    .registry
                    .store()
                    .find_run_by_output(&resolved.display().to_string())
                    .await?
            }
        };
        return Ok(Json(RunList {
            runs: run.into_iter().collect(),
            next_cursor: None,
        }));
    }
    let cursor = match params.cursor.as_deref() {
        Some(text) => Some(CursorList::Runs.decode(text).ok_or_else(|| {
            ApiError::invalid_field("cursor", "cursor: not a cursor this service issued")
        })?),
        None => None,
    };
    let limit = crate::error::page_limit(params.limit, 100)?;
    // One more than the page: a cursor is given only when another run follows.
    let store = state.registry.store();
    let mut runs = store.list_runs(limit + 1, cursor.as_ref()).await?;
    // The files are the truth: a run listed as superseded whose manifest names it again takes
    // its output back first, and the page is read again with both runs as they are now.
    if state.readopt_restored(&runs).await? {
        runs = store.list_runs(limit + 1, cursor.as_ref()).await?;
    }
    let (runs, next_cursor) =
        crate::error::keyset_page(runs, limit, CursorList::Runs, |r| Cursor {
            at: r.created_at.clone(),
            id: r.run_id.clone(),
        });
    Ok(Json(RunList { runs, next_cursor }))
}

/// One run: its record, manifest, lease holder and caps.
#[utoipa::path(get, path = "/runs/{run_id}", tag = "runs", params(("run_id" = String, Path, description = "Run id")),
    responses((status = 200, body = RunView), (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn get_run(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
) -> ApiResult<Json<RunView>> {
    caller.require(Role::Viewer)?;
    let crate::state::ReadingRun {
        record: run,
        paths,
        section,
    } = state.run_on_disk(&run_id).await?;
    let work_paths = paths.clone();
    let (manifest, extension) = state
        .blocking(move || {
            let manifest = runfiles::read_manifest(&work_paths.manifest);
            let extension = runfiles::budget_inputs(&work_paths).map(|b| b.extension);
            Ok((manifest, extension))
        })
        .await?;
    // Before an adoption below takes the run's lock.
    drop(section);
    let (extension, budget_problem) = match extension {
        Ok(extension) => (Some(extension), None),
        Err(problem) => (None, Some(problem.to_string())),
    };
    let budget = extension.map(|extension| recovery_core::plan::Budget {
        default_cap: state.config.default_max_attempts,
        extension,
    });
    // The files are the truth: a manifest a collector edited since the run was indexed is
    // indexed again, so the record shown (and listed) says what the file says.
    let run = match &manifest {
        recovery_core::verdict::SavedManifest::Read(m)
            if m.run_id == run_id && !recovery_runs::record_matches_manifest(&run, m) =>
        {
            state.registry.adopt(&paths.output).await?.unwrap_or(run)
        }
        _ => run,
    };
    let (manifest_value, problem, saved_cap, effective_cap) = match manifest {
        recovery_core::verdict::SavedManifest::Read(m) => (
            Some(m.to_value()),
            None,
            m.max_rollout_attempts,
            budget.map(|budget| budget.cap(&m)),
        ),
        recovery_core::verdict::SavedManifest::Missing => {
            (None, Some("missing".to_owned()), None, None)
        }
        recovery_core::verdict::SavedManifest::Unreadable(reason) => {
            (None, Some(reason), None, None)
        }
    };
    let now = state.registry.clock().now_text();
    let lease = state
        .registry
        .store()
        .get_lease(&run_id)
        .await?
        .filter(|l| l.expires_at > now)
        .map(|l| lease_holder(&l));
    Ok(Json(RunView {
        run,
        manifest: manifest_value,
        manifest_problem: problem,
        lease,
        saved_cap,
        attempt_extension: extension,
        effective_cap,
        budget_problem,
    }))
}

/// Which of a run's validations to list.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ValidationParams {
    /// At most this many (1-1000, default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
    /// Where the previous page ended (its `next_cursor`): older validations follow.
    #[param(max_length = 400)]
    pub cursor: Option<String>,
}

/// A page of a run's validations, newest first.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ValidationPage {
    pub validations: Vec<ResumeEvent>,
    /// Present when older validations exist: pass it as `cursor` for the next page.
    pub next_cursor: Option<String>,
}

/// Every validation of a run, newest first, whatever its outcome (reuse, drift, refusals,
/// overrides, lease and lock refusals, failures): what it was answered, with the keys, reasons
/// and configuration digests it was recorded with, never values. A run another run replaced
/// keeps its list.
#[utoipa::path(get, path = "/runs/{run_id}/validations", tag = "runs",
    params(("run_id" = String, Path, description = "Run id"), ValidationParams),
    responses((status = 200, body = ValidationPage), (status = 404, body = ApiErrorBody), (status = 422, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn list_validations(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
    ApiQuery(params): ApiQuery<ValidationParams>,
) -> ApiResult<Json<ValidationPage>> {
    caller.require(Role::Viewer)?;
    let limit = crate::error::page_limit(params.limit, 100)?;
    let before = params
        .cursor
        .as_deref()
        .map(|text| crate::routes::query::time_cursor(CursorList::Validations, text))
        .transpose()?;
    // A superseded run is history too: its validations stay readable after a replacement.
    state.known_run(&run_id).await?;
    // One more than the page: a cursor is given only when an older validation exists.
    let validations = state
        .registry
        .store()
        .page_resume_events(&run_id, before.as_ref(), limit + 1)
        .await?;
    let (validations, next_cursor) =
        crate::error::keyset_page(validations, limit, CursorList::Validations, |last| Cursor {
            at: last.at.clone(),
            id: last.event_id.clone(),
        });
    Ok(Json(ValidationPage {
        validations,
        next_cursor,
    }))
}
