//! The one integration-test binary of `recovery-server`: every endpoint and its error paths,
//! driven in process through the router (`oneshot`), over a real SQLite file and real files.

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use recovery_runs::{Clock, ManualClock};
use recovery_server::config::{ServerConfig, TokenEntry};
use recovery_server::state::AppState;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tower::ServiceExt as _;

const OPERATOR: &str = "operator-token-0123456789";
const COLLECTOR: &str = "collector-token-0123456789";
const VIEWER: &str = "viewer-token-0123456789";
const SECRET: &str = "sk-live-S3CR3T-value";

#[path = "server/concurrency.rs"]
mod concurrency;
#[path = "server/console.rs"]
mod console;
#[path = "server/contract.rs"]
mod contract;

struct TestApp {
    state: AppState,
    config: ServerConfig,
    _dir: tempfile::TempDir,
    root: PathBuf,
    clock: Arc<ManualClock>,
}

struct Reply {
    status: StatusCode,
    body: Value,
}

impl Reply {
    /// Asserts a 422 naming `field` in its details; `case` says which request in a table.
    fn assert_field_refused(&self, field: &str, case: &str) {
        assert_eq!(
            (self.status, self.body["details"]["field"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some(field)),
            "{case}: {}",
            self.body
        );
    }
}

impl TestApp {
    async fn new() -> Self {
        Self::with(|_| {}).await
    }

    async fn with(adjust: impl FnOnce(&mut ServerConfig)) -> Self {
        let dir = tempfile::tempdir().expect("dir");
        let mut config = ServerConfig::local(dir.path().join("data"));
        config.roots = vec![dir.path().join("runs")];
        config.tokens = vec![
            TokenEntry::parse(&format!("operator:alice:{OPERATOR}")).expect("token"),
            TokenEntry::parse(&format!("collector:collector-1:{COLLECTOR}")).expect("token"),
            TokenEntry::parse(&format!("viewer:dashboard:{VIEWER}")).expect("token"),
        ];
        adjust(&mut config);
        let clock = Arc::new(ManualClock::new(time::OffsetDateTime::now_utc()));
        let state = recovery_server::start(config.clone(), clock.clone())
            .await
            .expect("start");
        let root = std::fs::canonicalize(dir.path().join("runs")).expect("root");
        std::fs::create_dir_all(root.join("data")).expect("data dir");
        std::fs::write(
            root.join("data/train.jsonl"),
            b"{\"question\": \"1+1?\"}\n{\"question\": \"2+2?\"}\n",
        )
        .expect("source");
        Self {
            state,
            config,
            _dir: dir,
            root,
            clock,
        }
    }

