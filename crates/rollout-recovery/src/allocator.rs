//! The process's allocator, memory given back once a load ends, and SQLite's memory set-up
//! (statistics off, wider lookaside).
//!
//! mimalloc, chosen on measurement: under the load benchmark glibc's malloc took about a
//! quarter of the service's CPU (configuration identities are many small JSON trees) and kept
//! hundreds of MB after the load ended. mimalloc returns a thread's freed pages to the system
//! only while that thread goes on allocating, so the blocking threads that parse large bodies
//! kept their peak until they ended, and even then left it to their abandoned heaps: each
//! runtime thread gives everything it holds unused back as it ends (measured, validate with
//! 1,000 rows: RSS 5 s after the load 104 MB without, 62-65 MB with).

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Gives back everything this thread holds unused (called when a runtime thread ends).
#[allow(unsafe_code)]
pub fn give_back_all() {
    // SAFETY: mi_collect has no preconditions; it frees only pages of the calling thread's heap
    // (and, forced, of abandoned heaps) that hold no live allocation.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// Gives back what this thread holds unused at most once a second, as it parks (a runtime
/// worker, which never ends: after a load it parks, and its heap kept the load's pages).
/// Measured, validate with 1,000 rows: VmRSS 5 s after the load 67 MB without, 43 MB with
/// (RssAnon 52 to 28 MB), throughput unchanged within the runs' spread.
pub fn give_back_when_idle() {
    use std::cell::Cell;
    use std::time::{Duration, Instant};
    thread_local! {
        static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
    }
    let now = Instant::now();
    let due = LAST
        .get()
        .is_none_or(|last| now.duration_since(last) >= Duration::from_secs(1));
    if due {
        LAST.set(Some(now));
        give_back_all();
    }
}

/// Turns off SQLite's memory statistics. Call before anything opens a database: SQLite takes
/// its configuration only before its first use.
///
/// Why (profiles of the release service): with statistics on, every allocation SQLite makes
/// (pages, statements, bound values, the JSON text of a drift page, grown row by row) takes
/// one process-wide mutex to count bytes that nothing here reads, contended by every database
/// connection's thread. Measured with the load bench, old/new alternating: a 1,000-event drift
/// page 1,669 to 1,359 µs of CPU (means of three), a reindex of 1M journal lines 109k to 121k
/// lines/s. (Routing SQLite's allocations to mimalloc as well gained ~8% more on pages but
/// kept ~5-15 MB more after loads, on threads that never give it back; not done.)
///
/// Returns SQLite's result code when it refused (it was already in use): harmless, it then
/// keeps counting.
#[allow(unsafe_code)]
pub fn quiet_sqlite_statistics() -> Result<(), i32> {
    use libsqlite3_sys as sqlite;
    // SAFETY: SQLite's documented start-up configuration, made before any connection exists
    // (main calls this first); the one argument is an `int`.
    match unsafe {
        sqlite::sqlite3_config(sqlite::SQLITE_CONFIG_MEMSTATUS, 0 as std::os::raw::c_int)
    } {
        sqlite::SQLITE_OK => Ok(()),
        code => Err(code),
    }
}

/// Gives every SQLite connection 4,096 lookaside slots of 128 bytes (512 KiB; SQLite's default
/// is about 48 KiB). Call before anything opens a database, as [`quiet_sqlite_statistics`].
///
/// Why (perf of a 1M-line reindex): SQLite copies every value bound to a statement into memory
/// of its own. Beyond the default's few slots each copy went to glibc's malloc and back: about
/// a fifth of the database threads' samples. A lookaside slot is taken from and returned to a
/// free list of the connection. The values of the drift tables (times, ids, digests, key
/// lists) fit in 128 bytes, and a drift insert's statement binds at most 3,000 of them
/// (recovery-store's `EVENTS_PER_STATEMENT`), so all of them fit; larger values still use
/// malloc. Measured, 300k-line reindexes alternating without/with: eight pairs with 8,192
/// slots and 6,000 values per statement, CPU of the database threads 214 to 193 ticks, wall
/// 2.91 to 2.64 s (means); then five pairs of that against this setting, equal within noise.
/// The cost: SQLite lays its free list through every slot when a connection opens, so the
/// whole buffer is resident from then on, for each of the pool's connections and the
/// checkpointer's (8,192 slots added 5-6 MB to the service's idle RSS; this setting half).
///
/// Returns SQLite's result code when it refused (it was already in use): harmless, connections
/// then have the default lookaside.
#[allow(unsafe_code)]
pub fn widen_sqlite_lookaside() -> Result<(), i32> {
    use libsqlite3_sys as sqlite;
    use std::os::raw::c_int;
    const SLOT_BYTES: c_int = 128;
    const SLOTS: c_int = 4096;
    // SAFETY: SQLite's documented start-up configuration, made before any connection exists
    // (main calls this first); the two arguments are `int`s.
    match unsafe { sqlite::sqlite3_config(sqlite::SQLITE_CONFIG_LOOKASIDE, SLOT_BYTES, SLOTS) } {
        sqlite::SQLITE_OK => Ok(()),
        code => Err(code),
    }
}
