//! The one integration-test binary of the `rollout-recovery` command: the real service over real
//! sockets (end to end, graceful shutdown, lease contention between processes) and the offline
//! tools.

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rollout-recovery");
const OPERATOR: &str = "operator-token-0123456789";
const COLLECTOR: &str = "collector-token-0123456789";
const VIEWER: &str = "viewer-token-0123456789";

/// Whether the service on `port` answers `GET /readyz` 200: its start-up (the reindex of the
/// sidecars under its roots) is done. It listens before that, answering 503 `starting`.
fn is_ready(port: u16) -> bool {
    answers_ok(port, "/readyz")
}

/// Whether the service on `port` answers `GET path` 200 (one request, its own connection).
fn answers_ok(port: u16, path: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n");
    let mut status = [0u8; 12];
    stream.write_all(request.as_bytes()).is_ok()
        && stream.read_exact(&mut status).is_ok()
        && &status == b"HTTP/1.1 200"
}

#[path = "cli/chaos.rs"]
mod chaos;
#[path = "cli/console.rs"]
mod console;

struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(data: &Path, root: &Path) -> Self {
        Self::start_logging_to(data, root, Stdio::null())
    }

    /// [`Self::start`] with the service's log (warnings and errors) written to `log`.
    fn start_logging_to(data: &Path, root: &Path, log: impl Into<Stdio>) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("port")
            .local_addr()
            .expect("addr")
            .port();
        let child = Command::new(BIN)
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
            .env("RR_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("serve");
        let server = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if is_ready(port) {
                return server;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the service did not become ready");
    }

    /// SIGTERM, then the exit status.
    fn terminate(mut self) -> std::process::ExitStatus {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid");
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        self.child.wait().expect("exit")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn call(
    client: &reqwest::Client,
    server: &Server,
    method: reqwest::Method,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = client
        .request(method, format!("{}{path}", server.url))
        .bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("response");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn config(temperature: f64) -> Value {
    json!({"limit": 2, "responses_create_params": {"temperature": temperature}, "num_samples_in_parallel": 4})
}

fn global(port: i64) -> Value {
    json!({
        "policy_model": {"responses_api_models": {"vllm_model": {"model": "model-A", "host": "h", "port": 9001}}},
        "judge": {"resources_servers": {"math_with_judge": {"judge_model_server": {"type": "responses_api_models", "name": "policy_model"}}}},
        "agent": {"responses_api_agents": {"simple_agent": {"resources_server": {"type": "resources_servers", "name": "judge"},
            "model_server": {"type": "responses_api_models", "name": "policy_model"}, "sandbox": {"sandbox_port": port}}}}
    })
}

fn prepare(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let data = dir.join("data");
    let root = dir.join("runs");
    std::fs::create_dir_all(root.join("src")).expect("dirs");
    std::fs::write(root.join("src/train.jsonl"), b"{\"q\": 1}\n{\"q\": 2}\n").expect("source");
    (data, root.clone(), root.join("exp/out.jsonl"))
}

async fn create_run(
    client: &reqwest::Client,
    server: &Server,
    root: &Path,
    output: &Path,
) -> String {
    let rows = json!([
        {"agent_ref": {"name": "agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0},
        {"agent_ref": {"name": "agent"}, "_ng_task_index": 1, "_ng_rollout_index": 0}
    ]);
    let body = json!({"output_path": output, "source_path": root.join("src/train.jsonl"), "config": config(0.3), "global_config": global(8000), "rows": rows});
    let (status, created) = call(
        client,
        server,
        reqwest::Method::POST,
        "/runs",
        COLLECTOR,
        Some(body),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    created["run_id"].as_str().expect("run id").to_owned()
}

/// An answer given before the request's body was read (its caller's role, an unknown path or
/// method, a refused query) says `Connection: close`, so a client never sends its next request
/// on a connection the service drops: the Python client lost a request that way ("server
/// disconnected without sending a response"; hostile review 42 for 404, 405 and 422). An
/// answer to a body read to its end keeps the connection. One pooled client alternates them.
#[tokio::test]
async fn an_answer_before_the_body_is_read_closes_its_connection_and_the_next_call_is_answered() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let server = Server::start(&data, &root);
    let client = reqwest::Client::new();
    let root = std::fs::canonicalize(&root).expect("root");
    let run_id = create_run(&client, &server, &root, &root.join("exp/out.jsonl")).await;
    let padding = "x".repeat(512 * 1024);
    let big = json!({"config": config(0.3), "global_config": global(8000), "padding": padding});
    let refusals = [
        (format!("/runs/{run_id}/validate"), VIEWER, 403),
        ("/no/such/route".to_owned(), COLLECTOR, 404),
        ("/healthz".to_owned(), COLLECTOR, 405),
        ("/runs?bogus=1".to_owned(), COLLECTOR, 422),
    ];
    for round in 0..5 {
        for (path, token, status) in &refusals {
            let refused = client
                .post(format!("{}{path}", server.url))
                .bearer_auth(token)
                .json(&big)
                .send()
                .await
                .unwrap_or_else(|e| panic!("round {round} {path}: the refusal was lost: {e}"));
            assert_eq!(refused.status().as_u16(), *status, "round {round} {path}");
            assert_eq!(
                refused
                    .headers()
                    .get(reqwest::header::CONNECTION)
                    .and_then(|v| v.to_str().ok()),
                Some("close"),
                "round {round} {path}"
            );
            let next = client
                .post(format!("{}/runs/{run_id}/lease", server.url))
                .bearer_auth(VIEWER)
                .json(&json!({"holder": "v", "host": "h", "pid": 1}))
                .send()
                .await
                .unwrap_or_else(|e| panic!("round {round} {path}: the next call was lost: {e}"));
            assert_eq!(next.status().as_u16(), 403, "round {round} {path}");
        }
        // A body read to its end keeps the connection.
        let answered = client
            .post(format!("{}/runs/{run_id}/outcomes/check", server.url))
            .bearer_auth(COLLECTOR)
            .json(&json!({"line": "[1]"}))
            .send()
            .await
            .unwrap_or_else(|e| panic!("round {round}: the check was lost: {e}"));
        assert_eq!(answered.status().as_u16(), 422, "round {round}");
        assert_eq!(
            answered.headers().get(reqwest::header::CONNECTION),
            None,
            "round {round}"
        );
    }
}

/// A client that writes its whole body before it reads the answer (Python's `urllib` and
/// `http.client` do) is told why it was refused: the service reads the rest of a body it
/// answered early and throws it away before it closes the connection (up to twice the body
/// limit), so the client's writes are never reset. (`urllib` reported a broken pipe instead of
/// every 401 and 403 to a body of 4 MB or more.)
#[test]
fn a_client_that_writes_its_whole_body_first_reads_the_refusal() {
    use std::io::{Read as _, Write as _};
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let log = dir.path().join("serve.log");
    let server = Server::start_with(&data, &root, None, &[("RR_BODY_LIMIT_MB", "4")], &log);
    let address = server.url.trim_start_matches("http://").to_owned();
    let mb = 1024 * 1024;
    let cases = [
        ("/runs/r/validate", "not-a-known-token-0123", 6 * mb, "401"),
        ("/runs/r/validate", VIEWER, 3 * mb, "403"),
        ("/no/such/route", COLLECTOR, 3 * mb, "404"),
        ("/runs/r/validate", COLLECTOR, 7 * mb, "413"),
    ];
    for round in 0..3 {
        for (path, token, size, status) in cases {
            let mut stream = std::net::TcpStream::connect(&address).expect("connect");
            stream
                .set_read_timeout(Some(Duration::from_secs(60)))
                .expect("timeout");
            let head = format!(
                "POST {path} HTTP/1.1\r\nhost: {address}\r\nauthorization: Bearer {token}\r\n\
                 content-type: application/json\r\ncontent-length: {size}\r\n\r\n"
            );
            stream.write_all(head.as_bytes()).expect("head");
            stream
                .write_all(&vec![b' '; size])
                .unwrap_or_else(|e| panic!("round {round} {path} {status}: writing the body: {e}"));
            let mut answer = Vec::new();
            stream
                .read_to_end(&mut answer)
                .unwrap_or_else(|e| panic!("round {round} {path} {status}: reading: {e}"));
            let answer = String::from_utf8_lossy(&answer);
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status} ")),
                "round {round} {path}: {answer}"
            );
            assert!(
                answer.to_ascii_lowercase().contains("connection: close"),
                "{answer}"
            );
        }
    }
}

/// A stopping service waits for the requests it is answering, but not forever on a client:
/// connections that sent half a request head, or a body that stopped coming, are dropped once
/// the longest a request may run has passed (the request timeout, then the time an unread
/// body is read on), and the service exits (hostile review 43: a stop waited 200 s on a
/// half-sent head, holding every lease's lock).
#[test]
fn a_stop_is_not_held_up_by_clients_that_stopped_sending() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let log = dir.path().join("serve.log");
    let mut server = Server::start_with(
        &data,
        &root,
        None,
        &[("RR_REQUEST_TIMEOUT_SECS", "1")],
        &log,
    );
    let address = server.url.trim_start_matches("http://").to_owned();
    let mut half_head = std::net::TcpStream::connect(&address).expect("connect");
    half_head
        .write_all(b"POST /runs HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-le")
        .expect("half a head");
    let mut stalled_body = std::net::TcpStream::connect(&address).expect("connect");
    stalled_body
        .write_all(
            format!("POST /runs HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {COLLECTOR}\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"output")
                .as_bytes(),
        )
        .expect("part of a body");
    // Connections are accepted in order: once a later one is answered, both were accepted.
    let mut probe = std::net::TcpStream::connect(&address).expect("connect");
    probe
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        .expect("probe");
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut probe, &mut answer).expect("probe answer");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let pid = libc::pid_t::try_from(server.child.id()).expect("pid");
    #[allow(unsafe_code)]
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    // The bound is the request timeout (1 s) and the linger (10 s); well before the 60 s a
    // head may take, so the head timeout is not what ends the half-sent one.
    let deadline = Instant::now() + Duration::from_secs(40);
    let status = loop {
        if let Some(status) = server.child.try_wait().expect("status") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the service was still running 40 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status:?}");
    drop((half_head, stalled_body));
}

#[tokio::test]
async fn a_run_end_to_end_over_a_real_socket() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let server = Server::start(&data, &root);
    let client = reqwest::Client::new();
    let root = std::fs::canonicalize(&root).expect("root");
    let output = root.join("exp/out.jsonl");
    let run_id = create_run(&client, &server, &root, &output).await;
    let (status, lease) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"holder": "collector-1", "host": "node-1", "pid": 1})),
    )
    .await;
    assert_eq!(status, 201, "{lease}");
    let lease_id = lease["lease_id"].as_str().expect("lease").to_owned();
    let validate = |temperature: f64, port: i64| json!({"config": config(temperature), "global_config": global(port), "source_path": root.join("src/train.jsonl"), "lease_id": lease_id});
    let uri = format!("/runs/{run_id}/validate");
    let (status, reuse) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &uri,
        COLLECTOR,
        Some(validate(0.3, 8000)),
    )
    .await;
    assert_eq!(
        (status, reuse["outcome"].as_str()),
        (200, Some("reuse")),
        "{reuse}"
    );
    let (status, drift) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &uri,
        COLLECTOR,
        Some(validate(0.3, 9000)),
    )
    .await;
    assert_eq!(
        (status, drift["outcome"].as_str()),
        (200, Some("resume_with_drift")),
        "{drift}"
    );
    let journal =
        std::fs::read_to_string(root.join("exp/out_manifest_resume_drift.jsonl")).expect("journal");
    assert_eq!(journal.lines().count(), 1, "one journal line");
    let (_, history) = call(
        &client,
        &server,
        reqwest::Method::GET,
        "/drift?key=servers.agent.responses_api_agents.simple_agent.sandbox.sandbox_port",
        VIEWER,
        None,
    )
    .await;
    assert_eq!(
        history["events"][0]["run_id"].as_str(),
        Some(run_id.as_str()),
        "{history}"
    );
    // A second resume across drift, for the operator CLI to page through below.
    let (status, again) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &uri,
        COLLECTOR,
        Some(validate(0.3, 9001)),
    )
    .await;
    assert_eq!(
        (status, again["outcome"].as_str()),
        (200, Some("resume_with_drift")),
        "{again}"
    );
    let (status, refused) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &uri,
        COLLECTOR,
        Some(validate(0.9, 8000)),
    )
    .await;
    assert_eq!(
        (status, refused["code"].as_str()),
        (409, Some("resume_refused"))
    );
    assert!(
        refused["message"]
            .as_str()
            .expect("message")
            .contains("collection.responses_create_params.temperature")
    );
    // The collector reserves and saves a masked result that kept an answer.
    let (_, reserved) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/attempts/reserve"),
        COLLECTOR,
        Some(json!({"lease_id": lease_id, "rollout_ids": ["0-0", "1-0"]})),
    )
    .await;
    assert_eq!(reserved["attempts"]["1-0"], 0, "{reserved}");
    let results = [
        json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id, "reward": 1.0, "response": {"output": [{}], "status": "completed"}}),
        json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id, "reward": 0.0, "mask_sample": true, "failure_kind": "verifier_error", "response": {"output": [{}], "status": "completed"}}),
    ];
    std::fs::write(
        &output,
        results.iter().map(|r| format!("{r}\n")).collect::<String>(),
    )
    .expect("results");
    let approval = json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "the verifier lost the artifact"});
    let (status, _) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/approvals"),
        VIEWER,
        Some(approval.clone()),
    )
    .await;
    assert_eq!(status, 403, "viewers cannot approve");
    let (status, approved) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/approvals"),
        OPERATOR,
        Some(approval),
    )
    .await;
    assert_eq!(status, 201, "{approved}");
    let (_, plan) = call(
        &client,
        &server,
        reqwest::Method::GET,
        &format!("/runs/{run_id}/plan"),
        VIEWER,
        None,
    )
    .await;
    assert_eq!(plan["entries"][1]["state"], "approved_rerun", "{plan}");
    let approvals =
        std::fs::read_to_string(root.join("exp/out_rerun_masked.jsonl")).expect("journal");
    assert!(approvals.contains("\"task_index\":1") && approvals.contains("\"attempt_index\":0"));
    // The operator CLI reads the same drift history, a page at a time.
    let drift_page = |cursor: Option<&str>| {
        let mut args = vec![
            "drift",
            "--url",
            &server.url,
            "--run",
            &run_id,
            "--limit",
            "1",
        ];
        if let Some(cursor) = cursor {
            args.extend(["--cursor", cursor]);
        }
        let cli = Command::new(BIN)
            .args(args)
            .env("RR_TOKEN", VIEWER)
            .output()
            .expect("cli");
        assert!(
            cli.status.success(),
            "{}",
            String::from_utf8_lossy(&cli.stderr)
        );
        serde_json::from_slice::<Value>(&cli.stdout).expect("json")
    };
    let first = drift_page(None);
    let next = first["next_cursor"].as_str().expect("another page follows");
    let second = drift_page(Some(next));
    assert_eq!(second["next_cursor"], Value::Null, "{second}");
    let ids: Vec<&Value> = [&first, &second]
        .iter()
        .flat_map(|page| page["events"].as_array().expect("events"))
        .map(|event| &event["event_id"])
        .collect();
    assert_eq!(ids.len(), 2, "{first} {second}");
    assert_ne!(ids[0], ids[1], "two different events");
    // A run id that is no run is refused, not answered with an empty history.
    let typo = Command::new(BIN)
        .args([
            "drift",
            "--url",
            &server.url,
            "--run",
            "no-such-run",
            "--follow",
        ])
        .env("RR_TOKEN", VIEWER)
        .output_within(FOLLOWER_LIMIT)
        .expect("cli");
    assert!(
        !typo.status.success() && String::from_utf8_lossy(&typo.stderr).contains("not_found"),
        "{}",
        String::from_utf8_lossy(&typo.stderr)
    );
    // Following prints what is recorded, then what is recorded while it follows.
    let state = dir.path().join("follow.cursor");
    let (follower, next_id) = follow_drift(&server.url, &run_id, &state);
    let mut followed = vec![next_id(), next_id()];
    followed.sort();
    let mut paged: Vec<String> = ids
        .iter()
        .map(|id| id.as_str().expect("id").to_owned())
        .collect();
    paged.sort();
    assert_eq!(followed, paged, "the events already recorded, each once");
    let recorded = |port: i64| {
        let (client, server, uri, body) = (&client, &server, &uri, validate(0.3, port));
        async move {
            let (status, event) = call(
                client,
                server,
                reqwest::Method::POST,
                uri,
                COLLECTOR,
                Some(body),
            )
            .await;
            assert_eq!(event["outcome"], "resume_with_drift", "{status} {event}");
            event["drift_event_id"].as_str().expect("id").to_owned()
        }
    };
    let third = recorded(9002).await;
    assert_eq!(next_id(), third, "then the one recorded while following");
    // Stopped once its cursor is saved past the third event, a follower started again on the
    // same state file goes on with what was recorded meanwhile, nothing before.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !std::fs::read_to_string(&state).is_ok_and(|c| c.trim_end().ends_with(":3")) {
        assert!(
            std::time::Instant::now() < deadline,
            "the state file keeps the cursor"
        );
        std::thread::yield_now();
    }
    drop(follower);
    let fourth = recorded(9003).await;
    let (_again, next_id) = follow_drift(&server.url, &run_id, &state);
    assert_eq!(
        next_id(),
        fourth,
        "a restarted follower goes on where it stopped"
    );
}

