//! One writer per run: concurrent callers, other processes holding the run's `flock`,
//! replacement, runs the files hold and the database does not, and the form of what is written.

use super::*;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};

/// A Python process holding a `flock` (as a NeMo Gym collector does) until dropped.
struct PythonLock(Child);

impl PythonLock {
    fn hold(path: &Path) -> Self {
        let mut child = Command::new("python3")
            .args([
                "-c",
                "import fcntl, sys\nf = open(sys.argv[1], 'a')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nprint('locked', flush=True)\nsys.stdin.read()",
            ])
            .arg(path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().expect("stdout"))
            .read_line(&mut line)
            .expect("python answers");
        assert_eq!(line.trim(), "locked", "python took the lock");
        Self(child)
    }
}

impl Drop for PythonLock {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether a Python process can take the `flock` now (it releases it at once).
fn python_can_lock(path: &Path) -> bool {
    Command::new("python3")
        .args([
            "-c",
            "import fcntl, sys\nf = open(sys.argv[1], 'a')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)",
        ])
        .arg(path)
        .stderr(Stdio::null())
        .status()
        .expect("python3")
        .success()
}

fn many_rows(count: usize) -> Value {
    Value::Array(
        (0..count)
            .map(|i| json!({"agent_ref": {"name": "math_agent"}, "_ng_task_index": i, "_ng_rollout_index": 0, "question": format!("{i}+1?")}))
            .collect(),
    )
}

pub(crate) fn saved_manifest(app: &TestApp) -> recovery_core::manifest::RunManifest {
    let bytes = std::fs::read(recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest)
        .expect("manifest");
    recovery_core::manifest::RunManifest::from_json_bytes(&bytes).expect("readable manifest")
}

/// Sends every request at once (each on its own task) and answers in request order.
async fn all_at_once(
    app: &TestApp,
    requests: Vec<(Method, String, &'static str, Value)>,
) -> Vec<Reply> {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|(method, uri, token, body)| {
            let state = app.state.clone();
            tokio::spawn(async move {
                send(state, method, &uri, Some(token), Some(body.to_string())).await
            })
        })
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.expect("task"));
    }
    replies
}

/// The ids of a run's drift journal lines, derived as the service derives them.
fn journal_ids(run_id: &str, paths: &recovery_sidecar::SidecarPaths) -> BTreeSet<String> {
    recovery_sidecar::read_lines_at(&paths.resume_drift)
        .expect("journal")
        .iter()
        .map(|(offset, line)| {
            recovery_runs::events::line_id(
                run_id,
                recovery_runs::events::DRIFT_JOURNAL,
                *offset,
                line,
            )
        })
        .collect()
}

async fn create_with_rows(app: &TestApp, rows: Value) -> String {
    let mut body = app.create_body();
    body["rows"] = rows;
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    reply.body["run_id"].as_str().expect("run id").to_owned()
}

async fn lease_id(app: &TestApp, run_id: &str) -> String {
    let lease = app.lease(run_id, "collector-a").await;
    assert_eq!(lease.status, StatusCode::CREATED, "{}", lease.body);
    lease.body["lease_id"].as_str().expect("lease").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reservations_hand_out_each_number_once_and_every_one_reaches_the_manifest() {
    let app = TestApp::new().await;
    let run_id = create_with_rows(&app, many_rows(40)).await;
    let lease = lease_id(&app, &run_id).await;
    let uri = format!("/runs/{run_id}/attempts/reserve");
    let same: Vec<_> = (0..10)
        .map(|_| {
            (
                Method::POST,
                uri.clone(),
                COLLECTOR,
                json!({"lease_id": lease, "rollout_ids": ["0-0"]}),
            )
        })
        .collect();
    let mut numbers: Vec<i64> = all_at_once(&app, same)
        .await
        .iter()
        .map(|r| {
            assert_eq!(r.status, StatusCode::OK, "{}", r.body);
            r.body["attempts"]["0-0"].as_i64().expect("number")
        })
        .collect();
    numbers.sort_unstable();
    assert_eq!(
        numbers,
        (0..10).collect::<Vec<i64>>(),
        "distinct and gapless"
    );
    assert_eq!(saved_manifest(&app).next_attempt.get("0-0"), Some(&10));

    let distinct: Vec<_> = (1..40)
        .map(|i| {
            (
                Method::POST,
                uri.clone(),
                COLLECTOR,
                json!({"lease_id": lease, "rollout_ids": [format!("{i}-0")]}),
            )
        })
        .collect();
    for reply in all_at_once(&app, distinct).await {
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    }
    let manifest = saved_manifest(&app);
    for i in 1..40 {
        assert_eq!(
            manifest.next_attempt.get(&format!("{i}-0")),
            Some(&1),
            "rollout {i}-0 reached the manifest"
        );
    }

    let refused = app
        .call(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_ids": ["0-0", "nope-0"]})),
        )
        .await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        refused.body
    );
    assert_eq!(
        saved_manifest(&app),
        manifest,
        "a refused reserve changes nothing"
    );
}

/// An output from before manifests (materialized inputs and saved outcomes, no manifest) is
/// imported as a legacy run through the API, once whoever asks at the same time (gap review
/// 34: `POST /runs` called it an incomplete cache and offered only a replacement, which sets
/// the results aside): the others are told its run; its resumes need `allow_unsafe`, as the
/// Python module's do, and its plan keeps the saved answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_output_without_a_manifest_is_imported_as_a_legacy_run_once() {
    let app = TestApp::new().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    std::fs::create_dir_all(paths.output.parent().expect("dir")).expect("dir");
    let rows: String = rows()
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| format!("{r}\n"))
        .collect();
    std::fs::write(&paths.materialized, rows).expect("materialized");
    let saved = json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "reward": 1.0,
        "response": {"output": [{"type": "message"}], "status": "completed"}});
    std::fs::write(&paths.output, format!("{saved}\n")).expect("results");
    let output = app.output().display().to_string();
    let refused = app
        .call(
            Method::POST,
            "/runs/import_legacy",
            Some(COLLECTOR),
            Some(json!({"output_path": output, "allow_unsafe": false})),
        )
        .await;
    refused.assert_field_refused("allow_unsafe", "an import without allow_unsafe");
    assert!(!paths.manifest.exists(), "a refusal writes nothing");
    // An output holding nothing: refused before any lock file is made (hostile review 35).
    let empty = app.root.join("nothing/out.jsonl");
    let reply = app
        .call(
            Method::POST,
            "/runs/import_legacy",
            Some(COLLECTOR),
            Some(json!({"output_path": empty, "allow_unsafe": true})),
        )
        .await;
    reply.assert_field_refused("output_path", "an output with nothing saved");
    assert!(!app.root.join("nothing").exists(), "{}", reply.body);
    // Blank lines are nothing saved either (hostile review 36: imported).
    let blank = app.root.join("blank/out.jsonl");
    let blank_paths = recovery_sidecar::SidecarPaths::for_output(&blank);
    std::fs::create_dir_all(app.root.join("blank")).expect("dir");
    std::fs::write(&blank, "\n  \n").expect("blank");
    std::fs::write(&blank_paths.failures, "\n").expect("blank");
    std::fs::write(
        &blank_paths.materialized,
        "{\"_ng_task_index\":0,\"_ng_rollout_index\":0}\n",
    )
    .expect("materialized");
    let reply = app
        .call(
            Method::POST,
            "/runs/import_legacy",
            Some(COLLECTOR),
            Some(json!({"output_path": blank, "allow_unsafe": true})),
        )
        .await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.body
    );
    assert!(!blank_paths.manifest.exists(), "{}", reply.body);
    // Beside a draft dispatch journal, which the plan refuses, nothing is imported.
    std::fs::write(&paths.draft_journal, "{}\n").expect("draft");
    let reply = app
        .call(
            Method::POST,
            "/runs/import_legacy",
            Some(COLLECTOR),
            Some(json!({"output_path": output, "allow_unsafe": true})),
        )
        .await;
    assert_eq!(reply.body["code"], "run_files_invalid", "{}", reply.body);
    std::fs::remove_file(&paths.draft_journal).expect("draft");
    // A manifest naming no run is unreadable, not a run to validate.
    std::fs::write(&paths.manifest, "garbage").expect("manifest");
    for uri in ["/runs/import_legacy", "/runs"] {
        let body = if uri == "/runs" {
            let mut create = app.create_body();
            create["output_path"] = json!(output);
            create
        } else {
            json!({"output_path": output, "allow_unsafe": true})
        };
        let reply = app
            .call(Method::POST, uri, Some(COLLECTOR), Some(body))
            .await;
        assert_eq!(
            reply.body["code"], "manifest_unreadable",
            "{uri}: {}",
            reply.body
        );
    }
    std::fs::remove_file(&paths.manifest).expect("manifest");
    let import = json!({"output_path": output, "allow_unsafe_resume": true});
    let replies = all_at_once(
        &app,
        (0..8)
            .map(|_| {
                (
                    Method::POST,
                    "/runs/import_legacy".to_owned(),
                    COLLECTOR,
                    import.clone(),
                )
            })
            .collect(),
    )
    .await;
    let imported: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .collect();
    assert_eq!(imported.len(), 1, "imported once");
    let run_id = imported[0].body["run_id"].as_str().expect("id").to_owned();
    assert_eq!(imported[0].body["manifest"]["legacy_import"], true);
    for reply in replies.iter().filter(|r| r.status != StatusCode::CREATED) {
        assert_eq!(
            (
                reply.status,
                reply.body["code"].as_str(),
                reply.body["details"]["run_id"].as_str()
            ),
            (
                StatusCode::CONFLICT,
                Some("run_exists"),
                Some(run_id.as_str())
            ),
            "{}",
            reply.body
        );
    }
    assert_eq!(saved_manifest(&app).run_id, run_id);
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
            &plan.body["entries"][0]["state"],
            &plan.body["entries"][1]["state"]
        ),
        (&json!("scored"), &json!("missing")),
        "{}",
        plan.body
    );
    // New outcomes of an imported run carry its id and a reserved attempt: an untagged line is
    // tolerated only as the import found it (hostile review 40: the check admitted one as a
    // new, unreserved attempt 1 that replaced the scored answer).
    let check = format!("/runs/{run_id}/outcomes/check");
    for (line, reason) in [
        (
            json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "reward": 1.0,
                "response": {"output": [{"type": "message"}], "status": "completed"}})
            .to_string(),
            "different_run",
        ),
        (
            json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "reward": 1.0}).to_string(),
            "different_run",
        ),
        (
            json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 1, "_ng_run_id": run_id, "reward": 1.0}).to_string(),
            "unreserved",
        ),
    ] {
        let reply = app
            .call(Method::POST, &check, Some(COLLECTOR), Some(json!({"line": line})))
            .await;
        assert_eq!(
            (reply.status, reply.body["details"]["reason"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some(reason)),
            "{line}: {}",
            reply.body
        );
    }
    let uri = format!("/runs/{run_id}/validate");
    let validate = |allow: bool| {
        let mut body = app.validate_body(0.3, 8000);
        body["allow_unsafe"] = json!(allow);
        app.call(Method::POST, &uri, Some(COLLECTOR), Some(body))
    };
    let unverified = validate(false).await;
    assert_eq!(
        unverified.status,
        StatusCode::CONFLICT,
        "{}",
        unverified.body
    );
    let accepted = validate(true).await;
    assert_eq!(accepted.status, StatusCode::OK, "{}", accepted.body);
    let audit = app
        .state
        .registry
        .store()
        .list_audit(Some(&run_id), 20)
        .await
        .expect("audit");
    let imports: Vec<&str> = audit
        .iter()
        .filter(|a| a.action == "run.import_legacy")
        .map(|a| a.actor.as_str())
        .collect();
    assert_eq!(imports, ["collector-1"], "{audit:?}");
}

/// Concurrent acquires, then releases with the right and wrong lease ids: one lease granted,
/// the coverage snapshot each granted or released lease writes stays one whole JSON document
/// (written inside the run's section, atomically), and a refused release writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn coverage_snapshots_of_concurrent_lease_calls_stay_whole() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let acquire = |n: usize| {
        (
            Method::POST,
            format!("/runs/{run_id}/lease"),
            COLLECTOR,
            json!({"holder": format!("c{n}"), "host": "h", "pid": n, "ttl_seconds": 60}),
        )
    };
    let replies = all_at_once(&app, (0..8).map(acquire).collect()).await;
    let granted: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .collect();
    assert_eq!(granted.len(), 1);
    let lease = granted[0].body["lease_id"].clone();
    let snapshot = || -> Value {
        serde_json::from_slice(&std::fs::read(&paths.coverage).expect("coverage")).expect("whole")
    };
    assert_eq!(snapshot()["run_id"], json!(run_id));
    std::fs::remove_file(&paths.coverage).expect("remove");
    let release = |id: Value| {
        (
            Method::DELETE,
            format!("/runs/{run_id}/lease"),
            COLLECTOR,
            json!({"lease_id": id}),
        )
    };
    let wrong = all_at_once(
        &app,
        (0..4).map(|_| release(json!("not-a-lease"))).collect(),
    )
    .await;
    assert!(wrong.iter().all(|r| r.status == StatusCode::CONFLICT));
    assert!(!paths.coverage.exists(), "a refused release writes nothing");
    let replies = all_at_once(&app, (0..4).map(|_| release(lease.clone())).collect()).await;
    assert_eq!(
        replies
            .iter()
            .filter(|r| r.status == StatusCode::NO_CONTENT)
            .count(),
        1
    );
    assert_eq!(snapshot()["expected"], json!(2));
}

