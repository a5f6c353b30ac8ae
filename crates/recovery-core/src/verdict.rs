//! `validate_resume` as a pure function: the decision table of facts §12 over what was read from
//! disk (the caller reads; nothing here touches a file).
//!
//! Invariants: an unreadable manifest or materialized file refuses even with `allow_unsafe`;
//! every other mismatch refuses without it and becomes a sticky override with it; a config that
//! differs only in operational keys (saved identity present and verified) resumes and names the
//! keys to journal; messages keep the Python module's wording that callers match on
//! (`incompatible`, `no run manifest`, `Cannot read`, `previously overridden`,
//! `incompatible resolved configuration`, `allow_unsafe_resume`).

use crate::canonical::digest;
use crate::drift::{ClassifiedKey, DriftPolicy, KeyClass, SemanticReason, differing_keys};
use crate::identity::ConfigurationIdentity;
use crate::manifest::RunManifest;
use serde_json::Value;

/// The saved manifest as read from disk.
#[derive(Debug, Clone)]
pub enum SavedManifest {
    Missing,
    /// Unreadable: bad JSON, schema error, unsupported version or policy (the reason).
    Unreadable(String),
    Read(Box<RunManifest>),
}

/// What a resume is checked against, as read by the caller.
#[derive(Debug, Clone)]
pub struct SavedRun {
    /// The manifest's path, for messages.
    pub manifest_path: String,
    pub manifest: SavedManifest,
    /// Materialized digest recomputed from the saved materialized inputs, or why it failed.
    pub materialized: Result<String, String>,
    /// The identity saved beside the manifest, when present and parseable.
    pub identity: Option<Value>,
}

/// The run as the collector is about to start it.
#[derive(Debug, Clone)]
pub struct CurrentRun {
    pub source_digest: String,
    pub materialized_digest: String,
    /// Shared: a service keeps the identities of recent requests.
    pub config: std::sync::Arc<ConfigurationIdentity>,
}

/// Why saved work does not verify against the current run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    LegacyImport,
    PreviouslyOverridden,
    SavedMaterializedInputs,
    CurrentIdentityUnavailable,
    SourceDataset,
    CurrentMaterializedInputs,
    /// Config digest differs and no verified saved identity tells which keys.
    ResolvedConfiguration,
    /// Semantic keys differ from the saved identity.
    SemanticConfiguration(Vec<ClassifiedKey>),
}

