//! Issue 9, item 9: the interpolation subset resolves exactly as OmegaConf does. Every case of
//! the table is resolved by OmegaConf itself (python3 with `omegaconf`, which `.ci/run`
//! installs) and by our resolver; both must succeed with the same value (canonical JSON
//! equality: `1` and `1.0` differ) or both refuse. What the subset refuses by design (other
//! resolvers) is checked apart.

use crate::support::python;
use recovery_core::drift::canonical_equal;
use recovery_core::identity::interpolation::{Resolver, Segment};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// Values the cases interpolate, besides the cases themselves (under `case`).
fn fixtures() -> Value {
    json!({
        "y": "Y", "n": 2.5, "i": 7, "big": 12345678901234567890u64, "t": true, "z": null,
        "m": {"b": 1, "c": "s'q", "d": {"e": [1, 2.0]}},
        "l": [1, "a", null, true, 1.5, "it's \"q\""],
        "e": {}, "el": [],
        "nested": {"deep": {"up": "${..sib}", "top": "${...y}", "self": "${.own}", "own": "O"}, "sib": "S"},
        "chain": "${y}${y}", "via": "${chain}-${m.b}",
    })
}

const CASES: &[&str] = &[
    // Node references, absolute and relative, templates, whole nodes.
    "${y}",
    "a${y}b",
    "${y}${n}${i}${t}${z}",
    "${n}",
    "${i}",
    "${big}",
    "${t}",
    "${z}",
    "${m}",
    "${l}",
    "${m.d.e}",
    "${m.d.e[1]}",
    "${l[2]}",
    "${m.b}",
    "${[y]}",
    "${m[b]}",
    "${ y }",
    "${via}",
    "${nested.deep.up}",
    "${nested.deep.top}",
    "${nested.deep.self}",
    "${missing}",
    "${m.missing}",
    "${y.}",
    "${y..z}",
    "${l[9]}",
    "${y[0]}",
    // Containers inside a template go through str(), as OmegaConf writes them.
    "x${m}y",
    "x${l}y",
    "pre ${m.d} post",
    "[${e}][${el}]",
    "${y}${m}",
    // Escapes of `${` and backslashes.
    "x\\${y}z",
    "x\\\\${y}z",
    "x\\\\\\${y}z",
    "\\\\",
    "a\\b",
    "x $ {y}",
    "$${y}",
    "${",
    "}${y}{",
    // oc.env: set, unset with defaults of every kind, and their quirks.
    "${oc.env:SET}",
    "${oc.env:EMPTY}",
    "${oc.env:UNSET}",
    "${oc.env: SET }",
    "${oc.env :SET}",
    "${oc.env:UNSET,1e3}",
    "${oc.env:UNSET,TRUE}",
    "${oc.env:UNSET,false}",
    "${oc.env:UNSET,null}",
    "${oc.env:UNSET,NULL}",
    "${oc.env:UNSET,1_000}",
    "${oc.env:UNSET,-3}",
    "${oc.env:UNSET,+3}",
    "${oc.env:UNSET,0x10}",
    "${oc.env:UNSET,.5}",
    "${oc.env:UNSET,5.}",
    "${oc.env:UNSET,yes}",
    "${oc.env:UNSET,  a b  }",
    "${oc.env:UNSET,'it\\'s'}",
    "${oc.env:UNSET,'a\\\\b'}",
    "${oc.env:UNSET,'a\\b'}",
    "${oc.env:UNSET,'a\\\\'}",
    "${oc.env:UNSET,'a\\\\\\'b'}",
    "${oc.env:UNSET,\"a'b\"}",
    "${oc.env:UNSET,'a\"b'}",
    "${oc.env:UNSET,'a\\\"b'}",
    "${oc.env:UNSET,a\\\\b}",
    "${oc.env:UNSET,a\\,b}",
    "${oc.env:UNSET,a\\ b}",
    "${oc.env:UNSET,a:b}",
    "${oc.env:UNSET,a.b/c@d}",
    "${oc.env:UNSET,a?b|c%d*e$f}",
    "${oc.env:UNSET,[1,2]}",
    "${oc.env:UNSET,[]}",
    "${oc.env:UNSET,{a:1}}",
    "${oc.env:UNSET,{}}",
    "${oc.env:UNSET,[a, 'b c', {d: 1.5}]}",
    "${oc.env:UNSET,${y}}",
    "${oc.env:UNSET,x${m}}",
    "${oc.env:UNSET,'x${y}'}",
    "${oc.env:UNSET,'${n}'}",
    "${oc.env:${y},d}",
    "${oc.env:'SET'}",
    "${oc.env:UNSET,}",
    "${oc.env:UNSET,a}b}",
    // Grammar errors.
    "${oc.env:UNSET,a=b}",
    "${oc.env:UNSET,(x)}",
    "${(x)}",
    "${oc.env:UNSET,a!b}",
    "${oc.env:UNSET,a'b}",
    "${oc.env:UNSET,a\"b}",
    "${oc.env:UNSET,é}",
    "${oc.env:UNSET,a#b}",
    "${oc.env:UNSET,b,c}",
    "${oc.env:}",
    "${oc.env}",
    "${oc.env:UNSET,'open}",
    // oc.select: present, absent, typed defaults.
    "${oc.select:y}",
    "${oc.select:m}",
    "${oc.select:nope}",
    "${oc.select:nope,'d'}",
    "${oc.select:nope,1.5}",
    "${oc.select:nope,7}",
    "${oc.select:nope,true}",
    "${oc.select:nope,${m}}",
    "${oc.select:nope,[1,${n}]}",
    "${oc.select:nope,{a: ${n}}}",
    "${oc.select:nope,1_0}",
    "${oc.select:nope,' a '}",
    "${oc.select:nope,  a  b }",
    "${oc.select:nope,a${n}b}",
    "${oc.select:nope,${n}}",
    "x${oc.select:nope}y",
    "${oc.select:m.d.e}",
    "${oc.select:}",
];

