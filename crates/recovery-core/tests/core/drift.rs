//! Drift: differing keys and the semantic / operational classifier of decisions §5.

use recovery_core::drift::{DriftPolicy, KeyClass, SemanticReason, differing_keys, python_equal};
use serde_json::json;

#[test]
fn differing_keys_report_dotted_paths_lists_as_one_value_and_one_sided_keys() {
    let saved = json!({"collection": {"limit": 1, "p": {"t": 0.3}}, "servers": {"a": {"x": [1, 2], "y": 1}}, "gone": 1});
    let current = json!({"collection": {"limit": 1, "p": {"t": 0.8}}, "servers": {"a": {"x": [1, 3], "y": 1.0, "new": null}}});
    assert_eq!(
        differing_keys(&saved, &current),
        vec![
            "collection.p.t",
            "gone",
            "servers.a.new",
            "servers.a.x",
            "servers.a.y"
        ]
    );
}

#[test]
fn values_compare_like_python_equality() {
    for (a, b, equal) in [
        (json!(1), json!(1.0), true),
        (json!(true), json!(1), true),
        (json!(false), json!(0.0), true),
        (json!(-0.0), json!(0), true),
        (json!(9007199254740993u64), json!(9007199254740992.0), false),
        (json!(0.5), json!(0.50), true),
        (json!("1"), json!(1), false),
        (json!(null), json!(false), false),
        (json!([1, {"a": 2}]), json!([1.0, {"a": 2.0}]), true),
    ] {
        assert_eq!(python_equal(&a, &b), equal, "{a} == {b}");
    }
}

#[test]
fn each_rule_of_the_classifier_decides_in_order() {
    let policy = DriftPolicy::default();
    let semantic_listed = |s: &str| KeyClass::Semantic(SemanticReason::ListedKey(s.to_owned()));
    let table = [
        // Step 1: listed semantic segments, asset paths, anything with "dataset".
        (
            "collection.responses_create_params.temperature",
            semantic_listed("responses_create_params"),
        ),
        ("collection.num_repeats", semantic_listed("num_repeats")),
        (
            "servers.policy.responses_api_models.vllm_model.model",
            semantic_listed("model"),
        ),
        (
            "servers.agent.responses_api_agents.simple_agent.tools",
            semantic_listed("tools"),
        ),
        (
            "servers.env.resources_servers.x.train_dataset_timeout",
            semantic_listed("train_dataset_timeout"),
        ),
        (
            "servers.judge.resources_servers.x.judge_prompt_template_path",
            KeyClass::Semantic(SemanticReason::AssetPath(
                "judge_prompt_template_path".into(),
            )),
        ),
        (
            "servers.judge.resources_servers.x.prompt_dir",
            KeyClass::Semantic(SemanticReason::AssetPath("prompt_dir".into())),
        ),
        // Step 2: operational words of the last segment.
        (
            "servers.judge.resources_servers.x.judge_timeout",
            KeyClass::Operational,
        ),
        (
            "servers.agent.responses_api_agents.a.max_retries",
            KeyClass::Operational,
        ),
        ("collection.dispatch_connect_grace_s", KeyClass::Operational),
        (
            "servers.agent.responses_api_agents.a.sandbox_port",
            KeyClass::Operational,
        ),
        (
            "servers.agent.responses_api_agents.a.rate_limit",
            KeyClass::Operational,
        ),
        (
            "servers.agent.responses_api_agents.a.log_dir",
            KeyClass::Operational,
        ),
        (
            "servers.agent.responses_api_agents.a.wandb_project",
            KeyClass::Operational,
        ),
        // Step 3: semantic parts anywhere.
        (
            "servers.math.resources_servers.math_with_judge.scoring_rule",
            KeyClass::Semantic(SemanticReason::SemanticPart("judge".into())),
        ),
        (
            "servers.grader.resources_servers.g.threshold",
            KeyClass::Semantic(SemanticReason::SemanticPart("grad".into())),
        ),
        (
            "servers.a.responses_api_agents.a.reward_shaping",
            KeyClass::Semantic(SemanticReason::SemanticPart("reward".into())),
        ),
        // Step 4: nothing matched: semantic, unclassified.
        (
            "servers.a.responses_api_agents.a.scenario",
            KeyClass::Semantic(SemanticReason::Unclassified),
        ),
        (
            "token_id_capture.rebuild_response",
            KeyClass::Semantic(SemanticReason::Unclassified),
        ),
    ];
    for (key, expected) in table {
        assert_eq!(policy.classify(key), expected, "{key}");
    }
}

