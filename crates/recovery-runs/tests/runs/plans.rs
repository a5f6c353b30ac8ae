//! The plan cache: after any sequence of changes to a run's files, the plan a warm cache answers
//! equals the plan built cold from the same files (the same entries, coverage and warnings, or
//! the same refusal).

use recovery_core::manifest::RunManifest;
use recovery_runs::plans::{PlanCache, plan_once};
use recovery_sidecar::SidecarPaths;
use std::io::Write;

const RUN: &str = "0123456789abcdef0123456789abcdef";
const ROLLOUTS: u64 = 12;

/// xorshift64*: reproducible from the seed a failure prints.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn append(path: &std::path::Path, text: &str) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open");
    file.write_all(text.as_bytes()).expect("append");
}

fn outcome(task: u64, attempt: u64, kind: u64) -> String {
    let base = format!(
        "\"_ng_task_index\":{task},\"_ng_rollout_index\":0,\"_ng_attempt_index\":{attempt},\"_ng_run_id\":\"{RUN}\""
    );
    match kind {
        0 => {
            format!("{{{base},\"_ng_failure_class\":\"transport_peer_drop\",\"error\":\"reset\"}}")
        }
        1 => format!(
            "{{{base},\"_ng_failure_class\":\"agent_timeout\",\"_ng_failure_terminal\":true,\"elapsed_seconds\":{attempt}.5}}"
        ),
        2 => format!(
            "{{{base},\"reward\":1.0,\"response\":{{\"output\":[{{\"type\":\"message\"}}],\"status\":\"completed\"}}}}"
        ),
        3 => format!(
            "{{{base},\"reward\":0.0,\"mask_sample\":true,\"failure_kind\":\"verifier_error\",\"response\":{{\"output\":[{{\"type\":\"message\"}}],\"status\":\"completed\"}}}}"
        ),
        _ => format!(
            "{{{base},\"reward\":0.5,\"mask_sample\":true,\"failure_kind\":\"session_lost\"}}"
        ),
    }
}

struct Run {
    paths: SidecarPaths,
    manifest: RunManifest,
    /// The last outcome line written for each task, and its file.
    last: std::collections::HashMap<u64, (std::path::PathBuf, String)>,
}

impl Run {
    fn new(dir: &std::path::Path) -> Self {
        let paths = SidecarPaths::for_output(&dir.join("out.jsonl"));
        let rows: String = (0..ROLLOUTS)
            .map(|t| format!("{{\"_ng_task_index\":{t},\"_ng_rollout_index\":0,\"q\":\"{t}?\"}}\n"))
            .collect();
        std::fs::write(&paths.materialized, &rows).expect("inventory");
        let digest = recovery_core::materialized::materialized_digest(rows.as_bytes(), 1)
            .expect("digest")
            .sha256;
        std::fs::write(&paths.output, "").expect("output");
        std::fs::write(&paths.failures, "").expect("failures");
        let run = Self {
            paths,
            manifest: RunManifest::create(RUN, "s", digest, "c", Some(3)),
            last: std::collections::HashMap::new(),
        };
        run.write_manifest();
        run
    }

    fn write_manifest(&self) {
        let text = self.manifest.to_pretty_json().expect("manifest");
        recovery_sidecar::atomic_write(&self.paths.manifest, text.as_bytes(), None)
            .expect("manifest");
    }

    /// Reserves the next attempt of `task`; its number.
    fn reserve(&mut self, task: u64) -> u64 {
        let next = self
            .manifest
            .next_attempt
            .entry(format!("{task}-0"))
            .or_insert(0);
        *next += 1;
        let attempt = *next - 1;
        self.write_manifest();
        attempt
    }