    async fn call(
        &self,
        method: Method,
        uri: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> Reply {
        self.call_raw(method, uri, token, body.map(|b| b.to_string()))
            .await
    }

    async fn call_raw(
        &self,
        method: Method,
        uri: &str,
        token: Option<&str>,
        body: Option<String>,
    ) -> Reply {
        send(self.state.clone(), method, uri, token, body).await
    }

    fn output(&self) -> PathBuf {
        self.root.join("exp/out.jsonl")
    }

    fn source(&self) -> PathBuf {
        self.root.join("data/train.jsonl")
    }

    fn create_body(&self) -> Value {
        json!({
            "output_path": self.output(),
            "source_path": self.source(),
            "config": config(0.3),
            "global_config": global(8000),
            "environment": {"NGT_REVIEW_PROMPT": "Be strict.", "OPENAI_API_KEY": SECRET},
            "rows": rows(),
        })
    }

    async fn create(&self) -> String {
        let reply = self
            .call(
                Method::POST,
                "/runs",
                Some(COLLECTOR),
                Some(self.create_body()),
            )
            .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
        reply.body["run_id"].as_str().expect("run id").to_owned()
    }

    fn validate_body(&self, temperature: f64, port: i64) -> Value {
        json!({"config": config(temperature), "global_config": global(port), "environment": {"NGT_REVIEW_PROMPT": "Be strict."}, "source_path": self.source()})
    }

    async fn lease(&self, run_id: &str, holder: &str) -> Reply {
        self.call(
            Method::POST,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(json!({"holder": holder, "host": "node-1", "pid": 4242, "ttl_seconds": 60})),
        )
        .await
    }
}

/// One request through the router (tasks of concurrent tests call this with a cloned state).
async fn send(
    state: AppState,
    method: Method,
    uri: &str,
    token: Option<&str>,
    body: Option<String>,
) -> Reply {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let request = match body {
        Some(body) => request
            .header("content-type", "application/json")
            .body(Body::from(body)),
        None => request.body(Body::empty()),
    }
    .expect("request");
    let (status, _, bytes) = respond(state, request).await;
    Reply::of(status, &bytes)
}

/// A FIFO at `path` (what a hostile user plants where a run's file belongs).
fn mkfifo(path: &std::path::Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo");
    assert!(made.success(), "mkfifo {}", path.display());
}

/// Any request through the router: its status, headers and body.
async fn respond(
    state: AppState,
    request: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, axum::body::Bytes) {
    let response = recovery_server::app(state)
        .oneshot(request)
        .await
        .expect("response");
    let (status, headers) = (response.status(), response.headers().clone());
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    (status, headers, bytes)
}

impl Reply {
    /// A JSON answer, or its text as a JSON string when it is not JSON.
    fn of(status: StatusCode, bytes: &[u8]) -> Self {
        let body = serde_json::from_slice(bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned()));
        Self { status, body }
    }
}

fn config(temperature: f64) -> Value {
    json!({"limit": 2, "responses_create_params": {"temperature": temperature}, "num_samples_in_parallel": 8, "output_jsonl_fpath": "/x/out.jsonl"})
}

fn global(sandbox_port: i64) -> Value {
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

fn rows() -> Value {
    json!([
        {"agent_ref": {"name": "math_agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0, "question": "1+1?"},
        {"agent_ref": {"name": "math_agent"}, "_ng_task_index": 1, "_ng_rollout_index": 0, "question": "2+2?"}
    ])
}

/// The answer's status and stable code (the body shown when they differ).
fn assert_code(reply: &Reply, status: StatusCode, code: &str) {
    assert_eq!(
        (reply.status, reply.body["code"].as_str()),
        (status, Some(code)),
        "{}",
        reply.body
    );
}

/// Asserts that no file under `dir` (database, its log, sidecars) holds `needle`.
fn assert_no_file_holds(dir: &Path, needle: &str) {
    for file in files_under(dir) {
        let bytes = std::fs::read(&file).expect("file");
        assert!(
            !String::from_utf8_lossy(&bytes).contains(needle),
            "{needle} reached {}",
            file.display()
        );
    }
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("dir").filter_map(Result::ok) {
        let path = entry.path();
        if path.is_dir() {
            files.extend(files_under(&path));
        } else {
            files.push(path);
        }
    }
    files
}

#[tokio::test]
async fn the_openapi_document_is_committed_and_lists_every_route_with_its_errors() {
    let committed = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../openapi/openapi.json"),
    )
    .expect("committed spec");
    assert!(
        committed == recovery_server::openapi_json(),
        "openapi/openapi.json is out of date: run `rollout-recovery openapi --write` and commit it"
    );
    let spec: Value = serde_json::from_str(&committed).expect("json");
    for (path, methods) in spec["paths"].as_object().expect("paths") {
        for (method, operation) in methods.as_object().expect("methods") {
            let responses = operation["responses"].as_object().expect("responses");
            // A path parameter is one of the path's `{name}`s, and each `{name}` is declared:
            // a query parameter declared `in: path` breaks every generated client.
            let template: Vec<&str> = path
                .split('/')
                .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
                .collect();
            let declared: Vec<&str> = operation["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["in"] == "path")
                .filter_map(|p| p["name"].as_str())
                .collect();
            assert_eq!(declared, template, "{method} {path}: path parameters");
            if !["/healthz", "/readyz", "/metrics", "/openapi.json"].contains(&path.as_str()) {
                assert!(
                    responses.contains_key("401"),
                    "{method} {path} lists its authentication error"
                );
            }
        }
    }
    let app = TestApp::new().await;
    let served = app.call(Method::GET, "/openapi.json", None, None).await;
    assert_eq!(served.status, StatusCode::OK);
    assert_eq!(served.body, spec);
}

#[tokio::test]
async fn requests_need_a_known_token_and_a_sufficient_role() {
    let app = TestApp::new().await;
    let missing = app.call(Method::GET, "/runs", None, None).await;
    assert_eq!(
        (missing.status, missing.body["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("unauthenticated"))
    );
    let unknown = app
        .call(Method::GET, "/runs", Some("not-a-token-at-all"), None)
        .await;
    assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
    let viewer_creates = app
        .call(Method::POST, "/runs", Some(VIEWER), Some(app.create_body()))
        .await;
    assert_eq!(
        (viewer_creates.status, viewer_creates.body["code"].as_str()),
        (StatusCode::FORBIDDEN, Some("forbidden"))
    );
    assert_eq!(
        app.call(Method::GET, "/runs", Some(VIEWER), None)
            .await
            .status,
        StatusCode::OK
    );
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(
            app.call(Method::GET, path, None, None).await.status,
            StatusCode::OK,
            "{path}"
        );
    }
}

#[tokio::test]
async fn creating_a_run_writes_its_sidecars_and_refuses_bad_input_without_writing() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    for path in [
        &paths.manifest,
        &paths.identity,
        &paths.materialized,
        &paths.output,
        &paths.failures,
    ] {
        assert!(path.exists(), "{} is written", path.display());
    }
    let manifest = recovery_core::manifest::RunManifest::from_json_bytes(
        &std::fs::read(&paths.manifest).expect("manifest"),
    )
    .expect("readable");
    assert_eq!(
        (manifest.run_id.as_str(), manifest.max_rollout_attempts),
        (run_id.as_str(), Some(3))
    );
    let again = app
        .call(
            Method::POST,
            "/runs",
            Some(COLLECTOR),
            Some(app.create_body()),
        )
        .await;
    assert_eq!(
        (
            again.status,
            again.body["code"].as_str(),
            again.body["details"]["run_id"].as_str()
        ),
        (
            StatusCode::CONFLICT,
            Some("run_exists"),
            Some(run_id.as_str())
        )
    );
    let bytes_before = std::fs::read(&paths.manifest).expect("manifest");
    let mut outside = app.create_body();
    outside["output_path"] = json!("/etc/out.jsonl");
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(outside))
        .await;
    assert_eq!(
        (reply.status, reply.body["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("path_refused"))
    );
    let mut missing_server = app.create_body();
    missing_server["output_path"] = json!(app.root.join("exp2/out.jsonl"));
    missing_server["rows"] = json!([{"agent_ref": {"name": "ghost_agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0}]);
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(missing_server))
        .await;
    assert_eq!(
        (
            reply.status,
            reply.body["code"].as_str(),
            reply.body["details"]["kind"].as_str()
        ),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("identity_error"),
            Some("missing_server")
        )
    );
    assert!(
        reply.body["message"]
            .as_str()
            .expect("message")
            .contains("ghost_agent")
    );
    assert!(
        !app.root.join("exp2/out_manifest.json").exists(),
        "a refused create leaves no manifest"
    );
    let mut unknown_field = app.create_body();
    unknown_field["surprise"] = json!(1);
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(unknown_field))
        .await;
    assert!(
        reply.status.is_client_error(),
        "unknown fields are refused: {}",
        reply.status
    );
    let mut no_rows = app.create_body();
    no_rows["output_path"] = json!(app.root.join("exp3/out.jsonl"));
    no_rows.as_object_mut().expect("object").remove("rows");
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(no_rows))
        .await;
    assert_eq!(
        (reply.status, reply.body["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("invalid_request"))
    );
    assert!(
        reply.body["message"]
            .as_str()
            .expect("message")
            .starts_with("rows:")
    );
    let mut replace = app.create_body();
    replace["replace"] = json!(true);
    assert_eq!(
        app.call(
            Method::POST,
            "/runs",
            Some(COLLECTOR),
            Some(replace.clone())
        )
        .await
        .status,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        std::fs::read(&paths.manifest).expect("manifest"),
        bytes_before,
        "refusals leave the run untouched"
    );
    let replaced = app
        .call(Method::POST, "/runs", Some(OPERATOR), Some(replace))
        .await;
    assert_eq!(replaced.status, StatusCode::CREATED, "{}", replaced.body);
    let moved = replaced.body["replaced"].as_array().expect("moved");
    assert!(
        moved.iter().any(|m| m
            .as_str()
            .expect("path")
            .contains("out_manifest.json.replaced-")),
        "old sidecars are moved aside, never deleted"
    );
    assert_ne!(replaced.body["run_id"].as_str(), Some(run_id.as_str()));
    assert!(
        !paths.replace_intent.exists(),
        "a finished replacement leaves no intent"
    );
    // `replace` of an output that has no run yet is a plain create: no intent is left for the
    // next start to report as a replacement a crash interrupted.
    let mut fresh = app.create_body();
    fresh["output_path"] = json!(app.root.join("exp4/out.jsonl"));
    fresh["replace"] = json!(true);
    let created = app
        .call(Method::POST, "/runs", Some(OPERATOR), Some(fresh))
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    assert_eq!(created.body["replaced"], json!([]), "{}", created.body);
    let leftovers: Vec<_> = files_under(&app.root.join("exp4"))
        .into_iter()
        .filter(|f| f.to_string_lossy().ends_with("_replace_intent.json"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test]
async fn no_credential_value_reaches_a_file_a_row_or_a_response() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let mut port_change = app.validate_body(0.3, 9000);
    port_change["environment"]["OPENAI_API_KEY"] = json!(SECRET);
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(port_change),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let run = app
        .call(Method::GET, &format!("/runs/{run_id}"), Some(VIEWER), None)
        .await;
    assert!(!run.body.to_string().contains("S3CR3T") && !reply.body.to_string().contains("S3CR3T"));
    let data = app._dir.path().to_owned();
    assert_no_file_holds(&data, "S3CR3T");
    let identity =
        std::fs::read_to_string(recovery_sidecar::SidecarPaths::for_output(&app.output()).identity)
            .expect("identity");
    assert!(
        identity.contains("<redacted>") && identity.contains("Be strict."),
        "{identity}"
    );
}

/// A configuration value holding a token beside an interpolation that does not parse is refused
/// 422 and recorded as an `invalid` resume event: neither the answer nor the event (database
/// file, its log) nor any sidecar repeats the value.
#[tokio::test]
async fn an_unparsable_value_holding_a_token_is_refused_without_repeating_it() {
    const TOKEN: &str = "TKN4ZV8";
    let app = TestApp::new().await;
    let run_id = app.create().await;
    for value in [
        format!("Bearer {TOKEN} ${{unclosed"),
        format!("--api-key {TOKEN} ${{oc.env:A,'unclosed}}"),
        format!("${{oc.env:A,{TOKEN}<}}"),
    ] {
        let mut body = app.validate_body(0.3, 8000);
        body["config"]["extra"] = json!(value);
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/validate"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{}",
            reply.body
        );
        let message = reply.body["message"].as_str().expect("message");
        assert!(message.contains("config.extra"), "{message}");
        assert!(!reply.body.to_string().contains(TOKEN), "{}", reply.body);
    }
    let events = app
        .state
        .registry
        .store()
        .list_resume_events(&run_id, 100)
        .await
        .expect("events");
    let invalid = events.iter().filter(|e| e.outcome == "invalid").count();
    assert_eq!(invalid, 3, "each refusal is recorded: {events:?}");
    assert_no_file_holds(app._dir.path(), TOKEN);
}

#[tokio::test]
async fn validate_reuses_journals_operational_drift_and_refuses_semantic_drift() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let uri = format!("/runs/{run_id}/validate");
    app.clock.advance(time::Duration::seconds(1));
    let reuse = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_eq!(
        (reuse.status, reuse.body["outcome"].as_str()),
        (StatusCode::OK, Some("reuse")),
        "{}",
        reuse.body
    );
    app.clock.advance(time::Duration::seconds(1));
    let drift = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 9000)),
        )
        .await;
    assert_eq!(
        drift.body["outcome"].as_str(),
        Some("resume_with_drift"),
        "{}",
        drift.body
    );
    let key = "servers.math_agent.responses_api_agents.simple_agent.sandbox.sandbox_port";
    assert_eq!(drift.body["operational_keys"], json!([key]));
    let journal = std::fs::read_to_string(
        recovery_sidecar::SidecarPaths::for_output(&app.output()).resume_drift,
    )
    .expect("journal");
    assert_eq!(journal.lines().count(), 1);
    assert!(
        journal.contains(key) && !journal.contains("9000"),
        "keys and digests only: {journal}"
    );
    app.clock.advance(time::Duration::seconds(1));
    let refused = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(app.validate_body(0.8, 8000)),
        )
        .await;
    assert_eq!(
        (refused.status, refused.body["code"].as_str()),
        (StatusCode::CONFLICT, Some("resume_refused"))
    );
    assert!(
        refused.body["message"]
            .as_str()
            .expect("message")
            .contains("collection.responses_create_params.temperature")
    );
    assert_eq!(
        refused.body["details"]["semantic_keys"][0]["key"],
        "collection.responses_create_params.temperature"
    );
    app.clock.advance(time::Duration::seconds(1));
    let mut changed_source = app.validate_body(0.3, 8000);
    std::fs::write(app.root.join("data/other.jsonl"), b"{}\n").expect("other source");
    changed_source["source_path"] = json!(app.root.join("data/other.jsonl"));
    app.clock.advance(time::Duration::seconds(1));
    let reply = app
        .call(Method::POST, &uri, Some(COLLECTOR), Some(changed_source))
        .await;
    assert!(
        reply.body["message"]
            .as_str()
            .expect("message")
            .contains("incompatible source dataset")
    );
    app.clock.advance(time::Duration::seconds(1));
    let mut unsafe_resume = app.validate_body(0.8, 8000);
    unsafe_resume["allow_unsafe"] = json!(true);
    app.clock.advance(time::Duration::seconds(1));
    let overridden = app
        .call(Method::POST, &uri, Some(COLLECTOR), Some(unsafe_resume))
        .await;
    assert_eq!(overridden.body["outcome"].as_str(), Some("overridden"));
    assert_eq!(
        overridden.body["semantic_keys"],
        json!(["collection.responses_create_params.temperature"]),
        "the answer names what the override accepted: {}",
        overridden.body
    );
    app.clock.advance(time::Duration::seconds(1));
    let sticky = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert!(
        sticky.body["message"]
            .as_str()
            .expect("message")
            .contains("previously overridden"),
        "{}",
        sticky.body
    );
    let events = app
        .state
        .registry
        .store()
        .list_resume_events(&run_id, 100)
        .await
        .expect("events");
    let outcomes: Vec<&str> = events.iter().rev().map(|e| e.outcome.as_str()).collect();
    assert_eq!(
        outcomes,
        [
            "reuse",
            "resume_with_drift",
            "refused",
            "refused",
            "overridden",
            "refused"
        ],
        "every outcome is recorded"
    );
    let temperature = ["collection.responses_create_params.temperature"];
    let keys: Vec<(&str, &[String])> = events
        .iter()
        .rev()
        .map(|e| (e.outcome.as_str(), e.semantic_keys.as_slice()))
        .filter(|(_, keys)| !keys.is_empty())
        .collect();
    assert_eq!(
        keys,
        [
            ("refused", &temperature.map(String::from)[..]),
            ("overridden", &temperature.map(String::from)[..])
        ],
        "the semantic keys a refusal named and an override accepted are recorded"
    );
    std::fs::write(
        recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest,
        b"{\"schema_version\": 99}",
    )
    .expect("corrupt");
    app.clock.advance(time::Duration::seconds(1));
    let unreadable = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_eq!(
        (unreadable.status, unreadable.body["code"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("manifest_unreadable")
        )
    );
    let missing = app
        .call(
            Method::POST,
            "/runs/nope/validate",
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    // A run that does not exist is what the caller needs to hear, whatever it sent (hostile
    // review 43, F9: a body that is not a validate request answered 422).
    for body in [json!({}), json!({"config": 7}), json!([1, 2])] {
        let missing = app
            .call(
                Method::POST,
                "/runs/nope/validate",
                Some(COLLECTOR),
                Some(body.clone()),
            )
            .await;
        assert_eq!(
            (missing.status, missing.body["code"].as_str()),
            (StatusCode::NOT_FOUND, Some("not_found")),
            "{body}: {}",
            missing.body
        );
    }
}

/// Waits until the file at `path` last changed longer ago than the service's file caches need
/// to trust its identity (`recovery_runs::cache::SETTLE`): waiting for time to pass is the
/// condition itself.
fn wait_until_settled(path: &Path) {
    use std::os::unix::fs::MetadataExt as _;
    let changed = std::fs::metadata(path).expect("stat");
    let changed = std::time::UNIX_EPOCH
        + std::time::Duration::new(changed.ctime() as u64, changed.ctime_nsec() as u32);
    let settled = changed + recovery_runs::cache::SETTLE + std::time::Duration::from_millis(50);
    if let Ok(left) = settled.duration_since(std::time::SystemTime::now()) {
        std::thread::sleep(left);
    }
}

#[tokio::test]
async fn a_validate_reads_the_manifest_a_collector_replaced_since_the_last_one() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let uri = format!("/runs/{run_id}/validate");
    let validate = || {
        app.call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
    };
    let manifest_path = recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest;
    // Settled, the manifest is served from the cache by the next validates.
    wait_until_settled(&manifest_path);
    for _ in 0..2 {
        let reuse = validate().await;
        assert_eq!(reuse.body["outcome"], "reuse", "{}", reuse.body);
        assert_eq!(reuse.body["manifest"]["max_rollout_attempts"], 3);
    }
    // A Python collector replaces it (as it always does: write beside, then rename).
    let mut manifest: Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).expect("manifest")).expect("json");
    manifest["max_rollout_attempts"] = json!(5);
    recovery_sidecar::atomic_write(
        &manifest_path,
        serde_json::to_string_pretty(&manifest)
            .expect("text")
            .as_bytes(),
        None,
    )
    .expect("replace");
    let after = validate().await;
    assert_eq!(after.body["outcome"], "reuse", "{}", after.body);
    assert_eq!(
        after.body["manifest"]["max_rollout_attempts"], 5,
        "the replaced manifest is read, not the cached one"
    );
    // Written in place with the same size, it is read again too (its times changed).
    let text = std::fs::read_to_string(&manifest_path).expect("manifest");
    std::fs::write(
        &manifest_path,
        text.replace("\"max_rollout_attempts\": 5", "\"max_rollout_attempts\": 7"),
    )
    .expect("rewrite");
    let rewritten = validate().await;
    assert_eq!(
        rewritten.body["manifest"]["max_rollout_attempts"], 7,
        "{}",
        rewritten.body
    );
    // The run's record follows the file once the run is shown, in the run and in the list.
    let listed_cap = |body: &Value| {
        body["runs"]
            .as_array()
            .and_then(|runs| runs.iter().find(|r| r["run_id"] == run_id.as_str()))
            .map(|r| r["max_rollout_attempts"].clone())
    };
    let before = app.call(Method::GET, "/runs", Some(VIEWER), None).await;
    assert_eq!(
        listed_cap(&before.body),
        Some(json!(3)),
        "indexed before: {}",
        before.body
    );
    let shown = app
        .call(Method::GET, &format!("/runs/{run_id}"), Some(VIEWER), None)
        .await;
    assert_eq!(
        shown.body["run"]["max_rollout_attempts"], 7,
        "{}",
        shown.body
    );
    assert_eq!(shown.body["saved_cap"], 7, "{}", shown.body);
    let after = app.call(Method::GET, "/runs", Some(VIEWER), None).await;
    assert_eq!(listed_cap(&after.body), Some(json!(7)), "{}", after.body);
}

/// A run's validations are listed newest first, a page at a time, with every outcome the run
/// recorded (the console showed only the 50 newest, and no API listed them).
#[tokio::test]
async fn a_runs_validations_are_listed_newest_first_a_page_at_a_time() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let uri = format!("/runs/{run_id}/validations");
    let validate = format!("/runs/{run_id}/validate");
    for (temperature, port) in [
        (0.3, 8000),
        (0.3, 8001),
        (0.9, 8000),
        (0.3, 8002),
        (0.3, 8000),
    ] {
        app.clock.advance(time::Duration::seconds(1));
        app.call(
            Method::POST,
            &validate,
            Some(COLLECTOR),
            Some(app.validate_body(temperature, port)),
        )
        .await;
    }
    let recorded = app
        .state
        .registry
        .store()
        .list_resume_events(&run_id, 100)
        .await
        .expect("events");
    let outcomes: Vec<&str> = recorded.iter().map(|e| e.outcome.as_str()).collect();
    assert_eq!(
        outcomes,
        [
            "reuse",
            "resume_with_drift",
            "refused",
            "resume_with_drift",
            "reuse"
        ],
        "newest first"
    );
    for limit in [1, 2, 5, 100] {
        let mut listed: Vec<Value> = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let page = match &cursor {
                Some(c) => format!(
                    "{uri}?limit={limit}&cursor={}",
                    c.replace(':', "%3A").replace('|', "%7C")
                ),
                None => format!("{uri}?limit={limit}"),
            };
            let reply = app.call(Method::GET, &page, Some(VIEWER), None).await;
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
            let validations = reply.body["validations"].as_array().expect("list");
            assert!(validations.len() <= limit, "{}", reply.body);
            listed.extend(validations.iter().cloned());
            match reply.body["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => break,
            }
        }
        assert_eq!(
            listed,
            serde_json::to_value(&recorded)
                .expect("json")
                .as_array()
                .expect("list")
                .clone(),
            "limit {limit}: every validation once, in order"
        );
    }
    for (page, status, code) in [
        (
            "/runs/0123456789abcdef0123456789abcdef/validations".to_owned(),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            format!("{uri}?cursor=yesterday"),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            format!("{uri}?limit=0"),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
    ] {
        let reply = app.call(Method::GET, &page, Some(VIEWER), None).await;
        assert_eq!(
            (reply.status, reply.body["code"].as_str()),
            (status, Some(code)),
            "{page}: {}",
            reply.body
        );
    }
    let anonymous = app.call(Method::GET, &uri, None, None).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);

    // A replacement supersedes the run; its validations are history and stay readable.
    let mut replace = app.create_body();
    replace["replace"] = json!(true);
    let replaced = app
        .call(Method::POST, "/runs", Some(OPERATOR), Some(replace))
        .await;
    assert_eq!(replaced.status, StatusCode::CREATED, "{}", replaced.body);
    let reply = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(
        reply.body["validations"],
        serde_json::to_value(&recorded).expect("json"),
        "the superseded run's validations"
    );
    // A validate of the superseded run is refused, and recorded as superseded each time.
    for n in 1..=2 {
        app.clock.advance(time::Duration::seconds(1));
        let refused = app
            .call(
                Method::POST,
                &validate,
                Some(COLLECTOR),
                Some(app.validate_body(0.3, 8000)),
            )
            .await;
        assert_eq!(
            (refused.status, refused.body["code"].as_str()),
            (StatusCode::CONFLICT, Some("run_superseded")),
            "{}",
            refused.body
        );
        let reply = app
            .call(Method::GET, &format!("{uri}?limit=1"), Some(VIEWER), None)
            .await;
        let newest = &reply.body["validations"][0];
        assert_eq!(
            (newest["outcome"].as_str(), newest["message"].as_str()),
            (Some("superseded"), refused.body["message"].as_str()),
            "{}",
            reply.body
        );
        let all = app
            .state
            .registry
            .store()
            .list_resume_events(&run_id, 100)
            .await
            .expect("events");
        assert_eq!(all.len(), recorded.len() + n, "one more each time");
    }
}

