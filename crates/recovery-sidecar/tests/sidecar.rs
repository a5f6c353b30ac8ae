//! The one integration-test binary of `recovery-sidecar`: names, confinement, atomic replace,
//! journals and locks, with Python's `fcntl.flock` as the peer.

use recovery_sidecar::journal::TailRepair;
use recovery_sidecar::{
    Confinement, LockError, PathError, RunLock, SidecarPaths, append_line, append_lines_at,
    atomic_write, is_not_a_regular_file, prepare_append, read_lines,
};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

#[test]
fn companions_are_named_from_the_output_stem_and_the_manifest_stem() {
    let paths = SidecarPaths::for_output(Path::new("/data/results/rollouts.jsonl"));
    let name = |p: &Path| p.file_name().expect("name").to_string_lossy().into_owned();
    assert_eq!(name(&paths.manifest), "rollouts_manifest.json");
    assert_eq!(name(&paths.identity), "rollouts_manifest_identity.json");
    assert_eq!(
        name(&paths.resume_drift),
        "rollouts_manifest_resume_drift.jsonl"
    );
    assert_eq!(name(&paths.failures), "rollouts_failures.jsonl");
    assert_eq!(
        name(&paths.materialized),
        "rollouts_materialized_inputs.jsonl"
    );
    assert_eq!(name(&paths.run_lock), "rollouts_run.lock");
    assert_eq!(
        name(&paths.attempt_extension),
        "rollouts_attempt_extension.jsonl"
    );
    assert_eq!(name(&paths.rerun_masked), "rollouts_rerun_masked.jsonl");
    assert_eq!(name(&paths.resubmit_offset), "rollouts_resubmit_offset");
    assert_eq!(
        name(&paths.classification_policy),
        "rollouts_failure_classification.json"
    );
    assert_eq!(name(&paths.coverage), "rollouts_coverage.json");
    let dotted = SidecarPaths::for_output(Path::new("/d/out.v2.jsonl"));
    assert_eq!(
        name(&dotted.manifest),
        "out.v2_manifest.json",
        "only the last extension is the suffix"
    );
    let hidden = SidecarPaths::for_output(Path::new("/d/.hidden"));
    assert_eq!(name(&hidden.manifest), ".hidden_manifest.json");
}