    /// One random change to the run's files.
    fn change(&mut self, random: &mut Random) -> String {
        let task = random.below(ROLLOUTS);
        match random.below(14) {
            0..=5 => {
                let attempt = self.reserve(task);
                let kind = random.below(5);
                let path = if kind < 2 {
                    &self.paths.failures
                } else {
                    &self.paths.output
                };
                let line = outcome(task, attempt, kind);
                append(path, &format!("{line}\n"));
                self.last.insert(task, (path.clone(), line));
                format!("outcome kind {kind} for {task} attempt {attempt}")
            }
            6 => {
                let attempt = self.reserve(task);
                format!("reserved {task} attempt {attempt} without an outcome")
            }
            7 => {
                // The same outcome again (a retried write), with its keys in another order half
                // of the time: the first stands.
                let Some((path, line)) = self.last.get(&task).cloned() else {
                    return "nothing to repeat".into();
                };
                let line = if random.below(2) == 0 {
                    line
                } else {
                    let value: serde_json::Value = serde_json::from_str(&line).expect("line");
                    let mut entries: Vec<_> = value.as_object().expect("object").iter().collect();
                    entries.reverse();
                    let reordered: serde_json::Map<String, serde_json::Value> = entries
                        .into_iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect();
                    serde_json::Value::Object(reordered).to_string()
                };
                append(&path, &format!("{line}\n"));
                format!("repeated the last outcome of {task}")
            }
            8 => {
                // A torn tail (a collector killed mid-write), later completed or repaired.
                let attempt = self.reserve(task);
                let line = outcome(task, attempt, 2);
                let cut = 1 + random.below(line.len() as u64 - 1) as usize;
                append(&self.paths.output, &line[..cut]);
                if random.below(2) == 0 {
                    append(&self.paths.output, &format!("{}\n", &line[cut..]));
                    self.last.insert(task, (self.paths.output.clone(), line));
                    "a line written in two parts".into()
                } else {
                    recovery_sidecar::prepare_append(&self.paths.output).expect("repair");
                    "a torn tail, repaired".into()
                }
            }
            9 => {
                append(
                    &self.paths.attempt_extension,
                    "{\"at\":\"2026-01-01T00:00:00Z\",\"extend_attempts\":1,\"by\":\"op\",\"reason\":\"r\"}\n",
                );
                "extended the cap".into()
            }
            10 => {
                let lines = recovery_sidecar::read_lines(&self.paths.failures).expect("lines");
                append(&self.paths.resubmit_offset, &format!("{}\n", lines.len()));
                "resubmitted".into()
            }
            11 => {
                let attempt = self
                    .manifest
                    .next_attempt
                    .get(&format!("{task}-0"))
                    .copied();
                let attempt = attempt.and_then(|n| n.checked_sub(1)).unwrap_or(0);
                append(
                    &self.paths.rerun_masked,
                    &format!(
                        "{{\"approval_id\":\"a{task}x{attempt}\",\"at\":\"2026-01-01T00:00:00Z\",\"by\":\"op\",\"reason\":\"r\",\"task_index\":{task},\"rollout_index\":0,\"attempt_index\":{attempt}}}\n"
                    ),
                );
                "approved a masked rerun".into()
            }
            12 => {
                // The results file replaced by a copy (a new inode, the same lines).
                let bytes = std::fs::read(&self.paths.output).expect("read");
                recovery_sidecar::atomic_write(&self.paths.output, &bytes, None).expect("replace");
                "the results file replaced by a copy".into()
            }
            _ => {
                let mut policy = recovery_core::failure::ClassificationPolicy::default();
                let which = random.below(3);
                if which == 1 {
                    policy.kinds.insert(
                        "transport_peer_drop".into(),
                        recovery_core::failure::FailureClass::Model,
                    );
                }
                let text = match which {
                    2 => "{\"schema_version\": 9}".to_owned(),
                    _ => serde_json::to_string(&policy).expect("policy"),
                };
                std::fs::write(&self.paths.classification_policy, text).expect("policy");
                format!("classification policy variant {which}")
            }
        }
    }
}

/// An outcome file ending in an unterminated line that does not parse (a collector killed
/// mid-write) is warned of by the summary and the whole plan, naming the file's line; one that
/// parses is an outcome (counted, no warning), and a blank tail is nothing (facts §11.1: "ignored
/// with a warning"; hostile review 53, F3: the plan said nothing). Cold and warm alike.
#[test]
fn a_torn_final_line_is_warned_of_and_a_complete_unterminated_one_is_counted() {
    let torn = "{\"_ng_task_index\": 1, \"_ng_attem".to_owned();
    let cases = [
        ("a torn line", Some(torn), true, 1),
        ("a complete line without its line end", None, false, 2),
        (
            "blanks without a line end",
            Some("  \t".to_owned()),
            false,
            1,
        ),
    ];
    for (case, tail, warned, scored) in cases {
        let dir = tempfile::tempdir().expect("dir");
        let mut run = Run::new(dir.path());
        let first = run.reserve(0);
        let second = run.reserve(1);
        append(&run.paths.output, &format!("{}\n", outcome(0, first, 2)));
        let cache = PlanCache::default();
        // The warm cache has read the file, and counted its summary under the same manifest,
        // before the tail came (hostile review 54, N1: the counts stayed as they were).
        cache
            .with_plan(&run.paths, 3, |p| p.summary())
            .expect("plan");
        append(
            &run.paths.output,
            &tail.unwrap_or_else(|| outcome(1, second, 2)),
        );
        let answer = |p: &recovery_runs::plans::RunPlan<'_>| (p.summary(), p.resume_plan());
        let cold = plan_once(&run.paths, 3, answer).expect("cold");
        let warm = cache.with_plan(&run.paths, 3, answer).expect("warm");
        for (how, (summary, whole)) in [("cold", cold), ("warm", warm)] {
            let warning = summary
                .warnings
                .iter()
                .any(|w| w.starts_with("results line 2: an unterminated final line"));
            assert_eq!(warning, warned, "{case}, {how}: {:?}", summary.warnings);
            assert_eq!(summary.warnings, whole.warnings, "{case}, {how}");
            assert_eq!(summary.coverage.successful, scored, "{case}, {how}");
        }
    }
}

