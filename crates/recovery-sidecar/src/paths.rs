//! Companion file names (decisions §6) and output path confinement.
//!
//! Invariants: a companion of output `D/NAME.EXT` is `D/<stem><suffix>` with the stem Python's
//! `Path.stem` (the name without its last extension); manifest-derived files hang off the
//! manifest's stem; every output path the service touches is resolved (symlinks followed) and lies
//! under a configured root, `..` components are refused outright.

use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};

/// Why an output path is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("path {0:?} must not contain '..'")]
    ParentComponent(PathBuf),
    #[error("path {0:?} has no file name")]
    NoFileName(PathBuf),
    #[error("path {path:?} resolves to {resolved:?}, outside the allowed roots ({roots})")]
    OutsideRoots {
        path: PathBuf,
        resolved: PathBuf,
        roots: String,
    },
    #[error("path {path:?} cannot be resolved: {source}")]
    Unresolvable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("path {0:?} is a symbolic link to nothing: the service never writes through one")]
    DanglingSymlink(PathBuf),
    #[error(
        "output path {path:?}: its companion {companion:?} (with the temporary name an atomic write \
         uses) would exceed the {NAME_MAX}-byte file name limit; shorten the file name to at most \
         {max_stem} bytes before its extension"
    )]
    NameTooLong {
        path: PathBuf,
        companion: String,
        max_stem: usize,
    },
    #[error(
        "output path {0:?} is named like an atomic write's temporary (.<name>.<32 hex>.tmp), which \
         a restart removes; choose another name"
    )]
    LooksTemporary(PathBuf),
    #[error(
        "output path {path:?}: its companions and their temporaries would exceed the {max}-byte \
         path limit; use a shorter path"
    )]
    PathTooLong { path: PathBuf, max: usize },
    #[error("path {0:?} has a component longer than the {NAME_MAX}-byte file name limit")]
    ComponentTooLong(PathBuf),
    #[error(
        "output path {path:?}: its companion {companion:?} is not a regular file (a directory, \
         FIFO, socket or device)"
    )]
    CompanionNotAFile { path: PathBuf, companion: PathBuf },
    /// A run's journal is a link, no regular file, or a file with other names: nothing is
    /// appended to it.
    #[error(
        "{0:?}: a run's journal must be a regular file with one name (a symbolic link, FIFO, \
         socket, directory or a file with hard links is never written to); move it aside"
    )]
    JournalNotAFile(PathBuf),
    #[error("root {path:?} cannot be used: {source}")]
    BadRoot {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The directories output paths must lie under.
#[derive(Debug, Clone)]
pub struct Confinement {
    roots: Vec<PathBuf>,
}

impl Confinement {
    /// Roots are canonicalized once; each must exist.
    pub fn new(roots: impl IntoIterator<Item = PathBuf>) -> Result<Self, PathError> {
        let roots = roots
            .into_iter()
            .map(|root| {
                std::fs::canonicalize(&root)
                    .map_err(|source| PathError::BadRoot { path: root, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { roots })
    }

    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// Resolves an output path (relative paths are taken under the first root) and checks it
    /// lies under a root, following every symlink of the part that exists.
    pub fn resolve(&self, requested: &Path) -> Result<PathBuf, PathError> {
        if requested.components().any(|c| c == Component::ParentDir) {
            return Err(PathError::ParentComponent(requested.to_owned()));
        }
        let absolute = if requested.is_absolute() {
            requested.to_owned()
        } else {
            self.roots
                .first()
                .map_or_else(|| requested.to_owned(), |root| root.join(requested))
        };
        if absolute.file_name().is_none() {
            return Err(PathError::NoFileName(requested.to_owned()));
        }
        // The directories' names (the file's own name is checked with its companions').
        let too_long = absolute
            .parent()
            .is_some_and(|dir| dir.components().any(|c| c.as_os_str().len() > NAME_MAX));
        if too_long {
            return Err(PathError::ComponentTooLong(requested.to_owned()));
        }
        // Resolve the longest existing prefix; the rest does not exist, so it holds no symlink.
        // A component that vanishes meanwhile (a replacement renaming the output) moves the
        // prefix up instead of failing.
        let mut existing = absolute.clone();
        let mut missing: Vec<OsString> = Vec::new();
        // Times a name that was missing to `canonicalize` is found again as something else
        // than a link (created meanwhile: a replacement writing the output anew) and resolved
        // again; bounded, so two readings that keep disagreeing end.
        let mut reappeared = 0;
        let mut resolved = loop {
            match std::fs::canonicalize(&existing) {
                Ok(resolved) => break resolved,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    match std::fs::symlink_metadata(&existing) {
                        // A link to nothing would be followed by the file's creation, to
                        // anywhere.
                        Ok(found) if found.file_type().is_symlink() => {
                            return Err(PathError::DanglingSymlink(requested.to_owned()));
                        }
                        // Gone between the two readings and back (the concurrency test of
                        // plans beside replacements caught it called a link to nothing).
                        Ok(_) if reappeared < 3 => {
                            reappeared += 1;
                            continue;
                        }
                        Ok(_) => {
                            return Err(PathError::Unresolvable {
                                path: requested.to_owned(),
                                source: e,
                            });
                        }
                        Err(_) => {}
                    }
                    let Some(name) = existing.file_name().map(OsString::from) else {
                        return Err(PathError::Unresolvable {
                            path: requested.to_owned(),
                            source: e,
                        });
                    };
                    missing.push(name);
                    existing.pop();
                }
                Err(source) => {
                    return Err(PathError::Unresolvable {
                        path: requested.to_owned(),
                        source,
                    });
                }
            }
        };
        for name in missing.iter().rev() {
            resolved.push(name);
        }
        if self.roots.iter().any(|root| resolved.starts_with(root)) {
            Ok(resolved)
        } else {
            let roots: Vec<String> = self.roots.iter().map(|r| r.display().to_string()).collect();
            Err(PathError::OutsideRoots {
                path: requested.to_owned(),
                resolved,
                roots: roots.join(", "),
            })
        }
    }
}

/// Every companion file of one (resolved) output path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarPaths {
    pub output: PathBuf,
    pub failures: PathBuf,
    pub materialized: PathBuf,
    pub manifest: PathBuf,
    pub identity: PathBuf,
    pub resume_drift: PathBuf,
    pub run_lock: PathBuf,
    pub coverage: PathBuf,
    pub attempt_extension: PathBuf,
    pub rerun_masked: PathBuf,
    pub resubmit_offset: PathBuf,
    /// The results file's line count at each resubmit (this service's companion of the resubmit
    /// offset: a resubmit resets masked-infrastructure results too).
    pub resubmit_results_offset: PathBuf,
    pub classification_policy: PathBuf,
    /// The superseded draft dispatch journal, whose presence refuses a resume.
    pub draft_journal: PathBuf,
    pub aggregate_metrics: PathBuf,
    /// The service's record of a replacement under way (removed when it completes), so a
    /// replacement a crash interrupted is rolled back or completed at the next start.
    pub replace_intent: PathBuf,
}

/// The suffixes of every companion named after an output's stem (an output whose name ends with
/// one of these, beside that stem's manifest, is another run's companion).
pub const COMPANION_SUFFIXES: [&str; 15] = [
    "_failures.jsonl",
    "_materialized_inputs.jsonl",
    "_manifest.json",
    "_manifest_identity.json",
    "_manifest_resume_drift.jsonl",
    "_run.lock",
    "_coverage.json",
    "_attempt_extension.jsonl",
    "_rerun_masked.jsonl",
    "_resubmit_offset",
    "_resubmit_results_offset",
    "_failure_classification.json",
    "_attempts.jsonl",
    "_aggregate_metrics.json",
    "_replace_intent.json",
];

/// `Path.stem`: the file name without its last extension (a leading dot is not an extension).
fn stem(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Python's `PurePath.stem`: a suffix is a final `.` that is neither the name's first nor its
    // last character (`a.` and `.a` have none).
    match name.rfind('.') {
        Some(at) if at > 0 && at + 1 < name.len() => name[..at].to_owned(),
        _ => name,
    }
}

/// `path.with_name(path.stem + suffix)`.
pub fn companion(path: &Path, suffix: &str) -> PathBuf {
    path.with_file_name(format!("{}{suffix}", stem(path)))
}

/// `<checkpoint_dir>/.collector.lock`.
pub fn checkpoint_lock_path(checkpoint_dir: &Path) -> PathBuf {
    checkpoint_dir.join(".collector.lock")
}

/// The longest file name Linux file systems take.
pub const NAME_MAX: usize = 255;

/// The longest path Linux takes (`PATH_MAX`, its terminating NUL excluded).
pub const PATH_MAX: usize = 4095;

/// What an atomic write adds to a name (`.<name>.<32 hex>.tmp`) and what setting a file aside
/// adds (`.replaced-<unix seconds>-<n>`), so every companion can still be written and moved.
const NAME_OVERHEAD: usize = 38 + 24;

impl SidecarPaths {
    /// Every companion, the output included.
    pub fn all(&self) -> [&Path; 16] {
        [
            &self.output,
            &self.failures,
            &self.materialized,
            &self.manifest,
            &self.identity,
            &self.resume_drift,
            &self.run_lock,
            &self.coverage,
            &self.attempt_extension,
            &self.rerun_masked,
            &self.resubmit_offset,
            &self.resubmit_results_offset,
            &self.classification_policy,
            &self.draft_journal,
            &self.aggregate_metrics,
            &self.replace_intent,
        ]
        .map(PathBuf::as_path)
    }

    /// Refuses a journal (an append-only companion) that is there but is a symbolic link or no
    /// regular file, before a line is appended to it: one `lstat`. A journal that is not there
    /// yet is created by its first append.
    pub fn check_journal(path: &Path) -> Result<(), PathError> {
        match std::fs::symlink_metadata(path) {
            Ok(m) if !m.is_file() || std::os::unix::fs::MetadataExt::nlink(&m) > 1 => {
                Err(PathError::JournalNotAFile(path.to_owned()))
            }
            _ => Ok(()),
        }
    }

    /// Refuses a new run's output whose companions are there but are no regular files (a
    /// directory, FIFO, socket or device): a create would fail midway through its writes. One
    /// `lstat` per companion, so it is checked where a run is created, not on every request:
    /// every reader and appender of an existing run's files opens them without following a
    /// link or blocking and refuses what is not a regular file (see [`crate::open_regular`]).
    pub fn check_companion_types(&self) -> Result<(), PathError> {
        // The output itself may be a directory (refused elsewhere as such).
        let not_a_file = |p: &&&Path| {
            std::fs::symlink_metadata(p).is_ok_and(|m| !m.is_file() && !m.file_type().is_symlink())
        };
        match self.all()[1..].iter().find(not_a_file) {
            Some(companion) => Err(PathError::CompanionNotAFile {
                path: self.output.clone(),
                companion: companion.to_path_buf(),
            }),
            None => Ok(()),
        }
    }

    /// Refuses an output whose companions could not be created: a name over [`NAME_MAX`] fails
    /// only once some files exist, so it is checked before anything is written. Names only:
    /// no file is looked at.
    pub fn check_names(&self) -> Result<(), PathError> {
        if self
            .output
            .file_name()
            .is_some_and(|n| crate::temporary_target(&n.to_string_lossy()).is_some())
        {
            return Err(PathError::LooksTemporary(self.output.clone()));
        }
        let longest_path = self
            .all()
            .into_iter()
            .map(|p| p.as_os_str().len())
            .max()
            .unwrap_or(0);
        if longest_path + NAME_OVERHEAD > PATH_MAX {
            return Err(PathError::PathTooLong {
                path: self.output.clone(),
                max: PATH_MAX,
            });
        }
        let Some(longest) = self
            .all()
            .into_iter()
            .filter_map(Path::file_name)
            .max_by_key(|n| n.len())
        else {
            return Ok(());
        };
        if longest.len() + NAME_OVERHEAD <= NAME_MAX {
            return Ok(());
        }
        let suffix = longest.len().saturating_sub(stem(&self.output).len());
        Err(PathError::NameTooLong {
            path: self.output.clone(),
            companion: longest.to_string_lossy().into_owned(),
            max_stem: NAME_MAX.saturating_sub(NAME_OVERHEAD + suffix),
        })
    }

    /// Every companion (the output included) that is a symbolic link: the service refuses to
    /// run an output whose files could lead outside the roots.
    pub fn symlinks(&self) -> Vec<&Path> {
        self.all()
            .into_iter()
            .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink()))
            .collect()
    }

    /// The companions of an output path (resolve it first: the run lock is named on the resolved
    /// path so that symlink aliases share it).
    pub fn for_output(output: &Path) -> Self {
        let manifest = companion(output, "_manifest.json");
        Self {
            output: output.to_owned(),
            failures: companion(output, "_failures.jsonl"),
            materialized: companion(output, "_materialized_inputs.jsonl"),
            identity: companion(&manifest, "_identity.json"),
            resume_drift: companion(&manifest, "_resume_drift.jsonl"),
            manifest,
            run_lock: companion(output, "_run.lock"),
            coverage: companion(output, "_coverage.json"),
            attempt_extension: companion(output, "_attempt_extension.jsonl"),
            rerun_masked: companion(output, "_rerun_masked.jsonl"),
            resubmit_offset: companion(output, "_resubmit_offset"),
            resubmit_results_offset: companion(output, "_resubmit_results_offset"),
            classification_policy: companion(output, "_failure_classification.json"),
            draft_journal: companion(output, "_attempts.jsonl"),
            aggregate_metrics: companion(output, "_aggregate_metrics.json"),
            replace_intent: companion(output, "_replace_intent.json"),
        }
    }
}
