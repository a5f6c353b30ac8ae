//! Canonical JSON over arbitrary bytes: never a panic; whatever canonicalizes parses to a tree
//! with the same digest, passes the depth pre-check, and is a fixed point of canonicalization.
#![no_main]

use libfuzzer_sys::fuzz_target;
use recovery_core::canonical::{canonicalize_text, check_depth, digest, digest_text, parse_json};

fuzz_target!(|data: &[u8]| {
    let mut canonical = Vec::new();
    if canonicalize_text(data, &mut canonical).is_err() {
        return;
    }
    assert!(check_depth(data).is_ok(), "canonical text within the depth limit");
    let tree = parse_json(data).expect("canonicalizable text parses");
    let from_text = digest_text(data).expect("digest of the text");
    assert_eq!(digest(&tree).expect("digest of the tree"), from_text);
    let mut again = Vec::new();
    canonicalize_text(&canonical, &mut again).expect("canonical text canonicalizes");
    assert_eq!(again, canonical, "canonicalization is idempotent");
});