#[tokio::test]
async fn drift_history_is_queryable_per_run_and_across_runs() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    app.call(
        Method::POST,
        &format!("/runs/{run_id}/validate"),
        Some(COLLECTOR),
        Some(app.validate_body(0.3, 9000)),
    )
    .await;
    app.clock.advance(time::Duration::seconds(5));
    app.call(
        Method::POST,
        &format!("/runs/{run_id}/validate"),
        Some(COLLECTOR),
        Some(app.validate_body(0.3, 9100)),
    )
    .await;
    let per_run = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/drift"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(per_run.body["events"].as_array().expect("events").len(), 2);
    let key = "servers.math_agent.responses_api_agents.simple_agent.sandbox.sandbox_port";
    let by_key = app
        .call(
            Method::GET,
            &format!("/drift?key={key}&limit=1"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(by_key.body["events"].as_array().expect("events").len(), 1);
    let cursor = by_key.body["next_cursor"].as_str().expect("a next page");
    let next = app
        .call(
            Method::GET,
            &format!(
                "/drift?key={key}&limit=1&cursor={}",
                cursor.replace(':', "%3A").replace('|', "%7C")
            ),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        next.body["events"].as_array().expect("events").len(),
        1,
        "{}",
        next.body
    );
    // Newest first: the later event, then (its cursor) the earlier one.
    let ids = |reply: &Reply| -> Vec<String> {
        reply.body["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| e["event_id"].as_str().expect("id").to_owned())
            .collect()
    };
    let oldest_first = app.call(Method::GET, "/drift", Some(VIEWER), None).await;
    let newest = app
        .call(
            Method::GET,
            "/drift?order=newest&limit=1",
            Some(VIEWER),
            None,
        )
        .await;
    let cursor = newest.body["next_cursor"].as_str().expect("an older page");
    let older = app
        .call(
            Method::GET,
            &format!(
                "/drift?order=newest&limit=1&cursor={}",
                cursor.replace(':', "%3A").replace('|', "%7C")
            ),
            Some(VIEWER),
            None,
        )
        .await;
    let mut reversed = ids(&oldest_first);
    reversed.reverse();
    assert_eq!([ids(&newest), ids(&older)].concat(), reversed);
    assert!(older.body["next_cursor"].is_null(), "{}", older.body);
    let now = app.clock.now();
    let from =
        recovery_sidecar::format_rfc3339(now - time::Duration::seconds(1)).replace(':', "%3A");
    let recent = app
        .call(
            Method::GET,
            &format!("/drift?from={from}"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        recent.body["events"].as_array().expect("events").len(),
        1,
        "{}",
        recent.body
    );
    // The newest event is at `now` exactly: a `from` 100 ns later (finer than the stored
    // microseconds) is after it and must not take it in.
    let newest = recovery_sidecar::format_rfc3339(now);
    let just_after = newest.replace('Z', "1Z").replace(':', "%3A");
    let after_newest = app
        .call(
            Method::GET,
            &format!("/drift?from={just_after}"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        after_newest.body["events"].as_array().map(Vec::len),
        Some(0),
        "{}",
        after_newest.body
    );
    let bad = app
        .call(Method::GET, "/drift?from=yesterday", Some(VIEWER), None)
        .await;
    assert_eq!(
        (bad.status, bad.body["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("invalid_request"))
    );
    assert!(
        bad.body["message"]
            .as_str()
            .expect("message")
            .starts_with("from:")
    );
    let unencoded_plus = app
        .call(
            Method::GET,
            "/drift?from=2026-11-29T10:00:00+01:00",
            Some(VIEWER),
            None,
        )
        .await;
    assert!(
        unencoded_plus.body["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("from:") && m.contains("%2B")),
        "{}",
        unencoded_plus.body
    );
    let bad_cursor = app
        .call(Method::GET, "/drift?cursor=zzz", Some(VIEWER), None)
        .await;
    assert_eq!(bad_cursor.status, StatusCode::UNPROCESSABLE_ENTITY);
}

#[tokio::test]
async fn leases_guard_a_run_and_operators_take_it_over() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let first = app.lease(&run_id, "collector-a").await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let lease_id = first.body["lease_id"].as_str().expect("lease").to_owned();
    let second = app.lease(&run_id, "collector-b").await;
    assert_eq!(
        (
            second.status,
            second.body["details"]["holder"]["holder"].as_str()
        ),
        (StatusCode::LOCKED, Some("collector-a"))
    );
    assert!(
        second.body["details"]["holder"].get("lease_id").is_none(),
        "the lease id stays the holder's secret"
    );
    let validate = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_eq!(
        (validate.status, validate.body["code"].as_str()),
        (StatusCode::LOCKED, Some("run_locked"))
    );
    let mut with_lease = app.validate_body(0.3, 8000);
    with_lease["lease_id"] = json!(lease_id);
    assert_eq!(
        app.call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(with_lease)
        )
        .await
        .status,
        StatusCode::OK
    );
    let holder = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/lease"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(holder.body["holder"]["holder"], "collector-a");
    let beat = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease/heartbeat"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease_id})),
        )
        .await;
    assert_eq!(beat.status, StatusCode::OK);
    let takeover =
        json!({"holder": "collector-c", "host": "node-2", "pid": 7, "reason": "collector-a hung"});
    assert_eq!(
        app.call(
            Method::POST,
            &format!("/runs/{run_id}/lease/takeover"),
            Some(COLLECTOR),
            Some(takeover.clone())
        )
        .await
        .status,
        StatusCode::FORBIDDEN
    );
    let taken = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease/takeover"),
            Some(OPERATOR),
            Some(takeover),
        )
        .await;
    assert_eq!(taken.status, StatusCode::CREATED, "{}", taken.body);
    let stale = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease/heartbeat"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease_id})),
        )
        .await;
    assert_eq!(
        (stale.status, stale.body["code"].as_str()),
        (StatusCode::CONFLICT, Some("lease_not_held"))
    );
    let mut stale_validate = app.validate_body(0.3, 8000);
    stale_validate["lease_id"] = json!(lease_id);
    let refused = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(stale_validate),
        )
        .await;
    assert_eq!(refused.body["code"], "lease_not_held", "{}", refused.body);
    // Recorded as what they were, not as invalid requests (hostile review 27, finding 4).
    let outcomes: std::collections::BTreeSet<String> = app
        .state
        .registry
        .store()
        .list_resume_events(&run_id, 100)
        .await
        .expect("events")
        .into_iter()
        .map(|e| e.outcome)
        .collect();
    assert_eq!(
        outcomes,
        ["lease_not_held", "locked", "reuse"]
            .map(String::from)
            .into()
    );
    let audit = app
        .state
        .registry
        .store()
        .list_audit(Some(&run_id), 10)
        .await
        .expect("audit");
    assert!(
        audit
            .iter()
            .any(|a| a.action == "lease.takeover" && a.actor == "alice")
    );
    let new_lease = taken.body["lease_id"].as_str().expect("lease");
    let release = app
        .call(
            Method::DELETE,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(json!({"lease_id": new_lease})),
        )
        .await;
    assert_eq!(release.status, StatusCode::NO_CONTENT);
    assert_eq!(
        app.call(
            Method::GET,
            &format!("/runs/{run_id}/lease"),
            Some(VIEWER),
            None
        )
        .await
        .body["holder"],
        Value::Null
    );
    let bad_ttl = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(json!({"holder": "x", "host": "h", "pid": 1, "ttl_seconds": 0})),
        )
        .await;
    assert_eq!(bad_ttl.status, StatusCode::UNPROCESSABLE_ENTITY);
}

/// Creates a run, leases it and reserves attempt 0 of both its rollouts: (run, lease).
async fn run_with_reserved_attempts(app: &TestApp) -> (String, String) {
    let run_id = app.create().await;
    let lease = app.lease(&run_id, "collector-a").await.body["lease_id"]
        .as_str()
        .expect("lease")
        .to_owned();
    let reserved = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/reserve"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_ids": ["0-0", "1-0"]})),
        )
        .await;
    assert_eq!(
        reserved.body["attempts"],
        json!({"0-0": 0, "1-0": 0}),
        "{}",
        reserved.body
    );
    (run_id, lease)
}

/// Execution numbers are signed 64-bit wherever they are handed out and recorded: a manifest's
/// `next_attempt` past 2^63 - 1 is unreadable, and a reservation that would leave one there is
/// refused with nothing written (hostile review 45: 2^64 - 1 was handed out as -1 and wrapped
/// to 0 on disk, a manifest the service then refused to read).
#[tokio::test]
async fn a_reservation_past_the_largest_execution_number_is_refused_and_writes_nothing() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_reserved_attempts(&app).await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let uri = format!("/runs/{run_id}/attempts/reserve");
    let reserve = || {
        app.call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_ids": ["1-0"]})),
        )
    };
    let set_next = |next: u64| {
        let mut manifest: Value =
            serde_json::from_slice(&std::fs::read(&paths.manifest).expect("manifest"))
                .expect("json");
        manifest["next_attempt"]["1-0"] = json!(next);
        recovery_sidecar::atomic_write_json(&paths.manifest, &manifest, None).expect("edit");
    };
    let largest = i64::MAX as u64;
    // The last number there is is handed out; the manifest then holds one a reader keeps.
    set_next(largest - 1);
    let reserved = reserve().await;
    assert_eq!(
        reserved.body["attempts"]["1-0"].as_i64(),
        Some(i64::MAX - 1),
        "{}",
        reserved.body
    );
    let written: Value =
        serde_json::from_slice(&std::fs::read(&paths.manifest).expect("manifest")).expect("json");
    assert_eq!(written["next_attempt"]["1-0"].as_u64(), Some(largest));
    // No number is left for it: the plan offers none (hostile review 46, N6).
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    let entry = plan.body["entries"]
        .as_array()
        .and_then(|entries| entries.iter().find(|e| e["rollout_id"] == "1-0"))
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(
        (entry["state"].as_str(), entry["next_attempt"].as_i64()),
        (Some("exhausted"), None),
        "{}",
        plan.body
    );
    for (next, status, code, named) in [
        (
            largest,
            StatusCode::CONFLICT,
            "not_eligible",
            "no execution number is left",
        ),
        (
            largest + 1,
            StatusCode::UNPROCESSABLE_ENTITY,
            "manifest_unreadable",
            "next_attempt.1-0",
        ),
        (
            u64::MAX,
            StatusCode::UNPROCESSABLE_ENTITY,
            "manifest_unreadable",
            "next_attempt.1-0",
        ),
    ] {
        set_next(next);
        let before = std::fs::read(&paths.manifest).expect("manifest");
        let refused = reserve().await;
        assert_eq!(
            (refused.status, refused.body["code"].as_str()),
            (status, Some(code)),
            "{next}: {}",
            refused.body
        );
        assert!(
            refused.body.to_string().contains(named),
            "{next}: {}",
            refused.body
        );
        assert_eq!(
            std::fs::read(&paths.manifest).expect("manifest"),
            before,
            "{next}: the manifest is untouched"
        );
    }
}

/// Reserves attempts, saves a masked result that kept an answer, and returns (run, lease).
async fn run_with_masked_answer(app: &TestApp) -> (String, String) {
    let (run_id, lease) = run_with_reserved_attempts(app).await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let results = [
        json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id, "reward": 1.0, "response": {"output": [{}], "status": "completed"}}),
        json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id, "reward": 0.0, "mask_sample": true, "failure_kind": "verifier_error", "response": {"output": [{"type": "message"}], "status": "completed"}}),
    ];
    let text: String = results.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&paths.output, text).expect("results");
    (run_id, lease)
}

/// `POST /runs/{id}/outcomes/check` (the module's `check_outcome`, facts §11.2) says where a
/// line goes and what the plan would make of it, or refuses it naming the rule; it writes
/// nothing, and it agrees with the plan: a line it admits, once appended, plans; a line it
/// refuses by a plan rule stops the plan (except a missing attempt index, which saved lines
/// are read as attempt 0 with but a line being saved must carry).
#[tokio::test]
async fn an_outcome_line_is_checked_by_the_rules_the_plan_reads_saved_lines_with() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_reserved_attempts(&app).await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let result = |task: i64, attempt: Value, reward: f64| json!({"_ng_task_index": task, "_ng_rollout_index": 0, "_ng_attempt_index": attempt, "_ng_run_id": run_id, "reward": reward, "response": {"output": [{"type": "message"}], "status": "completed"}});
    let saved = result(0, json!(0), 1.0).to_string();
    std::fs::write(&paths.output, format!("{saved}\n")).expect("results");
    let failure = json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id, "_ng_failure_class": "transport_peer_drop", "failure_kind": "transport_peer_drop"});
    let mut untagged = result(1, json!(0), 1.0);
    untagged.as_object_mut().expect("row").remove("_ng_run_id");
    let mut no_attempt = result(1, json!(0), 1.0);
    no_attempt
        .as_object_mut()
        .expect("row")
        .remove("_ng_attempt_index");
    let mut other_run = result(1, json!(0), 1.0);
    other_run["_ng_run_id"] = json!("0123456789abcdef0123456789abcdef");
    let mut renamed = result(1, json!(0), 1.0);
    renamed["_ng_rollout_id"] = json!("0-0");
    let mut evidence = result(1, json!(0), 1.0);
    evidence["_ng_omitted_rollout"] = json!(true);
    // The invalid-judge migration: the original result of 0-0 saved, its sidecar copy checked.
    let mut judged = result(0, json!(0), 0.0);
    judged["invalid_judge_response"] = json!(true);
    let mut migrated = judged.clone();
    migrated["_ng_failure_class"] = json!("judge_invalid");
    migrated["_ng_migrated_invalid_judge_response"] = json!(true);
    // (line, the answer: a disposition with its file, rollout and attempt, or a refusal's
    // reason)
    type Admitted = (&'static str, &'static str, Value, Value);
    let cases: Vec<(String, Result<Admitted, &str>)> = vec![
        (
            result(1, json!(0), 1.0).to_string(),
            Ok(("new", "results", json!("1-0"), json!(0))),
        ),
        (
            failure.to_string(),
            Ok(("new", "failures", json!("1-0"), json!(0))),
        ),
        (
            format!("{saved}\n"),
            Ok(("already_saved", "results", json!("0-0"), json!(0))),
        ),
        (
            evidence.to_string(),
            Ok(("evidence", "results", Value::Null, Value::Null)),
        ),
        (
            result(0, json!(0), 0.0).to_string(),
            Err("conflicting_outcomes"),
        ),
        (result(1, json!(1), 1.0).to_string(), Err("unreserved")),
        (
            result(5, json!(0), 1.0).to_string(),
            Err("not_in_inventory"),
        ),
        (result(1, json!(true), 1.0).to_string(), Err("bad_attempt")),
        (result(1, json!(-1), 1.0).to_string(), Err("bad_attempt")),
        (no_attempt.to_string(), Err("bad_attempt")),
        (other_run.to_string(), Err("different_run")),
        (untagged.to_string(), Err("different_run")),
        (renamed.to_string(), Err("mismatched_index")),
        ("{\"_ng_task_index\": 1,".to_owned(), Err("malformed_json")),
        ("[1]".to_owned(), Err("not_an_object")),
        ("{}".to_owned(), Err("no_identity")),
        (format!("{saved}\n{saved}"), Err("not_one_line")),
        (String::new(), Err("blank_line")),
        ("\u{0b}\t \n".to_owned(), Err("blank_line")),
    ];
    let snapshot =
        || [&paths.output, &paths.failures, &paths.manifest].map(|p| std::fs::read(p).ok());
    let before = snapshot();
    let uri = format!("/runs/{run_id}/outcomes/check");
    for (line, expected) in &cases {
        let reply = app
            .call(
                Method::POST,
                &uri,
                Some(COLLECTOR),
                Some(json!({"line": line})),
            )
            .await;
        match expected {
            Ok((disposition, artifact, rollout, attempt)) => {
                assert_eq!(reply.status, StatusCode::OK, "{line}: {}", reply.body);
                assert_eq!(
                    reply.body,
                    json!({"disposition": disposition, "artifact": artifact, "rollout_id": rollout, "attempt": attempt}),
                    "{line}"
                );
            }
            Err(reason) => {
                assert_eq!(
                    (
                        reply.status,
                        reply.body["code"].as_str(),
                        reply.body["details"]["reason"].as_str(),
                        reply.body["details"]["field"].as_str()
                    ),
                    (
                        StatusCode::UNPROCESSABLE_ENTITY,
                        Some("outcome_refused"),
                        Some(*reason),
                        Some("line")
                    ),
                    "{line}: {}",
                    reply.body
                );
            }
        }
    }
    assert_eq!(snapshot(), before, "a check writes nothing");
    // The plan agrees: each JSON object line appended where it is routed, then taken away.
    for (line, expected) in &cases {
        let Ok(Value::Object(row)) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if matches!(expected, Err("bad_attempt")) && !row.contains_key("_ng_attempt_index") {
            continue;
        }
        let file = if row.get("_ng_failure_class").is_some_and(|c| !c.is_null()) {
            &paths.failures
        } else {
            &paths.output
        };
        let length = std::fs::metadata(file).map_or(0, |m| m.len());
        let mut appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .expect("open");
        std::io::Write::write_all(&mut appended, format!("{}\n", line.trim_end()).as_bytes())
            .expect("append");
        let plan = app
            .call(
                Method::GET,
                &format!("/runs/{run_id}/plan"),
                Some(VIEWER),
                None,
            )
            .await;
        let expected_status = match expected {
            Ok(_) => StatusCode::OK,
            Err(_) => StatusCode::UNPROCESSABLE_ENTITY,
        };
        assert_eq!(plan.status, expected_status, "{line}: {}", plan.body);
        appended.set_len(length).expect("take the line away");
    }
    // The invalid-judge migration in the order a migrating collector writes it: the result
    // saved, then its sidecar copy. The plan reads the sidecar first, so the copy takes the
    // result's place (hostile review 40: the check called it conflicting).
    std::fs::write(&paths.output, format!("{judged}\n")).expect("results");
    let reply = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(json!({"line": migrated.to_string()})),
        )
        .await;
    assert_eq!(
        reply.body,
        json!({"disposition": "migrates", "artifact": "failures", "rollout_id": "0-0", "attempt": 0}),
        "{}",
        reply.body
    );
    std::fs::write(&paths.failures, format!("{migrated}\n")).expect("failures");
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(plan.status, StatusCode::OK, "{}", plan.body);
}

