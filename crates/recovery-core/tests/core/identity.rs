//! Configuration identity: every public NeMo Gym legacy case, facts §17 scenarios 1 and 7-14,
//! and every redaction form.

use crate::support::shared_jsonl;
use recovery_core::canonical::digest;
use recovery_core::identity::{
    ConfigBundle, ConfigurationIdentity, IdentityError, IdentityForm, RowReferences,
    configuration_identity,
};
use recovery_core::pretty::python_pretty;
use serde_json::{Value, json};
use std::collections::BTreeMap;

fn environment(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        v.as_str().expect("env values are strings").to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn rows_of(value: &Value) -> RowReferences {
    RowReferences::from_rows(value.as_array().expect("rows"))
}

#[test]
fn every_public_legacy_case_gives_the_same_identity_digest_or_error_class() {
    let cases = shared_jsonl("conformance/identity-legacy.jsonl");
    assert_eq!(cases.len(), 68, "the vector file has 68 cases");
    for case in &cases {
        let name = case["name"].as_str().expect("name");
        let env = environment(&case["env"]);
        let rows = rows_of(&case["rows"]);
        let bundle = ConfigBundle {
            config: &case["config"],
            global_config: &case["global_config"],
            rows: &rows,
            environment: &env,
        };
        let result = configuration_identity(bundle, IdentityForm::Legacy);
        match case.get("error").and_then(Value::as_str) {
            Some(class) => {
                let error = result.expect_err(name);
                assert_eq!(error.kind(), class, "{name}: {error}");
                if class == "missing_server" {
                    assert_eq!(
                        error.to_string(),
                        case["message"].as_str().expect("message"),
                        "{name}"
                    );
                }
            }
            None => {
                let identity = result.unwrap_or_else(|e| panic!("{name}: {e}"));
                let expected = case["config_digest"].as_str().expect("digest");
                assert_eq!(
                    digest(&identity).expect("digest"),
                    expected,
                    "{name}: {identity}"
                );
                assert_eq!(
                    digest(&case["identity"]).expect("digest"),
                    expected,
                    "{name}: vector self-check"
                );
                let forms = ConfigurationIdentity::compute(bundle)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(
                    forms.matches_config(expected),
                    "{name}: a manifest with the legacy digest must match"
                );
                assert_eq!(forms.legacy_digest.as_deref(), Some(expected), "{name}");
            }
        }
    }
}

/// The conformance base configuration, rebuilt as a fixture.
fn base_global() -> Value {
    json!({
        "policy_base_url": "http://10.0.0.5:8000/v1",
        "policy_api_key": "sk-live-123",
        "policy_model_name": "model-A",
        "head_server": {"host": "0.0.0.0", "port": 11000},
        "policy_model": {"responses_api_models": {"vllm_model": {
            "entrypoint": "app.py", "model": "${policy_model_name}", "base_url": "${policy_base_url}",
            "api_key": "${policy_api_key}", "host": "127.0.0.1", "port": 9001}}},
        "math_resources": {"resources_servers": {"math_with_judge": {
            "entrypoint": "app.py", "host": "127.0.0.1", "port": 9002,
            "judge_model_server": {"type": "responses_api_models", "name": "policy_model"},
            "scoring_rule": 1}}},
        "math_agent": {"responses_api_agents": {"simple_agent": {
            "entrypoint": "app.py", "host": "127.0.0.1", "port": 9003,
            "resources_server": {"type": "resources_servers", "name": "math_resources"},
            "model_server": {"type": "responses_api_models", "name": "policy_model"},
            "task_parameters": {"difficulty": "hard"}}}},
        "unused_server": {"resources_servers": {"other": {"prompt": "${oc.env:NGT_MISSING_PROMPT}"}}}
    })
}

fn base_config() -> Value {
    json!({"limit": 1, "responses_create_params": {"temperature": 0.3}, "output_jsonl_fpath": "/data/out.jsonl"})
}

fn base_rows() -> Value {
    json!([{"agent_ref": {"name": "math_agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0}])
}

fn compute(
    config: &Value,
    global: &Value,
    rows: &Value,
    env: &Value,
) -> Result<ConfigurationIdentity, IdentityError> {
    let env = environment(env);
    let rows = rows_of(rows);
    ConfigurationIdentity::compute(ConfigBundle {
        config,
        global_config: global,
        rows: &rows,
        environment: &env,
    })
}

fn base_digest() -> String {
    compute(&base_config(), &base_global(), &base_rows(), &json!({}))
        .expect("base")
        .config_digest
}

/// Sets `value` at a dotted path (creating mappings on the way).
fn set(mut root: Value, path: &str, value: Value) -> Value {
    let mut node = &mut root;
    let parts: Vec<&str> = path.split('.').collect();
    for part in &parts[..parts.len() - 1] {
        node = node
            .as_object_mut()
            .expect("mapping")
            .entry(*part)
            .or_insert_with(|| json!({}));
    }
    node.as_object_mut()
        .expect("mapping")
        .insert(parts[parts.len() - 1].to_owned(), value);
    root
}

const AGENT: &str = "math_agent.responses_api_agents.simple_agent";
const MODEL: &str = "policy_model.responses_api_models.vllm_model";
const JUDGE: &str = "math_resources.resources_servers.math_with_judge";

#[test]
fn runtime_settings_and_collection_options_leave_the_current_digest_unchanged() {
    let base = base_digest();
    let same: Vec<(&str, Value, Value)> = vec![
        (
            "rotated policy endpoint",
            set(
                base_global(),
                "policy_base_url",
                json!("http://10.9.9.9/v1"),
            ),
            base_config(),
        ),
        (
            "rotated policy key",
            set(base_global(), "policy_api_key", json!("rotated")),
            base_config(),
        ),
        (
            "model server host and port",
            set(
                set(base_global(), &format!("{MODEL}.host"), json!("host-B")),
                &format!("{MODEL}.port"),
                json!(200),
            ),
            base_config(),
        ),
        (
            "model server api key",
            set(base_global(), &format!("{MODEL}.api_key"), json!("new")),
            base_config(),
        ),
        (
            "top-level capture dir",
            set(base_global(), "model_call_capture_dir", json!("/x")),
            base_config(),
        ),
        (
            "server capture dir",
            set(
                base_global(),
                &format!("{JUDGE}.model_call_capture_dir"),
                json!("/y"),
            ),
            base_config(),
        ),
        (
            "token capture dir",
            set(base_global(), "token_id_capture.dir", json!("/captures/b")),
            base_config(),
        ),
        (
            "collection options",
            base_global(),
            set(
                set(
                    set(base_config(), "resume_from_cache", json!(true)),
                    "num_samples_in_parallel",
                    json!(10),
                ),
                "count_missing_rollouts_as_zero",
                json!(true),
            ),
        ),
        (
            "memory options",
            base_global(),
            set(
                set(base_config(), "retain_results_in_memory", json!(false)),
                "max_resident_rollout_tasks",
                json!(5),
            ),
        ),
        (
            "unused server's missing variable",
            set(
                base_global(),
                "unused_server.resources_servers.other.x",
                json!("${oc.env:ALSO_MISSING}"),
            ),
            base_config(),
        ),
    ];
    let capture = |dir: &str| {
        set(
            base_global(),
            &format!("{MODEL}.token_id_capture"),
            json!({"dir": dir, "rebuild_response": true}),
        )
    };
    let capture_c = compute(&base_config(), &capture("/c"), &base_rows(), &json!({}))
        .expect("c")
        .config_digest;
    let capture_d = compute(&base_config(), &capture("/d"), &base_rows(), &json!({}))
        .expect("d")
        .config_digest;
    assert_eq!(
        capture_c, capture_d,
        "a server's token capture dir is operational"
    );
    for name in [
        "judge_api_key",
        "judge_base_url",
        "tavily_api_key",
        "anthropic_api_key",
        "sandbox_model_base_url",
        "num_workers",
        "switchyard_api_key",
        "switchyard_base_url",
    ] {
        let changed = set(base_global(), &format!("{JUDGE}.{name}"), json!("value-2"));
        let digest = compute(&base_config(), &changed, &base_rows(), &json!({}))
            .expect(name)
            .config_digest;
        assert_eq!(digest, base, "server-level {name} is a runtime setting");
    }
    for (name, global, config) in same {
        let digest = compute(&config, &global, &base_rows(), &json!({}))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .config_digest;
        assert_eq!(digest, base, "{name} must not change the identity");
    }
}

#[test]
fn semantic_settings_change_the_current_digest() {
    let base = base_digest();
    let token = set(
        base_global(),
        "token_id_capture",
        json!({"dir": "/a", "rebuild_response": true}),
    );
    let token_off = set(
        base_global(),
        "token_id_capture",
        json!({"dir": "/a", "rebuild_response": false}),
    );
    let token_digest = compute(&base_config(), &token, &base_rows(), &json!({}))
        .expect("token")
        .config_digest;
    let token_off_digest = compute(&base_config(), &token_off, &base_rows(), &json!({}))
        .expect("token off")
        .config_digest;
    assert_ne!(
        token_digest, token_off_digest,
        "rebuild_response is identity"
    );
    let different: Vec<(&str, Value, Value)> = vec![
        (
            "temperature",
            base_global(),
            set(
                base_config(),
                "responses_create_params.temperature",
                json!(0.8),
            ),
        ),
        (
            "model name",
            set(base_global(), "policy_model_name", json!("model-B")),
            base_config(),
        ),
        (
            "tool schema with a port key",
            set(
                base_global(),
                &format!("{AGENT}.tools"),
                json!({"properties": {"port": {"type": "string"}}}),
            ),
            base_config(),
        ),
        (
            "judge scoring rule",
            set(base_global(), &format!("{JUDGE}.scoring_rule"), json!(2)),
            base_config(),
        ),
        (
            "dataset path",
            set(
                base_global(),
                &format!("{AGENT}.dataset_path"),
                json!("data/v2.jsonl"),
            ),
            base_config(),
        ),
        (
            "nested judge base url",
            set(
                base_global(),
                &format!("{AGENT}.task_parameters.judge_base_url"),
                json!("v2"),
            ),
            base_config(),
        ),
        (
            "nested num_workers",
            set(
                base_global(),
                &format!("{AGENT}.task_parameters.num_workers"),
                json!(3),
            ),
            base_config(),
        ),
        (
            "nested model_call_capture_dir",
            set(
                base_global(),
                &format!("{AGENT}.task_parameters.model_call_capture_dir"),
                json!("/z"),
            ),
            base_config(),
        ),
        (
            "max turns",
            set(
                base_global(),
                &format!("{AGENT}.agent_kwargs.max_turns"),
                json!(30),
            ),
            base_config(),
        ),
        (
            "limit",
            base_global(),
            set(base_config(), "limit", json!(2)),
        ),
    ];
    for (name, global, config) in different {
        let digest = compute(&config, &global, &base_rows(), &json!({}))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .config_digest;
        assert_ne!(digest, base, "{name} must change the identity");
    }
}

#[test]
fn an_environment_variable_used_by_a_reachable_server_is_identity() {
    let global = set(
        base_global(),
        &format!("{JUDGE}.review_prompt"),
        json!("${oc.env:NG_REVIEW_PROMPT}"),
    );
    let strict = compute(
        &base_config(),
        &global,
        &base_rows(),
        &json!({"NG_REVIEW_PROMPT": "Be strict."}),
    )
    .expect("strict");
    let lenient = compute(
        &base_config(),
        &global,
        &base_rows(),
        &json!({"NG_REVIEW_PROMPT": "Be lenient."}),
    )
    .expect("lenient");
    assert_ne!(strict.config_digest, lenient.config_digest);
    let missing =
        compute(&base_config(), &global, &base_rows(), &json!({})).expect_err("missing variable");
    assert_eq!(missing.kind(), "interpolation");
    assert!(missing.to_string().contains("review_prompt"), "{missing}");
}

#[test]
fn authorization_headers_are_operational_and_other_headers_are_identity() {
    let base = base_digest();
    for setting in [
        "headers",
        "default_headers",
        "openai_default_headers",
        "artifact_request_headers",
    ] {
        let with = |auth: &str, version: &str| {
            set(
                base_global(),
                &format!("{MODEL}.{setting}"),
                json!({"Authorization": auth, "X-Dataset-Version": version}),
            )
        };
        let unset = compute(
            &base_config(),
            &with("Bearer ${oc.env:GYM_TEST_MISSING_CREDENTIAL}", "v1"),
            &base_rows(),
            &json!({}),
        )
        .unwrap_or_else(|e| {
            panic!("{setting}: an unset credential variable must not be read: {e}")
        });
        let changed = compute(
            &base_config(),
            &with("Bearer other", "v1"),
            &base_rows(),
            &json!({}),
        )
        .expect(setting);
        let versioned = compute(
            &base_config(),
            &with("Bearer other", "v2"),
            &base_rows(),
            &json!({}),
        )
        .expect(setting);
        assert_eq!(
            unset.config_digest, changed.config_digest,
            "{setting}: Authorization is operational"
        );
        assert_ne!(
            changed.config_digest, versioned.config_digest,
            "{setting}: X-Dataset-Version is identity"
        );
        assert_ne!(unset.config_digest, base);
    }
}

#[test]
fn missing_servers_are_refused_naming_them() {
    let cases: Vec<(&str, Value, Value)> = vec![
        (
            "missing_agent",
            base_global(),
            json!([{"agent_ref": {"name": "missing_agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0}]),
        ),
        (
            "missing_env",
            base_global(),
            json!([{"agent_ref": {"name": "math_agent"}, "_ng_environment_server": "missing_env", "_ng_task_index": 0, "_ng_rollout_index": 0}]),
        ),
        (
            "nope_model",
            set(
                base_global(),
                &format!("{AGENT}.model_server.name"),
                json!("nope_model"),
            ),
            base_rows(),
        ),
        (
            "nope_verifier",
            set(
                base_global(),
                &format!("{AGENT}.resources_server"),
                json!({"type": "resources_servers", "name": "nope_verifier"}),
            ),
            base_rows(),
        ),
        (
            "nope_agent",
            set(
                base_global(),
                "env.environment_servers.single_agent_turn.agent_server",
                json!({"name": "nope_agent"}),
            ),
            json!([{"agent_ref": {"name": "math_agent"}, "_ng_environment_server": "env", "_ng_task_index": 0, "_ng_rollout_index": 0}]),
        ),
    ];
    for (name, global, rows) in cases {
        let error = compute(&base_config(), &global, &rows, &json!({})).expect_err(name);
        assert_eq!(error.kind(), "missing_server", "{name}");
        let text = error.to_string();
        assert!(
            text.contains("configuration") && text.contains(name),
            "{name}: {text}"
        );
    }
}

#[test]
fn stirrup_rerun_toggle_is_operational_but_nested_task_options_are_identity() {
    let global = set(
        base_global(),
        "stirrup.responses_api_agents.stirrup_agent",
        json!({"rerun_incomplete": "${oc.env:RERUN_INCOMPLETE,false}", "task_options": {"rerun_incomplete": false}}),
    );
    let rows =
        json!([{"agent_ref": {"name": "stirrup"}, "_ng_task_index": 0, "_ng_rollout_index": 0}]);
    let off = compute(
        &base_config(),
        &global,
        &rows,
        &json!({"RERUN_INCOMPLETE": "false"}),
    )
    .expect("off");
    let on = compute(
        &base_config(),
        &global,
        &rows,
        &json!({"RERUN_INCOMPLETE": "true"}),
    )
    .expect("on");
    assert_eq!(off.config_digest, on.config_digest);
    let nested = set(
        global,
        "stirrup.responses_api_agents.stirrup_agent.task_options.rerun_incomplete",
        json!(true),
    );
    let nested = compute(&base_config(), &nested, &rows, &json!({})).expect("nested");
    assert_ne!(off.config_digest, nested.config_digest);
}

#[test]
fn environment_server_orchestration_settings_are_identity_but_its_port_is_not() {
    let rows = base_rows();
    let with_env = |scenario: i64, port: i64, agent_server: Value| {
        let global = set(base_global(), "agent_name", json!("math_agent"));
        let global = set(global, "agent_reference", json!({"name": "math_agent"}));
        set(
            global,
            "single_turn_env.environment_servers.single_agent_turn",
            json!({"agent_server": agent_server, "resources_server": {"name": "math_resources"}, "scenario": scenario, "port": port}),
        )
    };
    let digest_of =
        |global: Value| compute(&base_config(), &global, &rows, &json!({})).expect("identity");
    let literal = digest_of(with_env(1, 8000, json!({"name": "math_agent"})));
    assert!(
        literal.identity["servers"].get("single_turn_env").is_some(),
        "the wrapping environment server is selected"
    );
    assert_eq!(
        literal.config_digest,
        digest_of(with_env(1, 8000, json!({"name": "${agent_name}"}))).config_digest
    );
    assert_eq!(
        literal.config_digest,
        digest_of(with_env(1, 8000, json!("${agent_reference}"))).config_digest
    );
    assert_eq!(
        literal.config_digest,
        digest_of(with_env(1, 9000, json!({"name": "math_agent"}))).config_digest
    );
    assert_ne!(
        literal.config_digest,
        digest_of(with_env(2, 8000, json!({"name": "math_agent"}))).config_digest
    );
    let retained = compute(
        &set(base_config(), "retain_results_in_memory", json!(true)),
        &with_env(1, 8000, json!({"name": "math_agent"})),
        &rows,
        &json!({}),
    )
    .expect("identity");
    assert_eq!(literal.config_digest, retained.config_digest);
}

#[test]
fn scenario_1_the_identity_file_and_manifest_hold_no_credential() {
    let global = set(
        base_global(),
        &format!("{MODEL}.api_key"),
        json!("credential"),
    );
    let identity = compute(&base_config(), &global, &base_rows(), &json!({})).expect("identity");
    let text = python_pretty(&identity.identity).expect("pretty");
    assert!(
        !text.contains("credential") && !text.contains("sk-live-123"),
        "{text}"
    );
    let manifest = recovery_core::manifest::RunManifest::create(
        "0".repeat(32),
        "s",
        "m",
        identity.config_digest.clone(),
        Some(3),
    );
    let manifest_text = manifest.to_pretty_json().expect("pretty");
    assert!(!manifest_text.contains("credential") && !manifest_text.contains("model-A"));
}

/// Every credential form of decisions §3, each holding the same secret text.
#[test]
fn no_secret_substring_survives_anywhere_in_the_saved_identity() {
    const SECRET: &str = "S3cr3tV4lue";
    let forms: Vec<(&str, &str, Value)> = vec![
        (
            "credential-named key",
            "task_parameters.openai_api_key",
            json!(SECRET),
        ),
        (
            "credential-named key, whole subtree",
            "task_parameters.client_secret",
            json!({"nested": [SECRET, {"deeper": SECRET}]}),
        ),
        ("password key", "task_parameters.db_password", json!(SECRET)),
        ("token key", "task_parameters.hf_token", json!(SECRET)),
        (
            "cookie key",
            "task_parameters.session_cookie",
            json!(SECRET),
        ),
        (
            "secrets mapping",
            "task_parameters.secrets",
            json!({"ANY_NAME": SECRET}),
        ),
        (
            "authorization header outside header settings",
            "task_parameters.http.Authorization",
            json!(format!("Token {SECRET}")),
        ),
        (
            "name/value entry",
            "task_parameters.env",
            json!([{"name": "GITHUB_TOKEN", "value": SECRET}]),
        ),
        (
            "assignment string",
            "task_parameters.args",
            json!([format!("API_KEY={SECRET}")]),
        ),
        (
            "bearer string",
            "task_parameters.auth_value",
            json!(format!("Bearer {SECRET}")),
        ),
        (
            "basic string",
            "task_parameters.auth_value",
            json!(format!("basic {SECRET}")),
        ),
        (
            "url password",
            "task_parameters.mirror",
            json!(format!("https://user:{SECRET}@example.org/data")),
        ),
        (
            "credential env interpolation",
            "task_parameters.note",
            json!("key: ${oc.env:MY_SERVICE_SECRET}"),
        ),
        (
            "credential config interpolation",
            "task_parameters.note",
            json!("key: ${vault.access_key}"),
        ),
    ];
    for (name, path, value) in forms {
        let global = set(base_global(), &format!("{AGENT}.{path}"), value.clone());
        let global = set(global, "vault.access_key", json!(SECRET));
        let config = set(base_config(), "extra.some_api_key", json!(SECRET));
        let identity = compute(
            &config,
            &global,
            &base_rows(),
            &json!({"MY_SERVICE_SECRET": SECRET}),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let text = python_pretty(&identity.identity).expect("pretty");
        assert!(
            !text.contains(SECRET),
            "{name}: the secret survived in\n{text}"
        );
        assert!(text.contains("<redacted>"), "{name}: the marker is missing");
        // Redaction must not swallow the surrounding structure.
        assert_eq!(
            identity.identity["servers"]["math_agent"]["responses_api_agents"]["simple_agent"]["task_parameters"]
                ["difficulty"],
            "hard"
        );
    }
}

#[test]
fn redaction_keeps_scheme_names_and_surrounding_text() {
    use recovery_core::identity::redaction::{credential_safe, is_credential_name, redact_string};
    assert_eq!(redact_string("Bearer abc.def"), "Bearer <redacted>");
    assert_eq!(redact_string("API_KEY=abc"), "API_KEY=<redacted>");
    assert_eq!(redact_string("MODE=fast"), "MODE=fast");
    assert_eq!(
        redact_string("see https://u:p4ss@h.example/x and more"),
        "see https://u:<redacted>@h.example/x and more"
    );
    assert_eq!(
        redact_string("x ${oc.env:OPENAI_API_KEY,none} y"),
        "x <redacted> y"
    );
    assert_eq!(
        redact_string("${oc.env:DATASET_NAME}"),
        "${oc.env:DATASET_NAME}"
    );
    for (name, expected) in [
        ("max_tokens", false),
        ("token_id_capture", false),
        ("hf_token", true),
        ("auth_token", true),
        ("X-API-KEY", true),
        ("apikey", true),
        ("passwd", true),
        ("temperature", false),
    ] {
        assert_eq!(is_credential_name(name), expected, "{name}");
    }
    let value =
        json!({"a": {"api_key": "k", "x": ["Bearer t", {"name": "MY_TOKEN", "value": "v"}]}});
    let once = credential_safe(&value, false);
    assert_eq!(
        credential_safe(&once, false),
        once,
        "redaction is idempotent"
    );
}

#[test]
fn credential_changes_do_not_change_the_current_digest_but_do_change_the_legacy_one() {
    let a = set(
        base_global(),
        &format!("{AGENT}.task_parameters.judge_api_key"),
        json!("value-1"),
    );
    let b = set(
        base_global(),
        &format!("{AGENT}.task_parameters.judge_api_key"),
        json!("value-2"),
    );
    let ia = compute(&base_config(), &a, &base_rows(), &json!({})).expect("a");
    let ib = compute(&base_config(), &b, &base_rows(), &json!({})).expect("b");
    assert_eq!(ia.config_digest, ib.config_digest);
    assert_ne!(ia.legacy_digest, ib.legacy_digest);
    assert!(
        !ia.matches_config(ib.legacy_digest.as_deref().expect("legacy")),
        "another key's legacy digest is another configuration"
    );
}

#[test]
fn null_defaults_and_added_collection_settings_match_earlier_recorded_forms() {
    let plain = compute(&base_config(), &base_global(), &base_rows(), &json!({})).expect("plain");
    // An earlier Gym recorded the removed null defaults; a Gym before dispatch_connect_grace_s
    // recorded no such setting; a later one recorded its default.
    let with_nulls = set(
        set(
            base_global(),
            &format!("{MODEL}.chat_template_kwargs"),
            Value::Null,
        ),
        &format!("{MODEL}.sampling_overrides"),
        Value::Null,
    );
    let earlier = compute(&base_config(), &with_nulls, &base_rows(), &json!({})).expect("nulls");
    assert_eq!(
        plain.config_digest, earlier.config_digest,
        "null defaults are dropped from the current form"
    );
    let legacy_with_nulls = configuration_identity(
        ConfigBundle {
            config: &base_config(),
            global_config: &with_nulls,
            rows: &rows_of(&base_rows()),
            environment: &BTreeMap::new(),
        },
        IdentityForm::Legacy,
    )
    .expect("legacy");
    assert!(
        plain.matches_config(&digest(&legacy_with_nulls).expect("digest")),
        "restored null defaults match"
    );
    let only_one = set(
        base_global(),
        &format!("{MODEL}.chat_template_kwargs"),
        Value::Null,
    );
    let legacy_one = configuration_identity(
        ConfigBundle {
            config: &base_config(),
            global_config: &only_one,
            rows: &rows_of(&base_rows()),
            environment: &BTreeMap::new(),
        },
        IdentityForm::Legacy,
    )
    .expect("legacy");
    assert!(
        plain.matches_config(&digest(&legacy_one).expect("digest")),
        "a subset of restored defaults matches"
    );
    // A value another configuration sets is not a default and never matches.
    let set_value = set(
        base_global(),
        &format!("{MODEL}.chat_template_kwargs"),
        json!({"thinking": true}),
    );
    let other = compute(&base_config(), &set_value, &base_rows(), &json!({})).expect("other");
    assert!(!plain.matches_config(&other.config_digest));
    let mut grace = plain.identity.clone();
    grace["collection"]["dispatch_connect_grace_s"] = json!(60.0);
    assert!(
        plain.matches_config(&digest(&grace).expect("digest")),
        "the added setting at its default matches"
    );
    grace["collection"]["dispatch_connect_grace_s"] = json!(30.0);
    assert!(
        !plain.matches_config(&digest(&grace).expect("digest")),
        "another value of it does not"
    );
    let configured = compute(
        &set(base_config(), "dispatch_connect_grace_s", json!(30.0)),
        &base_global(),
        &base_rows(),
        &json!({}),
    )
    .expect("configured");
    assert!(
        configured.matches_config(&plain.config_digest),
        "a run recorded before the setting existed matches"
    );
}

#[test]
fn the_interpolation_subset_resolves_like_omegaconf_and_refuses_the_rest() {
    let global = set(
        base_global(),
        &format!("{JUDGE}.quirks"),
        json!({
            "a": "${oc.env:NGT_X,1e3}", "b": "${oc.env:NGT_X,TRUE}", "c": "${oc.env:NGT_X,'it\\'s'}",
            "d": "${oc.select:nope,1.5}", "e": "x${oc.select:nope}y", "f": "\\\\${policy_model_name}",
            "g": "${policy_model_name}-${.h}", "h": 2.50, "i": "${math_agent.responses_api_agents.simple_agent.task_parameters}",
            "j": "${oc.env: NGT_SET }", "k": "${oc.env:NGT_X,1_000}"
        }),
    );
    let identity = compute(
        &base_config(),
        &global,
        &base_rows(),
        &json!({"NGT_SET": "v"}),
    )
    .expect("identity");
    let quirks = &identity.identity["servers"]["math_resources"]["resources_servers"]["math_with_judge"]
        ["quirks"];
    assert_eq!(quirks["a"], "1000.0");
    assert_eq!(quirks["b"], "True");
    assert_eq!(quirks["c"], "it's");
    assert_eq!(quirks["d"], 1.5);
    assert_eq!(quirks["e"], "xNoney");
    assert_eq!(quirks["f"], "\\model-A");
    assert_eq!(quirks["g"], "model-A-2.5");
    assert_eq!(quirks["i"], json!({"difficulty": "hard"}));
    assert_eq!(quirks["j"], "v");
    assert_eq!(quirks["k"], "1000");
    for bad in [
        "${oc.decode:1}",
        "${env:X}",
        "${oc.env:A,${x}}",
        "${missing.key}",
        "${x",
        "${oc.env:A,b,c}",
        "${oc.env:A,a=b}",
    ] {
        let global = set(base_global(), &format!("{JUDGE}.bad"), json!(bad));
        let error = compute(&base_config(), &global, &base_rows(), &json!({})).expect_err(bad);
        assert_eq!(error.kind(), "interpolation", "{bad}: {error}");
        assert!(
            error.to_string().contains("bad"),
            "{bad}: the error names the key: {error}"
        );
    }
    let cycle = set(
        base_global(),
        &format!("{JUDGE}.loop"),
        json!(format!("${{{JUDGE}.loop}}")),
    );
    assert_eq!(
        compute(&base_config(), &cycle, &base_rows(), &json!({}))
            .expect_err("cycle")
            .kind(),
        "interpolation"
    );
}

/// Refusals of an interpolation speak of what the sender wrote: a key of `config` is named
/// under `config` (not the internal key its tree is resolved under), and a `<` the sender never
/// wrote (the marker left where a credential-named interpolation was redacted) is explained.
#[test]
fn interpolation_refusals_name_keys_and_text_as_the_sender_wrote_them() {
    let cases: [(&str, Value, Value, &str, &str); 5] = [
        (
            "a relative reference in config to a missing key",
            set(base_config(), "extra", json!("${.missing}")),
            base_global(),
            "'config.extra'",
            "_collection_identity",
        ),
        (
            "an absolute reference in config to a missing key",
            set(base_config(), "extra", json!("${nowhere.at_all}")),
            base_global(),
            "'config.extra'",
            "_collection_identity",
        ),
        (
            "a credential-named default nested unquoted in a server",
            base_config(),
            set(
                base_global(),
                &format!("{JUDGE}.bad"),
                json!("${oc.env:PLAIN,${oc.env:API_KEY}}"),
            ),
            "stands for a credential (a credential-named interpolation, or a URL's password)",
            "API_KEY}",
        ),
        (
            "a URL with a password as an unquoted default",
            set(
                base_config(),
                "extra",
                json!("${oc.env:NOPE,http://u:DEFSECRET7@h/}"),
            ),
            base_global(),
            "or a URL's password) redacted before anything resolves; quote the argument",
            "DEFSECRET7",
        ),
        (
            "a character the sender wrote unquoted",
            base_config(),
            set(
                base_global(),
                &format!("{JUDGE}.bad"),
                json!("${oc.env:A,a<b}"),
            ),
            "quote the argument",
            "stands for a credential",
        ),
    ];
    for (case, config, global, named, never) in cases {
        let error = compute(&config, &global, &base_rows(), &json!({})).expect_err(case);
        let text = error.to_string();
        assert_eq!(error.kind(), "interpolation", "{case}: {text}");
        assert!(text.contains(named), "{case}: names {named}: {text}");
        assert!(!text.contains(never), "{case}: never {never}: {text}");
    }
}

/// A value that does not parse as an interpolation may still hold a credential the redaction
/// has no pattern for (`Bearer` inside the text, a flag's argument): the refusal names the key
/// and the problem, and never quotes the value, since refusals are recorded and logged.
#[test]
fn interpolation_refusals_never_quote_the_value_they_refuse() {
    const TOKEN: &str = "TKN9QX7";
    let cases: [(&str, String, &str); 12] = [
        (
            "an interpolation never closed",
            format!("Bearer {TOKEN} ${{unclosed"),
            "never closed",
        ),
        (
            "a quoted argument never closed",
            format!("--api-key {TOKEN} ${{oc.env:A,'unclosed {TOKEN}}}"),
            "is never closed",
        ),
        (
            "a character an unquoted argument may not hold",
            format!("${{oc.env:A,{TOKEN}<x}} and {TOKEN}"),
            "is not allowed in an unquoted resolver argument",
        ),
        (
            "a list argument never closed",
            format!("${{oc.env:A,[{TOKEN}}} {TOKEN}"),
            "end too soon",
        ),
        (
            "a reference that is not a key path",
            format!("${{{TOKEN} is here}}"),
            "invalid interpolation key",
        ),
        (
            "a variable name no shell has",
            format!("${{oc.env:'{TOKEN} value'}}"),
            "names an environment variable",
        ),
        (
            "a variable the request lacks",
            format!("${{oc.env:{TOKEN}}}"),
            "names an environment variable",
        ),
        (
            "a bracket key the configuration lacks",
            format!("${{a[{TOKEN}]}}"),
            "refers to a key the configuration does not have",
        ),
        (
            "a relative key the configuration lacks",
            format!("${{.{TOKEN} }}"),
            "refers to a key the configuration does not have",
        ),
        (
            "a resolver that is not supported",
            format!("${{{TOKEN}_x:y}}"),
            "unsupported interpolation resolver",
        ),
        (
            "a reference climbing past the root",
            format!("${{.......{TOKEN}}}"),
            "past the root",
        ),
        (
            "an interpolation inside a key reference",
            format!("${{a.${{{TOKEN}}}}}"),
            "inside a key reference",
        ),
    ];
    for (case, value, problem) in cases {
        let config = set(base_config(), "extra", json!(value));
        let error = compute(&config, &base_global(), &base_rows(), &json!({})).expect_err(case);
        let text = error.to_string();
        assert_eq!(error.kind(), "interpolation", "{case}: {text}");
        assert!(
            text.contains("'config.extra'"),
            "{case}: names the key: {text}"
        );
        assert!(text.contains(problem), "{case}: says {problem}: {text}");
        assert!(!text.contains(TOKEN), "{case}: quotes the value: {text}");
    }
}

/// Issue 9, item 6: a credential-named mapping that an interpolation elsewhere references is
/// redacted and the reference resolves to the marker (not a missing key); a URL password holding
/// `@` and `/` is hidden whole; a credential read from the environment is never needed.
#[test]
fn item_6_redaction_resolves_references_to_secrets_hides_whole_passwords_and_needs_no_secret() {
    let global = set(
        set(
            set(
                base_global(),
                "secrets",
                json!({"openai": "sk-live-OPENAI", "nested": {"e2b": "e2b-live-KEY"}}),
            ),
            &format!("{JUDGE}.auth"),
            json!("${secrets.openai}"),
        ),
        &format!("{JUDGE}.sandbox_auth"),
        json!("Token ${secrets.nested.e2b}"),
    );
    let global = set(
        global,
        &format!("{JUDGE}.mirror"),
        json!("postgres://u:p@ss/word@h:5432/db"),
    );
    let identity = compute(&base_config(), &global, &base_rows(), &json!({}))
        .expect("a referenced secrets mapping resolves");
    let judge =
        &identity.identity["servers"]["math_resources"]["resources_servers"]["math_with_judge"];
    assert_eq!(judge["auth"], "<redacted>");
    assert_eq!(judge["sandbox_auth"], "Token <redacted>");
    assert_eq!(judge["mirror"], "postgres://u:<redacted>@h:5432/db");
    let text = identity.identity.to_string();
    for secret in ["sk-live-OPENAI", "e2b-live-KEY", "p@ss", "ss/word"] {
        assert!(!text.contains(secret), "{secret} leaked into {text}");
    }
    // A URL without user information keeps its port and query.
    assert_eq!(
        recovery_core::identity::redaction::redact_string("https://host:8080/p?u=ab"),
        "https://host:8080/p?u=ab"
    );
    // An environment credential is redacted before interpolation: the same identity whether or
    // not the collector sends it.
    let with_env_reference = set(
        base_global(),
        &format!("{JUDGE}.sandbox_key_ref"),
        json!("${oc.env:E2B_API_KEY}"),
    );
    let without = compute(
        &base_config(),
        &with_env_reference,
        &base_rows(),
        &json!({}),
    )
    .expect("no secret needed");
    let with = compute(
        &base_config(),
        &with_env_reference,
        &base_rows(),
        &json!({"E2B_API_KEY": "e2b-live-KEY"}),
    )
    .expect("identity");
    assert_eq!(with.config_digest, without.config_digest);
    assert!(!with.identity.to_string().contains("e2b-live-KEY"));
}

#[test]
fn quoted_computed_and_defaulted_environment_credentials_are_redacted_and_never_read() {
    // Forms OmegaConf resolves that Python's `_ENV_REFERENCE` pattern does not match.
    let cases = [
        ("quoted name", "${oc.env:'E2B_API_KEY'}"),
        ("double-quoted name", "${oc.env:\"E2B_API_KEY\"}"),
        ("spaced quoted name", "${oc.env: 'E2B_API_KEY' }"),
        (
            "a default holding an interpolation",
            "${oc.env:E2B_API_KEY,${judge_name}}",
        ),
        ("a computed name", "${oc.env:${which_key}}"),
        (
            "text around a quoted name",
            "Token ${oc.env:'E2B_API_KEY'} here",
        ),
        ("a space before the resolver", "${ oc.env:E2B_API_KEY}"),
        ("a space before the colon", "${oc.env :E2B_API_KEY}"),
        ("spaces in a template", "key=${ oc.env : E2B_API_KEY } end"),
    ];
    for (name, reference) in cases {
        let global = set(
            set(base_global(), "which_key", json!("E2B_API_KEY")),
            &format!("{JUDGE}.e2b"),
            json!(reference),
        );
        let global = set(global, "judge_name", json!("judge"));
        let without = compute(&base_config(), &global, &base_rows(), &json!({}))
            .unwrap_or_else(|e| panic!("{name}: no secret needed, got {e}"));
        let with = compute(
            &base_config(),
            &global,
            &base_rows(),
            &json!({"E2B_API_KEY": "e2b-live-KEY"}),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(with.config_digest, without.config_digest, "{name}");
        let text = with.identity.to_string();
        assert!(!text.contains("e2b-live-KEY"), "{name}: leaked into {text}");
        assert!(text.contains("<redacted>"), "{name}: {text}");
    }
}

#[test]
fn a_non_credential_environment_reference_is_still_resolved() {
    let global = set(
        base_global(),
        &format!("{JUDGE}.review_prompt"),
        json!("${oc.env:'NG_REVIEW_PROMPT'}"),
    );
    let first = compute(
        &base_config(),
        &global,
        &base_rows(),
        &json!({"NG_REVIEW_PROMPT": "v1"}),
    )
    .expect("identity");
    let second = compute(
        &base_config(),
        &global,
        &base_rows(),
        &json!({"NG_REVIEW_PROMPT": "v2"}),
    )
    .expect("identity");
    assert_ne!(first.config_digest, second.config_digest);
}

#[test]
fn url_passwords_are_hidden_whole_and_everything_else_kept() {
    use recovery_core::identity::redaction::redact_string;
    let cases = [
        ("plain", "https://u:pw@h/x", "https://u:<redacted>@h/x"),
        (
            "an @ in the password",
            "postgres://u:p@ss@h:5432/db",
            "postgres://u:<redacted>@h:5432/db",
        ),
        (
            "a / in the password",
            "postgres://u:pa/ss@h",
            "postgres://u:<redacted>@h",
        ),
        (
            "both",
            "postgres://u:p@ss/word@h",
            "postgres://u:<redacted>@h",
        ),
        (
            "digits then / in the password",
            "postgres://u:2024/PORTLIKE@h/db",
            "postgres://u:<redacted>@h/db",
        ),
        (
            "a ? in the password",
            "postgres://u:pa?ss@h/db",
            "postgres://u:<redacted>@h/db",
        ),
        (
            "a # in the password",
            "postgres://u:pa#ss@h/db",
            "postgres://u:<redacted>@h/db",
        ),
        // Syntax cannot tell these from passwords: hidden rather than risk keeping one.
        (
            "an @ in the query",
            "https://u:p@h/x?e=a@b",
            "https://u:<redacted>@b",
        ),
        (
            "an @ in a query after a port",
            "https://host:8080/p?u=a@b",
            "https://host:<redacted>@b",
        ),
        (
            "no user information, an @ in the query",
            "https://host/p?u=a@b",
            "https://host/p?u=a@b",
        ),
        (
            "no password, a colon in the path",
            "https://h/a:b@c",
            "https://h/a:b@c",
        ),
        (
            "a user without a password",
            "ssh://git@h/repo",
            "ssh://git@h/repo",
        ),
        (
            "two URLs",
            "a https://u:x@h b s3://k:y/z@bucket/p",
            "a https://u:<redacted>@h b s3://k:<redacted>@bucket/p",
        ),
    ];
    for (name, input, expected) in cases {
        assert_eq!(redact_string(input), expected, "{name}");
        assert_eq!(redact_string(expected), expected, "{name}: idempotent");
    }
}

#[test]
fn earlier_forms_are_skipped_only_when_none_could_be_the_saved_identity() {
    let legacy = |global: &Value| {
        configuration_identity(
            ConfigBundle {
                config: &base_config(),
                global_config: global,
                rows: &rows_of(&base_rows()),
                environment: &BTreeMap::new(),
            },
            IdentityForm::Legacy,
        )
        .expect("legacy")
    };
    let with_secret = set(
        base_global(),
        &format!("{JUDGE}.judge_api_key_ref"),
        json!("${policy_api_key}"),
    );
    let with_secret = set(
        with_secret,
        &format!("{JUDGE}.auth_token"),
        json!("tok-live-9"),
    );
    let with_nulls = set(
        with_secret.clone(),
        &format!("{MODEL}.chat_template_kwargs"),
        Value::Null,
    );
    let current = compute(&base_config(), &with_secret, &base_rows(), &json!({})).expect("current");
    let mut grace = current.identity.clone();
    grace["collection"]["dispatch_connect_grace_s"] = json!(60.0);
    let mut moved_port = current.identity.clone();
    moved_port["servers"]["math_resources"]["resources_servers"]["math_with_judge"]["judge_url"] =
        json!("http://judge:1");
    let mut hotter = current.identity.clone();
    hotter["collection"]["responses_create_params"]["temperature"] = json!(0.9);
    let mut hotter_with_grace = hotter.clone();
    hotter_with_grace["collection"]["dispatch_connect_grace_s"] = json!(60.0);
    // (what was saved, whether an earlier form of the current configuration is that identity)
    let saved = [
        (
            "the legacy form, secrets in the clear",
            legacy(&with_secret),
            true,
        ),
        (
            "the legacy form with a null default",
            legacy(&with_nulls),
            true,
        ),
        (
            "a form before dispatch_connect_grace_s was recorded",
            grace,
            true,
        ),
        ("a changed key no form touches", moved_port, false),
        ("a semantic change", hotter, false),
        (
            "a semantic change beside a form's key",
            hotter_with_grace,
            false,
        ),
    ];
    for (name, saved, is_earlier_form) in saved {
        let saved_digest = digest(&saved).expect("digest");
        assert_eq!(
            current.matches_config(&saved_digest),
            is_earlier_form,
            "{name}"
        );
        // Sound: whenever an earlier form names the saved digest, they are computed.
        assert_eq!(
            current.earlier_form_could_be(&saved, &saved_digest),
            is_earlier_form,
            "{name}"
        );
        // An identity file that is not the one the digest was taken of proves nothing.
        assert!(
            current.earlier_form_could_be(&saved, "0".repeat(64).as_str()),
            "{name}"
        );
    }
}
