//! Runs: create a run's manifest, validate a resume, read runs.

use crate::config::{Caller, Role};
use crate::error::{ApiError, ApiErrorBody, ApiJson, ApiQuery, ApiResult, ErrorCode, lease_holder};
use crate::runfiles;
use crate::state::AppState;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use recovery_core::canonical::sha256_reader;
use recovery_core::identity::{ConfigBundle, ConfigurationIdentity, RowReferences};
use recovery_core::manifest::RunManifest;
use recovery_core::verdict::{CurrentRun, Mismatch, ResumeVerdict, validate_resume};
use recovery_runs::LockedRun;
use recovery_sidecar::SidecarPaths;
use recovery_store::{Cursor, ResumeEvent, RunRecord};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use utoipa::{IntoParams, ToSchema};

/// A configuration bundle as a collector sends it (interpolations unresolved).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRunRequest {
    /// Output JSONL path (under the service's roots).
    pub output_path: String,
    /// The source dataset file (its bytes give `source_digest`).
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
    /// The run's attempt cap (default: the service's).
    #[serde(default)]
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

fn identity_error(error: recovery_core::identity::IdentityError) -> ApiError {
    ApiError::new(ErrorCode::IdentityError, error.to_string())
        .with_details(serde_json::json!({"kind": error.kind()}))
}

fn confined_file(state: &AppState, path: &str, field: &str) -> ApiResult<std::path::PathBuf> {
    let resolved = state
        .registry
        .confinement()
        .resolve(std::path::Path::new(path))
        .map_err(|e| ApiError::new(ErrorCode::PathRefused, format!("{field}: {e}")))?;
    if !resolved.is_file() {
        return Err(ApiError::invalid(format!(
            "{field}: {} is not a readable file",
            resolved.display()
        )));
    }
    Ok(resolved)
}

fn file_sha256(path: &std::path::Path) -> ApiResult<String> {
    let file = std::fs::File::open(path).map_err(|e| {
        ApiError::invalid(format!("source_path: cannot read {}: {e}", path.display()))
    })?;
    sha256_reader(file)
        .map_err(|e| ApiError::invalid(format!("source_path: cannot read {}: {e}", path.display())))
}

/// The companions a replacement moves aside (never deletes).
fn movable(paths: &SidecarPaths) -> [&PathBuf; 11] {
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
        &paths.aggregate_metrics,
    ]
}

/// Moves every existing companion aside under one suffix that no existing file carries
/// (`.replaced-<unix seconds>`, then `-2`, `-3`, ...), so a saved result is never overwritten.
/// Returns the (from, to) pairs moved; on error, what was moved is moved back.
fn move_aside(paths: &SidecarPaths, seconds: i64) -> std::io::Result<Vec<(PathBuf, PathBuf)>> {
    let target = |path: &FsPath, suffix: &str| PathBuf::from(format!("{}{suffix}", path.display()));
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
    let mut moved = Vec::new();
    for path in movable(paths).into_iter().filter(|p| p.exists()) {
        let to = target(path, &suffix);
        if let Err(e) = std::fs::rename(path, &to) {
            move_back(&moved);
            return Err(e);
        }
        moved.push((path.clone(), to));
    }
    Ok(moved)
}

/// Undoes [`move_aside`] (best effort: every move that can be undone is).
fn move_back(moved: &[(PathBuf, PathBuf)]) {
    for (from, to) in moved.iter().rev() {
        let _ = std::fs::remove_file(from);
        let _ = std::fs::rename(to, from);
    }
}

fn non_empty(path: &FsPath) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.len() > 0)
}

/// Refuses inventories the planner would refuse later (duplicate or malformed logical ids,
/// indices that are not integers), naming the row.
fn check_inventory<'a>(rows: impl IntoIterator<Item = &'a Value>) -> ApiResult<()> {
    use recovery_core::rows::{ROLLOUT_INDEX_KEY, TASK_INDEX_KEY};
    let mut seen = std::collections::HashMap::new();
    for (i, row) in rows.into_iter().enumerate() {
        if !row.is_object() {
            return Err(ApiError::invalid(format!(
                "rows[{i}]: must be a JSON object"
            )));
        }
        for key in [TASK_INDEX_KEY, ROLLOUT_INDEX_KEY] {
            if row
                .get(key)
                .is_some_and(|v| recovery_core::rows::index(Some(v)).is_none())
            {
                return Err(ApiError::invalid(format!(
                    "rows[{i}].{key}: must be an integer"
                )));
            }
        }
        let id = recovery_core::rows::logical_rollout_id(row)
            .map_err(|e| ApiError::invalid(format!("rows[{i}]: {e}")))?;
        if let Some(first) = seen.insert(id.clone(), i) {
            return Err(ApiError::invalid(format!(
                "rows[{i}]: logical rollout id {id} repeats rows[{first}]"
            )));
        }
    }
    Ok(())
}

