//! Real-binary proofs of the per-run critical section: concurrent clients while the service is
//! SIGKILLed and restarted lose no acknowledged change, and two service processes on one
//! PostgreSQL database hand out each execution number once.

use super::{BIN, COLLECTOR, OPERATOR, Server, VIEWER, config, global, prepare};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

/// Rows (rollouts `0-0` .. `19-0`) of every chaos run.
const ROWS: u64 = 20;
/// Runs the chaos clients share.
const RUNS: usize = 3;
/// Client tasks.
const CLIENTS: usize = 6;
/// SIGKILLs (each followed by a restart).
const KILLS: usize = 12;
/// How long a client waits for a killed service to answer again.
const COME_BACK: Duration = Duration::from_secs(20);

/// A tiny seeded xorshift64 generator (no new crates).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        // splitmix64 of the seed: nearby seeds give unrelated streams, never the zero state.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Self((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn between_ms(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(low + self.below(high - low + 1))
    }
}

/// The seed: `RR_CHAOS_SEED` when set (to replay a run), else the clock. Printed either way.
fn seed() -> u64 {
    let seed = std::env::var("RR_CHAOS_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            let nanos = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .expect("clock")
                .as_nanos();
            (nanos as u64) ^ u64::from(std::process::id())
        });
    eprintln!("chaos seed: {seed} (RR_CHAOS_SEED={seed} replays its choices, not its timing)");
    seed
}

impl Server {
    /// Starts `serve` on `port` (a free one when `None`) with extra environment, its stderr
    /// appended to `log`; returns once it is ready (`/readyz`), and fails at once when it exits.
    pub(super) fn start_with(
        data: &Path,
        root: &Path,
        port: Option<u16>,
        env: &[(&str, &str)],
        log: &Path,
    ) -> Self {
        Self::start_until(data, root, port, env, log, crate::is_ready)
    }

    /// [`Self::start_with`], returning once `reached(port)` holds.
    fn start_until(
        data: &Path,
        root: &Path,
        port: Option<u16>,
        env: &[(&str, &str)],
        log: &Path,
        reached: fn(u16) -> bool,
    ) -> Self {
        let port = port.unwrap_or_else(|| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .expect("port")
                .local_addr()
                .expect("addr")
                .port()
        });
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("log file");
        let mut command = Command::new(BIN);
        command
            .args([
                "serve",
                "--bind",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(data)
            .arg("--root")
            .arg(root)
            .env(
                "RR_TOKENS",
                format!("operator:alice:{OPERATOR},collector:c1:{COLLECTOR},viewer:dash:{VIEWER}"),
            )
            // Warnings, and the start-up report of removed temporaries.
            .env("RR_LOG", "warn,recovery_server=info")
            .env("RR_LOG_FORMAT", "json")
            .stdout(Stdio::null())
            .stderr(stderr);
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("serve");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().expect("child status") {
                panic!(
                    "the service exited before it was ready ({status}): {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
            if reached(port) {
                return Self {
                    child,
                    url: format!("http://127.0.0.1:{port}"),
                };
            }
            assert!(
                Instant::now() < deadline,
                "the service did not reach its state on {port}"
            );
            // Polling for the state, not standing in for it.
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL (no drain, no lease release), then reap.
    fn kill(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    fn port(&self) -> u16 {
        self.url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("port in url")
    }
}

/// Percent-encodes a query value.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The id the service derives for a journal line (`recovery_runs::events::line_id`).
fn line_id(run_id: &str, journal: &str, offset: u64, bytes: &[u8]) -> String {
    let mut text = format!("{run_id}\n{journal}\n{offset}\n").into_bytes();
    text.extend_from_slice(bytes);
    recovery_core::canonical::sha256_hex(&text)[..32].to_owned()
}

/// The complete lines of a journal with their byte offsets (a missing file has none).
fn journal_lines(path: &Path) -> Vec<(u64, Vec<u8>)> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => panic!("reading {}: {e}", path.display()),
    };
    let mut lines = Vec::new();
    let mut offset = 0u64;
    let mut rest = bytes.as_slice();
    while let Some(end) = rest.iter().position(|b| *b == b'\n') {
        lines.push((offset, rest[..end].to_vec()));
        offset += end as u64 + 1;
        rest = &rest[end + 1..];
    }
    lines
}

/// The derived ids of a journal's lines, checking each line names `run_id` when it has the field.
fn journal_ids(path: &Path, run_id: &str, journal: &str) -> BTreeSet<String> {
    journal_lines(path)
        .into_iter()
        .map(|(offset, bytes)| {
            let line: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                panic!("{}@{offset} is not JSON: {e}", path.display());
            });
            if let Some(named) = line.get("run_id") {
                assert_eq!(
                    named.as_str(),
                    Some(run_id),
                    "{}@{offset} belongs to its manifest's run",
                    path.display()
                );
            }
            line_id(run_id, journal, offset, &bytes)
        })
        .collect()
}

fn code(reply: &Value) -> &str {
    reply["code"].as_str().unwrap_or_default()
}

/// The collector's failure line of attempt `attempt` of rollout `task`-0 in run `run_id`: a
/// judge failure on a saved answer (a re-judgment's predecessor).
fn failure_line(run_id: &str, task: u64, attempt: i64) -> String {
    json!({"_ng_task_index": task, "_ng_rollout_index": 0, "_ng_attempt_index": attempt, "_ng_run_id": run_id,
        "_ng_failure_class": "judge_failed", "response": {"output": [{"type": "message"}], "status": "completed"}})
    .to_string()
}

fn chaos_rows() -> Value {
    (0..ROWS)
        .map(|t| json!({"agent_ref": {"name": "agent"}, "_ng_task_index": t, "_ng_rollout_index": 0}))
        .collect()
}

/// One output the clients share, and the run that owns it now.
#[derive(Debug)]
struct Slot {
    output: PathBuf,
    run_id: String,
}

/// What the service acknowledged with a 2xx.
#[derive(Debug, Default)]
struct Acks {
    /// (run, rollout, execution number).
    reservations: Vec<(String, String, i64)>,
    /// (run, drift event id).
    drift: Vec<(String, String)>,
    /// (run, extension event id).
    extensions: Vec<(String, String)>,
    /// (run, attempt key, operation id).
    admitted: Vec<(String, String, String)>,
    /// Operation ids whose close was acknowledged.
    closed: BTreeSet<String>,
    /// Operation ids whose close got no answer (closed or not).
    close_unknown: BTreeSet<String>,
    /// (run, approval id) of acknowledged masked-rerun approvals.
    approved: Vec<(String, String)>,
    /// Approval ids whose revocation was acknowledged.
    revoked: BTreeSet<String>,
    /// Approval ids whose revocation got no answer (revoked or not).
    revoke_unknown: BTreeSet<String>,
    /// (superseded run, the run found on disk after it).
    superseded: Vec<(String, String)>,
    /// Runs with an acknowledged resume that opted in to retrying terminal timeouts.
    opted_in: BTreeSet<String>,
    replaces: usize,
}

#[derive(Debug)]
struct Chaos {
    client: reqwest::Client,
    url: RwLock<String>,
    root: PathBuf,
    slots: Vec<Mutex<Slot>>,
    /// Serialises the test's replacements and its failure-file writes with slot switches.
    switch: tokio::sync::Mutex<()>,
    acks: Mutex<Acks>,
    unexpected: Mutex<Vec<String>>,
    stop: AtomicBool,
}

type Reply = Option<(u16, Value)>;

impl Chaos {
    fn url(&self) -> String {
        self.url.read().expect("url").clone()
    }

    fn acks(&self) -> std::sync::MutexGuard<'_, Acks> {
        self.acks.lock().expect("acks")
    }

    fn run_id(&self, slot: usize) -> String {
        self.slots[slot].lock().expect("slot").run_id.clone()
    }

    fn output(&self, slot: usize) -> PathBuf {
        self.slots[slot].lock().expect("slot").output.clone()
    }

