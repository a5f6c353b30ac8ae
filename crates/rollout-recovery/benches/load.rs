//! Load benchmark ("speed at scale"): the real release service (`rollout-recovery serve`, a fresh
//! data directory and process per scenario, with operator/collector/viewer tokens) driven over
//! loopback keep-alive connections, and in the same run an axum hello-world peer (this binary
//! re-executed with `LOAD_BENCH_HELLO=1`, in its own process: `POST /` parses a ~2.4 KB JSON body
//! into `serde_json::Value` and answers a small JSON) driven the same way, so every number comes
//! with the ratio to what this machine does over HTTP at all.
//!
//! Run everything, or name scenarios:
//!
//! ```text
//! cargo bench -p rollout-recovery --bench load
//! cargo bench -p rollout-recovery --bench load -- validate-1mb
//! LOAD_SECS=3 LOAD_CONNS=16 cargo bench -p rollout-recovery --bench load -- drift-64x8 plan-100k
//! ```
//!
//! Scenarios:
//! - `validate-1mb`, `validate-100mb`, `validate-1gb`: `POST /runs/{id}/validate` answering `reuse`, for a run of
//!   20 rows whose source dataset is 1 MB / 100 MB / 1 GB (the load starts once the dataset is 2 s old,
//!   when the service trusts its cached digest; the first, cold validate is a note);
//! - `validate-rows-1000`: the same with the run's 1,000 rows inline in every validate;
//! - `drift-64x8`: every validate resumes across operational drift (a per-request sandbox port),
//!   connections spread over 8 runs: one fsynced journal line and one drift event each; the notes
//!   compare events/s with this disk's single-writer append+fdatasync rate (~2 s probe);
//! - `drift-query`: `LOAD_DRIFT_EVENTS` journal lines written beside 4 runs in the documented
//!   format, `POST /reindex` timed (lines/s), then three rows: `/drift?key=<rare key>` (1 line in
//!   1,000 has it), `/drift?run_id=..&limit=1000`, and a `cursor` page halfway down the history;
//! - `classify-1mb`: `POST /classify` with ~1 MB of rows of every kind (MB/s in the notes);
//! - `plan-100k`: a run of 100,000 rollouts created inline, 3 attempts reserved through the API
//!   (two counted failures in the failures sidecar, a scored result in the results file, 500 left
//!   missing); `GET /runs/{id}/plan` once cold, against reading the run's files once, then five
//!   times, each after appending 100 of the missing results (median and max), then under load.
//!
//! Settings (environment): `LOAD_SECS` (10) seconds of load per row; `LOAD_CONNS` (64) concurrent
//! keep-alive connections; `LOAD_TIMEOUT_SECS` (30) bound of one load request (a timeout is an
//! error); `LOAD_SETUP_TIMEOUT_SECS` (600) bound of one set-up call (create, reserve, reindex, the
//! single plan timings); `LOAD_DRIFT_EVENTS` (1000000); `LOAD_PLAN_CONNS` (`LOAD_CONNS`, at most 4:
//! each concurrent 100k-rollout plan holds hundreds of MB); `LOAD_RSS_LIMIT_MB` (4096): a load
//! stops issuing requests once the service's RSS passes it; `LOAD_DIR` (the system temp dir):
//! where data directories and datasets are made, i.e. the disk measured. Every request is bounded
//! and every loop ends at its deadline; the temp directories are removed at the end.
//!
//! Columns of the summary table:
//! - `conns`: concurrent connections, each a tokio task with its own keep-alive reqwest client;
//! - `secs`: wall time from the first request until the last in-flight one finished;
//! - `req/s`: 2xx answers carrying the expected body, per second of `secs`;
//! - `p50 ms`, `p99 ms`: latency of those successful requests;
//! - `errors(t/o)`: non-2xx answers, unexpected bodies, transport errors and timeouts (of which
//!   timeouts in parentheses); samples are listed in the notes;
//! - `hz p99`: p99 of `GET /healthz` sampled every 25 ms on one more connection, from its own
//!   thread and runtime, during the load (target < 10 ms). The load generator shares the machine's
//!   cores with the server, so the hello-world row's value is this machine's floor;
//! - `rss idle/peak/aft`: the server's VmRSS in MB before the load, the largest sampled (every
//!   100 ms) during it, and one second after it. VmRSS includes the pages of the SQLite file the
//!   service maps (clean, file-backed page cache); each scenario's notes end with RssAnon, what
//!   the process itself holds, and RssFile;
//! - `x hello`: req/s divided by the hello-world peer's req/s (measured with `LOAD_CONNS`);
//! - `cpu us/ok`: the server process's CPU time (user + system, from `/proc/PID/stat`, 10 ms
//!   ticks) over the load divided by its successful answers, and then `x hello`: that divided by
//!   the hello-world peer's. On a machine whose neighbours take cores now and then, req/s moves
//!   with them while the CPU per answer stays put: it is the number to compare across runs.
//!
//! Scenario-specific numbers (set-up timings, fsync rate and ratio, reindex lines/s, MB/s, plan
//! timings, journal line counts, WARN/ERROR lines the service logged) are notes under the table.

use axum::body::Bytes;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rollout-recovery");
const OPERATOR: &str = "operator-token-0123456789";
const COLLECTOR: &str = "collector-token-0123456789";
const VIEWER: &str = "viewer-token-0123456789";
const SECRET: &str = "sk-live-S3CR3T-value";
const SCENARIOS: [&str; 8] = [
    "validate-1mb",
    "validate-100mb",
    "validate-1gb",
    "validate-rows-1000",
    "drift-64x8",
    "drift-query",
    "classify-1mb",
    "plan-100k",
];
const DRIFT_KEY: &str = "servers.math_agent.responses_api_agents.simple_agent.sandbox.sandbox_port";
const RARE_KEY: &str = "servers.math_agent.responses_api_agents.simple_agent.rate_limit";

type BenchResult<T> = Result<T, String>;

fn main() {
    if std::env::var("LOAD_BENCH_HELLO").as_deref() == Ok("1") {
        hello_server();
        return;
    }
    // `cargo bench` passes `--bench`; every other non-flag argument names a scenario.
    let names: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for name in &names {
        if !SCENARIOS.contains(&name.as_str()) {
            eprintln!(
                "unknown scenario {name:?}; scenarios: {}",
                SCENARIOS.join(", ")
            );
            std::process::exit(2);
        }
    }
    let selected: Vec<&str> = SCENARIOS
        .iter()
        .copied()
        .filter(|s| names.is_empty() || names.iter().any(|n| n == s))
        .collect();
    let settings = Settings::from_env();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(settings, selected));
}

#[derive(Debug, Clone)]
struct Settings {
    secs: f64,
    conns: usize,
    plan_conns: usize,
    timeout: Duration,
    setup_timeout: Duration,
    drift_events: usize,
    rss_limit_kb: u64,
    base: PathBuf,
}

impl Settings {
    fn from_env() -> Self {
        fn var<T: std::str::FromStr>(name: &str, default: T) -> T {
            match std::env::var(name) {
                Ok(text) => text.trim().parse().unwrap_or_else(|_| {
                    eprintln!("{name}={text:?} is not valid; using the default");
                    default
                }),
                Err(_) => default,
            }
        }
        let conns = var("LOAD_CONNS", 64usize).max(1);
        Self {
            secs: var("LOAD_SECS", 10.0f64).max(0.1),
            conns,
            // One plan of 100k rollouts takes seconds of CPU and hundreds of MB: with 64 at once
            // on 2 cores most wait past any reasonable timeout, so few connections by default.
            plan_conns: var("LOAD_PLAN_CONNS", conns.min(4)).max(1),
            timeout: Duration::from_secs_f64(var("LOAD_TIMEOUT_SECS", 30.0f64).max(0.1)),
            setup_timeout: Duration::from_secs_f64(
                var("LOAD_SETUP_TIMEOUT_SECS", 600.0f64).max(1.0),
            ),
            drift_events: var("LOAD_DRIFT_EVENTS", 1_000_000usize),
            rss_limit_kb: var("LOAD_RSS_LIMIT_MB", 4096u64) * 1024,
            base: std::env::var_os("LOAD_DIR").map_or_else(std::env::temp_dir, PathBuf::from),
        }
    }
}