fn path_refused(why: String) -> ApiError {
    ApiError::new(ErrorCode::PathRefused, format!("output_path: {why}"))
}

/// Refuses an output that would share files with the dataset or another run: a directory, the
/// source itself, a companion of a run beside it, or an output whose companions are another
/// run's output.
async fn check_output(state: &AppState, paths: &SidecarPaths, source: &FsPath) -> ApiResult<()> {
    if paths.output.is_dir() {
        return Err(path_refused(format!(
            "{} is a directory",
            paths.output.display()
        )));
    }
    if paths.output == source {
        return Err(path_refused("is the source dataset itself".into()));
    }
    let name = paths
        .output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let directory = paths
        .output
        .parent()
        .map(FsPath::to_owned)
        .unwrap_or_default();
    for suffix in recovery_sidecar::paths::COMPANION_SUFFIXES {
        let Some(stem) = name.strip_suffix(suffix).filter(|s| !s.is_empty()) else {
            continue;
        };
        if directory.join(format!("{stem}_manifest.json")).exists() {
            return Err(path_refused(format!(
                "{name} is a companion file of the run at {stem}.*"
            )));
        }
    }
    for companion in movable(paths).into_iter().filter(|p| **p != paths.output) {
        let recorded = state
            .registry
            .store()
            .find_run_by_output(&companion.display().to_string())
            .await?;
        if SidecarPaths::for_output(companion).manifest.exists() || recorded.is_some() {
            return Err(path_refused(format!(
                "its companion {} is another run's output",
                companion.display()
            )));
        }
    }
    Ok(())
}

/// What a create validated before it takes the run's lock (nothing is written before).
struct PreparedRun {
    manifest: RunManifest,
    identity: ConfigurationIdentity,
    /// The materialized rows to publish, when they were sent.
    materialized: Option<Vec<u8>>,
}

/// The rows to publish, their digest and their server references, checked as the planner will.
fn prepare_rows(
    rows: Option<&Vec<Value>>,
    paths: &SidecarPaths,
) -> ApiResult<(Option<Vec<u8>>, String, RowReferences)> {
    let rows_invalid = |e: String| ApiError::new(ErrorCode::RowsInvalid, e);
    if let Some(rows) = rows {
        check_inventory(rows)?;
        let mut text = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            text.extend(
                serde_json::to_vec(row)
                    .map_err(|e| ApiError::invalid(format!("rows[{i}]: {e}")))?,
            );
            text.push(b'\n');
        }
        let digest = recovery_core::materialized::materialized_digest(text.as_slice(), 1)
            .map_err(|e| ApiError::invalid(format!("rows: {e}")))?
            .sha256;
        return Ok((Some(text), digest, RowReferences::from_rows(rows)));
    }
    if !paths.materialized.is_file() {
        return Err(ApiError::invalid(format!(
            "rows: send the materialized rows, or write {} first",
            paths.materialized.display()
        )));
    }
    let name = paths.materialized.display().to_string();
    let file = std::fs::File::open(&paths.materialized)
        .map_err(|e| rows_invalid(format!("{name}: {e}")))?;
    let (rows, _) =
        recovery_core::rows::read_jsonl(file, &name).map_err(|e| rows_invalid(e.to_string()))?;
    let values: Vec<Value> = rows.into_iter().map(|r| r.value).collect();
    check_inventory(&values)?;
    let digest = runfiles::digest_rows_file(&paths.materialized).map_err(rows_invalid)?;
    Ok((None, digest, RowReferences::from_rows(&values)))
}

