//! Saved rows: logical rollout ids (facts §1), streaming JSONL reading of results and failures
//! files (facts §11.1) and the canonical failure record's shape (facts §14.3).
//!
//! Invariants: a torn final line (no newline, not parseable) is an interrupted write: reported,
//! never a record; an unparseable line that ends in a newline is an error naming the file and
//! line; a non-object line is an error; blank lines (ASCII whitespace, like `bytes.strip()`) are
//! skipped; only `\n` ends a line (binary reading).

use regex::Regex;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::sync::LazyLock;

/// Whether Python's `bytes.strip()` leaves nothing of `line`: every byte is ASCII whitespace as
/// Python counts it (space, `\t`, `\n`, `\r`, `\x0b`, `\x0c`). Rust's `u8::is_ascii_whitespace`
/// leaves out `\x0b` (hostile review 45: a line of one vertical tab stopped the plan, where the
/// module skips it). The rule of every binary JSONL reader here: outcome files, journals,
/// classify batches.
pub fn is_blank(line: &[u8]) -> bool {
    line.iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0b' | b'\x0c'))
}

/// The lines of `chunk`, each with its `\n` (the last one without, if unterminated): what
/// `split_inclusive(|&b| b == b'\n')` gives, found with `memchr` (the byte-at-a-time split
/// was 6% of a cold plan's CPU).
pub fn lines_with_ends(chunk: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = chunk;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = memchr::memchr(b'\n', rest).map_or(rest.len(), |at| at + 1);
        let (line, tail) = rest.split_at(end);
        rest = tail;
        Some(line)
    })
}

pub const TASK_INDEX_KEY: &str = "_ng_task_index";
pub const ROLLOUT_INDEX_KEY: &str = "_ng_rollout_index";
pub const ATTEMPT_INDEX_KEY: &str = "_ng_attempt_index";
pub const ROLLOUT_ID_KEY: &str = "_ng_rollout_id";
pub const RUN_ID_KEY: &str = "_ng_run_id";

static EXPLICIT_ID: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\A[A-Za-z0-9][A-Za-z0-9._-]*\z").expect("static regex"));
static ATTEMPT_SUFFIX: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"-a[1-9][0-9]*\z").expect("static regex"));

/// Why a row has no usable identity or shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowError {
    #[error("Invalid rollout identity: {0}")]
    InvalidIdentity(String),
    #[error("Recovery requires a rollout id or materialized task/rollout indices.")]
    NoIdentity,
}

/// The logical rollout id of a row (its capture key without attempt): an explicit
/// `_ng_rollout_id`, else `"{task index}-{rollout index}"`.
pub fn logical_rollout_id(row: &Value) -> Result<String, RowError> {
    let Some(map) = row.as_object() else {
        return Err(RowError::NoIdentity);
    };
    match map.get(ROLLOUT_ID_KEY) {
        None | Some(Value::Null) => {}
        Some(Value::String(id)) => {
            check_explicit_id(id)?;
            return Ok(id.clone());
        }
        Some(other) => {
            return Err(RowError::InvalidIdentity(format!(
                "{other} is not a string"
            )));
        }
    }
    match (
        index(map.get(TASK_INDEX_KEY)),
        index(map.get(ROLLOUT_INDEX_KEY)),
    ) {
        (Some(task), Some(rollout)) => Ok(format!("{task}-{rollout}")),
        _ => Err(RowError::NoIdentity),
    }
}

/// Refuses an explicit `_ng_rollout_id` that breaks the id grammar or ends with the reserved
/// attempt suffix.
pub fn check_explicit_id(id: &str) -> Result<(), RowError> {
    if !EXPLICIT_ID.is_match(id) {
        return Err(RowError::InvalidIdentity(format!(
            "{id:?} is not a valid rollout id"
        )));
    }
    if ATTEMPT_SUFFIX.is_match(id) {
        return Err(RowError::InvalidIdentity(format!(
            "{id:?} ends with the reserved attempt suffix"
        )));
    }
    Ok(())
}

/// A JSON integer index (never a bool).
pub fn index(value: Option<&Value>) -> Option<i64> {
    match value? {
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

/// One object line of a JSONL file.
#[derive(Debug, Clone)]
pub struct JsonlRecord {
    /// 1-based line number.
    pub line: u64,
    /// Byte offset of the line and its length including the newline.
    pub offset: u64,
    pub length: u64,
    pub value: Value,
}

/// An interrupted final write that was not taken as a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub line: u64,
    pub offset: u64,
    pub length: u64,
}

/// What a scan saw besides its records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JsonlSummary {
    /// Lines read (including blank lines and a torn tail).
    pub lines: u64,
    pub records: u64,
    pub bytes: u64,
    pub torn_tail: Option<TornTail>,
}

