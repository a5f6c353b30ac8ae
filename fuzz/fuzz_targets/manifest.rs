//! Manifest reading over arbitrary bytes: never a panic; a manifest read back from what it
//! writes is the same manifest.
#![no_main]

use libfuzzer_sys::fuzz_target;
use recovery_core::manifest::RunManifest;

fuzz_target!(|data: &[u8]| {
    let _ = RunManifest::run_id_of(data);
    let Ok(manifest) = RunManifest::from_json_bytes(data) else {
        return;
    };
    let Ok(written) = manifest.to_pretty_json() else {
        return;
    };
    let again = RunManifest::from_json_bytes(written.as_bytes()).expect("a written manifest reads");
    assert_eq!(again.to_pretty_json().ok(), Some(written));
});
