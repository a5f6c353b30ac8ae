//! The canonical files beside each output (decisions §6, facts §2, §9, §10), which file-based tools
//! (NeMo Gym's own collector, shell scripts, `jq`) keep reading.
//!
//! - [`paths`]: every companion's exact name, and confinement of output paths under roots.
//! - [`atomic`]: atomic replace exactly as `atomic_output_file` (readers see old or new, never part).
//! - [`journal`]: append-only JSONL journals with fsync and torn-tail repair.
//! - [`lock`]: run and checkpoint locks (`flock`, exclusive, non-blocking, never unlinked).

pub mod atomic;
pub mod files;
pub mod journal;
pub mod lock;
pub mod paths;

pub use atomic::{atomic_write, atomic_write_json, temporary_target};
pub use files::{open_regular, open_regular_following, read_regular};
pub use journal::{
    NotARegularFile, TailRepair, append_line, append_line_at, append_lines_at,
    is_not_a_regular_file, prepare_append, read_lines, read_lines_at, read_lines_batch,
    read_lines_from, unterminated_tail,
};
pub use lock::{LockError, RunLock, flock_held_elsewhere};
pub use paths::{Confinement, PathError, SidecarPaths};

/// Now as RFC 3339 UTC with microseconds (fixed width, so text order is time order).
pub fn now_rfc3339() -> String {
    format_rfc3339(time::OffsetDateTime::now_utc())
}

/// A time as fixed-width RFC 3339 UTC with microseconds (`2026-11-29T09:01:50.123456Z`).
pub fn format_rfc3339(at: time::OffsetDateTime) -> String {
    let at = at.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.microsecond()
    )
}

/// Why a text is no time of the stored form.
#[derive(Debug, thiserror::Error)]
pub enum TimeError {
    #[error(transparent)]
    NotRfc3339(#[from] time::error::Parse),
    /// RFC 3339 allows offsets that carry an instant past the stored form's four-digit years.
    #[error("it is outside the years 0000 to 9999 in UTC")]
    OutOfRange,
}

/// An RFC 3339 time in the fixed-width UTC form of [`format_rfc3339`] (`+00:00`, other offsets
/// and other precisions as Python's `isoformat()` writes them become the same instant in that
/// form, truncated to the microsecond), so times compare and sort as text.
pub fn normalize_rfc3339(text: &str) -> Result<String, TimeError> {
    utc(text).map(format_rfc3339)
}

/// The earliest stored time (fixed-width, microseconds: [`format_rfc3339`]) that is not before
/// the instant `text` names: a bound finer than a microsecond rounds up, so `at >= bound` and
/// `at < bound` over stored times say what they would over the instants themselves (truncating
/// took in an event from before a `from` such as `...00.0000005Z`).
pub fn stored_time_bound(text: &str) -> Result<String, TimeError> {
    let at = utc(text)?;
    let at = match at.nanosecond() % 1_000 {
        0 => Some(at),
        below_a_microsecond => at.checked_add(time::Duration::nanoseconds(i64::from(
            1_000 - below_a_microsecond,
        ))),
    };
    at.filter(|at| at.year() <= 9999)
        .map(format_rfc3339)
        .ok_or(TimeError::OutOfRange)
}

/// The instant `text` names, in UTC and within the stored form's years.
fn utc(text: &str) -> Result<time::OffsetDateTime, TimeError> {
    time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)?
        // An offset can carry the instant out of the years the type holds: no panic on input.
        .checked_to_offset(time::UtcOffset::UTC)
        .filter(|at| (0..=9999).contains(&at.year()))
        .ok_or(TimeError::OutOfRange)
}

/// A fresh identifier (`uuid4().hex`: 32 lowercase hex digits), as run ids and event ids are.
pub fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}
