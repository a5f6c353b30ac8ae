//! Reading a run's files: only regular files, never through a symbolic link.
//!
//! Invariant: every file of a run (manifest, identity, materialized inputs, outcomes, journals,
//! policy, offsets) is read through [`open_regular`], so a link planted beside an output cannot
//! make the service read (and quote in an error) a file outside the roots, and a FIFO or device
//! planted there cannot hang a reader: it is opened without blocking and refused.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens a regular file for reading, refusing symbolic links and anything that is not a
/// regular file. A missing file is `NotFound`, as `File::open` answers.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    open_checked(path, libc::O_NOFOLLOW).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            std::io::Error::other("a symbolic link, which is never followed")
        } else {
            e
        }
    })
}

/// The bytes of a regular file (see [`open_regular`]).
pub fn read_regular(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut file = open_regular(path)?;
    let mut bytes = Vec::with_capacity(file.metadata().map_or(0, |m| m.len() as usize));
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Opens a regular file for reading, following symbolic links (a source dataset may be one),
/// refusing anything that is not a regular file in the end: a FIFO swapped in for a dataset is
/// refused at once instead of blocking a reader until some writer comes.
pub fn open_regular_following(path: &Path) -> std::io::Result<File> {
    open_checked(path, 0)
}

/// Opens `path` for reading with `flags` and keeps it only when it is a regular file.
/// O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below); reads of a
/// regular file never block on it.
fn open_checked(path: &Path, flags: libc::c_int) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(flags | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a directory, FIFO, socket or device is never read)",
        ));
    }
    Ok(file)
}