    /// One request to whichever service runs now; `None` when the connection failed (the
    /// change may or may not have happened).
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<&Value>,
    ) -> Reply {
        let mut request = self
            .client
            .request(method, format!("{}{path}", self.url()))
            .bearer_auth(token);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.ok()?;
        let status = response.status().as_u16();
        let bytes = response.bytes().await.ok()?;
        let reply = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        // A restarted service refuses everything 503 `starting` until its reindex is done: no
        // answer yet, as while it was down (wait for it and ask again).
        if status == 503 && code(&reply) == "starting" {
            return None;
        }
        Some((status, reply))
    }

    /// Polls until a service answers `/readyz` 200 (short back-offs while it is down or
    /// starting).
    async fn wait_up(&self) {
        let deadline = Instant::now() + COME_BACK;
        loop {
            if let Some((200, _)) = self
                .send(reqwest::Method::GET, "/readyz", VIEWER, None)
                .await
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the service did not come back within {COME_BACK:?}"
            );
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
    }

    /// Sends until an answer arrives (only for requests that are safe to repeat).
    async fn send_answered(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        for _ in 0..20 {
            if let Some(reply) = self.send(method.clone(), path, token, body).await {
                return reply;
            }
            self.wait_up().await;
        }
        panic!("{method} {path} got no answer in 20 tries");
    }

    fn unexpected(&self, what: &str, path: &str, body: Option<&Value>, status: u16, reply: &Value) {
        let body = body.map(Value::to_string).unwrap_or_default();
        self.unexpected
            .lock()
            .expect("unexpected")
            .push(format!("{what}: {path} {body} -> {status} {reply}"));
    }

    /// Appends a failure line of run `run_id` to the failures sidecar of the slot's output, as
    /// the lease holder's collector does after a failed judge call; `false` (nothing written)
    /// when the output belongs to another run now. Under the switch lock: the test replaces no
    /// run meanwhile, and a line never lands in another run's sidecar.
    async fn append_failure(&self, slot: usize, run_id: &str, line: &str) -> bool {
        self.append_outcome(slot, run_id, line, false).await
    }

    /// [`Self::append_failure`] for the results file (`results`) or the failures sidecar.
    async fn append_outcome(&self, slot: usize, run_id: &str, line: &str, results: bool) -> bool {
        let _switch = self.switch.lock().await;
        if self.run_id(slot) != run_id {
            return false;
        }
        let paths = recovery_sidecar::SidecarPaths::for_output(&self.output(slot));
        let failures = if results {
            paths.output
        } else {
            paths.failures
        };
        match std::fs::OpenOptions::new().append(true).open(&failures) {
            Ok(mut file) => {
                std::io::Write::write_all(&mut file, format!("{line}\n").as_bytes())
                    .expect("append");
                true
            }
            // Only a run that lost its files (see `refused`) has no failures sidecar.
            Err(e) => {
                self.unexpected(
                    &format!("{} of run {run_id}: {e}", failures.display()),
                    "",
                    None,
                    0,
                    &Value::Null,
                );
                false
            }
        }
    }

    /// Switches a slot to the run its output holds on disk now (the one the service adopts).
    /// Under the switch lock: no replacement of the test runs meanwhile.
    async fn refresh_slot(&self, slot: usize) {
        let output = self.output(slot);
        let path = format!(
            "/runs?output_path={}",
            encode(&output.display().to_string())
        );
        // The slot must learn the truth before the switch lock is released (a collector line
        // written under a stale run id would corrupt the new run's failures sidecar).
        let mut found = None;
        for _ in 0..50 {
            let (status, reply) = self
                .send_answered(reqwest::Method::GET, &path, VIEWER, None)
                .await;
            match reply["runs"][0]["run_id"].as_str() {
                Some(run_id) if status == 200 => {
                    found = Some(run_id.to_owned());
                    break;
                }
                _ => {
                    self.unexpected("lookup", &path, None, status, &reply);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        let current = found.unwrap_or_else(|| panic!("{path} never answered its run"));
        let current = current.as_str();
        let previous = self.run_id(slot);
        if current == previous {
            return;
        }
        self.slots[slot].lock().expect("slot").run_id = current.to_owned();
        self.acks()
            .superseded
            .push((previous.clone(), current.to_owned()));
        let path = format!("/runs/{previous}");
        let (status, reply) = self
            .send_answered(reqwest::Method::GET, &path, VIEWER, None)
            .await;
        if (status, code(&reply)) != (409, "run_superseded")
            || reply["details"]["superseded_by"].as_str().is_none()
        {
            self.unexpected("superseded run", &path, None, status, &reply);
        }
    }

    /// An operator replaces the slot's run (then the slot follows the run on disk).
    async fn replace(&self, slot: usize) {
        let _switch = self.switch.lock().await;
        let output = self.output(slot);
        let body = json!({"output_path": output, "source_path": self.root.join("src/train.jsonl"), "config": config(0.3),
            "global_config": global(8000), "rows": chaos_rows(), "replace": true});
        match self
            .send(reqwest::Method::POST, "/runs", OPERATOR, Some(&body))
            .await
        {
            None => self.wait_up().await,
            Some((201, reply)) => {
                self.acks().replaces += 1;
                if reply["replaced"].as_array().is_none_or(Vec::is_empty) {
                    self.unexpected("replace moved nothing", "/runs", None, 201, &reply);
                }
            }
            // A collector holds the run: a replacement waits for its lease to end.
            Some((423, reply)) if reply["code"] == "run_locked" => {}
            Some((status, reply)) => self.unexpected("replace", "/runs", None, status, &reply),
        }
        self.refresh_slot(slot).await;
    }

    /// A client saw the slot's run superseded: follow the output to its run now.
    async fn follow(&self, slot: usize, run_id: &str) {
        let _switch = self.switch.lock().await;
        if self.run_id(slot) == run_id {
            self.refresh_slot(slot).await;
        }
    }

    async fn extend(&self, slot: usize) {
        let run_id = self.run_id(slot);
        let path = format!("/runs/{run_id}/attempts/extend");
        let body = json!({"extend_attempts": 1, "reason": "chaos"});
        match self
            .send(reqwest::Method::POST, &path, OPERATOR, Some(&body))
            .await
        {
            None => self.wait_up().await,
            Some((201, reply)) => {
                let id = reply["event_id"].as_str().expect("event id").to_owned();
                if reply["run_id"].as_str() != Some(run_id.as_str()) {
                    self.unexpected("extension of another run", &path, None, 201, &reply);
                }
                self.acks().extensions.push((run_id, id));
            }
            Some((409, reply)) if code(&reply) == "run_superseded" => {
                self.follow(slot, &run_id).await;
            }
            Some((423, _)) => {}
            Some((status, reply)) => self.unexpected("extend", &path, Some(&body), status, &reply),
        }
    }

    async fn reindex(&self) {
        match self
            .send(reqwest::Method::POST, "/reindex", OPERATOR, None)
            .await
        {
            None => self.wait_up().await,
            Some((200, _)) => {}
            Some((status, reply)) => self.unexpected("reindex", "/reindex", None, status, &reply),
        }
    }

    /// A lease, a few changes under it, then its release.
    async fn burst(&self, slot: usize, client: usize, rng: &mut Rng) {
        let run_id = self.run_id(slot);
        let path = format!("/runs/{run_id}/lease");
        let body = json!({"holder": format!("client-{client}"), "host": "chaos", "pid": client, "ttl_seconds": 4});
        let lease = match self
            .send(reqwest::Method::POST, &path, COLLECTOR, Some(&body))
            .await
        {
            None => return self.wait_up().await,
            Some((201, reply)) => reply["lease_id"].as_str().expect("lease id").to_owned(),
            Some((423, _)) => {
                // Held by another client (or an orphan of a killed process until its TTL).
                tokio::time::sleep(rng.between_ms(5, 30)).await;
                return;
            }
            Some((409, reply)) if code(&reply) == "run_superseded" => {
                return self.follow(slot, &run_id).await;
            }
            Some((status, reply)) => {
                return self.unexpected("lease", &path, Some(&body), status, &reply);
            }
        };
        for _ in 0..2 + rng.below(6) {
            let keep = match rng.below(10) {
                0..=4 => self.reserve(slot, &run_id, &lease, rng).await,
                5..=7 => self.validate(slot, &run_id, &lease, rng).await,
                _ => self.heartbeat(&run_id, &lease).await,
            };
            if !keep {
                break;
            }
        }
        let path = format!("/runs/{run_id}/lease");
        let body = json!({"lease_id": lease});
        let (status, reply) = self
            .send_answered(reqwest::Method::DELETE, &path, COLLECTOR, Some(&body))
            .await;
        if !(status == 204 || (status == 409 && code(&reply) == "lease_not_held")) {
            self.unexpected("release", &path, Some(&body), status, &reply);
        }
    }

    /// Handles the answers every leased change may give; returns whether the burst goes on.
    async fn refused(
        &self,
        what: &str,
        slot: usize,
        run_id: &str,
        path: &str,
        body: &Value,
        reply: Reply,
    ) -> bool {
        match reply {
            None => {
                self.wait_up().await;
                true
            }
            Some((409, reply)) if code(&reply) == "lease_not_held" => false,
            Some((409, reply)) if code(&reply) == "run_superseded" => {
                self.follow(slot, run_id).await;
                false
            }
            Some((423, _)) => false,
            Some((status, reply)) => {
                self.unexpected(what, path, Some(body), status, &reply);
                if ["no_manifest", "manifest_unreadable"].contains(&code(&reply)) {
                    // The run's output lost its manifest: an operator starts it afresh.
                    self.replace(slot).await;
                }
                false
            }
        }
    }

    async fn reserve(&self, slot: usize, run_id: &str, lease: &str, rng: &mut Rng) -> bool {
        let ids: BTreeSet<String> = (0..1 + rng.below(3))
            .map(|_| format!("{}-0", rng.below(ROWS)))
            .collect();
        let path = format!("/runs/{run_id}/attempts/reserve");
        let body = json!({"lease_id": lease, "rollout_ids": ids});
        let reply = self
            .send(reqwest::Method::POST, &path, COLLECTOR, Some(&body))
            .await;
        if let Some((409, refusal)) = &reply {
            if code(refusal) == "not_eligible" {
                // Rollouts picked at random include answers the plan keeps (scored, masked
                // awaiting an approval): refused by name, nothing reserved.
                let named: Vec<&str> = refusal["details"]["not_runnable"]
                    .as_array()
                    .map(|list| {
                        list.iter()
                            .filter_map(|entry| entry["rollout_id"].as_str())
                            .collect()
                    })
                    .unwrap_or_default();
                if named.is_empty() || named.iter().any(|id| !ids.contains(*id)) {
                    self.unexpected("reserve refusal", &path, Some(&body), 409, refusal);
                }
                return true;
            }
        }
        let Some((200, answer)) = &reply else {
            return self
                .refused("reserve", slot, run_id, &path, &body, reply)
                .await;
        };
        let attempts: Vec<(String, i64)> = answer["attempts"]
            .as_object()
            .map(|a| {
                a.iter()
                    .filter_map(|(id, n)| Some((id.clone(), n.as_i64()?)))
                    .collect()
            })
            .unwrap_or_default();
        if attempts.len() != ids.len() || attempts.iter().any(|(id, _)| !ids.contains(id)) {
            self.unexpected("reserve answer", &path, Some(&body), 200, answer);
        }
        self.acks().reservations.extend(
            attempts
                .iter()
                .map(|(id, n)| (run_id.to_owned(), id.clone(), *n)),
        );
        let Some((id, n)) = attempts.first() else {
            return true;
        };
        match rng.below(6) {
            0 | 1 => self.rejudge(slot, run_id, lease, id, *n, rng).await,
            2 => self.approve(slot, run_id, id, *n, rng).await,
            _ => true,
        }
    }

    /// Saves a masked result that kept an answer without a grade for a reserved attempt (as the
    /// collector does), has an operator approve rerunning it, and sometimes revokes the approval.
    async fn approve(
        &self,
        slot: usize,
        run_id: &str,
        rollout: &str,
        attempt: i64,
        rng: &mut Rng,
    ) -> bool {
        let task: u64 = rollout
            .split('-')
            .next()
            .and_then(|t| t.parse().ok())
            .expect("task index");
        let line = json!({"_ng_task_index": task, "_ng_rollout_index": 0, "_ng_attempt_index": attempt,
            "_ng_run_id": run_id, "reward": 0.0, "mask_sample": true, "failure_kind": "verifier_error",
            "response": {"output": [{"type": "message"}], "status": "completed"}})
        .to_string();
        if !self.append_outcome(slot, run_id, &line, true).await {
            return true;
        }
        let path = format!("/runs/{run_id}/approvals");
        let body = json!({"task_index": task, "rollout_index": 0, "attempt_index": attempt,
            "reason": "the verifier lost the artifact"});
        let reply = self
            .send(reqwest::Method::POST, &path, OPERATOR, Some(&body))
            .await;
        let Some((201, answer)) = &reply else {
            return self
                .refused("approve", slot, run_id, &path, &body, reply)
                .await;
        };
        let id = answer["approval_id"]
            .as_str()
            .expect("approval id")
            .to_owned();
        self.acks().approved.push((run_id.to_owned(), id.clone()));
        if rng.below(2) == 0 {
            return true;
        }
        let path = format!("/runs/{run_id}/approvals/{id}");
        let reply = self
            .send(reqwest::Method::DELETE, &path, OPERATOR, None)
            .await;
        match &reply {
            Some((204, _)) => {
                self.acks().revoked.insert(id);
                true
            }
            // Used meanwhile: after a restart this client's lease may have been found orphaned
            // and another client's reserve used the approval. It stays a journal line.
            Some((409, reply)) if code(reply) == "conflict" => true,
            None => {
                self.acks().revoke_unknown.insert(id);
                self.wait_up().await;
                true
            }
            _ => {
                self.acks().revoke_unknown.insert(id);
                self.refused("revoke", slot, run_id, &path, &Value::Null, reply)
                    .await
            }
        }
    }

    /// The unrevoked approvals the service lists for a run.
    async fn unrevoked_approvals(&self, run_id: &str) -> BTreeSet<String> {
        let path = format!("/runs/{run_id}/approvals");
        let (status, reply) = self
            .send_answered(reqwest::Method::GET, &path, VIEWER, None)
            .await;
        assert_eq!(status, 200, "{path}: {reply}");
        reply
            .as_array()
            .expect("approvals")
            .iter()
            .filter(|a| a["revoked_at"].is_null())
            .map(|a| a["approval_id"].as_str().expect("id").to_owned())
            .collect()
    }

    /// Saves a failed judge call of a reserved attempt, admits its re-judgment (the failure line
    /// is the predecessor), sometimes twice (idempotent), and sometimes closes it.
    async fn rejudge(
        &self,
        slot: usize,
        run_id: &str,
        lease: &str,
        rollout: &str,
        attempt: i64,
        rng: &mut Rng,
    ) -> bool {
        let task: u64 = rollout
            .split('-')
            .next()
            .and_then(|t| t.parse().ok())
            .expect("task index");
        let line = failure_line(run_id, task, attempt);
        if !self.append_failure(slot, run_id, &line).await {
            return true;
        }
        let path = format!("/runs/{run_id}/rejudgments");
        let body = json!({"lease_id": lease, "rollout_id": rollout, "attempt": attempt,
            "predecessor_failure_id": format!("f-{rollout}-{attempt}"), "predecessor_line": line});
        let mut operation: Option<String> = None;
        for _ in 0..1 + rng.below(2) {
            let reply = self
                .send(reqwest::Method::POST, &path, COLLECTOR, Some(&body))
                .await;
            match &reply {
                Some((201 | 200, answer)) => {
                    let id = answer["operation_id"]
                        .as_str()
                        .expect("operation id")
                        .to_owned();
                    if operation.as_ref().is_some_and(|first| *first != id) {
                        self.unexpected(
                            "a second admission of one predecessor answered another operation",
                            &path,
                            Some(&body),
                            200,
                            answer,
                        );
                    }
                    self.acks().admitted.push((
                        run_id.to_owned(),
                        format!("{rollout}-a{attempt}"),
                        id.clone(),
                    ));
                    operation = Some(id);
                }
                _ => {
                    return self
                        .refused("admit", slot, run_id, &path, &body, reply)
                        .await;
                }
            }
        }
        let Some(operation) = operation.filter(|_| rng.below(2) == 0) else {
            return true;
        };
        let path = format!("/runs/{run_id}/rejudgments/{operation}/close");
        let body = json!({"lease_id": lease, "outcome": "graded"});
        let reply = self
            .send(reqwest::Method::POST, &path, COLLECTOR, Some(&body))
            .await;
        match &reply {
            Some((204, _)) => {
                self.acks().closed.insert(operation);
                true
            }
            None => {
                self.acks().close_unknown.insert(operation);
                self.wait_up().await;
                true
            }
            _ => {
                self.acks().close_unknown.insert(operation);
                self.refused("close", slot, run_id, &path, &body, reply)
                    .await
            }
        }
    }

    async fn validate(&self, slot: usize, run_id: &str, lease: &str, rng: &mut Rng) -> bool {
        let port = 9000 + rng.below(500) as i64;
        let path = format!("/runs/{run_id}/validate");
        // One resume in eight opts in to retrying terminal timeouts: the manifest write it
        // makes is killed in the middle like every other.
        let opts_in = rng.below(8) == 0;
        let mut settings = config(0.3);
        if opts_in {
            settings["retry_terminal_timeouts"] = json!(true);
        }
        let body = json!({"config": settings, "global_config": global(port),
            "source_path": self.root.join("src/train.jsonl"), "lease_id": lease});
        let reply = self
            .send(reqwest::Method::POST, &path, COLLECTOR, Some(&body))
            .await;
        match &reply {
            Some((200, answer)) if answer["outcome"] == "resume_with_drift" => {
                let id = answer["drift_event_id"]
                    .as_str()
                    .expect("drift event id")
                    .to_owned();
                if answer["run_id"].as_str() != Some(run_id) {
                    self.unexpected("validate answered another run", &path, None, 200, answer);
                }
                let mut acks = self.acks();
                acks.drift.push((run_id.to_owned(), id));
                if opts_in {
                    acks.opted_in.insert(run_id.to_owned());
                }
                true
            }
            _ => {
                self.refused("validate", slot, run_id, &path, &body, reply)
                    .await
            }
        }
    }

    async fn heartbeat(&self, run_id: &str, lease: &str) -> bool {
        let path = format!("/runs/{run_id}/lease/heartbeat");
        let body = json!({"lease_id": lease, "ttl_seconds": 4});
        match self
            .send(reqwest::Method::POST, &path, COLLECTOR, Some(&body))
            .await
        {
            None => {
                self.wait_up().await;
                true
            }
            Some((200, _)) => true,
            // A restarted service does not hold the killed one's leases.
            Some((409, reply)) if code(&reply) == "lease_not_held" => false,
            Some((status, reply)) => {
                self.unexpected("heartbeat", &path, Some(&body), status, &reply);
                false
            }
        }
    }

    /// Every page of a drift listing: event id -> run id.
    async fn drift_listing(&self, path: &str) -> BTreeMap<String, String> {
        let mut events = BTreeMap::new();
        let mut cursor: Option<String> = None;
        for _ in 0..100 {
            let separator = if path.contains('?') { '&' } else { '?' };
            let page_path = match &cursor {
                Some(c) => format!("{path}{separator}limit=1000&cursor={}", encode(c)),
                None => format!("{path}{separator}limit=1000"),
            };
            let (status, page) = self
                .send_answered(reqwest::Method::GET, &page_path, VIEWER, None)
                .await;
            assert_eq!(status, 200, "{page_path}: {page}");
            for event in page["events"].as_array().expect("events") {
                let id = event["event_id"].as_str().expect("event id").to_owned();
                let run = event["run_id"].as_str().expect("run id").to_owned();
                assert!(
                    events.insert(id.clone(), run).is_none(),
                    "{id} listed twice"
                );
            }
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => return events,
            }
        }
        panic!("{path}: more than 100 pages");
    }

    /// The runs a service records that own their output (not superseded), without times.
    async fn live_runs(&self) -> BTreeMap<String, Value> {
        let (status, listed) = self
            .send_answered(reqwest::Method::GET, "/runs?limit=1000", VIEWER, None)
            .await;
        assert_eq!(status, 200, "{listed}");
        let runs = listed["runs"].as_array().expect("runs");
        assert!(runs.len() < 1000, "one page holds every run");
        runs.iter()
            .filter(|r| r["superseded_by"].is_null())
            .map(|r| {
                let mut record = r.clone();
                let object = record.as_object_mut().expect("record");
                object.remove("created_at");
                object.remove("updated_at");
                (r["run_id"].as_str().expect("run id").to_owned(), record)
            })
            .collect()
    }
}

/// The extension rows of a service's SQLite database (run id -> event ids), read with
/// Python's sqlite3 (the tests' Python is required anyway); the service may be running.
fn extension_rows(db: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let script = "import json, sqlite3, sys\ncon = sqlite3.connect(sys.argv[1])\nprint(json.dumps(con.execute('SELECT run_id, event_id FROM attempt_extensions').fetchall()))\ncon.close()\n";
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(db)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<(String, String)> = serde_json::from_slice(&out.stdout).expect("rows");
    let mut by_run: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (run, id) in rows {
        by_run.entry(run).or_default().insert(id);
    }
    by_run
}

/// What two run -> ids maps disagree on: `(run, id)` only in the database, only in the files.
fn difference(
    database: &BTreeMap<String, BTreeSet<String>>,
    files: &BTreeMap<String, BTreeSet<String>>,
) -> String {
    let pairs = |map: &BTreeMap<String, BTreeSet<String>>| -> BTreeSet<(String, String)> {
        map.iter()
            .flat_map(|(run, ids)| ids.iter().map(move |id| (run.clone(), id.clone())))
            .collect()
    };
    let (database, files) = (pairs(database), pairs(files));
    format!(
        "only in the database {:?}; only in the files {:?}",
        database.difference(&files).collect::<Vec<_>>(),
        files.difference(&database).collect::<Vec<_>>()
    )
}

/// The error lines the services logged (their stderr files under `logs`).
fn service_errors(logs: &Path) -> String {
    let mut names: Vec<PathBuf> = std::fs::read_dir(logs)
        .expect("logs")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    names.sort();
    names
        .iter()
        .flat_map(|path| {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            std::fs::read_to_string(path)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("ERROR"))
                .map(|l| format!("{}: {l}", name.clone().unwrap_or_default()))
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// How many hidden temporaries the services removed at start-up (their logs say so).
fn temporaries_removed(logs: &Path) -> usize {
    std::fs::read_dir(logs)
        .expect("logs")
        .filter_map(Result::ok)
        .map(|e| {
            std::fs::read_to_string(e.path())
                .unwrap_or_default()
                .lines()
                .filter(|line| {
                    // One line per removed file, naming it.
                    serde_json::from_str::<Value>(line).is_ok_and(|event| {
                        let fields = &event["fields"];
                        fields["message"]
                            .as_str()
                            .is_some_and(|m| m.starts_with("removed a temporary"))
                            && fields["path"].as_str().is_some_and(|p| p.ends_with(".tmp"))
                    })
                })
                .count()
        })
        .sum()
}

/// A run's manifest on disk (current or moved aside by a replacement) and its journals.
#[derive(Debug)]
struct RunOnDisk {
    manifest: Value,
    current: bool,
    drift: PathBuf,
    extension: PathBuf,
    approvals: PathBuf,
}

/// Every manifest beside the outputs, current (`out_manifest.json`) or moved aside
/// (`out_manifest.json.replaced-...`), by run id, with the journals that were moved with it.
fn runs_on_disk(outputs: &[PathBuf]) -> BTreeMap<String, RunOnDisk> {
    let mut runs = BTreeMap::new();
    for output in outputs {
        let paths = recovery_sidecar::SidecarPaths::for_output(output);
        let manifest_name = paths
            .manifest
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let directory = output.parent().expect("directory");
        for entry in std::fs::read_dir(directory).expect("run directory") {
            let name = entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned();
            let Some(suffix) = name.strip_prefix(&manifest_name) else {
                continue;
            };
            if !(suffix.is_empty() || suffix.starts_with(".replaced-")) {
                continue;
            }
            let text = std::fs::read(directory.join(&name)).expect("manifest");
            let manifest: Value = serde_json::from_slice(&text).expect("manifest json");
            let run_id = manifest["run_id"].as_str().expect("run id").to_owned();
            let with = |path: &Path| PathBuf::from(format!("{}{suffix}", path.display()));
            let found = RunOnDisk {
                current: suffix.is_empty(),
                drift: with(&paths.resume_drift),
                extension: with(&paths.attempt_extension),
                approvals: with(&paths.rerun_masked),
                manifest,
            };
            assert!(
                runs.insert(run_id.clone(), found).is_none(),
                "run {run_id} has two manifests"
            );
        }
    }
    runs
}

/// Hidden temporaries of atomic writes (`.<name>.<32 hex>.tmp`) under `root`, with their mtimes.
fn temporaries(root: &Path) -> Vec<(PathBuf, SystemTime)> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("dir").filter_map(Result::ok) {
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path).expect("metadata");
            if meta.is_dir() {
                pending.push(path);
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let temporary = name
                .strip_prefix('.')
                .and_then(|n| n.strip_suffix(".tmp"))
                .and_then(|n| n.rsplit_once('.'))
                .is_some_and(|(target, id)| {
                    !target.is_empty()
                        && id.len() == 32
                        && id.bytes().all(|b| b.is_ascii_hexdigit())
                });
            if temporary {
                found.push((path, meta.modified().expect("mtime")));
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chaos_of_concurrent_clients_and_sigkills_loses_no_acknowledged_change() {
    let began = Instant::now();
    let seed = seed();
    // RR_CHAOS_KEEP=1 keeps the data, roots and service logs for a post-mortem.
    let keep = std::env::var_os("RR_CHAOS_KEEP").is_some();
    let dir = tempfile::Builder::new()
        .disable_cleanup(keep)
        .tempdir()
        .expect("dir");
    if keep {
        eprintln!("chaos directory: {}", dir.path().display());
    }
    let (data, root, _) = prepare(dir.path());
    let root = std::fs::canonicalize(&root).expect("root");
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).expect("logs");
    let log = |n: usize| logs.join(format!("serve-{n}.log"));
    let first = Server::start_with(&data, &root, None, &[], &log(0));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()
        .expect("client");

    // Three runs of 20 rows.
    let mut slots = Vec::new();
    for n in 0..RUNS {
        let output = root.join(format!("exp{n}/out.jsonl"));
        let body = json!({"output_path": output, "source_path": root.join("src/train.jsonl"), "config": config(0.3),
            "global_config": global(8000), "rows": chaos_rows()});
        let (status, created) = super::call(
            &client,
            &first,
            reqwest::Method::POST,
            "/runs",
            COLLECTOR,
            Some(body),
        )
        .await;
        assert_eq!(status, 201, "{created}");
        let run_id = created["run_id"].as_str().expect("run id").to_owned();
        slots.push(Mutex::new(Slot { output, run_id }));
    }
    let chaos = Arc::new(Chaos {
        client,
        url: RwLock::new(first.url.clone()),
        root: root.clone(),
        slots,
        switch: tokio::sync::Mutex::new(()),
        acks: Mutex::new(Acks::default()),
        unexpected: Mutex::new(Vec::new()),
        stop: AtomicBool::new(false),
    });

    let mut clients = Vec::new();
    for index in 0..CLIENTS {
        let chaos = chaos.clone();
        let seed = seed.wrapping_add(1 + index as u64);
        clients.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed);
            let mut iterations = 0u64;
            while !chaos.stop.load(Ordering::SeqCst) {
                iterations += 1;
                assert!(iterations < 100_000, "a client loop ran away");
                let slot = rng.below(RUNS as u64) as usize;
                match rng.below(100) {
                    0..=2 => chaos.replace(slot).await,
                    3..=9 => chaos.extend(slot).await,
                    10..=11 => chaos.reindex().await,
                    _ => chaos.burst(slot, index, &mut rng).await,
                }
            }
            iterations
        }));
    }

    let killer = {
        let chaos = chaos.clone();
        let (data, root) = (data.clone(), root.clone());
        let logs = logs.clone();
        tokio::spawn(async move {
            let mut rng = Rng::new(seed ^ 0x5eed);
            let mut server = first;
            let mut last_start = SystemTime::now();
            for kill in 1..=KILLS {
                tokio::time::sleep(rng.between_ms(150, 650)).await;
                // Every fourth restart moves to a new port; the others reuse the port.
                let port = (kill % 4 != 0).then(|| server.port());
                server.kill();
                let (data, root) = (data.clone(), root.clone());
                let log = logs.join(format!("serve-{kill}.log"));
                last_start = SystemTime::now();
                server = tokio::task::spawn_blocking(move || {
                    Server::start_with(&data, &root, port, &[], &log)
                })
                .await
                .expect("the service comes up after a SIGKILL");
                *chaos.url.write().expect("url") = server.url.clone();
            }
            (server, last_start)
        })
    };
    let (server, last_start) = tokio::time::timeout(Duration::from_secs(40), killer)
        .await
        .expect("the kills finish in time")
        .expect("killer");
    chaos.stop.store(true, Ordering::SeqCst);
    let mut iterations = 0;
    for client in clients {
        iterations += tokio::time::timeout(Duration::from_secs(20), client)
            .await
            .expect("clients stop in time")
            .expect("client");
    }
    let chaos_done = began.elapsed();

    let acks = std::mem::take(&mut *chaos.acks());
    {
        // Shown with any failure below: what the service answered that the chaos does not explain.
        let unexpected = chaos.unexpected.lock().expect("unexpected");
        for line in unexpected.iter() {
            eprintln!("unexpected answer: {line}");
        }
    }
    let outputs: Vec<PathBuf> = (0..RUNS).map(|n| chaos.output(n)).collect();
    let on_disk = runs_on_disk(&outputs);

    // (d) Temporaries older than the last start were removed by it (the start-up logs count
    // those the restarts removed; the summary below prints it).
    let removed = temporaries_removed(&logs);
    for (path, modified) in temporaries(&root) {
        assert!(
            modified >= last_start,
            "{} was left by a killed process and survived the last start",
            path.display()
        );
    }

    // (a) Every acknowledged execution number is unique per rollout and saved in the manifest.
    let mut numbers: BTreeMap<(String, String), BTreeSet<i64>> = BTreeMap::new();
    for (run, rollout, n) in &acks.reservations {
        assert!(
            numbers
                .entry((run.clone(), rollout.clone()))
                .or_default()
                .insert(*n),
            "execution number {n} of {rollout} in run {run} was handed out twice"
        );
        let manifest = &on_disk
            .get(run)
            .unwrap_or_else(|| panic!("no manifest on disk for run {run}"))
            .manifest;
        let next = manifest["next_attempt"][rollout.as_str()]
            .as_i64()
            .unwrap_or_else(|| panic!("run {run}'s manifest has no next_attempt for {rollout}"));
        assert!(
            *n < next,
            "run {run}: {rollout} number {n} was acknowledged but the manifest's next_attempt is {next}"
        );
    }

    // The current runs are the slots' runs; superseded runs answer 409 run_superseded.
    let current: BTreeSet<String> = on_disk
        .iter()
        .filter(|(_, r)| r.current)
        .map(|(id, _)| id.clone())
        .collect();
    let slot_runs: BTreeSet<String> = (0..RUNS).map(|n| chaos.run_id(n)).collect();
    let without_manifest: Vec<&PathBuf> = outputs
        .iter()
        .filter(|o| {
            !recovery_sidecar::SidecarPaths::for_output(o)
                .manifest
                .exists()
        })
        .collect();
    assert!(
        without_manifest.is_empty(),
        "outputs left without a manifest (a replacement interrupted by a SIGKILL is neither \
         undone nor completed): {without_manifest:?}"
    );
    assert_eq!(current, slot_runs, "the clients followed every replacement");
    for (old, _) in &acks.superseded {
        let (status, reply) = chaos
            .send_answered(reqwest::Method::GET, &format!("/runs/{old}"), VIEWER, None)
            .await;
        assert_eq!(
            (status, code(&reply)),
            (409, "run_superseded"),
            "{old}: {reply}"
        );
    }

    // What the files say: drift and extension ids derived from the journal lines.
    let file_drift: BTreeMap<String, BTreeSet<String>> = on_disk
        .iter()
        .map(|(id, r)| (id.clone(), journal_ids(&r.drift, id, "resume_drift")))
        .filter(|(_, ids)| !ids.is_empty())
        .collect();
    let file_extensions: BTreeMap<String, BTreeSet<String>> = on_disk
        .iter()
        .map(|(id, r)| {
            (
                id.clone(),
                journal_ids(&r.extension, id, "attempt_extension"),
            )
        })
        .filter(|(_, ids)| !ids.is_empty())
        .collect();

    // (b) Acknowledged drift events are in the journal of their run and in the database.
    let mut original_drift: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (id, run) in chaos.drift_listing("/drift").await {
        original_drift.entry(run).or_default().insert(id);
    }
    assert!(
        original_drift == file_drift,
        "the database's drift events are the journals' lines: {}",
        difference(&original_drift, &file_drift)
    );
    for (run, id) in &acks.drift {
        assert!(
            file_drift.get(run).is_some_and(|ids| ids.contains(id)),
            "acknowledged drift event {id} of run {run} is not a line of its journal"
        );
    }
    let distinct: BTreeSet<&String> = acks.drift.iter().map(|(_, id)| id).collect();
    assert_eq!(
        distinct.len(),
        acks.drift.len(),
        "drift event ids are distinct"
    );
    // (c) Acknowledged extensions are in the journal of their run and in the database.
    let original_extensions = extension_rows(&data.join("rollout-recovery.db"));
    assert!(
        original_extensions == file_extensions,
        "the database's extensions are the journals' lines: {}",
        difference(&original_extensions, &file_extensions)
    );
    for (run, id) in &acks.extensions {
        assert!(
            file_extensions.get(run).is_some_and(|ids| ids.contains(id)),
            "acknowledged extension {id} of run {run} is not a line of its journal"
        );
    }

    // Re-judgments: an acknowledged admission is open in its run's manifest until its
    // acknowledged close.
    for (run, key, operation) in &acks.admitted {
        if acks.close_unknown.contains(operation) {
            continue;
        }
        let pending = &on_disk
            .get(run)
            .unwrap_or_else(|| panic!("no manifest on disk for run {run}"))
            .manifest["pending_rejudge"][key.as_str()];
        if acks.closed.contains(operation) {
            assert_ne!(
                pending["operation_id"].as_str(),
                Some(operation.as_str()),
                "closed re-judgment {operation} of {run} is still open"
            );
        } else {
            assert_eq!(
                pending["operation_id"].as_str(),
                Some(operation.as_str()),
                "admitted re-judgment {operation} ({key}) of {run} is not open in its manifest"
            );
        }
    }

    // An acknowledged opt-in to retrying terminal timeouts is kept in its run's manifest.
    for run in &acks.opted_in {
        let manifest = &on_disk
            .get(run)
            .unwrap_or_else(|| panic!("no manifest on disk for run {run}"))
            .manifest;
        assert_eq!(
            manifest["retry_terminal_timeouts"],
            json!(true),
            "run {run} acknowledged an opt-in its manifest lost"
        );
    }
    // Coverage snapshots (written at every lease grant and release) are whole documents.
    for output in &outputs {
        let coverage = recovery_sidecar::SidecarPaths::for_output(output).coverage;
        if let Ok(text) = std::fs::read(&coverage) {
            let snapshot: Value = serde_json::from_slice(&text)
                .unwrap_or_else(|e| panic!("{} is not a whole document: {e}", coverage.display()));
            assert!(snapshot.is_object(), "{}: {snapshot}", coverage.display());
        }
    }

    // Approvals: an acknowledged one is a line of its run's journal until its acknowledged
    // revocation removes it; the database's unrevoked approvals are the journal's lines.
    let approval_lines = |run: &str| -> BTreeSet<String> {
        on_disk.get(run).map_or_else(BTreeSet::new, |r| {
            journal_lines(&r.approvals)
                .iter()
                .filter_map(|(_, line)| {
                    serde_json::from_slice::<Value>(line).ok()?["approval_id"]
                        .as_str()
                        .map(str::to_owned)
                })
                .collect()
        })
    };
    for (run, id) in &acks.approved {
        if acks.revoke_unknown.contains(id) {
            continue;
        }
        let lines = approval_lines(run);
        if acks.revoked.contains(id) {
            assert!(
                !lines.contains(id),
                "revoked approval {id} of {run} is still a journal line"
            );
        } else {
            assert!(
                lines.contains(id),
                "acknowledged approval {id} of {run} is not a journal line"
            );
        }
    }
    let mut original_approvals = BTreeMap::new();
    for run in &current {
        let listed = chaos.unrevoked_approvals(run).await;
        assert_eq!(
            listed,
            approval_lines(run),
            "the unrevoked approvals of {run} are its journal's lines"
        );
        original_approvals.insert(run.clone(), listed);
    }

    // The database equals a reindex of the files: a fresh service over the same root.
    let original_runs = chaos.live_runs().await;
    let original_run_drift = {
        let mut by_run = BTreeMap::new();
        for run in &current {
            let ids: BTreeSet<String> = chaos
                .drift_listing(&format!("/runs/{run}/drift"))
                .await
                .into_keys()
                .collect();
            by_run.insert(run.clone(), ids);
        }
        by_run
    };
    let fresh_data = dir.path().join("fresh-data");
    let fresh = Server::start_with(&fresh_data, &root, None, &[], &logs.join("fresh.log"));
    *chaos.url.write().expect("url") = fresh.url.clone();
    let fresh_runs = chaos.live_runs().await;
    assert_eq!(
        fresh_runs, original_runs,
        "the run records equal a reindex of the files"
    );
    assert_eq!(fresh_runs.keys().cloned().collect::<BTreeSet<_>>(), current);
    let mut fresh_drift: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (id, run) in chaos.drift_listing("/drift").await {
        fresh_drift.entry(run).or_default().insert(id);
    }
    for run in &current {
        let ids: BTreeSet<String> = chaos
            .drift_listing(&format!("/runs/{run}/drift"))
            .await
            .into_keys()
            .collect();
        let in_files = file_drift.get(run).cloned().unwrap_or_default();
        assert_eq!(
            ids.len(),
            original_run_drift[run].len(),
            "drift event counts of {run}"
        );
        assert_eq!(ids, original_run_drift[run], "drift events of {run}");
        assert_eq!(
            ids, in_files,
            "drift events of {run} are its journal's lines"
        );
        assert_eq!(
            fresh_drift.get(run).cloned().unwrap_or_default(),
            ids,
            "{run}"
        );
    }
    // Replaced runs too: a rebuild reads the journals a replacement set aside (hostile review
    // 52, F2), so the fresh database's drift is every journal's, as the original's is.
    assert!(
        fresh_drift == file_drift,
        "a fresh service's drift events are the journals' lines, set-aside ones included: {}",
        difference(&fresh_drift, &file_drift)
    );
    let fresh_extensions = extension_rows(&fresh_data.join("rollout-recovery.db"));
    let current_extensions: BTreeMap<String, BTreeSet<String>> = original_extensions
        .iter()
        .filter(|(run, _)| current.contains(*run))
        .map(|(run, ids)| (run.clone(), ids.clone()))
        .collect();
    assert_eq!(
        fresh_extensions, current_extensions,
        "extension records equal a reindex of the files"
    );
    for run in &current {
        assert_eq!(
            chaos.unrevoked_approvals(run).await,
            original_approvals[run],
            "approvals of {run} equal a reindex of the files"
        );
    }
    drop(fresh);
    drop(server);

    let elapsed = began.elapsed();
    eprintln!(
        "chaos: {KILLS} SIGKILLs, {iterations} client iterations, {} reservations, {} drift events, {} extensions, {} admissions ({} closed), {} approvals ({} revoked), {} replacements, {} runs superseded, {} runs opted in, {removed} temporaries removed at restarts; chaos {chaos_done:?}, total {elapsed:?}",
        acks.reservations.len(),
        acks.drift.len(),
        acks.extensions.len(),
        acks.admitted.len(),
        acks.closed.len(),
        acks.approved.len(),
        acks.revoked.len(),
        acks.replaces,
        acks.superseded.len(),
        acks.opted_in.len(),
    );
    assert!(
        !acks.reservations.is_empty() && !acks.drift.is_empty() && !acks.extensions.is_empty(),
        "the chaos acknowledged changes of every kind"
    );
    assert!(
        elapsed < Duration::from_secs(60),
        "the chaos test took {elapsed:?}"
    );
    // Every answer was one the chaos explains (a success, a lease or lock refusal, a superseded
    // run, a dropped connection): never a server error.
    let unexpected = chaos.unexpected.lock().expect("unexpected").clone();
    assert!(
        unexpected.is_empty(),
        "{} unexpected answers:\n{}\nservice errors:\n{}",
        unexpected.len(),
        unexpected.join("\n"),
        service_errors(&logs)
    );
}