/// Concurrent resumes opting in to retrying terminal timeouts, half of them across drift:
/// each answered, the manifest keeps the opt-in (written once, under the run's lock), one
/// audit entry, and every drift journalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_resumes_opting_in_to_timeout_retries_write_it_once() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let requests = (0..12)
        .map(|n| {
            let mut body = app.validate_body(0.3, if n % 2 == 0 { 8000 } else { 8100 + n });
            body["config"]["retry_terminal_timeouts"] = json!(true);
            (
                Method::POST,
                format!("/runs/{run_id}/validate"),
                COLLECTOR,
                body,
            )
        })
        .collect();
    let replies = all_at_once(&app, requests).await;
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        assert_eq!(reply.body["manifest"]["retry_terminal_timeouts"], true);
    }
    assert!(saved_manifest(&app).retry_terminal_timeouts);
    let audit = app
        .state
        .registry
        .store()
        .list_audit(Some(&run_id), 100)
        .await
        .expect("audit");
    assert_eq!(
        audit
            .iter()
            .filter(|a| a.action == "run.retry_terminal_timeouts")
            .count(),
        1,
        "{audit:?}"
    );
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    assert_eq!(
        journal_ids(&run_id, &paths).len(),
        6,
        "every drift journalled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_admissions_of_one_rejudgment_open_it_once() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    // Rollout 1-0's grade failed after the model answered (instead of its masked result).
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let results = std::fs::read_to_string(&paths.output).expect("results");
    let first = results.lines().next().expect("0-0's result");
    std::fs::write(&paths.output, format!("{first}\n")).expect("results");
    let line = json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id,
        "_ng_failure_class": "judge_failed", "_ng_failure_terminal": false,
        "response": {"output": [{"type": "message"}], "status": "completed"}})
    .to_string();
    std::fs::write(&paths.failures, format!("{line}\n")).expect("failures");
    let admit = json!({"lease_id": lease, "rollout_id": "1-0", "attempt": 0, "predecessor_failure_id": "f-1", "predecessor_line": line});
    let replies = all_at_once(
        &app,
        (0..12)
            .map(|_| {
                (
                    Method::POST,
                    format!("/runs/{run_id}/rejudgments"),
                    COLLECTOR,
                    admit.clone(),
                )
            })
            .collect(),
    )
    .await;
    let statuses: Vec<StatusCode> = replies.iter().map(|r| r.status).collect();
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == StatusCode::CREATED)
            .count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == StatusCode::OK).count(),
        11,
        "{statuses:?}"
    );
    let operations: BTreeSet<&str> = replies
        .iter()
        .filter_map(|r| r.body["operation_id"].as_str())
        .collect();
    assert_eq!(operations.len(), 1, "one operation: {operations:?}");
    let open = app
        .state
        .registry
        .store()
        .list_rejudgments(&run_id)
        .await
        .expect("rows");
    assert_eq!(open.iter().filter(|r| r.closed_at.is_none()).count(), 1);
    assert_eq!(saved_manifest(&app).pending_rejudge.len(), 1);
}

/// A collector taking its run's `flock` without waiting and releasing it, 100,000 times: prints
/// `start`, then how many times it was refused.
const COLLECTOR_CYCLING_ITS_LOCK: &str = r"
import fcntl, sys
f = open(sys.argv[1], 'a')
print('start', flush=True)
refused = 0
for _ in range(100000):
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f, fcntl.LOCK_UN)
    except BlockingIOError:
        refused += 1
print(refused, flush=True)
";

/// Asking who holds a run never takes its `flock`: a Python collector taking and releasing the
/// lock without waiting, over and over while dashboards ask, is never refused; a holder is
/// still reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_who_holds_a_run_never_takes_its_lock_from_a_collector() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let uri = format!("/runs/{run_id}/lease");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let askers: Vec<_> = (0..4)
        .map(|_| {
            let (state, uri, stop, answered) = (
                app.state.clone(),
                uri.clone(),
                stop.clone(),
                answered.clone(),
            );
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let reply = send(state.clone(), Method::GET, &uri, Some(VIEWER), None).await;
                    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
                    answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            })
        })
        .collect();
    let mut collector = Command::new("python3")
        .args(["-c", COLLECTOR_CYCLING_ITS_LOCK])
        .arg(&paths.run_lock)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut lines = BufReader::new(collector.stdout.take().expect("stdout")).lines();
    let (started, refused) = tokio::task::spawn_blocking({
        let answered = answered.clone();
        move || {
            let start = lines.next().expect("a line").expect("start");
            assert_eq!(start, "start");
            let before = answered.load(std::sync::atomic::Ordering::Relaxed);
            let refused: usize = lines
                .next()
                .expect("a line")
                .expect("count")
                .parse()
                .expect("a count");
            let during = answered.load(std::sync::atomic::Ordering::Relaxed) - before;
            (during, refused)
        }
    })
    .await
    .expect("reader");
    collector.wait().expect("python3");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for asker in askers {
        asker.await.expect("asker");
    }
    assert!(
        started >= 20,
        "the holder was asked {started} times meanwhile"
    );
    assert_eq!(
        refused, 0,
        "the collector was refused its lock {refused} times"
    );
    let python = PythonLock::hold(&paths.run_lock);
    let held = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(
        held.body["locked_outside_service"],
        json!(true),
        "{}",
        held.body
    );
    drop(python);
    let free = app.call(Method::GET, &uri, Some(VIEWER), None).await;
    assert_eq!(
        free.body["locked_outside_service"],
        json!(false),
        "{}",
        free.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_are_refused_while_a_python_collector_owns_the_run_lock() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let manifest_before = std::fs::read(&paths.manifest).expect("manifest");
    let python = PythonLock::hold(&paths.run_lock);
    let mut unsafe_body = app.validate_body(0.9, 8000);
    unsafe_body["allow_unsafe"] = json!(true);
    let attempts = [
        (
            "an allow_unsafe override",
            format!("/runs/{run_id}/validate"),
            COLLECTOR,
            unsafe_body,
        ),
        (
            "an operational-drift resume",
            format!("/runs/{run_id}/validate"),
            COLLECTOR,
            app.validate_body(0.3, 9999),
        ),
        (
            "an attempt extension",
            format!("/runs/{run_id}/attempts/extend"),
            OPERATOR,
            json!({"extend_attempts": 1, "reason": "outage"}),
        ),
    ];
    for (case, uri, token, body) in attempts {
        let reply = app.call(Method::POST, &uri, Some(token), Some(body)).await;
        assert_eq!(reply.status, StatusCode::LOCKED, "{case}: {}", reply.body);
        assert_eq!(reply.body["code"], "run_locked", "{case}");
    }
    let held = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/lease"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        held.body["locked_outside_service"],
        json!(true),
        "{}",
        held.body
    );
    assert_eq!(
        std::fs::read(&paths.manifest).expect("manifest"),
        manifest_before,
        "the manifest is untouched"
    );
    assert!(
        !paths.resume_drift.exists() && !paths.attempt_extension.exists(),
        "no journal line"
    );
    drop(python);
    let resumed = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 9999)),
        )
        .await;
    assert_eq!(
        resumed.body["outcome"], "resume_with_drift",
        "{}",
        resumed.body
    );
}

/// A lease asked for a run while it is replaced never outlives the replacement: collectors
/// acquiring and releasing the old run in a loop while an operator replaces it get leases
/// before, `run_superseded` after, and the new run's collector gets its run (hostile review
/// 33: an acquire that passed the route's check just before the replacement leased the old
/// run, holding the new run's lock with it; a takeover too).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_racing_a_replacement_never_holds_the_new_runs_lock() {
    let app = TestApp::new().await;
    let old = app.create().await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loops: Vec<_> = (0..6)
        .map(|n| {
            let (state, old, stop) = (app.state.clone(), old.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut granted = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let acquire = json!({"holder": format!("looper-{n}"), "host": "h", "pid": n, "ttl_seconds": 60});
                    let reply = send(
                        state.clone(),
                        Method::POST,
                        &format!("/runs/{old}/lease"),
                        Some(COLLECTOR),
                        Some(acquire.to_string()),
                    )
                    .await;
                    if let Some(lease) = reply.body["lease_id"].as_str() {
                        granted += 1;
                        send(
                            state.clone(),
                            Method::DELETE,
                            &format!("/runs/{old}/lease"),
                            Some(COLLECTOR),
                            Some(json!({"lease_id": lease}).to_string()),
                        )
                        .await;
                    } else if reply.body["code"] == "run_superseded" {
                        return granted;
                    }
                }
                granted
            })
        })
        .collect();
    let mut body = app.create_body();
    body["replace"] = json!(true);
    let new = loop {
        let reply = app
            .call(Method::POST, "/runs", Some(OPERATOR), Some(body.clone()))
            .await;
        if reply.status == StatusCode::CREATED {
            break reply.body["run_id"].as_str().expect("id").to_owned();
        }
        assert_eq!(reply.body["code"], "run_locked", "{}", reply.body);
    };
    // Every looper sees the replacement (its next acquire is refused) unless stopped.
    for task in loops {
        tokio::time::timeout(std::time::Duration::from_secs(60), task)
            .await
            .expect("a looper saw the replacement")
            .expect("looper");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let leased = app.lease(&new, "new-collector").await;
    assert_eq!(leased.status, StatusCode::CREATED, "{}", leased.body);
    // The lease manager itself refuses the old run once it holds the flock: a request that
    // passed the route's check just before the replacement (acquire and takeover alike).
    app.call(
        Method::DELETE,
        &format!("/runs/{new}/lease"),
        Some(COLLECTOR),
        Some(json!({"lease_id": leased.body["lease_id"]})),
    )
    .await;
    let request = recovery_runs::leases::LeaseRequest {
        actor: "alice".into(),
        run_id: old.clone(),
        holder: "late".into(),
        host: "h".into(),
        pid: 1,
        ttl: time::Duration::MINUTE,
        lock_paths: vec![recovery_sidecar::SidecarPaths::for_output(&app.output()).run_lock],
    };
    let acquired = app.state.leases.acquire(&request).await;
    assert!(
        matches!(&acquired, Err(recovery_runs::leases::LeaseError::Superseded { successor, .. }) if *successor == new),
        "{acquired:?}"
    );
    let taken = app.state.leases.takeover("alice", "r", &request).await;
    assert!(
        matches!(
            &taken,
            Err(recovery_runs::leases::LeaseError::Superseded { .. })
        ),
        "{taken:?}"
    );
    let leased = app.lease(&new, "new-collector").await;
    assert_eq!(leased.status, StatusCode::CREATED, "{}", leased.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replacements_in_one_second_keep_every_saved_result_and_a_manifest() {
    let app = TestApp::new().await;
    let first = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    std::fs::write(&paths.output, "{\"saved\": \"first run\"}\n").expect("results");
    let mut body = app.create_body();
    body["replace"] = json!(true);
    let replies = all_at_once(
        &app,
        vec![
            (Method::POST, "/runs".into(), OPERATOR, body.clone()),
            (Method::POST, "/runs".into(), OPERATOR, body),
        ],
    )
    .await;
    let mut moved = BTreeSet::new();
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
        for name in reply.body["replaced"].as_array().expect("replaced") {
            assert!(
                moved.insert(name.as_str().expect("name").to_owned()),
                "{name} was moved to twice"
            );
        }
    }
    let saved: Vec<String> = moved
        .iter()
        .filter(|name| name.contains("out.jsonl.replaced-"))
        .map(|name| std::fs::read_to_string(name).expect("moved result"))
        .collect();
    assert!(
        saved.iter().any(|text| text.contains("first run")),
        "the first run's result survives: {saved:?}"
    );
    let current = saved_manifest(&app).run_id;
    let ids: BTreeSet<String> = replies
        .iter()
        .map(|r| r.body["run_id"].as_str().expect("id").to_owned())
        .collect();
    assert!(
        ids.contains(&current),
        "the manifest on disk is one of the answered runs"
    );
    let lookup = app
        .call(
            Method::GET,
            &format!("/runs?output_path={}", app.output().display()),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        lookup.body["runs"][0]["run_id"].as_str(),
        Some(current.as_str()),
        "{}",
        lookup.body
    );
    for old in ids.iter().filter(|id| **id != current).chain([&first]) {
        let reply = app
            .call(Method::GET, &format!("/runs/{old}"), Some(VIEWER), None)
            .await;
        assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.body);
        assert_eq!(reply.body["code"], "run_superseded");
    }
}

