//! Leases: the service owns each run's lock for as long as a client's lease is live.

use crate::config::{Caller, CollectorCaller, OperatorCaller, Role};
use crate::error::{ApiError, ApiErrorBody, ApiJson, ApiResult, lease_holder};
use crate::state::AppState;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use recovery_runs::{Granted, LeaseRequest};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"holder": "collector-1", "host": "node-7", "pid": 4242, "ttl_seconds": 60}))]
pub struct AcquireRequest {
    /// The client's name (shown to others as the holder; no control characters).
    #[serde(deserialize_with = "crate::limits::name")]
    #[schema(max_length = 256)]
    pub holder: String,
    #[serde(deserialize_with = "crate::limits::name")]
    #[schema(max_length = 256)]
    pub host: String,
    #[schema(minimum = 0)]
    pub pid: i64,
    /// Lease lifetime, renewed by heartbeat (default: the service's).
    #[serde(default, deserialize_with = "crate::limits::opt_saturating_u64")]
    #[schema(minimum = 1)]
    pub ttl_seconds: Option<u64>,
    /// Also lock this checkpoint directory (two outputs never share checkpoints).
    #[serde(default, deserialize_with = "crate::limits::opt_path")]
    #[schema(min_length = 1, max_length = 4096)]
    pub checkpoint_dir: Option<String>,
}

/// A granted lease; `lease_id` is the holder's proof of ownership.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LeaseGranted {
    pub lease_id: String,
    pub run_id: String,
    pub holder: String,
    pub expires_at: String,
}

/// The one answer that tells a lease id: the database keeps only its digest.
fn granted(Granted { lease, lease_id }: &Granted) -> LeaseGranted {
    LeaseGranted {
        lease_id: lease_id.clone(),
        run_id: lease.run_id.clone(),
        holder: lease.holder.clone(),
        expires_at: lease.expires_at.clone(),
    }
}

fn ttl(state: &AppState, seconds: Option<u64>) -> ApiResult<time::Duration> {
    let ttl = seconds.map_or(
        state.config.default_lease_ttl,
        std::time::Duration::from_secs,
    );
    if ttl.is_zero() || ttl > state.config.max_lease_ttl {
        return Err(ApiError::invalid_field(
            "ttl_seconds",
            format!(
                "ttl_seconds: out of range: must be between 1 and {}",
                state.config.max_lease_ttl.as_secs()
            ),
        ));
    }
    Ok(time::Duration::try_from(ttl).unwrap_or(time::Duration::MINUTE))
}

async fn lease_request(
    state: &AppState,
    caller: &Caller,
    run_id: &str,
    request: &AcquireRequest,
) -> ApiResult<LeaseRequest> {
    for (field, value) in [("holder", &request.holder), ("host", &request.host)] {
        if value.trim().is_empty() {
            return Err(ApiError::invalid_field(
                field,
                format!("{field}: must not be empty"),
            ));
        }
    }
    if request.pid < 0 {
        return Err(ApiError::invalid_field("pid", "pid: must not be negative"));
    }
    let (_, paths) = state.run(run_id).await?;
    let mut lock_paths = vec![paths.run_lock.clone()];
    if let Some(dir) = &request.checkpoint_dir {
        // An empty one would resolve to the first root: every run given it would share one
        // checkpoint lock.
        if dir.trim().is_empty() {
            return Err(ApiError::invalid_field(
                "checkpoint_dir",
                "checkpoint_dir: must not be empty",
            ));
        }
        let dir = state
            .registry
            .confinement()
            // Resolved with the lock file's name, so that the directory's own name is checked
            // like every directory of a path.
            .resolve(&std::path::Path::new(dir).join(".collector.lock"))
            .map(|lock| {
                lock.parent()
                    .map(std::path::Path::to_path_buf)
                    .unwrap_or(lock)
            })
            .map_err(|e| {
                ApiError::new(
                    crate::error::ErrorCode::PathRefused,
                    format!("checkpoint_dir: {e}"),
                )
                .with_details(serde_json::json!({"field": "checkpoint_dir"}))
            })?;
        lock_paths.push(recovery_sidecar::paths::checkpoint_lock_path(&dir));
    }
    Ok(LeaseRequest {
        actor: caller.name.clone(),
        run_id: run_id.to_owned(),
        holder: request.holder.clone(),
        host: request.host.clone(),
        pid: request.pid,
        ttl: ttl(state, request.ttl_seconds)?,
        lock_paths,
    })
}

