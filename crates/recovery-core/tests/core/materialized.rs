//! Materialized digest: the CPython vector file, line-splitting rules and chunk boundaries.

use crate::support::{python, shared};
use recovery_core::materialized::{MaterializedError, materialized_digest};
use std::io::Cursor;

const PYTHON_DIGEST_OF_FILE: &str = "import sys, json, hashlib\nrows = [json.loads(l) for l in open(sys.argv[1] if len(sys.argv) > 1 else '/dev/stdin', encoding='utf-8') if l.strip()]\nprint(hashlib.sha256(json.dumps(rows, sort_keys=True, separators=(',', ':'), ensure_ascii=False, allow_nan=False).encode()).hexdigest())";

fn python_digest(bytes: &[u8]) -> String {
    String::from_utf8(python(PYTHON_DIGEST_OF_FILE, bytes))
        .expect("utf8")
        .trim()
        .to_owned()
}

#[test]
fn the_conformance_file_digest_matches_its_sha256_sidecar_with_any_thread_count() {
    let path = shared("conformance/materialized/rows-200.jsonl");
    let expected = std::fs::read_to_string(path.with_extension("jsonl.sha256")).expect("sidecar");
    let expected = expected.split_whitespace().next().expect("digest");
    let rows: u64 = String::from_utf8(python(
        &format!(
            "print(sum(1 for l in open({:?}, encoding='utf-8') if l.strip()))",
            path.display().to_string()
        ),
        b"",
    ))
    .expect("utf8")
    .trim()
    .parse()
    .expect("count");
    for threads in [0, 1, 2, 4] {
        let file = std::fs::File::open(&path).expect("vector file");
        let result = materialized_digest(file, threads).expect("digest");
        assert_eq!(result.sha256, expected, "threads={threads}");
        assert_eq!(result.rows, rows, "rows counted like Python's list");
    }
}

#[test]
fn blank_lines_and_line_endings_follow_python_text_mode() {
    let cases: &[&[u8]] = &[
        b"",
        b"\n\n",
        b"{\"a\":1}",
        b"{\"a\":1}\n\n  \n{\"b\":2}\n",
        b"{\"a\":1}\r\n{\"b\":2}\r\n",
        b"{\"a\":1}\r{\"b\":2}\r",
        b"{\"a\":1}\n\x0b\x0c\x1c\n\xc2\x85\xc2\xa0\xe3\x80\x80\n[1,2]\n",
        b"1\n\"x\"\nnull\n",
        b"{\"b\":1,\"a\":{\"d\":[1.0,2],\"c\":\"\xc3\xa9\"}}\n",
    ];
    for case in cases {
        let ours = materialized_digest(Cursor::new(case.to_vec()), 1).expect("digest");
        assert_eq!(
            ours.sha256,
            python_digest(case),
            "{:?}",
            String::from_utf8_lossy(case)
        );
    }
}

#[test]
fn a_malformed_line_is_an_error_naming_its_line() {
    let text = b"{\"a\":1}\n\n{\"b\":2}\r\n{\"c\":\n{\"d\":4}\n";
    for threads in [1, 2] {
        match materialized_digest(Cursor::new(text.to_vec()), threads) {
            Err(MaterializedError::Line { line, .. }) => assert_eq!(line, 4, "threads={threads}"),
            other => panic!("expected a line error, got {other:?}"),
        }
    }
    let invalid_utf8 = b"{\"a\":1}\n\xff\n";
    assert!(matches!(
        materialized_digest(Cursor::new(invalid_utf8.to_vec()), 1),
        Err(MaterializedError::Line { line: 2, .. })
    ));
    // A line Python would not treat as blank and cannot parse.
    let nbsp_prefix = "{\"a\":1}\n\u{a0}{\"b\":1}\n".as_bytes();
    assert!(matches!(
        materialized_digest(Cursor::new(nbsp_prefix.to_vec()), 1),
        Err(MaterializedError::Line { line: 2, .. })
    ));
}