/// Why a JSONL file cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum JsonlError<E: std::error::Error + 'static = std::convert::Infallible> {
    #[error("Malformed JSON in {path} at line {line}: {message}")]
    Malformed {
        path: String,
        line: u64,
        message: String,
    },
    #[error("Expected an object in {path} at line {line}.")]
    NotAnObject { path: String, line: u64 },
    #[error("reading {path} failed: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Handler(E),
}

/// Why serde_json refused one line, placed within that line: its own "at line L column C"
/// counts from the start of the slice, which holds the line's `\n`, so an error at that `\n`
/// read "line 2 column 0" in a message naming the line's number in its file (hostile review
/// 39).
pub fn line_parse_error(error: &serde_json::Error) -> String {
    let text = error.to_string();
    let place = format!(" at line {} column {}", error.line(), error.column());
    match text.strip_suffix(&place) {
        Some(reason) if error.line() <= 1 => format!("{reason} at column {}", error.column()),
        Some(reason) => format!("{reason} at the end of the line"),
        None => text,
    }
}

/// Parses one JSONL line the way the collector's reader (orjson) accepts it, nesting allowed up
/// to [`crate::canonical::MAX_DEPTH`].
pub fn parse_line(bytes: &[u8]) -> Result<Value, String> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(value) => Ok(value),
        // Rows nested deeper than serde_json's default limit are rare: take the checked path.
        Err(e) if e.to_string().contains("recursion limit") => {
            crate::canonical::parse_json(bytes).map_err(|e| e.to_string())
        }
        Err(e) => Err(line_parse_error(&e)),
    }
}

/// Streams the object records of a JSONL file to `handle`, in file order.
pub fn scan_jsonl<E: std::error::Error + 'static>(
    reader: impl Read,
    path: &str,
    mut handle: impl FnMut(JsonlRecord) -> Result<(), E>,
) -> Result<JsonlSummary, JsonlError<E>> {
    let mut reader = BufReader::with_capacity(1 << 20, reader);
    let mut line = Vec::new();
    let mut summary = JsonlSummary::default();
    loop {
        line.clear();
        let read = reader
            .read_until(b'\n', &mut line)
            .map_err(|source| JsonlError::Io {
                path: path.to_owned(),
                source,
            })?;
        if read == 0 {
            return Ok(summary);
        }
        summary.lines += 1;
        let offset = summary.bytes;
        summary.bytes += read as u64;
        let terminated = line.last() == Some(&b'\n');
        if is_blank(&line) {
            continue;
        }
        match parse_line(&line) {
            Ok(value @ Value::Object(_)) => {
                summary.records += 1;
                handle(JsonlRecord {
                    line: summary.lines,
                    offset,
                    length: read as u64,
                    value,
                })
                .map_err(JsonlError::Handler)?;
            }
            Ok(_) => {
                return Err(JsonlError::NotAnObject {
                    path: path.to_owned(),
                    line: summary.lines,
                });
            }
            Err(_) if !terminated => {
                summary.torn_tail = Some(TornTail {
                    line: summary.lines,
                    offset,
                    length: read as u64,
                });
                return Ok(summary);
            }
            Err(message) => {
                return Err(JsonlError::Malformed {
                    path: path.to_owned(),
                    line: summary.lines,
                    message,
                });
            }
        }
    }
}

/// Streams the rows of a materialized-inputs file as the collector reads it (Python's text mode:
/// `\n`, `\r\n` and `\r` end a line; a line `str.strip()` leaves empty is blank, `\x0b` and
/// `\xa0` included), the rules of the materialized digest: every other line must be a JSON
/// object, the last one included. `handle` gets each row and its 1-based line number.
pub fn scan_materialized<E: std::error::Error + 'static>(
    reader: impl Read,
    path: &str,
    mut handle: impl FnMut(u64, Value) -> Result<(), E>,
) -> Result<u64, JsonlError<E>> {
    let mut reader = BufReader::with_capacity(1 << 20, reader);
    let mut segment = Vec::new();
    let mut line_number = 0u64;
    let mut rows = 0u64;
    loop {
        segment.clear();
        let read = reader
            .read_until(b'\n', &mut segment)
            .map_err(|source| JsonlError::Io {
                path: path.to_owned(),
                source,
            })?;
        if read == 0 {
            return Ok(rows);
        }
        // One `\n`-ended segment may hold several `\r`-ended lines.
        for line in crate::materialized::universal_lines(&segment) {
            line_number += 1;
            if crate::materialized::is_blank_line(line) {
                continue;
            }
            match parse_line(line) {
                Ok(value @ Value::Object(_)) => {
                    rows += 1;
                    handle(line_number, value).map_err(JsonlError::Handler)?;
                }
                Ok(_) => {
                    return Err(JsonlError::NotAnObject {
                        path: path.to_owned(),
                        line: line_number,
                    });
                }
                Err(message) => {
                    return Err(JsonlError::Malformed {
                        path: path.to_owned(),
                        line: line_number,
                        message,
                    });
                }
            }
        }
    }
}

