//! The row readers behind classification and the plan, over arbitrary JSONL: never a panic;
//! the streaming materialized digest agrees with the digest of the rows read one by one.
#![no_main]

use libfuzzer_sys::fuzz_target;
use recovery_core::facts::RowFacts;
use recovery_core::failure::ClassificationPolicy;
use recovery_core::plan::{OutcomeRow, classify_facts, read_inventory};

fuzz_target!(|data: &[u8]| {
    let policy = ClassificationPolicy::default();
    for line in data.split(|b| *b == b'\n') {
        if let Ok(Some(facts)) = RowFacts::from_line(line) {
            let _ = classify_facts(&facts, &policy, false);
            let _ = classify_facts(&facts, &policy, true);
        }
        let _ = OutcomeRow::parse(line, &policy, false);
    }
    let _ = read_inventory(data, "fuzz", 2);
    let streamed = recovery_core::materialized::materialized_digest(data, 2);
    let read = recovery_core::rows::read_materialized(data, "fuzz");
    if let (Ok(streamed), Ok(rows)) = (streamed, read) {
        let tree = serde_json::Value::Array(rows);
        assert_eq!(
            recovery_core::canonical::digest(&tree).ok().as_deref(),
            Some(streamed.sha256.as_str()),
            "one digest, streamed or read whole"
        );
    }
});