/// Hostile review 39: a plan read while its run was being replaced answered `no_manifest`,
/// `run_files_invalid` or `manifest_unreadable` (the files halfway moved aside), which read as
/// damage to a dashboard. A reader sees the files before or after a replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plans_read_beside_replacements_answer_a_whole_run_or_run_superseded() {
    const REPLACEMENTS: usize = 40;
    let app = Arc::new(TestApp::new().await);
    let first = app.create().await;
    let known = Arc::new(std::sync::Mutex::new(vec![first]));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let replacer = {
        let (app, known, done) = (app.clone(), known.clone(), done.clone());
        tokio::spawn(async move {
            let mut body = app.create_body();
            body["replace"] = json!(true);
            for _ in 0..REPLACEMENTS {
                let reply = app
                    .call(Method::POST, "/runs", Some(OPERATOR), Some(body.clone()))
                    .await;
                assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
                let id = reply.body["run_id"].as_str().expect("id").to_owned();
                known.lock().expect("ids").push(id);
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    };
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (app, known, done) = (app.clone(), known.clone(), done.clone());
            tokio::spawn(async move {
                let mut answers: BTreeMap<(u16, String), usize> = BTreeMap::new();
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    let newest = known.lock().expect("ids").last().cloned().expect("an id");
                    let reply = app
                        .call(
                            Method::GET,
                            &format!("/runs/{newest}/plan"),
                            Some(VIEWER),
                            None,
                        )
                        .await;
                    let code = reply.body["code"].as_str().unwrap_or("").to_owned();
                    let whole = reply.status == StatusCode::OK
                        || (reply.status == StatusCode::CONFLICT && code == "run_superseded");
                    assert!(whole, "{}: {}", reply.status, reply.body);
                    *answers.entry((reply.status.as_u16(), code)).or_default() += 1;
                }
                answers
            })
        })
        .collect();
    replacer.await.expect("replacer");
    let mut plans = 0;
    for reader in readers {
        let answers = reader.await.expect("reader");
        plans += answers.get(&(200, String::new())).copied().unwrap_or(0);
    }
    assert!(plans > 0, "some plans were read during the replacements");
    // Every replaced run names the run that owns the output now, not its own successor
    // (hostile review 39: following `superseded_by` once led to another `run_superseded`).
    let known = known.lock().expect("ids").clone();
    let (owner, replaced) = known.split_last().expect("ids");
    for (i, old) in replaced.iter().enumerate() {
        let reply = if i % 2 == 0 {
            app.call(Method::GET, &format!("/runs/{old}"), Some(VIEWER), None)
                .await
        } else {
            app.lease(old, "late-collector").await
        };
        assert_eq!(
            (
                reply.status,
                reply.body["details"]["superseded_by"].as_str()
            ),
            (StatusCode::CONFLICT, Some(owner.as_str())),
            "{old}: {}",
            reply.body
        );
    }
}

/// Hostile review 39: racing creates of outputs that share their companions (`out.jsonl`,
/// `out.json`, `out.txt`, `out`) answered the losers 422 `manifest_unreadable` ("restore it, or
/// replace it"), about the winner's healthy manifest. Each loser is told what a create sent
/// after the winner is told: the run exists (its own output), or the companions are another
/// output's run's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_creates_of_outputs_sharing_companions_create_one_run_and_name_it_to_the_rest() {
    let app = TestApp::new().await;
    let dir = app.output().parent().expect("dir").to_owned();
    let names = ["out.jsonl", "out.json", "out.txt", "out"];
    let requests = (0..16)
        .map(|i| {
            let mut body = app.create_body();
            body["output_path"] = json!(dir.join(names[i % names.len()]));
            (Method::POST, "/runs".to_owned(), COLLECTOR, body)
        })
        .collect();
    let replies = all_at_once(&app, requests).await;
    let created: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .collect();
    assert_eq!(created.len(), 1, "one run is created");
    let winner = created[0].body["run_id"].as_str().expect("id");
    let winner_output = created[0].body["output_path"].as_str().expect("output");
    for (i, reply) in replies.iter().enumerate() {
        if reply.status == StatusCode::CREATED {
            continue;
        }
        let output = dir.join(names[i % names.len()]);
        let code = reply.body["code"].as_str().unwrap_or("");
        if output.to_str() == Some(winner_output) {
            assert_eq!(
                (reply.status, code),
                (StatusCode::CONFLICT, "run_exists"),
                "{}",
                reply.body
            );
        } else {
            assert_eq!(
                (reply.status, code, reply.body["details"]["field"].as_str()),
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "path_refused",
                    Some("output_path")
                ),
                "{}: {}",
                output.display(),
                reply.body
            );
            let message = reply.body["message"].as_str().unwrap_or("");
            assert!(message.contains(winner), "{message} names {winner}");
        }
    }
}

/// Two outputs of one directory where one is the other's file (`q_failures.jsonl` is the
/// failures sidecar of `q.jsonl`; the materialized inputs and drift journal too), created at the
/// same moment: one run is created and the other create is refused naming `output_path`,
/// having written nothing (hostile review 55, F6: both were created, in 21 of 40 pairs, and two
/// runs wrote one file).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_creates_of_an_output_and_another_outputs_companion_create_one_run() {
    let app = TestApp::new().await;
    let dir = app.output().parent().expect("dir").to_owned();
    let suffixes = [
        "_failures.jsonl",
        "_materialized_inputs.jsonl",
        "_manifest_resume_drift.jsonl",
    ];
    for round in 0..4 {
        let pairs: Vec<(std::path::PathBuf, std::path::PathBuf)> = suffixes
            .iter()
            .enumerate()
            .map(|(k, suffix)| {
                let stem = format!("r{round}k{k}");
                (
                    dir.join(format!("{stem}.jsonl")),
                    dir.join(format!("{stem}{suffix}")),
                )
            })
            .collect();
        let requests = pairs
            .iter()
            .flat_map(|(output, companion)| [output, companion])
            .map(|output| {
                let mut body = app.create_body();
                body["output_path"] = json!(output);
                (Method::POST, "/runs".to_owned(), COLLECTOR, body)
            })
            .collect();
        let replies = all_at_once(&app, requests).await;
        for (pair, replies) in pairs.iter().zip(replies.chunks(2)) {
            let outputs = [&pair.0, &pair.1];
            let created: Vec<usize> = (0..2)
                .filter(|&i| replies[i].status == StatusCode::CREATED)
                .collect();
            assert_eq!(created.len(), 1, "{pair:?}: one of the two is created");
            let refused = &replies[1 - created[0]];
            assert_eq!(
                (
                    refused.status,
                    refused.body["code"].as_str(),
                    refused.body["details"]["field"].as_str()
                ),
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    Some("path_refused"),
                    Some("output_path")
                ),
                "{pair:?}: {}",
                refused.body
            );
            let loser = recovery_sidecar::SidecarPaths::for_output(outputs[1 - created[0]]);
            assert!(
                !loser.manifest.exists() && !loser.identity.exists(),
                "{pair:?}: the refused create wrote nothing"
            );
        }
    }
}

/// An import refuses what a create refuses: an output that is another run's companion (run t's
/// coverage snapshot, which t rewrites at its next lease), and one whose companion is another
/// run's output (review 57, M4, M5: an import shared files with a run and lost its outcome when
/// the run rewrote it). A create whose companion is its own source dataset is refused before it
/// moves the dataset aside as a stale companion (M1). Nothing is written by any of them.
#[tokio::test]
async fn an_import_or_a_create_never_takes_another_runs_files_or_its_own_dataset() {
    let app = TestApp::new().await;
    let dir = app.root.join("shared");
    std::fs::create_dir_all(&dir).expect("dir");
    for output in ["t.jsonl", "q_run.lock"] {
        let mut body = app.create_body();
        body["output_path"] = json!(dir.join(output));
        let created = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_eq!(
            created.status,
            StatusCode::CREATED,
            "{output}: {}",
            created.body
        );
    }
    let saved = json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "reward": 1.0});
    for output in ["t_coverage.json", "q.jsonl"] {
        let output = dir.join(output);
        std::fs::write(&output, format!("{saved}\n")).expect("a legacy outcome");
        let inputs: String = rows()
            .as_array()
            .expect("rows")
            .iter()
            .map(|r| format!("{r}\n"))
            .collect();
        let materialized = recovery_sidecar::SidecarPaths::for_output(&output).materialized;
        std::fs::write(&materialized, inputs).expect("materialized");
        let before = std::fs::read(&output).expect("read");
        let refused = app
            .call(
                Method::POST,
                "/runs/import_legacy",
                Some(COLLECTOR),
                Some(json!({"output_path": output, "allow_unsafe": true})),
            )
            .await;
        assert_eq!(
            (refused.status, refused.body["code"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some("path_refused")),
            "{}: {}",
            output.display(),
            refused.body
        );
        let paths = recovery_sidecar::SidecarPaths::for_output(&output);
        assert!(!paths.manifest.exists(), "{}", output.display());
        assert_eq!(std::fs::read(&output).expect("read"), before);
    }
    let dataset = dir.join("x_attempts.jsonl");
    std::fs::write(&dataset, b"{\"q\": 1}\n").expect("dataset");
    let mut body = app.create_body();
    body["output_path"] = json!(dir.join("x.jsonl"));
    body["source_path"] = json!(dataset);
    let refused = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(
        (refused.status, refused.body["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("path_refused")),
        "{}",
        refused.body
    );
    assert!(
        refused.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("is the source dataset")),
        "{}",
        refused.body
    );
    assert!(dataset.is_file(), "the dataset stays where it is");
}

/// An import racing a create of an output that is its companion (its failures sidecar, its
/// lock file): one of the two takes the files, the other is refused (an import takes the same
/// directory lock a create takes, and checks under it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_import_racing_a_create_of_its_companion_leaves_one_run() {
    let app = TestApp::new().await;
    let dir = app.root.join("raced");
    std::fs::create_dir_all(&dir).expect("dir");
    let inputs: String = rows()
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| format!("{r}\n"))
        .collect();
    let saved = json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "reward": 1.0});
    for round in 0..6 {
        let legacy = dir.join(format!("i{round}.jsonl"));
        let paths = recovery_sidecar::SidecarPaths::for_output(&legacy);
        std::fs::write(&legacy, format!("{saved}\n")).expect("a legacy outcome");
        std::fs::write(&paths.materialized, &inputs).expect("materialized");
        let companion = if round % 2 == 0 {
            &paths.run_lock
        } else {
            &paths.failures
        };
        let mut create = app.create_body();
        create["output_path"] = json!(companion);
        let replies = all_at_once(
            &app,
            vec![
                (
                    Method::POST,
                    "/runs/import_legacy".to_owned(),
                    COLLECTOR,
                    json!({"output_path": legacy, "allow_unsafe": true}),
                ),
                (Method::POST, "/runs".to_owned(), COLLECTOR, create),
            ],
        )
        .await;
        let created = replies
            .iter()
            .filter(|r| r.status == StatusCode::CREATED)
            .count();
        assert_eq!(
            created,
            1,
            "{}: {:?}",
            companion.display(),
            replies.iter().map(|r| &r.body).collect::<Vec<_>>()
        );
    }
}