fn prepare_run(
    request: &CreateRunRequest,
    paths: &SidecarPaths,
    source: &FsPath,
    default_cap: u64,
) -> ApiResult<PreparedRun> {
    let (materialized, digest, references) = prepare_rows(request.rows.as_ref(), paths)?;
    let identity = ConfigurationIdentity::compute(ConfigBundle {
        config: &request.config,
        global_config: &request.global_config,
        rows: &references,
        environment: &request.environment,
    })
    .map_err(identity_error)?;
    let mut manifest = RunManifest::create(
        recovery_sidecar::new_id(),
        file_sha256(source)?,
        digest,
        identity.config_digest.clone(),
        Some(request.max_rollout_attempts.unwrap_or(default_cap)),
    );
    manifest.retry_terminal_timeouts = request.retry_terminal_timeouts
        || request
            .config
            .get("retry_terminal_timeouts")
            .and_then(Value::as_bool)
            == Some(true);
    Ok(PreparedRun {
        manifest,
        identity,
        materialized,
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
    prepared: &PreparedRun,
    replace: bool,
    seconds: i64,
) -> ApiResult<Existing> {
    let exists = paths.manifest.exists();
    if exists && !replace {
        return Ok(Existing::Run);
    }
    if !exists && !replace && (non_empty(&paths.output) || non_empty(&paths.failures)) {
        return Err(ApiError::new(
            ErrorCode::RunExists,
            format!(
                "{} holds saved outcomes without a manifest (an incomplete legacy cache): it is never started fresh silently",
                paths.output.display()
            ),
        ));
    }
    let moved = if replace {
        move_aside(paths, seconds).map_err(|e| ApiError::internal("moving the old run aside", e))?
    } else {
        Vec::new()
    };
    let publish = || -> std::io::Result<()> {
        if let Some(parent) = paths.output.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let rows = match (
            &prepared.materialized,
            moved.iter().find(|(from, _)| *from == paths.materialized),
        ) {
            (Some(text), _) => Some(text.clone()),
            // The replaced run's rows stay the new run's inputs.
            (None, Some((_, aside))) => Some(std::fs::read(aside)?),
            (None, None) => None,
        };
        if let Some(rows) = rows {
            recovery_sidecar::atomic_write(&paths.materialized, &rows, None)?;
        }
        // A fresh start: stale derived files go, empty outcome files are created.
        for stale in [
            &paths.draft_journal,
            &paths.coverage,
            &paths.aggregate_metrics,
        ] {
            let _ = std::fs::remove_file(stale);
        }
        for outcome in [&paths.output, &paths.failures] {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(outcome)?;
        }
        Ok(())
    };
    match publish() {
        Ok(()) if moved.is_empty() => Ok(Existing::Fresh),
        Ok(()) => Ok(Existing::Replaced(moved)),
        Err(e) => {
            move_back(&moved);
            Err(ApiError::internal("publishing the run's files", e))
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
    caller: Caller,
    ApiJson(request): ApiJson<CreateRunRequest>,
) -> ApiResult<(StatusCode, Json<RunCreated>)> {
    caller.require(Role::Collector)?;
    if request.replace {
        caller.require(Role::Operator)?;
    }
    if request.max_rollout_attempts == Some(0) {
        return Err(ApiError::invalid(
            "max_rollout_attempts: must be at least 1",
        ));
    }
    let paths = state
        .registry
        .paths_for(FsPath::new(&request.output_path))?;
    let source = confined_file(&state, &request.source_path, "source_path")?;
    check_output(&state, &paths, &source).await?;
    let default_cap = state.config.default_max_attempts;
    let replace = request.replace;
    let (work_paths, work_source) = (paths.clone(), source.clone());
    // Everything that can refuse the request is checked before anything is written.
    let prepared = state
        .blocking(move || prepare_run(&request, &work_paths, &work_source, default_cap))
        .await?;
    let run = state.registry.lock(&paths).await?;
    let work = state.clone();
    let (prepared, replaced) = state
        .detached(async move { create_locked(&work, &caller, &run, prepared, replace).await })
        .await?;
    let (manifest, identity) = (&prepared.manifest, &prepared.identity);
    metrics::counter!("rollout_recovery_runs_created_total").increment(1);
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
            replaced,
        }),
    ))
}