/// Take a run's lease (and with it the run's lock).
#[utoipa::path(post, path = "/runs/{run_id}/lease", tag = "leases", request_body = AcquireRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = LeaseGranted), (status = 423, description = "Held by another client, or locked by another process", body = ApiErrorBody),
        (status = 409, description = "run_superseded, or no_manifest: the run's directory was moved or removed (it is not made again)", body = ApiErrorBody),
        (status = 404, body = ApiErrorBody), (status = 422, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn acquire(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    CollectorCaller(caller): CollectorCaller,
    ApiJson(request): ApiJson<AcquireRequest>,
) -> ApiResult<(StatusCode, Json<LeaseGranted>)> {
    let lease_request = lease_request(&state, &caller, &run_id, &request).await?;
    let lease = state.leases.acquire(&lease_request).await?;
    write_coverage(&state, &run_id).await;
    Ok((StatusCode::CREATED, Json(granted(&lease))))
}

/// The run's coverage snapshot, written as a collector's store opens and closes, under the
/// lease's own lock (before a release: a collector started once the release answered never
/// finds the run's lock taken for it).
async fn write_coverage(state: &AppState, run_id: &str) {
    if let Ok((_, paths)) = state.run(run_id).await {
        write_coverage_of(state, run_id, &paths).await;
    }
}

/// [`write_coverage`] of a run whose paths the caller has.
async fn write_coverage_of(state: &AppState, run_id: &str, paths: &recovery_sidecar::SidecarPaths) {
    match state.registry.lock(paths).await {
        Ok(run) => {
            state
                .registry
                .write_coverage(&run, state.config.default_max_attempts)
                .await;
        }
        Err(e) => tracing::warn!(run_id, error = %e, "the coverage snapshot was not written"),
    }
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    #[serde(deserialize_with = "crate::limits::id")]
    #[schema(min_length = 1, max_length = 256)]
    pub lease_id: String,
    /// New lifetime from now (default: the lifetime the lease was granted or last renewed with).
    #[serde(default, deserialize_with = "crate::limits::opt_saturating_u64")]
    #[schema(minimum = 1)]
    pub ttl_seconds: Option<u64>,
}

/// Renew a live lease.
#[utoipa::path(post, path = "/runs/{run_id}/lease/heartbeat", tag = "leases", request_body = HeartbeatRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 200, body = LeaseGranted), (status = 409, description = "lease_not_held (expired or taken over)", body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn heartbeat(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    _: CollectorCaller,
    ApiJson(request): ApiJson<HeartbeatRequest>,
) -> ApiResult<Json<LeaseGranted>> {
    state.known_run(&run_id).await?;
    if state.leases.shares_database() && !state.leases.holds(&run_id) {
        // Granted by a replica that stopped: taken here first, so its collector goes on.
        crate::adopt_live_leases(&state.registry).await;
    }
    let lease = state
        .leases
        .heartbeat(
            &run_id,
            &request.lease_id,
            // None: the lifetime the lease has.
            request
                .ttl_seconds
                .map(|seconds| ttl(&state, Some(seconds)))
                .transpose()?,
        )
        .await?;
    // The holder's own id, as it presented it.
    Ok(Json(granted(&Granted {
        lease,
        lease_id: request.lease_id,
    })))
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    #[serde(deserialize_with = "crate::limits::id")]
    #[schema(min_length = 1, max_length = 256)]
    pub lease_id: String,
}

