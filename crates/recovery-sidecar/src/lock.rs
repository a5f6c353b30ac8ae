//! Run locks (facts §10): `<stem>_run.lock` on the resolved output path and
//! `<checkpoint dir>/.collector.lock`, acquired with an exclusive non-blocking `flock` in sorted
//! path order, held until dropped (or the process dies), never unlinked.
//!
//! Invariant: the lock is the same kernel lock Python's `fcntl.flock` takes, so a Python collector
//! and this service exclude each other on the same files.

use fd_lock::RwLock;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Why a lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("Another collector owns this run ({}). Wait for it to stop before resuming.", .0.display())]
    Owned(PathBuf),
    /// A symbolic link, FIFO, socket or directory where the lock file belongs: a path problem
    /// of the run's files, never a lock to wait for nor the service's failure.
    #[error("lock file {} is not a regular file of its own (a symbolic link, FIFO, socket, directory or a file with other hard links is never used)", .0.display())]
    NotAFile(PathBuf),
    /// Taking a lock again: the lock file's directory is no longer the directory the lock was
    /// first taken in (moved, removed, or replaced by a link to elsewhere).
    #[error("the directory of lock file {} is no longer the one its lock was taken in", .0.display())]
    Moved(PathBuf),
    /// The lock file's directory does not exist, and is not made: the run's files were moved or
    /// removed (a lock never brings a run's directory back where its files are gone).
    #[error("the directory of lock file {} does not exist (the run's files were moved or removed)", .0.display())]
    DirectoryGone(PathBuf),
    #[error("cannot open lock file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Held locks of one run; dropping releases them (see the `Drop` impl).
#[derive(Debug)]
pub struct RunLock {
    /// Sorted by path.
    held: Vec<Held>,
    /// Files removed or replaced while locked, still locked: a process that opened one before
    /// it went, and waits for its `flock`, must not get it while this lock stands (it would take
    /// itself for the run's owner).
    retired: Vec<Held>,
}

/// One locked file.
#[derive(Debug)]
struct Held {
    path: PathBuf,
    lock: RwLock<File>,
    /// The (device, inode) of the file locked.
    identity: (u64, u64),
    /// The (device, inode) of the directory it was opened in: a lock taken again is taken in
    /// that directory only.
    directory: (u64, u64),
    /// A second descriptor of the same open file (so of the same `flock`), from which a lock
    /// taken again ([`RunLock::retake_displaced`]) keeps this file's lock without a gap.
    handle: File,
    /// The `flock` passed to a lock taken again: dropping this one must not release it.
    handed_over: AtomicBool,
}

impl Held {
    /// The same `flock`, through a second descriptor of the same open file, for another lock
    /// (this one is then marked handed over by the caller).
    fn pass_on(&self) -> Result<Held, LockError> {
        let io = |source| LockError::Io {
            path: self.path.clone(),
            source,
        };
        Ok(Held {
            path: self.path.clone(),
            lock: RwLock::new(self.handle.try_clone().map_err(io)?),
            identity: self.identity,
            directory: self.directory,
            handle: self.handle.try_clone().map_err(io)?,
            handed_over: AtomicBool::new(false),
        })
    }

    fn in_place(&self) -> bool {
        std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.is_file() && m.dev() == self.identity.0 && m.ino() == self.identity.1)
    }
}

impl Drop for RunLock {
    /// Unlocks each file before closing it. Closing alone releases a `flock` only once no other
    /// descriptor shares the open file, and a process forked meanwhile (any thread of this
    /// process spawning a program) holds a copy of every descriptor until it execs: the run
    /// would stay locked against the next section for that long. Taking the guard again on a
    /// lock this descriptor already holds is a no-op that succeeds; dropping it unlocks.
    fn drop(&mut self) {
        for held in self.held.iter_mut().chain(self.retired.iter_mut()) {
            if held.handed_over.load(Ordering::Acquire) {
                continue;
            }
            if let Ok(guard) = held.lock.try_write() {
                drop(guard);
            }
        }
    }
}

impl RunLock {
    /// Acquires every lock in sorted order; on the first that is owned, releases the ones taken.
    pub fn acquire(paths: impl IntoIterator<Item = PathBuf>) -> Result<Self, LockError> {
        Self::acquire_at(paths, Place::CreatingDirectories)
    }

