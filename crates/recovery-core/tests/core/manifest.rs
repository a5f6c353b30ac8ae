//! RunManifest: strict reading agreeing with the seed's pydantic models, Python's exact pretty
//! bytes, and round trips.

use crate::support::python;
use proptest::prelude::*;
use recovery_core::manifest::{PendingRejudge, RunManifest};
use serde_json::{Value, json};

/// The seed's models, written as the Python module declares them, validating each stdin line.
const PYDANTIC_MODELS: &str = r#"
import sys, json
from typing import Annotated, Literal
from pydantic import BaseModel, ConfigDict, Field, ValidationError
class PendingRejudge(BaseModel):
    model_config = ConfigDict(extra='forbid', frozen=True)
    admitted_at: Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)]
    operation_id: Annotated[str, Field(pattern='^[0-9a-f]{32}$')]
    predecessor_failure_id: Annotated[str, Field(min_length=1)]
    predecessor_sha256: Annotated[str, Field(pattern='^[0-9a-f]{64}$')]
class RunManifest(BaseModel):
    model_config = ConfigDict(extra='forbid', frozen=True)
    schema_version: Literal[2] = 2
    selection_policy: Literal['latest_allocated'] = 'latest_allocated'
    next_attempt: dict[str, Annotated[int, Field(ge=1, strict=True)]] = Field(default_factory=dict)
    run_id: str
    source_digest: str
    materialized_digest: str
    config_digest: str
    legacy_import: bool = False
    identity_overridden: bool = False
    max_rollout_attempts: Annotated[int, Field(ge=1, strict=True)] | None = None
    pending_rejudge: dict[str, PendingRejudge] = Field(default_factory=dict)
    retry_terminal_timeouts: bool = False
"#;

fn pydantic(script: &str, input: &str) -> Vec<String> {
    let program = format!("{PYDANTIC_MODELS}\n{script}");
    String::from_utf8(python(&program, input.as_bytes()))
        .expect("utf8")
        .lines()
        .map(str::to_owned)
        .collect()
}

const BASE: &str =
    r#""run_id":"r","source_digest":"s","materialized_digest":"m","config_digest":"c""#;

