//! Ordered parallel processing of a line-oriented stream: chunks of whole lines are processed on
//! N threads (the calling thread is one of them) and their results consumed in stream order.
//!
//! Each thread takes the next chunk from the reader, processes it, and consumes every result that
//! is next in order; no thread waits for another except to take its turn at the reader or at the
//! consumer, so N threads keep N cores busy. Memory stays bounded by a few chunks in flight plus
//! the longest line. The first consumer error (in stream order) or read error stops the pipeline.

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Bytes read per chunk; lines are never split across chunks.
pub(crate) const CHUNK: usize = 1 << 20;

/// Why a pipeline stopped.
#[derive(Debug)]
pub(crate) enum PipelineError<E> {
    Io(std::io::Error),
    Consumer(E),
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How lines end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LineEnds {
    /// `\n` only (binary reading).
    Newline,
    /// `\n`, `\r\n` and `\r` (Python's text mode).
    Universal,
}

/// Processes `reader` in chunks on `threads` threads; returns the bytes read.
pub(crate) fn process_ordered<R, W, T, E>(
    reader: R,
    threads: usize,
    line_ends: LineEnds,
    make_worker: impl Fn() -> W + Sync,
    work: impl Fn(&mut W, &[u8]) -> T + Sync,
    consume: impl FnMut(T) -> Result<(), E> + Send,
) -> Result<u64, PipelineError<E>>
where
    R: Read + Send,
    T: Send,
    E: Send,
{
    let source = Mutex::new(Source {
        chunks: ChunkReader::new(reader, line_ends),
        next_sequence: 0,
    });
    let sink = Mutex::new(Sink {
        consume,
        next_sequence: 0,
        ready: BTreeMap::new(),
        error: None,
    });
    let stop = AtomicBool::new(false);
    let run = || {
        let mut worker = make_worker();
        let mut chunk = Vec::with_capacity(CHUNK + CHUNK / 8);
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let sequence = {
                let mut source = lock(&source);
                match source.chunks.next_chunk(&mut chunk) {
                    Ok(true) => {
                        source.next_sequence += 1;
                        source.next_sequence - 1
                    }
                    Ok(false) => return,
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        lock(&sink).error.get_or_insert(PipelineError::Io(e));
                        return;
                    }
                }
            };
            let result = work(&mut worker, &chunk);
            let mut sink = lock(&sink);
            sink.ready.insert(sequence, result);
            // Consume every result that is next in order (possibly other threads' results too).
            loop {
                let next = sink.next_sequence;
                let Some(result) = sink.ready.remove(&next) else {
                    break;
                };
                sink.next_sequence += 1;
                if let Err(e) = (sink.consume)(result) {
                    sink.error.get_or_insert(PipelineError::Consumer(e));
                    stop.store(true, Ordering::Relaxed);
                    return;
                }
            }
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads.max(1) {
            scope.spawn(run);
        }
        run();
    });
    let bytes = lock(&source).chunks.total;
    match sink
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
        .error
    {
        Some(error) => Err(error),
        None => Ok(bytes),
    }
}

struct Source<R> {
    chunks: ChunkReader<R>,
    next_sequence: u64,
}

/// Results waiting for their turn, and the consumer.
struct Sink<C, T, E> {
    consume: C,
    next_sequence: u64,
    ready: BTreeMap<u64, T>,
    error: Option<PipelineError<E>>,
}

/// Reads the stream in chunks that end at a line end (or at the end of input).
struct ChunkReader<R> {
    reader: R,
    line_ends: LineEnds,
    /// Bytes after the last line end of the previous chunk.
    carry: Vec<u8>,
    eof: bool,
    total: u64,
}

impl<R: Read> ChunkReader<R> {
    fn new(reader: R, line_ends: LineEnds) -> Self {
        Self {
            reader,
            line_ends,
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
            if let Some(cut) = last_line_end(chunk, self.line_ends) {
                self.carry.extend_from_slice(&chunk[cut..]);
                chunk.truncate(cut);
                return Ok(true);
            }
            // No line end yet: a line longer than a chunk; read on.
        }
    }
}

/// End (exclusive) of the last complete line: after the last `\n`, or (universal newlines) after
/// a `\r` that is known not to be the first half of `\r\n`.
fn last_line_end(buf: &[u8], line_ends: LineEnds) -> Option<usize> {
    if let Some(i) = memchr::memrchr(b'\n', buf) {
        return Some(i + 1);
    }
    if line_ends == LineEnds::Newline {
        return None;
    }
    match memchr::memrchr(b'\r', buf) {
        Some(i) if i + 1 < buf.len() => Some(i + 1),
        _ => None,
    }
}
