//! Offline tools on a run's files and the operator client commands.

use anyhow::{Context as _, bail};
use clap::Args;
use recovery_core::drift::{DriftPolicy, differing_keys};
use recovery_core::failure::ClassificationPolicy;
use recovery_core::identity::{ConfigBundle, ConfigurationIdentity, RowReferences};
use recovery_core::plan::{Completion, completion};
use recovery_core::verdict::ResumeVerdict;
use recovery_runs::cache::RunCaches;
use recovery_runs::operations::{ResumeRequest, decide_resume};
use recovery_runs::runfiles;
use recovery_sidecar::SidecarPaths;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};

/// A configuration bundle file: `{config, global_config, environment?, rows?}`.
struct Bundle {
    config: Value,
    global_config: Value,
    environment: BTreeMap<String, String>,
    rows: Option<Vec<Value>>,
}

/// A bundle holding a number no digest can be taken of: the request's fault, as the service
/// answers it (`invalid_request` naming the key), which offline `validate` reports as the
/// `invalid` outcome the service records.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
struct NumberInBundle {
    file: String,
    /// `<key>: a number with no canonical form: ...`.
    message: String,
}

/// What a bundle file may hold: its four parts, and the other fields of the request bodies it is
/// often cut from (ignored here). Anything else is refused, so a misspelt part (`enviroment`)
/// never silently changes the digest (hostile review 55, F12).
const BUNDLE_KEYS: [&str; 4] = ["config", "global_config", "environment", "rows"];
const REQUEST_KEYS: [&str; 8] = [
    "source_path",
    "output_path",
    "lease_id",
    "allow_unsafe",
    "max_rollout_attempts",
    "retry_terminal_timeouts",
    "replace",
    "operation_id",
];

/// The refusal of a document holding a number no digest can be taken of (`1e999`, which
/// Python reads as infinity), naming the key (`config.a.b[1]: a number with no canonical
/// form: ...`), as the service names it; `None` when the text is not JSON or has no such number.
fn number_refusal(text: &[u8]) -> Option<String> {
    let value = serde_json::from_slice::<Value>(text).ok()?;
    let refusal = recovery_core::canonical::refuse_number_without_canonical_form("", &value)?;
    let message = refusal.message.trim_start_matches('.');
    Some(match message.strip_prefix(": ") {
        // The document itself is the number.
        Some(rest) => format!("the document: {rest}"),
        None => message.to_owned(),
    })
}

/// Opens a file argument for reading: a regular file, symbolic links followed; a directory, FIFO,
/// socket or device is refused at once, as `plan` and `validate` refuse them (hostile review 55,
/// F11: `digest /dev/zero` grew without bound, a FIFO hung `identity`). Standard input is
/// named `-` where a command reads it.
fn open_file(path: &Path) -> anyhow::Result<std::fs::File> {
    recovery_sidecar::open_regular_following(path)
        .with_context(|| format!("cannot read {}", path.display()))
}

/// The bytes of a file argument (see [`open_file`]).
fn read_file(path: &Path) -> anyhow::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    open_file(path)?
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {}", path.display()))?;
    Ok(bytes)
}

fn read_bundle(path: &Path) -> anyhow::Result<Bundle> {
    let text = read_file(path)?;
    let value = match recovery_core::canonical::parse_json(&text) {
        Ok(value) => value,
        // JSON whose digest cannot be taken is named by its key, not called "not JSON"
        // (hostile review 54).
        Err(error) => match number_refusal(&text) {
            Some(message) => {
                return Err(NumberInBundle {
                    file: path.display().to_string(),
                    message,
                }
                .into());
            }
            None => bail!("{} is not JSON: {error}", path.display()),
        },
    };
    if let Some(unknown) = value.as_object().and_then(|object| {
        object.keys().find(|key| {
            !BUNDLE_KEYS.contains(&key.as_str()) && !REQUEST_KEYS.contains(&key.as_str())
        })
    }) {
        bail!(
            "{}: {unknown:?} is no part of a bundle (its parts: {})",
            path.display(),
            BUNDLE_KEYS.join(", ")
        );
    }
    let field = |name: &str| {
        value
            .get(name)
            .cloned()
            .with_context(|| format!("{}: the bundle needs a {name:?} object", path.display()))
    };
    let environment = match value.get("environment") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(env) => serde_json::from_value(env.clone()).with_context(|| {
            format!("{}: environment must map names to strings", path.display())
        })?,
    };
    let rows = match value.get("rows") {
        None | Some(Value::Null) => None,
        Some(Value::Array(rows)) => {
            // As the service refuses them (review 55, F12: `[1, "x", null]` was taken).
            if let Some(i) = rows.iter().position(|row| !row.is_object()) {
                bail!("{}: rows[{i}]: must be a JSON object", path.display());
            }
            Some(rows.clone())
        }
        Some(_) => bail!("{}: rows must be a list", path.display()),
    };
    Ok(Bundle {
        config: field("config")?,
        global_config: field("global_config")?,
        environment,
        rows,
    })
}

