//! The API contract under hostile input (issue 11): every refusal in the error shape, with a
//! stable code and a message naming what is at fault, and nothing written or echoed.

use super::*;

/// One request with extra headers, through the router.
async fn send_headers(app: &TestApp, uri: &str, headers: &[(&str, String)]) -> Reply {
    let mut request = Request::builder().method(Method::GET).uri(uri);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let request = request.body(Body::empty()).expect("request");
    let (status, _, bytes) = respond(app.state.clone(), request).await;
    Reply::of(status, &bytes)
}

/// `depth` nested arrays around `0`.
fn nested(depth: usize) -> String {
    format!("{}0{}", "[".repeat(depth), "]".repeat(depth))
}

fn assert_invalid_naming(reply: &Reply, field: &str, context: &str) {
    assert_eq!(
        (reply.status, reply.body["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("invalid_request")),
        "{context}: {}",
        reply.body
    );
    let message = reply.body["message"].as_str().expect("message");
    assert!(message.contains(field), "{context}: {message}");
    assert!(
        message.len() < 400,
        "{context}: the message never echoes the input: {} bytes",
        message.len()
    );
}

/// A refused field is named for programs too, as `details.field`: a body field of the wrong
/// type (its path), a missing or unknown field, a query parameter, and every field a handler
/// checks itself.
#[tokio::test]
async fn a_number_of_the_wrong_kind_is_refused_in_words_not_rust_type_names() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let lease = |extra: Value| {
        let mut body = json!({"holder": "c", "host": "h", "pid": 1});
        body.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        body
    };
    let cases = [
        (lease(json!({"pid": "1"})), "pid", "expected an integer"),
        (lease(json!({"pid": 1.5})), "pid", "expected an integer"),
        // A lifetime is refused with its range whatever the number (hostile review, stop 29:
        // `-1` said "0 or more" and `0` the range); another type by its type.
        (
            lease(json!({"ttl_seconds": -1})),
            "ttl_seconds",
            "out of range: must be between 1 and 3600",
        ),
        (
            lease(json!({"ttl_seconds": 0})),
            "ttl_seconds",
            "out of range: must be between 1 and 3600",
        ),
        (
            lease(json!({"ttl_seconds": 1e20})),
            "ttl_seconds",
            "out of range: must be between 1 and 3600",
        ),
        (
            lease(json!({"ttl_seconds": "60"})),
            "ttl_seconds",
            "got a string: must be an integer",
        ),
        (
            lease(json!({"ttl_seconds": 1.5})),
            "ttl_seconds",
            "1.5 is a float: must be an integer",
        ),
    ];
    for (body, field, said) in cases {
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/lease"),
                Some(COLLECTOR),
                Some(body.clone()),
            )
            .await;
        let message = reply.body["message"].as_str().unwrap_or_default();
        reply.assert_field_refused(field, &body.to_string());
        assert!(
            message.starts_with(&format!("{field}: ")) && message.ends_with(said),
            "{body}: {message}"
        );
        for rust in ["i64", "u64", "f64", "usize"] {
            assert!(!message.contains(rust), "{body}: {message}");
        }
    }
}

/// `allow_unsafe_resume` is the Python module's name for `allow_unsafe`: a body with both is
/// told they are one field (serde said only "duplicate field", of a field sent once).
#[tokio::test]
async fn both_names_of_allow_unsafe_are_refused_as_one_field_given_twice() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let mut body = app.validate_body(0.3, 8000);
    body["allow_unsafe"] = json!(true);
    body["allow_unsafe_resume"] = json!(false);
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(body.clone()),
        )
        .await;
    reply.assert_field_refused("allow_unsafe", &body.to_string());
    assert_eq!(
        reply.body["message"],
        "allow_unsafe: duplicate field `allow_unsafe` (`allow_unsafe_resume` is another name for \
         `allow_unsafe`: send one of the two)"
    );
    // One name sent twice is a plain duplicate (both reviews of stop 30 saw the hint there).
    for name in ["allow_unsafe", "allow_unsafe_resume"] {
        let text = app.validate_body(0.3, 8000).to_string().replacen(
            '{',
            &format!("{{\"{name}\": true, \"{name}\": false, "),
            1,
        );
        let reply = app
            .call_raw(
                Method::POST,
                &format!("/runs/{run_id}/validate"),
                Some(COLLECTOR),
                Some(text.clone()),
            )
            .await;
        assert_eq!(
            reply.body["message"], "allow_unsafe: duplicate field `allow_unsafe`",
            "{text}"
        );
    }
}

#[tokio::test]
async fn an_invalid_field_is_named_in_details() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let mut wrong_type = app.validate_body(0.3, 8000);
    wrong_type["allow_unsafe"] = json!("yes");
    let mut missing = app.create_body();
    missing
        .as_object_mut()
        .expect("object")
        .remove("output_path");
    let mut unknown = app.create_body();
    unknown["output_pth"] = json!("typo.jsonl");
    let mut empty_lease = app.validate_body(0.3, 8000);
    empty_lease["lease_id"] = json!("");
    let mut empty_output = app.create_body();
    empty_output["output_path"] = json!("");
    // No rows: the run would be complete at once.
    let mut no_rows = app.create_body();
    no_rows["output_path"] = json!(app.root.join("empty/out.jsonl"));
    no_rows["rows"] = json!([]);
    let cases = [
        (
            Method::POST,
            "/runs".to_owned(),
            COLLECTOR,
            Some(no_rows),
            "rows",
        ),
        (
            Method::POST,
            format!("/runs/{run_id}/validate"),
            COLLECTOR,
            Some(wrong_type),
            "allow_unsafe",
        ),
        (
            Method::POST,
            "/runs".to_owned(),
            COLLECTOR,
            Some(missing),
            "output_path",
        ),
        (
            Method::POST,
            "/runs".to_owned(),
            COLLECTOR,
            Some(unknown),
            "output_pth",
        ),
        (
            Method::GET,
            "/drift?limit=5000".to_owned(),
            VIEWER,
            None,
            "limit",
        ),
        (
            Method::GET,
            "/drift?limit=abc".to_owned(),
            VIEWER,
            None,
            "limit",
        ),
        (
            Method::GET,
            "/runs?limit=-1".to_owned(),
            VIEWER,
            None,
            "limit",
        ),
        // A misspelt filter is refused, never read as no filter.
        (
            Method::GET,
            "/drift?runid=x".to_owned(),
            VIEWER,
            None,
            "runid",
        ),
        (
            Method::GET,
            "/drift?limit=1&limit=2".to_owned(),
            VIEWER,
            None,
            "limit",
        ),
        (
            Method::GET,
            format!("/drift?run_id={}", "r".repeat(300)),
            VIEWER,
            None,
            "run_id",
        ),
        (
            Method::GET,
            format!("/audit?run_id={}", "r".repeat(300)),
            OPERATOR,
            None,
            "run_id",
        ),
        (
            Method::GET,
            format!("/runs/{run_id}/drift?run_id=x"),
            VIEWER,
            None,
            "run_id",
        ),
        (Method::GET, "/runs?limt=5".to_owned(), VIEWER, None, "limt"),
        (
            Method::GET,
            format!("/runs/{run_id}/plan?stat=failed"),
            VIEWER,
            None,
            "stat",
        ),
        (
            Method::GET,
            "/audit?actr=ops".to_owned(),
            OPERATOR,
            None,
            "actr",
        ),
        // A misspelt action would match nothing, silently.
        (
            Method::GET,
            "/audit?action=lease.take_over".to_owned(),
            VIEWER,
            None,
            "action",
        ),
    ];
    // Fields the handlers check themselves (ranges, emptiness, cursors, times, files).
    let lease = |change: Value| {
        let mut body = json!({"holder": "c", "host": "h", "pid": 1, "ttl_seconds": 60});
        for (key, value) in change.as_object().expect("object") {
            body[key] = value.clone();
        }
        body
    };
    let mut no_source = app.create_body();
    no_source["source_path"] = json!("data/missing.jsonl");
    let mut no_attempts = app.create_body();
    no_attempts["max_rollout_attempts"] = json!(0);
    let mut scalar_row = app.validate_body(0.3, 8000);
    scalar_row["rows"] = json!([5]);
    let lease_uri = format!("/runs/{run_id}/lease");
    let checked = [
        (
            Method::POST,
            lease_uri.clone(),
            COLLECTOR,
            Some(lease(json!({"holder": " "}))),
            "holder",
        ),
        (
            Method::POST,
            lease_uri.clone(),
            COLLECTOR,
            Some(lease(json!({"host": ""}))),
            "host",
        ),
        (
            Method::POST,
            lease_uri.clone(),
            COLLECTOR,
            Some(lease(json!({"pid": -1}))),
            "pid",
        ),
        (
            Method::POST,
            lease_uri.clone(),
            COLLECTOR,
            Some(lease(json!({"ttl_seconds": 0}))),
            "ttl_seconds",
        ),
        (
            Method::POST,
            lease_uri.clone(),
            COLLECTOR,
            Some(lease(json!({"checkpoint_dir": " "}))),
            "checkpoint_dir",
        ),
        (
            Method::POST,
            format!("/runs/{run_id}/lease/takeover"),
            OPERATOR,
            Some(lease(json!({"reason": " "}))),
            "reason",
        ),
        (
            Method::POST,
            "/runs".to_owned(),
            COLLECTOR,
            Some(no_source),
            "source_path",
        ),
        (
            Method::POST,
            "/runs".to_owned(),
            COLLECTOR,
            Some(no_attempts),
            "max_rollout_attempts",
        ),
        (
            Method::GET,
            "/runs?cursor=garbage".to_owned(),
            VIEWER,
            None,
            "cursor",
        ),
        (
            Method::POST,
            format!("/runs/{run_id}/validate"),
            COLLECTOR,
            Some(scalar_row),
            "rows[0]",
        ),
        (
            Method::POST,
            format!("/runs/{run_id}/attempts/extend"),
            OPERATOR,
            Some(json!({"extend_attempts": 0, "reason": "more"})),
            "extend_attempts",
        ),
        // Every operator action says why (review 55, F7: a resubmit took an empty reason).
        (
            Method::POST,
            format!("/runs/{run_id}/attempts/resubmit"),
            OPERATOR,
            Some(json!({"reason": " \t"})),
            "reason",
        ),
        (
            Method::GET,
            format!("/runs/{run_id}/plan?cursor=x"),
            VIEWER,
            None,
            "cursor",
        ),
        (
            Method::POST,
            format!("/runs/{run_id}/approvals"),
            OPERATOR,
            Some(json!({"task_index": -1, "rollout_index": 0, "attempt_index": 0, "reason": "r"})),
            "task_index",
        ),
        (
            Method::DELETE,
            format!("/runs/{run_id}/approvals/{}", "a".repeat(300)),
            OPERATOR,
            None,
            "approval_id",
        ),
        (Method::GET, "/drift?key=".to_owned(), VIEWER, None, "key"),
        (
            Method::GET,
            "/drift?run_id=".to_owned(),
            VIEWER,
            None,
            "run_id",
        ),
        (
            Method::GET,
            "/drift?from=2026-11-30T00%3A00%3A00Z&to=2026-11-29T00%3A00%3A00Z".to_owned(),
            VIEWER,
            None,
            "to",
        ),
        (
            Method::GET,
            "/drift?order=sideways".to_owned(),
            VIEWER,
            None,
            "order",
        ),
        // A time cursor whose id part no event or entry has.
        (
            Method::GET,
            "/drift?cursor=2026-11-29T10%3A00%3A00.000000Z%7Czzz".to_owned(),
            VIEWER,
            None,
            "cursor",
        ),
        (
            Method::GET,
            "/audit?cursor=2026-11-29T10%3A00%3A00.000000Z%7CABC".to_owned(),
            VIEWER,
            None,
            "cursor",
        ),
        // A cursor of the other order, a made-up position, one past the last recorded.
        (
            Method::GET,
            "/drift?order=recorded&cursor=2026-11-29T10%3A00%3A00.000000Z%7Cabc".to_owned(),
            VIEWER,
            None,
            "cursor",
        ),
        (
            Method::GET,
            "/drift?cursor=recorded%3A0".to_owned(),
            VIEWER,
            None,
            "cursor",
        ),
        (
            Method::GET,
            "/drift?order=recorded&cursor=recorded%3A-1".to_owned(),
            VIEWER,
            None,
            "cursor",
        ),
        (
            Method::GET,
            "/drift?order=recorded&cursor=recorded%3Aabc%3A007".to_owned(),
            VIEWER,
            None,
            "cursor",
        ),
        (
            Method::GET,
            format!("/runs/{run_id}/drift?order=recorded&cursor=recorded%3A1000000"),
            VIEWER,
            None,
            "cursor",
        ),
        (
            Method::GET,
            "/drift?from=yesterday".to_owned(),
            VIEWER,
            None,
            "from",
        ),
        // An offset whose `+` was not encoded (a query string reads it as a space).
        (
            Method::GET,
            "/drift?from=2026-11-29T10:00:00+01:00".to_owned(),
            VIEWER,
            None,
            "from",
        ),
        (
            Method::GET,
            "/drift?to=9999-12-31T23:30:00-01:00".to_owned(),
            VIEWER,
            None,
            "to",
        ),
        (
            Method::GET,
            "/drift?to=2026-13-01T00:00:00Z".to_owned(),
            VIEWER,
            None,
            "to",
        ),
        (
            Method::POST,
            "/classify".to_owned(),
            VIEWER,
            Some(json!({"rows": [{"status": "ok"}, 5]})),
            "rows[1]",
        ),
        (
            Method::POST,
            "/classify".to_owned(),
            VIEWER,
            Some(json!({"rows": [], "policy": {"schema_version": 2}})),
            "policy",
        ),
        // An operation that takes no query parameter refuses one (a misspelt option).
        (
            Method::GET,
            format!("/runs/{run_id}/lease?holder=x"),
            VIEWER,
            None,
            "holder",
        ),
        (
            Method::POST,
            format!("/runs/{run_id}/validate?allow_unsafe=true"),
            COLLECTOR,
            Some(app.validate_body(0.3, 8000)),
            "allow_unsafe",
        ),
        (
            Method::GET,
            format!("/runs/{run_id}?verbose"),
            VIEWER,
            None,
            "verbose",
        ),
        // An empty filter or id names nothing.
        (
            Method::GET,
            "/audit?actor=".to_owned(),
            VIEWER,
            None,
            "actor",
        ),
        (
            Method::GET,
            "/runs?output_path=".to_owned(),
            VIEWER,
            None,
            "output_path",
        ),
        (
            Method::POST,
            format!("/runs/{run_id}/lease/heartbeat"),
            COLLECTOR,
            Some(json!({"lease_id": ""})),
            "lease_id",
        ),
        (
            Method::POST,
            "/runs".to_owned(),
            COLLECTOR,
            Some(empty_output),
            "output_path",
        ),
        // An optional id sent empty is refused too, not looked up (a validate's empty lease
        // was answered 409 lease_not_held: hostile review 28).
        (
            Method::POST,
            format!("/runs/{run_id}/validate"),
            COLLECTOR,
            Some(empty_lease),
            "lease_id",
        ),
        (
            Method::GET,
            "/drift?run_id=".to_owned(),
            VIEWER,
            None,
            "run_id",
        ),
        (
            Method::GET,
            "/audit?run_id=".to_owned(),
            VIEWER,
            None,
            "run_id",
        ),
        // A URL looked up as an output path is refused as in bodies, not answered "no run"
        // (hostile review 53, F4).
        (
            Method::GET,
            "/runs?output_path=https%3A%2F%2Fu%3Apw%40h%2Fx.jsonl".to_owned(),
            VIEWER,
            None,
            "output_path",
        ),
    ];
    for (method, uri, token, body, field) in cases.into_iter().chain(checked) {
        let reply = app.call(method.clone(), &uri, Some(token), body).await;
        let message = reply.body["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with(&format!("{field}: ")),
            "{uri}: the field comes first in the message: {message}"
        );
        if field == "allow_unsafe" && method == Method::POST && !uri.contains('?') {
            assert!(
                !message.contains(" at line "),
                "a value of the wrong type is named without serde's position: {message}"
            );
        }
        assert_invalid_naming(&reply, field, &uri);
        assert_eq!(
            reply.body["details"]["field"], field,
            "{uri}: {}",
            reply.body
        );
    }
}

