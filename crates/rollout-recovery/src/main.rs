//! `rollout-recovery`: the service (`serve`), its OpenAPI document (`openapi`), offline tools on
//! a run's files (`validate`, `plan`, `classify`, `identity`, `digest`) and operator client
//! commands (`approve`, `drift`). Every flag of `serve` is also an environment variable.

mod allocator;
mod offline;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use recovery_server::config::{ServerConfig, TokenEntry};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "rollout-recovery",
    version,
    about = "Resume authority for LLM evaluation and RL rollout collectors"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the HTTP service.
    Serve(ServeArgs),
    /// Write or check the OpenAPI document (default path: openapi/openapi.json).
    Openapi {
        #[arg(long, conflicts_with = "check")]
        write: bool,
        #[arg(long)]
        check: bool,
        #[arg(default_value = "openapi/openapi.json")]
        path: PathBuf,
    },
    /// Validate a resume offline against the files beside an output (exit 1 when refused); it
    /// reads the files and writes nothing.
    Validate(offline::ValidateArgs),
    /// Print the resume plan of an output (exit 0 complete; 75, 1 or 76 like IncompleteEvaluationError).
    Plan(offline::PlanArgs),
    /// Classify every row of a results or failures file and print counts.
    Classify(offline::ClassifyArgs),
    /// Print a configuration bundle's redacted identity and digests; with --against, the drift.
    Identity(offline::IdentityArgs),
    /// Print the canonical digest of a JSON document, or with --jsonl the materialized digest.
    Digest {
        /// File to read (`-` or absent: standard input).
        path: Option<PathBuf>,
        #[arg(long)]
        jsonl: bool,
    },
    /// Approve rerunning one masked attempt (operator client).
    Approve(offline::ApproveArgs),
    /// List resumes that crossed operational drift (client).
    Drift(offline::DriftArgs),
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// Address to listen on: `host:port`, the host an address or a name (`localhost:8787`).
    #[arg(long, env = "RR_BIND", default_value = "127.0.0.1:8787")]
    bind: String,
    /// Data directory (the SQLite database lives here).
    #[arg(long, env = "RR_DATA_DIR", default_value = "./rollout-recovery-data")]
    data_dir: PathBuf,
    /// Database URL (sqlite://... or postgres://...); default: SQLite in the data directory.
    #[arg(long, env = "RR_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Directories output paths must lie under (repeat, or comma-separated); default: <data-dir>/runs.
    #[arg(long = "root", env = "RR_ROOTS", value_delimiter = ',')]
    roots: Vec<PathBuf>,
    /// Bearer tokens as role:name:token, the token at least 16 characters (roles: viewer, collector, operator); none: unauthenticated, loopback only.
    #[arg(
        long = "token",
        env = "RR_TOKENS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    tokens: Vec<String>,
    /// Largest request body, in MiB.
    #[arg(long, env = "RR_BODY_LIMIT_MB", default_value_t = 64)]
    body_limit_mb: usize,
    /// Longest request, in seconds.
    #[arg(long, env = "RR_REQUEST_TIMEOUT_SECS", default_value_t = 120)]
    request_timeout_secs: u64,
    /// Attempt cap saved in new manifests (NEMO_GYM_MAX_ROLLOUT_ATTEMPTS is honoured when this is unset).
    #[arg(long, env = "RR_MAX_ROLLOUT_ATTEMPTS", value_parser = recovery_server::limits::parse_attempt_cap)]
    max_rollout_attempts: Option<u64>,
    /// Default lease lifetime, in seconds.
    #[arg(long, env = "RR_LEASE_TTL_SECS", default_value_t = 60)]
    lease_ttl_secs: u64,
    #[command(flatten)]
    drift_policy: offline::DriftPolicyArgs,
    /// This replica's name (default: host-pid).
    #[arg(long, env = "RR_REPLICA")]
    replica: Option<String>,
    /// Log format: text or json.
    #[arg(long, env = "RR_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

/// `_get_max_rollout_attempts()`: a positive int, else a warning and the default 3. A positive
/// int past the largest cap a run may have cannot be honoured: refused, as the service's own
/// flag is.
fn env_max_attempts() -> anyhow::Result<u64> {
    const DEFAULT: u64 = recovery_core::plan::DEFAULT_MAX_ROLLOUT_ATTEMPTS;
    let raw = match std::env::var("NEMO_GYM_MAX_ROLLOUT_ATTEMPTS") {
        Ok(raw) if !raw.is_empty() => raw,
        _ => return Ok(DEFAULT),
    };
    match raw.trim().parse::<i128>() {
        Ok(n) if n >= 1 => recovery_server::limits::parse_attempt_cap(&raw)
            .map_err(|e| anyhow::anyhow!("NEMO_GYM_MAX_ROLLOUT_ATTEMPTS: {e}")),
        _ => {
            tracing::warn!(
                value = %raw,
                "NEMO_GYM_MAX_ROLLOUT_ATTEMPTS is not an integer of 1 or more; using the default {DEFAULT}, as Python collectors do"
            );
            Ok(DEFAULT)
        }
    }
}