/// Every row of a materialized-inputs file ([`scan_materialized`]'s rules), in memory.
pub fn read_materialized(reader: impl Read, path: &str) -> Result<Vec<Value>, JsonlError> {
    let mut rows = Vec::new();
    scan_materialized::<std::convert::Infallible>(reader, path, |_, row| {
        rows.push(row);
        Ok(())
    })?;
    Ok(rows)
}

/// Reads every object record of a JSONL file into memory (small files: journals, inventories).
pub fn read_jsonl(
    reader: impl Read,
    path: &str,
) -> Result<(Vec<JsonlRecord>, JsonlSummary), JsonlError> {
    let mut records = Vec::new();
    let summary = scan_jsonl::<std::convert::Infallible>(reader, path, |record| {
        records.push(record);
        Ok(())
    })?;
    Ok((records, summary))
}

/// The sidecar routing alias a canonical failure record implies (`sidecar_failure_class`).
pub fn sidecar_failure_class(record: &Value) -> Option<String> {
    let failure = record.get("failure")?;
    if let Some(kind) = failure.get("failure_kind").and_then(Value::as_str) {
        return Some(kind.to_owned());
    }
    match record.get("source").and_then(Value::as_str)? {
        "environment" => Some("environment_server_failed".into()),
        "collector" => Some("agent_request_failed".into()),
        _ => None,
    }
}

/// Validates a canonical failure record (`RolloutFailure`, schema version 1): the problems found.
pub fn failure_record_problems(record: &Value) -> Vec<String> {
    const FIELDS: [&str; 8] = [
        "schema_version",
        "episode_id",
        "run_id",
        "source",
        "delivery",
        "failure",
        "http_status",
        "exception_type",
    ];
    const FAILURE_FIELDS: [&str; 4] = ["failure_reason", "terminal", "failure_kind", "stage"];
    let mut problems = Vec::new();
    let Some(map) = record.as_object() else {
        return vec!["must be an object".into()];
    };
    for key in map.keys().filter(|k| !FIELDS.contains(&k.as_str())) {
        problems.push(format!("{key}: extra field"));
    }
    match map.get("schema_version") {
        None => {}
        Some(v) if v.as_i64() == Some(1) && !v.is_boolean() => {}
        Some(_) => problems.push("schema_version: must be 1".into()),
    }
    match map.get("episode_id").and_then(Value::as_object) {
        Some(episode) => {
            if !episode.get("rollout_id").is_some_and(Value::is_string) {
                problems.push("episode_id.rollout_id: must be a string".into());
            }
            if episode
                .get("attempt")
                .and_then(Value::as_i64)
                .is_none_or(|a| a < 0)
            {
                problems.push("episode_id.attempt: must be a non-negative integer".into());
            }
        }
        None => problems.push("episode_id: required".into()),
    }
    if map
        .get("run_id")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        problems.push("run_id: must be a non-empty string".into());
    }
    let source = map.get("source").and_then(Value::as_str);
    if !matches!(source, Some("environment" | "collector")) {
        problems.push("source: must be 'environment' or 'collector'".into());
    }
    let delivery = map.get("delivery").and_then(Value::as_str);
    if !matches!(
        delivery,
        Some("not_sent" | "possibly_delivered" | "delivered")
    ) {
        problems.push("delivery: must be not_sent, possibly_delivered or delivered".into());
    } else if source == Some("environment") && delivery != Some("delivered") {
        problems.push("delivery: an environment-reported failure was delivered".into());
    }
    match map.get("failure").and_then(Value::as_object) {
        Some(failure) => {
            for key in failure
                .keys()
                .filter(|k| !FAILURE_FIELDS.contains(&k.as_str()))
            {
                problems.push(format!("failure.{key}: extra field"));
            }
            if failure
                .get("failure_reason")
                .and_then(Value::as_str)
                .is_none_or(|r| r.chars().count() > 2000)
            {
                problems.push("failure.failure_reason: required, at most 2000 characters".into());
            }
            if !failure.get("terminal").is_some_and(Value::is_boolean) {
                problems.push("failure.terminal: must be a boolean".into());
            }
            if let Some(kind) = failure.get("failure_kind")
                && !kind.is_string()
            {
                problems.push("failure.failure_kind: must be a string".into());
            }
            if let Some(stage) = failure.get("stage")
                && stage
                    .as_str()
                    .is_none_or(|s| crate::failure::FailureStage::parse(s).is_none())
            {
                problems.push(
                    "failure.stage: must be admission, seed, agent, verification or cleanup".into(),
                );
            }
        }
        None => problems.push("failure: required".into()),
    }
    match map.get("http_status") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_i64().is_some_and(|s| (100..=599).contains(&s)) => {}
        Some(_) => problems.push("http_status: must be 100-599 or null".into()),
    }
    match map.get("exception_type") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.chars().count() <= 2000 => {}
        Some(_) => problems
            .push("exception_type: must be a string of at most 2000 characters or null".into()),
    }
    problems
}
