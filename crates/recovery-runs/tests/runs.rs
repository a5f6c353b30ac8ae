//! The one integration-test binary of `recovery-runs`: SIGKILL crash safety of sidecar-first
//! writes, reindex, and flock-backed leases (contention, expiry, takeover, Python interop).

use recovery_core::manifest::RunManifest;
use recovery_runs::{
    DriftLine, LeaseError, LeaseRequest, Leases, ManualClock, Registry, SystemClock,
};
use recovery_sidecar::{Confinement, SidecarPaths};
use recovery_store::{DriftFilter, Store};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

#[path = "runs/groupcommit.rs"]
mod groupcommit;
#[path = "runs/plans.rs"]
mod plans;

/// A registry over a fresh SQLite store, confined to `root`.
async fn sqlite_registry(root: &Path) -> (Store, Registry) {
    let store = sqlite_store(root).await;
    let registry = Registry::new(
        store.clone(),
        Confinement::new([root.to_owned()]).expect("root"),
        Arc::new(SystemClock),
        "test",
    );
    (store, registry)
}

async fn sqlite_store(dir: &Path) -> Store {
    Store::connect(&format!("sqlite://{}", dir.join("store.db").display()))
        .await
        .expect("store")
}

/// A run's manifest written at `<root>/m/out.jsonl`'s companion (its id from `seed`), with the
/// run's companion paths.
fn manifest_on_disk(registry: &Registry, root: &Path, seed: &str) -> (SidecarPaths, RunManifest) {
    let paths = registry
        .paths_for(&root.join("m/out.jsonl"))
        .expect("paths");
    std::fs::create_dir_all(paths.manifest.parent().expect("dir")).expect("dir");
    let manifest = RunManifest::create(seed.repeat(16), "s", "m", "c", Some(3));
    std::fs::write(&paths.manifest, manifest.to_pretty_json().expect("json")).expect("manifest");
    (paths, manifest)
}

/// One resume-drift journal line as decisions §6 documents it (a collector's, or ours).
fn drift_line(run_id: &str, at: &str, current_digest: &str) -> String {
    format!(
        "{{\"at\": \"{at}\", \"run_id\": \"{run_id}\", \"saved_config_digest\": \"c\", \"current_config_digest\": \"{current_digest}\", \"operational_keys\": [\"a.port\"]}}\n"
    )
}

/// The ids of a drift journal's readable lines, derived as the registry derives them.
fn drift_ids_readable(path: &Path) -> Vec<String> {
    recovery_sidecar::read_lines_at(path)
        .expect("journal")
        .iter()
        .filter_map(|(offset, line)| {
            let parsed = serde_json::from_slice::<DriftLine>(line).ok()?;
            Some(recovery_runs::events::line_id(
                &parsed.run_id,
                recovery_runs::events::DRIFT_JOURNAL,
                *offset,
                line,
            ))
        })
        .collect()
}

/// The ids of a drift journal's lines, every one of which is a drift line.
fn drift_ids(path: &Path) -> Vec<String> {
    let ids = drift_ids_readable(path);
    let lines = recovery_sidecar::read_lines_at(path)
        .expect("journal")
        .len();
    assert_eq!(
        ids.len(),
        lines,
        "every complete journal line is a drift line"
    );
    ids
}

/// Every drift event in the database (of `run_id`, or all), in the order recorded (paged:
/// there may be more than a page).
async fn recorded_drift(store: &Store, run_id: Option<&str>) -> Vec<recovery_store::DriftEvent> {
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let page = store
            .follow_drift(&recovery_store::DriftFollow {
                run_id: run_id.map(str::to_owned),
                after,
                limit: 1000,
                ..Default::default()
            })
            .await
            .expect("drift");
        let Some((last, _)) = page.events.last() else {
            return events;
        };
        after = *last;
        events.extend(page.events.into_iter().map(|(_, e)| e));
    }
}

/// Every drift event's id in the database, in the order recorded.
async fn every_drift_id(store: &Store) -> Vec<String> {
    recorded_drift(store, None)
        .await
        .into_iter()
        .map(|e| e.event_id)
        .collect()
}

/// The ids of a run's drift rows.
async fn stored_drift_ids(store: &Store, run_id: &str) -> BTreeSet<String> {
    recorded_drift(store, Some(run_id))
        .await
        .into_iter()
        .map(|e| e.event_id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_points_never_leaves_partial_files_or_loses_journal_lines() {
    let root = tempfile::tempdir().expect("root");
    let db_dir = tempfile::tempdir().expect("db");
    let database = format!("sqlite://{}", db_dir.path().join("store.db").display());
    // Create the schema once so that children start writing at once.
    drop(Store::connect(&database).await.expect("store"));
    let paths = recovery_sidecar::SidecarPaths::for_output(
        &std::fs::canonicalize(root.path())
            .expect("root")
            .join("runs/out.jsonl"),
    );
    let mut acked: Vec<String> = Vec::new();
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_nanos() as u64
        | 1;
    let mut kills = 0;
    for iteration in 0..40u64 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_crash-writer"))
            .arg(root.path())
            .arg(&database)
            .arg((iteration * 100_000).to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("crash writer");
        let stdout = child.stdout.take().expect("stdout");
        let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = lines_tx.send(line);
            }
        });
        let mut seen = Vec::new();
        // Odd iterations kill after the child's first acknowledged event (so every machine,
        // however slow to start a process, exercises kills in the middle of steady writing);
        // even ones at a random point from the start (so start-up and the first write are hit).
        if iteration % 2 == 1 {
            let first = lines
                .recv_timeout(Duration::from_secs(120))
                .expect("the crash writer acknowledges its first event");
            seen.push(first);
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_millis(30 + seed % 120));
        child.kill().expect("SIGKILL");
        let status = child.wait().expect("reaped");
        kills += u32::from(status.code().is_none());
        reader.join().expect("reader");
        seen.extend(lines.try_iter());
        for line in seen {
            if let Some(id) = line.strip_prefix("ack ") {
                acked.push(id.to_owned());
            }
        }
        // Every file is a complete old or new version.
        if paths.manifest.exists() {
            let manifest =
                RunManifest::from_json_bytes(&std::fs::read(&paths.manifest).expect("manifest"))
                    .expect("a complete manifest");
            assert!(manifest.config_digest.starts_with("config-"));
        }
        if paths.identity.exists() {
            let identity: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&paths.identity).expect("identity"))
                    .expect("a complete identity");
            assert!(identity["collection"]["generation"].is_u64());
        }
        // No acknowledged journal line is lost.
        let present: BTreeSet<String> = drift_ids(&paths.resume_drift).into_iter().collect();
        for id in &acked {
            assert!(
                present.contains(id),
                "acknowledged drift line {id} was lost (iteration {iteration})"
            );
        }
    }
    assert!(
        kills >= 20,
        "the children were killed by a signal ({kills} of 40)"
    );
    assert!(
        acked.len() >= 20,
        "the writers made progress between kills ({} acknowledged)",
        acked.len()
    );

    let store = Store::connect(&database).await.expect("store");
    let registry = Registry::new(
        store.clone(),
        Confinement::new([root.path().to_owned()]).expect("root"),
        Arc::new(SystemClock),
        "test",
    );
    let report = registry.reindex().await.expect("reindex");
    assert!(report.unreadable.is_empty(), "{:?}", report.unreadable);
    let journal = drift_ids(&paths.resume_drift);
    let unique: BTreeSet<&String> = journal.iter().collect();
    assert_eq!(
        unique.len(),
        journal.len(),
        "no journal line is written twice"
    );
    let in_database = every_drift_id(&store).await;
    let in_database_set: BTreeSet<&String> = in_database.iter().collect();
    assert_eq!(
        in_database.len(),
        in_database_set.len(),
        "no duplicate rows"
    );
    assert_eq!(
        in_database_set, unique,
        "after reindex the database matches the sidecar exactly"
    );
    let again = registry.reindex().await.expect("reindex twice");
    assert_eq!(again.drift_inserted, 0, "reindex is idempotent");
    let manifest = RunManifest::from_json_bytes(&std::fs::read(&paths.manifest).expect("manifest"))
        .expect("manifest");
    let run = store
        .get_run(&manifest.run_id)
        .await
        .expect("run")
        .expect("the run is recorded");
    assert_eq!(
        run.config_digest, manifest.config_digest,
        "the run row follows the manifest on disk"
    );
}

