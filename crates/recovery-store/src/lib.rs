//! The store: the queryable record of runs, resume outcomes, drift, approvals, attempt changes,
//! re-judgments, leases and operator actions, over SQLite (the default: one file, WAL) or
//! PostgreSQL (several replicas), through one API.
//!
//! Invariants: the sidecar files stay canonical; every event row carries the id of its sidecar
//! line, so inserts are idempotent (`ON CONFLICT DO NOTHING`) and a reindex can replay sidecars
//! any number of times without duplicates; drift rows hold keys and digests, never values; times
//! are fixed-width RFC 3339 UTC text, so text order is time order on both backends; queries are
//! runtime queries with `$N` placeholders, which both drivers accept. An SQLite file belongs to
//! one service process, which holds its lock (`owner.rs`: another process is refused); there a
//! run's record and its lease are answered from memory once read, and forgotten by every write
//! of them (`rowcache.rs`). Drift events are also numbered in the order they commit (migration
//! 0009: SQLite's one writer; on PostgreSQL a transaction advisory lock every drift insert takes
//! first), under an epoch that changes when the database is made again, for followers.

mod checkpoint;
mod driftpages;
mod owner;
mod priority;
mod records;
mod rowcache;

pub use records::*;

use driftpages::{DriftPages, DriftVersion};
use owner::Owner;

use recovery_core::identity::redaction::is_credential_name;
use sqlx::Connection as _;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::pool::PoolConnection;
use sqlx::{Any, AnyConnection, AnyPool, Row};
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Which database a store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The URL's scheme is neither SQLite's nor PostgreSQL's (what it is, never the rest of the
    /// URL: a connection string may hold a password anywhere).
    #[error("unsupported database URL: {0} (use sqlite://... or postgres://...)")]
    UnsupportedUrl(String),
    /// The database named by the URL could not be reached at start (the URL with its password
    /// hidden).
    #[error("cannot connect to the database {url}: {source}")]
    Unreachable {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    /// A PostgreSQL URL's query parameter the driver does not take (it would log the value,
    /// which may be a password spelt otherwise: `PASSWORD=`, `passwd=`).
    #[error("database URL: unknown query parameter `{0}` (PostgreSQL's are {list})", list = POSTGRES_PARAMETERS.join(", "))]
    UnknownParameter(String),
    /// A file a PostgreSQL URL names for TLS (`sslrootcert`, `sslcert`, `sslkey`) cannot be read.
    #[error("database URL: {parameter}={path} cannot be read: {reason}")]
    UnreadableFile {
        parameter: String,
        path: String,
        reason: String,
    },
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    #[error("stored JSON is unreadable: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the store is closed")]
    Closed,
    /// Another process serves this SQLite file (several replicas need PostgreSQL).
    #[error(
        "another service process uses this SQLite database (it holds {0}): one process per SQLite file; several replicas need a postgres:// database"
    )]
    InUse(String),
    /// The SQLite file has several names (hard links): no lock by name covers them all.
    #[error(
        "the SQLite database {0} has more than one name (hard links): SQLite keeps its journal and locks by name, so two processes could serve it unknowingly; give it one name"
    )]
    HardLinked(String),
    #[error("cannot take the SQLite database's lock {path}: {source}")]
    Lock {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A group commit this caller's rows were part of failed.
    #[error("database error: {0}")]
    Grouped(String),
}

static SQLITE_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/sqlite");
static POSTGRES_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/postgres");

/// One store API over SQLite and PostgreSQL.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    /// Connections that may sit in a held advisory lock at once: fewer than the pool, so a
    /// critical section holding one can always get another for its writes.
    advisory_slots: Arc<Semaphore>,
    /// Event rows of concurrent callers, committed together.
    group: Arc<Group>,
    /// The database's owner in this process: its lock and row caches (see [`owner`]).
    owner: Arc<Owner>,
    /// SQLite's WAL checkpoints, off the writers' path (see [`checkpoint`]).
    checkpointer: Option<Arc<checkpoint::Checkpointer>>,
    /// Drift pages answered before, each with the history's version it was read at (see
    /// [`driftpages`]).
    drift_pages: Arc<DriftPages>,
}

/// An event row written through the group commit ([`Store::insert_grouped`]).
#[derive(Debug, Clone)]
pub enum GroupedRow {
    Resume(ResumeEvent),
    Drift(DriftEvent),
}

type GroupAnswer = tokio::sync::oneshot::Sender<Result<(), String>>;

/// The group commit's queue and its leader mutex (see [`Store::insert_grouped`]).
#[derive(Debug, Default)]
struct Group {
    queued: std::sync::Mutex<Vec<(Vec<GroupedRow>, GroupAnswer)>>,
    leader: Arc<tokio::sync::Mutex<()>>,
}

/// The most rows one list query returns: a page of up to 1,000 and the row after it, by which
/// the caller knows another page follows (a cap of 1,000 hid every page after a full one).
pub const MAX_ROWS: u32 = 1001;

const SQLITE_CONNECTIONS: u32 = 4;

/// The page size of a new SQLite database: 32 KiB rather than SQLite's 4 KiB. A reindex inserts
/// into four B-trees per drift event, and with larger pages it splits and balances them, and
/// writes log frames, several times less often. Measured on 2 cores, a start-up reindex of 1M
/// journal lines from an empty database: 4 KiB 169-187k lines/s, 16 KiB 172-215k, 32 KiB
/// 173-239k (mostly 206-239k), 64 KiB 234k; durable drift events (many one-event commits, each
/// writing its pages whole) were within the noise of 4 KiB at 16 and 32 KiB (3.4-4.2k events/s),
/// and drift pages as fast. A database made by an earlier release keeps its 4 KiB pages (a page
/// size changes only by `VACUUM`).
const SQLITE_PAGE_SIZE: &str = "PRAGMA page_size = 32768";
const POSTGRES_CONNECTIONS: u32 = 16;

/// A PostgreSQL session advisory lock held on its own pooled connection (spanning replicas that
/// share the database); released when dropped. On SQLite there is nothing to hold: replicas of
/// one SQLite file share a machine, where the run's `flock` excludes them.
#[derive(Debug)]
pub struct AdvisoryLock {
    /// In a mutex only to make the lock `Sync` (it is never locked concurrently).
    held: std::sync::Mutex<Option<(PoolConnection<Any>, i64, bool)>>,
    _slot: Option<OwnedSemaphorePermit>,
}

impl Drop for AdvisoryLock {
    fn drop(&mut self) {
        let held = self
            .held
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some((mut connection, key, shared)) = held else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let unlock = if shared {
                    "SELECT pg_advisory_unlock_shared($1)"
                } else {
                    "SELECT pg_advisory_unlock($1)"
                };
                runtime.spawn(async move {
                    let unlocked = sqlx::query(unlock)
                        .bind(key)
                        .execute(&mut *connection)
                        .await;
                    if unlocked.is_err() {
                        // Closing the session releases every lock it held.
                        let _ = connection.close().await;
                    }
                });
            }
            // Without a runtime the connection is dropped unpooled: its session ends.
            Err(_) => drop(connection.detach()),
        }
    }
}

/// A drift event as one element of the page [`Store::query_drift`] has the database build.
#[derive(serde::Deserialize)]
struct DriftRow(String, String, String, String, String, Vec<String>);

/// A drift event as [`DriftRow`], each field kept as the JSON text the database wrote.
#[derive(serde::Deserialize)]
struct RawDriftRow<'a>(#[serde(borrow)] [&'a serde_json::value::RawValue; 6]);

impl RawDriftRow<'_> {
    /// The event's time, its JSON string's text without the quotes.
    fn at(&self) -> &str {
        unquoted(self.0[2].get())
    }

    fn id(&self) -> &str {
        unquoted(self.0[0].get())
    }
}

fn unquoted(json: &str) -> &str {
    json.strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or(json)
}

/// What precedes each of a [`RawDriftRow`]'s fields in an event's JSON object: the names
/// [`DriftEvent`] serializes, in its order.
const DRIFT_EVENT_FIELDS: [&str; 6] = [
    "{\"event_id\":",
    ",\"run_id\":",
    ",\"at\":",
    ",\"saved_config_digest\":",
    ",\"current_config_digest\":",
    ",\"operational_keys\":",
];

/// A page of drift events as the API's JSON array ([`Store::query_drift_rendered`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedDriftPage {
    /// `[{"event_id": ..., ...}, ...]`: the events of [`DriftEvent`]'s JSON form, in the page's
    /// order.
    pub events_json: String,
    /// Where the next page starts (its last event), when more events match.
    pub next: Option<Cursor>,
    /// The API's answer holding this page, built once by the first caller that answers it
    /// (the page is kept between requests: later answers send the same bytes, not a copy).
    pub answer: std::sync::OnceLock<bytes::Bytes>,
}

/// Lays out the rows of a page's database text (`page_size` events at most, one more when
/// another follows) as the API's JSON array, and where the next page starts.
fn render_drift_page(
    text: &str,
    page_size: usize,
    newest_first: bool,
) -> Result<RenderedDriftPage, StoreError> {
    let mut rows: Vec<RawDriftRow> = serde_json::from_str(text)?;
    // As in `query_drift`. Both fields are stored plain (a normalized time, a hex id), so
    // their JSON texts without the quotes order as the strings do.
    rows.sort_unstable_by(|a, b| (a.at(), a.id()).cmp(&(b.at(), b.id())));
    if newest_first {
        rows.reverse();
    }
    let more = rows.len() > page_size;
    rows.truncate(page_size);
    let next = match rows.last().filter(|_| more) {
        Some(last) => Some(Cursor {
            at: serde_json::from_str(last.0[2].get())?,
            id: serde_json::from_str(last.0[0].get())?,
        }),
        None => None,
    };
    let mut events_json = String::with_capacity(text.len() + rows.len() * 100);
    events_json.push('[');
    for (n, RawDriftRow(fields)) in rows.iter().enumerate() {
        if n > 0 {
            events_json.push(',');
        }
        for (name, value) in DRIFT_EVENT_FIELDS.iter().zip(fields) {
            events_json.push_str(name);
            events_json.push_str(value.get());
        }
        events_json.push('}');
    }
    events_json.push(']');
    Ok(RenderedDriftPage {
        events_json,
        next,
        answer: std::sync::OnceLock::new(),
    })
}

/// A drift event and its recorded position, as [`Store::follow_drift`] has the database build.
#[derive(serde::Deserialize)]
struct FollowedRow(String, String, String, String, String, Vec<String>, i64);