/// The coverage snapshot `<stem>_coverage.json` is written when a lease is granted and when
/// it is released, as a Python collector's store writes it when it opens and closes (facts
/// §11.7; gap review 34: it was never written, so file-based tools found nothing).
#[tokio::test]
async fn a_lease_writes_the_coverage_snapshot_when_granted_and_released() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let read = || -> Value {
        serde_json::from_slice(&std::fs::read(&paths.coverage).expect("coverage")).expect("json")
    };
    // Granted before the outcomes were saved: nothing done yet.
    let granted = read();
    assert_eq!(
        (
            &granted["schema_version"],
            &granted["run_id"],
            &granted["expected"],
            &granted["successful"]
        ),
        (&json!(2), &json!(run_id), &json!(2), &json!(0)),
        "{granted}"
    );
    let released = app
        .call(
            Method::DELETE,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease})),
        )
        .await;
    assert_eq!(released.status, StatusCode::NO_CONTENT, "{}", released.body);
    let closed = read();
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        closed, plan.body["coverage"],
        "the snapshot is the plan's coverage"
    );
    assert_eq!(closed["successful"], json!(2), "{closed}");
    // Pretty, as the Python module's atomic_write_json writes it.
    let text = std::fs::read_to_string(&paths.coverage).expect("text");
    assert!(
        text.starts_with("{\n  \"") && text.ends_with("}\n"),
        "{text}"
    );
    // A takeover grants a lease too (hostile review 35: it wrote nothing).
    std::fs::remove_file(&paths.coverage).expect("remove");
    let taken = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease/takeover"),
            Some(OPERATOR),
            Some(json!({"holder": "op", "host": "h", "pid": 1, "reason": "stuck"})),
        )
        .await;
    assert_eq!(taken.status, StatusCode::CREATED, "{}", taken.body);
    assert_eq!(read(), closed);
}

/// A resume opts in to retrying terminal timeouts with the collection setting
/// `retry_terminal_timeouts: true` (facts §17, scenario 37): no drift, the manifest keeps the
/// opt-in (a later resume without it too), the plan retries the terminal timeout, and the
/// opt-in is audited once (gap review 34: a resume's opt-in was ignored). The setting is read as
/// the Python module reads a bool once its interpolation is resolved (`${oc.env:...}` giving
/// `"yes"` opts in, its default `false` does not; `"maybe"` is refused). The answer says whether rows were compared.
#[tokio::test]
async fn a_resume_opting_in_to_timeout_retries_keeps_the_opt_in() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let timeout = json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id,
        "_ng_failure_class": "timeout_exceeded", "_ng_failure_terminal": true, "error": "deadline"});
    std::fs::write(&paths.output, "").expect("results");
    std::fs::write(&paths.failures, format!("{timeout}\n")).expect("failures");
    let plan = || async {
        app.call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await
        .body["entries"][0]["state"]
            .clone()
    };
    assert_eq!(plan().await, "terminal");
    let uri = format!("/runs/{run_id}/validate");
    let validate = |body: Value| app.call(Method::POST, &uri, Some(COLLECTOR), Some(body));
    let mut body = app.validate_body(0.3, 8000);
    body["lease_id"] = json!(lease);
    let plain = validate(body.clone()).await;
    assert_eq!(
        (&plain.body["outcome"], &plain.body["rows_compared"]),
        (&json!("reuse"), &json!(false)),
        "{}",
        plain.body
    );
    // A value the Python module would refuse is refused, saying why and changing nothing.
    body["config"]["retry_terminal_timeouts"] = json!("sk-live-maybe");
    let refused = validate(body.clone()).await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        refused.body
    );
    let message = refused.body["message"].as_str().expect("message");
    assert!(
        message.starts_with("config.retry_terminal_timeouts: ") && !message.contains("sk-live"),
        "{message}"
    );
    assert!(!concurrency::saved_manifest(&app).retry_terminal_timeouts);
    // Set from the environment, as NeMo Gym configurations do: resolved first (the default
    // `false` gives OmegaConf's "False"), then read as pydantic's bool reads it (hostile review
    // 38: the unresolved text was refused).
    body["config"]["retry_terminal_timeouts"] = json!("${oc.env:NGT_RETRY_TIMEOUTS,false}");
    let defaulted = validate(body.clone()).await;
    assert_eq!(defaulted.body["outcome"], "reuse", "{}", defaulted.body);
    assert!(!concurrency::saved_manifest(&app).retry_terminal_timeouts);
    body["environment"]["NGT_RETRY_TIMEOUTS"] = json!("yes");
    let opted = validate(body.clone()).await;
    assert_eq!(opted.body["outcome"], "reuse", "{}", opted.body);
    assert_eq!(opted.body["manifest"]["retry_terminal_timeouts"], true);
    assert!(concurrency::saved_manifest(&app).retry_terminal_timeouts);
    assert_eq!(plan().await, "retryable");
    // Kept by a later resume that does not repeat it; audited once.
    body["config"]
        .as_object_mut()
        .expect("config")
        .remove("retry_terminal_timeouts");
    body["rows"] = rows();
    let later = validate(body).await;
    assert_eq!(
        (&later.body["outcome"], &later.body["rows_compared"]),
        (&json!("reuse"), &json!(true)),
        "{}",
        later.body
    );
    assert!(concurrency::saved_manifest(&app).retry_terminal_timeouts);
    let audit = app
        .call(
            Method::GET,
            &format!("/audit?run_id={run_id}&action=run.retry_terminal_timeouts"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        audit.body["entries"].as_array().map(Vec::len),
        Some(1),
        "{}",
        audit.body
    );
}

/// A run created with the opt-in reads it as the Python module reads a bool, once resolved:
/// `${oc.env:NGT_RETRY_TIMEOUTS,no}` with the variable `True` opts in; `"maybe"` is refused
/// naming the setting and writes nothing.
#[tokio::test]
async fn a_run_created_with_the_timeout_opt_in_reads_it_as_python_does() {
    let app = TestApp::new().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let mut body = app.create_body();
    body["config"]["retry_terminal_timeouts"] = json!("maybe");
    let refused = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body.clone()))
        .await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        refused.body
    );
    assert!(
        refused.body["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("config.retry_terminal_timeouts: ")),
        "{}",
        refused.body
    );
    assert!(!paths.manifest.exists(), "a refused create writes nothing");
    body["config"]["retry_terminal_timeouts"] = json!("${oc.env:NGT_RETRY_TIMEOUTS,no}");
    body["environment"]["NGT_RETRY_TIMEOUTS"] = json!("True");
    let created = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    assert!(concurrency::saved_manifest(&app).retry_terminal_timeouts);
}

/// A crashed judge's rollout is graded again end to end: the re-judgment is admitted, the
/// re-judged outcome is saved for the same attempt naming the line it re-judges
/// (`_ng_rejudge.predecessor_sha256`), the plan counts it, and the re-judgment closes. The new
/// outcome used to conflict with the judge failure, so such a run could never complete (gap
/// review 34).
#[tokio::test]
async fn a_judge_failure_is_graded_again_and_the_new_grade_counts() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let plan = || async {
        app.call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await
    };
    // Rollout 0-0's grade failed after the model answered: the answer is in the sidecar line.
    std::fs::write(&paths.output, "").expect("results");
    let judge_failed = json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id,
        "_ng_failure_class": "judge_failed", "_ng_failure_terminal": false, "error": "judge timed out",
        "response": {"output": [{"type": "message"}], "status": "completed"}})
    .to_string();
    std::fs::write(&paths.failures, format!("{judge_failed}\n")).expect("failures");
    let before = plan().await;
    assert_eq!(
        before.body["entries"][0]["state"], "judge_recoverable",
        "{}",
        before.body
    );
    let admitted = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/rejudgments"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_id": "0-0", "attempt": 0,
                "predecessor_failure_id": "f-1", "predecessor_line": judge_failed})),
        )
        .await;
    assert_eq!(admitted.status, StatusCode::CREATED, "{}", admitted.body);
    let operation = admitted.body["operation_id"].as_str().expect("operation");
    let sha = recovery_core::canonical::sha256_hex(judge_failed.as_bytes());
    assert_eq!(admitted.body["predecessor_sha256"], json!(sha));
    let graded = json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id,
        "reward": 1.0, "response": {"output": [{"type": "message"}], "status": "completed"},
        "_ng_rejudge": {"operation_id": operation, "predecessor_failure_id": "f-1", "predecessor_sha256": sha}});
    std::fs::write(&paths.output, format!("{graded}\n")).expect("results");
    let after = plan().await;
    assert_eq!(after.status, StatusCode::OK, "{}", after.body);
    assert_eq!(
        (
            &after.body["entries"][0]["state"],
            &after.body["coverage"]["successful"]
        ),
        (&json!("scored"), &json!(1)),
        "{}",
        after.body
    );
    let closed = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/rejudgments/{operation}/close"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "outcome": "graded"})),
        )
        .await;
    assert_eq!(closed.status, StatusCode::NO_CONTENT, "{}", closed.body);
    assert!(concurrency::saved_manifest(&app).pending_rejudge.is_empty());
    assert_eq!(plan().await.body["entries"][0]["state"], "scored");
    // The same predecessor again, once graded: nothing left to re-judge (hostile review 35:
    // admitted, and its second successor broke the plan).
    let again = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/rejudgments"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_id": "0-0", "attempt": 0,
                "predecessor_failure_id": "f-1", "predecessor_line": judge_failed})),
        )
        .await;
    assert_eq!(
        (again.status, again.body["code"].as_str()),
        (StatusCode::CONFLICT, Some("not_eligible")),
        "{}",
        again.body
    );
    // A result whose grade failed is re-judged from the results file.
    let unparseable = json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id,
        "reward": 0.0, "failure_kind": "judge_unparseable", "response": {"output": [{"type": "message"}], "status": "completed"}})
    .to_string();
    std::fs::write(&paths.output, format!("{graded}\n{unparseable}\n")).expect("results");
    let admitted = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/rejudgments"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_id": "1-0", "attempt": 0,
                "predecessor_failure_id": "r-1", "predecessor_line": unparseable})),
        )
        .await;
    assert_eq!(admitted.status, StatusCode::CREATED, "{}", admitted.body);
}

#[tokio::test]
async fn approvals_need_an_operator_and_an_eligible_attempt() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let uri = format!("/runs/{run_id}/approvals");
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        plan.body["entries"][1]["state"], "awaiting_approval",
        "{}",
        plan.body
    );
    let approval = json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "the verifier lost the artifact"});
    let viewer = app
        .call(Method::POST, &uri, Some(VIEWER), Some(approval.clone()))
        .await;
    assert_eq!(viewer.status, StatusCode::FORBIDDEN);
    let scored = app
        .call(
            Method::POST,
            &uri,
            Some(OPERATOR),
            Some(json!({"task_index": 0, "rollout_index": 0, "attempt_index": 0, "reason": "x"})),
        )
        .await;
    assert_eq!(
        (
            scored.status,
            scored.body["code"].as_str(),
            scored.body["details"]["state"].as_str()
        ),
        (StatusCode::CONFLICT, Some("not_eligible"), Some("scored"))
    );
    let wrong_attempt = app
        .call(
            Method::POST,
            &uri,
            Some(OPERATOR),
            Some(json!({"task_index": 1, "rollout_index": 0, "attempt_index": 3, "reason": "x"})),
        )
        .await;
    assert_eq!(wrong_attempt.body["code"], "not_eligible");
    let missing = app
        .call(
            Method::POST,
            &uri,
            Some(OPERATOR),
            Some(json!({"task_index": 9, "rollout_index": 0, "attempt_index": 0, "reason": "x"})),
        )
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    let granted = app
        .call(Method::POST, &uri, Some(OPERATOR), Some(approval))
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        (
            plan.body["entries"][1]["state"].as_str(),
            plan.body["entries"][1]["next_attempt"].as_i64()
        ),
        (Some("approved_rerun"), Some(1))
    );
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(listed.body.as_array().expect("list").len(), 1);
    let approval_id = granted.body["approval_id"].as_str().expect("id");
    let revoke = app
        .call(
            Method::DELETE,
            &format!("{uri}/{approval_id}"),
            Some(OPERATOR),
            None,
        )
        .await;
    assert_eq!(revoke.status, StatusCode::NO_CONTENT);
    let again = app
        .call(
            Method::DELETE,
            &format!("{uri}/{approval_id}"),
            Some(OPERATOR),
            None,
        )
        .await;
    assert_eq!(
        (again.status, again.body["code"].as_str()),
        (StatusCode::CONFLICT, Some("conflict"))
    );
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        plan.body["entries"][1]["state"], "awaiting_approval",
        "a revoked approval reopens nothing"
    );
}