#[tokio::test]
async fn journals_written_before_a_crash_reach_the_database_by_reindex() {
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let paths = registry
        .paths_for(&root.path().join("a/out.jsonl"))
        .expect("paths");
    let manifest = RunManifest::create("ab".repeat(16), "s", "m", "c", Some(3));
    std::fs::create_dir_all(paths.manifest.parent().expect("dir")).expect("dir");
    recovery_sidecar::atomic_write_json(&paths.manifest, &manifest.to_value(), None)
        .expect("manifest only");
    let sidecar_only = DriftLine {
        id: Some("d-sidecar-only".into()),
        at: "2026-11-29T10:00:00.000000Z".into(),
        run_id: manifest.run_id.clone(),
        saved_config_digest: "c".into(),
        current_config_digest: "d".into(),
        operational_keys: vec!["collection.timeout_s".into()],
    };
    recovery_sidecar::append_line(
        &paths.resume_drift,
        &serde_json::to_vec(&sidecar_only).expect("json"),
    )
    .expect("append");
    // A line naming another run is that run's business, not this journal's: reported.
    let foreign = DriftLine {
        run_id: "cd".repeat(16),
        ..sidecar_only.clone()
    };
    recovery_sidecar::append_line(
        &paths.resume_drift,
        &serde_json::to_vec(&foreign).expect("json"),
    )
    .expect("append");
    // A time RFC 3339 allows whose instant is past year 9999 in UTC (its offset carries it
    // there): reported, never a panic of the reindex.
    let beyond_the_years = DriftLine {
        id: Some("d-beyond".into()),
        at: "9999-12-31T23:30:00-01:00".into(),
        ..sidecar_only.clone()
    };
    recovery_sidecar::append_line(
        &paths.resume_drift,
        &serde_json::to_vec(&beyond_the_years).expect("json"),
    )
    .expect("append");
    recovery_sidecar::append_line(&paths.rerun_masked, br#"{"approval_id":"a1","at":"t","by":"op","reason":"r","task_index":3,"rollout_index":0,"attempt_index":1}"#).expect("append");
    recovery_sidecar::append_line(&paths.rerun_masked, b"not json").expect("append");
    recovery_sidecar::append_line(
        &paths.attempt_extension,
        br#"{"id":"x1","at":"t","extend_attempts":2,"by":"op","reason":"r"}"#,
    )
    .expect("append");
    recovery_sidecar::append_line(&paths.resubmit_offset, b"7").expect("append");
    let report = registry.reindex().await.expect("reindex");
    assert_eq!(
        (
            report.manifests,
            report.runs,
            report.drift_inserted,
            report.approvals_inserted,
            report.extensions_inserted,
            report.resubmits_inserted
        ),
        (1, 1, 1, 1, 1, 1)
    );
    assert_eq!(
        report.unreadable.len(),
        3,
        "the unreadable approval line is reported, and approves nothing; so are the foreign \
         drift line and the one beyond the years: {:?}",
        report.unreadable
    );
    assert!(
        report
            .unreadable
            .iter()
            .any(|(_, why)| why.starts_with("at: ")),
        "{:?}",
        report.unreadable
    );
    assert!(
        report
            .unreadable
            .iter()
            .any(|(_, why)| why.starts_with("run_id: ")),
        "{:?}",
        report.unreadable
    );
    assert_eq!(
        store
            .list_approvals(&manifest.run_id)
            .await
            .expect("approvals")
            .len(),
        1
    );
    assert_eq!(
        store
            .list_resubmits(&manifest.run_id)
            .await
            .expect("resubmits")[0]
            .line_offset,
        7
    );
    let again = registry.reindex().await.expect("again");
    assert_eq!(
        (again.runs, again.drift_inserted, again.approvals_inserted),
        (0, 0, 0)
    );
    let run = store
        .get_run(&manifest.run_id)
        .await
        .expect("run")
        .expect("recorded");
    assert!(
        run.output_path.ends_with("a/out.jsonl"),
        "{}",
        run.output_path
    );
}

#[tokio::test]
async fn recorded_events_are_journalled_then_stored_and_revocation_rewrites_the_journal() {
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let paths = registry
        .paths_for(&root.path().join("b/out.jsonl"))
        .expect("paths");
    let run = registry.lock_creating(&paths).await.expect("lock");
    let manifest = RunManifest::create("cd".repeat(16), "s", "m", "c", Some(3));
    registry
        .write_manifest(
            &run,
            &manifest,
            Some(&serde_json::json!({"collection": {}, "servers": {}, "token_id_capture": {}})),
        )
        .await
        .expect("write");
    assert!(paths.identity.exists() && paths.manifest.exists());
    let drift = registry
        .record_drift(&run, &manifest, "d", &["b.timeout".into(), "a.port".into()])
        .await
        .expect("drift");
    assert_eq!(
        drift.operational_keys,
        ["a.port", "b.timeout"],
        "keys are sorted"
    );
    let line = std::fs::read_to_string(&paths.resume_drift).expect("journal");
    let fields: BTreeSet<String> =
        serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&line)
            .expect("one JSON object")
            .keys()
            .cloned()
            .collect();
    assert_eq!(
        fields,
        [
            "at",
            "current_config_digest",
            "operational_keys",
            "run_id",
            "saved_config_digest"
        ]
        .map(String::from)
        .into(),
        "exactly the fields of decisions §6: {line}"
    );
    assert_eq!(
        drift_ids(&paths.resume_drift),
        std::slice::from_ref(&drift.event_id),
        "the event id derives from the line"
    );
    let first = registry
        .record_approval(&run, &manifest.run_id, "op", "lost artifact", (3, 0, 1))
        .await
        .expect("approval");
    let second = registry
        .record_approval(&run, &manifest.run_id, "op", "lost artifact", (4, 0, 2))
        .await
        .expect("approval");
    let approvals = recovery_core::journals::rerun_masked_approvals(
        std::fs::File::open(&paths.rerun_masked).expect("journal"),
    );
    assert_eq!(
        approvals,
        BTreeSet::from([(3, 0, 1), (4, 0, 2)]),
        "the core reads what the registry writes"
    );
    assert!(
        registry
            .revoke_approval(&run, &manifest.run_id, &first.approval_id)
            .await
            .expect("revoke")
    );
    let approvals = recovery_core::journals::rerun_masked_approvals(
        std::fs::File::open(&paths.rerun_masked).expect("journal"),
    );
    assert_eq!(
        approvals,
        BTreeSet::from([(4, 0, 2)]),
        "a revoked approval no longer approves anything"
    );
    assert!(
        store
            .list_approvals(&manifest.run_id)
            .await
            .expect("list")
            .iter()
            .any(|a| a.approval_id == first.approval_id && a.revoked_at.is_some())
    );
    // A revocation takes away the lines of its id only, and leaves every other byte (hostile
    // review 40: it also dropped an unterminated last line). Lines written by hand: one
    // reusing the second approval's id (it approves nothing), one whole, one unterminated.
    let hand = |id: &str, task: i64| {
        serde_json::json!({"approval_id": id, "at": "2026-12-05T12:00:00Z", "by": "op", "reason": "r", "task_index": task, "rollout_index": 0, "attempt_index": 0})
            .to_string()
    };
    let journal_before = std::fs::read(&paths.rerun_masked).expect("journal");
    let reused = format!("{}\n", hand(&second.approval_id, 5));
    let torn = hand("hand-2", 7);
    // An unterminated last line reusing the revoked id goes with it: once ended by the next
    // append, it would approve under that id (hostile review 41).
    let torn_of_revoked = hand("hand-1", 8);
    let mut journal = journal_before.clone();
    journal.extend_from_slice(reused.as_bytes());
    journal.extend_from_slice(format!("{}\n", hand("hand-1", 6)).as_bytes());
    journal.extend_from_slice(format!("{torn}\n").as_bytes());
    journal.extend_from_slice(torn_of_revoked.as_bytes());
    std::fs::write(&paths.rerun_masked, &journal).expect("hand-written lines");
    let read = || {
        recovery_core::journals::rerun_masked_approvals(
            std::fs::File::open(&paths.rerun_masked).expect("journal"),
        )
    };
    assert_eq!(read(), BTreeSet::from([(4, 0, 2), (6, 0, 0), (7, 0, 0)]));
    assert!(
        registry
            .revoke_approval(&run, &manifest.run_id, "hand-1")
            .await
            .expect("revoke")
    );
    assert_eq!(
        std::fs::read(&paths.rerun_masked).expect("journal"),
        [
            journal_before,
            reused.into_bytes(),
            format!("{torn}\n").into_bytes()
        ]
        .concat(),
        "every other byte stays"
    );
    assert_eq!(read(), BTreeSet::from([(4, 0, 2), (7, 0, 0)]));
    // A revocation keeps an unterminated last line of another id, byte for byte.
    let mut journal = std::fs::read(&paths.rerun_masked).expect("journal");
    let unended = hand("hand-3", 9);
    journal.extend_from_slice(format!("{}\n", hand("hand-4", 10)).as_bytes());
    journal.extend_from_slice(unended.as_bytes());
    std::fs::write(&paths.rerun_masked, &journal).expect("hand-written lines");
    assert!(
        registry
            .revoke_approval(&run, &manifest.run_id, "hand-4")
            .await
            .expect("revoke")
    );
    assert!(
        std::fs::read(&paths.rerun_masked)
            .expect("journal")
            .ends_with(format!("}}\n{unended}").as_bytes()),
        "the unterminated line stays as it was"
    );
    // A revoked id written into the journal again approves in the plan: a reindex records it
    // again, unrevoked, so the list shows it and a revocation takes it away (hostile review 41:
    // listed as revoked while it approved, and refused revocation).
    let mut journal = std::fs::read(&paths.rerun_masked).expect("journal");
    let len = journal.len();
    journal.truncate(len - unended.len());
    journal.extend_from_slice(format!("{}\n", hand(&first.approval_id, 3)).as_bytes());
    std::fs::write(&paths.rerun_masked, &journal).expect("revoked id again");
    assert!(read().contains(&(3, 0, 0)));
    drop(run);
    let report = registry.reindex().await.expect("reindex");
    assert_eq!(report.approvals_restored, 1, "{report:?}");
    let listed = store.list_approvals(&manifest.run_id).await.expect("list");
    let again = listed
        .iter()
        .find(|a| a.approval_id == first.approval_id)
        .expect("listed");
    assert_eq!(
        (again.revoked_at.as_deref(), again.task_index),
        (None, 3),
        "{again:?}"
    );
    let run = registry.lock(&paths).await.expect("lock");
    assert!(
        registry
            .revoke_approval(&run, &manifest.run_id, &first.approval_id)
            .await
            .expect("revoke")
    );
    assert!(!read().contains(&(3, 0, 0)));
    // A line edited in place (another rollout under the same id, the first line of it now) is
    // listed as the plan honours it after a reindex (hostile review 42).
    let second_now = store
        .list_approvals(&manifest.run_id)
        .await
        .expect("list")
        .into_iter()
        .find(|a| a.approval_id == second.approval_id)
        .expect("second");
    assert_eq!(second_now.task_index, 4);
    let journal =
        String::from_utf8(std::fs::read(&paths.rerun_masked).expect("journal")).expect("text");
    let edited: String = journal
        .split_inclusive('\n')
        .map(|line| {
            if line.contains(&second.approval_id) && line.contains("\"task_index\":4") {
                line.replace("\"task_index\":4", "\"task_index\":11")
            } else {
                line.to_owned()
            }
        })
        .collect();
    assert_ne!(edited, journal, "the second approval's line was edited");
    std::fs::write(&paths.rerun_masked, edited).expect("edited in place");
    assert!(read().contains(&(11, 0, 2)));
    drop(run);
    let report = registry.reindex().await.expect("reindex");
    assert_eq!(report.approvals_restored, 1, "{report:?}");
    let listed = store.list_approvals(&manifest.run_id).await.expect("list");
    assert!(
        listed
            .iter()
            .any(|a| a.approval_id == second.approval_id && a.task_index == 11),
        "{listed:?}"
    );
    let run = registry.lock(&paths).await.expect("lock");
    registry
        .record_extension(&run, &manifest.run_id, "op", "outage", 2)
        .await
        .expect("extension");
    let extension = recovery_core::journals::attempt_extension(
        std::fs::File::open(&paths.attempt_extension).expect("journal"),
        "x",
    )
    .expect("sum");
    assert_eq!(extension, 2);
    std::fs::write(&paths.failures, b"{\"a\":1}\n{\"b\":2}\n{\"torn\":").expect("failures");
    let resubmit = registry
        .record_resubmit(&run, &manifest.run_id, "op")
        .await
        .expect("resubmit");
    assert_eq!(
        resubmit.line_offset, 2,
        "a torn tail is repaired away and never counted"
    );
    let offset = recovery_core::journals::resubmit_offset(
        std::fs::File::open(&paths.resubmit_offset).expect("file"),
        "x",
    )
    .expect("offset");
    assert_eq!(offset, 2);
    assert!(
        registry.paths_for(Path::new("/etc/out.jsonl")).is_err(),
        "outputs stay under the roots"
    );
}