/// Two rows with one logical rollout id are refused in the Python module's words ("Duplicate
/// logical rollout id", which its tests match), naming the row, and nothing is written.
#[tokio::test]
async fn a_create_with_a_repeated_rollout_id_is_refused_in_the_python_modules_words() {
    let app = TestApp::new().await;
    let mut body = app.create_body();
    body["rows"] = json!([
        {"agent_ref": {"name": "math_agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0, "q": 1},
        {"agent_ref": {"name": "math_agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0, "q": 2}
    ]);
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.body
    );
    assert!(
        reply.body["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("rows[1]: Duplicate logical rollout id '0-0'")),
        "{}",
        reply.body
    );
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    assert!(!paths.manifest.exists() && !paths.materialized.exists());
}

/// A configuration holding a number its digest cannot be taken of (`1e999`, infinity to Python)
/// is refused as the request's fault, naming the key, where the digest's refusal said
/// `identity_error ... (byte 0)` (hostile review 53, F1) and a validate said `config: ...
/// (byte 56)` (review 54); a key that is no plain name is quoted after the field. A create
/// writes nothing; a validate leaves the run's files as they were.
#[tokio::test]
async fn a_configuration_holding_an_infinite_number_is_refused_naming_its_key() {
    let app = TestApp::new().await;
    let cases = [
        ("config", r#"{"a": {"b": [1, 1e999]}}"#, "config.a.b[1]", ""),
        (
            "global_config",
            r#"{"my server": {"port": -1e400}}"#,
            "global_config",
            r#"(at ["my server"]["port"])"#,
        ),
        // A row's too (review 55, F4: `rows[0]: ... (byte 82)`).
        (
            "rows",
            r#"[{"agent_ref": {"name": "math_agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0, "question": 1e999}]"#,
            "rows[0].question",
            "",
        ),
    ];
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let refused_naming = |reply: &Reply, named: &str, quoted: &str| {
        assert_code(reply, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
        let message = reply.body["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with(&format!("{named}: a number with no canonical form"))
                && message.contains(quoted)
                && message.ends_with("NaN and infinite numbers have no JSON form"),
            "{message}"
        );
        assert_eq!(reply.body["details"]["field"], named, "{}", reply.body);
    };
    for (field, text, named, quoted) in cases {
        let mut body = app.create_body();
        body[field] = serde_json::from_str(text).expect("a JSON text");
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        refused_naming(&reply, named, quoted);
        assert!(!paths.manifest.exists() && !paths.materialized.exists());
    }
    let run_id = app.create().await;
    let files_before = sidecar_bytes(&paths);
    for (field, text, named, quoted) in cases {
        let mut body = app.validate_body(0.3, 8000);
        body[field] = serde_json::from_str(text).expect("a JSON text");
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/validate"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        refused_naming(&reply, named, quoted);
        assert!(
            sidecar_bytes(&paths) == files_before,
            "{named}: a file changed"
        );
    }
}

/// The bytes of a run's manifest, saved identity and drift journal (empty when absent).
fn sidecar_bytes(paths: &recovery_sidecar::SidecarPaths) -> Vec<Vec<u8>> {
    [&paths.manifest, &paths.identity, &paths.resume_drift]
        .iter()
        .map(|path| std::fs::read(path).unwrap_or_default())
        .collect()
}

/// Refusals about the request as a whole name no field (the review saw `details.field: "body"`),
/// nor does a key no field has that reads as no field name (it is not repeated either), and
/// the audit log's cursor refusal does not point at a drift-only parameter.
#[tokio::test]
async fn refusals_of_the_whole_request_name_no_field() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    for (method, uri, body) in [
        (
            Method::POST,
            format!("/runs/{run_id}/validate"),
            Some("not json".to_owned()),
        ),
        (Method::POST, "/runs".to_owned(), Some("[1, 2]".to_owned())),
    ] {
        let reply = send(app.state.clone(), method, &uri, Some(COLLECTOR), body).await;
        assert_eq!(
            reply.body["code"], "invalid_request",
            "{uri}: {}",
            reply.body
        );
        assert!(
            reply.body["details"].get("field").is_none(),
            "{uri}: {}",
            reply.body
        );
    }
    // A key no field has that does not read as a field name is not repeated: it may be a
    // token pasted in the wrong place.
    let mut pasted = app.validate_body(0.3, 8000);
    pasted["Bearer SKEYQ77"] = json!(true);
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(pasted),
        )
        .await;
    let text = reply.body.to_string();
    assert_eq!(reply.body["code"], "invalid_request", "{text}");
    assert!(
        !text.contains("SKEYQ77") && reply.body["details"].get("field").is_none(),
        "{text}"
    );
    assert!(
        reply.body["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("body: unknown field (its name is not repeated)")),
        "{text}"
    );
    // A key named like a credential is no field either: refused as unknown (it was refused as
    // a field whose value was wrong, hostile review 30).
    for key in ["password", "api_key"] {
        let mut body = app.validate_body(0.3, 8000);
        body[key] = json!("hunter2");
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/validate"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        let text = reply.body.to_string();
        assert!(!text.contains("hunter2"), "{text}");
        reply.assert_field_refused(key, key);
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(&format!("{key}: unknown field `{key}`, expected "))),
            "{text}"
        );
    }
    // Token shapes made of name characters are no field name either (hostile review 31):
    // `-`, `.` and capitals are in tokens, never in a field or parameter name.
    for token in [
        "Bearer%20SKEYQ77",
        "sk-SKEYQ77abc",
        "ghp_SKEYQ77AbCd",
        "a.SKEYQ77",
    ] {
        // Lists, and operations that take no parameters (hostile review 33: those named it).
        for uri in [
            format!("/drift?{token}=1"),
            format!("/runs/{run_id}/validations?{token}=1"),
            format!("/runs/{run_id}?{token}=1"),
            format!("/runs/{run_id}/lease?{token}=1"),
            format!("/runs/{run_id}/approvals?{token}=1"),
        ] {
            let reply = app.call(Method::GET, &uri, Some(VIEWER), None).await;
            let text = reply.body.to_string();
            assert_eq!(reply.body["code"], "invalid_request", "{uri}: {text}");
            assert!(
                !text.contains("SKEYQ77") && reply.body["details"].get("field").is_none(),
                "{uri}: {text}"
            );
        }
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/validate?{token}=1"),
                Some(COLLECTOR),
                Some(app.validate_body(0.3, 8000)),
            )
            .await;
        let text = reply.body.to_string();
        assert!(
            reply.body["code"] == "invalid_request"
                && !text.contains("SKEYQ77")
                && reply.body["details"].get("field").is_none(),
            "validate?{token}: {text}"
        );
        let mut body = app.validate_body(0.3, 8000);
        body[token.replace("%20", " ")] = json!(1);
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/validate"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        let text = reply.body.to_string();
        assert!(
            !text.contains("SKEYQ77") && reply.body["details"].get("field").is_none(),
            "{token}: {text}"
        );
        // Inside a classify policy, the key is refused naming the policy, not repeated
        // (hostile review 32: the core's policy parser said it back).
        let classify = json!({"rows": [], "policy": {token.replace("%20", " "): 1}});
        let reply = app
            .call(Method::POST, "/classify", Some(VIEWER), Some(classify))
            .await;
        let text = reply.body.to_string();
        assert!(!text.contains("SKEYQ77"), "{token}: {text}");
        reply.assert_field_refused("policy", "policy");
    }
    // A parameter named like one is still named, where none is taken too.
    let reply = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}?verbose=1"),
            Some(VIEWER),
            None,
        )
        .await;
    reply.assert_field_refused("verbose", "a parameter of an operation that takes none");
    // A misspelt policy key reads as a field name and is still named.
    let classify = json!({"rows": [], "policy": {"schema_versionn": 1}});
    let reply = app
        .call(Method::POST, "/classify", Some(VIEWER), Some(classify))
        .await;
    reply.assert_field_refused("policy", "a misspelt policy key");
    assert!(
        reply.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("unknown field `schema_versionn`")),
        "{}",
        reply.body
    );
    // A path that is a URL, which may carry a credential, is refused without being repeated,
    // and the refusal is not recorded (hostile review 31: it was answered and kept).
    let recorded = app
        .state
        .registry
        .store()
        .list_resume_events(&run_id, 1000)
        .await
        .expect("events")
        .len();
    for path in [
        "https://user:SKEYQ77pw@host/x.jsonl",
        "s3://bucket/x.jsonl?token=SKEYQ77",
        "data/file://SKEYQ77/x.jsonl",
    ] {
        let mut body = app.validate_body(0.3, 8000);
        body["source_path"] = json!(path);
        let mut create = app.create_body();
        create["output_path"] = json!(path);
        let lease = json!({"holder": "c", "host": "h", "pid": 1, "checkpoint_dir": path});
        for (uri, body, field) in [
            (format!("/runs/{run_id}/validate"), body, "source_path"),
            ("/runs".to_owned(), create, "output_path"),
            (format!("/runs/{run_id}/lease"), lease, "checkpoint_dir"),
        ] {
            let reply = app
                .call(Method::POST, &uri, Some(COLLECTOR), Some(body))
                .await;
            let text = reply.body.to_string();
            assert!(!text.contains("SKEYQ77"), "{uri} {path}: {text}");
            reply.assert_field_refused(field, path);
            assert!(
                reply.body["message"].as_str().is_some_and(|m| m
                    .starts_with(&format!("{field}: is a URL, not a file path"))
                    && !m.contains("  ")),
                "{text}"
            );
        }
    }
    let after = app
        .state
        .registry
        .store()
        .list_resume_events(&run_id, 1000)
        .await
        .expect("events");
    assert_eq!(
        after.len(),
        recorded,
        "refusals of a request's reading are not recorded"
    );
    assert!(!format!("{after:?}").contains("SKEYQ77"));
    // Other paths are taken as sent, sweep directories among them (hostile review 32: a
    // credential pattern refused `eos_token=eos`).
    for path in [
        "data/lr=0.1,max_tokens=512/train.jsonl",
        "data/eos_token=eos,pad_token=0/train.jsonl",
        "data/basic runs/train.jsonl",
        "data/user@cluster:8000/train.jsonl",
    ] {
        std::fs::create_dir_all(app.root.join(path).parent().expect("dir")).expect("dir");
        std::fs::copy(app.source(), app.root.join(path)).expect("source");
        let mut body = app.validate_body(0.3, 8000);
        body["source_path"] = json!(app.root.join(path));
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/validate"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{path}: {}", reply.body);
    }
    // A misspelt parameter is still named, for the caller to see what was wrong.
    let reply = app
        .call(Method::GET, "/drift?run_idd=1", Some(VIEWER), None)
        .await;
    reply.assert_field_refused("run_idd", "run_idd");
    let reply = app
        .call(
            Method::GET,
            "/audit?cursor=recorded%3Aabc%3A1",
            Some(VIEWER),
            None,
        )
        .await;
    let message = reply.body["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("cursor: ") && !message.contains("order"),
        "{}",
        reply.body
    );
}