#[tokio::test]
async fn a_new_run_on_a_known_output_supersedes_the_record_and_the_service_starts_again() {
    let app = TestApp::new().await;
    let first = app.create().await;
    // The output directory is deleted and recreated, then a run is created there again.
    std::fs::remove_dir_all(app.output().parent().expect("dir")).expect("delete");
    let second = app.create().await;
    let old = app
        .call(Method::GET, &format!("/runs/{first}"), Some(VIEWER), None)
        .await;
    assert_eq!(old.status, StatusCode::CONFLICT, "{}", old.body);
    assert_eq!(
        old.body["details"]["superseded_by"].as_str(),
        Some(second.as_str())
    );
    // The list shows both with the output they wrote (hostile review 32: the superseded one
    // showed an internal `#superseded-by-...` suffix).
    let listed = app.call(Method::GET, "/runs", Some(VIEWER), None).await;
    let output = app.output().display().to_string();
    for (run, successor) in [(&first, json!(second)), (&second, json!(null))] {
        let record = listed.body["runs"]
            .as_array()
            .and_then(|runs| runs.iter().find(|r| r["run_id"] == json!(run)))
            .unwrap_or_else(|| panic!("{run} listed: {}", listed.body));
        assert_eq!(
            (&record["output_path"], &record["superseded_by"]),
            (&json!(output), &successor),
            "{}",
            listed.body
        );
    }
    // A Python collector starts fresh on the same output: a new manifest with a new run id.
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let mut python = saved_manifest(&app);
    python.run_id = recovery_sidecar::new_id();
    std::fs::write(&paths.manifest, python.to_pretty_json().expect("json"))
        .expect("python manifest");
    let lookup = app
        .call(
            Method::GET,
            &format!("/runs?output_path={}", app.output().display()),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        lookup.body["runs"][0]["run_id"].as_str(),
        Some(python.run_id.as_str()),
        "{}",
        lookup.body
    );
    let validate = app
        .call(
            Method::POST,
            &format!("/runs/{second}/validate"),
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_eq!(
        validate.body["code"], "run_superseded",
        "never `reuse` for another run's manifest: {}",
        validate.body
    );
    // Without a lookup first: another fresh start, then the old id is used directly.
    let mut again = python.clone();
    again.run_id = recovery_sidecar::new_id();
    std::fs::write(&paths.manifest, again.to_pretty_json().expect("json"))
        .expect("python manifest");
    for (uri, body) in [
        (
            format!("/runs/{}/validate", python.run_id),
            app.validate_body(0.3, 8000),
        ),
        (
            format!("/runs/{}/attempts/extend", python.run_id),
            json!({"extend_attempts": 1, "reason": "outage"}),
        ),
    ] {
        let reply = app
            .call(Method::POST, &uri, Some(OPERATOR), Some(body))
            .await;
        assert_eq!(
            reply.body["code"], "run_superseded",
            "{uri}: {}",
            reply.body
        );
        assert_eq!(
            reply.body["details"]["superseded_by"].as_str(),
            Some(again.run_id.as_str())
        );
    }
    let restarted = recovery_server::start(app.config.clone(), app.clock.clone()).await;
    assert!(
        restarted.is_ok(),
        "the service starts again: {:?}",
        restarted.err()
    );
}

#[tokio::test]
async fn a_run_written_by_a_python_collector_resolves_at_once() {
    let app = TestApp::new().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    std::fs::create_dir_all(app.output().parent().expect("dir")).expect("dir");
    std::fs::write(
        &paths.materialized,
        "{\"_ng_task_index\": 0, \"_ng_rollout_index\": 0}\n",
    )
    .expect("rows");
    let manifest = recovery_core::manifest::RunManifest::create(
        recovery_sidecar::new_id(),
        "s",
        "m",
        "c",
        Some(3),
    );
    std::fs::write(&paths.manifest, manifest.to_pretty_json().expect("json")).expect("manifest");
    let mut body = app.create_body();
    body.as_object_mut().expect("object").remove("rows");
    let exists = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(exists.status, StatusCode::CONFLICT, "{}", exists.body);
    assert_eq!(
        exists.body["details"]["run_id"].as_str(),
        Some(manifest.run_id.as_str())
    );
    let run = app
        .call(
            Method::GET,
            &format!("/runs/{}", manifest.run_id),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        run.status,
        StatusCode::OK,
        "the id the service answered resolves: {}",
        run.body
    );
}

#[tokio::test]
async fn create_refuses_what_the_planner_or_another_run_would_refuse_and_writes_nothing() {
    let app = TestApp::new().await;
    let beside = app.root.join("exp/a.jsonl");
    let mut taken = app.create_body();
    taken["output_path"] = json!(beside);
    assert_eq!(
        app.call(Method::POST, "/runs", Some(COLLECTOR), Some(taken))
            .await
            .status,
        StatusCode::CREATED
    );
    // Companions created first as outputs: one moved aside on a replacement, and two never
    // moved, the lock file and the classification policy (review 56, N2: those two were missed).
    for companion in [
        "other/c_failures.jsonl",
        "other/l_run.lock",
        "other/p_failure_classification.json",
    ] {
        let mut companion_first = app.create_body();
        companion_first["output_path"] = json!(app.root.join(companion));
        assert_eq!(
            app.call(
                Method::POST,
                "/runs",
                Some(COLLECTOR),
                Some(companion_first)
            )
            .await
            .status,
            StatusCode::CREATED,
            "{companion}"
        );
    }
    std::fs::create_dir_all(app.root.join("exp/dir.jsonl")).expect("dir");
    let row = |extra: Value| {
        let mut row = json!({"agent_ref": {"name": "math_agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0});
        for (k, v) in extra.as_object().expect("object") {
            row[k] = v.clone();
        }
        row
    };
    let cases: Vec<(&str, Value, Value, &str)> = vec![
        (
            "duplicate logical ids",
            json!(app.output()),
            json!([row(json!({})), row(json!({}))]),
            "Duplicate logical rollout id",
        ),
        (
            "a non-integer index",
            json!(app.output()),
            json!([row(json!({"_ng_task_index": "1"}))]),
            "_ng_task_index",
        ),
        (
            "a rollout id outside the grammar",
            json!(app.output()),
            json!([row(json!({"_ng_rollout_id": "../bad"}))]),
            "rows[0]",
        ),
        (
            "no index and no id",
            json!(app.output()),
            json!([{"question": "?"}]),
            "rows[0]",
        ),
        (
            "the source dataset as output",
            json!(app.source()),
            rows(),
            "source dataset",
        ),
        (
            "a directory as output",
            json!(app.root.join("exp/dir.jsonl")),
            rows(),
            "directory",
        ),
        (
            "another run's companion as output",
            json!(app.root.join("exp/a_failures.jsonl")),
            rows(),
            "companion",
        ),
        (
            "an output named as a manifest, with no run beside it",
            json!(app.root.join("lone/y_manifest.json")),
            rows(),
            "_manifest.json",
        ),
        (
            "an output named as a set-aside manifest",
            json!(app.root.join("lone/y_manifest.json.replaced-1700000000")),
            rows(),
            "_manifest.json.replaced-",
        ),
        (
            "an output whose companion is another run's output",
            json!(app.root.join("other/c.jsonl")),
            rows(),
            "companion",
        ),
        (
            "an output whose lock file is another run's output",
            json!(app.root.join("other/l.jsonl")),
            rows(),
            "companion",
        ),
        (
            "an output whose classification policy is another run's output",
            json!(app.root.join("other/p.jsonl")),
            rows(),
            "companion",
        ),
    ];
    let before = files_under(&app.root);
    for (case, output, rows, named) in cases {
        let mut body = app.create_body();
        body["output_path"] = output;
        body["rows"] = rows;
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_eq!(reply.status.as_u16() / 100, 4, "{case}: {}", reply.body);
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| m.contains(named)),
            "{case}: {}",
            reply.body
        );
        assert_eq!(
            files_under(&app.root),
            before,
            "{case}: nothing is written, no lock file either"
        );
    }
    let mut without_rows = app.create_body();
    without_rows.as_object_mut().expect("object").remove("rows");
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(without_rows))
        .await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "no leftover rows are used silently: {}",
        reply.body
    );
}

/// Outputs whose names share a prefix (`results.jsonl`, `results.v2.jsonl`, `out.jsonl.bak`)
/// have companions of their own and are created side by side, in either order (hostile review
/// 53, F2: the second was refused, saying its companion `results.v2_resubmit_offset` was
/// another run's output, since Python's stem of that name is `results`).
#[tokio::test]
async fn outputs_whose_names_share_a_prefix_are_created_side_by_side_in_either_order() {
    let app = TestApp::new().await;
    for (directory, names) in [
        ("versions", ["results.jsonl", "results.v2.jsonl"]),
        ("versions-reversed", ["results.v2.jsonl", "results.jsonl"]),
        ("backup", ["out.jsonl", "out.jsonl.bak"]),
    ] {
        for name in names {
            let mut body = app.create_body();
            body["output_path"] = json!(app.root.join(directory).join(name));
            let reply = app
                .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
                .await;
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "{directory}/{name}: {}",
                reply.body
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_drift_validations_leave_one_journal_line_and_one_row_each() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let requests = (0..64)
        .map(|i| {
            (
                Method::POST,
                format!("/runs/{run_id}/validate"),
                COLLECTOR,
                app.validate_body(0.3, 9000 + i),
            )
        })
        .collect();
    let mut answered = BTreeSet::new();
    for reply in all_at_once(&app, requests).await {
        assert_eq!(reply.body["outcome"], "resume_with_drift", "{}", reply.body);
        answered.insert(
            reply.body["drift_event_id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let journal = journal_ids(&run_id, &paths);
    let rows = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/drift?limit=1000"),
            Some(VIEWER),
            None,
        )
        .await;
    let stored: BTreeSet<String> = rows.body["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["event_id"].as_str().expect("id").to_owned())
        .collect();
    assert_eq!(answered.len(), 64);
    assert_eq!(
        journal, answered,
        "every answered event has its journal line"
    );
    assert_eq!(stored, answered, "and its row");
    // Each validation's resume event is committed with its drift row: once, complete.
    let drift_digests: BTreeSet<String> = rows.body["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            e["current_config_digest"]
                .as_str()
                .expect("digest")
                .to_owned()
        })
        .collect();
    let resumes = app
        .state
        .registry
        .store()
        .list_resume_events(&run_id, 1000)
        .await
        .expect("resume events");
    assert_eq!(resumes.len(), 64, "one resume event per validation");
    let mut resumed_digests = BTreeSet::new();
    for event in &resumes {
        assert_eq!(event.outcome, "resume_with_drift", "{event:?}");
        assert_eq!(
            event.operational_keys,
            ["servers.math_agent.responses_api_agents.simple_agent.sandbox.sandbox_port"],
            "{event:?}"
        );
        assert_eq!(event.client.as_deref(), Some("collector-1"), "{event:?}");
        resumed_digests.insert(event.current_config_digest.clone().expect("digest"));
    }
    assert_eq!(
        resumed_digests, drift_digests,
        "each resume event names its drift row's current digest"
    );
}

/// A dashboard following `/drift` in recorded order while 48 resumes across drift are being
/// recorded sees each of them exactly once. Every event here has the same time (the test clock
/// stands still) and ids are hashes, so events commit in no time order: a time cursor passes
/// some of them before they commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_in_recorded_order_sees_every_drift_event_recorded_while_it_follows() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let follower = {
        let (state, writing) = (app.state.clone(), writing.clone());
        tokio::spawn(async move {
            let mut seen: Vec<String> = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                // A page read after the writers finished sees everything they recorded.
                let last_round = !writing.load(std::sync::atomic::Ordering::SeqCst);
                let uri = match &cursor {
                    Some(c) => format!("/drift?order=recorded&limit=5&cursor={c}"),
                    None => "/drift?order=recorded&limit=5".to_owned(),
                };
                let page = send(state.clone(), Method::GET, &uri, Some(VIEWER), None).await;
                assert_eq!(page.status, StatusCode::OK, "{}", page.body);
                for event in page.body["events"].as_array().expect("events") {
                    seen.push(event["event_id"].as_str().expect("id").to_owned());
                }
                cursor = Some(
                    page.body["follow_cursor"]
                        .as_str()
                        .expect("a follow cursor on every recorded-order page")
                        .to_owned(),
                );
                if page.body["next_cursor"].is_null() {
                    if last_round {
                        return seen;
                    }
                    tokio::task::yield_now().await;
                }
            }
        })
    };
    let requests = (0..48)
        .map(|i| {
            (
                Method::POST,
                format!("/runs/{run_id}/validate"),
                COLLECTOR,
                app.validate_body(0.3, 9000 + i),
            )
        })
        .collect();
    let mut answered = BTreeSet::new();
    for reply in all_at_once(&app, requests).await {
        assert_eq!(reply.body["outcome"], "resume_with_drift", "{}", reply.body);
        answered.insert(
            reply.body["drift_event_id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    writing.store(false, std::sync::atomic::Ordering::SeqCst);
    let seen = follower.await.expect("follower");
    let unique: BTreeSet<String> = seen.iter().cloned().collect();
    assert_eq!(unique.len(), seen.len(), "no event is followed twice");
    assert_eq!(unique, answered, "every recorded event is followed");
}

#[tokio::test]
async fn an_expired_lease_frees_the_run_lock_the_moment_it_is_reported() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    lease_id(&app, &run_id).await;
    let lock = recovery_sidecar::SidecarPaths::for_output(&app.output()).run_lock;
    assert!(!python_can_lock(&lock), "a live lease holds the flock");
    app.clock.advance(time::Duration::seconds(61));
    let reported = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/lease"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(reported.body["holder"], Value::Null, "{}", reported.body);
    assert!(
        python_can_lock(&lock),
        "a collector that checked is not refused"
    );
}

/// Blank lines as `bytes.strip()` sees them (an empty one, a vertical tab: hostile review 45,
/// an empty drift line was reported unreadable and a vertical-tab results line stopped the
/// plan) are skipped in every file a collector writes.
#[tokio::test]
async fn journal_lines_written_by_python_collectors_are_indexed_on_demand() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let manifest = saved_manifest(&app);
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    std::fs::write(&paths.output, "\x0b\n\n").expect("blank results lines");
    let script = "import json, sys\nrun_id, digest, drift, extension = sys.argv[1:]\nwith open(drift, 'a') as f:\n    f.write('\\n\\x0b\\n')\n    f.write(json.dumps({'at': '2026-11-29T10:00:00.000000Z', 'run_id': run_id, 'saved_config_digest': digest, 'current_config_digest': 'c' * 64, 'operational_keys': ['collection.timeout_s']}) + '\\n')\nwith open(extension, 'a') as f:\n    f.write('\\x0b\\n')\n    f.write(json.dumps({'at': '2026-11-29T10:00:01Z', 'extend_attempts': 2, 'by': 'ops', 'reason': 'outage'}) + '\\n')\n";
    let status = Command::new("python3")
        .args(["-c", script, &run_id, &manifest.config_digest])
        .arg(&paths.resume_drift)
        .arg(&paths.attempt_extension)
        .status()
        .expect("python3");
    assert!(status.success());
    for round in 0..2 {
        let report = app
            .call(Method::POST, "/reindex", Some(OPERATOR), Some(json!({})))
            .await;
        assert_eq!(report.status, StatusCode::OK, "{}", report.body);
        assert!(
            report.body["unreadable"]
                .as_array()
                .is_some_and(Vec::is_empty),
            "{}",
            report.body
        );
        let drift = app
            .call(
                Method::GET,
                "/drift?key=collection.timeout_s",
                Some(VIEWER),
                None,
            )
            .await;
        assert_eq!(
            drift.body["events"].as_array().map(Vec::len),
            Some(1),
            "round {round}: {}",
            drift.body
        );
        let extensions = app
            .state
            .registry
            .store()
            .list_extensions(&run_id)
            .await
            .expect("rows");
        assert_eq!(extensions.len(), 1, "round {round}");
    }
    let plan = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(plan.status, StatusCode::OK, "{}", plan.body);
    let viewer = app
        .call(Method::POST, "/reindex", Some(VIEWER), Some(json!({})))
        .await;
    assert_eq!(viewer.status, StatusCode::FORBIDDEN);
}

/// The fields of a manifest before 0.5.0 (facts §3).
const PRE_05_FIELDS: [&str; 9] = [
    "schema_version",
    "selection_policy",
    "next_attempt",
    "run_id",
    "source_digest",
    "materialized_digest",
    "config_digest",
    "legacy_import",
    "identity_overridden",
];

#[tokio::test]
async fn a_pre_0_5_manifest_keeps_its_form_when_the_service_reserves_on_it() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let mut old: serde_json::Map<String, Value> =
        serde_json::from_slice(&std::fs::read(&paths.manifest).expect("manifest")).expect("json");
    old.retain(|key, _| PRE_05_FIELDS.contains(&key.as_str()));
    std::fs::write(
        &paths.manifest,
        serde_json::to_vec_pretty(&old).expect("json"),
    )
    .expect("pre-0.5 manifest");
    let lease = lease_id(&app, &run_id).await;
    let reserved = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/reserve"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease, "rollout_ids": ["0-0"]})),
        )
        .await;
    assert_eq!(reserved.status, StatusCode::OK, "{}", reserved.body);
    let written: BTreeMap<String, Value> =
        serde_json::from_slice(&std::fs::read(&paths.manifest).expect("manifest")).expect("json");
    assert_eq!(
        written.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        PRE_05_FIELDS.into_iter().collect()
    );
    assert_eq!(written["next_attempt"], json!({"0-0": 1}));
    // A pre-0.5 reader (pydantic, extra="forbid") still reads its own run.
    let script = "import sys\nfrom pydantic import BaseModel, ConfigDict\nfrom typing import Literal\nclass RunManifest(BaseModel):\n    model_config = ConfigDict(extra='forbid')\n    schema_version: Literal[2] = 2\n    selection_policy: Literal['latest_allocated'] = 'latest_allocated'\n    next_attempt: dict[str, int] = {}\n    run_id: str\n    source_digest: str\n    materialized_digest: str\n    config_digest: str\n    legacy_import: bool = False\n    identity_overridden: bool = False\nRunManifest.model_validate_json(open(sys.argv[1]).read())\n";
    let read = Command::new("python3")
        .args(["-c", script])
        .arg(&paths.manifest)
        .status()
        .expect("python3");
    assert!(
        read.success(),
        "the pre-0.5 model reads the rewritten manifest"
    );
}