    /// [`Self::acquire`] in directories that exist already (none is created): a lock taken again
    /// at a start, where a removed run directory means the run's files are gone.
    pub fn acquire_in_existing_directories(
        paths: impl IntoIterator<Item = PathBuf>,
    ) -> Result<Self, LockError> {
        Self::acquire_at(paths, Place::ExistingDirectory)
    }

    /// A lease's locks: the run's own lock in its run's directory as it is (hostile review 45:
    /// a lease of a run whose directory was moved away made the directory again, and the run
    /// moved back landed inside it), the others (a checkpoint directory's) with their
    /// directories created when missing.
    pub fn acquire_for_run(
        run_lock: PathBuf,
        others: impl IntoIterator<Item = PathBuf>,
    ) -> Result<Self, LockError> {
        // The run's lock first: a repeat of it among `others` is dropped after the stable sort.
        let others = others
            .into_iter()
            .map(|path| (path, Place::CreatingDirectories));
        Self::acquire_placed(
            std::iter::once((run_lock, Place::ExistingDirectory))
                .chain(others)
                .collect(),
        )
    }

    fn acquire_at(
        paths: impl IntoIterator<Item = PathBuf>,
        place: Place,
    ) -> Result<Self, LockError> {
        Self::acquire_placed(paths.into_iter().map(|path| (path, place)).collect())
    }

    fn acquire_placed(mut paths: Vec<(PathBuf, Place)>) -> Result<Self, LockError> {
        // Stable: of a path given twice, the first place given is kept.
        paths.sort_by(|a, b| a.0.cmp(&b.0));
        paths.dedup_by(|a, b| a.0 == b.0);
        // Built up in place, so a lock refused midway releases the ones taken (by `Drop`).
        let mut taken = Self {
            retired: Vec::new(),
            held: Vec::with_capacity(paths.len()),
        };
        for (path, place) in paths {
            taken.held.push(lock_file(path, place)?);
        }
        Ok(taken)
    }

    /// The lock of one output (and optionally its checkpoint directory).
    pub fn for_output(run_lock: &Path, checkpoint_dir: Option<&Path>) -> Result<Self, LockError> {
        let mut paths = vec![run_lock.to_owned()];
        if let Some(dir) = checkpoint_dir {
            paths.push(crate::paths::checkpoint_lock_path(dir));
        }
        Self::acquire(paths)
    }

    /// Whether every lock file is still the file this lock holds: one removed (or replaced)
    /// while held leaves the `flock` on a file nobody else opens, and a new file at the path
    /// can be locked by another process. Two `lstat`s' worth of work per path.
    pub fn is_in_place(&self) -> bool {
        self.held.iter().all(Held::in_place)
    }

    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.held.iter().map(|h| h.path.as_path())
    }

    /// The same locks with each removed or replaced file's path locked again (the file now
    /// there, created when missing, in the directory the first lock was taken in): `None` when
    /// every file is in place. Every `flock` this lock holds passes to the new one, never
    /// released in between: the files in place, and the displaced ones too (until the new lock
    /// ends), so dropping this lock releases nothing. When another process holds a new file
    /// ([`LockError::Owned`]), or the directory changed ([`LockError::Moved`]), nothing
    /// changes: this lock keeps what it holds.
    pub fn retake_displaced(&self) -> Result<Option<Self>, LockError> {
        // Looked at once: a file removed meanwhile is found by the next look.
        let (placed, displaced): (Vec<&Held>, Vec<&Held>) =
            self.held.iter().partition(|h| h.in_place());
        if displaced.is_empty() {
            return Ok(None);
        }
        // The displaced paths first: a refusal drops only their own new locks.
        let mut fresh = Self {
            held: Vec::new(),
            retired: Vec::new(),
        };
        for held in &displaced {
            fresh.held.push(lock_file(
                held.path.clone(),
                Place::Directory(held.directory),
            )?);
        }
        // Every lock this one holds passes to the new one: the files in place, and the
        // displaced ones (kept until the new lock ends).
        let mut kept = Vec::new();
        for held in &placed {
            kept.push(held.pass_on()?);
        }
        for held in displaced.iter().copied().chain(&self.retired) {
            fresh.retired.push(held.pass_on()?);
        }
        for held in self.held.iter().chain(&self.retired) {
            held.handed_over.store(true, Ordering::Release);
        }
        fresh.held.append(&mut kept);
        fresh.held.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(Some(fresh))
    }
}

