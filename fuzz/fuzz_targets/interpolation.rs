//! OmegaConf interpolation over arbitrary strings: resolving a value that holds the input, in
//! a tree with other keys and an environment, never panics (grammar errors are errors).
#![no_main]

use libfuzzer_sys::fuzz_target;
use recovery_core::identity::interpolation::{Resolver, Segment};
use serde_json::json;
use std::collections::BTreeMap;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let root = json!({
        "value": text,
        "other": {"port": 8000, "name": "policy", "list": [1, "${other.port}"]},
        "self": "${value}",
    });
    let env = BTreeMap::from([("HOME".to_owned(), "/home/x".to_owned())]);
    for key in ["value", "self", "other"] {
        let _ = Resolver::new(&env).resolve_at(&root, &[Segment::Key(key.to_owned())]);
    }
});