/// The transaction-scoped PostgreSQL advisory lock every drift-inserting transaction takes
/// before it draws recorded positions, so that positions are drawn and committed in one order
/// (migration 0009). Any constant works; this one spells "driftseq".
const DRIFT_RECORD_LOCK: i64 = 0x6472_6966_7473_6571;

/// The drift history's version (see [`driftpages`]) as two columns of a `SELECT`: the recorded
/// order's highest position and its epoch.
const DRIFT_VERSION: &str = "(SELECT COALESCE(MAX(seq), 0) FROM drift_recorded), \
                             (SELECT epoch FROM drift_recorded_epoch)";

impl DriftRow {
    fn into_event(self) -> DriftEvent {
        let DriftRow(event_id, run_id, at, saved_config_digest, current_config_digest, keys) = self;
        DriftEvent {
            event_id,
            run_id,
            at,
            saved_config_digest,
            current_config_digest,
            operational_keys: keys,
        }
    }
}

/// How a kept lease id starts: the rest is the SHA-256 of the id, in hex.
const LEASE_DIGEST_PREFIX: &str = "sha256:";

/// What is kept of a lease id, in the database and in memory: `sha256:` and the SHA-256 of the
/// id. The id is its holder's proof of ownership and is shown once, to the collector it is
/// granted to; a reader of the database (or of a backup) cannot present it, as console session
/// tokens, which are kept hashed too. Ids are 128 random bits: no salt is needed.
pub fn lease_digest(lease_id: &str) -> String {
    format!(
        "{LEASE_DIGEST_PREFIX}{}",
        recovery_core::canonical::sha256_hex(lease_id.as_bytes())
    )
}

fn json_list(value: &str) -> Result<Vec<String>, StoreError> {
    Ok(serde_json::from_str(value)?)
}

/// `($1, $2, ...), ($n+1, ...)`: `rows` tuples of `columns` numbered placeholders.
fn placeholders(rows: usize, columns: usize) -> String {
    (0..rows)
        .map(|row| {
            let cells: Vec<String> = (1..=columns)
                .map(|column| format!("${}", row * columns + column))
                .collect();
            format!("({})", cells.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

type Tx<'a> = sqlx::Transaction<'a, Any>;

/// Keeps as digests the lease ids an older release recorded in clear (before [`lease_digest`]),
/// so their holders go on presenting the ids they were given. Idempotent: replicas starting
/// together each convert what is still clear.
async fn digest_clear_lease_ids(pool: &AnyPool) -> Result<(), StoreError> {
    let clear: Vec<(String,)> = sqlx::query_as(
        "SELECT lease_id FROM leases WHERE lease_id NOT LIKE $1 \
         UNION SELECT lease_id FROM lease_locks WHERE lease_id NOT LIKE $1",
    )
    .bind(format!("{LEASE_DIGEST_PREFIX}%"))
    .fetch_all(pool)
    .await?;
    if clear.is_empty() {
        return Ok(());
    }
    let mut tx = pool.begin().await?;
    for (lease_id,) in &clear {
        for table in ["leases", "lease_locks"] {
            sqlx::query(&format!(
                "UPDATE {table} SET lease_id = $1 WHERE lease_id = $2"
            ))
            .bind(lease_digest(lease_id))
            .bind(lease_id)
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    tracing::info!(
        leases = clear.len(),
        "lease ids an older release kept in clear are kept as digests"
    );
    Ok(())
}

/// Inserts resume events (a few dozen: one statement) in `tx`.
/// Inserts resume events in `tx`. SQLite takes positional `?` parameters: it looks a `$N` up
/// by name, so binding a statement of twenty events cost a quadratic walk of its parameter list
/// (profiled: 3% of the CPU of a validate answering `reuse` under load).
async fn insert_resume_events(
    tx: &mut Tx<'_>,
    backend: Backend,
    events: &[&ResumeEvent],
) -> Result<(), StoreError> {
    let values = match backend {
        Backend::Sqlite => positional(events.len(), 12),
        Backend::Postgres => placeholders(events.len(), 12),
    };
    let sql = format!(
        "INSERT INTO resume_events (event_id, run_id, output_path, at, outcome, message, reasons, semantic_keys, \
         operational_keys, saved_config_digest, current_config_digest, client) \
         VALUES {values} ON CONFLICT (event_id) DO NOTHING"
    );
    let mut query = sqlx::query(&sql);
    for event in events {
        query = query
            .bind(&event.event_id)
            .bind(&event.run_id)
            .bind(&event.output_path)
            .bind(&event.at)
            .bind(&event.outcome)
            .bind(&event.message)
            .bind(to_json(&event.reasons))
            .bind(to_json(&event.semantic_keys))
            .bind(to_json(&event.operational_keys))
            .bind(&event.saved_config_digest)
            .bind(&event.current_config_digest)
            .bind(&event.client);
    }
    query.execute(&mut **tx).await?;
    Ok(())
}

/// Inserts drift events and their keys in `tx`; returns how many were new. SQLite takes
/// multi-row statements with positional `?` parameters (it looks a `$N` up by name, which made
/// large statements quadratic, and unpacking JSON in SQL cost more than binding); PostgreSQL
/// takes the rows as one JSON array parameter it unpacks (`json_array_elements`), two statements
/// whatever their number.
async fn insert_drift_chunk(
    tx: &mut Tx<'_>,
    backend: Backend,
    events: &[&DriftEvent],
) -> Result<usize, StoreError> {
    match backend {
        Backend::Sqlite => insert_drift_sqlite(tx, events).await,
        Backend::Postgres => insert_drift_postgres(tx, events).await,
    }
}

/// `(?, ?, ...), (?, ...)`: `rows` tuples of `columns` positional parameters.
fn positional(rows: usize, columns: usize) -> String {
    let tuple = format!("({})", vec!["?"; columns].join(", "));
    vec![tuple; rows].join(", ")
}

/// One statement of an SQLite drift insert, over a chunk of rows.
///
/// Every statement is `INSERT OR IGNORE` rather than `ON CONFLICT DO NOTHING`: the same for
/// these rows (their values are never NULL, their only constraint is the key), but a statement
/// that cannot abort needs no statement journal. With one, each statement copied every page it
/// changed into that journal first (perf of a 1M-line reindex: 5% of SQLite's time; start-up
/// reindex 190-209k lines/s before, 209-234k after, 32 KiB pages).
enum DriftStatement<'a> {
    /// Numbers the events of the chunk that `drift_events` lacks, in the order given, in the
    /// recorded order (migration 0010: the statement does what a trigger did per row, at less
    /// than half the cost). Runs before they are inserted, in the same transaction: SQLite has
    /// one writer, so nothing commits between the check and the insert, and the numbers are in
    /// commit order. An event later than every recorded one is new without a lookup (the
    /// latest time is read once per statement): a reindex inserts in time order, and the
    /// lookup per event was a quarter of numbering them (1M lines: 1.41 -> 1.08 s).
    Record(&'a [&'a DriftEvent]),
    /// Numbers, in time order, the events later than the given time: run right after a chunk
    /// whose events are all later than every recorded one, in time order, is inserted, it
    /// numbers that chunk as `Record` would, reading the new rows back from the table instead
    /// of binding their keys again and looking them up (a reindex inserts such chunks).
    RecordAfter(&'a str),
    /// Inserts the chunk's events.
    Events(&'a [&'a DriftEvent]),
    /// Inserts drifted keys: `(key, at, event id)`. Keys of events already known are known
    /// too (ids derive from the lines): no-ops.
    Keys(&'a [(&'a String, &'a String, &'a String)]),
}

/// Events in one statement of an SQLite drift insert ([`DriftStatement`]): 3,000 bound values,
/// which the service's SQLite lookaside holds (rollout-recovery's `allocator.rs`).
const EVENTS_PER_STATEMENT: usize = 500;
/// Keys in one statement of an SQLite drift insert ([`DriftStatement`]).
const KEYS_PER_STATEMENT: usize = 1000;

impl<'a> DriftStatement<'a> {
    /// The statement's text. A full chunk's is built once per process: formatting hundreds of
    /// rows of placeholders before every statement showed in perf of a 1M-line reindex, spent
    /// while the database's writer waited for the statement.
    fn sql(&self) -> std::borrow::Cow<'static, str> {
        use std::sync::OnceLock;
        static FULL: [OnceLock<String>; 4] = [const { OnceLock::new() }; 4];
        let (kind, rows, full) = match self {
            Self::RecordAfter(_) => (3, 1, 1),
            Self::Record(rows) => (0, rows.len(), EVENTS_PER_STATEMENT),
            Self::Events(rows) => (1, rows.len(), EVENTS_PER_STATEMENT),
            Self::Keys(rows) => (2, rows.len(), KEYS_PER_STATEMENT),
        };
        if rows == full {
            FULL[kind].get_or_init(|| self.text(rows)).as_str().into()
        } else {
            self.text(rows).into()
        }
    }

    /// The statement's text for `rows` rows.
    fn text(&self, rows: usize) -> String {
        match self {
            Self::Record(_) => {
                // The ordinal is a number this code formats: it keeps the recorded order the
                // given one.
                let values: Vec<String> = (0..rows).map(|n| format!("(?, ?, {n})")).collect();
                format!(
                    "INSERT OR IGNORE INTO drift_recorded (at, event_id) SELECT v.column1, v.column2 FROM (VALUES {}) AS v \
                     WHERE v.column1 > coalesce((SELECT max(at) FROM drift_events), '') \
                     OR NOT EXISTS (SELECT 1 FROM drift_events d WHERE d.at = v.column1 AND d.event_id = v.column2) \
                     ORDER BY v.column3",
                    values.join(", ")
                )
            }
            Self::RecordAfter(_) => "INSERT OR IGNORE INTO drift_recorded (at, event_id) \
                 SELECT at, event_id FROM drift_events WHERE at > ? ORDER BY at, event_id"
                .to_owned(),
            Self::Events(_) => format!(
                "INSERT OR IGNORE INTO drift_events (at, event_id, run_id, saved_config_digest, current_config_digest, operational_keys) \
                 VALUES {}",
                positional(rows, 6)
            ),
            Self::Keys(_) => format!(
                "INSERT OR IGNORE INTO drift_event_keys (key, at, event_id) VALUES {}",
                positional(rows, 3)
            ),
        }
    }

    /// The statement `sql` with this chunk's values bound, borrowed rather than copied (a bound
    /// `&String` is cloned into the arguments; SQLite copies each value once more as it binds).
    fn bound<'q>(&self, sql: &'q str) -> sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>>
    where
        'a: 'q,
    {
        let mut query = sqlx::query(sql);
        match self {
            Self::RecordAfter(latest) => query = query.bind(*latest),
            Self::Record(rows) => {
                for event in *rows {
                    query = query.bind(event.at.as_str()).bind(event.event_id.as_str());
                }
            }
            Self::Events(rows) => {
                for event in *rows {
                    query = query
                        .bind(event.at.as_str())
                        .bind(event.event_id.as_str())
                        .bind(event.run_id.as_str())
                        .bind(event.saved_config_digest.as_str())
                        .bind(event.current_config_digest.as_str())
                        .bind(to_json(&event.operational_keys));
                }
            }
            Self::Keys(rows) => {
                for (key, at, id) in *rows {
                    query = query.bind(key.as_str()).bind(at.as_str()).bind(id.as_str());
                }
            }
        }
        query
    }
}