/// Where [`lock_file`] may open a lock file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Its directory, created when missing (a first lock).
    CreatingDirectories,
    /// Its directory as it is; none is created.
    ExistingDirectory,
    /// Only the directory of this (device, inode): where the lock was first taken.
    Directory((u64, u64)),
}

/// Whether a process other than this one holds a `flock` on the file at `path`, read from the
/// kernel's table of locks (`/proc/locks`, as `lslocks` reads it) without taking the lock:
/// taking it to find out, even for an instant, can make a collector's own non-blocking attempt
/// fail, and would wait behind this service's own sections. `Ok(Some(false))` for a missing
/// file (nobody holds it), `Ok(None)` when the table cannot be read (no `/proc`); a path that
/// is not a regular file of its own is refused as an acquire refuses it.
pub fn flock_held_elsewhere(path: &Path) -> Result<Option<bool>, LockError> {
    let metadata = match std::fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Some(false)),
        Err(source) => {
            return Err(LockError::Io {
                path: path.to_owned(),
                source,
            });
        }
    };
    if !metadata.is_file() || metadata.nlink() > 1 {
        return Err(LockError::NotAFile(path.to_owned()));
    }
    let Ok(table) = procfs::locks() else {
        return Ok(None);
    };
    let ours = i32::try_from(std::process::id()).ok();
    let (major, minor) = (
        rustix::fs::major(metadata.dev()),
        rustix::fs::minor(metadata.dev()),
    );
    Ok(Some(table.iter().any(|lock| {
        lock.lock_type == procfs::LockType::FLock
            && (lock.devmaj, lock.devmin, lock.inode) == (major, minor, metadata.ino())
            && lock.pid != ours
    })))
}

/// Opens the lock file at `path` (created when missing; never through a link) and takes its
/// exclusive `flock` without waiting, in the directory `place` allows: a lock taken again opens
/// the file only in the directory it was first taken in, never in one created since or reached
/// through a link put in its place.
fn lock_file(path: PathBuf, place: Place) -> Result<Held, LockError> {
    use rustix::fs::{Mode, OFlags};
    let io = |source| LockError::Io {
        path: path.clone(),
        source,
    };
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let Some(name) = path.file_name() else {
        return Err(LockError::NotAFile(path));
    };
    if place == Place::CreatingDirectories {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let dir = match rustix::fs::open(
        parent,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(dir) => dir,
        Err(e) if e == rustix::io::Errno::NOENT && place != Place::CreatingDirectories => {
            return Err(LockError::DirectoryGone(path));
        }
        Err(e) => return Err(io(e.into())),
    };
    let stat = rustix::fs::fstat(&dir).map_err(|e| io(e.into()))?;
    let opened_in = (stat.st_dev, stat.st_ino);
    if matches!(place, Place::Directory(first) if first != opened_in) {
        return Err(LockError::Moved(path));
    }
    let file = match rustix::fs::openat(
        &dir,
        name,
        OFlags::RDWR
            | OFlags::APPEND
            | OFlags::CREATE
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o666),
    ) {
        Ok(fd) => File::from(fd),
        // A link (ELOOP under O_NOFOLLOW), a directory (EISDIR: opened for writing) or a
        // socket (ENXIO): the run's files' problem, never the service's.
        Err(e) if matches!(e.raw_os_error(), libc::ELOOP | libc::EISDIR | libc::ENXIO) => {
            return Err(LockError::NotAFile(path));
        }
        Err(e) => return Err(io(e.into())),
    };
    let metadata = file.metadata().map_err(io)?;
    // A file with other names (hard links) may be another run's lock, or a file outside the
    // roots: locking it would exclude, or be excluded by, whoever uses those names.
    if !metadata.is_file() || metadata.nlink() > 1 {
        return Err(LockError::NotAFile(path));
    }
    let identity = (metadata.dev(), metadata.ino());
    let handle = file.try_clone().map_err(io)?;
    let mut lock = RwLock::new(file);
    match lock.try_write() {
        // The guard would unlock on drop; the lock must live as long as the file instead.
        Ok(guard) => std::mem::forget(guard),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            return Err(LockError::Owned(path));
        }
        Err(e) => return Err(io(e)),
    }
    Ok(Held {
        path,
        lock,
        identity,
        directory: opened_in,
        handle,
        handed_over: AtomicBool::new(false),
    })
}
