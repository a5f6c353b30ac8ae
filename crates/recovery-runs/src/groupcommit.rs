//! Group commit of journal appends: concurrent appends to one journal are written by one writer
//! with one `write` and one `fdatasync`, and each caller learns where its line starts.
//!
//! Invariants (the pattern of a database's group commit, as in mini-redis's small primitives):
//! - each journal has one writer at a time: the caller that takes the journal's leader mutex
//!   writes every line queued so far, its own included, then answers each caller; callers that
//!   queued while it wrote are written by the next leader, in arrival order;
//! - a caller is answered only after its line is durable (written and fdatasynced) or the write
//!   failed (then every line of that write is refused, none half-kept: a torn tail is repaired
//!   before the next append);
//! - the write itself runs on a blocking thread that owns the batch and the leader mutex, so a
//!   caller that goes away never abandons the lines of others nor lets a second writer in.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use tokio::sync::oneshot;

type Answer = oneshot::Sender<Result<u64, Failure>>;

/// Why a batch was not written, as each of its callers is told.
#[derive(Debug, Clone)]
struct Failure {
    message: String,
    not_a_file: bool,
}

/// One journal's queue and its leader mutex.
#[derive(Debug, Default)]
struct Journal {
    queued: Mutex<Vec<(Vec<u8>, Answer)>>,
    leader: Arc<tokio::sync::Mutex<()>>,
}

/// Every journal this process appends to (entries vanish once nobody appends).
#[derive(Debug, Clone, Default)]
pub struct GroupJournals {
    journals: Arc<Mutex<HashMap<PathBuf, Weak<Journal>>>>,
    /// Writes (each one `write` and one `fdatasync`) so far.
    writes: Arc<std::sync::atomic::AtomicU64>,
}

/// Why an append failed.
#[derive(Debug, thiserror::Error)]
#[error("appending to {path}: {message}")]
pub struct AppendError {
    pub path: String,
    pub message: String,
    /// Something other than a regular file is where the journal belongs (see
    /// [`recovery_sidecar::is_not_a_regular_file`]): the run's files' problem, not the service's.
    pub not_a_file: bool,
}

impl GroupJournals {
    fn journal(&self, path: &Path) -> Arc<Journal> {
        let mut journals = self.journals.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(journal) = journals.get(path).and_then(Weak::upgrade) {
            return journal;
        }
        journals.retain(|_, weak| weak.strong_count() > 0);
        let journal = Arc::new(Journal::default());
        journals.insert(path.to_owned(), Arc::downgrade(&journal));
        journal
    }

    /// How many writes (each one `write` and one `fdatasync`) appends took so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Appends one line (without its newline) to the journal at `path` and fsyncs it, together
    /// with whatever other callers append at the same time; returns the byte offset it starts
    /// at. The caller holds the run's section (shared or exclusive).
    pub async fn append(&self, path: &Path, line: Vec<u8>) -> Result<u64, AppendError> {
        let failed = |failure: Failure| AppendError {
            path: path.display().to_string(),
            message: failure.message,
            not_a_file: failure.not_a_file,
        };
        let broken = |message: String| Failure {
            message,
            not_a_file: false,
        };
        let journal = self.journal(path);
        let (answer, mut answered) = oneshot::channel();
        journal
            .queued
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((line, answer));
        let leader = journal.leader.clone().lock_owned().await;
        // A previous leader may have written this line with its batch.
        if let Ok(result) = answered.try_recv() {
            return result.map_err(failed);
        }
        let batch = std::mem::take(
            &mut *journal
                .queued
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let target = path.to_owned();
        self.writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The leader's guard goes with the write: a leader whose caller goes away keeps the
        // journal until its batch is written.
        crate::background::spawn(move || {
            write_batch(&target, batch);
            drop(leader);
        })
        .await
        .map_err(|e| failed(broken(e.to_string())))?;
        answered
            .await
            .map_err(|_| failed(broken("the batch writer went away".into())))?
            .map_err(failed)
    }
}

/// Tells the operator what an append found at a journal's end: a tail cut off is a write a
/// crash interrupted (its caller was never answered), kept out of the journal; a complete last
/// line without its newline was kept. Silent when the file ended cleanly.
pub fn report_repair(path: &Path, repair: recovery_sidecar::TailRepair) {
    match repair {
        recovery_sidecar::TailRepair::Clean => {}
        recovery_sidecar::TailRepair::Terminated => tracing::warn!(
            journal = %path.display(),
            "the journal's last line lacked its newline (a write interrupted after its last byte); the newline was added"
        ),
        recovery_sidecar::TailRepair::Truncated(bytes) => tracing::warn!(
            journal = %path.display(),
            bytes_removed = bytes,
            "the journal ended in an incomplete line (a write interrupted by a crash); it was cut off before appending"
        ),
    }
}

/// Writes a batch with one write and one fdatasync, and answers each line's caller.
fn write_batch(path: &Path, batch: Vec<(Vec<u8>, Answer)>) {
    let lines: Vec<&[u8]> = batch.iter().map(|(line, _)| line.as_slice()).collect();
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| recovery_sidecar::append_lines_at(path, &lines))
        .map_err(|e| Failure {
            message: e.to_string(),
            not_a_file: recovery_sidecar::is_not_a_regular_file(&e),
        });
    match written {
        Ok((repair, offsets)) => {
            report_repair(path, repair);
            // Lines per fdatasync is what group commit buys: the two counters' ratio.
            metrics::counter!("rollout_recovery_journal_syncs_total").increment(1);
            metrics::counter!("rollout_recovery_journal_lines_total")
                .increment(offsets.len() as u64);
            for ((_, answer), offset) in batch.into_iter().zip(offsets) {
                let _ = answer.send(Ok(offset));
            }
        }
        Err(failure) => {
            for (_, answer) in batch {
                let _ = answer.send(Err(failure.clone()));
            }
        }
    }
}
