//! Atomic replace, exactly as `atomic_output_file` (facts §9): a hidden temporary
//! `.<name>.<uuid4 hex>.tmp` in the same directory created exclusively with mode 0o666 (umask
//! applies), the target's permission bits retained (or `mode` applied), data fsynced, renamed over
//! the target, the directory fsynced; on any failure the temporary is removed and the previous
//! target is left intact.

use recovery_core::canonical::CanonicalError;
use recovery_core::pretty::python_pretty;
use serde_json::Value;
use std::fs::{File, OpenOptions, Permissions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Removes the temporary file unless the replace completed.
struct TemporaryGuard(Option<PathBuf>);

impl Drop for TemporaryGuard {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Replaces `path` with `bytes`: readers see the complete old or the complete new file.
pub fn atomic_write(path: &Path, bytes: &[u8], mode: Option<u32>) -> std::io::Result<()> {
    let directory = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other(format!("{} has no file name", path.display())))?;
    let temporary = directory.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        crate::new_id()
    ));
    let mut guard = TemporaryGuard(None);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(&temporary)?;
    guard.0 = Some(temporary.clone());
    let permissions = match mode {
        Some(mode) => Some(mode),
        None => std::fs::metadata(path)
            .ok()
            .map(|m| m.permissions().mode() & 0o7777),
    };
    if let Some(mode) = permissions {
        file.set_permissions(Permissions::from_mode(mode))?;
    }
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&temporary, path)?;
    guard.0 = None;
    File::open(&directory)?.sync_all()
}

/// `atomic_write_json`: Python's `json.dumps(value, indent=2, allow_nan=False) + "\n"`.
pub fn atomic_write_json(
    path: &Path,
    value: &Value,
    mode: Option<u32>,
) -> Result<(), AtomicJsonError> {
    let text = python_pretty(value)?;
    atomic_write(path, text.as_bytes(), mode)?;
    Ok(())
}

/// Why a JSON document was not published.
#[derive(Debug, thiserror::Error)]
pub enum AtomicJsonError {
    #[error(transparent)]
    Json(#[from] CanonicalError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The file an atomic write's temporary (`.<name>.<32 hex>.tmp`) was to become, or `None` when
/// `name` is not such a temporary.
pub fn temporary_target(name: &str) -> Option<&str> {
    let rest = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    let (target, id) = rest.rsplit_once('.')?;
    let hex = id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    (!target.is_empty() && hex).then_some(target)
}
