//! The materialized digest: `_digest([json.loads(line) for line in file if line.strip()])` of a
//! JSONL stream, computed in constant memory.
//!
//! Invariants:
//! - the digest of a list is SHA-256 of `[`, each row's canonical text joined by `,`, and `]`, so
//!   rows are canonicalized and hashed one chunk at a time, never collected;
//! - lines are split like Python's text mode (universal newlines: `\n`, `\r\n` and `\r`);
//! - a line is blank (skipped) when Python's `str.strip()` leaves nothing, which includes
//!   `\x0b`, `\x0c`, `\x1c`-`\x1f`, `\x85`, `\xa0` and the Unicode spaces;
//! - any invalid UTF-8 or malformed line is an error naming its 1-based line number;
//! - memory is bounded by a few chunks in flight plus the longest line.

use crate::canonical::{
    CanonicalError, Scratch, canonicalize_text, canonicalize_valid_utf8, hex, validate_utf8,
};
use crate::pipeline::{CHUNK, LineEnds, PipelineError, lock, process_ordered};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::sync::Mutex;

/// The result of digesting a materialized-inputs stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaterializedDigest {
    /// `_digest(rows)`, lowercase hex.
    pub sha256: String,
    /// Non-blank lines (rows) digested.
    pub rows: u64,
    /// Bytes read.
    pub bytes: u64,
}

/// Why a materialized stream has no digest.
#[derive(Debug, thiserror::Error)]
pub enum MaterializedError {
    #[error("line {line}: {source}")]
    Line {
        line: u64,
        #[source]
        source: CanonicalError,
    },
    #[error("reading the rows failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Digests a JSONL stream using up to `threads` canonicalizing threads (the calling thread is one
/// of them; 0 counts as 1); chunks are hashed in stream order.
pub fn materialized_digest(
    reader: impl Read + Send,
    threads: usize,
) -> Result<MaterializedDigest, MaterializedError> {
    let mut hasher = Sha256::new();
    hasher.update(b"[");
    let mut state = HashState {
        hasher,
        any_row: false,
        rows: 0,
        lines: 0,
    };
    // Hashed output buffers go back to the workers, so chunks allocate nothing once warm.
    let spare: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
    let result = process_ordered(
        reader,
        threads,
        LineEnds::Universal,
        Scratch::default,
        |scratch, chunk| {
            let mut out = lock(&spare)
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(CHUNK + CHUNK / 4));
            out.clear();
            canonicalize_lines(chunk, &mut out, scratch).map(|counts| (out, counts))
        },
        |result| {
            let (out, counts) = result.map_err(|e| e.offset_by(state.lines))?;
            state.absorb(&out, counts);
            lock(&spare).push(out);
            Ok(())
        },
    );
    let bytes = match result {
        Ok(bytes) => bytes,
        Err(PipelineError::Io(e)) => return Err(MaterializedError::Io(e)),
        Err(PipelineError::Consumer(e)) => return Err(e),
    };
    let HashState {
        mut hasher, rows, ..
    } = state;
    hasher.update(b"]");
    Ok(MaterializedDigest {
        sha256: hex(&hasher.finalize()),
        rows,
        bytes,
    })
}

struct HashState {
    hasher: Sha256,
    any_row: bool,
    rows: u64,
    lines: u64,
}

impl HashState {
    /// Hashes one chunk's output (every row preceded by a comma).
    fn absorb(&mut self, out: &[u8], counts: Counts) {
        if counts.rows > 0 {
            let text = if self.any_row { out } else { &out[1..] };
            self.hasher.update(text);
            self.any_row = true;
        }
        self.rows += counts.rows;
        self.lines += counts.lines;
    }
}

#[derive(Debug, Clone, Copy)]
struct Counts {
    rows: u64,
    lines: u64,
}

/// A line error before it is placed in the whole stream.
#[derive(Debug)]
struct LocalLineError {
    line_in_chunk: u64,
    source: CanonicalError,
}

impl LocalLineError {
    fn offset_by(self, lines_before: u64) -> MaterializedError {
        MaterializedError::Line {
            line: lines_before + self.line_in_chunk,
            source: self.source,
        }
    }
}

/// Canonicalizes every non-blank line of a chunk, each preceded by a comma.
fn canonicalize_lines(
    chunk: &[u8],
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) -> Result<Counts, LocalLineError> {
    // One SIMD validation per chunk; an invalid chunk is re-read line by line to name the line.
    let chunk_valid = validate_utf8(chunk).is_ok();
    let mut rows = 0u64;
    let mut lines = 0u64;
    let mut pos = 0usize;
    while pos < chunk.len() {
        let rest = &chunk[pos..];
        let (line, next) = match memchr::memchr2(b'\n', b'\r', rest) {
            Some(i) if rest[i] == b'\r' && rest.get(i + 1) == Some(&b'\n') => {
                (&rest[..i], pos + i + 2)
            }
            Some(i) => (&rest[..i], pos + i + 1),
            None => (rest, chunk.len()),
        };
        lines += 1;
        pos = next;
        let fail = |source| LocalLineError {
            line_in_chunk: lines,
            source,
        };
        if is_python_blank(line, chunk_valid).map_err(fail)? {
            continue;
        }
        out.push(b',');
        if chunk_valid {
            canonicalize_valid_utf8(line, out, scratch)
        } else {
            canonicalize_text(line, out)
        }
        .map_err(fail)?;
        rows += 1;
    }
    Ok(Counts { rows, lines })
}

/// Whether Python's `line.strip()` would leave nothing (errors on invalid UTF-8, as decoding would).
fn is_python_blank(line: &[u8], valid_utf8: bool) -> Result<bool, CanonicalError> {
    match line.first() {
        None => return Ok(true),
        // The common case: a row starts right away.
        Some(&b) if b > b' ' && b < 0x80 => return Ok(false),
        _ => {}
    }
    if !valid_utf8 {
        validate_utf8(line)?;
    }
    Ok(String::from_utf8_lossy(line).chars().all(is_python_space))
}

/// Python's `str.isspace()` for one character.
/// The lines of `text` as Python's text mode splits them (`\n`, `\r\n` and `\r` end a line),
/// without their ends; a final line without an end is a line too.
pub fn universal_lines(text: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let (line, next) = match memchr::memchr2(b'\n', b'\r', rest) {
            Some(i) if rest[i] == b'\r' && rest.get(i + 1) == Some(&b'\n') => {
                (&rest[..i], &rest[i + 2..])
            }
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, &rest[rest.len()..]),
        };
        rest = next;
        Some(line)
    })
}

/// Whether a line is blank as Python's `str.strip()` sees it (`\x0b`, `\x1c`, `\xa0`, U+2003
/// and the other Unicode spaces included); a line that is not UTF-8 is not blank.
pub fn is_blank_line(line: &[u8]) -> bool {
    is_python_blank(line, false).unwrap_or(false)
}

pub fn is_python_space(c: char) -> bool {
    matches!(
        c,
        '\u{09}'..='\u{0d}'
            | '\u{1c}'..='\u{20}'
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}