/// Refusals name their field whatever their code: a source outside the roots
/// (`path_refused`) and a configuration that is no mapping (`invalid_request`, as any
/// wrong-typed field).
#[tokio::test]
async fn refusals_of_their_own_kind_name_their_field() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let mut outside = app.validate_body(0.3, 8000);
    outside["source_path"] = json!("/etc/passwd");
    let mut not_a_mapping = app.validate_body(0.3, 8000);
    not_a_mapping["config"] = json!(5);
    for (body, code, field) in [
        (outside, "path_refused", "source_path"),
        (not_a_mapping, "invalid_request", "config"),
    ] {
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/validate"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        assert_eq!(reply.body["code"], code, "{}", reply.body);
        assert_eq!(reply.body["details"]["field"], field, "{}", reply.body);
    }
    for (field, value) in [("config", json!([])), ("global_config", json!("x"))] {
        let mut body = app.create_body();
        body[field] = value;
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_code(&reply, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
        assert_eq!(reply.body["details"]["field"], field, "{}", reply.body);
    }
    // An output outside the roots, or climbing out of them, is named as output_path.
    for output in [
        "/etc/elsewhere.jsonl",
        "../escape.jsonl",
        "exp/../../escape.jsonl",
    ] {
        let mut body = app.create_body();
        body["output_path"] = json!(output);
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_code(&reply, StatusCode::UNPROCESSABLE_ENTITY, "path_refused");
        assert_eq!(reply.body["details"]["field"], "output_path", "{output}");
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("output_path: ")),
            "{output}: {}",
            reply.body
        );
    }
}

/// A body the service refuses on its own is refused as such while another client holds the
/// run's lease: the caller learns what to fix (the source path), not only that the run is held.
#[tokio::test]
async fn a_bad_validate_body_is_named_before_the_lease_is_looked_at() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let granted = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(json!({"holder": "c", "host": "h", "pid": 1})),
        )
        .await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    let mut outside = app.validate_body(0.3, 8000);
    outside["source_path"] = json!("/etc/passwd");
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(outside),
        )
        .await;
    assert_code(&reply, StatusCode::UNPROCESSABLE_ENTITY, "path_refused");
    assert_eq!(reply.body["details"]["field"], "source_path");
    let mut not_a_mapping = app.validate_body(0.3, 8000);
    not_a_mapping["config"] = json!("x");
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(not_a_mapping),
        )
        .await;
    assert_code(&reply, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
    assert_eq!(reply.body["details"]["field"], "config");
    // A good body from the same caller is refused for the lease.
    let held = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_code(&held, StatusCode::LOCKED, "run_locked");
}

/// A row the digest refuses (a lone surrogate, which CPython cannot encode either) is named by
/// its index, on validate and on create, and nothing is written.
#[tokio::test]
async fn a_row_the_digest_refuses_is_named_by_its_index() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let rows = r#"[{"a": 1}, {"b": 2}, {"c": "\ud800"}]"#;
    let with_rows = |body: Value| {
        let text = body.to_string();
        format!("{},\"rows\":{rows}}}", &text[..text.len() - 1])
    };
    let mut create = app.create_body();
    create["output_path"] = json!(app.root.join("other/out.jsonl"));
    create.as_object_mut().expect("object").remove("rows");
    for (uri, body) in [
        (
            format!("/runs/{run_id}/validate"),
            with_rows(app.validate_body(0.3, 9000)),
        ),
        ("/runs".to_owned(), with_rows(create)),
    ] {
        let files = files_under(&app.root);
        let reply = send(
            app.state.clone(),
            Method::POST,
            &uri,
            Some(COLLECTOR),
            Some(body),
        )
        .await;
        assert_invalid_naming(&reply, "rows[2]", &uri);
        // Validate digests each row's text (rows[2]); create reads the rows as values and
        // names where the text stops being JSON (rows[2].c).
        assert!(
            reply.body["details"]["field"]
                .as_str()
                .is_some_and(|field| field.starts_with("rows[2]")),
            "{uri}: {}",
            reply.body
        );
        assert_eq!(files_under(&app.root), files, "{uri}: nothing written");
    }
}

/// A full page at the largest size still says whether another follows: 1,001 drift events come
/// back as a page of 1,000 with a cursor and a page of one, on the run's list and the global one.
#[tokio::test]
async fn a_full_page_of_a_thousand_continues_to_the_next() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let events: Vec<recovery_store::DriftEvent> = (0..1001)
        .map(|n| recovery_store::DriftEvent {
            event_id: format!("{n:032x}"),
            run_id: run_id.clone(),
            at: format!("2026-11-29T10:00:00.{n:06}Z"),
            saved_config_digest: "a".repeat(64),
            current_config_digest: "b".repeat(64),
            operational_keys: vec!["servers.a.port".into()],
        })
        .collect();
    app.state
        .registry
        .store()
        .insert_drift_events(&events)
        .await
        .expect("events");
    for list in [format!("/runs/{run_id}/drift"), "/drift".to_owned()] {
        let first = app
            .call(
                Method::GET,
                &format!("{list}?limit=1000"),
                Some(VIEWER),
                None,
            )
            .await;
        assert_eq!(first.status, StatusCode::OK, "{list}: {}", first.body);
        assert_eq!(
            first.body["events"].as_array().map(Vec::len),
            Some(1000),
            "{list}"
        );
        let cursor = first.body["next_cursor"].as_str().unwrap_or_else(|| {
            panic!(
                "{list}: a full page has a cursor: {}",
                first.body["next_cursor"]
            )
        });
        let second = app
            .call(
                Method::GET,
                &format!(
                    "{list}?limit=1000&cursor={}",
                    cursor
                        .bytes()
                        .map(|b| format!("%{b:02X}"))
                        .collect::<String>()
                ),
                Some(VIEWER),
                None,
            )
            .await;
        assert_eq!(
            second.body["events"].as_array().map(Vec::len),
            Some(1),
            "{list}: {}",
            second.body
        );
        assert!(second.body["next_cursor"].is_null(), "{list}");
    }
}

/// A recorded-order cursor is read only in the numbering it came from: in a database made
/// again (another service's here) or past the last position (a restore to an older backup) it
/// answers 410 `cursor_expired` naming `cursor`, never a page of other events.
#[tokio::test]
async fn a_follow_cursor_from_another_numbering_has_expired() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let drift = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 9000)),
        )
        .await;
    assert_eq!(drift.body["outcome"], "resume_with_drift", "{}", drift.body);
    let page = app
        .call(Method::GET, "/drift?order=recorded", Some(VIEWER), None)
        .await;
    let cursor = page.body["follow_cursor"]
        .as_str()
        .expect("cursor")
        .to_owned();
    let (prefix, position) = cursor
        .rsplit_once(':')
        .expect("recorded:<epoch>:<position>");
    assert_eq!(position, "1", "{cursor}");
    let encode = |c: &str| c.replace(':', "%3A");
    let current = app
        .call(
            Method::GET,
            &format!("/drift?order=recorded&cursor={}", encode(&cursor)),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(current.status, StatusCode::OK, "{}", current.body);
    assert_eq!(current.body["events"], json!([]));
    let other = TestApp::new().await;
    let other_run = other.create().await;
    for port in [9000, 9001] {
        other
            .call(
                Method::POST,
                &format!("/runs/{other_run}/validate"),
                Some(COLLECTOR),
                Some(other.validate_body(0.3, port)),
            )
            .await;
    }
    for (case, target, uri) in [
        (
            "another database",
            &other,
            format!("/drift?order=recorded&cursor={}", encode(&cursor)),
        ),
        (
            "past the head",
            &app,
            format!(
                "/drift?order=recorded&cursor={}",
                encode(&format!("{prefix}:2"))
            ),
        ),
    ] {
        let reply = target.call(Method::GET, &uri, Some(VIEWER), None).await;
        assert_code(&reply, StatusCode::GONE, "cursor_expired");
        assert_eq!(reply.body["details"]["field"], "cursor", "{case}");
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("cursor: ") && m.contains("without a cursor")),
            "{case}: {}",
            reply.body
        );
    }
}