fn request(root: &Path, holder: &str, ttl_seconds: i64) -> LeaseRequest {
    LeaseRequest {
        actor: "collector-token".into(),
        run_id: "run-1".into(),
        holder: holder.into(),
        host: "node-1".into(),
        pid: 4242,
        ttl: time::Duration::seconds(ttl_seconds),
        lock_paths: vec![root.join("out_run.lock")],
    }
}

/// A section of a leased run that is the first to find the lease's lock file removed (nobody
/// holding the new one) takes the new file for the lease and runs under it: the section is
/// granted, no other owner can lock the file meanwhile, and the lease goes on (audited once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_section_that_finds_the_lease_lock_file_removed_takes_the_new_one_and_runs_under_it() {
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let paths = registry
        .paths_for(&root.path().join("m/out.jsonl"))
        .expect("paths");
    // A run's directory exists (its manifest is there): a lease never makes it.
    std::fs::create_dir_all(root.path().join("m")).expect("run directory");
    let lease = registry
        .leases()
        .acquire(&LeaseRequest {
            lock_paths: vec![paths.run_lock.clone()],
            ..request(root.path(), "collector-a", 600)
        })
        .await
        .expect("lease");
    std::fs::remove_file(&paths.run_lock).expect("remove the lock file");
    let section = registry
        .lock(&paths)
        .await
        .expect("the section runs under the lease");
    assert!(
        matches!(
            recovery_sidecar::RunLock::acquire([paths.run_lock.clone()]),
            Err(recovery_sidecar::LockError::Owned(_))
        ),
        "the new lock file is held"
    );
    drop(section);
    registry
        .leases()
        .heartbeat("run-1", &lease.lease_id, time::Duration::seconds(600))
        .await
        .expect("the lease goes on");
    let audit = store.list_audit(Some("run-1"), 10).await.expect("audit");
    assert_eq!(
        audit
            .iter()
            .filter(|a| a.action == "lease.lock_retaken")
            .count(),
        1,
        "{audit:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_hold_the_run_lock_exclusively_until_released_expired_or_taken_over() {
    let root = tempfile::tempdir().expect("root");
    let store = sqlite_store(root.path()).await;
    let clock = Arc::new(ManualClock::new(time::OffsetDateTime::now_utc()));
    let leases = Leases::new(store.clone(), clock.clone(), "replica-a");
    let first = leases
        .acquire(&request(root.path(), "collector-a", 30))
        .await
        .expect("first");
    match leases
        .acquire(&request(root.path(), "collector-b", 30))
        .await
    {
        Err(LeaseError::Held(holder)) => {
            assert_eq!((holder.holder.as_str(), holder.pid), ("collector-a", 4242))
        }
        other => panic!("{other:?}"),
    }
    // Another replica (another open file) cannot take the lock either.
    let other_replica = Leases::new(store.clone(), clock.clone(), "replica-b");
    assert!(matches!(
        other_replica
            .acquire(&request(root.path(), "collector-c", 30))
            .await,
        Err(LeaseError::Locked(_))
    ));
    clock.advance(time::Duration::seconds(20));
    leases
        .heartbeat("run-1", &first.lease_id, time::Duration::seconds(30))
        .await
        .expect("heartbeat");
    clock.advance(time::Duration::seconds(25));
    assert!(
        leases.sweep().await.expect("sweep").is_empty(),
        "a renewed lease is live"
    );
    clock.advance(time::Duration::seconds(10));
    let expired = leases.sweep().await.expect("sweep");
    assert_eq!(expired.len(), 1, "the lease expired");
    assert!(matches!(
        leases
            .heartbeat("run-1", &first.lease_id, time::Duration::seconds(30))
            .await,
        Err(LeaseError::NotHolder { .. })
    ));
    let second = other_replica
        .acquire(&request(root.path(), "collector-c", 30))
        .await
        .expect("expiry freed the run and its lock");
    let audit = store.list_audit(Some("run-1"), 10).await.expect("audit");
    assert!(audit.iter().any(|a| a.action == "lease.expired"));
    // An operator takes the run over on the replica that holds it: audited.
    let (taken, previous) = other_replica
        .takeover(
            "alice",
            "collector hung",
            &request(root.path(), "collector-d", 30),
        )
        .await
        .expect("takeover");
    assert_eq!(
        previous.map(|p| p.lease_id),
        Some(second.lease.lease_id.clone())
    );
    assert!(matches!(
        other_replica
            .heartbeat("run-1", &second.lease_id, time::Duration::seconds(30))
            .await,
        Err(LeaseError::NotHolder { .. })
    ));
    let audit = store.list_audit(Some("run-1"), 10).await.expect("audit");
    let entry = audit
        .iter()
        .find(|a| a.action == "lease.takeover")
        .expect("takeover audited");
    assert_eq!(
        (
            entry.actor.as_str(),
            entry.details["previous_holder"].as_str()
        ),
        ("alice", Some("collector-c"))
    );
    other_replica
        .release("operator", "run-1", &taken.lease_id)
        .await
        .expect("release");
    assert!(
        leases
            .acquire(&request(root.path(), "collector-e", 30))
            .await
            .is_ok(),
        "released runs are free"
    );
    assert_eq!(leases.release_all().await.expect("shutdown"), 1);
    assert_eq!(
        store.get_lease("run-1").await.expect("lease"),
        None,
        "shutdown releases leases"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_acquirers_of_one_run_get_exactly_one_lease() {
    let root = tempfile::tempdir().expect("root");
    let store = sqlite_store(root.path()).await;
    let clock: Arc<SystemClock> = Arc::new(SystemClock);
    let replicas: Vec<Leases> = (0..4)
        .map(|r| Leases::new(store.clone(), clock.clone(), format!("replica-{r}")))
        .collect();
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let leases = replicas[i % 4].clone();
            let barrier = Arc::clone(&barrier);
            let request = request(root.path(), &format!("collector-{i}"), 60);
            tokio::spawn(async move {
                barrier.wait().await;
                leases.acquire(&request).await.is_ok()
            })
        })
        .collect();
    let mut granted = 0;
    for task in tasks {
        granted += usize::from(task.await.expect("task"));
    }
    assert_eq!(granted, 1, "exactly one of 64 acquirers holds the run");
}

/// At the start, a lease whose run directory was removed while the service was down is ended
/// (`lease.lost`): the directory is not made again for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_run_directory_was_removed_is_ended_at_the_start_and_nothing_is_made() {
    let root = tempfile::tempdir().expect("root");
    let store = sqlite_store(root.path()).await;
    let clock: Arc<SystemClock> = Arc::new(SystemClock);
    let run_dir = root.path().join("gone");
    std::fs::create_dir_all(&run_dir).expect("run directory");
    let before = Leases::new(store.clone(), clock.clone(), "replica-a");
    before
        .acquire(&LeaseRequest {
            lock_paths: vec![run_dir.join("out_run.lock")],
            ..request(root.path(), "collector-a", 600)
        })
        .await
        .expect("granted");
    drop(before);
    std::fs::remove_dir_all(&run_dir).expect("remove the run directory");
    let after = Leases::new(store.clone(), clock, "replica-a");
    assert!(after.adopt_live(|_| true).await.expect("start").is_empty());
    assert!(!run_dir.exists(), "the run directory is not made again");
    assert!(store.get_lease("run-1").await.expect("row").is_none());
    let audit = store.list_audit(Some("run-1"), 10).await.expect("audit");
    assert!(audit.iter().any(|a| a.action == "lease.lost"), "{audit:?}");
}