/// A scratch PostgreSQL database, dropped at the end (declare it before the services using it,
/// so they stop first).
#[derive(Debug)]
struct ScratchDatabase {
    admin: String,
    name: String,
    url: String,
}

fn psql(admin: &str, sql: &str) -> std::process::Output {
    Command::new("psql")
        .arg(admin)
        .args(["-v", "ON_ERROR_STOP=1", "-q", "-c", sql])
        .output()
        .expect("psql")
}

impl ScratchDatabase {
    fn create(rng: &mut Rng) -> Self {
        let admin = std::env::var("RR_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
        let name = format!("rr_test_{:016x}", rng.next());
        let out = psql(&admin, &format!("CREATE DATABASE {name}"));
        assert!(
            out.status.success(),
            "creating {name} through {admin}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (base, query) = match admin.split_once('?') {
            Some((base, query)) => (base, format!("?{query}")),
            None => (admin.as_str(), String::new()),
        };
        let (server, _) = base.rsplit_once('/').expect("a database in the admin URL");
        let url = format!("{server}/{name}{query}");
        Self { admin, name, url }
    }
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        let out = psql(
            &self.admin,
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
        if !out.status.success() {
            eprintln!(
                "dropping {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// Two service processes sharing `database`, each with its own data directory and log under
/// `dir`, started one after the other (the second finds the schema migrated).
fn start_replicas(
    dir: &Path,
    root: &Path,
    database: &ScratchDatabase,
    names: [&str; 2],
) -> (Server, Server) {
    let start = |replica: &str| {
        Server::start_with(
            &dir.join(format!("data-{replica}")),
            root,
            None,
            &[
                ("RR_DATABASE_URL", database.url.as_str()),
                ("RR_REPLICA", replica),
            ],
            &dir.join(format!("{replica}.log")),
        )
    };
    let first = start(names[0]);
    (first, start(names[1]))
}

#[tokio::test]
async fn two_service_processes_and_a_python_collector_contend_for_one_run() {
    // Two processes share a PostgreSQL database (one SQLite file serves one process).
    let database = ScratchDatabase::create(&mut Rng::new(seed()));
    let dir = tempfile::tempdir().expect("dir");
    let (_, root, _) = prepare(dir.path());
    let (first, second) = start_replicas(dir.path(), &root, &database, ["a", "b"]);
    let client = reqwest::Client::new();
    let root = std::fs::canonicalize(&root).expect("root");
    let run_id = super::create_run(&client, &first, &root, &root.join("exp/out.jsonl")).await;
    let lease = |holder: &str| json!({"holder": holder, "host": "h", "pid": 1, "ttl_seconds": 60});
    let (status, granted) = super::call(
        &client,
        &first,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(lease("collector-a")),
    )
    .await;
    assert_eq!(status, 201, "{granted}");
    let (status, refused) = super::call(
        &client,
        &second,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(lease("collector-b")),
    )
    .await;
    assert_eq!(
        (status, refused["code"].as_str()),
        (423, Some("run_locked")),
        "{refused}"
    );
    let (status, _) = super::call(
        &client,
        &first,
        reqwest::Method::DELETE,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"lease_id": granted["lease_id"]})),
    )
    .await;
    assert_eq!(status, 204);
    // A Python collector holding the lock keeps both services out.
    let lock = root.join("exp/out_run.lock");
    let python = super::PythonLock::hold(&lock);
    let (status, refused) = super::call(
        &client,
        &second,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(lease("collector-b")),
    )
    .await;
    assert_eq!(status, 423);
    assert!(
        refused["message"]
            .as_str()
            .expect("message")
            .contains("Another collector owns this run"),
        "{refused}"
    );
    drop(python);
    let (status, _) = super::call(
        &client,
        &second,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(lease("collector-b")),
    )
    .await;
    assert_eq!(status, 201, "free once every other owner left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_service_processes_on_one_postgresql_database_hand_out_each_number_once() {
    let began = Instant::now();
    let mut rng = Rng::new(seed());
    let database = ScratchDatabase::create(&mut rng);
    let dir = tempfile::tempdir().expect("dir");
    let (_, root, _) = prepare(dir.path());
    let root = std::fs::canonicalize(&root).expect("root");
    let (a, b) = start_replicas(dir.path(), &root, &database, ["replica-a", "replica-b"]);
    let client = reqwest::Client::new();
    let output = root.join("exp/out.jsonl");
    let rows: Value = (0..=40)
        .map(|t| json!({"agent_ref": {"name": "agent"}, "_ng_task_index": t, "_ng_rollout_index": 0}))
        .collect();
    let body = json!({"output_path": output, "source_path": root.join("src/train.jsonl"), "config": config(0.3),
        "global_config": global(8000), "rows": rows});
    let (status, created) = super::call(
        &client,
        &a,
        reqwest::Method::POST,
        "/runs",
        COLLECTOR,
        Some(body),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let run_id = created["run_id"].as_str().expect("run id").to_owned();
    let (status, lease) = super::call(
        &client,
        &a,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"holder": "collector-a", "host": "h", "pid": 1, "ttl_seconds": 300})),
    )
    .await;
    assert_eq!(status, 201, "{lease}");
    let lease_id = lease["lease_id"].as_str().expect("lease").to_owned();
    let urls = [a.url.clone(), b.url.clone()];

    // 40 reserves of one rollout and 40 of distinct rollouts, split across both replicas.
    let mut requests = Vec::new();
    for i in 0..80usize {
        let rollout = if i < 40 {
            "0-0".to_owned()
        } else {
            format!("{}-0", i - 39)
        };
        let url = format!("{}/runs/{run_id}/attempts/reserve", urls[i % 2]);
        let body = json!({"lease_id": lease_id, "rollout_ids": [rollout]});
        let client = client.clone();
        requests.push(tokio::spawn(async move {
            let response = client
                .post(&url)
                .bearer_auth(COLLECTOR)
                .json(&body)
                .send()
                .await
                .expect("response");
            let status = response.status().as_u16();
            let reply: Value = response.json().await.unwrap_or(Value::Null);
            (rollout, url, status, reply)
        }));
    }
    let mut same = Vec::new();
    let mut distinct = BTreeMap::new();
    for request in requests {
        let (rollout, url, status, reply) = request.await.expect("request");
        assert_eq!(status, 200, "{url} {rollout}: {reply}");
        let number = reply["attempts"][rollout.as_str()]
            .as_i64()
            .unwrap_or_else(|| panic!("{url} {rollout}: {reply}"));
        if rollout == "0-0" {
            same.push(number);
        } else {
            distinct.insert(rollout, number);
        }
    }
    same.sort_unstable();
    assert_eq!(
        same,
        (0..40).collect::<Vec<i64>>(),
        "one rollout's numbers are distinct and gapless"
    );
    let paths = recovery_sidecar::SidecarPaths::for_output(&output);
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(&paths.manifest).expect("manifest")).expect("json");
    assert_eq!(manifest["next_attempt"]["0-0"], 40, "{manifest}");
    assert_eq!(distinct.len(), 40);
    for (rollout, number) in &distinct {
        assert_eq!(*number, 0, "{rollout}");
        assert_eq!(
            manifest["next_attempt"][rollout.as_str()],
            1,
            "{rollout} is saved in the manifest"
        );
    }