/// An approval line written beside the run (by a Python collector or an operator's script) is
/// honoured by the plan at once, so it is listed at once and can be revoked, before any
/// reindex told the database (left open by hostile review 40: listed only after a reindex, and
/// a revocation answered 404). Operators revoking it at once: one revocation, the others 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_line_written_beside_the_run_is_listed_and_revocable_at_once() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let uri = format!("/runs/{run_id}/approvals");
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let line = json!({"approval_id": "python-1", "at": "2026-12-05T12:00:00Z", "by": "op", "reason": "lost artifact", "task_index": 1, "rollout_index": 0, "attempt_index": 0});
    std::fs::write(&paths.rerun_masked, format!("{line}\n")).expect("journal");
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert!(
        plan.body.to_string().contains("approved_rerun"),
        "the plan honours the line: {}",
        plan.body
    );
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(listed.status, StatusCode::OK, "{}", listed.body);
    let listed = listed.body.as_array().expect("list").clone();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (
            listed[0]["approval_id"].as_str(),
            listed[0]["task_index"].as_i64(),
            listed[0]["revoked_at"].is_null(),
            listed[0]["consumed_by_attempt"].is_null()
        ),
        (Some("python-1"), Some(1), true, true),
        "{listed:?}"
    );
    let revokes: Vec<_> = (0..4)
        .map(|_| {
            let (state, path) = (app.state.clone(), format!("{uri}/python-1"));
            tokio::spawn(
                async move { send(state, Method::DELETE, &path, Some(OPERATOR), None).await },
            )
        })
        .collect();
    let mut statuses = Vec::new();
    for revoke in revokes {
        statuses.push(revoke.await.expect("revoke").status);
    }
    statuses.sort();
    assert_eq!(
        statuses,
        [
            StatusCode::NO_CONTENT,
            StatusCode::CONFLICT,
            StatusCode::CONFLICT,
            StatusCode::CONFLICT
        ]
    );
    let journal = std::fs::read_to_string(&paths.rerun_masked).expect("journal");
    assert!(!journal.contains("python-1"), "{journal}");
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert!(listed.body[0]["revoked_at"].is_string(), "{}", listed.body);
}

/// A used approval whose journal line is rewritten to name another attempt approves that
/// attempt in the plan: it is listed so, unused, and an operator can revoke it, and a reindex
/// records it so too (hostile review 43: listed as used for the old attempt while the plan
/// approved the new one, and a revocation answered 409).
#[tokio::test]
async fn a_used_approval_rewritten_for_another_attempt_is_listed_and_revocable_as_the_plan_reads_it()
 {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    let uri = format!("/runs/{run_id}/approvals");
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let approve =
        json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "lost artifact"});
    let granted = app
        .call(Method::POST, &uri, Some(OPERATOR), Some(approve))
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    let id = granted.body["approval_id"].as_str().expect("id").to_owned();
    let reserved = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/reserve"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_ids": ["1-0"]})),
        )
        .await;
    assert_eq!(
        reserved.body["attempts"],
        json!({"1-0": 1}),
        "{}",
        reserved.body
    );
    // The rerun kept an answer without a grade again; the line of the used id is rewritten to
    // approve that attempt.
    let mut results = std::fs::read_to_string(&paths.output).expect("results");
    results.push_str(&format!("{}\n", json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 1, "_ng_run_id": run_id, "reward": 0.0, "mask_sample": true, "failure_kind": "verifier_error", "response": {"output": [{"type": "message"}], "status": "completed"}})));
    std::fs::write(&paths.output, results).expect("results");
    let journal = std::fs::read_to_string(&paths.rerun_masked).expect("journal");
    std::fs::write(
        &paths.rerun_masked,
        journal.replace("\"attempt_index\":0", "\"attempt_index\":1"),
    )
    .expect("rewritten");
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert!(
        plan.body.to_string().contains("approved_rerun"),
        "the plan honours the rewritten line: {}",
        plan.body
    );
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(
        (
            listed.body[0]["attempt_index"].as_i64(),
            listed.body[0]["consumed_by_attempt"].is_null()
        ),
        (Some(1), true),
        "{}",
        listed.body
    );
    let revoked = app
        .call(Method::DELETE, &format!("{uri}/{id}"), Some(OPERATOR), None)
        .await;
    assert_eq!(revoked.status, StatusCode::NO_CONTENT, "{}", revoked.body);
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert!(
        !plan.body.to_string().contains("approved_rerun"),
        "{}",
        plan.body
    );
}

/// An approval whose line was removed from the journal by hand (or by another process
/// revoking it), made unreadable or left unterminated approves nothing in the plan, and is
/// listed as revoked at once, as a reindex records it (hostile reviews 43 and 44: listed as
/// live until a reindex).
#[tokio::test]
async fn an_approval_whose_line_stops_approving_is_listed_as_revoked_at_once() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let uri = format!("/runs/{run_id}/approvals");
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let approve =
        json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "lost artifact"});
    let granted = app
        .call(Method::POST, &uri, Some(OPERATOR), Some(approve))
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert!(listed.body[0]["revoked_at"].is_null(), "{}", listed.body);
    let line = std::fs::read_to_string(&paths.rerun_masked).expect("journal");
    let mut unreadable: Value = serde_json::from_str(line.trim_end()).expect("line");
    unreadable.as_object_mut().expect("line").remove("reason");
    // Emptied, its line made unreadable, its newline taken away (review 44): it approves
    // nothing in the plan, and the list says so; its line whole again, it approves again.
    let journals = [
        String::new(),
        format!("{unreadable}\n"),
        line.trim_end().to_owned(),
    ];
    for journal in journals {
        std::fs::write(&paths.rerun_masked, &journal).expect("written by hand");
        let plan = app
            .call(
                Method::GET,
                &format!("/runs/{run_id}/plan"),
                Some(VIEWER),
                None,
            )
            .await;
        assert!(
            !plan.body.to_string().contains("approved_rerun"),
            "{journal:?}: {}",
            plan.body
        );
        let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
        assert!(
            listed.body[0]["revoked_at"].is_string(),
            "{journal:?}: {}",
            listed.body
        );
    }
    std::fs::write(&paths.rerun_masked, &line).expect("whole again");
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert!(listed.body[0]["revoked_at"].is_null(), "{}", listed.body);
}

/// An attempt-extension journal the plan refuses (a line of `extend_attempts` 0) shows no cap
/// in the run's view but the reason, and is not appended to (hostile review 48: the view showed
/// a cap as if nothing were extended, and an extension was appended after the bad line, the run
/// staying unplannable). Nothing is written; repaired by hand, both work again.
#[tokio::test]
async fn an_unreadable_extension_journal_shows_no_cap_and_is_not_appended_to() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let bad = format!(
        "{}\n",
        json!({"at": "2026-12-05T12:00:00Z", "extend_attempts": 0, "by": "op", "reason": "r"})
    );
    std::fs::write(&paths.attempt_extension, &bad).expect("journal");
    let view_uri = format!("/runs/{run_id}");
    let view = app.call(Method::GET, &view_uri, Some(VIEWER), None).await;
    assert_eq!(view.status, StatusCode::OK, "{}", view.body);
    assert!(view.body["effective_cap"].is_null(), "{}", view.body);
    assert!(view.body["attempt_extension"].is_null(), "{}", view.body);
    assert!(
        view.body["budget_problem"]
            .as_str()
            .is_some_and(|m| m.contains("extend_attempts must be an integer from 1 to")),
        "{}",
        view.body
    );
    let extend_uri = format!("/runs/{run_id}/attempts/extend");
    let extend = json!({"extend_attempts": 2, "reason": "judge outage"});
    let refused = app
        .call(
            Method::POST,
            &extend_uri,
            Some(OPERATOR),
            Some(extend.clone()),
        )
        .await;
    assert_code(&refused, StatusCode::CONFLICT, "run_files_invalid");
    assert_eq!(
        std::fs::read_to_string(&paths.attempt_extension).expect("journal"),
        bad,
        "nothing written"
    );
    std::fs::write(&paths.attempt_extension, "").expect("repaired by hand");
    let extended = app
        .call(Method::POST, &extend_uri, Some(OPERATOR), Some(extend))
        .await;
    assert_eq!(extended.status, StatusCode::CREATED, "{}", extended.body);
    let view = app.call(Method::GET, &view_uri, Some(VIEWER), None).await;
    assert_eq!(view.body["attempt_extension"], 2, "{}", view.body);
    assert!(view.body["effective_cap"].is_u64(), "{}", view.body);
    assert!(view.body["budget_problem"].is_null(), "{}", view.body);
    // Nor is a line appended that would take the sum past 2^63 - 1, which the plan refuses
    // (hostile review 51, N2: the extension answered 201 and left the run with no cap).
    let near = format!("{}\n", json!({"extend_attempts": i64::MAX - 2}));
    std::fs::write(&paths.attempt_extension, &near).expect("a journal near the limit");
    let refused = app
        .call(
            Method::POST,
            &extend_uri,
            Some(OPERATOR),
            Some(json!({"extend_attempts": 3, "reason": "too many"})),
        )
        .await;
    assert_code(&refused, StatusCode::CONFLICT, "run_files_invalid");
    assert_eq!(
        std::fs::read_to_string(&paths.attempt_extension).expect("journal"),
        near,
        "nothing written"
    );
    let view = app.call(Method::GET, &view_uri, Some(VIEWER), None).await;
    assert!(view.body["budget_problem"].is_null(), "{}", view.body);
}

/// An approval is refused while the approvals journal ends with an unterminated line: the
/// append would end that line, and a line that approved nothing would approve with nobody's
/// approval recorded (hostile review 43). Nothing is written; once the line is ended by hand it
/// is an approval the list shows.
#[tokio::test]
async fn an_approval_is_refused_while_the_journal_ends_with_an_unterminated_line() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let uri = format!("/runs/{run_id}/approvals");
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let torn = json!({"approval_id": "torn-1", "at": "2026-12-05T12:00:00Z", "by": "op", "reason": "r", "task_index": 1, "rollout_index": 0, "attempt_index": 0}).to_string();
    std::fs::write(&paths.rerun_masked, &torn).expect("journal");
    let approve =
        json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "lost artifact"});
    let refused = app
        .call(Method::POST, &uri, Some(OPERATOR), Some(approve.clone()))
        .await;
    assert_code(&refused, StatusCode::CONFLICT, "run_files_invalid");
    assert!(
        refused.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("unterminated line")),
        "{}",
        refused.body
    );
    assert_eq!(
        std::fs::read_to_string(&paths.rerun_masked).expect("journal"),
        torn,
        "nothing written"
    );
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(listed.body, json!([]), "the torn line approves nothing");
    std::fs::write(&paths.rerun_masked, format!("{torn}\n")).expect("ended by hand");
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(listed.body[0]["approval_id"], "torn-1", "{}", listed.body);
    // A blank unterminated tail can approve nothing: the append cuts it off (hostile review
    // 46, N7: it was refused too).
    let revoked = app
        .call(
            Method::DELETE,
            &format!("{uri}/torn-1"),
            Some(OPERATOR),
            None,
        )
        .await;
    assert_eq!(revoked.status, StatusCode::NO_CONTENT, "{}", revoked.body);
    std::fs::write(&paths.rerun_masked, " \t\x0b").expect("blank tail");
    let granted = app
        .call(Method::POST, &uri, Some(OPERATOR), Some(approve))
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    let journal = std::fs::read_to_string(&paths.rerun_masked).expect("journal");
    assert!(
        journal.ends_with('\n') && !journal.contains('\x0b') && journal.lines().count() == 1,
        "{journal:?}"
    );
}

/// Whether an approval was used is read from the run's files: an attempt reserved after the
/// approved one. A database that did not see the reservation (rebuilt from the files, or the
/// attempt reserved by a Python collector) neither lists the approval as unused nor lets it be
/// revoked, which would erase the journal line that explains the extra attempt (review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_used_by_a_reservation_the_database_missed_stays_used() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    let uri = format!("/runs/{run_id}/approvals");
    let approve =
        json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "lost artifact"});
    let granted = app
        .call(Method::POST, &uri, Some(OPERATOR), Some(approve))
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    let approval_id = granted.body["approval_id"].as_str().expect("id").to_owned();
    // A Python collector sharing the files reserves the rerun in the manifest itself.
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let mut manifest: Value =
        serde_json::from_slice(&std::fs::read(&paths.manifest).expect("manifest")).expect("json");
    manifest["next_attempt"]["1-0"] = json!(2);
    recovery_sidecar::atomic_write_json(&paths.manifest, &manifest, None).expect("reserve");
    // Listed as used at once, before anything told the database.
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(listed.body[0]["consumed_by_attempt"], 1, "{}", listed.body);
    // Operators revoking at once: every one is refused, and the use is recorded once.
    let revokes: Vec<_> = (0..8)
        .map(|_| {
            let (state, path) = (app.state.clone(), format!("{uri}/{approval_id}"));
            tokio::spawn(
                async move { send(state, Method::DELETE, &path, Some(OPERATOR), None).await },
            )
        })
        .collect();
    for revoke in revokes {
        let revoke = revoke.await.expect("revoke");
        assert_eq!(
            (revoke.status, revoke.body["code"].as_str()),
            (StatusCode::CONFLICT, Some("conflict")),
            "{}",
            revoke.body
        );
    }
    let journal = std::fs::read_to_string(&paths.rerun_masked).expect("journal");
    assert!(
        journal.contains(&approval_id),
        "the approval stays on record"
    );
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(listed.body[0]["consumed_by_attempt"], 1, "{}", listed.body);
    // The database is made again from the files: the approval is still listed as used.
    app.call(
        Method::DELETE,
        &format!("/runs/{run_id}/lease"),
        Some(COLLECTOR),
        Some(json!({"lease_id": lease})),
    )
    .await;
    let rebuilt_dir = tempfile::tempdir().expect("dir");
    let mut config = app.config.clone();
    config.data_dir = rebuilt_dir.path().join("data");
    let rebuilt = recovery_server::start(config, app.clock.clone())
        .await
        .expect("start on a new database");
    let listed = send(rebuilt.clone(), Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(
        (
            listed.body[0]["approval_id"].as_str(),
            listed.body[0]["consumed_by_attempt"].as_i64()
        ),
        (Some(approval_id.as_str()), Some(1)),
        "{}",
        listed.body
    );
    let revoke = send(
        rebuilt,
        Method::DELETE,
        &format!("{uri}/{approval_id}"),
        Some(OPERATOR),
        None,
    )
    .await;
    assert_eq!(revoke.status, StatusCode::CONFLICT, "{}", revoke.body);
    assert!(
        std::fs::read_to_string(&paths.rerun_masked)
            .expect("journal")
            .contains(&approval_id)
    );
}

