//! The operators' console in process: sessions, CSRF, roles, and the console's actions going
//! through the API's locked mutations (the browser suite drives the same pages in Chromium).

use super::*;

struct Page {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: String,
}

async fn visit(
    app: &TestApp,
    method: Method,
    uri: &str,
    cookie: Option<&str>,
    form: Option<&str>,
    extra: &[(&str, &str)],
) -> Page {
    visit_state(app.state.clone(), method, uri, cookie, form, extra).await
}

async fn visit_state(
    state: AppState,
    method: Method,
    uri: &str,
    cookie: Option<&str>,
    form: Option<&str>,
    extra: &[(&str, &str)],
) -> Page {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(cookie) = cookie {
        request = request.header("cookie", cookie);
    }
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let request = match form {
        Some(form) => request
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(form.to_owned())),
        None => request.body(Body::empty()),
    }
    .expect("request");
    let (status, headers, bytes) = respond(state, request).await;
    Page {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// Signs in with a token: the `name=value` of the session cookie.
async fn sign_in(app: &TestApp, token: &str) -> String {
    let page = visit(
        app,
        Method::POST,
        "/ui/login",
        None,
        Some(&format!("token={token}")),
        &[],
    )
    .await;
    assert_eq!(page.status, StatusCode::SEE_OTHER, "{}", page.body);
    let cookie = page.headers["set-cookie"]
        .to_str()
        .expect("cookie")
        .to_owned();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/ui"] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    cookie.split(';').next().expect("pair").to_owned()
}

fn csrf_of(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
    page[at..at + 64].to_owned()
}

fn approval_form(csrf: &str) -> String {
    format!("csrf={csrf}&task_index=1&rollout_index=0&attempt_index=0&reason=judge+outage")
}

#[tokio::test]
async fn the_console_needs_a_session_and_its_forms_need_their_csrf_token() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let run_page = format!("/ui/runs/{run_id}");
    let anonymous = visit(&app, Method::GET, "/ui/", None, None, &[]).await;
    assert_eq!(
        (
            anonymous.status,
            anonymous
                .headers
                .get("location")
                .and_then(|v| v.to_str().ok())
        ),
        (StatusCode::SEE_OTHER, Some("/ui/login"))
    );
    let wrong = visit(
        &app,
        Method::POST,
        "/ui/login",
        None,
        Some("token=not-a-token-0123456789"),
        &[],
    )
    .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);

    // A viewer sees the run without any action, and a form they forge is refused by the API.
    let viewer = sign_in(&app, VIEWER).await;
    let seen = visit(&app, Method::GET, &run_page, Some(&viewer), None, &[]).await;
    assert_eq!(seen.status, StatusCode::OK);
    assert!(seen.body.contains("awaiting_approval") && !seen.body.contains("Approve rerun"));
    let forged = visit(
        &app,
        Method::POST,
        &format!("{run_page}/approvals"),
        Some(&viewer),
        Some(&approval_form(&csrf_of(&seen.body))),
        &[],
    )
    .await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN, "{}", forged.body);
    assert!(
        forged.body.contains("this needs the operator role"),
        "{}",
        forged.body
    );

    // An operator's form needs its own session's token, and a same-origin request.
    let operator = sign_in(&app, OPERATOR).await;
    let page = visit(&app, Method::GET, &run_page, Some(&operator), None, &[]).await;
    let csrf = csrf_of(&page.body);
    assert_ne!(csrf, csrf_of(&seen.body), "each session has its own token");
    let refusals = [
        (
            Some(operator.as_str()),
            approval_form(&"0".repeat(64)),
            vec![],
        ),
        (
            Some(operator.as_str()),
            approval_form(&csrf),
            vec![("sec-fetch-site", "cross-site")],
        ),
        (
            Some(operator.as_str()),
            approval_form(&csrf),
            vec![("origin", "https://evil.example"), ("host", "localhost")],
        ),
        (None, approval_form(&csrf), vec![]),
    ];
    for (cookie, form, headers) in refusals {
        let refused = visit(
            &app,
            Method::POST,
            &format!("{run_page}/approvals"),
            cookie,
            Some(&form),
            &headers,
        )
        .await;
        assert_eq!(
            refused.status,
            StatusCode::FORBIDDEN,
            "{headers:?}: {}",
            refused.body
        );
    }
    let approvals = app
        .state
        .registry
        .store()
        .list_approvals(&run_id)
        .await
        .expect("approvals");
    assert!(
        approvals.is_empty(),
        "nothing refused was approved: {approvals:?}"
    );
    let approved = visit(
        &app,
        Method::POST,
        &format!("{run_page}/approvals"),
        Some(&operator),
        Some(&approval_form(&csrf)),
        &[("origin", "http://localhost"), ("host", "localhost")],
    )
    .await;
    assert_eq!(approved.status, StatusCode::SEE_OTHER, "{}", approved.body);
    let after = visit(&app, Method::GET, &run_page, Some(&operator), None, &[]).await;
    assert!(after.body.contains("1 approved_rerun"), "{}", after.body);

    // The audit log names who approved, over the API and in the console.
    let audit = app
        .call(
            Method::GET,
            &format!("/audit?run_id={run_id}&action=approval.create"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(audit.body["entries"][0]["actor"], "alice", "{}", audit.body);
    let audit_page = visit(
        &app,
        Method::GET,
        "/ui/audit?action=approval.create",
        Some(&viewer),
        None,
        &[],
    )
    .await;
    assert!(audit_page.body.contains("approval.create") && audit_page.body.contains("alice"));

    // Signing out ends the session: its cookie opens nothing any more.
    let logout = visit(
        &app,
        Method::POST,
        "/ui/logout",
        Some(&operator),
        Some(&format!("csrf={csrf}")),
        &[],
    )
    .await;
    assert_eq!(logout.status, StatusCode::SEE_OTHER);
    let ended = visit(&app, Method::GET, "/ui/", Some(&operator), None, &[]).await;
    assert_eq!(ended.status, StatusCode::SEE_OTHER);
}

#[tokio::test]
async fn sessions_are_stored_as_hashes_and_no_token_reaches_a_file() {
    let app = TestApp::new().await;
    let cookie = sign_in(&app, OPERATOR).await;
    let id = cookie.split_once('=').expect("pair").1.to_owned();
    assert!(id.len() >= 64, "a long random id");
    let database = app.config.data_dir.clone();
    for file in files_under(&database) {
        let bytes = std::fs::read(&file).unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains(&id),
            "{} holds the session id",
            file.display()
        );
        assert!(
            !text.contains(OPERATOR),
            "{} holds the token",
            file.display()
        );
    }
    let hash = recovery_core::canonical::sha256_hex(id.as_bytes());
    let now = app.clock.now_text();
    let session = app
        .state
        .registry
        .store()
        .live_session(&hash, &now)
        .await
        .expect("store");
    assert_eq!(
        session.map(|s| (s.name, s.role)),
        Some(("alice".to_owned(), "operator".to_owned()))
    );
    // Sessions expire: twelve hours on, the cookie opens nothing.
    app.clock.advance(time::Duration::hours(13));
    let expired = visit(&app, Method::GET, "/ui/", Some(&cookie), None, &[]).await;
    assert_eq!(expired.status, StatusCode::SEE_OTHER);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_console_approvals_of_one_attempt_approve_it_once() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let operator = sign_in(&app, OPERATOR).await;
    let page = visit(
        &app,
        Method::GET,
        &format!("/ui/runs/{run_id}"),
        Some(&operator),
        None,
        &[],
    )
    .await;
    let form = approval_form(&csrf_of(&page.body));
    let uri = format!("/ui/runs/{run_id}/approvals");
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (state, uri, operator, form) = (
                app.state.clone(),
                uri.clone(),
                operator.clone(),
                form.clone(),
            );
            tokio::spawn(async move {
                visit_state(state, Method::POST, &uri, Some(&operator), Some(&form), &[])
                    .await
                    .status
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.expect("task"));
    }
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == StatusCode::SEE_OTHER)
            .count(),
        1,
        "{statuses:?}"
    );
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::SEE_OTHER || *s == StatusCode::CONFLICT),
        "{statuses:?}"
    );
    let approvals = app
        .state
        .registry
        .store()
        .list_approvals(&run_id)
        .await
        .expect("approvals");
    assert_eq!(approvals.len(), 1, "{approvals:?}");
}