fn references(bundle: &Bundle, materialized: Option<&Path>) -> anyhow::Result<RowReferences> {
    match (&bundle.rows, materialized) {
        (Some(rows), _) => Ok(RowReferences::from_rows(rows)),
        (None, Some(path)) => runfiles::row_references(path).map_err(anyhow::Error::msg),
        (None, None) => Ok(RowReferences::default()),
    }
}

fn compute(bundle: &Bundle, refs: &RowReferences) -> anyhow::Result<ConfigurationIdentity> {
    ConfigurationIdentity::compute(ConfigBundle {
        config: &bundle.config,
        global_config: &bundle.global_config,
        rows: refs,
        environment: &bundle.environment,
    })
    .map_err(|e| anyhow::anyhow!("{e} ({})", e.kind()))
}

#[derive(Debug, Args)]
pub struct IdentityArgs {
    /// The configuration bundle (`{config, global_config, environment, rows}`).
    #[arg(long)]
    bundle: PathBuf,
    /// Materialized inputs for server selection when the bundle has no rows.
    #[arg(long)]
    materialized: Option<PathBuf>,
    /// A saved identity file to compare against (prints the drift keys and their class).
    #[arg(long)]
    against: Option<PathBuf>,
    #[command(flatten)]
    policy: DriftPolicyArgs,
}

/// The operator's extensions of the drift classifier (decisions §5), read by `serve` and by the
/// offline `validate` and `identity --against` alike, so both decide a key the same way.
#[derive(Debug, Args)]
pub struct DriftPolicyArgs {
    /// Extra semantic key segments for the drift classifier (a dotted key: that whole key).
    #[arg(long = "semantic-key", env = "RR_SEMANTIC_KEYS", value_delimiter = ',')]
    pub semantic_keys: Vec<String>,
    /// Extra operational words for the drift classifier (one holding `_`: a whole last segment).
    #[arg(
        long = "operational-word",
        env = "RR_OPERATIONAL_WORDS",
        value_delimiter = ','
    )]
    pub operational_words: Vec<String>,
    /// Whole dotted keys declared operational.
    #[arg(
        long = "operational-key",
        env = "RR_OPERATIONAL_KEYS",
        value_delimiter = ','
    )]
    pub operational_keys: Vec<String>,
}

impl DriftPolicyArgs {
    pub fn policy(self) -> DriftPolicy {
        DriftPolicy::extended(
            self.semantic_keys,
            self.operational_words,
            self.operational_keys,
        )
    }
}

