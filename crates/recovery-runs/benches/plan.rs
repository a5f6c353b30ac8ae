//! Benchmark: the resume plan of a 100k-rollout run with 3 attempts each (two retryable failures
//! in the failures sidecar, then a graded result), as `GET /runs/{id}/plan` answers it: the plan
//! cache brings the run's index up to date and the summary (counts per state, coverage) and the
//! first page of 1,000 rollouts are taken. Reference measured in the same run: reading the same
//! files once (no parsing); a second one, printed above the table: CPython parsing every line of
//! them once (`json.loads`), what the Python module we replace pays before any plan; a third,
//! also above the table: one syntax-checking pass of serde_json over every line (nothing built,
//! the same threads the plan uses), the least any reader that checks its JSON pays. Rows:
//! - cold: a fresh cache each time (the files indexed from scratch); target <= 2x the reference;
//! - after 100 appended outcomes: the warm cache reads only the appended lines; target < 20 ms;
//! - unchanged: the warm cache again with nothing appended;
//! - the whole plan (every entry built), as the offline `plan` command prints it;
//! - cold with the files out of the page cache too (each evicted with
//!   `posix_fadvise(DONTNEED)` first), against reading them from the disk once: what a service
//!   restarted on another node after a preemption pays.
//!
//! Run: `cargo bench -p recovery-runs --bench plan` (`BENCH_ROLLOUTS` sets the size).

use recovery_core::manifest::RunManifest;
use recovery_runs::plans::{PlanCache, RunPlan};
use recovery_runs::runfiles::build_plan;
use recovery_sidecar::SidecarPaths;
use std::io::{BufWriter, Write};
use std::time::{Duration, Instant};

// The service's allocator, so the numbers are the service's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RUN_ID: &str = "0123456789abcdef0123456789abcdef";

fn result_row(task: usize, attempt: usize) -> String {
    format!(
        "{{\"_ng_task_index\":{task},\"_ng_rollout_index\":0,\"_ng_attempt_index\":{attempt},\"_ng_run_id\":\"{RUN_ID}\",\"reward\":1.0,\"response\":{{\"output\":[{{\"type\":\"message\",\"content\":\"the answer is {task}\"}}],\"status\":\"completed\"}}}}\n"
    )
}

fn failure_row(task: usize, attempt: usize) -> String {
    format!(
        "{{\"_ng_task_index\":{task},\"_ng_rollout_index\":0,\"_ng_attempt_index\":{attempt},\"_ng_run_id\":\"{RUN_ID}\",\"_ng_failure_class\":\"transport_peer_drop\",\"failure_kind\":\"transport_peer_drop\",\"error\":\"connection reset by peer\"}}\n"
    )
}

