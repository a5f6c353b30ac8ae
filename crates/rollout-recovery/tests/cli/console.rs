//! The operators' console in a real headless Chromium (Debian's `chromium` and
//! `chromium-driver`, which `.ci/run` installs), driven over WebDriver against the real binary.
//! Screenshots of every page land in `target/ui-screenshots/`.

use super::*;
use fantoccini::{Client, ClientBuilder, Locator};

const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port()
}

fn start_driver() -> Driver {
    assert!(
        Path::new(CHROMEDRIVER).exists(),
        "the console tests need Debian's chromium and chromium-driver: apt-get install chromium chromium-driver (.ci/run does)"
    );
    let port = free_port();
    let child = Command::new(CHROMEDRIVER)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "chromedriver did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    Driver {
        child,
        url: format!("http://127.0.0.1:{port}"),
    }
}

async fn browser(driver: &Driver) -> Client {
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".into(),
        json!({"binary": "/usr/bin/chromium", "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,800"]}),
    );
    // The workspace's rustls has two crypto providers in a test build (sqlx's TLS to
    // PostgreSQL uses ring, the WebDriver client's default is aws-lc-rs): name one. Another
    // test of this binary may have installed it first.
    let _ = rustls::crypto::ring::default_provider().install_default();
    ClientBuilder::rustls()
        .expect("tls")
        .capabilities(capabilities)
        .connect(&driver.url)
        .await
        .expect("a Chromium session")
}

async fn screenshot(browser: &Client, name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/ui-screenshots");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    let png = browser.screenshot().await.expect("screenshot");
    std::fs::write(dir.join(format!("{name}.png")), png).expect("write screenshot");
}

async fn sign_in(browser: &Client, server: &Server, token: &str) {
    browser
        .goto(&format!("{}/ui/", server.url))
        .await
        .expect("goto");
    assert!(
        browser
            .current_url()
            .await
            .expect("url")
            .path()
            .ends_with("/ui/login"),
        "a visitor without a session is sent to sign in"
    );
    browser
        .find(Locator::Id("token"))
        .await
        .expect("token field")
        .send_keys(token)
        .await
        .expect("type");
    browser
        .find(Locator::Css("form button[type=submit]"))
        .await
        .expect("sign-in button")
        .click()
        .await
        .expect("sign in");
    arrive(browser, "//h1[text()='Runs']").await;
}

/// Waits (polling the page, at most 20 s) until the page the last click led to shows `xpath`.
async fn arrive(browser: &Client, xpath: &str) {
    browser
        .wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::XPath(xpath))
        .await
        .unwrap_or_else(|e| panic!("the page never showed {xpath}: {e}"));
}

async fn page_text(browser: &Client) -> String {
    browser
        .find(Locator::Css("main"))
        .await
        .expect("main")
        .text()
        .await
        .expect("text")
}

async fn buttons(browser: &Client, label: &str) -> usize {
    let mut found = 0;
    for button in browser
        .find_all(Locator::Css("button"))
        .await
        .expect("buttons")
    {
        if button.text().await.unwrap_or_default().trim() == label {
            found += 1;
        }
    }
    found
}

