//! Recording runs and their events, sidecar first and database second, and rebuilding the
//! database from the sidecars.
//!
//! Invariants: every change takes a [`LockedRun`] (one writer per run: see [`crate::runlock`]); a
//! sidecar write is complete and fsynced before the database hears of it, so after a crash the
//! files are ahead of (never behind) the database; [`Registry::reindex`] replays every sidecar
//! under the roots and inserts what is missing, idempotently (line ids derive from the lines), and
//! reconciles the runs table with the manifests it finds (the files are the truth: a manifest
//! whose run differs from the one recorded for its output supersedes it); an unreadable manifest
//! or journal line is reported, never fatal, and never replaced.

use crate::approvals::{Follow, follow_journal};
use crate::cache::RunCaches;
use crate::clock::Clock;
use crate::events::{
    ApprovalLine, DRIFT_JOURNAL, DriftLine, EXTENSION_JOURNAL, ExtensionLine, line_id, resubmit_id,
};
use crate::groupcommit::GroupJournals;
use crate::leases::Leases;
use crate::runlock::{LockedRun, RowsGuard, RunLockError, RunLocks, RunSection, SharedRun};
use recovery_core::journals::ApprovalJournal;
use recovery_core::manifest::RunManifest;
use recovery_sidecar::atomic::AtomicJsonError;
use recovery_sidecar::{
    Confinement, PathError, SidecarPaths, append_line, atomic_write_json, read_lines,
    read_lines_batch, read_lines_from,
};
use recovery_store::{
    Approval, AttemptExtension, Backend, DriftEvent, JournalMarkRow, Rejudgment, Resubmit,
    RunRecord, Store, StoreError,
};
use serde_json::Value;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a registry operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(transparent)]
    Path(#[from] PathError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Json(#[from] AtomicJsonError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("background file work failed: {0}")]
    Join(String),
    #[error(transparent)]
    Lock(#[from] RunLockError),
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RegistryError {
    let context = context.into();
    move |source| RegistryError::Io { context, source }
}

/// An append's failure: path refused when something other than a regular file is where the
/// journal belongs (see [`recovery_sidecar::is_not_a_regular_file`]), else an IO error.
fn journal_io(path: &Path) -> impl FnOnce(std::io::Error) -> RegistryError {
    let path = path.to_owned();
    move |source| {
        if recovery_sidecar::is_not_a_regular_file(&source) {
            PathError::JournalNotAFile(path).into()
        } else {
            RegistryError::Io {
                context: format!("appending to {}", path.display()),
                source,
            }
        }
    }
}

/// What a reindex found and inserted.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct ReindexReport {
    pub manifests: usize,
    pub runs: usize,
    pub drift_inserted: usize,
    pub approvals_inserted: usize,
    /// Approvals the database held unrevoked that their journal no longer has.
    pub approvals_revoked: usize,
    /// Unused approvals the database held otherwise than their journal's first line of the id
    /// says (revoked, and written again by hand; or edited in place): recorded again as the
    /// line says, since the plan honours the journal.
    pub approvals_restored: usize,
    pub extensions_inserted: usize,
    pub resubmits_inserted: usize,
    pub rejudgments_inserted: usize,
    /// Runs whose output a manifest on disk showed to belong to another run now: (old, new).
    #[schema(value_type = Vec<Vec<String>>)]
    pub superseded: Vec<(String, String)>,
    /// Files or lines that could not be read (path and reason).
    #[schema(value_type = Vec<Vec<String>>)]
    pub unreadable: Vec<(String, String)>,
}

impl ReindexReport {
    fn absorb(&mut self, other: ReindexReport) {
        self.manifests += other.manifests;
        self.runs += other.runs;
        self.drift_inserted += other.drift_inserted;
        self.approvals_inserted += other.approvals_inserted;
        self.approvals_revoked += other.approvals_revoked;
        self.approvals_restored += other.approvals_restored;
        self.extensions_inserted += other.extensions_inserted;
        self.resubmits_inserted += other.resubmits_inserted;
        self.rejudgments_inserted += other.rejudgments_inserted;
        self.superseded.extend(other.superseded);
        self.unreadable.extend(other.unreadable);
    }
}

/// Runs on disk and in the database.
#[derive(Debug, Clone)]
pub struct Registry {
    store: Store,
    confinement: Confinement,
    clock: Arc<dyn Clock>,
    locks: RunLocks,
    journals: GroupJournals,
    caches: Arc<RunCaches>,
}

/// Runs blocking file work off the async executor.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, RegistryError> + Send + 'static,
) -> Result<T, RegistryError> {
    crate::background::spawn(work)
        .await
        .map_err(|e| RegistryError::Join(e.to_string()))?
}

/// Whether a run's database record says what its manifest says (the record is an index of the
/// files; a collector that edits the manifest makes them differ until the run is indexed again).
pub fn record_matches_manifest(record: &RunRecord, manifest: &RunManifest) -> bool {
    // What indexing the manifest would record, with the record's own times and successor.
    let derived = RunRecord {
        superseded_by: record.superseded_by.clone(),
        ..run_record(
            manifest,
            Path::new(&record.output_path),
            &record.created_at,
            &record.updated_at,
        )
    };
    derived == *record
}

fn run_record(
    manifest: &RunManifest,
    output: &Path,
    created_at: &str,
    updated_at: &str,
) -> RunRecord {
    RunRecord {
        run_id: manifest.run_id.clone(),
        output_path: output.display().to_string(),
        source_digest: manifest.source_digest.clone(),
        materialized_digest: manifest.materialized_digest.clone(),
        config_digest: manifest.config_digest.clone(),
        legacy_import: manifest.legacy_import,
        identity_overridden: manifest.identity_overridden,
        max_rollout_attempts: manifest
            .max_rollout_attempts
            .and_then(|n| i64::try_from(n).ok()),
        created_at: created_at.to_owned(),
        updated_at: updated_at.to_owned(),
        superseded_by: None,
    }
}

impl Registry {
    /// A registry whose leases are granted as `replica`.
    pub fn new(
        store: Store,
        confinement: Confinement,
        clock: Arc<dyn Clock>,
        replica: impl Into<String>,
    ) -> Self {
        let leases = Leases::new(store.clone(), clock.clone(), replica);
        Self {
            locks: RunLocks::new(store.clone(), leases),
            caches: Arc::default(),
            journals: GroupJournals::default(),
            store,
            confinement,
            clock,
        }
    }

