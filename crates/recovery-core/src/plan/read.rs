//! Reading a run's inventory and outcome files into a [`RunIndex`]: lines parsed into the facts
//! the plan reads on several threads (fields nobody reads are skipped, never built), indexed in
//! file order on one.
//!
//! Invariants: the JSONL rules of [`crate::rows`] (only `\n` ends a line, ASCII-blank lines are
//! skipped, a torn final line is not a record, a malformed terminated line or a non-object is an
//! error naming the file and line); an outcome file is read from a [`JsonlMark`] so an
//! append-only file is read once, and the mark never passes an unterminated final line (it is
//! read again, and recognised as the same outcome, once its writer ends it).

use super::index::{LineAt, LineSource, OutcomeRow, Reservations, RunIndex};
use super::{Artifact, PlanError};
use crate::facts::IdentityFacts;
use crate::pipeline::{LineEnds, PipelineError, process_ordered};
use crate::rows::JsonlError;
use std::io::Read;

/// How far an append-only JSONL file has been read: the next line starts at byte `offset` and is
/// line `lines + 1`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JsonlMark {
    pub offset: u64,
    pub lines: u64,
}

enum Problem {
    Malformed(String),
    NotAnObject,
}

/// One chunk's parsed lines: (line within the chunk, offset within the chunk, length, facts).
struct Parsed<T> {
    records: Vec<(u64, u64, u64, T)>,
    /// Terminated lines (blank ones included).
    terminated_lines: u64,
    /// Bytes of terminated lines.
    terminated_bytes: u64,
    bytes: u64,
    problem: Option<(u64, Problem)>,
}

fn parse_chunk<T>(chunk: &[u8], parse: impl Fn(&[u8]) -> Result<Option<T>, String>) -> Parsed<T> {
    let mut parsed = Parsed {
        // One slot per line: the records vector never grows while it is filled.
        records: Vec::with_capacity(memchr::memchr_iter(b'\n', chunk).count() + 1),
        terminated_lines: 0,
        terminated_bytes: 0,
        bytes: chunk.len() as u64,
        problem: None,
    };
    let mut offset = 0u64;
    for (i, raw) in crate::rows::lines_with_ends(chunk).enumerate() {
        let line = i as u64 + 1;
        let terminated = raw.last() == Some(&b'\n');
        let at = offset;
        offset += raw.len() as u64;
        if terminated {
            parsed.terminated_lines = line;
            parsed.terminated_bytes = offset;
        }
        if crate::rows::is_blank(raw) {
            continue;
        }
        match parse(raw) {
            Ok(Some(facts)) => parsed.records.push((line, at, raw.len() as u64, facts)),
            Ok(None) => {
                parsed.problem = Some((line, Problem::NotAnObject));
                return parsed;
            }
            // An unterminated final line that does not parse is an interrupted write.
            Err(_) if !terminated => return parsed,
            Err(message) => {
                parsed.problem = Some((line, Problem::Malformed(message)));
                return parsed;
            }
        }
    }
    parsed
}

fn problem_error(path: &str, line: u64, problem: Problem) -> JsonlError {
    let path = path.to_owned();
    match problem {
        Problem::Malformed(message) => JsonlError::Malformed {
            path,
            line,
            message,
        },
        Problem::NotAnObject => JsonlError::NotAnObject { path, line },
    }
}

fn io_error<E: std::error::Error>(path: &str, e: PipelineError<E>) -> Result<JsonlError, E> {
    match e {
        PipelineError::Io(source) => Ok(JsonlError::Io {
            path: path.to_owned(),
            source,
        }),
        PipelineError::Consumer(e) => Err(e),
    }
}

/// One chunk of a materialized-inputs file: its rows' identities, its line count, and the first
/// bad line.
struct Inventory {
    rows: Vec<IdentityFacts>,
    lines: u64,
    problem: Option<(u64, Problem)>,
}