async fn run(settings: Settings, selected: Vec<&str>) {
    println!(
        "load benchmark: {} connections x {:.1} s per row, request timeout {:.0} s, scenarios: {}",
        settings.conns,
        settings.secs,
        settings.timeout.as_secs_f64(),
        selected.join(" ")
    );
    let mut report = Report::default();
    match Hello::start() {
        Ok(hello) => {
            let body = hello_body();
            println!("hello-world peer: POST / with a {} B JSON body", body.len());
            let endpoint = format!("{}/", hello.url);
            let make: MakeRequest = Arc::new(move |client, _, _| {
                client
                    .post(&endpoint)
                    .header("content-type", "application/json")
                    .body(body.clone())
            });
            let load = Load::new("hello-world (axum)", &settings, settings.conns);
            let result = run_load(&load, &hello.url, Some(hello.pid()), make, &settings).await;
            report.hello_rps = Some(result.rps());
            report.hello_cpu_per_ok = result.cpu_per_ok();
            result.print();
            report.rows.push(result);
            hello.stop();
        }
        Err(e) => report.note(format!("hello-world peer did not start: {e}")),
    }
    for name in selected {
        println!("\n== {name}");
        let dir = match tempfile::Builder::new()
            .prefix("rr-load-")
            .tempdir_in(&settings.base)
        {
            Ok(dir) => dir,
            Err(e) => {
                report.note(format!(
                    "{name}: no temp dir under {:?}: {e}",
                    settings.base
                ));
                continue;
            }
        };
        let outcome = match name {
            "validate-1mb" => validate_source(&settings, dir.path(), &mut report, 1, name).await,
            "validate-100mb" => {
                validate_source(&settings, dir.path(), &mut report, 100, name).await
            }
            "validate-1gb" => validate_source(&settings, dir.path(), &mut report, 1000, name).await,
            "validate-rows-1000" => validate_rows(&settings, dir.path(), &mut report).await,
            "drift-64x8" => drift_writes(&settings, dir.path(), &mut report).await,
            "drift-query" => drift_query(&settings, dir.path(), &mut report).await,
            "classify-1mb" => classify(&settings, dir.path(), &mut report).await,
            "plan-100k" => plan(&settings, dir.path(), &mut report).await,
            _ => Ok(()),
        };
        if let Err(e) = outcome {
            report.note(format!("{name}: FAILED: {e}"));
        }
        // `dir` (datasets, data directory, logs) is removed here.
    }
    report.print();
}

// --- report -----------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Report {
    hello_rps: Option<f64>,
    hello_cpu_per_ok: Option<f64>,
    rows: Vec<LoadResult>,
    notes: Vec<String>,
}

impl Report {
    fn note(&mut self, text: String) {
        println!("  note: {text}");
        self.notes.push(text);
    }

    fn push(&mut self, result: LoadResult) {
        result.print();
        for sample in &result.samples {
            self.notes
                .push(format!("{}: error sample: {sample}", result.name));
        }
        if let Some(reason) = &result.aborted {
            self.notes
                .push(format!("{}: stopped early: {reason}", result.name));
        }
        self.rows.push(result);
    }

    fn print(&self) {
        println!("\n== summary");
        println!(
            "{:<26} {:>5} {:>6} {:>9} {:>9} {:>9} {:>13} {:>8} {:>17} {:>8} {:>9} {:>8}",
            "scenario",
            "conns",
            "secs",
            "req/s",
            "p50 ms",
            "p99 ms",
            "errors(t/o)",
            "hz p99",
            "rss idle/peak/aft",
            "x hello",
            "cpu us/ok",
            "x hello"
        );
        for row in &self.rows {
            let ratio = match self.hello_rps {
                Some(hello) if hello > 0.0 => format!("{:.4}", row.rps() / hello),
                _ => "-".into(),
            };
            let errors = format!("{}({})", row.errors, row.timeouts);
            let rss = format!(
                "{}/{}/{}",
                mb(row.rss_idle_kb),
                mb(row.rss_peak_kb),
                mb(row.rss_after_kb)
            );
            let p50 = ms(percentile(&row.latencies_us, 0.50));
            let p99 = ms(percentile(&row.latencies_us, 0.99));
            let health = ms(percentile(&row.health_us, 0.99));
            let cpu_per_ok = cpu(row.cpu_per_ok());
            // How many times the hello-world peer's CPU one answer costs.
            let cpu_ratio = match (row.cpu_per_ok(), self.hello_cpu_per_ok) {
                (Some(row), Some(hello)) if hello > 0.0 => format!("{:.1}", row / hello),
                _ => "-".into(),
            };
            println!(
                "{:<26} {:>5} {:>6.1} {:>9.1} {p50:>9} {p99:>9} {errors:>13} {health:>8} {rss:>17} {ratio:>8} {cpu_per_ok:>9} {cpu_ratio:>8}",
                row.name,
                row.conns,
                row.elapsed,
                row.rps(),
            );
        }
        if !self.notes.is_empty() {
            println!("\nnotes:");
            for note in &self.notes {
                println!("- {note}");
            }
        }
    }
}

fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

fn ms(us: Option<u64>) -> String {
    us.map_or_else(|| "-".into(), |us| format!("{:.2}", us as f64 / 1000.0))
}

fn mb(kb: Option<u64>) -> String {
    kb.map_or_else(|| "-".into(), |kb| format!("{}", kb / 1024))
}

// --- processes --------------------------------------------------------------------------------

/// CPU time (user + system) of process `pid` so far, in microseconds (`/proc/PID/stat` fields
/// 14 and 15, in clock ticks of 10 ms).
fn cpu_us(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: fields are counted after its `)`.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((ticks(11)? + ticks(12)?) * 10_000)
}

fn cpu(us: Option<f64>) -> String {
    us.map_or_else(|| "-".into(), |us| format!("{us:.0}"))
}

fn rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn free_port() -> BenchResult<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// SIGTERM, up to 20 s for a graceful exit, then SIGKILL.
fn terminate(child: &mut Child) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on the pid of our own child, which has not been waited for yet.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("  note: the process did not exit 20 s after SIGTERM; killing it");
    let _ = child.kill();
    let _ = child.wait();
}

/// The service under test, in a fresh data directory with operator, collector and viewer tokens.
#[derive(Debug)]
struct Service {
    child: Option<Child>,
    pid: u32,
    url: String,
    log: PathBuf,
    root: PathBuf,
}