/// A run with one scored rollout, one masked result that kept an answer without a grade, and
/// one resume across operational drift.
async fn run_with_masked_answer(server: &Server, root: &Path) -> String {
    let client = reqwest::Client::new();
    let output = root.join("exp/out.jsonl");
    let run_id = create_run(&client, server, root, &output).await;
    let (status, lease) = call(
        &client,
        server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/lease"),
        COLLECTOR,
        Some(json!({"holder": "collector-7", "host": "node-7", "pid": 4242, "ttl_seconds": 600})),
    )
    .await;
    assert_eq!(status, 201, "{lease}");
    let lease_id = lease["lease_id"].as_str().expect("lease").to_owned();
    let validate = json!({"config": config(0.3), "global_config": global(8001), "source_path": root.join("src/train.jsonl"), "lease_id": lease_id});
    let (status, drift) = call(
        &client,
        server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/validate"),
        COLLECTOR,
        Some(validate),
    )
    .await;
    assert_eq!(
        (status, drift["outcome"].as_str()),
        (200, Some("resume_with_drift"))
    );
    let (status, _) = call(
        &client,
        server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/attempts/reserve"),
        COLLECTOR,
        Some(json!({"lease_id": lease_id, "rollout_ids": ["0-0", "1-0"]})),
    )
    .await;
    assert_eq!(status, 200);
    let results = [
        json!({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id, "reward": 1.0, "response": {"output": [{}], "status": "completed"}}),
        json!({"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 0, "_ng_run_id": run_id, "reward": 0.0, "mask_sample": true, "failure_kind": "verifier_error", "response": {"output": [{"type": "message"}], "status": "completed"}}),
    ];
    std::fs::write(
        &output,
        results.iter().map(|r| format!("{r}\n")).collect::<String>(),
    )
    .expect("results");
    run_id
}

async fn plan_states(server: &Server, run_id: &str) -> Value {
    let (_, plan) = call(
        &reqwest::Client::new(),
        server,
        reqwest::Method::GET,
        &format!("/runs/{run_id}/plan"),
        VIEWER,
        None,
    )
    .await;
    plan["state_counts"].clone()
}

#[tokio::test]
async fn operators_approve_and_revoke_in_the_console_viewers_only_look_and_forged_posts_fail() {
    let dir = tempfile::tempdir().expect("dir");
    let (data, root, _) = prepare(dir.path());
    let server = Server::start(&data, &root);
    let root = std::fs::canonicalize(&root).expect("root");
    let run_id = run_with_masked_answer(&server, &root).await;
    let driver = start_driver();
    let browser = browser(&driver).await;

    // An operator signs in, finds the run with the masked kept answer and approves a rerun.
    sign_in(&browser, &server, OPERATOR).await;
    let runs = page_text(&browser).await;
    assert!(runs.contains("1 awaiting_approval"), "{runs}");
    screenshot(&browser, "runs").await;
    browser
        .find(Locator::Css(&format!("a[href='/ui/runs/{run_id}']")))
        .await
        .expect("the run's link")
        .click()
        .await
        .expect("open the run");
    arrive(&browser, &format!("//h1[text()='Run {run_id}']")).await;
    screenshot(&browser, "run").await;
    browser
        .find(Locator::Css(
            "form[action$='/approvals'] input[name=reason]",
        ))
        .await
        .expect("the approval's reason")
        .send_keys("judge outage 12:00-12:40")
        .await
        .expect("type");
    browser
        .find(Locator::Css("form[action$='/approvals'] button"))
        .await
        .expect("approve")
        .click()
        .await
        .expect("approve");
    arrive(&browser, "//p[@class='done' and contains(., 'approved')]").await;
    let after = page_text(&browser).await;
    assert!(after.contains("Done: rerun approved."), "{after}");
    assert!(after.contains("1 approved_rerun"), "{after}");
    assert_eq!(
        plan_states(&server, &run_id).await,
        json!({"scored": 1, "approved_rerun": 1})
    );
    screenshot(&browser, "run-approved").await;
    browser
        .find(Locator::Css("form[action$='/revoke'] button"))
        .await
        .expect("revoke")
        .click()
        .await
        .expect("revoke");
    arrive(&browser, "//p[@class='done' and contains(., 'revoked')]").await;
    let revoked = page_text(&browser).await;
    assert!(revoked.contains("Done: approval revoked."), "{revoked}");
    assert_eq!(
        plan_states(&server, &run_id).await,
        json!({"scored": 1, "awaiting_approval": 1})
    );

    // A page on another origin posts a forged approval: the browser sends no session cookie
    // (SameSite=Strict) and marks it cross-site; it is refused and nothing is approved.
    let forged = format!(
        "data:text/html,<form method=post action='{}/ui/runs/{run_id}/approvals'>\
         <input name=csrf value=guess><input name=task_index value=1><input name=rollout_index value=0>\
         <input name=attempt_index value=0><input name=reason value=forged><button id=go>go</button></form>",
        server.url
    );
    browser.goto(&forged).await.expect("the forging page");
    browser
        .find(Locator::Id("go"))
        .await
        .expect("forged form")
        .click()
        .await
        .expect("submit");
    arrive(&browser, "//p[@class='problem']").await;
    let refused = browser.source().await.expect("source");
    assert!(refused.contains("Forbidden"), "{refused}");
    let (_, approvals) = call(
        &reqwest::Client::new(),
        &server,
        reqwest::Method::GET,
        &format!("/runs/{run_id}/approvals"),
        VIEWER,
        None,
    )
    .await;
    assert_eq!(
        approvals.as_array().map(Vec::len),
        Some(1),
        "only the operator's (revoked) approval: {approvals}"
    );

    // Drift: filter by the key that changed and see the chart.
    let key = "servers.agent.responses_api_agents.simple_agent.sandbox.sandbox_port";
    browser
        .goto(&format!("{}/ui/drift", server.url))
        .await
        .expect("drift");
    browser
        .find(Locator::Id("key"))
        .await
        .expect("key filter")
        .send_keys(key)
        .await
        .expect("type");
    browser
        .find(Locator::Css("form[action='/ui/drift'] button"))
        .await
        .expect("filter")
        .click()
        .await
        .expect("filter");
    arrive(&browser, &format!("//input[@id='key' and @value='{key}']")).await;
    assert!(
        browser
            .current_url()
            .await
            .expect("url")
            .query()
            .is_some_and(|q| q.contains("sandbox_port")),
        "the filter is in the address"
    );
    browser
        .find(Locator::Css("figure svg rect"))
        .await
        .expect("the drift chart's bars");
    let drift = page_text(&browser).await;
    assert!(drift.contains("1 event.") && drift.contains(key), "{drift}");
    screenshot(&browser, "drift").await;
    browser
        .goto(&format!("{}/ui/audit", server.url))
        .await
        .expect("audit");
    arrive(&browser, "//h1[text()='Audit']").await;
    let audit = page_text(&browser).await;
    assert!(
        audit.contains("approval.create") && audit.contains("approval.revoke"),
        "{audit}"
    );
    screenshot(&browser, "audit").await;

    // A viewer sees the same run and no action at all, while an unused approval exists (whose
    // Revoke an operator sees on the same page).
    let (status, approval) = call(
        &reqwest::Client::new(),
        &server,
        reqwest::Method::POST,
        &format!("/runs/{run_id}/approvals"),
        OPERATOR,
        Some(json!({"task_index": 1, "rollout_index": 0, "attempt_index": 0, "reason": "approved again for the viewer's look"})),
    )
    .await;
    assert_eq!(status, 201, "{approval}");
    browser
        .goto(&format!("{}/ui/runs/{run_id}", server.url))
        .await
        .expect("run");
    arrive(&browser, &format!("//h1[text()='Run {run_id}']")).await;
    for action in ["Revoke", "Take over", "Extend", "Resubmit"] {
        assert!(
            buttons(&browser, action).await > 0,
            "an operator has {action}"
        );
    }
    browser
        .goto(&format!("{}/ui/", server.url))
        .await
        .expect("runs");
    browser
        .find(Locator::Css("form[action='/ui/logout'] button"))
        .await
        .expect("sign out")
        .click()
        .await
        .expect("sign out");
    arrive(&browser, "//input[@id='token']").await;
    sign_in(&browser, &server, VIEWER).await;
    browser
        .goto(&format!("{}/ui/runs/{run_id}", server.url))
        .await
        .expect("run");
    let seen = page_text(&browser).await;
    assert!(seen.contains("1 approved_rerun"), "{seen}");
    for action in ["Approve rerun", "Revoke", "Take over", "Extend", "Resubmit"] {
        assert_eq!(
            buttons(&browser, action).await,
            0,
            "a viewer has no {action}"
        );
    }
    browser.set_window_size(390, 844).await.expect("phone size");
    screenshot(&browser, "run-viewer-phone").await;
    browser.close().await.expect("close");
}