#[test]
fn operators_extend_the_lists_in_service_configuration() {
    let policy = DriftPolicy::extended(
        ["difficulty".to_owned()],
        ["budget".to_owned()],
        ["servers.a.responses_api_agents.a.scenario".to_owned()],
    );
    assert_eq!(
        policy.classify("servers.a.responses_api_agents.a.scenario"),
        KeyClass::Operational
    );
    assert_eq!(
        policy.classify("collection.token_budget"),
        KeyClass::Operational
    );
    assert!(matches!(
        policy.classify("collection.difficulty_timeout"),
        KeyClass::Operational
    ));
    assert!(matches!(
        policy.classify("collection.difficulty.timeout"),
        KeyClass::Semantic(SemanticReason::ListedKey(_))
    ));
    let with_underscore = DriftPolicy::extended([], ["queue_depth".to_owned()], []);
    assert_eq!(
        with_underscore.classify("servers.a.responses_api_agents.a.queue_depth"),
        KeyClass::Operational,
        "an operational word holding _ names a whole last segment"
    );
    assert!(matches!(
        with_underscore.classify("servers.a.responses_api_agents.a.queue_depth_max"),
        KeyClass::Semantic(_)
    ));
    let drift = policy.classify_all(&["b.timeout".into(), "a.limit".into(), "a.port".into()]);
    assert_eq!(drift.operational, vec!["a.port", "b.timeout"]);
    assert_eq!(drift.semantic.len(), 1);
}

/// Issue 9, item 11: keys differ exactly as their canonical forms do (decisions §5): `30` and
/// `30.0` differ, so a changed digest always names a key, classified like any other change.
#[test]
fn item_11_differing_keys_are_type_exact() {
    let saved =
        json!({"collection": {"request_timeout_s": 30, "flag": true, "same": [1, {"a": 2.5}]}});
    let current =
        json!({"collection": {"request_timeout_s": 30.0, "flag": 1, "same": [1, {"a": 2.50}]}});
    assert_eq!(
        differing_keys(&saved, &current),
        ["collection.flag", "collection.request_timeout_s"]
    );
    let drift = DriftPolicy::default().classify_all(&differing_keys(&saved, &current));
    assert_eq!(drift.operational, ["collection.request_timeout_s"]);
}

/// Issue 9, item 12 (decisions §5, rules 0 and 1): a path that names what a run reads (model
/// weights, tokenizer, data, references) is semantic; paths of what it writes or caches stay
/// operational; a whole key an operator declares takes that class before every rule.
#[test]
fn item_12_paths_of_what_a_run_reads_are_semantic() {
    let policy = DriftPolicy::default();
    let read_path =
        |segment: &str| KeyClass::Semantic(SemanticReason::ReadPath(segment.to_owned()));
    for (key, class) in [
        (
            "servers.policy.responses_api_models.vllm_model.model_path",
            read_path("model_path"),
        ),
        (
            "servers.math.resources_servers.math_with_judge.data_dir",
            read_path("data_dir"),
        ),
        (
            "servers.p.responses_api_models.vllm_model.tokenizer_dir",
            read_path("tokenizer_dir"),
        ),
        (
            "servers.j.resources_servers.x.reference_files",
            read_path("reference_files"),
        ),
        (
            "servers.a.responses_api_agents.b.lora_adapter_path",
            read_path("lora_adapter_path"),
        ),
        (
            "servers.a.responses_api_agents.b.log_dir",
            KeyClass::Operational,
        ),
        (
            "servers.a.responses_api_agents.b.cache_dir",
            KeyClass::Operational,
        ),
        ("collection.output_dir", KeyClass::Operational),
        (
            "servers.a.responses_api_agents.b.path",
            KeyClass::Operational,
        ),
    ] {
        assert_eq!(policy.classify(key), class, "{key}");
    }
    let declared = DriftPolicy::extended(
        ["servers.a.responses_api_agents.b.log_dir".to_owned()],
        [],
        ["servers.math.resources_servers.math_with_judge.data_dir".to_owned()],
    );
    assert_eq!(
        declared.classify("servers.a.responses_api_agents.b.log_dir"),
        KeyClass::Semantic(SemanticReason::DeclaredKey(
            "servers.a.responses_api_agents.b.log_dir".into()
        ))
    );
    assert_eq!(
        declared.classify("servers.math.resources_servers.math_with_judge.data_dir"),
        KeyClass::Operational,
        "an operator's declaration comes first"
    );
}
