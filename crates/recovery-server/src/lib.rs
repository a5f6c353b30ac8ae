//! The rollout-recovery HTTP service: collectors validate resumes before they start, dashboards
//! read drift history, operators approve reruns, and the service owns each run's lock.
//!
//! - [`app`]: the router (tests drive it in process with `oneshot`).
//! - [`start`]: connect the store, reindex the sidecars, and build the state: [`open`] (before
//!   listening: the store, stale temporaries, interrupted replacements, expired and live
//!   leases) then [`catch_up`] (the reindex; the state is ready after it).
//! - [`serve`]: listen until shutdown; live leases are kept, and taken again by the next start.
//!   [`serve_starting`]: the same for a state [`open`] returned, running [`catch_up`] while it
//!   listens (every route but `/healthz`, `/readyz`, `/metrics` and `/openapi.json` answers 503
//!   `starting` until then).
//! - [`openapi`]: the OpenAPI document (committed at `openapi/openapi.json`).

pub mod api_doc;
pub mod config;
mod connection;
pub mod error;
pub mod limits;
pub mod routes;
pub mod state;
pub mod ui;

use api_doc::{CommonResponses, Links};
use axum::Router;
use axum::body::Body;
use axum::extract::{MatchedPath, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use config::ServerConfig;
use recovery_runs::{Clock, Registry, SystemClock};
use recovery_sidecar::Confinement;
use recovery_store::Store;
use state::AppState;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "rollout-recovery", description = "Resume authority for LLM evaluation and RL rollout collectors: manifests, resume validation, drift history, failure classification, approvals and run leases. Every error body is {code, message, details}."),
    paths(
        routes::runs::create_run, routes::runs::import_legacy, routes::runs::validate, routes::runs::list_runs, routes::runs::get_run, routes::runs::list_validations,
        routes::query::drift, routes::query::run_drift, routes::query::classify, routes::query::plan,
        routes::ops::approve, routes::ops::list_approvals, routes::ops::revoke_approval,
        routes::ops::extend, routes::ops::resubmit, routes::ops::reserve, routes::ops::check_outcome,
        routes::ops::admit_rejudgment, routes::ops::close_rejudgment,
        routes::leases::acquire, routes::leases::heartbeat, routes::leases::release, routes::leases::holder, routes::leases::takeover,
        routes::audit::audit, routes::system::reindex, routes::system::healthz, routes::system::readyz, routes::system::metrics, routes::system::openapi,
    ),
    components(schemas(error::ApiErrorBody, error::ErrorCode, error::ResumeRefusedDetails, error::KeyView, error::KeyReason, error::LeaseHolder, routes::query::DriftOrder)),
    modifiers(&BearerAuth, &CommonResponses, &Links),
    tags(
        (name = "runs", description = "Create runs and validate resumes"),
        (name = "drift", description = "Resumes that crossed operational drift"),
        (name = "classification", description = "Failure responsibility and the resume plan"),
        (name = "approvals", description = "Operator approvals of masked reruns"),
        (name = "attempts", description = "Attempt caps, resubmits and reservations"),
        (name = "rejudgments", description = "Judge-only re-judgments"),
        (name = "leases", description = "Run ownership"),
        (name = "system", description = "Health, readiness, metrics, this document"),
    )
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        openapi.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
            "bearer",
            Vec::<String>::new(),
        )]);
    }
}

/// The stack of every thread that parses or digests request JSON (512 levels deep, debug build
/// included): the runtime's threads and the heavy-work threads.
pub const THREAD_STACK_BYTES: usize = 32 << 20;

/// The OpenAPI document of this service.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    doc
}

/// The OpenAPI document as committed (pretty JSON with a trailing newline).
pub fn openapi_json() -> String {
    let mut text = serde_json::to_string_pretty(&openapi_value()).unwrap_or_default();
    text.push('\n');
    text
}