#[tokio::test]
async fn attempts_are_extended_resubmitted_and_reserved_only_by_their_owners() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    let extend = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/extend"),
            Some(OPERATOR),
            Some(json!({"extend_attempts": 2, "reason": "provider outage"})),
        )
        .await;
    assert_eq!(extend.status, StatusCode::CREATED);
    let bad = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/extend"),
            Some(OPERATOR),
            Some(json!({"extend_attempts": 0, "reason": "x"})),
        )
        .await;
    assert_eq!(
        (
            bad.status,
            bad.body["message"]
                .as_str()
                .map(|m| m.starts_with("extend_attempts"))
        ),
        (StatusCode::UNPROCESSABLE_ENTITY, Some(true))
    );
    let run = app
        .call(Method::GET, &format!("/runs/{run_id}"), Some(VIEWER), None)
        .await;
    assert_eq!(
        (
            run.body["saved_cap"].as_u64(),
            run.body["effective_cap"].as_u64()
        ),
        (Some(3), Some(5))
    );
    let leased = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/resubmit"),
            Some(OPERATOR),
            Some(json!({"reason": "new cluster"})),
        )
        .await;
    assert_eq!(
        leased.status,
        StatusCode::LOCKED,
        "no resubmit under a collector's live lease"
    );
    let no_lease = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/reserve"),
            Some(COLLECTOR),
            Some(json!({"lease_id": "forged", "rollout_ids": ["0-0"]})),
        )
        .await;
    assert_eq!(
        (no_lease.status, no_lease.body["code"].as_str()),
        (StatusCode::CONFLICT, Some("lease_not_held"))
    );
    // A refused id is named by its place in the list, quoted (an empty one too).
    for (ids, field, said) in [
        (json!(["1-0", "9-9"]), "rollout_ids[1]", "\"9-9\" is not in"),
        (json!(["1-0", ""]), "rollout_ids[1]", "\"\" is not in"),
        (
            json!(["1-0", "0-0", "1-0"]),
            "rollout_ids[2]",
            "\"1-0\" is listed twice (first at rollout_ids[0])",
        ),
    ] {
        let refused = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/attempts/reserve"),
                Some(COLLECTOR),
                Some(json!({"lease_id": lease, "rollout_ids": ids})),
            )
            .await;
        assert_eq!(
            (refused.status, refused.body["details"]["field"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some(field)),
            "{}",
            refused.body
        );
        let message = refused.body["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with(&format!("{field}: ")) && message.contains(said),
            "{message}"
        );
    }
    // What the plan does not run again is not reserved: a scored answer never, a masked answer
    // kept without a grade only once an operator approved it. Nothing is reserved then.
    let manifest_before =
        std::fs::read(recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest)
            .expect("manifest");
    for (ids, states) in [
        (json!(["0-0"]), json!(["scored"])),
        (json!(["1-0"]), json!(["awaiting_approval"])),
        (
            json!(["0-0", "1-0"]),
            json!(["scored", "awaiting_approval"]),
        ),
    ] {
        let refused = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/attempts/reserve"),
                Some(COLLECTOR),
                Some(json!({"lease_id": lease, "rollout_ids": ids})),
            )
            .await;
        let listed: Vec<&Value> = refused.body["details"]["not_runnable"]
            .as_array()
            .map(|list| list.iter().map(|entry| &entry["state"]).collect())
            .unwrap_or_default();
        assert_eq!(
            refused.body["details"]["not_runnable_count"].as_u64(),
            Some(listed.len() as u64)
        );
        assert_eq!(
            (
                refused.status,
                refused.body["code"].as_str(),
                refused.body["details"]["field"].as_str(),
                json!(listed)
            ),
            (
                StatusCode::CONFLICT,
                Some("not_eligible"),
                Some("rollout_ids"),
                states
            ),
            "{}",
            refused.body
        );
    }
    assert_eq!(
        std::fs::read(recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest)
            .expect("manifest"),
        manifest_before,
        "a refused reservation reserves nothing"
    );
    let approved = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/approvals"),
            Some(OPERATOR),
            Some(json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "the verifier lost the artifact"})),
        )
        .await;
    assert_eq!(approved.status, StatusCode::CREATED, "{}", approved.body);
    let next = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/reserve"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_ids": ["1-0"]})),
        )
        .await;
    assert_eq!(next.body["attempts"]["1-0"], 1, "{}", next.body);
    app.call(
        Method::DELETE,
        &format!("/runs/{run_id}/lease"),
        Some(COLLECTOR),
        Some(json!({"lease_id": lease})),
    )
    .await;
    let resubmit = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/resubmit"),
            Some(OPERATOR),
            Some(json!({"reason": "new cluster"})),
        )
        .await;
    assert_eq!(
        (resubmit.status, resubmit.body["line_offset"].as_i64()),
        (StatusCode::CREATED, Some(0)),
        "{}",
        resubmit.body
    );
}

#[tokio::test]
async fn rejudgments_are_admitted_into_the_manifest_and_closed() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    // Rollout 1-0's grade failed after the model answered (instead of its masked result).
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let results = std::fs::read_to_string(&paths.output).expect("results");
    let first = results.lines().next().expect("0-0's result").to_owned();
    std::fs::write(&paths.output, format!("{first}\n")).expect("results");
    let judge_failed = |kind: &str| {
        json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id,
            "_ng_failure_class": kind, "_ng_failure_terminal": false,
            "response": {"output": [{"type": "message"}], "status": "completed"}})
        .to_string()
    };
    let line = judge_failed("judge_failed");
    let line = line.as_str();
    let admit = json!({"lease_id": lease, "rollout_id": "1-0", "attempt": 0, "predecessor_failure_id": "f-1", "predecessor_line": format!("{line}\n")});
    let failures = paths.failures.clone();
    let manifest_before =
        std::fs::read(recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest)
            .expect("manifest");
    let scored = results.lines().next().expect("0-0's result").to_owned();
    let refusals = [
        (
            "a predecessor no file holds: the rollout is no judge failure yet",
            admit.clone(),
            StatusCode::CONFLICT,
            "judge_recoverable",
        ),
        (
            "an attempt never reserved",
            json!({"lease_id": lease, "rollout_id": "1-0", "attempt": 1, "predecessor_failure_id": "f-1", "predecessor_line": line}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "attempt",
        ),
        (
            "a rollout id outside the grammar",
            json!({"lease_id": lease, "rollout_id": "../bad", "attempt": 0, "predecessor_failure_id": "f-1", "predecessor_line": line}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "rollout_id",
        ),
        (
            "another rollout's line (hostile review 35: admitted)",
            json!({"lease_id": lease, "rollout_id": "0-0", "attempt": 0, "predecessor_failure_id": "f-1", "predecessor_line": line}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "predecessor_line",
        ),
        (
            "a scored result (hostile review 35: admitted)",
            json!({"lease_id": lease, "rollout_id": "0-0", "attempt": 0, "predecessor_failure_id": "f-1", "predecessor_line": scored}),
            StatusCode::CONFLICT,
            "judge_recoverable",
        ),
    ];
    for (case, body, status, said) in refusals {
        let refused = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/rejudgments"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        assert_eq!(refused.status, status, "{case}: {}", refused.body);
        assert!(
            refused.body["message"]
                .as_str()
                .is_some_and(|m| m.contains(said)),
            "{case}: {}",
            refused.body
        );
    }
    assert_eq!(
        std::fs::read(recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest)
            .expect("manifest"),
        manifest_before,
        "a refused admission changes nothing"
    );
    std::fs::write(&failures, format!("{line}\n")).expect("failures");
    let admitted = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/rejudgments"),
            Some(COLLECTOR),
            Some(admit.clone()),
        )
        .await;
    assert_eq!(admitted.status, StatusCode::CREATED, "{}", admitted.body);
    assert_eq!(
        admitted.body["predecessor_sha256"].as_str(),
        Some(recovery_core::canonical::sha256_hex(line.as_bytes()).as_str())
    );
    let manifest = recovery_core::manifest::RunManifest::from_json_bytes(
        &std::fs::read(recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest)
            .expect("read"),
    )
    .expect("manifest");
    assert!(manifest.pending_rejudge.contains_key("1-0-a0"));
    let operation = admitted.body["operation_id"].as_str().expect("operation");
    let twice = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/rejudgments"),
            Some(COLLECTOR),
            Some(admit.clone()),
        )
        .await;
    assert_eq!(
        twice.status,
        StatusCode::OK,
        "the same predecessor again is idempotent"
    );
    assert_eq!(twice.body["operation_id"].as_str(), Some(operation));
    let other = judge_failed("judge_unparseable");
    let mut another = admit;
    another["predecessor_failure_id"] = json!("f-2");
    another["predecessor_line"] = json!(other);
    let conflict = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/rejudgments"),
            Some(COLLECTOR),
            Some(another),
        )
        .await;
    assert_eq!(conflict.status, StatusCode::CONFLICT, "{}", conflict.body);
    let close = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/rejudgments/{operation}/close"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "outcome": "graded"})),
        )
        .await;
    assert_eq!(close.status, StatusCode::NO_CONTENT);
    let manifest = recovery_core::manifest::RunManifest::from_json_bytes(
        &std::fs::read(recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest)
            .expect("read"),
    )
    .expect("manifest");
    assert!(manifest.pending_rejudge.is_empty());
    let gone = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/rejudgments/{operation}/close"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "outcome": "graded"})),
        )
        .await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_plan_pages_its_rollouts_by_state_and_cursor_and_refuses_a_limit_out_of_range() {
    let app = TestApp::new().await;
    let inventory: Vec<Value> = (0..23)
        .map(|t| json!({"agent_ref": {"name": "math_agent"}, "_ng_task_index": t, "_ng_rollout_index": 0}))
        .collect();
    let mut body = app.create_body();
    body["rows"] = json!(inventory);
    let created = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let run_id = created.body["run_id"].as_str().expect("run").to_owned();
    let lease = app.lease(&run_id, "collector-a").await.body["lease_id"]
        .as_str()
        .expect("lease")
        .to_owned();
    let scored: Vec<i64> = (0..23).filter(|t| t % 3 == 0).collect();
    let ids: Vec<String> = scored.iter().map(|t| format!("{t}-0")).collect();
    let reserved = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/reserve"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_ids": ids})),
        )
        .await;
    assert_eq!(reserved.status, StatusCode::OK, "{}", reserved.body);
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let text: String = scored
        .iter()
        .map(|t| format!("{}\n", json!({"_ng_task_index": t, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id, "reward": 1.0, "response": {"output": [{}], "status": "completed"}})))
        .collect();
    std::fs::write(&paths.output, text).expect("results");
    // Every page of 4 scored rollouts, followed by its cursor, lists them all in inventory order.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let uri = match &cursor {
            Some(c) => format!(
                "/runs/{run_id}/plan?state=scored&limit=4&cursor={}",
                c.replace('|', "%7C")
            ),
            None => format!("/runs/{run_id}/plan?state=scored&limit=4"),
        };
        let page = app.call(Method::GET, &uri, Some(VIEWER), None).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        assert_eq!(
            page.body["state_counts"],
            json!({"scored": 8, "missing": 15})
        );
        let entries = page.body["entries"].as_array().expect("entries");
        assert!(entries.len() <= 4);
        for entry in entries {
            assert_eq!(entry["state"], "scored");
            seen.push(entry["task_index"].as_i64().expect("task"));
        }
        match page.body["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, scored);
    let all = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        (
            all.body["entries"].as_array().map(Vec::len),
            &all.body["next_cursor"]
        ),
        (Some(23), &Value::Null)
    );
    // A plan's cursor continues its own run's plan only: a bare position (what cursors were
    // before), another run's cursor and another list's are refused, never read as an offset
    // (hostile review 54); its own run's is taken with another state too.
    let first = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan?limit=5"),
            Some(VIEWER),
            None,
        )
        .await;
    let own = first.body["next_cursor"]
        .as_str()
        .expect("a cursor")
        .to_owned();
    assert_eq!(own, format!("plan|{run_id}|4"));
    let other_state = app
        .call(
            Method::GET,
            &format!(
                "/runs/{run_id}/plan?state=missing&limit=2&cursor={}",
                own.replace('|', "%7C")
            ),
            Some(VIEWER),
            None,
        )
        .await;
    let tasks: Vec<Option<i64>> = other_state.body["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["task_index"].as_i64())
        .collect();
    assert_eq!(tasks, [Some(5), Some(7)], "{}", other_state.body);
    // A cursor at the largest position lists nothing after it (review 55: it wrapped to the
    // first page).
    let last = app
        .call(
            Method::GET,
            &format!(
                "/runs/{run_id}/plan?cursor=plan%7C{run_id}%7C{}",
                usize::MAX
            ),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        (
            last.status,
            &last.body["entries"],
            &last.body["next_cursor"]
        ),
        (StatusCode::OK, &json!([]), &Value::Null),
        "{}",
        last.body
    );
    let another_run = format!("cursor=plan%7C{}%7C4", "0".repeat(32));
    let another_list = format!("cursor=runs%7C{}", own.replace('|', "%7C"));
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("cursor=abc", "cursor"),
        ("cursor=4", "cursor"),
        (another_run.as_str(), "cursor"),
        (another_list.as_str(), "cursor"),
        ("state=lost", "state"),
    ] {
        let refused = app
            .call(
                Method::GET,
                &format!("/runs/{run_id}/plan?{query}"),
                Some(VIEWER),
                None,
            )
            .await;
        assert_eq!(
            (refused.status, refused.body["code"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some("invalid_request")),
            "{query}: {}",
            refused.body
        );
        assert!(
            refused.body["message"]
                .as_str()
                .is_some_and(|m| m.contains(field)),
            "{query}: {}",
            refused.body
        );
    }
}

#[tokio::test]
async fn classify_plan_and_run_listing_answer_dashboards() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let classified = app.call(Method::POST, "/classify", Some(VIEWER), Some(json!({"rows": [{"_ng_failure_class": "session_lost"}, {"reward": 1.0, "response": {"output": [{}]}}]}))).await;
    assert_eq!(classified.body["decisions"][0]["verdict"], "retry");
    assert_eq!(
        classified.body["decisions"][0]["responsibility"],
        "evaluation"
    );
    assert_eq!(classified.body["decisions"][1]["verdict"], "keep");
    let not_rows = app
        .call(
            Method::POST,
            "/classify",
            Some(VIEWER),
            Some(json!({"rows": [1]})),
        )
        .await;
    assert_eq!(
        (
            not_rows.status,
            not_rows.body["message"]
                .as_str()
                .map(|m| m.starts_with("rows[0]"))
        ),
        (StatusCode::UNPROCESSABLE_ENTITY, Some(true))
    );
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        (
            plan.body["coverage"]["expected"].as_u64(),
            plan.body["coverage"]["successful"].as_u64()
        ),
        (Some(2), Some(2))
    );
    let listed = app
        .call(Method::GET, "/runs?limit=10", Some(VIEWER), None)
        .await;
    assert_eq!(
        listed.body["runs"][0]["run_id"].as_str(),
        Some(run_id.as_str())
    );
    let by_output = app
        .call(
            Method::GET,
            &format!("/runs?output_path={}", app.output().display()),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        by_output.body["runs"][0]["run_id"].as_str(),
        Some(run_id.as_str())
    );
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    std::fs::write(&paths.failures, b"{broken\n").expect("corrupt sidecar");
    let broken = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        (broken.status, broken.body["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("rows_invalid"))
    );
    assert!(
        broken.body["message"]
            .as_str()
            .expect("message")
            .contains("line 1")
    );
    let metrics = app.call(Method::GET, "/metrics", None, None).await;
    assert!(
        metrics
            .body
            .as_str()
            .expect("text")
            .contains("rollout_recovery_http_requests_total")
    );
}