#[tokio::test]
async fn heavy_work_beyond_its_queue_is_answered_503_with_retry_after() {
    let app = TestApp::new().await;
    // One heavy-work thread and room for one waiting job: while one job holds the thread and
    // another waits, a classify finds nowhere to go.
    let state = app
        .state
        .with_heavy_work(Arc::new(recovery_server::state::HeavyWork::new(
            "heavy-test",
            1,
            1,
        )));
    let (started, started_rx) = std::sync::mpsc::channel::<()>();
    let (release, release_rx) = std::sync::mpsc::channel::<()>();
    let heavy = state.heavy.clone();
    let holder = tokio::spawn(async move {
        heavy
            .run(move |_| {
                let _ = started.send(());
                let _ = release_rx.recv();
                Ok(())
            })
            .await
    });
    tokio::task::spawn_blocking(move || started_rx.recv())
        .await
        .expect("join")
        .expect("the holding job started");
    // The waiting job: queued, its caller gone (it takes the one place until it is dequeued).
    let waiting =
        tokio::time::timeout(std::time::Duration::ZERO, state.heavy.run(|_| Ok(()))).await;
    assert!(waiting.is_err(), "the waiting job is queued, not run");
    let request = Request::builder()
        .method(Method::POST)
        .uri("/classify")
        .header("authorization", format!("Bearer {VIEWER}"))
        .header("content-type", "application/json")
        .body(Body::from(json!({"rows": [{"reward": 1.0}]}).to_string()))
        .expect("request");
    let response = recovery_server::app(state)
        .oneshot(request)
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    let body: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(body["code"], "overloaded");
    release.send(()).expect("release");
    holder.await.expect("join").expect("the holding job ends");
    let served = app
        .call(
            Method::POST,
            "/classify",
            Some(VIEWER),
            Some(json!({"rows": [{"reward": 1.0}, 3]})),
        )
        .await;
    assert_eq!(
        served.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "with room, the batch is read and its bad row named: {}",
        served.body
    );
    assert!(
        served.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("rows[1]")),
        "{}",
        served.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_whose_client_goes_away_still_reaches_both_the_journal_and_the_database() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let lines = || recovery_sidecar::read_lines(&paths.resume_drift).map_or(0, |l| l.len());
    // Each client goes away the moment its line is in the journal: before its row, its resume
    // record and its answer.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    for port in 0..16 {
        let before = lines();
        let state = app.state.clone();
        let body = app.validate_body(0.3, 9000 + port).to_string();
        let uri = format!("/runs/{run_id}/validate");
        let client = tokio::spawn(async move {
            send(state, Method::POST, &uri, Some(COLLECTOR), Some(body)).await
        });
        while lines() == before && !client.is_finished() {
            assert!(
                std::time::Instant::now() < deadline,
                "the journal line never came"
            );
            tokio::task::yield_now().await;
        }
        client.abort();
    }
    // Every line seen means its change holds (or held) the run's section, and a section writes
    // its row before it ends: entering the section after them waits for all of them.
    drop(
        app.state
            .registry
            .lock(&paths)
            .await
            .expect("the run's section"),
    );
    let journal = journal_ids(&run_id, &paths);
    let stored: BTreeSet<String> = app
        .state
        .registry
        .store()
        .query_drift(&recovery_store::DriftFilter {
            run_id: Some(run_id.clone()),
            limit: 1000,
            ..Default::default()
        })
        .await
        .expect("rows")
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(
        journal.len(),
        16,
        "every client journalled its line before going away"
    );
    assert_eq!(
        journal, stored,
        "every journalled line has its row, with no restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validations_share_a_run_while_changes_wait_for_it() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let reader = app
        .state
        .registry
        .lock_shared(&paths)
        .await
        .expect("shared section");
    // Validations enter beside a shared section: reuse and a drift resume both answer.
    for port in [8000, 9100] {
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/validate"),
                Some(COLLECTOR),
                Some(app.validate_body(0.3, port)),
            )
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    }
    // A change waits for the shared section to end.
    let exclusive = app.state.registry.lock(&paths);
    tokio::pin!(exclusive);
    let entered = tokio::select! {
        biased;
        _ = &mut exclusive => true,
        () = std::future::ready(()) => false,
    };
    assert!(
        !entered,
        "an exclusive section never runs beside a shared one"
    );
    drop(reader);
    drop(
        exclusive
            .await
            .expect("the change enters once the readers are gone"),
    );
    // And a Python collector can own the run once every section has ended.
    let python = PythonLock::hold(&paths.run_lock);
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 9200)),
        )
        .await;
    assert_eq!(reply.status, StatusCode::LOCKED, "{}", reply.body);
    drop(python);
}

#[tokio::test]
async fn nothing_is_ever_written_through_a_symbolic_link_out_of_the_roots() {
    let app = TestApp::new().await;
    let outside = tempfile::tempdir().expect("outside");
    let precious = outside.path().join("precious.txt");
    std::fs::write(&precious, "KEEP-THIS-LINE\nAND-THIS-PARTIAL-TAIL").expect("precious");
    let dir = app.root.join("sym");
    std::fs::create_dir_all(&dir).expect("dir");
    let links = [
        (
            "an output linked to nothing outside",
            "f.jsonl",
            outside.path().join("target.jsonl"),
        ),
        (
            "a failures sidecar linked to nothing outside",
            "g_failures.jsonl",
            outside.path().join("victim_failures"),
        ),
        (
            "a run lock linked to nothing outside",
            "h_run.lock",
            outside.path().join("victim_lock"),
        ),
        (
            "a drift journal linked to a file outside",
            "q_manifest_resume_drift.jsonl",
            precious.clone(),
        ),
    ];
    for (case, name, target) in &links {
        std::os::unix::fs::symlink(target, dir.join(name)).expect("link");
        let output = dir.join(format!(
            "{}.jsonl",
            name.split(['.', '_']).next().expect("stem")
        ));
        let mut body = app.create_body();
        body["output_path"] = json!(output);
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{case}: {}",
            reply.body
        );
        assert_eq!(reply.body["code"], "path_refused", "{case}");
    }
    let mut outside_files: Vec<String> = std::fs::read_dir(outside.path())
        .expect("outside")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    outside_files.sort();
    assert_eq!(
        outside_files,
        ["precious.txt"],
        "nothing was created outside the roots"
    );
    assert_eq!(
        std::fs::read_to_string(&precious).expect("precious"),
        "KEEP-THIS-LINE\nAND-THIS-PARTIAL-TAIL",
        "nothing outside was truncated or appended to"
    );
}