/// The audit log pages newest first: following `next_cursor` two at a time walks every entry
/// once (ties in time broken by id), with a filter too, and ends without a cursor.
#[tokio::test]
async fn the_audit_log_pages_newest_first_to_its_oldest_entry() {
    let app = TestApp::new().await;
    let entries: Vec<recovery_store::AuditEntry> = (0..7u32)
        .map(|n| recovery_store::AuditEntry {
            // Ids as the service makes them (hex); ties in time follow them.
            audit_id: format!("{n:032x}"),
            // Two entries share each time.
            at: format!("2026-11-29T10:00:0{}.000000Z", n / 2),
            actor: "ops".into(),
            action: "lease.takeover".into(),
            run_id: Some(format!("r{}", n % 2)),
            details: json!({}),
        })
        .collect();
    for entry in &entries {
        app.state
            .registry
            .store()
            .insert_audit(entry)
            .await
            .expect("audit entry");
    }
    for (filter, expected) in [
        ("", vec![6, 5, 4, 3, 2, 1, 0]),
        ("&run_id=r1", vec![5, 3, 1]),
    ] {
        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        for page_number in 0.. {
            assert!(
                page_number < 10,
                "filter {filter:?}: the pages end: {seen:?}"
            );
            let uri = match &cursor {
                Some(c) => format!(
                    "/audit?actor=ops&limit=2{filter}&cursor={}",
                    c.replace(':', "%3A").replace('|', "%7C")
                ),
                None => format!("/audit?actor=ops&limit=2{filter}"),
            };
            let page = app.call(Method::GET, &uri, Some(OPERATOR), None).await;
            assert_eq!(page.status, StatusCode::OK, "{uri}: {}", page.body);
            for entry in page.body["entries"].as_array().expect("entries") {
                seen.push(entry["audit_id"].as_str().expect("id").to_owned());
            }
            match page.body["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => break,
            }
        }
        let expected: Vec<String> = expected.iter().map(|n| format!("{n:032x}")).collect();
        assert_eq!(seen, expected, "filter {filter:?}");
    }
    let garbled = app
        .call(Method::GET, "/audit?cursor=garbage", Some(OPERATOR), None)
        .await;
    assert_invalid_naming(&garbled, "cursor", "/audit?cursor=garbage");
    assert_eq!(garbled.body["details"]["field"], "cursor");
}

/// A cursor whose `+` or `:` a client did not encode (a space in its time) is refused naming
/// `cursor`, never read as another place in the history (which repeated a page without end).
#[tokio::test]
async fn a_garbled_cursor_is_refused() {
    let app = TestApp::new().await;
    for cursor in [
        "drift%7C2026-11-29T10:00:00.000000Z%7Cabc",
        "drift%7C2026-11-29T10%3A00%3A00.000000Z%7Cabc",
    ] {
        let reply = app
            .call(
                Method::GET,
                &format!("/drift?cursor={cursor}"),
                Some(VIEWER),
                None,
            )
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{cursor}: {}", reply.body);
    }
    for cursor in [
        "drift%7C2026-11-29T10:00:00 00:00%7Cabc",
        "drift%7C2026-11-29T10:00:00+00:00%7Cabc",
        "drift%7Cx%7Cy",
        "x%7Cy",
        "garbage",
        // Without the list's name (another list's, or one from before cursors carried it).
        "2026-11-29T10:00:00.000000Z%7Cabc",
        "audit%7C2026-11-29T10:00:00.000000Z%7Cabc",
    ] {
        let uri = format!(
            "/drift?cursor={}",
            cursor.replace(' ', "%20").replace('+', "%2B")
        );
        let reply = app.call(Method::GET, &uri, Some(VIEWER), None).await;
        assert_invalid_naming(&reply, "cursor", &uri);
        assert_eq!(reply.body["details"]["field"], "cursor", "{uri}");
    }
}

/// A cursor one list handed out is refused by every other list naming `cursor`, never read as
/// a place in it (hostile review 53, F7: `/audit` answered an empty page for a drift cursor and
/// `/runs` a page from somewhere for an audit one); each list takes its own.
#[tokio::test]
async fn a_cursor_of_one_list_is_refused_by_the_others() {
    let app = TestApp::new().await;
    let mut run_id = String::new();
    for port in 0..3 {
        let mut body = app.create_body();
        body["output_path"] = json!(app.root.join(format!("e{port}/out.jsonl")));
        let created = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
        run_id = created.body["run_id"].as_str().expect("id").to_owned();
        for second in 0..2 {
            let drifted = app
                .call(
                    Method::POST,
                    &format!("/runs/{run_id}/validate"),
                    Some(COLLECTOR),
                    Some(app.validate_body(0.3, 9000 + 2 * port + second)),
                )
                .await;
            assert_eq!(drifted.status, StatusCode::OK, "{}", drifted.body);
        }
    }
    let lists = [
        "/runs?limit=1".to_owned(),
        "/drift?limit=1".to_owned(),
        "/audit?limit=1".to_owned(),
        format!("/runs/{run_id}/validations?limit=1"),
    ];
    let mut cursors = Vec::new();
    for list in &lists {
        let page = app.call(Method::GET, list, Some(OPERATOR), None).await;
        let cursor = page.body["next_cursor"].as_str().unwrap_or_default();
        assert!(!cursor.is_empty(), "{list}: {}", page.body);
        cursors.push(cursor.to_owned());
    }
    for (i, list) in lists.iter().enumerate() {
        for (j, cursor) in cursors.iter().enumerate() {
            let encoded = cursor
                .replace(':', "%3A")
                .replace('|', "%7C")
                .replace('+', "%2B");
            let uri = format!("{list}&cursor={encoded}");
            let reply = app.call(Method::GET, &uri, Some(OPERATOR), None).await;
            if i == j {
                assert_eq!(reply.status, StatusCode::OK, "{uri}: {}", reply.body);
            } else {
                assert_invalid_naming(&reply, "cursor", &uri);
            }
        }
    }
}

/// Asking who holds a run never creates its lock file, nor its directory once removed: a read
/// leaves the files as they are.
#[tokio::test]
async fn asking_who_holds_a_run_creates_nothing() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let run_dir = app.root.join("exp");
    let lock = run_dir.join("out_run.lock");
    for (case, remove) in [
        ("the lock file removed", false),
        ("the run directory removed", true),
    ] {
        if remove {
            std::fs::remove_dir_all(&run_dir).expect("remove the run directory");
        } else if lock.exists() {
            std::fs::remove_file(&lock).expect("remove the lock file");
        }
        let reply = app
            .call(
                Method::GET,
                &format!("/runs/{run_id}/lease"),
                Some(VIEWER),
                None,
            )
            .await;
        if reply.status == StatusCode::OK {
            assert_eq!(reply.body["locked_outside_service"], false, "{case}");
        }
        assert!(
            !lock.exists(),
            "{case}: no lock file was created ({})",
            reply.body
        );
        assert_eq!(run_dir.exists(), !remove, "{case}: no directory was made");
    }
}

#[tokio::test]
async fn every_list_refuses_a_limit_outside_one_to_a_thousand() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    for list in ["/runs", "/drift", &format!("/runs/{run_id}/drift")] {
        for limit in ["0", "1001", "5000"] {
            let reply = app
                .call(
                    Method::GET,
                    &format!("{list}?limit={limit}"),
                    Some(VIEWER),
                    None,
                )
                .await;
            assert_invalid_naming(&reply, "limit", &format!("{list}?limit={limit}"));
        }
        let full = app
            .call(
                Method::GET,
                &format!("{list}?limit=1000"),
                Some(VIEWER),
                None,
            )
            .await;
        assert_eq!(full.status, StatusCode::OK, "{list}: {}", full.body);
    }
}

#[tokio::test]
async fn an_output_name_too_long_for_its_companions_is_path_refused_before_anything_is_written() {
    let app = TestApp::new().await;
    for stem_len in [170, 240, 252] {
        let mut body = app.create_body();
        let dir = app.root.join(format!("long-{stem_len}"));
        body["output_path"] = json!(dir.join(format!("{}.jsonl", "r".repeat(stem_len))));
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_eq!(
            (reply.status, reply.body["code"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some("path_refused")),
            "{stem_len}: {}",
            reply.body
        );
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| m.contains("at most 165 bytes")),
            "the message says how long a name may be: {}",
            reply.body
        );
        assert!(
            !dir.exists() || files_under(&dir).is_empty(),
            "{stem_len}: nothing written: {:?}",
            files_under(&dir)
        );
    }
    let mut body = app.create_body();
    body["output_path"] = json!(app.root.join(format!("ok/{}.jsonl", "r".repeat(165))));
    let longest = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(longest.status, StatusCode::CREATED, "{}", longest.body);
}

#[tokio::test]
async fn a_lock_file_that_cannot_be_a_file_is_refused_as_a_path_never_run_locked() {
    let app = TestApp::new().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    // A directory where the run's lock file belongs: no process holds it, so a client
    // retrying a 423 would wait forever.
    std::fs::create_dir_all(&paths.run_lock).expect("directory");
    let reply = app
        .call(
            Method::POST,
            "/runs",
            Some(COLLECTOR),
            Some(app.create_body()),
        )
        .await;
    assert_code(&reply, StatusCode::UNPROCESSABLE_ENTITY, "path_refused");
    assert!(!paths.manifest.exists(), "nothing written");
    // A run whose lock file became a link, FIFO or directory later: asking who holds it says
    // so, never that another process does.
    std::fs::remove_dir(&paths.run_lock).expect("remove");
    let run_id = app.create().await;
    let elsewhere = app.root.join("elsewhere.lock");
    std::fs::write(&elsewhere, b"").expect("target");
    for kind in ["directory", "link", "fifo", "socket"] {
        std::fs::remove_file(&paths.run_lock)
            .or_else(|_| std::fs::remove_dir(&paths.run_lock))
            .expect("remove the lock file");
        match kind {
            "directory" => std::fs::create_dir(&paths.run_lock).expect("directory"),
            "link" => std::os::unix::fs::symlink(&elsewhere, &paths.run_lock).expect("link"),
            "socket" => {
                drop(std::os::unix::net::UnixListener::bind(&paths.run_lock).expect("socket"))
            }
            _ => assert!(
                std::process::Command::new("mkfifo")
                    .arg(&paths.run_lock)
                    .status()
                    .expect("mkfifo")
                    .success()
            ),
        }
        let holder = app
            .call(
                Method::GET,
                &format!("/runs/{run_id}/lease"),
                Some(VIEWER),
                None,
            )
            .await;
        assert_code(&holder, StatusCode::UNPROCESSABLE_ENTITY, "path_refused");
    }
}

