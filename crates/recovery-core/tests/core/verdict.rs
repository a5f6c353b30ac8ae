//! The `validate_resume` decision table (facts §12) and scenarios 2-6, 15, 44 and 45.

use recovery_core::drift::DriftPolicy;
use recovery_core::identity::{ConfigBundle, ConfigurationIdentity, RowReferences};
use recovery_core::manifest::RunManifest;
use recovery_core::verdict::{
    CurrentRun, Mismatch, ResumeVerdict, SavedManifest, SavedRun, validate_resume,
};
use serde_json::{Value, json};
use std::collections::BTreeMap;

fn global(temperature_judge: f64, judge_timeout: i64, scenario: i64) -> Value {
    json!({
        "policy_model": {"responses_api_models": {"vllm_model": {"model": "model-A", "host": "h", "port": 1}}},
        "judge": {"resources_servers": {"math_with_judge": {
            "judge_model_server": {"type": "responses_api_models", "name": "policy_model"},
            "judge_temperature": temperature_judge, "judge_timeout": judge_timeout}}},
        "agent": {"responses_api_agents": {"simple_agent": {
            "scenario": scenario,
            "resources_server": {"type": "resources_servers", "name": "judge"},
            "model_server": {"type": "responses_api_models", "name": "policy_model"}}}}
    })
}

