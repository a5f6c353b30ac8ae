//! SQLite's connection threads at the priority of the service's other blocking work.
//!
//! sqlx runs each SQLite connection on a thread of its own (`sqlx-sqlite-worker-N`), which
//! started at the process's priority: under a load of large drift pages those threads, four
//! runnable at once, kept the async workers that answer `/healthz` waiting for a core (p99
//! 9-10 ms against the 4-6 ms of every other load). They run at nice +5 here, as tokio's blocking
//! threads do (`recovery_runs::background`), so an async worker that wakes preempts them.
//!
//! Invariant: only threads named by sqlx's SQLite driver are lowered, never raised, and only on
//! Linux (elsewhere, and when `/proc` cannot be read, nothing changes).

/// The nice value of SQLite's connection threads.
pub(crate) const NICE: i32 = 5;

/// The name sqlx gives its SQLite connection threads, as `/proc` shows it (15 bytes at most).
const WORKER_NAME: &str = "sqlx-sqlite-wor";

/// Lowers every SQLite connection thread of this process below [`NICE`] to it. Called after each
/// connection is made (its thread exists by then); threads already lowered are left alone.
pub(crate) fn lower_sqlite_threads() {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    for task in tasks.flatten() {
        let named = std::fs::read_to_string(task.path().join("comm"))
            .is_ok_and(|name| name.starts_with(WORKER_NAME));
        let tid = task
            .file_name()
            .to_str()
            .and_then(|tid| tid.parse::<i32>().ok())
            .and_then(rustix::process::Pid::from_raw);
        if let (true, Some(tid)) = (named, tid) {
            // Raising a thread's nice value is always allowed; failing to is harmless.
            if rustix::process::getpriority_process(Some(tid)).is_ok_and(|nice| nice < NICE) {
                let _ = rustix::process::setpriority_process(Some(tid), NICE);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread named `name` that reports its id and waits until the returned sender is dropped.
    fn waiting_thread(name: &str) -> (rustix::process::Pid, std::sync::mpsc::Sender<()>) {
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                tid_tx.send(rustix::thread::gettid()).expect("tid");
                let _ = stop_rx.recv();
            })
            .expect("thread");
        (tid_rx.recv().expect("tid"), stop_tx)
    }

    #[test]
    fn sqlite_connection_threads_are_lowered_and_no_other_thread_is() {
        let (worker, _stop_worker) = waiting_thread("sqlx-sqlite-worker-7");
        let (other, _stop_other) = waiting_thread("tokio-rt-worker");
        let nice = |tid| rustix::process::getpriority_process(Some(tid)).expect("nice");
        let other_before = nice(other);
        lower_sqlite_threads();
        assert_eq!(nice(worker), NICE.max(other_before));
        assert_eq!(
            nice(other),
            other_before,
            "other threads keep their priority"
        );
        // Once lowered, a thread is left alone; one already lower is never raised.
        let lower = nice(worker) + 2;
        rustix::process::setpriority_process(Some(worker), lower).expect("lowered");
        lower_sqlite_threads();
        assert_eq!(nice(worker), lower);
    }
}