/// serde stops at the first field it cannot take: a body cut short or followed by more text is
/// refused as no JSON (it was refused for an unknown or missing field), and an integer past 64
/// bits is said to be out of range (serde_json reads it as a float and said "floating point").
#[tokio::test]
async fn an_environment_value_of_the_wrong_type_is_refused_without_repeating_it() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let secret = "987654321012";
    // The environment as written in the body.
    let cases = [
        (
            "an integer",
            format!("{{\"API_KEY\": {secret}}}"),
            "environment.API_KEY",
        ),
        (
            "a float",
            format!("{{\"TOKEN\": {secret}.5}}"),
            "environment.TOKEN",
        ),
        (
            "an object",
            format!("{{\"X\": {{\"v\": \"{secret}\"}}}}"),
            "environment.X",
        ),
        (
            "an integer past 64 bits",
            format!("{{\"K\": {secret}{secret}}}"),
            "environment.K",
        ),
        ("not a map", format!("\"{secret}\""), "environment"),
    ];
    for (what, environment_text, field) in cases {
        let mut validate = app.validate_body(0.3, 8000);
        validate["environment"] = json!(null);
        let validate = validate.to_string().replace(
            "\"environment\":null",
            &format!("\"environment\":{environment_text}"),
        );
        let mut create = app.create_body();
        create["environment"] = json!(null);
        let create = create.to_string().replace(
            "\"environment\":null",
            &format!("\"environment\":{environment_text}"),
        );
        for (uri, body) in [
            (format!("/runs/{run_id}/validate"), validate),
            ("/runs".to_owned(), create),
        ] {
            assert!(body.contains(secret), "{what}: the body holds the value");
            let reply = app
                .call_raw(Method::POST, &uri, Some(COLLECTOR), Some(body))
                .await;
            reply.assert_field_refused(field, &format!("{what} {uri}"));
            assert!(
                !reply.body.to_string().contains(secret),
                "{what} {uri}: the refusal repeats the value: {}",
                reply.body
            );
        }
    }
}

/// Request text that reaches a refusal by other ways than a field's type (rows that are not a
/// list, server names read from rows or interpolated from the environment, a policy's unknown
/// kind, query values) is not repeated either: not in the answer, and not in the `invalid`
/// resume events validate records.
#[tokio::test]
async fn refusals_never_repeat_request_text_that_may_be_a_credential() {
    const TOKEN: &str = "TKN3RP6";
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let validate = format!("/runs/{run_id}/validate");
    let with = |pointer: &str, value: Value| {
        let mut body = app.validate_body(0.3, 8000);
        *body.pointer_mut(pointer).expect("a field of the body") = value;
        body
    };
    let with_rows = |rows: Value| {
        let mut body = app.validate_body(0.3, 8000);
        body["rows"] = rows;
        body
    };
    let mut interpolated_name = with(
        "/global_config/math_agent/responses_api_agents/simple_agent/model_server/name",
        json!("${oc.env:DEPLOY}"),
    );
    interpolated_name["environment"]["DEPLOY"] = json!(format!("Bearer {TOKEN}"));
    let cases = [
        (
            "rows that are not a list",
            Method::POST,
            validate.clone(),
            Some(with_rows(json!(format!("Bearer {TOKEN}")))),
        ),
        (
            "a row's agent name",
            Method::POST,
            validate.clone(),
            Some(with_rows(
                json!([{"agent_ref": {"name": format!("Bearer {TOKEN}")}, "_ng_task_index": 0, "_ng_rollout_index": 0}]),
            )),
        ),
        (
            "a row's agent name that is not a string",
            Method::POST,
            validate.clone(),
            Some(with_rows(
                json!([{"agent_ref": {"name": {"api_key": TOKEN}}, "_ng_task_index": 0, "_ng_rollout_index": 0}]),
            )),
        ),
        (
            "a server name interpolated from the environment",
            Method::POST,
            validate.clone(),
            Some(interpolated_name),
        ),
        (
            "a policy's unknown kind",
            Method::POST,
            "/classify".to_owned(),
            Some(
                json!({"rows": [{}], "policy": {"schema_version": 1, "kinds": {"x": format!("Bearer {TOKEN}")}}}),
            ),
        ),
        (
            "a plan state that is none",
            Method::GET,
            format!("/runs/{run_id}/plan?state=Bearer%20{TOKEN}"),
            None,
        ),
        (
            "a time bound that is none",
            Method::GET,
            format!("/drift?from=Bearer%20{TOKEN}"),
            None,
        ),
    ];
    for (case, method, uri, body) in cases {
        let reply = app.call(method, &uri, Some(COLLECTOR), body).await;
        assert!(
            reply.status.is_client_error(),
            "{case}: {} {}",
            reply.status,
            reply.body
        );
        assert!(
            !reply.body.to_string().contains(TOKEN),
            "{case}: {}",
            reply.body
        );
    }
    assert_no_file_holds(app._dir.path(), TOKEN);
}

/// A caller without the role a call needs is refused before its body is read: a viewer's
/// malformed body is 403 (never told what is wrong with a call it may not make, nor its body
/// parsed), as its well-formed one is.
#[tokio::test]
async fn a_caller_without_the_role_is_refused_before_its_body_is_read() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let run = format!("/runs/{run_id}");
    let collector_calls = [
        Method::POST.as_str().to_owned() + " /runs",
        format!("POST {run}/validate"),
        format!("POST {run}/lease"),
        format!("POST {run}/lease/heartbeat"),
        format!("DELETE {run}/lease"),
        format!("POST {run}/attempts/reserve"),
        format!("POST {run}/rejudgments"),
        format!("POST {run}/rejudgments/x/close"),
    ];
    let operator_calls = [
        format!("POST {run}/approvals"),
        format!("POST {run}/attempts/extend"),
        format!("POST {run}/attempts/resubmit"),
        format!("POST {run}/lease/takeover"),
    ];
    let refused = collector_calls
        .iter()
        .chain(&operator_calls)
        .map(|call| (call, VIEWER))
        .chain(operator_calls.iter().map(|call| (call, COLLECTOR)));
    for (call, token) in refused {
        let (method, uri) = call.split_once(' ').expect("method and path");
        let method = Method::from_bytes(method.as_bytes()).expect("method");
        let reply = app
            .call_raw(method, uri, Some(token), Some("{not json".into()))
            .await;
        assert_eq!(
            (reply.status, reply.body["code"].as_str()),
            (StatusCode::FORBIDDEN, Some("forbidden")),
            "{call} as {token}: {}",
            reply.body
        );
    }
    // With the role, the same body is refused for what it is.
    let reply = app
        .call_raw(
            Method::POST,
            &format!("{run}/approvals"),
            Some(OPERATOR),
            Some("{not json".into()),
        )
        .await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.body
    );
}

/// A token sent in a field of another type (a boolean, a number) is refused naming the field and
/// the type it takes, never repeated (collectors log refusals; validate records them).
#[tokio::test]
async fn a_string_in_a_field_of_another_type_is_refused_without_being_repeated() {
    const TOKEN: &str = "TKN7WQ2";
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let mut validate = app.validate_body(0.3, 8000);
    validate["allow_unsafe"] = json!(format!("Bearer {TOKEN}"));
    let mut create = app.create_body();
    create["replace"] = json!(format!("Bearer {TOKEN}"));
    let mut create_timeouts = app.create_body();
    create_timeouts["retry_terminal_timeouts"] = json!(TOKEN);
    let cases = [
        (format!("/runs/{run_id}/validate"), validate, "allow_unsafe"),
        ("/runs".to_owned(), create, "replace"),
        (
            "/runs".to_owned(),
            create_timeouts,
            "retry_terminal_timeouts",
        ),
        (
            format!("/runs/{run_id}/lease"),
            json!({"holder": "c", "host": "h", "pid": TOKEN}),
            "pid",
        ),
    ];
    for (uri, body, field) in cases {
        let reply = app
            .call(Method::POST, &uri, Some(COLLECTOR), Some(body))
            .await;
        reply.assert_field_refused(field, &uri);
        let message = reply.body["message"].as_str().expect("message");
        assert!(
            message.starts_with(&format!("{field}: invalid type: a string, expected ")),
            "{uri}: {message}"
        );
        assert!(
            !reply.body.to_string().contains(TOKEN),
            "{uri}: {}",
            reply.body
        );
    }
    assert_no_file_holds(app._dir.path(), TOKEN);
}

#[tokio::test]
async fn bodies_are_refused_for_what_is_wrong_with_them_first() {
    let app = TestApp::new().await;
    let attempts =
        r#"{"output_path": "o.jsonl", "source_path": "s.jsonl", "max_rollout_attempts": "#;
    let cases = [
        (
            r#"{"a":"#.to_owned(),
            "body: malformed JSON: EOF while parsing",
        ),
        (
            r#"{"output_path": "o.jsonl"} trailing"#.to_owned(),
            "body: malformed JSON: trailing characters",
        ),
        // Every number outside the cap's range is refused with the range, whatever its sign
        // or size (hostile review, stop 27: `-1` was "0 or more" while `0` was the range).
        (
            format!("{attempts}99999999999999999999999}}"),
            "max_rollout_attempts: 99999999999999999999999 is out of range: must be between 1 and 1000000",
        ),
        (
            format!("{attempts}-99999999999999999999999 }}"),
            "max_rollout_attempts: -99999999999999999999999 is out of range: must be between 1 and 1000000",
        ),
        (
            format!("{attempts}-1}}"),
            "max_rollout_attempts: -1 is out of range: must be between 1 and 1000000",
        ),
        (
            format!("{attempts}0}}"),
            "max_rollout_attempts: 0 is out of range: must be between 1 and 1000000",
        ),
        (
            format!("{attempts}1000001}}"),
            "max_rollout_attempts: 1000001 is out of range: must be between 1 and 1000000",
        ),
        (
            format!("{attempts}\"3\"}}"),
            "max_rollout_attempts: got a string: must be an integer between 1 and 1000000",
        ),
        (
            format!("{attempts}[[3]]}}"),
            "max_rollout_attempts: got a list: must be an integer between 1 and 1000000",
        ),
        // Not JSON, and not an object: both said (a byte order mark here).
        (
            "\u{feff}".to_owned(),
            "body: must be a JSON object, and is not JSON: expected value",
        ),
        // A lone surrogate is named as such, whichever half is alone.
        (
            r#"{"output_path": "o\ud800.jsonl", "source_path": "s.jsonl"}"#.to_owned(),
            "output_path: malformed JSON: unexpected end of hex escape at line 1 column 25 (a \\uD800-\\uDFFF escape is half of a surrogate pair: a lone one is no character)",
        ),
        (
            r#"{"output_path": "o\udc00.jsonl", "source_path": "s.jsonl"}"#.to_owned(),
            "output_path: malformed JSON: lone",
        ),
        (
            r#"{"output_path": "o\ud800\u0041.jsonl", "source_path": "s.jsonl"}"#.to_owned(),
            "output_path: malformed JSON: lone leading surrogate in hex escape at line 1 column 30 (a \\uD800",
        ),
        // A number written with a fraction is a float indeed.
        (
            format!("{attempts}1.5}}"),
            "max_rollout_attempts: 1.5 is a float: must be an integer between 1 and 1000000",
        ),
        (
            format!("{attempts}1e3}}"),
            "max_rollout_attempts: 1e+3 is a float: must be an integer between 1 and 1000000",
        ),
    ];
    for (body, said) in cases {
        let reply = app
            .call_raw(Method::POST, "/runs", Some(COLLECTOR), Some(body.clone()))
            .await;
        assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(said)),
            "{body}: {}",
            reply.body
        );
    }
}

/// The standard library's reasons for an integer it cannot read said the same of `-1` and
/// `abc` ("invalid digit found in string"): a refusal names the value and what is wrong.
#[tokio::test]
async fn integer_query_parameters_are_refused_naming_the_value() {
    let app = TestApp::new().await;
    for (query, said) in [
        // Every number outside the range says the range, as `0` does.
        (
            "limit=99999999999999999999",
            "limit: 99999999999999999999 is out of range: must be between 1 and 1000",
        ),
        (
            "limit=-1",
            "limit: -1 is out of range: must be between 1 and 1000",
        ),
        (
            "limit=0",
            "limit: 0 is out of range: must be between 1 and 1000",
        ),
        (
            "limit=1001",
            "limit: 1001 is out of range: must be between 1 and 1000",
        ),
        // A value that is no number is not repeated: it could be a pasted credential.
        (
            "limit=abc",
            "limit: is not an integer (the value is not repeated)",
        ),
        (
            "limit=Bearer%20SKEYQ77",
            "limit: is not an integer (the value is not repeated)",
        ),
        ("limit=1.5", "limit: \"1.5\" is not an integer"),
        ("limit=", "limit: must not be empty (an integer)"),
    ] {
        let reply = app
            .call(Method::GET, &format!("/drift?{query}"), Some(VIEWER), None)
            .await;
        assert_eq!(
            (
                reply.status,
                reply.body["message"].as_str(),
                reply.body["details"]["field"].as_str()
            ),
            (StatusCode::UNPROCESSABLE_ENTITY, Some(said), Some("limit")),
            "{query}"
        );
    }
}