/// How long a follower that should stop by itself (refused, or told its cursor expired) may
/// take: one that follows on instead fails the test rather than hanging it.
const FOLLOWER_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// `Command::output` bounded in time: a command still running at the limit is killed, and the
/// caller fails saying so.
trait OutputWithin {
    fn output_within(
        &mut self,
        limit: std::time::Duration,
    ) -> std::io::Result<std::process::Output>;
}

impl OutputWithin for Command {
    fn output_within(
        &mut self,
        limit: std::time::Duration,
    ) -> std::io::Result<std::process::Output> {
        let child = self.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        let pid = child.id().to_string();
        let (ended, ended_rx) = std::sync::mpsc::channel::<()>();
        let watchdog = std::thread::spawn(move || {
            let late = ended_rx.recv_timeout(limit).is_err();
            if late {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
            }
            late
        });
        let output = child.wait_with_output();
        let _ = ended.send(());
        let late = watchdog.join().expect("watchdog");
        assert!(!late, "{self:?} was still running after {limit:?}");
        output
    }
}

/// A child process killed and reaped when dropped (also when a test fails: a child left running
/// would hold the test's output open).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `drift --follow` of one run keeping its cursor in `state`, and a reader of the event id of
/// each line it prints (failing after a minute without one).
fn follow_drift(url: &str, run_id: &str, state: &Path) -> (Killed, impl Fn() -> String) {
    let mut follower = Command::new(BIN)
        .args([
            "drift",
            "--url",
            url,
            "--run",
            run_id,
            "--follow",
            "--interval",
            "0.05",
        ])
        .arg("--state")
        .arg(state)
        .env("RR_TOKEN", VIEWER)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("follower");
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let stdout = follower.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines_tx.send(line);
        }
    });
    let next_id = move || {
        let line = lines
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the follower prints an event");
        let event: Value = serde_json::from_str(&line).expect("one JSON event per line");
        event["event_id"].as_str().expect("id").to_owned()
    };
    (Killed(follower), next_id)
}