#[tokio::test]
async fn nothing_is_read_through_a_link_planted_beside_a_run_nor_from_a_fifo() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let outside = tempfile::tempdir().expect("outside");
    let secret_file = outside.path().join("service.env");
    std::fs::write(
        &secret_file,
        "RR_TOKENS=operator:olga:TOPSECRET-0123456789\n",
    )
    .expect("secret");
    let dir = app.root.join("exp");
    let plan_path = format!("/runs/{run_id}/plan");
    let plan = || app.call(Method::GET, &plan_path, Some(VIEWER), None);
    for companion in [
        "out_resubmit_offset",
        "out_attempt_extension.jsonl",
        "out_rerun_masked.jsonl",
        "out_failures.jsonl",
        "out_failure_classification.json",
    ] {
        let at = dir.join(companion);
        let aside = dir.join(format!("{companion}.aside"));
        let existed = std::fs::rename(&at, &aside).is_ok();
        std::os::unix::fs::symlink(&secret_file, &at).expect("link");
        let reply = plan().await;
        let text = reply.body.to_string();
        assert!(!text.contains("TOPSECRET"), "{companion}: {text}");
        assert_ne!(
            reply.status,
            StatusCode::OK,
            "{companion}: read through a link"
        );
        assert!(
            text.contains("symbolic link"),
            "{companion}: the refusal says why: {text}"
        );
        std::fs::remove_file(&at).expect("unlink");
        // A FIFO in the same place is refused at once, never waited on.
        mkfifo(&at);
        let reply = plan().await;
        assert_ne!(reply.status, StatusCode::OK, "{companion}: {}", reply.body);
        assert!(
            reply.body.to_string().contains("not a regular file"),
            "{companion}: {}",
            reply.body
        );
        std::fs::remove_file(&at).expect("unlink");
        if existed {
            std::fs::rename(&aside, &at).expect("restore");
        }
    }
    assert_eq!(
        plan().await.status,
        StatusCode::OK,
        "the run is whole again"
    );
    // A FIFO given (or swapped in) as the source dataset is refused, never waited on.
    let fifo_source = app.root.join("data/fifo.jsonl");
    mkfifo(&fifo_source);
    let mut body = app.validate_body(0.3, 8000);
    body["source_path"] = json!(fifo_source);
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(body),
        )
        .await;
    assert_ne!(reply.status, StatusCode::OK, "{}", reply.body);
    assert!(
        reply.body.to_string().contains("not a regular file"),
        "{}",
        reply.body
    );
    // A link or a FIFO planted where the run's lock file is: the lease is refused as a path
    // problem (422), never a lock to wait for nor the service's failure.
    let lock = dir.join("out_run.lock");
    for planted in ["a link", "a FIFO", "a directory"] {
        std::fs::rename(&lock, dir.join("out_run.lock.aside")).expect("aside");
        match planted {
            "a link" => std::os::unix::fs::symlink(&secret_file, &lock).expect("link"),
            "a FIFO" => mkfifo(&lock),
            _ => std::fs::create_dir(&lock).expect("directory"),
        }
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/lease"),
                Some(COLLECTOR),
                Some(json!({"holder": "c", "host": "h", "pid": 1})),
            )
            .await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{planted}: {}",
            reply.body
        );
        assert_eq!(reply.body["code"], "path_refused", "{planted}");
        if planted == "a directory" {
            std::fs::remove_dir(&lock).expect("rmdir");
        } else {
            std::fs::remove_file(&lock).expect("unlink");
        }
        std::fs::rename(dir.join("out_run.lock.aside"), &lock).expect("restore");
    }
    // A FIFO as a new run's output or companion is refused before anything is written.
    for (case, fifo_name, output) in [
        ("an output", "fifo_out.jsonl", "fifo_out.jsonl"),
        ("a failures sidecar", "g_failures.jsonl", "g.jsonl"),
    ] {
        let at = dir.join(fifo_name);
        mkfifo(&at);
        let mut body = app.create_body();
        body["output_path"] = json!(dir.join(output));
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{case}: {}",
            reply.body
        );
        assert_eq!(reply.body["code"], "path_refused", "{case}");
        let stem = output.trim_end_matches(".jsonl");
        assert!(
            !dir.join(format!("{stem}_manifest.json")).exists()
                && !dir
                    .join(format!("{stem}_materialized_inputs.jsonl"))
                    .exists(),
            "{case}: nothing written"
        );
    }
}

/// A file's bytes when it is a regular file (a FIFO is never opened: it would wait).
fn read_if_regular(path: &std::path::Path) -> Option<Vec<u8>> {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(std::fs::Metadata::is_file)
        .and_then(|_| std::fs::read(path).ok())
}

/// A link, FIFO or directory planted where a run's journal belongs: the write that would
/// append to it is refused as a path problem (422 `path_refused`) before anything is written
/// (a resubmit writes both of its journals or neither), nothing outside the roots changes, and
/// the run is whole again once the journal is moved back.
#[tokio::test]
async fn a_journal_planted_as_a_link_fifo_or_directory_is_refused_before_anything_is_written() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let outside = tempfile::tempdir().expect("outside");
    let target = outside.path().join("kept.jsonl");
    std::fs::write(&target, "outside\n").expect("outside file");
    let dir = app.root.join("exp");
    let drifting = || app.validate_body(0.3, 8123);
    let cases: [(&str, &str, Method, String, Value); 4] = [
        (
            "the drift journal",
            "out_manifest_resume_drift.jsonl",
            Method::POST,
            format!("/runs/{run_id}/validate"),
            drifting(),
        ),
        (
            "the extension journal",
            "out_attempt_extension.jsonl",
            Method::POST,
            format!("/runs/{run_id}/attempts/extend"),
            json!({"extend_attempts": 1, "reason": "r"}),
        ),
        (
            "the resubmit offsets",
            "out_resubmit_offset",
            Method::POST,
            format!("/runs/{run_id}/attempts/resubmit"),
            json!({"reason": "r"}),
        ),
        (
            "the resubmit results offsets",
            "out_resubmit_results_offset",
            Method::POST,
            format!("/runs/{run_id}/attempts/resubmit"),
            json!({"reason": "r"}),
        ),
    ];
    for (case, name, method, path, body) in cases {
        let token = if path.ends_with("/validate") {
            COLLECTOR
        } else {
            OPERATOR
        };
        for planted in ["a link", "a FIFO", "a directory"] {
            let at = dir.join(name);
            let aside = dir.join(format!("{name}.aside"));
            let existed = std::fs::rename(&at, &aside).is_ok();
            match planted {
                "a link" => std::os::unix::fs::symlink(&target, &at).expect("link"),
                "a FIFO" => mkfifo(&at),
                _ => std::fs::create_dir(&at).expect("directory"),
            }
            let companions_before: Vec<_> = ["out_resubmit_offset", "out_resubmit_results_offset"]
                .iter()
                .map(|n| read_if_regular(&dir.join(n)))
                .collect();
            let reply = app
                .call(method.clone(), &path, Some(token), Some(body.clone()))
                .await;
            assert_eq!(
                reply.status,
                StatusCode::UNPROCESSABLE_ENTITY,
                "{case} as {planted}: {}",
                reply.body
            );
            assert_eq!(reply.body["code"], "path_refused", "{case} as {planted}");
            assert!(
                reply.body["message"]
                    .as_str()
                    .expect("message")
                    .contains(name),
                "{case}: the message names the file: {}",
                reply.body
            );
            let companions_after: Vec<_> = ["out_resubmit_offset", "out_resubmit_results_offset"]
                .iter()
                .map(|n| read_if_regular(&dir.join(n)))
                .collect();
            assert_eq!(
                companions_before, companions_after,
                "{case} as {planted}: nothing written"
            );
            assert_eq!(
                std::fs::read_to_string(&target).expect("outside"),
                "outside\n"
            );
            if planted == "a directory" {
                std::fs::remove_dir(&at).expect("rmdir");
            } else {
                std::fs::remove_file(&at).expect("unlink");
            }
            if existed {
                std::fs::rename(&aside, &at).expect("restore");
            }
        }
        let reply = app
            .call(method.clone(), &path, Some(token), Some(body))
            .await;
        assert!(
            reply.status.is_success(),
            "{case}: the run is whole again: {}",
            reply.body
        );
    }
    // A validation answered from cached facts refuses a linked outcome file as the plan does.
    let failures = dir.join("out_failures.jsonl");
    std::fs::rename(&failures, dir.join("failures.aside")).expect("aside");
    std::os::unix::fs::symlink(&target, &failures).expect("link");
    for body in [app.validate_body(0.3, 8000), app.validate_body(0.3, 8124)] {
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/validate"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.body);
        assert_eq!(reply.body["code"], "run_files_invalid");
        assert!(
            reply.body["message"]
                .as_str()
                .expect("message")
                .contains("symbolic link"),
            "{}",
            reply.body
        );
    }
    assert_eq!(
        std::fs::read_to_string(&target).expect("outside"),
        "outside\n"
    );
}

#[tokio::test]
async fn a_lease_whose_process_died_is_ended_not_reported_live() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    // A lease granted by a service process that was then killed: the row stays, its flock died
    // with the process.
    let now = time::OffsetDateTime::now_utc();
    let orphan = recovery_store::Lease {
        run_id: run_id.clone(),
        lease_id: "0".repeat(32),
        holder: "collector-killed".into(),
        host: "node-9".into(),
        pid: 4242,
        acquired_at: recovery_sidecar::format_rfc3339(now),
        renewed_at: recovery_sidecar::format_rfc3339(now),
        expires_at: recovery_sidecar::format_rfc3339(now + time::Duration::hours(1)),
        replica: "host-killed-pid".into(),
    };
    let store = app.state.registry.store();
    store
        .try_acquire_lease(&orphan, &recovery_sidecar::format_rfc3339(now))
        .await
        .expect("orphan row");
    let reported = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/lease"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(reported.body["holder"], Value::Null, "{}", reported.body);
    store
        .try_acquire_lease(&orphan, &recovery_sidecar::format_rfc3339(now))
        .await
        .expect("orphan row again");
    let reserve = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/reserve"),
            Some(COLLECTOR),
            Some(json!({"lease_id": orphan.lease_id, "rollout_ids": ["0-0"]})),
        )
        .await;
    assert_eq!(reserve.body["code"], "lease_not_held", "{}", reserve.body);
    store
        .try_acquire_lease(&orphan, &recovery_sidecar::format_rfc3339(now))
        .await
        .expect("orphan row again");
    let acquired = app.lease(&run_id, "collector-new").await;
    assert_eq!(
        acquired.status,
        StatusCode::CREATED,
        "a new collector takes the run: {}",
        acquired.body
    );
    let audit = store.list_audit(Some(&run_id), 100).await.expect("audit");
    assert!(
        audit.iter().any(|a| a.action == "lease.orphaned"),
        "ending an orphan is audited"
    );
    let stale = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some({
                let mut body = app.validate_body(0.3, 8000);
                body["lease_id"] = json!("f".repeat(32));
                body
            }),
        )
        .await;
    // A lease that does not hold the run is told so, also while another's is live: never to
    // wait and go on under it.
    assert_eq!(
        (
            stale.status,
            &stale.body["code"],
            &stale.body["details"]["field"]
        ),
        (
            StatusCode::CONFLICT,
            &json!("lease_not_held"),
            &json!("lease_id")
        ),
        "{}",
        stale.body
    );
    let new_lease = acquired.body["lease_id"].as_str().expect("lease");
    let released = app
        .call(
            Method::DELETE,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(json!({"lease_id": new_lease})),
        )
        .await;
    assert_eq!(released.status, StatusCode::NO_CONTENT);
    let mut body = app.validate_body(0.3, 8000);
    body["lease_id"] = json!(new_lease);
    let ended = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(body),
        )
        .await;
    assert_eq!(
        ended.body["code"], "lease_not_held",
        "a collector whose lease ended is not told to go on: {}",
        ended.body
    );
}

#[tokio::test]
async fn a_credential_interpolated_from_the_environment_never_reaches_a_file() {
    let app = TestApp::new().await;
    let secret = "sk-live-ENV-INTERPOLATED-9";
    let mut body = app.create_body();
    body["environment"]["NGT_REVIEW_PROMPT"] =
        json!(format!("https://user:{secret}@judge.example/v1"));
    let created = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    assert!(!created.body.to_string().contains(secret));
    assert_no_file_holds(&app.root, secret);
}

#[tokio::test]
async fn refusals_below_the_handlers_answer_in_the_error_shape_too() {
    let app = TestApp::with(|config| config.body_limit_bytes = 1024).await;
    // A body declared larger than the 1 KiB limit, sent as `token` (or with none).
    let oversized = |uri: &str, token: Option<&str>| {
        let big = "x".repeat(4096);
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header("content-type", "application/json")
            .header("content-length", big.len().to_string());
        if let Some(token) = token {
            request = request.header("authorization", format!("bearer {token}"));
        }
        recovery_server::app(app.state.clone())
            .oneshot(request.body(Body::from(big)).expect("request"))
    };
    let response = oversized("/classify", Some(VIEWER))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // Without a valid token, the sender is told only that, whatever size it declares.
    let refused = oversized("/runs", None).await.expect("response");
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    let body: Value = serde_json::from_slice(
        &axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("body"),
    )
    .expect("json body");
    assert_eq!(body["code"], "payload_too_large");
    let wrong_method = app
        .call(Method::PUT, "/runs", Some(VIEWER), Some(json!({})))
        .await;
    assert_eq!(wrong_method.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        wrong_method.body["code"], "method_not_allowed",
        "{}",
        wrong_method.body
    );
    let lowercase = Request::builder()
        .method(Method::GET)
        .uri("/runs")
        .header("authorization", format!("bearer {VIEWER}"))
        .body(Body::empty())
        .expect("request");
    let response = recovery_server::app(app.state.clone())
        .oneshot(lowercase)
        .await
        .expect("response");
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "the scheme is case-insensitive"
    );
}

#[tokio::test]
async fn readers_are_never_served_another_runs_files() {
    let app = TestApp::new().await;
    let old = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let mut python = saved_manifest(&app);
    python.run_id = recovery_sidecar::new_id();
    std::fs::write(&paths.manifest, python.to_pretty_json().expect("json"))
        .expect("python manifest");
    for uri in [format!("/runs/{old}"), format!("/runs/{old}/plan")] {
        let reply = app.call(Method::GET, &uri, Some(VIEWER), None).await;
        assert_eq!(
            reply.body["code"], "run_superseded",
            "{uri}: {}",
            reply.body
        );
        assert_eq!(
            reply.body["details"]["superseded_by"].as_str(),
            Some(python.run_id.as_str())
        );
    }
    let new = app
        .call(
            Method::GET,
            &format!("/runs/{}", python.run_id),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        new.status,
        StatusCode::OK,
        "the run on disk is adopted: {}",
        new.body
    );
}