/// `events` without repeats of an event (the first is kept): a repeat in one statement would be
/// numbered twice in the recorded order.
fn distinct_events<'a>(events: &[&'a DriftEvent]) -> Vec<&'a DriftEvent> {
    let mut seen = std::collections::HashSet::with_capacity(events.len());
    events
        .iter()
        .copied()
        .filter(|event| seen.insert((event.at.as_str(), event.event_id.as_str())))
        .collect()
}

/// Inserts drift events in statements of at most 500 events (1,000 keys) each. A chunk of
/// events later than every recorded one, in (time, id) order, is numbered by
/// [`DriftStatement::RecordAfter`] after its insert; any other by [`DriftStatement::Record`]
/// before it. The latest recorded time is read once, after the first chunk (the transaction
/// then holds SQLite's write lock, so no other writer moves it), and followed from the chunks
/// after that. (Binding the next statement's values while SQLite ran the one before was
/// tried: within the noise, 3%.)
async fn insert_drift_sqlite(tx: &mut Tx<'_>, events: &[&DriftEvent]) -> Result<usize, StoreError> {
    let events = distinct_events(events);
    let mut inserted = 0;
    let mut latest: Option<String> = None;
    for (n, rows) in events.chunks(EVENTS_PER_STATEMENT).enumerate() {
        if n == 1 {
            latest = sqlx::query_scalar("SELECT max(at) FROM drift_events")
                .fetch_one(&mut **tx)
                .await?;
        }
        let after = latest
            .as_deref()
            .filter(|latest| later_and_in_order(rows, latest));
        let statements = match after {
            Some(latest) => [
                DriftStatement::Events(rows),
                DriftStatement::RecordAfter(latest),
            ],
            None => [DriftStatement::Record(rows), DriftStatement::Events(rows)],
        };
        for statement in &statements {
            let affected = execute_drift_statement(tx, statement).await?;
            if matches!(statement, DriftStatement::Events(_)) {
                inserted += affected;
            }
        }
        if let (Some(known), Some(last)) = (&latest, rows.iter().map(|e| &e.at).max()) {
            if last > known {
                latest = Some(last.clone());
            }
        }
    }
    let keys: Vec<(&String, &String, &String)> = events
        .iter()
        .flat_map(|e| {
            e.operational_keys
                .iter()
                .map(move |k| (k, &e.at, &e.event_id))
        })
        .collect();
    for rows in keys.chunks(KEYS_PER_STATEMENT) {
        execute_drift_statement(tx, &DriftStatement::Keys(rows)).await?;
    }
    Ok(inserted)
}

/// Whether every event of `rows` is later than `latest`, and the rows in (time, id) order:
/// then they are new, and [`DriftStatement::RecordAfter`] numbers them in the order given.
fn later_and_in_order(rows: &[&DriftEvent], latest: &str) -> bool {
    rows.first().is_some_and(|first| first.at.as_str() > latest)
        && rows
            .windows(2)
            .all(|pair| (&pair[0].at, &pair[0].event_id) < (&pair[1].at, &pair[1].event_id))
}

/// Runs one drift statement; returns the rows it changed.
async fn execute_drift_statement(
    tx: &mut Tx<'_>,
    statement: &DriftStatement<'_>,
) -> Result<usize, StoreError> {
    let text = statement.sql();
    Ok(statement
        .bound(&text)
        .execute(&mut **tx)
        .await?
        .rows_affected() as usize)
}

async fn insert_drift_postgres(
    tx: &mut Tx<'_>,
    events: &[&DriftEvent],
) -> Result<usize, StoreError> {
    let rows: Vec<(&str, &str, &str, &str, &str, String)> = events
        .iter()
        .map(|e| {
            (
                e.event_id.as_str(),
                e.run_id.as_str(),
                e.at.as_str(),
                e.saved_config_digest.as_str(),
                e.current_config_digest.as_str(),
                to_json(&e.operational_keys),
            )
        })
        .collect();
    let rows = serde_json::to_string(&rows)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(DRIFT_RECORD_LOCK)
        .execute(&mut **tx)
        .await?;
    let inserted = sqlx::query(
        "INSERT INTO drift_events (event_id, run_id, at, saved_config_digest, current_config_digest, operational_keys) \
         SELECT x ->> 0, x ->> 1, x ->> 2, x ->> 3, x ->> 4, x ->> 5 FROM json_array_elements($1::json) AS x \
         ON CONFLICT (at, event_id) DO NOTHING",
    )
    .bind(&rows)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    sqlx::query(
        "INSERT INTO drift_event_keys (key, at, event_id) \
         SELECT k, x ->> 2, x ->> 0 FROM json_array_elements($1::json) AS x, json_array_elements_text((x ->> 5)::json) AS k \
         ON CONFLICT (key, at, event_id) DO NOTHING",
    )
    .bind(&rows)
    .execute(&mut **tx)
    .await?;
    Ok(inserted as usize)
}

fn to_json(list: &[String]) -> String {
    serde_json::to_string(list).unwrap_or_else(|_| "[]".into())
}

/// How [`shown_database_url`] shows a URL it cannot take apart.
const UNPARSABLE_URL: &str =
    "(a database URL that does not parse; not shown: it may hold a password)";