/// A second reference: what the Python collector pays merely to parse the same files once
/// (`json.loads` of every line, `json.load` of the manifest), timed inside the interpreter,
/// best of 3. `None` without a `python3`.
fn cpython_parse_once(files: &[&std::path::PathBuf]) -> Option<Duration> {
    const SCRIPT: &str = r#"
import json, sys, time
best = None
for _ in range(3):
    start = time.perf_counter()
    for path in sys.argv[1:]:
        with open(path, 'rb') as f:
            if path.endswith('.json'):
                json.load(f)
            else:
                for line in f:
                    if line.strip():
                        json.loads(line)
    took = time.perf_counter() - start
    best = took if best is None else min(best, took)
print(best)
"#;
    let output = std::process::Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .args(files)
        .output()
        .ok()?;
    let seconds = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse::<f64>();
    let Ok(seconds) = seconds else {
        panic!(
            "the CPython reference failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    Some(Duration::from_secs_f64(seconds))
}

/// The third reference: every line of the JSONL files (and the manifest) checked as JSON once by
/// serde_json, nothing built (`IgnoredAny`), each file's lines split at a line end between as
/// many threads as the plan uses. Best of 3.
fn json_pass_once(files: &[&std::path::PathBuf], threads: usize) -> Duration {
    fn check_lines(bytes: &[u8]) {
        for line in bytes.split(|&b| b == b'\n') {
            if !line.is_empty() {
                serde_json::from_slice::<serde::de::IgnoredAny>(line).expect("a JSON line");
            }
        }
    }
    let contents: Vec<(bool, Vec<u8>)> = files
        .iter()
        .map(|path| {
            let jsonl = path.extension().is_some_and(|e| e == "jsonl");
            (jsonl, std::fs::read(path).expect("read"))
        })
        .collect();
    best_of(3, || {
        for (jsonl, bytes) in &contents {
            if !jsonl {
                serde_json::from_slice::<serde::de::IgnoredAny>(bytes).expect("a JSON document");
                continue;
            }
            let mut parts = Vec::with_capacity(threads);
            let mut rest = bytes.as_slice();
            for left in (1..=threads).rev() {
                let target = rest.len() / left;
                let end =
                    memchr::memchr(b'\n', &rest[target..]).map_or(rest.len(), |at| target + at + 1);
                let (part, tail) = rest.split_at(end);
                parts.push(part);
                rest = tail;
            }
            std::thread::scope(|scope| {
                for part in parts {
                    scope.spawn(move || check_lines(part));
                }
            });
        }
    })
}

fn write_lines(path: &std::path::Path, lines: impl Iterator<Item = String>) {
    let mut file = BufWriter::new(std::fs::File::create(path).expect("create"));
    for line in lines {
        file.write_all(line.as_bytes()).expect("write");
    }
    file.flush().expect("flush");
}

/// Asks the kernel to drop the files' pages from its cache (clean pages go; needs no
/// privilege), so the next read comes from the disk.
fn evict(files: &[&std::path::PathBuf]) {
    for path in files {
        let file = std::fs::File::open(path).expect("open");
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).expect("fadvise");
    }
}

/// User and system CPU time of this process so far, every thread's (`/proc/self/stat`, in
/// clock ticks of 10 ms: read over several plans).
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // The fields after the command name (which may hold spaces) start with the state, field 3.
    let fields: Vec<&str> = stat[stat.rfind(')').expect("comm") + 2..]
        .split(' ')
        .collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    Duration::from_millis(ticks * 10)
}