const PYTHON_PROBE: &str = "import fcntl, sys\nf = open(sys.argv[1], 'a+b')\ntry:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    print('acquired')\nexcept BlockingIOError:\n    print('blocked')\n";

/// A Python collector holding a lock file's `flock` (as `fcntl.flock` takes it) until dropped.
struct PythonLock(std::process::Child);

impl PythonLock {
    /// Starts the holder and returns once it holds the lock.
    fn hold(lock: &Path) -> Self {
        let mut child = Command::new("python3")
            .args(["-c", "import fcntl, sys\nf = open(sys.argv[1], 'a+b')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nprint('locked', flush=True)\nsys.stdin.read()\n"])
            .arg(lock)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().expect("stdout")),
            &mut line,
        )
        .expect("read");
        assert_eq!(line.trim(), "locked", "the holder took {}", lock.display());
        Self(child)
    }
}

impl Drop for PythonLock {
    /// Closes the holder's stdin (it exits, releasing the lock) and waits for it.
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

fn probe(lock: &Path) -> String {
    let out = Command::new("python3")
        .args(["-c", PYTHON_PROBE])
        .arg(lock)
        .output()
        .expect("python3");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test]
async fn json_nested_to_the_documented_limit_is_served_and_deeper_is_refused_without_a_crash() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let server = Server::start(&data, &root);
    let client = reqwest::Client::new();
    let deep = |depth: usize| format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
    for (depth, expected) in [(450, 201), (509, 201), (510, 422)] {
        // The body is level 1, `global_config` 2, its `policy` 3: `depth` more reach 3 + depth.
        let mut global = global(8000);
        global["policy_model"]["deep"] = json!("DEEP");
        let body = json!({"output_path": root.join(format!("d{depth}/out.jsonl")), "source_path": root.join("src/train.jsonl"),
            "config": config(0.3), "global_config": global,
            "rows": [{"agent_ref": {"name": "agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0}]});
        let text = body.to_string().replace("\"DEEP\"", &deep(depth));
        let response = client
            .post(format!("{}/runs", server.url))
            .bearer_auth(COLLECTOR)
            .header("content-type", "application/json")
            .body(text.clone())
            .send()
            .await
            .expect("the service answers");
        let status = response.status().as_u16();
        let answer: Value = response.json().await.expect("json");
        assert_eq!(status, expected, "{depth}: {answer}");
        if status == 201 {
            let run_id = answer["run_id"].as_str().expect("run");
            let mut validate: Value =
                serde_json::from_str(&text.replace(&deep(depth), "\"DEEP\"")).expect("body");
            let validate_body = json!({"config": validate["config"].take(), "global_config": validate["global_config"].take(), "source_path": validate["source_path"].take()})
                .to_string()
                .replace("\"DEEP\"", &deep(depth));
            let reply = client
                .post(format!("{}/runs/{run_id}/validate", server.url))
                .bearer_auth(COLLECTOR)
                .header("content-type", "application/json")
                .body(validate_body)
                .send()
                .await
                .expect("the service answers");
            assert_eq!(reply.status().as_u16(), 200, "{depth}");
        } else {
            assert!(
                answer["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("512")),
                "{answer}"
            );
        }
    }
}

#[tokio::test]
async fn serve_binds_a_host_name_and_logs_without_colours_to_a_file() {
    let dir = tempfile::tempdir().expect("dir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port();
    let log = dir.path().join("service.log");
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--bind",
            &format!("localhost:{port}"),
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .env_remove("RR_TOKENS")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("serve");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut healthy = None;
    while Instant::now() < deadline && healthy.is_none() {
        healthy = reqwest::get(format!("http://127.0.0.1:{port}/healthz"))
            .await
            .ok()
            .map(|r| r.status());
        if healthy.is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        healthy.map(|s| s.as_u16()),
        Some(200),
        "localhost:{port} is 127.0.0.1"
    );
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(text.contains("rollout-recovery listening"), "{text}");
    assert!(
        !text.contains('\x1b'),
        "no ANSI escapes in a log file: {text:?}"
    );
}

/// One service process per SQLite file: a second one on the same database (the same data
/// directory, or a symbolic link to the file) is refused before it touches the database, as is
/// a database file with a second name (a hard link), and the first keeps serving; once the
/// first stops, a new one starts.
#[tokio::test]
async fn a_second_service_process_on_one_sqlite_file_is_refused_and_the_first_keeps_serving() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).expect("other data dir");
    let second = |database: Option<&Path>| {
        let mut command = Command::new(BIN);
        command
            .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
            .arg(if database.is_some() { &other } else { &data })
            .arg("--root")
            .arg(&root);
        if let Some(database) = database {
            command
                .arg("--database-url")
                .arg(format!("sqlite://{}", database.display()));
        }
        command
            .env_remove("RR_TOKENS")
            .env("RR_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("serve")
    };
    let first = Server::start(&data, &root);
    let database = data.join("rollout-recovery.db");
    let symlink = other.join("link.db");
    std::os::unix::fs::symlink(&database, &symlink).expect("symlink");
    let hard_link = other.join("hard.db");
    // `%2D` is `-` to SQLite's URL reader: the same file.
    let encoded = data.join("rollout%2Drecovery.db");
    let in_use = "another service process uses this SQLite database";
    for (case, database, why, instead) in [
        ("the same data directory", None, in_use, "postgres://"),
        ("a link to the file", Some(&symlink), in_use, "postgres://"),
        (
            "a percent-encoded name",
            Some(&encoded),
            in_use,
            "postgres://",
        ),
        (
            "a second name of the file",
            Some(&hard_link),
            "has more than one name (hard links)",
            "give it one name",
        ),
    ] {
        if database == Some(&hard_link) {
            std::fs::hard_link(data.join("rollout-recovery.db"), &hard_link).expect("hard link");
        }
        let (started, stderr) = started_or_refused(second(database.map(PathBuf::as_path)));
        assert!(
            !started,
            "{case}: the second process must not start: {stderr}"
        );
        assert!(
            stderr.contains(why) && stderr.contains(instead),
            "{case}: the refusal says why and what to do: {stderr}"
        );
    }
    std::fs::remove_file(&hard_link).expect("one name again");
    let client = reqwest::Client::new();
    let health = client
        .get(format!("{}/healthz", first.url))
        .send()
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200, "the first keeps serving");
    assert!(first.terminate().success());
    // The lock went with the first process: a new one starts (and is stopped here).
    let (started, stderr) = started_or_refused(second(None));
    assert!(started, "a service starts once the first stopped: {stderr}");
}

/// The service names the database it connects to (in its log at start, in its refusal when it
/// cannot) without the password, wherever the URL carries it; a connection string that is no URL
/// is refused without being echoed.
#[test]
fn a_database_password_is_never_logged() {
    let dir = tempfile::tempdir().expect("dir");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    for (case, url, said) in [
        (
            "in the user info",
            format!("postgres://collector:DBSECRET@127.0.0.1:{port}/test"),
            "cannot connect to the database",
        ),
        (
            "as a query parameter",
            format!("postgres://127.0.0.1:{port}/test?user=collector&password=DBSECRET"),
            "cannot connect to the database",
        ),
        (
            "as a parameter spelt otherwise (the driver would log it)",
            format!("postgres://127.0.0.1:{port}/test?user=collector&PASSWORD=DBSECRET"),
            "unknown query parameter `PASSWORD`",
        ),
        (
            "in a connection string",
            format!("host=127.0.0.1 port={port} user=collector password=DBSECRET"),
            "unsupported database URL",
        ),
    ] {
        let child = Command::new(BIN)
            .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join("data"))
            .arg("--database-url")
            .arg(&url)
            .env_remove("RR_TOKENS")
            .env("RR_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("serve");
        let (started, stderr) = started_or_refused(child);
        assert!(!started, "{case}: nothing listens there: {stderr}");
        assert!(stderr.contains(said), "{case}: {stderr}");
        assert!(!stderr.contains("DBSECRET"), "{case}: {stderr}");
    }
}

/// Whether a `serve` process started (it logged so; it is stopped then) or ended refusing to,
/// with what it wrote to stderr either way.
fn started_or_refused(mut child: std::process::Child) -> (bool, String) {
    let mut stderr = child.stderr.take().expect("stderr");
    let mut text = String::new();
    let mut buffer = [0u8; 4096];
    // The service logs its start; a refusal ends the stream instead.
    while let Ok(n) = std::io::Read::read(&mut stderr, &mut buffer) {
        if n == 0 {
            break;
        }
        text.push_str(&String::from_utf8_lossy(&buffer[..n]));
        if text.contains("rollout-recovery listening") {
            let _ = child.kill();
            let _ = child.wait();
            return (true, text);
        }
    }
    let status = child.wait().expect("wait");
    (status.success(), text)
}

#[tokio::test]
async fn a_restart_keeps_live_leases_and_their_locks_whether_stopped_or_killed() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let server = Server::start(&data, &root);
    let client = reqwest::Client::new();
    let root = std::fs::canonicalize(&root).expect("root");
    let run_id = create_run(&client, &server, &root, &root.join("exp/out.jsonl")).await;
    let (status, granted) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"holder": "c", "host": "h", "pid": 1, "ttl_seconds": 3600})),
    )
    .await;
    assert_eq!(status, 201, "{granted}");
    let lease_id = granted["lease_id"].as_str().expect("lease id").to_owned();
    let lock = root.join("exp/out_run.lock");
    assert_eq!(probe(&lock), "blocked", "the live lease holds the run lock");
    let status = server.terminate();
    assert!(
        status.success(),
        "SIGTERM stops the service cleanly: {status:?}"
    );
    assert_eq!(
        probe(&lock),
        "acquired",
        "the lock is free while no service runs"
    );
    let mut server = Server::start(&data, &root);
    for stop in ["a SIGTERM", "a SIGKILL"] {
        // The restarted service holds the lock again for the lease's collector: another
        // collector is refused, and the holder renews and keeps the run.
        assert_eq!(
            probe(&lock),
            "blocked",
            "after {stop}: the lock is taken again"
        );
        let (status, holder) = call(
            &client,
            &server,
            reqwest::Method::GET,
            &format!("/runs/{run_id}/lease"),
            VIEWER,
            None,
        )
        .await;
        assert_eq!(
            (status, &holder["holder"]["holder"]),
            (200, &json!("c")),
            "after {stop}: {holder}"
        );
        let (status, refused) = call(
            &client,
            &server,
            reqwest::Method::POST,
            &format!("/runs/{run_id}/lease"),
            COLLECTOR,
            Some(json!({"holder": "intruder", "host": "h", "pid": 2, "ttl_seconds": 60})),
        )
        .await;
        assert_eq!(status, 423, "after {stop}: {refused}");
        let (status, renewed) = call(
            &client,
            &server,
            reqwest::Method::POST,
            &format!("/runs/{run_id}/lease/heartbeat"),
            COLLECTOR,
            Some(json!({"lease_id": lease_id, "ttl_seconds": 3600})),
        )
        .await;
        assert_eq!(status, 200, "after {stop}: {renewed}");
        // Then the service is killed outright, and started again.
        drop(server);
        server = Server::start(&data, &root);
    }
    let (status, _) = call(
        &client,
        &server,
        reqwest::Method::DELETE,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"lease_id": lease_id})),
    )
    .await;
    assert_eq!(status, 204, "the holder releases the run in the end");
    assert_eq!(probe(&lock), "acquired", "and the lock with it");
}