fn cold_and_warm_agree(cache: &PlanCache, run: &Run) -> Result<(), String> {
    // The whole plan, and the summary as `GET /plan` takes it (kept by a warm cache while
    // nothing it depends on changed).
    let plan = |p: &recovery_runs::plans::RunPlan<'_>| (p.resume_plan(), p.summary());
    let cold = plan_once(&run.paths, 3, plan).map_err(|e| e.to_string());
    let warm = cache
        .with_plan(&run.paths, 3, plan)
        .map_err(|e| e.to_string());
    let again = cache
        .with_plan(&run.paths, 3, plan)
        .map_err(|e| e.to_string());
    if warm != again {
        return Err(format!("warm: {warm:?}\nasked again: {again:?}"));
    }
    match (&cold, &warm) {
        (Ok(cold), Ok(warm)) if cold == warm => Ok(()),
        (Err(cold), Err(warm)) if cold == warm => Ok(()),
        _ => Err(format!("cold: {cold:?}\nwarm: {warm:?}")),
    }
}

#[test]
fn a_warm_plan_cache_answers_what_a_cold_build_of_the_same_files_answers() {
    for seed in [1u64, 7, 42, 1_000_003, 0x5eed_cafe, 99_991] {
        let dir = tempfile::tempdir().expect("dir");
        let mut run = Run::new(dir.path());
        let cache = PlanCache::default();
        let mut random = Random(seed);
        let mut history = Vec::new();
        cold_and_warm_agree(&cache, &run).expect("the empty run");
        for step in 0..120 {
            history.push(run.change(&mut random));
            if let Err(difference) = cold_and_warm_agree(&cache, &run) {
                panic!(
                    "seed {seed}, step {step}, after: {:#?}\n{difference}",
                    &history[history.len().saturating_sub(5)..]
                );
            }
        }
        // The run was planned, not refused, at the end (the sequence exercised the index).
        let outcomes = cache
            .with_plan(&run.paths, 3, |p| p.outcomes())
            .or_else(|_| {
                let _ = std::fs::remove_file(&run.paths.classification_policy);
                cache.with_plan(&run.paths, 3, |p| p.outcomes())
            });
        assert!(outcomes.is_ok_and(|n| n > 20), "seed {seed}: {history:#?}");
        // Appended outcomes and reservations are caught up with, never read from scratch.
        let before = cache.counts();
        for _ in 0..20 {
            let task = random.below(ROLLOUTS);
            let attempt = run.reserve(task);
            append(
                &run.paths.failures,
                &format!("{}\n", outcome(task, attempt, 0)),
            );
            cold_and_warm_agree(&cache, &run).expect("an appended failure");
        }
        let after = cache.counts();
        assert_eq!(after.builds, before.builds, "seed {seed}");
        // Two warm answers per change (the second finds nothing new).
        assert_eq!(after.catch_ups, before.catch_ups + 40, "seed {seed}");
    }
}

#[test]
fn a_conflicting_outcome_appended_to_a_warm_run_is_refused_as_a_cold_build_refuses_it() {
    let dir = tempfile::tempdir().expect("dir");
    let mut run = Run::new(dir.path());
    let cache = PlanCache::default();
    let attempt = run.reserve(3);
    append(&run.paths.output, &format!("{}\n", outcome(3, attempt, 2)));
    let state = cache
        .with_plan(&run.paths, 3, |p| {
            p.view().entry_for("3-0").map(|e| e.state)
        })
        .expect("plan");
    assert_eq!(state, Some(recovery_core::plan::PlanState::Scored));
    // Another payload for the same attempt: both builds name the conflict.
    append(&run.paths.output, &format!("{}\n", outcome(3, attempt, 3)));
    let warm = cache
        .with_plan(&run.paths, 3, |p| p.outcomes())
        .expect_err("a conflict");
    assert!(warm.to_string().contains("Conflicting outcomes"), "{warm}");
    cold_and_warm_agree(&cache, &run).expect("the same refusal");
}