/// At the start, a lease of this service whose lock path is no lock file now (a link, FIFO or
/// directory put there while it was down), or no longer under the roots, is ended (audited
/// `lease.lost`, saying why) instead of staying live with the run unusable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_lock_path_is_no_lock_file_at_the_start_is_ended() {
    type Spoil = fn(&Path);
    let cases: [(&str, Spoil, bool); 3] = [
        (
            "a symbolic link",
            |lock| std::os::unix::fs::symlink("elsewhere.lock", lock).expect("link"),
            true,
        ),
        (
            "a directory",
            |lock| std::fs::create_dir(lock).expect("dir"),
            true,
        ),
        ("outside the roots", |_| {}, false),
    ];
    for (case, spoil, confined) in cases {
        let root = tempfile::tempdir().expect("root");
        let store = sqlite_store(root.path()).await;
        let clock: Arc<SystemClock> = Arc::new(SystemClock);
        let before = Leases::new(store.clone(), clock.clone(), "replica-a");
        before
            .acquire(&request(root.path(), "collector-a", 600))
            .await
            .expect("granted");
        // The service stops (its flock goes with it, the lease row stays).
        drop(before);
        let lock = root.path().join("out_run.lock");
        std::fs::remove_file(&lock).expect("remove");
        spoil(&lock);
        let after = Leases::new(store.clone(), clock, "replica-a");
        let adopted = after.adopt_live(|_| confined).await.expect("start");
        assert!(adopted.is_empty(), "{case}");
        assert!(
            store.get_lease("run-1").await.expect("row").is_none(),
            "{case}: the lease ended"
        );
        let audit = store.list_audit(Some("run-1"), 10).await.expect("audit");
        assert!(
            audit.iter().any(|a| a.action == "lease.lost"),
            "{case}: {audit:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_lease_whose_replica_stopped_is_taken_again_by_exactly_one_of_many_starting_replicas()
 {
    let root = tempfile::tempdir().expect("root");
    let store = sqlite_store(root.path()).await;
    let clock: Arc<SystemClock> = Arc::new(SystemClock);
    let gone = Leases::new(store.clone(), clock.clone(), "replica-gone").among_replicas();
    let lease = gone
        .acquire(&request(root.path(), "collector-a", 600))
        .await
        .expect("granted");
    // The replica stops without a word: its flock goes with it, the lease row stays.
    drop(gone);
    let replicas: Vec<Leases> = (0..8)
        .map(|r| Leases::new(store.clone(), clock.clone(), format!("replica-{r}")).among_replicas())
        .collect();
    // A lock path no longer under the roots (they changed while the service was down) is not
    // taken again.
    assert!(
        replicas[0]
            .adopt_live(|_| false)
            .await
            .expect("adopt")
            .is_empty()
    );
    let barrier = Arc::new(tokio::sync::Barrier::new(replicas.len()));
    let tasks: Vec<_> = replicas
        .iter()
        .cloned()
        .map(|leases| {
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                barrier.wait().await;
                leases.adopt_live(|_| true).await.expect("adopt").len()
            })
        })
        .collect();
    let mut adopted = Vec::new();
    for task in tasks {
        adopted.push(task.await.expect("task"));
    }
    assert_eq!(adopted.iter().sum::<usize>(), 1, "{adopted:?}");
    let winner = &replicas[adopted.iter().position(|n| *n == 1).expect("one")];
    // The collector renews at the adopting replica under the lease it was granted; another
    // collector is refused everywhere, and the lock file is held.
    winner
        .heartbeat("run-1", &lease.lease_id, time::Duration::seconds(600))
        .await
        .expect("renewed");
    for leases in &replicas {
        assert!(
            leases
                .acquire(&request(root.path(), "collector-b", 60))
                .await
                .is_err()
        );
    }
    let probe = Command::new("python3")
        .args(["-c", PYTHON_PROBE])
        .arg(root.path().join("out_run.lock"))
        .output()
        .expect("python3");
    assert_eq!(String::from_utf8_lossy(&probe.stdout).trim(), "blocked");
    let row = store.get_lease("run-1").await.expect("row").expect("lease");
    assert_eq!(
        (
            row.lease_id,
            row.holder,
            row.replica.starts_with("replica-")
        ),
        (
            recovery_store::lease_digest(&lease.lease_id),
            "collector-a".to_owned(),
            true
        )
    );
}