/// A drift journal left ending in a torn line (a writer killed mid-write) is cut back to its
/// last complete line before the next append, and the operator is told in the log which journal
/// lost how many bytes (the repair was silent: hostile review 29).
#[tokio::test]
async fn a_torn_journal_tail_is_cut_off_and_logged_naming_the_journal_and_the_bytes() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let log = dir.path().join("service.log");
    let client = reqwest::Client::new();
    let server = Server::start_logging_to(&data, &root, std::fs::File::create(&log).expect("log"));
    let root = std::fs::canonicalize(&root).expect("root");
    let run_id = create_run(&client, &server, &root, &root.join("exp/out.jsonl")).await;
    let drift = |port: i64| json!({"config": config(0.3), "global_config": global(port), "source_path": root.join("src/train.jsonl")});
    let validate = format!("/runs/{run_id}/validate");
    let journal = root.join("exp/out_manifest_resume_drift.jsonl");
    let torn = b"{\"event\": \"resume_with_dr";
    for (port, tear) in [(9001, false), (9002, true)] {
        if tear {
            let mut file = std::fs::OpenOptions::new()
                .append(true)
                .open(&journal)
                .expect("journal");
            std::io::Write::write_all(&mut file, torn).expect("tear");
        }
        let (status, answer) = call(
            &client,
            &server,
            reqwest::Method::POST,
            &validate,
            COLLECTOR,
            Some(drift(port)),
        )
        .await;
        assert_eq!(
            (status, answer["outcome"].as_str()),
            (200, Some("resume_with_drift")),
            "{answer}"
        );
    }
    drop(server);
    let lines = std::fs::read_to_string(&journal).expect("journal");
    assert_eq!(lines.lines().count(), 2, "{lines}");
    assert!(
        lines.ends_with('\n') && !lines.contains("resume_with_dr\""),
        "{lines}"
    );
    let text = std::fs::read_to_string(&log).expect("log");
    let warning = text
        .lines()
        .find(|line| line.contains("incomplete line"))
        .unwrap_or_else(|| panic!("no warning of the cut: {text}"));
    assert!(
        warning.contains(&format!("bytes_removed={}", torn.len()))
            && warning.contains(&journal.display().to_string()),
        "{warning}"
    );
}