/// Issue 9, item 10: companions are named from Python's `PurePath.stem` (CPython is the oracle),
/// so `a.` keeps its dot and `.a.b` loses only `.b`.
#[test]
fn item_10_companion_names_follow_python_path_stem() {
    let names = [
        "a.",
        "a.b.",
        ".a",
        "a..jsonl",
        ".jsonl",
        "a",
        "a.tar.gz",
        "a. ",
        ".a.b",
        "out.jsonl",
        "x.y.z",
        "trailing..",
        "...",
    ];
    let script = "import sys, pathlib\nfor n in sys.argv[1:]:\n    print(pathlib.PurePath(n).stem + '_manifest.json')\n";
    let python = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(names)
        .output()
        .expect("python3");
    assert!(python.status.success());
    let expected: Vec<String> = String::from_utf8(python.stdout)
        .expect("utf-8")
        .lines()
        .map(str::to_owned)
        .collect();
    let ours: Vec<String> = names
        .iter()
        .map(|n| {
            SidecarPaths::for_output(&Path::new("/d").join(n))
                .manifest
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(ours, expected);
}

#[test]
fn output_paths_are_confined_to_their_roots() {
    let root = tempfile::tempdir().expect("root");
    let outside = tempfile::tempdir().expect("outside");
    std::fs::create_dir(root.path().join("runs")).expect("dir");
    std::os::unix::fs::symlink(outside.path(), root.path().join("escape")).expect("symlink");
    std::fs::write(outside.path().join("target.jsonl"), b"").expect("file");
    std::os::unix::fs::symlink(
        outside.path().join("target.jsonl"),
        root.path().join("runs/link.jsonl"),
    )
    .expect("symlink");
    let confinement = Confinement::new([root.path().to_owned()]).expect("confinement");
    let canonical_root = std::fs::canonicalize(root.path()).expect("canonical");
    let inside = confinement
        .resolve(&root.path().join("runs/new/out.jsonl"))
        .expect("inside");
    assert_eq!(inside, canonical_root.join("runs/new/out.jsonl"));
    assert_eq!(
        confinement
            .resolve(Path::new("runs/out.jsonl"))
            .expect("relative"),
        canonical_root.join("runs/out.jsonl")
    );
    assert!(matches!(
        confinement.resolve(&root.path().join("runs/../../etc/passwd")),
        Err(PathError::ParentComponent(_))
    ));
    assert!(matches!(
        confinement.resolve(&root.path().join("escape/out.jsonl")),
        Err(PathError::OutsideRoots { .. })
    ));
    assert!(matches!(
        confinement.resolve(&root.path().join("runs/link.jsonl")),
        Err(PathError::OutsideRoots { .. })
    ));
    assert!(matches!(
        confinement.resolve(Path::new("/etc/out.jsonl")),
        Err(PathError::OutsideRoots { .. })
    ));
    let error = confinement
        .resolve(Path::new("/etc/out.jsonl"))
        .expect_err("outside")
        .to_string();
    assert!(
        error.contains("/etc/out.jsonl") && error.contains("outside the allowed roots"),
        "{error}"
    );
}

#[test]
fn atomic_replace_keeps_permissions_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("run_manifest.json");
    atomic_write(&path, b"first\n", None).expect("first write");
    let fresh = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
    let ordinary = dir.path().join("ordinary");
    std::fs::write(&ordinary, b"").expect("ordinary");
    assert_eq!(
        fresh,
        std::fs::metadata(&ordinary)
            .expect("meta")
            .permissions()
            .mode()
            & 0o777,
        "like an ordinary new file"
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    atomic_write(&path, b"second\n", None).expect("rewrite");
    assert_eq!(
        std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777,
        0o640,
        "sharing permissions retained"
    );
    atomic_write(&path, b"third\n", Some(0o600)).expect("explicit mode");
    assert_eq!(
        std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(std::fs::read(&path).expect("read"), b"third\n");
    // A failed replace (the target is a directory) keeps the old bytes and leaves no temporary.
    let blocked = dir.path().join("blocked");
    std::fs::create_dir(&blocked).expect("dir");
    std::fs::write(blocked.join("keep"), b"x").expect("file");
    assert!(atomic_write(&blocked, b"new", None).is_err());
    let stray: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(stray.is_empty(), "no temporary file may remain");
    assert_eq!(std::fs::read(blocked.join("keep")).expect("kept"), b"x");
}

#[test]
fn journals_repair_torn_tails_and_never_rewrite_complete_lines() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("j.jsonl");
    assert_eq!(prepare_append(&path).expect("missing"), TailRepair::Clean);
    append_line(&path, br#"{"id":1}"#).expect("append");
    std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .expect("open")
        .write_all(br#"{"id":2,"#)
        .expect("torn");
    assert_eq!(
        append_line(&path, br#"{"id":3}"#).expect("append"),
        TailRepair::Truncated(8)
    );
    std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .expect("open")
        .write_all(br#"{"id":4}"#)
        .expect("complete tail");
    assert_eq!(
        append_line(&path, br#"{"id":5}"#).expect("append"),
        TailRepair::Terminated
    );
    let lines: Vec<String> = read_lines(&path)
        .expect("lines")
        .into_iter()
        .map(|l| String::from_utf8(l).expect("utf8"))
        .collect();
    assert_eq!(
        lines,
        [r#"{"id":1}"#, r#"{"id":3}"#, r#"{"id":4}"#, r#"{"id":5}"#]
    );
    assert!(append_line(&path, b"two\nlines").is_err());
    let offsets = dir.path().join("out_resubmit_offset");
    append_line(&offsets, b"12").expect("offset");
    std::fs::OpenOptions::new()
        .append(true)
        .open(&offsets)
        .expect("open")
        .write_all(b"17")
        .expect("tail");
    assert_eq!(
        prepare_append(&offsets).expect("repair"),
        TailRepair::Terminated,
        "a complete integer line is kept"
    );
}

#[test]
fn an_append_where_a_link_fifo_or_directory_is_refuses_as_not_a_regular_file_and_writes_nothing() {
    let dir = tempfile::tempdir().expect("dir");
    let target = dir.path().join("elsewhere.jsonl");
    std::fs::write(&target, b"{\"kept\":1}\n").expect("target");
    let link = dir.path().join("link_drift.jsonl");
    std::os::unix::fs::symlink(&target, &link).expect("symlink");
    let fifo = dir.path().join("fifo_drift.jsonl");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success(), "mkfifo");
    let directory = dir.path().join("dir_drift.jsonl");
    std::fs::create_dir(&directory).expect("directory");
    // A second name of a file elsewhere (unterminated: a repair would truncate it).
    let victim = dir.path().join("victim.txt");
    std::fs::write(&victim, b"line1\nno newline").expect("victim");
    let hard_link = dir.path().join("hard_drift.jsonl");
    std::fs::hard_link(&victim, &hard_link).expect("hard link");
    for (kind, path) in [
        ("link", &link),
        ("fifo", &fifo),
        ("directory", &directory),
        ("hard link", &hard_link),
    ] {
        let error =
            append_lines_at(path, &[b"{\"a\":1}".as_slice()]).expect_err("never appended to");
        assert!(
            is_not_a_regular_file(&error),
            "{kind}: {error} is told apart from an IO failure"
        );
    }
    // An ordinary IO failure (the directory is gone) is not mistaken for one.
    let orphan = dir.path().join("gone").join("orphan_drift.jsonl");
    let error = append_lines_at(&orphan, &[b"{\"a\":2}".as_slice()]).expect_err("no directory");
    assert!(!is_not_a_regular_file(&error), "{error} is an IO failure");
    assert_eq!(
        std::fs::read(&target).expect("target"),
        b"{\"kept\":1}\n",
        "nothing was written through the link"
    );
    assert_eq!(
        std::fs::read(&victim).expect("victim"),
        b"line1\nno newline",
        "nothing was written, nor repaired, through the hard link"
    );
}

/// Lock tests run one at a time: a process spawned by one test inherits, between its fork and
/// its exec, the open lock files of another test's thread, and holds their `flock` meanwhile.
fn serial_locks() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn a_run_lock_excludes_a_second_owner_until_released_and_follows_aliases() {
    let _serial = serial_locks();
    let dir = tempfile::tempdir().expect("dir");
    let output = dir.path().join("out.jsonl");
    std::fs::write(&output, b"").expect("output");
    let alias = dir.path().join("alias.jsonl");
    std::os::unix::fs::symlink(&output, &alias).expect("symlink");
    let lock_of =
        |p: &Path| SidecarPaths::for_output(&std::fs::canonicalize(p).expect("resolve")).run_lock;
    let held = RunLock::for_output(&lock_of(&output), None).expect("first owner");
    match RunLock::for_output(&lock_of(&alias), None) {
        Err(LockError::Owned(path)) => assert_eq!(path, lock_of(&output)),
        other => panic!("the alias must share the lock: {other:?}"),
    }
    drop(held);
    let again = RunLock::for_output(&lock_of(&alias), None).expect("free after release");
    assert!(lock_of(&output).exists(), "the lock file is never unlinked");
    drop(again);
    let checkpoints = dir.path().join("ckpt");
    let first = RunLock::for_output(&dir.path().join("a_run.lock"), Some(&checkpoints)).expect("a");
    let error = RunLock::for_output(&dir.path().join("b_run.lock"), Some(&checkpoints))
        .expect_err("shared checkpoints conflict");
    assert!(
        error
            .to_string()
            .contains("Another collector owns this run")
            && error.to_string().contains(".collector.lock"),
        "{error}"
    );
    drop(first);
    assert!(
        RunLock::for_output(&dir.path().join("b_run.lock"), None).is_ok(),
        "a failed acquisition released what it took"
    );
}

/// A lock whose run-lock file was removed takes the new file at the path again, while the
/// checkpoint lock still in place passes to the new lock with no moment unlocked (dropping the
/// old lock releases nothing the new one holds); when another owner holds the new file, the
/// retake is refused and the old lock keeps what it holds.
#[test]
fn a_displaced_lock_file_is_taken_again_without_releasing_the_files_in_place() {
    let _serial = serial_locks();
    let dir = tempfile::tempdir().expect("dir");
    let run_lock = dir.path().join("a_run.lock");
    let checkpoint = dir.path().join("ckpt/.collector.lock");
    let owned = |path: &Path| {
        matches!(
            RunLock::acquire([path.to_owned()]),
            Err(LockError::Owned(_))
        )
    };
    let old = RunLock::acquire([run_lock.clone(), checkpoint.clone()]).expect("first owner");
    assert!(
        old.retake_displaced().expect("in place").is_none(),
        "nothing to take again"
    );
    std::fs::remove_file(&run_lock).expect("remove the run lock");
    assert!(!old.is_in_place());
    assert!(!owned(&run_lock), "nobody holds the new file yet");
    let new = old
        .retake_displaced()
        .expect("the new file is free")
        .expect("a lock taken again");
    assert!(new.is_in_place());
    drop(old);
    assert!(owned(&run_lock), "the new run-lock file is held");
    assert!(
        owned(&checkpoint),
        "the checkpoint lock passed to the new lock: dropping the old one did not release it"
    );
    drop(new);
    assert!(
        !owned(&run_lock) && !owned(&checkpoint),
        "all released with the new lock"
    );

    let old = RunLock::acquire([run_lock.clone()]).expect("owner again");
    std::fs::remove_file(&run_lock).expect("remove again");
    let other = RunLock::acquire([run_lock.clone()]).expect("another owner takes the new file");
    match old.retake_displaced() {
        Err(LockError::Owned(path)) => assert_eq!(path, run_lock),
        other => panic!("the new file is another owner's: {other:?}"),
    }
    drop(old);
    assert!(owned(&run_lock), "the other owner keeps the new file");
    drop(other);
}

/// A lock taken again keeps the removed file locked until it ends (a process that opened the
/// old file before it went never gets its `flock` meanwhile), and is taken only in the directory
/// the first lock was taken in: a directory moved away and replaced by a link to elsewhere, or
/// removed, refuses the retake and creates nothing.
#[test]
fn a_lock_taken_again_keeps_the_removed_file_and_stays_in_its_directory() {
    let _serial = serial_locks();
    let dir = tempfile::tempdir().expect("dir");
    let run_dir = dir.path().join("run");
    let run_lock = run_dir.join("a_run.lock");
    let old = RunLock::acquire([run_lock.clone()]).expect("first owner");
    let mut waiter =
        fd_lock::RwLock::new(std::fs::File::open(&run_lock).expect("open the old file"));
    std::fs::remove_file(&run_lock).expect("remove the lock file");
    let new = old.retake_displaced().expect("free").expect("taken again");
    drop(old);
    assert!(
        waiter.try_write().is_err(),
        "the removed file stays locked while the new lock stands"
    );
    drop(new);
    assert!(waiter.try_write().is_ok(), "released with the new lock");
    drop(waiter);

    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).expect("elsewhere");
    let old = RunLock::acquire([run_lock.clone()]).expect("owner again");
    std::fs::rename(&run_dir, dir.path().join("moved")).expect("move the directory");
    std::os::unix::fs::symlink(&elsewhere, &run_dir).expect("a link in its place");
    match old.retake_displaced() {
        Err(LockError::Moved(path)) => assert_eq!(path, run_lock),
        other => panic!("a link to another directory refuses: {other:?}"),
    }
    assert!(
        std::fs::read_dir(&elsewhere)
            .expect("read")
            .next()
            .is_none(),
        "nothing was created through the link"
    );
    std::fs::remove_file(&run_dir).expect("remove the link");
    assert!(
        old.retake_displaced().is_err(),
        "a removed directory refuses"
    );
    assert!(!run_dir.exists(), "and is not created again");
}

/// A lock file with another name (a hard link, perhaps to a file outside the roots, or another
/// run's lock) is never locked: refused as not a lock file of its own.
#[test]
fn a_hard_linked_lock_file_is_refused() {
    let _serial = serial_locks();
    let dir = tempfile::tempdir().expect("dir");
    let outside = dir.path().join("outside.lock");
    std::fs::write(&outside, b"").expect("outside");
    let run_lock = dir.path().join("a_run.lock");
    std::fs::hard_link(&outside, &run_lock).expect("hard link");
    match RunLock::acquire([run_lock.clone()]) {
        Err(LockError::NotAFile(path)) => assert_eq!(path, run_lock),
        other => panic!("a hard-linked lock file is refused: {other:?}"),
    }
    std::fs::remove_file(&outside).expect("unlink the other name");
    assert!(
        RunLock::acquire([run_lock]).is_ok(),
        "a file of its own is locked"
    );
}

/// A forked process holds a copy of every descriptor until it execs or exits; a released run
/// lock must be free at once all the same (a collector's judge spawned at the wrong moment
/// never keeps the next section out).
#[test]
#[allow(unsafe_code)]
fn a_released_lock_is_free_at_once_while_a_forked_child_still_holds_its_descriptor() {
    use std::os::fd::AsRawFd;
    let _serial = serial_locks();
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("out_run.lock");
    let held = RunLock::acquire([path.clone()]).expect("first owner");
    let (reader, writer) = std::io::pipe().expect("pipe");
    // SAFETY: the child calls only async-signal-safe functions (read, _exit) before it exits.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork failed");
    if child == 0 {
        // The child keeps its copies of the lock file's descriptor until the parent closes
        // the pipe (its own copy of the write end closed first, or the read never ends).
        let mut byte = 0u8;
        unsafe {
            libc::close(writer.as_raw_fd());
            libc::read(
                reader.as_raw_fd(),
                (&raw mut byte).cast::<libc::c_void>(),
                1,
            );
            libc::_exit(0);
        }
    }
    drop(reader);
    drop(held);
    let again = RunLock::acquire([path.clone()]);
    drop(writer);
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    let waited = unsafe { libc::waitpid(child, &raw mut status, 0) };
    assert_eq!(waited, child, "the child was reaped");
    assert!(
        again.is_ok(),
        "the lock was released while the child still had the file open: {again:?}"
    );
}

#[test]
fn concurrent_acquirers_of_one_lock_get_exactly_one_owner() {
    let _serial = serial_locks();
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("out_run.lock");
    let barrier = std::sync::Barrier::new(64);
    let winners: Vec<RunLock> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..64)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    RunLock::acquire([path.clone()]).ok()
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().expect("thread"))
            .collect()
    });
    assert_eq!(winners.len(), 1, "exactly one of 64 acquirers owns the run");
}

const PYTHON_HOLDER: &str = "import fcntl, sys\nf = open(sys.argv[1], 'a+b')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nprint('locked', flush=True)\nsys.stdin.read()\n";
const PYTHON_PROBE: &str = "import fcntl, sys\nf = open(sys.argv[1], 'a+b')\ntry:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    print('acquired')\nexcept BlockingIOError:\n    print('blocked')\n";

#[test]
fn a_python_collector_and_this_service_exclude_each_other() {
    let _serial = serial_locks();
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("out_run.lock");
    let mut holder = Command::new("python3")
        .args(["-c", PYTHON_HOLDER])
        .arg(&path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    BufReader::new(holder.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    assert_eq!(line.trim(), "locked");
    let error = RunLock::acquire([path.clone()]).expect_err("Python owns the run");
    let text = error.to_string();
    assert!(
        text.contains("Another collector owns this run")
            && text.contains(&path.display().to_string()),
        "{text}"
    );
    drop(holder.stdin.take());
    assert!(holder.wait().expect("python exits").success());
    let ours = RunLock::acquire([path.clone()]).expect("free once Python exits");
    let probe = Command::new("python3")
        .args(["-c", PYTHON_PROBE])
        .arg(&path)
        .output()
        .expect("python3");
    assert_eq!(
        String::from_utf8_lossy(&probe.stdout).trim(),
        "blocked",
        "our lock blocks Python's non-blocking flock"
    );
    drop(ours);
    let probe = Command::new("python3")
        .args(["-c", PYTHON_PROBE])
        .arg(&path)
        .output()
        .expect("python3");
    assert_eq!(String::from_utf8_lossy(&probe.stdout).trim(), "acquired");
}

#[test]
fn a_time_bound_is_the_earliest_stored_time_not_before_its_instant() {
    let cases: [(&str, Option<&str>); 9] = [
        // Already at a microsecond (any offset, any precision down to it): unchanged instant.
        ("2026-11-29T10:00:00Z", Some("2026-11-29T10:00:00.000000Z")),
        (
            "2026-11-29T11:00:00.25+01:00",
            Some("2026-11-29T10:00:00.250000Z"),
        ),
        (
            "2026-11-29T10:00:00.123456Z",
            Some("2026-11-29T10:00:00.123456Z"),
        ),
        // Finer than a microsecond: the next microsecond, never the one before the instant.
        (
            "2026-11-29T10:00:00.1234561Z",
            Some("2026-11-29T10:00:00.123457Z"),
        ),
        (
            "2026-11-29T10:00:00.0000005Z",
            Some("2026-11-29T10:00:00.000001Z"),
        ),
        (
            "2026-11-29T23:59:59.999999001Z",
            Some("2026-11-30T00:00:00.000000Z"),
        ),
        // Instants the fixed-width form cannot hold.
        ("9999-12-31T23:30:00-01:00", None),
        ("0000-01-01T00:30:00+01:00", None),
        ("9999-12-31T23:59:59.9999999Z", None),
    ];
    for (text, expected) in cases {
        let bound = recovery_sidecar::stored_time_bound(text);
        assert_eq!(bound.as_deref().ok(), expected, "{text}");
        if expected.is_none() {
            assert!(
                matches!(bound, Err(recovery_sidecar::TimeError::OutOfRange)),
                "{text}"
            );
            assert!(
                recovery_sidecar::normalize_rfc3339(text).is_err()
                    || text.starts_with("9999-12-31T23:59:59")
            );
        }
    }
    assert!(matches!(
        recovery_sidecar::stored_time_bound("2026-11-29 10:00:00"),
        Err(recovery_sidecar::TimeError::NotRfc3339(_))
    ));
}
