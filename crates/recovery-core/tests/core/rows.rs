//! Reading saved JSONL: torn tails, malformed lines, non-objects, blank lines; rollout ids.

use proptest::prelude::*;
use recovery_core::rows::{JsonlError, lines_with_ends, logical_rollout_id, read_jsonl};
use serde_json::json;

#[test]
fn scenario_35_a_torn_final_line_is_reported_and_a_terminated_one_is_an_error() {
    let torn = "{\"a\":1}\n\n{\"b\":2}\n{\"reward\":";
    let (records, summary) = read_jsonl(torn.as_bytes(), "out.jsonl").expect("readable");
    assert_eq!(records.iter().map(|r| r.line).collect::<Vec<_>>(), [1, 3]);
    let tail = summary.torn_tail.expect("torn tail reported");
    assert_eq!((tail.line, tail.offset, tail.length), (4, 17, 10));
    match read_jsonl(format!("{torn}\n").as_bytes(), "out.jsonl") {
        Err(JsonlError::Malformed { path, line, .. }) => {
            assert_eq!((path.as_str(), line), ("out.jsonl", 4))
        }
        other => panic!("{other:?}"),
    }
    let complete_tail = "{\"a\":1}\n{\"b\":2}";
    let (records, summary) = read_jsonl(complete_tail.as_bytes(), "x").expect("readable");
    assert_eq!(
        (records.len(), summary.torn_tail),
        (2, None),
        "a parseable unterminated line is a record"
    );
    assert!(matches!(
        read_jsonl("[1]\n".as_bytes(), "x"),
        Err(JsonlError::NotAnObject { line: 1, .. })
    ));
    assert!(matches!(
        read_jsonl("{\"a\":NaN}\n".as_bytes(), "x"),
        Err(JsonlError::Malformed { .. })
    ));
    let (records, _) =
        read_jsonl(" \t\r\n{\"a\":1}\r\n".as_bytes(), "x").expect("blank lines and CRLF");
    assert_eq!(
        (
            records.len(),
            records[0].line,
            records[0].offset,
            records[0].length
        ),
        (1, 2, 4, 9)
    );
}

#[test]
fn logical_rollout_ids_follow_the_identity_rules() {
    let table = [
        (
            json!({"_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_attempt_index": 2}),
            Ok("3-1"),
        ),
        (
            json!({"_ng_rollout_id": "task.A_b-1", "_ng_task_index": 3}),
            Ok("task.A_b-1"),
        ),
        (
            json!({"_ng_rollout_id": null, "_ng_task_index": 0, "_ng_rollout_index": 0}),
            Ok("0-0"),
        ),
        (
            json!({"_ng_rollout_id": "x-a2"}),
            Err("reserved attempt suffix"),
        ),
        (json!({"_ng_rollout_id": "x-a0"}), Ok("x-a0")),
        (
            json!({"_ng_rollout_id": "../bad"}),
            Err("Invalid rollout identity"),
        ),
        (
            json!({"_ng_rollout_id": ""}),
            Err("Invalid rollout identity"),
        ),
        (
            json!({"_ng_rollout_id": 5}),
            Err("Invalid rollout identity"),
        ),
        (json!({"_ng_task_index": 3}), Err("requires a rollout id")),
        (
            json!({"_ng_task_index": true, "_ng_rollout_index": 0}),
            Err("requires a rollout id"),
        ),
    ];
    for (row, expected) in table {
        match (logical_rollout_id(&row), expected) {
            (Ok(id), Ok(want)) => assert_eq!(id, want, "{row}"),
            (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{row}: {e}"),
            (got, want) => panic!("{row}: got {got:?}, want {want:?}"),
        }
    }
}

/// A refused line's reason is placed within that line (hostile review 39: an error at a line's
/// `\n` read "at line 2 column 0" inside a message naming the line's place in its file).
#[test]
fn a_refused_line_is_placed_by_its_column_or_its_end() {
    for (line, expected) in [
        (
            &b"{\"question\": \"cut short\n"[..],
            "at the end of the line",
        ),
        (&b"{\"a\": tru}\n"[..], "expected ident at column 10"),
        (&b"{\"a\": 1} x"[..], "trailing characters at column 10"),
    ] {
        let message = recovery_core::rows::parse_line(line).expect_err("refused");
        assert!(
            message.ends_with(expected) && !message.contains(" at line "),
            "{}: {message}",
            String::from_utf8_lossy(line)
        );
    }
}

/// Hostile review 45: a saved line of one vertical tab stopped the plan, where the module
/// (binary reading, `bytes.strip()`) skips it. Every one-byte line, and the two-byte UTF-8 of a
/// no-break space, is blank here exactly when CPython's `bytes.strip()` leaves nothing; and a
/// JSONL file holding each blank line CPython skips reads as its one record.
#[test]
fn a_line_is_blank_exactly_when_python_bytes_strip_leaves_nothing() {
    let mut lines: Vec<Vec<u8>> = (0u8..=255).map(|b| vec![b]).collect();
    lines.push("\u{a0}".as_bytes().to_vec());
    lines.push(b" \x0b\t\x0c\r ".to_vec());
    let input: Vec<u8> = lines
        .iter()
        .flat_map(|line| {
            let mut hex = line
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                .into_bytes();
            hex.push(b'\n');
            hex
        })
        .collect();
    let python = crate::support::python(
        "import sys\nfor l in sys.stdin.read().split():\n    print(int(not bytes.fromhex(l).strip()))",
        &input,
    );
    let python: Vec<bool> = String::from_utf8(python)
        .expect("utf8")
        .lines()
        .map(|l| l == "1")
        .collect();
    assert_eq!(python.len(), lines.len());
    for (line, python_blank) in lines.iter().zip(&python) {
        assert_eq!(
            recovery_core::rows::is_blank(line),
            *python_blank,
            "{line:?}"
        );
    }
    let blank: Vec<u8> = lines
        .iter()
        .zip(&python)
        .filter(|(_, blank)| **blank)
        .flat_map(|(line, _)| line.iter().copied().chain([b'\n']))
        .collect();
    let file = [blank.as_slice(), b"{\"a\":1}\n"].concat();
    let (records, _) = read_jsonl(file.as_slice(), "out.jsonl").expect("blank lines skipped");
    assert_eq!(records.len(), 1);
}

proptest! {
    /// The memchr line splitter every JSONL chunk reader uses cuts exactly where the standard
    /// library's `split_inclusive` does, an unterminated tail and empty lines included.
    #[test]
    fn lines_with_ends_cut_where_split_inclusive_cuts(
        bytes in prop::collection::vec(prop::sample::select(vec![b'\n', b'\n', b'a', b' ', b'{', b'\r']), 0..64)
    ) {
        let ours: Vec<&[u8]> = lines_with_ends(&bytes).collect();
        let std: Vec<&[u8]> = bytes.split_inclusive(|&b| b == b'\n').collect();
        prop_assert_eq!(ours, std);
    }
}