impl Mismatch {
    /// Stable machine name.
    pub fn code(&self) -> &'static str {
        match self {
            Self::LegacyImport => "legacy_import",
            Self::PreviouslyOverridden => "previously_overridden",
            Self::SavedMaterializedInputs => "saved_materialized_inputs",
            Self::CurrentIdentityUnavailable => "current_identity_unavailable",
            Self::SourceDataset => "source_dataset",
            Self::CurrentMaterializedInputs => "current_materialized_inputs",
            Self::ResolvedConfiguration => "resolved_configuration",
            Self::SemanticConfiguration(_) => "semantic_configuration",
        }
    }

    /// The semantic keys among `mismatches` (a refusal's, or what an override accepted), in
    /// order.
    pub fn semantic_keys(mismatches: &[Mismatch]) -> Vec<String> {
        mismatches
            .iter()
            .filter_map(|m| match m {
                Self::SemanticConfiguration(keys) => Some(keys.iter().map(|k| k.key.clone())),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// The phrase the Python module uses after "incompatible".
    pub fn description(&self) -> String {
        match self {
            Self::LegacyImport => "unverified legacy run identity".into(),
            Self::PreviouslyOverridden => "previously overridden run identity".into(),
            Self::SavedMaterializedInputs => "saved materialized inputs".into(),
            Self::CurrentIdentityUnavailable => "current input/configuration identity".into(),
            Self::SourceDataset => "source dataset".into(),
            Self::CurrentMaterializedInputs => "current materialized inputs".into(),
            Self::ResolvedConfiguration => "resolved configuration".into(),
            Self::SemanticConfiguration(keys) => {
                let names: Vec<&str> = keys.iter().map(|k| k.key.as_str()).collect();
                format!(
                    "resolved configuration (semantic keys changed: {})",
                    names.join(", ")
                )
            }
        }
    }
}

/// The outcome of validating a resume.
#[derive(Debug, Clone)]
pub enum ResumeVerdict {
    /// Identity verified: reuse the saved manifest unchanged.
    Reuse { manifest: RunManifest },
    /// Only operational settings changed: resume, warn, journal these keys (sorted).
    ResumeWithDrift {
        manifest: RunManifest,
        operational_keys: Vec<String>,
    },
    /// Refused (`ResumeRefusedError`); nothing may change on disk.
    Refused {
        message: String,
        mismatches: Vec<Mismatch>,
    },
    /// No manifest and no override: refused.
    NoManifest { message: String },
    /// Manifest or materialized inputs unreadable: refused even with `allow_unsafe`.
    Unreadable { message: String },
    /// `allow_unsafe` accepted mismatches: the saved manifest with `identity_overridden` set.
    Overridden {
        manifest: RunManifest,
        message: String,
        mismatches: Vec<Mismatch>,
    },
    /// No manifest, `allow_unsafe`: the caller imports the saved outcomes as legacy.
    ImportLegacy { message: String },
}

const REFUSE_ADVICE: &str = " Start a fresh run or explicitly set allow_unsafe_resume=true.";
const UNSAFE_WARNING: &str =
    " Continuing because allow_unsafe_resume=true; saved inputs will be reused.";
const NO_MANIFEST: &str =
    "Saved rollouts have no run manifest; their input/configuration identity cannot be verified.";

/// `validate_resume(path, current, materialized_path, allow_unsafe)`.
pub fn validate_resume(
    saved: &SavedRun,
    current: Option<&CurrentRun>,
    allow_unsafe: bool,
    policy: &DriftPolicy,
) -> ResumeVerdict {
    let manifest = match &saved.manifest {
        SavedManifest::Missing => {
            return if allow_unsafe {
                ResumeVerdict::ImportLegacy {
                    message: format!("{NO_MANIFEST}{UNSAFE_WARNING}"),
                }
            } else {
                ResumeVerdict::NoManifest {
                    message: format!("{NO_MANIFEST}{REFUSE_ADVICE}"),
                }
            };
        }
        SavedManifest::Unreadable(reason) => return unreadable(&saved.manifest_path, reason),
        SavedManifest::Read(manifest) => manifest.as_ref(),
    };
    let saved_rows_digest = match &saved.materialized {
        Ok(d) => d,
        Err(reason) => return unreadable(&saved.manifest_path, reason),
    };
    let mut mismatches = Vec::new();
    if manifest.legacy_import {
        mismatches.push(Mismatch::LegacyImport);
    }
    if manifest.identity_overridden {
        mismatches.push(Mismatch::PreviouslyOverridden);
    }
    if &manifest.materialized_digest != saved_rows_digest {
        mismatches.push(Mismatch::SavedMaterializedInputs);
    }
    let mut operational_keys = Vec::new();
    match current {
        None => mismatches.push(Mismatch::CurrentIdentityUnavailable),
        Some(current) => {
            if current.source_digest != manifest.source_digest {
                mismatches.push(Mismatch::SourceDataset);
            }
            if current.materialized_digest != manifest.materialized_digest {
                mismatches.push(Mismatch::CurrentMaterializedInputs);
            }
            if !current.config.matches_config(&manifest.config_digest) {
                match configuration_drift(saved, manifest, current, policy) {
                    // A changed digest always names a key (keys differ exactly as canonical
                    // forms do); one that names none is compared by digest, never reused.
                    None => mismatches.push(Mismatch::ResolvedConfiguration),
                    Some((semantic, operational))
                        if semantic.is_empty() && operational.is_empty() =>
                    {
                        mismatches.push(Mismatch::ResolvedConfiguration)
                    }
                    Some((semantic, operational)) => {
                        if !semantic.is_empty() {
                            mismatches.push(Mismatch::SemanticConfiguration(semantic));
                        }
                        operational_keys = operational;
                    }
                }
            }
        }
    }
    if mismatches.is_empty() {
        return if operational_keys.is_empty() {
            ResumeVerdict::Reuse {
                manifest: manifest.clone(),
            }
        } else {
            ResumeVerdict::ResumeWithDrift {
                manifest: manifest.clone(),
                operational_keys,
            }
        };
    }
    let descriptions: Vec<String> = mismatches.iter().map(Mismatch::description).collect();
    let problem = format!(
        "Cannot resume with incompatible {}.",
        descriptions.join(", ")
    );
    if allow_unsafe {
        return ResumeVerdict::Overridden {
            manifest: manifest.overridden(),
            message: format!("{problem}{UNSAFE_WARNING}"),
            mismatches,
        };
    }
    let mut message = format!("{problem}{REFUSE_ADVICE}");
    let unclassified: Vec<&str> = mismatches
        .iter()
        .filter_map(|m| match m {
            Mismatch::SemanticConfiguration(keys) => Some(keys),
            _ => None,
        })
        .flatten()
        .filter(|k| k.class == KeyClass::Semantic(SemanticReason::Unclassified))
        .map(|k| k.key.as_str())
        .collect();
    if !unclassified.is_empty() {
        message.push_str(&format!(
            " No rule classifies {}: an unknown change refuses; if it cannot change results, declare it an \
             operational key in the service configuration.",
            unclassified.join(", ")
        ));
    }
    // Why no key is named: the saved identity that would tell them is not usable.
    if mismatches.contains(&Mismatch::ResolvedConfiguration) {
        message.push_str(&format!(
            " The changed keys cannot be named: the saved identity beside {} is {}.",
            saved.manifest_path,
            if saved.identity.is_some() {
                "not the one the manifest's config_digest was taken from"
            } else {
                "missing or unreadable"
            }
        ));
    }
    ResumeVerdict::Refused {
        message,
        mismatches,
    }
}

fn unreadable(path: &str, reason: &str) -> ResumeVerdict {
    ResumeVerdict::Unreadable {
        message: format!("Cannot read recovery manifest {path} or materialized inputs: {reason}"),
    }
}

/// `_configuration_drift`: semantic and operational keys that differ from the saved identity, or
/// `None` when no identity was saved or it is not the one `config_digest` was taken from.
pub fn configuration_drift(
    saved: &SavedRun,
    manifest: &RunManifest,
    current: &CurrentRun,
    policy: &DriftPolicy,
) -> Option<(Vec<ClassifiedKey>, Vec<String>)> {
    let identity = saved.identity.as_ref()?;
    if digest(identity).ok()? != manifest.config_digest {
        return None;
    }
    let drift = policy.classify_all(&differing_keys(identity, &current.config.identity));
    Some((drift.semantic, drift.operational))
}