/// Runs `leases`' lease sweep, as its service does every second (every 10 ms here), until the
/// returned flag is set.
fn sweeping(
    leases: &Leases,
) -> (
    Arc<std::sync::atomic::AtomicBool>,
    tokio::task::JoinHandle<()>,
) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (flag, leases) = (Arc::clone(&stop), leases.clone());
    let task = tokio::spawn(async move {
        while !flag.load(std::sync::atomic::Ordering::SeqCst) {
            leases.sweep().await.expect("sweep");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    (stop, task)
}

fn python_probe(lock: &Path) -> String {
    let probe = Command::new("python3")
        .args(["-c", PYTHON_PROBE])
        .arg(lock)
        .output()
        .expect("python3");
    String::from_utf8_lossy(&probe.stdout).trim().to_owned()
}

/// Among replicas, calls reaching the replica that does not hold the run's lock: an acquire
/// during the other's live lease is refused naming its holder; a takeover ends that lease and
/// holds the lock once the other replica let go at its sweep; a release answers once the
/// holding replica let go, so a Python collector started right after finds the run free
/// (hostile review 33: the takeover always failed 423, the lock outlived the release by up to
/// 5 s, the acquire's refusal read as a process outside the service).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_asked_of_the_replica_without_the_lock_hand_it_over() {
    let root = tempfile::tempdir().expect("root");
    let store = sqlite_store(root.path()).await;
    let clock: Arc<SystemClock> = Arc::new(SystemClock);
    let a = Leases::new(store.clone(), clock.clone(), "replica-a").among_replicas();
    let b = Leases::new(store.clone(), clock.clone(), "replica-b").among_replicas();
    let lock = root.path().join("out_run.lock");
    let checkpoint = root.path().join("ck/.collector.lock");
    let mut with_checkpoint = request(root.path(), "collector-a", 600);
    with_checkpoint.lock_paths.push(checkpoint.clone());
    let first = a.acquire(&with_checkpoint).await.expect("granted");
    match b.acquire(&request(root.path(), "collector-b", 60)).await {
        Err(LeaseError::Held(live)) => assert_eq!(live.holder, "collector-a"),
        other => panic!("{other:?}"),
    }
    let (stop, task) = sweeping(&a);
    let (taken, previous) = b
        .takeover(
            "operator",
            "stuck",
            &request(root.path(), "collector-b", 600),
        )
        .await
        .expect("taken over at the replica without the lock");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    task.await.expect("sweeper");
    assert_eq!(previous.map(|p| p.holder).as_deref(), Some("collector-a"));
    assert!(b.holds("run-1") && !a.holds("run-1"));
    assert_eq!(python_probe(&lock), "blocked");
    // The checkpoint directory stays locked for the new holder (hostile review 35).
    assert_eq!(python_probe(&checkpoint), "blocked");
    assert!(
        a.heartbeat("run-1", &first.lease_id, time::Duration::seconds(60))
            .await
            .is_err(),
        "the previous lease ended"
    );
    let (stop, task) = sweeping(&b);
    a.release("collector-token", "run-1", &taken.lease_id)
        .await
        .expect("released at the replica without the lock");
    // Once the release answered, the run's lock is free (before the sweeper is stopped).
    assert_eq!(python_probe(&lock), "acquired");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    task.await.expect("sweeper");
    assert!(!b.holds("run-1"));
    let audit = store.list_audit(Some("run-1"), 20).await.expect("audit");
    let actions: Vec<&str> = audit.iter().map(|e| e.action.as_str()).collect();
    assert!(
        actions.contains(&"lease.takeover") && actions.contains(&"lease.released"),
        "{actions:?}"
    );
}

/// A lease that expired while its service was down is ended at the next start and audited
/// as a sweep would have (hostile review 33: its row stayed, no `lease.expired` ever said it
/// ended); a lease still live is left to its collector.
#[tokio::test]
async fn a_lease_that_expired_while_the_service_was_down_is_ended_and_audited_at_the_start() {
    let root = tempfile::tempdir().expect("root");
    let store = sqlite_store(root.path()).await;
    let clock = Arc::new(ManualClock::new(time::OffsetDateTime::now_utc()));
    let before = Leases::new(store.clone(), clock.clone(), "replica-a");
    before
        .acquire(&request(root.path(), "collector-a", 2))
        .await
        .expect("granted");
    let mut other = request(root.path(), "collector-b", 600);
    other.run_id = "run-2".into();
    other.lock_paths = vec![root.path().join("two_run.lock")];
    before.acquire(&other).await.expect("granted");
    // The service stops; the short lease expires meanwhile.
    drop(before);
    clock.advance(time::Duration::seconds(3));
    let after = Leases::new(store.clone(), clock.clone(), "replica-a");
    let ended = after.end_expired_while_down().await.expect("start");
    assert_eq!(
        ended.iter().map(|l| l.holder.as_str()).collect::<Vec<_>>(),
        ["collector-a"]
    );
    assert!(store.get_lease("run-1").await.expect("row").is_none());
    assert!(store.get_lease("run-2").await.expect("row").is_some());
    let audit = store.list_audit(Some("run-1"), 10).await.expect("audit");
    assert_eq!(
        audit.iter().filter(|a| a.action == "lease.expired").count(),
        1,
        "{audit:?}"
    );
    assert!(
        after
            .end_expired_while_down()
            .await
            .expect("again")
            .is_empty(),
        "ended once"
    );
}

const PYTHON_HOLDER: &str = "import fcntl, sys\nf = open(sys.argv[1], 'a+b')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nprint('locked', flush=True)\nsys.stdin.read()\n";
const PYTHON_PROBE: &str = "import fcntl, sys\nf = open(sys.argv[1], 'a+b')\ntry:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    print('acquired')\nexcept BlockingIOError:\n    print('blocked')\n";

#[tokio::test]
async fn a_python_collector_holding_the_lock_refuses_a_lease_and_a_lease_refuses_python() {
    let root = tempfile::tempdir().expect("root");
    let store = sqlite_store(root.path()).await;
    let leases = Leases::new(store, Arc::new(SystemClock), "replica-a");
    let lock_path = root.path().join("out_run.lock");
    let mut python = Command::new("python3")
        .args(["-c", PYTHON_HOLDER])
        .arg(&lock_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    BufReader::new(python.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    assert_eq!(line.trim(), "locked");
    let error = leases
        .acquire(&request(root.path(), "collector-a", 30))
        .await
        .expect_err("Python owns it");
    let text = error.to_string();
    assert!(
        text.contains("Another collector owns this run")
            && text.contains(&lock_path.display().to_string()),
        "{text}"
    );
    drop(python.stdin.take());
    python.wait().expect("python exits");
    let lease = leases
        .acquire(&request(root.path(), "collector-a", 30))
        .await
        .expect("free");
    let probe = Command::new("python3")
        .args(["-c", PYTHON_PROBE])
        .arg(&lock_path)
        .output()
        .expect("python3");
    assert_eq!(
        String::from_utf8_lossy(&probe.stdout).trim(),
        "blocked",
        "a live lease blocks Python's flock"
    );
    leases
        .release("collector-token", "run-1", &lease.lease_id)
        .await
        .expect("release");
    let probe = Command::new("python3")
        .args(["-c", PYTHON_PROBE])
        .arg(&lock_path)
        .output()
        .expect("python3");
    assert_eq!(
        String::from_utf8_lossy(&probe.stdout).trim(),
        "acquired",
        "a released lease frees the flock"
    );
}

/// Sets a file's modification time `seconds` ago (its change time becomes now).
fn settle(path: &Path, seconds: u64) {
    let file = std::fs::File::options()
        .append(true)
        .open(path)
        .expect("open");
    file.set_modified(std::time::SystemTime::now() - Duration::from_secs(seconds))
        .expect("mtime");
}

#[test]
fn a_cached_derivation_is_reused_until_the_file_changes_in_any_way() {
    use recovery_runs::cache::FileCache;
    use std::cell::Cell;
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("source.jsonl");
    std::fs::write(&path, b"one\n").expect("write");
    let cache: FileCache<String> = FileCache::default();
    let reads = Cell::new(0);
    let derive = |p: &Path| {
        reads.set(reads.get() + 1);
        std::fs::read_to_string(p)
    };
    // A file changed just now is read every time: a same-size rewrite in the same timestamp
    // tick would keep its identity.
    cache.get(&path, derive).expect("read");
    cache.get(&path, derive).expect("read");
    assert_eq!(reads.get(), 2, "a racy file is never served from the cache");
    // Changing the modification time also changes the change time (now): wait until the file
    // settles by polling, as a collector's dataset does long before it is validated.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let changes: [(&str, &dyn Fn()); 3] = [
        ("an append changes the size", &|| {
            std::fs::write(&path, b"one\ntwo\n").expect("append")
        }),
        (
            "an atomic replace of the same size changes the inode",
            &|| recovery_sidecar::atomic_write(&path, b"one\nTWO\n", None).expect("replace"),
        ),
        (
            "an in-place rewrite of the same size changes the times",
            &|| std::fs::write(&path, b"ONE\nTWO\n").expect("rewrite"),
        ),
    ];
    let settled_read = |expected: &str| {
        loop {
            let before = reads.get();
            assert_eq!(cache.get(&path, derive).expect("derive"), expected);
            assert_eq!(cache.get(&path, derive).expect("again"), expected);
            if reads.get() == before + 1 {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the file never settled"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    settle(&path, 60);
    settled_read("one\n");
    for (case, change) in changes {
        let before = reads.get();
        change();
        settle(&path, 60);
        let expected = std::fs::read_to_string(&path).expect("read");
        assert_eq!(
            cache.get(&path, derive).expect("derive"),
            expected,
            "{case}"
        );
        assert!(reads.get() > before, "{case}: read again");
        settled_read(&expected);
    }
    std::fs::remove_file(&path).expect("remove");
    assert!(
        cache.get(&path, derive).is_err(),
        "a missing file is never served from the cache"
    );
}

#[tokio::test]
async fn a_replacement_a_crash_interrupted_is_undone_or_completed_at_the_next_start() {
    use recovery_runs::operations::ReplaceIntent;
    struct Case {
        name: &'static str,
        moved: bool,
        new_manifest: bool,
        old_files_back: bool,
    }
    let cases = [
        Case {
            name: "killed after the intent, before any move",
            moved: false,
            new_manifest: false,
            old_files_back: true,
        },
        Case {
            name: "killed after the moves, before the new manifest",
            moved: true,
            new_manifest: false,
            old_files_back: true,
        },
        Case {
            name: "killed after the new manifest, before the database",
            moved: true,
            new_manifest: true,
            old_files_back: false,
        },
    ];
    for case in cases {
        let root = tempfile::tempdir().expect("root");
        let (_, registry) = sqlite_registry(root.path()).await;
        let paths = registry
            .paths_for(&root.path().join("x/out.jsonl"))
            .expect("paths");
        std::fs::create_dir_all(paths.output.parent().expect("dir")).expect("dir");
        let old = RunManifest::create("aa".repeat(16), "s", "m", "c", Some(3));
        let old_files = [
            (&paths.output, "{\"saved\": \"old result\"}\n".to_owned()),
            (
                &paths.materialized,
                "{\"_ng_task_index\": 0, \"_ng_rollout_index\": 0}\n".to_owned(),
            ),
            (&paths.manifest, old.to_pretty_json().expect("json")),
        ];
        for (path, text) in &old_files {
            std::fs::write(path, text).expect("old file");
        }
        let new_run_id = "bb".repeat(16);
        let moves: Vec<(std::path::PathBuf, std::path::PathBuf)> = old_files
            .iter()
            .map(|(p, _)| {
                (
                    (*p).clone(),
                    std::path::PathBuf::from(format!("{}.replaced-1", p.display())),
                )
            })
            .collect();
        let intent = ReplaceIntent {
            output: paths.output.clone(),
            new_run_id: new_run_id.clone(),
            moves: moves.clone(),
        };
        std::fs::write(
            &paths.replace_intent,
            serde_json::to_vec(&intent).expect("json"),
        )
        .expect("intent");
        if case.moved {
            for (from, to) in &moves {
                std::fs::rename(from, to).expect("move");
            }
            std::fs::write(&paths.materialized, "{\"new\": 1}\n").expect("new rows");
            std::fs::write(&paths.output, "").expect("new output");
        }
        if case.new_manifest {
            let new = RunManifest::create(new_run_id.clone(), "s", "m2", "c", Some(3));
            std::fs::write(&paths.manifest, new.to_pretty_json().expect("json"))
                .expect("new manifest");
        }
        let recovered = registry.recover_replacements().await.expect("recover");
        assert_eq!(
            recovered,
            [(paths.output.clone(), case.old_files_back)],
            "{}",
            case.name
        );
        assert!(
            !paths.replace_intent.exists(),
            "{}: the intent is gone",
            case.name
        );
        for ((path, text), (_, aside)) in old_files.iter().zip(&moves) {
            if case.old_files_back {
                assert_eq!(
                    &std::fs::read_to_string(path).expect("back"),
                    text,
                    "{}: {} is the old run's again",
                    case.name,
                    path.display()
                );
                assert!(!aside.exists(), "{}", case.name);
            } else {
                assert_eq!(
                    &std::fs::read_to_string(aside).expect("aside"),
                    text,
                    "{}: the old run stays aside",
                    case.name
                );
            }
        }
        let report = registry.reindex().await.expect("reindex");
        let owner = if case.old_files_back {
            old.run_id.clone()
        } else {
            new_run_id.clone()
        };
        assert_eq!(
            registry
                .store()
                .find_run_by_output(&paths.output.display().to_string())
                .await
                .expect("find")
                .map(|r| r.run_id),
            Some(owner),
            "{}: {report:?}",
            case.name
        );
    }
}

#[tokio::test]
async fn a_reindex_reads_an_append_only_journal_from_where_the_last_one_stopped() {
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let (paths, manifest) = manifest_on_disk(&registry, root.path(), "cc");
    let line = |n: u32| {
        drift_line(
            &manifest.run_id,
            &format!("2026-11-29T10:00:{n:02}.000000Z"),
            &format!("d{n}"),
        )
    };
    std::fs::write(&paths.resume_drift, (0..3).map(line).collect::<String>()).expect("journal");
    let steps: [(&str, &dyn Fn(), usize); 6] = [
        ("the first reindex reads every line", &|| {}, 3),
        ("an unchanged journal is not read again", &|| {}, 0),
        (
            "an appended line is read alone",
            &|| {
                recovery_sidecar::append_line(&paths.resume_drift, line(3).trim_end().as_bytes())
                    .expect("append");
            },
            1,
        ),
        (
            "a journal replaced by another file is read from its start",
            &|| {
                let text: String = (10..12).map(line).collect();
                recovery_sidecar::atomic_write(&paths.resume_drift, text.as_bytes(), None)
                    .expect("replace");
            },
            2,
        ),
        (
            "a journal rewritten in place, longer than its mark, is read from its start",
            &|| {
                // The same inode: what `open(path, "w")`, `cp` over it or an editor saving in
                // place does. Reading from the mark would start mid-line.
                let text: String = (20..25).map(line).collect();
                std::fs::write(&paths.resume_drift, text).expect("rewrite in place");
            },
            5,
        ),
        ("and is then not read again", &|| {}, 0),
    ];
    for (case, change, inserted) in steps {
        change();
        let report = registry.reindex().await.expect("reindex");
        assert_eq!(report.drift_inserted, inserted, "{case}");
        assert!(report.unreadable.is_empty(), "{case}: {report:?}");
    }
    let all = store
        .query_drift(&DriftFilter {
            run_id: Some(manifest.run_id.clone()),
            limit: 100,
            ..Default::default()
        })
        .await
        .expect("rows");
    assert_eq!(all.len(), 11, "every line ever journalled is indexed once");
}

/// A journal line that gives a key twice is read as CPython's `json.loads` reads it: the last
/// value counts, also when the first is of the wrong type (hostile reviews 47 and 48: such lines
/// were reported unreadable). An extension line whose last value is no count >= 1 is refused, as
/// the plan refuses it (review 48: reindex recorded 0 and -2 without a word).
#[tokio::test]
async fn a_journal_line_with_a_key_given_twice_is_read_with_its_last_value() {
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let (paths, manifest) = manifest_on_disk(&registry, root.path(), "dk");
    let run = &manifest.run_id;
    let drift = |first_at: &str, keys: &str, at: &str| {
        format!(
            "{{\"at\": {first_at}, \"operational_keys\": {keys}, \"at\": \"{at}\", \"run_id\": \"{run}\", \"saved_config_digest\": \"c\", \"current_config_digest\": \"d\", \"operational_keys\": [\"a.port\"]}}\n"
        )
    };
    let journal = [
        drift(
            "\"2026-11-29T10:00:01.000000Z\"",
            "[]",
            "2026-11-29T10:00:02.000000Z",
        ),
        drift("null", "7", "2026-11-29T10:00:03.000000Z"),
    ]
    .concat();
    std::fs::write(&paths.resume_drift, journal).expect("drift journal");
    let extension = |first: &str, last: &str| {
        format!(
            "{{\"at\": \"2026-11-29T10:00:03Z\", \"extend_attempts\": {first}, \"extend_attempts\": {last}, \"by\": \"ops\", \"reason\": \"judge outage\"}}\n"
        )
    };
    // The last ones have no `reason`, a null `by`, a `by` that is no string, no `at`: the plan
    // counts them by `extend_attempts` alone, so they are recorded (reviews 49, 50).
    let extensions = [
        extension("1", "4"),
        extension("\"x\"", "2"),
        extension("5", "0"),
        "{\"at\": \"2026-11-29T10:00:04Z\", \"extend_attempts\": 3, \"by\": null}\n".to_owned(),
        "{\"at\": \"2026-11-29T10:00:05Z\", \"extend_attempts\": 5, \"by\": {\"team\": 7}}\n"
            .to_owned(),
        "{\"extend_attempts\": 6, \"by\": \"ops\", \"reason\": 12}\n".to_owned(),
    ]
    .concat();
    std::fs::write(&paths.attempt_extension, extensions).expect("extension journal");
    // A negative count is no line count, as the plan reads it (review 49).
    std::fs::write(&paths.resubmit_offset, "-1\n").expect("resubmit offsets");
    let report = registry.reindex().await.expect("reindex");
    assert_eq!(report.drift_inserted, 2, "{report:?}");
    let refused: Vec<&str> = report
        .unreadable
        .iter()
        .map(|(_, why)| why.as_str())
        .collect();
    assert_eq!(report.resubmits_inserted, 0, "{report:?}");
    assert_eq!(
        refused,
        [
            recovery_core::journals::EXTENSION_REFUSED,
            "not a line count"
        ],
        "{report:?}"
    );
    let events = store
        .query_drift(&DriftFilter {
            run_id: Some(run.clone()),
            limit: 10,
            ..Default::default()
        })
        .await
        .expect("drift");
    let times: Vec<&str> = events.iter().map(|e| e.at.as_str()).collect();
    assert_eq!(
        times,
        ["2026-11-29T10:00:02.000000Z", "2026-11-29T10:00:03.000000Z"]
    );
    let extensions = store.list_extensions(run).await.expect("extensions");
    let mut added: Vec<i64> = extensions.iter().map(|e| e.extend_attempts).collect();
    added.sort();
    assert_eq!(added, [2, 3, 4, 5, 6]);
    let named: Vec<(&str, &str)> = extensions
        .iter()
        .filter(|e| e.extend_attempts >= 5)
        .map(|e| (e.by.as_str(), e.reason.as_str()))
        .collect();
    assert!(named.contains(&("{\"team\":7}", "")), "{named:?}");
    assert!(named.contains(&("ops", "12")), "{named:?}");
}

/// Drift lines a Python collector wrote with `isoformat()` offsets are stored in the one UTC form
/// every query compares as text, so time filters and order follow the instants; a line whose
/// `at` is no time is reported, never indexed out of order.
#[tokio::test]
async fn drift_times_written_with_offsets_are_indexed_as_the_instants_they_name() {
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let (paths, manifest) = manifest_on_disk(&registry, root.path(), "ee");
    let line = |at: &str| drift_line(&manifest.run_id, at, "d");
    let written = [
        "2031-06-01T12:00:00+00:00",
        "2031-06-01T13:30:00+01:00",
        "2031-06-01T11:00:00.25Z",
        "yesterday",
    ];
    std::fs::write(&paths.resume_drift, written.map(line).concat()).expect("journal");
    let report = registry.reindex().await.expect("reindex");
    assert_eq!(report.drift_inserted, 3, "{report:?}");
    assert!(
        report
            .unreadable
            .iter()
            .any(|(_, why)| why.contains("yesterday")),
        "{report:?}"
    );
    let between = |from: &str, to: &str| {
        let store = store.clone();
        let filter = DriftFilter {
            run_id: Some(manifest.run_id.clone()),
            from: Some(from.to_owned()),
            to: Some(to.to_owned()),
            limit: 10,
            ..Default::default()
        };
        async move {
            store
                .query_drift(&filter)
                .await
                .expect("rows")
                .into_iter()
                .map(|e| e.at)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        between("2031-06-01T12:00:00.000000Z", "2031-06-01T13:00:00.000000Z").await,
        ["2031-06-01T12:00:00.000000Z", "2031-06-01T12:30:00.000000Z"],
        "an event at exactly `from` is in; 13:30+01:00 is 12:30 UTC"
    );
    assert_eq!(
        between("2031-06-01T00:00:00.000000Z", "2031-06-01T12:00:00.000000Z").await,
        ["2031-06-01T11:00:00.250000Z"]
    );
}

/// Manifests of runs at `<root>/<name>/out.jsonl`, each run's id its name's first letter
/// (hex) repeated.
fn runs_on_disk(
    registry: &Registry,
    root: &Path,
    names: &[&str],
) -> Vec<(SidecarPaths, RunManifest)> {
    names
        .iter()
        .map(|name| {
            let paths = registry
                .paths_for(&root.join(format!("{name}/out.jsonl")))
                .expect("paths");
            std::fs::create_dir_all(paths.manifest.parent().expect("dir")).expect("dir");
            let manifest = RunManifest::create(name[..1].repeat(32), "s", "m", "c", Some(3));
            std::fs::write(&paths.manifest, manifest.to_pretty_json().expect("json"))
                .expect("manifest");
            (paths, manifest)
        })
        .collect()
}

/// A reindex merges the drift journals of several runs, whose times interleave, into one time
/// order (SQLite then inserts at the end of its time-ordered tables): every line is indexed
/// once, across several batches of each journal and of the merge; the recorded order is time
/// order; an unreadable line is reported once; a run without a journal is no matter; and each
/// journal is read on from its own mark afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_journals_of_several_runs_are_merged_into_time_order_and_read_on_from_their_marks()
 {
    const LINES: u32 = 25_000;
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let runs = runs_on_disk(&registry, root.path(), &["a", "b", "c", "d"]);
    let at = |n: u32| format!("2026-11-29T10:00:00.{n:06}Z");
    for (k, (paths, manifest)) in runs.iter().take(3).enumerate() {
        let mut journal = String::new();
        for i in 0..LINES {
            if k == 1 && i == LINES / 2 {
                journal.push_str("{\"not a drift line\n");
            }
            let n = 3 * i + k as u32;
            journal.push_str(&drift_line(&manifest.run_id, &at(n), &format!("d{n}")));
        }
        std::fs::write(&paths.resume_drift, journal).expect("journal");
    }
    let first = registry.reindex().await.expect("reindex");
    assert_eq!(first.drift_inserted, 3 * LINES as usize);
    assert_eq!(first.unreadable.len(), 1, "{:?}", first.unreadable);
    let times: Vec<String> = recorded_drift(&store, None)
        .await
        .into_iter()
        .map(|e| e.at)
        .collect();
    assert_eq!(times.len(), 3 * LINES as usize);
    assert!(
        times.windows(2).all(|pair| pair[0] <= pair[1]),
        "the recorded order is time order"
    );
    for (k, (paths, manifest)) in runs.iter().take(3).enumerate() {
        for i in 0..4 {
            let n = 900_000 + 10 * i + k as u32;
            let line = drift_line(&manifest.run_id, &at(n), "late");
            recovery_sidecar::append_line(&paths.resume_drift, line.trim_end().as_bytes())
                .expect("append");
        }
    }
    let second = registry.reindex().await.expect("reindex again");
    assert_eq!(
        second.drift_inserted, 12,
        "only the appended lines are read"
    );
    assert!(second.unreadable.is_empty(), "{:?}", second.unreadable);
    assert_eq!(registry.reindex().await.expect("third").drift_inserted, 0);
    for (paths, manifest) in runs.iter().take(3) {
        let ids: BTreeSet<String> = drift_ids_readable(&paths.resume_drift)
            .into_iter()
            .collect();
        let stored = stored_drift_ids(&store, &manifest.run_id).await;
        assert_eq!(stored.len(), ids.len(), "run {}", manifest.run_id);
        assert!(
            stored == ids,
            "run {}: the rows are the lines",
            manifest.run_id
        );
    }
}

/// Fourteen runs (`0`-`9`, `a`-`d`), each with a drift journal of `lines` lines whose times
/// interleave with the others'.
fn many_interleaved_runs(
    registry: &Registry,
    root: &Path,
    lines: u32,
) -> Vec<(SidecarPaths, RunManifest)> {
    let names = [
        "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "a", "b", "c", "d",
    ];
    let runs = runs_on_disk(registry, root, &names);
    let at = |n: u32| {
        format!(
            "2026-11-29T10:00:{:02}.{:06}Z",
            n / 1_000_000,
            n % 1_000_000
        )
    };
    let count = runs.len() as u32;
    for (k, (paths, manifest)) in runs.iter().enumerate() {
        let journal: String = (0..lines)
            .map(|i| {
                let n = count * i + k as u32;
                drift_line(&manifest.run_id, &at(n), &format!("d{n}"))
            })
            .collect();
        std::fs::write(&paths.resume_drift, journal).expect("journal");
    }
    runs
}

/// At start-up, many runs' journals whose times interleave (more runs than a reindex beside
/// the service's work merges, eight) are merged into one time order: the recorded order is time
/// order across all of them, every line indexed once. (Runs merged eight at a time inserted each
/// later group's events among the earlier groups', rewriting SQLite's pages all along its
/// tables: 1M lines over 96 runs were indexed at a third of the rate of 1M over 4.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journals_of_many_runs_whose_times_interleave_are_recorded_in_one_time_order() {
    const LINES: u32 = 400;
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let runs = many_interleaved_runs(&registry, root.path(), LINES);
    let count = runs.len() as u32;
    let report = registry.reindex_at_start().await.expect("reindex");
    assert_eq!(report.drift_inserted, (count * LINES) as usize);
    assert!(report.unreadable.is_empty(), "{:?}", report.unreadable);
    let times: Vec<String> = recorded_drift(&store, None)
        .await
        .into_iter()
        .map(|e| e.at)
        .collect();
    assert_eq!(times.len(), (count * LINES) as usize);
    let first_out_of_order = times.windows(2).position(|pair| pair[0] > pair[1]);
    assert_eq!(
        first_out_of_order, None,
        "the recorded order is time order across every run"
    );
    assert_eq!(registry.reindex().await.expect("again").drift_inserted, 0);
}

/// A reindex beside the service's work locks the runs it indexes a few at a time: while one run
/// is held (a long operation), a run indexed in an earlier group is free again once its lines
/// are in, and the reindex goes on once the held run is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reindex_beside_the_service_frees_each_group_of_runs_before_waiting_for_the_next() {
    const LINES: u32 = 50;
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let runs = many_interleaved_runs(&registry, root.path(), LINES);
    let (first, last) = (&runs[0], &runs[runs.len() - 1]);
    let held = registry.lock(&last.0).await.expect("hold the last run");
    let reindex = tokio::spawn({
        let registry = registry.clone();
        async move { registry.reindex().await.expect("reindex") }
    });
    let indexed = async {
        while stored_drift_ids(&store, &first.1.run_id).await.len() < LINES as usize {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), indexed)
        .await
        .expect("the first run's lines are indexed while the last run is held");
    let first_run = tokio::time::timeout(Duration::from_secs(60), registry.lock(&first.0))
        .await
        .expect("the first run is not held while the reindex waits for the last")
        .expect("lock");
    drop(first_run);
    drop(held);
    let report = tokio::time::timeout(Duration::from_secs(60), reindex)
        .await
        .expect("the reindex ends once the last run is let go")
        .expect("task");
    assert_eq!(report.drift_inserted, runs.len() * LINES as usize);
}

/// Reindexes (which lock the rows of several runs at once) run beside each other, beside a
/// reindex of one run and beside writers journalling drift under their run's lock: none waits
/// for another forever, and afterwards every journal line is a drift row, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reindexes_and_drift_writers_index_every_line_once() {
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let runs = runs_on_disk(&registry, root.path(), &["a", "b", "c", "e", "f"]);
    let mut tasks = Vec::new();
    for (paths, manifest) in &runs[..3] {
        let (registry, paths, manifest) = (registry.clone(), paths.clone(), manifest.clone());
        tasks.push(tokio::spawn(async move {
            for n in 0..60 {
                let run = registry.lock(&paths).await.expect("lock");
                registry
                    .record_drift(&run, &manifest, &format!("d{n}"), &["a.port".to_owned()])
                    .await
                    .expect("drift");
            }
        }));
    }
    for n in 0..4 {
        let registry = registry.clone();
        let manifest = runs[n % runs.len()].0.manifest.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                registry.reindex().await.expect("reindex");
                registry
                    .reindex_manifest(&manifest)
                    .await
                    .expect("reindex one");
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("no reindex or writer waits forever")
            .expect("task");
    }
    registry.reindex().await.expect("reindex");
    for (paths, manifest) in &runs {
        let lines = drift_ids(&paths.resume_drift);
        let stored = stored_drift_ids(&store, &manifest.run_id).await;
        assert_eq!(stored.len(), lines.len(), "run {}", manifest.run_id);
        assert_eq!(stored, lines.into_iter().collect::<BTreeSet<_>>());
    }
}

/// A journal of several batches (each read and parsed while the previous one is inserted) is
/// indexed whole: every line once, the last included, and nothing read again afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_longer_than_a_batch_is_indexed_whole_and_once() {
    const LINES: u32 = 45_001;
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let (paths, manifest) = manifest_on_disk(&registry, root.path(), "dd");
    let at = |n: u32| format!("2026-11-29T10:00:00.{n:06}Z");
    let journal: String = (0..LINES)
        .map(|n| drift_line(&manifest.run_id, &at(n), &format!("d{n}")))
        .collect();
    std::fs::write(&paths.resume_drift, journal).expect("journal");
    let first = registry.reindex().await.expect("reindex");
    assert_eq!(first.drift_inserted, LINES as usize, "{first:?}");
    assert!(first.unreadable.is_empty(), "{first:?}");
    let again = registry.reindex().await.expect("reindex again");
    assert_eq!(again.drift_inserted, 0, "the mark is past the last line");
    let last = store
        .query_drift(&DriftFilter {
            run_id: Some(manifest.run_id.clone()),
            from: Some(at(LINES - 1)),
            limit: 10,
            ..Default::default()
        })
        .await
        .expect("rows");
    assert_eq!(
        last.iter().map(|e| e.at.clone()).collect::<Vec<_>>(),
        vec![at(LINES - 1)],
        "the last line of the last batch is indexed"
    );
}

#[tokio::test]
async fn a_revocation_the_database_never_heard_of_is_taken_from_the_journal_by_reindex() {
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let paths = registry
        .paths_for(&root.path().join("r/out.jsonl"))
        .expect("paths");
    let manifest = RunManifest::create("dd".repeat(16), "s", "m", "c", Some(3));
    let run = registry.lock_creating(&paths).await.expect("lock");
    registry
        .write_manifest(&run, &manifest, None)
        .await
        .expect("manifest");
    let kept = registry
        .record_approval(&run, &manifest.run_id, "op", "kept", (1, 0, 0))
        .await
        .expect("approval");
    let revoked = registry
        .record_approval(&run, &manifest.run_id, "op", "revoked", (2, 0, 0))
        .await
        .expect("approval");
    drop(run);
    // The revocation's journal rewrite happened; the process died before the database's.
    let line = std::fs::read_to_string(&paths.rerun_masked).expect("journal");
    let without: String = line
        .lines()
        .filter(|l| !l.contains(&revoked.approval_id))
        .map(|l| format!("{l}\n"))
        .collect();
    recovery_sidecar::atomic_write(&paths.rerun_masked, without.as_bytes(), None).expect("rewrite");
    let report = registry.reindex().await.expect("reindex");
    assert_eq!(report.approvals_revoked, 1);
    let approvals = store
        .list_approvals(&manifest.run_id)
        .await
        .expect("approvals");
    let state = |id: &str| {
        approvals
            .iter()
            .find(|a| a.approval_id == id)
            .map(|a| a.revoked_at.is_some())
    };
    assert_eq!(
        state(&kept.approval_id),
        Some(false),
        "a journalled approval stands"
    );
    assert_eq!(
        state(&revoked.approval_id),
        Some(true),
        "the journal's revocation reaches the database"
    );
    assert_eq!(
        registry.reindex().await.expect("again").approvals_revoked,
        0,
        "idempotent"
    );
}

/// Blocking work runs below the async workers' priority (so a worker answering `/healthz`
/// preempts it), and lowering it never lowers a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_work_runs_at_a_lower_priority_than_the_async_workers() {
    let nice =
        || rustix::process::getpriority_process(Some(rustix::thread::gettid())).expect("nice");
    let worker_before = nice();
    for _ in 0..8 {
        let blocking = recovery_runs::background::spawn(nice)
            .await
            .expect("blocking work");
        assert_eq!(
            blocking,
            (worker_before + 5).min(19),
            "a blocking thread runs at +5"
        );
    }
    let on_worker = tokio::spawn(async move { nice() }).await.expect("worker");
    assert_eq!(nice(), worker_before, "this worker kept its priority");
    assert_eq!(
        on_worker, worker_before,
        "the other worker kept its priority"
    );
}

/// A validation's resume event rides in the drift row's transaction, completed as a resume
/// across drift, and only once the journal line is durable: when the line cannot be written
/// the event stays with the caller, who records the failure with the keys it was about (nothing
/// is half-kept).
#[tokio::test]
async fn a_resume_event_is_committed_with_its_drift_row_only_once_the_line_is_durable() {
    let root = tempfile::tempdir().expect("root");
    let (store, registry) = sqlite_registry(root.path()).await;
    let paths = registry
        .paths_for(&root.path().join("c/out.jsonl"))
        .expect("paths");
    let run = registry.lock_creating(&paths).await.expect("lock");
    let manifest = RunManifest::create("ef".repeat(16), "s", "m", "c", Some(3));
    registry
        .write_manifest(&run, &manifest, None)
        .await
        .expect("write");
    let pending = |id: &str| recovery_store::ResumeEvent {
        event_id: id.to_owned(),
        run_id: Some(manifest.run_id.clone()),
        output_path: paths.output.display().to_string(),
        at: "2026-01-01T00:00:00.000000Z".into(),
        outcome: String::new(),
        message: String::new(),
        reasons: vec![],
        semantic_keys: vec![],
        operational_keys: vec![],
        saved_config_digest: Some(manifest.config_digest.clone()),
        current_config_digest: None,
        client: Some("collector-1".into()),
    };
    let keys = ["a.port".to_owned()];

    // A directory where the journal belongs: the append fails, the event is not taken.
    std::fs::create_dir(&paths.resume_drift).expect("plant a directory");
    let mut event = Some(pending("e1"));
    let failed = registry
        .record_drift_with(&run, &manifest, "d1", &keys, &mut event)
        .await;
    assert!(failed.is_err(), "{failed:?}");
    assert_eq!(
        event,
        Some(recovery_store::ResumeEvent {
            operational_keys: keys.to_vec(),
            current_config_digest: Some("d1".into()),
            ..pending("e1")
        }),
        "kept for the caller, naming the drift it attempted, with no outcome decided"
    );
    assert!(
        store
            .list_resume_events(&manifest.run_id, 10)
            .await
            .expect("events")
            .is_empty()
    );

    std::fs::remove_dir(&paths.resume_drift).expect("remove the directory");
    let drift = registry
        .record_drift_with(&run, &manifest, "d2", &keys, &mut event)
        .await
        .expect("recorded");
    assert_eq!(event, None, "taken and committed");
    let recorded = store
        .list_resume_events(&manifest.run_id, 10)
        .await
        .expect("events");
    assert_eq!(
        recorded,
        [recovery_store::ResumeEvent {
            outcome: "resume_with_drift".into(),
            operational_keys: keys.to_vec(),
            current_config_digest: Some("d2".into()),
            ..pending("e1")
        }]
    );
    let stored = store
        .query_drift(&DriftFilter {
            run_id: Some(manifest.run_id.clone()),
            ..Default::default()
        })
        .await
        .expect("drift rows");
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(stored[0].event_id, drift.event_id);
}

/// A scratch PostgreSQL database (made and dropped with `psql`, as the CLI suite does).
struct ScratchPostgres {
    admin: String,
    name: String,
    url: String,
}

impl ScratchPostgres {
    fn create() -> Self {
        let admin = std::env::var("RR_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
        let name = format!("rr_test_{}", recovery_sidecar::new_id());
        let made = Command::new("psql")
            .arg(&admin)
            .args(["-v", "ON_ERROR_STOP=1", "-q", "-c"])
            .arg(format!("CREATE DATABASE {name}"))
            .output()
            .expect("psql");
        assert!(
            made.status.success(),
            "PostgreSQL must be reachable at {admin} (start it with: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start): {}",
            String::from_utf8_lossy(&made.stderr)
        );
        let (server, _) = admin
            .split('?')
            .next()
            .and_then(|base| base.rsplit_once('/'))
            .expect("a database in the admin URL");
        let url = format!("{server}/{name}");
        Self { admin, name, url }
    }
}

impl Drop for ScratchPostgres {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .arg(&self.admin)
            .args(["-q", "-c"])
            .arg(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .output();
    }
}

/// Shared sections of one run at two replicas of one PostgreSQL database (two registries, each
/// with its own `flock`s, as two processes have): both hold the advisory lock in shared mode,
/// and each replica's sections hold the run's `flock` in turn, so a replica whose section finds
/// it held by the other's waits for it instead of refusing as if a collector owned the run
/// (hostile review 37: 27 of 80 concurrent validates without a lease, across two replicas, were
/// refused 423 "Another collector owns this run"). Every journal line is whole and recorded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_sections_of_one_run_at_two_replicas_take_turns_instead_of_refusing() {
    let database = ScratchPostgres::create();
    let root = tempfile::tempdir().expect("root");
    let replica = |name: &'static str| {
        let (url, root) = (database.url.clone(), root.path().to_owned());
        async move {
            Registry::new(
                Store::connect(&url).await.expect("store"),
                Confinement::new([root]).expect("root"),
                Arc::new(SystemClock),
                name,
            )
        }
    };
    let (one, two) = (replica("replica-a").await, replica("replica-b").await);
    let (paths, manifest) = manifest_on_disk(&one, root.path(), "ab");
    let start = Arc::new(tokio::sync::Barrier::new(16));
    let tasks: Vec<_> = (0..16)
        .map(|n| {
            let registry = if n % 2 == 0 { one.clone() } else { two.clone() };
            let (paths, manifest, start) = (paths.clone(), manifest.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                for i in 0..10 {
                    let section = registry
                        .lock_shared(&paths)
                        .await
                        .unwrap_or_else(|e| panic!("task {n}, section {i}: {e}"));
                    registry
                        .record_drift(
                            &section,
                            &manifest,
                            &format!("d{n}-{i}"),
                            &["a.port".to_owned()],
                        )
                        .await
                        .expect("drift");
                }
            })
        })
        .collect();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("every section ends")
            .expect("task");
    }
    let lines = drift_ids(&paths.resume_drift);
    assert_eq!(lines.len(), 160, "every line whole, once");
    let stored = stored_drift_ids(one.store(), &manifest.run_id).await;
    assert_eq!(stored, lines.into_iter().collect::<BTreeSet<_>>());
    one.store().close().await;
    two.store().close().await;
}