fn init_logging(json: bool) {
    let filter = match std::env::var("RR_LOG") {
        Err(_) => tracing_subscriber::EnvFilter::new("info"),
        Ok(text) => {
            // Said before logging starts: a filter that cannot be read is never silently info,
            // and a misspelt level (read as a module's name) never silently logs nothing.
            if let Some(word) = unknown_bare_word(&text) {
                eprintln!(
                    "warning: RR_LOG={text:?}: {word:?} is no level (off, error, warn, info, debug, trace) and is read as a module's name"
                );
            }
            tracing_subscriber::EnvFilter::try_new(&text).unwrap_or_else(|e| {
                eprintln!("warning: RR_LOG={text:?} is not a log filter ({e}); logging at info");
                tracing_subscriber::EnvFilter::new("info")
            })
        }
    }
    // The PostgreSQL driver warns of a URL parameter it ignores with its value, which may
    // be a password (the store refuses such URLs first; this holds whatever RR_LOG says).
    .add_directive(
        "sqlx_postgres::options::parse=error"
            .parse()
            .expect("static directive"),
    );
    // Colours only for a terminal: a log file or journal gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// The first directive of `filter` that is a bare word (no `=`) naming no level and no module of
/// this service or the crates it logs through: most likely a misspelt level (`inof`).
fn unknown_bare_word(filter: &str) -> Option<&str> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    const MODULES: [&str; 8] = [
        "rollout_recovery",
        "recovery_",
        "sqlx",
        "tower_http",
        "axum",
        "hyper",
        "tokio",
        "reqwest",
    ];
    filter.split(',').map(str::trim).find(|word| {
        !word.is_empty()
            && !word.contains(['=', '[', ':'])
            && !LEVELS.contains(&word.to_ascii_lowercase().as_str())
            && word.parse::<u8>().is_err()
            && !MODULES.iter().any(|m| word.starts_with(m))
    })
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    init_logging(args.log_format == "json");
    recovery_server::state::when_heavy_work_idles(allocator::give_back_all);
    let mut config = ServerConfig::local(args.data_dir.clone());
    config.bind = resolve_bind(&args.bind).await?;
    config.database_url = args.database_url;
    if !args.roots.is_empty() {
        config.roots = args.roots;
    }
    config.tokens = args
        .tokens
        .iter()
        .filter(|t| !t.is_empty())
        .map(|t| TokenEntry::parse(t))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    config.body_limit_bytes = args.body_limit_mb * 1024 * 1024;
    config.request_timeout = Duration::from_secs(args.request_timeout_secs);
    // Both are bounded as the cap a POST /runs may set is.
    config.default_max_attempts = match args.max_rollout_attempts {
        Some(n) => n,
        None => env_max_attempts()?,
    };
    config.default_lease_ttl = Duration::from_secs(args.lease_ttl_secs);
    config.drift_policy = args.drift_policy.policy();
    if let Some(replica) = args.replica {
        config.replica = replica;
    }
    let bind = config.bind;
    let authenticated = !config.tokens.is_empty();
    let socket = reserve(bind).with_context(|| format!("cannot listen on {bind}"))?;
    let state = recovery_server::open(config, recovery_server::system_clock()).await?;
    let listener = socket
        .listen(1024)
        .with_context(|| format!("cannot listen on {bind}"))?;
    // Listening while start-up reindexes: `/healthz` answers, `/readyz` once it is done.
    tracing::info!(address = %listener.local_addr()?, authenticated, "rollout-recovery listening; starting");
    recovery_server::serve_starting(listener, state, shutdown_signal()).await?;
    tracing::info!("stopped");
    Ok(())
}

/// The address `bind`, taken before the service opens its database or any file, so a port in
/// use fails the start at once and leaves nothing behind (no database file made, migrated and
/// reindexed, no live lease taken over for a process about to exit). Listened on once the
/// database is open: connections are answered from then on (503 `starting` until start-up's
/// reindex is done), never left waiting in the backlog.
fn reserve(bind: SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    let socket = if bind.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restart binds while the last run's connections linger.
    socket.set_reuseaddr(true)?;
    socket.bind(bind)?;
    Ok(socket)
}