/// The database restored from an older backup: start-up indexes the drift it lacks again, under
/// new positions, so a follower's cursor from before the restore answers 410 `cursor_expired`
/// (the hostile review saw it accepted, silently skipping events renumbered below it), and
/// following afresh answers every event.
#[tokio::test]
async fn a_follow_cursor_from_before_a_restore_of_an_older_backup_has_expired() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let client = reqwest::Client::new();
    let server = Server::start(&data, &root);
    let root = std::fs::canonicalize(&root).expect("root");
    let run_id = create_run(&client, &server, &root, &root.join("exp/out.jsonl")).await;
    let drift = |port: i64| json!({"config": config(0.3), "global_config": global(port), "source_path": root.join("src/train.jsonl")});
    let validate = format!("/runs/{run_id}/validate");
    let (status, first) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &validate,
        COLLECTOR,
        Some(drift(9001)),
    )
    .await;
    assert_eq!(
        (status, first["outcome"].as_str()),
        (200, Some("resume_with_drift")),
        "{first}"
    );
    assert!(server.terminate().success());
    let backup = dir.path().join("backup");
    std::fs::create_dir(&backup).expect("backup dir");
    let database_files = |from: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(from)
            .expect("data dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("rollout-recovery.db"))
            })
            .collect()
    };
    let copy_all = |files: Vec<PathBuf>, to: &Path| {
        for file in files {
            std::fs::copy(&file, to.join(file.file_name().expect("name"))).expect("copy");
        }
    };
    copy_all(database_files(&data), &backup);
    let server = Server::start(&data, &root);
    let (status, second) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &validate,
        COLLECTOR,
        Some(drift(9002)),
    )
    .await;
    assert_eq!(
        (status, second["outcome"].as_str()),
        (200, Some("resume_with_drift")),
        "{second}"
    );
    let (status, page) = call(
        &client,
        &server,
        reqwest::Method::GET,
        "/drift?order=recorded",
        VIEWER,
        None,
    )
    .await;
    assert_eq!(
        (status, page["events"].as_array().map(Vec::len)),
        (200, Some(2)),
        "{page}"
    );
    let follow_cursor = page["follow_cursor"].as_str().expect("follow cursor");
    let state = dir.path().join("follow.cursor");
    std::fs::write(&state, format!("{follow_cursor}\n")).expect("state");
    let cursor = follow_cursor.replace(':', "%3A");
    assert!(server.terminate().success());
    for file in database_files(&data) {
        std::fs::remove_file(file).expect("remove");
    }
    copy_all(database_files(&backup), &data);
    let server = Server::start(&data, &root);
    let (status, expired) = call(
        &client,
        &server,
        reqwest::Method::GET,
        &format!("/drift?order=recorded&cursor={cursor}"),
        VIEWER,
        None,
    )
    .await;
    assert_eq!(
        (status, expired["code"].as_str()),
        (410, Some("cursor_expired")),
        "{expired}"
    );
    let (status, afresh) = call(
        &client,
        &server,
        reqwest::Method::GET,
        "/drift?order=recorded",
        VIEWER,
        None,
    )
    .await;
    assert_eq!(
        (status, afresh["events"].as_array().map(Vec::len)),
        (200, Some(2)),
        "{afresh}"
    );
    // The CLI follower keeping that cursor stops saying so, and empties its state file so
    // that it follows afresh when run again (the review saw the stale cursor kept).
    let follower = Command::new(BIN)
        .args(["drift", "--url", &server.url, "--follow", "--state"])
        .arg(&state)
        .env("RR_TOKEN", VIEWER)
        .output_within(FOLLOWER_LIMIT)
        .expect("follower");
    let stderr = String::from_utf8_lossy(&follower.stderr);
    assert!(
        !follower.status.success() && stderr.contains("cursor_expired"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&state).expect("state"), "");
}

/// `drift --follow --state` in a directory that does not exist is refused before it prints or
/// asks anything (the review saw events printed, then the command fail on its first save).
#[test]
fn a_follow_state_file_that_cannot_be_written_is_refused_at_once() {
    let dir = tempfile::tempdir().expect("dir");
    let state = dir.path().join("missing/follow.cursor");
    // No service listens on port 9: a check made only after asking would retry forever.
    let follower = Command::new(BIN)
        .args([
            "drift",
            "--url",
            "http://127.0.0.1:9",
            "--follow",
            "--state",
        ])
        .arg(&state)
        .env("RR_TOKEN", VIEWER)
        .output_within(FOLLOWER_LIMIT)
        .expect("follower");
    let stderr = String::from_utf8_lossy(&follower.stderr);
    assert!(
        !follower.status.success() && stderr.contains("--state") && follower.stdout.is_empty(),
        "{stderr}"
    );
}

/// A follow state file holding what is no cursor (hand-edited, another program's file) is
/// refused naming the file and how to recover, and an empty `--run` is refused before anything
/// is asked (it named another route).
#[tokio::test]
async fn a_follow_state_that_is_no_cursor_and_an_empty_run_are_refused_naming_them() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let server = Server::start(&data, &root);
    let state = dir.path().join("follow.cursor");
    std::fs::write(&state, "not a cursor\n").expect("state");
    let follower = Command::new(BIN)
        .args(["drift", "--url", &server.url, "--follow", "--state"])
        .arg(&state)
        .env("RR_TOKEN", VIEWER)
        .output_within(FOLLOWER_LIMIT)
        .expect("follower");
    let stderr = String::from_utf8_lossy(&follower.stderr);
    assert!(
        !follower.status.success()
            && stderr.contains(&state.display().to_string())
            && stderr.contains("remove that file")
            && follower.stdout.is_empty(),
        "{stderr}"
    );
    // No service listens on port 9: an empty run that reached the network would retry or fail
    // otherwise.
    let empty = Command::new(BIN)
        .args(["drift", "--url", "http://127.0.0.1:9", "--run", ""])
        .env("RR_TOKEN", VIEWER)
        .output()
        .expect("drift");
    let stderr = String::from_utf8_lossy(&empty.stderr);
    assert!(
        !empty.status.success() && stderr.contains("--run") && !stderr.contains("127.0.0.1:9"),
        "{stderr}"
    );
    assert!(server.terminate().success());
}

/// The CLI's HTTP commands keep a run id one path segment (`approve --run ../reindex#` asked
/// POST /reindex and printed its report), refuse an empty one before asking, and refuse a
/// `--url` with credentials without printing them (`drift --follow` printed them with every
/// retry, and they replaced the token).
#[tokio::test]
async fn run_ids_stay_one_path_segment_and_url_credentials_are_refused_unprinted() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let server = Server::start(&data, &root);
    let approve = |run: &str, url: &str| {
        Command::new(BIN)
            .args(["approve", "--url", url, "--run", run])
            .args([
                "--task",
                "0",
                "--rollout",
                "0",
                "--attempt",
                "0",
                "--reason",
                "x",
            ])
            .env("RR_TOKEN", OPERATOR)
            .output()
            .expect("approve")
    };
    let climbing = approve("../reindex#", &server.url);
    let stderr = String::from_utf8_lossy(&climbing.stderr);
    assert!(
        !climbing.status.success() && stderr.contains("not_found") && climbing.stdout.is_empty(),
        "{stderr}"
    );
    let empty = approve("", &server.url);
    assert!(!empty.status.success() && String::from_utf8_lossy(&empty.stderr).contains("--run"));
    let with_credentials = server.url.replace("http://", "http://user:URLPASS@");
    for output in [
        approve("r", &with_credentials),
        Command::new(BIN)
            .args(["drift", "--follow", "--url", &with_credentials])
            .env("RR_TOKEN", VIEWER)
            .output_within(FOLLOWER_LIMIT)
            .expect("drift"),
    ] {
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success()
                && stderr.contains("--url: credentials")
                && !stderr.contains("URLPASS"),
            "{stderr}"
        );
    }
    assert!(server.terminate().success());
}

/// A lease whose run lock another process (a collector that did not wait) took while the
/// service was down is ended when the service starts again, audited, and never reported live:
/// asking who holds the run says another process does.
#[tokio::test]
async fn a_lease_whose_lock_another_process_took_while_the_service_was_down_ends_at_start() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let server = Server::start(&data, &root);
    let client = reqwest::Client::new();
    let root = std::fs::canonicalize(&root).expect("root");
    let run_id = create_run(&client, &server, &root, &root.join("exp/out.jsonl")).await;
    let (status, granted) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"holder": "c", "host": "h", "pid": 1, "ttl_seconds": 3600})),
    )
    .await;
    assert_eq!(status, 201, "{granted}");
    assert!(server.terminate().success());
    let python = PythonLock::hold(&root.join("exp/out_run.lock"));
    let server = Server::start(&data, &root);
    let (status, holder) = call(
        &client,
        &server,
        reqwest::Method::GET,
        &format!("/runs/{run_id}/lease"),
        VIEWER,
        None,
    )
    .await;
    assert_eq!(
        (status, &holder["holder"], &holder["locked_outside_service"]),
        (200, &Value::Null, &json!(true)),
        "{holder}"
    );
    let (status, refused) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease/heartbeat"),
        COLLECTOR,
        Some(json!({"lease_id": granted["lease_id"]})),
    )
    .await;
    assert_eq!(
        (status, &refused["code"]),
        (409, &json!("lease_not_held")),
        "{refused}"
    );
    let (_, audit) = call(
        &client,
        &server,
        reqwest::Method::GET,
        &format!("/audit?run_id={run_id}"),
        OPERATOR,
        None,
    )
    .await;
    assert!(audit.to_string().contains("lease.lost"), "{audit}");
    drop(python);
    let (status, again) = call(
        &client,
        &server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"holder": "d", "host": "h", "pid": 2})),
    )
    .await;
    assert_eq!(status, 201, "free once the other process let go: {again}");
}