/// A lease, or a takeover, of a run whose directory was moved away is refused `no_manifest`
/// and makes nothing: no directory, no lock file (hostile review 45: the acquire answered 201
/// and made the directory again, so the run moved back with `mv` landed inside it). Moved
/// back, the run is leased as before.
#[tokio::test]
async fn a_lease_of_a_run_whose_directory_was_moved_away_makes_nothing() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let dir = app.output().parent().expect("dir").to_owned();
    let aside = app.root.join("moved-away");
    std::fs::rename(&dir, &aside).expect("move the run away");
    let acquire = json!({"holder": "c2", "host": "h", "pid": 1});
    let takeover = json!({"holder": "c2", "host": "h", "pid": 1, "reason": "moved"});
    for (uri, token, body) in [
        (format!("/runs/{run_id}/lease"), COLLECTOR, acquire.clone()),
        (format!("/runs/{run_id}/lease/takeover"), OPERATOR, takeover),
        (
            format!("/runs/{run_id}/validate"),
            COLLECTOR,
            app.validate_body(0.3, 8000),
        ),
        (
            format!("/runs/{run_id}/approvals"),
            OPERATOR,
            json!({"task_index": 0, "rollout_index": 0, "attempt_index": 0, "reason": "r"}),
        ),
        (
            format!("/runs/{run_id}/attempts/extend"),
            OPERATOR,
            json!({"extend_attempts": 1, "reason": "r"}),
        ),
    ] {
        let reply = app.call(Method::POST, &uri, Some(token), Some(body)).await;
        assert_eq!(reply.status.as_u16() / 100, 4, "{uri}: {}", reply.body);
        assert!(
            !dir.exists(),
            "{uri}: the run's directory is not made again ({})",
            reply.body
        );
    }
    std::fs::rename(&aside, &dir).expect("move the run back");
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(acquire),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    assert!(
        app.output()
            .parent()
            .expect("dir")
            .join("out_manifest.json")
            .is_file()
    );
}

/// An output that is another name (a hard link) of another run's output is refused before
/// anything is written: the two runs would append to one file.
#[tokio::test]
async fn an_output_hard_linked_to_another_runs_output_is_refused() {
    let app = TestApp::new().await;
    app.create().await;
    let second = app.root.join("other/out.jsonl");
    std::fs::create_dir_all(second.parent().expect("dir")).expect("dir");
    std::fs::hard_link(app.output(), &second).expect("hard link");
    let mut body = app.create_body();
    body["output_path"] = json!(second);
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_code(&reply, StatusCode::UNPROCESSABLE_ENTITY, "path_refused");
    assert!(
        reply.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("hard links")),
        "{}",
        reply.body
    );
    assert!(
        !app.root.join("other/out_manifest.json").exists(),
        "nothing written"
    );
}

#[tokio::test]
async fn json_nests_512_levels_on_every_endpoint_and_no_deeper() {
    let app = TestApp::new().await;
    // The body object is level 1 and `config` level 2: 510 arrays inside reach 512.
    let create = |arrays: usize| {
        let mut body = app.create_body();
        body["config"]["deep"] = json!("PLACEHOLDER");
        body.to_string().replace("\"PLACEHOLDER\"", &nested(arrays))
    };
    let deepest = app
        .call_raw(Method::POST, "/runs", Some(COLLECTOR), Some(create(510)))
        .await;
    assert_eq!(deepest.status, StatusCode::CREATED, "{}", deepest.body);
    let run_id = deepest.body["run_id"].as_str().expect("run").to_owned();
    let too_deep = app
        .call_raw(Method::POST, "/runs", Some(OPERATOR), Some(create(511)))
        .await;
    assert_invalid_naming(&too_deep, "512", "create at 513");
    for (uri, token, body) in [
        (
            "/classify".to_owned(),
            VIEWER,
            format!("{{\"rows\": [{{\"x\": {}}}]}}", nested(511)),
        ),
        (
            format!("/runs/{run_id}/lease"),
            COLLECTOR,
            format!("{{\"holder\": {}}}", nested(512)),
        ),
    ] {
        let reply = app
            .call_raw(Method::POST, &uri, Some(token), Some(body))
            .await;
        assert_invalid_naming(&reply, "512", &uri);
    }
    // Validate reads its configuration and rows as raw texts, each bounded where it is parsed.
    let validate = |field: &str, arrays: usize| {
        let mut body = app.validate_body(0.3, 8000);
        match field {
            "rows" => body["rows"] = json!([{"x": "PLACEHOLDER"}]),
            _ => body[field]["deep"] = json!("PLACEHOLDER"),
        }
        body.to_string().replace("\"PLACEHOLDER\"", &nested(arrays))
    };
    let uri = format!("/runs/{run_id}/validate");
    for (field, deepest_arrays) in [("config", 510), ("global_config", 510), ("rows", 509)] {
        let deepest = app
            .call_raw(
                Method::POST,
                &uri,
                Some(COLLECTOR),
                Some(validate(field, deepest_arrays)),
            )
            .await;
        assert_ne!(
            deepest.body["code"], "invalid_request",
            "{field} at 512 levels is read: {}",
            deepest.body
        );
        let too_deep = app
            .call_raw(
                Method::POST,
                &uri,
                Some(COLLECTOR),
                Some(validate(field, deepest_arrays + 1)),
            )
            .await;
        assert_invalid_naming(&too_deep, "512", &format!("validate, {field} at 513"));
        assert!(
            too_deep.body["message"]
                .as_str()
                .is_some_and(|m| m.contains(field)),
            "the message names {field}: {}",
            too_deep.body
        );
    }
    let mut flat_only = app.validate_body(0.3, 8000);
    flat_only["environment"]["DEEP"] = json!("PLACEHOLDER");
    let flat_only = flat_only
        .to_string()
        .replace("\"PLACEHOLDER\"", &nested(100_000));
    let reply = app
        .call_raw(Method::POST, &uri, Some(COLLECTOR), Some(flat_only))
        .await;
    assert_invalid_naming(
        &reply,
        "environment",
        "validate, a nested environment value",
    );
    let classified = app
        .call_raw(
            Method::POST,
            "/classify",
            Some(VIEWER),
            Some(format!("{{\"rows\": [{{\"x\": {}}}]}}", nested(509))),
        )
        .await;
    assert_eq!(classified.status, StatusCode::OK, "{}", classified.body);
}

#[tokio::test]
async fn free_text_fields_and_ids_longer_than_their_limit_are_refused_naming_the_field() {
    let app = TestApp::new().await;
    let (run_id, lease) = run_with_masked_answer(&app).await;
    let huge = "x".repeat(1 << 20);
    let cases = [
        (
            "/approvals",
            OPERATOR,
            json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "r".repeat(4097)}),
            "reason",
        ),
        (
            "/attempts/extend",
            OPERATOR,
            json!({"extend_attempts": 1, "reason": huge}),
            "reason",
        ),
        (
            "/lease/heartbeat",
            COLLECTOR,
            json!({"lease_id": huge}),
            "lease_id",
        ),
        (
            "/lease/takeover",
            OPERATOR,
            json!({"holder": "h".repeat(257), "host": "n", "pid": 1, "reason": "r"}),
            "holder",
        ),
        (
            "/attempts/reserve",
            COLLECTOR,
            json!({"lease_id": lease, "rollout_ids": ["0-0", "9".repeat(300)]}),
            "rollout_ids: [1]",
        ),
        (
            "/validate",
            COLLECTOR,
            json!({"config": {}, "global_config": {}, "source_path": "p".repeat(5000)}),
            "source_path",
        ),
    ];
    for (route, token, body, field) in cases {
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}{route}"),
                Some(token),
                Some(body),
            )
            .await;
        assert_invalid_naming(&reply, field, route);
    }
    // Nothing of the refused calls reached the run: no approval, no extension, the lease held.
    let approvals = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/approvals"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(approvals.body, json!([]), "{}", approvals.body);
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    assert!(!paths.attempt_extension.exists());
    let holder = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/lease"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(
        holder.body["holder"]["holder"], "collector-a",
        "{}",
        holder.body
    );
}

#[tokio::test]
async fn request_heads_over_the_limits_answer_in_the_error_shape() {
    let app = TestApp::new().await;
    let long_target = format!("/runs?output_path={}", "a".repeat(9000));
    let auth = ("authorization", format!("Bearer {VIEWER}"));
    let reply = send_headers(&app, &long_target, std::slice::from_ref(&auth)).await;
    assert_eq!(
        (reply.status, reply.body["code"].as_str()),
        (StatusCode::URI_TOO_LONG, Some("uri_too_long"))
    );
    let big_header = ("x-padding", "p".repeat(70_000));
    let reply = send_headers(&app, "/runs", &[auth.clone(), big_header]).await;
    assert_eq!(
        (reply.status, reply.body["code"].as_str()),
        (
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Some("headers_too_large")
        )
    );
    // RFC 7235: the scheme is case-insensitive.
    for scheme in ["bearer", "BEARER", "Bearer"] {
        let reply = send_headers(
            &app,
            "/runs",
            &[("authorization", format!("{scheme} {VIEWER}"))],
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{scheme}: {}", reply.body);
    }
}

#[tokio::test]
async fn framework_answers_come_out_in_the_error_shape() {
    let timeout = axum::response::IntoResponse::into_response((
        StatusCode::REQUEST_TIMEOUT,
        "plain text from the timeout layer",
    ));
    let shaped = recovery_server::error::in_error_shape(timeout).await;
    let bytes = axum::body::to_bytes(shaped.into_body(), usize::MAX)
        .await
        .expect("body");
    let body: Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(body["code"], "request_timeout");
    let app = TestApp::new().await;
    let wrong_method = app.call(Method::PUT, "/runs", Some(VIEWER), None).await;
    assert_eq!(
        (wrong_method.status, wrong_method.body["code"].as_str()),
        (StatusCode::METHOD_NOT_ALLOWED, Some("method_not_allowed"))
    );
    for undecodable in ["/runs/%ff", "/runs/%ff/plan"] {
        let reply = app.call(Method::GET, undecodable, Some(VIEWER), None).await;
        assert_invalid_naming(&reply, "run_id", undecodable);
    }
    let forbidden = app.call(Method::POST, "/reindex", Some(VIEWER), None).await;
    assert_eq!(
        forbidden.body["message"], "this needs the operator role; dashboard is a viewer",
        "role names, never debug text"
    );
}

/// Every file under `dir` (the database, its log, the sidecars) that holds `needle`.
fn files_holding(dir: &std::path::Path, needle: &[u8]) -> Vec<std::path::PathBuf> {
    files_under(dir)
        .into_iter()
        .filter(|path| {
            std::fs::read(path)
                .expect("file")
                .windows(needle.len())
                .any(|w| w == needle)
        })
        .collect()
}

#[tokio::test]
async fn a_granted_lease_id_is_told_to_its_holder_only_and_kept_nowhere() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let granted = app.lease(&run_id, "collector-a").await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.body);
    let lease_id = granted.body["lease_id"].as_str().expect("id").to_owned();
    // The holder works under it: a heartbeat (answered with its own id), a validate.
    let renewed = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease/heartbeat"),
            Some(COLLECTOR),
            Some(json!({"lease_id": lease_id})),
        )
        .await;
    assert_eq!(
        renewed.body["lease_id"],
        lease_id.as_str(),
        "{}",
        renewed.body
    );
    let mut body = app.validate_body(0.3, 8000);
    body["lease_id"] = json!(lease_id);
    let validated = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(body),
        )
        .await;
    assert_eq!(validated.status, StatusCode::OK, "{}", validated.body);
    // Nobody else is told it, and no file keeps it (the SQLite file and its log included).
    let viewed = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/lease"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(viewed.status, StatusCode::OK, "{}", viewed.body);
    assert!(
        !viewed.body.to_string().contains(&lease_id),
        "{}",
        viewed.body
    );
    assert_eq!(
        files_holding(app._dir.path(), lease_id.as_bytes()),
        Vec::<std::path::PathBuf>::new()
    );
}