#[test]
fn digests_agree_with_python_across_chunk_boundaries_and_threads() {
    // ~3 MiB of rows so that several 1 MiB chunks, CRLF endings and blank lines meet boundaries.
    let mut text = Vec::new();
    let mut i = 0u64;
    while text.len() < 3 * 1024 * 1024 + 17 {
        let ending: &[u8] = match i % 5 {
            0 => b"\r\n",
            1 => b"\n\n",
            _ => b"\n",
        };
        text.extend_from_slice(
            format!(
                "{{\"_ng_task_index\":{i},\"_ng_rollout_index\":0,\"prompt\":\"q\\u00e9 {i} \\\"x\\\"\",\"w\":{},\"z\":[{}e-3,null,true]}}",
                i * 7919 % 1000,
                i % 997
            )
            .as_bytes(),
        );
        text.extend_from_slice(ending);
        i += 1;
    }
    let expected = python_digest(&text);
    for threads in [1, 2, 3] {
        let result = materialized_digest(Cursor::new(text.clone()), threads).expect("digest");
        assert_eq!(result.sha256, expected, "threads={threads}");
        assert_eq!(result.rows, i);
        assert_eq!(result.bytes, text.len() as u64);
    }
}

#[test]
fn a_line_longer_than_a_chunk_and_lone_carriage_returns_are_handled() {
    let long = format!("{{\"text\":\"{}\"}}", "x".repeat(3 * 1024 * 1024));
    let text = format!("{long}\r{{\"a\":1}}\r{long}\n");
    let expected = python_digest(text.as_bytes());
    for threads in [1, 2] {
        assert_eq!(
            materialized_digest(Cursor::new(text.clone().into_bytes()), threads)
                .expect("digest")
                .sha256,
            expected
        );
    }
}

#[test]
fn a_read_error_is_reported_not_swallowed() {
    struct Failing(usize);
    impl std::io::Read for Failing {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.0 == 0 {
                return Err(std::io::Error::other("disk vanished"));
            }
            let n = buf.len().min(self.0);
            buf[..n].fill(b'\n');
            self.0 -= n;
            Ok(n)
        }
    }
    for threads in [1, 2] {
        match materialized_digest(Failing(3 * 1024 * 1024), threads) {
            Err(MaterializedError::Io(e)) => assert!(e.to_string().contains("disk vanished")),
            other => panic!("expected the read error, got {other:?}"),
        }
    }
}

/// Issue 9, item 13: a rows file whose lines Python's `str.strip()` treats as blank (`\x0b`,
/// `\xa0`, `\x85`, U+2003, `\x1c`) is read the same way by every reader of materialized inputs
/// (the rows a create and a validate see, the server selection, the plan's inventory) as by its
/// digest and by the collector (CPython is the oracle).
#[test]
fn item_13_python_blank_lines_are_skipped_by_every_reader_of_the_rows() {
    let rows = [
        "{\"_ng_task_index\": 0, \"_ng_rollout_index\": 0, \"agent_ref\": {\"name\": \"a\"}}",
        "{\"_ng_task_index\": 1, \"_ng_rollout_index\": 0, \"agent_ref\": {\"name\": \"b\"}}",
        "{\"_ng_task_index\": 2, \"_ng_rollout_index\": 0}",
    ];
    let text = format!(
        "{}\n\u{0b}\n\u{a0}\n{}\r\n\u{85}\n \u{2003} \n\u{1c}\n\r{}\n\t\n",
        rows[0], rows[1], rows[2]
    );
    let bytes = text.as_bytes();
    let python_rows: usize = String::from_utf8(python(
        "import sys\nprint(sum(1 for l in open('/dev/stdin', encoding='utf-8') if l.strip()))",
        bytes,
    ))
    .expect("utf8")
    .trim()
    .parse()
    .expect("count");
    assert_eq!(python_rows, 3);
    let read = recovery_core::rows::read_materialized(bytes, "rows").expect("the rows");
    assert_eq!(read.len(), python_rows);
    let inventory = recovery_core::plan::read_inventory(bytes, "rows", 2).expect("inventory");
    assert_eq!(inventory.len(), python_rows);
    let mut references = recovery_core::identity::RowReferences::default();
    recovery_core::rows::scan_materialized::<std::convert::Infallible>(bytes, "rows", |_, row| {
        references.add_row(&row);
        Ok(())
    })
    .expect("scan");
    assert_eq!(
        references,
        recovery_core::identity::RowReferences::from_rows(&read)
    );
    assert_eq!(
        materialized_digest(Cursor::new(bytes), 2)
            .expect("digest")
            .sha256,
        python_digest(bytes)
    );
}