fn shared(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(relative)
}

#[test]
fn the_offline_digest_tool_matches_the_cpython_vectors() {
    let file = shared("conformance/materialized/rows-200.jsonl");
    let expected = std::fs::read_to_string(file.with_extension("jsonl.sha256")).expect("sidecar");
    let out = Command::new(BIN)
        .args(["digest", "--jsonl"])
        .arg(&file)
        .output()
        .expect("digest");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        expected.split_whitespace().next().expect("digest")
    );
    let mut child = Command::new(BIN)
        .arg("digest")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("digest");
    std::io::Write::write_all(
        child.stdin.as_mut().expect("stdin"),
        b"{\"b\": 1, \"a\": [1.0, 1e16]}",
    )
    .expect("write");
    drop(child.stdin.take());
    let out = child.wait_with_output().expect("digest");
    let expected = recovery_core::canonical::sha256_hex(b"{\"a\":[1.0,1e+16],\"b\":1}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), expected);
    let bad = Command::new(BIN)
        .arg("digest")
        .arg(dir_file("nan", b"NaN"))
        .output()
        .expect("digest");
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("NaN"));
}

fn dir_file(name: &str, bytes: &[u8]) -> PathBuf {
    let path = std::env::temp_dir().join(format!("rr-cli-{}-{name}", std::process::id()));
    std::fs::write(&path, bytes).expect("write");
    path
}

#[test]
fn the_committed_openapi_document_is_current() {
    let out = Command::new(BIN)
        .args(["openapi", "--check"])
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../openapi/openapi.json"))
        .output()
        .expect("openapi");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn offline_plan_identity_and_validate_answer_with_collector_exit_codes() {
    let dir = tempfile::tempdir().expect("dir");
    let output = dir.path().join("out.jsonl");
    let paths = recovery_sidecar::SidecarPaths::for_output(
        &std::fs::canonicalize(dir.path())
            .expect("dir")
            .join("out.jsonl"),
    );
    let rows = "{\"agent_ref\":{\"name\":\"agent\"},\"_ng_task_index\":0,\"_ng_rollout_index\":0}\n{\"agent_ref\":{\"name\":\"agent\"},\"_ng_task_index\":1,\"_ng_rollout_index\":0}\n";
    std::fs::write(&paths.materialized, rows).expect("rows");
    let source = dir.path().join("train.jsonl");
    std::fs::write(&source, b"{}\n").expect("source");
    let bundle = dir.path().join("bundle.json");
    std::fs::write(
        &bundle,
        json!({"config": config(0.3), "global_config": global(8000)}).to_string(),
    )
    .expect("bundle");
    // Identity: digests and the redacted identity.
    let out = Command::new(BIN)
        .args(["identity", "--bundle"])
        .arg(&bundle)
        .arg("--materialized")
        .arg(&paths.materialized)
        .output()
        .expect("identity");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let identity: Value = serde_json::from_slice(&out.stdout).expect("json");
    let config_digest = identity["config_digest"]
        .as_str()
        .expect("digest")
        .to_owned();
    std::fs::write(
        &paths.identity,
        serde_json::to_string(&identity["identity"]).expect("json"),
    )
    .expect("identity file");
    // A run saved with that identity.
    let materialized = recovery_core::materialized::materialized_digest(rows.as_bytes(), 1)
        .expect("digest")
        .sha256;
    let source_digest = recovery_core::canonical::sha256_hex(b"{}\n");
    let mut manifest = recovery_core::manifest::RunManifest::create(
        "ab".repeat(16),
        source_digest,
        materialized,
        config_digest,
        Some(1),
    );
    manifest.next_attempt.insert("0-0".into(), 1);
    std::fs::write(&paths.manifest, manifest.to_pretty_json().expect("json")).expect("manifest");
    std::fs::write(&paths.output, format!("{{\"_ng_task_index\":0,\"_ng_rollout_index\":0,\"_ng_attempt_index\":0,\"_ng_run_id\":\"{}\",\"reward\":1.0,\"response\":{{\"status\":\"completed\"}}}}\n", "ab".repeat(16))).expect("results");
    std::fs::write(&paths.failures, b"").expect("failures");
    let plan = Command::new(BIN)
        .args(["plan", "--output"])
        .arg(&output)
        .output()
        .expect("plan");
    assert_eq!(
        plan.status.code(),
        Some(75),
        "partial and retryable: {}",
        String::from_utf8_lossy(&plan.stderr)
    );
    assert!(String::from_utf8_lossy(&plan.stderr).contains("1/2"));
    let validate = |bundle: &Path| {
        Command::new(BIN)
            .args(["validate", "--output"])
            .arg(&output)
            .arg("--source")
            .arg(&source)
            .arg("--bundle")
            .arg(bundle)
            .output()
            .expect("validate")
    };
    let same = validate(&bundle);
    assert_eq!(
        same.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&same.stdout)
    );
    let hotter = dir.path().join("hotter.json");
    std::fs::write(
        &hotter,
        json!({"config": config(0.9), "global_config": global(8000)}).to_string(),
    )
    .expect("bundle");
    let refused = validate(&hotter);
    assert_eq!(
        refused.status.code(),
        Some(1),
        "a refusal exits 1 like ConfigError"
    );
    let report: Value = serde_json::from_slice(&refused.stdout).expect("a JSON report");
    assert_eq!(report["mismatches"], json!(["semantic_configuration"]));
    // Each refusing key with its rule, as the service's `details.semantic_keys` gives it.
    assert_eq!(
        report["semantic_keys"],
        json!([{"key": "collection.responses_create_params.temperature", "class": "semantic", "reason": "listed_key", "segment": "responses_create_params"}]),
        "{report}"
    );
    let against = Command::new(BIN)
        .args(["identity", "--bundle"])
        .arg(&hotter)
        .arg("--materialized")
        .arg(&paths.materialized)
        .arg("--against")
        .arg(&paths.identity)
        .output()
        .expect("identity");
    let report: Value = serde_json::from_slice(&against.stdout).expect("json");
    assert_eq!(
        report["against"]["semantic"][0]["key"],
        "collection.responses_create_params.temperature"
    );
    // What is no saved identity (not JSON; a bundle given by mistake) is refused naming the
    // file, never compared (hostile review 53, F9).
    // Nor is an object whose parts are not objects (review 54).
    let not_json = dir.path().join("passwd");
    std::fs::write(&not_json, "root:x:0:0:root:/root:/bin/bash\n").expect("file");
    let wrong_shape = dir.path().join("wrong_shape_identity.json");
    std::fs::write(&wrong_shape, r#"{"collection": 1, "servers": []}"#).expect("file");
    // And one holding a number no digest can be taken of is refused naming it (review 55).
    let infinite_identity = dir.path().join("infinite_identity.json");
    std::fs::write(
        &infinite_identity,
        r#"{"collection": {"x": {"y": [1, -1e400]}}, "servers": {}}"#,
    )
    .expect("file");
    for (wrong, says) in [
        (&not_json, "not JSON"),
        (&hotter, "not a saved identity"),
        (&wrong_shape, "not a saved identity"),
        (
            &infinite_identity,
            "collection.x.y[1]: a number with no canonical form",
        ),
    ] {
        let refused = Command::new(BIN)
            .args(["identity", "--bundle"])
            .arg(&hotter)
            .arg("--materialized")
            .arg(&paths.materialized)
            .arg("--against")
            .arg(wrong)
            .output()
            .expect("identity");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("--against {}: {says}", wrong.display())),
            "{stderr}"
        );
        assert!(refused.stdout.is_empty());
    }
    // A bundle whose digest cannot be taken (a number Python reads as infinity) is refused
    // naming the key, as the service does, not called "not JSON" (review 54).
    let infinite = dir.path().join("infinite_bundle.json");
    std::fs::write(
        &infinite,
        r#"{"config": {"a": [1, 1e999]}, "global_config": {}}"#,
    )
    .expect("bundle");
    // So does the digest tool of such a document (review 55: "(byte 26)", no key).
    for command in [&["identity", "--bundle"][..], &["digest"][..]] {
        let refused = Command::new(BIN)
            .args(command)
            .arg(&infinite)
            .output()
            .expect("identity");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{command:?}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "{}: config.a[1]: a number with no canonical form",
                infinite.display()
            )),
            "{command:?}: {stderr}"
        );
    }
    // Offline validate answers it as the service answers and records it: `invalid`, exit 1,
    // naming the key (review 55, F13: exit 2 and a bare error).
    let invalid = validate(&infinite);
    assert_eq!(invalid.status.code(), Some(1));
    let report: Value = serde_json::from_slice(&invalid.stdout).expect("a JSON report");
    assert_eq!(
        (
            &report["outcome"],
            &report["code"],
            &report["details"]["field"]
        ),
        (
            &json!("invalid"),
            &json!("invalid_request"),
            &json!("config.a[1]")
        ),
        "{report}"
    );
    // A part no bundle has (a misspelt `environment`) is refused, never ignored, and so is a row
    // that is no object, as the service refuses it (F12).
    for (name, bundle, says) in [
        (
            "misspelt_bundle.json",
            json!({"config": config(0.3), "global_config": global(8000), "enviroment": {"X": "1"}}),
            "\"enviroment\" is no part of a bundle",
        ),
        (
            "scalar_rows_bundle.json",
            json!({"config": config(0.3), "global_config": global(8000), "rows": [{"a": 1}, "x"]}),
            "rows[1]: must be a JSON object",
        ),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, bundle.to_string()).expect("bundle");
        let refused = validate(&path);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{name}: {stderr}");
        assert!(stderr.contains(says), "{name}: {stderr}");
    }
    // A FIFO or a device given as a file is refused at once, as plan and validate refuse it
    // (review 55, F11: a FIFO hung `identity`, `digest /dev/zero` grew without bound).
    let fifo = dir.path().join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    for args in [
        vec!["identity", "--bundle", fifo.to_str().expect("utf-8")],
        vec!["digest", fifo.to_str().expect("utf-8")],
        vec!["digest", "/dev/zero"],
        vec!["classify", fifo.to_str().expect("utf-8")],
    ] {
        let refused = Command::new(BIN).args(&args).output().expect("run");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("not a regular file"), "{args:?}: {stderr}");
    }
    // The operator's policy reaches the offline tools as it reaches `serve` (one set of flags
    // and variables): a key declared operational resumes offline too.
    let declared = Command::new(BIN)
        .args(["validate", "--output"])
        .arg(&output)
        .arg("--source")
        .arg(&source)
        .arg("--bundle")
        .arg(&hotter)
        .env(
            "RR_OPERATIONAL_KEYS",
            "collection.responses_create_params.temperature",
        )
        .output()
        .expect("validate");
    assert_eq!(declared.status.code(), Some(0));
    let report: Value = serde_json::from_slice(&declared.stdout).expect("json");
    assert_eq!(report["outcome"], "resume_with_drift", "{report}");
    // The service's message for the same resume, naming the key.
    assert_eq!(
        report["message"],
        "Resuming across operational configuration drift: collection.responses_create_params.temperature.",
        "{report}"
    );
    // A configuration that cannot be resolved is not a refused resume: the service answers 422
    // and records it `invalid`, and so does this check.
    let mut unresolvable = config(0.3);
    unresolvable["extra"] = json!("${nowhere.at_all}");
    let broken = dir.path().join("broken.json");
    std::fs::write(
        &broken,
        json!({"config": unresolvable, "global_config": global(8000)}).to_string(),
    )
    .expect("bundle");
    let invalid = validate(&broken);
    assert_eq!(invalid.status.code(), Some(1));
    let report: Value = serde_json::from_slice(&invalid.stdout).expect("json");
    assert_eq!(
        (report["outcome"].as_str(), report["code"].as_str()),
        (Some("invalid"), Some("identity_error")),
        "{report}"
    );
    assert!(
        report["message"]
            .as_str()
            .is_some_and(|m| m.contains("'config.extra'")),
        "{report}"
    );
    let classify = Command::new(BIN)
        .arg("classify")
        .arg(&paths.output)
        .output()
        .expect("classify");
    let summary: Value = serde_json::from_slice(&classify.stdout).expect("json");
    assert_eq!(summary["rows"], 1);
}

