//! Streaming classification of a results or failures file: every row's [`RowDecision`] on N
//! threads, delivered in file order, with counts by verdict, responsibility and kind.
//!
//! Invariants: the JSONL rules of [`crate::rows`] apply (only `\n` ends a line, blank lines are
//! skipped, a torn final line is reported and not classified, a malformed terminated line or a
//! non-object is an error naming the file and line); memory stays bounded by the chunks in flight.

use crate::facts::RowFacts;
use crate::failure::{ClassificationPolicy, FailureClass};
use crate::pipeline::{LineEnds, PipelineError, process_ordered};
use crate::plan::{RowDecision, RowVerdict, classify_facts};
use crate::rows::JsonlError;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Read;

/// Counts of a classified file.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClassifySummary {
    pub rows: u64,
    pub lines: u64,
    pub bytes: u64,
    /// Line of an interrupted final write that was not classified.
    pub torn_tail_line: Option<u64>,
    pub by_verdict: BTreeMap<RowVerdict, u64>,
    pub by_responsibility: BTreeMap<FailureClass, u64>,
    /// Failure rows by selected kind (`none` when a row names none).
    pub by_kind: BTreeMap<String, u64>,
}

enum LineProblem {
    Malformed(String),
    NotAnObject,
}

struct ChunkResult {
    decisions: Vec<(u64, RowDecision)>,
    lines: u64,
    torn_line: Option<u64>,
    problem: Option<(u64, LineProblem)>,
}

/// Classifies every row of a JSONL file, calling `each(line, decision)` in file order.
pub fn classify_jsonl(
    reader: impl Read + Send,
    path: &str,
    threads: usize,
    policy: &ClassificationPolicy,
    retry_terminal_timeouts: bool,
    mut each: impl FnMut(u64, &RowDecision) + Send,
) -> Result<ClassifySummary, JsonlError> {
    let mut summary = ClassifySummary::default();
    let result = process_ordered(
        reader,
        threads,
        LineEnds::Newline,
        || (),
        |(), chunk| classify_chunk(chunk, policy, retry_terminal_timeouts),
        |chunk: ChunkResult| {
            let base = summary.lines;
            if let Some((line, problem)) = chunk.problem {
                let path = path.to_owned();
                let line = base + line;
                return Err(match problem {
                    LineProblem::Malformed(message) => JsonlError::Malformed {
                        path,
                        line,
                        message,
                    },
                    LineProblem::NotAnObject => JsonlError::NotAnObject { path, line },
                });
            }
            for (line, decision) in &chunk.decisions {
                each(base + line, decision);
                summary.rows += 1;
                *summary.by_verdict.entry(decision.verdict).or_default() += 1;
                if decision.is_failure_row || decision.masked_infrastructure_kind.is_some() {
                    *summary
                        .by_responsibility
                        .entry(decision.responsibility)
                        .or_default() += 1;
                    let kind = decision
                        .failure_kind
                        .clone()
                        .unwrap_or_else(|| "none".into());
                    *summary.by_kind.entry(kind).or_default() += 1;
                }
            }
            summary.torn_tail_line = chunk.torn_line.map(|l| base + l);
            summary.lines += chunk.lines;
            Ok(())
        },
    );
    match result {
        Ok(bytes) => {
            summary.bytes = bytes;
            Ok(summary)
        }
        Err(PipelineError::Io(source)) => Err(JsonlError::Io {
            path: path.to_owned(),
            source,
        }),
        Err(PipelineError::Consumer(e)) => Err(e),
    }
}

fn classify_chunk(
    chunk: &[u8],
    policy: &ClassificationPolicy,
    retry_terminal_timeouts: bool,
) -> ChunkResult {
    let mut result = ChunkResult {
        decisions: Vec::new(),
        lines: 0,
        torn_line: None,
        problem: None,
    };
    for raw in crate::rows::lines_with_ends(chunk) {
        result.lines += 1;
        if crate::rows::is_blank(raw) {
            continue;
        }
        match RowFacts::from_line(raw) {
            Ok(Some(row)) => {
                result.decisions.push((
                    result.lines,
                    classify_facts(&row, policy, retry_terminal_timeouts),
                ));
            }
            Ok(None) => {
                result.problem = Some((result.lines, LineProblem::NotAnObject));
                return result;
            }
            // Only the final chunk can end without a newline: an interrupted write.
            Err(_) if raw.last() != Some(&b'\n') => result.torn_line = Some(result.lines),
            Err(message) => {
                result.problem = Some((result.lines, LineProblem::Malformed(message)));
                return result;
            }
        }
    }
    result
}
