//! Benchmark: classifying a generated ~200 MB failures sidecar (every row parsed and run through
//! every predicate), on 1 thread and on all cores, each in a fresh child process. As a reference in
//! the same run it also times parsing alone (serde_json, one thread): the classifier's overhead is
//! the difference. Target on the 2-core machines: >= 200 MB/s classified.
//!
//! Run: `cargo bench -p recovery-core --bench classify_failures` (`BENCH_MB` sets the size).

use recovery_core::classify::classify_jsonl;
use recovery_core::failure::ClassificationPolicy;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--child-classify") {
        let threads: usize = args[at + 2].parse().expect("threads");
        let file = std::fs::File::open(&args[at + 1]).expect("file");
        let summary = classify_jsonl(
            file,
            "failures",
            threads,
            &ClassificationPolicy::default(),
            false,
            |_, _| {},
        )
        .expect("classify");
        println!("{}", summary.rows);
        return;
    }
    let megabytes: usize = std::env::var("BENCH_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("out_failures.jsonl");
    let rows = generate(&path, megabytes * 1_000_000);
    let mb = std::fs::metadata(&path).expect("size").len() as f64 / 1e6;
    println!("failures classification benchmark: {rows} rows, {mb:.1} MB");
    let parse = parse_only(&path);
    println!(
        "  serde_json parse only, 1 thread       {:8.1} MB/s",
        mb / parse.as_secs_f64()
    );
    let exe = std::env::current_exe().expect("bench binary");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut best_all = Duration::MAX;
    for threads in [1, cores] {
        let best = (0..3)
            .map(|_| {
                let start = Instant::now();
                let output = Command::new(&exe)
                    .arg("--child-classify")
                    .arg(&path)
                    .arg(threads.to_string())
                    .output()
                    .expect("child");
                assert!(output.status.success(), "child failed");
                assert_eq!(
                    String::from_utf8_lossy(&output.stdout).trim(),
                    rows.to_string(),
                    "every row classified"
                );
                start.elapsed()
            })
            .min()
            .expect("runs");
        best_all = best_all.min(best);
        println!(
            "  classified, {threads} thread(s)              {:8.1} MB/s  (best of 3)",
            mb / best.as_secs_f64()
        );
    }
    println!(
        "  ratio: classification on all cores runs at {:.2}x single-thread parse speed",
        parse.as_secs_f64() / best_all.as_secs_f64()
    );
}

fn parse_only(path: &Path) -> Duration {
    let mut reader = BufReader::with_capacity(1 << 20, std::fs::File::open(path).expect("open"));
    let mut line = Vec::new();
    let start = Instant::now();
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line).expect("read") == 0 {
            break;
        }
        let value: serde_json::Value = serde_json::from_slice(&line).expect("parse");
        std::hint::black_box(value);
    }
    start.elapsed()
}

/// Failure rows as collectors write them: canonical records, captured calls, failure events,
/// partial responses and diagnostics, in a realistic mix of kinds.
fn generate(path: &Path, target: usize) -> u64 {
    let mut out = BufWriter::with_capacity(1 << 20, std::fs::File::create(path).expect("create"));
    let kinds = [
        "agent_timeout",
        "session_lost",
        "agent_run_error",
        "transport_peer_drop",
        "provider_oom_killed",
        "judge_failed",
        "kill_shaped",
        "timeout_exceeded",
    ];
    let (mut written, mut row) = (0usize, 0u64);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    while written < target {
        let kind = kinds[(next() % kinds.len() as u64) as usize];
        let calls: Vec<String> = (0..(1 + next() % 6))
            .map(|i| {
                let category = ["null", "\"upstream_error\"", "\"timeout\"", "null", "\"connection\""][(next() % 5) as usize];
                format!("{{\"status_code\":{},\"error_category\":{category},\"started_at\":{}.{},\"duration_ms\":{}}}", [200, 500, 429, 200][(next() % 4) as usize], 1_764_000_000 + i * 7, next() % 1000, next() % 30_000)
            })
            .collect();
        let task = row / 4;
        let line = format!(
            "{{\"_ng_task_index\":{task},\"_ng_rollout_index\":{r},\"_ng_attempt_index\":0,\"_ng_run_id\":\"0123456789abcdef0123456789abcdef\",\"_ng_failure_class\":\"{kind}\",\"_ng_failure_terminal\":false,\"_ng_failure_message\":\"agent stopped: {kind} after retries\",\"error\":\"agent stopped\",\"elapsed_seconds\":{e},\"_ng_failure_record\":{{\"schema_version\":1,\"episode_id\":{{\"rollout_id\":\"{task}-{r}\",\"attempt\":0}},\"run_id\":\"0123456789abcdef0123456789abcdef\",\"source\":\"environment\",\"delivery\":\"delivered\",\"failure\":{{\"failure_reason\":\"{kind} in the agent stage\",\"terminal\":false,\"failure_kind\":\"{kind}\",\"stage\":\"agent\"}},\"http_status\":null,\"exception_type\":null}},\"_ng_collected_model_calls\":[{calls}],\"ng_failure_events\":[{{\"failure_id\":\"f{row}\",\"failure_kind\":\"{kind}\",\"stage\":\"{stage}\",\"http_status\":null}}],\"_ng_selected_failure_id\":\"f{row}\",\"_ng_failure_partial_response\":{{\"output\":[{{\"type\":\"message\",\"content\":[{{\"type\":\"output_text\",\"text\":\"partial answer {row} with some reasoning text that goes on for a while\"}}]}}],\"status\":\"incomplete\"}},\"question\":\"What is {row} times {task}?\"}}\n",
            r = row % 4,
            e = 1 + next() % 900,
            calls = calls.join(","),
            stage = ["agent", "seed", "cleanup"][(next() % 3) as usize],
        );
        out.write_all(line.as_bytes()).expect("write");
        written += line.len();
        row += 1;
    }
    out.flush().expect("flush");
    row
}