#[test]
fn reading_accepts_and_refuses_exactly_what_the_seed_models_do() {
    let op = "a".repeat(32);
    let sha = "b".repeat(64);
    let rejudge = |admitted: &str, op: &str, failure: &str, sha: &str| {
        format!(
            r#""pending_rejudge":{{"k":{{"admitted_at":{admitted},"operation_id":"{op}","predecessor_failure_id":"{failure}","predecessor_sha256":"{sha}"}}}}"#
        )
    };
    let extras: Vec<String> = vec![
        String::new(),
        r#","schema_version":2"#.into(),
        r#","schema_version":2.0"#.into(),
        r#","schema_version":"2""#.into(),
        r#","schema_version":true"#.into(),
        r#","schema_version":1"#.into(),
        r#","schema_version":99"#.into(),
        r#","selection_policy":"latest_allocated""#.into(),
        r#","selection_policy":"any_success""#.into(),
        r#","legacy_import":true"#.into(),
        r#","legacy_import":1"#.into(),
        r#","legacy_import":0.0"#.into(),
        r#","legacy_import":2"#.into(),
        r#","legacy_import":"yes""#.into(),
        r#","legacy_import":"Off""#.into(),
        r#","legacy_import":"maybe""#.into(),
        r#","legacy_import":null"#.into(),
        r#","identity_overridden":"true""#.into(),
        r#","retry_terminal_timeouts":[]"#.into(),
        r#","max_rollout_attempts":3"#.into(),
        r#","max_rollout_attempts":null"#.into(),
        r#","max_rollout_attempts":0"#.into(),
        r#","max_rollout_attempts":1.0"#.into(),
        r#","max_rollout_attempts":true"#.into(),
        r#","max_rollout_attempts":"2""#.into(),
        r#","next_attempt":{"0-0":1,"1-0":4}"#.into(),
        r#","next_attempt":{"0-0":0}"#.into(),
        r#","next_attempt":{"0-0":1.0}"#.into(),
        r#","next_attempt":[]"#.into(),
        // Read without a JSON tree when every value is plain: duplicates and escapes as before.
        r#","next_attempt":{"0-0":1,"1-0":2,"0-0":3}"#.into(),
        r#","next_attempt":{"0-0":1},"next_attempt":{"1-0":2}"#.into(),
        r#","next_attempt":{"\u0030-0":2, "1-0" : 9223372036854775807 }"#.into(),
        r#","next_attempt":{"0-0":-0}"#.into(),
        r#","next_attempt":{"0-0":1E2}"#.into(),
        r#","next_attempt":{"0-0":"2"}"#.into(),
        r#","next_attempt":{"0-0":2,"1-0":null}"#.into(),
        r#","run_id":5"#.into(),
        r#","unknown_field":1"#.into(),
        r#","run_id":"second""#.into(),
        format!(",{}", rejudge("1", &op, "f", &sha)),
        format!(",{}", rejudge("1.5", &op, "f", &sha)),
        format!(",{}", rejudge("-0.0", &op, "f", &sha)),
        format!(",{}", rejudge("-1", &op, "f", &sha)),
        format!(",{}", rejudge("\"1\"", &op, "f", &sha)),
        format!(",{}", rejudge("true", &op, "f", &sha)),
        format!(",{}", rejudge("1e400", &op, "f", &sha)),
        format!(",{}", rejudge("1", &op.to_uppercase(), "f", &sha)),
        format!(",{}", rejudge("1", &format!("{op}\\n"), "f", &sha)),
        format!(",{}", rejudge("1", &op, "", &sha)),
        format!(",{}", rejudge("1", &op, "f", &sha[1..])),
        r#","pending_rejudge":{"k":{"admitted_at":1}}"#.into(),
    ];
    let mut documents: Vec<String> = extras.iter().map(|e| format!("{{{BASE}{e}}}")).collect();
    documents.push(r#"{"run_id":"r"}"#.into());
    documents.push("[]".into());
    documents.push("{".into());
    let verdicts = pydantic(
        "for line in sys.stdin:\n    try:\n        m = RunManifest.model_validate_json(line)\n        print('ok ' + json.dumps(m.model_dump(mode='json'), sort_keys=True))\n    except ValidationError:\n        print('refused')",
        &(documents.join("\n") + "\n"),
    );
    assert_eq!(verdicts.len(), documents.len());
    for (document, verdict) in documents.iter().zip(verdicts) {
        let ours = RunManifest::from_json_bytes(document.as_bytes());
        match verdict.strip_prefix("ok ") {
            Some(python_dump) => {
                let manifest = ours
                    .unwrap_or_else(|e| panic!("{document}: Python accepts it, we refused: {e}"));
                let python_dump: Value = serde_json::from_str(python_dump).expect("dump");
                assert!(
                    recovery_core::drift::python_equal(&manifest.to_value(), &python_dump),
                    "{document}: {python_dump}"
                );
            }
            None => assert!(
                ours.is_err(),
                "{document}: Python refuses it, we accepted it"
            ),
        }
    }
}

#[test]
fn field_errors_name_the_field() {
    let error = RunManifest::from_json_bytes(
        format!(r#"{{{BASE},"next_attempt":{{"0-0":true}},"bogus":1}}"#).as_bytes(),
    )
    .expect_err("invalid");
    let text = error.to_string();
    assert!(
        text.contains("next_attempt.0-0") && text.contains("bogus"),
        "{text}"
    );
}

/// Execution numbers are signed 64-bit here (where Python's ints are unbounded): a saved cap
/// past 2^63 - 1 is refused as `next_attempt` is, naming the field, so the cap with its
/// extensions never saturates into a guessed one (hostile review 51, N3).
#[test]
fn a_cap_past_the_largest_execution_number_is_refused_naming_it() {
    let largest = i64::MAX;
    let kept = RunManifest::from_json_bytes(
        format!(r#"{{{BASE},"max_rollout_attempts":{largest}}}"#).as_bytes(),
    )
    .expect("the largest cap reads");
    assert_eq!(kept.max_rollout_attempts, Some(largest as u64));
    for past in ["9223372036854775808", "18446744073709551615"] {
        let error = RunManifest::from_json_bytes(
            format!(r#"{{{BASE},"max_rollout_attempts":{past}}}"#).as_bytes(),
        )
        .expect_err("past the largest execution number");
        assert!(
            error.to_string().contains("max_rollout_attempts"),
            "{past}: {error}"
        );
    }
}

fn sample_manifest() -> RunManifest {
    let mut manifest = RunManifest::create("9f".repeat(16), "src", "mat", "cfg", Some(3));
    manifest.next_attempt.insert("0-0".into(), 2);
    manifest.next_attempt.insert("tâche-é".into(), 1);
    manifest.pending_rejudge.insert(
        "0-0-a1".into(),
        PendingRejudge {
            admitted_at: 1_764_000_000.25,
            operation_id: "0123456789abcdef0123456789abcdef".into(),
            predecessor_failure_id: "failure-\u{1F600}".into(),
            predecessor_sha256: "c".repeat(64),
        },
    );
    manifest
}

#[test]
fn a_manifest_we_write_is_byte_identical_to_what_python_writes_for_it() {
    let ours = sample_manifest().to_pretty_json().expect("pretty");
    let python_bytes = pydantic(
        "text = sys.stdin.read()\nm = RunManifest.model_validate_json(text)\nsys.stdout.write(json.dumps(m.model_dump(mode='json'), indent=2, allow_nan=False) + '\\n')",
        &ours,
    )
    .join("\n")
        + "\n";
    assert_eq!(ours, python_bytes);
    assert!(
        ours.contains("\\u00e2") && ours.contains("\\ud83d\\ude00"),
        "ensure_ascii escapes: {ours}"
    );
}

#[test]
fn a_manifest_python_writes_is_read_and_rewritten_unchanged() {
    let python_text = pydantic(
        "m = RunManifest(run_id='r\\u00e9\\n', source_digest='unverified', materialized_digest='m', config_digest='unverified', legacy_import=True, next_attempt={'b': 3, 'a': 1}, max_rollout_attempts=None)\nsys.stdout.write(json.dumps(m.model_dump(mode='json'), indent=2, allow_nan=False) + '\\n')",
        "",
    )
    .join("\n")
        + "\n";
    let manifest =
        RunManifest::from_json_bytes(python_text.as_bytes()).expect("Python's manifest reads");
    assert_eq!(manifest.run_id, "ré\n");
    assert!(manifest.legacy_import);
    assert_eq!(manifest.next_attempt.keys().collect::<Vec<_>>(), ["b", "a"]);
    assert_eq!(manifest.to_pretty_json().expect("pretty"), python_text);
}

#[test]
fn import_legacy_and_create_set_the_documented_fields() {
    let legacy = RunManifest::import_legacy("a".repeat(32), "digest");
    assert!(legacy.legacy_import && !legacy.identity_overridden);
    assert_eq!(
        (legacy.source_digest.as_str(), legacy.config_digest.as_str()),
        ("unverified", "unverified")
    );
    let created = RunManifest::create("b".repeat(32), "s", "m", "c", None);
    assert!(
        !created.legacy_import
            && created.next_attempt.is_empty()
            && created.pending_rejudge.is_empty()
    );
    assert!(created.overridden().identity_overridden);
}

fn manifest_strategy() -> impl Strategy<Value = RunManifest> {
    let rejudge = (0.0f64..2e9, "[0-9a-f]{32}", "\\PC{1,8}", "[0-9a-f]{64}").prop_map(
        |(admitted_at, op, failure, sha)| PendingRejudge {
            admitted_at,
            operation_id: op,
            predecessor_failure_id: failure,
            predecessor_sha256: sha,
        },
    );
    (
        "\\PC{0,12}",
        "\\PC{0,8}",
        prop::collection::vec(
            (
                "\\PC{1,6}",
                1u64..=recovery_core::manifest::MAX_NEXT_ATTEMPT,
            ),
            0..4,
        ),
        prop::option::of(1u64..100),
        prop::collection::vec(("\\PC{1,6}", rejudge), 0..3),
        any::<(bool, bool, bool)>(),
    )
        .prop_map(
            |(run_id, digest, next, cap, pending, (legacy, overridden, rtt))| {
                let mut m =
                    RunManifest::create(run_id, digest.clone(), digest.clone(), digest, cap);
                m.next_attempt = next.into_iter().collect();
                m.pending_rejudge = pending.into_iter().collect();
                m.legacy_import = legacy;
                m.identity_overridden = overridden;
                m.retry_terminal_timeouts = rtt;
                m
            },
        )
}

/// A manifest text with `next_attempt` values of every kind (plain, zero, negative, float,
/// exponent, string, null, list, past 2^63 - 1), names that repeat, and other members around it.
fn manifest_text_strategy() -> impl Strategy<Value = String> {
    let value = prop::sample::select(vec![
        "1",
        "7",
        "12",
        "0",
        "-0",
        "-1",
        "1.0",
        "1e2",
        "\"3\"",
        "null",
        "true",
        "[1]",
        "{}",
        "9223372036854775807",
        "9223372036854775808",
        "18446744073709551616",
        " 5 ",
    ]);
    let entries = prop::collection::vec(
        (
            prop::sample::select(vec!["0-0", "1-0", "\\u0030-0", "x"]),
            value,
        ),
        0..5,
    );
    let member = prop::sample::select(vec![
        "",
        r#","legacy_import":true"#,
        r#","max_rollout_attempts":3"#,
        r#","unknown":[[[1]]]"#,
        r#","next_attempt":{"9-0":4}"#,
        r#","pending_rejudge":{}"#,
    ]);
    (entries, member, any::<bool>()).prop_map(|(entries, member, before)| {
        let body: Vec<String> = entries
            .iter()
            .map(|(k, v)| format!("\"{k}\":{v}"))
            .collect();
        let next = format!(r#","next_attempt":{{{}}}"#, body.join(","));
        let (first, second) = if before {
            (member, next.as_str())
        } else {
            (next.as_str(), member)
        };
        format!("{{{BASE}{first}{second}}}")
    })
}

proptest! {
    /// The read that skips the JSON tree answers exactly as the full read (every manifest and
    /// every refusal, word for word).
    #[test]
    fn reading_a_manifest_answers_as_reading_its_json_tree(text in manifest_text_strategy()) {
        let full = serde_json::from_str::<Value>(&text)
            .map_err(|e| recovery_core::manifest::ManifestError::Json(e.to_string()).to_string())
            .and_then(|value| RunManifest::from_value(&value).map_err(|e| e.to_string()));
        let read = RunManifest::from_json_bytes(text.as_bytes()).map_err(|e| e.to_string());
        prop_assert_eq!(read, full, "{}", text);
    }

    #[test]
    fn every_manifest_survives_a_write_read_round_trip(manifest in manifest_strategy()) {
        let text = manifest.to_pretty_json().expect("pretty");
        prop_assert!(text.is_ascii(), "ensure_ascii output");
        let back = RunManifest::from_json_bytes(text.as_bytes()).expect("reads back");
        prop_assert_eq!(back, manifest);
    }
}

/// The collection setting `retry_terminal_timeouts` is read as the Python module's settings model
/// reads a `bool` (pydantic 2, lax; CPython is the oracle for every value): the forms it takes
/// give its answer, the ones it refuses are refused, and absent is `false`.
#[test]
fn the_timeout_retries_opt_in_is_read_as_pydantic_reads_a_bool() {
    const SETTINGS: &str = r#"
import sys, json
from pydantic import BaseModel, ValidationError
class Settings(BaseModel):
    retry_terminal_timeouts: bool = False
for line in sys.stdin:
    try:
        print(json.dumps(Settings(**json.loads(line)).retry_terminal_timeouts))
    except ValidationError:
        print("refused")
"#;
    let values = [
        "true",
        "false",
        "1",
        "0",
        "2",
        "-1",
        "1.0",
        "0.0",
        "1e0",
        "0.5",
        "\"true\"",
        "\"True\"",
        "\"TRUE\"",
        "\"false\"",
        "\"False\"",
        "\" true\"",
        "\"true \"",
        "\"yes\"",
        "\"YES\"",
        "\"no\"",
        "\"on\"",
        "\"off\"",
        "\"t\"",
        "\"f\"",
        "\"y\"",
        "\"n\"",
        "\"1\"",
        "\"0\"",
        "\"2\"",
        "\"1.0\"",
        "\"maybe\"",
        "\"\"",
        "null",
        "[]",
        "[true]",
        "{}",
    ];
    let mut input = String::from("{}\n");
    for value in values {
        input.push_str(&format!("{{\"retry_terminal_timeouts\": {value}}}\n"));
    }
    let expected = String::from_utf8(python(SETTINGS, input.as_bytes())).expect("utf8");
    let expected: Vec<&str> = expected.lines().collect();
    assert_eq!(expected.len(), values.len() + 1);
    let ours =
        |setting: Option<&Value>| match recovery_core::manifest::timeout_retries_opt_in(setting) {
            Ok(flag) => flag.to_string(),
            Err(message) => {
                assert!(
                    message.starts_with("config.retry_terminal_timeouts: "),
                    "the message names the field: {message}"
                );
                "refused".to_owned()
            }
        };
    assert_eq!(ours(None), expected[0], "absent");
    for (value, python) in values.iter().zip(&expected[1..]) {
        let parsed: Value = serde_json::from_str(value).expect("json");
        assert_eq!(ours(Some(&parsed)), *python, "{value}");
    }
}

/// The opt-in set through an interpolation (`${oc.env:NAME,default}`, a node of the server tree,
/// a sibling setting) is resolved as OmegaConf resolves the collector's configuration, then
/// read as pydantic reads a bool: both are CPython's answers here, for every case.
#[test]
fn an_interpolated_timeout_retries_opt_in_resolves_and_reads_as_the_python_module_does() {
    use recovery_core::identity::{ConfigBundle, RowReferences, resolved_collection_setting};
    const ORACLE: &str = r#"
import sys, json, os
from omegaconf import OmegaConf
from pydantic import BaseModel, ValidationError
class Settings(BaseModel):
    retry_terminal_timeouts: bool = False
for line in sys.stdin:
    case = json.loads(line)
    for k in [k for k in os.environ if k.startswith("NGT_RTT")]:
        del os.environ[k]
    os.environ.update(case["env"])
    tree = OmegaConf.create({**case["global"], "_settings": case["config"]})
    try:
        value = OmegaConf.to_container(tree, resolve=True)["_settings"]["retry_terminal_timeouts"]
        print(json.dumps(Settings(retry_terminal_timeouts=value).retry_terminal_timeouts))
    except ValidationError:
        print("refused")
    except Exception:
        print("unresolvable")
"#;
    let global = json!({"policy": {"flag": "on", "off": "no"}});
    let cases: Vec<(Value, Value)> = vec![
        (json!("${oc.env:NGT_RTT,false}"), json!({})),
        (json!("${oc.env:NGT_RTT,false}"), json!({"NGT_RTT": "yes"})),
        (
            json!("${oc.env:NGT_RTT,false}"),
            json!({"NGT_RTT": "maybe"}),
        ),
        (json!("${oc.env:NGT_RTT,true}"), json!({})),
        (json!("${oc.env:NGT_RTT,1}"), json!({})),
        (json!("${oc.env:NGT_RTT,0}"), json!({})),
        (json!("${oc.env:NGT_RTT}"), json!({"NGT_RTT": "TRUE"})),
        (json!("${oc.env:NGT_RTT}"), json!({})),
        (json!("${policy.flag}"), json!({})),
        (json!("${policy.off}"), json!({})),
        (json!("${.sibling}"), json!({})),
        (json!("x${policy.flag}"), json!({})),
    ];
    let mut input = String::new();
    for (setting, env) in &cases {
        let config = json!({"retry_terminal_timeouts": setting, "sibling": "y"});
        input.push_str(&json!({"config": config, "global": global, "env": env}).to_string());
        input.push('\n');
    }
    let expected = String::from_utf8(python(ORACLE, input.as_bytes())).expect("utf8");
    let expected: Vec<&str> = expected.lines().collect();
    assert_eq!(expected.len(), cases.len());
    for ((setting, env), python) in cases.iter().zip(expected) {
        let config = json!({"retry_terminal_timeouts": setting, "sibling": "y"});
        let environment: std::collections::BTreeMap<String, String> =
            serde_json::from_value(env.clone()).expect("env");
        let bundle = ConfigBundle {
            config: &config,
            global_config: &global,
            rows: &RowReferences::default(),
            environment: &environment,
        };
        let ours = match resolved_collection_setting(&bundle, "retry_terminal_timeouts") {
            Err(_) => "unresolvable".to_owned(),
            Ok(value) => match recovery_core::manifest::timeout_retries_opt_in(value.as_ref()) {
                Ok(flag) => flag.to_string(),
                Err(_) => "refused".to_owned(),
            },
        };
        assert_eq!(ours, python, "{setting} with {env}");
    }
}
