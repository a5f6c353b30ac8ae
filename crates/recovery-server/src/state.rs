//! Shared service state and the helpers every handler uses.

use crate::config::ServerConfig;
use crate::error::{ApiError, ApiResult, ErrorCode};
use metrics_exporter_prometheus::PrometheusHandle;
use recovery_runs::{Leases, LockedRun, Registry};
use recovery_sidecar::SidecarPaths;
use recovery_store::RunRecord;
use std::sync::{Arc, OnceLock};

#[derive(Debug, Clone)]
pub struct AppState {
    pub config: Arc<ServerConfig>,
    pub registry: Registry,
    pub leases: Leases,
    pub metrics: PrometheusHandle,
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
    pub async fn check_lease(&self, run_id: &str, presented: Option<&str>) -> ApiResult<()> {
        let now = self.registry.clock().now_text();
        if let Some(lease) = self.registry.store().get_lease(run_id).await?
            && lease.expires_at > now
            && presented != Some(lease.lease_id.as_str())
        {
            return Err(ApiError::new(
                ErrorCode::RunLocked,
                format!("run {run_id} is held by {}", lease.holder),
            )
            .with_details(serde_json::json!({"holder": crate::error::lease_holder(&lease)})));
        }
        Ok(())
    }
}