/// The address `--bind` names. A name resolving to several addresses listens on its first IPv4
/// one (`localhost` is 127.0.0.1 then, where most clients look first); the loopback rule of an
/// unauthenticated service is checked on the address actually bound.
async fn resolve_bind(text: &str) -> anyhow::Result<SocketAddr> {
    let addresses: Vec<SocketAddr> = tokio::net::lookup_host(text)
        .await
        .with_context(|| format!("--bind {text:?} (RR_BIND): expected host:port"))?
        .collect();
    addresses
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addresses.first())
        .copied()
        .with_context(|| format!("--bind {text:?} (RR_BIND): the name resolves to no address"))
}

async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = interrupt => {},
        () = terminate => {},
    }
    tracing::info!("shutting down: draining requests, then releasing leases");
}

fn openapi(write: bool, check: bool, path: PathBuf) -> anyhow::Result<()> {
    let current = recovery_server::openapi_json();
    if write {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        recovery_sidecar::atomic_write(&path, current.as_bytes(), None)
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("wrote {}", path.display());
        return Ok(());
    }
    if check {
        let committed = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if committed != current {
            anyhow::bail!(
                "{} is out of date: run `rollout-recovery openapi --write`",
                path.display()
            );
        }
        println!("{} is up to date", path.display());
        return Ok(());
    }
    print!("{current}");
    Ok(())
}

fn main() -> std::process::ExitCode {
    // First, before anything opens a database (SQLite is configured only before first use).
    if let Err(code) = allocator::quiet_sqlite_statistics() {
        eprintln!("warning: SQLite refused to stop counting its memory (code {code})");
    }
    if let Err(code) = allocator::widen_sqlite_lookaside() {
        eprintln!("warning: SQLite refused its lookaside configuration (code {code})");
    }
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve(_)) {
        end_by_sigpipe();
    }
    // TLS to PostgreSQL checks certificates with the process's crypto provider: named here, so
    // it never depends on which providers the build's crates happen to enable (two make
    // rustls refuse to choose).
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Blocking work (file reads, digests, plan builds, journal writes) is short or bounded by
    // the service's heavy-work limits; a few threads per core keep the cores busy, while every
    // extra thread keeps its own allocator heap (measured: ~4.5 MB of RSS each under load).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(4 * cores.max(2))
        // JSON nests up to 512 levels on every entry point; parsing and digesting that deep
        // recurses, and a debug build's frames are large: room for it on every thread.
        .thread_stack_size(recovery_server::THREAD_STACK_BYTES)
        // An idle blocking thread ends soon and gives its memory back as it does (see
        // `allocator`): RSS one second after the rows-1000 load fell from 116 to 65 MB.
        .thread_keep_alive(std::time::Duration::from_millis(500))
        .on_thread_stop(allocator::give_back_all)
        .on_thread_park(allocator::give_back_when_idle)
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result: anyhow::Result<i32> = runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve(args).await.map(|()| 0),
            Command::Openapi { write, check, path } => openapi(write, check, path).map(|()| 0),
            Command::Validate(args) => offline::validate(args),
            Command::Plan(args) => offline::plan(args),
            Command::Classify(args) => offline::classify(args),
            Command::Identity(args) => offline::identity(args),
            Command::Digest { path, jsonl } => offline::digest(path, jsonl).map(|()| 0),
            Command::Approve(args) => offline::approve(args).await.map(|()| 0),
            Command::Drift(args) => offline::drift(args).await.map(|()| 0),
        }
    });
    // Blocking work still running (a file read that never returns, such as a FIFO opened by
    // code that should not have) must not keep a stopped service alive: wait a little for it,
    // then exit; SQLite's log makes an interrupted transaction roll back at the next open.
    runtime.shutdown_timeout(SHUTDOWN_GRACE);
    match result {
        Ok(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
        // 2, as for bad arguments: a command that could not run is told apart from the answers
        // its exit codes carry (1: a refused resume, a run that completed nothing).
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            std::process::ExitCode::from(2)
        }
    }
}

/// How long the process waits, once a command is done, for blocking work still running.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A command whose reader went away (`validate ... | head`) ends as Unix tools do, by SIGPIPE,
/// instead of panicking in `println!`. The service keeps Rust's default (ignored): a client
/// that goes away must never end it.
#[allow(unsafe_code)]
fn end_by_sigpipe() {
    // SAFETY: called before any other thread exists; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// `error` and its causes as one line, each said once: a message that already quotes its
/// cause (the database driver's and the file system's do) is not followed by it again.
fn one_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}