/// The locked part of a create: publish the files, then the manifest; on failure the previous
/// state stands.
async fn create_locked(
    state: &AppState,
    caller: &Caller,
    run: &LockedRun,
    prepared: PreparedRun,
    replace: bool,
) -> ApiResult<(PreparedRun, Vec<String>)> {
    let paths = run.paths().clone();
    let seconds = state.registry.clock().now().unix_timestamp();
    let prepared = Arc::new(prepared);
    let (work_paths, work_prepared) = (paths.clone(), prepared.clone());
    let existing = state
        .blocking(move || publish_files(&work_paths, &work_prepared, replace, seconds))
        .await?;
    let moved = match existing {
        Existing::Run => {
            // The files hold a run: adopt it, so the id this answer names resolves.
            let adopted = state.registry.adopt_locked(run).await?;
            return Err(ApiError::new(ErrorCode::RunExists, format!("{} already has a manifest: resume it with validate, or replace it as an operator", paths.output.display()))
                .with_details(serde_json::json!({"run_id": adopted.map(|r| r.run_id)})));
        }
        Existing::Fresh => Vec::new(),
        Existing::Replaced(moved) => moved,
    };
    let written = state
        .registry
        .write_manifest(run, &prepared.manifest, Some(&prepared.identity.identity))
        .await;
    if let Err(e) = written {
        let published_rows = prepared.materialized.is_some() || !moved.is_empty();
        let undo = moved.clone();
        state
            .blocking(move || {
                unpublish(&paths, published_rows, &undo);
                Ok(())
            })
            .await?;
        return Err(e.into());
    }
    let replaced: Vec<String> = moved
        .iter()
        .map(|(_, to)| to.display().to_string())
        .collect();
    if !replaced.is_empty() {
        audit(
            state,
            caller,
            "run.replace",
            Some(&prepared.manifest.run_id),
            serde_json::json!({"moved": replaced}),
        )
        .await?;
    }
    let prepared = Arc::try_unwrap(prepared)
        .map_err(|_| ApiError::internal("a run change", "the prepared run is still shared"))?;
    Ok((prepared, replaced))
}

pub(crate) async fn audit(
    state: &AppState,
    caller: &Caller,
    action: &str,
    run_id: Option<&str>,
    details: Value,
) -> ApiResult<()> {
    state
        .registry
        .store()
        .insert_audit(&recovery_store::AuditEntry {
            audit_id: recovery_sidecar::new_id(),
            at: state.registry.clock().now_text(),
            actor: caller.name.clone(),
            action: action.to_owned(),
            run_id: run_id.map(str::to_owned),
            details,
        })
        .await?;
    Ok(())
}

/// A collector's pre-flight before (re)starting a run.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ValidateRequest {
    #[schema(value_type = Object)]
    pub config: Value,
    #[schema(value_type = Object)]
    pub global_config: Value,
    #[serde(default)]
    pub environment: BTreeMap<String, String>,
    /// The source dataset as the collector will read it now.
    pub source_path: String,
    /// The rows the collector materialized now; when absent the saved ones are taken as current.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub rows: Option<Vec<Value>>,
    /// Accept a mismatching identity (sticky: every later resume needs it too).
    #[serde(default)]
    pub allow_unsafe: bool,
    /// The caller's lease on the run, when it holds one.
    #[serde(default)]
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
    pub drift_event_id: Option<String>,
    pub config_digest: String,
    #[schema(value_type = Option<Object>)]
    pub manifest: Option<Value>,
}

fn mismatch_details(mismatches: &[Mismatch]) -> Value {
    let semantic: Vec<Value> = mismatches
        .iter()
        .filter_map(|m| match m {
            Mismatch::SemanticConfiguration(keys) => Some(keys),
            _ => None,
        })
        .flatten()
        .map(|k| serde_json::json!({"key": k.key, "reason": format!("{:?}", k.class)}))
        .collect();
    serde_json::json!({"mismatches": mismatches.iter().map(Mismatch::code).collect::<Vec<_>>(), "semantic_keys": semantic})
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
    caller: Caller,
    ApiJson(request): ApiJson<ValidateRequest>,
) -> ApiResult<Json<ValidateResponse>> {
    caller.require(Role::Collector)?;
    let (run, paths) = state.run(&run_id).await?;
    let mut event = ResumeEvent {
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
        client: Some(caller.name.clone()),
    };
    let work = state.clone();
    // Detached: a journal line and its rows are never split by a client that goes away.
    state
        .detached(async move {
            let state = work;
            let result = validate_inner(&state, &paths, &request, &mut event).await;
            if let Err(error) = &result {
                event.outcome = match error.code {
                    ErrorCode::ResumeRefused => "refused",
                    ErrorCode::NoManifest => "no_manifest",
                    ErrorCode::ManifestUnreadable => "unreadable",
                    ErrorCode::RunLocked => "locked",
                    ErrorCode::RunSuperseded => "superseded",
                    _ => "invalid",
                }
                .into();
                event.message = error.message.clone();
            }
            state.registry.store().insert_resume_event(&event).await?;
            metrics::counter!("rollout_recovery_validations_total", "outcome" => event.outcome.clone())
                .increment(1);
            result
        })
        .await
        .map(Json)
}