/// A legacy import numbers untagged outcomes in reading order, the whole failures sidecar
/// before the results file. A sidecar line appended after the results were indexed is planned
/// as a cold read plans it (hostile review 41: the warm plan numbered it after the results and
/// answered otherwise than after a restart, for the same files).
#[test]
fn a_legacy_runs_plan_caught_up_with_an_appended_sidecar_line_equals_the_cold_plan() {
    use recovery_runs::plans::{PlanCache, legacy_manifest, plan_once};
    let dir = tempfile::tempdir().expect("dir");
    let paths = SidecarPaths::for_output(&dir.path().join("out.jsonl"));
    std::fs::write(
        &paths.materialized,
        "{\"_ng_task_index\":0,\"_ng_rollout_index\":0}\n{\"_ng_task_index\":1,\"_ng_rollout_index\":0}\n",
    )
    .expect("inputs");
    let judged = serde_json::json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "reward": 0.0, "invalid_judge_response": true,
        "response": {"output": [{"type": "message"}], "status": "completed"}});
    std::fs::write(&paths.output, format!("{judged}\n")).expect("results");
    std::fs::write(&paths.failures, "").expect("failures");
    let manifest = legacy_manifest(&paths, "0123456789abcdef0123456789abcdef").expect("legacy");
    std::fs::write(&paths.manifest, manifest.to_pretty_json().expect("json")).expect("manifest");
    let states = |plan: &recovery_runs::plans::RunPlan<'_>| {
        let view = plan.view();
        (0..2)
            .map(|p| {
                let entry = view.entry(p);
                (entry.state, entry.latest_attempt)
            })
            .collect::<Vec<_>>()
    };
    let cache = PlanCache::default();
    cache.with_plan(&paths, 3, states).expect("warm plan");
    let mut migrated = judged.clone();
    migrated["_ng_failure_class"] = serde_json::json!("judge_invalid");
    migrated["_ng_migrated_invalid_judge_response"] = serde_json::json!(true);
    std::fs::write(&paths.failures, format!("{migrated}\n")).expect("sidecar line");
    let warm = cache.with_plan(&paths, 3, states).expect("caught up");
    let cold = plan_once(&paths, 3, states).expect("cold");
    assert_eq!(warm, cold);
}