#[tokio::test]
async fn a_create_never_deletes_and_never_shares_another_runs_companions() {
    let app = TestApp::new().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    std::fs::create_dir_all(app.output().parent().expect("dir")).expect("dir");
    std::fs::write(&paths.draft_journal, "{\"draft\": 1}\n").expect("draft");
    std::fs::write(&paths.coverage, "{}").expect("coverage");
    let run_id = app.create().await;
    for (stale, text) in [
        (&paths.draft_journal, "{\"draft\": 1}\n"),
        (&paths.coverage, "{}"),
    ] {
        assert!(!stale.exists(), "{} is set aside", stale.display());
        let aside = std::path::PathBuf::from(format!(
            "{}.stale-{}",
            stale.display(),
            app.clock.now().unix_timestamp()
        ));
        assert_eq!(
            std::fs::read_to_string(&aside).expect("kept"),
            text,
            "never deleted"
        );
    }
    let mut same_stem = app.create_body();
    same_stem["output_path"] = json!(app.output().with_extension("json"));
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(same_stem))
        .await;
    assert_eq!(reply.body["code"], "path_refused", "{}", reply.body);
    assert!(
        reply.body["message"]
            .as_str()
            .is_some_and(|m| m.contains(&run_id)),
        "{}",
        reply.body
    );
}

#[tokio::test]
async fn rows_sent_to_validate_are_digested_from_their_text_as_the_file_is() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let uri = format!("/runs/{run_id}/validate");
    let with_rows = |rows: &str| {
        let body = app.validate_body(0.3, 8000).to_string();
        format!("{},\"rows\":{rows}}}", body.trim_end_matches('}'))
    };
    // The created rows again, pretty-printed, keys reordered, numbers written differently.
    let same = "[\n  {\"_ng_rollout_index\": 0, \"_ng_task_index\": 0,\n   \"question\": \"1+1?\", \"agent_ref\": {\"name\": \"math_agent\"}},\n  {\"agent_ref\": {\"name\": \"math_agent\"}, \"_ng_task_index\": 1, \"_ng_rollout_index\": 0, \"question\": \"2+2?\"}\n]";
    let reply = app
        .call_raw(Method::POST, &uri, Some(COLLECTOR), Some(with_rows(same)))
        .await;
    assert_eq!(reply.body["outcome"], "reuse", "{}", reply.body);
    let changed = "[{\"agent_ref\": {\"name\": \"math_agent\"}, \"_ng_task_index\": 0, \"_ng_rollout_index\": 0, \"question\": \"1+1=?\"}]";
    let reply = app
        .call_raw(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(with_rows(changed)),
        )
        .await;
    assert_eq!(reply.body["code"], "resume_refused", "{}", reply.body);
    let not_object = app
        .call_raw(Method::POST, &uri, Some(COLLECTOR), Some(with_rows("[3]")))
        .await;
    assert_eq!(not_object.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        not_object.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("rows[0]")),
        "{}",
        not_object.body
    );
    let wrong_type = app
        .call_raw(
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(with_rows("[]").replace("\"source_path\"", "\"source_path\":1,\"x\"")),
        )
        .await;
    assert_eq!(
        wrong_type.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        wrong_type.body
    );
}

#[tokio::test]
async fn heavy_work_whose_caller_went_away_never_starts() {
    let heavy = Arc::new(recovery_server::state::HeavyWork::new("cancel-test", 1, 4));
    let (started, started_rx) = std::sync::mpsc::channel::<()>();
    let (release, release_rx) = std::sync::mpsc::channel::<()>();
    let holding = heavy.clone();
    let holder = tokio::spawn(async move {
        holding
            .run(move |_| {
                let _ = started.send(());
                let _ = release_rx.recv();
                Ok(())
            })
            .await
    });
    tokio::task::spawn_blocking(move || started_rx.recv())
        .await
        .expect("join")
        .expect("the holding job started");
    // Queued behind the holder, then its caller goes away (a timeout polls it once, so the
    // job is queued, and drops it).
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = ran.clone();
    let abandoned = tokio::time::timeout(
        std::time::Duration::ZERO,
        heavy.run(move |_| {
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }),
    )
    .await;
    assert!(abandoned.is_err(), "the caller gave up before the job ran");
    release.send(()).expect("release");
    holder.await.expect("join").expect("the holding job ends");
    // Jobs run in order: once a later one has run, the abandoned one was skipped.
    heavy.run(|_| Ok(())).await.expect("a later job runs");
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_unsafe_resumes_of_outcomes_without_a_manifest_import_them_once() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    std::fs::remove_file(&paths.manifest).expect("the manifest is lost");
    std::fs::write(
        &paths.output,
        b"{\"_ng_task_index\": 1, \"_ng_rollout_index\": 0, \"reward\": 1.0, \"response\": {\"status\": \"completed\"}}\n",
    )
    .expect("legacy results");
    let mut body = app.validate_body(0.3, 8000);
    body["allow_unsafe"] = json!(true);
    let uri = format!("/runs/{run_id}/validate");
    let replies = all_at_once(
        &app,
        (0..8)
            .map(|_| (Method::POST, uri.clone(), COLLECTOR, body.clone()))
            .collect(),
    )
    .await;
    let outcomes: BTreeMap<String, usize> =
        replies.iter().fold(BTreeMap::new(), |mut counts, reply| {
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
            *counts
                .entry(reply.body["outcome"].as_str().expect("outcome").to_owned())
                .or_default() += 1;
            counts
        });
    // One import; every later resume finds the legacy manifest and overrides it (sticky).
    assert_eq!(
        outcomes,
        BTreeMap::from([("import_legacy".into(), 1), ("overridden".into(), 7)])
    );
    let manifest = saved_manifest(&app);
    assert!(manifest.legacy_import && manifest.identity_overridden);
    assert_eq!(manifest.run_id, run_id);
    assert_eq!(manifest.next_attempt.get("1-0"), Some(&1));
}

/// A lease of 600 s on the run; its id.
async fn lease_for_ten_minutes(app: &TestApp, run_id: &str) -> Value {
    let granted = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(json!({"holder": "c", "host": "h", "pid": 1, "ttl_seconds": 600})),
        )
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    granted.body["lease_id"].clone()
}

/// A heartbeat without `ttl_seconds` keeps the lifetime the lease was granted with (a lease
/// asked for 600 s is not cut to the service's default by its first heartbeat); one with
/// `ttl_seconds` sets the new lifetime, which later heartbeats keep.
#[tokio::test]
async fn a_heartbeat_keeps_the_lifetime_the_lease_was_granted_with() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let lease_path = format!("/runs/{run_id}/lease");
    let lease_id = lease_for_ten_minutes(&app, &run_id).await;
    let expiry = |body: &Value| {
        time::OffsetDateTime::parse(
            body["expires_at"].as_str().expect("expires_at"),
            &time::format_description::well_known::Rfc3339,
        )
        .expect("time")
    };
    let heartbeat_path = format!("{lease_path}/heartbeat");
    let heartbeat = |ttl: Option<u64>| {
        let mut body = json!({"lease_id": lease_id});
        if let Some(ttl) = ttl {
            body["ttl_seconds"] = json!(ttl);
        }
        app.call(Method::POST, &heartbeat_path, Some(COLLECTOR), Some(body))
    };
    for (ttl, lifetime) in [(None, 600), (Some(120), 120), (None, 120)] {
        app.clock.advance(time::Duration::seconds(30));
        let now = app.clock.now();
        let renewed = heartbeat(ttl).await;
        assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.body);
        // Stored times keep microseconds: the lifetime is whole seconds once rounded.
        assert_eq!(
            (expiry(&renewed.body) - now).as_seconds_f64().round() as i64,
            lifetime,
            "heartbeat with ttl_seconds {ttl:?}"
        );
    }
    let refused = heartbeat(Some(0)).await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        refused.body
    );
    assert!(
        refused.body["message"]
            .as_str()
            .expect("message")
            .contains("ttl_seconds")
    );
}

/// The run's lock file removed under a live lease and locked anew by another process (a Python
/// collector here): the lease's exclusion no longer holds, so the lease ends (audited) the next
/// time anyone looks; its holder's heartbeat is refused, nobody writes under it, and the run is
/// the other process's until that process lets go.
#[tokio::test]
async fn a_lease_whose_lock_file_was_replaced_ends_and_the_new_owner_keeps_the_run() {
    // Whichever call comes first after the lock file is replaced finds the lease ended and
    // writes nothing: a change, as much as a renewal, a validation under the lease too.
    for first in ["reserve", "extend", "takeover", "heartbeat", "validate"] {
        let app = TestApp::new().await;
        let run_id = app.create().await;
        let lease_id = lease_for_ten_minutes(&app, &run_id).await;
        let lock = app.root.join("exp/out_run.lock");
        let manifest = app.root.join("exp/out_manifest.json");
        let before = std::fs::read(&manifest).expect("manifest");
        std::fs::remove_file(&lock).expect("remove the lock file");
        let python = PythonLock::hold(&lock);
        let (path, body) = match first {
            "reserve" => (
                format!("/runs/{run_id}/attempts/reserve"),
                json!({"lease_id": lease_id, "rollout_ids": ["0-0"]}),
            ),
            "extend" => (
                format!("/runs/{run_id}/attempts/extend"),
                json!({"extend_attempts": 2, "reason": "outage"}),
            ),
            "takeover" => (
                format!("/runs/{run_id}/lease/takeover"),
                json!({"holder": "op", "host": "h", "pid": 2, "reason": "stuck"}),
            ),
            "validate" => (format!("/runs/{run_id}/validate"), {
                let mut body = app.validate_body(0.3, 8123);
                body["lease_id"] = lease_id.clone();
                body
            }),
            _ => (
                format!("/runs/{run_id}/lease/heartbeat"),
                json!({"lease_id": lease_id}),
            ),
        };
        let reply = app
            .call(Method::POST, &path, Some(OPERATOR), Some(body))
            .await;
        // The holder's own call is told its lease is gone; an operator's, that another process
        // holds the run.
        let expected = match first {
            "reserve" | "heartbeat" | "validate" => (StatusCode::CONFLICT, "lease_not_held"),
            _ => (StatusCode::LOCKED, "run_locked"),
        };
        assert_eq!(
            (
                reply.status,
                reply.body["code"].as_str().unwrap_or_default()
            ),
            expected,
            "{first}: refused under the displaced lock: {}",
            reply.body
        );
        assert_eq!(
            std::fs::read(&manifest).expect("manifest"),
            before,
            "{first}: the manifest is untouched"
        );
        assert!(
            !app.root.join("exp/out_attempt_extension.jsonl").exists(),
            "{first}: no extension was journalled"
        );
        assert_eq!(
            lease_is_over(&app, &run_id, lease_id.as_str().expect("lease id")).await,
            (StatusCode::CONFLICT, "lease_not_held".to_owned()),
            "{first}: the lease ended"
        );
        drop(python);
        if first == "heartbeat" {
            finish_displaced_lock_case(&app, &run_id, &lock).await;
        }
    }
}

/// Two runs of `app`, on `exp/out.jsonl` and `exp/second.jsonl`.
async fn two_runs(app: &TestApp) -> (String, String) {
    let first = app.create().await;
    let mut body = app.create_body();
    body["output_path"] = json!(app.root.join("exp/second.jsonl"));
    let created = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let second = created.body["run_id"].as_str().expect("run id").to_owned();
    (first, second)
}

/// Two runs sharing a checkpoint directory: with its `.collector.lock` removed under the first
/// run's lease, the second run's lease is refused (the first lease holds the directory), before
/// and after the first lease's next use took the new lock file for it; the first lease goes on.
#[tokio::test]
async fn a_checkpoint_lock_replaced_under_a_lease_is_never_granted_to_a_second_run() {
    let app = TestApp::new().await;
    let (first, second) = two_runs(&app).await;
    std::fs::create_dir_all(app.root.join("ck/shared")).expect("checkpoints");
    let lease = |holder: &str| json!({"holder": holder, "host": "h", "pid": 1, "checkpoint_dir": "ck/shared", "ttl_seconds": 600});
    let granted = app
        .call(
            Method::POST,
            &format!("/runs/{first}/lease"),
            Some(COLLECTOR),
            Some(lease("first")),
        )
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    std::fs::remove_file(app.root.join("ck/shared/.collector.lock")).expect("remove");
    let refused = app
        .call(
            Method::POST,
            &format!("/runs/{second}/lease"),
            Some(COLLECTOR),
            Some(lease("second")),
        )
        .await;
    assert_eq!(refused.status, StatusCode::LOCKED, "{}", refused.body);
    assert_eq!(refused.body["details"]["holder"]["holder"], "first");
    // The first lease's next use finds its lock file displaced and takes the new one.
    let lease_id = granted.body["lease_id"].as_str().expect("lease id");
    assert_eq!(
        lease_is_over(&app, &first, lease_id).await,
        (StatusCode::OK, String::new()),
        "the first lease goes on"
    );
    assert!(
        !python_can_lock(&app.root.join("ck/shared/.collector.lock")),
        "the new checkpoint lock file is held for the first lease"
    );
    let still = app
        .call(
            Method::POST,
            &format!("/runs/{second}/lease"),
            Some(COLLECTOR),
            Some(lease("second")),
        )
        .await;
    assert_eq!(still.status, StatusCode::LOCKED, "{}", still.body);
    assert_eq!(still.body["details"]["holder"]["holder"], "first");
}