#[tokio::test]
async fn a_form_without_its_token_is_forbidden_a_takeover_needs_its_confirmation_and_banners_are_ours()
 {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let operator = sign_in(&app, OPERATOR).await;
    let run_page = format!("/ui/runs/{run_id}");
    let no_token = visit(
        &app,
        Method::POST,
        &format!("{run_page}/approvals"),
        Some(&operator),
        Some("task_index=1&rollout_index=0&attempt_index=0&reason=r"),
        &[],
    )
    .await;
    assert_eq!(no_token.status, StatusCode::FORBIDDEN, "{}", no_token.body);
    let page = visit(&app, Method::GET, &run_page, Some(&operator), None, &[]).await;
    assert!(page.body.contains("Take the run over"), "the run is leased");
    let csrf = csrf_of(&page.body);
    let unconfirmed = visit(
        &app,
        Method::POST,
        &format!("{run_page}/takeover"),
        Some(&operator),
        Some(&format!("csrf={csrf}&holder=ops&reason=stuck&confirm=no")),
        &[],
    )
    .await;
    assert_eq!(
        unconfirmed.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        unconfirmed.body
    );
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
        "the lease stands"
    );
    let confirmed = visit(
        &app,
        Method::POST,
        &format!("{run_page}/takeover"),
        Some(&operator),
        Some(&format!("csrf={csrf}&holder=ops&reason=stuck&confirm=yes")),
        &[],
    )
    .await;
    assert_eq!(
        confirmed.status,
        StatusCode::SEE_OTHER,
        "{}",
        confirmed.body
    );
    let spoofed = visit(
        &app,
        Method::GET,
        &format!("{run_page}?done=all+runs+deleted"),
        Some(&operator),
        None,
        &[],
    )
    .await;
    assert!(!spoofed.body.contains("all runs deleted") && !spoofed.body.contains("Done:"));
    let after = visit(
        &app,
        Method::GET,
        &format!("{run_page}?done=takeover"),
        Some(&operator),
        None,
        &[],
    )
    .await;
    assert!(
        after
            .body
            .contains("Done: lease ended; the run is free for the next collector."),
        "{}",
        after.body
    );
    // A browser cannot hand a lease to a collector: the run is free at once, audited.
    let free = app
        .call(
            Method::GET,
            &format!("/runs/{run_id}/lease"),
            Some(VIEWER),
            None,
        )
        .await;
    assert_eq!(free.body["holder"], Value::Null, "{}", free.body);
    let next = app.lease(&run_id, "collector-next").await;
    assert_eq!(next.status, StatusCode::CREATED, "{}", next.body);
    let audit = app
        .call(
            Method::GET,
            &format!("/audit?run_id={run_id}&actor=alice"),
            Some(VIEWER),
            None,
        )
        .await;
    let mut actions: Vec<&str> = audit.body["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| e["action"].as_str())
        .collect();
    actions.sort_unstable();
    assert_eq!(
        actions,
        ["lease.released", "lease.takeover"],
        "{}",
        audit.body
    );
}