impl Service {
    fn start(dir: &Path, env: &[(&str, &str)]) -> BenchResult<Self> {
        let data = dir.join("data");
        let root = dir.join("runs");
        std::fs::create_dir_all(&root).map_err(|e| format!("creating {root:?}: {e}"))?;
        let root = std::fs::canonicalize(&root).map_err(|e| format!("{root:?}: {e}"))?;
        let log = dir.join("service.log");
        let log_file = std::fs::File::create(&log).map_err(|e| format!("{log:?}: {e}"))?;
        let port = free_port()?;
        let mut command = Command::new(BIN);
        command
            .args([
                "serve",
                "--bind",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(&data)
            .arg("--root")
            .arg(&root)
            .env(
                "RR_TOKENS",
                format!("operator:alice:{OPERATOR},collector:c1:{COLLECTOR},viewer:dash:{VIEWER}"),
            )
            .env_remove("RR_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file);
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command
            .spawn()
            .map_err(|e| format!("spawning {BIN}: {e}"))?;
        let mut service = Self {
            pid: child.id(),
            child: Some(child),
            url: format!("http://127.0.0.1:{port}"),
            log,
            root,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if is_ready(port) {
                return Ok(service);
            }
            if let Some(child) = service.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(format!(
                    "the service exited ({status}) before it was ready: {}",
                    service.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "the service did not listen within 60 s: {}",
            service.log_tail()
        ))
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }

    /// Log lines at WARN or ERROR other than the expected drift warnings, counted.
    fn log_problems(&self) -> (usize, Option<String>) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut count = 0;
        let mut first = None;
        for line in text.lines() {
            let line = strip_ansi(line);
            let flagged = line.contains(" ERROR ")
                || (line.contains(" WARN ") && !line.contains("operational drift"));
            if flagged {
                count += 1;
                first.get_or_insert_with(|| line.chars().take(400).collect());
            }
        }
        (count, first)
    }

    fn stop(mut self, report: &mut Report, name: &str) {
        // VmRSS counts the SQLite file's pages mapped into the process (`mmap_size`): clean,
        // file-backed, the kernel's page cache. What the process itself holds is RssAnon.
        let kb = |field: &str| {
            std::fs::read_to_string(format!("/proc/{}/status", self.pid))
                .ok()?
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        };
        if let (Some(anon), Some(file)) = (kb("RssAnon:"), kb("RssFile:")) {
            report.note(format!(
                "{name}: at the end, RssAnon {} MB (the process's own), RssFile {} MB (mapped files: the binary, the database)",
                anon / 1024,
                file / 1024
            ));
        }
        if let Some(mut child) = self.child.take() {
            terminate(&mut child);
        }
        let (count, first) = self.log_problems();
        if let Some(first) = first {
            report.note(format!(
                "{name}: the service logged {count} WARN/ERROR line(s); first: {first}"
            ));
        }
    }
}

/// A log line without its colour escapes (the service colours its stderr even into a file).
fn strip_ansi(line: &str) -> String {
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for e in chars.by_ref() {
                if e.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The hello-world peer: this binary with `LOAD_BENCH_HELLO=1`, in its own process.
#[derive(Debug)]
struct Hello {
    child: Child,
    url: String,
}

impl Hello {
    fn start() -> BenchResult<Self> {
        let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
        let mut child = Command::new(exe)
            .env("LOAD_BENCH_HELLO", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawning the hello-world peer: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let port: u16 = match read {
            Ok(_) => line
                .trim()
                .parse()
                .map_err(|_| format!("bad port {line:?}"))?,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("reading the port: {e}"));
            }
        };
        Ok(Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stop(mut self) {
        terminate(&mut self.child);
    }
}

impl Drop for Hello {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The hello-world server: prints its port, serves until stdin closes (the bench went away).
fn hello_server() {
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        println!("{port}");
        std::io::stdout().flush().expect("stdout");
        let app = axum::Router::new()
            .route("/", axum::routing::post(hello))
            .route("/healthz", axum::routing::get(|| async { "ok" }));
        let shutdown = async {
            if let Ok(mut term) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            {
                term.recv().await;
            }
        };
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .expect("serve");
    });
}

async fn hello(axum::Json(body): axum::Json<Value>) -> axum::Json<Value> {
    let fields = body.as_object().map_or(0, serde_json::Map::len);
    axum::Json(json!({"ok": true, "fields": fields}))
}

/// A ~2.4 KB JSON body shaped like a validate request.
fn hello_body() -> Bytes {
    let mut body = json!({
        "config": config(0.3),
        "global_config": global(8000),
        "environment": {"NGT_REVIEW_PROMPT": "Be strict."},
        "source_path": "/srv/rollouts/data/train.jsonl",
        "rows": (0..8).map(row).collect::<Vec<_>>(),
    });
    let text = body.to_string();
    let pad = 2400usize.saturating_sub(text.len() + 12);
    body["padding"] = json!("p".repeat(pad));
    Bytes::from(body.to_string())
}

// --- load -------------------------------------------------------------------------------------

/// Builds request number `seq` of connection `task`.
type MakeRequest =
    Arc<dyn Fn(&reqwest::Client, usize, u64) -> reqwest::RequestBuilder + Send + Sync>;

#[derive(Debug, Clone)]
struct Load {
    name: String,
    conns: usize,
    secs: f64,
    timeout: Duration,
    /// A successful answer's body contains this.
    expect: Option<String>,
}

impl Load {
    fn new(name: &str, settings: &Settings, conns: usize) -> Self {
        Self {
            name: name.to_owned(),
            conns,
            secs: settings.secs,
            timeout: settings.timeout,
            expect: None,
        }
    }

    fn expect(mut self, text: &str) -> Self {
        self.expect = Some(text.to_owned());
        self
    }
}

#[derive(Debug, Default)]
struct LoadResult {
    name: String,
    conns: usize,
    ok: u64,
    errors: u64,
    timeouts: u64,
    samples: Vec<String>,
    latencies_us: Vec<u64>,
    elapsed: f64,
    health_us: Vec<u64>,
    health_errors: u64,
    rss_idle_kb: Option<u64>,
    rss_peak_kb: Option<u64>,
    rss_after_kb: Option<u64>,
    /// Five seconds after the load: once idle runtime threads have ended and given back.
    rss_settled_kb: Option<u64>,
    /// The server's CPU time (user + system) over the load, in microseconds.
    cpu_us: Option<u64>,
    aborted: Option<String>,
}

impl LoadResult {
    fn rps(&self) -> f64 {
        if self.elapsed > 0.0 {
            self.ok as f64 / self.elapsed
        } else {
            0.0
        }
    }

    /// The server's CPU microseconds per successful answer: steadier than req/s on a machine
    /// whose neighbours take cores now and then.
    fn cpu_per_ok(&self) -> Option<f64> {
        self.cpu_us
            .filter(|_| self.ok > 0)
            .map(|us| us as f64 / self.ok as f64)
    }

    fn print(&self) {
        println!(
            "  {}: {} ok in {:.1} s = {:.1} req/s, p50 {} ms, p99 {} ms, errors {} (timeouts {}), \
             /healthz p99 {} ms over {} probes ({} failed), RSS idle/peak/after 1 s/after 5 s \
             {}/{}/{}/{} MB, server CPU {} us per answer",
            self.name,
            self.ok,
            self.elapsed,
            self.rps(),
            ms(percentile(&self.latencies_us, 0.50)),
            ms(percentile(&self.latencies_us, 0.99)),
            self.errors,
            self.timeouts,
            ms(percentile(&self.health_us, 0.99)),
            self.health_us.len(),
            self.health_errors,
            mb(self.rss_idle_kb),
            mb(self.rss_peak_kb),
            mb(self.rss_after_kb),
            mb(self.rss_settled_kb),
            cpu(self.cpu_per_ok()),
        );
        for sample in &self.samples {
            println!("    error sample: {sample}");
        }
    }
}

#[derive(Debug, Default)]
struct TaskStats {
    ok: u64,
    errors: u64,
    timeouts: u64,
    samples: Vec<String>,
    latencies_us: Vec<u64>,
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .tcp_nodelay(true)
        .no_proxy()
        .build()
        .expect("client")
}

/// Drives `make` from `load.conns` tasks until the deadline, probing `/healthz` and the RSS of
/// `pid` from a separate thread meanwhile.
async fn run_load(
    load: &Load,
    url: &str,
    pid: Option<u32>,
    make: MakeRequest,
    settings: &Settings,
) -> LoadResult {
    let rss_idle_kb = pid.and_then(rss_kb);
    let cpu_before = pid.and_then(cpu_us);
    let stop = Arc::new(AtomicBool::new(false));
    let abort = Arc::new(std::sync::Mutex::new(None::<String>));
    let monitor = {
        let stop = stop.clone();
        let abort = abort.clone();
        let url = format!("{url}/healthz");
        let limit = settings.rss_limit_kb;
        std::thread::spawn(move || monitor(&url, pid, limit, &stop, &abort))
    };
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(load.secs);
    let seq = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(load.conns);
    for task in 0..load.conns {
        let make = make.clone();
        let stop = stop.clone();
        let seq = seq.clone();
        let expect = load.expect.clone();
        let timeout = load.timeout;
        tasks.push(tokio::spawn(async move {
            let client = client();
            let mut stats = TaskStats::default();
            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                let n = seq.fetch_add(1, Ordering::Relaxed);
                let request = make(&client, task, n);
                let began = Instant::now();
                let answer = tokio::time::timeout(timeout, async {
                    let response = request.send().await?;
                    let status = response.status();
                    let body = response.bytes().await?;
                    Ok::<_, reqwest::Error>((status, body))
                })
                .await;
                let took = began.elapsed();
                let problem = match answer {
                    Err(_) => {
                        stats.timeouts += 1;
                        Some(format!("timed out after {:.1} s", took.as_secs_f64()))
                    }
                    Ok(Err(e)) => Some(format!("transport: {e}")),
                    Ok(Ok((status, body))) if !status.is_success() => Some(format!(
                        "{} {}",
                        status.as_u16(),
                        String::from_utf8_lossy(&body[..body.len().min(300)])
                    )),
                    Ok(Ok((_, body))) => match &expect {
                        Some(text) if !contains(&body, text.as_bytes()) => Some(format!(
                            "2xx without {text:?}: {}",
                            String::from_utf8_lossy(&body[..body.len().min(300)])
                        )),
                        _ => None,
                    },
                };
                match problem {
                    None => {
                        stats.ok += 1;
                        stats
                            .latencies_us
                            .push(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
                    }
                    Some(text) => {
                        stats.errors += 1;
                        if stats.samples.len() < 2 {
                            stats.samples.push(text);
                        }
                    }
                }
            }
            stats
        }));
    }
    let mut result = LoadResult {
        name: load.name.clone(),
        conns: load.conns,
        rss_idle_kb,
        ..Default::default()
    };
    for task in tasks {
        match task.await {
            Ok(stats) => {
                result.ok += stats.ok;
                result.errors += stats.errors;
                result.timeouts += stats.timeouts;
                result.latencies_us.extend(stats.latencies_us);
                for sample in stats.samples {
                    if result.samples.len() < 3 && !result.samples.contains(&sample) {
                        result.samples.push(sample);
                    }
                }
            }
            Err(e) => {
                result.errors += 1;
                result.samples.push(format!("load task failed: {e}"));
            }
        }
    }
    result.elapsed = start.elapsed().as_secs_f64();
    result.cpu_us = cpu_before
        .zip(pid.and_then(cpu_us))
        .map(|(before, after)| after.saturating_sub(before));
    stop.store(true, Ordering::Relaxed);
    match monitor.join() {
        Ok(sampled) => {
            result.health_us = sampled.health_us;
            result.health_errors = sampled.health_errors;
            result.rss_peak_kb = sampled.rss_peak_kb;
        }
        Err(_) => result.samples.push("the monitor thread panicked".into()),
    }
    result.aborted = abort.lock().map(|a| a.clone()).unwrap_or_default();
    result.latencies_us.sort_unstable();
    result.health_us.sort_unstable();
    tokio::time::sleep(Duration::from_secs(1)).await;
    result.rss_after_kb = pid.and_then(rss_kb);
    tokio::time::sleep(Duration::from_secs(4)).await;
    result.rss_settled_kb = pid.and_then(rss_kb);
    result
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

#[derive(Debug, Default)]
struct Sampled {
    health_us: Vec<u64>,
    health_errors: u64,
    rss_peak_kb: Option<u64>,
}

/// `/healthz` every 25 ms on one keep-alive connection (its own runtime and thread), and the RSS
/// every 100 ms; stops the load when the RSS passes the limit.
fn monitor(
    url: &str,
    pid: Option<u32>,
    rss_limit_kb: u64,
    stop: &AtomicBool,
    abort: &std::sync::Mutex<Option<String>>,
) -> Sampled {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("monitor runtime");
    runtime.block_on(async {
        let client = client();
        let mut sampled = Sampled::default();
        let mut last_rss = Instant::now() - Duration::from_secs(1);
        while !stop.load(Ordering::Relaxed) {
            if last_rss.elapsed() >= Duration::from_millis(100) {
                last_rss = Instant::now();
                if let Some(kb) = pid.and_then(rss_kb) {
                    sampled.rss_peak_kb = Some(sampled.rss_peak_kb.unwrap_or(0).max(kb));
                    if kb > rss_limit_kb {
                        if let Ok(mut a) = abort.lock() {
                            a.get_or_insert_with(|| {
                                format!("RSS {} MB passed LOAD_RSS_LIMIT_MB", kb / 1024)
                            });
                        }
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            }
            let began = Instant::now();
            let answer = tokio::time::timeout(Duration::from_secs(5), async {
                let response = client.get(url).send().await?;
                let status = response.status();
                response.bytes().await?;
                Ok::<_, reqwest::Error>(status)
            })
            .await;
            match answer {
                Ok(Ok(status)) if status.is_success() => sampled
                    .health_us
                    .push(u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX)),
                _ => sampled.health_errors += 1,
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        sampled
    })
}

// --- one-off calls ----------------------------------------------------------------------------

/// One request bounded by `timeout`: (status, body, time).
async fn call(
    client: &reqwest::Client,
    url: &str,
    method: reqwest::Method,
    path: &str,
    token: &str,
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> BenchResult<(u16, Bytes, Duration)> {
    let mut request = client
        .request(method.clone(), format!("{url}{path}"))
        .bearer_auth(token);
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body);
    }
    let began = Instant::now();
    let answer = tokio::time::timeout(timeout, async {
        let response = request.send().await?;
        let status = response.status().as_u16();
        Ok::<_, reqwest::Error>((status, response.bytes().await?))
    })
    .await;
    match answer {
        Err(_) => Err(format!(
            "{method} {path}: timed out after {:.0} s",
            timeout.as_secs_f64()
        )),
        Ok(Err(e)) => Err(format!("{method} {path}: {e}")),
        Ok(Ok((status, bytes))) => Ok((status, bytes, began.elapsed())),
    }
}

/// A JSON call that must answer `want`: the parsed body and the time taken.
#[allow(clippy::too_many_arguments)]
async fn call_json(
    client: &reqwest::Client,
    url: &str,
    method: reqwest::Method,
    path: &str,
    token: &str,
    body: Option<&Value>,
    want: u16,
    timeout: Duration,
) -> BenchResult<(Value, Duration)> {
    let bytes = body.map(|b| b.to_string().into_bytes());
    let sent = bytes.as_ref().map_or(0, Vec::len);
    let (status, answer, took) =
        call(client, url, method.clone(), path, token, bytes, timeout).await?;
    if status != want {
        return Err(format!(
            "{method} {path} ({sent} B body) answered {status} (wanted {want}): {}",
            String::from_utf8_lossy(&answer[..answer.len().min(600)])
        ));
    }
    let value = serde_json::from_slice(&answer)
        .map_err(|e| format!("{method} {path}: the answer is not JSON: {e}"))?;
    Ok((value, took))
}

fn text_field(value: &Value, field: &str) -> BenchResult<String> {
    value[field]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("no {field:?} in {}", truncate(&value.to_string(), 300)))
}

fn truncate(text: &str, n: usize) -> String {
    text.chars().take(n).collect()
}

fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

// --- request shapes (those of crates/recovery-server/tests/server.rs) -------------------------

fn config(temperature: f64) -> Value {
    json!({"limit": 2, "responses_create_params": {"temperature": temperature}, "num_samples_in_parallel": 8, "output_jsonl_fpath": "/x/out.jsonl"})
}

fn global(sandbox_port: u64) -> Value {
    json!({
        "policy_api_key": SECRET,
        "policy_model": {"responses_api_models": {"vllm_model": {"model": "model-A", "api_key": "${policy_api_key}", "host": "127.0.0.1", "port": 9001,
            "headers": {"Authorization": format!("Bearer {SECRET}"), "X-Dataset-Version": "v1"}}}},
        "judge": {"resources_servers": {"math_with_judge": {"judge_model_server": {"type": "responses_api_models", "name": "policy_model"},
            "review_prompt": "${oc.env:NGT_REVIEW_PROMPT}", "client_secret": SECRET, "mirror": format!("https://user:{SECRET}@example.org/data")}}},
        "math_agent": {"responses_api_agents": {"simple_agent": {"resources_server": {"type": "resources_servers", "name": "judge"},
            "model_server": {"type": "responses_api_models", "name": "policy_model"}, "sandbox": {"sandbox_port": sandbox_port}}}}
    })
}

fn row(i: usize) -> Value {
    json!({"agent_ref": {"name": "math_agent"}, "_ng_task_index": i, "_ng_rollout_index": 0, "question": format!("What is {i} + {i}?")})
}

fn rows(n: usize) -> Vec<Value> {
    (0..n).map(row).collect()
}

fn create_body(output: &Path, source: &Path, rows: Option<&[Value]>) -> Value {
    let mut body = json!({
        "output_path": output,
        "source_path": source,
        "config": config(0.3),
        "global_config": global(8000),
        "environment": {"NGT_REVIEW_PROMPT": "Be strict.", "OPENAI_API_KEY": SECRET},
    });
    if let Some(rows) = rows {
        body["rows"] = json!(rows);
    }
    body
}

fn validate_body(source: &Path, port: u64, rows: Option<&[Value]>) -> Value {
    let mut body = json!({"config": config(0.3), "global_config": global(port), "environment": {"NGT_REVIEW_PROMPT": "Be strict."}, "source_path": source});
    if let Some(rows) = rows {
        body["rows"] = json!(rows);
    }
    body
}

/// A JSONL dataset of about `bytes` bytes (~200-byte lines).
fn write_dataset(path: &Path, bytes: u64) -> BenchResult<u64> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{parent:?}: {e}"))?;
    }
    let file = std::fs::File::create(path).map_err(|e| format!("{path:?}: {e}"))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let mut written = 0u64;
    let mut i = 0u64;
    while written < bytes {
        let line = format!(
            "{{\"question\": \"What is {i} + {}?\", \"answer\": {}, \"id\": \"q-{i:08}\", \"context\": \"{}\"}}\n",
            i * 7,
            i * 8,
            "lorem ipsum dolor sit amet ".repeat(4)
        );
        out.write_all(line.as_bytes())
            .map_err(|e| format!("{path:?}: {e}"))?;
        written += line.len() as u64;
        i += 1;
    }
    out.flush().map_err(|e| format!("{path:?}: {e}"))?;
    Ok(written)
}

/// Creates a run over `source` at `<root>/<dir>/out.jsonl`: (run id, config digest, time).
async fn create_run(
    service: &Service,
    settings: &Settings,
    dir: &str,
    source: &Path,
    rows: Option<&[Value]>,
) -> BenchResult<(String, String, Duration)> {
    let output = service.root.join(dir).join("out.jsonl");
    let (created, took) = call_json(
        &client(),
        &service.url,
        reqwest::Method::POST,
        "/runs",
        COLLECTOR,
        Some(&create_body(&output, source, rows)),
        201,
        settings.setup_timeout,
    )
    .await?;
    Ok((
        text_field(&created, "run_id")?,
        text_field(&created, "config_digest")?,
        took,
    ))
}

/// A load of repeated `POST /runs/{id}/validate` with one fixed body.
fn validate_request(url: &str, run_id: &str, body: &Value) -> MakeRequest {
    let endpoint = format!("{url}/runs/{run_id}/validate");
    let body = Bytes::from(body.to_string());
    Arc::new(move |client, _, _| {
        client
            .post(&endpoint)
            .bearer_auth(COLLECTOR)
            .header("content-type", "application/json")
            .body(body.clone())
    })
}

// --- scenarios --------------------------------------------------------------------------------

/// `validate-1mb`, `validate-100mb`, `validate-1gb`: reuse validations of a run over a large source dataset.
async fn validate_source(
    settings: &Settings,
    dir: &Path,
    report: &mut Report,
    megabytes: u64,
    name: &str,
) -> BenchResult<()> {
    let service = Service::start(dir, &[])?;
    let source = service.root.join(format!("src/train_{megabytes}mb.jsonl"));
    let began = Instant::now();
    let size = write_dataset(&source, megabytes * 1_000_000)?;
    report.note(format!(
        "{name}: source {:.1} MB written in {:.2} s",
        size as f64 / 1e6,
        began.elapsed().as_secs_f64()
    ));
    let written = Instant::now();
    let rows = rows(20);
    let (run_id, _, took) = create_run(&service, settings, "exp", &source, Some(&rows)).await?;
    report.note(format!(
        "{name}: POST /runs (20 rows, {megabytes} MB source) took {:.1} ms",
        took.as_secs_f64() * 1e3
    ));
    let body = validate_body(&source, 8000, None);
    reuse_under_load(&service, settings, &run_id, &body, written, name, report).await?;
    service.stop(report, name);
    Ok(())
}

/// Notes the first (cold) validate of `run_id` with `body`, waits until the source written at
/// `written` is old enough to be trusted, then loads the service with that validate (every
/// answer `reuse`): the service trusts its cached source digest only once the file has been
/// unchanged for 2 s (`recovery_runs::cache::SETTLE`), and before that every validate hashes
/// the source again. Datasets are old when collectors resume, so loads start after that window.
async fn reuse_under_load(
    service: &Service,
    settings: &Settings,
    run_id: &str,
    body: &Value,
    written: Instant,
    name: &str,
    report: &mut Report,
) -> BenchResult<()> {
    let (first, took) = call_json(
        &client(),
        &service.url,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/validate"),
        COLLECTOR,
        Some(body),
        200,
        settings.setup_timeout,
    )
    .await?;
    report.note(format!(
        "{name}: first validate answered {} in {:.1} ms",
        first["outcome"],
        took.as_secs_f64() * 1e3
    ));
    let settle = Duration::from_millis(2500).saturating_sub(written.elapsed());
    tokio::time::sleep(settle).await;
    let load = Load::new(name, settings, settings.conns).expect("\"outcome\":\"reuse\"");
    let make = validate_request(&service.url, run_id, body);
    let result = run_load(&load, &service.url, Some(service.pid), make, settings).await;
    report.push(result);
    Ok(())
}

/// `validate-rows-1000`: every validate carries the run's 1,000 rows inline.
async fn validate_rows(settings: &Settings, dir: &Path, report: &mut Report) -> BenchResult<()> {
    let name = "validate-rows-1000";
    let service = Service::start(dir, &[])?;
    let source = service.root.join("src/train.jsonl");
    write_dataset(&source, 10_000)?;
    let written = Instant::now();
    let rows = rows(1000);
    let (run_id, _, took) = create_run(&service, settings, "exp", &source, Some(&rows)).await?;
    report.note(format!(
        "{name}: POST /runs with 1,000 rows took {:.1} ms",
        took.as_secs_f64() * 1e3
    ));
    let body = validate_body(&source, 8000, Some(&rows));
    report.note(format!(
        "{name}: validate body {} KB",
        body.to_string().len() / 1024
    ));
    reuse_under_load(&service, settings, &run_id, &body, written, name, report).await?;
    service.stop(report, name);
    Ok(())
}

/// This disk's single-writer append + fdatasync rate (lines/s) in `dir`, for about `secs`.
fn fsync_rate(dir: &Path, secs: f64) -> BenchResult<f64> {
    let path = dir.join(".fsync-probe.jsonl");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| format!("{path:?}: {e}"))?;
    let mut line = vec![b'x'; 199];
    line.push(b'\n');
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed().as_secs_f64() < secs && n < 10_000_000 {
        file.write_all(&line).map_err(|e| format!("append: {e}"))?;
        file.sync_data().map_err(|e| format!("fdatasync: {e}"))?;
        n += 1;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop(file);
    let _ = std::fs::remove_file(&path);
    Ok(rate)
}

/// `drift-64x8`: every validate resumes across operational drift (a per-request sandbox port):
/// one fsynced journal line and one drift event each, spread over 8 runs.
async fn drift_writes(settings: &Settings, dir: &Path, report: &mut Report) -> BenchResult<()> {
    let name = "drift-64x8";
    let service = Service::start(dir, &[])?;
    let source = service.root.join("src/train.jsonl");
    write_dataset(&source, 10_000)?;
    let rows = rows(20);
    let mut run_ids = Vec::new();
    for i in 0..8 {
        let (run_id, _, _) =
            create_run(&service, settings, &format!("exp{i}"), &source, Some(&rows)).await?;
        run_ids.push(run_id);
    }
    let probe_dir = service.root.join("exp0");
    let fsync = tokio::task::spawn_blocking(move || fsync_rate(&probe_dir, 2.0))
        .await
        .map_err(|e| format!("fsync probe: {e}"))??;
    report.note(format!(
        "{name}: single-writer append+fdatasync of 200 B lines on this disk: {fsync:.0} lines/s"
    ));
    let endpoints: Arc<Vec<String>> = Arc::new(
        run_ids
            .iter()
            .map(|id| format!("{}/runs/{id}/validate", service.url))
            .collect(),
    );
    let template = validate_body(&source, 0, None).to_string();
    let placeholder = "\"sandbox_port\":0}";
    if !template.contains(placeholder) {
        return Err(format!("no sandbox port in {template}"));
    }
    let template = Arc::new(template);
    let make: MakeRequest = Arc::new(move |client, task, seq| {
        // Ports never repeat and never equal the saved 8000: every request drifts.
        let port = 10_000 + seq;
        let body = template.replace(placeholder, &format!("\"sandbox_port\":{port}}}"));
        client
            .post(&endpoints[task % endpoints.len()])
            .bearer_auth(COLLECTOR)
            .header("content-type", "application/json")
            .body(body)
    });
    let load =
        Load::new(name, settings, settings.conns).expect("\"outcome\":\"resume_with_drift\"");
    let result = run_load(&load, &service.url, Some(service.pid), make, settings).await;
    let events = result.rps();
    let ok = result.ok;
    report.push(result);
    report.note(format!(
        "{name}: {events:.1} drift events/s = {:.3} x the single-writer fdatasync rate",
        events / fsync
    ));
    let mut lines = 0usize;
    for i in 0..8 {
        let journal = service
            .root
            .join(format!("exp{i}/out_manifest_resume_drift.jsonl"));
        lines += std::fs::read(&journal)
            .map(|b| b.iter().filter(|c| **c == b'\n').count())
            .unwrap_or(0);
    }
    let (page, _) = call_json(
        &client(),
        &service.url,
        reqwest::Method::GET,
        &format!("/drift?run_id={}&limit=1000", run_ids[0]),
        VIEWER,
        None,
        200,
        settings.setup_timeout,
    )
    .await?;
    let listed = page["events"].as_array().map_or(0, Vec::len);
    report.note(format!(
        "{name}: {lines} journal lines on disk for {ok} drift answers (run 0 lists {listed} events)"
    ));
    if lines as u64 != ok {
        report.note(format!(
            "{name}: MISMATCH: {lines} journal lines but {ok} successful drift answers \
             (timed-out requests may still have written theirs)"
        ));
    }
    // Group commit at work: journal lines per write+fdatasync, from the service's counters.
    if let Ok((200, text, _)) = call(
        &client(),
        &service.url,
        reqwest::Method::GET,
        "/metrics",
        VIEWER,
        None,
        settings.setup_timeout,
    )
    .await
    {
        let counter = |name: &str| -> f64 {
            String::from_utf8_lossy(&text)
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0)
        };
        let (syncs, synced) = (
            counter("rollout_recovery_journal_syncs_total"),
            counter("rollout_recovery_journal_lines_total"),
        );
        report.note(format!(
            "{name}: {synced:.0} journal lines in {syncs:.0} write+fdatasync calls = {:.1} lines per fdatasync",
            synced / syncs.max(1.0)
        ));
    }
    service.stop(report, name);
    Ok(())
}

/// Fixed-width RFC 3339 time (the stored form) `n` x 10 ms after 2026-01-01T00:00:00Z.
fn at_text(n: u64) -> String {
    let micros = n * 10_000;
    let secs = micros / 1_000_000;
    // Days since 1970-01-01 to a civil date (Howard Hinnant's `civil_from_days`).
    let days = 20_454 + secs / 86_400; // 2026-01-01
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let rest = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        micros % 1_000_000
    )
}

/// `drift-query`: many journal lines written beside a few runs, reindexed, then queried.
async fn drift_query(settings: &Settings, dir: &Path, report: &mut Report) -> BenchResult<()> {
    let name = "drift-query";
    const RUNS: usize = 4;
    let service = Service::start(dir, &[])?;
    let source = service.root.join("src/train.jsonl");
    write_dataset(&source, 10_000)?;
    let rows = rows(20);
    let mut runs = Vec::new();
    for i in 0..RUNS {
        let (run_id, digest, _) =
            create_run(&service, settings, &format!("q{i}"), &source, Some(&rows)).await?;
        runs.push((run_id, digest));
    }
    let total = settings.drift_events;
    let began = Instant::now();
    let mut rare = 0usize;
    for (i, (run_id, digest)) in runs.iter().enumerate() {
        let path = service
            .root
            .join(format!("q{i}/out_manifest_resume_drift.jsonl"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("{path:?}: {e}"))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        for n in (i..total).step_by(RUNS) {
            let keys = if n % 1000 == 999 {
                rare += 1;
                format!("[\"{RARE_KEY}\",\"{DRIFT_KEY}\"]")
            } else {
                format!("[\"{DRIFT_KEY}\"]")
            };
            writeln!(
                out,
                "{{\"at\":\"{}\",\"run_id\":\"{run_id}\",\"saved_config_digest\":\"{digest}\",\"current_config_digest\":\"{:064x}\",\"operational_keys\":{keys}}}",
                at_text(n as u64),
                n
            )
            .map_err(|e| format!("{path:?}: {e}"))?;
        }
        out.flush().map_err(|e| format!("{path:?}: {e}"))?;
    }
    report.note(format!(
        "{name}: {total} journal lines ({rare} with the rare key) written over {RUNS} runs in {:.2} s",
        began.elapsed().as_secs_f64()
    ));
    let rss_before = rss_kb(service.pid);
    let (reindexed, took) = call_json(
        &client(),
        &service.url,
        reqwest::Method::POST,
        "/reindex",
        OPERATOR,
        None,
        200,
        settings.setup_timeout,
    )
    .await?;
    let inserted = reindexed["drift_inserted"].as_u64().unwrap_or(0);
    report.note(format!(
        "{name}: POST /reindex took {:.2} s: {:.0} lines/s, drift_inserted {inserted} (RSS {} -> {} MB)",
        took.as_secs_f64(),
        total as f64 / took.as_secs_f64(),
        mb(rss_before),
        mb(rss_kb(service.pid)),
    ));
    if inserted as usize != total {
        report.note(format!(
            "{name}: MISMATCH: reindex inserted {inserted} of {total} lines; report: {}",
            truncate(&reindexed.to_string(), 400)
        ));
    }
    // A deep page: follow `limit=1000` pages halfway through the history.
    let depth = (total / 2 / 1000).min(500);
    let mut cursor: Option<String> = None;
    let walk = Instant::now();
    let mut pages = 0;
    for _ in 0..depth {
        let path = match &cursor {
            Some(c) => format!("/drift?limit=1000&cursor={}", encode(c)),
            None => "/drift?limit=1000".to_owned(),
        };
        let (page, _) = call_json(
            &client(),
            &service.url,
            reqwest::Method::GET,
            &path,
            VIEWER,
            None,
            200,
            settings.setup_timeout,
        )
        .await?;
        pages += 1;
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    report.note(format!(
        "{name}: walked {pages} pages of 1,000 in {:.2} s ({:.1} ms/page)",
        walk.elapsed().as_secs_f64(),
        walk.elapsed().as_secs_f64() * 1e3 / f64::from(pages.max(1))
    ));
    let deep = match &cursor {
        Some(c) => format!("/drift?limit=100&cursor={}", encode(c)),
        None => "/drift?limit=100".to_owned(),
    };
    // One client, one call at a time: what a query costs when the index drives it, on the
    // first page and deep in the history, for every filter (the concurrent rows below measure
    // throughput, where 64 connections on these cores queue behind each other).
    let middle = at_text((total / 2) as u64);
    // A recorded-order cursor names the database's numbering: `recorded:<epoch>:<position>`.
    let (head, _) = call_json(
        &client(),
        &service.url,
        reqwest::Method::GET,
        "/drift?order=recorded&limit=1",
        VIEWER,
        None,
        200,
        settings.setup_timeout,
    )
    .await?;
    let follow = head["follow_cursor"].as_str().unwrap_or_default();
    let numbering = encode(follow.rsplit_once(':').map_or(follow, |(prefix, _)| prefix));
    let sequential = [
        ("first page, no filter", "/drift?limit=100".to_owned()),
        ("deep page, no filter", deep.clone()),
        (
            "first page, rare key",
            format!("/drift?key={}&limit=100", encode(RARE_KEY)),
        ),
        (
            "deep page, rare key",
            format!(
                "/drift?key={}&limit=100&from={}",
                encode(RARE_KEY),
                encode(&middle)
            ),
        ),
        (
            "first page, run",
            format!("/drift?run_id={}&limit=100", runs[0].0),
        ),
        (
            "deep page, run",
            format!(
                "/drift?run_id={}&limit=100&from={}",
                runs[0].0,
                encode(&middle)
            ),
        ),
        (
            "time range",
            format!(
                "/drift?limit=100&from={}&to={}",
                encode(&middle),
                encode(&at_text((total / 2 + 500) as u64))
            ),
        ),
        // Following: reindex recorded the lines in order, so position n is the n-th event.
        (
            "recorded order, deep page",
            format!(
                "/drift?order=recorded&limit=100&cursor={numbering}%3A{}",
                total / 2
            ),
        ),
        (
            "recorded order, follower at the head",
            format!("/drift?order=recorded&limit=100&cursor={numbering}%3A{total}"),
        ),
        (
            "recorded order, run, last 10,000",
            format!(
                "/drift?order=recorded&run_id={}&limit=100&cursor={numbering}%3A{}",
                runs[0].0,
                total.saturating_sub(10_000)
            ),
        ),
    ];
    let one = client();
    for (label, path) in sequential {
        let mut times = Vec::with_capacity(200);
        let mut events = 0;
        for _ in 0..200 {
            let (page, took) = call_json(
                &one,
                &service.url,
                reqwest::Method::GET,
                &path,
                VIEWER,
                None,
                200,
                settings.setup_timeout,
            )
            .await?;
            events = page["events"].as_array().map_or(0, Vec::len);
            times.push(took);
        }
        times.sort();
        report.note(format!(
            "{name} one client, {label}: {events} events, p50 {:.2} ms, p99 {:.2} ms over 200 calls",
            times[100].as_secs_f64() * 1e3,
            times[197].as_secs_f64() * 1e3
        ));
    }
    let queries = [
        (
            "drift-query key",
            format!("/drift?key={}", encode(RARE_KEY)),
        ),
        (
            "drift-query run l=1000",
            format!("/drift?run_id={}&limit=1000", runs[0].0),
        ),
        ("drift-query deep cursor", deep),
        (
            "drift-query follower at the head",
            format!("/drift?order=recorded&cursor={numbering}%3A{total}"),
        ),
    ];
    for (label, path) in queries {
        let (page, took) = call_json(
            &client(),
            &service.url,
            reqwest::Method::GET,
            &path,
            VIEWER,
            None,
            200,
            settings.setup_timeout,
        )
        .await?;
        report.note(format!(
            "{label}: GET {} -> {} events, single call {:.1} ms",
            truncate(&path, 90),
            page["events"].as_array().map_or(0, Vec::len),
            took.as_secs_f64() * 1e3
        ));
        let endpoint = format!("{}{path}", service.url);
        let make: MakeRequest =
            Arc::new(move |client, _, _| client.get(&endpoint).bearer_auth(VIEWER));
        let load = Load::new(label, settings, settings.conns).expect("\"events\"");
        let result = run_load(&load, &service.url, Some(service.pid), make, settings).await;
        report.push(result);
    }
    service.stop(report, name);
    Ok(())
}

/// Rows of every kind `POST /classify` distinguishes, repeated to about `bytes`.
fn classify_rows(bytes: usize) -> (Vec<Value>, usize) {
    let kinds = [
        json!({"reward": 1.0, "response": {"output": [{"type": "message", "content": "The answer is 4."}], "status": "completed"}}),
        json!({"_ng_failure_class": "session_lost", "_ng_failure_terminal": false}),
        json!({"_ng_failure_class": "agent_timeout", "_ng_failure_terminal": false, "_ng_collected_model_calls": [{"error_category": "upstream_error"}, {"status": 200}], "response": {"output": [{}], "status": "incomplete"}}),
        json!({"reward": 0.0, "mask_sample": true, "failure_kind": "verifier_error", "response": {"output": [{"type": "message"}], "status": "completed"}}),
        json!({"_ng_failure_class": "judge_failed", "response": {"output": [{}], "status": "completed"}}),
        json!({"_ng_failure_class": "timeout_exceeded", "_ng_failure_terminal": true}),
        json!({"_ng_failure_class": "agent_run_error", "_ng_failure_counts_as_zero": true}),
        json!({"mask_sample": true, "failure_kind": "session_lost", "_ng_failure_class": "session_lost"}),
    ];
    let mut rows = Vec::new();
    let mut size = 0;
    let mut i = 0usize;
    while size < bytes {
        let mut row = kinds[i % kinds.len()].clone();
        row["_ng_task_index"] = json!(i);
        row["_ng_rollout_index"] = json!(0);
        row["transcript"] = json!(format!("turn {i}: {}", "the quick brown fox ".repeat(20)));
        size += row.to_string().len() + 1;
        rows.push(row);
        i += 1;
    }
    (rows, size)
}

/// `classify-1mb`: `POST /classify` with ~1 MB of rows.
async fn classify(settings: &Settings, dir: &Path, report: &mut Report) -> BenchResult<()> {
    let name = "classify-1mb";
    let service = Service::start(dir, &[])?;
    let (rows, size) = classify_rows(1_000_000);
    let body = json!({"rows": rows});
    let (answer, took) = call_json(
        &client(),
        &service.url,
        reqwest::Method::POST,
        "/classify",
        VIEWER,
        Some(&body),
        200,
        settings.setup_timeout,
    )
    .await?;
    let decided = answer["decisions"].as_array().map_or(0, Vec::len);
    report.note(format!(
        "{name}: {} rows ({:.2} MB) -> {decided} decisions, single call {:.1} ms",
        rows.len(),
        size as f64 / 1e6,
        took.as_secs_f64() * 1e3
    ));
    let endpoint = format!("{}/classify", service.url);
    let body = Bytes::from(body.to_string());
    let make: MakeRequest = Arc::new(move |client, _, _| {
        client
            .post(&endpoint)
            .bearer_auth(VIEWER)
            .header("content-type", "application/json")
            .body(body.clone())
    });
    let load = Load::new(name, settings, settings.conns).expect("\"decisions\"");
    let result = run_load(&load, &service.url, Some(service.pid), make, settings).await;
    let mbps = result.rps() * size as f64 / 1e6;
    report.push(result);
    report.note(format!("{name}: {mbps:.1} MB/s of rows classified"));
    service.stop(report, name);
    Ok(())
}

/// Reads every file of the run's directory once (like `cat`): (bytes, time).
fn read_all(dir: &Path) -> BenchResult<(u64, Duration)> {
    let began = Instant::now();
    let mut total = 0u64;
    let mut buffer = vec![0u8; 1 << 20];
    for entry in std::fs::read_dir(dir).map_err(|e| format!("{dir:?}: {e}"))? {
        let path = entry.map_err(|e| format!("{dir:?}: {e}"))?.path();
        if !path.is_file() {
            continue;
        }
        let mut file = std::fs::File::open(&path).map_err(|e| format!("{path:?}: {e}"))?;
        loop {
            let n = file
                .read(&mut buffer)
                .map_err(|e| format!("{path:?}: {e}"))?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    Ok((total, began.elapsed()))
}

/// Waits until the file at `path` was last changed 2.5 s ago (the service's settle window, and
/// a margin).
async fn settle_file(path: &Path) {
    let age = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|modified| modified.elapsed().ok())
        .unwrap_or_default();
    tokio::time::sleep(Duration::from_millis(2500).saturating_sub(age)).await;
}

/// `GET /runs/{id}/plan` once: (coverage, state counts, bytes, time).
async fn plan_once(
    service: &Service,
    settings: &Settings,
    run_id: &str,
) -> BenchResult<(Value, Value, usize, Duration)> {
    let (status, body, took) = call(
        &client(),
        &service.url,
        reqwest::Method::GET,
        &format!("/runs/{run_id}/plan"),
        VIEWER,
        None,
        settings.setup_timeout,
    )
    .await?;
    if status != 200 {
        return Err(format!(
            "GET /runs/{run_id}/plan answered {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(600)])
        ));
    }
    let value: Value =
        serde_json::from_slice(&body).map_err(|e| format!("plan is not JSON: {e}"))?;
    Ok((
        value["coverage"].clone(),
        value["state_counts"].clone(),
        body.len(),
        took,
    ))
}

fn outcome_line(run_id: &str, task: usize, attempt: u64) -> String {
    if attempt < 2 {
        format!(
            "{{\"_ng_task_index\":{task},\"_ng_rollout_index\":0,\"_ng_attempt_index\":{attempt},\"_ng_run_id\":\"{run_id}\",\"_ng_failure_class\":\"transport_peer_drop\",\"_ng_failure_terminal\":false,\"error\":\"connection reset by peer\"}}\n"
        )
    } else {
        format!(
            "{{\"_ng_task_index\":{task},\"_ng_rollout_index\":0,\"_ng_attempt_index\":{attempt},\"_ng_run_id\":\"{run_id}\",\"reward\":1.0,\"response\":{{\"output\":[{{\"type\":\"message\",\"content\":\"The answer is {}.\"}}],\"status\":\"completed\"}}}}\n",
            task * 2
        )
    }
}

/// `plan-100k`: a 100,000-rollout run, 3 attempts each (two counted failures in the failures
/// sidecar, then a scored result), planned cold, after 100 appended lines (five rounds), and
/// under load.
async fn plan(settings: &Settings, dir: &Path, report: &mut Report) -> BenchResult<()> {
    let name = "plan-100k";
    const ROLLOUTS: usize = 100_000;
    const LATE: usize = 100;
    /// Rounds of "append LATE outcomes, then plan": one single call is at the mercy of whatever
    /// else the machine does at that moment.
    const ROUNDS: usize = 5;
    let service = Service::start(dir, &[("RR_BODY_LIMIT_MB", "256")])?;
    let source = service.root.join("src/train.jsonl");
    write_dataset(&source, 10_000)?;
    let all_rows = rows(ROLLOUTS);
    let (run_id, _, took) = create_run(&service, settings, "exp", &source, Some(&all_rows)).await?;
    drop(all_rows);
    report.note(format!(
        "{name}: POST /runs with {ROLLOUTS} rows inline took {:.2} s",
        took.as_secs_f64()
    ));
    let http = client();
    let (lease, _) = call_json(
        &http,
        &service.url,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(&json!({"holder": "load-bench", "host": "localhost", "pid": std::process::id(), "ttl_seconds": 3600})),
        201,
        settings.setup_timeout,
    )
    .await?;
    let lease_id = text_field(&lease, "lease_id")?;
    let ids: Vec<String> = (0..ROLLOUTS).map(|i| format!("{i}-0")).collect();
    let reserve = json!({"lease_id": lease_id, "rollout_ids": ids});
    let mut reserved = true;
    for attempt in 0..3 {
        match call_json(
            &http,
            &service.url,
            reqwest::Method::POST,
            &format!("/runs/{run_id}/attempts/reserve"),
            COLLECTOR,
            Some(&reserve),
            200,
            settings.setup_timeout,
        )
        .await
        {
            Ok((answer, took)) => report.note(format!(
                "{name}: reserve #{attempt} of {ROLLOUTS} rollouts took {:.2} s (0-0 -> {})",
                took.as_secs_f64(),
                answer["attempts"]["0-0"]
            )),
            Err(e) => {
                report.note(format!(
                    "{name}: reserve failed ({e}); writing next_attempt into the manifest instead"
                ));
                reserved = false;
                break;
            }
        }
    }
    let _ = call(
        &http,
        &service.url,
        reqwest::Method::DELETE,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"lease_id": lease_id}).to_string().into_bytes()),
        settings.setup_timeout,
    )
    .await;
    let run_dir = service.root.join("exp");
    if !reserved {
        let path = run_dir.join("out_manifest.json");
        let text = std::fs::read(&path).map_err(|e| format!("{path:?}: {e}"))?;
        let mut manifest: Value =
            serde_json::from_slice(&text).map_err(|e| format!("{path:?}: {e}"))?;
        manifest["next_attempt"] = Value::Object(
            (0..ROLLOUTS)
                .map(|i| (format!("{i}-0"), json!(3)))
                .collect(),
        );
        let pretty = serde_json::to_string_pretty(&manifest).map_err(|e| e.to_string())?;
        std::fs::write(&path, pretty).map_err(|e| format!("{path:?}: {e}"))?;
    }
    let began = Instant::now();
    let failures_path = run_dir.join("out_failures.jsonl");
    let results_path = run_dir.join("out.jsonl");
    {
        let mut failures = BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(&failures_path).map_err(|e| format!("{failures_path:?}: {e}"))?,
        );
        let mut results = BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(&results_path).map_err(|e| format!("{results_path:?}: {e}"))?,
        );
        for task in 0..ROLLOUTS {
            for attempt in 0..2 {
                failures
                    .write_all(outcome_line(&run_id, task, attempt).as_bytes())
                    .map_err(|e| e.to_string())?;
            }
            if task >= LATE * ROUNDS {
                results
                    .write_all(outcome_line(&run_id, task, 2).as_bytes())
                    .map_err(|e| e.to_string())?;
            }
        }
        failures.flush().map_err(|e| e.to_string())?;
        results.flush().map_err(|e| e.to_string())?;
    }
    report.note(format!(
        "{name}: {} outcome lines written in {:.2} s",
        3 * ROLLOUTS - LATE * ROUNDS,
        began.elapsed().as_secs_f64()
    ));
    let (bytes, read_took) = read_all(&run_dir)?;
    let rss_before = rss_kb(service.pid);
    let (coverage, counts, size, cold) = plan_once(&service, settings, &run_id).await?;
    report.note(format!(
        "{name}: GET plan cold {:.3} s ({:.1} MB answer, RSS {} -> {} MB); reading the run's \
         files once ({:.1} MB) takes {:.3} s: plan = {:.1} x read",
        cold.as_secs_f64(),
        size as f64 / 1e6,
        mb(rss_before),
        mb(rss_kb(service.pid)),
        bytes as f64 / 1e6,
        read_took.as_secs_f64(),
        cold.as_secs_f64() / read_took.as_secs_f64().max(1e-9)
    ));
    report.note(format!(
        "{name}: coverage {} state counts {}",
        truncate(&coverage.to_string(), 300),
        truncate(&counts.to_string(), 300)
    ));
    // The service trusts its index of the materialized inputs without hashing them again only
    // once they have been unchanged for 2 s (`recovery_runs::cache::SETTLE`); they are written
    // once, when the run is created, long before a resume's plan, so the warm plan is timed
    // after that window (within it every plan hashes them again: 5-20 ms more here).
    settle_file(&run_dir.join("out_materialized_inputs.jsonl")).await;
    let mut rounds = Vec::with_capacity(ROUNDS);
    let mut coverage_after = Value::Null;
    for round in 0..ROUNDS {
        let mut results = std::fs::OpenOptions::new()
            .append(true)
            .open(&results_path)
            .map_err(|e| format!("{results_path:?}: {e}"))?;
        let text: String = (round * LATE..(round + 1) * LATE)
            .map(|t| outcome_line(&run_id, t, 2))
            .collect();
        results
            .write_all(text.as_bytes())
            .map_err(|e| e.to_string())?;
        drop(results);
        let (coverage, _, _, again) = plan_once(&service, settings, &run_id).await?;
        rounds.push(again.as_secs_f64() * 1e3);
        coverage_after = coverage;
    }
    let listed: Vec<String> = rounds.iter().map(|ms| format!("{ms:.1}")).collect();
    rounds.sort_by(f64::total_cmp);
    report.note(format!(
        "{name}: GET plan after appending {LATE} outcome lines, {ROUNDS} rounds: median {:.1} ms, \
         max {:.1} ms ({} ms; each a new connection) (coverage after the last {})",
        rounds[ROUNDS / 2],
        rounds[ROUNDS - 1],
        listed.join(", "),
        truncate(&coverage_after.to_string(), 300)
    ));
    match console_times(&service, settings, &run_id).await {
        Ok(notes) => notes
            .into_iter()
            .for_each(|n| report.note(format!("{name}: {n}"))),
        Err(e) => report.note(format!("{name}: console pages not timed: {e}")),
    }
    let endpoint = format!("{}/runs/{run_id}/plan", service.url);
    let make: MakeRequest = Arc::new(move |client, _, _| client.get(&endpoint).bearer_auth(VIEWER));
    let load = Load::new(name, settings, settings.plan_conns).expect("\"coverage\"");
    let result = run_load(&load, &service.url, Some(service.pid), make, settings).await;
    report.push(result);
    service.stop(report, name);
    Ok(())
}

/// The operators' console over the 100k-rollout run: signs in as a viewer and times the run page
/// (its first page of the plan table and every state's count) and the runs page, each as time to the
/// first byte (headers) and to the last, best of five after one warm-up.
async fn console_times(
    service: &Service,
    settings: &Settings,
    run_id: &str,
) -> BenchResult<Vec<String>> {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(settings.setup_timeout)
        .build()
        .map_err(|e| e.to_string())?;
    let login = http
        .post(format!("{}/ui/login", service.url))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={VIEWER}"))
        .send()
        .await
        .map_err(|e| format!("sign-in: {e}"))?;
    let cookie = login
        .headers()
        .get(reqwest::header::SET_COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(str::to_owned)
        .ok_or_else(|| format!("sign-in answered {} without a cookie", login.status()))?;
    let mut notes = Vec::new();
    for (what, path, expect) in [
        ("console run page", format!("/ui/runs/{run_id}"), run_id),
        ("console runs page", "/ui/".to_owned(), run_id),
    ] {
        let mut best: Option<(Duration, Duration, usize)> = None;
        for round in 0..6 {
            let began = Instant::now();
            let answer = http
                .get(format!("{}{path}", service.url))
                .header(reqwest::header::COOKIE, &cookie)
                .send()
                .await
                .map_err(|e| format!("{path}: {e}"))?;
            let first_byte = began.elapsed();
            let status = answer.status();
            let body = answer.text().await.map_err(|e| format!("{path}: {e}"))?;
            let last_byte = began.elapsed();
            if !status.is_success() || !body.contains(expect) {
                return Err(format!(
                    "{path} answered {status}: {}",
                    truncate(&body, 300)
                ));
            }
            if round > 0 && best.is_none_or(|(t, _, _)| first_byte < t) {
                best = Some((first_byte, last_byte, body.len()));
            }
        }
        if let Some((first, last, bytes)) = best {
            notes.push(format!(
                "{what} {path}: first byte {:.1} ms, last byte {:.1} ms ({:.0} kB), best of 5 warm",
                first.as_secs_f64() * 1e3,
                last.as_secs_f64() * 1e3,
                bytes as f64 / 1e3
            ));
        }
    }
    Ok(notes)
}

/// Whether the service on `port` answers `GET /readyz` 200: its start-up (the reindex of the
/// sidecars under its roots) is done. It listens before that, answering 503 `starting`.
fn is_ready(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let asked =
        stream.write_all(b"GET /readyz HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n");
    let mut status = [0u8; 12];
    asked.is_ok() && stream.read_exact(&mut status).is_ok() && &status == b"HTTP/1.1 200"
}
