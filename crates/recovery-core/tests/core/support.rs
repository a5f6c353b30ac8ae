//! Shared test helpers: the `../shared` reference material and a Python oracle.

use serde_json::Value;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// `../shared` relative to the project root (tests read vectors from there, never copies).
pub fn shared(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(relative)
}

/// Reads a JSONL file of the shared material as values.
pub fn shared_jsonl(relative: &str) -> Vec<Value> {
    let path = shared(relative);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("vector line"))
        .collect()
}

/// Runs a Python 3 program with `input` on stdin and returns its stdout (panics on failure).
pub fn python(program: &str, input: &[u8]) -> Vec<u8> {
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(program)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 must be installed for the oracle tests");
    let mut stdin = child.stdin.take().expect("stdin");
    let input = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let output = child.wait_with_output().expect("python3 ran");
    writer
        .join()
        .expect("writer thread")
        .expect("python3 stdin");
    assert!(
        output.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output.stdout
}
