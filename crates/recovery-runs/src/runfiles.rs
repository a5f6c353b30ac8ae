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
use recovery_core::rows::scan_jsonl;
use recovery_core::verdict::{SavedManifest, SavedRun};
use recovery_sidecar::SidecarPaths;
use serde_json::Value;
use std::collections::BTreeSet;
use std::fs::File;
use std::path::Path;

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The materialized digest of a JSONL file.
pub fn digest_rows_file(path: &Path) -> Result<String, String> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    materialized_digest(file, threads())
        .map(|d| d.sha256)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The server references of a materialized-inputs file.
pub fn row_references(path: &Path) -> Result<RowReferences, String> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut references = RowReferences::default();
    scan_jsonl::<std::convert::Infallible>(file, &path.display().to_string(), |record| {
        references.add_row(&record.value);
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    Ok(references)
}

/// The saved manifest, as `validate_resume` sees it.
pub fn read_manifest(path: &Path) -> SavedManifest {
    match std::fs::read(path) {
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
    let identity = std::fs::read(&paths.identity)
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
    match std::fs::read(&paths.classification_policy) {
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

/// A run's budget journals: attempt extension, resubmit offset, approved masked reruns.
pub type BudgetInputs = (u64, u64, BTreeSet<journals::ApprovalTriple>);

/// Budget inputs of a run: the extension (an unreadable record stops, never guesses a cap), the
/// resubmit offset and the approvals (unreadable lines approve nothing).
pub fn budget_inputs(paths: &SidecarPaths) -> Result<BudgetInputs, RunFilesError> {
    let invalid = |e: journals::JournalError| RunFilesError::RowsInvalid(e.to_string());
    let extension = match File::open(&paths.attempt_extension) {
        Ok(file) => {
            journals::attempt_extension(file, &paths.attempt_extension.display().to_string())
                .map_err(invalid)?
        }
        Err(_) => 0,
    };
    let offset = match File::open(&paths.resubmit_offset) {
        Ok(file) => journals::resubmit_offset(file, &paths.resubmit_offset.display().to_string())
            .map_err(invalid)?,
        Err(_) => 0,
    };
    let approvals = File::open(&paths.rerun_masked)
        .map(journals::rerun_masked_approvals)
        .unwrap_or_default();
    Ok((extension, offset, approvals))
}

/// The resume plan of a run from its files, built from scratch (nothing cached).
pub fn build_plan(
    paths: &SidecarPaths,
    default_cap: u64,
) -> Result<(RunManifest, ResumePlan), RunFilesError> {
    crate::plans::plan_once(paths, default_cap, |plan| {
        (plan.manifest.clone(), plan.view().plan())
    })
}