/// The one rule by which recorded approvals follow the journal the plan reads (the list, a
/// revocation and a reindex all apply it), one case per row.
#[test]
fn recorded_approvals_follow_the_journal_by_one_rule() {
    use recovery_runs::approvals::{Follow, follow_journal, record_of};
    let line = |id: &str, attempt: i64, reason: &str| recovery_core::journals::ApprovalLine {
        approval_id: id.into(),
        at: "2026-12-05T12:00:00Z".into(),
        by: "op".into(),
        reason: reason.into(),
        task_index: 1,
        rollout_index: 0,
        attempt_index: attempt,
    };
    let record = |id: &str, attempt: i64, used: Option<i64>, revoked: bool| {
        let mut record = record_of("r", line(id, attempt, "r"));
        record.consumed_by_attempt = used;
        record.revoked_at = revoked.then(|| "2026-12-05T13:00:00Z".to_owned());
        record
    };
    let restored = |id: &str, attempt: i64, reason: &str| {
        vec![Follow::Restore(record_of("r", line(id, attempt, reason)))]
    };
    // (name, the record, the journal line as (attempt, reason), the changes)
    type Case<'a> = (
        &'a str,
        Option<recovery_store::Approval>,
        Option<(i64, &'a str)>,
        Vec<Follow>,
    );
    let cases: Vec<Case> = vec![
        (
            "a line the database lacks is inserted",
            None,
            Some((0, "r")),
            vec![Follow::Insert(record_of("r", line("x", 0, "r")))],
        ),
        (
            "a line as recorded changes nothing",
            Some(record("x", 0, None, false)),
            Some((0, "r")),
            vec![],
        ),
        (
            "a revoked id written again is restored",
            Some(record("x", 0, None, true)),
            Some((0, "r")),
            restored("x", 0, "r"),
        ),
        (
            "an open approval's edited line is restored",
            Some(record("x", 0, None, false)),
            Some((0, "edited")),
            restored("x", 0, "edited"),
        ),
        (
            "a used approval's line for the same attempt stays used",
            Some(record("x", 0, Some(1), false)),
            Some((0, "edited")),
            vec![],
        ),
        (
            "a used approval's line for another attempt approves it",
            Some(record("x", 0, Some(1), false)),
            Some((1, "r")),
            restored("x", 1, "r"),
        ),
        (
            "an open approval gone from the journal is revoked",
            Some(record("x", 0, None, false)),
            None,
            vec![Follow::Revoke("x".into())],
        ),
        (
            "a used approval gone from the journal stays used",
            Some(record("x", 0, Some(1), false)),
            None,
            vec![],
        ),
        (
            "a revoked approval gone from the journal stays revoked",
            Some(record("x", 0, None, true)),
            None,
            vec![],
        ),
    ];
    for (name, recorded, journalled, expected) in cases {
        let journal = journalled
            .map(|(attempt, reason)| vec![line("x", attempt, reason)])
            .unwrap_or_default();
        let recorded: Vec<_> = recorded.into_iter().collect();
        assert_eq!(follow_journal("r", &recorded, journal), expected, "{name}");
    }
}
