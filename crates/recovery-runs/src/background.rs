//! Blocking work (file reads, hashing, identity computation, fsyncs) off the async executor, on
//! tokio's blocking threads at a lower scheduling priority (nice +5) than the async workers that
//! accept connections and answer cheap calls such as `/healthz`: when the cores are busy with
//! validations, a worker preempts the blocking threads instead of waiting out their time slices.
//! The service's heavy-work pool (batch classification, plans) runs lower still (+10).
//!
//! Invariant: only threads of tokio's blocking pool are lowered (once each, on their first job);
//! the async workers keep the priority the process started with.

use std::cell::Cell;

/// The nice increment of blocking threads.
const NICE: i32 = 5;

/// Runs `work` on a blocking thread of lower priority (see the module doc).
pub async fn spawn<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    tokio::task::spawn_blocking(move || {
        lower_this_thread();
        work()
    })
    .await
}

fn lower_this_thread() {
    thread_local! {
        static LOWERED: Cell<bool> = const { Cell::new(false) };
    }
    if !LOWERED.with(|lowered| lowered.replace(true)) {
        // Lowering one's own priority is always allowed; failing to is harmless.
        let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), NICE);
    }
}