/// What is shown of a database URL in logs and errors: the URL with the password of its user
/// info and the value of every credential-named query parameter (`password`, `sslpassword`, ...)
/// replaced by `***`; a text that is not a URL is not shown at all.
pub fn shown_database_url(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return UNPARSABLE_URL.into();
    };
    let hidden = "***";
    // An `@` the parser did not take as the end of the user info (a password holding `@`, `/`,
    // `?` or `#` unescaped, which the parser cut short) may be where a password ends: all before
    // the last one is hidden, as in configurations (hostile review 52, F4).
    let user_info = !parsed.username().is_empty() || parsed.password().is_some();
    if url.matches('@').count() > usize::from(user_info) {
        return match (url.split_once("://"), url.rfind('@')) {
            (Some((scheme, _)), Some(last)) => {
                shown_database_url(&format!("{scheme}://{hidden}{}", &url[last..]))
            }
            _ => UNPARSABLE_URL.into(),
        };
    }
    let secret_params = parsed
        .query_pairs()
        .any(|(key, _)| is_credential_name(&key));
    if parsed.password().is_none() && !secret_params {
        // Nothing to hide: the URL as given (serializing would re-encode a path's spaces).
        return url.to_owned();
    }
    if parsed.password().is_some() {
        // Fails only for URLs that cannot have user info, which then have no password.
        let _ = parsed.set_password(Some(hidden));
    }
    if secret_params {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(key, value)| {
                let shown = if is_credential_name(&key) {
                    hidden.to_owned()
                } else {
                    value.into_owned()
                };
                (key.into_owned(), shown)
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.to_string()
}

/// The query parameters sqlx's PostgreSQL driver reads; it logs any other with its value.
const POSTGRES_PARAMETERS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// Refuses a PostgreSQL URL with a parameter the driver would ignore (and log, value and all),
/// naming the key only.
fn refuse_unknown_postgres_parameters(url: &str) -> Result<(), StoreError> {
    let Ok(parsed) = url::Url::parse(url) else {
        return Ok(()); // The driver refuses it, without logging parameters.
    };
    match parsed
        .query_pairs()
        .find(|(key, _)| !POSTGRES_PARAMETERS.contains(&key.as_ref()))
    {
        Some((key, _)) => Err(StoreError::UnknownParameter(key.into_owned())),
        None => refuse_unreadable_tls_files(&parsed),
    }
}

/// A certificate or key file the URL names that cannot be read, named with its parameter (the
/// driver's own refusal names neither).
fn refuse_unreadable_tls_files(parsed: &url::Url) -> Result<(), StoreError> {
    for (key, path) in parsed.query_pairs() {
        if matches!(key.as_ref(), "sslrootcert" | "sslcert" | "sslkey") {
            if let Err(e) = std::fs::File::open(path.as_ref()) {
                return Err(StoreError::UnreadableFile {
                    parameter: key.into_owned(),
                    path: path.into_owned(),
                    reason: e.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// What an unsupported URL is named by: its scheme when it has one, never the rest.
fn unsupported_scheme(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(parsed) => format!("the scheme {:?}", parsed.scheme()),
        Err(_) => {
            "not a URL (a connection string such as `host=... user=...` is not accepted)".to_owned()
        }
    }
}

impl Store {
    /// Connects (creating an SQLite file when needed) and applies the migrations.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Backend::Postgres
        } else {
            return Err(StoreError::UnsupportedUrl(unsupported_scheme(url)));
        };
        if backend == Backend::Postgres {
            refuse_unknown_postgres_parameters(url)?;
        }
        let url = match backend {
            Backend::Sqlite if !url.contains("mode=") => {
                format!("{url}{}mode=rwc", if url.contains('?') { "&" } else { "?" })
            }
            _ => url.to_owned(),
        };
        // Before anything is migrated or written: the file's one service process.
        let owner = match backend {
            Backend::Sqlite => Owner::of_sqlite(&url)?,
            Backend::Postgres => Owner::uncached(),
        };
        let connections = match backend {
            Backend::Sqlite => SQLITE_CONNECTIONS,
            Backend::Postgres => POSTGRES_CONNECTIONS,
        };
        // One connection first: a database that cannot be reached is named at once with the
        // driver's reason, where the pool would retry in silence for its whole acquire timeout.
        let shown = shown_database_url(&url);
        tracing::info!(url = %shown, "connecting to the database");
        // Reading SQLite's schema reads the file's header, so a file that is no database is
        // named here too (the pool's set-up retried it for 30 s: hostile review 52, F5).
        let probe = match backend {
            Backend::Sqlite => "SELECT count(*) FROM sqlite_schema",
            Backend::Postgres => "SELECT 1",
        };
        let reached = async {
            let mut connection = AnyConnection::connect(&url).await?;
            sqlx::query(probe).execute(&mut connection).await?;
            connection.close().await
        };
        reached
            .await
            .map_err(|source| StoreError::Unreachable { url: shown, source })?;
        let pool = AnyPoolOptions::new()
            .max_connections(connections)
            // An SQLite connection is a file handle: a ping before every use (one more round
            // trip to its worker thread) finds nothing a query would not.
            .test_before_acquire(backend == Backend::Postgres)
            .after_connect(move |connection, _| {
                Box::pin(async move {
                    if backend == Backend::Sqlite {
                        // Before anything is written: a new database's page size is fixed by
                        // its first write (switching to WAL is one); an existing one keeps its own.
                        sqlx::query(SQLITE_PAGE_SIZE)
                            .execute(&mut *connection)
                            .await?;
                        // WAL lets readers run beside the writer; waits instead of failing on a
                        // briefly locked database.
                        sqlx::query("PRAGMA journal_mode = WAL")
                            .execute(&mut *connection)
                            .await?;
                        sqlx::query("PRAGMA busy_timeout = 10000")
                            .execute(&mut *connection)
                            .await?;
                        sqlx::query("PRAGMA synchronous = NORMAL")
                            .execute(&mut *connection)
                            .await?;
                        // 64 MiB of page cache: index pages of large reindexes stay in memory
                        // until their commit instead of spilling to the WAL midway.
                        sqlx::query("PRAGMA cache_size = -65536")
                            .execute(&mut *connection)
                            .await?;
                        // Reads through a map of the file (up to 1 GiB) instead of copying
                        // each page into every connection's cache: drift pages over 1M events
                        // took 30-45% less CPU (load bench). The mapped pages are the kernel's
                        // page cache, counted in RSS as RssFile. The file is this process's
                        // alone (`Owner`), so nothing truncates it under the map.
                        sqlx::query("PRAGMA mmap_size = 1073741824")
                            .execute(&mut *connection)
                            .await?;
                        // Statement journals (a multi-row insert into indexed tables writes
                        // one inside each transaction) kept in memory rather than in a temporary
                        // file: a drift commit spent a sixth of its time writing one (perf).
                        sqlx::query("PRAGMA temp_store = MEMORY")
                            .execute(&mut *connection)
                            .await?;
                        // The checkpointer copies the log into the database; a commit does
                        // only should it fall far behind.
                        sqlx::query(checkpoint::SAFETY_NET)
                            .execute(&mut *connection)
                            .await?;
                        sqlx::query(checkpoint::LOG_SIZE_LIMIT)
                            .execute(&mut *connection)
                            .await?;
                        priority::lower_sqlite_threads();
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        match backend {
            Backend::Sqlite => SQLITE_MIGRATIONS.run(&pool).await?,
            Backend::Postgres => POSTGRES_MIGRATIONS.run(&pool).await?,
        }
        digest_clear_lease_ids(&pool).await?;
        let checkpointer = match backend {
            Backend::Sqlite => Some(Arc::new(checkpoint::Checkpointer::start(&url).await?)),
            Backend::Postgres => None,
        };
        Ok(Self {
            pool,
            backend,
            advisory_slots: Arc::new(Semaphore::new(connections as usize / 2)),
            group: Arc::default(),
            owner,
            checkpointer,
            drift_pages: Arc::default(),
        })
    }

    /// Holds the cross-replica lock named `key` until the result is dropped (waits for it). On
    /// SQLite nothing is held.
    pub async fn advisory_lock(&self, key: i64) -> Result<AdvisoryLock, StoreError> {
        self.advisory(key, false).await
    }

    /// [`Self::advisory_lock`] in shared mode: shared holders of one key coexist, never with an
    /// exclusive one.
    pub async fn advisory_lock_shared(&self, key: i64) -> Result<AdvisoryLock, StoreError> {
        self.advisory(key, true).await
    }

    async fn advisory(&self, key: i64, shared: bool) -> Result<AdvisoryLock, StoreError> {
        if self.backend == Backend::Sqlite {
            return Ok(AdvisoryLock {
                held: std::sync::Mutex::new(None),
                _slot: None,
            });
        }
        let slot = self
            .advisory_slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| StoreError::Closed)?;
        let mut connection = self.pool.acquire().await?;
        let take = if shared {
            "SELECT pg_advisory_lock_shared($1)"
        } else {
            "SELECT pg_advisory_lock($1)"
        };
        sqlx::query(take)
            .bind(key)
            .execute(&mut *connection)
            .await?;
        Ok(AdvisoryLock {
            held: std::sync::Mutex::new(Some((connection, key, shared))),
            _slot: Some(slot),
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Whether the database answers (readiness).
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    pub async fn close(&self) {
        if let Some(checkpointer) = &self.checkpointer {
            checkpointer.stop();
        }
        self.pool.close().await;
    }

    // --- runs -----------------------------------------------------------------------------

    /// Records a run, or updates its digests and flags (a run's manifest may be rewritten). In
    /// one transaction: another run recorded for the same output path is marked superseded by
    /// this one (kept in history under a suffixed path); returns that run's id.
    pub async fn upsert_run(&self, run: &RunRecord) -> Result<Option<String>, StoreError> {
        let result = self.upsert_run_uncached(run).await;
        // Another run's record may have changed too (superseded).
        self.owner.runs.forget_all();
        result
    }

    async fn upsert_run_uncached(&self, run: &RunRecord) -> Result<Option<String>, StoreError> {
        // The first statement writes: a transaction that reads first would have to upgrade its
        // SQLite snapshot to write, which fails (BUSY_SNAPSHOT) under concurrent writers instead
        // of waiting.
        let mut transaction = self.pool.begin().await?;
        let previous: Option<String> = sqlx::query_scalar(
            "UPDATE runs SET output_path = output_path || '#superseded-by-' || $2, superseded_by = $2 \
             WHERE output_path = $1 AND run_id <> $2 RETURNING run_id",
        )
        .bind(&run.output_path)
        .bind(&run.run_id)
        .fetch_optional(&mut *transaction)
        .await?;
        let insert = sqlx::query(
            "INSERT INTO runs (run_id, output_path, source_digest, materialized_digest, config_digest, legacy_import, \
             identity_overridden, max_rollout_attempts, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
             ON CONFLICT (run_id) DO UPDATE SET output_path = excluded.output_path, source_digest = excluded.source_digest, \
             materialized_digest = excluded.materialized_digest, config_digest = excluded.config_digest, \
             legacy_import = excluded.legacy_import, identity_overridden = excluded.identity_overridden, \
             max_rollout_attempts = excluded.max_rollout_attempts, updated_at = excluded.updated_at, superseded_by = NULL",
        );
        Self::bind_run(insert, run, run.output_path.clone())
            .execute(&mut *transaction)
            .await?;
        transaction.commit().await?;
        Ok(previous)
    }

    /// Records a run that `successor` had already replaced at its output (a set-aside manifest
    /// a rebuild from the files found): kept in history as [`Self::upsert_run`] keeps a run it
    /// supersedes, under the suffixed path, never touching the output's current run. A run
    /// already recorded (or a suffixed path already taken) is left as it is: `false`.
    pub async fn insert_superseded_run(
        &self,
        run: &RunRecord,
        successor: &str,
    ) -> Result<bool, StoreError> {
        let insert = sqlx::query(
            "INSERT INTO runs (run_id, output_path, source_digest, materialized_digest, config_digest, legacy_import, \
             identity_overridden, max_rollout_attempts, created_at, updated_at, superseded_by) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING",
        );
        let suffixed = format!("{}#superseded-by-{successor}", run.output_path);
        let inserted = Self::bind_run(insert, run, suffixed)
            .bind(successor)
            .execute(&self.pool)
            .await?
            .rows_affected()
            > 0;
        self.owner.runs.forget(&run.run_id);
        Ok(inserted)
    }

    /// `query` with a run's ten columns bound in the order `runs` lists them
    /// (`run_id` .. `updated_at`), its output path as `output_path` (a superseded run's is
    /// suffixed).
    fn bind_run<'q>(
        query: sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>>,
        run: &'q RunRecord,
        output_path: String,
    ) -> sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>> {
        query
            .bind(&run.run_id)
            .bind(output_path)
            .bind(&run.source_digest)
            .bind(&run.materialized_digest)
            .bind(&run.config_digest)
            .bind(i64::from(run.legacy_import))
            .bind(i64::from(run.identity_overridden))
            .bind(run.max_rollout_attempts)
            .bind(&run.created_at)
            .bind(&run.updated_at)
    }

    fn run_from_row(row: &AnyRow) -> Result<RunRecord, StoreError> {
        let superseded_by: Option<String> = row.try_get("superseded_by")?;
        let mut output_path: String = row.try_get("output_path")?;
        // The row keeps a superseded run under a suffixed path (an output has one current
        // run); the record names the output it wrote (hostile review 32: the suffix showed).
        if let Some(successor) = &superseded_by
            && let Some(path) = output_path.strip_suffix(&format!("#superseded-by-{successor}"))
        {
            output_path = path.to_owned();
        }
        Ok(RunRecord {
            run_id: row.try_get("run_id")?,
            output_path,
            source_digest: row.try_get("source_digest")?,
            materialized_digest: row.try_get("materialized_digest")?,
            config_digest: row.try_get("config_digest")?,
            legacy_import: row.try_get::<i64, _>("legacy_import")? != 0,
            identity_overridden: row.try_get::<i64, _>("identity_overridden")? != 0,
            max_rollout_attempts: row.try_get("max_rollout_attempts")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            superseded_by,
        })
    }

    const LEASE_COLUMNS: &'static str =
        "run_id, lease_id, holder, host, pid, acquired_at, renewed_at, expires_at, replica";

    const RUN_COLUMNS: &'static str = "run_id, output_path, source_digest, materialized_digest, config_digest, legacy_import, \
         identity_overridden, max_rollout_attempts, created_at, updated_at, superseded_by";

    pub async fn get_run(&self, run_id: &str) -> Result<Option<RunRecord>, StoreError> {
        let since = match self.owner.runs.get(run_id) {
            Ok(cached) => return Ok(cached),
            Err(since) => since,
        };
        let sql = format!("SELECT {} FROM runs WHERE run_id = $1", Self::RUN_COLUMNS);
        let row = sqlx::query(&sql)
            .bind(run_id)
            .fetch_optional(&self.pool)
            .await?;
        let run = row.as_ref().map(Self::run_from_row).transpose()?;
        self.owner.runs.fill(run_id, run.clone(), since);
        Ok(run)
    }

    /// The run that owns the output of `run_id` now: `run_id` itself, or the end of its chain
    /// of replacements (a run superseded twice names its successor, itself superseded, in its
    /// record; hostile review 39 followed a `superseded_by` into another `run_superseded`).
    pub async fn current_owner(&self, run_id: &str) -> Result<String, StoreError> {
        // A chain is as long as the replacements of one output; the bound only guards a cycle
        // no write makes.
        const HOPS: usize = 10_000;
        let mut owner = run_id.to_owned();
        for _ in 0..HOPS {
            match self.get_run(&owner).await?.and_then(|r| r.superseded_by) {
                Some(successor) => owner = successor,
                None => break,
            }
        }
        Ok(owner)
    }

    pub async fn find_run_by_output(
        &self,
        output_path: &str,
    ) -> Result<Option<RunRecord>, StoreError> {
        let sql = format!(
            "SELECT {} FROM runs WHERE output_path = $1",
            Self::RUN_COLUMNS
        );
        let row = sqlx::query(&sql)
            .bind(output_path)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(Self::run_from_row).transpose()
    }

    /// Runs by creation time, newest first, after an optional (created_at, run_id) cursor.
    pub async fn list_runs(
        &self,
        limit: u32,
        before: Option<&Cursor>,
    ) -> Result<Vec<RunRecord>, StoreError> {
        self.runs_page(None, limit, before).await
    }

    /// Runs whose output path contains `text`, newest first, paged like [`Self::list_runs`].
    pub async fn search_runs(
        &self,
        text: &str,
        limit: u32,
        before: Option<&Cursor>,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let pattern = format!(
            "%{}%",
            text.replace('\\', "\\\\")
                .replace('%', "\\%")
                .replace('_', "\\_")
        );
        self.runs_page(Some(pattern), limit, before).await
    }

    /// Newest runs first (keyset paged by creation time and id), those whose output path is
    /// `LIKE` the pattern when one is given.
    async fn runs_page(
        &self,
        pattern: Option<String>,
        limit: u32,
        before: Option<&Cursor>,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let mut conditions = Vec::new();
        let mut binds = Vec::new();
        if let Some(pattern) = pattern {
            binds.push(pattern);
            conditions.push("output_path LIKE $1 ESCAPE '\\'".to_owned());
        }
        if let Some(cursor) = before {
            let (at, id) = (binds.len() + 1, binds.len() + 2);
            binds.extend([cursor.at.clone(), cursor.id.clone()]);
            conditions.push(format!(
                "(created_at < ${at} OR (created_at = ${at} AND run_id < ${id}))"
            ));
        }
        let mut sql = format!("SELECT {} FROM runs", Self::RUN_COLUMNS);
        if !conditions.is_empty() {
            sql.push_str(" WHERE ");
            sql.push_str(&conditions.join(" AND "));
        }
        sql.push_str(&format!(
            " ORDER BY created_at DESC, run_id DESC LIMIT {}",
            limit.clamp(1, MAX_ROWS)
        ));
        let mut query = sqlx::query(&sql);
        for value in &binds {
            query = query.bind(value);
        }
        query
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(Self::run_from_row)
            .collect()
    }

    // --- resume events ---------------------------------------------------------------------

    /// Records one validate outcome (refusals included); `false` when the id was known.
    pub async fn insert_resume_event(&self, event: &ResumeEvent) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "INSERT INTO resume_events (event_id, run_id, output_path, at, outcome, message, reasons, semantic_keys, \
             operational_keys, saved_config_digest, current_config_digest, client) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT (event_id) DO NOTHING",
        )
        .bind(&event.event_id)
        .bind(&event.run_id)
        .bind(&event.output_path)
        .bind(&event.at)
        .bind(&event.outcome)
        .bind(&event.message)
        .bind(to_json(&event.reasons))
        .bind(to_json(&event.semantic_keys))
        .bind(to_json(&event.operational_keys))
        .bind(&event.saved_config_digest)
        .bind(&event.current_config_digest)
        .bind(&event.client)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    pub async fn list_resume_events(
        &self,
        run_id: &str,
        limit: u32,
    ) -> Result<Vec<ResumeEvent>, StoreError> {
        self.page_resume_events(run_id, None, limit).await
    }

    /// A run's validations, newest first (time, then id, descending), older than `before` when
    /// given (the last of the previous page): keyset paging along the run's time index.
    pub async fn page_resume_events(
        &self,
        run_id: &str,
        before: Option<&Cursor>,
        limit: u32,
    ) -> Result<Vec<ResumeEvent>, StoreError> {
        let older = if before.is_some() {
            " AND (at < $2 OR (at = $2 AND event_id < $3))"
        } else {
            ""
        };
        let sql = format!(
            "SELECT event_id, run_id, output_path, at, outcome, message, reasons, semantic_keys, operational_keys, \
             saved_config_digest, current_config_digest, client FROM resume_events WHERE run_id = $1{older} \
             ORDER BY at DESC, event_id DESC LIMIT {}",
            limit.clamp(1, MAX_ROWS)
        );
        let mut query = sqlx::query(&sql).bind(run_id);
        if let Some(cursor) = before {
            query = query.bind(&cursor.at).bind(&cursor.id);
        }
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter()
            .map(|row| {
                Ok(ResumeEvent {
                    event_id: row.try_get("event_id")?,
                    run_id: row.try_get("run_id")?,
                    output_path: row.try_get("output_path")?,
                    at: row.try_get("at")?,
                    outcome: row.try_get("outcome")?,
                    message: row.try_get("message")?,
                    reasons: json_list(&row.try_get::<String, _>("reasons")?)?,
                    semantic_keys: json_list(&row.try_get::<String, _>("semantic_keys")?)?,
                    operational_keys: json_list(&row.try_get::<String, _>("operational_keys")?)?,
                    saved_config_digest: row.try_get("saved_config_digest")?,
                    current_config_digest: row.try_get("current_config_digest")?,
                    client: row.try_get("client")?,
                })
            })
            .collect()
    }

    // --- group commit ----------------------------------------------------------------------

    /// Records event rows in one transaction with the rows concurrent callers record (group
    /// commit: a caller that finds no commit running commits everything queued, its own rows
    /// included; callers that queue meanwhile are committed by the next one). Answers once its
    /// rows are committed. Inserts are idempotent, so a submission that fails together with
    /// others is retried on its own and fails alone.
    pub async fn insert_grouped(&self, rows: Vec<GroupedRow>) -> Result<(), StoreError> {
        let (answer, mut answered) = tokio::sync::oneshot::channel();
        self.group
            .queued
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((rows, answer));
        let leader = self.group.leader.clone().lock_owned().await;
        if let Ok(result) = answered.try_recv() {
            return result.map_err(StoreError::Grouped);
        }
        let batch = std::mem::take(
            &mut *self
                .group
                .queued
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let store = self.clone();
        // The commit owns the batch and the leader mutex: a caller that goes away abandons
        // nobody's rows and lets no second commit in.
        tokio::spawn(async move {
            store.commit_group(batch).await;
            drop(leader);
        })
        .await
        .map_err(|e| StoreError::Grouped(e.to_string()))?;
        answered
            .await
            .map_err(|_| StoreError::Grouped("the group commit went away".into()))?
            .map_err(StoreError::Grouped)
    }

    async fn commit_group(&self, batch: Vec<(Vec<GroupedRow>, GroupAnswer)>) {
        let all: Vec<&GroupedRow> = batch.iter().flat_map(|(rows, _)| rows).collect();
        if self.insert_rows(&all).await.is_ok() {
            for (_, answer) in batch {
                let _ = answer.send(Ok(()));
            }
            return;
        }
        for (rows, answer) in batch {
            let rows: Vec<&GroupedRow> = rows.iter().collect();
            let result = self.insert_rows(&rows).await.map_err(|e| e.to_string());
            let _ = answer.send(result);
        }
    }

    /// Inserts event rows in one transaction.
    async fn insert_rows(&self, rows: &[&GroupedRow]) -> Result<(), StoreError> {
        let resumes: Vec<&ResumeEvent> = rows
            .iter()
            .filter_map(|r| match r {
                GroupedRow::Resume(e) => Some(e),
                GroupedRow::Drift(_) => None,
            })
            .collect();
        let drifts: Vec<&DriftEvent> = rows
            .iter()
            .filter_map(|r| match r {
                GroupedRow::Drift(e) => Some(e),
                GroupedRow::Resume(_) => None,
            })
            .collect();
        let mut tx = self.pool.begin().await?;
        for chunk in resumes.chunks(20) {
            insert_resume_events(&mut tx, self.backend, chunk).await?;
        }
        if !drifts.is_empty() {
            insert_drift_chunk(&mut tx, self.backend, &drifts).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    // --- journal marks ---------------------------------------------------------------------

    /// How far the journal at `path` was indexed.
    pub async fn journal_mark(&self, path: &str) -> Result<Option<JournalMarkRow>, StoreError> {
        let row = sqlx::query(
            "SELECT device, inode, indexed_to, before_mark FROM journal_marks WHERE path = $1",
        )
        .bind(path)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| {
            Ok(JournalMarkRow {
                device: r.try_get("device")?,
                inode: r.try_get("inode")?,
                indexed_to: r.try_get("indexed_to")?,
                before_mark: r.try_get("before_mark")?,
            })
        })
        .transpose()
    }

    /// Records how far each of several journals (its path, its mark) was indexed, in one
    /// transaction.
    pub async fn set_journal_marks(
        &self,
        marks: &[(String, JournalMarkRow)],
    ) -> Result<(), StoreError> {
        if marks.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await?;
        for (path, mark) in marks {
            sqlx::query(
                "INSERT INTO journal_marks (path, device, inode, indexed_to, before_mark) VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (path) DO UPDATE SET device = excluded.device, inode = excluded.inode, \
                 indexed_to = excluded.indexed_to, before_mark = excluded.before_mark",
            )
            .bind(path)
            .bind(mark.device)
            .bind(mark.inode)
            .bind(mark.indexed_to)
            .bind(mark.before_mark.as_deref())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    // --- drift -----------------------------------------------------------------------------

    /// Records one resume across operational drift with its keys; `false` when already known.
    pub async fn insert_drift_event(&self, event: &DriftEvent) -> Result<bool, StoreError> {
        Ok(self
            .insert_drift_events(std::slice::from_ref(event))
            .await?
            == 1)
    }

    /// Records drift events, twenty thousand to a transaction (event ids are hashes, so each
    /// transaction dirties pages all over the indexes: SQLite writes each dirty page once per
    /// commit, and small transactions rewrote the same pages again and again); returns how many
    /// were new.
    pub async fn insert_drift_events(&self, events: &[DriftEvent]) -> Result<usize, StoreError> {
        let mut inserted = 0;
        for batch in events.chunks(20_000) {
            let mut tx = self.pool.begin().await?;
            let rows: Vec<&DriftEvent> = batch.iter().collect();
            inserted += insert_drift_chunk(&mut tx, self.backend, &rows).await?;
            tx.commit().await?;
        }
        Ok(inserted)
    }

    /// Drift events in time order (or newest first), each filter driven by its index: a key by the key index in
    /// time order, a run by the run index, time bounds and cursors as index ranges (a deep page
    /// costs what the first does).
    pub async fn query_drift(&self, filter: &DriftFilter) -> Result<Vec<DriftEvent>, StoreError> {
        let (text, _) = self.drift_page_text(filter, filter.limit).await?;
        let mut rows: Vec<DriftRow> = serde_json::from_str(&text)?;
        // The aggregate keeps no promised order (ordering it in SQL made SQLite sort the page
        // again in a temporary table); the page is the inner query's, in (time, id) order.
        rows.sort_unstable_by(|a, b| (&a.2, &a.0).cmp(&(&b.2, &b.0)));
        if filter.newest_first {
            rows.reverse();
        }
        Ok(rows.into_iter().map(DriftRow::into_event).collect())
    }

    /// A page of [`Store::query_drift`] (`filter.limit` events at most) as the JSON array the
    /// API answers with, and where the next page starts when more events match. The database's
    /// JSON text is passed through, never read into events and written out again: for a page of
    /// 1,000 events that round trip was a third of the service's CPU (profiled). A page asked
    /// for again while the history is unchanged is answered from memory ([`driftpages`]).
    pub async fn query_drift_rendered(
        &self,
        filter: &DriftFilter,
    ) -> Result<Arc<RenderedDriftPage>, StoreError> {
        let current = self.drift_version().await?;
        if let Some(page) = self.drift_pages.get(filter, &current) {
            return Ok(page);
        }
        let page_size = filter.limit.clamp(1, MAX_ROWS - 1) as usize;
        // One more than the page: a cursor is given only when another event follows.
        let (text, version) = self.drift_page_text(filter, page_size as u32 + 1).await?;
        let page = Arc::new(render_drift_page(&text, page_size, filter.newest_first)?);
        self.drift_pages
            .keep(filter.clone(), version, Arc::clone(&page));
        Ok(page)
    }

    /// The drift history's version as it is now (see [`driftpages`]): one lookup of the
    /// recorded order's highest position (its primary key) and its epoch.
    async fn drift_version(&self) -> Result<DriftVersion, StoreError> {
        let (head, epoch) = sqlx::query_as::<_, (i64, String)>(&format!("SELECT {DRIFT_VERSION}"))
            .fetch_one(&self.pool)
            .await?;
        Ok(DriftVersion { epoch, head })
    }

    /// The JSON array of `[event_id, run_id, at, saved, current, keys]` rows the database builds
    /// for a page of `filter` with `limit` rows at most (in no promised order), and the
    /// history's version the same statement read.
    async fn drift_page_text(
        &self,
        filter: &DriftFilter,
        limit: u32,
    ) -> Result<(String, DriftVersion), StoreError> {
        let mut binds: Vec<String> = Vec::new();
        let next = |value: &str, binds: &mut Vec<String>| {
            binds.push(value.to_owned());
            format!("${}", binds.len())
        };
        // `o` is the ordering relation: the key rows when a key drives the query.
        let (mut sql, o) = match &filter.key {
            Some(key) => {
                let p = next(key, &mut binds);
                (
                    format!(
                        "SELECT d.event_id, d.run_id, d.at, d.saved_config_digest, d.current_config_digest, d.operational_keys \
                         FROM drift_event_keys k JOIN drift_events d ON d.at = k.at AND d.event_id = k.event_id WHERE k.key = {p}"
                    ),
                    "k",
                )
            }
            None => (
                "SELECT d.event_id, d.run_id, d.at, d.saved_config_digest, d.current_config_digest, d.operational_keys \
                 FROM drift_events d WHERE 1 = 1"
                    .to_owned(),
                "d",
            ),
        };
        if let Some(run_id) = &filter.run_id {
            let p = next(run_id, &mut binds);
            sql.push_str(&format!(" AND d.run_id = {p}"));
        }
        if let Some(from) = &filter.from {
            let p = next(from, &mut binds);
            sql.push_str(&format!(" AND {o}.at >= {p}"));
        }
        if let Some(to) = &filter.to {
            let p = next(to, &mut binds);
            sql.push_str(&format!(" AND {o}.at < {p}"));
        }
        let (beyond, direction) = if filter.newest_first {
            ("<", " DESC")
        } else {
            (">", "")
        };
        if let Some(cursor) = &filter.after {
            let at = next(&cursor.at, &mut binds);
            let id = next(&cursor.id, &mut binds);
            sql.push_str(&format!(
                " AND ({o}.at, {o}.event_id) {beyond} ({at}, {id})"
            ));
        }
        sql.push_str(&format!(
            " ORDER BY {o}.at{direction}, {o}.event_id{direction} LIMIT {}",
            limit.clamp(1, MAX_ROWS)
        ));
        // The page comes back as one JSON text the database builds: fetched row by row, the
        // driver's per-row costs (a channel message, a copy of every value, a name lookup per
        // column) were most of a page's CPU (profiled: 3 in 4 samples of a 100-event page).
        let page = match self.backend {
            Backend::Sqlite => format!(
                "SELECT json_group_array(json_array(event_id, run_id, at, saved_config_digest, \
                 current_config_digest, json(operational_keys))), {DRIFT_VERSION} FROM ({sql})"
            ),
            Backend::Postgres => format!(
                "SELECT COALESCE(json_agg(json_build_array(event_id, run_id, at, saved_config_digest, \
                 current_config_digest, operational_keys::json))::text, '[]'), {DRIFT_VERSION} FROM ({sql}) AS page"
            ),
        };
        let mut query = sqlx::query_as::<_, (String, i64, String)>(&page);
        for value in &binds {
            query = query.bind(value.as_str());
        }
        let (text, head, epoch) = query.fetch_one(&self.pool).await?;
        Ok((text, DriftVersion { epoch, head }))
    }

    /// Drift events recorded after a position, in the order they were recorded (which is the
    /// order they committed: migration 0009), with the filters of [`Store::query_drift`]. The
    /// recorded order is read from its own table, so a filter is a scan from the position:
    /// meant for following the history as it is written, where the position is recent.
    pub async fn follow_drift(&self, filter: &DriftFollow) -> Result<FollowedDrift, StoreError> {
        // The position is a number this code formats, never text from a client.
        let mut conditions = vec![format!("r.seq > {}", filter.after.max(0))];
        let bind = |value: &str, binds: &mut Vec<String>| {
            binds.push(value.to_owned());
            format!("${}", binds.len())
        };
        let mut binds: Vec<String> = Vec::new();
        if let Some(run_id) = &filter.run_id {
            conditions.push(format!("d.run_id = {}", bind(run_id, &mut binds)));
        }
        if let Some(from) = &filter.from {
            conditions.push(format!("d.at >= {}", bind(from, &mut binds)));
        }
        if let Some(to) = &filter.to {
            conditions.push(format!("d.at < {}", bind(to, &mut binds)));
        }
        if let Some(key) = &filter.key {
            conditions.push(format!(
                "EXISTS (SELECT 1 FROM drift_event_keys k WHERE k.key = {} AND k.at = d.at AND k.event_id = d.event_id)",
                bind(key, &mut binds)
            ));
        }
        let inner = format!(
            "SELECT r.seq, d.event_id, d.run_id, d.at, d.saved_config_digest, d.current_config_digest, d.operational_keys \
             FROM drift_recorded r JOIN drift_events d ON d.at = r.at AND d.event_id = r.event_id \
             WHERE {} ORDER BY r.seq LIMIT {}",
            conditions.join(" AND "),
            filter.limit.clamp(1, MAX_ROWS)
        );
        // One statement, so one snapshot: the head is the last position this page could see.
        let head = "(SELECT COALESCE(MAX(seq), 0) FROM drift_recorded), \
                    (SELECT epoch FROM drift_recorded_epoch)";
        let sql = match self.backend {
            Backend::Sqlite => format!(
                "SELECT json_group_array(json_array(event_id, run_id, at, saved_config_digest, \
                 current_config_digest, json(operational_keys), seq)), {head} FROM ({inner})"
            ),
            Backend::Postgres => format!(
                "SELECT COALESCE(json_agg(json_build_array(event_id, run_id, at, saved_config_digest, \
                 current_config_digest, operational_keys::json, seq))::text, '[]'), {head} FROM ({inner}) AS page"
            ),
        };
        let mut query = sqlx::query_as::<_, (String, i64, String)>(&sql);
        for value in &binds {
            query = query.bind(value.as_str());
        }
        let (page, head, epoch) = query.fetch_one(&self.pool).await?;
        let mut rows: Vec<FollowedRow> = serde_json::from_str(&page)?;
        rows.sort_unstable_by_key(|row| row.6);
        let events = rows
            .into_iter()
            .map(
                |FollowedRow(event_id, run_id, at, saved, current, keys, seq)| {
                    let event = DriftRow(event_id, run_id, at, saved, current, keys).into_event();
                    (seq, event)
                },
            )
            .collect();
        Ok(FollowedDrift {
            events,
            head,
            epoch,
        })
    }

    /// Starts a new numbering of the recorded order for followers: every recorded-order cursor
    /// handed out before answers `cursor_expired`. For a start-up that indexed drift the
    /// database lacked: it may be a restore of an older backup, whose positions past its head
    /// were numbered again, so a cursor from before could skip events silently.
    pub async fn renumber_drift_followers(&self) -> Result<(), StoreError> {
        // Random as migration 0009 makes the first epoch.
        let sql = match self.backend {
            Backend::Sqlite => "UPDATE drift_recorded_epoch SET epoch = lower(hex(randomblob(8)))",
            Backend::Postgres => {
                "UPDATE drift_recorded_epoch SET epoch = substr(md5(random()::text || clock_timestamp()::text), 1, 16)"
            }
        };
        sqlx::query(sql).execute(&self.pool).await?;
        Ok(())
    }

    // --- approvals, attempts, re-judgments -------------------------------------------------

    pub async fn insert_approval(&self, approval: &Approval) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "INSERT INTO approvals (approval_id, run_id, at, by_actor, reason, task_index, rollout_index, attempt_index, \
             consumed_by_attempt, revoked_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT (run_id, approval_id) DO NOTHING",
        )
        .bind(&approval.approval_id)
        .bind(&approval.run_id)
        .bind(&approval.at)
        .bind(&approval.by)
        .bind(&approval.reason)
        .bind(approval.task_index)
        .bind(approval.rollout_index)
        .bind(approval.attempt_index)
        .bind(approval.consumed_by_attempt)
        .bind(&approval.revoked_at)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    pub async fn list_approvals(&self, run_id: &str) -> Result<Vec<Approval>, StoreError> {
        Ok(sqlx::query_as::<_, Approval>(
            "SELECT approval_id, run_id, at, by_actor, reason, task_index, rollout_index, attempt_index, consumed_by_attempt, \
             revoked_at FROM approvals WHERE run_id = $1 ORDER BY at, approval_id",
        )
        .bind(run_id)
        .fetch_all(&self.pool)
        .await?)
    }

    /// A run's approval recorded again as `approval` (its journal's first line of that id) says,
    /// when the record differs: one no attempt used, when revoked (the id is in the journal
    /// again) or holding other fields (the line was edited in place); one an attempt used, when
    /// the line names another attempt now (the plan honours it for that attempt, so it is that
    /// attempt's approval, unused until the run's files say otherwise: hostile review 43). A
    /// used approval whose line names the attempt it was used for stays as it was used. `false`
    /// when nothing changed.
    pub async fn restore_approval(&self, approval: &Approval) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "UPDATE approvals SET at = $1, by_actor = $2, reason = $3, task_index = $4, rollout_index = $5, \
             attempt_index = $6, revoked_at = NULL, consumed_by_attempt = NULL \
             WHERE run_id = $7 AND approval_id = $8 \
             AND ((consumed_by_attempt IS NULL AND (revoked_at IS NOT NULL OR at <> $1 OR by_actor <> $2 \
             OR reason <> $3 OR task_index <> $4 OR rollout_index <> $5 OR attempt_index <> $6)) \
             OR (consumed_by_attempt IS NOT NULL AND (task_index <> $4 OR rollout_index <> $5 \
             OR attempt_index <> $6)))",
        )
        .bind(&approval.at)
        .bind(&approval.by)
        .bind(&approval.reason)
        .bind(approval.task_index)
        .bind(approval.rollout_index)
        .bind(approval.attempt_index)
        .bind(&approval.run_id)
        .bind(&approval.approval_id)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    /// Revokes a run's approval that no attempt consumed yet; `false` when there is none such.
    pub async fn revoke_approval(
        &self,
        run_id: &str,
        approval_id: &str,
        at: &str,
    ) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "UPDATE approvals SET revoked_at = $1 WHERE run_id = $2 AND approval_id = $3 AND revoked_at IS NULL \
             AND consumed_by_attempt IS NULL",
        )
        .bind(at)
        .bind(run_id)
        .bind(approval_id)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    /// Marks a run's approval used by the attempt that reran it.
    pub async fn consume_approval(
        &self,
        run_id: &str,
        approval_id: &str,
        attempt: i64,
    ) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "UPDATE approvals SET consumed_by_attempt = $1 WHERE run_id = $2 AND approval_id = $3 \
             AND consumed_by_attempt IS NULL AND revoked_at IS NULL",
        )
        .bind(attempt)
        .bind(run_id)
        .bind(approval_id)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    pub async fn insert_extension(&self, extension: &AttemptExtension) -> Result<bool, StoreError> {
        Ok(self
            .insert_extensions(std::slice::from_ref(extension))
            .await?
            == 1)
    }

    /// Records attempt extensions, a thousand to a transaction; returns how many were new.
    pub async fn insert_extensions(
        &self,
        extensions: &[AttemptExtension],
    ) -> Result<usize, StoreError> {
        let mut inserted = 0;
        for batch in extensions.chunks(1000) {
            let mut tx = self.pool.begin().await?;
            for extension in batch {
                let result = sqlx::query(
                    "INSERT INTO attempt_extensions (event_id, run_id, at, by_actor, reason, extend_attempts) \
                     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (event_id) DO NOTHING",
                )
                .bind(&extension.event_id)
                .bind(&extension.run_id)
                .bind(&extension.at)
                .bind(&extension.by)
                .bind(&extension.reason)
                .bind(extension.extend_attempts)
                .execute(&mut *tx)
                .await?;
                inserted += result.rows_affected() as usize;
            }
            tx.commit().await?;
        }
        Ok(inserted)
    }

    pub async fn list_extensions(&self, run_id: &str) -> Result<Vec<AttemptExtension>, StoreError> {
        Ok(sqlx::query_as::<_, AttemptExtension>(
            "SELECT event_id, run_id, at, by_actor, reason, extend_attempts FROM attempt_extensions WHERE run_id = $1 ORDER BY at, event_id",
        )
        .bind(run_id)
        .fetch_all(&self.pool)
        .await?)
    }

    pub async fn insert_resubmit(&self, resubmit: &Resubmit) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "INSERT INTO resubmits (event_id, run_id, at, by_actor, line_offset) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (event_id) DO NOTHING",
        )
        .bind(&resubmit.event_id)
        .bind(&resubmit.run_id)
        .bind(&resubmit.at)
        .bind(&resubmit.by)
        .bind(resubmit.line_offset)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    pub async fn list_resubmits(&self, run_id: &str) -> Result<Vec<Resubmit>, StoreError> {
        Ok(sqlx::query_as::<_, Resubmit>("SELECT event_id, run_id, at, by_actor, line_offset FROM resubmits WHERE run_id = $1 ORDER BY at, event_id")
            .bind(run_id)
            .fetch_all(&self.pool)
            .await?)
    }

    pub async fn insert_rejudgment(&self, rejudgment: &Rejudgment) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "INSERT INTO rejudgments (operation_id, run_id, attempt_key, admitted_at, predecessor_failure_id, predecessor_sha256, \
             closed_at, outcome) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (operation_id) DO NOTHING",
        )
        .bind(&rejudgment.operation_id)
        .bind(&rejudgment.run_id)
        .bind(&rejudgment.attempt_key)
        .bind(&rejudgment.admitted_at)
        .bind(&rejudgment.predecessor_failure_id)
        .bind(&rejudgment.predecessor_sha256)
        .bind(&rejudgment.closed_at)
        .bind(&rejudgment.outcome)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    /// Closes an open re-judgment; `false` when it is unknown or already closed.
    pub async fn close_rejudgment(
        &self,
        operation_id: &str,
        at: &str,
        outcome: &str,
    ) -> Result<bool, StoreError> {
        let result = sqlx::query("UPDATE rejudgments SET closed_at = $1, outcome = $2 WHERE operation_id = $3 AND closed_at IS NULL")
            .bind(at)
            .bind(outcome)
            .bind(operation_id)
            .execute(&self.pool)
            .await?;
        Ok(result.rows_affected() == 1)
    }

    pub async fn list_rejudgments(&self, run_id: &str) -> Result<Vec<Rejudgment>, StoreError> {
        Ok(sqlx::query_as::<_, Rejudgment>(
            "SELECT operation_id, run_id, attempt_key, admitted_at, predecessor_failure_id, predecessor_sha256, closed_at, outcome \
             FROM rejudgments WHERE run_id = $1 ORDER BY admitted_at, operation_id",
        )
        .bind(run_id)
        .fetch_all(&self.pool)
        .await?)
    }

    // --- leases ----------------------------------------------------------------------------

    /// Takes the run's lease when none is live (none recorded, or expired at `now`); returns the
    /// lease that holds afterwards, which is `lease` only when it was granted.
    pub async fn try_acquire_lease(&self, lease: &Lease, now: &str) -> Result<Lease, StoreError> {
        let result = self.try_acquire_lease_uncached(lease, now).await;
        self.owner.leases.forget(&lease.run_id);
        result
    }

    async fn try_acquire_lease_uncached(
        &self,
        lease: &Lease,
        now: &str,
    ) -> Result<Lease, StoreError> {
        // Insert (or take over an expired lease) in one statement; when a live lease keeps the
        // run, answer it. A lease released between the two is retried, never an error.
        for _ in 0..8 {
            let granted: Option<String> = sqlx::query_scalar(
                "INSERT INTO leases (run_id, lease_id, holder, host, pid, acquired_at, renewed_at, expires_at, replica) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (run_id) DO UPDATE SET lease_id = excluded.lease_id, \
                 holder = excluded.holder, host = excluded.host, pid = excluded.pid, acquired_at = excluded.acquired_at, \
                 renewed_at = excluded.renewed_at, expires_at = excluded.expires_at, replica = excluded.replica \
                 WHERE leases.expires_at <= $10 RETURNING lease_id",
            )
            .bind(&lease.run_id)
            .bind(&lease.lease_id)
            .bind(&lease.holder)
            .bind(&lease.host)
            .bind(lease.pid)
            .bind(&lease.acquired_at)
            .bind(&lease.renewed_at)
            .bind(&lease.expires_at)
            .bind(&lease.replica)
            .bind(now)
            .fetch_optional(&self.pool)
            .await?;
            self.owner.leases.forget(&lease.run_id);
            if granted.as_deref() == Some(lease.lease_id.as_str()) {
                return Ok(lease.clone());
            }
            if let Some(holder) = self.get_lease(&lease.run_id).await? {
                return Ok(holder);
            }
        }
        Err(StoreError::Database(sqlx::Error::RowNotFound))
    }

    pub async fn get_lease(&self, run_id: &str) -> Result<Option<Lease>, StoreError> {
        let since = match self.owner.leases.get(run_id) {
            Ok(cached) => return Ok(cached),
            Err(since) => since,
        };
        let sql = format!(
            "SELECT {} FROM leases WHERE run_id = $1",
            Self::LEASE_COLUMNS
        );
        let row = sqlx::query(&sql)
            .bind(run_id)
            .fetch_optional(&self.pool)
            .await?;
        let lease = row.as_ref().map(Self::lease_from_row).transpose()?;
        self.owner.leases.fill(run_id, lease.clone(), since);
        Ok(lease)
    }

    fn lease_from_row(row: &AnyRow) -> Result<Lease, StoreError> {
        Ok(<Lease as sqlx::FromRow<AnyRow>>::from_row(row)?)
    }

    /// Extends a live lease held under `lease_id`; `false` when it is not (expired or taken over).
    pub async fn renew_lease(
        &self,
        run_id: &str,
        lease_id: &str,
        now: &str,
        expires_at: &str,
    ) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "UPDATE leases SET renewed_at = $1, expires_at = $2 WHERE run_id = $3 AND lease_id = $4 AND expires_at > $1",
        )
        .bind(now)
        .bind(expires_at)
        .bind(run_id)
        .bind(lease_id)
        .execute(&self.pool)
        .await;
        self.owner.leases.forget(run_id);
        Ok(result?.rows_affected() == 1)
    }

    /// Ends a lease held under `lease_id`; `false` when it was not held.
    pub async fn release_lease(&self, run_id: &str, lease_id: &str) -> Result<bool, StoreError> {
        Ok(self.end_lease(run_id, lease_id).await?.is_some())
    }

    /// [`Self::release_lease`] answering the lease it ended.
    pub async fn end_lease(
        &self,
        run_id: &str,
        lease_id: &str,
    ) -> Result<Option<Lease>, StoreError> {
        let result = self.end_lease_uncached(run_id, lease_id).await;
        self.owner.leases.forget(run_id);
        result
    }

    /// Deletes the lease and the record of its lock files, in one transaction.
    async fn end_lease_uncached(
        &self,
        run_id: &str,
        lease_id: &str,
    ) -> Result<Option<Lease>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let sql = format!(
            "DELETE FROM leases WHERE run_id = $1 AND lease_id = $2 RETURNING {}",
            Self::LEASE_COLUMNS
        );
        let ended = sqlx::query(&sql)
            .bind(run_id)
            .bind(lease_id)
            .fetch_optional(&mut *tx)
            .await?;
        let ended = ended.as_ref().map(Self::lease_from_row).transpose()?;
        sqlx::query("DELETE FROM lease_locks WHERE run_id = $1 AND lease_id = $2")
            .bind(run_id)
            .bind(lease_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(ended)
    }

    /// Replaces whatever lease a run has (an operator's takeover); returns the one it ended.
    pub async fn replace_lease(&self, lease: &Lease) -> Result<Option<Lease>, StoreError> {
        let result = self.replace_lease_uncached(lease).await;
        self.owner.leases.forget(&lease.run_id);
        result
    }

    async fn replace_lease_uncached(&self, lease: &Lease) -> Result<Option<Lease>, StoreError> {
        // Write first (see `upsert_run`): the delete returns the lease it ended.
        let mut tx = self.pool.begin().await?;
        let sql = format!(
            "DELETE FROM leases WHERE run_id = $1 RETURNING {}",
            Self::LEASE_COLUMNS
        );
        let previous = sqlx::query(&sql)
            .bind(&lease.run_id)
            .fetch_optional(&mut *tx)
            .await?;
        let previous = previous.as_ref().map(Self::lease_from_row).transpose()?;
        sqlx::query(
            "INSERT INTO leases (run_id, lease_id, holder, host, pid, acquired_at, renewed_at, expires_at, replica) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&lease.run_id)
        .bind(&lease.lease_id)
        .bind(&lease.holder)
        .bind(&lease.host)
        .bind(lease.pid)
        .bind(&lease.acquired_at)
        .bind(&lease.renewed_at)
        .bind(&lease.expires_at)
        .bind(&lease.replica)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(previous)
    }

    /// Records the lock files a lease holds (see [`Self::lease_locks`]), forgetting those of
    /// any earlier lease of the run (a run has one lease: a takeover's predecessor held them).
    pub async fn record_lease_locks(
        &self,
        run_id: &str,
        lease_id: &str,
        lock_paths: &[String],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM lease_locks WHERE run_id = $1 AND lease_id <> $2")
            .bind(run_id)
            .bind(lease_id)
            .execute(&mut *tx)
            .await?;
        for path in lock_paths {
            sqlx::query(
                "INSERT INTO lease_locks (run_id, lease_id, lock_path) VALUES ($1, $2, $3) \
                 ON CONFLICT (run_id, lease_id, lock_path) DO NOTHING",
            )
            .bind(run_id)
            .bind(lease_id)
            .bind(path)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The lock files a lease holds, by path.
    pub async fn lease_locks(
        &self,
        run_id: &str,
        lease_id: &str,
    ) -> Result<Vec<String>, StoreError> {
        let rows = sqlx::query(
            "SELECT lock_path FROM lease_locks WHERE run_id = $1 AND lease_id = $2 ORDER BY lock_path",
        )
        .bind(run_id)
        .bind(lease_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| Ok(row.try_get::<String, _>("lock_path")?))
            .collect()
    }

    /// Every lease live at `now`, whichever replica granted it; lock records of leases that
    /// ended are forgotten on the way.
    pub async fn live_leases(&self, now: &str) -> Result<Vec<Lease>, StoreError> {
        sqlx::query(
            "DELETE FROM lease_locks WHERE NOT EXISTS (SELECT 1 FROM leases l \
             WHERE l.run_id = lease_locks.run_id AND l.lease_id = lease_locks.lease_id)",
        )
        .execute(&self.pool)
        .await?;
        let sql = format!(
            "SELECT {} FROM leases WHERE expires_at > $1",
            Self::LEASE_COLUMNS
        );
        let rows = sqlx::query(&sql).bind(now).fetch_all(&self.pool).await?;
        rows.iter().map(Self::lease_from_row).collect()
    }

    /// Makes `replica` the holder of a live lease's locks (it took them again after the
    /// replica that held them stopped); `false` when the lease ended meanwhile.
    pub async fn adopt_lease(
        &self,
        run_id: &str,
        lease_id: &str,
        replica: &str,
        now: &str,
    ) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "UPDATE leases SET replica = $1 WHERE run_id = $2 AND lease_id = $3 AND expires_at > $4",
        )
        .bind(replica)
        .bind(run_id)
        .bind(lease_id)
        .bind(now)
        .execute(&self.pool)
        .await;
        self.owner.leases.forget(run_id);
        Ok(result?.rows_affected() == 1)
    }

    /// Leases past their expiry at `now`: one replica's (the sweeper releases their locks), or
    /// every replica's (`None`: those no sweep ended, their service down when they expired).
    pub async fn expired_leases(
        &self,
        replica: Option<&str>,
        now: &str,
    ) -> Result<Vec<Lease>, StoreError> {
        let sql = format!(
            "SELECT {} FROM leases WHERE expires_at <= $1 AND ($2 IS NULL OR replica = $2)",
            Self::LEASE_COLUMNS
        );
        let rows = sqlx::query(&sql)
            .bind(now)
            .bind(replica)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(Self::lease_from_row).collect()
    }

    // --- console sessions --------------------------------------------------------------------

    /// Records a console session under the hash of its id (the id itself is never stored).
    pub async fn insert_session(&self, session: &ConsoleSession) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO console_sessions (session_hash, name, role, created_at, expires_at, token_fingerprint) VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(&session.session_hash)
            .bind(&session.name)
            .bind(&session.role)
            .bind(&session.created_at)
            .bind(&session.expires_at)
            .bind(&session.token_fingerprint)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The live session with this hash (expired ones are not answered).
    pub async fn live_session(
        &self,
        session_hash: &str,
        now: &str,
    ) -> Result<Option<ConsoleSession>, StoreError> {
        let row = sqlx::query("SELECT session_hash, name, role, created_at, expires_at, token_fingerprint FROM console_sessions WHERE session_hash = $1 AND expires_at > $2")
            .bind(session_hash)
            .bind(now)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref()
            .map(|row| Ok(<ConsoleSession as sqlx::FromRow<AnyRow>>::from_row(row)?))
            .transpose()
    }

    /// Ends a session, and every session past its expiry.
    pub async fn end_session(&self, session_hash: &str, now: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM console_sessions WHERE session_hash = $1 OR expires_at <= $2")
            .bind(session_hash)
            .bind(now)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    // --- audit -----------------------------------------------------------------------------

    pub async fn insert_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        debug_assert!(
            AUDIT_ACTIONS.contains(&entry.action.as_str()),
            "audit action {:?} is not in AUDIT_ACTIONS",
            entry.action
        );
        sqlx::query("INSERT INTO audit_log (audit_id, at, actor, action, run_id, details) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (audit_id) DO NOTHING")
            .bind(&entry.audit_id)
            .bind(&entry.at)
            .bind(&entry.actor)
            .bind(&entry.action)
            .bind(&entry.run_id)
            .bind(entry.details.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn list_audit(
        &self,
        run_id: Option<&str>,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        self.query_audit(&AuditFilter {
            run_id: run_id.map(str::to_owned),
            limit,
            ..AuditFilter::default()
        })
        .await
    }

    /// Audit entries, newest first, filtered by run, actor and action (each exact when given),
    /// from before a cursor.
    pub async fn query_audit(&self, filter: &AuditFilter) -> Result<Vec<AuditEntry>, StoreError> {
        let mut sql =
            String::from("SELECT audit_id, at, actor, action, run_id, details FROM audit_log");
        let mut conditions = Vec::new();
        let mut binds = Vec::new();
        for (column, value) in [
            ("run_id", &filter.run_id),
            ("actor", &filter.actor),
            ("action", &filter.action),
        ] {
            if let Some(value) = value {
                binds.push(value.clone());
                conditions.push(format!("{column} = ${}", binds.len()));
            }
        }
        if let Some(cursor) = &filter.before {
            binds.push(cursor.at.clone());
            binds.push(cursor.id.clone());
            conditions.push(format!(
                "(at, audit_id) < (${}, ${})",
                binds.len() - 1,
                binds.len()
            ));
        }
        if !conditions.is_empty() {
            sql.push_str(" WHERE ");
            sql.push_str(&conditions.join(" AND "));
        }
        sql.push_str(&format!(
            " ORDER BY at DESC, audit_id DESC LIMIT {}",
            filter.limit.clamp(1, MAX_ROWS)
        ));
        let mut query = sqlx::query(&sql);
        for value in &binds {
            query = query.bind(value);
        }
        query
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|row| {
                Ok(AuditEntry {
                    audit_id: row.try_get("audit_id")?,
                    at: row.try_get("at")?,
                    actor: row.try_get("actor")?,
                    action: row.try_get("action")?,
                    run_id: row.try_get("run_id")?,
                    details: serde_json::from_str(&row.try_get::<String, _>("details")?)?,
                })
            })
            .collect()
    }

    /// Row counts per table (diagnostics and reindex checks).
    pub async fn counts(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let mut counts = Vec::new();
        for table in [
            "runs",
            "resume_events",
            "drift_events",
            "drift_event_keys",
            "approvals",
            "attempt_extensions",
            "resubmits",
            "rejudgments",
            "leases",
            "audit_log",
        ] {
            let row = sqlx::query(&format!("SELECT COUNT(*) AS n FROM {table}"))
                .fetch_one(&self.pool)
                .await?;
            counts.push((table.to_owned(), row.try_get::<i64, _>("n")?));
        }
        Ok(counts)
    }
}