pub fn identity(args: IdentityArgs) -> anyhow::Result<i32> {
    let bundle = read_bundle(&args.bundle)?;
    let identity = compute(&bundle, &references(&bundle, args.materialized.as_deref())?)?;
    let mut report = json!({
        "config_digest": identity.config_digest,
        "legacy_config_digest": identity.legacy_digest,
        "accepted_forms": identity.accepted_forms(),
        "identity": identity.identity,
    });
    if let Some(against) = &args.against {
        let saved = read_saved_identity(against)?;
        let policy = args.policy.policy();
        let keys = differing_keys(&saved, &identity.identity);
        let drift = policy.classify_all(&keys);
        report["against"] = json!({
            "saved_digest": recovery_core::canonical::digest(&saved)?,
            "semantic": drift.semantic.iter().map(recovery_server::error::key_view).collect::<Vec<_>>(),
            "operational": drift.operational,
            "verdict": if drift.semantic.is_empty() { if drift.operational.is_empty() { "identical" } else { "resume with operational drift" } } else { "refused: semantic drift" },
        });
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(0)
}

/// A saved identity file (`<stem>_manifest_identity.json`): a JSON object holding `collection`
/// and `servers`, as every identity does. Anything else is refused naming the file, never
/// compared (hostile review 53, F9: `/etc/passwd` failed with a parse error naming no file, and
/// a bundle given instead was answered with drift on `config` and `global_config`).
fn read_saved_identity(path: &std::path::Path) -> anyhow::Result<Value> {
    let bytes = read_file(path)?;
    let saved: Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("--against {}: not JSON", path.display()))?;
    // A number no digest can be taken of is named by its key, as in a bundle (review 55).
    if let Some(refusal) = number_refusal(&bytes) {
        bail!("--against {}: {refusal}", path.display());
    }
    // Both parts are objects in every identity (review 54: `{"collection": 1, "servers": []}`
    // was compared, and answered drift on both).
    let is_identity = saved.as_object().is_some_and(|o| {
        o.get("collection").is_some_and(Value::is_object)
            && o.get("servers").is_some_and(Value::is_object)
    });
    if !is_identity {
        anyhow::bail!(
            "--against {}: not a saved identity (a JSON object whose \"collection\" and \"servers\" \
             are objects, as in the file <stem>_manifest_identity.json beside a manifest)",
            path.display()
        );
    }
    Ok(saved)
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The run's output JSONL path (its sidecars are read beside it).
    #[arg(long)]
    output: PathBuf,
    /// The source dataset file.
    #[arg(long)]
    source: PathBuf,
    /// The current configuration bundle.
    #[arg(long)]
    bundle: PathBuf,
    /// Answer as a resume with `allow_unsafe` would: a semantic change is accepted (outcome
    /// `overridden`). This offline check writes nothing: the service's validate is what marks
    /// the manifest overridden for good and journals drift.
    #[arg(long)]
    allow_unsafe: bool,
    #[command(flatten)]
    policy: DriftPolicyArgs,
}

pub fn validate(args: ValidateArgs) -> anyhow::Result<i32> {
    let output = std::fs::canonicalize(&args.output).unwrap_or(args.output.clone());
    let paths = SidecarPaths::for_output(&output);
    let bundle = match read_bundle(&args.bundle) {
        Ok(bundle) => bundle,
        // Answered as the service answers and records it (hostile review 55, F13: exit 2).
        Err(error) => match error.downcast_ref::<NumberInBundle>() {
            Some(number) => {
                let field = number.message.split(": ").next().unwrap_or_default();
                let report = json!({
                    "outcome": "invalid",
                    "code": "invalid_request",
                    "message": number.message,
                    "details": {"field": field},
                });
                println!("{}", serde_json::to_string_pretty(&report)?);
                return Ok(1);
            }
            None => return Err(error),
        },
    };
    let raw = |value: &Value| serde_json::value::to_raw_value(value);
    // The service's decision, from the same code (`decide_resume`): the load-time checks, the
    // current identity (a source that cannot be read resumes as overridden with
    // `--allow-unsafe`), then the decision table.
    let request = ResumeRequest {
        config: raw(&bundle.config)?,
        global_config: raw(&bundle.global_config)?,
        environment: bundle.environment,
        source: args.source.clone(),
        rows: bundle
            .rows
            .as_ref()
            .map(|rows| raw(&Value::Array(rows.clone())))
            .transpose()?,
        allow_unsafe: args.allow_unsafe,
    };
    let verdict = match decide_resume(
        &RunCaches::default(),
        &paths,
        &request,
        &args.policy.policy(),
    ) {
        Ok(decided) => decided.verdict,
        // What the service answers and records for the same request (an unresolvable
        // configuration is `invalid`, not a refused resume), with its error code and details.
        Err(e) => {
            let error = recovery_server::error::ApiError::from(e);
            let mut report = json!({
                "outcome": error.code.resume_outcome(),
                "code": error.code,
                "message": error.message,
            });
            if !error.details.is_null() {
                report["details"] = error.details;
            }
            println!("{}", serde_json::to_string_pretty(&report)?);
            return Ok(1);
        }
    };
    let (code, report) = match verdict {
        ResumeVerdict::Reuse { manifest } => {
            (0, json!({"outcome": "reuse", "run_id": manifest.run_id}))
        }
        ResumeVerdict::ResumeWithDrift {
            manifest,
            operational_keys,
        } => (
            0,
            json!({"outcome": "resume_with_drift", "run_id": manifest.run_id, "message": recovery_runs::operations::drift_message(&operational_keys), "operational_keys": operational_keys}),
        ),
        ResumeVerdict::Overridden {
            manifest, message, ..
        } => (
            0,
            json!({"outcome": "overridden", "run_id": manifest.run_id, "message": message}),
        ),
        ResumeVerdict::ImportLegacy { message } => {
            (0, json!({"outcome": "import_legacy", "message": message}))
        }
        // The service's `details` of the same refusal: mismatch codes and each semantic key
        // with the rule that refused it.
        ResumeVerdict::Refused {
            message,
            mismatches,
        } => {
            let details = recovery_server::error::mismatch_details(&mismatches);
            (
                1,
                json!({"outcome": "refused", "message": message, "mismatches": details["mismatches"], "semantic_keys": details["semantic_keys"]}),
            )
        }
        ResumeVerdict::NoManifest { message } => {
            (1, json!({"outcome": "no_manifest", "message": message}))
        }
        ResumeVerdict::Unreadable { message } => {
            (1, json!({"outcome": "unreadable", "message": message}))
        }
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(code)
}

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The run's output JSONL path.
    #[arg(long)]
    output: PathBuf,
    /// The cap for manifests that saved none (1 to 1,000,000).
    #[arg(long, default_value_t = 3, value_parser = recovery_server::limits::parse_attempt_cap)]
    default_max_attempts: u64,
}

