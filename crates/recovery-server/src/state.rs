//! Shared service state and the helpers every handler uses.

use crate::config::ServerConfig;
use crate::error::{ApiError, ApiResult, ErrorCode};
use metrics_exporter_prometheus::PrometheusHandle;
use recovery_runs::{Leases, LockedRun, Registry};
use recovery_sidecar::SidecarPaths;
use recovery_store::RunRecord;
use std::sync::{Arc, OnceLock};

/// Request bodies up to this size are parsed on the async worker that received them: reading
/// one costs less than handing it to a blocking thread and back.
pub const INLINE_BODY_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone)]
pub struct AppState {
    pub config: Arc<ServerConfig>,
    pub registry: Registry,
    pub leases: Leases,
    pub metrics: PrometheusHandle,
    /// Bounds batch classification.
    pub heavy: Arc<HeavyWork>,
    /// Bounds plan builds (each reads a run's whole files; a 100k-rollout plan takes seconds
    /// and a gigabyte), separately and more tightly than other heavy work.
    pub plans: Arc<HeavyWork>,
}

/// The bound on heavy blocking work (classifying, planning): a few run at once, a bounded
/// number wait, and beyond that callers are answered 503 `overloaded` with `Retry-After`
/// instead of queueing without end (the async workers and `/healthz` stay free).
#[derive(Debug)]
pub struct HeavyWork {
    running: tokio::sync::Semaphore,
    waiting: std::sync::atomic::AtomicUsize,
    max_waiting: usize,
}

impl HeavyWork {
    /// `running` at once, at most `max_waiting` queued.
    pub fn new(running: usize, max_waiting: usize) -> Self {
        Self {
            running: tokio::sync::Semaphore::new(running.max(1)),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            max_waiting,
        }
    }

    /// Sized for this machine: two per core running, 64 per core waiting.
    pub fn for_this_machine() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new(2 * cores, 64 * cores)
    }

    /// For plan builds: one per core running, four per core waiting.
    pub fn plans_for_this_machine() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new(cores, 4 * cores)
    }

    /// Runs blocking `work` within the bound: waits for a place, or answers 503 `overloaded`
    /// when the queue is full.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> ApiResult<T> + Send + 'static,
    ) -> ApiResult<T> {
        use std::sync::atomic::Ordering;
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::new(
                ErrorCode::Overloaded,
                "the service is saturated with heavy work; retry after the Retry-After seconds",
            ));
        }
        let waiting = Waiting(&self.waiting);
        let _permit = self
            .running
            .acquire()
            .await
            .map_err(|e| ApiError::internal("waiting for a worker", e))?;
        drop(waiting);
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| ApiError::internal("background work", e))?
    }
}

/// Decrements the waiting count however the wait ends (a client that goes away included).
struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The process-wide Prometheus recorder (installed once, shared by every app in the process).
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Another recorder may be installed already (embedding processes): then ours only
            // renders what it sees, which is nothing; the service installs first.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

impl AppState {
    /// A run's record and its companion paths (re-confined: the roots may have changed). A run
    /// whose output another run took over answers `run_superseded`, naming that run.
    pub async fn run(&self, run_id: &str) -> ApiResult<(RunRecord, SidecarPaths)> {
        let run = self
            .registry
            .store()
            .get_run(run_id)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("no run {run_id}")))?;
        if let Some(successor) = &run.superseded_by {
            return Err(ApiError::new(
                ErrorCode::RunSuperseded,
                format!(
                    "run {run_id} was superseded by run {successor}, which now owns its output"
                ),
            )
            .with_details(serde_json::json!({"superseded_by": successor})));
        }
        let paths = self
            .registry
            .paths_for(std::path::Path::new(&run.output_path))?;
        Ok((run, paths))
    }

    /// [`Self::run`] for readers of the run's files: when the manifest at its output names
    /// another run (rewritten outside the service), that run is adopted and this one answered
    /// `run_superseded`, never served another run's data.
    pub async fn run_on_disk(&self, run_id: &str) -> ApiResult<(RunRecord, SidecarPaths)> {
        let (run, paths) = self.run(run_id).await?;
        let manifest = paths.manifest.clone();
        let owner = self
            .blocking(move || {
                Ok(std::fs::read(&manifest).ok().and_then(|bytes| {
                    recovery_core::manifest::RunManifest::from_json_bytes(&bytes)
                        .ok()
                        .map(|m| m.run_id)
                }))
            })
            .await?;
        match owner {
            Some(owner) if owner != run_id => {
                self.registry.adopt(&paths.output).await?;
                Err(ApiError::superseded(run_id, &owner))
            }
            _ => Ok((run, paths)),
        }
    }

    /// A run's record and its critical section (see `recovery_runs::runlock`), refused when the
    /// files show its output belongs to another run now.
    pub async fn locked_run(&self, run_id: &str) -> ApiResult<(RunRecord, LockedRun)> {
        let (run, paths) = self.run(run_id).await?;
        let locked = self.registry.lock(&paths).await?;
        self.registry.check_owner(&locked, run_id).await?;
        Ok((run, locked))
    }

    /// Runs a change to completion even when the client goes away: the journal line, the
    /// manifest and the database rows of one change are never split by a cancelled request.
    pub async fn detached<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = ApiResult<T>> + Send + 'static,
    ) -> ApiResult<T> {
        tokio::spawn(work)
            .await
            .map_err(|e| ApiError::internal("a run change", e))?
    }

    /// Runs blocking file work off the executor.
    pub async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> ApiResult<T> + Send + 'static,
    ) -> ApiResult<T> {
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| ApiError::internal("background file work", e))?
    }

    /// Refuses callers when another client holds a live lease on the run (423 with the holder),
    /// unless they present that lease's id.
    /// A presented lease id that does not hold the run is refused (`lease_not_held`): a collector
    /// whose lease ended is never told it may go on.
    pub async fn check_lease(
        &self,
        paths: &SidecarPaths,
        run_id: &str,
        presented: Option<&str>,
    ) -> ApiResult<()> {
        let lease = self.registry.live_lease(paths, run_id).await?;
        match (lease, presented) {
            (Some(lease), presented) if presented != Some(lease.lease_id.as_str()) => {
                Err(ApiError::new(
                    ErrorCode::RunLocked,
                    format!("run {run_id} is held by {}", lease.holder),
                )
                .with_details(serde_json::json!({"holder": crate::error::lease_holder(&lease)})))
            }
            (None, Some(presented)) => Err(ApiError::new(
                ErrorCode::LeaseNotHeld,
                format!(
                    "lease {presented} does not hold run {run_id} (expired, released or taken over)"
                ),
            )),
            _ => Ok(()),
        }
    }
}