/// The OpenAPI document as served and committed. (utoipa 5.5 writes a link's `operationId` and
/// `requestBody` in snake case; they are renamed here, the one place the document is emitted.)
pub fn openapi_value() -> serde_json::Value {
    let mut doc = serde_json::to_value(openapi()).unwrap_or_default();
    api_doc::fix_link_field_names(&mut doc);
    doc
}

/// A body declared larger than the service accepts is refused (413) from its headers, before
/// routing; its sender is authenticated first, so a caller without a valid token is told only
/// that (401), as for any other call. (Its role is checked by the route, after the 413.) The
/// console authenticates by its session cookie, on its own routes.
async fn authenticate_oversized(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let oversized = declared.is_some_and(|n| n > state.config.body_limit_bytes as u64);
    if oversized && !request.uri().path().starts_with("/ui/") {
        let authorization = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if let Err(refused) = state.config.authenticate(authorization) {
            use axum::response::IntoResponse as _;
            return refused.into_response();
        }
    }
    next.run(request).await
}

/// Until start-up is done ([`catch_up`]) only the routes that do not read runs are answered
/// (`/healthz`, `/readyz`, `/metrics`, `/openapi.json`); every other request is refused 503
/// `starting` with `Retry-After`, rather than answered from a database that has not caught up
/// with the sidecars (a run not yet adopted would be 404, a live lease not yet taken again
/// would be granted to another collector).
async fn while_starting(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if state.is_ready() || api_doc::OPEN_ROUTES.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    use axum::response::IntoResponse as _;
    error::ApiError::new(
        error::ErrorCode::Starting,
        "the service is starting (reindexing the sidecars under its roots); retry after the \
         Retry-After seconds, or wait for GET /readyz to answer 200",
    )
    .into_response()
}

/// Without tokens the service answers anyone who reaches its loopback address, so it answers
/// only requests that name a loopback host: a web page whose name was rebound to 127.0.0.1 (DNS
/// rebinding) sends its own name as `Host` and is refused, never driving the API or the console.
/// Likewise a change (any method but GET, HEAD and OPTIONS) sent by a web page of another site
/// (its `Origin` is not a loopback origin) is refused: a browser sends a plain form post or a
/// body-less POST such as `/reindex` across sites without asking first.
async fn loopback_host_only(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if !state.config.tokens.is_empty() {
        return next.run(request).await;
    }
    // Every `Host` a request carries, and the authority of an absolute-form target, must name
    // the loopback: not only the first (hostile review 55, F15: a second `Host`, or
    // `GET http://other.example/runs`, was answered). Likewise every `Origin` of a change.
    let named_hosts = request
        .headers()
        .get_all(axum::http::header::HOST)
        .iter()
        .map(|h| h.to_str().unwrap_or("\u{fffd}").to_owned())
        .chain(request.uri().authority().map(|a| a.as_str().to_owned()));
    let mut foreign_hosts = named_hosts.filter(|host| !names_loopback(host));
    let host = foreign_hosts.next();
    let foreign_origin = !request.method().is_safe()
        && request
            .headers()
            .get_all(axum::http::header::ORIGIN)
            .iter()
            .any(|origin| !is_loopback_origin(origin.to_str().unwrap_or("null")));
    if foreign_origin {
        use axum::response::IntoResponse as _;
        return error::ApiError::new(
            error::ErrorCode::Forbidden,
            "a change sent by a web page of another site (its Origin is not a loopback origin) \
             is refused: without tokens this service takes changes only from localhost, \
             127.0.0.1 or [::1]",
        )
        .into_response();
    }
    match host {
        Some(host) => {
            use axum::response::IntoResponse as _;
            error::ApiError::new(
                error::ErrorCode::Forbidden,
                format!(
                    "Host {host:?} is not a loopback name: without tokens this service answers \
                     only requests to localhost, 127.0.0.1 or [::1]"
                ),
            )
            .into_response()
        }
        None => next.run(request).await,
    }
}

/// Whether an `Origin` header is `http(s)://` and a loopback host (`null`, from a sandboxed or
/// local-file page, is not).
fn is_loopback_origin(origin: &str) -> bool {
    origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .is_some_and(names_loopback)
}