    // Concurrent resumes across operational drift on both replicas: one journal line per event.
    let mut validations = Vec::new();
    for i in 0..20usize {
        let url = format!("{}/runs/{run_id}/validate", urls[i % 2]);
        let body = json!({"config": config(0.3), "global_config": global(9000 + i as i64),
            "source_path": root.join("src/train.jsonl"), "lease_id": lease_id});
        let client = client.clone();
        validations.push(tokio::spawn(async move {
            let response = client
                .post(&url)
                .bearer_auth(COLLECTOR)
                .json(&body)
                .send()
                .await
                .expect("response");
            let status = response.status().as_u16();
            (
                url,
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }));
    }
    let mut acknowledged = BTreeSet::new();
    for validation in validations {
        let (url, status, reply) = validation.await.expect("validation");
        assert_eq!(
            (status, reply["outcome"].as_str()),
            (200, Some("resume_with_drift")),
            "{url}: {reply}"
        );
        assert!(acknowledged.insert(reply["drift_event_id"].as_str().expect("id").to_owned()));
    }
    let lines = journal_lines(&paths.resume_drift);
    assert_eq!(lines.len(), 20, "one journal line per resume");
    let in_journal = journal_ids(&paths.resume_drift, &run_id, "resume_drift");
    assert_eq!(
        in_journal, acknowledged,
        "the journal holds the acknowledged events"
    );
    for server in [&a, &b] {
        let (status, page) = super::call(
            &client,
            server,
            reqwest::Method::GET,
            &format!("/runs/{run_id}/drift?limit=1000"),
            VIEWER,
            None,
        )
        .await;
        assert_eq!(status, 200, "{page}");
        let rows: BTreeSet<String> = page["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| e["event_id"].as_str().expect("id").to_owned())
            .collect();
        assert_eq!(
            page["events"].as_array().map(Vec::len),
            Some(lines.len()),
            "as many drift rows as journal lines ({})",
            server.url
        );
        assert_eq!(rows, in_journal, "{}", server.url);
    }
    drop((a, b));
    drop(database);
    eprintln!("two replicas on PostgreSQL: {:?}", began.elapsed());
}

/// Two replicas on one PostgreSQL database: when the one that granted a lease stops, the
/// other keeps the lease for its collector (the hostile review saw it ended as an orphan and
/// the collector refused hundreds of times): its calls go on there, its heartbeat renews it,
/// the run's lock is held again, and another collector is refused.
#[tokio::test]
async fn a_lease_outlives_the_replica_that_granted_it_and_its_collector_goes_on_at_another() {
    let database = ScratchDatabase::create(&mut Rng::new(seed()));
    let dir = tempfile::tempdir().expect("dir");
    let (_, root, _) = prepare(dir.path());
    let root = std::fs::canonicalize(&root).expect("root");
    let (first, second) = start_replicas(dir.path(), &root, &database, ["replica-a", "replica-b"]);
    let client = reqwest::Client::new();
    let output = root.join("exp/out.jsonl");
    let run_id = super::create_run(&client, &first, &root, &output).await;
    let (status, lease) = super::call(
        &client,
        &first,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"holder": "collector-1", "host": "node-1", "pid": 1, "ttl_seconds": 3600})),
    )
    .await;
    assert_eq!(status, 201, "{lease}");
    let lease_id = lease["lease_id"].as_str().expect("lease").to_owned();
    assert!(
        first.terminate().success(),
        "the first replica stops cleanly"
    );
    // The collector's next call reaches the other replica, under its lease.
    let validate = json!({"config": config(0.3), "global_config": global(8000), "source_path": root.join("src/train.jsonl"), "lease_id": lease_id});
    let (status, answer) = super::call(
        &client,
        &second,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/validate"),
        COLLECTOR,
        Some(validate),
    )
    .await;
    assert_eq!(
        (status, answer["outcome"].as_str()),
        (200, Some("reuse")),
        "{answer}"
    );
    let (status, renewed) = super::call(
        &client,
        &second,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease/heartbeat"),
        COLLECTOR,
        Some(json!({"lease_id": lease_id})),
    )
    .await;
    assert_eq!(
        status, 200,
        "the heartbeat renews it at the other replica: {renewed}"
    );
    assert_eq!(
        super::probe(&root.join("exp/out_run.lock")),
        "blocked",
        "its lock is held again"
    );
    let (status, refused) = super::call(
        &client,
        &second,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"holder": "collector-2", "host": "node-2", "pid": 2})),
    )
    .await;
    assert_eq!(status, 423, "another collector is refused: {refused}");
    let (_, audit) = super::call(
        &client,
        &second,
        reqwest::Method::GET,
        &format!("/audit?run_id={run_id}"),
        OPERATOR,
        None,
    )
    .await;
    let actions: Vec<&str> = audit["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| e["action"].as_str())
        .collect();
    assert!(actions.contains(&"lease.adopted"), "{actions:?}");
    assert!(!actions.contains(&"lease.orphaned"), "{actions:?}");
}