    /// Writes the run's coverage snapshot `<stem>_coverage.json` from its plan, inside the
    /// run's section (facts §11.7: a Python store writes it when it opens and closes, and
    /// file-based tools and the Python completion check read it; the service writes it when a
    /// lease is granted and released). Best effort, as the store's: a failure is logged and is
    /// never the caller's error (a run whose files cannot be planned has no coverage to give).
    pub async fn write_coverage(&self, run: &LockedRun, default_cap: u64) {
        let (caches, paths) = (self.caches.clone(), run.paths().clone());
        let target = paths.coverage.clone();
        let written = crate::background::spawn(move || -> Result<(), String> {
            let coverage = caches
                .plans
                .with_plan(&paths, default_cap, |plan| {
                    serde_json::to_value(plan.summary().coverage)
                })
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            atomic_write_json(&paths.coverage, &coverage, None).map_err(|e| e.to_string())
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        if let Err(reason) = written {
            tracing::warn!(path = %target.display(), %reason, "the coverage snapshot was not written");
        }
    }

    /// Derived state of files, cached by file identity.
    pub fn caches(&self) -> &Arc<RunCaches> {
        &self.caches
    }

    /// This process's leases (they share the per-run mutexes of [`Self::lock`]).
    pub fn leases(&self) -> &Leases {
        self.locks.leases()
    }

    /// Enters a run's critical section: every change to its files and rows happens inside.
    pub async fn lock(&self, paths: &SidecarPaths) -> Result<LockedRun, RunLockError> {
        self.locks.lock(paths).await
    }

    /// [`Self::lock`] for a run being created (its output's directory made when missing).
    pub async fn lock_creating(&self, paths: &SidecarPaths) -> Result<LockedRun, RunLockError> {
        self.locks.lock_creating(paths).await
    }

    /// Enters a run's section in shared mode: reads and journal appends only.
    pub async fn lock_shared(&self, paths: &SidecarPaths) -> Result<SharedRun, RunLockError> {
        self.locks.lock_shared(paths).await
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn confinement(&self) -> &Confinement {
        &self.confinement
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The companions of a requested output path, confined under the roots.
    pub fn paths_for(&self, output: &Path) -> Result<SidecarPaths, RegistryError> {
        let paths = SidecarPaths::for_output(&self.confinement.resolve(output)?);
        paths.check_names()?;
        Ok(paths)
    }

    /// Publishes the saved identity (when given) and then the manifest, each atomically, then
    /// records the run. A manifest that is rewritten keeps its form (see
    /// [`RunManifest::to_value_like`]).
    pub async fn write_manifest(
        &self,
        run: &LockedRun,
        manifest: &RunManifest,
        identity: Option<&Value>,
    ) -> Result<RunRecord, RegistryError> {
        let paths = run.paths();
        let (manifest_path, identity_path) = (paths.manifest.clone(), paths.identity.clone());
        let (written, identity) = (manifest.clone(), identity.cloned());
        blocking(move || {
            if let Some(parent) = manifest_path.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(io(format!("creating {}", parent.display())))?;
            }
            let value = match recovery_sidecar::read_regular(&manifest_path)
                .ok()
                .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
            {
                Some(previous) => written.to_value_like(&previous),
                None => written.to_value(),
            };
            if let Some(identity) = identity {
                atomic_write_json(&identity_path, &identity, None)?;
            }
            atomic_write_json(&manifest_path, &value, None)?;
            Ok(())
        })
        .await?;
        self.record_run(manifest, &paths.output).await
    }

    /// Records the run a manifest describes at `output` (keeping its creation time); another run
    /// recorded there is superseded and audited.
    async fn record_run(
        &self,
        manifest: &RunManifest,
        output: &Path,
    ) -> Result<RunRecord, RegistryError> {
        let now = self.clock.now_text();
        let created = match self.store.get_run(&manifest.run_id).await? {
            Some(existing) => existing.created_at,
            None => now.clone(),
        };
        let record = run_record(manifest, output, &created, &now);
        if let Some(previous) = self.store.upsert_run(&record).await? {
            self.audit_superseded(&previous, &record).await?;
        }
        Ok(record)
    }

    async fn audit_superseded(
        &self,
        previous: &str,
        record: &RunRecord,
    ) -> Result<(), RegistryError> {
        tracing::warn!(previous, run_id = %record.run_id, output = %record.output_path, "a new run took over an output; the previous run is kept as superseded");
        self.store
            .insert_audit(&recovery_store::AuditEntry {
                audit_id: recovery_sidecar::new_id(),
                at: self.clock.now_text(),
                actor: "system".into(),
                action: "run.superseded".into(),
                run_id: Some(previous.to_owned()),
                details: serde_json::json!({"superseded_by": record.run_id, "output_path": record.output_path}),
            })
            .await?;
        Ok(())
    }

    /// Appends one journal line (group-committed with concurrent appends to the same journal:
    /// one write and one fdatasync for all of them); returns the line's derived id.
    async fn append_json_line<T: serde::Serialize>(
        &self,
        path: &Path,
        run_id: &str,
        journal: &'static str,
        line: &T,
    ) -> Result<String, RegistryError> {
        let bytes = serde_json::to_vec(line).map_err(|e| RegistryError::Io {
            context: "serialising a journal line".into(),
            source: e.into(),
        })?;
        // A link, FIFO or directory where the journal belongs is the run's files' problem
        // (path refused), never the service's failure; the append refuses it before writing.
        let offset = self
            .journals
            .append(path, bytes.clone())
            .await
            .map_err(|e| {
                if e.not_a_file {
                    PathError::JournalNotAFile(path.to_owned()).into()
                } else {
                    RegistryError::Io {
                        context: e.path,
                        source: std::io::Error::other(e.message),
                    }
                }
            })?;
        Ok(line_id(run_id, journal, offset, &bytes))
    }

    /// Journals a resume across operational drift (keys and digests, never values).
    pub async fn record_drift(
        &self,
        run: &impl RunSection,
        manifest: &RunManifest,
        current_config_digest: &str,
        operational_keys: &[String],
    ) -> Result<DriftEvent, RegistryError> {
        self.record_drift_with(
            run,
            manifest,
            current_config_digest,
            operational_keys,
            &mut None,
        )
        .await
    }

    /// [`record_drift`](Self::record_drift), committing `resume` (the validation's resume event,
    /// completed as a resume across drift) in the drift row's transaction: one commit per
    /// resume, not two. It is taken only once the journal line is durable: a validation whose
    /// line could not be written keeps its event, given the keys and digest it attempted, for the
    /// caller to record the failure.
    pub async fn record_drift_with(
        &self,
        run: &impl RunSection,
        manifest: &RunManifest,
        current_config_digest: &str,
        operational_keys: &[String],
        resume: &mut Option<recovery_store::ResumeEvent>,
    ) -> Result<DriftEvent, RegistryError> {
        let mut keys = operational_keys.to_vec();
        keys.sort();
        let line = DriftLine {
            id: None,
            at: self.clock.now_text(),
            run_id: manifest.run_id.clone(),
            saved_config_digest: manifest.config_digest.clone(),
            current_config_digest: current_config_digest.to_owned(),
            operational_keys: keys,
        };
        let appended = self
            .append_json_line(
                &run.paths().resume_drift,
                &manifest.run_id,
                DRIFT_JOURNAL,
                &line,
            )
            .await;
        let id = match appended {
            Ok(id) => id,
            Err(e) => {
                // The caller records the failure, with the drift it was about (the operator
                // saw a failed validation with no keys: hostile review 29).
                if let Some(resume) = resume.as_mut() {
                    resume.operational_keys = operational_keys.to_vec();
                    resume.current_config_digest = Some(current_config_digest.to_owned());
                }
                return Err(e);
            }
        };
        let event = drift_event(id, line);
        let resume = resume.take().map(|resume| recovery_store::ResumeEvent {
            outcome: "resume_with_drift".into(),
            operational_keys: operational_keys.to_vec(),
            current_config_digest: Some(current_config_digest.to_owned()),
            ..resume
        });
        let rows = std::iter::once(recovery_store::GroupedRow::Drift(event.clone()))
            .chain(resume.map(recovery_store::GroupedRow::Resume))
            .collect();
        self.store.insert_grouped(rows).await?;
        Ok(event)
    }

    /// Journals an operator's approval to rerun exactly one masked attempt.
    pub async fn record_approval(
        &self,
        run: &LockedRun,
        run_id: &str,
        by: &str,
        reason: &str,
        (task_index, rollout_index, attempt_index): (i64, i64, i64),
    ) -> Result<Approval, RegistryError> {
        let line = ApprovalLine {
            approval_id: recovery_sidecar::new_id(),
            at: self.clock.now_text(),
            by: by.to_owned(),
            reason: reason.to_owned(),
            task_index,
            rollout_index,
            attempt_index,
        };
        self.append_json_line(&run.paths().rerun_masked, run_id, "rerun_masked", &line)
            .await?;
        let approval = crate::approvals::record_of(run_id, line);
        self.store.insert_approval(&approval).await?;
        Ok(approval)
    }

    /// Revokes an unused approval: the journal is rewritten without its line (atomically, so
    /// file-based readers stop honouring it too), then the database records the revocation.
    pub async fn revoke_approval(
        &self,
        run: &LockedRun,
        run_id: &str,
        approval_id: &str,
    ) -> Result<bool, RegistryError> {
        let journal = run.paths().rerun_masked.clone();
        let id = approval_id.to_owned();
        let removed = blocking(move || {
            let bytes = match recovery_sidecar::read_regular(&journal) {
                Ok(bytes) => bytes,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
                Err(e) => return Err(io(format!("reading {}", journal.display()))(e)),
            };
            let Some(kept) = without_approval(&bytes, &id) else {
                return Ok(false);
            };
            recovery_sidecar::atomic_write(&journal, &kept, None)
                .map_err(io(format!("rewriting {}", journal.display())))?;
            Ok(true)
        })
        .await?;
        let revoked = self
            .store
            .revoke_approval(run_id, approval_id, &self.clock.now_text())
            .await?;
        Ok(removed || revoked)
    }

    /// Journals attempts added to every rollout's cap.
    pub async fn record_extension(
        &self,
        run: &LockedRun,
        run_id: &str,
        by: &str,
        reason: &str,
        extend_attempts: i64,
    ) -> Result<AttemptExtension, RegistryError> {
        let line = ExtensionLine {
            id: None,
            at: self.clock.now_text(),
            extend_attempts,
            by: by.to_owned(),
            reason: reason.to_owned(),
        };
        let id = self
            .append_json_line(
                &run.paths().attempt_extension,
                run_id,
                EXTENSION_JOURNAL,
                &line,
            )
            .await?;
        let extension = extension_record(run_id, id, line);
        self.store.insert_extension(&extension).await?;
        Ok(extension)
    }

    /// Resets the failure budget: records the failures sidecar's current line count (after
    /// repairing a torn tail, which must not count) as the new offset, and the results file's
    /// complete lines beside it (`<stem>_resubmit_results_offset`), so masked infrastructure
    /// results saved before the resubmit stop counting too. The sidecar offset is written last:
    /// it is the record of the resubmit (its line number is the resubmit's id).
    pub async fn record_resubmit(
        &self,
        run: &LockedRun,
        run_id: &str,
        by: &str,
    ) -> Result<Resubmit, RegistryError> {
        let paths = run.paths();
        let (failures, offsets) = (paths.failures.clone(), paths.resubmit_offset.clone());
        let (results, results_offsets) =
            (paths.output.clone(), paths.resubmit_results_offset.clone());
        let (offset, line_number) = blocking(move || {
            // Both journals are checked before either is written: a resubmit is both lines or
            // neither.
            SidecarPaths::check_journal(&results_offsets)?;
            SidecarPaths::check_journal(&offsets)?;
            let repair =
                recovery_sidecar::prepare_append(&failures).map_err(journal_io(&failures))?;
            crate::groupcommit::report_repair(&failures, repair);
            let count = read_lines(&failures)
                .map_err(io(format!("reading {}", failures.display())))?
                .len();
            // Complete lines only: a torn tail is not a result yet.
            let results_count = read_lines(&results)
                .map_err(io(format!("reading {}", results.display())))?
                .len();
            for (journal, line) in [(&results_offsets, results_count), (&offsets, count)] {
                let repair = append_line(journal, line.to_string().as_bytes())
                    .map_err(journal_io(journal))?;
                crate::groupcommit::report_repair(journal, repair);
            }
            let line_number = read_lines(&offsets)
                .map_err(io(format!("reading {}", offsets.display())))?
                .len();
            Ok((count as i64, line_number))
        })
        .await?;
        let resubmit = Resubmit {
            event_id: resubmit_id(run_id, line_number),
            run_id: run_id.to_owned(),
            at: self.clock.now_text(),
            by: by.to_owned(),
            line_offset: offset,
        };
        self.store.insert_resubmit(&resubmit).await?;
        Ok(resubmit)
    }

    /// Records a re-judgment admitted in the manifest (the manifest is the sidecar record).
    pub async fn record_rejudgment(
        &self,
        _run: &LockedRun,
        rejudgment: &Rejudgment,
    ) -> Result<bool, RegistryError> {
        Ok(self.store.insert_rejudgment(rejudgment).await?)
    }

    /// Removes the hidden temporaries of atomic writes (`.<name>.<32 hex>.tmp`) under the roots
    /// that were last modified before `before` (the start of this process): their writer is
    /// gone, and the target they were meant to replace is intact. Returns how many it removed.
    pub async fn remove_stale_temporaries(
        &self,
        before: std::time::SystemTime,
    ) -> Result<Vec<PathBuf>, RegistryError> {
        let roots: Vec<PathBuf> = self.confinement.roots().to_vec();
        blocking(move || {
            let mut removed = Vec::new();
            for root in &roots {
                for entry in walkdir::WalkDir::new(root)
                    .follow_links(false)
                    .into_iter()
                    .filter_map(Result::ok)
                {
                    // Only a run's own temporaries (a companion's, or an output's beside its
                    // manifest), and only those older than a grace period before this start:
                    // a user's file that happens to look like one, or a Python collector's
                    // write in flight, is never touched.
                    let name = entry.file_name().to_string_lossy();
                    let run_lock = recovery_sidecar::temporary_target(&name).and_then(|target| {
                        entry
                            .path()
                            .parent()
                            .and_then(|dir| run_lock_of(dir, target))
                    });
                    let Some(run_lock) = run_lock else {
                        continue;
                    };
                    let stale = entry.file_type().is_file()
                        && entry
                            .metadata()
                            .ok()
                            .and_then(|m| m.modified().ok())
                            .is_some_and(|modified| modified < before);
                    if !stale {
                        continue;
                    }
                    // The run's lock, held while the temporary goes: a process writing the run
                    // (a Python collector) holds it, and its write in flight is left alone.
                    let Ok(_held) = recovery_sidecar::RunLock::for_output(&run_lock, None) else {
                        continue;
                    };
                    if std::fs::remove_file(entry.path()).is_ok() {
                        removed.push(entry.into_path());
                    }
                }
            }
            Ok(removed)
        })
        .await
    }

    /// Finishes or undoes every replacement a crash interrupted under the roots (see
    /// [`crate::operations::recover_replacement`]); call before [`Self::reindex`] at start-up.
    /// Returns the outputs whose replacement was rolled back or completed.
    pub async fn recover_replacements(&self) -> Result<Vec<(PathBuf, bool)>, RegistryError> {
        let roots: Vec<PathBuf> = self.confinement.roots().to_vec();
        blocking(move || {
            let mut recovered = Vec::new();
            for root in &roots {
                for entry in walkdir::WalkDir::new(root)
                    .follow_links(false)
                    .into_iter()
                    .filter_map(Result::ok)
                {
                    let name = entry.file_name().to_string_lossy();
                    let Some(stem) = name.strip_suffix("_replace_intent.json") else {
                        continue;
                    };
                    let intent: Option<crate::operations::ReplaceIntent> =
                        recovery_sidecar::read_regular(entry.path())
                            .ok()
                            .and_then(|b| serde_json::from_slice(&b).ok());
                    let output = intent.map_or_else(
                        || {
                            output_for_manifest(
                                &entry.path().with_file_name(format!("{stem}_manifest.json")),
                            )
                        },
                        |i| i.output,
                    );
                    let paths = SidecarPaths::for_output(&output);
                    // Reported, never fatal: the service always starts.
                    match crate::operations::recover_replacement(&paths) {
                        Ok(Some(rolled_back)) => recovered.push((output, rolled_back)),
                        Ok(None) => {}
                        Err(e) => tracing::warn!(intent = %entry.path().display(), error = %e, "an interrupted replacement could not be recovered; left as it is"),
                    }
                }
            }
            Ok(recovered)
        })
        .await
    }

    /// Brings the database up to date with every sidecar under the roots, beside the service's
    /// other work: runs whose drift journals hold lines to index are merged [`GROUP_RUNS`] at a
    /// time, so a run's requests wait at most for its own group (a run's rows are locked while
    /// its group is indexed).
    pub async fn reindex(&self) -> Result<ReindexReport, RegistryError> {
        self.reindex_merging(GROUP_RUNS).await
    }

    /// [`Self::reindex`] at start-up, while the service answers nothing that reads or changes
    /// runs: up to [`MERGED_RUNS`] runs with lines to index are merged together (a rebuild of
    /// many runs' journals in one time order; see [`Self::reindex_groups`]).
    pub async fn reindex_at_start(&self) -> Result<ReindexReport, RegistryError> {
        self.reindex_merging(MERGED_RUNS).await
    }

    /// A reindex that merges the drift journals of up to `merged` runs at once (on SQLite).
    async fn reindex_merging(&self, merged: usize) -> Result<ReindexReport, RegistryError> {
        let roots: Vec<PathBuf> = self.confinement.roots().to_vec();
        let found = blocking(move || Ok(find_manifests(&roots))).await?;
        let mut report = ReindexReport::default();
        let in_place = self
            .set_apart_unknown_copies(found.in_place, &mut report)
            .await?;
        for group in self.reindex_groups(in_place, merged).await? {
            let group = group.as_slice();
            let _rows = self.lock_rows_of(group).await?;
            let mut journals = Vec::new();
            for manifest_path in group {
                report.absorb(
                    self.reindex_unlocked(manifest_path, Some(&mut journals))
                        .await?,
                );
            }
            self.reindex_drift_merged(journals, &mut report).await?;
        }
        self.reindex_replaced(found.set_aside, &mut report).await?;
        Ok(report)
    }

    /// Sets apart the manifests of a run that several manifests name when the database does not
    /// record the run at one of them (a rebuilt database, a run moved and copied): the run and
    /// its copies (`cp -r` of its folder) cannot be told apart, and whichever a reindex read
    /// first took the run, the others being called its copies (hostile review 55, F9: after a
    /// restore, a copy that sorted first took the run from its collector). Each is reported and
    /// none recorded, until the copies are removed (or given runs of their own) and a reindex
    /// runs, or a request names one of the outputs (a collector's create or lookup at its own
    /// output adopts the run there). A run the database records at one of them keeps it: the
    /// others are its copies, reported as such.
    async fn set_apart_unknown_copies(
        &self,
        manifests: Vec<PathBuf>,
        report: &mut ReindexReport,
    ) -> Result<Vec<PathBuf>, RegistryError> {
        let named = blocking(move || {
            Ok(manifests
                .into_iter()
                .map(|manifest| {
                    let run_id = recovery_sidecar::read_regular(&manifest)
                        .ok()
                        .and_then(|bytes| RunManifest::run_id_of(&bytes));
                    (manifest, run_id)
                })
                .collect::<Vec<_>>())
        })
        .await?;
        let mut by_run: std::collections::HashMap<&str, Vec<&PathBuf>> = Default::default();
        for (manifest, run_id) in &named {
            if let Some(run_id) = run_id {
                by_run.entry(run_id.as_str()).or_default().push(manifest);
            }
        }
        let mut apart = std::collections::HashSet::new();
        for (run_id, manifests) in by_run.iter().filter(|(_, m)| m.len() > 1) {
            let recorded =
                self.store.get_run(run_id).await?.map(|record| {
                    SidecarPaths::for_output(Path::new(&record.output_path)).manifest
                });
            if recorded.is_some_and(|recorded| manifests.contains(&&recorded)) {
                continue;
            }
            let listed: Vec<String> = manifests.iter().map(|m| m.display().to_string()).collect();
            for manifest in manifests {
                report.unreadable.push((
                    manifest.display().to_string(),
                    format!(
                        "run {run_id} is named by {} manifests ({}): the run cannot be told from its \
                         copies; remove the copies (or give them runs of their own), then reindex; \
                         until then a request naming one of these outputs takes the run there",
                        manifests.len(),
                        listed.join(", ")
                    ),
                ));
                apart.insert((*manifest).clone());
            }
        }
        Ok(named
            .into_iter()
            .map(|(manifest, _)| manifest)
            .filter(|manifest| !apart.contains(manifest))
            .collect())
    }

    /// Records the runs an operator replaced (their manifests set aside as
    /// `*_manifest.json.replaced-<time>`) that the database does not know, as superseded by the
    /// run that replaced each (the next one set aside at that output, else the manifest in
    /// place), and indexes their set-aside drift journals: a database rebuilt from the files
    /// keeps the replaced runs and their history (hostile review 52, F2: they were gone). A run
    /// the database knows as current is another output's (a copy) and is left alone; lines
    /// already indexed keep their ids (derived from run, journal kind, offset and bytes).
    async fn reindex_replaced(
        &self,
        chains: std::collections::BTreeMap<PathBuf, Vec<SetAside>>,
        report: &mut ReindexReport,
    ) -> Result<(), RegistryError> {
        for (manifest_path, set_aside) in chains {
            let paths = SidecarPaths::for_output(&output_for_manifest(&manifest_path));
            let _rows = self.locks.lock_rows(&paths).await?;
            // Run ids only (a manifest of 100k rollouts takes tens of ms to read whole, and
            // every reindex passes here): a set-aside manifest is read whole once, when its run
            // is recorded.
            let read = blocking(move || {
                let run_of = |path: &Path| {
                    recovery_sidecar::read_regular(path)
                        .ok()
                        .and_then(|bytes| RunManifest::run_id_of(&bytes))
                };
                let live = run_of(&manifest_path);
                let runs: Vec<_> = set_aside
                    .into_iter()
                    .map(|SetAside { path, suffix, .. }| {
                        let run = run_of(&path);
                        (path, suffix, run)
                    })
                    .collect();
                Ok((live, runs))
            })
            .await?;
            let (live, runs) = read;
            for (i, (path, suffix, run_id)) in runs.iter().enumerate() {
                let Some(run_id) = run_id.as_ref().filter(|id| usable_run_id(id).is_ok()) else {
                    report.unreadable.push((
                        path.display().to_string(),
                        "a set-aside manifest that names no run the service can name".into(),
                    ));
                    continue;
                };
                let successor = runs[i + 1..]
                    .iter()
                    .find_map(|(_, _, run)| run.clone())
                    .or_else(|| live.clone())
                    .filter(|successor| successor != run_id);
                let Some(successor) = successor else {
                    continue;
                };
                match self.store.get_run(run_id).await? {
                    Some(known) if known.superseded_by.is_none() => continue,
                    Some(_) => {}
                    None => {
                        let record = match self.set_aside_record(path, suffix, &paths).await? {
                            Ok(record) => record,
                            Err(why) => {
                                report.unreadable.push((path.display().to_string(), why));
                                continue;
                            }
                        };
                        if !self
                            .store
                            .insert_superseded_run(&record, &successor)
                            .await?
                        {
                            // Another run holds its place (recorded as superseded by the same
                            // successor while this manifest could not be read): its drift is
                            // not indexed under a run the database does not have (hostile
                            // review 54, N2).
                            report.unreadable.push((
                                path.display().to_string(),
                                format!(
                                    "run {run_id}: another run is recorded as replaced by {successor}; \
                                     rebuild the database from the files to record both"
                                ),
                            ));
                            continue;
                        }
                        report.runs += 1;
                        report.superseded.push((run_id.clone(), successor.clone()));
                    }
                }
                let journal = PathBuf::from(format!("{}{suffix}", paths.resume_drift.display()));
                self.reindex_drift(run_id, &journal, report).await?;
            }
        }
        Ok(())
    }

    /// The record of a run whose manifest a replacement set aside at `path` (with `suffix`),
    /// read whole, created when its set-aside materialized inputs were written (they are
    /// written when a run is created, never again; now when they are gone or dated in the
    /// future, a clock set wrong); why not, when the manifest is unreadable.
    async fn set_aside_record(
        &self,
        path: &Path,
        suffix: &str,
        paths: &SidecarPaths,
    ) -> Result<Result<RunRecord, String>, RegistryError> {
        let path = path.to_owned();
        let materialized = PathBuf::from(format!("{}{suffix}", paths.materialized.display()));
        let (manifest, written) = blocking(move || {
            let manifest = recovery_sidecar::read_regular(&path)
                .map_err(|e| e.to_string())
                .and_then(|bytes| RunManifest::from_json_bytes(&bytes).map_err(|e| e.to_string()));
            let written = std::fs::symlink_metadata(&materialized)
                .and_then(|m| m.modified())
                .ok();
            Ok((manifest, written))
        })
        .await?;
        let manifest = match manifest {
            Ok(manifest) => manifest,
            Err(why) => return Ok(Err(why)),
        };
        let now = self.clock.now();
        let created = written
            .map(time::OffsetDateTime::from)
            .filter(|written| *written <= now)
            .unwrap_or(now);
        Ok(Ok(run_record(
            &manifest,
            &paths.output,
            &recovery_sidecar::format_rfc3339(created),
            &recovery_sidecar::format_rfc3339(now),
        )))
    }

    /// The manifests in the groups a reindex takes together (their rows locked at once): first
    /// the runs whose drift journals hold lines not indexed yet, `merged` together, their drift
    /// journals merged into one time order (SQLite then inserts into its time-ordered tables at
    /// their end: measured, 1M lines over 4 runs read one after the other 134k lines/s, merged
    /// 228k), then the others [`GROUP_RUNS`] at a time.
    ///
    /// Every group after the first inserts its events among the earlier groups' (their times
    /// overlap): in SQLite's time-ordered tables that rewrites pages all along them, so the cost
    /// of a group grows with the events indexed before it. Measured, 1M lines over 96 runs from
    /// an empty database in groups of 8: 66-80k lines/s, SQLite writing 6.5 GB for a 645 MB
    /// database (against 230k lines/s over 4 runs); merged together, 94-129k lines/s and 2.4 GB.
    /// Whether a journal has lines to index is a hint here (its size against its mark: lines the
    /// service journals itself do not move the mark); the group's reindex decides under its locks.
    ///
    /// On PostgreSQL every run's section holds one of a few pooled connections (its advisory
    /// lock), so runs are taken one at a time there.
    async fn reindex_groups(
        &self,
        manifests: Vec<PathBuf>,
        merged: usize,
    ) -> Result<Vec<Vec<PathBuf>>, RegistryError> {
        if self.store.backend() == Backend::Postgres {
            return Ok(manifests.into_iter().map(|m| vec![m]).collect());
        }
        let journals: Vec<PathBuf> = manifests
            .iter()
            .map(|m| SidecarPaths::for_output(&output_for_manifest(m)).resume_drift)
            .collect();
        let identities = blocking(move || {
            Ok(journals
                .into_iter()
                .map(|journal| {
                    let identity = journal_identity(&journal);
                    (journal, identity)
                })
                .collect::<Vec<_>>())
        })
        .await?;
        let (mut pending, mut idle) = (Vec::new(), Vec::new());
        for (manifest, (journal, identity)) in manifests.into_iter().zip(identities) {
            let indexed = match identity {
                None => true,
                Some((device, inode, length)) => self
                    .store
                    .journal_mark(&journal.display().to_string())
                    .await?
                    .is_some_and(|mark| {
                        (mark.device, mark.inode, mark.indexed_to) == (device, inode, length)
                    }),
            };
            if indexed {
                idle.push(manifest);
            } else {
                pending.push(manifest);
            }
        }
        Ok(pending
            .chunks(merged)
            .chain(idle.chunks(GROUP_RUNS))
            .map(<[PathBuf]>::to_vec)
            .collect())
    }

    /// The row locks of the runs whose manifests are `group`, taken in the order of their lock
    /// paths (each once: two manifests may be one run's lock): any two holders of several wait
    /// for them in the same order, and every other holder holds one.
    async fn lock_rows_of(&self, group: &[PathBuf]) -> Result<Vec<RowsGuard>, RegistryError> {
        let mut paths: Vec<SidecarPaths> = group
            .iter()
            .map(|manifest| SidecarPaths::for_output(&output_for_manifest(manifest)))
            .collect();
        paths.sort_by(|a, b| a.run_lock.cmp(&b.run_lock));
        paths.dedup_by(|a, b| a.run_lock == b.run_lock);
        let mut guards = Vec::with_capacity(paths.len());
        for paths in &paths {
            guards.push(self.locks.lock_rows(paths).await?);
        }
        Ok(guards)
    }

    /// Adopts the run that the files at `output` hold (its manifest), whether or not the
    /// database knew it, so an id read from disk resolves at once. `None` when no readable
    /// manifest is there.
    pub async fn adopt(&self, output: &Path) -> Result<Option<RunRecord>, RegistryError> {
        let paths = self.paths_for(output)?;
        let _rows = self.locks.lock_rows(&paths).await?;
        self.adopt_unlocked(&paths).await
    }

    /// [`Self::adopt`] inside a run's critical section.
    pub async fn adopt_locked(&self, run: &LockedRun) -> Result<Option<RunRecord>, RegistryError> {
        self.adopt_unlocked(run.paths()).await
    }

    async fn adopt_unlocked(
        &self,
        paths: &SidecarPaths,
    ) -> Result<Option<RunRecord>, RegistryError> {
        let manifest_path = paths.manifest.clone();
        if !blocking(move || Ok(manifest_path.is_file())).await? {
            return Ok(None);
        }
        self.reindex_unlocked(&paths.manifest, None).await?;
        Ok(self
            .store
            .find_run_by_output(&paths.output.display().to_string())
            .await?)
    }

    /// Where to start reading an append-only journal: its mark when the file is the one the
    /// mark was taken of (device and inode), has not shrunk, and still holds the bytes it held
    /// before the mark (a journal rewritten in place is read again from its start: reading
    /// from the mark would start mid-line and never index the lines before it), else its start.
    async fn journal_mark(&self, path: &Path) -> Result<Option<JournalMark>, RegistryError> {
        let stat_path = path.to_owned();
        let identity = blocking(move || {
            // Anything but a regular file is read too, so that its reader reports it; its
            // bytes before a mark are never read (`bytes_before` opens regular files only).
            Ok(journal_identity(&stat_path))
        })
        .await?;
        let Some((device, inode, length)) = identity else {
            return Ok(None);
        };
        let mark = self.store.journal_mark(&path.display().to_string()).await?;
        let start = match mark {
            Some(mark)
                if mark.device == device && mark.inode == inode && mark.indexed_to <= length =>
            {
                let (read_path, to) = (path.to_owned(), mark.indexed_to as u64);
                let before = blocking(move || Ok(bytes_before(&read_path, to))).await?;
                if before.is_some() && before == mark.before_mark {
                    to
                } else {
                    0
                }
            }
            _ => 0,
        };
        Ok(Some(JournalMark {
            device,
            inode,
            start,
        }))
    }

    /// Records that a journal is indexed up to the end of the last line read, when the file is
    /// still the one whose identity was taken before the read, with the bytes before that end.
    async fn advance_mark(
        &self,
        path: &Path,
        mark: Option<JournalMark>,
        end: Option<u64>,
    ) -> Result<(), RegistryError> {
        let Some(mark) = mark else { return Ok(()) };
        let end = end.unwrap_or(mark.start);
        self.advance_marks(vec![(path.to_owned(), mark, end)]).await
    }

    /// [`Self::advance_mark`] for several journals (each its path, the mark its reading began
    /// from, and where the lines indexed end), recorded in one transaction: a merged reindex
    /// moves the marks of up to [`MERGED_RUNS`] journals after each batch, and a transaction
    /// each was a commit per journal per batch.
    async fn advance_marks(
        &self,
        marks: Vec<(PathBuf, JournalMark, u64)>,
    ) -> Result<(), RegistryError> {
        let rows = blocking(move || {
            Ok(marks
                .into_iter()
                .filter_map(|(path, mark, end)| {
                    let same = journal_identity(&path).is_some_and(|(device, inode, _)| {
                        (device, inode) == (mark.device, mark.inode)
                    });
                    same.then(|| {
                        let row = JournalMarkRow {
                            device: mark.device,
                            inode: mark.inode,
                            indexed_to: end as i64,
                            before_mark: bytes_before(&path, end),
                        };
                        (path.display().to_string(), row)
                    })
                })
                .collect::<Vec<_>>())
        })
        .await?;
        self.store.set_journal_marks(&rows).await?;
        Ok(())
    }

    /// Indexes a run's drift journal from its mark, a batch of lines at a time (each batch parsed
    /// on every core, inserted in one transaction, then the mark moved past it), so memory stays
    /// bounded whatever the journal's length. The next batch is read and parsed while the
    /// database inserts the current one (measured: the database's writer is busy about 70% of a
    /// reindex, so reading in turn with it left a core idle).
    async fn reindex_drift(
        &self,
        run_id: &str,
        path: &Path,
        report: &mut ReindexReport,
    ) -> Result<(), RegistryError> {
        let Some(mark) = self.journal_mark(path).await? else {
            return Ok(());
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut batch = read_drift_batch(run_id, path, mark.start, DRIFT_BATCH, threads).await?;
        loop {
            let (events, end, full) = match batch {
                Ok(parsed) => {
                    report.unreadable.extend(parsed.unreadable);
                    let events: Vec<DriftEvent> =
                        parsed.events.into_iter().map(|(_, event)| event).collect();
                    (events, parsed.end, parsed.full)
                }
                // A journal that cannot be read (a symbolic link, which is never followed, or
                // an IO error) is reported: reindex never fails on one run's files.
                Err(e) => {
                    report
                        .unreadable
                        .push((path.display().to_string(), e.to_string()));
                    return Ok(());
                }
            };
            let insert = async {
                let inserted = self.store.insert_drift_events(&events).await?;
                self.advance_mark(path, Some(mark), Some(end)).await?;
                Ok::<_, RegistryError>(inserted)
            };
            if !full {
                report.drift_inserted += insert.await?;
                return Ok(());
            }
            let (inserted, next) = tokio::join!(
                insert,
                read_drift_batch(run_id, path, end, DRIFT_BATCH, threads)
            );
            report.drift_inserted += inserted?;
            batch = next?;
        }
    }

    /// Indexes the drift journals of runs whose rows are locked, merged into one time order: a
    /// batch of the earliest events of all of them at a time (each journal read a batch at a
    /// time, so memory stays bounded), inserted in one transaction, then every journal's mark
    /// moved past the lines of it that batch took (a prefix of the journal, so an interrupted
    /// reindex starts again where its last batch ended). The next batch is merged while the
    /// database inserts the current one. One journal is indexed on its own.
    async fn reindex_drift_merged(
        &self,
        journals: Vec<(String, PathBuf)>,
        report: &mut ReindexReport,
    ) -> Result<(), RegistryError> {
        if let [(run_id, path)] = journals.as_slice() {
            return self.reindex_drift(run_id, path, report).await;
        }
        // Each journal read in parts of about its share of a merged batch: then every merge
        // step reads and parses about one batch while the database inserts the previous one.
        let share = (MERGED_BATCH / journals.len().max(1)).max(MERGED_LINES_MIN);
        let mut merging = Vec::with_capacity(journals.len());
        for (run_id, path) in journals {
            if let Some(mark) = self.journal_mark(&path).await? {
                merging.push(MergedJournal::new(run_id, path, mark, share));
            }
        }
        let mut merged = merge_drift_batch(&mut merging, report).await?;
        loop {
            let (events, marks) = merged;
            let insert = async {
                let inserted = self.store.insert_drift_events(&events).await?;
                self.advance_marks(marks).await?;
                Ok::<_, RegistryError>(inserted)
            };
            if events.is_empty() {
                // Journals of unreadable lines only are passed too.
                insert.await?;
                return Ok(());
            }
            let mut unreadable = ReindexReport::default();
            let (inserted, next) =
                tokio::join!(insert, merge_drift_batch(&mut merging, &mut unreadable));
            report.drift_inserted += inserted?;
            report.unreadable.extend(unreadable.unreadable);
            merged = next?;
        }
    }

    /// Approvals the database learns from the journal (a rebuild, a Python collector's line)
    /// that an attempt reserved since has used, as the run's files tell: recorded as used, so
    /// they are listed as such and never revoked afterwards.
    async fn mark_used_approvals(
        &self,
        paths: &SidecarPaths,
        manifest: &RunManifest,
        inserted: Vec<Approval>,
    ) -> Result<(), RegistryError> {
        if inserted.is_empty() {
            return Ok(());
        }
        let (caches, plan_paths) = (self.caches.clone(), paths.clone());
        // Which attempt used an approval does not depend on the cap; the saved one will do.
        let cap = manifest.max_rollout_attempts.unwrap_or(3);
        let approvals = inserted
            .into_iter()
            .map(|a| {
                let triple = a.triple();
                (a.approval_id, triple)
            })
            .collect();
        let used =
            blocking(move || Ok(caches.plans.used_approvals(&plan_paths, cap, approvals))).await?;
        for (approval_id, attempt) in used {
            self.store
                .consume_approval(&manifest.run_id, &approval_id, attempt)
                .await?;
        }
        Ok(())
    }

    /// Reindexes one run from its manifest path (holding its rows against our writers).
    pub async fn reindex_manifest(
        &self,
        manifest_path: &Path,
    ) -> Result<ReindexReport, RegistryError> {
        let paths = SidecarPaths::for_output(&output_for_manifest(manifest_path));
        let _rows = self.locks.lock_rows(&paths).await?;
        self.reindex_unlocked(manifest_path, None).await
    }

    /// Reindexes one run whose rows are locked. Its drift journal is indexed here, or, given
    /// `merged_drift`, left there (run and path) for [`Self::reindex_drift_merged`].
    async fn reindex_unlocked(
        &self,
        manifest_path: &Path,
        merged_drift: Option<&mut Vec<(String, PathBuf)>>,
    ) -> Result<ReindexReport, RegistryError> {
        let mut report = ReindexReport {
            manifests: 1,
            ..Default::default()
        };
        let output = output_for_manifest(manifest_path);
        let paths = SidecarPaths::for_output(&output);
        let read_path = manifest_path.to_owned();
        let bytes = blocking(move || {
            recovery_sidecar::read_regular(&read_path)
                .map_err(io(format!("reading {}", read_path.display())))
        })
        .await;
        let manifest = match bytes.map(|b| RunManifest::from_json_bytes(&b)) {
            Ok(Ok(manifest)) => manifest,
            Ok(Err(e)) => {
                report
                    .unreadable
                    .push((manifest_path.display().to_string(), e.to_string()));
                return Ok(report);
            }
            Err(e) => {
                report
                    .unreadable
                    .push((manifest_path.display().to_string(), e.to_string()));
                return Ok(report);
            }
        };
        if let Err(why) = usable_run_id(&manifest.run_id) {
            report.unreadable.push((
                manifest_path.display().to_string(),
                format!("run_id {why}: the service cannot name this run"),
            ));
            return Ok(report);
        }
        let now = self.clock.now_text();
        // A known run keeps its creation time and its recorded output path when this manifest is
        // that output's; otherwise the files are the truth and the record follows them.
        let existing = self.store.get_run(&manifest.run_id).await?;
        // A run moved (its old manifest gone) follows its files; a copy (`cp -r` of a run's
        // folder: the recorded manifest still there, naming the same run) is never adopted, or
        // the run would flip between its two outputs.
        if let Some(original) = existing
            .as_ref()
            .map(|e| SidecarPaths::for_output(Path::new(&e.output_path)).manifest)
            && original != manifest_path
        {
            let (check, id) = (original.clone(), manifest.run_id.clone());
            let still_there = blocking(move || {
                Ok(recovery_sidecar::read_regular(&check)
                    .ok()
                    .and_then(|bytes| RunManifest::run_id_of(&bytes))
                    .is_some_and(|other| other == id))
            })
            .await?;
            if still_there {
                report.unreadable.push((
                    manifest_path.display().to_string(),
                    format!(
                        "a copy of run {} (whose manifest is {}): give the copy a new run, or remove it",
                        manifest.run_id,
                        original.display()
                    ),
                ));
                return Ok(report);
            }
        }
        if existing.is_none() {
            report.runs += 1;
        }
        let created = existing
            .as_ref()
            .map_or_else(|| now.clone(), |e| e.created_at.clone());
        let output = existing
            .map(|e| PathBuf::from(e.output_path))
            .filter(|recorded| SidecarPaths::for_output(recorded).manifest == manifest_path)
            .unwrap_or(output);
        let record = run_record(&manifest, &output, &created, &now);
        if let Some(previous) = self.store.upsert_run(&record).await? {
            self.audit_superseded(&previous, &record).await?;
            report.superseded.push((previous, record.run_id.clone()));
        }

        let run_id = manifest.run_id.clone();
        // The append-only journals are read from where the last reindex left them (same file).
        match merged_drift {
            Some(journals) => journals.push((run_id.clone(), paths.resume_drift.clone())),
            None => {
                self.reindex_drift(&run_id, &paths.resume_drift, &mut report)
                    .await?;
            }
        }
        let extension_mark = self.journal_mark(&paths.attempt_extension).await?;
        let journals = (
            paths.rerun_masked.clone(),
            paths.attempt_extension.clone(),
            paths.resubmit_offset.clone(),
        );
        let extension_start = extension_mark.map_or(0, |m| m.start);
        // A journal that cannot be read (a symbolic link, which is never followed, or an IO
        // error) is reported and indexed as empty: reindex never fails on one run's files.
        let approvals_path = paths.rerun_masked.display().to_string();
        let (approvals, extensions, offsets, problems) = blocking(move || {
            let mut problems = Vec::new();
            let mut read_from = |path: &PathBuf, start: u64| {
                read_lines_from(path, start).unwrap_or_else(|e| {
                    problems.push((path.display().to_string(), e.to_string()));
                    Vec::new()
                })
            };
            let approvals = read_from(&journals.0, 0);
            let extensions = read_from(&journals.1, extension_start);
            let offsets = read_from(&journals.2, 0);
            let plain = |lines: Vec<(u64, Vec<u8>)>| -> Vec<Vec<u8>> {
                lines.into_iter().map(|(_, line)| line).collect()
            };
            Ok((plain(approvals), extensions, plain(offsets), problems))
        })
        .await?;
        let approvals_readable = !problems.iter().any(|(path, _)| *path == approvals_path);
        report.unreadable.extend(problems);
        let journal = ApprovalJournal::of_lines(approvals.iter().map(Vec::as_slice));
        report.unreadable.extend(
            journal
                .unreadable
                .into_iter()
                .map(|(number, why)| (format!("{}:{number}", paths.rerun_masked.display()), why)),
        );
        // The journal decides (see `approvals`); an unreadable one changes nothing.
        let mut inserted = Vec::new();
        let follows = if approvals_readable {
            let recorded = self.store.list_approvals(&run_id).await?;
            follow_journal(&run_id, &recorded, journal.approvals)
        } else {
            Vec::new()
        };
        for follow in follows {
            match follow {
                Follow::Insert(record) => {
                    if self.store.insert_approval(&record).await? {
                        report.approvals_inserted += 1;
                        inserted.push(record);
                    }
                }
                Follow::Restore(record) => {
                    if self.store.restore_approval(&record).await? {
                        report.approvals_restored += 1;
                        inserted.push(record);
                    }
                }
                Follow::Revoke(approval_id) => {
                    if self
                        .store
                        .revoke_approval(&run_id, &approval_id, &now)
                        .await?
                    {
                        report.approvals_revoked += 1;
                    }
                }
            }
        }
        self.mark_used_approvals(&paths, &manifest, inserted)
            .await?;
        let mut records = Vec::with_capacity(extensions.len());
        // Blank lines are no lines (`recovery_core::rows::is_blank`), in every journal.
        for (offset, bytes) in &extensions {
            if recovery_core::rows::is_blank(bytes) {
                continue;
            }
            // As the plan reads the journal (decisions §6: N >= 1), so the database never
            // lists an extension the plan refuses (hostile review 48).
            let parsed = recovery_core::journals::parse_line::<ExtensionLine>(bytes)
                .map_err(|e| e.to_string())
                .and_then(|line| match line.extend_attempts {
                    1.. => Ok(line),
                    _ => Err(recovery_core::journals::EXTENSION_REFUSED.to_owned()),
                });
            match parsed {
                Ok(line) => {
                    let id = line_id(&run_id, EXTENSION_JOURNAL, *offset, bytes);
                    records.push(extension_record(&run_id, id, line));
                }
                Err(why) => report.unreadable.push((
                    format!("{}@{offset}", paths.attempt_extension.display()),
                    why,
                )),
            }
        }
        report.extensions_inserted += self.store.insert_extensions(&records).await?;
        let end = extensions
            .last()
            .map(|(offset, line)| offset + line.len() as u64 + 1);
        self.advance_mark(&paths.attempt_extension, extension_mark, end)
            .await?;
        for (number, line) in offsets.iter().enumerate() {
            if recovery_core::rows::is_blank(line) {
                continue;
            }
            match std::str::from_utf8(line)
                .ok()
                // As the plan reads it (a count, never negative: hostile review 49).
                .and_then(|t| t.trim().parse::<u64>().ok())
                .and_then(|count| i64::try_from(count).ok())
            {
                Some(offset) => {
                    let resubmit = Resubmit {
                        event_id: resubmit_id(&run_id, number + 1),
                        run_id: run_id.clone(),
                        at: now.clone(),
                        by: "reindex".into(),
                        line_offset: offset,
                    };
                    report.resubmits_inserted +=
                        usize::from(self.store.insert_resubmit(&resubmit).await?);
                }
                None => report.unreadable.push((
                    format!("{}:{}", paths.resubmit_offset.display(), number + 1),
                    "not a line count".into(),
                )),
            }
        }
        for (attempt_key, pending) in &manifest.pending_rejudge {
            let rejudgment = Rejudgment {
                operation_id: pending.operation_id.clone(),
                run_id: run_id.clone(),
                attempt_key: attempt_key.clone(),
                admitted_at: unix_to_text(pending.admitted_at),
                predecessor_failure_id: pending.predecessor_failure_id.clone(),
                predecessor_sha256: pending.predecessor_sha256.clone(),
                closed_at: None,
                outcome: None,
            };
            report.rejudgments_inserted +=
                usize::from(self.store.insert_rejudgment(&rejudgment).await?);
        }
        Ok(report)
    }
}

/// Bytes of a journal's fingerprint before its mark (see [`bytes_before`]).
const BEFORE_MARK_BYTES: u64 = 4096;

/// A journal's identity as its mark records it: device, inode and length (of the entry itself:
/// a link is never followed), or `None` when nothing is there.
fn journal_identity(path: &Path) -> Option<(i64, i64, i64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev() as i64, m.ino() as i64, m.len() as i64))
}

/// SHA-256 (hex) of the up to [`BEFORE_MARK_BYTES`] bytes of the file at `path` that end at
/// `end`: what a journal's mark remembers of the lines before it. `None` when they cannot be
/// read (the file is gone, shorter, or a symbolic link, which journals never follow).
fn bytes_before(path: &Path, end: u64) -> Option<String> {
    use sha2::Digest as _;
    use std::os::unix::fs::FileExt as _;
    // Only a regular file, opened without waiting: a FIFO planted as a journal would block the
    // open until some writer came, and the reindex with it (hostile review 50, F4).
    let file = recovery_sidecar::open_regular(path).ok()?;
    let start = end.saturating_sub(BEFORE_MARK_BYTES);
    let mut bytes = vec![0; (end - start) as usize];
    file.read_exact_at(&mut bytes, start).ok()?;
    Some(format!("{:x}", sha2::Sha256::digest(&bytes)))
}

/// An append-only journal's identity and where its reading starts.
#[derive(Debug, Clone, Copy)]
struct JournalMark {
    device: i64,
    inode: i64,
    start: u64,
}

/// A line that could not be indexed: where (path and offset) and why.
type Unreadable = (String, String);

/// One batch of a drift journal, parsed.
struct DriftBatch {
    /// Each line's event and where the line ends.
    events: Vec<(u64, DriftEvent)>,
    unreadable: Vec<(String, String)>,
    /// Where the batch's last line ends (where the next batch starts).
    end: u64,
    /// The batch is as long as a batch may be: more lines may follow.
    full: bool,
}

/// Runs whose drift journals a start-up reindex merges (see [`Registry::reindex_at_start`]).
/// Each journal is read [`MERGED_BATCH`] / runs lines at a time, at least [`MERGED_LINES_MIN`]:
/// the events read ahead stay under 20k + 200 x 100 whatever the runs.
const MERGED_RUNS: usize = 200;
/// The fewest lines of a merged journal read at a time.
const MERGED_LINES_MIN: usize = 100;
/// Runs a reindex takes together when their drift journals hold nothing new (their rows locked
/// for as long as their sidecars take), and the runs with lines to index that a reindex beside
/// the service's other work merges ([`Registry::reindex`]).
const GROUP_RUNS: usize = 8;
/// Events one transaction of a merged reindex inserts.
const MERGED_BATCH: usize = 20_000;

/// A drift journal being merged with others ([`Registry::reindex_drift_merged`]).
struct MergedJournal {
    run_id: String,
    path: PathBuf,
    mark: JournalMark,
    /// The events of the batch read last not merged yet, each with where its line ends.
    events: std::collections::VecDeque<(u64, DriftEvent)>,
    /// Where the batch read last ends (where the next one starts).
    batch_end: u64,
    /// More lines may follow the batch read last.
    more: bool,
    /// Where the lines merged so far end: what the mark may move to once they are inserted.
    merged_to: u64,
    /// Where the mark was last asked to move (a journal whose merging did not move is not
    /// marked again).
    marked_to: u64,
    /// Lines read at a time.
    batch_lines: usize,
}

impl MergedJournal {
    fn new(run_id: String, path: PathBuf, mark: JournalMark, batch_lines: usize) -> Self {
        Self {
            run_id,
            path,
            mark,
            batch_lines,
            events: std::collections::VecDeque::new(),
            batch_end: mark.start,
            more: true,
            merged_to: mark.start,
            marked_to: mark.start,
        }
    }

    /// Once every event read is merged, reads on until an event is there or the journal ends
    /// (a batch may hold only unreadable lines).
    async fn refill(&mut self, report: &mut ReindexReport) -> Result<(), RegistryError> {
        while self.events.is_empty() && self.more {
            self.read_batch(report).await?;
        }
        Ok(())
    }

    /// Reads the next batch.
    async fn read_batch(&mut self, report: &mut ReindexReport) -> Result<(), RegistryError> {
        // Parsed on one thread: the database's writer is what bounds a merged reindex, and a
        // second parser took its core from it (measured, 1M lines over 4 runs: 196k lines/s
        // with two parse threads, 204k with one; means of three).
        match read_drift_batch(
            &self.run_id,
            &self.path,
            self.batch_end,
            self.batch_lines,
            1,
        )
        .await?
        {
            Ok(batch) => {
                report.unreadable.extend(batch.unreadable);
                self.events = batch.events.into();
                self.batch_end = batch.end;
                self.more = batch.full;
                if self.events.is_empty() {
                    self.merged_to = batch.end;
                }
            }
            // Reported, and this journal is read no further (its mark stays): a reindex never
            // fails on one run's files.
            Err(e) => {
                report
                    .unreadable
                    .push((self.path.display().to_string(), e.to_string()));
                self.more = false;
            }
        }
        Ok(())
    }

    /// The next event in time order, taken (and how far this journal is then merged).
    fn take(&mut self) -> Option<DriftEvent> {
        let (end, event) = self.events.pop_front()?;
        // A batch merged whole is merged to its end (past any unreadable lines at its end).
        self.merged_to = if self.events.is_empty() {
            self.batch_end
        } else {
            end
        };
        Some(event)
    }
}

/// The next [`MERGED_BATCH`] events of `journals` in time order (each journal's own order kept
/// where its times go back), and where the mark of each journal they moved may move once they are
/// inserted.
async fn merge_drift_batch(
    journals: &mut [MergedJournal],
    report: &mut ReindexReport,
) -> Result<(Vec<DriftEvent>, Vec<(PathBuf, JournalMark, u64)>), RegistryError> {
    for journal in journals.iter_mut() {
        journal.refill(report).await?;
    }
    // The journals by their next event's time (then their place: the earlier journal first).
    let front = |journal: &MergedJournal, n: usize| {
        let at = &journal.events.front()?.1.at;
        Some(std::cmp::Reverse((at.clone(), n)))
    };
    let mut next: std::collections::BinaryHeap<_> = journals
        .iter()
        .enumerate()
        .filter_map(|(n, journal)| front(journal, n))
        .collect();
    let mut events = Vec::with_capacity(MERGED_BATCH);
    while events.len() < MERGED_BATCH {
        let Some(std::cmp::Reverse((_, n))) = next.pop() else {
            break;
        };
        events.extend(journals[n].take());
        // Only the journal taken from can have run out.
        journals[n].refill(report).await?;
        next.extend(front(&journals[n], n));
    }
    let marks = journals
        .iter_mut()
        .filter(|journal| journal.merged_to != journal.marked_to)
        .map(|journal| {
            journal.marked_to = journal.merged_to;
            (journal.path.clone(), journal.mark, journal.merged_to)
        })
        .collect();
    Ok((events, marks))
}

/// Lines of a drift journal read at a time when it is indexed on its own.
const DRIFT_BATCH: usize = 20_000;

/// Reads and parses the batch of `path`'s `lines` lines that starts at byte `start` (blocking work,
/// off the executor); the inner error is the journal's own (reported, never fatal).
async fn read_drift_batch(
    run_id: &str,
    path: &Path,
    start: u64,
    lines: usize,
    threads: usize,
) -> Result<Result<DriftBatch, std::io::Error>, RegistryError> {
    let (read_path, run) = (path.to_owned(), run_id.to_owned());
    blocking(move || {
        Ok(
            read_lines_batch(&read_path, start, lines).map(|(lines_read, end)| {
                let full = lines_read.len() == lines;
                let lines = lines_read;
                let (events, unreadable) = parse_drift_lines(&run, &read_path, lines, threads);
                DriftBatch {
                    events,
                    unreadable,
                    end,
                    full,
                }
            }),
        )
    })
    .await
}

/// The drift event of the journal line at `offset`, its time stored in the one UTC form every
/// query compares as text (a collector's `+00:00` or another offset names the same instant);
/// the id is the line's, whatever form its time was written in.
fn drift_line_event(run_id: &str, offset: u64, bytes: &[u8]) -> Result<DriftEvent, String> {
    let mut line =
        recovery_core::journals::parse_line::<DriftLine>(bytes).map_err(|e| e.to_string())?;
    // The journal beside a manifest is that run's: a line naming another run would show in
    // that run's history (or a run that does not exist), so it is reported, not indexed.
    if line.run_id != run_id {
        return Err(format!(
            "run_id: {:?} is not the run of the manifest beside this journal ({run_id})",
            line.run_id
        ));
    }
    line.at = recovery_sidecar::normalize_rfc3339(&line.at)
        .map_err(|_| format!("at: {:?} is not an RFC 3339 time", line.at))?;
    Ok(drift_event(
        line_id(run_id, DRIFT_JOURNAL, offset, bytes),
        line,
    ))
}

/// Drift events of journal lines, parsed and identified on `threads` threads; unreadable lines are
/// reported (path@offset and why).
fn parse_drift_lines(
    run_id: &str,
    path: &Path,
    mut lines: Vec<(u64, Vec<u8>)>,
    threads: usize,
) -> (Vec<(u64, DriftEvent)>, Vec<Unreadable>) {
    // Blank lines are no lines, as in every JSONL file (hostile review 45: an empty line was
    // reported unreadable with the parser's "EOF while parsing a value").
    lines.retain(|(_, bytes)| !recovery_core::rows::is_blank(bytes));
    let parse = |part: &[(u64, Vec<u8>)]| -> Vec<Result<(u64, DriftEvent), (String, String)>> {
        part.iter()
            .map(|(offset, bytes)| {
                // The line and its newline.
                let end = offset + bytes.len() as u64 + 1;
                drift_line_event(run_id, *offset, bytes)
                    .map(|event| (end, event))
                    .map_err(|why| (format!("{}@{offset}", path.display()), why))
            })
            .collect()
    };
    let size = lines.len().div_ceil(threads.max(1)).max(1024);
    let parsed: Vec<Result<(u64, DriftEvent), (String, String)>> = std::thread::scope(|scope| {
        let parts: Vec<_> = lines
            .chunks(size)
            .map(|part| scope.spawn(move || parse(part)))
            .collect();
        parts
            .into_iter()
            // A parser that panicked stops the reindex (the mark stays): no line is skipped.
            .flat_map(|part| part.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let mut events = Vec::with_capacity(parsed.len());
    let mut unreadable = Vec::new();
    for result in parsed {
        match result {
            Ok(event) => events.push(event),
            Err(problem) => unreadable.push(problem),
        }
    }
    (events, unreadable)
}

/// The approvals journal `bytes` without the lines that carry `approval_id` (the first
/// whole one approves; a later one reusing the id approves nothing, and would approve once
/// the first was gone), an unterminated last line that carries it included (the next append
/// ends it, and it would approve under the revoked id: hostile review 41); every other byte
/// kept as it was. `None` when no line carries it. (A revocation dropped any unterminated
/// last line, and a duplicate id's line approved in the plan while the list never showed it:
/// hostile review 40.)
fn without_approval(bytes: &[u8], approval_id: &str) -> Option<Vec<u8>> {
    let mut kept = Vec::with_capacity(bytes.len());
    let mut removed = false;
    for line in bytes.split_inclusive(|&b| b == b'\n') {
        let whole = line.strip_suffix(b"\n").unwrap_or(line);
        let carries_id = ApprovalLine::parse(whole).is_ok_and(|a| a.approval_id == approval_id);
        removed |= carries_id;
        if !carries_id {
            kept.extend_from_slice(line);
        }
    }
    removed.then_some(kept)
}

/// Unix seconds as fixed-width RFC 3339 text.
pub fn unix_to_text(seconds: f64) -> String {
    let nanos = (seconds * 1e9) as i128;
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .map(recovery_sidecar::format_rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00.000000Z".into())
}

/// Appends a journal line (under the run's lock: one writer) and returns its derived id.
fn drift_event(id: String, line: DriftLine) -> DriftEvent {
    DriftEvent {
        event_id: line.id.unwrap_or(id),
        run_id: line.run_id,
        at: line.at,
        saved_config_digest: line.saved_config_digest,
        current_config_digest: line.current_config_digest,
        operational_keys: line.operational_keys,
    }
}

/// The approvals the run's journal holds now, as the plan reads them; `None` when the journal
/// cannot be read (the database's list is all there is to show).
pub(crate) async fn journalled_approvals(paths: &SidecarPaths) -> Option<Vec<ApprovalLine>> {
    let path = paths.rerun_masked.clone();
    let lines = blocking(move || {
        read_lines_from(&path, 0).map_err(io(format!("reading {}", path.display())))
    })
    .await
    .ok()?;
    let journal = ApprovalJournal::of_lines(lines.iter().map(|(_, line)| line.as_slice()));
    Some(journal.approvals)
}

fn extension_record(run_id: &str, id: String, line: ExtensionLine) -> AttemptExtension {
    AttemptExtension {
        event_id: line.id.unwrap_or(id),
        run_id: run_id.to_owned(),
        at: line.at,
        by: line.by,
        reason: line.reason,
        extend_attempts: line.extend_attempts,
    }
}

/// A manifest an operator's replacement set aside: its order among its output's, its path and
/// the suffix its files were given.
struct SetAside {
    order: (i64, u64),
    path: PathBuf,
    suffix: String,
}

/// The manifests under the roots (symlinks not followed, hidden temporaries skipped), in one
/// walk: every `*_manifest.json` in place, sorted, and every one an operator's replacement set
/// aside (`<stem>_manifest.json.replaced-<unix seconds>`, then `-2`, `-3`, ... as
/// [`crate::operations`] names them) by the manifest path it was set aside from, each output's
/// in the order they were set aside.
struct FoundManifests {
    in_place: Vec<PathBuf>,
    set_aside: std::collections::BTreeMap<PathBuf, Vec<SetAside>>,
}

fn find_manifests(roots: &[PathBuf]) -> FoundManifests {
    let mut found = FoundManifests {
        in_place: Vec::new(),
        set_aside: Default::default(),
    };
    for root in roots {
        for entry in walkdir::WalkDir::new(root)
            .follow_links(false)
            .into_iter()
            .filter_map(Result::ok)
        {
            let name = entry.file_name().to_string_lossy();
            if !entry.file_type().is_file() || name.starts_with('.') {
                continue;
            }
            if name.ends_with("_manifest.json") {
                found.in_place.push(entry.into_path());
                continue;
            }
            let Some(at) = name.find("_manifest.json.replaced-") else {
                continue;
            };
            let (base, suffix) = name.split_at(at + "_manifest.json".len());
            let Some(order) = replacement_order(suffix) else {
                continue;
            };
            let set_aside = SetAside {
                order,
                path: entry.path().to_owned(),
                suffix: suffix.to_owned(),
            };
            found
                .set_aside
                .entry(entry.path().with_file_name(base))
                .or_default()
                .push(set_aside);
        }
    }
    found.in_place.sort();
    for set_aside in found.set_aside.values_mut() {
        set_aside.sort_by_key(|s| s.order);
    }
    found
}

/// The order of a replacement's suffix (`.replaced-<seconds>` or `.replaced-<seconds>-<n>`).
fn replacement_order(suffix: &str) -> Option<(i64, u64)> {
    let rest = suffix.strip_prefix(".replaced-")?;
    let (seconds, n) = match rest.split_once('-') {
        Some((seconds, n)) => (seconds, n.parse().ok()?),
        None => (rest, 1),
    };
    Some((seconds.parse().ok()?, n))
}

/// The output a manifest belongs to: `<stem>.jsonl` when present, else another file with that
/// stem that is not a companion, else `<stem>.jsonl`.
pub fn output_for_manifest(manifest: &Path) -> PathBuf {
    let name = manifest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name
        .strip_suffix("_manifest.json")
        .unwrap_or(&name)
        .to_owned();
    let default = manifest.with_file_name(format!("{stem}.jsonl"));
    if default.exists() {
        return default;
    }
    let directory = manifest.parent().map(Path::to_owned).unwrap_or_default();
    let candidate = std::fs::read_dir(&directory).ok().and_then(|entries| {
        entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|path| {
                let file = path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                // The output is the stem itself (no suffix: `a`, or `a.` whose stem keeps its
                // dot) or the stem and one suffix.
                path.is_file()
                    && file.strip_prefix(&stem).is_some_and(|rest| {
                        rest.is_empty()
                            || (rest.starts_with('.')
                                && rest.matches('.').count() == 1
                                && !rest.contains('_'))
                    })
            })
    });
    candidate.unwrap_or(default)
}

/// The run lock of the run `name` in `dir` belongs to (a companion by its suffix, else an
/// output), when that run exists; `None` for a file of no run (a user's file that only looks
/// like a temporary is never touched).
fn run_lock_of(dir: &std::path::Path, name: &str) -> Option<PathBuf> {
    let output = recovery_sidecar::paths::COMPANION_SUFFIXES
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .map(|stem| dir.join(format!("{stem}.jsonl")));
    let output = output.unwrap_or_else(|| dir.join(name));
    // A run has its lock file (the service and Python collectors create it before writing
    // anything); a stem without one is no run, and nothing of it is touched.
    let lock = recovery_sidecar::SidecarPaths::for_output(&output).run_lock;
    lock.is_file().then_some(lock)
}

/// Whether a run id read from a manifest on disk can name a run in URLs, rows and pages: one
/// to 256 bytes of printable text without `/` or surrounding spaces (the ids collectors
/// write are 32 hex digits).
fn usable_run_id(id: &str) -> Result<(), &'static str> {
    if id.is_empty() {
        return Err("is empty");
    }
    if id.len() > 256 {
        return Err("is longer than 256 bytes");
    }
    if id.trim() != id {
        return Err("has surrounding spaces");
    }
    if id.chars().any(|c| c.is_control() || c == '/') {
        return Err("holds a control character or a slash");
    }
    Ok(())
}