/// Whether a `Host` header (with or without its port) names this machine's loopback.
fn names_loopback(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                name
            } else {
                host
            }
        }),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

async fn record_metrics(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = request.method().to_string();
    let started = Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("rollout_recovery_http_requests_total", "method" => method.clone(), "route" => route.clone(), "status" => status).increment(1);
    metrics::histogram!("rollout_recovery_http_request_seconds", "method" => method, "route" => route).record(started.elapsed().as_secs_f64());
    response
}

/// The service's router.
pub fn app(state: AppState) -> Router {
    let limit = state.config.body_limit_bytes;
    let timeout = state.config.request_timeout;
    // Operations that take no query parameters refuse any (a misspelt option is not ignored).
    let without_query = Router::new()
        .route("/runs", post(routes::runs::create_run))
        .route("/runs/import_legacy", post(routes::runs::import_legacy))
        .route("/runs/{run_id}", get(routes::runs::get_run))
        .route("/runs/{run_id}/validate", post(routes::runs::validate))
        .route("/classify", post(routes::query::classify))
        .route(
            "/runs/{run_id}/approvals",
            post(routes::ops::approve).get(routes::ops::list_approvals),
        )
        .route(
            "/runs/{run_id}/approvals/{approval_id}",
            axum::routing::delete(routes::ops::revoke_approval),
        )
        .route("/runs/{run_id}/attempts/extend", post(routes::ops::extend))
        .route(
            "/runs/{run_id}/attempts/resubmit",
            post(routes::ops::resubmit),
        )
        .route(
            "/runs/{run_id}/attempts/reserve",
            post(routes::ops::reserve),
        )
        .route(
            "/runs/{run_id}/outcomes/check",
            post(routes::ops::check_outcome),
        )
        .route(
            "/runs/{run_id}/rejudgments",
            post(routes::ops::admit_rejudgment),
        )
        .route(
            "/runs/{run_id}/rejudgments/{operation_id}/close",
            post(routes::ops::close_rejudgment),
        )
        .route(
            "/runs/{run_id}/lease",
            post(routes::leases::acquire)
                .get(routes::leases::holder)
                .delete(routes::leases::release),
        )
        .route(
            "/runs/{run_id}/lease/heartbeat",
            post(routes::leases::heartbeat),
        )
        .route(
            "/runs/{run_id}/lease/takeover",
            post(routes::leases::takeover),
        )
        .route("/reindex", post(routes::system::reindex))
        .route_layer(middleware::from_fn(error::refuse_query));
    Router::new()
        .route("/runs", get(routes::runs::list_runs))
        .route("/runs/{run_id}/drift", get(routes::query::run_drift))
        .route(
            "/runs/{run_id}/validations",
            get(routes::runs::list_validations),
        )
        .route("/drift", get(routes::query::drift))
        .route("/runs/{run_id}/plan", get(routes::query::plan))
        .route("/audit", get(routes::audit::audit))
        .route("/healthz", get(routes::system::healthz))
        .route("/readyz", get(routes::system::readyz))
        .route("/metrics", get(routes::system::metrics))
        .route("/openapi.json", get(routes::system::openapi))
        .merge(without_query)
        .merge(ui::router())
        .fallback(error::fallback)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            while_starting,
        ))
        .layer(middleware::from_fn(record_metrics))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            loopback_host_only,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(RequestBodyLimitLayer::new(limit))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            authenticate_oversized,
        ))
        .layer(TimeoutLayer::with_status_code(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            timeout,
        ))
        // Outermost: plain-text answers of the layers above come out in the error shape.
        .layer(middleware::map_response(error::in_error_shape))
        // Outermost: an oversized head is refused, and every answer, the refusals above
        // included, says whether the connection is kept (see `connection`).
        .layer(middleware::from_fn_with_state(
            limit.saturating_mul(2),
            connection::outermost,
        ))
        .with_state(state)
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(String),
    #[error("cannot prepare {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Path(#[from] recovery_sidecar::PathError),
    #[error(transparent)]
    Store(#[from] recovery_store::StoreError),
    #[error(transparent)]
    Registry(#[from] recovery_runs::RegistryError),
}

/// Connects the store (migrating it), reindexes the sidecars under the roots, builds the state:
/// [`open`] then [`catch_up`], for a service that is ready when it starts listening.
pub async fn start(config: ServerConfig, clock: Arc<dyn Clock>) -> Result<AppState, StartError> {
    let state = open(config, clock).await?;
    catch_up(&state).await?;
    Ok(state)
}

/// The first part of start-up, before the service listens: checks the configuration, connects
/// the store (migrating it), makes the directories, removes stale temporaries, finishes or rolls
/// back interrupted replacements, ends the leases that expired while the service was down and
/// takes the live ones' locks again (each quick, and each needed before any request touches a
/// run, or before a collector's `flock` could take a leased run). The state is not ready
/// ([`AppState::is_ready`]) until [`catch_up`] has run.
pub async fn open(config: ServerConfig, clock: Arc<dyn Clock>) -> Result<AppState, StartError> {
    config.check().map_err(StartError::Config)?;
    refuse_file_system_root(&config.roots)?;
    // The embedded database is made in the data directory; every other directory waits until
    // the database is reached, so a start refused there (PostgreSQL down, the database owned
    // by another process) leaves nothing behind.
    if config.database_url.is_none() {
        create_dir(&config.data_dir)?;
    }
    let store = Store::connect(&config.database_url()).await?;
    for dir in std::iter::once(&config.data_dir).chain(config.roots.iter()) {
        let made = !dir.exists();
        create_dir(dir)?;
        // A mistyped root, or one on a file system not mounted yet, starts with no runs:
        // said loudly (hostile review 55, F8), since runs created now land in the new one.
        if made && config.roots.contains(dir) {
            tracing::warn!(
                root = %dir.display(),
                "a root that did not exist was created: no runs are under it; if the runs are \
                 elsewhere (a mistyped --root, a file system not mounted yet), stop and correct it"
            );
        }
    }
    // A root made just now is resolved only now (`--root /tmp/new/..`).
    refuse_file_system_root(&config.roots)?;
    let registry = Registry::new(
        store,
        Confinement::new(config.roots.clone())?,
        clock,
        config.replica.clone(),
    );
    // Each path is named: an operator finds what went (a file of theirs, named like a run's
    // temporary and older than this start, would be among them).
    for path in registry.remove_stale_temporaries(started_at()).await? {
        tracing::info!(
            path = %path.display(),
            "removed a temporary left by an interrupted atomic write"
        );
    }
    for (output, rolled_back) in registry.recover_replacements().await? {
        let outcome = if rolled_back {
            "rolled back"
        } else {
            "completed"
        };
        tracing::warn!(output = %output.display(), outcome, "recovered a replacement a crash interrupted");
    }
    match registry.leases().end_expired_while_down().await {
        Ok(ended) => {
            for lease in ended {
                tracing::info!(run_id = %lease.run_id, holder = %lease.holder, expired_at = %lease.expires_at, "a lease expired while the service was down; ended");
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "leases that expired while the service was down could not be ended")
        }
    }
    // Live leases survive a restart: their collectors keep the runs they were granted. Their
    // locks are taken again first, before the reindex, so nobody takes a run meanwhile (hostile
    // review 50, F5: a collector's `flock` took one during a long start-up).
    adopt_live_leases(&registry).await;
    let leases = registry.leases().clone();
    Ok(AppState::new(state::Shared {
        config: Arc::new(config),
        registry,
        leases,
        metrics: state::metrics_handle(),
        heavy: Arc::new(state::HeavyWork::for_this_machine()),
        plans: Arc::new(state::HeavyWork::plans_for_this_machine()),
        ready: Arc::default(),
    }))
}

/// The rest of start-up, which may take seconds (a million journal lines, about five): brings
/// the database up to date with the sidecars under the roots; then marks the state ready. A
/// service may listen meanwhile ([`serve_starting`]): it answers `/healthz`, and 503 `starting`
/// to everything that reads or changes runs.
pub async fn catch_up(state: &AppState) -> Result<(), StartError> {
    let registry = &state.registry;
    let reindex_started = Instant::now();
    let report = registry.reindex_at_start().await?;
    tracing::info!(
        manifests = report.manifests,
        runs = report.runs,
        drift = report.drift_inserted,
        approvals = report.approvals_inserted,
        superseded = report.superseded.len(),
        unreadable = report.unreadable.len(),
        seconds = reindex_started.elapsed().as_secs_f64(),
        "reindexed sidecars"
    );
    if report.drift_inserted > 0 {
        // Drift the database lacked: a crash between a journal and its row, lines a collector
        // wrote while the service was down, or a restored older backup, whose positions past
        // its head are numbered again. Followers cannot be told apart, so all start afresh.
        registry.store().renumber_drift_followers().await?;
        tracing::info!(
            drift = report.drift_inserted,
            "drift indexed at start: recorded-order cursors handed out before now answer cursor_expired"
        );
    }
    for (previous, run_id) in &report.superseded {
        tracing::warn!(
            previous,
            run_id,
            "a manifest on disk superseded the run recorded for its output"
        );
    }
    for (path, reason) in &report.unreadable {
        tracing::warn!(path, reason, "unreadable sidecar left as it is");
    }
    state.mark_ready();
    tracing::info!(seconds = reindex_started.elapsed().as_secs_f64(), "ready");
    Ok(())
}

fn create_dir(dir: &std::path::Path) -> Result<(), StartError> {
    std::fs::create_dir_all(dir).map_err(|source| StartError::Io {
        path: dir.display().to_string(),
        source,
    })
}

/// `--root /tmp/..` or a link to `/` is the file system root too: every start would read it.
fn refuse_file_system_root(roots: &[std::path::PathBuf]) -> Result<(), StartError> {
    match roots
        .iter()
        .find(|root| std::fs::canonicalize(root).is_ok_and(|r| r.parent().is_none()))
    {
        Some(root) => Err(StartError::Config(format!(
            "--root {}: resolves to the file system root, which cannot be a root of runs",
            root.display()
        ))),
        None => Ok(()),
    }
}

/// Takes again the locks of live leases nobody holds: at the start, this service's own from
/// before it stopped; while serving among replicas, those of a replica that stopped. Never
/// fatal: a lease that cannot be taken is left as if it had been lost.
pub async fn adopt_live_leases(registry: &recovery_runs::Registry) {
    let confinement = registry.confinement().clone();
    let confined = move |path: &std::path::Path| {
        confinement
            .resolve(path)
            .is_ok_and(|resolved| resolved == path)
    };
    match registry.leases().adopt_live(confined).await {
        Ok(adopted) => {
            for lease in adopted {
                tracing::info!(run_id = %lease.run_id, holder = %lease.holder, replica = %lease.replica, expires_at = %lease.expires_at, "a live lease's locks taken again");
            }
        }
        Err(e) => tracing::warn!(error = %e, "live leases could not be taken again"),
    }
}

/// Sweeps between two tries to take the locks of a stopped replica's live leases.
const ADOPT_EVERY: u64 = 5;

/// Serves on `listener` until `shutdown` resolves; then drains requests and releases leases.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let sweeper_state = state.clone();
    let sweeper = tokio::spawn(async move {
        // Start-up ends expired leases and adopts live ones itself; sweeps begin after it.
        sweeper_state.until_ready().await;
        let mut tick = tokio::time::interval(sweeper_state.config.sweep_interval);
        for round in 0u64.. {
            tick.tick().await;
            // A replica that stopped left its live leases' locks free: taken here, every
            // fifth sweep (each try opens and locks every live lease's file another replica
            // holds; letting go of ended leases is what needs every sweep).
            if sweeper_state.leases.shares_database() && round % ADOPT_EVERY == 0 {
                adopt_live_leases(&sweeper_state.registry).await;
            }
            // Each expiry is logged where the lease is ended (`Leases::end_if_expired`), once.
            if let Err(e) = sweeper_state.leases.sweep().await {
                tracing::warn!(error = %e, "lease sweep failed");
            }
        }
    });
    let result = serve_connections(listener, app(state.clone()), shutdown, &state.config).await;
    sweeper.abort();
    // Live leases are kept: their locks are released with this process and taken again by the
    // next start (a restart is invisible to their collectors); a lease whose collector is gone
    // expires after its TTL as it would have.
    let kept = state.leases.held_count();
    if kept > 0 {
        tracing::info!(
            kept,
            "live leases kept for the next start; their locks are released with this process"
        );
    }
    state.registry.store().close().await;
    result
}