#[tokio::test]
async fn a_session_ends_when_its_token_leaves_the_configuration() {
    let app = TestApp::new().await;
    let cookie = sign_in(&app, OPERATOR).await;
    let page = visit(&app, Method::GET, "/ui/", Some(&cookie), None, &[]).await;
    assert_eq!(page.status, StatusCode::OK);
    // The service restarted over the same database with alice's token removed, or replaced
    // under the same name and role.
    let restart = |replacement: Option<&str>| {
        let mut config = app.config.clone();
        config.tokens.retain(|token| token.name != "alice");
        config.tokens.extend(
            replacement
                .map(|spec| recovery_server::config::TokenEntry::parse(spec).expect("token")),
        );
        recovery_server::start(config, app.clock.clone())
    };
    let removed = restart(None).await.expect("restart");
    let rotated = restart(Some("operator:alice:rotated-token-0123456789"))
        .await
        .expect("restart");
    for (case, state) in [("removed", &removed), ("rotated", &rotated)] {
        let page = visit_state(state.clone(), Method::GET, "/ui/", Some(&cookie), None, &[]).await;
        assert_eq!(page.status, StatusCode::SEE_OTHER, "{case}: {}", page.body);
        assert_eq!(page.headers["location"], "/ui/login", "{case}");
    }
    // A viewer's session under the same restarted service still works.
    let viewer = sign_in(&app, VIEWER).await;
    let page = visit_state(removed, Method::GET, "/ui/", Some(&viewer), None, &[]).await;
    assert_eq!(page.status, StatusCode::OK);
}

/// An operator's extend form with no integer is refused naming the field, the value not
/// repeated (hostile review 39: the page said only "invalid digit found in string").
#[tokio::test]
async fn an_extend_form_without_an_integer_is_refused_naming_the_field() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let operator = sign_in(&app, OPERATOR).await;
    let run_page = format!("/ui/runs/{run_id}");
    let page = visit(&app, Method::GET, &run_page, Some(&operator), None, &[]).await;
    let csrf = csrf_of(&page.body);
    for typed in ["abc", "Bearer%20sk-live-1234", "1.5", ""] {
        let form = format!("csrf={csrf}&extend_attempts={typed}&reason=more");
        let answer = visit(
            &app,
            Method::POST,
            &format!("{run_page}/extend"),
            Some(&operator),
            Some(&form),
            &[],
        )
        .await;
        assert_eq!(
            answer.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{typed}: {}",
            answer.body
        );
        assert!(
            answer.body.contains("extend_attempts") && !answer.body.contains("sk-live-1234"),
            "{typed}: {}",
            answer.body
        );
    }
    let extension = std::fs::read_to_string(
        recovery_sidecar::SidecarPaths::for_output(&app.output()).attempt_extension,
    );
    assert!(extension.is_err(), "nothing was extended: {extension:?}");
}