pub fn plan(args: PlanArgs) -> anyhow::Result<i32> {
    let output = std::fs::canonicalize(&args.output).unwrap_or(args.output.clone());
    let paths = SidecarPaths::for_output(&output);
    let (_, plan) = runfiles::build_plan(&paths, args.default_max_attempts)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({"plan": plan, "state_counts": plan.state_counts()}))?
    );
    if let Some(message) = &plan.budget_message {
        eprintln!("{message} Failures: {}.", paths.failures.display());
    }
    // The one completion rule (`has_only_intentional_gaps`), shared with every reader.
    match completion(&plan.state_counts()) {
        Ok(Completion::Complete) => Ok(0),
        Ok(Completion::OnlyIntentionalGaps { omitted }) => {
            eprintln!("complete: {omitted} rollout(s) intentionally omitted beside completed ones");
            Ok(0)
        }
        Err(error) => {
            eprintln!("{error}");
            Ok(error.exit_code())
        }
    }
}

#[derive(Debug, Args)]
pub struct ClassifyArgs {
    /// A results or failures JSONL file.
    file: PathBuf,
    /// A saved classification policy (default: the shared one).
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Treat timeouts stamped terminal as retryable (for agents whose older builds stamped
    /// per-attempt timeouts terminal).
    #[arg(long)]
    retry_terminal_timeouts: bool,
    /// Print every row's decision, one JSON line each.
    #[arg(long)]
    rows: bool,
}

pub fn classify(args: ClassifyArgs) -> anyhow::Result<i32> {
    let policy = match &args.policy {
        Some(path) => ClassificationPolicy::from_json(&read_file(path)?)?,
        None => ClassificationPolicy::default(),
    };
    let file = open_file(&args.file)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let print_rows = args.rows;
    let summary = recovery_core::classify::classify_jsonl(
        file,
        &args.file.display().to_string(),
        threads,
        &policy,
        args.retry_terminal_timeouts,
        |line, decision| {
            if print_rows {
                println!("{}", json!({"line": line, "decision": decision}));
            }
        },
    )?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(0)
}

pub fn digest(path: Option<PathBuf>, jsonl: bool) -> anyhow::Result<()> {
    let reader: Box<dyn std::io::Read + Send> = match path.as_deref() {
        None => Box::new(std::io::stdin()),
        Some(p) if p.as_os_str() == "-" => Box::new(std::io::stdin()),
        Some(p) => Box::new(open_file(p)?),
    };
    if jsonl {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        println!(
            "{}",
            recovery_core::materialized::materialized_digest(reader, threads)?.sha256
        );
    } else {
        let mut text = Vec::new();
        let mut reader = reader;
        reader.read_to_end(&mut text)?;
        let name = path
            .as_deref()
            .filter(|p| p.as_os_str() != "-")
            .map_or_else(|| "standard input".to_owned(), |p| p.display().to_string());
        match recovery_core::canonical::digest_text(&text) {
            Ok(digest) => println!("{digest}"),
            // As a bundle's: the key of a number no digest can be taken of (review 55).
            Err(error) => match number_refusal(&text) {
                Some(refusal) => bail!("{name}: {refusal}"),
                None => bail!("{name}: {error}"),
            },
        }
    }
    Ok(())
}

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The service's base URL.
    #[arg(
        long,
        env = "RR_URL",
        default_value = "http://127.0.0.1:8787",
        hide_env_values = true
    )]
    url: String,
    /// Bearer token.
    #[arg(long, env = "RR_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl ClientArgs {
    /// The URL of an endpoint under `--url`, each segment percent-encoded (a run id such as
    /// `../reindex#` stays one segment). A `--url` carrying credentials is refused without
    /// echoing it: they would be sent instead of the token, and printed with every error.
    fn endpoint(&self, segments: &[&str]) -> anyhow::Result<reqwest::Url> {
        let mut url = reqwest::Url::parse(self.url.trim_end_matches('/'))
            .map_err(|e| anyhow::anyhow!("--url: not a URL ({e})"))?;
        if !url.username().is_empty() || url.password().is_some() {
            bail!(
                "--url: credentials in the URL are not used; pass the token as RR_TOKEN or --token"
            );
        }
        url.path_segments_mut()
            .map_err(|()| anyhow::anyhow!("--url {:?} cannot hold a path", self.url))?
            .extend(segments);
        Ok(url)
    }

    fn request(&self, builder: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(token) => builder.bearer_auth(token),
            None => builder,
        }
    }
}

