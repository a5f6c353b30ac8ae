//! Reading a run's sidecar files into the core's inputs (blocking file work: callers run it on the
//! blocking pool). Nothing here writes.

/// Why a run's files cannot be read into a plan.
#[derive(Debug, thiserror::Error)]
pub enum RunFilesError {
    /// The run has no manifest.
    #[error("{0}")]
    NoManifest(String),
    /// The manifest or the materialized inputs cannot be read.
    #[error("{0}")]
    ManifestUnreadable(String),
    /// Saved rows or journals cannot be planned (a malformed line, an inconsistent record).
    #[error("{0}")]
    RowsInvalid(String),
    /// The run's files contradict its manifest (facts §11.2, §11.6): a companion it needs is
    /// missing, the materialized inputs do not match it, or an older collector's draft journal
    /// is beside it. Nothing is planned, reserved or resumed over such a run.
    #[error("{0}")]
    Inconsistent(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}
use recovery_core::failure::ClassificationPolicy;
use recovery_core::identity::RowReferences;
use recovery_core::journals;
use recovery_core::manifest::RunManifest;
use recovery_core::materialized::materialized_digest;
use recovery_core::plan::ResumePlan;
use recovery_core::rows::scan_materialized;
use recovery_core::verdict::{SavedManifest, SavedRun};
use recovery_sidecar::SidecarPaths;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The load-time checks of a run whose manifest exists (facts §11.2, §11.6, scenario 30): the
/// output, the failures sidecar and the materialized inputs are all there (a run never falls
/// back to a fresh start, nor resumes saved outcomes without their output), and no draft
/// dispatch journal of an older collector (`<stem>_attempts.jsonl`) is beside them. Plans,
/// reservations and validations make these checks before anything else.
pub fn check_run_files(paths: &SidecarPaths) -> Result<(), RunFilesError> {
    if !paths.manifest.exists() {
        return Ok(());
    }
    let required = [&paths.output, &paths.failures, &paths.materialized];
    // A link, FIFO, socket or directory where a run's file belongs is named as such (its
    // readers refuse it too; a validation that reads only cached facts must as well), not as
    // missing. One `lstat` per file answers both questions: every validate makes these checks.
    let mut missing: Vec<String> = Vec::new();
    for path in required {
        let Ok(found) = std::fs::symlink_metadata(path) else {
            missing.push(path.display().to_string());
            continue;
        };
        let why = if found.file_type().is_symlink() {
            "a symbolic link, which is never followed"
        } else if !found.is_file() {
            "not a regular file (a directory, FIFO, socket or device)"
        } else {
            continue;
        };
        return Err(RunFilesError::Inconsistent(format!(
            "Cannot resume: {} is {why}",
            path.display()
        )));
    }
    if !missing.is_empty() {
        return Err(RunFilesError::Inconsistent(format!(
            "Cannot resume: {} {} missing beside {} (a run with a manifest never starts fresh)",
            missing.join(", "),
            if missing.len() == 1 { "is" } else { "are" },
            paths.manifest.display()
        )));
    }
    if paths.draft_journal.exists() {
        return Err(RunFilesError::Inconsistent(format!(
            "Cannot resume: {} is the draft dispatch journal of an older collector (schema 1); \
             this run's attempts cannot be known. Move it aside once its outcomes are accounted for.",
            paths.draft_journal.display()
        )));
    }
    Ok(())
}

/// Refuses a plan or a reservation over materialized inputs that are not the ones the manifest
/// recorded (validations refuse them as a mismatch, which `allow_unsafe` can override).
pub fn check_materialized_digest(
    manifest: &RunManifest,
    digest: &str,
    paths: &SidecarPaths,
) -> Result<(), RunFilesError> {
    if manifest.materialized_digest == digest {
        return Ok(());
    }
    Err(RunFilesError::Inconsistent(format!(
        "The materialized inputs {} do not match the run manifest (digest {digest}, recorded {})",
        paths.materialized.display(),
        manifest.materialized_digest
    )))
}

/// The materialized digest of a JSONL file.
pub fn digest_rows_file(path: &Path) -> Result<String, String> {
    let file =
        recovery_sidecar::open_regular(path).map_err(|e| format!("{}: {e}", path.display()))?;
    materialized_digest(file, threads())
        .map(|d| d.sha256)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The server references of a materialized-inputs file.
pub fn row_references(path: &Path) -> Result<RowReferences, String> {
    let file =
        recovery_sidecar::open_regular(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut references = RowReferences::default();
    // The collector's reading of its rows (text mode, Python-blank lines skipped): the server
    // selection sees exactly the rows the digest was taken of.
    scan_materialized::<std::convert::Infallible>(file, &path.display().to_string(), |_, row| {
        references.add_row(&row);
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    Ok(references)
}

/// The saved manifest, as `validate_resume` sees it.
pub fn read_manifest(path: &Path) -> SavedManifest {
    match recovery_sidecar::read_regular(path) {
        Ok(bytes) => match RunManifest::from_json_bytes(&bytes) {
            Ok(manifest) => SavedManifest::Read(Box::new(manifest)),
            Err(e) => SavedManifest::Unreadable(e.to_string()),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => SavedManifest::Missing,
        Err(e) => SavedManifest::Unreadable(e.to_string()),
    }
}

/// Everything a resume is checked against.
pub fn read_saved_run(paths: &SidecarPaths) -> SavedRun {
    let identity = recovery_sidecar::read_regular(&paths.identity)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok());
    SavedRun {
        manifest_path: paths.manifest.display().to_string(),
        manifest: read_manifest(&paths.manifest),
        materialized: digest_rows_file(&paths.materialized),
        identity,
    }
}

/// The run's saved classification policy, or the shared defaults for a standalone output; a
/// malformed saved policy is an error, never replaced by defaults.
pub fn classification_policy(paths: &SidecarPaths) -> Result<ClassificationPolicy, RunFilesError> {
    match recovery_sidecar::read_regular(&paths.classification_policy) {
        Ok(bytes) => ClassificationPolicy::from_json(&bytes).map_err(|e| {
            RunFilesError::RowsInvalid(format!("{}: {e}", paths.classification_policy.display()))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ClassificationPolicy::default()),
        Err(source) => Err(RunFilesError::Io {
            context: format!("reading {}", paths.classification_policy.display()),
            source,
        }),
    }
}

/// A run's budget journals.
#[derive(Debug, Clone, Default)]
pub struct BudgetInputs {
    /// Attempts added to every rollout's cap.
    pub extension: u64,
    /// Failures-sidecar and results-file line counts at the last resubmit.
    pub options: recovery_core::plan::IndexOptions,
    /// Approved masked reruns.
    pub approvals: BTreeSet<journals::ApprovalTriple>,
}

/// Budget inputs of a run: the extension (an unreadable record stops, never guesses a cap), the
/// resubmit offsets and the approvals (unreadable lines approve nothing).
pub fn budget_inputs(paths: &SidecarPaths) -> Result<BudgetInputs, RunFilesError> {
    let invalid = |e: journals::JournalError| RunFilesError::RowsInvalid(e.to_string());
    let extension = match optional_companion(&paths.attempt_extension)? {
        Some(file) => {
            journals::attempt_extension(file, &paths.attempt_extension.display().to_string())
                .map_err(invalid)?
        }
        None => 0,
    };
    let offset = |path: &std::path::Path| match optional_companion(path)? {
        Some(file) => journals::resubmit_offset(file, &path.display().to_string()).map_err(invalid),
        None => Ok(0),
    };
    let options = recovery_core::plan::IndexOptions {
        resubmit_offset: offset(&paths.resubmit_offset)?,
        resubmit_results_offset: offset(&paths.resubmit_results_offset)?,
    };
    let approvals = optional_companion(&paths.rerun_masked)?
        .map(journals::rerun_masked_approvals)
        .unwrap_or_default();
    Ok(BudgetInputs {
        extension,
        options,
        approvals,
    })
}

/// A companion a run may lack: `None` when absent; one that is there but cannot be read as a
/// regular file (a symbolic link, a FIFO, a directory) makes the run's files invalid, never a
/// silent default.
fn optional_companion(path: &std::path::Path) -> Result<Option<std::fs::File>, RunFilesError> {
    match recovery_sidecar::open_regular(path) {
        Ok(file) => Ok(Some(file)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(RunFilesError::Inconsistent(format!(
            "{} cannot be read: {e}",
            path.display()
        ))),
    }
}

/// The resume plan of a run from its files, built from scratch (nothing cached).
pub fn build_plan(
    paths: &SidecarPaths,
    default_cap: u64,
) -> Result<(RunManifest, ResumePlan), RunFilesError> {
    crate::plans::plan_once(paths, default_cap, |plan| {
        (plan.manifest.clone(), plan.resume_plan())
    })
}