/// Why a service that listened during its start-up stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("start-up failed: {0}")]
    Start(#[from] StartError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// [`serve`] for a state [`open`] returned: listens at once and runs [`catch_up`] meanwhile, so
/// a supervisor sees a live process (`/healthz`) and waits on `/readyz` while the sidecars are
/// reindexed, and clients are answered 503 `starting` with `Retry-After` instead of a refused
/// connection. A start-up that fails stops the service (requests in progress drain) and is the
/// error returned.
pub async fn serve_starting(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let (failed, start_failed) = tokio::sync::oneshot::channel::<()>();
    let starting = state.clone();
    let start_up = tokio::spawn(async move {
        let caught_up = catch_up(&starting).await;
        if let Err(e) = &caught_up {
            tracing::error!(error = %e, "start-up failed; stopping");
            let _ = failed.send(());
        }
        caught_up
    });
    let stop = async move {
        tokio::select! {
            () = shutdown => {}
            Ok(()) = start_failed => {}
        }
    };
    let served = serve(listener, state, stop).await;
    // A stop asked for during start-up abandons it: each of its steps commits on its own and a
    // reindex begun again at the next start reads from the marks it left.
    start_up.abort();
    match start_up.await {
        Ok(Err(e)) => Err(ServeError::Start(e)),
        // Done, or abandoned by the stop.
        Ok(Ok(())) | Err(_) => Ok(served?),
    }
}

/// A client has this long to send a request's head (the request line and headers) once it
/// starts, or once a connection it keeps is idle: a connection that sends a head slowly (or
/// half of one, and stops) is closed, and an idle kept connection closes after it.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(60);

/// Accepts connections until `shutdown` resolves, then lets the open ones finish: each answers
/// what it is answering and closes. Those still open after the longest a request may run (the
/// request timeout, and the time an unread body is read on: [`connection::LINGER`]) are
/// dropped, so one client (a head half sent, a body trickling in) never keeps a stopping service
/// and its leases' locks alive (hostile review 43: a stop waited 200 s on a half-sent head).
/// (`axum::serve` does the same without the two bounds.)
async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    config: &ServerConfig,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service =
            hyper_util::service::TowerToHyperService::new(tower::ServiceExt::map_request(
                app.clone(),
                |request: Request<hyper::body::Incoming>| request.map(Body::new),
            ));
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEAD_TIMEOUT)
            .serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let grace = config.request_timeout + connection::LINGER;
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            grace_secs = grace.as_secs(),
            "connections still open when stopping; closed without their answers"
        );
    }
    Ok(())
}

/// After a failed `accept`: a connection that went away before it was accepted is nothing;
/// anything else (no file descriptors left) is logged and waited out a moment, as
/// `axum::serve` does, instead of spinning.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "accepting a connection failed");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// When this process started (the first call is made at start-up): temporaries older than this
/// were left by a process that is gone.
fn started_at() -> std::time::SystemTime {
    static STARTED: std::sync::OnceLock<std::time::SystemTime> = std::sync::OnceLock::new();
    *STARTED.get_or_init(std::time::SystemTime::now)
}

/// The system clock, for `start`.
pub fn system_clock() -> Arc<dyn Clock> {
    Arc::new(SystemClock)
}