/// Two running replicas on one PostgreSQL database: a collector's heartbeat that reaches the
/// replica not holding its lease renews it (the hostile review saw 409 lease_not_held, which a
/// collector takes for a lost lease), and when the granting replica stops, another collector
/// asking at once is refused, the lease kept for its collector (the review saw 201: the
/// stopped replica's lease replaced as an orphan).
#[tokio::test]
async fn a_lease_is_renewed_at_either_replica_and_never_granted_away_when_its_replica_stops() {
    let database = ScratchDatabase::create(&mut Rng::new(seed()));
    let dir = tempfile::tempdir().expect("dir");
    let (_, root, _) = prepare(dir.path());
    let root = std::fs::canonicalize(&root).expect("root");
    let (first, second) = start_replicas(dir.path(), &root, &database, ["replica-a", "replica-b"]);
    let client = reqwest::Client::new();
    let run_id = super::create_run(&client, &first, &root, &root.join("exp/out.jsonl")).await;
    let acquire =
        |holder: &str| json!({"holder": holder, "host": "node", "pid": 1, "ttl_seconds": 600});
    let lease_path = format!("/runs/{run_id}/lease");
    let heartbeat_path = format!("/runs/{run_id}/lease/heartbeat");
    let (status, lease) = post(&client, &first, &lease_path, acquire("collector-1")).await;
    assert_eq!(status, 201, "{lease}");
    let lease_id = lease["lease_id"].as_str().expect("lease").to_owned();
    let (status, renewed) = post(
        &client,
        &second,
        &heartbeat_path,
        json!({"lease_id": lease_id, "ttl_seconds": 900}),
    )
    .await;
    assert_eq!(
        status, 200,
        "a heartbeat at the other running replica renews: {renewed}"
    );
    assert!(
        renewed["expires_at"].as_str() > lease["expires_at"].as_str(),
        "{renewed} after {lease}"
    );
    let (status, refused) = post(&client, &second, &lease_path, acquire("collector-2")).await;
    assert_eq!(status, 423, "{refused}");
    assert!(
        first.terminate().success(),
        "the first replica stops cleanly"
    );
    let (status, refused) = post(&client, &second, &lease_path, acquire("collector-2")).await;
    assert_eq!(
        status, 423,
        "the stopped replica's lease is not granted away: {refused}"
    );
    let (status, renewed) = post(
        &client,
        &second,
        &heartbeat_path,
        json!({"lease_id": lease_id}),
    )
    .await;
    assert_eq!(status, 200, "its collector goes on: {renewed}");
    assert_eq!(
        super::probe(&root.join("exp/out_run.lock")),
        "blocked",
        "its lock is held again"
    );
    let (_, audit) = super::call(
        &client,
        &second,
        reqwest::Method::GET,
        &format!("/audit?run_id={run_id}"),
        OPERATOR,
        None,
    )
    .await;
    let actions: Vec<&str> = audit["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| e["action"].as_str())
        .collect();
    assert!(actions.contains(&"lease.adopted"), "{actions:?}");
    assert!(!actions.contains(&"lease.orphaned"), "{actions:?}");
}

/// Two running replicas on one PostgreSQL database, calls reaching the one without the run's
/// lock (hostile review 33): an acquire during the other's live lease is refused naming its
/// holder (it read as a process outside the service); an operator's takeover there ends that
/// lease and holds the lock once the other replica let go (it always failed 423); a release
/// at the replica without the lock answers once the lock is let go, so a Python collector
/// started right after finds the run free (the lock outlived the release by up to 5 s).
#[tokio::test]
async fn calls_reaching_the_replica_without_the_runs_lock_hand_it_over() {
    let database = ScratchDatabase::create(&mut Rng::new(seed()));
    let dir = tempfile::tempdir().expect("dir");
    let (_, root, _) = prepare(dir.path());
    let root = std::fs::canonicalize(&root).expect("root");
    let (first, second) = start_replicas(dir.path(), &root, &database, ["replica-a", "replica-b"]);
    let client = reqwest::Client::new();
    let run_id = super::create_run(&client, &first, &root, &root.join("exp/out.jsonl")).await;
    let lock = root.join("exp/out_run.lock");
    let acquire =
        |holder: &str| json!({"holder": holder, "host": "node", "pid": 1, "ttl_seconds": 600});
    let lease_path = format!("/runs/{run_id}/lease");
    let (status, lease) = post(&client, &first, &lease_path, acquire("collector-1")).await;
    assert_eq!(status, 201, "{lease}");
    let (status, refused) = post(&client, &second, &lease_path, acquire("collector-2")).await;
    assert_eq!(
        (status, &refused["details"]["holder"]["holder"]),
        (423, &json!("collector-1")),
        "{refused}"
    );
    let (status, taken) = super::call(
        &client,
        &second,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease/takeover"),
        OPERATOR,
        Some(json!({"holder": "collector-2", "host": "node", "pid": 2, "reason": "stuck", "ttl_seconds": 600})),
    )
    .await;
    assert_eq!(
        status, 201,
        "a takeover at the replica without the lock: {taken}"
    );
    assert_eq!(
        super::probe(&lock),
        "blocked",
        "the new lease holds the lock"
    );
    let (status, refused) = post(
        &client,
        &first,
        &format!("/runs/{run_id}/lease/heartbeat"),
        json!({"lease_id": lease["lease_id"]}),
    )
    .await;
    assert_eq!(status, 409, "the previous lease ended: {refused}");
    let (status, released) = super::call(
        &client,
        &first,
        reqwest::Method::DELETE,
        &lease_path,
        COLLECTOR,
        Some(json!({"lease_id": taken["lease_id"]})),
    )
    .await;
    assert_eq!(status, 204, "{released}");
    assert_eq!(
        super::probe(&lock),
        "acquired",
        "once a release answered, the run's lock is free"
    );
}

async fn post(client: &reqwest::Client, server: &Server, path: &str, body: Value) -> (u16, Value) {
    super::call(
        client,
        server,
        reqwest::Method::POST,
        path,
        COLLECTOR,
        Some(body),
    )
    .await
}

/// Legacy imports (`POST /runs/import_legacy`: outcome files created, manifest written, run
/// recorded, audited) SIGKILLed in the middle: in each round eight outputs from before
/// manifests are imported at once and the service is killed at a random moment (odd rounds:
/// after the first answer). After a restart every output is imported whole or not at all: one
/// with a manifest has both outcome files and its run is known to the service under that output
/// (an acknowledged import's run is the one its manifest names); one without was not
/// acknowledged, and imports at the next try.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn legacy_imports_killed_in_the_middle_leave_each_output_imported_whole_or_not_at_all() {
    const ROUNDS: u64 = 6;
    const OUTPUTS: u64 = 8;
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let root = std::fs::canonicalize(&root).expect("root");
    let log = dir.path().join("service.log");
    let mut rng = Rng::new(seed());
    let client = reqwest::Client::new();
    let mut server = Server::start_with(&data, &root, None, &[], &log);
    let (mut acknowledged, mut retried, mut killed_mid_way) = (0, 0, 0);
    for round in 0..ROUNDS {
        let outputs: Vec<PathBuf> = (0..OUTPUTS)
            .map(|n| {
                let output = root.join(format!("legacy-{round}-{n}/out.jsonl"));
                let paths = recovery_sidecar::SidecarPaths::for_output(&output);
                std::fs::create_dir_all(output.parent().expect("dir")).expect("dir");
                std::fs::write(
                    &paths.materialized,
                    "{\"_ng_task_index\":0,\"_ng_rollout_index\":0,\"q\":\"1+1?\"}\n",
                )
                .expect("materialized");
                std::fs::write(
                    &output,
                    "{\"_ng_task_index\":0,\"_ng_rollout_index\":0,\"reward\":1.0,\"response\":{\"output\":[],\"status\":\"completed\"}}\n",
                )
                .expect("results");
                output
            })
            .collect();
        let (answered_tx, mut answered) = tokio::sync::mpsc::unbounded_channel();
        let imports: Vec<_> = outputs
            .iter()
            .map(|output| {
                let (client, url, answered_tx) =
                    (client.clone(), server.url.clone(), answered_tx.clone());
                let body = json!({"output_path": output, "allow_unsafe": true});
                tokio::spawn(async move {
                    let reply = client
                        .post(format!("{url}/runs/import_legacy"))
                        .bearer_auth(COLLECTOR)
                        .json(&body)
                        .send()
                        .await
                        .ok()?;
                    let status = reply.status().as_u16();
                    let answer: Value = reply.json().await.ok()?;
                    let _ = answered_tx.send(());
                    Some((status, answer))
                })
            })
            .collect();
        if round % 2 == 1 {
            answered.recv().await;
        } else {
            tokio::time::sleep(rng.between_ms(0, 40)).await;
        }
        server.kill();
        let mut acks: BTreeMap<PathBuf, String> = BTreeMap::new();
        for (output, import) in outputs.iter().zip(imports) {
            match import.await.expect("import task") {
                Some((201, answer)) => {
                    let run_id = answer["run_id"].as_str().expect("run id").to_owned();
                    acks.insert(output.clone(), run_id);
                }
                Some((status, answer)) => {
                    panic!("import of {}: {status} {answer}", output.display())
                }
                None => killed_mid_way += 1,
            }
        }
        acknowledged += acks.len();
        let started = SystemTime::now();
        server = Server::start_with(&data, &root, None, &[], &log);
        for (path, modified) in temporaries(&root) {
            assert!(
                modified >= started,
                "{} was left by the killed service and survived its restart",
                path.display()
            );
        }
        for output in &outputs {
            let paths = recovery_sidecar::SidecarPaths::for_output(output);
            let Ok(text) = std::fs::read(&paths.manifest) else {
                assert!(
                    !acks.contains_key(output),
                    "{}: an acknowledged import has no manifest",
                    output.display()
                );
                let (status, answer) = super::call(
                    &client,
                    &server,
                    reqwest::Method::POST,
                    "/runs/import_legacy",
                    COLLECTOR,
                    Some(json!({"output_path": output, "allow_unsafe": true})),
                )
                .await;
                assert_eq!(status, 201, "{}: {answer}", output.display());
                retried += 1;
                continue;
            };
            let manifest: Value = serde_json::from_slice(&text).expect("a whole manifest");
            let run_id = manifest["run_id"].as_str().expect("run id");
            if let Some(acked) = acks.get(output) {
                assert_eq!(acked, run_id, "{}", output.display());
            }
            assert!(
                paths.failures.exists(),
                "{}: no failures file",
                output.display()
            );
            let (status, record) = super::call(
                &client,
                &server,
                reqwest::Method::GET,
                &format!("/runs/{run_id}"),
                VIEWER,
                None,
            )
            .await;
            assert_eq!(status, 200, "{}: {record}", output.display());
            assert_eq!(record["run"]["output_path"], json!(output), "{record}");
            let (status, again) = super::call(
                &client,
                &server,
                reqwest::Method::POST,
                "/runs/import_legacy",
                COLLECTOR,
                Some(json!({"output_path": output, "allow_unsafe": true})),
            )
            .await;
            assert_eq!(
                (status, again["details"]["run_id"].as_str()),
                (409, Some(run_id)),
                "{again}"
            );
        }
    }
    eprintln!(
        "legacy imports: {ROUNDS} kills, {acknowledged} acknowledged, {killed_mid_way} without an answer, {retried} imported at the next try"
    );
    assert!(
        retried + acknowledged > 0 && killed_mid_way > 0,
        "the kills fell in the middle of imports ({killed_mid_way} unanswered)"
    );
}

