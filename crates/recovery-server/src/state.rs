//! Shared service state and the helpers every handler uses.

use crate::config::ServerConfig;
use crate::error::{ApiError, ApiResult, ErrorCode};
use metrics_exporter_prometheus::PrometheusHandle;
use recovery_runs::{Leases, LockedRun, Registry};
use recovery_sidecar::SidecarPaths;
use recovery_store::RunRecord;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// Request bodies up to this size are parsed on the async worker that received them: reading
/// one costs less than handing it to a blocking thread and back.
pub const INLINE_BODY_BYTES: usize = 64 * 1024;

/// What every handler shares, behind one reference count: axum clones the state for each
/// request, and cloning the parts (two dozen reference counts, the confinement roots, the
/// replica name) showed in profiles of validate under load (2.4% of its CPU).
#[derive(Debug, Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }

    /// This state with other bounds on heavy work (tests that fill its queue).
    pub fn with_heavy_work(&self, heavy: Arc<HeavyWork>) -> Self {
        let mut shared = (*self.0).clone();
        shared.heavy = heavy;
        Self::new(shared)
    }

    /// Whether start-up is done (the sidecars reindexed, live leases taken again): until then
    /// only `/healthz`, `/readyz`, `/metrics` and `/openapi.json` are answered.
    pub fn is_ready(&self) -> bool {
        self.ready.done.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Declares start-up done (every waiter of [`Self::until_ready`] wakes).
    pub fn mark_ready(&self) {
        self.ready
            .done
            .store(true, std::sync::atomic::Ordering::Release);
        self.ready.changed.notify_waiters();
    }

    /// Resolves once start-up is done.
    pub async fn until_ready(&self) {
        loop {
            // Made before the check: a `notify_waiters` after it wakes it even if not yet polled.
            let changed = self.ready.changed.notified();
            if self.is_ready() {
                return;
            }
            changed.await;
        }
    }
}