/// Release a lease (and the run's lock).
#[utoipa::path(delete, path = "/runs/{run_id}/lease", tag = "leases", request_body = ReleaseRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 204, description = "Released"), (status = 409, description = "lease_not_held", body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn release(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    CollectorCaller(caller): CollectorCaller,
    ApiJson(request): ApiJson<ReleaseRequest>,
) -> ApiResult<StatusCode> {
    state.known_run(&run_id).await?;
    if let Ok((_, paths)) = state.run(&run_id).await
        && state
            .check_lease(&paths, &run_id, Some(&request.lease_id))
            .await
            .is_ok()
    {
        write_coverage_of(&state, &run_id, &paths).await;
    }
    state
        .leases
        .release(&caller.name, &run_id, &request.lease_id)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Who holds a run.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct HolderView {
    pub run_id: String,
    /// The live lease's holder (never its lease id), or null.
    #[schema(value_type = Option<crate::error::LeaseHolder>)]
    pub holder: Option<serde_json::Value>,
    /// No lease, but another process (a Python collector) holds the run's `flock`.
    pub locked_outside_service: bool,
}

/// Who holds a run (without the lease id).
#[utoipa::path(get, path = "/runs/{run_id}/lease", tag = "leases", params(("run_id" = String, Path, description = "Run id")),
    responses((status = 200, body = HolderView, description = "The live holder, or null"), (status = 422, body = ApiErrorBody, description = "The run's lock file is a link, FIFO or directory (path_refused)"), (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn holder(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
) -> ApiResult<Json<HolderView>> {
    caller.require(Role::Viewer)?;
    let (_, paths) = state.run(&run_id).await?;
    // An expired lease of ours is ended (its flock released) before it is reported gone, and a
    // lease whose process is gone (nobody holds the flock) is ended, not reported live.
    let lease = state.registry.live_lease(&paths, &run_id).await?;
    // Without a live lease, the run's flock is looked up: a holder outside the service (a
    // Python collector, another service process without a lease) is reported. The kernel's
    // lock table is read, never the lock taken (a collector starting now must not find it
    // taken by a read); only where that table cannot be read is the lock tried, as before.
    // A lock file that cannot be locked at all (a link, FIFO or directory where it belongs) is
    // refused as a path, as an acquire would be, never reported as another process's lock.
    // A missing lock file is held by nobody, and a read never creates it (nor its directory).
    let externally_locked = match &lease {
        Some(_) => false,
        None => match flock_held_elsewhere(&state, &paths).await? {
            Some(held) => held,
            None => match state.registry.lock(&paths).await {
                Ok(_) => false,
                Err(recovery_runs::RunLockError::Locked(recovery_sidecar::LockError::Owned(_))) => {
                    true
                }
                Err(other) => return Err(other.into()),
            },
        },
    };
    Ok(Json(HolderView {
        run_id,
        holder: lease.as_ref().map(lease_holder),
        locked_outside_service: externally_locked,
    }))
}

/// Whether another process holds the run's `flock` per the kernel's lock table (see
/// [`recovery_sidecar::flock_held_elsewhere`]), off the async workers.
async fn flock_held_elsewhere(
    state: &AppState,
    paths: &recovery_sidecar::SidecarPaths,
) -> ApiResult<Option<bool>> {
    let lock_path = paths.run_lock.clone();
    state
        .blocking(move || {
            recovery_sidecar::flock_held_elsewhere(&lock_path)
                .map_err(|e| recovery_runs::RunLockError::from(e).into())
        })
        .await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TakeoverRequest {
    #[serde(deserialize_with = "crate::limits::name")]
    #[schema(max_length = 256)]
    pub holder: String,
    #[serde(deserialize_with = "crate::limits::name")]
    #[schema(max_length = 256)]
    pub host: String,
    #[schema(minimum = 0)]
    pub pid: i64,
    #[serde(default, deserialize_with = "crate::limits::opt_saturating_u64")]
    #[schema(minimum = 1)]
    pub ttl_seconds: Option<u64>,
    #[serde(deserialize_with = "crate::limits::text")]
    #[schema(max_length = 4096)]
    pub reason: String,
}

/// Take a run over for a new holder, ending the current lease at once (operator, audited).
#[utoipa::path(post, path = "/runs/{run_id}/lease/takeover", tag = "leases", request_body = TakeoverRequest,
    params(("run_id" = String, Path, description = "Run id")),
    responses((status = 201, body = LeaseGranted), (status = 423, description = "Another process holds the lock", body = ApiErrorBody),
        (status = 409, description = "run_superseded, or no_manifest: the run's directory was moved or removed (it is not made again)", body = ApiErrorBody),
        (status = 403, body = ApiErrorBody), (status = 404, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn takeover(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    OperatorCaller(caller): OperatorCaller,
    ApiJson(request): ApiJson<TakeoverRequest>,
) -> ApiResult<(StatusCode, Json<LeaseGranted>)> {
    if request.reason.trim().is_empty() {
        return Err(ApiError::invalid_field(
            "reason",
            "reason: say why the run is taken over",
        ));
    }
    let acquire = AcquireRequest {
        holder: request.holder.clone(),
        host: request.host.clone(),
        pid: request.pid,
        ttl_seconds: request.ttl_seconds,
        checkpoint_dir: None,
    };
    let lease_request = lease_request(&state, &caller, &run_id, &acquire).await?;
    // The lease manager audits the takeover, with the previous holder and the reason.
    let (lease, _previous) = state
        .leases
        .takeover(&caller.name, &request.reason, &lease_request)
        .await?;
    write_coverage(&state, &run_id).await;
    Ok((StatusCode::CREATED, Json(granted(&lease))))
}
