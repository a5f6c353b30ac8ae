//! The sidecar journal readers (attempt extensions, masked-rerun approvals, resubmit offsets)
//! over arbitrary bytes: never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use recovery_core::journals::{attempt_extension, rerun_masked_approvals, resubmit_offset};

fuzz_target!(|data: &[u8]| {
    let _ = attempt_extension(data, "fuzz_attempt_extension.jsonl");
    let _ = rerun_masked_approvals(data);
    let _ = resubmit_offset(data, "fuzz_resubmit_offset");
});