async fn answer(response: reqwest::Response) -> anyhow::Result<Value> {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        bail!(
            "{status}: {} ({})",
            body["message"].as_str().unwrap_or("no message"),
            body["code"].as_str().unwrap_or("no code")
        );
    }
    Ok(body)
}

#[derive(Debug, Args)]
pub struct ApproveArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// The run's id.
    #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    run: String,
    /// The masked attempt's task index (`_ng_task_index`).
    #[arg(long)]
    task: i64,
    /// Its rollout index (`_ng_rollout_index`).
    #[arg(long)]
    rollout: i64,
    /// Its attempt index (`_ng_attempt_index`), the execution number the masked answer came from.
    #[arg(long)]
    attempt: i64,
    /// Why this rerun is approved, kept in the audit log (required, not empty).
    #[arg(long)]
    reason: String,
}

pub async fn approve(args: ApproveArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let url = args.client.endpoint(&["runs", &args.run, "approvals"])?;
    let body = json!({"task_index": args.task, "rollout_index": args.rollout, "attempt_index": args.attempt, "reason": args.reason});
    let approval = answer(
        args.client
            .request(http.post(url).json(&body))
            .send()
            .await?,
    )
    .await?;
    println!("{}", serde_json::to_string_pretty(&approval)?);
    Ok(())
}

#[derive(Debug, Args)]
pub struct DriftArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// Only this run's events (a run id that is no run is refused).
    #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    run: Option<String>,
    /// Only events whose operational drift includes this dotted key.
    #[arg(long)]
    key: Option<String>,
    /// Only events at or after this RFC 3339 time (inclusive).
    #[arg(long)]
    from: Option<String>,
    /// Only events before this RFC 3339 time (exclusive).
    #[arg(long)]
    to: Option<String>,
    /// Events per page, 1 to 1000.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// The next page: the `next_cursor` of the page before, as printed (with `--follow`: a
    /// `follow_cursor`, to go on from there).
    #[arg(long)]
    cursor: Option<String>,
    /// `time` (default), `newest` (time order, newest first) or `recorded` (the order the
    /// service recorded the events in).
    #[arg(long)]
    order: Option<String>,
    /// Follow: print each matching event as one JSON line in the order the service records
    /// them, each once while the command runs, and keep asking for new ones until interrupted
    /// (across restarts see `--state`).
    #[arg(long, conflicts_with = "order")]
    follow: bool,
    /// Seconds between asks when following and nothing new is waiting.
    #[arg(long, default_value = "2", requires = "follow", value_parser = positive_seconds)]
    interval: std::time::Duration,
    /// When following, where to keep the follow cursor: read at start (unless `--cursor` is
    /// given) and replaced atomically after each page is printed, so a follower started again
    /// goes on where it stopped (at least once: a page printed just before a crash is printed
    /// again; drop repeated `event_id`s).
    #[arg(long, requires = "follow")]
    state: Option<std::path::PathBuf>,
}

fn positive_seconds(text: &str) -> Result<std::time::Duration, String> {
    text.parse::<f64>()
        .ok()
        .filter(|seconds| *seconds > 0.0)
        .and_then(|seconds| std::time::Duration::try_from_secs_f64(seconds).ok())
        .ok_or_else(|| format!("{text:?} is not a positive number of seconds"))
}