#[tokio::test]
async fn malformed_bodies_unknown_routes_and_oversized_requests_answer_in_the_error_shape() {
    let app = TestApp::with(|config| config.body_limit_bytes = 4096).await;
    let malformed = app
        .call_raw(
            Method::POST,
            "/runs",
            Some(COLLECTOR),
            Some("{not json".into()),
        )
        .await;
    assert_eq!(
        (malformed.status, malformed.body["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("invalid_request"))
    );
    assert!(
        malformed.body["message"]
            .as_str()
            .expect("message")
            .starts_with("body: malformed JSON"),
        "{}",
        malformed.body
    );
    let mut wrong_type = app.create_body();
    wrong_type["output_path"] = json!(5);
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(wrong_type))
        .await;
    assert!(
        reply.body["message"]
            .as_str()
            .expect("message")
            .contains("output_path"),
        "the message names the field: {}",
        reply.body
    );
    let mut missing = app.create_body();
    missing
        .as_object_mut()
        .expect("object")
        .remove("source_path");
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(missing))
        .await;
    assert!(
        reply.body["message"]
            .as_str()
            .expect("message")
            .contains("source_path"),
        "{}",
        reply.body
    );
    let big = json!({"rows": [{"padding": "x".repeat(8192)}]});
    let reply = app
        .call(Method::POST, "/classify", Some(VIEWER), Some(big))
        .await;
    assert_eq!(
        (reply.status, reply.body["code"].as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, Some("payload_too_large"))
    );
    let unknown = app.call(Method::GET, "/nowhere", Some(VIEWER), None).await;
    assert_eq!(
        (unknown.status, unknown.body["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    let bad_query = app
        .call(Method::GET, "/runs?limit=lots", Some(VIEWER), None)
        .await;
    assert_eq!(
        (bad_query.status, bad_query.body["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("invalid_request"))
    );
    assert!(
        bad_query.body["message"]
            .as_str()
            .expect("message")
            .contains("limit"),
        "{}",
        bad_query.body
    );
}

#[tokio::test]
async fn an_approval_is_used_by_the_attempt_reserved_for_it_and_cannot_be_revoked_after() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    let uri = format!("/runs/{run_id}/approvals");
    let approval = json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "the verifier lost the artifact"});
    let granted = app
        .call(Method::POST, &uri, Some(OPERATOR), Some(approval))
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    let reserved = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/reserve"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_ids": ["1-0"]})),
        )
        .await;
    assert_eq!(reserved.body["attempts"]["1-0"], 1);
    let listed = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(listed.body[0]["consumed_by_attempt"], 1, "{}", listed.body);
    let approval_id = granted.body["approval_id"].as_str().expect("id");
    let revoke = app
        .call(
            Method::DELETE,
            &format!("{uri}/{approval_id}"),
            Some(OPERATOR),
            None,
        )
        .await;
    assert_eq!(
        (revoke.status, revoke.body["code"].as_str()),
        (StatusCode::CONFLICT, Some("conflict"))
    );
}

// --- issue 9: the seed's semantics where they were decided differently -----------------------

/// Issue 9, item 1 (facts §17 scenario 31): with the source dataset deleted, a resume refuses
/// and changes nothing; with `allow_unsafe` it resumes as overridden (the saved outcomes
/// reused, the identity unverified from then on).
#[tokio::test]
async fn item_1_scenario_31_a_deleted_source_refuses_and_resumes_overridden_with_allow_unsafe() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    std::fs::remove_file(app.source()).expect("delete the dataset");
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let before = std::fs::read(&paths.manifest).expect("manifest");
    let uri = format!("/runs/{run_id}/validate");
    let refused = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_eq!(
        (refused.status, refused.body["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("invalid_request")),
        "{}",
        refused.body
    );
    assert!(
        refused.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("source_path"))
    );
    assert_eq!(std::fs::read(&paths.manifest).expect("manifest"), before);
    let mut unsafe_body = app.validate_body(0.3, 8000);
    unsafe_body["allow_unsafe"] = json!(true);
    let overridden = app
        .call(Method::POST, &uri, Some(COLLECTOR), Some(unsafe_body))
        .await;
    assert_eq!(overridden.status, StatusCode::OK, "{}", overridden.body);
    assert_eq!(overridden.body["outcome"], "overridden");
    assert_eq!(overridden.body["manifest"]["identity_overridden"], true);
    assert!(
        overridden.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("current input/configuration identity")),
        "{}",
        overridden.body
    );
}

async fn reserve_one(app: &TestApp, run_id: &str, lease: &str) -> Reply {
    app.call(
        Method::POST,
        &format!("/runs/{run_id}/attempts/reserve"),
        Some(COLLECTOR),
        Some(json!({"lease_id": lease, "rollout_ids": ["0-0"]})),
    )
    .await
}

/// Issue 9, item 4 (facts §11.2, §11.6, scenario 30): plans, reservations and validations
/// refuse a run whose materialized inputs no longer match its manifest, that has a draft
/// journal of an older collector beside it, or whose output is gone while its sidecars remain.
#[tokio::test]
async fn item_4_scenario_30_load_time_checks_refuse_plan_reserve_and_validate_of_inconsistent_files()
 {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let lease = app.lease(&run_id, "collector-a").await.body["lease_id"]
        .as_str()
        .expect("lease")
        .to_owned();
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let plan_uri = format!("/runs/{run_id}/plan");
    let mut validate = app.validate_body(0.3, 8000);
    validate["lease_id"] = json!(lease);
    let validate_uri = format!("/runs/{run_id}/validate");
    let refused_code =
        |reply: &Reply| (reply.status, reply.body["code"].as_str().map(str::to_owned));
    let invalid = (StatusCode::CONFLICT, Some("run_files_invalid".to_owned()));

    // Materialized inputs changed under the manifest.
    let rows = std::fs::read(&paths.materialized).expect("rows");
    let mut changed = rows.clone();
    changed.extend_from_slice(b"{\"_ng_task_index\": 9, \"_ng_rollout_index\": 0}\n");
    std::fs::write(&paths.materialized, &changed).expect("change the rows");
    let plan = app.call(Method::GET, &plan_uri, Some(VIEWER), None).await;
    assert_eq!(refused_code(&plan), invalid, "{}", plan.body);
    assert!(
        plan.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("do not match the run manifest"))
    );
    assert_eq!(
        refused_code(&reserve_one(&app, &run_id, &lease).await),
        invalid
    );
    let refused = app
        .call(
            Method::POST,
            &validate_uri,
            Some(COLLECTOR),
            Some(validate.clone()),
        )
        .await;
    assert_eq!(refused.body["code"], "resume_refused", "{}", refused.body);
    assert!(
        refused.body["details"]["mismatches"]
            .to_string()
            .contains("saved_materialized_inputs")
    );
    std::fs::write(&paths.materialized, &rows).expect("restore the rows");

    // A draft dispatch journal of an older collector.
    std::fs::write(&paths.draft_journal, b"{}\n").expect("draft journal");
    assert_eq!(
        refused_code(&app.call(Method::GET, &plan_uri, Some(VIEWER), None).await),
        invalid
    );
    assert_eq!(
        refused_code(&reserve_one(&app, &run_id, &lease).await),
        invalid
    );
    let refused = app
        .call(
            Method::POST,
            &validate_uri,
            Some(COLLECTOR),
            Some(validate.clone()),
        )
        .await;
    assert_eq!(refused_code(&refused), invalid, "{}", refused.body);
    std::fs::remove_file(&paths.draft_journal).expect("remove");

    // The output gone, its sidecars left: never a reuse.
    std::fs::remove_file(&paths.output).expect("remove the output");
    let refused = app
        .call(
            Method::POST,
            &validate_uri,
            Some(COLLECTOR),
            Some(validate.clone()),
        )
        .await;
    assert_eq!(refused_code(&refused), invalid, "{}", refused.body);
    assert!(
        refused.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("missing"))
    );
    assert_eq!(
        refused_code(&app.call(Method::GET, &plan_uri, Some(VIEWER), None).await),
        invalid
    );
    assert_eq!(
        refused_code(&reserve_one(&app, &run_id, &lease).await),
        invalid
    );
    assert!(!paths.output.exists(), "nothing was recreated");
    std::fs::write(&paths.output, b"").expect("restore the output");
    let reused = app
        .call(Method::POST, &validate_uri, Some(COLLECTOR), Some(validate))
        .await;
    assert_eq!(reused.body["outcome"], "reuse", "{}", reused.body);
}

/// A legacy import never writes a manifest it could not read back: a saved attempt whose next
/// number is past the largest a manifest keeps is refused, and nothing is written (hostile
/// review 46: attempt 2^63 - 1 was imported as `next_attempt` 2^63, and the run answered only
/// `manifest_unreadable` from then on).
#[tokio::test]
async fn a_legacy_import_of_an_attempt_with_no_number_after_it_is_refused_and_writes_nothing() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    std::fs::remove_file(&paths.manifest).expect("the manifest is lost");
    std::fs::remove_file(&paths.identity).expect("and its identity");
    std::fs::write(
        &paths.failures,
        format!(
            "{{\"_ng_task_index\": 0, \"_ng_rollout_index\": 0, \"_ng_attempt_index\": {}, \"_ng_failure_class\": \"transport_peer_drop\"}}\n",
            i64::MAX
        ),
    )
    .expect("failures");
    let mut unsafe_body = app.validate_body(0.3, 8000);
    unsafe_body["allow_unsafe"] = json!(true);
    let refused = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(unsafe_body),
        )
        .await;
    assert_code(&refused, StatusCode::CONFLICT, "run_files_invalid");
    assert!(
        refused.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("rollout 0-0")),
        "{}",
        refused.body
    );
    assert!(!paths.manifest.exists(), "a refusal writes nothing");
}

/// Issue 9, item 5 (facts §11.6, scenario 26): saved outcomes without a manifest, resumed with
/// `allow_unsafe`, get the legacy manifest (`legacy_import`, unverified digests, attempts
/// numbered from the saved rows); outcomes that name a run lost their manifest and are refused.
#[tokio::test]
async fn item_5_a_legacy_import_writes_the_legacy_manifest_after_its_checks() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    std::fs::remove_file(&paths.manifest).expect("the manifest is lost");
    std::fs::remove_file(&paths.identity).expect("and its identity");
    // Untagged legacy outcomes: task 0 failed once then succeeded; task 1 never ran.
    std::fs::write(
        &paths.failures,
        b"{\"_ng_task_index\": 0, \"_ng_rollout_index\": 0, \"_ng_failure_class\": \"transport_peer_drop\"}\n",
    )
    .expect("failures");
    std::fs::write(
        &paths.output,
        b"{\"_ng_task_index\": 0, \"_ng_rollout_index\": 0, \"reward\": 1.0, \"response\": {\"output\": [{}], \"status\": \"completed\"}}\n",
    )
    .expect("results");
    let uri = format!("/runs/{run_id}/validate");
    let refused = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_eq!(refused.body["code"], "no_manifest", "{}", refused.body);
    assert!(!paths.manifest.exists(), "a refusal writes nothing");
    let mut unsafe_body = app.validate_body(0.3, 8000);
    unsafe_body["allow_unsafe"] = json!(true);
    let imported = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(unsafe_body.clone()),
        )
        .await;
    assert_eq!(imported.status, StatusCode::OK, "{}", imported.body);
    assert_eq!(imported.body["outcome"], "import_legacy");
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(&paths.manifest).expect("a legacy manifest"))
            .expect("json");
    assert_eq!(manifest["legacy_import"], true);
    assert_eq!(manifest["run_id"], run_id.as_str());
    assert_eq!(
        manifest["next_attempt"],
        json!({"0-0": 2}),
        "failure 0, then success 1"
    );
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        plan.body["state_counts"],
        json!({"scored": 1, "missing": 1}),
        "{}",
        plan.body
    );
    assert_eq!(plan.body["coverage"]["identity_verified"], false);
    // From now on, a resume needs allow_unsafe (the legacy identity is unverified).
    let again = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_eq!(again.body["code"], "resume_refused", "{}", again.body);

    // Outcomes that name a run are that run's: they lost their manifest, never legacy.
    std::fs::remove_file(&paths.manifest).expect("lost again");
    std::fs::write(
        &paths.output,
        format!("{{\"_ng_task_index\": 0, \"_ng_rollout_index\": 0, \"_ng_attempt_index\": 0, \"_ng_run_id\": \"{run_id}\", \"reward\": 1.0}}\n"),
    )
    .expect("tagged results");
    let refused = app
        .call(Method::POST, &uri, Some(COLLECTOR), Some(unsafe_body))
        .await;
    assert_eq!(
        refused.body["code"], "run_files_invalid",
        "{}",
        refused.body
    );
    assert!(
        refused.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("lost their manifest"))
    );
    assert!(!paths.manifest.exists());
}

/// Issue 9, item 6: a credential the configuration reads from the environment is never
/// needed: a run created with it in `environment` is reused by a validate without it.
#[tokio::test]
async fn item_6_a_credential_from_the_environment_is_never_needed_to_resume() {
    let app = TestApp::new().await;
    let mut body = app.create_body();
    body["global_config"]["math_agent"]["responses_api_agents"]["simple_agent"]["sandbox"]["e2b"] =
        json!("${oc.env:E2B_API_KEY}");
    body["environment"]["E2B_API_KEY"] = json!("e2b-live-KEY");
    let created = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body.clone()))
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let run_id = created.body["run_id"].as_str().expect("run");
    let validate = json!({"config": body["config"], "global_config": body["global_config"], "environment": {"NGT_REVIEW_PROMPT": "Be strict."}, "source_path": app.source()});
    let reused = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(validate),
        )
        .await;
    assert_eq!(reused.body["outcome"], "reuse", "{}", reused.body);
    assert_no_file_holds(&app.root, "e2b-live-KEY");
}

/// A state opened but not caught up (the service listens during its start-up reindex) answers
/// only the routes that read no run; the rest are refused 503 `starting`, and a refused change
/// writes nothing. Once start-up is done the run on disk is known and `/readyz` answers 200.
#[tokio::test]
async fn a_service_that_has_not_caught_up_answers_starting_and_changes_nothing() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let rebuilt_dir = tempfile::tempdir().expect("dir");
    let mut config = app.config.clone();
    config.data_dir = rebuilt_dir.path().join("data");
    let opened = recovery_server::open(config, app.clock.clone())
        .await
        .expect("open on a new database");
    let other_output = app.root.join("other/out.jsonl");
    let mut create = app.create_body();
    create["output_path"] = json!(other_output);
    let run_uri = format!("/runs/{run_id}");
    let refused: [(Method, &str, &str, Option<Value>); 5] = [
        (Method::GET, "/readyz", VIEWER, None),
        (Method::GET, &run_uri, VIEWER, None),
        (Method::GET, "/runs", VIEWER, None),
        (Method::POST, "/runs", COLLECTOR, Some(create)),
        (Method::GET, "/ui", VIEWER, None),
    ];
    for (method, uri, token, body) in refused {
        let body = body.map(|b| b.to_string());
        let reply = send(opened.clone(), method.clone(), uri, Some(token), body).await;
        assert_code(&reply, StatusCode::SERVICE_UNAVAILABLE, "starting");
    }
    assert!(
        !other_output.parent().expect("dir").exists(),
        "a create refused while starting writes nothing"
    );
    for uri in ["/healthz", "/metrics", "/openapi.json"] {
        let reply = send(opened.clone(), Method::GET, uri, None, None).await;
        assert_eq!(reply.status, StatusCode::OK, "{uri} while starting");
    }

    recovery_server::catch_up(&opened).await.expect("catch up");
    let ready = send(opened.clone(), Method::GET, "/readyz", None, None).await;
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.body);
    let known = send(opened, Method::GET, &run_uri, Some(VIEWER), None).await;
    assert_eq!(known.status, StatusCode::OK, "{}", known.body);
}
