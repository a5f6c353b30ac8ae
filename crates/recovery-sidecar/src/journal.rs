//! Append-only journals: one complete line per event, fsynced before the append returns.
//!
//! Invariants (facts §11.1 `prepare_append`): before appending, an unterminated tail left by a
//! crash is repaired: kept (with its newline added) when it is a complete JSON value, truncated
//! away otherwise; complete lines are never rewritten. A line is written with one `write` on an
//! `O_APPEND` descriptor, so concurrent readers see whole lines.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// What `prepare_append` did to an unterminated tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailRepair {
    /// The file was empty or ended with a newline.
    Clean,
    /// A complete JSON value without its newline: the newline was added.
    Terminated,
    /// An incomplete write of this many bytes was removed.
    Truncated(u64),
}

/// A journal path that holds a symbolic link, FIFO, socket or directory, or a file with other
/// names (a hard link could name a file outside the roots, or another run's manifest): never
/// appended to, nor repaired.
#[derive(Debug, thiserror::Error)]
#[error(
    "not a regular file with one name (a symbolic link, FIFO, socket, directory or a file with hard links is never appended to)"
)]
pub struct NotARegularFile;

fn not_a_regular_file() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, NotARegularFile)
}

/// Refuses an opened journal that is not a regular file with one name.
fn check_appendable(file: &File) -> std::io::Result<std::fs::Metadata> {
    let metadata = file.metadata()?;
    if !metadata.is_file() || std::os::unix::fs::MetadataExt::nlink(&metadata) > 1 {
        return Err(not_a_regular_file());
    }
    Ok(metadata)
}

/// Whether an append failed because something other than a regular file is where the journal
/// belongs: the type check after opening, or the open itself refused it (`ELOOP`: a link under
/// `O_NOFOLLOW`; `EISDIR`: a directory; `ENXIO`: a FIFO without a reader, or a socket).
pub fn is_not_a_regular_file(error: &std::io::Error) -> bool {
    error
        .get_ref()
        .is_some_and(|inner| inner.is::<NotARegularFile>())
        || matches!(
            error.raw_os_error(),
            Some(libc::ELOOP | libc::EISDIR | libc::ENXIO)
        )
}

/// Repairs an unterminated tail (see the module invariants); `Clean` for a missing file.
pub fn prepare_append(path: &Path) -> std::io::Result<TailRepair> {
    let mut file = match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(file) => {
            check_appendable(&file)?;
            file
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(TailRepair::Clean),
        Err(e) => return Err(e),
    };
    let end = file.seek(SeekFrom::End(0))?;
    if end == 0 {
        return Ok(TailRepair::Clean);
    }
    let mut last = [0u8; 1];
    file.seek(SeekFrom::End(-1))?;
    file.read_exact(&mut last)?;
    if last[0] == b'\n' {
        return Ok(TailRepair::Clean);
    }
    let (start, tail) = read_tail(&mut file, end)?;
    let repair = if recovery_core::rows::parse_line(&tail).is_ok() || is_plain_line(&tail) {
        file.seek(SeekFrom::End(0))?;
        file.write_all(b"\n")?;
        TailRepair::Terminated
    } else {
        file.set_len(start)?;
        TailRepair::Truncated(end - start)
    };
    file.sync_all()?;
    Ok(repair)
}

/// The bytes after a file of length `end`'s last newline, and where they start.
fn read_tail(file: &mut File, end: u64) -> std::io::Result<(u64, Vec<u8>)> {
    let start = tail_start(file, end)?;
    let mut tail = vec![0u8; (end - start) as usize];
    file.seek(SeekFrom::Start(start))?;
    file.read_exact(&mut tail)?;
    Ok((start, tail))
}

/// Where the bytes after a file's last newline start (`end` when it ends with one), scanning
/// backwards in 1 MiB chunks: each chunk is read once.
fn tail_start(file: &mut File, end: u64) -> std::io::Result<u64> {
    let mut start = end;
    while start > 0 {
        let size = start.min(1 << 20);
        start -= size;
        let mut chunk = vec![0u8; size as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut chunk)?;
        if let Some(at) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + at as u64 + 1);
        }
    }
    Ok(0)
}