/// Whether start-up is done: a flag every request reads (one atomic load, no lock shared by
/// the cores), and a wake-up for the few that wait for it.
#[derive(Debug, Default)]
pub struct Readiness {
    done: std::sync::atomic::AtomicBool,
    changed: tokio::sync::Notify,
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The parts of [`AppState`].
#[derive(Debug, Clone)]
pub struct Shared {
    pub config: Arc<ServerConfig>,
    pub registry: Registry,
    pub leases: Leases,
    pub metrics: PrometheusHandle,
    /// Bounds batch classification.
    pub heavy: Arc<HeavyWork>,
    /// Bounds plan builds (each reads a run's whole files; a 100k-rollout plan takes seconds
    /// and a gigabyte), separately and more tightly than other heavy work.
    pub plans: Arc<HeavyWork>,
    /// Start-up done ([`AppState::is_ready`]).
    pub ready: Arc<Readiness>,
}

/// Heavy blocking work (classifying batches, building plans) on threads of its own that run at
/// a lower scheduling priority (nice +10) than the threads serving requests, so `/healthz` and
/// cheap calls keep their latency while the cores are busy with batches. A few run at once, a
/// bounded number wait, and beyond that callers are answered 503 `overloaded` with
/// `Retry-After` instead of queueing without end.
///
/// Cancellation: a caller that goes away (its client disconnected, or the request timed out)
/// drops its [`Cancel`] guard; queued work that finds itself cancelled never starts, and work
/// that checks [`Cancel::is_cancelled`] stops early.
#[derive(Debug)]
pub struct HeavyWork {
    queue: std::sync::mpsc::SyncSender<Job>,
}

type Job = Box<dyn FnOnce() + Send>;

/// What a heavy-work thread calls when it finds nothing queued (see [`when_heavy_work_idles`]).
static WHEN_IDLE: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Sets what a heavy-work thread calls when it finds nothing queued, before it waits: the
/// binary gives the allocator's unused memory back there (measured after the classify load:
/// RSS stayed at the peak otherwise). Set once, before the service starts; later calls are
/// ignored.
pub fn when_heavy_work_idles(give_back: fn()) {
    let _ = WHEN_IDLE.set(give_back);
}

/// Set once the caller of a piece of heavy work is gone.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<std::sync::atomic::AtomicBool>);

impl Cancel {
    pub fn is_cancelled(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Cancels its work when dropped (the caller's future went away, or completed).
struct CancelOnDrop(Cancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        (self.0).0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl HeavyWork {
    /// `running` threads named `name-N`, at most `max_waiting` jobs queued.
    pub fn new(name: &str, running: usize, max_waiting: usize) -> Self {
        let (queue, jobs) = std::sync::mpsc::sync_channel::<Job>(max_waiting);
        let jobs = Arc::new(std::sync::Mutex::new(jobs));
        for n in 0..running.max(1) {
            let jobs = jobs.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{n}"))
                .stack_size(crate::THREAD_STACK_BYTES)
                .spawn(move || {
                    // Lowering one's own priority is always allowed; failing to is harmless.
                    let _ =
                        rustix::process::setpriority_process(Some(rustix::thread::gettid()), 10);
                    let queue = || {
                        jobs.lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                    };
                    loop {
                        let next = queue().try_recv();
                        let job = match next {
                            Ok(job) => job,
                            Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                            Err(std::sync::mpsc::TryRecvError::Empty) => {
                                // Nothing queued: what this thread's last jobs freed goes back
                                // before it waits (these threads never end, so it would not).
                                if let Some(give_back) = WHEN_IDLE.get() {
                                    give_back();
                                }
                                match queue().recv() {
                                    Ok(job) => job,
                                    Err(_) => return,
                                }
                            }
                        };
                        job();
                    }
                });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start a heavy-work thread");
            }
        }
        Self { queue }
    }

    /// Sized for this machine: two per core running, 64 per core waiting.
    pub fn for_this_machine() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new("heavy", 2 * cores, 64 * cores)
    }

    /// For plan builds: one per core running, four per core waiting.
    pub fn plans_for_this_machine() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new("plans", cores, 4 * cores)
    }

    /// Runs `work` on a heavy-work thread: queued, or answered 503 `overloaded` when the queue
    /// is full; cancelled when this future is dropped.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Cancel) -> ApiResult<T> + Send + 'static,
    ) -> ApiResult<T> {
        let cancel = Cancel::default();
        let _cancel_on_drop = CancelOnDrop(cancel.clone());
        let (answer, answered) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            if cancel.is_cancelled() {
                return;
            }
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(&cancel)))
                .unwrap_or_else(|_| Err(ApiError::internal("heavy work", "it panicked")));
            let _ = answer.send(result);
        });
        match self.queue.try_send(job) {
            Ok(()) => {}
            Err(std::sync::mpsc::TrySendError::Full(_)) => {
                return Err(ApiError::new(
                    ErrorCode::Overloaded,
                    "the service is saturated with heavy work; retry after the Retry-After seconds",
                ));
            }
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {
                return Err(ApiError::internal(
                    "heavy work",
                    "no heavy-work thread runs",
                ));
            }
        }
        answered
            .await
            .map_err(|e| ApiError::internal("heavy work", e))?
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
    /// Refuses (404) a run id the service does not know; a superseded run is known (its lease
    /// can still be renewed and released).
    pub async fn known_run(&self, run_id: &str) -> ApiResult<()> {
        match self.registry.store().get_run(run_id).await? {
            Some(_) => Ok(()),
            None => Err(ApiError::not_found(format!("no run {run_id}"))),
        }
    }

    pub async fn run(&self, run_id: &str) -> ApiResult<(RunRecord, SidecarPaths)> {
        let run = self.record(run_id).await?;
        if let Some(successor) = &run.superseded_by {
            // The files are the truth: a run whose manifest names it again (restored, or a
            // takeover by hand undone) takes its output back, indexed from its files and looked
            // up anew (hostile review 45: it answered `run_superseded` until something re-read
            // its files). Only once: an adoption that leaves it superseded (taken over again
            // meanwhile, or refused) answers so.
            if let Ok(paths) = self.registry.paths_for(Path::new(&run.output_path))
                && self.owner_on_disk(&paths).await?.as_deref() == Some(run_id)
            {
                self.registry.adopt(&paths.output).await?;
                let run = self.record(run_id).await?;
                return match &run.superseded_by {
                    Some(successor) => Err(self.superseded(run_id, successor).await?),
                    None => {
                        let paths = self.registry.paths_for(Path::new(&run.output_path))?;
                        Ok((run, paths))
                    }
                };
            }
            return Err(self.superseded(run_id, successor).await?);
        }
        let paths = self.registry.paths_for(Path::new(&run.output_path))?;
        Ok((run, paths))
    }

    /// Adopts again each of `runs` recorded as superseded whose output's manifest names it
    /// again (restored, or a takeover by hand undone), as a lookup of it would ([`Self::run`]):
    /// a list answers what the files say, not a superseded mark a lookup would correct (hostile
    /// review 46, N4). Whether any was adopted. A run whose adoption is refused stays as it is
    /// recorded (logged): one run's files never fail a list.
    pub async fn readopt_restored(&self, runs: &[RunRecord]) -> ApiResult<bool> {
        let mut adopted = false;
        for run in runs.iter().filter(|run| run.superseded_by.is_some()) {
            let Ok(paths) = self.registry.paths_for(Path::new(&run.output_path)) else {
                continue;
            };
            if self.owner_on_disk(&paths).await?.as_deref() != Some(run.run_id.as_str()) {
                continue;
            }
            match self.registry.adopt(&paths.output).await {
                Ok(_) => adopted = true,
                Err(e) => {
                    tracing::warn!(run_id = %run.run_id, error = %e, "a restored run could not be adopted again")
                }
            }
        }
        Ok(adopted)
    }

    /// The database's record of `run_id`, or 404.
    async fn record(&self, run_id: &str) -> ApiResult<RunRecord> {
        self.registry
            .store()
            .get_run(run_id)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("no run {run_id}")))
    }

    /// `run_superseded` for `run_id`, naming the run that owns its output now (the end of the
    /// chain from its `successor`).
    async fn superseded(&self, run_id: &str, successor: &str) -> ApiResult<ApiError> {
        let owner = self.registry.store().current_owner(successor).await?;
        Ok(ApiError::superseded(run_id, &owner))
    }

    /// The run the manifest at `paths` names, read off the async workers; only the owner is
    /// read (a large run's manifest is megabytes). `None` when there is no readable one.
    async fn owner_on_disk(&self, paths: &SidecarPaths) -> ApiResult<Option<String>> {
        let manifest = paths.manifest.clone();
        self.blocking(move || {
            Ok(recovery_sidecar::read_regular(&manifest)
                .ok()
                .and_then(|bytes| recovery_core::manifest::RunManifest::run_id_of(&bytes)))
        })
        .await
    }

    /// [`Self::run`] for readers of the run's files, held still while [`ReadingRun`] lives:
    /// this process's per-run lock is taken in shared mode, so a change of the run (a
    /// replacement moving its files aside, above all) waits for the reading and the reading
    /// for it; the reader sees the files before or after it, never halfway. When the manifest
    /// at its output names another run (rewritten outside the service), that run is adopted
    /// and this one answered `run_superseded`, never served another run's data.
    ///
    /// Drop the section before taking the run's lock for a change (an adoption), and never
    /// take a second one in the same task: a change waiting between two readings of one task
    /// would wait forever.
    pub async fn run_on_disk(&self, run_id: &str) -> ApiResult<ReadingRun> {
        let (run, paths) = self.run(run_id).await?;
        let (section, waited) = self
            .registry
            .leases()
            .local()
            .read_noting_wait(&paths.run_lock)
            .await;
        // A change that ended while this waited (a replacement superseding the run) shows now;
        // one that ended between the lookup and the lock is found by the owner check below.
        // (Looking up again every time cost every read a second database query.)
        let (run, paths) = if waited {
            self.run(run_id).await?
        } else {
            (run, paths)
        };
        match self.owner_on_disk(&paths).await? {
            Some(owner) if owner != run_id => {
                drop(section);
                self.registry.adopt(&paths.output).await?;
                Err(ApiError::superseded(run_id, &owner))
            }
            _ => Ok(ReadingRun {
                record: run,
                paths,
                section,
            }),
        }
    }

    /// Works over the run's plan on a heavy-work thread ([`HeavyWork::run`]: queued, or 503
    /// when saturated), the run's files held still meanwhile ([`Self::run_on_disk`]). A build
    /// that started finishes: it fills the run's index for the next caller.
    pub async fn with_plan<T: Send + 'static>(
        &self,
        run_id: &str,
        work: impl FnOnce(&recovery_runs::plans::RunPlan<'_>) -> T + Send + 'static,
    ) -> ApiResult<T> {
        self.with_plan_then(run_id, work, |answer| answer).await
    }

    /// [`Self::with_plan`], then `finish` on the same thread once the run's plan and files are
    /// let go (serializing a large answer there holds up no other reader or change of the run).
    pub async fn with_plan_then<T: 'static, U: Send + 'static>(
        &self,
        run_id: &str,
        work: impl FnOnce(&recovery_runs::plans::RunPlan<'_>) -> T + Send + 'static,
        finish: impl FnOnce(T) -> U + Send + 'static,
    ) -> ApiResult<U> {
        let reading = self.run_on_disk(run_id).await?;
        let cap = self.config.default_max_attempts;
        let caches = self.registry.caches().clone();
        self.plans
            .run(move |_| {
                let answer = caches.plans.with_plan(&reading.paths, cap, work)?;
                drop(reading);
                Ok(finish(answer))
            })
            .await
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
        recovery_runs::background::spawn(work)
            .await
            .map_err(|e| ApiError::internal("background file work", e))?
    }

    /// `error` of a call made under the lease `presented`: when it is `run_locked` and that
    /// lease no longer holds the run (the call's section found the lease's lock file displaced,
    /// taken by another process, and ended the lease), the holder is told its lease is gone
    /// (`lease_not_held`) rather than to wait and retry under it.
    pub async fn under_lease(
        &self,
        error: ApiError,
        run_id: &str,
        presented: Option<&str>,
    ) -> ApiError {
        let Some(presented) = presented else {
            return error;
        };
        if error.code != ErrorCode::RunLocked {
            return error;
        }
        match self.leases.holder(run_id).await {
            Ok(Some(lease)) if lease.is_presented_as(presented) => error,
            Ok(_) => ApiError::lease_not_held_on(run_id),
            Err(_) => error,
        }
    }

    /// Refuses callers without a lease when a client holds a live lease on the run (423 with the
    /// holder). A presented lease id that does not hold the run is refused (`lease_not_held`,
    /// also while another client's lease is live: a collector whose lease ended is never told
    /// to wait and go on under it).
    pub async fn check_lease(
        &self,
        paths: &SidecarPaths,
        run_id: &str,
        presented: Option<&str>,
    ) -> ApiResult<()> {
        let lease = self.registry.live_lease(paths, run_id).await?;
        match (lease, presented) {
            (Some(lease), None) => Err(ApiError::new(
                ErrorCode::RunLocked,
                format!("run {run_id} is held by {}", lease.holder),
            )
            .with_details(serde_json::json!({"holder": crate::error::lease_holder(&lease)}))),
            (Some(lease), Some(presented)) if lease.is_presented_as(presented) => Ok(()),
            (_, Some(_)) => Err(ApiError::lease_not_held_on(run_id)),
            (None, None) => Ok(()),
        }
    }
}

/// A run whose files are being read ([`AppState::run_on_disk`]): its record, its companion
/// paths, and this process's per-run lock in shared mode until it drops.
#[derive(Debug)]
pub struct ReadingRun {
    pub record: RunRecord,
    pub paths: SidecarPaths,
    pub section: tokio::sync::OwnedRwLockReadGuard<()>,
}