/// An offline command whose reader is gone (`... | head`) ends quietly by SIGPIPE, as Unix
/// tools do, never with a panic and its backtrace.
#[test]
fn an_offline_command_whose_reader_is_gone_ends_without_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("rows.jsonl");
    std::fs::write(&file, "{\"a\": 1}\n".repeat(1000)).expect("rows");
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let output = Command::new(BIN)
        .arg("classify")
        .arg(&file)
        .stdout(writer)
        .output()
        .expect("classify");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        output.status.signal(),
        Some(13),
        "ended by SIGPIPE: {stderr}"
    );
}

#[test]
fn serve_refuses_settings_it_could_not_honour_before_it_starts() {
    let dir = tempfile::tempdir().expect("dir");
    const CAP_RANGE: &str = "is not an integer between 1 and 1000000";
    let no_env: &[(&str, &str)] = &[];
    let cases = [
        (
            "a default lease longer than the maximum",
            vec!["--lease-ttl-secs", "99999"],
            no_env,
            "--lease-ttl-secs",
        ),
        (
            "an attempt cap of zero",
            vec!["--max-rollout-attempts", "0"],
            no_env,
            CAP_RANGE,
        ),
        (
            "an unknown log format",
            vec!["--log-format", "yaml"],
            no_env,
            "yaml",
        ),
        (
            "an attempt cap over a million",
            vec!["--max-rollout-attempts", "1000001"],
            no_env,
            CAP_RANGE,
        ),
        (
            "a negative attempt cap",
            vec!["--max-rollout-attempts=-1"],
            no_env,
            CAP_RANGE,
        ),
        (
            "a fractional attempt cap",
            vec!["--max-rollout-attempts", "1.5"],
            no_env,
            CAP_RANGE,
        ),
        (
            "an attempt cap of zero from the service's variable",
            vec![],
            &[("RR_MAX_ROLLOUT_ATTEMPTS", "0")],
            CAP_RANGE,
        ),
        (
            "an attempt cap from the collectors' variable that no run may have",
            vec![],
            &[("NEMO_GYM_MAX_ROLLOUT_ATTEMPTS", "1000001")],
            "NEMO_GYM_MAX_ROLLOUT_ATTEMPTS: '1000001' is not an integer between 1 and 1000000",
        ),
        (
            "a token with a control character",
            vec!["--token", "operator:o:abcdefgh\u{1}ijklmnopq"],
            no_env,
            "control",
        ),
    ];
    for (case, flags, env, named) in cases {
        let output = Command::new(BIN)
            .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join("data"))
            .arg("--root")
            .arg(dir.path().join("runs"))
            .args(&flags)
            .envs(env.iter().copied())
            .env("RR_LOG", "warn")
            .output()
            .expect("serve");
        assert!(
            !output.status.success(),
            "{case}: the service must not start"
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(named), "{case}: {stderr}");
    }
}

#[test]
fn no_help_shows_a_password_or_token_taken_from_the_environment() {
    let top = Command::new(BIN).arg("--help").output().expect("help");
    let top = String::from_utf8_lossy(&top.stdout).into_owned();
    // The commands section: two spaces, a name, its summary.
    let commands: Vec<&str> = top
        .split_once("Commands:")
        .expect("commands")
        .1
        .lines()
        .skip(1)
        .take_while(|line| !line.is_empty())
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .collect();
    assert!(
        commands.contains(&"serve") && commands.contains(&"drift"),
        "{top}"
    );
    for command in commands {
        let output = Command::new(BIN)
            .args([command, "--help"])
            .env(
                "RR_DATABASE_URL",
                "postgres://admin:PWDATABASE@db.example/rr",
            )
            .env("RR_URL", "http://admin:PWSERVICE@rr.example:8787")
            .env("RR_TOKEN", "operator-token-PWTOKEN-0123")
            .env("RR_TOKENS", "operator:alice:PWTOKENS-0123456789")
            .output()
            .expect("help");
        let help = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{command}: {help}");
        for secret in ["PWDATABASE", "PWSERVICE", "PWTOKEN", "PWTOKENS"] {
            assert!(
                !help.contains(secret),
                "{command} --help shows {secret}: {help}"
            );
        }
    }
}

#[test]
fn a_start_that_cannot_reach_its_database_says_why_once() {
    let dir = tempfile::tempdir().expect("dir");
    // Port 1 on loopback: nothing listens there.
    let output = Command::new(BIN)
        .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(["--database-url", "postgres://admin:PWX@127.0.0.1:1/test"])
        .env("RR_LOG", "off")
        .output()
        .expect("serve");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    let error = stderr
        .lines()
        .find(|line| line.starts_with("error: "))
        .unwrap_or_else(|| panic!("an error line: {stderr}"));
    assert_eq!(error.matches("Connection refused").count(), 1, "{error}");
    assert!(
        error.contains("127.0.0.1:1") && !error.contains("PWX"),
        "{error}"
    );
    assert!(
        !dir.path().join("data").exists(),
        "a start refused at its database leaves no directory behind"
    );
}