/// The bytes that follow the journal's last newline (none for a missing or empty file, or one
/// that ends with a newline): an unterminated line, which [`prepare_append`] would end or
/// remove at the next append.
pub fn unterminated_tail(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut file = match crate::files::open_regular(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let end = file.seek(SeekFrom::End(0))?;
    read_tail(&mut file, end).map(|(_, tail)| tail)
}

/// A non-JSON line-based journal's complete entry (a decimal integer, as the resubmit offset).
fn is_plain_line(tail: &[u8]) -> bool {
    !tail.is_empty() && tail.iter().all(u8::is_ascii_digit)
}

/// Appends one line (a newline is added) and fsyncs it, repairing a torn tail first.
pub fn append_line(path: &Path, line: &[u8]) -> std::io::Result<TailRepair> {
    append_line_at(path, line).map(|(repair, _)| repair)
}

/// [`append_line`], also returning the byte offset the line starts at. The offset is exact only
/// for the journal's one writer (callers hold the run's lock): a complete line's offset never
/// changes, since tail repair only touches what follows the last complete line.
pub fn append_line_at(path: &Path, line: &[u8]) -> std::io::Result<(TailRepair, u64)> {
    let (repair, offsets) = append_lines_at(path, &[line])?;
    Ok((repair, offsets[0]))
}

/// Appends several lines with one write and one `fdatasync` (group commit), repairing a torn
/// tail first; returns where each line starts. As [`append_line_at`], for the journal's one
/// writer.
pub fn append_lines_at(path: &Path, lines: &[&[u8]]) -> std::io::Result<(TailRepair, Vec<u64>)> {
    if lines.iter().any(|line| line.contains(&b'\n')) {
        return Err(std::io::Error::other(
            "a journal line must not contain a newline",
        ));
    }
    let repair = prepare_append(path)?;
    // Never through a symbolic link: a journal is written beside its output, nowhere else.
    // Never waiting on a FIFO swapped in (no reader: ENXIO at once), never writing to one.
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let start = check_appendable(&file)?.len();
    let mut buffer = Vec::with_capacity(lines.iter().map(|l| l.len() + 1).sum());
    let mut offsets = Vec::with_capacity(lines.len());
    for line in lines {
        offsets.push(start + buffer.len() as u64);
        buffer.extend_from_slice(line);
        buffer.push(b'\n');
    }
    file.write_all(&buffer)?;
    file.sync_data()?;
    if repair != TailRepair::Clean || start == 0 {
        // A new file or a repaired one: make its directory entry durable too.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir)?.sync_all()?;
        }
    }
    Ok((repair, offsets))
}

/// The complete lines of a journal (a missing file has none; an unterminated tail is left out).
pub fn read_lines(path: &Path) -> std::io::Result<Vec<Vec<u8>>> {
    Ok(read_lines_at(path)?
        .into_iter()
        .map(|(_, line)| line)
        .collect())
}

/// [`read_lines`] with each line's byte offset.
pub fn read_lines_at(path: &Path) -> std::io::Result<Vec<(u64, Vec<u8>)>> {
    read_lines_from(path, 0)
}

/// Lines with their byte offsets, and where the next read starts.
pub type LinesFrom = (Vec<(u64, Vec<u8>)>, u64);

/// Up to `max` complete lines from byte `start` (a line boundary), with their offsets, and the
/// offset the next read starts at (after the last line returned; the read is complete when fewer
/// than `max` lines came back). A missing file has none.
pub fn read_lines_batch(path: &Path, start: u64, max: usize) -> std::io::Result<LinesFrom> {
    let file = match crate::files::open_regular(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), start)),
        Err(e) => return Err(e),
    };
    let mut reader = BufReader::with_capacity(1 << 20, file);
    reader.seek(SeekFrom::Start(start))?;
    let mut lines = Vec::new();
    let mut offset = start;
    while lines.len() < max {
        let mut line = Vec::new();
        let read = reader.read_until(b'\n', &mut line)?;
        if read == 0 || line.last() != Some(&b'\n') {
            break;
        }
        line.pop();
        lines.push((offset, line));
        offset += read as u64;
    }
    Ok((lines, offset))
}

/// The complete lines that start at or after byte `start` (a line boundary: where an earlier
/// read ended), with their offsets.
pub fn read_lines_from(path: &Path, start: u64) -> std::io::Result<Vec<(u64, Vec<u8>)>> {
    let file = match crate::files::open_regular(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut reader = BufReader::new(file);
    reader.seek(SeekFrom::Start(start))?;
    let mut lines = Vec::new();
    let mut offset = start;
    loop {
        let mut line = Vec::new();
        let read = reader.read_until(b'\n', &mut line)?;
        if read == 0 || line.last() != Some(&b'\n') {
            return Ok(lines);
        }
        line.pop();
        lines.push((offset, line));
        offset += read as u64;
    }
}