#[tokio::test]
async fn a_holder_whose_run_was_taken_over_is_told_its_lease_ended_on_every_call() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let old = app.lease(&run_id, "collector-a").await.body["lease_id"].clone();
    let taken = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease/takeover"),
            Some(OPERATOR),
            Some(json!({"holder": "collector-b", "host": "h", "pid": 1, "reason": "hung"})),
        )
        .await;
    assert_eq!(taken.status, StatusCode::CREATED, "{}", taken.body);
    let mut validate = app.validate_body(0.3, 8000);
    validate["lease_id"] = old.clone();
    let calls = [
        (Method::POST, "/validate", validate),
        (
            Method::POST,
            "/attempts/reserve",
            json!({"lease_id": old, "rollout_ids": ["0-0"]}),
        ),
        (Method::POST, "/lease/heartbeat", json!({"lease_id": old})),
        (Method::DELETE, "/lease", json!({"lease_id": old})),
    ];
    for (method, route, body) in calls {
        let reply = app
            .call(
                method,
                &format!("/runs/{run_id}{route}"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        assert_eq!(
            (
                reply.status,
                &reply.body["code"],
                &reply.body["details"]["field"]
            ),
            (
                StatusCode::CONFLICT,
                &json!("lease_not_held"),
                &json!("lease_id")
            ),
            "{route}: {}",
            reply.body
        );
    }
    // Without a lease, the caller is told who holds the run; a run that does not exist is not
    // found, whatever lease is presented.
    let unleased = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8000)),
        )
        .await;
    assert_eq!(unleased.status, StatusCode::LOCKED, "{}", unleased.body);
    for (method, route) in [
        (Method::POST, "/lease/heartbeat"),
        (Method::DELETE, "/lease"),
    ] {
        let reply = app
            .call(
                method,
                &format!("/runs/nosuchrun{route}"),
                Some(COLLECTOR),
                Some(json!({"lease_id": old})),
            )
            .await;
        assert_eq!(
            reply.status,
            StatusCode::NOT_FOUND,
            "{route}: {}",
            reply.body
        );
    }
}

#[tokio::test]
async fn a_refused_lease_id_is_never_echoed_and_a_full_last_page_has_no_cursor() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let guessed = "0123456789abcdef0123456789abcdef";
    for (method, route) in [
        (Method::POST, "/lease/heartbeat"),
        (Method::DELETE, "/lease"),
    ] {
        let reply = app
            .call(
                method,
                &format!("/runs/{run_id}{route}"),
                Some(COLLECTOR),
                Some(json!({"lease_id": guessed})),
            )
            .await;
        assert_eq!(
            reply.body["code"], "lease_not_held",
            "{route}: {}",
            reply.body
        );
        assert!(
            !reply.body.to_string().contains(guessed),
            "{route}: the lease id is the holder's secret: {}",
            reply.body
        );
    }
    // Exactly one run and one drift event: a page of one is the last page.
    app.call(
        Method::POST,
        &format!("/runs/{run_id}/validate"),
        Some(COLLECTOR),
        Some(app.validate_body(0.3, 9000)),
    )
    .await;
    for list in ["/runs?limit=1", "/drift?limit=1"] {
        let page = app.call(Method::GET, list, Some(VIEWER), None).await;
        let items = page.body.as_object().and_then(|o| {
            o.get("runs")
                .or_else(|| o.get("events"))
                .and_then(Value::as_array)
        });
        assert_eq!(items.map(Vec::len), Some(1), "{list}: {}", page.body);
        assert_eq!(
            page.body["next_cursor"],
            Value::Null,
            "{list}: {}",
            page.body
        );
    }
}

#[tokio::test]
async fn outputs_named_like_temporaries_or_too_long_for_their_companions_are_refused_before_any_write()
 {
    let app = TestApp::new().await;
    let deep = format!("deep/{}x.jsonl", "d/".repeat(2000));
    for output in [
        "exp/.victim.jsonl.0123456789abcdef0123456789abcdef.tmp".to_owned(),
        deep,
    ] {
        let mut body = app.create_body();
        body["output_path"] = json!(output);
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_code(&reply, StatusCode::UNPROCESSABLE_ENTITY, "path_refused");
    }
    assert!(!app.root.join("deep").exists(), "no directory was made");
    assert!(!app.root.join("exp").exists(), "nothing was written");
}

#[tokio::test]
async fn start_up_removes_only_a_runs_own_stale_temporaries_and_none_a_writer_holds() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let dir = app.output().parent().expect("dir").to_owned();
    let id = "0123456789abcdef0123456789abcdef";
    let companion = dir.join(format!(".out_manifest.json.{id}.tmp"));
    let users = dir.join(format!(".notes.txt.{id}.tmp"));
    let lonely_dir = app.root.join("lonely");
    std::fs::create_dir_all(&lonely_dir).expect("dir");
    let lonely = lonely_dir.join(format!(".thesis_failures.jsonl.{id}.tmp"));
    for file in [&companion, &users, &lonely] {
        std::fs::write(file, b"partial").expect("temporary");
    }
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(1);
    // A writer (the Python collector's lock, here another open file description) holds the run.
    let held = std::fs::File::options()
        .read(true)
        .write(true)
        .open(recovery_sidecar::SidecarPaths::for_output(&app.output()).run_lock)
        .expect("lock file");
    rustix::fs::flock(&held, rustix::fs::FlockOperation::NonBlockingLockExclusive).expect("flock");
    let removed = app
        .state
        .registry
        .remove_stale_temporaries(later)
        .await
        .expect("sweep");
    assert!(
        removed.is_empty(),
        "a held run's write in flight is left alone"
    );
    drop(held);
    let removed = app
        .state
        .registry
        .remove_stale_temporaries(later)
        .await
        .expect("sweep");
    assert_eq!(
        removed,
        std::slice::from_ref(&companion),
        "the removed file is named"
    );
    assert!(!companion.exists(), "the run's own temporary is removed");
    assert!(
        users.exists(),
        "a user's file that looks like a temporary is kept"
    );
    assert!(
        lonely.exists(),
        "a companion's name without a run (no run lock) is kept"
    );
    assert!(
        !lonely_dir.join("thesis_run.lock").exists(),
        "and no lock is made for it"
    );
    let run = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/plan"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(run.status, StatusCode::OK, "{}", run.body);
}

#[tokio::test]
async fn replacing_a_run_a_collector_holds_is_refused_naming_the_holder() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    assert_eq!(
        app.lease(&run_id, "collector-a").await.status,
        StatusCode::CREATED
    );
    let mut body = app.create_body();
    body["replace"] = json!(true);
    let reply = app
        .call(Method::POST, "/runs", Some(OPERATOR), Some(body))
        .await;
    assert_code(&reply, StatusCode::LOCKED, "run_locked");
    assert_eq!(reply.body["details"]["holder"]["holder"], "collector-a");
    let still = app
        .call(Method::GET, &format!("/runs/{run_id}"), Some(VIEWER), None)
        .await;
    assert_eq!(
        still.status,
        StatusCode::OK,
        "the run stands: {}",
        still.body
    );
}

/// Drift lines a Python collector journalled for a run that no reindex read yet stay in its
/// history when an operator replaces the run: the replacement reads them before it sets the
/// journals aside, since nothing reads a `*.replaced-*` journal (hostile review 52, F6).
#[tokio::test]
async fn a_replaced_runs_journal_lines_no_reindex_read_stay_in_its_history() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let manifest = super::concurrency::saved_manifest(&app);
    let journal = recovery_sidecar::SidecarPaths::for_output(&app.output()).resume_drift;
    for second in 0..3 {
        let line = json!({
            "at": format!("2026-11-29T10:00:0{second}.000000Z"),
            "run_id": run_id,
            "saved_config_digest": manifest.config_digest,
            "current_config_digest": format!("{second:064x}"),
            "operational_keys": ["servers.a.port"],
        });
        recovery_sidecar::append_line(&journal, line.to_string().as_bytes()).expect("append");
    }
    replace_run(&app).await;
    let history = app
        .call(
            Method::GET,
            &format!("/drift?run_id={run_id}"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(history.status, StatusCode::OK, "{}", history.body);
    assert_eq!(
        history.body["events"].as_array().map(Vec::len),
        Some(3),
        "{}",
        history.body
    );
    // The replaced run's own route answers the same history (hostile review 52, F7).
    let own = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/drift"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(own.status, StatusCode::OK, "{}", own.body);
    assert_eq!(own.body["events"], history.body["events"]);
}

/// Replaces the app's run as an operator; the new run's id.
async fn replace_run(app: &TestApp) -> String {
    let mut body = app.create_body();
    body["replace"] = json!(true);
    let replaced = app
        .call(Method::POST, "/runs", Some(OPERATOR), Some(body))
        .await;
    assert_eq!(replaced.status, StatusCode::CREATED, "{}", replaced.body);
    replaced.body["run_id"].as_str().expect("id").to_owned()
}

/// The app's configuration with a new, empty data directory (a database rebuilt from the files
/// under the same roots), and that directory.
fn on_a_new_database(app: &TestApp) -> (tempfile::TempDir, ServerConfig) {
    let fresh = tempfile::tempdir().expect("dir");
    let mut config = app.config.clone();
    config.data_dir = fresh.path().join("data");
    (fresh, config)
}

/// A database rebuilt from the files keeps the runs an operator replaced, each superseded by
/// the run that replaced it, with the drift history of its set-aside journal and the same event
/// ids (hostile review 52, F2: a rebuild read only the manifests in place, so replaced runs and
/// their history were gone). Two replacements in one second (suffixes `-<s>` and `-<s>-2`)
/// keep their order.
#[tokio::test]
async fn a_database_rebuilt_from_the_files_keeps_replaced_runs_and_their_drift_history() {
    let app = TestApp::new().await;
    let first = app.create().await;
    let manifest = super::concurrency::saved_manifest(&app);
    let journal = recovery_sidecar::SidecarPaths::for_output(&app.output()).resume_drift;
    for second in 0..3 {
        let line = json!({
            "at": format!("2026-11-29T10:00:0{second}.000000Z"),
            "run_id": first,
            "saved_config_digest": manifest.config_digest,
            "current_config_digest": format!("{second:064x}"),
            "operational_keys": ["servers.a.port"],
        });
        recovery_sidecar::append_line(&journal, line.to_string().as_bytes()).expect("append");
    }
    let mut runs = vec![first];
    for _ in 0..2 {
        runs.push(replace_run(&app).await);
    }
    let history = |state| {
        let uri = format!("/drift?run_id={}", runs[0]);
        async move { send(state, Method::GET, &uri, Some(VIEWER), None).await }
    };
    let before = history(app.state.clone()).await;
    assert_eq!(before.body["events"].as_array().map(Vec::len), Some(3));

    let (_fresh, config) = on_a_new_database(&app);
    let rebuilt = recovery_server::start(config, app.clock.clone())
        .await
        .expect("a service on a new database");
    let after = history(rebuilt.clone()).await;
    assert_eq!(after.status, StatusCode::OK, "{}", after.body);
    assert_eq!(after.body["events"], before.body["events"]);
    for (run, successor) in [(&runs[0], &runs[1]), (&runs[1], &runs[2])] {
        let record = rebuilt
            .registry
            .store()
            .get_run(run)
            .await
            .expect("store")
            .expect("the replaced run is recorded");
        assert_eq!(record.superseded_by.as_ref(), Some(successor), "{run}");
        assert_eq!(record.output_path, app.output().display().to_string());
    }
    let validate = send(
        rebuilt.clone(),
        Method::POST,
        &format!("/runs/{}/validate", runs[0]),
        Some(COLLECTOR),
        Some(app.validate_body(0.3, 8000).to_string()),
    )
    .await;
    assert_eq!(validate.body["code"], "run_superseded", "{}", validate.body);
    let live = send(
        rebuilt.clone(),
        Method::POST,
        &format!("/runs/{}/validate", runs[2]),
        Some(COLLECTOR),
        Some(app.validate_body(0.3, 8000).to_string()),
    )
    .await;
    assert_eq!(live.status, StatusCode::OK, "{}", live.body);
    // Reindexing again finds nothing new.
    let again = send(rebuilt, Method::POST, "/reindex", Some(OPERATOR), None).await;
    assert_eq!(again.body["runs"], 0, "{}", again.body);
    assert_eq!(again.body["drift_inserted"], 0, "{}", again.body);

    // Four reindexes racing over another new database record each replaced run and line once.
    let (_raced, config) = on_a_new_database(&app);
    let opened = recovery_server::open(config, app.clock.clone())
        .await
        .expect("a service on another new database");
    let registry = &opened.registry;
    let (a, b, c, d) = tokio::join!(
        registry.reindex(),
        registry.reindex(),
        registry.reindex(),
        registry.reindex()
    );
    let (mut runs_recorded, mut lines) = (0, 0);
    for report in [a, b, c, d] {
        let report = report.expect("reindex");
        runs_recorded += report.runs;
        lines += report.drift_inserted;
    }
    assert_eq!((runs_recorded, lines), (3, 3), "each run and line once");
    recovery_server::catch_up(&opened).await.expect("ready");
    let after = history(opened.clone()).await;
    assert_eq!(after.body["events"], before.body["events"]);
}

/// A replaced run whose set-aside manifest could not be read during a rebuild, restored later,
/// finds its place in the chain taken (the run before it is recorded as replaced by its
/// successor): a reindex reports it and indexes none of its drift, never events of a run the
/// database does not have (hostile review 54, N2: `/drift?run_id=` listed them while
/// `/runs/{id}` answered 404).
#[tokio::test]
async fn a_set_aside_run_restored_after_a_rebuild_leaves_no_drift_without_its_run() {
    let app = TestApp::new().await;
    let mut runs = vec![app.create().await];
    for _ in 0..2 {
        runs.push(replace_run(&app).await);
    }
    // The middle run's set-aside manifest, and a drift line in its set-aside journal.
    let directory = app.output().parent().expect("dir").to_owned();
    let mut set_aside: Vec<PathBuf> = std::fs::read_dir(&directory)
        .expect("dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().is_some_and(|n| {
                n.to_string_lossy()
                    .starts_with("out_manifest.json.replaced-")
            })
        })
        .collect();
    set_aside.sort();
    let middle = set_aside
        .iter()
        .find(|p| std::fs::read_to_string(p).is_ok_and(|t| t.contains(&runs[1])))
        .expect("the middle run's set-aside manifest")
        .clone();
    let suffix = middle
        .to_string_lossy()
        .rsplit_once("out_manifest.json")
        .expect("suffix")
        .1
        .to_owned();
    let journal = PathBuf::from(format!(
        "{}{suffix}",
        recovery_sidecar::SidecarPaths::for_output(&app.output())
            .resume_drift
            .display()
    ));
    let line = json!({"at": "2026-11-29T10:00:00.000000Z", "run_id": runs[1],
        "saved_config_digest": "c", "current_config_digest": "d", "operational_keys": ["a.port"]});
    recovery_sidecar::append_line(&journal, line.to_string().as_bytes()).expect("append");
    let good = std::fs::read(&middle).expect("manifest");
    std::fs::write(&middle, b"{ not a manifest").expect("corrupt");

    let (_fresh, config) = on_a_new_database(&app);
    let rebuilt = recovery_server::start(config, app.clock.clone())
        .await
        .expect("a service on a new database");
    std::fs::write(&middle, good).expect("restore");
    let report = send(
        rebuilt.clone(),
        Method::POST,
        "/reindex",
        Some(OPERATOR),
        None,
    )
    .await;
    assert_eq!(report.status, StatusCode::OK, "{}", report.body);
    assert_eq!(report.body["drift_inserted"], 0, "{}", report.body);
    let reported = report.body["unreadable"].to_string();
    assert!(reported.contains(&runs[1]), "{reported}");
    let drift = send(
        rebuilt.clone(),
        Method::GET,
        &format!("/drift?run_id={}", runs[1]),
        Some(VIEWER),
        None,
    )
    .await;
    assert_eq!(drift.body["events"], json!([]), "{}", drift.body);
}