/// A chunk read as the collector reads its rows (and as their digest is taken): Python's text
/// mode lines, Python-blank lines skipped, every other line a JSON object.
fn parse_inventory_chunk(chunk: &[u8]) -> Inventory {
    let mut parsed = Inventory {
        rows: Vec::new(),
        lines: 0,
        problem: None,
    };
    for line in crate::materialized::universal_lines(chunk) {
        parsed.lines += 1;
        if crate::materialized::is_blank_line(line) {
            continue;
        }
        match IdentityFacts::from_line(line) {
            Ok(Some(facts)) => parsed.rows.push(facts),
            Ok(None) => {
                parsed.problem = Some((parsed.lines, Problem::NotAnObject));
                return parsed;
            }
            Err(message) => {
                parsed.problem = Some((parsed.lines, Problem::Malformed(message)));
                return parsed;
            }
        }
    }
    parsed
}

/// The identity fields of every row of a materialized-inputs file, in file order.
pub fn read_inventory(
    reader: impl Read + Send,
    path: &str,
    threads: usize,
) -> Result<Vec<IdentityFacts>, JsonlError> {
    let mut rows = Vec::new();
    let mut lines = 0u64;
    let result = process_ordered(
        reader,
        threads,
        LineEnds::Universal,
        || (),
        |(), chunk| parse_inventory_chunk(chunk),
        |parsed: Inventory| {
            if let Some((line, problem)) = parsed.problem {
                return Err(problem_error(path, lines + line, problem));
            }
            rows.extend(parsed.rows);
            lines += parsed.lines;
            Ok(())
        },
    );
    match result {
        Ok(_) => Ok(rows),
        Err(e) => Err(io_error(path, e).unwrap_or_else(|e| e)),
    }
}

/// Why outcomes could not be indexed.
#[derive(Debug, thiserror::Error)]
pub enum OutcomesError {
    #[error(transparent)]
    Jsonl(#[from] JsonlError),
    /// A record the index refused, named with its file.
    #[error("{path}: {error}")]
    Plan { path: String, error: PlanError },
}

/// Indexes the outcomes of `artifact` read from `reader`, which is positioned at `from` (the
/// start of the file, or where the previous read ended); returns where this read ended.
#[allow(clippy::too_many_arguments)]
pub fn index_outcomes(
    index: &mut RunIndex,
    reservations: &Reservations,
    artifact: Artifact,
    reader: impl Read + Send,
    from: JsonlMark,
    path: &str,
    threads: usize,
    source: &mut (dyn LineSource + Send),
) -> Result<JsonlMark, OutcomesError> {
    let mut mark = from;
    let mut chunk_start = from.offset;
    let (policy, timeouts) = (index.policy().clone(), index.retry_terminal_timeouts());
    let result = process_ordered(
        reader,
        threads,
        LineEnds::Newline,
        || (),
        |(), chunk| parse_chunk(chunk, |line| OutcomeRow::parse(line, &policy, timeouts)),
        |parsed: Parsed<OutcomeRow>| {
            let base_line = mark.lines;
            if let Some((line, problem)) = parsed.problem {
                return Err(OutcomesError::Jsonl(problem_error(
                    path,
                    base_line + line,
                    problem,
                )));
            }
            for (line, offset, length, row) in parsed.records {
                let at = LineAt {
                    line: base_line + line,
                    offset: chunk_start + offset,
                    length,
                };
                index
                    .add(reservations, artifact, at, row, source)
                    .map_err(|error| OutcomesError::Plan {
                        path: path.to_owned(),
                        error,
                    })?;
            }
            mark = JsonlMark {
                offset: chunk_start + parsed.terminated_bytes,
                lines: base_line + parsed.terminated_lines,
            };
            chunk_start += parsed.bytes;
            Ok(())
        },
    );
    match result {
        Ok(_) => Ok(mark),
        Err(e) => Err(io_error(path, e).map_or_else(|e| e, OutcomesError::Jsonl)),
    }
}