async fn validate_inner(
    state: &AppState,
    paths: &SidecarPaths,
    request: &ValidateRequest,
    event: &mut ResumeEvent,
) -> ApiResult<ValidateResponse> {
    let run_id = event.run_id.clone().unwrap_or_default();
    state
        .check_lease(&run_id, request.lease_id.as_deref())
        .await?;
    let source = confined_file(state, &request.source_path, "source_path")?;
    // The verdict is read and acted on inside the run's critical section: a manifest rewrite or
    // a journal line never races another writer, and is refused while another process owns it.
    let run = state.registry.lock(paths).await?;
    state.still_owns_output(&run_id, &run).await?;
    let (work_paths, work_request) = (paths.clone(), request.clone());
    let (saved, current) = state
        .blocking(move || {
            let saved = runfiles::read_saved_run(&work_paths);
            let current_rows = match &work_request.rows {
                Some(rows) => {
                    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
                    let digest =
                        recovery_core::materialized::materialized_digest(text.as_bytes(), 1)
                            .map_err(|e| ApiError::invalid(format!("rows: {e}")))?
                            .sha256;
                    Some((digest, RowReferences::from_rows(rows)))
                }
                None => None,
            };
            let (materialized_digest, references) = match current_rows {
                Some(current) => current,
                None => {
                    let references =
                        runfiles::row_references(&work_paths.materialized).unwrap_or_default();
                    (saved.materialized.clone().unwrap_or_default(), references)
                }
            };
            let identity = ConfigurationIdentity::compute(ConfigBundle {
                config: &work_request.config,
                global_config: &work_request.global_config,
                rows: &references,
                environment: &work_request.environment,
            });
            let current = match identity {
                Ok(config) => Some(CurrentRun {
                    source_digest: file_sha256(&source)?,
                    materialized_digest,
                    config,
                }),
                // Like the collector: without allow_unsafe a configuration error propagates.
                Err(e) if !work_request.allow_unsafe => return Err(identity_error(e)),
                Err(_) => None,
            };
            Ok((saved, current))
        })
        .await?;
    event.current_config_digest = current.as_ref().map(|c| c.config.config_digest.clone());
    let config_digest = event.current_config_digest.clone().unwrap_or_default();
    match validate_resume(
        &saved,
        current.as_ref(),
        request.allow_unsafe,
        &state.config.drift_policy,
    ) {
        ResumeVerdict::Reuse { manifest } => {
            event.outcome = "reuse".into();
            Ok(ValidateResponse {
                outcome: "reuse".into(),
                run_id,
                message: None,
                operational_keys: vec![],
                drift_event_id: None,
                config_digest,
                manifest: Some(manifest.to_value()),
            })
        }
        ResumeVerdict::ResumeWithDrift {
            manifest,
            operational_keys,
        } => {
            let drift = state
                .registry
                .record_drift(&run, &manifest, &config_digest, &operational_keys)
                .await?;
            event.outcome = "resume_with_drift".into();
            event.operational_keys = operational_keys.clone();
            let message = format!(
                "Resuming across operational configuration drift: {}.",
                operational_keys.join(", ")
            );
            tracing::warn!(run_id = %run_id, keys = ?operational_keys, "resume across operational drift");
            Ok(ValidateResponse {
                outcome: "resume_with_drift".into(),
                run_id,
                message: Some(message),
                operational_keys,
                drift_event_id: Some(drift.event_id),
                config_digest,
                manifest: Some(manifest.to_value()),
            })
        }
        ResumeVerdict::Refused {
            message,
            mismatches,
        } => {
            event.reasons = mismatches.iter().map(|m| m.code().to_owned()).collect();
            event.semantic_keys = mismatches
                .iter()
                .filter_map(|m| match m {
                    Mismatch::SemanticConfiguration(keys) => {
                        Some(keys.iter().map(|k| k.key.clone()))
                    }
                    _ => None,
                })
                .flatten()
                .collect();
            Err(ApiError::new(ErrorCode::ResumeRefused, message)
                .with_details(mismatch_details(&mismatches)))
        }
        ResumeVerdict::NoManifest { message } => Err(ApiError::new(ErrorCode::NoManifest, message)),
        ResumeVerdict::Unreadable { message } => {
            Err(ApiError::new(ErrorCode::ManifestUnreadable, message))
        }
        ResumeVerdict::Overridden {
            manifest,
            message,
            mismatches,
        } => {
            state.registry.write_manifest(&run, &manifest, None).await?;
            event.outcome = "overridden".into();
            event.message = message.clone();
            event.reasons = mismatches.iter().map(|m| m.code().to_owned()).collect();
            tracing::warn!(run_id = %run_id, "resume accepted with allow_unsafe: identity overridden");
            Ok(ValidateResponse {
                outcome: "overridden".into(),
                run_id,
                message: Some(message),
                operational_keys: vec![],
                drift_event_id: None,
                config_digest,
                manifest: Some(manifest.to_value()),
            })
        }
        ResumeVerdict::ImportLegacy { message } => {
            event.outcome = "import_legacy".into();
            event.message = message.clone();
            Ok(ValidateResponse {
                outcome: "import_legacy".into(),
                run_id,
                message: Some(message),
                operational_keys: vec![],
                drift_event_id: None,
                config_digest,
                manifest: None,
            })
        }
    }
}