#[tokio::test]
async fn settings_that_refuse_everything_or_confuse_callers_stop_the_start() {
    for (what, adjust) in [
        (
            "same token twice",
            (|c: &mut ServerConfig| {
                c.tokens
                    .push(TokenEntry::parse(&format!("viewer:other:{OPERATOR}")).expect("token"));
            }) as fn(&mut ServerConfig),
        ),
        ("no body", |c| c.body_limit_bytes = 0),
        ("no time", |c| c.request_timeout = std::time::Duration::ZERO),
        ("the file system root", |c| {
            c.roots = vec![PathBuf::from("/")]
        }),
        ("a path to the file system root", |c| {
            c.roots = vec![PathBuf::from("/tmp/..")]
        }),
    ] {
        let dir = tempfile::tempdir().expect("dir");
        let mut config = ServerConfig::local(dir.path().join("data"));
        config.roots = vec![dir.path().join("runs")];
        config.tokens =
            vec![TokenEntry::parse(&format!("operator:alice:{OPERATOR}")).expect("token")];
        adjust(&mut config);
        let clock = Arc::new(ManualClock::new(time::OffsetDateTime::now_utc()));
        let started = recovery_server::start(config, clock).await;
        assert!(started.is_err(), "{what} is refused");
    }
}

#[tokio::test]
async fn run_ids_a_manifest_on_disk_gives_that_cannot_name_a_run_are_never_adopted() {
    let app = TestApp::new().await;
    for (n, bad) in ["", " padded ", "a/b/../c", "a\u{0}b", &"x".repeat(300)]
        .iter()
        .enumerate()
    {
        let output = app.root.join(format!("odd{n}/out.jsonl"));
        let mut body = app.create_body();
        body["output_path"] = json!(output);
        let created = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
        let paths = recovery_sidecar::SidecarPaths::for_output(&output);
        let mut manifest: Value =
            serde_json::from_slice(&std::fs::read(&paths.manifest).expect("manifest"))
                .expect("json");
        manifest["run_id"] = json!(bad);
        std::fs::write(&paths.manifest, manifest.to_string()).expect("edit");
        let found = app
            .call(
                Method::GET,
                &format!("/runs?output_path={}", output.display()),
                Some(VIEWER),
                None,
            )
            .await;
        let ids: Vec<&str> = found.body["runs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["run_id"].as_str())
            .collect();
        assert!(!ids.contains(bad), "{bad:?} adopted: {}", found.body);
    }
    let reindexed = app
        .call(Method::POST, "/reindex", Some(OPERATOR), None)
        .await;
    assert_eq!(
        reindexed.body["unreadable"].as_array().map(Vec::len),
        Some(5),
        "{}",
        reindexed.body
    );
}

#[tokio::test]
async fn long_components_and_companions_that_are_directories_are_refused_before_any_write() {
    let app = TestApp::new().await;
    let long = "d".repeat(300);
    let blocked = app.root.join("p9");
    std::fs::create_dir_all(blocked.join("t_manifest_identity.json")).expect("a directory");
    for (output, written) in [
        (
            app.root.join(format!("p5/{long}/o.jsonl")),
            app.root.join("p5"),
        ),
        (blocked.join("t.jsonl"), blocked.join("t.jsonl")),
    ] {
        let mut body = app.create_body();
        body["output_path"] = json!(output);
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_code(&reply, StatusCode::UNPROCESSABLE_ENTITY, "path_refused");
        assert!(!written.exists(), "nothing written: {}", written.display());
    }
    let run_id = app.create().await;
    let reply = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(json!({"holder": "c", "host": "h", "pid": 1, "checkpoint_dir": format!("ck/{long}")})),
        )
        .await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.body
    );
    assert!(!app.root.join("ck").exists());
}

#[tokio::test]
async fn references_that_repeat_references_are_refused_at_a_size_no_configuration_reaches() {
    let app = TestApp::new().await;
    let mut config = config(0.3);
    config["l0"] = json!("x".repeat(16));
    for level in 1..40 {
        let previous = format!("${{_collection_identity.l{}}}", level - 1);
        config[format!("l{level}")] = json!([previous, previous]);
    }
    let mut body = app.create_body();
    body["config"] = config;
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_code(&reply, StatusCode::UNPROCESSABLE_ENTITY, "identity_error");
    assert!(
        reply.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("more than")),
        "{}",
        reply.body
    );
}

#[tokio::test]
async fn a_copy_of_a_runs_folder_is_reported_and_never_moves_the_run() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let paths = recovery_sidecar::SidecarPaths::for_output(&app.output());
    let copy = app.root.join("copy/out.jsonl");
    let copied = recovery_sidecar::SidecarPaths::for_output(&copy);
    std::fs::create_dir_all(copy.parent().expect("dir")).expect("dir");
    for (from, to) in [
        (&paths.manifest, &copied.manifest),
        (&paths.identity, &copied.identity),
        (&paths.materialized, &copied.materialized),
        (&paths.output, &copied.output),
        (&paths.failures, &copied.failures),
    ] {
        std::fs::copy(from, to).expect("copy");
    }
    let reindexed = app
        .call(Method::POST, "/reindex", Some(OPERATOR), None)
        .await;
    let unreadable = reindexed.body["unreadable"].to_string();
    assert!(unreadable.contains("a copy of run"), "{}", reindexed.body);
    let run = app
        .call(Method::GET, &format!("/runs/{run_id}"), Some(VIEWER), None)
        .await;
    assert_eq!(
        run.body["run"]["output_path"],
        json!(app.output().display().to_string()),
        "{}",
        run.body
    );
}