pub async fn drift(args: DriftArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let mut query: Vec<(&str, String)> = vec![("limit", args.limit.to_string())];
    for (name, value) in [
        ("key", &args.key),
        ("from", &args.from),
        ("to", &args.to),
        ("order", &args.order),
    ] {
        if let Some(value) = value {
            query.push((name, value.clone()));
        }
    }
    // A run's own list, so that a run id that is no run answers 404 instead of nothing.
    let url = match &args.run {
        Some(run) => args.client.endpoint(&["runs", run, "drift"])?,
        None => args.client.endpoint(&["drift"])?,
    }
    .to_string();
    if args.follow {
        return follow_drift(&args, &http, &url, query).await;
    }
    if let Some(cursor) = &args.cursor {
        query.push(("cursor", cursor.clone()));
    }
    let page = answer(
        args.client
            .request(http.get(url).query(&query))
            .send()
            .await?,
    )
    .await?;
    println!("{}", serde_json::to_string_pretty(&page)?);
    Ok(())
}

/// Replaces the `--state` file with `cursor` (empty: follow from the first event).
fn write_follow_state(state: &std::path::Path, cursor: Option<&str>) -> anyhow::Result<()> {
    let text = cursor.map(|c| format!("{c}\n")).unwrap_or_default();
    recovery_sidecar::atomic_write(state, text.as_bytes(), None)
        .with_context(|| format!("--state {}", state.display()))
}

/// `drift --follow`: pages in recorded order from `--cursor` (or the first event), printing
/// events as JSON lines; waits `--interval` whenever no more are waiting. A service that cannot
/// be reached is asked again (it may be restarting); a refusal ends the command.
async fn follow_drift(
    args: &DriftArgs,
    http: &reqwest::Client,
    url: &str,
    mut query: Vec<(&str, String)>,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    query.push(("order", "recorded".into()));
    // A cursor read from the state file: a refusal of it names the file and how to recover.
    let mut from_state = args.cursor.is_none() && args.state.is_some();
    let mut cursor = match (&args.cursor, &args.state) {
        (Some(cursor), _) => Some(cursor.clone()),
        (None, Some(state)) => match std::fs::read_to_string(state) {
            Ok(text) => Some(text.trim().to_owned()).filter(|c| !c.is_empty()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => bail!("--state {}: {e}", state.display()),
        },
        (None, None) => None,
    };
    if let Some(state) = &args.state {
        // Before anything is printed: a state file that cannot be kept is refused at once.
        write_follow_state(state, cursor.as_deref())?;
    }
    loop {
        let mut ask = query.clone();
        ask.extend(cursor.iter().map(|c| ("cursor", c.clone())));
        let sent = args.client.request(http.get(url).query(&ask)).send().await;
        let response = match sent {
            Ok(response) => response,
            Err(e) => {
                eprintln!("drift --follow: cannot reach {url} ({e}); asking again");
                tokio::time::sleep(args.interval).await;
                continue;
            }
        };
        if response.status() == reqwest::StatusCode::GONE {
            if let Some(state) = &args.state {
                // The cursor is of another numbering: kept, it would be refused at every start.
                write_follow_state(state, None)?;
            }
            let refusal = answer(response)
                .await
                .err()
                .unwrap_or_else(|| anyhow::anyhow!("410"));
            bail!(
                "{refusal}{}",
                if args.state.is_some() {
                    "; the state file was emptied: run again to follow from the first event \
                     (drop the event ids you already have)"
                } else {
                    ""
                }
            );
        }
        let refused_state = from_state && response.status().is_client_error();
        let page = match (answer(response).await, &args.state) {
            (Ok(page), _) => page,
            (Err(refusal), Some(state)) if refused_state => bail!(
                "{refusal}; the cursor {:?} was read from --state {}: remove that file (or empty \
                 it) to follow from the first event",
                cursor.as_deref().unwrap_or_default(),
                state.display()
            ),
            (Err(refusal), _) => return Err(refusal),
        };
        from_state = false;
        let mut stdout = std::io::stdout().lock();
        for event in page["events"].as_array().into_iter().flatten() {
            writeln!(stdout, "{}", serde_json::to_string(event)?)?;
        }
        stdout.flush()?;
        drop(stdout);
        let next = page["follow_cursor"]
            .as_str()
            .context("the service answered no follow_cursor (a release without order=recorded)")?
            .to_owned();
        if let Some(state) = &args.state {
            if cursor.as_deref() != Some(next.as_str()) {
                write_follow_state(state, Some(&next))?;
            }
        }
        cursor = Some(next);
        if page["next_cursor"].is_null() {
            tokio::time::sleep(args.interval).await;
        }
    }
}