fn best_of(runs: usize, mut work: impl FnMut()) -> Duration {
    (0..runs)
        .map(|_| {
            let started = Instant::now();
            work();
            started.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn main() {
    let rollouts: usize = std::env::var("BENCH_ROLLOUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().expect("temp dir");
    let paths = SidecarPaths::for_output(&dir.path().join("out.jsonl"));
    write_lines(
        &paths.materialized,
        (0..rollouts).map(|t| {
            format!("{{\"_ng_task_index\":{t},\"_ng_rollout_index\":0,\"question\":\"{t}+1?\"}}\n")
        }),
    );
    let digest = recovery_runs::runfiles::digest_rows_file(&paths.materialized).expect("digest");
    let mut manifest = RunManifest::create(RUN_ID, "s", digest, "c", Some(3));
    for t in 0..rollouts {
        manifest.next_attempt.insert(format!("{t}-0"), 3);
    }
    std::fs::write(&paths.manifest, manifest.to_pretty_json().expect("json")).expect("manifest");
    write_lines(
        &paths.failures,
        (0..rollouts).flat_map(|t| [failure_row(t, 0), failure_row(t, 1)]),
    );
    // The last 100 results arrive after the first plan.
    write_lines(&paths.output, (0..rollouts - 100).map(|t| result_row(t, 2)));
    let files = [
        &paths.materialized,
        &paths.manifest,
        &paths.failures,
        &paths.output,
    ];
    let megabytes: f64 = files
        .iter()
        .map(|p| std::fs::metadata(p).expect("size").len() as f64 / 1e6)
        .sum();
    println!("plan benchmark: {rollouts} rollouts x 3 attempts, {megabytes:.1} MB of files");
    let read_once = best_of(3, || {
        for path in files {
            std::hint::black_box(std::fs::read(path).expect("read"));
        }
    });
    // What `GET /runs/{id}/plan` computes: the summary and the first page.
    let answer = |plan: &RunPlan<'_>| {
        let view = plan.view();
        let summary = plan.summary();
        let (positions, _) = summary.positions(None, None, 1000);
        let page: Vec<_> = positions.into_iter().map(|p| view.entry(p)).collect();
        std::hint::black_box(page);
        summary.coverage.successful
    };
    let mut scored = 0;
    // `BENCH_PROFILE_COLD=N`: only N cold plans (to profile them), no table.
    if let Some(runs) = std::env::var("BENCH_PROFILE_COLD")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        let cpu_before = process_cpu();
        let cold = best_of(runs, || {
            PlanCache::default()
                .with_plan(&paths, 3, answer)
                .expect("plan");
        });
        let cpu = (process_cpu() - cpu_before) / runs as u32;
        println!(
            "plan, cold: best of {runs}: {:.1} ms; CPU (every thread) per plan {:.1} ms",
            cold.as_secs_f64() * 1e3,
            cpu.as_secs_f64() * 1e3
        );
        return;
    }
    let cold = best_of(3, || {
        scored = PlanCache::default()
            .with_plan(&paths, 3, answer)
            .expect("plan");
    });
    assert_eq!(scored, (rollouts - 100) as u64);
    // The index of the materialized inputs is trusted without hashing them again only once
    // they have been unchanged for 2 s (`recovery_runs::cache::SETTLE`); they are written when
    // the run is created, long before a resume's plan, so the warm rows are timed after that.
    let age = std::fs::metadata(&paths.materialized)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|modified| modified.elapsed().ok())
        .unwrap_or_default();
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(age));
    let cache = PlanCache::default();
    cache.with_plan(&paths, 3, answer).expect("plan");
    let mut output = std::fs::OpenOptions::new()
        .append(true)
        .open(&paths.output)
        .expect("output");
    for t in rollouts - 100..rollouts {
        output
            .write_all(result_row(t, 2).as_bytes())
            .expect("append");
    }
    drop(output);
    let started = Instant::now();
    scored = cache.with_plan(&paths, 3, answer).expect("plan");
    let after_append = started.elapsed();
    assert_eq!(scored, rollouts as u64);
    let unchanged = best_of(3, || {
        scored = cache.with_plan(&paths, 3, answer).expect("plan");
    });
    let read_from_disk = best_of(3, || {
        evict(&files);
        for path in files {
            std::hint::black_box(std::fs::read(path).expect("read"));
        }
    });
    let cold_from_disk = best_of(3, || {
        evict(&files);
        PlanCache::default()
            .with_plan(&paths, 3, answer)
            .expect("plan");
    });
    let whole = best_of(1, || {
        let (_, plan) = build_plan(&paths, 3).expect("plan");
        scored = plan.coverage.successful;
    });
    assert_eq!(scored, rollouts as u64);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let json_pass = json_pass_once(&files, threads);
    println!(
        "third reference: serde_json checking every line of the same files once (nothing built, \
         {threads} threads, best of 3): {:.1} ms = {:.2} x reading them; plan, cold = {:.2} x that",
        ms(json_pass),
        json_pass.as_secs_f64() / read_once.as_secs_f64(),
        cold.as_secs_f64() / json_pass.as_secs_f64()
    );
    match cpython_parse_once(&files) {
        Some(parse) => println!(
            "second reference: CPython parsing every line of the same files once (json.loads, \
             best of 3): {:.1} ms; plan, cold = {:.2} x that",
            ms(parse),
            cold.as_secs_f64() / parse.as_secs_f64()
        ),
        None => println!("second reference: python3 not found, CPython parse not measured"),
    }
    println!("| measurement | time | ratio to reading the files once |");
    println!("| --- | --- | --- |");
    println!(
        "| read the files once (reference) | {:.1} ms | 1.00 |",
        ms(read_once)
    );
    println!(
        "| plan, cold | {:.1} ms | {:.2} |",
        ms(cold),
        cold.as_secs_f64() / read_once.as_secs_f64()
    );
    println!(
        "| plan after 100 appended outcomes (warm cache) | {:.1} ms | {:.2} |",
        ms(after_append),
        after_append.as_secs_f64() / read_once.as_secs_f64()
    );
    println!(
        "| plan, nothing appended (warm cache) | {:.1} ms | {:.2} |",
        ms(unchanged),
        unchanged.as_secs_f64() / read_once.as_secs_f64()
    );
    println!(
        "| read the files once from the disk (second reference) | {:.1} ms | 1.00 |",
        ms(read_from_disk)
    );
    println!(
        "| plan, cold, files not in the page cache | {:.1} ms | {:.2} x the disk read |",
        ms(cold_from_disk),
        cold_from_disk.as_secs_f64() / read_from_disk.as_secs_f64()
    );
    println!(
        "| whole plan, every entry (offline CLI) | {:.1} ms | {:.2} |",
        ms(whole),
        whole.as_secs_f64() / read_once.as_secs_f64()
    );
}