#[tokio::test]
async fn without_tokens_only_requests_naming_a_loopback_host_are_answered() {
    let app = TestApp::with(|config| config.tokens.clear()).await;
    let cases = [
        ("no Host header", None, true),
        ("localhost with a port", Some("localhost:8787"), true),
        ("LOCALHOST", Some("LOCALHOST"), true),
        ("127.0.0.1", Some("127.0.0.1:8787"), true),
        ("another loopback address", Some("127.1.2.3"), true),
        ("IPv6 loopback", Some("[::1]:8787"), true),
        ("a rebound name", Some("attacker.example:8787"), false),
        (
            "a rebound name without a port",
            Some("attacker.example"),
            false,
        ),
        ("a LAN address", Some("192.168.1.5:8787"), false),
        (
            "localhost as a subdomain",
            Some("localhost.attacker.example"),
            false,
        ),
    ];
    for (case, host, answered) in cases {
        for (method, uri, body) in [
            (Method::GET, "/runs", None),
            (Method::POST, "/runs", Some(app.create_body().to_string())),
            (Method::GET, "/ui/", None),
        ] {
            let mut request = Request::builder().method(method.clone()).uri(uri);
            if let Some(host) = host {
                request = request.header("host", host);
            }
            let request = match &body {
                Some(body) => request
                    .header("content-type", "application/json")
                    .body(Body::from(body.clone())),
                None => request.body(Body::empty()),
            }
            .expect("request");
            let (status, _, bytes) = respond(app.state.clone(), request).await;
            let reply = Reply::of(status, &bytes);
            if answered {
                assert_ne!(status, StatusCode::FORBIDDEN, "{case} {method} {uri}");
            } else {
                assert_eq!(status, StatusCode::FORBIDDEN, "{case} {method} {uri}");
                assert_eq!(reply.body["code"], "forbidden", "{case}");
                assert!(
                    reply.body["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("loopback")),
                    "{case}: {}",
                    reply.body
                );
            }
        }
    }
    let runs = app
        .state
        .registry
        .store()
        .list_runs(10, None)
        .await
        .expect("runs");
    assert_eq!(runs.len(), 1, "only a loopback request created the run");
    // Every Host a request names counts, and an absolute-form target's authority too (review
    // 55, F15: a second Host, or `GET http://attacker.example/runs`, was answered); and every
    // Origin of a change.
    let refused = [
        (
            "a second Host",
            "/runs",
            vec![("host", "localhost"), ("host", "attacker.example")],
        ),
        (
            "an absolute-form target",
            "http://attacker.example/runs",
            vec![("host", "localhost")],
        ),
        (
            "a second Origin",
            "/reindex",
            vec![
                ("host", "localhost"),
                ("origin", "http://localhost"),
                ("origin", "https://attacker.example"),
            ],
        ),
    ];
    for (case, uri, headers) in refused {
        let method = if uri == "/reindex" {
            Method::POST
        } else {
            Method::GET
        };
        let mut request = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let (status, _, bytes) = respond(
            app.state.clone(),
            request.body(Body::empty()).expect("request"),
        )
        .await;
        let reply = Reply::of(status, &bytes);
        assert_eq!(status, StatusCode::FORBIDDEN, "{case}: {}", reply.body);
    }
}

/// Without tokens, a change sent by a web page of another site is refused (a browser posts a
/// form or a body-less `/reindex` across sites without asking); the same change from a loopback
/// origin, or from a client that sends no `Origin`, is answered, and reads are never refused.
#[tokio::test]
async fn without_tokens_changes_from_another_site_are_refused() {
    let app = TestApp::with(|config| config.tokens.clear()).await;
    let cases = [
        ("another site", Some("http://attacker.example"), false),
        (
            "another site on https",
            Some("https://attacker.example:8443"),
            false,
        ),
        ("a sandboxed page", Some("null"), false),
        (
            "a rebound name",
            Some("http://localhost.attacker.example"),
            false,
        ),
        (
            "the console's own origin",
            Some("http://127.0.0.1:8787"),
            true,
        ),
        ("localhost", Some("http://localhost:8787"), true),
        ("no Origin (curl, the Python client)", None, true),
    ];
    for (case, origin, answered) in cases {
        let mut request = Request::builder().method(Method::POST).uri("/reindex");
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        let (status, _, bytes) = respond(
            app.state.clone(),
            request.body(Body::empty()).expect("request"),
        )
        .await;
        let reply = Reply::of(status, &bytes);
        if answered {
            assert_eq!(status, StatusCode::OK, "{case}: {}", reply.body);
        } else {
            assert_eq!(status, StatusCode::FORBIDDEN, "{case}");
            assert_eq!(reply.body["code"], "forbidden", "{case}");
        }
        let mut read = Request::builder().method(Method::GET).uri("/runs");
        if let Some(origin) = origin {
            read = read.header("origin", origin);
        }
        let (status, _, _) = respond(
            app.state.clone(),
            read.body(Body::empty()).expect("request"),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{case}: a read is answered");
    }
}

#[tokio::test]
async fn an_attempt_cap_outside_one_to_a_million_is_refused_naming_the_field() {
    let app = TestApp::new().await;
    for cap in [json!(0), json!(1_000_001), json!(u64::MAX)] {
        let mut body = app.create_body();
        body["max_rollout_attempts"] = cap.clone();
        let reply = app
            .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
            .await;
        assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{cap}");
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| m.contains("max_rollout_attempts")),
            "{cap}: {}",
            reply.body
        );
        assert!(!app.output().exists() && !app.root.join("exp/out_manifest.json").exists());
    }
    let mut body = app.create_body();
    body["max_rollout_attempts"] = json!(1_000_000);
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    let run_id = reply.body["run_id"].as_str().expect("id").to_owned();
    let extended = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/attempts/extend"),
            Some(OPERATOR),
            Some(json!({"extend_attempts": 100, "reason": "more room"})),
        )
        .await;
    assert_eq!(extended.status, StatusCode::CREATED, "{}", extended.body);
    let run = app
        .call(Method::GET, &format!("/runs/{run_id}"), Some(VIEWER), None)
        .await;
    assert_eq!(run.body["effective_cap"], 1_000_100, "{}", run.body);
}

#[tokio::test]
async fn bodies_are_objects_and_a_classify_batch_is_bounded() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    // serde reads a struct from a positional array too; the API takes objects only.
    let reply = app
        .call_raw(
            Method::POST,
            &format!("/runs/{run_id}/lease"),
            Some(COLLECTOR),
            Some(r#"["h1", "host", 1, 5, null]"#.into()),
        )
        .await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.body
    );
    assert_eq!(reply.body["message"], "body: must be a JSON object");
    let row = r#"{"_ng_task_index":0,"_ng_rollout_index":0,"reward":1.0,"response":{"output":[],"status":"completed"}}"#;
    let rows = vec![row; (9 << 20) / row.len()].join(",");
    let reply = app
        .call_raw(
            Method::POST,
            "/classify",
            Some(VIEWER),
            Some(format!(r#"{{"rows":[{rows}]}}"#)),
        )
        .await;
    assert_eq!(
        reply.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{}",
        reply.body
    );
    assert_eq!(reply.body["code"], "payload_too_large");
    let tiny_rows = vec!["{}"; 20_001].join(",");
    let reply = app
        .call_raw(
            Method::POST,
            "/classify",
            Some(VIEWER),
            Some(format!(r#"{{"rows":[{tiny_rows}]}}"#)),
        )
        .await;
    assert_eq!(
        reply.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{}",
        reply.body
    );
    assert!(
        reply.body["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("rows:"))
    );
    let small = app
        .call_raw(
            Method::POST,
            "/classify",
            Some(VIEWER),
            Some(format!(r#"{{"rows":[{row}]}}"#)),
        )
        .await;
    assert_eq!(small.status, StatusCode::OK, "{}", small.body);
}

#[tokio::test]
async fn lease_names_take_no_control_characters_pids_are_not_negative_and_outputs_are_files() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let cases = [
        (
            "a NUL in the holder",
            json!({"holder": "a\u{0}b", "host": "h", "pid": 1}),
            "holder",
        ),
        (
            "a right-to-left override in the holder",
            json!({"holder": "ops\u{202e}evil", "host": "h", "pid": 1}),
            "holder",
        ),
        (
            "a newline in the host",
            json!({"holder": "c", "host": "h\nx", "pid": 1}),
            "host",
        ),
        (
            "a negative pid",
            json!({"holder": "c", "host": "h", "pid": -5}),
            "pid",
        ),
        (
            "a left-to-right mark in the holder",
            json!({"holder": "ops\u{200e}", "host": "h", "pid": 1}),
            "holder",
        ),
        (
            "a zero-width space in the host",
            json!({"holder": "c", "host": "h\u{200b}", "pid": 1}),
            "host",
        ),
        (
            "a byte-order mark in the holder",
            json!({"holder": "\u{feff}c", "host": "h", "pid": 1}),
            "holder",
        ),
        (
            "an empty checkpoint directory (it would name the first root)",
            json!({"holder": "c", "host": "h", "pid": 1, "checkpoint_dir": ""}),
            "checkpoint_dir",
        ),
    ];
    for (case, body, field) in cases {
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/lease"),
                Some(COLLECTOR),
                Some(body),
            )
            .await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{case}: {}",
            reply.body
        );
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| m.contains(field)),
            "{case}: {}",
            reply.body
        );
    }
    let mut body = app.create_body();
    body["output_path"] = json!(format!("{}/", app.root.join("exp3").display()));
    let reply = app
        .call(Method::POST, "/runs", Some(COLLECTOR), Some(body))
        .await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.body
    );
    assert_eq!(reply.body["code"], "path_refused");
    assert!(
        !app.root.join("exp3").exists(),
        "nothing named exp3 was made"
    );
    for (case, output) in [
        (
            "a trailing /.",
            format!("{}/.", app.root.join("tp5").display()),
        ),
        (
            "a trailing /..",
            format!("{}/..", app.root.join("tp6").display()),
        ),
        (
            "a newline in the name",
            format!("{}\n", app.root.join("nl/out.jsonl").display()),
        ),
    ] {
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
    assert!(!app.root.join("tp5").exists() && !app.root.join("nl").exists());
    assert!(
        recovery_server::config::TokenEntry::parse("operator:o:has a space 0123456789").is_err()
    );
}

/// An extension is refused with its range whatever the number, and by its type otherwise
/// (hostile review, stop 29: `1.5` said "floating point", `1e20` "out of range", `true` showed
/// itself, where `0` and `101` said the range).
#[tokio::test]
async fn an_extension_out_of_its_range_is_refused_with_the_range() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    for (value, said) in [
        (
            json!(0),
            "extend_attempts: out of range: must be between 1 and 100",
        ),
        (
            json!(101),
            "extend_attempts: out of range: must be between 1 and 100",
        ),
        (
            json!(-5),
            "extend_attempts: out of range: must be between 1 and 100",
        ),
        (
            json!(1e20),
            "extend_attempts: out of range: must be between 1 and 100",
        ),
        (
            json!(1.5),
            "extend_attempts: 1.5 is a float: must be an integer",
        ),
        (
            json!(true),
            "extend_attempts: got a boolean: must be an integer",
        ),
        (
            json!("Bearer x"),
            "extend_attempts: got a string: must be an integer",
        ),
    ] {
        let reply = app
            .call(
                Method::POST,
                &format!("/runs/{run_id}/attempts/extend"),
                Some(OPERATOR),
                Some(json!({"extend_attempts": value, "reason": "more"})),
            )
            .await;
        reply.assert_field_refused("extend_attempts", &value.to_string());
        assert_eq!(reply.body["message"], said, "{value}");
    }
}

/// A database rebuilt from files where a run's folder was copied (`cp -r`, the copy sorting
/// first) takes no side: the run and its copy cannot be told apart, so neither is recorded and
/// the reindex reports both, until a request names one of the outputs: the collector's lookup
/// at its own output takes the run there, and the other is a copy from then on (hostile review
/// 55, F9: the copy took the run, and the collector's own output was refused as "a copy").
#[tokio::test]
async fn a_rebuilt_database_takes_no_side_between_a_run_and_its_copy() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let original = app.output().parent().expect("dir").to_owned();
    let copy = app.root.join("aaa/copy");
    std::fs::create_dir_all(&copy).expect("copy dir");
    for entry in std::fs::read_dir(&original).expect("dir") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, copy.join(path.file_name().expect("name"))).expect("copy");
    }
    let (_fresh, config) = on_a_new_database(&app);
    let rebuilt = recovery_server::start(config, app.clock.clone())
        .await
        .expect("a service on a new database");
    let unknown = send(
        rebuilt.clone(),
        Method::GET,
        &format!("/runs/{run_id}"),
        Some(VIEWER),
        None,
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{}", unknown.body);
    let manifests = [
        recovery_sidecar::SidecarPaths::for_output(&app.output()).manifest,
        recovery_sidecar::SidecarPaths::for_output(&copy.join("out.jsonl")).manifest,
    ];
    let report = send(
        rebuilt.clone(),
        Method::POST,
        "/reindex",
        Some(OPERATOR),
        None,
    )
    .await;
    for manifest in &manifests {
        let said = report.body["unreadable"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|entry| entry[0] == manifest.display().to_string());
        assert!(
            said.is_some_and(|e| e[1]
                .as_str()
                .is_some_and(|why| why.contains("cannot be told from its copies"))),
            "{}: {}",
            manifest.display(),
            report.body
        );
    }
    let lookup = send(
        rebuilt.clone(),
        Method::GET,
        &format!(
            "/runs?output_path={}",
            app.output().display().to_string().replace('/', "%2F")
        ),
        Some(VIEWER),
        None,
    )
    .await;
    assert_eq!(lookup.body["runs"][0]["run_id"], run_id, "{}", lookup.body);
    let again = send(rebuilt, Method::POST, "/reindex", Some(OPERATOR), None).await;
    let copy_said = again.body["unreadable"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|entry| entry[0] == manifests[1].display().to_string());
    assert!(
        copy_said.is_some_and(|e| e[1]
            .as_str()
            .is_some_and(|why| why.contains("a copy of run"))),
        "{}",
        again.body
    );
}
