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

use crate::canonical::{CanonicalError, canonicalize_text, hex};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::sync::mpsc;

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

/// Digests a JSONL stream using up to `threads` canonicalizing threads (0 or 1: this thread only).
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
    let bytes = if threads <= 1 {
        let mut out = Vec::with_capacity(CHUNK + CHUNK / 4);
        let read = read_chunks(reader, |chunk| {
            out.clear();
            let counts =
                canonicalize_lines(chunk, &mut out).map_err(|e| e.offset_by(state.lines))?;
            state.absorb(&out, counts);
            Ok(())
        });
        match read {
            Ok(bytes) => bytes,
            Err(ReadError::Io(e)) => return Err(MaterializedError::Io(e)),
            Err(ReadError::Handler(e)) => return Err(e),
        }
    } else {
        parallel(reader, threads, &mut state)?
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

type Reply = Result<(Vec<u8>, Counts), LocalLineError>;

/// Reader thread -> worker threads -> this thread hashing in submission order.
fn parallel(
    reader: impl Read + Send,
    threads: usize,
    state: &mut HashState,
) -> Result<u64, MaterializedError> {
    std::thread::scope(|scope| {
        let (job_tx, job_rx) = mpsc::sync_channel::<(Vec<u8>, mpsc::SyncSender<Reply>)>(threads);
        let job_rx = std::sync::Arc::new(std::sync::Mutex::new(job_rx));
        for _ in 0..threads {
            let job_rx = std::sync::Arc::clone(&job_rx);
            scope.spawn(move || {
                loop {
                    let job = match job_rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    let Ok((chunk, reply)) = job else { return };
                    let mut out = Vec::with_capacity(chunk.len() + chunk.len() / 4);
                    let result = canonicalize_lines(&chunk, &mut out).map(|counts| (out, counts));
                    // The receiver is gone only when hashing already stopped on an error.
                    let _ = reply.send(result);
                }
            });
        }
        // At most `threads + 1` chunks wait for hashing: memory stays bounded.
        let (order_tx, order_rx) = mpsc::sync_channel::<mpsc::Receiver<Reply>>(threads + 1);
        let reading = scope.spawn(move || {
            read_chunks(reader, |chunk| {
                let (reply_tx, reply_rx) = mpsc::sync_channel(1);
                if order_tx.send(reply_rx).is_err()
                    || job_tx.send((chunk.to_vec(), reply_tx)).is_err()
                {
                    return Err(Stopped);
                }
                Ok(())
            })
        });
        for reply in order_rx {
            let Ok(result) = reply.recv() else { break };
            let (out, counts) = result.map_err(|e| e.offset_by(state.lines))?;
            state.absorb(&out, counts);
        }
        match reading.join() {
            Ok(Ok(bytes)) => Ok(bytes),
            Ok(Err(ReadError::Io(e))) => Err(MaterializedError::Io(e)),
            Ok(Err(ReadError::Handler(Stopped))) | Err(_) => Err(MaterializedError::Io(
                std::io::Error::other("the digest pipeline stopped unexpectedly"),
            )),
        }
    })
}

/// The hashing side hung up (it reports its own error).
#[derive(Debug)]
struct Stopped;

enum ReadError<E> {
    Io(std::io::Error),
    Handler(E),
}

/// Reads the stream and hands over chunks that end at a line break (or at the end of input).
fn read_chunks<E>(
    mut reader: impl Read,
    mut handle: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<u64, ReadError<E>> {
    let mut buf: Vec<u8> = Vec::with_capacity(CHUNK * 2);
    let mut total = 0u64;
    let mut eof = false;
    while !eof {
        // Fill up to CHUNK more bytes.
        let start = buf.len();
        buf.resize(start + CHUNK, 0);
        let mut filled = start;
        while filled < buf.len() {
            match reader.read(&mut buf[filled..]) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
        buf.truncate(filled);
        total += (filled - start) as u64;
        let cut = if eof {
            Some(buf.len())
        } else {
            last_line_end(&buf)
        };
        if let Some(cut) = cut {
            handle(&buf[..cut]).map_err(ReadError::Handler)?;
            buf.drain(..cut);
        }
    }
    Ok(total)
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
fn canonicalize_lines(chunk: &[u8], out: &mut Vec<u8>) -> Result<Counts, LocalLineError> {
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
        if is_python_blank(line).map_err(fail)? {
            continue;
        }
        out.push(b',');
        canonicalize_text(line, out).map_err(fail)?;
        rows += 1;
    }
    Ok(Counts { rows, lines })
}

/// Whether Python's `line.strip()` would leave nothing (errors on invalid UTF-8, as decoding would).
fn is_python_blank(line: &[u8]) -> Result<bool, CanonicalError> {
    match line.first() {
        None => return Ok(true),
        // The common case: a row starts right away.
        Some(&b) if b > b' ' && b < 0x80 => return Ok(false),
        _ => {}
    }
    let text = std::str::from_utf8(line).map_err(|e| CanonicalError::Utf8 {
        offset: e.valid_up_to(),
    })?;
    Ok(text.chars().all(is_python_space))
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