/// A viewer's action form is refused for the role before it is read: malformed or empty, the
/// answer is 403 as for a well-formed one (it was a 422 naming what was wrong).
#[tokio::test]
async fn a_viewers_action_form_is_refused_for_its_role_whatever_it_holds() {
    let app = TestApp::new().await;
    let (run_id, _) = run_with_masked_answer(&app).await;
    let viewer = sign_in(&app, VIEWER).await;
    let run_page = format!("/ui/runs/{run_id}");
    let page = visit(&app, Method::GET, &run_page, Some(&viewer), None, &[]).await;
    let csrf = csrf_of(&page.body);
    for (action, form) in [
        ("extend", format!("csrf={csrf}&extend_attempts=Bearer%20x")),
        ("extend", format!("csrf={csrf}")),
        ("resubmit", format!("csrf={csrf}")),
        ("approvals", format!("csrf={csrf}&reason=r")),
        ("takeover", format!("csrf={csrf}&reason=r&confirm=yes")),
        ("approvals", approval_form(&csrf)),
    ] {
        let answer = visit(
            &app,
            Method::POST,
            &format!("{run_page}/{action}"),
            Some(&viewer),
            Some(&form),
            &[],
        )
        .await;
        assert_eq!(
            answer.status,
            StatusCode::FORBIDDEN,
            "{action} {form}: {}",
            answer.body
        );
    }
}

/// A run's page lists its 50 newest validations and says when older ones exist (it listed 50
/// with no sign of more), and a refusal that names no key shows its reasons where the keys go
/// (the cell was blank).
#[tokio::test]
async fn the_run_page_says_when_older_validations_exist_and_why_a_keyless_refusal_was_refused() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let viewer = sign_in(&app, VIEWER).await;
    let run_page = format!("/ui/runs/{run_id}");
    let uri = format!("/runs/{run_id}/validate");
    let older = "newest validations are listed; older ones are recorded";
    for _ in 0..50 {
        app.clock.advance(time::Duration::seconds(1));
        let reply = app
            .call(
                Method::POST,
                &uri,
                Some(COLLECTOR),
                Some(app.validate_body(0.3, 8000)),
            )
            .await;
        assert_eq!(reply.body["outcome"], "reuse", "{}", reply.body);
    }
    let page = visit(&app, Method::GET, &run_page, Some(&viewer), None, &[]).await;
    assert!(
        !page.body.contains(older),
        "fifty in all: every one is listed"
    );
    std::fs::write(app.root.join("data/other.jsonl"), b"{}\n").expect("other source");
    let mut changed_source = app.validate_body(0.3, 8000);
    changed_source["source_path"] = json!(app.root.join("data/other.jsonl"));
    app.clock.advance(time::Duration::seconds(1));
    let refused = app
        .call(Method::POST, &uri, Some(COLLECTOR), Some(changed_source))
        .await;
    assert_eq!(refused.body["code"], "resume_refused", "{}", refused.body);
    let page = visit(&app, Method::GET, &run_page, Some(&viewer), None, &[]).await;
    assert!(page.body.contains(older), "fifty-one in all");
    assert!(
        page.body.contains("reasons: source_dataset"),
        "the newest, a refusal for the source, says why"
    );
}

#[tokio::test]
async fn a_superseded_runs_page_names_the_run_that_owns_its_output_and_keeps_its_validations() {
    let app = TestApp::new().await;
    let run_id = app.create().await;
    let viewer = sign_in(&app, VIEWER).await;
    app.clock.advance(time::Duration::seconds(1));
    let drifted = app
        .call(
            Method::POST,
            &format!("/runs/{run_id}/validate"),
            Some(COLLECTOR),
            Some(app.validate_body(0.3, 8001)),
        )
        .await;
    assert_eq!(
        drifted.body["outcome"], "resume_with_drift",
        "{}",
        drifted.body
    );
    let mut replace = app.create_body();
    replace["replace"] = json!(true);
    let replaced = app
        .call(Method::POST, "/runs", Some(OPERATOR), Some(replace))
        .await;
    assert_eq!(replaced.status, StatusCode::CREATED, "{}", replaced.body);
    let successor = replaced.body["run_id"].as_str().expect("run id");

    let page = visit(
        &app,
        Method::GET,
        &format!("/ui/runs/{run_id}"),
        Some(&viewer),
        None,
        &[],
    )
    .await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(
        page.body
            .contains(&format!("href=\"/ui/runs/{successor}\"")),
        "links the run that owns the output now: {}",
        page.body
    );
    let drift_key = drifted.body["operational_keys"][0].as_str().expect("key");
    assert!(
        page.body.contains("resume_with_drift") && page.body.contains(drift_key),
        "the validation is listed: {}",
        page.body
    );
    assert!(
        !page.body.contains(&format!("action=\"/ui/runs/{run_id}/")),
        "nothing can be done to a superseded run: {}",
        page.body
    );
}