/// What OmegaConf makes of every case: `{"value": ...}` or `{"error": "<class>"}`.
const ORACLE: &str = r#"
import json, os, sys, warnings
warnings.simplefilter("ignore")
from omegaconf import OmegaConf
data = json.load(sys.stdin)
for name in data["unset"]:
    os.environ.pop(name, None)
os.environ.update(data["env"])
cases = data["root"].pop("case")
out = {}
for key, template in cases.items():
    try:
        # One configuration per case: OmegaConf refuses a whole tree when one string in it
        # does not parse.
        config = OmegaConf.create(dict(data["root"], case={key: template}))
        value = OmegaConf.select(config, "case." + key, throw_on_resolution_failure=True, throw_on_missing=True)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        out[key] = {"value": value}
    except Exception as e:
        out[key] = {"error": type(e).__name__}
print(json.dumps(out))
"#;

fn environment() -> BTreeMap<String, String> {
    BTreeMap::from([("SET".into(), "v".into()), ("EMPTY".into(), String::new())])
}

fn ours(root: &Value, key: &str) -> Result<Value, String> {
    let env = environment();
    Resolver::new(&env)
        .resolve_at(
            root,
            &[Segment::Key("case".into()), Segment::Key(key.into())],
        )
        .map_err(|e| e.to_string())
}

#[test]
fn item_9_every_interpolation_of_the_table_resolves_as_omegaconf_resolves_it() {
    let mut root = fixtures();
    let cases: serde_json::Map<String, Value> = CASES
        .iter()
        .enumerate()
        .map(|(i, case)| (format!("c{i}"), json!(case)))
        .collect();
    root["case"] = Value::Object(cases);
    let input = json!({"root": root, "env": environment(), "unset": ["UNSET", "Y"]});
    let answer = python(ORACLE, input.to_string().as_bytes());
    let oracle: Value = serde_json::from_slice(&answer).unwrap_or_else(|e| {
        panic!(
            "OmegaConf must be installed (`pip install omegaconf`; .ci/run does): {e}: {}",
            String::from_utf8_lossy(&answer)
        )
    });
    let mut differences = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let key = format!("c{i}");
        let expected = &oracle[&key];
        let got = ours(&root, &key);
        let same = match (&got, expected.get("value")) {
            (Ok(value), Some(wanted)) => canonical_equal(value, wanted),
            (Err(_), None) => true,
            _ => false,
        };
        if !same {
            differences.push(format!("{case:?}: OmegaConf {expected}, ours {got:?}"));
        }
    }
    assert!(
        differences.is_empty(),
        "{} of {} cases differ:\n{}",
        differences.len(),
        CASES.len(),
        differences.join("\n")
    );
}

#[test]
fn other_resolvers_are_refused_naming_the_resolver() {
    for refused in ["${oc.decode:1}", "${env:X}", "${oc.create:{}}", "${now:}"] {
        let mut root = fixtures();
        root["case"] = json!({"c": refused});
        let error = ours(&root, "c").expect_err(refused);
        assert!(
            error.contains("case.c"),
            "{refused}: names the key: {error}"
        );
    }
}

/// A chain of relative references (`k0: ${.k1}`, `k1: ${.k2}`, ..., `"end"`), with `fan` more
/// keys referring to its head.
fn chain(links: usize, fan: usize) -> Value {
    let mut case = serde_json::Map::new();
    for i in 0..links {
        case.insert(format!("k{i}"), json!(format!("${{.k{}}}", i + 1)));
    }
    case.insert(format!("k{links}"), json!("end"));
    for j in 0..fan {
        case.insert(format!("f{j}"), json!("${.k0}"));
    }
    json!({ "case": case })
}

/// Every key of a chain met from many keys resolves to its end: a string resolved once is
/// answered again from what it resolved to (a 3,000-link chain took ~50 s, cubic in its length:
/// hostile review 55, F10). OmegaConf itself resolves a chain of 50 links and no longer one.
#[test]
fn a_chain_of_references_met_from_many_keys_resolves_each_to_its_end() {
    let root = chain(200, 2_000);
    let env = environment();
    let resolved = Resolver::new(&env)
        .resolve_at(&root, &[Segment::Key("case".into())])
        .expect("resolves");
    let values = resolved.as_object().expect("a mapping");
    assert_eq!(values.len(), 201 + 2_000);
    assert!(values.values().all(|v| v == "end"), "{resolved}");
    let oracle = python(
        "import json, sys\nfrom omegaconf import OmegaConf\nc = OmegaConf.create(json.load(sys.stdin))\nprint(json.dumps(OmegaConf.to_container(c, resolve=True)))",
        chain(50, 20).to_string().as_bytes(),
    );
    let oracle: Value = serde_json::from_slice(&oracle).expect("OmegaConf's answer");
    let ours = Resolver::new(&env)
        .resolve_at(&chain(50, 20), &[Segment::Key("case".into())])
        .expect("resolves");
    assert_eq!(ours, oracle["case"]);
}

/// A chain deeper than the resolver nests interpolations is refused naming a key of it, before
/// the stack runs out (OmegaConf stops at a RecursionError much sooner).
#[test]
fn a_chain_deeper_than_interpolations_nest_is_refused_naming_a_key() {
    let env = environment();
    let refused = Resolver::new(&env)
        .resolve_at(&chain(100_000, 0), &[Segment::Key("case".into())])
        .expect_err("refused");
    assert!(
        refused.key.starts_with("case.k") && refused.message.contains("nested deeper than 256"),
        "{refused:?}"
    );
}