#[test]
fn a_log_filter_that_cannot_be_read_is_said_not_silently_replaced() {
    let dir = tempfile::tempdir().expect("dir");
    // A setting refused at once ends the start right after logging begins: what it said.
    let said_at_start = |filter: &str| {
        let output = Command::new(BIN)
            .args([
                "serve",
                "--bind",
                "127.0.0.1:0",
                "--lease-ttl-secs",
                "99999",
            ])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .env("RR_LOG", filter)
            .output()
            .expect("serve");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let stderr = said_at_start("debug,recovery=loud");
    assert!(
        stderr.contains("warning: RR_LOG=\"debug,recovery=loud\" is not a log filter"),
        "{stderr}"
    );
    // A misspelt level is a valid filter (a module's name) that would log nothing.
    for (filter, warned) in [
        ("inof", true),
        ("debug", false),
        ("recovery_store=debug", false),
    ] {
        let stderr = said_at_start(filter);
        assert_eq!(stderr.contains("is no level"), warned, "{filter}: {stderr}");
    }
}

/// A root that did not exist is made at start and said loudly, naming it (a mistyped `--root`,
/// or a file system not mounted yet, starts with no runs: hostile review 55, F8); a root that
/// exists is not.
#[test]
fn a_root_made_at_start_is_said_loudly() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let unmounted = dir.path().join("mnt/nfs/runs");
    for (root, made) in [(&unmounted, true), (&root, false)] {
        let log = dir.path().join("serve.log");
        let server =
            Server::start_logging_to(&data, root, std::fs::File::create(&log).expect("log"));
        assert!(server.terminate().success());
        let said = std::fs::read_to_string(&log).expect("log");
        assert_eq!(
            said.contains("a root that did not exist was created")
                && said.contains(&root.display().to_string()),
            made,
            "{}: {said}",
            root.display()
        );
    }
}

#[test]
fn a_start_on_a_port_in_use_fails_before_it_makes_any_file() {
    let dir = tempfile::tempdir().expect("dir");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = taken.local_addr().expect("address").port();
    let output = Command::new(BIN)
        .args([
            "serve",
            "--bind",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .arg("--root")
        .arg(dir.path().join("runs"))
        .env("RR_LOG", "warn")
        .output()
        .expect("serve");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on 127.0.0.1:{port}")),
        "{stderr}"
    );
    let made: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(made.is_empty(), "a failed start made {made:?}");
}

/// A run saved beside `dir/out.jsonl` with its identity, as the offline commands read it.
struct OfflineRun {
    output: PathBuf,
    source: PathBuf,
    bundle: PathBuf,
    paths: recovery_sidecar::SidecarPaths,
    run_id: String,
}

fn offline_run(dir: &Path) -> OfflineRun {
    let output = dir.join("out.jsonl");
    let paths = recovery_sidecar::SidecarPaths::for_output(
        &std::fs::canonicalize(dir).expect("dir").join("out.jsonl"),
    );
    let rows = "{\"agent_ref\":{\"name\":\"agent\"},\"_ng_task_index\":0,\"_ng_rollout_index\":0}\n{\"agent_ref\":{\"name\":\"agent\"},\"_ng_task_index\":1,\"_ng_rollout_index\":0}\n";
    std::fs::write(&paths.materialized, rows).expect("rows");
    let source = dir.join("train.jsonl");
    std::fs::write(&source, b"{}\n").expect("source");
    let bundle = dir.join("bundle.json");
    std::fs::write(
        &bundle,
        json!({"config": config(0.3), "global_config": global(8000)}).to_string(),
    )
    .expect("bundle");
    let out = Command::new(BIN)
        .args(["identity", "--bundle"])
        .arg(&bundle)
        .arg("--materialized")
        .arg(&paths.materialized)
        .output()
        .expect("identity");
    let identity: Value = serde_json::from_slice(&out.stdout).expect("json");
    std::fs::write(
        &paths.identity,
        serde_json::to_string(&identity["identity"]).expect("json"),
    )
    .expect("identity file");
    let run_id = "ab".repeat(16);
    let mut manifest = recovery_core::manifest::RunManifest::create(
        run_id.clone(),
        recovery_core::canonical::sha256_hex(b"{}\n"),
        recovery_core::materialized::materialized_digest(rows.as_bytes(), 1)
            .expect("digest")
            .sha256,
        identity["config_digest"].as_str().expect("digest"),
        Some(1),
    );
    manifest.next_attempt.insert("0-0".into(), 1);
    manifest.next_attempt.insert("1-0".into(), 1);
    std::fs::write(&paths.manifest, manifest.to_pretty_json().expect("json")).expect("manifest");
    std::fs::write(&paths.failures, b"").expect("failures");
    std::fs::write(&paths.output, b"").expect("results");
    OfflineRun {
        output,
        source,
        bundle,
        paths,
        run_id,
    }
}

fn offline_validate(run: &OfflineRun, unsafe_resume: bool) -> std::process::Output {
    let mut command = Command::new(BIN);
    command
        .args(["validate", "--output"])
        .arg(&run.output)
        .arg("--source")
        .arg(&run.source)
        .arg("--bundle")
        .arg(&run.bundle);
    if unsafe_resume {
        command.arg("--allow-unsafe");
    }
    command.output().expect("validate")
}

/// Issue 9, item 1, offline: the `validate` command decides a deleted source as the service
/// does (one code path): refused, or overridden with `--allow-unsafe`.
#[test]
fn item_1_the_offline_validate_decides_a_deleted_source_as_the_service_does() {
    let dir = tempfile::tempdir().expect("dir");
    let run = offline_run(dir.path());
    let reused = offline_validate(&run, false);
    assert_eq!(
        reused.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&reused.stdout)
    );
    std::fs::remove_file(&run.source).expect("delete the dataset");
    let refused = offline_validate(&run, false);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stdout).contains("source_path"));
    let overridden = offline_validate(&run, true);
    assert_eq!(overridden.status.code(), Some(0));
    let report: Value = serde_json::from_slice(&overridden.stdout).expect("json");
    assert_eq!(report["outcome"], "overridden", "{report}");
}

/// Issue 9, item 7, offline: `plan` exits as `has_only_intentional_gaps` decides, and never
/// prints "N/N completed" for a run that is not complete.
#[test]
fn item_7_the_offline_plan_exits_by_the_completion_rule() {
    let dir = tempfile::tempdir().expect("dir");
    let run = offline_run(dir.path());
    let plan = || {
        Command::new(BIN)
            .args(["plan", "--output"])
            .arg(&run.output)
            .output()
            .expect("plan")
    };
    let line = |task: u64, extra: &str| {
        format!(
            "{{\"_ng_task_index\":{task},\"_ng_rollout_index\":0,\"_ng_attempt_index\":0,\"_ng_run_id\":\"{}\"{extra}}}\n",
            run.run_id
        )
    };
    // Scored, and masked: not complete, and nothing a resume can run.
    std::fs::write(
        &run.paths.output,
        line(0, ",\"reward\":1.0,\"response\":{\"status\":\"completed\"}")
            + &line(1, ",\"reward\":0.0,\"mask_sample\":true"),
    )
    .expect("results");
    let masked = plan();
    let stderr = String::from_utf8_lossy(&masked.stderr).into_owned();
    assert_eq!(masked.status.code(), Some(76), "{stderr}");
    assert!(
        stderr.contains("1/2 samples completed (1 masked)"),
        "{stderr}"
    );
    assert!(!stderr.contains("2/2"), "{stderr}");
    // Scored, and intentionally omitted: accepted.
    std::fs::write(
        &run.paths.output,
        line(0, ",\"reward\":1.0,\"response\":{\"status\":\"completed\"}"),
    )
    .expect("results");
    std::fs::write(
        &run.paths.failures,
        line(
            1,
            ",\"_ng_failure_class\":\"skipped\",\"_ng_failure_terminal\":true,\"_ng_omitted\":true",
        ),
    )
    .expect("failures");
    assert_eq!(plan().status.code(), Some(0));
    // Only omissions: nothing completed, not accepted.
    std::fs::write(&run.paths.output, b"").expect("results");
    std::fs::write(
        &run.paths.failures,
        line(
            0,
            ",\"_ng_failure_class\":\"skipped\",\"_ng_failure_terminal\":true,\"_ng_omitted\":true",
        ) + &line(
            1,
            ",\"_ng_failure_class\":\"skipped\",\"_ng_failure_terminal\":true,\"_ng_omitted\":true",
        ),
    )
    .expect("failures");
    assert_eq!(plan().status.code(), Some(76));
}