fn identity(config: &Value, global: &Value) -> ConfigurationIdentity {
    let rows = RowReferences::from_rows(&[
        json!({"agent_ref": {"name": "agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0}),
    ]);
    let env = BTreeMap::new();
    ConfigurationIdentity::compute(ConfigBundle {
        config,
        global_config: global,
        rows: &rows,
        environment: &env,
    })
    .expect("identity")
}

fn config(num_repeats: i64, temperature: f64, parallel: i64) -> Value {
    json!({"num_repeats": num_repeats, "responses_create_params": {"temperature": temperature}, "num_samples_in_parallel": parallel, "request_timeout_s": 30})
}

struct Fixture {
    saved: SavedRun,
    original: ConfigurationIdentity,
}

fn fixture(with_identity_file: bool) -> Fixture {
    let original = identity(&config(1, 0.3, 8), &global(0.0, 60, 1));
    let manifest = RunManifest::create(
        "1".repeat(32),
        "source-digest",
        "rows-digest",
        original.config_digest.clone(),
        Some(3),
    );
    let saved = SavedRun {
        manifest_path: "/runs/out_manifest.json".into(),
        manifest: SavedManifest::Read(Box::new(manifest)),
        materialized: Ok("rows-digest".into()),
        identity: with_identity_file.then(|| original.identity.clone()),
    };
    Fixture { saved, original }
}

fn current(config: ConfigurationIdentity) -> CurrentRun {
    CurrentRun {
        source_digest: "source-digest".into(),
        materialized_digest: "rows-digest".into(),
        config: std::sync::Arc::new(config),
    }
}

fn refused_message(verdict: ResumeVerdict) -> (String, Vec<Mismatch>) {
    match verdict {
        ResumeVerdict::Refused {
            message,
            mismatches,
        } => (message, mismatches),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn an_identical_run_reuses_the_saved_manifest_unchanged() {
    let f = fixture(true);
    let verdict = validate_resume(
        &f.saved,
        Some(&current(f.original.clone())),
        false,
        &DriftPolicy::default(),
    );
    let ResumeVerdict::Reuse { manifest } = verdict else {
        panic!("{verdict:?}")
    };
    let SavedManifest::Read(saved) = &f.saved.manifest else {
        unreachable!()
    };
    assert_eq!(&manifest, saved.as_ref());
}

#[test]
fn scenario_2_any_changed_input_refuses_as_incompatible() {
    let f = fixture(false);
    let policy = DriftPolicy::default();
    let mut changed_source = current(f.original.clone());
    changed_source.source_digest = "other".into();
    let (message, _) = refused_message(validate_resume(
        &f.saved,
        Some(&changed_source),
        false,
        &policy,
    ));
    assert!(
        message.contains("incompatible source dataset") && message.contains("allow_unsafe_resume"),
        "{message}"
    );

    let mut corrupt = f.saved.clone();
    corrupt.materialized = Ok("tampered".into());
    let (message, _) = refused_message(validate_resume(
        &corrupt,
        Some(&current(f.original.clone())),
        false,
        &policy,
    ));
    assert!(
        message.contains("incompatible saved materialized inputs"),
        "{message}"
    );

    for (name, changed) in [
        (
            "temperature",
            identity(&config(1, 0.8, 8), &global(0.0, 60, 1)),
        ),
        ("judge", identity(&config(1, 0.3, 8), &global(0.5, 60, 1))),
    ] {
        let (message, mismatches) = refused_message(validate_resume(
            &f.saved,
            Some(&current(changed)),
            false,
            &policy,
        ));
        assert!(
            message.contains("incompatible resolved configuration"),
            "{name}: {message}"
        );
        assert_eq!(
            mismatches,
            vec![Mismatch::ResolvedConfiguration],
            "{name}: no saved identity, digest only"
        );
    }
}

#[test]
fn scenario_3_a_missing_manifest_refuses_unless_unsafe_imports_legacy() {
    let saved = SavedRun {
        manifest_path: "/r/out_manifest.json".into(),
        manifest: SavedManifest::Missing,
        materialized: Ok("x".into()),
        identity: None,
    };
    let policy = DriftPolicy::default();
    match validate_resume(&saved, None, false, &policy) {
        ResumeVerdict::NoManifest { message } => {
            assert!(message.contains("no run manifest") && message.contains("allow_unsafe_resume"))
        }
        other => panic!("{other:?}"),
    }
    match validate_resume(&saved, None, true, &policy) {
        ResumeVerdict::ImportLegacy { message } => assert!(message.contains("allow_unsafe_resume")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn scenarios_4_and_5_unreadable_manifests_refuse_even_when_unsafe() {
    let policy = DriftPolicy::default();
    for text in [
        r#"{"schema_version": 99}"#,
        "{",
        r#"{"run_id":"r","source_digest":"s","materialized_digest":"m","config_digest":"c","selection_policy":"any_success"}"#,
    ] {
        let manifest = match RunManifest::from_json_bytes(text.as_bytes()) {
            Ok(_) => panic!("{text} must not read"),
            Err(e) => SavedManifest::Unreadable(e.to_string()),
        };
        let saved = SavedRun {
            manifest_path: "/r/out_manifest.json".into(),
            manifest,
            materialized: Ok("x".into()),
            identity: None,
        };
        for unsafe_ in [false, true] {
            match validate_resume(&saved, None, unsafe_, &policy) {
                ResumeVerdict::Unreadable { message } => {
                    assert!(
                        message.contains("Cannot read") && message.contains("/r/out_manifest.json"),
                        "{message}"
                    );
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }
    let without_policy =
        r#"{"run_id":"r","source_digest":"s","materialized_digest":"m","config_digest":"c"}"#;
    assert!(
        RunManifest::from_json_bytes(without_policy.as_bytes()).is_ok(),
        "selection_policy defaults"
    );
    let mut f = fixture(true);
    f.saved.materialized = Err("line 3: invalid JSON".into());
    assert!(matches!(
        validate_resume(&f.saved, Some(&current(f.original.clone())), true, &policy),
        ResumeVerdict::Unreadable { .. }
    ));
}

#[test]
fn scenario_6_an_unsafe_override_is_sticky() {
    let f = fixture(true);
    let policy = DriftPolicy::default();
    let changed = identity(
        &json!({"num_repeats": 2, "responses_create_params": {"temperature": 0.3}}),
        &global(0.0, 60, 1),
    );
    let ResumeVerdict::Overridden {
        manifest, message, ..
    } = validate_resume(&f.saved, Some(&current(changed)), true, &policy)
    else {
        panic!("expected an override")
    };
    assert!(manifest.identity_overridden && manifest.run_id == "1".repeat(32));
    assert!(message.contains("allow_unsafe_resume"));
    let mut after = f.saved.clone();
    after.manifest = SavedManifest::Read(Box::new(manifest));
    let (message, _) = refused_message(validate_resume(
        &after,
        Some(&current(f.original.clone())),
        false,
        &policy,
    ));
    assert!(message.contains("previously overridden"), "{message}");
    let mut legacy = f.saved.clone();
    legacy.manifest = SavedManifest::Read(Box::new(RunManifest::import_legacy(
        "2".repeat(32),
        "rows-digest",
    )));
    let (message, _) = refused_message(validate_resume(
        &legacy,
        Some(&current(f.original.clone())),
        false,
        &policy,
    ));
    assert!(message.contains("unverified legacy run identity"));
    let (message, _) = refused_message(validate_resume(&f.saved, None, false, &policy));
    assert!(message.contains("current input/configuration identity"));
}

#[test]
fn scenario_44_operational_drift_resumes_naming_the_keys_to_journal() {
    let f = fixture(true);
    let changed = identity(
        &json!({"num_repeats": 1, "responses_create_params": {"temperature": 0.3}, "num_samples_in_parallel": 64, "request_timeout_s": 90}),
        &global(0.0, 120, 1),
    );
    for unsafe_ in [false, true] {
        match validate_resume(
            &f.saved,
            Some(&current(changed.clone())),
            unsafe_,
            &DriftPolicy::default(),
        ) {
            ResumeVerdict::ResumeWithDrift {
                manifest,
                operational_keys,
            } => {
                assert!(!manifest.identity_overridden);
                assert_eq!(
                    operational_keys,
                    vec![
                        "collection.request_timeout_s",
                        "servers.judge.resources_servers.math_with_judge.judge_timeout"
                    ]
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn scenario_45_semantic_drift_refuses_naming_the_semantic_keys() {
    let f = fixture(true);
    let policy = DriftPolicy::default();
    let table: Vec<(&str, ConfigurationIdentity, Vec<&str>)> = vec![
        (
            "num_repeats",
            identity(&config(4, 0.3, 8), &global(0.0, 60, 1)),
            vec!["collection.num_repeats"],
        ),
        (
            "temperature and a timeout",
            identity(
                &json!({"num_repeats": 1, "responses_create_params": {"temperature": 0.9}, "request_timeout_s": 99}),
                &global(0.0, 60, 1),
            ),
            vec!["collection.responses_create_params.temperature"],
        ),
        (
            "judge setting",
            identity(&config(1, 0.3, 8), &global(0.7, 60, 1)),
            vec!["servers.judge.resources_servers.math_with_judge.judge_temperature"],
        ),
    ];
    for (name, changed, keys) in table {
        let (message, mismatches) = refused_message(validate_resume(
            &f.saved,
            Some(&current(changed)),
            false,
            &policy,
        ));
        assert!(
            message.contains("incompatible resolved configuration"),
            "{name}: {message}"
        );
        let Some(Mismatch::SemanticConfiguration(found)) = mismatches.first() else {
            panic!("{name}: {mismatches:?}")
        };
        assert_eq!(
            found.iter().map(|k| k.key.as_str()).collect::<Vec<_>>(),
            keys,
            "{name}"
        );
        for key in keys {
            assert!(message.contains(key), "{name}: {message}");
        }
    }
    let unknown = identity(&config(1, 0.3, 8), &global(0.0, 60, 2));
    let (message, _) = refused_message(validate_resume(
        &f.saved,
        Some(&current(unknown)),
        false,
        &policy,
    ));
    assert!(
        message.contains(
            "No rule classifies servers.agent.responses_api_agents.simple_agent.scenario"
        ),
        "{message}"
    );
    assert!(
        message.contains("operational key in the service configuration"),
        "{message}"
    );
    let relaxed = DriftPolicy::extended(
        [],
        [],
        ["servers.agent.responses_api_agents.simple_agent.scenario".to_owned()],
    );
    let unknown = identity(&config(1, 0.3, 8), &global(0.0, 60, 2));
    assert!(matches!(
        validate_resume(&f.saved, Some(&current(unknown)), false, &relaxed),
        ResumeVerdict::ResumeWithDrift { .. }
    ));
}

#[test]
fn a_saved_identity_that_is_not_the_digested_one_falls_back_to_digest_comparison() {
    let mut f = fixture(true);
    f.saved.identity = Some(json!({"collection": {}, "servers": {}, "token_id_capture": {}}));
    let refused = |saved: &SavedRun| {
        let changed = identity(
            &json!({"num_repeats": 1, "responses_create_params": {"temperature": 0.3}, "request_timeout_s": 90}),
            &global(0.0, 60, 1),
        );
        refused_message(validate_resume(
            saved,
            Some(&current(changed)),
            false,
            &DriftPolicy::default(),
        ))
    };
    let (message, mismatches) = refused(&f.saved);
    assert_eq!(mismatches, vec![Mismatch::ResolvedConfiguration]);
    assert!(message.contains("incompatible resolved configuration"));
    assert!(
        message.contains("not the one the manifest's config_digest was taken from"),
        "the message says why no key is named: {message}"
    );
    // No saved identity at all: the message says it is missing or unreadable.
    f.saved.identity = None;
    let (message, mismatches) = refused(&f.saved);
    assert_eq!(mismatches, vec![Mismatch::ResolvedConfiguration]);
    assert!(message.starts_with("Cannot resume with incompatible resolved configuration."));
    assert!(message.contains("is missing or unreadable"), "{message}");
}

#[test]
fn scenario_15_a_changed_prompt_refuses_and_a_changed_host_reuses() {
    let f = fixture(false);
    let policy = DriftPolicy::default();
    let mut prompt = global(0.0, 60, 1);
    prompt["judge"]["resources_servers"]["math_with_judge"]["judge_prompt"] = json!("Be strict.");
    let (message, _) = refused_message(validate_resume(
        &f.saved,
        Some(&current(identity(&config(1, 0.3, 8), &prompt))),
        false,
        &policy,
    ));
    assert!(message.contains("incompatible resolved configuration"));
    let mut host = global(0.0, 60, 1);
    host["policy_model"]["responses_api_models"]["vllm_model"]["host"] = json!("other-host");
    assert!(matches!(
        validate_resume(
            &f.saved,
            Some(&current(identity(&config(1, 0.3, 8), &host))),
            false,
            &policy
        ),
        ResumeVerdict::Reuse { .. }
    ));
}