/// A run made by a service on `database` (stopped again), and a drift line a collector appended
/// to its journal while no service ran: the next start's reindex has it to insert.
async fn a_run_with_drift_to_reindex(
    data: &Path,
    root: &Path,
    env: &[(&str, &str)],
    log: &Path,
) -> String {
    let first = Server::start_with(data, root, None, env, log);
    let rows =
        json!([{"agent_ref": {"name": "agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0}]);
    let body = json!({"output_path": root.join("exp/out.jsonl"),
        "source_path": root.join("src/train.jsonl"), "config": config(0.3),
        "global_config": global(8000), "rows": rows});
    let (status, created) = post(&reqwest::Client::new(), &first, "/runs", body).await;
    assert_eq!(status, 201, "{created}");
    let run_id = created["run_id"].as_str().expect("run id").to_owned();
    // A collector holds the run's lease across the restart.
    let (status, lease) = post(
        &reqwest::Client::new(),
        &first,
        &format!("/runs/{run_id}/lease"),
        json!({"holder": "collector-1", "host": "node-7", "pid": 4242, "ttl_seconds": 3600}),
    )
    .await;
    assert_eq!(status, 201, "{lease}");
    assert!(first.terminate().success());
    let line = json!({"at": "2026-12-05T10:00:00.000000Z", "run_id": run_id,
        "saved_config_digest": "s".repeat(64), "current_config_digest": "c".repeat(64),
        "operational_keys": ["policy.timeout"]});
    std::fs::write(
        root.join("exp/out_manifest_resume_drift.jsonl"),
        format!("{line}\n"),
    )
    .expect("journal");
    run_id
}

/// Another process (`psql`) holding the drift table of `database` locked until its stdin is
/// written `COMMIT;` (or it goes): a reindex that has drift to insert waits for it.
fn hold_the_drift_table(
    database: &ScratchDatabase,
) -> (std::process::Child, std::process::ChildStdin) {
    let mut holder = Command::new("psql")
        .arg(&database.url)
        .args(["-q", "-t", "-A", "-v", "ON_ERROR_STOP=1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("psql");
    let mut to_holder = holder.stdin.take().expect("stdin");
    std::io::Write::write_all(
        &mut to_holder,
        b"BEGIN; LOCK TABLE drift_events IN EXCLUSIVE MODE; SELECT 'locked';\n",
    )
    .expect("lock");
    let mut said = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(holder.stdout.take().expect("stdout")),
        &mut said,
    )
    .expect("psql answers");
    assert_eq!(said.trim(), "locked");
    (holder, to_holder)
}

/// A service restarted on a scratch PostgreSQL database beside a run with drift to reindex,
/// whose start-up reindex [`hold_the_drift_table`] holds back: it listens (`/healthz`) but is
/// not ready until `to_holder` is written `COMMIT;` or closed. The run holds a live lease.
/// Fields drop in order: the service first, the database and the directory last.
struct HeldBackStart {
    starting: Server,
    holder: std::process::Child,
    to_holder: std::process::ChildStdin,
    run_id: String,
    root: PathBuf,
    log: PathBuf,
    database: ScratchDatabase,
    _dir: tempfile::TempDir,
}

impl HeldBackStart {
    async fn new() -> Self {
        let mut rng = Rng::new(seed());
        let database = ScratchDatabase::create(&mut rng);
        let dir = tempfile::tempdir().expect("dir");
        let (_, root, _) = prepare(dir.path());
        let root = std::fs::canonicalize(&root).expect("root");
        let (data, log) = (dir.path().join("data"), dir.path().join("service.log"));
        let env = [("RR_DATABASE_URL", database.url.as_str())];
        let run_id = a_run_with_drift_to_reindex(&data, &root, &env, &log).await;
        let (holder, to_holder) = hold_the_drift_table(&database);
        let starting = Server::start_until(&data, &root, None, &env, &log, |port| {
            crate::answers_ok(port, "/healthz")
        });
        Self {
            starting,
            holder,
            to_holder,
            run_id,
            root,
            log,
            database,
            _dir: dir,
        }
    }
}

/// A restarted service listens while its start-up reindexes the sidecars: `/healthz` answers at
/// once, while `/readyz` and every route over runs answer 503 `starting` with `Retry-After`
/// (nothing is read from, or written to, a database that has not caught up); once the reindex
/// is done `/readyz` answers 200 and the lines a collector appended while the service was down
/// are listed. The reindex is held back by another process holding the drift table locked, so
/// the order of these events is fixed rather than timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_service_answers_starting_until_its_reindex_is_done() {
    // Bound whole (not destructured with `..`): the database and the directory live to the end.
    let held = HeldBackStart::new().await;
    let (starting, mut holder, mut to_holder) = (held.starting, held.holder, held.to_holder);
    let (run_id, root) = (&held.run_id, &held.root);
    let client = reqwest::Client::new();
    let run_path = format!("/runs/{run_id}");
    for (method, path, token) in [
        (reqwest::Method::GET, "/readyz", VIEWER),
        (reqwest::Method::GET, run_path.as_str(), VIEWER),
        (reqwest::Method::GET, "/drift", VIEWER),
        (reqwest::Method::POST, "/reindex", OPERATOR),
    ] {
        let response = client
            .request(method.clone(), format!("{}{path}", starting.url))
            .bearer_auth(token)
            .send()
            .await
            .expect("answer");
        assert_eq!(response.status(), 503, "{method} {path} while starting");
        let retry_after = response.headers().get("retry-after").cloned();
        assert_eq!(
            retry_after.as_ref().and_then(|v| v.to_str().ok()),
            Some("1")
        );
        let reply: Value = response.json().await.expect("json");
        assert_eq!(code(&reply), "starting", "{method} {path}: {reply}");
    }
    for path in ["/healthz", "/metrics", "/openapi.json"] {
        assert!(
            crate::answers_ok(starting.port(), path),
            "{path} while starting"
        );
    }
    // The live lease's lock is the service's again before the reindex: another process's
    // `flock` cannot take the run meanwhile (hostile review 50, F5).
    assert_eq!(crate::probe(&root.join("exp/out_run.lock")), "blocked");

    std::io::Write::write_all(&mut to_holder, b"COMMIT;\n").expect("unlock");
    drop(to_holder);
    assert!(holder.wait().expect("psql").success());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !crate::is_ready(starting.port()) {
        assert!(Instant::now() < deadline, "not ready once the lock went");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, drift) = super::call(
        &client,
        &starting,
        reqwest::Method::GET,
        &format!("/runs/{run_id}/drift"),
        VIEWER,
        None,
    )
    .await;
    assert_eq!(status, 200, "{drift}");
    let listed = drift["events"].as_array().expect("events");
    assert_eq!(listed.len(), 1, "{drift}");
    assert_eq!(listed[0]["operational_keys"], json!(["policy.timeout"]));
    assert!(starting.terminate().success());
}

/// A start-up reindex that fails (here its database is dropped under it, while it waits for the
/// drift table) stops the service that was listening meanwhile: it exits with code 2 and logs
/// why, rather than serving from a database that never caught up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_up_reindex_that_fails_stops_the_service() {
    let held = HeldBackStart::new().await;
    let (mut starting, mut holder, to_holder) = (held.starting, held.holder, held.to_holder);
    let (log, database) = (&held.log, &held.database);
    assert!(!crate::is_ready(starting.port()), "held back by the lock");
    let dropped = psql(
        &database.admin,
        &format!("DROP DATABASE {} WITH (FORCE)", database.name),
    );
    assert!(
        dropped.status.success(),
        "{}",
        String::from_utf8_lossy(&dropped.stderr)
    );
    drop(to_holder);
    let _ = holder.wait();
    let status = starting.child.wait().expect("the service stops");
    assert_eq!(
        status.code(),
        Some(2),
        "{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    let text = std::fs::read_to_string(log).expect("log");
    assert!(text.contains("start-up failed"), "{text}");
}