/// A run as dashboards see it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RunView {
    #[schema(value_type = Object)]
    pub run: RunRecord,
    /// The manifest on disk (null when missing or unreadable).
    #[schema(value_type = Option<Object>)]
    pub manifest: Option<Value>,
    pub manifest_problem: Option<String>,
    /// The live lease holder, if any (without the lease id).
    #[schema(value_type = Option<Object>)]
    pub lease: Option<Value>,
    pub saved_cap: Option<u64>,
    pub attempt_extension: Option<u64>,
    /// Saved cap (or the service default) plus the extension.
    pub effective_cap: Option<u64>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RunList {
    #[schema(value_type = Vec<Object>)]
    pub runs: Vec<RunRecord>,
    /// Pass as `cursor` for the next page.
    pub next_cursor: Option<String>,
}

#[derive(Debug, Clone, Deserialize, IntoParams)]
pub struct ListParams {
    /// At most this many (1-1000, default 100).
    pub limit: Option<u32>,
    pub cursor: Option<String>,
    /// Find the run recorded for this output path.
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
        let resolved = state
            .registry
            .confinement()
            .resolve(std::path::Path::new(&output))
            .map_err(|e| ApiError::new(ErrorCode::PathRefused, e.to_string()))?;
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
        Some(text) => Some(
            Cursor::decode(text)
                .ok_or_else(|| ApiError::invalid("cursor: not a cursor this service issued"))?,
        ),
        None => None,
    };
    let limit = params.limit.unwrap_or(100).clamp(1, 1000);
    let runs = state
        .registry
        .store()
        .list_runs(limit, cursor.as_ref())
        .await?;
    let next_cursor = (runs.len() as u32 == limit)
        .then(|| {
            runs.last().map(|r| {
                Cursor {
                    at: r.created_at.clone(),
                    id: r.run_id.clone(),
                }
                .encode()
            })
        })
        .flatten();
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
    let (run, paths) = state.run(&run_id).await?;
    let work_paths = paths.clone();
    let (manifest, extension) = state
        .blocking(move || {
            let manifest = runfiles::read_manifest(&work_paths.manifest);
            let extension = runfiles::budget_inputs(&work_paths).ok().map(|(e, _, _)| e);
            Ok((manifest, extension))
        })
        .await?;
    let (manifest_value, problem, saved_cap) = match manifest {
        recovery_core::verdict::SavedManifest::Read(m) => {
            (Some(m.to_value()), None, m.max_rollout_attempts)
        }
        recovery_core::verdict::SavedManifest::Missing => (None, Some("missing".to_owned()), None),
        recovery_core::verdict::SavedManifest::Unreadable(reason) => (None, Some(reason), None),
    };
    let now = state.registry.clock().now_text();
    let lease = state
        .registry
        .store()
        .get_lease(&run_id)
        .await?
        .filter(|l| l.expires_at > now)
        .map(|l| lease_holder(&l));
    let effective_cap = manifest_value
        .as_ref()
        .map(|_| saved_cap.unwrap_or(state.config.default_max_attempts) + extension.unwrap_or(0));
    Ok(Json(RunView {
        run,
        manifest: manifest_value,
        manifest_problem: problem,
        lease,
        saved_cap,
        attempt_extension: extension,
        effective_cap,
    }))
}
