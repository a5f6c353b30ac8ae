//! The console's pages (maud templates: checked when the service compiles, every value escaped).
//!
//! Plain, semantic HTML: a `nav`, one `main` and `h1` per page, tables with captions and
//! header scopes, a label on every control; no script. Times are shown in UTC with their age.

use super::RunSummary;
use super::chart::DriftChart;
use super::session::Visitor;
use crate::error::ApiError;
use crate::routes::query::DriftPage;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::{DOCTYPE, Markup, PreEscaped, html};
use recovery_store::{Approval, AuditEntry, RunRecord};
use serde_json::Value;
use time::OffsetDateTime;

pub const STYLE: &str = r#"
:root { font-family: system-ui, sans-serif; line-height: 1.4; color: #1b1b1b; background: #fff; }
body { margin: 0; }
header { background: #16324f; color: #fff; padding: .5rem 1rem; display: flex; flex-wrap: wrap; gap: 1rem; align-items: center; }
header a { color: #fff; }
header nav ul { display: flex; gap: 1rem; list-style: none; margin: 0; padding: 0; }
header .who { margin-left: auto; display: flex; gap: .5rem; align-items: center; }
main { padding: 1rem; max-width: 80rem; }
h1 { overflow-wrap: anywhere; font-size: 1.6rem; }
a { color: #0a4f9e; }
:focus-visible { outline: 3px solid #e69f00; outline-offset: 2px; }
table { border-collapse: collapse; width: 100%; margin: .5rem 0 1rem; }
.scroll { overflow-x: auto; }
caption { text-align: left; font-weight: 600; padding: .25rem 0; }
th, td { text-align: left; padding: .3rem .5rem; border-bottom: 1px solid #ddd; vertical-align: top; }
code, .mono { font-family: ui-monospace, monospace; font-size: .9em; overflow-wrap: anywhere; }
form.inline { display: inline-flex; flex-wrap: wrap; gap: .25rem; align-items: center; margin: 0; }
fieldset { border: 1px solid #ccc; margin: .5rem 0; padding: .5rem 1rem; }
label { margin-right: .25rem; }
input, select, button { font: inherit; padding: .2rem .4rem; }
button { cursor: pointer; }
.bar { display: flex; height: .9rem; min-width: 8rem; border: 1px solid #999; }
.bar span { display: block; height: 100%; }
.done { background: #e7f5ec; border-left: 4px solid #00875a; padding: .5rem; }
.problem { background: #fdecea; border-left: 4px solid #c62828; padding: .5rem; }
.legend li { list-style: none; }
.swatch { display: inline-block; width: .8rem; height: .8rem; margin-right: .3rem; border: 1px solid #666; }
.sr-only { position: absolute; width: 1px; height: 1px; overflow: hidden; clip: rect(0 0 0 0); }
svg { max-width: 100%; height: auto; }
@media (max-width: 40rem) { main { padding: .5rem; } header .who { margin-left: 0; } }
"#;

/// Colours of the plan states' bar (the same state always the same colour).
fn state_colour(state: &str) -> &'static str {
    match state {
        "scored" | "model_final" => "#00875a",
        "retryable" | "missing" | "judge_recoverable" => "#0072b2",
        "approved_rerun" => "#56b4e9",
        "awaiting_approval" | "masked" => "#e69f00",
        "omitted" => "#bbbbbb",
        _ => "#c62828",
    }
}

/// What an action's `?done=` code says on the page (unknown codes say nothing: the banner
/// never repeats text from the address).
pub fn done_message(code: &str) -> Option<&'static str> {
    Some(match code {
        "takeover" => "lease ended; the run is free for the next collector",
        "approved" => "rerun approved",
        "revoked" => "approval revoked",
        "extended" => "attempts extended",
        "resubmitted" => "failure budget reset",
        _ => return None,
    })
}

/// `%`-encodes a value for a URL query or path segment.
pub fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A stored time in UTC with its age (`2026-12-02 01:59:44 UTC, 3 min ago`).
fn when(at: &str, now: OffsetDateTime) -> Markup {
    let parsed = OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339);
    let Ok(then) = parsed else {
        return html! { (at) };
    };
    let shown = format!(
        "{} {:02}:{:02}:{:02} UTC",
        then.date(),
        then.hour(),
        then.minute(),
        then.second()
    );
    let seconds = (now - then).whole_seconds();
    let span = |s: i64| match s {
        s if s < 60 => format!("{s} s"),
        s if s < 3600 => format!("{} min", s / 60),
        s if s < 86_400 => format!("{} h", s / 3600),
        s => format!("{} days", s / 86_400),
    };
    let age = if seconds < 0 {
        format!("in {}", span(-seconds))
    } else {
        format!("{} ago", span(seconds))
    };
    html! { time datetime=(at) { (shown) } ", " (age) }
}

fn layout(visitor: Option<&Visitor>, title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · rollout-recovery" }
                link rel="stylesheet" href="/ui/style.css";
            }
            body {
                header {
                    strong { "rollout-recovery" }
                    nav aria-label="Console" {
                        ul {
                            li { a href="/ui/" { "Runs" } }
                            li { a href="/ui/drift" { "Drift" } }
                            li { a href="/ui/audit" { "Audit" } }
                        }
                    }
                    @if let Some(visitor) = visitor {
                        div.who {
                            span { (visitor.caller.name) " (" (visitor.caller.role.label()) ")" }
                            @if visitor.signed_in {
                                form.inline method="post" action="/ui/logout" {
                                    input type="hidden" name="csrf" value=(visitor.csrf);
                                    button type="submit" { "Sign out" }
                                }
                            }
                        }
                    }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

/// A page saying why something could not be done.
pub fn error_page(status: StatusCode, message: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    (
        status,
        layout(
            None,
            title,
            html! {
                p.problem role="alert" { (message) }
                p { a href="/ui/" { "Back to the runs" } }
            },
        ),
    )
        .into_response()
}

/// The API's refusal as a page (its code and message, never internals).
pub fn api_error_page(error: &ApiError, run_id: Option<&str>) -> Response {
    let code = serde_json::to_value(error.code)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    let title = error.code.status().canonical_reason().unwrap_or("Error");
    (
        error.code.status(),
        layout(
            None,
            title,
            html! {
                p.problem role="alert" { code { (code) } ": " (error.message) }
                @if let Some(run_id) = run_id {
                    p { a href={ "/ui/runs/" (url_encode(run_id)) } { "Back to the run" } }
                }
                p { a href="/ui/" { "Back to the runs" } }
            },
        ),
    )
        .into_response()
}

pub fn login(problem: Option<&str>) -> Markup {
    layout(
        None,
        "Sign in",
        html! {
            @if let Some(problem) = problem { p.problem role="alert" { (problem) } }
            p { "Sign in with a bearer token of this service (viewer, collector or operator). The token is checked once; the session cookie holds a random id, never the token." }
            form method="post" action="/ui/login" {
                label for="token" { "Token" }
                input id="token" name="token" type="password" autocomplete="current-password" required autofocus;
                button type="submit" { "Sign in" }
            }
        },
    )
}

fn counts(plan: &Value) -> Vec<(String, u64)> {
    plan.get("state_counts")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default()
}

/// The plan's counts as one compact bar, with the numbers in text beside it.
fn state_bar(plan: &Value) -> Markup {
    let counts = counts(plan);
    let total: u64 = counts.iter().map(|(_, n)| n).sum();
    let text = counts
        .iter()
        .map(|(state, n)| format!("{n} {state}"))
        .collect::<Vec<_>>()
        .join(", ");
    html! {
        div.bar role="img" aria-label=(text) {
            @for (state, n) in &counts {
                @let width = if total == 0 { 0.0 } else { *n as f64 * 100.0 / total as f64 };
                span title={ (n) " " (state) } style={ "width:" (format!("{width:.2}")) "%;background:" (state_colour(state)) } {}
            }
        }
        small { (text) }
    }
}

fn holder_text(holder: Option<&crate::routes::leases::HolderView>, now: OffsetDateTime) -> Markup {
    match holder {
        None => html! { "unknown" },
        Some(h) if h.locked_outside_service => html! { "held by an outside process" },
        Some(h) => match &h.holder {
            None => html! { "free" },
            Some(holder) => html! {
                (holder["holder"].as_str().unwrap_or("?")) " on " (holder["host"].as_str().unwrap_or("?"))
                " (pid " (holder["pid"]) "), until "
                (when(holder["expires_at"].as_str().unwrap_or(""), now))
            },
        },
    }
}

pub fn runs(
    visitor: &Visitor,
    now: OffsetDateTime,
    search: Option<&str>,
    rows: &[RunSummary],
    next: Option<&str>,
) -> Markup {
    layout(
        Some(visitor),
        "Runs",
        html! {
            form role="search" method="get" action="/ui/" {
                label for="q" { "Output path contains" }
                input id="q" name="q" type="search" value=(search.unwrap_or(""));
                button type="submit" { "Search" }
            }
            div.scroll {
                table {
                    caption { "Runs, newest first" }
                    thead { tr {
                        th scope="col" { "Output" }
                        th scope="col" { "Lease" }
                        th scope="col" { "Plan" }
                        th scope="col" { "Attempt cap" }
                        th scope="col" { "Last drift" }
                        th scope="col" { "Last validation" }
                    } }
                    tbody {
                        @for row in rows {
                            tr {
                                td {
                                    a href={ "/ui/runs/" (url_encode(&row.record.run_id)) } class="mono" { (row.record.output_path) }
                                    br; small { "created " (when(&row.record.created_at, now)) }
                                    @if let Some(by) = &row.record.superseded_by { br; small { "superseded by " code { (by) } } }
                                }
                                td { (holder_text(row.holder.as_ref(), now)) }
                                td {
                                    @match &row.plan {
                                        Ok(plan) => (state_bar(plan)),
                                        Err(problem) => small.problem { (problem) },
                                    }
                                }
                                td { @if let Ok(plan) = &row.plan { (plan["cap"]) } }
                                td { @match row.last_drift() {
                                    Some(e) => { (when(&e.at, now)) br; small.mono { (e.operational_keys.join(", ")) } },
                                    None => "none",
                                } }
                                td { @match row.last_validation() {
                                    Some(e) => { (e.outcome) br; small { (when(&e.at, now)) } },
                                    None => "none",
                                } }
                            }
                        }
                        @if rows.is_empty() { tr { td colspan="6" { "No runs." } } }
                    }
                }
            }
            @if let Some(next) = next {
                p { a rel="next" href={ "/ui/?cursor=" (url_encode(next)) @if let Some(q) = search { "&q=" (url_encode(q)) } } { "Older runs" } }
            }
        },
    )
}

/// Everything the run page shows.
#[derive(Debug)]
pub struct RunPage<'a> {
    pub record: &'a recovery_store::RunRecord,
    pub summary: &'a RunSummary,
    pub filter: Option<&'a str>,
    pub approvals: &'a [Approval],
    pub done: Option<&'a str>,
}

const PLAN_STATES: [&str; 11] = [
    "scored",
    "model_final",
    "judge_recoverable",
    "retryable",
    "exhausted",
    "terminal",
    "missing",
    "masked",
    "omitted",
    "awaiting_approval",
    "approved_rerun",
];

pub fn run(visitor: &Visitor, now: OffsetDateTime, page: &RunPage<'_>) -> Markup {
    let run = page.record;
    let run_path = format!("/ui/runs/{}", url_encode(&run.run_id));
    layout(
        Some(visitor),
        &format!("Run {}", run.run_id),
        html! {
            @if let Some(done) = page.done { p.done role="status" { "Done: " (done) "." } }
            section aria-labelledby="identity" {
                h2 id="identity" { "Identity" }
                dl {
                    dt { "Output" } dd.mono { (run.output_path) }
                    dt { "Source digest" } dd.mono { (run.source_digest) }
                    dt { "Materialized digest" } dd.mono { (run.materialized_digest) }
                    dt { "Config digest" } dd.mono { (run.config_digest) }
                    dt { "Created" } dd { (when(&run.created_at, now)) }
                    dt { "Legacy import / identity overridden" } dd { (run.legacy_import) " / " (run.identity_overridden) }
                    dt { "Attempt cap" } dd {
                        @if let Ok(plan) = &page.summary.plan { (plan["cap"]) } @else { "?" }
                        " (saved: " (run.max_rollout_attempts.map_or("the service default".to_owned(), |c| c.to_string())) ", plus extensions)"
                    }
                }
            }
            section aria-labelledby="lease" {
                h2 id="lease" { "Lease" }
                p { (holder_text(page.summary.holder.as_ref(), now)) }
                @if visitor.is_operator() && page.summary.holder.as_ref().is_some_and(|h| h.holder.is_some() || h.locked_outside_service) {
                    form method="post" action={ (run_path) "/takeover" } {
                        fieldset {
                            legend { "Take the run over: end the current lease at once, leaving the run free for the next collector (audited)" }
                            input type="hidden" name="csrf" value=(visitor.csrf);
                            label for="takeover-holder" { "Taken over by (recorded in the audit)" }
                            input id="takeover-holder" name="holder" required maxlength="256" value={ "operator:" (visitor.caller.name) };
                            label for="takeover-reason" { "Reason" }
                            input id="takeover-reason" name="reason" required maxlength="4096";
                            input id="takeover-confirm" type="checkbox" name="confirm" value="yes" required;
                            label for="takeover-confirm" { "I understand the current holder loses the run" }
                            button type="submit" { "Take over" }
                        }
                    }
                }
            }
            section aria-labelledby="plan" {
                h2 id="plan" { "Plan" }
                @match &page.summary.plan {
                    Err(problem) => p.problem { (problem) },
                    Ok(plan) => (plan_section(visitor, &run_path, page.filter, plan)),
                }
                @if visitor.is_operator() {
                    form method="post" action={ (run_path) "/extend" } {
                        fieldset {
                            legend { "Extend attempts (every rollout's cap)" }
                            input type="hidden" name="csrf" value=(visitor.csrf);
                            label for="extend-n" { "Attempts to add" }
                            input id="extend-n" name="extend_attempts" type="number" min="1" max="100" value="1" required;
                            label for="extend-reason" { "Reason" }
                            input id="extend-reason" name="reason" required maxlength="4096";
                            button type="submit" { "Extend" }
                        }
                    }
                    form method="post" action={ (run_path) "/resubmit" } {
                        fieldset {
                            legend { "Resubmit (earlier failures stop counting; no live lease)" }
                            input type="hidden" name="csrf" value=(visitor.csrf);
                            label for="resubmit-reason" { "Reason" }
                            input id="resubmit-reason" name="reason" required maxlength="4096";
                            button type="submit" { "Resubmit" }
                        }
                    }
                }
            }
            section aria-labelledby="approvals" {
                h2 id="approvals" { "Approvals" }
                div.scroll { table {
                    caption { "Masked reruns approved by operators" }
                    thead { tr { th scope="col" { "Attempt" } th scope="col" { "By" } th scope="col" { "Reason" } th scope="col" { "State" } } }
                    tbody {
                        @for a in page.approvals {
                            tr {
                                td.mono { (a.task_index) "-" (a.rollout_index) " attempt " (a.attempt_index) }
                                td { (a.by) br; small { (when(&a.at, now)) } }
                                td { (a.reason) }
                                td {
                                    @if let Some(at) = &a.revoked_at { "revoked " (when(at, now)) }
                                    @else if let Some(used) = a.consumed_by_attempt { "used by attempt " (used) }
                                    @else {
                                        "unused"
                                        @if visitor.is_operator() {
                                            " "
                                            form.inline method="post" action={ (run_path) "/approvals/" (url_encode(&a.approval_id)) "/revoke" } {
                                                input type="hidden" name="csrf" value=(visitor.csrf);
                                                button type="submit" aria-label={ "Revoke the approval of " (a.task_index) "-" (a.rollout_index) } { "Revoke" }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                        @if page.approvals.is_empty() { tr { td colspan="4" { "None." } } }
                    }
                } }
            }
            (history_section(&run.run_id, &page.summary.history, page.summary.older_history, now))
        },
    )
}

/// A run's newest validations (and a link to its drift), with a note when older ones exist.
fn history_section(
    run_id: &str,
    history: &[recovery_store::ResumeEvent],
    older: bool,
    now: OffsetDateTime,
) -> Markup {
    html! {
        section aria-labelledby="history" {
            h2 id="history" { "Validations and drift" }
            div.scroll { table {
                caption { "This run's validations, newest first (drift: resumes across operational changes)" }
                thead { tr { th scope="col" { "When" } th scope="col" { "Outcome" } th scope="col" { "Keys" } th scope="col" { "Client" } } }
                tbody {
                    @for e in history {
                        tr {
                            td { (when(&e.at, now)) }
                            td { (e.outcome) }
                            td.mono {
                                (e.operational_keys.join(", "))
                                @if !e.semantic_keys.is_empty() { " " (if e.outcome == "overridden" { "overridden" } else { "refused" }) ": " (e.semantic_keys.join(", ")) }
                                // A refusal that names no key (a changed source, an earlier override) says why.
                                @else if e.operational_keys.is_empty() && !e.reasons.is_empty() { "reasons: " (e.reasons.join(", ")) }
                            }
                            td { (e.client.as_deref().unwrap_or("")) }
                        }
                    }
                    @if history.is_empty() { tr { td colspan="4" { "None yet." } } }
                }
            } }
            @if older {
                p { "The " (super::HISTORY_ROWS) " newest validations are listed; older ones are recorded, and " code { "GET /runs/" (run_id) "/validations" } " pages through all of them." }
            }
            p { a href={ "/ui/drift?run_id=" (url_encode(run_id)) } { "This run's drift over time" } }
        }
    }
}

/// The page of a run another run took over: what it was, who owns its output now, and its
/// validations (history stays readable; nothing can be done to the run any more).
pub fn superseded_run(
    visitor: &Visitor,
    now: OffsetDateTime,
    record: &RunRecord,
    successor: &str,
    history: &[recovery_store::ResumeEvent],
    older: bool,
) -> Markup {
    layout(
        Some(visitor),
        &format!("Run {} (superseded)", record.run_id),
        html! {
            p.problem role="status" {
                "This run was superseded: run "
                a href={ "/ui/runs/" (url_encode(successor)) } { (successor) }
                " owns its output now. Its history is kept."
            }
            section aria-labelledby="identity" {
                h2 id="identity" { "Identity" }
                dl {
                    dt { "Output" } dd.mono { (record.output_path) }
                    dt { "Config digest" } dd.mono { (record.config_digest) }
                    dt { "Created" } dd { (when(&record.created_at, now)) }
                }
            }
            (history_section(&record.run_id, history, older, now))
        },
    )
}

fn plan_section(visitor: &Visitor, run_path: &str, filter: Option<&str>, plan: &Value) -> Markup {
    let entries = plan["entries"].as_array().cloned().unwrap_or_default();
    let completion = &plan["completion"];
    html! {
        (state_bar(plan))
        p { "Completion: exit " (completion["exit_code"]) @if let Some(m) = completion["message"].as_str() { ". " (m) } }
        form method="get" action=(run_path) {
            label for="state" { "Show rollouts in state" }
            select id="state" name="state" {
                option value="" selected[filter.is_none()] { "any" }
                @for state in PLAN_STATES {
                    option value=(state) selected[filter == Some(state)] { (state) }
                }
            }
            button type="submit" { "Filter" }
        }
        div.scroll { table {
            caption { "Rollouts in inventory order" @if let Some(f) = filter { " (" (f) ")" } }
            thead { tr {
                th scope="col" { "Rollout" } th scope="col" { "State" } th scope="col" { "Why" }
                th scope="col" { "Attempts" } th scope="col" { "Failure" } th scope="col" { "Action" }
            } }
            tbody {
                @for entry in &entries {
                    tr {
                        td.mono { (entry["rollout_id"].as_str().unwrap_or("")) }
                        td { (entry["state"].as_str().unwrap_or("")) }
                        td { (entry["reason"].as_str().unwrap_or("")) }
                        td {
                            "latest " (attempt(&entry["latest_attempt"])) ", next " (attempt(&entry["next_attempt"]))
                            ", " (entry["counted_failures"]) " counted failures"
                        }
                        td { (entry["failure_kind"].as_str().unwrap_or("")) " " small { (entry["responsibility"].as_str().unwrap_or("")) } }
                        td { (approve_form(visitor, run_path, entry)) }
                    }
                }
                @if entries.is_empty() { tr { td colspan="6" { "No rollouts in this state." } } }
            }
        } }
        @if let Some(next) = plan["next_cursor"].as_str() {
            p { a rel="next" href={ (run_path) "?cursor=" (url_encode(next)) @if let Some(f) = filter { "&state=" (url_encode(f)) } } { "Next rollouts" } }
        }
    }
}

/// An attempt number, or "none".
fn attempt(value: &Value) -> String {
    value
        .as_i64()
        .map_or_else(|| "none".to_owned(), |n| n.to_string())
}

/// An approval form on a rollout that waits for one (operators only).
fn approve_form(visitor: &Visitor, run_path: &str, entry: &Value) -> Markup {
    let eligible = entry["state"] == "awaiting_approval" && entry["latest_attempt"].is_i64();
    if !eligible || !visitor.is_operator() {
        return html! {};
    }
    let id = entry["rollout_id"].as_str().unwrap_or("");
    let field = format!("reason-{}", url_encode(id));
    html! {
        form.inline method="post" action={ (run_path) "/approvals" } {
            input type="hidden" name="csrf" value=(visitor.csrf);
            input type="hidden" name="task_index" value=(entry["task_index"]);
            input type="hidden" name="rollout_index" value=(entry["rollout_index"]);
            input type="hidden" name="attempt_index" value=(entry["latest_attempt"]);
            label for=(field) { "Reason" }
            input id=(field) name="reason" required maxlength="4096";
            button type="submit" aria-label={ "Approve a rerun of " (id) } { "Approve rerun" }
        }
    }
}

/// The drift page's filters, as given.
#[derive(Debug, Default)]
pub struct DriftFilters {
    pub from: Option<String>,
    pub to: Option<String>,
    pub run_id: Option<String>,
    pub key: Option<String>,
}

pub fn drift(
    visitor: &Visitor,
    now: OffsetDateTime,
    filters: &DriftFilters,
    page: &DriftPage,
    chart: Option<&DriftChart>,
    top: &[(String, usize)],
) -> Markup {
    let field = |v: &Option<String>| v.clone().unwrap_or_default();
    html! {
        (layout(Some(visitor), "Drift", html! {
            form method="get" action="/ui/drift" {
                fieldset {
                    legend { "Filter resumes across operational drift" }
                    label for="from" { "From (RFC 3339)" }
                    input id="from" name="from" value=(field(&filters.from)) placeholder="2026-12-01T00:00:00Z";
                    label for="to" { "To" }
                    input id="to" name="to" value=(field(&filters.to));
                    label for="run_id" { "Run" }
                    input id="run_id" name="run_id" value=(field(&filters.run_id));
                    label for="key" { "Key" }
                    input id="key" name="key" value=(field(&filters.key));
                    button type="submit" { "Filter" }
                }
            }
            p { (page.events.len()) @if page.events.len() == 1 { " event" } @else { " events" } @if page.next_cursor.is_some() { " (the newest 1,000 of the range; narrow the filters for older ones)" } "." }
            @if let Some(chart) = chart {
                figure aria-labelledby="chart-caption" {
                    div role="img" aria-label={ "Drift events over time, stacked by key, from " (chart.first) " to " (chart.last) } {
                        (PreEscaped(&chart.svg))
                    }
                    figcaption id="chart-caption" {
                        "Events per interval from " (when(&chart.first, now)) " to " (when(&chart.last, now)) " (tallest bar: " (chart.tallest) " key changes)."
                        ul.legend {
                            @for (key, colour, n) in &chart.legend {
                                li { span.swatch style={ "background:" (colour) } {} code { (key) } " " (n) }
                            }
                        }
                    }
                }
            }
            div.scroll { table {
                caption { "Keys that drift most" }
                thead { tr { th scope="col" { "Key" } th scope="col" { "Events" } } }
                tbody {
                    @for (key, n) in top.iter().take(20) {
                        tr { td { a.mono href={ "/ui/drift?key=" (url_encode(key)) } { (key) } } td { (n) } }
                    }
                }
            } }
            div.scroll { table {
                caption { "Events, newest first" }
                thead { tr { th scope="col" { "When" } th scope="col" { "Run" } th scope="col" { "Keys" } th scope="col" { "Digests (saved → current)" } } }
                tbody {
                    @for e in page.events.iter().take(200) {
                        tr {
                            td { (when(&e.at, now)) }
                            td { a.mono href={ "/ui/runs/" (url_encode(&e.run_id)) } { (e.run_id) } }
                            td.mono { (e.operational_keys.join(", ")) }
                            td.mono { (e.saved_config_digest.get(..12).unwrap_or("")) " → " (e.current_config_digest.get(..12).unwrap_or("")) }
                        }
                    }
                    @if page.events.is_empty() { tr { td colspan="4" { "No drift in this range." } } }
                }
            } }
        }))
    }
}

/// The audit page's filters, as given.
#[derive(Debug, Default)]
pub struct AuditFilters {
    pub run_id: Option<String>,
    pub actor: Option<String>,
    pub action: Option<String>,
}

pub fn audit(
    visitor: &Visitor,
    now: OffsetDateTime,
    filters: &AuditFilters,
    entries: &[AuditEntry],
) -> Markup {
    let field = |v: &Option<String>| v.clone().unwrap_or_default();
    layout(
        Some(visitor),
        "Audit",
        html! {
            form method="get" action="/ui/audit" {
                fieldset {
                    legend { "Filter" }
                    label for="run_id" { "Run" }
                    input id="run_id" name="run_id" value=(field(&filters.run_id));
                    label for="actor" { "Who" }
                    input id="actor" name="actor" value=(field(&filters.actor));
                    label for="action" { "Action" }
                    select id="action" name="action" {
                        option value="" { "any" }
                        @for action in recovery_store::AUDIT_ACTIONS {
                            option value=(action) selected[filters.action.as_deref() == Some(action)] { (action) }
                        }
                    }
                    button type="submit" { "Filter" }
                }
            }
            div.scroll { table {
                caption { "Who did what, newest first" }
                thead { tr { th scope="col" { "When" } th scope="col" { "Who" } th scope="col" { "Action" } th scope="col" { "Run" } th scope="col" { "Details" } } }
                tbody {
                    @for e in entries {
                        tr {
                            td { (when(&e.at, now)) }
                            td { (e.actor) }
                            td { (e.action) }
                            td { @if let Some(run) = &e.run_id { a.mono href={ "/ui/runs/" (url_encode(run)) } { (run) } } }
                            td.mono { (e.details.to_string()) }
                        }
                    }
                    @if entries.is_empty() { tr { td colspan="5" { "Nothing recorded." } } }
                }
            } }
        },
    )
}