/// A checkpoint directory held (by another run's lease, or by a Python collector) refuses a
/// lease naming `checkpoint_dir`, not the run asked for; the run's own lock is left free.
#[tokio::test]
async fn a_lease_refused_for_its_checkpoint_directory_names_checkpoint_dir() {
    let app = TestApp::new().await;
    let (first, second) = two_runs(&app).await;
    std::fs::create_dir_all(app.root.join("ck/shared")).expect("checkpoints");
    std::fs::create_dir_all(app.root.join("ck/python")).expect("checkpoints");
    let lease = |dir: &str| json!({"holder": "h2", "host": "h", "pid": 1, "checkpoint_dir": dir});
    let granted = app
        .call(
            Method::POST,
            &format!("/runs/{first}/lease"),
            Some(COLLECTOR),
            Some(lease("ck/shared")),
        )
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    let _python = PythonLock::hold(&app.root.join("ck/python/.collector.lock"));
    for (case, dir, names) in [
        ("another run's lease", "ck/shared", first.as_str()),
        ("a Python collector", "ck/python", "Wait for it to stop"),
    ] {
        let refused = app
            .call(
                Method::POST,
                &format!("/runs/{second}/lease"),
                Some(COLLECTOR),
                Some(lease(dir)),
            )
            .await;
        assert_eq!(
            (refused.status, refused.body["code"].as_str()),
            (StatusCode::LOCKED, Some("run_locked")),
            "{case}: {}",
            refused.body
        );
        assert_eq!(
            refused.body["details"]["field"], "checkpoint_dir",
            "{case}: {}",
            refused.body
        );
        let message = refused.body["message"].as_str().expect("message");
        assert!(
            message.starts_with("checkpoint_dir ")
                && message.contains(dir)
                && message.contains("Another collector owns")
                && message.contains(names),
            "{case}: {message}"
        );
        assert!(
            python_can_lock(&app.root.join("exp/second_run.lock")),
            "{case}: the second run's own lock is not kept"
        );
    }
}

/// Concurrent validations that all find the lease's lock file removed (nobody holding the new
/// one) take the new file for the lease once: one audit entry, whichever of them got there
/// first; the lease's holder is answered, everyone else is refused as before, and no other
/// process can lock the new file.
#[tokio::test]
async fn concurrent_calls_that_find_a_removed_lock_file_take_the_new_one_for_the_lease_once() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let lease_id = lease_for_ten_minutes(&app, &run_id).await;
    std::fs::remove_file(app.root.join("exp/out_run.lock")).expect("remove the lock file");
    let requests = (0..16)
        .map(|i| {
            let mut body = app.validate_body(0.3, 8000);
            if i % 2 == 0 {
                body["lease_id"] = lease_id.clone();
            }
            (
                Method::POST,
                format!("/runs/{run_id}/validate"),
                COLLECTOR,
                body,
            )
        })
        .collect();
    for (i, reply) in all_at_once(&app, requests).await.into_iter().enumerate() {
        let expected = if i % 2 == 0 {
            StatusCode::OK
        } else {
            StatusCode::LOCKED
        };
        assert_eq!(reply.status, expected, "call {i}: {}", reply.body);
    }
    assert!(
        !python_can_lock(&app.root.join("exp/out_run.lock")),
        "the new lock file is held for the lease"
    );
    assert_eq!(
        lease_is_over(&app, &run_id, lease_id.as_str().expect("lease id")).await,
        (StatusCode::OK, String::new()),
        "the lease goes on"
    );
    let audit = audit_of(&app, &run_id).await;
    assert_eq!(audit.matches("lease.lock_retaken").count(), 1, "{audit}");
    assert!(!audit.contains("lease.lock_displaced"), "{audit}");
}

/// The run's audit log, as text, read by an operator.
async fn audit_of(app: &TestApp, run_id: &str) -> String {
    app.call(
        Method::GET,
        &format!("/audit?run_id={run_id}"),
        Some(OPERATOR),
        None,
    )
    .await
    .body
    .to_string()
}

/// A heartbeat of the lease answers whether it still holds the run.
async fn lease_is_over(app: &TestApp, run_id: &str, lease_id: &str) -> (StatusCode, String) {
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease/heartbeat"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease_id})),
        )
        .await;
    (
        reply.status,
        reply.body["code"].as_str().unwrap_or_default().to_owned(),
    )
}

/// With the replaced lock file held again by another process: validation waits for it, the
/// ending is audited, and the run is free once that process lets go.
async fn finish_displaced_lock_case(app: &TestApp, run_id: &str, lock: &std::path::Path) {
    let lease_path = format!("/runs/{run_id}/lease");
    let python = PythonLock::hold(lock);
    let validate = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8125)),
        )
        .await;
    assert_eq!(validate.status, StatusCode::LOCKED, "{}", validate.body);
    let audit = audit_of(app, run_id).await;
    assert!(audit.contains("lease.lock_displaced"), "{audit}");
    drop(python);
    let again = app
        .call(
            Method::POST,
            &lease_path,
            Some(COLLECTOR),
            Some(json!({"holder": "c", "host": "h", "pid": 1})),
        )
        .await;
    assert_eq!(
        again.status,
        StatusCode::CREATED,
        "free once the other process let go: {}",
        again.body
    );
}

/// The audit log says who created a run and who held it: of many concurrent acquires one is
/// granted and audited, then released by its holder and audited, each under the caller's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_acquires_grant_and_audit_one_lease_and_its_release() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let requests = (0..16)
        .map(|i| {
            (
                Method::POST,
                format!("/runs/{run_id}/lease"),
                COLLECTOR,
                json!({"holder": format!("collector-{i}"), "host": "node-1", "pid": 4242}),
            )
        })
        .collect();
    let replies = all_at_once(&app, requests).await;
    let granted: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .collect();
    assert_eq!(granted.len(), 1, "one lease");
    assert!(
        replies
            .iter()
            .all(|r| r.status == StatusCode::CREATED || r.body["code"] == "run_locked"),
        "the others are told who holds it"
    );
    let holder = granted[0].body["holder"].clone();
    let released = app
        .call(
            Method::DELETE,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(json!({"lease_id": granted[0].body["lease_id"]})),
        )
        .await;
    assert_eq!(released.status, StatusCode::NO_CONTENT, "{}", released.body);
    let audit = app
        .call(
            Method::GET,
            &format!("/audit?run_id={run_id}"),
            Some(VIEWER),
            None,
        )
        .await;
    // The test clock stands still: entries of one instant come in id order, so by action here.
    let mut entries: Vec<(String, String, Value)> = audit.body["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap_or_default().to_owned(),
                e["actor"].as_str().unwrap_or_default().to_owned(),
                e["details"]["holder"].clone(),
            )
        })
        .collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        entries,
        [
            (
                "lease.acquired".to_owned(),
                "collector-1".to_owned(),
                holder.clone()
            ),
            (
                "lease.released".to_owned(),
                "collector-1".to_owned(),
                holder
            ),
            (
                "run.created".to_owned(),
                "collector-1".to_owned(),
                Value::Null
            ),
        ],
        "{}",
        audit.body
    );
}

/// A run whose output another manifest took (a collector's fresh start) and whose own manifest
/// is then restored takes its output back at its next lookup, however many ask at once: the
/// files are the truth (hostile review 45: it answered `run_superseded`, naming the run its
/// files no longer knew, until something re-read the files).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_whose_manifest_is_restored_takes_its_output_back_at_its_next_lookup() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let original = std::fs::read(&paths.manifest).expect("manifest");
    let other = "0123456789abcdef0123456789abcdef";
    let taken = String::from_utf8(original.clone())
        .expect("utf8")
        .replace(&run_id, other);
    std::fs::write(&paths.manifest, taken).expect("another run's manifest");
    let superseded = app
        .call(Method::GET, &format!("/runs/{run_id}"), Some(VIEWER), None)
        .await;
    assert_eq!(
        (
            superseded.status,
            superseded.body["details"]["superseded_by"].as_str()
        ),
        (StatusCode::CONFLICT, Some(other)),
        "{}",
        superseded.body
    );
    std::fs::write(&paths.manifest, &original).expect("restored");
    let lookups: Vec<_> = (0..16)
        .map(|n| {
            let state = app.state.clone();
            let uri = match n % 4 {
                0 => format!("/runs/{run_id}"),
                1 => format!("/runs/{run_id}/plan"),
                2 => format!("/runs/{run_id}/approvals"),
                // The list answers what the files say too (hostile review 46, N4).
                _ => "/runs".to_owned(),
            };
            tokio::spawn(async move { send(state, Method::GET, &uri, Some(VIEWER), None).await })
        })
        .collect();
    for lookup in lookups {
        let reply = lookup.await.expect("lookup");
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        if let Some(listed) = reply.body["runs"].as_array() {
            let superseded_by = |id: &str| {
                listed
                    .iter()
                    .find(|run| run["run_id"] == id)
                    .map(|run| run["superseded_by"].clone())
            };
            assert_eq!(superseded_by(&run_id), Some(Value::Null), "{}", reply.body);
            assert_eq!(superseded_by(other), Some(json!(run_id)), "{}", reply.body);
        }
    }
    let replaced = app
        .call(Method::GET, &format!("/runs/{other}"), Some(VIEWER), None)
        .await;
    assert_eq!(
        (
            replaced.status,
            replaced.body["details"]["superseded_by"].as_str()
        ),
        (StatusCode::CONFLICT, Some(run_id.as_str())),
        "{}",
        replaced.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_validates_of_a_superseded_run_are_each_refused_and_recorded_once() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let mut replace = app.create_body();
    replace["replace"] = json!(true);
    let replaced = app
        .call(Method::POST, "/runs", Some(OPERATOR), Some(replace))
        .await;
    assert_eq!(replaced.status, StatusCode::CREATED, "{}", replaced.body);
    let before = app
        .state
        .registry
        .store()
        .list_resume_events(&run_id, 1000)
        .await
        .expect("events")
        .len();

    let uri = format!("/runs/{run_id}/validate");
    let requests = (0..16)
        .map(|_| {
            let body = app.validate_body(0.3, 8000);
            (Method::POST, uri.clone(), COLLECTOR, body)
        })
        .collect();
    for reply in all_at_once(&app, requests).await {
        assert_eq!(
            (reply.status, reply.body["code"].as_str()),
            (StatusCode::CONFLICT, Some("run_superseded")),
            "{}",
            reply.body
        );
    }
    let events = app
        .state
        .registry
        .store()
        .list_resume_events(&run_id, 1000)
        .await
        .expect("events");
    let superseded: BTreeSet<&str> = events
        .iter()
        .filter(|e| e.outcome == "superseded")
        .map(|e| e.event_id.as_str())
        .collect();
    assert_eq!(events.len(), before + 16, "one record per refusal");
    assert_eq!(superseded.len(), 16, "each under its own id");
}

/// A FIFO planted as a run's attempt-extension, approvals or drift journal is reported unreadable
/// by a reindex, which goes on: it is never opened in a way that waits for a writer (hostile
/// review 50, F4: the reindex, and with it a start-up or a stop, waited on the FIFO for good;
/// review 51, N4: the first fix stopped reporting a drift journal that was no regular file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_planted_as_a_journal_never_holds_a_reindex() {
    let app = TestApp::new().await;
    app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let fifos = [
        &paths.attempt_extension,
        &paths.rerun_masked,
        &paths.resume_drift,
    ];
    // A reindex first: the extension journal is marked, as a restart finds it.
    let first = app
        .call(Method::POST, "/reindex", Some(OPERATOR), None)
        .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    for fifo in fifos {
        let _ = std::fs::remove_file(fifo);
        mkfifo(fifo);
    }
    let reindex = send(
        app.state.clone(),
        Method::POST,
        "/reindex",
        Some(OPERATOR),
        None,
    );
    let Ok(reply) = tokio::time::timeout(std::time::Duration::from_secs(30), reindex).await else {
        // Let the stuck reader go (a writer opening the FIFO), so the test can end.
        for fifo in fifos {
            let _ = std::os::unix::fs::OpenOptionsExt::custom_flags(
                std::fs::OpenOptions::new().write(true),
                libc::O_NONBLOCK,
            )
            .open(fifo);
        }
        panic!("the reindex waited on a FIFO");
    };
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let unreadable = reply.body["unreadable"].to_string();
    for fifo in fifos {
        let name = fifo.file_name().and_then(|n| n.to_str()).expect("name");
        assert!(unreadable.contains(name), "{name}: {unreadable}");
    }
}
