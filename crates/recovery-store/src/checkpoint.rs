//! SQLite's WAL checkpoints taken off the writers' path.
//!
//! By default the connection that commits a transaction which takes the write-ahead log past
//! its threshold copies the log into the database file and waits for the `fsync` (measured
//! during a reindex: the writer sat in that `fsync` with a core idle, and every commit behind
//! it waited too). Here one connection of its own checkpoints every [`INTERVAL`] (`PASSIVE`:
//! never waits for readers or writers), so commits only append to the log while the disk
//! catches up beside them. The pool's connections keep an automatic checkpoint at a higher
//! threshold ([`SAFETY_NET`]) should this task fall behind or stop.
//!
//! Invariant: the checkpointing task ends when the store's last clone is dropped or the store
//! is closed; it never holds a pool connection.

use sqlx::{AnyConnection, ConnectOptions as _, Connection};
use std::time::Duration;

/// How often the log is checkpointed: often enough that it stays a few MB under load.
const INTERVAL: Duration = Duration::from_millis(200);

/// The pool connections' own automatic checkpoint threshold: 65,536 pages of the log, 256 MiB
/// (SQLite's default is 1,000). A log starts over only once everything in it was copied and a
/// new transaction begins, so under a long stream of commits (a reindex) it grows while this
/// task copies it; past the threshold every commit copied the log itself, on the writer's
/// thread. Measured, a reindex of 1M journal lines (six alternating runs each): 16,384 pages
/// 115k-125k lines/s (mean 120k), this threshold 125k-142k (mean 132k).
pub(crate) const SAFETY_NET: &str = "PRAGMA wal_autocheckpoint = 65536";

/// What the log file is cut back to when it starts over, if larger: the threshold's size. A
/// log file is reused from its start, and cut back to 64 MiB a reindex was no faster than
/// before (120k lines/s): growing the file again cost what copying on the writer did.
pub(crate) const LOG_SIZE_LIMIT: &str = "PRAGMA journal_size_limit = 268435456";

/// The running checkpointer; dropping it stops it.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    task: tokio::task::AbortHandle,
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Checkpointer {
    /// Opens the checkpointer's connection to the (already migrated, WAL) database at `url`
    /// and starts checkpointing.
    pub(crate) async fn start(url: &str) -> Result<Self, sqlx::Error> {
        // Its statement, five times a second, is not logged (debug logs were mostly it).
        let options = std::str::FromStr::from_str(url).map(|o: sqlx::any::AnyConnectOptions| {
            o.log_statements(tracing::log::LevelFilter::Off)
        })?;
        let mut connection = AnyConnection::connect_with(&options).await?;
        sqlx::query("PRAGMA busy_timeout = 10000")
            .execute(&mut connection)
            .await?;
        // Copying the log is background work too.
        crate::priority::lower_sqlite_threads();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = checkpoint(&mut connection).await {
                    // The writers' own threshold still checkpoints: slower, never lost.
                    tracing::warn!(error = %e, "a background WAL checkpoint failed");
                }
            }
        });
        Ok(Self {
            task: task.abort_handle(),
        })
    }

    /// Stops checkpointing (the store is closing).
    pub(crate) fn stop(&self) {
        self.task.abort();
    }
}

/// Copies what the log holds into the database file, as far as readers allow.
async fn checkpoint(connection: &mut AnyConnection) -> Result<(), sqlx::Error> {
    sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
        .execute(connection)
        .await?;
    Ok(())
}
