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
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

/// Bytes read per chunk; lines are never split across chunks.
const CHUNK: usize = 1 << 20;

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
/// of them; 0 counts as 1).
///
/// Each thread takes the next chunk from the reader, canonicalizes it, and hashes every result
/// that is next in order; no thread waits for another except to take its turn at the reader or
/// at the hasher, so two cores stay busy with two threads.
pub fn materialized_digest(
    reader: impl Read + Send,
    threads: usize,
) -> Result<MaterializedDigest, MaterializedError> {
    let mut hasher = Sha256::new();
    hasher.update(b"[");
    let source = Mutex::new(Source {
        chunks: ChunkReader::new(reader),
        next_sequence: 0,
    });
    let sink = Mutex::new(Sink {
        state: HashState {
            hasher,
            any_row: false,
            rows: 0,
            lines: 0,
        },
        next_sequence: 0,
        ready: BTreeMap::new(),
        spare: Vec::new(),
        error: None,
    });
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        for _ in 1..threads.max(1) {
            scope.spawn(|| work(&source, &sink, &stop));
        }
        work(&source, &sink, &stop);
    });
    let bytes = lock(&source).chunks.total;
    let Sink { state, error, .. } = sink.into_inner().unwrap_or_else(PoisonError::into_inner);
    if let Some(error) = error {
        return Err(error);
    }
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

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Source<R> {
    chunks: ChunkReader<R>,
    next_sequence: u64,
}

/// Results waiting for their turn to be hashed, and the hash so far.
struct Sink {
    state: HashState,
    next_sequence: u64,
    ready: BTreeMap<u64, Result<(Vec<u8>, Counts), LocalLineError>>,
    /// Hashed output buffers, reused by the next chunks.
    spare: Vec<Vec<u8>>,
    error: Option<MaterializedError>,
}

fn work<R: Read>(source: &Mutex<Source<R>>, sink: &Mutex<Sink>, stop: &AtomicBool) {
    let mut chunk = Vec::with_capacity(CHUNK + CHUNK / 8);
    let mut scratch = Scratch::default();
    loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let sequence = {
            let mut source = lock(source);
            match source.chunks.next_chunk(&mut chunk) {
                Ok(true) => {
                    source.next_sequence += 1;
                    source.next_sequence - 1
                }
                Ok(false) => return,
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    lock(sink).error.get_or_insert(MaterializedError::Io(e));
                    return;
                }
            }
        };
        let mut out = lock(sink)
            .spare
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(CHUNK + CHUNK / 4));
        out.clear();
        let result = canonicalize_lines(&chunk, &mut out, &mut scratch).map(|counts| (out, counts));
        let mut sink = lock(sink);
        sink.ready.insert(sequence, result);
        // Hash every result that is next in order (possibly other threads' results too).
        loop {
            let next = sink.next_sequence;
            let Some(result) = sink.ready.remove(&next) else {
                break;
            };
            sink.next_sequence += 1;
            match result {
                Ok((out, counts)) => {
                    sink.state.absorb(&out, counts);
                    sink.spare.push(out);
                }
                Err(e) => {
                    let lines = sink.state.lines;
                    sink.error.get_or_insert(e.offset_by(lines));
                    stop.store(true, Ordering::Relaxed);
                    return;
                }
            }
        }
    }
}

/// Reads the stream in chunks that end at a line break (or at the end of input).
struct ChunkReader<R> {
    reader: R,
    /// Bytes after the last line break of the previous chunk.
    carry: Vec<u8>,
    eof: bool,
    total: u64,
}

impl<R: Read> ChunkReader<R> {
    fn new(reader: R) -> Self {
        Self {
            reader,
            carry: Vec::new(),
            eof: false,
            total: 0,
        }
    }

    /// Fills `chunk` with the next whole lines; `false` when the input is exhausted.
    fn next_chunk(&mut self, chunk: &mut Vec<u8>) -> std::io::Result<bool> {
        chunk.clear();
        chunk.append(&mut self.carry);
        loop {
            if self.eof {
                return Ok(!chunk.is_empty());
            }
            let start = chunk.len();
            loop {
                match (&mut self.reader).take(CHUNK as u64).read_to_end(chunk) {
                    Ok(_) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            let got = chunk.len() - start;
            self.total += got as u64;
            if got < CHUNK {
                self.eof = true;
                return Ok(!chunk.is_empty());
            }
            if let Some(cut) = last_line_end(chunk) {
                self.carry.extend_from_slice(&chunk[cut..]);
                chunk.truncate(cut);
                return Ok(true);
            }
            // No line break yet: a line longer than a chunk; read on.
        }
    }
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

/// End (exclusive) of the last complete line: after the last `\n`, or after a `\r` that is known
/// not to be the first half of `\r\n`.
fn last_line_end(buf: &[u8]) -> Option<usize> {
    if let Some(i) = memchr::memrchr(b'\n', buf) {
        return Some(i + 1);
    }
    match memchr::memrchr(b'\r', buf) {
        Some(i) if i + 1 < buf.len() => Some(i + 1),
        _ => None,
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
